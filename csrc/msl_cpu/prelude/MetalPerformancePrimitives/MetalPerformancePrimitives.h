// The MSL-on-CPU stand-in for <MetalPerformancePrimitives/MetalPerformancePrimitives.h>:
// mpp::tensor_ops::matmul2d over tensor views (<metal_tensor>), nothing else of MPP.
//
// Semantics, from Apple's header MPPTensorOpsMatMul2d.h (macOS 26.1 SDK) — no Apple compiler or
// GPU has checked this emulation:
//  - matmul2d_descriptor(m, n, k = dynamic_extent, transpose_left = false,
//    transpose_right = false, relaxed_precision = false, mode = mode::multiply);
//    mode::multiply: C = A.B, mode::multiply_accumulate: C += A.B.
//  - Operands: A is M x K (transpose_left: stored K x M), B is K x N (transpose_right: stored
//    N x K), C is M x N; extents innermost first, so K = A.extent(0) for NN and NT,
//    K = B.extent(1) for NN and B.extent(0) for NT (as the header spells out).
//  - k = dynamic_extent: K is read from the operands; else the op multiplies k columns of A
//    by k rows of B (the caller loops over K).
//  - The op is edge-checked against the operands' extents: C elements past C's extents are
//    not written; A / B elements past theirs contribute nothing.
//  - matmul2d<desc, execution_simdgroups<N>> is run cooperatively by N simdgroups: every
//    thread of the scope must call run(); a mismatch between N and the simdgroups dispatched
//    is undefined behavior on the GPU and an error here.
//  - Supported element types: the table in Apple's header, restricted to its floating-point
//    rows (half, bfloat, float); relaxed_precision is accepted and ignored (the sum is f32).
//
// How it runs here: each calling thread computes its own share of C (element i of the M x N
// tile belongs to thread i mod threads-in-scope), reading A, B (and C when accumulating)
// straight from their memory, with f32 accumulation in k order, without waiting for anyone.
// So the op is not a barrier: as on the GPU, the kernel must put a threadgroup_barrier between
// writing A / B and run(), and between run() and reading C written by other threads, and a
// missing one shows (the runtime switches threads only at barriers and collectives, so a thread
// computing its share right after its own staging writes reads the others' unwritten, NaN-filled
// operands). For the same reason run() is not a collective here: a lane that skips it leaves
// its share of C unwritten (wrong numbers, not a named error).
//
// Not emulated (a kernel using them fails to compile): cooperative tensors
// (get_destination_cooperative_tensor, ...), reduce_rows / reduce_columns, convolution2d,
// integer operands.
#pragma once
#include <metal_tensor>

namespace mpp {
namespace tensor_ops {

struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right;
  bool relaxed_precision;
  mode matmul_mode;
  constexpr matmul2d_descriptor(int m_, int n_, int k_ = static_cast<int>(metal::dynamic_extent),
                                bool transpose_left_ = false, bool transpose_right_ = false,
                                bool relaxed_precision_ = false, mode mode_ = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_), matmul_mode(mode_) {}
};

namespace lily_detail {

// T without its address space (tensor element types are spelled `device float`, ...).
template <class T>
struct strip_as {
  using type = std::remove_cv_t<T>;
};
#if !defined(LILY_MSL_CPU_FLAT_ADDRESS_SPACES)
template <class T>
struct strip_as<device T> {
  using type = std::remove_cv_t<T>;
};
template <class T>
struct strip_as<threadgroup T> {
  using type = std::remove_cv_t<T>;
};
#endif
template <class T>
using value_t = typename strip_as<T>::type;

enum class fp { half_, bfloat_, float_, other };
template <class T>
constexpr fp kind() {
  using U = value_t<T>;
  if constexpr (std::is_same_v<U, half>) return fp::half_;
  else if constexpr (std::is_same_v<U, bfloat>) return fp::bfloat_;
  else if constexpr (std::is_same_v<U, float>) return fp::float_;
  else return fp::other;
}

// The floating-point rows of the type table in Apple's MPPTensorOpsMatMul2d.h (A, B, C).
constexpr bool supported(fp a, fp b, fp c) {
  constexpr fp H = fp::half_, B = fp::bfloat_, F = fp::float_;
  constexpr fp table[][3] = {{H, H, H}, {H, H, F}, {H, F, F}, {F, H, F}, {F, F, F},
                             {B, B, B}, {B, B, F}, {B, F, F}, {F, B, F}, {B, H, B},
                             {B, H, H}, {B, H, F}, {H, B, B}, {H, B, H}, {H, B, F}};
  for (const auto& row : table)
    if (row[0] == a && row[1] == b && row[2] == c) return true;
  return false;
}

template <class T>
struct is_tensor : std::false_type {};
template <class E, class X, class Tag>
struct is_tensor<metal::tensor<E, X, Tag>> : std::true_type {};

template <class Scope>
struct scope_info;
template <>
struct scope_info<metal::execution_thread> {
  static constexpr int simdgroups = 0;
};
template <>
struct scope_info<metal::execution_simdgroup> {
  static constexpr int simdgroups = 1;
};
template <int N>
struct scope_info<metal::execution_simdgroups<N>> {
  static_assert(N > 0, "execution_simdgroups<N> needs N >= 1");
  static constexpr int simdgroups = N;
};

[[noreturn]] inline void fail(const char* msg, const char* file, int line) {
  ::lily_msl::host_api->fail(msg, file, line);
  __builtin_unreachable();
}

}  // namespace lily_detail

template <matmul2d_descriptor Descriptor, class Scope, class... Args>
class matmul2d {
  static constexpr int kScopeSimdgroups = lily_detail::scope_info<Scope>::simdgroups;

 public:
  static constexpr matmul2d_descriptor descriptor = Descriptor;
  using scope = Scope;
  matmul2d() = default;

  template <class L, class R, class D>
  void run(thread L& left, thread R& right, thread D& destination, const char* file = __builtin_FILE(),
           int line = __builtin_LINE()) const {
    static_assert(lily_detail::is_tensor<L>::value && lily_detail::is_tensor<R>::value,
                  "matmul2d::run: the operands must be tensors (<metal_tensor>)");
    static_assert(lily_detail::is_tensor<D>::value,
                  "matmul2d::run: msl_cpu emulates tensor destinations only, not cooperative tensors");
    using TA = typename L::element_type;
    using TB = typename R::element_type;
    using TC = lily_detail::value_t<typename D::element_type>;
    static_assert(lily_detail::supported(lily_detail::kind<TA>(), lily_detail::kind<TB>(), lily_detail::kind<TC>()),
                  "matmul2d::run: this (A, B, C) element type combination is not in Apple's table "
                  "(or not emulated: integer operands)");
    static_assert(Descriptor.m > 0 && Descriptor.n > 0, "matmul2d_descriptor: m and n must be positive");
    constexpr bool dyn_k = Descriptor.k == static_cast<int>(metal::dynamic_extent);
    static_assert(dyn_k || Descriptor.k > 0, "matmul2d_descriptor: k must be positive or dynamic_extent");

    // Who takes part, and this thread's place among them.
    const lily_msl_thread* t = lily_msl_current;
    uint32_t me = 0, threads = 1;
    if constexpr (kScopeSimdgroups > 0) {
      if constexpr (kScopeSimdgroups == 1) {
        me = t->thread_index_in_simdgroup;
        threads = t->active_lanes;
      } else {
        if (t->simdgroups_per_threadgroup != uint32_t(kScopeSimdgroups)) {
          char msg[200];
          snprintf(msg, sizeof msg,
                   "matmul2d::run: the op runs on execution_simdgroups<%d> but the threadgroup has %u "
                   "simdgroups (undefined behavior on the GPU)",
                   kScopeSimdgroups, t->simdgroups_per_threadgroup);
          lily_detail::fail(msg, file, line);
        }
        me = t->thread_index_in_threadgroup;
        threads = t->threads_per_threadgroup[0] * t->threads_per_threadgroup[1] * t->threads_per_threadgroup[2];
      }
    }

    // Operand extents: A is M x K, B is K x N, C is M x N (extents innermost first).
    const long a_m = Descriptor.transpose_left ? left.extents().extent(0) : left.extents().extent(1);
    const long a_k = Descriptor.transpose_left ? left.extents().extent(1) : left.extents().extent(0);
    const long b_k = Descriptor.transpose_right ? right.extents().extent(0) : right.extents().extent(1);
    const long b_n = Descriptor.transpose_right ? right.extents().extent(1) : right.extents().extent(0);
    const long c_n = destination.extents().extent(0), c_m = destination.extents().extent(1);
    long K = Descriptor.k;
    if (dyn_k) {
      if (a_k != b_k) {
        char msg[200];
        snprintf(msg, sizeof msg,
                 "matmul2d::run: shape mismatch: A has K = %ld, B has K = %ld (k = dynamic_extent reads K "
                 "from both)",
                 a_k, b_k);
        lily_detail::fail(msg, file, line);
      }
      K = a_k;
    } else if (a_k < K || b_k < K) {
      char msg[200];
      snprintf(msg, sizeof msg,
               "matmul2d::run: the descriptor's k = %ld is more than A's K extent (%ld) or B's (%ld)", K,
               a_k, b_k);
      lily_detail::fail(msg, file, line);
    }
    const long M = Descriptor.m < c_m ? Descriptor.m : c_m;
    const long N = Descriptor.n < c_n ? Descriptor.n : c_n;
    constexpr bool acc = Descriptor.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate;
    for (long i = me; i < M * N; i += threads) {
      const long m = i / N, n = i % N;
      float s = 0.0f;
      if (m < a_m && n < b_n) {
        for (long k = 0; k < K; ++k) {
          const float a = float(Descriptor.transpose_left ? left.lily_at(m, k) : left.lily_at(k, m));
          const float b = float(Descriptor.transpose_right ? right.lily_at(k, n) : right.lily_at(n, k));
          s += a * b;
        }
      }
      auto& c = destination.lily_at(n, m);
      c = acc ? TC(float(c) + s) : TC(s);
    }
  }
};

}  // namespace tensor_ops
}  // namespace mpp
