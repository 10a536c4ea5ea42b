// Activations: see activations.h.
#include "gpu/activations.h"

#include <algorithm>

#include "gpu/encode.h"

namespace lily::gpu {

void Activations::grow(std::shared_ptr<Buffer>& b, size_t bytes) {
  bytes = std::max<size_t>(bytes, 16);
  if (!b || b->length() < bytes) b = device_.new_buffer(bytes);
}

void Activations::size_for(int T, int segments) {
  const size_t H = c_.hidden, Hq = c_.n_heads, Hkv = c_.n_kv_heads, D = c_.head_dim;
  const size_t C = c_.gdn_qkv_dim(), vdim = c_.gdn_value_dim(), Hv = c_.gdn_v_heads;
  const size_t I = std::max(c_.moe_intermediate, c_.intermediate), topk = std::max(c_.top_k, 1);
  const size_t f = 4 * size_t(T);
  grow(tokens, f);
  grow(x, f * H);
  grow(h, f * H);
  grow(y, f * H);
  grow(qg, f * Hq * 2 * D);
  grow(k, f * Hkv * D);
  grow(v, f * Hkv * D);
  grow(o, f * Hq * D);
  const AttnPartialBytes slice = attn_partial_bytes(Hq, D, max_splits_);
  grow(part_o, size_t(std::max(segments, 1)) * slice.o);
  grow(part_ml, size_t(std::max(segments, 1)) * slice.ml);
  grow(qkv, f * C);
  grow(qkvz, f * (C + vdim));
  grow(z, f * vdim);
  grow(b, f * Hv);
  grow(a, f * Hv);
  grow(ba, f * 2 * Hv);
  grow(conv_out, f * C);
  grow(go, f * vdim);
  grow(gdn_gates, f * Hv * 2);
  grow(router, f * std::max(c_.n_experts, 1));
  grow(ids, f * topk);
  grow(wts, f * topk);
  grow(act, f * topk * I);
  grow(act_s, f * std::max(c_.shared_intermediate, 1));
  grow(sgate, f);
  if (!zeros || zeros->length() < f) {
    grow(zeros, f);
    zeros->fill(0, 0, zeros->length());
  }
}

}  // namespace lily::gpu
