// xpm-plan plan: split an outer batch (a file of records) into microbatches that fit the budget.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <iostream>
#include <memory>
#include <sstream>

#include "common.hpp"
#include "csv_table.hpp"
#include "figures.hpp"
#include "verbs.hpp"
#include "xpm/planner/packer_kind.hpp"
#include "xpm/planner/packer.hpp"
#include "xpm/planner/time_model.hpp"

namespace xpm_plan {
namespace {

bool is_number(const std::string& text) {
  const std::string t = trim(text);
  double v = 0;
  auto [ptr, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  return !t.empty() && ec == std::errc() && ptr == t.data() + t.size();
}

// Records from a CSV with a header (one column per variable but the batch-size one) or, when
// the model has one such variable, from a plain list with one value per line.
std::vector<std::vector<double>> read_records(const std::string& path,
                                              const xpm::MemoryModel& model) {
  const std::string text = read_file(path, "records");
  const auto& vars = model.formula().variable_names();
  std::istringstream lines(text);
  std::string first;
  while (std::getline(lines, first) && trim(first).empty()) {}
  if (!first.empty() && first.back() == '\r') first.pop_back();
  if (vars.size() == 2 && is_number(first)) {  // plain list: one length per line
    const std::size_t v = model.batch_size_index() == 0 ? 1 : 0;
    CsvTable table = parse_csv(vars[v] + "\n" + text, path);
    for (std::size_t& line : table.line_numbers) --line;  // the header above is not in the file
    std::vector<std::vector<double>> records;
    for (std::size_t r = 0; r < table.rows.size(); ++r) {
      std::vector<double> dims(2, 1.0);  // the batch-size entry: one record
      dims[v] = table.dim(r, 0, "plan", false);
      records.push_back(std::move(dims));
    }
    return records;
  }
  const CsvTable table = parse_csv(text, path);
  std::vector<std::vector<double>> records(table.rows.size(), std::vector<double>(vars.size(), 0));
  for (auto& record : records) record[model.batch_size_index()] = 1;  // one record
  for (std::size_t v = 0; v < vars.size(); ++v) {
    if (v == model.batch_size_index()) continue;  // counted, not read
    const std::size_t c = table.column(vars[v]);
    for (std::size_t r = 0; r < table.rows.size(); ++r) records[r][v] = table.dim(r, c, "plan", false);
  }
  return records;
}

}  // namespace

po::options_description plan_options() {
  po::options_description desc(
      "xpm-plan plan --model M --csv RECORDS --capacity-bytes B [options]\n"
      "Splits an outer batch into microbatches predicted to fit the usable budget. RECORDS is a\n"
      "CSV with one column per variable but the batch-size one (e.g. l), or a plain list of\n"
      "lengths, one per line, for a model with one such variable; dims must be >= 0. No\n"
      "microbatch reaches a probe the model records as out of memory. Reports each microbatch's\n"
      "size, dims, predicted bytes and utilization (predicted / usable). Exit code 1 when a\n"
      "record does not fit even alone (the plan is printed, no figure is written).\nOptions");
  desc.add_options()
      ("help,h", "show this help")
      ("model", po::value<std::string>()->required(), "memory model JSON (required)")
      ("csv", po::value<std::string>()->required(), "records file (required; also positional)");
  add_budget_options(desc);
  desc.add_options()
      ("packer", po::value<std::string>()->default_value("adaptive"),
       "adaptive, uniform, ffd (first fit decreasing) or fastest (least predicted time: the model's "
       "time_model)")
      ("sort-by", po::value<std::string>()->default_value("", "none"),
       "adaptive and fastest packers: variable to sort records by, heaviest first")
      ("figure", po::value<std::string>(),
       "write an SVG figure here: utilization and records per microbatch")
      ("json", po::bool_switch()->default_value(false), "print one JSON object instead of text");
  return desc;
}

int run_plan(const po::variables_map& vm) {
  if (vm.count("figure")) {
    check_written_files({{"--figure", vm["figure"].as<std::string>()}},
                        {{"the --model file", vm["model"].as<std::string>()}, {"the --csv file", vm["csv"].as<std::string>()}});
  }
  const std::int64_t usable_given = usable_bytes_from(vm);
  const std::string packer_name = vm["packer"].as<std::string>();
  const std::string sort_by = vm["sort-by"].as<std::string>();
  const xpm::MemoryModel model = load_model(vm["model"].as<std::string>());
  // A model probed under a caching allocator: the budget in its predictions' (allocated) terms.
  const std::int64_t usable = model.prediction_budget_bytes(usable_given);
  xpm::PackerKind kind{};
  try {
    kind = xpm::parse_packer_kind(packer_name, "--packer");
  } catch (const std::invalid_argument& e) {
    throw InputError(e.what());
  }
  if (kind == xpm::PackerKind::kAdaptive) {
    const auto& vars = model.formula().variable_names();
    if (!sort_by.empty() && std::find(vars.begin(), vars.end(), sort_by) == vars.end()) {
      std::string names;
      for (const auto& v : vars) names += (names.empty() ? "" : ", ") + v;
      throw InputError("--sort-by: '" + sort_by + "' is not a variable of the model (" + names +
                       ")");
    }
  } else if (!sort_by.empty()) {
    throw InputError("--sort-by applies to the adaptive packer only");
  }
  if (kind == xpm::PackerKind::kFastest && !xpm::TimeModel::from_metadata(model)) {
    throw InputError("--packer fastest: the model " + vm["model"].as<std::string>() +
                     " has no time model (fitted to given measurements: only a probed model has one); "
                     "use --packer adaptive");
  }
  const std::shared_ptr<const xpm::MicrobatchPacker> packer = xpm::make_packer(kind, sort_by);

  const std::string source = vm["csv"].as<std::string>();
  const std::vector<std::vector<double>> records = read_records(source, model);
  xpm::MicrobatchPlan plan;
  try {
    plan = packer->pack(records, model, usable);
  } catch (const std::invalid_argument& e) {
    throw InputError(source + ": " + first_line(e.what()));
  }

  const double budget = static_cast<double>(usable);
  double sum = 0, min_u = 0, max_u = 0;
  for (std::size_t i = 0; i < plan.microbatches.size(); ++i) {
    const double u = plan.microbatches[i].predicted_bytes / budget;
    sum += u;
    min_u = i == 0 ? u : std::min(min_u, u);
    max_u = i == 0 ? u : std::max(max_u, u);
  }
  const double mean_u = plan.microbatches.empty() ? 0 : sum / static_cast<double>(plan.microbatches.size());

  std::ostringstream out;
  if (vm["json"].as<bool>()) {
    nlohmann::json j;
    j["packer"] = packer->name();
    j["usable_bytes"] = usable;
    if (usable != usable_given) j["usable_bytes_given"] = usable_given;  // less the model's reserved gap
    j["budget"] = budget_json(vm);
    j["records"] = records.size();
    nlohmann::json mbs = nlohmann::json::array();
    std::size_t extrapolated = 0;
    for (const auto& mb : plan.microbatches) {
      mbs.push_back({{"size", mb.record_indices.size()},
                     {"record_indices", mb.record_indices},
                     {"dims", dims_json(model, mb.dims)},
                     {"predicted_bytes", mb.predicted_bytes},
                     {"utilization", mb.predicted_bytes / budget},
                     {"over_budget", mb.over_budget},
                     {"extrapolation", extrapolation_json(model, mb.dims)}});
      extrapolated += model.extrapolation(mb.dims).empty() ? 0 : 1;
    }
    j["extrapolated_microbatches"] = extrapolated;
    j["microbatches"] = std::move(mbs);
    j["microbatch_count"] = plan.microbatches.size();
    j["mean_utilization"] = mean_u;
    j["min_utilization"] = min_u;
    j["max_utilization"] = max_u;
    j["over_budget_records"] = plan.over_budget_records;
    j["feasible"] = plan.over_budget_records.empty();
    out << j.dump() << "\n";
  } else {
    out << plan.microbatches.size() << " microbatches for " << records.size()
              << " records (packer " << packer->name() << ", usable " << usable << " bytes = "
              << mib_text(budget) << ")\n";
    for (std::size_t i = 0; i < plan.microbatches.size(); ++i) {
      const auto& mb = plan.microbatches[i];
      out << "  #" << i << ": size " << mb.record_indices.size() << ", "
                << dims_text(model, mb.dims) << ", predicted " << bytes_text(mb.predicted_bytes)
                << " bytes, utilization "
                << number_text(std::round(mb.predicted_bytes / budget * 1000) / 10) << " %"
                << (mb.over_budget ? "  OVER BUDGET" : "") << extrapolation_text(model, mb.dims)
                << "\n";
    }
    out << "utilization: mean " << number_text(std::round(mean_u * 1000) / 10)
              << " %, min " << number_text(std::round(min_u * 1000) / 10) << " %, max "
              << number_text(std::round(max_u * 1000) / 10) << " %\n";
  }
  if (!plan.over_budget_records.empty()) {
    std::cout << out.str();
    std::string rows;
    for (std::size_t k = 0; k < plan.over_budget_records.size() && k < 5; ++k) {
      const std::size_t r = plan.over_budget_records[k];
      rows += (k ? "; " : "") + std::string("#") + std::to_string(r) + " (" +
              dims_text(model, records[r]) + ")";
    }
    if (plan.over_budget_records.size() > 5) rows += "; ...";
    throw InfeasibleError(std::to_string(plan.over_budget_records.size()) + " of " +
                          std::to_string(records.size()) + " records in " + source +
                          " are predicted over the usable budget of " + std::to_string(usable) +
                          " bytes even alone (0-based record " + rows + ")");
  }
  if (vm.count("figure")) {
    const std::string figure = vm["figure"].as<std::string>();
    write_file_atomically(figure, plan_figure_svg(model, plan, usable, packer->name(), source));
    if (!vm["json"].as<bool>()) out << "wrote figure " << figure << "\n";
  }
  std::cout << out.str();
  return 0;
}

}  // namespace xpm_plan
