// ShardedAdamW: layout and options; a simulated rank (the probe's view); and at world 2 (two
// xpm-sharding-worker processes over gloo): the same parameters as unsharded AdamW, state bytes
// halved (CpuMemoryMeter), per-rank shard files, and a consolidated state resumed at world 1.
#include "torch_doctest.hpp"
#include "scratch_folders.hpp"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trainer/distributed/sharding_fixture.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/trainer/options/lr_schedule.hpp"
#include "xpm/trainer/distributed/sharded_optimizer.hpp"
#include "xpm/trainer/options/weight_decay_groups.hpp"

namespace {

namespace fx = sharding_fixture;

constexpr double kPeakLr = 1e-2;
constexpr double kWeightDecay = 0.1;
// Clipping limit for the clipped comparison: below step 0's gradient norm (0.967), so it clips.
constexpr double kMaxGradNorm = 0.5;

// The worker's schedule (sharding_worker_main.cpp).
double worker_learning_rate(std::int64_t step) {
  xpm::LrScheduleOptions schedule;
  schedule.peak_learning_rate = kPeakLr;
  schedule.warmup_steps = 2;
  schedule.total_steps = 1000;
  return xpm::learning_rate_at(schedule, step);
}

// Unsharded reference: LibTorch's AdamW with the same groups on the whole global gradient,
// clipped by clip_grad_norm_ when max_grad_norm > 0, from `first_step` to `end_step`.
void reference_steps(xpm::TransformerTagger& model, torch::optim::AdamW& optimizer, const fx::Corpus& corpus,
                     std::int64_t first_step, std::int64_t end_step, double max_grad_norm,
                     std::vector<double>* norms = nullptr) {
  for (std::int64_t step = first_step; step < end_step; ++step) {
    optimizer.zero_grad();
    for (int rank = 0; rank < fx::kWorld; ++rank) fx::backward_rank_share(model, corpus, step, rank);
    if (max_grad_norm > 0) {
      const double norm = torch::nn::utils::clip_grad_norm_(model->parameters(), max_grad_norm);
      if (norms != nullptr) norms->push_back(norm);
    }
    for (auto& group : optimizer.param_groups()) group.options().set_lr(worker_learning_rate(step));
    optimizer.step();
  }
}

std::unique_ptr<torch::optim::AdamW> reference_optimizer(xpm::TransformerTagger& model) {
  return std::make_unique<torch::optim::AdamW>(
      xpm::adamw_param_groups(*model, torch::optim::AdamWOptions(kPeakLr).weight_decay(kWeightDecay)),
      torch::optim::AdamWOptions(kPeakLr));
}

// Largest |a - b| over a tensor, relative to the largest |b| (the tensor's scale).
double relative_difference(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

// A folder of this process under the build tree, removed when the test case passes.
std::string work_dir(const std::string& name) {
  const std::string dir = std::string(XPM_BINARY_DIR) + "/tests/sharding/" + name + "_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  xpm_test::remove_when_passed(dir);
  return dir;
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(fx::read_text(path)); }

std::vector<int> run_train(const std::string& out, const std::string& strategy, std::int64_t steps,
                           double max_grad_norm) {
  const std::vector<int> codes = fx::run_world(
      XPM_SHARDING_WORKER, {"train", out, strategy, std::to_string(steps), std::to_string(max_grad_norm)}, 2,
      out + "/train_log");
  if (codes != std::vector<int>{0, 0}) {
    MESSAGE(fx::read_text(out + "/train_log0.log") << fx::read_text(out + "/train_log1.log"));
  }
  return codes;
}

// exp_avg and exp_avg_sq of the owned segments, in group order.
torch::Tensor owned_state(xpm::ShardedAdamW& optimizer) {
  std::vector<torch::Tensor> parts;
  for (auto& group : optimizer.adamw().param_groups()) {
    for (auto& p : group.params()) {
      auto& state = static_cast<torch::optim::AdamWParamState&>(
          *optimizer.adamw().state().at(p.unsafeGetTensorImpl()));
      parts.push_back(state.exp_avg());
      parts.push_back(state.exp_avg_sq());
    }
  }
  return parts.empty() ? torch::zeros({0}) : torch::cat(parts);
}

}  // namespace

TEST_CASE("the flat vector is cut into contiguous shards of ceil(total / world) elements") {
  const xpm::ShardLayout layout(10, 3);
  CHECK(layout.shard_numel == 4);
  CHECK(layout.padded_numel() == 12);
  CHECK(layout.begin(0) == 0);
  CHECK(layout.end(0) == 4);
  CHECK(layout.begin(1) == 4);
  CHECK(layout.end(1) == 8);
  CHECK(layout.begin(2) == 8);
  CHECK(layout.end(2) == 10);  // the last rank owns less
  const xpm::ShardLayout tiny(1, 2);
  CHECK(tiny.begin(1) == 1);
  CHECK(tiny.end(1) == 1);  // a rank may own nothing
  CHECK_THROWS_AS(xpm::ShardLayout(5, 0), std::invalid_argument);
}

TEST_CASE("sharding strategies parse by FSDP's names and full_shard is refused with the reason") {
  CHECK(xpm::parse_sharding_strategy("no_shard", "--sharding") == xpm::ShardingStrategy::kNoShard);
  CHECK(xpm::to_string(xpm::parse_sharding_strategy("shard_grad_op", "--sharding")) == "shard_grad_op");
  CHECK_THROWS_WITH_AS(xpm::parse_sharding_strategy("full_shard", "--sharding"),
                       doctest::Contains("--sharding: 'full_shard' (parameters sharded too) is not supported"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::parse_sharding_strategy("full_shard", "--sharding"),
                       doctest::Contains("depend on how many microbatches each rank runs"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::parse_sharding_strategy("zero3", "--sharding"),
                       doctest::Contains("--sharding must be 'no_shard' or 'shard_grad_op', got 'zero3'"), std::invalid_argument);
  xpm::ShardedAdamWOptions options;
  options.rank = 2;
  options.world_size = 2;
  CHECK_THROWS_WITH_AS(options.validate(), doctest::Contains("rank must be in [0, world_size 2), got 2"),
                       std::invalid_argument);
  options = {};
  options.max_grad_norm = -1;
  CHECK_THROWS_WITH_AS(options.validate(), doctest::Contains("max_grad_norm"), std::invalid_argument);
}

TEST_CASE("a simulated rank holds its shard's state only and steps only its own elements") {
  const fx::Corpus corpus = fx::load_corpus();
  xpm::TransformerTagger model = fx::make_model(corpus);
  std::vector<torch::Tensor> before;
  for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
  xpm::ShardedAdamWOptions options;
  options.rank = 1;
  options.world_size = 2;
  xpm::DistributedContext single_process;
  CHECK_THROWS_WITH_AS(
      xpm::ShardedAdamW(xpm::adamw_param_groups(*model, torch::optim::AdamWOptions(1e-2)),
                        torch::optim::AdamWOptions(1e-2), options, &single_process),
      doctest::Contains("options say rank 1 of 2 but the context is rank 0 of 1"), std::invalid_argument);
  xpm::ShardedAdamW optimizer(xpm::adamw_param_groups(*model, torch::optim::AdamWOptions(1e-2)),
                              torch::optim::AdamWOptions(1e-2), options, nullptr);
  const std::int64_t total = optimizer.layout().total_numel;
  std::int64_t expected_total = 0;
  for (const auto& p : model->parameters()) expected_total += p.numel();
  CHECK(total == expected_total);
  CHECK(optimizer.owned_begin() == (total + 1) / 2);
  CHECK(optimizer.owned_end() == total);
  CHECK(optimizer.state_bytes() == 0);
  optimizer.allocate_state();
  CHECK(optimizer.state_bytes() == 2 * 4 * (total - (total + 1) / 2));

  optimizer.zero_grad();
  fx::backward_rank_share(model, corpus, 0, 0);
  optimizer.step();  // no collective: a probe's step
  // Parameters are views of the flat buffer now (same values before the step), in group order:
  // count how many elements changed; they must all be this rank's.
  std::int64_t changed = 0;
  for (std::size_t i = 0; i < before.size(); ++i) {
    changed += (model->parameters()[i].detach() != before[i]).sum().item<std::int64_t>();
  }
  CHECK(changed > 0);
  CHECK(changed <= optimizer.owned_end() - optimizer.owned_begin());
  CHECK(optimizer.steps() == 1);
  // step_local (a probe inside a running job) moves the same elements only.
  optimizer.step_local();
  changed = 0;
  for (std::size_t i = 0; i < before.size(); ++i) {
    changed += (model->parameters()[i].detach() != before[i]).sum().item<std::int64_t>();
  }
  CHECK(changed <= optimizer.owned_end() - optimizer.owned_begin());
  CHECK(optimizer.steps() == 2);
}

// Largest relative_difference over the parameters of `rank0`/`rank1` (the workers' files)
// against `expected`; both ranks must hold identical parameters.
double worst_difference(const std::string& out, const std::vector<torch::Tensor>& expected) {
  const auto rank0 = fx::load_tensors(out + "/params_rank0.pt");
  const auto rank1 = fx::load_tensors(out + "/params_rank1.pt");
  REQUIRE(rank0.size() == expected.size());
  double worst = 0;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    CHECK(torch::equal(rank0[i], rank1[i]));  // the all-gather leaves every rank identical
    worst = std::max(worst, relative_difference(rank0[i], expected[i].detach()));
  }
  return worst;
}

// Why two comparisons: AdamW divides each element's step by sqrt(v), so a one-ulp difference in
// a near-zero gradient element can change that element's update by up to the learning rate, and
// the next steps amplify it. Without clipping, the sharded step does exactly LibTorch's arithmetic
// (the same per-element operations; the ranks' gradients summed in the same order), so six steps
// agree. Clipping under sharding adds up squares in another grouping than clip_grad_norm_ (per
// shard, not per parameter), so its coefficient may differ by one float ulp: one clipped step is
// compared, and the norms of every step.
TEST_CASE("at world 2, shard_grad_op and no_shard reach unsharded AdamW's parameters within 1e-6") {
  torch::set_num_threads(1);
  const fx::Corpus corpus = fx::load_corpus();
  const std::int64_t steps = 6;
  xpm::TransformerTagger reference = fx::make_model(corpus);
  auto optimizer = reference_optimizer(reference);
  reference_steps(reference, *optimizer, corpus, 0, steps, /*max_grad_norm=*/0);
  xpm::TransformerTagger clipped_reference = fx::make_model(corpus);
  auto clipped_optimizer = reference_optimizer(clipped_reference);
  std::vector<double> norms;
  reference_steps(clipped_reference, *clipped_optimizer, corpus, 0, 1, kMaxGradNorm, &norms);
  REQUIRE(norms[0] > kMaxGradNorm);

  for (const std::string strategy : {"shard_grad_op", "no_shard"}) {
    const std::string out = work_dir("train_" + strategy);
    REQUIRE(run_train(out, strategy, steps, 0) == std::vector<int>{0, 0});
    const double worst = worst_difference(out, reference->parameters());
    MESSAGE(strategy << ": largest relative parameter difference to unsharded AdamW after " << steps
                     << " steps: " << worst);
    CHECK(worst <= 1e-6);
    // The parameters moved: the comparison is not between two untrained models.
    CHECK(relative_difference(fx::make_model(corpus)->parameters()[0].detach(),
                              reference->parameters()[0].detach()) > 1e-3);
    CHECK(read_json(out + "/rank1.json")["regrafted_gradients"] == 0);

    const std::string clipped_out = work_dir("clipped_" + strategy);
    REQUIRE(run_train(clipped_out, strategy, 1, kMaxGradNorm) == std::vector<int>{0, 0});
    const double clipped_worst = worst_difference(clipped_out, clipped_reference->parameters());
    MESSAGE(strategy << ": one step clipped by the global norm (" << norms[0] << " -> " << kMaxGradNorm
                     << "): largest relative parameter difference " << clipped_worst);
    CHECK(clipped_worst <= 1e-6);
    CHECK(read_json(clipped_out + "/rank0.json")["gradient_norms"][0].get<double>() ==
          doctest::Approx(norms[0]).epsilon(1e-6));
  }
}

TEST_CASE("at world 2, each rank's AdamW state is half of one process's, measured with the meter") {
  const std::string out = work_dir("state_bytes");
  const std::vector<int> codes = fx::run_world(XPM_SHARDING_WORKER, {"state_bytes", out}, 2, out + "/log");
  INFO(fx::read_text(out + "/log0.log") << fx::read_text(out + "/log1.log"));
  REQUIRE(codes == std::vector<int>{0, 0});

  // World 1, this process: the same model and groups, LibTorch's AdamW and ShardedAdamW.
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  const fx::Corpus corpus = fx::load_corpus();
  xpm::TransformerTaggerOptions model_options;
  model_options.num_tags = corpus.num_tags;
  torch::manual_seed(1);
  xpm::TransformerTagger model(model_options);
  std::int64_t world1_bytes = 0;
  {
    auto groups = xpm::adamw_param_groups(*model, torch::optim::AdamWOptions(0.0).weight_decay(0.01));
    torch::optim::AdamW plain(groups, torch::optim::AdamWOptions(0.0));
    for (const auto& p : model->parameters()) p.mutable_grad() = torch::zeros_like(p);
    const std::int64_t before = meter.current_allocated_bytes();
    plain.step();  // allocates the state (lr 0)
    world1_bytes = meter.current_allocated_bytes() - before;
  }
  xpm::ShardedAdamW world1(xpm::adamw_param_groups(*model, torch::optim::AdamWOptions(1e-3)),
                           torch::optim::AdamWOptions(1e-3), xpm::ShardedAdamWOptions{}, nullptr);
  const std::int64_t before = meter.current_allocated_bytes();
  world1.allocate_state();
  const std::int64_t sharded_world1_bytes = meter.current_allocated_bytes() - before;
  const std::int64_t total = world1.layout().total_numel;
  CHECK(world1_bytes == 8 * total);  // exp_avg and exp_avg_sq, float32
  CHECK(sharded_world1_bytes == world1_bytes);

  std::int64_t sum = 0;
  for (int rank = 0; rank < 2; ++rank) {
    const nlohmann::json report = read_json(out + "/state_bytes_rank" + std::to_string(rank) + ".json");
    const std::int64_t measured = report["measured_state_bytes"];
    CHECK(report["total_numel"] == total);
    CHECK(measured == report["state_bytes"].get<std::int64_t>());
    CHECK(measured == 8 * report["owned_numel"].get<std::int64_t>());
    CHECK(measured <= world1_bytes / 2 + 8);  // half, up to one padding element
    sum += measured;
    MESSAGE("rank " << rank << " of 2: AdamW state " << measured << " bytes (world 1: " << world1_bytes
                    << " bytes, " << total << " parameters)");
  }
  CHECK(sum == world1_bytes);
}

TEST_CASE("a consolidated state written at world 2 resumes at world 1 like an uninterrupted run") {
  torch::set_num_threads(1);
  const fx::Corpus corpus = fx::load_corpus();
  const std::int64_t first = 4;
  const std::int64_t more = 3;
  const std::string out = work_dir("resume");
  REQUIRE(run_train(out, "shard_grad_op", first, 0) == std::vector<int>{0, 0});

  xpm::TransformerTagger uninterrupted = fx::make_model(corpus);
  auto uninterrupted_optimizer = reference_optimizer(uninterrupted);
  reference_steps(uninterrupted, *uninterrupted_optimizer, corpus, 0, first + more, 0);

  // World 1: the parameters rank 0 saved, LibTorch's AdamW loading the consolidated file.
  xpm::TransformerTagger resumed = fx::make_model(corpus);
  {
    torch::NoGradGuard no_grad;
    const auto saved = fx::load_tensors(out + "/params_rank0.pt");
    for (std::size_t i = 0; i < saved.size(); ++i) resumed->parameters()[i].copy_(saved[i]);
  }
  auto resumed_optimizer = reference_optimizer(resumed);
  torch::load(*resumed_optimizer, out + "/full.pt");
  REQUIRE(resumed_optimizer->state().size() == resumed->parameters().size());
  reference_steps(resumed, *resumed_optimizer, corpus, first, first + more, 0);
  double worst = 0;
  for (std::size_t i = 0; i < resumed->parameters().size(); ++i) {
    worst = std::max(worst, relative_difference(resumed->parameters()[i].detach(),
                                                uninterrupted->parameters()[i].detach()));
  }
  MESSAGE("world 2 -> consolidated -> world 1: largest relative parameter difference after " << first + more
                                                                                               << " steps: " << worst);
  CHECK(worst <= 1e-6);

  // Each shard file reloads into its rank's layout (simulated here) and equals the consolidated
  // state's slice; a shard refuses another world size; the full state loads at world 3.
  for (int rank = 0; rank < 2; ++rank) {
    xpm::TransformerTagger model = fx::make_model(corpus);
    const auto groups = xpm::adamw_param_groups(*model, torch::optim::AdamWOptions(kPeakLr).weight_decay(kWeightDecay));
    xpm::ShardedAdamWOptions options;
    options.rank = rank;
    options.world_size = 2;
    xpm::ShardedAdamW from_shard(groups, torch::optim::AdamWOptions(kPeakLr), options, nullptr);
    from_shard.load_shard(out + "/shard_rank" + std::to_string(rank) + ".pt");
    CHECK(from_shard.steps() == first);
    xpm::ShardedAdamW from_full(groups, torch::optim::AdamWOptions(kPeakLr), options, nullptr);
    from_full.load_full_state(out + "/full.pt");
    CHECK(from_full.steps() == first);
    CHECK(torch::equal(owned_state(from_shard), owned_state(from_full)));
    CHECK(owned_state(from_shard).abs().sum().item<double>() > 0);
  }
  xpm::TransformerTagger model = fx::make_model(corpus);
  const auto groups = xpm::adamw_param_groups(*model, torch::optim::AdamWOptions(kPeakLr).weight_decay(kWeightDecay));
  xpm::ShardedAdamW single(groups, torch::optim::AdamWOptions(kPeakLr), xpm::ShardedAdamWOptions{}, nullptr);
  CHECK_THROWS_WITH_AS(single.load_shard(out + "/shard_rank0.pt"),
                       doctest::Contains("was written by rank 0 of world size 2 (shard_grad_op), this is rank 0 of "
                                         "world size 1"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(single.load_shard(out + "/shard_rank0.pt"),
                       doctest::Contains("resume from a full state"), std::invalid_argument);
  xpm::ShardedAdamWOptions three;
  three.rank = 2;
  three.world_size = 3;
  xpm::ShardedAdamW third(groups, torch::optim::AdamWOptions(kPeakLr), three, nullptr);
  third.load_full_state(out + "/full.pt");
  CHECK(third.steps() == first);
  CHECK(third.state_bytes() == 8 * (third.owned_end() - third.owned_begin()));
}
