// GpuBackend::Dispatch, the one way the GPU backend's files (backend.cpp, prefill_mixers.cpp,
// ...) encode a dispatch: bindings, declared accesses for the hazard tracker and the plan
// records, then the barrier the tracker asks for and the grid. Internal to csrc/gpu/.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/backend.h"
#include "model/error.h"

namespace lily::gpu {

inline uint32_t div_up(uint64_t a, uint64_t b) { return uint32_t((a + b - 1) / b); }

// Encodes one dispatch: bindings, then the barrier the hazard tracker asks for, then the grid.
class GpuBackend::Dispatch {
 public:
  Dispatch(GpuBackend& be, const std::string& file, const std::string& kernel) : be_(be) {
    be_.begin();
    rec_.kernel = kernel;
    pipeline_ = be_.pipeline(file, kernel);
    be_.enc_->set_pipeline(pipeline_);
  }
  Dispatch& buf(uint32_t index, const Ref& r) {
    be_.enc_->set_buffer(index, r.buf, r.off);
    return *this;
  }
  Dispatch& buf(uint32_t index, const std::shared_ptr<Buffer>& b) { return buf(index, Ref{b, 0}); }
  template <typename A>
  Dispatch& args(uint32_t index, const A& a) {
    be_.enc_->set_bytes(index, &a, sizeof a);
    return *this;
  }
  // Declared accesses (bytes [off, off + n) of a buffer).
  Dispatch& reads(const std::shared_ptr<Buffer>& b, size_t n, size_t off = 0) {
    reads_.push_back({b.get(), off, off + n});
    rec_.other_bytes += n;
    return *this;
  }
  Dispatch& writes(const std::shared_ptr<Buffer>& b, size_t n, size_t off = 0) {
    writes_.push_back({b.get(), off, off + n});
    rec_.other_bytes += n;
    return *this;
  }
  // Accesses of state (KV, DeltaNet) whose traffic is counted separately.
  Dispatch& state(const std::shared_ptr<Buffer>& b, bool write, uint64_t traffic) {
    Access a{b.get(), 0, b->length()};
    (write ? writes_ : reads_).push_back(a);
    if (write) reads_.push_back(a);
    rec_.state_bytes += traffic;
    return *this;
  }
  Dispatch& weight_bytes(uint64_t n) {
    rec_.weight_bytes += n;
    return *this;
  }
  void run(Size3 grid, Size3 threads) {
    // A compiled pipeline may allow fewer threads than the kernel asks for (register pressure
    // on a real GPU): say so instead of letting Metal reject the dispatch.
    const uint64_t n = uint64_t(threads.width) * threads.height * threads.depth;
    if (n > pipeline_->max_total_threads_per_threadgroup())
      throw Error("[gpu] kernel '" + rec_.kernel + "' needs " + std::to_string(n) +
                  " threads per threadgroup; its pipeline allows " +
                  std::to_string(pipeline_->max_total_threads_per_threadgroup()));
    if (be_.hazards_.dispatch(*be_.enc_, grid, threads, reads_, writes_)) {
      ++be_.stage_;
      ++be_.stats_.barriers;
    }
    ++be_.stats_.dispatches;
    rec_.stage = be_.stage_;
    if (be_.recording_) be_.records_.push_back(rec_);
  }

 private:
  GpuBackend& be_;
  std::shared_ptr<Pipeline> pipeline_;
  DispatchRecord rec_;
  std::vector<Access> reads_, writes_;
};

}  // namespace lily::gpu
