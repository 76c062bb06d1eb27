// xpm._planner: the planner core for Python, without LibTorch (it imports next to any torch).
// The Pythonic layer over it is python/xpm/*.py; names and units are documented there.
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <iomanip>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "xpm/planner/budget.hpp"
#include "xpm/planner/calibration.hpp"
#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"
#include "xpm/planner/formula_selection.hpp"
#include "xpm/planner/memory_model.hpp"
#include "xpm/planner/packer.hpp"
#include "xpm/planner/packer_kind.hpp"
#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner/rank_assignment.hpp"
#include "xpm/planner/step_plan.hpp"
#include "xpm/planner/training_refit.hpp"
#include "xpm/planner/record_dims_view.hpp"

namespace py = pybind11;

namespace {

using DoubleArray = py::array_t<double, py::array::c_style | py::array::forcecast>;

// A [n, v] array's buffer (a [n] array is n records of one variable) as a view of n records of
// v dims, without copying: valid while `array` lives and is not written to.
xpm::RecordDimsView view_of(const DoubleArray& array, std::size_t variables, const char* what) {
  if (array.ndim() != 1 && array.ndim() != 2) throw std::invalid_argument(std::string(what) + " must be a 1-D or 2-D array");
  const auto n = static_cast<std::size_t>(array.shape(0));
  const std::size_t width = array.ndim() == 2 ? static_cast<std::size_t>(array.shape(1)) : 1;
  if (width != variables) {
    throw std::invalid_argument(std::string(what) + " has " + std::to_string(width) + " column(s), the formula " +
                                std::to_string(variables) + " variable(s)");
  }
  return xpm::RecordDimsView(array.data(), n, width);  // C-contiguous float64 (DoubleArray's flags)
}

// Rows of a [n, v] array as one vector each (for the calls that take that type).
std::vector<std::vector<double>> rows_of(const DoubleArray& array, std::size_t variables, const char* what) {
  const xpm::RecordDimsView view = view_of(array, variables, what);
  std::vector<std::vector<double>> rows(view.records);
  for (std::size_t i = 0; i < view.records; ++i) rows[i].assign(view.row(i), view.row(i) + view.variables);
  return rows;
}

std::shared_ptr<const xpm::MicrobatchPacker> packer_named(const std::string& name, const std::string& sort_by) {
  const xpm::PackerKind kind = xpm::parse_packer_kind(name, "packer");
  return xpm::make_packer(kind, xpm::packer_takes_sort_by(kind) ? sort_by : "");
}

// A plan as flat arrays: record indices of every microbatch one after the other, offsets
// (m + 1) into them, each microbatch's dims [m, v], predicted bytes [m], over-budget flags [m].
py::tuple flat_plan(const xpm::MicrobatchPlan& plan, std::size_t variables) {
  const std::size_t m = plan.microbatches.size();
  std::size_t total = 0;
  for (const xpm::Microbatch& mb : plan.microbatches) total += mb.record_indices.size();
  py::array_t<std::int64_t> indices(static_cast<py::ssize_t>(total));
  py::array_t<std::int64_t> offsets(static_cast<py::ssize_t>(m + 1));
  py::array_t<double> dims({static_cast<py::ssize_t>(m), static_cast<py::ssize_t>(variables)});
  py::array_t<double> predicted(static_cast<py::ssize_t>(m));
  py::array_t<bool> over(static_cast<py::ssize_t>(m));
  auto o = offsets.mutable_unchecked<1>();
  auto d = dims.mutable_unchecked<2>();
  auto p = predicted.mutable_unchecked<1>();
  auto b = over.mutable_unchecked<1>();
  std::int64_t* index = indices.mutable_data();
  std::size_t at = 0;
  for (std::size_t k = 0; k < m; ++k) {
    const xpm::Microbatch& mb = plan.microbatches[k];
    o(k) = static_cast<std::int64_t>(at);
    std::transform(mb.record_indices.begin(), mb.record_indices.end(), index + at,
                   [](std::size_t r) { return static_cast<std::int64_t>(r); });
    at += mb.record_indices.size();
    for (std::size_t v = 0; v < variables; ++v) d(k, v) = mb.dims[v];
    p(k) = mb.predicted_bytes;
    b(k) = mb.over_budget;
  }
  o(m) = static_cast<std::int64_t>(at);
  return py::make_tuple(indices, offsets, dims, predicted, over);
}

// Packs the array's rows in place: the packer reads the NumPy buffer (no copy; `record_dims`
// holds a reference to the array, so it lives until the plan is made) with the GIL released.
py::tuple pack(const std::string& packer, const std::string& sort_by, const DoubleArray& record_dims,
               const xpm::MemoryModel& model, std::int64_t usable_bytes) {
  const std::size_t variables = model.formula().variable_names().size();
  const xpm::RecordDimsView view = view_of(record_dims, variables, "record dims");
  const std::shared_ptr<const xpm::MicrobatchPacker> chosen = packer_named(packer, sort_by);
  xpm::MicrobatchPlan plan;
  {
    py::gil_scoped_release release;
    plan = chosen->pack(view, model, usable_bytes);
  }
  return flat_plan(plan, variables);
}

// plan_step (step_plan.hpp): (shares, [flat plan of each rank]), indices into the outer batch;
// the phase models (StepPhaseModels) None where the model has no fit of that phase.
py::tuple plan_step(const std::string& packer, const std::string& sort_by, const DoubleArray& record_dims,
                    const xpm::MemoryModel& model, std::int64_t planning_bytes, int world_size, bool lockstep,
                    int only_rank, const xpm::MemoryModel* first_of_several, const xpm::MemoryModel* first_alone,
                    const xpm::MemoryModel* synchronised) {
  const std::size_t variables = model.formula().variable_names().size();
  const std::vector<std::vector<double>> rows = rows_of(record_dims, variables, "record dims");
  const std::shared_ptr<const xpm::MicrobatchPacker> chosen = packer_named(packer, sort_by);
  xpm::StepPlan step;
  {
    py::gil_scoped_release release;
    step = xpm::plan_step(rows, model, *chosen, planning_bytes,
                          {world_size, lockstep, only_rank, {first_of_several, first_alone, synchronised}});
  }
  py::list plans;
  for (const xpm::MicrobatchPlan& plan : step.rank_plans) plans.append(flat_plan(plan, variables));
  return py::make_tuple(step.assignment.records_per_rank, plans);
}

py::array_t<double> predict(const xpm::MemoryModel& model, const DoubleArray& dims) {
  const std::vector<std::vector<double>> rows = rows_of(dims, model.formula().variable_names().size(), "dims");
  py::array_t<double> out(static_cast<py::ssize_t>(rows.size()));
  auto o = out.mutable_unchecked<1>();
  for (std::size_t i = 0; i < rows.size(); ++i) o(i) = model.predict_bytes(rows[i]);
  return out;
}

// Each record's share of the largest microbatch of its kind (record_costs_bytes): what the rank
// assignment balances, as the C++ data-parallel step does.
py::array_t<double> record_costs(const xpm::MemoryModel& model, const DoubleArray& record_dims,
                                 std::int64_t usable_bytes, std::int64_t max_records) {
  const std::vector<double> costs = xpm::record_costs_bytes(
      model, rows_of(record_dims, model.formula().variable_names().size(), "record dims"), usable_bytes, max_records);
  return py::array_t<double>(static_cast<py::ssize_t>(costs.size()), costs.data());
}

std::map<std::string, xpm::DimAggregation> aggregation_of(const std::map<std::string, std::string>& names) {
  std::map<std::string, xpm::DimAggregation> out;
  for (const auto& [variable, name] : names) out[variable] = xpm::parse_dim_aggregation(name, "aggregation['" + variable + "']");
  return out;
}

py::dict summary_dict(const xpm::FitSummary& s) {
  py::dict d;
  d["converged"] = s.converged;
  d["usable"] = s.usable;
  d["reasons"] = s.reasons;
  d["max_rel_error"] = s.max_rel_error;
  d["mean_rel_error"] = s.mean_rel_error;
  d["rel_errors"] = s.rel_errors;
  d["leave_one_out_max_rel_error"] = s.leave_one_out_max_rel_error;
  d["leave_one_out_rel_errors"] = s.leave_one_out_rel_errors;
  d["surrounded_held_out_max_rel_error"] = s.surrounded_held_out_max_rel_error;
  d["extrapolated_held_out_max_rel_error"] = s.extrapolated_held_out_max_rel_error;
  d["held_out_extrapolated"] = s.held_out_extrapolated;
  d["held_out_undetermined"] = s.held_out_undetermined;
  d["held_out_note"] = s.held_out_note;
  d["iterations"] = s.iterations;
  d["linear"] = s.linear;
  d["brief_report"] = s.brief_report();
  d["full_report"] = s.full_report();
  return d;
}

struct FitArguments {
  double floor_bytes = 0;
  std::string batch_size_variable;
  std::map<std::string, std::string> aggregation;
  bool non_negative = true;
  double usable_max_rel_error = xpm::FitOptions{}.usable_max_rel_error;
  std::vector<std::string> automatic_variables;  // non-empty: choose the formula over these
};

// Fits `formula` to measured peaks (and infeasible bounds); returns the model and the summary.
py::tuple fit(const xpm::CostFormula& given, const DoubleArray& dims, const DoubleArray& peak_bytes,
              const DoubleArray& infeasible_dims, const DoubleArray& infeasible_bytes, const FitArguments& args) {
  xpm::CostFormula formula = given;
  const std::size_t variables = formula.variable_names().size();
  const std::vector<std::vector<double>> rows = rows_of(dims, variables, "dims");
  const std::vector<std::vector<double>> peaks = rows_of(peak_bytes, 1, "peak_bytes");
  if (peaks.size() != rows.size()) throw std::invalid_argument("dims and peak_bytes differ in length");
  std::vector<xpm::Measurement> measurements;
  for (std::size_t i = 0; i < rows.size(); ++i) measurements.push_back({rows[i], peaks[i][0]});
  const std::vector<std::vector<double>> bound_rows = rows_of(infeasible_dims, variables, "infeasible dims");
  const std::vector<std::vector<double>> bound_bytes = rows_of(infeasible_bytes, 1, "infeasible bytes");
  if (bound_rows.size() != bound_bytes.size()) throw std::invalid_argument("infeasible dims and bytes differ in length");
  std::vector<xpm::InfeasibleBound> bounds;
  for (std::size_t i = 0; i < bound_rows.size(); ++i) bounds.push_back({bound_rows[i], bound_bytes[i][0]});
  const std::string bs = args.batch_size_variable.empty() ? formula.variable_names().at(0) : args.batch_size_variable;
  xpm::FitOptions options;
  options.non_negative = args.non_negative;
  options.batch_size_variable = bs;
  options.usable_max_rel_error = args.usable_max_rel_error;
  xpm::FitResult result;
  std::string selection_report;
  {
    py::gil_scoped_release release;
    if (args.automatic_variables.empty()) {
      result = xpm::fit_coefficients(formula, measurements, bounds, options);
    } else {
      xpm::FormulaSelectionOptions selection;
      selection.batch_size_variable = bs;
      selection.fit = options;
      for (const auto& [name, how] : args.aggregation) {
        if (how == "sum") selection.summed_variables.push_back(name);
      }
      xpm::FormulaSelection chosen = xpm::select_formula(args.automatic_variables, measurements, bounds, selection);
      formula = chosen.formula;
      result = std::move(chosen.fit);
      selection_report = chosen.report();
    }
  }
  xpm::MemoryModel model(formula, result.coefficients, args.floor_bytes, bs, aggregation_of(args.aggregation));
  model.set_infeasible_probes(bounds);
  model.set_single_record_factor(result.summary.single_record_factor);
  model.set_single_record_coefficients(result.summary.single_record_coefficients);
  model.set_probed_ranges(xpm::MemoryModel::ranges_of(rows));
  if (!selection_report.empty()) {
    model.metadata()["formula_selection"] = {{"chosen", formula.canonical()}, {"report", selection_report}};
  }
  return py::make_tuple(model, summary_dict(result.summary), selection_report);
}

// A probe executor written in Python: run_probe(dims) -> ProbeResult, static_bytes() -> float.
class PythonProbeExecutor : public xpm::ProbeExecutor {
 public:
  using xpm::ProbeExecutor::ProbeExecutor;
  xpm::ProbeResult run_probe(const std::vector<double>& dims) override {
    PYBIND11_OVERRIDE_PURE(xpm::ProbeResult, xpm::ProbeExecutor, run_probe, dims);
  }
  xpm::ProbeResult run_probe_records(const std::vector<std::vector<double>>& records) override {
    PYBIND11_OVERRIDE(xpm::ProbeResult, xpm::ProbeExecutor, run_probe_records, records);
  }
  double static_bytes() override { PYBIND11_OVERRIDE_PURE(double, xpm::ProbeExecutor, static_bytes, ); }
};

struct ProbeArguments {
  std::string batch_size_variable = xpm::PredictiveBatcherOptions{}.batch_size_variable;
  std::map<std::string, std::string> aggregation;
  std::vector<std::map<std::string, double>> probe_points;
  std::map<std::string, double> variable_max;
  std::vector<std::vector<double>> record_dims_sample;
  std::vector<double> design_fractions = xpm::PredictiveBatcherOptions{}.design_fractions;
  double usable_max_rel_error = xpm::FitOptions{}.usable_max_rel_error;
  bool automatic_formula = false;  // the formula's variables only; the formula chosen from the probes
  xpm::AdaptiveDesignOptions adaptive;
};

py::dict adaptive_dict(const xpm::AdaptiveDesignReport& r, const xpm::CostFormula& formula) {
  py::dict d;
  d["stop"] = xpm::to_string(r.stop);
  d["added_probes"] = r.added_probes;
  d["elapsed_s"] = r.elapsed_s;
  d["disagreement"] = r.disagreement;
  d["disagreement_dims"] = r.disagreement_dims;
  d["report"] = r.describe(formula);
  return d;
}

// The C++ probe design and fit over a Python executor: (model, probes, fit summary, floor report).
py::tuple probe_and_fit(xpm::ProbeExecutor& executor, const xpm::CostFormula& formula,
                        const xpm::MemoryBudget& budget, const ProbeArguments& args) {
  xpm::PredictiveBatcherOptions options;
  options.formula = formula;
  options.batch_size_variable = args.batch_size_variable;
  options.aggregation = aggregation_of(args.aggregation);
  for (const auto& point : args.probe_points) options.probe_points.push_back({point});
  options.variable_max = args.variable_max;
  options.record_dims_sample = args.record_dims_sample;
  options.design_fractions = args.design_fractions;
  options.budget = budget;
  options.fit.usable_max_rel_error = args.usable_max_rel_error;
  options.adaptive = args.adaptive;
  if (args.automatic_formula) options.formula_choice = xpm::FormulaChoice::kAutomatic;
  xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::AdaptivePacker>());
  batcher.probe_and_fit(executor);
  return py::make_tuple(batcher.model(), batcher.probes(), summary_dict(batcher.fit_summary()),
                        batcher.floor_fit().report, adaptive_dict(batcher.adaptive_report(), batcher.model().formula()),
                        batcher.selection_report());
}

void register_formula_error(py::module_& m) {
  static py::exception<xpm::FormulaError> formula_error(m, "FormulaError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) std::rethrow_exception(thrown);
    } catch (const xpm::FormulaError& error) {
      py::object type = py::reinterpret_borrow<py::object>(formula_error.ptr());
      py::object instance = type(error.what());
      const bool positioned = error.position() != std::string::npos;
      instance.attr("position") = positioned ? py::cast(error.position()) : py::none();
      instance.attr("column") = positioned ? py::cast(error.position() + 1) : py::none();
      instance.attr("symbol") = error.symbol();
      instance.attr("brief") = error.brief();
      PyErr_SetObject(formula_error.ptr(), instance.ptr());
    }
  });
}

void bind_formula(py::module_& m) {
  py::class_<xpm::CostFormula>(m, "CostFormula")
      .def(py::init([](const std::string& text, const std::vector<std::string>& variables,
                       const std::optional<std::vector<std::string>>& coefficients, bool allow_nonlinear) {
             xpm::CostFormulaOptions options;
             options.allow_nonlinear = allow_nonlinear;
             return coefficients ? xpm::CostFormula(text, *coefficients, variables, options)
                                 : xpm::CostFormula::with_variables(text, variables, options);
           }),
           py::arg("text"), py::arg("variables"), py::arg("coefficients") = py::none(),
           py::arg("allow_nonlinear") = false)
      .def_property_readonly("text", &xpm::CostFormula::text)
      .def_property_readonly("canonical", &xpm::CostFormula::canonical)
      .def_property_readonly("coefficient_names", &xpm::CostFormula::coefficient_names)
      .def_property_readonly("variable_names", &xpm::CostFormula::variable_names)
      .def_property_readonly("is_linear", &xpm::CostFormula::is_linear)
      .def_property_readonly("identity_hash", &xpm::CostFormula::identity_hash)
      .def("predict", &xpm::CostFormula::predict, py::arg("coefficients"), py::arg("dims"))
      .def("__repr__", [](const xpm::CostFormula& f) { return "CostFormula('" + f.canonical() + "')"; });
}

void bind_model(py::module_& m) {
  py::class_<xpm::MemoryModel>(m, "MemoryModel")
      .def_static("from_json", [](const std::string& text) { return xpm::MemoryModel::from_json(nlohmann::json::parse(text)); })
      .def("to_json", [](const xpm::MemoryModel& model) { return model.to_json().dump(2); })
      .def_static("load", &xpm::MemoryModel::load, py::arg("path"))
      .def("save", &xpm::MemoryModel::save, py::arg("path"))
      .def_property_readonly("formula", &xpm::MemoryModel::formula)
      .def_property_readonly("coefficients", &xpm::MemoryModel::coefficients)
      .def_property_readonly("floor_bytes", &xpm::MemoryModel::floor_bytes)
      .def_property_readonly("batch_size_variable", &xpm::MemoryModel::batch_size_variable)
      .def_property_readonly("single_record_factor", &xpm::MemoryModel::single_record_factor)
      .def_property_readonly("single_record_coefficients", &xpm::MemoryModel::single_record_coefficients)
      .def_property_readonly("refit_outside",
                             [](const xpm::MemoryModel& model) -> std::optional<xpm::MemoryModel> {
                               if (model.refit_region() == nullptr) return std::nullopt;
                               return *model.refit_region()->outside;
                             })
      .def_property_readonly("refit_training_ranges",
                             [](const xpm::MemoryModel& model) -> std::optional<std::vector<std::pair<double, double>>> {
                               if (model.refit_region() == nullptr) return std::nullopt;
                               std::vector<std::pair<double, double>> out;
                               for (const xpm::ProbedRange& r : model.refit_region()->training_ranges)
                                 out.emplace_back(r.min, r.max);
                               return out;
                             })
      .def("predict_bytes", &xpm::MemoryModel::predict_bytes, py::arg("dims"))
      .def("prediction_budget_bytes", &xpm::MemoryModel::prediction_budget_bytes, py::arg("usable_bytes"))
      .def("max_microbatch_size", &xpm::MemoryModel::max_microbatch_size, py::arg("dims"), py::arg("usable_bytes"),
           py::arg("max_size") = std::int64_t{1} << 40);
  m.def("predict", &predict);
  m.def("record_costs", &record_costs);
}

void bind_budget(py::module_& m) {
  py::class_<xpm::MemoryBudget>(m, "MemoryBudget")
      .def(py::init([](std::int64_t capacity_bytes, double memory_fraction, std::int64_t extra_overhead_bytes) {
             xpm::MemoryBudget budget{capacity_bytes, memory_fraction, extra_overhead_bytes};
             budget.validate();
             return budget;
           }),
           py::arg("capacity_bytes"), py::arg("memory_fraction") = xpm::MemoryBudget{}.memory_fraction,
           py::arg("extra_overhead_bytes") = 0)
      .def_readonly("capacity_bytes", &xpm::MemoryBudget::capacity_bytes)
      .def_readonly("memory_fraction", &xpm::MemoryBudget::memory_fraction)
      .def_readonly("extra_overhead_bytes", &xpm::MemoryBudget::extra_overhead_bytes)
      .def_property_readonly("usable_bytes", &xpm::MemoryBudget::usable_bytes);
}

// "ProbeResult(dims=[8, 120], feasible=True, forward_backward_peak_bytes=..., ...)": what a
// probe measured, readable where a probe list is printed.
std::string probe_result_repr(const xpm::ProbeResult& r) {
  std::ostringstream os;
  os << "ProbeResult(dims=[";
  for (std::size_t i = 0; i < r.dims.size(); ++i) os << (i ? ", " : "") << r.dims[i];
  os << "], feasible=" << (r.feasible ? "True" : "False")
     << ", forward_backward_peak_bytes=" << std::fixed << std::setprecision(0) << r.forward_backward_peak_bytes
     << ", optimizer_step_peak_bytes=" << r.optimizer_step_peak_bytes;
  if (!r.feasible) os << ", capacity_bytes=" << r.capacity_bytes;
  os << std::defaultfloat << std::setprecision(6) << ", forward_backward_s=" << r.forward_backward_s;
  if (!r.error.empty()) os << ", error=" << py::repr(py::str(r.error)).cast<std::string>();
  os << ")";
  return os.str();
}

void bind_probing(py::module_& m) {
  py::class_<xpm::ProbeResult>(m, "ProbeResult")
      .def(py::init<>())
      .def_readwrite("dims", &xpm::ProbeResult::dims)
      .def_readwrite("feasible", &xpm::ProbeResult::feasible)
      .def_readwrite("forward_backward_peak_bytes", &xpm::ProbeResult::forward_backward_peak_bytes)
      .def_readwrite("optimizer_step_peak_bytes", &xpm::ProbeResult::optimizer_step_peak_bytes)
      .def_readwrite("duration_s", &xpm::ProbeResult::duration_s)
      .def_readwrite("forward_backward_s", &xpm::ProbeResult::forward_backward_s)
      .def_readwrite("error", &xpm::ProbeResult::error)
      .def_readwrite("capacity_bytes", &xpm::ProbeResult::capacity_bytes)
      .def_property_readonly("step_peak_bytes", &xpm::ProbeResult::step_peak_bytes)
      .def("__repr__", &probe_result_repr);
  py::class_<xpm::ProbeExecutor, PythonProbeExecutor>(m, "ProbeExecutor")
      .def(py::init<>())
      .def("run_probe", &xpm::ProbeExecutor::run_probe)
      .def("run_probe_records", &xpm::ProbeExecutor::run_probe_records)
      .def("static_bytes", &xpm::ProbeExecutor::static_bytes);
  py::class_<ProbeArguments>(m, "ProbeArguments")
      .def(py::init<>())
      .def_readwrite("batch_size_variable", &ProbeArguments::batch_size_variable)
      .def_readwrite("aggregation", &ProbeArguments::aggregation)
      .def_readwrite("probe_points", &ProbeArguments::probe_points)
      .def_readwrite("variable_max", &ProbeArguments::variable_max)
      .def_readwrite("record_dims_sample", &ProbeArguments::record_dims_sample)
      .def_readwrite("design_fractions", &ProbeArguments::design_fractions)
      .def_readwrite("usable_max_rel_error", &ProbeArguments::usable_max_rel_error)
      .def_readwrite("automatic_formula", &ProbeArguments::automatic_formula)
      .def_readwrite("adaptive", &ProbeArguments::adaptive);
  py::class_<xpm::AdaptiveDesignOptions>(m, "AdaptiveDesignOptions")
      .def(py::init<>())
      .def_readwrite("max_probes", &xpm::AdaptiveDesignOptions::max_probes)
      .def_readwrite("tolerance", &xpm::AdaptiveDesignOptions::tolerance)
      .def_readwrite("grid_steps", &xpm::AdaptiveDesignOptions::grid_steps);
  m.def("probe_and_fit", &probe_and_fit);
}

void bind_fit(py::module_& m) {
  py::class_<FitArguments>(m, "FitArguments")
      .def(py::init<>())
      .def_readwrite("floor_bytes", &FitArguments::floor_bytes)
      .def_readwrite("batch_size_variable", &FitArguments::batch_size_variable)
      .def_readwrite("aggregation", &FitArguments::aggregation)
      .def_readwrite("non_negative", &FitArguments::non_negative)
      .def_readwrite("usable_max_rel_error", &FitArguments::usable_max_rel_error)
      .def_readwrite("automatic_variables", &FitArguments::automatic_variables);
  m.def("fit", &fit);
}

// (intercept_bytes, slope, {position: (intercept_bytes, slope, low_bytes, high_bytes)}) of a correction.
py::tuple correction_tuple(const xpm::Correction& c) {
  py::dict positions;
  for (std::size_t p = 0; p < xpm::kMicrobatchPositions; ++p)
    if (const auto& line = c.positions[p]) {
      positions[py::str(xpm::to_string(static_cast<xpm::MicrobatchPosition>(p)))] =
          py::make_tuple(line->intercept_bytes, line->slope, line->low_bytes, line->high_bytes);
    }
  return py::make_tuple(c.intercept_bytes, c.slope, positions);
}

// The correction of (intercept_bytes, slope, {position: (intercept_bytes, slope, low_bytes, high_bytes)}).
xpm::Correction correction_of(double intercept_bytes, double slope,
                              const std::map<std::string, std::array<double, 4>>& positions) {
  xpm::Correction c{intercept_bytes, slope, {}};
  for (const auto& [name, line] : positions)
    c.positions[static_cast<std::size_t>(xpm::parse_microbatch_position(name, "Correction.positions"))] =
        xpm::CorrectionLine{line[0], line[1], line[2], line[3]};
  return c;
}

// The calibration's policy; its Python face (Correction, the collective) is python/xpm/calibration.py.
void bind_calibration(py::module_& m) {
  m.def("correction_bytes_for",
        [](double intercept_bytes, double slope, const std::map<std::string, std::array<double, 4>>& positions,
           double predicted_bytes, std::optional<std::string> position) {
          const xpm::Correction c = correction_of(intercept_bytes, slope, positions);
          return position ? c.bytes_for(predicted_bytes, xpm::parse_microbatch_position(*position, "position"))
                          : c.bytes_for(predicted_bytes);
        });
  m.def("correction_planning_bytes",
        [](double intercept_bytes, double slope, const std::map<std::string, std::array<double, 4>>& positions,
           double usable_bytes) {
          return correction_of(intercept_bytes, slope, positions).planning_bytes(usable_bytes);
        });
  m.def("microbatch_position", [](std::size_t index, std::size_t count) {
    return xpm::to_string(xpm::microbatch_position(index, count));
  });
  m.def("covering_correction", [](const std::vector<double>& predicted, const std::vector<double>& peaks,
                                  double usable_bytes) {
    const xpm::Correction c = xpm::covering_correction(predicted, peaks, usable_bytes);
    return std::pair{c.intercept_bytes, c.slope};
  });
  py::class_<xpm::Calibration>(m, "Calibration")
      .def(py::init([](std::int64_t usable_bytes, int window_steps, int settle_steps, double intercept_bytes,
                       double slope, bool lower_early) {
        return xpm::Calibration(usable_bytes, {window_steps, settle_steps, {intercept_bytes, slope}, lower_early});
      }))
      .def("record_peak",
           [](xpm::Calibration& c, double predicted_bytes, double peak_bytes, std::optional<std::string> position) {
             c.record_peak(predicted_bytes, peak_bytes,
                           position ? std::optional(xpm::parse_microbatch_position(*position, "position"))
                                    : std::nullopt);
           },
           py::arg("predicted_bytes"), py::arg("peak_bytes"), py::arg("position") = py::none())
      .def("lower_only_once_settled", &xpm::Calibration::lower_only_once_settled)
      .def("step_row", &xpm::Calibration::step_row)
      .def("end_step", &xpm::Calibration::end_step)
      .def_property_readonly("correction", [](const xpm::Calibration& c) { return correction_tuple(c.correction()); })
      .def_property_readonly("correction_bytes", &xpm::Calibration::correction_bytes)
      .def_property_readonly("replan_from", &xpm::Calibration::replan_from)
      .def_property_readonly("log", &xpm::Calibration::log)
      .def_property_readonly("measured_microbatches", &xpm::Calibration::measured_microbatches)
      .def_property_readonly("worst_rel_error", &xpm::Calibration::worst_rel_error)
      .def("state_json", [](const xpm::Calibration& c) { return xpm::to_json(c.state()).dump(); })
      .def("load_state_json", [](xpm::Calibration& c, const std::string& text) {
        nlohmann::json parsed;
        try {
          parsed = nlohmann::json::parse(text);
        } catch (const nlohmann::json::exception& error) {
          throw std::invalid_argument(std::string("calibration state: ") + error.what());
        }
        c.load_state(xpm::calibration_state_from_json(parsed));
      });
}

std::optional<xpm::MicrobatchPosition> position_named(const std::optional<std::string>& name) {
  return name ? std::optional(xpm::parse_microbatch_position(*name, "position")) : std::nullopt;
}

// The refit of the model on training's peaks; its Python face is python/xpm/sampler_refit.py.
void bind_training_refit(py::module_& m) {
  py::class_<xpm::TrainingRefit>(m, "TrainingRefit")
      .def(py::init([](const xpm::MemoryModel& model, int window_steps) {
        xpm::TrainingRefitOptions options;
        options.window_steps = window_steps;
        return xpm::TrainingRefit(model, options);
      }))
      .def("end_step",
           [](xpm::TrainingRefit& refit, std::int64_t step, const std::vector<std::vector<double>>& dims,
              const std::vector<double>& peaks, const std::vector<std::optional<std::string>>& positions) {
             if (dims.size() != peaks.size() || dims.size() != positions.size())
               throw std::invalid_argument("TrainingRefit.end_step: dims, peaks and positions differ in length");
             std::vector<xpm::TrainingPoint> points;
             for (std::size_t i = 0; i < dims.size(); ++i) points.push_back({dims[i], peaks[i], position_named(positions[i])});
             return refit.end_step(step, std::move(points));
           })
      .def_property_readonly("model", [](const xpm::TrainingRefit& refit) { return refit.model(); })
      .def_property_readonly("refitted", &xpm::TrainingRefit::refitted)
      .def_property_readonly("log", &xpm::TrainingRefit::log)
      .def("redraw",
           [](const xpm::TrainingRefit& refit, xpm::Calibration& calibration, const xpm::MemoryModel* first_of_several,
              const xpm::MemoryModel* first_alone, const xpm::MemoryModel* synchronised, const std::string& line) {
             calibration.redraw(refit.calibration_steps({first_of_several, first_alone, synchronised}), line);
           },
           py::arg("calibration"), py::arg("first_of_several").none(true), py::arg("first_alone").none(true),
           py::arg("synchronised").none(true), py::arg("line"))
      .def_static("digest", &xpm::TrainingRefit::digest)
      .def_static("refitted_model", [](const xpm::MemoryModel& model, const std::string& formula_text,
                                       const std::map<std::string, double>& coefficients,
                                       const std::vector<std::pair<double, double>>& training_ranges) {
        std::vector<xpm::ProbedRange> ranges;
        for (const auto& [low, high] : training_ranges) ranges.push_back({low, high});
        return xpm::refitted_model(model, formula_text, coefficients, std::move(ranges));
      })
      .def("state_json", [](const xpm::TrainingRefit& refit) { return refit.state().dump(); })
      .def("load_state_json", [](xpm::TrainingRefit& refit, const std::string& text) {
        nlohmann::json parsed;
        try {
          parsed = nlohmann::json::parse(text);
        } catch (const nlohmann::json::exception& error) {
          throw std::invalid_argument(std::string("training refit state: ") + error.what());
        }
        refit.load_state(parsed);
      });
}

}  // namespace

PYBIND11_MODULE(_planner, m) {
  m.doc() = "xpm's planner core (no LibTorch); use the xpm package, not this module";
  register_formula_error(m);
  bind_formula(m);
  bind_model(m);
  bind_budget(m);
  bind_probing(m);
  bind_fit(m);
  bind_calibration(m);
  bind_training_refit(m);
  m.def("pack", &pack);
  m.def("plan_step", &plan_step, py::arg("packer"), py::arg("sort_by"), py::arg("record_dims"), py::arg("model"),
        py::arg("planning_bytes"), py::arg("world_size"), py::arg("lockstep"), py::arg("only_rank"),
        py::arg("first_of_several") = nullptr, py::arg("first_alone") = nullptr, py::arg("synchronised") = nullptr);
  m.def("packer_names", &xpm::packer_names);
  m.def("aggregate_dims", [](const xpm::MemoryModel& model, const DoubleArray& record_dims,
                             const std::vector<std::size_t>& indices) {
    return xpm::aggregate_dims(view_of(record_dims, model.formula().variable_names().size(), "record_dims"), indices,
                               model);
  });
  m.attr("HEADROOM_SLOPE") = xpm::kHeadroomSlope;  // the calibration's, for its Python docs and tests
  m.attr("EARLY_HEADROOM_SLOPE") = xpm::kEarlyHeadroomSlope;
  // The planner's defaults, so the Python options start from the same values (one source).
  const xpm::PredictiveBatcherOptions batcher;
  m.attr("DEFAULTS") = py::dict(
      py::arg("usable_max_rel_error") = xpm::FitOptions{}.usable_max_rel_error,
      py::arg("design_fractions") = py::tuple(py::cast(batcher.design_fractions)),
      py::arg("batch_size_variable") = batcher.batch_size_variable,
      py::arg("adaptive_max_probes") = batcher.adaptive.max_probes,
      py::arg("adaptive_tolerance") = batcher.adaptive.tolerance,
      py::arg("adaptive_grid_steps") = batcher.adaptive.grid_steps,
      py::arg("memory_fraction") = xpm::MemoryBudget{}.memory_fraction);
  m.def("assign_records_to_ranks", [](const std::vector<double>& costs, int world_size) {
    return xpm::assign_records_to_ranks(costs, world_size).records_per_rank;
  });
}
