// Quant family: GEMV with fused dequantization (decode, and the simple prefill path) and the
// embedding gather. Algorithms in quant.h; this file holds the kernels and instantiations.
//
//   gemv_<S>   y[t, r] = W[r] . x[t]          grid (ceil(out / 8), T), 64 threads
//   embed_<S>  x[t, :] = W[tokens[t], :]      grid (ceil(in / 256), T), 256 threads
//   gemm_<S>_bm<BM>  y[t, :] = W . x[t] for a chunk (prefill): a BM x 32 output tile per
//              threadgroup, dequantization fused into the tile loads (gemm.h).
//                                             grid (ceil(out / 32), ceil(T / BM)), 128 threads
// S is the scale type of affine weights, or the element type of dense ones (float, half,
// bfloat). The bit width is a uniform runtime argument (0 = dense, 2, 4, 8).
#include <metal_stdlib>
#include "lily_msl.h"
#include "gemm.h"
#include "quant.h"
using namespace metal;

// Each simdgroup owns LILY_GEMV_ROWS_PER_SIMDGROUP rows and walks them one after another, so a
// threadgroup covers 8 consecutive rows; f32 partials per lane, one simd_sum per row.
template <typename S>
kernel void gemv(device const uchar* w [[buffer(0)]],       // packed or dense W
                 device const uchar* scales [[buffer(1)]],  // [out, in/group] (affine)
                 device const uchar* biases [[buffer(2)]],  // [out, in/group] (affine)
                 device const float* x [[buffer(3)]],       // [T, ldx]
                 device float* y [[buffer(4)]],             // [T, ldy]
                 constant GemvArgs& args [[buffer(5)]],
                 uint2 tg [[threadgroup_position_in_grid]],
                 uint simd_id [[simdgroup_index_in_threadgroup]],
                 uint lane [[thread_index_in_simdgroup]]) {
  const uint t = tg.y;
  device const float* xt = x + ulong(t) * args.ldx;
  const uint row0 = (tg.x * LILY_GEMV_SIMDGROUPS + simd_id) * LILY_GEMV_ROWS_PER_SIMDGROUP;
  for (uint r = 0; r < LILY_GEMV_ROWS_PER_SIMDGROUP; ++r) {
    const uint row = row0 + r;
    if (row >= args.w.out) break;  // uniform across the simdgroup
    const float dot = simd_sum(row_partial<S>(w, scales, biases, args.w, row, xt, lane));
    if (lane == 0) y[ulong(t) * args.ldy + row] = dot;
  }
}

LILY_KERNEL_INSTANTIATE("gemv_float", gemv, float)
LILY_KERNEL_INSTANTIATE("gemv_half", gemv, half)
LILY_KERNEL_INSTANTIATE("gemv_bfloat", gemv, bfloat)

template <typename S>
kernel void embed(device const uchar* w [[buffer(0)]],
                  device const uchar* scales [[buffer(1)]],
                  device const uchar* biases [[buffer(2)]],
                  device const int* tokens [[buffer(3)]],  // [T], range-checked by the engine
                  device float* x [[buffer(4)]],           // [T, in]
                  constant EmbedArgs& args [[buffer(5)]],
                  uint2 gid [[thread_position_in_grid]]) {
  const uint j = gid.x, t = gid.y;
  if (j >= args.w.in) return;
  const uint row = uint(tokens[t]);
  x[ulong(t) * args.w.in + j] = dequantize_element<S>(w, scales, biases, args.w, row, j);
}

LILY_KERNEL_INSTANTIATE("embed_float", embed, float)
LILY_KERNEL_INSTANTIATE("embed_half", embed, half)
LILY_KERNEL_INSTANTIATE("embed_bfloat", embed, bfloat)

// Prefill's dense projections. The skinny route (T below GpuOptions::gemm_min_rows) keeps
// gemv: with a few rows, a GEMV re-reading W per row costs less than padding tiles to 8.
template <typename S, int BM, bool TENSOR>
kernel void gemm(device const uchar* w [[buffer(0)]],       // packed or dense W [out, in]
                 device const uchar* scales [[buffer(1)]],  // [out, in/group] (affine)
                 device const uchar* biases [[buffer(2)]],  // [out, in/group] (affine)
                 device const float* x [[buffer(3)]],       // [T, ldx]
                 device float* y [[buffer(4)]],             // [T, ldy]
                 constant GemmArgs& args [[buffer(5)]],
                 uint2 tg [[threadgroup_position_in_grid]],
                 uint tid [[thread_index_in_threadgroup]],
                 uint simd_id [[simdgroup_index_in_threadgroup]]) {
  typedef GemmMma<BM, TENSOR> Mma;
  LILY_THREADGROUP(float, xs, [BM * LILY_GEMM_LD]);
  LILY_THREADGROUP(float, ws, [LILY_GEMM_BN * LILY_GEMM_LD]);
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

// gemm_<S>_bm<BM> on simdgroup_matrix (every Apple GPU); gemm_tensor_<S>_bm<BM> on Metal 4
// matmul2d (only where the compiler has tensors).
#define LILY_GEMM_INSTANTIATE(path, tensor)                                 \
  LILY_KERNEL_INSTANTIATE("gemm" path "_float_bm8", gemm, float, 8, tensor)   \
  LILY_KERNEL_INSTANTIATE("gemm" path "_half_bm8", gemm, half, 8, tensor)     \
  LILY_KERNEL_INSTANTIATE("gemm" path "_bfloat_bm8", gemm, bfloat, 8, tensor) \
  LILY_KERNEL_INSTANTIATE("gemm" path "_float_bm32", gemm, float, 32, tensor) \
  LILY_KERNEL_INSTANTIATE("gemm" path "_half_bm32", gemm, half, 32, tensor)   \
  LILY_KERNEL_INSTANTIATE("gemm" path "_bfloat_bm32", gemm, bfloat, 32, tensor)
LILY_GEMM_INSTANTIATE("", false)
#if defined(__HAVE_TENSOR__)
LILY_GEMM_INSTANTIATE("_tensor", true)
#endif
