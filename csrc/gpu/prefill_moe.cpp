// Prefill encoding of the GPU backend's projections and feed-forward: a chunk of T >=
// GpuOptions::gemm_min_rows tokens (shorter chunks and decode keep the GEMV kernels).
//
// Design choices:
// - Dense projections are one tiled GEMM each (metal/gemm.h via gemm_<S>_bm<BM>): weights are
//   dequantized a tile at a time into threadgroup memory, never written back, so a chunk
//   reads each weight byte once per 8 or 32 rows instead of once per row as the GEMV does.
// - MoE routing stays on the GPU inside the chunk's command buffer: after moe() has run the
//   router GEMM and moe_route (top-k, ties to the lowest id, renormalisation), moe_plan builds
//   the per-expert histogram, prefix scans, the scatter of (token, job) slots sorted by expert
//   and the block map. Every buffer is sized by the bound T*k rows and
//   min(E, T*k) + T*k / BM blocks, so the grids are known when encoding and the CPU never
//   reads counts back: a chunk still has no CPU wait (one at lm_head, as in decode).
// - Grouped GEMMs run over the block map: an expert without tokens has no block (its weights
//   are not read), and threadgroups past the blocks in use return at once. gate and up share
//   the X tile and fuse SwiGLU; down scales each row by its routing weight and scatters it to
//   its slot; moe_combine then sums a token's k slots in order and adds the sigmoid-gated
//   shared expert, so the result does not depend on how rows were sorted.
// - The block height BM (8 or 32) follows the rows per tile: the average rows per expert for
//   routed experts, T for the shared expert, a dense MLP and projections. A heuristic, not
//   tuned on hardware (nothing here has run on an Apple GPU).
// - The shared expert and a dense MLP are the same grouped kernels with routed = 0 (one
//   expert, rows 0..T), so there is one implementation of each GEMM.
//
// Shapes: h [T, H]; ids, wts [T, k] (slot s = t*k + j); act [T*k, I] in sorted order; yr
// [T*k, H] by slot; act_s [T, Is]; ys [T, H]; y [T, H].
#include <algorithm>
#include <initializer_list>
#include <string>

#include "gpu/encode.h"

namespace lily::gpu {

namespace {

constexpr uint32_t kGemmThreads = LILY_GEMM_THREADS;

// The GEMM block height for tiles that hold `rows` rows on average.
int block_rows(uint64_t rows) { return rows >= 32 ? 32 : 8; }

// gemm_<S>_bm<BM> (simdgroup_matrix) or gemm_tensor_<S>_bm<BM> (Metal 4 matmul2d): the same
// kernel template over the two inner products (metal/gemm.h), picked at load time.
std::string gemm_name(const char* family, bool tensor, DType t, int bm) {
  return std::string(family) + (tensor ? "_tensor_" : "_") + scalar_name(t) + "_bm" + std::to_string(bm);
}

}  // namespace

bool GpuBackend::gemm_fits(const Linear& W) const { return tiles_fit(matrix(W, "a projection")); }

bool GpuBackend::grouped_fits(const ExpertTables& tb) const {
  for (const auto* m : {&tb.gate, &tb.up, &tb.down, &tb.shared_gate, &tb.shared_up, &tb.shared_down})
    if (!tiles_fit(m->m)) return false;  // (absent shared matrices are zero: dense, fit)
  return c_.n_experts <= LILY_MOE_PLAN_THREADS;  // else the GEMV route
}

void GpuBackend::gemm(const Linear& W, const Ref& x, int ldx, const Ref& y, int ldy, int T) {
  GemmArgs args{};
  args.w = matrix(W, "a projection");
  args.rows = uint32_t(T);
  args.ldx = uint32_t(ldx);
  args.ldy = uint32_t(ldy);
  const int bm = block_rows(uint64_t(T));
  Dispatch d(*this, tensor_gemm_ ? "quant_tensor.metal" : "quant.metal", gemm_name("gemm", tensor_gemm_, W.dtype, bm));
  d.projection(W, x, ldx, y, ldy, T).args(5, args);
  d.run({div_up(W.out, LILY_GEMM_BN), div_up(T, bm), 1}, {kGemmThreads, 1, 1});
}

// act[i] = silu(gate_e . x_i) * (up_e . x_i) over `blocks` row blocks: routed, the block map's
// rows (x_i = h[slot / k]); else rows 0..T of expert 0 (x_i = h[i]).
void GpuBackend::gate_up_gemm(const ExpertMatrix& gate, const ExpertMatrix& up, bool routed, int k, int bm,
                              uint32_t blocks, const std::shared_ptr<Buffer>& act) {
  const uint32_t n = uint32_t(routed ? T_ * k : T_), I = gate.m.out;
  MoeGemmArgs a{gate.m, up.m, uint32_t(routed ? k : 1), routed ? 1u : 0u, n};
  Dispatch d(*this, tensor_gemm_ ? "moe_tensor.metal" : "moe.metal", gemm_name("moe_gemm_gate_up", tensor_gemm_, gate.dtype, bm));
  d.experts(0, gate).experts(4, up)
      .buf(8, routed ? plan_blocks_ : dummy_).buf(9, routed ? plan_header_ : dummy_)
      .buf(10, routed ? plan_rows_ : dummy_).buf(11, h_).buf(12, act).args(13, a)
      .reads(h_, size_t(T_) * c_.hidden * 4).writes(act, size_t(n) * I * 4)
      .weight_bytes(uint64_t(std::min<int64_t>(n, gate.experts)) * (gate.nbytes + up.nbytes));
  if (routed) d.reads(plan_blocks_, size_t(blocks) * 16).reads(plan_header_, 16).reads(plan_rows_, size_t(n) * 4);
  d.run({div_up(I, LILY_GEMM_BN), blocks, 1}, {kGemmThreads, 1, 1});
}

// Routed: yr[slot] = wts[slot] * down_e . act[i] for each block-map row i; else out[i] = down . act[i].
void GpuBackend::down_gemm(const ExpertMatrix& down, bool routed, int k, int bm, uint32_t blocks,
                           const std::shared_ptr<Buffer>& act, const std::shared_ptr<Buffer>& out) {
  const uint32_t n = uint32_t(routed ? T_ * k : T_), H = down.m.out;
  MoeGemmArgs a{down.m, down.m, uint32_t(routed ? k : 1), routed ? 1u : 0u, n};
  Dispatch d(*this, tensor_gemm_ ? "moe_tensor.metal" : "moe.metal", gemm_name("moe_gemm_down", tensor_gemm_, down.dtype, bm));
  d.experts(0, down)
      .buf(4, routed ? plan_blocks_ : dummy_).buf(5, routed ? plan_header_ : dummy_)
      .buf(6, routed ? plan_rows_ : dummy_).buf(7, routed ? wts_ : dummy_).buf(8, act).buf(9, out).args(10, a)
      .reads(act, size_t(n) * down.m.in * 4).writes(out, size_t(n) * H * 4)
      .weight_bytes(uint64_t(std::min<int64_t>(n, down.experts)) * down.nbytes);
  if (routed)
    d.reads(plan_blocks_, size_t(blocks) * 16).reads(plan_header_, 16).reads(plan_rows_, size_t(n) * 4)
        .reads(wts_, size_t(n) * 4);
  d.run({div_up(H, LILY_GEMM_BN), blocks, 1}, {kGemmThreads, 1, 1});
}

void GpuBackend::mlp_prefill(const ExpertTables& tb) {
  const int bm = block_rows(uint64_t(T_));
  const uint32_t blocks = div_up(T_, bm);
  gate_up_gemm(tb.gate, tb.up, false, 1, bm, blocks, act_);
  down_gemm(tb.down, false, 1, bm, blocks, act_, y_);
}

void GpuBackend::moe_prefill(const ExpertTables& tb) {
  const int T = T_, H = c_.hidden, E = c_.n_experts, k = c_.top_k;
  const bool shared = c_.shared_intermediate > 0;
  if (!grouped_fits(tb)) throw Error("[gpu] moe_prefill: the experts do not suit the grouped GEMMs");
  const uint32_t n = uint32_t(T) * uint32_t(k);
  const int bm = block_rows(n / uint32_t(E));  // rows per expert on average
  const uint32_t max_blocks = std::min<uint32_t>(uint32_t(E), n) + n / uint32_t(bm);
  grow(plan_rows_, size_t(n) * 4);
  grow(plan_blocks_, size_t(max_blocks) * 16);
  grow(plan_header_, 16);
  grow(yr_, size_t(n) * H * 4);
  if (shared) grow(ys_, size_t(T) * H * 4);

  {  // ids [T, k] (moe_route, encoded by moe()) -> sorted slots and the block map
    MoePlanArgs a{n, uint32_t(E), uint32_t(bm)};
    Dispatch d(*this, "moe.metal", "moe_plan");
    d.buf(0, ids_).buf(1, plan_rows_).buf(2, plan_blocks_).buf(3, plan_header_).args(4, a)
        .reads(ids_, size_t(n) * 4).writes(plan_rows_, size_t(n) * 4)
        .writes(plan_blocks_, size_t(max_blocks) * 16).writes(plan_header_, 16);
    d.run({1, 1, 1}, {LILY_MOE_PLAN_THREADS, 1, 1});
  }
  if (shared) {  // independent of the routing: shares its stages
    const int sbm = block_rows(uint64_t(T));
    gate_up_gemm(tb.shared_gate, tb.shared_up, false, 1, sbm, div_up(T, sbm), act_s_);
    down_gemm(tb.shared_down, false, 1, sbm, div_up(T, sbm), act_s_, ys_);
  }
  gate_up_gemm(tb.gate, tb.up, true, k, bm, max_blocks, act_);
  down_gemm(tb.down, true, k, bm, max_blocks, act_, yr_);
  {
    MoeCombineArgs a{uint32_t(H), uint32_t(k), shared ? 1u : 0u};
    Dispatch d(*this, "moe.metal", "moe_combine");
    d.buf(0, yr_).buf(1, shared ? ys_ : dummy_).buf(2, shared ? sgate_ : dummy_).buf(3, y_).args(4, a)
        .reads(yr_, size_t(n) * H * 4).writes(y_, size_t(T) * H * 4);
    if (shared) d.reads(ys_, size_t(T) * H * 4).reads(sgate_, size_t(T) * 4);
    d.run({div_up(H, 256), uint32_t(T), 1}, {256, 1, 1});
  }
}

}  // namespace lily::gpu
