#include "xpm/planner/predictive_batcher.hpp"

#include <algorithm>
#include <limits>
#include <cmath>
#include <stdexcept>
#include <utility>

namespace xpm {

void PredictiveBatcherOptions::validate() const {
  budget.validate();
  fit.validate();
  const auto is_variable = [&](const std::string& name) {
    return std::find(variable_names.begin(), variable_names.end(), name) != variable_names.end();
  };
  if (!is_variable(batch_size_variable)) {
    throw std::invalid_argument("PredictiveBatcherOptions.batch_size_variable '" +
                                batch_size_variable + "' is not one of variable_names");
  }
  if (probe_points.empty()) {
    for (const std::string& name : variable_names) {
      auto it = variable_max.find(name);
      if (it == variable_max.end() || !(it->second >= 1)) {
        throw std::invalid_argument(
            "PredictiveBatcherOptions.variable_max must give a value >= 1 for variable '" + name +
            "' when no probe points are given (automatic probe design)");
      }
    }
    for (double f : design_fractions) {
      if (!(f > 0 && f <= 1)) {
        throw std::invalid_argument(
            "PredictiveBatcherOptions.design_fractions must lie in (0, 1], got " +
            std::to_string(f));
      }
    }
  }
}

PredictiveBatcher::PredictiveBatcher(PredictiveBatcherOptions options,
                                     std::shared_ptr<const MicrobatchPacker> packer)
    : options_(std::move(options)), packer_(std::move(packer)) {
  if (!packer_) throw std::invalid_argument("PredictiveBatcher: packer is null");
  // The fit refuses a model whose prediction decreases as the microbatch grows.
  if (options_.fit.batch_size_variable.empty()) {
    options_.fit.batch_size_variable = options_.batch_size_variable;
  }
  options_.validate();
  // Parse once here so a bad formula fails at construction, not after probing.
  CostFormula(options_.formula, options_.coefficient_names, options_.variable_names);
}

std::vector<std::vector<double>> PredictiveBatcher::design_probe_dims(
    const CostFormula& formula) const {
  std::vector<std::vector<double>> dims_list;
  if (!options_.probe_points.empty()) {
    for (std::size_t i = 0; i < options_.probe_points.size(); ++i) {
      dims_list.push_back(formula.dims_from_map(options_.probe_points[i].values,
                                                "probe point " + std::to_string(i)));
    }
  }
  return dims_list;
}

const MemoryModel& PredictiveBatcher::probe_and_fit(ProbeExecutor& executor) {
  const CostFormula formula(options_.formula, options_.coefficient_names, options_.variable_names);
  const std::size_t bs_index = formula.variable_index(options_.batch_size_variable);
  const double usable_bytes = static_cast<double>(options_.budget.usable_bytes());
  const double static_bytes = executor.static_bytes();
  if (static_bytes >= usable_bytes) {
    throw std::invalid_argument("PredictiveBatcher: the static memory (weights, gradients, optimizer "
                             "state) takes " + std::to_string(static_cast<long long>(static_bytes)) +
                             " bytes, at or above the usable budget of " +
                             std::to_string(static_cast<long long>(usable_bytes)) +
                             " bytes: no microbatch can fit");
  }
  probes_.clear();
  if (!options_.probe_points.empty()) {
    for (const auto& dims : design_probe_dims(formula)) probes_.push_back(executor.run_probe(dims));
  } else {
    const double bs_max = std::floor(options_.variable_max.at(options_.batch_size_variable));
    for (double fraction : options_.design_fractions) {
      std::vector<double> dims(formula.variable_names().size());
      for (std::size_t v = 0; v < dims.size(); ++v) {
        dims[v] = std::max(1.0, std::floor(fraction * options_.variable_max.at(
                                                          formula.variable_names()[v])));
      }
      // Grow the microbatch size by doubling toward the budget, then bisect once between the
      // last size that fitted and the first that did not, so two probes lie where it binds.
      const auto fits = [&](const ProbeResult& probe) {
        return probe.feasible && probe.step_peak_bytes() <= usable_bytes;
      };
      double last_fit = 0, first_miss = 0;
      for (double bs = 1; bs <= bs_max; bs = (bs * 2 > bs_max && bs < bs_max) ? bs_max : bs * 2) {
        dims[bs_index] = bs;
        probes_.push_back(executor.run_probe(dims));
        if (!fits(probes_.back())) {
          first_miss = bs;
          break;
        }
        last_fit = bs;
      }
      if (first_miss > 0 && first_miss - last_fit > 1) {
        dims[bs_index] = std::floor((last_fit + first_miss) / 2);
        probes_.push_back(executor.run_probe(dims));
      }
    }
  }

  // Floor: the static memory and every optimizer-step peak (AdamW's update temporaries).
  double floor_bytes = static_bytes;
  for (const ProbeResult& probe : probes_) {
    if (probe.feasible) floor_bytes = std::max(floor_bytes, probe.optimizer_step_peak_bytes);
  }
  // Below some size the forward/backward peak stops following the activations: a
  // shape-independent moment of backward sets it (the dense gradient of the largest parameter,
  // e.g. the tagger's 10.24 MB embedding gradient, alive while it is added into .grad). Several
  // probes then peak within kPlateauFraction of the smallest peak, whatever their dims. That
  // plateau is a floor too; it matters when it lies above the optimizer peaks (measured: a
  // rank holding 1/3 of the AdamW state, plateau 43.28 MB vs optimizer step 41.04 MB).
  constexpr double kPlateauFraction = 0.01;
  double smallest_peak_bytes = std::numeric_limits<double>::infinity();
  for (const ProbeResult& probe : probes_) {
    if (probe.feasible) smallest_peak_bytes = std::min(smallest_peak_bytes, probe.forward_backward_peak_bytes);
  }
  const double plateau_top_bytes = smallest_peak_bytes * (1 + kPlateauFraction);
  const auto on_plateau = std::count_if(probes_.begin(), probes_.end(), [&](const ProbeResult& probe) {
    return probe.feasible && probe.forward_backward_peak_bytes <= plateau_top_bytes;
  });
  const bool plateau = on_plateau >= 2;
  if (plateau) floor_bytes = std::max(floor_bytes, smallest_peak_bytes);
  // Fit the formula where it matters: forward/backward peaks above the floor and off the
  // plateau. Below it the prediction is the floor anyway. Fall back to every feasible probe
  // when too few remain.
  std::vector<Measurement> measurements, all_feasible;
  for (const ProbeResult& probe : probes_) {
    if (!probe.feasible) continue;
    all_feasible.push_back({probe.dims, probe.forward_backward_peak_bytes});
    const bool above_floor = probe.forward_backward_peak_bytes > floor_bytes &&
                             !(plateau && probe.forward_backward_peak_bytes <= plateau_top_bytes);
    if (above_floor) measurements.push_back(all_feasible.back());
  }
  // Probes that ran out of memory: lower bounds of the fit, limits of the plans.
  std::vector<InfeasibleBound> infeasible;
  for (const ProbeResult& probe : probes_) {
    if (probe.feasible) continue;
    const double capacity = probe.capacity_bytes > 0
                                ? probe.capacity_bytes
                                : static_cast<double>(options_.budget.capacity_bytes);
    infeasible.push_back({probe.dims, capacity});
  }
  const bool fitted_above_floor = measurements.size() >= formula.coefficient_names().size();
  if (!fitted_above_floor) measurements = all_feasible;
  if (floor_bytes >= usable_bytes) {
    throw std::invalid_argument(
        "PredictiveBatcher: the optimizer step alone peaks at " +
        std::to_string(static_cast<long long>(floor_bytes)) + " bytes, at or above the usable budget of " +
        std::to_string(static_cast<long long>(usable_bytes)) + " bytes: no microbatch can fit; raise the capacity");
  }
  if (measurements.size() < formula.coefficient_names().size()) {
    throw std::invalid_argument("PredictiveBatcher: only " + std::to_string(measurements.size()) +
                             " feasible probes for " +
                             std::to_string(formula.coefficient_names().size()) +
                             " coefficients; raise the capacity or give probe points that fit it");
  }
  FitResult fit = fit_coefficients(formula, measurements, infeasible, options_.fit);
  fit_summary_ = fit.summary;
  if (!fit.summary.usable) {
    std::string reasons;
    for (const std::string& reason : fit.summary.reasons) reasons += (reasons.empty() ? "" : "; ") + reason;
    throw std::runtime_error("PredictiveBatcher: the fitted memory model is not usable: " + reasons);
  }
  MemoryModel model(formula, fit.coefficients, floor_bytes, options_.batch_size_variable,
                    options_.aggregation);
  model.set_infeasible_probes(infeasible);
  nlohmann::json probes_json = nlohmann::json::array();
  for (const ProbeResult& probe : probes_) probes_json.push_back(to_json(probe));
  model.metadata()["probes"] = probes_json;
  nlohmann::json measurements_json = nlohmann::json::array();
  for (const Measurement& m : measurements) {
    measurements_json.push_back({{"dims", m.dims}, {"bytes", m.bytes}});
  }
  model.metadata()["fit_measurements"] = measurements_json;
  fit_measurements_ = measurements;
  corrections_ = 0;
  model.metadata()["static_bytes"] = static_bytes;
  model.metadata()["fit"] = {{"converged", fit.summary.converged},
                             {"max_rel_error", fit.summary.max_rel_error},
                             {"mean_rel_error", fit.summary.mean_rel_error},
                             {"leave_one_out_max_rel_error",
                              std::isnan(fit.summary.leave_one_out_max_rel_error)
                                  ? nlohmann::json(nullptr)
                                  : nlohmann::json(fit.summary.leave_one_out_max_rel_error)},
                             {"usable", fit.summary.usable},
                             {"fitted_to", "forward_backward_peak_bytes"},
                             {"fitted_points", measurements.size()},
                             {"infeasible_bound_count", infeasible.size()},
                             {"fitted_above_floor_only", fitted_above_floor}};
  model_ = std::move(model);
  return *model_;
}

void PredictiveBatcher::set_model(MemoryModel model) {
  fit_measurements_.clear();
  const auto it = model.metadata().find("fit_measurements");
  if (it != model.metadata().end() && it->is_array()) {
    for (const auto& m : *it) {
      fit_measurements_.push_back({m.at("dims").get<std::vector<double>>(), m.at("bytes").get<double>()});
    }
  }
  corrections_ = 0;
  model_ = std::move(model);
}

const MemoryModel& PredictiveBatcher::add_measurement(const Measurement& measurement) {
  if (!model_) throw std::logic_error("PredictiveBatcher: add_measurement before a model was set");
  fit_measurements_.push_back(measurement);
  const CostFormula& formula = model_->formula();
  if (fit_measurements_.size() < formula.coefficient_names().size()) {
    // Too little data to refit (a model set without its fit data): stay safe by raising the
    // floor to the measured bytes; the refit takes over once enough measurements accumulated.
    return raise_floor_bytes(measurement.bytes);
  }
  FitResult fit;
  try {
    fit = fit_coefficients(formula, fit_measurements_, model_->infeasible_probes(), options_.fit);
  } catch (const std::invalid_argument&) {
    // The accumulated measurements cannot separate the coefficients (IdentifiabilityError):
    // stay safe with the floor, as above.
    fit_measurements_.pop_back();
    return raise_floor_bytes(measurement.bytes);
  }
  fit_summary_ = fit.summary;
  MemoryModel refitted(formula, fit.coefficients, model_->floor_bytes(),
                       model_->batch_size_variable(), options_.aggregation);
  refitted.set_infeasible_probes(model_->infeasible_probes());
  refitted.metadata() = model_->metadata();
  refitted.metadata()["fit_measurements"].push_back(
      {{"dims", measurement.dims}, {"bytes", measurement.bytes}, {"online", true}});
  refitted.metadata()["fit"]["max_rel_error"] = fit.summary.max_rel_error;
  refitted.metadata()["fit"]["mean_rel_error"] = fit.summary.mean_rel_error;
  ++corrections_;
  model_ = std::move(refitted);
  return *model_;
}

const MemoryModel& PredictiveBatcher::raise_floor_bytes(double floor_bytes) {
  if (!model_) throw std::logic_error("PredictiveBatcher: raise_floor_bytes before a model was set");
  if (floor_bytes <= model_->floor_bytes()) return *model_;
  MemoryModel raised(model_->formula(), model_->coefficients(), floor_bytes,
                     model_->batch_size_variable(), options_.aggregation);
  raised.set_infeasible_probes(model_->infeasible_probes());
  raised.metadata() = model_->metadata();
  ++corrections_;
  model_ = std::move(raised);
  return *model_;
}

const MemoryModel& PredictiveBatcher::model() const {
  if (!model_) throw std::logic_error("PredictiveBatcher: no model yet; call probe_and_fit first");
  return *model_;
}

MicrobatchPlan PredictiveBatcher::plan(const std::vector<std::vector<double>>& record_dims) const {
  return packer_->pack(record_dims, model(), options_.budget.usable_bytes());
}

}  // namespace xpm
