// Gated DeltaNet family (the linear-attention layers), decode-first.
//
//   gdn_ungroup     Qwen3-Next only: scatter the per-key-head grouped [q k v z] / [b a]
//                   projections into the plain layouts.      grid (ceil(n / 256), T), 256 threads
//   gdn_conv        causal depthwise conv1d over [carried K-1 inputs ; chunk] + SiLU, one
//                   thread per channel walking a sequence's tokens; the new window is written to
//                   window_out.                            grid (ceil(C / 256), S), 256 threads
//   gdn_recurrence_dk<Dk>  one threadgroup per (value head, slice of LILY_GDN_COLUMNS value
//                   columns), one thread per column j: the column S[:, j] (Dk floats, Dk a
//                   template parameter: LILY_GDN_KEY_DIMS) stays in registers for the whole
//                   sequence's tokens. Per token: l2-norm q and k, beta = sigmoid(b),
//                   decay = exp(-exp(A_log) * softplus(a + dt_bias)),
//                   S <- S * decay; delta = (v - S^T k) * beta; S <- S + k delta^T; o = S^T q.
//                                       grid (Hv, ceil(Dv / LILY_GDN_COLUMNS), S), LILY_GDN_COLUMNS threads
//   gdn_gated_norm  the gated RMSNorm  (w * (o * r)) * silu(z)  of each head's o, in place.
//                                          grid (Hv, T), 32 * ceil(Dv / 32) threads
// f32 throughout, in the CPU backend's order of operations.
// gdn_conv and gdn_recurrence take a table of sequences (GdnSeq: rows, state addresses), so one
// dispatch serves all the decode-route sequences of a pass (S of them), each against its own
// state; a sequence's result depends only on its own entry. State in and out are separate
// addresses (they may be the same buffer): the host ping-pongs two copies, so the state before
// a pass survives it and a pass made past the end of a generation can be discarded (depth-2
// pipelining) without a copy.
#include <metal_stdlib>
#include "lily_msl.h"
#include "gdn_args.h"
#include "reduce.h"
using namespace metal;

kernel void gdn_ungroup(constant GdnArgs& args [[buffer(0)]],
                        device const float* qkvz [[buffer(1)]],  // [T, C + Hv*Dv]
                        device const float* ba [[buffer(2)]],    // [T, 2*Hv]
                        device float* qkv [[buffer(3)]],         // [T, C]
                        device float* z [[buffer(4)]],           // [T, Hv*Dv]
                        device float* b [[buffer(5)]],           // [T, Hv]
                        device float* a [[buffer(6)]],           // [T, Hv]
                        uint2 gid [[thread_position_in_grid]]) {
  const uint Dk = args.Dk, Dv = args.Dv, r = args.Hv / args.Hk;
  const uint key_dim = args.Hk * Dk, vdim = args.Hv * Dv, C = args.C;
  const uint block = 2 * Dk + 2 * r * Dv;  // one key head's [q | k | v | z] rows
  const uint j = gid.x, t = gid.y;
  device const float* src = qkvz + ulong(t) * (C + vdim);
  if (j < key_dim) {
    qkv[ulong(t) * C + j] = src[(j / Dk) * block + j % Dk];
  } else if (j < 2 * key_dim) {
    const uint i = j - key_dim;
    qkv[ulong(t) * C + j] = src[(i / Dk) * block + Dk + i % Dk];
  } else if (j < C) {
    const uint i = j - 2 * key_dim;
    qkv[ulong(t) * C + j] = src[(i / (r * Dv)) * block + 2 * Dk + i % (r * Dv)];
  } else if (j < C + vdim) {
    const uint i = j - C;
    z[ulong(t) * vdim + i] = src[(i / (r * Dv)) * block + 2 * Dk + r * Dv + i % (r * Dv)];
  } else if (j < C + vdim + 2 * args.Hv) {
    const uint i = j - C - vdim;
    const uint head = i % args.Hv, g = head / r;
    const float value = ba[ulong(t) * 2 * args.Hv + g * 2 * r + (i < args.Hv ? 0 : r) + head % r];
    if (i < args.Hv) b[ulong(t) * args.Hv + head] = value;
    else a[ulong(t) * args.Hv + head] = value;
  }
}

// One channel (x) of one sequence (y).
kernel void gdn_conv(constant GdnArgs& args [[buffer(0)]],
                     constant GdnSeq* seqs [[buffer(1)]],         // [sequences]
                     device const float* qkv [[buffer(2)]],       // [T, C]
                     device const float* taps [[buffer(3)]],      // [C, K]
                     device float* out [[buffer(4)]],             // [T, C]
                     uint2 gid [[thread_position_in_grid]]) {
  const uint C = args.C, K = args.K, ch = gid.x;
  constant GdnSeq& seq = seqs[gid.y];
  if (ch >= C) return;
  const uint T = seq.n;
  device const float* x_in = qkv + ulong(seq.first) * C;
  device const float* window = seq.window;  // [K-1, C] carried inputs
  device float* y = out + ulong(seq.first) * C;
  device const float* tap = taps + ulong(ch) * K;
  for (uint t = 0; t < T; ++t) {
    float acc = 0.0f;
    for (uint j = 0; j < K; ++j) {
      const int src = int(t + j) - int(K - 1);  // < 0: from the carried window
      const float x = src >= 0 ? x_in[ulong(src) * C + ch] : window[ulong(int(K - 1) + src) * C + ch];
      acc += tap[j] * x;
    }
    y[ulong(t) * C + ch] = silu_f(acc);
  }
  // Carry the last K-1 inputs. window_out may be window itself: slot j takes old slot j + T,
  // which is later in the loop order, so no old value is overwritten before it is read.
  device float* window_out = seq.window_out;
  for (uint j = 0; j + 1 < K; ++j) {
    const int src = int(T) - int(K - 1) + int(j);
    window_out[ulong(j) * C + ch] = src >= 0 ? x_in[ulong(src) * C + ch] : window[ulong(j + T) * C + ch];
  }
}

// One value head (tg.x), one slice of LILY_GDN_COLUMNS value columns (tg.y): the columns of a
// head's state are independent, so a slice needs only q, k, v's slice and the gates, and the
// 35B shape's 32 heads x 4 slices make 128 threadgroups to stream the 2 MB of state per layer
// (one threadgroup per head made 32). Each slice normalises q and k itself (Dk floats, read
// from L2 by the head's slices alike). o is written unnormalised: the gated RMSNorm needs the
// whole head's columns and runs in gdn_gated_norm.
template <int Dk>
kernel void gdn_recurrence(constant GdnArgs& args [[buffer(0)]],
                           constant GdnSeq* seqs [[buffer(1)]],         // [sequences]
                           device const float* conv_out [[buffer(2)]],  // [T, C]
                           device const float* b [[buffer(3)]],         // [T, Hv]
                           device const float* a [[buffer(4)]],         // [T, Hv]
                           device const float* a_neg [[buffer(5)]],     // [Hv] -exp(A_log)
                           device const float* dt_bias [[buffer(6)]],   // [Hv]
                           device float* o [[buffer(7)]],               // [T, Hv*Dv] S^T q
                           uint3 tg [[threadgroup_position_in_grid]],
                           uint3 tid [[thread_position_in_threadgroup]],
                           uint3 threads [[threads_per_threadgroup]],
                           uint simd_id [[simdgroup_index_in_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint n_simd [[simdgroups_per_threadgroup]]) {
  LILY_THREADGROUP(float, scratch, [32]);
  LILY_THREADGROUP(float, qs, [Dk]);
  LILY_THREADGROUP(float, ks, [Dk]);
  constant GdnSeq& seq = seqs[tg.z];
  const uint Dv = args.Dv, Hv = args.Hv, C = args.C, hv = tg.x, n = threads.x;
  const uint j = tg.y * n + tid.x;  // this thread's value column
  const uint hk = hv / (Hv / args.Hk), key_dim = args.Hk * Dk, vdim = Hv * Dv;
  const bool owner = j < Dv;
  device const float* S = seq.S;  // [Hv, Dk, Dv] in; S_out (below) may be the same buffer

  float col[Dk];  // S[:, j] of this head
  device const float* Sh = S + ulong(hv) * Dk * Dv;
  LILY_UNROLL for (int i = 0; i < Dk; ++i) col[i] = owner ? Sh[ulong(i) * Dv + j] : 0.0f;

  for (uint r = 0; r < seq.n; ++r) {
    const uint t = seq.first + r;  // the row in the pass
    device const float* row = conv_out + ulong(t) * C;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // last token's qs / ks fully read
    float sq = 0.0f, sk = 0.0f;
    for (uint i = tid.x; i < uint(Dk); i += n) {
      const float qv = row[hk * Dk + i], kv = row[key_dim + hk * Dk + i];
      qs[i] = qv;
      ks[i] = kv;
      sq += qv * qv;
      sk += kv * kv;
    }
    // (the same sums in every slice of the head: same threads, same order)
    const float rq = 1.0f / sqrt(threadgroup_sum(sq, scratch, simd_id, lane, n_simd) + 1e-6f);
    const float rk = 1.0f / sqrt(threadgroup_sum(sk, scratch, simd_id, lane, n_simd) + 1e-6f);

    const float beta = sigmoid_f(b[ulong(t) * Hv + hv]);
    const float x = a[ulong(t) * Hv + hv] + dt_bias[hv];
    const float softplus = x > 20.0f ? x : log(1.0f + exp(x));
    const float decay = exp(a_neg[hv] * softplus);

    float kv_mem = 0.0f;
    LILY_UNROLL for (int i = 0; i < Dk; ++i) {
      col[i] *= decay;
      kv_mem += (ks[i] * rk) * col[i];
    }
    const float v = owner ? row[2 * key_dim + hv * Dv + j] : 0.0f;
    const float delta = (v - kv_mem) * beta;
    // Orders threadgroup memory, so the loop below loads ks[i] again: without it a compiler
    // forwards the loads of the loop above and keeps Dk more values live beside the Dk-float
    // column (at Dk = 128, 255 registers and spills on sm_90: docs/msl-on-cuda.md).
    simdgroup_barrier(mem_flags::mem_threadgroup);
    float out = 0.0f;
    LILY_UNROLL for (int i = 0; i < Dk; ++i) {
      col[i] += (ks[i] * rk) * delta;
      out += ((qs[i] * rq) * args.q_scale) * col[i];
    }
    if (owner) o[ulong(t) * vdim + hv * Dv + j] = out;
  }
  device float* So = seq.S_out + ulong(hv) * Dk * Dv;  // may be S itself: each thread owns its column
  if (owner) LILY_UNROLL for (int i = 0; i < Dk; ++i) So[ulong(i) * Dv + j] = col[i];
}

#define LILY_GDN_RECURRENCE_INSTANTIATE(Dk) LILY_KERNEL_INSTANTIATE("gdn_recurrence_dk" #Dk, gdn_recurrence, Dk)
LILY_GDN_KEY_DIMS(LILY_GDN_RECURRENCE_INSTANTIATE)

// The gated RMSNorm of the recurrence's output, one threadgroup per (value head, token), in
// place:  o <- (w * (o * r)) * silu(z),  r = 1 / sqrt(mean(o^2) + eps) over the head's Dv.
kernel void gdn_gated_norm(constant GdnArgs& args [[buffer(0)]],
                           device const float* z [[buffer(1)]],       // [T, Hv*Dv]
                           device const float* norm_w [[buffer(2)]],  // [Dv]
                           device float* o [[buffer(3)]],             // [T, Hv*Dv]
                           uint2 tg [[threadgroup_position_in_grid]],
                           uint2 tid [[thread_position_in_threadgroup]],
                           uint2 threads [[threads_per_threadgroup]],
                           uint simd_id [[simdgroup_index_in_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint n_simd [[simdgroups_per_threadgroup]]) {
  LILY_THREADGROUP(float, scratch, [32]);
  const uint Dv = args.Dv, hv = tg.x, t = tg.y;
  const ulong base = ulong(t) * args.Hv * Dv + ulong(hv) * Dv;
  float ss = 0.0f;
  for (uint j = tid.x; j < Dv; j += threads.x) ss += o[base + j] * o[base + j];
  const float r = 1.0f / sqrt(threadgroup_sum(ss, scratch, simd_id, lane, n_simd) / float(Dv) + args.eps);
  for (uint j = tid.x; j < Dv; j += threads.x)  // each element read back only by its writer
    o[base + j] = (norm_w[j] * (o[base + j] * r)) * silu_f(z[base + j]);
}
