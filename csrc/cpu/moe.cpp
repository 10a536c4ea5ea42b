#include "cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/linear.h"
#include "cpu/simd.h"

namespace lily::cpu {

namespace {

// act[n, I] = silu(gate) * up, written over gate.
void swiglu(float* gate, const float* up, size_t n) {
  for (size_t i = 0; i < n; ++i) gate[i] = silu(gate[i]) * up[i];
}

// y[T, H] = down(silu(gate(x)) * up(x)) using the scratch's gate/up buffers.
void swiglu_mlp(const MlpWeights& w, const float* x, int T, float* y, FfnScratch& s, ThreadPool& pool) {
  const int I = w.gate.out;
  s.gate.resize(size_t(T) * I);
  s.up.resize(size_t(T) * I);
  linear(w.gate, x, T, s.gate.data(), pool);
  linear(w.up, x, T, s.up.data(), pool);
  swiglu(s.gate.data(), s.up.data(), size_t(T) * I);
  linear(w.down, s.gate.data(), T, y, pool);
}

}  // namespace

void route_token(const float* logits, int E, int k, bool renormalize, int32_t* ids, float* weights) {
  float mx = -INFINITY;
  for (int e = 0; e < E; ++e) mx = std::max(mx, logits[e]);
  float sum = 0;
  for (int e = 0; e < E; ++e) sum += std::exp(logits[e] - mx);
  // Selection by logit is selection by probability (softmax is monotonic); insertion into a
  // k-sized sorted list keeps the lowest id first among equals.
  int n = 0;
  for (int e = 0; e < E; ++e) {
    const float v = logits[e];
    if (n == k && v <= logits[ids[k - 1]]) continue;
    int pos = std::min(n, k - 1);
    while (pos > 0 && logits[ids[pos - 1]] < v) {
      ids[pos] = ids[pos - 1];
      --pos;
    }
    ids[pos] = e;
    n = std::min(n + 1, k);
  }
  float total = 0;
  for (int i = 0; i < k; ++i) {
    weights[i] = std::exp(logits[ids[i]] - mx) / sum;
    total += weights[i];
  }
  if (renormalize)
    for (int i = 0; i < k; ++i) weights[i] /= total;
}

void mlp_block(const MlpWeights& w, const float* x, int T, float* y, FfnScratch& s, ThreadPool& pool) {
  swiglu_mlp(w, x, T, y, s, pool);
}

void moe_block(const ModelConfig& c, const MoeWeights& w, const float* x, int T, float* y, FfnScratch& s,
               ThreadPool& pool) {
  const int H = c.hidden, E = c.n_experts, k = c.top_k;
  s.logits.resize(size_t(T) * E);
  s.route_id.resize(size_t(T) * k);
  s.route_w.resize(size_t(T) * k);
  linear(w.router, x, T, s.logits.data(), pool);
  for (int t = 0; t < T; ++t)
    route_token(s.logits.data() + size_t(t) * E, E, k, c.norm_topk_prob, s.route_id.data() + size_t(t) * k,
                s.route_w.data() + size_t(t) * k);

  // Counting sort of (token, slot) pairs by expert.
  s.expert_start.assign(E + 1, 0);
  for (int i = 0; i < T * k; ++i) s.expert_start[s.route_id[i] + 1]++;
  for (int e = 0; e < E; ++e) s.expert_start[e + 1] += s.expert_start[e];
  s.by_expert.resize(size_t(T) * k);
  {
    std::vector<int32_t> fill(s.expert_start.begin(), s.expert_start.end() - 1);
    for (int i = 0; i < T * k; ++i) s.by_expert[fill[s.route_id[i]]++] = i;  // i = t * k + slot
  }

  std::fill(y, y + size_t(T) * H, 0.0f);
  for (int e = 0; e < E; ++e) {
    const int b = s.expert_start[e], n = s.expert_start[e + 1] - b;
    if (n == 0) continue;
    s.xe.resize(size_t(n) * H);
    s.ye.resize(size_t(n) * H);
    for (int j = 0; j < n; ++j)
      std::memcpy(s.xe.data() + size_t(j) * H, x + size_t(s.by_expert[b + j] / k) * H, H * sizeof(float));
    swiglu_mlp(w.experts[e], s.xe.data(), n, s.ye.data(), s, pool);
    for (int j = 0; j < n; ++j) {
      const int i = s.by_expert[b + j];
      axpy(s.route_w[i], s.ye.data() + size_t(j) * H, y + size_t(i / k) * H, H);
    }
  }

  if (c.shared_intermediate > 0) {
    s.shared_gate.resize(T);
    linear(w.shared_gate, x, T, s.shared_gate.data(), pool);
    s.ye.resize(size_t(T) * H);
    swiglu_mlp(w.shared, x, T, s.ye.data(), s, pool);
    for (int t = 0; t < T; ++t) axpy(sigmoid(s.shared_gate[t]), s.ye.data() + size_t(t) * H, y + size_t(t) * H, H);
  }
}

}  // namespace lily::cpu
