#include "cpu/gdn.h"

#include <cmath>
#include <cstring>

#include "cpu/linear.h"
#include "cpu/norm.h"
#include "cpu/simd.h"

namespace lily::cpu {

namespace {

// Qwen3-Next projects [q k v z] and [b a] grouped per key head:
//   qkvz row block g = [q_g (Dk) | k_g (Dk) | v_g (r*Dv) | z_g (r*Dv)],  r = Hv / Hk
//   ba row block g   = [b_g (r) | a_g (r)]
// Scatter them into the ungrouped layout the rest of the mixer uses.
void ungroup_qkvz(const ModelConfig& c, const float* qkvz, const float* ba, int T, float* qkv, float* z, float* b,
                  float* a) {
  const int Hk = c.gdn_k_heads, Dk = c.gdn_k_dim, Dv = c.gdn_v_dim, r = c.gdn_v_heads / c.gdn_k_heads;
  const int key_dim = Hk * Dk, C = c.gdn_qkv_dim(), vdim = c.gdn_value_dim(), Hv = c.gdn_v_heads;
  const int block = 2 * Dk + 2 * r * Dv;
  for (int t = 0; t < T; ++t) {
    const float* src = qkvz + size_t(t) * (C + vdim);
    float* dq = qkv + size_t(t) * C;
    for (int g = 0; g < Hk; ++g) {
      const float* blk = src + size_t(g) * block;
      std::memcpy(dq + g * Dk, blk, Dk * sizeof(float));
      std::memcpy(dq + key_dim + g * Dk, blk + Dk, Dk * sizeof(float));
      std::memcpy(dq + 2 * key_dim + g * r * Dv, blk + 2 * Dk, size_t(r) * Dv * sizeof(float));
      std::memcpy(z + size_t(t) * vdim + g * r * Dv, blk + 2 * Dk + r * Dv, size_t(r) * Dv * sizeof(float));
      const float* bag = ba + size_t(t) * 2 * Hv + g * 2 * r;
      std::memcpy(b + size_t(t) * Hv + g * r, bag, r * sizeof(float));
      std::memcpy(a + size_t(t) * Hv + g * r, bag + r, r * sizeof(float));
    }
  }
}

}  // namespace

std::vector<float> transpose_conv_taps(const ModelConfig& c, const GdnWeights& w) {
  const int C = c.gdn_qkv_dim(), K = c.conv_kernel;
  std::vector<float> taps(size_t(K) * C);
  for (int ch = 0; ch < C; ++ch)
    for (int j = 0; j < K; ++j) taps[size_t(j) * C + ch] = w.conv1d[size_t(ch) * K + j];
  return taps;
}

void gated_deltanet_mixer(const ModelConfig& c, const GdnWeights& w, const float* taps, const GdnRows* seqs,
                          int n_seqs, const float* h, int T, float* y, GdnScratch& s, ThreadPool& pool) {
  const int Hk = c.gdn_k_heads, Hv = c.gdn_v_heads, Dk = c.gdn_k_dim, Dv = c.gdn_v_dim, K = c.conv_kernel;
  const int C = c.gdn_qkv_dim(), vdim = c.gdn_value_dim(), key_dim = Hk * Dk, r = Hv / Hk;
  s.qkv.resize(size_t(T) * C);
  s.z.resize(size_t(T) * vdim);
  s.b.resize(size_t(T) * Hv);
  s.a.resize(size_t(T) * Hv);
  if (c.gdn_fused_qkvz) {
    s.qkvz.resize(size_t(T) * (C + vdim));
    s.ba.resize(size_t(T) * 2 * Hv);
    linear(w.in_qkvz, h, T, s.qkvz.data(), pool, s.matmul);
    linear(w.in_ba, h, T, s.ba.data(), pool, s.matmul);
    ungroup_qkvz(c, s.qkvz.data(), s.ba.data(), T, s.qkv.data(), s.z.data(), s.b.data(), s.a.data());
  } else {
    linear(w.in_qkv, h, T, s.qkv.data(), pool, s.matmul);
    linear(w.in_z, h, T, s.z.data(), pool, s.matmul);
    linear(w.in_b, h, T, s.b.data(), pool, s.matmul);
    linear(w.in_a, h, T, s.a.data(), pool, s.matmul);
  }

  // Causal depthwise conv over [carried K-1 inputs ; the sequence's rows], then SiLU, for each
  // sequence of the pass in turn. Channels are independent, so threads split the channel axis;
  // each thread walks its channel range row by row (token-major, as qkv is laid out), so every
  // load is contiguous and vectorises; the taps come transposed to [K, C] for the same reason.
  // Per channel the sum runs over taps in order from 0, exactly as a per-channel loop would.
  s.conv_out.resize(size_t(T) * C);
  pool.parallel_for(
      C,
      [&](int64_t c0, int64_t c1, int) {
        const int64_t n = c1 - c0;
        for (int sq = 0; sq < n_seqs; ++sq) {
          GdnState& st = *seqs[sq].state;
          const float* qkv = s.qkv.data() + size_t(seqs[sq].first) * C;  // the sequence's rows [Ts, C]
          float* conv_out = s.conv_out.data() + size_t(seqs[sq].first) * C;
          const int Ts = seqs[sq].n;
          for (int t = 0; t < Ts; ++t) {
            float* out = conv_out + size_t(t) * C + c0;
            std::fill(out, out + n, 0.0f);
            for (int j = 0; j < K; ++j) {
              const int src = t + j - (K - 1);  // < 0: from the carried state
              const float* xin = (src >= 0 ? qkv + size_t(src) * C : st.conv.data() + size_t(K - 1 + src) * C) + c0;
              const float* tap = taps + size_t(j) * C + c0;
              for (int64_t i = 0; i < n; ++i) out[i] += tap[i] * xin[i];
            }
            for (int64_t i = 0; i < n; ++i) out[i] = silu(out[i]);
          }
          // Carry the last K-1 inputs (rows in increasing order: a row is read before it is
          // overwritten, as j + Ts > j).
          for (int j = 0; j < K - 1; ++j) {
            const int src = Ts - (K - 1) + j;
            const float* from = (src >= 0 ? qkv + size_t(src) * C : st.conv.data() + size_t(j + Ts) * C) + c0;
            std::copy(from, from + n, st.conv.data() + size_t(j) * C + c0);
          }
        }
      },
      16);

  // The recurrence: sequential in t, independent per (sequence, value head) item.
  s.o.resize(size_t(T) * vdim);
  const float q_scale = 1.0f / std::sqrt(float(Dk));
  pool.parallel_for(int64_t(n_seqs) * Hv, [&](int64_t i0, int64_t i1, int) {
    thread_local std::vector<float> q, k, kv_mem;
    q.resize(Dk);
    k.resize(Dk);
    kv_mem.resize(Dv);
    for (int64_t item = i0; item < i1; ++item) {
      const GdnRows& sq = seqs[item / Hv];
      const int hv = int(item % Hv), hk = hv / r;
      float* S = sq.state->S.data() + size_t(hv) * Dk * Dv;
      for (int t = sq.first; t < sq.first + sq.n; ++t) {
        const float* row = s.conv_out.data() + size_t(t) * C;
        std::memcpy(q.data(), row + hk * Dk, Dk * sizeof(float));
        std::memcpy(k.data(), row + key_dim + hk * Dk, Dk * sizeof(float));
        const float* v = row + 2 * key_dim + hv * Dv;
        l2_normalize(q.data(), Dk, 1e-6f);
        l2_normalize(k.data(), Dk, 1e-6f);
        for (int i = 0; i < Dk; ++i) q[i] *= q_scale;
        const float beta = sigmoid(s.b[size_t(t) * Hv + hv]);
        const float g = w.a_neg[hv] * softplus(s.a[size_t(t) * Hv + hv] + w.dt_bias[hv]);
        const float decay = std::exp(g);
        // Pass 1: decay S and read kv_mem = S^T k.
        std::fill(kv_mem.begin(), kv_mem.end(), 0.0f);
        for (int i = 0; i < Dk; ++i) {
          float* Si = S + size_t(i) * Dv;
          for (int j = 0; j < Dv; ++j) Si[j] *= decay;
          axpy(k[i], Si, kv_mem.data(), Dv);
        }
        // Pass 2: rank-1 update with delta, and read o = S^T q.
        float* o = s.o.data() + size_t(t) * vdim + hv * Dv;
        for (int j = 0; j < Dv; ++j) kv_mem[j] = (v[j] - kv_mem[j]) * beta;  // delta
        std::fill(o, o + Dv, 0.0f);
        for (int i = 0; i < Dk; ++i) {
          float* Si = S + size_t(i) * Dv;
          axpy(k[i], kv_mem.data(), Si, Dv);
          axpy(q[i], Si, o, Dv);
        }
        gated_rms_norm(o, s.z.data() + size_t(t) * vdim + hv * Dv, w.norm.data(), Dv, c.rms_eps, o);
      }
    }
  });

  linear(w.out_proj, s.o.data(), T, y, pool, s.matmul);
}

}  // namespace lily::cpu
