// The prefill / decode loop over one backend and one set of weights. A prompt is prefilled in
// chunks of at most `prefill_chunk` tokens, so temporaries are bounded by the chunk, never by
// the prompt (a 128K prompt needs the same scratch as a 512 one).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "model/backend.h"
#include "model/schedule.h"

namespace lily {

class Engine {
 public:
  Engine(std::shared_ptr<const ModelWeights> weights, std::unique_ptr<Backend> backend, int prefill_chunk);

  const ModelConfig& config() const { return weights_->config; }
  const ModelWeights& weights() const { return *weights_; }
  Backend& backend() { return *backend_; }
  int prefill_chunk() const { return prefill_chunk_; }

  std::unique_ptr<State> new_state(int max_context);

  // Bytes of KV cache (all attention layers, fp32 K and V) for `positions` tokens.
  uint64_t kv_bytes(int64_t positions) const;

  // Both calls first check that the mapped checkpoint files are unchanged on disk (a file
  // truncated under the mapping would SIGBUS on the next read; see Weights.check_files_unchanged:
  // prefill stats the files, decode stats them only when the file watch saw an event, so an
  // untouched checkpoint costs a decode step one empty read(), not a stat per shard),
  // and that the KV cache the request grows to fits in the memory left; either failure is an
  // error before any compute, leaving the state as it was.
  // Appends n tokens to the state. logits: [n, vocab] when all_logits, else [vocab] of the last
  // token (or nullptr for none). Throws RequestError before any compute if the state's context
  // would overflow.
  void prefill(State& st, const int32_t* tokens, int n, float* logits, bool all_logits);
  // One token; logits [vocab].
  void decode(State& st, int32_t token, float* logits);

  // Continuous batching: one step over several sequences. Each StepRows appends its n >= 1
  // tokens to its state (n = 1: a decode row; more: a prefill chunk, so a prompt can be
  // prefilled in the same passes as other sequences' decode rows); logits [seqs, vocab] gets
  // the last row's logits of each, in the order given (nullptr: none).
  // Everything is checked first, before any compute, and a failed check changes no state: each
  // state was made by this engine, appears once, and has room in its context; the tokens are
  // in the vocabulary; the KV caches the step grows fit in the memory left, all together; the
  // checkpoint files are unchanged (as prefill / decode check them); no device loop is running.
  // On a backend that batches (Backend::batches(): the CPU and GPU backends) the step is ONE
  // pass when its rows fit Backend::batch_rows() (always on the CPU backend; below
  // GpuOptions::gemm_min_rows on a GPU one): every weight matrix is read once for all rows, and
  // each sequence's logits are bit-identical to running it alone; a pass that throws is
  // abandoned as a single sequence's is (abandon_pass), and no position moves (the CPU
  // backend's one failure point, KV growth, comes before any state changes). A step of more
  // rows runs as several such passes, in order (the multi-row segments first; one of more than
  // batch_rows() rows alone); a pass that throws there leaves the passes before it done.
  // Elsewhere the sequences run one pass each, in order, with the same results as decode /
  // prefill calls; a pass that throws there leaves the sequences before it advanced.
  struct StepRows {
    State* state = nullptr;
    const int32_t* tokens = nullptr;  // [n]
    int n = 0;
  };
  void step(const std::vector<StepRows>& seqs, float* logits);
  // One decode row per state: step() with n = 1 each; tokens [B], logits [B, vocab].
  void decode_batch(const std::vector<State*>& states, const int32_t* tokens, float* logits);

  // Greedy decoding from `token` (not yet in the state): up to max_tokens tokens, each the
  // argmax (lowest id among ties) of the previous step's logits; stops after a token for which
  // keep_going returns false (that token is returned but not fed back). The state ends holding
  // token and every returned token but the last, as max_tokens decode() calls would leave it.
  // On a backend with device greedy support the token never leaves the device before the next
  // step is committed (depth-2 pipelining; a step made past the stop is discarded).
  std::vector<int32_t> generate_greedy(State& st, int32_t token, int max_tokens,
                                       const std::function<bool(int32_t)>& keep_going);
  // The same from a prompt of n tokens (none in the state yet): the prompt is prefilled in
  // chunks and its last chunk is the first greedy step, so on a device backend the first
  // generated token is chosen on the device and fed to the next step without a CPU round trip.
  std::vector<int32_t> generate_greedy(State& st, const int32_t* prompt, int n, int max_tokens,
                                       const std::function<bool(int32_t)>& keep_going);

  // A decode loop whose tokens stay on the device (GPU backends), over one or several
  // sequences. begin feeds each row's `first` tokens (not yet in its state) and commits the
  // first step, in which each sequence's token is chosen on the device: the argmax, or its
  // `sampler`'s draw (the sampler's parameters and its generator state at this point;
  // penalties and logprobs need the logits on the host, so such a sampler is refused). Each
  // next_device_tokens commits the following step (at most max_steps in all) before it waits
  // for the oldest and returns its tokens, one per row, so the device always has the next step
  // queued (depth 2); each token drawn advances its sampler's generator on the host too, so a
  // later loop or host step continues the same random stream. end waits for the step still in
  // flight, if any, and undoes it (recurrent states and positions), so every state ends as
  // decode() calls for each of its returned tokens but the last would leave it.
  // The rows' steps are one batched pass each (Engine::step's rules: every weight matrix is
  // read once for all rows, and each sequence's tokens are the ones it gets alone). A loop of
  // several sequences starts from one token each, holds at most Backend::batch_rows() of them
  // and is checked as step() checks its rows.
  // begin returns false, changing nothing, when the backend has no device loop, or when a
  // sampler has a token mask or a logit bias (computed or applied on the host).
  struct DeviceRow {
    State* state = nullptr;
    const int32_t* first = nullptr;  // [n]
    int n = 0;
    Sampler* sampler = nullptr;  // nullptr: argmax
  };
  bool begin_device_decode(const std::vector<DeviceRow>& rows, int max_steps);
  // tokens [rows]. errors [rows] (nullptr: throw the first instead): the CPU sampler's error for
  // a row whose logits held a NaN / +inf or were all -inf (its token is then meaningless and its
  // sampler drew nothing), else "". The other rows' tokens are good either way.
  void next_device_tokens(int32_t* tokens, std::vector<std::string>* errors = nullptr);
  void end_device_decode();
  bool device_loop_running() const { return !loop_.states.empty(); }
  int device_loop_rows() const { return int(loop_.states.size()); }
  // One sequence: the same from a token, or from n >= 1 tokens (a prompt's last chunk, whose
  // first step processes all of them and whose token is the first one the loop returns).
  bool begin_device_decode(State& st, int32_t token, int max_steps, Sampler* sampler);
  bool begin_device_decode(State& st, const int32_t* first, int n, int max_steps, Sampler* sampler);
  int32_t next_device_token(State& st);
  void end_device_decode(State& st);

 private:
  void check_tokens(const State& st, const int32_t* tokens, int n) const;
  void check_no_device_loop() const;
  // A batched step's checks; `ahead`: positions each sequence takes after the step (a device
  // loop's further steps), counted in the memory its KV caches grow by.
  void check_step(const std::vector<StepRows>& seqs, int ahead = 0) const;

  void device_step();
  // forward_pass; if it throws, the backend abandons the pass (none of it runs, every state is
  // as before it), then the exception goes on.
  void forward(Segments segs, const int32_t* tokens, LogitRows rows, float* logits);
  // The same for one sequence's T tokens.
  void forward(State& st, const int32_t* tokens, int T, LogitRows rows, float* logits);

  std::shared_ptr<const ModelWeights> weights_;
  std::unique_ptr<Backend> backend_;
  int prefill_chunk_;
  // step()'s pass, reused: segments in pass order, their tokens back to back, the caller's
  // index of each segment, and the logits in pass order when that differs from the caller's.
  std::vector<SeqRows> step_segs_;
  std::vector<int32_t> step_tokens_;
  std::vector<int> step_order_;
  std::vector<float> step_logits_;
  // The device loop in progress (begin_device_decode .. end_device_decode).
  struct DeviceLoop {
    std::vector<State*> states;      // the rows, in pass order
    std::vector<Sampler*> samplers;  // each row's (nullptr: argmax), advanced as the device draws
    std::vector<SeqRows> segs;       // one row per state: the passes after the first
    int max_steps = 0, committed = 0, read = 0;
  } loop_;
};

}  // namespace lily
