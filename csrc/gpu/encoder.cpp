// EncoderContext and Dispatch: see encoder.h.
#include "gpu/encoder.h"

#include "gpu/embedded.h"
#include "model/error.h"

namespace lily::gpu {

LibraryOptions library_options(const std::string& file) {
  LibraryOptions o;
  const std::string tensor_suffix = "_tensor.metal";
  if (file.size() > tensor_suffix.size() &&
      file.compare(file.size() - tensor_suffix.size(), tensor_suffix.size(), tensor_suffix) == 0)
    o.language = LibraryOptions::Language::MSL4_0;
  o.safe_math = file == "sampling.metal";
  return o;
}

EncoderContext::EncoderContext(std::shared_ptr<Device> device) : device_(std::move(device)) {
  dummy_ = device_->new_buffer(16);
}

void EncoderContext::compile(const std::string& file) {
  auto& lib = libraries_[file];
  if (!lib) lib = device_->new_library(kernel_source(file), "metal/" + file, library_options(file));
}

std::shared_ptr<Pipeline> EncoderContext::pipeline(const std::string& file, const std::string& kernel) {
  auto& p = pipelines_[kernel];
  if (!p) {
    compile(file);
    p = libraries_[file]->pipeline(kernel);
  }
  return p;
}

void EncoderContext::begin(const std::string& label) {
  if (cb_) return;
  cb_ = device_->new_command_buffer();
  enc_ = cb_->compute_encoder(DispatchType::Concurrent, label);
  hazards_.barrier();
  stage_ = 0;
  ++stats_.command_buffers;
}

std::shared_ptr<CommandBuffer> EncoderContext::commit() {
  if (!cb_) return nullptr;
  auto cb = std::move(cb_);
  auto enc = std::move(enc_);
  enc->end_encoding();
  cb->commit();
  return cb;
}

void EncoderContext::finish() {
  auto cb = commit();
  if (!cb) return;
  ++stats_.waits;
  cb->wait_until_completed();
}

void EncoderContext::discard() noexcept {
  try {
    if (enc_) enc_->end_encoding();  // Metal: an encoder must be ended before it is released
  } catch (...) {
  }
  enc_.reset();
  cb_.reset();  // never committed: nothing of it runs
  hazards_.barrier();
}

void EncoderContext::signpost(const std::string& what) {
  if (enc_) enc_->insert_debug_signpost(what);
}

// ---- Dispatch ----------------------------------------------------------------------------------

Dispatch::Dispatch(EncoderContext& ctx, const std::string& file, const std::string& kernel) : ctx_(ctx) {
  rec_.kernel = kernel;
  pipeline_ = ctx_.pipeline(file, kernel);
  if (!ctx_.open()) throw Error("[gpu] kernel '" + kernel + "' encoded outside a pass");
  ctx_.encoder().set_pipeline(pipeline_);
}

uint32_t Dispatch::next(const char* name) {
  const uint32_t index = index_++;
  if (index >= 31) throw Error("[gpu] kernel '" + rec_.kernel + "' binds more than Metal's 31 buffers");
  const std::string declared = pipeline_->buffer_name(index);
  if (!declared.empty() && declared != name)
    throw Error("[gpu] kernel '" + rec_.kernel + "': the host binds '" + name + "' at [[buffer(" +
                std::to_string(index) + ")]], where the kernel has '" + declared +
                "' (host and kernel disagree on the buffer order: args, reads, writes)");
  return index;
}

void Dispatch::set_bytes(const char* name, const void* p, size_t n) {
  ctx_.encoder().set_bytes(next(name), p, n);
}

void Dispatch::set_rows(const char* name, const void* p, size_t n, size_t each) {
  if (n == 0 || n * each > kMaxSetBytes)
    throw Error("[gpu] " + rec_.kernel + ": " + std::to_string(n) + " argument structs of " + std::to_string(each) +
                " bytes do not fit set_bytes (1 to " + std::to_string(kMaxSetBytes / each) + ")");
  set_bytes(name, p, n * each);
}

Dispatch& Dispatch::bind(const char* name, const BufferRange& r) {
  ctx_.encoder().set_buffer(next(name), r.buf, r.off);
  return *this;
}

Dispatch& Dispatch::declare_read(const std::shared_ptr<Buffer>& b, size_t bytes, size_t off) {
  reads_.push_back({b.get(), off, off + bytes});
  rec_.other_bytes += bytes;
  return *this;
}

Dispatch& Dispatch::declare_write(const std::shared_ptr<Buffer>& b, size_t bytes, size_t off) {
  writes_.push_back({b.get(), off, off + bytes});
  rec_.other_bytes += bytes;
  return *this;
}

Dispatch& Dispatch::read(const char* name, const BufferRange& r, size_t bytes) {
  return bind(name, r).declare_read(r.buf, bytes, r.off);
}

Dispatch& Dispatch::write(const char* name, const BufferRange& r, size_t bytes) {
  return bind(name, r).declare_write(r.buf, bytes, r.off);
}

Dispatch& Dispatch::weight(const char* name, const BufferRange& r) { return bind(name, r); }

Dispatch& Dispatch::weight_bytes(uint64_t n) {
  rec_.weight_bytes += n;
  return *this;
}

void Dispatch::declare_state(const std::shared_ptr<Buffer>& b, bool write, uint64_t traffic) {
  Access a{b.get(), 0, b->length()};
  reads_.push_back(a);
  if (write) writes_.push_back(a);
  rec_.state_bytes += traffic;
}

Dispatch& Dispatch::state(const char* name, const std::shared_ptr<Buffer>& b, bool write, uint64_t traffic) {
  bind(name, BufferRange{b, 0});
  declare_state(b, write, traffic);
  return *this;
}

uint64_t Dispatch::address(const std::shared_ptr<Buffer>& b, bool write, uint64_t traffic) {
  ctx_.encoder().use_resource(b, write);
  declare_state(b, write, traffic);
  return b->gpu_address();
}

Dispatch& Dispatch::unused(const char* name) { return bind(name, BufferRange{ctx_.dummy(), 0}); }

void Dispatch::run(Size3 grid, Size3 threads) {
  // A pipeline may allow fewer threads than the kernel is dispatched with (register pressure on
  // a real GPU; Metal then rejects the dispatch): say which kernel and why instead.
  const uint64_t n = uint64_t(threads.width) * threads.height * threads.depth;
  const uint32_t limit = pipeline_->max_total_threads_per_threadgroup();
  if (n > limit)
    throw Error("[gpu] kernel '" + rec_.kernel + "' needs " + std::to_string(n) +
                " threads per threadgroup; its pipeline allows " + std::to_string(limit) +
                (n > kDefaultMaxThreadsPerThreadgroup
                     ? " (a kernel dispatched with more than 256 declares [[max_total_threads_per_threadgroup(N)]])"
                     : ""));
  if (ctx_.hazards().dispatch(ctx_.encoder(), grid, threads, reads_, writes_)) {
    ++ctx_.stage();
    ++ctx_.stats().barriers;
  }
  ++ctx_.stats().dispatches;
  rec_.stage = ctx_.stage();
  rec_.threadgroups = uint64_t(grid.width) * grid.height * grid.depth;
  rec_.threads_per_threadgroup = uint32_t(n);
  if (ctx_.recording) ctx_.records.push_back(rec_);
}

}  // namespace lily::gpu
