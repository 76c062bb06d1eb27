// xpm/trainer/loop/run_counters.hpp — the running totals of a Learner's run that end up in its
// reports and a job's summary (steps, OOMs, microbatches, the records' size trained, peaks,
// prediction errors, rank balance, validations), kept in one struct so checkpoints can save
// them and a resumed run reports the same summary as the uninterrupted one.
//
//   RunCounters counters(world_size);
//   counters.add_step(result, step_size, /*ooms_caught=*/0, /*attempts=*/1, /*underpredictions=*/0,
//                     /*prediction_rel_error=*/0.0);
//   nlohmann::json saved = counters.to_json();          // into a checkpoint
//   RunCounters resumed = RunCounters::from_json(saved);
#pragma once

#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "xpm/trainer/steps/data_parallel_trainer.hpp"

namespace xpm {

struct RunCounters {
  std::int64_t ooms = 0;                 // out-of-memory errors caught in training steps
  std::int64_t oom_skipped_steps = 0;    // steps skipped (no optimizer step) after an OOM
  std::int64_t retried_steps = 0;        // power batcher: steps redone after an OOM
  std::int64_t microbatches = 0;         // microbatches over all ranks
  std::int64_t skipped_records = 0;      // records predicted over budget even alone
  std::int64_t underpredictions = 0;     // measured peaks above (1 + tolerance) x predicted
  std::int64_t earlier_online_corrections = 0;  // corrections before the last resume
  std::int64_t peak_allocated_bytes = 0;  // max over steps and ranks
  double train_s = 0;                    // sum of step wall times (s)
  double trained_size = 0;               // TrainingRecord::size summed over the steps that ran
  double max_prediction_rel_error = 0;   // max |measured - predicted| / measured per step
  double last_loss = 0;                  // loss of the last step that ran
  std::vector<std::int64_t> microbatches_per_rank;
  double max_rank_imbalance = 1;         // max over steps of max/mean predicted cost per rank
  double sum_rank_imbalance = 0;         // for the mean
  nlohmann::json validations = nlohmann::json::array();  // {"step", "best", "val_<metric>", ...}

  RunCounters() = default;
  explicit RunCounters(int world_size)
      : microbatches_per_rank(static_cast<std::size_t>(world_size), 0) {}

  /// Adds one step's result. `ooms` counts the OOMs caught in it (the power batcher may catch
  /// several and still complete the step); `attempts` > 1 counts a retried step;
  /// `prediction_rel_error` is 0 for a skipped step or a batcher without predictions.
  void add_step(const GlobalStepResult& result, double step_size, std::int64_t ooms_caught,
                std::int64_t attempts, std::int64_t step_underpredictions,
                double prediction_rel_error);

  /// Mean step time (s) over `steps` steps; 0 when none ran.
  double mean_step_s(std::int64_t steps) const {
    return steps > 0 ? train_s / static_cast<double>(steps) : 0.0;
  }

  /// Every field by name (doubles keep all their digits, so a round trip is exact).
  nlohmann::json to_json() const;
  /// Throws std::invalid_argument naming the missing or malformed field.
  static RunCounters from_json(const nlohmann::json& json);
};

}  // namespace xpm
