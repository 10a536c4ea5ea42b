// MSL source -> PTX, on any machine with clang; PTX from the kernel cache on a machine without.
//
// The unit is the one msl_cpu generates (msl_cpu::scan_source + generate_unit: binders, the
// source line for line, function constants, one LILY_MSL_REGISTER per kernel), compiled against
// the CUDA prelude (csrc/msl_cuda/prelude/metal_stdlib) with
//   clang --target=nvptx64-nvidia-cuda -march=sm_90 -O3 -ffreestanding -nostdlibinc
//         -Xclang -mlink-builtin-bitcode -Xclang libdevice.10.bc -S
// into PTX, cached as $LILY_MSL_CUDA_CACHE/<key>.ptx (default ~/.cache/lily/msl_cuda).
//
// The key is computed without running any tool: a hash of the unit, the preludes, the headers
// the kernels may include and the target. So the GPU machine (which has the NVIDIA driver but
// no clang) finds the PTX that a machine with clang compiled and carried over. Which clang and
// libdevice made a file is recorded in its first line; where clang is present, a file made by
// another toolchain is compiled again.
//
// Each kernel entry in the PTX is named by its host name and has a metadata global beside it
// (csrc/msl_cuda/prelude/lily_msl_cuda_abi.h); parse_entries() reads them from the PTX text.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace lily::msl_cuda {

constexpr const char* kArch = "sm_90";  // Hopper: the H200 that runs them

struct CompileOptions {
  std::vector<std::string> include_dirs;  // searched by #include "..." besides metal/
  // Metal's safe math (gpu::LibraryOptions::safe_math): no contraction into FMA
  // (-ffp-contract=off, part of the cache key). Otherwise clang contracts, as Metal's fast math.
  bool safe_math = false;
};

// A kernel entry of a PTX module: its host name (the PTX .entry), the kernel function it
// instantiates (as scanned from the source), its [[max_total_threads_per_threadgroup]] (0: not
// declared), and per parameter the bytes a `T&` reads (0 for pointers and builtins).
struct EntryInfo {
  std::string host_name;
  std::string kernel;
  uint32_t max_threads = 0;
  std::vector<uint64_t> bound_sizes;
};

struct PtxModule {
  std::string path;  // in the kernel cache
  std::string text;
  std::vector<EntryInfo> entries;
};

std::string cache_dir();  // $LILY_MSL_CUDA_CACHE, else ~/.cache/lily/msl_cuda
// The cache key of a unit (16 hex digits): runs no tool.
std::string cache_key(const std::string& unit, const CompileOptions& options);
// The PTX of a unit: from the cache, else compiled by clang into it. Without clang and without
// a cached file, a lily::Error says how to compile and carry the kernels.
PtxModule build_ptx(const std::string& unit, const std::string& file_name, const CompileOptions& options);
// The entries and their metadata, read from PTX text (no GPU needed).
std::vector<EntryInfo> parse_entries(const std::string& ptx);

// The libdevice bitcode linked into every module: $LILY_LIBDEVICE, else the CUDA toolkit's
// ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda). lily.msl_cuda sets $LILY_LIBDEVICE from the
// nvidia-cuda-nvcc wheel when it is installed.
std::string libdevice_path();
std::string prelude_dir();  // csrc/msl_cuda/prelude of the source tree (msl_cpu::source_dir())

}  // namespace lily::msl_cuda
