// Arguments of the norm family (metal/norm.metal), shared by host and kernels.
#pragma once

// x[t] (+= y[t] when add); h[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w
struct NormArgs {
  uint32_t n;    // hidden size
  uint32_t add;  // 1: fold the residual add in first
  float eps;
};

static_assert(sizeof(NormArgs) == 12, "NormArgs: 3 fields of 4 bytes, as the kernels read them");
