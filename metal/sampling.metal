// Sampling family: the next token chosen on the GPU, so a decode step's token is written into the
// next step's input slot without a CPU round trip.
//
//   sample   one threadgroup per row of a device-loop step (the sequences of the loop), each
//            with its own parameters a = args[row]: token[row] = argmax(logits[row][0, a.vocab)),
//            or a seeded draw after temperature / top-k / top-p / min-p; the row's rng[4]
//            advances by one draw; its status[3] reports bad logits. a.vocab may be less than
//            the row (the sampler's token limit: padding rows are never chosen).
//            grid (rows), LILY_SAMPLE_THREADS threads.
//
// The algorithm is the CPU sampler's (engine/sampler.{h,cpp}), and the arithmetic is shared
// with it through sampling.h, so identical logits and RNG state give the identical token:
//   - candidates are ordered by (logit descending, id ascending); top-k, top-p and min-p each
//     keep a prefix of that order, so the kept set is "key > v, plus the first n tokens (by id)
//     whose key equals v", and logit >= max + T log(min_p);
//   - weights are integers (sampling.h), so every sum is exact and order-free;
//   - the draw is t = mulhi(rng, total) and picks the token whose interval of the running sum in
//     id order holds t.
// Top-k and top-p boundaries are found without sorting: a binary search over the 32-bit keys,
// each probe one pass over the vocabulary (a count for top-k, a mass for top-p), reduced over the
// threadgroup. The draw is one pass over contiguous id ranges, one per thread, with exclusive
// scans of their counts and masses. One threadgroup: ~70 passes over 1 MB of logits at 248K, a
// fraction of a decode step's weight traffic (unmeasured on Apple hardware).
#include <metal_stdlib>
#include "lily_msl.h"
#include "sampling_args.h"
#include "sampling.h"
using namespace metal;

namespace {

// Sum of a uint over the threadgroup, returned to every thread.
inline uint tg_sum_u32(uint v, threadgroup uint* scratch, uint simd_id, uint lane, uint n_simd) {
  v = simd_sum(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);  // scratch may still be read by a prior call
  if (lane == 0) scratch[simd_id] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint total = 0;
  for (uint i = 0; i < n_simd; ++i) total += scratch[i];
  return total;
}

// Sum of a ulong over the threadgroup (exact), returned to every thread. Simdgroup shuffles move
// 32-bit halves, which every Metal GPU supports.
inline ulong tg_sum_u64(ulong v, threadgroup ulong* scratch, uint simd_id, uint lane, uint n_simd) {
  for (ushort m = 16; m > 0; m >>= 1) {
    const uint lo = simd_shuffle_xor(uint(v & 0xFFFFFFFFu), m);
    const uint hi = simd_shuffle_xor(uint(v >> 32), m);
    v += (ulong(hi) << 32) | ulong(lo);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) scratch[simd_id] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  ulong total = 0;
  for (uint i = 0; i < n_simd; ++i) total += scratch[i];
  return total;
}

inline uint tg_max_u32(uint v, threadgroup uint* scratch, uint simd_id, uint lane, uint n_simd) {
  v = simd_max(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) scratch[simd_id] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint m = 0;
  for (uint i = 0; i < n_simd; ++i) m = max(m, scratch[i]);
  return m;
}

inline uint tg_min_u32(uint v, threadgroup uint* scratch, uint simd_id, uint lane, uint n_simd) {
  v = simd_min(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) scratch[simd_id] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint m = 0xFFFFFFFFu;
  for (uint i = 0; i < n_simd; ++i) m = min(m, scratch[i]);
  return m;
}

}  // namespace

[[max_total_threads_per_threadgroup(LILY_SAMPLE_THREADS)]]
kernel void sample(constant SampleArgs* args [[buffer(0)]],   // [rows]
                   device const float* logits [[buffer(1)]],  // [rows, stride]: only [0, vocab) of a row is read
                   device float* w [[buffer(2)]],              // [rows, stride] scratch: e^((l - max) / T)
                   device ulong* rng [[buffer(3)]],            // [rows, 4] xoshiro256** state (advanced in place)
                   device int* token [[buffer(4)]],            // [rows]
                   device uint* status [[buffer(5)]],          // [rows, 4] code, index, logit bits, unused
                   uint row [[threadgroup_position_in_grid]],
                   uint tid [[thread_index_in_threadgroup]],
                   uint threads [[threads_per_threadgroup]],
                   uint simd_id [[simdgroup_index_in_threadgroup]],
                   uint lane [[thread_index_in_simdgroup]],
                   uint n_simd [[simdgroups_per_threadgroup]]) {
  LILY_THREADGROUP(uint, su, [32]);
  LILY_THREADGROUP(ulong, sl, [32]);
  LILY_THREADGROUP(uint, eq_scan, [LILY_SAMPLE_THREADS]);     // per thread: equal-key tokens
  LILY_THREADGROUP(ulong, mass_scan, [LILY_SAMPLE_THREADS]);  // per thread: kept mass
  LILY_THREADGROUP(ulong, pick, [2]);                         // the drawing thread, t
  // This threadgroup's row: its parameters, logits, scratch, generator state, token and status.
  constant SampleArgs& a = args[row];
  logits += ulong(row) * a.stride;
  w += ulong(row) * a.stride;
  rng += 4 * row;
  token += row;
  status += 4 * row;
  const uint V = a.vocab;

  // Pass 1: the best key (lowest id on ties) and the first NaN / +inf.
  uint best_key = 0, best_id = 0xFFFFFFFFu, bad = 0xFFFFFFFFu;
  for (uint i = tid; i < V; i += threads) {  // ascending i: strict > keeps the lowest id
    const float l = logits[i];
    if (sample_is_bad(l)) {
      bad = min(bad, i);
      continue;
    }
    const uint k = sample_key(l);
    if (k > best_key) {
      best_key = k;
      best_id = i;
    }
  }
  bad = tg_min_u32(bad, su, simd_id, lane, n_simd);
  const uint top = tg_max_u32(best_key, su, simd_id, lane, n_simd);
  const uint best = tg_min_u32(best_key == top ? best_id : 0xFFFFFFFFu, su, simd_id, lane, n_simd);
  if (bad != 0xFFFFFFFFu || top <= LILY_SAMPLE_KEY_NEG_INF) {
    if (tid == 0) {  // token 0 keeps the next step's embedding in bounds; the host raises
      token[0] = 0;
      status[0] = bad != 0xFFFFFFFFu ? LILY_SAMPLE_BAD_LOGIT : LILY_SAMPLE_ALL_NEG_INF;
      status[1] = bad;
      status[2] = bad != 0xFFFFFFFFu ? as_type<uint>(logits[bad]) : 0u;
    }
    return;
  }
  if (a.sample == 0) {
    if (tid == 0) {
      token[0] = int(best);
      status[0] = LILY_SAMPLE_OK;
    }
    return;
  }

  // Pass 2: weights (float, kept for the passes below) and their integer total.
  const float max_logit = logits[best], inv_t = a.inv_t, scale = sample_weight_scale(V);
  ulong z_all = 0;
  for (uint i = tid; i < V; i += threads) {
    const float l = logits[i];  // -inf weighs 0 (tested on the bits: fast math assumes no inf)
    const float e = sample_key(l) <= LILY_SAMPLE_KEY_NEG_INF ? 0.0f : sample_exp_nonpos((l - max_logit) * inv_t);
    w[i] = e;
    z_all += ulong(e * scale);  // == sample_weight(logits[i], ...)
  }
  z_all = tg_sum_u64(z_all, sl, simd_id, lane, n_simd);

  // The kept prefix so far: key > v, and the first n_eq tokens with key == v. v = 0: everything.
  uint v = 0, n_eq = 0xFFFFFFFFu;
  const bool use_k = a.top_k > 0 && a.top_k < V;
  ulong z = z_all;  // mass that top-p applies to
  if (use_k) {
    // The k-th best key: the largest u with count(key >= u) >= k.
    uint lo = 0, hi = top;
    while (lo < hi) {
      const uint mid = lo + (hi - lo + 1) / 2;
      uint c = 0;
      for (uint i = tid; i < V; i += threads) c += sample_key(logits[i]) >= mid ? 1u : 0u;
      if (tg_sum_u32(c, su, simd_id, lane, n_simd) >= a.top_k) lo = mid;
      else hi = mid - 1;
    }
    v = lo;
    uint c = 0;
    ulong m = 0;
    for (uint i = tid; i < V; i += threads)
      if (sample_key(logits[i]) > v) {
        ++c;
        m += ulong(w[i] * scale);
      }
    const uint n_gt = tg_sum_u32(c, su, simd_id, lane, n_simd);
    n_eq = a.top_k - n_gt;
    z = tg_sum_u64(m, sl, simd_id, lane, n_simd) +
        ulong(n_eq) * sample_weight(sample_key_value(v), max_logit, inv_t, scale);
  }
  if (a.use_top_p) {
    ulong target = sample_mulhi(z, (ulong(a.top_p_hi) << 32) | ulong(a.top_p_lo));
    target = max(target, ulong(1));
    // The smallest key u (within the top-k prefix) with mass(key > u) < target: the last kept
    // token's key. Keys above the best carry no mass, so `top` qualifies.
    uint lo = use_k ? v : 0, hi = top;
    while (lo < hi) {
      const uint mid = lo + (hi - lo) / 2;
      ulong m = 0;
      for (uint i = tid; i < V; i += threads)
        if (sample_key(logits[i]) > mid) m += ulong(w[i] * scale);
      if (tg_sum_u64(m, sl, simd_id, lane, n_simd) < target) hi = mid;
      else lo = mid + 1;
    }
    uint c = 0;
    ulong m = 0;
    for (uint i = tid; i < V; i += threads) {
      const uint k = sample_key(logits[i]);
      if (k > lo) m += ulong(w[i] * scale);
      c += k == lo ? 1u : 0u;
    }
    const ulong before = tg_sum_u64(m, sl, simd_id, lane, n_simd);
    const uint n_at = tg_sum_u32(c, su, simd_id, lane, n_simd);
    // Tokens at key lo are kept while the mass before them stays below target.
    const ulong q = sample_weight(sample_key_value(lo), max_logit, inv_t, scale);
    uint n = n_at;
    if (q > 0) n = uint(min(ulong(n_at), (target - before + q - 1) / q));
    if (use_k && lo == v) n = min(n, n_eq);
    v = lo;
    n_eq = n;
  }
  // min-p: logit >= max + T log(min_p), compared as keys (0: off).
  const uint floor_key = a.use_min_p ? sample_key(max_logit + a.min_p_offset) : 0u;
  const ulong q_v = v >= floor_key ? sample_weight(sample_key_value(v), max_logit, inv_t, scale) : 0;

  // The draw, over contiguous id ranges so that running sums follow id order.
  threadgroup_barrier(mem_flags::mem_device);  // w[] of every thread is read below
  const uint chunk = (V + threads - 1) / threads, b = min(tid * chunk, V), e = min(b + chunk, V);
  uint my_eq = 0;
  for (uint i = b; i < e; ++i) my_eq += sample_key(logits[i]) == v ? 1u : 0u;
  eq_scan[tid] = my_eq;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    uint run = 0;
    for (uint j = 0; j < threads; ++j) {
      const uint c = eq_scan[j];
      eq_scan[j] = run;
      run += c;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint eq_before = eq_scan[tid];
  ulong mine = 0;
  for (uint i = b; i < e; ++i) {
    const uint k = sample_key(logits[i]);
    if (k > v && k >= floor_key) mine += ulong(w[i] * scale);
  }
  const uint eq_kept = n_eq > eq_before ? min(n_eq - eq_before, my_eq) : 0u;
  mine += ulong(eq_kept) * q_v;
  mass_scan[tid] = mine;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    ulong total = 0;
    for (uint j = 0; j < threads; ++j) total += mass_scan[j];
    ulong s[4] = {rng[0], rng[1], rng[2], rng[3]};
    const ulong t = sample_mulhi(sample_rng_next(s), total);
    for (uint j = 0; j < 4; ++j) rng[j] = s[j];
    ulong run = 0;
    uint owner = 0;
    for (uint j = 0; j < threads; ++j) {
      const ulong c = mass_scan[j];
      if (c > 0 && t < run + c) {
        owner = j;
        break;
      }
      run += c;
    }
    pick[0] = owner;
    pick[1] = t - run;  // t within the owner's range
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == uint(pick[0])) {
    const ulong t = pick[1];
    ulong run = 0;
    uint seen_eq = eq_before;
    int chosen = -1;
    for (uint i = b; i < e && chosen < 0; ++i) {
      const uint k = sample_key(logits[i]);
      ulong q = 0;
      if (k > v && k >= floor_key) q = ulong(w[i] * scale);
      else if (k == v) q = seen_eq++ < n_eq ? q_v : 0;
      if (t < run + q) chosen = int(i);
      run += q;
    }
    token[0] = chosen < 0 ? int(best) : chosen;  // (cannot happen: t < the range's mass)
    status[0] = LILY_SAMPLE_OK;
  }
}
