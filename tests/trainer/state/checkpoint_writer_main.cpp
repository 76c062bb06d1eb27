// xpm-checkpoint-writer DIR FLOATS_PER_TENSOR: saves checkpoints 1, 2, 3, ... into DIR with a
// CheckpointStore (keep_last 2, every third one marked best), each holding three tensors
// (tensor-0.pt .. tensor-2.pt, FLOATS_PER_TENSOR float32 values each, all equal to the step,
// times 1, 2, 3 for the three files) written with torch::save, and prints "saved <step>" after
// each completed save. Runs until killed; the kill test (checkpoint_store_test.cpp) SIGKILLs it
// at varied moments and checks what CheckpointStore::latest_valid() finds. Exit code 2 for bad
// arguments (one line naming the argument), 1 when a save fails.
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <string>

#include <torch/torch.h>

#include "xpm/trainer/state/checkpoint_store.hpp"

namespace {

// FLOATS_PER_TENSOR: a whole number >= 1; 0 for anything else.
std::int64_t parse_count(const std::string& text) {
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  return error == std::errc() && end == text.data() + text.size() && value >= 1 ? value : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 3) {
    std::fprintf(stderr, "xpm-checkpoint-writer: error: unexpected argument '%s' (usage: "
                         "xpm-checkpoint-writer DIR FLOATS_PER_TENSOR)\n", argv[3]);
    return 2;
  }
  if (argc < 3) {
    std::fprintf(stderr, "usage: xpm-checkpoint-writer DIR FLOATS_PER_TENSOR\n");
    return 2;
  }
  const std::int64_t floats_per_tensor = parse_count(argv[2]);
  if (floats_per_tensor == 0) {
    std::fprintf(stderr, "xpm-checkpoint-writer: error: FLOATS_PER_TENSOR '%s' is not a whole number >= 1\n",
                 argv[2]);
    return 2;
  }
  try {
    const std::string dir = argv[1];
    xpm::CheckpointSettings settings;
    settings.every_steps = 1;
    settings.keep_last = 2;
    xpm::CheckpointStore store(dir, settings);
    for (std::int64_t step = 1;; ++step) {
      std::map<std::string, xpm::CheckpointFileWriter> files;
      for (int i = 0; i < 3; ++i) {
        files["tensor-" + std::to_string(i) + ".pt"] = [=](const std::string& path) {
          torch::save(torch::full({floats_per_tensor}, static_cast<double>(step * (i + 1)),
                                  torch::kFloat32),
                      path);
        };
      }
      store.save(step, {{"writer", "xpm-checkpoint-writer"}}, files, /*is_best=*/step % 3 == 0);
      std::printf("saved %lld\n", static_cast<long long>(step));
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "xpm-checkpoint-writer: %s\n", e.what());
    return 1;
  }
}
