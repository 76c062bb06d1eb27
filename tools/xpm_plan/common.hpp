// xpm-plan shared pieces: the two error kinds (bad input -> exit 2, infeasible -> exit 1),
// option parsing helpers, budget options, number formatting and atomic file writes.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include "xpm/planner/memory_model.hpp"

namespace xpm_plan {

namespace po = boost::program_options;

/// A user error: bad option value, file, cell, ... Reported as "xpm-plan: error: ...", exit 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The input is fine but the request cannot be met (nothing fits the budget, a record is over
/// budget). Reported as "xpm-plan: error: ...", exit 1. The verb may print its report first.
struct InfeasibleError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// `text` with the planner's field names replaced by the options that set them
/// ("FitOptions::usable_max_rel_error" -> "--usable-max-rel-error", "MemoryModel: floor_bytes"
/// -> "--floor-bytes", ...): for messages of the planner shown at the command line.
std::string option_names(std::string text);

/// Refuses files a command would write that lose something: an empty name, the same file named
/// by two options, or a file the command reads (it would be overwritten). `outputs`: {option,
/// path} of each given one; `inputs`: {what it is ("the measurements file"), path}. InputError
/// naming the option and the file.
void check_written_files(const std::vector<std::pair<std::string, std::string>>& outputs,
                         const std::vector<std::pair<std::string, std::string>>& inputs);

/// A whole byte count from `text` ("196362432", "2e8"); InputError naming `option` otherwise.
std::int64_t byte_count(const std::string& text, const std::string& option);

/// The first line of an exception message (FormulaError adds a caret line below the first).
std::string first_line(const std::string& text);

std::string trim(const std::string& s);

/// "a, b,c" -> {"a", "b", "c"}; an empty item is an InputError naming --option.
std::vector<std::string> split_list(const std::string& text, const std::string& option);

/// Parses a finite number; `what` names the source in the error ("--dims l").
double parse_number(const std::string& text, const std::string& what);

/// What is wrong with a dim (a value of a formula variable), "" when nothing: not finite,
/// negative ("-4 is negative; dims must be >= 0"), or, for the batch-size variable (`count`),
/// zero. `text` is the value as written (number_text(value) when ""), `name` the variable.
std::string dim_problem(double value, const std::string& text, const std::string& name,
                        bool count);
/// Checks every dim of `dims` (variable order `names`; `count_index` the batch-size variable,
/// or >= names.size() for none); InputError "<where> <name>: <problem>" on the first bad one.
void check_dims(const std::vector<double>& dims, const std::vector<std::string>& names,
                std::size_t count_index, const std::string& where);

/// "l=128,d=64" (possibly given as several --option) -> {l: 128, d: 64}.
std::map<std::string, double> parse_assignments(const std::vector<std::string>& args,
                                                const std::string& option);

/// --capacity-bytes (required), --memory-fraction, --extra-overhead-bytes.
void add_budget_options(po::options_description& desc);
/// The usable bytes of the budget options; InputError naming the option when out of range.
std::int64_t usable_bytes_from(const po::variables_map& vm);
/// The budget options as JSON (capacity_bytes, memory_fraction, extra_overhead_bytes, usable).
nlohmann::json budget_json(const po::variables_map& vm);

/// Whole bytes, no exponent: 1234567.
std::string bytes_text(double bytes);
/// Human-readable size: "93.6 MiB".
std::string mib_text(double bytes);
/// Shortest round-tripping text of a double ("0.25", "96.008825348296654").
std::string number_text(double value);

/// "bs=8 l=128" in the model's variable order.
std::string dims_text(const xpm::MemoryModel& model, const std::vector<double>& dims);
/// {"bs": 8, "l": 128}.
nlohmann::json dims_json(const xpm::MemoryModel& model, const std::vector<double>& dims);

/// The variables of `dims` outside the model's probed range, as JSON: [{variable, value,
/// probed_min, probed_max, description}]; [] when inside or when the model records no range.
nlohmann::json extrapolation_json(const xpm::MemoryModel& model, const std::vector<double>& dims);
/// "; extrapolated: bs = 20 is 2.5x the largest probed bs (8)", or "" when inside the range.
std::string extrapolation_text(const xpm::MemoryModel& model, const std::vector<double>& dims);

/// Loads a memory model; errors name the path (--model).
xpm::MemoryModel load_model(const std::string& path);

/// Writes `text` to `path` atomically (xpm::write_file_atomically: temporary file in the same
/// folder, fsync, rename). Throws std::runtime_error naming the path.
void write_file_atomically(const std::string& path, const std::string& text);

/// Reads a whole file; InputError naming `what` and the path when unreadable.
std::string read_file(const std::string& path, const std::string& what);

}  // namespace xpm_plan

namespace xpm_plan {

/// The term each coefficient multiplies, in formula.coefficient_names() order, from the
/// expanded monomials: "bs*l^2", "bs*l - bs", "1" for a constant; "" when the coefficient is
/// not a linear factor of expanded terms (non-linear formulas).
std::vector<std::string> coefficient_terms(const xpm::CostFormula& formula);
/// The unit of a coefficient: "bytes per bs*l^2", "bytes" (constant term); for a non-linear
/// formula (linear = false) "" (an exponent has no unit; max(...) mixes terms).
std::string coefficient_unit(const std::string& term, bool linear);
/// "96.0088 bytes per bs*l^2", "49091684 bytes" (constant term), "1.7" (non-linear).
std::string coefficient_text(double value, const std::string& term, bool linear);

}  // namespace xpm_plan
