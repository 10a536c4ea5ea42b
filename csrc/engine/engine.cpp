#include "engine/engine.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>

#include "model/checked.h"
#include "model/error.h"

namespace lily {

Engine::Engine(std::shared_ptr<const ModelWeights> weights, std::unique_ptr<Backend> backend, int prefill_chunk)
    : weights_(std::move(weights)), backend_(std::move(backend)), prefill_chunk_(prefill_chunk) {
  if (prefill_chunk_ < 1) throw ConfigError("[engine] prefill_chunk must be at least 1");
}

std::unique_ptr<State> Engine::new_state(int max_context) {
  if (max_context < 1) throw RequestError("[engine] max_context must be at least 1");
  auto st = backend_->new_state(max_context);
  st->max_context_ = max_context;
  st->position_ = 0;
  st->engine_ = this;
  return st;
}

namespace {

// Memory a request may still claim: physical RAM, or less under an address-space limit
// (ulimit -v), minus what the process already maps. Linux overcommits, so a KV cache larger than
// RAM would "allocate" and then be OOM-killed when touched; this check turns that into an error.
uint64_t available_memory() {
  uint64_t avail = UINT64_MAX;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0) avail = uint64_t(pages) * uint64_t(page);
#if defined(__linux__)
  struct rlimit rl;
  if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    uint64_t mapped = 0;
    if (FILE* f = std::fopen("/proc/self/statm", "r")) {
      unsigned long long vm_pages = 0;
      if (std::fscanf(f, "%llu", &vm_pages) == 1) mapped = vm_pages * uint64_t(page);
      std::fclose(f);
    }
    const uint64_t lim = uint64_t(rl.rlim_cur);
    avail = std::min(avail, lim > mapped ? lim - mapped : 0);
  }
#endif
  return avail;
}

}  // namespace

uint64_t Engine::kv_bytes(int64_t positions) const {
  const ModelConfig& c = config();
  // Saturating: an absurd context reads as "too big" in check_tokens, never wraps to small.
  uint64_t per_position = 0;
  for (Mixer m : c.mixers)
    if (m == Mixer::Attention)
      per_position = saturating_add(per_position, 2ull * uint64_t(c.attn_kv_dim()) * sizeof(float));
  return saturating_mul(per_position, uint64_t(std::max<int64_t>(positions, 0)));
}

void Engine::check_tokens(const State& st, const int32_t* tokens, int n) const {
  if (n < 0) throw RequestError("[engine] negative token count");
  if (int64_t(st.position()) + n > st.max_context())
    throw RequestError("[engine] " + std::to_string(st.position()) + " cached + " + std::to_string(n) +
                       " new tokens exceed the context of " + std::to_string(st.max_context()));
  // The KV cache this request grows to, against the memory left (what the state holds already
  // is in use and stays). Checked before any compute, so a refused request changes nothing.
  const uint64_t need = kv_bytes(int64_t(st.position()) + n), held = st.nbytes();
  if (need > held && need - held > available_memory())
    throw RequestError("[engine] a context of " + std::to_string(int64_t(st.position()) + n) + " tokens needs " +
                       std::to_string(need >> 20) + " MiB of KV cache, more than the " +
                       std::to_string(available_memory() >> 20) + " MiB of memory available; use a shorter context");
  const int vocab = config().vocab;
  for (int i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab)
      throw RequestError("[engine] token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                         " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
}

// The backend is in device-loop mode until end_device_decode: no other pass may interleave.
void Engine::check_no_device_loop() const {
  if (device_loop_running())
    throw RequestError("[engine] a device decode loop is running on this engine: end it before other calls");
}

void Engine::prefill(State& st, const int32_t* tokens, int n, float* logits, bool all_logits) {
  check_no_device_loop();
  weights_->check_files_unchanged();
  check_tokens(st, tokens, n);
  // A call of several passes grows what all of them need first (the CPU backend's KV caches):
  // should memory run out, the call fails before its first pass, and the state is as it was.
  if (n > prefill_chunk_) backend_->reserve_for_call(st, st.position() + n);
  const int vocab = config().vocab;
  for (int done = 0; done < n;) {
    const int T = std::min(prefill_chunk_, n - done);
    const bool last_chunk = done + T == n;
    LogitRows rows = LogitRows::None;
    float* out = nullptr;
    if (logits && all_logits) {
      rows = LogitRows::All;
      out = logits + size_t(done) * vocab;
    } else if (logits && last_chunk) {
      rows = LogitRows::Last;
      out = logits;
    }
    forward(st, tokens + done, T, rows, out);
    st.position_ += T;
    done += T;
  }
}

void Engine::decode(State& st, int32_t token, float* logits) {
  check_no_device_loop();
  // Per token: the watch makes this an empty read() unless a file was touched.
  weights_->check_files_unchanged_if_touched();
  check_tokens(st, &token, 1);
  forward(st, &token, 1, logits ? LogitRows::Last : LogitRows::None, logits);
  st.position_ += 1;
}

void Engine::check_step(const std::vector<StepRows>& seqs, int ahead) const {
  check_no_device_loop();
  if (seqs.empty()) throw RequestError("[engine] a batched step needs at least one sequence");
  bool decode_only = true;
  uint64_t grow = 0;  // KV bytes the step (and `ahead` more rows each) add beyond what the states hold
  for (size_t i = 0; i < seqs.size(); ++i) {
    const StepRows& q = seqs[i];
    const std::string which = "sequence " + std::to_string(i) + " of the batch";
    if (!q.state) throw RequestError("[engine] " + which + " has no state");
    if (q.state->engine_ != this) throw RequestError("[engine] " + which + "'s state belongs to another engine");
    for (size_t j = 0; j < i; ++j)
      if (seqs[j].state == q.state)
        throw RequestError("[engine] " + which + "'s state is also sequence " + std::to_string(j) +
                           "'s: a state can appear once in a batch");
    if (q.n < 1) throw RequestError("[engine] " + which + " has no tokens");
    try {
      check_tokens(*q.state, q.tokens, q.n);
    } catch (const RequestError& e) {
      throw RequestError(std::string(e.what()) + " (" + which + ")");
    }
    decode_only = decode_only && q.n == 1;
    const uint64_t need = kv_bytes(int64_t(q.state->position()) + q.n + ahead), held = q.state->nbytes();
    if (need > held) grow = saturating_add(grow, need - held);
  }
  if (grow > available_memory())
    throw RequestError("[engine] the batch grows its KV caches by " + std::to_string(grow >> 20) +
                       " MiB, more than the " + std::to_string(available_memory() >> 20) +
                       " MiB of memory available; use fewer or shorter sequences");
  // As decode and prefill check the files: decode rows only when the watch saw an event.
  if (decode_only) weights_->check_files_unchanged_if_touched();
  else weights_->check_files_unchanged();
}

void Engine::step(const std::vector<StepRows>& seqs, float* logits) {
  check_step(seqs);
  const int vocab = config().vocab;
  if (!backend_->batches()) {  // one pass per sequence (see engine.h)
    for (size_t i = 0; i < seqs.size(); ++i) {
      forward(*seqs[i].state, seqs[i].tokens, seqs[i].n, logits ? LogitRows::Last : LogitRows::None,
              logits ? logits + i * vocab : nullptr);
      seqs[i].state->position_ += seqs[i].n;
    }
    return;
  }
  // Pass order: the multi-row segments first, so the last rows of all segments are consecutive
  // and the head reads its weights once (forward_pass).
  step_order_.clear();
  for (int multi : {1, 0})
    for (size_t i = 0; i < seqs.size(); ++i)
      if ((seqs[i].n > 1) == bool(multi)) step_order_.push_back(int(i));
  bool in_order = true;
  for (size_t k = 0; k < step_order_.size(); ++k) in_order = in_order && step_order_[k] == int(k);
  float* out = logits;
  if (logits && !in_order) {
    step_logits_.resize(seqs.size() * size_t(vocab));
    out = step_logits_.data();
  }
  // Passes of at most batch_rows() rows (one pass on the CPU backend), in that order.
  const int cap = backend_->batch_rows();
  for (size_t k = 0; k < step_order_.size();) {
    step_segs_.clear();
    step_tokens_.clear();
    size_t end = k;
    for (; end < step_order_.size(); ++end) {
      const StepRows& q = seqs[step_order_[end]];
      if (end > k && int64_t(step_tokens_.size()) + q.n > cap) break;
      step_segs_.push_back({q.state, int(step_tokens_.size()), q.n});
      step_tokens_.insert(step_tokens_.end(), q.tokens, q.tokens + q.n);
    }
    const Segments segs{step_segs_.data(), int(step_segs_.size())};
    forward(segs, step_tokens_.data(), logits ? LogitRows::Last : LogitRows::None, out ? out + k * vocab : nullptr);
    for (const SeqRows& seg : step_segs_) seg.state->position_ += seg.n;
    k = end;
  }
  if (out != logits)
    for (size_t k = 0; k < step_order_.size(); ++k)
      std::copy_n(out + k * vocab, vocab, logits + size_t(step_order_[k]) * vocab);
}

void Engine::decode_batch(const std::vector<State*>& states, const int32_t* tokens, float* logits) {
  std::vector<StepRows> seqs(states.size());
  for (size_t i = 0; i < states.size(); ++i) seqs[i] = {states[i], tokens + i, 1};
  step(seqs, logits);
}

void Engine::forward(State& st, const int32_t* tokens, int T, LogitRows rows, float* logits) {
  const SeqRows seg{&st, 0, T};
  forward(Segments{&seg, 1}, tokens, rows, logits);
}

void Engine::forward(Segments segs, const int32_t* tokens, LogitRows rows, float* logits) {
  try {
    forward_pass(*backend_, *weights_, segs, tokens, rows, logits);
  } catch (...) {
    backend_->abandon_pass(segs);  // nothing of the pass runs; every state is as before it
    throw;
  }
}

std::vector<int32_t> Engine::generate_greedy(State& st, int32_t token, int max_tokens,
                                             const std::function<bool(int32_t)>& keep_going) {
  return generate_greedy(st, &token, 1, max_tokens, keep_going);
}

std::vector<int32_t> Engine::generate_greedy(State& st, const int32_t* prompt, int n, int max_tokens,
                                             const std::function<bool(int32_t)>& keep_going) {
  std::vector<int32_t> out;
  if (max_tokens <= 0) return out;
  if (n < 1) throw RequestError("[engine] greedy generation needs at least one prompt token");
  weights_->check_files_unchanged();
  check_tokens(st, prompt, n);
  if (int64_t(st.position()) + n - 1 + max_tokens > st.max_context())
    throw RequestError("[engine] " + std::to_string(st.position()) + " cached + " + std::to_string(n) +
                       " prompt tokens + " + std::to_string(max_tokens) +
                       " greedy steps exceed the context of " + std::to_string(st.max_context()));
  // The prompt's chunks as prefill() cuts them; the last one is the first device step, so on a
  // device backend its argmax (the first generated token) never leaves the device.
  const int last = n - (n - 1) / prefill_chunk_ * prefill_chunk_;
  if (n > last) prefill(st, prompt, n - last, nullptr, false);
  const int32_t* first = prompt + (n - last);
  if (!begin_device_decode(st, first, last, max_tokens, nullptr)) {
    // Host loop: the last chunk in one prefill (its last row's argmax is the first token), then
    // one decode per further token.
    std::vector<float> logits(config().vocab);
    prefill(st, first, last, logits.data(), false);
    for (int i = 0; i < max_tokens; ++i) {
      if (i > 0) decode(st, out.back(), logits.data());
      const auto token = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
      out.push_back(token);
      if (!keep_going(token)) break;
    }
    return out;
  }
  struct End {
    Engine& e;
    State& st;
    ~End() { e.end_device_decode(st); }
  } end{*this, st};
  for (int i = 0; i < max_tokens; ++i) {
    const int32_t token = next_device_token(st);
    out.push_back(token);
    if (!keep_going(token)) break;
  }
  return out;
}

bool Engine::begin_device_decode(State& st, int32_t token, int max_steps, Sampler* sampler) {
  return begin_device_decode(st, &token, 1, max_steps, sampler);
}

bool Engine::begin_device_decode(State& st, const int32_t* first, int n, int max_steps, Sampler* sampler) {
  return begin_device_decode({DeviceRow{&st, first, n, sampler}}, max_steps);
}

namespace {

// What the device sampler takes from a host sampler (nullptr: argmax); false where the host must
// choose the tokens (a token mask or a logit bias).
bool device_sampling(const Sampler* sampler, DeviceSampling& ds) {
  ds = DeviceSampling{};
  if (!sampler) return true;
  // Greedy or not: the device argmax / draw would silently skip these.
  const SamplingParams& p = sampler->params();
  if (p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f ||
      p.top_logprobs > 0)
    throw RequestError("[engine] penalties and logprobs need the logits on the host: use the host loop");
  // A per-step token mask is computed on the host from the tokens so far, which a device loop
  // does not wait for: such a request decodes on the host (the caller's fallback). The GPU
  // sampler has no logit bias either (a rare request option; the host sampler applies it).
  if (sampler->has_allowed_tokens() || sampler->has_logit_bias()) return false;
  ds.token_limit = sampler->token_limit();
  if (sampler->draws()) {
    ds.draw = true;
    ds.top_k = p.top_k;
    ds.top_p_fixed = sampler->top_p_fixed();
    ds.use_min_p = p.min_p > 0.0f;
    ds.inv_t = sampler->inv_temperature();
    ds.min_p_offset = sampler->min_p_offset();
    for (int i = 0; i < 4; ++i) ds.rng[i] = sampler->rng().state()[i];
  }
  return true;
}

}  // namespace

bool Engine::begin_device_decode(const std::vector<DeviceRow>& rows, int max_steps) {
  if (device_loop_running()) throw RequestError("[engine] a device decode loop is already running on this engine");
  if (max_steps <= 0) throw RequestError("[engine] a device decode loop needs at least one step");
  if (rows.empty()) throw RequestError("[engine] a device decode loop needs at least one sequence");
  if (rows.size() > 1 && int(rows.size()) > backend_->batch_rows())
    throw RequestError("[engine] a device decode loop holds at most " + std::to_string(backend_->batch_rows()) +
                       " sequences, not " + std::to_string(rows.size()));
  std::vector<StepRows> step_rows;
  for (const DeviceRow& r : rows) {
    if (r.n < 1) throw RequestError("[engine] a device decode loop starts from at least one token");
    if (rows.size() > 1 && r.n != 1)
      throw RequestError("[engine] a device decode loop of several sequences starts from one token each");
    step_rows.push_back({r.state, r.first, r.n});
  }
  // States, tokens and files as a step's; memory for the KV caches all the loop's steps grow to.
  check_step(step_rows, max_steps - 1);
  for (size_t i = 0; i < rows.size(); ++i) {
    const State& st = *rows[i].state;
    if (int64_t(st.position()) + rows[i].n - 1 + max_steps > st.max_context())
      throw RequestError("[engine] " + std::to_string(st.position()) + " cached + " + std::to_string(rows[i].n) +
                         " tokens + " + std::to_string(max_steps) + " decode steps exceed the context of " +
                         std::to_string(st.max_context()) +
                         (rows.size() > 1 ? " (sequence " + std::to_string(i) + " of the loop)" : ""));
  }
  std::vector<DeviceSampling> ds(rows.size());
  for (size_t i = 0; i < rows.size(); ++i)
    if (!device_sampling(rows[i].sampler, ds[i])) return false;

  // The first pass: every row's tokens from the host, back to back.
  std::vector<SeqRows> first_segs;
  std::vector<int32_t> tokens;
  for (const DeviceRow& r : rows) {
    first_segs.push_back({r.state, int(tokens.size()), r.n});
    tokens.insert(tokens.end(), r.first, r.first + r.n);
  }
  const Segments first{first_segs.data(), int(first_segs.size())};
  if (!backend_->begin_device_decode(first, rows[0].n - 1 + max_steps, ds.data())) return false;
  loop_ = {};
  for (size_t i = 0; i < rows.size(); ++i) {
    loop_.states.push_back(rows[i].state);
    loop_.samplers.push_back(ds[i].draw ? rows[i].sampler : nullptr);
    loop_.segs.push_back({rows[i].state, int(i), 1});
  }
  loop_.max_steps = max_steps;
  try {  // step 0 brings its tokens from the host; the rest read theirs on the device
    forward(first, tokens.data(), LogitRows::Last, nullptr);
    for (const DeviceRow& r : rows) r.state->position_ += r.n;
    ++loop_.committed;
  } catch (...) {
    loop_ = {};
    backend_->end_device_decode();
    throw;
  }
  return true;
}

void Engine::device_step() {
  const Segments segs{loop_.segs.data(), int(loop_.segs.size())};
  forward(segs, nullptr, LogitRows::Last, nullptr);
  for (State* st : loop_.states) st->position_ += 1;
  ++loop_.committed;
}

void Engine::next_device_tokens(int32_t* tokens, std::vector<std::string>* errors) {
  if (!device_loop_running()) throw RequestError("[engine] no device decode loop is running");
  if (loop_.read >= loop_.max_steps) throw RequestError("[engine] the device decode loop has no steps left");
  // Depth 2: step read + 1 is committed before step read's tokens are waited for.
  if (loop_.committed == loop_.read + 1 && loop_.committed < loop_.max_steps) device_step();
  std::vector<std::string> own;
  std::vector<std::string>& err = errors ? *errors : own;
  err.assign(loop_.states.size(), std::string());
  backend_->wait_device_tokens(tokens, err.data());
  ++loop_.read;
  // The device drew each good row's sampler's next value for this step: the host's copy follows.
  for (size_t r = 0; r < loop_.samplers.size(); ++r)
    if (loop_.samplers[r] && err[r].empty()) loop_.samplers[r]->skip_draw();
  if (!errors)
    for (const std::string& e : err)
      if (!e.empty()) throw Error(e);
}

int32_t Engine::next_device_token(State& st) {
  if (loop_.states.size() != 1 || loop_.states[0] != &st)
    throw RequestError("[engine] no device decode loop of this one state is running");
  int32_t token = 0;
  next_device_tokens(&token);
  return token;
}

void Engine::end_device_decode() {
  if (!device_loop_running()) return;
  const bool unread = loop_.committed > loop_.read;
  const std::vector<State*> states = std::move(loop_.states);
  loop_ = {};
  struct End {  // the backend leaves device-loop mode even if the undo throws (a GPU error)
    Backend& b;
    ~End() { b.end_device_decode(); }
  } end{*backend_};
  if (unread) {  // that step consumed a token past the end: undo it
    backend_->discard_last_step();
    for (State* st : states) st->position_ -= 1;
  }
}

void Engine::end_device_decode(State& st) {
  if (std::find(loop_.states.begin(), loop_.states.end(), &st) == loop_.states.end()) return;
  if (loop_.states.size() != 1)
    throw RequestError("[engine] the device decode loop runs several sequences: end it with end_device_batch");
  end_device_decode();
}

}  // namespace lily
