// The GPU host's encoding functions, one file per op family as metal/ and csrc/cpu/ are:
//   quant.cpp      embed, gemv, gemm (a Linear's projection)
//   norm.cpp       add_rms_norm
//   attention.cpp  attn_prepare, attn_decode (+ attn_combine), attn_prefill
//   gdn.cpp        gdn_ungroup, gdn_conv, gdn_recurrence, gdn_prepare, gdn_scan
//   moe.cpp        moe_route, moe_gate_up, moe_down; prefill moe_plan, grouped GEMMs, moe_combine
//   sampling.cpp   sample (and the device decode loop of GpuBackend)
// Each encode_* function is one kernel's contract: it fills nothing but the dispatch (the caller
// passes the kernel's argument struct, metal/*_args.h), binds the buffers in the kernel's order
// (args, reads, writes: encoder.h), declares the bytes each touches and sizes the grid. What to
// run when (decode or prefill route, splits, parity of the state copies) is GpuBackend's.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/encoder.h"
#include "model/dtype.h"

// The argument structs shared with the kernels (plain 32-bit fields, a static_assert on each size).
#include "metal/attention_args.h"
#include "metal/attention_prefill_args.h"
#include "metal/gdn_args.h"
#include "metal/gdn_prefill_args.h"
#include "metal/moe_args.h"
#include "metal/norm_args.h"
#include "metal/quant_args.h"
#include "metal/sampling_args.h"

namespace lily::gpu {

// ---- weights -------------------------------------------------------------------------------------

// A weight matrix as the quant kernels read it: packed (or dense) words, scales and biases
// (the dummy buffer for dense matrices), its shape and format.
struct LinearBuffers {
  BufferRange w, scales, biases;
  QuantMatrix m{};
  DType dtype = DType::F32;
  uint64_t nbytes = 0;  // bytes of the whole matrix (weights + scales + biases)
};

// One matrix kind of a MoE block (or a dense MLP): the buffers its experts live in and the
// [E, 3] byte offsets (w, scales, biases) of each expert's matrix into them.
struct ExpertMatrix {
  BufferRange w, s, b;            // bound at offset 0 of each region buffer
  std::shared_ptr<Buffer> table;  // [n, 3] uint64 offsets
  QuantMatrix m{};
  DType dtype = DType::F32;
  uint64_t nbytes = 0;  // one expert's matrix
  int experts = 0;
  uint32_t lanes = 0;  // a down matrix: moe_down's lanes per job, set at load (DeviceWeights::tables)
};

// Offset tables of one MoE block (or one dense MLP: gate, up, down of one "expert").
struct ExpertTables {
  ExpertMatrix gate, up, down, shared_gate, shared_up, shared_down;
};

// "float", "half", "bfloat": the S of kernel names (throws ConfigError for other dtypes).
const char* scalar_name(DType t);
// The rows of the pass a sequence-table dispatch spans (its activations are bound from their
// start, each sequence's rows placed by its `first`): up to the last sequence's last row.
template <typename Seq>
size_t rows_spanned(const std::vector<Seq>& seqs) {
  size_t end = 0;
  for (const Seq& s : seqs) end = std::max<size_t>(end, size_t(s.first) + s.n);
  return end;
}

// Throws ConfigError unless `value` is one of the sizes a kernel family is instantiated for
// (`what`: "head_dim 80 has no attention kernels", `where`: the list's macro).
void check_instantiated(int value, const std::vector<int>& sizes, const std::string& what, const char* where);

// ---- quant.cpp -----------------------------------------------------------------------------------

// Whether the GEMM tiles (metal/gemm.h) read matrix m: affine widths must be whole K steps
// (every MLX group size is a multiple of 32); dense ones any width.
bool tiles_fit(const QuantMatrix& m);
// Whether the GEMVs may read m's packed rows 16 bytes per lane per step (QuantMatrix::vec): every
// row starts 16-byte aligned, as rows are whole 16-byte runs (in * bits % 128 == 0) and each
// matrix start (one per expert) is at a 16-byte aligned device address. Dense m: false.
bool vector_rows(const QuantMatrix& m, const std::vector<uint64_t>& starts);
// The device address of a bound range as far as the host sees it: the buffer's CPU view plus the
// offset, or the offset alone for a buffer without one (device allocations start page-aligned).
uint64_t device_address(const BufferRange& r);
// The GEMM block height for tiles that hold `rows` rows on average (8 or 32).
int gemm_block_rows(uint64_t rows);
// Kernel <family>[_tensor]_<S>_bm<BM> and the library it is in (<base>.metal or <base>_tensor.metal).
std::string gemm_kernel(const char* family, bool tensor, DType t, int bm);
std::string gemm_library(const char* base, bool tensor);

// x[t, :] = E[tokens[t], :] for t < T  (embed_<S>)
void encode_embed(EncoderContext& ctx, const LinearBuffers& E, uint32_t vocab, const BufferRange& tokens,
                  const BufferRange& x, int T);
// y[t, :out) = W x[t, :in) for t < T, rows ldx / ldy floats apart  (gemv_<S>: decode, short chunks)
void encode_gemv(EncoderContext& ctx, const LinearBuffers& W, const BufferRange& x, int ldx, const BufferRange& y,
                 int ldy, int T);
// The same as a tiled GEMM (gemm[_tensor]_<S>_bm<BM>: prefill chunks); W must fit the tiles.
void encode_gemm(EncoderContext& ctx, const LinearBuffers& W, const BufferRange& x, int ldx, const BufferRange& y,
                 int ldy, int T, bool tensor);

// ---- norm.cpp ------------------------------------------------------------------------------------

// x[t] += y[t] (args.add); h[t] = rmsnorm(x[t]) * w  for t < T  (add_rms_norm)
void encode_add_rms_norm(EncoderContext& ctx, const NormArgs& args, int T, const BufferRange& y,
                         const std::shared_ptr<Buffer>& w, const BufferRange& x, const BufferRange& h);

// ---- attention.cpp -------------------------------------------------------------------------------

// One layer's KV cache of a sequence: contiguous K, V [Hkv, cap, D], or the fixed-block
// layout's table and K / V arenas (csrc/gpu/kv_cache.cpp). The kernels reach it by address
// (metal/attention_args.h AttnSeq), so a dispatch serves several sequences.
struct KvCacheView {
  std::shared_ptr<Buffer> k, v;                        // contiguous
  std::shared_ptr<Buffer> table;                       // blocks: [n_blocks] arena << 24 | slot
  std::vector<std::shared_ptr<Buffer>> k_arenas, v_arenas;
  bool blocks = false;
  bool half = false;  // f16 elements (else f32)
  uint32_t cap = 0;   // contiguous: capacity (positions); blocks: positions per block
  std::string kernel_suffix() const;  // "[blocks_]<float|half>"
};

// One sequence of an attention dispatch: its cache, its rows of the pass's qg, k, v and o, its
// position, and (decode) its split-K and partials slot. Its AttnSeq table entry is made from it.
struct AttnSeqView {
  KvCacheView kv;
  uint32_t first = 0, n = 0, pos0 = 0;
  uint32_t n_splits = 1, split_len = 0;
  uint32_t part = 0;  // its slot of the split-K partials [slot, Hq, max_splits, D]
};

// The attention kernels take every sequence of a dispatch in one table (at most
// LILY_ATTN_MAX_SEQS, all of one cache layout and element type: one kernel); the grid's rows
// are the sequences' rows in table order, and the activations are bound from their start.
//
// q, k normed and rotated; k, v written into each sequence's cache at its positions
// (attn_prepare_[blocks_]<KV>): grid (Hq + Hkv, rows). qg is updated in place.
void encode_attn_prepare(EncoderContext& ctx, AttnPrepareArgs args, const std::vector<AttnSeqView>& seqs,
                         const std::shared_ptr<Buffer>& k, const std::shared_ptr<Buffer>& v,
                         const std::shared_ptr<Buffer>& q_norm, const std::shared_ptr<Buffer>& k_norm,
                         const std::shared_ptr<Buffer>& inv_freq, const std::shared_ptr<Buffer>& qg);
// Decode attention over each sequence's cache (attn_decode_[blocks_]<KV>_d<D>): o [T, Hq, D] for a
// sequence of one split, else its splits' partials in its slot of part_o / part_ml, which
// encode_attn_combine (attn_combine) then merges into o (it encodes nothing when no sequence
// is split). Two calls, so the combine is one stage after all of a pass's decodes.
void encode_attn_decode(EncoderContext& ctx, AttnArgs args, const std::vector<AttnSeqView>& seqs,
                        const std::shared_ptr<Buffer>& qg, const std::shared_ptr<Buffer>& o,
                        const std::shared_ptr<Buffer>& part_o, const std::shared_ptr<Buffer>& part_ml);
void encode_attn_combine(EncoderContext& ctx, AttnArgs args, const std::vector<AttnSeqView>& seqs,
                         const std::shared_ptr<Buffer>& qg, const std::shared_ptr<Buffer>& o,
                         const std::shared_ptr<Buffer>& part_o, const std::shared_ptr<Buffer>& part_ml);
// Bytes of one decode's split-K partials over `splits` splits: part_o [Hq, splits, D] and
// part_ml [Hq, splits, 2] (f32): one slot.
struct AttnPartialBytes {
  size_t o, ml;
};
AttnPartialBytes attn_partial_bytes(size_t Hq, size_t D, size_t splits);
// The splits of s's decode attention over n_ctx positions (s.n_splits, s.split_len): several
// only for a single row past split_threshold positions.
void attn_decode_splits(AttnSeqView& s, int n_ctx, int split_threshold, int split_len, int max_splits,
                        int block_len);
// Whether attn_prefill takes this shape (head dim instantiated, GQA group within a tile).
bool attn_prefill_fits(int D, int group);
// Flash attention of one sequence's chunk over its cache (attn_prefill_[blocks_]<KV>_d<D>):
// o [T, Hq, D] on the chunk's rows.
void encode_attn_prefill(EncoderContext& ctx, const AttnPrefillArgs& args, const AttnSeqView& seq,
                         const std::shared_ptr<Buffer>& qg, const std::shared_ptr<Buffer>& o);
// Throws ConfigError unless the attention kernels are instantiated for head_dim D.
void check_attention_head_dim(int D);

// ---- gdn.cpp -------------------------------------------------------------------------------------

// The DeltaNet buffers of one layer and pass: the state copy read and the one written.
struct GdnStateView {
  std::shared_ptr<Buffer> window_in, window_out;  // [K-1, C]
  std::shared_ptr<Buffer> S_in, S_out;            // [Hv, Dk, Dv]
};
struct GdnLayerBuffers {  // per-channel vectors of the layer (f32)
  std::shared_ptr<Buffer> taps, a_neg, dt_bias, norm_w;
};
// One sequence of a decode-route DeltaNet dispatch: its state and its rows of the pass.
struct GdnSeqView {
  GdnStateView st;
  uint32_t first = 0, n = 0;
};

// Qwen3-Next's grouped projections scattered into qkv, z, b, a (gdn_ungroup).
void encode_gdn_ungroup(EncoderContext& ctx, const GdnArgs& args, const BufferRange& qkvz, const BufferRange& ba,
                        const BufferRange& qkv, const BufferRange& z, const BufferRange& b, const BufferRange& a);
// Decode route: conv1d over [window ; rows] + SiLU (gdn_conv), the recurrence
// (gdn_recurrence_dk<Dk>), each one dispatch for all the sequences in `seqs` (at most
// LILY_GDN_MAX_SEQS; activations bound from their start, rows placed by each entry), then the
// gated RMSNorm of its output in place (gdn_gated_norm, row-wise over args.T rows from o).
void encode_gdn_conv(EncoderContext& ctx, const GdnArgs& args, const std::vector<GdnSeqView>& seqs,
                     const std::shared_ptr<Buffer>& qkv, const GdnLayerBuffers& L,
                     const std::shared_ptr<Buffer>& conv_out);
void encode_gdn_recurrence(EncoderContext& ctx, const GdnArgs& args, const std::vector<GdnSeqView>& seqs,
                           const std::shared_ptr<Buffer>& conv_out, const std::shared_ptr<Buffer>& b,
                           const std::shared_ptr<Buffer>& a, const GdnLayerBuffers& L,
                           const std::shared_ptr<Buffer>& o);
void encode_gdn_gated_norm(EncoderContext& ctx, const GdnArgs& args, const BufferRange& z, const GdnLayerBuffers& L,
                           const BufferRange& o);
// Prefill route (T > 1): gdn_prepare (conv, SiLU, norms, gates for every token at once), then
// gdn_scan_dk<Dk> (the recurrence over the chunk, state in registers).
bool gdn_prefill_fits(int Dk, int Dv);
void encode_gdn_prepare(EncoderContext& ctx, const GdnArgs& args, const BufferRange& qkv, const BufferRange& b,
                        const BufferRange& a, const GdnLayerBuffers& L, const GdnStateView& st,
                        const BufferRange& x, const BufferRange& gates);
void encode_gdn_scan(EncoderContext& ctx, const GdnArgs& args, const BufferRange& x, const BufferRange& gates,
                     const BufferRange& z, const GdnLayerBuffers& L, const GdnStateView& st, const BufferRange& o);
// Throws ConfigError unless the DeltaNet kernels are instantiated for key head dim Dk.
void check_gdn_key_dim(int Dk, int Dv);

// ---- moe.cpp -------------------------------------------------------------------------------------

// Softmax + top-k (ties to the lowest id) + renormalisation per token (moe_route): ids, weights [T, k].
void encode_moe_route(EncoderContext& ctx, const MoeRouteArgs& args, int T, const BufferRange& logits,
                      const BufferRange& ids, const BufferRange& weights);
// Decode feed-forward (gather-GEMV). act[t, j, :] = silu(gate_e . h[t]) * (up_e . h[t]) for
// e = ids[t, j], j < k (a dense MLP or the shared expert: one job, ids a zero buffer).
void encode_moe_gate_up(EncoderContext& ctx, const ExpertMatrix& gate, const ExpertMatrix& up,
                        const BufferRange& ids, int k, int T, const BufferRange& h, const BufferRange& act);
// y[t] = sum_j w[t, j] down_e . act[t, j]  (+ sigmoid(sgate[t]) shared_down . act_s[t]).
struct MoeDownInputs {
  BufferRange ids;                       // [T, k] (one job: a zero buffer)
  const BufferRange* weights = nullptr;  // [T, k]; nullptr: every job weighs 1 (dense MLP)
  const ExpertMatrix* shared = nullptr;  // the shared expert, or none
  BufferRange act, act_s, sgate;
};
// MoeDownArgs::lanes: down.lanes, chosen once at load (0: moe_down_lanes here, on every call).
void encode_moe_down(EncoderContext& ctx, const ExpertMatrix& down, const MoeDownInputs& in, int k, int T, int H,
                     const BufferRange& y);
// Lanes per job of moe_down (MoeDownArgs::lanes: 32, 16, 8 or 4): the team width whose busiest
// team makes the fewest loads over the k jobs and the shared expert (`shared`, or none), ties to
// the wider team. A shape-only choice: the same for every T.
uint32_t moe_down_lanes(const QuantMatrix& down, const QuantMatrix* shared, int k);
// Prefill: ids -> sorted slots and the block map (moe_plan; one threadgroup).
void encode_moe_plan(EncoderContext& ctx, const MoePlanArgs& args, uint32_t max_blocks, const BufferRange& ids,
                     const BufferRange& rows, const BufferRange& blocks, const BufferRange& header);
// The grouped GEMMs over the block map (routed) or over rows 0..T of one expert (not routed).
struct MoePlanBuffers {
  BufferRange rows, blocks, header, weights;  // moe_plan's output and the routing weights
};
struct GroupedGemm {
  bool routed = false;
  int k = 1;               // jobs per token
  int bm = 8;              // block height
  uint32_t blocks = 0;     // grid rows: max_blocks (routed) or ceil(T / bm)
  uint32_t rows = 0;       // T*k (routed) or T
  bool tensor = false;     // Metal 4 matmul2d kernels (moe_tensor.metal)
};
void encode_moe_gemm_gate_up(EncoderContext& ctx, const ExpertMatrix& gate, const ExpertMatrix& up,
                             const GroupedGemm& g, const MoePlanBuffers& plan, int T, int H, const BufferRange& h,
                             const BufferRange& act);
void encode_moe_gemm_down(EncoderContext& ctx, const ExpertMatrix& down, const GroupedGemm& g,
                          const MoePlanBuffers& plan, const BufferRange& act, const BufferRange& out);
// y = the sum of a token's k weighted slots (+ the sigmoid-gated shared expert) (moe_combine).
void encode_moe_combine(EncoderContext& ctx, const MoeCombineArgs& args, int T, const BufferRange& yr,
                        const BufferRange* ys, const BufferRange* sgate, const BufferRange& y);

// ---- sampling.cpp --------------------------------------------------------------------------------

// The tokens of the rows of a step, one dispatch (a threadgroup per row, args[r] its parameters):
// row r of logits [rows, stride] (argmax or a seeded draw) into token [r] with its status
// [r, 4] beside it; row r's generator state rng [r, 4] advances in place.
void encode_sample(EncoderContext& ctx, const std::vector<SampleArgs>& args, const BufferRange& logits,
                   const BufferRange& w, const BufferRange& rng, const BufferRange& token, const BufferRange& status);

}  // namespace lily::gpu
