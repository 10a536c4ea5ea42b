#include "model/schedule.h"

#include "model/error.h"

namespace lily {

namespace {

// logits[i] = head(last row of segment i). The wanted rows form runs of consecutive rows (a run
// breaks only before a segment of more than one row), and each run is one lm_head call, so the
// head's weights are read once per run: once when the multi-row segments come first
// (Engine::step orders them so).
void last_rows_head(Backend& be, const Linear& head, Segments segs, int vocab, float* logits) {
  for (int i = 0; i < segs.size();) {
    int j = i + 1;
    while (j < segs.size() && segs[j].n == 1) ++j;  // segment j's last row follows segment j-1's
    const int first = segs[i].first + segs[i].n - 1;
    be.lm_head(head, first, j - i, logits + size_t(i) * vocab);
    i = j;
  }
}

}  // namespace

// Pre-norm residual blocks: x += mixer(norm(x)); x += ffn(norm(x)). Each residual add is fused
// with the norm that follows it, so the stream is read once per block.
void forward_pass(Backend& be, const ModelWeights& w, Segments segs, const int32_t* tokens, LogitRows rows,
                  float* logits) {
  const ModelConfig& c = w.config;
  if (segs.size() < 1) throw Error("[schedule] a pass needs at least one segment");
  int next = 0;
  for (const SeqRows& s : segs) {
    if (!s.state || s.first != next || s.n < 1) throw Error("[schedule] a pass's segments must be back to back from row 0");
    next += s.n;
  }
  const int T = segs.rows();
  be.embed(segs, tokens);
  for (int l = 0; l < c.n_layers(); ++l) {
    const LayerWeights& L = w.layers[l];
    if (l == 0) be.rms_norm(L.input_norm);
    else be.add_rms_norm(L.input_norm);

    if (c.mixers[l] == Mixer::Attention) be.attention(segs, l, L.attn);
    else be.gated_deltanet(segs, l, L.gdn);

    be.add_rms_norm(L.post_norm);
    if (c.ffns[l] == Ffn::Moe) be.moe(L.moe);
    else be.mlp(L.mlp);
  }
  be.add_rms_norm(w.final_norm);
  if (rows == LogitRows::All) be.lm_head(w.lm_head, 0, T, logits);
  else if (rows == LogitRows::Last) last_rows_head(be, w.lm_head, segs, c.vocab, logits);
}

void forward_chunk(Backend& be, const ModelWeights& w, State& st, const int32_t* tokens, int T, LogitRows rows,
                   float* logits) {
  const SeqRows seg{&st, 0, T};
  forward_pass(be, w, Segments{&seg, 1}, tokens, rows, logits);
}

}  // namespace lily
