// safetensors files: memory-mapped, or read once into private memory.
//
// Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
// data_offsets: [begin, end]}, "__metadata__": {...}}, then the data section. Everything in the
// header is untrusted: every offset is checked against the file size, every byte count against
// dtype x shape (with overflow checks), and tensors may not overlap. A file that fails any check
// is a CheckpointError naming the file and tensor; nothing is read before validation passes.
//
// Two residencies, chosen per load:
// - Mapped: a read-only shared mapping, so weights cost no private memory and pages are faulted
//   in from the page cache as kernels touch them. The file's identity (device, inode, size,
//   mtime) is recorded at open, so a file replaced or truncated later can be detected
//   (check_unchanged) before a read of a vanished page would SIGBUS.
// - Resident: the file is read into anonymous memory advised for 2 MiB transparent huge pages.
//   Why: batch-1 decode streams every weight once per token, and from page-cache pages (4 KiB)
//   it runs ~30% below the same loop over huge pages (TLB misses; hardware prefetchers stop at
//   4 KiB boundaries) — measured in docs/performance.md. It costs load time and private memory,
//   and the file may then change or vanish without harm.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/dtype.h"
#include "model/pages.h"

namespace lily {

struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offset in the data section
  uint64_t nbytes = 0;

  int64_t numel() const;
};

enum class Residency { Mapped, Resident };

class SafetensorsFile {
 public:
  // Opens and validates the header, then maps or reads the file; throws CheckpointError on any
  // inconsistency (nothing past the header is touched before validation passes).
  explicit SafetensorsFile(const std::string& path, Residency residency = Residency::Mapped);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return size_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // nullptr when absent.
  const TensorInfo* find(const std::string& name) const;
  const uint8_t* data(const TensorInfo& t) const { return data_ + t.begin; }
  // The whole file's bytes, page-aligned and read-only (GPU backends wrap it as one zero-copy
  // buffer).
  const void* mapping() const { return base_; }
  // Where the data section starts in mapping() (8 + the header's length: unpadded headers, as
  // mlx's writer leaves them, put it at any byte) and its length.
  uint64_t data_offset() const { return uint64_t(data_ - base_); }
  uint64_t data_size() const { return data_size_; }
  Residency residency() const { return residency_; }
  // Resident files: whether p lies in the file's copy, and [p, p + n) marked as read no more, its
  // pages handed back to the OS (pages.h: HugePages::release, finish_release), for a backend
  // that has copied those bytes into a layout of its own (cpu::arrange_for_int8).
  bool holds(const uint8_t* p) const { return resident_ && resident_->contains(p); }
  void release(const uint8_t* p, uint64_t n);
  void finish_release();

  // Mapped files: throws CheckpointError if the file on disk is no longer the one that was
  // mapped (size, inode or modification time changed): reading a truncated mapping would
  // SIGBUS. Resident files hold their own copy, so there is nothing to check.
  void check_unchanged() const;

 private:
  void parse_header(const uint8_t* bytes, uint64_t header_len);
  void read_exact(uint64_t offset, void* dst, uint64_t n) const;
  void read_resident();
  void unmap();  // the mapping or the copy, and the descriptor

  std::string path_;
  Residency residency_;
  int fd_ = -1;
  void* map_ = nullptr;         // Mapped: what munmap releases
  uint64_t map_bytes_ = 0;
  std::unique_ptr<HugePages> resident_;  // Resident: the file's copy
  const uint8_t* base_ = nullptr;  // the file's first byte in memory
  uint64_t size_ = 0;
  const uint8_t* data_ = nullptr;  // start of the data section
  uint64_t data_size_ = 0;
  uint64_t ident_dev_ = 0, ident_ino_ = 0;
  int64_t ident_mtime_ns_ = 0;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace lily
