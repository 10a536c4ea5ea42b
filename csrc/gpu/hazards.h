// Barriers only at real data edges, for concurrent compute encoders.
//
// In a MTLDispatchTypeConcurrent encoder, dispatches between two memory barriers may run in any
// order or overlap. The encoding code declares, for each dispatch, the byte ranges it reads and
// writes; HazardTracker says whether the dispatch depends on one encoded since the last
// barrier — it reads what one wrote (read after write), writes what one wrote (write after
// write) or writes what one read (write after read) — and only then is a memory_barrier()
// placed. Decode steps made of many small independent dispatches keep their overlap; a real
// edge is never missed as long as the declarations are right, which the msl_cpu
// dependency-check mode verifies by running each group of "independent" dispatches in reverse.
#pragma once
#include <cstddef>
#include <vector>

#include "gpu/device.h"

namespace lily::gpu {

// Bytes [begin, end) of one buffer.
struct Access {
  const Buffer* buffer = nullptr;
  size_t begin = 0, end = 0;
};

class HazardTracker {
 public:
  // Whether a dispatch with these accesses must wait for the ones encoded since the last
  // barrier. Call barrier() when one is placed, then add() the dispatch.
  bool conflicts(const std::vector<Access>& reads, const std::vector<Access>& writes) const;
  void add(const std::vector<Access>& reads, const std::vector<Access>& writes);
  void barrier();

  // Encode one dispatch with the barrier it needs (if any); returns whether one was placed.
  bool dispatch(ComputeEncoder& encoder, Size3 threadgroups, Size3 threads,
                const std::vector<Access>& reads, const std::vector<Access>& writes);

 private:
  std::vector<Access> reads_, writes_;  // since the last barrier
};

}  // namespace lily::gpu
