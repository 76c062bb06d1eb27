#include "xpm/trainer/distributed/local_launcher.hpp"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "xpm/trainer/loop/stop_signals.hpp"

extern char** environ;

namespace xpm {
namespace {

// A TCP port that is free on 127.0.0.1 now (the kernel picks it; rank 0 binds it moments later).
int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("--nproc: socket(): ") + std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof address;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    const std::string error = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error("--nproc: cannot find a free port on 127.0.0.1: " + error);
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

std::vector<std::string> worker_environment(int rank, const LocalLaunchOptions& options, int port, int restart) {
  static const char* const kReplaced[] = {"RANK=",        "WORLD_SIZE=",  "LOCAL_RANK=",
                                          "LOCAL_WORLD_SIZE=", "MASTER_ADDR=", "MASTER_PORT=",
                                          "TORCHELASTIC_RESTART_COUNT=", "TORCHELASTIC_MAX_RESTARTS="};
  std::vector<std::string> out;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    bool replaced = false;
    for (const char* prefix : kReplaced) replaced = replaced || std::strncmp(*entry, prefix, std::strlen(prefix)) == 0;
    if (!replaced) out.emplace_back(*entry);
  }
  out.push_back("RANK=" + std::to_string(rank));
  out.push_back("LOCAL_RANK=" + std::to_string(rank));
  out.push_back("WORLD_SIZE=" + std::to_string(options.nproc));
  out.push_back("LOCAL_WORLD_SIZE=" + std::to_string(options.nproc));
  out.push_back("MASTER_ADDR=127.0.0.1");
  out.push_back("MASTER_PORT=" + std::to_string(port));
  out.push_back("TORCHELASTIC_RESTART_COUNT=" + std::to_string(restart));
  out.push_back("TORCHELASTIC_MAX_RESTARTS=" + std::to_string(options.max_restarts));
  return out;
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// The signals the launcher passes on to its workers (each in a process group of its own, so a
// terminal's Ctrl-C reaches them once, through here).
// Every signal --preemption-signal accepts (stop_signals.cpp) is among them.
constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2, SIGHUP, SIGQUIT, SIGXCPU};
std::atomic<int> g_pending_signal{0};

void remember_signal(int signal) { g_pending_signal.store(signal); }

class ForwardedSignals {
 public:
  ForwardedSignals() {
    struct sigaction action {};
    action.sa_handler = &remember_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = 0;  // no SA_RESTART: waitpid returns EINTR and the loop forwards
    for (std::size_t i = 0; i < std::size(kForwarded); ++i) sigaction(kForwarded[i], &action, &previous_[i]);
  }
  ~ForwardedSignals() {
    for (std::size_t i = 0; i < std::size(kForwarded); ++i) sigaction(kForwarded[i], &previous_[i], nullptr);
  }
  ForwardedSignals(const ForwardedSignals&) = delete;
  ForwardedSignals& operator=(const ForwardedSignals&) = delete;

 private:
  struct sigaction previous_[std::size(kForwarded)] {};
};

// Passes a signal the launcher received on to every worker; true when there was one.
bool forward_pending_signal(const std::map<pid_t, int>& rank_of) {
  const int signal = g_pending_signal.exchange(0);
  if (signal == 0) return false;
  for (const auto& [pid, rank] : rank_of) ::kill(pid, signal);
  return true;
}

std::string describe(int status) {
  if (WIFEXITED(status) && WEXITSTATUS(status) == kInterruptedExitCode) {
    return "stopped after a signal, with a checkpoint (exit code " + std::to_string(kInterruptedExitCode) + ")";
  }
  if (WIFSIGNALED(status)) {
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  }
  return "exited with code " + std::to_string(exit_code_of(status));
}

// Starts every rank of one attempt; terminates the ones already started when one cannot be.
std::map<pid_t, int> start_workers(const std::vector<std::string>& arguments, const LocalLaunchOptions& options,
                                   int restart) {
  const int port = options.master_port > 0 ? options.master_port : free_loopback_port();
  std::map<pid_t, int> rank_of;
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attributes, 0);
  for (int rank = 0; rank < options.nproc; ++rank) {
    std::vector<std::string> argv_strings = {"/proc/self/exe"};
    argv_strings.insert(argv_strings.end(), arguments.begin(), arguments.end());
    std::vector<std::string> env_strings = worker_environment(rank, options, port, restart);
    std::vector<char*> argv = pointers(argv_strings), envp = pointers(env_strings);
    pid_t pid = 0;
    const int error = ::posix_spawn(&pid, "/proc/self/exe", nullptr, &attributes, argv.data(), envp.data());
    if (error != 0) {
      posix_spawnattr_destroy(&attributes);
      for (const auto& [started, unused] : rank_of) ::kill(started, SIGTERM);
      for (const auto& [started, unused] : rank_of) ::waitpid(started, nullptr, 0);
      throw std::runtime_error("--nproc: cannot start rank " + std::to_string(rank) + ": " +
                               std::strerror(error));
    }
    rank_of[pid] = rank;
  }
  posix_spawnattr_destroy(&attributes);
  return rank_of;
}

struct AttemptResult {
  int exit_code = 0;          // of the first worker that failed; 0 when all succeeded
  std::string failure;        // "rank 1 exited with code 17"
  bool signalled = false;     // the launcher itself received a signal (and passed it on)
};

// Waits for every worker of one attempt; after the first failure the others get grace_s to
// stop on their own (their collectives fail, naming the rank), then SIGTERM.
AttemptResult wait_for_workers(std::map<pid_t, int> rank_of, const LocalLaunchOptions& options) {
  AttemptResult result;
  std::chrono::steady_clock::time_point failed_at;
  bool terminated = false;
  while (!rank_of.empty()) {
    result.signalled = forward_pending_signal(rank_of) || result.signalled;
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, result.exit_code == 0 ? 0 : WNOHANG);
    if (pid > 0) {
      const auto it = rank_of.find(pid);
      if (it == rank_of.end()) continue;
      const int rank = it->second;
      rank_of.erase(it);
      if (exit_code_of(status) != 0) {
        const std::string failure = "rank " + std::to_string(rank) + " " + describe(status);
        std::cerr << "xpm-train: " + failure + "\n";  // one write
        if (result.exit_code == 0) {
          result.exit_code = exit_code_of(status);
          result.failure = failure;
          failed_at = std::chrono::steady_clock::now();
        }
      }
      continue;
    }
    if (pid < 0 && errno != EINTR) break;  // no children left
    if (result.exit_code == 0) continue;   // a signal interrupted the wait: forward it
    const double waited_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - failed_at).count();
    if (!terminated && waited_s > options.grace_s) {
      for (const auto& [other, rank] : rank_of) {
        std::ostringstream line;  // one write: the workers share stderr
        line << "xpm-train: rank " << rank << " still running " << options.grace_s
             << " s after a failure; terminating it\n";
        std::cerr << line.str();
        ::kill(other, SIGTERM);
      }
      terminated = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return result;
}

// A failure that another attempt could get past: not bad input (2, the same on every attempt),
// not a stop that a signal asked for (4, or a signal the launcher passed on).
bool restartable(const AttemptResult& result) {
  return result.exit_code != 0 && result.exit_code != 2 && result.exit_code != kInterruptedExitCode &&
         !result.signalled;
}

}  // namespace

int launch_local_workers(const std::vector<std::string>& arguments, const LocalLaunchOptions& options) {
  if (options.nproc < 1) {
    throw std::invalid_argument("--nproc must be >= 1, got " + std::to_string(options.nproc));
  }
  if (options.max_restarts < 0) {
    throw std::invalid_argument("--max-restarts must be >= 0, got " + std::to_string(options.max_restarts));
  }
  const ForwardedSignals forwarded;
  for (int restart = 0;; ++restart) {
    const AttemptResult result = wait_for_workers(start_workers(arguments, options, restart), options);
    if (!restartable(result)) return result.exit_code;
    if (restart == options.max_restarts) {
      if (options.max_restarts > 0) {
        std::cerr << "xpm-train: giving up after " + std::to_string(restart) + " restart" +
                         (restart == 1 ? "" : "s") + " (--max-restarts " + std::to_string(options.max_restarts) +
                         ")\n";
      }
      return result.exit_code;
    }
    std::cerr << "xpm-train: restarting all " + std::to_string(options.nproc) + " ranks from the newest " +
                     "checkpoint (restart " + std::to_string(restart + 1) + " of " +
                     std::to_string(options.max_restarts) + ") after " + result.failure + "\n";
  }
}

}  // namespace xpm
