// residual_structure.cpp — runs test on the signs of a fit's residuals (see the header).
#include "residual_structure.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "number_format.hpp"

namespace xpm::detail {
namespace {

constexpr std::size_t kMinPoints = 8;
constexpr double kMinRelError = 0.001;  // residuals below 0.1 %: nothing worth saying
constexpr double kRunsZ = -2.0;

struct Run {
  bool positive;
  double from, to;  // range of the variable over the run
};

// Runs of residual signs along variable v (points ordered by v, then by the other variables);
// exact zeros take the sign of the run they are in.
std::vector<Run> sign_runs(const std::vector<Measurement>& measurements,
                           const std::vector<double>& rel_errors, std::size_t v) {
  std::vector<std::size_t> order(measurements.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    if (measurements[a].dims[v] != measurements[b].dims[v]) {
      return measurements[a].dims[v] < measurements[b].dims[v];
    }
    return measurements[a].dims < measurements[b].dims;
  });
  std::vector<Run> runs;
  for (std::size_t i : order) {
    const double value = measurements[i].dims[v];
    const bool positive = rel_errors[i] > 0 || (rel_errors[i] == 0 && !runs.empty() && runs.back().positive);
    if (runs.empty() || runs.back().positive != positive) {
      runs.push_back({positive, value, value});
    } else {
      runs.back().to = value;
    }
  }
  return runs;
}

double runs_z(std::size_t runs, std::size_t positive, std::size_t negative) {
  const double n = static_cast<double>(positive + negative);
  const double p = static_cast<double>(positive), q = static_cast<double>(negative);
  const double mean = 2 * p * q / n + 1;
  const double variance = 2 * p * q * (2 * p * q - n) / (n * n * (n - 1));
  if (!(variance > 0)) return 0;
  return (static_cast<double>(runs) - mean) / std::sqrt(variance);
}

std::string describe_runs(const std::string& name, const std::vector<Run>& runs) {
  std::string out;
  for (std::size_t r = 0; r < runs.size(); ++r) {
    out += (r ? ", " : "") + std::string(runs[r].positive ? "over-predicted" : "under-predicted") +
           " for " + name + " in [" + short_double(runs[r].from) + ", " + short_double(runs[r].to) + "]";
  }
  return out;
}

// A max() of two pieces of the formula's shape, or, for a formula with max() already, one more
// argument.
std::string suggestion(const CostFormula& formula) {
  const std::string& text = formula.canonical();
  if (text.find("max(") != std::string::npos) {
    return "try one more argument in its max(), a piece that wins where the residuals are negative";
  }
  const auto& names = formula.coefficient_names();
  return "try a max() of pieces, e.g. max(" + rename_identifiers(text, names, "", "1") + ", " +
         rename_identifiers(text, names, "", "2") + ")";
}

}  // namespace

std::string rename_identifiers(const std::string& text, const std::vector<std::string>& names,
                               const std::string& prefix, const std::string& suffix) {
  std::string out;
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (!(std::isalpha(c) || c == '_')) {
      out += text[i++];
      continue;
    }
    std::size_t end = i;
    while (end < text.size() &&
           (std::isalnum(static_cast<unsigned char>(text[end])) || text[end] == '_')) {
      ++end;
    }
    const std::string word = text.substr(i, end - i);
    const bool rename = std::find(names.begin(), names.end(), word) != names.end();
    out += rename ? prefix + word + suffix : word;
    i = end;
  }
  return out;
}

std::string residual_structure(const CostFormula& formula, const std::vector<Measurement>& measurements,
                               const std::vector<double>& rel_errors) {
  if (measurements.size() < kMinPoints || rel_errors.size() != measurements.size()) return "";
  double largest = 0;
  std::size_t positive = 0;
  for (double r : rel_errors) {
    if (!std::isfinite(r)) return "";
    largest = std::max(largest, std::abs(r));
    positive += r > 0 ? 1 : 0;
  }
  const std::size_t negative = rel_errors.size() - positive;
  if (largest < kMinRelError || positive == 0 || negative == 0) return "";
  const auto& names = formula.variable_names();
  for (std::size_t v = 0; v < names.size(); ++v) {
    std::set<double> values;
    for (const Measurement& m : measurements) values.insert(m.dims[v]);
    if (values.size() < 3) continue;
    const std::vector<Run> runs = sign_runs(measurements, rel_errors, v);
    const double z = runs_z(runs.size(), positive, negative);
    if (z >= kRunsZ) continue;
    return "residuals are grouped by " + names[v] + ": " + describe_runs(names[v], runs) + " (" +
           std::to_string(runs.size()) + " sign runs over " + std::to_string(measurements.size()) +
           " points, runs-test z = " + short_double(std::round(z * 100) / 100) +
           "); one formula may not describe every shape (the peak can move from one operation to "
           "another): " + suggestion(formula);
  }
  return "";
}

}  // namespace xpm::detail
