// xpm/planner/memory_model.hpp — a fitted cost formula that predicts peak bytes for dims.
//
//   MemoryModel model(formula, fit.coefficients, /*floor_bytes=*/static_bytes, "bs",
//                     {{"l", DimAggregation::kMax}});
//   model.predict_bytes({8, 100});                 // max(floor, formula(8, 100))
//   model.max_microbatch_size({1, 100}, budget);   // largest bs whose prediction fits
//   model.save("model.json"); MemoryModel::load("model.json");
//
// Prediction is max(floor_bytes, formula(dims)): at small shapes the static memory (weights,
// gradients, optimizer state) dominates and a polynomial fitted where activations dominate
// would under-predict it (DESIGN.md section 3, "Peaks are a maximum over phases").
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"

namespace xpm {

/// How the records' dims combine into the dims of a batch, per variable.
enum class DimAggregation {
  kCount,  // number of records (the batch-size variable)
  kMax,    // maximum over records (padded length)
  kSum,    // sum over records (total tokens)
};

class MemoryModel {
 public:
  /// `batch_size_variable` must be a declared variable (aggregation kCount); every other
  /// variable aggregates by `aggregation[name]`, default kMax. Coefficients in
  /// formula.coefficient_names() order. Throws std::invalid_argument naming a bad argument.
  MemoryModel(CostFormula formula, std::vector<double> coefficients, double floor_bytes,
              std::string batch_size_variable,
              std::map<std::string, DimAggregation> aggregation = {});

  const CostFormula& formula() const { return formula_; }
  const std::vector<double>& coefficients() const { return coefficients_; }
  double floor_bytes() const { return floor_bytes_; }
  const std::string& batch_size_variable() const { return batch_size_variable_; }
  std::size_t batch_size_index() const { return batch_size_index_; }
  const std::vector<DimAggregation>& aggregation() const { return aggregation_; }  // per variable

  /// max(floor_bytes, formula(dims)); dims in variable_names() order.
  double predict_bytes(const std::vector<double>& dims) const;

  /// Largest microbatch size m in [1, max_size] such that predict_bytes(dims with
  /// batch-size variable = m) <= usable_bytes. The batch-size entry of `dims` is ignored.
  /// Never returns a size the model predicts over budget. Throws std::invalid_argument when even
  /// m = 1 is predicted over budget (message gives the prediction and the budget).
  std::int64_t max_microbatch_size(std::vector<double> dims, std::int64_t usable_bytes,
                                   std::int64_t max_size = std::int64_t{1} << 40) const;

  /// Extra information recorded in the JSON file (fit summary, probes, device, ...).
  nlohmann::json& metadata() { return metadata_; }
  const nlohmann::json& metadata() const { return metadata_; }

  /// JSON (format_version 1): format_version, formula {text, canonical, coefficient_names,
  /// variable_names}, coefficients {name: bytes}, floor_bytes, batch_size_variable,
  /// aggregation {variable: "count"|"max"|"sum"}, metadata {...}.
  nlohmann::json to_json() const;
  /// Throws std::invalid_argument naming the missing or bad field (e.g. "coefficients.b").
  /// formula.text is re-parsed with the stored names; formula.canonical is informative only.
  static MemoryModel from_json(const nlohmann::json& j);
  /// Writes atomically (temp file in the same folder, then rename). Throws std::runtime_error.
  void save(const std::string& path) const;
  /// Throws std::runtime_error (unreadable, not JSON) or std::invalid_argument (bad fields),
  /// naming the path.
  static MemoryModel load(const std::string& path);

 private:
  CostFormula formula_;
  std::vector<double> coefficients_;
  double floor_bytes_;
  std::string batch_size_variable_;
  std::size_t batch_size_index_;
  std::vector<DimAggregation> aggregation_;
  nlohmann::json metadata_ = nlohmann::json::object();
};

std::string to_string(DimAggregation a);             // "count" | "max" | "sum"
DimAggregation dim_aggregation_from_string(const std::string& s);  // throws std::invalid_argument

}  // namespace xpm
