// lily._core.msl_cpu: the MSL-on-CPU runtime for tests. The classes are the portable gpu::
// interfaces (csrc/gpu/device.h), so a test drives kernels exactly as the Metal backend does:
//
//   dev = msl_cpu.device(interleavings=0, check_dependencies=False, asan=False, seed=0)
//   lib = dev.library(source, "tests/msl/kernels/reduce.metal")
//   pso = lib.pipeline("reduce_sum", constants={0: ("bool", True)})
//   buf = dev.buffer(np_array) / dev.buffer_empty(nbytes);  buf.read() -> bytes
//   cb = dev.command_buffer(); enc = cb.compute_encoder(concurrent=False)
//   enc.set_pipeline(pso); enc.set_buffer(0, buf, 0); enc.set_bytes(1, b"...")
//   enc.set_threadgroup_memory_length(0, 1024); enc.dispatch_threadgroups((g,), (t,))
//   enc.memory_barrier(); enc.end_encoding(); cb.commit(); cb.wait_until_completed()
// Errors are lily.LilyError (ValueError) naming the kernel.
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "gpu/device.h"
#include "gpu/embedded.h"
#include "gpu/encoder.h"
#include "gpu/hazards.h"
#include "model/error.h"
#include "msl_cpu/compiler.h"
#include "msl_cpu/device.h"
#include "msl_cpu/prelude/lily_msl_cpu_abi.h"
#include "python/bindings.h"

namespace lily::python {
namespace {

gpu::Size3 size3(const std::vector<uint32_t>& v, const char* what) {
  if (v.empty() || v.size() > 3)
    throw lily::Error(std::string("[msl_cpu] ") + what + " takes 1 to 3 sizes");
  gpu::Size3 s;
  s.width = v[0];
  s.height = v.size() > 1 ? v[1] : 1;
  s.depth = v.size() > 2 ? v[2] : 1;
  return s;
}

using Bytes = nb::ndarray<nb::device::cpu, nb::c_contig>;

gpu::ConstantType constant_type(const std::string& t) {
  if (t == "bool") return gpu::ConstantType::Bool;
  if (t == "int") return gpu::ConstantType::Int;
  if (t == "uint") return gpu::ConstantType::UInt;
  if (t == "short") return gpu::ConstantType::Short;
  if (t == "ushort") return gpu::ConstantType::UShort;
  if (t == "float") return gpu::ConstantType::Float;
  if (t == "half") return gpu::ConstantType::Half;
  throw lily::Error("[msl_cpu] unknown function constant type '" + t +
                    "' (bool, int, uint, short, ushort, float, half)");
}
}  // namespace

gpu::FunctionConstants function_constants(const ConstantValues& constants) {
  gpu::FunctionConstants fc;
  for (const auto& [index, tv] : constants) fc.set(index, constant_type(tv.first), tv.second);
  return fc;
}

void init_msl_cpu(nb::module_& parent) {
  nb::module_ m = parent.def_submodule(
      "msl_cpu", "Run MSL kernels on the CPU with Metal's semantics (for tests)");

  nb::class_<gpu::Buffer>(m, "Buffer")
      .def_prop_ro("length", &gpu::Buffer::length)
      .def("read", [](gpu::Buffer& b) {
        std::string out(b.length(), '\0');
        b.read(0, out.data(), out.size());
        return nb::bytes(out.data(), out.size());
      }, "A copy of the buffer's contents.")
      .def("write", [](gpu::Buffer& b, Bytes data, size_t offset) {
        b.write(offset, data.data(), data.nbytes());
      }, nb::arg("data"), nb::arg("offset") = 0)
      .def("fill", &gpu::Buffer::fill, nb::arg("offset"), nb::arg("value"), nb::arg("n"),
           "Sets n bytes from offset to value (a memset).")
      .def_prop_ro("gpu_address", &gpu::Buffer::gpu_address,
                   "The address kernels see it at, for a device pointer in argument data (MTLBuffer.gpuAddress).");

  nb::class_<gpu::Pipeline>(m, "Pipeline")
      .def_prop_ro("name", &gpu::Pipeline::name)
      .def_prop_ro("max_total_threads_per_threadgroup",
                   &gpu::Pipeline::max_total_threads_per_threadgroup)
      .def_prop_ro("thread_execution_width", &gpu::Pipeline::thread_execution_width)
      .def_prop_ro("buffers", [](const gpu::Pipeline& p) {
        std::map<std::string, uint32_t> out;
        for (uint32_t i = 0; i < LILY_MSL_MAX_BINDINGS; ++i)
          if (const std::string n = p.buffer_name(i); !n.empty()) out[n] = i;
        return out;
      }, "{parameter name: [[buffer(i)]] index} of the kernel.");

  nb::class_<gpu::Library>(m, "Library")
      .def("pipeline",
           [](gpu::Library& lib, const std::string& name, const ConstantValues& constants) {
             return lib.pipeline(name, function_constants(constants));
           },
           nb::arg("name"), nb::arg("constants") = ConstantValues{});

  nb::class_<gpu::ComputeEncoder>(m, "ComputeEncoder")
      .def("set_pipeline", &gpu::ComputeEncoder::set_pipeline)
      .def("set_buffer", &gpu::ComputeEncoder::set_buffer, nb::arg("index"), nb::arg("buffer"),
           nb::arg("offset") = 0)
      .def("set_bytes", [](gpu::ComputeEncoder& e, uint32_t index, nb::bytes data) {
        e.set_bytes(index, data.c_str(), data.size());
      })
      .def("set_threadgroup_memory_length", &gpu::ComputeEncoder::set_threadgroup_memory_length)
      .def("insert_debug_signpost", &gpu::ComputeEncoder::insert_debug_signpost)
      .def("dispatch_threadgroups",
           [](gpu::ComputeEncoder& e, const std::vector<uint32_t>& grid,
              const std::vector<uint32_t>& threads) {
             e.dispatch_threadgroups(size3(grid, "threadgroups_per_grid"),
                                     size3(threads, "threads_per_threadgroup"));
           })
      .def("memory_barrier", &gpu::ComputeEncoder::memory_barrier)
      .def("use_resource", &gpu::ComputeEncoder::use_resource, nb::arg("buffer"), nb::arg("write"),
           "The next dispatch reaches buffer through an address in its argument data (useResource:usage:).")
      .def("end_encoding", &gpu::ComputeEncoder::end_encoding);

  nb::class_<gpu::CommandBuffer>(m, "CommandBuffer")
      .def("compute_encoder",
           [](gpu::CommandBuffer& cb, bool concurrent, const std::string& label) {
             return cb.compute_encoder(concurrent ? gpu::DispatchType::Concurrent
                                                  : gpu::DispatchType::Serial, label);
           },
           nb::arg("concurrent") = false, nb::arg("label") = "")
      .def("commit", &gpu::CommandBuffer::commit, nb::call_guard<nb::gil_scoped_release>())
      .def("wait_until_completed", &gpu::CommandBuffer::wait_until_completed);

  nb::class_<gpu::Device>(m, "Device")
      .def_prop_ro("name", &gpu::Device::name)
      .def_prop_ro("supports_tensor_ops", &gpu::Device::supports_tensor_ops)
      .def("buffer", [](gpu::Device& d, Bytes data) {
        auto b = d.new_buffer(data.nbytes());
        b->write(0, data.data(), data.nbytes());
        return b;
      }, "A new buffer holding a copy of the array's bytes.")
      .def("buffer_empty", &gpu::Device::new_buffer, nb::arg("length"))
      .def("library",
           [](gpu::Device& d, const std::string& source, const std::string& file_name, const std::string& language,
              bool safe_math) {
             gpu::LibraryOptions o;
             if (language == "4.0") o.language = gpu::LibraryOptions::Language::MSL4_0;
             else if (language != "3.1")
               throw lily::Error("[gpu] language must be '3.1' or '4.0', not '" + language + "'");
             o.safe_math = safe_math;
             return d.new_library(source, file_name, o);
           },
           nb::arg("source"), nb::arg("file_name"), nb::arg("language") = "3.1", nb::arg("safe_math") = false,
           "Compile MSL source as Metal would (language: the MSL version, '3.1' or '4.0' on a metal4 "
           "device).")
      .def_prop_ro("unified_memory", &gpu::Device::unified_memory)
      .def("copy", [](gpu::Device& d, gpu::Buffer& dst, size_t dst_offset, gpu::Buffer& src, size_t src_offset,
                      size_t n) { d.copy(dst, dst_offset, src, src_offset, n); },
           nb::arg("dst"), nb::arg("dst_offset"), nb::arg("src"), nb::arg("src_offset"), nb::arg("n"),
           "n bytes from src to dst, now (Device::copy).")
      .def_prop_ro("apple_gpu_family", &gpu::Device::apple_gpu_family)
      .def_prop_ro("recommended_max_working_set_size", &gpu::Device::recommended_max_working_set_size)
      .def("command_buffer", &gpu::Device::new_command_buffer);

  // gpu::HazardTracker, for tests of barrier placement (accesses: (buffer, begin, end) bytes).
  using AccessList = std::vector<std::tuple<std::shared_ptr<gpu::Buffer>, size_t, size_t>>;
  auto accesses = [](const AccessList& list) {
    std::vector<gpu::Access> out;
    for (const auto& [b, begin, end] : list) out.push_back({b.get(), begin, end});
    return out;
  };
  nb::class_<gpu::HazardTracker>(m, "HazardTracker")
      .def(nb::init<>())
      .def("dispatch",
           [accesses](gpu::HazardTracker& t, gpu::ComputeEncoder& e,
                      const std::vector<uint32_t>& grid, const std::vector<uint32_t>& threads,
                      const AccessList& reads, const AccessList& writes) {
             return t.dispatch(e, size3(grid, "threadgroups_per_grid"),
                               size3(threads, "threads_per_threadgroup"), accesses(reads),
                               accesses(writes));
           },
           nb::arg("encoder"), nb::arg("threadgroups"), nb::arg("threads"),
           nb::arg("reads"), nb::arg("writes"),
           "Dispatch, placing a memory barrier first if it depends on a dispatch since the last "
           "one; returns whether a barrier was placed.");

  m.def("device",
        [](bool asan, int interleavings, bool check_dependencies, uint64_t seed,
           const std::vector<std::string>& include_dirs, bool metal4, int apple_gpu_family, uint64_t working_set,
           const std::string& fail_dispatch, int fail_dispatch_count, const std::string& fail_library,
           bool opaque_buffers) {
          msl_cpu::DeviceOptions o;
          o.opaque_buffers = opaque_buffers;
          o.metal4 = metal4;
          o.apple_gpu_family = apple_gpu_family;
          o.working_set = working_set;
          o.fail_dispatch = fail_dispatch;
          o.fail_dispatch_count = fail_dispatch_count;
          o.fail_library = fail_library;
          o.asan = asan;
          o.interleavings = interleavings;
          o.check_dependencies = check_dependencies;
          o.seed = seed;
          o.include_dirs = include_dirs;
          return msl_cpu::make_device(o);
        },
        nb::arg("asan") = false, nb::arg("interleavings") = 0,
        nb::arg("check_dependencies") = false, nb::arg("seed") = 0,
        nb::arg("include_dirs") = std::vector<std::string>{}, nb::arg("metal4") = false,
        nb::arg("apple_gpu_family") = 7, nb::arg("working_set") = 0, nb::arg("fail_dispatch") = "",
        nb::arg("fail_dispatch_count") = 1, nb::arg("fail_library") = "", nb::arg("opaque_buffers") = false,
        "A device that runs MSL kernels on the CPU. interleavings=K reruns each dispatch under K "
        "random thread orders and fails if the result changes; check_dependencies reruns the "
        "dispatches between memory barriers of a concurrent encoder in reverse order; asan "
        "builds kernels with AddressSanitizer (preload its runtime); metal4 claims Metal 4 (libraries "
        "compiled as MSL 4.0 see __HAVE_TENSOR__ and the emulated <metal_tensor> / "
        "MetalPerformancePrimitives matmul2d); apple_gpu_family (7-10) and working_set are what the "
        "device reports; fail_dispatch / fail_library inject failures for tests of error paths; "
        "opaque_buffers hides buffer storage from the host (contents() is null, as on a device with memory "
        "of its own: bytes move only through Buffer.read / write and the device's copies).");
  m.def("clang_path", &msl_cpu::clang_path);
  m.def("library_options",
        [](const std::string& file) {
          const gpu::LibraryOptions o = gpu::library_options(file);
          return std::make_pair(std::string(o.language == gpu::LibraryOptions::Language::MSL4_0 ? "4.0" : "3.1"),
                                o.safe_math);
        },
        nb::arg("file"),
        "(language, safe_math) the GPU backend compiles metal/<file> with: the *_tensor libraries as "
        "MSL 4.0, sampling with safe math.");
  m.def("embedded_files", [] {
        std::vector<std::string> paths;
        for (size_t i = 0; i < gpu::kEmbeddedCount; ++i) paths.emplace_back(gpu::kEmbeddedFiles[i].path);
        return paths;
      },
      "Checkout-relative paths of the kernel sources and preludes embedded in the extension.");
  m.def("source_file", &gpu::source_file, nb::arg("path"),
        "The text of an embedded source file as the backends read it ($LILY_SOURCE_DIR/<path> where that "
        "overrides it).");
  m.def("kernel_source", &gpu::kernel_source, nb::arg("file"),
        "metal/<file> as the backend hands it to Device.library: its local #includes inlined (with #line "
        "markers naming the real files), so the kernels of its headers are in the text.");
}

}  // namespace lily::python
