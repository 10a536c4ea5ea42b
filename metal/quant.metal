// Quant family: GEMV with fused dequantization (decode, and the simple prefill path) and the
// embedding gather. Algorithms in quant.h; this file holds the kernels and instantiations.
//
//   gemv_<S>   y[t, r] = W[r] . x[t]          grid (ceil(out / 8), T), 64 threads
//   embed_<S>  x[t, :] = W[tokens[t], :]      grid (ceil(in / 256), T), 256 threads
//   gemm_<S>_bm<BM>  y[t, :] = W . x[t] for a chunk (prefill): a BM x 32 output tile per
//              threadgroup, dequantization fused into the tile loads (quant_gemm.h, gemm.h).
//                                             grid (ceil(out / 32), ceil(T / BM)), 128 threads
//              (gemm_tensor_<S>_bm<BM>, the same on Metal 4 tensor ops: quant_tensor.metal)
// S is the scale type of affine weights, or the element type of dense ones (float, half,
// bfloat); uchar for MLX's microscaled modes (byte scales, microscale.h). The bit width is a
// uniform runtime argument (0 = dense, 2, 4, 8; microscaled: 4 or 8, the mode named by it and
// the group size).
#include <metal_stdlib>
#include "lily_msl.h"
#include "quant.h"
#include "quant_gemm.h"
using namespace metal;

// Each simdgroup owns LILY_GEMV_ROWS_PER_SIMDGROUP rows and walks them together (quant.h
// rows_partial: 16 bytes of each row per lane per step where args.w.vec, each x value read once
// for all of them), so a threadgroup covers 8 consecutive rows; f32 partials per lane, one
// simd_sum per row.
template <typename S>
kernel void gemv(constant GemvArgs& args [[buffer(0)]],
                 device const uchar* w [[buffer(1)]],       // packed or dense W
                 device const uchar* scales [[buffer(2)]],  // [out, in/group] (affine)
                 device const uchar* biases [[buffer(3)]],  // [out, in/group] (affine)
                 device const float* x [[buffer(4)]],       // [T, ldx]
                 device float* y [[buffer(5)]],             // [T, ldy]
                 uint2 tg [[threadgroup_position_in_grid]],
                 uint simd_id [[simdgroup_index_in_threadgroup]],
                 uint lane [[thread_index_in_simdgroup]]) {
  const uint t = tg.y;
  device const float* xt = x + ulong(t) * args.ldx;
  const uint row0 = (tg.x * LILY_GEMV_SIMDGROUPS + simd_id) * LILY_GEMV_ROWS_PER_SIMDGROUP;
  if (row0 >= args.w.out) return;  // uniform across the simdgroup (no barrier below)
  const uint rows = min(uint(LILY_GEMV_ROWS_PER_SIMDGROUP), args.w.out - row0);
  const RowParts p = rows_partial<S>(w, scales, biases, args.w, row0, rows, xt, lane, 32);
  LILY_UNROLL for (int r = 0; r < LILY_GEMV_ROWS_PER_SIMDGROUP; ++r) {
    if (uint(r) < rows) {  // uniform across the simdgroup
      const float dot = simd_sum(p.v[r]);
      if (lane == 0) y[ulong(t) * args.ldy + row0 + r] = dot;
    }
  }
}

LILY_KERNEL_INSTANTIATE("gemv_float", gemv, float)
LILY_KERNEL_INSTANTIATE("gemv_half", gemv, half)
LILY_KERNEL_INSTANTIATE("gemv_bfloat", gemv, bfloat)
LILY_KERNEL_INSTANTIATE("gemv_uchar", gemv, uchar)

template <typename S>
kernel void embed(constant EmbedArgs& args [[buffer(0)]],
                  device const uchar* w [[buffer(1)]],
                  device const uchar* scales [[buffer(2)]],
                  device const uchar* biases [[buffer(3)]],
                  device const int* tokens [[buffer(4)]],  // [T], range-checked by the engine
                  device float* x [[buffer(5)]],           // [T, in]
                  uint2 gid [[thread_position_in_grid]]) {
  const uint j = gid.x, t = gid.y;
  if (j >= args.w.in) return;
  const uint row = uint(tokens[t]);
  x[ulong(t) * args.w.in + j] = dequantize_element<S>(w, scales, biases, args.w, row, j);
}

LILY_KERNEL_INSTANTIATE("embed_float", embed, float)
LILY_KERNEL_INSTANTIATE("embed_half", embed, half)
LILY_KERNEL_INSTANTIATE("embed_bfloat", embed, bfloat)
LILY_KERNEL_INSTANTIATE("embed_uchar", embed, uchar)

LILY_GEMM_INSTANTIATE("", false)
