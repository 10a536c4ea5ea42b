// Arguments of the attention family (metal/attention.metal), shared by host and kernels.
//
// Layouts: qg [T, Hq, 2D] = per head [query | output gate];  k, v [T, Hkv, D];
// cache K, V [Hkv, cap, D] f32 (one contiguous run of positions per KV head), or for long
// contexts fixed blocks of B positions: a block table [n_blocks] of (arena << 24 | slot) and up
// to LILY_ATTN_MAX_ARENAS arena buffers per K and V, each [slots, Hkv, B, D];
// o [T, Hq, D];  split partials o [slot, Hq, max_splits, D] and (max, sum) [slot, Hq, max_splits, 2],
// one slot per decoding sequence of the pass.
#pragma once
#include "device_ptr.h"

#define LILY_ATTN_SIMDGROUPS 4   // simdgroups of an attn_decode threadgroup
#define LILY_ATTN_MAX_GROUP 16   // query heads per KV head (GQA packing)
#define LILY_ATTN_MAX_HEAD_DIM 256
// Query heads each simdgroup of attn_decode owns (its registers hold their q and accumulators).
#define LILY_ATTN_ROWS_PER_SIMDGROUP (LILY_ATTN_MAX_GROUP / LILY_ATTN_SIMDGROUPS)

// The head dims the attention kernels are instantiated for (a compile-time D keeps each lane's
// D/32 elements in registers): the Qwen3.5 / 3.6 / Next family's 256, and smaller ones for
// tests and tiny checkpoints. X(D) per head dim; the host checks a model's head_dim against it.
#define LILY_ATTN_HEAD_DIMS(X) X(64) X(96) X(128) X(256)
#define LILY_ATTN_COMBINE_COLUMNS 32  // value columns per attn_combine threadgroup (head dims are multiples)
#define LILY_ATTN_MAX_ARENAS 6   // block-layout arenas per K and per V (sizes double)

// One sequence of an attention dispatch: its rows of the pass, its position, its cache and its
// decode split. A dispatch walks a table of these (set_bytes, at most LILY_ATTN_MAX_SEQS), so a
// pass of several sequences runs each kernel once for all of them; the caches are reached by
// address (device_ptr.h). Rows: a dispatch's grid rows are its sequences' rows in table order
// (sequence 0's n rows, then sequence 1's, ...); `first` places them in the pass's activations.
struct AttnSeq {
  // Contiguous layout: k[0], v[0] are K, V [Hkv, cap, D]. Block layout: the arenas
  // [slots, Hkv, B, D] (unused entries 0) and the block table [n_blocks] (arena << 24 | slot).
  LILY_DEVICE_PTR(uchar) k[LILY_ATTN_MAX_ARENAS];
  LILY_DEVICE_PTR(uchar) v[LILY_ATTN_MAX_ARENAS];
  LILY_DEVICE_PTR(uint) table;
  uint32_t first;      // its first row in qg, k, v, o
  uint32_t n;          // its rows (tokens)
  uint32_t pos0;       // position of its first row
  uint32_t cap;        // contiguous: capacity (positions); blocks: positions per block (B)
  uint32_t n_splits;   // decode: 1 single pass (writes o), > 1 split-K partials for attn_combine
  uint32_t split_len;  // decode: positions per split
  uint32_t part;       // decode: its slot of the split-K partials
  uint32_t pad_;
};
#define LILY_ATTN_MAX_SEQS 8  // sequences per dispatch (a pass of several sequences holds at most 7 rows)

// q, k <- RMSNorm(.) * gain, then rotate-half RoPE on the first `rot` dims; k, v -> cache.
struct AttnPrepareArgs {
  uint32_t D, rot, Hq, Hkv;
  uint32_t n_seqs;  // entries of the sequence table
  float eps;
};

// Causal attention of each sequence's query rows over its cache (positions [0, pos0 + t]).
struct AttnArgs {
  uint32_t D, Hq, Hkv;
  uint32_t n_seqs;      // entries of the sequence table
  uint32_t max_splits;  // stride of the partials: part_o [slot, Hq, max_splits, D]
  float scale;          // 1 / sqrt(D)
};

static_assert(sizeof(AttnSeq) == 136, "AttnSeq: 13 addresses of 8 bytes and 8 fields of 4, as the kernels read them");
static_assert(sizeof(AttnPrepareArgs) == 24, "AttnPrepareArgs: 6 fields of 4 bytes, as the kernels read them");
static_assert(sizeof(AttnArgs) == 24, "AttnArgs: 6 fields of 4 bytes, as the kernels read them");
