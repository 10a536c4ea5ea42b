// Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE with a gated shared expert.
//
//   mlp(x)  = down(silu(gate(x)) * up(x))
//   moe(x)  = sum_{e in topk(softmax(router(x)))} p_e * mlp_e(x)  +  sigmoid(shared_gate(x)) * mlp_shared(x)
//   (top-k probabilities renormalised to sum to 1 when norm_topk_prob; ties go to the lower id)
//
// Prefill groups the chunk's tokens by expert, so each routed expert's weights are expanded
// once per chunk, not once per token.
// Shapes: T tokens, H hidden, E experts, k = top_k, I = expert intermediate, n_e = tokens on e.
//   x [T, H]  router logits [T, E]  route ids/weights [T, k]  gathered xe [n_e, H]  act [n_e, I]
#pragma once
#include <cstdint>
#include <vector>

#include "cpu/linear.h"
#include "cpu/thread_pool.h"
#include "model/weights.h"

namespace lily::cpu {

struct FfnScratch {
  Matmul matmul = Matmul::F32;  // the backend's choice, read by every product below
  std::vector<float> gate, up, down, logits, route_w, ye, shared_gate;
  std::vector<float> slot_out;  // [T * top_k, H]: each (token, slot)'s expert output
  std::vector<int32_t> route_id, by_expert, expert_start, active;
};

void mlp_block(const MlpWeights& w, const float* x, int T, float* y, FfnScratch& s, ThreadPool& pool);
void moe_block(const ModelConfig& c, const MoeWeights& w, const float* x, int T, float* y, FfnScratch& s,
               ThreadPool& pool);

// Router: softmax over E logits in f32, top-k by probability (ties to the lowest id), then
// optional renormalisation. ids/weights [k].
void route_token(const float* logits, int E, int k, bool renormalize, int32_t* ids, float* weights);

}  // namespace lily::cpu
