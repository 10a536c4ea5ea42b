// Driver of tests/test_cpu_elementwise.py: cpu::map_elementwise with the maps the engine runs
// through it (silu, sigmoid, SwiGLU), built once per instruction set.
//   elementwise_driver INPUT OUTPUT
// INPUT: n, then x[n] and u[n] (float32). OUTPUT: silu(x)[n], sigmoid(x)[n], silu(x) * u[n]
// (float32), each from one call over the whole array. The driver also runs every map over
// sub-ranges of every length 1..40 at offsets 0..3 and exits with status 2 if any value differs,
// in any bit, from the whole-array call's: a value's result must not depend on where it sits.
// It also runs scale_max (attention's softmax scaling and running maximum) over every sub-range
// of x of length 0..40 at offsets 0..3, with the scales 0.0625 and -3 and the starting maxima
// -inf, 0.5 and NaN, against the scalar loop it replaces; the products must match bit for bit and
// the maxima compare equal (or both be NaN), else status 2.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cpu/simd.h"

using namespace lily::cpu;

int main(int argc, char** argv) {
  if (argc != 3) return 1;
  FILE* f = std::fopen(argv[1], "rb");
  uint32_t n = 0;
  if (!f || std::fread(&n, 4, 1, f) != 1) return 1;
  std::vector<float> x(n), u(n);
  if (std::fread(x.data(), 4, n, f) != n || std::fread(u.data(), 4, n, f) != n) return 1;
  std::fclose(f);

  auto silu_map = [](float* out, size_t m, const float* a, const float*) {
    map_elementwise(out, m, [](auto v) { return silu(v); }, a);
  };
  auto sigmoid_map = [](float* out, size_t m, const float* a, const float*) {
    map_elementwise(out, m, [](auto v) { return sigmoid(v); }, a);
  };
  auto swiglu_map = [](float* out, size_t m, const float* a, const float* b) {
    map_elementwise(out, m, [](auto g, auto up) { return silu(g) * up; }, a, b);
  };
  std::vector<float> whole[3];
  int status = 0;
  int which = 0;
  for (auto map : {+silu_map, +sigmoid_map, +swiglu_map}) {
    std::vector<float>& w = whole[which++];
    w.assign(n, 0.0f);
    map(w.data(), n, x.data(), u.data());
    for (uint32_t off = 0; off < 4; ++off)
      for (uint32_t len = 1; len <= 40 && off + len <= n; ++len) {
        std::vector<float> part(len + 1, -7.0f);  // one guard value past the end
        map(part.data(), len, x.data() + off, u.data() + off);
        if (std::memcmp(part.data(), w.data() + off, len * 4) != 0 || part[len] != -7.0f) {
          std::fprintf(stderr, "map %d: offset %u length %u differs from the whole-array call\n", which, off, len);
          status = 2;
        }
      }
  }
  // In place (out is the first input), as the engine calls it.
  std::vector<float> inplace = x;
  silu_map(inplace.data(), n, inplace.data(), nullptr);
  if (std::memcmp(inplace.data(), whole[0].data(), n * 4) != 0) {
    std::fprintf(stderr, "silu in place differs\n");
    status = 2;
  }
  for (float scale : {0.0625f, -3.0f})
    for (float init : {-INFINITY, 0.5f, NAN})
      for (uint32_t off = 0; off < 4; ++off)
        for (uint32_t len = 0; len <= 40 && off + len <= n; ++len) {
          std::vector<float> got(x.begin() + off, x.begin() + off + len), want = got;
          const float m = scale_max(got.data(), int(len), scale, init);
          float ref = init;
          for (float& v : want) ref = std::max(ref, v *= scale);
          if (std::memcmp(got.data(), want.data(), len * 4) != 0 || !(m == ref || (std::isnan(m) && std::isnan(ref)))) {
            std::fprintf(stderr, "scale_max: offset %u length %u scale %g init %g: %g, the loop %g\n", off, len,
                         double(scale), double(init), double(m), double(ref));
            status = 2;
          }
        }
  FILE* o = std::fopen(argv[2], "wb");
  if (!o) return 1;
  for (const auto& w : whole) std::fwrite(w.data(), 4, n, o);
  std::fclose(o);
  return status;
}
