// xpm/planner/atomic_file.hpp — write a file so that readers see the old content or the new,
// never a half-written file.
//
//   write_file_atomically("run/summary.json", summary.dump(2));
#pragma once

#include <string>

namespace xpm {

/// Writes `content` to `path` atomically: a temporary file next to it (same folder, so the
/// rename stays on one file system), written, fsync'ed, mode 0644, then renamed over `path`.
/// Does not create folders. Throws std::runtime_error "cannot write '<path>': <step>: <reason>";
/// on failure the temporary file is removed and `path` is untouched.
void write_file_atomically(const std::string& path, const std::string& content);

}  // namespace xpm
