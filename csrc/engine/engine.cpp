#include "engine/engine.h"

#include <algorithm>
#include <string>

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
  return st;
}

void Engine::check_tokens(const State& st, const int32_t* tokens, int n) const {
  if (n < 0) throw RequestError("[engine] negative token count");
  if (int64_t(st.position()) + n > st.max_context())
    throw RequestError("[engine] " + std::to_string(st.position()) + " cached + " + std::to_string(n) +
                       " new tokens exceed the context of " + std::to_string(st.max_context()));
  const int vocab = config().vocab;
  for (int i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab)
      throw RequestError("[engine] token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                         " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
}

void Engine::prefill(State& st, const int32_t* tokens, int n, float* logits, bool all_logits) {
  check_tokens(st, tokens, n);
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
    forward_chunk(*backend_, *weights_, st, tokens + done, T, rows, out);
    st.position_ += T;
    done += T;
  }
}

void Engine::decode(State& st, int32_t token, float* logits) {
  check_tokens(st, &token, 1);
  forward_chunk(*backend_, *weights_, st, &token, 1, logits ? LogitRows::Last : LogitRows::None, logits);
  st.position_ += 1;
}

}  // namespace lily
