// Size arithmetic on untrusted numbers (config.json fields, safetensors shapes): every product
// and sum in 64 bits with an overflow check, and a range check before a result is narrowed to
// the int a dimension is stored in. A signed overflow is undefined behaviour (head_dim 1e9 made
// 2 * n_heads * head_dim wrap to a negative matrix size); here it is a ConfigError naming what.
#pragma once
#include <cstdint>
#include <limits>
#include <string>

#include "model/error.h"

namespace lily {

// a * b, or ConfigError("[config] <what> overflows") when it leaves int64.
inline int64_t checked_mul(int64_t a, int64_t b, const std::string& what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw ConfigError("[config] " + what + " overflows 64 bits");
  return r;
}

inline int64_t checked_add(int64_t a, int64_t b, const std::string& what) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) throw ConfigError("[config] " + what + " overflows 64 bits");
  return r;
}

// v as the int a dimension is stored in, or ConfigError naming `what` and the value.
inline int checked_dim(int64_t v, const std::string& what) {
  if (v < 0 || v > std::numeric_limits<int>::max())
    throw ConfigError("[config] " + what + " is " + std::to_string(v) + ", outside [0, 2^31)");
  return int(v);
}

// a * b for byte counts that are only compared against a limit: saturates at UINT64_MAX instead
// of wrapping, so an absurd size reads as "too big", never as small.
inline uint64_t saturating_mul(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<uint64_t>::max() : r;
}

inline uint64_t saturating_add(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_add_overflow(a, b, &r) ? std::numeric_limits<uint64_t>::max() : r;
}

}  // namespace lily
