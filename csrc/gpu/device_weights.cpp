// DeviceWeights: see device_weights.h.
#include "gpu/device_weights.h"

#include <unistd.h>

#include <algorithm>
#include <string>

#include "model/error.h"

namespace lily::gpu {

namespace {
// Whether W has a scales tensor (affine and microscaled); biases only affine ones have.
bool has_scales(const Linear& W) { return W.quantized() || W.microscaled(); }
}  // namespace

QuantMatrix quant_matrix(const Linear& W, const char* what) {
  if (!W.present()) throw ConfigError(std::string("[gpu] ") + what + " is missing");
  const bool packed = has_scales(W);  // microscaled: (bits, group) name the mode
  const uint32_t bits = packed ? uint32_t(W.bits) : 0;
  if (bits != 0 && bits != 2 && bits != 4 && bits != 8)
    throw ConfigError(std::string("[gpu] ") + what + " is " + std::to_string(bits) +
                      "-bit; the GPU kernels read 2, 4 and 8-bit affine weights and dense ones");
  QuantMatrix m{};
  m.in = uint32_t(W.in);
  m.out = uint32_t(W.out);
  m.bits = bits;
  m.group = packed ? uint32_t(W.group) : 0;
  if (bits && (m.group % (32 / bits) != 0 || W.in % W.group != 0))
    throw ConfigError(std::string("[gpu] ") + what + ": group size " + std::to_string(W.group) +
                      " does not suit the kernels");
  return m;
}

void check_matrices(const ModelWeights& w) {
  auto check = [](const Linear& L, const std::string& what) {
    if (L.present()) quant_matrix(L, what.c_str());
  };
  check(w.embed, "embed_tokens");
  check(w.lm_head, "lm_head");
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    const std::string p = "layers." + std::to_string(l) + ".";
    for (const auto& [m, name] : {std::pair{&L.attn.q_proj, "q_proj"}, {&L.attn.k_proj, "k_proj"},
                                  {&L.attn.v_proj, "v_proj"}, {&L.attn.o_proj, "o_proj"}, {&L.gdn.in_qkv, "in_proj_qkv"},
                                  {&L.gdn.in_z, "in_proj_z"}, {&L.gdn.in_b, "in_proj_b"}, {&L.gdn.in_a, "in_proj_a"},
                                  {&L.gdn.in_qkvz, "in_proj_qkvz"}, {&L.gdn.in_ba, "in_proj_ba"},
                                  {&L.gdn.out_proj, "out_proj"}, {&L.mlp.gate, "mlp.gate_proj"},
                                  {&L.mlp.up, "mlp.up_proj"}, {&L.mlp.down, "mlp.down_proj"},
                                  {&L.moe.router, "mlp.gate"}, {&L.moe.shared_gate, "shared_expert_gate"},
                                  {&L.moe.shared.gate, "shared_expert.gate_proj"},
                                  {&L.moe.shared.up, "shared_expert.up_proj"},
                                  {&L.moe.shared.down, "shared_expert.down_proj"}})
      check(*m, p + name);
    for (size_t e = 0; e < L.moe.experts.size(); ++e)
      for (const auto& [m, name] : {std::pair{&L.moe.experts[e].gate, "gate_proj"}, {&L.moe.experts[e].up, "up_proj"},
                                    {&L.moe.experts[e].down, "down_proj"}})
        check(*m, p + "experts." + std::to_string(e) + "." + name);
  }
}

DeviceWeights::DeviceWeights(Device& device, const ModelWeights& weights, std::vector<Region> regions,
                             std::shared_ptr<Buffer> dummy, bool vector_loads)
    : device_(device),
      dummy_(std::move(dummy)),
      vector_loads_(vector_loads),
      top_k_(std::max(weights.config.top_k, 1)) {
  // A file's mapping covers whole pages, so the wrapped length is rounded up to the page size
  // (Metal's newBufferWithBytesNoCopy wants a page-aligned pointer and length).
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  std::vector<std::shared_ptr<Buffer>> buffers;
  // A copy of [p, p + n) in a new device buffer (at its offset 0: device buffers start aligned).
  auto copy = [&](const uint8_t* p, size_t n) {
    auto buf = device_.new_buffer(std::max<size_t>(n, 1));
    buf->write(0, p, n);
    buffers.push_back(buf);
    copied_bytes_ += n;
    bytes_ += n;
    return buf;
  };
  if (regions.empty()) {
    for (const auto& f : weights.files) {
      const auto* base = static_cast<const uint8_t*>(f->mapping());
      const uint64_t data = f->data_offset();
      bool aligned = true;
      for (const TensorInfo& t : f->tensors())
        if ((data + t.begin) % weight_alignment(t.dtype) != 0) aligned = false;
      if (aligned) {  // the mapping is page-aligned: zero-copy
        regions.push_back({base, (size_t(f->file_size()) + page - 1) / page * page});
        continue;
      }
      // Misaligned (an unpadded header): the data section copied to an aligned buffer, where a
      // tensor's offset is its data_offsets begin (a multiple of its element size in files that
      // mlx and safetensors write); any tensor still misaligned there gets a buffer of its own,
      // found first (regions_ is searched in order).
      for (const TensorInfo& t : f->tensors())
        if (t.begin % weight_alignment(t.dtype) != 0)
          regions_.push_back({Region{f->data(t), size_t(t.nbytes)}, copy(f->data(t), size_t(t.nbytes))});
      const Region r{base + data, size_t(f->data_size())};
      regions_.push_back({r, copy(r.base, r.size)});
    }
  }
  for (const Region& r : regions) {
    regions_.push_back({r, device_.wrap_buffer(const_cast<uint8_t*>(r.base), r.size)});
    buffers.push_back(regions_.back().second);
    bytes_ += r.size;
  }
  device_.make_resident(buffers);
}

size_t weight_alignment(DType t) { return std::max<size_t>(4, dtype_size(t)); }

BufferRange DeviceWeights::find(const uint8_t* p, const char* what) const {
  for (const auto& [r, buf] : regions_)
    if (p >= r.base && p < r.base + r.size) return BufferRange{buf, size_t(p - r.base)};
  throw Error(std::string("[gpu] ") + what + " does not lie in a mapped weights file");
}

const LinearBuffers& DeviceWeights::linear(const Linear& W, const char* what) {
  if (auto it = linears_.find(&W); it != linears_.end()) return it->second;
  LinearBuffers L;
  L.m = quant_matrix(W, what);
  L.w = find(W.w, what);
  L.scales = has_scales(W) ? find(W.scales, what) : BufferRange{dummy_, 0};
  if (W.quantized()) L.biases = find(W.biases, what);
  else if (W.microscaled()) L.biases = {new_floats({W.scale_mult}), 0};
  else L.biases = {dummy_, 0};
  L.m.vec = vector_loads_ && vector_rows(L.m, {device_address(L.w)}) ? 1u : 0u;
  L.dtype = W.dtype;
  L.nbytes = W.nbytes();
  return linears_.emplace(&W, std::move(L)).first->second;  // (node-based: the reference stays valid)
}

std::shared_ptr<Buffer> DeviceWeights::vector(const std::vector<float>& v) {
  auto& b = vectors_[v.data()];
  if (!b) b = new_floats(v);
  return b;
}

std::shared_ptr<Buffer> DeviceWeights::new_floats(const std::vector<float>& v) {
  auto b = device_.new_buffer(std::max<size_t>(v.size(), 1) * 4);
  b->write(0, v.data(), v.size() * 4);
  return b;
}

// The buffers of expert 0's matrix and a table of every expert's offsets into them (all must
// live in the same files: one binding per part). Microscaled experts have no biases: their third
// part is a buffer of each expert's scale_mult, expert e's at 4 * e.
ExpertMatrix DeviceWeights::expert_matrix(const std::vector<const Linear*>& list, const char* what) {
  ExpertMatrix mt;
  const Linear& L0 = *list[0];
  mt.m = quant_matrix(L0, what);
  mt.dtype = L0.dtype;
  mt.nbytes = L0.nbytes();
  mt.experts = int(list.size());
  BufferRange w0 = find(L0.w, what);
  BufferRange s0 = has_scales(L0) ? find(L0.scales, what) : w0;
  std::vector<float> mults;
  for (const Linear* L : list) mults.push_back(L->scale_mult);
  BufferRange b0 = L0.quantized() ? find(L0.biases, what) : L0.microscaled() ? BufferRange{new_floats(mults), 0} : w0;
  mt.w = {w0.buf, 0};
  mt.s = {s0.buf, 0};
  mt.b = {b0.buf, 0};
  std::vector<uint64_t> t(list.size() * 3);  // per expert: weight, scales, biases offsets
  std::vector<uint64_t> starts;              // device addresses of the experts' weights
  for (size_t e = 0; e < list.size(); ++e) {
    const Linear& L = *list[e];
    if (L.format != L0.format || L.microscale != L0.microscale || L.bits != L0.bits || L.group != L0.group ||
        L.dtype != L0.dtype || L.in != L0.in || L.out != L0.out)
      throw ConfigError(std::string("[gpu] ") + what + ": experts differ in format or shape");
    BufferRange rw = find(L.w, what), rs = has_scales(L) ? find(L.scales, what) : rw,
                rb = L.quantized() ? find(L.biases, what) : L.microscaled() ? BufferRange{b0.buf, 4 * e} : rw;
    if (rw.buf != w0.buf || rs.buf != s0.buf || rb.buf != b0.buf)
      throw ConfigError(std::string("[gpu] ") + what + ": experts of one layer span several files");
    t[3 * e + 0] = rw.off;
    starts.push_back(device_address(rw));
    t[3 * e + 1] = rs.off;
    t[3 * e + 2] = rb.off;
  }
  mt.m.vec = vector_loads_ && vector_rows(mt.m, starts) ? 1u : 0u;
  mt.table = device_.new_buffer(t.size() * 8);
  mt.table->write(0, t.data(), t.size() * 8);
  return mt;
}

const ExpertTables& DeviceWeights::tables(const MoeWeights* moe, const MlpWeights* mlp) {
  const void* key = moe ? static_cast<const void*>(moe) : static_cast<const void*>(mlp);
  auto& slot = tables_[key];
  if (slot) return *slot;
  auto tb = std::make_unique<ExpertTables>();
  auto one = [](const Linear& L) { return std::vector<const Linear*>{&L}; };
  if (moe) {
    std::vector<const Linear*> g, u, d;
    for (const auto& e : moe->experts) {
      g.push_back(&e.gate);
      u.push_back(&e.up);
      d.push_back(&e.down);
    }
    tb->gate = expert_matrix(g, "experts' gate_proj");
    tb->up = expert_matrix(u, "experts' up_proj");
    tb->down = expert_matrix(d, "experts' down_proj");
    if (moe->shared.gate.present()) {
      tb->shared_gate = expert_matrix(one(moe->shared.gate), "shared expert gate_proj");
      tb->shared_up = expert_matrix(one(moe->shared.up), "shared expert up_proj");
      tb->shared_down = expert_matrix(one(moe->shared.down), "shared expert down_proj");
      if (tb->shared_down.dtype != tb->down.dtype)
        throw ConfigError("[gpu] the shared expert's down_proj and the experts' differ in scale dtype");
    }
  } else {
    tb->gate = expert_matrix(one(mlp->gate), "mlp gate_proj");
    tb->up = expert_matrix(one(mlp->up), "mlp up_proj");
    tb->down = expert_matrix(one(mlp->down), "mlp down_proj");
  }
  if (tb->gate.dtype != tb->up.dtype) throw ConfigError("[gpu] gate_proj and up_proj differ in scale dtype");
  const bool shared = moe && moe->shared.gate.present();
  tb->down.lanes = moe_down_lanes(tb->down.m, shared ? &tb->shared_down.m : nullptr, moe ? top_k_ : 1);
  slot = std::move(tb);
  return *slot;
}

}  // namespace lily::gpu
