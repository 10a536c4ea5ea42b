#include "cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/linear.h"
#include "cpu/norm.h"
#include "cpu/simd.h"

namespace lily::cpu {

void KvCache::reserve(int positions, int max_positions) {
  if (positions <= capacity) return;
  int cap = std::max(capacity, 256);
  while (cap < positions) cap *= 2;
  cap = std::min(cap, max_positions);
  std::vector<float> nk(size_t(kv_heads) * cap * head_dim), nv(nk.size());
  for (int hh = 0; hh < kv_heads && capacity > 0; ++hh) {
    std::memcpy(nk.data() + size_t(hh) * cap * head_dim, k.data() + size_t(hh) * capacity * head_dim,
                size_t(capacity) * head_dim * sizeof(float));
    std::memcpy(nv.data() + size_t(hh) * cap * head_dim, v.data() + size_t(hh) * capacity * head_dim,
                size_t(capacity) * head_dim * sizeof(float));
  }
  k.swap(nk);
  v.swap(nv);
  capacity = cap;
}

namespace {

// Rotate-half RoPE on x[0 .. rot): pairs (i, i + rot/2) turn by angle pos * inv_freq[i].
void rope(float* x, int rot, const float* cos, const float* sin) {
  const int half = rot / 2;
  for (int i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i] + a * sin[i];
  }
}

}  // namespace

void attention_mixer(const ModelConfig& c, const AttentionWeights& w, KvCache& cache, int pos0, int max_context,
                     const float* h, int T, float* y, AttentionScratch& s, ThreadPool& pool) {
  const int Hq = c.n_heads, Hkv = c.n_kv_heads, D = c.head_dim, rot = c.rotary_dim, half = rot / 2;
  const int group = Hq / Hkv;
  s.qg.resize(size_t(T) * Hq * 2 * D);
  s.k.resize(size_t(T) * Hkv * D);
  s.v.resize(size_t(T) * Hkv * D);
  s.o.resize(size_t(T) * Hq * D);
  linear(w.q_proj, h, T, s.qg.data(), pool, s.matmul);
  linear(w.k_proj, h, T, s.k.data(), pool, s.matmul);
  linear(w.v_proj, h, T, s.v.data(), pool, s.matmul);

  // RoPE tables for this chunk's positions. inv_freq and the angle are rounded to f32 the way
  // the reference computes them, so long-context angles agree.
  s.rope_cos.resize(size_t(T) * half);
  s.rope_sin.resize(size_t(T) * half);
  for (int i = 0; i < half; ++i) {
    const float inv_freq = float(1.0 / std::pow(c.rope_theta, double(float(2 * i) / float(rot))));
    for (int t = 0; t < T; ++t) {
      const float angle = float(pos0 + t) * inv_freq;
      s.rope_cos[size_t(t) * half + i] = std::cos(angle);
      s.rope_sin[size_t(t) * half + i] = std::sin(angle);
    }
  }

  // Normalise + rotate q and k in place; append k, v to the cache.
  cache.reserve(pos0 + T, max_context);
  pool.parallel_for(T, [&](int64_t t0, int64_t t1, int) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* cs = s.rope_cos.data() + size_t(t) * half;
      const float* sn = s.rope_sin.data() + size_t(t) * half;
      for (int hq = 0; hq < Hq; ++hq) {
        float* q = s.qg.data() + (size_t(t) * Hq + hq) * 2 * D;
        rms_norm(q, w.q_norm.data(), D, c.rms_eps, q);
        rope(q, rot, cs, sn);
      }
      for (int hk = 0; hk < Hkv; ++hk) {
        float* k = s.k.data() + (size_t(t) * Hkv + hk) * D;
        rms_norm(k, w.k_norm.data(), D, c.rms_eps, k);
        rope(k, rot, cs, sn);
        std::memcpy(cache.k_at(hk, pos0 + int(t)), k, D * sizeof(float));
        std::memcpy(cache.v_at(hk, pos0 + int(t)), s.v.data() + (size_t(t) * Hkv + hk) * D, D * sizeof(float));
      }
    }
  });

  // One task per (token, query head): causal softmax over positions [0, pos0 + t].
  const float scale = 1.0f / std::sqrt(float(D));
  const int n_ctx = pos0 + T;
  pool.parallel_for(int64_t(T) * Hq, [&](int64_t i0, int64_t i1, int) {
    thread_local std::vector<float> scores;
    scores.resize(n_ctx);
    for (int64_t i = i0; i < i1; ++i) {
      const int t = int(i / Hq), hq = int(i % Hq), hk = hq / group;
      const int len = pos0 + t + 1;
      const float* q = s.qg.data() + (size_t(t) * Hq + hq) * 2 * D;
      const float* gate = q + D;
      float mx = -INFINITY;
      for (int p = 0; p < len; ++p) {
        scores[p] = dot(q, cache.k_at(hk, p), D) * scale;
        mx = std::max(mx, scores[p]);
      }
      float sum = 0;
      for (int p = 0; p < len; ++p) {
        scores[p] = std::exp(scores[p] - mx);
        sum += scores[p];
      }
      float* o = s.o.data() + (size_t(t) * Hq + hq) * D;
      std::fill(o, o + D, 0.0f);
      const float inv = 1.0f / sum;
      for (int p = 0; p < len; ++p) axpy(scores[p] * inv, cache.v_at(hk, p), o, D);
      for (int d = 0; d < D; ++d) o[d] *= sigmoid(gate[d]);
    }
  });

  linear(w.o_proj, s.o.data(), T, y, pool, s.matmul);
}

}  // namespace lily::cpu
