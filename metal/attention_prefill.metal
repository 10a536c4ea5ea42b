// Attention prefill: flash-style causal attention of a chunk of T query tokens over the cache
// (earlier chunks and this one; attn_prepare of metal/attention.metal has already written the
// chunk's normalised, rotated k and v into it).
//
//   attn_prefill_<KV>_d<D>  one threadgroup per (KV head, tile of query tokens). Its query rows are the
//                 tile's tokens x the Hq/Hkv query heads that share the KV head (GQA), up to
//                 LILY_ATTN_PF_ROWS rows, so every K/V row fetched from the cache serves all of
//                 them: the cache is read ceil(T / tile_tokens) times per KV head instead of T
//                 times (the decode kernel's grid). K and V tiles of LILY_ATTN_PF_KV_TILE
//                 positions are staged in threadgroup memory by all threads, then each
//                 simdgroup scores its rows against the tile (a lane holds D/32 elements,
//                 strided by 32, one simd_sum per score) and updates each row's online softmax
//                 position by position: running max, rescale of the accumulator, sum. Positions past a
//                 row's causal end are skipped; the tile loop stops at the tile's last token.
//                 The sigmoid output gate is applied on the way out.
//                        grid (Hkv, ceil(T / tile_tokens)), 32 * LILY_ATTN_PF_SIMDGROUPS threads
//
// Scores, maxima, sums and accumulators are f32; KV is the cache's element type (float or half).
// Registers per lane: rows_per_simdgroup (8) x D/32 accumulator floats, plus one row's query;
// D is a template parameter (LILY_ATTN_HEAD_DIMS), so they are registers, not stack memory.
#include <metal_stdlib>
#include "lily_msl.h"
#include "attention_prefill_args.h"
#include "kv_cache.h"
#include "reduce.h"
using namespace metal;

template <typename KV, int D, typename Cache>
inline void attn_prefill_impl(device const float* qg, Cache kc, Cache vc, device float* o,
                              constant AttnPrefillArgs& args, threadgroup float* ktile,
                              threadgroup float* vtile, uint2 tg, uint tid, uint threads, uint simd_id,
                              uint lane) {
  constexpr int NSG = LILY_ATTN_PF_SIMDGROUPS, KT = LILY_ATTN_PF_KV_TILE, PER_LANE = D / 32;
  constexpr int ROWS = (LILY_ATTN_PF_ROWS + NSG - 1) / NSG;  // rows per simdgroup
  const uint group = args.Hq / args.Hkv;
  const uint hk = tg.x, t0 = tg.y * args.tile_tokens;
  const uint t_end = min(args.T, t0 + args.tile_tokens);  // tokens [t0, t_end)
  const uint n_rows = (t_end - t0) * group;

  // Row r of the tile = (token t0 + r / group, query head hk * group + r % group); this
  // simdgroup owns rows simd_id, simd_id + NSG, ...
  // Only the accumulators live in registers; a row's query is re-read (from cache) once per
  // K/V tile, which is what lets a threadgroup hold 64 rows.
  float acc[ROWS][PER_LANE];
  float m[ROWS], l[ROWS];
  uint len[ROWS];  // causal length of the row: positions [0, len)
  LILY_UNROLL for (int i = 0; i < ROWS; ++i) {
    const uint r = simd_id + NSG * uint(i);
    len[i] = r < n_rows ? args.pos0 + t0 + r / group + 1 : 0;
    LILY_UNROLL for (int e = 0; e < PER_LANE; ++e) acc[i][e] = 0.0f;
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }

  const uint end = args.pos0 + t_end;  // the tile's last token sees positions [0, end)
  for (uint p0 = 0; p0 < end; p0 += KT) {
    const uint n = min(uint(KT), end - p0);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous tile is fully read
    for (uint e = tid; e < n * D; e += threads) {
      ktile[e] = float(kc.row(hk, p0 + e / D)[e % D]);
      vtile[e] = float(vc.row(hk, p0 + e / D)[e % D]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    LILY_UNROLL for (int i = 0; i < ROWS; ++i) {
      if (len[i] > p0) {  // uniform across the simdgroup (a row is one simdgroup's)
        const uint r = simd_id + NSG * uint(i);
        device const float* qh = qg + (ulong(t0 + r / group) * args.Hq + hk * group + r % group) * 2 * D;
        float q[PER_LANE];
        LILY_UNROLL for (int e = 0; e < PER_LANE; ++e) q[e] = qh[lane + 32 * e];
        const uint valid = min(n, len[i] - p0);
        // Online softmax over the tile's positions in order: running max, rescale, sum.
        for (uint c = 0; c < valid; ++c) {
          float d = 0.0f;
          LILY_UNROLL for (int e = 0; e < PER_LANE; ++e) d += q[e] * ktile[c * D + lane + 32 * e];
          const float s = simd_sum(d) * args.scale;
          const float mn = max(m[i], s);
          const float corr = exp(m[i] - mn), w = exp(s - mn);  // corr = 0 at the first (m = -inf)
          l[i] = l[i] * corr + w;
          LILY_UNROLL for (int e = 0; e < PER_LANE; ++e) acc[i][e] = acc[i][e] * corr + w * vtile[c * D + lane + 32 * e];
          m[i] = mn;
        }
      }
    }
  }

  LILY_UNROLL for (int i = 0; i < ROWS; ++i) {
    const uint r = simd_id + NSG * uint(i);
    if (r < n_rows) {
      const uint t = t0 + r / group, hq = hk * group + r % group;
      const ulong head_row = ulong(t) * args.Hq + hq;
      device const float* gate = qg + head_row * 2 * D + D;
      LILY_UNROLL for (int e = 0; e < PER_LANE; ++e) {
        const uint d = lane + 32 * e;
        o[head_row * D + d] = acc[i][e] / l[i] * sigmoid_f(gate[d]);
      }
    }
  }
}

template <typename KV, int D>
kernel void attn_prefill(constant AttnPrefillArgs& args [[buffer(0)]],
                         device const float* qg [[buffer(1)]],     // [T, Hq, 2D]
                         device const KV* k_cache [[buffer(2)]],   // [Hkv, cap, D]
                         device const KV* v_cache [[buffer(3)]],   // [Hkv, cap, D]
                         device float* o [[buffer(4)]],            // [T, Hq, D]
                         uint2 tg [[threadgroup_position_in_grid]],
                         uint2 threads [[threads_per_threadgroup]],
                         uint tid [[thread_index_in_threadgroup]],
                         uint simd_id [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  LILY_THREADGROUP(float, ktile, [LILY_ATTN_PF_KV_TILE * D]);
  LILY_THREADGROUP(float, vtile, [LILY_ATTN_PF_KV_TILE * D]);
  const ContiguousCache<const KV> kc{k_cache, args.cap, D}, vc{v_cache, args.cap, D};
  attn_prefill_impl<KV, D>(qg, kc, vc, o, args, ktile, vtile, tg, tid, threads.x, simd_id, lane);
}

// The fixed-block layout (kv_cache.h; args.cap = block length): the block table and the K and V
// arenas in place of k_cache, v_cache.
template <typename KV, int D>
kernel void attn_prefill_blocks(constant AttnPrefillArgs& args [[buffer(0)]],
                                device const float* qg [[buffer(1)]],
                                device const uint* table [[buffer(2)]],
                                device const KV* k0 [[buffer(3)]], device const KV* k1 [[buffer(4)]],
                                device const KV* k2 [[buffer(5)]], device const KV* k3 [[buffer(6)]],
                                device const KV* k4 [[buffer(7)]], device const KV* k5 [[buffer(8)]],
                                device const KV* v0 [[buffer(9)]], device const KV* v1 [[buffer(10)]],
                                device const KV* v2 [[buffer(11)]], device const KV* v3 [[buffer(12)]],
                                device const KV* v4 [[buffer(13)]], device const KV* v5 [[buffer(14)]],
                                device float* o [[buffer(15)]],
                                uint2 tg [[threadgroup_position_in_grid]],
                                uint2 threads [[threads_per_threadgroup]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint simd_id [[simdgroup_index_in_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]]) {
  LILY_THREADGROUP(float, ktile, [LILY_ATTN_PF_KV_TILE * D]);
  LILY_THREADGROUP(float, vtile, [LILY_ATTN_PF_KV_TILE * D]);
  const BlockCache<const KV> kc{{k0, k1, k2, k3, k4, k5}, table, args.cap, args.Hkv, D};
  const BlockCache<const KV> vc{{v0, v1, v2, v3, v4, v5}, table, args.cap, args.Hkv, D};
  attn_prefill_impl<KV, D>(qg, kc, vc, o, args, ktile, vtile, tg, tid, threads.x, simd_id, lane);
}

// attn_prefill[_blocks]_<KV>_d<D>
#define LILY_ATTN_PREFILL_INSTANTIATE(D)                                                   \
  LILY_KERNEL_INSTANTIATE("attn_prefill_float_d" #D, attn_prefill, float, D)               \
  LILY_KERNEL_INSTANTIATE("attn_prefill_half_d" #D, attn_prefill, half, D)                 \
  LILY_KERNEL_INSTANTIATE("attn_prefill_blocks_float_d" #D, attn_prefill_blocks, float, D) \
  LILY_KERNEL_INSTANTIATE("attn_prefill_blocks_half_d" #D, attn_prefill_blocks, half, D)
LILY_ATTN_HEAD_DIMS(LILY_ATTN_PREFILL_INSTANTIATE)
