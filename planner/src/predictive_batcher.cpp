#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner/time_model.hpp"

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>
#include <cmath>
#include <stdexcept>
#include <utility>

#include "number_format.hpp"
#include "xpm/planner/enum_names.hpp"

namespace xpm {
namespace {

// A corrected model keeps the floor formula and the probed range of the one it replaces.
void keep_floor_and_range(const MemoryModel& from, MemoryModel& to) {
  if (const FloorFormula* moving = from.floor_formula()) to.set_floor_formula(*moving);
  to.set_probed_ranges(from.probed_ranges());
  to.set_single_record_factor(from.single_record_factor());
  to.set_single_record_coefficients(from.single_record_coefficients());
}

// A refitted model predicts batch size 1 as its own fit says (FitSummary's single-record factor
// and coefficients), not as the model it replaces did.
void take_single_record_fit(const FitSummary& fit, MemoryModel& to) {
  to.set_single_record_factor(fit.single_record_factor);
  to.set_single_record_coefficients(fit.single_record_coefficients);
}

// The sample's records: the formula's width, batch-size column 1, finite and >= 0; with the
// automatic design only, whose range of every other variable it sets.
void validate_record_dims_sample(const PredictiveBatcherOptions& options) {
  if (options.record_dims_sample.empty()) return;
  const std::vector<std::string>& names = options.formula.variable_names();
  if (!options.probe_points.empty()) {
    throw std::invalid_argument("PredictiveBatcherOptions: record_dims_sample and probe_points are both given; the "
                                "sample shapes the automatic design, explicit probe points replace it: give one");
  }
  for (const auto& [name, value] : options.variable_max) {
    if (name != options.batch_size_variable) {
      throw std::invalid_argument("PredictiveBatcherOptions.variable_max['" + name + "'] and record_dims_sample both "
                                  "set the range of '" + name + "': the sample's records set it, drop the key");
    }
  }
  const std::size_t bs_index = options.formula.variable_index(options.batch_size_variable);
  for (std::size_t r = 0; r < options.record_dims_sample.size(); ++r) {
    const std::vector<double>& record = options.record_dims_sample[r];
    const std::string where = "PredictiveBatcherOptions.record_dims_sample[" + std::to_string(r) + "]";
    if (record.size() != names.size()) {
      throw std::invalid_argument(where + " has " + std::to_string(record.size()) + " dims; the formula has " +
                                  std::to_string(names.size()) + " variables (" + detail::comma_list(names) + ")");
    }
    if (record[bs_index] != 1) {
      throw std::invalid_argument(where + ": its " + options.batch_size_variable + " column is " +
                                  detail::format_double(record[bs_index]) + ", not 1 (one record)");
    }
    for (std::size_t v = 0; v < record.size(); ++v) {
      if (!(std::isfinite(record[v]) && record[v] >= 0)) {
        throw std::invalid_argument(where + ": " + names[v] + " = " + detail::format_double(record[v]) +
                                    " is not a finite value >= 0");
      }
    }
  }
}

// The variables the sample is ordered by: the summed ones (formula order), then the others.
std::vector<std::size_t> sample_sort_keys(const PredictiveBatcherOptions& options) {
  const std::vector<std::string>& names = options.formula.variable_names();
  std::vector<std::size_t> keys;
  for (int summed = 1; summed >= 0; --summed) {
    for (std::size_t v = 0; v < names.size(); ++v) {
      const auto it = options.aggregation.find(names[v]);
      const bool is_sum = it != options.aggregation.end() && it->second == DimAggregation::kSum;
      if (names[v] != options.batch_size_variable && is_sum == (summed == 1)) keys.push_back(v);
    }
  }
  return keys;
}

// The sample's record indices in ascending order of `keys`.
std::vector<std::size_t> sample_order(const PredictiveBatcherOptions& options,
                                      const std::vector<std::size_t>& keys) {
  std::vector<std::size_t> order(options.record_dims_sample.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const auto& x = options.record_dims_sample[a];
    const auto& y = options.record_dims_sample[b];
    for (std::size_t key : keys) {
      if (x[key] != y[key]) return x[key] < y[key];
    }
    return false;
  });
  return order;
}

}  // namespace

std::string to_string(FormulaChoice choice) {
  constexpr EnumNames<FormulaChoice, 2> kNames{{{FormulaChoice::kGiven, "given"}, {FormulaChoice::kAutomatic, "auto"}}};
  return enum_name(kNames, choice);
}

std::string not_usable_message(const FitSummary& summary) {
  std::string reasons;
  for (const std::string& reason : summary.reasons) reasons += (reasons.empty() ? "" : "; ") + reason;
  return "PredictiveBatcher: the fitted memory model is not usable: " + reasons;
}

void PredictiveBatcherOptions::validate() const {
  budget.validate();
  fit.validate();
  floor.validate();
  adaptive.validate();
  if (formula_choice == FormulaChoice::kAutomatic) selection.validate();
  const std::vector<std::string>& variable_names = formula.variable_names();
  const auto is_variable = [&](const std::string& name) {
    return std::find(variable_names.begin(), variable_names.end(), name) != variable_names.end();
  };
  if (!is_variable(batch_size_variable)) {
    throw std::invalid_argument("PredictiveBatcherOptions.batch_size_variable '" +
                                batch_size_variable + "' is not one of the formula's variables");
  }
  for (const auto& [name, value] : variable_max) {
    if (!is_variable(name)) {
      throw std::invalid_argument("PredictiveBatcherOptions.variable_max names '" + name +
                                  "', which is not a variable of the formula (" +
                                  detail::comma_list(variable_names) + ")");
    }
  }
  for (const auto& [name, how] : aggregation) {
    if (!is_variable(name) || name == batch_size_variable) {
      throw std::invalid_argument("PredictiveBatcherOptions.aggregation names '" + name + "', which is not a variable of "
                                  "the formula other than the batch size (" + detail::comma_list(variable_names) + ")");
    }
  }
  validate_record_dims_sample(*this);
  for (std::size_t i = 0; i < probe_points.size(); ++i) {
    const std::string where = "PredictiveBatcherOptions.probe_points[" + std::to_string(i) + "]";
    const std::vector<double> point = formula.dims_from_map(probe_points[i].values, where);  // names checked
    for (std::size_t v = 0; v < point.size(); ++v) {
      if (!(std::isfinite(point[v]) && point[v] >= 0)) {
        throw std::invalid_argument(where + " has " + variable_names[v] + " = " + detail::format_double(point[v]) +
                                    "; dims must be finite and >= 0");
      }
    }
  }
  if (probe_points.empty()) {
    if (design_fractions.empty()) {
      throw std::invalid_argument("PredictiveBatcherOptions.design_fractions is empty: the automatic probe design "
                                  "(no probe points given) needs at least one share of the budget, e.g. {1, 0.5}");
    }
    for (const std::string& name : variable_names) {
      if (!record_dims_sample.empty() && name != batch_size_variable) continue;  // the sample's range
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
  const std::vector<std::size_t> keys = sample_sort_keys(options_);
  sample_order_ = sample_order(options_, keys);
  for (std::size_t i : sample_order_) {
    sample_first_key_.push_back(keys.empty() ? 0.0 : options_.record_dims_sample[i][keys[0]]);
  }
  for (const std::vector<double>& record : options_.record_dims_sample) {
    sample_rows_.insert(sample_rows_.end(), record.begin(), record.end());
  }
  const std::vector<std::string>& names = options_.formula.variable_names();
  for (const std::string& name : names) {
    const auto it = options_.aggregation.find(name);
    aggregation_.push_back(name == options_.batch_size_variable ? DimAggregation::kCount
                           : it != options_.aggregation.end()   ? it->second
                                                                : DimAggregation::kMax);
  }
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
  run_initial_design(executor, usable_bytes);
  FitCandidate chosen = fit_probes(static_bytes, usable_bytes);
  chosen = refine_design(executor, std::move(chosen), static_bytes, usable_bytes);
  if (!chosen.model) throw std::runtime_error(not_usable_message(chosen.fit.summary));
  store_model(std::move(chosen), static_bytes);
  note_reserved_gap();
  correction_ = model_->reserved_gap();
  return *model_;
}

// Probes that measured reserved bytes: the line from the model's predictions (of allocated
// bytes) to their reserved peaks, as a calibration draws it, and the ratios seen.
void PredictiveBatcher::note_reserved_gap() {
  std::vector<double> predicted, reserved;
  double low_ratio = 0, high_ratio = 0;
  for (const ProbeResult& probe : probes_) {
    if (!probe.feasible || !(probe.step_peak_reserved_bytes > 0) || !(probe.step_peak_bytes() > 0)) continue;
    predicted.push_back(model_->predict_bytes(probe.dims));
    reserved.push_back(probe.step_peak_reserved_bytes);
    const double ratio = probe.step_peak_reserved_bytes / probe.step_peak_bytes();
    low_ratio = predicted.size() == 1 ? ratio : std::min(low_ratio, ratio);
    high_ratio = std::max(high_ratio, ratio);
  }
  if (predicted.empty()) return;
  const Correction gap =
      covering_correction(predicted, reserved, static_cast<double>(options_.budget.usable_bytes()));
  model_->metadata()["reserved_gap"] = {{"intercept_bytes", gap.intercept_bytes},
                                        {"slope", gap.slope},
                                        {"points", predicted.size()},
                                        {"reserved_to_allocated", {low_ratio, high_ratio}}};
}

std::int64_t PredictiveBatcher::planning_bytes() const {
  const double bytes = correction_.planning_bytes(static_cast<double>(options_.budget.usable_bytes()));
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(bytes));
}

PredictiveBatcher::FitCandidate PredictiveBatcher::fit_probes(double static_bytes, double usable_bytes,
                                                              const std::vector<std::string>& among) {
  const CostFormula& formula = options_.formula;
  // Floor: the static memory and the optimizer-step peaks, a constant or a formula of its own
  // when they grow with the dims (floor_model.hpp).
  std::vector<Measurement> optimizer_peaks;
  std::vector<std::vector<double>> feasible_dims;
  for (const ProbeResult& probe : probes_) {
    if (!probe.feasible) continue;
    optimizer_peaks.push_back({probe.dims, probe.optimizer_step_peak_bytes});
    feasible_dims.push_back(probe.dims);
  }
  if (optimizer_peaks.empty()) {
    floor_fit_ = FloorFit{};  // every probe ran out of memory: refused below
    floor_fit_.constant_bytes = static_bytes;
    feasible_dims.push_back(std::vector<double>(formula.variable_names().size(), 0.0));
  } else {
    FloorOptions floor = options_.floor;
    if (options_.formula_choice == FormulaChoice::kAutomatic && floor.formula.empty()) {
      floor.formula = all_terms_formula(formula.variable_names(), options_.batch_size_variable, "floor_");
    }
    floor_fit_ = fit_floor(formula, optimizer_peaks, static_bytes, floor);
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
  FitCandidate chosen = choose_fit(formula, infeasible, usable_bytes, among);
  chosen.probed_ranges = MemoryModel::ranges_of(feasible_dims);
  chosen.infeasible = std::move(infeasible);
  return chosen;
}

void PredictiveBatcher::store_model(FitCandidate chosen, double static_bytes) {
  fit_summary_ = chosen.fit.summary;
  selection_report_ = chosen.selection_report;
  MemoryModel model = std::move(*chosen.model);
  model.set_probed_ranges(chosen.probed_ranges);
  const std::vector<InfeasibleBound>& infeasible = chosen.infeasible;
  model.metadata()["floor"] = {{"report", chosen.plateau_report.empty() ? floor_fit_.report : chosen.plateau_report},
                               {"spread", floor_fit_.spread},
                               {"moving", floor_fit_.formula.has_value()},
                               {"plateau", chosen.plateau}};
  nlohmann::json probes_json = nlohmann::json::array();
  for (const ProbeResult& probe : probes_) probes_json.push_back(to_json(probe));
  model.metadata()["probes"] = probes_json;
  nlohmann::json measurements_json = nlohmann::json::array();
  for (const Measurement& m : chosen.measurements) {
    measurements_json.push_back({{"dims", m.dims}, {"bytes", m.bytes}});
  }
  model.metadata()["fit_measurements"] = measurements_json;
  fit_measurements_ = chosen.measurements;
  corrections_ = 0;
  model.metadata()["static_bytes"] = static_bytes;
  const FitSummary& fit = chosen.fit.summary;
  model.metadata()["fit"] = {{"converged", fit.converged},
                             {"max_rel_error", fit.max_rel_error},
                             {"mean_rel_error", fit.mean_rel_error},
                             {"leave_one_out_max_rel_error",
                              std::isnan(fit.leave_one_out_max_rel_error)
                                  ? nlohmann::json(nullptr)
                                  : nlohmann::json(fit.leave_one_out_max_rel_error)},
                             {"usable", fit.usable},
                             {"fitted_to", "forward_backward_peak_bytes"},
                             {"fitted_points", chosen.measurements.size()},
                             {"infeasible_bound_count", infeasible.size()},
                             {"fitted_above_floor_only", chosen.fitted_above_floor}};
  if (!selection_report_.empty()) {
    model.metadata()["formula_selection"] = {{"chosen", model.formula().canonical()},
                                             {"report", selection_report_}};
  }
  model.metadata()["adaptive_design"] = {
      {"stop", to_string(adaptive_report_.stop)},
      {"added_probes", adaptive_report_.added_probes},
      {"elapsed_s", adaptive_report_.elapsed_s},
      {"disagreement", std::isnan(adaptive_report_.disagreement)
                           ? nlohmann::json(nullptr)
                           : nlohmann::json(adaptive_report_.disagreement)},
      {"report", adaptive_report_.describe(model.formula())}};
  // The probes' forward/backward times, for the fastest packer (absent when not timed).
  if (const std::optional<TimeModel> time = fit_time_model(model, probes_)) {
    model.metadata()["time_model"] = time->to_json();
  }
  model_ = std::move(model);
}

// The given formula's fit, or the formula chosen from the candidates (FormulaChoice::kAutomatic).
std::string PredictiveBatcher::too_few_fit_message(std::size_t fitted, const std::string& needed) const {
  return "PredictiveBatcher: only " + std::to_string(fitted) + " of " + std::to_string(probes_.size()) +
         " probes fit under the capacity of " + std::to_string(options_.budget.capacity_bytes) +
         " bytes (the others ran out of memory), too few for " + needed +
         "; the floor (static memory, optimizer step) is " +
         std::to_string(static_cast<long long>(floor_fit_.constant_bytes)) +
         " bytes: raise the capacity or give probe points that fit it";
}

void PredictiveBatcher::fit_formula(FitCandidate& c, const std::vector<InfeasibleBound>& infeasible,
                                    const std::vector<std::string>& among) const {
  if (options_.formula_choice == FormulaChoice::kGiven) {
    c.formula = options_.formula;
    c.fit = fit_coefficients(*c.formula, c.measurements, infeasible, options_.fit);
    return;
  }
  FormulaSelectionOptions selection = options_.selection;
  selection.batch_size_variable = options_.batch_size_variable;
  selection.fit = options_.fit;
  selection.floor = false;  // the batcher's floor is its own (floor_model.hpp)
  selection.formulas = among;
  for (const auto& [name, aggregation] : options_.aggregation) {
    if (aggregation == DimAggregation::kSum) selection.summed_variables.push_back(name);
  }
  FormulaSelection chosen = select_formula(options_.formula.variable_names(), c.measurements, infeasible, selection);
  c.formula = chosen.formula;
  c.fit = std::move(chosen.fit);
  c.selection_report = chosen.report();
  c.alternatives = std::move(chosen.alternatives);
}

PredictiveBatcher::FitCandidate PredictiveBatcher::fit_candidate(
    const CostFormula& formula, const std::vector<InfeasibleBound>& infeasible, double floor_bytes,
    const std::function<bool(const ProbeResult&)>& off_plateau, const std::vector<std::string>& among) const {
  FitCandidate c;
  c.floor_bytes = floor_bytes;
  const auto floor_at = [&](const std::vector<double>& dims) {
    const double moving = floor_fit_.formula
                              ? floor_fit_.formula->formula.predict(floor_fit_.formula->coefficients, dims)
                              : 0.0;
    return std::max(floor_bytes, moving);
  };
  std::vector<Measurement> all_feasible;
  for (const ProbeResult& probe : probes_) {
    if (!probe.feasible) continue;
    all_feasible.push_back({probe.dims, probe.forward_backward_peak_bytes});
    if (probe.forward_backward_peak_bytes > floor_at(probe.dims) && off_plateau(probe)) {
      c.measurements.push_back(all_feasible.back());
    }
  }
  const bool choosing = options_.formula_choice == FormulaChoice::kAutomatic;
  const std::size_t needed = choosing ? 3 : formula.coefficient_names().size();
  c.fitted_above_floor = c.measurements.size() >= needed;
  if (!c.fitted_above_floor) c.measurements = all_feasible;
  const auto out_of_memory = std::count_if(probes_.begin(), probes_.end(), [](const ProbeResult& p) {
    return !p.feasible;
  });
  if (c.measurements.size() < needed) {
    if (out_of_memory == 0) {
      throw std::invalid_argument("PredictiveBatcher: " + std::to_string(probes_.size()) + " probe(s) for " +
                                  std::to_string(needed) + " coefficients: give more probe points, at least " +
                                  std::to_string(needed) + " shapes, or let the automatic design choose them");
    }
    throw std::invalid_argument(too_few_fit_message(c.measurements.size(), std::to_string(needed) + " coefficients"));
  }
  try {
    fit_formula(c, infeasible, among);
  } catch (const std::invalid_argument& error) {
    // No candidate of "auto" could be fitted to the few probes the capacity let run.
    if (out_of_memory == 0 || options_.formula_choice != FormulaChoice::kAutomatic) throw;
    throw std::invalid_argument(too_few_fit_message(c.measurements.size(), std::string("any formula (") +
                                                                               error.what() + ")"));
  }
  if (!c.fit.summary.usable) return c;
  MemoryModel model(*c.formula, c.fit.coefficients, floor_bytes, options_.batch_size_variable,
                    options_.aggregation);
  model.set_infeasible_probes(infeasible);
  model.set_single_record_factor(c.fit.summary.single_record_factor);
  model.set_single_record_coefficients(c.fit.summary.single_record_coefficients);
  if (floor_fit_.formula) model.set_floor_formula(*floor_fit_.formula);
  // Score: the largest relative error of the model over every feasible probe's step peak.
  std::vector<Measurement> step_peaks;
  for (const ProbeResult& probe : probes_) {
    if (probe.feasible) step_peaks.push_back({probe.dims, probe.step_peak_bytes()});
  }
  c.probe_error = max_step_peak_rel_error(model, step_peaks);
  c.model = std::move(model);
  return c;
}

PredictiveBatcher::FitCandidate PredictiveBatcher::choose_fit(
    const CostFormula& formula, const std::vector<InfeasibleBound>& infeasible, double usable_bytes,
    const std::vector<std::string>& among) const {
  // A plateau of the forward/backward peaks (floor_model.hpp: PeakPlateau) is fitted as a floor
  // and as a piece of the formula; the one whose model misses the probes' step peaks least is kept.
  std::vector<double> peaks;
  for (const ProbeResult& probe : probes_) {
    if (probe.feasible) peaks.push_back(probe.forward_backward_peak_bytes);
  }
  const double floor_bytes = floor_fit_.constant_bytes;
  const std::optional<PeakPlateau> plateau = options_.floor.mode == FloorMode::kAutomatic
                                                  ? find_peak_plateau(peaks, floor_bytes)
                                                  : std::nullopt;
  const double highest_floor_bytes = plateau ? plateau->floor_bytes : floor_bytes;
  if (highest_floor_bytes >= usable_bytes) {
    throw std::invalid_argument(
        "PredictiveBatcher: the optimizer step alone peaks at " +
        std::to_string(static_cast<long long>(highest_floor_bytes)) + " bytes, at or above the usable budget of " +
        std::to_string(static_cast<long long>(usable_bytes)) + " bytes: no microbatch can fit; raise the capacity");
  }
  std::vector<FitCandidate> candidates;
  std::string first_error;
  const auto try_fit = [&](double floor, bool with_plateau) {
    try {
      FitCandidate c = fit_candidate(formula, infeasible, floor, [&](const ProbeResult& probe) {
        return !with_plateau || probe.forward_backward_peak_bytes > plateau->top_bytes;
      }, among);
      c.plateau = with_plateau;
      candidates.push_back(std::move(c));
    } catch (const IdentifiabilityError& e) {
      if (first_error.empty()) first_error = e.what();
    }
  };
  if (plateau) try_fit(plateau->floor_bytes, true);
  try_fit(floor_bytes, false);
  if (candidates.empty()) throw IdentifiabilityError(first_error, {}, "");
  FitCandidate* best = nullptr;  // the plateau's first: it wins a tie (plateau_fit_kept)
  for (FitCandidate& c : candidates) {
    if (c.model && (best == nullptr || !plateau_fit_kept(best->probe_error, c.probe_error))) best = &c;
  }
  if (best != nullptr && best->plateau) best->plateau_report = plateau_floor_report(*plateau, floor_bytes);
  // None usable: the caller may probe more (adaptive design) before it refuses.
  return std::move(best == nullptr ? candidates.front() : *best);
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
  correction_ = model.reserved_gap();
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
  keep_floor_and_range(*model_, refitted);
  take_single_record_fit(fit.summary, refitted);
  refitted.metadata() = model_->metadata();
  refitted.metadata()["fit_measurements"].push_back(
      {{"dims", measurement.dims}, {"bytes", measurement.bytes}, {"online", true}});
  refitted.metadata()["fit"]["max_rel_error"] = fit.summary.max_rel_error;
  refitted.metadata()["fit"]["mean_rel_error"] = fit.summary.mean_rel_error;
  ++corrections_;
  model_ = std::move(refitted);
  return *model_;
}

const MemoryModel& PredictiveBatcher::add_infeasible_bound(const InfeasibleBound& bound) {
  if (!model_) throw std::logic_error("PredictiveBatcher: add_infeasible_bound before a model was set");
  const CostFormula& formula = model_->formula();
  std::vector<InfeasibleBound> bounds = model_->infeasible_probes();
  bounds.push_back(bound);
  std::vector<double> coefficients = model_->coefficients();
  std::optional<FitSummary> refit;
  if (fit_measurements_.size() >= formula.coefficient_names().size()) {
    try {
      const FitResult fit = fit_coefficients(formula, fit_measurements_, bounds, options_.fit);
      if (fit.summary.usable) {
        coefficients = fit.coefficients;
        fit_summary_ = fit.summary;
        refit = fit.summary;
      }
    } catch (const std::invalid_argument&) {
      // The fit data cannot separate the coefficients: the bound still limits every plan.
    }
  }
  MemoryModel corrected(formula, coefficients, model_->floor_bytes(), model_->batch_size_variable(),
                        options_.aggregation);
  corrected.set_infeasible_probes(std::move(bounds));
  keep_floor_and_range(*model_, corrected);
  if (refit) {
    take_single_record_fit(*refit, corrected);
  } else if (bound.dims.at(corrected.batch_size_index()) == 1) {
    corrected.set_single_record_coefficients({});  // the bound may be below their fit: the trend's safe side
  }
  corrected.metadata() = model_->metadata();
  corrected.metadata()["fit"]["infeasible_bound_count"] = corrected.infeasible_probes().size();
  ++corrections_;
  model_ = std::move(corrected);
  return *model_;
}

const MemoryModel& PredictiveBatcher::raise_floor_bytes(double floor_bytes) {
  if (!model_) throw std::logic_error("PredictiveBatcher: raise_floor_bytes before a model was set");
  if (floor_bytes <= model_->floor_bytes()) return *model_;
  MemoryModel raised(model_->formula(), model_->coefficients(), floor_bytes,
                     model_->batch_size_variable(), options_.aggregation);
  raised.set_infeasible_probes(model_->infeasible_probes());
  keep_floor_and_range(*model_, raised);
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
  const MemoryModel& planned_with = model();  // first: without a model, that is the error to give
  return packer_->pack(record_dims, planned_with, planning_bytes());
}

}  // namespace xpm
