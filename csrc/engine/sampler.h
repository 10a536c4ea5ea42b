// Token sampling from one row of logits: penalties, temperature, top-k, top-p, min-p, then a
// draw from a seeded generator owned by the Sampler. Pure C++17, no Python.
//
// Order of operations (the one HF transformers, llama.cpp and mlx-lm users expect):
//   0. logit bias (OpenAI's logit_bias, set_logit_bias): l[id] += bias, first, as llama.cpp's
//      sampler chain does, so the penalties below see the biased logits.
//   1. penalties on the logits, over the tokens the caller passes as the penalty window:
//        repetition (CTRL / HF): once per distinct token, l > 0 ? l / r : l * r
//        presence / frequency (OpenAI): l -= presence * [count > 0] + frequency * count
//   2. logprobs (SampleResult) are log-softmax of these penalized logits: the model's distribution
//      after penalties, before temperature and truncation (what mlx-lm reports).
//   3. temperature 0 -> argmax of the penalized logits, lowest id on ties; no draw, no RNG use
//      (temperatures below 1e-5 count as 0).
//   4. temperature T > 0 -> scaled logits l / T; top-k keeps the k largest (ties by lowest id);
//      top-p keeps the smallest prefix of the remaining tokens, in descending probability
//      (renormalized over the top-k set), whose mass reaches top_p; min-p keeps tokens whose
//      probability is at least min_p times the largest; then one draw in proportion to
//      exp(l / T) over what is left.
//
// Cost per call is a few O(V) passes over the vocabulary plus work on the candidate set only:
// top-k uses a bounded heap (or nth_element for large k); top-p without top-k buckets tokens by
// log-probability and sorts only the one bucket where the cut falls. A 248K vocabulary is never
// fully sorted.
//
// Which tokens may be chosen (a per-request token mask): ids below token_limit() (an embedding
// may have rows past the tokenizer's entries: padding the tokenizer cannot decode, 248,320 rows
// for 248,077 tokens in Qwen3.5/3.6), and of those, when set_allowed_tokens() gave a bitmask,
// only the ids whose bit is set. Outside the mask a token's logit counts as -inf from step 2 on:
// it is never drawn, never the argmax, and not in the reported top logprobs; logprobs are those
// of the masked distribution. Structured output (a grammar allowing some tokens per step) sets
// the bitmask before each step; the limit is fixed per request. The GPU sampler honours the
// limit (SampleArgs::vocab); a bitmask keeps sampling on the host (Engine::begin_device_decode).
//
// Exactness: weights are 64-bit fixed-point integers and the draw is an integer product
// (metal/sampling.h, shared with the GPU kernel metal/sampling.metal), and the draw walks the
// kept tokens in id order. So the result depends on the kept *set* only, and the GPU sampler,
// which finds the same set another way, picks the same token from the same logits and RNG state.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace lily {

struct SamplingParams {
  float temperature = 0.0f;         // 0 = greedy (argmax); else > 0
  int32_t top_k = 0;                // 0 = off
  float top_p = 1.0f;               // in (0, 1]; 1 = off
  float min_p = 0.0f;               // in [0, 1]; 0 = off
  float repetition_penalty = 1.0f;  // > 0; 1 = off
  float presence_penalty = 0.0f;    // finite; 0 = off
  float frequency_penalty = 0.0f;   // finite; 0 = off
  uint64_t seed = 0;
  int32_t top_logprobs = 0;         // how many (id, logprob) pairs SampleResult::top holds

  // Throws lily::RequestError naming the first bad parameter.
  void validate() const;
};

// A (token, value) pair: a logprob in SampleResult, a bias in set_logit_bias.
struct TokenLogprob {
  int32_t token;
  float logprob;
};

struct SampleResult {
  int32_t token = -1;
  float logprob = 0.0f;           // log p(token) under the penalized, untempered distribution
  std::vector<TokenLogprob> top;  // the top_logprobs most likely tokens, descending (ties: low id)
};

// xoshiro256** (Blackman & Vigna), seeded through splitmix64: small, fast, and the same stream on
// every platform, so a seed reproduces tokens across machines.
class Rng {
 public:
  explicit Rng(uint64_t seed);
  uint64_t next();
  // The generator's state (s[0..3]), e.g. to continue the stream on a GPU.
  const uint64_t* state() const { return s_; }
 private:
  uint64_t s_[4];
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);  // validates params

  // Token mask (see the top of this file). limit 0: every id of the row. bits: bit i of
  // bits[i / 32] allows token i; ids past the bits are not allowed; empty: no bitmask.
  void set_token_limit(int32_t limit);
  void set_allowed_tokens(std::vector<uint32_t> bits);
  // Logit bias (step 0 above): each entry's bias is added to its token's logit before anything
  // else. Biases must be finite; ids are checked against the row in sample(). Empty: none.
  void set_logit_bias(std::vector<TokenLogprob> bias);
  bool has_logit_bias() const { return !bias_.empty(); }
  int32_t token_limit() const { return token_limit_; }
  bool has_allowed_tokens() const { return !allowed_.empty(); }

  // Picks the next token from logits[0, vocab), within the token mask. logits is modified in
  // place (penalties applied, masked tokens set to -inf; its contents afterwards are
  // unspecified). penalty_tokens are the window the penalties see (ids in [0, vocab), repeats
  // count for the frequency penalty). out may be null.
  int32_t sample(float* logits, int32_t vocab, const int32_t* penalty_tokens,
                 size_t n_penalty_tokens, SampleResult* out = nullptr);

  const SamplingParams& params() const { return params_; }
  // True when a draw happens (temperature >= 1e-5); false: argmax.
  bool draws() const;
  // The derived constants the GPU sampler takes (metal/sampling_args.h), identical to the ones
  // sample() uses: 1 / T, T * log(min_p), top_p * 2^64.
  float inv_temperature() const { return 1.0f / params_.temperature; }
  float min_p_offset() const { return min_p_offset_; }
  uint64_t top_p_fixed() const { return top_p_fixed_; }
  const Rng& rng() const { return rng_; }
  // A device loop drew this sampler's next value on the GPU (one per drawn token): the host's
  // generator follows, so whatever samples next (the host, another loop) continues the stream.
  void skip_draw() { rng_.next(); }

 private:
  struct Candidate {
    float logit;  // penalized, not yet divided by the temperature (same order)
    int32_t id;
  };

  void apply_penalties(float* logits, int32_t vocab, const int32_t* tokens, size_t n);
  int32_t draw_all(const float* logits, int32_t vocab, float max_logit, float inv_t, float scale);
  int32_t draw_candidates(int32_t vocab, float max_logit, float inv_t, float scale);
  void cut_top_p(float max_logit, float inv_t, float scale);
  void gather_top_p(const float* logits, int32_t vocab, float max_logit, float inv_t, float scale);
  void fill_logprobs(const float* logits, int32_t vocab, float max_logit, int32_t token,
                     SampleResult* out);

  SamplingParams params_;
  int32_t token_limit_ = 0;
  std::vector<uint32_t> allowed_;
  std::vector<TokenLogprob> bias_;
  float min_p_offset_ = 0.0f;
  uint64_t top_p_fixed_ = 0;
  Rng rng_;
  // Scratch reused across calls so a decode step does not allocate.
  std::vector<Candidate> cand_;
  std::vector<Candidate> top_;
  std::vector<int32_t> sorted_tokens_;
  std::vector<float> weights_;
  std::vector<uint64_t> q_;
  std::vector<uint64_t> bucket_mass_;
  std::vector<uint8_t> kept_;
};

}  // namespace lily
