// time_model.cpp — a microbatch's forward and backward time, fitted to the probes (time_model.hpp).
#include "xpm/planner/time_model.hpp"

#include <cmath>
#include <set>
#include <stdexcept>
#include <string>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"

namespace xpm {

double TimeModel::work_bytes(const MemoryModel& model, const std::vector<double>& dims) {
  return model.added_bytes(dims);
}

double TimeModel::seconds(const MemoryModel& model, const std::vector<double>& dims) const {
  return overhead_s + seconds_per_byte * work_bytes(model, dims);
}

nlohmann::json TimeModel::to_json() const {
  return {{"overhead_s", overhead_s},
          {"seconds_per_byte", seconds_per_byte},
          {"max_rel_error", max_rel_error},
          {"fitted_points", fitted_points}};
}

std::optional<TimeModel> TimeModel::from_metadata(const MemoryModel& model) {
  const nlohmann::json& metadata = model.metadata();
  if (!metadata.is_object() || !metadata.contains("time_model")) return std::nullopt;
  const nlohmann::json& record = metadata["time_model"];
  const auto number = [&](const char* name) {
    if (!record.is_object() || !record.contains(name) || !record[name].is_number() ||
        !std::isfinite(record[name].get<double>())) {
      throw std::invalid_argument(std::string("memory model: metadata.time_model.") + name +
                                  " must be a finite number");
    }
    return record[name].get<double>();
  };
  TimeModel time;
  time.overhead_s = number("overhead_s");
  time.seconds_per_byte = number("seconds_per_byte");
  if (time.overhead_s < 0 || time.seconds_per_byte < 0) {
    throw std::invalid_argument("memory model: metadata.time_model's overhead_s and seconds_per_byte must be >= 0");
  }
  if (record.contains("max_rel_error") && record["max_rel_error"].is_number()) {
    time.max_rel_error = record["max_rel_error"].get<double>();
  }
  if (record.contains("fitted_points") && record["fitted_points"].is_number_unsigned()) {
    time.fitted_points = record["fitted_points"].get<std::size_t>();
  }
  return time;
}

std::optional<TimeModel> fit_time_model(const MemoryModel& model, const std::vector<ProbeResult>& probes) {
  std::vector<Measurement> measurements;
  std::set<double> works;
  for (const ProbeResult& probe : probes) {
    if (!probe.feasible || !(probe.forward_backward_s > 0) || !std::isfinite(probe.forward_backward_s)) continue;
    const double work = TimeModel::work_bytes(model, probe.dims);
    measurements.push_back({{work}, probe.forward_backward_s});
    works.insert(work);
  }
  if (works.size() < 3) return std::nullopt;
  const CostFormula line("overhead_s + seconds_per_byte*work", {"overhead_s", "seconds_per_byte"}, {"work"});
  FitResult fitted;
  try {
    fitted = fit_coefficients(line, measurements);
  } catch (const std::invalid_argument&) {
    return std::nullopt;  // the probes' work cannot separate the two terms
  }
  TimeModel time;
  time.overhead_s = fitted.coefficients[0];
  time.seconds_per_byte = fitted.coefficients[1];
  time.max_rel_error = fitted.summary.max_rel_error;
  time.fitted_points = measurements.size();
  if (!(time.overhead_s > 0 || time.seconds_per_byte > 0) || !std::isfinite(time.overhead_s) ||
      !std::isfinite(time.seconds_per_byte)) {
    return std::nullopt;
  }
  return time;
}

}  // namespace xpm
