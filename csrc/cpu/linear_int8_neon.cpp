// The int8 row kernels of linear_int8.cpp for arm64 (NEON): MLX affine 4/8-bit weights against
// int8 activations, for 1..8 tokens per pass over the weights (decode, small expert groups).
// Larger chunks (prefill) run as passes of 8 tokens: the token-vector GEMM of linear_int8.cpp
// is AVX-512 only (int8_gemm_supported() is false here).
//
// Numerics are those of the x86 kernels (see linear_int8.cpp): x rounded per block of 32 values
// by quantize_activations, exact integer dot products per block, then
//   y = sum_blocks (s_group * d_block) * (u . q)  +  sum_groups b * gsum
// so results differ from the x86 build only in the f32 summation order.
//
// Dot products. SDOT (vdotq_s32, __ARM_FEATURE_DOTPROD: Apple M1 and later, Neoverse, Cortex-A55
// and later) sums four s8 x s8 products into each int32 lane. Plain ARMv8.0 has no such
// instruction: VMULL (s8 x s8 -> s16, at most 128 * 128 = 2^14, exact) and VPADAL (pairs of s16
// added into s32 lanes) compute the same total, spread over the four lanes differently. Lanes
// are only ever summed (all four belong to one block, one scale), so both give the same block
// sum exactly.
//
// 4-bit. One 16-byte register of packed weights is 32 values = one activation block: its low
// nibbles are the 16 even-indexed codes, its high nibbles the 16 odd ones, so
// quantize_activations stores x per 32 values as [x0 x2 .. x30 | x1 x3 .. x31] (kChunk4 = 32 on
// NEON) and a block costs one AND, one shift and two SDOTs per token. Codes 0..15 are valid s8.
// Chunks of one block also mean every MLX group size (32, 64, 128: 32 << gshift) runs here; the
// block's group is b >> gshift (a division per block showed up in the generated loop).
//
// 8-bit. Codes 0..255 do not fit s8 and SDOT has no unsigned x signed form before the I8MM
// extension (USDOT, ARMv8.6; not on M1), so the codes enter as u - 128 (an XOR with 0x80) and
//   u . q = (u - 128) . q + 128 * sum(q),
// with 128 * sum(q) computed once per call for each token and block (qoff below) and used as
// the initial value of that block's integer accumulator: still exact (|u . q| < 2^20).
//
// Speed is unverified on Apple hardware: CI runs these kernels under qemu, for correctness only
// (tests/test_arm64_kernels.py); docs/performance.md gives the loops' instruction counts.
#include "cpu/linear_int8.h"

#if defined(LILY_INT8_NEON)

#include <arm_neon.h>

#include <cstring>
#include <vector>

#include "model/dtype.h"

namespace lily::cpu {

namespace {

// acc + the s8 x s8 products of a and b, summed into the four int32 lanes (how the 16 products
// are spread over the lanes differs between the two forms; their total does not).
inline int32x4_t dot_s8(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, a, b);
#else
  acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
  return vpadalq_s16(acc, vmull_high_s8(a, b));
#endif
}

// n scales or biases of one row as f32 (exact: bf16 is a shift, f16 -> f32 a widening convert).
void row_params(const uint8_t* p, DType dt, int n, float* out) {
  if (dt == DType::F32) {
    std::memcpy(out, p, size_t(n) * 4);
    return;
  }
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint16x8_t h = vreinterpretq_u16_u8(vld1q_u8(p + 2 * i));
    if (dt == DType::BF16) {
      vst1q_f32(out + i, vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16)));
      vst1q_f32(out + i + 4, vreinterpretq_f32_u32(vshll_high_n_u16(h, 16)));
    } else {
      const float16x8_t f = vreinterpretq_f16_u16(h);
      vst1q_f32(out + i, vcvt_f32_f16(vget_low_f16(f)));
      vst1q_f32(out + i + 4, vcvt_high_f32_f16(f));
    }
  }
  for (; i < n; ++i) out[i] = load_as_f32(p, dt, i);
}

// One row against NT tokens. sf/bf: the row's scales and biases as f32 [G]; xq/dx/gsum as
// quantize_activations and MatvecInput write them ([NT, in], [NT, ndx], [NT, G]); qoff
// [NT, in / 32]: 128 * sum(q) per block (8-bit only).
template <int NT, int BITS>
void row_int8(const uint8_t* wrow, const float* sf, const float* bf, int in, int gshift, const int8_t* xq,
              const float* dx, int ndx, const int32_t* qoff, const float* gsum, int G, float* out, int ldo) {
  const int nb = in / kInt8Block;
  // dx holds one scale per block for 8-bit and the same scale four times (one per 32-bit lane
  // of x86's 256-bit vectors) for 4-bit.
  constexpr int kDxPerBlock = BITS == 4 ? 4 : 1;
  // Few tokens: two accumulator sets (even / odd blocks), so consecutive FMAs into one register
  // do not wait on each other's latency. From 4 tokens the tokens give that independence, and
  // a second set would not fit in the 32 vector registers (spills at 8 tokens).
  constexpr int kSets = NT < 4 ? 2 : 1;
  float32x4_t acc[kSets][NT];
  for (int i = 0; i < kSets; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = vdupq_n_f32(0.0f);
  auto block = [&](int b, float32x4_t* a) {
    int8x16_t w0, w1;  // codes of the block's first and second 16 activations
    if constexpr (BITS == 4) {
      const uint8x16_t p = vld1q_u8(wrow + 16 * b);
      w0 = vreinterpretq_s8_u8(vandq_u8(p, vdupq_n_u8(0x0F)));  // even values
      w1 = vreinterpretq_s8_u8(vshrq_n_u8(p, 4));                // odd values
    } else {
      w0 = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(wrow + 32 * b), vdupq_n_u8(0x80)));  // u - 128
      w1 = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(wrow + 32 * b + 16), vdupq_n_u8(0x80)));
    }
    const float s = sf[b >> gshift];
    for (int t = 0; t < NT; ++t) {
      const int8_t* xb = xq + size_t(t) * in + kInt8Block * b;
      int32x4_t ia = vdupq_n_s32(0);
      if constexpr (BITS == 8) ia = vsetq_lane_s32(qoff[size_t(t) * nb + b], ia, 0);
      ia = dot_s8(ia, w0, vld1q_s8(xb));
      ia = dot_s8(ia, w1, vld1q_s8(xb + 16));
      a[t] = vfmaq_n_f32(a[t], vcvtq_f32_s32(ia), s * dx[size_t(t) * ndx + b * kDxPerBlock]);
    }
  };
  int b = 0;
  for (; b + 2 <= nb; b += 2) {
    block(b, acc[0]);
    block(b + 1, acc[kSets - 1]);
  }
  if (b < nb) block(b, acc[0]);
  // Bias term: sum_g b[g] * gsum[t, g], four groups per FMA.
  int g = 0;
  for (; g + 4 <= G; g += 4) {
    const float32x4_t bv = vld1q_f32(bf + g);
    for (int t = 0; t < NT; ++t) acc[0][t] = vfmaq_f32(acc[0][t], bv, vld1q_f32(gsum + size_t(t) * G + g));
  }
  for (int t = 0; t < NT; ++t) {
    float s = vaddvq_f32(kSets == 2 ? vaddq_f32(acc[0][t], acc[kSets - 1][t]) : acc[0][t]);
    for (int k = g; k < G; ++k) s += bf[k] * gsum[size_t(t) * G + k];
    out[size_t(t) * ldo] = s;
  }
}

template <int NT>
void rows_nt(const Linear& W, const int8_t* xq, const float* dx, const float* gsum, float* y, int ldy, int64_t r0,
             int64_t r1) {
  const int G = W.in / W.group, nb = W.in / kInt8Block, ndx = int8_dx_per_token(W.in, W.bits);
  const size_t esz = dtype_size(W.dtype), wbytes = size_t(W.in) * W.bits / 8;
  int gshift = 0;  // group = 32 << gshift
  while ((kInt8Block << gshift) < W.group) ++gshift;
  // 8-bit: 128 * sum(q) per token and block, shared by every row of this call.
  thread_local std::vector<int32_t> qoff_store;
  if (W.bits == 8) {
    qoff_store.resize(size_t(NT) * nb);
    for (int t = 0; t < NT; ++t)
      for (int b = 0; b < nb; ++b) {
        const int8_t* xb = xq + size_t(t) * W.in + kInt8Block * b;
        qoff_store[size_t(t) * nb + b] = 128 * (int32_t(vaddlvq_s8(vld1q_s8(xb))) + vaddlvq_s8(vld1q_s8(xb + 16)));
      }
  }
  const int32_t* qoff = qoff_store.data();
  // Per-row f32 scales and biases; G <= 2048 (int8_supported), as on x86.
  constexpr int kMaxG = 2048;
  float sf[kMaxG], bf[kMaxG];
  for (int64_t r = r0; r < r1; ++r) {
    row_params(W.scales + size_t(r) * G * esz, W.dtype, G, sf);
    row_params(W.biases + size_t(r) * G * esz, W.dtype, G, bf);
    const uint8_t* wrow = W.w + size_t(r) * wbytes;
    if (W.bits == 4) row_int8<NT, 4>(wrow, sf, bf, W.in, gshift, xq, dx, ndx, qoff, gsum, G, y + r, ldy);
    else row_int8<NT, 8>(wrow, sf, bf, W.in, gshift, xq, dx, ndx, qoff, gsum, G, y + r, ldy);
  }
}

}  // namespace

bool int8_supported(const Linear& W) {
  if (!W.quantized() || W.in / W.group > 2048 || (W.bits != 4 && W.bits != 8)) return false;
  const int blocks = W.group / kInt8Block;  // per group: a power of two (32 << gshift)
  return W.group % kInt8Block == 0 && blocks > 0 && (blocks & (blocks - 1)) == 0;
}

void int8_rows(const Linear& W, const int8_t* xq, const float* dx, const float* gsum, int t0, int nt, float* y,
               int ldy, int64_t r0, int64_t r1) {
  int8_rows_for_tokens(W, xq, dx, gsum, t0, nt, y, ldy,
                       [&](auto n, const int8_t* q, const float* d, const float* gs, float* yt) {
                         rows_nt<decltype(n)::value>(W, q, d, gs, yt, ldy, r0, r1);
                       });
}

}  // namespace lily::cpu

#endif  // LILY_INT8_NEON
