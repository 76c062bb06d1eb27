// xpm/planner/memory_model.hpp — a fitted cost formula that predicts peak bytes for dims.
//
//   MemoryModel model(formula, fit.coefficients, /*floor_bytes=*/static_bytes, "bs",
//                     {{"l", DimAggregation::kMax}});
//   model.predict_bytes({8, 100});                 // max(floor, formula(8, 100))
//   model.max_microbatch_size({1, 100}, usable_bytes);  // largest bs whose prediction fits
//   model.save(path); MemoryModel::load(path);     // JSON (docs/file-formats.md)
//
// Prediction is max(floor_bytes, formula(dims)): at small shapes the static memory (weights,
// gradients, optimizer state) dominates and a polynomial fitted where activations dominate
// would under-predict it (docs/design.md, "Peaks are a maximum over phases").
//
// A floor that moves. When the optimizer step runs while tensors of the step are still alive
// (logits, loss, saved inputs), its peak grows with the dims; the model then carries a floor
// formula of its own, fitted to the optimizer-step peaks, and predicts
// max(floor_bytes, floor_formula(dims), formula(dims)):
//
//   model.set_floor_formula(FloorFormula{CostFormula("d*bs*l + f", {"d", "f"}, {"bs", "l"}),
//                                        {1200.0, 6.1e7}});
//
// Probed range. The model records the smallest and largest value of every variable over the
// probes it was fitted to (set_probed_ranges); extrapolation(dims) lists the variables of an
// answer that lie outside it (bs = 20 when the largest probe had bs = 8), so a caller can say
// that the prediction there is an extrapolation.
//
// Infeasible probes. The model keeps the probes that ran out of memory (dims and the capacity
// they ran under, InfeasibleBound) and never lets a microbatch dominate one: dims d dominate a
// probe at p when d[v] >= p[v] for every variable (bs included). For a cost that grows with
// every dim, such a microbatch would run out of memory too, whatever the formula predicts.
// The rule applies under a budget at or below the probe's capacity (usable_bytes <=
// exceeds_bytes); a larger budget is not bound by it. fits() and max_microbatch_size() apply it,
// and so do the packers.
//
//   model.set_infeasible_probes({{{64, 128}, 16e9}});   // bs=64, l=128 ran out of 16 GB
//   model.max_microbatch_size({1, 200}, usable);       // <= 63: l=200 >= 128
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "xpm/planner/calibration.hpp"
#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"

namespace xpm {

/// How the records' dims combine into the dims of a batch, per variable.
enum class DimAggregation {
  kCount,  // number of records (the batch-size variable)
  kMax,    // maximum over records (padded length)
  kSum,    // sum over records (total tokens)
};

/// A second formula over the model's variables whose value is a lower bound of the prediction
/// (the optimizer-step peak when it grows with the dims).
struct FloorFormula {
  CostFormula formula;               // same variable names, in the same order, as the model's
  std::vector<double> coefficients;  // formula.coefficient_names() order, bytes per term unit
};

/// Smallest and largest probed value of one variable.
struct ProbedRange {
  double min = 0;
  double max = 0;
};

/// A variable of an answer outside the probed range.
struct Extrapolation {
  std::string variable;  // e.g. "bs"
  double value = 0;      // the answer's value
  double probed_min = 0;
  double probed_max = 0;
  /// "bs = 20 is 2.5x the largest probed bs (8)" or "l = 4 is below the smallest probed l (16)".
  std::string describe() const;
};

class MemoryModel;

/// Where a model refitted on training's peaks (TrainingRefit) is known to hold: the range of
/// each variable over the shapes training had measured when it was refitted. Outside that box
/// (any variable outside its range) the model predicts what `outside` predicts (the model the
/// refit started from, fitted on probes across every variable's range), raised by the refit's
/// excess over it only where both the refit's formula there and its excess at the nearest shape
/// inside (each variable clamped to its range) say the refit is higher, by the smaller of the
/// two. A refit does not extrapolate to shapes training has not shown it, below the probes nor
/// far above them: a T5's refit on one step's 19 peaks put a microbatch of two records with
/// 33-token targets (the step's were 87 to 158) 24.8 % over its peak by its own formula; the
/// outside model, raised by the smaller excess, 2.1 %.
struct RefitRegion {
  std::vector<ProbedRange> training_ranges;  // variable_names() order
  std::shared_ptr<const MemoryModel> outside;
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

  /// max(floor_bytes, floor formula(dims) when set, formula(dims)); at batch size 1 the
  /// formula's part is times single_record_factor(), and the smaller of that and the formula
  /// with single_record_coefficients() when set (below); dims in variable_names() order. Outside
  /// a refit_region(), its outside model's prediction, raised as RefitRegion says. Throws
  /// std::invalid_argument for dims of the wrong width, not finite or negative (so do fits()
  /// and max_microbatch_size(), which call it).
  double predict_bytes(const std::vector<double>& dims) const;
  /// The bytes `dims`' records add: formula(dims) less formula(dims at batch size 0), at least
  /// 0 (floor and single-record factor and coefficients aside); dims in variable_names() order. Throws
  /// std::invalid_argument for dims of the wrong width.
  double added_bytes(const std::vector<double>& dims) const;

  /// Microbatches of one record peak above the trend of larger ones (FitSummary::
  /// single_record_factor): the formula's prediction at batch size 1 is scaled by this; 1 by
  /// default.
  double single_record_factor() const { return single_record_factor_; }
  /// Sets it. Throws std::invalid_argument unless finite and >= 1.
  void set_single_record_factor(double factor);
  /// Microbatches of one record peak below the trend of larger ones and follow the formula on
  /// their own (FitSummary::single_record_coefficients): at batch size 1 the formula's part is
  /// the smaller of its prediction with these coefficients and with coefficients(); empty (the
  /// default): coefficients() alone. coefficient_names() order.
  const std::vector<double>& single_record_coefficients() const { return single_record_coefficients_; }
  /// Sets them (empty: none). Throws std::invalid_argument unless one finite number per
  /// coefficient.
  void set_single_record_coefficients(std::vector<double> coefficients);

  /// The region a refit was fitted on (RefitRegion), or nullptr (every model the probes fit).
  const RefitRegion* refit_region() const { return refit_region_ ? &*refit_region_ : nullptr; }
  /// Sets it. Throws std::invalid_argument when the ranges are not one finite [min, max] per
  /// variable, or the outside model is missing or over other variables.
  void set_refit_region(RefitRegion region);
  /// Whether `dims` (variable_names() order) lie outside the refit region in some variable,
  /// where predict_bytes starts from the outside model's prediction; false without one.
  bool beyond_refit_region(const std::vector<double>& dims) const;

  /// The floor formula, or nullptr when the floor is the constant floor_bytes() alone.
  const FloorFormula* floor_formula() const { return floor_formula_ ? &*floor_formula_ : nullptr; }
  /// Sets it. Throws std::invalid_argument when its variable names differ from the model's or a
  /// coefficient count or value is wrong (not finite).
  void set_floor_formula(FloorFormula floor_formula);
  /// The floor at `dims`: max(floor_bytes, floor formula(dims)).
  double floor_bytes_at(const std::vector<double>& dims) const;

  /// Probed range per variable (variable_names() order); empty when not recorded.
  const std::vector<ProbedRange>& probed_ranges() const { return probed_ranges_; }
  /// Sets it. Throws std::invalid_argument when the size differs from the variable count or a
  /// range is not finite with min <= max.
  void set_probed_ranges(std::vector<ProbedRange> ranges);
  /// Smallest and largest value of every variable over `dims_list` (each variable_names()
  /// order); throws std::invalid_argument when the list is empty.
  static std::vector<ProbedRange> ranges_of(const std::vector<std::vector<double>>& dims_list);
  /// The variables of `dims` outside the probed range, in variable order; empty when inside or
  /// when no range is recorded.
  std::vector<Extrapolation> extrapolation(const std::vector<double>& dims) const;

  /// Probes that ran out of memory (dims in variable_names() order, capacity in bytes).
  const std::vector<InfeasibleBound>& infeasible_probes() const { return infeasible_probes_; }
  /// Replaces them. Throws std::invalid_argument naming the entry ("infeasible probe 1") when its
  /// dims have the wrong size or are not finite, or exceeds_bytes is not finite and > 0.
  void set_infeasible_probes(std::vector<InfeasibleBound> probes);
  /// The first infeasible probe that `dims` dominate (dims[v] >= probe.dims[v] for every v) and
  /// whose capacity is at or above `usable_bytes`; nullptr when none.
  const InfeasibleBound* dominated_infeasible_probe(const std::vector<double>& dims,
                                                    double usable_bytes) const;
  /// predict_bytes(dims) <= usable_bytes and no infeasible probe dominated (see above).
  bool fits(const std::vector<double>& dims, double usable_bytes) const;

  /// Largest microbatch size m in [1, max_size] such that m records with `dims` each fit
  /// (fits() at the batch-size variable = m, every summed variable (DimAggregation::kSum) = m
  /// times its value in `dims`, the others as given): predicted within budget, and below the
  /// batch size of every infeasible probe those dims reach. The batch-size entry of `dims` is
  /// ignored.
  /// Never returns a size the model predicts over budget. Throws std::invalid_argument when even
  /// m = 1 does not fit (message gives the prediction and the budget, or the infeasible probe).
  std::int64_t max_microbatch_size(std::vector<double> dims, std::int64_t usable_bytes,
                                   std::int64_t max_size = std::int64_t{1} << 40) const;

  /// The bytes this model's predictions may fill so that a step fits `usable_bytes`. A model
  /// probed under a caching allocator predicts allocated bytes and carries in its metadata the
  /// line to the reserved bytes its probes measured (metadata.reserved_gap: intercept_bytes,
  /// slope; reserved ~ prediction + intercept_bytes + slope x prediction): then
  /// (usable_bytes - intercept_bytes) / (1 + slope), at least 1; else usable_bytes. Throws
  /// std::invalid_argument for a malformed reserved_gap.
  std::int64_t prediction_budget_bytes(std::int64_t usable_bytes) const;
  /// metadata.reserved_gap as a Correction (zero when the model has none). Throws
  /// std::invalid_argument for a malformed reserved_gap.
  Correction reserved_gap() const;

  /// Extra information recorded in the JSON file (fit summary, probes, device, ...).
  nlohmann::json& metadata() { return metadata_; }
  const nlohmann::json& metadata() const { return metadata_; }

  /// JSON (format_version 1): format_version, formula {text, canonical, coefficient_names,
  /// variable_names}, coefficients {name: bytes}, floor_bytes, batch_size_variable,
  /// aggregation {variable: "count"|"max"|"sum"}, infeasible_probes [{dims: [...] in
  /// variable_names order, exceeds_bytes}] (optional when reading: missing = none),
  /// floor_formula {text, canonical, coefficient_names, coefficients {name: bytes}} (optional),
  /// probed_ranges {variable: [min, max]} (optional; when missing, taken from the feasible
  /// metadata.probes[].dims if there are any), single_record_factor (optional, default 1),
  /// single_record_coefficients {name: bytes} (optional, default none), refit_region
  /// {training_ranges {variable: [min, max]}, outside {a model's JSON}} (optional, default none),
  /// metadata {...}.
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
  // Throws std::invalid_argument "<where>: l = -4; dims must be finite and >= 0" (or the width).
  void check_dims(const std::vector<double>& dims, const char* where) const;
  // predict_bytes without the refit region: this model's own floor and formula.
  double own_prediction_bytes(const std::vector<double>& dims) const;
  CostFormula formula_;
  std::vector<double> coefficients_;
  double floor_bytes_;
  std::string batch_size_variable_;
  std::size_t batch_size_index_;
  std::vector<DimAggregation> aggregation_;
  std::vector<InfeasibleBound> infeasible_probes_;
  std::optional<FloorFormula> floor_formula_;
  std::vector<ProbedRange> probed_ranges_;
  double single_record_factor_ = 1;
  std::vector<double> single_record_coefficients_;
  std::optional<RefitRegion> refit_region_;
  nlohmann::json metadata_ = nlohmann::json::object();
};

std::string to_string(DimAggregation a);  // "count" | "max" | "sum"
/// Throws std::invalid_argument "<source> must be 'count', 'max' or 'sum', got '<text>'".
DimAggregation parse_dim_aggregation(const std::string& text, const std::string& source);

}  // namespace xpm
