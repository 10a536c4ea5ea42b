#include "cpu/linear.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/simd.h"

namespace lily::cpu {

namespace {

// MLX affine packing: the row is a little-endian bit stream, element j at bits
// [j*bits, (j+1)*bits). For 2/4/8 bits that is "low bits first within each uint32"; for 3/5/6
// the elements straddle bytes, so they are read through a 64-bit window.
template <int BITS>
void unpack_row(const uint8_t* p, int n, float* q) {
  constexpr uint32_t mask = (1u << BITS) - 1;
  if constexpr (BITS == 4) {
    for (int j = 0; j < n; j += 2) {
      const uint8_t b = p[j / 2];
      q[j] = float(b & 0xF);
      q[j + 1] = float(b >> 4);
    }
  } else if constexpr (BITS == 8) {
    for (int j = 0; j < n; ++j) q[j] = float(p[j]);
  } else if constexpr (BITS == 2) {
    for (int j = 0; j < n; j += 4) {
      const uint8_t b = p[j / 4];
      q[j] = float(b & 3);
      q[j + 1] = float((b >> 2) & 3);
      q[j + 2] = float((b >> 4) & 3);
      q[j + 3] = float(b >> 6);
    }
  } else {
    for (int j = 0; j < n; ++j) {
      const size_t bit = size_t(j) * BITS;
      uint32_t window = 0;
      // At most 2 bytes are needed for <= 6 bits at any bit offset; never read past the row.
      const size_t byte = bit / 8;
      const size_t row_bytes = size_t(n) * BITS / 8;
      window = p[byte];
      if (byte + 1 < row_bytes) window |= uint32_t(p[byte + 1]) << 8;
      q[j] = float((window >> (bit % 8)) & mask);
    }
  }
}

void unpack(int bits, const uint8_t* p, int n, float* q) {
  switch (bits) {
    case 2: unpack_row<2>(p, n, q); break;
    case 3: unpack_row<3>(p, n, q); break;
    case 4: unpack_row<4>(p, n, q); break;
    case 5: unpack_row<5>(p, n, q); break;
    case 6: unpack_row<6>(p, n, q); break;
    default: unpack_row<8>(p, n, q); break;
  }
}

void convert_row(const uint8_t* p, DType t, int n, float* out) {
  switch (t) {
    case DType::F32: std::memcpy(out, p, size_t(n) * 4); break;
    case DType::BF16:
      for (int j = 0; j < n; ++j) {
        uint16_t v;
        std::memcpy(&v, p + 2 * j, 2);
        out[j] = bf16_to_f32(v);
      }
      break;
    default:
      for (int j = 0; j < n; ++j) {
        uint16_t v;
        std::memcpy(&v, p + 2 * j, 2);
        out[j] = f16_to_f32(v);
      }
      break;
  }
}

// Rows of W expanded per block: 8 rows keep the scratch (8 x in floats) inside L2 for the
// model's widest input (in = 4096 -> 128 KiB), and amortise the expansion over all T tokens.
constexpr int kRowBlock = 8;

}  // namespace

void dequantize_row(const Linear& W, int row, float* out) {
  const uint8_t* wrow = W.w + size_t(row) * W.row_bytes();
  if (!W.quantized()) {
    convert_row(wrow, W.dtype, W.in, out);
    return;
  }
  unpack(W.bits, wrow, W.in, out);
  const int groups = W.in / W.group;
  const size_t esz = dtype_size(W.dtype);
  const uint8_t* srow = W.scales + size_t(row) * groups * esz;
  const uint8_t* brow = W.biases + size_t(row) * groups * esz;
  for (int g = 0; g < groups; ++g) {
    const float s = load_as_f32(srow, W.dtype, g);
    const float b = load_as_f32(brow, W.dtype, g);
    float* o = out + size_t(g) * W.group;
    // A rounded multiply, then a rounded add: the core is built with -ffp-contract=off, so
    // this is never fused into an FMA and matches mlx.core.dequantize bit for bit.
    for (int j = 0; j < W.group; ++j) o[j] = s * o[j] + b;
  }
}

void linear(const Linear& W, const float* x, int T, float* y, ThreadPool& pool) {
  const int out = W.out, in = W.in;
  const bool direct = W.format == Linear::Format::Dense && W.dtype == DType::F32;
  pool.parallel_for(
      out,
      [&](int64_t r0, int64_t r1, int) {
        thread_local std::vector<float> scratch;
        if (!direct && scratch.size() < size_t(kRowBlock) * in) scratch.resize(size_t(kRowBlock) * in);
        for (int64_t rb = r0; rb < r1; rb += kRowBlock) {
          const int nr = int(std::min<int64_t>(kRowBlock, r1 - rb));
          const float* rows[kRowBlock];
          for (int i = 0; i < nr; ++i) {
            if (direct) {
              rows[i] = reinterpret_cast<const float*>(W.w) + size_t(rb + i) * in;
            } else {
              dequantize_row(W, int(rb + i), scratch.data() + size_t(i) * in);
              rows[i] = scratch.data() + size_t(i) * in;
            }
          }
          for (int t = 0; t < T; ++t) {
            const float* xt = x + size_t(t) * in;
            float* yt = y + size_t(t) * out + rb;
            for (int i = 0; i < nr; ++i) yt[i] = dot(rows[i], xt, in);
          }
        }
      },
      kRowBlock);
}

void embedding(const Linear& W, const int32_t* tokens, int T, float* x, ThreadPool& pool) {
  pool.parallel_for(T, [&](int64_t t0, int64_t t1, int) {
    for (int64_t t = t0; t < t1; ++t) dequantize_row(W, tokens[t], x + size_t(t) * W.in);
  });
}

}  // namespace lily::cpu
