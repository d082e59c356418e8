// CPU kernels of MHAR routing (math: mhar_kernel.cuh). Positions run in parallel with
// at::parallel_for; within a position the loops run over the contiguous d axis so that
// the compiler vectorizes them, and the hot functions are compiled for AVX-512, AVX2
// and baseline x86-64 with runtime selection (target_clones).
//
// Forward, per position: pass 1 reads the N rows and forms r_n and the logits; the softmax
// over sources is exact (max first, no rescaling); pass 2 re-reads the rows from cache and
// forms the weighted sum with the sources innermost, its sums in registers.
// Backward, per position: pass 1 forms r_n, a[n,h] = <dout_h, s_n[h]> and S_h (and the
// gate's gradient sum_h S_h); pass 2 re-reads each row (from cache) and emits ds_n and
// z += dl u_n (dq = g z, dg = q z), with dout scaled by the gate. z and the gate sum are
// summed per fixed chunk of kChunk positions and then over chunks in order, so the result
// does not depend on the number of threads.
#include "../common/cpu_convert.h"
#include "../common/cpu_simd.h"
#include "../common/op_range.h"
#include "../common/outputs.h"
#include "mhar_args.h"
#include "mhar_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace headwise {
namespace mhar {
namespace {

constexpr int64_t kChunk = 16;  // positions per z partial in the backward

// Helpers are force-inlined (HW_CPU_INLINE) into the multi-versioned entries below, so
// that each clone compiles them for its own instruction set.
using cpu::sums;

// The row src[0, n) in the accumulation type: src itself when T is A, else widened into
// scratch.
template <typename T, typename A>
HW_CPU_INLINE const A* as_acc(const T* __restrict src, A* __restrict scratch, int64_t n) {
  if constexpr (std::is_same_v<T, A>) {
    return src;
  } else {
    for (int64_t j = 0; j < n; ++j) scratch[j] = static_cast<A>(src[j]);
    return scratch;
  }
}

// Everything a chunk of positions needs; pointers are typed by the caller's T and A.
struct Call {
  const void* sources;
  int64_t sn, sb, st;
  const void* query;
  const void* norm_weight;
  const void* residual;
  int64_t rb, rt;
  const void* grad_out;
  double gate;     // out = residual + gate * mix (1 without a gate)
  void* out;       // forward: out [B, T, d]; backward: grad_sources [N_max, B, T, d]
  bool accumulate;  // backward: add to grad_sources instead of storing
  void* weights;   // [N, B, T, H] in A
  void* partial;   // backward: z partials [chunks, d] in A
  void* gate_partial;  // backward: sum_h S_h partials [chunks] in A
  int64_t seq, positions, d, heads, head_dim, num_sources;
  double eps;
};

// Prefetches the n elements at p into L2 (prefetcht1): the rows kPrefetchAhead positions
// on. The rows of one position lie N_max apart in memory, more streams than the hardware
// prefetcher follows (and a 4 KiB row is a page, where it stops), and the kernels are bound
// by these reads. Into L2, not L1: the second pass re-reads the current position's N
// rows (36 KiB at N = 9, d = 1024, fp32) from L1 and L2, and prefetches into L1 evicted
// them (on the 2-core AMD EPYC test VM, the forward at T = 512 took 3.9-4.6 ms on one
// thread with prefetcht0 one position ahead and 3.1-3.2 ms with this; bench/RESULTS.md,
// 2026-12-08).
constexpr int64_t kPrefetchAhead = 2;
template <typename T>
HW_CPU_INLINE void prefetch_row(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(bytes + off, 0, 2);
}

// The position whose rows are prefetched while pos is processed (pos itself near p1).
HW_CPU_INLINE int64_t position_ahead(int64_t pos, int64_t p1) {
  return pos + kPrefetchAhead < p1 ? pos + kPrefetchAhead : pos;
}

// Row 0 of position pos in the sources; row n lies n * c.sn further.
template <typename T>
HW_CPU_INLINE const T* position_rows(const Call& c, int64_t pos) {
  return static_cast<const T*>(c.sources) + (pos / c.seq) * c.sb + (pos % c.seq) * c.st;
}

// out[k] = T(gate * sum_{j < N} w[j] rows[j][o + k] (+ res[k])) for k < n, the sum over
// sources in order j, innermost: each block of 4 vectors stays in registers (AVX-512)
// across the N rows (re-read from cache), where an accumulator in memory would be loaded
// and stored once per row.
template <typename T, typename A>
HW_CPU_INLINE void weighted_sum_store(const A* const* rows, int64_t o, const A* w, int64_t N, A gate,
                                      const T* __restrict res, T* __restrict out, int64_t n) {
  using V = cpu::vec_t<A>;
  constexpr int L = cpu::Simd<A>::lanes;
  constexpr int W = 4;  // vectors per block
  int64_t k = 0;
  const auto store = [&](const A* sum, int64_t k0, int64_t count) {
    if (res == nullptr) {
      for (int64_t i = 0; i < count; ++i) out[k0 + i] = cpu::to_storage<T>(sum[i] * gate);
    } else {
      for (int64_t i = 0; i < count; ++i)
        out[k0 + i] = cpu::to_storage<T>(sum[i] * gate + static_cast<A>(res[k0 + i]));
    }
  };
  for (; k + W * L <= n; k += W * L) {
    V acc[W];
    for (V& a : acc) a = cpu::vzero<A>();
    for (int64_t j = 0; j < N; ++j) {
      const A* x = rows[j] + o + k;
      for (int i = 0; i < W; ++i) acc[i] += w[j] * cpu::vload(x + i * L);
    }
    A sum[W * L];
    std::memcpy(sum, acc, sizeof(sum));
    store(sum, k, W * L);
  }
  for (; k + L <= n; k += L) {
    V acc = cpu::vzero<A>();
    for (int64_t j = 0; j < N; ++j) acc += w[j] * cpu::vload(rows[j] + o + k);
    A sum[L];
    std::memcpy(sum, &acc, sizeof(sum));
    store(sum, k, L);
  }
  for (; k < n; ++k) {
    A sum = 0;
    for (int64_t j = 0; j < N; ++j) sum += w[j] * rows[j][o + k];
    store(&sum, k, 1);
  }
}

// One head's slice of pass 2 of the backward (see the file comment of mhar_kernel.cuh):
//   ds[k] = w dout[k] + r dl q[k] g[k] - r^3 c x[k] / d,   z[k] += dl u[k]
// (dq = g z and dg = q z once z is summed over sources and positions).
// ds has dtype G (T, or A for a DepthBuffer's accumulator); with `accumulate` the
// gradient is added to what ds holds.
template <typename T, typename A, typename G>
HW_CPU_INLINE void emit_source_grad(const A* __restrict x, const A* __restrict dout, const A* __restrict qg,
                                    A r, A wv, A dl, A r3c, bool accumulate, G* __restrict ds,
                                    A* __restrict z, int64_t n) {
  if (accumulate) {
    for (int64_t k = 0; k < n; ++k)
      ds[k] = cpu::to_storage<G>(static_cast<A>(ds[k]) + (wv * dout[k] + r * dl * qg[k] - r3c * x[k]));
  } else {
    for (int64_t k = 0; k < n; ++k) ds[k] = cpu::to_storage<G>(wv * dout[k] + r * dl * qg[k] - r3c * x[k]);
  }
  for (int64_t k = 0; k < n; ++k) z[k] += dl * cpu::round_to<T>(x[k] * r);
}

template <typename T, typename A>
HW_CPU_INLINE void forward_positions(const Call& c, int64_t p0, int64_t p1) {
  const int64_t d = c.d, H = c.heads, K = c.head_dim, N = c.num_sources;
  const A* q = static_cast<const A*>(c.query);
  const A* g = static_cast<const A*>(c.norm_weight);
  const A inv_d = A(1) / static_cast<A>(d);
  const A gate = static_cast<A>(c.gate);
  A* w = static_cast<A*>(c.weights);
  constexpr bool widen = !std::is_same_v<T, A>;
  // gq = g q (T == A: fp32, fp64); logit [N, H]; wh [N]: one head's weights; the rows
  // widened to A (narrow dtypes) for the second pass.
  std::vector<A> buf(d + N * H + N + (widen ? N * d : 0));
  A* gq = buf.data();
  A* logit = gq + d;
  A* wh = logit + N * H;
  A* widened = wh + N;
  std::vector<const A*> rows(N);
  for (int64_t j = 0; j < d; ++j) gq[j] = g[j] * q[j];
  for (int64_t pos = p0; pos < p1; ++pos) {
    const int64_t b = pos / c.seq, t = pos % c.seq;
    const T* src = position_rows<T>(c, pos);
    const T* src_next = position_rows<T>(c, position_ahead(pos, p1));
    for (int64_t n = 0; n < N; ++n) {  // pass 1: r_n and the logits l[n, h]
      const A* x = as_acc(src + n * c.sn, widened + (widen ? n * d : 0), d);
      rows[n] = x;
      prefetch_row(src_next + n * c.sn, d);
      A* l = logit + n * H;
      if constexpr (!widen) {
        // No storage rounding: l_h = r <x_h, g_h q_h>, formed in the same pass as the RMS.
        A sumsq = 0;
        for (int64_t h = 0; h < H; ++h) {
          const A* xh = x + h * K;
          const A* gqh = gq + h * K;
          A v[2];
          sums<2>(K, [&](auto ld, auto& t) {
            const auto xv = ld(xh);
            t[0] = xv * xv;
            t[1] = xv * ld(gqh);
          }, v);
          sumsq += v[0];
          l[h] = v[1];
        }
        const A r = A(1) / std::sqrt(sumsq * inv_d + static_cast<A>(c.eps));
        for (int64_t h = 0; h < H; ++h) l[h] *= r;
      } else {
        // The key is rounded to T after scaling by r: l_h = <round_T(x_h r) g_h, q_h>.
        A v[1];
        sums<1>(d, [&](auto ld, auto& t) { t[0] = ld(x) * ld(x); }, v);
        const A r = A(1) / std::sqrt(v[0] * inv_d + static_cast<A>(c.eps));
        for (int64_t h = 0; h < H; ++h) {
          const A* xh = x + h * K;
          const A* gh = g + h * K;
          const A* qh = q + h * K;
          sums<1>(K, [&](auto ld, auto& t) { t[0] = cpu::round_to<T>(ld(xh) * r) * ld(gh) * ld(qh); }, v);
          l[h] = v[0];
        }
      }
    }
    // Per head: w_n = exp(l_n - m) / sum_j exp(l_j - m), m = max_n l_n (a NaN logit makes
    // every weight of its head NaN), then pass 2 mixes the head's slice of the rows.
    T* out = static_cast<T*>(c.out) + pos * d;
    const T* res = c.residual == nullptr ? nullptr : static_cast<const T*>(c.residual) + b * c.rb + t * c.rt;
    for (int64_t h = 0; h < H; ++h) {
      A m = logit[h];
      for (int64_t n = 1; n < N; ++n) m = logit[n * H + h] > m ? logit[n * H + h] : m;
      A den = 0;
      for (int64_t n = 0; n < N; ++n) {
        wh[n] = std::exp(logit[n * H + h] - m);
        den += wh[n];
      }
      const A inv = A(1) / den;
      for (int64_t n = 0; n < N; ++n) {
        wh[n] *= inv;
        w[(n * c.positions + pos) * H + h] = wh[n];
      }
      weighted_sum_store(rows.data(), h * K, wh, N, gate, res == nullptr ? nullptr : res + h * K, out + h * K, K);
    }
  }
}

// Backward of the positions of one chunk; leaves z = sum_{n,pos} dl[n,h] u_n in the
// chunk's row of c.partial.
template <typename T, typename A, typename G>
HW_CPU_INLINE void backward_chunk(const Call& c, int64_t chunk) {
  const int64_t d = c.d, H = c.heads, K = c.head_dim, N = c.num_sources;
  const A* q = static_cast<const A*>(c.query);
  const A* g = static_cast<const A*>(c.norm_weight);
  const A* w = static_cast<const A*>(c.weights);
  A* z = static_cast<A*>(c.partial) + chunk * d;
  std::fill(z, z + d, A(0));
  const A gate = static_cast<A>(c.gate);
  A gate_sum = 0;  // sum over the chunk's positions and heads of S_h (unscaled dout)
  std::vector<A> buf(3 * d + 3 * N * H + N + H);
  A* xbuf = buf.data();
  A* doutbuf = xbuf + d;
  A* qg = doutbuf + d;
  A* dot_a = qg + d;        // a[n, h] = <dout_h, s_n[h]>
  A* dot_b = dot_a + N * H;  // b[n, h] = <(q g)_h, s_n[h]>
  A* dl = dot_b + N * H;     // dl[n, h]
  A* rn = dl + N * H;
  A* coupling = rn + N;      // S_h
  for (int64_t j = 0; j < d; ++j) qg[j] = q[j] * g[j];
  const A inv_d = A(1) / static_cast<A>(d);
  const int64_t p1 = std::min(c.positions, (chunk + 1) * kChunk);
  for (int64_t pos = chunk * kChunk; pos < p1; ++pos) {
    const T* src = position_rows<T>(c, pos);
    const A* wpos = w + pos * H;
    const int64_t wstride = c.positions * H;
    const A* dout = as_acc(static_cast<const T*>(c.grad_out) + pos * d, doutbuf, d);
    std::fill(coupling, coupling + H, A(0));
    const int64_t ahead = position_ahead(pos, p1);
    const T* src_next = position_rows<T>(c, ahead);
    prefetch_row(static_cast<const T*>(c.grad_out) + ahead * d, d);
    for (int64_t n = 0; n < N; ++n) {  // pass 1: r_n, a[n, h], b[n, h], S_h in one read
      const A* x = as_acc(src + n * c.sn, xbuf, d);
      prefetch_row(src_next + n * c.sn, d);
      A sumsq = 0;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t o = h * K;
        A v[3];
        sums<3>(K, [&](auto ld, auto& t) {
          const auto xv = ld(x + o);
          t[0] = xv * xv;
          t[1] = ld(dout + o) * xv;
          t[2] = ld(qg + o) * xv;
        }, v);
        sumsq += v[0];
        dot_a[n * H + h] = v[1];
        dot_b[n * H + h] = v[2];
        coupling[h] += wpos[n * wstride + h] * v[1];
      }
      rn[n] = A(1) / std::sqrt(sumsq * inv_d + static_cast<A>(c.eps));
    }
    for (int64_t h = 0; h < H; ++h) gate_sum += coupling[h];
    for (int64_t n = 0; n < N; ++n) {  // pass 2: emit ds_n, accumulate z
      const A* x = as_acc(src + n * c.sn, xbuf, d);
      const A r = rn[n];
      A cn = 0;  // c_n = <du_n, s_n> = sum_h dl[n,h] b[n,h]
      for (int64_t h = 0; h < H; ++h) {
        dl[n * H + h] = wpos[n * wstride + h] * (dot_a[n * H + h] - coupling[h]) * gate;
        cn += dl[n * H + h] * dot_b[n * H + h];
      }
      const A r3c = r * r * r * cn * inv_d;
      G* ds = static_cast<G*>(c.out) + (n * c.positions + pos) * d;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t o = h * K;
        emit_source_grad<T>(x + o, dout + o, qg + o, r, wpos[n * wstride + h] * gate, dl[n * H + h], r3c,
                            c.accumulate, ds + o, z + o, K);
      }
    }
  }
  static_cast<A*>(c.gate_partial)[chunk] = gate_sum;
}

// Non-template, multi-versioned entries: one forward and one backward per dtype.
// backward_*: gradients in the sources' dtype; backward_into_*: into an A-typed buffer.
#define HW_MHAR_CPU_ENTRIES(T, A, suffix)                                           \
  HW_CPU_CLONES void forward_##suffix(const Call& c, int64_t p0, int64_t p1) {      \
    forward_positions<T, A>(c, p0, p1);                                             \
  }                                                                                 \
  HW_CPU_CLONES void backward_##suffix(const Call& c, int64_t chunk) {              \
    backward_chunk<T, A, T>(c, chunk);                                              \
  }                                                                                 \
  HW_CPU_CLONES void backward_into_##suffix(const Call& c, int64_t chunk) {         \
    backward_chunk<T, A, A>(c, chunk);                                              \
  }
HW_MHAR_CPU_ENTRIES(float, float, f32)
HW_MHAR_CPU_ENTRIES(double, double, f64)
HW_MHAR_CPU_ENTRIES(c10::BFloat16, float, bf16)
HW_MHAR_CPU_ENTRIES(c10::Half, float, f16)
#undef HW_MHAR_CPU_ENTRIES

using ForwardFn = void (*)(const Call&, int64_t, int64_t);
using BackwardFn = void (*)(const Call&, int64_t);

struct Kernels {
  ForwardFn forward;
  BackwardFn backward, backward_into;
};

Kernels kernels_for(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return {forward_f32, backward_f32, backward_into_f32};
    case at::kDouble: return {forward_f64, backward_f64, backward_into_f64};
    case at::kBFloat16: return {forward_bf16, backward_bf16, backward_into_bf16};
    case at::kHalf: return {forward_f16, backward_f16, backward_into_f16};
    default: TORCH_CHECK_TYPE(false, "headwise.mhar_route: unsupported sources dtype ", dtype);
  }
}

// The fields of a Call that forward and backward share; q, g in the accumulation dtype.
Call make_call(const at::Tensor& sources, const at::Tensor& q, const at::Tensor& g, const Shape& s,
               double eps) {
  Call c{};
  c.sources = sources.data_ptr();
  c.sn = sources.stride(0);
  c.sb = sources.stride(1);
  c.st = sources.stride(2);
  c.query = q.data_ptr();
  c.norm_weight = g.data_ptr();
  c.seq = s.seq;
  c.positions = s.positions();
  c.d = s.d;
  c.heads = s.heads;
  c.head_dim = s.head_dim;
  c.num_sources = s.num_sources;
  c.eps = eps;
  return c;
}

// The gate's value (1 without a gate), as the kernels' double parameter.
double gate_value(const c10::optional<at::Tensor>& gate) {
  return gate.has_value() ? gate->to(at::kDouble).item<double>() : 1.0;
}

void check_cpu(const at::Tensor& sources, const char* op) {
  TORCH_CHECK(sources.device().is_cpu(), "headwise.", op, ": sources is on ", sources.device(),
              " but the CPU backend takes CPU tensors");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> route_cpu(const at::Tensor& sources, const at::Tensor& query,
                                             const at::Tensor& norm_weight, int64_t num_heads,
                                             int64_t num_sources, double eps,
                                             const c10::optional<at::Tensor>& residual,
                                             const c10::optional<at::Tensor>& gate) {
  HW_OP_RANGE("headwise::mhar_route");
  const Shape s = check_route_args(sources, query, norm_weight, num_heads, num_sources, eps);
  check_cpu(sources, "mhar_route");
  if (residual.has_value()) check_residual(*residual, sources, s);
  if (gate.has_value()) check_gate("mhar_route", *gate, sources);
  const at::ScalarType acc = weights_dtype(sources);
  const at::Tensor q = query.to(acc).contiguous();
  const at::Tensor g = norm_weight.to(acc).contiguous();
  at::Tensor out = new_output({s.batch, s.seq, s.d}, sources.options());
  at::Tensor weights = new_output({s.num_sources, s.batch, s.seq, s.heads}, sources.options().dtype(acc));

  Call c = make_call(sources, q, g, s, eps);
  c.residual = residual.has_value() ? residual->data_ptr() : nullptr;
  c.rb = residual.has_value() ? residual->stride(0) : 0;
  c.rt = residual.has_value() ? residual->stride(1) : 0;
  c.gate = gate_value(gate);
  c.out = out.data_ptr();
  c.weights = weights.data_ptr();
  const ForwardFn forward = kernels_for(sources.scalar_type()).forward;
  const int64_t grain = std::max<int64_t>(1, 32768 / (s.d * s.num_sources));
  at::parallel_for(0, s.positions(), grain, [&](int64_t p0, int64_t p1) { forward(c, p0, p1); });
  return {out, weights};
}

namespace {

// Runs the backward chunks into grad_sources (contiguous [N_max, B, T, d]) with `backward`
// and returns (grad_query, grad_norm_weight, grad_gate as a 0-dim tensor in the weights'
// dtype).
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_into(
    const at::Tensor& grad_out, const at::Tensor& sources, const at::Tensor& query,
    const at::Tensor& norm_weight, const at::Tensor& weights, double gate, const Shape& s, double eps,
    at::Tensor& grad_sources, bool accumulate, BackwardFn backward) {
  const at::ScalarType acc = weights_dtype(sources);
  const at::Tensor dout = grad_out.contiguous();
  const at::Tensor w = weights.contiguous();
  const at::Tensor q = query.to(acc).contiguous();
  const at::Tensor g = norm_weight.to(acc).contiguous();
  const int64_t chunks = (s.positions() + kChunk - 1) / kChunk;
  at::Tensor partial = new_output({chunks, s.d}, sources.options().dtype(acc));
  at::Tensor gate_partial = new_output({chunks}, sources.options().dtype(acc));

  Call c = make_call(sources, q, g, s, eps);
  c.grad_out = dout.data_ptr();
  c.out = grad_sources.data_ptr();
  c.accumulate = accumulate;
  c.gate = gate;
  c.weights = w.data_ptr();
  c.partial = partial.data_ptr();
  c.gate_partial = gate_partial.data_ptr();
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t chunk = c0; chunk < c1; ++chunk) backward(c, chunk);
  });
  // Second stage: z and the gate sum over the chunk partials in chunk order (an order that
  // does not depend on the thread count); dq = g z, dg = q z.
  at::Tensor z = at::zeros({s.d}, partial.options());
  at::Tensor grad_gate = at::zeros({}, partial.options());
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    z.add_(partial[chunk]);
    grad_gate.add_(gate_partial[chunk]);
  }
  return {(z * g).to(query.scalar_type()), (z * q).to(norm_weight.scalar_type()), grad_gate};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& sources, const at::Tensor& query,
    const at::Tensor& norm_weight, const at::Tensor& weights, const c10::optional<at::Tensor>& gate,
    int64_t num_heads, int64_t num_sources, double eps) {
  HW_OP_RANGE("headwise::mhar_route_backward");
  const Shape s = check_route_args(sources, query, norm_weight, num_heads, num_sources, eps);
  check_cpu(sources, "mhar_route_backward");
  check_backward_args(grad_out, sources, weights, s);
  if (gate.has_value()) check_gate("mhar_route_backward", *gate, sources);
  at::Tensor grad_sources = new_output(sources.sizes(), sources.options());
  if (s.num_sources < s.max_sources)
    grad_sources.narrow(0, s.num_sources, s.max_sources - s.num_sources).zero_();
  auto [grad_query, grad_norm, grad_gate] =
      backward_into(grad_out, sources, query, norm_weight, weights, gate_value(gate), s, eps, grad_sources,
                    false, kernels_for(sources.scalar_type()).backward);
  if (gate.has_value()) grad_gate = grad_gate.to(gate->scalar_type()).reshape(gate->sizes());
  return {grad_sources, grad_query, grad_norm, grad_gate};
}

std::tuple<at::Tensor, at::Tensor> route_backward_into_cpu(
    const at::Tensor& grad_out, const at::Tensor& sources, const at::Tensor& query,
    const at::Tensor& norm_weight, const at::Tensor& weights, at::Tensor& grad_sources,
    int64_t num_heads, int64_t num_sources, double eps, bool accumulate) {
  HW_OP_RANGE("headwise::mhar_route_backward_into");
  const Shape s = check_route_args(sources, query, norm_weight, num_heads, num_sources, eps);
  check_cpu(sources, "mhar_route_backward_into");
  check_backward_args(grad_out, sources, weights, s);
  check_grad_buffer(grad_sources, sources, weights_dtype(sources));
  const auto grads = backward_into(grad_out, sources, query, norm_weight, weights, 1.0, s, eps, grad_sources,
                                   accumulate, kernels_for(sources.scalar_type()).backward_into);
  return {std::get<0>(grads), std::get<1>(grads)};
}

}  // namespace mhar
}  // namespace headwise
