// xpm/trainer/loop/train_context.hpp — what a training loop knows at a point in time (TrainState) and
// what it hands to hooks and listeners (TrainerContext: state, metrics, metric-name scopes).
//
//   TrainState state;                      // epoch, step, position in the epoch's order
//   state.model = &module; state.optimizer = &optimizer;
//   TrainerContext context(state);
//   {
//     auto scope = context.scope("validation");
//     context.add_metric("loss", 0.42);    // recorded as "validation/loss"
//   }
//
// Header only; single process state (every rank keeps its own copy, equal on every rank).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace xpm {

/// Where training stands. Checkpoints save it (with the RNG states) so a resumed run continues
/// exactly where the stopped one was.
struct TrainState {
  std::int64_t epoch = 0;           // index of the current epoch (0-based)
  std::int64_t step = 0;            // optimizer steps completed since the start of training
  std::int64_t epoch_position = 0;  // outer batches already taken from the current epoch's order
  std::int64_t total_steps = 0;     // steps the run is planned for (epochs x steps per epoch, or max_steps)
  torch::nn::Module* model = nullptr;           // not owned
  torch::optim::Optimizer* optimizer = nullptr;  // not owned; null before it is built
};

/// The state plus the metrics recorded since the last clear(), under scoped names.
class TrainerContext {
 public:
  explicit TrainerContext(TrainState& state) : state_(state) {}

  TrainState& state() { return state_; }
  const TrainState& state() const { return state_; }

  /// Restores the previous scope when destroyed.
  class Scope {
   public:
    explicit Scope(TrainerContext& context) : context_(&context) {}
    Scope(Scope&& other) noexcept : context_(other.context_) { other.context_ = nullptr; }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    Scope& operator=(Scope&&) = delete;
    ~Scope() {
      if (context_ != nullptr) context_->scopes_.pop_back();
    }

   private:
    TrainerContext* context_;
  };

  /// Metric names added while the returned Scope lives are prefixed with "name/" (nested scopes
  /// join with '/'). Throws std::invalid_argument for an empty name or one containing '/'.
  [[nodiscard]] Scope scope(const std::string& name) {
    if (name.empty() || name.find('/') != std::string::npos) {
      throw std::invalid_argument("TrainerContext::scope: bad scope name '" + name + "'");
    }
    scopes_.push_back(name);
    return Scope(*this);
  }

  /// Records `value` under the current scope's prefix + `name` (replacing an earlier value).
  void add_metric(const std::string& name, double value) { metrics_[prefix() + name] = value; }
  /// Metrics by full name ("train/loss", "validation/accuracy", ...).
  const std::map<std::string, double>& metrics() const { return metrics_; }
  void clear_metrics() { metrics_.clear(); }

 private:
  std::string prefix() const {
    std::string out;
    for (const std::string& s : scopes_) out += s + "/";
    return out;
  }
  TrainState& state_;
  std::vector<std::string> scopes_;
  std::map<std::string, double> metrics_;
};

}  // namespace xpm
