#include "cpu/linear.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "cpu/linear_int8.h"
#include "cpu/simd.h"

namespace lily::cpu {

namespace {

// MLX affine packing: the row is a little-endian bit stream, element j at bits
// [j*bits, (j+1)*bits). For 2/4/8 bits that is "low bits first within each uint32"; for 3/5/6
// the elements straddle bytes, so they are read through a 64-bit window.
template <int BITS>
void unpack_row(const uint8_t* p, int n, float* q) {
  constexpr uint32_t mask = (1u << BITS) - 1;
  if constexpr (BITS == 4) {
    for (int j = 0; j < n; j += 2) {
      const uint8_t b = p[j / 2];
      q[j] = float(b & 0xF);
      q[j + 1] = float(b >> 4);
    }
  } else if constexpr (BITS == 8) {
    for (int j = 0; j < n; ++j) q[j] = float(p[j]);
  } else if constexpr (BITS == 2) {
    for (int j = 0; j < n; j += 4) {
      const uint8_t b = p[j / 4];
      q[j] = float(b & 3);
      q[j + 1] = float((b >> 2) & 3);
      q[j + 2] = float((b >> 4) & 3);
      q[j + 3] = float(b >> 6);
    }
  } else {
    for (int j = 0; j < n; ++j) {
      const size_t bit = size_t(j) * BITS;
      uint32_t window = 0;
      // At most 2 bytes are needed for <= 6 bits at any bit offset; never read past the row.
      const size_t byte = bit / 8;
      const size_t row_bytes = size_t(n) * BITS / 8;
      window = p[byte];
      if (byte + 1 < row_bytes) window |= uint32_t(p[byte + 1]) << 8;
      q[j] = float((window >> (bit % 8)) & mask);
    }
  }
}

void unpack(int bits, const uint8_t* p, int n, float* q) {
  switch (bits) {
    case 2: unpack_row<2>(p, n, q); break;
    case 3: unpack_row<3>(p, n, q); break;
    case 4: unpack_row<4>(p, n, q); break;
    case 5: unpack_row<5>(p, n, q); break;
    case 6: unpack_row<6>(p, n, q); break;
    default: unpack_row<8>(p, n, q); break;
  }
}

void convert_row(const uint8_t* p, DType t, int n, float* out) {
  switch (t) {
    case DType::F32: std::memcpy(out, p, size_t(n) * 4); break;
    case DType::BF16:
      for (int j = 0; j < n; ++j) {
        uint16_t v;
        std::memcpy(&v, p + 2 * j, 2);
        out[j] = bf16_to_f32(v);
      }
      break;
    default:
      for (int j = 0; j < n; ++j) {
        uint16_t v;
        std::memcpy(&v, p + 2 * j, 2);
        out[j] = f16_to_f32(v);
      }
      break;
  }
}

// ---- MLX microscaled modes (mxfp4, mxfp8, nvfp4) ------------------------------------------------
// The codes are small floats read through tables; each group's scale is e8m0 (mx: 2^(s - 127),
// 255 = NaN) or e4m3 (nv), times the matrix's scale_mult (nvfp4's global scale; 1, exact,
// otherwise). (scale * mult) * value, two roundings in that order, is mlx.core.dequantize's.

// e2m1 (1 sign, 2 exponent, 1 mantissa bit), by 4-bit code.
constexpr float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// float8 e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities, 0x7F /
// 0xFF NaN), by byte.
struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) {
      const int exp = (b >> 3) & 0xF, man = b & 7;
      const float mag = exp == 0 ? std::ldexp(float(man) / 8.0f, -6) : std::ldexp(1.0f + float(man) / 8.0f, exp - 7);
      v[b] = (b & 0x7F) == 0x7F ? std::numeric_limits<float>::quiet_NaN() : ((b & 0x80) ? -mag : mag);
    }
  }
};
const E4m3Table kE4m3;

inline float e8m0(uint8_t s) {
  return s == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, int(s) - 127);
}

void dequantize_microscaled_row(const Linear& W, const uint8_t* wrow, const uint8_t* srow, float* out) {
  for (int g = 0; g < W.in / W.group; ++g) {
    const float s = (W.microscale == Microscale::Nvfp4 ? kE4m3.v[srow[g]] : e8m0(srow[g])) * W.scale_mult;
    float* o = out + size_t(g) * W.group;
    const int j0 = g * W.group;
    if (W.microscale == Microscale::Mxfp8) {
      for (int j = 0; j < W.group; ++j) o[j] = kE4m3.v[wrow[j0 + j]] * s;
    } else {  // two e2m1 codes a byte, the low nibble first (MLX's bit stream order)
      for (int j = 0; j < W.group; ++j) o[j] = kE2M1[(wrow[(j0 + j) / 2] >> (4 * ((j0 + j) & 1))) & 0xF] * s;
    }
  }
}

// codes[0, 8) of a 4- or 8-bit row as f32, from the byte holding code 0: exact conversions.
// Why vectors: this conversion runs before every f32 dot product of the portable path (f32 mode
// on AVX2 and arm64, and the router in every mode, which stays f32), and one code at a time it
// held that path to ~1.5 GB/s of weights on two Zen 2 cores.
#if defined(__AVX2__)
template <int BITS>
inline __m256 codes8_f32(const uint8_t* p) {
  __m128i v;
  if constexpr (BITS == 4) {
    uint32_t packed;
    std::memcpy(&packed, p, 4);
    const __m128i b = _mm_cvtsi32_si128(int(packed)), m4 = _mm_set1_epi8(0x0F);
    // low nibble (code 2i) then high nibble (code 2i + 1) of byte i
    v = _mm_unpacklo_epi8(_mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(b, 4), m4));
  } else {
    v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  }
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}
#elif defined(__ARM_NEON)
template <int BITS>
inline void codes8_f32(const uint8_t* p, float32x4_t& lo, float32x4_t& hi) {
  uint8x8_t v;
  if constexpr (BITS == 4) {
    uint32_t packed;
    std::memcpy(&packed, p, 4);
    const uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(packed));
    v = vzip1_u8(vand_u8(b, vdup_n_u8(0x0F)), vshr_n_u8(b, 4));  // code 2i, then 2i + 1
  } else {
    v = vld1_u8(p);
  }
  const uint16x8_t w = vmovl_u8(v);
  lo = vcvtq_f32_u32(vmovl_u16(vget_low_u16(w)));
  hi = vcvtq_f32_u32(vmovl_u16(vget_high_u16(w)));
}
#endif

// out[j] = s_g * code_j + b_g for a 4- or 8-bit affine row (groups of a multiple of 8 values):
// the scalar loop's two roundings (a product, then a sum; never an FMA), 8 values at a time.
template <int BITS>
void dequantize_affine_row(const Linear& W, const uint8_t* wrow, const uint8_t* srow, const uint8_t* brow,
                           float* out) {
  for (int g = 0; g < W.in / W.group; ++g) {
    const float s = load_as_f32(srow, W.dtype, g), b = load_as_f32(brow, W.dtype, g);
    for (int j = g * W.group; j < (g + 1) * W.group; j += 8) {
      const uint8_t* p = wrow + size_t(j) * BITS / 8;
#if defined(__AVX2__)
      _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(s), codes8_f32<BITS>(p)), _mm256_set1_ps(b)));
#elif defined(__ARM_NEON)
      float32x4_t lo, hi;
      codes8_f32<BITS>(p, lo, hi);
      vst1q_f32(out + j, vaddq_f32(vmulq_n_f32(lo, s), vdupq_n_f32(b)));
      vst1q_f32(out + j + 4, vaddq_f32(vmulq_n_f32(hi, s), vdupq_n_f32(b)));
#endif
    }
  }
}

// Whether dot_affine_rows runs W: 4- or 8-bit affine rows of whole 16-value steps (dot has no
// scalar tail there) in groups of whole steps.
bool fused_portable(const Linear& W) {
#if !defined(__AVX512F__) && ((defined(__AVX2__) && defined(__FMA__)) || defined(__ARM_NEON))
  return W.format == Linear::Format::Affine && (W.bits == 4 || W.bits == 8) && W.in % 16 == 0 && W.group % 16 == 0;
#else
  return false;
#endif
}

// y[t, r] = dot(dequantize_row(W, r), x_t) for rows [r0, r1) and NT tokens, straight off the
// packed bytes: each value dequantized as dequantize_row does it, then dot's accumulators and
// final sum (simd.h) in dot's order, so the outputs are those of the expand-then-dot loop in
// matvec_rows bit for bit, without writing the row out and reading it back (1.7x that loop's
// speed on one token, on two Zen 2 cores: 3.9 -> 6.5 GB/s of 4-bit weights).
template <int BITS, int NT>
void dot_affine_rows(const Linear& W, const float* x, float* y, int ldy, int64_t r0, int64_t r1) {
#if !defined(__AVX512F__) && ((defined(__AVX2__) && defined(__FMA__)) || defined(__ARM_NEON))
  const int G = W.in / W.group;
  const size_t esz = dtype_size(W.dtype), wbytes = size_t(W.in) * BITS / 8;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wrow = W.w + size_t(r) * wbytes;
    const uint8_t* srow = W.scales + size_t(r) * G * esz;
    const uint8_t* brow = W.biases + size_t(r) * G * esz;
#if defined(__AVX2__)
    __m256 a0[NT], a1[NT];  // dot's s0 (values i .. i+8 of each step) and s1 (i+8 .. i+16)
    for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
#else
    float32x4_t a[NT][4];  // dot's s0 .. s3
    for (int t = 0; t < NT; ++t) a[t][0] = a[t][1] = a[t][2] = a[t][3] = vdupq_n_f32(0);
#endif
    for (int g = 0; g < G; ++g) {
      const float s = load_as_f32(srow, W.dtype, g), b = load_as_f32(brow, W.dtype, g);
#if defined(__AVX2__)
      const __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
#endif
      for (int j = g * W.group; j < (g + 1) * W.group; j += 16) {
        const uint8_t* p = wrow + size_t(j) * BITS / 8;
#if defined(__AVX2__)
        const __m256 w0 = _mm256_add_ps(_mm256_mul_ps(vs, codes8_f32<BITS>(p)), vb);
        const __m256 w1 = _mm256_add_ps(_mm256_mul_ps(vs, codes8_f32<BITS>(p + BITS)), vb);
        for (int t = 0; t < NT; ++t) {
          const float* xt = x + size_t(t) * W.in + j;
          a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt), a0[t]);
          a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt + 8), a1[t]);
        }
#else
        float32x4_t w[4];
        codes8_f32<BITS>(p, w[0], w[1]);
        codes8_f32<BITS>(p + BITS, w[2], w[3]);
        for (int k = 0; k < 4; ++k) w[k] = vaddq_f32(vmulq_n_f32(w[k], s), vdupq_n_f32(b));
        for (int t = 0; t < NT; ++t)
          for (int k = 0; k < 4; ++k) a[t][k] = vfmaq_f32(a[t][k], w[k], vld1q_f32(x + size_t(t) * W.in + j + 4 * k));
#endif
      }
    }
    for (int t = 0; t < NT; ++t)
#if defined(__AVX2__)
      y[size_t(t) * ldy + r] = dot_sum(a0[t], a1[t]);
#else
      y[size_t(t) * ldy + r] = dot_sum(a[t][0], a[t][1], a[t][2], a[t][3]);
#endif
  }
#else
  (void)W, (void)x, (void)y, (void)ldy, (void)r0, (void)r1;
#endif
}

}  // namespace

void dequantize_row(const Linear& W, int row, float* out) {
  const uint8_t* wrow = W.w + size_t(row) * W.row_bytes();
  if (W.microscaled()) {
    dequantize_microscaled_row(W, wrow, W.scales + size_t(row) * (W.in / W.group), out);
    return;
  }
  if (!W.quantized()) {
    convert_row(wrow, W.dtype, W.in, out);
    return;
  }
  const int groups = W.in / W.group;
  const size_t esz = dtype_size(W.dtype);
  const uint8_t* srow = W.scales + size_t(row) * groups * esz;
  const uint8_t* brow = W.biases + size_t(row) * groups * esz;
#if defined(__AVX2__) || defined(__ARM_NEON)
  if ((W.bits == 4 || W.bits == 8) && W.group % 8 == 0) {
    if (W.bits == 4) dequantize_affine_row<4>(W, wrow, srow, brow, out);
    else dequantize_affine_row<8>(W, wrow, srow, brow, out);
    return;
  }
#endif
  unpack(W.bits, wrow, W.in, out);
  for (int g = 0; g < groups; ++g) {
    const float s = load_as_f32(srow, W.dtype, g);
    const float b = load_as_f32(brow, W.dtype, g);
    float* o = out + size_t(g) * W.group;
    // A rounded multiply, then a rounded add: the core is built with -ffp-contract=off, so
    // this is never fused into an FMA and matches mlx.core.dequantize bit for bit.
    for (int j = 0; j < W.group; ++j) o[j] = s * o[j] + b;
  }
}

void group_sums(const float* x, int T, int in, int group, float* gsum) {
  const int G = in / group;
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) {
      const float* xg = x + size_t(t) * in + size_t(g) * group;
      float sum = 0;
      for (int j = 0; j < group; ++j) sum += xg[j];  // in order: the sum is part of the canonical sequence
      gsum[size_t(t) * G + g] = sum;
    }
}

namespace {

#if defined(__AVX512F__)
// ---- AVX-512 f32 kernels -------------------------------------------------------------------
//
// The reduction order of f32 mode on AVX-512 builds, one sequence per output y[t, r] whatever
// the kernel, chunk length or thread count (the reference mode keeps the guarantee int8 has):
//
//   affine (4/8-bit, groups of 32k):           dense:
//     acc = 0 (16 lanes)                         acc = 0 (16 lanes)
//     for each group g:                          for each step k of 16 values:
//       gacc = 0 (16 lanes)                        acc = fma(w[k..k+16], x[k..k+16], acc)
//       for each step k of 16 values in g:       y = hsum(acc), then y += w[j] * x[j] for the
//         gacc = fma(u[k..k+16], x[k..k+16], gacc)  tail j >= in - in % 16, in order
//       acc = fma(gacc, s[g], acc)
//     y = hsum(acc) + sum_g b[g] * gsum[g]       (the bias sum in order, each product rounded)
//
// u: the weight codes as f32; for 4-bit rows each 32-value block is taken as its 16 even values
// (low nibbles) then its 16 odd ones, with x de-interleaved to match (MatvecInput::xd); hsum: a
// fixed tree (lanes i + i+8, then + i+4, + i+2, + i+1). Two kernels run it: fused row kernels
// straight off the packed bytes (decode and small batches) and a panel GEMM over rows expanded
// to f32 codes once per call (prefill).

// Tokens per pass of the fused kernels over a row.
constexpr int kFusedMaxT = 8;

inline float hsum(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

// One scale or bias, with its dtype fixed at compile time (no per-group switch).
template <DType SD>
inline float scalar_at(const uint8_t* p, int i) {
  if constexpr (SD == DType::F32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  } else {
    uint16_t v;
    std::memcpy(&v, p + 2 * i, 2);
    return SD == DType::BF16 ? bf16_to_f32(v) : f16_to_f32(v);
  }
}

// The codes of 16 bytes of a 4-bit row as two vectors: the 16 low nibbles (even values), the 16
// high ones (odd values).
inline void codes4(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
inline __m512 codes8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// One row of an affine-quantized matrix (4 or 8 bits) against NT tokens, straight off the packed
// bytes (nothing is written back, so decode reads each weight byte once).
template <int NT, DType SD, int BITS>
void row_affine(const Linear& W, int r, const float* x, int ldx, const float* gsum, int G, float* out, int ldo) {
  static_assert(BITS == 4 || BITS == 8, "fused kernels exist for 4 and 8 bits");
  const uint8_t* wrow = W.w + size_t(r) * (size_t(W.in) * BITS / 8);
  const size_t esz = dtype_size(W.dtype);
  const uint8_t* srow = W.scales + size_t(r) * G * esz;
  const uint8_t* brow = W.biases + size_t(r) * G * esz;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  float bias_part[NT] = {};
  for (int g = 0; g < G; ++g) {
    __m512 gacc[NT];
    for (int t = 0; t < NT; ++t) gacc[t] = _mm512_setzero_ps();
    if constexpr (BITS == 4) {
      for (int e0 = g * W.group; e0 < (g + 1) * W.group; e0 += 32) {
        __m512 lo, hi;
        codes4(wrow + e0 / 2, lo, hi);
        for (int t = 0; t < NT; ++t) {
          const float* xb = x + size_t(t) * ldx + e0;
          gacc[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), gacc[t]);
          gacc[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), gacc[t]);
        }
      }
    } else {
      for (int e0 = g * W.group; e0 < (g + 1) * W.group; e0 += 16) {
        const __m512 w = codes8(wrow + e0);
        for (int t = 0; t < NT; ++t) gacc[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + size_t(t) * ldx + e0), gacc[t]);
      }
    }
    const __m512 sc = _mm512_set1_ps(scalar_at<SD>(srow, g));
    const float bi = scalar_at<SD>(brow, g);
    for (int t = 0; t < NT; ++t) {
      acc[t] = _mm512_fmadd_ps(gacc[t], sc, acc[t]);
      bias_part[t] += bi * gsum[size_t(t) * G + g];
    }
  }
  for (int t = 0; t < NT; ++t) out[size_t(t) * ldo] = hsum(acc[t]) + bias_part[t];
}

inline __m512 load16_as_f32(const uint8_t* p, DType dt) {
  if (dt == DType::F32) return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (dt == DType::BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

// The dense tail: s += w[j] * x[j] for j < n, in order.
inline float dense_tail(float s, const float* w, const float* x, int n) {
  for (int j = 0; j < n; ++j) s += w[j] * x[j];
  return s;
}

template <int NT>
void row_dense(const Linear& W, int r, const float* x, int ldx, float* out, int ldo) {
  const size_t esz = dtype_size(W.dtype);
  const uint8_t* wrow = W.w + size_t(r) * W.in * esz;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const int main = W.in - W.in % 16;
  for (int i = 0; i < main; i += 16) {
    const __m512 w = load16_as_f32(wrow + i * esz, W.dtype);
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + size_t(t) * ldx + i), acc[t]);
  }
  float tail[16];
  for (int j = main; j < W.in; ++j) tail[j - main] = load_as_f32(wrow, W.dtype, j);
  for (int t = 0; t < NT; ++t)
    out[size_t(t) * ldo] = dense_tail(hsum(acc[t]), tail, x + size_t(t) * ldx + main, W.in - main);
}

// Rows [r0, r1) for NT tokens of a prepared input.
template <int NT>
void matvec_rows_nt(const Linear& W, const MatvecInput& in, int t0, float* y, int ldy, int64_t r0, int64_t r1) {
  const int G = W.quantized() ? W.in / W.group : 0;
  const float* xk = (in.deinterleaved ? in.xd.data() : in.x) + size_t(t0) * W.in;
  const float* gs = in.gsum.data() + size_t(t0) * G;
  auto rows = [&](auto row_fn) {
    for (int64_t r = r0; r < r1; ++r) row_fn(W, int(r), xk, W.in, gs, G, y + size_t(t0) * ldy + r, ldy);
  };
  if (!W.quantized()) {
    for (int64_t r = r0; r < r1; ++r) row_dense<NT>(W, int(r), xk, W.in, y + size_t(t0) * ldy + r, ldy);
  } else if (W.bits == 4) {
    if (W.dtype == DType::BF16) rows(row_affine<NT, DType::BF16, 4>);
    else if (W.dtype == DType::F16) rows(row_affine<NT, DType::F16, 4>);
    else rows(row_affine<NT, DType::F32, 4>);
  } else {
    if (W.dtype == DType::BF16) rows(row_affine<NT, DType::BF16, 8>);
    else if (W.dtype == DType::F16) rows(row_affine<NT, DType::F16, 8>);
    else rows(row_affine<NT, DType::F32, 8>);
  }
}

// Whether the fused kernels (and the panel GEMM, their twin in order) run W.
bool fused_f32(const Linear& W) {
  if (W.microscaled()) return false;  // the portable row path: dequantize_row, then one dot per token
  return W.quantized() ? ((W.bits == 4 || W.bits == 8) && W.group % 32 == 0) : true;
}

// ---- Larger chunks: panel GEMM in the same order ---------------------------------------------
// A panel of kPanel rows is expanded once into f32 codes (dense rows: f32 values) in the kernels'
// element order (in L2). It is swept by register tiles of kTileR rows x kTileN tokens, each
// output with its own 16-lane accumulators, exactly as the fused kernels keep them: per 16-value
// step, kTileR + kTileN loads feed kTileR * kTileN FMAs (the fused kernels re-read and re-widen
// each packed row for every 8 tokens). The values are taken kKChunk at a time, so the tile's
// slice of x stays in L1 while every row of the panel passes over it; between chunks the
// accumulators wait in a small L1 buffer. The panel is stored in the order the tiles read it
// (per chunk, per row pair, per step: the pair's two 16-value slices), one sequential stream.
// The bias term runs 16 tokens at a time on the group sums transposed to [G][16].
constexpr int kPanel = 32;
constexpr int kTileR = 2, kTileN = 6;
constexpr int kKChunk = 512;
static_assert(kPanel % kTileR == 0, "whole row pairs per panel");

// A 64-byte aligned view into a vector (the tiles' 64-byte loads must not split cache lines:
// unaligned, they ran at half speed).
inline float* aligned64(std::vector<float>& v, size_t n) {
  v.resize(n + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
}

struct F32GemmInput {
  MatvecInput x;            // x (de-interleaved for 4-bit) and its group sums
  std::vector<float> gsT;   // [ceil(T / 16)][G][16]
  std::vector<float> xa_store;
  float* xa = nullptr;      // [T, in]: x as the tiles read it, 64-byte aligned
};

void prepare_f32_gemm(const Linear& W, const float* x, int T, F32GemmInput& g) {
  g.x.prepare(W, x, T, Matmul::F32);
  g.xa = aligned64(g.xa_store, size_t(T) * W.in);
  std::memcpy(g.xa, g.x.deinterleaved ? g.x.xd.data() : x, size_t(T) * W.in * sizeof(float));
  if (!W.quantized()) return;
  const int G = W.in / W.group, groups16 = (T + 15) / 16;
  g.gsT.assign(size_t(groups16) * G * 16, 0.0f);
  for (int t = 0; t < T; ++t)
    for (int gi = 0; gi < G; ++gi) g.gsT[(size_t(t / 16) * G + gi) * 16 + t % 16] = g.x.gsum[size_t(t) * G + gi];
}

// Where the panel keeps values [k, k + 16) of row i: chunks of `chunk` values, each holding the
// row pairs' blocks of steps (16 values of both rows of the pair per step).
struct PanelLayout {
  int chunk, main;  // values per chunk; values in the panel (dense rows: without the tail)
  size_t offset(int i, int k) const {
    const int kc = k / chunk, k0 = kc * chunk, len = std::min(chunk, main - k0);
    return size_t(k0) * kPanel + (size_t(i / kTileR) * len + size_t(k - k0)) * kTileR + size_t(i % kTileR) * 16;
  }
};

// Rows [r0, r0 + nr) as f32 codes in the fused kernels' element order, at L's offsets in Q;
// rows nr .. kPanel - 1 repeat row nr - 1 (computed, never stored). Dense rows' tails (values
// past the last whole step) go to tail [kPanel][16].
void expand_panel(const Linear& W, int r0, int nr, const PanelLayout& L, float* Q, float* tail) {
  const int in = W.in;
  thread_local std::vector<float> row_store;
  row_store.resize(in);
  float* row = row_store.data();
  for (int i = 0; i < kPanel; ++i) {
    const int r = r0 + std::min(i, nr - 1);
    if (!W.quantized()) {
      convert_row(W.w + size_t(r) * W.row_bytes(), W.dtype, in, row);
      for (int k = 0; k < L.main; k += 16) std::memcpy(Q + L.offset(i, k), row + k, 16 * sizeof(float));
      std::memcpy(tail + size_t(i) * 16, row + L.main, size_t(in - L.main) * sizeof(float));
    } else if (W.bits == 4) {
      const uint8_t* p = W.w + size_t(r) * (size_t(in) / 2);
      for (int e0 = 0; e0 < in; e0 += 32) {
        __m512 lo, hi;
        codes4(p + e0 / 2, lo, hi);
        _mm512_storeu_ps(Q + L.offset(i, e0), lo);
        _mm512_storeu_ps(Q + L.offset(i, e0 + 16), hi);
      }
    } else {
      const uint8_t* p = W.w + size_t(r) * size_t(in);
      for (int e0 = 0; e0 < in; e0 += 16) _mm512_storeu_ps(Q + L.offset(i, e0), codes8(p + e0));
    }
  }
}

// Advances the accumulators of kTileR rows x N tokens (x[t]) over `len` values of one chunk:
// q, the row pair's steps in the chunk (PanelLayout); acc + 16 * (r * kTileN + t) holds output
// (r, t)'s 16 lanes. Affine: per group (sf[r][g0 + j]: row r's scale of the chunk's group j)
// gacc from zero, then acc = fma(gacc, s, acc); dense: acc itself runs through the FMAs.
template <int N, bool kAffine>
void tile_chunk(const float* q, const float* const* x, int k0, int len, int group, const float* const* sf, int g0,
                float* acc) {
  constexpr int R = kTileR;
  auto steps = [&](__m512 (&a)[R][N], int s0, int s1) {
    for (int k = s0; k < s1; k += 16) {
      __m512 w[R];
      for (int r = 0; r < R; ++r) w[r] = _mm512_loadu_ps(q + size_t(k) * R + r * 16);
      for (int t = 0; t < N; ++t) {
        const __m512 xv = _mm512_loadu_ps(x[t] + k0 + k);
        for (int r = 0; r < R; ++r) a[r][t] = _mm512_fmadd_ps(w[r], xv, a[r][t]);
      }
    }
  };
  __m512 a[R][N];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < N; ++t) a[r][t] = _mm512_loadu_ps(acc + 16 * (r * kTileN + t));
  if constexpr (kAffine) {
    for (int k = 0, g = g0; k < len; k += group, ++g) {
      __m512 ga[R][N];
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < N; ++t) ga[r][t] = _mm512_setzero_ps();
      if (group == 64) steps(ga, k, k + 64);  // the common group, with a constant trip count
      else steps(ga, k, k + group);
      for (int r = 0; r < R; ++r) {
        const __m512 sc = _mm512_set1_ps(sf[r][g]);
        for (int t = 0; t < N; ++t) a[r][t] = _mm512_fmadd_ps(ga[r][t], sc, a[r][t]);
      }
    }
  } else {
    steps(a, 0, len);
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < N; ++t) _mm512_storeu_ps(acc + 16 * (r * kTileN + t), a[r][t]);
}

template <int N>
void tile_chunk_for(bool affine, const float* q, const float* const* x, int k0, int len, int group,
                    const float* const* sf, int g0, float* acc) {
  if (affine) tile_chunk<N, true>(q, x, k0, len, group, sf, g0, acc);
  else tile_chunk<N, false>(q, x, k0, len, group, sf, g0, acc);
}

// Panels [p0, p1) of y[T, out], by the calling thread.
void f32_gemm_panels(const Linear& W, const F32GemmInput& g, float* y, int64_t p0, int64_t p1) {
  const int in = W.in, T = g.x.T, out_rows = W.out;
  const bool affine = W.quantized();
  const int group = affine ? W.group : 16, G = affine ? in / W.group : 0;
  PanelLayout L;
  L.main = affine ? in : in - in % 16;  // dense: the tail is added after the tree sum
  L.chunk = std::max(kKChunk / group, 1) * group;
  const float* X = g.xa;
  thread_local std::vector<float> q_store, tail_store, sf_store, bf_store, acc_store;
  tail_store.resize(size_t(kPanel) * 16);
  sf_store.resize(size_t(kPanel) * std::max(G, 1));
  bf_store.resize(size_t(kPanel) * std::max(G, 1));
  float* Q = aligned64(q_store, size_t(kPanel) * std::max(L.main, 16));
  float* acc_all = aligned64(acc_store, size_t(kPanel) * kTileN * 16);
  const size_t esz = dtype_size(W.dtype);
  for (int64_t p = p0; p < p1; ++p) {
    const int r0 = int(p * kPanel), nr = std::min(kPanel, out_rows - r0);
    expand_panel(W, r0, nr, L, Q, tail_store.data());
    for (int i = 0; i < nr && affine; ++i)
      for (int gi = 0; gi < G; ++gi) {
        sf_store[size_t(i) * G + gi] = load_as_f32(W.scales + size_t(r0 + i) * G * esz, W.dtype, gi);
        bf_store[size_t(i) * G + gi] = load_as_f32(W.biases + size_t(r0 + i) * G * esz, W.dtype, gi);
      }
    for (int t0 = 0; t0 < T; t0 += kTileN) {
      const int N = std::min(kTileN, T - t0);
      const float* xs[kTileN];
      for (int t = 0; t < kTileN; ++t) xs[t] = X + size_t(t0 + std::min(t, N - 1)) * in;
      std::fill(acc_all, acc_all + size_t(kPanel) * kTileN * 16, 0.0f);
      for (int k0 = 0; k0 < L.main; k0 += L.chunk) {
        const int len = std::min(L.chunk, L.main - k0);
        for (int i0 = 0; i0 < nr; i0 += kTileR) {
          const float* q = Q + L.offset(i0, k0);
          const float* sfs[kTileR];
          for (int r = 0; r < kTileR; ++r) sfs[r] = sf_store.data() + size_t(std::min(i0 + r, nr - 1)) * G;
          float* acc = acc_all + size_t(i0) * kTileN * 16;
          switch (N) {
            case 1: tile_chunk_for<1>(affine, q, xs, k0, len, group, sfs, k0 / group, acc); break;
            case 2: tile_chunk_for<2>(affine, q, xs, k0, len, group, sfs, k0 / group, acc); break;
            case 3: tile_chunk_for<3>(affine, q, xs, k0, len, group, sfs, k0 / group, acc); break;
            case 4: tile_chunk_for<4>(affine, q, xs, k0, len, group, sfs, k0 / group, acc); break;
            case 5: tile_chunk_for<5>(affine, q, xs, k0, len, group, sfs, k0 / group, acc); break;
            default: tile_chunk_for<kTileN>(affine, q, xs, k0, len, group, sfs, k0 / group, acc); break;
          }
        }
      }
      for (int i = 0; i < nr; ++i)
        for (int t = 0; t < N; ++t) {
          const float* a = acc_all + (size_t(i) * kTileN + t) * 16;
          float v = hsum(_mm512_loadu_ps(a));
          if (!affine && L.main < in)
            v = dense_tail(v, tail_store.data() + size_t(i) * 16, X + size_t(t0 + t) * in + L.main, in - L.main);
          y[size_t(t0 + t) * out_rows + r0 + i] = v;
        }
    }
    // The bias term, 16 tokens at a time, in the order of the fused kernels.
    for (int i = 0; i < nr && affine; ++i) {
      const float* bf = bf_store.data() + size_t(i) * G;
      for (int tg = 0; tg * 16 < T; ++tg) {
        __m512 bias = _mm512_setzero_ps();
        for (int gi = 0; gi < G; ++gi)
          bias = _mm512_add_ps(bias, _mm512_mul_ps(_mm512_set1_ps(bf[gi]), _mm512_loadu_ps(g.gsT.data() + (size_t(tg) * G + gi) * 16)));
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, bias);
        for (int l = 0; l < 16 && tg * 16 + l < T; ++l) y[size_t(tg * 16 + l) * out_rows + r0 + i] += lanes[l];
      }
    }
  }
}

int64_t panel_count(const Linear& W) { return (W.out + kPanel - 1) / kPanel; }
#endif  // __AVX512F__

}  // namespace

void MatvecInput::prepare(const Linear& W, const float* x_, int T_, Matmul mode) {
  x = x_;
  T = T_;
  in = W.in;
  bits = W.quantized() ? W.bits : 0;
  group = W.quantized() ? W.group : 0;
  deinterleaved = false;
  int8 = mode == Matmul::Int8 && int8_supported(W);
  if (!W.quantized()) return;
  gsum.resize(size_t(T) * (in / group));
  group_sums(x, T, in, group, gsum.data());
  if (int8) {
    xq.resize(size_t(T) * in);
    dx.resize(size_t(T) * int8_dx_per_token(in));
    quantize_activations(x, T, in, bits, xq.data(), dx.data());
    return;
  }
#if defined(__AVX512F__)
  if (bits == 4 && group % 32 == 0) {
    xd.resize(size_t(T) * in);
    for (int t = 0; t < T; ++t)
      for (int b = 0; b < in; b += 32)
        for (int i = 0; i < 16; ++i) {
          xd[size_t(t) * in + b + i] = x[size_t(t) * in + b + 2 * i];
          xd[size_t(t) * in + b + 16 + i] = x[size_t(t) * in + b + 2 * i + 1];
        }
    deinterleaved = true;
  }
#endif
}

bool MatvecInput::matches(const Linear& W) const {
  return W.in == in && (W.quantized() ? (W.bits == bits && W.group == group) : bits == 0);
}

void matvec_rows(const Linear& W, const MatvecInput& in, float* y, int ldy, int64_t r0, int64_t r1,
                 int64_t prefetch_end) {
  if (in.int8) {
    int8_rows(W, in.xq.data(), in.dx.data(), in.gsum.data(), in.T, y, ldy, r0, r1, prefetch_end);
    return;
  }
#if defined(__AVX512F__)
  if (fused_f32(W)) {
    for (int t = 0; t < in.T; t += kFusedMaxT) {
      switch (std::min(kFusedMaxT, in.T - t)) {
        case 1: matvec_rows_nt<1>(W, in, t, y, ldy, r0, r1); break;
        case 2: matvec_rows_nt<2>(W, in, t, y, ldy, r0, r1); break;
        case 3: matvec_rows_nt<3>(W, in, t, y, ldy, r0, r1); break;
        case 4: matvec_rows_nt<4>(W, in, t, y, ldy, r0, r1); break;
        case 5: matvec_rows_nt<5>(W, in, t, y, ldy, r0, r1); break;
        case 6: matvec_rows_nt<6>(W, in, t, y, ldy, r0, r1); break;
        case 7: matvec_rows_nt<7>(W, in, t, y, ldy, r0, r1); break;
        default: matvec_rows_nt<8>(W, in, t, y, ldy, r0, r1); break;
      }
    }
    return;
  }
#endif
  if (in.T <= 2 && fused_portable(W)) {  // decode; the router in every mode
    if (W.bits == 4) (in.T == 1 ? dot_affine_rows<4, 1> : dot_affine_rows<4, 2>)(W, in.x, y, ldy, r0, r1);
    else (in.T == 1 ? dot_affine_rows<8, 1> : dot_affine_rows<8, 2>)(W, in.x, y, ldy, r0, r1);
    return;
  }
  // Portable: expand each row once, one dot per token (dot's order depends on n alone).
  thread_local std::vector<float> row;
  row.resize(W.in);
  for (int64_t r = r0; r < r1; ++r) {
    const float* w = reinterpret_cast<const float*>(W.w) + size_t(r) * W.in;
    if (W.format != Linear::Format::Dense || W.dtype != DType::F32) {
      dequantize_row(W, int(r), row.data());
      w = row.data();
    }
    for (int t = 0; t < in.T; ++t) y[size_t(t) * ldy + r] = dot(w, in.x + size_t(t) * W.in, W.in);
  }
}

namespace {

// Which kernel runs a chunk of T tokens. Every kernel of a mode computes each output in that
// mode's one order (linear_int8.h for int8; the f32 order above), so this choice is speed only:
//   int8, T >= kInt8GemmMinT where the host has it: the token-vector GEMM (1.3-1.6x the row
//     kernels at 16-32 tokens, measured with benchmarks/kernels; matters for MoE expert groups);
//   f32, T >= kF32GemmMinT on AVX-512: the panel GEMM;
//   else the row kernels (matvec_rows), parallel over rows.
enum class Kernel { Rows, Int8Gemm, F32Gemm };

#if defined(__AVX512F__)
// From this many tokens the f32 panel GEMM beats the fused kernels (benchmarks/kernels).
constexpr int kF32GemmMinT = 16;
#endif

Kernel kernel_for(const Linear& W, int T, Matmul mode) {
  // Every product passes here: an interleaved matrix (linear_int8.h) has only int8 kernels.
  if (W.interleaved && mode != Matmul::Int8)
    throw std::logic_error("linear: an interleaved matrix runs in int8 mode only");
  if (mode == Matmul::Int8 && int8_supported(W)) return T >= kInt8GemmMinT && int8_gemm_supported(W) ? Kernel::Int8Gemm : Kernel::Rows;
#if defined(__AVX512F__)
  if (T >= kF32GemmMinT && fused_f32(W)) return Kernel::F32Gemm;
#endif
  return Kernel::Rows;
}

// Each job's x prepared for its W, once per distinct (x, quantization): inputs[input_of[j]]
// is job j's. Reused across calls (no per-token allocation); the caller's own instance, which
// its parallel region then reads through the reference.
struct GroupInputs {
  std::vector<MatvecInput> inputs;
  std::vector<int> input_of;
  const MatvecInput& of(int j) const { return inputs[size_t(input_of[size_t(j)])]; }
};

GroupInputs& prepare_group(const LinearJob* jobs, int n, int T, Matmul mode) {
  thread_local GroupInputs g;
  if (g.inputs.size() < size_t(n)) g.inputs.resize(size_t(n));
  g.input_of.resize(size_t(n));
  int n_inputs = 0;
  for (int j = 0; j < n; ++j) {
    const Linear& W = *jobs[j].W;
    int i = 0;
    while (i < n_inputs && !(g.inputs[size_t(i)].x == jobs[j].x && g.inputs[size_t(i)].matches(W))) ++i;
    if (i == n_inputs) g.inputs[size_t(n_inputs++)].prepare(W, jobs[j].x, T, mode);
    g.input_of[size_t(j)] = i;
  }
  return g;
}

// The row kernels over every job of a group, all rows of all jobs one index space of ONE
// parallel region (linear() runs a single matrix through here too).
void rows_group(const LinearJob* jobs, int n, int T, ThreadPool& pool, Matmul mode) {
  const GroupInputs& g = prepare_group(jobs, n, T, mode);
  thread_local std::vector<int64_t> first_row_store;  // job j's first row in the index space
  std::vector<int64_t>& first_row = first_row_store;
  first_row.resize(size_t(n) + 1);
  first_row[0] = 0;
  for (int j = 0; j < n; ++j) first_row[size_t(j) + 1] = first_row[size_t(j)] + jobs[j].W->out;
  pool.parallel_for(
      first_row[size_t(n)],
      [&](int64_t r0, int64_t r1, int) {
        const int64_t run_end = ThreadPool::run_end();  // this thread reads on to here next
        for (int j = 0; j < n; ++j) {
          const int64_t b = first_row[size_t(j)], e = first_row[size_t(j) + 1];
          const int64_t lo = std::max(r0, b), hi = std::min(r1, e);
          const Linear& W = *jobs[j].W;
          if (lo < hi) matvec_rows(W, g.of(j), jobs[j].y, W.out, lo - b, hi - b, std::min(run_end, e) - b);
        }
      },
      16);
}

}  // namespace

void linear_group(const LinearJob* jobs, int n, int T, ThreadPool& pool, Matmul mode) {
  bool rows = true;
  for (int j = 0; j < n && rows; ++j) rows = kernel_for(*jobs[j].W, T, mode) == Kernel::Rows;
  if (rows) {
    rows_group(jobs, n, T, pool, mode);
    return;
  }
  for (int j = 0; j < n; ++j) linear(*jobs[j].W, jobs[j].x, T, jobs[j].y, pool, mode);
}

void linear_sum(const LinearJob* jobs, const float* weights, int n, float* y, ThreadPool& pool, Matmul mode) {
  const int64_t out = jobs[0].W->out;
  for (int j = 0; j < n; ++j)
    if (jobs[j].W->out != out) throw std::logic_error("linear_sum: the matrices differ in their outputs");
  const GroupInputs& g = prepare_group(jobs, n, 1, mode);  // one token: the row kernels
  pool.parallel_for(
      out,
      [&](int64_t r0, int64_t r1, int) {
        const int64_t run_end = ThreadPool::run_end();
        for (int j = 0; j < n; ++j) matvec_rows(*jobs[j].W, g.of(j), jobs[j].y, int(out), r0, r1, run_end);
        // r0 is a multiple of 16 (the grain), so axpy's vector and scalar lanes fall on the
        // same outputs as over the whole row: the sum of a whole-row axpy per job, bit for bit.
        std::fill(y + r0, y + r1, 0.0f);
        for (int j = 0; j < n; ++j) axpy(weights[j], jobs[j].y + r0, y + r0, int(r1 - r0));
      },
      16);
}

void linear(const Linear& W, const float* x, int T, float* y, ThreadPool& pool, Matmul mode) {
  switch (kernel_for(W, T, mode)) {
    case Kernel::Int8Gemm: int8_gemm(W, x, T, y, &pool); return;
#if defined(__AVX512F__)
    case Kernel::F32Gemm: {
      thread_local F32GemmInput prepared;  // bound by reference: workers must see this thread's
      F32GemmInput& g = prepared;
      prepare_f32_gemm(W, x, T, g);
      pool.parallel_for(panel_count(W), [&](int64_t p0, int64_t p1, int) { f32_gemm_panels(W, g, y, p0, p1); });
      return;
    }
#endif
    default: break;
  }
  const LinearJob job{&W, x, y};
  rows_group(&job, 1, T, pool, mode);
}

void linear_serial(const Linear& W, const float* x, int T, float* y, Matmul mode) {
  switch (kernel_for(W, T, mode)) {
    case Kernel::Int8Gemm: int8_gemm(W, x, T, y, nullptr); return;
#if defined(__AVX512F__)
    case Kernel::F32Gemm: {
      thread_local F32GemmInput g;
      prepare_f32_gemm(W, x, T, g);
      f32_gemm_panels(W, g, y, 0, panel_count(W));
      return;
    }
#endif
    default: break;
  }
  thread_local MatvecInput in;
  in.prepare(W, x, T, mode);
  matvec_rows(W, in, y, W.out, 0, W.out);
}

void embedding(const Linear& W, const int32_t* tokens, int T, float* x, ThreadPool& pool) {
  pool.parallel_for(T, [&](int64_t t0, int64_t t1, int) {
    for (int64_t t = t0; t < t1; ++t) dequantize_row(W, tokens[t], x + size_t(t) * W.in);
  });
}

}  // namespace lily::cpu
