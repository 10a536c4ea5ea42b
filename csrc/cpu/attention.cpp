#include "cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "cpu/linear.h"
#include "cpu/norm.h"
#include "cpu/simd.h"

namespace lily::cpu {

// Capacity doubles, and always leaves room for one position more than asked: the token that
// follows. Why: a prompt of a power-of-two length (512, 4096) filled its cache exactly, and the
// first decode step then regrew it, copying the whole cache into freshly faulted pages (the
// medium model on the 2-core VM: the first decode step after 4096 positions took 35-47 ms
// against ~10). The capacity never changes a result (blocks are read by position).
void KvCache::reserve(int positions, int max_positions) {
  if (positions < capacity) return;
  int cap = std::max(capacity, 256);
  while (cap <= positions) cap *= 2;
  cap = std::min(cap, (max_positions + kKvBlock - 1) / kKvBlock * kKvBlock);  // whole K blocks
  if (cap <= capacity) return;  // at max_positions already
  HugeFloats nk(size_t(kv_heads) * cap * head_dim), nv(nk.size());
  for (int hh = 0; hh < kv_heads && capacity > 0; ++hh) {
    std::memcpy(nk.data() + size_t(hh) * cap * head_dim, k.data() + size_t(hh) * capacity * head_dim,
                size_t(capacity) * head_dim * sizeof(float));
    std::memcpy(nv.data() + size_t(hh) * cap * head_dim, v.data() + size_t(hh) * capacity * head_dim,
                size_t(capacity) * head_dim * sizeof(float));
  }
  k.swap(nk);
  v.swap(nv);
  capacity = cap;
}

// (Both layouts keep a head's positions in one run of capacity * head_dim floats, block by
// block for K, so reserve's copies above move whole blocks.)
void KvCache::put_k(int head, int pos, const float* row) {
  float* blk = k.data() + (size_t(head) * capacity + size_t(pos / kKvBlock) * kKvBlock) * head_dim;
  for (int d = 0; d < head_dim; ++d) blk[size_t(d) * kKvBlock + pos % kKvBlock] = row[d];
}

void KvCache::get_k(int head, int pos, float* row) const {
  const float* blk = k_block(head, pos / kKvBlock);
  for (int d = 0; d < head_dim; ++d) row[d] = blk[size_t(d) * kKvBlock + pos % kKvBlock];
}

namespace {

// Rotate-half RoPE on x[0 .. rot): pairs (i, i + rot/2) turn by angle pos * inv_freq[i].
void rope(float* x, int rot, const float* cos, const float* sin) {
  const int half = rot / 2;
  for (int i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i] + a * sin[i];
  }
}

// ---- causal GQA attention of a chunk over the cache, flash-style -------------------------------
//
// The naive loop (one task per token and query head, each streaming its KV head's whole cache)
// reads K and V from DRAM Hq * T times per chunk: at 32K positions that is 64 MB per (token,
// head) and made long prompts crawl. Here a work item is (KV head, tile of kQTile tokens); its
// rows are the tile's tokens x the query heads sharing the KV head (GQA packing), so each K/V
// block, once in L2, serves group x kQTile rows. Blocks of kBlock positions are folded into each
// row's online-softmax state (running max m, running sum l, unnormalised o), in fp32, so the
// result is softmax(qK^T)V up to summation order.
//
// One order per row. The positions are cut into fixed spans of kSpan from position 0; a span's
// blocks are folded into a fresh state, and the spans' states are merged in ascending order
// (merge_span). Spans, blocks and the merge depend on the row's position alone, never on the
// chunk length, the tile, the thread count or the other sequences sharing the pass, so a token's
// attention output is bit-identical however its prompt was chunked, cached or batched. Decode
// and short chunks have too few (head, tile) items to feed every thread: there each (head, tile,
// span) is an item of its own, and the last of a (head, tile)'s spans to finish merges their
// states in the same order (split-K) -- the same operations, run by more threads, in one
// parallel region (a merge pass of its own cost a second barrier per layer).
//
// Tiles are cut per sequence (a tile never mixes sequences: each reads its own cache).
//   qg [T, Hq, 2D] (q, then the output gate)   K, V [Hkv, capacity, D]   o [T, Hq, D]
//   item rows r = (t - t0) * group + g  <->  query head hq = hk * group + g  (t: row in the sequence)
constexpr int kBlock = kKvBlock;  // positions per K/V block: 32 KB of K + 32 KB of V at D = 256
constexpr int kQTile = 16;  // chunk tokens per work item
constexpr int kSpan = 8 * kBlock;  // positions per span (the unit of split-K)
static_assert(kSpan % kBlock == 0, "spans are whole blocks");

// Micro-kernels over one block of kBlock positions for NR rows at a time. The block's keys are
// stored transposed, kt [D, kBlock] (KvCache), so scores need no horizontal sums: for each d, one
// broadcast of q[r][d] times a row of kt, for NR rows sharing the loads (FMA-bound on AVX-512
// rather than L2-bound as a dot per (row, position) is). Rows come 8 at a time where there are
// 8 (a decode token's 8 query heads of one KV head; prefill tiles): with 16 accumulators in
// flight the FMA units stay busy, where 4 rows (8 accumulators) ran at half the FMA rate on the
// CI-class Zen 4 (benchmarks/kernels/attention_bench.cpp, docs/performance.md). With 16 ymm
// (AVX2) the accumulators are 8 vectors, so the block's positions (qk) or dims (pv) are taken in
// narrower slices. NR never changes a row's result: each row's sums run the same operations in
// the same order whatever rows share the call, and they are axpy's (the vector-less fallback).
//
// Each kernel also asks for the NEXT block of the same stream (keys in qk_block, values in
// pv_block) to be brought into L2, spread over its loop: exactly one block ahead (a K block is
// D x 128 bytes, two lines per d; a V block's n x D floats are W lines per (slice, position)
// step). Why: in decode each block comes from DRAM and is used once, and without it the
// loads of a block waited on memory at a third of one core's streaming rate. `next` is null
// when there is no next block, and for all but the first row group of a block (the others
// find it in L2 already).
// And the block being read is asked into L1 a few steps ahead of its loads (near_l1): keys kNearK
// dims on, values kNearV positions on. Why: the loads still waited on L2 (the instruction after
// each K and V load held most of a profile's samples); on the 2-core Xeon VM the decode step's
// attention at 4K positions ran ~3% faster with it (docs/performance.md, "Attention's stalls").
inline void prefetch_lines(const char*& next, int lines) {
  for (int i = 0; i < lines; ++i) __builtin_prefetch(next + 64 * i, 0, 2);  // 2: prefetcht1 (L2), as linear_int8
  next += 64 * lines;
}
constexpr int kNearK = 16, kNearV = 6;
inline void near_l1(const float* p, int floats) {
  for (int i = 0; i < floats; i += 16) __builtin_prefetch(p + i, 0, 3);  // 3: prefetcht0 (L1)
}

// Vector accumulators a micro-kernel keeps in registers: 16 of the 32 zmm (AVX-512) or NEON
// registers, 8 of the 16 ymm (AVX2), the rest holding the loaded K / V vectors and broadcasts.
#if defined(__AVX512F__) || defined(__ARM_NEON)
constexpr int kAccVecs = 16;
#else
constexpr int kAccVecs = 8;
#endif

// s[r, j] = q_r · k_j   for j < kBlock
// Positions in slices of C vectors, NR x C accumulators (AVX-512: the whole block, C = 2).
template <int NR>
void qk_block(const float* const* q, const float* kt, int D, float* s, const char* next) {
#if defined(LILY_FVEC)
  constexpr int W = FVec::kWidth, C = std::max(1, std::min(kBlock / W, kAccVecs / NR));
  static_assert(kBlock % (C * W) == 0, "slices tile the block");
  static_assert(kBlock == 32, "a K block row is two lines (the prefetch)");
  for (int j0 = 0; j0 < kBlock; j0 += C * W) {
    FVec acc[NR][C];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = FVec::zero();
    for (int d = 0; d < D; ++d) {
      if (next && j0 == 0) prefetch_lines(next, 2);
      if (d + kNearK < D) near_l1(kt + (d + kNearK) * kBlock + j0, C * W);
      FVec k[C];
      for (int c = 0; c < C; ++c) k[c] = FVec::load(kt + d * kBlock + j0 + c * W);
      for (int r = 0; r < NR; ++r) {
        const FVec qd = FVec::splat(q[r][d]);
        for (int c = 0; c < C; ++c) acc[r][c] = fmadd(qd, k[c], acc[r][c]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < C; ++c) acc[r][c].store(s + r * kBlock + j0 + c * W);
  }
#else
  for (int r = 0; r < NR; ++r) {
    float* sr = s + r * kBlock;
    for (int j = 0; j < kBlock; ++j) sr[j] = 0.0f;
    for (int d = 0; d < D; ++d) {
      if (next && r == 0) prefetch_lines(next, 2);
      axpy(q[r][d], kt + d * kBlock, sr, kBlock);
    }
  }
#endif
}

// o_r = o_r * alpha_r + sum_{j < n} p[r, j] v_j, v_j = v + j * D (the block's values)
// Rows whose causal limit lies before the block (active[r] false) are left untouched.
template <int NR>
void pv_block(const float* p, const float* v, int n, int D, float* const* o, const float* alpha, const bool* active,
              const char* next) {
  int d0 = 0;
#if defined(LILY_FVEC)
  // kWide vectors of dims of NR rows in registers across the block (NR x kWide accumulators),
  // then 1-vector slices. `next`: the next block's n x D floats, spread over the steps.
  // Each FMA names its value vector by address, not through an array of loaded vectors: with
  // the array GCC 12 kept the loaded vectors on the stack and every FMA re-read them there (the
  // load ports, not the FMAs, set the pace). attention_bench, Zen 5 VM, one thread, 4K positions
  // in cache: 0.50 against 0.66-0.75 ms a decode step (clang, with the array: 0.55-0.59); a
  // 64-token prefill chunk 27 against 40 ms. The same FMAs in the same order: results unchanged.
  constexpr int W = FVec::kWidth, kWide = std::max(1, std::min(4, kAccVecs / NR));
  auto slice = [&](auto width) {
    constexpr int S = decltype(width)::value;
    // A step reads S * W floats; the prefetch keeps pace with it, a line at a time.
    constexpr int kStepBytes = S * W * 4, kEvery = kStepBytes >= 64 ? 1 : 64 / kStepBytes;
    FVec acc[NR][S];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < S; ++c) acc[r][c] = FVec::splat(alpha[r]) * FVec::load(o[r] + d0 + W * c);
    for (int j = 0; j < n; ++j) {
      if (next && j % kEvery == 0) prefetch_lines(next, std::max(1, kStepBytes / 64));
      const float* vrow = v + size_t(j) * D + d0;
      if (j + kNearV < n) near_l1(vrow + kNearV * D, S * W);
      for (int r = 0; r < NR; ++r) {
        const FVec pj = FVec::splat(p[r * kBlock + j]);
        for (int c = 0; c < S; ++c) acc[r][c] = fmadd(pj, FVec::load(vrow + W * c), acc[r][c]);
      }
    }
    for (int r = 0; r < NR; ++r)
      if (active[r])
        for (int c = 0; c < S; ++c) acc[r][c].store(o[r] + d0 + W * c);
    d0 += W * S;
  };
  while (d0 + W * kWide <= D) slice(std::integral_constant<int, kWide>{});
  while (d0 + W <= D) slice(std::integral_constant<int, 1>{});
#endif
  if (d0 == D) return;
  const int tail_lines = (D - d0 + 15) / 16;  // of each next-block position's dims [d0, D)
  for (int r = 0; r < NR; ++r) {
    if (!active[r]) continue;
    scale(alpha[r], o[r] + d0, D - d0);
    for (int j = 0; j < n; ++j) {
      if (next) prefetch_lines(next, tail_lines);
      axpy(p[r * kBlock + j], v + size_t(j) * D + d0, o[r] + d0, D - d0);
    }
    next = nullptr;  // the first active row asked for them all
  }
}

// Per-thread working set of one work item.
struct SpanScratch {
  std::vector<float> scores;  // [NR <= 8, kBlock]
};

// Folds positions [p0, p1) of KV head hk into the rows' online-softmax state (m, l, o rows);
// row r sees positions < lim[r]. Rows come NR at a time; rows of a group may have different
// causal limits inside the block, so each masks its own tail.
// next_k, next_v: the next block's keys and values to prefetch, or null.
template <int NR>
void attend_rows(KvCache& cache, int hk, const float* const* q, const int* lim, const float* kt, int b, int bend,
                 float scale_qk, float* m, float* l, float* const* o, float* s, const float* next_k,
                 const float* next_v) {
  const int D = cache.head_dim;
  qk_block<NR>(q, kt, D, s, reinterpret_cast<const char*>(next_k));
  float alpha[NR];
  bool active[NR];
  int n_max = 0;
  for (int r = 0; r < NR; ++r) {
    float* sr = s + r * kBlock;
    const int n = std::min(bend, lim[r]) - b;
    active[r] = n > 0;
    if (n <= 0) {  // this row's causal limit is before the block
      alpha[r] = 1.0f;
      std::fill(sr, sr + kBlock, 0.0f);
      continue;
    }
    const float mx = scale_max(sr, n, scale_qk, m[r]);
    alpha[r] = std::exp(m[r] - mx);  // 0 on the row's first block (m = -inf)
    l[r] = l[r] * alpha[r] + exp_shift_sum(sr, n, mx);
    m[r] = mx;
    std::fill(sr + n, sr + kBlock, 0.0f);
    n_max = std::max(n_max, n);
  }
  if (n_max > 0) pv_block<NR>(s, cache.v_at(hk, b), n_max, D, o, alpha, active, reinterpret_cast<const char*>(next_v));
}

// Positions below read_end may be prefetched (the item's last causal limit: past the span, the
// same thread usually walks the next span next).
void attend_span(KvCache& cache, int hk, const float* const* q, const int* lim, int R, int p0, int p1, int read_end,
                 float scale_qk, float* m, float* l, float* const* o, SpanScratch& ss) {
  ss.scores.resize(8 * kBlock);
  for (int b = p0; b < p1; b += kBlock) {  // p0 is a span start: blocks are the cache's K blocks
    const int bend = std::min(b + kBlock, p1);
    // Positions of the block at or past p1 (unwritten, or left by a rewound sequence) are scored
    // too, and every row masks them (attend_rows): their keys never reach a result.
    const float* kt = cache.k_block(hk, b / kBlock);
    const bool ahead = b + kBlock < read_end;
    const float* next_k = ahead ? cache.k_block(hk, b / kBlock + 1) : nullptr;
    const float* next_v = ahead ? cache.v_at(hk, b + kBlock) : nullptr;
    auto rows = [&](auto nr, int r) {
      constexpr int NR = decltype(nr)::value;
      attend_rows<NR>(cache, hk, q + r, lim + r, kt, b, bend, scale_qk, m + r, l + r, o + r, ss.scores.data(),
                      r == 0 ? next_k : nullptr, r == 0 ? next_v : nullptr);
    };
    int r = 0;
    for (; r + 8 <= R; r += 8) rows(std::integral_constant<int, 8>{}, r);
    for (; r + 4 <= R; r += 4) rows(std::integral_constant<int, 4>{}, r);
    for (; r < R; ++r) rows(std::integral_constant<int, 1>{}, r);
  }
}

// (M, L, O) <- (M, L, O) merged with one span's state (m, l, o), all unnormalised. The first
// span a row sees enters as itself (M = -inf: a = 0, b = 1); a span wholly after the row's
// causal limit (m = -inf) adds nothing.
void merge_span(float& M, float& L, float* O, float m, float l, const float* o, int D) {
  if (m == -INFINITY) return;
  const float Mn = std::max(M, m), a = std::exp(M - Mn), b = std::exp(m - Mn);
  L = L * a + l * b;
  for (int d = 0; d < D; ++d) O[d] = O[d] * a + o[d] * b;
  M = Mn;
}

// Memory bound of the split-K partial states (floats): past it the items walk their spans.
constexpr size_t kMaxPartialFloats = size_t(16) << 20;

// The plan entry whose range [key(p), key(next)) holds x: keys ascend over the plans, and a
// plan with an empty range shares its key with the next one, so the last plan at or below x is
// the one that holds it.
template <class Key>
int plan_of(const std::vector<AttendPlan>& plan, int64_t x, Key key) {
  int lo = 0, hi = int(plan.size());  // the first plan whose key is > x, by bisection
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (key(plan[mid]) <= x) lo = mid + 1;
    else hi = mid;
  }
  return lo - 1;
}

// Every sequence of the pass attends over its own cache; one item space holds all of their
// items, so a batch of decode rows (one tile each) shares out over the threads in one region.
void attend(const KvRows* seqs, int n_seqs, const float* qg, int Hq, int D, AttentionScratch& s, ThreadPool& pool) {
  const int Hkv = seqs[0].cache->kv_heads, group = Hq / Hkv;
  const float scale_qk = 1.0f / std::sqrt(float(D));
  std::vector<AttendPlan>& plan = s.plan;
  plan.resize(n_seqs);
  int64_t base_items = 0;
  for (int i = 0; i < n_seqs; ++i) base_items += int64_t(Hkv) * ((seqs[i].n + kQTile - 1) / kQTile);
  int64_t n_items = 0, groups = 0;
  size_t parts = 0;  // split-K partial rows: per split sequence [n_spans, n, Hq]
  for (int i = 0; i < n_seqs; ++i) {
    const KvRows& q = seqs[i];
    AttendPlan& p = plan[i];
    p.n_tiles = (q.n + kQTile - 1) / kQTile;
    p.n_spans = (q.pos0 + q.n + kSpan - 1) / kSpan;
    const size_t need = size_t(p.n_spans) * q.n * Hq;
    // Speed only (both ways run the same operations per row): one item per span when the
    // pass's (head, tile) items cannot keep every thread busy and the spans' states stay small.
    p.split = p.n_spans > 1 && base_items < 2 * pool.size() && (parts + need) * (D + 2) <= kMaxPartialFloats;
    p.item0 = n_items;
    p.part0 = parts;
    p.group0 = groups;
    n_items += int64_t(Hkv) * p.n_tiles * (p.split ? p.n_spans : 1);
    if (p.split) {
      parts += need;
      groups += int64_t(Hkv) * p.n_tiles;
    }
  }
  if (parts) {
    s.part_ml.resize(parts * 2);
    s.part_o.resize(parts * D);
    // Counters, zeroed here and published to the workers by parallel_for's start.
    if (s.spans_done.size() < size_t(groups)) s.spans_done = std::vector<std::atomic<int>>(size_t(groups));
    for (int64_t g = 0; g < groups; ++g) s.spans_done[size_t(g)].store(0, std::memory_order_relaxed);
  }
  float* out = s.o.data();

  pool.parallel_for(n_items, [&](int64_t i0, int64_t i1, int) {
    thread_local std::vector<float> m, l, o, M, L, O;
    thread_local std::vector<const float*> q;
    thread_local std::vector<float*> orows;
    thread_local SpanScratch ss;
    thread_local std::vector<int> lim;
    for (int64_t item = i0; item < i1; ++item) {
      const int seq = plan_of(plan, item, [](const AttendPlan& p) { return p.item0; });
      const KvRows& sq = seqs[seq];
      const AttendPlan& p = plan[seq];
      KvCache& cache = *sq.cache;
      const int pos0 = sq.pos0, n = sq.n, first = sq.first;
      const int64_t local = item - p.item0, items_per_tile = p.split ? p.n_spans : 1;
      const int span = int(local % items_per_tile), tile = int(local / items_per_tile % p.n_tiles);
      const int hk = int(local / items_per_tile / p.n_tiles);
      const int t0 = tile * kQTile, t1 = std::min(n, t0 + kQTile), R = (t1 - t0) * group;  // the sequence's rows
      const int tile_end = pos0 + t1;  // the tile's last causal limit
      q.resize(R);
      orows.resize(R);
      lim.resize(R);
      for (int t = t0; t < t1; ++t)
        for (int g = 0; g < group; ++g) {
          const int r = (t - t0) * group + g;
          q[r] = qg + (size_t(first + t) * Hq + hk * group + g) * 2 * D;
          lim[r] = pos0 + t + 1;  // causal: this token and everything before it
        }
      // One span [p0, p1) folded into a fresh state (m, l, o).
      auto run_span = [&](int p0) {
        m.assign(R, -INFINITY);
        l.assign(R, 0.0f);
        o.assign(size_t(R) * D, 0.0f);
        for (int r = 0; r < R; ++r) orows[r] = o.data() + size_t(r) * D;
        const int p1 = std::min(tile_end, p0 + kSpan);
        if (p0 < p1)
          attend_span(cache, hk, q.data(), lim.data(), R, p0, p1, tile_end, scale_qk, m.data(), l.data(), orows.data(), ss);
      };
      if (p.split) {
        run_span(span * kSpan);
        for (int t = t0; t < t1; ++t)
          for (int g = 0; g < group; ++g) {
            const int r = (t - t0) * group + g;
            const size_t prow = p.part0 + size_t(span) * n * Hq + size_t(t) * Hq + hk * group + g;
            s.part_ml[prow * 2] = m[r];
            s.part_ml[prow * 2 + 1] = l[r];
            std::memcpy(s.part_o.data() + prow * D, o.data() + size_t(r) * D, D * sizeof(float));
          }
        // The (head, tile)'s last span to finish merges its rows' span states, in ascending
        // span order as a walking item folds them (so the result does not depend on which
        // thread merges). acq_rel: it sees every other span's partial rows.
        std::atomic<int>& done = s.spans_done[size_t(p.group0 + int64_t(hk) * p.n_tiles + tile)];
        if (done.fetch_add(1, std::memory_order_acq_rel) == p.n_spans - 1)
          for (int t = t0; t < t1; ++t)
            for (int g = 0; g < group; ++g) {
              const size_t row = size_t(t) * Hq + hk * group + g;  // t * Hq + hq in the sequence
              float Mr = -INFINITY, Lr = 0;
              O.assign(D, 0.0f);
              for (int sp = 0; sp < p.n_spans; ++sp) {
                const size_t prow = p.part0 + size_t(sp) * n * Hq + row;
                merge_span(Mr, Lr, O.data(), s.part_ml[prow * 2], s.part_ml[prow * 2 + 1], s.part_o.data() + prow * D, D);
              }
              const float inv = 1.0f / Lr;
              float* orow = out + (size_t(first) * Hq + row) * D;
              for (int d = 0; d < D; ++d) orow[d] = O[d] * inv;
            }
        continue;
      }
      M.assign(R, -INFINITY);
      L.assign(R, 0.0f);
      O.assign(size_t(R) * D, 0.0f);
      for (int p0 = 0; p0 < tile_end; p0 += kSpan) {
        run_span(p0);
        for (int r = 0; r < R; ++r) merge_span(M[r], L[r], O.data() + size_t(r) * D, m[r], l[r], o.data() + size_t(r) * D, D);
      }
      for (int t = t0; t < t1; ++t)
        for (int g = 0; g < group; ++g) {
          const int r = (t - t0) * group + g;
          const float inv = 1.0f / L[r];
          float* orow = out + (size_t(first + t) * Hq + hk * group + g) * D;
          for (int d = 0; d < D; ++d) orow[d] = O[size_t(r) * D + d] * inv;
        }
    }
  });
}

}  // namespace

void attention_mixer(const ModelConfig& c, const AttentionWeights& w, const KvRows* seqs, int n_seqs, const float* h,
                     int T, float* y, AttentionScratch& s, ThreadPool& pool) {
  const int Hq = c.n_heads, Hkv = c.n_kv_heads, D = c.head_dim, rot = c.rotary_dim, half = rot / 2;
  s.qg.resize(size_t(T) * Hq * 2 * D);
  s.k.resize(size_t(T) * Hkv * D);
  s.v.resize(size_t(T) * Hkv * D);
  s.o.resize(size_t(T) * Hq * D);
  const LinearJob qkv[3] = {{&w.q_proj, h, s.qg.data()}, {&w.k_proj, h, s.k.data()}, {&w.v_proj, h, s.v.data()}};
  linear_group(qkv, 3, T, pool, s.matmul);

  // RoPE tables for each row's own position (its sequence's pos0 + its offset in the sequence).
  // inv_freq and the angle are rounded to f32 the way the reference computes them, so
  // long-context angles agree.
  s.row_seq.resize(T);
  for (int i = 0; i < n_seqs; ++i) std::fill_n(s.row_seq.begin() + seqs[i].first, seqs[i].n, i);
  auto position = [&](int64_t t) { const KvRows& q = seqs[s.row_seq[t]]; return q.pos0 + int(t - q.first); };
  s.rope_cos.resize(size_t(T) * half);
  s.rope_sin.resize(size_t(T) * half);
  const std::vector<float> inv_freq = c.rope_inv_freq();
  for (int i = 0; i < half; ++i) {
    for (int t = 0; t < T; ++t) {
      const float angle = float(position(t)) * inv_freq[i];
      s.rope_cos[size_t(t) * half + i] = std::cos(angle);
      s.rope_sin[size_t(t) * half + i] = std::sin(angle);
    }
  }

  // Normalise + rotate q and k in place; append k, v to the row's sequence's cache.
  pool.parallel_for(T, [&](int64_t t0, int64_t t1, int) {
    for (int64_t t = t0; t < t1; ++t) {
      KvCache& cache = *seqs[s.row_seq[t]].cache;
      const int pos = position(t);
      const float* cs = s.rope_cos.data() + size_t(t) * half;
      const float* sn = s.rope_sin.data() + size_t(t) * half;
      for (int hq = 0; hq < Hq; ++hq) {
        float* q = s.qg.data() + (size_t(t) * Hq + hq) * 2 * D;
        rms_norm(q, w.q_norm.data(), D, c.rms_eps, q);
        rope(q, rot, cs, sn);
      }
      for (int hk = 0; hk < Hkv; ++hk) {
        float* k = s.k.data() + (size_t(t) * Hkv + hk) * D;
        rms_norm(k, w.k_norm.data(), D, c.rms_eps, k);
        rope(k, rot, cs, sn);
        cache.put_k(hk, pos, k);
        std::memcpy(cache.v_at(hk, pos), s.v.data() + (size_t(t) * Hkv + hk) * D, D * sizeof(float));
      }
    }
  });

  attend(seqs, n_seqs, s.qg.data(), Hq, D, s, pool);
  // o *= sigmoid(gate), per query head
  pool.parallel_for(int64_t(T) * Hq, [&](int64_t i0, int64_t i1, int) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* gate = s.qg.data() + size_t(i) * 2 * D + D;
      float* o = s.o.data() + size_t(i) * D;
      map_elementwise(o, size_t(D), [](auto od, auto g) { return od * sigmoid(g); }, o, gate);
    }
  });

  linear(w.o_proj, s.o.data(), T, y, pool, s.matmul);
}

}  // namespace lily::cpu
