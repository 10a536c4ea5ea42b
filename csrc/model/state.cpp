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
  if (at) {
    check_not_stale(*at);
    return tensors_of(*at, at->position_, with_kv);  // tensors_of checks `at` is this state's
  }
  return tensors_of(*capture(), position_, with_kv);
}

void State::import_tensors(int position, const std::vector<StateTensor>& tensors) {
  if (position < 0 || position > max_context_)
    throw RequestError("[state] a saved state at position " + std::to_string(position) +
                       " does not fit this sequence's context of " + std::to_string(max_context_));
  check_kv(position, tensors);  // everything is checked before anything changes
  auto recurrent = recurrent_from(tensors);
  load_kv(tensors);
  apply(*recurrent);
  position_ = position;
  ++epoch_;
  restores_.emplace_back(epoch_, position_);
}

std::unique_ptr<Snapshot> State::snapshot_from_tensors(int position, const std::vector<StateTensor>& tensors) const {
  if (position < 0 || position > position_)
    throw RequestError("[state] a snapshot at position " + std::to_string(position) +
                       " is past this sequence's position " + std::to_string(position_));
  auto snap = recurrent_from(tensors);
  snap->position_ = position;
  snap->epoch_ = epoch_;
  return snap;
}

}  // namespace lily
