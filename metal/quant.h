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
// biases): per word sum_j w_j x_j = scale[g] * sum_j code_j x_j. The row_partial and
// dequantize_element specializations for uchar read them; the other S read affine or dense W.
//
// Work split: the 32 lanes of a simdgroup take consecutive words (dense: consecutive elements),
// so each step of a simdgroup reads one contiguous 128-byte run of the row. The caller reduces
// the lane partials with simd_sum.
#pragma once
#include <metal_stdlib>
#include "microscale.h"
#include "quant_args.h"
using namespace metal;

// How a row dot product reads one packed word of BITS-wide codes: partial(word, xs, g) is
// sum_j w_j xs[j] over the word's 32 / BITS elements, all of group g.
//   affine: scale[g] * sum_j q_j x_j + bias[g] * sum_j x_j
template <int BITS, typename S>
struct AffineWords {
  device const S* scales;  // this row's
  device const S* biases;
  float partial(uint word, device const float* xs, uint g) const {
    float qx = 0.0f, sx = 0.0f;
    for (uint j = 0; j < 32 / BITS; ++j) {
      const float xv = xs[j];
      qx += float((word >> (j * BITS)) & ((1u << BITS) - 1u)) * xv;
      sx += xv;
    }
    return float(scales[g]) * qx + float(biases[g]) * sx;
  }
};

//   microscaled: scale[g] * sum_j code_j x_j (microscale.h)
template <int BITS>
struct MicroscaledWords {
  device const uchar* scales;  // this row's
  uint group;
  float partial(uint word, device const float* xs, uint g) const {
    float qx = 0.0f;
    for (uint j = 0; j < 32 / BITS; ++j) qx += microscale_code<BITS>((word >> (j * BITS)) & ((1u << BITS) - 1u)) * xs[j];
    return microscale_scale(scales[g], group) * qx;
  }
};

// A packed row (w at its first word) . x, this lane's words.
template <int BITS, typename Words>
inline float packed_row_partial(device const uint* w, Words words, device const float* x, uint in, uint group,
                                uint lane) {
  constexpr uint per_word = 32 / BITS;
  const uint n = in / per_word;
  float part = 0.0f;
  for (uint i = lane; i < n; i += 32) part += words.partial(w[i], x + i * per_word, i * per_word / group);
  return part;
}

template <typename S>
inline float dense_row_partial(device const S* w, device const float* x, uint in, uint lane) {
  float part = 0.0f;
  for (uint i = lane; i < in; i += 32) part += float(w[i]) * x[i];
  return part;
}

// Row `row` of matrix m (w, scales, biases at their matrix starts). The switch is uniform
// across the dispatch, so it costs a branch, not divergence.
template <typename S>
inline float row_partial(device const uchar* w, device const uchar* scales,
                         device const uchar* biases, constant QuantMatrix& m, uint row,
                         device const float* x, uint lane) {
  if (m.bits == 0) {
    return dense_row_partial((device const S*)w + ulong(row) * m.in, x, m.in, lane);
  }
  const uint groups = m.in / m.group;
  device const uint* wr = (device const uint*)w + ulong(row) * (m.in * m.bits / 32);
  device const S* sr = (device const S*)scales + ulong(row) * groups;
  device const S* br = (device const S*)biases + ulong(row) * groups;
  switch (m.bits) {
    case 2: return packed_row_partial<2>(wr, AffineWords<2, S>{sr, br}, x, m.in, m.group, lane);
    case 4: return packed_row_partial<4>(wr, AffineWords<4, S>{sr, br}, x, m.in, m.group, lane);
    default: return packed_row_partial<8>(wr, AffineWords<8, S>{sr, br}, x, m.in, m.group, lane);
  }
}

// Row `row` of a microscaled matrix (mxfp8: 8 bits; mxfp4, nvfp4: 4).
template <>
inline float row_partial<uchar>(device const uchar* w, device const uchar* scales, device const uchar* biases,
                                constant QuantMatrix& m, uint row, device const float* x, uint lane) {
  device const uint* wr = (device const uint*)w + ulong(row) * (m.in * m.bits / 32);
  device const uchar* sr = scales + ulong(row) * (m.in / m.group);
  return m.bits == 8 ? packed_row_partial<8>(wr, MicroscaledWords<8>{sr, m.group}, x, m.in, m.group, lane)
                     : packed_row_partial<4>(wr, MicroscaledWords<4>{sr, m.group}, x, m.in, m.group, lane);
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
  const float s = microscale_scale(scales[ulong(row) * (m.in / m.group) + j / m.group], m.group);
  return (m.bits == 8 ? microscale_code<8>(q) : microscale_code<4>(q)) * s;
}
