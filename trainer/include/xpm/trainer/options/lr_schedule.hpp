// xpm/trainer/options/lr_schedule.hpp — learning-rate schedules as a pure function of the optimizer
// step: constant, linear warmup + linear decay to a floor, cosine with warmup.
//
//   LrScheduleOptions schedule;            // linear warmup, linear decay to 10 % (the job's)
//   schedule.peak_learning_rate = 3e-3;
//   schedule.warmup_steps = 50;
//   schedule.total_steps = 1000;
//   schedule.validate();
//   for (std::int64_t step = 0; step < 1000; ++step) {
//     set_learning_rate(optimizer, learning_rate_at(schedule, step));  // before step `step`
//     ...
//   }
//
// `step` counts optimizer steps already taken (0 for the first one), so the value is the
// learning rate the step about to run uses. A pure function of (options, step), so resuming from
// a checkpoint at step s needs only s: there is no scheduler state to save.
//
// Warmup (every kind): step < warmup_steps gives peak * (step + 1) / warmup_steps, so the first
// step already moves (HF's get_*_schedule_with_warmup start at 0 at step 0; ours is the
// bundled jobs' schedule, which these formulas reproduce bit for bit for kind linear and
// final_fraction 0.1). After warmup, progress = min(1, (step - warmup_steps) /
// max(1, total_steps - warmup_steps)) and
//   constant: peak
//   linear:   peak * (1 - (1 - final_fraction) * progress)
//   cosine:   peak * (final_fraction + (1 - final_fraction) * 0.5 * (1 + cos(pi * progress)))
// (cosine: Loshchilov & Hutter 2017, "SGDR", without restarts; HF's
// get_cosine_schedule_with_warmup with num_cycles 0.5 when final_fraction is 0). Steps at or
// past total_steps stay at the floor.
#pragma once

#include <cstdint>
#include <string>

namespace xpm {

enum class LrScheduleKind { kConstant, kLinear, kCosine };

/// "constant" | "linear" | "cosine" -> the kind. Throws std::invalid_argument naming the text
/// and `source` (e.g. "--lr-schedule") for anything else.
LrScheduleKind parse_lr_schedule_kind(const std::string& text, const std::string& source);
/// The name parse_lr_schedule_kind accepts.
std::string to_string(LrScheduleKind kind);

struct LrScheduleOptions {
  LrScheduleKind kind = LrScheduleKind::kLinear;  // shape after warmup
  double peak_learning_rate = 3e-3;  // reached at the end of warmup (the optimizer's lr)
  std::int64_t warmup_steps = 0;     // linear warmup from peak/warmup_steps to peak (0: none)
  std::int64_t total_steps = 1;      // steps of the whole run; decay ends at the last one
  double final_fraction = 0.1;       // linear/cosine floor as a fraction of the peak, in [0, 1]
  /// Throws std::invalid_argument naming the field and its value: peak < 0 or not finite,
  /// warmup_steps < 0, total_steps < 1, final_fraction outside [0, 1].
  void validate() const;
};

/// Learning rate for optimizer step `step` (0-based: steps already taken). Throws
/// std::invalid_argument when step < 0. Does not call validate() (call it once up front).
double learning_rate_at(const LrScheduleOptions& options, std::int64_t step);

}  // namespace xpm
