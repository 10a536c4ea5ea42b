// Attention prefill: flash-style causal attention of a chunk of T query tokens over the cache
// (earlier chunks and this one; attn_prepare of metal/attention.metal has already written the
// chunk's normalised, rotated k and v into it).
//
//   attn_prefill_<KV>_d<D>  one threadgroup per (KV head, tile of query tokens). Its query rows are the
//                 tile's tokens x the Hq/Hkv query heads that share the KV head (GQA), up to
//                 LILY_ATTN_PF_ROWS = 64 rows (35B: 8 tokens x 8 heads), so every K/V row fetched
//                 from the cache serves all of them: the cache is read ceil(T / tile_tokens)
//                 times per KV head instead of T times (the decode kernel's grid). K and V tiles
//                 of LILY_ATTN_PF_KV_TILE positions are staged in threadgroup memory by all
//                 threads, K transposed ([D][KT]) so no simdgroup_load transposes. Each
//                 simdgroup owns 8 consecutive rows and works on 8x8 simdgroup matrices:
//                   S[8 x KT]  = Q[8 x D] K^T[D x KT]                (D/8 products)
//                   online softmax of S's rows (lanes 0..7, one row each, in threadgroup memory)
//                   O[8 x D]   = diag(corr) O + P[8 x KT] V[KT x D]  (2 D/8 products)
//                 The row rescale goes through a diagonal matrix rather than thread_elements(),
//                 whose per-lane layout the specification leaves open. Positions past a row's
//                 causal end get probability 0; the tile loop stops at the tile's last token, a
//                 simdgroup skips tiles past its last row. The sigmoid output gate is applied
//                 on the way out.
//                        grid (Hkv, ceil(T / tile_tokens)), LILY_ATTN_PF_THREADS (256) threads
//
// Registers per lane: O is 8 rows x D f32 per simdgroup, D/8 matrices = D/4 floats (64 at
// D = 256), plus the products' operands. Why not more rows per threadgroup (the KV bytes a
// chunk declares fall with the tile): 16 simdgroups (512 threads, 16-token tiles) took 128
// registers a thread compiled for sm_90 and spilled, i.e. twice the register file per
// threadgroup for the same per-thread need; 32-token tiles would hold 256 KB of accumulators.
// Concurrent tiles of one KV head share its positions through the GPU's caches (measured on an
// H200: DRAM sees about one read of the cache per dispatch; docs/metal.md).
// Q is gathered from device memory per K/V tile through a per-simdgroup 8x8 block (a
// simdgroup's 8 rows are not evenly strided when the GQA group is not a multiple of 8).
// Scores, maxima, sums and accumulators are f32; KV is the cache's element type (float or half),
// widened to f32 as it is staged. D is a template parameter (LILY_ATTN_HEAD_DIMS), so the D/8
// accumulator matrices are registers, not stack memory.
#include <metal_stdlib>
#include "lily_msl.h"
#include "attention_prefill_args.h"
#include "kv_cache.h"
#include "reduce.h"
using namespace metal;

// Threadgroup memory of one attn_prefill threadgroup (declared by the kernel, passed down).
struct AttnPrefillTiles {
  threadgroup float* k_t;      // [D][KT]  K tile, transposed
  threadgroup float* v;        // [KT][D]  V tile
  threadgroup float* scratch;  // [NSG][2][8][8]  per simdgroup: Q block, then S / P; diag(corr)
};

template <typename KV, int D, typename Cache>
inline void attn_prefill_impl(device const float* qg, Cache kc, Cache vc, device float* o,
                              constant AttnPrefillArgs& args, uint pos0, uint T, AttnPrefillTiles tiles, uint2 tg,
                              uint tid, uint threads, uint simd_id, uint lane) {
  constexpr int KT = LILY_ATTN_PF_KV_TILE, NB = D / 8;  // NB: 8-column blocks along D
  static_assert(KT == 8, "S and P are one 8x8 matrix per simdgroup");
  const uint group = args.Hq / args.Hkv;
  const uint hk = tg.x, t0 = tg.y * args.tile_tokens;
  const uint t_end = min(T, t0 + args.tile_tokens);  // tokens [t0, t_end)
  const uint n_rows = (t_end - t0) * group;
  // Row r of the tile = (token t0 + r / group, query head hk * group + r % group); this
  // simdgroup owns rows [r0, r0 + 8).
  const uint r0 = simd_id * 8;
  threadgroup float* blk = tiles.scratch + simd_id * 128;  // [8][8] Q block, then S / P
  threadgroup float* diag = blk + 64;                       // [8][8] diag(corr)
  for (uint e = lane; e < 64; e += 32) diag[e] = 0.0f;

  // Lanes 0..7 carry the softmax state of row r0 + lane: running max m, sum l, causal length.
  const uint my_row = r0 + lane;
  const uint len = lane < 8 && my_row < n_rows ? pos0 + t0 + my_row / group + 1 : 0;
  float m = -INFINITY, l = 0.0f;
  // The simdgroup's last position: its last row's causal end (0 if it has no rows).
  const uint sg_end = r0 < n_rows ? pos0 + t0 + (min(r0 + 8, n_rows) - 1) / group + 1 : 0;
  // This lane's two elements of a Q block: row e / 8, column e % 8 for e = 2 lane, 2 lane + 1.
  const uint q_row = r0 + lane / 4;
  device const float* q = q_row < n_rows
      ? qg + (ulong(t0 + q_row / group) * args.Hq + hk * group + q_row % group) * 2 * D + 2 * (lane % 4)
      : nullptr;

  simdgroup_float8x8 acc[NB];
  LILY_UNROLL for (int j = 0; j < NB; ++j) acc[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  const uint end = pos0 + t_end;  // the tile's last token sees positions [0, end)
  for (uint p0 = 0; p0 < end; p0 += KT) {
    const uint n = min(uint(KT), end - p0);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous tile is fully read
    for (uint e = tid; e < KT * D; e += threads) {  // zeros past n: P is 0 there, 0 x V stays 0
      const uint c = e / D, d = e % D;
      tiles.k_t[d * KT + c] = c < n ? float(kc.row(hk, p0 + c)[d]) : 0.0f;
      tiles.v[e] = c < n ? float(vc.row(hk, p0 + c)[d]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (p0 >= sg_end) continue;  // uniform across the simdgroup

    // S = Q K^T over the D/8 blocks of D.
    simdgroup_float8x8 s = make_filled_simdgroup_matrix<float, 8, 8>(0.0f), a, b;
    for (int j = 0; j < NB; ++j) {
      blk[2 * lane] = q ? q[8 * j] : 0.0f;
      blk[2 * lane + 1] = q ? q[8 * j + 1] : 0.0f;
      simdgroup_barrier(mem_flags::mem_threadgroup);
      simdgroup_load(a, blk, 8);
      simdgroup_load(b, tiles.k_t + 8 * j * KT, KT);
      simdgroup_multiply_accumulate(s, a, b, s);
      simdgroup_barrier(mem_flags::mem_threadgroup);  // blk is rewritten next
    }
    simdgroup_store(s, blk, 8);
    simdgroup_barrier(mem_flags::mem_threadgroup);

    // Online softmax, one row per lane: new max, the old sum's rescale, P in place of S.
    if (lane < 8) {
      threadgroup float* row = blk + 8 * lane;
      float mx = m;
      for (uint c = 0; c < uint(KT); ++c)
        if (p0 + c < len) mx = max(mx, row[c] * args.scale);
      // A row with no visible position yet (padding rows only) keeps m = -inf: P 0, corr 1.
      const float corr = mx == -INFINITY ? 1.0f : exp(m - mx);  // 0 at a row's first position
      float sum = 0.0f;
      for (uint c = 0; c < uint(KT); ++c) {
        const float p = p0 + c < len ? exp(row[c] * args.scale - mx) : 0.0f;
        row[c] = p;
        sum += p;
      }
      l = l * corr + sum;
      m = mx;
      diag[9 * lane] = corr;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);

    // O = diag(corr) O + P V, block by block of D.
    simdgroup_float8x8 p, dg;
    simdgroup_load(p, blk, 8);
    simdgroup_load(dg, diag, 8);
    LILY_UNROLL for (int j = 0; j < NB; ++j) {
      simdgroup_multiply(acc[j], dg, acc[j]);
      simdgroup_load(b, tiles.v + 8 * j, D);
      simdgroup_multiply_accumulate(acc[j], p, b, acc[j]);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // blk and diag are rewritten next tile
  }

  // O / l, times the output gate, row by row through the scratch block: this lane writes
  // elements 2 lane and 2 lane + 1 of each 8x8 block (row lane / 4, whose l lane lane / 4 holds).
  const float l_row = simd_shuffle(l, ushort(lane / 4));
  LILY_UNROLL for (int j = 0; j < NB; ++j) {
    simdgroup_store(acc[j], blk, 8);
    simdgroup_barrier(mem_flags::mem_threadgroup);
    if (q) {  // (head_row recomputed, not kept from q's: live across the KV walk it spilled on sm_90)
      const ulong head_row = ulong(t0 + q_row / group) * args.Hq + hk * group + q_row % group;
      device const float* gate = qg + head_row * 2 * D + D;
      LILY_UNROLL for (int k = 0; k < 2; ++k) {
        const uint d = 8 * j + 2 * (lane % 4) + k;
        o[head_row * D + d] = blk[2 * lane + k] / l_row * sigmoid_f(gate[d]);
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
}

template <typename KV, int D, typename Cache>
[[max_total_threads_per_threadgroup(LILY_ATTN_PF_THREADS)]]
kernel void attn_prefill(constant AttnPrefillArgs& args [[buffer(0)]],
                         constant AttnSeq& seq [[buffer(1)]],      // the chunk: rows, position, cache
                         device const float* qg [[buffer(2)]],     // [T, Hq, 2D]
                         device float* o [[buffer(3)]],            // [T, Hq, D]
                         uint2 tg [[threadgroup_position_in_grid]],
                         uint2 threads [[threads_per_threadgroup]],
                         uint tid [[thread_index_in_threadgroup]],
                         uint simd_id [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  LILY_THREADGROUP(float, k_t, [LILY_ATTN_PF_KV_TILE * D]);
  LILY_THREADGROUP(float, v_tile, [LILY_ATTN_PF_KV_TILE * D]);
  LILY_THREADGROUP(float, scratch, [LILY_ATTN_PF_SIMDGROUPS * 2 * 64]);
  const Cache kc(seq, false, args.Hkv, D), vc(seq, true, args.Hkv, D);
  attn_prefill_impl<KV, D>(qg + ulong(seq.first) * args.Hq * 2 * D, kc, vc, o + ulong(seq.first) * args.Hq * D,
                           args, seq.pos0, seq.n, {k_t, v_tile, scratch}, tg, tid, threads.x, simd_id, lane);
}

// attn_prefill[_blocks]_<KV>_d<D>
#define LILY_ATTN_PREFILL_INSTANTIATE(D)                                                                   \
  LILY_KERNEL_INSTANTIATE("attn_prefill_float_d" #D, attn_prefill, float, D, ContiguousCache<const float>)  \
  LILY_KERNEL_INSTANTIATE("attn_prefill_half_d" #D, attn_prefill, half, D, ContiguousCache<const half>)    \
  LILY_KERNEL_INSTANTIATE("attn_prefill_blocks_float_d" #D, attn_prefill, float, D, BlockCache<const float>) \
  LILY_KERNEL_INSTANTIATE("attn_prefill_blocks_half_d" #D, attn_prefill, half, D, BlockCache<const half>)
LILY_ATTN_HEAD_DIMS(LILY_ATTN_PREFILL_INSTANTIATE)
