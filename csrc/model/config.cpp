#include "model/config.h"

#include "model/error.h"

namespace lily {

void ModelConfig::validate() const {
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) throw ConfigError("[config] " + model_type + ": " + what);
  };
  need(hidden > 0, "hidden_size must be positive");
  need(vocab > 0, "vocab_size must be positive");
  need(!mixers.empty(), "the model has no layers");
  need(mixers.size() == ffns.size(), "layer_types and the feed-forward schedule disagree in length");
  need(rms_eps > 0, "rms_norm_eps must be positive");
  bool any_attn = false, any_gdn = false, any_moe = false, any_dense = false;
  for (Mixer m : mixers) (m == Mixer::Attention ? any_attn : any_gdn) = true;
  for (Ffn f : ffns) (f == Ffn::Moe ? any_moe : any_dense) = true;
  if (any_attn) {
    need(n_heads > 0 && n_kv_heads > 0 && head_dim > 0, "attention head counts and head_dim must be positive");
    need(n_heads % n_kv_heads == 0, "num_attention_heads must be a multiple of num_key_value_heads");
    need(rotary_dim >= 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0,
         "rotary dimension (head_dim x partial_rotary_factor) must be even and at most head_dim");
    need(rope_theta > 0, "rope_theta must be positive");
  }
  if (any_gdn) {
    need(gdn_k_heads > 0 && gdn_v_heads > 0 && gdn_k_dim > 0 && gdn_v_dim > 0,
         "linear attention head counts and dims must be positive");
    need(gdn_v_heads % gdn_k_heads == 0, "linear_num_value_heads must be a multiple of linear_num_key_heads");
    need(conv_kernel >= 1 && conv_kernel <= 16, "linear_conv_kernel_dim must be in [1, 16]");
  }
  if (any_moe) {
    need(n_experts > 0 && top_k > 0 && top_k <= n_experts, "num_experts_per_tok must be in [1, num_experts]");
    need(moe_intermediate > 0, "moe_intermediate_size must be positive");
    need(shared_intermediate >= 0, "shared_expert_intermediate_size must be non-negative");
  }
  if (any_dense) need(intermediate > 0, "intermediate_size must be positive for dense MLP layers");
}

}  // namespace lily
