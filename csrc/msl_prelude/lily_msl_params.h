/* How a kernel's parameters are described to the host, by every target: the binders that
 * csrc/msl_cpu/compiler.cpp generates fill lily_msl_param tables on the CPU, and the CUDA host
 * builds the same tables from the scan and the PTX's metadata; the shared encoder checks a
 * dispatch against them (csrc/msl_cpu/encoder.h). Plain C: included by kernel units (any target)
 * and by lily's host code alike. */
#ifndef LILY_MSL_PARAMS_H
#define LILY_MSL_PARAMS_H
#include <stdint.h>

#define LILY_MSL_MAX_BINDINGS 31 /* Metal's buffer / threadgroup argument table size */

enum {
  LILY_MSL_PARAM_BUFFER = 1,      /* [[buffer(i)]] pointer */
  LILY_MSL_PARAM_BUFFER_REF = 2,  /* [[buffer(i)]] reference: size = sizeof(referenced type) */
  LILY_MSL_PARAM_THREADGROUP = 3, /* [[threadgroup(i)]] pointer */
  LILY_MSL_PARAM_BUILTIN = 4,     /* thread position attributes */
  LILY_MSL_PARAM_ABSENT = 5,      /* [[function_constant(c)]] parameter with c false: unbound */
  LILY_MSL_PARAM_END = 0
};

typedef struct lily_msl_param {
  int kind;
  uint32_t index;
  uint64_t size;
  const char* name;
  /* [[buffer(i)]]: alignof the element (pointer) or referenced type, the alignment Metal's
   * setBuffer:offset: asks of a device buffer's offset; 0 where unknown (msl_cuda's tables). */
  uint64_t align;
} lily_msl_param;

#endif
