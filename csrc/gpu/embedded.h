// Kernel sources embedded in the extension, so an installed wheel needs no source tree: every
// metal/*.metal and metal/*.h, and the MSL-on-CPU prelude (csrc/msl_cpu/prelude/*), as string
// literals generated at build time by cmake/embed_sources.cmake.
//
// LILY_SOURCE_DIR stays a developer override: a file present under it is read from there (edit
// a kernel and rerun without rebuilding); any other file comes from the embedded copy.
#pragma once
#include <cstddef>
#include <string>

namespace lily::gpu {

struct EmbeddedFile {
  const char* path;  // relative to the checkout, e.g. "metal/quant.metal"
  const char* text;
  size_t size;
};
extern const EmbeddedFile kEmbeddedFiles[];
extern const size_t kEmbeddedCount;

// The text of a source file by checkout-relative path: $LILY_SOURCE_DIR/<path> when that
// variable is set and the file exists there, else the embedded copy. Throws lily::Error naming
// the path when neither has it.
std::string source_file(const std::string& path);

// A directory holding the source files a compiler must find by path (the embedded copies,
// written once under `cache_root`, in a folder named by their content hash), or
// $LILY_SOURCE_DIR when it holds every one of them.
std::string source_tree(const std::string& cache_root);

// metal/<file> with its local #include "..." lines inlined once each (with #line markers, so
// diagnostics name the real file and line): the self-contained text Metal's
// newLibraryWithSource needs, with the kernel templates of its headers in it.
std::string kernel_source(const std::string& file);

}  // namespace lily::gpu
