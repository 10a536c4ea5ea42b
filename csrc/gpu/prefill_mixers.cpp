// The GPU backend's prefill mixers: a chunk of T > 1 tokens through an attention layer's core
// and a DeltaNet layer's conv + recurrence, with kernels made for T rows
// (metal/attention_prefill.metal, metal/gdn_prefill.metal). GpuBackend::attention and
// ::gated_deltanet call these after their input projections and fall back to the decode
// kernels when they return false (T == 1, or a shape outside the kernels' limits).
//
// Design choices:
// - Attention: the projections and attn_prepare (q/k norm, partial RoPE, KV write for all T
//   rows) are the decode path's; only the core changes. One threadgroup per (KV head, tile of
//   query tokens) holds all GQA query heads of the tile, so the cache is read once per tile
//   rather than once per token; the chunk attends to the cache written by earlier chunks and
//   by its own attn_prepare (causal within the chunk), so chunks chain with no extra state.
// - DeltaNet: gdn_prepare does everything parallel over tokens (conv, SiLU, L2 norms, gates)
//   so that the sequential scan only does the rank-1 state updates; the scan holds the state
//   in registers for the whole chunk and ends with the state written to the other parity copy,
//   like the decode kernels, so discard_last_step and snapshots see the same scheme.
// - Everything stays in the pass's command buffer: no CPU wait inside a chunk.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "gpu/backend.h"
#include "gpu/encode.h"
#include "metal/attention_prefill_args.h"
#include "metal/gdn_prefill_args.h"

namespace lily::gpu {

bool GpuBackend::prefill_attention(GpuState& st, int layer) {
  const int T = T_, Hq = c_.n_heads, Hkv = c_.n_kv_heads, D = c_.head_dim;
  const int group = Hq / Hkv;
  if (T < 2 || group > LILY_ATTN_PF_ROWS || D % 32 != 0 || D > LILY_ATTN_PF_MAX_HEAD_DIM) return false;
  const uint64_t row = uint64_t(D) * (options_.kv_half ? 2 : 4);
  const bool blocks = st.block_len > 0;  // the fixed-block layout (kv_blocks.cpp)
  const uint32_t tile = std::max(1, LILY_ATTN_PF_ROWS / group);
  const uint32_t tiles = div_up(T, tile);
  AttnPrefillArgs a{uint32_t(D), uint32_t(Hq), uint32_t(Hkv), uint32_t(blocks ? st.block_len : st.capacity), uint32_t(pos0_),
                    uint32_t(T), tile, 1.0f / std::sqrt(float(D))};
  // Cache traffic: tile i reads positions [0, pos0 + its last token], K and V.
  uint64_t positions = 0;
  for (uint32_t i = 0; i < tiles; ++i) positions += uint64_t(pos0_) + std::min<uint32_t>(T, (i + 1) * tile);
  Dispatch d(*this, "attention_prefill.metal",
             std::string("attn_prefill_") + (blocks ? "blocks_" : "") + (options_.kv_half ? "half" : "float") + "_d" +
                 std::to_string(D));
  d.buf(0, qg_).buf(3, o_).args(4, a)
      .reads(qg_, size_t(T) * Hq * 2 * D * 4)
      .writes(o_, size_t(T) * Hq * D * 4);
  bind_kv(d, st, layer, 1, false, positions * Hkv * row);
  d.run({uint32_t(Hkv), tiles, 1}, {32 * LILY_ATTN_PF_SIMDGROUPS, 1, 1});
  return true;
}

bool GpuBackend::prefill_gated_deltanet(GpuState& st, int layer, const GdnWeights& w, const GdnArgs& args) {
  const int T = T_, C = c_.gdn_qkv_dim(), vdim = c_.gdn_value_dim(), Hv = c_.gdn_v_heads, Hk = c_.gdn_k_heads;
  const int Dk = c_.gdn_k_dim, Dv = c_.gdn_v_dim;
  if (T < 2 || Dk % LILY_GDN_SCAN_SPLIT != 0 || Dk > LILY_GDN_SCAN_MAX_DK ||
      uint64_t(LILY_GDN_SCAN_SPLIT) * Dv > 1024)
    return false;
  const size_t f = size_t(T) * 4;
  const int out = in_ ^ 1;
  auto& win = st.conv[in_][layer];
  auto& win_out = st.conv[out][layer];
  {
    // conv_out_ holds x: conv + SiLU, q and k normalised.
    Dispatch d(*this, "gdn_prefill.metal", "gdn_prepare");
    d.buf(0, qkv_).buf(1, vec(w.conv1d)).buf(2, win).buf(3, b_).buf(4, a_).buf(5, vec(w.a_neg))
        .buf(6, vec(w.dt_bias)).buf(7, conv_out_).buf(8, gdn_gates_).buf(9, win_out).args(10, args)
        .reads(qkv_, f * C).reads(b_, f * Hv).reads(a_, f * Hv)
        .writes(conv_out_, f * C).writes(gdn_gates_, f * Hv * 2)
        .state(win, false, win->length())
        .state(win_out, true, win_out->length());
    d.run({uint32_t(2 * Hk + Hv), uint32_t(T), 1}, {LILY_GDN_PREP_THREADS, 1, 1});
  }
  {
    auto& S = st.S[in_][layer];
    auto& S_out = st.S[out][layer];
    Dispatch d(*this, "gdn_prefill.metal", "gdn_scan_dk" + std::to_string(Dk));
    d.buf(0, conv_out_).buf(1, gdn_gates_).buf(2, z_).buf(3, vec(w.norm)).buf(4, S).buf(5, S_out)
        .buf(6, go_).args(7, args)
        .reads(conv_out_, f * C).reads(gdn_gates_, f * Hv * 2).reads(z_, f * vdim)
        .writes(go_, f * vdim)
        .state(S, false, S->length())
        .state(S_out, true, S_out->length());
    d.run({uint32_t(Hv), 1, 1}, {32 * div_up(uint64_t(LILY_GDN_SCAN_SPLIT) * Dv, 32), 1, 1});
  }
  return true;
}

}  // namespace lily::gpu
