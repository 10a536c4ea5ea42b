#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "model/error.h"
#include "model/json.h"

namespace lily {

namespace {

// Headers of real checkpoints are well under 1 MiB; the bound keeps a hostile length from
// making us parse gigabytes of JSON.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

int64_t stat_mtime_ns(const struct stat& st) {
#if defined(__APPLE__)
  return int64_t(st.st_mtimespec.tv_sec) * 1000000000 + st.st_mtimespec.tv_nsec;
#else
  return int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
#endif
}

}  // namespace

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::F64: return "F64";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::I16: return "I16";
    case DType::I8: return "I8";
    case DType::U64: return "U64";
    case DType::U32: return "U32";
    case DType::U16: return "U16";
    case DType::U8: return "U8";
    case DType::Bool: return "BOOL";
  }
  return "?";
}

bool dtype_from_name(const std::string& s, DType* out) {
  static const std::pair<const char*, DType> table[] = {
      {"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16}, {"F64", DType::F64},
      {"I64", DType::I64}, {"I32", DType::I32}, {"I16", DType::I16},   {"I8", DType::I8},
      {"U64", DType::U64}, {"U32", DType::U32}, {"U16", DType::U16},   {"U8", DType::U8},
      {"BOOL", DType::Bool}};
  for (const auto& [name, t] : table)
    if (s == name) { *out = t; return true; }
  return false;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile::SafetensorsFile(const std::string& path, Residency residency)
    : path_(path), residency_(residency) {
  auto fail = [&](const std::string& what) -> void {
    throw CheckpointError("[safetensors] " + path_ + ": " + what);
  };
  // O_NONBLOCK: opening a FIFO (a hostile "model.safetensors") would otherwise block until a
  // writer appears, deaf to Ctrl-C. The descriptor is checked to be a regular file before any
  // read; reads of a regular file ignore the flag.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) fail(errno == ELOOP ? std::string("is a symbolic link loop")
                                   : std::string("cannot open: ") + std::strerror(errno));
  struct stat st;
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    const bool fifo = S_ISFIFO(st.st_mode), dir = S_ISDIR(st.st_mode);
    ::close(fd_);
    fd_ = -1;
    fail(fifo ? "is a FIFO, not a regular file" : dir ? "is a directory, not a regular file" : "not a regular file");
  }
  size_ = uint64_t(st.st_size);
  ident_dev_ = uint64_t(st.st_dev);
  ident_ino_ = uint64_t(st.st_ino);
  ident_mtime_ns_ = stat_mtime_ns(st);
  try {
    if (size_ < 8) fail("file is " + std::to_string(size_) + " bytes, too short for a header");
    uint8_t len_bytes[8];
    read_exact(0, len_bytes, 8);
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = header_len << 8 | len_bytes[i];
    // (The value is printed only when plausible: for any other file its 8 bytes are just the
    // file's first bytes, which an error message must not echo.)
    if (header_len > kMaxHeaderBytes)
      fail("not a safetensors file: its first 8 bytes do not give a header length under " +
           std::to_string(kMaxHeaderBytes >> 20) + " MiB");
    if (header_len > size_ - 8)
      fail("header length " + std::to_string(header_len) + " runs past the end of the file (" +
           std::to_string(size_) + " bytes): truncated or not a safetensors file");
    data_size_ = size_ - 8 - header_len;
    {
      std::vector<uint8_t> header(header_len);
      read_exact(8, header.data(), header_len);
      parse_header(header.data(), header_len);
    }
    if (residency_ == Residency::Mapped) {
      map_ = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
      if (map_ == MAP_FAILED) {
        map_ = nullptr;
        fail(std::string("mmap failed: ") + std::strerror(errno));
      }
      map_bytes_ = size_;
      base_ = static_cast<const uint8_t*>(map_);
    } else {
      read_resident();
      ::close(fd_);  // nothing reads the file again
      fd_ = -1;
    }
    data_ = base_ + 8 + header_len;
  } catch (...) {
    unmap();
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { unmap(); }

void SafetensorsFile::unmap() {
  if (map_) ::munmap(map_, map_bytes_);
  resident_.reset();
  if (fd_ >= 0) ::close(fd_);
  map_ = nullptr;
  base_ = data_ = nullptr;
  fd_ = -1;
}

void SafetensorsFile::read_exact(uint64_t offset, void* dst, uint64_t n) const {
  auto* out = static_cast<uint8_t*>(dst);
  while (n > 0) {
    // Bounded chunks: Linux returns at most ~2 GiB per read anyway.
    const ssize_t got = ::pread(fd_, out, size_t(std::min<uint64_t>(n, 1ull << 30)), off_t(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0)
      throw CheckpointError("[safetensors] " + path_ + ": read failed at byte " + std::to_string(offset) + ": " +
                            std::strerror(errno));
    if (got == 0)
      throw CheckpointError("[safetensors] " + path_ + ": file ended at byte " + std::to_string(offset) + " of " +
                            std::to_string(size_) + " while reading (truncated while loading?)");
    out += got;
    offset += uint64_t(got);
    n -= uint64_t(got);
  }
}

void SafetensorsFile::read_resident() {
  try {
    resident_ = std::make_unique<HugePages>(size_, "the file's copy");
  } catch (const std::runtime_error& e) {
    throw CheckpointError("[safetensors] " + path_ + ": " + e.what() + " (load it mapped instead: use_mmap=True)");
  }
  read_exact(0, resident_->data(), size_);
  resident_->protect();  // read-only from here, as the mapping would be
  base_ = resident_->data();
}

void SafetensorsFile::release(const uint8_t* p, uint64_t n) {
  if (!resident_) throw std::logic_error("release: a mapped file's pages are the page cache's");
  resident_->release(p, n);
}

void SafetensorsFile::finish_release() {
  if (resident_) resident_->finish_release();
}

void SafetensorsFile::parse_header(const uint8_t* bytes, uint64_t header_len) {
  auto fail = [&](const std::string& what) -> void {
    throw CheckpointError("[safetensors] " + path_ + ": " + what);
  };
  json::Value root;
  try {
    root = json::parse(std::string_view(reinterpret_cast<const char*>(bytes), header_len));
  } catch (const Error& e) {
    fail(std::string("malformed header: ") + e.what());
  }
  if (!root.is_object()) fail("header is not a JSON object");

  for (const auto& [name, entry] : root.object) {
    if (name == "__metadata__") continue;
    const std::string where = "tensor '" + name + "'";
    if (!entry.is_object()) fail(where + ": entry is not an object");
    const json::Value* dt = entry.find("dtype");
    const json::Value* shape = entry.find("shape");
    const json::Value* offs = entry.find("data_offsets");
    if (!dt || !dt->is_string()) fail(where + ": missing dtype");
    if (!shape || !shape->is_array()) fail(where + ": missing shape");
    if (!offs || !offs->is_array() || offs->array.size() != 2) fail(where + ": data_offsets must be [begin, end]");
    TensorInfo t;
    t.name = name;
    // FP8 (Qwen's official FP8 releases: F8_E4M3 weights + weight_scale_inv block scales) has no
    // kernel here; lily convert dequantizes it into an MLX checkpoint.
    if (dt->string.rfind("F8_", 0) == 0)
      fail(where + ": dtype " + dt->string + " is FP8; lily runs FP8 checkpoints after `lily convert SRC --out DST` "
           "turns them into MLX affine 4/8-bit");
    if (!dtype_from_name(dt->string, &t.dtype)) fail(where + ": unknown dtype '" + dt->string + "'");
    // numel * itemsize with overflow checks: a hostile shape must not wrap around.
    uint64_t nbytes = dtype_size(t.dtype);
    for (const json::Value& d : shape->array) {
      if (d.kind != json::Value::Kind::Number || !d.is_integer || d.integer < 0)
        fail(where + ": shape entries must be non-negative integers");
      t.shape.push_back(d.integer);
      if (d.integer != 0 && nbytes > UINT64_MAX / uint64_t(d.integer)) fail(where + ": shape overflows");
      nbytes *= uint64_t(d.integer);
    }
    const json::Value& b = offs->array[0];
    const json::Value& e = offs->array[1];
    if (!b.is_integer || !e.is_integer || b.integer < 0 || e.integer < b.integer)
      fail(where + ": data_offsets must be non-negative integers with begin <= end");
    if (uint64_t(e.integer) > data_size_)
      fail(where + ": data ends at byte " + std::to_string(e.integer) + " of a data section of " +
           std::to_string(data_size_) + " bytes (truncated file or lying header)");
    if (uint64_t(e.integer - b.integer) != nbytes)
      fail(where + ": holds " + std::to_string(e.integer - b.integer) + " bytes but dtype x shape needs " +
           std::to_string(nbytes));
    t.begin = uint64_t(b.integer);
    t.nbytes = nbytes;
    index_[t.name] = tensors_.size();
    tensors_.push_back(std::move(t));
  }

  // No two tensors may share bytes (a lying header could alias weights).
  std::vector<const TensorInfo*> order;
  for (const auto& t : tensors_) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  // Compare each tensor with the one reaching furthest so far, not just its sorted neighbour:
  // an empty tensor placed inside another must not hide the overlap of the two around it.
  const TensorInfo* far = nullptr;
  for (const TensorInfo* t : order) {
    if (!t->nbytes) continue;
    if (far && far->begin + far->nbytes > t->begin)
      fail("tensors '" + far->name + "' and '" + t->name + "' overlap");
    if (!far || t->begin + t->nbytes > far->begin + far->nbytes) far = t;
  }
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void SafetensorsFile::check_unchanged() const {
  if (residency_ == Residency::Resident) return;
  struct stat st;
  if (::stat(path_.c_str(), &st) != 0)
    throw CheckpointError("[safetensors] " + path_ + ": file disappeared after it was loaded");
  if (uint64_t(st.st_size) != size_ || uint64_t(st.st_ino) != ident_ino_ ||
      uint64_t(st.st_dev) != ident_dev_ || stat_mtime_ns(st) != ident_mtime_ns_)
    throw CheckpointError("[safetensors] " + path_ +
                          ": file was modified or replaced after it was loaded (size " +
                          std::to_string(size_) + " -> " + std::to_string(st.st_size) + ")");
}

}  // namespace lily
