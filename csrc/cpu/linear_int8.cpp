// Integer-dot-product kernels for MLX affine weights (4 and 8 bits) against int8 activations.
//
// Why: the f32 fused kernels widen every nibble to an f32 lane and spend ~36 instructions per
// 64 bytes of weights, so decode was instruction-bound at ~2 GB/s per core. Here 32 packed bytes
// (64 weights) become two u8 vectors with one AND and one shift, and VPDPBUSD multiplies them by
// int8 activations and sums groups of four into int32 lanes.
//
// Numerics. Each row of x is quantized per block of 32 values: d = max|x| / 127, q = round(x / d).
// With weights w = s * u + b (u the unsigned code, s/b the group's scale and bias):
//   sum_j w_j x_j  =  sum_groups [ s * sum_j u_j x_j  +  b * sum_j x_j ]
//                 ~=  sum_blocks (s * d) * (sum_j u_j q_j)  +  sum_groups b * gsum
// The integer sums are exact; the only new error is the rounding of x to q (relative 1/254 of the
// block's max per element, unbiased), and the bias term keeps the f32 group sum of x. This is the
// scheme of llama.cpp's Q4_0 x Q8_0 dot product. The f32 steps run in the canonical order of
// linear_int8.h, the same in every kernel.
//
// Row kernels: rows in vector lanes. A VPDPBUSD result holds, per row, the partial dot products
// of a block spread over 4 (4-bit) or 8 (8-bit) int32 lanes. Integer sums are exact in any order,
// so a few unpack/add/shuffle steps turn the results of 16 rows (8 on AVX2) into one vector per
// block whose lane i is row i's block sum; the f32 steps then run for 16 rows at once, one FMA
// per block, and 16 consecutive outputs are stored together. For 4-bit weights byte i of a chunk
// holds weights 2i (low nibble) and 2i+1 (high), so x is stored per chunk as [evens | odds]: the
// low-nibble vector pairs with the evens, the high-nibble vector with the odds, and lane j of
// either product covers values [8j, 8j + 8) of the chunk, i.e. block j / 4.
//
// Instruction sets: AVX-512 VNNI (512-bit VPDPBUSD, 16 rows), AVX-VNNI or AVX-512 VNNI without
// BW (256-bit, 8 rows); plain AVX2 emulates VPDPBUSD with VPMADDUBSW + VPMADDWD, exact for 4-bit
// codes (2 * 15 * 127 fits an int16) but not for 8-bit codes, which therefore need VNNI. arm64 has
// its own row kernels (linear_int8_neon.cpp). Elsewhere int8_supported() is false and linear.cpp
// runs the f32 kernels.
#include "cpu/linear_int8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "cpu/linear.h"
#include "model/dtype.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <cpuid.h>
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
  const int nb = in / kInt8Block;
  for (int t = 0; t < T; ++t) {
    const float* xt = x + size_t(t) * in;
    int8_t* qt = xq + size_t(t) * in;
    float* dt = dx + size_t(t) * nb;
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
        } else {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qt + b * kInt8Block),
                           _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, vi))));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qt + b * kInt8Block + 16),
                           _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, vi))));
        }
        dt[b] = d;
        continue;
      }
#elif defined(LILY_INT8_KERNELS)
      {
        // The scalar loop's arithmetic, 8 lanes at a time: max (a NaN lane keeps the running
        // max, as std::max does), one multiply, VCVTPS2DQ (round to nearest even, as
        // nearbyint). The saturating packs are exact (|q| <= 127) but interleave 128-bit
        // lanes: one dword permute restores value order, and for 4-bit weights a byte shuffle
        // and a qword permute split it into the chunk's evens and odds.
        __m256 v[4], m = _mm256_setzero_ps();
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        for (int i = 0; i < 4; ++i) m = _mm256_max_ps(_mm256_and_ps(v[i] = _mm256_loadu_ps(xb + 8 * i), abs_mask), m);
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
        const __m256 vi = _mm256_set1_ps(inv);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vi));
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        if (bits == 4) {
          const __m256i split = _mm256_shuffle_epi8(
              ordered, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                        0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
          const __m256i eo = _mm256_permute4x64_epi64(split, 0xD8);  // [evens | odds]
          const int c0 = b * kInt8Block / kChunk4 * kChunk4, wc = std::min(kChunk4, in - c0);
          int8_t* qc = qt + c0 + (b * kInt8Block - c0) / 2;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qc), _mm256_castsi256_si128(eo));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qc + wc / 2), _mm256_extracti128_si256(eo, 1));
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(qt + b * kInt8Block), ordered);
        }
        dt[b] = d;
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
        } else {
          vst1q_s8(qb, q0);
          vst1q_s8(qb + 16, q1);
        }
        dt[b] = d;
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
      } else {
        std::memcpy(qt + b * kInt8Block, q, kInt8Block);
      }
      dt[b] = d;
    }
  }
}

bool int8_kernels_available() {
#if defined(LILY_INT8_KERNELS) || defined(LILY_INT8_NEON)
  return true;
#else
  return false;
#endif
}

#if defined(LILY_INT8_KERNELS)

namespace {

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

// Software prefetch. Why: batch-1 decode is one pass over each matrix, and the hardware
// prefetchers stop at every 4 KiB page and ramp up again on the next, which left one thread's
// loads waiting on DRAM. The row kernels prefetch each of a quad's four weight streams a
// distance ahead (rows are contiguous: near a row's end that is a later row), and the scales
// and biases of the next block of rows (StreamPrefetch), into L2 (kPrefetchLocality).
// Measured with benchmarks/kernels/matvec_bench, 248320 x 2048 4-bit (the lm_head), 1-2 threads:
// - into L2, not L1: on the CI-class AMD EPYC (Zen 4) prefetcht0 streamed 10 GB/s on one thread
//   and 19 GB/s on two, prefetcht1 19-20 and 26-27 (prefetchnta 8-10). The L1 fills of t0
//   compete with the kernel's own loads; from L2 the core's L1 prefetcher takes over.
// - the distance, about eight rows (at least 8 KiB, at most 32 KiB): with prefetcht1, 2 KiB ran
//   at 16-17 GB/s on two threads, 5 KiB at 22-23, 8-32 KiB at 26-27. (The first tuning, on an
//   Intel Xeon with prefetcht0, chose five rows: 1 KiB rows ran best at 5-6 KiB there.)
// LILY_PREFETCH_LOCALITY / LILY_PREFETCH_ROWS: build-time overrides for measuring other CPUs
// (scripts/h200/phase_l.sh sweeps them); the defaults are the measurements above.
#ifndef LILY_PREFETCH_LOCALITY
#define LILY_PREFETCH_LOCALITY 2  // __builtin_prefetch's: 2 = prefetcht1 on x86
#endif
#ifndef LILY_PREFETCH_ROWS
#define LILY_PREFETCH_ROWS 8
#endif
constexpr int kPrefetchLocality = LILY_PREFETCH_LOCALITY;
inline size_t prefetch_distance(size_t row_bytes) {
  constexpr size_t rows = LILY_PREFETCH_ROWS;  // 8: at least 8 KiB, at most 32 KiB
  return std::clamp<size_t>(rows * row_bytes, rows * 1024, rows * 4096);
}

// One row-major stream, prefetched up to a moving target (into the cache level of Locality).
template <int Locality = kPrefetchLocality>
struct StreamPrefetch {
  const uint8_t* next;  // first byte not yet prefetched
  const uint8_t* end;   // the stream's end: nothing past it is touched
  void upto(const uint8_t* target) {
    const uint8_t* t = std::min(end, target);
    // The interleaved kernel moves the target on by 256 bytes a call: four lines under one bound
    // check, not a loop of five instructions a line (interleaved_block says why that counts).
    if (t - next >= 256) {
      __builtin_prefetch(next, 0, Locality), __builtin_prefetch(next + 64, 0, Locality);
      __builtin_prefetch(next + 128, 0, Locality), __builtin_prefetch(next + 192, 0, Locality);
      next += 256;
    }
    for (; next < t; next += 64) __builtin_prefetch(next, 0, Locality);
  }
};

// ---- Block sums with rows in lanes -----------------------------------------------------------
//
// Rows are taken kRows at a time (a block of rows), four at a time within it (a quad). A quad's
// four rows are read together, front to back, step by step; each step is loaded and unpacked
// once into registers and every token of the call runs over it, and the tokens' block sums wait
// in a small buffer. Then, step by step, the quads' vectors are rearranged into one vector per
// block whose lane i is row i of the block, and each token's f32 sequence runs for the kRows
// rows at once.
//   Step<BITS>::unpack<kHalf>(rows, v) -> Codes: values [v, v + width) of the quad's rows
//     (rows[i]: row i's packed bytes) as u8 codes in registers (4-bit: 8 vectors, 8-bit: 4).
//     Step::kFull is the width of the main steps; a row may end with one half-width step (kHalf).
//   Step<BITS>::dot<kHalf>(codes, x): the quad's block sums of that step against one token (x:
//     its xq at value v) in the layout blocks() reads.
//   Step<BITS>::blocks(q, blk): the quads' vectors of one step (q[0 .. kRows / 4)) -> blk[k] =
//     the block sums of block v / 32 + k, lane i = row i; returns the number of blocks.
// (Why all tokens over one unpacked step: until then the kernel ran tokens in pairs, unpacking
// each step again per pair; unpacking once cut the decode step of 4 and 8 sequences by ~10% on the
// medium model. Per token the step then costs 8 VPDPBUSD plus the 9-instruction reduction of
// sum_lane_quads, near the VPDPBUSD throughput on Zen 4, where 512-bit VPDPBUSD and shuffles do
// not overlap; moving that reduction to the weight side, once per step, measured no faster:
// transposing the codes so tokens need only in-lane broadcasts of x (in registers, or
// broadcast once per call into a 4x copy of x) cost more than it saved, and so did staggering
// the rows across the accumulators with blends.)
// (Why quads: reading all 16 rows interleaved, no prefetch pattern we tried streamed the lm_head
// from DRAM as fast as one row at a time (15-20% short); reading rows one at a time needs a
// 16 x 16 transpose of block sums per 16 blocks, ~15% more instructions. Measured with
// benchmarks/kernels/matvec_bench.)
#if defined(LILY_INT8_AVX512)
constexpr int kRows = 16;
// Batch-1 decode reads a block's rows quad by quad, like every other call: 16 rows read together
// streamed the lm_head 15-20% slower with per-row prefetch (above), and with the block prefetched
// in address order (as on 256-bit builds) no faster on the H200 host's Xeon, within its noise.
constexpr bool kInterleavedSingleToken = false;
using IVec = __m512i;
using FVec = __m512;

// [a b c d] of each 128-bit lane k: the sums of lanes 4k .. 4k+3 of a, b, c and d.
inline __m512i sum_lane_quads(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

// v[k] = 128-bit lane k of q[0], q[1], q[2], q[3] (a 4 x 4 transpose of 128-bit lanes).
inline void transpose_lanes(const __m512i* q, __m512i* v) {
  const __m512i t0 = _mm512_shuffle_i32x4(q[0], q[1], 0x44), t1 = _mm512_shuffle_i32x4(q[0], q[1], 0xEE);
  const __m512i t2 = _mm512_shuffle_i32x4(q[2], q[3], 0x44), t3 = _mm512_shuffle_i32x4(q[2], q[3], 0xEE);
  v[0] = _mm512_shuffle_i32x4(t0, t2, 0x88);
  v[1] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
  v[2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
  v[3] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
}

// 64 bytes, or 32 zero-extended (a masked load touches no byte past the 32).
template <bool kHalf>
inline __m512i load_bytes(const void* p) {
  if constexpr (kHalf) return _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p);
  return _mm512_loadu_si512(p);
}

template <int BITS>
struct Step;

// 4-bit: 128 values per step, 64 packed bytes per row. Lane m of a row's product covers values
// [8m, 8m + 8) of the step: block m / 4. The quad vector: 128-bit lane k = the quad's rows' sums
// of the step's block k.
template <>
struct Step<4> {
  static constexpr int kFull = 128;
  struct Codes {
    __m512i lo[4], hi[4];  // row i's low and high nibbles (the step's even and odd values)
  };
  template <bool kHalf>
  static Codes unpack(const uint8_t* const* rows, int v) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    Codes c;
    for (int i = 0; i < 4; ++i) {
      const __m512i w = load_bytes<kHalf>(rows[i] + v / 2);
      c.lo[i] = _mm512_and_si512(w, m4);
      c.hi[i] = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
    }
    return c;
  }
  template <bool kHalf>
  static __m512i dot(const Codes& c, const int8_t* x) {
    constexpr int half = kHalf ? 32 : 64;  // bytes of codes per row = x bytes per parity
    const __m512i zero = _mm512_setzero_si512(), xe = load_bytes<kHalf>(x), xo = load_bytes<kHalf>(x + half);
    __m512i ia[4];
    for (int i = 0; i < 4; ++i) ia[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, c.lo[i], xe), c.hi[i], xo);
    return sum_lane_quads(ia[0], ia[1], ia[2], ia[3]);
  }
  template <bool kHalf>
  static int blocks(const __m512i* q, __m512i* blk) {
    transpose_lanes(q, blk);
    return kHalf ? 2 : 4;
  }
};

// 8-bit: 64 values = bytes per step, two blocks of 8 lanes. The quad vector: 128-bit lanes 0, 1
// = the two halves of the step's first block, lanes 2, 3 of its second.
template <>
struct Step<8> {
  static constexpr int kFull = 64;
  struct Codes {
    __m512i w[4];
  };
  template <bool kHalf>
  static Codes unpack(const uint8_t* const* rows, int v) {
    Codes c;
    for (int i = 0; i < 4; ++i) c.w[i] = load_bytes<kHalf>(rows[i] + v);
    return c;
  }
  template <bool kHalf>
  static __m512i dot(const Codes& c, const int8_t* x) {
    const __m512i zero = _mm512_setzero_si512(), xv = load_bytes<kHalf>(x);
    __m512i ia[4];
    for (int i = 0; i < 4; ++i) ia[i] = _mm512_dpbusd_epi32(zero, c.w[i], xv);
    return sum_lane_quads(ia[0], ia[1], ia[2], ia[3]);
  }
  template <bool kHalf>
  static int blocks(const __m512i* q, __m512i* blk) {
    __m512i t[4];
    transpose_lanes(q, t);
    blk[0] = _mm512_add_epi32(t[0], t[1]);
    blk[1] = _mm512_add_epi32(t[2], t[3]);
    return kHalf ? 1 : 2;
  }
};

// kRows f32 values of a parameter row (n of them there, the rest zero).
inline __m512 load_params(const uint8_t* p, DType dt, int n) {
  const __mmask16 m = __mmask16((1u << n) - 1);  // masked loads touch nothing past the n values
  if (dt == DType::F32) return _mm512_maskz_loadu_ps(m, p);
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  if (dt == DType::BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

// out[c * 16 + i] = lane c of r[i], for i, c < 16.
inline void transpose16x16(const __m512* r, float* out) {
  __m512 a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + k], 128-bit lane L: rows 4i .. 4i+3 of column 4L + k
    b[4 * i + 0] = _mm512_shuffle_ps(a[4 * i + 0], a[4 * i + 2], 0x44);
    b[4 * i + 1] = _mm512_shuffle_ps(a[4 * i + 0], a[4 * i + 2], 0xEE);
    b[4 * i + 2] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0x44);
    b[4 * i + 3] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i q[4] = {_mm512_castps_si512(b[k]), _mm512_castps_si512(b[4 + k]), _mm512_castps_si512(b[8 + k]),
                          _mm512_castps_si512(b[12 + k])};
    __m512i v[4];
    transpose_lanes(q, v);
    for (int L = 0; L < 4; ++L) _mm512_storeu_si512(out + (4 * L + k) * 16, v[L]);
  }
}
inline void transpose_rows(const __m512* r, float* out) { transpose16x16(r, out); }

inline FVec fzero() { return _mm512_setzero_ps(); }
inline FVec fload(const float* p) { return _mm512_loadu_ps(p); }
inline FVec fma_block(FVec acc, IVec sums, FVec s, float d) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(s, _mm512_set1_ps(d)), acc);
}
inline FVec fma_bias(FVec acc, FVec b, float gsum) { return _mm512_fmadd_ps(b, _mm512_set1_ps(gsum), acc); }
inline void fstore(float* y, FVec v, int n) { _mm512_mask_storeu_ps(y, __mmask16((1u << n) - 1), v); }

#else  // 256-bit: AVX2, AVX-VNNI
constexpr int kRows = 8;
// Batch-1 decode reads the block's 8 rows together (single_token_blocks). Measured on a Zen 2
// EPYC, 2 threads, GB/s of weights streamed, quad by quad -> 8 rows together: the lm_head
// (2048 x 248,320) 16.5 -> 28.4; one call each on 256 matrices of 2048 x 512 13.2 -> 19.3, of
// 512 x 2048 17.5 -> 17.9; 128 of 1024 x 2048 15.4 -> 22.4; 32 of 4096 x 2048 20.1 -> 24.4.
constexpr bool kInterleavedSingleToken = true;
using IVec = __m256i;
using FVec = __m256;

inline __m256i sum_lane_quads(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
  const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}

inline __m256i load_bytes(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// a0 · b0 + a1 · b1 (u8 x s8, summed per int32 lane) for 4-bit codes a0, a1 (<= 15).
inline __m256i dpbusd2(__m256i a0, __m256i b0, __m256i a1, __m256i b1) {
#if defined(LILY_INT8_VNNI)
  return dpbusd(dpbusd(_mm256_setzero_si256(), a0, b0), a1, b1);
#else
  // Both int16 pair sums and their sum are exact: |2 * 2 * 15 * 127| < 2^15.
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(a0, b0), _mm256_maddubs_epi16(a1, b1));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}

template <int BITS>
struct Step;

// 4-bit: 64 values per step (32 packed bytes), blocks of 4 lanes; the quad vector's 128-bit lane
// k = the quad's rows' sums of the step's block k.
template <>
struct Step<4> {
  static constexpr int kFull = 64;
  struct Codes {
    __m256i lo[4], hi[4];
  };
  template <bool kHalf>
  static Codes unpack(const uint8_t* const* rows, int v) {
    static_assert(!kHalf, "4-bit rows are multiples of 64 values");
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    Codes c;
    for (int i = 0; i < 4; ++i) {
      const __m256i w = load_bytes(rows[i] + v / 2);
      c.lo[i] = _mm256_and_si256(w, m4);
      c.hi[i] = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
    }
    return c;
  }
  template <bool kHalf>
  static __m256i dot(const Codes& c, const int8_t* x) {
    const __m256i xe = load_bytes(x), xo = load_bytes(x + 32);
    __m256i ia[4];
    for (int i = 0; i < 4; ++i) ia[i] = dpbusd2(c.lo[i], xe, c.hi[i], xo);
    return sum_lane_quads(ia[0], ia[1], ia[2], ia[3]);
  }
  // dot(unpack(rows, v), x) for a single token (single_token_blocks). On plain AVX2 each row
  // is loaded, unpacked and multiplied before the next, and the four rows' int16 partials are
  // added through the lane sums, then widened once: exact, as 16 products of 15 x 127 fit an
  // int16; 18 VPMADDUBSW / VPMADDWD per two quads instead of 24 (Zen 2 runs them on one pipe).
  static __m256i dot_rows(const uint8_t* const* rows, int v, const int8_t* x) {
#if defined(LILY_INT8_VNNI)
    return dot<false>(unpack<false>(rows, v), x);
#else
    const __m256i m4 = _mm256_set1_epi8(0x0F), xe = load_bytes(x), xo = load_bytes(x + 32);
    __m256i p[4];
    for (int i = 0; i < 4; ++i) {
      const __m256i w = load_bytes(rows[i] + v / 2);
      p[i] = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(w, m4), xe),
                              _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), m4), xo));
    }
    const __m256i ab = _mm256_add_epi16(_mm256_unpacklo_epi32(p[0], p[1]), _mm256_unpackhi_epi32(p[0], p[1]));
    const __m256i cd = _mm256_add_epi16(_mm256_unpacklo_epi32(p[2], p[3]), _mm256_unpackhi_epi32(p[2], p[3]));
    const __m256i s = _mm256_add_epi16(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
  }
  template <bool kHalf>
  static int blocks(const __m256i* q, __m256i* blk) {
    blk[0] = _mm256_permute2x128_si256(q[0], q[1], 0x20);
    blk[1] = _mm256_permute2x128_si256(q[0], q[1], 0x31);
    return 2;
  }
};

// 8-bit: 32 values = bytes per step, one block of 8 lanes; the quad vector's two 128-bit lanes
// hold its halves.
template <>
struct Step<8> {
  static constexpr int kFull = 32;
  struct Codes {
    __m256i w[4];
  };
  template <bool kHalf>
  static Codes unpack(const uint8_t* const* rows, int v) {
    static_assert(!kHalf, "8-bit rows are multiples of 32 values");
    Codes c;
    for (int i = 0; i < 4; ++i) c.w[i] = load_bytes(rows[i] + v);
    return c;
  }
  template <bool kHalf>
  static __m256i dot(const Codes& c, const int8_t* x) {
    const __m256i zero = _mm256_setzero_si256(), xv = load_bytes(x);
    __m256i ia[4];
    for (int i = 0; i < 4; ++i) ia[i] = dpbusd(zero, c.w[i], xv);
    return sum_lane_quads(ia[0], ia[1], ia[2], ia[3]);
  }
  static __m256i dot_rows(const uint8_t* const* rows, int v, const int8_t* x) {
    return dot<false>(unpack<false>(rows, v), x);
  }
  template <bool kHalf>
  static int blocks(const __m256i* q, __m256i* blk) {
    blk[0] = _mm256_add_epi32(_mm256_permute2x128_si256(q[0], q[1], 0x20), _mm256_permute2x128_si256(q[0], q[1], 0x31));
    return 1;
  }
};

// kRows f32 values of a parameter row (n of them there, the rest zero).
inline __m256 load_params(const uint8_t* p, DType dt, int n) {
  if (n < 8) {  // a zero-filled copy; only here: zeroing one on every call cost the row kernels 4-7%
    alignas(32) uint8_t tail[32] = {};
    std::memcpy(tail, p, size_t(n) * dtype_size(dt));
    return load_params(tail, dt, 8);
  }
  if (dt == DType::F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (dt == DType::BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

// out[c * 8 + i] = lane c of r[i], for i, c < 8.
inline void transpose8x8(const __m256* r, float* out) {
  __m256 t[8], q[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // q[4i + k], 128-bit lane L: rows 4i .. 4i+3 of column 4L + k
    q[4 * i + 0] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
    q[4 * i + 1] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
    q[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    q[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(out + k * 8, _mm256_permute2f128_ps(q[k], q[4 + k], 0x20));
    _mm256_storeu_ps(out + (4 + k) * 8, _mm256_permute2f128_ps(q[k], q[4 + k], 0x31));
  }
}
inline void transpose_rows(const __m256* r, float* out) { transpose8x8(r, out); }

inline FVec fzero() { return _mm256_setzero_ps(); }
inline FVec fload(const float* p) { return _mm256_loadu_ps(p); }
inline FVec fma_block(FVec acc, IVec sums, FVec s, float d) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(s, _mm256_set1_ps(d)), acc);
}
inline FVec fma_bias(FVec acc, FVec b, float gsum) { return _mm256_fmadd_ps(b, _mm256_set1_ps(gsum), acc); }
inline void fstore(float* y, FVec v, int n) {
  alignas(32) float lanes[kRows];
  _mm256_store_ps(lanes, v);
  std::memcpy(y, lanes, size_t(n) * sizeof(float));
}
#endif

// Tokens per call of rows_int8 (int8_rows splits longer chunks): each step of a quad's rows is
// unpacked once for them, and their x and block sums stay in L1 (8 tokens: 24 KiB at in = 2048
// on AVX-512, 16 KiB on AVX2). Decode batches up to 8 are one pass; longer chunks that reach
// the row kernels (arm64 prefill: no int8_gemm there) pass over the rows once per group.
constexpr int kTokenGroup = 8;

// A vector in a std::vector (which drops a bare vector type's alignment attribute).
struct IVecSlot {
  IVec v;
};

// The canonical f32 sequence (linear_int8.h), kRows rows per vector, for the blocks of step st:
// qv holds the quads' block-sum vectors of that step (Step::blocks' layout), dt the token's
// block scales, sT the block of rows' scales transposed to [group][kRows] (group = 32 << gshift).
template <int BITS>
inline FVec f32_step(FVec acc, int st, bool half, const IVec* qv, const float* dt, const float* sT, int gshift) {
  using S = Step<BITS>;
  IVec blk[4];
  const int n = half ? S::template blocks<true>(qv, blk) : S::template blocks<false>(qv, blk);
  for (int k = 0; k < n; ++k) {
    const int b = st * S::kFull / kInt8Block + k;
    acc = fma_block(acc, blk[k], fload(sT + size_t(b >> gshift) * kRows), dt[b]);
  }
  return acc;
}

// One token (batch-1 decode) against kRows whole rows from `base` (row stride wbytes, full
// steps only): all kRows rows are read together, step by step, and each step's block sums go
// straight into the f32 sequence; returns it before the bias terms. The block's rows are
// contiguous, so it is prefetched as one stream in address order, `ahead` bytes on (never at or
// past w_end), as fast as the rows are read: kRows lines per 64 bytes of row. (Prefetching each
// row's own next line, eight streams a row apart, streamed the lm_head at 20 GB/s on two Zen 2
// threads against 28 in address order.) A function of its own: inside rows_int8 the compiler
// kept the accumulator on the stack.
template <int BITS>
[[gnu::noinline]] FVec single_token_blocks(const uint8_t* base, size_t wbytes, int nsteps, const int8_t* xq,
                                           const float* dx, const float* sT, int gshift, size_t ahead,
                                           const uint8_t* w_end) {
  using S = Step<BITS>;
  FVec acc = fzero();
  for (int st = 0; st < nsteps; ++st) {
    const int v = st * S::kFull;
    const size_t done = size_t(v) * BITS / 8;  // bytes of each row read so far
    if (done % 64 == 0)
      for (int i = 0; i < kRows; ++i) {
        const uint8_t* line = base + ahead + done * kRows + i * 64;
        if (line < w_end) __builtin_prefetch(line, 0, kPrefetchLocality);
      }
    IVec qv[kRows / 4];
    for (int qd = 0; qd < kRows / 4; ++qd) {
      const uint8_t* quad[4];
      for (int i = 0; i < 4; ++i) quad[i] = base + (4 * qd + i) * wbytes;
      qv[qd] = S::dot_rows(quad, v, xq + v);
    }
    acc = f32_step<BITS>(acc, st, false, qv, dx, sT, gshift);
  }
  return acc;
}

// Rows [r0, r1) for T tokens, kRows rows at a time in the canonical order (linear_int8.h); each
// step of a quad's rows is unpacked once and serves all T tokens (a single token on 256-bit
// builds: single_token_blocks).
template <int BITS>
void rows_int8(const Linear& W, const int8_t* xq, const float* dx, const float* gsum, int T, float* y, int ldy,
               int64_t r0, int64_t r1) {
  using S = Step<BITS>;
  constexpr int kQuads = kRows / 4;
  const int in = W.in, G = in / W.group, nb = in / kInt8Block, nsteps = (in + S::kFull - 1) / S::kFull;
  const bool tail = in % S::kFull != 0;  // AVX-512 only: one half-width last step
  const int Gp = (G + kRows - 1) / kRows * kRows;  // G padded to whole transposes
  int gshift = 0;  // group = 32 << gshift
  while ((kInt8Block << gshift) < W.group) ++gshift;
  const size_t esz = dtype_size(W.dtype), wbytes = size_t(in) * BITS / 8, pbytes = size_t(G) * esz;
  // Per thread: the block of rows' scales and biases as f32, transposed to [Gp][kRows] (lane i
  // = row i); the quads' block-sum vectors [kQuads][nsteps][T].
  thread_local std::vector<float> params_store;
  thread_local std::vector<IVecSlot> sums_store;
  params_store.resize(size_t(2) * Gp * kRows);
  sums_store.resize(size_t(T) * kQuads * nsteps);
  float* sT = params_store.data();      // [Gp][kRows]
  float* bT = sT + size_t(Gp) * kRows;  // [Gp][kRows]
  IVecSlot* sums = sums_store.data();  // [kQuads][nsteps][T]
  // Nothing past this call's rows is touched. (Prefetching on into the next rows, which the
  // thread pool usually hands the same thread next, sped up 2-thread expert GEMVs on a Zen 2
  // 17.5 -> 20.3 GB/s, but at the end of a thread's share those rows are the next thread's,
  // already read: with many threads and small matrices that is a second read of a share's
  // first rows in every call.)
  const uint8_t* w_end = W.w + size_t(r1) * wbytes;
  const size_t pf_distance = prefetch_distance(wbytes), pf_interleaved = 2 * pf_distance;
  StreamPrefetch<> spf{W.scales + size_t(r0) * pbytes, W.scales + size_t(r1) * pbytes};
  StreamPrefetch<> bpf{W.biases + size_t(r0) * pbytes, W.biases + size_t(r1) * pbytes};
  for (int64_t rb = r0; rb < r1; rb += kRows) {
    const int nr = int(std::min<int64_t>(kRows, r1 - rb));
    // Rows past the end repeat the last one: their lanes are computed and never stored. (Only the
    // quad path reads these, but set after the single-token branch, GCC's code for the loop ran
    // that branch 10-15% slower on Zen 2.)
    const uint8_t* rows[kRows];
    for (int i = 0; i < kRows; ++i) rows[i] = W.w + size_t(rb + std::min(i, nr - 1)) * wbytes;
    const int64_t next = rb + nr, next_rows = std::min<int64_t>(kRows, r1 - next);
    spf.upto(W.scales + size_t(next + next_rows) * pbytes);
    bpf.upto(W.biases + size_t(next + next_rows) * pbytes);
    // kRows groups of kRows rows at a time: loaded, widened to f32 and transposed in registers.
    for (int g = 0; g < G; g += kRows) {
      const int n = std::min(kRows, G - g);
      FVec sr[kRows], br[kRows];
      for (int i = 0; i < kRows; ++i) {
        const size_t at = size_t(rb + std::min(i, nr - 1)) * pbytes + size_t(g) * esz;
        sr[i] = load_params(W.scales + at, W.dtype, n);
        br[i] = load_params(W.biases + at, W.dtype, n);
      }
      transpose_rows(sr, sT + size_t(g) * kRows);
      transpose_rows(br, bT + size_t(g) * kRows);
    }
    // The bias terms of token t, after its block terms (acc), and its outputs.
    auto f32_finish = [&](FVec acc, int t) {
      const float* gt = gsum + size_t(t) * G;
      for (int g = 0; g < G; ++g) acc = fma_bias(acc, fload(bT + size_t(g) * kRows), gt[g]);
      fstore(y + size_t(t) * ldy + rb, acc, nr);
    };
    if constexpr (kInterleavedSingleToken) if (!tail && T == 1 && nr == kRows) {
      f32_finish(single_token_blocks<BITS>(W.w + size_t(rb) * wbytes, wbytes, nsteps, xq, dx, sT, gshift,
                                           pf_interleaved, w_end), 0);
      continue;
    }
    // Integer sums, quad by quad, step by step: the quad's step is loaded and unpacked once into
    // registers (S::Codes), then every token runs over it (sums: tokens innermost, so the stores
    // are contiguous). The rows stream from memory: each of the quad's four streams is prefetched
    // pf_distance ahead.
    for (int qd = 0; qd < kQuads; ++qd) {
      const uint8_t* const* qrows = rows + 4 * qd;
      for (int st = 0; st < nsteps; ++st) {
        const int v = st * S::kFull;
        for (int i = 0; i < 4; ++i) {
          const uint8_t* ahead = qrows[i] + size_t(v) * BITS / 8 + pf_distance;
          if (ahead < w_end) __builtin_prefetch(ahead, 0, kPrefetchLocality);
        }
        auto tokens = [&](auto half) {
          constexpr bool kHalf = decltype(half)::value;
          const typename S::Codes codes = S::template unpack<kHalf>(qrows, v);
          IVecSlot* out = sums + (size_t(qd) * nsteps + st) * T;
          for (int t = 0; t < T; ++t) out[t].v = S::template dot<kHalf>(codes, xq + size_t(t) * in + v);
        };
#if defined(LILY_INT8_AVX512)
        if (tail && st == nsteps - 1) tokens(std::true_type());
        else
#endif
          tokens(std::false_type());
      }
    }
    for (int t = 0; t < T; ++t) {
      FVec acc = fzero();
      for (int st = 0; st < nsteps; ++st) {
        IVec qv[kQuads];
        for (int qd = 0; qd < kQuads; ++qd) qv[qd] = sums[(size_t(qd) * nsteps + st) * T + t].v;
        acc = f32_step<BITS>(acc, st, tail && st == nsteps - 1, qv, dx + size_t(t) * nb, sT, gshift);
      }
      f32_finish(acc, t);
    }
  }
}

#if defined(LILY_INT8_AVX512)
// ---- Interleaved rows (Linear::interleaved) ---------------------------------------------------
//
// The layout: rows 16 at a time, each block of 16 rows one contiguous run of bytes, read front to
// back once: [chunk 0 | chunk 1 | ... | biases]. A chunk is the scales of the groups that fill one
// 64-byte line ([group][16], lane i = row i: two groups of bf16 or f16 scales, one of f32), then
// those groups' codes; the biases ([group][16]) come last, where the kernel adds their term. The
// codes: for each activation block b (32 values = 16 packed bytes of a row) and each 4-byte slice
// k of it, one 64-byte vector whose 32-bit lane i holds bytes [16b + 4k, 16b + 4k + 4) of row i.
// So one VPDPBUSD of a weight vector against a broadcast of the 4 activation bytes it pairs with
// adds those products to each row's own lane: a block's integer sums come out with rows in lanes,
// with no lane reduction (sum_lane_quads) and no transposes of the scales, and a thread's rows
// are one sequential stream. About half the vector instructions per weight byte of the quad
// kernel above: on one Zen 5 thread, 4-bit 2048-wide rows ran 99 against 44 GB/s from L2 and 36
// against 28 from DRAM (the lm_head), and the engine's decode went +25-31% at 1-2 threads
// (docs/performance.md, "Interleaved rows"). On the H200 host's Xeon, whose threads are bound by
// their DRAM streams, no change could be measured.
// Why the scales and biases sit inside the block, not in tensors of their own: a thread then
// streams one run of memory instead of three (docs/performance.md, "One stream per thread").
// Why each group's scales sit right before its codes, not all of a block's scales at its front
// (the layout until 2026-12-05): the kernel then reads every byte in address order, which is the
// pattern the hardware prefetchers follow best. On the Zen 4 VM the old order (scales, biases and
// codes read as three streams through each 18 KiB block) kept one thread's lm_head at 22 GB/s
// against `membw`'s 30 whatever the software prefetch; in address order and with no software
// prefetch it reads 27-29, and two threads 56-59 against `membw`'s 59 (docs/performance.md,
// "One stream in address order").
// Per token, the same canonical sequence (linear_int8.h) as every kernel here.
constexpr int kInterleave = 16;

// The interleaved kernel's stream is prefetched into L2 (prefetcht1) on Intel, not at all on AMD
// family 19h (Zen 4, the only AVX-512 CPUs of that family), and into L1 (prefetcht0) elsewhere
// (Zen 5); the row kernels' several streams always go to L2 (kPrefetchLocality says why).
// Measured with benchmarks/kernels/pool_bench.cpp (interleaved, the prefetch 8 rows ahead,
// alternated) and the medium model's decode:
// - Zen 5 VM, the scales-first layout: one thread, the lm_head 36.9-39.6 GB/s into L1 against
//   34.9-37.4 into L2 (36.2-37.6 into L3), the 256 expert matrices 2048 x 512 34.4-38.8 against
//   33.0-36.7; two threads in the VM's fast bandwidth state 76-82 GB/s against 72.6-77.0 (membw:
//   83). 4 rows ahead ran 33-35, 16 rows 36-38. At full size on the H200 host's Xeon, 16 threads:
//   decode +10-16% with L1 (docs/performance.md, "Its stream into L1").
// - Intel Xeon (family 6 model 207: the 2-core VM and the H200 host), the address-order layout:
//   with no software prefetch the 2-core VM's two threads read the lm_head at 16-21 GB/s against
//   21-31 into L1 (membw 28-33). Each pass as a ratio to the membw bests bracketing it, 6
//   alternations: into L1 median 0.905, into L2 0.962 (16-64 KiB ahead, or L2 far and L1 near,
//   no better). The medium model's decode, 2 threads, the builds alternated 6 times: into L2
//   36-42 tok/s, median 68-70% of the bracketing membw, against 35-38 and 65-67% into L1
//   (docs/performance.md, "On Intel"). At full size on the H200 host, 16 threads: decode 48.5
//   and 46.9 tok/s into L2 against 47.7 and 44.3 into L1 (there, "Run 8").
// - Zen 4 VM (family 19h model 11h), the address-order layout: one thread, the lm_head 27-29
//   GB/s with no software prefetch against 22-24 into L1 and 20-22 into L2 (membw 29-30); two
//   threads in the VM's fast state 56-59 against 47-49 into L1 (membw 59); the 256 matrices
//   2048 x 512 32-35 against 30-32.5, 512 x 2048 35-39 against 32-34.5; prefetching only the
//   first 4 or 16 KiB of each run no better (docs/performance.md, "One stream in address
//   order"). With the scales-first layout L2 had been its best (one thread 22-23, two 44-45).
// LILY_INTERLEAVED_PREFETCH_LOCALITY (3 = L1, 2 = L2, 0 = no software prefetch) fixes it at
// build time.
int interleaved_prefetch_locality() {
#if defined(LILY_INTERLEAVED_PREFETCH_LOCALITY)
  return LILY_INTERLEAVED_PREFETCH_LOCALITY;
#else
  static const int locality = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return 3;
    if (ebx == 0x756e6547 && edx == 0x49656e69 && ecx == 0x6c65746e) return 2;  // "GenuineIntel"
    const bool amd = ebx == 0x68747541 && edx == 0x69746e65 && ecx == 0x444d4163;  // "AuthenticAMD"
    if (!amd || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 3;
    const unsigned family = ((eax >> 8) & 0xF) + (((eax >> 8) & 0xF) == 0xF ? (eax >> 20) & 0xFF : 0);
    return family == 0x19 ? 0 : 3;
  }();
  return locality;
#endif
}

// The interleaved kernel with no software prefetch: the hardware prefetchers follow the stream.
struct NoPrefetch {
  void upto(const uint8_t*) {}
};

// Where a block's parts lie, in bytes from its first one (the layout above).
struct InterleavedLayout {
  size_t esz;           // bytes of one scale or bias
  int groups;           // per row: in / group
  int per_chunk;        // groups per chunk: 16 rows' scales of them fill 64 bytes
  int blocks_per_group; // activation blocks (32 values, 256 bytes of a block's codes) per group
  size_t chunk_bytes;   // a whole chunk: its scales, then its groups' codes
  size_t stride;        // a whole block, from one to the next: codes, scales and biases

  explicit InterleavedLayout(const Linear& W)
      : esz(dtype_size(W.dtype)), groups(W.in / W.group), per_chunk(int(64 / (kInterleave * esz))),
        blocks_per_group(W.group / kInt8Block),
        chunk_bytes(size_t(per_chunk) * (kInterleave * esz + size_t(blocks_per_group) * 256)),
        stride(size_t(groups) * (2 * kInterleave * esz + size_t(blocks_per_group) * 256)) {}
  // Groups in chunk c (the last one may hold fewer).
  int chunk_groups(int c) const { return std::min(per_chunk, groups - c * per_chunk); }
  // The 16 rows' scales of group g.
  size_t scales(int g) const { return size_t(g / per_chunk) * chunk_bytes + size_t(g % per_chunk) * kInterleave * esz; }
  // The 256 bytes of codes of activation block b.
  size_t codes(int b) const {
    const int g = b / blocks_per_group, c = g / per_chunk;
    return size_t(c) * chunk_bytes + size_t(chunk_groups(c)) * kInterleave * esz +
           size_t((g % per_chunk) * blocks_per_group + b % blocks_per_group) * 256;
  }
  // The 16 rows' biases of group g: after every chunk.
  size_t biases(int g) const {
    return size_t(groups) * (kInterleave * esz + size_t(blocks_per_group) * 256) + size_t(g) * kInterleave * esz;
  }
};

// acc + VPDPBUSD(u, the 4 bytes at x in every 32-bit lane), the broadcast embedded in the
// instruction ({1to16}): one fused load-and-multiply where GCC emits a separate broadcast load for
// _mm512_set1_epi32 of the bytes.
inline __m512i dpbusd_bcast(__m512i acc, __m512i u, const int8_t* x) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

// The tokens' outputs of rows [r0, r1) of one interleaved block (rows [rb, rb + 16)), its bytes
// read in address order: per chunk the scales, then per activation block its codes; the biases.
// Why the loop is kept to few instructions per byte, though it waits on memory: on the 2-core
// Xeon VM (family 6 model 207) a core streams less the more instructions ride on each line, far
// below what it could execute. benchmarks/kernels/stream_ceiling.cpp, two threads, as shares of
// the plain reads' bandwidth in the same rounds: the stream alone 92-94%, with this loop's
// arithmetic 86-89%, with half of it 90-92%. Hence one load per 64 bytes (kept from being folded
// into both masks), the high nibbles masked in place instead of shifted, the activations'
// broadcasts embedded in the VPDPBUSDs, four prefetches under one bound check, and the cursors
// in registers: ~50 instructions executed per 256 bytes of codes instead of ~78, the same sums
// (docs/performance.md, "Fewer instructions a line, measured in one process").
template <int T, class Prefetch>
[[gnu::noinline]] void interleaved_block(const Linear& W, const InterleavedLayout& L, const uint8_t* blk,
                                         const int8_t* xq, const float* dx, const float* gsum, float* y, int ldy,
                                         int64_t rb, int64_t r0, int64_t r1, Prefetch& stream) {
  Prefetch pf = stream;  // the cursor in a register: through the reference it is reloaded and stored every step
  const int in = W.in, nb = in / kInt8Block, G = L.groups;
  const size_t esz = L.esz, ahead = prefetch_distance(size_t(in) / 2), params = size_t(kInterleave) * esz;
  const __m512i m4 = _mm512_set1_epi8(0x0F), mF0 = _mm512_set1_epi8(char(0xF0));
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  const uint8_t* p = blk;  // the next byte to read
  // x's even values of block b at chunk offset (b % 4) * 16 of xq's 128-value chunks, its odd ones
  // 64 bytes on (the layout [evens | odds]): xb = xq + (b / 4) * 128 + (b % 4) * 16.
  const int8_t* xb = xq;
  for (int c = 0, b = 0; c * L.per_chunk < G; ++c) {
    const int ng = L.chunk_groups(c);
    const uint8_t* scales = p;
    p += ng * params;
    for (int g = 0; g < ng; ++g) {
      const __m512 s = load_params(scales + g * params, W.dtype, kInterleave);
      for (int j = 0; j < L.blocks_per_group; ++j, ++b, p += 256, xb += (b % 4 == 0 ? 80 : 16)) {
        pf.upto(p + 256 + ahead);
        // Integer sums per token. Up to 4 tokens (8 sums + 4 accumulators in registers) the low
        // nibbles (v & 0x0F) and the high ones left in place (v & 0xF0: 16x their codes) go to two
        // chains, and I = lo + (hi >> 4), exact since the high chain's sum is 16x an integer; that
        // spares a shift per 64 bytes for one per block. Beyond 4 tokens one chain (8 VPDPBUSDs
        // deep) per token, so the high nibbles are shifted down first.
        constexpr bool kTwoChains = T <= 4;
        __m512i lo_sum[T], hi_sum[T];
        for (int t = 0; t < T; ++t) lo_sum[t] = hi_sum[t] = _mm512_setzero_si512();
        for (int k = 0; k < 4; ++k) {
          __m512i v = _mm512_loadu_si512(p + k * 64);
          __asm__("" : "+v"(v));  // one load: GCC would fold it into each use and read the line twice
          const __m512i lo = _mm512_and_si512(v, m4);
          const __m512i hi = kTwoChains ? _mm512_and_si512(v, mF0) : _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
          for (int t = 0; t < T; ++t) {
            const int8_t* xt = xb + size_t(t) * in + 4 * k;
            lo_sum[t] = dpbusd_bcast(lo_sum[t], lo, xt);
            __m512i& h = kTwoChains ? hi_sum[t] : lo_sum[t];
            h = dpbusd_bcast(h, hi, xt + 64);
          }
        }
        for (int t = 0; t < T; ++t) {
          const __m512i sum = kTwoChains ? _mm512_add_epi32(lo_sum[t], _mm512_srai_epi32(hi_sum[t], 4)) : lo_sum[t];
          acc[t] = fma_block(acc[t], sum, s, dx[size_t(t) * nb + b]);
        }
      }
    }
  }
  // p is at the biases now. Lanes of rows outside [r0, r1) are computed and never stored.
  const __mmask16 keep = __mmask16(((1u << (r1 - rb)) - 1) & ~((1u << (r0 - rb)) - 1));
  for (int t = 0; t < T; ++t) {
    const float* gt = gsum + size_t(t) * G;
    for (int g = 0; g < G; ++g) acc[t] = fma_bias(acc[t], load_params(p + g * params, W.dtype, kInterleave), gt[g]);
    _mm512_mask_storeu_ps(y + size_t(t) * ldy + rb, keep, acc[t]);
  }
  stream = pf;
}

// The blocks of rows [r0, r1), one after another, with the stream prefetcher pf (NoPrefetch or
// StreamPrefetch).
template <class Prefetch>
void interleaved_blocks(const Linear& W, const InterleavedLayout& L, const int8_t* xq, const float* dx,
                        const float* gsum, int T, float* y, int ldy, int64_t r0, int64_t r1, Prefetch pf) {
  for (int64_t R = r0 / kInterleave; R <= (r1 - 1) / kInterleave; ++R) {
    const int64_t rb = R * kInterleave, a = std::max(r0, rb), z = std::min(r1, rb + kInterleave);
    const uint8_t* blk = W.scales + size_t(R) * L.stride;  // the block's first byte: its first scales
    // y + (a - rb) .. : the block's lanes start at rb; a store only touches rows [a, z).
    switch (T) {
#define LILY_INTERLEAVED_CASE(n) \
  case n: interleaved_block<n>(W, L, blk, xq, dx, gsum, y, ldy, rb, a, z, pf); break;
      LILY_INTERLEAVED_CASE(1) LILY_INTERLEAVED_CASE(2) LILY_INTERLEAVED_CASE(3) LILY_INTERLEAVED_CASE(4)
      LILY_INTERLEAVED_CASE(5) LILY_INTERLEAVED_CASE(6) LILY_INTERLEAVED_CASE(7) LILY_INTERLEAVED_CASE(8)
#undef LILY_INTERLEAVED_CASE
    }
  }
}

// Rows [r0, r1) of an interleaved W for T <= kTokenGroup tokens. Where the stream is prefetched
// (interleaved_prefetch_locality), it is prefetched on to the block of row pf_end - 1 (>= r1):
// prefetching on into the rows the thread reads next (ThreadPool::run_end) keeps the stream
// going from one piece of a share to the next, where it used to start cold at each: the 256
// matrices 2048 x 512 in turn (pool_bench, 2 threads, Zen 4 VM, scales-first layout into L2)
// 24-27.5 -> 27.3-28.8 GB/s, 512 x 2048 26-27.7 -> 28-30.5.
void interleaved_rows(const Linear& W, const int8_t* xq, const float* dx, const float* gsum, int T, float* y, int ldy,
                      int64_t r0, int64_t r1, int64_t pf_end) {
  const InterleavedLayout L(W);
  // Nothing past the blocks of [r0, pf_end) is touched.
  const uint8_t *from = W.scales + size_t(r0 / kInterleave) * L.stride,
                *to = W.scales + size_t((pf_end - 1) / kInterleave + 1) * L.stride;
  switch (interleaved_prefetch_locality()) {
  case 0: interleaved_blocks(W, L, xq, dx, gsum, T, y, ldy, r0, r1, NoPrefetch{}); break;
  case 2: interleaved_blocks(W, L, xq, dx, gsum, T, y, ldy, r0, r1, StreamPrefetch<2>{from, to}); break;
  default: interleaved_blocks(W, L, xq, dx, gsum, T, y, ldy, r0, r1, StreamPrefetch<3>{from, to}); break;
  }
}
#endif

}  // namespace

bool int8_supported(const Linear& W) {
  if (!W.quantized() || W.in / W.group > 2048 || W.group % kInt8Block != 0) return false;
  const int blocks = W.group / kInt8Block;  // per group: a power of two (32 << gshift)
  if ((blocks & (blocks - 1)) != 0) return false;
  if (W.bits == 4) return W.in % 64 == 0;  // 4-bit chunks are 64 or 128 values
#if defined(LILY_INT8_VNNI)
  if (W.bits == 8) return true;
#endif
  return false;
}

void int8_rows(const Linear& W, const int8_t* xq, const float* dx, const float* gsum, int T, float* y, int ldy,
               int64_t r0, int64_t r1, int64_t prefetch_end) {
  // Tokens in groups of at most kTokenGroup, each group a pass over the rows.
  const int nb = int8_dx_per_token(W.in), G = W.in / W.group;
  for (int t0 = 0; t0 < T; t0 += kTokenGroup) {
    const int nt = std::min(kTokenGroup, T - t0);
    const int8_t* xg = xq + size_t(t0) * W.in;
    const float *dg = dx + size_t(t0) * nb, *gg = gsum + size_t(t0) * G;
    float* yg = y + size_t(t0) * ldy;
#if defined(LILY_INT8_AVX512)
    if (W.interleaved) {
      // Only the last token group's pass reads on past r1 next.
      interleaved_rows(W, xg, dg, gg, nt, yg, ldy, r0, r1, t0 + nt == T ? std::max(r1, prefetch_end) : r1);
      continue;
    }
#endif
    if (W.bits == 4) rows_int8<4>(W, xg, dg, gg, nt, yg, ldy, r0, r1);
    else rows_int8<8>(W, xg, dg, gg, nt, yg, ldy, r0, r1);
  }
}

#elif !defined(LILY_INT8_NEON)  // no AVX2 nor NEON: the f32 kernels serve both modes

bool int8_supported(const Linear&) { return false; }
void int8_rows(const Linear&, const int8_t*, const float*, const float*, int, float*, int, int64_t, int64_t, int64_t) {}

#endif

bool int8_interleavable(const Linear& W) {
#if defined(LILY_INT8_AVX512)
  // 4-bit only (8-bit rows are already one block per lane quad); whole blocks of 16 rows; whole
  // 128-value chunks of x (interleaved_block's offsets into the xq layout).
  return int8_supported(W) && W.bits == 4 && W.out % kInterleave == 0 && W.in % 128 == 0 && !W.interleaved;
#else
  return false;
#endif
}

size_t interleaved_bytes(const Linear& W) {
  if (!int8_interleavable(W)) throw std::logic_error("interleaved_bytes: matrix not interleavable");
  return W.nbytes();  // the same bytes, only their order changes
}

Linear interleave_rows(const Linear& W, uint8_t* dst) {
#if defined(LILY_INT8_AVX512)
  if (!int8_interleavable(W)) throw std::logic_error("interleave_rows: matrix not interleavable");
  const InterleavedLayout L(W);
  const int G = L.groups;
  const size_t rbytes = size_t(W.in) / 2, esz = L.esz;
  for (int64_t R = 0; R < W.out / kInterleave; ++R) {
    uint8_t* blk = dst + size_t(R) * L.stride;
    // Scales and biases: [16 rows][G] -> [G][16], each group's 16 where the layout puts it.
    const size_t first = size_t(R) * kInterleave * G;  // the block's first row's first group
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < kInterleave; ++i) {
        std::memcpy(blk + L.scales(g) + i * esz, W.scales + (first + size_t(i) * G + g) * esz, esz);
        std::memcpy(blk + L.biases(g) + i * esz, W.biases + (first + size_t(i) * G + g) * esz, esz);
      }
    // Codes: [16 rows][rbytes] -> per activation block b, [4 slices][16 rows][4 bytes]; one
    // 16 x 16 transpose of 4-byte slices per 64 bytes of each row (four blocks).
    const uint8_t* rows = W.w + size_t(R) * kInterleave * rbytes;
    alignas(64) float t[kInterleave * kInterleave];
    for (size_t j = 0; j < rbytes; j += 64) {
      __m512 r[kInterleave];
      for (int i = 0; i < kInterleave; ++i) r[i] = _mm512_loadu_ps(rows + i * rbytes + j);
      transpose16x16(r, t);  // t[k * 16 + i]: row i's slice j / 4 + k
      for (int q = 0; q < 4; ++q) std::memcpy(blk + L.codes(int(j / 16) + q), t + q * 4 * kInterleave, 256);
    }
  }
  Linear out = W;
  // Every block is read through its first byte (kernels add R * stride and the layout's offsets).
  out.scales = out.biases = out.w = dst;
  out.interleaved = true;
  return out;
#else
  (void)W, (void)dst;
  throw std::logic_error("interleave_rows: this build has no interleaved kernels");
#endif
}

}  // namespace lily::cpu


// ---- Larger chunks: tokens in vectors ---------------------------------------------------------
//
// For larger T the row kernels would re-read (and re-unpack) each weight row once per token
// group. Here the roles turn: a vector holds one 4-byte slice of x for kLanes tokens (16 in a
// 512-bit vector, 8 in a 256-bit one; x is transposed once per call into
// Xp[token group][dword][kLanes]), and each weight dword is broadcast against it, so one
// VPDPBUSD does 4 values x kLanes tokens. Weight rows are unpacked to u8 codes once per call
// (kGemmRows at a time, into L1) and then swept by every token group.
//   AVX-512: per 8 rows x 32 values x 16 tokens: 8 x loads, 64 broadcasts, 64 VPDPBUSD, 24 scale
//   ops (8 rows rather than 4: +6% measured, the x loads shared by more rows).
//   AVX2 (no VNNI): VPMADDUBSW + VPMADDWD, as in the row kernels, but the block's eight
//   VPMADDUBSW results per row are summed in int16 and widened by one VPMADDWD per block (exact:
//   |8 * 2 * 15 * 127| < 2^15), where the row kernels widen every pair of them. On the Zen 2
//   CPU these were measured on the multiply pipe is what bounds both, so this is ~1.4x the row
//   kernels at 16 tokens and more (benchmarks/kernels/matvec_bench, 2048 x 1024, one thread).
// Block scales and group sums are transposed the same way (dxT, gsT), so the per-block scale is
// one vector multiply per row and the bias term one FMA per group. Each lane (token) of a row's
// accumulator runs the canonical sequence of linear_int8.h: the row kernels' result exactly.
namespace lily::cpu {

#if defined(LILY_INT8_KERNELS)

namespace {

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

// kTailRows: a last token group this short goes to the row kernels instead (a partial group
// costs what a full one does). 256-bit, 2048 x 512, one thread on a Zen 2 EPYC: the row kernels
// ran 63-67 GFLOP/s at 4-8 tokens, this GEMM 86 at 8 tokens (one group), so tails of up to 6
// tokens are cheaper as rows. AVX-512: not measured on such a host since; no split.
#if defined(LILY_INT8_AVX512)
constexpr int kLanes = 16;     // tokens per vector
constexpr int kGemmRows = 16;  // rows unpacked per step (16 x in bytes in L1)
static_assert(kGemmRows == kInterleave, "gemm_rows takes an interleaved W one whole block a step");
constexpr int kGemmR = 8;      // rows per register block (8 int32 + 8 f32 accumulators in zmm)
constexpr int kTailRows = 0;
#else
constexpr int kLanes = 8;
constexpr int kGemmRows = 8;  // 16 KiB of codes at in = 2048: with a token group's x, in L1
constexpr int kGemmR = 4;     // 4 int + 4 f32 accumulators, 2 x, 2 broadcasts, 1 constant: 13 ymm
constexpr int kTailRows = 6;
#endif
static_assert(kInt8GemmMinT >= kLanes || kTailRows == 0, "a chunk of kInt8GemmMinT tokens has a whole group");

struct GemmInput {
  int T = 0, in = 0, G = 0, nb = 0;
  int Tv = 0, groups = 0;  // tokens in vectors (the first Tv), in groups of kLanes; the rest: rows
  std::vector<int8_t> xq;
  std::vector<float> dx, gsum;
  std::vector<int32_t> Xp;  // [groups][in / 4][kLanes]
  std::vector<float> dxT;   // [groups][nb][kLanes]
  std::vector<float> gsT;   // [groups][G][kLanes]
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
  const int in = W.in, G = in / W.group, nb = in / kInt8Block;
  g.T = T;
  g.in = in;
  g.G = G;
  g.nb = nb;
  g.Tv = T % kLanes <= kTailRows ? T - T % kLanes : T;
  g.groups = (g.Tv + kLanes - 1) / kLanes;
  g.xq.resize(size_t(T) * in);
  g.dx.resize(size_t(T) * nb);
  g.gsum.resize(size_t(T) * G);
  quantize_activations(x, T, in, W.bits, g.xq.data(), g.dx.data());
  group_sums(x, T, in, W.group, g.gsum.data());
  g.Xp.assign(size_t(g.groups) * (in / 4) * kLanes, 0);
  g.dxT.assign(size_t(g.groups) * nb * kLanes, 0.0f);
  g.gsT.assign(size_t(g.groups) * G * kLanes, 0.0f);
  for (int t = 0; t < g.Tv; ++t) {
    const int tg = t / kLanes, l = t % kLanes;
    const int32_t* q = reinterpret_cast<const int32_t*>(g.xq.data() + size_t(t) * in);
    int32_t* xp = g.Xp.data() + size_t(tg) * (in / 4) * kLanes + l;
    for (int k = 0; k < in / 4; ++k) xp[size_t(k) * kLanes] = q[k];
    const float* d = g.dx.data() + size_t(t) * nb;
    float* dt = g.dxT.data() + size_t(tg) * nb * kLanes + l;
    for (int b = 0; b < nb; ++b) dt[size_t(b) * kLanes] = d[b];
    const float* gsum = g.gsum.data() + size_t(t) * G;
    float* gs = g.gsT.data() + size_t(tg) * G * kLanes + l;
    for (int gi = 0; gi < G; ++gi) gs[size_t(gi) * kLanes] = gsum[gi];
  }
}

// Rows [i0, i0 + kGemmR) of the unpacked rows (cw[r]: row r's codes as dwords, sf/bf[r]: its
// scales and biases) against one token group: y_lanes[r] = kLanes outputs of row r, each in the
// canonical order.
#if defined(LILY_INT8_AVX512)
using GemmVec = __m512;
inline void gemm_block(const int32_t* const* cw, const float* const* sf, const float* const* bf, int in, int bits,
                       int group, const int32_t* xp, const float* dxT, const float* gsT, __m512* facc) {
  const int nb = in / kInt8Block, G = in / group;
  for (int r = 0; r < kGemmR; ++r) facc[r] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    int e0, o0;
    block_dwords(b, in, bits, e0, o0);
    __m512i ia[kGemmR];
    for (int r = 0; r < kGemmR; ++r) ia[r] = _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k) {
      const __m512i xe = _mm512_loadu_si512(xp + size_t(e0 + k) * kLanes);
      const __m512i xo = _mm512_loadu_si512(xp + size_t(o0 + k) * kLanes);
      for (int r = 0; r < kGemmR; ++r) {
        ia[r] = _mm512_dpbusd_epi32(ia[r], _mm512_set1_epi32(cw[r][e0 + k]), xe);
        ia[r] = _mm512_dpbusd_epi32(ia[r], _mm512_set1_epi32(cw[r][o0 + k]), xo);
      }
    }
    const __m512 d = _mm512_loadu_ps(dxT + size_t(b) * kLanes);
    const int gi = b * kInt8Block / group;
    for (int r = 0; r < kGemmR; ++r)
      facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), _mm512_mul_ps(_mm512_set1_ps(sf[r][gi]), d), facc[r]);
  }
  for (int gi = 0; gi < G; ++gi) {
    const __m512 gs = _mm512_loadu_ps(gsT + size_t(gi) * kLanes);
    for (int r = 0; r < kGemmR; ++r) facc[r] = _mm512_fmadd_ps(_mm512_set1_ps(bf[r][gi]), gs, facc[r]);
  }
}
#else
using GemmVec = __m256;
inline void gemm_block(const int32_t* const* cw, const float* const* sf, const float* const* bf, int in, int bits,
                       int group, const int32_t* xp, const float* dxT, const float* gsT, __m256* facc) {
  const int nb = in / kInt8Block, G = in / group;
  for (int r = 0; r < kGemmR; ++r) facc[r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    int e0, o0;
    block_dwords(b, in, bits, e0, o0);
    // The block's x slices stay in registers; each row then runs its 8 products to one int32
    // sum per token (row by row: interleaving the rows spilled the int16 partials).
    __m256i xv[8];
    for (int k = 0; k < 4; ++k) {
      xv[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + size_t(e0 + k) * kLanes));
      xv[4 + k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + size_t(o0 + k) * kLanes));
    }
    const __m256 d = _mm256_loadu_ps(dxT + size_t(b) * kLanes);
    const int gi = b * kInt8Block / group;
    for (int r = 0; r < kGemmR; ++r) {
      const int32_t* we = cw[r] + e0;
      const int32_t* wo = cw[r] + o0;
#if defined(LILY_INT8_VNNI)
      __m256i ia = _mm256_setzero_si256();
      for (int k = 0; k < 4; ++k)
        ia = dpbusd(dpbusd(ia, _mm256_set1_epi32(we[k]), xv[k]), _mm256_set1_epi32(wo[k]), xv[4 + k]);
#else
      // int16 pair sums, added over the block in int16 (4-bit codes only: see above), widened once
      __m256i p[4];
      for (int k = 0; k < 4; ++k)
        p[k] = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32(we[k]), xv[k]),
                                _mm256_maddubs_epi16(_mm256_set1_epi32(wo[k]), xv[4 + k]));
      const __m256i ia = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                                           _mm256_set1_epi16(1));
#endif
      facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(_mm256_set1_ps(sf[r][gi]), d), facc[r]);
    }
  }
  for (int gi = 0; gi < G; ++gi) {
    const __m256 gs = _mm256_loadu_ps(gsT + size_t(gi) * kLanes);
    for (int r = 0; r < kGemmR; ++r) facc[r] = _mm256_fmadd_ps(_mm256_set1_ps(bf[r][gi]), gs, facc[r]);
  }
}
#endif

// Row i's packed codes -> u8 codes in the xq layout (4-bit: per chunk of kChunk4 values, the low
// nibbles, then the high).
void unpack_row(const uint8_t* wrow, int in, int bits, uint8_t* cr) {
  if (bits == 8) {
    std::memcpy(cr, wrow, in);
    return;
  }
  int v = 0;
#if defined(LILY_INT8_AVX512)
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (; v + 128 <= in; v += 128) {
    const __m512i w = _mm512_loadu_si512(wrow + v / 2);
    _mm512_storeu_si512(cr + v, _mm512_and_si512(w, m4));
    _mm512_storeu_si512(cr + v + 64, _mm512_and_si512(_mm512_srli_epi16(w, 4), m4));
  }
#endif
  const __m256i m = _mm256_set1_epi8(0x0F);
  for (; v < in; v += 64) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + v / 2));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(cr + v), _mm256_and_si256(w, m));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(cr + v + 32), _mm256_and_si256(_mm256_srli_epi16(w, 4), m));
  }
}

#if defined(LILY_INT8_AVX512)
// Rows [rb, rb + 16) of an interleaved W (rb % 16 == 0) as row-major packed rows, dst [16][in / 2]:
// per 64 bytes of each row (four activation blocks), one 16 x 16 transpose of the block's 4-byte
// slices. (Gathering a row's slices one by one cost the 512-token prefill 6% on a Zen 5 VM.)
void deinterleave_block(const Linear& W, const InterleavedLayout& L, int64_t rb, uint8_t* dst) {
  const size_t rbytes = size_t(W.in) / 2;
  const uint8_t* blk = W.w + size_t(rb / kInterleave) * L.stride;
  alignas(64) float t[kInterleave * kInterleave];
  for (size_t j = 0; j < rbytes; j += 64) {
    __m512 r[kInterleave];  // r[4q + k]: slice k of activation block j / 16 + q (lane i: row i)
    for (int q = 0; q < 4; ++q)
      for (int k = 0; k < 4; ++k) r[4 * q + k] = _mm512_loadu_ps(blk + L.codes(int(j / 16) + q) + k * 64);
    transpose16x16(r, t);   // t[i * 16 + k]: row i's slice j / 4 + k
    for (int i = 0; i < kInterleave; ++i) std::memcpy(dst + i * rbytes + j, t + i * kInterleave, 64);
  }
}

// The same block's scales or biases as f32, out [16][G].
void deinterleave_params(const Linear& W, const InterleavedLayout& L, bool biases, int64_t rb, float* out) {
  const int G = L.groups;
  const uint8_t* blk = W.scales + size_t(rb / kInterleave) * L.stride;
  alignas(64) float t[kInterleave * kInterleave];
  for (int g0 = 0; g0 < G; g0 += kInterleave) {
    const int n = std::min(kInterleave, G - g0);
    __m512 r[kInterleave];  // r[k]: group g0 + k of the 16 rows (zero past G)
    for (int k = 0; k < kInterleave; ++k)
      r[k] = k < n ? load_params(blk + (biases ? L.biases(g0 + k) : L.scales(g0 + k)), W.dtype, kInterleave)
                   : _mm512_setzero_ps();
    transpose16x16(r, t);
    for (int i = 0; i < kInterleave; ++i) std::memcpy(out + size_t(i) * G + g0, t + i * kInterleave, n * sizeof(float));
  }
}
#endif

// Rows [r0, r1) of y for every token, by the calling thread.
void gemm_rows(const Linear& W, const GemmInput& g, float* y, int64_t r0, int64_t r1) {
  const int in = W.in, G = g.G, nb = g.nb, dw = in / 4;
  const size_t esz = dtype_size(W.dtype), wbytes = size_t(in) * W.bits / 8;
  thread_local std::vector<uint8_t> codes_store;
  thread_local std::vector<float> sf_store, bf_store;
  codes_store.resize(size_t(kGemmRows) * in);
  sf_store.resize(size_t(kGemmRows) * G);
  bf_store.resize(size_t(kGemmRows) * G);
  uint8_t* codes = codes_store.data();
  float* sf = sf_store.data();
  float* bf = bf_store.data();
  // An interleaved W: each step is one whole block (parallel_for hands out whole grains of
  // kGemmRows == kInterleave rows, and W.out % 16 == 0), made row-major here.
  thread_local std::vector<uint8_t> block_store;
  for (int64_t rb = r0; rb < r1; rb += kGemmRows) {
    const int nr = int(std::min<int64_t>(kGemmRows, r1 - rb));
    const uint8_t* packed = W.w + size_t(rb) * wbytes;  // [nr][wbytes]
#if defined(LILY_INT8_AVX512)
    if (W.interleaved) {
      block_store.resize(kInterleave * wbytes);
      const InterleavedLayout L(W);
      deinterleave_block(W, L, rb, block_store.data());
      deinterleave_params(W, L, false, rb, sf);
      deinterleave_params(W, L, true, rb, bf);
      packed = block_store.data();
    }
#endif
    for (int i = 0; i < nr; ++i) {
      unpack_row(packed + size_t(i) * wbytes, in, W.bits, codes + size_t(i) * in);
      if (W.interleaved) continue;
      row_params(W.scales + size_t(rb + i) * G * esz, W.dtype, G, sf + size_t(i) * G);
      row_params(W.biases + size_t(rb + i) * G * esz, W.dtype, G, bf + size_t(i) * G);
    }
    for (int tg = 0; tg < g.groups; ++tg) {
      const int nt = std::min(kLanes, g.Tv - tg * kLanes);
      for (int i0 = 0; i0 < nr; i0 += kGemmR) {
        const int R = std::min(kGemmR, nr - i0);
        // Rows past the end repeat the last one: computed, never stored.
        const int32_t* cw[kGemmR];
        const float *sr[kGemmR], *br[kGemmR];
        for (int r = 0; r < kGemmR; ++r) {
          const int i = i0 + std::min(r, R - 1);
          cw[r] = reinterpret_cast<const int32_t*>(codes + size_t(i) * in);
          sr[r] = sf + size_t(i) * G;
          br[r] = bf + size_t(i) * G;
        }
        GemmVec facc[kGemmR];
        gemm_block(cw, sr, br, in, W.bits, W.group, g.Xp.data() + size_t(tg) * dw * kLanes,
                   g.dxT.data() + size_t(tg) * nb * kLanes, g.gsT.data() + size_t(tg) * G * kLanes, facc);
        for (int r = 0; r < R; ++r) {
          alignas(64) float lanes[kLanes];
          std::memcpy(lanes, &facc[r], sizeof(lanes));
          for (int l = 0; l < nt; ++l) y[size_t(tg * kLanes + l) * W.out + rb + i0 + r] = lanes[l];
        }
      }
    }
  }
  if (g.Tv < g.T)  // the short tail: row kernels, the same canonical order
    int8_rows(W, g.xq.data() + size_t(g.Tv) * in, g.dx.data() + size_t(g.Tv) * nb, g.gsum.data() + size_t(g.Tv) * G,
              g.T - g.Tv, y + size_t(g.Tv) * W.out, W.out, r0, r1);
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
