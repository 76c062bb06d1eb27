#include "xpm/trainer/options/lr_schedule.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include "xpm/planner/enum_names.hpp"

namespace xpm {

namespace {
constexpr EnumNames<LrScheduleKind, 3> kLrScheduleNames{
    {{LrScheduleKind::kConstant, "constant"}, {LrScheduleKind::kLinear, "linear"}, {LrScheduleKind::kCosine, "cosine"}}};
}  // namespace

LrScheduleKind parse_lr_schedule_kind(const std::string& text, const std::string& source) {
  return parse_enum(kLrScheduleNames, text, source);
}

std::string to_string(LrScheduleKind kind) { return enum_name(kLrScheduleNames, kind); }

void LrScheduleOptions::validate() const {
  if (!(std::isfinite(peak_learning_rate) && peak_learning_rate >= 0)) {
    throw std::invalid_argument("LrScheduleOptions.peak_learning_rate must be finite and >= 0, got " +
                                std::to_string(peak_learning_rate));
  }
  if (warmup_steps < 0) {
    throw std::invalid_argument("LrScheduleOptions.warmup_steps must be >= 0, got " +
                                std::to_string(warmup_steps));
  }
  if (total_steps < 1) {
    throw std::invalid_argument("LrScheduleOptions.total_steps must be >= 1, got " +
                                std::to_string(total_steps));
  }
  if (!(final_fraction >= 0 && final_fraction <= 1)) {
    throw std::invalid_argument("LrScheduleOptions.final_fraction must be in [0, 1], got " +
                                std::to_string(final_fraction));
  }
}

double learning_rate_at(const LrScheduleOptions& options, std::int64_t step) {
  if (step < 0) throw std::invalid_argument("learning_rate_at: step must be >= 0, got " + std::to_string(step));
  const double peak = options.peak_learning_rate;
  if (step < options.warmup_steps) {
    return peak * static_cast<double>(step + 1) / static_cast<double>(options.warmup_steps);
  }
  // The same expressions, in the same order, as the job's scheduled_learning_rate, so kind
  // linear with final_fraction 0.1 gives bit-identical values.
  const double span = static_cast<double>(std::max<std::int64_t>(1, options.total_steps - options.warmup_steps));
  const double progress = std::min(1.0, static_cast<double>(step - options.warmup_steps) / span);
  const double decay = 1.0 - options.final_fraction;
  switch (options.kind) {
    case LrScheduleKind::kConstant: return peak;
    case LrScheduleKind::kLinear: return peak * (1.0 - decay * progress);
    case LrScheduleKind::kCosine:
      return peak * (options.final_fraction + decay * 0.5 * (1.0 + std::cos(M_PI * progress)));
  }
  return peak;
}

}  // namespace xpm
