// The CPU backend: the reference every other backend is tested against, and a fast runtime in
// its own right. Ops run as loops over one thread pool; scratch buffers persist across calls,
// so decoding allocates nothing per token once warmed up. A pass may batch several sequences
// (batches()): each row's result is bit-identical to running its sequence alone, because every
// kernel computes an output row by one fixed order that depends on that row alone.
#pragma once
#include <memory>

#include "cpu/attention.h"
#include "cpu/gdn.h"
#include "cpu/moe.h"
#include "cpu/thread_pool.h"
#include "model/backend.h"

namespace lily::cpu {

class CpuSnapshot : public Snapshot {
 public:
  const void* owner = nullptr;  // the CpuState it was taken from
  std::vector<GdnState> gdn;
  size_t nbytes() const override;
};

class CpuState : public State {
 public:
  explicit CpuState(const ModelConfig& c) { config_ = &c; }
  std::vector<KvCache> kv;    // per layer (empty for DeltaNet layers)
  std::vector<GdnState> gdn;  // per layer (empty for attention layers)

  std::unique_ptr<State> clone() const override { return std::make_unique<CpuState>(*this); }
  size_t nbytes() const override;

 protected:
  friend class CpuBackend;  // reserve_for_call grows the KV caches as reserve_kv_rows does
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

// Copies every 4-bit matrix the int8 mode runs with the integer row kernels into the interleaved
// layout those kernels read fastest (linear_int8.h: interleave_rows; AVX-512 VNNI builds), in
// one buffer (w.arranged), and hands the pages of the old bytes back to the OS, so the weights'
// memory does not grow. Only for weights that serve one int8 CPU backend alone and that the
// loader read into memory (a mapped file's pages are the page cache's): returns false, changing
// nothing, where the build has no such kernels or a file is mapped. Afterwards
// w.arranged holds the copy (w.arranged_for_cpu_int8()) and no other backend or mode can use w.
bool arrange_for_int8(ModelWeights& w);

class CpuBackend : public Backend {
 public:
  // matmul: how quantized weights meet activations (linear.h); Int8 where the host has the
  // integer kernels, F32 elsewhere.
  CpuBackend(std::shared_ptr<const ModelWeights> weights, int n_threads, Matmul matmul = Matmul::F32);

  const char* name() const override { return "cpu"; }
  int threads() const { return pool_.size(); }
  Matmul matmul() const { return matmul_; }
  std::unique_ptr<State> new_state(int max_context) override;
  void reserve_for_call(State& st, int positions) override {
    static_cast<CpuState&>(st).reserve_kv_rows(positions);
  }

  bool batches() const override { return true; }
  void embed(Segments segs, const int32_t* tokens) override;
  void rms_norm(const std::vector<float>& w) override;
  void add_rms_norm(const std::vector<float>& w) override;
  void attention(Segments segs, int layer, const AttentionWeights& w) override;
  void gated_deltanet(Segments segs, int layer, const GdnWeights& w) override;
  void mlp(const MlpWeights& w) override;
  void moe(const MoeWeights& w) override;
  void lm_head(const Linear& head, int first, int n, float* logits) override;

 private:
  void norm_rows(const std::vector<float>& w, bool add);

  std::shared_ptr<const ModelWeights> weights_;
  const ModelConfig& c_;
  ThreadPool pool_;
  Matmul matmul_;
  int T_ = 0;                   // rows in the current pass
  std::vector<float> x_, h_, y_;  // [T, hidden]
  AttentionScratch attn_;
  GdnScratch gdn_;
  std::vector<KvRows> kv_rows_;    // [segments]: the pass's segments as the mixers take them
  std::vector<GdnRows> gdn_rows_;
  std::vector<std::vector<float>> conv_taps_;  // per DeltaNet layer: transpose_conv_taps, once
  FfnScratch ffn_;
};

}  // namespace lily::cpu
