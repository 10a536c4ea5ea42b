// The GPU backend's device decode loop: tokens chosen on the device (metal/sampling.metal) and
// fed to the next step without a CPU round trip (Engine::begin_device_decode drives it).
//
// Design choices:
// - A two-slot ring of tokens: step i reads slot (i+1)%2 (its input) and writes slot i%2, so
//   step i+1 can be committed before step i's token is read back (depth 2). Beside each slot a
//   status word says whether the logits were usable; the host raises the CPU sampler's error
//   when it reads a bad one.
// - The generator state (xoshiro256**, 4 x u64) lives in a device buffer that each sample
//   dispatch advances, so the device continues the host sampler's stream: the host draws the
//   first token from the prefill's logits and hands over its state here.
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

// logits [vocab] -> token (sample: argmax or a seeded draw), status [3] beside it; rng [4]
// advances in place; w [vocab] is the kernel's scratch.
void encode_sample(EncoderContext& ctx, const SampleArgs& args, const BufferRange& logits, const BufferRange& w,
                   const BufferRange& rng, const BufferRange& token, const BufferRange& status) {
  const size_t vocab = args.vocab;
  Dispatch d(ctx, "sampling.metal", "sample");
  d.args(args)
      .read("logits", logits, vocab * 4)
      .write("w", w, vocab * 4)
      .write("rng", rng, 32)
      .declare_read(rng.buf, 32, rng.off)
      .write("token", token, 4)
      .write("status", status, 12);
  d.run({1, 1, 1}, {LILY_SAMPLE_THREADS, 1, 1});
}

bool GpuBackend::begin_device_decode(State& state, int max_steps, const DeviceSampling& s) {
  auto& st = static_cast<GpuState&>(state);
  finish();
  reserve_kv(st, st.position() + max_steps);
  acts_.size_for(1);
  acts_.grow(acts_.logits, size_t(c_.vocab) * 4);
  acts_.grow(sample_w_, size_t(c_.vocab) * 4);
  acts_.grow(ring_, 8);
  acts_.grow(status_, 32);
  acts_.grow(rng_, 32);
  step_ = read_step_ = 0;
  inflight_.clear();
  rng_->write(0, s.rng, 32);
  sample_args_ = SampleArgs{};
  // The chosen token is one of the first `vocab` rows: the sampler's token limit (rows past the
  // tokenizer's entries are never sampled), the CPU sampler's truncation exactly.
  sample_args_.vocab = uint32_t(s.token_limit > 0 && s.token_limit < c_.vocab ? s.token_limit : c_.vocab);
  sample_args_.sample = s.draw ? 1u : 0u;
  sample_args_.top_k = s.top_k > 0 ? uint32_t(s.top_k) : 0u;
  sample_args_.use_top_p = s.top_p_fixed != 0 ? 1u : 0u;
  sample_args_.top_p_lo = uint32_t(s.top_p_fixed & 0xFFFFFFFFu);
  sample_args_.top_p_hi = uint32_t(s.top_p_fixed >> 32);
  sample_args_.use_min_p = s.use_min_p ? 1u : 0u;
  sample_args_.inv_t = s.inv_t;
  sample_args_.min_p_offset = s.min_p_offset;
  greedy_ = true;
  return true;
}

int32_t GpuBackend::wait_device_token() {
  if (inflight_.empty()) throw Error("[gpu] no device-loop step in flight");
  auto cb = inflight_.front();
  inflight_.erase(inflight_.begin());
  ++ctx_.stats().waits;
  cb->wait_until_completed();
  const int64_t i = read_step_++;
  // This step's slot: its token, and its status {code, token id, logit bits} (sample_step).
  int32_t token = 0;
  uint32_t s[3];
  ring_->read(size_t(i % 2) * 4, &token, 4);
  status_->read(size_t(i % 2) * 16, s, sizeof s);
  if (s[0] == LILY_SAMPLE_BAD_LOGIT) {
    float v;
    std::memcpy(&v, &s[2], 4);
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", double(v));
    throw Error("[sampling] logit of token " + std::to_string(s[1]) + " is " + buf);
  }
  if (s[0] == LILY_SAMPLE_ALL_NEG_INF) throw Error("[sampling] every logit is -inf");
  return token;
}

void GpuBackend::discard_last_step(State& state) {
  for (auto& cb : inflight_) {
    ++ctx_.stats().waits;
    cb->wait_until_completed();
  }
  inflight_.clear();
  auto& st = static_cast<GpuState&>(state);
  st.parity ^= 1;  // back to the copies the discarded step read
  --step_;
  read_step_ = step_;
}

void GpuBackend::end_device_decode() {
  for (auto& cb : inflight_) cb->wait_until_completed();
  inflight_.clear();
  greedy_ = false;
}

// The token of device-loop step step_ from the logits (metal/sampling.metal): into ring slot
// step_ % 2, with its status beside it; advances the generator state in rng_.
void GpuBackend::sample_step() {
  encode_sample(ctx_, sample_args_, {acts_.logits, 0}, {sample_w_, 0}, {rng_, 0},
                {ring_, size_t(step_ % 2) * 4}, {status_, size_t(step_ % 2) * 16});
}

}  // namespace lily::gpu
