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
// not for 8-bit codes, which therefore need VNNI. Elsewhere int8_supported() is false and
// linear.cpp keeps the f32 kernels.
#include "cpu/linear_int8.h"

#include <algorithm>
#include <cmath>
#include <cstring>

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

namespace lily::cpu {

// Values per 4-bit chunk: the packed bytes of one vector register (512-bit: 64 bytes = 128
// values; 256-bit: 32 bytes = 64). A row whose length is not a multiple ends with a 64-chunk.
#if defined(LILY_INT8_AVX512)
constexpr int kChunk4 = 128;
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
  for (int64_t r = r0; r < r1; ++r) {
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
  const int G = W.in / W.group, ndx = int8_dx_per_token(W.in, W.bits);
  xq += size_t(t0) * W.in;
  dx += size_t(t0) * ndx;
  gsum += size_t(t0) * G;
  y += size_t(t0) * ldy;
  switch (nt) {
    case 1: rows_nt<1>(W, xq, dx, gsum, y, ldy, r0, r1); break;
    case 2: rows_nt<2>(W, xq, dx, gsum, y, ldy, r0, r1); break;
    case 3: rows_nt<3>(W, xq, dx, gsum, y, ldy, r0, r1); break;
    case 4: rows_nt<4>(W, xq, dx, gsum, y, ldy, r0, r1); break;
    case 5: rows_nt<5>(W, xq, dx, gsum, y, ldy, r0, r1); break;
    case 6: rows_nt<6>(W, xq, dx, gsum, y, ldy, r0, r1); break;
    case 7: rows_nt<7>(W, xq, dx, gsum, y, ldy, r0, r1); break;
    default: rows_nt<8>(W, xq, dx, gsum, y, ldy, r0, r1); break;
  }
}

#else  // no AVX2: the f32 kernels serve both modes

bool int8_supported(const Linear&) { return false; }
void int8_rows(const Linear&, const int8_t*, const float*, const float*, int, int, float*, int, int64_t, int64_t) {}

#endif

}  // namespace lily::cpu
