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

bool GpuBackend::begin_device_decode(State& state, int max_steps, const DeviceSampling& s) {
  auto& st = static_cast<GpuState&>(state);
  finish();
  reserve_kv(st, st.position() + max_steps);
  size_activations(1);
  grow(logits_, size_t(c_.vocab) * 4);
  grow(sample_w_, size_t(c_.vocab) * 4);
  grow(ring_, 8);
  grow(status_, 32);
  grow(rng_, 32);
  step_ = read_step_ = 0;
  inflight_.clear();
  if (auto* p = static_cast<uint64_t*>(rng_->contents())) std::memcpy(p, s.rng, 32);
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
  ++stats_.waits;
  cb->wait_until_completed();
  const int64_t i = read_step_++;
  const auto* r = static_cast<const int32_t*>(ring_->contents());
  const auto* status = static_cast<const uint32_t*>(status_->contents());
  if (status) {
    const uint32_t* s = status + (i % 2) * 4;
    if (s[0] == LILY_SAMPLE_BAD_LOGIT) {
      float v;
      std::memcpy(&v, &s[2], 4);
      char buf[32];
      std::snprintf(buf, sizeof buf, "%g", double(v));
      throw Error("[sampling] logit of token " + std::to_string(s[1]) + " is " + buf);
    }
    if (s[0] == LILY_SAMPLE_ALL_NEG_INF) throw Error("[sampling] every logit is -inf");
  }
  return r ? r[i % 2] : 0;
}

void GpuBackend::discard_last_step(State& state) {
  for (auto& cb : inflight_) {
    ++stats_.waits;
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

// The token of device-loop step step_ from logits_ (metal/sampling.metal): into ring slot
// step_ % 2, with its status beside it; advances the generator state in rng_.
void GpuBackend::encode_sample(int vocab) {
  const Ref slot{ring_, size_t(step_ % 2) * 4}, status{status_, size_t(step_ % 2) * 16};
  Dispatch d(*this, "sampling.metal", "sample");
  d.buf(0, logits_).buf(1, sample_w_).buf(2, rng_).buf(3, slot).buf(4, status)
      .args(5, sample_args_)
      .reads(logits_, size_t(vocab) * 4).writes(sample_w_, size_t(vocab) * 4)
      .reads(rng_, 32).writes(rng_, 32).writes(slot.buf, 4, slot.off).writes(status.buf, 12, status.off);
  d.run({1, 1, 1}, {LILY_SAMPLE_THREADS, 1, 1});
}

}  // namespace lily::gpu
