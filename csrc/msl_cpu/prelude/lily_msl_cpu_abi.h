/* The C ABI between the msl_cpu host runtime (the .cpp files of csrc/msl_cpu, built into lily._core by any
 * C++ compiler) and a kernel module (the .metal source compiled by clang into a shared object
 * at run time). Plain C structs only, so both sides agree whatever compiled them.
 *
 * A kernel module exports:
 *   int lily_msl_module_init(const lily_msl_host_api* api);   returns LILY_MSL_ABI_VERSION
 *   const lily_msl_kernel* lily_msl_kernels(unsigned* count);
 *   lily_msl_thread* lily_msl_current;   the running thread; the host sets it before it
 *                                        switches to a thread's fiber
 * Each kernel entry takes no argument: it reads its thread from lily_msl_current, binds its
 * parameters from the thread's bindings by [[buffer(i)]] / [[threadgroup(i)]] / builtin
 * attribute, and calls the kernel function. */
#ifndef LILY_MSL_CPU_ABI_H
#define LILY_MSL_CPU_ABI_H
#include <stddef.h>
#include <stdint.h>

#include "../../msl_prelude/lily_msl_params.h"

#define LILY_MSL_ABI_VERSION 3
#define LILY_MSL_SIMD_WIDTH 32       /* Apple GPUs: 32 threads per simdgroup */
#define LILY_MSL_SIMD_SLOT 64        /* bytes per lane in a simdgroup exchange */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lily_msl_bindings {
  void* buffers[LILY_MSL_MAX_BINDINGS]; /* base + offset, or the copied set_bytes data */
  size_t buffer_lengths[LILY_MSL_MAX_BINDINGS]; /* bytes from the bound offset to the end */
  void* threadgroup_memory[LILY_MSL_MAX_BINDINGS]; /* this threadgroup's [[threadgroup(i)]] memory */
  size_t threadgroup_memory_lengths[LILY_MSL_MAX_BINDINGS];
} lily_msl_bindings;

typedef struct lily_msl_thread {
  uint32_t thread_position_in_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threads_per_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threadgroups_per_grid[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t threads_per_simdgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t active_lanes; /* lanes that exist in this thread's simdgroup (the last may be short) */
  const lily_msl_bindings* bindings;
} lily_msl_thread;

enum { LILY_MSL_BARRIER_THREADGROUP = 0, LILY_MSL_BARRIER_SIMDGROUP = 1 };

typedef struct lily_msl_host_api {
  /* threadgroup_barrier / simdgroup_barrier: blocks until every thread of the scope arrives. */
  void (*barrier)(int scope, const char* what, const char* file, int line);
  /* A simdgroup collective: stores this lane's value (size <= LILY_MSL_SIMD_SLOT), waits for
   * every lane of the simdgroup, and returns the 32 lanes' values (stride LILY_MSL_SIMD_SLOT),
   * valid until this lane's next collective. */
  const void* (*simd_exchange)(const void* value, size_t size, const char* what,
                               const char* file, int line);
  /* Kernel-scope threadgroup array: the same storage for every thread of the threadgroup
   * that passes the same key (one per declaration); name, file and line name it in errors (the
   * threadgroup's static + dynamic memory over 32 KB). */
  void* (*threadgroup_alloc)(const void* key, size_t size, size_t align, const char* name,
                             const char* file, int line);
  /* A GPU error found by the prelude: the thread stops and the dispatch fails. Never returns. */
  void (*fail)(const char* what, const char* file, int line);
} lily_msl_host_api;

typedef struct lily_msl_kernel {
  const char* name;             /* host name */
  void (*entry)(void);
  const lily_msl_param* params; /* ends with kind == LILY_MSL_PARAM_END */
  uint32_t max_total_threads_per_threadgroup; /* 0: not declared */
  const char* file;
  int line;
} lily_msl_kernel;

#ifdef __cplusplus
}
#endif
#endif
