// Arguments of the attention family (metal/attention.metal), shared by host and kernels.
//
// Layouts: qg [T, Hq, 2D] = per head [query | output gate];  k, v [T, Hkv, D];
// cache K, V [Hkv, cap, D] f32 (one contiguous run of positions per KV head), or for long
// contexts fixed blocks of B positions: a block table [n_blocks] of (arena << 24 | slot) and up
// to LILY_ATTN_MAX_ARENAS arena buffers per K and V, each [slots, Hkv, B, D];
// o [T, Hq, D];  split partials o [T, Hq, n_splits, D] and (max, sum) [T, Hq, n_splits, 2].
#pragma once

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

// q, k <- RMSNorm(.) * gain, then rotate-half RoPE on the first `rot` dims; k, v -> cache.
struct AttnPrepareArgs {
  uint32_t D, rot, Hq, Hkv;
  uint32_t pos0;  // position of token 0 of the chunk
  uint32_t cap;   // cache capacity (positions); block layout: positions per block (B)
  float eps;
};

// Causal attention of T query tokens over the cache (positions [0, pos0 + t]).
struct AttnArgs {
  uint32_t D, Hq, Hkv;
  uint32_t cap;        // cache capacity (positions); block layout: positions per block (B)
  uint32_t pos0;
  uint32_t n_splits;   // 1: single pass, writes o; > 1: writes partials for attn_combine
  uint32_t split_len;  // positions per split
  float scale;         // 1 / sqrt(D)
};

static_assert(sizeof(AttnPrepareArgs) == 28, "AttnPrepareArgs: 7 fields of 4 bytes, as the kernels read them");
static_assert(sizeof(AttnArgs) == 32, "AttnArgs: 8 fields of 4 bytes, as the kernels read them");
