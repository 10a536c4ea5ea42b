// Norm family encoding (metal/norm.metal): the residual add fused with the RMSNorm after it.
// Shapes: x, y, h [T, n]; w [n] (the full gain, 1 + w folded at load).
#include "gpu/encode.h"

namespace lily::gpu {

void encode_add_rms_norm(EncoderContext& ctx, const NormArgs& args, int T, const BufferRange& y,
                         const std::shared_ptr<Buffer>& w, const BufferRange& x, const BufferRange& h) {
  const size_t n = size_t(T) * args.n * 4;
  Dispatch d(ctx, "norm.metal", "add_rms_norm");
  d.args(args);
  if (args.add) d.read("y", y, n);
  else d.unused("y");
  d.weight("w", BufferRange{w, 0});
  // x is the kernel's in-place stream: written only when the residual is added.
  d.bind("x", x).declare_read(x.buf, n, x.off);
  if (args.add) d.declare_write(x.buf, n, x.off);
  d.write("h", h, n);
  d.run({uint32_t(T), 1, 1}, {256, 1, 1});
}

}  // namespace lily::gpu
