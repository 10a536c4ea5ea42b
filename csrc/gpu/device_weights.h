// The checkpoint as the GPU sees it: each mapped (or resident) weights file wrapped once as a
// zero-copy device buffer, so a Linear is (file buffer, byte offset) and nothing is copied;
// the small per-channel vectors (norm gains, conv taps, ...) copied once into device buffers;
// the MoE blocks' per-expert offset tables. The wrapped files are asked to stay resident
// (Device::make_resident: a Metal residency set where the OS has one).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
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

class DeviceWeights {
 public:
  // A memory region holding weights (a mapped file); each is wrapped as one buffer.
  struct Region {
    const uint8_t* base = nullptr;
    size_t size = 0;
  };
  // regions: where the weight pointers live; empty = the weights' files (page-rounded).
  DeviceWeights(Device& device, const ModelWeights& weights, std::vector<Region> regions,
                std::shared_ptr<Buffer> dummy);

  // The buffer and offset holding p; throws naming `what` if no region holds it.
  BufferRange find(const uint8_t* p, const char* what) const;
  // W's buffers; a microscaled W's third one (biases for affine) holds its scale_mult
  // (metal/quant_args.h), copied to the device on first use.
  LinearBuffers linear(const Linear& W, const char* what);
  // A device copy of a per-channel vector (made once, kept by its address).
  std::shared_ptr<Buffer> vector(const std::vector<float>& v);
  // The expert tables of a MoE block, or of a dense MLP as one expert (built once).
  const ExpertTables& tables(const MoeWeights* moe, const MlpWeights* mlp);
  // Bytes of the wrapped regions: what the GPU must hold of the checkpoint.
  uint64_t bytes() const { return bytes_; }

 private:
  ExpertMatrix expert_matrix(const std::vector<const Linear*>& list, const char* what);
  std::shared_ptr<Buffer> new_floats(const std::vector<float>& v);

  Device& device_;
  std::shared_ptr<Buffer> dummy_;
  std::vector<std::pair<Region, std::shared_ptr<Buffer>>> regions_;
  uint64_t bytes_ = 0;
  std::map<const float*, std::shared_ptr<Buffer>> vectors_;
  std::map<const Linear*, std::shared_ptr<Buffer>> scale_mults_;  // linear()'s, by matrix
  std::map<const void*, std::unique_ptr<ExpertTables>> tables_;
};

}  // namespace lily::gpu
