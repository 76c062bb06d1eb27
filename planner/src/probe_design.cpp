// probe_design.cpp — where PredictiveBatcher probes: the automatic initial design (sweeps of the
// microbatch size at shapes that move each variable) and the adaptive design that probes next
// where the candidate models disagree most (predictive_batcher.hpp).
#include <algorithm>
#include <chrono>
#include <functional>
#include <optional>
#include <cmath>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "xpm/planner/predictive_batcher.hpp"

#include "xpm/planner/dims_text.hpp"
#include "xpm/planner/enum_names.hpp"

#include "number_format.hpp"

namespace xpm {
namespace {

// Microbatch sizes of the adaptive grid: 1, 2, 3, 4, 6, 8, 12, ... up to `largest`, and it.
std::vector<double> grid_batch_sizes(double largest) {
  std::set<double> sizes;
  for (double p = 1; p <= largest; p *= 2) {
    sizes.insert(p);
    if (p * 1.5 <= largest && p >= 2) sizes.insert(p * 1.5);
  }
  sizes.insert(largest);
  return {sizes.begin(), sizes.end()};
}

}  // namespace

void AdaptiveDesignOptions::validate() const {
  if (max_probes < 0) {
    throw std::invalid_argument("AdaptiveDesignOptions.max_probes must be >= 0, got " +
                                std::to_string(max_probes));
  }
  if (!(tolerance > 0 && std::isfinite(tolerance))) {
    throw std::invalid_argument("AdaptiveDesignOptions.tolerance must be finite and > 0, got " +
                                detail::format_double(tolerance));
  }
  if (grid_steps < 2) {
    throw std::invalid_argument("AdaptiveDesignOptions.grid_steps must be >= 2, got " +
                                std::to_string(grid_steps));
  }
}

namespace {
constexpr EnumNames<AdaptiveStop, 4> kAdaptiveStopNames{{{AdaptiveStop::kNotRun, "not run"},
                                                          {AdaptiveStop::kAgreed, "agreed"},
                                                          {AdaptiveStop::kProbeCount, "probe count"},
                                                          {AdaptiveStop::kNoCandidates, "no candidates"}}};
}  // namespace

std::string to_string(AdaptiveStop stop) { return enum_name(kAdaptiveStopNames, stop); }

std::string AdaptiveDesignReport::describe(const CostFormula& formula) const {
  std::ostringstream os;
  if (stop == AdaptiveStop::kNotRun) return "adaptive design not run";
  os << "adaptive design added " << added_probes << (added_probes == 1 ? " probe" : " probes")
     << " in " << detail::short_double(elapsed_s) << " s; stopped: ";
  switch (stop) {
    case AdaptiveStop::kAgreed: os << "the candidate models agree within the tolerance"; break;
    case AdaptiveStop::kProbeCount: os << "the probe count budget is spent"; break;
    default: os << "no held-out refits to compare, or no shape left to probe"; break;
  }
  if (!std::isnan(disagreement)) {
    os << " (largest disagreement " << detail::percent(disagreement) << " at "
       << dims_text(formula.variable_names(), disagreement_dims) << ")";
  }
  return os.str();
}

std::vector<std::vector<double>> PredictiveBatcher::design_sweep_shapes() const {
  const CostFormula& formula = options_.formula;
  const std::size_t variables = formula.variable_names().size();
  const std::size_t bs_index = formula.variable_index(options_.batch_size_variable);
  const auto at_fraction = [&](std::size_t v, double fraction) {
    return std::max(1.0, std::floor(fraction * options_.variable_max.at(formula.variable_names()[v])));
  };
  std::vector<std::vector<double>> shapes;
  const auto add = [&](std::vector<double> dims) {  // the sweep sets the batch size
    dims[bs_index] = 1;
    if (std::find(shapes.begin(), shapes.end(), dims) == shapes.end()) shapes.push_back(std::move(dims));
  };
  for (double fraction : options_.design_fractions) {  // every other variable together
    std::vector<double> dims(variables);
    for (std::size_t v = 0; v < variables; ++v) dims[v] = at_fraction(v, fraction);
    add(dims);
  }
  if (variables < 3) return shapes;
  for (std::size_t moved = 0; moved < variables; ++moved) {  // one variable at a time
    if (moved == bs_index) continue;
    for (double fraction : options_.design_fractions) {
      if (fraction >= 1) continue;
      std::vector<double> dims(variables);
      for (std::size_t v = 0; v < variables; ++v) dims[v] = at_fraction(v, v == moved ? fraction : 1.0);
      add(dims);
    }
  }
  return shapes;
}

void PredictiveBatcher::run_initial_design(ProbeExecutor& executor, double usable_bytes) {
  if (!options_.probe_points.empty()) {
    for (const auto& dims : design_probe_dims(options_.formula)) probes_.push_back(executor.run_probe(dims));
    return;
  }
  if (!options_.record_dims_sample.empty()) {  // mixes of the sample's records
    for (double fraction : options_.design_fractions) {
      for (bool spread : {false, true}) {
        sweep_batch_size(executor, [&](double bs) {
          return sample_mix(static_cast<std::size_t>(bs), fraction, spread);
        }, usable_bytes);
      }
    }
    for (std::size_t index : lopsided_records()) {
      sweep_batch_size(executor, [&](double bs) {
        ProbeShape shape{{}, std::vector<std::vector<double>>(static_cast<std::size_t>(bs),
                                                              options_.record_dims_sample[index])};
        const RecordDimsView sample(sample_rows_.data(), options_.record_dims_sample.size(), aggregation_.size());
        shape.dims = aggregate_dims(sample, std::vector<std::size_t>(shape.records.size(), index), aggregation_);
        return shape;
      }, usable_bytes);
    }
    return;
  }
  const std::size_t bs_index = options_.formula.variable_index(options_.batch_size_variable);
  for (const std::vector<double>& dims : design_sweep_shapes()) {
    sweep_batch_size(executor, [&](double bs) {
      ProbeShape shape{dims, {}};
      shape.dims[bs_index] = bs;
      return shape;
    }, usable_bytes);
  }
}

ProbeResult PredictiveBatcher::run_shape(ProbeExecutor& executor, const ProbeShape& shape) {
  if (shape.records.empty()) return executor.run_probe(shape.dims);
  ProbeResult result = executor.run_probe_records(shape.records);
  result.dims = shape.dims;
  return result;
}

// `records` of the sample up to its `fraction`-quantile (record_dims_sample's order), or up to
// the last record whose first sorting variable is at most `fraction` of the largest where that
// comes first and still holds records enough for the largest microbatch probed (else a few
// outliers, or none, would stand for every mix): the ones just below it (spread false; repeated
// when fewer), or ones spread evenly up to it. (A sample whose records are mostly cut at one
// length has its quantiles there, yet a sorting packer's last microbatch holds its shortest
// records: the fraction of the length reaches them.)
PredictiveBatcher::ProbeShape PredictiveBatcher::sample_mix(std::size_t records, double fraction,
                                                            bool spread) const {
  const std::size_t n = sample_order_.size();
  const double cut = fraction * sample_first_key_.back() * (1 + 1e-12);  // a grid's 1 - ulp is 1
  const auto by_value = static_cast<std::size_t>(
      std::upper_bound(sample_first_key_.begin(), sample_first_key_.end(), cut) - sample_first_key_.begin());
  const auto by_count = static_cast<std::size_t>(std::ceil(fraction * n));
  const double bs_max = std::floor(options_.variable_max.at(options_.batch_size_variable));
  const std::size_t enough = std::min(n, static_cast<std::size_t>(std::max(1.0, bs_max)));
  const auto top = std::clamp<std::size_t>(by_value >= enough ? std::min(by_count, by_value) : by_count, 1, n);
  ProbeShape shape;
  std::vector<std::size_t> indices;
  for (std::size_t i = 0; i < records; ++i) {
    const std::size_t rank = spread ? (2 * i + 1) * top / (2 * records) : top - 1 - i % top;
    indices.push_back(sample_order_[rank]);
    shape.records.push_back(options_.record_dims_sample[indices.back()]);
  }
  const RecordDimsView sample(sample_rows_.data(), n, aggregation_.size());
  shape.dims = aggregate_dims(sample, indices, aggregation_);
  return shape;
}

// Per variable besides the batch size whose records combine by their max (with two or more
// such), the sample's record whose share of that variable's largest value most exceeds its
// largest share of another's, when by at least kLopsidedShare (the first in sample order on a
// tie): the shapes the quantiles' mixes miss (predictive_batcher.hpp).
std::vector<std::size_t> PredictiveBatcher::lopsided_records() const {
  std::vector<std::size_t> lengths;
  for (std::size_t v = 0; v < aggregation_.size(); ++v) {
    if (aggregation_[v] == DimAggregation::kMax) lengths.push_back(v);
  }
  std::vector<std::size_t> chosen;
  if (lengths.size() < 2) return chosen;
  std::vector<double> largest(aggregation_.size(), 0.0);
  for (const auto& record : options_.record_dims_sample) {
    for (std::size_t v : lengths) largest[v] = std::max(largest[v], record[v]);
  }
  for (std::size_t v : lengths) {
    if (largest[v] <= 0) continue;
    double best = kLopsidedShare;
    std::optional<std::size_t> pick;
    for (std::size_t i : sample_order_) {
      const auto& record = options_.record_dims_sample[i];
      double others = 0;
      for (std::size_t u : lengths) {
        if (u != v && largest[u] > 0) others = std::max(others, record[u] / largest[u]);
      }
      const double lead = record[v] / largest[v] - others;
      if (lead >= best && (!pick || lead > best)) {
        best = lead;
        pick = i;
      }
    }
    if (pick) chosen.push_back(*pick);
  }
  return chosen;
}

// Grows the microbatch size by doubling toward the budget, then bisects once between the last
// size that fitted and the first that did not, so two probes lie where it binds.
void PredictiveBatcher::sweep_batch_size(ProbeExecutor& executor,
                                         const std::function<ProbeShape(double)>& shape_at,
                                         double usable_bytes) {
  const double bs_max = std::floor(options_.variable_max.at(options_.batch_size_variable));
  const auto fits = [&](const ProbeResult& probe) {
    const double reserved = probe.step_peak_reserved_bytes;  // what binds under a caching allocator
    return probe.feasible && (reserved > 0 ? reserved : probe.step_peak_bytes()) <= usable_bytes;
  };
  double last_fit = 0, first_miss = 0;
  for (double bs = 1; bs <= bs_max; bs = (bs * 2 > bs_max && bs < bs_max) ? bs_max : bs * 2) {
    probes_.push_back(run_shape(executor, shape_at(bs)));
    if (!fits(probes_.back())) {
      first_miss = bs;
      break;
    }
    last_fit = bs;
  }
  if (first_miss > 0 && first_miss - last_fit > 1) {
    probes_.push_back(run_shape(executor, shape_at(std::floor((last_fit + first_miss) / 2))));
  }
}

// Every shape of the grid: microbatch sizes up to variable_max[bs], each other variable at
// grid_steps values from the smallest design fraction of its max to its max; with a record
// sample, both mixes of every microbatch size at grid_steps fractions of the sample.
std::vector<PredictiveBatcher::ProbeShape> PredictiveBatcher::adaptive_grid() const {
  const CostFormula& formula = options_.formula;
  const std::size_t bs_index = formula.variable_index(options_.batch_size_variable);
  const double lowest_fraction =
      *std::min_element(options_.design_fractions.begin(), options_.design_fractions.end());
  const int steps = options_.adaptive.grid_steps;
  if (!options_.record_dims_sample.empty()) {
    std::vector<ProbeShape> mixes;
    for (double bs : grid_batch_sizes(std::floor(options_.variable_max.at(options_.batch_size_variable)))) {
      for (int i = 0; i < steps; ++i) {
        for (bool spread : {false, true}) {
          ProbeShape mix = sample_mix(static_cast<std::size_t>(bs),
                                      lowest_fraction + (1 - lowest_fraction) * i / (steps - 1), spread);
          const bool seen = std::any_of(mixes.begin(), mixes.end(), [&](const ProbeShape& s) { return s.dims == mix.dims; });
          if (!seen) mixes.push_back(std::move(mix));
        }
      }
    }
    return mixes;
  }
  std::vector<std::vector<double>> axes;
  for (std::size_t v = 0; v < formula.variable_names().size(); ++v) {
    const double max = std::floor(options_.variable_max.at(formula.variable_names()[v]));
    if (v == bs_index) {
      axes.push_back(grid_batch_sizes(max));
      continue;
    }
    std::set<double> values;
    for (int i = 0; i < steps; ++i) {
      const double fraction = lowest_fraction + (1 - lowest_fraction) * i / (steps - 1);
      values.insert(std::max(1.0, std::floor(fraction * max)));
    }
    axes.push_back({values.begin(), values.end()});
  }
  std::vector<ProbeShape> grid = {{}};
  for (const std::vector<double>& axis : axes) {
    std::vector<ProbeShape> longer;
    for (const ProbeShape& prefix : grid) {
      for (double value : axis) {
        longer.push_back(prefix);
        longer.back().dims.push_back(value);
      }
    }
    grid = std::move(longer);
  }
  return grid;
}

double PredictiveBatcher::candidate_prediction(const CostFormula& formula,
                                               const std::vector<double>& coefficients,
                                               double floor_bytes,
                                               const std::vector<double>& dims) const {
  double floor = floor_bytes;
  if (floor_fit_.formula) {
    floor = std::max(floor, floor_fit_.formula->formula.predict(floor_fit_.formula->coefficients, dims));
  }
  return std::max(floor, formula.predict(coefficients, dims));
}

PredictiveBatcher::FitCandidate PredictiveBatcher::refine_design(ProbeExecutor& executor,
                                                                 FitCandidate chosen,
                                                                 double static_bytes,
                                                                 double usable_bytes) {
  adaptive_report_ = AdaptiveDesignReport{};
  if (!options_.probe_points.empty() || options_.adaptive.max_probes == 0) return chosen;
  const auto start = std::chrono::steady_clock::now();
  const auto elapsed_s = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const std::vector<ProbeShape> grid = adaptive_grid();
  const bool choosing = options_.formula_choice == FormulaChoice::kAutomatic;
  // With the formula chosen, an added probe refits the chosen formula and its rivals only; the
  // choice among every candidate is made again, on every probe, before the design stops: when
  // it stops for agreement (or for want of candidates) the new choice's candidates are checked
  // in turn, and the design goes on if they disagree.
  bool rivals_only = false;
  const auto stops = [&](AdaptiveStop stop) {
    if (rivals_only) {
      chosen = fit_probes(static_bytes, usable_bytes);
      rivals_only = false;
      if (stop != AdaptiveStop::kProbeCount) return false;
    }
    adaptive_report_.stop = stop;
    return true;
  };
  for (;;) {
    const FitSummary& summary = chosen.fit.summary;
    adaptive_report_.elapsed_s = elapsed_s();
    // The candidates: the fit's held-out refits, and, when the formula was chosen, the other
    // formulas that explain the probes within the tolerance of its fit error.
    std::vector<std::pair<const CostFormula*, const std::vector<double>*>> rivals;
    for (const auto& refit : summary.leave_one_out_coefficients) rivals.push_back({&*chosen.formula, &refit});
    for (const FittedFormula& other : chosen.alternatives) {  // those that explain the probes as well
      if (other.max_rel_error <= summary.max_rel_error + options_.adaptive.tolerance) {
        rivals.push_back({&other.formula, &other.coefficients});
      }
    }
    if (rivals.empty()) {
      if (stops(AdaptiveStop::kNoCandidates)) return chosen;
      continue;
    }
    // The shape where a held-out refit departs most from the fit, inside the budget.
    double worst = -1;
    const ProbeShape* worst_shape = nullptr;
    for (const ProbeShape& shape : grid) {
      const std::vector<double>& dims = shape.dims;
      const double fitted = candidate_prediction(*chosen.formula, chosen.fit.coefficients, chosen.floor_bytes, dims);
      if (!(fitted > 0) || fitted > usable_bytes) continue;
      const bool probed = std::any_of(probes_.begin(), probes_.end(),
                                      [&](const ProbeResult& p) { return p.dims == dims; });
      if (probed) continue;
      for (const auto& [formula, coefficients] : rivals) {
        const double d = std::abs(candidate_prediction(*formula, *coefficients, chosen.floor_bytes, dims) - fitted) / fitted;
        if (d > worst) {
          worst = d;
          worst_shape = &shape;
        }
      }
    }
    if (worst < 0) {
      if (stops(AdaptiveStop::kNoCandidates)) return chosen;
      continue;
    }
    adaptive_report_.disagreement = worst;
    adaptive_report_.disagreement_dims = worst_shape->dims;
    const bool agreed = worst <= options_.adaptive.tolerance;
    if (agreed || adaptive_report_.added_probes >= options_.adaptive.max_probes) {
      if (stops(agreed ? AdaptiveStop::kAgreed : AdaptiveStop::kProbeCount)) return chosen;
      continue;
    }
    probes_.push_back(run_shape(executor, *worst_shape));
    ++adaptive_report_.added_probes;
    std::vector<std::string> among;  // the chosen formula and its rivals, refitted on every probe
    if (choosing) {
      among.push_back(chosen.formula->text());
      for (const FittedFormula& other : chosen.alternatives) among.push_back(other.formula.text());
    }
    chosen = fit_probes(static_bytes, usable_bytes, among);
    rivals_only = choosing;
  }
}

}  // namespace xpm
