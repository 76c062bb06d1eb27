#include "xpm/trainer/loop/run_counters.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace xpm {

void RunCounters::add_step(const GlobalStepResult& result, double step_size,
                                  std::int64_t ooms_caught, std::int64_t attempts,
                                  std::int64_t step_underpredictions, double prediction_rel_error) {
  ooms += ooms_caught;
  oom_skipped_steps += result.oom ? 1 : 0;
  retried_steps += attempts > 1 ? 1 : 0;
  underpredictions += step_underpredictions;
  microbatches += result.microbatches;
  if (microbatches_per_rank.size() < result.microbatches_per_rank.size()) {
    microbatches_per_rank.resize(result.microbatches_per_rank.size(), 0);
  }
  for (std::size_t r = 0; r < result.microbatches_per_rank.size(); ++r) {
    microbatches_per_rank[r] += result.microbatches_per_rank[r];
  }
  max_rank_imbalance = std::max(max_rank_imbalance, result.imbalance);
  sum_rank_imbalance += result.imbalance;
  skipped_records += result.skipped_records;
  peak_allocated_bytes = std::max(peak_allocated_bytes, result.peak_allocated_bytes);
  train_s += result.duration_s;
  if (!result.oom) {
    trained_size += step_size;
    last_loss = result.loss;
  }
  max_prediction_rel_error = std::max(max_prediction_rel_error, std::abs(prediction_rel_error));
}

nlohmann::json RunCounters::to_json() const {
  return {{"ooms", ooms},
          {"oom_skipped_steps", oom_skipped_steps},
          {"retried_steps", retried_steps},
          {"microbatches", microbatches},
          {"skipped_records", skipped_records},
          {"underpredictions", underpredictions},
          {"earlier_online_corrections", earlier_online_corrections},
          {"peak_allocated_bytes", peak_allocated_bytes},
          {"train_s", train_s},
          {"trained_size", trained_size},
          {"max_prediction_rel_error", max_prediction_rel_error},
          {"last_loss", last_loss},
          {"microbatches_per_rank", microbatches_per_rank},
          {"max_rank_imbalance", max_rank_imbalance},
          {"sum_rank_imbalance", sum_rank_imbalance},
          {"validations", validations}};
}

RunCounters RunCounters::from_json(const nlohmann::json& json) {
  RunCounters counters;
  const auto field = [&](const char* name) -> const nlohmann::json& {
    if (!json.contains(name)) {
      throw std::invalid_argument(std::string("run counters: field '") + name + "' is missing");
    }
    return json.at(name);
  };
  try {
    counters.ooms = field("ooms").get<std::int64_t>();
    counters.oom_skipped_steps = field("oom_skipped_steps").get<std::int64_t>();
    counters.retried_steps = field("retried_steps").get<std::int64_t>();
    counters.microbatches = field("microbatches").get<std::int64_t>();
    counters.skipped_records = field("skipped_records").get<std::int64_t>();
    counters.underpredictions = field("underpredictions").get<std::int64_t>();
    counters.earlier_online_corrections = field("earlier_online_corrections").get<std::int64_t>();
    counters.peak_allocated_bytes = field("peak_allocated_bytes").get<std::int64_t>();
    counters.train_s = field("train_s").get<double>();
    counters.trained_size = field("trained_size").get<double>();
    counters.max_prediction_rel_error = field("max_prediction_rel_error").get<double>();
    counters.last_loss = field("last_loss").get<double>();
    counters.microbatches_per_rank = field("microbatches_per_rank").get<std::vector<std::int64_t>>();
    counters.max_rank_imbalance = field("max_rank_imbalance").get<double>();
    counters.sum_rank_imbalance = field("sum_rank_imbalance").get<double>();
    counters.validations = field("validations");
  } catch (const nlohmann::json::exception& error) {
    throw std::invalid_argument(std::string("run counters: malformed field: ") + error.what());
  }
  return counters;
}

}  // namespace xpm
