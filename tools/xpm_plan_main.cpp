// xpm-plan — model peak memory offline: fit a cost formula to measurements, save the memory
// model, and query it (largest microbatch size, microbatch plan of an outer batch).
//
//   xpm-plan fit --csv probes.csv --formula 'a*bs*l^2 + b*bs*l + c' --coefficients a,b,c
//                --variables bs,l --bytes-column peak_allocated_bytes --output model.json
//   xpm-plan max-batch --model model.json --dims l=128 --capacity-bytes 85899345920
//   xpm-plan plan --model model.json --csv records.csv --capacity-bytes 85899345920 --sort-by l
//
// Exit codes: 0 success; 2 bad input (options, files, CSV cells, formula, budget), with one
// line on stderr starting "xpm-plan: error:"; 1 internal error. Files are written atomically
// and only after everything else succeeded, so a failed run leaves nothing half-written.
//
// CSV files: the first non-blank line names the columns; cells are separated by commas and may
// be double-quoted ("" escapes a quote); blank lines are skipped; every row has as many cells as
// the header; numeric cells must parse completely as finite numbers. Extra columns are ignored.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include "xpm/planner/budget.hpp"
#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"
#include "xpm/planner/memory_model.hpp"
#include "xpm/planner/packer.hpp"

namespace po = boost::program_options;

namespace {

// A user error: bad option value, file, cell, ... Reported as "xpm-plan: error: ...", exit 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ------------------------------------------------------------------------------------------
// Strict CSV reader

struct CsvTable {
  std::string path;
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;  // one per data row, header.size() cells each
  std::vector<std::size_t> line_numbers;       // 1-based file line of each row

  std::size_t column(const std::string& name) const {
    auto it = std::find(header.begin(), header.end(), name);
    if (it == header.end()) {
      std::string names;
      for (const auto& h : header) names += (names.empty() ? "" : ", ") + h;
      throw InputError(path + ": no column '" + name + "' (columns: " + names + ")");
    }
    return static_cast<std::size_t>(it - header.begin());
  }

  double number(std::size_t row, std::size_t col) const {
    const std::string& cell = rows[row][col];
    double value = 0;
    const char* end = cell.data() + cell.size();
    auto [ptr, ec] = std::from_chars(cell.data(), end, value);
    if (cell.empty() || ec != std::errc() || ptr != end || !std::isfinite(value)) {
      throw InputError(path + ": line " + std::to_string(line_numbers[row]) + ", column '" +
                       header[col] + "': '" + cell + "' is not a finite number");
    }
    return value;
  }
};

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

std::vector<std::string> split_csv_line(const std::string& line, const std::string& path,
                                        std::size_t line_number) {
  std::vector<std::string> cells;
  std::size_t i = 0;
  while (true) {
    std::string cell;
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    if (i < line.size() && line[i] == '"') {
      ++i;
      bool closed = false;
      while (i < line.size()) {
        if (line[i] == '"') {
          if (i + 1 < line.size() && line[i + 1] == '"') {
            cell += '"';
            i += 2;
            continue;
          }
          ++i;
          closed = true;
          break;
        }
        cell += line[i++];
      }
      if (!closed) {
        throw InputError(path + ": line " + std::to_string(line_number) +
                         ": unterminated quoted cell");
      }
      while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
      if (i < line.size() && line[i] != ',') {
        throw InputError(path + ": line " + std::to_string(line_number) +
                         ": unexpected text after a quoted cell");
      }
    } else {
      const std::size_t comma = line.find(',', i);
      const std::size_t stop = comma == std::string::npos ? line.size() : comma;
      cell = trim(line.substr(i, stop - i));
      i = stop;
    }
    cells.push_back(std::move(cell));
    if (i >= line.size()) break;
    ++i;  // skip the comma; a trailing comma yields a final empty cell
    if (i == line.size()) {
      cells.emplace_back();
      break;
    }
  }
  return cells;
}

CsvTable read_csv(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError("cannot read CSV file '" + path + "'");
  CsvTable table;
  table.path = path;
  std::string line;
  std::size_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (trim(line).empty()) continue;
    std::vector<std::string> cells = split_csv_line(line, path, line_number);
    if (table.header.empty()) {
      for (const auto& name : cells) {
        if (name.empty()) {
          throw InputError(path + ": line " + std::to_string(line_number) +
                           ": empty column name in the header");
        }
        if (std::count(cells.begin(), cells.end(), name) > 1) {
          throw InputError(path + ": line " + std::to_string(line_number) + ": column '" + name +
                           "' appears twice in the header");
        }
      }
      table.header = std::move(cells);
      continue;
    }
    if (cells.size() != table.header.size()) {
      throw InputError(path + ": line " + std::to_string(line_number) + " has " +
                       std::to_string(cells.size()) + " cells, the header has " +
                       std::to_string(table.header.size()));
    }
    table.rows.push_back(std::move(cells));
    table.line_numbers.push_back(line_number);
  }
  if (in.bad()) throw InputError("error while reading CSV file '" + path + "'");
  if (table.header.empty()) throw InputError(path + ": empty CSV file (no header row)");
  if (table.rows.empty()) throw InputError(path + ": no data rows after the header");
  return table;
}

// ------------------------------------------------------------------------------------------
// Option helpers

std::vector<std::string> split_list(const std::string& text, const std::string& option) {
  std::vector<std::string> items;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item = trim(item);
    if (item.empty()) throw InputError("--" + option + ": empty name in '" + text + "'");
    items.push_back(item);
  }
  if (items.empty()) throw InputError("--" + option + ": expected a comma-separated list");
  return items;
}

double parse_number(const std::string& text, const std::string& what) {
  const std::string t = trim(text);
  double value = 0;
  auto [ptr, ec] = std::from_chars(t.data(), t.data() + t.size(), value);
  if (t.empty() || ec != std::errc() || ptr != t.data() + t.size() || !std::isfinite(value)) {
    throw InputError(what + ": '" + text + "' is not a finite number");
  }
  return value;
}

// "l=128,d=64" (possibly given as several --dims) -> {l: 128, d: 64}.
std::map<std::string, double> parse_assignments(const std::vector<std::string>& args,
                                                const std::string& option) {
  std::map<std::string, double> out;
  for (const std::string& arg : args) {
    for (const std::string& item : split_list(arg, option)) {
      const auto eq = item.find('=');
      if (eq == std::string::npos) {
        throw InputError("--" + option + ": expected NAME=VALUE, got '" + item + "'");
      }
      const std::string name = trim(item.substr(0, eq));
      if (name.empty() || out.count(name)) {
        throw InputError("--" + option + ": empty or repeated name in '" + item + "'");
      }
      out[name] = parse_number(item.substr(eq + 1), "--" + option + " " + name);
    }
  }
  return out;
}

std::map<std::string, xpm::DimAggregation> parse_aggregation(const std::vector<std::string>& args) {
  std::map<std::string, xpm::DimAggregation> out;
  for (const std::string& arg : args) {
    for (const std::string& item : split_list(arg, "aggregation")) {
      const auto eq = item.find('=');
      if (eq == std::string::npos) {
        throw InputError("--aggregation: expected VAR=count|max|sum, got '" + item + "'");
      }
      out[trim(item.substr(0, eq))] = xpm::dim_aggregation_from_string(trim(item.substr(eq + 1)));
    }
  }
  return out;
}

void add_budget_options(po::options_description& desc) {
  desc.add_options()
      ("capacity-bytes", po::value<std::int64_t>()->required(),
       "device total memory or CPU cap, bytes (required)")
      ("memory-fraction", po::value<double>()->default_value(0.9, "0.9"),
       "share of capacity the plan may use, in (0, 1]")
      ("extra-overhead-bytes", po::value<std::int64_t>()->default_value(0),
       "bytes reserved for what probes don't see");
}

std::int64_t usable_bytes_from(const po::variables_map& vm) {
  xpm::MemoryBudget budget;
  budget.capacity_bytes = vm["capacity-bytes"].as<std::int64_t>();
  budget.memory_fraction = vm["memory-fraction"].as<double>();
  budget.extra_overhead_bytes = vm["extra-overhead-bytes"].as<std::int64_t>();
  return budget.usable_bytes();
}

std::string bytes_text(double bytes) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(0);
  os << bytes;
  return os.str();
}

std::string dims_text(const xpm::MemoryModel& model, const std::vector<double>& dims) {
  std::ostringstream os;
  const auto& vars = model.formula().variable_names();
  for (std::size_t v = 0; v < vars.size(); ++v) os << (v ? " " : "") << vars[v] << "=" << dims[v];
  return os.str();
}

nlohmann::json dims_json(const xpm::MemoryModel& model, const std::vector<double>& dims) {
  nlohmann::json j = nlohmann::json::object();
  const auto& vars = model.formula().variable_names();
  for (std::size_t v = 0; v < vars.size(); ++v) j[vars[v]] = dims[v];
  return j;
}

// ------------------------------------------------------------------------------------------
// Subcommands. Each has its options description (for --help) and a runner.

po::options_description fit_options() {
  po::options_description desc("xpm-plan fit [--csv] FILE [options]");
  desc.add_options()
      ("help,h", "show this help")
      ("csv", po::value<std::string>()->required(),
       "measurements CSV: a header row, one column per variable and the bytes column (required)")
      ("formula", po::value<std::string>()->required(),
       "cost formula, e.g. 'a*bs*l^2 + b*bs*l + c' (required)")
      ("coefficients", po::value<std::string>()->required(),
       "comma-separated coefficient names, e.g. a,b,c (required)")
      ("variables", po::value<std::string>()->required(),
       "comma-separated variable names, e.g. bs,l (required)")
      ("bytes-column", po::value<std::string>()->required(),
       "CSV column with the measured peak bytes (required)")
      ("batch-size-variable", po::value<std::string>()->default_value("", "first variable"),
       "variable that counts records in a microbatch")
      ("floor-bytes", po::value<double>()->default_value(0.0, "0"),
       "constant floor of every prediction (static memory), bytes")
      ("aggregation", po::value<std::vector<std::string>>()->composing(),
       "VAR=count|max|sum, how records combine per variable (repeatable; default: max)")
      ("allow-negative", po::bool_switch()->default_value(false, "off"),
       "let coefficients be negative (default: bounded below by 0)")
      ("output,o", po::value<std::string>()->default_value("", "none"),
       "save the memory model JSON here (atomic write)")
      ("json", po::bool_switch()->default_value(false, "off"),
       "print one JSON object instead of text");
  return desc;
}

int run_fit(const po::variables_map& vm) {
  const std::vector<std::string> coefficients = split_list(vm["coefficients"].as<std::string>(),
                                                           "coefficients");
  const std::vector<std::string> variables = split_list(vm["variables"].as<std::string>(),
                                                        "variables");
  const xpm::CostFormula formula(vm["formula"].as<std::string>(), coefficients, variables);
  std::string bs_variable = vm["batch-size-variable"].as<std::string>();
  if (bs_variable.empty()) bs_variable = variables.front();
  const auto aggregation = vm.count("aggregation")
                               ? parse_aggregation(vm["aggregation"].as<std::vector<std::string>>())
                               : std::map<std::string, xpm::DimAggregation>{};
  const double floor_bytes = vm["floor-bytes"].as<double>();
  // Validates the batch-size variable, aggregation and floor before reading the data.
  (void)xpm::MemoryModel(formula, std::vector<double>(coefficients.size(), 0.0), floor_bytes,
                         bs_variable, aggregation);

  const CsvTable table = read_csv(vm["csv"].as<std::string>());
  std::vector<std::size_t> var_columns;
  for (const auto& v : variables) var_columns.push_back(table.column(v));
  const std::size_t bytes_column = table.column(vm["bytes-column"].as<std::string>());
  std::vector<xpm::Measurement> measurements;
  for (std::size_t r = 0; r < table.rows.size(); ++r) {
    xpm::Measurement m;
    for (std::size_t c : var_columns) m.dims.push_back(table.number(r, c));
    m.bytes = table.number(r, bytes_column);
    if (m.bytes <= 0) {
      throw InputError(table.path + ": line " + std::to_string(table.line_numbers[r]) +
                       ", column '" + table.header[bytes_column] + "': bytes must be > 0, got " +
                       table.rows[r][bytes_column]);
    }
    measurements.push_back(std::move(m));
  }

  xpm::FitOptions options;
  options.non_negative = !vm["allow-negative"].as<bool>();
  const xpm::FitResult fit = xpm::fit_coefficients(formula, measurements, options);
  const xpm::FitSummary& s = fit.summary;

  xpm::MemoryModel model(formula, fit.coefficients, floor_bytes, bs_variable, aggregation);
  nlohmann::json probes = nlohmann::json::array();
  for (const auto& m : measurements) {
    probes.push_back({{"dims", dims_json(model, m.dims)}, {"bytes", m.bytes}});
  }
  model.metadata()["created_by"] = "xpm-plan fit";
  model.metadata()["source_csv"] = table.path;
  model.metadata()["fit"] = {{"converged", s.converged},       {"iterations", s.iterations},
                             {"points", measurements.size()},  {"max_rel_error", s.max_rel_error},
                             {"mean_rel_error", s.mean_rel_error},
                             {"rel_errors", s.rel_errors},     {"non_negative", options.non_negative},
                             {"solver_report", s.solver_report}};
  model.metadata()["measurements"] = std::move(probes);

  const std::string output = vm["output"].as<std::string>();
  if (!output.empty()) model.save(output);  // before printing: no output claims a failed save

  if (vm["json"].as<bool>()) {
    nlohmann::json j;
    j["formula"] = formula.text();
    j["canonical"] = formula.canonical();
    j["coefficients"] = model.to_json()["coefficients"];
    j["converged"] = s.converged;
    j["iterations"] = s.iterations;
    j["points"] = measurements.size();
    j["max_rel_error"] = s.max_rel_error;
    j["mean_rel_error"] = s.mean_rel_error;
    j["rel_errors"] = s.rel_errors;
    j["floor_bytes"] = floor_bytes;
    j["batch_size_variable"] = bs_variable;
    j["solver_report"] = s.solver_report;
    j["output"] = output.empty() ? nlohmann::json(nullptr) : nlohmann::json(output);
    std::cout << j.dump() << "\n";
  } else {
    std::cout << "formula: " << formula.canonical() << "\n"
              << "coefficients (bytes per unit of each term):\n";
    std::cout.precision(10);
    for (std::size_t k = 0; k < coefficients.size(); ++k) {
      std::cout << "  " << coefficients[k] << " = " << fit.coefficients[k] << "\n";
    }
    std::cout << s.brief_report() << "\n";
    if (!s.converged) std::cout << "solver: " << s.solver_report << "\n";
    if (!output.empty()) std::cout << "saved memory model to " << output << "\n";
  }
  if (!s.converged) std::cerr << "xpm-plan: warning: the fit did not converge\n";
  return 0;
}

po::options_description max_batch_options() {
  po::options_description desc("xpm-plan max-batch [options]");
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
      ("json", po::bool_switch()->default_value(false, "off"),
       "print one JSON object instead of text");
  return desc;
}

int run_max_batch(const po::variables_map& vm) {
  const xpm::MemoryModel model = xpm::MemoryModel::load(vm["model"].as<std::string>());
  std::map<std::string, double> dims_map =
      vm.count("dims") ? parse_assignments(vm["dims"].as<std::vector<std::string>>(), "dims")
                       : std::map<std::string, double>{};
  if (dims_map.count(model.batch_size_variable())) {
    throw InputError("--dims: '" + model.batch_size_variable() +
                     "' is the batch-size variable; max-batch computes it");
  }
  dims_map[model.batch_size_variable()] = 1;
  const std::vector<double> dims = model.formula().dims_from_map(dims_map, "--dims");
  const std::int64_t usable = usable_bytes_from(vm);
  const std::int64_t m = model.max_microbatch_size(dims, usable, vm["max-size"].as<std::int64_t>());
  std::vector<double> at_m = dims;
  at_m[model.batch_size_index()] = static_cast<double>(m);
  const double predicted = model.predict_bytes(at_m);
  if (vm["json"].as<bool>()) {
    nlohmann::json j;
    j["max_microbatch_size"] = m;
    j["predicted_bytes"] = predicted;
    j["usable_bytes"] = usable;
    j["dims"] = dims_json(model, at_m);
    std::cout << j.dump() << "\n";
  } else {
    std::cout << "max microbatch size " << m << " at " << dims_text(model, at_m) << ": predicted "
              << bytes_text(predicted) << " of " << usable << " usable bytes\n";
  }
  return 0;
}

po::options_description plan_options() {
  po::options_description desc("xpm-plan plan [options]");
  desc.add_options()
      ("help,h", "show this help")
      ("model", po::value<std::string>()->required(), "memory model JSON (required)")
      ("csv", po::value<std::string>()->required(),
       "records CSV: a header row, one column per variable but the batch-size one (required)");
  add_budget_options(desc);
  desc.add_options()
      ("packer", po::value<std::string>()->default_value("adaptive"), "adaptive or uniform")
      ("sort-by", po::value<std::string>()->default_value("", "none"),
       "adaptive packer: variable to sort records by, heaviest first")
      ("json", po::bool_switch()->default_value(false, "off"),
       "print one JSON object instead of text");
  return desc;
}

int run_plan(const po::variables_map& vm) {
  const xpm::MemoryModel model = xpm::MemoryModel::load(vm["model"].as<std::string>());
  const std::int64_t usable = usable_bytes_from(vm);
  const std::string packer_name = vm["packer"].as<std::string>();
  const std::string sort_by = vm["sort-by"].as<std::string>();
  std::unique_ptr<xpm::MicrobatchPacker> packer;
  if (packer_name == "adaptive") {
    xpm::AdaptivePackerOptions options;
    options.sort_by = sort_by;
    packer = std::make_unique<xpm::AdaptivePacker>(options);
  } else if (packer_name == "uniform") {
    if (!sort_by.empty()) throw InputError("--sort-by applies to the adaptive packer only");
    packer = std::make_unique<xpm::UniformPacker>();
  } else {
    throw InputError("--packer: unknown packer '" + packer_name + "' (adaptive or uniform)");
  }

  const CsvTable table = read_csv(vm["csv"].as<std::string>());
  const auto& vars = model.formula().variable_names();
  std::vector<std::vector<double>> records(table.rows.size(), std::vector<double>(vars.size(), 0));
  for (std::size_t v = 0; v < vars.size(); ++v) {
    if (v == model.batch_size_index()) continue;  // counted, not read
    const std::size_t c = table.column(vars[v]);
    for (std::size_t r = 0; r < table.rows.size(); ++r) records[r][v] = table.number(r, c);
  }
  const xpm::MicrobatchPlan plan = packer->pack(records, model, usable);

  if (vm["json"].as<bool>()) {
    nlohmann::json j;
    j["packer"] = packer->name();
    j["usable_bytes"] = usable;
    j["records"] = records.size();
    nlohmann::json mbs = nlohmann::json::array();
    for (const auto& mb : plan.microbatches) {
      mbs.push_back({{"size", mb.record_indices.size()},
                     {"record_indices", mb.record_indices},
                     {"dims", dims_json(model, mb.dims)},
                     {"predicted_bytes", mb.predicted_bytes},
                     {"over_budget", mb.over_budget}});
    }
    j["microbatches"] = std::move(mbs);
    j["over_budget_records"] = plan.over_budget_records;
    std::cout << j.dump() << "\n";
  } else {
    std::cout << plan.microbatches.size() << " microbatches for " << records.size()
              << " records (packer " << packer->name() << ", usable " << usable << " bytes)\n";
    for (std::size_t i = 0; i < plan.microbatches.size(); ++i) {
      const auto& mb = plan.microbatches[i];
      std::cout << "  #" << i << ": size " << mb.record_indices.size() << ", "
                << dims_text(model, mb.dims) << ", predicted " << bytes_text(mb.predicted_bytes)
                << " bytes" << (mb.over_budget ? "  OVER BUDGET" : "") << "\n";
    }
    if (!plan.over_budget_records.empty()) {
      std::cout << plan.over_budget_records.size()
                << " records are predicted over budget even alone (rows, 0-based):";
      for (std::size_t r : plan.over_budget_records) std::cout << " " << r;
      std::cout << "\n";
    }
  }
  return 0;
}

// ------------------------------------------------------------------------------------------

struct Command {
  const char* name;
  const char* summary;
  po::options_description (*options)();
  int (*run)(const po::variables_map&);
  const char* positional;  // option that takes one positional argument, or nullptr
};

const std::vector<Command>& commands() {
  static const std::vector<Command> list = {
      {"fit", "fit a cost formula to measured peak bytes; print and save the memory model",
       fit_options, run_fit, "csv"},
      {"max-batch", "largest microbatch size a memory model predicts within budget",
       max_batch_options, run_max_batch, nullptr},
      {"plan", "split an outer batch (records CSV) into microbatches that fit the budget",
       plan_options, run_plan, nullptr},
  };
  return list;
}

void print_usage(std::ostream& os) {
  os << "usage: xpm-plan COMMAND [options]   (xpm-plan COMMAND --help for one command)\n\n"
     << "commands:\n";
  for (const Command& c : commands()) {
    const std::string name = c.name;
    os << "  " << name << std::string(name.size() < 11 ? 11 - name.size() : 1, ' ') << c.summary
       << "\n";
  }
  os << "\nexit codes: 0 success, 2 bad input (one line on stderr), 1 internal error\n";
  for (const Command& c : commands()) os << "\n" << c.options();
}

int run(int argc, char** argv) {
  if (argc < 2) throw InputError("missing command (fit, max-batch, plan); see xpm-plan --help");
  const std::string name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    print_usage(std::cout);
    return 0;
  }
  auto it = std::find_if(commands().begin(), commands().end(),
                         [&](const Command& c) { return name == c.name; });
  if (it == commands().end()) {
    throw InputError("unknown command '" + name + "' (fit, max-batch, plan); see xpm-plan --help");
  }
  const po::options_description desc = it->options();
  po::positional_options_description positional;
  if (it->positional != nullptr) positional.add(it->positional, 1);
  po::variables_map vm;
  po::store(po::command_line_parser(std::vector<std::string>(argv + 2, argv + argc))
                .options(desc)
                .positional(positional)
                .run(),
            vm);
  if (vm.count("help")) {
    std::cout << desc;
    return 0;
  }
  po::notify(vm);
  return it->run(vm);
}

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  std::replace(s.begin(), s.end(), '\r', ' ');
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const po::error& e) {
    std::cerr << "xpm-plan: error: " << one_line(e.what()) << "\n";
  } catch (const InputError& e) {
    std::cerr << "xpm-plan: error: " << one_line(e.what()) << "\n";
  } catch (const std::invalid_argument& e) {  // formula, fit, budget, model file fields
    std::cerr << "xpm-plan: error: " << one_line(e.what()) << "\n";
  } catch (const std::runtime_error& e) {  // unreadable or unwritable files
    std::cerr << "xpm-plan: error: " << one_line(e.what()) << "\n";
  } catch (const std::exception& e) {
    std::cerr << "xpm-plan: internal error: " << one_line(e.what()) << "\n";
    return 1;
  }
  return 2;
}
