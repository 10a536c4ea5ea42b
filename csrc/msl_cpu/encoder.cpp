// The recording compute encoder shared by the MSL runtimes; see encoder.h.
#include "msl_cpu/encoder.h"

#include <algorithm>
#include <cstring>

#include "model/error.h"

namespace lily::msl_cpu {

std::string param_name(const lily_msl_param* params, int kind_a, int kind_b, uint32_t index) {
  for (const lily_msl_param* p = params; p->kind != LILY_MSL_PARAM_END; ++p)
    if ((p->kind == kind_a || p->kind == kind_b) && p->index == index) return p->name;
  return "?";
}

std::string KernelPipeline::buffer_name(uint32_t index) const {
  for (const lily_msl_param* p = params(); p->kind != LILY_MSL_PARAM_END; ++p)
    if ((p->kind == LILY_MSL_PARAM_BUFFER || p->kind == LILY_MSL_PARAM_BUFFER_REF ||
         p->kind == LILY_MSL_PARAM_ABSENT) && p->index == index)
      return p->name;
  return {};
}

void RecordingEncoder::fail(const std::string& what) const {
  throw lily::Error("[" + std::string(runtime_) + "] " + what);
}

void RecordingEncoder::check_open() const {
  if (ended_) fail("the encoder was used after end_encoding()");
}

void RecordingEncoder::check_index(uint32_t index, const char* what) const {
  if (index >= LILY_MSL_MAX_BINDINGS)
    fail(std::string(what) + ": index " + std::to_string(index) + " is past Metal's 31");
}

void RecordingEncoder::set_pipeline(const std::shared_ptr<gpu::Pipeline>& pipeline) {
  check_open();
  state_.pipeline = std::dynamic_pointer_cast<KernelPipeline>(pipeline);
  if (!state_.pipeline || std::strcmp(state_.pipeline->runtime(), runtime_) != 0)
    fail("set_pipeline: not a pipeline of an " + std::string(runtime_) + " device");
}

void RecordingEncoder::set_buffer(uint32_t index, const std::shared_ptr<gpu::Buffer>& buffer,
                                  size_t offset) {
  check_open();
  check_index(index, "set_buffer");
  if (!buffer) fail("set_buffer: null buffer at index " + std::to_string(index));
  if (offset > buffer->length())
    fail("set_buffer: offset " + std::to_string(offset) + " is past the end of a buffer of " +
         std::to_string(buffer->length()) + " bytes (index " + std::to_string(index) + ")");
  state_.buffers[index] = Binding{buffer, offset, {}, true};
}

void RecordingEncoder::set_bytes(uint32_t index, const void* bytes, size_t length) {
  check_open();
  check_index(index, "set_bytes");
  if (length > gpu::kMaxSetBytes)
    fail("set_bytes: " + std::to_string(length) + " bytes at index " + std::to_string(index) +
         " are more than the " + std::to_string(gpu::kMaxSetBytes) + " Metal's setBytes takes; use a buffer");
  Binding& b = state_.buffers[index];
  b = Binding{nullptr, 0, std::vector<uint8_t>(length), true};
  if (length) std::memcpy(b.bytes.data(), bytes, length);
}

void RecordingEncoder::set_threadgroup_memory_length(uint32_t index, size_t length) {
  check_open();
  check_index(index, "set_threadgroup_memory_length");
  if (length % 16 != 0)
    fail("set_threadgroup_memory_length: " + std::to_string(length) +
         " bytes is not a multiple of 16, as Metal requires (index " + std::to_string(index) + ")");
  state_.threadgroup_lengths[index] = length;
}

void RecordingEncoder::insert_debug_signpost(const std::string& text) {
  check_open();
  signpost_ = text;
}

void RecordingEncoder::dispatch_threadgroups(gpu::Size3 grid, gpu::Size3 threads) {
  check_open();
  const KernelPipeline* p = state_.pipeline.get();
  if (!p) fail("dispatch_threadgroups: no pipeline set");
  const std::string where = "kernel '" + p->name() + "': ";
  if (faults_ && faults_->remaining > 0 && faults_->kernel == p->name()) {
    --faults_->remaining;
    fail(where + "injected failure while encoding (DeviceOptions::fail_dispatch)");
  }
  uint64_t n = uint64_t(threads.width) * threads.height * threads.depth;
  if (n == 0 || uint64_t(grid.width) * grid.height * grid.depth == 0)
    fail(where + "a threadgroup or grid size is zero");
  if (n > p->max_total_threads_per_threadgroup())
    fail(where + std::to_string(n) + " threads per threadgroup exceed the pipeline's maximum of " +
         std::to_string(p->max_total_threads_per_threadgroup()) +
         (p->declared_max_threads() == 0
              ? " (a kernel dispatched with more than " + std::to_string(gpu::kDefaultMaxThreadsPerThreadgroup) +
                    " threads declares [[max_total_threads_per_threadgroup(N)]], N at least what the host "
                    "dispatches: without it Metal may allow fewer)"
              : ""));
  for (const lily_msl_param* q = p->params(); q->kind != LILY_MSL_PARAM_END; ++q) {
    const std::string arg = "(" + std::string(q->name) + ")";
    if (q->kind == LILY_MSL_PARAM_BUFFER || q->kind == LILY_MSL_PARAM_BUFFER_REF) {
      const Binding& b = state_.buffers[q->index];
      if (!b.bound) fail(where + "buffer(" + std::to_string(q->index) + ") " + arg + " is not bound");
      if (b.buffer) {
        // Metal's setBuffer:offset: wants a device buffer's offset aligned to the data type the
        // kernel consumes; lily's kernels also read `uchar` weight buffers as 32-bit words
        // (metal/quant.h), so every device buffer is bound at a multiple of 4 at least. CUDA
        // faults on a misaligned load ("misaligned address"); x86 does not, so this check is
        // what catches it off the GPU (an unpadded safetensors header put every tensor at 2 mod 4).
        const uint64_t need = std::max<uint64_t>(4, q->align);
        const uintptr_t at = reinterpret_cast<uintptr_t>(b.buffer->contents()) + b.offset;
        if (at % need != 0)
          fail(where + "buffer(" + std::to_string(q->index) + ") " + arg + " is bound at offset " +
               std::to_string(b.offset) + " (address " + std::to_string(at % need) + " mod " +
               std::to_string(need) + "): misaligned, it needs " + std::to_string(need) + "-byte alignment" +
               (q->align > 4 ? " (alignof its element type)" : " (32-bit reads)") +
               "; Metal requires aligned buffer offsets and CUDA faults on misaligned loads");
      }
      size_t have = b.buffer ? b.buffer->length() - b.offset : b.bytes.size();
      if (q->kind == LILY_MSL_PARAM_BUFFER_REF && have < q->size)
        fail(where + "buffer(" + std::to_string(q->index) + ") " + arg + " has " +
             std::to_string(have) + " bytes but the kernel reads " + std::to_string(q->size));
    } else if (q->kind == LILY_MSL_PARAM_THREADGROUP) {
      if (!state_.threadgroup_lengths[q->index])
        fail(where + "threadgroup(" + std::to_string(q->index) + ") " + arg +
             " has no set_threadgroup_memory_length");
    }
  }
  size_t dynamic_bytes = 0;
  for (size_t len : state_.threadgroup_lengths) dynamic_bytes += len;
  const size_t tg_bytes = p->static_threadgroup_bytes() + dynamic_bytes;
  if (tg_bytes > kMaxThreadgroupMemory)
    fail(where + std::to_string(tg_bytes) + " bytes of threadgroup memory (" +
         std::to_string(p->static_threadgroup_bytes()) + " declared in the kernel + " +
         std::to_string(dynamic_bytes) + " set_threadgroup_memory_length) exceed the " +
         std::to_string(kMaxThreadgroupMemory) + " that Apple GPUs have");
  Command c = state_;
  c.signpost = signpost_;
  c.threadgroups = grid;
  c.threads = threads;
  commands_.push_back(std::move(c));
  state_.resources.clear();  // (recorded per dispatch: see gpu::ComputeEncoder::use_resource)
}

void RecordingEncoder::memory_barrier() {
  check_open();
  Command c;
  c.barrier = true;
  commands_.push_back(std::move(c));
}

void RecordingEncoder::use_resource(const std::shared_ptr<gpu::Buffer>& buffer, bool) {
  check_open();
  if (!buffer) fail("use_resource: null buffer");
  state_.resources.push_back(buffer);
}

void RecordingEncoder::end_encoding() {
  check_open();
  ended_ = true;
}

}  // namespace lily::msl_cpu
