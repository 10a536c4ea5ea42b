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


#if defined(LILY_FVEC)
// Slice widths of the recurrence (columns of S walked together; see the parallel region).
// Prefill: 32 columns, a Dk x 32 slice (16 KB) that stays in L1 across a chunk's tokens.
// Decode: a single token reads each slice once, so the slice is as wide as the registers allow
// (kv_mem, delta and o of the slice: 3 x 8 vectors of 16 on AVX-512; AVX2 and NEON have too
// few registers for 128 columns), so its rows are contiguous and the hardware prefetcher
// streams a head's S from memory instead of taking a 128-byte bite every 512 bytes
// (perf: 6% of a one-thread decode step on the medium model went to those misses).
constexpr int kGdnCols = 32;
constexpr int kDecodeCols = FVec::kWidth == 16 ? 128 : kGdnCols;

// One token's step on columns [0, N * kWidth) of a head's S (row i at S + i * Dv): decay S and
// read kv_mem = S^T k, delta = (v - kv_mem) * beta, rank-1 update S += k delta^T while reading
// o = S^T q. kv_mem, delta and o stay in registers; per column these are the FMAs of the
// scalar loop below, in its order, so the result does not depend on N.
// Pass 1 only reads S: pass 2 multiplies by the decay again as it loads a row (the same
// rounded product the scalar loop stores), so a head's S is written once per token, not twice.
// Medium model, 2 threads, Zen 5 VM: the DeltaNet region of a decode step 221-227 us against
// 235-246 (three layers, alternated builds).
template <int N>
void recur_token(float* S, int Dk, int Dv, const float* q, const float* k, const float* v, float beta, float decay,
                 float* o) {
  FVec kv[N], delta[N], out[N];
  const FVec vdecay = FVec::splat(decay), vbeta = FVec::splat(beta);
  for (int n = 0; n < N; ++n) kv[n] = FVec::zero();
  for (int i = 0; i < Dk; ++i) {  // pass 1
    float* Si = S + size_t(i) * Dv;
    const FVec ki = FVec::splat(k[i]);
    for (int n = 0; n < N; ++n) kv[n] = fmadd(ki, FVec::load(Si + n * FVec::kWidth) * vdecay, kv[n]);
  }
  for (int n = 0; n < N; ++n) {
    delta[n] = (FVec::load(v + n * FVec::kWidth) - kv[n]) * vbeta;
    out[n] = FVec::zero();
  }
  for (int i = 0; i < Dk; ++i) {  // pass 2
    float* Si = S + size_t(i) * Dv;
    const FVec ki = FVec::splat(k[i]), qi = FVec::splat(q[i]);
    for (int n = 0; n < N; ++n) {
      const FVec sv = fmadd(ki, delta[n], FVec::load(Si + n * FVec::kWidth) * vdecay);
      sv.store(Si + n * FVec::kWidth);
      out[n] = fmadd(qi, sv, out[n]);
    }
  }
  for (int n = 0; n < N; ++n) out[n].store(o + n * FVec::kWidth);
}
#else
constexpr int kGdnCols = 32, kDecodeCols = kGdnCols;
#endif
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
    const LinearJob in[2] = {{&w.in_qkvz, h, s.qkvz.data()}, {&w.in_ba, h, s.ba.data()}};
    linear_group(in, 2, T, pool, s.matmul);
    ungroup_qkvz(c, s.qkvz.data(), s.ba.data(), T, s.qkv.data(), s.z.data(), s.b.data(), s.a.data());
  } else {
    const LinearJob in[4] = {
        {&w.in_qkv, h, s.qkv.data()}, {&w.in_z, h, s.z.data()}, {&w.in_b, h, s.b.data()}, {&w.in_a, h, s.a.data()}};
    linear_group(in, 4, T, pool, s.matmul);
  }

  // Everything between the input projections and out_proj runs in ONE parallel region, an item
  // per (sequence, key head): the causal conv + SiLU of the item's channels (its key head's q
  // and k, its r value heads' v), q and k l2-normalised, the gates of its value heads, then the
  // recurrence and the gated output norm of each of those heads. Items own disjoint channels,
  // conv-window columns, state heads and output rows, so nothing is shared; each value is
  // computed by the same operations in the same order as with one region per step, which is
  // what this replaced (three regions per layer in decode, 90 barriers per token at the 35B
  // shape, each a wake-up and a wait at 16 threads; four per chunk in prefill).
  s.conv_out.resize(size_t(T) * C);
  s.beta.resize(size_t(T) * Hv);
  s.decay.resize(size_t(T) * Hv);
  s.o.resize(size_t(T) * vdim);
  const float q_scale = 1.0f / std::sqrt(float(Dk));

  // Causal depthwise conv of channels [c0, c1) over [carried K-1 inputs ; the sequence's rows],
  // then SiLU. Row by row (token-major, as qkv is laid out), so every load is contiguous and
  // vectorises; the taps come transposed to [K, C] for the same reason. Per channel the sum runs
  // over taps in order from 0, exactly as a per-channel loop would.
  auto conv = [&](const GdnRows& sq, int c0, int c1) {
    const int n = c1 - c0, Ts = sq.n;
    GdnState& st = *sq.state;
    const float* qkv = s.qkv.data() + size_t(sq.first) * C;  // the sequence's rows [Ts, C]
    float* conv_out = s.conv_out.data() + size_t(sq.first) * C;
    for (int t = 0; t < Ts; ++t) {
      float* out = conv_out + size_t(t) * C + c0;
      std::fill(out, out + n, 0.0f);
      for (int j = 0; j < K; ++j) {
        const int src = t + j - (K - 1);  // < 0: from the carried state
        const float* xin = (src >= 0 ? qkv + size_t(src) * C : st.conv.data() + size_t(K - 1 + src) * C) + c0;
        const float* tap = taps + size_t(j) * C + c0;
        for (int i = 0; i < n; ++i) out[i] += tap[i] * xin[i];
      }
      map_elementwise(out, size_t(n), [](auto v) { return silu(v); }, out);
    }
    // Carry the last K-1 inputs (rows in increasing order: a row is read before it is
    // overwritten, as j + Ts > j).
    for (int j = 0; j < K - 1; ++j) {
      const int src = Ts - (K - 1) + j;
      const float* from = (src >= 0 ? qkv + size_t(src) * C : st.conv.data() + size_t(j + Ts) * C) + c0;
      std::copy(from, from + n, st.conv.data() + size_t(j) * C + c0);
    }
  };

  // The recurrence: sequential in t. Within a head S's value columns are independent (column j
  // of S only ever meets column j of v, of delta and of o), so a head's chunk is walked once
  // per slice of columns (kGdnCols, or kDecodeCols for a single token). Why slices: a head's S
  // (Dk x Dv f32, 64 KB at 128 x 128) does not fit L1, and each token reads and writes it twice;
  // a slice's Dk x 32 (16 KB) stays in L1 across the chunk's tokens. Per column the operations
  // and their order are those of a whole-head loop (axpy is element-wise, and slices are whole
  // vectors), so the result does not depend on the slicing.
  pool.parallel_for(int64_t(n_seqs) * Hk, [&](int64_t i0, int64_t i1, int) {
    thread_local std::vector<float> kv_mem;
    kv_mem.resize(kDecodeCols);
    // Columns [j0, j0 + nc) of head hv of sequence sq over the sequence's tokens.
    auto run_slice = [&](const GdnRows& sq, int hv, int j0, int nc) {
      const int hk = hv / r;
      float* S = sq.state->S.data() + size_t(hv) * Dk * Dv + j0;  // row i of the slice: S + i * Dv
      for (int t = sq.first; t < sq.first + sq.n; ++t) {
        const float* row = s.conv_out.data() + size_t(t) * C;
        const float* q = row + hk * Dk;
        const float* k = row + key_dim + hk * Dk;
        const float* v = row + 2 * key_dim + hv * Dv + j0;
        const float beta = s.beta[size_t(t) * Hv + hv], decay = s.decay[size_t(t) * Hv + hv];
        float* o = s.o.data() + size_t(t) * vdim + hv * Dv + j0;
#if defined(LILY_FVEC)
        if (nc == kGdnCols) {
          recur_token<kGdnCols / FVec::kWidth>(S, Dk, Dv, q, k, v, beta, decay, o);
          continue;
        }
        if (nc == kDecodeCols) {
          recur_token<kDecodeCols / FVec::kWidth>(S, Dk, Dv, q, k, v, beta, decay, o);
          continue;
        }
#endif
        // Pass 1: decay S and read kv_mem = S^T k.
        std::fill_n(kv_mem.data(), nc, 0.0f);
        for (int i = 0; i < Dk; ++i) {
          float* Si = S + size_t(i) * Dv;
          for (int j = 0; j < nc; ++j) Si[j] *= decay;
          axpy(k[i], Si, kv_mem.data(), nc);
        }
        // Pass 2: rank-1 update with delta, and read o = S^T q.
        for (int j = 0; j < nc; ++j) kv_mem[j] = (v[j] - kv_mem[j]) * beta;  // delta
        std::fill_n(o, nc, 0.0f);
        for (int i = 0; i < Dk; ++i) {
          float* Si = S + size_t(i) * Dv;
          axpy(k[i], kv_mem.data(), Si, nc);
          axpy(q[i], Si, o, nc);
        }
      }
    };
    for (int64_t item = i0; item < i1; ++item) {
      const GdnRows& sq = seqs[item / Hk];
      const int hk = int(item % Hk), hv0 = hk * r;
      conv(sq, hk * Dk, (hk + 1) * Dk);                                  // q
      conv(sq, key_dim + hk * Dk, key_dim + (hk + 1) * Dk);              // k
      conv(sq, 2 * key_dim + hv0 * Dv, 2 * key_dim + (hv0 + r) * Dv);    // v of the r value heads
      // Per token: q and k l2-normalised (in place: conv_out is not read again), q scaled; beta
      // and the decay per value head.
      for (int t = sq.first; t < sq.first + sq.n; ++t) {
        float* row = s.conv_out.data() + size_t(t) * C;
        float* q = row + hk * Dk;
        l2_normalize(q, Dk, 1e-6f);
        for (int i = 0; i < Dk; ++i) q[i] *= q_scale;
        l2_normalize(row + key_dim + hk * Dk, Dk, 1e-6f);
        for (int hv = hv0; hv < hv0 + r; ++hv) {
          s.beta[size_t(t) * Hv + hv] = sigmoid(s.b[size_t(t) * Hv + hv]);
          s.decay[size_t(t) * Hv + hv] = std::exp(w.a_neg[hv] * softplus(s.a[size_t(t) * Hv + hv] + w.dt_bias[hv]));
        }
      }
      for (int hv = hv0; hv < hv0 + r; ++hv) {
        const int cols = sq.n == 1 && Dv % kDecodeCols == 0 ? kDecodeCols : kGdnCols;
        for (int j0 = 0; j0 < Dv; j0 += cols) run_slice(sq, hv, j0, std::min(cols, Dv - j0));
        // The gated norm of each (token, head) row of o, which needs all of the head's columns.
        for (int t = sq.first; t < sq.first + sq.n; ++t) {
          const size_t at = size_t(t) * vdim + size_t(hv) * Dv;  // the (token, head) row of o and z
          gated_rms_norm(s.o.data() + at, s.z.data() + at, w.norm.data(), Dv, c.rms_eps, s.o.data() + at);
        }
      }
    }
  });

  linear(w.out_proj, s.o.data(), T, y, pool, s.matmul);
}

}  // namespace lily::cpu
