// Function constants of several types, is_function_constant_defined, and the [[kernel]]
// attribute spelling: out[i] = in[i] * scale + offset + bias, where a constant that the
// pipeline does not define falls back to a neutral value.
#include <metal_stdlib>
#include "lily_msl.h"
using namespace metal;

constant float scale [[function_constant(0)]];
constant uint offset [[function_constant(1)]];
constant half bias [[function_constant(2)]];
constant int sign_flip [[function_constant(3)]];

[[kernel]] void apply_constants(device const float* in [[buffer(0)]],
                                device float* out [[buffer(1)]],
                                uint gid [[thread_position_in_grid]]) {
  const float s = is_function_constant_defined(scale) ? scale : 1.0f;
  const float o = is_function_constant_defined(offset) ? float(offset) : 0.0f;
  const float b = is_function_constant_defined(bias) ? float(bias) : 0.0f;
  const float f = is_function_constant_defined(sign_flip) ? float(sign_flip) : 1.0f;
  out[gid] = f * (in[gid] * s + o + b);
}
