// xpm/trainer/run_files.hpp — writing the run folder's files without ever leaving a
// half-written one.
#pragma once

#include <string>

namespace xpm {

/// Writes `content` to `path` atomically: a temporary file in the same folder, flushed and
/// fsync'ed, then renamed over `path`. Creates missing parent folders. Throws
/// std::runtime_error naming the path on failure (the temporary file is removed).
void write_file_atomically(const std::string& path, const std::string& content);

}  // namespace xpm
