// The few macros where MSL and the C++ that runs it on the CPU (csrc/msl_cpu/) or on CUDA
// (csrc/msl_cuda/) cannot meet; each runtime's prelude defines the LILY_MSL_* side.
// Included by every kernel file after <metal_stdlib>; on a Mac the Metal branch is used.
//
//   LILY_KERNEL_INSTANTIATE("host_name", func, T...)  instantiate a kernel template under a
//       host name. (Metal's `template [[host_name(...)]] [[kernel]] ...` explicit
//       instantiation is a hard error in C++; the runtimes register func<T...>.)
//   LILY_THREADGROUP(type, name, dims);  a kernel-scope threadgroup array, e.g.
//       LILY_THREADGROUP(float, tile, [32][33]);  (on the CPU every thread is a fiber with its
//       own stack, so the array is taken from the threadgroup's shared storage.) Only in kernel
//       functions: helpers take a `threadgroup T*` (scripts/lint_metal.py checks it).
//   LILY_UNROLL  before a loop with a compile-time trip count that indexes a thread-local array:
//       fully unrolled, every index is a constant and the array lives in registers (the
//       MSL-on-CPU compile fails on an array left in stack memory). MLX's STEEL_PRAGMA_UNROLL.
#pragma once

#define LILY_UNROLL _Pragma("clang loop unroll(full)")

#if defined(__METAL_VERSION__)
#define LILY_KERNEL_INSTANTIATE(host, func, ...) \
  template [[host_name(host)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;
#define LILY_THREADGROUP(type, name, dims) threadgroup type name dims
#else
#define LILY_KERNEL_INSTANTIATE(host, func, ...) LILY_MSL_INSTANTIATE(host, func, __VA_ARGS__)
#define LILY_THREADGROUP(type, name, dims) LILY_MSL_THREADGROUP(type, name, dims)
#endif
