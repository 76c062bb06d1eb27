#include "xpm/trainer/distributed/distributed.hpp"

#include <cerrno>
#include <cstdlib>
#include <functional>
#include <future>
#include <limits>
#include <sstream>
#include <thread>
#include <utility>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include "xpm/planner/enum_names.hpp"
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace xpm {

struct DistributedContext::Connection {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> process_group;  // gloo or NCCL: c10d's collectives
  bool store_unreachable = false;  // a bounded lookup timed out: do not wait for it again
};

namespace {

std::optional<std::string> env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

int env_int(const char* name, const std::string& text, long min, long max) {
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || end == nullptr || *end != '\0' || errno != 0 || value < min || value > max) {
    throw std::invalid_argument("environment variable " + std::string(name) + "='" + text +
                                "' must be a whole number in [" + std::to_string(min) + ", " +
                                std::to_string(max) + "]");
  }
  return static_cast<int>(value);
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

std::string first_line(const std::string& text) {
  const std::size_t newline = text.find('\n');
  return newline == std::string::npos ? text : text.substr(0, newline);
}

std::string store_get(c10d::Store& store, const std::string& key) {
  const std::vector<std::uint8_t> bytes = store.get(key);
  return std::string(bytes.begin(), bytes.end());
}

void store_set(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<std::uint8_t>(value.begin(), value.end()));
}

// How long a rank that is failing anyway waits for the store (to read or leave a failure
// message) before it gives up on it.
constexpr std::chrono::milliseconds kStoreLookupBound{3000};

// Runs `call` on a thread of its own and waits at most `bound` for it. Returns nullopt when the
// call did not finish in time or threw; the thread then ends on its own (at the store's
// timeout), holding what `call` captured.
template <typename Result>
std::optional<Result> within(std::chrono::milliseconds bound, std::function<Result()> call) {
  auto task = std::make_shared<std::packaged_task<Result()>>(std::move(call));
  std::future<Result> result = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (result.wait_for(bound) != std::future_status::ready) return std::nullopt;
  try {
    return result.get();
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

DistributedError rendezvous_failure(const WorkerEnvironment& environment, const std::string& why) {
  return DistributedError("rank " + std::to_string(environment.rank) + ": rendezvous at " +
                          environment.master_addr + ":" + std::to_string(environment.master_port) +
                          " failed: " + why);
}

}  // namespace

std::optional<WorkerEnvironment> WorkerEnvironment::from_environment() {
  const auto rank_text = env("RANK");
  const auto world_text = env("WORLD_SIZE");
  if (!rank_text && !world_text) return std::nullopt;
  if (!rank_text || !world_text) {
    throw std::invalid_argument(std::string("environment variable ") + (rank_text ? "RANK" : "WORLD_SIZE") +
                                " is set but " + (rank_text ? "WORLD_SIZE" : "RANK") +
                                " is not; a distributed worker needs both (torchrun sets them)");
  }
  WorkerEnvironment out;
  out.world_size = env_int("WORLD_SIZE", *world_text, 1, 1 << 20);
  out.rank = env_int("RANK", *rank_text, 0, out.world_size - 1);
  out.local_rank = env("LOCAL_RANK") ? env_int("LOCAL_RANK", *env("LOCAL_RANK"), 0, out.world_size - 1)
                                     : out.rank;
  out.local_world_size = env("LOCAL_WORLD_SIZE")
                             ? env_int("LOCAL_WORLD_SIZE", *env("LOCAL_WORLD_SIZE"), 1, out.world_size)
                             : out.world_size;
  if (out.local_rank >= out.local_world_size) {
    throw std::invalid_argument("environment variable LOCAL_RANK=" + std::to_string(out.local_rank) +
                                " must be < LOCAL_WORLD_SIZE=" + std::to_string(out.local_world_size));
  }
  if (auto addr = env("MASTER_ADDR")) {
    if (addr->empty()) throw std::invalid_argument("environment variable MASTER_ADDR is empty");
    out.master_addr = *addr;
  }
  if (auto port = env("MASTER_PORT")) out.master_port = env_int("MASTER_PORT", *port, 1, 65535);
  if (auto count = env("TORCHELASTIC_RESTART_COUNT")) {
    out.restart_count = env_int("TORCHELASTIC_RESTART_COUNT", *count, 0, 1 << 20);
  }
  if (auto limit = env("TORCHELASTIC_MAX_RESTARTS")) {
    out.max_restarts = env_int("TORCHELASTIC_MAX_RESTARTS", *limit, 0, 1 << 20);
  }
  return out;
}

namespace {
constexpr EnumNames<CollectiveBackend, 3> kBackendNames{
    {{CollectiveBackend::kAuto, "auto"}, {CollectiveBackend::kGloo, "gloo"}, {CollectiveBackend::kNccl, "nccl"}}};
}  // namespace

CollectiveBackend parse_collective_backend(const std::string& text, const std::string& source) {
  return parse_enum(kBackendNames, text, source);
}

std::string to_string(CollectiveBackend backend) { return enum_name(kBackendNames, backend); }

void DistributedOptions::validate() const {
#ifndef USE_C10D_NCCL
  if (backend == CollectiveBackend::kNccl) {
    throw std::invalid_argument("--backend nccl: this LibTorch was built without NCCL "
                                "(Debian's CPU build); use gloo or a CUDA LibTorch");
  }
#endif
  if (collective_timeout.count() <= 0 || rendezvous_timeout.count() <= 0) {
    throw std::invalid_argument("DistributedOptions: timeouts must be > 0 ms");
  }
}

DistributedContext::DistributedContext() = default;
DistributedContext::~DistributedContext() = default;
DistributedContext::DistributedContext(DistributedContext&&) noexcept = default;
DistributedContext& DistributedContext::operator=(DistributedContext&&) noexcept = default;

DistributedContext::DistributedContext(const WorkerEnvironment& environment,
                                       const DistributedOptions& options)
    : environment_(environment), options_(options) {
  options_.validate();
  std::string backend = to_string(options_.backend);
  if (backend == "auto") backend = "gloo";  // CPU tensors; CUDA runs choose nccl (docs/cuda.md)
  backend_ = backend;
  if (environment_.world_size == 1) return;  // nothing to connect to
  connection_ = std::make_unique<Connection>();
  try {
    // Under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True) the agent already hosts
    // the store at MASTER_ADDR:MASTER_PORT: every rank is a client, and the keys of each attempt
    // live under /worker/attempt_<k>, as PyTorch's own rendezvous does.
    const std::optional<std::string> agent_store = env("TORCHELASTIC_USE_AGENT_STORE");
    const bool use_agent_store =
        agent_store && (*agent_store == "True" || *agent_store == "true" || *agent_store == "1");
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<std::uint16_t>(environment_.master_port);
    store_options.isServer = environment_.rank == 0 && !use_agent_store;
    store_options.numWorkers = static_cast<std::size_t>(environment_.world_size);
    store_options.waitWorkers = !use_agent_store;
    store_options.timeout = options_.rendezvous_timeout;
    c10::intrusive_ptr<c10d::Store> tcp_store =
        c10::make_intrusive<c10d::TCPStore>(environment_.master_addr, store_options);
    if (use_agent_store) {
      tcp_store = c10::make_intrusive<c10d::PrefixStore>(
          "/worker/attempt_" + std::to_string(environment_.restart_count), tcp_store);
    }
    connection_->store = c10::make_intrusive<c10d::PrefixStore>("xpm", tcp_store);
    if (backend_ == "gloo") {
      auto gloo_options = c10d::ProcessGroupGloo::Options::create(options_.collective_timeout);
      if (is_loopback(environment_.master_addr)) {
        gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      } else if (auto interface = env("GLOO_SOCKET_IFNAME")) {
        gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(*interface));
      } else {
        gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      gloo_options->threads = 2;
      connection_->process_group = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<c10d::PrefixStore>("gloo", connection_->store), environment_.rank,
          environment_.world_size, gloo_options);
    }
#ifdef USE_C10D_NCCL
    else {
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = options_.collective_timeout;
      connection_->process_group = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>("nccl", connection_->store), environment_.rank,
          environment_.world_size, nccl_options);
    }
#endif
  } catch (const c10::Error& error) {
    throw rendezvous_failure(environment_, first_line(error.what_without_backtrace()));
  } catch (const std::exception& error) {  // socket errors may come as std::runtime_error
    throw rendezvous_failure(environment_, first_line(error.what()));
  }
}

void DistributedContext::rethrow_collective_failure(const std::string& what,
                                                    const std::exception& error) {
  std::string message = "rank " + std::to_string(rank()) + ": " + what + " failed: " +
                        first_line(error.what());
  // Did another rank say why? The store lives in rank 0's process; across a cut link each store
  // call blocks until the store's own timeout (the rendezvous timeout), so the lookup is bounded.
  const c10::intrusive_ptr<c10d::Store> store = connection_->store;
  const int self = rank(), world = world_size();
  const std::optional<std::string> reported = within<std::string>(kStoreLookupBound, [store, self, world] {
    for (int other = 0; other < world; ++other) {
      const std::string key = "failure/" + std::to_string(other);
      if (other != self && store->check({key})) {
        return "; rank " + std::to_string(other) + " reported: " + store_get(*store, key);
      }
    }
    return std::string();
  });
  if (!reported) {
    connection_->store_unreachable = true;
    message += "; the store on rank 0 is unreachable, so rank 0 probably exited, was killed or became unreachable";
  } else if (!reported->empty()) {
    message += *reported;
  } else {
    message += world == 2 ? "; rank " + std::to_string(1 - self) + " (the only other rank) reported no error, "
                            "so it probably exited, was killed or became unreachable"
                          : "; no rank reported an error, so a rank probably exited, was killed or became unreachable";
  }
  throw DistributedError(message);
}

void DistributedContext::broadcast_(const std::vector<torch::Tensor>& tensors, int root_rank) {
  if (!distributed()) return;
  for (const torch::Tensor& tensor : tensors) {
    std::vector<at::Tensor> list = {tensor};
    c10d::BroadcastOptions broadcast_options;
    broadcast_options.rootRank = root_rank;
    broadcast_options.timeout = options_.collective_timeout;
    try {
      connection_->process_group->broadcast(list, broadcast_options)->wait();
    } catch (const std::exception& error) {
      rethrow_collective_failure("broadcast from rank " + std::to_string(root_rank), error);
    }
  }
}

torch::Tensor DistributedContext::all_reduce_(torch::Tensor tensor, ReduceOp op) {
  if (!distributed()) return tensor;
  std::vector<at::Tensor> list = {tensor};
  c10d::AllreduceOptions reduce_options;
  reduce_options.reduceOp = op == ReduceOp::kSum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
  reduce_options.timeout = options_.collective_timeout;
  try {
    connection_->process_group->allreduce(list, reduce_options)->wait();
  } catch (const std::exception& error) {
    rethrow_collective_failure(op == ReduceOp::kSum ? "all-reduce (sum)" : "all-reduce (max)", error);
  }
  return tensor;
}

std::vector<double> DistributedContext::all_reduce(const std::vector<double>& values, ReduceOp op) {
  if (!distributed() || values.empty()) return values;
  torch::Tensor tensor = torch::tensor(values, torch::kFloat64);
  all_reduce_(tensor, op);
  const double* data = tensor.data_ptr<double>();
  return std::vector<double>(data, data + values.size());
}

void DistributedContext::barrier() {
  if (!distributed()) return;
  try {
    c10d::BarrierOptions barrier_options;
    barrier_options.timeout = options_.collective_timeout;
    connection_->process_group->barrier(barrier_options)->wait();
  } catch (const std::exception& error) {
    rethrow_collective_failure("barrier", error);
  }
}

std::string DistributedContext::share_from(int root_rank, const std::string& text,
                                           std::chrono::milliseconds wait) {
  if (!distributed()) return text;
  const std::string key = "share/" + std::to_string(share_sequence_++);
  try {
    if (rank() == root_rank) {
      // Publish, then wait until every other rank has read it: the store lives in rank 0's
      // process, and rank 0 may exit right after sharing (e.g. its error).
      store_set(*connection_->store, key, text);
      std::vector<std::string> acknowledgements;
      for (int other = 0; other < world_size(); ++other) {
        if (other != root_rank) acknowledgements.push_back(key + "/read/" + std::to_string(other));
      }
      // Wait in short slices so a rank that failed meanwhile (report_failure) stops us early.
      const auto deadline = std::chrono::steady_clock::now() + wait;
      for (;;) {
        try {
          connection_->store->wait(acknowledgements, std::chrono::milliseconds(1000));
          return text;
        } catch (const c10::Error&) {
          for (int other = 0; other < world_size(); ++other) {
            const std::string failure = "failure/" + std::to_string(other);
            if (other != rank() && connection_->store->check({failure})) {
              throw DistributedError("rank " + std::to_string(rank()) + ": rank " + std::to_string(other) +
                                     " failed before reading '" + key + "': " +
                                     store_get(*connection_->store, failure));
            }
          }
          if (std::chrono::steady_clock::now() > deadline) throw;
        }
      }
    }
    connection_->store->wait({key}, wait);
    std::string value = store_get(*connection_->store, key);
    store_set(*connection_->store, key + "/read/" + std::to_string(rank()), "1");
    return value;
  } catch (const DistributedError&) {
    throw;
  } catch (const std::exception& error) {
    rethrow_collective_failure("waiting for rank " + std::to_string(root_rank) + "'s '" + key + "'",
                               error);
  }
}

void DistributedContext::report_failure(const std::string& message) noexcept {
  if (!connection_ || !connection_->store || connection_->store_unreachable) return;
  try {  // best effort, bounded: the store may be gone with rank 0 or behind a cut link
    const c10::intrusive_ptr<c10d::Store> store = connection_->store;
    const std::string key = "failure/" + std::to_string(rank());
    within<bool>(kStoreLookupBound, [store, key, message] {
      store_set(*store, key, message);
      return true;
    });
  } catch (...) {
  }
}

}  // namespace xpm
