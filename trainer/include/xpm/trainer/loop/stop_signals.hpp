// xpm/trainer/loop/stop_signals.hpp — a graceful stop on a signal: the first SIGTERM, SIGINT or
// preemption signal (SIGUSR1 from a scheduler about to kill the job) asks the run to stop after
// the step in progress; a second one ends the process at once.
//
//   xpm::StopSignals stop({SIGINT, SIGTERM, SIGUSR1});  // installs the handlers; RAII
//   while (!stop.requested()) train_one_step();         // the Learner: LearnerOptions::stop_signals
//   stop.signal();                                      // which one arrived (0: none)
//
// The handler only stores the signal number in an atomic (async-signal-safe). A second signal
// of the set at least 1 s after the first restores the default action and raises it again, so
// the process ends as it would without handlers; within 1 s it counts as the same delivery (a
// signal sent to a process group and forwarded by a launcher arrives twice). One instance at a
// time per process: the constructor throws std::logic_error while another is alive, and
// std::invalid_argument for a signal that cannot be caught (SIGKILL, SIGSTOP, out of range).
#pragma once

#include <atomic>
#include <csignal>
#include <string>
#include <vector>

namespace xpm {

/// The exit code of xpm's programs after a graceful stop (every rank's, and the launcher's):
/// the run folder holds a checkpoint of the last step; --resume continues from it.
constexpr int kInterruptedExitCode = 4;

class StopSignals {
 public:
  explicit StopSignals(const std::vector<int>& signals);
  ~StopSignals();  // restores the handlers that were there before
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  /// True once one of the signals arrived.
  bool requested() const { return flag().load(); }
  /// The first signal that arrived; 0 while none did.
  int signal() const;
  /// The flag requested() reads, for a step that must see it (DataParallelTrainer::set_stop_flag).
  const std::atomic<bool>& flag() const;

 private:
  std::vector<int> signals_;
  std::vector<struct sigaction> previous_;
};

/// "SIGTERM" for SIGTERM; "signal N" for a number without a name here.
std::string signal_name(int signal);
/// "SIGUSR1" or "USR1" -> SIGUSR1 (also INT, TERM, HUP, QUIT, USR2, XCPU); "none" -> 0.
/// Throws std::invalid_argument "<source> must be a signal name (SIGUSR1, ...) or none, got 'x'".
int parse_signal_name(const std::string& text, const std::string& source);

}  // namespace xpm
