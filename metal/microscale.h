// MLX's microscaled quantization modes (mlx.core.quantize mode = "mxfp4" / "mxfp8" / "nvfp4"),
// decoded exactly: each element a small float code, each group one byte of scale, no bias.
//   mxfp4: e2m1 codes (4 bits), groups of 32, e8m0 scales
//   mxfp8: e4m3 codes (8 bits), groups of 32, e8m0 scales
//   nvfp4: e2m1 codes (4 bits), groups of 16, e4m3 scales
// Each mode fixes its bit width and group size, so a QuantMatrix's (bits, group) names the mode
// (quant_args.h). Codes are packed as MLX's affine ones (a little-endian bit stream in uint32
// words, low bits first), so the word loops of quant.h and gemm.h read both.
//
// The decoders build the f32 bit pattern (no tables: no constant-memory arrays to place), and
// code * scale is one rounding, as mlx.core.dequantize and the CPU backend compute it.
//
// Each matrix also has a float multiplier of its group scales (Linear::scale_mult): nvfp4's
// global scale / (448 * 6) where mx.quantize was given one (mlx-lm's switch layers with
// global_scale), else 1. A microscaled matrix has no biases, so the kernels read it from the
// matrix's biases buffer (quant_args.h); (scale * mult) * code keeps mlx.core.dequantize's order.
#pragma once
#include <metal_stdlib>
using namespace metal;

#define LILY_MICROSCALE_NAN 0x7FC00000u

// e2m1 (sign, 2 exponent bits with bias 1, 1 mantissa bit): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives.
inline float e2m1_value(uint c) {
  const uint e = (c >> 1) & 3u, m = c & 1u;
  const uint mag = e == 0u ? m * 0x3F000000u : (((e + 126u) << 23) | (m << 22));  // 0 or 0.5; 2^(e-1) * 1.m
  return as_type<float>(mag | ((c & 8u) << 28));
}

// float8 e4m3fn (sign, 4 exponent bits with bias 7, 3 mantissa bits; 0x7F / 0xFF are NaN, no
// infinities).
inline float e4m3_value(uint b) {
  const uint e = (b >> 3) & 15u, m = b & 7u;
  const float mag = (b & 0x7Fu) == 0x7Fu ? as_type<float>(LILY_MICROSCALE_NAN)
                    : e == 0u           ? float(m) * (1.0f / 512.0f)  // subnormal: m/8 * 2^-6
                                        : as_type<float>(((e + 120u) << 23) | (m << 20));
  return (b & 0x80u) != 0u ? -mag : mag;
}

// e8m0: 2^(s - 127); 255 is NaN (s = 0 is the f32 subnormal 2^-127).
inline float e8m0_value(uint s) {
  return s == 255u ? as_type<float>(LILY_MICROSCALE_NAN) : as_type<float>(s == 0u ? 0x00400000u : s << 23);
}

// A group's scale byte: e4m3 for nvfp4 (the only mode with groups of 16), e8m0 otherwise.
inline float microscale_scale(uchar s, uint group) {
  return group == 16u ? e4m3_value(uint(s)) : e8m0_value(uint(s));
}

// The matrix's scale multiplier, from where an affine matrix's biases are.
inline float microscale_mult(device const uchar* biases) { return *(device const float*)biases; }

// A BITS-wide code: e4m3 (mxfp8) or e2m1 (mxfp4, nvfp4).
template <int BITS>
inline float microscale_code(uint q) {
  return BITS == 8 ? e4m3_value(q) : e2m1_value(q);
}
