// CPU kernels of the fused QKV projection (math: qkv_kernel.cuh). The product is one
// library GEMM with the bias (at::addmm: MKL / oneDNN); the epilogue is fused C++: each
// token's packed row is read once and every head is written, normalized, rotated and scaled,
// straight into its head-major output. Tokens run in parallel with at::parallel_for in
// fixed chunks of kChunk rows; the norm-weight gradients are summed per chunk and then
// over chunks in order, so results do not depend on the number of threads.
#include "../common/cpu_convert.h"
#include "../common/cpu_simd.h"
#include "../common/op_range.h"
#include "../common/outputs.h"
#include "qkv_args.h"
#include "qkv_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace headwise {
namespace qkv {
namespace {

constexpr int64_t kChunk = 32;  // token rows per task (and per norm-weight partial)

enum Role { kQ = 0, kK = 1, kV = 2 };

// Everything the epilogue loops need; small parameters are contiguous copies in A.
template <typename T, typename A>
struct Call {
  Shape s;
  const int64_t* offsets;
  const A* qn;    // [d] or nullptr
  const A* kn;
  bool qn_rounds, kn_rounds;  // that norm weight is stored in T: round y * w to T
  const A* cos;   // [S, rot] or [B, S, rot] (batch stride s.rope_batch_stride), or nullptr
  const A* sin;
  A scale_q, eps;
  const T* packed;  // [M, rows]
  T* out[3];        // forward: q, k, v head-major
  const T* grad[3];  // backward: grad_q, grad_k, grad_v head-major contiguous
  T* grad_packed;    // backward: [M, rows]
  A* partial;        // backward: [chunks, 2, d]

  // Role, index within the role, width and output row of head h at token m.
  Role role(int64_t h) const { return h < s.hq ? kQ : (h < s.hq + s.hkv ? kK : kV); }
  int64_t index(int64_t h) const { return h < s.hq ? h : (h < s.hq + s.hkv ? h - s.hq : h - s.hq - s.hkv); }
  int64_t width(Role r) const { return r == kV ? s.dv : s.d; }
  int64_t heads_of(Role r) const { return r == kQ ? s.hq : s.hkv; }
  const A* norm(Role r) const { return r == kQ ? qn : (r == kK ? kn : nullptr); }
  bool norm_rounds(Role r) const { return r == kQ ? qn_rounds : kn_rounds; }
  // Offset of (b, head, t) in a head-major [B, H, S, width] tensor.
  int64_t head_row(Role r, int64_t b, int64_t hr, int64_t t) const {
    return ((b * heads_of(r) + hr) * s.seq + t) * width(r);
  }
  // Offset of the rope table row of token (b, t).
  int64_t rope_row(int64_t b, int64_t t) const { return b * s.rope_batch_stride + t * s.rot; }
};

// Rotary forward over the leading `rot` dims of y (n >= rot), the rest copied:
// o = rotate(y) (pairs and formula: RopeStyle in qkv_args.h).
template <typename A>
HW_CPU_INLINE void rope_forward(const A* __restrict y, A* __restrict o, const A* __restrict cs,
                                const A* __restrict sn, int64_t n, int64_t rot, bool interleaved) {
  const int64_t half = rot / 2;
  if (!interleaved) {
    for (int64_t p = 0; p < half; ++p) {
      o[p] = y[p] * cs[p] - y[p + half] * sn[p];
      o[p + half] = y[p + half] * cs[p + half] + y[p] * sn[p + half];
    }
  } else {
    for (int64_t p = 0; p < half; ++p) {
      o[2 * p] = y[2 * p] * cs[2 * p] - y[2 * p + 1] * sn[2 * p];
      o[2 * p + 1] = y[2 * p + 1] * cs[2 * p + 1] + y[2 * p] * sn[2 * p + 1];
    }
  }
  for (int64_t j = rot; j < n; ++j) o[j] = y[j];
}

// Transpose of rope_forward: for a pair (lo, hi),
// o[lo] = g[lo] c[lo] + g[hi] s[hi],  o[hi] = g[hi] c[hi] - g[lo] s[lo].
template <typename A>
HW_CPU_INLINE void rope_backward(const A* __restrict g, A* __restrict o, const A* __restrict cs,
                                 const A* __restrict sn, int64_t n, int64_t rot, bool interleaved) {
  const int64_t half = rot / 2;
  if (!interleaved) {
    for (int64_t p = 0; p < half; ++p) {
      o[p] = g[p] * cs[p] + g[p + half] * sn[p + half];
      o[p + half] = g[p + half] * cs[p + half] - g[p] * sn[p];
    }
  } else {
    for (int64_t p = 0; p < half; ++p) {
      o[2 * p] = g[2 * p] * cs[2 * p] + g[2 * p + 1] * sn[2 * p + 1];
      o[2 * p + 1] = g[2 * p + 1] * cs[2 * p + 1] - g[2 * p] * sn[2 * p];
    }
  }
  for (int64_t j = rot; j < n; ++j) o[j] = g[j];
}

// y[j] = packed[j] in the accumulation type
template <typename T, typename A>
HW_CPU_INLINE void load_row(const T* __restrict src, A* __restrict y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] = static_cast<A>(src[j]);
}

// 1 / sqrt(mean_j y[j]^2 + eps), the sum in cpu::sums' fixed order (vector lanes, then a
// halving tree; in order for rows narrower than one vector): a sequential sum would be a
// chain of n dependent adds per head row.
template <typename A>
HW_CPU_INLINE A rms_scale(const A* __restrict y, int64_t n, A eps) {
  A ss[1];
  cpu::sums<1>(n, [&](auto ld, auto& t) { t[0] = ld(y) * ld(y); }, ss);
  return A(1) / std::sqrt(ss[0] / static_cast<A>(n) + eps);
}

template <typename T, typename A>
HW_CPU_INLINE void forward_rows(const Call<T, A>& c, int64_t m0, int64_t m1) {
  const Shape& s = c.s;
  const int64_t wmax = std::max(s.d, s.dv);
  std::vector<A> buf(2 * wmax);
  A* y = buf.data();
  A* o = y + wmax;
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t b = m / s.seq, t = m - b * s.seq;
    const T* row = c.packed + m * s.rows;
    for (int64_t h = 0; h < s.heads(); ++h) {
      const Role r = c.role(h);
      const int64_t n = c.width(r), off = c.offsets[h];
      load_row(row + off, y, n);
      if (const A* w = c.norm(r)) {
        const A inv = rms_scale(y, n, c.eps);
        for (int64_t j = 0; j < n; ++j) y[j] = cpu::round_to<T>(y[j] * inv) * w[j];
        if (c.norm_rounds(r))
          for (int64_t j = 0; j < n; ++j) y[j] = cpu::round_to<T>(y[j]);
      }
      const A scale = r == kQ ? c.scale_q : A(1);
      T* dst = c.out[r] + c.head_row(r, b, c.index(h), t);
      if (c.cos != nullptr && r != kV) {
        const int64_t row = c.rope_row(b, t);
        rope_forward(y, o, c.cos + row, c.sin + row, n, s.rot, s.interleaved);
        for (int64_t j = 0; j < n; ++j) dst[j] = cpu::to_storage<T>(o[j] * scale);
      } else {
        for (int64_t j = 0; j < n; ++j) dst[j] = cpu::to_storage<T>(y[j] * scale);
      }
    }
  }
}

// Backward of the epilogue for the rows of chunk `chunk`: grad_packed rows and the
// chunk's norm-weight partial [2, d] (q_norm then k_norm).
template <typename T, typename A>
HW_CPU_INLINE void backward_chunk(const Call<T, A>& c, int64_t chunk) {
  const Shape& s = c.s;
  const int64_t m0 = chunk * kChunk, m1 = std::min(s.tokens(), m0 + kChunk);
  const int64_t wmax = std::max(s.d, s.dv);
  std::vector<A> buf(3 * wmax);
  A* g = buf.data();
  A* y = g + wmax;
  A* tmp = y + wmax;
  A* part = c.partial + chunk * 2 * s.d;
  for (int64_t j = 0; j < 2 * s.d; ++j) part[j] = 0;
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t b = m / s.seq, t = m - b * s.seq;
    T* grow = c.grad_packed + m * s.rows;
    for (int64_t h = 0; h < s.heads(); ++h) {
      const Role r = c.role(h);
      const int64_t n = c.width(r), off = c.offsets[h];
      const T* src = c.grad[r] + c.head_row(r, b, c.index(h), t);
      const A scale = r == kQ ? c.scale_q : A(1);
      for (int64_t j = 0; j < n; ++j) g[j] = static_cast<A>(src[j]) * scale;
      if (c.cos != nullptr && r != kV) {
        const int64_t row = c.rope_row(b, t);
        rope_backward(g, tmp, c.cos + row, c.sin + row, n, s.rot, s.interleaved);
        for (int64_t j = 0; j < n; ++j) g[j] = tmp[j];
      }
      if (const A* w = c.norm(r)) {
        // n = round(y r) w:  dw += g round(y r);  du = g w;
        // dy = r du - r^3 y <du, y> / n
        load_row(c.packed + m * s.rows + off, y, n);
        const A inv = rms_scale(y, n, c.eps);
        A* pw = part + (r == kQ ? 0 : s.d);
        for (int64_t j = 0; j < n; ++j) {
          pw[j] += g[j] * cpu::round_to<T>(y[j] * inv);
          g[j] *= w[j];
        }
        A dot[1];
        cpu::sums<1>(n, [&](auto ld, auto& t) { t[0] = ld(g) * ld(y); }, dot);
        const A k = inv * inv * inv * dot[0] / static_cast<A>(n);
        for (int64_t j = 0; j < n; ++j) g[j] = inv * g[j] - k * y[j];
      }
      T* dst = grow + off;
      for (int64_t j = 0; j < n; ++j) dst[j] = cpu::to_storage<T>(g[j]);
    }
  }
}

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// The entries the parallel tasks call, one per dtype, multi-versioned (HW_CPU_CLONES): the
// HW_CPU_INLINE functions above are compiled into each clone.
#define HW_QKV_CPU_ENTRIES(T)                                                                  \
  HW_CPU_CLONES void forward_rows_clone(const Call<T, acc_t<T>>& c, int64_t m0, int64_t m1) { \
    forward_rows(c, m0, m1);                                                                   \
  }                                                                                            \
  HW_CPU_CLONES void backward_chunk_clone(const Call<T, acc_t<T>>& c, int64_t chunk) {         \
    backward_chunk(c, chunk);                                                                  \
  }
HW_QKV_CPU_ENTRIES(float)
HW_QKV_CPU_ENTRIES(double)
HW_QKV_CPU_ENTRIES(c10::BFloat16)
HW_QKV_CPU_ENTRIES(c10::Half)
#undef HW_QKV_CPU_ENTRIES

template <typename F>
void dispatch_cpu_dtype(at::ScalarType dt, const char* op, F&& f) {
  switch (dt) {
    case at::kFloat: f(float{}); break;
    case at::kDouble: f(double{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK_TYPE(false, "headwise.", op, ": x must be float32, bfloat16, float16 or float64, got ", dt);
  }
}

inline at::Tensor small(const c10::optional<at::Tensor>& t, at::ScalarType acc) {
  return t.has_value() ? t->to(acc).contiguous() : at::Tensor();
}

template <typename A>
inline const A* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<A>() : nullptr;
}

// Fills the shared part of a Call; `keep` holds the converted small parameters alive.
template <typename T, typename A>
Call<T, A> make_call(const Shape& s, const at::Tensor& offsets, const std::vector<at::Tensor>& keep,
                     double norm_eps, double scale_q) {
  Call<T, A> c{};
  c.s = s;
  c.offsets = offsets.data_ptr<int64_t>();
  c.qn = ptr_or_null<A>(keep[0]);
  c.kn = ptr_or_null<A>(keep[1]);
  c.cos = ptr_or_null<A>(keep[2]);
  c.sin = ptr_or_null<A>(keep[3]);
  c.eps = static_cast<A>(norm_eps);
  c.scale_q = static_cast<A>(scale_q);
  return c;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> project_cpu(
    const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    at::IntArrayRef head_offsets, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t v_head_dim,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double norm_eps,
    const c10::optional<at::Tensor>& rope_cos, const c10::optional<at::Tensor>& rope_sin, double scale_q,
    int64_t rope_style) {
  HW_OP_RANGE("headwise::qkv_project");
  constexpr const char* op = "qkv_project";
  const Shape s = check_project_args(op, x, weight, bias, head_offsets, num_q_heads, num_kv_heads, head_dim,
                                     v_head_dim, q_norm, k_norm, norm_eps, rope_cos, rope_sin, rope_style);
  TORCH_CHECK(x.device().is_cpu(), "headwise.", op, ": x is on ", x.device(), " but the CPU backend takes CPU tensors");
  auto [q, k, v] = new_head_outputs(s, x, new_output);
  const at::Tensor packed = packed_product(x, weight, bias, s);
  const at::Tensor offsets = at::tensor(head_offsets.vec(), at::kLong);
  dispatch_cpu_dtype(x.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const auto acc = c10::CppTypeToScalarType<A>::value;
    const std::vector<at::Tensor> keep{small(q_norm, acc), small(k_norm, acc), small(rope_cos, acc),
                                       small(rope_sin, acc)};
    Call<T, A> c = make_call<T, A>(s, offsets, keep, norm_eps, scale_q);
    c.qn_rounds = norm_rounds(x, q_norm);
    c.kn_rounds = norm_rounds(x, k_norm);
    c.packed = packed.data_ptr<T>();
    c.out[0] = q.data_ptr<T>();
    c.out[1] = k.data_ptr<T>();
    c.out[2] = v.data_ptr<T>();
    at::parallel_for(0, s.tokens(), kChunk, [&](int64_t m0, int64_t m1) { forward_rows_clone(c, m0, m1); });
  });
  return {q, k, v, s.any_norm() ? packed : at::empty({0}, x.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> project_backward_cpu(
    const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& grad_v, const at::Tensor& x,
    const at::Tensor& weight, const c10::optional<at::Tensor>& bias, const at::Tensor& packed,
    at::IntArrayRef head_offsets, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t v_head_dim,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double norm_eps,
    const c10::optional<at::Tensor>& rope_cos, const c10::optional<at::Tensor>& rope_sin, double scale_q,
    int64_t rope_style) {
  HW_OP_RANGE("headwise::qkv_project_backward");
  constexpr const char* op = "qkv_project_backward";
  const Shape s = check_project_args(op, x, weight, bias, head_offsets, num_q_heads, num_kv_heads, head_dim,
                                     v_head_dim, q_norm, k_norm, norm_eps, rope_cos, rope_sin, rope_style);
  TORCH_CHECK(x.device().is_cpu(), "headwise.", op, ": x is on ", x.device(), " but the CPU backend takes CPU tensors");
  check_backward_args(op, grad_q, grad_k, grad_v, x, packed, s);
  const at::Tensor gq = contiguous_grad(grad_q), gk = contiguous_grad(grad_k), gv = contiguous_grad(grad_v);
  const at::Tensor pk = s.any_norm() ? packed.contiguous() : packed;
  at::Tensor G = new_output({s.tokens(), s.rows}, x.options());
  const int64_t chunks = (s.tokens() + kChunk - 1) / kChunk;
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor partial = new_output({chunks, 2, s.d}, x.options().dtype(acc));
  at::Tensor norm_sum = at::zeros({2, s.d}, x.options().dtype(acc));
  const at::Tensor offsets = at::tensor(head_offsets.vec(), at::kLong);
  dispatch_cpu_dtype(x.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const std::vector<at::Tensor> keep{small(q_norm, acc), small(k_norm, acc), small(rope_cos, acc),
                                       small(rope_sin, acc)};
    Call<T, A> c = make_call<T, A>(s, offsets, keep, norm_eps, scale_q);
    c.qn_rounds = norm_rounds(x, q_norm);
    c.kn_rounds = norm_rounds(x, k_norm);
    c.packed = s.any_norm() ? pk.data_ptr<T>() : nullptr;
    c.grad[0] = gq.data_ptr<T>();
    c.grad[1] = gk.data_ptr<T>();
    c.grad[2] = gv.data_ptr<T>();
    c.grad_packed = G.data_ptr<T>();
    c.partial = partial.data_ptr<A>();
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t i = c0; i < c1; ++i) backward_chunk_clone(c, i);
    });
    // Chunks in order: the same sum for any thread count.
    A* total = norm_sum.data_ptr<A>();
    const A* part = c.partial;
    for (int64_t i = 0; i < chunks; ++i)
      for (int64_t j = 0; j < 2 * s.d; ++j) total[j] += part[i * 2 * s.d + j];
  });
  auto [grad_x, grad_w, grad_b] = backward_gemms(G, x, weight, bias, s);
  at::Tensor grad_qn = q_norm.has_value() ? norm_sum[0].to(q_norm->scalar_type()) : at::empty({0}, x.options());
  at::Tensor grad_kn = k_norm.has_value() ? norm_sum[1].to(k_norm->scalar_type()) : at::empty({0}, x.options());
  return {grad_x, grad_w, grad_b, grad_qn, grad_kn};
}

}  // namespace qkv
}  // namespace headwise
