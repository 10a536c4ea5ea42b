// What the GPU backend's encoding files (backend.cpp, prefill_moe.cpp) share: the dispatch
// encoder, the expert offset tables and the weight-matrix helpers. Internal to csrc/gpu/.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/backend.h"
#include "model/error.h"

// The argument structs shared with the kernels (plain 32-bit fields).
#include "metal/moe_args.h"
#include "metal/quant_args.h"

namespace lily::gpu {

// One matrix kind of a MoE block (or a dense MLP): the buffers its experts live in and the
// [E, 3] byte offsets (w, scales, biases) of each expert's matrix into them.
struct GpuBackend::ExpertMatrix {
  Ref w, s, b;                    // bound at offset 0 of each region buffer
  std::shared_ptr<Buffer> table;  // [n, 3] uint64 offsets
  QuantMatrix m{};
  DType dtype = DType::F32;
  uint64_t nbytes = 0;  // one expert's matrix
  int experts = 0;
};

// Offset tables of one MoE block (or one dense MLP: gate, up, down of one "expert").
struct GpuBackend::ExpertTables {
  ExpertMatrix gate, up, down, shared_gate, shared_up, shared_down;
};

// Whether the prefill tiles (metal/gemm.h) read matrix m: affine widths must be whole K steps
// (every MLX group size is a multiple of 32); dense ones any width.
inline bool tiles_fit(const QuantMatrix& m) { return m.bits == 0 || m.in % LILY_GEMM_BK == 0; }

inline const char* scalar_name(DType t) {
  switch (t) {
    case DType::F32: return "float";
    case DType::F16: return "half";
    case DType::BF16: return "bfloat";
    default: throw ConfigError("[gpu] weights of dtype " + std::string(dtype_name(t)) + " are not supported");
  }
}

inline QuantMatrix matrix(const Linear& W, const char* what) {
  if (!W.present()) throw ConfigError(std::string("[gpu] ") + what + " is missing");
  const uint32_t bits = W.quantized() ? uint32_t(W.bits) : 0;
  if (bits != 0 && bits != 2 && bits != 4 && bits != 8)
    throw ConfigError(std::string("[gpu] ") + what + " is " + std::to_string(bits) +
                      "-bit; the GPU kernels read 2, 4 and 8-bit affine weights and dense ones");
  QuantMatrix m{};
  m.in = uint32_t(W.in);
  m.out = uint32_t(W.out);
  m.bits = bits;
  m.group = W.quantized() ? uint32_t(W.group) : 0;
  if (bits && (m.group % (32 / bits) != 0 || W.in % W.group != 0))
    throw ConfigError(std::string("[gpu] ") + what + ": group size " + std::to_string(W.group) + " does not suit the kernels");
  return m;
}

inline uint32_t div_up(uint64_t a, uint64_t b) { return uint32_t((a + b - 1) / b); }
constexpr uint32_t kGemvRows = LILY_GEMV_SIMDGROUPS * LILY_GEMV_ROWS_PER_SIMDGROUP;
constexpr uint32_t kGemvThreads = 32 * LILY_GEMV_SIMDGROUPS;

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
  // An expert matrix at four consecutive bindings: weights, scales, biases, offset table.
  Dispatch& experts(uint32_t index, const ExpertMatrix& m) {
    return buf(index, m.w).buf(index + 1, m.s).buf(index + 2, m.b).buf(index + 3, m.table);
  }
  // A Linear at three consecutive bindings: weights, scales, biases (dense: a dummy for both).
  Dispatch& linear(uint32_t index, const Linear& W) {
    buf(index, be_.weight(W.w, "weight"));
    buf(index + 1, W.quantized() ? be_.weight(W.scales, "scales") : Ref{be_.dummy_, 0});
    return buf(index + 2, W.quantized() ? be_.weight(W.biases, "biases") : Ref{be_.dummy_, 0});
  }
  // A projection y[t, :out) = W x[t, :in) for t < T: W at bindings 0-2, x at 3, y at 4 (the
  // layout of gemv_* and gemm_*), with its accesses declared.
  Dispatch& projection(const Linear& W, const Ref& x, int ldx, const Ref& y, int ldy, int T) {
    return linear(0, W)
        .buf(3, x)
        .buf(4, y)
        .reads(x.buf, size_t(T) * ldx * 4, x.off)
        .writes(y.buf, (size_t(T - 1) * ldy + W.out) * 4, y.off)
        .weight_bytes(W.nbytes());
  }
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
