// MSL source -> scanned kernels -> generated C++ unit -> clang -> cached, loaded module.
// See compiler.h for the design.
#include "msl_cpu/compiler.h"

#include "gpu/embedded.h"

#include <dirent.h>
#include <dlfcn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cxxabi.h>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>

#include "model/error.h"
#include "msl_cpu/executor.h"

namespace lily::msl_cpu {
namespace {

[[noreturn]] void fail(const std::string& what) { throw lily::Error("[msl_cpu] " + what); }

// The source with comments and string/char literals blanked out (newlines kept), so that the
// scanner sees only code and every offset still points at the same place.
std::string mask_source(const std::string& s) {
  std::string m = s;
  size_t i = 0, n = s.size();
  auto blank = [&](size_t a, size_t b) {
    for (size_t k = a; k < b && k < n; ++k)
      if (m[k] != '\n') m[k] = ' ';
  };
  while (i < n) {
    if (s.compare(i, 2, "//") == 0) {
      size_t e = s.find('\n', i);
      e = e == std::string::npos ? n : e;
      blank(i, e);
      i = e;
    } else if (s.compare(i, 2, "/*") == 0) {
      size_t e = s.find("*/", i + 2);
      e = e == std::string::npos ? n : e + 2;
      blank(i, e);
      i = e;
    } else if (s[i] == '"' || s[i] == '\'') {
      char q = s[i];
      size_t e = i + 1;
      while (e < n && s[e] != q && s[e] != '\n') e += (s[e] == '\\') ? 2 : 1;
      blank(i + 1, e);
      i = e + 1;
    } else {
      ++i;
    }
  }
  return m;
}

int line_of(const std::string& s, size_t pos) {
  int line = 1;
  for (size_t i = 0; i < pos && i < s.size(); ++i) line += s[i] == '\n';
  return line;
}

std::string trim(const std::string& s) {
  size_t a = s.find_first_not_of(" \t\r\n"), b = s.find_last_not_of(" \t\r\n");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

// Builtin parameter attributes -> the expression that binds them from lily_msl_thread `t`.
const std::map<std::string, std::string>& builtin_bindings() {
  static const std::map<std::string, std::string> m = {
      {"thread_position_in_grid", "bind_position<P>(t.thread_position_in_grid)"},
      {"threads_per_grid", "bind_position<P>(t.threads_per_grid)"},
      {"thread_position_in_threadgroup", "bind_position<P>(t.thread_position_in_threadgroup)"},
      {"threads_per_threadgroup", "bind_position<P>(t.threads_per_threadgroup)"},
      {"dispatch_threads_per_threadgroup", "bind_position<P>(t.threads_per_threadgroup)"},
      {"threadgroup_position_in_grid", "bind_position<P>(t.threadgroup_position_in_grid)"},
      {"threadgroups_per_grid", "bind_position<P>(t.threadgroups_per_grid)"},
      {"thread_index_in_threadgroup", "bind_scalar<P>(t.thread_index_in_threadgroup)"},
      {"simdgroup_index_in_threadgroup", "bind_scalar<P>(t.simdgroup_index_in_threadgroup)"},
      {"thread_index_in_simdgroup", "bind_scalar<P>(t.thread_index_in_simdgroup)"},
      {"threads_per_simdgroup", "bind_scalar<P>(t.threads_per_simdgroup)"},
      {"thread_execution_width", "bind_scalar<P>(t.threads_per_simdgroup)"},
      {"simdgroups_per_threadgroup", "bind_scalar<P>(t.simdgroups_per_threadgroup)"},
      {"dispatch_simdgroups_per_threadgroup", "bind_scalar<P>(t.simdgroups_per_threadgroup)"},
      {"quadgroup_index_in_threadgroup", "bind_scalar<P>(t.thread_index_in_threadgroup / 4)"},
      {"thread_index_in_quadgroup", "bind_scalar<P>(t.thread_index_in_simdgroup % 4)"},
  };
  return m;
}

// Split a parameter list at top-level commas: (text, offset of its first character).
std::vector<std::pair<std::string, size_t>> split_params(const std::string& list) {
  std::vector<std::pair<std::string, size_t>> out;
  int depth = 0;
  size_t begin = 0;
  auto push = [&](size_t end) {
    const std::string raw = list.substr(begin, end - begin);
    const size_t lead = raw.find_first_not_of(" \t\r\n");
    if (lead != std::string::npos) out.emplace_back(trim(raw), begin + lead);
  };
  for (size_t i = 0; i < list.size(); ++i) {
    const char c = list[i];
    if (c == '(' || c == '[' || c == '{' || c == '<') ++depth;
    if (c == ')' || c == ']' || c == '}' || c == '>') --depth;
    if (c == ',' && depth == 0) {
      push(i);
      begin = i + 1;
    }
  }
  push(list.size());
  return out;
}

// Metal's rule for the position attributes of one kernel (MSL specification, "Kernel function
// input attributes"): all scalars or all vectors with the same number of components, and
// [[thread_position_in_grid]] / [[threads_per_grid]], and [[thread_position_in_threadgroup]] /
// [[threads_per_threadgroup]] / [[dispatch_threads_per_threadgroup]], of the same type. clang
// binds any mix; Apple's compiler rejects it.
void check_position_attributes(const KernelDecl& k, const std::string& file_name) {
  static const std::set<std::string> position = {
      "thread_position_in_grid",      "threads_per_grid",     "thread_position_in_threadgroup",
      "threads_per_threadgroup",      "threadgroup_position_in_grid", "threadgroups_per_grid",
      "dispatch_threads_per_threadgroup"};
  static const std::regex type_re(R"(^(?:const\s+)?(uint|ushort)([234])?(?:\s+const)?$)");
  const KernelParam* first = nullptr;
  int first_width = 0;
  auto where = [&](const KernelParam& p) {
    return file_name + ":" + std::to_string(p.line) + ": kernel '" + k.name + "': ";
  };
  auto describe = [](const KernelParam& p) {
    return "'" + p.name + "' [[" + p.attribute + "]] is " + p.type;
  };
  std::map<std::string, const KernelParam*> by_attribute;
  for (const auto& p : k.params) {
    if (!position.count(p.attribute)) continue;
    std::smatch m;
    if (!std::regex_match(p.type, m, type_re))
      fail(where(p) + describe(p) + ": a position attribute is uint or ushort, a scalar or a 2- or "
           "3-component vector");
    const int width = m[2].matched ? std::stoi(m[2]) : 1;
    if (!first) {
      first = &p;
      first_width = width;
    } else if (width != first_width) {
      fail(where(p) + describe(p) + " but " + describe(*first) + ": Metal requires the position "
           "attributes of a kernel ([[thread_position_in_grid]], [[threads_per_grid]], "
           "[[thread_position_in_threadgroup]], [[threads_per_threadgroup]], "
           "[[threadgroup_position_in_grid]], [[threadgroups_per_grid]], "
           "[[dispatch_threads_per_threadgroup]]) to be all scalars or all vectors of one width");
    }
    by_attribute[p.attribute] = &p;
  }
  auto same_type = [&](const char* a, const char* b) {
    auto x = by_attribute.find(a), y = by_attribute.find(b);
    if (x == by_attribute.end() || y == by_attribute.end()) return;
    auto base = [](const std::string& t) { return std::regex_replace(t, std::regex(R"(\bconst\b|\s)"), ""); };
    if (base(x->second->type) != base(y->second->type))
      fail(where(*y->second) + describe(*y->second) + " but " + describe(*x->second) +
           ": Metal requires the two of the same type");
  };
  same_type("thread_position_in_grid", "threads_per_grid");
  same_type("thread_position_in_threadgroup", "threads_per_threadgroup");
  same_type("thread_position_in_threadgroup", "dispatch_threads_per_threadgroup");
  same_type("threads_per_threadgroup", "dispatch_threads_per_threadgroup");
}

}  // namespace

SourceInfo scan_source(const std::string& source, const std::string& file_name) {
  const std::string m = mask_source(source);
  SourceInfo info;

  static const std::regex fc_re(
      R"(\bconstant\s+([A-Za-z_]\w*)\s+([A-Za-z_]\w*)\s*\[\[\s*function_constant\s*\(\s*(\d+)\s*\)\s*\]\]\s*;)");
  for (auto it = std::sregex_iterator(m.begin(), m.end(), fc_re); it != std::sregex_iterator();
       ++it) {
    FunctionConstantDecl d;
    d.type = (*it)[1];
    d.name = (*it)[2];
    d.index = static_cast<uint32_t>(std::stoul((*it)[3]));
    d.begin = static_cast<size_t>(it->position(0));
    d.end = d.begin + static_cast<size_t>(it->length(0));
    info.constants.push_back(d);
  }

  static const std::regex kernel_re(
      R"((\[\[\s*kernel\s*\]\]|\bkernel\b)\s*(\[\[[^\]]*\]\]\s*)*void\s+([A-Za-z_]\w*)\s*\()");
  static const std::regex attr_re(R"(\[\[\s*([A-Za-z_]\w*)\s*(\(\s*(\d+)\s*\))?[^\]]*\]\])");
  static const std::regex name_re(R"(([A-Za-z_]\w*)\s*$)");
  static const std::regex max_threads_re(
      R"(max_total_threads_per_threadgroup\s*\(([^()]*(?:\([^()]*\)[^()]*)*)\))");
  static const std::regex template_re(R"(\btemplate\b)");
  for (auto it = std::sregex_iterator(m.begin(), m.end(), kernel_re); it != std::sregex_iterator();
       ++it) {
    KernelDecl k;
    k.name = (*it)[3];

    size_t start = static_cast<size_t>(it->position(0));
    size_t open = start + static_cast<size_t>(it->length(0)) - 1;
    k.line = line_of(source, start);
    const std::string where = file_name + ":" + std::to_string(k.line) + ": kernel '" + k.name + "'";
    // Find the end of the parameter list.
    int depth = 0;
    size_t close = open;
    for (; close < m.size(); ++close) {
      if (m[close] == '(') ++depth;
      if (m[close] == ')' && --depth == 0) break;
    }
    if (close >= m.size()) fail(where + ": unterminated parameter list");
    // What precedes the kernel since the previous declaration: template<...>, attributes.
    size_t prev = m.find_last_of(";}", start == 0 ? 0 : start - 1);
    std::string head = m.substr(prev == std::string::npos ? 0 : prev + 1,
                                open - (prev == std::string::npos ? 0 : prev + 1));
    // Preprocessor lines are not part of the declaration.
    std::string head_code;
    std::istringstream hs(head);
    for (std::string l; std::getline(hs, l);)
      if (trim(l).rfind("#", 0) != 0) head_code += l + "\n";
    k.is_template = std::regex_search(head_code, template_re);
    std::smatch mt;
    if (std::regex_search(head_code, mt, max_threads_re))
      k.max_total_threads_per_threadgroup = trim(mt[1]);

    for (size_t a = m.find("[[", open); a != std::string::npos && a < close;
         a = m.find("[[", a + 2)) {
      size_t b = m.find("]]", a);
      if (b == std::string::npos || b > close) fail(where + ": unterminated [[ attribute");
      k.attribute_spans.emplace_back(a, b + 2);
    }
    for (const auto& [p, offset] : split_params(m.substr(open + 1, close - open - 1))) {
      std::smatch am;
      if (!std::regex_search(p, am, attr_re))
        fail(where + ": parameter '" + p + "' has no [[...]] attribute (msl_cpu binds every "
             "kernel parameter by its attribute; write [[buffer(i)]] explicitly)");
      KernelParam kp;
      kp.attribute = am[1];
      std::string before = p.substr(0, static_cast<size_t>(am.position(0)));
      std::smatch nm;
      if (!std::regex_search(before, nm, name_re))
        fail(where + ": cannot find the name of parameter '" + p + "'");
      kp.name = nm[1];
      kp.type = trim(before.substr(0, before.size() - nm.length(0)));
      kp.line = line_of(source, open + 1 + offset);
      if (kp.attribute == "buffer" || kp.attribute == "threadgroup") {
        if (!am[3].matched) fail(where + ": parameter '" + kp.name + "' needs an index");
        kp.index = static_cast<uint32_t>(std::stoul(am[3]));
        if (kp.index >= LILY_MSL_MAX_BINDINGS)
          fail(where + ": parameter '" + kp.name + "': index " + std::to_string(kp.index) +
               " is past Metal's 31 bindings");
      } else if (!builtin_bindings().count(kp.attribute)) {
        fail(where + ": parameter '" + kp.name + "': attribute [[" + kp.attribute +
             "]] is not supported by msl_cpu (textures, samplers, stage_in, ... need a Mac)");
      }
      static const std::regex fc_attr_re(R"(function_constant\s*\(\s*([A-Za-z_]\w*)\s*\))");
      std::smatch fm;
      if (std::regex_search(p, fm, fc_attr_re)) kp.function_constant = fm[1];
      k.params.push_back(kp);
    }
    check_position_attributes(k, file_name);
    // A prototype and its definition: bind and register once, blank both's attributes.
    KernelDecl* first = nullptr;
    for (auto& other : info.kernels)
      if (other.name == k.name) first = &other;
    if (first)
      first->attribute_spans.insert(first->attribute_spans.end(), k.attribute_spans.begin(),
                                    k.attribute_spans.end());
    else
      info.kernels.push_back(k);
  }
  return info;
}

namespace {

std::string constant_value(const FunctionConstantDecl& d, const gpu::FunctionConstants::Value& v,
                           const std::string& file_name) {
  static const std::map<std::string, gpu::ConstantType> types = {
      {"bool", gpu::ConstantType::Bool},   {"int", gpu::ConstantType::Int},
      {"uint", gpu::ConstantType::UInt},   {"short", gpu::ConstantType::Short},
      {"ushort", gpu::ConstantType::UShort}, {"float", gpu::ConstantType::Float},
      {"half", gpu::ConstantType::Half}};
  auto t = types.find(d.type);
  if (t == types.end())
    fail(file_name + ": function constant '" + d.name + "' has type '" + d.type +
         "', which msl_cpu does not support");
  if (t->second != v.type)
    fail(file_name + ": function constant " + std::to_string(d.index) + " '" + d.name +
         "' is declared " + d.type + " but was given a value of another type");
  char buf[64];
  switch (v.type) {
    case gpu::ConstantType::Bool:
      return v.value != 0 ? "true" : "false";
    // Decimal with 9 significant digits: a float round-trips exactly (hex floats are C++17).
    case gpu::ConstantType::Float:
      std::snprintf(buf, sizeof buf, "%.8ef", double(float(v.value)));
      return buf;
    case gpu::ConstantType::Half:
      std::snprintf(buf, sizeof buf, "(half)%.8ef", double(float(v.value)));
      return buf;
    case gpu::ConstantType::UInt:
    case gpu::ConstantType::UShort:
      std::snprintf(buf, sizeof buf, "%lluu", static_cast<unsigned long long>(v.value));
      return buf;
    default:
      std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v.value));
      return buf;
  }
}

}  // namespace

bool parameter_present(const SourceInfo& info, const KernelParam& p,
                       const gpu::FunctionConstants* constants, const std::string& file_name) {
  if (p.function_constant.empty()) return true;
  for (const auto& d : info.constants) {
    if (d.name != p.function_constant) continue;
    if (constants)
      for (const auto& v : constants->values())
        if (v.index == d.index) return v.type == gpu::ConstantType::Bool && v.value != 0;
    return false;
  }
  fail(file_name + ": parameter '" + p.name + "' names an undeclared function constant '" +
       p.function_constant + "'");
}

std::string generate_unit(const std::string& original, const SourceInfo& info,
                          const std::string& file_name, const gpu::FunctionConstants* constants) {
  std::string source = original;
  for (const auto& k : info.kernels)
    for (const auto& [a, b] : k.attribute_spans)
      for (size_t i = a; i < b; ++i) source[i] = ' ';
  std::ostringstream u;
  u << "// Generated by lily msl_cpu from " << file_name << "; do not edit.\n"
    << "#include <metal_stdlib>\n";
  // Function constants: is_function_constant_defined(name).
  std::vector<std::string> values;
  for (const auto& d : info.constants) {
    const gpu::FunctionConstants::Value* given = nullptr;
    if (constants)
      for (const auto& v : constants->values())
        if (v.index == d.index) given = &v;
    u << "static constexpr bool lily_msl_fc_defined_" << d.name << " = "
      << (given ? "true" : "false") << ";\n";
    values.push_back(given ? constant_value(d, *given, file_name) : d.type + "()");
  }
  auto absent = [&](const KernelParam& p) { return !parameter_present(info, p, constants, file_name); };
  // One binder per kernel: binds parameter i from its attribute, for any instantiation F.
  for (const auto& k : info.kernels) {
    u << "struct lily_msl_binder_" << k.name << " {\n"
      << "  static const uint32_t max_threads;  // defined after the source (it may use its macros)\n"
      << "  template <class F, class Thread> static void call(F* f, const Thread& t) {\n"
      << "    using namespace ::lily_msl::detail;\n"
      << "    (void)t;\n"
      << "    f(";
    for (size_t i = 0; i < k.params.size(); ++i) {
      const auto& p = k.params[i];
      std::string expr;
      if (absent(p))
        expr = "bind_absent<P>()";
      else if (p.attribute == "buffer")
        expr = "bind_buffer<P>(t, " + std::to_string(p.index) + ")";
      else if (p.attribute == "threadgroup")
        expr = "bind_threadgroup<P>(t, " + std::to_string(p.index) + ")";
      else
        expr = builtin_bindings().at(p.attribute);
      const std::string P = "param_t<F, " + std::to_string(i) + ">";
      expr.replace(expr.find("<P>"), 3, "<" + P + ">");
      u << (i ? ",\n      " : "") << expr;
    }
    u << ");\n  }\n"
      << "  template <class F> static const lily_msl_param* describe() {\n"
      << "    using namespace ::lily_msl::detail;\n"
      << "    static const lily_msl_param p[] = {\n";
    for (size_t i = 0; i < k.params.size(); ++i) {
      const auto& p = k.params[i];
      const std::string P = "param_t<F, " + std::to_string(i) + ">";
      if (absent(p))
        u << "      {LILY_MSL_PARAM_ABSENT, " << p.index << ", 0, \"" << p.name << "\", 0},\n";
      else if (p.attribute == "buffer")
        u << "      {buffer_kind<" << P << ">(), " << p.index << ", bound_size<" << P << ">(), \""
          << p.name << "\", buffer_align<" << P << ">()},\n";
      else if (p.attribute == "threadgroup")
        u << "      {LILY_MSL_PARAM_THREADGROUP, " << p.index << ", 0, \"" << p.name << "\", 0},\n";
      else
        u << "      {LILY_MSL_PARAM_BUILTIN, 0, 0, \"" << p.name << "\", 0},\n";
    }
    u << "      {LILY_MSL_PARAM_END, 0, 0, nullptr, 0}};\n    return p;\n  }\n};\n";
  }
  // Metal's language level from here on (the prelude above may use what it needs): MSL 3.x is
  // C++14, MSL 4.0 C++17 (the unit is compiled as C++17, or C++20 for MSL 4.0).
  u << "#if __cplusplus > 201703L\n"
    << "#pragma clang diagnostic error \"-Wpre-c++20-compat\"\n"
    << "#pragma clang diagnostic error \"-Wpre-c++20-compat-pedantic\"\n"
    << "#else\n"
    << "#pragma clang diagnostic error \"-Wpre-c++17-compat\"\n"
    << "#pragma clang diagnostic error \"-Wpre-c++17-compat-pedantic\"\n"
    << "#endif\n";
  // The source itself, line for line, with function constants given their values.
  u << "#line 1 \"" << file_name << "\"\n";
  size_t pos = 0;
  for (size_t i = 0; i < info.constants.size(); ++i) {
    const auto& d = info.constants[i];
    u << source.substr(pos, d.begin - pos);
    u << "constant const " << d.type << " " << d.name << " = " << values[i] << ";";
    for (size_t c = d.begin; c < d.end; ++c)
      if (source[c] == '\n') u << '\n';  // keep the line numbers
    pos = d.end;
  }
  u << source.substr(pos) << "\n#line 1 \"<msl registrations>\"\n";
  // Each binder's [[max_total_threads_per_threadgroup(N)]], after the source: N may be a
  // constant of the kernel's headers. LILY_MSL_KERNEL_INFO hands it to the target (CUDA's
  // metadata; the CPU's registrar reads the binder).
  for (const auto& k : info.kernels) {
    const std::string& n = k.max_total_threads_per_threadgroup;
    u << "const uint32_t lily_msl_binder_" << k.name << "::max_threads = " << (n.empty() ? "0" : "uint32_t(" + n + ")")
      << ";\nLILY_MSL_KERNEL_INFO(" << k.name << ", lily_msl_binder_" << k.name << ")\n";
  }
  // Each target's prelude defines LILY_MSL_REGISTER (a registration on the CPU, an entry point
  // on CUDA); #line gives it the kernel's own file:line.
  for (const auto& k : info.kernels) {
    if (k.is_template) continue;  // registered by LILY_KERNEL_INSTANTIATE
    u << "#line " << k.line << " \"" << file_name << "\"\n"
      << "LILY_MSL_REGISTER(\"" << k.name << "\", lily_msl_binder_" << k.name << ", " << k.name
      << ")\n";
  }
  return u.str();
}

// ---------------------------------------------------------------------------------------------
// Building and loading
// ---------------------------------------------------------------------------------------------

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

uint64_t fnv1a(const std::string& s, uint64_t h) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

namespace {
bool is_executable(const std::string& p) { return access(p.c_str(), X_OK) == 0; }
}  // namespace

// Run a command (argv), capturing stdout+stderr; returns the exit status.
int run_command(const std::vector<std::string>& argv, std::string* output) {
  int pipefd[2];
  if (pipe(pipefd) != 0) fail("pipe() failed");
  pid_t pid = fork();
  if (pid < 0) fail("fork() failed");
  if (pid == 0) {
    dup2(pipefd[1], 1);
    dup2(pipefd[1], 2);
    close(pipefd[0]);
    close(pipefd[1]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  close(pipefd[1]);
  char buf[4096];
  ssize_t r;
  while ((r = read(pipefd[0], buf, sizeof buf)) > 0) output->append(buf, static_cast<size_t>(r));
  close(pipefd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

std::string cache_dir(const char* env, const std::string& name) {
  std::string dir;
  if (const char* e = std::getenv(env); e && *e) {
    dir = e;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) {
    dir = std::string(x) + "/lily/" + name;
  } else if (const char* h = std::getenv("HOME"); h && *h) {
    dir = std::string(h) + "/.cache/lily/" + name;
  } else {
    dir = "/tmp/lily-" + name + "-" + std::to_string(getuid());
  }
  std::string partial;
  for (size_t i = 0; i <= dir.size(); ++i) {
    if (i == dir.size() || (dir[i] == '/' && i > 0)) {
      partial = dir.substr(0, i);
      mkdir(partial.c_str(), 0755);
    }
  }
  return dir;
}

std::string clang_version() {
  static std::once_flag once;
  static std::string version;
  std::call_once(once, [] {
    std::string out;
    if (run_command({clang_path(), "--version"}, &out) != 0)
      fail("cannot run " + clang_path() + " --version:\n" + out);
    version = out.substr(0, out.find('\n'));
  });
  return version;
}

// Compile errors: keep clang's own text (it names file.metal:line:col) but drop the noise.
std::string compiler_errors(const std::string& out) {
  std::istringstream s(out);
  std::string line, kept;
  int n = 0;
  while (std::getline(s, line) && n < 60) {
    kept += line + "\n";
    ++n;
  }
  return kept;
}

uint64_t hash_headers(const std::vector<std::string>& dirs, uint64_t h) {
  for (const auto& d : dirs) {
    std::vector<std::string> names;
    if (DIR* dir = opendir(d.c_str())) {
      while (const dirent* e = readdir(dir)) {
        const std::string n = e->d_name;
        if (n.size() > 2 && n.compare(n.size() - 2, 2, ".h") == 0) names.push_back(n);
      }
      closedir(dir);
    }
    std::sort(names.begin(), names.end());
    for (const auto& n : names) h = fnv1a(n + "\x1f" + read_file(d + "/" + n), h);
  }
  return h;
}

namespace {
std::string cpu_cache_dir() { return cache_dir("LILY_MSL_CPU_CACHE", "msl_cpu"); }
// The thread-local arrays of the kernel's own code that -O2 left as stack memory: every
// `alloca` of an array type in the IR, named by its variable's debug record (DILocalVariable:
// name, file, line). The prelude's (the CPU emulation's own scratch) are not the kernel's.
struct StackArray {
  std::string file, variable, type, function;
  int line = 0;
};

std::string demangled(const std::string& name) {
  int status = 0;
  char* d = abi::__cxa_demangle(name.c_str(), nullptr, nullptr, &status);
  std::string out = status == 0 && d ? d : name;
  std::free(d);
  // Drop the parameter list: "void f<float, 8>(float AS1*, ...)" -> "f<float, 8>".
  int depth = 0;
  for (size_t i = out.size(); i-- > 0;) {
    if (out[i] == ')') ++depth;
    if (out[i] == '(' && --depth == 0) {
      out = out.substr(0, i);
      break;
    }
  }
  const size_t space = out.find(' ');
  if (space != std::string::npos && out.find('<') > space) out = out.substr(space + 1);  // return type
  return out;
}

std::vector<StackArray> stack_arrays(const std::string& ir) {
  static const std::regex alloca_re(R"(^\s*(%[\w.]+) = alloca (\[.*?\]+)(?:, align|$))");
  static const std::regex declare_re(R"((?:#dbg_declare\(ptr|llvm\.dbg\.declare\(metadata ptr) (%[\w.]+), (?:metadata )?(![0-9]+))");
  static const std::regex var_re(R"re(^(![0-9]+) = !DILocalVariable\(name: "([^"]*)".*?file: (![0-9]+), line: ([0-9]+))re");
  static const std::regex file_re(R"re(^(![0-9]+) = !DIFile\(filename: "([^"]*)")re");
  struct Var {
    std::string name, file;
    int line;
  };
  std::map<std::string, Var> vars;
  std::map<std::string, std::string> files;
  std::vector<std::tuple<std::string, std::string, std::string>> allocas;  // function, value, type
  std::map<std::pair<std::string, std::string>, std::string> declared;    // (function, value) -> var
  std::string function;
  std::istringstream in(ir);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (line.rfind("define ", 0) == 0) {
      const size_t at = line.find('@'), paren = line.find('(', at);
      function = line.substr(at + 1, paren - at - 1);
      if (!function.empty() && function.front() == '"') function = function.substr(1, function.size() - 2);
    } else if (line == "}") {
      function.clear();
    } else if (!function.empty() && std::regex_search(line, m, alloca_re)) {
      allocas.emplace_back(function, m[1], m[2]);
    } else if (!function.empty() && std::regex_search(line, m, declare_re)) {
      declared[{function, m[1]}] = m[2];
    } else if (std::regex_search(line, m, var_re)) {
      vars[m[1]] = Var{m[2], m[3], std::stoi(m[4])};
    } else if (std::regex_search(line, m, file_re)) {
      files[m[1]] = m[2];
    }
  }
  std::vector<StackArray> out;
  std::set<std::string> seen;
  for (const auto& [fn, value, type] : allocas) {
    auto d = declared.find({fn, value});
    if (d == declared.end()) continue;  // a compiler temporary, not a variable of the source
    auto v = vars.find(d->second);
    if (v == vars.end()) continue;
    const std::string file = files.count(v->second.file) ? files[v->second.file] : "?";
    if (file.find("/prelude/") != std::string::npos || file.find("/msl_prelude/") != std::string::npos ||
        file.find("<msl registrations>") != std::string::npos)
      continue;
    const std::string key = file + ":" + std::to_string(v->second.line) + ":" + v->second.name;
    if (!seen.insert(key).second) continue;
    out.push_back({file, v->second.name, type, demangled(fn), v->second.line});
  }
  return out;
}

}  // namespace

std::string clang_path() {
  if (const char* e = std::getenv("LILY_CLANG"); e && *e) return e;
  const char* path = std::getenv("PATH");
  for (const char* name : {"clang-19", "clang"}) {
    std::istringstream d(path ? path : "/usr/bin");
    for (std::string dir; std::getline(d, dir, ':');)
      if (!dir.empty() && is_executable(dir + "/" + name)) return dir + "/" + name;
  }
  fail("no clang found to compile MSL kernels for the CPU: install clang (Debian: apt-get "
       "install clang-19) or set LILY_CLANG");
}

// The prelude and metal/ headers: $LILY_SOURCE_DIR when it holds them (a developer's checkout),
// else the copies embedded in the extension, written once into the cache (gpu/embedded.h).
std::string source_dir() { return gpu::source_tree(cpu_cache_dir()); }

std::string prelude_dir() { return source_dir() + "/csrc/msl_cpu/prelude"; }
std::string common_prelude_dir() { return source_dir() + "/csrc/msl_prelude"; }

std::shared_ptr<Module> Module::build(const std::string& unit, const std::string& file_name,
                                      const BuildOptions& options) {
  if (options.asan && !dlsym(RTLD_DEFAULT, "__asan_init"))
    fail("asan=True needs the AddressSanitizer runtime in this process; run Python with "
         "LD_PRELOAD=$(" + clang_path() + " -print-file-name=libclang_rt.asan-$(uname -m).so) "
         "ASAN_OPTIONS=detect_leaks=0");
  const std::string clang = clang_path();
  std::vector<std::string> flags = {
      "-x", "c++", options.metal4 ? "-std=c++20" : "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden",
      "-fexcess-precision=16",  // half / bfloat round after every operation, like the GPU
      "-ffp-contract=on", "-fno-exceptions", "-fno-threadsafe-statics", "-fno-rtti", "-Wall",
      "-Wno-unknown-attributes", "-Wno-user-defined-literals", "-Wno-unused-variable",
      "-Wno-unused-function", "-Wl,-Bsymbolic",
      // The preludes as system headers: the language rules of generate_unit() are the kernel's.
      "-isystem", prelude_dir(), "-isystem", common_prelude_dir()};
  if (options.metal4) flags.push_back("-D__HAVE_TENSOR__=1");
  if (options.asan) {
    // The runtime's symbols resolve from the ASan library preloaded into the process.
    // ASan skips accesses through non-zero address spaces: build this variant without them.
    flags.insert(flags.end(), {"-O1", "-fsanitize=address", "-fno-omit-frame-pointer",
                               "-DLILY_MSL_CPU_FLAT_ADDRESS_SPACES"});
  } else {
    flags.push_back("-O2");
  }
  // Kernel files include each other by path relative to their folder and metal/.
  std::vector<std::string> includes = options.include_dirs;
  includes.push_back(source_dir() + "/metal");
  for (const auto& d : includes) flags.insert(flags.end(), {"-I", d});

  // Cache key: everything that can change the object.
  uint64_t h = fnv1a(unit);
  h = fnv1a(clang_version(), h);
  for (const auto& f : flags) h = fnv1a(f + "\x1f", h);
  h = fnv1a(read_file(common_prelude_dir() + "/lily_msl_common.h"), h);
  h = fnv1a(read_file(prelude_dir() + "/metal_stdlib"), h);
  h = fnv1a(read_file(prelude_dir() + "/lily_msl_cpu_abi.h"), h);
  h = fnv1a(read_file(prelude_dir() + "/metal_tensor"), h);
  h = fnv1a(read_file(prelude_dir() + "/MetalPerformancePrimitives/MetalPerformancePrimitives.h"), h);
  h = hash_headers(includes, h);
  char key[32];
  std::snprintf(key, sizeof key, "%016llx", static_cast<unsigned long long>(h));
  const std::string dir = cpu_cache_dir();
  const std::string so = dir + "/" + key + ".so";

  if (access(so.c_str(), R_OK) != 0) {
    // The unit is kept beside the object (debug info and ASan reports point into it);
    // both are published by rename, so concurrent builders never see a partial file.
    const std::string tmp = dir + "/" + key + "." + std::to_string(getpid());
    const std::string cpp = dir + "/" + key + ".cpp";
    {
      std::ofstream f(tmp + ".cpp", std::ios::binary);
      f << unit;
      if (!f) fail("cannot write " + tmp + ".cpp");
    }
    std::rename((tmp + ".cpp").c_str(), cpp.c_str());
    auto compile = [&](std::vector<std::string> argv) {
      argv.insert(argv.begin(), clang);
      std::string out;
      if (run_command(argv, &out) != 0) {
        std::remove((tmp + ".so").c_str());
        std::remove((tmp + ".ll").c_str());
        fail("compiling " + file_name + " for the CPU failed (" + clang + "):\n" + compiler_errors(out));
      }
    };
    if (options.asan) {
      std::vector<std::string> argv = flags;
      argv.insert(argv.end(), {"-gline-tables-only", cpp, "-o", tmp + ".so", "-lm"});
      compile(argv);
    } else {
      // Optimized LLVM IR first (full debug info names each variable), checked for arrays left
      // in stack memory, then compiled to the object without optimizing again.
      std::vector<std::string> argv;
      for (const auto& f : flags)
        if (f != "-shared" && f != "-Wl,-Bsymbolic") argv.push_back(f);
      argv.insert(argv.end(), {"-g", "-Xclang", "-fexperimental-assignment-tracking=disabled", "-S",
                               "-emit-llvm", cpp, "-o", tmp + ".ll"});
      compile(argv);
      const std::vector<StackArray> arrays = stack_arrays(read_file(tmp + ".ll"));
      if (!arrays.empty()) {
        std::remove((tmp + ".ll").c_str());
        std::string msg = file_name + ": thread-local arrays stay in stack memory after -O2 (an index, a loop "
                          "bound or the size depends on a run-time value; on the GPU they would live in "
                          "slow stack memory instead of registers). Make the bound a compile-time constant "
                          "(e.g. a template parameter) and unroll the loops that index them (LILY_UNROLL):";
        for (const auto& a : arrays)
          msg += "\n  " + a.file + ":" + std::to_string(a.line) + ": '" + a.variable + "' " + a.type + " in " +
                 a.function;
        fail(msg);
      }
      compile({"-fPIC", "-shared", "-O2", "-Xclang", "-disable-llvm-optzns", "-Wl,-Bsymbolic", "-x", "ir",
               tmp + ".ll", "-o", tmp + ".so", "-lm"});
      std::remove((tmp + ".ll").c_str());
    }
    if (std::rename((tmp + ".so").c_str(), so.c_str()) != 0)  // atomic publish
      fail("cannot move the compiled kernels into " + so);
  }

  std::shared_ptr<Module> mod(new Module());
  mod->path_ = so;
  mod->handle_ = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!mod->handle_) fail("cannot load " + so + ": " + dlerror());
  using init_fn = int (*)(const lily_msl_host_api*);
  using kernels_fn = const lily_msl_kernel* (*)(unsigned*);
  auto init = reinterpret_cast<init_fn>(dlsym(mod->handle_, "lily_msl_module_init"));
  auto kernels = reinterpret_cast<kernels_fn>(dlsym(mod->handle_, "lily_msl_kernels"));
  mod->current_ = static_cast<lily_msl_thread**>(dlsym(mod->handle_, "lily_msl_current"));
  if (!init || !kernels || !mod->current_)
    fail(so + " is not an msl_cpu kernel module (missing entry points)");
  if (init(host_api()) != LILY_MSL_ABI_VERSION)
    fail(so + " was built for another msl_cpu ABI version");
  mod->kernels_ = kernels(&mod->count_);
  return mod;
}

Module::~Module() {
  if (handle_) dlclose(handle_);
}

const lily_msl_kernel* Module::find(const std::string& name) const {
  for (unsigned i = 0; i < count_; ++i)
    if (name == kernels_[i].name) return &kernels_[i];
  return nullptr;
}

std::vector<std::string> Module::kernel_names() const {
  std::vector<std::string> out;
  for (unsigned i = 0; i < count_; ++i) out.push_back(kernels_[i].name);
  return out;
}

}  // namespace lily::msl_cpu
