// lily._core.msl_cuda: the MSL-on-CUDA runtime (csrc/msl_cuda/). Its devices are the same
// gpu:: classes as lily._core.msl_cpu's (Device, Library, Buffer, ...), so a kernel test drives
// either runtime with the same calls:
//
//   dev = msl_cuda.device(ordinal=0, permute_threadgroups=False, seed=0, timing=False,
//                         synchronous=False)      # raises LilyError without an NVIDIA driver
//   msl_cuda.take_timings(dev) -> [(kernel, grid, threads, ms)]   (timing=True)
//   msl_cuda.compile(source, file_name) -> (path, key, entries)  (clang: PTX into the cache)
//   msl_cuda.cache_key(source, file_name)  (no tool run: what a machine without clang looks up)
//
// The pure launch arithmetic (threadgroup_layout, threadgroup_permutation,
// threadgroup_position) is bound for tests without a GPU.
#include <nanobind/stl/array.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "gpu/backend.h"
#include "gpu/embedded.h"
#include "model/error.h"
#include "msl_cpu/compiler.h"
#include "msl_cuda/compiler.h"
#include "msl_cuda/device.h"
#include "msl_cuda/driver.h"
#include "msl_cuda/launch.h"
#include "python/bindings.h"

namespace lily::python {
namespace {

using Entry = std::tuple<std::string, std::string, std::vector<uint64_t>>;  // host, kernel, sizes

std::vector<Entry> entries(const std::vector<msl_cuda::EntryInfo>& in) {
  std::vector<Entry> out;
  for (const auto& e : in) out.emplace_back(e.host_name, e.kernel, e.bound_sizes);
  return out;
}

// The unit of `source` as a library (constants empty) or a pipeline specialization.
std::string unit_of(const std::string& source, const std::string& file_name,
                    const ConstantValues& constants) {
  const auto info = msl_cpu::scan_source(source, file_name);
  const auto fc = function_constants(constants);
  return msl_cpu::generate_unit(source, info, file_name, constants.empty() ? nullptr : &fc);
}

// As a library does: the folder of file_name is searched by #include "...".
msl_cuda::CompileOptions compile_options(const std::string& file_name, std::vector<std::string> dirs,
                                         bool safe_math) {
  msl_cuda::CompileOptions o;
  o.safe_math = safe_math;
  o.include_dirs = std::move(dirs);
  size_t slash = file_name.rfind('/');
  if (slash != std::string::npos) o.include_dirs.push_back(file_name.substr(0, slash));
  return o;
}

std::tuple<uint32_t, uint32_t, uint32_t> tuple3(gpu::Size3 s) { return {s.width, s.height, s.depth}; }

}  // namespace

void init_msl_cuda(nb::module_& parent) {
  nb::module_ m = parent.def_submodule(
      "msl_cuda", "Run MSL kernels on an NVIDIA GPU: PTX compiled by clang, run through the CUDA driver");

  m.def("device",
        [](int ordinal, bool permute_threadgroups, uint64_t seed, bool timing, bool synchronous,
           const std::vector<std::string>& include_dirs) {
          return msl_cuda::make_device(
              {ordinal, permute_threadgroups, seed, timing, synchronous, include_dirs});
        },
        nb::arg("ordinal") = 0, nb::arg("permute_threadgroups") = false, nb::arg("seed") = 0,
        nb::arg("timing") = false, nb::arg("synchronous") = false,
        nb::arg("include_dirs") = std::vector<std::string>{},
        "A device that runs MSL kernels on CUDA GPU `ordinal`. permute_threadgroups launches "
        "each dispatch's threadgroups in a seeded random order; timing records each dispatch's "
        "GPU time (take_timings); synchronous waits after each dispatch so a fault names its "
        "kernel. Raises LilyError when there is no NVIDIA driver (libcuda.so.1) or GPU.");
  m.def("take_timings",
        [](gpu::Device& d) {
          std::vector<std::tuple<std::string, std::tuple<uint32_t, uint32_t, uint32_t>,
                                 std::tuple<uint32_t, uint32_t, uint32_t>, double>> out;
          for (const auto& t : msl_cuda::take_timings(d))
            out.emplace_back(t.kernel, tuple3(t.threadgroups), tuple3(t.threads), t.ms);
          return out;
        },
        nb::arg("device"), "(kernel, threadgroups, threads, ms) of each dispatch completed since the last call.");
  m.def("resources",
        [](gpu::Pipeline& p) {
          const auto r = msl_cuda::resources(p);
          return std::map<std::string, int>{{"registers", r.registers},
                                             {"local_bytes", r.local_bytes},
                                             {"static_shared_bytes", r.static_shared_bytes},
                                             {"max_threads", r.max_threads}};
        },
        nb::arg("pipeline"), "Registers, local (stack/spill) bytes, static shared bytes and the "
        "most threads per threadgroup of a pipeline's kernel, as the driver compiled it.");
  m.def("driver_version", [] { return msl_cuda::driver().version; },
        "The CUDA driver's version (13000 = 13.0); raises LilyError without a driver.");

  m.def("compile",
        [](const std::string& source, const std::string& file_name,
           const std::vector<std::string>& include_dirs, const ConstantValues& constants, bool safe_math) {
          const std::string unit = unit_of(source, file_name, constants);
          const auto options = compile_options(file_name, include_dirs, safe_math);
          msl_cuda::PtxModule ptx;
          {
            nb::gil_scoped_release release;
            ptx = msl_cuda::build_ptx(unit, file_name, options);
          }
          return std::make_tuple(ptx.path, msl_cuda::cache_key(unit, options), entries(ptx.entries));
        },
        nb::arg("source"), nb::arg("file_name"), nb::arg("include_dirs") = std::vector<std::string>{},
        nb::arg("constants") = ConstantValues{}, nb::arg("safe_math") = false,
        "The PTX of a library (or of one function-constant specialization) in the kernel cache, "
        "compiled by clang when absent: (path, key, [(host_name, kernel, bound_sizes)]). safe_math: "
        "as Device.library's (no FMA contraction).");
  m.def("cache_key",
        [](const std::string& source, const std::string& file_name,
           const std::vector<std::string>& include_dirs, const ConstantValues& constants, bool safe_math) {
          return msl_cuda::cache_key(unit_of(source, file_name, constants),
                                     compile_options(file_name, include_dirs, safe_math));
        },
        nb::arg("source"), nb::arg("file_name"), nb::arg("include_dirs") = std::vector<std::string>{},
        nb::arg("constants") = ConstantValues{}, nb::arg("safe_math") = false,
        "The kernel-cache key of a library, computed without running any tool.");
  m.def("cache_dir", &msl_cuda::cache_dir);
  m.def("parse_entries", [](const std::string& ptx) { return entries(msl_cuda::parse_entries(ptx)); },
        nb::arg("ptx"), "The kernel entries of PTX text: [(host_name, kernel, bound_sizes)].");
  m.def("libdevice_path", &msl_cuda::libdevice_path);
  m.def("source_file", &gpu::source_file, nb::arg("path"),
        "A kernel source file by checkout-relative path (LILY_SOURCE_DIR, else the embedded copy).");
  m.def("kernel_source", &gpu::kernel_source, nb::arg("file"),
        "metal/<file> with its local #includes inlined: the text the GPU backend compiles.");
  m.def("kernel_files",
        [] {
          std::vector<std::string> out;
          for (size_t i = 0; i < gpu::kEmbeddedCount; ++i) {
            const std::string p = gpu::kEmbeddedFiles[i].path;
            if (p.rfind("metal/", 0) == 0 && p.size() > 6 && p.compare(p.size() - 6, 6, ".metal") == 0)
              out.push_back(p.substr(6));
          }
          return out;
        },
        "The kernel files the extension embeds (metal/*.metal, names only).");

  m.def("threadgroup_layout",
        [](const std::vector<size_t>& lengths) {
          std::array<size_t, LILY_MSL_MAX_BINDINGS> l{};
          if (lengths.size() > l.size()) throw lily::Error("[msl_cuda] at most 31 threadgroup lengths");
          std::copy(lengths.begin(), lengths.end(), l.begin());
          uint32_t offsets[LILY_MSL_MAX_BINDINGS];
          const size_t total = msl_cuda::threadgroup_layout(l, offsets);
          return std::make_pair(std::vector<uint32_t>(offsets, offsets + lengths.size()), total);
        },
        nb::arg("lengths"), "(offsets, total bytes) of [[threadgroup(i)]] memory in a launch's dynamic shared memory.");
  m.def("threadgroup_permutation", &msl_cuda::threadgroup_permutation, nb::arg("n"), nb::arg("seed"));
  m.def("threadgroup_position",
        [](uint64_t linear, const std::tuple<uint32_t, uint32_t, uint32_t>& grid) {
          return tuple3(msl_cuda::threadgroup_position(
              linear, gpu::Size3{std::get<0>(grid), std::get<1>(grid), std::get<2>(grid)}));
        },
        nb::arg("linear"), nb::arg("grid"));
}

}  // namespace lily::python
