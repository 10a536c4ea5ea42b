// How near the read bandwidth a decode kernel's stream can get on this CPU, and how near lily's
// gets: one process, one cpu::ThreadPool, each round one pass of every kind in a shuffled order,
// each kind's GB/s (its bytes over its seconds, all rounds) as a share of the plain reads' in the
// same rounds. A ratio within one process and one minute, where a membw run before or after
// another program's would compare two states of a shared VM's memory.
//   stream_ceiling [ROUNDS=30] [THREADS=2] [KINDS=plain,prefetch,loads,arith,half,kernel,moe]
// Kinds. All but `kernel` and `moe` read one 1 GiB buffer on 2 MiB pages (lily::HugePages, the
// loader's memory, as every buffer here), each thread its contiguous part:
//   plain     membw's loop (benchmarks/membw.c): eight 64-byte loads summed per 512 bytes
//   prefetch  the same with every line also prefetched into L2 16 KiB ahead (membw's other mode)
//   loads     the decode kernel's stream without its arithmetic: four 64-byte loads per 256
//             bytes, every line prefetched into L2 8 KiB ahead (prefetcht1, as on Intel)
//   arith     that stream with the interleaved kernel's arithmetic per 256 bytes (linear_int8.cpp,
//             interleaved_block, one token): per 64 bytes the low nibbles and the high ones
//             masked, a VPDPBUSD of each; per 256 bytes an add, a convert and an FMA
//   half      arith with the low nibbles' half only: what half the arithmetic per byte costs
//   kernel    lily's kernel: cpu::linear, int8 mode, one token, on the lm_head's shape
//             (2048 x 248,320, 4-bit MLX affine, bf16 scales, group 64) in the interleaved layout,
//             4 copies called in turn so that each call streams from DRAM
//   moe       lily's kernel on a decode step's MoE matrices, as moe_block calls it: per layer one
//             cpu::linear_group of the gate and up rows of 9 experts (18 matrices 512 x 2048),
//             then cpu::linear_sum of their 9 down rows and their mix (2048 x 512; its inputs
//             random, not the SwiGLU of the first call's outputs: the bytes read are the same);
//             the experts drawn at random from 256 (453 MB, beyond the L3), 24 layers a pass
// Needs AVX-512 VNNI (the interleaved kernel's instruction set).
// Build (after scripts/dev_build.sh):
//   c++ -O3 -march=native -std=c++17 -ffp-contract=off -Icsrc benchmarks/kernels/stream_ceiling.cpp
//       build/dev/<tag>/liblily_core.a -lpthread -o stream_ceiling
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/linear.h"
#include "cpu/linear_int8.h"
#include "cpu/thread_pool.h"
#include "model/pages.h"

#if !defined(__AVX512VNNI__) || !defined(__AVX512BW__)
#error "stream_ceiling needs AVX-512 VNNI: build with -march=native on such a CPU"
#endif

using namespace lily;

namespace {

enum class Kind { Plain, Prefetch, Loads, Arith, Half, Kernel, Moe };
constexpr const char* kNames[] = {"plain", "prefetch", "loads", "arith", "half", "kernel", "moe"};

// The sum of the 16 lanes (of type Lane) of the vector at v: a store, not _mm512_reduce_add_*,
// where GCC 12 warns on its own header's code.
template <class Lane>
double lane_sum(const void* v) {
  Lane lanes[16];
  std::memcpy(lanes, v, sizeof lanes);
  double s = 0;
  for (Lane l : lanes) s += double(l);
  return s;
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// membw's loop: [a, end) in 512-byte steps, optionally prefetching 16 KiB ahead into L2.
template <bool kPrefetch>
float read_plain(const uint8_t* a, const uint8_t* end) {
  __m512 s[8];
  for (__m512& v : s) v = _mm512_setzero_ps();
  for (const uint8_t* p = a; p < end; p += 512) {
    if constexpr (kPrefetch)
      for (int j = 0; j < 8; ++j) _mm_prefetch(reinterpret_cast<const char*>(p) + 64 * j + 16384, _MM_HINT_T1);
    for (int j = 0; j < 8; ++j) s[j] = _mm512_add_ps(s[j], _mm512_load_ps(reinterpret_cast<const float*>(p + 64 * j)));
  }
  for (int j = 1; j < 8; ++j) s[0] = _mm512_add_ps(s[0], s[j]);
  return float(lane_sum<float>(&s[0]));
}

// The kernel's stream in 256-byte steps, each line prefetched into L2 8 KiB ahead, with none, all
// or half of the interleaved kernel's arithmetic on it (the activations: constants in registers).
template <Kind K>
float read_kernel_like(const uint8_t* a, const uint8_t* end) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), mF0 = _mm512_set1_epi8(char(0xF0));
  const __m512 scale = _mm512_set1_ps(0.5f);
  __m512 acc = _mm512_setzero_ps();
  __m512i sum = _mm512_setzero_si512();
  const uint8_t* ahead = a;
  for (const uint8_t* p = a; p < end; p += 256) {
    for (const uint8_t* want = std::min(end, p + 256 + 8192); ahead < want; ahead += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T1);
    if constexpr (K == Kind::Loads) {
      for (int k = 0; k < 4; ++k) sum = _mm512_add_epi32(sum, _mm512_load_si512(p + 64 * k));
    } else {
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int k = 0; k < 4; ++k) {
        const __m512i v = _mm512_load_si512(p + 64 * k);
        lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(v, m4), _mm512_set1_epi32(0x01020304 + k));
        if constexpr (K == Kind::Arith)
          hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(v, mF0), _mm512_set1_epi32(0x05060708 + k));
      }
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, _mm512_srai_epi32(hi, 4))), scale, acc);
    }
  }
  return float(lane_sum<float>(&acc) + lane_sum<int32_t>(&sum));
}

float read_slice(Kind k, const uint8_t* a, const uint8_t* end) {
  switch (k) {
  case Kind::Plain: return read_plain<false>(a, end);
  case Kind::Prefetch: return read_plain<true>(a, end);
  case Kind::Loads: return read_kernel_like<Kind::Loads>(a, end);
  case Kind::Arith: return read_kernel_like<Kind::Arith>(a, end);
  case Kind::Half: return read_kernel_like<Kind::Half>(a, end);
  case Kind::Kernel:
  case Kind::Moe: break;
  }
  return 0;
}

std::vector<Kind> parse_kinds(const std::string& list) {
  std::vector<Kind> kinds;
  std::stringstream ss(list);
  for (std::string name; std::getline(ss, name, ',');) {
    const auto* it = std::find_if(std::begin(kNames), std::end(kNames), [&](const char* n) { return name == n; });
    if (it == std::end(kNames)) {
      std::fprintf(stderr, "stream_ceiling: unknown kind '%s' (plain, prefetch, loads, arith, half, kernel, moe)\n",
                   name.c_str());
      std::exit(2);
    }
    kinds.push_back(Kind(it - std::begin(kNames)));
  }
  return kinds;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 30, threads = argc > 2 ? std::atoi(argv[2]) : 2;
  const std::vector<Kind> kinds = parse_kinds(argc > 3 ? argv[3] : "plain,prefetch,loads,arith,half,kernel,moe");
  if (rounds < 1 || threads < 1) {
    std::fprintf(stderr, "usage: stream_ceiling [ROUNDS>=1] [THREADS>=1] [KINDS]\n");
    return 2;
  }
  // The synthetic kinds' buffer, touched page by page.
  constexpr size_t kBuffer = size_t(1) << 30;
  HugePages buffer(kBuffer, "stream_ceiling's buffer");
  uint8_t* buf = buffer.data();
  for (size_t i = 0; i < kBuffer; i += 4096) std::memset(buf + i, int(i >> 12), 4096);

  // Random 4-bit codes, bf16 scales and biases near +-0.01, n matrices out x in rearranged as
  // Model.load does, in one run of huge pages (kept in `store`).
  std::mt19937 rng(1);
  std::deque<HugePages> store;  // a deque: HugePages does not move
  auto interleaved = [&](int in, int out, int n, const char* what) {
    const size_t w_bytes = size_t(out) * in / 2, p_bytes = size_t(out) * (in / 64) * 2;
    HugePages source(w_bytes + 2 * p_bytes, what);
    uint8_t* src = source.data();
    Linear W;
    W.format = Linear::Format::Affine;
    W.out = out, W.in = in, W.dtype = DType::BF16, W.bits = 4, W.group = 64;
    W.w = src, W.scales = src + w_bytes, W.biases = src + w_bytes + p_bytes;
    if (!cpu::int8_interleavable(W)) {
      std::fprintf(stderr, "stream_ceiling: this build has no interleaved layout\n");
      std::exit(1);
    }
    const size_t bytes = cpu::interleaved_bytes(W);
    store.emplace_back(bytes * size_t(n), what);
    // One random source for all n copies: the bytes' values do not change how fast they stream.
    for (size_t i = 0; i < w_bytes; ++i) src[i] = uint8_t(rng());
    for (size_t i = 0; i < p_bytes; i += 2) {
      const uint16_t sc = uint16_t(0x3C24 + (rng() & 0x3F)), b = uint16_t(0xBC24 + (rng() & 0x3F));
      std::memcpy(src + w_bytes + i, &sc, 2);
      std::memcpy(src + w_bytes + p_bytes + i, &b, 2);
    }
    std::vector<Linear> mats;
    for (int c = 0; c < n; ++c) mats.push_back(cpu::interleave_rows(W, store.back().data() + bytes * size_t(c)));
    return std::pair<std::vector<Linear>, double>{mats, double(w_bytes + 2 * p_bytes)};
  };
  const auto has = [&](Kind k) { return std::find(kinds.begin(), kinds.end(), k) != kinds.end(); };
  // The lm_head: 4 copies called in turn.
  constexpr int kHidden = 2048, kVocab = 248320, kCopies = 4;
  // The MoE block: kActive experts a token (8 routed and the shared one) of kExperts, kLayers a pass.
  constexpr int kExperts = 256, kExpertRows = 512, kActive = 9, kLayers = 24;
  const auto [heads, head_bytes] = interleaved(kHidden, has(Kind::Kernel) ? kVocab : 16, kCopies, "the lm_head");
  // The experts' gate, up and down rows.
  const int experts = has(Kind::Moe) ? kExperts : 1;
  const auto [gate_up, gate_up_bytes] = interleaved(kHidden, kExpertRows, 2 * experts, "the experts' gate and up rows");
  const auto [down, down_bytes] = interleaved(kExpertRows, kHidden, experts, "the experts' down rows");
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(kHidden), y(kVocab), act(kActive * 2 * kExpertRows), ye(kActive * kHidden);
  std::vector<float> mix(kActive, 1.0f / kActive), moe_out(kHidden);
  for (float& v : x) v = normal(rng);
  for (float& v : act) v = normal(rng);

  cpu::ThreadPool pool(threads);
  volatile float sink = 0;
  // One pass of kind k (round r picks the lm_head's copy): {bytes, seconds}.
  auto pass = [&](Kind k, int r) {
    const double t0 = now();
    double bytes;
    if (k == Kind::Kernel) {
      cpu::linear(heads[size_t(r % kCopies)], x.data(), 1, y.data(), pool, cpu::Matmul::Int8);
      bytes = head_bytes;
    } else if (k == Kind::Moe) {
      std::uniform_int_distribution<int> pick(0, kExperts - 1);
      cpu::LinearJob jobs[2 * kActive];
      for (int l = 0; l < kLayers; ++l) {
        int e[kActive];
        for (int& id : e) id = pick(rng);
        for (int i = 0; i < kActive; ++i)
          for (int h = 0; h < 2; ++h)
            jobs[2 * i + h] = {&gate_up[size_t(2 * e[i] + h)], x.data(), act.data() + (2 * i + h) * kExpertRows};
        cpu::linear_group(jobs, 2 * kActive, 1, pool, cpu::Matmul::Int8);
        for (int i = 0; i < kActive; ++i)
          jobs[i] = {&down[size_t(e[i])], act.data() + 2 * i * kExpertRows, ye.data() + i * kHidden};
        cpu::linear_sum(jobs, mix.data(), kActive, moe_out.data(), pool, cpu::Matmul::Int8);
      }
      bytes = double(kLayers) * kActive * (2 * gate_up_bytes + down_bytes);
    } else {
      const size_t part = kBuffer / size_t(threads) / 512 * 512;
      pool.parallel_for(threads, [&](int64_t i0, int64_t i1, int) {
        for (int64_t i = i0; i < i1; ++i) sink = read_slice(k, buf + size_t(i) * part, buf + size_t(i + 1) * part);
      });
      bytes = double(part) * threads;
    }
    return std::pair<double, double>{bytes, now() - t0};
  };

  for (Kind k : kinds) pass(k, 0);  // warm-up: page faults, the pool's threads
  const size_t n = std::size(kNames);
  std::vector<double> bytes(n), seconds(n);
  std::vector<std::vector<double>> gbps(n);
  for (int r = 0; r < rounds; ++r) {
    std::vector<Kind> order = kinds;
    std::shuffle(order.begin(), order.end(), rng);
    for (Kind k : order) {
      const auto [b, s] = pass(k, r);
      bytes[size_t(k)] += b, seconds[size_t(k)] += s;
      gbps[size_t(k)].push_back(b / s / 1e9);
    }
  }
  const bool has_plain = seconds[size_t(Kind::Plain)] > 0;
  const double plain = has_plain ? bytes[size_t(Kind::Plain)] / seconds[size_t(Kind::Plain)] / 1e9 : 0;
  std::printf("%d rounds, %d threads; GB/s over all passes (min / median / max of single passes)%s\n", rounds,
              threads, has_plain ? ", % of plain's" : "");
  for (Kind k : kinds) {
    std::vector<double>& v = gbps[size_t(k)];
    std::sort(v.begin(), v.end());
    const double mean = bytes[size_t(k)] / seconds[size_t(k)] / 1e9;
    std::printf("%-9s %6.2f  (%.1f / %.1f / %.1f)", kNames[size_t(k)], mean, v.front(), v[v.size() / 2], v.back());
    if (has_plain) std::printf("  %5.1f%%", 100 * mean / plain);
    std::printf("\n");
  }
  std::printf("(y[0] = %g, ye[0] = %g)\n", double(y[0]), double(ye[0]));
}
