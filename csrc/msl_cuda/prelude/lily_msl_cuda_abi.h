/* The launch ABI between the msl_cuda host runtime (csrc/msl_cuda/ sources, built into lily._core by
 * any C++ compiler) and a kernel entry point compiled to PTX (csrc/msl_cuda/prelude/metal_stdlib).
 * Plain C types of fixed width on both sides (x86-64 / aarch64 Linux and nvptx64 agree on them).
 *
 * Every kernel entry takes one parameter, a lily_msl_cuda_args by value (kernel parameter space,
 * read through the constant cache), and is launched on a 1-D grid of all the dispatch's
 * threadgroups; the entry recovers Metal's (x, y, z) threadgroup position from the linear id,
 * optionally through a permutation (the order-checking mode).
 *
 * Beside each entry, named by the kernel's host name, the module holds a global
 *   lily_msl_cuda_meta lily_msl_meta_<host name>
 * that the host reads from the PTX text (never from the GPU) to learn which scanned kernel the
 * entry instantiates and how many bytes each `constant T&` parameter reads; and per kernel
 * function a global
 *   lily_msl_cuda_kernel_meta lily_msl_kernel_<kernel>
 * with what the kernel declares (defined after the source, where the macros it may use for
 * [[max_total_threads_per_threadgroup(N)]] are known). */
#ifndef LILY_MSL_CUDA_ABI_H
#define LILY_MSL_CUDA_ABI_H

#include "../../msl_prelude/lily_msl_params.h"

#define LILY_MSL_CUDA_ABI_VERSION 2
#define LILY_MSL_CUDA_MAX_PARAMS 96   /* parameters of one kernel function */
#define LILY_MSL_CUDA_NAME_BYTES 64   /* the scanned kernel's name, NUL-terminated */

typedef struct lily_msl_cuda_args {
  /* Device address of each [[buffer(i)]] (allocation + bound offset; set_bytes data is staged
   * in device memory by the command buffer). 0 where unbound. */
  unsigned long long buffers[LILY_MSL_MAX_BINDINGS];
  /* 0: threadgroups run in launch order (block b is threadgroup b); otherwise the device
   * address of a uint32 permutation: block b runs threadgroup order[b]. */
  unsigned long long threadgroup_order;
  /* Byte offset of [[threadgroup(i)]] in the dispatch's dynamic shared memory. */
  unsigned int threadgroup_offsets[LILY_MSL_MAX_BINDINGS];
  /* Metal's threadgroups_per_grid (the launch itself is 1-D). */
  unsigned int threadgroups_per_grid[3];
} lily_msl_cuda_args;

typedef struct lily_msl_cuda_meta {
  unsigned long long abi_version;
  unsigned long long param_count;
  /* Per parameter in declaration order: sizeof(T) of a `T&` parameter, else 0. */
  unsigned long long bound_sizes[LILY_MSL_CUDA_MAX_PARAMS];
  char function[LILY_MSL_CUDA_NAME_BYTES]; /* the kernel function this entry instantiates */
} lily_msl_cuda_meta;

typedef struct lily_msl_cuda_kernel_meta {
  unsigned long long abi_version;
  /* [[max_total_threads_per_threadgroup(N)]]: N, or 0 where the kernel declares none. */
  unsigned long long max_threads;
} lily_msl_cuda_kernel_meta;

#endif
