#include "gpu/embedded.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "model/error.h"

namespace lily::gpu {

namespace {

std::string override_dir() {
  const char* e = std::getenv("LILY_SOURCE_DIR");
  return e && *e ? std::string(e) : std::string();
}

bool read_disk(const std::string& path, std::string& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::ostringstream s;
  s << f.rdbuf();
  out = s.str();
  return true;
}

const EmbeddedFile* find(const std::string& path) {
  for (size_t i = 0; i < kEmbeddedCount; ++i)
    if (path == kEmbeddedFiles[i].path) return &kEmbeddedFiles[i];
  return nullptr;
}

void make_dirs(const std::string& path) {  // every parent folder of path
  for (size_t i = 1; i < path.size(); ++i)
    if (path[i] == '/') mkdir(path.substr(0, i).c_str(), 0755);
}

// Inlines #include "x.h" (files of metal/) once each; <...> includes stay.
void inline_includes(const std::string& file, std::set<std::string>& seen, std::string& out) {
  if (!seen.insert(file).second) return;
  std::istringstream in(source_file("metal/" + file));
  // #line keeps compiler diagnostics pointing at the real file and line.
  out += "#line 1 \"metal/" + file + "\"\n";
  int n = 0;
  for (std::string line; std::getline(in, line);) {
    ++n;
    const auto hash = line.find_first_not_of(" \t");
    if (hash != std::string::npos && line.compare(hash, 8, "#include") == 0) {
      const auto q0 = line.find('"');
      const auto q1 = q0 == std::string::npos ? q0 : line.find('"', q0 + 1);
      if (q1 != std::string::npos) {
        inline_includes(line.substr(q0 + 1, q1 - q0 - 1), seen, out);
        out += "#line " + std::to_string(n + 1) + " \"metal/" + file + "\"\n";
        continue;
      }
    }
    if (line.find("#pragma once") != std::string::npos) continue;
    out += line;
    out += '\n';
  }
}

}  // namespace

std::string kernel_source(const std::string& file) {
  std::string out;
  std::set<std::string> seen;
  inline_includes(file, seen, out);
  return out;
}

std::string source_file(const std::string& path) {
  std::string text;
  if (const std::string dir = override_dir(); !dir.empty() && read_disk(dir + "/" + path, text)) return text;
  if (const EmbeddedFile* f = find(path)) return std::string(f->text, f->size);
  throw Error("[gpu] no kernel source " + path + " (neither embedded in the extension nor under LILY_SOURCE_DIR)");
}

std::string source_tree(const std::string& cache_root) {
  if (const std::string dir = override_dir(); !dir.empty()) {
    bool all = true;
    for (size_t i = 0; i < kEmbeddedCount && all; ++i) all = access((dir + "/" + kEmbeddedFiles[i].path).c_str(), R_OK) == 0;
    if (all) return dir;
  }
  // FNV-1a of every path and text: a folder per distinct set of sources (the set is fixed at
  // build time, so hashed once per process, not once per kernel build).
  static const uint64_t h = [] {
    uint64_t v = 1469598103934665603ull;
    auto mix = [&](const char* p, size_t n) {
      for (size_t i = 0; i < n; ++i) v = (v ^ uint8_t(p[i])) * 1099511628211ull;
    };
    for (size_t i = 0; i < kEmbeddedCount; ++i) {
      mix(kEmbeddedFiles[i].path, std::strlen(kEmbeddedFiles[i].path) + 1);
      mix(kEmbeddedFiles[i].text, kEmbeddedFiles[i].size);
    }
    return v;
  }();
  char name[40];
  std::snprintf(name, sizeof name, "/sources-%016llx", static_cast<unsigned long long>(h));
  const std::string root = cache_root + name;
  for (size_t i = 0; i < kEmbeddedCount; ++i) {
    const std::string path = root + "/" + kEmbeddedFiles[i].path;
    if (access(path.c_str(), R_OK) == 0) continue;
    make_dirs(path);
    // Written under a private name and renamed: concurrent processes never see a partial file.
    const std::string tmp = path + "." + std::to_string(getpid());
    {
      std::ofstream f(tmp, std::ios::binary);
      f.write(kEmbeddedFiles[i].text, std::streamsize(kEmbeddedFiles[i].size));
      if (!f) throw Error("[gpu] cannot write " + tmp);
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) throw Error("[gpu] cannot write " + path);
  }
  return root;
}

}  // namespace lily::gpu
