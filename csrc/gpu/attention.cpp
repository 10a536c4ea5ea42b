// Attention family encoding (metal/attention.metal, metal/attention_prefill.metal): q/k norm +
// RoPE + KV write, decode attention (single pass or split-K + combine), flash prefill.
//
// Shapes: qg [T, Hq, 2D] (query | output gate), k, v [T, Hkv, D], o [T, Hq, D]; the cache
// [Hkv, cap, D] per K and V, or fixed blocks (table + arenas [slots, Hkv, B, D], kv_cache.cpp);
// split partials part_o [slot, Hq, max_splits, D], part_ml [slot, Hq, max_splits, 2]. Every kernel
// takes a table of sequences (metal/attention_args.h AttnSeq), so a pass's sequences share one
// dispatch per kernel (per cache layout).
#include <algorithm>
#include <string>

#include "gpu/encode.h"
#include "model/error.h"

namespace lily::gpu {

namespace {

uint32_t total_rows(const std::vector<AttnSeqView>& seqs) {
  uint32_t n = 0;
  for (const AttnSeqView& s : seqs) n += s.n;
  return n;
}

// s's table entry without its cache addresses (what attn_combine, which reads no cache, takes).
AttnSeq entry(const AttnSeqView& s) {
  AttnSeq e{};
  e.first = s.first;
  e.n = s.n;
  e.pos0 = s.pos0;
  e.cap = s.kv.cap;
  e.n_splits = s.n_splits;
  e.split_len = s.split_len;
  e.part = s.part;
  return e;
}

// The table of a dispatch: one AttnSeq per sequence, each cache buffer declared to the dispatch
// (its device address written into the entry). traffic(s): bytes of s's cache the kernel
// touches per K and per V (counted once, on the first arena of a block cache).
template <typename Traffic>
std::vector<AttnSeq> seq_table(Dispatch& d, const std::string& kernel, const std::vector<AttnSeqView>& seqs,
                               bool write, Traffic traffic) {
  if (seqs.empty() || seqs.size() > LILY_ATTN_MAX_SEQS)
    throw Error("[gpu] " + kernel + ": " + std::to_string(seqs.size()) + " sequences in one dispatch (1 to " +
                std::to_string(LILY_ATTN_MAX_SEQS) + ")");
  std::vector<AttnSeq> table;
  for (const AttnSeqView& s : seqs) {
    if (s.kv.kernel_suffix() != seqs[0].kv.kernel_suffix())
      throw Error("[gpu] " + kernel + ": the sequences of one dispatch share a cache layout and type");
    AttnSeq e = entry(s);
    const uint64_t bytes = traffic(s);
    if (!s.kv.blocks) {
      e.k[0] = d.address(s.kv.k, write, bytes);
      e.v[0] = d.address(s.kv.v, write, bytes);
    } else {
      e.table = d.address(s.kv.table, false, 0);
      for (size_t a = 0; a < s.kv.k_arenas.size(); ++a) e.k[a] = d.address(s.kv.k_arenas[a], write, a ? 0 : bytes);
      for (size_t a = 0; a < s.kv.v_arenas.size(); ++a) e.v[a] = d.address(s.kv.v_arenas[a], write, a ? 0 : bytes);
    }
    table.push_back(e);
  }
  return table;
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

void encode_attn_prepare(EncoderContext& ctx, AttnPrepareArgs args, const std::vector<AttnSeqView>& seqs,
                         const std::shared_ptr<Buffer>& k, const std::shared_ptr<Buffer>& v,
                         const std::shared_ptr<Buffer>& q_norm, const std::shared_ptr<Buffer>& k_norm,
                         const std::shared_ptr<Buffer>& inv_freq, const std::shared_ptr<Buffer>& qg) {
  const size_t D = args.D, Hq = args.Hq, Hkv = args.Hkv, rows = rows_spanned(seqs);
  const std::string kernel = "attn_prepare_" + seqs.at(0).kv.kernel_suffix();
  Dispatch d(ctx, "attention.metal", kernel);
  const auto table = seq_table(d, kernel, seqs, true, [&](const AttnSeqView& s) {
    return uint64_t(s.n) * Hkv * D * (s.kv.half ? 2 : 4);  // the rows written
  });
  args.n_seqs = uint32_t(table.size());
  d.args(args)
      .table("seqs", table)
      .read("k", {k, 0}, rows * Hkv * D * 4)
      .read("v", {v, 0}, rows * Hkv * D * 4)
      .weight("q_norm", {q_norm, 0})
      .weight("k_norm", {k_norm, 0})
      .weight("inv_freq", {inv_freq, 0})
      .write("qg", {qg, 0}, rows * Hq * 2 * D * 4)
      .declare_read(qg, rows * Hq * 2 * D * 4);
  d.run({uint32_t(Hq + Hkv), total_rows(seqs), 1}, {128, 1, 1});
}

void attn_decode_splits(AttnSeqView& s, int n_ctx, int split_threshold, int split_len, int max_splits,
                        int block_len) {
  int splits = 1, len = n_ctx;
  if (s.n == 1 && n_ctx > split_threshold) {
    // Over blocks a split is whole blocks, so each threadgroup walks its own blocks.
    const int unit = block_len > 0 ? block_len : 1;
    len = std::max(unit, split_len / unit * unit);
    splits = int(div_up(n_ctx, len));
    if (splits > max_splits) {
      len = int(div_up(div_up(n_ctx, max_splits), unit)) * unit;
      splits = int(div_up(n_ctx, len));
    }
  }
  s.n_splits = uint32_t(splits);
  s.split_len = uint32_t(len);
}

AttnPartialBytes attn_partial_bytes(size_t Hq, size_t D, size_t splits) {
  return {Hq * splits * D * 4, Hq * splits * 2 * 4};
}

void encode_attn_decode(EncoderContext& ctx, AttnArgs args, const std::vector<AttnSeqView>& seqs,
                        const std::shared_ptr<Buffer>& qg, const std::shared_ptr<Buffer>& o,
                        const std::shared_ptr<Buffer>& part_o, const std::shared_ptr<Buffer>& part_ml) {
  const size_t D = args.D, Hq = args.Hq, Hkv = args.Hkv, rows = rows_spanned(seqs);
  const std::string kernel = "attn_decode_" + seqs.at(0).kv.kernel_suffix() + "_d" + std::to_string(D);
  Dispatch d(ctx, "attention.metal", kernel);
  const auto table = seq_table(d, kernel, seqs, false, [&](const AttnSeqView& s) {
    return uint64_t(Hkv) * (uint64_t(s.pos0) + s.n) * D * (s.kv.half ? 2 : 4);  // positions [0, pos0 + n)
  });
  args.n_seqs = uint32_t(table.size());
  uint32_t splits = 1;
  for (const AttnSeqView& s : seqs) splits = std::max(splits, s.n_splits);
  if (splits > args.max_splits)
    throw Error("[gpu] " + kernel + ": " + std::to_string(splits) + " splits exceed the partials' " +
                std::to_string(args.max_splits));
  const AttnPartialBytes slot = attn_partial_bytes(Hq, D, args.max_splits);
  d.args(args).table("seqs", table).read("qg", {qg, 0}, rows * Hq * 2 * D * 4);
  d.write("o", {o, 0}, rows * Hq * D * 4).bind("part_o", {part_o, 0}).bind("part_ml", {part_ml, 0});
  for (const AttnSeqView& s : seqs)
    if (s.n_splits > 1)
      d.declare_write(part_o, slot.o, s.part * slot.o).declare_write(part_ml, slot.ml, s.part * slot.ml);
  d.run({uint32_t(Hkv), splits, total_rows(seqs)}, {32 * LILY_ATTN_SIMDGROUPS, 1, 1});
}

void encode_attn_combine(EncoderContext& ctx, AttnArgs args, const std::vector<AttnSeqView>& seqs,
                         const std::shared_ptr<Buffer>& qg, const std::shared_ptr<Buffer>& o,
                         const std::shared_ptr<Buffer>& part_o, const std::shared_ptr<Buffer>& part_ml) {
  std::vector<AttnSeq> table;  // the split sequences (each decodes one row): no cache read
  std::vector<AttnSeqView> split;
  for (const AttnSeqView& s : seqs)
    if (s.n_splits > 1) {
      split.push_back(s);
      table.push_back(entry(s));
    }
  if (split.empty()) return;
  const size_t D = args.D, Hq = args.Hq, rows = rows_spanned(split);
  const AttnPartialBytes slot = attn_partial_bytes(Hq, D, args.max_splits);
  args.n_seqs = uint32_t(table.size());
  Dispatch d(ctx, "attention.metal", "attn_combine");
  d.args(args).table("seqs", table).read("qg", {qg, 0}, rows * Hq * 2 * D * 4);
  d.bind("part_o", {part_o, 0}).bind("part_ml", {part_ml, 0});
  for (const AttnSeqView& s : split)
    d.declare_read(part_o, slot.o, s.part * slot.o).declare_read(part_ml, slot.ml, s.part * slot.ml);
  d.write("o", {o, 0}, rows * Hq * D * 4);
  d.run({uint32_t(Hq), uint32_t(div_up(D, LILY_ATTN_COMBINE_COLUMNS)), uint32_t(table.size())},
        {LILY_ATTN_COMBINE_COLUMNS, 1, 1});
}

bool attn_prefill_fits(int D, int group) { return group <= LILY_ATTN_PF_ROWS && D % 32 == 0; }

void encode_attn_prefill(EncoderContext& ctx, const AttnPrefillArgs& args, const AttnSeqView& seq,
                         const std::shared_ptr<Buffer>& qg, const std::shared_ptr<Buffer>& o) {
  const size_t D = args.D, Hq = args.Hq, Hkv = args.Hkv, T = seq.n, tile = args.tile_tokens;
  const size_t rows = size_t(seq.first) + T;
  const uint32_t tiles = div_up(T, tile);
  // Cache traffic: tile i reads positions [0, pos0 + its last token], K and V.
  uint64_t positions = 0;
  for (uint32_t i = 0; i < tiles; ++i) positions += uint64_t(seq.pos0) + std::min<uint64_t>(T, (i + 1) * tile);
  const std::string kernel = "attn_prefill_" + seq.kv.kernel_suffix() + "_d" + std::to_string(D);
  Dispatch d(ctx, "attention_prefill.metal", kernel);
  const auto table = seq_table(d, kernel, {seq}, false, [&](const AttnSeqView& s) {
    return positions * Hkv * D * (s.kv.half ? 2 : 4);
  });
  d.args(args).table("seq", table).read("qg", {qg, 0}, rows * Hq * 2 * D * 4);
  d.write("o", {o, 0}, rows * Hq * D * 4);
  d.run({uint32_t(Hkv), tiles, 1}, {LILY_ATTN_PF_THREADS, 1, 1});
}

}  // namespace lily::gpu
