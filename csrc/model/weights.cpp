#include "model/weights.h"

#include <cmath>
#include <sstream>

#include "model/checked.h"
#include "model/error.h"

namespace lily {

const char* microscale_name(Microscale m) {
  switch (m) {
    case Microscale::Mxfp4: return "mxfp4";
    case Microscale::Mxfp8: return "mxfp8";
    case Microscale::Nvfp4: return "nvfp4";
  }
  return "?";
}

bool microscale_from_name(const std::string& s, Microscale* out) {
  for (Microscale m : {Microscale::Mxfp4, Microscale::Mxfp8, Microscale::Nvfp4})
    if (s == microscale_name(m)) { *out = m; return true; }
  return false;
}

size_t Linear::row_bytes() const {
  if (format == Format::Affine || format == Format::Microscaled) return size_t(in) * bits / 8;
  return size_t(in) * dtype_size(dtype);
}

size_t Linear::nbytes() const {
  size_t n = row_bytes() * out;
  if (format == Format::Affine) n += 2 * size_t(out) * (in / group) * dtype_size(dtype);
  if (format == Format::Microscaled) n += size_t(out) * (in / group);
  return n;
}

void ModelWeights::check_files_unchanged() const {
  stat_checks_.fetch_add(1, std::memory_order_relaxed);
  try {
    for (const auto& f : files) f->check_unchanged();
  } catch (...) {
    stale_.store(true, std::memory_order_relaxed);
    throw;
  }
}

void ModelWeights::check_files_unchanged_if_touched() const {
  if (!watch) return;  // no file is mapped: resident copies cannot change under us
  if (stale_.load(std::memory_order_relaxed) || watch->maybe_changed()) check_files_unchanged();
}

WeightsBuilder::WeightsBuilder(ModelConfig config) : w_(std::make_shared<ModelWeights>()) {
  config.validate();
  w_->config = std::move(config);
  // No per-layer memory yet: layer() makes a layer's weights when a slot of it is first bound.
  // A config.json claiming 10^6 layers (or 2^31 experts) must not cost that much memory before
  // the checkpoint has shown a single tensor for them.
}

LayerWeights& WeightsBuilder::layer(int l) {
  auto it = layers_.find(l);
  if (it != layers_.end()) return it->second;
  const ModelConfig& c = w_->config;
  LayerWeights L;
  if (c.ffns[l] == Ffn::Moe) {
    // Each expert's three matrices take at least 2 bytes per row in any format (one f16 element,
    // or one packed u32 plus its scale and bias): the files must be able to hold that much.
    const uint64_t rows = saturating_add(saturating_mul(2, uint64_t(c.moe_intermediate)), uint64_t(c.hidden));
    const uint64_t need = saturating_mul(saturating_mul(uint64_t(c.n_experts), rows), 2);
    uint64_t have = 0;
    for (const auto& f : w_->files) have = saturating_add(have, f->file_size());
    if (need > have)
      throw CheckpointError("[weights] config.json's " + std::to_string(c.n_experts) + " experts of layer " +
                            std::to_string(l) + " need at least " + std::to_string(need) +
                            " bytes of weights; the checkpoint files hold " + std::to_string(have));
    L.moe.experts.resize(c.n_experts);
  }
  return layers_.emplace(l, std::move(L)).first->second;
}

int WeightsBuilder::add_file(const std::string& path, Residency residency) {
  w_->files.push_back(std::make_shared<SafetensorsFile>(path, residency));
  return int(w_->files.size()) - 1;
}

const SafetensorsFile& WeightsBuilder::file(int id) const {
  if (id < 0 || id >= int(w_->files.size())) throw Error("[weights] no file with id " + std::to_string(id));
  return *w_->files[id];
}

namespace {

std::vector<std::string> split_dots(const std::string& s) {
  std::vector<std::string> parts;
  std::stringstream ss(s);
  std::string p;
  while (std::getline(ss, p, '.')) parts.push_back(p);
  return parts;
}

bool parse_index(const std::string& s, int limit, int* out) {
  if (s.empty() || s.size() > 9) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  *out = std::stoi(s);
  return *out < limit;
}

}  // namespace

WeightsBuilder::Expect WeightsBuilder::resolve(const std::string& slot) {
  const ModelConfig& c = w_->config;
  auto bad = [&]() -> Expect { throw Error("[weights] unknown slot '" + slot + "'"); };
  std::vector<std::string> p = split_dots(slot);
  if (p.empty()) return bad();
  if (slot == "embed") return {&w_->embed, nullptr, c.vocab, c.hidden};
  if (slot == "lm_head") return {&w_->lm_head, nullptr, c.vocab, c.hidden};
  if (slot == "final_norm") return {nullptr, &w_->final_norm, c.hidden, 0};
  int l = 0;
  if (p.size() < 2 || p[0] != "layers" || !parse_index(p[1], c.n_layers(), &l)) return bad();
  LayerWeights& L = layer(l);
  const std::string rest = slot.substr(p[0].size() + p[1].size() + 2);
  const bool attn = c.mixers[l] == Mixer::Attention;
  const bool moe = c.ffns[l] == Ffn::Moe;
  if (rest == "input_norm") return {nullptr, &L.input_norm, c.hidden, 0};
  if (rest == "post_norm") return {nullptr, &L.post_norm, c.hidden, 0};
  // (Products of config fields: the accessors' values, which validate() checked to fit an int.)
  if (attn) {
    const int qd = c.attn_q_dim(), kd = c.attn_kv_dim();
    if (rest == "attn.q_proj") return {&L.attn.q_proj, nullptr, 2 * qd, c.hidden};
    if (rest == "attn.k_proj") return {&L.attn.k_proj, nullptr, kd, c.hidden};
    if (rest == "attn.v_proj") return {&L.attn.v_proj, nullptr, kd, c.hidden};
    if (rest == "attn.o_proj") return {&L.attn.o_proj, nullptr, c.hidden, qd};
    if (rest == "attn.q_norm") return {nullptr, &L.attn.q_norm, c.head_dim, 0};
    if (rest == "attn.k_norm") return {nullptr, &L.attn.k_norm, c.head_dim, 0};
  } else {
    GdnWeights& g = L.gdn;
    const int qkv = c.gdn_qkv_dim(), vdim = c.gdn_value_dim(), vh = c.gdn_v_heads;
    if (!c.gdn_fused_qkvz) {
      if (rest == "gdn.in_qkv") return {&g.in_qkv, nullptr, qkv, c.hidden};
      if (rest == "gdn.in_z") return {&g.in_z, nullptr, vdim, c.hidden};
      if (rest == "gdn.in_b") return {&g.in_b, nullptr, vh, c.hidden};
      if (rest == "gdn.in_a") return {&g.in_a, nullptr, vh, c.hidden};
    } else {
      if (rest == "gdn.in_qkvz") return {&g.in_qkvz, nullptr, qkv + vdim, c.hidden};
      if (rest == "gdn.in_ba") return {&g.in_ba, nullptr, 2 * vh, c.hidden};
    }
    if (rest == "gdn.out_proj") return {&g.out_proj, nullptr, c.hidden, vdim};
    if (rest == "gdn.conv1d") return {nullptr, &g.conv1d, int(int64_t(qkv) * c.conv_kernel), 0};
    if (rest == "gdn.dt_bias") return {nullptr, &g.dt_bias, vh, 0};
    if (rest == "gdn.A_log") return {nullptr, &g.a_neg, vh, 0};
    if (rest == "gdn.norm") return {nullptr, &g.norm, c.gdn_v_dim, 0};
  }
  if (!moe) {
    if (rest == "mlp.gate") return {&L.mlp.gate, nullptr, c.intermediate, c.hidden};
    if (rest == "mlp.up") return {&L.mlp.up, nullptr, c.intermediate, c.hidden};
    if (rest == "mlp.down") return {&L.mlp.down, nullptr, c.hidden, c.intermediate};
    return bad();
  }
  MoeWeights& m = L.moe;
  if (rest == "moe.router") return {&m.router, nullptr, c.n_experts, c.hidden};
  if (c.shared_intermediate > 0) {
    if (rest == "moe.shared_gate") return {&m.shared_gate, nullptr, 1, c.hidden};
    if (rest == "moe.shared.gate") return {&m.shared.gate, nullptr, c.shared_intermediate, c.hidden};
    if (rest == "moe.shared.up") return {&m.shared.up, nullptr, c.shared_intermediate, c.hidden};
    if (rest == "moe.shared.down") return {&m.shared.down, nullptr, c.hidden, c.shared_intermediate};
  }
  int e = 0;
  if (p.size() == 6 && p[2] == "moe" && p[3] == "experts" && parse_index(p[4], c.n_experts, &e)) {
    MlpWeights& x = m.experts[e];
    if (p[5] == "gate") return {&x.gate, nullptr, c.moe_intermediate, c.hidden};
    if (p[5] == "up") return {&x.up, nullptr, c.moe_intermediate, c.hidden};
    if (p[5] == "down") return {&x.down, nullptr, c.hidden, c.moe_intermediate};
  }
  return bad();
}

const uint8_t* WeightsBuilder::slice_bytes(const TensorSlice& s, int64_t* rows, int64_t* cols,
                                           DType* dtype, const std::string& slot) const {
  const SafetensorsFile& f = file(s.file);
  const TensorInfo* t = f.find(s.name);
  auto fail = [&](const std::string& what) -> void {
    throw CheckpointError("[weights] " + slot + " <- '" + s.name + "' in " + f.path() + ": " + what);
  };
  if (!t) fail("no such tensor");
  const size_t esz = dtype_size(t->dtype);
  int64_t r = 0, cl = 0;
  uint64_t offset = 0;
  if (s.index < 0) {
    if (t->shape.size() != 2) fail("expected a 2-D tensor, got " + std::to_string(t->shape.size()) + "-D");
    r = t->shape[0];
    cl = t->shape[1];
  } else {
    if (t->shape.size() != 3) fail("expected a 3-D stacked tensor, got " + std::to_string(t->shape.size()) + "-D");
    if (s.index >= t->shape[0]) fail("index " + std::to_string(s.index) + " out of range");
    r = t->shape[1];
    cl = t->shape[2];
    offset = uint64_t(s.index) * uint64_t(r) * uint64_t(cl) * esz;
  }
  const int64_t end = s.row_end < 0 ? r : s.row_end;
  if (s.row_begin < 0 || s.row_begin > end || end > r) fail("row range out of bounds");
  offset += uint64_t(s.row_begin) * uint64_t(cl) * esz;
  *rows = end - s.row_begin;
  *cols = cl;
  *dtype = t->dtype;
  // Belt and braces: the header was validated, but recheck the slice against the tensor.
  if (offset + uint64_t(*rows) * uint64_t(cl) * esz > t->nbytes) fail("slice runs past the tensor");
  return f.data(*t) + offset;
}

WeightsBuilder::Expect WeightsBuilder::resolve_matrix(const std::string& slot) {
  Expect x = resolve(slot);
  if (!x.linear) throw Error("[weights] slot '" + slot + "' is not a matrix");
  return x;
}

// Both set_* calls end here, after every check passed: the slot is overwritten as a whole (a
// slot set twice keeps nothing of the first binding) and only then counts as filled.
Linear& WeightsBuilder::bind_linear(const std::string& slot, const Expect& x, Linear::Format format, DType dtype) {
  Linear& L = *x.linear;
  L = Linear{};
  L.format = format;
  L.out = x.out;
  L.in = x.in;
  L.dtype = dtype;
  filled_[slot] = true;
  return L;
}

void WeightsBuilder::set_dense(const std::string& slot, const TensorSlice& ws) {
  const Expect x = resolve_matrix(slot);
  int64_t rows, cols;
  DType dt;
  const uint8_t* p = slice_bytes(ws, &rows, &cols, &dt, slot);
  if (!is_float_dtype(dt))
    throw CheckpointError("[weights] " + slot + " <- '" + ws.name + "': dtype " + dtype_name(dt) +
                          " is not F32/F16/BF16 (a quantized tensor without scales?)");
  if (rows != x.out || cols != x.in)
    throw CheckpointError("[weights] " + slot + " <- '" + ws.name + "': shape [" + std::to_string(rows) + ", " +
                          std::to_string(cols) + "], expected [" + std::to_string(x.out) + ", " +
                          std::to_string(x.in) + "]");
  bind_linear(slot, x, Linear::Format::Dense, dt).w = p;
}

void WeightsBuilder::set_affine(const std::string& slot, const TensorSlice& ws, const TensorSlice& ss,
                                const TensorSlice& bs, int bits, int group) {
  const Expect x = resolve_matrix(slot);
  auto fail = [&](const std::string& what) -> void {
    throw CheckpointError("[weights] " + slot + " <- '" + ws.name + "': " + what);
  };
  int64_t wr, wc, sr, sc, br, bc;
  DType wdt, sdt, bdt;
  const uint8_t* wp = slice_bytes(ws, &wr, &wc, &wdt, slot);
  const uint8_t* sp = slice_bytes(ss, &sr, &sc, &sdt, slot + ".scales");
  const uint8_t* bp = slice_bytes(bs, &br, &bc, &bdt, slot + ".biases");
  if (bits == 0 && group == 0) {
    // No per-module entry in config.json: the shapes tell, as mlx-lm's infer_quant_config reads
    // them (group = in / scale columns, bits = packed columns * 32 / in).
    if (sc <= 0 || x.in % sc != 0 || (wc * 32) % x.in != 0)
      fail("cannot infer bits and group size: packed [" + std::to_string(wr) + ", " + std::to_string(wc) +
           "] and '" + ss.name + "' [" + std::to_string(sr) + ", " + std::to_string(sc) + "] do not divide a [" +
           std::to_string(x.out) + ", " + std::to_string(x.in) + "] matrix");
    group = int(x.in / sc);
    bits = int(wc * 32 / x.in);
    if (group != 32 && group != 64 && group != 128)
      fail("'" + ss.name + "' [" + std::to_string(sr) + ", " + std::to_string(sc) + "] gives group size " +
           std::to_string(group) + " for input dim " + std::to_string(x.in) + " (supported: 32, 64, 128)");
  }
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8)
    fail("unsupported bit width " + std::to_string(bits));
  if (group != 32 && group != 64 && group != 128) fail("unsupported group size " + std::to_string(group));
  if (wdt != DType::U32) fail(std::string("packed weights must be U32, got ") + dtype_name(wdt));
  if (!is_float_dtype(sdt) || sdt != bdt) fail("scales and biases must share one float dtype");
  if (x.in % group != 0) fail("input dim " + std::to_string(x.in) + " is not a multiple of group " + std::to_string(group));
  if (wr != x.out || wc * 32 != int64_t(x.in) * bits)
    fail("packed shape [" + std::to_string(wr) + ", " + std::to_string(wc) + "] does not hold a [" +
         std::to_string(x.out) + ", " + std::to_string(x.in) + "] matrix at " + std::to_string(bits) + " bits");
  auto check_side = [&](const TensorSlice& t, int64_t r, int64_t cl) {
    if (r != x.out || cl != x.in / group)
      throw CheckpointError("[weights] " + slot + " <- '" + t.name + "': shape [" + std::to_string(r) + ", " +
                            std::to_string(cl) + "], expected [" + std::to_string(x.out) + ", " +
                            std::to_string(x.in / group) + "] for " + std::to_string(bits) + "-bit group " +
                            std::to_string(group));
  };
  check_side(ss, sr, sc);
  check_side(bs, br, bc);
  Linear& L = bind_linear(slot, x, Linear::Format::Affine, sdt);
  L.bits = bits;
  L.group = group;
  L.w = wp;
  L.scales = sp;
  L.biases = bp;
}

void WeightsBuilder::set_microscaled(const std::string& slot, const TensorSlice& ws, const TensorSlice& ss,
                                     const std::string& mode, std::optional<float> global_scale) {
  const Expect x = resolve_matrix(slot);
  auto fail = [&](const std::string& what) -> void {
    throw CheckpointError("[weights] " + slot + " <- '" + ws.name + "': " + what);
  };
  int64_t wr, wc, sr, sc;
  DType wdt, sdt;
  const uint8_t* wp = slice_bytes(ws, &wr, &wc, &wdt, slot);
  const uint8_t* sp = slice_bytes(ss, &sr, &sc, &sdt, slot + ".scales");
  if (wdt != DType::U32) fail(std::string("packed weights must be U32, got ") + dtype_name(wdt));
  if (sdt != DType::U8) fail(std::string("'") + ss.name + "' must be U8 scales, got " + dtype_name(sdt));
  Microscale m = Microscale::Mxfp4;
  if (mode.empty()) {
    const int64_t group = sc > 0 && x.in % sc == 0 ? x.in / sc : 0;
    const int64_t bits = (wc * 32) % x.in == 0 ? wc * 32 / x.in : 0;
    if (bits == 4 && group == 16) m = Microscale::Nvfp4;
    else if (bits == 4 && group == 32) m = Microscale::Mxfp4;
    else if (bits == 8 && group == 32) m = Microscale::Mxfp8;
    else
      fail("cannot infer the quantization mode: " + std::to_string(bits) + " bits with group size " +
           std::to_string(group) + " (from '" + ss.name + "') is none of mxfp4 (4, 32), mxfp8 (8, 32), nvfp4 (4, 16)");
  } else if (!microscale_from_name(mode, &m)) {
    fail("unknown quantization mode '" + mode + "' (mxfp4, mxfp8, nvfp4 have no biases)");
  }
  const int bits = microscale_bits(m), group = microscale_group(m);
  if (x.in % group != 0) fail("input dim " + std::to_string(x.in) + " is not a multiple of group " + std::to_string(group));
  if (wr != x.out || wc * 32 != int64_t(x.in) * bits)
    fail("packed shape [" + std::to_string(wr) + ", " + std::to_string(wc) + "] does not hold a [" +
         std::to_string(x.out) + ", " + std::to_string(x.in) + "] matrix in " + microscale_name(m));
  if (sr != x.out || sc != x.in / group)
    throw CheckpointError("[weights] " + slot + " <- '" + ss.name + "': shape [" + std::to_string(sr) + ", " +
                          std::to_string(sc) + "], expected [" + std::to_string(x.out) + ", " +
                          std::to_string(x.in / group) + "] for " + microscale_name(m));
  if (global_scale && m != Microscale::Nvfp4)
    fail(std::string("a global scale is an nvfp4 feature (mlx.core.quantize takes one only there), but this matrix is ") +
         microscale_name(m));
  if (global_scale && !std::isfinite(*global_scale))
    fail("its global scale is " + std::to_string(*global_scale) + ", not a finite number");
  Linear& L = bind_linear(slot, x, Linear::Format::Microscaled, DType::U8);
  if (global_scale) L.scale_mult = nvfp4_scale_mult(*global_scale);
  L.microscale = m;
  L.bits = bits;
  L.group = group;
  L.w = wp;
  L.scales = sp;
}

void WeightsBuilder::set_vector(const std::string& slot, std::vector<float> values) {
  Expect x = resolve(slot);
  if (!x.vector) throw Error("[weights] slot '" + slot + "' is not a vector");
  if (int64_t(values.size()) != x.out)
    throw CheckpointError("[weights] " + slot + ": " + std::to_string(values.size()) + " values, expected " +
                          std::to_string(x.out));
  if (slot.size() >= 5 && slot.compare(slot.size() - 5, 5, "A_log") == 0)
    for (float& v : values) v = -std::exp(v);  // stored as A = -exp(A_log), as the kernel uses it
  // YaRN's attention factor multiplies cos and sin, i.e. the rotated dims of q and k; RoPE is linear
  // and the per-head norm gain comes right before it, so scaling the gain's rotated dims is the same
  // product (mlx-lm's YarnRoPE scales those dims of its input), with no change to any kernel.
  const bool qk_norm = slot.size() > 11 && (slot.compare(slot.size() - 11, 11, "attn.q_norm") == 0 ||
                                            slot.compare(slot.size() - 11, 11, "attn.k_norm") == 0);
  if (qk_norm && w_->config.rope_attention_factor != 1.0)
    for (int i = 0; i < w_->config.rotary_dim; ++i) values[size_t(i)] *= float(w_->config.rope_attention_factor);
  *x.vector = std::move(values);
  filled_[slot] = true;
}

std::shared_ptr<ModelWeights> WeightsBuilder::finish() {
  const ModelConfig& c = w_->config;
  auto check = [&](const std::vector<std::string>& need) {
    for (const std::string& s : need)
      if (!filled_.count(s)) throw CheckpointError("[weights] no tensor was given for '" + s + "'");
  };
  check({"embed", "lm_head", "final_norm"});
  // Layer by layer, stopping at the first gap: a config claiming 10^6 layers fails at the first
  // layer the checkpoint lacks, without listing a million slot names first.
  for (int l = 0; l < c.n_layers(); ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    std::vector<std::string> need;
    for (const char* s : {"input_norm", "post_norm"}) need.push_back(p + s);
    if (c.mixers[l] == Mixer::Attention) {
      for (const char* s : {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}) need.push_back(p + "attn." + s);
    } else {
      if (c.gdn_fused_qkvz) {
        for (const char* s : {"in_qkvz", "in_ba"}) need.push_back(p + "gdn." + s);
      } else {
        for (const char* s : {"in_qkv", "in_z", "in_b", "in_a"}) need.push_back(p + "gdn." + s);
      }
      for (const char* s : {"out_proj", "conv1d", "dt_bias", "A_log", "norm"}) need.push_back(p + "gdn." + s);
    }
    if (c.ffns[l] == Ffn::Dense) {
      for (const char* s : {"gate", "up", "down"}) need.push_back(p + "mlp." + s);
    } else {
      need.push_back(p + "moe.router");
      if (c.shared_intermediate > 0)
        for (const char* s : {"shared_gate", "shared.gate", "shared.up", "shared.down"}) need.push_back(p + "moe." + s);
      for (int e = 0; e < c.n_experts; ++e)
        for (const char* s : {"gate", "up", "down"})
          need.push_back(p + "moe.experts." + std::to_string(e) + "." + s);
    }
    check(need);
  }
  w_->layers.clear();
  w_->layers.reserve(c.n_layers());
  for (int l = 0; l < c.n_layers(); ++l) w_->layers.push_back(std::move(layers_.at(l)));
  layers_.clear();
  // Watch first, then stat once: a change before the watch existed is caught by this stat, any
  // later one queues an event.
  std::vector<std::string> paths;
  for (const auto& f : w_->files)
    if (f->residency() == Residency::Mapped) paths.push_back(f->path());
  if (!paths.empty()) w_->watch = std::make_shared<FileWatch>(paths);
  w_->check_files_unchanged();
  return w_;
}

}  // namespace lily
