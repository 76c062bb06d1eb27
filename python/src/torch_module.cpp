// xpm._torch: the LibTorch side for Python: the capping CPU memory meter, installed into the
// Python process's c10 (the one `import torch` uses: xpm links the LibTorch inside the installed
// torch, so both share libc10.so). xpm.torch_extension checks the torch version before loading.
#include <optional>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "xpm/planner_torch/cpu_memory_meter.hpp"

namespace py = pybind11;

PYBIND11_MODULE(_torch, m) {
  m.doc() = "xpm's CPU memory meter for PyTorch; use xpm.CpuMeter, not this module";
  py::class_<xpm::CpuMemoryMeter, std::unique_ptr<xpm::CpuMemoryMeter, py::nodelete>>(m, "CpuMemoryMeter")
      .def_static("install", &xpm::CpuMemoryMeter::install, py::return_value_policy::reference)
      .def_static("uninstall", &xpm::CpuMemoryMeter::uninstall)
      .def_property_readonly("current_allocated_bytes", &xpm::CpuMemoryMeter::current_allocated_bytes)
      .def_property_readonly("peak_allocated_bytes", &xpm::CpuMemoryMeter::peak_allocated_bytes)
      .def("reset_peak", &xpm::CpuMemoryMeter::reset_peak)
      .def_property("capacity_bytes", &xpm::CpuMemoryMeter::capacity_bytes, &xpm::CpuMemoryMeter::set_capacity_bytes)
      .def_property_readonly("oom_count", &xpm::CpuMemoryMeter::oom_count)
      .def("set_caching",
           [](xpm::CpuMemoryMeter& meter, bool enabled, bool expandable_segments) {
             meter.set_caching(enabled ? std::optional<xpm::CachingAllocatorOptions>(
                                             xpm::CachingAllocatorOptions{expandable_segments})
                                       : std::nullopt);
           })
      .def_property_readonly("caching_expandable_segments",  // None: no caching
                             [](const xpm::CpuMemoryMeter& meter) -> std::optional<bool> {
                               const auto caching = meter.caching();
                               return caching ? std::optional<bool>(caching->expandable_segments) : std::nullopt;
                             })
      .def_property_readonly("current_reserved_bytes", &xpm::CpuMemoryMeter::current_reserved_bytes)
      .def_property_readonly("peak_reserved_bytes", &xpm::CpuMemoryMeter::peak_reserved_bytes)
      .def("empty_cache", &xpm::CpuMemoryMeter::empty_cache);
}
