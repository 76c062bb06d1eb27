// with_error_context and describe_error (error_context.hpp): the context goes before the
// message, the class stays (c10::OutOfMemoryError is still caught as one, LibTorch's
// backtrace is kept), contexts nest outermost first, a DistributedError passes unchanged; each
// class has its kind and exit code; a LibTorch error is described by its first line.
#include "torch_doctest.hpp"

#include <new>
#include <stdexcept>
#include <string>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "xpm/trainer/distributed/distributed.hpp"
#include "xpm/trainer/loop/error_context.hpp"

namespace {

// The exception `fn` throws inside with_error_context("step 12", ...), described.
template <class Fn>
xpm::ErrorDescription described(Fn fn) {
  try {
    xpm::with_error_context("step 12", fn);
  } catch (...) {
    return xpm::describe_current_exception();
  }
  FAIL("nothing was thrown");
  return {};
}

}  // namespace

TEST_CASE("with_error_context returns fn's value and keeps the class of what it throws") {
  CHECK(xpm::with_error_context("step 1", [] { return 7; }) == 7);
  CHECK_THROWS_WITH_AS(xpm::with_error_context("step 12", [] { throw std::invalid_argument("bad"); }),
                       "step 12: bad", std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::with_error_context("step 12", [] { throw std::runtime_error("disk"); }),
                       "step 12: disk", std::runtime_error);
  CHECK_THROWS_WITH_AS(xpm::with_error_context("step 12", [] { throw std::out_of_range("index"); }),
                       "step 12: index", std::logic_error);
  CHECK_THROWS_AS(xpm::with_error_context("step 12", [] { throw std::bad_alloc(); }), c10::OutOfMemoryError);
  const std::string unchanged = "rank 0: all-reduce (sum) failed: timeout";
  CHECK_THROWS_WITH_AS(xpm::with_error_context("step 12", [&] { throw xpm::DistributedError(unchanged); }),
                       unchanged.c_str(), xpm::DistributedError);
}

TEST_CASE("a LibTorch error keeps its class, its backtrace and its context lines") {
  try {
    xpm::with_error_context("validation after step 40", [] {
      xpm::with_error_context("probing at bs=8 l=64", [] {
        TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU memory cap exceeded");
      });
    });
    FAIL("nothing was thrown");
  } catch (const c10::OutOfMemoryError& error) {
    const std::string brief = error.what_without_backtrace();
    CHECK(brief.rfind("validation after step 40: probing at bs=8 l=64: CPU memory cap exceeded", 0) == 0);
    CHECK(std::string(error.what()).find("Exception raised from") != std::string::npos);
  }
  try {
    xpm::with_error_context("step 3", [] {
      try {
        torch::ones({2}).index({torch::tensor({5})});
      } catch (c10::Error& error) {
        error.add_context("while indexing");
        throw;
      }
    });
    FAIL("nothing was thrown");
  } catch (const c10::IndexError& error) {
    CHECK(std::string(error.msg()).rfind("step 3: ", 0) == 0);
    REQUIRE(error.context().size() == 1);
    CHECK(error.context()[0] == "while indexing");
  }
}

TEST_CASE("describe_error gives the kind, the first line without the backtrace and the full text") {
  const xpm::ErrorDescription bad = described([] { throw std::invalid_argument("--x must be >= 1"); });
  CHECK(bad.kind == xpm::ErrorKind::kBadInput);
  CHECK(bad.line == "step 12: --x must be >= 1");
  CHECK(xpm::exit_code_of(bad.kind) == 2);

  const xpm::ErrorDescription torch_error = described([] {
    TORCH_INTERNAL_ASSERT(false, "a broken invariant\nsecond line");
  });
  CHECK(torch_error.kind == xpm::ErrorKind::kInternal);
  CHECK(torch_error.line.rfind("step 12: ", 0) == 0);
  CHECK(torch_error.line.find('\n') == std::string::npos);
  CHECK(torch_error.line.find("Exception raised from") == std::string::npos);
  CHECK(torch_error.full_text.find("second line") != std::string::npos);
  CHECK(torch_error.full_text.find("Exception raised from") != std::string::npos);
  CHECK(xpm::exit_code_of(torch_error.kind) == 3);

  const xpm::ErrorDescription oom = described([] { TORCH_CHECK_WITH(OutOfMemoryError, false, "cap"); });
  CHECK(oom.kind == xpm::ErrorKind::kOutOfMemory);
  CHECK(xpm::exit_code_of(oom.kind) == 1);
  CHECK(described([] { throw std::runtime_error("disk full"); }).kind == xpm::ErrorKind::kFailure);
  CHECK(described([] { return nlohmann::json::parse("{"); }).kind == xpm::ErrorKind::kInternal);
  CHECK(described([] { throw 42; }).line == "step 12: unknown exception (not a std::exception)");
}

TEST_CASE("throw_error_of_kind rethrows another process's error as its kind") {
  for (xpm::ErrorKind kind : {xpm::ErrorKind::kBadInput, xpm::ErrorKind::kOutOfMemory,
                              xpm::ErrorKind::kFailure, xpm::ErrorKind::kInternal}) {
    CHECK(xpm::parse_error_kind(xpm::to_string(kind)) == kind);
    try {
      xpm::throw_error_of_kind(kind, "rank 0's line");
    } catch (...) {
      const xpm::ErrorDescription error = xpm::describe_current_exception();
      CHECK(error.kind == kind);
      CHECK(error.line == "rank 0's line");
    }
  }
  CHECK(xpm::parse_error_kind("no such kind") == xpm::ErrorKind::kInternal);
}
