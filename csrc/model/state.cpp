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

void State::restore(const Snapshot& snap) {
  for (const auto& [epoch, pos] : restores_)
    if (epoch > snap.epoch_ && pos < snap.position_)
      throw RequestError("[state] snapshot at position " + std::to_string(snap.position_) +
                         " is stale: the sequence was rolled back to " + std::to_string(pos) + " after it was taken");
  if (snap.position_ > max_context_) throw RequestError("[state] snapshot does not fit this state's context");
  apply(snap);  // throws if the snapshot belongs to another backend / model
  position_ = snap.position_;
  ++epoch_;
  restores_.emplace_back(epoch_, position_);
}

}  // namespace lily
