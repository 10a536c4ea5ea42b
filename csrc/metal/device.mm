// gpu::Device over Apple's Metal: the thin Objective-C++ layer. Every method is one or two
// Metal calls; the semantics (binding persistence, concurrent dispatch, errors raised at wait)
// are Metal's own, which csrc/msl_cpu/ reproduces on the CPU for tests.
//
// Manual reference counting (CMake's default for .mm, as in metal-cpp and MLX): a Metal object
// held by a C++ object is an Owned<> (released in its destructor), and every method that
// creates autoreleased objects drains its own @autoreleasepool, so calls from plain C++ threads
// leak nothing. On Linux this file is type-checked (scripts/check_metal_host.sh) against
// GNUstep's Foundation and tests/metal_host/Metal/Metal.h; it has not yet run on a Mac.
//
// Choices:
//  - Buffers are MTLResourceStorageModeShared (unified memory: contents() is the CPU view) and
//    hazard-tracked by Metal; lily places its own barriers in concurrent encoders.
//  - wrap_buffer() is zero-copy (newBufferWithBytesNoCopy), for mmap'ed safetensors weights: the
//    pointer must be page-aligned; the length is rounded up to whole pages (an mmap'ed region
//    always is), and the caller keeps the memory alive (no deallocator).
//  - Libraries compile from source at run time, each with its own options (gpu::LibraryOptions):
//    MSL 3.1 (bfloat), MSL 4.0 for the Metal 4 tensor libraries; safe math where asked (the
//    sampler: MTLMathModeSafe from macOS 15, fastMathEnabled = NO before). Pipelines are cached
//    by function name and function-constant values.
//  - A command buffer's execution error is raised by wait_until_completed(), with Metal's text
//    and the encoders that faulted (MTLCommandBufferErrorOptionEncoderExecutionStatus: each
//    encoder's label and its last debug signposts).
//  - The weights' buffers are held resident by an MTLResidencySet on the queue where the OS has
//    them (macOS 15+); elsewhere make_resident does nothing.
#if __has_feature(objc_arc)
#error "csrc/metal/*.mm uses manual reference counting: compile without -fobjc-arc"
#endif

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include "metal/device.h"

#include <unistd.h>

#include <map>
#include <mutex>
#include <string>

#include "model/error.h"

namespace lily::metal {
namespace {

[[noreturn]] void fail(const std::string& what, NSError* error = nil) {
  std::string msg = "[metal] " + what;
  if (error) msg += ": " + std::string([[error localizedDescription] UTF8String]);
  throw lily::Error(msg);
}

NSString* ns(const std::string& s) { return [NSString stringWithUTF8String:s.c_str()]; }

// One owned reference to an Objective-C object: adopts a +1 reference (from new..., alloc or
// MTLCreateSystemDefaultDevice), or retains one that is autoreleased (Owned::retain).
template <class T>
class Owned {
 public:
  Owned() = default;
  explicit Owned(T object) : object_(object) {}
  static Owned retain(T object) { return Owned([object retain]); }
  Owned(const Owned& o) : object_([o.object_ retain]) {}
  Owned& operator=(const Owned& o) {
    if (this != &o) {
      [o.object_ retain];
      [object_ release];
      object_ = o.object_;
    }
    return *this;
  }
  ~Owned() { [object_ release]; }
  T get() const { return object_; }
  explicit operator bool() const { return object_ != nil; }

 private:
  T object_ = nil;
};

class MetalBuffer final : public gpu::Buffer {
 public:
  explicit MetalBuffer(Owned<id<MTLBuffer>> buffer) : buffer_(std::move(buffer)) {}
  void* contents() override { return [buffer_.get() contents]; }
  size_t length() const override { return [buffer_.get() length]; }
  uint64_t gpu_address() const override { return [buffer_.get() gpuAddress]; }
  id<MTLBuffer> buffer() const { return buffer_.get(); }

 private:
  Owned<id<MTLBuffer>> buffer_;
};

class MetalPipeline final : public gpu::Pipeline {
 public:
  MetalPipeline(Owned<id<MTLComputePipelineState>> state, std::string name)
      : state_(std::move(state)), name_(std::move(name)) {}
  const std::string& name() const override { return name_; }
  uint32_t max_total_threads_per_threadgroup() const override {
    return static_cast<uint32_t>([state_.get() maxTotalThreadsPerThreadgroup]);
  }
  uint32_t thread_execution_width() const override {
    return static_cast<uint32_t>([state_.get() threadExecutionWidth]);
  }
  id<MTLComputePipelineState> state() const { return state_.get(); }

 private:
  Owned<id<MTLComputePipelineState>> state_;
  std::string name_;
};

// The encoders a failed command buffer reports as faulted (the command buffer was made with
// MTLCommandBufferErrorOptionEncoderExecutionStatus): " in encoder 'label' after signpost 'x'".
std::string faulted_encoders(NSError* error) {
  if (!error) return "";
  id infos = [[error userInfo] objectForKey:MTLCommandBufferEncoderInfoErrorKey];
  if (![infos isKindOfClass:[NSArray class]]) return "";
  std::string out;
  NSArray* list = infos;
  for (NSUInteger i = 0; i < [list count]; ++i) {
    id<MTLCommandBufferEncoderInfo> info = [list objectAtIndex:i];
    if ([info errorState] != MTLCommandEncoderErrorStateFaulted) continue;
    out += std::string(" in encoder '") + ([info label] ? [[info label] UTF8String] : "") + "'";
    NSArray<NSString*>* signposts = [info debugSignposts];
    if ([signposts count] > 0) out += std::string(" after signpost '") + [[signposts lastObject] UTF8String] + "'";
  }
  return out;
}

MTLDataType data_type(gpu::ConstantType t) {
  switch (t) {
    case gpu::ConstantType::Bool: return MTLDataTypeBool;
    case gpu::ConstantType::Int: return MTLDataTypeInt;
    case gpu::ConstantType::UInt: return MTLDataTypeUInt;
    case gpu::ConstantType::Short: return MTLDataTypeShort;
    case gpu::ConstantType::UShort: return MTLDataTypeUShort;
    case gpu::ConstantType::Float: return MTLDataTypeFloat;
    case gpu::ConstantType::Half: return MTLDataTypeHalf;
  }
  return MTLDataTypeNone;
}

class MetalLibrary final : public gpu::Library {
 public:
  MetalLibrary(Owned<id<MTLDevice>> device, Owned<id<MTLLibrary>> library, std::string file_name)
      : device_(std::move(device)), library_(std::move(library)), file_name_(std::move(file_name)) {}

  std::shared_ptr<gpu::Pipeline> pipeline(const std::string& function,
                                          const gpu::FunctionConstants& constants) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::string key = function + "|" + constants.key();
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;

    @autoreleasepool {
    Owned<MTLFunctionConstantValues*> values([MTLFunctionConstantValues new]);
    for (const auto& v : constants.values()) {
      // Each value in its own type's bytes.
      bool b = v.value != 0;
      int32_t i = static_cast<int32_t>(v.value);
      uint32_t u = static_cast<uint32_t>(v.value);
      int16_t s = static_cast<int16_t>(v.value);
      uint16_t us = static_cast<uint16_t>(v.value);
      float f = static_cast<float>(v.value);
      _Float16 h = static_cast<_Float16>(v.value);
      const void* bytes = nullptr;
      switch (v.type) {
        case gpu::ConstantType::Bool: bytes = &b; break;
        case gpu::ConstantType::Int: bytes = &i; break;
        case gpu::ConstantType::UInt: bytes = &u; break;
        case gpu::ConstantType::Short: bytes = &s; break;
        case gpu::ConstantType::UShort: bytes = &us; break;
        case gpu::ConstantType::Float: bytes = &f; break;
        case gpu::ConstantType::Half: bytes = &h; break;
      }
      [values.get() setConstantValue:bytes type:data_type(v.type) atIndex:v.index];
    }
    NSError* error = nil;
    Owned<id<MTLFunction>> fn([library_.get() newFunctionWithName:ns(function)
                                                   constantValues:values.get()
                                                            error:&error]);
    if (!fn) fail("function '" + function + "' of " + file_name_, error);
    Owned<id<MTLComputePipelineState>> state(
        [device_.get() newComputePipelineStateWithFunction:fn.get() error:&error]);
    if (!state) fail("pipeline for '" + function + "'", error);
    auto p = std::make_shared<MetalPipeline>(std::move(state), function);
    cache_[key] = p;
    return p;
    }  // @autoreleasepool
  }

 private:
  Owned<id<MTLDevice>> device_;
  Owned<id<MTLLibrary>> library_;
  std::string file_name_;
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<gpu::Pipeline>> cache_;
};

class MetalEncoder final : public gpu::ComputeEncoder {
 public:
  explicit MetalEncoder(Owned<id<MTLComputeCommandEncoder>> encoder) : encoder_(std::move(encoder)) {}
  void insert_debug_signpost(const std::string& text) override {
    @autoreleasepool {
      [encoder_.get() insertDebugSignpost:ns(text)];
    }
  }

  void set_pipeline(const std::shared_ptr<gpu::Pipeline>& pipeline) override {
    auto* p = dynamic_cast<MetalPipeline*>(pipeline.get());
    if (!p) fail("set_pipeline: not a Metal pipeline");
    [encoder_.get() setComputePipelineState:p->state()];
  }
  void set_buffer(uint32_t index, const std::shared_ptr<gpu::Buffer>& buffer,
                  size_t offset) override {
    auto* b = dynamic_cast<MetalBuffer*>(buffer.get());
    if (!b) fail("set_buffer: not a Metal buffer");
    [encoder_.get() setBuffer:b->buffer() offset:offset atIndex:index];
  }
  void set_bytes(uint32_t index, const void* bytes, size_t length) override {
    [encoder_.get() setBytes:bytes length:length atIndex:index];
  }
  void set_threadgroup_memory_length(uint32_t index, size_t length) override {
    [encoder_.get() setThreadgroupMemoryLength:length atIndex:index];
  }
  void dispatch_threadgroups(gpu::Size3 grid, gpu::Size3 threads) override {
    [encoder_.get() dispatchThreadgroups:MTLSizeMake(grid.width, grid.height, grid.depth)
             threadsPerThreadgroup:MTLSizeMake(threads.width, threads.height, threads.depth)];
  }
  void memory_barrier() override { [encoder_.get() memoryBarrierWithScope:MTLBarrierScopeBuffers]; }
  // A buffer reached through a gpuAddress in argument data must be declared, or it may not be
  // resident when the kernel reads it. (Hazards need nothing more: the encoder is concurrent
  // and every barrier is memoryBarrierWithScope:MTLBarrierScopeBuffers, which covers it.)
  void use_resource(const std::shared_ptr<gpu::Buffer>& buffer, bool write) override {
    auto* b = dynamic_cast<MetalBuffer*>(buffer.get());
    if (!b) fail("use_resource: not a Metal buffer");
    [encoder_.get() useResource:b->buffer()
                          usage:(write ? MTLResourceUsageRead | MTLResourceUsageWrite : MTLResourceUsageRead)];
  }
  void end_encoding() override { [encoder_.get() endEncoding]; }

 private:
  Owned<id<MTLComputeCommandEncoder>> encoder_;
};

class MetalCommandBuffer final : public gpu::CommandBuffer {
 public:
  explicit MetalCommandBuffer(Owned<id<MTLCommandBuffer>> buffer) : buffer_(std::move(buffer)) {}

  std::shared_ptr<gpu::ComputeEncoder> compute_encoder(gpu::DispatchType type, const std::string& label) override {
    @autoreleasepool {
      id<MTLComputeCommandEncoder> e = [buffer_.get()
          computeCommandEncoderWithDispatchType:type == gpu::DispatchType::Concurrent
                                                    ? MTLDispatchTypeConcurrent
                                                    : MTLDispatchTypeSerial];
      if (!e) fail("cannot create a compute command encoder");
      if (!label.empty()) e.label = ns(label);
      return std::make_shared<MetalEncoder>(Owned<id<MTLComputeCommandEncoder>>::retain(e));
    }
  }
  void commit() override { [buffer_.get() commit]; }
  void wait_until_completed() override {
    @autoreleasepool {
      [buffer_.get() waitUntilCompleted];
      if ([buffer_.get() status] == MTLCommandBufferStatusError) {
        NSError* error = [buffer_.get() error];
        fail("command buffer failed" + faulted_encoders(error), error);
      }
    }
  }

 private:
  Owned<id<MTLCommandBuffer>> buffer_;
};

// MTLGPUFamilyMetal4, MTLGPUFamilyApple10 and MTLLanguageVersion4_0 (macOS 26 SDK) by value, so
// the file builds with older SDKs too; an older OS answers NO for the families, and the version
// is only asked for then. The values are Apple's (metal-cpp: tests/metal_host/metal_api.txt).
const MTLGPUFamily kGPUFamilyMetal4 = static_cast<MTLGPUFamily>(5002);
const MTLGPUFamily kGPUFamilyApple10 = static_cast<MTLGPUFamily>(1010);
const MTLLanguageVersion kLanguageVersion4_0 = static_cast<MTLLanguageVersion>((4 << 16) + 0);

// Residency sets and MTLCompileOptions.mathMode exist from the macOS 15 SDK (and in our Linux
// declarations of Metal); with an older SDK those calls are left out.
#if defined(__MAC_15_0) || !defined(__APPLE__)
#define LILY_METAL_MACOS15_SDK 1
#endif

class MetalDevice final : public gpu::Device {
 public:
  MetalDevice() : device_(MTLCreateSystemDefaultDevice()) {
    if (!device_) fail("no Metal device");
    // simdgroup_matrix, bfloat and 32 KB of threadgroup memory: Metal 3 on Apple7 (M1) or later.
    if (![device_.get() supportsFamily:MTLGPUFamilyMetal3] ||
        ![device_.get() supportsFamily:MTLGPUFamilyApple7])
      fail("the GPU '" + name() + "' lacks Metal 3 / Apple7 (M1 or later), which lily's kernels need");
    // Metal 4 (macOS 26, MTLGPUFamilyMetal4): tensors and MetalPerformancePrimitives' matmul2d;
    // libraries are then compiled as MSL 4, which defines __HAVE_TENSOR__ for the tensor-op
    // GEMM kernels (metal/gemm.h). Decided once, at load.
    tensor_ops_ = [device_.get() supportsFamily:kGPUFamilyMetal4];
    apple_family_ = [device_.get() supportsFamily:kGPUFamilyApple10] ? 10
                    : [device_.get() supportsFamily:MTLGPUFamilyApple9] ? 9
                    : [device_.get() supportsFamily:MTLGPUFamilyApple8] ? 8
                                                                          : 7;
    queue_ = Owned<id<MTLCommandQueue>>([device_.get() newCommandQueue]);
    if (!queue_) fail("cannot create a command queue");
  }
  ~MetalDevice() override {
#if defined(LILY_METAL_MACOS15_SDK)
    if (residency_) {
      [queue_.get() removeResidencySet:residency_.get()];
      [residency_.get() endResidency];
    }
#endif
  }
  std::string name() const override { return [[device_.get() name] UTF8String]; }
  bool supports_tensor_ops() const override { return tensor_ops_; }
  int apple_gpu_family() const override { return apple_family_; }
  uint64_t recommended_max_working_set_size() const override {
    return [device_.get() recommendedMaxWorkingSetSize];
  }
  // One residency set for the weights' buffers, attached to the queue: the OS keeps them
  // resident instead of paging them in per command buffer (macOS 15+; elsewhere nothing).
  void make_resident(const std::vector<std::shared_ptr<gpu::Buffer>>& buffers) override {
#if defined(LILY_METAL_MACOS15_SDK)
    if (buffers.empty() || ![device_.get() respondsToSelector:@selector(newResidencySetWithDescriptor:error:)]) return;
    @autoreleasepool {
      Owned<MTLResidencySetDescriptor*> desc([MTLResidencySetDescriptor new]);
      desc.get().label = @"lily weights";
      desc.get().initialCapacity = buffers.size();
      NSError* error = nil;
      Owned<id<MTLResidencySet>> set([device_.get() newResidencySetWithDescriptor:desc.get() error:&error]);
      if (!set) fail("cannot create a residency set for the weights", error);
      for (const auto& b : buffers) {
        auto* mb = dynamic_cast<MetalBuffer*>(b.get());
        if (!mb) fail("make_resident: not a Metal buffer");
        [set.get() addAllocation:mb->buffer()];
      }
      [set.get() commit];
      [set.get() requestResidency];
      if (residency_) {
        [queue_.get() removeResidencySet:residency_.get()];
        [residency_.get() endResidency];
      }
      [queue_.get() addResidencySet:set.get()];
      residency_ = std::move(set);
    }
#endif
  }
  std::shared_ptr<gpu::Buffer> new_buffer(size_t length) override {
    Owned<id<MTLBuffer>> b([device_.get() newBufferWithLength:length
                                                      options:MTLResourceStorageModeShared]);
    if (!b) fail("cannot allocate a buffer of " + std::to_string(length) + " bytes");
    return std::make_shared<MetalBuffer>(std::move(b));
  }
  std::shared_ptr<gpu::Buffer> wrap_buffer(void* pointer, size_t length) override {
    const size_t page = static_cast<size_t>(getpagesize());
    if (reinterpret_cast<uintptr_t>(pointer) % page != 0)
      fail("wrap_buffer: the pointer is not page-aligned");
    Owned<id<MTLBuffer>> b([device_.get() newBufferWithBytesNoCopy:pointer
                                                            length:(length + page - 1) / page * page
                                                           options:MTLResourceStorageModeShared
                                                       deallocator:nil]);
    if (!b) fail("cannot wrap " + std::to_string(length) + " bytes as a Metal buffer");
    return std::make_shared<MetalBuffer>(std::move(b));
  }
  std::shared_ptr<gpu::Library> new_library(const std::string& source, const std::string& file_name,
                                            const gpu::LibraryOptions& library) override {
    @autoreleasepool {
      Owned<MTLCompileOptions*> options([MTLCompileOptions new]);
      if (library.language == gpu::LibraryOptions::Language::MSL4_0) {
        if (!tensor_ops_) fail("compiling " + file_name + ": MSL 4.0 needs a Metal 4 GPU (macOS 26)");
        options.get().languageVersion = kLanguageVersion4_0;
      } else {
        options.get().languageVersion = MTLLanguageVersion3_1;  // bfloat
      }
      if (library.safe_math) {
#if defined(LILY_METAL_MACOS15_SDK)
        if ([options.get() respondsToSelector:@selector(setMathMode:)])
          options.get().mathMode = MTLMathModeSafe;
        else
#endif
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"  // fastMathEnabled: the pre-macOS 15 way
          options.get().fastMathEnabled = NO;
#pragma clang diagnostic pop
      }
      NSError* error = nil;
      Owned<id<MTLLibrary>> lib([device_.get() newLibraryWithSource:ns(source)
                                                            options:options.get()
                                                              error:&error]);
      if (!lib) fail("compiling " + file_name, error);
      return std::make_shared<MetalLibrary>(device_, std::move(lib), file_name);
    }
  }
  std::shared_ptr<gpu::CommandBuffer> new_command_buffer() override {
    @autoreleasepool {
      // Encoder execution status in errors: which encoder faulted, with its signposts.
      Owned<MTLCommandBufferDescriptor*> desc([MTLCommandBufferDescriptor new]);
      desc.get().errorOptions = MTLCommandBufferErrorOptionEncoderExecutionStatus;
      id<MTLCommandBuffer> cb = [queue_.get() commandBufferWithDescriptor:desc.get()];
      if (!cb) fail("cannot create a command buffer");
      return std::make_shared<MetalCommandBuffer>(Owned<id<MTLCommandBuffer>>::retain(cb));
    }
  }

 private:
  Owned<id<MTLDevice>> device_;
  Owned<id<MTLCommandQueue>> queue_;
#if defined(LILY_METAL_MACOS15_SDK)
  Owned<id<MTLResidencySet>> residency_;
#endif
  bool tensor_ops_ = false;
  int apple_family_ = 7;
};

}  // namespace

std::shared_ptr<gpu::Device> make_device() { return std::make_shared<MetalDevice>(); }

bool system_device_present() { return bool(Owned<id<MTLDevice>>(MTLCreateSystemDefaultDevice())); }

}  // namespace lily::metal
