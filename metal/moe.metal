// MoE family. Decode (and chunks shorter than GpuOptions::gemm_min_rows) runs the
// gather-GEMV kernels; prefill routes on the GPU and runs grouped GEMMs over a block map.
//
// Decode:
//   moe_route     softmax over the router logits, top-k by repeated argmax with ties to the
//                 lowest expert id, renormalisation.          grid (T), E rounded to 32 threads
//   moe_gate_up   fused gather-GEMV: rows of gate and up of the expert picked for job j, SwiGLU
//                 in registers, act written once.        grid (ceil(I / 8), k, T), 64 threads
//   moe_down      fused down-projection of every job + weighted combine + sigmoid-gated shared
//                 expert: each output row sums all experts' partial dots before one
//                 simd_sum, so y is written once and never re-read. The jobs run on teams of
//                 args.lanes lanes side by side (a 256-byte row: 16 lanes x 16 bytes, two
//                 experts at once), not one after another.   grid (ceil(H / 8), T), 64
//
// Prefill (one chunk, no CPU read-back: every size below is bounded by T*k on the host):
//   moe_route         as above: ids, weights [T, k]
//   moe_plan          histogram of ids per expert, prefix scans, stable scatter of the (token,
//                     job) slots sorted by expert, block map (moe_args.h). One threadgroup, a
//                     thread per expert, so the order is deterministic. grid (1), 1024 threads
//   moe_gemm_gate_up  (moe_gemm.h; _tensor_ variants in moe_tensor.metal)
//                     grouped GEMM per block of one expert's rows: the token rows of h gathered
//                     into the X tile, gate and up tiles dequantized in threadgroup memory,
//                     SwiGLU in the epilogue; act in sorted order.
//                                        grid (ceil(I / 32), max_blocks), 128 threads
//   moe_gemm_down     the same over act, scaled by the routing weight, rows scattered back to
//                     their slot: yr [T*k, H].          grid (ceil(H / 32), max_blocks), 128
//   moe_combine       y = sum of a token's k slots + sigmoid-gated shared expert; the sum runs
//                     over j in order, so results do not depend on the scatter.
// The shared expert and a dense MLP run the two GEMM kernels with routed = 0 (rows 0..T of one
// expert, blocks of BM). An expert with no tokens has no block: its weights are never read.
// Weights stay packed (quant.h, gemm.h read them); S is the scale (or dense element) type,
// uchar for the microscaled modes (microscale.h).
#include <metal_stdlib>
#include "lily_msl.h"
#include "moe_args.h"
#include "moe_gemm.h"
#include "quant.h"
#include "reduce.h"
using namespace metal;

// E threads rounded up to 32: up to 1024 (LILY_MOE_PLAN_THREADS bounds E).
[[max_total_threads_per_threadgroup(1024)]]
kernel void moe_route(constant MoeRouteArgs& args [[buffer(0)]],
                      device const float* logits [[buffer(1)]],  // [T, E]
                      device uint* ids [[buffer(2)]],            // [T, k]
                      device float* weights [[buffer(3)]],       // [T, k]
                      uint t [[threadgroup_position_in_grid]],
                      uint e [[thread_index_in_threadgroup]],
                      uint simd_id [[simdgroup_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]],
                      uint n_simd [[simdgroups_per_threadgroup]]) {
  LILY_THREADGROUP(float, scratch, [32]);
  LILY_THREADGROUP(uint, uscratch, [32]);
  LILY_THREADGROUP(float, picked, [LILY_MOE_MAX_TOPK]);
  const bool valid = e < args.E;
  const float logit = valid ? logits[ulong(t) * args.E + e] : -INFINITY;
  const float mx = threadgroup_max(logit, scratch, simd_id, lane, n_simd);
  const float sum = threadgroup_sum(valid ? exp(logit - mx) : 0.0f, scratch, simd_id, lane, n_simd);
  bool taken = false;
  for (uint r = 0; r < args.k; ++r) {
    const float v = valid && !taken ? logit : -INFINITY;
    const float best = threadgroup_max(v, scratch, simd_id, lane, n_simd);
    const uint cand = valid && !taken && v == best ? e : 0xFFFFFFFFu;
    const uint sel = threadgroup_min_uint(cand, uscratch, simd_id, lane, n_simd);
    if (e == sel) {
      taken = true;
      ids[ulong(t) * args.k + r] = sel;
      picked[r] = exp(best - mx) / sum;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (e == 0) {
    float total = 0.0f;
    for (uint r = 0; r < args.k; ++r) total += picked[r];
    for (uint r = 0; r < args.k; ++r)
      weights[ulong(t) * args.k + r] = args.renormalize ? picked[r] / total : picked[r];
  }
}

template <typename S>
kernel void moe_gate_up(constant MoeGateUpArgs& args [[buffer(0)]],
                        device const uchar* gate_w [[buffer(1)]],
                        device const uchar* gate_s [[buffer(2)]],
                        device const uchar* gate_b [[buffer(3)]],
                        device const ulong* gate_table [[buffer(4)]],  // [E, 3]
                        device const uchar* up_w [[buffer(5)]],
                        device const uchar* up_s [[buffer(6)]],
                        device const uchar* up_b [[buffer(7)]],
                        device const ulong* up_table [[buffer(8)]],    // [E, 3]
                        device const uint* ids [[buffer(9)]],          // [T, k]
                        device const float* h [[buffer(10)]],          // [T, H]
                        device float* act [[buffer(11)]],              // [T, k, I]
                        uint3 tg [[threadgroup_position_in_grid]],
                        uint simd_id [[simdgroup_index_in_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]]) {
  const uint job = tg.y, t = tg.z, I = args.gate.out;
  const uint e = ids[ulong(t) * args.k + job];
  device const float* x = h + ulong(t) * args.gate.in;
  device float* out = act + (ulong(t) * args.k + job) * I;
  const uint row0 = (tg.x * LILY_GEMV_SIMDGROUPS + simd_id) * LILY_GEMV_ROWS_PER_SIMDGROUP;
  if (row0 >= I) return;  // uniform across the simdgroup (no barrier below)
  const uint rows = min(uint(LILY_GEMV_ROWS_PER_SIMDGROUP), I - row0);
  const RowParts pg = rows_partial<S>(at(gate_w, gate_table, e, 0), at(gate_s, gate_table, e, 1),
                                      at(gate_b, gate_table, e, 2), args.gate, row0, rows, x, lane, 32);
  const RowParts pu = rows_partial<S>(at(up_w, up_table, e, 0), at(up_s, up_table, e, 1),
                                      at(up_b, up_table, e, 2), args.up, row0, rows, x, lane, 32);
  LILY_UNROLL for (int r = 0; r < LILY_GEMV_ROWS_PER_SIMDGROUP; ++r) {
    if (uint(r) < rows) {  // uniform across the simdgroup
      const float g = simd_sum(pg.v[r]), u = simd_sum(pu.v[r]);
      if (lane == 0) out[row0 + r] = silu_f(g) * u;
    }
  }
}

LILY_KERNEL_INSTANTIATE("moe_gate_up_float", moe_gate_up, float)
LILY_KERNEL_INSTANTIATE("moe_gate_up_half", moe_gate_up, half)
LILY_KERNEL_INSTANTIATE("moe_gate_up_bfloat", moe_gate_up, bfloat)
LILY_KERNEL_INSTANTIATE("moe_gate_up_uchar", moe_gate_up, uchar)

template <typename S>
kernel void moe_down(constant MoeDownArgs& args [[buffer(0)]],
                     device const uchar* down_w [[buffer(1)]],
                     device const uchar* down_s [[buffer(2)]],
                     device const uchar* down_b [[buffer(3)]],
                     device const ulong* down_table [[buffer(4)]],    // [E, 3]
                     device const uint* ids [[buffer(5)]],            // [T, k]
                     device const float* weights [[buffer(6)]],       // [T, k]
                     device const float* act [[buffer(7)]],           // [T, k, I]
                     device const uchar* shared_w [[buffer(8)]],
                     device const uchar* shared_s [[buffer(9)]],
                     device const uchar* shared_b [[buffer(10)]],
                     device const ulong* shared_table [[buffer(11)]],  // [1, 3]
                     device const float* shared_act [[buffer(12)]],    // [T, Is]
                     device const float* shared_gate [[buffer(13)]],   // [T] logit
                     device float* y [[buffer(14)]],                   // [T, H]
                     uint2 tg [[threadgroup_position_in_grid]],
                     uint simd_id [[simdgroup_index_in_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]]) {
  const uint t = tg.y, H = args.down.out, I = args.down.in;
  const uint row0 = (tg.x * LILY_GEMV_SIMDGROUPS + simd_id) * LILY_GEMV_ROWS_PER_SIMDGROUP;
  if (row0 >= H) return;  // uniform across the simdgroup (no barrier below)
  const uint rows = min(uint(LILY_GEMV_ROWS_PER_SIMDGROUP), H - row0);
  // Teams of args.lanes lanes side by side (moe_args.h): team p walks jobs p, p + teams, ...
  // (job k: the shared expert), each row's lane partial summing its jobs in that order; per job
  // the rows share one read of its activations. simd_sum then adds the teams' partials.
  const uint lanes = args.lanes, teams = 32 / lanes, team = lane / lanes, tl = lane % lanes;
  const uint jobs = args.k + (args.has_shared ? 1u : 0u);
  float part[LILY_GEMV_ROWS_PER_SIMDGROUP] = {};
  for (uint j = team; j < jobs; j += teams) {  // teams diverge here only; rejoined before simd_sum
    RowParts p;
    float wt;
    if (j < args.k) {
      const uint e = ids[ulong(t) * args.k + j];
      wt = args.weighted ? weights[ulong(t) * args.k + j] : 1.0f;
      p = rows_partial<S>(at(down_w, down_table, e, 0), at(down_s, down_table, e, 1), at(down_b, down_table, e, 2),
                          args.down, row0, rows, act + (ulong(t) * args.k + j) * I, tl, lanes);
    } else {
      wt = sigmoid_f(shared_gate[t]);
      p = rows_partial<S>(at(shared_w, shared_table, 0, 0), at(shared_s, shared_table, 0, 1),
                          at(shared_b, shared_table, 0, 2), args.shared_down, row0, rows,
                          shared_act + ulong(t) * args.shared_down.in, tl, lanes);
    }
    LILY_UNROLL for (int r = 0; r < LILY_GEMV_ROWS_PER_SIMDGROUP; ++r) part[r] += wt * p.v[r];
  }
  LILY_UNROLL for (int r = 0; r < LILY_GEMV_ROWS_PER_SIMDGROUP; ++r) {
    if (uint(r) < rows) {  // uniform across the simdgroup
      const float total = simd_sum(part[r]);
      if (lane == 0) y[ulong(t) * H + row0 + r] = total;
    }
  }
}

LILY_KERNEL_INSTANTIATE("moe_down_float", moe_down, float)
LILY_KERNEL_INSTANTIATE("moe_down_half", moe_down, half)
LILY_KERNEL_INSTANTIATE("moe_down_bfloat", moe_down, bfloat)
LILY_KERNEL_INSTANTIATE("moe_down_uchar", moe_down, uchar)

// ---- prefill ------------------------------------------------------------------------------------

[[max_total_threads_per_threadgroup(LILY_MOE_PLAN_THREADS)]]
kernel void moe_plan(constant MoePlanArgs& args [[buffer(0)]],
                     device const uint* ids [[buffer(1)]],  // [n] expert of slot s = t*k + j
                     device uint* rows [[buffer(2)]],       // [n] slots sorted by expert
                     device uint4* blocks [[buffer(3)]],    // [max_blocks]
                     device uint* header [[buffer(4)]],     // [4]
                     uint e [[thread_index_in_threadgroup]],
                     uint simd_id [[simdgroup_index_in_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]],
                     uint n_simd [[simdgroups_per_threadgroup]]) {
  LILY_THREADGROUP(ushort, tile, [LILY_MOE_PLAN_TILE]);
  LILY_THREADGROUP(uint, rows_before, [32]);
  LILY_THREADGROUP(uint, blocks_before, [32]);
  const uint threads = n_simd * 32, bm = args.block_rows;

  // Histogram: thread e counts slots routed to expert e (ids staged through threadgroup memory).
  uint count = 0;
  for (uint base = 0; base < args.n; base += LILY_MOE_PLAN_TILE) {
    const uint m = min(uint(LILY_MOE_PLAN_TILE), args.n - base);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous tile is read
    for (uint i = e; i < m; i += threads) tile[i] = ushort(ids[base + i]);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (e < args.E)
      for (uint i = 0; i < m; ++i) count += tile[i] == e ? 1u : 0u;
  }
  const uint nblk = (count + bm - 1) / bm;

  // Exclusive prefix sums over experts of the row counts and block counts.
  const uint pre_rows = simd_prefix_exclusive_sum(count), pre_blk = simd_prefix_exclusive_sum(nblk);
  if (lane == 31) {
    rows_before[simd_id] = pre_rows + count;
    blocks_before[simd_id] = pre_blk + nblk;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simd_id == 0) {
    const uint r = lane < n_simd ? rows_before[lane] : 0u, b = lane < n_simd ? blocks_before[lane] : 0u;
    const uint er = simd_prefix_exclusive_sum(r), eb = simd_prefix_exclusive_sum(b);
    if (lane < n_simd) {
      rows_before[lane] = er;
      blocks_before[lane] = eb;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint row0 = rows_before[simd_id] + pre_rows, blk0 = blocks_before[simd_id] + pre_blk;
  if (e == args.E - 1) {
    header[0] = blk0 + nblk;
    header[1] = row0 + count;
    header[2] = 0;
    header[3] = 0;
  }

  // Stable scatter: expert e writes its slots in increasing order from row0.
  uint pos = row0;
  for (uint base = 0; base < args.n; base += LILY_MOE_PLAN_TILE) {
    const uint m = min(uint(LILY_MOE_PLAN_TILE), args.n - base);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = e; i < m; i += threads) tile[i] = ushort(ids[base + i]);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (e < args.E)
      for (uint i = 0; i < m; ++i)
        if (tile[i] == e) rows[pos++] = base + i;
  }
  for (uint b = 0; b < nblk; ++b) blocks[blk0 + b] = uint4(e, row0 + b * bm, min(bm, count - b * bm), 0u);
}

LILY_MOE_GEMM_INSTANTIATE(gate_up, "", false)
LILY_MOE_GEMM_INSTANTIATE(down, "", false)

kernel void moe_combine(constant MoeCombineArgs& args [[buffer(0)]],
                        device const float* yr [[buffer(1)]],      // [T*k, H] weighted expert rows
                        device const float* ys [[buffer(2)]],      // [T, H] shared expert
                        device const float* sg [[buffer(3)]],      // [T] shared gate logit
                        device float* y [[buffer(4)]],             // [T, H]
                        uint2 gid [[thread_position_in_grid]]) {
  const uint c = gid.x, t = gid.y;
  if (c >= args.H) return;
  float total = 0.0f;
  for (uint j = 0; j < args.k; ++j) total += yr[(ulong(t) * args.k + j) * args.H + c];
  if (args.has_shared) total += sigmoid_f(sg[t]) * ys[ulong(t) * args.H + c];
  y[ulong(t) * args.H + c] = total;
}
