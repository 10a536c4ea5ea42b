// Running one dispatch of a compiled kernel on the CPU with Metal's execution semantics.
//
// Threadgroups run one after another; inside a threadgroup every thread is a fiber with its
// own stack. A fiber runs until it finishes, reaches a barrier, or reaches a
// simdgroup collective; when every fiber is blocked the scheduler releases what is complete:
//  - a simdgroup whose 32 lanes (fewer in a short last simdgroup) all wait at the same
//    collective or simdgroup_barrier;
//  - the threadgroup, when every thread waits at the same threadgroup_barrier.
// Anything else is a GPU bug and fails the dispatch with the kernel's name, the barrier's
// file:line and which threads were where: a barrier some threads never reach (divergence or
// an early return), two different barriers, a collective not reached by every lane.
// Threadgroup memory is fresh per threadgroup and filled with 0xFF bytes (NaN for floats), so
// reading it before writing shows. In randomized mode the order of threadgroups, and of
// threads in every phase between barriers, is a seeded random permutation: with a missing
// barrier the result then depends on the order, which the device's interleaving check finds.
#pragma once
#include <cstdint>

#include "gpu/device.h"
#include "msl_cpu/compiler.h"

namespace lily::msl_cpu {

// The host services that kernel modules call (barriers, collectives, threadgroup arrays).
const lily_msl_host_api* host_api();

struct DispatchRun {
  const Module* module = nullptr;
  const lily_msl_kernel* kernel = nullptr;
  // buffers / buffer_lengths bound; threadgroup_memory_lengths set (memory is per threadgroup).
  lily_msl_bindings bindings{};
  gpu::Size3 threadgroups, threads;
  bool randomize = false;
  uint64_t seed = 0;
  size_t stack_bytes = 256 * 1024;
};

// Runs every threadgroup; throws lily::Error naming the kernel on a GPU bug.
void execute(const DispatchRun& run);

}  // namespace lily::msl_cpu
