// Arguments of the quant family (metal/quant.metal), shared by the host (csrc/gpu/) and the
// kernels: plain 32-bit fields only, so the layout is the same in C++ and MSL.
#pragma once

// A weight matrix W [out, in] as the kernels read it. bits == 0: dense, elements of the
// kernel's type; else MLX affine: [out, in*bits/32] uint32 words, scales and biases of the
// kernel's type [out, in/group]. The *_uchar kernels read MLX's microscaled modes
// (metal/microscale.h): the same words, byte scales [out, in/group], no biases (their buffer
// holds one float instead, the multiplier of every group scale: nvfp4's global scale); (bits,
// group) is the mode: (4, 32) mxfp4, (8, 32) mxfp8, (4, 16) nvfp4.
// vec: the GEMVs read packed rows 16 bytes (a uint4) per lane per step; the host sets it only
// where every row of the bound matrix (of every expert) starts 16-byte aligned: the row is a
// whole number of 16 bytes (in * bits % 128 == 0) and the matrix starts aligned
// (csrc/gpu/device_weights.cpp, vector_rows). 0: one 32-bit word per lane per step (any packed
// matrix: words are 4-byte aligned). Dense matrices and the GEMM tiles ignore it.
struct QuantMatrix {
  uint32_t in, out;
  uint32_t bits;
  uint32_t group;
  uint32_t vec;
};
static_assert(sizeof(QuantMatrix) == 20, "QuantMatrix: 5 fields of 4 bytes, as the kernels read them");

// y[t, 0..out) = x[t, 0..in) . W^T     (gemv_*; decode T = 1, prefill runs T rows of the grid)
struct GemvArgs {
  QuantMatrix w;
  uint32_t ldx;  // floats between rows of x
  uint32_t ldy;  // floats between rows of y
};
static_assert(sizeof(GemvArgs) == 28, "GemvArgs: a QuantMatrix and 2 fields of 4 bytes");

// x[t, :] = W[tokens[t], :]     (embed_*)
struct EmbedArgs {
  QuantMatrix w;
  uint32_t vocab;
};
static_assert(sizeof(EmbedArgs) == 24, "EmbedArgs: a QuantMatrix and 1 field of 4 bytes");

// Rows of a GEMV threadgroup: 2 simdgroups x 4 rows (a uniform tile the host sizes grids by).
#define LILY_GEMV_SIMDGROUPS 2
#define LILY_GEMV_ROWS_PER_SIMDGROUP 4

// Tiled GEMM with fused dequantization (metal/gemm.h): prefill's dense projections (gemm_*) and
// the grouped expert GEMMs (moe_gemm_*). A threadgroup of LILY_GEMM_THREADS threads (4
// simdgroups) computes a BM x LILY_GEMM_BN output tile, BM in {8, 32} (the host picks it by rows
// per tile), stepping K by LILY_GEMM_BK. Affine weights need in % LILY_GEMM_BK == 0 (every MLX
// group size is a multiple of 32); dense ones any in.
#define LILY_GEMM_BN 32
#define LILY_GEMM_BK 32
#define LILY_GEMM_THREADS 128

// y[t, 0..out) = x[t, 0..in) . W^T for t < rows     (gemm_<S>_bm<BM>)
struct GemmArgs {
  QuantMatrix w;
  uint32_t rows;  // T
  uint32_t ldx;   // floats between rows of x
  uint32_t ldy;   // floats between rows of y
};
static_assert(sizeof(GemmArgs) == 32, "GemmArgs: a QuantMatrix and 3 fields of 4 bytes");
