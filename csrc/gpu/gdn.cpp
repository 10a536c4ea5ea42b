// Gated DeltaNet family encoding (metal/gdn.metal, metal/gdn_prefill.metal).
//
// Shapes: qkv [T, C], C = 2*Hk*Dk + Hv*Dv ([q | k | v]); z [T, Hv*Dv]; b, a [T, Hv]; conv window
// [K-1, C]; state S [Hv, Dk, Dv] f32; x [T, C] after conv + SiLU (+ q/k norms in prefill);
// gates [T, Hv, 2]; o [T, Hv*Dv]. Qwen3-Next's grouped inputs: qkvz [T, C + Hv*Dv], ba [T, 2*Hv].
// State is read from one copy and written to the other (GpuState's parity), so a pass can be
// undone; both are declared as state (their traffic counted apart from activations).
#include <string>

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

void encode_gdn_conv(EncoderContext& ctx, const GdnArgs& args, const BufferRange& qkv, const GdnLayerBuffers& L,
                     const GdnStateView& st, const BufferRange& conv_out) {
  const size_t f = size_t(args.T) * 4, C = args.C;
  Dispatch d(ctx, "gdn.metal", "gdn_conv");
  d.args(args)
      .read("qkv", qkv, f * C)
      .weight("taps", {L.taps, 0})
      .state("window", st.window_in, false, st.window_in->length())
      .write("out", conv_out, f * C)
      .state("window_out", st.window_out, true, st.window_out->length());
  d.run({div_up(C, 256), 1, 1}, {256, 1, 1});
}

void encode_gdn_recurrence(EncoderContext& ctx, const GdnArgs& args, const BufferRange& conv_out,
                           const BufferRange& b, const BufferRange& a, const GdnLayerBuffers& L,
                           const GdnStateView& st, const BufferRange& o) {
  const size_t f = size_t(args.T) * 4, C = args.C, vdim = size_t(args.Hv) * args.Dv, Hv = args.Hv;
  Dispatch d(ctx, "gdn.metal", "gdn_recurrence_dk" + std::to_string(args.Dk));
  d.args(args)
      .read("conv_out", conv_out, f * C)
      .read("b", b, f * Hv)
      .read("a", a, f * Hv)
      .weight("a_neg", {L.a_neg, 0})
      .weight("dt_bias", {L.dt_bias, 0})
      .state("S", st.S_in, false, st.S_in->length())
      .write("o", o, f * vdim)
      .state("S_out", st.S_out, true, st.S_out->length());
  d.run({args.Hv, div_up(args.Dv, LILY_GDN_COLUMNS), 1}, {LILY_GDN_COLUMNS, 1, 1});
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
