#include "cpu/backend.h"

#include <algorithm>
#include <new>
#include <string>

#include "cpu/linear.h"
#include "cpu/norm.h"
#include "model/error.h"

namespace lily::cpu {

size_t CpuState::nbytes() const {
  size_t n = 0;
  for (const auto& c : kv) n += (c.k.capacity() + c.v.capacity()) * sizeof(float);
  for (const auto& g : gdn) n += (g.conv.capacity() + g.S.capacity()) * sizeof(float);
  return n;
}

size_t CpuSnapshot::nbytes() const {
  size_t n = 0;
  for (const auto& g : gdn) n += (g.conv.size() + g.S.size()) * sizeof(float);
  return n;
}

std::unique_ptr<Snapshot> CpuState::capture() const {
  auto snap = std::make_unique<CpuSnapshot>();
  snap->owner = this;
  snap->gdn = gdn;
  return snap;
}

void CpuState::apply(const Snapshot& snap) {
  const auto* s = dynamic_cast<const CpuSnapshot*>(&snap);
  if (!s || s->owner != this) throw RequestError("[state] snapshot was taken from another sequence");
  gdn = s->gdn;
}

// ---- state as named tensors (State::export_tensors / import_tensors) -------------------------

namespace {

std::string layer_name(const char* kind, size_t layer, const char* part) {
  return std::string(kind) + "." + std::to_string(layer) + "." + part;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool is_kv_name(const std::string& name) { return name.rfind("kv.", 0) == 0; }

// The tensor named `name`, checked to have `shape`; throws if absent or mis-shaped.
const StateTensor& expect(const std::vector<StateTensor>& tensors, const std::string& name,
                          const std::vector<int64_t>& shape) {
  for (const auto& t : tensors)
    if (t.name == name) {
      if (t.shape != shape)
        throw RequestError("[state] tensor '" + name + "' has shape " + shape_str(t.shape) + ", this model's is " +
                           shape_str(shape));
      return t;
    }
  throw RequestError("[state] tensor '" + name + "' is missing");
}

}  // namespace

std::vector<StateTensor> CpuState::tensors_of(const Snapshot& recurrent, int positions, bool with_kv) const {
  const auto* snap = dynamic_cast<const CpuSnapshot*>(&recurrent);
  if (!snap || snap->owner != this) throw RequestError("[state] snapshot was taken from another sequence");
  std::vector<StateTensor> out;
  for (size_t l = 0; l < kv.size(); ++l) {
    const KvCache& c = kv[l];
    if (!with_kv || c.kv_heads == 0) continue;
    for (const auto& [part, src] : {std::pair{"k", &c.k}, std::pair{"v", &c.v}}) {
      StateTensor t{layer_name("kv", l, part), {c.kv_heads, positions, c.head_dim}, {}};
      t.data.resize(size_t(c.kv_heads) * positions * c.head_dim);
      for (int h = 0; h < c.kv_heads; ++h)  // [Hkv, capacity, D] -> [Hkv, positions, D]
        std::copy_n(src->data() + size_t(h) * c.capacity * c.head_dim, size_t(positions) * c.head_dim,
                    t.data.data() + size_t(h) * positions * c.head_dim);
      out.push_back(std::move(t));
    }
  }
  const ModelConfig& c = *config;
  for (size_t l = 0; l < snap->gdn.size(); ++l) {
    const GdnState& g = snap->gdn[l];
    if (c.mixers[l] == Mixer::Attention) continue;
    out.push_back({layer_name("gdn", l, "conv"), {c.conv_kernel - 1, c.gdn_qkv_dim()}, g.conv});
    out.push_back({layer_name("gdn", l, "S"), {c.gdn_v_heads, c.gdn_k_dim, c.gdn_v_dim}, g.S});
  }
  return out;
}

std::unique_ptr<Snapshot> CpuState::recurrent_from(const std::vector<StateTensor>& tensors) const {
  const ModelConfig& c = *config;
  auto snap = std::make_unique<CpuSnapshot>();
  snap->owner = this;
  snap->gdn.resize(gdn.size());
  size_t used = 0;
  for (size_t l = 0; l < gdn.size(); ++l) {
    if (c.mixers[l] == Mixer::Attention) continue;
    snap->gdn[l].conv = expect(tensors, layer_name("gdn", l, "conv"), {c.conv_kernel - 1, c.gdn_qkv_dim()}).data;
    snap->gdn[l].S = expect(tensors, layer_name("gdn", l, "S"), {c.gdn_v_heads, c.gdn_k_dim, c.gdn_v_dim}).data;
    used += 2;
  }
  size_t recurrent = 0;
  for (const auto& t : tensors)
    if (!is_kv_name(t.name)) ++recurrent;
  if (recurrent != used)  // a name this model does not have (another model, or a bad file)
    for (const auto& t : tensors) {
      if (is_kv_name(t.name)) continue;
      bool known = false;
      for (size_t l = 0; l < gdn.size() && !known; ++l)
        known = c.mixers[l] != Mixer::Attention &&
                (t.name == layer_name("gdn", l, "conv") || t.name == layer_name("gdn", l, "S"));
      if (!known) throw RequestError("[state] unknown tensor '" + t.name + "' (not a state tensor of this model)");
    }
  return snap;
}

void CpuState::check_kv(int positions, const std::vector<StateTensor>& tensors) const {
  size_t expected = 0;
  for (size_t l = 0; l < kv.size(); ++l) {
    const KvCache& c = kv[l];
    if (c.kv_heads == 0) continue;
    int rows = -1;
    for (const char* part : {"k", "v"}) {
      const std::string name = layer_name("kv", l, part);
      const StateTensor* t = nullptr;
      for (const auto& x : tensors)
        if (x.name == name) t = &x;
      if (!t) throw RequestError("[state] tensor '" + name + "' is missing");
      if (t->shape.size() != 3 || t->shape[0] != c.kv_heads || t->shape[2] != c.head_dim)
        throw RequestError("[state] tensor '" + name + "' has shape " + shape_str(t->shape) + ", this model's is [" +
                           std::to_string(c.kv_heads) + ", positions, " + std::to_string(c.head_dim) + "]");
      if (t->shape[1] < positions || t->shape[1] > max_context_ || (rows >= 0 && t->shape[1] != rows))
        throw RequestError("[state] tensor '" + name + "' holds " + std::to_string(t->shape[1]) + " positions; " +
                           std::to_string(positions) + " to " + std::to_string(max_context_) + " expected, " +
                           "the same for K and V");
      rows = int(t->shape[1]);
      ++expected;
    }
  }
  size_t given = 0;
  for (const auto& t : tensors)
    if (is_kv_name(t.name)) ++given;
  if (given != expected)
    for (const auto& t : tensors) {
      if (!is_kv_name(t.name)) continue;
      bool known = false;
      for (size_t l = 0; l < kv.size() && !known; ++l)
        known = kv[l].kv_heads && (t.name == layer_name("kv", l, "k") || t.name == layer_name("kv", l, "v"));
      if (!known) throw RequestError("[state] unknown tensor '" + t.name + "' (not a state tensor of this model)");
    }
}

void CpuState::load_kv(const std::vector<StateTensor>& tensors) {
  // check_kv has vouched for each "kv.<l>.<k|v>" name and its shape [Hkv, rows, D]. Every cache
  // grows first, so running out of memory leaves the contents as they were.
  for (const auto& t : tensors) {
    if (!is_kv_name(t.name)) continue;
    const size_t l = std::stoul(t.name.substr(3));
    try {
      kv[l].reserve(int(t.shape[1]), max_context_);
    } catch (const std::bad_alloc&) {
      throw RequestError("[kv-cache] out of memory loading layer " + std::to_string(l) + "'s KV cache of " +
                         std::to_string(t.shape[1]) + " positions");
    }
  }
  for (const auto& t : tensors) {
    if (!is_kv_name(t.name)) continue;
    KvCache& c = kv[std::stoul(t.name.substr(3))];
    const size_t row = size_t(t.shape[1]) * c.head_dim;
    std::vector<float>& dst = t.name.back() == 'k' ? c.k : c.v;
    for (int h = 0; h < c.kv_heads; ++h)  // [Hkv, rows, D] -> [Hkv, capacity, D]
      std::copy_n(t.data.data() + h * row, row, dst.data() + size_t(h) * c.capacity * c.head_dim);
  }
}

CpuBackend::CpuBackend(std::shared_ptr<const ModelWeights> weights, int n_threads, Matmul matmul)
    : weights_(std::move(weights)), c_(weights_->config), pool_(n_threads), matmul_(matmul) {
  attn_.matmul = gdn_.matmul = ffn_.matmul = matmul;
  conv_taps_.resize(c_.n_layers());
  for (int l = 0; l < c_.n_layers(); ++l)
    if (c_.mixers[l] != Mixer::Attention) conv_taps_[l] = transpose_conv_taps(c_, weights_->layers[l].gdn);
}

std::unique_ptr<State> CpuBackend::new_state(int max_context) {
  auto st = std::make_unique<CpuState>();
  st->config = &c_;
  st->kv.resize(c_.n_layers());
  st->gdn.resize(c_.n_layers());
  for (int l = 0; l < c_.n_layers(); ++l) {
    if (c_.mixers[l] == Mixer::Attention) {
      st->kv[l].kv_heads = c_.n_kv_heads;
      st->kv[l].head_dim = c_.head_dim;
    } else {
      st->gdn[l].conv.assign(size_t(c_.conv_kernel - 1) * c_.gdn_qkv_dim(), 0.0f);
      st->gdn[l].S.assign(size_t(c_.gdn_v_heads) * c_.gdn_k_dim * c_.gdn_v_dim, 0.0f);
    }
  }
  return st;
}

void CpuBackend::embed(State& st, const int32_t* tokens, int T) {
  // Grow every layer's KV cache for this chunk before any layer runs: if memory runs out, the
  // chunk fails here with the state untouched (position, KV, DeltaNet state all as before),
  // instead of after some layers have already advanced their recurrent state.
  auto& s = static_cast<CpuState&>(st);
  for (int l = 0; l < c_.n_layers(); ++l) {
    if (c_.mixers[l] != Mixer::Attention) continue;
    try {
      s.kv[l].reserve(s.position() + T, s.max_context());
    } catch (const std::bad_alloc&) {
      throw RequestError("[kv-cache] out of memory growing layer " + std::to_string(l) + "'s KV cache to " +
                         std::to_string(s.position() + T) + " positions; use a shorter context");
    }
  }
  T_ = T;
  const size_t n = size_t(T) * c_.hidden;
  x_.resize(n);
  h_.resize(n);
  y_.resize(n);
  embedding(weights_->embed, tokens, T, x_.data(), pool_);
}

void CpuBackend::norm_rows(const std::vector<float>& w, bool add) {
  const int H = c_.hidden;
  pool_.parallel_for(T_, [&](int64_t t0, int64_t t1, int) {
    for (int64_t t = t0; t < t1; ++t) {
      float* x = x_.data() + size_t(t) * H;
      if (add) {
        const float* y = y_.data() + size_t(t) * H;
        for (int i = 0; i < H; ++i) x[i] += y[i];
      }
      cpu::rms_norm(x, w.data(), H, c_.rms_eps, h_.data() + size_t(t) * H);
    }
  });
}

void CpuBackend::rms_norm(const std::vector<float>& w) { norm_rows(w, false); }
void CpuBackend::add_rms_norm(const std::vector<float>& w) { norm_rows(w, true); }

void CpuBackend::attention(State& st, int layer, const AttentionWeights& w) {
  auto& s = static_cast<CpuState&>(st);
  attention_mixer(c_, w, s.kv[layer], s.position(), s.max_context(), h_.data(), T_, y_.data(), attn_, pool_);
}

void CpuBackend::gated_deltanet(State& st, int layer, const GdnWeights& w) {
  auto& s = static_cast<CpuState&>(st);
  gated_deltanet_mixer(c_, w, conv_taps_[layer].data(), s.gdn[layer], h_.data(), T_, y_.data(), gdn_, pool_);
}

void CpuBackend::mlp(const MlpWeights& w) { mlp_block(w, h_.data(), T_, y_.data(), ffn_, pool_); }
void CpuBackend::moe(const MoeWeights& w) { moe_block(c_, w, h_.data(), T_, y_.data(), ffn_, pool_); }

void CpuBackend::lm_head(const Linear& head, int first, int n, float* logits) {
  linear(head, h_.data() + size_t(first) * c_.hidden, n, logits, pool_, matmul_);
}

}  // namespace lily::cpu
