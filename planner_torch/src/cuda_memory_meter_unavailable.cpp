// CudaMemoryMeter in a build without a CUDA-enabled LibTorch (Debian's is CPU only): the class
// exists so callers need no #ifdef, and constructing it says why it cannot work.
#include "xpm/planner_torch/cuda_memory_meter.hpp"

#include <stdexcept>

namespace xpm {
namespace {

[[noreturn]] void unavailable() {
  throw std::runtime_error(
      "CudaMemoryMeter: this xpm was built against a LibTorch without CUDA (Debian's libtorch is "
      "CPU only); configure with -DTorch_DIR=<a CUDA LibTorch>/share/cmake/Torch (docs/cuda.md)");
}

}  // namespace

bool cuda_memory_meter_available() { return false; }
int CudaMemoryMeter::device_count() { return 0; }
CudaMemoryMeter::CudaMemoryMeter(int device_index) : device_index_(device_index) { unavailable(); }
std::int64_t CudaMemoryMeter::current_allocated_bytes() const { unavailable(); }
std::int64_t CudaMemoryMeter::peak_allocated_bytes() const { unavailable(); }
std::int64_t CudaMemoryMeter::current_reserved_bytes() const { unavailable(); }
std::int64_t CudaMemoryMeter::peak_reserved_bytes() const { unavailable(); }
void CudaMemoryMeter::reset_peak() { unavailable(); }
void CudaMemoryMeter::empty_cache() { unavailable(); }
std::int64_t CudaMemoryMeter::capacity_bytes() const { unavailable(); }
std::int64_t CudaMemoryMeter::total_device_bytes() const { unavailable(); }
void CudaMemoryMeter::set_memory_fraction(double) { unavailable(); }

}  // namespace xpm
