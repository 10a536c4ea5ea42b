// Anonymous memory for weights that decode streams once per token: aligned to 2 MiB and advised
// for transparent huge pages (safetensors.h says why), read-only once filled, and with ranges
// that can be handed back to the OS while the rest stays.
//
// Users: resident safetensors files (the loader's copy of a file) and cpu::arrange_for_int8 (its
// rearranged copy of the int8 kernels' matrices, after which the file copy's pages under those
// matrices are handed back).
// HugePageAllocator (below) puts the CPU backend's per-sequence state on the same kind of pages:
// its KV caches and DeltaNet states, which a decode step also reads once per token.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

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

// Blocks of 2 MiB or more, mapped on their own: 2 MiB-aligned and advised for transparent huge
// pages before their first touch. huge_free(p, bytes) takes back what huge_alloc(bytes) gave.
// Throws std::bad_alloc when the memory is not there.
void* huge_alloc(size_t bytes);
void huge_free(void* p, size_t bytes);

// An allocator for the state a decode step walks through once per token, as it does the weights
// (KV caches, DeltaNet states): from 2 MiB on, on huge pages (huge_alloc); smaller blocks as
// std::allocator gives them. Why: on 4 KiB pages a layer's 16 MB of K and V at 4K positions is
// 4,096 pages, past the second-level TLB, and each of attention's blocks (32 KB of K, 32 KB of V)
// crossed eight of them; on the 2-core Xeon VM the decode step's attention ran ~7% faster on huge
// pages (docs/performance.md, "Attention's stalls").
template <class T>
struct HugePageAllocator {
  using value_type = T;
  static constexpr size_t kHuge = size_t(2) << 20;
  HugePageAllocator() = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) {}
  T* allocate(size_t n) {
    if (n * sizeof(T) < kHuge) return std::allocator<T>().allocate(n);
    return static_cast<T*>(huge_alloc(n * sizeof(T)));
  }
  void deallocate(T* p, size_t n) {
    if (n * sizeof(T) < kHuge) std::allocator<T>().deallocate(p, n);
    else huge_free(p, n * sizeof(T));
  }
  template <class U>
  bool operator==(const HugePageAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const HugePageAllocator<U>&) const { return false; }
};
using HugeFloats = std::vector<float, HugePageAllocator<float>>;

}  // namespace lily
