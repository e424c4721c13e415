// CPU kernels for fxc::rms_norm, fxc::silu_mul and fxc::rope (fp32 vectorised; bf16 silu_mul and
// rope vectorised with AVX-512, op for op like ATen; other dtypes via fp32/fp64 math or ATen).
// ATen's headers only (not torch/extension.h, whose pybind11 and torch API headers tripled the build time);
// the Python bindings live in paged_attention.cpp.
#include <ATen/Dispatch.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
namespace torch {
using namespace at;  // the torch:: names below (Tensor, empty, kLong, ...) are ATen's
}  // namespace torch
#include <ATen/Parallel.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <type_traits>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "bf16_simd.h"  // bf16 loads/stores/rounding and the bf16 silu step, shared with the linear epilogues
#include "simd_math.h"

// The float vector width of ATen's sum kernel (8 or 16), found by the loader by comparison with
// ATen; 0 = unknown: the bf16 rms_norm then lets ATen compute the mean of squares.
int g_aten_sum_lanes = 0;

namespace {

using fxc::Acc;

// fp32/fp64: sum of squares, rsqrt and both multiplies per row in one pass.
// bf16/fp16 (mean_sq given): transformers' RMSNorm op for op: the mean of the fp32 squares
// (bit-equal to ATen's), then rsqrt(var + eps) in fp32, x * inv rounded to the input dtype,
// times the weight, rounded.
template <typename scalar_t>
void rms_rows(const scalar_t* x, const scalar_t* w, scalar_t* y, int64_t rows, int64_t H, double eps,
              const float* mean_sq) {
  using acc_t = typename Acc<scalar_t>::type;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * H;
      scalar_t* yr = y + r * H;
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        acc_t ss = 0;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
        const acc_t inv = acc_t(1) / std::sqrt(ss / static_cast<acc_t>(H) + static_cast<acc_t>(eps));
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) yr[i] = w[i] * (xr[i] * inv);
      } else {
        const float inv = 1.0f / std::sqrt(mean_sq[r] + static_cast<float>(eps));
#pragma omp simd
        for (int64_t i = 0; i < H; ++i)
          yr[i] = static_cast<scalar_t>(static_cast<float>(w[i]) *
                                        static_cast<float>(static_cast<scalar_t>(static_cast<float>(xr[i]) * inv)));
      }
    }
  });
}

// Rows per parallel_for chunk for row-wise elementwise kernels: ~16K elements a chunk.
inline int64_t row_grain(int64_t H) { return std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(H, 1)); }

// Rows of H elements; gate/up rows may be strided (the halves of a fused gate_up projection).
void silu_mul_f32(const float* g0, int64_t gs, const float* u0, int64_t us, float* y0, int64_t rows, int64_t H) {
  at::parallel_for(0, rows, row_grain(H), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const float* g = g0 + r * gs;
      const float* u = u0 + r * us;
      float* y = y0 + r * H;
      int64_t i = 0;
#ifdef __AVX512F__
      for (; i + 16 <= H; i += 16)
        _mm512_storeu_ps(y + i, fxc::silu_mul512(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
#endif
      for (; i < H; ++i) y[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
}

#ifdef __AVX512F__
using fxc::bf16_load;
using fxc::bf16_r;
using fxc::bf16_round;
using fxc::bf16_store;

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// silu(g) * u as ATen computes F.silu(gate) * up on bf16 tensors: silu in fp32 as g / (1 + exp(-g))
// with Sleef's expf (u10, what Vectorized<float>::exp() calls), rounded to bf16; the product of
// the two bf16 values in fp32, rounded to bf16.
void silu_mul_bf16(const c10::BFloat16* g0, int64_t gs, const c10::BFloat16* u0, int64_t us, c10::BFloat16* y0,
                   int64_t rows, int64_t H) {
  at::parallel_for(0, rows, row_grain(H), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const c10::BFloat16* g = g0 + r * gs;
      const c10::BFloat16* u = u0 + r * us;
      c10::BFloat16* y = y0 + r * H;
      auto step = [&](int64_t i, __mmask16 k) {
        bf16_store(y + i, fxc::silu_mul_bf16_512(bf16_load(g + i, k), bf16_load(u + i, k)), k);
      };
      int64_t i = 0;
      for (; i + 16 <= H; i += 16) step(i, static_cast<__mmask16>(0xFFFF));
      if (i < H) step(i, tail_mask(H - i));
    }
  });
}

// rope on bf16 rows (last dim contiguous): out = bf16(bf16(x * c) + bf16(rotate_half(x) * s)).
void rope_row_bf16(const c10::BFloat16* x, const c10::BFloat16* c, const c10::BFloat16* s, c10::BFloat16* o,
                   int64_t h) {
  for (int64_t d = 0; d < h; d += 16) {
    const __mmask16 k = tail_mask(h - d);
    const __m512 x1 = bf16_load(x + d, k), x2 = bf16_load(x + d + h, k);
    const __m512 lo = _mm512_add_ps(bf16_r(_mm512_mul_ps(x1, bf16_load(c + d, k))),
                                    bf16_r(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), bf16_load(s + d, k))));
    const __m512 hi = _mm512_add_ps(bf16_r(_mm512_mul_ps(x2, bf16_load(c + d + h, k))),
                                    bf16_r(_mm512_mul_ps(x1, bf16_load(s + d + h, k))));
    bf16_store(o + d, lo, k);
    bf16_store(o + d + h, hi, k);
  }
}

// The sum of a contiguous fp32 row exactly as ATen's sum kernel computes it (SumKernel.cpp:
// cascade_sum -> vectorized_inner_sum -> row_sum: L-lane vectors, 4 interleaved accumulators, each
// a 4-level cascade; then the vector tail, the accumulators in order, the scalar tail and the
// lanes in order).  L is the float vector width of the ATen build that runs (8 with torch 2.13 on
// AVX-512 machines: the loader finds it by comparing with ATen, see attention.install()).  Plain
// lane-wise adds: with -ffp-contract=off and no fast-math the compiler keeps every rounding.
template <int L>
float aten_row_sum(const float* x, int64_t n) {
  constexpr int kLevels = 4, kIlp = 4;
  const int64_t nvec = n / L, size_ilp = nvec / kIlp;
  const int64_t clog2 = size_ilp <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(size_ilp - 1));
  const int64_t level_power = std::max<int64_t>(4, clog2 / kLevels);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  float acc[kLevels][kIlp][L] = {};
  auto add_row = [&](float* dst, const float* src) {
#pragma omp simd
    for (int l = 0; l < L; ++l) dst[l] += src[l];
  };
  int64_t i = 0;
  while (i + level_step <= size_ilp) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) add_row(acc[0][k], x + (i * kIlp + k) * L);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        add_row(acc[j][k], acc[j - 1][k]);
        std::fill(acc[j - 1][k], acc[j - 1][k] + L, 0.f);
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size_ilp; ++i)
    for (int k = 0; k < kIlp; ++k) add_row(acc[0][k], x + (i * kIlp + k) * L);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k) add_row(acc[0][k], acc[j][k]);
  for (int64_t r = size_ilp * kIlp; r < nvec; ++r) add_row(acc[0][0], x + r * L);
  for (int k = 1; k < kIlp; ++k) add_row(acc[0][0], acc[0][k]);
  float total = 0.f;
  for (int64_t t = nvec * L; t < n; ++t) total += x[t];
  for (int l = 0; l < L; ++l) total += acc[0][0][l];
  return total;
}

float aten_row_sum_lanes(const float* x, int64_t n, int lanes) {
  switch (lanes) {
    case 8: return aten_row_sum<8>(x, n);
    case 16: return aten_row_sum<16>(x, n);
    default: TORCH_CHECK(false, "aten_row_sum: lanes must be 8 or 16, got ", lanes);
  }
}

// bf16 RMSNorm rows as transformers computes them in a bf16 model: var = mean(float(x)^2) with ATen's
// summation order, inv = 1 / sqrt(var + eps) in fp32, y = bf16(w * bf16(x * inv)).
void rms_rows_bf16(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* y, int64_t rows, int64_t H,
                   float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> sq;
    if (static_cast<int64_t>(sq.size()) < H) sq.resize(H);
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* xr = x + r * H;
      c10::BFloat16* yr = y + r * H;
      int64_t i = 0;
      for (; i < H; i += 16) {
        const __mmask16 k = tail_mask(H - i);
        const __m512 v = bf16_load(xr + i, k);
        _mm512_mask_storeu_ps(sq.data() + i, k, _mm512_mul_ps(v, v));
      }
      const float var = aten_row_sum_lanes(sq.data(), H, g_aten_sum_lanes) / static_cast<float>(H);
      const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(var + eps));
      for (i = 0; i < H; i += 16) {
        const __mmask16 k = tail_mask(H - i);
        const __m512 n = bf16_r(_mm512_mul_ps(bf16_load(xr + i, k), inv));
        bf16_store(yr + i, _mm512_mul_ps(bf16_load(w + i, k), n), k);
      }
    }
  });
}

// Greedy pick over fp32 or bf16 logits rows: the first index of the maximum (NaN counts as the maximum, as in
// torch.max) and its log-probability max - logsumexp(row) = -log(sum(exp(x - max))).  bf16 values are widened
// to fp32 exactly on load, so a bf16 row gives the bits its fp32 upcast gives (a bf16 checkpoint run in its own
// dtype returns bf16 logits: no [B, V] fp32 copy before the pick).
inline __m512 load_row16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_row16(const c10::BFloat16* p) { return bf16_load(p, static_cast<__mmask16>(0xFFFF)); }
inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
void greedy_rows(const T* x, int64_t rows, int64_t V, int64_t* tok, float* lp) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * V;
      __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __m512i vidx = _mm512_setzero_si512(), cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      __mmask16 nan = 0;
      const __m512i step = _mm512_set1_epi32(16);
      int64_t i = 0;
      for (; i + 16 <= V; i += 16) {
        const __m512 v = load_row16(xr + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
        vmax = _mm512_mask_mov_ps(vmax, gt, v);
        vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
        cur = _mm512_add_epi32(cur, step);
      }
      alignas(64) float mv[16];
      alignas(64) int32_t mi[16];
      _mm512_store_ps(mv, vmax);
      _mm512_store_si512(mi, vidx);
      float best = -std::numeric_limits<float>::infinity();
      int64_t arg = -1;
      if (i > 0)
        for (int l = 0; l < 16; ++l)
          if (arg < 0 || mv[l] > best || (mv[l] == best && mi[l] < arg)) {
            best = mv[l];
            arg = mi[l];
          }
      for (int64_t t = i; t < V; ++t) {
        const float v = widen(xr[t]);
        if (std::isnan(v)) nan = 1;
        if (arg < 0 || v > best) {
          best = v;
          arg = t;
        }
      }
      if (nan) {
        for (int64_t t = 0; t < V; ++t)
          if (std::isnan(widen(xr[t]))) { arg = t; break; }
        tok[r] = arg;
        lp[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      tok[r] = arg;
      if (best == -std::numeric_limits<float>::infinity() || best == std::numeric_limits<float>::infinity()) {
        lp[r] = std::numeric_limits<float>::quiet_NaN();  // as max - logsumexp: -inf - (-inf), inf - inf
        continue;
      }
      const __m512 vm = _mm512_set1_ps(best);
      __m512 vs = _mm512_setzero_ps();
      for (i = 0; i + 16 <= V; i += 16) vs = _mm512_add_ps(vs, fxc::exp512(_mm512_sub_ps(load_row16(xr + i), vm)));
      double s = _mm512_reduce_add_ps(vs);
      for (; i < V; ++i) s += std::exp(static_cast<double>(widen(xr[i])) - best);
      lp[r] = static_cast<float>(-std::log(s));
    }
  });
}
#endif

}  // namespace

torch::Tensor fxc_rms_norm_cpu(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.size(-1) == weight.numel(), "fxc::rms_norm: weight size must equal the last dim of x");
  auto xc = x.contiguous();
  auto wc = weight.to(x.scalar_type()).contiguous();
  auto y = torch::empty_like(xc);
  const int64_t H = x.size(-1), rows = H ? xc.numel() / H : 0;
#ifdef __AVX512F__
  // ATen sums a row in the order reproduced here when the row is not split between threads
  // (numel below its grain size, or at least one row per thread) and holds a whole vector.
  if (x.scalar_type() == at::kBFloat16 && g_aten_sum_lanes && H >= g_aten_sum_lanes &&
      (rows * H < 32768 || rows >= at::get_num_threads())) {
    rms_rows_bf16(xc.data_ptr<c10::BFloat16>(), wc.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows, H,
                  static_cast<float>(eps));
    return y;
  }
#endif
  torch::Tensor mean_sq;  // reduced precision: [rows] fp32 mean of squares, reduced by ATen
  if (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf)
    mean_sq = xc.view({rows, H}).to(at::kFloat).square().mean(-1).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fxc_rms_norm", [&] {
    rms_rows<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, H, eps,
                       mean_sq.defined() ? mean_sq.data_ptr<float>() : nullptr);
  });
  return y;
}

// [R, H] views of gate/up with unit stride along H (no copy for the halves of a fused projection).
static torch::Tensor rows_view(const torch::Tensor& t) {
  const int64_t H = t.dim() ? t.size(-1) : 1;
  auto r = t.reshape({-1, H});
  return r.stride(1) == 1 ? r : r.contiguous();
}

torch::Tensor fxc_silu_mul_cpu(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.sizes() == up.sizes(), "fxc::silu_mul: gate and up must have the same shape");
  const bool bf16 = gate.scalar_type() == at::kBFloat16 && up.scalar_type() == at::kBFloat16;
  const bool f32 = gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat;
#ifndef __AVX512F__
  if (bf16) return torch::silu(gate) * up;
#endif
  if (!bf16 && !f32) return torch::silu(gate) * up;
  if (gate.numel() == 0) return torch::empty(gate.sizes(), gate.options());
  auto g = rows_view(gate), u = rows_view(up);
  const int64_t R = g.size(0), H = g.size(1);
  auto y = torch::empty(gate.sizes(), gate.options());
#ifdef __AVX512F__
  if (bf16) {
    silu_mul_bf16(g.data_ptr<c10::BFloat16>(), g.stride(0), u.data_ptr<c10::BFloat16>(), u.stride(0),
                  y.data_ptr<c10::BFloat16>(), R, H);
    return y;
  }
#endif
  silu_mul_f32(g.data_ptr<float>(), g.stride(0), u.data_ptr<float>(), u.stride(0), y.data_ptr<float>(), R, H);
  return y;
}

// Strides of t broadcast to the 4-d shape of x (0 along broadcast dims): what expand_as(x).strides() gives,
// without two dispatcher calls per rope call (~2 us each at decode sizes).
static std::array<int64_t, 4> broadcast_strides(const torch::Tensor& t, const torch::Tensor& x, const char* name) {
  TORCH_CHECK(t.dim() <= 4, "fxc::rope: ", name, " has more dims than x");
  std::array<int64_t, 4> st{0, 0, 0, 0};
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t xd = 4 - t.dim() + d;
    TORCH_CHECK(t.size(d) == x.size(xd) || t.size(d) == 1, "fxc::rope: ", name, " of shape ", t.sizes(),
                " does not broadcast to x of shape ", x.sizes());
    st[xd] = t.size(d) == 1 && x.size(xd) != 1 ? 0 : t.stride(d);
  }
  return st;
}

// fxc::rope: out = x * cos + rotate_half(x) * sin over the last dim (x any strides; cos/sin broadcast).
// Compiled without FMA contraction so results equal the ATen reference bit for bit.
torch::Tensor fxc_rope_cpu(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && x.size(-1) % 2 == 0, "fxc::rope: x must be [B, H, S, D] with even D");
#ifdef __AVX512F__
  if (x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
      sin.scalar_type() == at::kBFloat16) {
    const auto cs = broadcast_strides(cos, x, "cos"), ss = broadcast_strides(sin, x, "sin");
    if (x.stride(3) == 1 && cs[3] == 1 && ss[3] == 1) {
      auto out = torch::empty(x.sizes(), x.options());
      const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3);
      const auto* xp = x.data_ptr<c10::BFloat16>();
      const auto* cp = cos.data_ptr<c10::BFloat16>();
      const auto* sp = sin.data_ptr<c10::BFloat16>();
      auto* o = out.data_ptr<c10::BFloat16>();
      const auto xs = x.strides();
      at::parallel_for(0, B * H * S, 256, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t b = i / (H * S), hh = (i / S) % H, t = i % S;
          rope_row_bf16(xp + b * xs[0] + hh * xs[1] + t * xs[2], cp + b * cs[0] + hh * cs[1] + t * cs[2],
                        sp + b * ss[0] + hh * ss[1] + t * ss[2], o + i * D, D / 2);
        }
      });
      return out;
    }
  }
#endif
  if (x.scalar_type() != at::kFloat || cos.scalar_type() != at::kFloat || sin.scalar_type() != at::kFloat) {
    const int64_t h = x.size(-1) / 2;
    return x * cos + torch::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1) * sin;
  }
  const auto cs = broadcast_strides(cos, x, "cos"), ss = broadcast_strides(sin, x, "sin");
  const auto xs = x.strides();
  auto out = torch::empty(x.sizes(), x.options());
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3), h = D / 2;
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, B * H * S, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (H * S), hh = (i / S) % H, t = i % S;
      const float* xr = xp + b * xs[0] + hh * xs[1] + t * xs[2];
      const float* cr = cp + b * cs[0] + hh * cs[1] + t * cs[2];
      const float* sr = sp + b * ss[0] + hh * ss[1] + t * ss[2];
      auto X = [&](int64_t d) { return xr[d * xs[3]]; };
      float* dst = o + i * D;
      for (int64_t d = 0; d < h; ++d) {
        const float p = X(d) * cr[d * cs[3]];
        const float q = -X(d + h) * sr[d * ss[3]];
        dst[d] = p + q;
      }
      for (int64_t d = h; d < D; ++d) {
        const float p = X(d) * cr[d * cs[3]];
        const float q = X(d - h) * sr[d * ss[3]];
        dst[d] = p + q;
      }
    }
  });
  return out;
}

// fxc::greedy_logprob: (argmax, log-probability of it) per row of [B, V] logits.
std::tuple<torch::Tensor, torch::Tensor> fxc_greedy_logprob_cpu(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2, "fxc::greedy_logprob: logits must be [B, V], got ", logits.sizes());
#ifdef __AVX512F__
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  if ((logits.scalar_type() == at::kFloat || bf16) && logits.size(1) > 0) {
    auto x = logits.contiguous();
    const int64_t B = x.size(0), V = x.size(1);
    auto tok = torch::empty({B}, x.options().dtype(at::kLong));
    auto lp = torch::empty({B}, x.options().dtype(at::kFloat));
    if (bf16)
      greedy_rows(x.data_ptr<c10::BFloat16>(), B, V, tok.data_ptr<int64_t>(), lp.data_ptr<float>());
    else
      greedy_rows(x.data_ptr<float>(), B, V, tok.data_ptr<int64_t>(), lp.data_ptr<float>());
    return {tok, lp};
  }
#endif
  auto x = logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble ? logits : logits.to(at::kFloat);
  auto [vals, idx] = x.max(-1);
  return {idx, vals - x.logsumexp(-1)};
}

// fxc::apply_token_bitmask: a copy of fp32 logits [B, V] in which row rows[j] keeps the tokens whose bit is set in
// bitmask[j] (bit t % 32 of int32 word t / 32) and holds -inf elsewhere: masked_fill's result, in one pass per row
// (the ATen reference unpacks the bits into a [R, V] bool tensor first).
torch::Tensor fxc_apply_token_bitmask_cpu(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2, "fxc::apply_token_bitmask: logits must be [B, V], got ", logits.sizes());
  const int64_t B = logits.size(0), V = logits.size(1), W = (V + 31) / 32;
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.size(1) == W,
              "fxc::apply_token_bitmask: bitmask must be int32 [R, ", W, "] for V=", V, ", got ", bitmask.sizes());
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "fxc::apply_token_bitmask: rows must be int64 [", bitmask.size(0), "], got ", rows.sizes());
  auto x = logits.contiguous();
  auto m = bitmask.contiguous();
  auto r = rows.contiguous();
  auto out = at::empty_like(x);
  const int32_t* mp = m.data_ptr<int32_t>();
  const int64_t* rp = r.data_ptr<int64_t>();
  std::vector<int64_t> mask_of(B, -1);  // bitmask row of each logits row, -1: a plain copy
  for (int64_t j = 0; j < r.size(0); ++j) {
    TORCH_CHECK(rp[j] >= 0 && rp[j] < B, "fxc::apply_token_bitmask: rows[", j, "]=", rp[j], " is outside [0, ", B, ")");
    mask_of[rp[j]] = j;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fxc::apply_token_bitmask", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t neg_inf = -std::numeric_limits<scalar_t>::infinity();
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const scalar_t* xr = xp + b * V;
        scalar_t* orow = op + b * V;
        if (mask_of[b] < 0) {
          std::memcpy(orow, xr, sizeof(scalar_t) * V);
          continue;
        }
        const uint32_t* w = reinterpret_cast<const uint32_t*>(mp + mask_of[b] * W);
        int64_t i = 0;
#ifdef __AVX512F__
        if constexpr (std::is_same_v<scalar_t, float>) {
          const __m512 vneg = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          for (; i + 16 <= V; i += 16) {
            const __mmask16 keep = static_cast<__mmask16>(w[i >> 5] >> (i & 31));
            _mm512_storeu_ps(orow + i, _mm512_mask_loadu_ps(vneg, keep, xr + i));
          }
        }
#endif
        for (; i < V; ++i) orow[i] = (w[i >> 5] >> (i & 31)) & 1u ? xr[i] : neg_inf;
      }
    });
  });
  return out;
}

// For the loader's check: each row of a contiguous fp32 [R, n] tensor summed in ATen's order at a given width.
torch::Tensor fxc_aten_row_sums(torch::Tensor x, int64_t lanes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "aten_row_sums: x must be a 2-D float tensor");
  auto xc = x.contiguous();
  auto out = torch::empty({xc.size(0)}, xc.options());
  float* o = out.data_ptr<float>();
#ifdef __AVX512F__
  for (int64_t r = 0; r < xc.size(0); ++r)
    o[r] = aten_row_sum_lanes(xc.data_ptr<float>() + r * xc.size(1), xc.size(1), static_cast<int>(lanes));
#else  // the bf16 rms_norm path that needs ATen's order is AVX-512 only: report "no width matches" (NaN rows)
  (void)lanes;
  for (int64_t r = 0; r < xc.size(0); ++r) o[r] = std::numeric_limits<float>::quiet_NaN();
#endif
  return out;
}
