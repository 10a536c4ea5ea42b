// Attention family encoding (metal/attention.metal, metal/attention_prefill.metal): q/k norm +
// RoPE + KV write, decode attention (single pass or split-K + combine), flash prefill.
//
// Shapes: qg [T, Hq, 2D] (query | output gate), k, v [T, Hkv, D], o [T, Hq, D]; the cache
// [Hkv, cap, D] per K and V, or fixed blocks (table + arenas [slots, Hkv, B, D], kv_cache.cpp);
// split partials part_o [Hq, n_splits, D], part_ml [Hq, n_splits, 2].
#include <algorithm>
#include <string>

#include "gpu/encode.h"
#include "model/error.h"

namespace lily::gpu {

namespace {

// The cache as the kernel's parameters, in their order: contiguous k_cache, v_cache; or the
// block table (a read) and the K and V arenas (unused slots bound to the dummy). The table is
// bound among the reads, so a kernel that writes the cache binds it before its outputs (see
// metal/attention.metal); the caller places it.
void bind_cache(Dispatch& d, const KvCacheView& kv, bool write, uint64_t traffic) {
  if (!kv.blocks) {
    d.state("k_cache", kv.k, write, traffic).state("v_cache", kv.v, write, traffic);
    return;
  }
  static const char* const k_names[LILY_ATTN_MAX_ARENAS] = {"k0", "k1", "k2", "k3", "k4", "k5"};
  static const char* const v_names[LILY_ATTN_MAX_ARENAS] = {"v0", "v1", "v2", "v3", "v4", "v5"};
  for (int kind = 0; kind < 2; ++kind) {
    const auto& arenas = kind ? kv.v_arenas : kv.k_arenas;
    for (size_t a = 0; a < LILY_ATTN_MAX_ARENAS; ++a) {
      const char* name = (kind ? v_names : k_names)[a];
      if (a < arenas.size()) d.state(name, arenas[a], write, a == 0 ? traffic : 0);
      else d.unused(name);
    }
  }
}

}  // namespace

std::string KvCacheView::kernel_suffix() const {
  return std::string(blocks ? "blocks_" : "") + (half ? "half" : "float");
}

void check_attention_head_dim(int D) {
#define LILY_LIST(X) X,
  check_instantiated(D, {LILY_ATTN_HEAD_DIMS(LILY_LIST)}, "head_dim " + std::to_string(D) + " has no attention kernels",
                     "LILY_ATTN_HEAD_DIMS, metal/attention_args.h");
#undef LILY_LIST
}

void encode_attn_prepare(EncoderContext& ctx, const AttnPrepareArgs& args, int T, const BufferRange& k,
                         const BufferRange& v, const std::shared_ptr<Buffer>& q_norm,
                         const std::shared_ptr<Buffer>& k_norm, const std::shared_ptr<Buffer>& inv_freq,
                         const KvCacheView& kv, const BufferRange& qg) {
  const size_t D = args.D, Hq = args.Hq, Hkv = args.Hkv;
  const uint64_t row = D * (kv.half ? 2 : 4);
  Dispatch d(ctx, "attention.metal", "attn_prepare_" + kv.kernel_suffix());
  d.args(args)
      .read("k", k, size_t(T) * Hkv * D * 4)
      .read("v", v, size_t(T) * Hkv * D * 4)
      .weight("q_norm", {q_norm, 0})
      .weight("k_norm", {k_norm, 0})
      .weight("inv_freq", {inv_freq, 0});
  if (kv.blocks) d.state("table", kv.table, false, 0);
  d.write("qg", qg, size_t(T) * Hq * 2 * D * 4).declare_read(qg.buf, size_t(T) * Hq * 2 * D * 4, qg.off);
  bind_cache(d, kv, true, uint64_t(T) * Hkv * row);
  d.run({uint32_t(Hq + Hkv), uint32_t(T), 1}, {128, 1, 1});
}

void attn_decode_splits(AttnArgs& args, int n_ctx, int T, int split_threshold, int split_len, int max_splits,
                        int block_len) {
  int splits = 1, len = n_ctx;
  if (T == 1 && n_ctx > split_threshold) {
    // Over blocks a split is whole blocks, so each threadgroup walks its own blocks.
    const int unit = block_len > 0 ? block_len : 1;
    len = std::max(unit, split_len / unit * unit);
    splits = int(div_up(n_ctx, len));
    if (splits > max_splits) {
      len = int(div_up(div_up(n_ctx, max_splits), unit)) * unit;
      splits = int(div_up(n_ctx, len));
    }
  }
  args.n_splits = uint32_t(splits);
  args.split_len = uint32_t(len);
}

AttnPartialBytes attn_partial_bytes(size_t Hq, size_t D, size_t splits) {
  return {Hq * splits * D * 4, Hq * splits * 2 * 4};
}

void encode_attn_decode(EncoderContext& ctx, const AttnArgs& args, int T, const BufferRange& qg,
                        const KvCacheView& kv, const BufferRange& o, const BufferRange& part_o,
                        const BufferRange& part_ml) {
  const size_t D = args.D, Hq = args.Hq, Hkv = args.Hkv, splits = args.n_splits;
  const uint64_t row = D * (kv.half ? 2 : 4), n_ctx = uint64_t(args.pos0) + T;
  const AttnPartialBytes part = attn_partial_bytes(Hq, D, splits);
  Dispatch d(ctx, "attention.metal", "attn_decode_" + kv.kernel_suffix() + "_d" + std::to_string(D));
  d.args(args).read("qg", qg, size_t(T) * Hq * 2 * D * 4);
  if (kv.blocks) d.state("table", kv.table, false, 0);
  bind_cache(d, kv, false, Hkv * n_ctx * row);
  if (splits == 1) d.write("o", o, size_t(T) * Hq * D * 4).unused("part_o").unused("part_ml");
  else d.unused("o").write("part_o", part_o, part.o).write("part_ml", part_ml, part.ml);
  d.run({uint32_t(Hkv), uint32_t(splits), uint32_t(T)}, {32 * LILY_ATTN_SIMDGROUPS, 1, 1});
}

void encode_attn_combine(EncoderContext& ctx, const AttnArgs& args, const BufferRange& qg, const BufferRange& o,
                         const BufferRange& part_o, const BufferRange& part_ml) {
  const size_t D = args.D, Hq = args.Hq, splits = args.n_splits;
  if (splits == 1) return;
  const AttnPartialBytes part = attn_partial_bytes(Hq, D, splits);
  Dispatch d(ctx, "attention.metal", "attn_combine");
  d.args(args)
      .read("qg", qg, Hq * 2 * D * 4)
      .read("part_o", part_o, part.o)
      .read("part_ml", part_ml, part.ml)
      .write("o", o, Hq * D * 4);
  d.run({uint32_t(Hq), uint32_t(div_up(D, LILY_ATTN_COMBINE_COLUMNS)), 1}, {LILY_ATTN_COMBINE_COLUMNS, 1, 1});
}

bool attn_prefill_fits(int D, int group) { return group <= LILY_ATTN_PF_ROWS && D % 32 == 0; }

void encode_attn_prefill(EncoderContext& ctx, const AttnPrefillArgs& args, const BufferRange& qg,
                         const KvCacheView& kv, const BufferRange& o) {
  const size_t D = args.D, Hq = args.Hq, Hkv = args.Hkv, T = args.T, tile = args.tile_tokens;
  const uint64_t row = D * (kv.half ? 2 : 4);
  const uint32_t tiles = div_up(T, tile);
  // Cache traffic: tile i reads positions [0, pos0 + its last token], K and V.
  uint64_t positions = 0;
  for (uint32_t i = 0; i < tiles; ++i) positions += uint64_t(args.pos0) + std::min<uint64_t>(T, (i + 1) * tile);
  Dispatch d(ctx, "attention_prefill.metal", "attn_prefill_" + kv.kernel_suffix() + "_d" + std::to_string(D));
  d.args(args).read("qg", qg, T * Hq * 2 * D * 4);
  if (kv.blocks) d.state("table", kv.table, false, 0);
  bind_cache(d, kv, false, positions * Hkv * row);
  d.write("o", o, T * Hq * D * 4);
  d.run({uint32_t(Hkv), tiles, 1}, {LILY_ATTN_PF_THREADS, 1, 1});
}

}  // namespace lily::gpu
