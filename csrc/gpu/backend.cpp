// GpuBackend: which kernels a pass runs, in what order, on which buffers. The dispatches
// themselves are the encode_* functions of encode.h; see backend.h for the design.
#include "gpu/backend.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>

#include "model/error.h"

namespace lily::gpu {

// ---- state -----------------------------------------------------------------------------------

namespace {

std::shared_ptr<Buffer> copy_buffer(Device& dev, const std::shared_ptr<Buffer>& b) {
  if (!b) return nullptr;
  auto out = dev.new_buffer(b->length());
  dev.copy(*out, 0, *b, 0, b->length());
  return out;
}

class GpuSnapshot : public Snapshot {
 public:
  const void* owner = nullptr;
  std::vector<std::vector<uint8_t>> conv, S;
  size_t nbytes() const override {
    size_t n = 0;
    for (const auto& v : conv) n += v.size();
    for (const auto& v : S) n += v.size();
    return n;
  }
};

std::vector<uint8_t> bytes_of(const std::shared_ptr<Buffer>& b) {
  if (!b) return {};
  std::vector<uint8_t> out(b->length());
  b->read(0, out.data(), out.size());
  return out;
}

std::string gib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", double(bytes) / double(1ull << 30));
  return buf;
}

}  // namespace

std::unique_ptr<State> GpuState::clone() const {
  backend->finish();
  auto s = std::make_unique<GpuState>(*this);
  Device& dev = backend->device();
  for (auto* list : {&s->k, &s->v, &s->conv[0], &s->conv[1], &s->S[0], &s->S[1]})
    for (auto& b : *list) b = copy_buffer(dev, b);
  for (auto* layers : {&s->k_arenas, &s->v_arenas})
    for (auto& arenas : *layers)
      for (auto& b : arenas) b = copy_buffer(dev, b);
  s->block_table = copy_buffer(dev, s->block_table);
  return s;
}

size_t GpuState::nbytes() const {
  size_t n = 0;
  for (const auto* list : {&k, &v, &conv[0], &conv[1], &S[0], &S[1]})
    for (const auto& b : *list)
      if (b) n += b->length();
  for (const auto* layers : {&k_arenas, &v_arenas})
    for (const auto& arenas : *layers)
      for (const auto& b : arenas) n += b->length();
  return n;
}

std::unique_ptr<Snapshot> GpuState::capture() const {
  backend->finish();
  auto snap = std::make_unique<GpuSnapshot>();
  snap->owner = this;
  for (const auto& b : conv[parity]) snap->conv.push_back(bytes_of(b));
  for (const auto& b : S[parity]) snap->S.push_back(bytes_of(b));
  return snap;
}

void GpuState::apply(const Snapshot& snap) {
  const auto* s = dynamic_cast<const GpuSnapshot*>(&snap);
  if (!s || s->owner != this) throw RequestError("[state] snapshot was taken from another sequence");
  backend->finish();
  for (size_t l = 0; l < conv[parity].size(); ++l) {
    if (const auto& c = conv[parity][l]) c->write(0, s->conv[l].data(), s->conv[l].size());
    if (const auto& S_ = S[parity][l]) S_->write(0, s->S[l].data(), s->S[l].size());
  }
}

// Saved sessions (State::export_tensors / import_tensors): the recurrent state goes through a
// GpuSnapshot (the host copy a turn snapshot keeps, f32 bytes), the KV rows through the
// backend's read_kv_rows / write_kv_rows, whichever layout and element type the cache has.
namespace {

GpuSnapshot& own(const Snapshot& snap, const GpuState* state) {
  auto* s = dynamic_cast<const GpuSnapshot*>(&snap);
  if (!s || s->owner != state) throw RequestError("[state] snapshot was taken from another sequence");
  return const_cast<GpuSnapshot&>(*s);
}

std::vector<float> floats_of(const std::vector<uint8_t>& bytes) {
  std::vector<float> f(bytes.size() / 4);
  std::memcpy(f.data(), bytes.data(), f.size() * 4);
  return f;
}

std::vector<uint8_t> f32_bytes(const std::vector<float>& f) {
  std::vector<uint8_t> b(f.size() * 4);
  std::memcpy(b.data(), f.data(), b.size());
  return b;
}

}  // namespace

void GpuState::read_recurrent(const Snapshot& snap, int layer, std::vector<float>& conv, std::vector<float>& S) const {
  const GpuSnapshot& s = own(snap, this);
  conv = floats_of(s.conv[layer]);
  S = floats_of(s.S[layer]);
}

std::unique_ptr<Snapshot> GpuState::new_snapshot() const {
  auto snap = std::make_unique<GpuSnapshot>();
  snap->owner = this;
  snap->conv.resize(conv[parity].size());
  snap->S.resize(S[parity].size());
  return snap;
}

void GpuState::write_recurrent(Snapshot& snap, int layer, const std::vector<float>& conv_,
                               const std::vector<float>& S_) const {
  GpuSnapshot& s = own(snap, this);
  s.conv[layer] = f32_bytes(conv_);
  s.S[layer] = f32_bytes(S_);
}

void GpuState::read_kv_rows(int layer, bool v, int positions, float* out) const {
  backend->finish();
  backend->read_kv_rows(*this, layer, v, positions, out);
}

void GpuState::reserve_kv_rows(int rows) {
  backend->finish();
  backend->reserve_kv(*this, rows);
}

void GpuState::write_kv_rows(int layer, bool v, int rows, const float* in) {
  backend->write_kv_rows(*this, layer, v, rows, in);
}

// ---- backend ---------------------------------------------------------------------------------

GpuBackend::GpuBackend(std::shared_ptr<const ModelWeights> weights, std::shared_ptr<Device> device,
                       std::string name, GpuOptions options, std::vector<Region> regions)
    : weights_(std::move(weights)),
      c_(weights_->config),
      name_(std::move(name)),
      options_(options),
      ctx_(std::move(device)),
      weights_gpu_(ctx_.device(), *weights_, std::move(regions), ctx_.dummy(), options.gemv_vector_loads),
      acts_(ctx_.device(), c_, options.max_splits) {
  const bool has_attn = std::count(c_.mixers.begin(), c_.mixers.end(), Mixer::Attention) > 0;
  const bool has_gdn = std::count(c_.mixers.begin(), c_.mixers.end(), Mixer::GatedDeltaNet) > 0;
  if (has_attn) {
    check_attention_head_dim(c_.head_dim);
    if (c_.n_heads / c_.n_kv_heads > LILY_ATTN_MAX_GROUP)
      throw ConfigError("[gpu] more than " + std::to_string(LILY_ATTN_MAX_GROUP) + " query heads per KV head");
  }
  if (has_gdn) check_gdn_key_dim(c_.gdn_k_dim, c_.gdn_v_dim);
  if (c_.top_k > LILY_MOE_MAX_TOPK || c_.n_experts > 1024)
    throw ConfigError("[gpu] MoE with " + std::to_string(c_.n_experts) + " experts top-" +
                      std::to_string(c_.top_k) + " exceeds the kernels' limits");
  if (options_.split_len < 1 || options_.max_splits < 1)
    throw ConfigError("[gpu] split_len and max_splits must be positive");
  if (options_.block_len < 1 || options_.block_threshold < 0)
    throw ConfigError("[gpu] block_len must be positive and block_threshold non-negative");
  check_matrices(*weights_);
  choose_gemm_path();

  // RoPE inverse frequencies, the CPU backend's table (at least one entry: a buffer is never empty).
  std::vector<float> inv_freq = c_.rope_inv_freq();
  if (inv_freq.empty()) inv_freq.push_back(0.0f);
  inv_freq_ = ctx_.device().new_buffer(inv_freq.size() * 4);
  inv_freq_->write(0, inv_freq.data(), inv_freq.size() * 4);
}

GpuBackend::~GpuBackend() {
  try {
    ctx_.finish();
  } catch (...) {
  }
}

// GpuOptions::gemm: "tensor" compiles the Metal 4 libraries now (their errors surface at load);
// "auto" takes them only on a GPU that accelerates tensor ops and only if they compile, else
// falls back to simdgroup_matrix and says why in gemm_path().
void GpuBackend::choose_gemm_path() {
  const std::string& g = options_.gemm;
  if (g != "auto" && g != "simdgroup" && g != "tensor")
    throw ConfigError("[gpu] gemm must be 'auto', 'simdgroup' or 'tensor', not '" + g + "'");
  Device& dev = ctx_.device();
  const std::string family = "Apple" + std::to_string(dev.apple_gpu_family());
  if (g == "simdgroup") {
    gemm_path_ = "simdgroup (asked for)";
    return;
  }
  if (!dev.supports_tensor_ops()) {
    if (g == "tensor") throw ConfigError("[gpu] gemm='tensor' needs Metal 4 tensor ops, which '" + dev.name() + "' lacks");
    gemm_path_ = "simdgroup: the GPU has no Metal 4 tensor ops";
    return;
  }
  if (g == "auto" && dev.apple_gpu_family() < kTensorOpsGpuFamily) {
    gemm_path_ = "simdgroup: the GPU family is " + family + "; tensor ops are accelerated from Apple" +
                 std::to_string(kTensorOpsGpuFamily) + " (M5)";
    return;
  }
  try {
    ctx_.compile("quant_tensor.metal");
    ctx_.compile("moe_tensor.metal");
  } catch (const Error& e) {
    if (g == "tensor") throw;
    gemm_path_ = std::string("simdgroup: the Metal 4 tensor libraries did not compile: ") + e.what();
    return;
  }
  tensor_gemm_ = true;
  gemm_path_ = "tensor (Metal 4 matmul2d on " + family + (g == "tensor" ? ", asked for)" : ")");
}

uint64_t GpuBackend::state_bytes(int64_t max_context) const {
  uint64_t n = 0;
  const uint64_t kv_row = uint64_t(c_.head_dim) * (options_.kv_half ? 2 : 4);
  for (const Mixer m : c_.mixers) {
    if (m == Mixer::Attention) n += 2 * uint64_t(c_.n_kv_heads) * uint64_t(max_context) * kv_row;
    else n += 2 * 4 * (uint64_t(c_.conv_kernel - 1) * c_.gdn_qkv_dim() +
                       uint64_t(c_.gdn_v_heads) * c_.gdn_k_dim * c_.gdn_v_dim);
  }
  return n;
}

int GpuBackend::max_fitting_context() const {
  const uint64_t ws = ctx_.device().recommended_max_working_set_size();
  if (ws == 0) return INT_MAX;
  const uint64_t fixed = weight_bytes() + state_bytes(0), per_token = state_bytes(1) - state_bytes(0);
  if (fixed >= ws) return 0;
  if (per_token == 0) return INT_MAX;
  return int(std::min<uint64_t>((ws - fixed) / per_token, INT_MAX));
}

void GpuBackend::check_context(int max_context) const {
  Device& dev = ctx_.device();
  const uint64_t ws = dev.recommended_max_working_set_size();
  if (!ws || weight_bytes() + state_bytes(max_context) <= ws) return;
  const int fits = max_fitting_context();
  throw ConfigError("[gpu] a context of " + std::to_string(max_context) + " tokens needs " +
                    gib(weight_bytes() + state_bytes(max_context)) + " on '" + dev.name() + "' (weights " +
                    gib(weight_bytes()) + " + KV cache and recurrent state " + gib(state_bytes(max_context)) +
                    "), more than the GPU's recommended working set of " + gib(ws) +
                    (fits > 0 ? "; at most " + std::to_string(fits) + " tokens fit" : "; the weights alone do not fit"));
}

std::unique_ptr<State> GpuBackend::new_state(int max_context) {
  check_context(max_context);
  ctx_.finish();
  auto st = std::make_unique<GpuState>(c_);
  st->backend = this;
  const int L = c_.n_layers();
  st->k.resize(L);
  st->v.resize(L);
  for (int p = 0; p < 2; ++p) {
    st->conv[p].resize(L);
    st->S[p].resize(L);
    for (int l = 0; l < L; ++l) {
      if (c_.mixers[l] != Mixer::GatedDeltaNet) continue;
      st->conv[p][l] = ctx_.device().new_buffer(size_t(c_.conv_kernel - 1) * c_.gdn_qkv_dim() * 4);
      st->S[p][l] = ctx_.device().new_buffer(size_t(c_.gdn_v_heads) * c_.gdn_k_dim * c_.gdn_v_dim * 4);
      for (auto* b : {st->conv[p][l].get(), st->S[p][l].get()}) b->fill(0, 0, b->length());
    }
  }
  return st;
}

namespace {

// Encodes a group of sequences' mixer dispatch: all of them in one table, or (together false:
// GpuOptions::mixer_tables off, for A/B timing) one table per sequence.
template <typename V, typename F>
void each_table(bool together, const std::vector<V>& seqs, F&& encode) {
  if (together) return encode(seqs);
  for (const V& s : seqs) encode(std::vector<V>{s});
}

}  // namespace

void GpuBackend::abandon_pass(Segments) noexcept {
  ctx_.discard();
  // The pass flipped each segment's parity at embed: its reads came from copy `in`, which it
  // never got to overwrite (nothing ran), so returning to it restores the state. The device
  // loop's steps already committed stay in flight (end_device_decode waits for them).
  if (pass_open_)
    for (const PassSegment& p : pass_) p.state->parity = p.in;
  pass_open_ = false;
}

void GpuBackend::begin_pass() {
  std::string label = "lily pass: " + std::to_string(T_) + " token(s)";
  if (pass_.size() == 1) label += " at position " + std::to_string(pass_[0].pos0);
  else label += " of " + std::to_string(pass_.size()) + " sequences";
  ctx_.begin(label);
}

void GpuBackend::project(const Linear& W, const char* what, const BufferRange& x, int ldx, const BufferRange& y,
                         int ldy, int T) {
  const LinearBuffers& L = weights_gpu_.linear(W, what);
  if (T >= options_.gemm_min_rows && tiles_fit(L.m)) encode_gemm(ctx_, L, x, ldx, y, ldy, T, tensor_gemm_);
  else encode_gemv(ctx_, L, x, ldx, y, ldy, T);
}

void GpuBackend::embed(Segments segs, const int32_t* tokens) {
  pass_open_ = false;  // the previous pass was encoded completely
  if (segs.size() > 1 && segs.rows() > batch_rows())
    throw Error("[gpu] a pass of several sequences holds at most " + std::to_string(batch_rows()) + " rows, not " +
                std::to_string(segs.rows()) + " (Engine::step splits larger steps)");
  const int T = segs.rows();
  if (device_loop_ && int(segs.size()) != int(loop_.size()))
    throw Error("[gpu] the device decode loop runs " + std::to_string(loop_.size()) + " sequence(s), not " +
                std::to_string(segs.size()));
  T_ = T;
  pass_.clear();
  for (const SeqRows& s : segs) {
    auto& st = static_cast<GpuState&>(*s.state);
    pass_.push_back({&st, s.first, s.n, st.position(), st.parity});
  }
  BufferRange token_src;
  if (!device_loop_ || tokens) {  // tokens from the host: a host pass, or a device loop's first step
    if (device_loop_ && (step_ != 0 || !inflight_.empty()))
      throw Error("[gpu] only the first device-loop step takes host tokens");
    if (!device_loop_) {
      ctx_.finish();
      for (const PassSegment& p : pass_) reserve_kv(*p.state, p.pos0 + p.n);  // may throw: nothing changed yet
    }
    acts_.size_for(T, int(pass_.size()));  // nothing in flight: buffers may be replaced
    acts_.tokens->write(0, tokens, 4 * size_t(T));
    token_src = {acts_.tokens, 0};
  } else {  // each sequence's previous token (sized and reserved by begin_device_decode)
    if (T != int(loop_.size())) throw Error("[gpu] device-loop steps take one token per sequence from the device");
    if (step_ == 0) throw Error("[gpu] the first device-loop step brings its tokens from the host");
    token_src = {ring_, size_t((step_ + 1) % 2) * loop_.size() * 4};
  }
  begin_pass();
  for (const PassSegment& p : pass_) p.state->parity = p.in ^ 1;
  pass_open_ = true;
  ctx_.signpost("embed");
  encode_embed(ctx_, weights_gpu_.linear(weights_->embed, "embed_tokens"), uint32_t(c_.vocab), token_src,
               {acts_.x, 0}, T);
}

void GpuBackend::norm(const std::vector<float>& w, bool add) {
  NormArgs args{uint32_t(c_.hidden), add ? 1u : 0u, c_.rms_eps};
  encode_add_rms_norm(ctx_, args, T_, {acts_.y, 0}, weights_gpu_.vector(w), {acts_.x, 0}, {acts_.h, 0});
}

void GpuBackend::rms_norm(const std::vector<float>& w) { norm(w, false); }
void GpuBackend::add_rms_norm(const std::vector<float>& w) { norm(w, true); }

// ---- attention ---------------------------------------------------------------------------------

void GpuBackend::attention(Segments, int layer, const AttentionWeights& w) {
  const int T = T_, H = c_.hidden, Hq = c_.n_heads, Hkv = c_.n_kv_heads, D = c_.head_dim;
  layer_ = layer;
  ctx_.signpost("layer " + std::to_string(layer) + " attention");
  project(w.q_proj, "q_proj", {acts_.h, 0}, H, {acts_.qg, 0}, Hq * 2 * D, T);
  project(w.k_proj, "k_proj", {acts_.h, 0}, H, {acts_.k, 0}, Hkv * D, T);
  project(w.v_proj, "v_proj", {acts_.h, 0}, H, {acts_.v, 0}, Hkv * D, T);

  // Each segment against its own cache and position, on its rows of qg, k, v and o (and its own
  // slot of the split-K partials): each kernel is one dispatch for all the segments whose
  // caches share a layout (contiguous and block caches are two kernels), chunks that fit
  // attn_prefill one dispatch each. Each step is encoded for every segment before the next.
  const float scale = 1.0f / std::sqrt(float(D));
  const int group = Hq / Hkv;
  std::vector<AttnSeqView> seqs;
  for (size_t i = 0; i < pass_.size(); ++i) {
    const PassSegment& p = pass_[i];
    AttnSeqView s{kv_view(*p.state, layer), uint32_t(p.first), uint32_t(p.n), uint32_t(p.pos0)};
    s.part = uint32_t(i);
    attn_decode_splits(s, p.pos0 + p.n, options_.split_threshold, options_.split_len, options_.max_splits,
                       p.state->block_len);
    seqs.push_back(std::move(s));
  }
  // The segments of one cache layout (all, or those of one route: a chunk that fits
  // attn_prefill, or decode rows and the chunks that do not fit).
  enum class Route { Any, Prefill, Decode };
  auto layout = [&](bool blocks, Route route) {
    std::vector<AttnSeqView> out;
    for (const AttnSeqView& s : seqs) {
      const Route r = s.n > 1 && attn_prefill_fits(D, group) ? Route::Prefill : Route::Decode;
      if (s.kv.blocks == blocks && (route == Route::Any || route == r)) out.push_back(s);
    }
    return out;
  };
  const AttnPrepareArgs pa{uint32_t(D), uint32_t(c_.rotary_dim), uint32_t(Hq), uint32_t(Hkv), 0, c_.rms_eps};
  const bool together = options_.mixer_tables;
  for (bool blocks : {false, true})
    each_table(together, layout(blocks, Route::Any), [&](const std::vector<AttnSeqView>& t) {
      if (!t.empty())
        encode_attn_prepare(ctx_, pa, t, acts_.k, acts_.v, weights_gpu_.vector(w.q_norm),
                            weights_gpu_.vector(w.k_norm), inv_freq_, acts_.qg);
    });
  const AttnArgs da{uint32_t(D), uint32_t(Hq), uint32_t(Hkv), 0, uint32_t(options_.max_splits), scale};
  const std::vector<AttnSeqView> decode[2] = {layout(false, Route::Decode), layout(true, Route::Decode)};
  for (bool blocks : {false, true}) {
    for (const AttnSeqView& s : layout(blocks, Route::Prefill)) {  // a chunk: flash attention over query tiles
      const uint32_t tile = std::max(1, LILY_ATTN_PF_ROWS / group);
      encode_attn_prefill(ctx_, {uint32_t(D), uint32_t(Hq), uint32_t(Hkv), tile, scale}, s, acts_.qg, acts_.o);
    }
    each_table(together, decode[blocks], [&](const std::vector<AttnSeqView>& t) {
      if (!t.empty()) encode_attn_decode(ctx_, da, t, acts_.qg, acts_.o, acts_.part_o, acts_.part_ml);
    });
  }
  for (bool blocks : {false, true})
    each_table(together, decode[blocks], [&](const std::vector<AttnSeqView>& t) {
      if (!t.empty()) encode_attn_combine(ctx_, da, t, acts_.qg, acts_.o, acts_.part_o, acts_.part_ml);
    });
  project(w.o_proj, "o_proj", {acts_.o, 0}, Hq * D, {acts_.y, 0}, H, T);
}

// ---- Gated DeltaNet ----------------------------------------------------------------------------

void GpuBackend::gated_deltanet(Segments, int layer, const GdnWeights& w) {
  const int T = T_, H = c_.hidden, C = c_.gdn_qkv_dim(), vdim = c_.gdn_value_dim(), Hv = c_.gdn_v_heads;
  layer_ = layer;
  ctx_.signpost("layer " + std::to_string(layer) + " gated deltanet");
  GdnArgs args{uint32_t(T), uint32_t(c_.gdn_k_heads), uint32_t(Hv), uint32_t(c_.gdn_k_dim),
               uint32_t(c_.gdn_v_dim), uint32_t(c_.conv_kernel), uint32_t(C), c_.rms_eps,
               1.0f / std::sqrt(float(c_.gdn_k_dim))};
  const BufferRange h{acts_.h, 0}, qkv{acts_.qkv, 0}, z{acts_.z, 0}, b{acts_.b, 0}, a{acts_.a, 0};
  if (c_.gdn_fused_qkvz) {
    project(w.in_qkvz, "in_proj_qkvz", h, H, {acts_.qkvz, 0}, C + vdim, T);
    project(w.in_ba, "in_proj_ba", h, H, {acts_.ba, 0}, 2 * Hv, T);
    encode_gdn_ungroup(ctx_, args, {acts_.qkvz, 0}, {acts_.ba, 0}, qkv, z, b, a);
  } else {
    project(w.in_qkv, "in_proj_qkv", h, H, qkv, C, T);
    project(w.in_z, "in_proj_z", h, H, z, vdim, T);
    project(w.in_b, "in_proj_b", h, H, b, Hv, T);
    project(w.in_a, "in_proj_a", h, H, a, Hv, T);
  }
  const GdnLayerBuffers L{weights_gpu_.vector(w.conv1d), weights_gpu_.vector(w.a_neg), weights_gpu_.vector(w.dt_bias),
                          weights_gpu_.vector(w.norm)};
  // Each segment against its own conv window and state, on its rows of the activations: the
  // decode-route segments share one gdn_conv and one gdn_recurrence dispatch, each chunk that
  // fits the prefill route takes gdn_prepare + gdn_scan; each step encoded for every segment
  // before the next, so the segments share stages.
  const bool prefill_fits = gdn_prefill_fits(c_.gdn_k_dim, c_.gdn_v_dim);
  auto is_chunk = [&](const PassSegment& p) { return p.n > 1 && prefill_fits; };  // the prefill route
  auto state_of = [&](const PassSegment& p) {  // the copy read (parity p.in) and the one written
    const GpuState& st = *p.state;
    return GdnStateView{st.conv[p.in][layer], st.conv[p.in ^ 1][layer], st.S[p.in][layer], st.S[p.in ^ 1][layer]};
  };
  std::vector<GdnSeqView> decode;
  for (const PassSegment& p : pass_)
    if (!is_chunk(p)) decode.push_back({state_of(p), uint32_t(p.first), uint32_t(p.n)});
  auto chunk = [&](const PassSegment& p, bool scan) {  // the prefill route of one segment
    const GdnStateView sv = state_of(p);
    const size_t r = size_t(p.first) * 4;
    GdnArgs ca = args;
    ca.T = uint32_t(p.n);
    if (!scan)
      encode_gdn_prepare(ctx_, ca, {acts_.qkv, r * C}, {acts_.b, r * Hv}, {acts_.a, r * Hv}, L, sv,
                         {acts_.conv_out, r * C}, {acts_.gdn_gates, r * Hv * 2});
    else
      encode_gdn_scan(ctx_, ca, {acts_.conv_out, r * C}, {acts_.gdn_gates, r * Hv * 2}, {acts_.z, r * vdim}, L, sv,
                      {acts_.go, r * vdim});
  };
  for (bool scan : {false, true}) {
    for (const PassSegment& p : pass_)
      if (is_chunk(p)) chunk(p, scan);
    each_table(options_.mixer_tables, decode, [&](const std::vector<GdnSeqView>& t) {
      if (t.empty()) return;
      if (!scan) encode_gdn_conv(ctx_, args, t, acts_.qkv, L, acts_.conv_out);
      else encode_gdn_recurrence(ctx_, args, t, acts_.conv_out, acts_.b, acts_.a, L, acts_.go);
    });
  }
  // The gated norm is row-wise: one dispatch per run of consecutive decode-route segments.
  for (size_t i = 0; i < pass_.size();) {
    if (is_chunk(pass_[i])) {
      ++i;
      continue;
    }
    GdnArgs run = args;
    run.T = 0;
    size_t j = i;
    for (; j < pass_.size() && !is_chunk(pass_[j]); ++j) run.T += uint32_t(pass_[j].n);
    const size_t r = size_t(pass_[i].first) * 4;
    encode_gdn_gated_norm(ctx_, run, {acts_.z, r * vdim}, L, {acts_.go, r * vdim});
    i = j;
  }
  project(w.out_proj, "out_proj", {acts_.go, 0}, vdim, {acts_.y, 0}, H, T);
}

// ---- feed-forward ------------------------------------------------------------------------------

bool GpuBackend::grouped_fits(const ExpertTables& tb) const {
  for (const auto* m : {&tb.gate, &tb.up, &tb.down, &tb.shared_gate, &tb.shared_up, &tb.shared_down})
    if (!tiles_fit(m->m)) return false;  // (absent shared matrices are zero: dense, fit)
  return c_.n_experts <= LILY_MOE_PLAN_THREADS;  // else the GEMV route
}

void GpuBackend::mlp(const MlpWeights& w) {
  const ExpertTables& tb = weights_gpu_.tables(nullptr, &w);
  ctx_.signpost("layer " + std::to_string(layer_) + " mlp");
  if (T_ >= options_.gemm_min_rows && grouped_fits(tb)) return mlp_prefill(tb);
  const BufferRange zeros{acts_.zeros, 0};
  encode_moe_gate_up(ctx_, tb.gate, tb.up, zeros, 1, T_, {acts_.h, 0}, {acts_.act, 0});
  MoeDownInputs in;
  in.ids = zeros;
  in.act = {acts_.act, 0};
  encode_moe_down(ctx_, tb.down, in, 1, T_, c_.hidden, {acts_.y, 0});
}

void GpuBackend::moe(const MoeWeights& w) {
  const ExpertTables& tb = weights_gpu_.tables(&w, nullptr);
  const int T = T_, H = c_.hidden, E = c_.n_experts, k = c_.top_k;
  const bool shared = c_.shared_intermediate > 0;
  ctx_.signpost("layer " + std::to_string(layer_) + " moe");
  project(w.router, "router", {acts_.h, 0}, H, {acts_.router, 0}, E, T);
  if (shared) project(w.shared_gate, "shared_expert_gate", {acts_.h, 0}, H, {acts_.sgate, 0}, 1, T);
  MoeRouteArgs ra{uint32_t(E), uint32_t(k), c_.norm_topk_prob ? 1u : 0u};
  encode_moe_route(ctx_, ra, T, {acts_.router, 0}, {acts_.ids, 0}, {acts_.wts, 0});
  if (T >= options_.gemm_min_rows && grouped_fits(tb)) return moe_prefill(tb);
  if (shared)  // beside the routing: shares its stage
    encode_moe_gate_up(ctx_, tb.shared_gate, tb.shared_up, {acts_.zeros, 0}, 1, T, {acts_.h, 0}, {acts_.act_s, 0});
  encode_moe_gate_up(ctx_, tb.gate, tb.up, {acts_.ids, 0}, k, T, {acts_.h, 0}, {acts_.act, 0});
  const BufferRange wts{acts_.wts, 0};
  MoeDownInputs in;
  in.ids = {acts_.ids, 0};
  in.weights = &wts;
  in.shared = shared ? &tb.shared_down : nullptr;
  in.act = {acts_.act, 0};
  in.act_s = {acts_.act_s, 0};
  in.sgate = {acts_.sgate, 0};
  encode_moe_down(ctx_, tb.down, in, k, T, H, {acts_.y, 0});
}

// Prefill (T >= gemm_min_rows): the feed-forward as grouped GEMMs. Routed experts over the
// block map moe_plan builds on the GPU (every size bounded by T*k, so nothing is read back);
// the shared expert and a dense MLP as one expert over rows 0..T.
void GpuBackend::mlp_prefill(const ExpertTables& tb) {
  GroupedGemm g;
  g.bm = gemm_block_rows(uint64_t(T_));
  g.blocks = div_up(T_, g.bm);
  g.rows = uint32_t(T_);
  g.tensor = tensor_gemm_;
  const MoePlanBuffers none;
  encode_moe_gemm_gate_up(ctx_, tb.gate, tb.up, g, none, T_, c_.hidden, {acts_.h, 0}, {acts_.act, 0});
  encode_moe_gemm_down(ctx_, tb.down, g, none, {acts_.act, 0}, {acts_.y, 0});
}

void GpuBackend::moe_prefill(const ExpertTables& tb) {
  const int T = T_, H = c_.hidden, E = c_.n_experts, k = c_.top_k;
  const bool shared = c_.shared_intermediate > 0;
  const uint32_t n = uint32_t(T) * uint32_t(k);
  GroupedGemm routed;
  routed.routed = true;
  routed.k = k;
  routed.bm = gemm_block_rows(n / uint32_t(E));  // rows per expert on average
  routed.blocks = std::min<uint32_t>(uint32_t(E), n) + n / uint32_t(routed.bm);  // max blocks
  routed.rows = n;
  routed.tensor = tensor_gemm_;
  acts_.grow(acts_.plan_rows, size_t(n) * 4);
  acts_.grow(acts_.plan_blocks, size_t(routed.blocks) * 16);
  acts_.grow(acts_.plan_header, 16);
  acts_.grow(acts_.yr, size_t(n) * H * 4);
  if (shared) acts_.grow(acts_.ys, size_t(T) * H * 4);
  const MoePlanBuffers plan{{acts_.plan_rows, 0}, {acts_.plan_blocks, 0}, {acts_.plan_header, 0}, {acts_.wts, 0}};

  MoePlanArgs pa{n, uint32_t(E), uint32_t(routed.bm)};
  encode_moe_plan(ctx_, pa, routed.blocks, {acts_.ids, 0}, plan.rows, plan.blocks, plan.header);
  if (shared) {  // independent of the routing: shares its stages
    GroupedGemm s;
    s.bm = gemm_block_rows(uint64_t(T));
    s.blocks = div_up(T, s.bm);
    s.rows = uint32_t(T);
    s.tensor = tensor_gemm_;
    encode_moe_gemm_gate_up(ctx_, tb.shared_gate, tb.shared_up, s, plan, T, H, {acts_.h, 0}, {acts_.act_s, 0});
    encode_moe_gemm_down(ctx_, tb.shared_down, s, plan, {acts_.act_s, 0}, {acts_.ys, 0});
  }
  encode_moe_gemm_gate_up(ctx_, tb.gate, tb.up, routed, plan, T, H, {acts_.h, 0}, {acts_.act, 0});
  encode_moe_gemm_down(ctx_, tb.down, routed, plan, {acts_.act, 0}, {acts_.yr, 0});
  MoeCombineArgs ca{uint32_t(H), uint32_t(k), shared ? 1u : 0u};
  const BufferRange ys{acts_.ys, 0}, sg{acts_.sgate, 0};
  encode_moe_combine(ctx_, ca, T, {acts_.yr, 0}, shared ? &ys : nullptr, shared ? &sg : nullptr, {acts_.y, 0});
}

// ---- head ----------------------------------------------------------------------------------------

void GpuBackend::lm_head(const Linear& head, int first, int n, float* logits) {
  const size_t bytes = size_t(n) * head.out * 4;
  ctx_.signpost("lm_head");
  if (!device_loop_) {
    acts_.grow(acts_.logits, bytes);
    if (!ctx_.open()) begin_pass();  // a later run of the pass's last rows (model/schedule.cpp)
  }
  project(head, "lm_head", {acts_.h, size_t(first) * c_.hidden * 4}, c_.hidden, {acts_.logits, 0}, head.out, n);
  if (!device_loop_) {
    pass_open_ = false;  // complete: an error from here on is the execution's, not the encoding's
    ctx_.finish();
    if (logits) acts_.logits->read(0, logits, bytes);
    return;
  }
  // Device-loop step: each sequence's chosen token goes into this step's ring slot (the next
  // step's input); commit and return without waiting.
  if (n != int(loop_.size()))
    throw Error("[gpu] a device-loop step's head takes one row per sequence, not " + std::to_string(n));
  sample_step();
  pass_open_ = false;
  inflight_.push_back(ctx_.commit());
  ctx_.stats().max_in_flight = std::max<uint64_t>(ctx_.stats().max_in_flight, inflight_.size());
  ++step_;
}

}  // namespace lily::gpu
