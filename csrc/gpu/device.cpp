// Backend-independent parts of the device interface (csrc/gpu/device.h).
#include "gpu/device.h"

#include <cstdio>
#include <cstring>

#include "model/error.h"

namespace lily::gpu {

FunctionConstants& FunctionConstants::set(uint32_t index, ConstantType type, double value) {
  for (auto& v : values_) {
    if (v.index == index) {
      v = {index, type, value};
      return *this;
    }
  }
  values_.push_back({index, type, value});
  return *this;
}

std::string FunctionConstants::key() const {
  static const char* tags = "biusUfh";  // by ConstantType: Bool Int UInt Short UShort Float Half
  std::string out;
  for (const auto& v : values_) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%u:%c=%.17g;", v.index, tags[static_cast<int>(v.type)],
                  v.value);
    out += buf;
  }
  return out;
}

void check_buffer_range(size_t length, size_t offset, size_t n, const char* what) {
  if (offset > length || n > length - offset)
    throw Error(std::string("[gpu] Buffer::") + what + ": " + std::to_string(n) + " bytes at offset " +
                std::to_string(offset) + " do not fit in a buffer of " + std::to_string(length));
}

namespace {
// The bytes [offset, offset + n) of b's shared storage, checked.
uint8_t* span(Buffer& b, size_t offset, size_t n, const char* what) {
  check_buffer_range(b.length(), offset, n, what);
  auto* p = static_cast<uint8_t*>(b.contents());
  if (!p && n)
    throw Error(std::string("[gpu] Buffer::") + what + ": this buffer has no host storage and its "
                "device does not implement " + what);
  return p + offset;
}
}  // namespace

void Buffer::write(size_t offset, const void* data, size_t n) {
  if (n) std::memcpy(span(*this, offset, n, "write"), data, n);
}
void Buffer::read(size_t offset, void* data, size_t n) {
  if (n) std::memcpy(data, span(*this, offset, n, "read"), n);
}
void Buffer::fill(size_t offset, uint8_t value, size_t n) {
  if (n) std::memset(span(*this, offset, n, "fill"), value, n);
}
void Device::copy(Buffer& dst, size_t dst_offset, Buffer& src, size_t src_offset, size_t n) {
  if (n) std::memmove(span(dst, dst_offset, n, "copy"), span(src, src_offset, n, "copy"), n);
}

}  // namespace lily::gpu
