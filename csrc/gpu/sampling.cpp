// The GPU backend's device decode loop: tokens chosen on the device (metal/sampling.metal) and
// fed to the next step without a CPU round trip (Engine::begin_device_decode drives it).
//
// Design choices:
// - A two-slot ring of tokens, one per sequence of the loop: step i reads slot (i+1)%2 (its
//   inputs) and writes slot i%2, so step i+1 can be committed before step i's tokens are read
//   back (depth 2). Beside each token a status says whether its logits were usable; the host
//   raises the CPU sampler's error when it reads a bad one.
// - Each sequence's generator state (xoshiro256**, 4 x u64) lives in a device buffer that its
//   sample dispatch advances, so the device continues the host sampler's stream: the host draws
//   the first token from the prefill's logits and hands over its state here (and advances its
//   own copy as the device draws: Engine::next_device_tokens).
// - A loop of several sequences is one batched pass per step (GpuBackend::embed .. lm_head) and
//   one sample dispatch for all of them, a threadgroup per sequence with its own parameters.
// - Nothing waits on the GPU within a step: successive command buffers of one queue see each
//   other's writes (Metal's default hazard tracking of buffers), which is what carries the
//   ring slot and the generator state from step to step.
#include <cstdio>
#include <cstring>
#include <string>

#include "gpu/backend.h"
#include "gpu/encode.h"
#include "model/error.h"

namespace lily::gpu {

// One dispatch for all rows of a step, a threadgroup per row (args[r]: row r's parameters and
// stride): logits [rows, stride] -> token [rows] (argmax or a seeded draw), status [rows, 4]
// beside them; rng [rows, 4] advances in place; w [rows, stride] is the kernel's scratch.
void encode_sample(EncoderContext& ctx, const std::vector<SampleArgs>& args, const BufferRange& logits,
                   const BufferRange& w, const BufferRange& rng, const BufferRange& token, const BufferRange& status) {
  const size_t rows = args.size(), row_bytes = size_t(args[0].stride) * 4;
  Dispatch d(ctx, "sampling.metal", "sample");
  d.args(args)
      .read("logits", logits, rows * row_bytes)
      .write("w", w, rows * row_bytes)
      .write("rng", rng, rows * 32)
      .declare_read(rng.buf, rows * 32, rng.off)
      .write("token", token, rows * 4)
      .write("status", status, rows * 16);
  d.run({uint32_t(rows), 1, 1}, {LILY_SAMPLE_THREADS, 1, 1});
}

bool GpuBackend::begin_device_decode(Segments segs, int max_steps, const DeviceSampling* sampling) {
  finish();
  const size_t rows = size_t(segs.size()), vocab = size_t(c_.vocab);
  for (const SeqRows& s : segs) {
    auto& st = static_cast<GpuState&>(*s.state);
    reserve_kv(st, st.position() + max_steps);
  }
  acts_.size_for(int(rows), int(rows));
  acts_.grow(acts_.logits, rows * vocab * 4);
  acts_.grow(sample_w_, rows * vocab * 4);
  acts_.grow(ring_, 2 * rows * 4);
  acts_.grow(status_, 2 * rows * 16);
  acts_.grow(rng_, rows * 32);
  step_ = read_step_ = 0;
  inflight_.clear();
  loop_.clear();
  sample_args_.assign(rows, SampleArgs{});
  for (size_t r = 0; r < rows; ++r) {
    loop_.push_back(static_cast<GpuState*>(segs[int(r)].state));
    const DeviceSampling& s = sampling[r];
    rng_->write(r * 32, s.rng, 32);
    SampleArgs& a = sample_args_[r];
    // The chosen token is one of the first `vocab` rows: the sampler's token limit (rows past the
    // tokenizer's entries are never sampled), the CPU sampler's truncation exactly.
    a.vocab = uint32_t(s.token_limit > 0 && s.token_limit < c_.vocab ? s.token_limit : c_.vocab);
    a.sample = s.draw ? 1u : 0u;
    a.top_k = s.top_k > 0 ? uint32_t(s.top_k) : 0u;
    a.use_top_p = s.top_p_fixed != 0 ? 1u : 0u;
    a.top_p_lo = uint32_t(s.top_p_fixed & 0xFFFFFFFFu);
    a.top_p_hi = uint32_t(s.top_p_fixed >> 32);
    a.use_min_p = s.use_min_p ? 1u : 0u;
    a.inv_t = s.inv_t;
    a.min_p_offset = s.min_p_offset;
    a.stride = uint32_t(vocab);
  }
  device_loop_ = true;
  return true;
}

void GpuBackend::wait_device_tokens(int32_t* tokens, std::string* errors) {
  if (inflight_.empty()) throw Error("[gpu] no device-loop step in flight");
  auto cb = inflight_.front();
  inflight_.erase(inflight_.begin());
  ++ctx_.stats().waits;
  cb->wait_until_completed();
  const int64_t i = read_step_++;
  // This step's slot: each row's token, and its status {code, token id, logit bits} (sample_step).
  const size_t rows = loop_.size();
  ring_->read(size_t(i % 2) * rows * 4, tokens, rows * 4);
  std::vector<uint32_t> status(rows * 4);
  status_->read(size_t(i % 2) * rows * 16, status.data(), rows * 16);
  for (size_t r = 0; r < rows; ++r) {
    const uint32_t* s = &status[r * 4];
    errors[r].clear();
    if (s[0] == LILY_SAMPLE_BAD_LOGIT) {
      float v;
      std::memcpy(&v, &s[2], 4);
      char buf[32];
      std::snprintf(buf, sizeof buf, "%g", double(v));
      errors[r] = "[sampling] logit of token " + std::to_string(s[1]) + " is " + buf;
    } else if (s[0] == LILY_SAMPLE_ALL_NEG_INF) {
      errors[r] = "[sampling] every logit is -inf";
    }
  }
}

void GpuBackend::discard_last_step() {
  for (auto& cb : inflight_) {
    ++ctx_.stats().waits;
    cb->wait_until_completed();
  }
  inflight_.clear();
  for (GpuState* st : loop_) st->parity ^= 1;  // back to the copies the discarded step read
  --step_;
  read_step_ = step_;
}

void GpuBackend::end_device_decode() {
  for (auto& cb : inflight_) cb->wait_until_completed();
  inflight_.clear();
  loop_.clear();
  device_loop_ = false;
}

// The tokens of device-loop step step_ from the logits [rows, vocab] (metal/sampling.metal), one
// dispatch, a threadgroup per row with its own parameters and generator state: into ring slot
// step_ % 2, each with its status beside it.
void GpuBackend::sample_step() {
  const size_t rows = loop_.size(), slot = size_t(step_ % 2);
  encode_sample(ctx_, sample_args_, {acts_.logits, 0}, {sample_w_, 0}, {rng_, 0}, {ring_, slot * rows * 4},
                {status_, slot * rows * 16});
}

}  // namespace lily::gpu
