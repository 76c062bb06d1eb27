// StopSignals: the handlers store the signal; a second one re-raises it with the default action.
#include "xpm/trainer/loop/stop_signals.hpp"

#include <ctime>
#include <stdexcept>
#include <utility>

namespace xpm {
namespace {

std::atomic<bool> g_installed{false};
std::atomic<bool> g_requested{false};
std::atomic<int> g_signal{0};
std::atomic<long long> g_first_ns{0};

long long monotonic_ns() {  // clock_gettime is async-signal-safe
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<long long>(now.tv_sec) * 1000000000LL + now.tv_nsec;
}

void on_signal(int signal) {
  if (!g_requested.load()) {
    g_signal.store(signal);
    g_first_ns.store(monotonic_ns());
    g_requested.store(true);
    return;
  }
  if (monotonic_ns() - g_first_ns.load() < 1000000000LL) return;  // the same delivery, twice
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

const std::vector<std::pair<std::string, int>>& names() {
  static const std::vector<std::pair<std::string, int>> table = {
      {"SIGINT", SIGINT},   {"SIGTERM", SIGTERM}, {"SIGHUP", SIGHUP},  {"SIGQUIT", SIGQUIT},
      {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2}, {"SIGXCPU", SIGXCPU}};
  return table;
}

}  // namespace

StopSignals::StopSignals(const std::vector<int>& signals) : signals_(signals) {
  for (int signal : signals_) {
    if (signal <= 0 || signal >= NSIG || signal == SIGKILL || signal == SIGSTOP) {
      throw std::invalid_argument("StopSignals: signal " + std::to_string(signal) + " cannot be caught");
    }
  }
  if (g_installed.exchange(true)) throw std::logic_error("StopSignals: another instance is installed");
  g_requested.store(false);
  g_signal.store(0);
  struct sigaction action {};
  action.sa_handler = &on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  previous_.resize(signals_.size());
  for (std::size_t i = 0; i < signals_.size(); ++i) sigaction(signals_[i], &action, &previous_[i]);
}

StopSignals::~StopSignals() {
  for (std::size_t i = 0; i < signals_.size(); ++i) sigaction(signals_[i], &previous_[i], nullptr);
  g_installed.store(false);
}

int StopSignals::signal() const { return g_signal.load(); }

const std::atomic<bool>& StopSignals::flag() const { return g_requested; }

std::string signal_name(int signal) {
  for (const auto& [name, number] : names()) {
    if (number == signal) return name;
  }
  return "signal " + std::to_string(signal);
}

int parse_signal_name(const std::string& text, const std::string& source) {
  if (text == "none") return 0;
  for (const auto& [name, number] : names()) {
    if (text == name || text == name.substr(3)) return number;
  }
  throw std::invalid_argument(source + " must be a signal name (SIGUSR1, SIGUSR2, SIGTERM, ...) or none, got '" +
                              text + "'");
}

}  // namespace xpm
