#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <filesystem>
#include <iostream>
#include <system_error>
#include <vector>

#include "scratch_folders.hpp"

namespace {

// What the running test case registered (scratch_folders.hpp).
std::vector<std::filesystem::path>& registered() {
  static std::vector<std::filesystem::path> paths;
  return paths;
}

// At the end of each test case: removes what it registered if it passed, then forgets it.
class ScratchFolderRemover : public doctest::IReporter {
 public:
  explicit ScratchFolderRemover(const doctest::ContextOptions&) {}

  void test_case_end(const doctest::CurrentTestCaseStats& stats) override {
    if (stats.testCaseSuccess) {
      for (const std::filesystem::path& path : registered()) remove(path);
    }
    registered().clear();
  }

  // The other events: nothing to do.
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}

 private:
  // A folder that cannot be removed is reported, not an error of the test case that passed.
  static void remove(const std::filesystem::path& path) {
    std::error_code error;
    std::filesystem::remove_all(path, error);
    if (error) std::cerr << "warning: could not remove " << path << ": " << error.message() << '\n';
  }
};

REGISTER_LISTENER("scratch_folders", 0, ScratchFolderRemover);

}  // namespace

namespace xpm_test {

void remove_when_passed(const std::filesystem::path& path) { registered().push_back(path); }

}  // namespace xpm_test
