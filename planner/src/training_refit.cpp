// The memory model refitted on training's peaks (training_refit.hpp).
#include "xpm/planner/training_refit.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <stdexcept>
#include <utility>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula_selection.hpp"
#include "xpm/planner/stable_hash.hpp"

namespace xpm {
namespace {

constexpr double kFloorMargin = 0.01;  // a peak within 1 % of the floor: the optimizer step set it

// (min, max) of the finite values; (inf, -inf) when none.
std::pair<double, double> finite_range(const std::vector<double>& values) {
  double low = std::numeric_limits<double>::infinity(), high = -low;
  for (double v : values) {
    if (!std::isfinite(v)) continue;
    low = std::min(low, v);
    high = std::max(high, v);
  }
  return {low, high};
}

// The median of `values` (not empty): the mean of the middle two when their count is even.
double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t half = values.size() / 2;
  return values.size() % 2 ? values[half] : (values[half - 1] + values[half]) / 2;
}

std::size_t finite_count(const std::vector<double>& values) {
  return static_cast<std::size_t>(std::count_if(values.begin(), values.end(), [](double v) { return std::isfinite(v); }));
}

std::string percent_range(std::pair<double, double> range) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%+.2f %% to %+.2f %%", 100 * range.first, 100 * range.second);
  return buf;
}

// A count of `field` in a state: a whole number in [least, 2^53].
std::int64_t state_count(const nlohmann::json& state, const char* field, std::int64_t least) {
  const nlohmann::json& value = state.at(field);
  if (!value.is_number_integer() || value.get<std::int64_t>() < least || value.get<std::int64_t>() > (1LL << 53))
    throw std::invalid_argument(std::string(field) + " must be a whole number >= " + std::to_string(least) +
                                ", got " + value.dump());
  return value.get<std::int64_t>();
}

// A refit region's ranges in a state: [[min, max], ...] in variable order.
nlohmann::json ranges_json(const std::vector<ProbedRange>& ranges) {
  nlohmann::json out = nlohmann::json::array();
  for (const ProbedRange& range : ranges) out.push_back({range.min, range.max});
  return out;
}

std::vector<ProbedRange> ranges_of_json(const nlohmann::json& value) {
  std::vector<ProbedRange> ranges;
  for (const nlohmann::json& range : value) {
    if (!range.is_array() || range.size() != 2)
      throw std::invalid_argument("training_ranges must be [min, max] per variable, got " + value.dump());
    ranges.push_back({range[0].get<double>(), range[1].get<double>()});
  }
  return ranges;
}



// The relative residuals of `points`' peaks from the line a + b x prediction closest to them
// (least squares of the relative residuals): what remains of the model's errors once a
// calibration line, an offset and a share of the prediction, has taken them off.
std::vector<double> line_residuals(const std::vector<double>& predicted, const std::vector<Measurement>& points) {
  double s11 = 0, s12 = 0, s22 = 0, t1 = 0, t2 = 0;  // normal equations of sum ((a + b p - y) / y)^2
  for (std::size_t i = 0; i < points.size(); ++i) {
    const double u = 1 / points[i].bytes, v = predicted[i] / points[i].bytes;
    s11 += u * u, s12 += u * v, s22 += v * v, t1 += u, t2 += v;
  }
  const double det = s11 * s22 - s12 * s12;
  const double a = det != 0 ? (t1 * s22 - t2 * s12) / det : 0;
  const double b = det != 0 ? (s11 * t2 - s12 * t1) / det : 1;
  std::vector<double> residuals;
  residuals.reserve(points.size());
  for (std::size_t i = 0; i < points.size(); ++i)
    residuals.push_back((a + b * predicted[i] - points[i].bytes) / points[i].bytes);
  return residuals;
}

int position_code(const std::optional<MicrobatchPosition>& position) {
  return position ? static_cast<int>(*position) : -1;
}

std::optional<MicrobatchPosition> position_of(double code, const std::string& field) {
  if (code == -1) return std::nullopt;
  if (!(code >= 0 && code < static_cast<double>(kMicrobatchPositions) && code == std::floor(code))) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%g", code);
    throw std::invalid_argument("training refit state: " + field + " must be -1 or a position 0 to 3, got " + buf);
  }
  return static_cast<MicrobatchPosition>(static_cast<int>(code));
}

}  // namespace

MemoryModel with_coefficients(const MemoryModel& model, const std::vector<double>& coefficients) {
  const std::vector<std::string>& names = model.formula().coefficient_names();
  if (coefficients.size() != names.size())
    throw std::invalid_argument("with_coefficients: " + std::to_string(coefficients.size()) + " coefficients for " +
                                std::to_string(names.size()));
  nlohmann::json j = model.to_json();
  nlohmann::json values = nlohmann::json::object();
  for (std::size_t k = 0; k < names.size(); ++k) values[names[k]] = coefficients[k];
  j["coefficients"] = std::move(values);
  return MemoryModel::from_json(j);
}

namespace {

MemoryModel with_formula(const MemoryModel& model, const CostFormula& formula, const std::vector<double>& coefficients) {
  nlohmann::json j = model.to_json();
  j["formula"] = {{"text", formula.text()},
                  {"canonical", formula.canonical()},
                  {"coefficient_names", formula.coefficient_names()},
                  {"variable_names", formula.variable_names()}};
  nlohmann::json values = nlohmann::json::object();
  for (std::size_t k = 0; k < coefficients.size(); ++k) values[formula.coefficient_names().at(k)] = coefficients[k];
  j["coefficients"] = std::move(values);
  j.erase("single_record_factor");
  j.erase("single_record_coefficients");
  // The phases' fits keep the formula they were fitted with (plan_step takes a phase over the
  // same variables): the probes measured those phases, training does not tell them apart.
  if (auto phases = j["metadata"].find("phases"); phases != j["metadata"].end() && phases->is_object()) {
    const nlohmann::json old_formula = model.to_json()["formula"];
    for (auto& [name, record] : phases->items())
      if (record.is_object() && !record.contains("formula")) record["formula"] = old_formula;
  }
  return MemoryModel::from_json(j);
}

}  // namespace

std::map<std::string, double> coefficients_by_name(const MemoryModel& model) {
  std::map<std::string, double> values;
  for (std::size_t k = 0; k < model.coefficients().size(); ++k)
    values[model.formula().coefficient_names()[k]] = model.coefficients()[k];
  return values;
}

MemoryModel refitted_model(const MemoryModel& model, const CostFormula& formula, const std::vector<double>& coefficients) {
  if (formula.canonical() == model.formula().canonical()) return with_coefficients(model, coefficients);
  if (coefficients.size() != formula.coefficient_names().size())
    throw std::invalid_argument("refitted_model: " + std::to_string(coefficients.size()) + " coefficients for " +
                                std::to_string(formula.coefficient_names().size()));
  return with_formula(model, formula, coefficients);
}

MemoryModel refitted_model(const MemoryModel& model, const std::string& formula_text,
                           const std::map<std::string, double>& coefficients) {
  const CostFormula formula = formula_text == model.formula().text()
                                  ? model.formula()
                                  : CostFormula::with_variables(formula_text, model.formula().variable_names());
  std::vector<double> values;
  for (const std::string& name : formula.coefficient_names()) {
    const auto it = coefficients.find(name);
    if (it == coefficients.end()) throw std::invalid_argument("refitted_model: no value of coefficient '" + name + "'");
    if (!(std::isfinite(it->second) && it->second >= 0))  // a refit's fit is non-negative
      throw std::invalid_argument("refitted_model: coefficient '" + name + "' must be a finite number >= 0, got " +
                                  std::to_string(it->second));
    values.push_back(it->second);
  }
  if (coefficients.size() != values.size())
    throw std::invalid_argument("refitted_model: " + std::to_string(coefficients.size()) + " coefficients given for " +
                                "the formula's " + std::to_string(values.size()));
  return refitted_model(model, formula, values);
}

MemoryModel refitted_model(const MemoryModel& model, const std::string& formula_text,
                           const std::map<std::string, double>& coefficients,
                           std::vector<ProbedRange> training_ranges) {
  MemoryModel refitted = refitted_model(model, formula_text, coefficients);
  refitted.set_refit_region({std::move(training_ranges), std::make_shared<const MemoryModel>(model)});
  return refitted;
}

TrainingRefit::TrainingRefit(MemoryModel model, TrainingRefitOptions options)
    : given_(model), model_(std::move(model)), options_(options) {
  if (options_.window_steps < 1)
    throw std::invalid_argument("TrainingRefit: window_steps must be >= 1, got " + std::to_string(options_.window_steps));
  if (!(options_.points_per_coefficient >= 1))
    throw std::invalid_argument("TrainingRefit: points_per_coefficient must be >= 1, got " +
                                std::to_string(options_.points_per_coefficient));
  if (!(options_.min_spread_gain >= 0))
    throw std::invalid_argument("TrainingRefit: min_spread_gain must be >= 0, got " +
                                std::to_string(options_.min_spread_gain));
  next_try_points_ = static_cast<std::size_t>(
      std::ceil(options_.points_per_coefficient * static_cast<double>(given_.formula().coefficient_names().size())));
}

void TrainingRefit::check_point(const TrainingPoint& point) const {
  const std::size_t variables = given_.formula().variable_names().size();
  if (point.dims.size() != variables)
    throw std::invalid_argument("TrainingRefit.end_step: a point has " + std::to_string(point.dims.size()) +
                                " dims, the formula " + std::to_string(variables) + " variables");
  for (double d : point.dims)
    if (!(std::isfinite(d) && d >= 0)) throw std::invalid_argument("TrainingRefit.end_step: dims must be finite and >= 0");
  if (!(std::isfinite(point.peak_bytes) && point.peak_bytes >= 0))
    throw std::invalid_argument("TrainingRefit.end_step: peak_bytes must be a finite number of bytes >= 0");
}

bool TrainingRefit::fitted(const TrainingPoint& point) const {
  if (point.position != MicrobatchPosition::kMiddle && point.position != MicrobatchPosition::kLast) return false;
  const bool own_single_fit = given_.single_record_factor() != 1 || !given_.single_record_coefficients().empty();
  if (own_single_fit && point.dims[given_.batch_size_index()] <= 1) return false;
  return point.peak_bytes > (1 + kFloorMargin) * given_.floor_bytes_at(point.dims);
}

std::vector<Measurement> TrainingRefit::fitted_points() const {
  std::vector<Measurement> points;
  for (const Step& step : window_) {
    if (step.run_first) continue;
    for (const TrainingPoint& point : step.points)
      if (fitted(point)) points.push_back({point.dims, point.peak_bytes});
  }
  return points;
}

std::optional<std::string> TrainingRefit::end_step(std::int64_t step, std::vector<TrainingPoint> points) {
  for (const TrainingPoint& point : points) check_point(point);
  window_.push_back({step, ++steps_seen_ == 1, std::move(points)});
  const auto counted = [this] {
    return std::count_if(window_.begin(), window_.end(), [](const Step& s) { return !s.run_first; });
  };
  while (counted() > options_.window_steps) window_.erase(window_.begin());
  const std::vector<Measurement> measured = fitted_points();
  const std::size_t least = static_cast<std::size_t>(
      std::ceil(options_.points_per_coefficient * static_cast<double>(given_.formula().coefficient_names().size())));
  if (measured.size() < least) return std::nullopt;
  // Counted in steps seen, not in `step` (an index within the epoch, which starts over).
  const bool grown = measured.size() >= next_try_points_;
  const bool turned_over = last_try_seen_ >= 0 && steps_seen_ - last_try_seen_ >= options_.window_steps;
  if (!grown && !turned_over) return std::nullopt;
  next_try_points_ = static_cast<std::size_t>(std::ceil(1.5 * static_cast<double>(measured.size())));
  last_try_seen_ = steps_seen_;
  return try_refit(step, measured);
}

std::optional<std::string> TrainingRefit::try_refit(std::int64_t step, const std::vector<Measurement>& points) {
  FitOptions options;
  options.batch_size_variable = given_.batch_size_variable();
  options.single_record_regime = false;
  FitResult fit;
  std::optional<CostFormula> chosen;
  try {
    if (selects_formula()) {
      FormulaSelection selection = select_formula(given_.formula().variable_names(), points,
                                                  given_.infeasible_probes(), selection_options(options));
      fit = std::move(selection.fit);
      if (selection.formula.canonical() != given_.formula().canonical()) chosen = std::move(selection.formula);
    } else {
      fit = fit_coefficients(given_.formula(), points, given_.infeasible_probes(), options);
    }
  } catch (const std::invalid_argument&) {
    return std::nullopt;  // the points cannot separate the coefficients: the model in force stays
  }
  const std::vector<double>& held_out = fit.summary.leave_one_out_rel_errors;
  if (!fit.summary.converged || 2 * finite_count(held_out) < points.size()) return std::nullopt;
  std::vector<double> predicted;
  predicted.reserve(points.size());
  for (const Measurement& m : points) predicted.push_back(model_.predict_bytes(m.dims));
  const auto after = finite_range(held_out);
  const auto before = finite_range(line_residuals(predicted, points));
  if (after.second - after.first + options_.min_spread_gain >= before.second - before.first) return std::nullopt;
  // From the formula's text and the coefficients by name, as a restored state builds it: the
  // same model bit for bit (a formula parsed anew may order its terms otherwise).
  const MemoryModel fitted = refitted_model(given_, chosen ? *chosen : given_.formula(), fit.coefficients);
  model_ = refitted_model(given_, fitted.formula().text(), coefficients_by_name(fitted),
                          MemoryModel::ranges_of(region_shapes(fitted, after)));
  refitted_ = true;
  log_.push_back("step " + std::to_string(step) + ": memory model refitted on " + std::to_string(points.size()) +
                 " training peaks (" + model_.formula().canonical() + "): leave-one-shape-out errors " +
                 percent_range(after) + ", the model in force's " + percent_range(before) + " after a line");
  return log_.back();
}

std::vector<std::vector<double>> TrainingRefit::region_shapes(const MemoryModel& refit,
                                                              std::pair<double, double> held_out) const {
  // Every shape of the window's fitted steps, their first microbatches' too.
  std::vector<std::vector<double>> shapes;
  std::array<std::vector<const TrainingPoint*>, kMicrobatchPositions + 1> run_first;  // by position, then none
  for (const Step& seen : window_)
    for (const TrainingPoint& point : seen.points) {
      if (seen.run_first)
        run_first[point.position ? static_cast<std::size_t>(*point.position) : kMicrobatchPositions].push_back(&point);
      else
        shapes.push_back(point.dims);
    }
  // The run's first step peaks without the optimizer's state (its first microbatch without the
  // gradients either): a shape of it joins where the refit, less its median excess over that
  // step's peaks at the same position, errs as little as where it was checked (its
  // leave-one-shape-out range, widened by min_spread_gain).
  for (const std::vector<const TrainingPoint*>& points : run_first) {
    if (points.empty()) continue;
    std::vector<double> excess;
    for (const TrainingPoint* point : points) excess.push_back(refit.predict_bytes(point->dims) - point->peak_bytes);
    const double offset_bytes = median(excess);
    for (std::size_t k = 0; k < points.size(); ++k) {
      const double steady_bytes = points[k]->peak_bytes + offset_bytes;
      const double error = (excess[k] - offset_bytes) / steady_bytes;
      if (steady_bytes > 0 && error >= held_out.first - options_.min_spread_gain &&
          error <= held_out.second + options_.min_spread_gain)
        shapes.push_back(points[k]->dims);
    }
  }
  return shapes;
}

bool TrainingRefit::selects_formula() const {
  // A formula of "auto", unless its fit of records alone (a regime of its own) would be lost.
  return given_.metadata().contains("formula_selection") && given_.single_record_factor() == 1 &&
         given_.single_record_coefficients().empty();
}

FormulaSelectionOptions TrainingRefit::selection_options(const FitOptions& fit) const {
  FormulaSelectionOptions options;
  options.batch_size_variable = given_.batch_size_variable();
  const std::vector<std::string>& names = given_.formula().variable_names();
  for (std::size_t v = 0; v < names.size(); ++v)
    if (given_.aggregation()[v] == DimAggregation::kSum) options.summed_variables.push_back(names[v]);
  options.max_pieces = 1;  // linear candidates: a few milliseconds each, tried again as the points grow
  options.floor = false;   // the model's floor is kept
  options.fit = fit;
  return options;
}

std::string TrainingRefit::digest(const MemoryModel& model) { return stable_hash_hex(model.to_json().dump()); }

std::vector<CalibrationStep> TrainingRefit::calibration_steps(const StepPhaseModels& given_phases) const {
  const StepPhaseModels phases = phases_beside(model_, given_phases);
  std::vector<CalibrationStep> steps;
  steps.reserve(window_.size());
  for (const Step& step : window_) {
    CalibrationStep out{step.step, step.run_first, {}};
    for (const TrainingPoint& point : step.points) {
      const double steady = model_.predict_bytes(point.dims);
      const double predicted =
          point.position ? phase_predicted_bytes(steady, point.dims, *point.position, phases) : steady;
      out.points.push_back({predicted, point.peak_bytes, point.position});
    }
    steps.push_back(std::move(out));
  }
  return steps;
}

nlohmann::json TrainingRefit::state() const {
  nlohmann::json window = nlohmann::json::array();
  for (const Step& step : window_) {
    nlohmann::json points = nlohmann::json::array();
    for (const TrainingPoint& point : step.points) {
      nlohmann::json row = point.dims;
      row.push_back(point.peak_bytes);
      row.push_back(position_code(point.position));
      points.push_back(std::move(row));
    }
    window.push_back({{"step", step.step}, {"run_first", step.run_first}, {"points", std::move(points)}});
  }
  return {{"window", std::move(window)},
          {"steps_seen", steps_seen_},
          {"next_try_points", next_try_points_},
          {"last_try_steps_seen", last_try_seen_},
          {"formula", refitted_ ? nlohmann::json(model_.formula().text()) : nlohmann::json(nullptr)},
          {"coefficients", refitted_ ? nlohmann::json(coefficients_by_name(model_)) : nlohmann::json(nullptr)},
          {"training_ranges", refitted_ ? ranges_json(model_.refit_region()->training_ranges) : nlohmann::json(nullptr)},
          {"given", digest(given_)},
          {"log", log_}};
}

void TrainingRefit::load_state(const nlohmann::json& state) {
  const std::size_t width = given_.formula().variable_names().size() + 2;
  std::vector<Step> window;
  try {
    if (state.at("given") != digest(given_))
      throw std::invalid_argument("written for another memory model (digest " + state.at("given").dump() +
                                  "), not the one this refit was given (" + digest(given_) + ")");
    for (const nlohmann::json& entry : state.at("window")) {
      Step step{entry.at("step").get<std::int64_t>(), entry.at("run_first").get<bool>(), {}};
      for (const nlohmann::json& row : entry.at("points")) {
        if (!row.is_array() || row.size() != width)
          throw std::invalid_argument("a point of step " + std::to_string(step.step) + " is not " +
                                      std::to_string(width) + " numbers (dims, peak_bytes, position)");
        std::vector<double> values = row.get<std::vector<double>>();
        TrainingPoint point{{values.begin(), values.end() - 2}, values[width - 2],
                            position_of(values[width - 1], "a point's position")};
        check_point(point);
        step.points.push_back(std::move(point));
      }
      window.push_back(std::move(step));
    }
    const nlohmann::json& coefficients = state.at("coefficients");
    MemoryModel model = coefficients.is_null()
                            ? given_
                            : refitted_model(given_, state.at("formula").get<std::string>(),
                                             coefficients.get<std::map<std::string, double>>(),
                                             ranges_of_json(state.at("training_ranges")));
    const std::int64_t steps_seen = state_count(state, "steps_seen", 0);
    const auto next_try = static_cast<std::size_t>(state_count(state, "next_try_points", 0));
    const std::int64_t last_try = state_count(state, "last_try_steps_seen", -1);
    std::vector<std::string> log = state.at("log").get<std::vector<std::string>>();
    window_ = std::move(window);
    model_ = std::move(model);
    refitted_ = !coefficients.is_null();
    steps_seen_ = steps_seen;
    next_try_points_ = next_try;
    last_try_seen_ = last_try;
    log_ = std::move(log);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(std::string("training refit state: ") + e.what());
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    throw std::invalid_argument(what.rfind("training refit state", 0) == 0 ? what : "training refit state: " + what);
  }
}

}  // namespace xpm
