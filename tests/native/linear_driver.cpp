// Runs the CPU backend's quantized matmul (cpu::linear, both Matmul modes) on cases written by
// tests/test_cpu_kernel_builds.py, so that the kernels of each instruction set (arm64 under
// qemu, x86 natively) can be checked bit for bit against NumPy. Built by that test, once per
// instruction set; it is not part of lily.
//
// Usage: linear_driver DIR OUT. DIR/cases.txt has one line per weight matrix:
//   name bits group rows in dtype T1,T2,...      (dtype of scales/biases: f32, f16 or bf16)
// with inputs (raw little-endian) DIR/name.w: packed codes uint32 [rows, in * bits / 32],
// DIR/name.s and DIR/name.b: scales and biases [rows, in / group], DIR/name.x: f32 [max T, in].
// For each T (the first T rows of x) y = x · Wᵀ is computed in int8 and in f32 mode and
// appended to OUT/name.int8 and OUT/name.f32 (f32 [T, rows] each, in the order of the T list).
// The int8 kernels' input for all of x, as quantize_activations writes it, goes to OUT/name.xq
// (int8 [max T, in]) and OUT/name.dx (f32 [max T, in / 32]).
// Prints the build's instruction set, then "name int8_supported=0|1" per matrix.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/linear.h"
#include "cpu/linear_int8.h"

namespace {

std::vector<char> read_file(const std::string& path, size_t expected) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (!f.good() && !f.eof()) throw std::runtime_error("cannot read " + path);
  if (data.size() != expected)
    throw std::runtime_error(path + ": " + std::to_string(data.size()) + " bytes, expected " + std::to_string(expected));
  return data;
}

void write_file(const std::string& path, const void* data, size_t bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), std::streamsize(bytes));
  if (!f) throw std::runtime_error("cannot write " + path);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lily;
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s DIR OUT\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1], out_dir = argv[2];
#if defined(__aarch64__)
  std::printf("arch=aarch64");
#elif defined(__x86_64__)
  std::printf("arch=x86_64");
#else
  std::printf("arch=other");
#endif
  // The features the kernels dispatch on at compile time.
  std::printf(" dotprod=%d neon_int8=%d avx2=%d avx512vnni=%d avxvnni=%d int8=%d\n",
#if defined(__ARM_FEATURE_DOTPROD)
              1,
#else
              0,
#endif
#if defined(LILY_INT8_NEON)
              1,
#else
              0,
#endif
#if defined(__AVX2__) && defined(__FMA__)
              1,
#else
              0,
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
              1,
#else
              0,
#endif
#if defined(__AVXVNNI__)
              1,
#else
              0,
#endif
              int(cpu::int8_kernels_available()));
  cpu::ThreadPool pool(2);
  std::ifstream cases(dir + "/cases.txt");
  if (!cases) {
    std::fprintf(stderr, "linear_driver: cannot read %s/cases.txt\n", dir.c_str());
    return 1;
  }
  std::string line;
  try {
    while (std::getline(cases, line)) {
      if (line.empty()) continue;
      std::istringstream in(line);
      std::string name, dtype, ts;
      Linear W;
      in >> name >> W.bits >> W.group >> W.out >> W.in >> dtype >> ts;
      if (!in) throw std::runtime_error("bad line in cases.txt: " + line);
      W.format = Linear::Format::Affine;
      W.dtype = dtype == "f32" ? DType::F32 : dtype == "f16" ? DType::F16 : DType::BF16;
      std::vector<int> Ts;
      for (std::istringstream tl(ts); std::getline(tl, dtype, ',');) Ts.push_back(std::stoi(dtype));
      int max_t = 0;
      for (int t : Ts) max_t = std::max(max_t, t);
      const size_t G = W.in / W.group, esz = dtype_size(W.dtype);
      const auto w = read_file(dir + "/" + name + ".w", size_t(W.out) * W.in * W.bits / 8);
      const auto s = read_file(dir + "/" + name + ".s", W.out * G * esz);
      const auto b = read_file(dir + "/" + name + ".b", W.out * G * esz);
      const auto xb = read_file(dir + "/" + name + ".x", size_t(max_t) * W.in * 4);
      W.w = reinterpret_cast<const uint8_t*>(w.data());
      W.scales = reinterpret_cast<const uint8_t*>(s.data());
      W.biases = reinterpret_cast<const uint8_t*>(b.data());
      const float* x = reinterpret_cast<const float*>(xb.data());
      std::printf("%s int8_supported=%d\n", name.c_str(), int(cpu::int8_supported(W)));
      std::vector<int8_t> xq(size_t(max_t) * W.in);
      std::vector<float> dx(size_t(max_t) * cpu::int8_dx_per_token(W.in));
      cpu::quantize_activations(x, max_t, W.in, W.bits, xq.data(), dx.data());
      write_file(out_dir + "/" + name + ".xq", xq.data(), xq.size());
      write_file(out_dir + "/" + name + ".dx", dx.data(), dx.size() * 4);
      for (const char* mode : {"int8", "f32"}) {
        const std::string path = out_dir + "/" + name + "." + mode;
        std::ofstream out(path, std::ios::binary);
        for (int T : Ts) {
          std::vector<float> y(size_t(T) * W.out);
          cpu::linear(W, x, T, y.data(), pool, mode[0] == 'i' ? cpu::Matmul::Int8 : cpu::Matmul::F32);
          out.write(reinterpret_cast<const char*>(y.data()), std::streamsize(y.size() * 4));
        }
        if (!out) throw std::runtime_error("cannot write " + path);
      }
      // The interleaved layout (linear_int8.h; AVX-512 VNNI builds, 4-bit): the first 32 rows
      // (whole blocks of 16), rearranged in a copy, in int8 mode -> <name>.int8i [T][32].
      Linear Wi = W;
      Wi.out = 32;
      if (W.out >= 32 && cpu::int8_interleavable(Wi)) {
        std::vector<uint8_t> wi(cpu::interleaved_bytes(Wi));
        Wi = cpu::interleave_rows(Wi, wi.data());
        const std::string path = out_dir + "/" + name + ".int8i";
        std::ofstream out(path, std::ios::binary);
        for (int T : Ts) {
          std::vector<float> y(size_t(T) * Wi.out);
          cpu::linear(Wi, x, T, y.data(), pool, cpu::Matmul::Int8);
          out.write(reinterpret_cast<const char*>(y.data()), std::streamsize(y.size() * 4));
        }
        if (!out) throw std::runtime_error("cannot write " + path);
        bool refused = false;  // the f32 kernels cannot read the layout: refused, not misread
        try {
          std::vector<float> y(Wi.out);
          cpu::linear(Wi, x, 1, y.data(), pool, cpu::Matmul::F32);
        } catch (const std::logic_error&) {
          refused = true;
        }
        std::printf("%s interleaved=1 f32_refused=%d\n", name.c_str(), int(refused));
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "linear_driver: %s\n", e.what());
    return 1;
  }
  return 0;
}
