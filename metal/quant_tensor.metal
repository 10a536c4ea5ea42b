// The quant family's prefill GEMM on Metal 4 tensor ops: gemm_tensor_<S>_bm<BM>, the kernel of
// quant_gemm.h with the matmul2d inner product (gemm_tensor.h). Its own library, compiled as
// MSL 4.0 only on a GPU with Metal 4 tensors, and used by default only where the GPU
// accelerates them (GpuOptions::gemm); every other kernel builds without it. Unverified on
// Apple hardware.
#include <metal_stdlib>
#include "gemm_tensor.h"
#include "lily_msl.h"
#include "quant_gemm.h"
using namespace metal;

LILY_GEMM_INSTANTIATE("_tensor", true)
