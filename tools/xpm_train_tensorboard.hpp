// TensorBoard event files of a training run's scalars, for `xpm-train report --tensorboard`.
//
//   write_tensorboard_events(metrics, "runs/tagger/report/tensorboard");
//   // tensorboard --logdir runs/tagger/report/tensorboard
//
// Format (TensorFlow's tensorflow/core/util/event.proto and the TFRecord framing of
// tensorflow/core/lib/io/record_writer.cc): each record is
//   uint64 length (little-endian), uint32 masked_crc32c(length bytes), length bytes of data,
//   uint32 masked_crc32c(data),
// with masked_crc32c(x) = ((c >> 15) | (c << 17)) + 0xa282ead8 for c = CRC-32C (Castagnoli) of x.
// The data is a serialized tensorboard Event: the first {wall_time, step 0, file_version
// "brain.Event:2"}, then one Event {wall_time, step, summary {value {tag, simple_value}}} per
// scalar. The messages are built with protobuf's DynamicMessage from a descriptor of the needed
// subset of event.proto/summary.proto (same field numbers and types), so no protoc is needed.
//
// Tags: train/loss, train/tokens_per_s, memory/peak_allocated_bytes,
// memory/predicted_peak_bytes, memory/capacity_bytes, validation/token_accuracy,
// validation/loss (simple_value is a float32, as TensorBoard stores it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "xpm_train_report.hpp"

namespace xpm {

/// CRC-32C (Castagnoli polynomial 0x1EDC6F41, reflected, init and final xor 0xFFFFFFFF) of
/// `size` bytes: Boost.CRC's crc_optimal. Check value: "123456789" -> 0xE3069283.
std::uint32_t crc32c(const void* data, std::size_t size);

/// TFRecord's masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8 (mod 2^32).
std::uint32_t masked_crc32c(const void* data, std::size_t size);

/// One scalar as TensorBoard stores it.
struct TensorboardScalar {
  double wall_time_s = 0;  // seconds since the Unix epoch
  std::int64_t step = 0;
  std::string tag;
  float value = 0;
};

/// A serialized Event holding one scalar (summary { value { tag, simple_value } }).
std::string serialize_scalar_event(const TensorboardScalar& scalar);

/// The scalars of `metrics` (tags above), all stamped with `wall_time_s`, in step order per tag.
std::vector<TensorboardScalar> tensorboard_scalars(const TrainMetrics& metrics,
                                                   double wall_time_s);

/// Writes `dir`/events.out.tfevents.<seconds>.xpm-train (atomically: temp + rename): the
/// file_version event, then every scalar. Returns the file's path. `wall_time_s` < 0: now.
/// Throws std::runtime_error naming the path when it cannot write.
std::string write_tensorboard_events(const TrainMetrics& metrics, const std::string& dir,
                                     double wall_time_s = -1);

/// What a TensorBoard event file holds, read back with both CRCs of every record checked.
struct TensorboardEventFile {
  std::string file_version;                // from the first event
  std::vector<TensorboardScalar> scalars;  // every scalar event, in file order
};

/// Reads an event file written as above. Throws std::runtime_error naming the path and the
/// record's byte offset on a short record, a length or data CRC mismatch or an unparsable Event.
TensorboardEventFile read_tensorboard_events(const std::string& path);

}  // namespace xpm
