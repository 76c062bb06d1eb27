// xpm/planner_torch/device_meter.hpp — the device a job trains on, checked before any work, and
// the memory meter that goes with it: CpuMemoryMeter on the CPU, CudaMemoryMeter (the caching
// allocator's statistics, its memory fraction as the cap) on a GPU.
//
//   const torch::Device device = xpm::training_device("cuda", "--device", local_rank);  // cuda:LOCAL_RANK
//   std::shared_ptr<xpm::MemoryMeter> meter = xpm::make_device_meter(device, 24'000'000);
//   auto model = std::make_shared<MyModel>();  // after the meter: a CPU meter must see the weights
//   model->to(device);
//
// On a machine (or a LibTorch build) without CUDA, training_device("cuda", ...) throws one line
// before anything is built, so a job that asked for a GPU never runs on the CPU by mistake.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "xpm/planner_torch/memory_meter.hpp"

namespace xpm {

/// The device named `text`: "cpu", "cuda" or "cuda:N". Plain "cuda" is cuda:`local_rank` (one
/// GPU per process under a launcher: LOCAL_RANK). Throws std::invalid_argument naming `source`
/// and the text for any other name, for "cuda" when this LibTorch has no CUDA or no GPU is
/// visible, and for an index beyond the visible GPUs.
torch::Device training_device(const std::string& text, const std::string& source, int local_rank = 0);

/// The meter of `device` with a cap of `capacity_bytes` (0: none). CPU: CpuMemoryMeter::install()
/// (call it before building the model, which it must see) with the cap set. CUDA: a
/// CudaMemoryMeter of the device whose memory fraction is capacity / the device's memory (the
/// caching allocator throws c10::OutOfMemoryError beyond it). Throws std::invalid_argument for
/// a negative capacity, one above a GPU's memory, or a device that is neither.
std::shared_ptr<MemoryMeter> make_device_meter(const torch::Device& device, std::int64_t capacity_bytes);

/// Caps `meter`, made by make_device_meter(device, ...), at `capacity_bytes` (0: none) once the
/// cap is known, e.g. from the static bytes it measured: the CPU meter's cap, or a GPU's memory
/// fraction (1.0 for none). Throws std::invalid_argument for a negative capacity or one above a
/// GPU's memory. Not collective.
void set_device_capacity(MemoryMeter& meter, const torch::Device& device, std::int64_t capacity_bytes);

}  // namespace xpm
