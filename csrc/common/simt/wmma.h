// headwise SIMT emulator: nvcuda::wmma on the CPU (included by simt.h).
//
// Emulation model: every lane holds the WHOLE tile in its fragment
// (num_elements == rows * cols, element (r, c) at x[r * cols + c]), so
// elementwise loops over x[0..num_elements) stay consistent across lanes.
// On hardware each lane holds a slice with an unspecified mapping; kernels
// must not depend on the per-lane mapping or on num_elements' value.
// Every function below is a warp collective over all 32 lanes (lanes beyond
// a partial last warp excepted): divergent calls raise hw_sim::SimtError.
#pragma once

#include "simt.h"

#if !defined(__CUDACC__)

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
namespace precision {
struct tf32 {};
}  // namespace precision

namespace detail {
template <typename T> struct storage { using type = T; };
template <> struct storage<precision::tf32> { using type = float; };

template <int M, int N, int K>
struct shape_ok {
  static constexpr bool half_like =
      (M == 16 && N == 16 && K == 16) || (M == 32 && N == 8 && K == 16) || (M == 8 && N == 32 && K == 16);
  static constexpr bool tf32 = (M == 16 && N == 16 && K == 8);
};

template <typename Use, int M, int N, int K> struct dims;
template <int M, int N, int K> struct dims<matrix_a, M, N, K> { static constexpr int rows = M, cols = K; };
template <int M, int N, int K> struct dims<matrix_b, M, N, K> { static constexpr int rows = K, cols = N; };
template <int M, int N, int K> struct dims<accumulator, M, N, K> { static constexpr int rows = M, cols = N; };

template <typename Use, int M, int N, int K, typename T>
struct valid {
  static constexpr bool input_half =
      shape_ok<M, N, K>::half_like && (std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value);
  static constexpr bool input_tf32 = shape_ok<M, N, K>::tf32 && std::is_same<T, precision::tf32>::value;
  static constexpr bool value = std::is_same<Use, accumulator>::value
                                    ? ((shape_ok<M, N, K>::half_like &&
                                        (std::is_same<T, float>::value || std::is_same<T, __half>::value)) ||
                                       (shape_ok<M, N, K>::tf32 && std::is_same<T, float>::value))
                                    : (input_half || input_tf32);
};

inline float to_float(float v) { return v; }
inline float to_float(__half v) { return static_cast<float>(v); }
inline float to_float(__nv_bfloat16 v) { return static_cast<float>(v); }

// TF32 tensor-core inputs: the low 13 mantissa bits are ignored (truncated).
inline float tf32_truncate(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u &= 0xffffe000u;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void collective(int kind) { hw_sim::detail::warp_sync(kind, 0xffffffffu); }
}  // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(detail::valid<Use, M, N, K, T>::value,
                "headwise sim: unsupported wmma fragment (shape / element type)");
  static_assert(std::is_same<Use, accumulator>::value
                    ? std::is_same<Layout, void>::value
                    : (std::is_same<Layout, row_major>::value || std::is_same<Layout, col_major>::value),
                "headwise sim: matrix_a/matrix_b fragments need row_major or col_major; accumulator none");
  using element_type = T;
  using storage_element_type = typename detail::storage<T>::type;
  static constexpr int rows = detail::dims<Use, M, N, K>::rows;
  static constexpr int cols = detail::dims<Use, M, N, K>::cols;
  enum : int { num_elements = rows * cols };
  storage_element_type x[num_elements];
};

// Round to TF32 (round to nearest, ties away from zero, like cvt.rna.tf32.f32).
inline float __float_to_tf32(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) {
    u += 0x1000u;
    u &= 0xffffe000u;
  }
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename Use, int M, int N, int K, typename T, typename Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f,
                          const typename detail::storage<T>::type& v) {
  detail::collective(hw_sim::detail::kWmmaFill);
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = v;
}

namespace detail {
template <typename Frag, typename S>
inline void load_ab(Frag& f, const S* p, unsigned ldm, bool row_major_mem) {
  collective(hw_sim::detail::kWmmaLoad);
  for (int r = 0; r < Frag::rows; ++r)
    for (int c = 0; c < Frag::cols; ++c)
      f.x[r * Frag::cols + c] = row_major_mem ? p[static_cast<size_t>(r) * ldm + c]
                                              : p[r + static_cast<size_t>(c) * ldm];
}
}  // namespace detail

template <int M, int N, int K, typename T, typename Layout>
inline void load_matrix_sync(fragment<matrix_a, M, N, K, T, Layout>& f,
                             const typename detail::storage<T>::type* p, unsigned ldm) {
  detail::load_ab(f, p, ldm, std::is_same<Layout, row_major>::value);
}
template <int M, int N, int K, typename T, typename Layout>
inline void load_matrix_sync(fragment<matrix_b, M, N, K, T, Layout>& f,
                             const typename detail::storage<T>::type* p, unsigned ldm) {
  detail::load_ab(f, p, ldm, std::is_same<Layout, row_major>::value);
}
template <int M, int N, int K, typename T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const T* p, unsigned ldm,
                             layout_t layout) {
  detail::load_ab(f, p, ldm, layout == mem_row_major);
}
template <int M, int N, int K, typename T>
inline void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm,
                              layout_t layout) {
  detail::collective(hw_sim::detail::kWmmaStore);
  using Frag = fragment<accumulator, M, N, K, T>;
  for (int r = 0; r < Frag::rows; ++r)
    for (int c = 0; c < Frag::cols; ++c) {
      const size_t off = layout == mem_row_major ? static_cast<size_t>(r) * ldm + c
                                                 : r + static_cast<size_t>(c) * ldm;
      p[off] = f.x[r * Frag::cols + c];
    }
}

// D = A * B + C, fp32 accumulation over k in ascending order (products of
// half / bf16 / tf32 inputs are exact in fp32). D may alias C.
template <int M, int N, int K, typename Tab, typename LA, typename LB, typename Tc, typename Td>
inline void mma_sync(fragment<accumulator, M, N, K, Td>& d, const fragment<matrix_a, M, N, K, Tab, LA>& a,
                     const fragment<matrix_b, M, N, K, Tab, LB>& b,
                     const fragment<accumulator, M, N, K, Tc>& c, bool satf = false) {
  detail::collective(hw_sim::detail::kWmmaMma);
  constexpr bool is_tf32 = std::is_same<Tab, precision::tf32>::value;
  float af[M * K];
  float bf[K * N];
  for (int i = 0; i < M * K; ++i) {
    af[i] = detail::to_float(a.x[i]);
    if (is_tf32) af[i] = detail::tf32_truncate(af[i]);
  }
  for (int i = 0; i < K * N; ++i) {
    bf[i] = detail::to_float(b.x[i]);
    if (is_tf32) bf[i] = detail::tf32_truncate(bf[i]);
  }
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = detail::to_float(c.x[i * N + j]);
      for (int k = 0; k < K; ++k) acc += af[i * K + k] * bf[k * N + j];
      if (satf) {  // NaN -> 0, out of range -> largest finite value of the output type
        const float big = std::is_same<Td, float>::value ? std::numeric_limits<float>::max() : 65504.0f;
        acc = acc != acc ? 0.0f : (acc > big ? big : (acc < -big ? -big : acc));
      }
      d.x[i * N + j] = static_cast<Td>(acc);
    }
}

}  // namespace wmma
}  // namespace nvcuda

#endif  // !defined(__CUDACC__)
