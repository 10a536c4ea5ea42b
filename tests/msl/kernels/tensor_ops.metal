// Metal 4 tensor ops as the msl_cpu runtime emulates them (prelude/metal_tensor and
// MetalPerformancePrimitives): matmul2d over tensor views, checked against NumPy by
// tests/test_metal_tensor_ops.py. Built only by a device with metal4=True.
//
// mm_<a>_<b>_<mode>: C[M, N] (=|+=) A . B for one tile of M = 32, N = 16 with 4 simdgroups;
// A is [M, K] (or stored [K, M] when transposed), B is [K, N] (or stored [N, K]); row strides
// are passed so the views are strided; K is dynamic (read from the operands).
// mm_tg_klooped: the same product staged through threadgroup memory 8 columns of K at a time
// with a static k = 8, as lily's GEMMs use it. mm_slice: an edge tile through slice().
// The misuse kernels each break one rule the runtime must report.
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#include "lily_msl.h"
using namespace metal;
using namespace mpp::tensor_ops;

struct MmArgs {
  int M, N, K;
  int lda, ldb, ldc;
};

typedef dextents<int32_t, 2> E2;

template <bool TA, bool TB, bool ACC>
kernel void mm(device float* a [[buffer(0)]], device float* b [[buffer(1)]], device float* c [[buffer(2)]],
               constant MmArgs& p [[buffer(3)]]) {
  constexpr auto desc = matmul2d_descriptor(32, 16, static_cast<int>(dynamic_extent), TA, TB, false,
                                            ACC ? matmul2d_descriptor::mode::multiply_accumulate
                                                : matmul2d_descriptor::mode::multiply);
  matmul2d<desc, execution_simdgroups<4>> op;
  tensor<device float, E2, tensor_inline> ta(a, TA ? E2(p.M, p.K) : E2(p.K, p.M), array<int32_t, 2>({1, p.lda}));
  tensor<device float, E2, tensor_inline> tb(b, TB ? E2(p.K, p.N) : E2(p.N, p.K), array<int32_t, 2>({1, p.ldb}));
  tensor<device float, E2, tensor_inline> tc(c, E2(p.N, p.M), array<int32_t, 2>({1, p.ldc}));
  op.run(ta, tb, tc);
}

LILY_KERNEL_INSTANTIATE("mm_n_n_set", mm, false, false, false)
LILY_KERNEL_INSTANTIATE("mm_n_t_set", mm, false, true, false)
LILY_KERNEL_INSTANTIATE("mm_t_n_set", mm, true, false, false)
LILY_KERNEL_INSTANTIATE("mm_t_t_acc", mm, true, true, true)
LILY_KERNEL_INSTANTIATE("mm_n_t_acc", mm, false, true, true)

// half operands, float destination (a row of Apple's type table).
kernel void mm_half(device half* a [[buffer(0)]], device half* b [[buffer(1)]], device float* c [[buffer(2)]],
                    constant MmArgs& p [[buffer(3)]]) {
  constexpr auto desc = matmul2d_descriptor(32, 16);
  matmul2d<desc, execution_simdgroups<4>> op;
  auto ta = tensor<device half, E2, tensor_inline>(a, E2(p.K, p.M));
  auto tb = tensor<device half, E2, tensor_inline>(b, E2(p.N, p.K));
  auto tc = tensor<device float, E2, tensor_inline>(c, E2(p.N, p.M));
  op.run(ta, tb, tc);
}

// C [M, N] over a grid of 32 x 16 tiles: slices of the whole tensors, edge tiles included.
kernel void mm_slice(device float* a [[buffer(0)]], device float* b [[buffer(1)]], device float* c [[buffer(2)]],
                     constant MmArgs& p [[buffer(3)]], uint2 tg [[threadgroup_position_in_grid]]) {
  constexpr auto desc = matmul2d_descriptor(32, 16, static_cast<int>(dynamic_extent), false, true);
  matmul2d<desc, execution_simdgroups<4>> op;
  auto ta = tensor<device float, E2, tensor_inline>(a, E2(p.K, p.M));
  auto tb = tensor<device float, E2, tensor_inline>(b, E2(p.K, p.N));  // stored [N, K]
  auto tc = tensor<device float, E2, tensor_inline>(c, E2(p.N, p.M));
  auto sa = ta.slice(0, int(tg.y) * 32);
  auto sb = tb.slice(0, int(tg.x) * 16);
  auto sc = tc.slice(int(tg.x) * 16, int(tg.y) * 32);
  op.run(sa, sb, sc);
}

// K in steps of 8 staged through threadgroup memory, accumulated into a threadgroup tile.
kernel void mm_tg_klooped(device float* a [[buffer(0)]], device float* b [[buffer(1)]], device float* c [[buffer(2)]],
                          constant MmArgs& p [[buffer(3)]], uint tid [[thread_index_in_threadgroup]]) {
  LILY_THREADGROUP(float, as, [32 * 9]);
  LILY_THREADGROUP(float, bs, [16 * 9]);
  LILY_THREADGROUP(float, cs, [32 * 16]);
  constexpr auto desc = matmul2d_descriptor(32, 16, 8, false, true, false, matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<4>> op;
  tensor<threadgroup float, E2, tensor_inline> ta(as, E2(8, 32), array<int32_t, 2>({1, 9}));
  tensor<threadgroup float, E2, tensor_inline> tb(bs, E2(8, 16), array<int32_t, 2>({1, 9}));
  tensor<threadgroup float, E2, tensor_inline> tc(cs, E2(16, 32));
  for (uint i = tid; i < 32 * 16; i += 128) cs[i] = 0.0f;
  for (int k0 = 0; k0 < p.K; k0 += 8) {
    for (uint i = tid; i < 32 * 8; i += 128) as[(i / 8) * 9 + i % 8] = a[(i / 8) * p.K + k0 + i % 8];
    for (uint i = tid; i < 16 * 8; i += 128) bs[(i / 8) * 9 + i % 8] = b[(i / 8) * p.K + k0 + i % 8];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    op.run(ta, tb, tc);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint i = tid; i < 32 * 16; i += 128) c[i] = cs[(i % 16) + 16 * (i / 16)];
}

// The same with the barrier between staging and run() missing: the result depends on the
// thread order (found by the randomized-interleaving mode).
kernel void mm_tg_missing_barrier(device float* a [[buffer(0)]], device float* b [[buffer(1)]],
                                  device float* c [[buffer(2)]], constant MmArgs& p [[buffer(3)]],
                                  uint tid [[thread_index_in_threadgroup]]) {
  LILY_THREADGROUP(float, as, [32 * 8]);
  LILY_THREADGROUP(float, bs, [16 * 8]);
  constexpr auto desc = matmul2d_descriptor(32, 16, 8, false, true);
  matmul2d<desc, execution_simdgroups<4>> op;
  tensor<threadgroup float, E2, tensor_inline> ta(as, E2(8, 32));
  tensor<threadgroup float, E2, tensor_inline> tb(bs, E2(8, 16));
  tensor<device float, E2, tensor_inline> tc(c, E2(16, 32));
  for (uint i = tid; i < 32 * 8; i += 128) as[i] = a[i];
  for (uint i = tid; i < 16 * 8; i += 128) bs[i] = b[i];
  op.run(ta, tb, tc);
}

// Misuse: A has K = p.K, B has K = p.K + 1 (dynamic k reads both).
kernel void bad_shape(device float* a [[buffer(0)]], device float* b [[buffer(1)]], device float* c [[buffer(2)]],
                      constant MmArgs& p [[buffer(3)]]) {
  constexpr auto desc = matmul2d_descriptor(32, 16);
  matmul2d<desc, execution_simdgroups<4>> op;
  auto ta = tensor<device float, E2, tensor_inline>(a, E2(p.K, p.M));
  auto tb = tensor<device float, E2, tensor_inline>(b, E2(p.N, p.K + 1));
  auto tc = tensor<device float, E2, tensor_inline>(c, E2(p.N, p.M));
  op.run(ta, tb, tc);
}

// Misuse: a slice whose origin is past the tensor.
kernel void bad_slice(device float* a [[buffer(0)]], constant MmArgs& p [[buffer(3)]]) {
  auto ta = tensor<device float, E2, tensor_inline>(a, E2(p.K, p.M));
  auto s = ta.slice(0, p.M + 1);
  (void)s;
}

// Misuse: a static slice that runs past the tensor.
kernel void bad_static_slice(device float* a [[buffer(0)]], constant MmArgs& p [[buffer(3)]]) {
  auto ta = tensor<device float, E2, tensor_inline>(a, E2(p.K, p.M));
  auto s = ta.static_slice<8, 32>(0, 8);
  (void)s;
}

// Misuse: an op for 4 simdgroups run by a threadgroup of 2.
kernel void bad_scope(device float* a [[buffer(0)]], device float* b [[buffer(1)]], device float* c [[buffer(2)]],
                      constant MmArgs& p [[buffer(3)]]) {
  constexpr auto desc = matmul2d_descriptor(32, 16);
  matmul2d<desc, execution_simdgroups<4>> op;
  auto ta = tensor<device float, E2, tensor_inline>(a, E2(p.K, p.M));
  auto tb = tensor<device float, E2, tensor_inline>(b, E2(p.N, p.K));
  auto tc = tensor<device float, E2, tensor_inline>(c, E2(p.N, p.M));
  op.run(ta, tb, tc);
}
