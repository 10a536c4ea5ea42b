// lily._core.SamplingParams / lily._core.Sampler: the native sampler (csrc/engine/sampler.h)
// exposed for tests and for Python-side generation loops. sample() copies the logits (the
// caller's array is left untouched) and runs with the GIL released.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <cstdio>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "model/error.h"
#include "python/bindings.h"

namespace lily::python {

using namespace nb::literals;

void init_sampler(nb::module_& m) {
  nb::class_<SamplingParams>(m, "SamplingParams",
                             "Sampling parameters (see docs/api-generation.md for their order).")
      .def(
          "__init__",
          [](SamplingParams* p, float temperature, int32_t top_k, float top_p, float min_p,
             float repetition_penalty, float presence_penalty, float frequency_penalty,
             uint64_t seed, int32_t top_logprobs) {
            new (p) SamplingParams{temperature,      top_k,           top_p,
                                   min_p,            repetition_penalty, presence_penalty,
                                   frequency_penalty, seed,           top_logprobs};
          },
          "temperature"_a = 0.0f, "top_k"_a = 0, "top_p"_a = 1.0f, "min_p"_a = 0.0f,
          "repetition_penalty"_a = 1.0f, "presence_penalty"_a = 0.0f,
          "frequency_penalty"_a = 0.0f, "seed"_a = 0, "top_logprobs"_a = 0)
      .def_rw("temperature", &SamplingParams::temperature)
      .def_rw("top_k", &SamplingParams::top_k)
      .def_rw("top_p", &SamplingParams::top_p)
      .def_rw("min_p", &SamplingParams::min_p)
      .def_rw("repetition_penalty", &SamplingParams::repetition_penalty)
      .def_rw("presence_penalty", &SamplingParams::presence_penalty)
      .def_rw("frequency_penalty", &SamplingParams::frequency_penalty)
      .def_rw("seed", &SamplingParams::seed)
      .def_rw("top_logprobs", &SamplingParams::top_logprobs)
      .def("validate", &SamplingParams::validate, "Raise lily.RequestError on a bad parameter.")
      .def("__repr__", [](const SamplingParams& p) {
        char buf[320];
        std::snprintf(buf, sizeof buf,
                      "SamplingParams(temperature=%g, top_k=%d, top_p=%g, min_p=%g, "
                      "repetition_penalty=%g, presence_penalty=%g, frequency_penalty=%g, "
                      "seed=%llu, top_logprobs=%d)",
                      p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty,
                      p.presence_penalty, p.frequency_penalty,
                      static_cast<unsigned long long>(p.seed), p.top_logprobs);
        return std::string(buf);
      });

  using Logits = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
  using Tokens = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

  using Bits = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

  nb::class_<Sampler>(m, "Sampler", "Seeded sampler over one row of logits at a time.")
      .def(
          "__init__",
          [](Sampler* s, const SamplingParams& params, int32_t token_limit) {
            new (s) Sampler(params);
            s->set_token_limit(token_limit);
          },
          "params"_a, "token_limit"_a = 0,
          "token_limit: only ids below it are ever chosen (0: every id of the logits row).")
      .def_prop_ro("token_limit", &Sampler::token_limit)
      .def(
          "set_allowed_tokens",
          [](Sampler& s, std::optional<Bits> bits) {
            s.set_allowed_tokens(bits ? std::vector<uint32_t>(bits->data(), bits->data() + bits->shape(0))
                                      : std::vector<uint32_t>{});
          },
          "bits"_a.none(),
          "A per-step token mask: uint32 words, bit i of word i // 32 allows token i (ids past them are "
          "not allowed); None removes it. Requests with a mask sample on the host.")
      .def(
          "set_logit_bias",
          [](Sampler& s, const std::vector<std::pair<int32_t, float>>& bias) {
            std::vector<TokenLogprob> v;
            v.reserve(bias.size());
            for (const auto& [token, value] : bias) v.push_back({token, value});
            s.set_logit_bias(std::move(v));
          },
          "bias"_a,
          "OpenAI's logit_bias as [(token, bias), ...]: each bias is added to its token's logit before "
          "penalties and sampling (empty: none). Requests with a bias sample on the host.")
      .def_prop_ro("has_logit_bias", &Sampler::has_logit_bias)
      .def_prop_ro("params", &Sampler::params)
      .def_prop_ro("rng_state", [](const Sampler& s) {
        const uint64_t* st = s.rng().state();
        return std::vector<uint64_t>(st, st + 4);
      }, "The xoshiro256** state [4] the next draw starts from (what a GPU loop continues).")
      .def_prop_ro("device_constants", [](const Sampler& s) {
        return nb::make_tuple(s.draws(), s.inv_temperature(), s.min_p_offset(), s.top_p_fixed());
      }, "(draws, 1/T, T*log(min_p), top_p*2^64): the constants the GPU sampler takes.")
      .def(
          "sample",
          [](Sampler& s, Logits logits, std::optional<Tokens> penalty_tokens) {
            if (logits.shape(0) == 0 || logits.shape(0) > INT32_MAX)
              throw RequestError("[sampling] logits must hold 1 .. 2^31-1 values, got " +
                                 std::to_string(logits.shape(0)));
            std::vector<float> work(logits.data(), logits.data() + logits.shape(0));
            std::vector<int32_t> window;
            if (penalty_tokens)
              window.assign(penalty_tokens->data(), penalty_tokens->data() + penalty_tokens->shape(0));
            SampleResult r;
            {
              nb::gil_scoped_release release;
              s.sample(work.data(), static_cast<int32_t>(work.size()), window.data(), window.size(),
                       &r);
            }
            nb::list top;
            for (const auto& t : r.top) top.append(nb::make_tuple(t.token, t.logprob));
            return nb::make_tuple(r.token, r.logprob, top);
          },
          "logits"_a, "penalty_tokens"_a = nb::none(),
          "Sample one token from float32 logits [vocab]; penalty_tokens is an int32 array (the "
          "penalty window). Returns (token, logprob, [(id, logprob), ...top_logprobs]).");
}

}  // namespace lily::python
