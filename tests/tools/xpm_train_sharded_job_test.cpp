// xpm-train --sharding shard_grad_op at world 2 (gloo over loopback, the real corpus), against
// the unsharded job: same parameters within float tolerance, each rank's AdamW state and static
// bytes measured lower by half the state, the memory plan still exact (prediction error, no
// out-of-memory); per-rank checkpoints resume bit for bit at world 2; a consolidated checkpoint
// of world 2 resumes at world 1; per-rank shards refuse another world size before anything is
// written; bad settings exit 2.
#include "torch_doctest.hpp"
#include "tools/xpm_train_runs.hpp"

#include <filesystem>
#include <fstream>
#include <string>

using namespace xpm_train_runs;

namespace {

const std::string kSharded = kWork + "/sharded";
// kSharded/NAME, removed when the running test case passes.
std::string sharded_dir(const std::string& name) { return scratch("sharded/" + name); }
// Checkpoints every 2 steps of a 4-step run (the world-2 stop/resume cases stop after step 2).
const std::string kFourSteps = kCommon + "--max-steps 4 --checkpoint-every-steps 2 ";

// The 4-step run `args` describes, whole in kSharded/NAME_whole and stopped after step 2 in
// kSharded/NAME_cut (fresh folders); `checkpoint` is the stopped run's step-2 checkpoint.
struct StoppedRuns {
  std::string whole, cut, checkpoint;
};
StoppedRuns run_whole_and_stopped(const std::string& name, const std::string& args) {
  StoppedRuns runs{sharded_dir(name + "_whole"), sharded_dir(name + "_cut"), ""};
  runs.checkpoint = runs.cut + "/checkpoints/step-00000002";
  std::filesystem::remove_all(runs.whole);
  std::filesystem::remove_all(runs.cut);
  const Run uninterrupted = run_train(args + "--run-dir '" + runs.whole + "'");
  REQUIRE_MESSAGE(uninterrupted.exit_code == 0, uninterrupted.output);
  const Run first = run_train(args + "--stop-after-steps 2 --run-dir '" + runs.cut + "'");
  REQUIRE_MESSAGE(first.exit_code == 0, first.output);
  return runs;
}

}  // namespace

TEST_CASE("sharding: shard_grad_op at world 2 trains like no_shard with half the AdamW state per rank") {
  for (const char* name : {"plain", "sharded"}) std::filesystem::remove_all(sharded_dir(name));
  const Run plain = run_train(kCommon + "--max-steps 4 --nproc 2 --run-dir '" + kSharded + "/plain'");
  REQUIRE_MESSAGE(plain.exit_code == 0, plain.output);
  const Run sharded = run_train(kCommon + "--max-steps 4 --nproc 2 --sharding shard_grad_op --run-dir '" +
                                kSharded + "/sharded'");
  REQUIRE_MESSAGE(sharded.exit_code == 0, sharded.output);

  const double rel = relative_parameter_difference(load_parameters(kSharded + "/plain/final_parameters.pt"),
                                                   load_parameters(kSharded + "/sharded/final_parameters.pt"));
  MESSAGE("relative parameter difference shard_grad_op vs no_shard, world 2, 4 steps: " << rel);
  CHECK(rel <= 1e-5);

  const nlohmann::json p = read_summary(kSharded + "/plain"), s = read_summary(kSharded + "/sharded");
  CHECK(p.at("sharding") == "no_shard");
  CHECK(s.at("sharding") == "shard_grad_op");
  const auto p_state = p.at("optimizer_state_bytes_per_rank").get<std::vector<std::int64_t>>();
  const auto s_state = s.at("optimizer_state_bytes_per_rank").get<std::vector<std::int64_t>>();
  const auto p_static = p.at("static_bytes_per_rank").get<std::vector<std::int64_t>>();
  const auto s_static = s.at("static_bytes_per_rank").get<std::vector<std::int64_t>>();
  REQUIRE(p_state.size() == 2);
  REQUIRE(s_state.size() == 2);
  MESSAGE("AdamW state per rank: no_shard " << p_state[0] << ", " << p_state[1] << "; shard_grad_op "
                                            << s_state[0] << ", " << s_state[1]);
  MESSAGE("static bytes per rank (meter): no_shard " << p_static[0] << ", " << p_static[1]
                                                     << "; shard_grad_op " << s_static[0] << ", " << s_static[1]);
  CHECK(p_state[0] == p_state[1]);
  // Halved: the two shards add up to the whole state (the padding of the last shard aside).
  CHECK(s_state[0] + s_state[1] == p_state[0]);
  CHECK(s_state[0] - s_state[1] <= 8 * 2);  // ceil split: at most one element apart per moment
  for (std::size_t r = 0; r < 2; ++r) {
    // The meter sees the saving: static bytes fall by what the state lost (within 1 KiB).
    CHECK(std::abs((p_static[r] - s_static[r]) - (p_state[r] - s_state[r])) < 1024);
  }
  // The plan holds under sharding: probes measured what a sharded rank holds.
  CHECK(s.at("ooms") == 0);
  CHECK(s.at("underpredictions") == 0);
  CHECK(s.at("max_step_prediction_rel_error").get<double>() < 0.01);
  CHECK(s.at("peak_allocated_bytes").get<std::int64_t>() <= s.at("capacity_bytes").get<std::int64_t>());
  // The memory model is keyed by the sharding and records it.
  std::ifstream model_file(kSharded + "/sharded/memory_model.json");
  const nlohmann::json model = nlohmann::json::parse(model_file);
  CHECK(model.at("metadata").at("sharding") == "shard_grad_op");
}

TEST_CASE("sharding: per-rank checkpoints of shard_grad_op resume bit for bit at world 2") {
  const std::string args = kFourSteps + "--nproc 2 --sharding shard_grad_op ";
  const StoppedRuns runs = run_whole_and_stopped("ckpt", args);
  const std::string &whole = runs.whole, &cut = runs.cut, &folder = runs.checkpoint;
  CHECK(std::filesystem::exists(folder + "/optimizer-rank0.pt"));
  CHECK(std::filesystem::exists(folder + "/optimizer-rank1.pt"));
  CHECK_FALSE(std::filesystem::exists(folder + "/optimizer.pt"));
  // The shards are in the manifest, checksummed like every file of the checkpoint.
  std::ifstream manifest_file(folder + "/manifest.json");
  const nlohmann::json manifest = nlohmann::json::parse(manifest_file);
  CHECK(manifest.at("files").contains("optimizer-rank1.pt"));

  // Another world size cannot load per-rank shards: refused before anything is written.
  const auto config_before = std::filesystem::last_write_time(cut + "/config.json");
  const Run wrong_world = run_train(kFourSteps + "--nproc 1 --resume --run-dir '" + cut + "'");
  CHECK(wrong_world.exit_code == 2);
  CHECK_MESSAGE(wrong_world.output.find("optimizer-rank<r>.pt of 2 rank(s)") != std::string::npos,
                wrong_world.output);
  CHECK_MESSAGE(wrong_world.output.find("--optimizer-checkpoint full") != std::string::npos, wrong_world.output);
  CHECK(std::filesystem::last_write_time(cut + "/config.json") == config_before);

  const Run second = run_train(args + "--resume --run-dir '" + cut + "'");
  REQUIRE_MESSAGE(second.exit_code == 0, second.output);
  const auto a = load_parameters(whole + "/final_parameters.pt");
  const auto b = load_parameters(cut + "/final_parameters.pt");
  REQUIRE(a.size() == b.size());
  for (const auto& [name, tensor] : a) CHECK_MESSAGE(torch::equal(tensor, b.at(name)), name);
  CHECK(read_summary(cut).at("resumed_from_step") == 2);
  CHECK(read_summary(cut).at("memory_model_from_checkpoint") == true);
}

TEST_CASE("sharding: a consolidated checkpoint of world 2 resumes at world 1 without sharding") {
  const StoppedRuns runs =
      run_whole_and_stopped("full", kFourSteps + "--nproc 2 --sharding shard_grad_op --optimizer-checkpoint full ");
  const std::string &whole = runs.whole, &cut = runs.cut, &folder = runs.checkpoint;
  CHECK(std::filesystem::exists(folder + "/optimizer.pt"));
  CHECK_FALSE(std::filesystem::exists(folder + "/optimizer-rank0.pt"));

  const Run second = run_train(kFourSteps + "--nproc 1 --resume --run-dir '" + cut + "'");
  REQUIRE_MESSAGE(second.exit_code == 0, second.output);
  const nlohmann::json summary = read_summary(cut);
  CHECK(summary.at("world_size") == 1);
  CHECK(summary.at("sharding") == "no_shard");
  CHECK(summary.at("resumed_from_step") == 2);
  CHECK(summary.at("train_steps") == 4);
  CHECK(summary.at("finished") == true);
  // Another layout plans with a memory model of its own (cache or probes), not the checkpoint's.
  CHECK(summary.at("memory_model_from_checkpoint") == false);
  // Steps 3-4 at world 1 continue the world-2 run: same parameters within float tolerance (the
  // microbatches differ, so the summation order does).
  const double rel = relative_parameter_difference(load_parameters(whole + "/final_parameters.pt"),
                                                   load_parameters(cut + "/final_parameters.pt"));
  MESSAGE("relative parameter difference, world 2 throughout vs world 2 then world 1: " << rel);
  CHECK(rel <= 1e-5);
}

TEST_CASE("sharding: bad sharding settings exit 2 naming the option") {
  const Run full_shard = run_train("--sharding full_shard --max-steps 1 --run-dir '" + sharded_dir("bad1") + "'");
  CHECK(full_shard.exit_code == 2);
  CHECK_MESSAGE(full_shard.output.find("full_shard") != std::string::npos, full_shard.output);
  const Run format = run_train("--optimizer-checkpoint zip --max-steps 1 --run-dir '" + sharded_dir("bad2") + "'");
  CHECK(format.exit_code == 2);
  CHECK_MESSAGE(format.output.find("--optimizer-checkpoint") != std::string::npos, format.output);
  const Run fixed = run_train("--sharding shard_grad_op --batcher fixed --max-steps 1 --run-dir '" +
                              sharded_dir("bad3") + "'");
  CHECK(fixed.exit_code == 2);
  CHECK_MESSAGE(fixed.output.find("--sharding") != std::string::npos, fixed.output);
}

TEST_CASE("sharding: shard_grad_op at world 3 fits above the backward plateau and plans exactly") {
  // At world 3 a rank's optimizer step (1/3 of the AdamW state) peaks below the plateau small
  // microbatches reach in backward (the embedding's dense gradient); the planner takes that
  // plateau as the floor (predictive_batcher.cpp) instead of failing the fit.
  const std::string run_dir = sharded_dir("world3");
  std::filesystem::remove_all(run_dir);
  const Run run = run_train(kCommon + "--max-steps 2 --nproc 3 --sharding shard_grad_op -q --run-dir '" +
                            run_dir + "'");
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  const nlohmann::json summary = read_summary(run_dir);
  const auto state = summary.at("optimizer_state_bytes_per_rank").get<std::vector<std::int64_t>>();
  REQUIRE(state.size() == 3);
  MESSAGE("AdamW state per rank at world 3: " << state[0] << ", " << state[1] << ", " << state[2]);
  CHECK(state[0] >= state[2]);
  CHECK(state[0] - state[2] <= 2 * 8);
  CHECK(summary.at("ooms") == 0);
  CHECK(summary.at("underpredictions") == 0);
  CHECK(summary.at("max_step_prediction_rel_error").get<double>() < 0.01);
}
