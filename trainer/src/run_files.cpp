#include "xpm/trainer/run_files.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace xpm {

void write_file_atomically(const std::string& path, const std::string& content) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  if (target.has_parent_path()) fs::create_directories(target.parent_path());
  std::string temp = path + ".tmp.XXXXXX";
  const int fd = ::mkstemp(temp.data());
  if (fd < 0) {
    throw std::runtime_error("cannot create a temporary file next to '" + path +
                             "': " + std::strerror(errno));
  }
  const char* data = content.data();
  std::size_t left = content.size();
  bool ok = true;
  while (ok && left > 0) {
    const ssize_t written = ::write(fd, data, left);
    if (written < 0 && errno == EINTR) continue;
    ok = written > 0;
    if (ok) {
      data += written;
      left -= static_cast<std::size_t>(written);
    }
  }
  const int saved_errno = errno;
  ok = ok && ::fsync(fd) == 0;
  ::fchmod(fd, 0644);
  ok = (::close(fd) == 0) && ok;
  if (!ok || std::rename(temp.c_str(), path.c_str()) != 0) {
    const std::string reason = std::strerror(errno != 0 ? errno : saved_errno);
    ::unlink(temp.c_str());
    throw std::runtime_error("cannot write '" + path + "': " + reason);
  }
}

}  // namespace xpm
