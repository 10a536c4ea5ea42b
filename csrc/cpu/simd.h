// The few vector primitives the CPU kernels are built from, written once per instruction set
// (AVX-512, AVX2+FMA, NEON) with a scalar fallback. Each keeps several independent
// accumulators so the FMA latency is hidden; results therefore differ from a sequential sum in
// the last bits, well inside the engine's 1e-4 tolerance against PyTorch.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace lily::cpu {

// dot's final sum of its accumulators, per instruction set (also used by the kernels that run
// dot's order straight off packed weights: cpu/linear.cpp).
#if defined(__AVX512F__)
#elif defined(__AVX2__) && defined(__FMA__)
inline float dot_sum(__m256 s0, __m256 s1) {
  const __m256 v = _mm256_add_ps(s0, s1);
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_shuffle_ps(r, r, 1));
  return _mm_cvtss_f32(r);
}
#elif defined(__ARM_NEON)
inline float dot_sum(float32x4_t s0, float32x4_t s1, float32x4_t s2, float32x4_t s3) {
  return vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
}
#endif

// sum_i a[i] * b[i]
inline float dot(const float* a, const float* b, int n) {
  int i = 0;
#if defined(__AVX512F__)
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
  }
  for (; i + 16 <= n; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
  // Horizontal sum through memory: gcc 12's _mm512_reduce_add_ps trips -Wuninitialized.
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_add_ps(s0, s1));
  float s = 0;
  for (float l : lanes) s += l;
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  float s = dot_sum(s0, s1);
#elif defined(__ARM_NEON)
  float32x4_t s0 = vdupq_n_f32(0), s1 = vdupq_n_f32(0), s2 = vdupq_n_f32(0), s3 = vdupq_n_f32(0);
  for (; i + 16 <= n; i += 16) {
    s0 = vfmaq_f32(s0, vld1q_f32(a + i), vld1q_f32(b + i));
    s1 = vfmaq_f32(s1, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
    s2 = vfmaq_f32(s2, vld1q_f32(a + i + 8), vld1q_f32(b + i + 8));
    s3 = vfmaq_f32(s3, vld1q_f32(a + i + 12), vld1q_f32(b + i + 12));
  }
  float s = dot_sum(s0, s1, s2, s3);
#else
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  float s = (s0 + s1) + (s2 + s3);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[i] += alpha * x[i]
inline void axpy(float alpha, const float* x, float* y, int n) {
  int i = 0;
#if defined(__AVX512F__)
  const __m512 va = _mm512_set1_ps(alpha);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 va = _mm256_set1_ps(alpha);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#elif defined(__ARM_NEON)
  const float32x4_t va = vdupq_n_f32(alpha);
  for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vfmaq_f32(vld1q_f32(y + i), va, vld1q_f32(x + i)));
#endif
  for (; i < n; ++i) y[i] += alpha * x[i];
}

// x[i] = exp(x[i] - shift), returning the sum: the softmax numerator. The vector paths use
// exp(r) for r = x - n ln2 in [-ln2/2, ln2/2] as its degree-7 Taylor polynomial (truncation
// error r^8/8! < 6e-9, below f32 rounding) scaled by 2^n; inputs below -87 flush to ~0, as in
// softmax they must.
#if defined(__AVX512F__)
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // a NaN passes (MAXPS returns its 2nd operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln 2 split in two so n * ln2_hi is exact for |n| <= 127.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.4286068203094173e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // a NaN passes, as above
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.4286068203094173e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  // 2^n through the exponent field (n >= -126 after the clamp above).
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// x[j] *= scale for j < n; returns the largest of init and those products: the scalar loop
//   for (j < n) m = std::max(m, x[j] *= scale);   (m = init)
// with the products' maximum taken 16 lanes at a time. Why: that loop is a chain of n
// dependent compares (attention's online softmax runs it per row and block); in lanes, the
// decode step's attention at 4K positions ran ~4% faster on the 2-core Xeon VM
// (docs/performance.md, "Attention's stalls"). The result is the loop's: a maximum is exact in
// any order, and a NaN product is passed over as std::max(m, NaN) passes it (MAXPS returns its
// second operand, the running maximum, when either is NaN; the lanes then hold no NaN).
inline float scale_max(float* x, int n, float scale, float init) {
  int i = 0;
  float m = init;
#if defined(__AVX512F__)
  const __m512 vs = _mm512_set1_ps(scale);
  __m512 acc = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), vs);
    _mm512_storeu_ps(x + i, v);
    acc = _mm512_max_ps(v, acc);
  }
  if (i < n) {
    const __mmask16 k = __mmask16((1u << (n - i)) - 1);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), vs);
    _mm512_mask_storeu_ps(x + i, k, v);
    acc = _mm512_mask_max_ps(acc, k, v, acc);
    i = n;
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  float lane_max = -INFINITY;
  for (float l : lanes) lane_max = std::max(lane_max, l);
  if (n > 0) m = std::max(m, lane_max);
#endif
  for (; i < n; ++i) m = std::max(m, x[i] *= scale);
  return m;
}

inline float exp_shift_sum(float* x, int n, float shift) {
  int i = 0;
  float sum = 0;
#if defined(__AVX512F__)
  const __m512 vs = _mm512_set1_ps(shift);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vs));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  for (float l : lanes) sum += l;
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vs = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vs));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float l : lanes) sum += l;
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

// y[i] *= alpha
inline void scale(float alpha, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] *= alpha;
}

// FVec: the build's widest f32 vector (16 lanes on AVX-512, 8 on AVX2, 4 on NEON), for kernels
// that keep a fixed-width slice in registers across a loop (gdn.cpp's recurrence) and are written
// once over it. Each operation is per lane and the one axpy / scale use (fmadd: one fused
// multiply-add), so a kernel over FVec gives the same bits at every width.
#if defined(__AVX512F__)
struct FVec {
  static constexpr int kWidth = 16;
  __m512 v;
  static FVec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static FVec splat(float a) { return {_mm512_set1_ps(a)}; }
  static FVec zero() { return {_mm512_setzero_ps()}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
inline FVec operator*(FVec a, FVec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline FVec operator-(FVec a, FVec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline FVec fmadd(FVec a, FVec b, FVec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
#define LILY_FVEC 1
#elif defined(__AVX2__) && defined(__FMA__)
struct FVec {
  static constexpr int kWidth = 8;
  __m256 v;
  static FVec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static FVec splat(float a) { return {_mm256_set1_ps(a)}; }
  static FVec zero() { return {_mm256_setzero_ps()}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
};
inline FVec operator*(FVec a, FVec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline FVec operator-(FVec a, FVec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline FVec fmadd(FVec a, FVec b, FVec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
#define LILY_FVEC 1
#elif defined(__ARM_NEON)
struct FVec {
  static constexpr int kWidth = 4;
  float32x4_t v;
  static FVec load(const float* p) { return {vld1q_f32(p)}; }
  static FVec splat(float a) { return {vdupq_n_f32(a)}; }
  static FVec zero() { return {vdupq_n_f32(0.0f)}; }
  void store(float* p) const { vst1q_f32(p, v); }
};
inline FVec operator*(FVec a, FVec b) { return {vmulq_f32(a.v, b.v)}; }
inline FVec operator-(FVec a, FVec b) { return {vsubq_f32(a.v, b.v)}; }
inline FVec fmadd(FVec a, FVec b, FVec c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
#define LILY_FVEC 1
#endif

// ---- Element-wise maps through exp ----------------------------------------------------------
//
// sigmoid and silu of one value (libm's exp), and of a vector where the instruction set has
// exp_ps. exp_neg(x) = exp(-x): past -x = 88 it is +inf, as libm's exp overflows to (exp_ps's
// own 2^n would overflow AVX2's exponent field there), so sigmoid and silu are 0 and -0 there;
// a NaN stays NaN, as with libm (MINPS returns its second operand when either is NaN).
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
#if defined(__AVX512F__)
inline __m512 exp_neg(__m512 x) {
  const __m512 nx = -x, cap = _mm512_set1_ps(88.0f);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(nx, cap, _CMP_GT_OQ), exp_ps(_mm512_min_ps(cap, nx)),
                              _mm512_set1_ps(INFINITY));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_neg(__m256 x) {
  const __m256 nx = -x, cap = _mm256_set1_ps(88.0f);
  return _mm256_blendv_ps(exp_ps(_mm256_min_ps(cap, nx)), _mm256_set1_ps(INFINITY), _mm256_cmp_ps(nx, cap, _CMP_GT_OQ));
}
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define LILY_VEXP 1
template <class V>
inline V sigmoid(V x) { return 1.0f / (1.0f + exp_neg(x)); }
template <class V>
inline V silu(V x) { return x / (1.0f + exp_neg(x)); }
#endif

// out[i] = f(in[i]...) for i < n (out may be one of the inputs). f is generic: it runs on
// vectors where the instruction set has exp_ps (the vector types' operators, sigmoid and silu
// above), else on floats. The last n % width values go through the same vector code (masked,
// or copied into a zero-padded vector), so a value's result never depends on n or on where it
// sits in the range: prefill and decode, any chunking, any split of the work over threads.
// Why: these maps run once per token per layer on every activation (the DeltaNet conv's SiLU,
// its gated norm, the attention's output gate, SwiGLU), and libm's exp per value cost ~70 us of
// a ~6.5 ms medium-model decode step at 2 threads (docs/performance.md, "Where a decode step
// goes").
template <class F, class... In>
inline void map_elementwise(float* out, size_t n, F f, const In*... in) {
  size_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, f(_mm512_loadu_ps(in + i)...));
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, m, f(_mm512_maskz_loadu_ps(m, in + i)...));
  }
#elif defined(LILY_VEXP)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, f(_mm256_loadu_ps(in + i)...));
  if (i < n) {
    auto tail = [&](const float* p) {
      float v[8] = {};
      for (size_t j = i; j < n; ++j) v[j - i] = p[j];
      return _mm256_loadu_ps(v);
    };
    float r[8];
    _mm256_storeu_ps(r, f(tail(in)...));
    for (size_t j = i; j < n; ++j) out[j] = r[j - i];
  }
#else
  for (; i < n; ++i) out[i] = f(in[i]...);
#endif
}
// log(1 + e^x) as torch computes it (linear above 20 to avoid overflow).
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

}  // namespace lily::cpu
