// The GPU backend: the coarse Backend ops (model/backend.h) encoded as compute dispatches over a
// gpu::Device — real Metal (csrc/metal/) or the MSL-on-CPU runtime (csrc/msl_cpu/), the same
// dispatch sequence for both.
//
// The tree (as metal/ and csrc/cpu/):
//   encoder.{h,cpp}      EncoderContext (command buffer, hazards, stats, pipelines) + Dispatch
//   encode.h             the encode_* functions, one file per op family:
//                        quant.cpp norm.cpp attention.cpp gdn.cpp moe.cpp sampling.cpp
//   activations.{h,cpp}  the activation buffers, a shape per buffer
//   device_weights.{h,cpp}  the checkpoint as device buffers (zero-copy), expert tables
//   kv_cache.cpp         KV cache growth: contiguous, then fixed blocks for long contexts
//   backend.{h,cpp}      this file: which kernels run when, and the sequence state
//
// Design choices:
// - One command buffer and one *concurrent* compute encoder per forward pass. Every dispatch
//   declares the activation/state bytes it reads and writes; gpu::HazardTracker places a
//   memory barrier only at a real data edge, so independent projections (q, k, v; DeltaNet's
//   four input projections; the shared expert beside the routed ones) share a stage.
// - The CPU waits once per pass: at lm_head, whose logits it must hand back. A pass without
//   logits (a prefill chunk that is not the last) is committed when the next one starts or the
//   state is read. An exception while a pass is encoded (a pipeline limit, a bad shape)
//   discards that pass unexecuted and puts the state back (abandon_pass), so the next request
//   runs on a clean command buffer.
// - Weights are never copied (device_weights.h). A sequence's state plus the weights must fit
//   the device's recommended working set: new_state refuses a context that does not, and
//   max_fitting_context() tells the largest that does.
// - Activations and state are f32 (the CPU backend's precision; KV optionally f16).
// - A pass may hold several sequences (continuous batching: batches() is true). Embed, norms,
//   projections, the MLP / MoE and the head run over all T rows at once (weights read once);
//   the mixers (attention prepare + decode / prefill, DeltaNet conv + recurrence / prepare +
//   scan) are encoded once per segment, on that segment's rows of the activations (a byte
//   offset) and its own KV cache, DeltaNet state and position. The kernels take one sequence
//   per dispatch, so a decode pass of B sequences has B mixer dispatches per layer (a kernel
//   that walks a per-row table of caches and states would make that one; not done yet).
//   Each segment's mixer dispatches are the ones its sequence alone would get, and the
//   row-wise kernels compute a row the same way whatever T is, so batched logits are
//   bit-identical to solo ones as long as the pass stays on the GEMV route: batch_rows() keeps
//   passes of several sequences below gemm_min_rows (Engine::step splits larger steps).
//   The device decode loop runs such passes too: one decode row per sequence, each row's
//   token chosen on the device with its own sampling parameters and generator state.
// - Decode is the target (T = 1). Chunks of at least GpuOptions::gemm_min_rows tokens take
//   tiled GEMMs for projections and feed-forward (MoE routed on the GPU into grouped GEMMs);
//   shorter ones run the decode kernels with T rows in the grid. Attention and DeltaNet cores
//   of chunks of T > 1 take the prefill kernels (flash attention, DeltaNet prepare + scan).
#pragma once
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpu/activations.h"
#include "gpu/device.h"
#include "gpu/device_weights.h"
#include "gpu/encode.h"
#include "gpu/encoder.h"
#include "model/backend.h"

namespace lily::gpu {

struct GpuOptions {
  // Decode over a context longer than this splits the cache (split-K + combine); shorter
  // contexts take the single pass. Splits of split_len positions walked from position 0 (grown
  // to a multiple of it once there would be more than max_splits): an M-series GPU needs many
  // threadgroups per dispatch to stream the cache at full bandwidth, and one threadgroup per KV
  // head and split gives 64 at a 1K context of the 35B shape (2 KV heads), 256 from 4K on
  // (benchmarks/metal_plan.py; tests/test_metal_plan.py holds it). Parameters so tests reach
  // both routes with tiny models.
  int split_threshold = 32;
  int split_len = 32;
  int max_splits = 128;
  // KV cache elements in half precision (the default): half the bytes per token at long
  // contexts (a 128K decode step reads 4.5 GB instead of 7.2 GB at the 35B shape), at the cost
  // of one f16 rounding of k and v; scores, softmax and sums stay f32. false: f32 elements, the
  // CPU backend's precision (what the tests that compare at 1e-4 select).
  bool kv_half = true;
  // A context reaching block_threshold positions moves its KV cache (once) into fixed blocks of
  // block_len positions (csrc/gpu/kv_cache.cpp): later growth adds blocks without copying
  // the cache, and split-K walks whole blocks.
  int block_threshold = 32768;
  int block_len = 256;
  // Chunks of at least this many tokens run projections and the feed-forward as tiled GEMMs
  // (and MoE as grouped GEMMs); shorter ones take the "skinny" GEMV route (decode kernels with
  // T rows), which wins while a weight tile would be mostly padding.
  int gemm_min_rows = 8;
  // The prefill GEMMs' inner product: "simdgroup" (simdgroup_matrix, every Apple GPU from M1),
  // "tensor" (Metal 4 MetalPerformancePrimitives matmul2d, the *_tensor.metal libraries; the
  // device must support tensor ops) or "auto": tensor only on a GPU family whose hardware
  // accelerates them (Apple10, M5 and later) and only if the tensor libraries compile (a probe
  // at load), else simdgroup. Chosen at load time.
  std::string gemm = "auto";
  // The decode GEMVs (gemv, moe_gate_up, moe_down) read packed rows 16 bytes per lane per step
  // wherever the rows are 16-byte aligned (QuantMatrix::vec, metal/quant.h); false: 32-bit words
  // everywhere, the earlier kernels' reads (an A/B knob for timing: scripts/h200/fullsize.py).
  bool gemv_vector_loads = true;
  // A pass's sequences share one dispatch per attention / DeltaNet kernel (sequence tables);
  // false: one dispatch per sequence, as before the tables (an A/B knob for timing:
  // scripts/h200/phase_m.sh). The same results either way.
  bool mixer_tables = true;
};

// The Apple GPU family from which "auto" takes the Metal 4 tensor-op GEMMs (M5: tensor units
// in every GPU core; on M1-M4 Metal 4 runs them on the shader cores, no faster).
constexpr int kTensorOpsGpuFamily = 10;

class GpuBackend;

class GpuState : public State {
 public:
  explicit GpuState(const ModelConfig& c) { config_ = &c; }
  GpuBackend* backend = nullptr;
  int capacity = 0;                                  // KV positions allocated
  std::vector<std::shared_ptr<Buffer>> k, v;         // per attention layer [Hkv, capacity, D]
  // Block layout (block_len > 0; k, v then empty): table [max blocks] of (arena << 24 | slot)
  // shared by all layers; per layer, K and V arenas [slots, Hkv, block_len, D], sizes doubling.
  int block_len = 0;
  std::shared_ptr<Buffer> block_table;
  std::vector<std::vector<std::shared_ptr<Buffer>>> k_arenas, v_arenas;
  std::vector<int> arena_slots;  // blocks per arena
  // Per DeltaNet layer, two copies each: a pass reads copy `parity` and writes the other, then
  // flips parity, so the state before the latest pass is still there (discard_last_step).
  std::vector<std::shared_ptr<Buffer>> conv[2], S[2];
  int parity = 0;

  // Plan reports only (benchmarks/metal_plan.py): act as if `position` tokens were cached.
  void seek(int position) { position_ = position; }

  std::unique_ptr<State> clone() const override;
  size_t nbytes() const override;

 protected:
  std::unique_ptr<Snapshot> capture() const override;
  void apply(const Snapshot& snap) override;
  void read_recurrent(const Snapshot& snap, int layer, std::vector<float>& conv, std::vector<float>& S) const override;
  std::unique_ptr<Snapshot> new_snapshot() const override;
  void write_recurrent(Snapshot& snap, int layer, const std::vector<float>& conv,
                       const std::vector<float>& S) const override;
  void read_kv_rows(int layer, bool v, int positions, float* out) const override;
  void reserve_kv_rows(int rows) override;
  void write_kv_rows(int layer, bool v, int rows, const float* in) override;
};

class GpuBackend : public Backend {
 public:
  using Region = DeviceWeights::Region;
  // regions: where weight pointers live; empty = the weights' mapped files.
  GpuBackend(std::shared_ptr<const ModelWeights> weights, std::shared_ptr<Device> device,
             std::string name, GpuOptions options = {}, std::vector<Region> regions = {});
  ~GpuBackend() override;

  const char* name() const override { return name_.c_str(); }
  // Refuses (ConfigError naming the sizes) a context whose state, with the weights, does not fit
  // the device's recommended working set.
  std::unique_ptr<State> new_state(int max_context) override;
  int max_fitting_context() const override;
  void check_context(int max_context) const override;
  void abandon_pass(Segments segs) noexcept override;
  bool batches() const override { return true; }
  int batch_rows() const override { return std::max(1, options_.gemm_min_rows - 1); }

  void embed(Segments segs, const int32_t* tokens) override;
  void rms_norm(const std::vector<float>& w) override;
  void add_rms_norm(const std::vector<float>& w) override;
  void attention(Segments segs, int layer, const AttentionWeights& w) override;
  void gated_deltanet(Segments segs, int layer, const GdnWeights& w) override;
  void mlp(const MlpWeights& w) override;
  void moe(const MoeWeights& w) override;
  void lm_head(const Linear& head, int first, int n, float* logits) override;

  // Device decode loop (csrc/gpu/sampling.cpp).
  bool has_device_loop() const override { return true; }
  bool begin_device_decode(Segments segs, int max_steps, const DeviceSampling* sampling) override;
  void wait_device_tokens(int32_t* tokens, std::string* errors) override;
  void discard_last_step() override;
  void end_device_decode() override;

  // Commits the pass being encoded (if any) and waits for it.
  void finish() { ctx_.finish(); }

  const GpuOptions& options() const { return options_; }
  // Whether the prefill GEMMs run on Metal 4 tensor ops (GpuOptions::gemm, resolved at load),
  // and why (e.g. "simdgroup: the GPU family is Apple9; tensor ops run fast from Apple10").
  bool tensor_gemm() const { return tensor_gemm_; }
  const std::string& gemm_path() const { return gemm_path_; }
  const GpuStats& stats() const { return ctx_.stats(); }
  // Recording of every dispatch (off by default).
  void set_recording(bool on) { ctx_.recording = on; }
  std::vector<DispatchRecord>& records() { return ctx_.records; }
  // Bytes a sequence of max_context positions holds on the device: KV cache (all attention
  // layers, K and V) and both copies of the DeltaNet state and conv window of every layer.
  uint64_t state_bytes(int64_t max_context) const;
  uint64_t weight_bytes() const { return weights_gpu_.bytes(); }
  // Of those, the bytes copied at load because a file's tensors were misaligned (0: zero-copy).
  uint64_t weight_copied_bytes() const { return weights_gpu_.copied_bytes(); }

  Device& device() { return ctx_.device(); }

 private:
  friend class GpuState;

  void choose_gemm_path();
  void begin_pass();
  // y[t, :out) = W x[t, :in) for t < T: a tiled GEMM for chunks of gemm_min_rows tokens (if W
  // fits the tiles), else a GEMV.
  void project(const Linear& W, const char* what, const BufferRange& x, int ldx, const BufferRange& y, int ldy,
               int T);
  void reserve_kv(GpuState& st, int positions);      // kv_cache.cpp
  void reserve_blocks(GpuState& st, int positions);  // kv_cache.cpp
  // Rows [0, positions) of one layer's K (or V) cache to / from host [Hkv, positions, D] f32,
  // whichever layout holds them (f16 caches converted); between passes. kv_cache.cpp.
  void read_kv_rows(const GpuState& st, int layer, bool v, int positions, float* host);
  void write_kv_rows(GpuState& st, int layer, bool v, int positions, const float* host);
  KvCacheView kv_view(GpuState& st, int layer) const;
  void norm(const std::vector<float>& w, bool add);
  void moe_prefill(const ExpertTables& tb);  // after moe() has routed the chunk
  void mlp_prefill(const ExpertTables& tb);
  bool grouped_fits(const ExpertTables& tb) const;
  void sample_step();  // the sample dispatches of a device-loop step (sampling.cpp)

  std::shared_ptr<const ModelWeights> weights_;
  const ModelConfig& c_;
  std::string name_;
  GpuOptions options_;
  EncoderContext ctx_;
  DeviceWeights weights_gpu_;
  Activations acts_;
  std::shared_ptr<Buffer> inv_freq_;  // [rotary_dim / 2] RoPE inverse frequencies
  bool tensor_gemm_ = false;
  std::string gemm_path_;

  // The pass being encoded: T_ rows, and per segment its state, rows [first, first + n), its
  // position at embed and the DeltaNet state copy it reads (GpuState::parity before embed
  // flipped it). pass_open_ while it is encoded incompletely: abandon_pass then returns every
  // segment's state to copy `in`.
  struct PassSegment {
    GpuState* state = nullptr;
    int first = 0, n = 0, pos0 = 0, in = 0;
  };
  int T_ = 0;
  std::vector<PassSegment> pass_;
  bool pass_open_ = false;
  int layer_ = 0;             // the layer being encoded (debug signposts)
  // Device decode loop over loop_ (one row per sequence from the second step on): step i reads
  // its tokens from ring slot (i+1)%2 ([rows] int32) and writes the tokens it chooses
  // (metal/sampling.metal) to slot i%2, with a status per row ([rows][4] u32); each row's
  // generator state lives in rng_ ([rows][4] u64) and its sampling parameters in sample_args_.
  // Committed steps not yet read back wait in `inflight_`.
  bool device_loop_ = false;
  int64_t step_ = 0, read_step_ = 0;
  std::vector<GpuState*> loop_;
  std::vector<std::shared_ptr<CommandBuffer>> inflight_;
  std::shared_ptr<Buffer> ring_, status_, rng_, sample_w_;
  std::vector<SampleArgs> sample_args_;  // per row (metal/sampling_args.h)
};

}  // namespace lily::gpu
