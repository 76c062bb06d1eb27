// xpm-plan max-batch: the largest microbatch size whose predicted peak fits the budget.
#include <cmath>
#include <iostream>

#include "common.hpp"
#include "verbs.hpp"

namespace xpm_plan {

po::options_description max_batch_options() {
  po::options_description desc(
      "xpm-plan max-batch --model M --dims l=128 --capacity-bytes B [options]\n"
      "Largest microbatch size (the batch-size variable) whose predicted peak fits the usable\n"
      "budget, capacity x memory fraction - extra overhead, and below every probe recorded in\n"
      "the model as out of memory at dims these reach. Exit code 1 when even one record does\n"
      "not fit.\nOptions");
  desc.add_options()
      ("help,h", "show this help")
      ("model", po::value<std::string>()->required(), "memory model JSON (required)")
      ("dims", po::value<std::vector<std::string>>()->composing(),
       "VAR=VALUE for every variable but the batch-size one, e.g. l=128 (repeatable or "
       "comma-separated)");
  add_budget_options(desc);
  desc.add_options()
      ("max-size", po::value<std::int64_t>()->default_value(std::int64_t{1} << 40),
       "largest microbatch size considered")
      ("json", po::bool_switch()->default_value(false), "print one JSON object instead of text");
  return desc;
}

int run_max_batch(const po::variables_map& vm) {
  const std::int64_t usable_given = usable_bytes_from(vm);
  const std::int64_t max_size = vm["max-size"].as<std::int64_t>();
  if (max_size < 1) throw InputError("--max-size must be >= 1, got " + std::to_string(max_size));
  const xpm::MemoryModel model = load_model(vm["model"].as<std::string>());
  // A model probed under a caching allocator: the budget in its predictions' (allocated) terms.
  const std::int64_t usable = model.prediction_budget_bytes(usable_given);
  std::map<std::string, double> dims_map =
      vm.count("dims") ? parse_assignments(vm["dims"].as<std::vector<std::string>>(), "dims")
                       : std::map<std::string, double>{};
  const std::string& bs = model.batch_size_variable();
  if (dims_map.count(bs)) {
    throw InputError("--dims: '" + bs + "' is the batch-size variable; max-batch computes it");
  }
  dims_map[bs] = 1;
  std::vector<double> dims;
  try {
    dims = model.formula().dims_from_map(dims_map, "--dims");
  } catch (const std::invalid_argument& e) {
    throw InputError(first_line(e.what()));
  }
  check_dims(dims, model.formula().variable_names(), model.batch_size_index(), "max-batch: --dims");
  const bool json = vm["json"].as<bool>();
  const double at_one = model.predict_bytes(dims);
  const xpm::InfeasibleBound* oom = model.dominated_infeasible_probe(dims, static_cast<double>(usable));
  if (!(at_one <= static_cast<double>(usable)) || oom != nullptr) {
    if (json) {
      std::cout << nlohmann::json{{"feasible", false},
                                  {"max_microbatch_size", 0},
                                  {"predicted_bytes", at_one},
                                  {"usable_bytes", usable},
                                  {"budget", budget_json(vm)},
                                  {"dims", dims_json(model, dims)},
                                  {"extrapolation", extrapolation_json(model, dims)}}
                       .dump()
                << "\n";
    }
    if (oom != nullptr && at_one <= static_cast<double>(usable)) {
      throw InfeasibleError("even a microbatch of 1 record at " + dims_text(model, dims) +
                            " reaches a probe that ran out of memory at " +
                            dims_text(model, oom->dims) + " under " +
                            bytes_text(oom->exceeds_bytes) + " bytes");
    }
    throw InfeasibleError("even a microbatch of 1 record at " + dims_text(model, dims) +
                          " is predicted at " + bytes_text(at_one) + " bytes (" + mib_text(at_one) +
                          "), over the usable budget of " + std::to_string(usable) + " bytes (" +
                          mib_text(static_cast<double>(usable)) + ")");
  }
  const std::int64_t m = model.max_microbatch_size(dims, usable, max_size);
  std::vector<double> at_m = dims;
  at_m[model.batch_size_index()] = static_cast<double>(m);
  const double predicted = model.predict_bytes(at_m);
  std::vector<double> at_next = at_m;
  at_next[model.batch_size_index()] = static_cast<double>(m) + 1;
  const double next = model.predict_bytes(at_next);
  if (json) {
    nlohmann::json j;
    j["feasible"] = true;
    j["max_microbatch_size"] = m;
    j["predicted_bytes"] = predicted;
    j["usable_bytes"] = usable;
    j["utilization"] = predicted / static_cast<double>(usable);
    j["next_size_predicted_bytes"] = m < max_size ? nlohmann::json(next) : nlohmann::json(nullptr);
    j["budget"] = budget_json(vm);
    j["dims"] = dims_json(model, at_m);
    j["extrapolation"] = extrapolation_json(model, at_m);
    j["capped_by_max_size"] = m == max_size;
    std::cout << j.dump() << "\n";
  } else {
    std::cout << "max microbatch size " << m << " at " << dims_text(model, at_m) << ": predicted "
              << bytes_text(predicted) << " of " << usable << " usable bytes ("
              << number_text(std::round(predicted / static_cast<double>(usable) * 1000) / 10)
              << " %)";
    if (m < max_size) {
      std::cout << "; " << bs << "=" << m + 1 << " would need " << bytes_text(next);
    } else {
      std::cout << "; capped by --max-size " << max_size << " (larger ones fit too)";
    }
    std::cout << extrapolation_text(model, at_m) << "\n";
  }
  return 0;
}

}  // namespace xpm_plan
