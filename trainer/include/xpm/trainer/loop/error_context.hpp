// xpm/trainer/loop/error_context.hpp — errors that say where they happened, in the job's terms, and
// what kind of error they are, for the programs that turn them into one line and an exit code.
//
//   with_error_context("step " + std::to_string(step), [&] { train_one_step(records); });
//   // e.g. throws c10::OutOfMemoryError("step 12: CPU memory cap exceeded: ...")
//
//   catch (...) {                                       // in main()
//     const ErrorDescription error = describe_current_exception();
//     std::cerr << "tool: error: " << error.line << "\n";           // one line
//     write_log(error.full_text);                                   // every line, backtrace too
//     return exit_code_of(error.kind);                              // 2, 1 or 3
//   }
//
// An exception escaping with_error_context is rethrown as an exception of the same class (for
// the classes below; another one as the nearest of them), its message prefixed with
// "<context>: ": LibTorch's c10::OutOfMemoryError stays a c10::OutOfMemoryError (a caller that
// catches out-of-memory errors keeps catching it), c10::Error subclasses keep their class and
// their backtrace, std::invalid_argument stays bad input. Contexts nest, the outermost first
// ("resume: reading 'run/checkpoints/step-00000004/model.pt': PytorchStreamReader failed ...").
// A DistributedError passes unchanged: it already names the rank and the collective.
#pragma once

#include <exception>
#include <string>
#include <utility>

namespace xpm {

/// What kind of error an exception is; the programs map it to their exit codes.
enum class ErrorKind {
  kBadInput,     // std::invalid_argument: an option, a config, the data, a checkpoint's settings
  kOutOfMemory,  // c10::OutOfMemoryError (the CPU cap, a device), std::bad_alloc
  kFailure,      // other std::runtime_error: a file, a rank that died, a collective that timed out
  kInternal,     // anything else: LibTorch's other c10::Error, std::logic_error, ... (a bug)
};

/// The programs' exit code of each kind: 2 bad input, 1 out of memory or failure, 3 internal.
int exit_code_of(ErrorKind kind);

/// "bad_input", "out_of_memory", "failure", "internal".
const char* to_string(ErrorKind kind);
/// The inverse of to_string; kInternal for any other text.
ErrorKind parse_error_kind(const std::string& text);

struct ErrorDescription {
  ErrorKind kind = ErrorKind::kInternal;
  std::string line;       // the message's first line, without LibTorch's backtrace
  std::string full_text;  // what(): every line, LibTorch's backtrace included
};

/// The kind, first line and full text of `error` (c10::Error: its what_without_backtrace()
/// cut at the first newline, and what()).
ErrorDescription describe_error(const std::exception& error);
/// The same for the exception being handled; call it in a catch block. An exception that is
/// not a std::exception is kInternal, "unknown exception".
ErrorDescription describe_current_exception();

/// Throws an exception of `kind` with `message` (std::invalid_argument, c10::OutOfMemoryError,
/// std::runtime_error, std::logic_error): what another process reported, rethrown here.
[[noreturn]] void throw_error_of_kind(ErrorKind kind, const std::string& message);

/// Rethrows the exception being handled with "<context>: " before its message (see the top of
/// this file); call it in a catch block.
[[noreturn]] void rethrow_with_context(const std::string& context);

/// fn(), with "<context>: " added to the message of any exception that escapes it.
template <class Fn>
decltype(auto) with_error_context(const std::string& context, Fn&& fn) {
  try {
    return std::forward<Fn>(fn)();
  } catch (...) {
    rethrow_with_context(context);
  }
}

}  // namespace xpm
