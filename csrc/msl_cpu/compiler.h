// Turning MSL source into a loaded CPU kernel module, the way Metal compiles MSL at run time.
//
// 1. scan_source() reads the .metal text (comments and strings masked) for what C++ cannot
//    express: each kernel's parameter attributes ([[buffer(i)]], [[threadgroup(i)]],
//    [[thread_position_in_grid]], ...) and the [[function_constant(i)]] declarations.
// 2. generate_unit() wraps the source, unchanged line for line, in a C++ translation unit: a
//    binder struct per kernel (binds each parameter by attribute from the thread's bindings),
//    `#line 1 "file.metal"` so every diagnostic points into the .metal file, the function
//    constants rewritten to the pipeline's values, and a LILY_MSL_REGISTER for each
//    non-template kernel (templates register through LILY_KERNEL_INSTANTIATE). The unit is the
//    same for every target: the prelude it is compiled against (the CPU's here, CUDA's in
//    csrc/msl_cuda/) decides what a binder's thread is and what a registration makes.
// 3. Module::build() compiles it with clang ($LILY_CLANG, else clang-19 / clang on PATH) into a
//    shared object cached under $LILY_MSL_CPU_CACHE (default ~/.cache/lily/msl_cpu), keyed by a
//    hash of the unit, the prelude, the included headers, the flags and the clang version; then
//    dlopen()s it. The main extension may be built by gcc; only kernels need clang.
//
// What Apple's compiler would reject but C++ accepts is an error here too (docs/msl-on-cpu.md):
//  - scan_source(): the position attributes of one kernel ([[thread_position_in_grid]],
//    [[threads_per_threadgroup]], ...) all scalars or all vectors of one width, with the pairs
//    the MSL specification ties together of one type;
//  - generate_unit(): constructs newer than the library's language are errors in the kernel
//    source and the headers it includes (MSL 3.x is C++14, MSL 4.0 C++17: clang's
//    -Wpre-c++17-compat / -Wpre-c++20-compat turned into errors after the prelude);
//  - Module::build(): kernels compile to LLVM IR at -O2 first, and a thread-local array that
//    survives as stack memory (an `alloca` of an array type, declared in the kernel's own
//    files) is an error naming file:line: its index or size depends on a run-time value, so on
//    the GPU it would live in slow stack memory instead of registers. The IR is then compiled
//    into the shared object.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/device.h"
#include "msl_cpu/prelude/lily_msl_cpu_abi.h"

namespace lily::msl_cpu {

struct KernelParam {
  std::string name;
  std::string type;       // the declared type, e.g. "uint2", "device const float*"
  int line = 0;
  std::string attribute;  // "buffer", "threadgroup", or a builtin such as "thread_position_in_grid"
  uint32_t index = 0;     // for buffer / threadgroup
  std::string function_constant;  // [[buffer(i), function_constant(c)]]: present iff c is true
};

struct KernelDecl {
  std::string name;
  bool is_template = false;
  // [[max_total_threads_per_threadgroup(N)]]: N as written (a number or a constant expression,
  // e.g. a macro of the kernel's headers); empty when not declared.
  std::string max_total_threads_per_threadgroup;
  int line = 0;
  std::vector<KernelParam> params;
  // [[...]] spans in the parameter list: blanked in the generated unit, since C++ would
  // macro-expand `threadgroup` inside [[threadgroup(0)]] (they are bound by the binder instead).
  std::vector<std::pair<size_t, size_t>> attribute_spans;
};

struct FunctionConstantDecl {
  std::string type, name;
  uint32_t index = 0;
  size_t begin = 0, end = 0;  // span of the declaration in the source
};

struct SourceInfo {
  std::vector<KernelDecl> kernels;
  std::vector<FunctionConstantDecl> constants;
};

SourceInfo scan_source(const std::string& source, const std::string& file_name);

// Whether parameter p exists in a pipeline with these function-constant values: one declared
// [[function_constant(c)]] exists only where c is given as true.
bool parameter_present(const SourceInfo& info, const KernelParam& p,
                       const gpu::FunctionConstants* constants, const std::string& file_name);

// constants == nullptr: no value given for any function constant (the library-level compile).
std::string generate_unit(const std::string& source, const SourceInfo& info,
                          const std::string& file_name, const gpu::FunctionConstants* constants);

struct BuildOptions {
  bool asan = false;                      // -fsanitize=address (the process must load ASan)
  // MSL 4.0 on a Metal 4 device: -D__HAVE_TENSOR__ (as Apple's compiler defines it for MSL 4
  // on a GPU with tensors), so <metal_tensor> and MetalPerformancePrimitives' matmul2d are
  // available; C++20 for the descriptor as a template argument (a class-type non-type template
  // parameter), with C++17 (MSL 4's base) the newest the kernel source may use. Otherwise MSL
  // 3.x: C++17 for the prelude, C++14 for the kernel source.
  bool metal4 = false;
  std::vector<std::string> include_dirs;  // besides the prelude
};

// A compiled, loaded kernel object.
class Module {
 public:
  static std::shared_ptr<Module> build(const std::string& unit, const std::string& file_name,
                                       const BuildOptions& options);
  ~Module();
  const lily_msl_kernel* find(const std::string& name) const;
  std::vector<std::string> kernel_names() const;
  lily_msl_thread** current_slot() const { return current_; }
  const std::string& path() const { return path_; }

 private:
  Module() = default;
  void* handle_ = nullptr;
  lily_msl_thread** current_ = nullptr;
  const lily_msl_kernel* kernels_ = nullptr;
  unsigned count_ = 0;
  std::string path_;
};

// The clang used for kernels; the lily source tree whose csrc/msl_cpu/prelude and metal/ the
// kernels include ($LILY_SOURCE_DIR when it has them, else the sources embedded in the
// extension, written into the kernel cache: gpu/embedded.h).
std::string clang_path();
std::string source_dir();
std::string prelude_dir();
std::string common_prelude_dir();  // csrc/msl_prelude: what every target's prelude shares

// Helpers shared with the MSL-on-CUDA compiler (csrc/msl_cuda/compiler.cpp).
std::string clang_version();  // first line of `clang --version` (run once)
// $env, else $XDG_CACHE_HOME/lily/<name>, else ~/.cache/lily/<name> (created).
std::string cache_dir(const char* env, const std::string& name);
std::string read_file(const std::string& path);
uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull);
// Every *.h directly in each folder, by name: a kernel's cache key covers the headers it may use.
uint64_t hash_headers(const std::vector<std::string>& dirs, uint64_t h);
// Runs argv, capturing stdout + stderr; returns the exit status.
int run_command(const std::vector<std::string>& argv, std::string* output);
// The first lines of a compiler's output (its errors, without the long tail).
std::string compiler_errors(const std::string& out);

}  // namespace lily::msl_cpu
