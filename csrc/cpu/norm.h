// RMSNorm family, all in f32.
//   rms_norm:        out = x * rsqrt(mean(x^2) + eps) * w     (w is the full gain: the
//                    zero-centred norms' 1 + w is folded in at load)
//   gated_rms_norm:  out = (x * rsqrt(mean(x^2) + eps) * w) * silu(z)   (DeltaNet output norm)
//   l2_normalize:    x *= rsqrt(sum(x^2) + eps)                (DeltaNet q and k)
#pragma once

namespace lily::cpu {

void rms_norm(const float* x, const float* w, int n, float eps, float* out);
void gated_rms_norm(const float* x, const float* z, const float* w, int n, float eps, float* out);
void l2_normalize(float* x, int n, float eps);

}  // namespace lily::cpu
