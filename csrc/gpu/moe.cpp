// MoE family encoding (metal/moe.metal, metal/moe_tensor.metal): routing; the decode
// feed-forward as gather-GEMVs (gate + up + SwiGLU, then down + weighted combine + the
// sigmoid-gated shared expert); prefill as a routing plan on the GPU and grouped GEMMs over it.
// A dense MLP and the shared expert run through the same kernels as one-expert tables.
//
// Shapes (T tokens, E experts, k per token, H hidden, I expert intermediate, Is shared):
// logits [T, E]; ids, weights [T, k] (slot s = t*k + j); decode act [T, k, I], act_s [T, Is];
// prefill act [T*k, I] in sorted order, rows [T*k], blocks [max_blocks] uint4, header [4],
// yr [T*k, H] by slot, ys [T, H]; h, y [T, H].
#include <algorithm>
#include <string>

#include "gpu/encode.h"

namespace lily::gpu {

namespace {
constexpr uint32_t kGemvRows = LILY_GEMV_SIMDGROUPS * LILY_GEMV_ROWS_PER_SIMDGROUP;
constexpr uint32_t kGemvThreads = 32 * LILY_GEMV_SIMDGROUPS;

// An expert matrix as its four parameters: <prefix>_w, _s, _b (the region buffers) and _table.
Dispatch& experts(Dispatch& d, const char* prefix, const ExpertMatrix& m) {
  const std::string p(prefix);
  return d.weight((p + "_w").c_str(), m.w)
      .weight((p + "_s").c_str(), m.s)
      .weight((p + "_b").c_str(), m.b)
      .weight((p + "_table").c_str(), {m.table, 0});
}
}  // namespace

void encode_moe_route(EncoderContext& ctx, const MoeRouteArgs& args, int T, const BufferRange& logits,
                      const BufferRange& ids, const BufferRange& weights) {
  const size_t f = size_t(T) * 4;
  Dispatch d(ctx, "moe.metal", "moe_route");
  d.args(args)
      .read("logits", logits, f * args.E)
      .write("ids", ids, f * args.k)
      .write("weights", weights, f * args.k);
  d.run({uint32_t(T), 1, 1}, {32 * div_up(args.E, 32), 1, 1});
}

void encode_moe_gate_up(EncoderContext& ctx, const ExpertMatrix& gate, const ExpertMatrix& up,
                        const BufferRange& ids, int k, int T, const BufferRange& h, const BufferRange& act) {
  const uint32_t I = gate.m.out;
  const size_t f = size_t(T) * 4;
  MoeGateUpArgs args{gate.m, up.m, uint32_t(k)};
  Dispatch d(ctx, "moe.metal", std::string("moe_gate_up_") + scalar_name(gate.dtype));
  d.args(args);
  experts(d, "gate", gate);
  experts(d, "up", up);
  d.read("ids", ids, f * k)
      .read("h", h, f * gate.m.in)
      .write("act", act, f * k * I)
      .weight_bytes(uint64_t(std::min(T * k, gate.experts)) * (gate.nbytes + up.nbytes));
  d.run({div_up(I, kGemvRows), uint32_t(k), uint32_t(T)}, {kGemvThreads, 1, 1});
}

void encode_moe_down(EncoderContext& ctx, const ExpertMatrix& down, const MoeDownInputs& in, int k, int T, int H,
                     const BufferRange& y) {
  const uint32_t I = down.m.in;
  const size_t f = size_t(T) * 4;
  const ExpertMatrix& sd = in.shared ? *in.shared : down;
  const uint32_t lanes = down.lanes ? down.lanes : moe_down_lanes(down.m, in.shared ? &sd.m : nullptr, k);
  MoeDownArgs args{down.m, sd.m, uint32_t(k), in.weights ? 1u : 0u, in.shared ? 1u : 0u, lanes};
  Dispatch d(ctx, "moe.metal", std::string("moe_down_") + scalar_name(down.dtype));
  d.args(args);
  experts(d, "down", down).read("ids", in.ids, f * k);
  if (in.weights) d.read("weights", *in.weights, f * k);
  else d.unused("weights");
  d.read("act", in.act, f * k * I);
  experts(d, "shared", sd);
  if (in.shared) d.read("shared_act", in.act_s, f * sd.m.in).read("shared_gate", in.sgate, f);
  else d.unused("shared_act").unused("shared_gate");
  d.write("y", y, f * H)
      .weight_bytes(uint64_t(std::min(T * k, down.experts)) * down.nbytes + (in.shared ? sd.nbytes : 0));
  d.run({div_up(H, kGemvRows), uint32_t(T), 1}, {kGemvThreads, 1, 1});
}

uint32_t moe_down_lanes(const QuantMatrix& down, const QuantMatrix* shared, int k) {
  // Loads per row: 16-byte runs (vec), 32-bit words, or dense elements (quant.h).
  auto loads = [](const QuantMatrix& m) { return m.bits == 0 ? m.in : m.in * m.bits / (m.vec ? 128 : 32); };
  const int jobs = k + (shared ? 1 : 0);
  uint32_t best = 32;
  uint64_t best_steps = UINT64_MAX;
  for (uint32_t lanes = 32; lanes >= 4; lanes /= 2) {
    const uint32_t teams = 32 / lanes;
    uint64_t steps = 0;  // of the busiest team: job j runs on team j % teams
    for (uint32_t p = 0; p < teams; ++p) {
      uint64_t s = 0;
      for (int j = int(p); j < jobs; j += int(teams)) s += div_up(loads(j < k ? down : *shared), lanes);
      steps = std::max(steps, s);
    }
    if (steps < best_steps) {
      best = lanes;
      best_steps = steps;
    }
  }
  return best;
}

void encode_moe_plan(EncoderContext& ctx, const MoePlanArgs& args, uint32_t max_blocks, const BufferRange& ids,
                     const BufferRange& rows, const BufferRange& blocks, const BufferRange& header) {
  Dispatch d(ctx, "moe.metal", "moe_plan");
  d.args(args)
      .read("ids", ids, size_t(args.n) * 4)
      .write("rows", rows, size_t(args.n) * 4)
      .write("blocks", blocks, size_t(max_blocks) * 16)
      .write("header", header, 16);
  d.run({1, 1, 1}, {LILY_MOE_PLAN_THREADS, 1, 1});
}

namespace {
// The block map a routed grouped GEMM reads, or (not routed) dummies it does not read.
Dispatch& plan_inputs(Dispatch& d, const GroupedGemm& g, const MoePlanBuffers& plan) {
  if (!g.routed) return d.unused("blocks").unused("header").unused("rows");
  return d.read("blocks", plan.blocks, size_t(g.blocks) * 16)
      .read("header", plan.header, 16)
      .read("rows", plan.rows, size_t(g.rows) * 4);
}
}  // namespace

void encode_moe_gemm_gate_up(EncoderContext& ctx, const ExpertMatrix& gate, const ExpertMatrix& up,
                             const GroupedGemm& g, const MoePlanBuffers& plan, int T, int H, const BufferRange& h,
                             const BufferRange& act) {
  const uint32_t I = gate.m.out;
  MoeGemmArgs args{gate.m, up.m, uint32_t(g.routed ? g.k : 1), g.routed ? 1u : 0u, g.rows};
  Dispatch d(ctx, gemm_library("moe", g.tensor), gemm_kernel("moe_gemm_gate_up", g.tensor, gate.dtype, g.bm));
  d.args(args);
  experts(d, "gate", gate);
  experts(d, "up", up);
  plan_inputs(d, g, plan)
      .read("h", h, size_t(T) * H * 4)
      .write("act", act, size_t(g.rows) * I * 4)
      .weight_bytes(uint64_t(std::min<int64_t>(g.rows, gate.experts)) * (gate.nbytes + up.nbytes));
  d.run({div_up(I, LILY_GEMM_BN), g.blocks, 1}, {LILY_GEMM_THREADS, 1, 1});
}

void encode_moe_gemm_down(EncoderContext& ctx, const ExpertMatrix& down, const GroupedGemm& g,
                          const MoePlanBuffers& plan, const BufferRange& act, const BufferRange& out) {
  const uint32_t H = down.m.out;
  MoeGemmArgs args{down.m, down.m, uint32_t(g.routed ? g.k : 1), g.routed ? 1u : 0u, g.rows};
  Dispatch d(ctx, gemm_library("moe", g.tensor), gemm_kernel("moe_gemm_down", g.tensor, down.dtype, g.bm));
  d.args(args);
  experts(d, "down", down);
  plan_inputs(d, g, plan);
  if (g.routed) d.read("weights", plan.weights, size_t(g.rows) * 4);
  else d.unused("weights");
  d.read("act", act, size_t(g.rows) * down.m.in * 4)
      .write("out", out, size_t(g.rows) * H * 4)
      .weight_bytes(uint64_t(std::min<int64_t>(g.rows, down.experts)) * down.nbytes);
  d.run({div_up(H, LILY_GEMM_BN), g.blocks, 1}, {LILY_GEMM_THREADS, 1, 1});
}

void encode_moe_combine(EncoderContext& ctx, const MoeCombineArgs& args, int T, const BufferRange& yr,
                        const BufferRange* ys, const BufferRange* sgate, const BufferRange& y) {
  const size_t H = args.H;
  Dispatch d(ctx, "moe.metal", "moe_combine");
  d.args(args).read("yr", yr, size_t(T) * args.k * H * 4);
  if (ys) d.read("ys", *ys, size_t(T) * H * 4).read("sg", *sgate, size_t(T) * 4);
  else d.unused("ys").unused("sg");
  d.write("y", y, size_t(T) * H * 4);
  d.run({div_up(H, 256), uint32_t(T), 1}, {256, 1, 1});
}

}  // namespace lily::gpu
