// The KV cache of a GpuState: a contiguous [Hkv, cap, D] run per K and V of each attention
// layer, grown geometrically like the CPU backend's, until the context reaches
// GpuOptions::block_threshold; then the fixed-block layout of long contexts (block_len).
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
#include <string>
#include <vector>

#include "gpu/backend.h"
#include "metal/attention_args.h"
#include "model/dtype.h"
#include "model/error.h"

namespace lily::gpu {

// Grows every attention layer's cache to hold `positions` (geometric, up to max_context).
// Called between passes, so no command buffer uses the old buffers.
void GpuBackend::reserve_kv(GpuState& st, int positions) {
  if (st.block_len || positions >= options_.block_threshold) return reserve_blocks(st, positions);
  if (positions <= st.capacity) return;
  int cap = std::max(st.capacity, 256);
  while (cap < positions) cap *= 2;
  cap = std::min(cap, std::max(st.max_context(), positions));
  const size_t row = size_t(c_.head_dim) * (options_.kv_half ? 2 : 4);
  for (int l = 0; l < c_.n_layers(); ++l) {
    if (c_.mixers[l] != Mixer::Attention) continue;
    for (auto* list : {&st.k, &st.v}) {
      auto nb = ctx_.device().new_buffer(size_t(c_.n_kv_heads) * cap * row);
      auto& old = (*list)[l];
      if (old)
        for (int h = 0; h < c_.n_kv_heads; ++h)
          ctx_.device().copy(*nb, size_t(h) * cap * row, *old, size_t(h) * st.capacity * row,
                             size_t(st.capacity) * row);
      old = nb;
    }
  }
  st.capacity = cap;
}

void GpuBackend::reserve_blocks(GpuState& st, int positions) {
  if (st.block_len && positions <= st.capacity) return;
  const int B = options_.block_len;
  const int max_blocks = (std::max(st.max_context(), positions) + B - 1) / B;
  const int need = (positions + B - 1) / B;
  const bool convert = st.block_len == 0;
  if (convert) {
    st.block_len = B;
    st.block_table = ctx_.device().new_buffer(size_t(max_blocks) * 4);
    st.k_arenas.assign(c_.n_layers(), {});
    st.v_arenas.assign(c_.n_layers(), {});
    st.arena_slots.clear();
  }
  int have = 0;
  for (int n : st.arena_slots) have += n;
  const size_t block_bytes = size_t(c_.n_kv_heads) * B * c_.head_dim * (options_.kv_half ? 2 : 4);
  std::vector<uint32_t> entries;  // the block table from `have` on, written once below
  const int first = have;
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
      st.k_arenas[l].push_back(ctx_.device().new_buffer(size_t(n) * block_bytes));
      st.v_arenas[l].push_back(ctx_.device().new_buffer(size_t(n) * block_bytes));
    }
    for (int s = 0; s < n; ++s) entries.push_back(uint32_t(a) << 24 | uint32_t(s));
    st.arena_slots.push_back(n);
    have += n;
  }
  st.block_table->write(size_t(first) * 4, entries.data(), entries.size() * 4);
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
        // Block b of head h holds positions [b*B, b*B + B) contiguous, as the old run of h does:
        // one copy per (block, head).
        if (old)
          for (int p = 0; p < rows; p += B)
            for (int h = 0; h < Hkv; ++h)
              ctx_.device().copy(*dst, (size_t(p / B) * Hkv + h) * B * row, *old,
                                 (size_t(h) * st.capacity + p) * row, size_t(std::min(B, rows - p)) * row);
        old.reset();
      }
    }
  }
  st.capacity = have * B;
}

// ---- rows to and from the host (saved sessions: State::export_tensors / import_tensors) ------

namespace {

// Calls run(buffer, byte offset, head, first position, rows) for each contiguous run of rows
// [0, positions) of one layer's K or V cache: one run per head in the contiguous layout, one
// per (block, head) in the block layout.
template <typename Run>
void for_each_kv_run(const GpuState& st, int layer, bool v, int positions, int Hkv, size_t row, Run run) {
  if (positions == 0) return;  // (a state that never grew has no buffers)
  if (!st.block_len) {
    Buffer& buf = *(v ? st.v : st.k)[layer];
    for (int h = 0; h < Hkv; ++h) run(buf, size_t(h) * st.capacity * row, h, 0, positions);
    return;
  }
  const int B = st.block_len;
  std::vector<uint32_t> table((positions + B - 1) / B);
  st.block_table->read(0, table.data(), table.size() * 4);
  const auto& arenas = (v ? st.v_arenas : st.k_arenas)[layer];
  for (size_t b = 0; b < table.size(); ++b) {
    Buffer& arena = *arenas[table[b] >> 24];
    const size_t slot = table[b] & 0xFFFFFFu;
    const int p = int(b) * B, n = std::min(B, positions - p);
    for (int h = 0; h < Hkv; ++h) run(arena, (slot * Hkv + h) * B * row, h, p, n);
  }
}

}  // namespace

void GpuBackend::read_kv_rows(const GpuState& st, int layer, bool v, int positions, float* host) {
  const int D = c_.head_dim;
  const bool half = options_.kv_half;
  const size_t row = size_t(D) * (half ? 2 : 4);
  std::vector<uint16_t> tmp;
  for_each_kv_run(st, layer, v, positions, c_.n_kv_heads, row, [&](Buffer& buf, size_t off, int h, int p, int n) {
    float* dst = host + (size_t(h) * positions + p) * D;
    if (!half) return buf.read(off, dst, size_t(n) * row);
    tmp.resize(size_t(n) * D);
    buf.read(off, tmp.data(), size_t(n) * row);
    for (size_t i = 0; i < tmp.size(); ++i) dst[i] = f16_to_f32(tmp[i]);
  });
}

void GpuBackend::write_kv_rows(GpuState& st, int layer, bool v, int positions, const float* host) {
  const int D = c_.head_dim;
  const bool half = options_.kv_half;
  const size_t row = size_t(D) * (half ? 2 : 4);
  std::vector<uint16_t> tmp;
  for_each_kv_run(st, layer, v, positions, c_.n_kv_heads, row, [&](Buffer& buf, size_t off, int h, int p, int n) {
    const float* src = host + (size_t(h) * positions + p) * D;
    if (!half) return buf.write(off, src, size_t(n) * row);
    tmp.resize(size_t(n) * D);
    for (size_t i = 0; i < tmp.size(); ++i) tmp[i] = f32_to_f16(src[i]);
    buf.write(off, tmp.data(), size_t(n) * row);
  });
}

// A layer's cache as the attention kernels reach it (attention.cpp).
KvCacheView GpuBackend::kv_view(GpuState& st, int layer) const {
  KvCacheView kv;
  kv.half = options_.kv_half;
  kv.blocks = st.block_len > 0;
  kv.cap = uint32_t(kv.blocks ? st.block_len : st.capacity);
  if (!kv.blocks) {
    kv.k = st.k[layer];
    kv.v = st.v[layer];
  } else {
    kv.table = st.block_table;
    kv.k_arenas = st.k_arenas[layer];
    kv.v_arenas = st.v_arenas[layer];
  }
  return kv;
}

}  // namespace lily::gpu
