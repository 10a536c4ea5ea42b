// Matrix products against checkpoint weights (dense f32/f16/bf16, or MLX affine-quantized at
// 2..8 bits), with dequantization fused: weights stay packed in memory and are expanded a few
// rows at a time into a per-thread scratch that lives in L1/L2.
//
// Shapes: W [out, in], x [T, in], y [T, out]  (T = tokens in the chunk)
#pragma once
#include <cstdint>

#include "cpu/thread_pool.h"
#include "model/weights.h"

namespace lily::cpu {

// out[in] = W[row, :] as f32. For affine weights: scale[g] * q + bias[g], exactly as
// mlx.core.dequantize computes it in f32.
void dequantize_row(const Linear& W, int row, float* out);

// y[T, out] = x[T, in] · Wᵀ
void linear(const Linear& W, const float* x, int T, float* y, ThreadPool& pool);

// x[T, in] = W[tokens[t], :] (embedding lookup; tokens already range-checked)
void embedding(const Linear& W, const int32_t* tokens, int T, float* x, ThreadPool& pool);

}  // namespace lily::cpu
