// Element types found in checkpoints, and the scalar conversions the CPU paths need.
// bf16 -> f32 is exact (a shift); f16 -> f32 is exact; both are written portably so the
// same code builds with gcc (which lacks __bf16 arithmetic) and Apple clang.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace lily {

enum class DType : uint8_t { F32, F16, BF16, F64, I64, I32, I16, I8, U64, U32, U16, U8, Bool };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64: case DType::I64: case DType::U64: return 8;
    case DType::F32: case DType::I32: case DType::U32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: case DType::U16: return 2;
    default: return 1;
  }
}

const char* dtype_name(DType t);
// Parses a safetensors dtype string ("F32", "BF16", ...); returns false when unknown.
bool dtype_from_name(const std::string& s, DType* out);

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do { ++e; man <<= 1; } while ((man & 0x400) == 0);
      bits = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3FF) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// f32 -> f16, rounding to nearest even (so exact for every value f16_to_f32 gives): a GPU
// backend's f16 KV cache written back from a saved session's f32 tensors.
inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return sign | 0x7C00 | (ax > 0x7F800000u ? 0x200 : 0);  // inf, nan
  if (ax >= 0x477FF000u) return sign | 0x7C00;  // >= 65520 rounds past the largest half
  if (ax < 0x38800000u) {  // below 2^-14: a subnormal half, in units of 2^-24 (scaling is exact)
    float v;
    std::memcpy(&v, &ax, 4);
    return sign | uint16_t(std::nearbyint(v * 16777216.0f));
  }
  const uint32_t rounded = ax + 0xFFFu + ((ax >> 13) & 1u);  // to nearest even at bit 13
  return sign | uint16_t((rounded - 0x38000000u) >> 13);     // rebias the exponent 127 -> 15
}

// Reads element i of a float-typed buffer (F32, F16 or BF16) as f32.
inline float load_as_f32(const void* base, DType t, size_t i) {
  switch (t) {
    case DType::F32: { float f; std::memcpy(&f, static_cast<const char*>(base) + 4 * i, 4); return f; }
    case DType::BF16: { uint16_t v; std::memcpy(&v, static_cast<const char*>(base) + 2 * i, 2); return bf16_to_f32(v); }
    case DType::F16: { uint16_t v; std::memcpy(&v, static_cast<const char*>(base) + 2 * i, 2); return f16_to_f32(v); }
    default: return 0.0f;
  }
}

inline bool is_float_dtype(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; }

}  // namespace lily
