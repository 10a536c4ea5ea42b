// Attention family for the gated full-attention layers. Buffers: the argument struct at 0, then
// what a kernel reads, then what it writes (csrc/gpu/encoder.h).
//
//   attn_prepare  q/k zero-centred RMSNorm + partial rotate-half RoPE in place, k and v written
//                 into the cache at their positions.   grid (Hq + Hkv, T), 128 threads
//   attn_decode_<KV>_d<D>  causal softmax(q k^T * scale) v for one KV head and one split of
//                 the cache, GQA-packed: the query heads sharing a KV head are all in this
//                 threadgroup, each owned by one simdgroup (heads s, s + 4, ...), so the K/V
//                 rows of the split are read from memory once for all of them. Single pass
//                 (n_splits == 1) applies the sigmoid output gate and writes o; split-K
//                 (n_splits > 1) writes unnormalised partials and (max, sum).
//                                                      grid (Hkv, n_splits, T), 128 threads
//   attn_combine  merges the split partials and applies the gate.
//                                      grid (Hq, D / LILY_ATTN_COMBINE_COLUMNS, T), 32 threads
//   attn_prepare_blocks, attn_decode_blocks  the same over the fixed-block cache layout of long
//                 contexts (attention_args.h): splits are whole blocks, so split-K walks blocks.
//
// Both layouts share one body per kernel: a cache-addressing policy (ContiguousCache,
// BlockCache) maps (KV head, position) to the row's address. Blocks keep growth free of copies:
// a longer context allocates a new arena and extends the table, the cached rows stay put.
//
// Within attn_decode a simdgroup walks the split's positions in order with an online softmax
// per head it owns (running max, rescale, sum). A lane holds D/32 elements of each vector
// (strided by 32, so a simdgroup reads each row as one coalesced run); D is a template
// parameter (LILY_ATTN_HEAD_DIMS), so q, the accumulators and the K/V row stay in registers.
// Softmax in f32 with the running max subtracted, as the CPU backend computes it.
//
// KV is the cache's element type: half (the GPU backends' default) or float (the CPU backend's
// precision, the reference option)
// (half the bytes per token at long contexts; scores and sums stay f32).
#include <metal_stdlib>
#include "lily_msl.h"
#include "attention_args.h"
#include "kv_cache.h"
#include "reduce.h"
using namespace metal;

template <typename KV, typename Cache>
inline void attn_prepare_impl(device float* qg, device const float* k, device const float* v,
                              device const float* q_norm, device const float* k_norm,
                              device const float* inv_freq, Cache kc, Cache vc,
                              constant AttnPrepareArgs& args, threadgroup float* scratch,
                              threadgroup float* normed, uint2 tg, uint tid, uint threads,
                              uint simd_id, uint lane, uint n_simd) {
  const uint D = args.D, t = tg.y, head = tg.x;
  const bool is_q = head < args.Hq;
  const uint hk = head - args.Hq;
  device const float* src = is_q ? qg + (ulong(t) * args.Hq + head) * 2 * D
                                 : k + (ulong(t) * args.Hkv + hk) * D;
  device const float* gain = is_q ? q_norm : k_norm;

  float ss = 0.0f;
  for (uint i = tid; i < D; i += threads) ss += src[i] * src[i];
  const float r = 1.0f / sqrt(threadgroup_sum(ss, scratch, simd_id, lane, n_simd) / float(D) +
                              args.eps);
  for (uint i = tid; i < D; i += threads) normed[i] = (src[i] * r) * gain[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const uint pos = args.pos0 + t, half_rot = args.rot / 2;
  device float* q_dst = qg + (ulong(t) * args.Hq + head) * 2 * D;
  device KV* k_dst = is_q ? nullptr : kc.row(hk, pos);
  for (uint i = tid; i < D; i += threads) {
    float out = normed[i];
    if (i < args.rot) {
      const uint f = i < half_rot ? i : i - half_rot;
      const float angle = float(pos) * inv_freq[f];
      const float c = cos(angle), s = sin(angle);
      out = i < half_rot ? normed[i] * c - normed[i + half_rot] * s
                         : normed[i] * c + normed[i - half_rot] * s;
    }
    if (is_q) q_dst[i] = out;
    else k_dst[i] = KV(out);
  }
  if (!is_q) {
    device const float* vs = v + (ulong(t) * args.Hkv + hk) * D;
    device KV* vd = vc.row(hk, pos);
    for (uint i = tid; i < D; i += threads) vd[i] = KV(vs[i]);
  }
}

template <typename KV>
kernel void attn_prepare(constant AttnPrepareArgs& args [[buffer(0)]],
                         device const float* k [[buffer(1)]],         // [T, Hkv, D]
                         device const float* v [[buffer(2)]],         // [T, Hkv, D]
                         device const float* q_norm [[buffer(3)]],    // [D]
                         device const float* k_norm [[buffer(4)]],    // [D]
                         device const float* inv_freq [[buffer(5)]],  // [rot / 2]
                         device float* qg [[buffer(6)]],              // [T, Hq, 2D] (q in place)
                         device KV* k_cache [[buffer(7)]],            // [Hkv, cap, D]
                         device KV* v_cache [[buffer(8)]],            // [Hkv, cap, D]
                         uint2 tg [[threadgroup_position_in_grid]],
                         uint2 threads [[threads_per_threadgroup]],
                         uint tid [[thread_index_in_threadgroup]],
                         uint simd_id [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint n_simd [[simdgroups_per_threadgroup]]) {
  LILY_THREADGROUP(float, scratch, [32]);
  LILY_THREADGROUP(float, normed, [LILY_ATTN_MAX_HEAD_DIM]);
  const ContiguousCache<KV> kc{k_cache, args.cap, args.D}, vc{v_cache, args.cap, args.D};
  attn_prepare_impl<KV>(qg, k, v, q_norm, k_norm, inv_freq, kc, vc, args, scratch, normed, tg, tid, threads.x,
                        simd_id, lane, n_simd);
}

// Block layout: the block table among the reads, the LILY_ATTN_MAX_ARENAS K and V arenas among
// the writes (in place of k_cache, v_cache).
template <typename KV>
kernel void attn_prepare_blocks(constant AttnPrepareArgs& args [[buffer(0)]],
                                device const float* k [[buffer(1)]],
                                device const float* v [[buffer(2)]],
                                device const float* q_norm [[buffer(3)]],
                                device const float* k_norm [[buffer(4)]],
                                device const float* inv_freq [[buffer(5)]],
                                device const uint* table [[buffer(6)]],  // [n_blocks]
                                device float* qg [[buffer(7)]],
                                device KV* k0 [[buffer(8)]], device KV* k1 [[buffer(9)]],
                                device KV* k2 [[buffer(10)]], device KV* k3 [[buffer(11)]],
                                device KV* k4 [[buffer(12)]], device KV* k5 [[buffer(13)]],
                                device KV* v0 [[buffer(14)]], device KV* v1 [[buffer(15)]],
                                device KV* v2 [[buffer(16)]], device KV* v3 [[buffer(17)]],
                                device KV* v4 [[buffer(18)]], device KV* v5 [[buffer(19)]],
                                uint2 tg [[threadgroup_position_in_grid]],
                                uint2 threads [[threads_per_threadgroup]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint simd_id [[simdgroup_index_in_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]],
                                uint n_simd [[simdgroups_per_threadgroup]]) {
  LILY_THREADGROUP(float, scratch, [32]);
  LILY_THREADGROUP(float, normed, [LILY_ATTN_MAX_HEAD_DIM]);
  const BlockCache<KV> kc{{k0, k1, k2, k3, k4, k5}, table, args.cap, args.Hkv, args.D};
  const BlockCache<KV> vc{{v0, v1, v2, v3, v4, v5}, table, args.cap, args.Hkv, args.D};
  attn_prepare_impl<KV>(qg, k, v, q_norm, k_norm, inv_freq, kc, vc, args, scratch, normed, tg, tid, threads.x,
                        simd_id, lane, n_simd);
}

LILY_KERNEL_INSTANTIATE("attn_prepare_float", attn_prepare, float)
LILY_KERNEL_INSTANTIATE("attn_prepare_half", attn_prepare, half)
LILY_KERNEL_INSTANTIATE("attn_prepare_blocks_float", attn_prepare_blocks, float)
LILY_KERNEL_INSTANTIATE("attn_prepare_blocks_half", attn_prepare_blocks, half)

// One KV head (tg.x), one split of the cache (tg.y), one query token (tg.z). Simdgroup s owns
// the query heads s, s + 4, ... of the GQA group; each walks the split's positions in order.
template <typename KV, int D, typename Cache>
inline void attn_decode_impl(device const float* qg, Cache kc, Cache vc, device float* o,
                             device float* part_o, device float* part_ml, constant AttnArgs& args,
                             uint3 tg, uint simd_id, uint lane) {
  constexpr int PER_LANE = D / 32, ROWS = LILY_ATTN_ROWS_PER_SIMDGROUP, NSG = LILY_ATTN_SIMDGROUPS;
  const uint group = args.Hq / args.Hkv;
  const uint hk = tg.x, split = tg.y, t = tg.z;
  const uint rows = group > simd_id ? (group - simd_id + NSG - 1) / NSG : 0u;  // heads this simdgroup owns
  if (rows == 0) return;  // (uniform over the simdgroup; no threadgroup barrier below)
  const uint len = args.pos0 + t + 1;  // causal: positions [0, pos0 + t]
  const uint begin = split * args.split_len;
  const uint end = min(len, begin + args.split_len);

  float q[ROWS][PER_LANE], acc[ROWS][PER_LANE], m[ROWS], l[ROWS];
  LILY_UNROLL for (int r = 0; r < ROWS; ++r) {
    const uint g = min(simd_id + NSG * uint(r), group - 1);  // rows past `rows` are never used
    device const float* qh = qg + (ulong(t) * args.Hq + hk * group + g) * 2 * D;
    LILY_UNROLL for (int i = 0; i < PER_LANE; ++i) {
      q[r][i] = qh[lane + 32 * i];
      acc[r][i] = 0.0f;
    }
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }

  for (uint p = begin; p < end; ++p) {
    float kr[PER_LANE], vr[PER_LANE];
    device const KV* kp = kc.row(hk, p);
    device const KV* vp = vc.row(hk, p);
    LILY_UNROLL for (int i = 0; i < PER_LANE; ++i) {
      kr[i] = float(kp[lane + 32 * i]);
      vr[i] = float(vp[lane + 32 * i]);
    }
    LILY_UNROLL for (int r = 0; r < ROWS; ++r) {
      if (uint(r) < rows) {
        float d = 0.0f;
        LILY_UNROLL for (int i = 0; i < PER_LANE; ++i) d += q[r][i] * kr[i];
        const float s = simd_sum(d) * args.scale;
        const float mn = max(m[r], s);
        const float c = exp(m[r] - mn), e = exp(s - mn);
        l[r] = l[r] * c + e;
        LILY_UNROLL for (int i = 0; i < PER_LANE; ++i) acc[r][i] = acc[r][i] * c + e * vr[i];
        m[r] = mn;
      }
    }
  }

  LILY_UNROLL for (int r = 0; r < ROWS; ++r) {
    if (uint(r) < rows) {
      const uint hq = hk * group + simd_id + NSG * uint(r);
      const ulong head_row = ulong(t) * args.Hq + hq;
      device const float* gate = qg + head_row * 2 * D + D;
      LILY_UNROLL for (int i = 0; i < PER_LANE; ++i) {
        const uint d = lane + 32 * i;
        if (args.n_splits == 1) o[head_row * D + d] = acc[r][i] / l[r] * sigmoid_f(gate[d]);
        else part_o[(head_row * args.n_splits + split) * D + d] = acc[r][i];
      }
      if (args.n_splits > 1 && lane == 0) {
        part_ml[(head_row * args.n_splits + split) * 2 + 0] = m[r];
        part_ml[(head_row * args.n_splits + split) * 2 + 1] = l[r];
      }
    }
  }
}

template <typename KV, int D>
kernel void attn_decode(constant AttnArgs& args [[buffer(0)]],
                        device const float* qg [[buffer(1)]],       // [T, Hq, 2D]
                        device const KV* k_cache [[buffer(2)]],     // [Hkv, cap, D]
                        device const KV* v_cache [[buffer(3)]],     // [Hkv, cap, D]
                        device float* o [[buffer(4)]],              // [T, Hq, D]
                        device float* part_o [[buffer(5)]],         // [T, Hq, n_splits, D]
                        device float* part_ml [[buffer(6)]],        // [T, Hq, n_splits, 2]
                        uint3 tg [[threadgroup_position_in_grid]],
                        uint simd_id [[simdgroup_index_in_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]]) {
  const ContiguousCache<const KV> kc{k_cache, args.cap, D}, vc{v_cache, args.cap, D};
  attn_decode_impl<KV, D>(qg, kc, vc, o, part_o, part_ml, args, tg, simd_id, lane);
}

// Block layout (split_len is a multiple of the block length): the block table and the K and V
// arenas in place of k_cache, v_cache.
template <typename KV, int D>
kernel void attn_decode_blocks(constant AttnArgs& args [[buffer(0)]],
                               device const float* qg [[buffer(1)]],
                               device const uint* table [[buffer(2)]],  // [n_blocks]
                               device const KV* k0 [[buffer(3)]], device const KV* k1 [[buffer(4)]],
                               device const KV* k2 [[buffer(5)]], device const KV* k3 [[buffer(6)]],
                               device const KV* k4 [[buffer(7)]], device const KV* k5 [[buffer(8)]],
                               device const KV* v0 [[buffer(9)]], device const KV* v1 [[buffer(10)]],
                               device const KV* v2 [[buffer(11)]], device const KV* v3 [[buffer(12)]],
                               device const KV* v4 [[buffer(13)]], device const KV* v5 [[buffer(14)]],
                               device float* o [[buffer(15)]],
                               device float* part_o [[buffer(16)]],
                               device float* part_ml [[buffer(17)]],
                               uint3 tg [[threadgroup_position_in_grid]],
                               uint simd_id [[simdgroup_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
  const BlockCache<const KV> kc{{k0, k1, k2, k3, k4, k5}, table, args.cap, args.Hkv, D};
  const BlockCache<const KV> vc{{v0, v1, v2, v3, v4, v5}, table, args.cap, args.Hkv, D};
  attn_decode_impl<KV, D>(qg, kc, vc, o, part_o, part_ml, args, tg, simd_id, lane);
}

// attn_decode[_blocks]_<KV>_d<D>
#define LILY_ATTN_DECODE_INSTANTIATE(D)                                                  \
  LILY_KERNEL_INSTANTIATE("attn_decode_float_d" #D, attn_decode, float, D)               \
  LILY_KERNEL_INSTANTIATE("attn_decode_half_d" #D, attn_decode, half, D)                 \
  LILY_KERNEL_INSTANTIATE("attn_decode_blocks_float_d" #D, attn_decode_blocks, float, D) \
  LILY_KERNEL_INSTANTIATE("attn_decode_blocks_half_d" #D, attn_decode_blocks, half, D)
LILY_ATTN_HEAD_DIMS(LILY_ATTN_DECODE_INSTANTIATE)

// One query head (tg.x), one slice of LILY_ATTN_COMBINE_COLUMNS value columns (tg.y), one
// token (tg.z): the slices spread a head's combine over D / 32 threadgroups, since the partials
// it reads grow with the splits (2 MB per layer at 128 splits of the 35B shape). Every thread
// recomputes the splits' global max and total (2 floats per split, the same for all) and merges
// its column over the splits in split order, so a row's result depends only on its own splits.
kernel void attn_combine(constant AttnArgs& args [[buffer(0)]],
                         device const float* qg [[buffer(1)]],       // [T, Hq, 2D] (gate)
                         device const float* part_o [[buffer(2)]],   // [T, Hq, n_splits, D]
                         device const float* part_ml [[buffer(3)]],  // [T, Hq, n_splits, 2]
                         device float* o [[buffer(4)]],              // [T, Hq, D]
                         uint3 tg [[threadgroup_position_in_grid]],
                         uint3 tid [[thread_position_in_threadgroup]]) {
  const uint D = args.D, hq = tg.x, t = tg.z, n = args.n_splits;
  const uint d = tg.y * LILY_ATTN_COMBINE_COLUMNS + tid.x;
  if (d >= D) return;
  const ulong head_row = ulong(t) * args.Hq + hq;
  device const float* ml = part_ml + head_row * n * 2;
  float mx = -INFINITY;
  for (uint s = 0; s < n; ++s) mx = max(mx, ml[2 * s]);
  float total = 0.0f, num = 0.0f;
  for (uint s = 0; s < n; ++s) {
    if (ml[2 * s] == -INFINITY) continue;  // a split past the causal end: no positions
    const float w = exp(ml[2 * s] - mx);
    total += ml[2 * s + 1] * w;
    num += part_o[(head_row * n + s) * D + d] * w;
  }
  device const float* gate = qg + head_row * 2 * D + D;
  o[head_row * D + d] = num / total * sigmoid_f(gate[d]);
}
