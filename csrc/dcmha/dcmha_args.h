// Argument validation of the DCMHA ops, shared by the CPU, CUDA and emulated entries so
// that every backend rejects the same calls with the same words.
#pragma once

#include "../common/checks.h"

#include <ATen/core/Tensor.h>

namespace headwise {
namespace dcmha {

constexpr int64_t kRank = 2;   // R
constexpr int64_t kSlots = 4;  // c = (pre,q), (pre,k), (post,q), (post,k)

struct Shape {
  int64_t batch, heads, seq, head_groups;
};

// w1, w2 [B, T, 4, R, H], g [B, T, 4, H]: same dtype and device as `ref`.
inline void check_weights(const char* op, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& g,
                          const at::Tensor& ref, const char* ref_name, const Shape& s) {
  check_dim(op, w1, "weights.w1", 5);
  check_dim(op, w2, "weights.w2", 5);
  check_dim(op, g, "weights.g", 4);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{w1, "weights.w1"}, {w2, "weights.w2"}}) {
    check_size(op, t, name, 0, s.batch, "B");
    check_size(op, t, name, 1, s.seq, "T");
    check_size(op, t, name, 2, kSlots, "the 4 compose slots");
    check_size(op, t, name, 3, kRank, "the rank R = 2");
    check_size(op, t, name, 4, s.heads, "H");
  }
  check_size(op, g, "weights.g", 0, s.batch, "B");
  check_size(op, g, "weights.g", 1, s.seq, "T");
  check_size(op, g, "weights.g", 2, kSlots, "the 4 compose slots");
  check_size(op, g, "weights.g", 3, s.heads, "H");
  for (const auto& [t, name] :
       {std::pair<const at::Tensor&, const char*>{w1, "weights.w1"}, {w2, "weights.w2"}, {g, "weights.g"}}) {
    check_same_dtype(op, t, name, ref, ref_name);
    check_same_device(op, t, name, ref, ref_name);
  }
}

inline void check_groups(const char* op, int64_t heads, int64_t head_groups) {
  TORCH_CHECK_VALUE(head_groups >= 1 && heads % head_groups == 0, "headwise.", op,
                    ": head_groups must be a positive divisor of the number of heads H = ", heads, ", got ",
                    head_groups);
}

inline Shape check_compose_args(const at::Tensor& a, const at::Tensor& w1, const at::Tensor& w2,
                                const at::Tensor& g, int64_t slot, int64_t head_groups) {
  constexpr const char* op = "dcmha_compose";
  check_dim(op, a, "a", 4);
  check_float_dtype(op, a, "a");
  TORCH_CHECK_VALUE(a.size(2) == a.size(3), "headwise.dcmha_compose: a must be [B, H, T, S] with S = T ",
                    "(key-side weights are indexed by the key position), got shape ", shape_str(a));
  TORCH_CHECK_VALUE(slot == 0 || slot == 1, "headwise.dcmha_compose: slot must be 0 (pre) or 1 (post), got ", slot);
  const Shape s{a.size(0), a.size(1), a.size(2), head_groups};
  check_groups(op, s.heads, head_groups);
  check_weights(op, w1, w2, g, a, "a", s);
  return s;
}

struct AttnShape {
  int64_t batch, heads, seq, head_dim, v_dim, head_groups;
};

inline AttnShape check_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& g,
                                      int64_t window, int64_t head_groups) {
  constexpr const char* op = "dcmha_attention";
  check_dim(op, q, "q", 4);
  check_dim(op, k, "k", 4);
  check_dim(op, v, "v", 4);
  check_float_dtype(op, q, "q");
  check_same_dtype(op, k, "k", q, "q");
  check_same_dtype(op, v, "v", q, "q");
  check_same_device(op, k, "k", q, "q");
  check_same_device(op, v, "v", q, "q");
  const AttnShape s{q.size(0), q.size(1), q.size(2), q.size(3), v.size(3), head_groups};
  TORCH_CHECK_VALUE(k.sizes() == q.sizes(), "headwise.dcmha_attention: k must have the shape of q ",
                    shape_str(q), " (self-attention, one head per q head), got ", shape_str(k));
  check_size(op, v, "v", 0, s.batch, "B of q");
  check_size(op, v, "v", 1, s.heads, "H of q");
  check_size(op, v, "v", 2, s.seq, "T of q");
  TORCH_CHECK_VALUE(s.head_dim > 0 && s.v_dim > 0, "headwise.dcmha_attention: q and v need a non-empty head dim");
  TORCH_CHECK_VALUE(window >= 0, "headwise.dcmha_attention: window must be None or at least 1, got ", window);
  check_groups(op, s.heads, head_groups);
  check_weights(op, w1, w2, g, q, "q", Shape{s.batch, s.heads, s.seq, head_groups});
  return s;
}

}  // namespace dcmha
}  // namespace headwise
