// Generated unit -> PTX in the kernel cache; PTX text -> kernel entries. See compiler.h.
#include "msl_cuda/compiler.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "model/error.h"
#include "msl_cpu/compiler.h"
#include "msl_cuda/prelude/lily_msl_cuda_abi.h"

namespace lily::msl_cuda {
namespace {

[[noreturn]] void fail(const std::string& what) { throw lily::Error("[msl_cuda] " + what); }

bool readable(const std::string& p) { return access(p.c_str(), R_OK) == 0; }

// Flags that decide what the PTX is (part of the key); include paths are machine-specific and
// are added at compile time only. C++17 as msl_cpu compiles MSL 3.x libraries: the generated
// unit holds the kernel source to C++14 (MSL 3's base) after the prelude.
std::vector<std::string> semantic_flags(const CompileOptions& options) {
  return {"-x", "c++", "-std=c++17", "--target=nvptx64-nvidia-cuda", std::string("-march=") + kArch,
          "-O3", "-ffreestanding", "-nostdlibinc", "-fno-exceptions", "-fno-rtti",
          "-fno-threadsafe-statics", options.safe_math ? "-ffp-contract=off" : "-ffp-contract=on",
          // .loc directives: compute-sanitizer and the driver's error reports name file.metal:line.
          "-gline-directives-only"};
}

// Which clang and libdevice made a PTX file: its first line. Empty where clang is absent.
std::string toolchain() {
  static std::once_flag once;
  static std::string id;
  std::call_once(once, [] {
    try {
      msl_cpu::clang_path();
    } catch (const lily::Error&) {
      return;  // no clang here: PTX can only come from the cache
    }
    char h[32];
    std::snprintf(h, sizeof h, "%016llx",
                  static_cast<unsigned long long>(msl_cpu::fnv1a(msl_cpu::read_file(libdevice_path()))));
    id = "// lily msl_cuda: " + msl_cpu::clang_version() + "; libdevice " + h;
  });
  return id;
}

void write_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + "." + std::to_string(getpid());
  {
    std::ofstream f(tmp, std::ios::binary);
    f << text;
    if (!f) fail("cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("cannot write " + path);
}

// The bytes of `.global .align A .b8 name[N] = {b0, b1, ...};` (PTX omits trailing zeros).
bool global_bytes(const std::string& line, std::string* name, std::vector<uint8_t>* bytes) {
  const std::string tag = ".b8 ";
  size_t at = line.find(tag);
  if (line.find(".global") == std::string::npos || at == std::string::npos) return false;
  at += tag.size();
  const size_t open = line.find('[', at), close = line.find(']', open);
  const size_t brace = line.find('{', close), end = line.find('}', brace);
  if (open == std::string::npos || close == std::string::npos || brace == std::string::npos ||
      end == std::string::npos)
    return false;
  *name = line.substr(at, open - at);
  bytes->assign(std::stoul(line.substr(open + 1, close - open - 1)), 0);
  std::istringstream values(line.substr(brace + 1, end - brace - 1));
  size_t i = 0;
  for (std::string v; std::getline(values, v, ',') && i < bytes->size(); ++i)
    (*bytes)[i] = static_cast<uint8_t>(std::stoul(v));
  return true;
}

// Metal compiles a kernel declaring [[max_total_threads_per_threadgroup(N)]] so that N threads
// fit (registers included): the attribute is a promise the host relies on. PTX's `.maxntid N`
// makes ptxas keep the same promise (at most 65536 / N registers a thread). clang has no C++
// spelling for it on NVPTX, so it is written into the text after the entry's parameter list.
std::string with_thread_limits(const std::string& ptx, const std::vector<EntryInfo>& entries) {
  std::string out = ptx;
  for (const auto& e : entries) {
    if (e.max_threads == 0) continue;
    const size_t at = out.find(".entry " + e.host_name + "(");
    const size_t close = at == std::string::npos ? at : out.find("\n)", at);
    if (close == std::string::npos) fail("PTX has no parameter list for .entry " + e.host_name);
    const size_t eol = out.find('\n', close + 1);
    out.insert(eol == std::string::npos ? out.size() : eol,
               "\n.maxntid " + std::to_string(e.max_threads) + ", 1, 1");
  }
  return out;
}

}  // namespace

std::string cache_dir() { return msl_cpu::cache_dir("LILY_MSL_CUDA_CACHE", "msl_cuda"); }

std::string prelude_dir() { return msl_cpu::source_dir() + "/csrc/msl_cuda/prelude"; }

std::string libdevice_path() {
  if (const char* e = std::getenv("LILY_LIBDEVICE"); e && *e) return e;
  std::vector<std::string> roots;
  for (const char* v : {"CUDA_HOME", "CUDA_PATH"})
    if (const char* e = std::getenv(v); e && *e) roots.push_back(e);
  roots.push_back("/usr/local/cuda");
  for (const auto& r : roots)
    if (readable(r + "/nvvm/libdevice/libdevice.10.bc")) return r + "/nvvm/libdevice/libdevice.10.bc";
  fail("no libdevice.10.bc (CUDA's math library) to compile kernels to PTX: pip install "
       "nvidia-cuda-nvcc and use lily.msl_cuda, or set LILY_LIBDEVICE or CUDA_HOME");
}

std::string cache_key(const std::string& unit, const CompileOptions& options) {
  // kPtxEdits: bumped when build_ptx changes what it writes around clang's output.
  constexpr int kPtxEdits = 1;  // 1: .maxntid from [[max_total_threads_per_threadgroup]]
  uint64_t h = msl_cpu::fnv1a("lily msl_cuda " + std::to_string(LILY_MSL_CUDA_ABI_VERSION) + " " +
                              std::to_string(kPtxEdits));
  h = msl_cpu::fnv1a(unit, h);
  for (const auto& f : semantic_flags(options)) h = msl_cpu::fnv1a(f + "\x1f", h);
  h = msl_cpu::fnv1a(msl_cpu::read_file(msl_cpu::common_prelude_dir() + "/lily_msl_common.h"), h);
  h = msl_cpu::fnv1a(msl_cpu::read_file(prelude_dir() + "/metal_stdlib"), h);
  h = msl_cpu::fnv1a(msl_cpu::read_file(prelude_dir() + "/lily_msl_cuda_abi.h"), h);
  std::vector<std::string> includes = options.include_dirs;
  includes.push_back(msl_cpu::source_dir() + "/metal");
  h = msl_cpu::hash_headers(includes, h);
  char key[32];
  std::snprintf(key, sizeof key, "%016llx", static_cast<unsigned long long>(h));
  return key;
}

PtxModule build_ptx(const std::string& unit, const std::string& file_name, const CompileOptions& options) {
  PtxModule m;
  const std::string dir = cache_dir(), key = cache_key(unit, options);
  m.path = dir + "/" + key + ".ptx";
  const std::string tools = toolchain();
  if (readable(m.path)) {
    m.text = msl_cpu::read_file(m.path);
    // Kept unless this machine has clang and the file was made by another clang or libdevice.
    if (tools.empty() || m.text.compare(0, m.text.find('\n'), tools) == 0) {
      m.entries = parse_entries(m.text);
      return m;
    }
  }
  if (tools.empty())
    fail("no PTX for " + file_name + " in " + dir + " (key " + key + ") and no clang here to "
         "compile it. On a machine with clang-19, compile the kernels into a folder "
         "(python -m lily.msl_cuda compile --cache DIR) and point LILY_MSL_CUDA_CACHE at a copy "
         "of it here");

  // The unit is kept beside the PTX (its .loc directives point into it for generated lines).
  const std::string cpp = dir + "/" + key + ".cpp", tmp = dir + "/" + key + "." + std::to_string(getpid());
  write_atomically(cpp, unit);
  std::vector<std::string> argv = {msl_cpu::clang_path()};
  for (const auto& f : semantic_flags(options)) argv.push_back(f);
  for (const auto& f : {"-Wall", "-Wno-unknown-attributes", "-Wno-user-defined-literals",
                        "-Wno-unused-variable", "-Wno-unused-function"})
    argv.push_back(f);
  // The preludes as system headers: the language rules of generate_unit() are the kernel's.
  for (const auto& d : {prelude_dir(), msl_cpu::common_prelude_dir()}) argv.insert(argv.end(), {"-isystem", d});
  std::vector<std::string> includes = options.include_dirs;
  includes.push_back(msl_cpu::source_dir() + "/metal");
  for (const auto& d : includes) argv.insert(argv.end(), {"-I", d});
  argv.insert(argv.end(), {"-Xclang", "-mlink-builtin-bitcode", "-Xclang", libdevice_path(), "-S",
                           cpp, "-o", tmp + ".ptx"});
  std::string out;
  if (msl_cpu::run_command(argv, &out) != 0) {
    std::remove((tmp + ".ptx").c_str());
    fail("compiling " + file_name + " to PTX failed (" + argv[0] + "):\n" + msl_cpu::compiler_errors(out));
  }
  m.text = tools + "\n// from " + file_name + "\n" + msl_cpu::read_file(tmp + ".ptx");
  std::remove((tmp + ".ptx").c_str());
  m.entries = parse_entries(m.text);  // before publishing: a malformed module never enters the cache
  m.text = with_thread_limits(m.text, m.entries);
  write_atomically(m.path, m.text);
  return m;
}

std::vector<EntryInfo> parse_entries(const std::string& ptx) {
  std::vector<EntryInfo> out;
  std::vector<std::string> entries;
  std::map<std::string, uint32_t> max_threads;  // kernel function -> declared maximum
  std::istringstream in(ptx);
  const std::string prefix = "lily_msl_meta_", kernel_prefix = "lily_msl_kernel_";
  for (std::string line; std::getline(in, line);) {
    if (size_t e = line.find(".entry "); e != std::string::npos) {
      const size_t a = e + 7, b = line.find('(', a);
      entries.push_back(line.substr(a, b == std::string::npos ? std::string::npos : b - a));
      continue;
    }
    std::string name;
    std::vector<uint8_t> bytes;
    if (!global_bytes(line, &name, &bytes)) continue;
    if (name.compare(0, kernel_prefix.size(), kernel_prefix) == 0) {
      lily_msl_cuda_kernel_meta k;
      if (bytes.size() != sizeof k) fail("PTX metadata " + name + " is for another msl_cuda ABI");
      std::memcpy(&k, bytes.data(), sizeof k);
      if (k.abi_version != LILY_MSL_CUDA_ABI_VERSION) fail("PTX metadata " + name + " is for another msl_cuda ABI");
      max_threads[name.substr(kernel_prefix.size())] = uint32_t(k.max_threads);
      continue;
    }
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    if (bytes.size() != sizeof(lily_msl_cuda_meta))
      fail("PTX metadata " + name + " has " + std::to_string(bytes.size()) + " bytes, not " +
           std::to_string(sizeof(lily_msl_cuda_meta)) + " (built by another lily)");
    lily_msl_cuda_meta meta;
    std::memcpy(&meta, bytes.data(), sizeof meta);
    if (meta.abi_version != LILY_MSL_CUDA_ABI_VERSION || meta.param_count > LILY_MSL_CUDA_MAX_PARAMS)
      fail("PTX metadata " + name + " is for another msl_cuda ABI");
    meta.function[LILY_MSL_CUDA_NAME_BYTES - 1] = 0;
    EntryInfo e;
    e.host_name = name.substr(prefix.size());
    e.kernel = meta.function;
    e.bound_sizes.assign(meta.bound_sizes, meta.bound_sizes + meta.param_count);
    out.push_back(std::move(e));
  }
  for (auto& e : out) {
    auto k = max_threads.find(e.kernel);
    if (k == max_threads.end()) fail("PTX has no metadata lily_msl_kernel_" + e.kernel + " (built by another lily)");
    e.max_threads = k->second;
    bool found = false;
    for (const auto& n : entries) found = found || n == e.host_name;
    if (!found) fail("PTX has metadata for '" + e.host_name + "' but no such .entry");
  }
  return out;
}

}  // namespace lily::msl_cuda
