// Gated DeltaNet mixer (Qwen3.5 / Qwen3-Next linear-attention layers).
//
//   qkv = in_qkv(h); z = in_z(h); b = in_b(h); a = in_a(h)
//   qkv <- silu(causal depthwise conv1d(qkv)) with the last K-1 inputs carried in the state
//   q, k <- l2-normalised per head; q *= 1/sqrt(Dk)
//   beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias);  value head h uses key head h / (Hv/Hk)
//   per value head, S [Dk, Dv] in f32:
//     S <- S * exp(g);  delta = (v - S^T k) * beta;  S <- S + k delta^T;  o = S^T q
//   y = out_proj(gated_rms_norm(o, z))
//
// A pass may hold several sequences (GdnRows segments, back to back over its rows): the
// projections run over all T rows at once; the causal conv and the recurrence run each segment
// on its own state.
//
// Shapes: T rows; Hk, Hv heads; Dk, Dv head dims; C = 2*Hk*Dk + Hv*Dv conv channels.
//   qkv [T, C]  z [T, Hv*Dv]  b, a [T, Hv]  conv state [K-1, C]  S [Hv, Dk, Dv]  o [T, Hv*Dv]
#pragma once
#include <vector>

#include "cpu/linear.h"
#include "cpu/thread_pool.h"
#include "model/pages.h"
#include "model/weights.h"

namespace lily::cpu {

struct GdnState {
  std::vector<float> conv;  // [K-1, C]: the last K-1 pre-conv inputs, oldest first
  HugeFloats S;             // [Hv, Dk, Dv] (on huge pages: model/pages.h)
};

struct GdnScratch {
  Matmul matmul = Matmul::F32;  // the backend's choice for the projections
  std::vector<float> qkv, qkvz, z, b, a, ba, conv_out, o;
  std::vector<float> beta, decay;  // [T, Hv]: sigmoid(b), exp(g)
};

// Rows [first, first + n) of the pass continue `state` (one sequence).
struct GdnRows {
  GdnState* state = nullptr;
  int first = 0, n = 0;
};

// taps: the layer's conv1d weights transposed to [K, C] (transpose_conv_taps, once per model).
// seqs [n_seqs]: back to back over the T rows from row 0.
void gated_deltanet_mixer(const ModelConfig& c, const GdnWeights& w, const float* taps, const GdnRows* seqs,
                          int n_seqs, const float* h, int T, float* y, GdnScratch& s, ThreadPool& pool);

// conv1d [C, K] -> [K, C]: the conv reads one row of taps per kernel position, contiguous over
// the channels each thread owns.
std::vector<float> transpose_conv_taps(const ModelConfig& c, const GdnWeights& w);

}  // namespace lily::cpu
