// Argument validation of qkv_project and qkv_project_backward, shared by the CPU, CUDA
// and emulated entries so that every backend rejects the same calls with the same
// words, plus the library-GEMM halves that every backend shares (see qkv_kernel.cuh for
// why the product is a library GEMM and the split/norm/rope/scale a fused epilogue).
#pragma once

#include "../common/checks.h"

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

namespace headwise {
namespace qkv {

// Rotary conventions (the schema's `rope_style`): which element pairs a rotation turns.
// Over the leading `rot` dims of a q/k head (rot = the tables' last dim, even, <= head_dim;
// the dims from rot on pass through):
//   kRotateHalf  (Llama, Qwen, GPT-NeoX): pairs (p, p + rot/2), p < rot/2;
//   kInterleaved (GPT-J):                 pairs (2p, 2p + 1),   p < rot/2.
// For a pair (lo, hi) with tables c, s of width rot (indexed by the element):
//   out[lo] = y[lo] c[lo] - y[hi] s[lo],   out[hi] = y[hi] c[hi] + y[lo] s[hi].
enum RopeStyle : int64_t { kRotateHalf = 0, kInterleaved = 1 };

struct Shape {
  int64_t batch, seq, d_model, rows;  // rows = N_total of the packed axis
  int64_t hq, hkv, d, dv;
  bool norm_q, norm_k, rope, bias;
  // Rope: rot = the tables' last dim (0 without rope); rope_batch_stride = S * rot for
  // per-row tables [B, S, rot], 0 for one table [S, rot] shared by every row.
  int64_t rot, rope_batch_stride;
  bool interleaved;
  int64_t tokens() const { return batch * seq; }
  int64_t heads() const { return hq + 2 * hkv; }
  bool any_norm() const { return norm_q || norm_k; }
};

inline void check_small_param(const char* op, const at::Tensor& t, const char* name, const at::Tensor& x,
                              std::initializer_list<int64_t> sizes, const char* what) {
  const std::vector<int64_t> want(sizes);
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(want), "headwise.", op, ": ", name, " must be ", what,
                    " = ", at::IntArrayRef(want), ", got shape ", shape_str(t));
  check_same_device(op, t, name, x, "x");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == x.scalar_type(), "headwise.", op, ": ",
                   name, " must be float32 or the dtype of x (", x.scalar_type(), "), got ", t.scalar_type());
}

// Checks every argument of qkv_project; `op` names the op in messages.
inline Shape check_project_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias, at::IntArrayRef head_offsets,
                                int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t v_head_dim, const c10::optional<at::Tensor>& q_norm,
                                const c10::optional<at::Tensor>& k_norm, double norm_eps,
                                const c10::optional<at::Tensor>& rope_cos,
                                const c10::optional<at::Tensor>& rope_sin, int64_t rope_style) {
  check_dim(op, x, "x", 3);
  check_float_dtype(op, x, "x");
  check_last_dim_contiguous(op, x, "x");
  check_dim(op, weight, "weight", 2);
  check_same_dtype(op, weight, "weight", x, "x");
  check_same_device(op, weight, "weight", x, "x");
  check_last_dim_contiguous(op, weight, "weight");
  Shape s{};
  s.batch = x.size(0);
  s.seq = x.size(1);
  s.d_model = x.size(2);
  s.hq = num_q_heads;
  s.hkv = num_kv_heads;
  s.d = head_dim;
  s.dv = v_head_dim;
  check_size(op, weight, "weight", 1, s.d_model, "D_model, the last dim of x");
  TORCH_CHECK_VALUE(num_q_heads >= 0 && num_kv_heads >= 0 && num_q_heads + num_kv_heads > 0, "headwise.", op,
                    ": layout: head counts must be non-negative and not both 0, got num_q_heads = ", num_q_heads,
                    ", num_kv_heads = ", num_kv_heads);
  TORCH_CHECK_VALUE(num_q_heads == 0 || num_kv_heads == 0 || num_q_heads % num_kv_heads == 0, "headwise.", op,
                    ": layout: num_kv_heads (", num_kv_heads, ") must divide num_q_heads (", num_q_heads, ")");
  TORCH_CHECK_VALUE(head_dim >= 1 && v_head_dim >= 1, "headwise.", op,
                    ": layout: head_dim and v_head_dim must be positive, got ", head_dim, " and ", v_head_dim);
  s.rows = s.hq * s.d + s.hkv * (s.d + s.dv);
  TORCH_CHECK_VALUE(weight.size(0) == s.rows, "headwise.", op, ": weight has ", weight.size(0),
                    " rows but the layout packs ", s.rows, " (", s.hq, " q heads and ", s.hkv,
                    " kv heads of width ", s.d, ", v width ", s.dv, "); the widths do not divide into these heads");
  // The heads' row spans must tile [0, rows) exactly: no overlap, no gap.
  TORCH_CHECK_VALUE(static_cast<int64_t>(head_offsets.size()) == s.heads(), "headwise.", op,
                    ": layout: head_offsets must list ", s.heads(), " heads (q, k, v), got ", head_offsets.size());
  std::vector<std::pair<int64_t, int64_t>> spans;  // (start, width)
  for (int64_t h = 0; h < s.heads(); ++h) {
    const int64_t w = h < s.hq + s.hkv ? s.d : s.dv;
    TORCH_CHECK_VALUE(head_offsets[h] >= 0 && head_offsets[h] + w <= s.rows, "headwise.", op,
                      ": layout: head ", h, " spans rows [", head_offsets[h], ", ", head_offsets[h] + w,
                      ") outside the packed axis [0, ", s.rows, ")");
    spans.emplace_back(head_offsets[h], w);
  }
  std::sort(spans.begin(), spans.end());
  int64_t pos = 0;
  for (const auto& [start, w] : spans) {
    TORCH_CHECK_VALUE(start >= pos, "headwise.", op, ": layout: spans overlap: rows [", start, ", ",
                      std::min(pos, start + w), ") belong to two heads");
    TORCH_CHECK_VALUE(start == pos, "headwise.", op, ": layout: spans leave a gap: rows [", pos, ", ", start,
                      ") belong to no head");
    pos = start + w;
  }
  s.bias = bias.has_value();
  if (s.bias) {
    check_dim(op, *bias, "bias", 1);
    check_small_param(op, *bias, "bias", x, {s.rows}, "[N_total]");
  }
  s.norm_q = q_norm.has_value();
  s.norm_k = k_norm.has_value();
  if (s.norm_q) check_small_param(op, *q_norm, "q_norm", x, {s.d}, "[head_dim]");
  if (s.norm_k) check_small_param(op, *k_norm, "k_norm", x, {s.d}, "[head_dim]");
  if (s.any_norm()) TORCH_CHECK_VALUE(norm_eps > 0.0, "headwise.", op, ": norm_eps must be positive, got ", norm_eps);
  TORCH_CHECK_VALUE(rope_cos.has_value() == rope_sin.has_value(), "headwise.", op,
                    ": rope: give both cos and sin or neither");
  TORCH_CHECK_VALUE(rope_style == kRotateHalf || rope_style == kInterleaved, "headwise.", op,
                    ": rope_style must be 0 (rotate-half) or 1 (interleaved pairs, GPT-J), got ", rope_style);
  s.rope = rope_cos.has_value();
  s.interleaved = rope_style == kInterleaved;
  if (s.rope) {
    const at::Tensor& cos = *rope_cos;
    const at::Tensor& sin = *rope_sin;
    TORCH_CHECK_VALUE(cos.dim() == 2 || cos.dim() == 3, "headwise.", op,
                      ": rope cos must be [S, rotary_dim] or [B, S, rotary_dim], got shape ", shape_str(cos));
    s.rot = cos.size(-1);
    TORCH_CHECK_VALUE(s.rot >= 2 && s.rot % 2 == 0 && s.rot <= s.d, "headwise.", op,
                      ": rope: rotary_dim (the tables' last dim) must be even and in [2, head_dim = ", s.d,
                      "], got ", s.rot);
    if (cos.dim() == 2) {
      check_small_param(op, cos, "rope cos", x, {s.seq, s.rot}, "[S, rotary_dim]");
      check_small_param(op, sin, "rope sin", x, {s.seq, s.rot}, "[S, rotary_dim] like rope cos");
      s.rope_batch_stride = 0;
    } else {
      check_small_param(op, cos, "rope cos", x, {s.batch, s.seq, s.rot}, "[B, S, rotary_dim]");
      check_small_param(op, sin, "rope sin", x, {s.batch, s.seq, s.rot}, "[B, S, rotary_dim] like rope cos");
      s.rope_batch_stride = s.seq * s.rot;
    }
  }
  return s;
}

inline void check_backward_args(const char* op, const at::Tensor& grad_q, const at::Tensor& grad_k,
                                const at::Tensor& grad_v, const at::Tensor& x, const at::Tensor& packed,
                                const Shape& s) {
  const std::pair<const at::Tensor*, const char*> grads[] = {{&grad_q, "grad_q"}, {&grad_k, "grad_k"},
                                                             {&grad_v, "grad_v"}};
  const int64_t heads[] = {s.hq, s.hkv, s.hkv};
  const int64_t widths[] = {s.d, s.d, s.dv};
  for (int i = 0; i < 3; ++i) {
    const at::Tensor& g = *grads[i].first;
    const std::vector<int64_t> want{s.batch, heads[i], s.seq, widths[i]};
    TORCH_CHECK_VALUE(g.sizes() == at::IntArrayRef(want), "headwise.", op, ": ", grads[i].second, " must be ",
                      at::IntArrayRef(want), ", got shape ", shape_str(g));
    check_same_dtype(op, g, grads[i].second, x, "x");
    check_same_device(op, g, grads[i].second, x, "x");
  }
  if (s.any_norm()) {
    const std::vector<int64_t> want{s.tokens(), s.rows};
    TORCH_CHECK_VALUE(packed.sizes() == at::IntArrayRef(want), "headwise.", op,
                      ": packed (the forward's saved product) must be ", at::IntArrayRef(want), ", got shape ",
                      shape_str(packed));
    check_same_dtype(op, packed, "packed", x, "x");
    check_same_device(op, packed, "packed", x, "x");
  }
}

// Output tensors of the forward: q [B, Hq, S, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv].
template <typename NewOutput>
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> new_head_outputs(const Shape& s, const at::Tensor& x,
                                                                      NewOutput&& new_output) {
  return {new_output({s.batch, s.hq, s.seq, s.d}, x.options()),
          new_output({s.batch, s.hkv, s.seq, s.d}, x.options()),
          new_output({s.batch, s.hkv, s.seq, s.dv}, x.options())};
}

// Whether a norm weight is stored in x's dtype: then the reference's weight * h is a tensor
// of that dtype, and the kernels round the product to it as well (fp32 weights: no
// rounding, the product stays fp32 until the output).
inline bool norm_rounds(const at::Tensor& x, const c10::optional<at::Tensor>& norm) {
  return norm.has_value() && norm->scalar_type() == x.scalar_type();
}

// The library GEMM of the forward: packed = x2d @ weight^T + bias, [B*S, N_total] in x's
// dtype (fp32 accumulation inside MKL/oneDNN on CPU and cuBLAS(Lt) on CUDA, with the bias
// in the GEMM's epilogue), i.e. rounded to the storage dtype once, exactly where
// F.linear(x, weight, bias) rounds.
inline at::Tensor packed_product(const at::Tensor& x, const at::Tensor& weight,
                                 const c10::optional<at::Tensor>& bias, const Shape& s) {
  const at::Tensor x2d = x.reshape({s.tokens(), s.d_model});
  if (bias.has_value()) return at::addmm(bias->to(x.scalar_type()), x2d, weight.t());
  return at::mm(x2d, weight.t());
}

// The library GEMMs of the backward from the packed gradient G [B*S, N_total]:
// grad_x = G @ W, grad_weight = G^T @ x (fp32/fp64 on the CPU: contracted in fixed-order
// token chunks), grad_bias = sum of G's rows (fp32 sum for narrow dtypes; 0-element
// without bias).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_gemms(const at::Tensor& G, const at::Tensor& x,
                                                                     const at::Tensor& weight,
                                                                     const c10::optional<at::Tensor>& bias,
                                                                     const Shape& s) {
  at::Tensor grad_x = at::mm(G, weight).view({s.batch, s.seq, s.d_model});
  const at::Tensor x2d = x.reshape({s.tokens(), s.d_model});
  at::Tensor grad_w;
  if (G.device().is_cpu() && (G.scalar_type() == at::kFloat || G.scalar_type() == at::kDouble)) {
    // The contraction over all tokens in fixed-order chunks of kWeightGradChunk: one GEMM
    // over them lets a CPU BLAS split it across threads, which changes the bits with the
    // thread count. (Narrow dtypes keep one GEMM: chunk sums would round to bf16/fp16.)
    constexpr int64_t kWeightGradChunk = 512;
    grad_w = at::mm(G.narrow(0, 0, std::min(s.tokens(), kWeightGradChunk)).t(),
                    x2d.narrow(0, 0, std::min(s.tokens(), kWeightGradChunk)));
    for (int64_t t0 = kWeightGradChunk; t0 < s.tokens(); t0 += kWeightGradChunk) {
      const int64_t n = std::min(kWeightGradChunk, s.tokens() - t0);
      grad_w.addmm_(G.narrow(0, t0, n).t(), x2d.narrow(0, t0, n));
    }
  } else {
    grad_w = at::mm(G.t(), x2d);
  }
  at::Tensor grad_b;
  if (bias.has_value()) {
    const auto acc = G.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    grad_b = G.sum(0, false, acc).to(bias->scalar_type());
  } else {
    grad_b = at::empty({0}, x.options());
  }
  return {grad_x, grad_w, grad_b};
}

// A head-major gradient as a contiguous tensor (autograd may hand in expanded zeros or
// strided views).
inline at::Tensor contiguous_grad(const at::Tensor& g) { return g.contiguous(); }

}  // namespace qkv
}  // namespace headwise
