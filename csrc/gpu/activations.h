// The GPU backend's activations: every buffer a pass reads and writes besides weights and the
// sequence state, in one place, with its shape. f32 unless said otherwise. T = tokens of the
// pass; H hidden; Hq, Hkv, D attention heads and head dim; C = 2*Hk*Dk + Hv*Dv DeltaNet conv
// channels, Hv value heads of Dv; E experts, k per token, I = max(expert, dense) intermediate,
// Is shared expert intermediate; V vocab.
#pragma once
#include <cstddef>
#include <memory>

#include "gpu/device.h"
#include "gpu/encoder.h"
#include "model/config.h"

namespace lily::gpu {

struct Activations {
  std::shared_ptr<Buffer> tokens;    // [T] int32: the pass's tokens (from the host)
  std::shared_ptr<Buffer> x;         // [T, H] residual stream
  std::shared_ptr<Buffer> h;         // [T, H] normed stream, the blocks' input
  std::shared_ptr<Buffer> y;         // [T, H] a block's output, added to x by the next norm
  std::shared_ptr<Buffer> qg;        // [T, Hq, 2D] per head: query | output gate
  std::shared_ptr<Buffer> k, v;      // [T, Hkv, D]
  std::shared_ptr<Buffer> o;         // [T, Hq, D] attention output (gated)
  std::shared_ptr<Buffer> part_o;    // [S, Hq, max_splits, D] split-K partials (decode), slot s: segment s
  std::shared_ptr<Buffer> part_ml;   // [S, Hq, max_splits, 2] their (max, sum)
  std::shared_ptr<Buffer> qkv;       // [T, C] DeltaNet q | k | v projections
  std::shared_ptr<Buffer> qkvz;      // [T, C + Hv*Dv] Qwen3-Next's grouped q k v z projection
  std::shared_ptr<Buffer> ba;        // [T, 2*Hv] Qwen3-Next's grouped b a projection
  std::shared_ptr<Buffer> z;         // [T, Hv*Dv] output gate of the gated RMSNorm
  std::shared_ptr<Buffer> b, a;      // [T, Hv] beta and decay inputs
  std::shared_ptr<Buffer> conv_out;  // [T, C] after conv + SiLU (prefill: q/k normalised too)
  std::shared_ptr<Buffer> gdn_gates; // [T, Hv, 2] (beta, decay) of the prefill scan
  std::shared_ptr<Buffer> go;        // [T, Hv*Dv] DeltaNet output before out_proj
  std::shared_ptr<Buffer> router;    // [T, E] router logits
  std::shared_ptr<Buffer> ids;       // [T, k] uint32 routed experts
  std::shared_ptr<Buffer> wts;       // [T, k] routing weights
  std::shared_ptr<Buffer> act;       // [T, k, I] SwiGLU activations (prefill: [T*k, I] sorted by expert)
  std::shared_ptr<Buffer> act_s;     // [T, Is] shared expert activations
  std::shared_ptr<Buffer> sgate;     // [T] shared expert gate logit
  std::shared_ptr<Buffer> zeros;     // [T] uint32 zeros: the ids of one-expert blocks (dense MLP)
  std::shared_ptr<Buffer> logits;    // [n, V] lm_head rows handed back (or sampled on the device)
  // Prefill MoE (chunks on the GEMM route): moe_plan's output and the routed rows.
  std::shared_ptr<Buffer> plan_rows;    // [T*k] uint32 slots sorted by expert
  std::shared_ptr<Buffer> plan_blocks;  // [max_blocks] uint4 {expert, first row, rows, 0}
  std::shared_ptr<Buffer> plan_header;  // [4] uint32 {blocks used, rows, 0, 0}
  std::shared_ptr<Buffer> yr;           // [T*k, H] weighted expert rows by slot
  std::shared_ptr<Buffer> ys;           // [T, H] shared expert output

  Activations(Device& device, const ModelConfig& c, int max_splits) : device_(device), c_(c), max_splits_(max_splits) {}
  // Every per-token buffer large enough for T tokens, and the split-K partials for `segments`
  // sequences (buffers only grow). Call only when no command buffer in flight uses them (a
  // replaced buffer is released).
  void size_for(int T, int segments = 1);
  // b holds at least `bytes` (at least 16), replaced by a larger one if needed.
  void grow(std::shared_ptr<Buffer>& b, size_t bytes);

 private:
  Device& device_;
  const ModelConfig& c_;
  int max_splits_;
};

}  // namespace lily::gpu
