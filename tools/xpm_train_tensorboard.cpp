// TensorBoard event files (see xpm_train_tensorboard.hpp).
#include "xpm_train_tensorboard.hpp"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>
#include <google/protobuf/dynamic_message.h>
#include <google/protobuf/message.h>

#include <boost/crc.hpp>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "xpm/planner/atomic_file.hpp"

namespace xpm {
namespace {

namespace pb = google::protobuf;

/// The subset of tensorboard's event.proto and summary.proto that scalars need, with the same
/// field numbers and wire types:
///   message Summary { message Value { string tag = 1; float simple_value = 2; }
///                     repeated Value value = 1; }
///   message Event { double wall_time = 1; int64 step = 2; string file_version = 3;
///                   Summary summary = 5; }
/// Declared proto2 so that a set field is written even when it is zero: upstream,
/// simple_value is in a oneof (always written when set); here presence gives the same bytes.
class EventSchema {
 public:
  static const EventSchema& get() {
    static const EventSchema schema;
    return schema;
  }

  std::unique_ptr<pb::Message> new_event() const {
    return std::unique_ptr<pb::Message>(factory_.GetPrototype(event_)->New());
  }

  const pb::Descriptor* event_ = nullptr;
  const pb::FieldDescriptor* wall_time_ = nullptr;
  const pb::FieldDescriptor* step_ = nullptr;
  const pb::FieldDescriptor* file_version_ = nullptr;
  const pb::FieldDescriptor* summary_ = nullptr;
  const pb::FieldDescriptor* value_ = nullptr;         // Summary.value
  const pb::FieldDescriptor* tag_ = nullptr;           // Summary.Value.tag
  const pb::FieldDescriptor* simple_value_ = nullptr;  // Summary.Value.simple_value

 private:
  static void add_field(pb::DescriptorProto* message, const char* name, int number,
                        pb::FieldDescriptorProto::Type type,
                        pb::FieldDescriptorProto::Label label =
                            pb::FieldDescriptorProto::LABEL_OPTIONAL,
                        const char* type_name = nullptr) {
    pb::FieldDescriptorProto* field = message->add_field();
    field->set_name(name);
    field->set_number(number);
    field->set_type(type);
    field->set_label(label);
    if (type_name != nullptr) field->set_type_name(type_name);
  }

  EventSchema() {
    using F = pb::FieldDescriptorProto;
    pb::FileDescriptorProto file;
    file.set_name("xpm/tensorboard_event_subset.proto");
    file.set_package("tensorboard");
    pb::DescriptorProto* summary = file.add_message_type();
    summary->set_name("Summary");
    pb::DescriptorProto* value = summary->add_nested_type();
    value->set_name("Value");
    add_field(value, "tag", 1, F::TYPE_STRING);
    add_field(value, "simple_value", 2, F::TYPE_FLOAT);
    add_field(summary, "value", 1, F::TYPE_MESSAGE, F::LABEL_REPEATED,
              ".tensorboard.Summary.Value");
    pb::DescriptorProto* event = file.add_message_type();
    event->set_name("Event");
    add_field(event, "wall_time", 1, F::TYPE_DOUBLE);
    add_field(event, "step", 2, F::TYPE_INT64);
    add_field(event, "file_version", 3, F::TYPE_STRING);
    add_field(event, "summary", 5, F::TYPE_MESSAGE, F::LABEL_OPTIONAL, ".tensorboard.Summary");
    const pb::FileDescriptor* built = pool_.BuildFile(file);
    if (built == nullptr) throw std::logic_error("tensorboard: the Event descriptor is invalid");
    event_ = built->FindMessageTypeByName("Event");
    const pb::Descriptor* summary_type = built->FindMessageTypeByName("Summary");
    const pb::Descriptor* value_type = summary_type->FindNestedTypeByName("Value");
    wall_time_ = event_->FindFieldByName("wall_time");
    step_ = event_->FindFieldByName("step");
    file_version_ = event_->FindFieldByName("file_version");
    summary_ = event_->FindFieldByName("summary");
    value_ = summary_type->FindFieldByName("value");
    tag_ = value_type->FindFieldByName("tag");
    simple_value_ = value_type->FindFieldByName("simple_value");
  }

  pb::DescriptorPool pool_;
  mutable pb::DynamicMessageFactory factory_{&pool_};
};

constexpr const char* kFileVersion = "brain.Event:2";

void append_le(std::string& out, std::uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

std::uint64_t read_le(const unsigned char* p, int bytes) {
  std::uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return value;
}

/// Appends one TFRecord: length, masked CRC of the length's 8 bytes, data, masked CRC of data.
void append_record(std::string& out, const std::string& data) {
  std::string length;
  append_le(length, data.size(), 8);
  out += length;
  append_le(out, masked_crc32c(length.data(), length.size()), 4);
  out += data;
  append_le(out, masked_crc32c(data.data(), data.size()), 4);
}

std::string serialize(const pb::Message& message) {
  std::string bytes;
  if (!message.SerializeToString(&bytes)) {
    throw std::runtime_error("tensorboard: cannot serialize an Event");
  }
  return bytes;
}

}  // namespace

std::uint32_t crc32c(const void* data, std::size_t size) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;
  crc.process_bytes(data, size);
  return crc.checksum();
}

std::uint32_t masked_crc32c(const void* data, std::size_t size) {
  const std::uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string serialize_scalar_event(const TensorboardScalar& scalar) {
  const EventSchema& schema = EventSchema::get();
  std::unique_ptr<pb::Message> event = schema.new_event();
  const pb::Reflection* reflection = event->GetReflection();
  reflection->SetDouble(event.get(), schema.wall_time_, scalar.wall_time_s);
  reflection->SetInt64(event.get(), schema.step_, scalar.step);
  pb::Message* summary = reflection->MutableMessage(event.get(), schema.summary_);
  pb::Message* value = summary->GetReflection()->AddMessage(summary, schema.value_);
  value->GetReflection()->SetString(value, schema.tag_, scalar.tag);
  value->GetReflection()->SetFloat(value, schema.simple_value_, scalar.value);
  return serialize(*event);
}

std::vector<TensorboardScalar> tensorboard_scalars(const TrainMetrics& metrics,
                                                   double wall_time_s) {
  std::vector<TensorboardScalar> scalars;
  auto add = [&](const char* tag, std::int64_t step, const std::optional<double>& value) {
    if (value) scalars.push_back({wall_time_s, step, tag, static_cast<float>(*value)});
  };
  for (const TrainStepMetrics& s : metrics.steps) {
    add("train/loss", s.step, s.loss);
    add("train/tokens_per_s", s.step, s.tokens_per_s);
    add("memory/peak_allocated_bytes", s.step, s.peak_allocated_bytes);
    add("memory/predicted_peak_bytes", s.step, s.predicted_peak_bytes);
    add("memory/capacity_bytes", s.step, s.capacity_bytes);
  }
  for (const TrainValidationMetrics& v : metrics.validations) {
    add("validation/token_accuracy", v.step, v.token_accuracy);
    add("validation/loss", v.step, v.loss);
  }
  return scalars;
}

std::string write_tensorboard_events(const TrainMetrics& metrics, const std::string& dir,
                                     double wall_time_s) {
  if (wall_time_s < 0) {
    wall_time_s = std::chrono::duration<double>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  }
  const EventSchema& schema = EventSchema::get();
  std::unique_ptr<pb::Message> first = schema.new_event();
  first->GetReflection()->SetDouble(first.get(), schema.wall_time_, wall_time_s);
  first->GetReflection()->SetString(first.get(), schema.file_version_, kFileVersion);
  std::string file;
  append_record(file, serialize(*first));
  for (const TensorboardScalar& scalar : tensorboard_scalars(metrics, wall_time_s)) {
    append_record(file, serialize_scalar_event(scalar));
  }
  const std::string path = (std::filesystem::path(dir) /
                            ("events.out.tfevents." +
                             std::to_string(static_cast<std::int64_t>(wall_time_s)) +
                             ".xpm-train"))
                               .string();
  write_file_atomically(path, file);
  return path;
}

TensorboardEventFile read_tensorboard_events(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("tensorboard: cannot open '" + path + "'");
  std::ostringstream buffer;
  buffer << in.rdbuf();
  const std::string bytes = buffer.str();
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  const EventSchema& schema = EventSchema::get();
  TensorboardEventFile result;
  std::size_t offset = 0;
  while (offset < bytes.size()) {
    const std::string where = "tensorboard: '" + path + "' record at byte " + std::to_string(offset);
    if (bytes.size() - offset < 12) throw std::runtime_error(where + ": short header");
    const std::uint64_t length = read_le(data + offset, 8);
    if (static_cast<std::uint32_t>(read_le(data + offset + 8, 4)) !=
        masked_crc32c(data + offset, 8)) {
      throw std::runtime_error(where + ": length CRC mismatch");
    }
    if (bytes.size() - offset - 12 < 4 || length > bytes.size() - offset - 16) throw std::runtime_error(where + ": short data");
    const unsigned char* payload = data + offset + 12;
    if (static_cast<std::uint32_t>(read_le(payload + length, 4)) !=
        masked_crc32c(payload, length)) {
      throw std::runtime_error(where + ": data CRC mismatch");
    }
    std::unique_ptr<pb::Message> event = schema.new_event();
    if (!event->ParseFromArray(payload, static_cast<int>(length))) {
      throw std::runtime_error(where + ": not a parsable Event");
    }
    const pb::Reflection* reflection = event->GetReflection();
    if (reflection->HasField(*event, schema.file_version_)) {
      result.file_version = reflection->GetString(*event, schema.file_version_);
    }
    if (reflection->HasField(*event, schema.summary_)) {
      const pb::Message& summary = reflection->GetMessage(*event, schema.summary_);
      const pb::Reflection* summary_reflection = summary.GetReflection();
      for (int i = 0; i < summary_reflection->FieldSize(summary, schema.value_); ++i) {
        const pb::Message& value = summary_reflection->GetRepeatedMessage(summary, schema.value_, i);
        TensorboardScalar scalar;
        scalar.wall_time_s = reflection->GetDouble(*event, schema.wall_time_);
        scalar.step = reflection->GetInt64(*event, schema.step_);
        scalar.tag = value.GetReflection()->GetString(value, schema.tag_);
        scalar.value = value.GetReflection()->GetFloat(value, schema.simple_value_);
        result.scalars.push_back(scalar);
      }
    }
    offset += 12 + length + 4;
  }
  return result;
}

}  // namespace xpm
