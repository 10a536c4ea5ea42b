// The Metal 4 inner product of the tiled GEMMs (metal/gemm.h): GemmMma<BM, true> runs
// MetalPerformancePrimitives' matmul2d on the staged tiles. Only the *_tensor.metal libraries
// include this header; the host compiles them as MSL 4.0, and only on a GPU with Metal 4
// tensors (GpuOptions::gemm), so a failure here cannot take the other kernels down.
//
// The 4 simdgroups run matmul2d together (execution_simdgroups<4>) with mode
// multiply_accumulate into an f32 accumulator tile in threadgroup memory: A is the X tile
// [BM, BK], B the weight tile [BK, BN] as gemm.h stages it (no transpose), C [BM, BN]. A
// cooperative-tensor accumulator (registers) would save the threadgroup round trip; the msl_cpu
// runtime does not emulate cooperative tensors, and an untestable kernel was not written.
// Unverified on Apple hardware.
#pragma once
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#include "gemm.h"
using namespace metal;

template <int BM>
struct GemmMma<BM, true> {
  enum { ACC = BM * LILY_GEMM_LD };
  void begin(threadgroup float* cacc, uint tid, uint simd_id) {
    for (uint i = tid; i < uint(ACC); i += LILY_GEMM_THREADS) cacc[i] = 0.0f;
  }
  void step(threadgroup float* cacc, threadgroup float* xs, threadgroup float* ws, uint simd_id) {
    typedef dextents<int32_t, 2> E;  // extents innermost first: (columns, rows)
    typedef tensor<threadgroup float, E, tensor_inline> Tile;
    constexpr auto desc = mpp::tensor_ops::matmul2d_descriptor(
        BM, LILY_GEMM_BN, LILY_GEMM_BK, false, false, false,
        mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate);
    mpp::tensor_ops::matmul2d<desc, execution_simdgroups<LILY_GEMM_THREADS / 32>> op;
    Tile a(xs, E(LILY_GEMM_BK, BM), array<int32_t, 2>({1, LILY_GEMM_LD}));            // X [BM, BK]
    Tile b(ws, E(LILY_GEMM_BN, LILY_GEMM_BK), array<int32_t, 2>({1, LILY_GEMM_LDW}));  // W^T [BK, BN]
    Tile c(cacc, E(LILY_GEMM_BN, BM), array<int32_t, 2>({1, LILY_GEMM_LD}));           // acc [BM, BN]
    op.run(a, b, c);
  }
  threadgroup float* finish(threadgroup float* cacc, threadgroup float* spare, uint simd_id) { return cacc; }
};
