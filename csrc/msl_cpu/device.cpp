// gpu::Device over the CPU: buffers, libraries, pipelines, encoders, command buffers, and the
// interleaving / dependency checks. See device.h.
#include "msl_cpu/device.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "model/error.h"
#include "msl_cpu/compiler.h"
#include "msl_cpu/encoder.h"
#include "msl_cpu/executor.h"

namespace lily::msl_cpu {
namespace {

[[noreturn]] void fail(const std::string& what) { throw lily::Error("[msl_cpu] " + what); }

class CpuBuffer final : public gpu::Buffer {
 public:
  explicit CpuBuffer(size_t length, bool opaque)
      // Exactly `length` bytes from malloc, so ASan's redzone starts right after the end.
      : data_(static_cast<uint8_t*>(std::calloc(length ? length : 1, 1))), length_(length), owned_(true),
        opaque_(opaque) {
    if (!data_) fail("cannot allocate a buffer of " + std::to_string(length) + " bytes");
  }
  CpuBuffer(void* pointer, size_t length, bool opaque)
      : data_(static_cast<uint8_t*>(pointer)), length_(length), owned_(false), opaque_(opaque) {}
  ~CpuBuffer() override {
    if (owned_) std::free(data_);
  }
  // DeviceOptions::opaque_buffers hides the storage from the host, as device memory is.
  void* contents() override { return opaque_ ? nullptr : data_; }
  size_t length() const override { return length_; }
  void write(size_t offset, const void* data, size_t n) override {
    gpu::check_buffer_range(length_, offset, n, "write");
    if (n) std::memcpy(data_ + offset, data, n);
  }
  void read(size_t offset, void* data, size_t n) override {
    gpu::check_buffer_range(length_, offset, n, "read");
    if (n) std::memcpy(data, data_ + offset, n);
  }
  void fill(size_t offset, uint8_t value, size_t n) override {
    gpu::check_buffer_range(length_, offset, n, "fill");
    if (n) std::memset(data_ + offset, value, n);
  }
  // The storage, for the runtime itself (kernels' bindings, the checking modes' snapshots).
  uint8_t* data() const { return data_; }
  uint64_t gpu_address() const override { return reinterpret_cast<uintptr_t>(data_); }

 private:
  uint8_t* data_;
  size_t length_;
  bool owned_, opaque_;
};

// A bound buffer's storage: a buffer of this runtime (opaque or not).
uint8_t* storage(gpu::Buffer& b) {
  auto* cpu = dynamic_cast<CpuBuffer*>(&b);
  if (!cpu) fail("a bound buffer is not a buffer of an msl_cpu device");
  return cpu->data();
}

class CpuPipeline final : public KernelPipeline {
 public:
  CpuPipeline(std::shared_ptr<Module> module, const lily_msl_kernel* kernel)
      : module_(std::move(module)), kernel_(kernel), name_(kernel->name) {}
  const std::string& name() const override { return name_; }
  // Without [[max_total_threads_per_threadgroup(N)]] a Metal pipeline may allow as few threads as
  // register pressure leaves; 256 is what lily counts on (gpu::kDefaultMaxThreadsPerThreadgroup).
  // Reporting that here makes a kernel dispatched wider without declaring it fail in CI.
  uint32_t max_total_threads_per_threadgroup() const override {
    uint32_t declared = kernel_->max_total_threads_per_threadgroup;
    return declared ? std::min(declared, kMaxThreadsPerThreadgroup) : gpu::kDefaultMaxThreadsPerThreadgroup;
  }
  uint32_t thread_execution_width() const override { return LILY_MSL_SIMD_WIDTH; }
  const char* runtime() const override { return "msl_cpu"; }
  const lily_msl_param* params() const override { return kernel_->params; }
  uint32_t declared_max_threads() const override { return kernel_->max_total_threads_per_threadgroup; }
  const Module* module() const { return module_.get(); }
  const lily_msl_kernel* kernel() const { return kernel_; }

 private:
  std::shared_ptr<Module> module_;
  const lily_msl_kernel* kernel_;
  std::string name_;
};

class CpuLibrary final : public gpu::Library {
 public:
  CpuLibrary(const DeviceOptions& options, std::string source, std::string file_name,
             const gpu::LibraryOptions& library)
      : source_(std::move(source)), file_name_(std::move(file_name)) {
    const bool msl4 = library.language == gpu::LibraryOptions::Language::MSL4_0;
    if (msl4 && !options.metal4)
      fail("compiling " + file_name_ + ": MSL 4.0 needs a Metal 4 device (this one has no tensors)");
    if (!options.fail_library.empty() && file_name_.find(options.fail_library) != std::string::npos)
      fail("compiling " + file_name_ + " failed: injected failure (DeviceOptions::fail_library)");
    // Safe math changes nothing here: the CPU build is IEEE already (no -ffast-math).
    build_.asan = options.asan;
    build_.metal4 = msl4;
    build_.include_dirs = options.include_dirs;
    size_t slash = file_name_.rfind('/');
    if (slash != std::string::npos) build_.include_dirs.push_back(file_name_.substr(0, slash));
    info_ = scan_source(source_, file_name_);
    // Compile now, as newLibraryWithSource does, so errors show at library creation.
    base_ = Module::build(generate_unit(source_, info_, file_name_, nullptr), file_name_, build_);
  }

  std::shared_ptr<gpu::Pipeline> pipeline(const std::string& function,
                                          const gpu::FunctionConstants& constants) override {
    std::shared_ptr<Module> module = base_;
    if (!info_.constants.empty()) {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& m = specialized_[constants.key()];
      if (!m)
        m = Module::build(generate_unit(source_, info_, file_name_, &constants), file_name_,
                          build_);
      module = m;
    }
    const lily_msl_kernel* k = module->find(function);
    if (!k) {
      std::string names;
      for (const auto& n : module->kernel_names()) names += (names.empty() ? "" : ", ") + n;
      fail("function '" + function + "' is not in " + file_name_ + " (it has: " + names + ")");
    }
    return std::make_shared<CpuPipeline>(module, k);
  }

 private:
  std::string source_, file_name_;
  BuildOptions build_;
  SourceInfo info_;
  std::shared_ptr<Module> base_;
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<Module>> specialized_;
};

// ---- execution and checks --------------------------------------------------------------------

using Snapshot = std::vector<std::pair<gpu::Buffer*, std::vector<uint8_t>>>;

std::vector<gpu::Buffer*> buffers_of(const std::vector<const Command*>& cmds) {
  std::vector<gpu::Buffer*> out;
  auto add = [&](gpu::Buffer* b) {
    if (std::find(out.begin(), out.end(), b) == out.end()) out.push_back(b);
  };
  for (const Command* c : cmds) {
    for (const Binding& b : c->buffers)
      if (b.bound && b.buffer) add(b.buffer.get());
    for (const auto& r : c->resources) add(r.get());  // reached through argument data
  }
  return out;
}
Snapshot take(const std::vector<gpu::Buffer*>& bufs) {
  Snapshot s;
  for (gpu::Buffer* b : bufs) {
    const uint8_t* p = storage(*b);
    s.emplace_back(b, std::vector<uint8_t>(p, p + b->length()));
  }
  return s;
}
// Only buffers that changed are written back: a zero-copy wrap of read-only memory (the
// mmapped weights) is never written, so it must not be touched.
void restore(const Snapshot& s) {
  for (const auto& [b, bytes] : s)
    if (!bytes.empty() && std::memcmp(storage(*b), bytes.data(), bytes.size()) != 0)
      std::memcpy(storage(*b), bytes.data(), bytes.size());
}
// The first buffer that differs, described by the bindings that name it; "" if none.
std::string first_difference(const Snapshot& a, const Snapshot& b,
                             const std::vector<const Command*>& cmds) {
  for (size_t i = 0; i < a.size(); ++i) {
    const auto& x = a[i].second;
    const auto& y = b[i].second;
    size_t at = 0;
    while (at < x.size() && x[at] == y[at]) ++at;
    if (at == x.size()) continue;
    std::string names;
    for (const Command* c : cmds)
      for (uint32_t k = 0; k < LILY_MSL_MAX_BINDINGS; ++k)
        if (c->buffers[k].buffer.get() == a[i].first) {
          std::string n = "buffer(" + std::to_string(k) + ") '" +
                          param_name(c->pipeline->params(), LILY_MSL_PARAM_BUFFER,
                                     LILY_MSL_PARAM_BUFFER_REF, k) +
                          "'";
          if (names.find(n) == std::string::npos) names += (names.empty() ? "" : " / ") + n;
        }
    if (names.empty()) names = "a buffer reached through argument data (use_resource)";
    return names + " differs at byte " + std::to_string(at);
  }
  return "";
}

class CpuCommandBuffer final : public gpu::CommandBuffer {
 public:
  CpuCommandBuffer(const DeviceOptions& options, std::shared_ptr<EncoderFaults> faults)
      : options_(options), faults_(std::move(faults)) {}

  std::shared_ptr<gpu::ComputeEncoder> compute_encoder(gpu::DispatchType type, const std::string& label) override {
    if (committed_) fail("compute_encoder: the command buffer is already committed");
    for (const auto& e : encoders_)
      if (!e->ended()) fail("compute_encoder: the previous encoder was not ended (end_encoding)");
    encoders_.push_back(std::make_shared<RecordingEncoder>("msl_cpu", type, label, faults_));
    return encoders_.back();
  }
  void commit() override {
    if (committed_) fail("commit: the command buffer was already committed");
    committed_ = true;
    try {
      for (const auto& e : encoders_) {
        if (!e->ended()) fail("commit: an encoder was not ended (end_encoding)");
        try {
          run_encoder(*e);
        } catch (const lily::Error& err) {
          // Which encoder failed, as Metal's encoder execution status reports it.
          const std::string label = e->label().empty() ? "(no label)" : "'" + e->label() + "'";
          const std::string after = last_signpost_.empty() ? "" : " after signpost '" + last_signpost_ + "'";
          error_ = std::string(err.what()) + " [encoder " + label + after + "]";
          break;
        }
      }
    } catch (const lily::Error& err) {
      error_ = err.what();
    }
    encoders_.clear();  // release what the commands held, as a completed Metal buffer does
  }
  void wait_until_completed() override {
    if (!committed_) fail("wait_until_completed: the command buffer was not committed");
    if (!error_.empty()) throw lily::Error(error_);
  }

 private:
  void run_dispatch(const Command& c) {
    last_signpost_ = c.signpost;
    const auto* pipeline = static_cast<const CpuPipeline*>(c.pipeline.get());  // set_pipeline checked
    DispatchRun r;
    r.module = pipeline->module();
    r.kernel = pipeline->kernel();
    r.threadgroups = c.threadgroups;
    r.threads = c.threads;
    r.stack_bytes = options_.asan ? 1024 * 1024 : 256 * 1024;
    for (uint32_t i = 0; i < LILY_MSL_MAX_BINDINGS; ++i) {
      const Binding& b = c.buffers[i];
      if (!b.bound) continue;
      if (b.buffer) {
        r.bindings.buffers[i] = storage(*b.buffer) + b.offset;
        r.bindings.buffer_lengths[i] = b.buffer->length() - b.offset;
      } else {
        r.bindings.buffers[i] = const_cast<uint8_t*>(b.bytes.data());
        r.bindings.buffer_lengths[i] = b.bytes.size();
      }
      r.bindings.threadgroup_memory_lengths[i] = c.threadgroup_lengths[i];
    }
    for (uint32_t i = 0; i < LILY_MSL_MAX_BINDINGS; ++i)
      r.bindings.threadgroup_memory_lengths[i] = c.threadgroup_lengths[i];
    if (options_.interleavings <= 0) {
      execute(r);
      return;
    }
    // Interleaving check: the same inputs under other thread orders must give the same bytes.
    const std::vector<const Command*> cmds = {&c};
    const auto bufs = buffers_of(cmds);
    const Snapshot before = take(bufs);
    execute(r);
    const Snapshot reference = take(bufs);
    for (int k = 1; k <= options_.interleavings; ++k) {
      restore(before);
      r.randomize = true;
      r.seed = options_.seed * 1000003u + uint64_t(k);
      execute(r);
      std::string diff = first_difference(reference, take(bufs), cmds);
      if (!diff.empty()) {
        restore(reference);
        fail("kernel '" + c.pipeline->name() + "': the result depends on the order its threads " +
             "run in: " + diff + " between two thread interleavings (seed " +
             std::to_string(r.seed) + "). A threadgroup_barrier is missing, or threads race " +
             "on the same memory");
      }
    }
    restore(reference);
  }

  void run_stage(const std::vector<const Command*>& stage) {
    if (!options_.check_dependencies || stage.size() < 2) {
      for (const Command* c : stage) run_dispatch(*c);
      return;
    }
    // Dependency check: the encoder claims these dispatches independent; any order must do.
    const auto bufs = buffers_of(stage);
    const Snapshot before = take(bufs);
    for (const Command* c : stage) run_dispatch(*c);
    const Snapshot forward = take(bufs);
    restore(before);
    for (auto it = stage.rbegin(); it != stage.rend(); ++it) run_dispatch(**it);
    std::string diff = first_difference(forward, take(bufs), stage);
    if (diff.empty()) {
      restore(forward);
      return;
    }
    // Name a pair whose order matters.
    for (size_t i = 0; i < stage.size(); ++i) {
      for (size_t j = i + 1; j < stage.size(); ++j) {
        restore(before);
        run_dispatch(*stage[i]);
        run_dispatch(*stage[j]);
        const Snapshot a = take(bufs);
        restore(before);
        run_dispatch(*stage[j]);
        run_dispatch(*stage[i]);
        std::string d = first_difference(a, take(bufs), {stage[i], stage[j]});
        if (!d.empty()) {
          restore(forward);
          fail("dispatches " + std::to_string(i) + " (kernel '" + stage[i]->pipeline->name() +
               "') and " + std::to_string(j) + " (kernel '" + stage[j]->pipeline->name() +
               "') of a concurrent encoder have no memory barrier between them but are not "
               "independent: in the other order " + d + ". Add memory_barrier() between them");
        }
      }
    }
    restore(forward);
    std::string names;
    for (const Command* c : stage) names += (names.empty() ? "'" : ", '") + c->pipeline->name() + "'";
    fail("the dispatches " + names + " of a concurrent encoder have no memory barrier between "
         "them but their result depends on their order: " + diff);
  }

  void run_encoder(const RecordingEncoder& e) {
    std::vector<const Command*> stage;
    for (const Command& c : e.commands()) {
      if (c.barrier) {
        run_stage(stage);
        stage.clear();
      } else if (e.type() == gpu::DispatchType::Serial) {
        run_dispatch(c);  // a serial encoder orders every dispatch after the previous one
      } else {
        stage.push_back(&c);
      }
    }
    run_stage(stage);
  }

  DeviceOptions options_;
  std::shared_ptr<EncoderFaults> faults_;
  std::vector<std::shared_ptr<RecordingEncoder>> encoders_;
  bool committed_ = false;
  std::string error_, last_signpost_;
};

class CpuDevice final : public gpu::Device {
 public:
  explicit CpuDevice(DeviceOptions options) : options_(std::move(options)), faults_(std::make_shared<EncoderFaults>()) {
    faults_->kernel = options_.fail_dispatch;
    faults_->remaining = options_.fail_dispatch.empty() ? 0 : options_.fail_dispatch_count;
    if (options_.apple_gpu_family < 7 || options_.apple_gpu_family > 10)
      fail("apple_gpu_family must be 7 (M1) to 10 (M5), not " + std::to_string(options_.apple_gpu_family));
  }
  std::string name() const override {
    return std::string("msl_cpu (MSL on the CPU, 32-wide simdgroups") +
           (options_.asan ? ", AddressSanitizer" : "") + (options_.metal4 ? ", Metal 4 tensors emulated" : "") +
           (options_.opaque_buffers ? ", opaque buffers" : "") + ")";
  }
  bool unified_memory() const override { return !options_.opaque_buffers; }
  bool supports_tensor_ops() const override { return options_.metal4; }
  int apple_gpu_family() const override { return options_.apple_gpu_family; }
  uint64_t recommended_max_working_set_size() const override { return options_.working_set; }
  void make_resident(const std::vector<std::shared_ptr<gpu::Buffer>>&) override {}  // all memory is the CPU's
  std::shared_ptr<gpu::Buffer> new_buffer(size_t length) override {
    return std::make_shared<CpuBuffer>(length, options_.opaque_buffers);
  }
  std::shared_ptr<gpu::Buffer> wrap_buffer(void* pointer, size_t length) override {
    return std::make_shared<CpuBuffer>(pointer, length, options_.opaque_buffers);
  }
  void copy(gpu::Buffer& dst, size_t dst_offset, gpu::Buffer& src, size_t src_offset, size_t n) override {
    gpu::check_buffer_range(dst.length(), dst_offset, n, "copy");
    gpu::check_buffer_range(src.length(), src_offset, n, "copy");
    if (n) std::memmove(storage(dst) + dst_offset, storage(src) + src_offset, n);
  }
  std::shared_ptr<gpu::Library> new_library(const std::string& source, const std::string& file_name,
                                            const gpu::LibraryOptions& library) override {
    return std::make_shared<CpuLibrary>(options_, source, file_name, library);
  }
  std::shared_ptr<gpu::CommandBuffer> new_command_buffer() override {
    return std::make_shared<CpuCommandBuffer>(options_, faults_);
  }

 private:
  DeviceOptions options_;
  std::shared_ptr<EncoderFaults> faults_;
};

}  // namespace

std::shared_ptr<gpu::Device> make_device(const DeviceOptions& options) {
  return std::make_shared<CpuDevice>(options);
}

}  // namespace lily::msl_cpu
