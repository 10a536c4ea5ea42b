// Quant family encoding (metal/quant.metal, metal/quant_tensor.metal): the embedding gather and
// a Linear's projection as a GEMV (decode, short chunks) or a tiled GEMM with the weights
// dequantized into the tiles (prefill chunks; simdgroup_matrix, or Metal 4 matmul2d).
//
// Shapes: x [T, ldx], y [T, ldy] (row views of wider activations), W [out, in] (MLX affine:
// [out, in*bits/32] uint32 words + scales / biases [out, in/group]; MLX mxfp4 / mxfp8 / nvfp4:
// the same words + byte scales [out, in/group], run by the *_uchar kernels; dense: [out, in]).
#include <algorithm>
#include <string>

#include "gpu/encode.h"
#include "model/error.h"

namespace lily::gpu {

namespace {
constexpr uint32_t kGemvRows = LILY_GEMV_SIMDGROUPS * LILY_GEMV_ROWS_PER_SIMDGROUP;
constexpr uint32_t kGemvThreads = 32 * LILY_GEMV_SIMDGROUPS;

// W's three buffers, in every quant kernel's order (w, scales, biases), its bytes counted.
Dispatch& matrix(Dispatch& d, const LinearBuffers& W) {
  return d.weight("w", W.w).weight("scales", W.scales).weight("biases", W.biases);
}
}  // namespace

const char* scalar_name(DType t) {
  switch (t) {
    case DType::F32: return "float";
    case DType::F16: return "half";
    case DType::BF16: return "bfloat";
    case DType::U8: return "uchar";  // a microscaled matrix's byte scales (metal/microscale.h)
    default: throw ConfigError("[gpu] weights of dtype " + std::string(dtype_name(t)) + " are not supported");
  }
}

void check_instantiated(int value, const std::vector<int>& sizes, const std::string& what, const char* where) {
  std::string list;
  for (int d : sizes) {
    if (d == value) return;
    list += (list.empty() ? "" : ", ") + std::to_string(d);
  }
  throw ConfigError("[gpu] " + what + ": the kernels are instantiated for " + list + " (" + where + ")");
}

bool tiles_fit(const QuantMatrix& m) { return m.bits == 0 || m.in % LILY_GEMM_BK == 0; }

bool vector_rows(const QuantMatrix& m, const std::vector<uint64_t>& starts) {
  if (m.bits == 0 || uint64_t(m.in) * m.bits % 128 != 0) return false;
  return std::all_of(starts.begin(), starts.end(), [](uint64_t a) { return a % 16 == 0; });
}

uint64_t device_address(const BufferRange& r) {
  return uint64_t(reinterpret_cast<uintptr_t>(r.buf->contents())) + r.off;
}

int gemm_block_rows(uint64_t rows) { return rows >= 32 ? 32 : 8; }

std::string gemm_kernel(const char* family, bool tensor, DType t, int bm) {
  return std::string(family) + (tensor ? "_tensor_" : "_") + scalar_name(t) + "_bm" + std::to_string(bm);
}

std::string gemm_library(const char* base, bool tensor) {
  return std::string(base) + (tensor ? "_tensor.metal" : ".metal");
}

void encode_embed(EncoderContext& ctx, const LinearBuffers& E, uint32_t vocab, const BufferRange& tokens,
                  const BufferRange& x, int T) {
  EmbedArgs args{};
  args.w = E.m;
  args.vocab = vocab;
  const size_t H = E.m.in, f = 4 * size_t(T);
  Dispatch d(ctx, "quant.metal", std::string("embed_") + scalar_name(E.dtype));
  d.args(args);
  matrix(d, E)
      .read("tokens", tokens, f)
      .write("x", x, f * H)
      .weight_bytes(uint64_t(T) * E.nbytes / std::max<uint32_t>(E.m.out, 1));  // T rows of the table
  d.run({div_up(H, 256), uint32_t(T), 1}, {256, 1, 1});
}

void encode_gemv(EncoderContext& ctx, const LinearBuffers& W, const BufferRange& x, int ldx, const BufferRange& y,
                 int ldy, int T) {
  GemvArgs args{};
  args.w = W.m;
  args.ldx = uint32_t(ldx);
  args.ldy = uint32_t(ldy);
  Dispatch d(ctx, "quant.metal", std::string("gemv_") + scalar_name(W.dtype));
  d.args(args);
  matrix(d, W)
      .read("x", x, size_t(T) * ldx * 4)
      .write("y", y, (size_t(T - 1) * ldy + W.m.out) * 4)
      .weight_bytes(W.nbytes);
  d.run({div_up(W.m.out, kGemvRows), uint32_t(T), 1}, {kGemvThreads, 1, 1});
}

void encode_gemm(EncoderContext& ctx, const LinearBuffers& W, const BufferRange& x, int ldx, const BufferRange& y,
                 int ldy, int T, bool tensor) {
  GemmArgs args{};
  args.w = W.m;
  args.rows = uint32_t(T);
  args.ldx = uint32_t(ldx);
  args.ldy = uint32_t(ldy);
  const int bm = gemm_block_rows(uint64_t(T));
  Dispatch d(ctx, gemm_library("quant", tensor), gemm_kernel("gemm", tensor, W.dtype, bm));
  d.args(args);
  matrix(d, W)
      .read("x", x, size_t(T) * ldx * 4)
      .write("y", y, (size_t(T - 1) * ldy + W.m.out) * 4)
      .weight_bytes(W.nbytes);
  d.run({div_up(W.m.out, LILY_GEMM_BN), div_up(T, bm), 1}, {LILY_GEMM_THREADS, 1, 1});
}

}  // namespace lily::gpu
