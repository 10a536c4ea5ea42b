// FileWatch (see file_watch.h for why): inotify on Linux, "always maybe changed" elsewhere.
#include "model/file_watch.h"

#include <unistd.h>

#include <cerrno>

#if defined(__linux__)
#include <sys/inotify.h>
#endif

namespace lily {

#if defined(__linux__)

FileWatch::FileWatch(const std::vector<std::string>& paths) {
  fd_ = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  if (fd_ < 0) return;
  // File: contents (write, truncate), metadata (mtime via utimes, link count: unlink, rename
  // over it). Folder: entries appearing, vanishing or moving, and the folder itself moving.
  // Not IN_MODIFY on the folder, which would report every write to any file in it.
  const uint32_t file_mask = IN_MODIFY | IN_ATTRIB | IN_DELETE_SELF | IN_MOVE_SELF;
  const uint32_t dir_mask = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF;
  for (const std::string& p : paths) {
    const size_t slash = p.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : p.substr(0, slash);
    if (inotify_add_watch(fd_, p.c_str(), file_mask) < 0 || inotify_add_watch(fd_, dir.c_str(), dir_mask) < 0) {
      ::close(fd_);
      fd_ = -1;
      return;
    }
  }
}

FileWatch::~FileWatch() {
  if (fd_ >= 0) ::close(fd_);
}

bool FileWatch::maybe_changed() const {
  if (fd_ < 0) return true;
  // Events are read and dropped: which file it was does not matter, the caller stats them all.
  alignas(struct inotify_event) char buf[4096];
  bool any = false;
  for (;;) {
    const ssize_t n = ::read(fd_, buf, sizeof buf);
    if (n > 0) {
      any = true;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    // EAGAIN: the queue is empty. Any other error: cannot tell, so say "maybe".
    return any || !(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
  }
}

#else

FileWatch::FileWatch(const std::vector<std::string>&) {}
FileWatch::~FileWatch() {}
bool FileWatch::maybe_changed() const { return true; }

#endif

}  // namespace lily
