// How the attention kernels address the KV cache (attention.metal, attention_prefill.metal):
// a policy maps (KV head, position) to the row's address, so each kernel body is written once
// for both layouts. A policy is built from the sequence's table entry (attention_args.h
// AttnSeq), which holds the cache's device addresses:
//   ContiguousCache  [Hkv, cap, D]: one contiguous run of positions per KV head (k[0], v[0])
//   BlockCache       fixed blocks of B positions: table[pos / B] = (arena << 24 | slot), each
//                    arena [slots, Hkv, B, D], up to LILY_ATTN_MAX_ARENAS of them
#pragma once
#include <metal_stdlib>
#include "attention_args.h"
using namespace metal;

template <typename KV>
struct ContiguousCache {
  device KV* base;
  uint cap, D;
  ContiguousCache(constant AttnSeq& s, bool values, uint, uint D_)
      : base(reinterpret_cast<device KV*>(values ? s.v[0] : s.k[0])), cap(s.cap), D(D_) {}
  device KV* row(uint hk, uint pos) const { return base + (ulong(hk) * cap + pos) * D; }
};

template <typename KV>
struct BlockCache {
  device uchar* constant* arena;  // the entry's k or v: [LILY_ATTN_MAX_ARENAS] addresses
  device const uint* table;
  uint B, Hkv, D;
  BlockCache(constant AttnSeq& s, bool values, uint Hkv_, uint D_)
      : arena(values ? s.v : s.k), table(s.table), B(s.cap), Hkv(Hkv_), D(D_) {}
  device KV* row(uint hk, uint pos) const {
    const uint e = table[pos / B];
    return reinterpret_cast<device KV*>(arena[e >> 24]) + ((ulong(e & 0xFFFFFFu) * Hkv + hk) * B + pos % B) * D;
  }
};

// The table entry of grid row `row` (a dispatch's rows are its sequences' rows in table order);
// `row` becomes the row's index within that sequence.
inline uint attn_seq_index(constant AttnSeq* seqs, uint n_seqs, thread uint& row) {
  uint i = 0;
  while (i + 1 < n_seqs && row >= seqs[i].n) {
    row -= seqs[i].n;
    ++i;
  }
  return i;
}
