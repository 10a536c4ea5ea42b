// SwiGLU activation, the worked example of docs/add-a-kernel.md:
//   out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i]
// One thread per element; T is the storage type (float, half, bfloat), arithmetic in float as
// the CPU backend does it, rounded to T once at the store.
#include <metal_stdlib>
#include "lily_msl.h"
using namespace metal;

template <typename T>
kernel void swiglu(device const T* gate [[buffer(0)]],  // [n]
                   device const T* up [[buffer(1)]],    // [n]
                   device T* out [[buffer(2)]],         // [n]
                   constant uint& n [[buffer(3)]],
                   uint gid [[thread_position_in_grid]]) {
  if (gid >= n) return;  // the grid is rounded up to whole threadgroups
  const float g = float(gate[gid]);
  out[gid] = T(g / (1.0f + exp(-g)) * float(up[gid]));
}

LILY_KERNEL_INSTANTIATE("swiglu_float", swiglu, float)
LILY_KERNEL_INSTANTIATE("swiglu_half", swiglu, half)
