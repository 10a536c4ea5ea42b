// How the attention kernels address the KV cache (attention.metal, attention_prefill.metal):
// a policy maps (KV head, position) to the row's address, so each kernel body is written once
// for both layouts (attention_args.h):
//   ContiguousCache  [Hkv, cap, D]: one contiguous run of positions per KV head
//   BlockCache       fixed blocks of B positions: table[pos / B] = (arena << 24 | slot), each
//                    arena [slots, Hkv, B, D], up to LILY_ATTN_MAX_ARENAS of them
#pragma once
#include <metal_stdlib>
#include "attention_args.h"
using namespace metal;

// Cache rows [Hkv, cap, D]: one contiguous run of positions per KV head.
template <typename KV>
struct ContiguousCache {
  device KV* base;
  uint cap, D;
  device KV* row(uint hk, uint pos) const { return base + (ulong(hk) * cap + pos) * D; }
};

// Fixed blocks of B positions: table[pos / B] = (arena << 24 | slot), arena [slots, Hkv, B, D].
template <typename KV>
struct BlockCache {
  device KV* arena[LILY_ATTN_MAX_ARENAS];
  device const uint* table;
  uint B, Hkv, D;
  device KV* row(uint hk, uint pos) const {
    const uint e = table[pos / B];
    return arena[e >> 24] + ((ulong(e & 0xFFFFFFu) * Hkv + hk) * B + pos % B) * D;
  }
};

