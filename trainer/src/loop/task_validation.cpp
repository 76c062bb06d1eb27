// task_validation.cpp — the Learner's validation of a task's validation records (validate_records,
// training_task.hpp) and the TrainingTask defaults it stands in for.
#include <stdexcept>
#include <string>
#include <vector>

#include "xpm/trainer/loop/training_task.hpp"

namespace xpm {
namespace {

// Restores train mode when validation ends, by return or by exception.
class EvalModeGuard {
 public:
  explicit EvalModeGuard(torch::nn::Module& module) : module_(module) { module_.eval(); }
  ~EvalModeGuard() { module_.train(); }
  EvalModeGuard(const EvalModeGuard&) = delete;
  EvalModeGuard& operator=(const EvalModeGuard&) = delete;

 private:
  torch::nn::Module& module_;
};

}  // namespace

TrainingRecord TrainingTask::validation_record(std::size_t /*index*/) const {
  throw std::logic_error("TrainingTask: validation_record_count() > 0 needs validation_record() overridden");
}

NamedMetrics TrainingTask::validation_sums(const std::vector<std::size_t>& /*records*/) {
  throw std::logic_error("TrainingTask: validation_record_count() > 0 needs validation_sums() overridden");
}

NamedMetrics TrainingTask::validate(const ValidationPlanFn& /*plan_of*/) {
  throw std::logic_error(
      "TrainingTask: override validate(), or validation_record_count(), validation_record() and validation_sums()");
}

NamedMetrics validate_records(TrainingTask& task, const ValidationPlanFn& plan_of, DistributedContext& dist) {
  const std::size_t count = task.validation_record_count();
  const auto world = static_cast<std::size_t>(dist.world_size());
  if (count < world) {
    throw std::invalid_argument("validation: " + std::to_string(count) + " validation record(s) for " +
                                std::to_string(world) + " ranks; every rank needs at least one");
  }
  std::vector<std::size_t> mine;  // this rank's share
  std::vector<std::vector<double>> dims;
  double units = 0;
  for (std::size_t i = static_cast<std::size_t>(dist.rank()); i < count; i += world) {
    const TrainingRecord record = task.validation_record(i);
    mine.push_back(i);
    dims.push_back(record.dims);
    units += record.units;
  }
  NamedMetrics sums;
  {
    torch::NoGradGuard no_grad;
    EvalModeGuard eval(task.module());
    for (const Microbatch& microbatch : plan_of(dims).microbatches) {
      std::vector<std::size_t> records;
      for (std::size_t j : microbatch.record_indices) records.push_back(mine[j]);
      for (const auto& [name, value] : task.validation_sums(records)) sums[name] += value;
    }
  }
  std::vector<double> totals = {units};
  for (const auto& entry : sums) totals.push_back(entry.second);
  totals = dist.all_reduce(totals, ReduceOp::kSum);
  if (!(totals[0] > 0)) throw std::invalid_argument("validation: the validation records' units sum to 0");
  NamedMetrics metrics;
  std::size_t k = 1;
  for (const auto& entry : sums) metrics[entry.first] = totals[k++] / totals[0];
  metrics["records"] = static_cast<double>(count);
  return metrics;
}

}  // namespace xpm
