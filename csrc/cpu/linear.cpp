#include "cpu/linear.h"

#include <algorithm>
#include <cstring>
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

}  // namespace

void dequantize_row(const Linear& W, int row, float* out) {
  const uint8_t* wrow = W.w + size_t(row) * W.row_bytes();
  if (!W.quantized()) {
    convert_row(wrow, W.dtype, W.in, out);
    return;
  }
  unpack(W.bits, wrow, W.in, out);
  const int groups = W.in / W.group;
  const size_t esz = dtype_size(W.dtype);
  const uint8_t* srow = W.scales + size_t(row) * groups * esz;
  const uint8_t* brow = W.biases + size_t(row) * groups * esz;
  for (int g = 0; g < groups; ++g) {
    const float s = load_as_f32(srow, W.dtype, g);
    const float b = load_as_f32(brow, W.dtype, g);
    float* o = out + size_t(g) * W.group;
    // A rounded multiply, then a rounded add: the core is built with -ffp-contract=off, so
    // this is never fused into an FMA and matches mlx.core.dequantize bit for bit.
    for (int j = 0; j < W.group; ++j) o[j] = s * o[j] + b;
  }
}

namespace {

#if defined(__AVX512F__)
// ---- AVX-512 kernels -------------------------------------------------------------------
//
// Decode and small batches (T <= kFusedMaxT) run fused kernels straight off the packed
// weights: each 16-byte load is widened to 16 int32 lanes, turned into floats and multiplied
// into the activations, group by group; the group's scale multiplies the group's partial
// sums and the bias term uses the precomputed group sums of x:
//   y[t, r] = sum_g  s[r,g] * sum_{j in g} q[r,j] x[t,j]  +  b[r,g] * sum_{j in g} x[t,j]
// Nothing is written back to memory, so decode reads each weight byte exactly once.
//
// 4-bit rows hold element 2i in the low nibble of byte i and 2i+1 in the high nibble, so x is
// de-interleaved once per call into blocks of 32: [x0 x2 .. x30 | x1 x3 .. x31].

constexpr int kFusedMaxT = 8;
// Above this many tokens the panel GEMM wins over re-reading packed weights per 8 tokens.
constexpr int kPanelMinT = 32;

inline float hsum(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float s = 0;
  for (float l : lanes) s += l;
  return s;
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

// One row of an affine-quantized matrix (4 or 8 bits) against NT tokens. Per group, the
// partial dot products gacc[t] are scaled once; the bias term uses the group sums of x.
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
      // 16 bytes = 32 weights: low nibbles pair with x's even block half, high with the odd.
      const __m512i low4 = _mm512_set1_epi32(0xF);
      for (int e0 = g * W.group; e0 < (g + 1) * W.group; e0 += 32) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + e0 / 2)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, low4));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        for (int t = 0; t < NT; ++t) {
          const float* xb = x + size_t(t) * ldx + e0;
          gacc[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), gacc[t]);
          gacc[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), gacc[t]);
        }
      }
    } else {
      for (int e0 = g * W.group; e0 < (g + 1) * W.group; e0 += 16) {
        const __m512 w = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + e0))));
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

template <int NT>
void row_dense(const Linear& W, int r, const float* x, int ldx, float* out, int ldo) {
  const size_t esz = dtype_size(W.dtype);
  const uint8_t* wrow = W.w + size_t(r) * W.in * esz;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= W.in; i += 16) {
    const __m512 w = load16_as_f32(wrow + i * esz, W.dtype);
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + size_t(t) * ldx + i), acc[t]);
  }
  for (int t = 0; t < NT; ++t) {
    float s = hsum(acc[t]);
    for (int j = i; j < W.in; ++j) s += load_as_f32(wrow, W.dtype, j) * x[size_t(t) * ldx + j];
    out[size_t(t) * ldo] = s;
  }
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
#endif  // __AVX512F__

#if defined(__AVX512F__)
// ---- Larger chunks: panel GEMM ----------------------------------------------------------
// A panel of kPanel rows is expanded once into a k-major f32 buffer Wt[in][kPanel] (in L2),
// then swept by a register-blocked micro-kernel: kMR tokens x kPanel rows of accumulators,
// each k step = 2 weight loads, kMR broadcasts, 2*kMR FMAs.
constexpr int kPanel = 32;
constexpr int kMR = 6;

template <int MR>
void micro_kernel(const float* Wt, int in, const float* x, int ldx, float* y, int ldy, int nr) {
  __m512 acc0[MR], acc1[MR];
  for (int t = 0; t < MR; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
  for (int k = 0; k < in; ++k) {
    const __m512 w0 = _mm512_load_ps(Wt + size_t(k) * kPanel);
    const __m512 w1 = _mm512_load_ps(Wt + size_t(k) * kPanel + 16);
    for (int t = 0; t < MR; ++t) {
      const __m512 bx = _mm512_set1_ps(x[size_t(t) * ldx + k]);
      acc0[t] = _mm512_fmadd_ps(w0, bx, acc0[t]);
      acc1[t] = _mm512_fmadd_ps(w1, bx, acc1[t]);
    }
  }
  for (int t = 0; t < MR; ++t) {
    alignas(64) float tmp[kPanel];
    _mm512_store_ps(tmp, acc0[t]);
    _mm512_store_ps(tmp + 16, acc1[t]);
    std::memcpy(y + size_t(t) * ldy, tmp, size_t(nr) * sizeof(float));
  }
}

// Panels [p0, p1) of y[T, out], in the calling thread.
void panel_rows(const Linear& W, const float* x, int T, float* y, int64_t p0, int64_t p1) {
  const int in = W.in, out = W.out;
  thread_local std::vector<float> wt_store, row;
  wt_store.resize(size_t(in) * kPanel + 16);
  row.resize(in);
  // 64-byte aligned view for the aligned loads.
  float* Wt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(wt_store.data()) + 63) & ~uintptr_t(63));
  for (int64_t p = p0; p < p1; ++p) {
    const int r0 = int(p * kPanel), nr = std::min(kPanel, out - r0);
    for (int i = 0; i < nr; ++i) {
      dequantize_row(W, r0 + i, row.data());
      for (int k = 0; k < in; ++k) Wt[size_t(k) * kPanel + i] = row[k];
    }
    for (int i = nr; i < kPanel; ++i)
      for (int k = 0; k < in; ++k) Wt[size_t(k) * kPanel + i] = 0.0f;
    int t = 0;
    for (; t + kMR <= T; t += kMR) micro_kernel<kMR>(Wt, in, x + size_t(t) * in, in, y + size_t(t) * out + r0, out, nr);
    switch (T - t) {
      case 1: micro_kernel<1>(Wt, in, x + size_t(t) * in, in, y + size_t(t) * out + r0, out, nr); break;
      case 2: micro_kernel<2>(Wt, in, x + size_t(t) * in, in, y + size_t(t) * out + r0, out, nr); break;
      case 3: micro_kernel<3>(Wt, in, x + size_t(t) * in, in, y + size_t(t) * out + r0, out, nr); break;
      case 4: micro_kernel<4>(Wt, in, x + size_t(t) * in, in, y + size_t(t) * out + r0, out, nr); break;
      case 5: micro_kernel<5>(Wt, in, x + size_t(t) * in, in, y + size_t(t) * out + r0, out, nr); break;
      default: break;
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
  const int G = in / group;
  gsum.resize(size_t(T) * G);
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) {
      float sum = 0;
      for (int j = 0; j < group; ++j) sum += x[size_t(t) * in + g * group + j];
      gsum[size_t(t) * G + g] = sum;
    }
  if (int8) {
    xq.resize(size_t(T) * in);
    dx.resize(size_t(T) * int8_dx_per_token(in, bits));
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

void matvec_rows(const Linear& W, const MatvecInput& in, float* y, int ldy, int64_t r0, int64_t r1) {
  if (in.int8) {
    for (int t = 0; t < in.T; t += 8)
      int8_rows(W, in.xq.data(), in.dx.data(), in.gsum.data(), t, std::min(8, in.T - t), y, ldy, r0, r1);
    return;
  }
#if defined(__AVX512F__)
  const bool fused = W.quantized() ? ((W.bits == 4 || W.bits == 8) && W.group % 32 == 0) : true;
  if (fused) {
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
  // Portable: expand each row once, one dot per token.
  thread_local std::vector<float> row;
  row.resize(W.in);
  for (int64_t r = r0; r < r1; ++r) {
    const float* w = reinterpret_cast<const float*>(W.w) + size_t(r) * W.in;
    if (W.quantized() || W.dtype != DType::F32) {
      dequantize_row(W, int(r), row.data());
      w = row.data();
    }
    for (int t = 0; t < in.T; ++t) y[size_t(t) * ldy + r] = dot(w, in.x + size_t(t) * W.in, W.in);
  }
}

void linear(const Linear& W, const float* x, int T, float* y, ThreadPool& pool, Matmul mode) {
  // int8: from kInt8GemmMinT tokens the token-vector GEMM beats the row kernels (measured with
  // benchmarks/kernels: 1.3-1.6x at 16-32 tokens), which matters for MoE expert groups.
  if (mode == Matmul::Int8 && T >= kInt8GemmMinT && int8_gemm_supported(W)) {
    int8_gemm(W, x, T, y, &pool);
    return;
  }
#if defined(__AVX512F__)
  // Large chunks: expand each panel of weights once and sweep it with a register-blocked
  // micro-kernel. Small ones (decode, small expert groups): fused kernels off the packed bytes.
  if (T > kPanelMinT) {
    pool.parallel_for(panel_count(W), [&](int64_t p0, int64_t p1, int) { panel_rows(W, x, T, y, p0, p1); });
    return;
  }
#endif
  // Reused across calls (no per-token allocation). Bound to a plain reference: a lambda that
  // named the thread_local itself would see each worker thread's own (empty) instance.
  thread_local MatvecInput prepared;
  MatvecInput& in = prepared;
  in.prepare(W, x, T, mode);
  pool.parallel_for(W.out, [&](int64_t r0, int64_t r1, int) { matvec_rows(W, in, y, W.out, r0, r1); }, 16);
}

void linear_serial(const Linear& W, const float* x, int T, float* y, Matmul mode) {
  // int8: from kInt8GemmMinT tokens the token-vector GEMM beats the row kernels (measured with
  // benchmarks/kernels: 1.3-1.6x at 16-32 tokens), which matters for MoE expert groups.
  if (mode == Matmul::Int8 && T >= kInt8GemmMinT && int8_gemm_supported(W)) {
    int8_gemm(W, x, T, y, nullptr);
    return;
  }
#if defined(__AVX512F__)
  if (T > kPanelMinT) {
    panel_rows(W, x, T, y, 0, panel_count(W));
    return;
  }
#endif
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
