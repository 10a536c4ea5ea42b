// The msl_cuda implementation of gpu::Device: lily's .metal kernels compiled to PTX
// (compiler.h) and run on an NVIDIA GPU through the CUDA driver API (driver.h), with Metal's
// object model and encoder semantics (msl_cpu/encoder.h).
//
//  - Buffers are plain device allocations (cuMemAlloc, zero-filled; never managed memory);
//    contents() is null and the host moves bytes with Buffer::write / read / fill and
//    Device::copy, which run at once on a copy stream of their own (the caller makes sure no
//    unfinished command buffer uses those bytes, as for contents() on Metal). wrap_buffer
//    copies the caller's memory into a new allocation.
//  - A command buffer's dispatches are launched at commit(), in encoding order, on the device's
//    one stream: each starts after the previous one ends, so memory barriers are honoured (a
//    concurrent encoder's freedom to overlap is not used). Its set_bytes data and threadgroup
//    permutations go up in one pinned staging block first. wait_until_completed() raises a
//    lily::Error for a failed launch or a kernel fault.
//  - Options: `permute_threadgroups` launches every dispatch's threadgroups in a seeded random
//    order (launch.h); `timing` records CUDA events around each dispatch (take_timings);
//    `synchronous` waits after each dispatch, so a fault names its kernel.
// Limits are Apple's, not CUDA's (32 KB of threadgroup memory, counting the kernel's static
// arrays), so a dispatch that runs here would also be accepted by Metal.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/device.h"

namespace lily::msl_cuda {

struct DeviceOptions {
  int ordinal = 0;  // which GPU
  bool permute_threadgroups = false;
  uint64_t seed = 0;  // of the permutations (each dispatch draws the next one)
  bool timing = false;
  bool synchronous = false;
  std::vector<std::string> include_dirs;  // searched by #include in kernel sources
};

// Throws lily::Error when the driver cannot be loaded (naming libcuda.so.1) or has no such GPU.
std::shared_ptr<gpu::Device> make_device(const DeviceOptions& options);

// One timed dispatch (DeviceOptions::timing), in the order the GPU ran them.
struct DispatchTime {
  std::string kernel;
  gpu::Size3 threadgroups, threads;
  double ms = 0;
};
// The timings of the command buffers completed since the last call (device of make_device).
std::vector<DispatchTime> take_timings(gpu::Device& device);

// Resource use of a pipeline's compiled kernel as the driver reports it.
struct KernelResources {
  int registers = 0, local_bytes = 0, static_shared_bytes = 0, max_threads = 0;
};
KernelResources resources(const gpu::Pipeline& pipeline);  // a pipeline of an msl_cuda device

}  // namespace lily::msl_cuda
