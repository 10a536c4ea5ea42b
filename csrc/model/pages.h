// Anonymous memory for weights that decode streams once per token: aligned to 2 MiB and advised
// for transparent huge pages (safetensors.h says why), read-only once filled, and with ranges
// that can be handed back to the OS while the rest stays.
//
// Users: resident safetensors files (the loader's copy of a file) and cpu::arrange_for_int8 (its
// rearranged copy of the int8 kernels' matrices, after which the file copy's pages under those
// matrices are handed back).
#pragma once
#include <cstdint>
#include <map>
#include <string>

namespace lily {

class HugePages {
 public:
  // `what` names the memory in errors. Throws std::runtime_error when the memory is not there.
  HugePages(uint64_t bytes, const std::string& what);
  ~HugePages();
  HugePages(const HugePages&) = delete;
  HugePages& operator=(const HugePages&) = delete;

  uint8_t* data() const { return start_; }
  uint64_t size() const { return bytes_; }
  bool contains(const uint8_t* p) const { return p >= start_ && p < start_ + bytes_; }

  // Read-only from here: a stray write faults instead of corrupting weights.
  void protect() const;
  // Marks [p, p + n) (inside this memory) as read no more. Every 2 MiB page whose bytes are all
  // marked goes back to the OS at once, whole: the next huge-page fault (the copy being filled
  // while this one is released) can take it as it is, where pages given back in 4 KiB pieces
  // would leave it fresh pages to zero (on the 2-core VM about 1 s per GB: docs/performance.md,
  // "One stream per thread").
  // finish_release() then gives back the smaller pages whose bytes are all marked. Pages given
  // back are inaccessible: a stray read faults rather than reading zeros.
  void release(const uint8_t* p, uint64_t n);
  void finish_release();

 private:
  void discard(uint64_t lo, uint64_t hi);  // offsets, page-aligned
  // The marked bytes, as merged runs: begin -> {end, [given_lo, given_hi): the run's whole 2 MiB
  // pages given back so far}.
  struct Run {
    uint64_t end, given_lo, given_hi;
  };
  std::map<uint64_t, Run> released_;

  void* map_ = nullptr;  // what munmap releases: the aligned start, with slack on either side
  uint64_t map_bytes_ = 0;
  uint8_t* start_ = nullptr;
  uint64_t bytes_ = 0;
};

}  // namespace lily
