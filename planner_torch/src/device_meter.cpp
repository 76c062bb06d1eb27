// device_meter.cpp — training_device and make_device_meter (see device_meter.hpp).
#include "xpm/planner_torch/device_meter.hpp"

#include <array>
#include <cstddef>
#include <stdexcept>

#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/planner_torch/cuda_memory_meter.hpp"

namespace xpm {
namespace {

int visible_gpus() { return cuda_memory_meter_available() ? CudaMemoryMeter::device_count() : 0; }

void check_gpu_visible(const std::string& text, const std::string& source) {
  if (!cuda_memory_meter_available()) {
    throw std::invalid_argument(source + " '" + text + "': this xpm was built against a LibTorch without CUDA; use cpu");
  }
  if (visible_gpus() == 0) {
    throw std::invalid_argument(source + " '" + text + "': no CUDA device is visible (CUDA_VISIBLE_DEVICES, driver); use cpu");
  }
}

void cap_cpu_meter(MemoryMeter& meter, const torch::Device& device, std::int64_t capacity_bytes) {
  auto* cpu = dynamic_cast<CpuMemoryMeter*>(&meter);
  if (cpu == nullptr) throw std::invalid_argument("set_device_capacity: the meter is not " + device.str() + "'s");
  cpu->set_capacity_bytes(capacity_bytes);
}

std::shared_ptr<MemoryMeter> make_cpu_meter(const torch::Device&, std::int64_t capacity_bytes) {
  CpuMemoryMeter& meter = CpuMemoryMeter::install();
  meter.set_capacity_bytes(capacity_bytes);
  return std::shared_ptr<MemoryMeter>(&meter, [](MemoryMeter*) {});  // the process-wide meter
}

// A GPU's cap: its memory fraction (1.0 for none).
void cap_cuda_meter(MemoryMeter& any, const torch::Device& device, std::int64_t capacity_bytes) {
  auto* cuda = dynamic_cast<CudaMemoryMeter*>(&any);
  if (cuda == nullptr) throw std::invalid_argument("set_device_capacity: the meter is not " + device.str() + "'s");
  CudaMemoryMeter& meter = *cuda;
  const auto total = static_cast<double>(meter.total_device_bytes());
  if (static_cast<double>(capacity_bytes) > total) {
    throw std::invalid_argument("memory cap of " + std::to_string(capacity_bytes) + " bytes is above " +
                                device.str() + "'s " + std::to_string(meter.total_device_bytes()) + " bytes");
  }
  meter.set_memory_fraction(capacity_bytes > 0 ? static_cast<double>(capacity_bytes) / total : 1.0);
}

std::shared_ptr<MemoryMeter> make_cuda_meter(const torch::Device& device, std::int64_t capacity_bytes) {
  auto meter = std::make_shared<CudaMemoryMeter>(device.has_index() ? device.index() : 0);
  if (capacity_bytes > 0) cap_cuda_meter(*meter, device, capacity_bytes);
  return meter;
}

// The meters by device type: a new device's meter is its class in a file of its own and one row
// here (the device type, how its meter is made with a cap, and how it is capped later).
struct MeterRegistration {
  c10::DeviceType device_type;
  std::shared_ptr<MemoryMeter> (*make)(const torch::Device& device, std::int64_t capacity_bytes);
  void (*cap)(MemoryMeter& meter, const torch::Device& device, std::int64_t capacity_bytes);
};
const std::array<MeterRegistration, 2> kMeters{{{c10::DeviceType::CPU, make_cpu_meter, cap_cpu_meter},
                                                {c10::DeviceType::CUDA, make_cuda_meter, cap_cuda_meter}}};

std::string meter_device_list() {
  std::string list;
  for (std::size_t i = 0; i < kMeters.size(); ++i) {
    if (i > 0) list += i + 1 == kMeters.size() ? " and " : ", ";
    list += c10::DeviceTypeName(kMeters[i].device_type, /*lower_case=*/true);
  }
  return list;
}

const MeterRegistration& registration_of(const torch::Device& device) {
  for (const MeterRegistration& meter : kMeters) {
    if (meter.device_type == device.type()) return meter;
  }
  throw std::invalid_argument("device '" + device.str() + "': only " + meter_device_list() + " are supported");
}

void check_capacity(std::int64_t capacity_bytes) {
  if (capacity_bytes < 0) {
    throw std::invalid_argument("memory cap must be >= 0 bytes (0: none), got " + std::to_string(capacity_bytes));
  }
}

}  // namespace

torch::Device training_device(const std::string& text, const std::string& source, int local_rank) {
  if (text == "cpu") return torch::Device(torch::kCPU);
  if (text != "cuda" && text.rfind("cuda:", 0) != 0) {
    throw std::invalid_argument(source + " must be 'cpu', 'cuda' or 'cuda:N', got '" + text + "'");
  }
  int index = local_rank;
  if (text != "cuda") {
    std::size_t used = 0;
    const std::string digits = text.substr(5);
    try {
      index = std::stoi(digits, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (digits.empty() || used != digits.size() || index < 0) {
      throw std::invalid_argument(source + " must be 'cpu', 'cuda' or 'cuda:N', got '" + text + "'");
    }
  }
  check_gpu_visible(text, source);
  if (index >= visible_gpus()) {
    throw std::invalid_argument(source + " '" + text + "': GPU " + std::to_string(index) + " of " +
                                std::to_string(visible_gpus()) + " visible");
  }
  return torch::Device(torch::kCUDA, static_cast<torch::DeviceIndex>(index));
}

std::shared_ptr<MemoryMeter> make_device_meter(const torch::Device& device, std::int64_t capacity_bytes) {
  check_capacity(capacity_bytes);
  return registration_of(device).make(device, capacity_bytes);
}

void set_device_capacity(MemoryMeter& meter, const torch::Device& device, std::int64_t capacity_bytes) {
  check_capacity(capacity_bytes);
  registration_of(device).cap(meter, device, capacity_bytes);
}

}  // namespace xpm
