// xpm/trainer/loop/training_task.hpp — what a model brings to the Learner (learner.hpp): its training
// records with their dims, the summed loss of a microbatch of them, a validation that returns
// named metrics, and the loss of a synthetic batch of given dims for probing.
//
//   class MyTask : public xpm::TrainingTask {
//    public:
//     torch::nn::Module& module() override { return *net_; }
//     std::size_t train_record_count() const override { return texts_.size(); }
//     xpm::TrainingRecord train_record(std::size_t i) const override {
//       const double l = static_cast<double>(texts_[i].size());
//       return {{1.0, l}, l - 1, l};              // dims {bs, l}, loss units, tokens
//     }
//     torch::Tensor loss_sum(const std::vector<std::size_t>& records) override;  // scalar
//     xpm::NamedMetrics validate(const xpm::ValidationPlanFn& plan_of) override;  // {"loss", ..}
//     torch::Tensor probe_loss_sum(const std::vector<double>& dims) override;     // scalar
//   };
//
// Dims follow the cost formula's variable_names() order, with the batch-size variable at 1 for a
// single record (the planner sums or maxes them over a microbatch). Units are what the loss is
// summed over (tokens that have a label, pairs, images): the Learner divides the summed
// gradients by the outer batch's units, so a step's update is the mean over them whatever the
// microbatches. Size is what throughput counts, named by LearnerOptions::size_name ("real_<name>"
// and "<name>_per_s" in metrics.jsonl).
//
// Every method runs on every rank of a data-parallel job, with the same arguments except where
// noted; none may issue collectives except validate().
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "xpm/planner/packer.hpp"
#include "xpm/trainer/distributed/distributed.hpp"

namespace xpm {

/// One training record as the planner and the loss normalization see it.
struct TrainingRecord {
  std::vector<double> dims;  // the cost formula's variables, batch size 1
  double units = 1;          // what its loss is summed over (> 0 for a record that trains)
  double size = 1;           // what throughput counts (tokens, characters, pixels)
};

/// Validation metrics by name ("loss", "accuracy", "records"): every value goes to
/// metrics.jsonl, to the hooks' context under "validation/<name>" and to the summary's
/// validations; the Learner's ValidationSettings::metric names the one that decides.
using NamedMetrics = std::map<std::string, double>;

/// Microbatches of a list of records given their dims (the Learner passes a snapshot of the
/// training plan, so nothing validation measures changes it).
using ValidationPlanFn = std::function<MicrobatchPlan(const std::vector<std::vector<double>>&)>;

class TrainingTask {
 public:
  virtual ~TrainingTask() = default;

  /// The model being trained: its parameters are what the optimizer steps, checkpoints save
  /// (model.pt) and data parallelism broadcasts and all-reduces.
  virtual torch::nn::Module& module() = 0;
  /// Number of training records; the Learner shuffles their indices every epoch.
  virtual std::size_t train_record_count() const = 0;
  /// Record `index` (0 <= index < train_record_count()).
  virtual TrainingRecord train_record(std::size_t index) const = 0;
  /// Forward pass of the records (indices into the training records) and their loss SUMMED
  /// over the records' units: a scalar tensor with a gradient. May throw
  /// c10::OutOfMemoryError (the Learner handles it).
  virtual torch::Tensor loss_sum(const std::vector<std::size_t>& records) = 0;
  /// Validation records for the Learner's own validation (validate_records): their count
  /// (default 0: the Learner calls validate() instead).
  virtual std::size_t validation_record_count() const { return 0; }
  /// Validation record `index`: its dims and units (what validation_sums' sums are per).
  virtual TrainingRecord validation_record(std::size_t index) const;
  /// Named sums over a microbatch of validation records (indices into them), under no-grad and
  /// eval mode: {"loss": summed loss, "accuracy": correct records}. Every call returns the
  /// same names. The Learner sums them over every microbatch and rank and divides each by the
  /// records' total units.
  virtual NamedMetrics validation_sums(const std::vector<std::size_t>& records);
  /// Evaluates the model (eval mode, no gradient, back to train mode afterwards) and returns
  /// its metrics, the same on every rank. Collective: every rank calls it and may split the
  /// validation records among ranks and all-reduce. `plan_of` gives microbatches that fit.
  /// Called only when validation_record_count() is 0; the default throws std::logic_error
  /// (override either this or the three above).
  virtual NamedMetrics validate(const ValidationPlanFn& plan_of);
  /// Summed loss of a synthetic microbatch of `dims` (formula order), for probing the memory
  /// cost of a training step. Only rank 0 calls it, before training.
  virtual torch::Tensor probe_loss_sum(const std::vector<double>& dims) = 0;
  /// One line for the log after a validation; default: "name value" pairs.
  virtual std::string describe(const NamedMetrics& metrics) const;
  /// State of the task a resumed run needs (its own RNG, a curriculum position); saved in
  /// state.json of every checkpoint. Default: none.
  virtual nlohmann::json extra_state() const { return nullptr; }
  /// Restores what extra_state() returned. Default: nothing.
  virtual void restore_extra_state(const nlohmann::json& /*state*/) {}
};

/// The Learner's validation of a task with validation records: rank r takes records r, r + W,
/// ... (W the world size), plans them with `plan_of`, sums validation_sums() over its
/// microbatches under torch::NoGradGuard in eval mode (train mode restored, also on error),
/// all-reduces the sums and the units, and returns each sum / total units plus "records", the
/// record count. Collective: every rank calls it. Throws std::invalid_argument when there are
/// fewer validation records than ranks or their units sum to 0.
NamedMetrics validate_records(TrainingTask& task, const ValidationPlanFn& plan_of, DistributedContext& dist);

/// Positional dims from a record's named fields, in `variable_names` order (a cost formula's
/// variable_names()): dims_by_name({"bs", "l"}, {{"l", 12}, {"bs", 1}}) == {1, 12}. Throws
/// std::invalid_argument naming a variable that is missing or a field that is not a variable.
std::vector<double> dims_by_name(const std::vector<std::string>& variable_names,
                                 const std::map<std::string, double>& fields);

}  // namespace xpm
