// xpm/trainer/loop/hooks.hpp — training hooks:
// a hook implements one or more of the interfaces below and is registered in a HookList, which
// the training loop calls at the documented points. Implementations: hook_library.hpp
// (LayerFreezer, LayerSharer, GradientClipper).
//
//   HookList hooks;
//   hooks.add(std::make_shared<LayerFreezer>(LayerFreezerOptions{"^embedding\\.", 100}));
//   hooks.before_initialization(context);   // model built, parameters random
//   ...load / resume parameters...
//   hooks.after_initialization(context);    // freeze, share; then the optimizer is built, then DDP
//
// Call order per run (every rank calls every hook; hooks must do the same thing on every rank):
//   before_initialization, after_initialization            once, before the optimizer exists
//   per step:  before_step, [microbatches], before_optimizer_step, after_step
//   per validation: before_validation, after_validation
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "xpm/trainer/loop/train_context.hpp"

namespace xpm {

/// Base of every hook.
class TrainingHook {
 public:
  virtual ~TrainingHook() = default;
  /// Short name for logs ("layer-freezer").
  virtual std::string name() const = 0;
};

/// Around model initialization: before_initialization right after the model is built (random
/// parameters); after_initialization once its parameters are final (loaded or resumed), before
/// the optimizer is built and before parameters are broadcast or put in gradient buckets.
/// context.state().optimizer is null in both.
class InitializationTrainingHook : public virtual TrainingHook {
 public:
  virtual void before_initialization(TrainerContext& /*context*/) {}
  virtual void after_initialization(TrainerContext& /*context*/) {}
};

/// Around each optimizer step. before_step: state().step is the number of steps done so far;
/// before_optimizer_step: gradients of the whole outer batch accumulated (and all-reduced under
/// data parallelism), optimizer not yet stepped (gradient clipping goes here); after_step:
/// state().step already counts this step. Not called for a step skipped by an out-of-memory error
/// except before_step.
class StepTrainingHook : public virtual TrainingHook {
 public:
  virtual void before_step(TrainerContext& /*context*/) {}
  virtual void before_optimizer_step(TrainerContext& /*context*/) {}
  virtual void after_step(TrainerContext& /*context*/) {}
};

/// Around each validation; after_validation sees the validation metrics in context.metrics().
class ValidationHook : public virtual TrainingHook {
 public:
  virtual void before_validation(TrainerContext& /*context*/) {}
  virtual void after_validation(TrainerContext& /*context*/) {}
};

/// Registered hooks, called in registration order.
class HookList {
 public:
  /// Throws std::invalid_argument for a null hook or one implementing none of the interfaces.
  void add(std::shared_ptr<TrainingHook> hook) {
    if (!hook) throw std::invalid_argument("HookList::add: null hook");
    auto* init = dynamic_cast<InitializationTrainingHook*>(hook.get());
    auto* step = dynamic_cast<StepTrainingHook*>(hook.get());
    auto* validation = dynamic_cast<ValidationHook*>(hook.get());
    if (init == nullptr && step == nullptr && validation == nullptr) {
      throw std::invalid_argument("HookList::add: hook '" + hook->name() +
                                  "' implements no hook interface");
    }
    if (init != nullptr) init_.push_back(init);
    if (step != nullptr) step_.push_back(step);
    if (validation != nullptr) validation_.push_back(validation);
    owned_.push_back(std::move(hook));
  }
  std::size_t size() const { return owned_.size(); }
  /// The registered hooks, in registration order (to build a list around another one).
  const std::vector<std::shared_ptr<TrainingHook>>& hooks() const { return owned_; }

  void before_initialization(TrainerContext& c) { for (auto* h : init_) h->before_initialization(c); }
  void after_initialization(TrainerContext& c) { for (auto* h : init_) h->after_initialization(c); }
  void before_step(TrainerContext& c) { for (auto* h : step_) h->before_step(c); }
  void before_optimizer_step(TrainerContext& c) { for (auto* h : step_) h->before_optimizer_step(c); }
  void after_step(TrainerContext& c) { for (auto* h : step_) h->after_step(c); }
  void before_validation(TrainerContext& c) { for (auto* h : validation_) h->before_validation(c); }
  void after_validation(TrainerContext& c) { for (auto* h : validation_) h->after_validation(c); }

 private:
  std::vector<std::shared_ptr<TrainingHook>> owned_;
  std::vector<InitializationTrainingHook*> init_;
  std::vector<StepTrainingHook*> step_;
  std::vector<ValidationHook*> validation_;
};

}  // namespace xpm
