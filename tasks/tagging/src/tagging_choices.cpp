// Names of the tagging job's enum settings: one table per enum, read both ways.
#include "xpm/tasks/tagging_choices.hpp"

#include <array>
#include <stdexcept>
#include <utility>

namespace xpm {
namespace {

template <class Enum, std::size_t N>
using NameTable = std::array<std::pair<Enum, const char*>, N>;

template <class Enum, std::size_t N>
Enum parse_name(const NameTable<Enum, N>& names, const std::string& text, const std::string& source,
                const std::string& expected) {
  for (const auto& [value, name] : names) {
    if (text == name) return value;
  }
  throw std::invalid_argument(source + " must be " + expected + ", got '" + text + "'");
}

template <class Enum, std::size_t N>
std::string name_of(const NameTable<Enum, N>& names, Enum value) {
  for (const auto& [entry, name] : names) {
    if (entry == value) return name;
  }
  throw std::logic_error("an enum value without a name");
}

constexpr NameTable<TaggingArchitecture, 2> kArchitectures{
    {{TaggingArchitecture::kTransformer, "transformer"}, {TaggingArchitecture::kBilstm, "bilstm"}}};
constexpr NameTable<BatcherKind, 3> kBatchers{
    {{BatcherKind::kPredictive, "predictive"}, {BatcherKind::kFixed, "fixed"}, {BatcherKind::kPower, "power"}}};
constexpr NameTable<PackerKind, 3> kPackers{{{PackerKind::kAdaptive, "adaptive"},
                                             {PackerKind::kUniform, "uniform"},
                                             {PackerKind::kFirstFitDecreasing, "ffd"}}};
constexpr NameTable<TaggingMetric, 2> kMetrics{
    {{TaggingMetric::kTokenAccuracy, "token_accuracy"}, {TaggingMetric::kLoss, "loss"}}};
constexpr NameTable<OptimizerCheckpointLayout, 2> kLayouts{
    {{OptimizerCheckpointLayout::kPerRankShards, "sharded"}, {OptimizerCheckpointLayout::kConsolidated, "full"}}};

}  // namespace

TaggingArchitecture parse_tagging_architecture(const std::string& text, const std::string& source) {
  return parse_name(kArchitectures, text, source, "'transformer' or 'bilstm'");
}
BatcherKind parse_batcher_kind(const std::string& text, const std::string& source) {
  return parse_name(kBatchers, text, source, "'predictive', 'fixed' or 'power'");
}
PackerKind parse_packer_kind(const std::string& text, const std::string& source) {
  return parse_name(kPackers, text, source, "'adaptive', 'uniform' or 'ffd'");
}
TaggingMetric parse_tagging_metric(const std::string& text, const std::string& source) {
  return parse_name(kMetrics, text, source, "'token_accuracy' or 'loss'");
}
OptimizerCheckpointLayout parse_optimizer_checkpoint_layout(const std::string& text, const std::string& source) {
  return parse_name(kLayouts, text, source,
                    "'sharded' (each rank writes optimizer-rank<r>.pt) or 'full' (one consolidated "
                    "optimizer.pt any world size can load)");
}
std::optional<MetricMode> parse_validation_mode(const std::string& text, const std::string& source) {
  if (text == "auto") return std::nullopt;
  if (text == "min") return MetricMode::kMin;
  if (text == "max") return MetricMode::kMax;
  throw std::invalid_argument(source + " must be 'min', 'max' or 'auto', got '" + text + "'");
}

std::string to_string(TaggingArchitecture architecture) { return name_of(kArchitectures, architecture); }
std::string to_string(BatcherKind batcher) { return name_of(kBatchers, batcher); }
std::string to_string(PackerKind packer) { return name_of(kPackers, packer); }
std::string to_string(TaggingMetric metric) { return name_of(kMetrics, metric); }
std::string optimizer_checkpoint_name(OptimizerCheckpointLayout layout) { return name_of(kLayouts, layout); }
std::string validation_mode_name(const std::optional<MetricMode>& mode) {
  return mode ? to_string(*mode) : "auto";
}

}  // namespace xpm
