// memory_model.cpp — MemoryModel: prediction, microbatch-size search, JSON file (see header).
#include "xpm/planner/memory_model.hpp"

#include "number_format.hpp"

#include "xpm/planner/atomic_file.hpp"
#include "xpm/planner/enum_names.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <utility>


namespace xpm {
namespace {

constexpr int kFormatVersion = 1;

using detail::format_double;

// A JSON value for an error message: compact, one line, at most ~60 characters.
std::string brief(const nlohmann::json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

[[noreturn]] void bad_field(const std::string& field, const std::string& why) {
  throw std::invalid_argument("memory model: field '" + field + "': " + why);
}

// GCC 14's -Wdangling-reference takes the field names' temporaries for what the result refers
// to; it refers into `j`.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 14
#define XPM_REFERS_INTO_ARGUMENT [[gnu::no_dangling]]
#else
#define XPM_REFERS_INTO_ARGUMENT
#endif

XPM_REFERS_INTO_ARGUMENT const nlohmann::json& required(const nlohmann::json& j, const std::string& key,
                                                        const std::string& field) {
  auto it = j.find(key);
  if (it == j.end()) bad_field(field, "missing");
  return *it;
}

std::string get_string(const nlohmann::json& j, const std::string& key, const std::string& field) {
  const nlohmann::json& v = required(j, key, field);
  if (!v.is_string()) bad_field(field, "expected a string, got " + brief(v));
  return v.get<std::string>();
}

double get_number(const nlohmann::json& v, const std::string& field) {
  if (!v.is_number()) bad_field(field, "expected a number, got " + brief(v));
  return v.get<double>();
}

// {name: bytes} with exactly the formula's coefficient names, in their order.
std::vector<double> coefficients_from_json(const nlohmann::json& j, const std::vector<std::string>& names,
                                           const std::string& field) {
  if (!j.is_object()) bad_field(field, "expected an object name -> bytes");
  std::vector<double> values;
  for (const std::string& name : names)
    values.push_back(get_number(required(j, name, field + "." + name), field + "." + name));
  for (const auto& item : j.items())
    if (std::find(names.begin(), names.end(), item.key()) == names.end())
      bad_field(field + "." + item.key(), "not a coefficient of the formula");
  return values;
}

std::vector<std::string> get_string_array(const nlohmann::json& j, const std::string& key,
                                          const std::string& field) {
  const nlohmann::json& v = required(j, key, field);
  if (!v.is_array()) bad_field(field, "expected an array of strings, got " + brief(v));
  std::vector<std::string> out;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string()) {
      bad_field(field + "[" + std::to_string(i) + "]", "expected a string, got " + brief(v[i]));
    }
    out.push_back(v[i].get<std::string>());
  }
  return out;
}

FloorFormula floor_formula_from_json(const nlohmann::json& jf,
                                     const std::vector<std::string>& var_names) {
  if (!jf.is_object()) bad_field("floor_formula", "expected an object");
  const std::string text = get_string(jf, "text", "floor_formula.text");
  const std::vector<std::string> names =
      get_string_array(jf, "coefficient_names", "floor_formula.coefficient_names");
  FloorFormula out{[&] {
                     try {
                       return CostFormula(text, names, var_names, CostFormulaOptions{true});
                     } catch (const std::invalid_argument& e) {
                       bad_field("floor_formula.text", e.what());
                     }
                   }(),
                   {}};
  const nlohmann::json& jc = required(jf, "coefficients", "floor_formula.coefficients");
  if (!jc.is_object()) bad_field("floor_formula.coefficients", "expected an object name -> bytes");
  for (const std::string& name : names) {
    out.coefficients.push_back(get_number(
        required(jc, name, "floor_formula.coefficients." + name), "floor_formula.coefficients." + name));
  }
  return out;
}

nlohmann::json ranges_to_json(const std::vector<ProbedRange>& ranges, const std::vector<std::string>& var_names) {
  nlohmann::json out = nlohmann::json::object();
  for (std::size_t v = 0; v < ranges.size(); ++v) out[var_names[v]] = {ranges[v].min, ranges[v].max};
  return out;
}

// {variable: [min, max]} for every variable, `field` naming it in errors.
std::vector<ProbedRange> ranges_from_json(const nlohmann::json& j, const std::vector<std::string>& var_names,
                                          const std::string& field) {
  if (!j.is_object()) bad_field(field, "expected an object variable -> [min, max]");
  std::vector<ProbedRange> ranges;
  for (const std::string& name : var_names) {
    const std::string at = field + "." + name;
    const nlohmann::json& range = required(j, name, at);
    if (!range.is_array() || range.size() != 2) bad_field(at, "expected [min, max], got " + brief(range));
    ranges.push_back({get_number(range[0], at + "[0]"), get_number(range[1], at + "[1]")});
  }
  return ranges;
}

// probed_ranges {variable: [min, max]}; without it, the range of the feasible probes in
// metadata.probes (files written before the field existed); empty when neither.
std::vector<ProbedRange> probed_ranges_from_json(const nlohmann::json& j,
                                                 const nlohmann::json& metadata,
                                                 const std::vector<std::string>& var_names) {
  std::vector<ProbedRange> ranges;
  if (auto it = j.find("probed_ranges"); it != j.end()) return ranges_from_json(*it, var_names, "probed_ranges");
  const auto probes = metadata.find("probes");
  if (probes == metadata.end() || !probes->is_array()) return ranges;
  std::vector<std::vector<double>> dims_list;
  for (const nlohmann::json& probe : *probes) {
    if (!probe.is_object() || !probe.contains("dims") || !probe["dims"].is_array() ||
        probe["dims"].size() != var_names.size() ||
        (probe.contains("feasible") && !(probe["feasible"].is_boolean() && probe["feasible"].get<bool>()))) {
      continue;
    }
    std::vector<double> dims;
    for (const nlohmann::json& d : probe["dims"]) {
      if (!d.is_number()) break;
      dims.push_back(d.get<double>());
    }
    if (dims.size() == var_names.size()) dims_list.push_back(std::move(dims));
  }
  if (!dims_list.empty()) ranges = MemoryModel::ranges_of(dims_list);
  return ranges;
}

// refit_region {training_ranges, outside}, its errors naming the field within it.
RefitRegion refit_region_from_json(const nlohmann::json& j, const std::vector<std::string>& var_names) {
  if (!j.is_object()) bad_field("refit_region", "expected an object {training_ranges, outside}");
  RefitRegion region;
  region.training_ranges = ranges_from_json(required(j, "training_ranges", "refit_region.training_ranges"), var_names,
                                          "refit_region.training_ranges");
  try {
    region.outside = std::make_shared<const MemoryModel>(
        MemoryModel::from_json(required(j, "outside", "refit_region.outside")));
  } catch (const std::invalid_argument& e) {  // "memory model: field 'x': ..." -> "... field 'refit_region.outside.x'"
    const std::string what = e.what(), prefix = "memory model: field '";
    if (what.rfind(prefix, 0) != 0) bad_field("refit_region.outside", what);
    throw std::invalid_argument(prefix + "refit_region.outside." + what.substr(prefix.size()));
  }
  return region;
}

}  // namespace

namespace {
constexpr EnumNames<DimAggregation, 3> kDimAggregationNames{
    {{DimAggregation::kCount, "count"}, {DimAggregation::kMax, "max"}, {DimAggregation::kSum, "sum"}}};
}  // namespace

std::string to_string(DimAggregation a) { return enum_name(kDimAggregationNames, a); }

DimAggregation parse_dim_aggregation(const std::string& text, const std::string& source) {
  return parse_enum(kDimAggregationNames, text, source);
}

MemoryModel::MemoryModel(CostFormula formula, std::vector<double> coefficients, double floor_bytes,
                         std::string batch_size_variable,
                         std::map<std::string, DimAggregation> aggregation)
    : formula_(std::move(formula)),
      coefficients_(std::move(coefficients)),
      floor_bytes_(floor_bytes),
      batch_size_variable_(std::move(batch_size_variable)),
      batch_size_index_(0) {
  const auto& coef_names = formula_.coefficient_names();
  const auto& vars = formula_.variable_names();
  if (coefficients_.size() != coef_names.size()) {
    throw std::invalid_argument("MemoryModel: " + std::to_string(coefficients_.size()) +
                                " coefficients given for " + std::to_string(coef_names.size()) +
                                " declared in the formula");
  }
  for (std::size_t k = 0; k < coefficients_.size(); ++k) {
    if (!std::isfinite(coefficients_[k])) {
      throw std::invalid_argument("MemoryModel: coefficient '" + coef_names[k] + "' = " +
                                  format_double(coefficients_[k]) + " is not finite");
    }
  }
  if (!(std::isfinite(floor_bytes_) && floor_bytes_ >= 0)) {
    throw std::invalid_argument("MemoryModel: floor_bytes must be finite and >= 0, got " +
                                format_double(floor_bytes_));
  }
  auto bs = std::find(vars.begin(), vars.end(), batch_size_variable_);
  if (bs == vars.end()) {
    throw std::invalid_argument("MemoryModel: batch-size variable '" + batch_size_variable_ +
                                "' is not a declared variable of the formula");
  }
  batch_size_index_ = static_cast<std::size_t>(bs - vars.begin());
  for (const auto& [name, how] : aggregation) {
    if (std::find(vars.begin(), vars.end(), name) == vars.end()) {
      throw std::invalid_argument("MemoryModel: aggregation given for '" + name +
                                  "', which is not a declared variable of the formula");
    }
    if (name == batch_size_variable_ && how != DimAggregation::kCount) {
      throw std::invalid_argument("MemoryModel: the batch-size variable '" + name +
                                  "' must aggregate by count, not " + to_string(how));
    }
  }
  aggregation_.resize(vars.size(), DimAggregation::kMax);
  for (std::size_t v = 0; v < vars.size(); ++v) {
    auto it = aggregation.find(vars[v]);
    if (it != aggregation.end()) aggregation_[v] = it->second;
  }
  aggregation_[batch_size_index_] = DimAggregation::kCount;
}

void MemoryModel::check_dims(const std::vector<double>& dims, const char* where) const {
  const auto& names = formula_.variable_names();
  if (dims.size() != names.size()) {
    throw std::invalid_argument(std::string(where) + ": got " + std::to_string(dims.size()) + " dims, expected " +
                                std::to_string(names.size()) + " (" + formula_.text() + ")");
  }
  for (std::size_t v = 0; v < names.size(); ++v) {
    if (!(std::isfinite(dims[v]) && dims[v] >= 0)) {
      throw std::invalid_argument(std::string(where) + ": " + names[v] + " = " + format_double(dims[v]) +
                                  "; dims must be finite and >= 0");
    }
  }
}

double MemoryModel::predict_bytes(const std::vector<double>& dims) const {
  check_dims(dims, "MemoryModel::predict_bytes");
  const double own = own_prediction_bytes(dims);
  if (!beyond_refit_region(dims)) return own;
  // Beyond the region: the outside model, raised by the refit's excess over it where both its
  // own formula there and its excess at the nearest shape inside (each variable clamped to its
  // range) say it is higher, by the smaller of the two.
  const std::vector<ProbedRange>& ranges = refit_region_->training_ranges;
  std::vector<double> nearest = dims;
  for (std::size_t v = 0; v < ranges.size() && v < nearest.size(); ++v)
    nearest[v] = std::clamp(nearest[v], ranges[v].min, ranges[v].max);
  const MemoryModel& outside = *refit_region_->outside;
  const double outside_bytes = outside.predict_bytes(dims);
  const double excess_at_edge = own_prediction_bytes(nearest) - outside.predict_bytes(nearest);
  return outside_bytes + std::max(0.0, std::min(own - outside_bytes, excess_at_edge));
}

double MemoryModel::own_prediction_bytes(const std::vector<double>& dims) const {
  double formula_bytes = formula_.predict(coefficients_, dims);
  if (dims.size() > batch_size_index_ && dims[batch_size_index_] == 1) {
    formula_bytes *= single_record_factor_;
    if (!single_record_coefficients_.empty())
      formula_bytes = std::min(formula_bytes, formula_.predict(single_record_coefficients_, dims));
  }
  return std::max(floor_bytes_at(dims), formula_bytes);
}

bool MemoryModel::beyond_refit_region(const std::vector<double>& dims) const {
  if (!refit_region_) return false;
  const std::vector<ProbedRange>& ranges = refit_region_->training_ranges;
  for (std::size_t v = 0; v < ranges.size() && v < dims.size(); ++v) {
    if (dims[v] < ranges[v].min || dims[v] > ranges[v].max) return true;
  }
  return false;
}

void MemoryModel::set_refit_region(RefitRegion region) {
  const std::vector<std::string>& variables = formula_.variable_names();
  if (region.outside == nullptr || region.outside->formula().variable_names() != variables)
    throw std::invalid_argument("MemoryModel: a refit region needs the model outside it, over the same variables");
  if (region.training_ranges.size() != variables.size())
    throw std::invalid_argument("MemoryModel: " + std::to_string(region.training_ranges.size()) +
                                " refit region ranges for " + std::to_string(variables.size()) + " variables");
  for (std::size_t v = 0; v < variables.size(); ++v) {
    const ProbedRange& range = region.training_ranges[v];
    if (!(std::isfinite(range.min) && std::isfinite(range.max) && range.min <= range.max))
      throw std::invalid_argument("MemoryModel: refit region range of " + variables[v] + " [" +
                                  format_double(range.min) + ", " + format_double(range.max) +
                                  "] is not finite with min <= max");
  }
  refit_region_ = std::move(region);
}

double MemoryModel::added_bytes(const std::vector<double>& dims) const {
  if (dims.size() != formula_.variable_names().size()) {
    throw std::invalid_argument("MemoryModel::added_bytes: " + std::to_string(dims.size()) + " dims for " +
                                std::to_string(formula_.variable_names().size()) + " variables");
  }
  std::vector<double> empty = dims;
  empty[batch_size_index_] = 0;
  return std::max(0.0, formula_.predict(coefficients_, dims) - formula_.predict(coefficients_, empty));
}

void MemoryModel::set_single_record_factor(double factor) {
  if (!(std::isfinite(factor) && factor >= 1)) {
    throw std::invalid_argument("MemoryModel: single_record_factor must be finite and >= 1, got " +
                                format_double(factor));
  }
  single_record_factor_ = factor;
}

void MemoryModel::set_single_record_coefficients(std::vector<double> coefficients) {
  const std::size_t expected = formula_.coefficient_names().size();
  if (!coefficients.empty() && coefficients.size() != expected)
    throw std::invalid_argument("MemoryModel: " + std::to_string(coefficients.size()) +
                                " single_record_coefficients given for " + std::to_string(expected) + " coefficients");
  for (std::size_t k = 0; k < coefficients.size(); ++k)
    if (!std::isfinite(coefficients[k]))
      throw std::invalid_argument("MemoryModel: single-record coefficient '" + formula_.coefficient_names()[k] +
                                  "' = " + format_double(coefficients[k]) + " is not finite");
  single_record_coefficients_ = std::move(coefficients);
}

double MemoryModel::floor_bytes_at(const std::vector<double>& dims) const {
  if (!floor_formula_) return floor_bytes_;
  return std::max(floor_bytes_, floor_formula_->formula.predict(floor_formula_->coefficients, dims));
}

void MemoryModel::set_floor_formula(FloorFormula floor_formula) {
  const CostFormula& f = floor_formula.formula;
  if (f.variable_names() != formula_.variable_names()) {
    throw std::invalid_argument("MemoryModel: the floor formula '" + f.text() +
                                "' must have the model's variables in the same order");
  }
  if (floor_formula.coefficients.size() != f.coefficient_names().size()) {
    throw std::invalid_argument("MemoryModel: " + std::to_string(floor_formula.coefficients.size()) +
                                " coefficients given for the floor formula '" + f.text() +
                                "', which declares " + std::to_string(f.coefficient_names().size()));
  }
  for (std::size_t k = 0; k < floor_formula.coefficients.size(); ++k) {
    if (!std::isfinite(floor_formula.coefficients[k])) {
      throw std::invalid_argument("MemoryModel: floor formula coefficient '" +
                                  f.coefficient_names()[k] + "' = " +
                                  format_double(floor_formula.coefficients[k]) + " is not finite");
    }
  }
  floor_formula_ = std::move(floor_formula);
}

void MemoryModel::set_probed_ranges(std::vector<ProbedRange> ranges) {
  if (!ranges.empty() && ranges.size() != formula_.variable_names().size()) {
    throw std::invalid_argument("MemoryModel: " + std::to_string(ranges.size()) +
                                " probed ranges for " +
                                std::to_string(formula_.variable_names().size()) + " variables");
  }
  for (std::size_t v = 0; v < ranges.size(); ++v) {
    if (!(std::isfinite(ranges[v].min) && std::isfinite(ranges[v].max) &&
          ranges[v].min <= ranges[v].max)) {
      throw std::invalid_argument("MemoryModel: probed range of " + formula_.variable_names()[v] +
                                  " [" + format_double(ranges[v].min) + ", " +
                                  format_double(ranges[v].max) + "] is not finite with min <= max");
    }
  }
  probed_ranges_ = std::move(ranges);
}

std::vector<ProbedRange> MemoryModel::ranges_of(const std::vector<std::vector<double>>& dims_list) {
  if (dims_list.empty()) throw std::invalid_argument("MemoryModel::ranges_of: no dims");
  std::vector<ProbedRange> out(dims_list.front().size());
  for (std::size_t v = 0; v < out.size(); ++v) out[v] = {dims_list.front()[v], dims_list.front()[v]};
  for (const std::vector<double>& dims : dims_list) {
    for (std::size_t v = 0; v < out.size() && v < dims.size(); ++v) {
      out[v].min = std::min(out[v].min, dims[v]);
      out[v].max = std::max(out[v].max, dims[v]);
    }
  }
  return out;
}

std::vector<Extrapolation> MemoryModel::extrapolation(const std::vector<double>& dims) const {
  std::vector<Extrapolation> out;
  for (std::size_t v = 0; v < probed_ranges_.size() && v < dims.size(); ++v) {
    const ProbedRange& range = probed_ranges_[v];
    if (dims[v] > range.max || dims[v] < range.min) {
      out.push_back({formula_.variable_names()[v], dims[v], range.min, range.max});
    }
  }
  return out;
}

std::string Extrapolation::describe() const {
  const auto number = [](double x, int digits) {
    std::ostringstream os;
    os.precision(digits);
    os << x;
    return os.str();
  };
  const auto dim = [&](double x) { return number(x, 6); };
  if (value > probed_max) {
    const std::string by = probed_max > 0 ? number(value / probed_max, 3) + "x"
                                          : dim(value - probed_max) + " above";
    return variable + " = " + dim(value) + " is " + by + " the largest probed " + variable +
           " (" + dim(probed_max) + ")";
  }
  return variable + " = " + dim(value) + " is below the smallest probed " + variable + " (" +
         dim(probed_min) + ")";
}

void MemoryModel::set_infeasible_probes(std::vector<InfeasibleBound> probes) {
  const auto& vars = formula_.variable_names();
  for (std::size_t i = 0; i < probes.size(); ++i) {
    const InfeasibleBound& p = probes[i];
    const std::string where = "MemoryModel: infeasible probe " + std::to_string(i);
    if (p.dims.size() != vars.size()) {
      throw std::invalid_argument(where + " has " + std::to_string(p.dims.size()) +
                                  " dims, expected " + std::to_string(vars.size()));
    }
    for (std::size_t v = 0; v < vars.size(); ++v) {
      if (!std::isfinite(p.dims[v])) {
        throw std::invalid_argument(where + " has " + vars[v] + " = " + format_double(p.dims[v]) +
                                    "; dims must be finite");
      }
    }
    if (!(std::isfinite(p.exceeds_bytes) && p.exceeds_bytes > 0)) {
      throw std::invalid_argument(where + " has exceeds_bytes = " +
                                  format_double(p.exceeds_bytes) + "; it must be finite and > 0");
    }
  }
  infeasible_probes_ = std::move(probes);
}

const InfeasibleBound* MemoryModel::dominated_infeasible_probe(const std::vector<double>& dims,
                                                               double usable_bytes) const {
  for (const InfeasibleBound& p : infeasible_probes_) {
    if (p.exceeds_bytes < usable_bytes || dims.size() != p.dims.size()) continue;
    bool dominates = true;
    for (std::size_t v = 0; v < dims.size() && dominates; ++v) dominates = dims[v] >= p.dims[v];
    if (dominates) return &p;
  }
  return nullptr;
}

bool MemoryModel::fits(const std::vector<double>& dims, double usable_bytes) const {
  // NaN predictions compare false, i.e. count as not fitting.
  return predict_bytes(dims) <= usable_bytes &&
         dominated_infeasible_probe(dims, usable_bytes) == nullptr;
}

std::int64_t MemoryModel::prediction_budget_bytes(std::int64_t usable_bytes) const {
  if (!metadata_.is_object() || !metadata_.contains("reserved_gap")) return usable_bytes;
  const double budget = reserved_gap().planning_bytes(static_cast<double>(usable_bytes));
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(budget));
}

Correction MemoryModel::reserved_gap() const {
  if (!metadata_.is_object() || !metadata_.contains("reserved_gap")) return {};
  const nlohmann::json& gap = metadata_.at("reserved_gap");
  if (!gap.is_object() || !gap.contains("intercept_bytes") || !gap.contains("slope") ||
      !gap.at("intercept_bytes").is_number() || !gap.at("slope").is_number() ||
      !(gap.at("slope").get<double>() > -1.0)) {
    throw std::invalid_argument("memory model: metadata.reserved_gap must hold intercept_bytes and slope (> -1), got " +
                                gap.dump());
  }
  return {gap.at("intercept_bytes").get<double>(), gap.at("slope").get<double>()};
}

std::int64_t MemoryModel::max_microbatch_size(std::vector<double> dims, std::int64_t usable_bytes,
                                              std::int64_t max_size) const {
  if (dims.size() != formula_.variable_names().size()) {
    throw std::invalid_argument("max_microbatch_size: got " + std::to_string(dims.size()) +
                                " dims, expected " +
                                std::to_string(formula_.variable_names().size()));
  }
  if (max_size < 1) {
    throw std::invalid_argument("max_microbatch_size: max_size must be >= 1, got " +
                                std::to_string(max_size));
  }
  const double budget = static_cast<double>(usable_bytes);
  // Below the batch size of every infeasible probe whose other dims these dims reach.
  for (const InfeasibleBound& p : infeasible_probes_) {
    if (p.exceeds_bytes < budget) continue;
    bool reaches = true;
    for (std::size_t v = 0; v < dims.size() && reaches; ++v) {
      reaches = v == batch_size_index_ || dims[v] >= p.dims[v];
    }
    if (!reaches) continue;
    const double below = std::ceil(p.dims[batch_size_index_]) - 1;
    if (below < 1) {
      dims[batch_size_index_] = 1;
      std::string at;
      for (std::size_t v = 0; v < dims.size(); ++v) {
        at += (v ? ", " : "") + formula_.variable_names()[v] + " = " + format_double(p.dims[v]);
      }
      throw std::invalid_argument(
          "max_microbatch_size: even a microbatch of 1 reaches a probe that ran out of memory at " +
          at + " under " + format_double(p.exceeds_bytes) + " bytes");
    }
    if (below < static_cast<double>(max_size)) max_size = static_cast<std::int64_t>(below);
  }
  // A summed variable grows with the records (a copy of the record's dims only then).
  const bool summed = std::find(aggregation_.begin(), aggregation_.end(), DimAggregation::kSum) != aggregation_.end();
  const std::vector<double> record = summed ? dims : std::vector<double>();
  auto fits_at = [&](std::int64_t m) {
    dims[batch_size_index_] = static_cast<double>(m);
    for (std::size_t v = 0; summed && v < dims.size(); ++v) {
      if (aggregation_[v] == DimAggregation::kSum) dims[v] = record[v] * static_cast<double>(m);
    }
    return fits(dims, budget);
  };
  if (!fits_at(1)) {
    throw std::invalid_argument(
        "max_microbatch_size: even a microbatch of 1 is predicted at " +
        format_double(predict_bytes(dims)) + " bytes, over the usable budget of " +
        std::to_string(usable_bytes) + " bytes");
  }
  // Invariant: `lo` was evaluated and fits; `hi` (when > lo) was evaluated and does not. The
  // answer is therefore always a verified size, even if the model is not monotone in the
  // batch size (then it is a fitting size, not necessarily the largest).
  std::int64_t lo = 1;
  std::int64_t hi = 0;
  while (true) {  // exponential phase
    const std::int64_t next = lo > max_size / 2 ? max_size : lo * 2;
    if (next == lo) return lo;  // lo == max_size
    if (!fits_at(next)) {
      hi = next;
      break;
    }
    lo = next;
  }
  while (hi - lo > 1) {  // binary phase
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (fits_at(mid)) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

nlohmann::json MemoryModel::to_json() const {
  const auto& coef_names = formula_.coefficient_names();
  const auto& vars = formula_.variable_names();
  nlohmann::json j;
  j["format_version"] = kFormatVersion;
  j["formula"] = {{"text", formula_.text()},
                  {"canonical", formula_.canonical()},
                  {"coefficient_names", coef_names},
                  {"variable_names", vars}};
  nlohmann::json coefs = nlohmann::json::object();
  for (std::size_t k = 0; k < coef_names.size(); ++k) coefs[coef_names[k]] = coefficients_[k];
  j["coefficients"] = std::move(coefs);
  j["floor_bytes"] = floor_bytes_;
  j["batch_size_variable"] = batch_size_variable_;
  nlohmann::json agg = nlohmann::json::object();
  for (std::size_t v = 0; v < vars.size(); ++v) agg[vars[v]] = to_string(aggregation_[v]);
  j["aggregation"] = std::move(agg);
  nlohmann::json infeasible = nlohmann::json::array();
  for (const InfeasibleBound& p : infeasible_probes_) {
    infeasible.push_back({{"dims", p.dims}, {"exceeds_bytes", p.exceeds_bytes}});
  }
  j["infeasible_probes"] = std::move(infeasible);
  if (floor_formula_) {
    const CostFormula& f = floor_formula_->formula;
    nlohmann::json floor_coefs = nlohmann::json::object();
    for (std::size_t k = 0; k < f.coefficient_names().size(); ++k) {
      floor_coefs[f.coefficient_names()[k]] = floor_formula_->coefficients[k];
    }
    j["floor_formula"] = {{"text", f.text()},
                          {"canonical", f.canonical()},
                          {"coefficient_names", f.coefficient_names()},
                          {"coefficients", std::move(floor_coefs)}};
  }
  if (!probed_ranges_.empty()) j["probed_ranges"] = ranges_to_json(probed_ranges_, vars);
  if (single_record_factor_ != 1) j["single_record_factor"] = single_record_factor_;
  if (!single_record_coefficients_.empty()) {
    nlohmann::json single = nlohmann::json::object();
    for (std::size_t k = 0; k < coef_names.size(); ++k) single[coef_names[k]] = single_record_coefficients_[k];
    j["single_record_coefficients"] = std::move(single);
  }
  if (refit_region_) {
    j["refit_region"] = {{"training_ranges", ranges_to_json(refit_region_->training_ranges, vars)},
                         {"outside", refit_region_->outside->to_json()}};
  }
  j["metadata"] = metadata_;
  return j;
}

MemoryModel MemoryModel::from_json(const nlohmann::json& j) {
  if (!j.is_object()) bad_field("(root)", "expected a JSON object");
  const nlohmann::json& version = required(j, "format_version", "format_version");
  if (!version.is_number_integer() || version.get<std::int64_t>() != kFormatVersion) {
    bad_field("format_version", "unsupported value " + brief(version) + "; expected " +
                                    std::to_string(kFormatVersion));
  }

  const nlohmann::json& jf = required(j, "formula", "formula");
  if (!jf.is_object()) bad_field("formula", "expected an object");
  const std::string text = get_string(jf, "text", "formula.text");
  std::vector<std::string> coef_names =
      get_string_array(jf, "coefficient_names", "formula.coefficient_names");
  std::vector<std::string> var_names =
      get_string_array(jf, "variable_names", "formula.variable_names");
  // formula.canonical is informative: the text is re-parsed, so a newer canonical printer
  // still reads older files. It must be a string when present.
  if (auto it = jf.find("canonical"); it != jf.end() && !it->is_string()) {
    bad_field("formula.canonical", "expected a string, got " + brief(*it));
  }
  CostFormula formula = [&] {
    try {
      // Non-linear terms allowed: the file holds a formula that was already fitted; for a
      // linear formula the result (canonical form, identity hash) is the same either way.
      return CostFormula(text, coef_names, var_names, CostFormulaOptions{true});
    } catch (const std::invalid_argument& e) {
      bad_field("formula.text", e.what());
    }
  }();

  std::vector<double> coefficients = coefficients_from_json(required(j, "coefficients", "coefficients"), coef_names,
                                                            "coefficients");

  const double floor_bytes = get_number(required(j, "floor_bytes", "floor_bytes"), "floor_bytes");
  const std::string bs = get_string(j, "batch_size_variable", "batch_size_variable");

  std::map<std::string, DimAggregation> aggregation;
  const nlohmann::json& ja = required(j, "aggregation", "aggregation");
  if (!ja.is_object()) bad_field("aggregation", "expected an object variable -> count|max|sum");
  for (const auto& item : ja.items()) {
    const std::string field = "aggregation." + item.key();
    if (!item.value().is_string()) bad_field(field, "expected a string, got " + brief(item.value()));
    try {
      aggregation[item.key()] = parse_dim_aggregation(item.value().get<std::string>(), "the value");
    } catch (const std::invalid_argument& e) {
      bad_field(field, e.what());
    }
  }

  // infeasible_probes: optional (files written before it existed have none).
  std::vector<InfeasibleBound> infeasible;
  if (auto it = j.find("infeasible_probes"); it != j.end()) {
    if (!it->is_array()) bad_field("infeasible_probes", "expected an array, got " + brief(*it));
    for (std::size_t i = 0; i < it->size(); ++i) {
      const std::string field = "infeasible_probes[" + std::to_string(i) + "]";
      const nlohmann::json& entry = (*it)[i];
      if (!entry.is_object()) bad_field(field, "expected an object {dims, exceeds_bytes}");
      const nlohmann::json& jd = required(entry, "dims", field + ".dims");
      if (!jd.is_array() || jd.size() != var_names.size()) {
        bad_field(field + ".dims", "expected an array of " + std::to_string(var_names.size()) +
                                       " numbers (variable_names order), got " + brief(jd));
      }
      InfeasibleBound probe;
      for (std::size_t v = 0; v < jd.size(); ++v) {
        probe.dims.push_back(get_number(jd[v], field + ".dims[" + std::to_string(v) + "]"));
      }
      probe.exceeds_bytes =
          get_number(required(entry, "exceeds_bytes", field + ".exceeds_bytes"),
                     field + ".exceeds_bytes");
      if (!(probe.exceeds_bytes > 0)) bad_field(field + ".exceeds_bytes", "must be > 0");
      infeasible.push_back(std::move(probe));
    }
  }

  nlohmann::json metadata = nlohmann::json::object();
  if (auto it = j.find("metadata"); it != j.end()) {
    if (!it->is_object()) bad_field("metadata", "expected an object");
    metadata = *it;
  }

  // The constructor's errors name the bad argument (floor_bytes, batch-size variable, ...).
  MemoryModel model(std::move(formula), std::move(coefficients), floor_bytes, bs,
                    std::move(aggregation));
  model.set_infeasible_probes(std::move(infeasible));
  if (auto it = j.find("floor_formula"); it != j.end()) {
    model.set_floor_formula(floor_formula_from_json(*it, var_names));
  }
  model.set_probed_ranges(probed_ranges_from_json(j, metadata, var_names));
  if (auto it = j.find("single_record_factor"); it != j.end()) {
    if (!it->is_number()) bad_field("single_record_factor", "expected a number >= 1");
    model.set_single_record_factor(it->get<double>());
  }
  if (auto it = j.find("single_record_coefficients"); it != j.end()) {
    model.set_single_record_coefficients(coefficients_from_json(*it, coef_names, "single_record_coefficients"));
  }
  if (auto it = j.find("refit_region"); it != j.end()) model.set_refit_region(refit_region_from_json(*it, var_names));
  model.metadata_ = std::move(metadata);
  return model;
}

void MemoryModel::save(const std::string& path) const {
  write_file_atomically(path, to_json().dump(2) + "\n");
}

MemoryModel MemoryModel::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::runtime_error("cannot read memory model '" + path + "': " + std::strerror(errno));
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error("memory model '" + path + "' is not valid JSON: " + e.what());
  }
  try {
    return from_json(j);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(path + ": " + e.what());
  }
}

}  // namespace xpm
