// The MoE family's grouped expert GEMMs on Metal 4 tensor ops: moe_gemm_{gate_up,down}_tensor_
// <S>_bm<BM>, the kernels of moe_gemm.h with the matmul2d inner product (gemm_tensor.h). Its
// own library, compiled as MSL 4.0 only on a GPU with Metal 4 tensors, and used by default only
// where the GPU accelerates them (GpuOptions::gemm). Unverified on Apple hardware.
#include <metal_stdlib>
#include "gemm_tensor.h"
#include "lily_msl.h"
#include "moe_gemm.h"
using namespace metal;

LILY_MOE_GEMM_INSTANTIATE(gate_up, "_tensor", true)
LILY_MOE_GEMM_INSTANTIATE(down, "_tensor", true)
