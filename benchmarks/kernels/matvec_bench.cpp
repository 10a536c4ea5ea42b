// Micro-benchmark and cross-check of the CPU backend's quantized matvec/GEMM kernels in
// isolation (no model): random MLX-affine 4-bit (or 8-bit) weights, bf16 scales, group 64.
//   matvec_bench [in] [out] [T] [bits] [threads]
// Prints, for f32 and int8 modes: GB/s of packed weights read, GFLOP/s (2*T*in*out per call),
// with the matrix in cache (small out) and streamed from DRAM (out large), and the relative
// error of each mode against a double-precision reference computed from the dequantized rows.
// Rates are per second of this thread's CPU time (CLOCK_THREAD_CPUTIME_ID), so with threads=1
// they describe one core even on a shared machine; "wall" is the elapsed-time rate.
//   c++ -O3 -march=native -std=c++17 -ffp-contract=off -Icsrc benchmarks/kernels/matvec_bench.cpp \
//       build/dev/liblily_core.a -lpthread -o matvec_bench
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sys/mman.h>
#include <random>
#include <vector>

#include "cpu/linear.h"
#include "cpu/thread_pool.h"

using namespace lily;

struct HugeBuffer {
  uint8_t* p = nullptr;
  size_t n = 0;
  explicit HugeBuffer(size_t bytes) : n(bytes) {
    const size_t cap = (bytes + (2u << 20) - 1) & ~size_t((2u << 20) - 1);
    p = static_cast<uint8_t*>(std::aligned_alloc(2u << 20, cap));
#if defined(MADV_HUGEPAGE)
    madvise(p, cap, MADV_HUGEPAGE);
#endif
  }
  ~HugeBuffer() { std::free(p); }
  uint8_t* begin() { return p; }
  uint8_t* end() { return p + n; }
  uint8_t* data() { return p; }
  uint8_t& operator[](size_t i) { return p[i]; }
  size_t size() const { return n; }
};
using namespace lily::cpu;

int main(int argc, char** argv) {
  const int in = argc > 1 ? atoi(argv[1]) : 2048;
  const int out = argc > 2 ? atoi(argv[2]) : 4096;
  const int T = argc > 3 ? atoi(argv[3]) : 1;
  const int bits = argc > 4 ? atoi(argv[4]) : 4;
  const int threads = argc > 5 ? atoi(argv[5]) : 1;
  const int group = 64, G = in / group;
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> nd(0.f, 1.f);
  // Weights in 2 MiB-aligned buffers advised for transparent huge pages, as lily's loader puts
  // them: with 4 KiB pages a streamed matvec loses ~30% to TLB misses and page-bounded prefetch.
  HugeBuffer w(size_t(out) * in * bits / 8), sc(size_t(out) * G * 2), bi(size_t(out) * G * 2);
  for (auto& b : w) b = uint8_t(byte(rng));
  auto bf16 = [](float f) { uint32_t u; memcpy(&u, &f, 4); return uint16_t(u >> 16); };
  for (size_t i = 0; i < size_t(out) * G; ++i) {
    uint16_t s = bf16(0.01f * (1 + 0.1f * nd(rng))), b = bf16(-0.08f * (1 + 0.1f * nd(rng)));
    memcpy(&sc[2 * i], &s, 2);
    memcpy(&bi[2 * i], &b, 2);
  }
  Linear W;
  W.format = Linear::Format::Affine;
  W.out = out; W.in = in; W.dtype = DType::BF16; W.bits = bits; W.group = group;
  W.w = w.data(); W.scales = sc.data(); W.biases = bi.data();
  std::vector<float> x(size_t(T) * in), y(size_t(T) * out), yi(size_t(T) * out);
  for (auto& v : x) v = nd(rng);
  ThreadPool pool(threads);
  // Reference in double from dequantized rows (first 256 rows).
  const int nref = std::min(out, 256);
  std::vector<double> ref(size_t(T) * nref);
  std::vector<float> row(in);
  for (int r = 0; r < nref; ++r) {
    dequantize_row(W, r, row.data());
    for (int t = 0; t < T; ++t) {
      double s = 0;
      for (int k = 0; k < in; ++k) s += double(row[k]) * x[size_t(t) * in + k];
      ref[size_t(t) * nref + r] = s;
    }
  }
  for (Matmul mode : {Matmul::F32, Matmul::Int8}) {
    linear(W, x.data(), T, y.data(), pool, mode);
    double num = 0, den = 0;
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < nref; ++r) {
        const double d = y[size_t(t) * out + r] - ref[size_t(t) * nref + r];
        num += d * d;
        den += ref[size_t(t) * nref + r] * ref[size_t(t) * nref + r];
      }
    auto cpu_now = [] {
      timespec ts;
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
      return ts.tv_sec + 1e-9 * ts.tv_nsec;
    };
    int iters = 0;
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = cpu_now();
    double el = 0;
    do {
      linear(W, x.data(), T, y.data(), pool, mode);
      ++iters;
      el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } while (el < 1.0);
    const double per = (cpu_now() - c0) / iters, wall = el / iters;
    const double bytes = double(w.size() + sc.size() + bi.size());
    printf("%-4s in=%d out=%d T=%d bits=%d thr=%d: %8.3f ms cpu  %6.2f GB/s  %7.1f GFLOP/s  (wall %6.2f GB/s)  "
           "rel_err %.2e\n",
           mode == Matmul::F32 ? "f32" : "int8", in, out, T, bits, threads, per * 1e3, bytes / per / 1e9,
           2.0 * T * in * out / per / 1e9, bytes / wall / 1e9, std::sqrt(num / den));
  }
}
