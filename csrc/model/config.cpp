#include "model/config.h"

#include <algorithm>
#include <cmath>

#include "model/checked.h"
#include "model/error.h"

namespace lily {

std::vector<float> ModelConfig::rope_inv_freq() const {
  const int half = rotary_dim / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    // f32 rounding of the exponent and of the result, as transformers computes inv_freq.
    const float extrapolated = float(1.0 / std::pow(rope_theta, double(float(2 * i) / float(rotary_dim))));
    if (yarn_factor == 1.0) {
      inv[i] = extrapolated;
      continue;
    }
    const float interpolated = float(1.0 / (yarn_factor * std::pow(rope_theta, double(float(2 * i) / float(rotary_dim)))));
    // transformers widens an empty range by 0.001 (its "prevent singularity").
    const double span = yarn_high == yarn_low ? 0.001 : yarn_high - yarn_low;
    const float ramp = float(std::min(1.0, std::max(0.0, (double(i) - yarn_low) / span)));
    const float keep = 1.0f - ramp;  // share of the extrapolated (unscaled) frequency
    inv[i] = interpolated * (1.0f - keep) + extrapolated * keep;
  }
  return inv;
}

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
  // Every size the core derives from these fields, computed in 64 bits: each must fit the int it
  // is stored in (a matrix's rows and columns, a conv's taps).
  auto dim = [&](int64_t v, const std::string& what) { checked_dim(v, model_type + ": " + what); };
  if (any_attn) {
    need(n_heads > 0 && n_kv_heads > 0 && head_dim > 0, "attention head counts and head_dim must be positive");
    need(n_heads % n_kv_heads == 0, "num_attention_heads must be a multiple of num_key_value_heads");
    need(rotary_dim >= 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0,
         "rotary dimension (head_dim x partial_rotary_factor) must be even and at most head_dim");
    need(rope_theta > 0, "rope_theta must be positive");
    need(yarn_factor >= 1.0 && yarn_low >= 0.0 && yarn_high >= yarn_low && rope_attention_factor > 0.0,
         "YaRN rope_scaling needs factor >= 1, a correction range low <= high and a positive attention factor");
    dim(checked_mul(checked_mul(2, n_heads, "q_proj rows"), head_dim, "q_proj rows"),
        "q_proj rows (2 x num_attention_heads x head_dim)");
    dim(checked_mul(n_kv_heads, head_dim, "k_proj rows"), "k_proj rows (num_key_value_heads x head_dim)");
  }
  if (any_gdn) {
    need(gdn_k_heads > 0 && gdn_v_heads > 0 && gdn_k_dim > 0 && gdn_v_dim > 0,
         "linear attention head counts and dims must be positive");
    need(gdn_v_heads % gdn_k_heads == 0, "linear_num_value_heads must be a multiple of linear_num_key_heads");
    need(conv_kernel >= 1 && conv_kernel <= 16, "linear_conv_kernel_dim must be in [1, 16]");
    const int64_t key = checked_mul(gdn_k_heads, gdn_k_dim, "linear attention key dim");
    const int64_t value = checked_mul(gdn_v_heads, gdn_v_dim, "linear attention value dim");
    const int64_t qkv = checked_add(checked_mul(2, key, "in_proj_qkv rows"), value, "in_proj_qkv rows");
    dim(checked_add(qkv, value, "in_proj_qkvz rows"),
        "in_proj_qkvz rows (2 x linear_num_key_heads x linear_key_head_dim + 2 x value dim)");
    dim(checked_mul(qkv, conv_kernel, "conv1d taps"), "conv1d taps (in_proj_qkv rows x linear_conv_kernel_dim)");
    dim(checked_mul(2, gdn_v_heads, "in_proj_ba rows"), "in_proj_ba rows (2 x linear_num_value_heads)");
    // Qwen3-Next's grouped qkvz block per key head (cpu/gdn.cpp).
    dim(checked_add(checked_mul(2, gdn_k_dim, "qkvz group"),
                    checked_mul(checked_mul(2, gdn_v_heads / gdn_k_heads, "qkvz group"), gdn_v_dim, "qkvz group"),
                    "qkvz group"),
        "a key head's qkvz group (2 x linear_key_head_dim + 2 x value heads per key head x linear_value_head_dim)");
  }
  if (any_moe) {
    need(n_experts > 0 && top_k > 0 && top_k <= n_experts, "num_experts_per_tok must be in [1, num_experts]");
    need(moe_intermediate > 0, "moe_intermediate_size must be positive");
    need(shared_intermediate >= 0, "shared_expert_intermediate_size must be non-negative");
  }
  if (any_dense) need(intermediate > 0, "intermediate_size must be positive for dense MLP layers");
}

}  // namespace lily
