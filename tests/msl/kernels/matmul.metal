// Matrix multiplication two ways.
//   matmul_tiled       C[M,N] = A[M,K] @ B[K,N] (+ bias[N]): 16x16 tiles staged through
//                      threadgroup memory, one output element per thread.
//   matmul_simdgroup_* one simdgroup per 8x8 tile of C with simdgroup_matrix multiply-
//                      accumulate; B is [K,N], or [N,K] when transpose_b (a weight matrix),
//                      staged transposed into the [k][n] tile the multiply reads (no
//                      transposed simdgroup_load: scripts/lint_metal.py). Inputs are T (float,
//                      half, bfloat), staged as float; accumulation in float.
#include <metal_stdlib>
#include "lily_msl.h"
using namespace metal;

constant bool has_bias [[function_constant(0)]];
constant bool transpose_b [[function_constant(1)]];

struct MatmulArgs {
  uint M, N, K;
};

constant constexpr uint kTile = 16;

kernel void matmul_tiled(device const float* A [[buffer(0)]],
                         device const float* B [[buffer(1)]],
                         device float* C [[buffer(2)]],
                         constant MatmulArgs& args [[buffer(3)]],
                         device const float* bias [[buffer(4), function_constant(has_bias)]],
                         uint2 tid [[thread_position_in_threadgroup]],
                         uint2 group [[threadgroup_position_in_grid]]) {
  LILY_THREADGROUP(float, As, [kTile][kTile]);
  LILY_THREADGROUP(float, Bs, [kTile][kTile + 1]);
  const uint row = group.y * kTile + tid.y;
  const uint col = group.x * kTile + tid.x;
  float acc = 0.0f;
  for (uint k0 = 0; k0 < args.K; k0 += kTile) {
    As[tid.y][tid.x] = (row < args.M && k0 + tid.x < args.K) ? A[row * args.K + k0 + tid.x] : 0.0f;
    Bs[tid.y][tid.x] = (k0 + tid.y < args.K && col < args.N) ? B[(k0 + tid.y) * args.N + col] : 0.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint k = 0; k < kTile; ++k) acc += As[tid.y][k] * Bs[k][tid.x];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (row < args.M && col < args.N) {
    if (has_bias) acc += bias[col];
    C[row * args.N + col] = acc;
  }
}

template <typename T>
kernel void matmul_simdgroup(device const T* A [[buffer(0)]],
                             device const T* B [[buffer(1)]],
                             device float* C [[buffer(2)]],
                             constant MatmulArgs& args [[buffer(3)]],
                             uint2 group [[threadgroup_position_in_grid]],
                             ushort lane [[thread_index_in_simdgroup]]) {
  LILY_THREADGROUP(float, As, [64]);
  LILY_THREADGROUP(float, Bs, [64]);
  LILY_THREADGROUP(float, Cs, [64]);
  const uint row0 = group.y * 8, col0 = group.x * 8;
  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (uint k0 = 0; k0 < args.K; k0 += 8) {
    for (uint i = lane; i < 64; i += 32) {
      const uint r = i / 8, c = i % 8;
      As[i] = (row0 + r < args.M && k0 + c < args.K) ? float(A[(row0 + r) * args.K + k0 + c]) : 0.0f;
      // Bs[k][n] either way; B stores [n][k] when transpose_b.
      const bool in = k0 + r < args.K && col0 + c < args.N;
      if (transpose_b) Bs[i] = in ? float(B[(col0 + c) * args.K + k0 + r]) : 0.0f;
      else Bs[i] = in ? float(B[(k0 + r) * args.N + col0 + c]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 a, b;
    simdgroup_load(a, As, 8);
    simdgroup_load(b, Bs, 8);
    simdgroup_multiply_accumulate(acc, a, b, acc);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  simdgroup_store(acc, Cs, 8);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = lane; i < 64; i += 32) {
    const uint r = i / 8, c = i % 8;
    if (row0 + r < args.M && col0 + c < args.N) C[(row0 + r) * args.N + col0 + c] = Cs[i];
  }
}

LILY_KERNEL_INSTANTIATE("matmul_simdgroup_float", matmul_simdgroup, float)
LILY_KERNEL_INSTANTIATE("matmul_simdgroup_half", matmul_simdgroup, half)
LILY_KERNEL_INSTANTIATE("matmul_simdgroup_bfloat", matmul_simdgroup, bfloat)
