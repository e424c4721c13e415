// fxcompiler CPU kernel of fxc::moe's experts for a few tokens (decode, speculative verify).
//
//   fxc::moe_experts_cpu(x[T, H] f32, weights[T, k] f32, experts[T, k] i64, gate_up, gate_up_bias?,
//                        down, down_bias?, activation, transposed, alpha, limit) -> f32 [T, H]
//
// The router and top-k stay in ATen (fxcompiler/ops/moe.py: route); this kernel does the rest:
// per distinct selected expert, its [gate; up] matvec for every token that chose it, the activation
// (SILU_GLU: silu(gate) * up over the halves; CLAMPED_SWIGLU: GPT-OSS's interleaved gate/up, clamped,
// (up + 1) * gate * sigmoid(alpha * gate)), the down matvec, then the weighted sum per token in top-k
// order. Only the selected experts' weights are read, each weight row once (the tokens sharing an
// expert reuse it from L1). Weights fp32 or bf16 (biases in the weights' dtype), fp32 accumulation.
// Layouts: gate_up [E, 2I, H] / down [E, H, I] (rows are dot products), or transposed [E, H, 2I] /
// [E, I, H] (column blocks, rank-1 updates). Parallel over output rows / column blocks (at::parallel_for).
//
// Build flags choose the ISA: -DFXC_AVX512 (intrinsics for the dot products) or -DFXC_AVX2 (the same
// loops written for the compiler's auto-vectoriser).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace fxcmoe {
namespace {

constexpr int64_t CB = 64;  // output columns per task of the transposed layout

inline float bf2f(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float ld(const float* p, int64_t i) { return p[i]; }
inline float ld(const uint16_t* p, int64_t i) { return bf2f(p[i]); }

// sum_i w[i] * x[i]
inline float dot(const float* w, const float* x, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(FXC_AVX512)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
  }
  for (; i + 16 <= n; i += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
  s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#else
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n - n % 16; ++j) s += w[j] * x[j];
  i = n - n % 16;
#endif
  for (; i < n; ++i) s += w[i] * x[i];
  return s;
}

inline float dot(const uint16_t* w, const float* x, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(FXC_AVX512)
  auto cvt = [](const uint16_t* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  };
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    a0 = _mm512_fmadd_ps(cvt(w + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(cvt(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
  }
  for (; i + 16 <= n; i += 16) a0 = _mm512_fmadd_ps(cvt(w + i), _mm512_loadu_ps(x + i), a0);
  s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#else
  const int64_t m = n - n % 16;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < m; ++j) {
    const uint32_t u = static_cast<uint32_t>(w[j]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    s += f * x[j];
  }
  i = m;
#endif
  for (; i < n; ++i) s += bf2f(w[i]) * x[i];
  return s;
}

// The distinct selected experts and, per expert, the (token * k + slot) pairs that chose it.
struct Groups {
  std::vector<int64_t> expert, start, pair;  // expert[u]; pairs of u: pair[start[u] .. start[u+1])
};

Groups group_pairs(const int64_t* idx, int64_t P, int64_t E) {
  std::vector<int64_t> order(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(idx[p] >= 0 && idx[p] < E, "fxc::moe_experts_cpu: expert index ", idx[p], " out of range [0, ", E, ")");
    order[p] = p;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return idx[a] < idx[b]; });
  Groups g;
  for (int64_t i = 0; i < P; ++i) {
    if (i == 0 || idx[order[i]] != idx[order[i - 1]]) {
      g.expert.push_back(idx[order[i]]);
      g.start.push_back(i);
    }
    g.pair.push_back(order[i]);
  }
  g.start.push_back(P);
  return g;
}

// out[pair, :n_out] = W_e @ in[src(pair), :n_in] (+ b_e) for every pair of every expert.
// W: [E, n_out, n_in] (rows) or, transposed, [E, n_in, n_out] (columns).
template <typename W>
void project(const Groups& g, const W* w, const W* b, bool transposed, int64_t n_in, int64_t n_out,
             const float* in, int64_t in_stride, int64_t in_div, float* out) {
  const int64_t U = static_cast<int64_t>(g.expert.size());
  const int64_t per_expert = transposed ? (n_out + CB - 1) / CB : n_out;
  at::parallel_for(0, U * per_expert, transposed ? 1 : 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t u = t / per_expert, r = t % per_expert, e = g.expert[u];
      const int64_t p0 = g.start[u], p1 = g.start[u + 1];
      const W* we = w + e * n_in * n_out;
      const W* be = b ? b + e * n_out : nullptr;
      if (!transposed) {
        const W* row = we + r * n_in;
        const float bias = be ? ld(be, r) : 0.f;
        for (int64_t q = p0; q < p1; ++q) {
          const int64_t p = g.pair[q];
          out[p * n_out + r] = dot(row, in + (p / in_div) * in_stride, n_in) + bias;
        }
        continue;
      }
      const int64_t c0 = r * CB, nc = std::min(CB, n_out - c0), np = p1 - p0;
      acc.assign(static_cast<size_t>(np * CB), 0.f);
      for (int64_t k = 0; k < n_in; ++k) {
        const W* wr = we + k * n_out + c0;
        float wf[CB];
#pragma omp simd
        for (int64_t j = 0; j < nc; ++j) wf[j] = ld(wr, j);
        for (int64_t q = 0; q < np; ++q) {
          const float xv = in[(g.pair[p0 + q] / in_div) * in_stride + k];
          float* a = acc.data() + q * CB;
#pragma omp simd
          for (int64_t j = 0; j < nc; ++j) a[j] += xv * wf[j];
        }
      }
      for (int64_t q = 0; q < np; ++q) {
        float* o = out + g.pair[p0 + q] * n_out + c0;
        const float* a = acc.data() + q * CB;
        for (int64_t j = 0; j < nc; ++j) o[j] = a[j] + (be ? ld(be, c0 + j) : 0.f);
      }
    }
  });
}

void activate(const float* h, float* act, int64_t P, int64_t I, int64_t activation, float alpha, float limit) {
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* hp = h + p * 2 * I;
      float* ap = act + p * I;
      if (activation == 1) {  // CLAMPED_SWIGLU: interleaved gate/up
        for (int64_t i = 0; i < I; ++i) {
          float gt = hp[2 * i], up = hp[2 * i + 1];
          gt = std::isnan(gt) ? gt : std::min(gt, limit);
          up = std::isnan(up) ? up : std::min(std::max(up, -limit), limit);
          ap[i] = (up + 1.f) * (gt / (1.f + std::exp(-gt * alpha)));
        }
      } else {  // SILU_GLU: [gate; up] halves
        for (int64_t i = 0; i < I; ++i) {
          const float gt = hp[i];
          ap[i] = gt / (1.f + std::exp(-gt)) * hp[I + i];
        }
      }
    }
  });
}

template <typename W>
void run(const float* x, const float* wts, const Groups& g, const W* gu, const W* gub, const W* dn, const W* dnb,
         bool transposed, int64_t T, int64_t K, int64_t H, int64_t I, int64_t activation, float alpha, float limit,
         float* out) {
  const int64_t P = T * K;
  std::vector<float> h(static_cast<size_t>(P * 2 * I)), act(static_cast<size_t>(P * I)), y(static_cast<size_t>(P * H));
  project(g, gu, gub, transposed, H, 2 * I, x, H, K, h.data());
  activate(h.data(), act.data(), P, I, activation, alpha, limit);
  project(g, dn, dnb, transposed, I, H, act.data(), I, 1, y.data());
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = out + t * H;
      std::fill(o, o + H, 0.f);
      for (int64_t s = 0; s < K; ++s) {
        const float wv = wts[t * K + s];
        const float* yp = y.data() + (t * K + s) * H;
#pragma omp simd
        for (int64_t j = 0; j < H; ++j) o[j] += wv * yp[j];
      }
    }
  });
}

at::Tensor moe_experts_cpu(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& experts,
                           const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_bias,
                           const at::Tensor& down, const std::optional<at::Tensor>& down_bias, int64_t activation,
                           bool transposed, double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "fxc::moe_experts_cpu: x must be float32 [T, H]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && experts.scalar_type() == at::kLong && weights.dim() == 2 &&
                  weights.sizes() == experts.sizes() && weights.size(0) == x.size(0),
              "fxc::moe_experts_cpu: weights (float32) and experts (int64) must both be [T, k]");
  TORCH_CHECK(activation == 0 || activation == 1, "fxc::moe_experts_cpu: activation must be 0 or 1, got ", activation);
  const auto wt = gate_up.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16, "fxc::moe_experts_cpu: expert weights must be float32 or bfloat16");
  TORCH_CHECK(down.scalar_type() == wt && gate_up.dim() == 3 && down.dim() == 3,
              "fxc::moe_experts_cpu: gate_up and down must be 3-D of one dtype");
  const int64_t T = x.size(0), H = x.size(1), K = weights.size(1), E = gate_up.size(0);
  const int64_t I2 = transposed ? gate_up.size(2) : gate_up.size(1);
  TORCH_CHECK(I2 % 2 == 0 && gate_up.size(transposed ? 1 : 2) == H && down.size(0) == E &&
                  down.size(transposed ? 1 : 2) == I2 / 2 && down.size(transposed ? 2 : 1) == H,
              "fxc::moe_experts_cpu: shapes do not match: x ", x.sizes(), ", gate_up ", gate_up.sizes(), ", down ",
              down.sizes(), ", transposed ", transposed);
  for (const auto* b : {&gate_up_bias, &down_bias})
    if (b->has_value())
      TORCH_CHECK((*b)->scalar_type() == wt && (*b)->is_contiguous(),
                  "fxc::moe_experts_cpu: biases must be contiguous and of the weights' dtype");
  TORCH_CHECK(!gate_up_bias.has_value() || gate_up_bias->numel() == E * I2, "fxc::moe_experts_cpu: gate_up_bias must be [E, 2I]");
  TORCH_CHECK(!down_bias.has_value() || down_bias->numel() == E * H, "fxc::moe_experts_cpu: down_bias must be [E, H]");
  const auto xc = x.contiguous(), wc = weights.contiguous(), ec = experts.contiguous();
  const auto gu = gate_up.contiguous(), dn = down.contiguous();
  auto out = at::empty({T, H}, x.options());
  const Groups g = group_pairs(ec.data_ptr<int64_t>(), T * K, E);
  const float a = static_cast<float>(alpha), l = static_cast<float>(limit);
  if (wt == at::kFloat) {
    auto p = [](const std::optional<at::Tensor>& b) { return b ? b->data_ptr<float>() : nullptr; };
    run<float>(xc.data_ptr<float>(), wc.data_ptr<float>(), g, gu.data_ptr<float>(), p(gate_up_bias),
               dn.data_ptr<float>(), p(down_bias), transposed, T, K, H, I2 / 2, activation, a, l, out.data_ptr<float>());
  } else {
    auto p = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
    auto pb = [&](const std::optional<at::Tensor>& b) { return b ? p(*b) : nullptr; };
    run<uint16_t>(xc.data_ptr<float>(), wc.data_ptr<float>(), g, p(gu), pb(gate_up_bias), p(dn), pb(down_bias),
                  transposed, T, K, H, I2 / 2, activation, a, l, out.data_ptr<float>());
  }
  return out;
}

}  // namespace
}  // namespace fxcmoe

TORCH_LIBRARY_FRAGMENT(fxc, m) {
  m.def("moe_experts_cpu(Tensor x, Tensor weights, Tensor experts, Tensor gate_up, Tensor? gate_up_bias, "
        "Tensor down, Tensor? down_bias, int activation, bool transposed, float alpha, float limit) -> Tensor");
}

TORCH_LIBRARY_IMPL(fxc, CPU, m) { m.impl("moe_experts_cpu", &fxcmoe::moe_experts_cpu); }
