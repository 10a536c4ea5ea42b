// HazardTracker: see hazards.h.
#include "gpu/hazards.h"

namespace lily::gpu {
namespace {

bool overlap(const Access& a, const Access& b) {
  return a.buffer == b.buffer && a.begin < b.end && b.begin < a.end;
}
bool any_overlap(const std::vector<Access>& xs, const std::vector<Access>& ys) {
  for (const Access& x : xs)
    for (const Access& y : ys)
      if (overlap(x, y)) return true;
  return false;
}

}  // namespace

bool HazardTracker::conflicts(const std::vector<Access>& reads,
                              const std::vector<Access>& writes) const {
  return any_overlap(reads, writes_)      // read after write
         || any_overlap(writes, writes_)  // write after write
         || any_overlap(writes, reads_);  // write after read
}

void HazardTracker::add(const std::vector<Access>& reads, const std::vector<Access>& writes) {
  reads_.insert(reads_.end(), reads.begin(), reads.end());
  writes_.insert(writes_.end(), writes.begin(), writes.end());
}

void HazardTracker::barrier() {
  reads_.clear();
  writes_.clear();
}

bool HazardTracker::dispatch(ComputeEncoder& encoder, Size3 threadgroups, Size3 threads,
                             const std::vector<Access>& reads, const std::vector<Access>& writes) {
  const bool edge = conflicts(reads, writes);
  if (edge) {
    encoder.memory_barrier();
    barrier();
  }
  encoder.dispatch_threadgroups(threadgroups, threads);
  add(reads, writes);
  return edge;
}

}  // namespace lily::gpu
