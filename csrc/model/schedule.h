// The Qwen3.5 / Qwen3.6 / Qwen3-Next layer schedule, written once for every backend.
#pragma once
#include <cstdint>

#include "model/backend.h"

namespace lily {

// Which rows' logits a pass writes: none, the last row of each segment ([segments, vocab]), or
// every row ([T, vocab]).
enum class LogitRows { None, Last, All };

// Runs one pass of segs.rows() tokens, each segment from its state's position (segments back to
// back from row 0: see Segments; more than one only where be.batches()); writes the requested
// logits. Does not advance any position (the engine does).
void forward_pass(Backend& be, const ModelWeights& w, Segments segs, const int32_t* tokens, LogitRows rows,
                  float* logits);

// One sequence: T tokens from st.position() ([1, vocab] logits for Last).
void forward_chunk(Backend& be, const ModelWeights& w, State& st, const int32_t* tokens, int T, LogitRows rows,
                   float* logits);

}  // namespace lily
