#include <map>
#include <string>

#include "model/backend.h"
#include "model/error.h"

namespace lily {

std::unique_ptr<Snapshot> State::snapshot() const {
  auto snap = capture();
  snap->position_ = position_;
  snap->epoch_ = epoch_;
  return snap;
}

void State::check_not_stale(const Snapshot& snap) const {
  for (const auto& [epoch, pos] : restores_)
    if (epoch > snap.epoch_ && pos < snap.position_)
      throw RequestError("[state] snapshot at position " + std::to_string(snap.position_) +
                         " is stale: the sequence was rolled back to " + std::to_string(pos) + " after it was taken");
}

void State::restore(const Snapshot& snap) {
  check_not_stale(snap);
  if (snap.position_ > max_context_) throw RequestError("[state] snapshot does not fit this state's context");
  apply(snap);  // throws if the snapshot belongs to another backend / model
  position_ = snap.position_;
  ++epoch_;
  restores_.emplace_back(epoch_, position_);
}

std::vector<StateTensor> State::export_tensors(const Snapshot* at, bool with_kv) const {
  std::unique_ptr<Snapshot> live;
  if (at) check_not_stale(*at);
  else live = capture();
  const Snapshot& snap = at ? *at : *live;
  const int positions = at ? at->position_ : position_;
  const ModelConfig& c = *config_;
  std::vector<StateTensor> out;
  for (int l = 0; l < c.n_layers(); ++l) {
    if (c.mixers[l] != Mixer::Attention) {
      StateTensor conv{state_tensor_name("gdn", l, "conv"), {c.conv_kernel - 1, c.gdn_qkv_dim()}, {}};
      StateTensor S{state_tensor_name("gdn", l, "S"), {c.gdn_v_heads, c.gdn_k_dim, c.gdn_v_dim}, {}};
      read_recurrent(snap, l, conv.data, S.data);  // throws if `at` is another state's
      out.push_back(std::move(conv));
      out.push_back(std::move(S));
    } else if (with_kv) {
      for (const char* part : {"k", "v"}) {
        StateTensor t{state_tensor_name("kv", l, part), {c.n_kv_heads, positions, c.head_dim}, {}};
        t.data.resize(size_t(c.n_kv_heads) * positions * c.head_dim);
        read_kv_rows(l, part[0] == 'v', positions, t.data.data());
        out.push_back(std::move(t));
      }
    }
  }
  return out;
}

// ---- state as named tensors ------------------------------------------------------------------

std::string state_tensor_name(const char* kind, int layer, const char* part) {
  return std::string(kind) + "." + std::to_string(layer) + "." + part;
}

const StateTensor* find_state_tensor(const std::vector<StateTensor>& tensors, const std::string& name) {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

namespace {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

void State::check_tensors(int positions, const std::vector<StateTensor>& tensors, bool with_kv) const {
  const ModelConfig& c = *config_;
  std::map<std::string, const StateTensor*> left;  // given, not yet matched
  for (const auto& t : tensors)
    if (with_kv || t.name.rfind("kv.", 0) != 0) left[t.name] = &t;
  auto take = [&](const std::string& name) {
    auto it = left.find(name);
    if (it == left.end()) throw RequestError("[state] tensor '" + name + "' is missing");
    const StateTensor* t = it->second;
    left.erase(it);
    return t;
  };
  auto check_shape = [](const StateTensor& t, const std::vector<int64_t>& shape) {
    if (t.shape != shape)
      throw RequestError("[state] tensor '" + t.name + "' has shape " + shape_str(t.shape) + ", this model's is " +
                         shape_str(shape));
  };
  int64_t kv_rows = -1;
  for (int l = 0; l < c.n_layers(); ++l) {
    if (c.mixers[l] != Mixer::Attention) {
      check_shape(*take(state_tensor_name("gdn", l, "conv")), {c.conv_kernel - 1, c.gdn_qkv_dim()});
      check_shape(*take(state_tensor_name("gdn", l, "S")), {c.gdn_v_heads, c.gdn_k_dim, c.gdn_v_dim});
      continue;
    }
    if (!with_kv) continue;
    for (const char* part : {"k", "v"}) {
      const StateTensor& t = *take(state_tensor_name("kv", l, part));
      if (kv_rows < 0) kv_rows = t.shape.size() == 3 ? t.shape[1] : 0;
      check_shape(t, {c.n_kv_heads, kv_rows, c.head_dim});  // every layer holds the same rows
      if (kv_rows < positions || kv_rows > max_context_)
        throw RequestError("[state] tensor '" + t.name + "' holds " + std::to_string(kv_rows) + " positions; " +
                           std::to_string(positions) + " to " + std::to_string(max_context_) + " expected");
    }
  }
  if (!left.empty())
    throw RequestError("[state] unknown tensor '" + left.begin()->first + "' (not a state tensor of this model)");
}

std::unique_ptr<Snapshot> State::recurrent_from(const std::vector<StateTensor>& tensors) const {
  const ModelConfig& c = *config_;
  auto snap = new_snapshot();
  for (int l = 0; l < c.n_layers(); ++l)
    if (c.mixers[l] != Mixer::Attention)
      write_recurrent(*snap, l, find_state_tensor(tensors, state_tensor_name("gdn", l, "conv"))->data,
                      find_state_tensor(tensors, state_tensor_name("gdn", l, "S"))->data);
  return snap;
}

void State::import_tensors(int position, const std::vector<StateTensor>& tensors) {
  if (position < 0 || position > max_context_)
    throw RequestError("[state] a saved state at position " + std::to_string(position) +
                       " does not fit this sequence's context of " + std::to_string(max_context_));
  check_tensors(position, tensors, true);  // everything is checked before anything changes
  auto recurrent = recurrent_from(tensors);
  const ModelConfig& c = *config_;
  int rows = 0;  // the same in every layer (check_tensors)
  for (int l = 0; l < c.n_layers() && !rows; ++l)
    if (c.mixers[l] == Mixer::Attention) rows = int(find_state_tensor(tensors, state_tensor_name("kv", l, "k"))->shape[1]);
  reserve_kv_rows(rows);
  for (int l = 0; l < c.n_layers(); ++l)
    if (c.mixers[l] == Mixer::Attention)
      for (const char* part : {"k", "v"})
        write_kv_rows(l, part[0] == 'v', rows, find_state_tensor(tensors, state_tensor_name("kv", l, part))->data.data());
  apply(*recurrent);
  position_ = position;
  ++epoch_;
  restores_.emplace_back(epoch_, position_);
}

std::unique_ptr<Snapshot> State::snapshot_from_tensors(int position, const std::vector<StateTensor>& tensors) const {
  if (position < 0 || position > position_)
    throw RequestError("[state] a snapshot at position " + std::to_string(position) +
                       " is past this sequence's position " + std::to_string(position_));
  check_tensors(position, tensors, false);
  auto snap = recurrent_from(tensors);
  snap->position_ = position;
  snap->epoch_ = epoch_;
  return snap;
}

}  // namespace lily
