// SwiGLU activation, the worked example of docs/add-a-kernel.md:
//   out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i]
// One thread per element; T is the storage type (float, half, bfloat), arithmetic in float as
// the CPU backend does it, rounded to T once at the store.
#include <metal_stdlib>
#include "lily_msl.h"
using namespace metal;

// Buffers in lily's order (docs/metal.md): the arguments at 0, then what the kernel reads, then
// what it writes.
template <typename T>
kernel void swiglu(constant uint& n [[buffer(0)]],
                   device const T* gate [[buffer(1)]],  // [n]
                   device const T* up [[buffer(2)]],    // [n]
                   device T* out [[buffer(3)]],         // [n]
                   uint gid [[thread_position_in_grid]]) {
  if (gid >= n) return;  // the grid is rounded up to whole threadgroups
  const float g = float(gate[gid]);
  out[gid] = T(g / (1.0f + exp(-g)) * float(up[gid]));
}

LILY_KERNEL_INSTANTIATE("swiglu_float", swiglu, float)
LILY_KERNEL_INSTANTIATE("swiglu_half", swiglu, half)
