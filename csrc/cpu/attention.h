// Gated full attention (Qwen3.5 / Qwen3-Next) over a growing KV cache.
//
//   [q | gate] = q_proj(h) per head;  k = k_proj(h);  v = v_proj(h)
//   q, k <- per-head zero-centred RMSNorm, then RoPE on the first rotary_dim dims (rotate-half)
//   o = softmax(q k^T / sqrt(head_dim), causal) v     (GQA: n_heads / n_kv_heads queries per KV head)
//   y = o_proj(o * sigmoid(gate))
//
// A pass may hold several sequences (KvRows segments, back to back over its rows): the
// projections run over all T rows at once; RoPE, the cache append and the attention itself run
// each segment against its own cache from its own position.
//
// Shapes: T rows in the pass, P = a sequence's cached positions before it, Hq/Hkv heads,
// D = head_dim.
//   h [T, hidden]  qg [T, Hq, 2D]  k, v [T, Hkv, D]  cache K, V [Hkv, capacity, D]  o [T, Hq, D]
#pragma once
#include <atomic>
#include <vector>

#include "cpu/linear.h"
#include "cpu/thread_pool.h"
#include "model/pages.h"
#include "model/weights.h"

namespace lily::cpu {

// Keys and values of one attention layer, f32, one contiguous [capacity, D] run per KV head
// so a head's scan over the past is a linear walk. Grows geometrically up to the state's
// max_context, so short conversations hold little memory.
// K is kept as the attention kernels read it: in blocks of kKvBlock positions, each transposed
// ([head_dim, kKvBlock]: element (pos, d) at d * kKvBlock + pos % kKvBlock), so scoring a block
// needs no transpose. (Each step used to transpose every block of the context again: on the
// medium model, one thread, a decode token at a 4K context cost 3.4 ms more than at 512, and
// 2.3 ms more with K stored transposed; A/B of the two builds alternated in one session.)
// V stays row-major.
constexpr int kKvBlock = 32;

struct KvCache {
  int kv_heads = 0, head_dim = 0, capacity = 0;  // capacity: a multiple of kKvBlock
  HugeFloats k;  // [kv_heads, capacity / kKvBlock, head_dim, kKvBlock]
  HugeFloats v;  // [kv_heads, capacity, head_dim]

  void reserve(int positions, int max_positions);
  // The transposed K block holding positions [block * kKvBlock, (block + 1) * kKvBlock).
  const float* k_block(int head, int block) const {
    return k.data() + (size_t(head) * capacity + size_t(block) * kKvBlock) * head_dim;
  }
  void put_k(int head, int pos, const float* row);  // row [head_dim] -> position pos
  void get_k(int head, int pos, float* row) const;  // position pos -> row [head_dim]
  float* v_at(int head, int pos) { return v.data() + (size_t(head) * capacity + pos) * head_dim; }
};

// Rows [first, first + n) of the pass extend `cache` from position pos0 (one sequence).
struct KvRows {
  KvCache* cache = nullptr;
  int pos0 = 0, first = 0, n = 0;
};

// How attend() cuts one sequence's rows into work items (attention.cpp).
struct AttendPlan {
  int n_tiles = 0, n_spans = 0;
  bool split = false;     // one item per (head, tile, span); a (head, tile)'s last span merges them
  int64_t item0 = 0;      // the sequence's first item in the pass's item space
  size_t part0 = 0;       // its first split-K partial row (split only)
  int64_t group0 = 0;     // its first (head, tile) span counter (split only)
};

struct AttentionScratch {
  Matmul matmul = Matmul::F32;  // the backend's choice for the projections
  std::vector<float> qg, k, v, o, rope_cos, rope_sin;
  std::vector<float> part_ml, part_o;  // split-K span states: per split sequence [spans, n, Hq] (m, l), [.., D] o
  std::vector<AttendPlan> plan;        // [sequences]
  std::vector<std::atomic<int>> spans_done;  // per split (sequence, head, tile): spans finished
  std::vector<int> row_seq;            // [T]: the sequence each row belongs to
};

// seqs [n_seqs]: back to back over the T rows from row 0; each cache already holds room for
// pos0 + n positions (KvCache::reserve: the backend grows them all before a pass changes any).
void attention_mixer(const ModelConfig& c, const AttentionWeights& w, const KvRows* seqs, int n_seqs, const float* h,
                     int T, float* y, AttentionScratch& s, ThreadPool& pool);

}  // namespace lily::cpu
