// fxc::paged_attention CPU kernel for decode-shaped calls (few query tokens per sequence).
//
// Writes this step's K/V rows into the paged cache, then for every (sequence, query
// head, query token) walks the sequence's block table over its *real* context,
// computing a numerically-stable softmax in fp32 (fp64 for double caches).
// GQA: query head h reads KV head h / (Hq / Hkv); K/V are never repeated.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include "simd_math.h"
#include <cstring>
#include <type_traits>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <cmath>
#include <limits>
#include <vector>

namespace {

using fxc::Acc;
using fxc::exp_row;

template <typename scalar_t>
void write_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache,
                 torch::Tensor& v_cache, const torch::Tensor& slot_mapping) {
  const int64_t B = key.size(0), Hkv = key.size(1), S = key.size(2), D = key.size(3);
  auto sm = slot_mapping.accessor<int64_t, 2>();
  scalar_t* kc = k_cache.data_ptr<scalar_t>();
  scalar_t* vc = v_cache.data_ptr<scalar_t>();
  const scalar_t* kp = key.data_ptr<scalar_t>();
  const scalar_t* vp = value.data_ptr<scalar_t>();
  const int64_t row = Hkv * D;
  const auto ks = key.strides(), vs = value.strides();
  const bool rows_contiguous = ks[3] == 1 && vs[3] == 1;
  at::parallel_for(0, B * S, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / S, s = i % S;
      const int64_t slot = sm[b][s];
      for (int64_t h = 0; h < Hkv; ++h) {
        scalar_t* kd = kc + slot * row + h * D;
        scalar_t* vd = vc + slot * row + h * D;
        const scalar_t* kr = kp + b * ks[0] + h * ks[1] + s * ks[2];
        const scalar_t* vr = vp + b * vs[0] + h * vs[1] + s * vs[2];
        if (rows_contiguous) {
          std::memcpy(kd, kr, D * sizeof(scalar_t));
          std::memcpy(vd, vr, D * sizeof(scalar_t));
        } else {
          for (int64_t d = 0; d < D; ++d) {
            kd[d] = kr[d * ks[3]];
            vd[d] = vr[d * vs[3]];
          }
        }
      }
    }
  });
}

#ifdef __AVX512F__
// fp32, head_dim = 16*DV: scores with the K row held in registers for all G heads; V
// accumulated into G x DV registers-worth of L1-resident accumulators.
template <int DV>
void attend_item_f32(const float* q /*[G][16*DV], pre-scaled*/, int64_t G, const float* kc, const float* vc,
                     const int64_t* row_blocks, int64_t bs, int64_t block_stride, int64_t tok_stride,
                     int64_t kv_off, int64_t lo, int64_t hi, float* scores /*[G][L]*/, int64_t L,
                     float* out /*[G][16*DV] contiguous per g with stride out_stride*/, int64_t out_stride) {
  constexpr int D = 16 * DV;
  const int64_t n = hi - lo + 1;
  for (int64_t j = lo; j <= hi; ++j) {
    const float* kr = kc + row_blocks[j / bs] * block_stride + (j % bs) * tok_stride + kv_off;
    __m512 k[DV];
    for (int i = 0; i < DV; ++i) k[i] = _mm512_loadu_ps(kr + 16 * i);
    for (int64_t g = 0; g < G; ++g) {
      __m512 a = _mm512_mul_ps(k[0], _mm512_loadu_ps(q + g * D));
      for (int i = 1; i < DV; ++i) a = _mm512_fmadd_ps(k[i], _mm512_loadu_ps(q + g * D + 16 * i), a);
      scores[g * L + (j - lo)] = _mm512_reduce_add_ps(a);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores + g * L;
    float mx = row[0];
    for (int64_t j = 1; j < n; ++j) mx = std::max(mx, row[j]);
    for (int64_t j = 0; j < n; ++j) row[j] -= mx;
    exp_row(row, n);
    float denom = 0;
    for (int64_t j = 0; j < n; ++j) denom += row[j];
    const float inv = 1.0f / denom;
    for (int64_t j = 0; j < n; ++j) row[j] *= inv;
  }
  constexpr int GMAX = 8;
  for (int64_t g0 = 0; g0 < G; g0 += GMAX) {
    const int64_t gn = std::min<int64_t>(GMAX, G - g0);
    __m512 acc[GMAX][DV];
    for (int g = 0; g < gn; ++g)
      for (int i = 0; i < DV; ++i) acc[g][i] = _mm512_setzero_ps();
    for (int64_t j = lo; j <= hi; ++j) {
      const float* vr = vc + row_blocks[j / bs] * block_stride + (j % bs) * tok_stride + kv_off;
      __m512 v[DV];
      for (int i = 0; i < DV; ++i) v[i] = _mm512_loadu_ps(vr + 16 * i);
      for (int g = 0; g < gn; ++g) {
        const __m512 p = _mm512_set1_ps(scores[(g0 + g) * L + (j - lo)]);
        for (int i = 0; i < DV; ++i) acc[g][i] = _mm512_fmadd_ps(p, v[i], acc[g][i]);
      }
    }
    for (int g = 0; g < gn; ++g)
      for (int i = 0; i < DV; ++i) _mm512_storeu_ps(out + (g0 + g) * out_stride + 16 * i, acc[g][i]);
  }
}
#endif

// One work item = (sequence, KV head, query token): its G query heads share every K/V row read.
template <typename scalar_t>
void attend(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const torch::Tensor& block_table, const torch::Tensor& query_pos, const torch::Tensor& seq_lens,
            double scale, int64_t window, double softcap, torch::Tensor& out) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t B = query.size(0), Hq = query.size(1), S = query.size(2), D = query.size(3);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv;
  const int64_t MB = block_table.size(1);
  auto qa = query.accessor<scalar_t, 4>();
  auto qp = query_pos.accessor<int64_t, 2>();
  auto sl = seq_lens.accessor<int64_t, 1>();
  const int64_t* bt = block_table.data_ptr<int64_t>();  // contiguous [B, MB]
  const scalar_t* kc = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc = v_cache.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();  // [B, S, Hq, D] contiguous
  const int64_t block_stride = bs * Hkv * D, tok_stride = Hkv * D;
  const int64_t L = MB * bs;
  const acc_t sc = static_cast<acc_t>(scale);

  at::parallel_for(0, B * Hkv * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scores(G * L), q(G * D), acc(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (Hkv * S), kvh = (item / S) % Hkv, s = item % S;
      const int64_t pos = qp[b][s];
      const int64_t hi = std::min<int64_t>(pos, sl[b] - 1);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t n = hi - lo + 1;
      if (n <= 0) {
        for (int64_t g = 0; g < G; ++g) {
          scalar_t* dst = o + ((b * S + s) * Hq + kvh * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = scalar_t(0);
        }
        continue;
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) q[g * D + d] = static_cast<acc_t>(qa[b][kvh * G + g][s][d]) * sc;
      const int64_t* row_blocks = bt + b * MB;
#ifdef __AVX512F__
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (softcap <= 0 && (D == 64 || D == 128)) {
          float* dst = o + ((b * S + s) * Hq + kvh * G) * D;
          if (D == 64)
            attend_item_f32<4>(q.data(), G, kc, vc, row_blocks, bs, block_stride, tok_stride, kvh * D, lo, hi,
                               scores.data(), L, dst, D);
          else
            attend_item_f32<8>(q.data(), G, kc, vc, row_blocks, bs, block_stride, tok_stride, kvh * D, lo, hi,
                               scores.data(), L, dst, D);
          continue;
        }
      }
#endif
      for (int64_t j = lo; j <= hi; ++j) {
        const scalar_t* kr = kc + row_blocks[j / bs] * block_stride + (j % bs) * tok_stride + kvh * D;
        for (int64_t g = 0; g < G; ++g) {
          const acc_t* qg = q.data() + g * D;
          acc_t dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * static_cast<acc_t>(kr[d]);
          if (softcap > 0) dot = static_cast<acc_t>(std::tanh(dot / softcap) * softcap);
          scores[g * L + (j - lo)] = dot;
        }
      }
      std::vector<acc_t> inv(G);
      for (int64_t g = 0; g < G; ++g) {
        acc_t* row = scores.data() + g * L;
        acc_t mx = row[0];
        for (int64_t j = 1; j < n; ++j) mx = std::max(mx, row[j]);
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) row[j] -= mx;
        exp_row(row, n);
        acc_t denom = 0;
#pragma omp simd reduction(+ : denom)
        for (int64_t j = 0; j < n; ++j) denom += row[j];
        inv[g] = acc_t(1) / denom;
      }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      for (int64_t j = lo; j <= hi; ++j) {
        const scalar_t* vr = vc + row_blocks[j / bs] * block_stride + (j % bs) * tok_stride + kvh * D;
        for (int64_t g = 0; g < G; ++g) {
          const acc_t p = scores[g * L + (j - lo)];
          acc_t* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * static_cast<acc_t>(vr[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        scalar_t* dst = o + ((b * S + s) * Hq + kvh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[g * D + d] * inv[g]);
      }
    }
  });
}

torch::Tensor paged_attention_cpu(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                                  torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                                  torch::Tensor slot_mapping, torch::Tensor query_pos, torch::Tensor seq_lens,
                                  double scale, int64_t sliding_window, double softcap) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "fxc::paged_attention: caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && key.scalar_type() == k_cache.scalar_type(),
              "fxc::paged_attention (cpu kernel): query/key/cache dtypes must match");
  block_table = block_table.contiguous();
  const int64_t B = query.size(0), Hq = query.size(1), S = query.size(2), D = query.size(3);
  auto out = torch::empty({B, S, Hq, D}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "fxc_paged_attention", [&] {
    write_cache<scalar_t>(key, value, k_cache, v_cache, slot_mapping);
    attend<scalar_t>(query, k_cache, v_cache, block_table, query_pos, seq_lens, scale, sliding_window, softcap,
                     out);
  });
  return out;
}

void write_cache_cpu(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "fxc write_cache: caches must be contiguous");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type(), "fxc write_cache: key/cache dtypes must match");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "fxc_write_cache", [&] {
    write_cache<scalar_t>(key, value, k_cache, v_cache, slot_mapping);
  });
}

}  // namespace

torch::Tensor fxc_rms_norm_cpu(torch::Tensor x, torch::Tensor weight, double eps);  // fused_ops.cpp
torch::Tensor fxc_silu_mul_cpu(torch::Tensor gate, torch::Tensor up);                // fused_ops.cpp
torch::Tensor fxc_rope_cpu(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);    // fused_ops.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_cpu", &paged_attention_cpu, "fxc::paged_attention CPU kernel (decode-shaped calls)");
  m.def("write_cache", &write_cache_cpu, "write K/V rows [B, Hkv, S, D] into cache slots [B, S]");
  m.def("rms_norm", &fxc_rms_norm_cpu, "fxc::rms_norm CPU kernel");
  m.def("silu_mul", &fxc_silu_mul_cpu, "fxc::silu_mul CPU kernel");
  m.def("rope", &fxc_rope_cpu, "fxc::rope CPU kernel");
}
