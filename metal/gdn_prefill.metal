// Gated DeltaNet prefill: a chunk of T tokens through one linear-attention layer in two
// dispatches, with everything that does not depend on the recurrence taken out of the scan.
//
//   gdn_prepare  one threadgroup per (head slot, token), slots = Hk query heads, Hk key heads,
//                Hv value heads. Causal depthwise conv1d over [carried K-1 inputs ; chunk]
//                + SiLU for the slot's channels (each output depends only on inputs, so all T
//                tokens run in parallel, unlike the decode kernel's walk over the chunk);
//                query / key slots are then L2-normalised (the query also scaled by
//                1/sqrt(Dk)); value slots also compute the token's gates
//                beta = sigmoid(b), decay = exp(-exp(A_log) * softplus(a + dt_bias)).
//                The threadgroups of the last token write the new conv window.
//                                          grid (2*Hk + Hv, T), LILY_GDN_PREP_THREADS threads
//   gdn_scan_dk<Dk>  the gated delta rule scanned over the chunk, one threadgroup per value head:
//                S[:, j] (one state column) is split over a quad of 4 threads, each holding
//                Dk/4 floats in registers for the whole chunk, so dot products over Dk are a
//                register loop plus one quad_sum, and 4*Dv threads (512 at Dv = 128) keep the
//                GPU busier than one thread per column. Per token:
//                  S <- S * decay;  delta = (v - S^T k) * beta;  S <- S + k delta^T;  o = S^T q
//                then the gated RMSNorm (w * (o * rms(o))) * silu(z) fused (a threadgroup
//                sum over the head's Dv columns). S is read once and written once per chunk.
//                                          grid (Hv), 4 * Dv threads (rounded up to 32)
//
// f32 throughout; sums are split over a quad, so the order of additions differs from the CPU
// backend's within f32 rounding. State and window in and out are separate buffers that must
// not alias (the host ping-pongs two copies, see GpuState::parity): gdn_prepare reads the old
// window while the last token's threadgroups write the new one.
#include <metal_stdlib>
#include "lily_msl.h"
#include "gdn_prefill_args.h"
#include "reduce.h"
using namespace metal;

kernel void gdn_prepare(constant GdnArgs& args [[buffer(0)]],
                        device const float* qkv [[buffer(1)]],       // [T, C]
                        device const float* taps [[buffer(2)]],      // [C, K]
                        device const float* window [[buffer(3)]],    // [K-1, C] carried inputs
                        device const float* b [[buffer(4)]],         // [T, Hv]
                        device const float* a [[buffer(5)]],         // [T, Hv]
                        device const float* a_neg [[buffer(6)]],     // [Hv] -exp(A_log)
                        device const float* dt_bias [[buffer(7)]],   // [Hv]
                        device float* x [[buffer(8)]],               // [T, C]
                        device float* gates [[buffer(9)]],           // [T, Hv, 2]
                        device float* window_out [[buffer(10)]],     // [K-1, C]
                        uint2 tg [[threadgroup_position_in_grid]],
                        uint2 threads_per_group [[threads_per_threadgroup]],
                        uint tid [[thread_index_in_threadgroup]],
                        uint simd_id [[simdgroup_index_in_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]],
                        uint n_simd [[simdgroups_per_threadgroup]]) {
  LILY_THREADGROUP(float, scratch, [32]);
  const uint threads = threads_per_group.x;
  const uint C = args.C, K = args.K, T = args.T, t = tg.y, slot = tg.x;
  const uint key_slots = 2 * args.Hk;
  const bool is_key = slot < key_slots;  // a query or key head: normalised
  const uint base = is_key ? slot * args.Dk : key_slots * args.Dk + (slot - key_slots) * args.Dv;
  const uint width = is_key ? args.Dk : args.Dv;

  // Conv + SiLU of this slot's channels at token t; kept in x (unnormalised) meanwhile.
  float ss = 0.0f;
  for (uint i = tid; i < width; i += threads) {
    const uint ch = base + i;
    device const float* tap = taps + ulong(ch) * K;
    float acc = 0.0f;
    for (uint j = 0; j < K; ++j) {
      const int src = int(t + j) - int(K - 1);  // < 0: from the carried window
      const float in = src >= 0 ? qkv[ulong(src) * C + ch] : window[ulong(int(K - 1) + src) * C + ch];
      acc += tap[j] * in;
    }
    const float y = silu_f(acc);
    x[ulong(t) * C + ch] = y;
    ss += y * y;
  }
  if (is_key) {  // uniform per threadgroup: every thread reaches the reduction
    const float r = 1.0f / sqrt(threadgroup_sum(ss, scratch, simd_id, lane, n_simd) + 1e-6f);
    const float s = slot < args.Hk ? r * args.q_scale : r;
    // Each thread rescales the elements it wrote itself: no barrier needed.
    for (uint i = tid; i < width; i += threads) x[ulong(t) * C + base + i] *= s;
  } else if (tid == 0) {
    const uint hv = slot - key_slots;
    const float beta = sigmoid_f(b[ulong(t) * args.Hv + hv]);
    const float xa = a[ulong(t) * args.Hv + hv] + dt_bias[hv];
    const float softplus = xa > 20.0f ? xa : log(1.0f + exp(xa));
    gates[(ulong(t) * args.Hv + hv) * 2 + 0] = beta;
    gates[(ulong(t) * args.Hv + hv) * 2 + 1] = exp(a_neg[hv] * softplus);
  }

  // The new window: the last K-1 raw inputs of [window ; chunk].
  if (t + 1 == T) {
    for (uint j = 0; j + 1 < K; ++j) {
      const int src = int(T) - int(K - 1) + int(j);
      for (uint i = tid; i < width; i += threads) {
        const uint ch = base + i;
        window_out[ulong(j) * C + ch] = src >= 0 ? qkv[ulong(src) * C + ch] : window[ulong(j + T) * C + ch];
      }
    }
  }
}

// 4 * Dv threads: 512 at the family's Dv = 128 (the host checks SPLIT * Dv <= LILY_GDN_SCAN_MAX_THREADS).
template <int Dk>
[[max_total_threads_per_threadgroup(LILY_GDN_SCAN_MAX_THREADS)]]
kernel void gdn_scan(constant GdnArgs& args [[buffer(0)]],
                     device const float* x [[buffer(1)]],         // [T, C] from gdn_prepare
                     device const float* gates [[buffer(2)]],     // [T, Hv, 2]
                     device const float* z [[buffer(3)]],         // [T, Hv*Dv]
                     device const float* norm_w [[buffer(4)]],    // [Dv]
                     device const float* S [[buffer(5)]],         // [Hv, Dk, Dv] in
                     device float* o [[buffer(6)]],               // [T, Hv*Dv]
                     device float* S_out [[buffer(7)]],           // [Hv, Dk, Dv] out
                     uint hv [[threadgroup_position_in_grid]],
                     uint tid [[thread_index_in_threadgroup]],
                     uint simd_id [[simdgroup_index_in_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]],
                     uint n_simd [[simdgroups_per_threadgroup]]) {
  constexpr uint split = LILY_GDN_SCAN_SPLIT;
  LILY_THREADGROUP(float, scratch, [32]);
  LILY_THREADGROUP(float, k_step, [Dk]);  // this step's k, for the state update
  constexpr int rows = Dk / split;  // LILY_GDN_KEY_DIMS are multiples of the split
  const uint Dv = args.Dv, Hv = args.Hv, C = args.C;
  const uint hk = hv / (Hv / args.Hk), key_dim = args.Hk * Dk, vdim = Hv * Dv;
  const uint j = tid / split, s = tid % split;  // column j, rows i = s + split * r
  const bool owner = j < Dv;                    // threads are 4 * Dv rounded up to 32

  float col[rows];
  device const float* Sh = S + ulong(hv) * Dk * Dv;
  LILY_UNROLL for (int r = 0; r < rows; ++r) col[r] = owner ? Sh[ulong(s + split * r) * Dv + j] : 0.0f;

  for (uint t = 0; t < args.T; ++t) {
    device const float* q = x + ulong(t) * C + hk * Dk;
    device const float* k = q + key_dim;
    // The update reads k from threadgroup memory, the decay pass from device memory, so the
    // compiler cannot keep the Dk / split k values in registers from one pass to the next
    // beside the column: at 512 threads a thread may hold 128 registers (sm_90 spilled 192
    // bytes with k kept, 68-76 without). k_step's readers of the previous step all passed
    // the barrier inside that step's threadgroup_sum before this write.
    for (uint i = tid; i < uint(Dk); i += n_simd * 32) k_step[i] = k[i];  // threads: whole SIMD groups
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float beta = gates[(ulong(t) * Hv + hv) * 2 + 0];
    const float decay = gates[(ulong(t) * Hv + hv) * 2 + 1];
    float kv_mem = 0.0f;
    LILY_UNROLL for (int r = 0; r < rows; ++r) {
      col[r] *= decay;
      kv_mem += k[s + split * r] * col[r];
    }
    kv_mem = quad_sum(kv_mem);
    const float v = owner ? x[ulong(t) * C + 2 * key_dim + hv * Dv + j] : 0.0f;
    const float delta = (v - kv_mem) * beta;
    float out = 0.0f;
    LILY_UNROLL for (int r = 0; r < rows; ++r) {
      col[r] += k_step[s + split * r] * delta;
      out += q[s + split * r] * col[r];
    }
    out = quad_sum(out);  // 0 for non-owners: their column stays 0

    // Gated RMSNorm over the head's Dv outputs (each counted once: lane s == 0 of the quad).
    const float sq = s == 0 ? out * out : 0.0f;
    const float rr = 1.0f / sqrt(threadgroup_sum(sq, scratch, simd_id, lane, n_simd) / float(Dv) + args.eps);
    if (owner && s == 0) {
      const float zj = z[ulong(t) * vdim + hv * Dv + j];
      o[ulong(t) * vdim + hv * Dv + j] = (norm_w[j] * (out * rr)) * silu_f(zj);
    }
  }
  device float* So = S_out + ulong(hv) * Dk * Dv;
  if (owner) LILY_UNROLL for (int r = 0; r < rows; ++r) So[ulong(s + split * r) * Dv + j] = col[r];
}

#define LILY_GDN_SCAN_INSTANTIATE(Dk) LILY_KERNEL_INSTANTIATE("gdn_scan_dk" #Dk, gdn_scan, Dk)
LILY_GDN_KEY_DIMS(LILY_GDN_SCAN_INSTANTIATE)
