// The GPU backend: the coarse Backend ops (model/backend.h) encoded as compute dispatches over a
// gpu::Device — real Metal (csrc/metal/) or the MSL-on-CPU runtime (csrc/msl_cpu/), the same
// dispatch sequence for both.
//
// Design choices:
// - One command buffer and one *concurrent* compute encoder per forward pass. Every dispatch
//   declares the activation/state bytes it reads and writes; gpu::HazardTracker places a
//   memory barrier only at a real data edge, so independent projections (q, k, v; DeltaNet's
//   four input projections; the shared expert beside the routed ones) share a stage.
// - The CPU waits once per pass: at lm_head, whose logits it must hand back. A pass without
//   logits (a prefill chunk that is not the last) is committed when the next one starts or the
//   state is read.
// - Weights are never copied: each mmapped safetensors file is one zero-copy buffer and a
//   Linear is (file buffer, byte offset). Experts are addressed through per-layer offset
//   tables, so stacked (MLX) and per-expert (HF) layouts both work without repacking.
// - One argument struct per kernel family (metal/*_args.h), included here and by the kernels.
// - Kernel sources come embedded in the extension (gpu/embedded.h; LILY_SOURCE_DIR overrides)
//   with their local #includes inlined, so the text handed to Device::new_library is
//   self-contained (what Metal's newLibraryWithSource needs).
// - Activations and state are f32 (the CPU backend's precision): KV cache [Hkv, cap, D] per
//   attention layer grows geometrically like the CPU one; DeltaNet S [Hv, Dk, Dv] and the conv
//   window [K-1, C] per layer.
// - Decode is the target (T = 1). Chunks of at least GpuOptions::gemm_min_rows tokens take
//   prefill kernels for projections and feed-forward (prefill_moe.cpp: tiled GEMMs with fused
//   dequantization, MoE routing and grouped expert GEMMs on the GPU); shorter ones run the
//   decode kernels with T rows in the grid.
// - Attention and DeltaNet cores of chunks of T > 1 take the prefill mixers of
//   csrc/gpu/prefill_mixers.cpp (flash attention over query tiles, DeltaNet prepare + scan).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpu/device.h"
#include "gpu/hazards.h"
#include "metal/gdn_args.h"
#include "metal/sampling_args.h"
#include "model/backend.h"

namespace lily::gpu {

struct GpuOptions {
  // Decode over a context longer than this splits the cache (split-K + combine); shorter
  // contexts take the single pass. Parameters so tests reach both routes with tiny models.
  int split_threshold = 4096;
  int split_len = 1024;  // positions per split (grown so that splits <= max_splits)
  int max_splits = 128;
  // KV cache elements in half precision: half the bytes per token at long contexts, at the cost
  // of f16 rounding of k and v (default f32: the CPU backend's precision).
  bool kv_half = false;
  // A context reaching block_threshold positions moves its KV cache (once) into fixed blocks of
  // block_len positions (csrc/gpu/kv_blocks.cpp): later growth adds blocks without copying
  // the cache, and split-K walks whole blocks.
  int block_threshold = 32768;
  int block_len = 256;
  // Chunks of at least this many tokens run projections and the feed-forward as tiled GEMMs
  // (and MoE as grouped GEMMs); shorter ones take the "skinny" GEMV route (decode kernels with
  // T rows), which wins while a weight tile would be mostly padding.
  int gemm_min_rows = 8;
  // The prefill GEMMs' inner product: "simdgroup" (simdgroup_matrix, every Apple GPU from M1),
  // "tensor" (Metal 4 MetalPerformancePrimitives matmul2d; the device must support tensor ops)
  // or "auto" (tensor where Device::supports_tensor_ops(), else simdgroup), chosen at load time.
  std::string gemm = "auto";
};

// One encoded dispatch, for plan reports (benchmarks/metal_plan.py) and tests.
struct DispatchRecord {
  std::string kernel;
  int stage = 0;              // memory-barrier-separated stage within its command buffer
  uint64_t weight_bytes = 0;  // checkpoint bytes the kernel reads
  uint64_t state_bytes = 0;   // KV cache / DeltaNet state bytes read (and written back)
  uint64_t other_bytes = 0;   // activations read and written
};

struct GpuStats {
  uint64_t dispatches = 0, barriers = 0, command_buffers = 0, waits = 0;
  uint64_t max_in_flight = 0;  // most device-loop steps committed and not yet read back at once
};

class GpuBackend;

class GpuState : public State {
 public:
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
};

class GpuBackend : public Backend {
 public:
  // A memory region holding weights (a mapped file); the backend wraps each as one buffer.
  struct Region {
    const uint8_t* base = nullptr;
    size_t size = 0;
  };
  // regions: where weight pointers live; empty = the weights' mapped files.
  GpuBackend(std::shared_ptr<const ModelWeights> weights, std::shared_ptr<Device> device,
             std::string name, GpuOptions options = {}, std::vector<Region> regions = {});
  ~GpuBackend() override;

  const char* name() const override { return name_.c_str(); }
  std::unique_ptr<State> new_state(int max_context) override;

  void embed(State& st, const int32_t* tokens, int T) override;
  void rms_norm(const std::vector<float>& w) override;
  void add_rms_norm(const std::vector<float>& w) override;
  void attention(State& st, int layer, const AttentionWeights& w) override;
  void gated_deltanet(State& st, int layer, const GdnWeights& w) override;
  void mlp(const MlpWeights& w) override;
  void moe(const MoeWeights& w) override;
  void lm_head(const Linear& head, int first, int n, float* logits) override;

  // Device decode loop (csrc/gpu/sampling.cpp).
  bool begin_device_decode(State& st, int max_steps, const DeviceSampling& sampling) override;
  int32_t wait_device_token() override;
  void discard_last_step(State& st) override;
  void end_device_decode() override;

  // Commits the pass being encoded (if any) and waits for it.
  void finish();

  const GpuOptions& options() const { return options_; }
  // Whether the prefill GEMMs run on Metal 4 tensor ops (GpuOptions::gemm, resolved at load).
  bool tensor_gemm() const { return tensor_gemm_; }
  const GpuStats& stats() const { return stats_; }
  // Recording of every dispatch (off by default).
  void set_recording(bool on) { recording_ = on; }
  std::vector<DispatchRecord>& records() { return records_; }

  Device& device() { return *device_; }

 private:
  friend class GpuState;
  struct Ref {  // a buffer and a byte offset into it
    std::shared_ptr<Buffer> buf;
    size_t off = 0;
  };
  struct ExpertTables;
  struct ExpertMatrix;  // one matrix kind of an ExpertTables (encode.h)
  class Dispatch;

  Ref weight(const uint8_t* p, const char* what) const;
  std::shared_ptr<Buffer> vec(const std::vector<float>& v);
  std::shared_ptr<Pipeline> pipeline(const std::string& file, const std::string& kernel);
  void begin();
  void grow(std::shared_ptr<Buffer>& b, size_t bytes);
  void reserve_kv(GpuState& st, int positions);
  void reserve_blocks(GpuState& st, int positions);  // kv_blocks.cpp
  void bind_kv(Dispatch& d, GpuState& st, int layer, uint32_t index, bool write, uint64_t traffic);
  void gemv(const Linear& W, const Ref& x, int ldx, const Ref& y, int ldy, int T);
  void norm(const std::vector<float>& w, bool add);
  const ExpertTables& tables(const MoeWeights* moe, const MlpWeights* mlp);
  // The gather-GEMV feed-forward (decode): gate/up + SwiGLU for k jobs per token, then down +
  // weighted combine (+ the sigmoid-gated shared expert when `shared` is given).
  void gate_up_gemv(const ExpertMatrix& gate, const ExpertMatrix& up, const Ref& ids, int k,
                    const std::shared_ptr<Buffer>& act);
  void down_gemv(const ExpertMatrix& down, const ExpertMatrix* shared, const Ref& ids, int k,
                 bool weighted);
  // Prefill (prefill_moe.cpp): tiled GEMM for a chunk's projection, grouped-GEMM feed-forward.
  bool gemm_fits(const Linear& W) const;
  bool grouped_fits(const ExpertTables& tb) const;
  void gemm(const Linear& W, const Ref& x, int ldx, const Ref& y, int ldy, int T);
  void moe_prefill(const ExpertTables& tb);  // after moe() has routed the chunk
  void mlp_prefill(const ExpertTables& tb);
  void gate_up_gemm(const ExpertMatrix& gate, const ExpertMatrix& up, bool routed, int k, int bm,
                    uint32_t blocks, const std::shared_ptr<Buffer>& act);
  void down_gemm(const ExpertMatrix& down, bool routed, int k, int bm, uint32_t blocks,
                 const std::shared_ptr<Buffer>& act, const std::shared_ptr<Buffer>& out);
  // Prefill mixers (csrc/gpu/prefill_mixers.cpp): encode the chunk's attention core (after
  // attn_prepare, before o_proj) / DeltaNet conv + scan (after the input projections, before
  // out_proj) with the prefill kernels and return true, or return false (T == 1 or a shape
  // they do not take) for the decode kernels.
  bool prefill_attention(GpuState& st, int layer);
  bool prefill_gated_deltanet(GpuState& st, int layer, const GdnWeights& w, const GdnArgs& args);

  std::shared_ptr<const ModelWeights> weights_;
  const ModelConfig& c_;
  std::shared_ptr<Device> device_;
  std::string name_;
  GpuOptions options_;
  bool tensor_gemm_ = false;
  std::vector<std::pair<Region, std::shared_ptr<Buffer>>> regions_;

  std::map<std::string, std::shared_ptr<Library>> libraries_;
  std::map<std::string, std::shared_ptr<Pipeline>> pipelines_;
  std::map<const float*, std::shared_ptr<Buffer>> vectors_;
  std::map<const void*, std::unique_ptr<ExpertTables>> tables_;

  std::shared_ptr<CommandBuffer> cb_;
  std::shared_ptr<ComputeEncoder> enc_;
  HazardTracker hazards_;
  int stage_ = 0;
  GpuStats stats_;
  bool recording_ = false;
  std::vector<DispatchRecord> records_;

  int T_ = 0, pos0_ = 0;
  int in_ = 0;  // the state copy this pass reads (GpuState::parity at embed)
  // Device decode loop: step i reads its token from ring slot (i+1)%2 and writes the token it
  // chooses (metal/sampling.metal) to slot i%2, with a status word per slot; the generator
  // state lives in rng_. Committed steps not yet read back wait in `inflight_`.
  bool greedy_ = false;
  int64_t step_ = 0, read_step_ = 0;
  std::vector<std::shared_ptr<CommandBuffer>> inflight_;
  std::shared_ptr<Buffer> ring_, status_, rng_, sample_w_;
  SampleArgs sample_args_{};          // this loop's (metal/sampling_args.h)
  void encode_sample(int vocab);      // the sample dispatch of a device-loop step
  void size_activations(int T);
  // Activations [T, ...] (see metal/*_args.h for the layouts).
  std::shared_ptr<Buffer> tokens_, x_, h_, y_, qg_, k_, v_, o_, part_o_, part_ml_, qkv_, qkvz_, z_,
      b_, a_, ba_, conv_out_, go_, logits_, router_, ids_, wts_, act_, act_s_, sgate_, zeros_,
      dummy_, inv_freq_;
  std::shared_ptr<Buffer> gdn_gates_;  // [T, Hv, 2] (beta, decay) of the DeltaNet prefill scan
  // Prefill MoE scratch (prefill_moe.cpp): the routing plan, weighted expert rows, shared output.
  std::shared_ptr<Buffer> plan_rows_, plan_blocks_, plan_header_, yr_, ys_;
};

// metal/<file> (embedded, or from LILY_SOURCE_DIR: gpu/embedded.h) with its local
// #include "..." lines inlined.
std::string kernel_source(const std::string& file);

}  // namespace lily::gpu
