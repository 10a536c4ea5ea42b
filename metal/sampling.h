// The arithmetic of token sampling, written once for the CPU sampler (csrc/engine/sampler.cpp)
// and the GPU kernel (metal/sampling.metal), so that with the same logits and the same seed both
// pick the same token, bit for bit.
//
// Why integers: a draw compares u * total against running sums of weights. Float sums depend on
// the order of the additions (a GPU threadgroup adds in a tree, the CPU in a loop) and Metal has
// no double, so two float implementations would disagree whenever u lands within rounding of a
// boundary. Here each weight is an exact function of one logit, turned into a 64-bit fixed-point
// integer; sums of integers are the same in any order, and the draw and the top-p target are
// integer products. What is left in floating point is element-wise and uses only IEEE-exact
// operations (+, -, *, conversions), in a fixed order, with contraction into FMA disabled.
//
//   sample_key(l)         32-bit key ordered like the float l (-0 and +0 equal; no NaN)
//   sample_exp_nonpos(x)  e^x for x <= 0 (< 2 ulp), branch-free: Cody-Waite + degree-7 Taylor
//   sample_weight_scale(V)  2^shift with shift = 63 - bits(V): V weights <= 2^shift sum < 2^63
//   sample_weight(l, max, inv_t, scale)  floor(e^((l - max) * inv_t) * scale), an integer
//   sample_mulhi(a, b)    floor(a * b / 2^64) (64 x 64 -> high 64 bits, 32-bit limbs)
//   sample_rng_next(s)    xoshiro256** (Blackman & Vigna); the state is seeded by splitmix64
//
// A weight below 2^-shift of the best token's (e^-31 at a 248K vocabulary) is 0: such a token is
// never drawn. Over the whole vocabulary that mass is below V * 2^-shift < 2^-44 of the total.
#pragma once

#if defined(__METAL_VERSION__) || defined(LILY_MSL_PRELUDE)
// Kernel side: MSL, or MSL compiled as C++ by the MSL-on-CPU / MSL-on-CUDA runtimes.
#if defined(__METAL_VERSION__) && __METAL_VERSION__ >= 320
// Metal compiles with fast math by default, which may reassociate and contract the float steps
// below; the bit-exact agreement with the CPU needs IEEE semantics (MSL 3.2 pragmas).
#pragma METAL fp math_mode(safe)
#pragma METAL fp contract(off)
#endif
typedef ulong lily_u64;
typedef uint lily_u32;
#define LILY_SAMPLE_THREAD thread
inline float lily_sample_as_float(lily_u32 bits) { return metal::as_type<float>(bits); }
inline lily_u32 lily_sample_as_bits(float f) { return metal::as_type<lily_u32>(f); }
inline float lily_sample_rint(float x) { return metal::rint(x); }
#else
// Host side: plain C++17 (no includes, so the MSL lint sees no host library here).
typedef __UINT64_TYPE__ lily_u64;  // = std::uint64_t
typedef __UINT32_TYPE__ lily_u32;
#define LILY_SAMPLE_THREAD
inline float lily_sample_as_float(lily_u32 bits) { return __builtin_bit_cast(float, bits); }
inline lily_u32 lily_sample_as_bits(float f) { return __builtin_bit_cast(lily_u32, f); }
inline float lily_sample_rint(float x) { return __builtin_rintf(x); }
#endif

#if defined(__clang__) || defined(__METAL_VERSION__)
#define LILY_SAMPLE_NO_CONTRACT _Pragma("clang fp contract(off)")
#else
#define LILY_SAMPLE_NO_CONTRACT  // gcc: the host build passes -ffp-contract=off
#endif

// Order-preserving key of a float that is not NaN: larger float, larger key. -0 maps to +0's
// key, so ties between them break by id as the float comparison does. Integer-only, so fast
// math cannot fold it.
inline lily_u32 sample_key(float l) {
  lily_u32 b = lily_sample_as_bits(l);
  b = b == 0x80000000u ? 0u : b;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

#define LILY_SAMPLE_KEY_NEG_INF 0x007FFFFFu  // sample_key(-inf)

// NaN or +inf (by the bits: a fast-math compiler may assume isnan() false).
inline bool sample_is_bad(float l) {
  const lily_u32 b = lily_sample_as_bits(l);
  return (b & 0x7F800000u) == 0x7F800000u && b != 0xFF800000u;
}

// The float a key came from (+0 for zero).
inline float sample_key_value(lily_u32 key) {
  return lily_sample_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// e^x for x <= 0 (below -87, and -inf, give 0). n = rint(x / ln2); r = x - n ln2 in two parts
// (Cody-Waite) so |r| <= ln2/2; e^r by its Taylor series to r^7 (truncation < 6e-9 relative);
// 2^n built in the exponent bits. No libm call (rint is one instruction), so the CPU loop
// vectorizes.
inline float sample_exp_nonpos(float x) {
  LILY_SAMPLE_NO_CONTRACT
  const bool under = !(x >= -87.0f);
  x = under ? -87.0f : x;
  const float n = lily_sample_rint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float scale = lily_sample_as_float(lily_u32(int(n) + 127) << 23);
  return under ? 0.0f : p * scale;
}

// 2^(63 - bits(V)) as a float (exact): the fixed-point scale of the weights of a V-token
// vocabulary, so that V of them (each <= the scale) add up below 2^63.
inline float sample_weight_scale(lily_u32 vocab) {
  lily_u32 bits = 0;
  while (bits < 32 && (vocab >> bits) != 0) ++bits;
  return lily_sample_as_float(lily_u32(127 + 63 - int(bits)) << 23);
}

// A token's integer weight: e^((l - max) / T) in fixed point (scale from sample_weight_scale).
inline lily_u64 sample_weight(float l, float max_logit, float inv_t, float scale) {
  LILY_SAMPLE_NO_CONTRACT
  const float w = sample_exp_nonpos((l - max_logit) * inv_t) * scale;
  return lily_u64(w);  // truncation: exact integer part of a float < 2^63
}

// floor(a * b / 2^64).
inline lily_u64 sample_mulhi(lily_u64 a, lily_u64 b) {
  const lily_u64 a0 = a & 0xFFFFFFFFu, a1 = a >> 32, b0 = b & 0xFFFFFFFFu, b1 = b >> 32;
  const lily_u64 p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
  const lily_u64 mid = (p00 >> 32) + (p01 & 0xFFFFFFFFu) + (p10 & 0xFFFFFFFFu);
  return p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
}

// xoshiro256**: advances the state s[4] and returns the next 64 random bits.
inline lily_u64 sample_rng_next(LILY_SAMPLE_THREAD lily_u64* s) {
  const lily_u64 x = s[1] * 5;
  const lily_u64 result = ((x << 7) | (x >> 57)) * 9;
  const lily_u64 t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = (s[3] << 45) | (s[3] >> 19);
  return result;
}
