// Sampler implementation. See sampler.h for the order of operations and what logprobs mean.
//
// Numerics: every weight is exp(s) with s = (l - max) / T <= 0, from sample_exp_nonpos() in
// metal/sampling.h, a branch-free float exponential (Cody-Waite reduction + degree-7 polynomial,
// < 2 ulp) that the compiler vectorizes (libm's exp is ~40x slower per call inside a Python
// process, and this runs over 248K logits every decode step). For the draw and the top-p cut each
// weight becomes a 64-bit fixed-point integer (sample_weight), so sums are exact in any order:
// top-p keeps a token while the integer mass before it is below floor(top_p * Z), and the draw
// takes t = floor(r * total / 2^64) for 64 random bits r and walks the kept tokens in id order.
// The GPU kernel (metal/sampling.metal) does the same integer arithmetic from the same header, so
// both pick the same token. Against a float64 reference the weights differ by < 2 ulp plus a
// fixed-point step of 2^-45 of the best token's weight (at a 248K vocabulary).
//
// Candidate order everywhere is (logit descending, id ascending), so ties resolve to the lowest
// id for argmax, top-k, top-p and the reported top logprobs alike.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "model/error.h"
// The sampling arithmetic shared with the GPU kernel.
#include "metal/sampling.h"

namespace lily {

namespace {

// Better-first order of candidates: higher logit, then lower id.
struct Better {
  template <class C>
  bool operator()(const C& a, const C& b) const {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  }
};

// The k best tokens of logits[0, vocab), written to dst best-first. A bounded heap (O(V log k))
// for the usual small k; nth_element over all ids (O(V)) when k is large.
template <class C>
void select_top(const float* logits, int32_t vocab, int32_t k, std::vector<C>& dst) {
  dst.clear();
  if (k <= 0) return;
  if (k >= vocab) {
    for (int32_t i = 0; i < vocab; ++i) dst.push_back({logits[i], i});
  } else if (k <= 1024) {
    // Min-heap on "Better": the front is the worst of the k kept so far.
    Better better;
    for (int32_t i = 0; i < vocab; ++i) {
      C c{logits[i], i};
      if (static_cast<int32_t>(dst.size()) < k) {
        dst.push_back(c);
        std::push_heap(dst.begin(), dst.end(), better);
      } else if (better(c, dst.front())) {
        std::pop_heap(dst.begin(), dst.end(), better);
        dst.back() = c;
        std::push_heap(dst.begin(), dst.end(), better);
      }
    }
  } else {
    dst.resize(vocab);
    for (int32_t i = 0; i < vocab; ++i) dst[i] = {logits[i], i};
    std::nth_element(dst.begin(), dst.begin() + (k - 1), dst.end(), Better{});
    dst.resize(k);
  }
  std::sort(dst.begin(), dst.end(), Better{});
}

// w[i] = exp((l[i] - max) * inv_t) for i < n; returns their sum (double, four partial sums):
// the log-sum-exp of the logprobs.
double exp_weights(const float* l, size_t n, float max, float inv_t, float* w) {
  for (size_t i = 0; i < n; ++i) w[i] = sample_exp_nonpos((l[i] - max) * inv_t);
  double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a0 += w[i];
    a1 += w[i + 1];
    a2 += w[i + 2];
    a3 += w[i + 3];
  }
  for (; i < n; ++i) a0 += w[i];
  return (a0 + a1) + (a2 + a3);
}

// q[i] = the integer weight of l[i] (sample_weight) for i < n; returns their exact sum.
uint64_t int_weights(const float* l, size_t n, float max, float inv_t, float scale, uint64_t* q) {
  for (size_t i = 0; i < n; ++i) q[i] = sample_weight(l[i], max, inv_t, scale);
  uint64_t z = 0;
  for (size_t i = 0; i < n; ++i) z += q[i];
  return z;
}

// The top-p target: floor(top_p * z), at least 1 so that the best token always stays.
uint64_t top_p_target(uint64_t z, uint64_t top_p_fixed) {
  return std::max<uint64_t>(sample_mulhi(z, top_p_fixed), 1);
}

std::string fmt(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Parameters

void SamplingParams::validate() const {
  auto bad = [](const std::string& name, const std::string& rule, double v) {
    throw RequestError("[sampling] " + name + " " + rule + ", got " + fmt(v));
  };
  if (!std::isfinite(temperature) || temperature < 0) bad("temperature", "must be >= 0", temperature);
  if (top_k < 0) bad("top_k", "must be >= 0 (0 = off)", top_k);
  if (!(top_p > 0 && top_p <= 1)) bad("top_p", "must be in (0, 1]", top_p);
  if (!(min_p >= 0 && min_p <= 1)) bad("min_p", "must be in [0, 1]", min_p);
  if (!std::isfinite(repetition_penalty) || repetition_penalty <= 0)
    bad("repetition_penalty", "must be > 0 (1 = off)", repetition_penalty);
  if (!std::isfinite(presence_penalty)) bad("presence_penalty", "must be finite", presence_penalty);
  if (!std::isfinite(frequency_penalty)) bad("frequency_penalty", "must be finite", frequency_penalty);
  if (top_logprobs < 0 || top_logprobs > 1024) bad("top_logprobs", "must be in [0, 1024]", top_logprobs);
}

// ---------------------------------------------------------------------------------------------
// Rng: xoshiro256**, state filled by splitmix64 so any 64-bit seed (even 0) gives a good state.

Rng::Rng(uint64_t seed) {
  uint64_t x = seed;
  for (auto& s : s_) {
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    s = z ^ (z >> 31);
  }
}

uint64_t Rng::next() { return sample_rng_next(s_); }

// ---------------------------------------------------------------------------------------------
// Sampler

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
  params_.validate();
  // p_i >= min_p * p_max  <=>  l_i >= max + T log(min_p): a threshold on the logits, so no
  // exponentials. The offset is rounded to float once, here; the GPU sampler gets this value.
  if (params_.min_p > 0)
    min_p_offset_ = static_cast<float>(static_cast<double>(params_.temperature) * std::log(static_cast<double>(params_.min_p)));
  // top_p * 2^64 is exact in double (a float has 24 significant bits) and below 2^64 for top_p < 1.
  if (params_.top_p < 1.0f) top_p_fixed_ = static_cast<uint64_t>(std::ldexp(static_cast<double>(params_.top_p), 64));
}

void Sampler::set_token_limit(int32_t limit) {
  if (limit < 0) throw RequestError("[sampling] token limit must be >= 0 (0 = none), got " + std::to_string(limit));
  token_limit_ = limit;
}

void Sampler::set_allowed_tokens(std::vector<uint32_t> bits) { allowed_ = std::move(bits); }

void Sampler::set_logit_bias(std::vector<TokenLogprob> bias) {
  for (const auto& b : bias) {
    if (b.token < 0) throw RequestError("[sampling] logit bias token " + std::to_string(b.token) + " is negative");
    if (!std::isfinite(b.logprob))
      throw RequestError("[sampling] logit bias of token " + std::to_string(b.token) + " must be finite, got " +
                         fmt(b.logprob));
  }
  bias_ = std::move(bias);
}

// Temperatures this small are greedy in all but name; below it 1/T stops being usable.
constexpr float kMinTemperature = 1e-5f;

bool Sampler::draws() const { return params_.temperature >= kMinTemperature; }

void Sampler::apply_penalties(float* logits, int32_t vocab, const int32_t* tokens, size_t n) {
  const float rep = params_.repetition_penalty;
  const float pres = params_.presence_penalty;
  const float freq = params_.frequency_penalty;
  if (n == 0 || (rep == 1.0f && pres == 0.0f && freq == 0.0f)) return;
  // Sort a copy of the window so each distinct token is visited once with its count; windows
  // are short (tens to thousands of ids), so this is cheaper than a vocab-sized counter.
  sorted_tokens_.assign(tokens, tokens + n);
  std::sort(sorted_tokens_.begin(), sorted_tokens_.end());
  if (sorted_tokens_.front() < 0 || sorted_tokens_.back() >= vocab) {
    int32_t t = sorted_tokens_.front() < 0 ? sorted_tokens_.front() : sorted_tokens_.back();
    throw RequestError("[sampling] penalty token " + std::to_string(t) +
                       " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  }
  for (size_t i = 0; i < n;) {
    size_t j = i;
    while (j < n && sorted_tokens_[j] == sorted_tokens_[i]) ++j;
    const int32_t t = sorted_tokens_[i];
    const float count = static_cast<float>(j - i);
    float l = logits[t];
    if (rep != 1.0f) l = l > 0 ? l / rep : l * rep;
    l -= pres + freq * count;
    logits[t] = l;
    i = j;
  }
}

// Cuts cand_ (the top-k set, sorted best-first) to the tokens whose mass before them (integer
// weights, within the set) is below floor(top_p * the set's mass).
void Sampler::cut_top_p(float max_logit, float inv_t, float scale) {
  uint64_t z = 0;
  for (const auto& c : cand_) z += sample_weight(c.logit, max_logit, inv_t, scale);
  const uint64_t target = top_p_target(z, top_p_fixed_);
  uint64_t cum = 0;
  size_t keep = 0;
  while (keep < cand_.size() && cum < target) cum += sample_weight(cand_[keep++].logit, max_logit, inv_t, scale);
  cand_.resize(keep);
}

// Top-p over the whole vocabulary in O(V), never sorting it. Tokens fall into buckets of width
// 1/kScale nat by their scaled logit s = (l - max) / T <= 0 (bucket 0 holds the best; the last
// bucket everything below -kBuckets/kScale). Buckets are ordered like the tokens, so summing
// bucket masses from the top finds the bucket B where the cumulative mass crosses top_p * Z:
// buckets before B are kept whole, and only B's tokens are sorted to place the exact cut.
void Sampler::gather_top_p(const float* logits, int32_t vocab, float max_logit, float inv_t, float scale) {
  constexpr int32_t kBuckets = 4096;
  constexpr float kScale = 64.0f;  // buckets per nat: s in [-64, 0] is resolved
  auto bucket = [&](float l) {
    const float x = (max_logit - l) * inv_t * kScale;  // >= 0, monotone in l
    return x < static_cast<float>(kBuckets - 1) ? static_cast<int32_t>(x) : kBuckets - 1;
  };
  q_.resize(vocab);
  const uint64_t target = top_p_target(int_weights(logits, vocab, max_logit, inv_t, scale, q_.data()), top_p_fixed_);
  bucket_mass_.assign(kBuckets, 0);
  for (int32_t i = 0; i < vocab; ++i) bucket_mass_[bucket(logits[i])] += q_[i];
  // Every token of a bucket before `cut` has less than target before it; bucket `cut` holds the
  // boundary (cum < target is the mass before it).
  uint64_t cum = 0;
  int32_t cut = 0;
  while (cut < kBuckets - 1 && cum + bucket_mass_[cut] < target) cum += bucket_mass_[cut++];
  cand_.clear();
  top_.clear();
  for (int32_t i = 0; i < vocab; ++i) {
    const int32_t b = bucket(logits[i]);
    if (b < cut) cand_.push_back({logits[i], i});
    else if (b == cut) top_.push_back({logits[i], i});
  }
  std::sort(top_.begin(), top_.end(), Better{});
  size_t keep = 0;
  while (keep < top_.size() && cum < target) {
    cum += q_[top_[keep].id];
    cand_.push_back(top_[keep++]);
  }
}

// One draw over the whole vocabulary (no truncation): t = floor(r * total / 2^64), then the
// token whose interval of the running sum (id order) holds t.
int32_t Sampler::draw_all(const float* logits, int32_t vocab, float max_logit, float inv_t, float scale) {
  q_.resize(vocab);
  const uint64_t t = sample_mulhi(rng_.next(), int_weights(logits, vocab, max_logit, inv_t, scale, q_.data()));
  uint64_t cum = 0;
  for (int32_t i = 0; i < vocab; ++i) {
    cum += q_[i];
    if (t < cum) return i;
  }
  throw Error("[sampling] internal: draw past the total mass");
}

// One draw over cand_ (the kept set, any order), walked in id order: sorted when small, else
// through a vocab-sized mark so that no large set is sorted.
int32_t Sampler::draw_candidates(int32_t vocab, float max_logit, float inv_t, float scale) {
  uint64_t total = 0;
  for (const auto& c : cand_) total += sample_weight(c.logit, max_logit, inv_t, scale);
  const uint64_t t = sample_mulhi(rng_.next(), total);
  uint64_t cum = 0;
  if (cand_.size() <= 4096) {
    std::sort(cand_.begin(), cand_.end(), [](const Candidate& a, const Candidate& b) { return a.id < b.id; });
    for (const auto& c : cand_) {
      cum += sample_weight(c.logit, max_logit, inv_t, scale);
      if (t < cum) return c.id;
    }
  } else {
    kept_.assign(vocab, 0);
    weights_.resize(vocab);
    for (const auto& c : cand_) {
      kept_[c.id] = 1;
      weights_[c.id] = c.logit;
    }
    for (int32_t i = 0; i < vocab; ++i) {
      if (!kept_[i]) continue;
      cum += sample_weight(weights_[i], max_logit, inv_t, scale);
      if (t < cum) return i;
    }
  }
  throw Error("[sampling] internal: draw past the total mass");
}

void Sampler::fill_logprobs(const float* logits, int32_t vocab, float max_logit, int32_t token,
                            SampleResult* out) {
  weights_.resize(vocab);
  const double lse = max_logit + std::log(exp_weights(logits, vocab, max_logit, 1.0f, weights_.data()));
  out->token = token;
  out->logprob = static_cast<float>(logits[token] - lse);
  select_top(logits, vocab, std::min(params_.top_logprobs, vocab), top_);
  out->top.clear();
  for (const auto& c : top_)  // masked tokens (-inf) are not alternatives
    if (c.logit != -std::numeric_limits<float>::infinity()) out->top.push_back({c.id, static_cast<float>(c.logit - lse)});
}

int32_t Sampler::sample(float* logits, int32_t vocab, const int32_t* penalty_tokens,
                        size_t n_penalty_tokens, SampleResult* out) {
  if (vocab <= 0) throw RequestError("[sampling] vocab must be > 0, got " + std::to_string(vocab));
  for (const auto& b : bias_) {
    if (b.token >= vocab)
      throw RequestError("[sampling] logit bias token " + std::to_string(b.token) + " is outside the vocabulary [0, " +
                         std::to_string(vocab) + ")");
    logits[b.token] += b.logprob;
  }
  apply_penalties(logits, vocab, penalty_tokens, n_penalty_tokens);
  // The token mask: rows past the limit are not candidates at all (the GPU sampler reads the
  // same prefix, so both derive the same fixed-point scale from it); bits mask within it.
  if (token_limit_ > 0 && token_limit_ < vocab) vocab = token_limit_;
  if (!allowed_.empty()) {
    const int32_t covered = int32_t(std::min<size_t>(size_t(vocab), allowed_.size() * 32));
    for (int32_t i = 0; i < covered; ++i)
      if (!(allowed_[size_t(i) >> 5] >> (i & 31) & 1u)) logits[i] = -std::numeric_limits<float>::infinity();
    for (int32_t i = covered; i < vocab; ++i) logits[i] = -std::numeric_limits<float>::infinity();
  }

  // One pass: the maximum (lowest id on ties, hence strict >) and a check for bad numbers.
  float max_logit = -std::numeric_limits<float>::infinity();
  int32_t argmax = -1;
  for (int32_t i = 0; i < vocab; ++i) {
    const float x = logits[i];
    if (std::isnan(x) || x == std::numeric_limits<float>::infinity())
      throw Error("[sampling] logit of token " + std::to_string(i) + " is " + fmt(x));
    if (x > max_logit) {
      max_logit = x;
      argmax = i;
    }
  }
  if (argmax < 0 && !allowed_.empty()) throw RequestError("[sampling] the token mask allows no token");
  if (argmax < 0) throw Error("[sampling] every logit is -inf");

  int32_t token = argmax;
  if (draws()) {
    const float inv_t = inv_temperature();
    const float scale = sample_weight_scale(static_cast<uint32_t>(vocab));
    const int32_t k = params_.top_k;
    const bool use_k = k > 0 && k < vocab;
    const bool use_p = params_.top_p < 1.0f;
    const bool use_min_p = params_.min_p > 0.0f;
    cand_.clear();
    if (use_k) {
      select_top(logits, vocab, k, cand_);
      if (use_p) cut_top_p(max_logit, inv_t, scale);
    } else if (use_p) {
      gather_top_p(logits, vocab, max_logit, inv_t, scale);
    }
    if (use_min_p) {
      const float floor = max_logit + min_p_offset_;  // the best token always stays
      if (!use_k && !use_p) {
        for (int32_t i = 0; i < vocab; ++i)
          if (logits[i] >= floor) cand_.push_back({logits[i], i});
      } else {
        cand_.erase(std::remove_if(cand_.begin(), cand_.end(), [&](const Candidate& c) { return c.logit < floor; }),
                    cand_.end());
      }
    }
    token = use_k || use_p || use_min_p ? draw_candidates(vocab, max_logit, inv_t, scale)
                                        : draw_all(logits, vocab, max_logit, inv_t, scale);
  }
  if (out) fill_logprobs(logits, vocab, max_logit, token, out);
  return token;
}

}  // namespace lily
