// The coarse ops every backend implements, and the per-sequence state they keep.
//
// The layer schedule (model/schedule.cpp) is written once against this interface. Ops are
// coarse on purpose — a whole mixer, a whole MoE block — so a backend can fuse inside them:
// the CPU backend runs loops over its thread pool; a GPU backend encodes dispatches and waits
// for nothing until the pass ends.
//
// Activations live inside the backend for the current pass of T rows:
//   x [T, hidden]  residual stream     h [T, hidden]  normed input of the next block
//   y [T, hidden]  output of the last mixer / feed-forward block
//
// A pass's rows may belong to several sequences (continuous batching): each sequence owns a
// contiguous run of rows (a SeqRows segment). Norms, projections, the MLP / MoE and the head
// treat the T rows alike, so every weight matrix is read once for all of them; only the mixers
// (attention, DeltaNet) read and extend per-sequence state, each segment against its own.
#pragma once
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "model/weights.h"

namespace lily {

// The recurrent part of a State at one position (DeltaNet S and conv windows). DeltaNet state
// cannot be rewound, only restored; the KV cache needs no copy, because entries past a
// position are simply overwritten as the sequence goes on from there.
class Snapshot {
 public:
  virtual ~Snapshot() = default;
  int position() const { return position_; }
  virtual size_t nbytes() const = 0;

 protected:
  friend class State;
  int position_ = 0;
  uint64_t epoch_ = 0;  // the State's restore count when taken
};

// One tensor of a sequence state written to a file that outlives the process (lily's
// Session.save): float32, row-major.
struct StateTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// The name of layer `layer`'s state tensor: "kv.<layer>.k", "gdn.<layer>.S", ...
std::string state_tensor_name(const char* kind, int layer, const char* part);
// The tensor called `name` in `tensors` (which check_tensors passed), or nullptr.
const StateTensor* find_state_tensor(const std::vector<StateTensor>& tensors, const std::string& name);

// Everything a sequence carries between chunks: the attention KV cache, the DeltaNet conv and
// recurrent state, and the position. Made by a backend; opaque to the schedule.
class State {
 public:
  virtual ~State() = default;
  int position() const { return position_; }
  int max_context() const { return max_context_; }
  // A deep copy (used for turn snapshots: DeltaNet state cannot be rewound, only restored).
  virtual std::unique_ptr<State> clone() const = 0;
  // Bytes of memory held now.
  virtual size_t nbytes() const = 0;

  // Captures the recurrent state at the current position.
  std::unique_ptr<Snapshot> snapshot() const;
  // Returns the sequence to a snapshot's position. Throws RequestError if the snapshot is not
  // of this state, or if the KV entries it relies on were overwritten since (a restore to an
  // earlier position followed by new tokens).
  void restore(const Snapshot& snap);

  // The state as named tensors (Session.save writes them to a safetensors file): for each
  // attention layer l, "kv.<l>.k" and "kv.<l>.v" [Hkv, P, D] holding positions [0, P); for each
  // DeltaNet layer, "gdn.<l>.conv" [K-1, C] and "gdn.<l>.S" [Hv, Dk, Dv]. The recurrent part is
  // a snapshot's (capture(), the same copy a turn snapshot keeps): `at`, a snapshot of this
  // state, exports that position instead of the current one (throws as restore() would if it
  // is stale); with_kv false leaves the KV tensors out (the recurrent state alone).
  std::vector<StateTensor> export_tensors(const Snapshot* at, bool with_kv) const;
  // Moves the sequence to `position` from such tensors (KV tensors required; they may hold more
  // than `position` rows: entries past the position are overwritten as the sequence goes on).
  // Like restore(), it invalidates snapshots taken past `position`. Throws RequestError naming
  // the first tensor that is missing, unknown or mis-shaped, before changing anything.
  void import_tensors(int position, const std::vector<StateTensor>& tensors);
  // A snapshot at `position` (<= position()) of this sequence from recurrent tensors alone
  // ("gdn.*"; "kv.*" ones are ignored), as if snapshot() had been taken there: the caller
  // vouches that the KV cache holds the same tokens up to `position` (a saved sequence and the
  // turn snapshots saved with it).
  std::unique_ptr<Snapshot> snapshot_from_tensors(int position, const std::vector<StateTensor>& tensors) const;

 protected:
  friend class Engine;
  virtual std::unique_ptr<Snapshot> capture() const = 0;
  virtual void apply(const Snapshot& snap) = 0;
  // The backend parts of the tensor import / export (names, shapes and checks are State's):
  // a layer's recurrent state out of a snapshot of this state, and into a new_snapshot() of it
  // (CPU or device layout, f32 values); KV rows [0, positions) of a layer's K (v false) or V
  // cache as [Hkv, positions, D] f32, read and written (reserve_kv_rows first grows every
  // layer's cache to hold `rows`, so running out of memory changes nothing).
  virtual void read_recurrent(const Snapshot& snap, int layer, std::vector<float>& conv,
                              std::vector<float>& S) const = 0;
  virtual std::unique_ptr<Snapshot> new_snapshot() const = 0;
  virtual void write_recurrent(Snapshot& snap, int layer, const std::vector<float>& conv,
                               const std::vector<float>& S) const = 0;
  virtual void read_kv_rows(int layer, bool v, int positions, float* out) const = 0;
  virtual void reserve_kv_rows(int rows) = 0;
  virtual void write_kv_rows(int layer, bool v, int rows, const float* in) = 0;
  // Throws RequestError unless `tensors` are exactly this model's state tensors (the "kv.*"
  // ones only when with_kv, else they are ignored) with their shapes, KV holding between
  // `positions` and max_context rows.
  void check_tensors(int positions, const std::vector<StateTensor>& tensors, bool with_kv) const;
  // Throws RequestError if `snap` is not usable any more (see restore()).
  void check_not_stale(const Snapshot& snap) const;
  // A snapshot of this state holding the "gdn.*" tensors (position and epoch unset).
  std::unique_ptr<Snapshot> recurrent_from(const std::vector<StateTensor>& tensors) const;

  int position_ = 0;
  int max_context_ = 0;
  const ModelConfig* config_ = nullptr;  // the model's (set by the backend; it outlives its states)
  const void* engine_ = nullptr;  // the Engine that made it (or the state it was cloned from)
  uint64_t epoch_ = 0;
  // (epoch after the restore, position restored to): a snapshot at position p taken in epoch e
  // stays valid while every later restore went to a position >= p.
  std::vector<std::pair<uint64_t, int>> restores_;
};

// How a device decode loop chooses each token: argmax, or the CPU sampler's draw (see
// engine/sampler.h and metal/sampling.h) with the constants it derives and its generator state,
// so the device continues the host sampler's random stream.
struct DeviceSampling {
  bool draw = false;        // false: argmax (lowest id on ties)
  int32_t top_k = 0;        // 0: off
  uint64_t top_p_fixed = 0;  // top_p * 2^64; 0: off
  bool use_min_p = false;
  float inv_t = 1.0f;         // 1 / temperature
  float min_p_offset = 0.0f;  // temperature * log(min_p)
  uint64_t rng[4] = {0, 0, 0, 0};  // xoshiro256** state before the first device draw
  int32_t token_limit = 0;          // only ids below it are chosen (0: every row); Sampler::token_limit
};

// Rows [first, first + n) of a pass extend `state` from state->position() (n >= 1).
struct SeqRows {
  State* state = nullptr;
  int first = 0, n = 0;
};

// The segments of one pass, in row order and back to back (segment i + 1 starts where i ends,
// the first at row 0): a view (pointer and count; C++17 has no std::span), so a
// single-sequence pass builds its one segment on the stack and allocates nothing.
struct Segments {
  const SeqRows* seg = nullptr;
  int count = 0;

  const SeqRows* begin() const { return seg; }
  const SeqRows* end() const { return seg + count; }
  const SeqRows& operator[](int i) const { return seg[i]; }
  int size() const { return count; }
  int rows() const { return count ? seg[count - 1].first + seg[count - 1].n : 0; }  // T
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual std::unique_ptr<State> new_state(int max_context) = 0;
  // The longest context whose state fits beside the weights in the memory the backend may use
  // (GPU backends: the device's recommended working set); INT_MAX where nothing limits it.
  virtual int max_fitting_context() const { return std::numeric_limits<int>::max(); }
  // Throws ConfigError naming the sizes if a state of max_context positions does not fit (what
  // new_state would refuse), allocating nothing.
  virtual void check_context(int max_context) const {}
  // Whether one pass may hold rows of several sequences (more than one segment). A backend that
  // cannot refuses such a pass at embed; Engine::step runs the sequences one pass each there.
  virtual bool batches() const { return false; }
  // The most rows a pass of several segments may hold with every row's result still bit-identical
  // to running its sequence alone; Engine::step splits a step of more rows into several passes
  // (a segment of more rows runs alone). The GPU backends switch projections and the
  // feed-forward to tiled GEMMs at GpuOptions::gemm_min_rows rows, whose summation order is not
  // the GEMV's, so their passes of several sequences stay below it.
  virtual int batch_rows() const { return std::numeric_limits<int>::max(); }
  // An exception escaped a pass (forward_pass) before it completed: drop whatever of it was
  // encoded (none of it runs) and return every segment's state to how it was before the pass,
  // so the next pass starts clean. The engine calls it, then rethrows.
  virtual void abandon_pass(Segments segs) noexcept {}
  // A prefill call of several passes is about to take `st` to `positions`: grow what the passes
  // will need now, so that running out of memory refuses the call before its first pass
  // changes the state. The CPU backend grows the KV caches; the GPU backends grow theirs per
  // pass (embed), where the first chunk's layout depends on the pass (GpuOptions::block_threshold).
  virtual void reserve_for_call(State& st, int positions) {}

  // Starts a pass of segs.rows() tokens, each segment at its state's position:
  // x = embed(tokens). Grows every segment's KV cache for the pass first, so running out of
  // memory fails here, before any state changes.
  virtual void embed(Segments segs, const int32_t* tokens) = 0;
  // h = rmsnorm(x) * w
  virtual void rms_norm(const std::vector<float>& w) = 0;
  // x += y; h = rmsnorm(x) * w
  virtual void add_rms_norm(const std::vector<float>& w) = 0;
  // y = mixer(h), each segment's rows reading and extending its own state's layer.
  virtual void attention(Segments segs, int layer, const AttentionWeights& w) = 0;
  virtual void gated_deltanet(Segments segs, int layer, const GdnWeights& w) = 0;
  // y = ffn(h)
  virtual void mlp(const MlpWeights& w) = 0;
  virtual void moe(const MoeWeights& w) = 0;
  // logits[n, vocab] = head(h[first .. first + n))
  virtual void lm_head(const Linear& head, int first, int n, float* logits) = 0;

  // Device-side decoding (GPU backends; Engine::begin_device_decode drives it). Between begin
  // and end, each forward pass gets tokens == nullptr (each segment's input is its previous
  // step's token, already on the device) and logits == nullptr (lm_head chooses each segment's
  // token on the device, as its `sampling` entry says, writes it into the next step's input slot
  // and commits without waiting), so step N+1 is encoded and committed before step N's tokens
  // are read. `segs` are the loop's sequences, one row each from the second step on; the first
  // pass brings its own tokens instead (each segment's, T >= 1 in all: a prompt's last chunk or
  // the last token), and its rows are `segs`' rows. max_steps counts positions per sequence
  // (that first chunk's and 1 per step). sampling: [segs.size()].
  // Backends without it return false from begin and the engine loops on the host.
  virtual bool has_device_loop() const { return false; }
  virtual bool begin_device_decode(Segments segs, int max_steps, const DeviceSampling* sampling) { return false; }
  // Waits for the oldest step in flight and writes the token it chose for each sequence into
  // tokens [segs.size()], and into errors [segs.size()] the CPU sampler's error for a sequence
  // whose logits held a NaN / +inf or were all -inf (its token is then meaningless), else "".
  virtual void wait_device_tokens(int32_t* tokens, std::string* errors) {}
  // Waits for every step in flight, then undoes the newest one's recurrent-state update of every
  // sequence of the loop (the engine rolls the positions back; their KV entries are simply
  // overwritten later).
  virtual void discard_last_step() {}
  virtual void end_device_decode() {}
};

}  // namespace lily
