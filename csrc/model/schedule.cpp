#include "model/schedule.h"

namespace lily {

// Pre-norm residual blocks: x += mixer(norm(x)); x += ffn(norm(x)). Each residual add is fused
// with the norm that follows it, so the stream is read once per block.
void forward_chunk(Backend& be, const ModelWeights& w, State& st, const int32_t* tokens, int T,
                   LogitRows rows, float* logits) {
  const ModelConfig& c = w.config;
  be.embed(st, tokens, T);
  for (int l = 0; l < c.n_layers(); ++l) {
    const LayerWeights& L = w.layers[l];
    if (l == 0) be.rms_norm(L.input_norm);
    else be.add_rms_norm(L.input_norm);

    if (c.mixers[l] == Mixer::Attention) be.attention(st, l, L.attn);
    else be.gated_deltanet(st, l, L.gdn);

    be.add_rms_norm(L.post_norm);
    if (c.ffns[l] == Ffn::Moe) be.moe(L.moe);
    else be.mlp(L.mlp);
  }
  be.add_rms_norm(w.final_norm);
  if (rows == LogitRows::All) be.lm_head(w.lm_head, 0, T, logits);
  else if (rows == LogitRows::Last) be.lm_head(w.lm_head, T - 1, 1, logits);
}

}  // namespace lily
