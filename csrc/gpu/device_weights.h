// The checkpoint as the GPU sees it: each mapped (or resident) weights file wrapped once as a
// zero-copy device buffer, so a Linear is (file buffer, byte offset) and nothing is copied
// (unless the file's tensors are misaligned: see weight_alignment);
// the small per-channel vectors (norm gains, conv taps, ...) copied once into device buffers;
// the MoE blocks' per-expert offset tables. The wrapped files are asked to stay resident
// (Device::make_resident: a Metal residency set where the OS has one).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

#include "gpu/encode.h"
#include "model/weights.h"

namespace lily::gpu {

// quant_matrix on every matrix of the model: a format the kernels do not read fails at load, naming
// the tensor, not at its first dispatch.
void check_matrices(const ModelWeights& weights);

// W's shape and format as the kernels read it (dense, MLX affine 2/4/8-bit, mxfp4 / mxfp8 /
// nvfp4); throws ConfigError naming `what` for a bit width or group size the kernels do not take.
QuantMatrix quant_matrix(const Linear& W, const char* what);

// The alignment every weight tensor's address must have for the kernels (a bound device buffer's
// offset, msl_cpu/encoder.cpp checks it): 4, as the quant kernels read `uchar` weight buffers as
// 32-bit words, or the tensor's element size if larger.
size_t weight_alignment(DType t);

class DeviceWeights {
 public:
  // A memory region holding weights (a mapped file); each is wrapped as one buffer.
  struct Region {
    const uint8_t* base = nullptr;
    size_t size = 0;
  };
  // regions: where the weight pointers live; empty = the weights' files (page-rounded).
  // vector_loads: mark matrices whose rows are 16-byte aligned for the GEMVs' 16-byte loads
  // (QuantMatrix::vec; GpuOptions::gemv_vector_loads).
  DeviceWeights(Device& device, const ModelWeights& weights, std::vector<Region> regions,
                std::shared_ptr<Buffer> dummy, bool vector_loads = true);

  // The buffer and offset holding p; throws naming `what` if no region holds it.
  BufferRange find(const uint8_t* p, const char* what) const;
  // W's buffers; a microscaled W's third one (biases for affine) holds its scale_mult
  // (metal/quant_args.h), copied to the device. Resolved on W's first use (the region search,
  // the 16-byte rule) and kept by W's address: every later projection is one lookup.
  const LinearBuffers& linear(const Linear& W, const char* what);
  // A device copy of a per-channel vector (made once, kept by its address).
  std::shared_ptr<Buffer> vector(const std::vector<float>& v);
  // The expert tables of a MoE block, or of a dense MLP as one expert (built once), down.lanes
  // chosen for the block's k (the config's top_k; 1 for a dense MLP) and shared expert.
  const ExpertTables& tables(const MoeWeights* moe, const MlpWeights* mlp);
  // Bytes of the wrapped regions: what the GPU must hold of the checkpoint.
  uint64_t bytes() const { return bytes_; }
  // Bytes copied at load instead of wrapped: files whose tensors are not all aligned
  // (weight_alignment: mlx's writer does not pad the safetensors header, so the data section, and
  // with it every tensor, may start at any byte) have their data section copied into a device
  // buffer of their own (one memcpy of the data section; tensors still misaligned in it, e.g.
  // after an odd-sized U8 tensor, one buffer each). 0 where every file is zero-copy.
  uint64_t copied_bytes() const { return copied_bytes_; }

 private:
  ExpertMatrix expert_matrix(const std::vector<const Linear*>& list, const char* what);
  std::shared_ptr<Buffer> new_floats(const std::vector<float>& v);

  Device& device_;
  std::shared_ptr<Buffer> dummy_;
  bool vector_loads_ = true;
  int top_k_ = 1;  // jobs per token of the MoE blocks (moe_down_lanes)
  std::vector<std::pair<Region, std::shared_ptr<Buffer>>> regions_;
  uint64_t bytes_ = 0, copied_bytes_ = 0;
  std::map<const float*, std::shared_ptr<Buffer>> vectors_;
  std::unordered_map<const Linear*, LinearBuffers> linears_;  // linear()'s, by matrix
  std::map<const void*, std::unique_ptr<ExpertTables>> tables_;
};

}  // namespace lily::gpu
