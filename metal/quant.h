// Dot products of one weight row with an f32 vector, with dequantization fused: the packed
// words are expanded in registers and never written anywhere. Shared by quant.metal (GEMV,
// embedding) and moe.metal (gather-GEMV), so every kernel reads MLX's affine format the same way.
//
// MLX affine packing: a row is a little-endian bit stream, element j at bits [j*b, (j+1)*b);
// for b in {2, 4, 8} a uint32 word holds 32/b whole elements, low bits first. Dequantized
// w = scale[g] * q + bias[g], so per word
//   sum_j w_j x_j = scale[g] * sum_j q_j x_j + bias[g] * sum_j x_j
// and both sums accumulate in f32. A word never straddles a group (group % (32/b) == 0).
//
// S = uchar selects MLX's microscaled modes (microscale.h; their scales are bytes, there are no
// biases): per word sum_j w_j x_j = scale[g] * sum_j code_j x_j. The rows_partial and
// dequantize_element specializations for uchar read them; the other S read affine or dense W.
//
// Work split: the lanes of a simdgroup (or of a team of 8 or 16 lanes in moe_down) take
// consecutive 16-byte loads of packed words (uint4; 32-bit words where the host cannot promise
// 16-byte aligned rows: QuantMatrix::vec; dense: consecutive elements), so each step of a
// simdgroup reads one contiguous 512-byte run of each row; a simdgroup serves up to
// LILY_GEMV_ROWS_PER_SIMDGROUP rows with each x value read once. The caller reduces the lane
// partials with simd_sum.
#pragma once
#include <metal_stdlib>
#include "lily_msl.h"  // LILY_UNROLL
#include "microscale.h"
#include "quant_args.h"
using namespace metal;

// How a row dot product reads the packed words of BITS-wide codes, per word of group g:
// sum_j w_j x_j = combine(sum_j code(q_j) x_j, sum_j x_j, g).
//   affine: scale[g] * sum_j q_j x_j + bias[g] * sum_j x_j
template <int BITS, typename S>
struct AffineWords {
  device const S* scales;  // this row's
  device const S* biases;
  AffineWords row(uint r, uint groups) const { return {scales + r * groups, biases + r * groups}; }
  static float code(uint q) { return float(q); }
  float combine(float qx, float sx, uint g) const { return float(scales[g]) * qx + float(biases[g]) * sx; }
};

//   microscaled: (scale[g] * mult) * sum_j code_j x_j (microscale.h; mult: the matrix's
//   microscale_mult)
template <int BITS>
struct MicroscaledWords {
  device const uchar* scales;  // this row's
  uint group;
  float mult;
  MicroscaledWords row(uint r, uint groups) const { return {scales + r * groups, group, mult}; }
  static float code(uint q) { return microscale_code<BITS>(q); }
  float combine(float qx, float, uint g) const { return microscale_scale(scales[g], group) * mult * qx; }
};

// The lane partials of up to LILY_GEMV_ROWS_PER_SIMDGROUP consecutive rows of one matrix
// against one x: v[r] for row row0 + r, r < rows (the caller reduces each with simd_sum).
struct RowParts {
  float v[LILY_GEMV_ROWS_PER_SIMDGROUP];
};

// VEC consecutive packed words of one row, read as one load: a uint4 (16 bytes; the caller
// guarantees 16-byte alignment: QuantMatrix::vec) or one 32-bit word.
template <int VEC>
struct PackedLoad;
template <>
struct PackedLoad<4> {
  static uint4 at(device const uint* w, ulong i) { return ((device const uint4*)w)[i]; }
};
template <>
struct PackedLoad<1> {
  static uint at(device const uint* w, ulong i) { return w[i]; }
};
inline uint word_of(uint4 v, int c) { return v[c]; }
inline uint word_of(uint v, int) { return v; }

// Packed rows (w at the first row's first word, `stride` words between rows) . x, this lane's
// part: the `lanes` lanes of a team (32: the whole simdgroup; fewer: moe_down's experts side
// by side) take loads of VEC words lane, lane + lanes, ... (VEC = 4: 16 bytes per lane per step,
// so a 32-lane step reads one contiguous 512-byte run of each row; VEC = 1: 128 bytes). The x
// values of each loaded word are read once into registers and used for every row the lane
// serves (re-read per row otherwise: 4x the x traffic). Each row's sum runs over the lane's
// words in increasing order, the same for one row alone or several, whatever T is.
template <int BITS, int VEC, typename Words>
inline RowParts packed_rows_partial(device const uint* w, uint stride, Words words, uint groups, uint rows,
                                    device const float* x, uint in, uint group, uint lane, uint lanes) {
  constexpr uint per_word = 32 / BITS;
  const uint n = in / (per_word * VEC);  // loads per row (VEC = 4: the host checked in * BITS % 128 == 0)
  RowParts p;
  LILY_UNROLL for (int r = 0; r < LILY_GEMV_ROWS_PER_SIMDGROUP; ++r) p.v[r] = 0.0f;
  for (uint i = lane; i < n; i += lanes) {
    using Load = decltype(PackedLoad<VEC>::at(w, 0));
    Load ws[LILY_GEMV_ROWS_PER_SIMDGROUP];  // every row's load first, then the words in order
    LILY_UNROLL for (int r = 0; r < LILY_GEMV_ROWS_PER_SIMDGROUP; ++r)
      ws[r] = uint(r) < rows ? PackedLoad<VEC>::at(w, ulong(r) * (stride / VEC) + i) : Load(0u);
    LILY_UNROLL for (int c = 0; c < VEC; ++c) {
      const uint k = i * VEC + uint(c);  // the word: it never straddles a group
      float xs[per_word], sx = 0.0f;
      LILY_UNROLL for (uint j = 0; j < per_word; ++j) {
        xs[j] = x[k * per_word + j];
        sx += xs[j];
      }
      const uint g = k * per_word / group;
      LILY_UNROLL for (int r = 0; r < LILY_GEMV_ROWS_PER_SIMDGROUP; ++r) {
        if (uint(r) < rows) {
          const uint word = word_of(ws[r], c);
          float qx = 0.0f;
          LILY_UNROLL for (uint j = 0; j < per_word; ++j) qx += Words::code((word >> (j * BITS)) & ((1u << BITS) - 1u)) * xs[j];
          p.v[r] += words.row(r, groups).combine(qx, sx, g);
        }
      }
    }
  }
  return p;
}

// packed_rows_partial with the load width the matrix allows (m.vec: uniform, a branch).
template <int BITS, typename Words>
inline RowParts packed_rows(constant QuantMatrix& m, device const uint* w, uint stride, Words words, uint groups,
                            uint rows, device const float* x, uint lane, uint lanes) {
  return m.vec ? packed_rows_partial<BITS, 4>(w, stride, words, groups, rows, x, m.in, m.group, lane, lanes)
               : packed_rows_partial<BITS, 1>(w, stride, words, groups, rows, x, m.in, m.group, lane, lanes);
}

template <typename S>
inline RowParts dense_rows_partial(device const S* w, uint rows, device const float* x, uint in, uint lane,
                                   uint lanes) {
  RowParts p;
  LILY_UNROLL for (int r = 0; r < LILY_GEMV_ROWS_PER_SIMDGROUP; ++r) p.v[r] = 0.0f;
  for (uint i = lane; i < in; i += lanes) {
    const float xv = x[i];
    LILY_UNROLL for (int r = 0; r < LILY_GEMV_ROWS_PER_SIMDGROUP; ++r)
      if (uint(r) < rows) p.v[r] += float(w[ulong(r) * in + i]) * xv;
  }
  return p;
}

// Rows [row0, row0 + rows) of matrix m (w, scales, biases at their matrix starts), rows <=
// LILY_GEMV_ROWS_PER_SIMDGROUP. The switch is uniform across the dispatch, so it costs a
// branch, not divergence.
template <typename S>
inline RowParts rows_partial(device const uchar* w, device const uchar* scales, device const uchar* biases,
                             constant QuantMatrix& m, uint row0, uint rows, device const float* x, uint lane,
                             uint lanes) {
  if (m.bits == 0) return dense_rows_partial((device const S*)w + ulong(row0) * m.in, rows, x, m.in, lane, lanes);
  const uint groups = m.in / m.group, stride = m.in * m.bits / 32;
  device const uint* wr = (device const uint*)w + ulong(row0) * stride;
  device const S* sr = (device const S*)scales + ulong(row0) * groups;
  device const S* br = (device const S*)biases + ulong(row0) * groups;
  switch (m.bits) {
    case 2: return packed_rows<2>(m, wr, stride, AffineWords<2, S>{sr, br}, groups, rows, x, lane, lanes);
    case 4: return packed_rows<4>(m, wr, stride, AffineWords<4, S>{sr, br}, groups, rows, x, lane, lanes);
    default: return packed_rows<8>(m, wr, stride, AffineWords<8, S>{sr, br}, groups, rows, x, lane, lanes);
  }
}

// Rows of a microscaled matrix (mxfp8: 8 bits; mxfp4, nvfp4: 4).
template <>
inline RowParts rows_partial<uchar>(device const uchar* w, device const uchar* scales, device const uchar* biases,
                                    constant QuantMatrix& m, uint row0, uint rows, device const float* x,
                                    uint lane, uint lanes) {
  const uint groups = m.in / m.group, stride = m.in * m.bits / 32;
  device const uint* wr = (device const uint*)w + ulong(row0) * stride;
  device const uchar* sr = scales + ulong(row0) * groups;
  const float mult = microscale_mult(biases);
  return m.bits == 8
             ? packed_rows<8>(m, wr, stride, MicroscaledWords<8>{sr, m.group, mult}, groups, rows, x, lane, lanes)
             : packed_rows<4>(m, wr, stride, MicroscaledWords<4>{sr, m.group, mult}, groups, rows, x, lane, lanes);
}

// Element j of row `row`, dequantized (embedding gather).
template <typename S>
inline float dequantize_element(device const uchar* w, device const uchar* scales,
                                device const uchar* biases, constant QuantMatrix& m, uint row, uint j) {
  if (m.bits == 0) return float(((device const S*)w)[ulong(row) * m.in + j]);
  const ulong bit = (ulong(row) * m.in + j) * m.bits;
  const uint word = ((device const uint*)w)[bit / 32];
  const uint q = (word >> uint(bit % 32)) & ((1u << m.bits) - 1u);
  const ulong g = ulong(row) * (m.in / m.group) + j / m.group;
  return float(((device const S*)scales)[g]) * float(q) + float(((device const S*)biases)[g]);
}

template <>
inline float dequantize_element<uchar>(device const uchar* w, device const uchar* scales,
                                       device const uchar* biases, constant QuantMatrix& m, uint row, uint j) {
  const ulong bit = (ulong(row) * m.in + j) * m.bits;
  const uint q = (((device const uint*)w)[bit / 32] >> uint(bit % 32)) & ((1u << m.bits) - 1u);
  const float s = microscale_scale(scales[ulong(row) * (m.in / m.group) + j / m.group], m.group) * microscale_mult(biases);
  return (m.bits == 8 ? microscale_code<8>(q) : microscale_code<4>(q)) * s;
}
