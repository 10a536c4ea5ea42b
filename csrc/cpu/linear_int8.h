// Integer dot products for affine-quantized weights against int8-quantized activations (the
// `cpu_matmul="int8"` mode). Internal to the CPU backend: linear.cpp prepares the activations
// (MatvecInput) and dispatches here; nothing else includes this header.
//
// Shapes: W [out, in] packed (4 or 8 bits), x [T, in] quantized in blocks of 32.
//
// The canonical order. Every kernel here (x86 row kernels, the x86 token-vector GEMM, the
// arm64 row kernels) computes each output y[t, r] with this one sequence of f32 operations, so
// a token's result is bit-identical whichever kernel, chunk length, thread count or
// neighbouring rows produced it (prefix caches, snapshots and batching never change a token):
//
//   acc = +0
//   for b in 0 .. in/32 - 1:                    ascending blocks of 32 values
//     I   = sum_{j in b} u[r, j] * q[t, j]      integer, exact (any summation order)
//     acc = fma(float(I), s[r, g(b)] * d[t, b], acc)     the product s * d rounded to f32 first
//   for g in 0 .. in/group - 1:                 ascending groups: the affine bias term
//     acc = fma(bias[r, g], gsum[t, g], acc)    gsum: the f32 sum of x over group g, in order
//   y[t, r] = acc
//
// (u: the weight codes, w = s * u + bias per group; q, d: x rounded per block, q = rint(x / d),
// d = max|x| / 127.) float(I) is exact: |I| <= 32 * 255 * 127 < 2^24. The kernels differ only in
// how they reach I (vector lanes, VNNI, SDOT or widening multiplies) and in which outputs share
// a vector register; tests/test_arm64_kernels.py checks every build bit for bit against a NumPy
// evaluation of the sequence above.
#pragma once
#include <cstddef>
#include <cstdint>

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

// Whether this build has integer kernels at all (x86 AVX2 / AVX-VNNI / AVX-512 VNNI, arm64):
// where it does, cpu_matmul defaults to "int8".
bool int8_kernels_available();

// x[T, in] -> xq (int8, in the kernel's element order: for 4-bit weights each chunk of 64 values
// is stored [x0 x2 .. x62 | x1 x3 .. x63], matching the nibble order of 32 packed bytes;
// chunks are 128 values on AVX-512 and 32 on NEON, one vector register of packed bytes) and dx
// (the block scales d, one per block of 32 values: in / 32 per token).
void quantize_activations(const float* x, int T, int in, int bits, int8_t* xq, float* dx);
// The interleaved row layout (Linear::interleaved; AVX-512 VNNI builds, 4-bit matrices whose rows
// come in whole blocks of 16; each block's codes, scales and biases in one run of bytes): whether
// W can take it, the bytes it takes there (W.nbytes(): reordered, not grown), and W copied into it
// at dst (64-byte aligned), returning the Linear that reads the copy. Every int8 kernel reads an
// interleaved W in that layout; the f32 kernels cannot (linear.cpp refuses).
bool int8_interleavable(const Linear& W);
size_t interleaved_bytes(const Linear& W);
Linear interleave_rows(const Linear& W, uint8_t* dst);
// Block scales per token.
inline int int8_dx_per_token(int in) { return in / kInt8Block; }

// Rows [r0, r1) of y[t, r] (row stride ldy) for tokens t < T. gsum [T, G] holds the f32 sums of
// x per weight group (the affine bias term), summed in order. The weights may be prefetched up
// to row prefetch_end where that is past r1 (ThreadPool::run_end: the caller reads on there
// next), else only up to r1.
void int8_rows(const Linear& W, const int8_t* xq, const float* dx, const float* gsum, int T, float* y, int ldy,
               int64_t r0, int64_t r1, int64_t prefetch_end = 0);

// Chunks of at least this many tokens go to int8_gemm rather than the row kernels (the same
// results either way: only speed decides): 12 with 16 tokens per vector (AVX-512), 8 with 8.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int kInt8GemmMinT = 12;
#else
constexpr int kInt8GemmMinT = 8;
#endif

// Whether int8_gemm runs W in this build (x86: wherever the row kernels do, 16 tokens per vector
// on AVX-512 VNNI, 8 on AVX2 / AVX-VNNI; arm64: no, every chunk runs the row kernels).
bool int8_gemm_supported(const Linear& W);

// y[T, out] = x[T, in] · Wᵀ for larger chunks (prefill): tokens in vector lanes, each weight
// row unpacked once per call. pool == nullptr: computed by the calling thread.
void int8_gemm(const Linear& W, const float* x, int T, float* y, ThreadPool* pool);

}  // namespace lily::cpu
