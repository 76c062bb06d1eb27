// Run folders a test case writes (those of xpm-train and the Learner hold ~24 MB of parameters
// and checkpoints each): registered with remove_when_passed, they are removed at the end of the
// test case if it passed, by the doctest listener in doctest_main.cpp, and kept for inspection if
// it failed (a failed check, an exception, a crash). Either way the list is cleared, so each test
// case removes only what it registered. Caches that other test cases reuse on purpose (memory
// models) are not registered.
#pragma once

#include <filesystem>

namespace xpm_test {

// Removes `path` (a folder with everything in it, or a file) at the end of the running test case
// if it passed. Call it from the test case's thread.
void remove_when_passed(const std::filesystem::path& path);

}  // namespace xpm_test
