// libFuzzer target: the safetensors header and tensor table (csrc/model/safetensors.cpp), the
// JSON reader under it (csrc/model/json.cpp), and the weight-slot binding that turns tensors
// into kernel views (csrc/model/weights.cpp).
//
// The input is a whole .safetensors file. It is written to a memfd and opened through
// /proc/self/fd/N, so the product's real open + fstat + mmap path runs unchanged (no test-only
// entry point in the product). Every tensor the parser accepts is then offered to the slots of
// a tiny fixed config (tensor names that are slot names go to that slot; others to a slot
// picked by hash), dense and affine, whole, per stacked index and per row range.
//
// ASan does not see reads of an mmap'd file, so out-of-bounds views are checked explicitly:
// every tensor and every filled slot must lie inside the data section of the file the
// parser mapped; a violation traps (a crash libFuzzer records). Clean rejections are
// lily::Error subclasses; anything else escaping (std::out_of_range, bad_alloc...) is a bug
// and aborts through the uncaught exception.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "model/error.h"
#include "model/safetensors.h"
#include "model/weights.h"

using namespace lily;

namespace {

#define FUZZ_CHECK(cond)                                                       \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::fprintf(stderr, "invariant failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      __builtin_trap();                                                        \
    }                                                                          \
  } while (0)

// Two layers (DeltaNet + MoE with a shared expert, attention + dense MLP), dims small enough
// that fuzzed shapes can match them and divisible by every affine group size (32).
ModelConfig tiny_config() {
  ModelConfig c;
  c.model_type = "fuzz";
  c.hidden = 64;
  c.vocab = 16;
  c.max_position = 64;
  c.mixers = {Mixer::GatedDeltaNet, Mixer::Attention};
  c.ffns = {Ffn::Moe, Ffn::Dense};
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 32;
  c.rotary_dim = 16;
  c.gdn_k_heads = 1;
  c.gdn_v_heads = 2;
  c.gdn_k_dim = 32;
  c.gdn_v_dim = 32;
  c.conv_kernel = 4;
  c.intermediate = 64;
  c.n_experts = 2;
  c.top_k = 1;
  c.moe_intermediate = 32;
  c.shared_intermediate = 32;
  return c;
}

const char* const kMatrixSlots[] = {
    "embed", "lm_head", "layers.0.gdn.in_qkv", "layers.0.gdn.in_z", "layers.0.gdn.in_b",
    "layers.0.gdn.in_a", "layers.0.gdn.out_proj", "layers.0.moe.router", "layers.0.moe.shared_gate",
    "layers.0.moe.shared.gate", "layers.0.moe.shared.up", "layers.0.moe.shared.down",
    "layers.0.moe.experts.0.gate", "layers.0.moe.experts.0.up", "layers.0.moe.experts.0.down",
    "layers.0.moe.experts.1.gate", "layers.0.moe.experts.1.up", "layers.0.moe.experts.1.down",
    "layers.1.attn.q_proj", "layers.1.attn.k_proj", "layers.1.attn.v_proj", "layers.1.attn.o_proj",
    "layers.1.mlp.gate", "layers.1.mlp.up", "layers.1.mlp.down",
    // Not slots of this config: must be refused cleanly.
    "layers.1.gdn.in_qkv", "layers.2.mlp.gate", "layers.0.moe.experts.2.gate", "layers.x.mlp.up",
    "final_norm", "", "layers..", "layers.0.moe.experts.00000000001.gate"};
constexpr size_t kNumSlots = sizeof(kMatrixSlots) / sizeof(kMatrixSlots[0]);

// The file's data section [base, base + size), as the parser mapped it.
struct Section {
  const uint8_t* base = nullptr;
  uint64_t size = 0;
  bool contains(const uint8_t* p, uint64_t n) const {
    return p >= base && uint64_t(p - base) <= size && n <= size - uint64_t(p - base);
  }
};

Section data_section(const SafetensorsFile& f, uint64_t header_len) {
  Section s;
  s.size = f.file_size() - 8 - header_len;
  if (!f.tensors().empty()) s.base = f.data(f.tensors()[0]) - f.tensors()[0].begin;
  return s;
}

void check_linear(const Linear& L, const Section& s) {
  if (!L.present()) return;
  FUZZ_CHECK(L.out > 0 && L.in > 0);
  FUZZ_CHECK(s.contains(L.w, uint64_t(L.row_bytes()) * L.out));
  if (L.quantized()) {
    const uint64_t side = uint64_t(L.out) * (L.in / L.group) * dtype_size(L.dtype);
    FUZZ_CHECK(s.contains(L.scales, side));
    FUZZ_CHECK(s.contains(L.biases, side));
  }
}

template <class F>
void refused_ok(F&& f) {
  try {
    f();
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static int fd = ::memfd_create("safetensors_fuzz", 0);
  FUZZ_CHECK(fd >= 0);
  FUZZ_CHECK(::ftruncate(fd, 0) == 0);
  FUZZ_CHECK(::pwrite(fd, data, size, 0) == ssize_t(size));
  const std::string path = "/proc/self/fd/" + std::to_string(fd);

  uint64_t header_len = 0;
  if (size >= 8)
    for (int i = 7; i >= 0; --i) header_len = header_len << 8 | data[i];

  try {
    SafetensorsFile f(path);
    // Accepted: the header must really describe this file.
    FUZZ_CHECK(f.file_size() == size);
    const Section sec = data_section(f, header_len);
    for (const TensorInfo& t : f.tensors()) {
      FUZZ_CHECK(f.find(t.name) != nullptr);
      FUZZ_CHECK(sec.contains(f.data(t), t.nbytes));
      uint64_t n = dtype_size(t.dtype);
      for (int64_t d : t.shape) n *= uint64_t(d);
      FUZZ_CHECK(n == t.nbytes);
      // The bytes the header promises must be the input's bytes.
      if (t.nbytes) FUZZ_CHECK(std::memcmp(f.data(t), data + 8 + header_len + t.begin, t.nbytes) == 0);
    }
    // No two non-empty tensors share a byte (the parser promises to refuse aliasing headers).
    const auto& ts = f.tensors();
    for (size_t i = 0; i < ts.size(); ++i)
      for (size_t j = i + 1; j < ts.size() && j < 256; ++j)
        if (ts[i].nbytes && ts[j].nbytes)
          FUZZ_CHECK(ts[i].begin + ts[i].nbytes <= ts[j].begin || ts[j].begin + ts[j].nbytes <= ts[i].begin);
    refused_ok([&] { f.check_unchanged(); });

    WeightsBuilder b(tiny_config());
    const int id = b.add_file(path);
    const SafetensorsFile& bf = b.file(id);
    const Section bsec = data_section(bf, header_len);
    std::hash<std::string> hash;
    for (const TensorInfo& t : bf.tensors()) {
      std::string slot = t.name;
      bool named = false;
      for (const char* s : kMatrixSlots) named |= slot == s;
      if (!named) slot = kMatrixSlots[hash(t.name) % kNumSlots];
      // One whole-tensor binding and one hashed variant (stacked index, row range, bit width,
      // group) per tensor: trying every combination would make each input cost thousands of
      // throws and starve the mutator.
      const size_t h = hash(t.name) ^ size;
      const int64_t rows = t.shape.size() >= 2 ? t.shape[t.shape.size() - 2] : 0;
      const int half = int(std::min<int64_t>(rows / 2, 1 << 20));
      const std::pair<int, int> ranges[] = {{0, -1}, {0, half}, {half, -1}, {half + 1, half}, {-1, 2}};
      const int idx = t.shape.size() == 3 ? int(h % 3) : -1;
      const std::pair<int, int> rng = ranges[(h >> 8) % 5];
      const int bits_choice[] = {4, 8, 2, 3, 5, 6, 7};
      const int group_choice[] = {32, 64, 128, 0};
      const TensorInfo* sc = bf.find(t.name + ".scales");
      const TensorInfo* bi = bf.find(t.name + ".biases");
      for (int variant = 0; variant < 2; ++variant) {
        const int rb = variant ? rng.first : 0, re = variant ? rng.second : -1;
        const TensorSlice w{id, t.name, variant ? idx : (t.shape.size() == 3 ? 0 : -1), rb, re};
        refused_ok([&] { b.set_dense(slot, w); });
        if (sc && bi) {
          const int bits = bits_choice[variant ? (h >> 16) % 7 : 0];
          const int group = group_choice[variant ? (h >> 24) % 4 : 0];
          refused_ok([&] {
            b.set_affine(slot, w, TensorSlice{id, sc->name, w.index, rb, re},
                         TensorSlice{id, bi->name, w.index, rb, re}, bits, group);
          });
          // The natural width for this slot's shape, when the packing says which.
          for (int nb : {4, 8})
            refused_ok([&] {
              b.set_affine(slot, w, TensorSlice{id, sc->name, w.index, rb, re},
                           TensorSlice{id, bi->name, w.index, rb, re}, nb, 32);
            });
        }
      }
    }
    refused_ok([&] { b.set_dense("embed", TensorSlice{id + 1, "x", -1, 0, -1}); });
    // Vector slots are filled from Python in the product; fill them here so finish() can pass
    // and the bound views get checked.
    const ModelConfig c = tiny_config();
    const std::pair<const char*, int> vectors[] = {
        {"final_norm", c.hidden}, {"layers.0.input_norm", c.hidden}, {"layers.0.post_norm", c.hidden},
        {"layers.1.input_norm", c.hidden}, {"layers.1.post_norm", c.hidden},
        {"layers.0.gdn.conv1d", c.gdn_qkv_dim() * c.conv_kernel}, {"layers.0.gdn.dt_bias", c.gdn_v_heads},
        {"layers.0.gdn.A_log", c.gdn_v_heads}, {"layers.0.gdn.norm", c.gdn_v_dim},
        {"layers.1.attn.q_norm", c.head_dim}, {"layers.1.attn.k_norm", c.head_dim}};
    for (const auto& [slot, n] : vectors) b.set_vector(slot, std::vector<float>(size_t(n), 0.0f));
    std::shared_ptr<ModelWeights> w;
    refused_ok([&] { w = b.finish(); });
    if (std::getenv("FUZZ_VERBOSE"))
      std::fprintf(stderr, "%zu tensors, finish() %s\n", bf.tensors().size(), w ? "passed" : "refused");
    if (w) {
      check_linear(w->embed, bsec);
      check_linear(w->lm_head, bsec);
      for (const LayerWeights& L : w->layers) {
        for (const Linear* x : {&L.attn.q_proj, &L.attn.k_proj, &L.attn.v_proj, &L.attn.o_proj,
                                &L.gdn.in_qkv, &L.gdn.in_z, &L.gdn.in_b, &L.gdn.in_a, &L.gdn.out_proj,
                                &L.mlp.gate, &L.mlp.up, &L.mlp.down, &L.moe.router, &L.moe.shared_gate,
                                &L.moe.shared.gate, &L.moe.shared.up, &L.moe.shared.down})
          check_linear(*x, bsec);
        for (const MlpWeights& e : L.moe.experts)
          for (const Linear* x : {&e.gate, &e.up, &e.down}) check_linear(*x, bsec);
      }
    }
  } catch (const Error&) {
    // A clean rejection: what the product promises for bad files.
  }
  return 0;
}
