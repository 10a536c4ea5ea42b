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
static_assert(sizeof(MoeRouteArgs) == 12, "MoeRouteArgs: 3 fields of 4 bytes");

// act[t, j, :] = silu(gate_e . h[t]) * (up_e . h[t]),  e = ids[t, j]
struct MoeGateUpArgs {
  QuantMatrix gate, up;  // [I, H] each
  uint32_t k;            // jobs per token (routed experts; 1 for the shared expert / dense MLP)
};
static_assert(sizeof(MoeGateUpArgs) == 44, "MoeGateUpArgs: 2 QuantMatrix and 1 field of 4 bytes");

// y[t, r] = sum_j w[t, j] * down_e[r] . act[t, j]  (+ sigmoid(sg[t]) * shared_down[r] . act_s[t])
// The jobs (k routed experts, then the shared one as job k) are spread over teams of `lanes`
// lanes, 32 / lanes teams side by side in a simdgroup: team p takes jobs p, p + 32 / lanes, ...
// (moe_down_lanes on the host picks lanes by the rows' length; it depends on shapes and k only,
// never on T, so a row's order of summation is the same in every batch).
struct MoeDownArgs {
  QuantMatrix down;         // [H, I]
  QuantMatrix shared_down;  // [H, Is]
  uint32_t k;
  uint32_t weighted;    // 0: every job has weight 1 (dense MLP)
  uint32_t has_shared;  // add the sigmoid-gated shared expert
  uint32_t lanes;       // lanes per job: 4, 8, 16 or 32
};
static_assert(sizeof(MoeDownArgs) == 56, "MoeDownArgs: 2 QuantMatrix and 4 fields of 4 bytes");

// ---- prefill: routing on the GPU and grouped expert GEMMs ----------------------------------------
//
// moe_plan turns ids [T, k] into the work of the grouped GEMMs without the CPU reading counts:
//   rows   [T*k]          slots s = t*k + j sorted by expert (stable: increasing s per expert)
//   blocks [max_blocks]   uint4 {expert, first sorted row, rows (<= block_rows), 0}; only
//                         experts with tokens get blocks, ceil(count / block_rows) each
//   header [4]            {blocks used, 0, 0, 0}
// The grids are sized by the bound max_blocks = min(E, T*k) + floor(T*k / block_rows) (a sum of
// ceilings is at most the floor of the sum plus one per non-empty expert); threadgroups past
// header[0] return at once.
#define LILY_MOE_PLAN_THREADS 1024  // one thread per expert: E <= 1024
#define LILY_MOE_PLAN_TILE 4096     // ids staged in threadgroup memory this many at a time

struct MoePlanArgs {
  uint32_t n;           // T*k routed rows
  uint32_t E;
  uint32_t block_rows;  // BM of the GEMMs that read the map (8 or 32)
};
static_assert(sizeof(MoePlanArgs) == 12, "MoePlanArgs: 3 fields of 4 bytes");

// One grouped GEMM over the block map (routed = 1) or over the rows 0..n in BM blocks of one
// expert (routed = 0: the shared expert and a dense MLP).
//   gate_up: act[i, :] = silu(gate_e . x) * (up_e . x),  x = h[rows[i] / k]  (routed)
//                                                        x = h[i]            (not routed)
//   down:    routed: yr[rows[i], :] = weights[rows[i]] * down_e . act[i];  else y[i, :] = down . act[i]
struct MoeGemmArgs {
  QuantMatrix a, b;  // gate, up (gate_up); down, unused (down)
  uint32_t k;        // jobs per token
  uint32_t routed;
  uint32_t n;        // rows (routed: T*k; else T)
};
static_assert(sizeof(MoeGemmArgs) == 52, "MoeGemmArgs: 2 QuantMatrix and 3 fields of 4 bytes");

// y[t, :] = sum_j yr[t*k + j, :] (+ sigmoid(sg[t]) * ys[t, :])
struct MoeCombineArgs {
  uint32_t H, k;
  uint32_t has_shared;
};
static_assert(sizeof(MoeCombineArgs) == 12, "MoeCombineArgs: 3 fields of 4 bytes");
