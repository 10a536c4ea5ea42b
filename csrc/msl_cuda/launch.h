// How a recorded Metal dispatch becomes one cuLaunchKernel: the host-side arithmetic, with no
// driver call, so it is tested without a GPU (tests/test_msl_cuda.py).
//
//  - The launch is 1-D over all of the dispatch's threadgroups (CUDA's grid y and z stop at
//    65535; Metal's do not); the entry recovers (x, y, z) from the linear id exactly as
//    threadgroup_position() below does (csrc/msl_cuda/prelude/metal_stdlib, Thread).
//  - [[threadgroup(i)]] memory: one dynamic shared allocation, the lengths laid out in index
//    order, each at a multiple of 16 bytes (Metal's lengths are multiples of 16 already).
//  - set_bytes data and threadgroup permutations of a command buffer are packed into one staging
//    block, uploaded once before its first launch.
//  - The order-checking mode launches block b as threadgroup order[b], order a seeded random
//    permutation, so a kernel whose result depends on the order its threadgroups run in (or
//    on the lowest-numbered ones finishing first) shows it.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gpu/device.h"
#include "msl_cuda/prelude/lily_msl_cuda_abi.h"

namespace lily::msl_cuda {

// Offsets of each [[threadgroup(i)]] length in the dynamic shared memory; returns the total.
size_t threadgroup_layout(const std::array<size_t, LILY_MSL_MAX_BINDINGS>& lengths,
                          uint32_t offsets[LILY_MSL_MAX_BINDINGS]);

// The threadgroup a launch block runs: (x, y, z) of linear id `linear` in `grid`.
gpu::Size3 threadgroup_position(uint64_t linear, gpu::Size3 grid);

// A seeded uniform permutation of 0..n-1 (Fisher-Yates over splitmix64): the same seed, the
// same order on every machine.
std::vector<uint32_t> threadgroup_permutation(uint32_t n, uint64_t seed);

// The threadgroups of a dispatch as one launch dimension; throws lily::Error naming the kernel
// past CUDA's 2^31 - 1 blocks.
uint32_t launch_blocks(gpu::Size3 grid, const std::string& kernel);

// Bytes appended at aligned offsets: the command buffer's staging block.
class Staging {
 public:
  size_t add(const void* data, size_t n, size_t align);  // returns the offset
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

}  // namespace lily::msl_cuda
