// Plan reports: the Metal backend's dispatch sequence for one decode step, or a chunked prefill,
// at any model shape and context, counted without running it (benchmarks/metal_plan.py, docs/metal.md).
//
// A RecordingDevice implements gpu::Device with buffers that have a length and no memory and
// command buffers that execute nothing, so GpuBackend encodes exactly what it would encode for
// Metal; synthetic weights give every Linear the size it has in an MLX affine checkpoint
// (addresses in a reserved range that is never dereferenced).
#pragma once
#include <memory>
#include <vector>

#include "gpu/backend.h"

namespace lily::gpu {

std::shared_ptr<Device> make_recording_device();

struct PlanQuantization {
  int bits = 4, group = 64;
  int gate_bits = 8;  // router and shared_expert_gate (the released 4-bit checkpoints' overrides)
};

struct DecodePlan {
  std::vector<DispatchRecord> dispatches;
  GpuStats stats;  // of this one decode step
  // Device memory allocated while encoding it (activations and scratch, expert offset tables,
  // norm vectors: everything but weights and the state made by new_state).
  uint64_t scratch_bytes = 0;
};

// One decode step (the token at position context - 1) of a model with config `c`.
DecodePlan plan_decode_step(const ModelConfig& c, const PlanQuantization& q, const GpuOptions& options,
                            int context);

// One prefill chunk of `tokens` tokens ending at position context - 1 (logits of its last row
// only, as a chunk of Session.prefill); tokens = 1 is plan_decode_step.
DecodePlan plan_chunk(const ModelConfig& c, const PlanQuantization& q, const GpuOptions& options,
                      int context, int tokens);

// `batch` sequences, each such a chunk (tokens = 1: a decode row) at the same context, in the
// passes Engine::step runs them (continuous batching: at most GpuBackend::batch_rows() rows in
// a pass of several sequences); dispatches and counts of all those passes.
DecodePlan plan_batch(const ModelConfig& c, const PlanQuantization& q, const GpuOptions& options, int context,
                      int tokens, int batch);

// A whole prompt prefilled in chunks the way Engine::generate_greedy does it: every chunk but
// the last as a prefill pass, the last as device greedy step 0 (its argmax stays on the device).
struct PrefillPlan {
  int chunks = 0;
  int last_tokens = 0;
  std::vector<DispatchRecord> last_chunk;  // the last chunk's dispatches
  GpuStats last_stats;                     // ... and its counts
  GpuStats total;                          // the whole prompt (waits include those between chunks)
  uint64_t waits_inside_chunks = 0;        // CPU waits while a chunk is encoded (goal 0)
  uint64_t device_bytes = 0;  // buffers the backend holds at the last chunk (no weights)
  uint64_t state_bytes = 0;   // of which the sequence state (KV, both DeltaNet/conv copies)
};

PrefillPlan plan_prefill(const ModelConfig& c, const PlanQuantization& q, const GpuOptions& options, int prompt,
                         int chunk);

}  // namespace lily::gpu
