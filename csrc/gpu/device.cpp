// Backend-independent parts of the device interface (csrc/gpu/device.h).
#include "gpu/device.h"

#include <cstdio>

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

}  // namespace lily::gpu
