// The model's weights as the kernels see them: views into the mapped checkpoint files, never
// copies of the large matrices. Small per-channel vectors (norm gains, conv taps, dt_bias, A)
// are owned float arrays: they are read on every token and converting them once at load (also
// folding the zero-centred norms' 1 + w) keeps that conversion out of the hot loops.
//
// Loading is split in two on purpose. lily/checkpoint.py knows the three families' tensor
// names and layouts (HF fused or per-expert experts, MLX switch_mlp, Qwen3-Next grouped
// projections) and fills named slots through WeightsBuilder; this file owns memory safety: every
// slot's dimensions are re-checked against the config and the bytes available, so no Python
// mistake can make a kernel read outside a tensor.
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/dtype.h"
#include "model/file_watch.h"
#include "model/safetensors.h"

namespace lily {

// MLX's floating-point quantization modes (mlx.core.quantize mode=...): each element a small
// float code, each group one power-of-two (e8m0) or e4m3 scale, no bias.
//   mxfp4: e2m1 codes (4 bits), groups of 32, e8m0 scales;  mxfp8: e4m3 codes (8 bits), groups of
//   32, e8m0 scales;  nvfp4: e2m1 codes, groups of 16, e4m3 scales.
enum class Microscale : uint8_t { Mxfp4, Mxfp8, Nvfp4 };
const char* microscale_name(Microscale m);
// "mxfp4" / "mxfp8" / "nvfp4"; false for any other name.
bool microscale_from_name(const std::string& s, Microscale* out);
inline int microscale_bits(Microscale m) { return m == Microscale::Mxfp8 ? 8 : 4; }
inline int microscale_group(Microscale m) { return m == Microscale::Nvfp4 ? 16 : 32; }
// Linear::scale_mult of an nvfp4 matrix with this global scale: global_scale / (448 * 6) (the e4m3
// and e2m1 maxima) in float32, as mlx.core.dequantize computes it.
inline float nvfp4_scale_mult(float global_scale) { return global_scale / (448.0f * 6.0f); }

// y[t, o] = sum_i x[t, i] * W[o, i]: a weight matrix W [out, in], row-major.
struct Linear {
  enum class Format : uint8_t { None, Dense, Affine, Microscaled };
  Format format = Format::None;
  int out = 0;
  int in = 0;
  // Dense: dtype of w (F32/F16/BF16). Affine: dtype of scales and biases. Microscaled: U8.
  DType dtype = DType::F32;
  int bits = 0;   // Affine: 2, 3, 4, 5, 6 or 8. Microscaled: 4 or 8 (microscale_bits)
  int group = 0;  // Affine: elements per scale/bias. Microscaled: microscale_group
  Microscale microscale = Microscale::Mxfp4;  // Microscaled only
  const uint8_t* w = nullptr;       // Dense: [out, in] elements. Affine, Microscaled: [out, in*bits/32] uint32
  const uint8_t* scales = nullptr;  // Affine: [out, in/group] (dtype). Microscaled: [out, in/group] bytes
  const uint8_t* biases = nullptr;  // Affine: [out, in/group]
  // Microscaled: every group's scale is multiplied by this before the codes are. An nvfp4 matrix
  // quantized with a global (per-tensor; per-expert in mlx-lm's switch layers) scale stores its
  // group scales relative to it (nvfp4_scale_mult). 1 (exact, a no-op) for every other matrix.
  float scale_mult = 1.0f;
  // Affine 4-bit, CPU int8 mode on AVX-512 VNNI builds: rows stored 16 at a time, a 32-bit lane
  // of each 64-byte vector holding 4 packed bytes of one row, each block of 16 rows one run of
  // bytes in the order the kernel reads them (a group's scales [16] before its codes, the
  // biases [group][16] last); w, scales and biases all point at block 0's first byte, and every
  // block is the same stride on (cpu/linear_int8.cpp: InterleavedLayout, interleave_rows). Set
  // only by cpu::arrange_for_int8 (and the kernel tests and benchmarks).
  bool interleaved = false;

  bool present() const { return format != Format::None; }
  // Affine-quantized (codes, scales and biases): what the fused, int8 and GPU kernels read.
  bool quantized() const { return format == Format::Affine; }
  bool microscaled() const { return format == Format::Microscaled; }
  size_t row_bytes() const;  // bytes of w per row
  // Bytes the kernels read for one full pass over the matrix.
  size_t nbytes() const;
};

struct AttentionWeights {
  Linear q_proj;  // [n_heads * head_dim * 2, hidden]: per head [query | gate]
  Linear k_proj, v_proj;
  Linear o_proj;
  std::vector<float> q_norm, k_norm;  // [head_dim], full gain (1 + w)
};

struct GdnWeights {
  Linear in_qkv;  // [2*Hk*Dk + Hv*Dv, hidden]   (or in_qkvz when fused)
  Linear in_z;    // [Hv*Dv, hidden]
  Linear in_b, in_a;  // [Hv, hidden]           (or in_ba when fused)
  Linear in_qkvz, in_ba;  // Qwen3-Next: grouped per key head, see cpu/gdn.cpp
  Linear out_proj;        // [hidden, Hv*Dv]
  std::vector<float> conv1d;  // [qkv_dim, kernel]
  std::vector<float> dt_bias; // [Hv]
  std::vector<float> a_neg;   // [Hv] = -exp(A_log)
  std::vector<float> norm;    // [Dv] plain gain of the gated RMSNorm
};

struct MlpWeights {
  Linear gate, up, down;
};

struct MoeWeights {
  Linear router;                    // [E, hidden]
  std::vector<MlpWeights> experts;  // E
  MlpWeights shared;                // absent when shared_intermediate == 0
  Linear shared_gate;               // [1, hidden]
};

struct LayerWeights {
  std::vector<float> input_norm, post_norm;  // [hidden], full gain
  AttentionWeights attn;
  GdnWeights gdn;
  MlpWeights mlp;
  MoeWeights moe;
};

struct ModelWeights {
  ModelConfig config;
  Linear embed;    // [vocab, hidden], rows gathered
  Linear lm_head;  // [vocab, hidden]
  std::vector<float> final_norm;
  std::vector<LayerWeights> layers;
  std::vector<std::shared_ptr<SafetensorsFile>> files;  // keep the mappings alive
  std::shared_ptr<FileWatch> watch;                     // over the mapped `files` (none: no file is mapped)
  // Some matrices are in the CPU int8 kernels' interleaved layout (cpu::arrange_for_int8), in
  // this memory (their bytes in `files` are gone): only an int8 CPU backend can read them.
  std::shared_ptr<const HugePages> arranged;
  bool arranged_for_cpu_int8() const { return arranged != nullptr; }

  // Throws CheckpointError if any mapped file changed on disk since load: one stat per file.
  void check_files_unchanged() const;
  // The same guarantee for the per-token path: stats only when the watch queued an event since
  // the last call (or cannot watch), so an unchanged checkpoint costs one empty read().
  void check_files_unchanged_if_touched() const;
  // Times check_files_unchanged stat'ed the files (tests pin that decode steps do not).
  uint64_t stat_checks() const { return stat_checks_.load(std::memory_order_relaxed); }

 private:
  mutable std::atomic<uint64_t> stat_checks_{0};
  // Set once a check found a change: the watch's events are drained by then, but the files stay
  // changed, so every later check must stat (and fail) again.
  mutable std::atomic<bool> stale_{false};
};

// Where a slot's bytes come from: tensor `name` in file `file`, optionally one entry of a
// stacked leading dimension (`index`, e.g. an expert) and a row range (e.g. the gate half of
// a fused gate_up_proj).
struct TensorSlice {
  int file = -1;
  std::string name;
  int index = -1;      // -1: the tensor is 2-D [rows, cols]; else pick [index] of a 3-D tensor
  int row_begin = 0;
  int row_end = -1;    // -1: all rows
};

class WeightsBuilder {
 public:
  explicit WeightsBuilder(ModelConfig config);

  int add_file(const std::string& path, Residency residency = Residency::Mapped);
  const SafetensorsFile& file(int id) const;

  // Slots: "embed", "lm_head", "final_norm", "layers.{i}.{input_norm,post_norm}",
  // "layers.{i}.attn.{q_proj,k_proj,v_proj,o_proj,q_norm,k_norm}",
  // "layers.{i}.gdn.{in_qkv,in_z,in_b,in_a,in_qkvz,in_ba,out_proj,conv1d,dt_bias,A_log,norm}",
  // "layers.{i}.mlp.{gate,up,down}", "layers.{i}.moe.{router,shared_gate}",
  // "layers.{i}.moe.shared.{gate,up,down}", "layers.{i}.moe.experts.{e}.{gate,up,down}".
  void set_dense(const std::string& slot, const TensorSlice& w);
  // bits = group = 0: inferred from the packed and scale shapes (a module config.json does not list).
  void set_affine(const std::string& slot, const TensorSlice& w, const TensorSlice& scales,
                  const TensorSlice& biases, int bits, int group);
  // An MLX mxfp4 / mxfp8 / nvfp4 matrix (no biases); mode "" = inferred from the shapes, as
  // mlx-lm's infer_quant_config does (each mode allows one bits / group pair). global_scale: the
  // matrix's nvfp4 global scale (mx.quantize(..., global_scale=)); only nvfp4 has one.
  void set_microscaled(const std::string& slot, const TensorSlice& w, const TensorSlice& scales,
                       const std::string& mode, std::optional<float> global_scale = std::nullopt);
  void set_vector(const std::string& slot, std::vector<float> values);

  // Checks that every slot the config needs is filled; hands the weights over.
  std::shared_ptr<ModelWeights> finish();

 private:
  struct Expect {
    Linear* linear = nullptr;
    std::vector<float>* vector = nullptr;
    int out = 0, in = 0;  // matrix dims, or vector length in `out`
  };
  Expect resolve(const std::string& slot);
  LayerWeights& layer(int l);  // layer l's weights, made on first use
  Expect resolve_matrix(const std::string& slot);  // resolve, and refuse a vector slot
  Linear& bind_linear(const std::string& slot, const Expect& x, Linear::Format format, DType dtype);
  const uint8_t* slice_bytes(const TensorSlice& s, int64_t* rows, int64_t* cols, DType* dtype,
                             const std::string& slot) const;

  std::shared_ptr<ModelWeights> w_;
  std::map<int, LayerWeights> layers_;  // the layers bound so far (finish() moves them into w_)
  std::map<std::string, bool> filled_;
};

}  // namespace lily
