// xpm/tasks/tagging_choices.hpp — the closed sets of values of the tagging job's settings, as
// enums, with the names the command line and the run folder's config.json use.
//
//   TaggingJobConfig config;
//   config.packer = xpm::parse_packer_kind("ffd", "--packer");   // PackerKind::kFirstFitDecreasing
//   xpm::to_string(config.packer);                               // "ffd"
//
// Every parse_* throws std::invalid_argument "<source> must be <the names>, got '<text>'".
// The enums of the planner (PackerKind, packer_kind.hpp) and of the generic trainer
// (LrScheduleKind, Precision, ShardingStrategy, MetricMode, OptimizerCheckpointLayout,
// CollectiveBackend) have their own parse_* and to_string next to them.
#pragma once

#include <optional>
#include <string>

#include "xpm/planner/packer_kind.hpp"
#include "xpm/trainer/loop/learner.hpp"
#include "xpm/trainer/loop/validation.hpp"

namespace xpm {

enum class TaggingArchitecture { kTransformer, kBilstm };                  // "transformer" | "bilstm"
enum class BatcherKind { kPredictive, kFixed, kPower };                    // fixed_batchers.hpp
enum class TaggingMetric { kTokenAccuracy, kLoss };                        // "token_accuracy" | "loss"

TaggingArchitecture parse_tagging_architecture(const std::string& text, const std::string& source);
BatcherKind parse_batcher_kind(const std::string& text, const std::string& source);
TaggingMetric parse_tagging_metric(const std::string& text, const std::string& source);
/// "min" | "max" | "auto" (nullopt: the metric's natural direction).
std::optional<MetricMode> parse_validation_mode(const std::string& text, const std::string& source);

std::string to_string(TaggingArchitecture architecture);
std::string to_string(BatcherKind batcher);
std::string to_string(TaggingMetric metric);
std::string to_string(const std::optional<MetricMode>& mode);  // "min" | "max" | "auto"

}  // namespace xpm
