// The int8 row kernels of linear_int8.cpp for arm64 (NEON): MLX affine 4/8-bit weights against
// int8 activations, for 1..8 tokens per pass over the weights (decode, small expert groups).
// Larger chunks (prefill) run as passes of 8 tokens: the token-vector GEMM of linear_int8.cpp
// is x86 only (int8_gemm_supported() is false here).
//
// Numerics are those of the x86 kernels, bit for bit: x rounded per block of 32 values by
// quantize_activations, exact integer dot products per block, then the canonical f32 sequence
// of linear_int8.h (one FMA per block in ascending order, then one per group for the bias term).
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
// (tests/test_cpu_kernel_builds.py, bit for bit against NumPy).
#include "cpu/linear_int8.h"

#if defined(LILY_INT8_NEON)

#include <arm_neon.h>

#include <algorithm>
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

// Rows in lanes: four rows against NT tokens, in the canonical order of linear_int8.h. A block's
// dot products leave each row's block sum spread over the four int32 lanes of its own vector;
// two pairwise adds (ADDP) gather the four rows' sums into one vector (lane i = row i), so the
// f32 steps run for the four rows at once: one FMA per block and token.
// rows[i]: row i's packed codes; sT, bT: the rows' scales and biases as f32, [G][4]; xq, dx,
// gsum as quantize_activations and MatvecInput write them ([NT, in], [NT, in / 32], [NT, G]);
// qoff [NT, in / 32]: 128 * sum(q) per block (8-bit only). Writes y[t, i] for i < nr.
template <int NT, int BITS>
void rows4(const uint8_t* const* rows, const float* sT, const float* bT, int in, int gshift, const int8_t* xq,
           const float* dx, const int32_t* qoff, const float* gsum, int G, float* y, int ldy, int nr) {
  const int nb = in / kInt8Block;
  float32x4_t acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = vdupq_n_f32(0.0f);
  for (int b = 0; b < nb; ++b) {
    int8x16_t w0[4], w1[4];  // per row: codes of the block's first and second 16 activations
    for (int i = 0; i < 4; ++i) {
      if constexpr (BITS == 4) {
        const uint8x16_t p = vld1q_u8(rows[i] + 16 * b);
        w0[i] = vreinterpretq_s8_u8(vandq_u8(p, vdupq_n_u8(0x0F)));  // even values
        w1[i] = vreinterpretq_s8_u8(vshrq_n_u8(p, 4));                // odd values
      } else {
        w0[i] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(rows[i] + 32 * b), vdupq_n_u8(0x80)));  // u - 128
        w1[i] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(rows[i] + 32 * b + 16), vdupq_n_u8(0x80)));
      }
    }
    const float32x4_t s = vld1q_f32(sT + size_t(b >> gshift) * 4);
    for (int t = 0; t < NT; ++t) {
      const int8_t* xb = xq + size_t(t) * in + kInt8Block * b;
      const int8x16_t x0 = vld1q_s8(xb), x1 = vld1q_s8(xb + 16);
      int32x4_t init = vdupq_n_s32(0);
      if constexpr (BITS == 8) init = vsetq_lane_s32(qoff[size_t(t) * nb + b], init, 0);
      int32x4_t ia[4];
      for (int i = 0; i < 4; ++i) ia[i] = dot_s8(dot_s8(init, w0[i], x0), w1[i], x1);
      const int32x4_t sums = vpaddq_s32(vpaddq_s32(ia[0], ia[1]), vpaddq_s32(ia[2], ia[3]));
      acc[t] = vfmaq_f32(acc[t], vcvtq_f32_s32(sums), vmulq_n_f32(s, dx[size_t(t) * nb + b]));
    }
  }
  for (int g = 0; g < G; ++g) {
    const float32x4_t bv = vld1q_f32(bT + size_t(g) * 4);
    for (int t = 0; t < NT; ++t) acc[t] = vfmaq_n_f32(acc[t], bv, gsum[size_t(t) * G + g]);
  }
  for (int t = 0; t < NT; ++t) {
    float lanes[4];
    vst1q_f32(lanes, acc[t]);
    std::memcpy(y + size_t(t) * ldy, lanes, size_t(nr) * sizeof(float));
  }
}

// Rows [r0, r1) for NT tokens.
template <int NT>
void rows_nt(const Linear& W, const int8_t* xq, const float* dx, const float* gsum, float* y, int ldy, int64_t r0,
             int64_t r1) {
  const int G = W.in / W.group, nb = W.in / kInt8Block;
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
  // The four rows' f32 scales and biases, [G][4]; G <= 2048 (int8_supported), as on x86.
  constexpr int kMaxG = 2048;
  thread_local std::vector<float> params_store;
  params_store.resize(size_t(8) * G);
  float* sT = params_store.data();
  float* bT = sT + size_t(4) * G;
  float row[kMaxG];
  for (int64_t rb = r0; rb < r1; rb += 4) {
    const int nr = int(std::min<int64_t>(4, r1 - rb));
    const uint8_t* rows[4];  // rows past the end repeat the last one, and are not stored
    for (int i = 0; i < 4; ++i) rows[i] = W.w + size_t(rb + std::min(i, nr - 1)) * wbytes;
    for (int i = 0; i < 4; ++i) {
      const int64_t r = rb + std::min(i, nr - 1);
      row_params(W.scales + size_t(r) * G * esz, W.dtype, G, row);
      for (int g = 0; g < G; ++g) sT[size_t(g) * 4 + i] = row[g];
      row_params(W.biases + size_t(r) * G * esz, W.dtype, G, row);
      for (int g = 0; g < G; ++g) bT[size_t(g) * 4 + i] = row[g];
    }
    if (W.bits == 4) rows4<NT, 4>(rows, sT, bT, W.in, gshift, xq, dx, qoff, gsum, G, y + rb, ldy, nr);
    else rows4<NT, 8>(rows, sT, bT, W.in, gshift, xq, dx, qoff, gsum, G, y + rb, ldy, nr);
  }
}

}  // namespace

bool int8_supported(const Linear& W) {
  if (!W.quantized() || W.in / W.group > 2048 || (W.bits != 4 && W.bits != 8)) return false;
  const int blocks = W.group / kInt8Block;  // per group: a power of two (32 << gshift)
  return W.group % kInt8Block == 0 && blocks > 0 && (blocks & (blocks - 1)) == 0;
}

void int8_rows(const Linear& W, const int8_t* xq, const float* dx, const float* gsum, int T, float* y, int ldy,
               int64_t r0, int64_t r1, int64_t /*prefetch_end: no prefetch here*/) {
  // Passes of up to 8 tokens over the weights (every token's outputs are independent of the
  // others in its pass: only the loads are shared).
  const int G = W.in / W.group, nb = W.in / kInt8Block;
  for (int t = 0; t < T; t += 8) {
    const int8_t* q = xq + size_t(t) * W.in;
    const float* d = dx + size_t(t) * nb;
    const float* gs = gsum + size_t(t) * G;
    float* yt = y + size_t(t) * ldy;
    switch (std::min(8, T - t)) {
      case 1: rows_nt<1>(W, q, d, gs, yt, ldy, r0, r1); break;
      case 2: rows_nt<2>(W, q, d, gs, yt, ldy, r0, r1); break;
      case 3: rows_nt<3>(W, q, d, gs, yt, ldy, r0, r1); break;
      case 4: rows_nt<4>(W, q, d, gs, yt, ldy, r0, r1); break;
      case 5: rows_nt<5>(W, q, d, gs, yt, ldy, r0, r1); break;
      case 6: rows_nt<6>(W, q, d, gs, yt, ldy, r0, r1); break;
      case 7: rows_nt<7>(W, q, d, gs, yt, ldy, r0, r1); break;
      default: rows_nt<8>(W, q, d, gs, yt, ldy, r0, r1); break;
    }
  }
}

}  // namespace lily::cpu

#endif  // LILY_INT8_NEON
