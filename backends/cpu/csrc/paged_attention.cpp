// fxc::paged_attention CPU kernel for decode-shaped calls (few query tokens per sequence).
//
// Writes this step's K/V rows into the paged cache, then for every (sequence, query
// head, query token) walks the sequence's block table over its *real* context,
// computing a numerically-stable softmax in fp32 (fp64 for double caches).
// GQA: query head h reads KV head h / (Hq / Hkv); K/V are never repeated.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <typename scalar_t>
void write_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache,
                 torch::Tensor& v_cache, const torch::Tensor& slot_mapping) {
  const int64_t B = key.size(0), Hkv = key.size(1), S = key.size(2), D = key.size(3);
  auto ka = key.accessor<scalar_t, 4>();
  auto va = value.accessor<scalar_t, 4>();
  auto sm = slot_mapping.accessor<int64_t, 2>();
  scalar_t* kc = k_cache.data_ptr<scalar_t>();
  scalar_t* vc = v_cache.data_ptr<scalar_t>();
  const int64_t row = Hkv * D;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t slot = sm[b][s];
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t d = 0; d < D; ++d) {
          kc[slot * row + h * D + d] = ka[b][h][s][d];
          vc[slot * row + h * D + d] = va[b][h][s][d];
        }
    }
}

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
  auto bt = block_table.accessor<int64_t, 2>();
  auto qp = query_pos.accessor<int64_t, 2>();
  auto sl = seq_lens.accessor<int64_t, 1>();
  const scalar_t* kc = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc = v_cache.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();  // [B, S, Hq, D] contiguous
  const int64_t block_stride = bs * Hkv * D, tok_stride = Hkv * D;
  const int64_t L = MB * bs;

  at::parallel_for(0, B * Hq * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scores(L);
    std::vector<acc_t> q(D), acc(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (Hq * S), h = (item / S) % Hq, s = item % S;
      const int64_t kvh = h / G;
      const int64_t pos = qp[b][s];
      const int64_t hi = std::min<int64_t>(pos, sl[b] - 1);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      scalar_t* dst = o + ((b * S + s) * Hq + h) * D;
      if (hi < lo) {
        for (int64_t d = 0; d < D; ++d) dst[d] = scalar_t(0);
        continue;
      }
      for (int64_t d = 0; d < D; ++d) q[d] = static_cast<acc_t>(qa[b][h][s][d]);
      acc_t mx = -std::numeric_limits<acc_t>::infinity();
      for (int64_t j = lo; j <= hi; ++j) {
        const scalar_t* kr = kc + bt[b][j / bs] * block_stride + (j % bs) * tok_stride + kvh * D;
        acc_t dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += q[d] * static_cast<acc_t>(kr[d]);
        dot *= static_cast<acc_t>(scale);
        if (softcap > 0) dot = static_cast<acc_t>(std::tanh(dot / softcap) * softcap);
        scores[j - lo] = dot;
        mx = std::max(mx, dot);
      }
      acc_t denom = 0;
      for (int64_t d = 0; d < D; ++d) acc[d] = 0;
      for (int64_t j = lo; j <= hi; ++j) {
        const acc_t p = std::exp(scores[j - lo] - mx);
        denom += p;
        const scalar_t* vr = vc + bt[b][j / bs] * block_stride + (j % bs) * tok_stride + kvh * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += p * static_cast<acc_t>(vr[d]);
      }
      const acc_t inv = acc_t(1) / denom;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[d] * inv);
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
  const int64_t B = query.size(0), Hq = query.size(1), S = query.size(2), D = query.size(3);
  auto out = torch::empty({B, S, Hq, D}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "fxc_paged_attention", [&] {
    write_cache<scalar_t>(key, value, k_cache, v_cache, slot_mapping);
    attend<scalar_t>(query, k_cache, v_cache, block_table, query_pos, seq_lens, scale, sliding_window, softcap,
                     out);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_cpu", &paged_attention_cpu, "fxc::paged_attention CPU kernel (decode-shaped calls)");
}
