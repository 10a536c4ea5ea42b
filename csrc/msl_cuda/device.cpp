// gpu::Device over the CUDA driver: buffers, libraries, pipelines, command buffers. See device.h.
#include "msl_cuda/device.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>

#include "model/error.h"
#include "msl_cpu/compiler.h"
#include "msl_cpu/encoder.h"
#include "msl_cuda/compiler.h"
#include "msl_cuda/driver.h"
#include "msl_cuda/launch.h"

namespace lily::msl_cuda {
namespace {

[[noreturn]] void fail(const std::string& what) { throw lily::Error("[msl_cuda] " + what); }

// The GPU, its primary context, and the two streams every object of one device uses: `work`
// runs command buffers in order; `copy` carries the host's immediate reads and writes.
struct Context {
  const Driver& d;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  CUstream work = nullptr, copy = nullptr;
  std::string gpu_name;
  int cc_major = 0, cc_minor = 0;
  uint64_t total_memory = 0;  // bytes
  uint64_t seed = 0;
  std::atomic<uint64_t> dispatches{0};  // draws the next permutation
  std::mutex timings_mutex;
  std::vector<DispatchTime> timings;

  explicit Context(int ordinal) : d(driver()) {
    int n = 0;
    d.check(d.cuDeviceGetCount(&n), "cuDeviceGetCount");
    if (ordinal < 0 || ordinal >= n)
      fail("no CUDA GPU " + std::to_string(ordinal) + " (the driver sees " + std::to_string(n) + ")");
    d.check(d.cuDeviceGet(&dev, ordinal), "cuDeviceGet");
    d.check(d.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    current();
    d.check(d.cuStreamCreate(&work, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    d.check(d.cuStreamCreate(&copy, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    char name[256] = {};
    d.check(d.cuDeviceGetName(name, sizeof name - 1, dev), "cuDeviceGetName");
    gpu_name = name;
    d.check(d.cuDeviceGetAttribute(&cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute");
    d.check(d.cuDeviceGetAttribute(&cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute");
    size_t bytes = 0;
    d.check(d.cuDeviceTotalMem(&bytes, dev), "cuDeviceTotalMem");
    total_memory = bytes;
    if (cc_major * 10 + cc_minor < 90)
      fail("GPU " + gpu_name + " is sm_" + std::to_string(cc_major * 10 + cc_minor) +
           "; the kernels are compiled for sm_90 (Hopper) and later");
  }
  ~Context() {
    d.cuCtxSetCurrent(ctx);
    if (work) d.cuStreamDestroy(work);
    if (copy) d.cuStreamDestroy(copy);
    d.cuDevicePrimaryCtxRelease(dev);
  }
  void current() const { d.check(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent"); }
  void check(CUresult r, const std::string& what) const { d.check(r, what); }
  // Runs `op` on the copy stream and waits for it.
  void copy_now(CUresult r, const std::string& what) const {
    check(r, what);
    check(d.cuStreamSynchronize(copy), what);
  }
};

class CudaBuffer final : public gpu::Buffer {
 public:
  // Zero-filled, as msl_cpu's (calloc) are, unless `initial` (length bytes) is copied in.
  CudaBuffer(std::shared_ptr<Context> c, size_t length, const void* initial = nullptr)
      : c_(std::move(c)), length_(length) {
    c_->current();
    c_->check(c_->d.cuMemAlloc(&ptr_, length ? length : 1),
              "cuMemAlloc of " + std::to_string(length) + " bytes");
    if (initial)
      write(0, initial, length);
    else
      fill(0, 0, length);
  }
  ~CudaBuffer() override {
    c_->d.cuCtxSetCurrent(c_->ctx);
    c_->d.cuMemFree(ptr_);
  }
  void* contents() override { return nullptr; }
  size_t length() const override { return length_; }
  void write(size_t offset, const void* data, size_t n) override {
    gpu::check_buffer_range(length_, offset, n, "write");
    if (!n) return;
    c_->current();
    c_->copy_now(c_->d.cuMemcpyHtoDAsync(ptr_ + offset, data, n, c_->copy), "Buffer::write");
  }
  void read(size_t offset, void* data, size_t n) override {
    gpu::check_buffer_range(length_, offset, n, "read");
    if (!n) return;
    c_->current();
    c_->copy_now(c_->d.cuMemcpyDtoHAsync(data, ptr_ + offset, n, c_->copy), "Buffer::read");
  }
  void fill(size_t offset, uint8_t value, size_t n) override {
    gpu::check_buffer_range(length_, offset, n, "fill");
    if (!n) return;
    c_->current();
    c_->copy_now(c_->d.cuMemsetD8Async(ptr_ + offset, value, n, c_->copy), "Buffer::fill");
  }
  CUdeviceptr address() const { return ptr_; }
  uint64_t gpu_address() const override { return uint64_t(ptr_); }

 private:
  std::shared_ptr<Context> c_;
  size_t length_;
  CUdeviceptr ptr_ = 0;
};

// A loaded PTX module; unloaded when the last pipeline made from it goes.
struct LoadedModule {
  std::shared_ptr<Context> c;
  CUmodule mod = nullptr;
  PtxModule ptx;

  LoadedModule(std::shared_ptr<Context> context, PtxModule p, const std::string& file_name)
      : c(std::move(context)), ptx(std::move(p)) {
    c->current();
    // The driver compiles the PTX for this GPU now; its assembler's errors name the problem.
    static char log[8192];
    static std::mutex log_mutex;
    std::lock_guard<std::mutex> lock(log_mutex);
    log[0] = 0;
    int keys[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, CU_JIT_GENERATE_LINE_INFO};
    void* values[] = {log, reinterpret_cast<void*>(uintptr_t(sizeof log)), reinterpret_cast<void*>(uintptr_t(1))};
    CUresult r = c->d.cuModuleLoadDataEx(&mod, ptx.text.c_str(), 3, keys, values);
    if (r != CUDA_SUCCESS)
      fail("loading the PTX of " + file_name + " (" + ptx.path + ") failed: " + c->d.describe(r) +
           (log[0] ? std::string("\n") + log : std::string()));
  }
  ~LoadedModule() {
    if (!mod) return;
    c->d.cuCtxSetCurrent(c->ctx);
    c->d.cuModuleUnload(mod);
  }
};

class CudaPipeline final : public msl_cpu::KernelPipeline {
 public:
  CudaPipeline(std::shared_ptr<LoadedModule> module, const EntryInfo& entry,
               const msl_cpu::KernelDecl& decl, const msl_cpu::SourceInfo& info,
               const gpu::FunctionConstants* constants, const std::string& file_name)
      : module_(std::move(module)), name_(entry.host_name) {
    if (entry.bound_sizes.size() != decl.params.size())
      fail("kernel '" + name_ + "': the PTX has " + std::to_string(entry.bound_sizes.size()) +
           " parameters, the source " + std::to_string(decl.params.size()) + " (stale kernel cache?)");
    for (const auto& p : decl.params) names_.push_back(p.name);
    for (size_t i = 0; i < decl.params.size(); ++i) {
      const auto& p = decl.params[i];
      lily_msl_param q{LILY_MSL_PARAM_BUILTIN, 0, 0, names_[i].c_str(), 0};
      if (!msl_cpu::parameter_present(info, p, constants, file_name)) {
        q.kind = LILY_MSL_PARAM_ABSENT;
        q.index = p.index;
      } else if (p.attribute == "buffer") {
        q.kind = entry.bound_sizes[i] ? LILY_MSL_PARAM_BUFFER_REF : LILY_MSL_PARAM_BUFFER;
        q.index = p.index;
        q.size = entry.bound_sizes[i];
      } else if (p.attribute == "threadgroup") {
        q.kind = LILY_MSL_PARAM_THREADGROUP;
        q.index = p.index;
      }
      params_.push_back(q);
    }
    params_.push_back({LILY_MSL_PARAM_END, 0, 0, nullptr, 0});
    const Context& c = *module_->c;
    c.check(c.d.cuModuleGetFunction(&fn_, module_->mod, name_.c_str()), "cuModuleGetFunction '" + name_ + "'");
    auto attr = [&](int a) {
      int v = 0;
      c.check(c.d.cuFuncGetAttribute(&v, a, fn_), "cuFuncGetAttribute");
      return v;
    };
    res_.registers = attr(CU_FUNC_ATTRIBUTE_NUM_REGS);
    res_.local_bytes = attr(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES);
    res_.static_shared_bytes = attr(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES);
    res_.max_threads = attr(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
    // The kernel's declared maximum (without one, the 256 a Metal pipeline is sure to allow:
    // gpu::kDefaultMaxThreadsPerThreadgroup), within Metal's 1024 and what its registers allow.
    declared_max_threads_ = entry.max_threads;
    max_threads_ = std::min<uint32_t>(
        declared_max_threads_ ? std::min(declared_max_threads_, msl_cpu::kMaxThreadsPerThreadgroup)
                              : gpu::kDefaultMaxThreadsPerThreadgroup,
        uint32_t(res_.max_threads));
  }
  const std::string& name() const override { return name_; }
  uint32_t max_total_threads_per_threadgroup() const override { return max_threads_; }
  uint32_t declared_max_threads() const override { return declared_max_threads_; }
  uint32_t thread_execution_width() const override { return 32; }
  const char* runtime() const override { return "msl_cuda"; }
  const lily_msl_param* params() const override { return params_.data(); }
  size_t static_threadgroup_bytes() const override { return size_t(res_.static_shared_bytes); }
  CUfunction function() const { return fn_; }
  const KernelResources& kernel_resources() const { return res_; }

 private:
  std::shared_ptr<LoadedModule> module_;
  std::string name_;
  std::vector<std::string> names_;
  std::vector<lily_msl_param> params_;
  CUfunction fn_ = nullptr;
  KernelResources res_;
  uint32_t max_threads_ = 0, declared_max_threads_ = 0;
};

class CudaLibrary final : public gpu::Library {
 public:
  CudaLibrary(std::shared_ptr<Context> c, const DeviceOptions& options, std::string source, std::string file_name,
              const gpu::LibraryOptions& library)
      : c_(std::move(c)), source_(std::move(source)), file_name_(std::move(file_name)) {
    if (library.language == gpu::LibraryOptions::Language::MSL4_0)
      fail("compiling " + file_name_ + ": MSL 4.0 needs Metal 4 tensors, which msl_cuda does not provide "
           "(supports_tensor_ops is false; the simdgroup_matrix GEMMs run instead)");
    compile_.safe_math = library.safe_math;
    compile_.include_dirs = options.include_dirs;
    size_t slash = file_name_.rfind('/');
    if (slash != std::string::npos) compile_.include_dirs.push_back(file_name_.substr(0, slash));
    info_ = msl_cpu::scan_source(source_, file_name_);
    base_ = load(nullptr);  // as newLibraryWithSource: errors show at library creation
  }

  std::shared_ptr<gpu::Pipeline> pipeline(const std::string& function,
                                          const gpu::FunctionConstants& constants) override {
    std::shared_ptr<LoadedModule> module = base_;
    if (!info_.constants.empty()) {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& m = specialized_[constants.key()];
      if (!m) m = load(&constants);
      module = m;
    }
    std::string names;
    for (const auto& e : module->ptx.entries) {
      if (e.host_name != function) {
        names += (names.empty() ? "" : ", ") + e.host_name;
        continue;
      }
      for (const auto& k : info_.kernels)
        if (k.name == e.kernel)
          return std::make_shared<CudaPipeline>(module, e, k, info_, info_.constants.empty() ? nullptr : &constants,
                                                file_name_);
      fail("kernel '" + function + "' instantiates '" + e.kernel + "', which the scan of " +
           file_name_ + " did not find");
    }
    fail("function '" + function + "' is not in " + file_name_ + " (it has: " + names + ")");
  }

 private:
  std::shared_ptr<LoadedModule> load(const gpu::FunctionConstants* constants) {
    const std::string unit = msl_cpu::generate_unit(source_, info_, file_name_, constants);
    return std::make_shared<LoadedModule>(c_, build_ptx(unit, file_name_, compile_), file_name_);
  }
  std::shared_ptr<Context> c_;
  std::string source_, file_name_;
  CompileOptions compile_;
  msl_cpu::SourceInfo info_;
  std::shared_ptr<LoadedModule> base_;
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<LoadedModule>> specialized_;
};

class CudaCommandBuffer final : public gpu::CommandBuffer {
 public:
  CudaCommandBuffer(std::shared_ptr<Context> c, const DeviceOptions& options)
      : c_(std::move(c)), options_(options) {}
  ~CudaCommandBuffer() override {
    if (done_) c_->d.cuEventSynchronize(done_);  // nothing is freed under a running kernel
    release();
  }

  std::shared_ptr<gpu::ComputeEncoder> compute_encoder(gpu::DispatchType type, const std::string& label) override {
    if (committed_) fail("compute_encoder: the command buffer is already committed");
    for (const auto& e : encoders_)
      if (!e->ended()) fail("compute_encoder: the previous encoder was not ended (end_encoding)");
    encoders_.push_back(std::make_shared<msl_cpu::RecordingEncoder>("msl_cuda", type, label));
    return encoders_.back();
  }
  void commit() override {
    if (committed_) fail("commit: the command buffer was already committed");
    committed_ = true;
    try {
      for (const auto& e : encoders_)
        if (!e->ended()) fail("commit: an encoder was not ended (end_encoding)");
      launch();
    } catch (const lily::Error& err) {
      error_ = err.what();
    }
  }
  void wait_until_completed() override {
    if (!committed_) fail("wait_until_completed: the command buffer was not committed");
    if (error_.empty() && done_) {
      CUresult r = c_->d.cuEventSynchronize(done_);
      if (r != CUDA_SUCCESS) {
        std::string names;
        for (const auto& l : launches_) names += (names.empty() ? "" : ", ") + describe(l);
        error_ = "[msl_cuda] a kernel of this command buffer failed: " + c_->d.describe(r) +
                 " (kernels: " + names + "; a device made with synchronous=True names the one)";
      } else {
        record_timings();
      }
    }
    release();
    if (!error_.empty()) throw lily::Error(error_);
  }

 private:
  struct Launch {
    const CudaPipeline* pipeline;
    const msl_cpu::Command* command;
    const std::string* encoder;  // its label
    lily_msl_cuda_args args;
    std::array<int64_t, LILY_MSL_MAX_BINDINGS> staged;  // set_bytes at this staging offset
    int64_t order = -1;                                       // permutation at this offset
    uint32_t blocks = 0;
    size_t shared = 0;
  };

  void launch() {
    c_->current();
    // Marshal every dispatch first; set_bytes data and permutations into one staging block.
    Staging staging;
    for (const auto& e : encoders_) {
      for (const msl_cpu::Command& cmd : e->commands()) {
        if (cmd.barrier) continue;  // one stream in order: every dispatch already waits
        Launch l{};
        l.pipeline = static_cast<const CudaPipeline*>(cmd.pipeline.get());  // set_pipeline checked
        l.command = &cmd;
        l.encoder = &e->label();
        l.staged.fill(-1);
        l.blocks = launch_blocks(cmd.threadgroups, l.pipeline->name());
        for (uint32_t i = 0; i < LILY_MSL_MAX_BINDINGS; ++i) {
          const msl_cpu::Binding& b = cmd.buffers[i];
          if (!b.bound) continue;
          if (!b.buffer) {
            l.staged[i] = int64_t(staging.add(b.bytes.data(), b.bytes.size(), 16));
            continue;
          }
          const auto* cb = dynamic_cast<const CudaBuffer*>(b.buffer.get());
          if (!cb)
            fail("kernel '" + l.pipeline->name() + "': buffer(" + std::to_string(i) +
                 ") is not a buffer of an msl_cuda device");
          l.args.buffers[i] = cb->address() + b.offset;
        }
        l.shared = threadgroup_layout(cmd.threadgroup_lengths, l.args.threadgroup_offsets);
        l.args.threadgroups_per_grid[0] = cmd.threadgroups.width;
        l.args.threadgroups_per_grid[1] = cmd.threadgroups.height;
        l.args.threadgroups_per_grid[2] = cmd.threadgroups.depth;
        if (options_.permute_threadgroups) {
          const auto order = threadgroup_permutation(l.blocks, c_->seed * 0x9E3779B97F4A7C15ull + c_->dispatches++);
          l.order = int64_t(staging.add(order.data(), order.size() * 4, 4));
        }
        launches_.push_back(l);
      }
    }
    if (!staging.bytes().empty()) {
      const size_t n = staging.bytes().size();
      c_->check(c_->d.cuMemAllocHost(&host_staging_, n), "cuMemAllocHost");
      std::memcpy(host_staging_, staging.bytes().data(), n);
      c_->check(c_->d.cuMemAlloc(&staging_, n), "cuMemAlloc (staging)");
      c_->check(c_->d.cuMemcpyHtoDAsync(staging_, host_staging_, n, c_->work), "uploading set_bytes data");
    }
    if (options_.timing) {
      events_.resize(launches_.size() + 1);
      for (auto& ev : events_) c_->check(c_->d.cuEventCreate(&ev, CU_EVENT_DEFAULT), "cuEventCreate");
      c_->check(c_->d.cuEventRecord(events_[0], c_->work), "cuEventRecord");
    }
    for (size_t k = 0; k < launches_.size(); ++k) {
      Launch& l = launches_[k];
      for (uint32_t i = 0; i < LILY_MSL_MAX_BINDINGS; ++i)
        if (l.staged[i] >= 0) l.args.buffers[i] = staging_ + uint64_t(l.staged[i]);
      if (l.order >= 0) l.args.threadgroup_order = staging_ + uint64_t(l.order);
      const gpu::Size3 t = l.command->threads;
      void* params[] = {&l.args};
      c_->check(c_->d.cuLaunchKernel(l.pipeline->function(), l.blocks, 1, 1, t.width, t.height, t.depth,
                                     unsigned(l.shared), c_->work, params, nullptr),
                "launching kernel '" + l.pipeline->name() + "'");
      if (options_.timing) c_->check(c_->d.cuEventRecord(events_[k + 1], c_->work), "cuEventRecord");
      if (options_.synchronous) {
        CUresult r = c_->d.cuStreamSynchronize(c_->work);
        if (r != CUDA_SUCCESS) fail(describe(l) + " failed: " + c_->d.describe(r));
      }
    }
    c_->check(c_->d.cuEventCreate(&done_, CU_EVENT_DEFAULT), "cuEventCreate");
    c_->check(c_->d.cuEventRecord(done_, c_->work), "cuEventRecord");
  }

  // "'kernel'", with the encoder's label and the last debug signpost before it where there are
  // (as Metal's encoder execution status names the encoder).
  static std::string describe(const Launch& l) {
    std::string s = "'" + l.pipeline->name() + "'";
    if (!l.encoder->empty() || !l.command->signpost.empty()) {
      s += " [encoder " + (l.encoder->empty() ? std::string("(no label)") : "'" + *l.encoder + "'");
      if (!l.command->signpost.empty()) s += " after signpost '" + l.command->signpost + "'";
      s += "]";
    }
    return s;
  }

  void record_timings() {
    if (events_.empty()) return;
    std::vector<DispatchTime> times;
    for (size_t k = 0; k < launches_.size(); ++k) {
      float ms = 0;
      c_->check(c_->d.cuEventElapsedTime(&ms, events_[k], events_[k + 1]), "cuEventElapsedTime");
      times.push_back({launches_[k].pipeline->name(), launches_[k].command->threadgroups,
                       launches_[k].command->threads, double(ms)});
    }
    std::lock_guard<std::mutex> lock(c_->timings_mutex);
    c_->timings.insert(c_->timings.end(), times.begin(), times.end());
  }

  // What the command buffer held until it completed (Metal retains its resources too).
  void release() {
    c_->d.cuCtxSetCurrent(c_->ctx);
    for (CUevent ev : events_) c_->d.cuEventDestroy(ev);
    events_.clear();
    if (done_) c_->d.cuEventDestroy(done_);
    done_ = nullptr;
    if (staging_) c_->d.cuMemFree(staging_);
    staging_ = 0;
    if (host_staging_) c_->d.cuMemFreeHost(host_staging_);
    host_staging_ = nullptr;
    launches_.clear();
    encoders_.clear();
  }

  std::shared_ptr<Context> c_;
  DeviceOptions options_;
  std::vector<std::shared_ptr<msl_cpu::RecordingEncoder>> encoders_;
  std::vector<Launch> launches_;
  std::vector<CUevent> events_;
  CUevent done_ = nullptr;
  CUdeviceptr staging_ = 0;
  void* host_staging_ = nullptr;
  bool committed_ = false;
  std::string error_;
};

class CudaDevice final : public gpu::Device {
 public:
  explicit CudaDevice(DeviceOptions options)
      : options_(std::move(options)), c_(std::make_shared<Context>(options_.ordinal)) {
    c_->seed = options_.seed;
  }
  std::string name() const override {
    return "msl_cuda (" + c_->gpu_name + ", sm_" + std::to_string(c_->cc_major * 10 + c_->cc_minor) +
           ", CUDA driver " + std::to_string(c_->d.version / 1000) + "." +
           std::to_string(c_->d.version % 1000 / 10) + (options_.permute_threadgroups ? ", threadgroups permuted" : "") + ")";
  }
  bool unified_memory() const override { return false; }
  // What every Apple GPU lily supports runs here (no Metal 4 tensor ops): the baseline family.
  int apple_gpu_family() const override { return 7; }
  // The GPU's memory (cuDeviceTotalMem): what a context must fit beside the weights.
  uint64_t recommended_max_working_set_size() const override { return c_->total_memory; }
  void make_resident(const std::vector<std::shared_ptr<gpu::Buffer>>&) override {}  // device memory is resident
  std::shared_ptr<gpu::Buffer> new_buffer(size_t length) override {
    return std::make_shared<CudaBuffer>(c_, length);
  }
  std::shared_ptr<gpu::Buffer> wrap_buffer(void* pointer, size_t length) override {
    return std::make_shared<CudaBuffer>(c_, length, pointer);
  }
  void copy(gpu::Buffer& dst, size_t dst_offset, gpu::Buffer& src, size_t src_offset, size_t n) override {
    auto* d = dynamic_cast<CudaBuffer*>(&dst);
    auto* s = dynamic_cast<CudaBuffer*>(&src);
    if (!d || !s) fail("copy: not buffers of an msl_cuda device");
    gpu::check_buffer_range(d->length(), dst_offset, n, "copy");
    gpu::check_buffer_range(s->length(), src_offset, n, "copy");
    if (!n) return;
    c_->current();
    c_->copy_now(c_->d.cuMemcpyDtoDAsync(d->address() + dst_offset, s->address() + src_offset, n, c_->copy),
                 "Device::copy");
  }
  std::shared_ptr<gpu::Library> new_library(const std::string& source, const std::string& file_name,
                                            const gpu::LibraryOptions& library) override {
    return std::make_shared<CudaLibrary>(c_, options_, source, file_name, library);
  }
  std::shared_ptr<gpu::CommandBuffer> new_command_buffer() override {
    return std::make_shared<CudaCommandBuffer>(c_, options_);
  }
  std::vector<DispatchTime> take_timings() {
    std::lock_guard<std::mutex> lock(c_->timings_mutex);
    std::vector<DispatchTime> out;
    out.swap(c_->timings);
    return out;
  }

 private:
  DeviceOptions options_;
  std::shared_ptr<Context> c_;
};

}  // namespace

std::shared_ptr<gpu::Device> make_device(const DeviceOptions& options) {
  return std::make_shared<CudaDevice>(options);
}

std::vector<DispatchTime> take_timings(gpu::Device& device) {
  auto* d = dynamic_cast<CudaDevice*>(&device);
  if (!d) fail("take_timings: not an msl_cuda device");
  return d->take_timings();
}

KernelResources resources(const gpu::Pipeline& pipeline) {
  auto* p = dynamic_cast<const CudaPipeline*>(&pipeline);
  if (!p) fail("resources: not a pipeline of an msl_cuda device");
  return p->kernel_resources();
}

}  // namespace lily::msl_cuda
