// The one portable GPU interface: devices, buffers, pipelines and compute command encoding.
//
// Three backends implement it: csrc/metal/device.mm (real Metal, Apple only), csrc/msl_cpu/
// (runs the same .metal kernels on the CPU, for tests on Linux) and csrc/msl_cuda/ (runs them on
// an NVIDIA GPU). Everything that encodes work (csrc/gpu/) is written against this header only,
// so the dispatch sequence tested on Linux is the one that ships.
//
// The interface mirrors Apple's API one to one and keeps its semantics:
//   Device::new_library(source, options) -> newLibraryWithSource:options:error: (MTLCompileOptions:
//                                          languageVersion, mathMode / fastMathEnabled)
//   Library::pipeline(name, constants)  -> newFunctionWithName:constantValues:error: +
//                                          newComputePipelineStateWithFunction:error:
//   Device::new_buffer / wrap_buffer    -> newBufferWithLength: / newBufferWithBytesNoCopy:...
//   CommandBuffer::compute_encoder(t, label) -> computeCommandEncoderWithDispatchType: + label
//   ComputeEncoder::set_buffer(i, b, o) -> setBuffer:offset:atIndex:
//   ComputeEncoder::set_bytes(i, p, n)  -> setBytes:length:atIndex: (the bytes are copied now)
//                                          (Metal: "smaller than 4 KB"; larger is an error here)
//   set_threadgroup_memory_length(i, n) -> setThreadgroupMemoryLength:atIndex: (n % 16 == 0)
//   dispatch_threadgroups(grid, tg)     -> dispatchThreadgroups:threadsPerThreadgroup:
//   memory_barrier()                    -> memoryBarrierWithScope:MTLBarrierScopeBuffers
//   use_resource(b, write)              -> useResource:usage: (a buffer a kernel reaches through
//                                          an address in its argument data, not a binding)
//   Buffer::gpu_address()               -> MTLBuffer.gpuAddress (macOS 13+)
//   CommandBuffer::commit / wait_until_completed; an execution error is raised by the wait, as
//   Metal reports it in the command buffer's error once it completes, naming the encoder that
//   failed (its label; Metal: MTLCommandBufferErrorOptionEncoderExecutionStatus).
//   Device::make_resident(buffers)      -> an MTLResidencySet on the command queue (macOS 15+)
// Bindings persist on an encoder across dispatches, as in Metal. In a Concurrent encoder the
// dispatches between two memory barriers may run in any order or overlap: that is a claim
// that they are independent, which the msl_cpu dependency-check mode verifies.
// Objects are shared_ptr-owned; a command buffer holds on to what it uses until it completes
// (Metal retains them too).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lily::gpu {

// MTLSize.
struct Size3 {
  uint32_t width = 1, height = 1, depth = 1;
};

// MTLDispatchType.
enum class DispatchType { Serial, Concurrent };

// MTLDataType for the function-constant types the kernels use.
enum class ConstantType { Bool, Int, UInt, Short, UShort, Float, Half };

// MTLFunctionConstantValues: values by [[function_constant(index)]].
class FunctionConstants {
 public:
  struct Value {
    uint32_t index;
    ConstantType type;
    double value;  // exact for every type above (bool, 32-bit integers, float, half)
  };
  FunctionConstants& set(uint32_t index, ConstantType type, double value);
  const std::vector<Value>& values() const { return values_; }
  // A stable text form, e.g. "0:b=1;3:u=64": part of pipeline cache keys.
  std::string key() const;

 private:
  std::vector<Value> values_;
};

// MTLBuffer. On Metal and msl_cpu the storage is shared: contents() is the buffer's memory.
// A device with memory of its own (msl_cuda) returns nullptr from contents(). The GPU backend
// (csrc/gpu) never touches contents(): every host access is write / read / fill here or
// Device::copy, which on shared storage copy through contents() (msl_cpu's opaque_buffers mode
// hides contents() to keep it so). Like a CPU access to contents() on Metal, they happen at
// once: the caller makes sure that no committed, unfinished command buffer uses those bytes.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual void* contents() = 0;
  virtual size_t length() const = 0;
  virtual void write(size_t offset, const void* data, size_t n);  // host -> buffer
  virtual void read(size_t offset, void* data, size_t n);         // buffer -> host
  virtual void fill(size_t offset, uint8_t value, size_t n);      // memset
  // The address kernels see the buffer's first byte at, for a `device T*` written into argument
  // data (Metal 3's MTLBuffer.gpuAddress; msl_cpu: its storage; msl_cuda: its device pointer).
  // A dispatch that reaches a buffer this way declares it with ComputeEncoder::use_resource.
  virtual uint64_t gpu_address() const = 0;
};

// Throws lily::Error unless [offset, offset + n) lies in a buffer of `length` bytes ("[gpu]
// Buffer::<what>: ..."), for implementations of write / read / fill / copy.
void check_buffer_range(size_t length, size_t offset, size_t n, const char* what);

// The most bytes ComputeEncoder::set_bytes takes (Metal's limit for setBytes:length:atIndex:).
constexpr size_t kMaxSetBytes = 4096;
// Threadgroup memory of every Apple GPU lily supports (static + dynamic, per threadgroup).
constexpr size_t kMaxThreadgroupMemory = 32768;
// Threads per threadgroup a pipeline is sure to allow: more needs the kernel to declare
// [[max_total_threads_per_threadgroup(N)]] (otherwise register pressure may lower the limit).
constexpr uint32_t kDefaultMaxThreadsPerThreadgroup = 256;

// MTLComputePipelineState.
class Pipeline {
 public:
  virtual ~Pipeline() = default;
  virtual const std::string& name() const = 0;
  virtual uint32_t max_total_threads_per_threadgroup() const = 0;
  virtual uint32_t thread_execution_width() const = 0;
  // The name of the kernel parameter bound at [[buffer(index)]], "" where unknown (no such
  // parameter, or a device without reflection: Metal's pipelines are made without it). The GPU
  // backend checks its bindings against it, so on msl-cpu a host binding in the wrong order fails.
  virtual std::string buffer_name(uint32_t index) const { return {}; }
};

// MTLCompileOptions: what each library is compiled as.
struct LibraryOptions {
  // MTLLanguageVersion: MSL 3.1 (bfloat; every GPU lily supports, M1 on) or 4.0 (Metal 4
  // tensors; only where the device supports them).
  enum class Language { MSL3_1, MSL4_0 };
  Language language = Language::MSL3_1;
  // IEEE arithmetic (MTLMathModeSafe; fastMathEnabled = NO before macOS 15): no reassociation,
  // no contraction into FMA, no flushed infinities. Metal compiles with fast math by default.
  bool safe_math = false;
};

// MTLLibrary: compiled MSL source; pipelines are made from it by function name.
class Library {
 public:
  virtual ~Library() = default;
  virtual std::shared_ptr<Pipeline> pipeline(const std::string& function,
                                             const FunctionConstants& constants = {}) = 0;
};

// MTLComputeCommandEncoder.
class ComputeEncoder {
 public:
  virtual ~ComputeEncoder() = default;
  virtual void set_pipeline(const std::shared_ptr<Pipeline>& pipeline) = 0;
  virtual void set_buffer(uint32_t index, const std::shared_ptr<Buffer>& buffer,
                          size_t offset) = 0;
  virtual void set_bytes(uint32_t index, const void* bytes, size_t length) = 0;
  virtual void set_threadgroup_memory_length(uint32_t index, size_t length) = 0;
  virtual void insert_debug_signpost(const std::string& text) = 0;
  virtual void dispatch_threadgroups(Size3 threadgroups_per_grid,
                                     Size3 threads_per_threadgroup) = 0;
  virtual void memory_barrier() = 0;
  // The next dispatches reach `buffer` through an address in their argument data (a sequence
  // table of device addresses) rather than a binding: Metal makes it resident for them
  // (useResource:usage:); the MSL runtimes keep it alive and include it in their checks. Applies
  // to the dispatches encoded after it until the next dispatch_threadgroups has taken it, as
  // the runtimes record it per dispatch (Metal's lasts the whole encoder: a superset).
  virtual void use_resource(const std::shared_ptr<Buffer>& buffer, bool write) = 0;
  virtual void end_encoding() = 0;
};

// MTLCommandBuffer.
class CommandBuffer {
 public:
  virtual ~CommandBuffer() = default;
  // label names the encoder in execution errors (and in Xcode's GPU tools).
  virtual std::shared_ptr<ComputeEncoder> compute_encoder(DispatchType type, const std::string& label) = 0;
  virtual void commit() = 0;
  virtual void wait_until_completed() = 0;  // throws lily::Error if execution failed
};

// MTLDevice.
class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;
  // Metal 4 tensors and MetalPerformancePrimitives' tensor ops (matmul2d) in kernels: the GPU is
  // in MTLGPUFamilyMetal4 and libraries are compiled as MSL 4 (which defines __HAVE_TENSOR__).
  virtual bool supports_tensor_ops() const { return false; }
  // The newest MTLGPUFamilyAppleN the GPU supports (7: M1, 8: M2, 9: M3/M4, 10: M5).
  virtual int apple_gpu_family() const = 0;
  // MTLDevice.recommendedMaxWorkingSetSize: how much memory the GPU can use without hurting
  // performance (0: no limit known).
  virtual uint64_t recommended_max_working_set_size() const = 0;
  // Ask the OS to keep these buffers resident (MTLResidencySet on the command queue where the
  // OS has it, macOS 15+; elsewhere nothing).
  virtual void make_resident(const std::vector<std::shared_ptr<Buffer>>& buffers) = 0;
  virtual std::shared_ptr<Buffer> new_buffer(size_t length) = 0;
  // Caller memory as a buffer: a zero-copy wrap (page-aligned on Metal; the caller keeps it
  // alive), or on a device with memory of its own a copy made now (for weights, which never
  // change afterwards).
  virtual std::shared_ptr<Buffer> wrap_buffer(void* pointer, size_t length) = 0;
  // Whether buffers are the host's memory (contents() non-null): true on Metal and msl_cpu.
  virtual bool unified_memory() const { return true; }
  // n bytes from src to dst now, with the same rule as Buffer::write.
  virtual void copy(Buffer& dst, size_t dst_offset, Buffer& src, size_t src_offset, size_t n);
  // file_name names the source in diagnostics ("metal/quant.metal").
  virtual std::shared_ptr<Library> new_library(const std::string& source, const std::string& file_name,
                                               const LibraryOptions& options) = 0;
  virtual std::shared_ptr<CommandBuffer> new_command_buffer() = 0;
};

}  // namespace lily::gpu
