// The fixed-block KV layout of long contexts (GpuOptions::block_threshold, block_len).
//
// Design choices:
// - A cache in blocks of B positions, [slots, Hkv, B, D] per arena: one block of one KV head is
//   B * D contiguous elements, so a split of split-K reads whole contiguous runs.
// - Growth never copies the cache: a longer context allocates one more arena (each twice the
//   size of the one before, at most LILY_ATTN_MAX_ARENAS, never past max_context) and extends
//   the block table; the rows already cached stay where they are. (The contiguous layout
//   doubles its buffer and copies every row, which at 128K means GBs per growth.)
// - The block table (logical block -> arena << 24 | slot) is one small buffer shared by every
//   attention layer (all layers grow alike). It is the indirection a block allocator needs to
//   share blocks between sequences later; today blocks are handed out in order.
// - A state switches layout once, when a pass would take it to block_threshold: its
//   contiguous rows are copied into the first arena (between passes: nothing is in flight).
//   Short contexts keep the contiguous layout and its simpler addressing.
#include <algorithm>
#include <cstring>
#include <string>

#include "gpu/backend.h"
#include "gpu/encode.h"
#include "metal/attention_args.h"
#include "model/error.h"

namespace lily::gpu {

void GpuBackend::reserve_blocks(GpuState& st, int positions) {
  if (st.block_len && positions <= st.capacity) return;
  const int B = options_.block_len;
  const int max_blocks = (std::max(st.max_context(), positions) + B - 1) / B;
  const int need = (positions + B - 1) / B;
  const bool convert = st.block_len == 0;
  if (convert) {
    st.block_len = B;
    st.block_table = device_->new_buffer(size_t(max_blocks) * 4);
    st.k_arenas.assign(c_.n_layers(), {});
    st.v_arenas.assign(c_.n_layers(), {});
    st.arena_slots.clear();
  }
  int have = 0;
  for (int n : st.arena_slots) have += n;
  const size_t block_bytes = size_t(c_.n_kv_heads) * B * c_.head_dim * (options_.kv_half ? 2 : 4);
  auto* table = static_cast<uint32_t*>(st.block_table->contents());
  while (have < need) {
    const int a = int(st.arena_slots.size());
    if (a == LILY_ATTN_MAX_ARENAS)
      throw ConfigError("[gpu] the block KV cache ran out of arenas at " + std::to_string(positions) +
                        " positions: raise block_len");
    // Twice the previous arena (the first: twice what is needed now), never past max_context.
    int n = a == 0 ? 2 * need : 2 * st.arena_slots.back();
    n = std::max(1, std::min(n, max_blocks - have));
    for (int l = 0; l < c_.n_layers(); ++l) {
      if (c_.mixers[l] != Mixer::Attention) continue;
      st.k_arenas[l].push_back(device_->new_buffer(size_t(n) * block_bytes));
      st.v_arenas[l].push_back(device_->new_buffer(size_t(n) * block_bytes));
    }
    if (table)
      for (int s = 0; s < n; ++s) table[have + s] = uint32_t(a) << 24 | uint32_t(s);
    st.arena_slots.push_back(n);
    have += n;
  }
  if (convert) {
    // The cached rows [0, position) of the contiguous cache [Hkv, cap, D] into blocks (all in
    // arena 0, which holds `positions` > position).
    const size_t row = size_t(c_.head_dim) * (options_.kv_half ? 2 : 4);
    const int Hkv = c_.n_kv_heads, rows = std::min(st.capacity, st.position());
    for (int l = 0; l < c_.n_layers(); ++l) {
      if (c_.mixers[l] != Mixer::Attention) continue;
      for (int kind = 0; kind < 2; ++kind) {
        auto& old = (kind ? st.v : st.k)[l];
        auto& dst = (kind ? st.v_arenas : st.k_arenas)[l][0];
        if (old && old->contents() && dst->contents())
          for (int h = 0; h < Hkv; ++h)
            for (int p = 0; p < rows; ++p)
              std::memcpy(static_cast<uint8_t*>(dst->contents()) + ((size_t(p / B) * Hkv + h) * B + p % B) * row,
                          static_cast<const uint8_t*>(old->contents()) + (size_t(h) * st.capacity + p) * row, row);
        old.reset();
      }
    }
  }
  st.capacity = have * B;
}

// Binds a layer's KV cache to a dispatch and declares the access (traffic bytes, K and V
// each): contiguous K, V at `index`, index + 1; blocks as the table at 9 and the K and V
// arenas from 10 (metal/attention.metal), unused arena slots bound to a dummy.
void GpuBackend::bind_kv(Dispatch& d, GpuState& st, int layer, uint32_t index, bool write, uint64_t traffic) {
  if (!st.block_len) {
    d.buf(index, st.k[layer]).buf(index + 1, st.v[layer])
        .state(st.k[layer], write, traffic).state(st.v[layer], write, traffic);
    return;
  }
  d.buf(9, st.block_table).state(st.block_table, false, 0);
  for (int kind = 0; kind < 2; ++kind) {
    const auto& arenas = (kind ? st.v_arenas : st.k_arenas)[layer];
    for (uint32_t a = 0; a < LILY_ATTN_MAX_ARENAS; ++a) {
      const uint32_t slot = 10 + kind * LILY_ATTN_MAX_ARENAS + a;
      if (a < arenas.size()) d.buf(slot, arenas[a]).state(arenas[a], write, a == 0 ? traffic : 0);
      else d.buf(slot, dummy_);
    }
  }
}

}  // namespace lily::gpu
