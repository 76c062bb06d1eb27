#include "xpm/trainer/loop/hook_library.hpp"

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>

#include <c10/util/Exception.h>

namespace xpm {
namespace {

std::regex compile(const std::string& pattern, const std::string& where) {
  try {
    return std::regex(pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& error) {
    throw std::invalid_argument(where + ": pattern '" + pattern + "' is not a valid regex: " +
                                error.what());
  }
}

torch::nn::Module& model_of(TrainerContext& context, const std::string& hook) {
  if (context.state().model == nullptr) {
    throw std::invalid_argument(hook + ": the context has no model (state().model is null)");
  }
  if (context.state().optimizer != nullptr) {
    throw std::logic_error(hook + ": the optimizer already exists; build it after "
                           "after_initialization so that it never sees the parameters as they were");
  }
  return *context.state().model;
}

// Module's parameter registry (a protected member): Module::register_parameter refuses a name
// that is already registered, so the sharer edits the entry itself. A pointer to a protected
// member formed through a derived class applies to any Module.
struct ParameterRegistry : torch::nn::Module {
  static torch::OrderedDict<std::string, torch::Tensor>& of(torch::nn::Module& module) {
    return module.*(&ParameterRegistry::parameters_);
  }
};

std::string shape_of(const torch::Tensor& t) {
  return c10::str(t.sizes()) + " " + std::string(c10::toString(t.scalar_type())) + " on " +
         t.device().str();
}

}  // namespace

// ---------------------------------------------------------------------------- LayerFreezer

void LayerFreezerOptions::validate() const {
  compile(pattern, "LayerFreezerOptions.pattern");
  if (until_step.has_value() && *until_step < 1) {
    throw std::invalid_argument("LayerFreezerOptions.until_step must be >= 1 (or unset: frozen "
                                "for the whole run), got " + std::to_string(*until_step));
  }
}

LayerFreezer::LayerFreezer(LayerFreezerOptions options) : options_(std::move(options)) {
  options_.validate();
  regex_ = compile(options_.pattern, "LayerFreezer");
}

void LayerFreezer::after_initialization(TrainerContext& context) {
  if (selected_) {
    throw std::invalid_argument("LayerFreezer '" + options_.pattern +
                                "': after_initialization called twice");
  }
  torch::nn::Module& model = model_of(context, "LayerFreezer '" + options_.pattern + "'");
  const auto named = model.named_parameters();
  for (const auto& item : named) {
    if (std::regex_search(item.key(), regex_)) {
      names_.push_back(item.key());
      parameters_.push_back(item.value());
    }
  }
  if (names_.empty()) {
    throw std::invalid_argument("LayerFreezer: pattern '" + options_.pattern +
                                "' matches none of the model's " + std::to_string(named.size()) +
                                " parameters" +
                                (named.is_empty() ? std::string()
                                                  : " (the first is '" + named.keys().front() + "')"));
  }
  selected_ = true;
  if (options_.until_step.has_value() && context.state().step >= *options_.until_step) return;
  for (torch::Tensor& parameter : parameters_) {
    parameter.mutable_grad() = torch::Tensor();
    parameter.set_requires_grad(false);
  }
  frozen_ = true;
}

void LayerFreezer::before_step(TrainerContext& context) {
  if (!frozen_ || !options_.until_step.has_value() || context.state().step < *options_.until_step) {
    return;
  }
  for (torch::Tensor& parameter : parameters_) parameter.set_requires_grad(true);
  frozen_ = false;
}

void LayerFreezer::before_optimizer_step(TrainerContext& /*context*/) {
  if (!frozen_) return;
  for (torch::Tensor& parameter : parameters_) {
    if (parameter.grad().defined()) parameter.mutable_grad() = torch::Tensor();
  }
}

// ----------------------------------------------------------------------------- LayerSharer

void LayerSharerOptions::validate() const {
  if (ties.empty()) throw std::invalid_argument("LayerSharerOptions.ties is empty");
  for (std::size_t i = 0; i < ties.size(); ++i) {
    const std::string where = "LayerSharerOptions.ties[" + std::to_string(i) + "]";
    if (ties[i].target.empty() || ties[i].source.empty()) {
      throw std::invalid_argument(where + ": empty target or source ('" + ties[i].target +
                                  "' -> '" + ties[i].source + "')");
    }
    if (regex) compile(ties[i].target, where + ".target");
  }
}

LayerSharer::LayerSharer(LayerSharerOptions options) : options_(std::move(options)) {
  options_.validate();
}

void LayerSharer::before_initialization(TrainerContext& context) { tie(context); }

void LayerSharer::after_initialization(TrainerContext& context) {
  if (!done_) tie(context);
}

void LayerSharer::tie(TrainerContext& context) {
  if (done_) {
    throw std::invalid_argument("LayerSharer: the parameters are already tied");
  }
  torch::nn::Module& model = model_of(context, "LayerSharer");

  // (target, source) names, resolved against the untied model.
  std::vector<std::pair<std::string, std::string>> pairs;
  {
    const auto named = model.named_parameters();
    for (const ParameterTie& tie : options_.ties) {
      std::size_t matched = 0;
      if (options_.regex) {
        const std::regex target_regex = compile(tie.target, "LayerSharer");
        for (const auto& item : named) {
          if (!std::regex_match(item.key(), target_regex)) continue;
          pairs.emplace_back(item.key(), std::regex_replace(item.key(), target_regex, tie.source));
          ++matched;
        }
      } else if (named.contains(tie.target)) {
        pairs.emplace_back(tie.target, tie.source);
        ++matched;
      }
      if (matched == 0) {
        throw std::invalid_argument("LayerSharer: target '" + tie.target +
                                    "' matches none of the model's " +
                                    std::to_string(named.size()) + " parameters");
      }
    }
    std::set<std::string> targets;
    for (const auto& [target, source] : pairs) {
      if (!targets.insert(target).second) {
        throw std::invalid_argument("LayerSharer: parameter '" + target + "' is tied twice");
      }
    }
    for (const auto& [target, source] : pairs) {
      if (target == source) {
        throw std::invalid_argument("LayerSharer: parameter '" + target + "' is tied to itself");
      }
      if (targets.count(source) != 0) {
        throw std::invalid_argument("LayerSharer: source '" + source + "' of '" + target +
                                    "' is itself a tied target; tie both to the same source");
      }
      const torch::Tensor* source_tensor = named.find(source);
      if (source_tensor == nullptr) {
        throw std::invalid_argument("LayerSharer: source '" + source + "' of target '" + target +
                                    "' is not a parameter of the model");
      }
      const torch::Tensor& target_tensor = named[target];
      if (!target_tensor.sizes().equals(source_tensor->sizes()) ||
          target_tensor.scalar_type() != source_tensor->scalar_type() ||
          target_tensor.device() != source_tensor->device()) {
        throw std::invalid_argument("LayerSharer: target '" + target + "' (" +
                                    shape_of(target_tensor) + ") and source '" + source + "' (" +
                                    shape_of(*source_tensor) + ") differ in shape, dtype or device");
      }
      if (!target_tensor.requires_grad()) {
        throw std::invalid_argument("LayerSharer: target '" + target +
                                    "' does not require grad (frozen before the tie?): register "
                                    "the LayerSharer before any LayerFreezer and freeze the source");
      }
    }
  }

  // Owning submodule of every parameter name ("a.b.weight" -> module "a.b", entry "weight").
  std::map<std::string, std::shared_ptr<torch::nn::Module>> modules;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    modules[item.key()] = item.value();
  }
  const auto owner = [&](const std::string& name) -> std::pair<torch::nn::Module*, std::string> {
    const std::size_t dot = name.rfind('.');
    if (dot == std::string::npos) return {&model, name};
    return {modules.at(name.substr(0, dot)).get(), name.substr(dot + 1)};
  };

  for (const auto& [target_name, source_name] : pairs) {
    const torch::Tensor source = model.named_parameters()[source_name];
    torch::Tensor target = model.named_parameters()[target_name];  // the handle members share
    {
      torch::NoGradGuard no_grad;
      target.set_data(source);  // one storage: values equal, now and after every update
    }
    target.mutable_grad() = torch::Tensor();
    target.set_requires_grad(false);
    // The target becomes a non-leaf alias of the source: copy_ onto the same storage changes
    // no value (it returns early for identical data) but records CopyBackwards, whose backward
    // adds the gradient reaching the target into the source's .grad. The edge is recorded only
    // while the source requires grad, so it is made to for the copy.
    const bool source_requires_grad = source.requires_grad();
    torch::Tensor source_handle = source;
    source_handle.set_requires_grad(true);
    {
      torch::AutoGradMode grad_mode(true);
      target.copy_(source);
    }
    source_handle.set_requires_grad(source_requires_grad);
    auto [module, entry] = owner(target_name);
    *ParameterRegistry::of(*module).find(entry) = torch::Tensor();  // skipped by named_parameters()
    tied_.emplace_back(target_name, source_name);
  }
  done_ = true;
}

// ------------------------------------------------------------------------- GradientClipper

void GradientClipperOptions::validate() const {
  if (!(max_norm > 0) || !std::isfinite(max_norm)) {
    throw std::invalid_argument("GradientClipperOptions.max_norm must be finite and > 0, got " +
                                std::to_string(max_norm));
  }
  if (!(norm_type > 0)) {
    throw std::invalid_argument("GradientClipperOptions.norm_type must be > 0 (or infinity), got " +
                                std::to_string(norm_type));
  }
}

GradientClipper::GradientClipper(GradientClipperOptions options) : options_(options) {
  options_.validate();
}

void GradientClipper::before_optimizer_step(TrainerContext& context) {
  std::vector<torch::Tensor> candidates;
  if (context.state().optimizer != nullptr) {
    for (const auto& group : context.state().optimizer->param_groups()) {
      for (const auto& parameter : group.params()) candidates.push_back(parameter);
    }
  } else if (context.state().model != nullptr) {
    candidates = context.state().model->parameters();
  } else {
    throw std::invalid_argument("GradientClipper: the context has neither an optimizer nor a model");
  }
  // Each distinct tensor once: a tensor listed twice would count twice and be scaled twice.
  std::vector<torch::Tensor> parameters;
  std::unordered_set<const void*> seen;
  for (const auto& parameter : candidates) {
    if (seen.insert(parameter.unsafeGetTensorImpl()).second) parameters.push_back(parameter);
  }
  last_norm_ = torch::nn::utils::clip_grad_norm_(parameters, options_.max_norm, options_.norm_type);
  context.add_metric("grad_norm", last_norm_);
}

}  // namespace xpm
