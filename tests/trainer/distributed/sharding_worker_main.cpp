// xpm-sharding-worker SCENARIO OUT_DIR [ARGS...]: one rank of a world started by
// sharding_fixture::run_world (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), for
// sharded_optimizer_test.cpp and gradient_clipping_test.cpp. Scenarios:
//   clip OUT MAX_NORM NORM_TYPE    step 0's gradient summed over the ranks; this rank clips its
//                                  two shards with clip_gradient_norm_; writes
//                                  OUT/clip_rank<r>.pt = [norm, shard a, shard b]
//   train OUT STRATEGY STEPS MAX_GRAD_NORM
//                                  STEPS steps of ShardedAdamW (weight-decay groups, linear
//                                  schedule) on the fixture's real batches; writes parameters
//                                  (OUT/params_rank<r>.pt), the shard (OUT/shard_rank<r>.pt),
//                                  the full state (OUT/full.pt, rank 0) and OUT/rank<r>.json
//   state_bytes OUT                the job's default Transformer (d_model 128, vocabulary 20000):
//                                  AdamW state bytes this rank allocates, measured with the
//                                  CpuMemoryMeter, in OUT/state_bytes_rank<r>.json
// Exit code 0 on success, 2 for bad arguments or environment, 1 for another error, with the
// error on stderr.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "trainer/distributed/sharding_fixture.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/trainer/distributed/distributed.hpp"
#include "xpm/trainer/options/gradient_clipping.hpp"
#include "xpm/trainer/options/lr_schedule.hpp"
#include "xpm/trainer/distributed/sharded_optimizer.hpp"
#include "xpm/trainer/options/weight_decay_groups.hpp"

namespace {

namespace fx = sharding_fixture;

void write_json(const nlohmann::json& value, const std::string& path) {
  std::ofstream out(path);
  out << value.dump(2) << "\n";
}

int clip(xpm::DistributedContext& dist, const std::string& out, double max_norm, double norm_type) {
  const fx::Corpus corpus = fx::load_corpus();
  xpm::TransformerTagger model = fx::make_model(corpus);
  fx::backward_rank_share(model, corpus, 0, dist.rank());
  std::vector<torch::Tensor> grads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad().reshape({-1}));
  torch::Tensor full = dist.all_reduce_(torch::cat(grads), xpm::ReduceOp::kSum);
  const xpm::ShardLayout layout(full.numel(), dist.world_size());
  const std::int64_t begin = layout.begin(dist.rank());
  const std::int64_t middle = begin + (layout.end(dist.rank()) - begin) / 2;
  std::vector<torch::Tensor> shards = {full.narrow(0, begin, middle - begin),
                                       full.narrow(0, middle, layout.end(dist.rank()) - middle)};
  const double norm = xpm::clip_gradient_norm_(shards, max_norm, dist, norm_type);
  fx::save_tensors({torch::tensor({norm}, torch::kFloat64), shards[0].clone(), shards[1].clone()},
                   out + "/clip_rank" + std::to_string(dist.rank()) + ".pt");
  return 0;
}

int train(xpm::DistributedContext& dist, const std::string& out, const std::string& strategy,
          std::int64_t steps, double max_grad_norm) {
  const fx::Corpus corpus = fx::load_corpus();
  xpm::TransformerTagger model = fx::make_model(corpus);
  const auto groups = xpm::adamw_param_groups(*model, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  xpm::ShardedAdamWOptions options;
  options.strategy = xpm::parse_sharding_strategy(strategy, "worker");
  options.rank = dist.rank();
  options.world_size = dist.world_size();
  options.max_grad_norm = max_grad_norm;
  xpm::ShardedAdamW optimizer(groups, torch::optim::AdamWOptions(1e-2), options, &dist);
  xpm::LrScheduleOptions schedule;
  schedule.peak_learning_rate = 1e-2;
  schedule.warmup_steps = 2;
  schedule.total_steps = 1000;  // as the tests' reference (sharded_optimizer_test.cpp)
  nlohmann::json report;
  report["gradient_norms"] = nlohmann::json::array();
  for (std::int64_t step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    fx::backward_rank_share(model, corpus, step, dist.rank());
    optimizer.set_learning_rate(xpm::learning_rate_at(schedule, step));
    const xpm::ShardedStepResult result = optimizer.step();
    report["gradient_norms"].push_back(result.gradient_norm);
  }
  const std::string rank = std::to_string(dist.rank());
  fx::save_tensors(model->parameters(), out + "/params_rank" + rank + ".pt");
  optimizer.save_shard(out + "/shard_rank" + rank + ".pt");
  optimizer.save_full_state(out + "/full.pt");  // collective; rank 0 writes
  report["state_bytes"] = optimizer.state_bytes();
  report["owned_begin"] = optimizer.owned_begin();
  report["owned_end"] = optimizer.owned_end();
  report["regrafted_gradients"] = optimizer.regrafted_gradients();
  write_json(report, out + "/rank" + rank + ".json");
  return 0;
}

int state_bytes(xpm::DistributedContext& dist, const std::string& out) {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  const fx::Corpus corpus = fx::load_corpus();
  xpm::TransformerTaggerOptions model_options;  // the job's defaults
  model_options.num_tags = corpus.num_tags;
  torch::manual_seed(1);
  xpm::TransformerTagger model(model_options);
  xpm::ShardedAdamWOptions options;
  options.rank = dist.rank();
  options.world_size = dist.world_size();
  xpm::ShardedAdamW optimizer(xpm::adamw_param_groups(*model, torch::optim::AdamWOptions(1e-3).weight_decay(0.01)),
                              torch::optim::AdamWOptions(1e-3), options, &dist);
  const std::int64_t before = meter.current_allocated_bytes();
  optimizer.allocate_state();
  const std::int64_t after = meter.current_allocated_bytes();
  write_json({{"measured_state_bytes", after - before},
              {"state_bytes", optimizer.state_bytes()},
              {"owned_numel", optimizer.owned_end() - optimizer.owned_begin()},
              {"total_numel", optimizer.layout().total_numel}},
             out + "/state_bytes_rank" + std::to_string(dist.rank()) + ".json");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 3) throw std::invalid_argument("usage: xpm-sharding-worker SCENARIO OUT_DIR [ARGS...]");
    const std::string scenario = argv[1];
    const int arguments = scenario == "clip" ? 5 : scenario == "train" ? 6 : scenario == "state_bytes" ? 3 : -1;
    if (arguments > 0 && argc > arguments) {
      throw std::invalid_argument("unexpected argument '" + std::string(argv[arguments]) + "' (scenario '" +
                                  scenario + "' takes " + std::to_string(arguments - 3) + " after OUT_DIR)");
    }
    if (arguments != argc) {
      throw std::invalid_argument("scenario '" + scenario + "' with " + std::to_string(argc - 3) +
                                  " argument(s) after OUT_DIR is not one of those at the top of "
                                  "tests/trainer/distributed/sharding_worker_main.cpp");
    }
    torch::set_num_threads(1);  // bit-identical gradients in every process
    const auto env = xpm::WorkerEnvironment::from_environment();
    if (!env) throw std::invalid_argument("RANK and WORLD_SIZE must be set");
    xpm::DistributedOptions dist_options;
    dist_options.collective_timeout = std::chrono::seconds(120);
    dist_options.rendezvous_timeout = std::chrono::seconds(120);
    xpm::DistributedContext dist(*env, dist_options);
    const std::string out = argv[2];
    if (scenario == "clip") return clip(dist, out, std::stod(argv[3]), std::stod(argv[4]));
    if (scenario == "train") return train(dist, out, argv[3], std::stoll(argv[4]), std::stod(argv[5]));
    return state_bytes(dist, out);
  } catch (const std::invalid_argument& error) {
    std::fprintf(stderr, "xpm-sharding-worker: error: %s\n", error.what());
    return 2;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "xpm-sharding-worker: error: %s\n", error.what());
    return 1;
  }
}
