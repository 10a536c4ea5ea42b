// The target-independent half of the <metal_stdlib> stand-ins: what is written once for every
// target that runs lily's .metal files as clang C++ — the CPU (csrc/msl_cpu/prelude/metal_stdlib)
// and CUDA (csrc/msl_cuda/prelude/metal_stdlib). Each target prelude includes this file and adds
// what differs: barriers, SIMD-group functions, simdgroup_matrix products, atomics, and how a
// kernel entry binds its parameters.
//
// Freestanding: no C or C++ library header but the compiler's own <stdint.h> is included (the
// CUDA target has no other), so the type traits the kernels and the prelude need are defined here (metal:: re-exports them as Metal's
// <metal_type_traits> does).
//
// Before including this file a target prelude defines:
//   device, constant, threadgroup, thread, kernel   address spaces and the kernel qualifier
//   LILY_MSL_MATH(name)   its float function `name`: __builtin_##name##f (CPU), __nv_##name##f
//                         (CUDA's libdevice)
//   lily_msl::detail::simd_lane()   the calling thread's lane in its simdgroup (declared here,
//                                   defined by the target)
#ifndef LILY_MSL_COMMON_H
#define LILY_MSL_COMMON_H

#include "lily_msl_params.h"

// Kernel-side code that must know it is compiled by a prelude rather than by Apple's compiler
// tests this (metal/sampling.h).
#define LILY_MSL_PRELUDE 1

#if !defined(LILY_MSL_MATH)
#error "a target prelude defines LILY_MSL_MATH before including lily_msl_common.h"
#endif

// ---------------------------------------------------------------------------------------------
// Scalar and vector types
// ---------------------------------------------------------------------------------------------
typedef _Float16 half;
typedef __bf16 bfloat;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;

namespace metal {
template <class T, int N>
using vec = T __attribute__((ext_vector_type(N)));
}  // namespace metal

#define LILY_MSL_VEC_TYPES(T)           \
  typedef metal::vec<T, 2> T##2;        \
  typedef metal::vec<T, 3> T##3;        \
  typedef metal::vec<T, 4> T##4;
LILY_MSL_VEC_TYPES(float)
LILY_MSL_VEC_TYPES(half)
LILY_MSL_VEC_TYPES(bfloat)
LILY_MSL_VEC_TYPES(int)
LILY_MSL_VEC_TYPES(uint)
LILY_MSL_VEC_TYPES(short)
LILY_MSL_VEC_TYPES(ushort)
LILY_MSL_VEC_TYPES(char)
LILY_MSL_VEC_TYPES(uchar)
LILY_MSL_VEC_TYPES(long)
LILY_MSL_VEC_TYPES(ulong)
LILY_MSL_VEC_TYPES(bool)
#undef LILY_MSL_VEC_TYPES

// Half literals: 1.5h.
constexpr half operator""h(long double v) { return (half)v; }
constexpr half operator""h(unsigned long long v) { return (half)v; }

// ---------------------------------------------------------------------------------------------
// Type traits (<metal_type_traits>): a freestanding subset of <type_traits>
// ---------------------------------------------------------------------------------------------
namespace lily_msl::traits {
template <class T, T v>
struct integral_constant {
  static constexpr T value = v;
  constexpr operator T() const { return v; }
};
template <bool B>
using bool_constant = integral_constant<bool, B>;
using true_type = bool_constant<true>;
using false_type = bool_constant<false>;

template <class A, class B>
struct is_same : false_type {};
template <class A>
struct is_same<A, A> : true_type {};
template <class A, class B>
constexpr bool is_same_v = is_same<A, B>::value;

template <bool B, class T = void>
struct enable_if {};
template <class T>
struct enable_if<true, T> {
  using type = T;
};
template <bool B, class T = void>
using enable_if_t = typename enable_if<B, T>::type;

template <bool B, class T, class F>
struct conditional {
  using type = T;
};
template <class T, class F>
struct conditional<false, T, F> {
  using type = F;
};
template <bool B, class T, class F>
using conditional_t = typename conditional<B, T, F>::type;

template <class T> struct remove_const { using type = T; };
template <class T> struct remove_const<const T> { using type = T; };
template <class T> struct remove_volatile { using type = T; };
template <class T> struct remove_volatile<volatile T> { using type = T; };
template <class T>
struct remove_cv {
  using type = typename remove_const<typename remove_volatile<T>::type>::type;
};
template <class T>
using remove_cv_t = typename remove_cv<T>::type;
template <class T> struct remove_reference { using type = T; };
template <class T> struct remove_reference<T&> { using type = T; };
template <class T> struct remove_reference<T&&> { using type = T; };
template <class T>
using remove_reference_t = typename remove_reference<T>::type;

template <class T> struct is_pointer_ : false_type {};
template <class T> struct is_pointer_<T*> : true_type {};
template <class T>
struct is_pointer : is_pointer_<remove_cv_t<T>> {};
template <class T>
constexpr bool is_pointer_v = is_pointer<T>::value;
template <class T> struct is_reference : false_type {};
template <class T> struct is_reference<T&> : true_type {};
template <class T> struct is_reference<T&&> : true_type {};
template <class T>
constexpr bool is_reference_v = is_reference<T>::value;

// Arithmetic types, with Metal's half and bfloat among the floating-point ones.
template <class T> struct is_integral_ : false_type {};
#define LILY_MSL_TRAIT(trait, T) template <> struct trait<T> : true_type {};
LILY_MSL_TRAIT(is_integral_, bool)
LILY_MSL_TRAIT(is_integral_, char)
LILY_MSL_TRAIT(is_integral_, signed char)
LILY_MSL_TRAIT(is_integral_, unsigned char)
LILY_MSL_TRAIT(is_integral_, short)
LILY_MSL_TRAIT(is_integral_, unsigned short)
LILY_MSL_TRAIT(is_integral_, int)
LILY_MSL_TRAIT(is_integral_, unsigned int)
LILY_MSL_TRAIT(is_integral_, long)
LILY_MSL_TRAIT(is_integral_, unsigned long)
LILY_MSL_TRAIT(is_integral_, long long)
LILY_MSL_TRAIT(is_integral_, unsigned long long)
template <class T> struct is_floating_point_ : false_type {};
LILY_MSL_TRAIT(is_floating_point_, half)
LILY_MSL_TRAIT(is_floating_point_, bfloat)
LILY_MSL_TRAIT(is_floating_point_, float)
LILY_MSL_TRAIT(is_floating_point_, double)
#undef LILY_MSL_TRAIT
template <class T>
struct is_integral : is_integral_<remove_cv_t<T>> {};
template <class T>
constexpr bool is_integral_v = is_integral<T>::value;
template <class T>
struct is_floating_point : is_floating_point_<remove_cv_t<T>> {};
template <class T>
constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T>
struct is_signed : bool_constant<(is_floating_point_v<T> || is_integral_v<T>) && T(-1) < T(0)> {};
template <class T>
struct is_unsigned : bool_constant<is_integral_v<T> && T(0) < T(-1)> {};

template <class T> struct make_unsigned;
template <class T> struct make_signed;
#define LILY_MSL_SIGN_PAIR(S, U)                      \
  template <> struct make_unsigned<S> { using type = U; }; \
  template <> struct make_unsigned<U> { using type = U; }; \
  template <> struct make_signed<S> { using type = S; };   \
  template <> struct make_signed<U> { using type = S; };
LILY_MSL_SIGN_PAIR(signed char, unsigned char)
LILY_MSL_SIGN_PAIR(short, unsigned short)
LILY_MSL_SIGN_PAIR(int, unsigned int)
LILY_MSL_SIGN_PAIR(long, unsigned long)
LILY_MSL_SIGN_PAIR(long long, unsigned long long)
#undef LILY_MSL_SIGN_PAIR
template <> struct make_unsigned<char> { using type = unsigned char; };
template <> struct make_signed<char> { using type = signed char; };
template <class T>
using make_unsigned_t = typename make_unsigned<T>::type;
template <class T>
using make_signed_t = typename make_signed<T>::type;

// The I-th type of a pack (fn_traits below).
template <unsigned I, class T, class... R>
struct nth_type : nth_type<I - 1, R...> {};
template <class T, class... R>
struct nth_type<0, T, R...> {
  using type = T;
};
}  // namespace lily_msl::traits

// ---------------------------------------------------------------------------------------------
// Traits over scalars and ext vectors; MSL's vector constructors
// ---------------------------------------------------------------------------------------------
namespace lily_msl::detail {
using namespace ::lily_msl::traits;

template <class T>
struct vec_info {
  static constexpr bool is_vec = false;
  static constexpr int size = 1;
  using elem = T;
};
template <class T, int N>
struct vec_info<T __attribute__((ext_vector_type(N)))> {
  static constexpr bool is_vec = true;
  static constexpr int size = N;
  using elem = T;
};
template <class T>
using elem_t = typename vec_info<remove_cv_t<T>>::elem;
template <class T>
constexpr bool is_vec_v = vec_info<remove_cv_t<T>>::is_vec;
template <class T>
constexpr bool is_float_v = is_same_v<elem_t<T>, float> || is_same_v<elem_t<T>, half> ||
                            is_same_v<elem_t<T>, bfloat>;
template <class T>
constexpr bool is_int_v = is_integral_v<elem_t<T>>;
template <class T>
constexpr int count_elems() {
  return vec_info<remove_cv_t<remove_reference_t<T>>>::size;
}

// MSL vector constructor: splat a scalar, convert a vector element by element (never a bit
// cast), or concatenate scalars and vectors into N elements.
template <class T, int N, class... A>
inline metal::vec<T, N> make_vec(A... a) {
  using V = metal::vec<T, N>;
  V r = {};
  if constexpr (sizeof...(A) == 0) {
    return r;
  } else if constexpr (sizeof...(A) == 1 && !(is_vec_v<A> && ...)) {
    ((r = V((T)a)), ...);  // splat
    return r;
  } else {
    static_assert((count_elems<A>() + ...) == N,
                  "vector constructor: the arguments do not add up to the vector's size");
    int i = 0;
    auto put = [&](auto x) {
      using X = decltype(x);
      if constexpr (is_vec_v<X>) {
        for (int k = 0; k < count_elems<X>(); ++k) r[i++] = (T)x[k];
      } else {
        r[i++] = (T)x;
      }
    };
    (put(a), ...);
    return r;
  }
}

// The calling thread's lane in its simdgroup (defined by the target prelude).
inline unsigned simd_lane();
}  // namespace lily_msl::detail

// Function-like macros: only `float4(...)` expands, the plain type name `float4` does not.
// (A macro cannot define macros, so they are spelled out.)
#define float2(...) ::lily_msl::detail::make_vec<float, 2>(__VA_ARGS__)
#define float3(...) ::lily_msl::detail::make_vec<float, 3>(__VA_ARGS__)
#define float4(...) ::lily_msl::detail::make_vec<float, 4>(__VA_ARGS__)
#define half2(...) ::lily_msl::detail::make_vec<half, 2>(__VA_ARGS__)
#define half3(...) ::lily_msl::detail::make_vec<half, 3>(__VA_ARGS__)
#define half4(...) ::lily_msl::detail::make_vec<half, 4>(__VA_ARGS__)
#define bfloat2(...) ::lily_msl::detail::make_vec<bfloat, 2>(__VA_ARGS__)
#define bfloat3(...) ::lily_msl::detail::make_vec<bfloat, 3>(__VA_ARGS__)
#define bfloat4(...) ::lily_msl::detail::make_vec<bfloat, 4>(__VA_ARGS__)
#define int2(...) ::lily_msl::detail::make_vec<int, 2>(__VA_ARGS__)
#define int3(...) ::lily_msl::detail::make_vec<int, 3>(__VA_ARGS__)
#define int4(...) ::lily_msl::detail::make_vec<int, 4>(__VA_ARGS__)
#define uint2(...) ::lily_msl::detail::make_vec<uint, 2>(__VA_ARGS__)
#define uint3(...) ::lily_msl::detail::make_vec<uint, 3>(__VA_ARGS__)
#define uint4(...) ::lily_msl::detail::make_vec<uint, 4>(__VA_ARGS__)
#define short2(...) ::lily_msl::detail::make_vec<short, 2>(__VA_ARGS__)
#define short3(...) ::lily_msl::detail::make_vec<short, 3>(__VA_ARGS__)
#define short4(...) ::lily_msl::detail::make_vec<short, 4>(__VA_ARGS__)
#define ushort2(...) ::lily_msl::detail::make_vec<ushort, 2>(__VA_ARGS__)
#define ushort3(...) ::lily_msl::detail::make_vec<ushort, 3>(__VA_ARGS__)
#define ushort4(...) ::lily_msl::detail::make_vec<ushort, 4>(__VA_ARGS__)
#define char2(...) ::lily_msl::detail::make_vec<char, 2>(__VA_ARGS__)
#define char3(...) ::lily_msl::detail::make_vec<char, 3>(__VA_ARGS__)
#define char4(...) ::lily_msl::detail::make_vec<char, 4>(__VA_ARGS__)
#define uchar2(...) ::lily_msl::detail::make_vec<uchar, 2>(__VA_ARGS__)
#define uchar3(...) ::lily_msl::detail::make_vec<uchar, 3>(__VA_ARGS__)
#define uchar4(...) ::lily_msl::detail::make_vec<uchar, 4>(__VA_ARGS__)
#define long2(...) ::lily_msl::detail::make_vec<long, 2>(__VA_ARGS__)
#define long3(...) ::lily_msl::detail::make_vec<long, 3>(__VA_ARGS__)
#define long4(...) ::lily_msl::detail::make_vec<long, 4>(__VA_ARGS__)
#define ulong2(...) ::lily_msl::detail::make_vec<ulong, 2>(__VA_ARGS__)
#define ulong3(...) ::lily_msl::detail::make_vec<ulong, 3>(__VA_ARGS__)
#define ulong4(...) ::lily_msl::detail::make_vec<ulong, 4>(__VA_ARGS__)
#define bool2(...) ::lily_msl::detail::make_vec<bool, 2>(__VA_ARGS__)
#define bool3(...) ::lily_msl::detail::make_vec<bool, 3>(__VA_ARGS__)
#define bool4(...) ::lily_msl::detail::make_vec<bool, 4>(__VA_ARGS__)

#define LILY_MSL_CAT_(a, b) a##b
#define LILY_MSL_CAT(a, b) LILY_MSL_CAT_(a, b)

// Function constants: `constant T name [[function_constant(i)]];` is rewritten by the host into
// a definition with the pipeline's value; this tells whether a value was given.
#define is_function_constant_defined(name) LILY_MSL_CAT(lily_msl_fc_defined_, name)

// Float constants of <metal_math>.
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define FLT_MAX 3.402823466e+38f
#define FLT_MIN 1.175494351e-38f
#define FLT_EPSILON 1.192092896e-07f
#define HALF_MAX ((half)65504.0f)
#define HALF_MIN ((half)6.103515625e-05f)
#define M_PI_F 3.14159265358979323846f
#define M_E_F 2.71828182845904523536f
#define M_LN2_F 0.693147180559945309417f
#define M_LOG2E_F 1.44269504088896340736f
#define M_SQRT2_F 1.41421356237309504880f

namespace metal {

using ::lily_msl::traits::conditional;
using ::lily_msl::traits::conditional_t;
using ::lily_msl::traits::enable_if;
using ::lily_msl::traits::enable_if_t;
using ::lily_msl::traits::false_type;
using ::lily_msl::traits::integral_constant;
using ::lily_msl::traits::is_floating_point;
using ::lily_msl::traits::is_integral;
using ::lily_msl::traits::is_same;
using ::lily_msl::traits::is_same_v;
using ::lily_msl::traits::is_signed;
using ::lily_msl::traits::is_unsigned;
using ::lily_msl::traits::make_signed_t;
using ::lily_msl::traits::make_unsigned_t;
using ::lily_msl::traits::remove_cv_t;
using ::lily_msl::traits::remove_reference_t;
using ::lily_msl::traits::true_type;

// numeric_limits for Metal's scalar types.
template <class T>
struct numeric_limits {
  static constexpr bool is_specialized = false;
};
#define LILY_MSL_INT_LIMITS(T, lo, hi)                          \
  template <>                                                   \
  struct numeric_limits<T> {                                    \
    static constexpr bool is_specialized = true;                \
    static constexpr bool is_integer = true;                    \
    static constexpr bool is_signed = (T)-1 < (T)0;             \
    static constexpr T min() { return lo; }                     \
    static constexpr T lowest() { return lo; }                  \
    static constexpr T max() { return hi; }                     \
  };
LILY_MSL_INT_LIMITS(bool, false, true)
LILY_MSL_INT_LIMITS(char, (char)(char(-1) < char(0) ? -__SCHAR_MAX__ - 1 : 0),
                    (char)(char(-1) < char(0) ? __SCHAR_MAX__ : 2 * __SCHAR_MAX__ + 1))
LILY_MSL_INT_LIMITS(signed char, -__SCHAR_MAX__ - 1, __SCHAR_MAX__)
LILY_MSL_INT_LIMITS(unsigned char, 0, 2 * __SCHAR_MAX__ + 1)
LILY_MSL_INT_LIMITS(short, -__SHRT_MAX__ - 1, __SHRT_MAX__)
LILY_MSL_INT_LIMITS(unsigned short, 0, 2 * __SHRT_MAX__ + 1)
LILY_MSL_INT_LIMITS(int, -__INT_MAX__ - 1, __INT_MAX__)
LILY_MSL_INT_LIMITS(unsigned int, 0, 2u * __INT_MAX__ + 1u)
LILY_MSL_INT_LIMITS(long, -__LONG_MAX__ - 1, __LONG_MAX__)
LILY_MSL_INT_LIMITS(unsigned long, 0, 2ul * __LONG_MAX__ + 1ul)
#undef LILY_MSL_INT_LIMITS
#define LILY_MSL_FLOAT_LIMITS(T, bits_t, min_bits, max_bits, eps_bits, inf_bits, nan_bits) \
  template <>                                                                              \
  struct numeric_limits<T> {                                                               \
    static constexpr bool is_specialized = true;                                           \
    static constexpr bool is_integer = false;                                              \
    static constexpr bool is_signed = true;                                                \
    static constexpr T min() { return __builtin_bit_cast(T, (bits_t)min_bits); }           \
    static constexpr T max() { return __builtin_bit_cast(T, (bits_t)max_bits); }           \
    static constexpr T lowest() { return -max(); }                                         \
    static constexpr T epsilon() { return __builtin_bit_cast(T, (bits_t)eps_bits); }       \
    static constexpr T infinity() { return __builtin_bit_cast(T, (bits_t)inf_bits); }      \
    static constexpr T quiet_NaN() { return __builtin_bit_cast(T, (bits_t)nan_bits); }     \
  };
LILY_MSL_FLOAT_LIMITS(float, uint, 0x00800000u, 0x7f7fffffu, 0x34000000u, 0x7f800000u, 0x7fc00000u)
LILY_MSL_FLOAT_LIMITS(half, ushort, 0x0400u, 0x7bffu, 0x1400u, 0x7c00u, 0x7e00u)
LILY_MSL_FLOAT_LIMITS(bfloat, ushort, 0x0080u, 0x7f7fu, 0x3c00u, 0x7f80u, 0x7fc0u)
#undef LILY_MSL_FLOAT_LIMITS

// as_type<T>(x): reinterpret the bits (sizes must match, as MSL requires).
template <class T, class U>
inline T as_type(U x) {
  static_assert(sizeof(T) == sizeof(U), "as_type: source and destination sizes differ");
  return __builtin_bit_cast(T, x);
}

// ---------------------------------------------------------------------------------------------
// Math (<metal_math>, <metal_common>, <metal_integer>, <metal_relational>, <metal_geometric>)
// half and bfloat compute in float (the target's LILY_MSL_MATH) and round once.
// ---------------------------------------------------------------------------------------------
namespace detail {
using ::lily_msl::detail::elem_t;
using ::lily_msl::detail::is_float_v;
using ::lily_msl::detail::is_int_v;
using ::lily_msl::detail::is_vec_v;
using ::lily_msl::traits::enable_if_t;
template <class T, class R = T>
using if_float = enable_if_t<is_float_v<T>, R>;
template <class T, class R = T>
using if_arith = enable_if_t<is_float_v<T> || is_int_v<T>, R>;
// Apply a scalar function to each element of a vector (or to a scalar).
template <class T, class F>
inline T map1(T x, F f) {
  if constexpr (is_vec_v<T>) {
    T r;
    for (int i = 0; i < ::lily_msl::detail::count_elems<T>(); ++i) r[i] = f(x[i]);
    return r;
  } else {
    return f(x);
  }
}
template <class T, class F>
inline T map2(T x, T y, F f) {
  if constexpr (is_vec_v<T>) {
    T r;
    for (int i = 0; i < ::lily_msl::detail::count_elems<T>(); ++i) r[i] = f(x[i], y[i]);
    return r;
  } else {
    return f(x, y);
  }
}
template <class T, class F>
inline T map3(T x, T y, T z, F f) {
  if constexpr (is_vec_v<T>) {
    T r;
    for (int i = 0; i < ::lily_msl::detail::count_elems<T>(); ++i) r[i] = f(x[i], y[i], z[i]);
    return r;
  } else {
    return f(x, y, z);
  }
}
}  // namespace detail

#define LILY_MSL_FLOAT1(name, expr)                                                 \
  template <class T>                                                                \
  inline detail::if_float<T> name(T x) {                                            \
    return detail::map1(x, [](auto e) {                                             \
      float v = (float)e;                                                           \
      return (decltype(e))(expr);                                                   \
    });                                                                             \
  }
LILY_MSL_FLOAT1(sqrt, LILY_MSL_MATH(sqrt)(v))
LILY_MSL_FLOAT1(rsqrt, 1.0f / LILY_MSL_MATH(sqrt)(v))
LILY_MSL_FLOAT1(exp, LILY_MSL_MATH(exp)(v))
LILY_MSL_FLOAT1(exp2, LILY_MSL_MATH(exp2)(v))
LILY_MSL_FLOAT1(exp10, LILY_MSL_MATH(pow)(10.0f, v))
LILY_MSL_FLOAT1(log, LILY_MSL_MATH(log)(v))
LILY_MSL_FLOAT1(log2, LILY_MSL_MATH(log2)(v))
LILY_MSL_FLOAT1(log10, LILY_MSL_MATH(log10)(v))
LILY_MSL_FLOAT1(sin, LILY_MSL_MATH(sin)(v))
LILY_MSL_FLOAT1(cos, LILY_MSL_MATH(cos)(v))
LILY_MSL_FLOAT1(tan, LILY_MSL_MATH(tan)(v))
LILY_MSL_FLOAT1(asin, LILY_MSL_MATH(asin)(v))
LILY_MSL_FLOAT1(acos, LILY_MSL_MATH(acos)(v))
LILY_MSL_FLOAT1(atan, LILY_MSL_MATH(atan)(v))
LILY_MSL_FLOAT1(sinh, LILY_MSL_MATH(sinh)(v))
LILY_MSL_FLOAT1(cosh, LILY_MSL_MATH(cosh)(v))
LILY_MSL_FLOAT1(tanh, LILY_MSL_MATH(tanh)(v))
LILY_MSL_FLOAT1(floor, LILY_MSL_MATH(floor)(v))
LILY_MSL_FLOAT1(ceil, LILY_MSL_MATH(ceil)(v))
LILY_MSL_FLOAT1(round, LILY_MSL_MATH(round)(v))
LILY_MSL_FLOAT1(rint, LILY_MSL_MATH(rint)(v))
LILY_MSL_FLOAT1(trunc, LILY_MSL_MATH(trunc)(v))
LILY_MSL_FLOAT1(fabs, LILY_MSL_MATH(fabs)(v))
LILY_MSL_FLOAT1(fract, LILY_MSL_MATH(fmin)(v - LILY_MSL_MATH(floor)(v), 0x1.fffffep-1f))
LILY_MSL_FLOAT1(saturate, LILY_MSL_MATH(fmin)(LILY_MSL_MATH(fmax)(v, 0.0f), 1.0f))
LILY_MSL_FLOAT1(sign, v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : 0.0f))
#undef LILY_MSL_FLOAT1

#define LILY_MSL_FLOAT2(name, expr)                                                 \
  template <class T>                                                                \
  inline detail::if_float<T> name(T x, T y) {                                       \
    return detail::map2(x, y, [](auto a, auto b) {                                  \
      float u = (float)a, v = (float)b;                                             \
      return (decltype(a))(expr);                                                   \
    });                                                                             \
  }
LILY_MSL_FLOAT2(pow, LILY_MSL_MATH(pow)(u, v))
LILY_MSL_FLOAT2(powr, LILY_MSL_MATH(pow)(u, v))
LILY_MSL_FLOAT2(atan2, LILY_MSL_MATH(atan2)(u, v))
LILY_MSL_FLOAT2(fmod, LILY_MSL_MATH(fmod)(u, v))
LILY_MSL_FLOAT2(fmin, LILY_MSL_MATH(fmin)(u, v))
LILY_MSL_FLOAT2(fmax, LILY_MSL_MATH(fmax)(u, v))
LILY_MSL_FLOAT2(copysign, LILY_MSL_MATH(copysign)(u, v))
LILY_MSL_FLOAT2(step, v < u ? 0.0f : 1.0f)  // step(edge, x)
#undef LILY_MSL_FLOAT2

template <class T>
inline detail::if_float<T> fma(T a, T b, T c) {
  return detail::map3(a, b, c, [](auto x, auto y, auto z) {
    return (decltype(x))LILY_MSL_MATH(fma)((float)x, (float)y, (float)z);
  });
}
template <class T>
inline detail::if_float<T> mix(T x, T y, T a) {
  return x + (y - x) * a;
}
template <class T, class = enable_if_t<detail::is_vec_v<T>>>
inline T mix(T x, T y, detail::elem_t<T> a) {
  return x + (y - x) * a;
}
template <class T>
inline detail::if_arith<T> clamp(T x, T lo, T hi);
template <class T>
inline detail::if_float<T> smoothstep(T e0, T e1, T x) {
  T t = clamp((x - e0) / (e1 - e0), T(0), T(1));
  return t * t * (T(3) - T(2) * t);
}
template <class T>
inline detail::if_float<T> sincos(T x, thread T& c) {
  c = cos(x);
  return sin(x);
}

// min / max / clamp / abs for floats and integers; a scalar second argument broadcasts.
template <class T>
inline detail::if_arith<T> min(T x, T y) {
  return detail::map2(x, y, [](auto a, auto b) {
    if constexpr (detail::is_float_v<decltype(a)>)
      return (decltype(a))LILY_MSL_MATH(fmin)((float)a, (float)b);
    else
      return b < a ? b : a;
  });
}
template <class T>
inline detail::if_arith<T> max(T x, T y) {
  return detail::map2(x, y, [](auto a, auto b) {
    if constexpr (detail::is_float_v<decltype(a)>)
      return (decltype(a))LILY_MSL_MATH(fmax)((float)a, (float)b);
    else
      return a < b ? b : a;
  });
}
template <class T, class = enable_if_t<detail::is_vec_v<T>>>
inline T min(T x, detail::elem_t<T> y) {
  return min(x, T(y));
}
template <class T, class = enable_if_t<detail::is_vec_v<T>>>
inline T max(T x, detail::elem_t<T> y) {
  return max(x, T(y));
}
template <class T>
inline detail::if_arith<T> clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <class T, class = enable_if_t<detail::is_vec_v<T>>>
inline T clamp(T x, detail::elem_t<T> lo, detail::elem_t<T> hi) {
  return clamp(x, T(lo), T(hi));
}
template <class T>
inline detail::if_arith<T> abs(T x) {
  return detail::map1(x, [](auto a) {
    if constexpr (detail::is_float_v<decltype(a)>)
      return (decltype(a))LILY_MSL_MATH(fabs)((float)a);
    else
      return a < 0 ? (decltype(a))-a : a;
  });
}
#define LILY_MSL_CLASSIFY(name)                                   \
  template <class T>                                              \
  inline enable_if_t<detail::is_float_v<T>, bool> name(T x) {     \
    return __builtin_##name((float)x);                            \
  }
LILY_MSL_CLASSIFY(isnan)
LILY_MSL_CLASSIFY(isinf)
LILY_MSL_CLASSIFY(isfinite)
LILY_MSL_CLASSIFY(signbit)
#undef LILY_MSL_CLASSIFY

// Integer bit functions.
template <class T>
inline enable_if_t<detail::is_int_v<T>, T> popcount(T x) {
  return detail::map1(x, [](auto a) {
    return (decltype(a))__builtin_popcountll((unsigned long long)make_unsigned_t<decltype(a)>(a));
  });
}
template <class T>
inline enable_if_t<detail::is_int_v<T>, T> clz(T x) {
  return detail::map1(x, [](auto a) {
    using U = make_unsigned_t<decltype(a)>;
    constexpr int bits = 8 * sizeof(U);
    return (decltype(a))(a == 0 ? bits : __builtin_clzll((unsigned long long)(U)a) - (64 - bits));
  });
}
template <class T>
inline enable_if_t<detail::is_int_v<T>, T> ctz(T x) {
  return detail::map1(x, [](auto a) {
    using U = make_unsigned_t<decltype(a)>;
    return (decltype(a))(a == 0 ? 8 * sizeof(U) : __builtin_ctzll((unsigned long long)(U)a));
  });
}
template <class T>
inline enable_if_t<detail::is_int_v<T>, T> mulhi(T x, T y) {
  return detail::map2(x, y, [](auto a, auto b) {
    using E = decltype(a);
    return (E)(((__int128)a * (__int128)b) >> (8 * sizeof(E)));
  });
}

// Relational and geometric.
template <class T>
inline bool all(T x) {
  if constexpr (detail::is_vec_v<T>) {
    for (int i = 0; i < ::lily_msl::detail::count_elems<T>(); ++i)
      if (!x[i]) return false;
    return true;
  } else {
    return bool(x);
  }
}
template <class T>
inline bool any(T x) {
  if constexpr (detail::is_vec_v<T>) {
    for (int i = 0; i < ::lily_msl::detail::count_elems<T>(); ++i)
      if (x[i]) return true;
    return false;
  } else {
    return bool(x);
  }
}
// select(a, b, c): c ? b : a, per element; c is a bool or a comparison mask.
template <class T, class C>
inline T select(T a, T b, C c) {
  if constexpr (detail::is_vec_v<T>) {
    T r;
    for (int i = 0; i < ::lily_msl::detail::count_elems<T>(); ++i) {
      if constexpr (detail::is_vec_v<C>)
        r[i] = c[i] ? b[i] : a[i];
      else
        r[i] = c ? b[i] : a[i];
    }
    return r;
  } else {
    return c ? b : a;
  }
}
template <class T>
inline enable_if_t<detail::is_vec_v<T>, detail::elem_t<T>> dot(T x, T y) {
  detail::elem_t<T> s = 0;
  for (int i = 0; i < ::lily_msl::detail::count_elems<T>(); ++i) s += x[i] * y[i];
  return s;
}
template <class T>
inline enable_if_t<detail::is_vec_v<T>, detail::elem_t<T>> length(T x) {
  return sqrt(dot(x, x));
}
template <class T>
inline enable_if_t<detail::is_vec_v<T>, detail::elem_t<T>> distance(T x, T y) {
  return length(x - y);
}
template <class T>
inline enable_if_t<detail::is_vec_v<T>, T> normalize(T x) {
  return x * rsqrt(dot(x, x));
}
template <class T>
inline enable_if_t<detail::is_vec_v<T>, T> cross(T x, T y) {
  return T{x.y * y.z - x.z * y.y, x.z * y.x - x.x * y.z, x.x * y.y - x.y * y.x};
}

namespace fast {
using namespace ::metal;
}
namespace precise {
using namespace ::metal;
}

// ---------------------------------------------------------------------------------------------
// Atomic types and barrier flags (<metal_atomic>, <metal_compute>); the operations are the
// target's. Only relaxed ordering exists in MSL.
// ---------------------------------------------------------------------------------------------
enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release,
                    memory_order_acq_rel, memory_order_seq_cst };
enum class thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup,
                          thread_scope_device };
template <class T>
struct _atomic {
  using value_type = T;
  T __value;
};
template <class T>
using atomic = _atomic<T>;
typedef _atomic<int> atomic_int;
typedef _atomic<uint> atomic_uint;
typedef _atomic<bool> atomic_bool;
typedef _atomic<float> atomic_float;
typedef _atomic<ulong> atomic_ulong;

enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4,
                              mem_threadgroup_imageblock = 8, mem_object_data = 16 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }

// simd_vote (<metal_simdgroup>): one bit per lane, as simd_ballot returns it.
struct simd_vote {
  typedef ulong vote_t;
  vote_t v;
  explicit constexpr simd_vote(vote_t x = 0) : v(x) {}
  explicit constexpr operator vote_t() const { return v; }
  constexpr bool all() const { return v == full; }
  constexpr bool any() const { return v != 0; }
  vote_t full = 0;  // bits of the lanes that exist
};
// ---------------------------------------------------------------------------------------------
// simdgroup_matrix<T, 8, 8> (<metal_simdgroup_matrix>): storage, construction, load and store;
// the products are the target's.
// Lane l owns row (l/4 & 4) + (l/2 % 4), columns (l/4 & 2)*2 + (l%2)*2 and the one after: the
// layout Apple GPUs use, so code reading thread_elements() sees what it would on a Mac.
// ---------------------------------------------------------------------------------------------
template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "lily's MSL runtimes support 8x8 simdgroup matrices");
  vec<T, 2> __e;  // this lane's two elements
  simdgroup_matrix() : __e{T(0), T(0)} {}
  explicit simdgroup_matrix(T diagonal);  // make_filled / diagonal: see below
  thread vec<T, 2>& thread_elements() { return __e; }
  const thread vec<T, 2>& thread_elements() const { return __e; }
  static uint row_of(uint lane) { return ((lane / 4) & 4) + ((lane / 2) % 4); }
  static uint col_of(uint lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }
  // The lane that holds (row, 2 * pair) and (row, 2 * pair + 1): the inverse of the two above.
  static uint lane_of(uint row, uint pair) {
    return ((row >> 2) & 1) << 4 | (pair >> 1) << 3 | ((row >> 1) & 1) << 2 | (row & 1) << 1 |
           (pair & 1);
  }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int C, int R>
inline simdgroup_matrix<T, C, R>::simdgroup_matrix(T d) {
  uint lane = ::lily_msl::detail::simd_lane();
  uint r = row_of(lane), c = col_of(lane);
  __e = vec<T, 2>{r == c ? d : T(0), r == c + 1 ? d : T(0)};
}
template <class T, int C, int R>
inline simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, C, R> m;
  m.__e = vec<T, 2>{value, value};
  return m;
}

// Load / store: element (row r, column c) is src[(origin.y + r) * elements_per_row + origin.x
// + c], or with transpose_matrix the element (c, r) of that storage. The matrix operations are
// always inlined, so a kernel's arrays of matrices stay registers as on the GPU (the msl_cpu
// kernel compile fails on arrays left in stack memory).
template <class T, int C, int R, class P>
__attribute__((always_inline)) inline void simdgroup_load(thread simdgroup_matrix<T, C, R>& d, P* src, ulong elements_per_row = C,
                           ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  uint lane = ::lily_msl::detail::simd_lane();
  uint r = d.row_of(lane), c = d.col_of(lane);
  for (uint k = 0; k < 2; ++k) {
    ulong row = transpose_matrix ? c + k : r, col = transpose_matrix ? r : c + k;
    d.__e[k] = T(src[(matrix_origin.y + row) * elements_per_row + matrix_origin.x + col]);
  }
}
template <class T, int C, int R, class P>
__attribute__((always_inline)) inline void simdgroup_store(const thread simdgroup_matrix<T, C, R>& s, P* dst,
                            ulong elements_per_row = C, ulong2 matrix_origin = ulong2(0),
                            bool transpose_matrix = false) {
  uint lane = ::lily_msl::detail::simd_lane();
  uint r = s.row_of(lane), c = s.col_of(lane);
  for (uint k = 0; k < 2; ++k) {
    ulong row = transpose_matrix ? c + k : r, col = transpose_matrix ? r : c + k;
    dst[(matrix_origin.y + row) * elements_per_row + matrix_origin.x + col] = s.__e[k];
  }
}

}  // namespace metal

// ---------------------------------------------------------------------------------------------
// Parameter binding (used by the binders the host generates around a .metal file,
// csrc/msl_cpu/compiler.cpp). The target adds bind_buffer / bind_threadgroup, which read its
// own dispatch state.
// ---------------------------------------------------------------------------------------------
namespace lily_msl::detail {
template <class F>
struct fn_traits;
template <class R, class... A>
struct fn_traits<R(A...)> {
  template <unsigned I>
  using arg = typename nth_type<I, A...>::type;
};

template <class F, unsigned I>
using param_t = typename fn_traits<F>::template arg<I>;

template <class P>
inline P bind_absent() {
  static_assert(is_pointer_v<P>, "a [[function_constant]] parameter must be a pointer here");
  return nullptr;
}
// A thread-position attribute: uint / ushort scalars take .x, vectors take their first N.
template <class P>
inline P bind_position(const unsigned* v) {
  if constexpr (is_vec_v<P>) {
    P r;
    for (int i = 0; i < count_elems<P>(); ++i) r[i] = elem_t<P>(v[i]);
    return r;
  } else {
    return P(v[0]);
  }
}
template <class P>
inline P bind_scalar(unsigned v) {
  return P(v);
}
// Bytes a [[buffer(i)]] parameter reads: sizeof the referenced type for `constant T&`, 0 (no
// known size) for a pointer.
template <class P>
constexpr unsigned long long bound_size() {
  if constexpr (is_reference_v<P>)
    return sizeof(remove_reference_t<P>);
  else
    return 0;
}
// The alignment a [[buffer(i)]] parameter's bound address needs: alignof the pointee of a
// pointer (1 for void), of the referenced type for `constant T&`.
template <class T> struct pointee_ { using type = T; };
template <class T> struct pointee_<T*> { using type = T; };
template <class T> struct pointee_<T* const> { using type = T; };
template <class T>
constexpr unsigned long long align_of_element() {
  using E = remove_cv_t<T>;
  if constexpr (is_same_v<E, void>)
    return 1;
  else
    return alignof(E);
}
template <class P>
constexpr unsigned long long buffer_align() {
  if constexpr (is_reference_v<P>)
    return align_of_element<remove_reference_t<P>>();
  else
    return align_of_element<typename pointee_<remove_cv_t<P>>::type>();
}
template <class P>
constexpr int buffer_kind() {
  return is_reference_v<P> ? LILY_MSL_PARAM_BUFFER_REF : LILY_MSL_PARAM_BUFFER;
}
}  // namespace lily_msl::detail

#endif  // LILY_MSL_COMMON_H
