// Integer-dot-product kernels for MLX affine weights (4 and 8 bits) against int8 activations.
//
// Why: the f32 fused kernels widen every nibble to an f32 lane and spend ~36 instructions per
// 64 bytes of weights, so decode was instruction-bound at ~2 GB/s per core. Here 32 packed bytes
// (64 weights) become two u8 vectors with one AND and one shift, and VPDPBUSD multiplies them by
// int8 activations and sums groups of four into int32 lanes: ~10 instructions per 32 bytes.
//
// Numerics. Each row of x is quantized per block of 32 values: d = max|x| / 127, q = round(x / d).
// With weights w = s * u + b (u the unsigned code, s/b the group's scale and bias):
//   sum_j w_j x_j  =  sum_groups [ s * sum_j u_j x_j  +  b * sum_j x_j ]
//                 ~=  sum_groups [ s * sum_blocks d * (sum_j u_j q_j) ]  +  b * gsum
// The integer sums are exact; the only new error is the rounding of x to q (relative 1/254 of the
// block's max per element, unbiased), and the bias term keeps the exact f32 group sum of x.
// This is the scheme of llama.cpp's Q4_0 x Q8_0 dot product.
//
// Layout. A 256-bit vector holds eight int32 lanes, each the dot of 4 weights with 4 x values.
// For 4-bit weights, byte i of a 32-byte chunk holds weights 2i (low nibble) and 2i+1 (high), so
// x is stored per 64 values as [evens | odds]: the low-nibble vector pairs with the evens, the
// high-nibble vector with the odds, and lane j covers x block (2c + j/4). Block scales are stored
// expanded to lanes (dx: one float per lane), so applying them is one load and one multiply.
//
// Instruction sets: AVX-512 VNNI (256-bit forms, AVX512VL) or AVX-VNNI (VPDPBUSD); plain AVX2
// emulates it with VPMADDUBSW + VPMADDWD, exact for 4-bit codes (2 * 15 * 127 fits an int16) but
// not for 8-bit codes, which therefore need VNNI. arm64 has its own row kernels
// (linear_int8_neon.cpp). Elsewhere int8_supported() is false and linear.cpp keeps the f32
// kernels.
#include "cpu/linear_int8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "model/dtype.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LILY_INT8_KERNELS 1
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define LILY_INT8_VNNI 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LILY_INT8_AVX512 1
#endif
#endif
#if defined(LILY_INT8_NEON)
#include <arm_neon.h>
#endif

namespace lily::cpu {

// Values per 4-bit chunk: the packed bytes of one vector register (512-bit: 64 bytes = 128
// values; 256-bit: 32 bytes = 64; NEON 128-bit: 16 bytes = 32, one activation block). A row
// whose length is not a multiple ends with a 64-chunk.
#if defined(LILY_INT8_AVX512)
constexpr int kChunk4 = 128;
#elif defined(LILY_INT8_NEON)
constexpr int kChunk4 = 32;
#else
constexpr int kChunk4 = 64;
#endif

void quantize_activations(const float* x, int T, int in, int bits, int8_t* xq, float* dx) {
  const int nb = in / kInt8Block, ndx = int8_dx_per_token(in, bits);
  for (int t = 0; t < T; ++t) {
    const float* xt = x + size_t(t) * in;
    int8_t* qt = xq + size_t(t) * in;
    float* dt = dx + size_t(t) * ndx;
    for (int b = 0; b < nb; ++b) {
      const float* xb = xt + b * kInt8Block;
#if defined(LILY_INT8_AVX512)
      {
        // The same arithmetic as the scalar loop below (max, one multiply, round to nearest
        // even), 16 lanes at a time; the 4-bit layout's even/odd split is one permute each.
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
        const __m512 vi = _mm512_set1_ps(inv);
        if (bits == 4) {
          const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
          const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
          const __m512 e = _mm512_permutex2var_ps(x0, ev, x1), o = _mm512_permutex2var_ps(x0, od, x1);
          const int c0 = b * kInt8Block / kChunk4 * kChunk4, wc = std::min(kChunk4, in - c0);
          int8_t* qc = qt + c0 + (b * kInt8Block - c0) / 2;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qc), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(e, vi))));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qc + wc / 2),
                           _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(o, vi))));
          for (int l = 0; l < 4; ++l) dt[b * 4 + l] = d;
        } else {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qt + b * kInt8Block),
                           _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, vi))));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qt + b * kInt8Block + 16),
                           _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, vi))));
          dt[b] = d;
        }
        continue;
      }
#elif defined(LILY_INT8_NEON)
      {
        // The scalar loop's arithmetic (max, one multiply, round to nearest even: FCVTNS), four
        // lanes at a time. A 4-bit chunk is this one block: its evens and odds are two unzips.
        float32x4_t v[8], m = vdupq_n_f32(0.0f);
        for (int i = 0; i < 8; ++i) m = vmaxnmq_f32(m, vabsq_f32(v[i] = vld1q_f32(xb + 4 * i)));
        const float amax = vmaxnmvq_f32(m);
        const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
        int8x8_t q8[4];  // |q| <= 127: the narrowing moves are exact
        for (int i = 0; i < 4; ++i)
          q8[i] = vmovn_s16(vcombine_s16(vmovn_s32(vcvtnq_s32_f32(vmulq_n_f32(v[2 * i], inv))),
                                         vmovn_s32(vcvtnq_s32_f32(vmulq_n_f32(v[2 * i + 1], inv)))));
        const int8x16_t q0 = vcombine_s8(q8[0], q8[1]), q1 = vcombine_s8(q8[2], q8[3]);
        static_assert(kChunk4 == kInt8Block, "a NEON 4-bit chunk is one block");
        int8_t* qb = qt + b * kInt8Block;
        if (bits == 4) {
          vst1q_s8(qb, vuzp1q_s8(q0, q1));
          vst1q_s8(qb + 16, vuzp2q_s8(q0, q1));
          for (int l = 0; l < 4; ++l) dt[b * 4 + l] = d;
        } else {
          vst1q_s8(qb, q0);
          vst1q_s8(qb + 16, q1);
          dt[b] = d;
        }
        continue;
      }
#endif
      float amax = 0;
      for (int j = 0; j < kInt8Block; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
      int8_t q[kInt8Block];
      for (int j = 0; j < kInt8Block; ++j) q[j] = int8_t(std::nearbyint(xb[j] * inv));
      if (bits == 4) {
        // Block b lies in chunk c (width wc values): its evens go to the chunk's first wc / 2
        // bytes, its odds to the last wc / 2, each at offset 16 * (its place in the chunk).
        const int c0 = b * kInt8Block / kChunk4 * kChunk4, wc = std::min(kChunk4, in - c0);
        int8_t* qc = qt + c0 + (b * kInt8Block - c0) / 2;
        for (int i = 0; i < 16; ++i) {
          qc[i] = q[2 * i];
          qc[wc / 2 + i] = q[2 * i + 1];
        }
        for (int l = 0; l < 4; ++l) dt[b * 4 + l] = d;  // the 4 lanes (of 8 values) of block b
      } else {
        std::memcpy(qt + b * kInt8Block, q, kInt8Block);
        dt[b] = d;
      }
    }
  }
}

#if defined(LILY_INT8_KERNELS)

namespace {

#if defined(LILY_INT8_AVX512)
inline __m512i dpbusd512(__m512i acc, __m512i a, __m512i b) { return _mm512_dpbusd_epi32(acc, a, b); }
#endif

// acc + sum of 4 products u8 (a) x s8 (b) per int32 lane.
inline __m256i dpbusd(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, a, b);
#else
  // u8 x s8 pairs summed to int16 (exact for codes <= 15), then pairs of those to int32.
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// n scales or biases of one row as f32 (dtype fixed per matrix).
void row_params(const uint8_t* p, DType dt, int n, float* out) {
  int i = 0;
  if (dt == DType::F32) {
    std::memcpy(out, p, size_t(n) * 4);
    return;
  }
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
    const __m256 f = dt == DType::BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                       : _mm256_cvtph_ps(h);
    _mm256_storeu_ps(out + i, f);
  }
  for (; i < n; ++i) out[i] = load_as_f32(p, dt, i);
}

// Software prefetch of one row-major stream, kPrefetchBytes past the end of the row being read.
// Why: batch-1 decode is one pass over each matrix, and the hardware prefetchers stop at every
// 4 KiB page and ramp up again on the next, which left one thread's loads waiting on DRAM.
// Measured with benchmarks/kernels/matvec_bench (2 threads, 4-bit, this VM): lm_head-shaped
// rows (in 2048) 21.2 -> 24.6 GB/s, expert-shaped rows (in 512) 15.4 -> 23.4 GB/s; 2 KiB
// beat 1 KiB and 4 KiB.
constexpr size_t kPrefetchBytes = 2048;

struct StreamPrefetch {
  const uint8_t* next;  // first byte not yet prefetched
  const uint8_t* end;   // the stream's end: nothing past it is touched
  void upto(const uint8_t* target) {
    for (const uint8_t* t = std::min(end, target); next < t; next += 64) __builtin_prefetch(next, 0, 3);
  }
};

// One row against NT tokens. sf/bf: the row's scales and biases as f32 [G].
template <int NT, int BITS>
void row_int8(const uint8_t* wrow, const float* sf, const float* bf, int in, int group, const int8_t* xq,
              const float* dx, int ndx, const float* gsum, int G, float* out, int ldo) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  if constexpr (BITS == 4) {
    int v0 = 0;  // first value of the current chunk
#if defined(LILY_INT8_AVX512)
    // 128 values per step; two accumulator sets (even / odd steps) so consecutive FMAs into
    // one register do not serialise on its latency.
    const __m512i m4x = _mm512_set1_epi8(0x0F), zx = _mm512_setzero_si512();
    const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 wacc[2][NT];
    for (int t = 0; t < NT; ++t) wacc[0][t] = wacc[1][t] = _mm512_setzero_ps();
    auto step = [&](int v, __m512* a) {
      const __m512i w = _mm512_loadu_si512(wrow + v / 2);
      const __m512i lo = _mm512_and_si512(w, m4x);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4x);
      // Lanes 0-7 hold values v..v+63, lanes 8-15 v+64..v+127: one group of 64 each, or one
      // group of >= 128 for both.
      const __m512 s = group == 64
          ? _mm512_permutexvar_ps(pair, _mm512_castpd_ps(_mm512_castpd128_pd512(_mm_load_sd(
                reinterpret_cast<const double*>(sf + v / 64)))))
          : _mm512_set1_ps(sf[v / group]);
      for (int t = 0; t < NT; ++t) {
        const int8_t* xc = xq + size_t(t) * in + v;
        __m512i ia = dpbusd512(zx, lo, _mm512_loadu_si512(xc));
        ia = dpbusd512(ia, hi, _mm512_loadu_si512(xc + 64));
        const __m512 scale = _mm512_mul_ps(s, _mm512_loadu_ps(dx + size_t(t) * ndx + v / 8));
        a[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), scale, a[t]);
      }
    };
    for (; v0 + 256 <= in; v0 += 256) {
      step(v0, wacc[0]);
      step(v0 + 128, wacc[1]);
    }
    if (v0 + 128 <= in) {
      step(v0, wacc[0]);
      v0 += 128;
    }
    for (int t = 0; t < NT; ++t) {
      const __m512 sum = _mm512_add_ps(wacc[0][t], wacc[1][t]);
      acc[t] = _mm256_add_ps(_mm512_castps512_ps256(sum),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sum), 1)));
    }
#endif
    // 64 values per step (the whole row on AVX2, the tail after the 128-steps on AVX-512).
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (; v0 < in; v0 += 64) {
      const __m256 s = _mm256_broadcast_ss(sf + v0 / group);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + v0 / 2));
      const __m256i lo = _mm256_and_si256(v, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      for (int t = 0; t < NT; ++t) {
        const int8_t* xc = xq + size_t(t) * in + v0;
        __m256i ia = dpbusd(zero, lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc)));
        ia = dpbusd(ia, hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + 32)));
        const __m256 scale = _mm256_mul_ps(s, _mm256_loadu_ps(dx + size_t(t) * ndx + v0 / 8));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), scale, acc[t]);
      }
    }
  } else {
    const int blocks_per_group = group / kInt8Block;
    for (int g = 0, b = 0; g < G; ++g) {
      for (int bg = 0; bg < blocks_per_group; ++bg, ++b) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + 32 * b));
        for (int t = 0; t < NT; ++t) {
          const __m256i ia =
              dpbusd(zero, w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + size_t(t) * in + 32 * b)));
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_set1_ps(sf[g] * dx[size_t(t) * ndx + b]), acc[t]);
        }
      }
    }
  }
  // Bias term: sum_g b[g] * gsum[t, g], folded into the same accumulator lanes.
  int g = 0;
  for (; g + 8 <= G; g += 8) {
    const __m256 bv = _mm256_loadu_ps(bf + g);
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_fmadd_ps(bv, _mm256_loadu_ps(gsum + size_t(t) * G + g), acc[t]);
  }
  for (int t = 0; t < NT; ++t) {
    float s = hsum(acc[t]);
    for (int k = g; k < G; ++k) s += bf[k] * gsum[size_t(t) * G + k];
    out[size_t(t) * ldo] = s;
  }
}

template <int NT>
void rows_nt(const Linear& W, const int8_t* xq, const float* dx, const float* gsum, float* y, int ldy, int64_t r0,
             int64_t r1) {
  const int G = W.in / W.group, ndx = int8_dx_per_token(W.in, W.bits);
  const size_t esz = dtype_size(W.dtype), wbytes = size_t(W.in) * W.bits / 8;
  // Per-row f32 scales and biases; G <= in / 32, so a model with in <= 65536 fits on the stack.
  constexpr int kMaxG = 2048;
  float sf[kMaxG], bf[kMaxG];
  // The three streams this thread reads (weights, scales, biases), prefetched ahead in step.
  const size_t pbytes = size_t(G) * esz;
  const size_t pahead = kPrefetchBytes * pbytes / wbytes;
  StreamPrefetch wpf{W.w + size_t(r0) * wbytes, W.w + size_t(r1) * wbytes};
  StreamPrefetch spf{W.scales + size_t(r0) * pbytes, W.scales + size_t(r1) * pbytes};
  StreamPrefetch bpf{W.biases + size_t(r0) * pbytes, W.biases + size_t(r1) * pbytes};
  for (int64_t r = r0; r < r1; ++r) {
    wpf.upto(W.w + size_t(r + 1) * wbytes + kPrefetchBytes);
    spf.upto(W.scales + size_t(r + 1) * pbytes + pahead);
    bpf.upto(W.biases + size_t(r + 1) * pbytes + pahead);
    row_params(W.scales + size_t(r) * G * esz, W.dtype, G, sf);
    row_params(W.biases + size_t(r) * G * esz, W.dtype, G, bf);
    const uint8_t* wrow = W.w + size_t(r) * wbytes;
    if (W.bits == 4) row_int8<NT, 4>(wrow, sf, bf, W.in, W.group, xq, dx, ndx, gsum, G, y + r, ldy);
    else row_int8<NT, 8>(wrow, sf, bf, W.in, W.group, xq, dx, ndx, gsum, G, y + r, ldy);
  }
}

}  // namespace

bool int8_supported(const Linear& W) {
  if (!W.quantized() || W.in / W.group > 2048) return false;
  if (W.bits == 4) return W.group % 64 == 0;
#if defined(LILY_INT8_VNNI)
  if (W.bits == 8) return W.group % kInt8Block == 0;
#endif
  return false;
}

void int8_rows(const Linear& W, const int8_t* xq, const float* dx, const float* gsum, int t0, int nt, float* y,
               int ldy, int64_t r0, int64_t r1) {
  int8_rows_for_tokens(W, xq, dx, gsum, t0, nt, y, ldy,
                       [&](auto n, const int8_t* q, const float* d, const float* gs, float* yt) {
                         rows_nt<decltype(n)::value>(W, q, d, gs, yt, ldy, r0, r1);
                       });
}

#elif !defined(LILY_INT8_NEON)  // no AVX2 nor NEON: the f32 kernels serve both modes

bool int8_supported(const Linear&) { return false; }
void int8_rows(const Linear&, const int8_t*, const float*, const float*, int, int, float*, int, int64_t, int64_t) {}

#endif

}  // namespace lily::cpu

// ---- Larger chunks: tokens in vectors ---------------------------------------------------------
//
// For T > 32 the row kernels would re-read (and re-unpack) each weight row once per 8 tokens.
// Here the roles turn: a 512-bit vector holds one 4-byte slice of x for 16 tokens (x is
// transposed once per call into Xp[token group][dword][16]), and each weight dword is broadcast
// against it, so one VPDPBUSD does 4 values x 16 tokens. Weight rows are unpacked to u8 codes
// once per call (16 rows at a time, into L1) and then swept by every token group:
//   per 8 rows x 32 values x 16 tokens: 8 x loads, 64 broadcasts, 64 VPDPBUSD, 24 scale ops
//   (8 rows rather than 4: +6% measured, the x loads shared by more rows).
// Block scales and group sums are transposed the same way (dxT, gsT), so the per-block scale is
// one vector multiply per row and the bias term one FMA per group.
namespace lily::cpu {

#if defined(LILY_INT8_AVX512)

namespace {

constexpr int kGemmRows = 16;  // rows unpacked per step (16 x in bytes in L1)
constexpr int kGemmR = 8;      // rows per register block (8 int32 + 8 f32 accumulators in zmm)

struct GemmInput {
  int T = 0, in = 0, G = 0, nb = 0, groups16 = 0;
  std::vector<int8_t> xq;
  std::vector<float> dx, gsum;
  std::vector<int32_t> Xp;  // [groups16][in / 4][16]
  std::vector<float> dxT;   // [groups16][nb][16]
  std::vector<float> gsT;   // [groups16][G][16]
};

// Dword offsets (in the xq layout) of block b's first evens and first odds for 4-bit rows; for
// 8-bit rows the block is 8 consecutive dwords.
inline void block_dwords(int b, int in, int bits, int& e0, int& o0) {
  if (bits == 8) {
    e0 = b * 8;
    o0 = b * 8 + 4;
    return;
  }
  const int c0 = b * kInt8Block / kChunk4 * kChunk4, wc = std::min(kChunk4, in - c0);
  const int h = (b * kInt8Block - c0) / 32;
  e0 = (c0 + 16 * h) / 4;
  o0 = (c0 + wc / 2 + 16 * h) / 4;
}

void prepare_gemm(const Linear& W, const float* x, int T, GemmInput& g) {
  const int in = W.in, G = in / W.group, nb = in / kInt8Block, ndx = int8_dx_per_token(in, W.bits);
  g.T = T;
  g.in = in;
  g.G = G;
  g.nb = nb;
  g.groups16 = (T + 15) / 16;
  g.xq.resize(size_t(T) * in);
  g.dx.resize(size_t(T) * ndx);
  quantize_activations(x, T, in, W.bits, g.xq.data(), g.dx.data());
  g.Xp.assign(size_t(g.groups16) * (in / 4) * 16, 0);
  g.dxT.assign(size_t(g.groups16) * nb * 16, 0.0f);
  g.gsT.assign(size_t(g.groups16) * G * 16, 0.0f);
  for (int t = 0; t < T; ++t) {
    const int tg = t / 16, l = t % 16;
    const int32_t* q = reinterpret_cast<const int32_t*>(g.xq.data() + size_t(t) * in);
    int32_t* xp = g.Xp.data() + size_t(tg) * (in / 4) * 16 + l;
    for (int k = 0; k < in / 4; ++k) xp[size_t(k) * 16] = q[k];
    // dx: 4-bit keeps one scale per lane of 8 values (4 per block), 8-bit one per block.
    const float* d = g.dx.data() + size_t(t) * ndx;
    float* dt = g.dxT.data() + size_t(tg) * nb * 16 + l;
    for (int b = 0; b < nb; ++b) dt[size_t(b) * 16] = W.bits == 4 ? d[b * 4] : d[b];
    float* gs = g.gsT.data() + size_t(tg) * G * 16 + l;
    for (int gi = 0; gi < G; ++gi) {
      float s = 0;
      for (int j = 0; j < W.group; ++j) s += x[size_t(t) * in + gi * W.group + j];
      gs[size_t(gi) * 16] = s;
    }
  }
}

// Rows [r0, r1) of y for every token, by the calling thread.
void gemm_rows(const Linear& W, const GemmInput& g, float* y, int64_t r0, int64_t r1) {
  const int in = W.in, G = g.G, nb = g.nb, bits = W.bits, dw = in / 4;
  const size_t esz = dtype_size(W.dtype), wbytes = size_t(in) * bits / 8;
  thread_local std::vector<uint8_t> codes_store;
  thread_local std::vector<float> sf_store, bf_store;
  codes_store.resize(size_t(kGemmRows) * in);
  sf_store.resize(size_t(kGemmRows) * G);
  bf_store.resize(size_t(kGemmRows) * G);
  uint8_t* codes = codes_store.data();
  float* sf = sf_store.data();
  float* bf = bf_store.data();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int64_t rb = r0; rb < r1; rb += kGemmRows) {
    const int nr = int(std::min<int64_t>(kGemmRows, r1 - rb));
    // Unpack: 4-bit rows to u8 codes in the xq layout (per chunk: low nibbles, then high).
    for (int i = 0; i < nr; ++i) {
      const uint8_t* wrow = W.w + size_t(rb + i) * wbytes;
      uint8_t* cr = codes + size_t(i) * in;
      if (bits == 8) {
        std::memcpy(cr, wrow, in);
      } else {
        int v = 0;
        for (; v + 128 <= in; v += 128) {
          const __m512i w = _mm512_loadu_si512(wrow + v / 2);
          _mm512_storeu_si512(cr + v, _mm512_and_si512(w, m4));
          _mm512_storeu_si512(cr + v + 64, _mm512_and_si512(_mm512_srli_epi16(w, 4), m4));
        }
        for (; v < in; v += 64) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + v / 2));
          const __m256i m = _mm256_set1_epi8(0x0F);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(cr + v), _mm256_and_si256(w, m));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(cr + v + 32), _mm256_and_si256(_mm256_srli_epi16(w, 4), m));
        }
      }
      row_params(W.scales + size_t(rb + i) * G * esz, W.dtype, G, sf + size_t(i) * G);
      row_params(W.biases + size_t(rb + i) * G * esz, W.dtype, G, bf + size_t(i) * G);
    }
    for (int tg = 0; tg < g.groups16; ++tg) {
      const int32_t* xp = g.Xp.data() + size_t(tg) * dw * 16;
      const float* dxT = g.dxT.data() + size_t(tg) * nb * 16;
      const float* gsT = g.gsT.data() + size_t(tg) * G * 16;
      const int nt = std::min(16, g.T - tg * 16);
      for (int i0 = 0; i0 < nr; i0 += kGemmR) {
        const int R = std::min(kGemmR, nr - i0);
        const int32_t* cw[kGemmR];
        for (int r = 0; r < kGemmR; ++r) cw[r] = reinterpret_cast<const int32_t*>(codes + size_t(i0 + std::min(r, R - 1)) * in);
        __m512 facc[kGemmR];
        for (int r = 0; r < kGemmR; ++r) facc[r] = _mm512_setzero_ps();
        for (int b = 0; b < nb; ++b) {
          int e0, o0;
          block_dwords(b, in, bits, e0, o0);
          __m512i ia[kGemmR];
          for (int r = 0; r < kGemmR; ++r) ia[r] = _mm512_setzero_si512();
          for (int k = 0; k < 4; ++k) {
            const __m512i xe = _mm512_loadu_si512(xp + size_t(e0 + k) * 16);
            const __m512i xo = _mm512_loadu_si512(xp + size_t(o0 + k) * 16);
            for (int r = 0; r < kGemmR; ++r) {
              ia[r] = _mm512_dpbusd_epi32(ia[r], _mm512_set1_epi32(cw[r][e0 + k]), xe);
              ia[r] = _mm512_dpbusd_epi32(ia[r], _mm512_set1_epi32(cw[r][o0 + k]), xo);
            }
          }
          const __m512 d = _mm512_loadu_ps(dxT + size_t(b) * 16);
          const int gi = b * kInt8Block / W.group;
          for (int r = 0; r < kGemmR; ++r)
            facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]),
                                      _mm512_mul_ps(_mm512_set1_ps(sf[size_t(i0 + std::min(r, R - 1)) * G + gi]), d),
                                      facc[r]);
        }
        for (int gi = 0; gi < G; ++gi) {
          const __m512 gs = _mm512_loadu_ps(gsT + size_t(gi) * 16);
          for (int r = 0; r < kGemmR; ++r)
            facc[r] = _mm512_fmadd_ps(_mm512_set1_ps(bf[size_t(i0 + std::min(r, R - 1)) * G + gi]), gs, facc[r]);
        }
        for (int r = 0; r < R; ++r) {
          alignas(64) float lanes[16];
          _mm512_store_ps(lanes, facc[r]);
          for (int l = 0; l < nt; ++l) y[size_t(tg * 16 + l) * W.out + rb + i0 + r] = lanes[l];
        }
      }
    }
  }
}

}  // namespace

bool int8_gemm_supported(const Linear& W) { return int8_supported(W); }

void int8_gemm(const Linear& W, const float* x, int T, float* y, ThreadPool* pool) {
  thread_local GemmInput prepared;
  GemmInput& g = prepared;
  prepare_gemm(W, x, T, g);
  if (!pool) {
    gemm_rows(W, g, y, 0, W.out);
    return;
  }
  pool->parallel_for(W.out, [&](int64_t r0, int64_t r1, int) { gemm_rows(W, g, y, r0, r1); }, kGemmRows);
}

#else

bool int8_gemm_supported(const Linear&) { return false; }
void int8_gemm(const Linear&, const float*, int, float*, ThreadPool*) {}

#endif

}  // namespace lily::cpu
