// membw: sustained memory READ bandwidth, the roofline of batch-1 decode.
//
//   cc -O3 -march=native -pthread benchmarks/membw.c -o membw && ./membw [threads] [MiB] [passes] [source]
//   prints one line: threads=N bytes=B best_GBps=X median_GBps=Y plain_best_GBps=P
//   prefetch_best_GBps=Q source=S  (best/median: of the faster of the two read modes)
// passes = "serve": set up, print "ready", then for each line on stdin ("plain" or "prefetch")
//   read the buffer once that way and print "seconds=S bytes=B"; stop at end of input. A caller
//   interleaves these passes with its own work (roofline.MembwServer): the reads then sample
//   the same minutes as the work, one pass at a time, and the buffer is set up only once.
// source: "anon" (default: anonymous memory, whatever pages the OS gives), "huge" (anonymous,
// advised for 2 MiB transparent huge pages), or a file path: its first MiB bytes, mmapped
// read-only, as an mmapped checkpoint is read (run it once first so the pages are cached).
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
//   and a pass lasts from the first reader's start to the last reader's end, each reader
//   timing itself. (Until 2026-12-04 the main thread took the time around the barriers. With
//   as many readers as cores it is a thread too many: woken after the readers it could read
//   its start clock late, and a pass looked short. On the 2-core Zen 5 VM two threads "read"
//   up to 137 GB/s, three times one thread's 41, the best of 10 passes always such a one.)
// - The source option exists because where the bytes live changes the answer: on the 2-core dev
//   VM an mmapped file read ~30% slower than anonymous memory (docs/performance.md, "Decode:
//   weights in memory, prefetched").
// - Best and median over passes: the machine is shared, the best pass is the hardware's
//   ceiling, the median says how noisy the moment was. Against a decode timed over seconds the
//   best of a few short passes is an upper envelope, not what the memory gave meanwhile: on a
//   shared VM whose bandwidth moves from pass to pass the decode's share of it reads low. The
//   serve mode gives the mean over passes taken between the decode's own steps.
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef float v16f __attribute__((vector_size(64)));

typedef struct {
  const v16f* base;      // this thread's slice
  size_t n;              // vectors in the slice (multiple of 8)
  pthread_barrier_t* start;
  pthread_barrier_t* end;
  const int* mode;       // the next pass's: 0 plain, 1 prefetched, -1 none (the reader ends)
  float sink;            // keeps the sum alive
  double t_start, t_end; // the last pass: when this thread started and finished reading
  int touch;             // first-touch the slice (anonymous memory only)
} worker_t;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// prefetch = 1: each line is also prefetched into L2 16 KiB ahead (prefetcht1 on x86), as
// lily's decode kernels do; plain loads alone leave part of a core's bandwidth unused on some
// CPUs (on a Zen 2 EPYC one core read 12 GB/s with plain loads, ~15 with the prefetch).
static float read_slice(const v16f* p, size_t n, int prefetch) {
  v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
  for (size_t i = 0; i < n; i += 8) {
    if (prefetch)
      for (int j = 0; j < 8; ++j) __builtin_prefetch((const char*)(p + i + j) + 16384, 0, 2);
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
  if (w->touch) memset((void*)w->base, 0, w->n * sizeof(v16f));
  for (;;) {
    pthread_barrier_wait(w->start);  // orders the main thread's write of *mode before this read
    const int mode = *w->mode;
    if (mode < 0) return NULL;
    w->t_start = now();
    w->sink += read_slice(w->base, w->n, mode);
    w->t_end = now();
    pthread_barrier_wait(w->end);
  }
}

// One pass of every reader in `mode`: from the first reader's start to the last one's end.
static double timed_pass(worker_t* ws, int threads, int* mode_slot, int mode) {
  *mode_slot = mode;
  pthread_barrier_wait(ws[0].start);
  pthread_barrier_wait(ws[0].end);  // after it every reader's times of this pass are written
  double t0 = ws[0].t_start, t1 = ws[0].t_end;
  for (int t = 1; t < threads; ++t) {
    if (ws[t].t_start < t0) t0 = ws[t].t_start;
    if (ws[t].t_end > t1) t1 = ws[t].t_end;
  }
  return t1 - t0;
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 1;
  size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 2048;
  const int serve = argc > 3 && strcmp(argv[3], "serve") == 0;
  int passes = serve ? 1 : argc > 3 ? atoi(argv[3]) : 10;
  const char* source = argc > 4 ? argv[4] : "anon";
  if (threads < 1 || mib < 1 || passes < 1) {
    fprintf(stderr, "usage: membw [threads>=1] [MiB>=1] [passes>=1 | serve] [anon|huge|FILE]\n");
    return 2;
  }
  size_t per = (mib << 20) / threads / sizeof(v16f) / 8 * 8;  // vectors per thread
  size_t bytes = per * threads * sizeof(v16f);
  v16f* buf = NULL;
  int mapped = strcmp(source, "anon") != 0 && strcmp(source, "huge") != 0;
  if (mapped) {
    int fd = open(source, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || (size_t)st.st_size < bytes) {
      fprintf(stderr, "membw: %s: cannot open, or smaller than %zu MiB\n", source, mib);
      return 1;
    }
    buf = mmap(NULL, bytes, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (buf == MAP_FAILED) {
      fprintf(stderr, "membw: cannot map %s\n", source);
      return 1;
    }
  } else {
    if (posix_memalign((void**)&buf, 2 << 20, bytes) != 0) {
      fprintf(stderr, "membw: cannot allocate %zu MiB\n", mib);
      return 1;
    }
#ifdef MADV_HUGEPAGE
    if (strcmp(source, "huge") == 0) madvise(buf, bytes, MADV_HUGEPAGE);
#endif
  }
  pthread_barrier_t start, end;
  pthread_barrier_init(&start, NULL, threads + 1);
  pthread_barrier_init(&end, NULL, threads + 1);
  worker_t* ws = calloc(threads, sizeof(worker_t));
  pthread_t* ts = calloc(threads, sizeof(pthread_t));
  int mode = 0, status = 0;
  for (int t = 0; t < threads; ++t) {
    ws[t] = (worker_t){buf + per * t, per, &start, &end, &mode, 0, 0, 0, !mapped};
    pthread_create(&ts[t], NULL, run, &ws[t]);
  }
  if (serve) {
    char line[64];
    printf("ready\n");
    fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
      const int m = strncmp(line, "prefetch", 8) == 0 ? 1 : strncmp(line, "plain", 5) == 0 ? 0 : -1;
      if (m < 0) {
        fprintf(stderr, "membw serve: expected \"plain\" or \"prefetch\", got %s", line);
        status = 1;
        break;
      }
      printf("seconds=%.6f bytes=%zu\n", timed_pass(ws, threads, &mode, m), bytes);
      fflush(stdout);
    }
  } else {
    // Passes alternate plain / prefetched reads; the first of each warms up (page faults,
    // frequency). The roofline is the better mode: whichever reads faster is what the memory
    // system can give a reader.
    double* gbps[2] = {calloc(passes, sizeof(double)), calloc(passes, sizeof(double))};
    for (int p = 0; p < 2 * (passes + 1); ++p) {
      const double sec = timed_pass(ws, threads, &mode, p % 2);
      if (p >= 2) gbps[p % 2][p / 2 - 1] = (double)bytes / sec / 1e9;
    }
    for (int m = 0; m < 2; ++m) qsort(gbps[m], passes, sizeof(double), cmp);
    const int best = gbps[1][passes - 1] > gbps[0][passes - 1];
    float sink = 0;
    for (int t = 0; t < threads; ++t) sink += ws[t].sink;
    printf("threads=%d bytes=%zu best_GBps=%.2f median_GBps=%.2f plain_best_GBps=%.2f prefetch_best_GBps=%.2f "
           "source=%s%s\n", threads, bytes, gbps[best][passes - 1], gbps[best][passes / 2], gbps[0][passes - 1],
           gbps[1][passes - 1], mapped ? "file" : source, sink == 12345.f ? " " : "");
    free(gbps[0]); free(gbps[1]);
  }
  mode = -1;  // every reader returns at the next start barrier
  pthread_barrier_wait(&start);
  for (int t = 0; t < threads; ++t) pthread_join(ts[t], NULL);
  free(ws); free(ts);
  if (mapped) munmap(buf, bytes);
  else free(buf);
  return status;
}
