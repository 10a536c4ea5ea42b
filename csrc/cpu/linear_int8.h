// Integer dot products for affine-quantized weights against int8-quantized activations (the
// `cpu_matmul="int8"` mode). Internal to the CPU backend: linear.cpp prepares the activations
// (MatvecInput) and dispatches here; nothing else includes this header.
//
// Shapes: W [out, in] packed (4 or 8 bits), x [T, in] quantized in blocks of 32.
#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cpu/thread_pool.h"
#include "model/weights.h"

namespace lily::cpu {

// Elements per activation block: one int8 scale per 32 values of x, as llama.cpp's Q8_0.
constexpr int kInt8Block = 32;

// arm64 builds: the row kernels are NEON (linear_int8_neon.cpp), with 4-bit chunks of 32 values.
#if defined(__aarch64__) && defined(__ARM_NEON)
#define LILY_INT8_NEON 1
#endif

// Whether this build has integer kernels for W (its bits and group size).
bool int8_supported(const Linear& W);

// x[T, in] -> xq (int8, in the kernel's element order: for 4-bit weights each chunk of 64 values
// is stored [x0 x2 .. x62 | x1 x3 .. x63], matching the nibble order of 32 packed bytes; chunks
// are 128 values on AVX-512 and 32 on NEON, one vector register of packed bytes) and dx
// (the block scales: for 4-bit, one per 32-bit lane of a 256-bit vector, in / 8 per token; for
// 8-bit one per block, in / 32 per token).
void quantize_activations(const float* x, int T, int in, int bits, int8_t* xq, float* dx);
// Sizes of xq and dx for one token.
inline int int8_dx_per_token(int in, int bits) { return bits == 4 ? in / 8 : in / kInt8Block; }

// Rows [r0, r1) of y[t, r] (row stride ldy) for tokens [t0, t0 + nt), nt <= 8. gsum [T, G]
// holds the exact f32 sums of x per weight group (the affine bias term).
void int8_rows(const Linear& W, const int8_t* xq, const float* dx, const float* gsum, int t0, int nt, float* y,
               int ldy, int64_t r0, int64_t r1);

// The part of int8_rows both kernel sets (x86, NEON) share: moves the inputs to token t0 and
// calls rows(std::integral_constant<int, NT>, xq, dx, gsum, y) with NT = nt (at most 8), so each
// set instantiates its row kernel for every token count it may be given.
template <class Rows>
inline void int8_rows_for_tokens(const Linear& W, const int8_t* xq, const float* dx, const float* gsum, int t0,
                                 int nt, float* y, int ldy, Rows&& rows) {
  const int G = W.in / W.group, ndx = int8_dx_per_token(W.in, W.bits);
  xq += size_t(t0) * W.in;
  dx += size_t(t0) * ndx;
  gsum += size_t(t0) * G;
  y += size_t(t0) * ldy;
  switch (nt) {
    case 1: rows(std::integral_constant<int, 1>(), xq, dx, gsum, y); break;
    case 2: rows(std::integral_constant<int, 2>(), xq, dx, gsum, y); break;
    case 3: rows(std::integral_constant<int, 3>(), xq, dx, gsum, y); break;
    case 4: rows(std::integral_constant<int, 4>(), xq, dx, gsum, y); break;
    case 5: rows(std::integral_constant<int, 5>(), xq, dx, gsum, y); break;
    case 6: rows(std::integral_constant<int, 6>(), xq, dx, gsum, y); break;
    case 7: rows(std::integral_constant<int, 7>(), xq, dx, gsum, y); break;
    default: rows(std::integral_constant<int, 8>(), xq, dx, gsum, y); break;
  }
}

// Chunks of at least this many tokens go to int8_gemm rather than the row kernels.
constexpr int kInt8GemmMinT = 12;

// Whether int8_gemm runs W in this build (AVX-512 VNNI hosts; elsewhere large chunks use the
// f32 panel GEMM).
bool int8_gemm_supported(const Linear& W);

// y[T, out] = x[T, in] · Wᵀ for larger chunks (prefill): tokens in vectors of 16, each weight
// row unpacked once per call. pool == nullptr: computed by the calling thread.
void int8_gemm(const Linear& W, const float* x, int T, float* y, ThreadPool* pool);

}  // namespace lily::cpu
