#include "cpu/norm.h"

#include <cmath>

#include "cpu/simd.h"

namespace lily::cpu {

namespace {
float inv_rms(const float* x, int n, float eps) { return 1.0f / std::sqrt(dot(x, x, n) / float(n) + eps); }
}  // namespace

void rms_norm(const float* x, const float* w, int n, float eps, float* out) {
  const float r = inv_rms(x, n, eps);
  for (int i = 0; i < n; ++i) out[i] = (x[i] * r) * w[i];
}

void gated_rms_norm(const float* x, const float* z, const float* w, int n, float eps, float* out) {
  const float r = inv_rms(x, n, eps);
  map_elementwise(out, size_t(n), [r](auto xi, auto zi, auto wi) { return (wi * (xi * r)) * silu(zi); }, x, z, w);
}

void l2_normalize(float* x, int n, float eps) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) + eps);
  for (int i = 0; i < n; ++i) x[i] *= r;
}

}  // namespace lily::cpu
