#include <doctest/doctest.h>

#include <algorithm>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "xpm/planner/packer_kind.hpp"
#include "xpm/planner/step_plan.hpp"

namespace {

nlohmann::json step_plan_table() {
  std::ifstream in(std::string(XPM_SOURCE_DIR) + "/tests/planner/step_plans.json");
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

std::vector<std::vector<double>> outer_batch_dims(const nlohmann::json& lengths) {
  std::vector<std::vector<double>> dims;
  for (const auto& length : lengths) dims.push_back({1.0, length.get<double>()});
  return dims;
}

// The table's phase models (StepPhaseModels) for a case marked "phases", else none.
struct CasePhases {
  std::optional<xpm::MemoryModel> first_of_several, first_alone, synchronised;

  CasePhases(const nlohmann::json& table, const nlohmann::json& c) {
    if (!c.value("phases", false)) return;
    const nlohmann::json& models = table.at("phase_models");
    first_of_several.emplace(xpm::MemoryModel::from_json(models.at("first_of_several")));
    first_alone.emplace(xpm::MemoryModel::from_json(models.at("first_alone")));
    synchronised.emplace(xpm::MemoryModel::from_json(models.at("synchronised")));
  }

  xpm::StepPhaseModels models() const {
    if (!first_of_several) return {};
    return {&*first_of_several, &*first_alone, &*synchronised};
  }
};

}  // namespace

// The table the Python sampler checks too (tests/python/test_step_plans.py): the C++
// data-parallel step and the sampler plan every step alike.
TEST_CASE("plan_step gives the shared table's shares and microbatches, every rank's plan within the budget") {
  const nlohmann::json table = step_plan_table();
  const xpm::MemoryModel steady_model = xpm::MemoryModel::from_json(table.at("model"));
  const xpm::MemoryModel phase_model = xpm::MemoryModel::from_json(table.at("phase_model"));
  REQUIRE(table.at("cases").size() >= 8);
  for (const auto& c : table.at("cases")) {
    CAPTURE(c.at("name").get<std::string>());
    const CasePhases phases(table, c);
    const xpm::MemoryModel& model = c.value("phases", false) ? phase_model : steady_model;
    const xpm::PackerKind kind = xpm::parse_packer_kind(c.at("packer").get<std::string>(), "packer");
    const auto packer = xpm::make_packer(kind, xpm::packer_takes_sort_by(kind) ? "l" : "");
    xpm::StepPlanOptions options;
    options.world_size = c.at("world_size").get<int>();
    options.lockstep = c.at("lockstep").get<bool>();
    options.phases = phases.models();
    const auto budget = c.at("planning_bytes").get<std::int64_t>();
    const xpm::StepPlan step = xpm::plan_step(outer_batch_dims(c.at("lengths")), model, *packer, budget, options);
    const auto& ranks = c.at("ranks");
    REQUIRE(step.rank_plans.size() == ranks.size());
    std::size_t microbatches = 0;
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      CAPTURE(r);
      CHECK(step.assignment.records_per_rank[r] == ranks[r].at("share").get<std::vector<std::size_t>>());
      const auto& plan = step.rank_plans[r].microbatches;
      REQUIRE(plan.size() == ranks[r].at("microbatches").size());
      if (options.lockstep) CHECK((r == 0 || plan.size() == microbatches));
      microbatches = plan.size();
      for (std::size_t k = 0; k < plan.size(); ++k) {
        CHECK(plan[k].record_indices == ranks[r].at("microbatches")[k].get<std::vector<std::size_t>>());
        CHECK(plan[k].dims == ranks[r].at("dims")[k].get<std::vector<double>>());
        CHECK(plan[k].predicted_bytes == doctest::Approx(ranks[r].at("predicted_bytes")[k].get<double>()).epsilon(1e-12));
        CHECK(plan[k].over_budget == ranks[r].at("over_budget")[k].get<bool>());
        CHECK((plan[k].over_budget || plan[k].predicted_bytes <= static_cast<double>(budget)));
      }
    }
  }
}

TEST_CASE("plan_step packs only the rank asked for without lockstep, and refuses bad options") {
  const nlohmann::json table = step_plan_table();
  const xpm::MemoryModel model = xpm::MemoryModel::from_json(table.at("model"));
  const auto packer = xpm::make_packer(xpm::PackerKind::kAdaptive, "l");
  const auto dims = outer_batch_dims(table.at("cases")[1].at("lengths"));
  xpm::StepPlanOptions options;
  options.world_size = 2;
  const xpm::StepPlan all = xpm::plan_step(dims, model, *packer, 2'500'000, options);
  options.only_rank = 1;
  const xpm::StepPlan mine = xpm::plan_step(dims, model, *packer, 2'500'000, options);
  CHECK(mine.rank_plans[0].microbatches.empty());
  REQUIRE(mine.rank_plans[1].microbatches.size() == all.rank_plans[1].microbatches.size());
  CHECK(mine.rank_plans[1].microbatches[0].record_indices == all.rank_plans[1].microbatches[0].record_indices);
  options.only_rank = 2;
  CHECK_THROWS_WITH_AS(xpm::plan_step(dims, model, *packer, 2'500'000, options),
                       "plan_step: only_rank 2 is not a rank of world_size 2", std::invalid_argument);
  options = {};
  options.world_size = 0;
  CHECK_THROWS_AS(xpm::plan_step(dims, model, *packer, 2'500'000, options), std::invalid_argument);
  CHECK_THROWS_AS(xpm::plan_step(dims, model, *packer, 0, {}), std::invalid_argument);
  const xpm::MemoryModel other(xpm::CostFormula("a*bs*t + c", {"a", "c"}, {"bs", "t"}), {900.0, 1e6}, 0, "bs");
  options = {};
  options.phases.synchronised = &other;
  CHECK_THROWS_WITH_AS(xpm::plan_step(dims, model, *packer, 2'500'000, options),
                       doctest::Contains("is not over the model's variables"), std::invalid_argument);
}
