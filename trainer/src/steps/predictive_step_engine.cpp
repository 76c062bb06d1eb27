// predictive_step_engine.cpp — the engine a memory model plans, and that model's probing,
// online correction, calibration and checkpoint (predictive_step_engine.hpp).
#include "xpm/trainer/steps/predictive_step_engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "xpm/planner/dims_text.hpp"

namespace xpm {
namespace {

// A microbatch predicted at the floor and measured under it: the step's peak there is the
// optimizer step's, not the formula's.
bool at_the_floor(const MicrobatchPeak& peak, const MemoryModel& model) {
  const double floor_bytes = model.floor_bytes_at(peak.dims);
  return peak.predicted_bytes <= floor_bytes && peak.forward_backward_peak_bytes <= floor_bytes;
}

// Every rank's microbatches (the peaks are all-reduced) but those at the floor, (predicted -
// measured) / measured each: positive is over-predicted, negative under-predicted (the sign of
// the fit's own errors).
nlohmann::json microbatch_rel_errors(const GlobalStepResult& result, const MemoryModel& model) {
  nlohmann::json errors = nlohmann::json::array();
  for (const MicrobatchPeak& peak : result.microbatch_peaks) {
    const double measured = peak.forward_backward_peak_bytes;
    if (measured <= 0 || at_the_floor(peak, model)) continue;
    errors.push_back((peak.predicted_bytes - measured) / measured);
  }
  return errors;
}

// The largest reserved peak of the step's microbatches (every rank's).
double peak_reserved_bytes(const GlobalStepResult& result) {
  double peak = 0;
  for (const MicrobatchPeak& p : result.microbatch_peaks) peak = std::max(peak, p.forward_backward_peak_reserved_bytes);
  return peak;
}

// Each peak's position among its rank's microbatches with records (the order the rank ran them
// in, as the Python sampler counts them); none for an empty one (lockstep's, zero dims) or
// where the result does not say each peak's rank.
std::vector<std::optional<MicrobatchPosition>> peak_positions(const GlobalStepResult& result) {
  const std::vector<int>& ranks = result.microbatch_peak_ranks;
  std::vector<std::optional<MicrobatchPosition>> positions(result.microbatch_peaks.size());
  if (ranks.size() != positions.size()) return positions;
  const auto holds_records = [&](std::size_t i) {
    const std::vector<double>& dims = result.microbatch_peaks[i].dims;
    return std::any_of(dims.begin(), dims.end(), [](double d) { return d != 0; });
  };
  std::map<int, std::size_t> count, seen;
  for (std::size_t i = 0; i < positions.size(); ++i)
    if (holds_records(i)) ++count[ranks[i]];
  for (std::size_t i = 0; i < positions.size(); ++i)
    if (holds_records(i)) positions[i] = microbatch_position(seen[ranks[i]]++, count[ranks[i]]);
  return positions;
}

// The correction of a prediction at `position` (the correction's line without one).
double correction_at(const Correction& correction, double predicted_bytes, std::optional<MicrobatchPosition> position) {
  return position ? correction.bytes_for(predicted_bytes, *position) : correction.bytes_for(predicted_bytes);
}

// (planned - measured) / measured of each microbatch's peak (reserved bytes under a caching
// allocator, else allocated), planned = its prediction with the correction the step was planned
// with at its position; the microbatches at the floor left out as in microbatch_rel_errors.
nlohmann::json microbatch_planned_rel_errors(const GlobalStepResult& result, const MemoryModel& model,
                                             const Correction& correction, bool reserved) {
  nlohmann::json errors = nlohmann::json::array();
  const std::vector<std::optional<MicrobatchPosition>> positions = peak_positions(result);
  for (std::size_t i = 0; i < result.microbatch_peaks.size(); ++i) {
    const MicrobatchPeak& peak = result.microbatch_peaks[i];
    const double measured = reserved ? peak.forward_backward_peak_reserved_bytes : peak.forward_backward_peak_bytes;
    if (measured <= 0 || at_the_floor(peak, model)) continue;
    errors.push_back((peak.predicted_bytes + correction_at(correction, peak.predicted_bytes, positions[i]) - measured) /
                     measured);
  }
  return errors;
}

// The probes' reserved/allocated ratios and the gap planned, when the model has them.
void log_reserved_gap(const MemoryModel& model, const EngineLog& log) {
  const nlohmann::json& metadata = model.metadata();
  if (!metadata.contains("reserved_gap") || !metadata.at("reserved_gap").contains("reserved_to_allocated")) return;
  const auto ratios = metadata.at("reserved_gap").at("reserved_to_allocated").get<std::vector<double>>();
  const Correction gap = model.reserved_gap();
  char line[200];
  std::snprintf(line, sizeof line, "reserved bytes planned: the probes reserved %.3fx to %.3fx what they allocated; "
                "gap %+.0f bytes %+.2f %% of the prediction", ratios.at(0), ratios.at(1), gap.intercept_bytes,
                100 * gap.slope);
  log(line);
}

}  // namespace

PredictiveStepEngine::PredictiveStepEngine(torch::optim::Optimizer& optimizer, PredictiveBatcher& batcher,
                                           MemoryMeter* meter, DistributedContext& dist, GradientBuckets* buckets,
                                           ShardedAdamW* sharded)
    : batcher_(batcher), meter_(meter), dist_(dist), trainer_(optimizer, batcher, meter, dist, buckets, sharded) {}

GlobalStepResult PredictiveStepEngine::train_step(const std::vector<std::vector<double>>& record_dims,
                                                  const std::vector<double>& record_units,
                                                  const MicrobatchLossFn& loss_sum_fn,
                                                  const BeforeOptimizerStepFn& before_optimizer_step) {
  GlobalStepResult result = trainer_.train_step(record_dims, record_units, loss_sum_fn, before_optimizer_step);
  result.oom_errors = result.oom ? 1 : 0;
  return result;
}

ValidationPlanFn PredictiveStepEngine::validation_planner() const {
  auto snapshot = std::make_shared<PredictiveBatcher>(batcher_.options(), batcher_.shared_packer());
  snapshot->set_model(batcher_.model());
  snapshot->set_correction(batcher_.correction());  // the calibrated line, not the model's initial one
  return [snapshot](const std::vector<std::vector<double>>& dims) { return snapshot->plan(dims); };
}

EngineModelOrigin PredictiveStepEngine::ensure_memory_model(torch::nn::Module& module,
                                                            torch::optim::Optimizer& optimizer,
                                                            const ProbeLossFn& loss_fn,
                                                            const StepProbeOptions& probing, const EngineLog& log) {
  if (batcher_.has_model()) return {};
  StepProbeOptions options = probing;
  options.batcher = batcher_.options();
  options.rank = dist_.rank();
  if (options.meter == nullptr) options.meter = meter_;
  if (dist_.distributed() && !options.share_from_rank0) {
    const auto wait = dist_.options().rendezvous_timeout;
    options.share_from_rank0 = [this, wait](const std::string& payload) { return dist_.share_from(0, payload, wait); };
  }
  if (!options.log) {
    options.log = [&log](const std::string& line) {  // the probe's lines start with "xpm: "
      log(line.rfind("xpm: ", 0) == 0 ? line.substr(5) : line);
    };
  }
  const StepProbeResult probed = probe_and_fit(module, optimizer, loss_fn, options);
  batcher_.set_model(probed.model);
  const EngineModelOrigin origin{static_cast<std::int64_t>(probed.probes.size()), probed.from_cache, probed.probe_s};
  log("memory model " + batcher_.model().formula().canonical() + ", floor " +
      std::to_string(static_cast<std::int64_t>(batcher_.model().floor_bytes())) + " bytes" +
      (probed.from_cache ? " (from the cache)" : ", " + std::to_string(origin.probes) + " probes"));
  log_reserved_gap(batcher_.model(), log);
  return origin;
}

EngineMemoryState PredictiveStepEngine::memory_state() const {
  EngineMemoryState saved;
  if (batcher_.has_model()) saved.memory_model = batcher_.model().to_json();
  if (calibration_) {
    saved.calibration = to_json(calibration_->state());
    if (refit_) saved.calibration["training_refit"] = refit_state();
  } else if (!restored_calibration_.is_null()) {  // resumed, no step run since
    saved.calibration = restored_calibration_;
  }
  return saved;
}

bool PredictiveStepEngine::restore_memory_state(const EngineMemoryState& saved, bool same_layout) {
  // The memory model training used at that step (online corrections included), unless another
  // world size changes what a rank holds; the caller may have set it already.
  bool taken = false;
  if (!batcher_.has_model() && same_layout && !saved.memory_model.is_null()) {
    batcher_.set_model(MemoryModel::from_json(saved.memory_model));
    taken = true;
  }
  restored_calibration_ = saved.calibration;  // used with the model it was measured against only
  restored_calibration_model_ = saved.memory_model;
  return taken;
}

void PredictiveStepEngine::begin_step(const EngineLog& /*log*/) {
  if (meter_ != nullptr && !calibration_) {
    CalibrationOptions options;
    options.initial = batcher_.correction();  // the model's reserved gap, or none
    options.lower_early = !plans_reserved_bytes();
    calibration_.emplace(batcher_.options().budget.usable_bytes(), options);
    // The checkpoint's correction and window measured its model's predictions: kept when that
    // is the model planning now (not after probing again, e.g. at another world size).
    const bool restoring =
        !restored_calibration_.is_null() && restored_calibration_model_ == batcher_.model().to_json();
    if (restoring) calibration_->load_state(calibration_state_from_json(restored_calibration_));
    start_refit(restoring ? restored_calibration_.value("training_refit", nlohmann::json()) : nlohmann::json());
    restored_calibration_ = nullptr;
    batcher_.set_correction(calibration_->correction());
  }
  step_correction_ = batcher_.correction();
}

double PredictiveStepEngine::planned_floor_bytes(const GlobalStepResult& result) const {
  // Constant, or a formula of the microbatches' dims (a moving floor).
  const MemoryModel& model = batcher_.model();
  double floor_bytes = model.floor_bytes();
  for (const MicrobatchPeak& peak : result.microbatch_peaks) {
    floor_bytes = std::max(floor_bytes, model.floor_bytes_at(peak.dims));
  }
  return floor_bytes;
}

std::int64_t PredictiveStepEngine::bound_out_of_memory_microbatches(const GlobalStepResult& result,
                                                                   std::int64_t step, const EngineLog& log) {
  std::int64_t bounded = 0;
  for (const std::vector<double>& dims : result.oom_microbatch_dims) {
    if (dims.empty()) continue;
    const double predicted = batcher_.model().predict_bytes(dims);
    // The model's prediction there reaches at least the capacity, less the correction (what
    // a caching allocator reserves beyond the allocated bytes the model predicts).
    const double bound_bytes = batcher_.correction().planning_bytes(static_cast<double>(log.capacity_bytes));
    batcher_.add_infeasible_bound({dims, bound_bytes});
    ++bounded;
    log("step " + std::to_string(step) + " ran out of memory in a microbatch at " +
        dims_text(batcher_.model().formula().variable_names(), dims) + " predicted at " +
        std::to_string(static_cast<std::int64_t>(predicted)) + " bytes (capacity " +
        std::to_string(log.capacity_bytes) + "): it bounds the memory model from now on; refitted");
  }
  return bounded;
}

void PredictiveStepEngine::note_extrapolation(const GlobalStepResult& result, std::int64_t step,
                                              const EngineLog& log) {
  if (extrapolation_noted_) return;
  std::vector<std::vector<double>> planned = result.oom_microbatch_dims;
  for (const MicrobatchPeak& peak : result.microbatch_peaks) planned.push_back(peak.dims);
  for (const std::vector<double>& dims : planned) {
    if (dims.empty()) continue;
    const std::vector<Extrapolation> beyond = batcher_.model().extrapolation(dims);
    if (beyond.empty()) continue;
    std::string what;
    for (const Extrapolation& e : beyond) what += (what.empty() ? "" : ", ") + e.describe();
    log("note: step " + std::to_string(step) + " planned a microbatch beyond the probed range (" + what +
        "); its prediction is an extrapolation of the fit (noted once per run)");
    extrapolation_noted_ = true;
    return;
  }
}

// Online correction, every rank alike (the peaks are all-reduced): a microbatch that ran out of
// memory bounds the model, an optimizer step above the floor raises it, and the calibration
// draws its correction line over every microbatch's measured peak (the bytes the plans bound:
// reserved under a caching allocator, else allocated), the policy of the Python sampler.
std::int64_t PredictiveStepEngine::learn_from_step(const GlobalStepResult& result, std::int64_t step,
                                                   const EngineLog& log) {
  note_extrapolation(result, step, log);
  std::int64_t underpredictions = bound_out_of_memory_microbatches(result, step, log);
  const double tolerance = 1 + log.underprediction_tolerance;
  const std::vector<std::optional<MicrobatchPosition>> positions = peak_positions(result);
  for (std::size_t i = 0; i < result.microbatch_peaks.size(); ++i) {
    const MicrobatchPeak& peak = result.microbatch_peaks[i];
    const double planned = peak.predicted_bytes + correction_at(batcher_.correction(), peak.predicted_bytes, positions[i]);
    const double measured = planned_peak(peak);
    if (measured > tolerance * planned) {
      ++underpredictions;
      log("underprediction at step " + std::to_string(step) + ": measured " +
          std::to_string(static_cast<std::int64_t>(measured)) + " bytes, planned " +
          std::to_string(static_cast<std::int64_t>(planned)) + " at " +
          dims_text(batcher_.model().formula().variable_names(), peak.dims));
    }
  }
  if (result.optimizer_step_peak_bytes > tolerance * planned_floor_bytes(result)) {
    ++underpredictions;
    batcher_.raise_floor_bytes(result.optimizer_step_peak_bytes);
    log("optimizer step at step " + std::to_string(step) + " peaked above the floor; floor raised to " +
        std::to_string(static_cast<std::int64_t>(result.optimizer_step_peak_bytes)));
  }
  underpredictions += check_optimizer_step_reserved(result, step, tolerance, log);
  if (calibration_) calibrate(result, step, log);
  return underpredictions;
}

// Under a caching allocator the plans bound reserved bytes, the optimizer step's too: the
// floor plus its correction (the allocator's gap at the floor) must hold the step's reserved
// peak, else the floor rises to the allocated bytes whose correction reaches it.
std::int64_t PredictiveStepEngine::check_optimizer_step_reserved(const GlobalStepResult& result, std::int64_t step,
                                                                 double tolerance, const EngineLog& log) {
  if (!plans_reserved_bytes() || result.oom || result.optimizer_step_peak_reserved_bytes <= 0) return 0;
  const Correction& correction = batcher_.correction();
  const double floor_bytes = planned_floor_bytes(result);
  const double planned = floor_bytes + correction.bytes_for(floor_bytes);
  const double reserved = result.optimizer_step_peak_reserved_bytes;
  if (reserved <= tolerance * planned) return 0;
  const double raised = (reserved - correction.intercept_bytes) / (1 + correction.slope);
  if (raised > floor_bytes) batcher_.raise_floor_bytes(raised);
  log("optimizer step at step " + std::to_string(step) + " reserved " +
      std::to_string(static_cast<std::int64_t>(reserved)) + " bytes, above the floor and its correction (" +
      std::to_string(std::llround(planned)) + "); floor raised to " +
      std::to_string(std::llround(std::max(raised, floor_bytes))));
  return 1;
}

double PredictiveStepEngine::planned_peak(const MicrobatchPeak& peak) const {
  return plans_reserved_bytes() ? peak.forward_backward_peak_reserved_bytes : peak.forward_backward_peak_bytes;
}

// Every rank records the same all-reduced peaks; the rows are agreed once more (one all-reduce
// of 518 numbers) so that ranks planning under different budgets are refused on every rank.
void PredictiveStepEngine::calibrate(const GlobalStepResult& result, std::int64_t step, const EngineLog& log) {
  if (!result.oom) {
    const std::vector<std::optional<MicrobatchPosition>> positions = peak_positions(result);
    // A microbatch predicted and measured under the model's floor says nothing of the line
    // (the floor, not the prediction, bounds its step); its over-prediction would lower it.
    for (std::size_t i = 0; i < result.microbatch_peaks.size(); ++i)
      if (!at_the_floor(result.microbatch_peaks[i], batcher_.model()))
        calibration_->record_peak(result.microbatch_peaks[i].predicted_bytes,
                                  planned_peak(result.microbatch_peaks[i]), positions[i]);
  }
  std::vector<double> row = calibration_->step_row(step + 1);
  if (dist_.distributed()) row = dist_.all_reduce(row, ReduceOp::kMax);
  const std::optional<std::string> line = calibration_->end_step(step, row);
  batcher_.set_correction(calibration_->correction());
  if (line) log("calibration: " + *line);
  if (refit_) refit_model(result, step, log);
}

// The refit (allocated bytes only) from the model planning now, or as the checkpoint left it:
// {"given": the model it refits, "state": its state} (`saved`; null: a new one).
void PredictiveStepEngine::start_refit(const nlohmann::json& saved) {
  if (plans_reserved_bytes()) return;
  if (saved.is_null()) {
    refit_.emplace(batcher_.model());
    return;
  }
  refit_.emplace(MemoryModel::from_json(saved.at("given")));
  refit_->load_state(saved.at("state"));
}

nlohmann::json PredictiveStepEngine::refit_state() const {
  return {{"given", refit_->given().to_json()}, {"state", refit_->state()}};
}

// Every rank holds every rank's peaks (all-reduced): the same points, the same refit. The
// refitted coefficients (and formula) replace the batcher's, its floor and bounds kept; the
// calibration is drawn anew over the refit's window with its predictions.
void PredictiveStepEngine::refit_model(const GlobalStepResult& result, std::int64_t step, const EngineLog& log) {
  std::vector<TrainingPoint> points;
  if (!result.oom) {
    const std::vector<std::optional<MicrobatchPosition>> positions = peak_positions(result);
    for (std::size_t i = 0; i < result.microbatch_peaks.size(); ++i)
      points.push_back({result.microbatch_peaks[i].dims, planned_peak(result.microbatch_peaks[i]), positions[i]});
  }
  const std::optional<std::string> line = refit_->end_step(step, std::move(points));
  if (!line) return;
  const MemoryModel& refitted = refit_->model();
  batcher_.set_model(refitted_model(batcher_.model(), refitted.formula().text(), coefficients_by_name(refitted)));
  calibration_->redraw(refit_->calibration_steps({}), *line);
  batcher_.set_correction(calibration_->correction());
  log("calibration: " + *line);
}

void PredictiveStepEngine::add_step_metrics(const GlobalStepResult& result, nlohmann::json& line) const {
  if (result.oom) return;
  line["microbatch_rel_errors"] = microbatch_rel_errors(result, batcher_.model());
  if (calibration_) {
    line["microbatch_planned_rel_errors"] =
        microbatch_planned_rel_errors(result, batcher_.model(), step_correction_, plans_reserved_bytes());
    line["correction_bytes"] = calibration_->correction_bytes();
  }
  if (plans_reserved_bytes()) {
    line["peak_reserved_bytes"] = peak_reserved_bytes(result);
    line["optimizer_step_peak_reserved_bytes"] = result.optimizer_step_peak_reserved_bytes;
  }
}

EngineMemorySummary PredictiveStepEngine::memory_summary() const {
  if (!batcher_.has_model()) return {};
  return {true, batcher_.model().formula().canonical(), batcher_.model().floor_bytes(), batcher_.corrections()};
}

std::string PredictiveStepEngine::out_of_memory_cause(const EngineLog& log) const {
  return "the memory model keeps under-predicting this job (" + log.out_of_memory_advice + ")";
}

}  // namespace xpm
