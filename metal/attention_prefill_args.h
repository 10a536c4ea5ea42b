// Arguments of the attention prefill family (metal/attention_prefill.metal), shared by host and
// kernels. Layouts as in attention_args.h: qg [T, Hq, 2D] (query | output gate), cache K, V
// [Hkv, cap, D] of the cache's element type, o [T, Hq, D].
#pragma once
#include "attention_args.h"  // LILY_ATTN_HEAD_DIMS

#define LILY_ATTN_PF_SIMDGROUPS 8   // simdgroups of an attn_prefill threadgroup, 8 query rows each
#define LILY_ATTN_PF_THREADS (32 * LILY_ATTN_PF_SIMDGROUPS)  // 256: the kernels declare it
#define LILY_ATTN_PF_ROWS (8 * LILY_ATTN_PF_SIMDGROUPS)     // query rows (token, head) per threadgroup
#define LILY_ATTN_PF_KV_TILE 8      // cache positions per K/V tile in threadgroup memory
#define LILY_ATTN_PF_MAX_HEAD_DIM 256

// Causal attention of a chunk's T query tokens (positions pos0 .. pos0 + T - 1, already in the
// cache) over the cache positions [0, pos0 + t]; the chunk's rows, position and cache are its
// table entry (attention_args.h AttnSeq: first, n = T, pos0, the cache's addresses).
struct AttnPrefillArgs {
  uint32_t D, Hq, Hkv;
  uint32_t tile_tokens;  // query tokens per threadgroup: LILY_ATTN_PF_ROWS / (Hq / Hkv), >= 1
  float scale;           // 1 / sqrt(D)
};

static_assert(sizeof(AttnPrefillArgs) == 20, "AttnPrefillArgs: 5 fields of 4 bytes, as the kernels read them");
