// Matrix products against checkpoint weights (dense f32/f16/bf16, or MLX affine-quantized at
// 2..8 bits), with dequantization fused: weights stay packed in memory and are expanded a few
// rows at a time into a per-thread scratch that lives in L1/L2.
//
// Invariance: each output y[t, r] is computed by one fixed sequence of f32 operations that
// depends on x[t] and W's row r alone, never on T, on the other tokens or rows sharing the call,
// or on the thread count; kernels are chosen by T for speed only. (The sequences: int8 mode in
// linear_int8.h, f32 mode in linear.cpp.) So a token's logits are bit-identical however its
// prompt was chunked, cached or batched.
//
// Shapes: W [out, in], x [T, in], y [T, out]  (T = tokens in the chunk)
#pragma once
#include <cstdint>
#include <vector>

#include "cpu/thread_pool.h"
#include "model/weights.h"

namespace lily::cpu {

// How quantized weights meet the activations. F32: weights are expanded to f32 and multiplied
// into f32 activations (matches mlx.core.dequantize followed by an f32 matmul to ~1e-6).
// Int8: activations are rounded to int8 per block of 32 and multiplied by the integer codes with
// integer dot products (faster; see linear_int8.cpp for the error it adds). Dense weights and
// hosts without the integer kernels use F32 in both modes.
enum class Matmul { F32, Int8 };

// out[in] = W[row, :] as f32. For affine weights: scale[g] * q + bias[g], exactly as
// mlx.core.dequantize computes it in f32.
void dequantize_row(const Linear& W, int row, float* out);

// y[T, out] = x[T, in] · Wᵀ
void linear(const Linear& W, const float* x, int T, float* y, ThreadPool& pool, Matmul mode);

// One product of a group: y[T, W->out] = x[T, W->in] · W->ᵀ.
struct LinearJob {
  const Linear* W;
  const float* x;
  float* y;
};

// Every job of jobs[0, n), T tokens each. Where every job takes the row kernels (decode, short
// chunks), the rows of all jobs form one index space split over the threads in ONE parallel
// region: one wake-up and one barrier for the group instead of one per matrix (a layer's input
// projections, the MoE's expert matrices). Otherwise each job runs as linear(). Either way each
// output is the one linear() computes. Jobs with the same x (pointer) and quantization share
// its prepared form.
void linear_group(const LinearJob* jobs, int n, int T, ThreadPool& pool, Matmul mode);

// One token: y[out] = sum over j in order of weights[j] * (x_j · W_jᵀ), every W_j with the same
// out, each job's own product left in its y[out]. ONE parallel region over the outputs: a
// thread computes its rows of every job and sums them there, where the rows are in its cache
// (an MoE block's down projections and their mix, which the calling thread summed alone after
// the region, reading every thread's rows). Each output is fill(0) then axpy per job in order.
void linear_sum(const LinearJob* jobs, const float* weights, int n, float* y, ThreadPool& pool, Matmul mode);

// The same product computed entirely by the calling thread (for callers that parallelise
// over something else, e.g. MoE prefill over experts).
void linear_serial(const Linear& W, const float* x, int T, float* y, Matmul mode);

// gsum[T, in / group] = sum of x over each group, in order (the affine bias term's input).
void group_sums(const float* x, int T, int in, int group, float* gsum);

// Activations prepared once for the fused small-batch kernels (decode, small expert groups):
// group sums for the affine bias term and, for 4-bit rows, x de-interleaved to match the
// nibble order. Valid for every matrix with the same (in, bits, group), so a decode step can
// prepare x once for all the experts that read it.
struct MatvecInput {
  const float* x = nullptr;  // [T, in], not owned
  int T = 0, in = 0, bits = 0, group = 0;
  bool deinterleaved = false;
  bool int8 = false;        // prepared for the integer kernels (Matmul::Int8 and W supports it)
  std::vector<float> xd;    // [T, in] (4-bit f32 kernels only)
  std::vector<float> gsum;  // [T, in / group]
  std::vector<int8_t> xq;   // [T, in] (int8 only)
  std::vector<float> dx;    // [T, in / 32]: block scales (int8 only)

  void prepare(const Linear& W, const float* x, int T, Matmul mode);
  bool matches(const Linear& W) const;
};

// Rows [r0, r1) of y[t, r] (row stride ldy) = x[t] · W[r], t < in.T; single-threaded: callers
// split rows across threads, so several matrices can share one parallel region. prefetch_end:
// as int8_rows'.
void matvec_rows(const Linear& W, const MatvecInput& in, float* y, int ldy, int64_t r0, int64_t r1,
                 int64_t prefetch_end = 0);

// x[T, in] = W[tokens[t], :] (embedding lookup; tokens already range-checked)
void embedding(const Linear& W, const int32_t* tokens, int T, float* x, ThreadPool& pool);

}  // namespace lily::cpu
