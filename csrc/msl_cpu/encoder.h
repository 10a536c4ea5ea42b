// Metal's compute-command-encoder semantics, shared by the runtimes that run lily's .metal files
// off Apple hardware (msl_cpu here, msl_cuda in csrc/msl_cuda/): bindings that persist across
// dispatches, set_bytes copied at encode time, and every check Metal's validation layer would
// make at encode time, against Apple's limits (1024 threads per threadgroup or the kernel's
// [[max_total_threads_per_threadgroup]], 32 KB of threadgroup memory, lengths a multiple of 16,
// every [[buffer(i)]] bound, a bound `constant T&` at least sizeof(T) bytes, a device buffer's
// bound address a multiple of max(4, alignof its element type), set_bytes at most 4 KB, more
// than 256 threads only where the kernel declares its maximum). The encoder only
// records; a runtime's command buffer executes the commands, naming the encoder's label (and the
// last debug signpost) when one fails.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/device.h"
#include "msl_cpu/prelude/lily_msl_cpu_abi.h"

namespace lily::msl_cpu {

constexpr uint32_t kMaxThreadsPerThreadgroup = 1024;
constexpr size_t kMaxThreadgroupMemory = gpu::kMaxThreadgroupMemory;  // Apple GPUs (M1 and later)

// A pipeline of an MSL runtime: the kernel's parameters, as the checks need them.
class KernelPipeline : public gpu::Pipeline {
 public:
  virtual const char* runtime() const = 0;         // "msl_cpu", "msl_cuda": whose pipeline
  virtual const lily_msl_param* params() const = 0;  // ends with LILY_MSL_PARAM_END
  // Kernel-scope threadgroup arrays, where known before the dispatch runs (0 on the CPU, which
  // counts them as they are allocated).
  virtual size_t static_threadgroup_bytes() const { return 0; }
  // The kernel's [[max_total_threads_per_threadgroup(N)]], 0 where it declares none.
  virtual uint32_t declared_max_threads() const = 0;
  // Reflection from params(): the name of the parameter at [[buffer(index)]].
  std::string buffer_name(uint32_t index) const override;
};

// Fault injection for tests of the host's error paths, shared by a device's encoders: the next
// `remaining` dispatches of `kernel` throw while encoding (msl_cpu's DeviceOptions::fail_dispatch).
struct EncoderFaults {
  std::string kernel;
  int remaining = 0;
};

struct Binding {
  std::shared_ptr<gpu::Buffer> buffer;  // set_buffer
  size_t offset = 0;
  std::vector<uint8_t> bytes;  // set_bytes (copied at encode time, as Metal does)
  bool bound = false;
};

struct Command {
  bool barrier = false;
  std::string signpost;  // the last debug signpost before this dispatch
  std::shared_ptr<KernelPipeline> pipeline;
  std::array<Binding, LILY_MSL_MAX_BINDINGS> buffers;
  std::array<size_t, LILY_MSL_MAX_BINDINGS> threadgroup_lengths{};
  gpu::Size3 threadgroups, threads;
  // Buffers the dispatch reaches through addresses in its argument data (use_resource): held
  // until the command completes and included in the checking modes' snapshots.
  std::vector<std::shared_ptr<gpu::Buffer>> resources;
};

// The name of a kernel's parameter of kind a or b at `index` ("?" if none).
std::string param_name(const lily_msl_param* params, int kind_a, int kind_b, uint32_t index);

class RecordingEncoder final : public gpu::ComputeEncoder {
 public:
  RecordingEncoder(const char* runtime, gpu::DispatchType type, std::string label,
                   std::shared_ptr<EncoderFaults> faults = nullptr)
      : runtime_(runtime), type_(type), label_(std::move(label)), faults_(std::move(faults)) {}

  void set_pipeline(const std::shared_ptr<gpu::Pipeline>& pipeline) override;
  void set_buffer(uint32_t index, const std::shared_ptr<gpu::Buffer>& buffer, size_t offset) override;
  void set_bytes(uint32_t index, const void* bytes, size_t length) override;
  void set_threadgroup_memory_length(uint32_t index, size_t length) override;
  void insert_debug_signpost(const std::string& text) override;
  void dispatch_threadgroups(gpu::Size3 grid, gpu::Size3 threads) override;
  void memory_barrier() override;
  void use_resource(const std::shared_ptr<gpu::Buffer>& buffer, bool write) override;
  void end_encoding() override;

  bool ended() const { return ended_; }
  gpu::DispatchType type() const { return type_; }
  const std::string& label() const { return label_; }
  const std::vector<Command>& commands() const { return commands_; }

 private:
  [[noreturn]] void fail(const std::string& what) const;
  void check_open() const;
  void check_index(uint32_t index, const char* what) const;
  const char* runtime_;
  gpu::DispatchType type_;
  std::string label_, signpost_;
  std::shared_ptr<EncoderFaults> faults_;
  Command state_;  // the current bindings (they persist across dispatches, as in Metal)
  std::vector<Command> commands_;
  bool ended_ = false;
};

}  // namespace lily::msl_cpu
