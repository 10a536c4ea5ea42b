// Micro-benchmark of the CPU backend's attention over a long KV cache, alone (no model): the
// decode step of one gated-attention layer at the Qwen3.5/3.6 MoE shape (16 query heads, 2 KV
// heads, head_dim 256), against a context of `context` cached positions; with tokens > 1, a
// prefill chunk of that many tokens after the context instead.
//   attention_bench [context] [threads] [layers] [steps] [tokens]
// `layers` independent caches are visited in turn, one decode step each, as a model's attention
// layers are: with 8 layers x 16 MB (4K positions, f32 K and V) the working set is well past
// the L3, so each step reads its cache from DRAM, as in a real decode step (where hundreds of MB
// of weights stream between two attention layers). The projections run on a hidden size of 64
// (dense f32), so the time is the attention's. Prints the median and best ms per step and the
// KV bytes a step reads per second of the median.
//   c++ -O3 -march=native -std=c++17 -ffp-contract=off -Icsrc benchmarks/kernels/attention_bench.cpp \
//       build/dev/<tag>/liblily_core.a -lpthread -o attention_bench
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cpu/attention.h"
#include "cpu/thread_pool.h"

using namespace lily;
using namespace lily::cpu;

namespace {

Linear dense(std::vector<float>& storage, int out, int in, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f / std::sqrt(float(in)));
  storage.resize(size_t(out) * in);
  for (float& x : storage) x = nd(rng);
  Linear l;
  l.format = Linear::Format::Dense;
  l.dtype = DType::F32;
  l.out = out;
  l.in = in;
  l.w = reinterpret_cast<const uint8_t*>(storage.data());
  return l;
}

}  // namespace

int main(int argc, char** argv) {
  const int context = argc > 1 ? atoi(argv[1]) : 4096;
  const int threads = argc > 2 ? atoi(argv[2]) : 2;
  const int layers = argc > 3 ? atoi(argv[3]) : 8;
  const int steps = argc > 4 ? atoi(argv[4]) : 64;
  const int tokens = argc > 5 ? atoi(argv[5]) : 1;

  ModelConfig c;
  c.hidden = 64;
  c.n_heads = 16;
  c.n_kv_heads = 2;
  c.head_dim = 256;
  c.rotary_dim = 64;
  c.rope_theta = 1e7;
  const int Hq = c.n_heads, Hkv = c.n_kv_heads, D = c.head_dim;

  std::mt19937 rng(1);
  std::vector<float> wq, wk, wv, wo;
  AttentionWeights w;
  w.q_proj = dense(wq, Hq * D * 2, c.hidden, rng);
  w.k_proj = dense(wk, Hkv * D, c.hidden, rng);
  w.v_proj = dense(wv, Hkv * D, c.hidden, rng);
  w.o_proj = dense(wo, c.hidden, Hq * D, rng);
  w.q_norm.assign(D, 1.0f);
  w.k_norm.assign(D, 1.0f);

  // Caches filled with random keys and values at positions [0, context).
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<KvCache> caches(layers);
  std::vector<float> row(D);
  for (KvCache& kv : caches) {
    kv.kv_heads = Hkv;
    kv.head_dim = D;
    kv.reserve(context + tokens, context + tokens);
    for (int h = 0; h < Hkv; ++h)
      for (int p = 0; p < context; ++p) {
        for (float& x : row) x = nd(rng);
        kv.put_k(h, p, row.data());
        for (int d = 0; d < D; ++d) kv.v_at(h, p)[d] = nd(rng);
      }
  }

  ThreadPool pool(threads);
  AttentionScratch scratch;
  std::vector<float> h(size_t(tokens) * c.hidden), y(h.size());
  for (float& x : h) x = nd(rng);
  std::vector<double> ms;
  for (int i = 0; i < steps + layers; ++i) {  // the first round over the layers is a warm-up
    KvRows seq{&caches[i % layers], context, 0, tokens};  // tokens at positions [context, context + tokens)
    const auto t0 = std::chrono::steady_clock::now();
    attention_mixer(c, w, &seq, 1, h.data(), tokens, y.data(), scratch, pool);
    const auto t1 = std::chrono::steady_clock::now();
    if (i >= layers) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  const double kv_mb = 2.0 * Hkv * (context + tokens) * D * sizeof(float) / 1e6;
  std::printf("context %d tokens %d threads %d layers %d: median %.3f ms best %.3f ms per step; KV %.1f MB, %.1f GB/s at the median\n",
              context, tokens, threads, layers, ms[ms.size() / 2], ms[0], kv_mb, kv_mb / ms[ms.size() / 2]);
  return 0;
}
