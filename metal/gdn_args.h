// Arguments of the Gated DeltaNet family (metal/gdn.metal), shared by host and kernels.
//
// Layouts: qkv [T, C] with C = 2*Hk*Dk + Hv*Dv ([q | k | v], heads contiguous);
// z [T, Hv*Dv]; b, a [T, Hv]; conv state [K-1, C] (oldest first); taps [C, K];
// recurrent state S [Hv, Dk, Dv] f32; Qwen3-Next grouped inputs qkvz [T, C + Hv*Dv], ba [T, 2*Hv].
#pragma once

#define LILY_GDN_MAX_DK 256  // key head dim held per thread (the state column lives in registers)

struct GdnArgs {
  uint32_t T;
  uint32_t Hk, Hv, Dk, Dv;
  uint32_t K;  // conv kernel width
  uint32_t C;  // conv channels
  float eps;      // gated RMSNorm epsilon
  float q_scale;  // 1 / sqrt(Dk)
};
