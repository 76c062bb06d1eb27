// TensorBoard event files of `xpm-train report --tensorboard` (xpm_train_tensorboard.hpp):
// CRC-32C against its published check value and a bitwise second implementation, an Event's
// bytes against a hand encoding of the protobuf wire format, the TFRecord framing walked by hand
// with both masked CRCs checked, the scalars read back, and corruption detected.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "xpm_train_tensorboard.hpp"

namespace {

namespace fs = std::filesystem;

/// CRC-32C bit by bit (reflected polynomial 0x82F63B78), a second method next to Boost.CRC.
std::uint32_t bitwise_crc32c(const std::string& bytes) {
  std::uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : bytes) {
    crc ^= byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return crc ^ 0xFFFFFFFFu;
}

std::uint32_t bitwise_masked(const std::string& bytes) {
  const std::uint32_t crc = bitwise_crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::uint64_t little_endian(const std::string& bytes, std::size_t offset, int count) {
  std::uint64_t value = 0;
  for (int i = 0; i < count; ++i) {
    value |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[offset + i])) << (8 * i);
  }
  return value;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

xpm::TrainMetrics small_run() {
  xpm::TrainMetrics metrics;
  xpm::TrainStepMetrics first;
  first.step = 1;
  first.loss = 2.5;
  first.tokens_per_s = 1000;
  first.peak_allocated_bytes = 52428800;
  first.predicted_peak_bytes = 53477376;
  first.capacity_bytes = 104857600;
  xpm::TrainStepMetrics second;  // an out-of-memory step: no loss
  second.step = 2;
  second.tokens_per_s = 0;
  metrics.steps = {first, second};
  xpm::TrainValidationMetrics validation;
  validation.step = 2;
  validation.token_accuracy = 0.75;
  metrics.validations = {validation};
  return metrics;
}

}  // namespace

TEST_CASE("CRC-32C matches its check value and a bitwise implementation and so does TFRecord's mask") {
  const std::string check = "123456789";
  CHECK(xpm::crc32c(check.data(), check.size()) == 0xE3069283u);
  CHECK(bitwise_crc32c(check) == 0xE3069283u);
  // ((0xE3069283 >> 15) | (0xE3069283 << 17)) + 0xa282ead8 mod 2^32, worked out by hand.
  CHECK(xpm::masked_crc32c(check.data(), check.size()) == 0xC78AB0E5u);
  const std::string other = "brain.Event:2";
  CHECK(xpm::masked_crc32c(other.data(), other.size()) == bitwise_masked(other));
}

TEST_CASE("a scalar event has the bytes of the protobuf wire format worked out by hand") {
  // Event{wall_time 1.5, step 3, summary{value{tag "loss", simple_value 2.0}}}:
  //   09 <1.5 as little-endian double>   field 1, 64-bit
  //   10 03                              field 2, varint 3
  //   2a 0d <13 bytes>                   field 5, length 13: Summary
  //     0a 0b <11 bytes>                 Summary field 1, length 11: Value
  //       0a 04 'l' 'o' 's' 's'          Value field 1, string
  //       15 <2.0 as little-endian float> Value field 2, 32-bit
  const unsigned char expected[] = {0x09, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf8, 0x3f, 0x10,
                                    0x03, 0x2a, 0x0d, 0x0a, 0x0b, 0x0a, 0x04, 'l',  'o',  's',
                                    's',  0x15, 0x00, 0x00, 0x00, 0x40};
  const std::string bytes = xpm::serialize_scalar_event({1.5, 3, "loss", 2.0f});
  CHECK(bytes == std::string(reinterpret_cast<const char*>(expected), sizeof expected));
  // A zero value is still written (TensorBoard needs simple_value present): 0x15 00 00 00 00.
  const std::string zero = xpm::serialize_scalar_event({1.5, 3, "loss", 0.0f});
  CHECK(zero.size() == sizeof expected);
  CHECK(zero.substr(21) == std::string("\x15\0\0\0\0", 5));
}

TEST_CASE("an event file holds framed records whose CRCs check and whose scalars read back") {
  const fs::path dir = fs::path(XPM_BINARY_DIR) / "tests" / "xpm_train_tensorboard_test";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const xpm::TrainMetrics metrics = small_run();
  const double wall_time_s = 1700000000.25;
  const std::string path = xpm::write_tensorboard_events(metrics, dir.string(), wall_time_s);
  CHECK(fs::path(path).filename() == "events.out.tfevents.1700000000.xpm-train");

  const std::vector<xpm::TensorboardScalar> scalars = xpm::tensorboard_scalars(metrics, wall_time_s);
  // Step 1: loss, tokens/s, three memory values; step 2: tokens/s only; one validation accuracy.
  REQUIRE(scalars.size() == 7);
  CHECK(scalars[0].tag == "train/loss");
  CHECK(scalars[0].value == 2.5f);
  CHECK(scalars[4].tag == "memory/capacity_bytes");
  CHECK(scalars[4].value == 104857600.0f);
  CHECK(scalars[5].tag == "train/tokens_per_s");
  CHECK(scalars[5].step == 2);
  CHECK(scalars[5].value == 0.0f);
  CHECK(scalars[6].tag == "validation/token_accuracy");
  CHECK(scalars[6].value == 0.75f);

  // Walk the records by hand: length, masked CRC of the length, data, masked CRC of the data.
  const std::string bytes = read_bytes(path);
  std::size_t offset = 0;
  std::vector<std::string> records;
  while (offset < bytes.size()) {
    REQUIRE(bytes.size() - offset >= 16);
    const std::uint64_t length = little_endian(bytes, offset, 8);
    CHECK(little_endian(bytes, offset + 8, 4) == bitwise_masked(bytes.substr(offset, 8)));
    REQUIRE(bytes.size() - offset - 16 >= length);
    const std::string data = bytes.substr(offset + 12, length);
    CHECK(little_endian(bytes, offset + 12 + length, 4) == bitwise_masked(data));
    records.push_back(data);
    offset += 16 + length;
  }
  CHECK(offset == bytes.size());
  REQUIRE(records.size() == 1 + scalars.size());
  // First record: wall_time (09 + 8 bytes) and file_version (1a 0d "brain.Event:2").
  CHECK(records[0].size() == 24);
  CHECK(records[0].substr(9) == std::string("\x1a\x0d") + "brain.Event:2");
  for (std::size_t i = 0; i < scalars.size(); ++i) {
    CHECK(records[i + 1] == xpm::serialize_scalar_event(scalars[i]));
  }

  const xpm::TensorboardEventFile read = xpm::read_tensorboard_events(path);
  CHECK(read.file_version == "brain.Event:2");
  REQUIRE(read.scalars.size() == scalars.size());
  for (std::size_t i = 0; i < scalars.size(); ++i) {
    CHECK(read.scalars[i].tag == scalars[i].tag);
    CHECK(read.scalars[i].step == scalars[i].step);
    CHECK(read.scalars[i].value == scalars[i].value);
    CHECK(read.scalars[i].wall_time_s == wall_time_s);
  }
}

TEST_CASE("a flipped byte in a record's data or length fails its CRC naming the offset") {
  const fs::path dir = fs::path(XPM_BINARY_DIR) / "tests" / "xpm_train_tensorboard_corrupt";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = xpm::write_tensorboard_events(small_run(), dir.string(), 1.0);
  const std::string bytes = read_bytes(path);
  const std::size_t second = 16 + little_endian(bytes, 0, 8);  // the second record's offset

  std::string data_flipped = bytes;
  data_flipped[second + 12 + 3] ^= 0x20;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data_flipped;
  CHECK_THROWS_WITH_AS(xpm::read_tensorboard_events(path),
                       doctest::Contains(("record at byte " + std::to_string(second) +
                                          ": data CRC mismatch")
                                             .c_str()),
                       std::runtime_error);

  std::string length_flipped = bytes;
  length_flipped[second] ^= 0x01;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << length_flipped;
  CHECK_THROWS_WITH_AS(xpm::read_tensorboard_events(path),
                       doctest::Contains(("record at byte " + std::to_string(second) +
                                          ": length CRC mismatch")
                                             .c_str()),
                       std::runtime_error);

  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - 2);
  CHECK_THROWS_WITH_AS(xpm::read_tensorboard_events(path), doctest::Contains("short data"),
                       std::runtime_error);
}
