// learner_outcome.cpp — LearnerOutcome's reports (see learner.hpp).
#include <cstdio>
#include <sstream>
#include <string>

#include "xpm/trainer/loop/learner.hpp"

namespace xpm {
namespace {

std::string fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

std::string metrics_text(const NamedMetrics& metrics) {
  std::string text;
  for (const auto& [name, value] : metrics) text += (text.empty() ? "" : ", ") + name + " " + fixed(value, 4);
  return text;
}

std::string ending(const LearnerOutcome& outcome) {
  if (outcome.finished) return outcome.early_stopped ? "early stopped" : "finished";
  return std::string(outcome.stopped_by_signal ? "stopped by a signal" : "stopped") + " after step " +
         std::to_string(outcome.steps) + "; resume continues from its checkpoint";
}

}  // namespace

std::string LearnerOutcome::brief_report() const {
  const RunCounters& c = counters;
  std::string line = "steps " + std::to_string(steps) + " of " + std::to_string(total_steps) + ", microbatches " +
                     std::to_string(c.microbatches) + ", OOM " + std::to_string(c.ooms) +
                     ", max step prediction error " + fixed(100 * c.max_prediction_rel_error, 2) +
                     " %, underpredictions " + std::to_string(c.underpredictions);
  if (c.skipped_records > 0) {
    line += "; " + std::to_string(c.skipped_records) + " record(s) not trained, predicted over the budget even alone";
  }
  if (!last_validation.empty()) line += "; validation: " + metrics_text(last_validation);
  return line + "; " + ending(*this);
}

std::string LearnerOutcome::full_report() const {
  const RunCounters& c = counters;
  std::ostringstream os;
  os << brief_report() << "\n";
  if (!memory_formula.empty()) {
    os << "memory model: " << memory_formula << ", floor " << fixed(floor_bytes, 0) << " bytes; "
       << (memory_model_from_checkpoint ? "from the resumed checkpoint"
           : memory_model_from_cache    ? "from the cache"
           : probes > 0                 ? std::to_string(probes) + " probes in " + fixed(probe_s, 2) + " s"
                                        : "given")
       << "\n";
  }
  os << "resumed: " << (resumed_from_step >= 0 ? "from step " + std::to_string(resumed_from_step) : "no")
     << "; checkpoints written: " << checkpoints_written << "\n";
  if (best.best_value) {
    os << "best validation: " << fixed(*best.best_value, 4) << " at step " << best.best_step << "\n";
  }
  os << "OOM-skipped steps " << c.oom_skipped_steps << ", skipped records " << c.skipped_records
     << ", online corrections " << c.earlier_online_corrections << ", loss-scale skipped steps "
     << loss_scale_skipped_steps << "\n";
  os << "peak allocated " << c.peak_allocated_bytes << " bytes, train " << fixed(c.train_s, 2) << " s ("
     << fixed(c.mean_step_s(steps), 3) << " s/step), max rank imbalance " << fixed(c.max_rank_imbalance, 3);
  return os.str();
}

}  // namespace xpm
