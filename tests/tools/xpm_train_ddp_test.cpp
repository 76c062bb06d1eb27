// Data-parallel training on c10d/gloo over loopback, run as users run it: `xpm-train --nproc N`
// processes on the real corpus. Checks: world 2 reaches the same parameters as world 1 on the
// same global batches while the ranks run different numbers of microbatches; a probe failure
// on rank 0 stops every rank with the same message; a rank that dies stops the others within
// the collective timeout, and the failure names the rank.
#include "torch_doctest.hpp"
#include "tools/xpm_train_runs.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

using namespace xpm_train_runs;

TEST_CASE("DDP: world 2 gives the same parameters as world 1 with different microbatch counts per rank") {
  const std::string one = scratch("world1"), two = scratch("world2");
  const Run single = run_train(kCommon + "--max-steps 4 --nproc 1 --run-dir '" + one + "'");
  REQUIRE_MESSAGE(single.exit_code == 0, single.output);
  const Run pair = run_train(kCommon + "--max-steps 4 --nproc 2 --run-dir '" + two + "'");
  REQUIRE_MESSAGE(pair.exit_code == 0, pair.output);

  const auto p1 = load_parameters(one + "/final_parameters.pt");
  const auto p2 = load_parameters(two + "/final_parameters.pt");
  REQUIRE(p1.size() == p2.size());
  REQUIRE(!p1.empty());
  double diff2 = 0, norm2 = 0;
  for (const auto& [name, tensor] : p1) {
    REQUIRE(p2.count(name) == 1);
    const double d = (tensor - p2.at(name)).pow(2).sum().item<double>();
    const double n = tensor.pow(2).sum().item<double>();
    if (d > 1e-10 * n) MESSAGE(name << ": relative difference " << std::sqrt(d / n));
    diff2 += d;
    norm2 += n;
  }
  const double rel = std::sqrt(diff2 / norm2);
  MESSAGE("relative parameter difference world 2 vs world 1 after 4 steps: " << rel);
  CHECK(rel <= 1e-5);
  // The run actually split the work: both ranks got records, and their microbatch counts
  // differed in at least one step (no desync although the ranks did different work).
  bool counts_differ = false;
  for (const nlohmann::json& line : read_step_metrics(two)) {
    const auto per_rank = line.at("microbatches_per_rank").get<std::vector<std::int64_t>>();
    const auto records = line.at("records_per_rank").get<std::vector<std::int64_t>>();
    REQUIRE(per_rank.size() == 2);
    CHECK(records[0] + records[1] == line.at("records").get<std::int64_t>());
    CHECK(records[0] > 0);
    CHECK(records[1] > 0);
    counts_differ = counts_differ || per_rank[0] != per_rank[1];
    CHECK(line.at("rank_imbalance").get<double>() >= 1.0);
  }
  CHECK(counts_differ);
  std::ifstream summary_file(two + "/summary.json");
  const nlohmann::json summary = nlohmann::json::parse(summary_file);
  CHECK(summary.at("world_size") == 2);
  CHECK(summary.at("ooms") == 0);
  CHECK(summary.at("train_steps") == 4);
}

TEST_CASE("DDP: a probe failure on rank 0 stops every rank with the same message") {
  // Every probe has l = 16: the formula's a and b cannot be separated (IdentifiabilityError).
  const Run run = run_train("--max-steps 2 --threads 1 --memory-cap-factor 2.0 --memory-model-cache '' "
                            "--probe-points 1x16,2x16,4x16 --nproc 2 --run-dir '" + scratch("probe_fail") + "'");
  INFO(run.output);
  CHECK(run.exit_code == 2);
  CHECK(run.wall_s < 120);
  CHECK(run.output.find("rank 0: error: ") != std::string::npos);
  CHECK(run.output.find("rank 1: error: ") != std::string::npos);
  // The same message on both ranks.
  const auto message_of = [&](const std::string& prefix) {
    const std::size_t at = run.output.find(prefix);
    const std::size_t end = run.output.find('\n', at);
    return run.output.substr(at + prefix.size(), end - at - prefix.size());
  };
  CHECK(message_of("rank 0: error: ") == message_of("rank 1: error: "));
  CHECK(message_of("rank 0: error: ").find("cannot be separated") != std::string::npos);
}

TEST_CASE("DDP: a rank killed mid-training makes the other fail within the collective timeout, naming it") {
  const Run run = run_train(kCommon + "--max-steps 6 --nproc 2 --collective-timeout-s 30 --run-dir '" +
                                scratch("rank_dies") + "'",
                            "XPM_FAULT_EXIT_AT=1:3:kill");
  INFO(run.output);
  CHECK(run.exit_code != 0);
  CHECK(run.wall_s < 90);
  CHECK(run.output.find("xpm-train: rank 1 was killed by signal 9") != std::string::npos);
  CHECK(run.output.find("xpm-train: rank 0: error: all-reduce (sum) failed: ") != std::string::npos);
  CHECK(run.output.find("rank 1 (the only other rank) reported no error") != std::string::npos);
}

TEST_CASE("DDP: bad distributed settings are rejected with exit code 2") {
  CHECK(run_train("--nproc 0").exit_code == 2);
  CHECK(run_train("--backend mpi").exit_code == 2);
  const Run nccl = run_train("--backend nccl --max-steps 1 --nproc 1 --run-dir '" + scratch("nccl") + "'");
  CHECK(nccl.exit_code == 2);
  CHECK(nccl.output.find("NCCL") != std::string::npos);
  const Run bad_env = run_train("--max-steps 1", "RANK=3 WORLD_SIZE=2");
  CHECK(bad_env.exit_code == 2);
  CHECK(bad_env.output.find("RANK='3'") != std::string::npos);
}

namespace {
// A TCP port free on 127.0.0.1 right now.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  ::close(fd);
  return ntohs(address.sin_port);
}
}  // namespace

TEST_CASE("DDP: workers started by hand with torchrun's variables form one job") {
  const std::string run_dir = scratch("torchrun_style");
  std::filesystem::remove_all(run_dir);
  const std::string env = "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                          std::to_string(free_port());
  const std::string args = " '" + kTrain + "' --data-dir '" + kData + "' " + kCommon +
                           "--max-steps 2 --run-dir '" + run_dir + "'";
  const std::string log0 = scratch("torchrun_rank0.log"), log1 = scratch("torchrun_rank1.log");
  const std::string command = env + " RANK=0 LOCAL_RANK=0" + args + " > '" + log0 + "' 2>&1 & p=$!; " +
                              env + " RANK=1 LOCAL_RANK=1" + args + " > '" + log1 + "' 2>&1; r1=$?; " +
                              "wait $p; r0=$?; exit $((r0 * 16 + r1))";
  const int status = std::system(command.c_str());
  std::ifstream in0(log0), in1(log1);
  std::stringstream out0, out1;
  out0 << in0.rdbuf();
  out1 << in1.rdbuf();
  INFO("rank 0: " << out0.str() << "\nrank 1: " << out1.str());
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  // Rank 0 logs and writes the run folder; rank 1 is silent.
  CHECK(out0.str().find("world size 2, backend gloo") != std::string::npos);
  CHECK(out1.str().empty());
  std::ifstream summary_file(run_dir + "/summary.json");
  const nlohmann::json summary = nlohmann::json::parse(summary_file);
  CHECK(summary.at("world_size") == 2);
  CHECK(summary.at("microbatches_per_rank").size() == 2);
}

TEST_CASE("DDP: world 3 splits every global batch among three ranks") {
  const std::string run_dir = scratch("world3");
  const Run run = run_train(kCommon + "--max-steps 2 --nproc 3 --run-dir '" + run_dir + "' -q");
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  for (const nlohmann::json& line : read_step_metrics(run_dir)) {
    const auto records = line.at("records_per_rank").get<std::vector<std::int64_t>>();
    REQUIRE(records.size() == 3);
    CHECK(records[0] + records[1] + records[2] == line.at("records").get<std::int64_t>());
    for (std::int64_t count : records) CHECK(count > 0);
    CHECK(line.at("oom") == false);
  }
}

TEST_CASE("DDP: from the third step no microbatch is under-predicted by 1 % nor over-predicted by 3 %") {
  // kCommon's cap splits each rank's share into microbatches of different shapes; every rank's
  // microbatch peaks are all-reduced, so each step line lists both ranks' microbatches.
  const std::string run_dir = scratch("microbatch_errors");
  const Run run = run_train(kCommon + "--max-steps 8 --outer-batch-size 256 --nproc 2 --run-dir '" + run_dir + "' -q");
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  double worst_under = 1, worst_over = -1;  // the first microbatch sets both
  std::size_t checked = 0;
  for (const nlohmann::json& line : read_step_metrics(run_dir)) {
    CHECK(line.at("oom") == false);
    if (line.at("step").get<std::int64_t>() < 3) continue;
    for (double error : line.at("microbatch_planned_rel_errors").get<std::vector<double>>()) {
      worst_under = std::min(worst_under, error);
      worst_over = std::max(worst_over, error);
      ++checked;
    }
  }
  MESSAGE("microbatches from step 3: " << checked << ", (planned - measured) / measured from "
                                       << 100 * worst_under << " % to " << 100 * worst_over << " %");
  CHECK(checked >= 12);
  CHECK(worst_under >= -0.01);
  CHECK(worst_over <= 0.03);
}

TEST_CASE("DDP: --packer fastest plans with the probes' time model on both ranks, 0 OOM") {
  const std::string run_dir = scratch("fastest");
  const Run run = run_train(kCommon + "--max-steps 4 --outer-batch-size 256 --packer fastest --nproc 2 --run-dir '" +
                            run_dir + "' -q");
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  std::ifstream model_file(run_dir + "/memory_model.json");
  const nlohmann::json model = nlohmann::json::parse(model_file);
  REQUIRE(model.at("metadata").contains("time_model"));
  CHECK(model["metadata"]["time_model"].at("seconds_per_byte").get<double>() > 0);
  for (const nlohmann::json& line : read_step_metrics(run_dir)) {
    CHECK(line.at("oom") == false);
    for (double error : line.at("microbatch_planned_rel_errors").get<std::vector<double>>()) CHECK(error >= -0.01);
  }
}
