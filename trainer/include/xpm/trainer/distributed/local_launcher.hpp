// xpm/trainer/distributed/local_launcher.hpp — `xpm-train --nproc N`: run N workers of this program on
// this host, each with torchrun's environment, and wait for them (a minimal `torchrun
// --standalone --nproc_per_node N`, https://pytorch.org/docs/stable/elastic/run.html).
//
//   LocalLaunchOptions options;
//   options.nproc = 2;
//   return launch_local_workers(argv_of_this_program, options);
//
// Each worker gets RANK = LOCAL_RANK = i, WORLD_SIZE = LOCAL_WORLD_SIZE = N, MASTER_ADDR =
// 127.0.0.1 and a MASTER_PORT that was free when chosen (or options.master_port), and the same
// command line. Workers inherit stdout and stderr (the trainer logs from rank 0 only and
// prefixes errors with the rank). When a worker fails, the launcher says which rank and how
// (exit code or signal), waits up to options.grace_s for the others to stop on their own (their
// collectives fail within the collective timeout, naming the rank), then terminates them.
//
// Restarts (as `torchrun --max-restarts K`): when an attempt fails, the launcher starts every
// rank again, at most options.max_restarts times, on a fresh port. The workers of attempt k see
// TORCHELASTIC_RESTART_COUNT=k and TORCHELASTIC_MAX_RESTARTS=K, torchrun's variables, and are
// expected to resume from their newest valid checkpoint when k > 0 (xpm-train does). Not
// restarted: exit code 2 (bad input fails the same way again), exit code 4 (a signal asked the
// job to stop) and any attempt during which the launcher itself received a signal.
#pragma once

#include <string>
#include <vector>

namespace xpm {

struct LocalLaunchOptions {
  int nproc = 1;         // workers to start, >= 1
  int master_port = 0;   // 0: pick a free port on 127.0.0.1
  double grace_s = 60;   // after a failure, how long the other workers may take to stop
  int max_restarts = 0;  // restarts of the whole group after a failed attempt, >= 0
};

/// Starts the workers (this executable, /proc/self/exe, with `arguments` as argv[1..]) and
/// waits for all of them, restarting the group as above. Returns 0 when every worker of the
/// last attempt exited with 0; otherwise the exit code of that attempt's first failed worker
/// (128 + signal number for a signal). Prints one line per failed worker ("xpm-train: rank 1
/// exited with code 3") and per restart ("xpm-train: restarting all 2 ranks from the newest
/// checkpoint (restart 1 of 2) after rank 1 exited with code 17") to stderr. Throws
/// std::invalid_argument for nproc < 1 or max_restarts < 0, std::runtime_error when a worker
/// cannot be started (the ones already started are terminated first).
int launch_local_workers(const std::vector<std::string>& arguments, const LocalLaunchOptions& options);

}  // namespace xpm
