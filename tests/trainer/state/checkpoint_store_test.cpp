// CheckpointStore (checkpoint_store.hpp): when a checkpoint is due, the manifest's sizes and
// CRC-32s (checked against the standard check value), keep-K retention that keeps the best,
// detection of flipped bytes, truncated files, missing or unparsable manifests, replacement of a
// same-step checkpoint, leftover temporary folders; and kill -9 of a process writing checkpoints
// (xpm-checkpoint-writer) at varied moments, after which the newest valid checkpoint loads and
// holds exactly what the writer wrote for its step.
#include "torch_doctest.hpp"
#include "scratch_folders.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "xpm/trainer/state/checkpoint_store.hpp"

extern char** environ;

namespace {

namespace fs = std::filesystem;

/// A fresh, empty folder under the build tree for one test, removed when the test passes.
std::string fresh_dir(const std::string& name) {
  const fs::path dir = fs::path(XPM_BINARY_DIR) / "tests" / "checkpoint_store_test" / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  xpm_test::remove_when_passed(dir);
  return dir.string();
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

/// A writer that puts `content` in the file.
xpm::CheckpointFileWriter text_writer(const std::string& content) {
  return [content](const std::string& path) {
    std::ofstream out(path, std::ios::binary);
    out << content;
    if (!out) throw std::runtime_error("test writer failed");
  };
}

std::map<std::string, xpm::CheckpointFileWriter> one_file(const std::string& content) {
  return {{"model.bin", text_writer(content)}};
}

std::vector<std::string> folder_names(const std::vector<std::string>& paths) {
  std::vector<std::string> names;
  for (const std::string& p : paths) names.push_back(fs::path(p).filename().string());
  return names;
}

std::vector<std::string> temp_folders(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(".tmp-", 0) == 0) names.push_back(name);
  }
  return names;
}

/// A pid that belonged to a process that has exited and been reaped.
pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

}  // namespace

TEST_CASE("a checkpoint is due every N steps and at the end of every N epochs") {
  const std::string dir = fresh_dir("due");
  xpm::CheckpointSettings by_steps;
  by_steps.every_steps = 100;
  xpm::CheckpointStore steps(dir, by_steps);
  CHECK_FALSE(steps.due(0, 0));
  CHECK_FALSE(steps.due(99, 0));
  CHECK(steps.due(100, 0));
  CHECK_FALSE(steps.due(101, 0));
  CHECK(steps.due(300, 0));
  CHECK_FALSE(steps.due(150, 1));  // not by epochs

  xpm::CheckpointSettings by_epochs;
  by_epochs.every_epochs = 2;
  xpm::CheckpointStore epochs(dir, by_epochs);
  CHECK_FALSE(epochs.due(100, 0));
  CHECK_FALSE(epochs.due(57, 1));
  CHECK(epochs.due(57, 2));
  CHECK_FALSE(epochs.due(58, 3));
  CHECK(epochs.due(90, 4));

  xpm::CheckpointSettings both;
  both.every_steps = 10;
  both.every_epochs = 1;
  xpm::CheckpointStore either(dir, both);
  CHECK(either.due(10, 0));
  CHECK(either.due(13, 1));
  CHECK_FALSE(either.due(13, 0));

  xpm::CheckpointStore never(dir, xpm::CheckpointSettings{});
  CHECK_FALSE(never.due(100, 5));
}

TEST_CASE("bad settings throw an error naming the field and its value") {
  const std::string dir = fresh_dir("bad_settings");
  xpm::CheckpointSettings keep_none;
  keep_none.keep_last = 0;
  CHECK_THROWS_WITH_AS(keep_none.validate(), doctest::Contains("keep_last must be >= 1, got 0"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::CheckpointStore(dir, keep_none), doctest::Contains("keep_last"),
                       std::invalid_argument);
  xpm::CheckpointSettings negative_steps;
  negative_steps.every_steps = -5;
  CHECK_THROWS_WITH_AS(negative_steps.validate(),
                       doctest::Contains("every_steps must be >= 0 (0: not by steps), got -5"),
                       std::invalid_argument);
  xpm::CheckpointSettings negative_epochs;
  negative_epochs.every_epochs = -1;
  CHECK_THROWS_WITH_AS(negative_epochs.validate(), doctest::Contains("every_epochs"),
                       std::invalid_argument);
  xpm::CheckpointStore store(dir, xpm::CheckpointSettings{});
  CHECK_THROWS_WITH_AS(store.save(-1, {}, one_file("x"), false),
                       doctest::Contains("step must be >= 0, got -1"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(store.save(1, {}, {{"manifest.json", text_writer("x")}}, false),
                       doctest::Contains("'manifest.json' is not allowed"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(store.save(1, {}, {{"../escape", text_writer("x")}}, false),
                       doctest::Contains("'../escape' is not allowed"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(store.save(1, {{"step", 3}}, one_file("x"), false),
                       doctest::Contains("'step'"), std::invalid_argument);
  CHECK(store.list().empty());
}

TEST_CASE("the manifest holds each file's size and standard CRC-32 plus the extra keys") {
  const std::string dir = fresh_dir("manifest");
  xpm::CheckpointStore store(dir, xpm::CheckpointSettings{});
  // "123456789" is CRC-32's published check string; its CRC-32 is 0xCBF43926.
  const std::string folder =
      store.save(7, {{"config", {{"lr", 0.5}}}},
                 {{"a.bin", text_writer("123456789")}, {"b.bin", text_writer("")}}, false);
  CHECK(fs::path(folder).filename() == "step-00000007");
  const nlohmann::json manifest = nlohmann::json::parse(read_text(folder + "/manifest.json"));
  CHECK(manifest["format_version"] == 1);
  CHECK(manifest["step"] == 7);
  CHECK(manifest["config"]["lr"] == 0.5);
  CHECK(manifest["files"]["a.bin"]["bytes"] == 9);
  CHECK(manifest["files"]["a.bin"]["crc32"].get<std::uint32_t>() == 0xCBF43926u);
  CHECK(manifest["files"]["b.bin"]["bytes"] == 0);
  CHECK(manifest["files"]["b.bin"]["crc32"].get<std::uint32_t>() == 0u);
  CHECK(read_text(folder + "/a.bin") == "123456789");
  CHECK(xpm::CheckpointStore::verify(folder) == "");
  const auto latest = store.latest_valid(nullptr);
  REQUIRE(latest);
  CHECK(latest->step == 7);
  CHECK(latest->path == folder);
  CHECK(latest->manifest == manifest);
  CHECK(temp_folders(dir).empty());
}

TEST_CASE("keeps the newest K checkpoints and the best one even when it is old") {
  const std::string dir = fresh_dir("retention");
  xpm::CheckpointSettings settings;
  settings.keep_last = 2;
  xpm::CheckpointStore store(dir, settings);
  for (int step = 1; step <= 5; ++step) {
    store.save(step, {}, one_file("step " + std::to_string(step)), /*is_best=*/step == 2);
  }
  CHECK(folder_names(store.list()) ==
        std::vector<std::string>{"step-00000002", "step-00000004", "step-00000005"});
  CHECK(read_text(dir + "/best") == "step-00000002\n");
  auto best = store.best();
  REQUIRE(best);
  CHECK(best->step == 2);
  CHECK(read_text(best->path + "/model.bin") == "step 2");

  // A newer best: the old best is no longer kept, only the newest two (one is the best).
  store.save(6, {}, one_file("step 6"), /*is_best=*/true);
  CHECK(folder_names(store.list()) ==
        std::vector<std::string>{"step-00000005", "step-00000006"});
  best = store.best();
  REQUIRE(best);
  CHECK(best->step == 6);

  // keep_best = false: the best is removed like any other old one.
  const std::string dir2 = fresh_dir("retention_no_best");
  settings.keep_best = false;
  settings.keep_last = 1;
  xpm::CheckpointStore no_best(dir2, settings);
  no_best.save(1, {}, one_file("one"), /*is_best=*/true);
  no_best.save(2, {}, one_file("two"), false);
  CHECK(folder_names(no_best.list()) == std::vector<std::string>{"step-00000002"});
  CHECK_FALSE(no_best.best());
}

TEST_CASE("a byte flipped in the middle of a file is detected and the previous checkpoint used") {
  const std::string dir = fresh_dir("flipped_byte");
  xpm::CheckpointSettings settings;
  settings.keep_last = 3;
  xpm::CheckpointStore store(dir, settings);
  const std::string content(10000, 'a');
  store.save(1, {}, one_file(content), false);
  const std::string second = store.save(2, {}, one_file(content), false);
  {
    std::fstream file(second + "/model.bin", std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(5000);
    file.put('b');
  }
  CHECK(fs::file_size(second + "/model.bin") == 10000);
  const std::string reason = xpm::CheckpointStore::verify(second);
  CHECK(reason.find("file 'model.bin' checksum mismatch") != std::string::npos);
  std::vector<std::string> warnings;
  const auto latest = store.latest_valid(&warnings);
  REQUIRE(latest);
  CHECK(latest->step == 1);
  REQUIRE(warnings.size() == 1);
  CHECK(warnings[0].find("step-00000002") != std::string::npos);
  CHECK(warnings[0].find("checksum mismatch") != std::string::npos);
}

TEST_CASE("a truncated file is detected by its size and the previous checkpoint used") {
  const std::string dir = fresh_dir("truncated");
  xpm::CheckpointStore store(dir, xpm::CheckpointSettings{});
  store.save(10, {}, one_file(std::string(4096, 'x')), false);
  const std::string second = store.save(20, {}, one_file(std::string(4096, 'y')), false);
  fs::resize_file(second + "/model.bin", 1000);
  std::vector<std::string> warnings;
  const auto latest = store.latest_valid(&warnings);
  REQUIRE(latest);
  CHECK(latest->step == 10);
  REQUIRE(warnings.size() == 1);
  CHECK(warnings[0].find("step-00000020") != std::string::npos);
  CHECK(warnings[0].find("size mismatch: manifest says 4096 bytes, found 1000") !=
        std::string::npos);

  fs::remove(second + "/model.bin");
  CHECK(xpm::CheckpointStore::verify(second) == "file 'model.bin' is missing");
}

TEST_CASE("a missing or unparsable manifest is detected and with none valid nothing is returned") {
  const std::string dir = fresh_dir("manifest_missing");
  xpm::CheckpointSettings settings;
  settings.keep_last = 3;
  xpm::CheckpointStore store(dir, settings);
  const std::string first = store.save(1, {}, one_file("one"), false);
  const std::string second = store.save(2, {}, one_file("two"), false);
  const std::string third = store.save(3, {}, one_file("three"), false);
  fs::remove(third + "/manifest.json");
  {
    std::ofstream out(second + "/manifest.json", std::ios::trunc);
    out << "{\"step\": 2, \"files\": {";
  }
  std::vector<std::string> warnings;
  auto latest = store.latest_valid(&warnings);
  REQUIRE(latest);
  CHECK(latest->step == 1);
  REQUIRE(warnings.size() == 2);
  CHECK(warnings[0] == "skipping checkpoint '" + third + "': missing manifest.json");
  CHECK(warnings[1].find("'" + second + "': manifest.json unparsable") != std::string::npos);

  fs::remove(first + "/model.bin");
  warnings.clear();
  CHECK_FALSE(store.latest_valid(&warnings));
  CHECK(warnings.size() == 3);
}

TEST_CASE("saving a step that exists replaces that checkpoint") {
  const std::string dir = fresh_dir("replace");
  xpm::CheckpointStore store(dir, xpm::CheckpointSettings{});
  store.save(3, {{"try", 1}}, one_file("old content"), false);
  const std::string folder = store.save(3, {{"try", 2}}, one_file("new"), false);
  CHECK(folder_names(store.list()) == std::vector<std::string>{"step-00000003"});
  CHECK(read_text(folder + "/model.bin") == "new");
  const auto latest = store.latest_valid(nullptr);
  REQUIRE(latest);
  CHECK(latest->manifest["try"] == 2);
  CHECK(latest->manifest["files"]["model.bin"]["bytes"] == 3);
  CHECK(temp_folders(dir).empty());
}

TEST_CASE("a failing writer leaves earlier checkpoints untouched and no temporary folder") {
  const std::string dir = fresh_dir("failing_writer");
  xpm::CheckpointStore store(dir, xpm::CheckpointSettings{});
  store.save(1, {}, one_file("one"), true);
  auto failing = [](const std::string&) { throw std::runtime_error("disk on fire"); };
  CHECK_THROWS_WITH_AS(store.save(2, {}, {{"model.bin", failing}}, true),
                       doctest::Contains("model.bin': disk on fire"), std::runtime_error);
  CHECK(folder_names(store.list()) == std::vector<std::string>{"step-00000001"});
  CHECK(temp_folders(dir).empty());
  CHECK(store.best()->step == 1);
}

TEST_CASE("leftover temporary folders are ignored and the next save removes only dead ones") {
  const std::string dir = fresh_dir("leftovers");
  xpm::CheckpointStore store(dir, xpm::CheckpointSettings{});
  store.save(1, {}, one_file("one"), false);
  const std::string dead = ".tmp-step-00000002-" + std::to_string(dead_pid());
  const std::string live = ".tmp-step-00000002-" + std::to_string(::getppid());
  for (const std::string& name : {dead, live, std::string("notes")}) {
    fs::create_directories(dir + "/" + name);
    std::ofstream(dir + "/" + name + "/model.bin") << "partial";
  }
  std::vector<std::string> warnings;
  const auto latest = store.latest_valid(&warnings);
  REQUIRE(latest);
  CHECK(latest->step == 1);
  CHECK(warnings.empty());
  CHECK(folder_names(store.list()) == std::vector<std::string>{"step-00000001"});

  store.save(2, {}, one_file("two"), false);
  CHECK_FALSE(fs::exists(dir + "/" + dead));
  CHECK(fs::exists(dir + "/" + live));  // another running process's write is left alone
  CHECK(fs::exists(dir + "/notes"));
  CHECK(store.latest_valid(nullptr)->step == 2);
}

// ---------------------------------------------------------------------------------------------
// kill -9 during checkpoint writes

namespace {

/// xpm-checkpoint-writer running with its stdout on a pipe.
class WriterProcess {
 public:
  WriterProcess(const std::string& dir, std::int64_t floats_per_tensor) {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    posix_spawn_file_actions_addclose(&actions, fds[1]);
    const std::string program = XPM_CHECKPOINT_WRITER;
    const std::string floats = std::to_string(floats_per_tensor);
    std::vector<char*> args = {const_cast<char*>(program.c_str()),
                               const_cast<char*>(dir.c_str()),
                               const_cast<char*>(floats.c_str()), nullptr};
    const int rc = ::posix_spawn(&pid_, program.c_str(), &actions, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(fds[1]);
    read_fd_ = fds[0];
    REQUIRE_MESSAGE(rc == 0, "cannot start " << program);
  }
  ~WriterProcess() {
    if (pid_ > 0) kill_and_wait();
    if (read_fd_ >= 0) ::close(read_fd_);
  }

  /// Reads output until "saved <step>" has been printed; false after `timeout_s` or at the end.
  bool wait_for_saved(std::int64_t step, double timeout_s) {
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (last_saved_ < step) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      if (!read_some(static_cast<int>(left.count()))) return false;
    }
    return true;
  }

  void kill_and_wait() {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    while (read_some(0)) {
    }
  }

  /// The last step the writer printed as saved.
  std::int64_t last_saved() const { return last_saved_; }

 private:
  bool read_some(int timeout_ms) {
    pollfd fd{read_fd_, POLLIN, 0};
    if (::poll(&fd, 1, timeout_ms) <= 0) return false;
    char buffer[4096];
    const ssize_t n = ::read(read_fd_, buffer, sizeof buffer);
    if (n <= 0) return false;
    pending_.append(buffer, static_cast<std::size_t>(n));
    std::size_t end;
    while ((end = pending_.find('\n')) != std::string::npos) {
      const std::string line = pending_.substr(0, end);
      pending_.erase(0, end + 1);
      if (line.rfind("saved ", 0) == 0) last_saved_ = std::stoll(line.substr(6));
    }
    return true;
  }

  pid_t pid_ = -1;
  int read_fd_ = -1;
  std::string pending_;
  std::int64_t last_saved_ = 0;
};

/// A temporary folder: a checkpoint being written (".tmp-step-N-pid") or, with `old`, an old
/// checkpoint being removed by retention (".tmp-step-N-pid-old").
bool has_temp_folder(const std::string& dir, bool old = false) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool is_old = name.size() > 4 && name.compare(name.size() - 4, 4, "-old") == 0;
    if (name.rfind(".tmp-step-", 0) == 0 && is_old == old) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("after kill -9 during checkpoint writes the newest valid checkpoint is complete") {
  // 3 tensors of 1M float32 (4 MB each) per checkpoint: a save (write, fsync, read back for the
  // CRC, rename, retention) takes tens of milliseconds or more.
  const std::int64_t floats_per_tensor = 1 << 20;
  // Kill moments: a fraction of the measured save period after "saved <k>" (k = 2..4, so the
  // retention of keep_last 2 has deleted folders), or as soon as a temporary folder is seen
  // (plus a few milliseconds).
  struct KillMoment {
    bool when_temp_folder_exists;
    double period_fraction;  // of the save period, after "saved k"
    int delay_ms;            // after the temporary folder appeared
  };
  const std::vector<KillMoment> moments = {
      {false, 0.0, 0},  {false, 0.1, 0},  {false, 0.25, 0}, {false, 0.4, 0},
      {false, 0.55, 0}, {false, 0.7, 0},  {false, 0.85, 0}, {false, 0.95, 0},
      {false, 1.3, 0},  {true, 0.0, 0},   {true, 0.0, 2},   {true, 0.0, 10}};
  double period_s = 0;
  int mid_write = 0, mid_removal = 0;
  for (std::size_t i = 0; i < moments.size(); ++i) {
    const KillMoment moment = moments[i];
    CAPTURE(i);
    const std::string dir = fresh_dir("kill-" + std::to_string(i));
    WriterProcess writer(dir, floats_per_tensor);
    const std::int64_t wait_step = 2 + static_cast<std::int64_t>(i % 3);
    REQUIRE(writer.wait_for_saved(1, 120.0));
    const auto first_saved = std::chrono::steady_clock::now();
    REQUIRE(writer.wait_for_saved(wait_step, 120.0));
    if (i == 0) {
      period_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - first_saved)
                     .count() /
                 static_cast<double>(wait_step - 1);
      MESSAGE("save period (3 x 4 MB tensors): " << period_s * 1000 << " ms");
    }
    if (moment.when_temp_folder_exists) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!has_temp_folder(dir) && std::chrono::steady_clock::now() < deadline) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(moment.delay_ms));
    } else {
      std::this_thread::sleep_for(std::chrono::duration<double>(moment.period_fraction * period_s));
    }
    writer.kill_and_wait();
    const bool killed_mid_write = has_temp_folder(dir);
    const bool killed_mid_removal = has_temp_folder(dir, /*old=*/true);
    mid_write += killed_mid_write ? 1 : 0;
    mid_removal += killed_mid_removal ? 1 : 0;
    const std::int64_t printed = writer.last_saved();

    xpm::CheckpointSettings settings;
    settings.keep_last = 2;
    xpm::CheckpointStore store(dir, settings);
    std::vector<std::string> warnings;
    const auto latest = store.latest_valid(&warnings);
    REQUIRE(latest);
    CHECK(warnings.empty());
    // Every printed step was complete; the next one may have completed before the kill.
    CHECK(latest->step >= printed);
    CHECK(latest->step <= printed + 1);
    for (int t = 0; t < 3; ++t) {
      torch::Tensor tensor;
      torch::load(tensor, latest->path + "/tensor-" + std::to_string(t) + ".pt");
      CHECK(tensor.numel() == floats_per_tensor);
      CHECK(torch::equal(tensor, torch::full({floats_per_tensor},
                                             static_cast<double>(latest->step * (t + 1)),
                                             torch::kFloat32)));
    }
    // The best marker (every third step) names a valid checkpoint once step 3 was written.
    if (latest->step >= 3) {
      const auto best = store.best();
      REQUIRE(best);
      CHECK(best->step % 3 == 0);
    }
    // The next save (another process now) removes the dead writer's temporary folder.
    store.save(latest->step + 1, {}, one_file("after the crash"), false);
    CHECK_FALSE(has_temp_folder(dir));
    CHECK_FALSE(has_temp_folder(dir, /*old=*/true));
    MESSAGE("kill " << i << ": writer printed step " << printed << ", latest valid step "
                    << latest->step
                    << std::string(killed_mid_write ? ", killed mid-write" : "")
                    << std::string(killed_mid_removal ? ", killed while removing an old one" : "")
                    << std::string(!killed_mid_write && !killed_mid_removal ? ", between writes"
                                                                            : ""));
  }
  MESSAGE("kills that landed mid-write (a .tmp-step-* folder left behind): "
          << mid_write << " of " << moments.size() << "; while removing an old checkpoint: "
          << mid_removal);
  CHECK(mid_write >= 3);
}
