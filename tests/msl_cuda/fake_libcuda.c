/* A stand-in for the CUDA driver (libcuda.so.1) for testing lily's msl_cuda runtime on a
 * machine without a GPU (tests/test_msl_cuda.py loads it through LILY_LIBCUDA). It implements
 * the entry points msl_cuda resolves over host memory: "device" pointers are malloc'ed host
 * pointers (never freed, so a test can read what a launch was given after the command buffer
 * completed), copies and memsets happen at once, and kernels do not run: each call is appended
 * to the JSON-lines file $FAKE_LIBCUDA_LOG, a launch with its grid, block, dynamic shared memory
 * and the bytes of its one parameter (lily_msl_cuda_args).
 *
 * Knobs: FAKE_LIBCUDA_STATIC_SHARED (bytes a kernel's static shared memory reports),
 * FAKE_LIBCUDA_MAX_THREADS (a kernel's maximum threads per block), FAKE_LIBCUDA_FAULT (waiting for
 * an event returns CUDA_ERROR_ILLEGAL_ADDRESS, as after a kernel fault). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
enum { OK = 0, NOT_FOUND = 500, ILLEGAL_ADDRESS = 700 };

static void logf_(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void logf_(const char* fmt, ...) {
  const char* path = getenv("FAKE_LIBCUDA_LOG");
  if (!path) return;
  FILE* f = fopen(path, "a");
  if (!f) return;
  va_list ap;
  va_start(ap, fmt);
  vfprintf(f, fmt, ap);
  va_end(ap);
  fputc('\n', f);
  fclose(f);
}
static int env_int(const char* name, int fallback) {
  const char* v = getenv(name);
  return v ? atoi(v) : fallback;
}
static CUresult event_result(void) { return getenv("FAKE_LIBCUDA_FAULT") ? ILLEGAL_ADDRESS : OK; }

typedef struct Module {
  char* ptx;
} Module;
typedef struct Function {
  char name[256];
} Function;

CUresult cuInit(unsigned flags) { return OK; }
CUresult cuDriverGetVersion(int* v) { *v = 13000; return OK; }
CUresult cuGetErrorName(CUresult r, const char** s) {
  *s = r == ILLEGAL_ADDRESS ? "CUDA_ERROR_ILLEGAL_ADDRESS" : r == NOT_FOUND ? "CUDA_ERROR_NOT_FOUND" : "CUDA_ERROR_UNKNOWN";
  return OK;
}
CUresult cuGetErrorString(CUresult r, const char** s) { *s = "fake driver"; return OK; }
CUresult cuDeviceGetCount(int* n) { *n = 1; return OK; }
CUresult cuDeviceGet(int* d, int ordinal) { *d = ordinal; return OK; }
CUresult cuDeviceGetName(char* name, int len, int d) { snprintf(name, len, "Fake H200"); return OK; }
CUresult cuDeviceGetAttribute(int* v, int attr, int d) {
  *v = attr == 75 ? 9 : attr == 76 ? 0 : attr == 16 ? 132 : 0;
  return OK;
}
CUresult cuDeviceTotalMem_v2(size_t* bytes, int d) {
  *bytes = (size_t)143771ull << 20; /* an H200's 140 GiB */
  return OK;
}
CUresult cuDevicePrimaryCtxRetain(void** ctx, int d) { *ctx = (void*)0x1; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(int d) { return OK; }
CUresult cuCtxSetCurrent(void* ctx) { return OK; }

CUresult cuModuleLoadDataEx(Module** m, const void* image, unsigned n, int* keys, void** values) {
  *m = calloc(1, sizeof(Module));
  (*m)->ptx = strdup((const char*)image);
  logf_("{\"call\": \"module_load\", \"bytes\": %zu}", strlen((*m)->ptx));
  return OK;
}
CUresult cuModuleUnload(Module* m) { return OK; }
CUresult cuModuleGetFunction(Function** f, Module* m, const char* name) {
  char entry[300];
  snprintf(entry, sizeof entry, ".entry %s(", name);
  if (!strstr(m->ptx, entry)) return NOT_FOUND;
  *f = calloc(1, sizeof(Function));
  snprintf((*f)->name, sizeof (*f)->name, "%s", name);
  return OK;
}
CUresult cuFuncGetAttribute(int* v, int attr, Function* f) {
  switch (attr) {
    case 0: *v = env_int("FAKE_LIBCUDA_MAX_THREADS", 1024); break;
    case 1: *v = env_int("FAKE_LIBCUDA_STATIC_SHARED", 0); break;
    case 4: *v = 32; break;
    default: *v = 0;
  }
  return OK;
}

CUresult cuMemAlloc_v2(unsigned long long* p, size_t n) {
  *p = (unsigned long long)calloc(1, n);
  logf_("{\"call\": \"alloc\", \"ptr\": %llu, \"bytes\": %zu}", *p, n);
  return OK;
}
CUresult cuMemFree_v2(unsigned long long p) { return OK; }
CUresult cuMemAllocHost_v2(void** p, size_t n) { *p = calloc(1, n); return OK; }
CUresult cuMemFreeHost(void* p) { return OK; }
CUresult cuMemcpyHtoDAsync_v2(unsigned long long dst, const void* src, size_t n, void* stream) {
  /* The bytes of a small copy (tokens, ring reads) go into the log: the memory is overwritten later. */
  char hex[2 * 64 + 1] = "";
  for (size_t i = 0; n <= 64 && i < n; ++i) sprintf(hex + 2 * i, "%02x", ((const unsigned char*)src)[i]);
  memcpy((void*)dst, src, n);
  logf_("{\"call\": \"htod\", \"dst\": %llu, \"bytes\": %zu, \"stream\": %llu, \"data\": \"%s\"}", dst, n,
        (unsigned long long)stream, hex);
  return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, unsigned long long src, size_t n, void* stream) {
  memcpy(dst, (const void*)src, n);
  logf_("{\"call\": \"dtoh\", \"src\": %llu, \"bytes\": %zu, \"stream\": %llu}", src, n, (unsigned long long)stream);
  return OK;
}
CUresult cuMemcpyDtoDAsync_v2(unsigned long long dst, unsigned long long src, size_t n, void* stream) {
  memmove((void*)dst, (const void*)src, n);
  logf_("{\"call\": \"dtod\", \"dst\": %llu, \"src\": %llu, \"bytes\": %zu, \"stream\": %llu}", dst, src, n,
        (unsigned long long)stream);
  return OK;
}
CUresult cuMemsetD8Async(unsigned long long dst, unsigned char v, size_t n, void* stream) {
  memset((void*)dst, v, n);
  logf_("{\"call\": \"memset\", \"dst\": %llu, \"bytes\": %zu, \"stream\": %llu}", dst, n, (unsigned long long)stream);
  return OK;
}

static unsigned long long next_handle = 0x1000;
CUresult cuStreamCreate(void** s, unsigned flags) { *s = (void*)(next_handle++); return OK; }
CUresult cuStreamDestroy_v2(void* s) { return OK; }
CUresult cuStreamSynchronize(void* s) { return OK; }
CUresult cuEventCreate(void** e, unsigned flags) { *e = (void*)(next_handle++); return OK; }
CUresult cuEventDestroy_v2(void* e) { return OK; }
CUresult cuEventRecord(void* e, void* s) {
  logf_("{\"call\": \"event\", \"stream\": %llu}", (unsigned long long)s);
  return OK;
}
CUresult cuEventSynchronize(void* e) { return event_result(); }
CUresult cuEventElapsedTime(float* ms, void* a, void* b) { *ms = 0.5f; return OK; }

CUresult cuLaunchKernel(Function* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, void* stream, void** params, void** extra) {
  enum { ARGS_BYTES = 392 }; /* sizeof(lily_msl_cuda_args) */
  char hex[2 * ARGS_BYTES + 1];
  const unsigned char* a = (const unsigned char*)params[0];
  for (int i = 0; i < ARGS_BYTES; ++i) sprintf(hex + 2 * i, "%02x", a[i]);
  logf_("{\"call\": \"launch\", \"kernel\": \"%s\", \"grid\": [%u, %u, %u], \"block\": [%u, %u, %u], "
        "\"shared\": %u, \"stream\": %llu, \"args\": \"%s\"}",
        f->name, gx, gy, gz, bx, by, bz, shared, (unsigned long long)stream, hex);
  return OK;
}
