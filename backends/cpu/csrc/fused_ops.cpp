// CPU kernels for fxc::rms_norm, fxc::silu_mul and fxc::rope (fp32 vectorised; bf16 silu_mul and
// rope vectorised with AVX-512, op for op like ATen; other dtypes via fp32/fp64 math or ATen).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#ifdef __AVX512F__
#include <immintrin.h>
#include <sleef.h>  // shipped with torch; libtorch_cpu exports the functions ATen's Vectorized<float> uses
#endif

#include "simd_math.h"

namespace {

using fxc::Acc;

// fp32/fp64: sum of squares, rsqrt and both multiplies per row in one pass.
// bf16/fp16 (mean_sq given): transformers' RMSNorm op for op: the mean of the fp32 squares is
// ATen's own reduction (its summation order, so the variance is bit-equal), then
// rsqrt(var + eps) in fp32, x * inv rounded to the input dtype, times the weight, rounded.
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

void silu_mul_f32(const float* g, const float* u, float* y, int64_t n) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= end; i += 16) {
      __m512 a = _mm512_loadu_ps(g + i);
      __m512 s = _mm512_div_ps(a, _mm512_add_ps(one, fxc::exp512(_mm512_sub_ps(_mm512_setzero_ps(), a))));
      _mm512_storeu_ps(y + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < end; ++i) y[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  });
}

#ifdef __AVX512F__
// bf16 <-> fp32 in registers: widening is exact; narrowing rounds to nearest even (NaN -> 0x7FC0),
// what c10::BFloat16 and ATen's cvtfp32_bf16 do.
inline __m512 bf16_load(const c10::BFloat16* p, __mmask16 k) {
  const __m256i h = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m256i bf16_round(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

inline void bf16_store(c10::BFloat16* p, __m512 v, __mmask16 k) { _mm256_mask_storeu_epi16(p, k, bf16_round(v)); }

// The value rounded to bf16 and widened again (an intermediate ATen stores as a bf16 tensor).
inline __m512 bf16_r(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                               _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(r);
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// silu(g) * u as ATen computes F.silu(gate) * up on bf16 tensors: silu in fp32 as g / (1 + exp(-g))
// with Sleef's expf (u10, what Vectorized<float>::exp() calls), rounded to bf16; the product of
// the two bf16 values in fp32, rounded to bf16.
void silu_mul_bf16(const c10::BFloat16* g, const c10::BFloat16* u, c10::BFloat16* y, int64_t n) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.0f);
    auto step = [&](int64_t i, __mmask16 k) {
      const __m512 a = bf16_load(g + i, k);
      const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), a));
      const __m512 s = bf16_r(_mm512_div_ps(a, _mm512_add_ps(one, e)));
      bf16_store(y + i, _mm512_mul_ps(s, bf16_load(u + i, k)), k);
    };
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) step(i, static_cast<__mmask16>(0xFFFF));
    if (i < end) step(i, tail_mask(end - i));
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
#endif

}  // namespace

torch::Tensor fxc_rms_norm_cpu(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.size(-1) == weight.numel(), "fxc::rms_norm: weight size must equal the last dim of x");
  auto xc = x.contiguous();
  auto wc = weight.to(x.scalar_type()).contiguous();
  auto y = torch::empty_like(xc);
  const int64_t H = x.size(-1), rows = H ? xc.numel() / H : 0;
  torch::Tensor mean_sq;  // reduced precision: [rows] fp32 mean of squares, reduced by ATen
  if (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf)
    mean_sq = xc.view({rows, H}).to(at::kFloat).square().mean(-1).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fxc_rms_norm", [&] {
    rms_rows<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, H, eps,
                       mean_sq.defined() ? mean_sq.data_ptr<float>() : nullptr);
  });
  return y;
}

torch::Tensor fxc_silu_mul_cpu(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.sizes() == up.sizes(), "fxc::silu_mul: gate and up must have the same shape");
#ifdef __AVX512F__
  if (gate.scalar_type() == at::kBFloat16 && up.scalar_type() == at::kBFloat16) {
    auto g = gate.contiguous(), u = up.contiguous();
    auto y = torch::empty_like(g);
    silu_mul_bf16(g.data_ptr<c10::BFloat16>(), u.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), g.numel());
    return y;
  }
#endif
  if (gate.scalar_type() != at::kFloat || up.scalar_type() != at::kFloat)
    return torch::silu(gate) * up;
  auto g = gate.contiguous(), u = up.contiguous();
  auto y = torch::empty_like(g);
  silu_mul_f32(g.data_ptr<float>(), u.data_ptr<float>(), y.data_ptr<float>(), g.numel());
  return y;
}

// fxc::rope: out = x * cos + rotate_half(x) * sin over the last dim (x any strides; cos/sin broadcast).
// Compiled without FMA contraction so results equal the ATen reference bit for bit.
torch::Tensor fxc_rope_cpu(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && x.size(-1) % 2 == 0, "fxc::rope: x must be [B, H, S, D] with even D");
#ifdef __AVX512F__
  if (x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
      sin.scalar_type() == at::kBFloat16) {
    auto c = cos.expand_as(x), s = sin.expand_as(x);
    if (x.stride(3) == 1 && c.stride(3) == 1 && s.stride(3) == 1) {
      auto out = torch::empty(x.sizes(), x.options());
      const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3);
      const auto* xp = x.data_ptr<c10::BFloat16>();
      const auto* cp = c.data_ptr<c10::BFloat16>();
      const auto* sp = s.data_ptr<c10::BFloat16>();
      auto* o = out.data_ptr<c10::BFloat16>();
      const auto xs = x.strides(), cs = c.strides(), ss = s.strides();
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
  auto c = cos.expand_as(x), s = sin.expand_as(x);
  auto out = torch::empty(x.sizes(), x.options());
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3), h = D / 2;
  auto xa = x.accessor<float, 4>();
  auto ca = c.accessor<float, 4>();
  auto sa = s.accessor<float, 4>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, B * H * S, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (H * S), hh = (i / S) % H, t = i % S;
      auto xr = xa[b][hh][t];
      auto cr = ca[b][hh][t];
      auto sr = sa[b][hh][t];
      float* dst = o + i * D;
      for (int64_t d = 0; d < h; ++d) {
        const float p = xr[d] * cr[d];
        const float q = -xr[d + h] * sr[d];
        dst[d] = p + q;
      }
      for (int64_t d = h; d < D; ++d) {
        const float p = xr[d] * cr[d];
        const float q = xr[d - h] * sr[d];
        dst[d] = p + q;
      }
    }
  });
  return out;
}
