// Arguments of the MoE family (metal/moe.metal), shared by host and kernels.
//
// Experts are addressed through offset tables: table[e] = {w, scales, biases} byte offsets of
// expert e's matrix inside the buffers bound for that matrix (the mmapped checkpoint files).
// That covers both stacked MLX switch_mlp tensors and HF per-expert tensors with no copy.
// A dense MLP and the shared expert run through the same kernels as a one-expert table.
//
// Layouts: h [T, H]; logits [T, E]; ids, weights [T, k]; act [T, k, I]; y [T, H].
#pragma once
#include "quant_args.h"

#define LILY_MOE_MAX_TOPK 32

struct MoeRouteArgs {
  uint32_t E, k;
  uint32_t renormalize;  // divide the k weights by their sum (norm_topk_prob)
};

// act[t, j, :] = silu(gate_e . h[t]) * (up_e . h[t]),  e = ids[t, j]
struct MoeGateUpArgs {
  QuantMatrix gate, up;  // [I, H] each
  uint32_t k;            // jobs per token (routed experts; 1 for the shared expert / dense MLP)
};

// y[t, r] = sum_j w[t, j] * down_e[r] . act[t, j]  (+ sigmoid(sg[t]) * shared_down[r] . act_s[t])
struct MoeDownArgs {
  QuantMatrix down;         // [H, I]
  QuantMatrix shared_down;  // [H, Is]
  uint32_t k;
  uint32_t weighted;    // 0: every job has weight 1 (dense MLP)
  uint32_t has_shared;  // add the sigmoid-gated shared expert
};
