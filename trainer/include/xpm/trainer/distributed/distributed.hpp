// xpm/trainer/distributed/distributed.hpp — the process group of a data-parallel job on LibTorch's c10d:
// rendezvous through a TCPStore, gloo collectives (NCCL when this LibTorch has it), and small
// helpers the trainer needs. One DistributedContext per process.
//
//   std::optional<WorkerEnvironment> env = WorkerEnvironment::from_environment();  // torchrun
//   DistributedContext dist = env ? DistributedContext(*env, options) : DistributedContext();
//   dist.broadcast_(parameters, /*root_rank=*/0);
//   torch::Tensor totals = dist.all_reduce_(local_counts, ReduceOp::kSum);
//
// Environment (same names as torchrun, https://pytorch.org/docs/stable/elastic/run.html):
// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT. Rank 0 hosts the
// TCPStore on MASTER_ADDR:MASTER_PORT; the others connect to it (multi-node: MASTER_ADDR is rank
// 0's host). Under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True, which torchrun
// sets) every rank connects to the agent's store there instead, under /worker/attempt_<k>. Gloo binds to 127.0.0.1 when MASTER_ADDR is a loopback address, to the interface
// named by GLOO_SOCKET_IFNAME when set, else to the address this host's name resolves to.
//
// Collectives: every rank must call them, in the same order, with tensors of the same shapes
// (the caller's contract; the trainer derives every call from data all ranks have). Each has a
// timeout (DistributedOptions::collective_timeout); a failure or timeout throws
// DistributedError naming this rank and, when another rank reported an error through
// report_failure() before it went away, that rank and its message.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace xpm {

/// Where this worker sits in the job, as torchrun describes it.
struct WorkerEnvironment {
  int rank = 0;              // global rank, 0..world_size-1
  int world_size = 1;        // number of worker processes in the job
  int local_rank = 0;        // rank on this host (device index under CUDA)
  int local_world_size = 1;  // workers on this host (for the default thread count)
  std::string master_addr = "127.0.0.1";  // host of rank 0's TCPStore
  int master_port = 29500;                // port of rank 0's TCPStore
  /// Which restart of the group this process belongs to: 0 for the first attempt, k after k
  /// restarts (TORCHELASTIC_RESTART_COUNT, set by torchrun and by `xpm-train --nproc`). A
  /// worker with restart_count > 0 should resume from its newest valid checkpoint.
  int restart_count = 0;
  /// The group's restart limit (TORCHELASTIC_MAX_RESTARTS); nullopt when no launcher set it.
  std::optional<int> max_restarts;

  /// Reads the variables above. Returns nullopt when neither RANK nor WORLD_SIZE is set (a
  /// plain single-process run). Throws std::invalid_argument naming the variable and its value
  /// when one is set but not a valid number, out of range (RANK >= WORLD_SIZE, port outside
  /// 1..65535), or when RANK is set without WORLD_SIZE or the reverse. LOCAL_RANK defaults to
  /// RANK, LOCAL_WORLD_SIZE to WORLD_SIZE, MASTER_ADDR to 127.0.0.1, MASTER_PORT to 29500,
  /// TORCHELASTIC_RESTART_COUNT to 0.
  static std::optional<WorkerEnvironment> from_environment();
};

/// The c10d process group's backend: kAuto is nccl on CUDA when built with it, else gloo.
enum class CollectiveBackend { kAuto, kGloo, kNccl };
/// "auto" | "gloo" | "nccl"; throws std::invalid_argument "<source> must be auto, gloo or nccl, got '<text>'".
CollectiveBackend parse_collective_backend(const std::string& text, const std::string& source);
std::string to_string(CollectiveBackend backend);

struct DistributedOptions {
  CollectiveBackend backend = CollectiveBackend::kAuto;
  std::chrono::milliseconds collective_timeout{std::chrono::minutes(5)};   // per collective
  std::chrono::milliseconds rendezvous_timeout{std::chrono::minutes(10)};  // store connect/wait
  /// Throws std::invalid_argument naming the bad field.
  void validate() const;
};

/// A collective failed or timed out, or another rank reported a failure.
class DistributedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class ReduceOp { kSum, kMax };

class DistributedContext {
 public:
  /// A single-process context: rank 0 of 1; every collective is the identity.
  DistributedContext();
  /// Joins the job: connects to (rank 0: hosts) the TCPStore, then builds the process group.
  /// Blocks until every rank has joined or rendezvous_timeout passes. Every rank must call it.
  /// Throws std::invalid_argument for a backend this LibTorch lacks (e.g. nccl without NCCL),
  /// DistributedError when the rendezvous fails.
  DistributedContext(const WorkerEnvironment& environment, const DistributedOptions& options);
  ~DistributedContext();
  DistributedContext(DistributedContext&&) noexcept;
  DistributedContext& operator=(DistributedContext&&) noexcept;

  int rank() const { return environment_.rank; }
  int world_size() const { return environment_.world_size; }
  int local_rank() const { return environment_.local_rank; }
  const WorkerEnvironment& environment() const { return environment_; }
  bool is_main() const { return environment_.rank == 0; }
  bool distributed() const { return environment_.world_size > 1; }
  std::string backend() const { return backend_; }
  /// The timeouts and backend it was built with (defaults for a single process).
  const DistributedOptions& options() const { return options_; }

  /// In-place broadcast of each tensor from root_rank. Collective.
  void broadcast_(const std::vector<torch::Tensor>& tensors, int root_rank);
  /// In-place all-reduce of one tensor; returns it. Collective.
  torch::Tensor all_reduce_(torch::Tensor tensor, ReduceOp op);
  /// Convenience: all-reduce of a vector of doubles (float64 tensor). Collective.
  std::vector<double> all_reduce(const std::vector<double>& values, ReduceOp op);
  /// Blocks until every rank arrives. Collective.
  void barrier();

  /// Rank root_rank's `text` on every rank, through the store (not a collective: no collective
  /// timeout, waits up to `wait`, e.g. while rank 0 probes). The root returns once every other
  /// rank has read the text, so it may exit right afterwards. Each call uses a fresh key, so
  /// every rank must make the same sequence of share_from calls.
  std::string share_from(int root_rank, const std::string& text, std::chrono::milliseconds wait);

  /// Records in the store that this rank failed and why, so other ranks whose collectives then
  /// fail can name it. Never throws (best effort: the store may be gone).
  void report_failure(const std::string& message) noexcept;

 private:
  [[noreturn]] void rethrow_collective_failure(const std::string& what, const std::exception& error);

  struct Connection;  // c10d store and process group (distributed.cpp)

  WorkerEnvironment environment_;
  DistributedOptions options_;
  std::string backend_ = "none";
  std::unique_ptr<Connection> connection_;  // null for a single process
  std::int64_t share_sequence_ = 0;
};

}  // namespace xpm
