// Attention family for the gated full-attention layers. Buffers: the argument struct at 0, then
// what a kernel reads, then what it writes (csrc/gpu/encoder.h).
//
// Every kernel takes a table of sequences (AttnSeq: rows, position, cache addresses, split), so
// one dispatch serves all the sequences of a pass, each against its own cache and position;
// the grid's rows are the sequences' rows in table order (R = their sum, S = table entries).
//
//   attn_prepare_[blocks_]<KV>  q/k zero-centred RMSNorm + partial rotate-half RoPE in place,
//                 k and v written into each row's cache at its position.
//                                                      grid (Hq + Hkv, R), 128 threads
//   attn_decode_[blocks_]<KV>_d<D>  causal softmax(q k^T * scale) v for one KV head and one
//                 split of a row's cache, GQA-packed: the query heads sharing a KV head are all
//                 in this threadgroup, each owned by one simdgroup (heads s, s + 4, ...), so the
//                 K/V rows of the split are read from memory once for all of them. A sequence
//                 of one split applies the sigmoid output gate and writes o; split-K (n_splits
//                 > 1) writes unnormalised partials and (max, sum) into its slot; threadgroups
//                 past its splits return.        grid (Hkv, max n_splits, R), 128 threads
//   attn_combine  merges each split sequence's partials and applies the gate.
//                                      grid (Hq, D / LILY_ATTN_COMBINE_COLUMNS, S), 32 threads
//
// The _blocks kernels read the fixed-block cache layout of long contexts (attention_args.h):
// splits are whole blocks, so split-K walks blocks. Both layouts share one body per kernel: a
// cache-addressing policy (kv_cache.h: ContiguousCache, BlockCache) maps (KV head, position)
// to the row's address. Blocks keep growth free of copies: a longer context allocates a new
// arena and extends the table, the cached rows stay put. A row's result depends only on its
// own sequence's entry, never on the other sequences of the dispatch.
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
kernel void attn_prepare(constant AttnPrepareArgs& args [[buffer(0)]],
                         constant AttnSeq* seqs [[buffer(1)]],        // [n_seqs]
                         device const float* k [[buffer(2)]],         // [T, Hkv, D]
                         device const float* v [[buffer(3)]],         // [T, Hkv, D]
                         device const float* q_norm [[buffer(4)]],    // [D]
                         device const float* k_norm [[buffer(5)]],    // [D]
                         device const float* inv_freq [[buffer(6)]],  // [rot / 2]
                         device float* qg [[buffer(7)]],              // [T, Hq, 2D] (q in place)
                         uint2 tg [[threadgroup_position_in_grid]],
                         uint2 threads [[threads_per_threadgroup]],
                         uint tid [[thread_index_in_threadgroup]],
                         uint simd_id [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint n_simd [[simdgroups_per_threadgroup]]) {
  LILY_THREADGROUP(float, scratch, [32]);
  LILY_THREADGROUP(float, normed, [LILY_ATTN_MAX_HEAD_DIM]);
  const uint D = args.D, head = tg.x, n = threads.x;
  uint r = tg.y;
  constant AttnSeq& seq = seqs[attn_seq_index(seqs, args.n_seqs, r)];
  const uint t = seq.first + r, pos = seq.pos0 + r;  // the row in the pass, its position
  const bool is_q = head < args.Hq;
  const uint hk = head - args.Hq;
  device const float* src = is_q ? qg + (ulong(t) * args.Hq + head) * 2 * D
                                 : k + (ulong(t) * args.Hkv + hk) * D;
  device const float* gain = is_q ? q_norm : k_norm;

  float ss = 0.0f;
  for (uint i = tid; i < D; i += n) ss += src[i] * src[i];
  const float rms = 1.0f / sqrt(threadgroup_sum(ss, scratch, simd_id, lane, n_simd) / float(D) + args.eps);
  for (uint i = tid; i < D; i += n) normed[i] = (src[i] * rms) * gain[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const uint half_rot = args.rot / 2;
  device float* q_dst = qg + (ulong(t) * args.Hq + head) * 2 * D;
  const Cache kc(seq, false, args.Hkv, D), vc(seq, true, args.Hkv, D);
  device KV* k_dst = is_q ? nullptr : kc.row(hk, pos);
  for (uint i = tid; i < D; i += n) {
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
    for (uint i = tid; i < D; i += n) vd[i] = KV(vs[i]);
  }
}

LILY_KERNEL_INSTANTIATE("attn_prepare_float", attn_prepare, float, ContiguousCache<float>)
LILY_KERNEL_INSTANTIATE("attn_prepare_half", attn_prepare, half, ContiguousCache<half>)
LILY_KERNEL_INSTANTIATE("attn_prepare_blocks_float", attn_prepare, float, BlockCache<float>)
LILY_KERNEL_INSTANTIATE("attn_prepare_blocks_half", attn_prepare, half, BlockCache<half>)

// One KV head (tg.x), one split of a row's cache (tg.y), one row (tg.z). Simdgroup s owns the
// query heads s, s + 4, ... of the GQA group; each walks the split's positions in order.
template <typename KV, int D, typename Cache>
kernel void attn_decode(constant AttnArgs& args [[buffer(0)]],
                        constant AttnSeq* seqs [[buffer(1)]],   // [n_seqs]
                        device const float* qg [[buffer(2)]],   // [T, Hq, 2D]
                        device float* o [[buffer(3)]],          // [T, Hq, D]
                        device float* part_o [[buffer(4)]],     // [slot, Hq, max_splits, D]
                        device float* part_ml [[buffer(5)]],    // [slot, Hq, max_splits, 2]
                        uint3 tg [[threadgroup_position_in_grid]],
                        uint simd_id [[simdgroup_index_in_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]]) {
  constexpr int PER_LANE = D / 32, ROWS = LILY_ATTN_ROWS_PER_SIMDGROUP, NSG = LILY_ATTN_SIMDGROUPS;
  uint r = tg.z;
  constant AttnSeq& seq = seqs[attn_seq_index(seqs, args.n_seqs, r)];
  const uint hk = tg.x, split = tg.y, t = seq.first + r, group = args.Hq / args.Hkv;
  if (split >= seq.n_splits) return;  // (uniform over the threadgroup; no barrier below)
  const uint rows = group > simd_id ? (group - simd_id + NSG - 1) / NSG : 0u;  // heads this simdgroup owns
  if (rows == 0) return;
  const Cache kc(seq, false, args.Hkv, D), vc(seq, true, args.Hkv, D);
  const uint len = seq.pos0 + r + 1;  // causal: positions [0, pos0 + r]
  const uint begin = split * seq.split_len;
  const uint end = min(len, begin + seq.split_len);

  float q[ROWS][PER_LANE], acc[ROWS][PER_LANE], m[ROWS], l[ROWS];
  LILY_UNROLL for (int i = 0; i < ROWS; ++i) {
    const uint g = min(simd_id + NSG * uint(i), group - 1);  // rows past `rows` are never used
    device const float* qh = qg + (ulong(t) * args.Hq + hk * group + g) * 2 * D;
    LILY_UNROLL for (int e = 0; e < PER_LANE; ++e) {
      q[i][e] = qh[lane + 32 * e];
      acc[i][e] = 0.0f;
    }
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }

  for (uint p = begin; p < end; ++p) {
    float kr[PER_LANE], vr[PER_LANE];
    device const KV* kp = kc.row(hk, p);
    device const KV* vp = vc.row(hk, p);
    LILY_UNROLL for (int e = 0; e < PER_LANE; ++e) {
      kr[e] = float(kp[lane + 32 * e]);
      vr[e] = float(vp[lane + 32 * e]);
    }
    LILY_UNROLL for (int i = 0; i < ROWS; ++i) {
      if (uint(i) < rows) {
        float d = 0.0f;
        LILY_UNROLL for (int e = 0; e < PER_LANE; ++e) d += q[i][e] * kr[e];
        const float s = simd_sum(d) * args.scale;
        const float mn = max(m[i], s);
        const float c = exp(m[i] - mn), w = exp(s - mn);
        l[i] = l[i] * c + w;
        LILY_UNROLL for (int e = 0; e < PER_LANE; ++e) acc[i][e] = acc[i][e] * c + w * vr[e];
        m[i] = mn;
      }
    }
  }

  LILY_UNROLL for (int i = 0; i < ROWS; ++i) {
    if (uint(i) < rows) {
      const uint hq = hk * group + simd_id + NSG * uint(i);
      const ulong head_row = ulong(t) * args.Hq + hq;
      const ulong part = (ulong(seq.part) * args.Hq + hq) * args.max_splits + split;
      device const float* gate = qg + head_row * 2 * D + D;
      LILY_UNROLL for (int e = 0; e < PER_LANE; ++e) {
        const uint d = lane + 32 * e;
        if (seq.n_splits == 1) o[head_row * D + d] = acc[i][e] / l[i] * sigmoid_f(gate[d]);
        else part_o[part * D + d] = acc[i][e];
      }
      if (seq.n_splits > 1 && lane == 0) {
        part_ml[part * 2 + 0] = m[i];
        part_ml[part * 2 + 1] = l[i];
      }
    }
  }
}

// attn_decode[_blocks]_<KV>_d<D>
#define LILY_ATTN_DECODE_INSTANTIATE(D)                                                                  \
  LILY_KERNEL_INSTANTIATE("attn_decode_float_d" #D, attn_decode, float, D, ContiguousCache<const float>)  \
  LILY_KERNEL_INSTANTIATE("attn_decode_half_d" #D, attn_decode, half, D, ContiguousCache<const half>)    \
  LILY_KERNEL_INSTANTIATE("attn_decode_blocks_float_d" #D, attn_decode, float, D, BlockCache<const float>) \
  LILY_KERNEL_INSTANTIATE("attn_decode_blocks_half_d" #D, attn_decode, half, D, BlockCache<const half>)
LILY_ATTN_HEAD_DIMS(LILY_ATTN_DECODE_INSTANTIATE)

// One query head (tg.x), one slice of LILY_ATTN_COMBINE_COLUMNS value columns (tg.y), one
// sequence (tg.z; one of one split has nothing to merge): the slices spread a head's combine
// over D / 32 threadgroups, since the partials it reads grow with the splits (2 MB per layer at
// 128 splits of the 35B shape). Every thread recomputes the splits' global max and total (2
// floats per split, the same for all) and merges its column over the splits in split order, so
// a row's result depends only on its own splits.
kernel void attn_combine(constant AttnArgs& args [[buffer(0)]],
                         constant AttnSeq* seqs [[buffer(1)]],       // [n_seqs]
                         device const float* qg [[buffer(2)]],       // [T, Hq, 2D] (gate)
                         device const float* part_o [[buffer(3)]],   // [slot, Hq, max_splits, D]
                         device const float* part_ml [[buffer(4)]],  // [slot, Hq, max_splits, 2]
                         device float* o [[buffer(5)]],              // [T, Hq, D]
                         uint3 tg [[threadgroup_position_in_grid]],
                         uint3 tid [[thread_position_in_threadgroup]]) {
  constant AttnSeq& seq = seqs[tg.z];
  const uint D = args.D, hq = tg.x, n = seq.n_splits;
  const uint d = tg.y * LILY_ATTN_COMBINE_COLUMNS + tid.x;
  if (d >= D || n <= 1) return;
  const ulong head_row = ulong(seq.first) * args.Hq + hq;  // (split sequences decode one row)
  const ulong part = (ulong(seq.part) * args.Hq + hq) * args.max_splits;
  device const float* ml = part_ml + part * 2;
  float mx = -INFINITY;
  for (uint s = 0; s < n; ++s) mx = max(mx, ml[2 * s]);
  float total = 0.0f, num = 0.0f;
  for (uint s = 0; s < n; ++s) {
    if (ml[2 * s] == -INFINITY) continue;  // a split past the causal end: no positions
    const float w = exp(ml[2 * s] - mx);
    total += ml[2 * s + 1] * w;
    num += part_o[(part + s) * D + d] * w;
  }
  device const float* gate = qg + head_row * 2 * D + D;
  o[head_row * D + d] = num / total * sigmoid_f(gate[d]);
}
