// The model's shape, as the native core sees it. Parsed from config.json by lily/config.py
// (which handles the three families' spellings: qwen3_5_moe, qwen3_5, qwen3_next) and checked
// again here, because every buffer size and loop bound in the core derives from these numbers.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace lily {

enum class Mixer : uint8_t { GatedDeltaNet, Attention };
enum class Ffn : uint8_t { Dense, Moe };

struct ModelConfig {
  std::string model_type;
  int hidden = 0;
  int vocab = 0;
  int max_position = 0;
  float rms_eps = 1e-6f;
  std::vector<Mixer> mixers;  // one per layer
  std::vector<Ffn> ffns;      // one per layer

  // Gated attention.
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int rotary_dim = 0;  // leading dims of each head that get RoPE (rotate-half)
  double rope_theta = 10000.0;
  // YaRN (rope_type "yarn", transformers' _compute_yarn_parameters): frequency i of the rotary
  // dims is interpolated (divided by yarn_factor) by the ramp clamp((i - low) / (high - low), 0, 1);
  // yarn_factor 1 is plain RoPE. The attention factor scales the rotated dims of q and k (folded
  // into the q/k norm gains at load, as mlx-lm's YarnRoPE scales them before rotating).
  double yarn_factor = 1.0;
  double yarn_low = 0.0, yarn_high = 0.0;  // correction range, in frequency indices
  double rope_attention_factor = 1.0;

  // Gated DeltaNet.
  int gdn_k_heads = 0;
  int gdn_v_heads = 0;
  int gdn_k_dim = 0;
  int gdn_v_dim = 0;
  int conv_kernel = 0;
  bool gdn_fused_qkvz = false;  // Qwen3-Next: in_proj_qkvz / in_proj_ba grouped per key head

  // Feed-forward.
  int intermediate = 0;  // dense MLP
  int n_experts = 0;
  int top_k = 0;
  int moe_intermediate = 0;
  int shared_intermediate = 0;  // 0: no shared expert
  bool norm_topk_prob = true;

  int n_layers() const { return int(mixers.size()); }
  // Dimensions derived from the fields. Products of untrusted numbers: validate() checks each in
  // 64 bits and refuses a config where one does not fit in an int (model/checked.h), so these
  // narrowings are exact on any validated config.
  int attn_q_dim() const { return int(int64_t(n_heads) * head_dim); }      // queries, attention output
  int attn_kv_dim() const { return int(int64_t(n_kv_heads) * head_dim); }  // keys, values
  int gdn_key_dim() const { return int(int64_t(gdn_k_heads) * gdn_k_dim); }
  int gdn_value_dim() const { return int(int64_t(gdn_v_heads) * gdn_v_dim); }
  int gdn_qkv_dim() const { return int(2 * int64_t(gdn_key_dim()) + gdn_value_dim()); }

  // The inverse frequency of each rotated pair [rotary_dim / 2], for every backend's RoPE.
  std::vector<float> rope_inv_freq() const;

  // Throws ConfigError naming the first inconsistent field (or derived size that overflows).
  void validate() const;
};

}  // namespace lily
