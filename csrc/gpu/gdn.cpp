// Gated DeltaNet family encoding (metal/gdn.metal, metal/gdn_prefill.metal).
//
// Shapes: qkv [T, C], C = 2*Hk*Dk + Hv*Dv ([q | k | v]); z [T, Hv*Dv]; b, a [T, Hv]; conv window
// [K-1, C]; state S [Hv, Dk, Dv] f32; x [T, C] after conv + SiLU (+ q/k norms in prefill);
// gates [T, Hv, 2]; o [T, Hv*Dv]. Qwen3-Next's grouped inputs: qkvz [T, C + Hv*Dv], ba [T, 2*Hv].
// State is read from one copy and written to the other (GpuState's parity), so a pass can be
// undone; both are declared as state (their traffic counted apart from activations). The
// decode route's kernels reach each sequence's state by address (metal/gdn_args.h GdnSeq), so a
// pass's sequences share one dispatch.
#include <string>
#include <vector>

#include "gpu/encode.h"
#include "model/error.h"

namespace lily::gpu {

void check_gdn_key_dim(int Dk, int Dv) {
#define LILY_LIST(X) X,
  check_instantiated(Dk, {LILY_GDN_KEY_DIMS(LILY_LIST)},
                     "DeltaNet key head dim " + std::to_string(Dk) + " has no recurrence kernels",
                     "LILY_GDN_KEY_DIMS, metal/gdn_args.h");
#undef LILY_LIST
  if (Dv > 1024)
    throw ConfigError("[gpu] DeltaNet value head dim " + std::to_string(Dv) + " exceeds the kernels' 1024");
}

void encode_gdn_ungroup(EncoderContext& ctx, const GdnArgs& args, const BufferRange& qkvz, const BufferRange& ba,
                        const BufferRange& qkv, const BufferRange& z, const BufferRange& b, const BufferRange& a) {
  const size_t f = size_t(args.T) * 4, C = args.C, vdim = size_t(args.Hv) * args.Dv, Hv = args.Hv;
  const uint32_t n = uint32_t(C + vdim + 2 * Hv);
  Dispatch d(ctx, "gdn.metal", "gdn_ungroup");
  d.args(args)
      .read("qkvz", qkvz, f * (C + vdim))
      .read("ba", ba, f * 2 * Hv)
      .write("qkv", qkv, f * C)
      .write("z", z, f * vdim)
      .write("b", b, f * Hv)
      .write("a", a, f * Hv);
  d.run({div_up(n, 256), args.T, 1}, {256, 1, 1});
}

namespace {

// The table of a decode-route dispatch: one GdnSeq per sequence, each state copy declared to
// the dispatch (its device address written into the entry). state(st) picks the copies a
// kernel reads and writes.
template <typename Pick>
std::vector<GdnSeq> seq_table(Dispatch& d, const char* kernel, const std::vector<GdnSeqView>& seqs, Pick state) {
  if (seqs.empty() || seqs.size() > LILY_GDN_MAX_SEQS)
    throw Error(std::string("[gpu] ") + kernel + ": " + std::to_string(seqs.size()) +
                " sequences in one dispatch (1 to " + std::to_string(LILY_GDN_MAX_SEQS) + ")");
  std::vector<GdnSeq> table;
  for (const GdnSeqView& s : seqs) {
    GdnSeq e{};
    state(d, s.st, e);
    e.first = s.first;
    e.n = s.n;
    table.push_back(e);
  }
  return table;
}

}  // namespace

void encode_gdn_conv(EncoderContext& ctx, const GdnArgs& args, const std::vector<GdnSeqView>& seqs,
                     const std::shared_ptr<Buffer>& qkv, const GdnLayerBuffers& L,
                     const std::shared_ptr<Buffer>& conv_out) {
  const size_t f = rows_spanned(seqs) * 4, C = args.C;
  Dispatch d(ctx, "gdn.metal", "gdn_conv");
  const auto table = seq_table(d, "gdn_conv", seqs, [](Dispatch& d, const GdnStateView& st, GdnSeq& e) {
    e.window = d.address(st.window_in, false, st.window_in->length());
    e.window_out = d.address(st.window_out, true, st.window_out->length());
  });
  d.args(args)
      .table("seqs", table)
      .read("qkv", {qkv, 0}, f * C)
      .weight("taps", {L.taps, 0})
      .write("out", {conv_out, 0}, f * C);
  d.run({div_up(C, 256), uint32_t(table.size()), 1}, {256, 1, 1});
}

void encode_gdn_recurrence(EncoderContext& ctx, const GdnArgs& args, const std::vector<GdnSeqView>& seqs,
                           const std::shared_ptr<Buffer>& conv_out, const std::shared_ptr<Buffer>& b,
                           const std::shared_ptr<Buffer>& a, const GdnLayerBuffers& L,
                           const std::shared_ptr<Buffer>& o) {
  const size_t f = rows_spanned(seqs) * 4, C = args.C, vdim = size_t(args.Hv) * args.Dv, Hv = args.Hv;
  const std::string kernel = "gdn_recurrence_dk" + std::to_string(args.Dk);
  Dispatch d(ctx, "gdn.metal", kernel);
  const auto table = seq_table(d, kernel.c_str(), seqs, [](Dispatch& d, const GdnStateView& st, GdnSeq& e) {
    e.S = d.address(st.S_in, false, st.S_in->length());
    e.S_out = d.address(st.S_out, true, st.S_out->length());
  });
  d.args(args)
      .table("seqs", table)
      .read("conv_out", {conv_out, 0}, f * C)
      .read("b", {b, 0}, f * Hv)
      .read("a", {a, 0}, f * Hv)
      .weight("a_neg", {L.a_neg, 0})
      .weight("dt_bias", {L.dt_bias, 0})
      .write("o", {o, 0}, f * vdim);
  d.run({args.Hv, div_up(args.Dv, LILY_GDN_COLUMNS), uint32_t(table.size())}, {LILY_GDN_COLUMNS, 1, 1});
}

void encode_gdn_gated_norm(EncoderContext& ctx, const GdnArgs& args, const BufferRange& z, const GdnLayerBuffers& L,
                           const BufferRange& o) {
  const size_t f = size_t(args.T) * 4, vdim = size_t(args.Hv) * args.Dv;
  Dispatch d(ctx, "gdn.metal", "gdn_gated_norm");
  d.args(args)
      .read("z", z, f * vdim)
      .weight("norm_w", {L.norm_w, 0})
      .write("o", o, f * vdim)
      .declare_read(o.buf, f * vdim, o.off);
  d.run({args.Hv, args.T, 1}, {32 * div_up(args.Dv, 32), 1, 1});
}

bool gdn_prefill_fits(int Dk, int Dv) {
  return Dk % LILY_GDN_SCAN_SPLIT == 0 && uint64_t(LILY_GDN_SCAN_SPLIT) * Dv <= LILY_GDN_SCAN_MAX_THREADS;
}

void encode_gdn_prepare(EncoderContext& ctx, const GdnArgs& args, const BufferRange& qkv, const BufferRange& b,
                        const BufferRange& a, const GdnLayerBuffers& L, const GdnStateView& st,
                        const BufferRange& x, const BufferRange& gates) {
  const size_t f = size_t(args.T) * 4, C = args.C, Hv = args.Hv;
  Dispatch d(ctx, "gdn_prefill.metal", "gdn_prepare");
  d.args(args)
      .read("qkv", qkv, f * C)
      .weight("taps", {L.taps, 0})
      .state("window", st.window_in, false, st.window_in->length())
      .read("b", b, f * Hv)
      .read("a", a, f * Hv)
      .weight("a_neg", {L.a_neg, 0})
      .weight("dt_bias", {L.dt_bias, 0})
      .write("x", x, f * C)
      .write("gates", gates, f * Hv * 2)
      .state("window_out", st.window_out, true, st.window_out->length());
  d.run({2 * args.Hk + args.Hv, args.T, 1}, {LILY_GDN_PREP_THREADS, 1, 1});
}

void encode_gdn_scan(EncoderContext& ctx, const GdnArgs& args, const BufferRange& x, const BufferRange& gates,
                     const BufferRange& z, const GdnLayerBuffers& L, const GdnStateView& st, const BufferRange& o) {
  const size_t f = size_t(args.T) * 4, C = args.C, vdim = size_t(args.Hv) * args.Dv, Hv = args.Hv;
  Dispatch d(ctx, "gdn_prefill.metal", "gdn_scan_dk" + std::to_string(args.Dk));
  d.args(args)
      .read("x", x, f * C)
      .read("gates", gates, f * Hv * 2)
      .read("z", z, f * vdim)
      .weight("norm_w", {L.norm_w, 0})
      .state("S", st.S_in, false, st.S_in->length())
      .write("o", o, f * vdim)
      .state("S_out", st.S_out, true, st.S_out->length());
  d.run({args.Hv, 1, 1}, {32 * div_up(uint64_t(LILY_GDN_SCAN_SPLIT) * args.Dv, 32), 1, 1});
}

}  // namespace lily::gpu
