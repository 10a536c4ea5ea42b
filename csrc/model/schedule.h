// The Qwen3.5 / Qwen3.6 / Qwen3-Next layer schedule, written once for every backend.
#pragma once
#include <cstdint>

#include "model/backend.h"

namespace lily {

enum class LogitRows { None, Last, All };

// Runs T tokens through the model from st.position(); writes logits for the requested rows
// ([1, vocab] for Last, [T, vocab] for All). Does not advance the position (the engine does).
void forward_chunk(Backend& be, const ModelWeights& w, State& st, const int32_t* tokens, int T,
                   LogitRows rows, float* logits);

}  // namespace lily
