// Batch-1 decode GEMVs as the engine runs them: cpu::linear() on the thread pool, int8 mode,
// one call after another on E distinct matrices (called in a scattered order, so each call
// streams its matrix from memory), with the pool's barrier at the end of every call. Prints
// GB/s of weights + scales + biases read, three rounds of 1.5 s. Weights: random MLX-affine
// 4-bit, bf16 scales, group 64, on 2 MiB pages (as lily's loader keeps resident weights).
//   pool_bench IN OUT THREADS [E] [interleaved] [group]
//   lm_head: pool_bench 2048 248320 2      routed-expert gate/up: pool_bench 2048 512 2 256
// A sixth argument, group > 1, runs that many matrices per call in one parallel region
// (cpu::linear_group), as a decode step's MoE block does: 18 = the gate and up rows of 8 routed
// experts and the shared one (pool_bench 2048 512 2 256 1 18).
// Unlike matvec_bench (one kernel call per thread, fixed halves, no barrier) this includes how
// the pool splits a call and how long the threads wait for each other at its end. A fifth
// argument of 1 rearranges the matrices into interleaved rows first, as Model.load does where
// the CPU has the layout's kernels (cpu::interleave_rows; AVX-512 VNNI builds only).
//   c++ -O3 -march=native -std=c++17 -ffp-contract=off -Icsrc benchmarks/kernels/pool_bench.cpp
//       build/dev/<tag>/liblily_core.a -lpthread -o pool_bench
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/linear.h"
#include "cpu/linear_int8.h"
#include "cpu/thread_pool.h"

using namespace lily;

// Weights on 2 MiB pages, as lily's loader keeps resident weights (lily::huge_alloc).
static uint8_t* huge_bytes(size_t bytes) { return static_cast<uint8_t*>(huge_alloc(bytes)); }

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: pool_bench IN OUT THREADS [E]\n");
    return 2;
  }
  const int in = std::atoi(argv[1]), out = std::atoi(argv[2]), threads = std::atoi(argv[3]);
  const int E = argc > 4 ? std::atoi(argv[4]) : 1, G = in / 64;
  bool interleaved = argc > 5 && std::atoi(argv[5]) == 1;
  const int group = argc > 6 ? std::max(1, std::atoi(argv[6])) : 1;
  const size_t w_bytes = size_t(out) * in / 2, p_bytes = size_t(out) * G * 2;  // per matrix
  uint8_t *w = huge_bytes(w_bytes * E), *scales = huge_bytes(p_bytes * E), *biases = huge_bytes(p_bytes * E);
  std::mt19937 rng(1);
  for (size_t i = 0; i < w_bytes * E; ++i) w[i] = uint8_t(rng());
  for (size_t i = 0; i < p_bytes * E / 2; ++i) {  // bf16 near 0.01 and -0.01
    const uint16_t s = uint16_t(0x3C24 + (rng() & 0x3F)), b = uint16_t(0xBC24 + (rng() & 0x3F));
    std::memcpy(scales + 2 * i, &s, 2);
    std::memcpy(biases + 2 * i, &b, 2);
  }
  std::vector<Linear> mats(E);
  for (int e = 0; e < E; ++e) {
    Linear& W = mats[e];
    W.format = Linear::Format::Affine;
    W.out = out, W.in = in, W.dtype = DType::BF16, W.bits = 4, W.group = 64;
    W.w = w + w_bytes * e, W.scales = scales + p_bytes * e, W.biases = biases + p_bytes * e;
  }
  if (interleaved && !cpu::int8_interleavable(mats[0])) {
    std::printf("(this build or matrix has no interleaved layout: row-major)\n");
    interleaved = false;
  }
  if (interleaved) {  // into one buffer, as cpu::arrange_for_int8 does (the sources stay: unread)
    const size_t bytes = cpu::interleaved_bytes(mats[0]);
    uint8_t* dst = huge_bytes(bytes * E);
    for (int e = 0; e < E; ++e) mats[e] = cpu::interleave_rows(mats[e], dst + bytes * e);
  }
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(in), y(size_t(out) * group);
  for (float& v : x) v = normal(rng);
  cpu::ThreadPool pool(threads);
  std::vector<cpu::LinearJob> jobs(group);
  std::printf("%d x %d, %d matrices, %d threads%s", in, out, E, threads, interleaved ? ", interleaved" : "");
  if (group > 1) std::printf(", %d a call", group);
  std::printf(": GB/s");
  for (int round = 0; round < 3; ++round) {
    long calls = 0;
    const auto t0 = std::chrono::steady_clock::now();
    double elapsed = 0;
    while (elapsed < 1.5) {
      for (int j = 0; j < group; ++j)  // the matrices in a scattered order: each call reads them from DRAM
        jobs[size_t(j)] = {&mats[size_t((calls + j) * 37 % E)], x.data(), y.data() + size_t(j) * out};
      cpu::linear_group(jobs.data(), group, 1, pool, cpu::Matmul::Int8);
      calls += group;
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    std::printf(" %.2f", double(w_bytes + 2 * p_bytes) * calls / elapsed / 1e9);
  }
  std::printf("   (y[0] = %g)\n", y[0]);
}
