// xpm/trainer/loop/hook_library.hpp — the hooks every run may want (hooks.hpp has the interfaces):
// LayerFreezer (no gradient, no optimizer state for parameters chosen by a regex, optionally
// until a step), LayerSharer (tie target parameters to source ones) and GradientClipper (global
// gradient-norm clipping, the pre-clip norm recorded as the metric "grad_norm").
//
//   HookList hooks;
//   hooks.add(std::make_shared<LayerSharer>(LayerSharerOptions{{{"output.weight", "embedding.weight"}}}));
//   hooks.add(std::make_shared<LayerFreezer>(LayerFreezerOptions{"^embedding\\.", 100}));
//   hooks.add(std::make_shared<GradientClipper>(GradientClipperOptions{1.0}));
//   hooks.before_initialization(context);   // the sharer ties here
//   ...load or resume parameters...
//   hooks.after_initialization(context);    // the freezer freezes here
//   AdamW optimizer(model->parameters(), ...);   // built AFTER: sees one tensor per tie and no
//                                                // gradient for a frozen parameter
//
// Order guarantee: the freezer and the sharer both act before the optimizer (and any DDP wrapper)
// is built, before probes measure the model, and before gradient buckets are laid out, so
//   - a frozen parameter never gets a gradient, so LibTorch's optimizers skip it and keep no
//     state for it (no exp_avg / exp_avg_sq under AdamW, no weight decay), the probes measure
//     the memory of the frozen model, and GradientBuckets leave it out;
//   - a tied pair is one parameter for every consumer of model.parameters(): the optimizer
//     updates it once, the buckets all-reduce it once, checkpoints hold it once.
// The optimizer MUST be built after after_initialization, from model.parameters() (all of
// them: an until_step freezer unfreezes parameters the optimizer must already hold).
//
// Register the LayerSharer before any LayerFreezer and the GradientClipper after every hook
// that changes gradients in before_optimizer_step (HookList calls hooks in registration
// order). Every hook here does the same thing on every rank (it reads only names and step
// counts, and gradients already all-reduced), so every rank must register the same hooks.
#pragma once

#include <cstdint>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "xpm/trainer/loop/hooks.hpp"

namespace xpm {

struct LayerFreezerOptions {
  /// ECMAScript regex searched (std::regex_search) in each name of model.named_parameters()
  /// ("encoder.layers.0.linear1.weight"); anchor it with ^ and $ to match whole names.
  std::string pattern;
  /// Frozen while state().step < until_step, unfrozen by the before_step hook of step
  /// until_step (0-based: after until_step optimizer steps); unset: frozen for the whole run.
  std::optional<std::int64_t> until_step;
  /// Throws std::invalid_argument naming the pattern (bad regex) or the value (until_step < 1).
  void validate() const;
};

/// Freezes the parameters whose names match a regex: requires_grad(false) and no gradient,
/// from after_initialization (before the optimizer is built) until until_step.
///
/// Under data parallelism with until_step: GradientBuckets built while the parameters were
/// frozen do not hold their gradients, so the caller must rebuild the buckets at
/// unfreeze_step() (every rank, same step) or the unfrozen gradients are never all-reduced.
/// The memory plan was probed with them frozen: unfreezing adds their gradients and
/// optimizer state (3x their bytes under AdamW), which the budget must leave room for.
class LayerFreezer : public InitializationTrainingHook, public StepTrainingHook {
 public:
  /// Throws std::invalid_argument as LayerFreezerOptions::validate.
  explicit LayerFreezer(LayerFreezerOptions options);
  std::string name() const override { return "layer-freezer"; }

  /// Selects the parameters (names matching the pattern) and, unless state().step already
  /// reached until_step (a resumed run), freezes them: requires_grad(false), gradient reset to
  /// undefined (frees one allocated by earlier code). Throws std::invalid_argument when
  /// state().model is null, when the pattern matches no parameter (naming the pattern and the
  /// number of parameters), or when called a second time; std::logic_error when the optimizer
  /// already exists (state().optimizer non-null: it would keep state built before freezing).
  void after_initialization(TrainerContext& context) override;
  /// Unfreezes (requires_grad(true)) when state().step >= until_step.
  void before_step(TrainerContext& context) override;
  /// While frozen, drops a gradient found on a frozen parameter (put there by code outside the
  /// hooks), so the optimizer still skips it.
  void before_optimizer_step(TrainerContext& context) override;

  /// Names of the selected parameters, in registration order (empty before after_initialization).
  const std::vector<std::string>& parameter_names() const { return names_; }
  /// Whether the selected parameters are frozen now.
  bool frozen() const { return frozen_; }
  /// The step at which they are unfrozen; -1 without until_step.
  std::int64_t unfreeze_step() const { return options_.until_step.value_or(-1); }

 private:
  LayerFreezerOptions options_;
  std::regex regex_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> parameters_;
  bool selected_ = false;
  bool frozen_ = false;
};

/// One tie: `target` becomes the same parameter as `source`.
struct ParameterTie {
  std::string target;  // parameter name, or (regex mode) an ECMAScript regex matching whole names
  std::string source;  // parameter name, or (regex mode) a std::regex_replace format ("enc.$1")
};

struct LayerSharerOptions {
  std::vector<ParameterTie> ties;  // applied in order
  bool regex = false;              // targets are regexes, sources replacement formats
  /// Throws std::invalid_argument for no tie, an empty name, or (regex mode) a bad regex,
  /// naming it.
  void validate() const;
};

/// Ties target parameters to source parameters: after the tie the model computes with the
/// source's values wherever it used the target, the target's gradient contributions go to the
/// source, and model.parameters() lists the source once.
///
/// How, in LibTorch (where a module's forward reads its C++ member, e.g. LinearImpl::weight,
/// not its parameter registry, so replacing the registry entry alone would change nothing the
/// forward sees; and Module::register_parameter refuses an existing name): the target tensor
/// the member holds is made to share the source's storage (set_data), then becomes a
/// non-leaf alias of the source (copy_ of the source onto its own storage, recorded by
/// autograd: its backward adds the gradient into the source's .grad); its registry entry is
/// set to an undefined tensor, which named_parameters() skips. So:
///   - values stay bitwise equal (one storage; the optimizer's in-place update of the source
///     is what the target reads);
///   - the gradient of the source is the sum of both uses (exact);
///   - the optimizer, built after, holds one parameter and one state;
///   - a checkpoint of the tied model holds only the source's name; loading it into a model
///     tied the same way works (the sharer ties in before_initialization, before the load).
/// Do not convert or move the model (to(), clone()) after the tie: the target would keep the
/// old storage. Freeze a tied pair through its source.
class LayerSharer : public InitializationTrainingHook {
 public:
  /// Throws std::invalid_argument as LayerSharerOptions::validate.
  explicit LayerSharer(LayerSharerOptions options);
  std::string name() const override { return "layer-sharer"; }

  /// Ties (so the load that follows sees the tied layout). Throws std::invalid_argument, naming
  /// the parameters, when state().model is null, a target or source matches no parameter, a
  /// target is tied twice or to itself, a source is itself a tied target, shapes, dtypes or
  /// devices differ, or a target does not require grad (frozen before the tie: register the
  /// sharer first); std::logic_error when the optimizer already exists.
  void before_initialization(TrainerContext& context) override;
  /// Ties if before_initialization did not (callers that only call after_initialization).
  void after_initialization(TrainerContext& context) override;

  /// (target, source) parameter names tied, in order (empty before the tie).
  const std::vector<std::pair<std::string, std::string>>& tied() const { return tied_; }

 private:
  void tie(TrainerContext& context);
  LayerSharerOptions options_;
  std::vector<std::pair<std::string, std::string>> tied_;
  bool done_ = false;
};

struct GradientClipperOptions {
  double max_norm = 1.0;   // largest global gradient norm after clipping, > 0
  double norm_type = 2.0;  // p of the p-norm, > 0 (infinity allowed)
  /// Throws std::invalid_argument naming the field and its value.
  void validate() const;
};

/// Global gradient-norm clipping in before_optimizer_step: the norm N of all gradients
/// together (the p-norm of the per-parameter p-norms) over the optimizer's parameters (the
/// model's when no optimizer is set), each distinct tensor once; when N > max_norm every
/// gradient is multiplied by max_norm / (N + 1e-6) (torch::nn::utils::clip_grad_norm_, as
/// PyTorch's clip_grad_norm_). Records N before clipping as the metric "grad_norm" (under the
/// context's current scope) and keeps it in last_norm().
///
/// Under data parallelism before_optimizer_step runs after the gradients are all-reduced, so
/// every rank holds the same gradients, computes the same norm and scales the same way: the
/// ranks stay identical without any collective of its own. It assumes whole gradients on every
/// rank: with the sharded optimizer, clip with clip_gradient_norm_ (gradient_clipping.hpp). A
/// non-finite norm is recorded as is and, as in PyTorch, leaves non-finite gradients.
class GradientClipper : public StepTrainingHook {
 public:
  /// Throws std::invalid_argument as GradientClipperOptions::validate.
  explicit GradientClipper(GradientClipperOptions options);
  std::string name() const override { return "gradient-clipper"; }
  /// Throws std::invalid_argument when neither state().optimizer nor state().model is set.
  void before_optimizer_step(TrainerContext& context) override;
  /// Pre-clip global norm of the last step (0 before the first, or without any gradient).
  double last_norm() const { return last_norm_; }

 private:
  GradientClipperOptions options_;
  double last_norm_ = 0;
};

}  // namespace xpm
