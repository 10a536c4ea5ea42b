#include "model/pages.h"

#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>
#include <sys/mman.h>
#include <unistd.h>

#include <iterator>
#include <utility>
#include <vector>

namespace lily {

HugePages::HugePages(uint64_t bytes, const std::string& what) : bytes_(bytes) {
  // The slack before the aligned start and after the end stays mapped, unused, until the end.
  constexpr uint64_t kHuge = 2ull << 20;
  map_bytes_ = (bytes + kHuge - 1) / kHuge * kHuge + kHuge;
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw std::runtime_error("cannot allocate " + std::to_string(bytes) + " bytes for " + what + ": " +
                             std::strerror(errno));
  }
  start_ = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(map_) + kHuge - 1) & ~uintptr_t(kHuge - 1));
#if defined(MADV_HUGEPAGE)
  ::madvise(start_, (bytes + kHuge - 1) / kHuge * kHuge, MADV_HUGEPAGE);  // advice only: no huge pages is fine
#endif
}

void* huge_alloc(size_t bytes) {
  // Mapped on its own, 2 MiB-aligned: a 2 MiB-aligned block from malloc (aligned_alloc) kept up
  // to 2 MiB of address space unused before it, which a process under an address-space limit
  // (RLIMIT_AS) then lacked for its next buffers; here the slack around the aligned start is
  // unmapped at once, and the block takes its own bytes rounded up to 4 KiB pages, no more.
  // Every whole 2 MiB of it can be a huge page; the rest stays on small pages.
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t page = size_t(::sysconf(_SC_PAGESIZE)), len = (bytes + page - 1) / page * page;
  void* map = ::mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) throw std::bad_alloc();
  auto* lo = static_cast<uint8_t*>(map);
  auto* start = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(lo) + kHuge - 1) & ~uintptr_t(kHuge - 1));
  if (start > lo) ::munmap(lo, size_t(start - lo));
  if (lo + len + kHuge > start + len) ::munmap(start + len, size_t(lo + len + kHuge - (start + len)));
#if defined(MADV_HUGEPAGE)
  ::madvise(start, len, MADV_HUGEPAGE);  // advice only: no huge pages is fine
#endif
  return start;
}

void huge_free(void* p, size_t bytes) {
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  ::munmap(p, (bytes + page - 1) / page * page);
}

HugePages::~HugePages() {
  if (map_) ::munmap(map_, map_bytes_);
}

void HugePages::protect() const {
  if (::mprotect(map_, map_bytes_, PROT_READ) != 0)
    throw std::runtime_error(std::string("mprotect: ") + std::strerror(errno));
}

void HugePages::release(const uint8_t* p, uint64_t n) {
  if (n == 0) return;
  if (!contains(p) || n > uint64_t(start_ + bytes_ - p)) throw std::logic_error("HugePages::release: range outside");
  constexpr uint64_t kHuge = 2ull << 20;
  uint64_t begin = uint64_t(p - start_), end = begin + n;
  // Merge with every run it touches; remember the 2 MiB pages those runs gave back already.
  std::vector<std::pair<uint64_t, uint64_t>> given;
  auto it = released_.upper_bound(begin);
  if (it != released_.begin() && std::prev(it)->second.end >= begin) --it;
  while (it != released_.end() && it->first <= end) {
    begin = std::min(begin, it->first);
    end = std::max(end, it->second.end);
    if (it->second.given_lo < it->second.given_hi) given.emplace_back(it->second.given_lo, it->second.given_hi);
    it = released_.erase(it);
  }
  const uint64_t lo = (begin + kHuge - 1) / kHuge * kHuge, hi = end / kHuge * kHuge;
  if (lo < hi) {  // [lo, hi) minus what was given back (sub-ranges of it, in order)
    uint64_t at = lo;
    for (const auto& [glo, ghi] : given) {
      if (at < glo) discard(at, glo);
      at = std::max(at, ghi);
    }
    if (at < hi) discard(at, hi);
  }
  released_[begin] = Run{end, lo, std::max(lo, hi)};
}

void HugePages::finish_release() {
  const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  for (const auto& [begin, run] : released_) {
    const uint64_t lo = (begin + page - 1) / page * page, hi = run.end / page * page;
    if (lo >= hi) continue;
    if (run.given_lo >= run.given_hi) {
      discard(lo, hi);
    } else {  // around the 2 MiB pages given back already
      if (lo < run.given_lo) discard(lo, run.given_lo);
      if (run.given_hi < hi) discard(run.given_hi, hi);
    }
  }
}

void HugePages::discard(uint64_t lo, uint64_t hi) {
  void* at = start_ + lo;
  // Inaccessible first, then given back (MADV_DONTNEED on private anonymous memory frees it; a
  // later touch would map zeros, which PROT_NONE turns into a fault).
  if (::mprotect(at, hi - lo, PROT_NONE) != 0 || ::madvise(at, hi - lo, MADV_DONTNEED) != 0)
    throw std::runtime_error(std::string("giving pages back: ") + std::strerror(errno));
}

}  // namespace lily
