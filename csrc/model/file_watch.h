// FileWatch: "has anything happened to these files since I last asked?" for one non-blocking
// read, however many files there are.
//
// The engine must not read a checkpoint file that was truncated under its mapping (the read
// would SIGBUS), so it used to stat() every shard before every decode step. That is one path
// lookup per shard per token. On Linux an inotify instance watches each mapped file (write,
// truncate, metadata and link-count changes, so an unlink or a rename over it too) and the folder
// that holds it (entries created, removed or renamed: a path re-pointed at another file). A
// check is then one read() that finds the queue empty; only when an event is queued does the
// caller stat the files, which stays the single source of truth (an event on an unrelated file of
// the folder costs one stat and nothing else).
//
// The events are queued by the kernel inside the syscall that changes the file, so a change
// made before a check returns is always seen by that check: there is no race with a watcher
// thread, because there is none. What inotify cannot see (a folder higher up renamed, a
// network filesystem changed by another machine) leaves the mapping itself valid; the full stat
// that Engine::prefill and the start of a generation make still catches it.
//
// Elsewhere (macOS for now; kqueue could do the same) and when inotify is unavailable (out of
// instances or watches), maybe_changed() is always true and every check stats, as before.
#pragma once
#include <string>
#include <vector>

namespace lily {

class FileWatch {
 public:
  // Never throws: a watch that cannot be set up is inactive (always "maybe changed").
  explicit FileWatch(const std::vector<std::string>& paths);
  ~FileWatch();
  FileWatch(const FileWatch&) = delete;
  FileWatch& operator=(const FileWatch&) = delete;

  bool active() const { return fd_ >= 0; }
  // Drains the event queue. False: no event since the previous call, so none of the files
  // changed. True: something may have changed (or the watch is inactive); stat to know.
  bool maybe_changed() const;

 private:
  int fd_ = -1;
};

}  // namespace lily
