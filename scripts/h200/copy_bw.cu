// The GPU's achievable memory bandwidth, the yardstick of the per-kernel GB/s tables
// (scripts/h200/fullsize.py / long_context.py --copy-gbs). Built and run on the H200 machine:
//   nvcc -O2 -o /tmp/copy_bw scripts/h200/copy_bw.cu && /tmp/copy_bw
// Prints one JSON line: a device-to-device cudaMemcpy (bytes read + bytes written per second,
// the figure vendors' bandwidth tests report) and a read-only streaming kernel (bytes read per
// second: what a decode step's weight reads can reach at best), each the best of 10 runs over
// 2 GiB (far past the 50 MB L2).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e = (x);                                                          \
    if (e != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e));                \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

// Each thread sums a strided run of 16-byte words; the sum is stored only if it equals a value
// it never takes, so the reads cannot be optimised away and nothing is written.
__global__ void read_stream(const float4* __restrict__ in, size_t n, float* out) {
  float acc = 0.0f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    float4 v = in[i];
    acc += v.x + v.y + v.z + v.w;
  }
  if (acc == -1.2345f) *out = acc;
}

int main() {
  const size_t bytes = size_t(2) << 30;
  void *a, *b;
  CHECK(cudaMalloc(&a, bytes));
  CHECK(cudaMalloc(&b, bytes));
  CHECK(cudaMemset(a, 0, bytes));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float best_copy = 1e30f, best_read = 1e30f;
  for (int rep = 0; rep < 11; ++rep) {  // the first of each is a warm-up
    float ms = 0;
    CHECK(cudaEventRecord(t0));
    CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(t1));
    CHECK(cudaEventSynchronize(t1));
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    if (rep > 0 && ms < best_copy) best_copy = ms;
    CHECK(cudaEventRecord(t0));
    read_stream<<<sms * 8, 512>>>(static_cast<const float4*>(a), bytes / 16, static_cast<float*>(b));
    CHECK(cudaEventRecord(t1));
    CHECK(cudaEventSynchronize(t1));
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    if (rep > 0 && ms < best_read) best_read = ms;
  }
  CHECK(cudaGetLastError());
  std::printf("{\"bytes\": %zu, \"memcpy_d2d_gb_s\": %.1f, \"read_gb_s\": %.1f}\n", bytes,
              2.0 * bytes / (best_copy * 1e6), double(bytes) / (best_read * 1e6));
  return 0;
}
