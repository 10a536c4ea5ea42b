// Launch arithmetic; see launch.h.
#include "msl_cuda/launch.h"

#include <cstring>

#include "model/error.h"

namespace lily::msl_cuda {

// The kernel parameter's layout is fixed: the host and nvptx64 must agree byte for byte.
static_assert(sizeof(lily_msl_cuda_args) == 392, "lily_msl_cuda_args changed: bump LILY_MSL_CUDA_ABI_VERSION");
static_assert(sizeof(lily_msl_cuda_meta) == 848, "lily_msl_cuda_meta changed: bump LILY_MSL_CUDA_ABI_VERSION");

size_t threadgroup_layout(const std::array<size_t, LILY_MSL_MAX_BINDINGS>& lengths,
                          uint32_t offsets[LILY_MSL_MAX_BINDINGS]) {
  size_t total = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    total = (total + 15) & ~size_t(15);
    offsets[i] = static_cast<uint32_t>(total);
    total += lengths[i];
  }
  return total;
}

gpu::Size3 threadgroup_position(uint64_t linear, gpu::Size3 grid) {
  gpu::Size3 p;
  p.width = static_cast<uint32_t>(linear % grid.width);
  p.height = static_cast<uint32_t>((linear / grid.width) % grid.height);
  p.depth = static_cast<uint32_t>(linear / (uint64_t(grid.width) * grid.height));
  return p;
}

std::vector<uint32_t> threadgroup_permutation(uint32_t n, uint64_t seed) {
  std::vector<uint32_t> order(n);
  for (uint32_t i = 0; i < n; ++i) order[i] = i;
  uint64_t s = seed;
  auto next = [&s] {  // splitmix64
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  for (uint32_t i = n; i > 1; --i) {
    const uint32_t j = static_cast<uint32_t>(next() % i);  // bias < 2^-32 for any n here
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

uint32_t launch_blocks(gpu::Size3 grid, const std::string& kernel) {
  const uint64_t n = uint64_t(grid.width) * grid.height * grid.depth;
  if (n > 0x7FFFFFFFull)
    throw Error("[msl_cuda] kernel '" + kernel + "': " + std::to_string(n) +
                " threadgroups exceed CUDA's 2147483647 blocks per launch");
  return static_cast<uint32_t>(n);
}

size_t Staging::add(const void* data, size_t n, size_t align) {
  const size_t at = (bytes_.size() + align - 1) / align * align;
  bytes_.resize(at + n);
  if (n) std::memcpy(bytes_.data() + at, data, n);
  return at;
}

}  // namespace lily::msl_cuda
