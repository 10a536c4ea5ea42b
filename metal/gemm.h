// Tiled GEMM with dequantization fused into the tile loads, on simdgroup_matrix<float, 8, 8>.
// Shared by quant.metal (gemm_*: prefill's dense projections) and moe.metal (moe_gemm_*: the
// grouped expert GEMMs over a block map), so both read MLX's affine format the same way.
//
// Design choices:
// - Output tile BM x BN (BN = 32, BM = 8 or 32), one threadgroup of 4 simdgroups. BM = 32 lays
//   the simdgroups out 2 x 2, each owning a 16 x 16 sub-tile (2 x 2 fragments); BM = 8 (few
//   rows per expert, or a short chunk) lays them out 1 x 4, each owning one 8 x 8 fragment, so a
//   block with a handful of rows does not pay for 32.
// - K advances by BK = 32. Per step the threadgroup stages an X tile [BM, BK] (rows gathered
//   through a per-tile row table: the token rows of a routed block) and each weight tile
//   (BN rows of W, BK deep) *dequantized to f32 in threadgroup memory*: packed words are expanded in
//   registers by the thread that loads them and never written to device memory. BK = 32
//   divides every MLX affine group size (32, 64, 128), so a tile row of an affine matrix needs
//   one scale and one bias (nvfp4's groups of 16 take two scales a tile row).
// - Accumulation is f32 in the simdgroup matrices; the epilogue stores the accumulators into
//   the (no longer needed) staging tiles so each output element is written once, by one thread,
//   with bounds checks (no reliance on the unverified per-lane layout of thread_elements()).
// - The X tile is [BM, BK] (rows m, columns k) and the weight tile is written *transposed* while
//   it is dequantized, [BK, BN] (rows k, columns n): both are then the row-major operands
//   A [m, k] and B [k, n] of the multiply, so simdgroup_load never transposes (ggml-metal's
//   mul_mm dequantizes into the layout its multiply reads the same way).
// - Tile rows are padded to LD = BK + 4 (X) and LDW = BN + 4 (W) floats against threadgroup
//   bank conflicts.
// - The inner product over a staged pair of tiles is a policy, GemmMma<BM, TENSOR>:
//   TENSOR = false (here): simdgroup_matrix<float, 8, 8>, accumulators in registers (every
//     Apple GPU, M1 on);
//   TENSOR = true (gemm_tensor.h, only in the *_tensor.metal libraries, compiled as MSL 4.0 on
//     GPUs with Metal 4 tensors): MetalPerformancePrimitives' matmul2d.
//   Both keep the same staging, barriers and epilogue, so the dequantization is shared.
//
// Shapes: X [rows, K] f32, W [N, K] (affine: [N, K*bits/32] uint32 + scales/biases [N, K/group]
// of type S; microscaled, S = uchar: the same words + byte scales [N, K/group]; dense: [N, K] of
// type S), acc = X . W^T [rows, N].
#pragma once
#include <metal_stdlib>
#include "lily_msl.h"
#include "microscale.h"
#include "quant_args.h"
using namespace metal;

#define LILY_GEMM_LD (LILY_GEMM_BK + 4)   // floats per row of the X tile [BM, BK] (and results)
#define LILY_GEMM_LDW (LILY_GEMM_BN + 4)  // floats per row of the weight tile [BK, BN]
#define LILY_GEMM_NO_ROW 0xFFFFFFFFu

// The simdgroup layout of a BM-row tile. (An enum, not static constexpr members: MSL would
// want those in the constant address space, which C++ does not have.)
template <int BM>
struct GemmTile {
  enum {
    SN = BM == 32 ? 2 : 4,          // simdgroups across the columns
    SM = 4 / SN,                    // simdgroups across the rows
    FM = BM / (8 * SM),             // 8x8 fragments per simdgroup, rows
    FN = LILY_GEMM_BN / (8 * SN),   // and columns
  };
};

// X tile [BM, BK] from k0: row r of the tile is x + src_row[r] * ldx (LILY_GEMM_NO_ROW: zeros).
template <int BM>
inline void gemm_load_x(threadgroup float* xs, device const float* x, uint ldx,
                        threadgroup const uint* src_row, uint k0, uint K, uint tid) {
  for (uint i = tid; i < uint(BM * LILY_GEMM_BK); i += LILY_GEMM_THREADS) {
    const uint r = i / LILY_GEMM_BK, c = i % LILY_GEMM_BK;
    const uint row = src_row[r];
    const bool ok = row != LILY_GEMM_NO_ROW && k0 + c < K;
    xs[r * LILY_GEMM_LD + c] = ok ? x[ulong(row) * ldx + k0 + c] : 0.0f;
  }
}

// How a packed tile loader turns codes into floats. at(row, kt) reads the group of the tile's
// element kt (0 <= kt < BK) of a row; value(q) is code q dequantized with it. g0 is the group of
// the tile's first element (k0 / group).
//   affine: scale * q + bias (S scales and biases); BK divides the group size, so the whole
//   tile row is group g0
template <typename S>
struct AffineCodes {
  device const S* scales;
  device const S* biases;
  uint groups, g0;  // groups per row; the tile's
  float s, b;
  void at(uint row, uint kt) {
    const ulong i = ulong(row) * groups + g0;
    s = float(scales[i]);
    b = float(biases[i]);
  }
  float value(uint q) const { return s * float(q) + b; }
};

//   microscaled (microscale.h): code value * byte scale; GROUP (16 or 32) a template parameter,
//   so the group within the tile is a shift
template <int BITS, int GROUP>
struct MicroscaledCodes {
  device const uchar* scales;
  uint groups, g0;
  float mult;  // the matrix's microscale_mult
  float s;
  void at(uint row, uint kt) { s = microscale_scale(scales[ulong(row) * groups + g0 + kt / GROUP], GROUP) * mult; }
  float value(uint q) const { return microscale_code<BITS>(q) * s; }
};

// Weight tile [BK, BN] (transposed: tile[k][n] = W[n0 + n][k0 + k]) of a packed matrix,
// dequantized to f32 by `codes`. A word never straddles a group (every group size is a multiple
// of the codes per word), so each thread reads one group per word.
template <int BITS, typename Codes>
inline void gemm_load_w_packed(threadgroup float* ws, device const uint* w, Codes codes, uint n0, uint N,
                               uint K, uint k0, uint tid) {
  constexpr uint per_word = 32 / BITS;
  constexpr uint mask = (1u << BITS) - 1u;
  constexpr uint words = LILY_GEMM_BK / per_word;  // per tile row
  const uint row_words = K / per_word;
  for (uint i = tid; i < LILY_GEMM_BN * words; i += LILY_GEMM_THREADS) {
    const uint n = i / words, wi = i % words, row = n0 + n;
    threadgroup float* dst = ws + wi * per_word * LILY_GEMM_LDW + n;  // column n, rows k..k + per_word
    if (row >= N) {
      for (uint j = 0; j < per_word; ++j) dst[j * LILY_GEMM_LDW] = 0.0f;
      continue;
    }
    const uint word = w[ulong(row) * row_words + k0 / per_word + wi];
    codes.at(row, wi * per_word);
    for (uint j = 0; j < per_word; ++j) dst[j * LILY_GEMM_LDW] = codes.value((word >> (j * BITS)) & mask);
  }
}

// Weight tile of rows n0.. from k0, dequantized to f32 and stored [BK, BN] (zeros past N or K).
template <typename S>
inline void gemm_load_w(threadgroup float* ws, device const uchar* w, device const uchar* scales,
                        device const uchar* biases, constant QuantMatrix& m, uint n0, uint k0,
                        uint tid) {
  device const uint* wp = (device const uint*)w;
  if (m.bits != 0) {
    const AffineCodes<S> codes = {(device const S*)scales, (device const S*)biases, m.in / m.group, k0 / m.group,
                                  0.0f, 0.0f};
    switch (m.bits) {
      case 2: gemm_load_w_packed<2>(ws, wp, codes, n0, m.out, m.in, k0, tid); return;
      case 4: gemm_load_w_packed<4>(ws, wp, codes, n0, m.out, m.in, k0, tid); return;
      default: gemm_load_w_packed<8>(ws, wp, codes, n0, m.out, m.in, k0, tid); return;
    }
  }
  device const S* wd = (device const S*)w;
  for (uint i = tid; i < uint(LILY_GEMM_BN * LILY_GEMM_BK); i += LILY_GEMM_THREADS) {
    const uint n = i / LILY_GEMM_BK, c = i % LILY_GEMM_BK, row = n0 + n;
    const bool ok = row < m.out && k0 + c < m.in;
    ws[c * LILY_GEMM_LDW + n] = ok ? float(wd[ulong(row) * m.in + k0 + c]) : 0.0f;
  }
}

// S = uchar: a microscaled matrix, the mode from (bits, group): mxfp8 (8, 32), nvfp4 (4, 16),
// mxfp4 (4, 32).
template <>
inline void gemm_load_w<uchar>(threadgroup float* ws, device const uchar* w, device const uchar* scales,
                               device const uchar* biases, constant QuantMatrix& m, uint n0, uint k0,
                               uint tid) {
  device const uint* wp = (device const uint*)w;
  const uint groups = m.in / m.group, g0 = k0 / m.group;
  const float mult = microscale_mult(biases);
  if (m.bits == 8)
    gemm_load_w_packed<8>(ws, wp, MicroscaledCodes<8, 32>{scales, groups, g0, mult, 0.0f}, n0, m.out, m.in, k0, tid);
  else if (m.group == 16)
    gemm_load_w_packed<4>(ws, wp, MicroscaledCodes<4, 16>{scales, groups, g0, mult, 0.0f}, n0, m.out, m.in, k0, tid);
  else
    gemm_load_w_packed<4>(ws, wp, MicroscaledCodes<4, 32>{scales, groups, g0, mult, 0.0f}, n0, m.out, m.in, k0, tid);
}

// acc += xs . ws over one BK step (xs [BM, BK], ws [BK, BN]), for this simdgroup's fragments.
template <int BM>
inline void gemm_mma(thread simdgroup_float8x8 (&acc)[GemmTile<BM>::FM][GemmTile<BM>::FN],
                     threadgroup const float* xs, threadgroup const float* ws, uint simd_id) {
  typedef GemmTile<BM> L;
  const uint m0 = (simd_id / L::SN) * L::FM * 8, n0 = (simd_id % L::SN) * L::FN * 8;
  LILY_UNROLL for (int kk = 0; kk < LILY_GEMM_BK; kk += 8) {
    simdgroup_float8x8 a[L::FM], b[L::FN];
    LILY_UNROLL for (int i = 0; i < L::FM; ++i) simdgroup_load(a[i], xs, LILY_GEMM_LD, ulong2(kk, m0 + 8 * i));
    LILY_UNROLL for (int j = 0; j < L::FN; ++j) simdgroup_load(b[j], ws, LILY_GEMM_LDW, ulong2(n0 + 8 * j, kk));
    LILY_UNROLL for (int i = 0; i < L::FM; ++i)
      LILY_UNROLL for (int j = 0; j < L::FN; ++j) simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
  }
}

// The accumulators into a [BM, LD] threadgroup tile (the caller barriers before reading it).
template <int BM>
inline void gemm_store_acc(threadgroup float* cs,
                           thread const simdgroup_float8x8 (&acc)[GemmTile<BM>::FM][GemmTile<BM>::FN],
                           uint simd_id) {
  typedef GemmTile<BM> L;
  const uint m0 = (simd_id / L::SN) * L::FM * 8, n0 = (simd_id % L::SN) * L::FN * 8;
  LILY_UNROLL for (int i = 0; i < L::FM; ++i)
    LILY_UNROLL for (int j = 0; j < L::FN; ++j) simdgroup_store(acc[i][j], cs, LILY_GEMM_LD, ulong2(n0 + 8 * j, m0 + 8 * i));
}

template <int BM>
inline void gemm_zero(thread simdgroup_float8x8 (&acc)[GemmTile<BM>::FM][GemmTile<BM>::FN]) {
  LILY_UNROLL for (int i = 0; i < GemmTile<BM>::FM; ++i)
    LILY_UNROLL for (int j = 0; j < GemmTile<BM>::FN; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}

// The inner-product policy of a BM-row tile. Each kernel declares a threadgroup accumulator of
// ACC floats per output tile (unused by the simdgroup path; 1 keeps the array legal), then:
//   begin(cacc, tid, simd_id)         zero the accumulator (before the first staging barrier)
//   step(cacc, xs, ws, simd_id)       acc += xs . ws over one staged BK step (ws is [BK, BN])
//   finish(cacc, spare, simd_id)      the result tile [BM, LD] (simdgroup: stored into `spare`,
//                                     a staging tile no longer read); the caller barriers
// The TENSOR = true specialization is in gemm_tensor.h.
template <int BM, bool TENSOR>
struct GemmMma;

template <int BM>
struct GemmMma<BM, false> {
  enum { ACC = 1 };
  simdgroup_float8x8 acc[GemmTile<BM>::FM][GemmTile<BM>::FN];
  void begin(threadgroup float* cacc, uint tid, uint simd_id) { gemm_zero<BM>(acc); }
  void step(threadgroup float* cacc, threadgroup float* xs, threadgroup float* ws, uint simd_id) {
    gemm_mma<BM>(acc, xs, ws, simd_id);
  }
  threadgroup float* finish(threadgroup float* cacc, threadgroup float* spare, uint simd_id) {
    gemm_store_acc<BM>(spare, acc, simd_id);
    return spare;
  }
};
