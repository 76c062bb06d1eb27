// Names of the tagging job's enum settings: one table per enum, read both ways.
#include "xpm/tasks/tagging_choices.hpp"

#include <stdexcept>

#include "xpm/planner/enum_names.hpp"

namespace xpm {
namespace {

constexpr EnumNames<TaggingArchitecture, 2> kArchitectures{
    {{TaggingArchitecture::kTransformer, "transformer"}, {TaggingArchitecture::kBilstm, "bilstm"}}};
constexpr EnumNames<BatcherKind, 3> kBatchers{
    {{BatcherKind::kPredictive, "predictive"}, {BatcherKind::kFixed, "fixed"}, {BatcherKind::kPower, "power"}}};
constexpr EnumNames<TaggingMetric, 2> kMetrics{
    {{TaggingMetric::kTokenAccuracy, "token_accuracy"}, {TaggingMetric::kLoss, "loss"}}};

}  // namespace

TaggingArchitecture parse_tagging_architecture(const std::string& text, const std::string& source) {
  return parse_enum(kArchitectures, text, source);
}
BatcherKind parse_batcher_kind(const std::string& text, const std::string& source) {
  return parse_enum(kBatchers, text, source);
}
TaggingMetric parse_tagging_metric(const std::string& text, const std::string& source) {
  return parse_enum(kMetrics, text, source);
}
std::optional<MetricMode> parse_validation_mode(const std::string& text, const std::string& source) {
  return parse_metric_mode_choice(text, source);
}

std::string to_string(TaggingArchitecture architecture) { return enum_name(kArchitectures, architecture); }
std::string to_string(BatcherKind batcher) { return enum_name(kBatchers, batcher); }
std::string to_string(TaggingMetric metric) { return enum_name(kMetrics, metric); }
std::string to_string(const std::optional<MetricMode>& mode) { return mode ? to_string(*mode) : "auto"; }

}  // namespace xpm
