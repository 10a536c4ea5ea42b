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
  // Claim Metal 4 (GPU family Metal4: tensors and MetalPerformancePrimitives' matmul2d):
  // libraries compiled as MSL 4.0 see __HAVE_TENSOR__ and the emulation in prelude/metal_tensor,
  // and supports_tensor_ops() is true.
  bool metal4 = false;
  // The Apple GPU family reported (7: M1 ... 10: M5, whose GPU accelerates tensor ops).
  int apple_gpu_family = 7;
  // recommendedMaxWorkingSetSize reported (0: no limit), so the backend's memory fit is
  // testable with small models.
  uint64_t working_set = 0;
  // Fault injection for tests of the host's error paths: the first fail_dispatch_count
  // dispatches of kernel `fail_dispatch` throw when encoded (as a pipeline limit or a bad shape
  // found while encoding would); a library whose file name contains `fail_library` does not
  // compile (as Apple's compiler rejecting it would).
  std::string fail_dispatch;
  int fail_dispatch_count = 1;
  std::string fail_library;
  // Buffers whose contents() is null, as on a device with memory of its own (msl_cuda): the
  // host must move bytes with Buffer::write / read / fill and Device::copy, so a GPU backend
  // that reads or writes contents() directly shows it here, without a GPU.
  bool opaque_buffers = false;
  uint64_t seed = 0;
  std::vector<std::string> include_dirs;  // searched by #include in kernel sources
};

std::shared_ptr<gpu::Device> make_device(const DeviceOptions& options);

}  // namespace lily::msl_cpu
