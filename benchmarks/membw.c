// membw: sustained memory READ bandwidth, the roofline of batch-1 decode.
//
//   cc -O3 -march=native -pthread benchmarks/membw.c -o membw && ./membw [threads] [MiB] [passes]
//   prints one line: threads=N bytes=B best_GBps=X median_GBps=Y
//
// Design choices:
// - Decode streams weights once per token and does little arithmetic on them, so the ceiling is
//   how fast the cores can *read* DRAM. We measure exactly that: a sum over a buffer much larger
//   than the last-level cache (default 2 GiB), nothing written back.
// - GCC/clang vector extensions (64-byte vectors) with 8 independent accumulators: the compiler
//   emits the host's widest loads (AVX-512 here, NEON on arm64) and the add chain never limits
//   the loop, so the number is the memory system's, not the adder's.
// - Each thread owns a contiguous slice and first-touches it (pages land on its NUMA node, like
//   mmapped weights read by the same thread each token); threads start together at a barrier
//   and a pass's time is the slowest thread's.
// - Best and median over passes: the machine is shared, the best pass is the hardware's
//   ceiling, the median says how noisy the moment was.
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef float v16f __attribute__((vector_size(64)));

typedef struct {
  const v16f* base;      // this thread's slice
  size_t n;              // vectors in the slice (multiple of 8)
  int passes;
  pthread_barrier_t* start;
  pthread_barrier_t* end;
  float sink;            // keeps the sum alive
} worker_t;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static float read_slice(const v16f* p, size_t n) {
  v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
  for (size_t i = 0; i < n; i += 8) {
    a0 += p[i + 0]; a1 += p[i + 1]; a2 += p[i + 2]; a3 += p[i + 3];
    a4 += p[i + 4]; a5 += p[i + 5]; a6 += p[i + 6]; a7 += p[i + 7];
  }
  v16f s = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
  float t = 0;
  for (int j = 0; j < 16; ++j) t += s[j];
  return t;
}

static void* run(void* arg) {
  worker_t* w = (worker_t*)arg;
  // First touch by the reading thread; values are irrelevant but must not be denormal-slow.
  memset((void*)w->base, 0, w->n * sizeof(v16f));
  for (int p = 0; p < w->passes; ++p) {
    pthread_barrier_wait(w->start);
    w->sink += read_slice(w->base, w->n);
    pthread_barrier_wait(w->end);
  }
  return NULL;
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 1;
  size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 2048;
  int passes = argc > 3 ? atoi(argv[3]) : 10;
  if (threads < 1 || mib < 1 || passes < 1) {
    fprintf(stderr, "usage: membw [threads>=1] [MiB>=1] [passes>=1]\n");
    return 2;
  }
  size_t per = (mib << 20) / threads / sizeof(v16f) / 8 * 8;  // vectors per thread
  v16f* buf = NULL;
  if (posix_memalign((void**)&buf, 2 << 20, per * threads * sizeof(v16f)) != 0) {
    fprintf(stderr, "membw: cannot allocate %zu MiB\n", mib);
    return 1;
  }
  pthread_barrier_t start, end;
  pthread_barrier_init(&start, NULL, threads + 1);
  pthread_barrier_init(&end, NULL, threads + 1);
  worker_t* ws = calloc(threads, sizeof(worker_t));
  pthread_t* ts = calloc(threads, sizeof(pthread_t));
  for (int t = 0; t < threads; ++t) {
    ws[t] = (worker_t){buf + per * t, per, passes + 1, &start, &end, 0};
    pthread_create(&ts[t], NULL, run, &ws[t]);
  }
  double* gbps = calloc(passes + 1, sizeof(double));
  for (int p = 0; p <= passes; ++p) {  // pass 0 warms up (page faults, frequency)
    pthread_barrier_wait(&start);
    double t0 = now();
    pthread_barrier_wait(&end);
    gbps[p] = (double)per * threads * sizeof(v16f) / (now() - t0) / 1e9;
  }
  float sink = 0;
  for (int t = 0; t < threads; ++t) {
    pthread_join(ts[t], NULL);
    sink += ws[t].sink;
  }
  qsort(gbps + 1, passes, sizeof(double), cmp);
  printf("threads=%d bytes=%zu best_GBps=%.2f median_GBps=%.2f%s\n", threads,
         per * threads * sizeof(v16f), gbps[passes], gbps[1 + passes / 2],
         sink == 12345.f ? " " : "");
  free(gbps); free(ws); free(ts); free(buf);
  return 0;
}
