#include "gpu/backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <sstream>

#include <unistd.h>

#include "gpu/embedded.h"
#include "gpu/encode.h"
#include "model/error.h"

// The argument structs shared with the kernels (plain 32-bit fields).
#include <cstdint>
#include "metal/attention_args.h"
#include "metal/moe_args.h"
#include "metal/norm_args.h"
#include "metal/quant_args.h"

namespace lily::gpu {

// ---- kernel sources ---------------------------------------------------------------------------

namespace {

// Inlines #include "x.h" (files of metal/) once each; <...> includes stay.
void inline_includes(const std::string& file, std::set<std::string>& seen, std::string& out) {
  if (!seen.insert(file).second) return;
  std::istringstream in(source_file("metal/" + file));
  // #line keeps compiler diagnostics pointing at the real file and line.
  out += "#line 1 \"metal/" + file + "\"\n";
  int n = 0;
  for (std::string line; std::getline(in, line);) {
    ++n;
    const auto hash = line.find_first_not_of(" \t");
    if (hash != std::string::npos && line.compare(hash, 8, "#include") == 0) {
      const auto q0 = line.find('"');
      const auto q1 = q0 == std::string::npos ? q0 : line.find('"', q0 + 1);
      if (q1 != std::string::npos) {
        inline_includes(line.substr(q0 + 1, q1 - q0 - 1), seen, out);
        out += "#line " + std::to_string(n + 1) + " \"metal/" + file + "\"\n";
        continue;
      }
    }
    if (line.find("#pragma once") != std::string::npos) continue;
    out += line;
    out += '\n';
  }
}

}  // namespace

std::string kernel_source(const std::string& file) {
  std::string out;
  std::set<std::string> seen;
  inline_includes(file, seen, out);
  return out;
}

// ---- state -----------------------------------------------------------------------------------

namespace {

std::shared_ptr<Buffer> copy_buffer(Device& dev, const std::shared_ptr<Buffer>& b) {
  if (!b) return nullptr;
  auto out = dev.new_buffer(b->length());
  if (out->contents() && b->contents()) std::memcpy(out->contents(), b->contents(), b->length());
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
  if (!b || !b->contents()) return {};
  const auto* p = static_cast<const uint8_t*>(b->contents());
  return std::vector<uint8_t>(p, p + b->length());
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
    auto& c = conv[parity][l];
    auto& S_ = S[parity][l];
    if (c && c->contents()) std::memcpy(c->contents(), s->conv[l].data(), s->conv[l].size());
    if (S_ && S_->contents()) std::memcpy(S_->contents(), s->S[l].data(), s->S[l].size());
  }
}

// ---- backend ---------------------------------------------------------------------------------

GpuBackend::GpuBackend(std::shared_ptr<const ModelWeights> weights, std::shared_ptr<Device> device,
                       std::string name, GpuOptions options, std::vector<Region> regions)
    : weights_(std::move(weights)), c_(weights_->config), device_(std::move(device)), name_(std::move(name)),
      options_(options) {
  if (options_.gemm != "auto" && options_.gemm != "simdgroup" && options_.gemm != "tensor")
    throw ConfigError("[gpu] gemm must be 'auto', 'simdgroup' or 'tensor', not '" + options_.gemm + "'");
  if (options_.gemm == "tensor" && !device_->supports_tensor_ops())
    throw ConfigError("[gpu] gemm='tensor' needs Metal 4 tensor ops, which '" + device_->name() + "' lacks");
  tensor_gemm_ = options_.gemm == "tensor" || (options_.gemm == "auto" && device_->supports_tensor_ops());
  // A file's mapping covers whole pages, so the wrapped length is rounded up to the page size
  // (Metal's newBufferWithBytesNoCopy wants a page-aligned pointer and length).
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  if (regions.empty())
    for (const auto& f : weights_->files)
      regions.push_back({static_cast<const uint8_t*>(f->mapping()), (size_t(f->file_size()) + page - 1) / page * page});
  for (const Region& r : regions)
    regions_.push_back({r, device_->wrap_buffer(const_cast<uint8_t*>(r.base), r.size)});

  const bool has_attn = std::count(c_.mixers.begin(), c_.mixers.end(), Mixer::Attention) > 0;
  if (has_attn) {
    if (c_.head_dim % 32 || c_.head_dim > LILY_ATTN_MAX_HEAD_DIM)
      throw ConfigError("[gpu] head_dim " + std::to_string(c_.head_dim) + " must be a multiple of 32 up to " +
                        std::to_string(LILY_ATTN_MAX_HEAD_DIM));
    if (c_.n_heads / c_.n_kv_heads > LILY_ATTN_MAX_GROUP)
      throw ConfigError("[gpu] more than " + std::to_string(LILY_ATTN_MAX_GROUP) + " query heads per KV head");
  }
  if (c_.gdn_k_dim > LILY_GDN_MAX_DK || c_.gdn_v_dim > 1024)
    throw ConfigError("[gpu] DeltaNet head dims " + std::to_string(c_.gdn_k_dim) + "/" +
                      std::to_string(c_.gdn_v_dim) + " exceed the kernels' limits");
  if (c_.top_k > LILY_MOE_MAX_TOPK || c_.n_experts > 1024)
    throw ConfigError("[gpu] MoE with " + std::to_string(c_.n_experts) + " experts top-" +
                      std::to_string(c_.top_k) + " exceeds the kernels' limits");
  if (options_.split_len < 1 || options_.max_splits < 1)
    throw ConfigError("[gpu] split_len and max_splits must be positive");
  if (options_.block_len < 1 || options_.block_threshold < 0)
    throw ConfigError("[gpu] block_len must be positive and block_threshold non-negative");

  // RoPE inverse frequencies, rounded exactly as the CPU backend computes them.
  const int half = c_.rotary_dim / 2;
  inv_freq_ = device_->new_buffer(size_t(std::max(half, 1)) * 4);
  if (auto* p = static_cast<float*>(inv_freq_->contents()))
    for (int i = 0; i < half; ++i)
      p[i] = float(1.0 / std::pow(c_.rope_theta, double(float(2 * i) / float(c_.rotary_dim))));
  dummy_ = device_->new_buffer(16);
}

GpuBackend::~GpuBackend() {
  try {
    finish();
  } catch (...) {
  }
}

GpuBackend::Ref GpuBackend::weight(const uint8_t* p, const char* what) const {
  for (const auto& [r, buf] : regions_)
    if (p >= r.base && p < r.base + r.size) return Ref{buf, size_t(p - r.base)};
  throw Error(std::string("[gpu] ") + what + " does not lie in a mapped weights file");
}

std::shared_ptr<Buffer> GpuBackend::vec(const std::vector<float>& v) {
  auto& b = vectors_[v.data()];
  if (!b) {
    b = device_->new_buffer(std::max<size_t>(v.size(), 1) * 4);
    if (b->contents()) std::memcpy(b->contents(), v.data(), v.size() * 4);
  }
  return b;
}

std::shared_ptr<Pipeline> GpuBackend::pipeline(const std::string& file, const std::string& kernel) {
  auto& p = pipelines_[kernel];
  if (!p) {
    auto& lib = libraries_[file];
    if (!lib) {
      LibraryOptions o;
      o.safe_math = file == "sampling.metal";
      if (file.find("_tensor.metal") != std::string::npos) o.language = LibraryOptions::Language::MSL4_0;
      lib = device_->new_library(kernel_source(file), "metal/" + file, o);
    }
    p = lib->pipeline(kernel);
  }
  return p;
}

void GpuBackend::begin() {
  if (cb_) return;
  cb_ = device_->new_command_buffer();
  enc_ = cb_->compute_encoder(DispatchType::Concurrent, "lily forward pass");
  hazards_.barrier();
  stage_ = 0;
  ++stats_.command_buffers;
}

void GpuBackend::finish() {
  if (!cb_) return;
  auto cb = std::move(cb_);
  auto enc = std::move(enc_);
  enc->end_encoding();
  cb->commit();
  ++stats_.waits;
  cb->wait_until_completed();
}

void GpuBackend::grow(std::shared_ptr<Buffer>& b, size_t bytes) {
  bytes = std::max<size_t>(bytes, 16);
  if (!b || b->length() < bytes) b = device_->new_buffer(bytes);
}

std::unique_ptr<State> GpuBackend::new_state(int max_context) {
  finish();
  auto st = std::make_unique<GpuState>();
  st->backend = this;
  const int L = c_.n_layers();
  st->k.resize(L);
  st->v.resize(L);
  for (int p = 0; p < 2; ++p) {
    st->conv[p].resize(L);
    st->S[p].resize(L);
    for (int l = 0; l < L; ++l) {
      if (c_.mixers[l] != Mixer::GatedDeltaNet) continue;
      st->conv[p][l] = device_->new_buffer(size_t(c_.conv_kernel - 1) * c_.gdn_qkv_dim() * 4);
      st->S[p][l] = device_->new_buffer(size_t(c_.gdn_v_heads) * c_.gdn_k_dim * c_.gdn_v_dim * 4);
      for (auto* b : {st->conv[p][l].get(), st->S[p][l].get()})
        if (b->contents()) std::memset(b->contents(), 0, b->length());
    }
  }
  return st;
}

// Grows every attention layer's cache to hold `positions` (geometric, up to max_context).
// Called between passes, so no command buffer uses the old buffers.
void GpuBackend::reserve_kv(GpuState& st, int positions) {
  if (st.block_len || positions >= options_.block_threshold) return reserve_blocks(st, positions);
  if (positions <= st.capacity) return;
  int cap = std::max(st.capacity, 256);
  while (cap < positions) cap *= 2;
  cap = std::min(cap, std::max(st.max_context(), positions));
  const size_t row = size_t(c_.head_dim) * (options_.kv_half ? 2 : 4);
  for (int l = 0; l < c_.n_layers(); ++l) {
    if (c_.mixers[l] != Mixer::Attention) continue;
    for (auto* list : {&st.k, &st.v}) {
      auto nb = device_->new_buffer(size_t(c_.n_kv_heads) * cap * row);
      auto& old = (*list)[l];
      if (old && nb->contents() && old->contents())
        for (int h = 0; h < c_.n_kv_heads; ++h)
          std::memcpy(static_cast<uint8_t*>(nb->contents()) + size_t(h) * cap * row,
                      static_cast<const uint8_t*>(old->contents()) + size_t(h) * st.capacity * row,
                      size_t(st.capacity) * row);
      old = nb;
    }
  }
  st.capacity = cap;
}

void GpuBackend::size_activations(int T) {
  const size_t H = c_.hidden, Hq = c_.n_heads, Hkv = c_.n_kv_heads, D = c_.head_dim;
  const size_t C = c_.gdn_qkv_dim(), vdim = c_.gdn_value_dim(), Hv = c_.gdn_v_heads;
  const size_t I = std::max(c_.moe_intermediate, c_.intermediate), k = std::max(c_.top_k, 1);
  const size_t f = 4 * size_t(T);
  grow(tokens_, f);
  grow(x_, f * H);
  grow(h_, f * H);
  grow(y_, f * H);
  grow(qg_, f * Hq * 2 * D);
  grow(k_, f * Hkv * D);
  grow(v_, f * Hkv * D);
  grow(o_, f * Hq * D);
  grow(part_o_, 4 * Hq * options_.max_splits * D);
  grow(part_ml_, 4 * Hq * options_.max_splits * 2);
  grow(qkv_, f * C);
  grow(qkvz_, f * (C + vdim));
  grow(z_, f * vdim);
  grow(b_, f * Hv);
  grow(a_, f * Hv);
  grow(ba_, f * 2 * Hv);
  grow(conv_out_, f * C);
  grow(go_, f * vdim);
  grow(gdn_gates_, f * Hv * 2);
  grow(router_, f * std::max(c_.n_experts, 1));
  grow(ids_, f * k);
  grow(wts_, f * k);
  grow(act_, f * k * I);
  grow(act_s_, f * std::max(c_.shared_intermediate, 1));
  grow(sgate_, f);
  if (!zeros_ || zeros_->length() < f) {
    grow(zeros_, f);
    if (zeros_->contents()) std::memset(zeros_->contents(), 0, zeros_->length());
  }
}

void GpuBackend::embed(State& state, const int32_t* tokens, int T) {
  auto& st = static_cast<GpuState&>(state);
  T_ = T;
  pos0_ = st.position();
  const size_t f = 4 * size_t(T), H = c_.hidden;
  Ref token_src;
  if (!greedy_) {
    finish();
    reserve_kv(st, pos0_ + T);
    size_activations(T);
    if (tokens_->contents()) std::memcpy(tokens_->contents(), tokens, f);
    token_src = Ref{tokens_, 0};
  } else if (tokens) {  // the first device-loop step: a prompt's last chunk, from the host
    if (step_ != 0 || !inflight_.empty()) throw Error("[gpu] only the first device-loop step takes host tokens");
    size_activations(T);  // nothing in flight: buffers may be replaced
    if (tokens_->contents()) std::memcpy(tokens_->contents(), tokens, f);
    token_src = Ref{tokens_, 0};
  } else {  // the previous step's token (sized and reserved by begin_device_decode)
    if (T != 1) throw Error("[gpu] device-loop steps take their token from the device");
    if (step_ == 0) throw Error("[gpu] the first device-loop step brings its tokens from the host");
    token_src = Ref{ring_, size_t((step_ + 1) % 2) * 4};
  }
  in_ = st.parity;
  st.parity ^= 1;

  const Linear& E = weights_->embed;
  EmbedArgs args{};
  args.w = matrix(E, "embed_tokens");
  args.vocab = uint32_t(c_.vocab);
  const std::string S = scalar_name(E.dtype);
  Dispatch d(*this, "quant.metal", "embed_" + S);
  d.buf(0, weight(E.w, "embed_tokens"))
      .buf(1, E.quantized() ? weight(E.scales, "embed scales") : Ref{dummy_, 0})
      .buf(2, E.quantized() ? weight(E.biases, "embed biases") : Ref{dummy_, 0})
      .buf(3, token_src)
      .buf(4, x_)
      .args(5, args)
      .reads(token_src.buf, f, token_src.off)
      .writes(x_, f * H)
      .weight_bytes(uint64_t(T) * E.nbytes() / std::max(E.out, 1));
  d.run({div_up(H, 256), uint32_t(T), 1}, {256, 1, 1});
}

void GpuBackend::norm(const std::vector<float>& w, bool add) {
  const size_t n = size_t(T_) * c_.hidden * 4;
  NormArgs args{uint32_t(c_.hidden), add ? 1u : 0u, c_.rms_eps};
  Dispatch d(*this, "norm.metal", "add_rms_norm");
  d.buf(0, x_).buf(1, add ? y_ : x_).buf(2, vec(w)).buf(3, h_).args(4, args).reads(x_, n).writes(h_, n);
  if (add) d.reads(y_, n).writes(x_, n);
  d.run({uint32_t(T_), 1, 1}, {256, 1, 1});
}

void GpuBackend::rms_norm(const std::vector<float>& w) { norm(w, false); }
void GpuBackend::add_rms_norm(const std::vector<float>& w) { norm(w, true); }

void GpuBackend::gemv(const Linear& W, const Ref& x, int ldx, const Ref& y, int ldy, int T) {
  if (T >= options_.gemm_min_rows && gemm_fits(W)) return gemm(W, x, ldx, y, ldy, T);  // prefill
  GemvArgs args{};
  args.w = matrix(W, "a projection");
  args.ldx = uint32_t(ldx);
  args.ldy = uint32_t(ldy);
  Dispatch d(*this, "quant.metal", "gemv_" + std::string(scalar_name(W.dtype)));
  d.projection(W, x, ldx, y, ldy, T).args(5, args);
  d.run({div_up(W.out, kGemvRows), uint32_t(T), 1}, {kGemvThreads, 1, 1});
}

// ---- attention ---------------------------------------------------------------------------------

void GpuBackend::attention(State& state, int layer, const AttentionWeights& w) {
  auto& st = static_cast<GpuState&>(state);
  const int T = T_, H = c_.hidden, Hq = c_.n_heads, Hkv = c_.n_kv_heads, D = c_.head_dim;
  gemv(w.q_proj, {h_, 0}, H, {qg_, 0}, Hq * 2 * D, T);
  gemv(w.k_proj, {h_, 0}, H, {k_, 0}, Hkv * D, T);
  gemv(w.v_proj, {h_, 0}, H, {v_, 0}, Hkv * D, T);

  const uint64_t row = uint64_t(D) * (options_.kv_half ? 2 : 4);
  const std::string kv = options_.kv_half ? "half" : "float";
  // Contiguous cache, or fixed blocks for long contexts (csrc/gpu/kv_blocks.cpp).
  const bool blocks = st.block_len > 0;
  const std::string layout = blocks ? "blocks_" : "";
  const uint32_t cap = uint32_t(blocks ? st.block_len : st.capacity);
  {
    AttnPrepareArgs a{uint32_t(D), uint32_t(c_.rotary_dim), uint32_t(Hq), uint32_t(Hkv),
                      uint32_t(pos0_), cap, c_.rms_eps};
    Dispatch d(*this, "attention.metal", "attn_prepare_" + layout + kv);
    d.buf(0, qg_).buf(1, k_).buf(2, v_).buf(3, vec(w.q_norm)).buf(4, vec(w.k_norm)).buf(5, inv_freq_)
        .args(8, a)
        .reads(qg_, size_t(T) * Hq * 2 * D * 4).writes(qg_, size_t(T) * Hq * 2 * D * 4)
        .reads(k_, size_t(T) * Hkv * D * 4).reads(v_, size_t(T) * Hkv * D * 4);
    bind_kv(d, st, layer, 6, true, uint64_t(T) * Hkv * row);
    d.run({uint32_t(Hq + Hkv), uint32_t(T), 1}, {128, 1, 1});
  }

  // Route by context: one pass, or split-K over the cache and a combine.
  const int n_ctx = pos0_ + T;
  int splits = 1, split_len = n_ctx;
  if (T == 1 && n_ctx > options_.split_threshold) {
    // Over blocks a split is whole blocks, so each threadgroup walks its own blocks.
    const int unit = blocks ? st.block_len : 1;
    split_len = std::max(unit, options_.split_len / unit * unit);
    splits = div_up(n_ctx, split_len);
    if (splits > options_.max_splits) {
      split_len = int(div_up(div_up(n_ctx, options_.max_splits), unit)) * unit;
      splits = div_up(n_ctx, split_len);
    }
  }
  if (prefill_attention(st, layer)) {  // chunks of T > 1: csrc/gpu/prefill_mixers.cpp
    gemv(w.o_proj, {o_, 0}, Hq * D, {y_, 0}, H, T);
    return;
  }
  AttnArgs a{uint32_t(D), uint32_t(Hq), uint32_t(Hkv), cap, uint32_t(pos0_),
             uint32_t(splits), uint32_t(split_len), 1.0f / std::sqrt(float(D))};
  const size_t part_o = size_t(Hq) * splits * D * 4, part_ml = size_t(Hq) * splits * 2 * 4;
  {
    Dispatch d(*this, "attention.metal", "attn_decode_" + layout + kv + "_d" + std::to_string(D));
    d.buf(0, qg_).buf(3, o_).buf(4, part_o_).buf(5, part_ml_).args(6, a)
        .reads(qg_, size_t(T) * Hq * 2 * D * 4);
    bind_kv(d, st, layer, 1, false, uint64_t(Hkv) * n_ctx * row);
    if (splits == 1) d.writes(o_, size_t(T) * Hq * D * 4);
    else d.writes(part_o_, part_o).writes(part_ml_, part_ml);
    d.run({uint32_t(Hkv), uint32_t(splits), uint32_t(T)}, {32 * LILY_ATTN_SIMDGROUPS, 1, 1});
  }
  if (splits > 1) {
    Dispatch d(*this, "attention.metal", "attn_combine");
    d.buf(0, qg_).buf(1, part_o_).buf(2, part_ml_).buf(3, o_).args(4, a)
        .reads(qg_, size_t(Hq) * 2 * D * 4).reads(part_o_, part_o).reads(part_ml_, part_ml)
        .writes(o_, size_t(Hq) * D * 4);
    d.run({uint32_t(Hq), 1, 1}, {128, 1, 1});
  }
  gemv(w.o_proj, {o_, 0}, Hq * D, {y_, 0}, H, T);
}

// ---- Gated DeltaNet ----------------------------------------------------------------------------

void GpuBackend::gated_deltanet(State& state, int layer, const GdnWeights& w) {
  auto& st = static_cast<GpuState&>(state);
  const int T = T_, H = c_.hidden, C = c_.gdn_qkv_dim(), vdim = c_.gdn_value_dim(), Hv = c_.gdn_v_heads;
  GdnArgs args{uint32_t(T), uint32_t(c_.gdn_k_heads), uint32_t(Hv), uint32_t(c_.gdn_k_dim),
               uint32_t(c_.gdn_v_dim), uint32_t(c_.conv_kernel), uint32_t(C), c_.rms_eps,
               1.0f / std::sqrt(float(c_.gdn_k_dim))};
  const size_t f = size_t(T) * 4;
  if (c_.gdn_fused_qkvz) {
    gemv(w.in_qkvz, {h_, 0}, H, {qkvz_, 0}, C + vdim, T);
    gemv(w.in_ba, {h_, 0}, H, {ba_, 0}, 2 * Hv, T);
    const uint32_t n = uint32_t(C + vdim + 2 * Hv);
    Dispatch d(*this, "gdn.metal", "gdn_ungroup");
    d.buf(0, qkvz_).buf(1, ba_).buf(2, qkv_).buf(3, z_).buf(4, b_).buf(5, a_).args(6, args)
        .reads(qkvz_, f * (C + vdim)).reads(ba_, f * 2 * Hv)
        .writes(qkv_, f * C).writes(z_, f * vdim).writes(b_, f * Hv).writes(a_, f * Hv);
    d.run({div_up(n, 256), uint32_t(T), 1}, {256, 1, 1});
  } else {
    gemv(w.in_qkv, {h_, 0}, H, {qkv_, 0}, C, T);
    gemv(w.in_z, {h_, 0}, H, {z_, 0}, vdim, T);
    gemv(w.in_b, {h_, 0}, H, {b_, 0}, Hv, T);
    gemv(w.in_a, {h_, 0}, H, {a_, 0}, Hv, T);
  }
  const int out = in_ ^ 1;
  if (prefill_gated_deltanet(st, layer, w, args)) {  // chunks of T > 1: csrc/gpu/prefill_mixers.cpp
    gemv(w.out_proj, {go_, 0}, vdim, {y_, 0}, H, T);
    return;
  }
  {
    Dispatch d(*this, "gdn.metal", "gdn_conv");
    d.buf(0, qkv_).buf(1, vec(w.conv1d)).buf(2, st.conv[in_][layer]).buf(3, conv_out_).args(4, args)
        .buf(5, st.conv[out][layer])
        .reads(qkv_, f * C).writes(conv_out_, f * C)
        .state(st.conv[in_][layer], false, st.conv[in_][layer]->length())
        .state(st.conv[out][layer], true, st.conv[out][layer]->length());
    d.run({div_up(C, 256), 1, 1}, {256, 1, 1});
  }
  {
    Dispatch d(*this, "gdn.metal", "gdn_recurrence_dk" + std::to_string(c_.gdn_k_dim));
    d.buf(0, conv_out_).buf(1, b_).buf(2, a_).buf(3, z_).buf(4, vec(w.a_neg)).buf(5, vec(w.dt_bias))
        .buf(6, vec(w.norm)).buf(7, st.S[in_][layer]).buf(8, go_).args(9, args).buf(10, st.S[out][layer])
        .reads(conv_out_, f * C).reads(b_, f * Hv).reads(a_, f * Hv).reads(z_, f * vdim)
        .writes(go_, f * vdim)
        .state(st.S[in_][layer], false, st.S[in_][layer]->length())
        .state(st.S[out][layer], true, st.S[out][layer]->length());
    d.run({uint32_t(Hv), 1, 1}, {32 * div_up(c_.gdn_v_dim, 32), 1, 1});
  }
  gemv(w.out_proj, {go_, 0}, vdim, {y_, 0}, H, T);
}

// ---- feed-forward ------------------------------------------------------------------------------


const GpuBackend::ExpertTables& GpuBackend::tables(const MoeWeights* moe, const MlpWeights* mlp) {
  const void* key = moe ? static_cast<const void*>(moe) : static_cast<const void*>(mlp);
  auto& slot = tables_[key];
  if (slot) return *slot;
  slot = std::make_unique<ExpertTables>();

  auto build = [&](const std::vector<const Linear*>& list, const char* what) {
    ExpertMatrix mt;
    const Linear& L0 = *list[0];
    mt.m = matrix(L0, what);
    mt.dtype = L0.dtype;
    mt.nbytes = L0.nbytes();
    mt.experts = int(list.size());
    // Every expert's parts must live in the region of expert 0's (one mapped file).
    Ref w0 = weight(L0.w, what);
    Ref s0 = L0.quantized() ? weight(L0.scales, what) : w0;
    Ref b0 = L0.quantized() ? weight(L0.biases, what) : w0;
    mt.w = {w0.buf, 0};
    mt.s = {s0.buf, 0};
    mt.b = {b0.buf, 0};
    mt.table = device_->new_buffer(list.size() * 3 * 8);
    auto* t = static_cast<uint64_t*>(mt.table->contents());
    for (size_t e = 0; e < list.size(); ++e) {
      const Linear& L = *list[e];
      if (L.format != L0.format || L.bits != L0.bits || L.group != L0.group || L.dtype != L0.dtype ||
          L.in != L0.in || L.out != L0.out)
        throw ConfigError(std::string("[gpu] ") + what + ": experts differ in format or shape");
      Ref rw = weight(L.w, what), rs = L.quantized() ? weight(L.scales, what) : rw,
          rb = L.quantized() ? weight(L.biases, what) : rw;
      if (rw.buf != w0.buf || rs.buf != s0.buf || rb.buf != b0.buf)
        throw ConfigError(std::string("[gpu] ") + what + ": experts of one layer span several files");
      if (t) {
        t[3 * e + 0] = rw.off;
        t[3 * e + 1] = rs.off;
        t[3 * e + 2] = rb.off;
      }
    }
    return mt;
  };
  auto one = [](const Linear& L) { return std::vector<const Linear*>{&L}; };
  if (moe) {
    std::vector<const Linear*> g, u, d;
    for (const auto& e : moe->experts) {
      g.push_back(&e.gate);
      u.push_back(&e.up);
      d.push_back(&e.down);
    }
    slot->gate = build(g, "experts' gate_proj");
    slot->up = build(u, "experts' up_proj");
    slot->down = build(d, "experts' down_proj");
    if (c_.shared_intermediate > 0) {
      slot->shared_gate = build(one(moe->shared.gate), "shared expert gate_proj");
      slot->shared_up = build(one(moe->shared.up), "shared expert up_proj");
      slot->shared_down = build(one(moe->shared.down), "shared expert down_proj");
      if (slot->shared_down.dtype != slot->down.dtype)
        throw ConfigError("[gpu] the shared expert's down_proj and the experts' differ in scale dtype");
    }
  } else {
    slot->gate = build(one(mlp->gate), "mlp gate_proj");
    slot->up = build(one(mlp->up), "mlp up_proj");
    slot->down = build(one(mlp->down), "mlp down_proj");
  }
  if (slot->gate.dtype != slot->up.dtype)
    throw ConfigError("[gpu] gate_proj and up_proj differ in scale dtype");
  return *slot;
}

// act[t, j, :] = silu(gate_e . h[t]) * (up_e . h[t]) for e = ids[t, j], j < k.
void GpuBackend::gate_up_gemv(const ExpertMatrix& gate, const ExpertMatrix& up, const Ref& ids, int k,
                              const std::shared_ptr<Buffer>& act) {
  const int T = T_, I = int(gate.m.out);
  const size_t f = size_t(T) * 4;
  MoeGateUpArgs a{gate.m, up.m, uint32_t(k)};
  Dispatch d(*this, "moe.metal", "moe_gate_up_" + std::string(scalar_name(gate.dtype)));
  d.experts(0, gate).experts(4, up).buf(8, ids).buf(9, h_).buf(10, act).args(11, a)
      .reads(h_, f * c_.hidden).writes(act, f * k * I)
      .weight_bytes(uint64_t(std::min(T * k, gate.experts)) * (gate.nbytes + up.nbytes));
  if (ids.buf != zeros_) d.reads(ids.buf, f * k, ids.off);  // (zeros_: one job, never written)
  d.run({div_up(I, kGemvRows), uint32_t(k), uint32_t(T)}, {kGemvThreads, 1, 1});
}

// y[t] = sum_j w[t, j] down_e . act[t, j]  (+ sigmoid(sgate[t]) shared_down . act_s[t]).
void GpuBackend::down_gemv(const ExpertMatrix& down, const ExpertMatrix* shared, const Ref& ids, int k,
                           bool weighted) {
  const int T = T_, H = c_.hidden, I = int(down.m.in);
  const size_t f = size_t(T) * 4;
  const ExpertMatrix& sd = shared ? *shared : down;
  MoeDownArgs a{down.m, sd.m, uint32_t(k), weighted ? 1u : 0u, shared ? 1u : 0u};
  Dispatch d(*this, "moe.metal", "moe_down_" + std::string(scalar_name(down.dtype)));
  d.experts(0, down).buf(4, ids).buf(5, weighted ? wts_ : dummy_).buf(6, act_).experts(7, sd)
      .buf(11, shared ? act_s_ : dummy_).buf(12, shared ? sgate_ : dummy_).buf(13, y_).args(14, a)
      .reads(act_, f * k * I).writes(y_, f * H)
      .weight_bytes(uint64_t(std::min(T * k, down.experts)) * down.nbytes + (shared ? sd.nbytes : 0));
  if (ids.buf != zeros_) d.reads(ids.buf, f * k, ids.off);
  if (weighted) d.reads(wts_, f * k);
  if (shared) d.reads(act_s_, f * sd.m.in).reads(sgate_, f);
  d.run({div_up(H, kGemvRows), uint32_t(T), 1}, {kGemvThreads, 1, 1});
}

void GpuBackend::mlp(const MlpWeights& w) {
  const ExpertTables& tb = tables(nullptr, &w);
  if (T_ >= options_.gemm_min_rows && grouped_fits(tb)) return mlp_prefill(tb);
  gate_up_gemv(tb.gate, tb.up, {zeros_, 0}, 1, act_);
  down_gemv(tb.down, nullptr, {zeros_, 0}, 1, false);
}

void GpuBackend::moe(const MoeWeights& w) {
  const ExpertTables& tb = tables(&w, nullptr);
  const int T = T_, H = c_.hidden, E = c_.n_experts, k = c_.top_k;
  const bool shared = c_.shared_intermediate > 0;
  const size_t f = size_t(T) * 4;

  gemv(w.router, {h_, 0}, H, {router_, 0}, E, T);
  if (shared) gemv(w.shared_gate, {h_, 0}, H, {sgate_, 0}, 1, T);
  {
    MoeRouteArgs a{uint32_t(E), uint32_t(k), c_.norm_topk_prob ? 1u : 0u};
    Dispatch d(*this, "moe.metal", "moe_route");
    d.buf(0, router_).buf(1, ids_).buf(2, wts_).args(3, a)
        .reads(router_, f * E).writes(ids_, f * k).writes(wts_, f * k);
    d.run({uint32_t(T), 1, 1}, {32 * div_up(E, 32), 1, 1});
  }
  if (T >= options_.gemm_min_rows && grouped_fits(tb)) return moe_prefill(tb);  // prefill_moe.cpp
  if (shared) gate_up_gemv(tb.shared_gate, tb.shared_up, {zeros_, 0}, 1, act_s_);  // beside the routing
  gate_up_gemv(tb.gate, tb.up, {ids_, 0}, k, act_);
  down_gemv(tb.down, shared ? &tb.shared_down : nullptr, {ids_, 0}, k, true);
}

// ---- head ----------------------------------------------------------------------------------------

void GpuBackend::lm_head(const Linear& head, int first, int n, float* logits) {
  const size_t bytes = size_t(n) * head.out * 4;
  if (!greedy_) grow(logits_, bytes);
  gemv(head, {h_, size_t(first) * c_.hidden * 4}, c_.hidden, {logits_, 0}, head.out, n);
  if (!greedy_) {
    finish();
    if (logits && logits_->contents()) std::memcpy(logits, logits_->contents(), bytes);
    return;
  }
  // Device-loop step: the chosen token goes into this step's ring slot (the next step's input);
  // commit and return without waiting.
  encode_sample(head.out);
  auto cb = std::move(cb_);
  auto enc = std::move(enc_);
  enc->end_encoding();
  cb->commit();
  inflight_.push_back(std::move(cb));
  stats_.max_in_flight = std::max<uint64_t>(stats_.max_in_flight, inflight_.size());
  ++step_;
}

}  // namespace lily::gpu
