#include "gpu/plan.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "model/error.h"
#include "model/schedule.h"

namespace lily::gpu {

namespace {

// Bytes of the recording buffers alive now (wrapped weight regions excluded), for the
// scratch-memory figure of prefill plans. Plans run one at a time (the GIL is held).
uint64_t g_live_bytes = 0;

class RecBuffer final : public Buffer {
 public:
  explicit RecBuffer(size_t n, bool counted = true) : n_(n), counted_(counted) {
    if (counted_) g_live_bytes += n_;
  }
  ~RecBuffer() override {
    if (counted_) g_live_bytes -= n_;
  }
  // Nothing behind it: host writes go nowhere and reads give zeros (a plan runs no kernel).
  void* contents() override { return nullptr; }
  size_t length() const override { return n_; }
  void write(size_t, const void*, size_t) override {}
  void read(size_t, void* data, size_t n) override { std::memset(data, 0, n); }
  void fill(size_t, uint8_t, size_t) override {}
  uint64_t gpu_address() const override { return 0; }

 private:
  size_t n_;
  bool counted_;
};

class RecPipeline final : public Pipeline {
 public:
  explicit RecPipeline(std::string n) : name_(std::move(n)) {}
  const std::string& name() const override { return name_; }
  uint32_t max_total_threads_per_threadgroup() const override { return 1024; }
  uint32_t thread_execution_width() const override { return 32; }

 private:
  std::string name_;
};

class RecLibrary final : public Library {
 public:
  std::shared_ptr<Pipeline> pipeline(const std::string& f, const FunctionConstants&) override {
    return std::make_shared<RecPipeline>(f);
  }
};

class RecEncoder final : public ComputeEncoder {
 public:
  void set_pipeline(const std::shared_ptr<Pipeline>&) override {}
  void set_buffer(uint32_t, const std::shared_ptr<Buffer>&, size_t) override {}
  void set_bytes(uint32_t, const void*, size_t) override {}
  void set_threadgroup_memory_length(uint32_t, size_t) override {}
  void insert_debug_signpost(const std::string&) override {}
  void dispatch_threadgroups(Size3, Size3) override {}
  void memory_barrier() override {}
  void use_resource(const std::shared_ptr<Buffer>&, bool) override {}
  void end_encoding() override {}
};

class RecCommandBuffer final : public CommandBuffer {
 public:
  std::shared_ptr<ComputeEncoder> compute_encoder(DispatchType, const std::string&) override {
    return std::make_shared<RecEncoder>();
  }
  void commit() override {}
  void wait_until_completed() override {}
};

class RecDevice final : public Device {
 public:
  std::string name() const override { return "recording"; }
  int apple_gpu_family() const override { return 7; }  // plans show the path every GPU takes
  uint64_t recommended_max_working_set_size() const override { return 0; }
  void make_resident(const std::vector<std::shared_ptr<Buffer>>&) override {}
  std::shared_ptr<Buffer> new_buffer(size_t n) override {
    allocated += n;
    return std::make_shared<RecBuffer>(n);
  }
  std::shared_ptr<Buffer> wrap_buffer(void*, size_t n) override { return std::make_shared<RecBuffer>(n, false); }
  bool unified_memory() const override { return false; }
  void copy(Buffer&, size_t, Buffer&, size_t, size_t) override {}
  std::shared_ptr<Library> new_library(const std::string&, const std::string&, const LibraryOptions&) override {
    return std::make_shared<RecLibrary>();
  }
  std::shared_ptr<CommandBuffer> new_command_buffer() override { return std::make_shared<RecCommandBuffer>(); }
  size_t allocated = 0;  // bytes of new_buffer so far (wrapped weights excluded)
};

// Hands out address ranges of the sizes an MLX checkpoint's tensors have.
struct Layout {
  const uint8_t* base = reinterpret_cast<const uint8_t*>(uintptr_t(1) << 44);
  size_t used = 0;
  const uint8_t* take(size_t n) {
    const uint8_t* p = base + used;
    used += (n + 63) / 64 * 64;
    return p;
  }
  Linear affine(int out, int in, int bits, int group) {
    Linear L;
    L.format = Linear::Format::Affine;
    L.out = out;
    L.in = in;
    L.dtype = DType::BF16;
    L.bits = bits;
    L.group = group;
    L.w = take(size_t(out) * in * bits / 8);
    L.scales = take(size_t(out) * (in / group) * 2);
    L.biases = take(size_t(out) * (in / group) * 2);
    return L;
  }
};

}  // namespace

std::shared_ptr<Device> make_recording_device() { return std::make_shared<RecDevice>(); }

// Synthetic weights of the sizes an MLX affine checkpoint of config c has.
static std::shared_ptr<ModelWeights> synthetic_weights(const ModelConfig& c, const PlanQuantization& q, Layout& lay) {
  auto w = std::make_shared<ModelWeights>();
  w->config = c;
  const int H = c.hidden, b = q.bits, g = q.group;
  auto mlp = [&](int inter) {
    MlpWeights m;
    m.gate = lay.affine(inter, H, b, g);
    m.up = lay.affine(inter, H, b, g);
    m.down = lay.affine(H, inter, b, g);
    return m;
  };
  w->embed = lay.affine(c.vocab, H, b, g);
  w->lm_head = lay.affine(c.vocab, H, b, g);
  w->final_norm.assign(H, 1.0f);
  for (int l = 0; l < c.n_layers(); ++l) {
    LayerWeights L;
    L.input_norm.assign(H, 1.0f);
    L.post_norm.assign(H, 1.0f);
    if (c.mixers[l] == Mixer::Attention) {
      const int D = c.head_dim;
      L.attn.q_proj = lay.affine(c.n_heads * D * 2, H, b, g);
      L.attn.k_proj = lay.affine(c.n_kv_heads * D, H, b, g);
      L.attn.v_proj = lay.affine(c.n_kv_heads * D, H, b, g);
      L.attn.o_proj = lay.affine(H, c.n_heads * D, b, g);
      L.attn.q_norm.assign(D, 1.0f);
      L.attn.k_norm.assign(D, 1.0f);
    } else {
      const int C = c.gdn_qkv_dim(), V = c.gdn_value_dim(), Hv = c.gdn_v_heads;
      if (c.gdn_fused_qkvz) {
        L.gdn.in_qkvz = lay.affine(C + V, H, b, g);
        L.gdn.in_ba = lay.affine(2 * Hv, H, b, g);
      } else {
        L.gdn.in_qkv = lay.affine(C, H, b, g);
        L.gdn.in_z = lay.affine(V, H, b, g);
        L.gdn.in_b = lay.affine(Hv, H, b, g);
        L.gdn.in_a = lay.affine(Hv, H, b, g);
      }
      L.gdn.out_proj = lay.affine(H, V, b, g);
      L.gdn.conv1d.assign(size_t(C) * c.conv_kernel, 0.0f);
      L.gdn.dt_bias.assign(Hv, 0.0f);
      L.gdn.a_neg.assign(Hv, -1.0f);
      L.gdn.norm.assign(c.gdn_v_dim, 1.0f);
    }
    if (c.ffns[l] == Ffn::Moe) {
      L.moe.router = lay.affine(c.n_experts, H, q.gate_bits, g);
      for (int e = 0; e < c.n_experts; ++e) L.moe.experts.push_back(mlp(c.moe_intermediate));
      if (c.shared_intermediate > 0) {
        L.moe.shared = mlp(c.shared_intermediate);
        L.moe.shared_gate = lay.affine(1, H, q.gate_bits, g);
      }
    } else {
      L.mlp = mlp(c.intermediate);
    }
    w->layers.push_back(std::move(L));
  }

  return w;
}

DecodePlan plan_decode_step(const ModelConfig& c, const PlanQuantization& q, const GpuOptions& options,
                            int context) {
  return plan_chunk(c, q, options, context, 1);
}

DecodePlan plan_chunk(const ModelConfig& c, const PlanQuantization& q, const GpuOptions& options,
                      int context, int tokens) {
  return plan_batch(c, q, options, context, tokens, 1);
}

DecodePlan plan_batch(const ModelConfig& c, const PlanQuantization& q, const GpuOptions& options, int context,
                      int tokens, int batch) {
  c.validate();
  if (tokens < 1 || context < tokens) throw Error("[plan] need 1 <= tokens <= context");
  if (batch < 1) throw Error("[plan] need a batch of at least 1 sequence");
  Layout lay;
  auto w = synthetic_weights(c, q, lay);
  auto dev = std::make_shared<RecDevice>();
  GpuBackend be(w, dev, "plan", options, {GpuBackend::Region{lay.base, lay.used}});
  std::vector<std::unique_ptr<State>> states;
  for (int b = 0; b < batch; ++b) {
    states.push_back(be.new_state(context));
    static_cast<GpuState&>(*states.back()).seek(context - tokens);
  }
  const size_t allocated_before = dev->allocated;
  const GpuStats before = be.stats();
  be.set_recording(true);
  // Passes as Engine::step makes them: at most batch_rows() rows in a pass of several sequences.
  const int per_pass = std::max(1, be.batch_rows() / tokens);
  const std::vector<int32_t> ids(size_t(tokens) * std::min(batch, per_pass), 0);
  std::vector<float> logits_unused(size_t(c.vocab) * std::min(batch, per_pass));
  std::vector<SeqRows> segs;
  for (int b0 = 0; b0 < batch; b0 += per_pass) {
    segs.clear();
    for (int b = b0; b < std::min(batch, b0 + per_pass); ++b)
      segs.push_back({states[b].get(), (b - b0) * tokens, tokens});
    forward_pass(be, *w, Segments{segs.data(), int(segs.size())}, ids.data(), LogitRows::Last, logits_unused.data());
  }
  DecodePlan plan;
  plan.dispatches = be.records();
  plan.scratch_bytes = dev->allocated - allocated_before;
  plan.stats = be.stats();
  plan.stats.dispatches -= before.dispatches;
  plan.stats.barriers -= before.barriers;
  plan.stats.command_buffers -= before.command_buffers;
  plan.stats.waits -= before.waits;
  return plan;
}

PrefillPlan plan_prefill(const ModelConfig& c, const PlanQuantization& q, const GpuOptions& options, int prompt,
                         int chunk) {
  c.validate();
  if (prompt < 1 || chunk < 1) throw Error("[plan] prompt and chunk must be at least 1");
  Layout lay;
  auto w = synthetic_weights(c, q, lay);
  GpuBackend be(w, make_recording_device(), "plan", options, {GpuBackend::Region{lay.base, lay.used}});
  auto st = be.new_state(prompt + 1);
  auto& gs = static_cast<GpuState&>(*st);
  PrefillPlan plan;
  plan.chunks = (prompt + chunk - 1) / chunk;
  std::vector<int32_t> tokens(size_t(std::min(prompt, chunk)), 0);
  for (int done = 0; done < prompt;) {
    const int T = std::min(chunk, prompt - done);
    const bool last = done + T == prompt;
    gs.seek(done);
    be.finish();  // the previous chunk's commit (and its wait) belongs between chunks
    const GpuStats before = be.stats();
    be.set_recording(last);
    be.records().clear();
    if (last) {
      // The engine's generate_greedy: the last chunk is device-loop step 0, its argmax the
      // first token, committed without a wait.
      const SeqRows seg{st.get(), 0, T};
      const DeviceSampling argmax;
      be.begin_device_decode(Segments{&seg, 1}, T, &argmax);
      forward_chunk(be, *w, *st, tokens.data(), T, LogitRows::Last, nullptr);
    } else {
      forward_chunk(be, *w, *st, tokens.data(), T, LogitRows::None, nullptr);
    }
    GpuStats d = be.stats();
    d.dispatches -= before.dispatches;
    d.barriers -= before.barriers;
    d.command_buffers -= before.command_buffers;
    d.waits -= before.waits;
    plan.total.dispatches += d.dispatches;
    plan.total.barriers += d.barriers;
    plan.total.command_buffers += d.command_buffers;
    plan.total.waits += d.waits;
    plan.waits_inside_chunks += d.waits;
    if (last) {
      plan.last_chunk = be.records();
      plan.last_stats = d;
      plan.last_tokens = T;
      plan.device_bytes = g_live_bytes;
      plan.state_bytes = st->nbytes();
      be.end_device_decode();
    }
    done += T;
  }
  plan.total.waits += plan.chunks - 1;  // one wait between chunks (the next embed's finish)
  return plan;
}

}  // namespace lily::gpu
