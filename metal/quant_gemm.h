// The prefill projection kernel, gemm<S, BM, TENSOR>: a chunk's y = x . W^T with a BM x 32
// output tile per threadgroup and the weights dequantized into the tiles (gemm.h). A kernel
// template here, instantiated by quant.metal (TENSOR = false, simdgroup_matrix) and by
// quant_tensor.metal (TENSOR = true, Metal 4 matmul2d), so both libraries share one body.
#pragma once
#include <metal_stdlib>
#include "gemm.h"
#include "lily_msl.h"
#include "quant_args.h"
using namespace metal;

// Prefill's dense projections. The skinny route (T below GpuOptions::gemm_min_rows) keeps
// gemv: with a few rows, a GEMV re-reading W per row costs less than padding tiles to 8.
template <typename S, int BM, bool TENSOR>
kernel void gemm(constant GemmArgs& args [[buffer(0)]],
                 device const uchar* w [[buffer(1)]],       // packed or dense W [out, in]
                 device const uchar* scales [[buffer(2)]],  // [out, in/group] (affine)
                 device const uchar* biases [[buffer(3)]],  // [out, in/group] (affine)
                 device const float* x [[buffer(4)]],       // [T, ldx]
                 device float* y [[buffer(5)]],             // [T, ldy]
                 uint2 tg [[threadgroup_position_in_grid]],
                 uint tid [[thread_index_in_threadgroup]],
                 uint simd_id [[simdgroup_index_in_threadgroup]]) {
  typedef GemmMma<BM, TENSOR> Mma;
  LILY_THREADGROUP(float, xs, [BM * LILY_GEMM_LD]);
  LILY_THREADGROUP(float, ws, [LILY_GEMM_BK * LILY_GEMM_LDW]);
  LILY_THREADGROUP(uint, src_row, [BM]);
  LILY_THREADGROUP(float, cacc, [Mma::ACC]);
  const uint n0 = tg.x * LILY_GEMM_BN, m0 = tg.y * BM;
  if (tid < uint(BM)) src_row[tid] = m0 + tid < args.rows ? m0 + tid : LILY_GEMM_NO_ROW;
  Mma mma;
  mma.begin(cacc, tid, simd_id);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (uint k0 = 0; k0 < args.w.in; k0 += LILY_GEMM_BK) {
    gemm_load_x<BM>(xs, x, args.ldx, src_row, k0, args.w.in, tid);
    gemm_load_w<S>(ws, w, scales, biases, args.w, n0, k0, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    mma.step(cacc, xs, ws, simd_id);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // tiles are reloaded next step
  }
  threadgroup float* res = mma.finish(cacc, xs, simd_id);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < uint(BM * LILY_GEMM_BN); i += LILY_GEMM_THREADS) {
    const uint r = i / LILY_GEMM_BN, c = i % LILY_GEMM_BN;
    if (m0 + r < args.rows && n0 + c < args.w.out) y[ulong(m0 + r) * args.ldy + n0 + c] = res[r * LILY_GEMM_LD + c];
  }
}

// gemm<path>_<S>_bm<BM>: path "" on simdgroup_matrix (quant.metal, every Apple GPU), "_tensor"
// on Metal 4 matmul2d (quant_tensor.metal).
#define LILY_GEMM_INSTANTIATE(path, tensor)                                 \
  LILY_KERNEL_INSTANTIATE("gemm" path "_float_bm8", gemm, float, 8, tensor)   \
  LILY_KERNEL_INSTANTIATE("gemm" path "_half_bm8", gemm, half, 8, tensor)     \
  LILY_KERNEL_INSTANTIATE("gemm" path "_bfloat_bm8", gemm, bfloat, 8, tensor) \
  LILY_KERNEL_INSTANTIATE("gemm" path "_float_bm32", gemm, float, 32, tensor) \
  LILY_KERNEL_INSTANTIATE("gemm" path "_half_bm32", gemm, half, 32, tensor)   \
  LILY_KERNEL_INSTANTIATE("gemm" path "_bfloat_bm32", gemm, bfloat, 32, tensor) \
  LILY_KERNEL_INSTANTIATE("gemm" path "_uchar_bm8", gemm, uchar, 8, tensor)     \
  LILY_KERNEL_INSTANTIATE("gemm" path "_uchar_bm32", gemm, uchar, 32, tensor)
