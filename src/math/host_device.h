// Lets one function body serve the CPU (scalars and Eigen arrays) and CUDA device code.
#pragma once

#include <type_traits>

#if defined(__CUDACC__)
#define WINNOW_HD __host__ __device__ __forceinline__
#else
#define WINNOW_HD inline
#endif

// For long, rarely taken paths inside fully unrolled device loops (pow for a general alpha):
// one call instead of hundreds of inlined copies keeps compile time and code size down.
#if defined(__CUDACC__)
#define WINNOW_HD_OUTLINED __host__ __device__ __noinline__
#else
#define WINNOW_HD_OUTLINED inline
#endif

// Full unrolling where device code keeps a loop's values in registers (arrays indexed by the
// loop variable); the host compilers need no hint.
#if defined(__CUDA_ARCH__)
#define WINNOW_UNROLL _Pragma("unroll")
#else
#define WINNOW_UNROLL
#endif

namespace winnow::math {

// The element type of X: X itself for a scalar, X::Scalar for an Eigen array expression.
// Lets a formula write its constants once for both.
template <class X, class = void>
struct scalar_of {
  using type = X;
};
template <class X>
struct scalar_of<X, std::void_t<typename X::Scalar>> {
  using type = typename X::Scalar;
};
template <class X>
using scalar_of_t = typename scalar_of<X>::type;

}  // namespace winnow::math
