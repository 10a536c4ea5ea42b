// The msl_cpu implementation of gpu::Device: Metal's object model and encoder semantics over
// kernels compiled for the CPU (compiler.h) and run by the fiber executor (executor.h).
//
// A command buffer records its encoders' commands and executes them at commit(), in order;
// an error is kept and raised by wait_until_completed(). Besides executing, the device can
// check what the GPU would not tell you:
//  - interleavings = K: every dispatch also runs K more times from the same inputs with random
//    threadgroup and thread orders; a result that differs names the kernel and the buffer
//    (a missing barrier, or threads racing on memory);
//  - check_dependencies: in a Concurrent encoder, each group of dispatches between two memory
//    barriers is also run in reverse order; a changed result names the two dispatches that are
//    not independent (a memory barrier is missing between them);
//  - asan: kernels built with AddressSanitizer (the process must preload the ASan runtime),
//    so an out-of-bounds read or write in a buffer or threadgroup memory stops with a report.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/device.h"

namespace lily::msl_cpu {

struct DeviceOptions {
  bool asan = false;
  int interleavings = 0;
  bool check_dependencies = false;
  // Claim Metal 4 (GPU family Metal4: tensors and MetalPerformancePrimitives' matmul2d): kernels
  // are compiled with __HAVE_TENSOR__ and the emulation in prelude/metal_tensor, and
  // supports_tensor_ops() is true, so the GPU backend takes its tensor-op GEMM path.
  bool metal4 = false;
  uint64_t seed = 0;
  std::vector<std::string> include_dirs;  // searched by #include in kernel sources
};

std::shared_ptr<gpu::Device> make_device(const DeviceOptions& options);

}  // namespace lily::msl_cpu
