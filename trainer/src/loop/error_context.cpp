// Errors with where they happened and their kind (error_context.hpp).
#include "xpm/trainer/loop/error_context.hpp"

#include <new>
#include <stdexcept>

#include <c10/util/Exception.h>

#include "xpm/trainer/distributed/distributed.hpp"
#include "xpm/planner/enum_names.hpp"

namespace xpm {
namespace {

std::string first_line(const std::string& text) {
  const std::size_t end = text.find_first_of("\r\n");
  return end == std::string::npos ? text : text.substr(0, end);
}

ErrorKind kind_of(const std::exception& error) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&error) != nullptr ||
      dynamic_cast<const std::bad_alloc*>(&error) != nullptr) {
    return ErrorKind::kOutOfMemory;
  }
  if (dynamic_cast<const c10::Error*>(&error) != nullptr) return ErrorKind::kInternal;
  if (dynamic_cast<const std::invalid_argument*>(&error) != nullptr) return ErrorKind::kBadInput;
  if (dynamic_cast<const std::runtime_error*>(&error) != nullptr) return ErrorKind::kFailure;
  return ErrorKind::kInternal;
}

// `error` as an E (its class, or a base of it) with `prefix` before its message; the
// backtrace and the context lines are kept.
template <class E>
[[noreturn]] void throw_prefixed(const c10::Error& error, const std::string& prefix) {
  E copy(prefix + error.msg(), error.backtrace(), error.caller());
  for (const std::string& line : error.context()) copy.add_context(line);
  throw copy;
}

template <class E>
bool is_a(const c10::Error& error) {
  return dynamic_cast<const E*>(&error) != nullptr;
}

[[noreturn]] void rethrow_c10_prefixed(const c10::Error& error, const std::string& prefix) {
  if (is_a<c10::OutOfMemoryError>(error)) throw_prefixed<c10::OutOfMemoryError>(error, prefix);
  if (is_a<c10::IndexError>(error)) throw_prefixed<c10::IndexError>(error, prefix);
  if (is_a<c10::ValueError>(error)) throw_prefixed<c10::ValueError>(error, prefix);
  if (is_a<c10::TypeError>(error)) throw_prefixed<c10::TypeError>(error, prefix);
  if (is_a<c10::NotImplementedError>(error)) throw_prefixed<c10::NotImplementedError>(error, prefix);
  if (is_a<c10::LinAlgError>(error)) throw_prefixed<c10::LinAlgError>(error, prefix);
  if (is_a<c10::EnforceFiniteError>(error)) throw_prefixed<c10::EnforceFiniteError>(error, prefix);
  throw_prefixed<c10::Error>(error, prefix);
}

}  // namespace

int exit_code_of(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kBadInput:
      return 2;
    case ErrorKind::kOutOfMemory:
    case ErrorKind::kFailure:
      return 1;
    case ErrorKind::kInternal:
      break;
  }
  return 3;
}

namespace {
constexpr EnumNames<ErrorKind, 4> kErrorKindNames{{{ErrorKind::kBadInput, "bad_input"},
                                                    {ErrorKind::kOutOfMemory, "out_of_memory"},
                                                    {ErrorKind::kFailure, "failure"},
                                                    {ErrorKind::kInternal, "internal"}}};
}  // namespace

const char* to_string(ErrorKind kind) { return enum_name(kErrorKindNames, kind); }

ErrorKind parse_error_kind(const std::string& text) {
  for (const auto& [kind, name] : kErrorKindNames) {
    if (text == name) return kind;
  }
  return ErrorKind::kInternal;
}

ErrorDescription describe_error(const std::exception& error) {
  ErrorDescription description;
  description.kind = kind_of(error);
  const auto* torch_error = dynamic_cast<const c10::Error*>(&error);
  description.line = first_line(torch_error != nullptr ? torch_error->what_without_backtrace() : error.what());
  if (description.line.empty()) description.line = "an error without a message";
  description.full_text = error.what();
  return description;
}

ErrorDescription describe_current_exception() {
  try {
    throw;
  } catch (const std::exception& error) {
    return describe_error(error);
  } catch (...) {
    return {ErrorKind::kInternal, "unknown exception", "unknown exception (not a std::exception)"};
  }
}

void throw_error_of_kind(ErrorKind kind, const std::string& message) {
  switch (kind) {
    case ErrorKind::kBadInput:
      throw std::invalid_argument(message);
    case ErrorKind::kOutOfMemory:
      throw c10::OutOfMemoryError(message);
    case ErrorKind::kFailure:
      throw std::runtime_error(message);
    case ErrorKind::kInternal:
      break;
  }
  throw std::logic_error(message);
}

void rethrow_with_context(const std::string& context) {
  const std::string prefix = context + ": ";
  try {
    throw;
  } catch (const DistributedError&) {
    throw;  // names the rank and the collective already
  } catch (const c10::Error& error) {
    rethrow_c10_prefixed(error, prefix);
  } catch (const std::bad_alloc& error) {
    throw c10::OutOfMemoryError(prefix + "out of memory (" + error.what() + ")");
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(prefix + error.what());
  } catch (const std::runtime_error& error) {
    throw std::runtime_error(prefix + error.what());
  } catch (const std::exception& error) {
    throw std::logic_error(prefix + error.what());
  } catch (...) {
    throw std::logic_error(prefix + "unknown exception (not a std::exception)");
  }
}

}  // namespace xpm
