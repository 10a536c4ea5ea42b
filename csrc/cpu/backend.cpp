#include "cpu/backend.h"

#include <algorithm>
#include <new>
#include <string>
#include <vector>

#include "cpu/linear.h"
#include "cpu/linear_int8.h"
#include "cpu/norm.h"
#include "model/error.h"
#include "model/safetensors.h"

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

CpuSnapshot& own(const Snapshot& snap, const CpuState* state) {
  auto* s = dynamic_cast<const CpuSnapshot*>(&snap);
  if (!s || s->owner != state) throw RequestError("[state] snapshot was taken from another sequence");
  return const_cast<CpuSnapshot&>(*s);
}

}  // namespace

void CpuState::read_recurrent(const Snapshot& snap, int layer, std::vector<float>& conv, std::vector<float>& S) const {
  const GdnState& g = own(snap, this).gdn[layer];
  conv = g.conv;
  S.assign(g.S.begin(), g.S.end());
}

std::unique_ptr<Snapshot> CpuState::new_snapshot() const {
  auto snap = std::make_unique<CpuSnapshot>();
  snap->owner = this;
  snap->gdn.resize(gdn.size());
  return snap;
}

void CpuState::write_recurrent(Snapshot& snap, int layer, const std::vector<float>& conv,
                               const std::vector<float>& S) const {
  GdnState& g = own(snap, this).gdn[layer];
  g.conv = conv;
  g.S.assign(S.begin(), S.end());
}

void CpuState::read_kv_rows(int layer, bool v, int positions, float* out) const {
  const KvCache& c = kv[layer];
  const size_t run = size_t(positions) * c.head_dim;
  for (int h = 0; h < c.kv_heads && positions > 0; ++h) {  // the cache's layout -> [Hkv, positions, D]
    if (v) std::copy_n(c.v.data() + size_t(h) * c.capacity * c.head_dim, run, out + h * run);
    else
      for (int p = 0; p < positions; ++p) c.get_k(h, p, out + h * run + size_t(p) * c.head_dim);
  }
}

void CpuState::reserve_kv_rows(int rows) {
  for (size_t l = 0; l < kv.size(); ++l) {
    if (kv[l].kv_heads == 0) continue;  // a DeltaNet layer
    try {
      kv[l].reserve(rows, max_context_);
    } catch (const std::bad_alloc&) {
      throw RequestError("[kv-cache] out of memory growing layer " + std::to_string(l) + "'s KV cache to " +
                         std::to_string(rows) + " positions; use a shorter context");
    }
  }
}

void CpuState::write_kv_rows(int layer, bool v, int rows, const float* in) {
  KvCache& c = kv[layer];
  const size_t run = size_t(rows) * c.head_dim;
  for (int h = 0; h < c.kv_heads && rows > 0; ++h) {  // [Hkv, rows, D] -> the cache's layout
    if (v) std::copy_n(in + h * run, run, c.v.data() + size_t(h) * c.capacity * c.head_dim);
    else
      for (int p = 0; p < rows; ++p) c.put_k(h, p, in + h * run + size_t(p) * c.head_dim);
  }
}

bool arrange_for_int8(ModelWeights& w) {
  for (const auto& f : w.files)
    if (f->residency() != Residency::Resident) return false;
  std::vector<Linear*> mats;
  auto mlp = [&](MlpWeights& m) { mats.insert(mats.end(), {&m.gate, &m.up, &m.down}); };
  for (LayerWeights& l : w.layers) {
    mats.insert(mats.end(), {&l.attn.q_proj, &l.attn.k_proj, &l.attn.v_proj, &l.attn.o_proj, &l.gdn.in_qkv,
                             &l.gdn.in_z, &l.gdn.in_b, &l.gdn.in_a, &l.gdn.in_qkvz, &l.gdn.in_ba, &l.gdn.out_proj});
    mlp(l.mlp);
    mlp(l.moe.shared);
    for (MlpWeights& e : l.moe.experts) mlp(e);
    // Not the router and the shared expert's gate: moe.cpp runs them in f32 in every mode.
  }
  // The embedding gathers rows (never interleaved): a tied lm_head shares its bytes.
  if (w.lm_head.w != w.embed.w) mats.push_back(&w.lm_head);
  mats.erase(std::remove_if(mats.begin(), mats.end(), [](const Linear* m) { return !m->present() || !int8_interleavable(*m); }),
             mats.end());
  if (mats.empty()) return false;

  // One copy in the new layout, matrix after matrix in the order a decode step reads them
  // (64-byte aligned each). As each matrix is copied, its old bytes are released: the loader's
  // copy gives its 2 MiB pages back as they empty, for the new copy to fill (pages.h), so the
  // peak stays about one matrix above the checkpoint's size.
  auto at64 = [](size_t n) { return (n + 63) & ~size_t(63); };
  size_t total = 0;
  for (const Linear* m : mats) total += at64(interleaved_bytes(*m));
  auto copy = std::make_shared<HugePages>(total, "the int8 CPU engine's copy of the weights");
  // Owned by the weights from here: should a step below throw, every matrix is still whole,
  // either rearranged into the copy or as loaded, and no other engine may take them.
  w.arranged = copy;
  auto release = [&](const uint8_t* p, size_t n) {
    for (const auto& f : w.files)
      if (f->holds(p)) return f->release(p, n);
    throw std::logic_error("arrange_for_int8: a matrix outside the checkpoint's files");
  };
  size_t at = 0;
  for (Linear* m : mats) {
    const Linear src = *m;
    *m = interleave_rows(src, copy->data() + at);
    at += at64(interleaved_bytes(src));
    const size_t pbytes = size_t(src.out) * (src.in / src.group) * dtype_size(src.dtype);
    release(src.w, src.row_bytes() * src.out);
    release(src.scales, pbytes);
    release(src.biases, pbytes);
  }
  for (const auto& f : w.files) f->finish_release();
  copy->protect();
  return true;
}

CpuBackend::CpuBackend(std::shared_ptr<const ModelWeights> weights, int n_threads, Matmul matmul)
    : weights_(std::move(weights)), c_(weights_->config), pool_(n_threads), matmul_(matmul) {
  attn_.matmul = gdn_.matmul = ffn_.matmul = matmul;
  conv_taps_.resize(c_.n_layers());
  for (int l = 0; l < c_.n_layers(); ++l)
    if (c_.mixers[l] != Mixer::Attention) conv_taps_[l] = transpose_conv_taps(c_, weights_->layers[l].gdn);
}

std::unique_ptr<State> CpuBackend::new_state(int max_context) {
  auto st = std::make_unique<CpuState>(c_);
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

void CpuBackend::embed(Segments segs, const int32_t* tokens) {
  // Grow every segment's KV caches for this pass before any layer runs: if memory runs out, the
  // pass fails here with every state untouched (positions, KV entries, DeltaNet state all as
  // before; a cache grown for an earlier segment keeps its larger capacity, nothing else),
  // instead of after some layers have already advanced their recurrent state.
  for (const SeqRows& seg : segs) {
    auto& s = static_cast<CpuState&>(*seg.state);
    for (int l = 0; l < c_.n_layers(); ++l) {
      if (c_.mixers[l] != Mixer::Attention) continue;
      try {
        s.kv[l].reserve(s.position() + seg.n, s.max_context());
      } catch (const std::bad_alloc&) {
        throw RequestError("[kv-cache] out of memory growing layer " + std::to_string(l) + "'s KV cache to " +
                           std::to_string(s.position() + seg.n) + " positions; use a shorter context");
      }
    }
  }
  const int T = segs.rows();
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

void CpuBackend::attention(Segments segs, int layer, const AttentionWeights& w) {
  kv_rows_.clear();
  for (const SeqRows& seg : segs) {
    auto& s = static_cast<CpuState&>(*seg.state);
    kv_rows_.push_back({&s.kv[layer], s.position(), seg.first, seg.n});
  }
  attention_mixer(c_, w, kv_rows_.data(), segs.size(), h_.data(), T_, y_.data(), attn_, pool_);
}

void CpuBackend::gated_deltanet(Segments segs, int layer, const GdnWeights& w) {
  gdn_rows_.clear();
  for (const SeqRows& seg : segs) gdn_rows_.push_back({&static_cast<CpuState&>(*seg.state).gdn[layer], seg.first, seg.n});
  gated_deltanet_mixer(c_, w, conv_taps_[layer].data(), gdn_rows_.data(), segs.size(), h_.data(), T_, y_.data(), gdn_,
                       pool_);
}

void CpuBackend::mlp(const MlpWeights& w) { mlp_block(w, h_.data(), T_, y_.data(), ffn_, pool_); }
void CpuBackend::moe(const MoeWeights& w) { moe_block(c_, w, h_.data(), T_, y_.data(), ffn_, pool_); }

void CpuBackend::lm_head(const Linear& head, int first, int n, float* logits) {
  linear(head, h_.data() + size_t(first) * c_.hidden, n, logits, pool_, matmul_);
}

}  // namespace lily::cpu
