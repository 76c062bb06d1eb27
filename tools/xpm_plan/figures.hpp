// xpm-plan figures: the fit (measured vs predicted bytes, relative residuals) and the plan
// (fill of each microbatch). SVG, see svg_plot.hpp.
#pragma once

#include <cstdint>
#include <string>

#include "measurements.hpp"
#include "xpm/planner/fit.hpp"
#include "xpm/planner/memory_model.hpp"
#include "xpm/planner/packer.hpp"

namespace xpm_plan {

/// Two panels: predicted vs measured bytes (MiB) with the y = x line; relative residual (%)
/// vs measured bytes. Infeasible probes are counted in the notes.
std::string fit_figure_svg(const xpm::MemoryModel& model, const MeasurementSet& set,
                           const xpm::FitSummary& summary, const std::string& bytes_column);

/// Two panels: utilization (predicted / usable, %) per microbatch with the 100 % line, over-
/// budget microbatches in red; records per microbatch.
std::string plan_figure_svg(const xpm::MemoryModel& model, const xpm::MicrobatchPlan& plan,
                            std::int64_t usable_bytes, const std::string& packer,
                            const std::string& source);

}  // namespace xpm_plan
