#include "cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/linear.h"
#include "cpu/simd.h"

namespace lily::cpu {

namespace {

// act[n, I] = silu(gate) * up, written over gate. Vectorised (map_elementwise): in decode this
// runs on the main thread between two parallel regions, where a libm exp per value took 9-11 us
// of each medium-model MoE layer; vectorised, 2-3 us (Zen 5 VM, 2 threads, alternated builds).
void swiglu(float* gate, const float* up, size_t n) {
  map_elementwise(gate, n, [](auto g, auto u) { return silu(g) * u; }, gate, up);
}

// y[T, H] = down(silu(gate(x)) * up(x)) using the scratch's gate/up buffers.
void swiglu_mlp(const MlpWeights& w, const float* x, int T, float* y, FfnScratch& s, ThreadPool& pool) {
  const int I = w.gate.out;
  s.gate.resize(size_t(T) * I);
  s.up.resize(size_t(T) * I);
  linear(w.gate, x, T, s.gate.data(), pool, s.matmul);
  linear(w.up, x, T, s.up.data(), pool, s.matmul);
  swiglu(s.gate.data(), s.up.data(), size_t(T) * I);
  linear(w.down, s.gate.data(), T, y, pool, s.matmul);
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

namespace {

// One token (decode): the k routed experts and the shared expert are all fed the same x, so
// x is prepared once and every expert's gate and up rows run in ONE parallel region, then every
// down row and their weighted sum in a second (linear_group, linear_sum): two pool wake-ups per
// MoE block instead of three per expert. The router and the shared expert's gate, both f32,
// share a region before them.
void moe_single_token(const ModelConfig& c, const MoeWeights& w, const float* x, float* y, FfnScratch& s,
                      ThreadPool& pool) {
  const int H = c.hidden, E = c.n_experts, k = c.top_k;
  const bool shared = c.shared_intermediate > 0;
  s.logits.resize(E);
  s.route_id.resize(k);
  s.route_w.resize(k);
  // The router stays f32 in every mode: a rounding of x must not flip an expert choice.
  float shared_logit = 0;
  const LinearJob gates[2] = {{&w.router, x, s.logits.data()}, {&w.shared_gate, x, &shared_logit}};
  linear_group(gates, shared ? 2 : 1, 1, pool, Matmul::F32);
  route_token(s.logits.data(), E, k, c.norm_topk_prob, s.route_id.data(), s.route_w.data());

  // Experts: routed ones in id order (the reference sums them so), then the shared expert.
  struct Expert {
    const MlpWeights* mlp;
    size_t act_at;  // offset of this expert's [gate | up] outputs in s.gate
  };
  std::vector<std::pair<int32_t, float>> routed(k);
  for (int i = 0; i < k; ++i) routed[i] = {s.route_id[i], s.route_w[i]};
  std::sort(routed.begin(), routed.end());
  thread_local std::vector<Expert> experts_store;
  thread_local std::vector<LinearJob> jobs_store;
  thread_local std::vector<float> mix_store;  // each expert's weight in y, in the same order
  std::vector<Expert>& experts = experts_store;
  std::vector<LinearJob>& jobs = jobs_store;
  std::vector<float>& mix = mix_store;
  experts.clear();
  mix.clear();
  size_t rows = 0;
  for (auto [e, wt] : routed) {
    experts.push_back({&w.experts[e], rows});
    mix.push_back(wt);
    rows += 2 * size_t(w.experts[e].gate.out);
  }
  if (shared) {
    experts.push_back({&w.shared, rows});
    mix.push_back(sigmoid(shared_logit));
    rows += 2 * size_t(w.shared.gate.out);
  }
  const int n = int(experts.size());

  // Phase 1: [gate | up] of every expert, [rows] in s.gate.
  s.gate.resize(rows);
  jobs.clear();
  for (const Expert& ex : experts) {
    jobs.push_back({&ex.mlp->gate, x, s.gate.data() + ex.act_at});
    jobs.push_back({&ex.mlp->up, x, s.gate.data() + ex.act_at + ex.mlp->gate.out});
  }
  linear_group(jobs.data(), int(jobs.size()), 1, pool, s.matmul);

  // SwiGLU per expert (over its gate outputs), then phase 2: every expert's down rows, [n, H],
  // and y = their weighted sum in the experts' order, each thread summing the rows it computed.
  s.ye.resize(size_t(n) * H);
  jobs.clear();
  for (int i = 0; i < n; ++i) {
    float* g = s.gate.data() + experts[i].act_at;
    swiglu(g, g + experts[i].mlp->gate.out, size_t(experts[i].mlp->gate.out));
    jobs.push_back({&experts[i].mlp->down, g, s.ye.data() + size_t(i) * H});
  }
  linear_sum(jobs.data(), mix.data(), n, y, pool, s.matmul);
}

}  // namespace

void moe_block(const ModelConfig& c, const MoeWeights& w, const float* x, int T, float* y, FfnScratch& s,
               ThreadPool& pool) {
  if (T == 1) {
    moe_single_token(c, w, x, y, s, pool);
    return;
  }
  const int H = c.hidden, E = c.n_experts, k = c.top_k;
  s.logits.resize(size_t(T) * E);
  s.route_id.resize(size_t(T) * k);
  s.route_w.resize(size_t(T) * k);
  linear(w.router, x, T, s.logits.data(), pool, Matmul::F32);
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

  // Experts in parallel, each computed whole by one thread (a chunk spreads its tokens over
  // many experts, so this keeps every thread busy with one wake-up instead of three per
  // expert). Each (token, slot) gets its own output row, so no two threads write one row.
  std::vector<int32_t>& active = s.active;
  active.clear();
  for (int e = 0; e < E; ++e)
    if (s.expert_start[e + 1] > s.expert_start[e]) active.push_back(e);
  s.slot_out.resize(size_t(T) * k * H);
  pool.parallel_for(int64_t(active.size()), [&](int64_t a0, int64_t a1, int) {
    thread_local std::vector<float> xe, gate, up, down;
    for (int64_t a = a0; a < a1; ++a) {
      const int e = active[a], b = s.expert_start[e], n = s.expert_start[e + 1] - b;
      const MlpWeights& ew = w.experts[e];
      const int I = ew.gate.out;
      xe.resize(size_t(n) * H);
      gate.resize(size_t(n) * I);
      up.resize(size_t(n) * I);
      down.resize(size_t(n) * H);
      for (int j = 0; j < n; ++j)
        std::memcpy(xe.data() + size_t(j) * H, x + size_t(s.by_expert[b + j] / k) * H, H * sizeof(float));
      linear_serial(ew.gate, xe.data(), n, gate.data(), s.matmul);
      linear_serial(ew.up, xe.data(), n, up.data(), s.matmul);
      swiglu(gate.data(), up.data(), size_t(n) * I);
      linear_serial(ew.down, gate.data(), n, down.data(), s.matmul);
      for (int j = 0; j < n; ++j)
        std::memcpy(s.slot_out.data() + size_t(s.by_expert[b + j]) * H, down.data() + size_t(j) * H,
                    H * sizeof(float));
    }
  });
  // y = sum of the routed outputs in expert-id order, as the single-token path adds them (the
  // same operations, so a token's result does not depend on which path or chunk ran it).
  pool.parallel_for(T, [&](int64_t t0, int64_t t1, int) {
    thread_local std::vector<int> order;  // the token's slots by expert id
    order.resize(k);
    for (int64_t t = t0; t < t1; ++t) {
      float* yt = y + size_t(t) * H;
      std::fill(yt, yt + H, 0.0f);
      for (int slot = 0; slot < k; ++slot) {
        int pos = slot;
        while (pos > 0 && s.route_id[size_t(t) * k + order[pos - 1]] > s.route_id[size_t(t) * k + slot]) {
          order[pos] = order[pos - 1];
          --pos;
        }
        order[pos] = slot;
      }
      for (int j = 0; j < k; ++j) {
        const size_t i = size_t(t) * k + order[j];
        axpy(s.route_w[i], s.slot_out.data() + i * H, yt, H);
      }
    }
  });

  if (c.shared_intermediate > 0) {
    s.shared_gate.resize(T);
    linear(w.shared_gate, x, T, s.shared_gate.data(), pool, Matmul::F32);
    s.ye.resize(size_t(T) * H);
    swiglu_mlp(w.shared, x, T, s.ye.data(), s, pool);
    for (int t = 0; t < T; ++t) axpy(sigmoid(s.shared_gate[t]), s.ye.data() + size_t(t) * H, y + size_t(t) * H, H);
  }
}

}  // namespace lily::cpu
