// What every GPU encoding function shares: the encoder context of a pass (command buffer,
// concurrent compute encoder, hazard tracker, statistics, pipelines) and the Dispatch builder
// that binds one kernel's buffers in its documented order. The encode_* functions of each op
// family (encode.h; quant.cpp, norm.cpp, attention.cpp, gdn.cpp, moe.cpp, sampling.cpp) take an
// EncoderContext, as ggml-metal's ggml_metal_op_<op>() take theirs.
//
// Binding order (one rule for every kernel, as ggml-metal's): [[buffer(0)]] is the argument
// struct (metal/*_args.h, set_bytes), then every buffer the kernel only reads (weights,
// activations, state read), then every buffer it writes (outputs, state written, buffers updated
// in place), each list in the order of the kernel's parameters. Dispatch assigns the indices as
// it is told the buffers, so no slot number is written twice; on a device whose pipelines know
// their parameter names (msl-cpu), each binding's name is checked against the kernel's, so a
// host and a kernel that disagree on the order fail the first test that runs them.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpu/device.h"
#include "gpu/hazards.h"

namespace lily::gpu {

// A buffer and a byte offset into it.
struct BufferRange {
  std::shared_ptr<Buffer> buf;
  size_t off = 0;
};

// One encoded dispatch, for plan reports (benchmarks/metal_plan.py) and tests.
struct DispatchRecord {
  std::string kernel;
  int stage = 0;              // memory-barrier-separated stage within its command buffer
  uint64_t weight_bytes = 0;  // checkpoint bytes the kernel reads
  uint64_t state_bytes = 0;   // KV cache / DeltaNet state bytes read (and written back)
  uint64_t other_bytes = 0;   // activations read and written
  uint64_t threadgroups = 0;             // in the grid
  uint32_t threads_per_threadgroup = 0;  // all three dimensions multiplied
};

struct GpuStats {
  uint64_t dispatches = 0, barriers = 0, command_buffers = 0, waits = 0;
  uint64_t max_in_flight = 0;  // most device-loop steps committed and not yet read back at once
};

// The compile options of metal/<file>: the *_tensor libraries as MSL 4.0 (Metal 4 tensors),
// everything else MSL 3.1; sampling with safe math (its bit-exact arithmetic needs IEEE
// semantics, also on MSL 3.1 where metal/sampling.h's #pragma is not available).
LibraryOptions library_options(const std::string& file);

class EncoderContext {
 public:
  explicit EncoderContext(std::shared_ptr<Device> device);

  Device& device() const { return *device_; }
  const std::shared_ptr<Device>& device_ptr() const { return device_; }

  // The pipeline of `kernel` in metal/<file>; libraries and pipelines are compiled once.
  std::shared_ptr<Pipeline> pipeline(const std::string& file, const std::string& kernel);
  // Compiles metal/<file> now (a probe: throws what the compiler says).
  void compile(const std::string& file);

  // The pass being encoded: one command buffer with one concurrent compute encoder labelled
  // `label` (the encoder a Metal execution error names). begin() opens one if none is open.
  void begin(const std::string& label);
  bool open() const { return cb_ != nullptr; }
  ComputeEncoder& encoder() { return *enc_; }
  // Ends and commits the open pass; returns its command buffer (nullptr if none was open).
  std::shared_ptr<CommandBuffer> commit();
  // Commits the open pass (if any) and waits for it.
  void finish();
  // Drops the open pass unexecuted: an exception left it half encoded (a pipeline limit, a bad
  // shape). Nothing of it runs; the next pass starts from a fresh command buffer.
  void discard() noexcept;
  // Names what the next dispatches belong to (MTLComputeCommandEncoder insertDebugSignpost:),
  // reported with an execution error.
  void signpost(const std::string& what);

  HazardTracker& hazards() { return hazards_; }
  int& stage() { return stage_; }
  GpuStats& stats() { return stats_; }
  const GpuStats& stats() const { return stats_; }
  // Recording of every dispatch (plan reports and tests; off by default).
  bool recording = false;
  std::vector<DispatchRecord> records;
  // Bound where a kernel takes a buffer it does not read in this mode (Metal wants every
  // parameter bound).
  const std::shared_ptr<Buffer>& dummy() const { return dummy_; }

 private:
  std::shared_ptr<Device> device_;
  std::map<std::string, std::shared_ptr<Library>> libraries_;
  std::map<std::string, std::shared_ptr<Pipeline>> pipelines_;
  std::shared_ptr<CommandBuffer> cb_;
  std::shared_ptr<ComputeEncoder> enc_;
  HazardTracker hazards_;
  int stage_ = 0;
  GpuStats stats_;
  std::shared_ptr<Buffer> dummy_;
};

// One dispatch: the argument struct, then reads, then writes (see the top of this file), each
// declared with the bytes it touches so the hazard tracker places barriers only at real data
// edges; then run() encodes the barrier it needs and the grid.
class Dispatch {
 public:
  Dispatch(EncoderContext& ctx, const std::string& file, const std::string& kernel);

  // [[buffer(0)]]: the kernel's argument struct, sent with set_bytes.
  template <typename A>
  Dispatch& args(const A& a) {
    static_assert(sizeof(A) <= kMaxSetBytes, "argument structs go through set_bytes (at most 4 KB)");
    set_bytes("args", &a, sizeof a);
    return *this;
  }
  // [[buffer(0)]] as `constant A*`: one argument struct per row of the grid, sent with set_bytes.
  template <typename A>
  Dispatch& args(const std::vector<A>& rows) {
    return table("args", rows);
  }
  // [[buffer(i)]] as `constant A*`: a table of structs (sequences of the dispatch), set_bytes.
  template <typename A>
  Dispatch& table(const char* name, const std::vector<A>& rows) {
    set_rows(name, rows.data(), rows.size(), sizeof(A));
    return *this;
  }
  // A buffer the kernel reaches through an address in its argument data (a sequence table)
  // rather than a binding: declared to the encoder (use_resource) and to the hazard tracker as
  // state, as state() does; returns the address to write into the table.
  uint64_t address(const std::shared_ptr<Buffer>& b, bool write, uint64_t traffic);
  // A buffer the kernel reads: `bytes` from r.off on (activations; counted as other traffic).
  Dispatch& read(const char* name, const BufferRange& r, size_t bytes);
  // A buffer the kernel writes (or updates in place).
  Dispatch& write(const char* name, const BufferRange& r, size_t bytes);
  // Checkpoint bytes the kernel reads (weights are never written: no hazard to declare).
  Dispatch& weight(const char* name, const BufferRange& r);
  Dispatch& weight_bytes(uint64_t n);
  // Sequence state (KV cache, DeltaNet state and window), whose traffic is counted apart; a
  // written one is declared read as well (the whole buffer: a conservative edge).
  Dispatch& state(const char* name, const std::shared_ptr<Buffer>& b, bool write, uint64_t traffic);
  // A parameter the kernel does not touch in this mode: the context's dummy buffer.
  Dispatch& unused(const char* name);
  // A binding whose accesses the caller declares itself (declare_read / declare_write).
  Dispatch& bind(const char* name, const BufferRange& r);
  Dispatch& declare_read(const std::shared_ptr<Buffer>& b, size_t bytes, size_t off = 0);
  Dispatch& declare_write(const std::shared_ptr<Buffer>& b, size_t bytes, size_t off = 0);

  // Encodes the dispatch. Throws lily::Error naming the kernel when the threadgroup exceeds the
  // pipeline's limit (more than 256 threads need the kernel's
  // [[max_total_threads_per_threadgroup(N)]]).
  void run(Size3 grid, Size3 threads);

 private:
  void set_bytes(const char* name, const void* p, size_t n);
  // n structs of `each` bytes; throws lily::Error naming the kernel unless 1 <= n and they fit set_bytes.
  void set_rows(const char* name, const void* p, size_t n, size_t each);
  uint32_t next(const char* name);
  void declare_state(const std::shared_ptr<Buffer>& b, bool write, uint64_t traffic);

  EncoderContext& ctx_;
  std::shared_ptr<Pipeline> pipeline_;
  DispatchRecord rec_;
  std::vector<Access> reads_, writes_;
  uint32_t index_ = 0;
};

inline uint32_t div_up(uint64_t a, uint64_t b) { return uint32_t((a + b - 1) / b); }

}  // namespace lily::gpu
