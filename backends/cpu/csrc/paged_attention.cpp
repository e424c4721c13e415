// fxc::paged_attention CPU kernel for decode-shaped calls (few query tokens per sequence); the dispatch
// between it and the flash kernel for multi-token calls (flash_attention.cpp).
//
// Writes this step's K/V rows into the paged cache, then for every (sequence, query token)
// walks the sequence's block table over its *real* context, all query heads at once,
// computing a numerically-stable softmax in fp32 (fp64 for double caches).
// GQA: query head h reads KV head h / (Hq / Hkv); K/V are never repeated.
// fp32 and bf16 caches with head_dim 16/32/64/128 take the AVX-512 path (bf16 converted to
// fp32 exactly in registers, fp32 accumulation); other cases a portable loop of the same shape.
// int8 caches (KV8): codes q with a float32 scale per KV head stored in the cache's last block
// (fxcompiler/ops/paged_attention.py); the write quantizes (nearbyint(x / s), clamped to +-127), the
// attention converts codes to fp32 in registers (exact) and applies the scales outside the inner
// loops: k_scale is folded into the pre-scaled query row, v_scale into the final normalisation.
// fp8 caches (KVf8, torch.float8_e4m3fn): the same with e4m3 codes (kv_fp8.h): the write stores
// e4m3(clamp(x / s, +-448)) rounded to nearest even, the attention converts codes to fp32 exactly
// (AVX-512: the code's bits moved into an fp16 and F16C's vcvtph2ps; elsewhere a 256-entry table).
// pybind11 with torch's Tensor casters and ATen's headers, not torch/extension.h (the whole C++ frontend API):
// the same bindings, half the build time.
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tanh.h>
namespace torch {
using namespace at;  // the torch:: names below (Tensor, empty, arange, kDouble) are ATen's
}  // namespace torch
#include <ATen/Parallel.h>

#include <algorithm>
#include "count_dispatch.h"  // fxc::with_count
#include "simd_math.h"
#include "kv_fp8.h"
#include <cstring>
#include <type_traits>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <cmath>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>

// The fused elementwise kernels (fused_ops.cpp), registered below with the attention kernel.
torch::Tensor fxc_rms_norm_cpu(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor fxc_silu_mul_cpu(torch::Tensor gate, torch::Tensor up);
torch::Tensor fxc_rope_cpu(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
std::tuple<torch::Tensor, torch::Tensor> fxc_greedy_logprob_cpu(torch::Tensor logits);
torch::Tensor fxc_apply_token_bitmask_cpu(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows);
torch::Tensor fxc_aten_row_sums(torch::Tensor x, int64_t lanes);
extern int g_aten_sum_lanes;
// The multi-token (flash) attention kernel, csrc/flash_attention.cpp.
void fxc_flash_attend(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const torch::Tensor& block_table, const torch::Tensor& query_pos, const torch::Tensor& seq_lens,
                      double scale, int64_t window, double softcap, const double* sinks, torch::Tensor& out,
                      const float* kscales = nullptr, const float* vscales = nullptr);

namespace {

using fxc::Acc;
using fxc::exp_row;

// The float32 scales [Hkv] of an int8 or fp8 cache (its last block's first 4 * Hkv bytes).
std::vector<float> kv8_scales(const torch::Tensor& cache) {
  const int64_t nb = cache.size(0), Hkv = cache.size(2);
  const int64_t block = cache.size(1) * Hkv * cache.size(3);
  TORCH_CHECK(block >= 4 * Hkv, "fxc::paged_attention: int8/fp8 cache blocks too small for their scales");
  std::vector<float> s(Hkv);
  std::memcpy(s.data(), static_cast<const char*>(cache.data_ptr()) + (nb - 1) * block, 4 * Hkv);
  return s;
}

inline bool is_code_cache(const torch::Tensor& cache) {
  return cache.scalar_type() == at::kChar || cache.scalar_type() == at::kFloat8_e4m3fn;
}

// code_t: int8_t (KV8: clamp(nearbyint(x / s), +-127)) or fxc::e4m3 (KVf8: e4m3(clamp(x / s, +-448)), RNE).
template <typename scalar_t, typename code_t = int8_t>
void write_cache_q8(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache,
                    torch::Tensor& v_cache, const torch::Tensor& slot_mapping) {
  const int64_t B = key.size(0), Hkv = key.size(1), S = key.size(2), D = key.size(3);
  const std::vector<float> ksc = kv8_scales(k_cache), vsc = kv8_scales(v_cache);
  auto sm = slot_mapping.accessor<int64_t, 2>();
  code_t* kc = static_cast<code_t*>(k_cache.data_ptr());
  code_t* vc = static_cast<code_t*>(v_cache.data_ptr());
  const scalar_t* kp = key.data_ptr<scalar_t>();
  const scalar_t* vp = value.data_ptr<scalar_t>();
  const int64_t row = Hkv * D;
  const auto ks = key.strides(), vs = value.strides();
  auto q8 = [](float x, float s) -> code_t {
    if constexpr (std::is_same_v<code_t, fxc::e4m3>) {
      return fxc::e4m3_encode(x / s);
    } else {
      const float q = std::nearbyint(x / s);
      return static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q)));
    }
  };
  at::parallel_for(0, B * S, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / S, s = i % S;
      const int64_t slot = sm[b][s];
      for (int64_t h = 0; h < Hkv; ++h) {
        code_t* kd = kc + slot * row + h * D;
        code_t* vd = vc + slot * row + h * D;
        const scalar_t* kr = kp + b * ks[0] + h * ks[1] + s * ks[2];
        const scalar_t* vr = vp + b * vs[0] + h * vs[1] + s * vs[2];
        const float kh = ksc[h], vh = vsc[h];
        for (int64_t d = 0; d < D; ++d) {
          kd[d] = q8(static_cast<float>(kr[d * ks[3]]), kh);
          vd[d] = q8(static_cast<float>(vr[d * vs[3]]), vh);
        }
      }
    }
  });
}

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
  const bool heads_adjacent = rows_contiguous && ks[1] == D && vs[1] == D;  // a token's Hkv rows: one run
  at::parallel_for(0, B * S, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / S, s = i % S;
      const int64_t slot = sm[b][s];
      if (heads_adjacent) {
        std::memcpy(kc + slot * row, kp + b * ks[0] + s * ks[2], row * sizeof(scalar_t));
        std::memcpy(vc + slot * row, vp + b * vs[0] + s * vs[2], row * sizeof(scalar_t));
        continue;
      }
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

// ---------------------------------------------------------------------------------------------
// Attention over the cache.
//
// A *row* is one (sequence b, query token s): it attends over context tokens [lo, hi].  The rows'
// tokens are laid end to end and cut into T equal shares (T = threads), cuts rounded to block
// boundaries; a row cut by a share boundary is processed as several *pieces* whose partial
// results (max m, sum l, unnormalised output) are merged afterwards (log-sum-exp), so one long
// context keeps both cores busy and uneven lengths stay balanced.
//
// A piece walks its blocks twice, K then V.  Every block is one contiguous run of token rows
// [bs][Hkv][D] and each token row is read once for all KV heads and all query heads of their
// groups (the scores of the row's Hq heads come out of one pass).  While a block is processed,
// the next block of the stream (K blocks, then the piece's V blocks, then the next piece's K
// blocks) is prefetched token row by token row: the block ids are random, so neither the
// hardware prefetcher nor out-of-order execution would otherwise start the next block early.
// ---------------------------------------------------------------------------------------------

struct Piece {
  int64_t row, a, e;  // context tokens [a, e] of row
  int64_t slot;       // -1: the whole row (write the output), else index of the partial result
};

template <typename scalar_t>
struct Geo {
  const scalar_t* kc;
  const scalar_t* vc;
  int64_t bs, Hkv, G, D, block_stride, tok_stride;
  double softcap;
};

int g_prefetch = 1;       // 0: none, 1: T0, 2: T1, 3: NTA (_set_prefetch, for measurements)
int g_prefetch_dist = 1;  // blocks ahead
// Extra L2 prefetch streams (measured at batch 64, ctx 136/500, one thread, interleaved A/B: mode 2 is
// 28-36 % faster than 0; prefetching the next piece's V as well was no better):
// >= 1: while a block's K rows are read, its V rows go to L2 (the V pass then reads L2);
// >= 2: while a block's V rows are read, the next piece's K block of the same index goes to L2.
int g_l2_streams = 2;

inline void prefetch_l2(const char* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

inline void prefetch_bytes(const char* p, int64_t bytes) {
  switch (g_prefetch) {
    case 1: for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3); break;
    case 2: prefetch_l2(p, bytes); break;
    case 3: for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 0); break;
    default: break;
  }
}

// The reference order of operations, any dtype / head_dim: scores, softmax stats, unnormalised
// output of one piece.  q: [Hq][D] pre-scaled; scores: [Hq][n]; m, l: [Hq]; acc: [Hq][D].
template <typename scalar_t, typename acc_t>
void piece_generic(const Geo<scalar_t>& g, const acc_t* q, const int64_t* row_blocks, int64_t a, int64_t e,
                   acc_t* scores, acc_t* m, acc_t* l, acc_t* acc) {
  const int64_t n = e - a + 1, Hq = g.Hkv * g.G, D = g.D;
  for (int64_t j = a; j <= e; ++j) {
    const scalar_t* kr = g.kc + row_blocks[j / g.bs] * g.block_stride + (j % g.bs) * g.tok_stride;
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const acc_t* qh = q + hq * D;
      const scalar_t* kh = kr + (hq / g.G) * D;
      acc_t dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qh[d] * static_cast<acc_t>(kh[d]);
      if (g.softcap > 0) dot = static_cast<acc_t>(std::tanh(dot / g.softcap) * g.softcap);
      scores[hq * n + (j - a)] = dot;
    }
  }
  for (int64_t hq = 0; hq < Hq; ++hq) {
    acc_t* row = scores + hq * n;
    acc_t mx = row[0];
    for (int64_t j = 1; j < n; ++j) mx = std::max(mx, row[j]);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] -= mx;
    exp_row(row, n);
    acc_t sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) sum += row[j];
    m[hq] = mx;
    l[hq] = sum;
  }
  std::fill(acc, acc + Hq * D, acc_t(0));
  for (int64_t j = a; j <= e; ++j) {
    const scalar_t* vr = g.vc + row_blocks[j / g.bs] * g.block_stride + (j % g.bs) * g.tok_stride;
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const acc_t p = scores[hq * n + (j - a)];
      const scalar_t* vh = vr + (hq / g.G) * D;
      acc_t* ah = acc + hq * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ah[d] += p * static_cast<acc_t>(vh[d]);
    }
  }
}

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {  // int8 codes -> fp32 (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// e4m3 codes -> fp32 (exact): the 7 magnitude bits shifted left by 7 are an fp16 with the same exponent and
// mantissa fields, i.e. the e4m3 value x 2^-8 (subnormals included); the sign goes to bit 15, vcvtph2ps
// converts exactly, the product with 2^8 is exact; NaN codes (magnitude 0x7F) are blended to NaN.
inline __m512 load16(const fxc::e4m3* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7F));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
  const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7F));
  return _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}
inline __m512 load16(const c10::BFloat16* p) {  // bf16 -> fp32 is exact: the bits shifted up by 16
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// fp32 / bf16 caches, head_dim = 16 * DV; accumulation in fp32.
template <typename T, int DV>
void piece_avx512(const Geo<T>& g, const float* q, const int64_t* row_blocks, int64_t a, int64_t e, float* scores,
                  float* m, float* l, float* acc, const int64_t* next_blocks, int64_t next_nb) {
  constexpr int D = 16 * DV;
  constexpr int GMAX = DV >= 8 ? 3 : (DV == 4 ? 6 : 8);  // accumulators of the V pass: GMAX * DV <= 24 zmm
  const int64_t n = e - a + 1, bs = g.bs, Hkv = g.Hkv, G = g.G, Hq = Hkv * G;
  const int64_t row_bytes = g.tok_stride * static_cast<int64_t>(sizeof(T));
  const int64_t first_blk = a / bs, last_blk = e / bs, nb = last_blk - first_blk + 1;
  const int64_t seg_bytes = D * static_cast<int64_t>(sizeof(T));
  // The blocks this thread reads, in order: K blocks, V blocks, the next piece's K blocks.
  auto stream = [&](int64_t s) -> const char* {
    if (s < nb) return reinterpret_cast<const char*>(g.kc + row_blocks[first_blk + s] * g.block_stride);
    if (s < 2 * nb) return reinterpret_cast<const char*>(g.vc + row_blocks[first_blk + s - nb] * g.block_stride);
    s -= 2 * nb;
    return s < next_nb ? reinterpret_cast<const char*>(g.kc + next_blocks[s] * g.block_stride) : nullptr;
  };
  // K pass, per block and up to 16 consecutive token rows: for each (KV head, query head) the 16
  // dot products are reduced together (one transpose-add tree instead of 16 horizontal sums),
  // with the query row held in registers.
  for (int64_t blk = first_blk; blk <= last_blk; ++blk) {
    const int64_t tb = blk == first_blk ? a - blk * bs : 0;
    const int64_t te = blk == last_blk ? e - blk * bs + 1 : bs;
    const T* base = g.kc + row_blocks[blk] * g.block_stride;
    const char* next = stream(blk - first_blk + g_prefetch_dist);
    for (int64_t t0 = tb; t0 < te; t0 += 16) {
      const int64_t cnt = std::min<int64_t>(16, te - t0);
      const __mmask16 mk = static_cast<__mmask16>(cnt >= 16 ? 0xFFFFu : (1u << cnt) - 1);
      const T* rows = base + t0 * g.tok_stride;
      const int64_t col = blk * bs + t0 - a;
      for (int64_t h = 0; h < Hkv; ++h) {
        if (next)
          for (int64_t t = 0; t < cnt; ++t) prefetch_bytes(next + (t0 + t) * row_bytes + h * seg_bytes, seg_bytes);
        if (g_l2_streams) {  // the same rows of this block's V into L2: a second stream while K streams
          const char* vb = reinterpret_cast<const char*>(g.vc + row_blocks[blk] * g.block_stride);
          for (int64_t t = 0; t < cnt; ++t) prefetch_l2(vb + (t0 + t) * row_bytes + h * seg_bytes, seg_bytes);
        }
        // The 16 rows' scores for each query head of the group: P[t] = q . k_t, one transpose-add tree.
        auto group_scores = [&](auto&& krow, int64_t kstride) {
          for (int64_t gg = 0; gg < G; ++gg) {
            const float* qh = q + (h * G + gg) * D;
            __m512 qv[DV];
            for (int i = 0; i < DV; ++i) qv[i] = _mm512_loadu_ps(qh + 16 * i);
            __m512 P[16];
#pragma GCC unroll 16
            for (int t = 0; t < 16; ++t) {
              const auto* kr = krow + std::min<int64_t>(t, cnt - 1) * kstride;
              __m512 s0 = _mm512_mul_ps(qv[0], load16(kr));
              if constexpr (DV >= 2) {
                __m512 s1 = _mm512_mul_ps(qv[1], load16(kr + 16));
                for (int i = 2; i < DV; i += 2) {
                  s0 = _mm512_fmadd_ps(qv[i], load16(kr + 16 * i), s0);
                  s1 = _mm512_fmadd_ps(qv[i + 1], load16(kr + 16 * i + 16), s1);
                }
                s0 = _mm512_add_ps(s0, s1);
              }
              P[t] = s0;
            }
            _mm512_mask_storeu_ps(scores + (h * G + gg) * n + col, mk, fxc::sum16(P));
          }
        };
        if constexpr (!std::is_same_v<T, float>) {
          if (G > 1) {  // widen the rows once (exactly) for every query head of the group, not once per head
            alignas(64) float kw[16 * D];
            for (int64_t t = 0; t < cnt; ++t)
              for (int i = 0; i < DV; ++i)
                _mm512_store_ps(kw + t * D + 16 * i, load16(rows + t * g.tok_stride + h * D + 16 * i));
            group_scores(static_cast<const float*>(kw), D);
            continue;
          }
        }
        group_scores(rows + h * D, g.tok_stride);
      }
    }
  }
  if (g.softcap > 0)
    for (int64_t i = 0; i < Hq * n; ++i) scores[i] = static_cast<float>(std::tanh(scores[i] / g.softcap) * g.softcap);
  for (int64_t hq = 0; hq < Hq; ++hq) {
    float* row = scores + hq * n;
    int64_t j = 0;
    __m512 vmx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (; j + 16 <= n; j += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(row + j));
    float mx = _mm512_reduce_max_ps(vmx);
    for (; j < n; ++j) mx = std::max(mx, row[j]);
    const __m512 vm = _mm512_set1_ps(mx);
    __m512 vs = _mm512_setzero_ps();
    for (j = 0; j + 16 <= n; j += 16) {
      const __m512 p = fxc::exp512(_mm512_sub_ps(_mm512_loadu_ps(row + j), vm));
      _mm512_storeu_ps(row + j, p);
      vs = _mm512_add_ps(vs, p);
    }
    if (j < n) {
      const __mmask16 mk = static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 p = _mm512_maskz_mov_ps(mk, fxc::exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, row + j), vm)));
      _mm512_mask_storeu_ps(row + j, mk, p);
      vs = _mm512_add_ps(vs, p);
    }
    m[hq] = mx;
    l[hq] = _mm512_reduce_add_ps(vs);
  }
  // V pass: per block and KV head, the group's accumulators stay in registers over the block's tokens.
  for (int64_t i = 0; i < Hq * D; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
  for (int64_t blk = first_blk; blk <= last_blk; ++blk) {
    const int64_t t0 = blk == first_blk ? a - blk * bs : 0;
    const int64_t t1 = blk == last_blk ? e - blk * bs + 1 : bs;
    const T* base = g.vc + row_blocks[blk] * g.block_stride;
    const char* next = stream(nb + blk - first_blk + g_prefetch_dist);
    // The next piece's K block of the same index into L2 (its K pass then starts from L2).
    const char* next_k = g_l2_streams >= 2 && blk - first_blk < next_nb
                             ? reinterpret_cast<const char*>(g.kc + next_blocks[blk - first_blk] * g.block_stride)
                             : nullptr;
    const int64_t col0 = blk * bs - a;
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t g0 = 0; g0 < G; g0 += GMAX) {
        const int gn = static_cast<int>(std::min<int64_t>(GMAX, G - g0));
        // gn query heads' accumulators over this block's tokens.  GN is a compile-time count so that they stay
        // in registers: with a run-time bound GCC kept them on the stack, a store and a load per token.
        auto run = [&](auto gn_c) {
          constexpr int GN = decltype(gn_c)::value;
          __m512 ac[GN][DV];
#pragma GCC unroll 8
          for (int gg = 0; gg < GN; ++gg)
#pragma GCC unroll 8
            for (int i = 0; i < DV; ++i) ac[gg][i] = _mm512_loadu_ps(acc + (h * G + g0 + gg) * D + 16 * i);
          const float* sc = scores + (h * G + g0) * n + col0;
          for (int64_t t = t0; t < t1; ++t) {
            if (next && g0 == 0) prefetch_bytes(next + t * row_bytes + h * seg_bytes, seg_bytes);
            if (next_k && g0 == 0) prefetch_l2(next_k + t * row_bytes + h * seg_bytes, seg_bytes);
            const T* vr = base + t * g.tok_stride + h * D;
            __m512 v[DV];
#pragma GCC unroll 8
            for (int i = 0; i < DV; ++i) v[i] = load16(vr + 16 * i);
#pragma GCC unroll 8
            for (int gg = 0; gg < GN; ++gg) {
              const __m512 p = _mm512_set1_ps(sc[gg * n + t]);
#pragma GCC unroll 8
              for (int i = 0; i < DV; ++i) ac[gg][i] = _mm512_fmadd_ps(p, v[i], ac[gg][i]);
            }
          }
#pragma GCC unroll 8
          for (int gg = 0; gg < GN; ++gg)
#pragma GCC unroll 8
            for (int i = 0; i < DV; ++i) _mm512_storeu_ps(acc + (h * G + g0 + gg) * D + 16 * i, ac[gg][i]);
        };
        fxc::with_count<GMAX>(gn, run);
      }
    }
  }
}
#endif

constexpr int64_t kMinShareTokens = 64;  // shortest context share worth a thread of its own

// scalar_t: query/output dtype; cache_t: the cache's (scalar_t, or int8_t with kscale/vscale [Hkv]).
template <typename scalar_t, typename cache_t = scalar_t>
void attend(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const torch::Tensor& block_table, const torch::Tensor& query_pos, const torch::Tensor& seq_lens,
            double scale, int64_t window, double softcap, const double* sinks, torch::Tensor& out,
            const float* kscale = nullptr, const float* vscale = nullptr) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t B = query.size(0), Hq = query.size(1), S = query.size(2), D = query.size(3);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t MB = block_table.size(1);
  const Geo<cache_t> geo{static_cast<const cache_t*>(k_cache.data_ptr()), static_cast<const cache_t*>(v_cache.data_ptr()),
                          bs, Hkv, Hq / Hkv, D,
                          bs * Hkv * D, Hkv * D, softcap};
  const int64_t G = Hq / Hkv;
  auto kmul = [&](int64_t hq) { return kscale ? static_cast<acc_t>(kscale[hq / G]) : acc_t(1); };
  auto vmul = [&](int64_t hq) { return vscale ? static_cast<acc_t>(vscale[hq / G]) : acc_t(1); };
  const scalar_t* qbase = query.data_ptr<scalar_t>();
  const auto qst = query.strides();
  auto qp = query_pos.accessor<int64_t, 2>();
  auto sl = seq_lens.accessor<int64_t, 1>();
  const int64_t* bt = block_table.data_ptr<int64_t>();  // contiguous [B, MB]
  scalar_t* o = out.data_ptr<scalar_t>();                // [B, S, Hq, D] contiguous
  const acc_t sc = static_cast<acc_t>(scale);

  // Rows and their context ranges; rows with nothing to attend to output zeros.
  const int64_t R = B * S;
  std::vector<int64_t> lo(R), cnt(R);
  int64_t total = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = r / S, s = r % S, pos = qp[b][s];
    const int64_t hi = std::min<int64_t>(pos, std::min<int64_t>(sl[b], MB * bs) - 1);
    lo[r] = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    cnt[r] = std::max<int64_t>(0, hi - lo[r] + 1);
    total += cnt[r];
    if (cnt[r] == 0) std::fill(o + r * Hq * D, o + (r + 1) * Hq * D, scalar_t(0));
  }
  // Shares: thread t takes tokens [cut[t], cut[t+1]) of the concatenation, cuts moved to a block
  // boundary of the row they fall in (or to the row's end when the row is short).
  // One share per thread, but not more shares than rows unless the context is long enough to be cut
  // (a single decode row of >= 2 * kMinShareTokens tokens is split too: batch 1 uses both cores).
  const int64_t shares_wanted = std::max<int64_t>(R, total / kMinShareTokens);
  const int64_t T =
      at::in_parallel_region() ? 1 : std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), shares_wanted));
  std::vector<std::vector<Piece>> shares(T);
  int64_t nparts = 0;
  {
    std::vector<int64_t> cut_row(T + 1, R), cut_off(T + 1, 0);  // cut t = before token cut_off of row cut_row
    cut_row[0] = 0;
    int64_t r = 0, before = 0;  // tokens of rows < r
    for (int64_t t = 1; t < T; ++t) {
      const int64_t target = total * t / T;
      while (r < R && before + cnt[r] <= target) before += cnt[r++];
      int64_t off = target - before;
      if (r < R && off > 0) {
        const int64_t j = lo[r] + off;
        const int64_t aligned = (j + bs / 2) / bs * bs - lo[r];
        off = cnt[r] < 4 * bs ? (2 * off < cnt[r] ? 0 : cnt[r]) : std::clamp<int64_t>(aligned, 0, cnt[r]);
      }
      cut_row[t] = r;
      cut_off[t] = off;
    }
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t rr = cut_row[t]; rr <= std::min<int64_t>(cut_row[t + 1], R - 1); ++rr) {
        const int64_t begin = rr == cut_row[t] ? cut_off[t] : 0;
        const int64_t end = rr == cut_row[t + 1] ? cut_off[t + 1] : cnt[rr];
        if (end <= begin) continue;
        const bool whole = begin == 0 && end == cnt[rr];
        int64_t slot = -1;
        if (!whole) slot = nparts++;
        shares[t].push_back(Piece{rr, lo[rr] + begin, lo[rr] + end - 1, slot});
      }
    }
  }
  std::vector<acc_t> part_acc(nparts * Hq * D), part_ml(nparts * Hq * 2);

  at::parallel_for(0, T, 1, [&](int64_t tb, int64_t te) {
    static thread_local std::vector<acc_t> buf;
    for (int64_t t = tb; t < te; ++t) {
      const auto& pieces = shares[t];
      int64_t maxn = 0;
      for (const auto& p : pieces) maxn = std::max(maxn, p.e - p.a + 1);
      const size_t need = static_cast<size_t>(Hq * maxn + Hq * D * 2 + Hq * 2 + 64);
      if (buf.size() < need) buf.resize(need);
      acc_t* q = buf.data();
      acc_t* acc = q + Hq * D;
      acc_t* ml = acc + Hq * D;
      acc_t* scores = ml + Hq * 2;
      for (size_t pi = 0; pi < pieces.size(); ++pi) {
        const Piece& p = pieces[pi];
        const int64_t b = p.row / S, s = p.row % S;
        const int64_t* row_blocks = bt + b * MB;
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const scalar_t* qh = qbase + b * qst[0] + hq * qst[1] + s * qst[2];
          acc_t* qd = q + hq * D;
          const acc_t sch = kscale ? sc * kmul(hq) : sc;
          if (qst[3] == 1) {
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) qd[d] = static_cast<acc_t>(qh[d]) * sch;
          } else {
            for (int64_t d = 0; d < D; ++d) qd[d] = static_cast<acc_t>(qh[d * qst[3]]) * sch;
          }
        }
        acc_t* pacc = p.slot >= 0 ? part_acc.data() + p.slot * Hq * D : acc;
        acc_t* pm = p.slot >= 0 ? part_ml.data() + p.slot * Hq * 2 : ml;
        bool done = false;
#ifdef __AVX512F__
        if constexpr ((std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) &&
                      (std::is_same_v<cache_t, scalar_t> || std::is_same_v<cache_t, int8_t> ||
                       std::is_same_v<cache_t, fxc::e4m3>)) {
          const int64_t* nxb = nullptr;
          int64_t nxn = 0;
          if (pi + 1 < pieces.size()) {
            const Piece& nx = pieces[pi + 1];
            nxb = bt + (nx.row / S) * MB + nx.a / bs;
            nxn = nx.e / bs - nx.a / bs + 1;
          }
          done = true;
          switch (D) {
            case 16: piece_avx512<cache_t, 1>(geo, q, row_blocks, p.a, p.e, scores, pm, pm + Hq, pacc, nxb, nxn); break;
            case 32: piece_avx512<cache_t, 2>(geo, q, row_blocks, p.a, p.e, scores, pm, pm + Hq, pacc, nxb, nxn); break;
            case 64: piece_avx512<cache_t, 4>(geo, q, row_blocks, p.a, p.e, scores, pm, pm + Hq, pacc, nxb, nxn); break;
            case 128: piece_avx512<cache_t, 8>(geo, q, row_blocks, p.a, p.e, scores, pm, pm + Hq, pacc, nxb, nxn); break;
            default: done = false;
          }
        }
#endif
        if (!done) piece_generic<cache_t, acc_t>(geo, q, row_blocks, p.a, p.e, scores, pm, pm + Hq, pacc);
        if (p.slot < 0) {
          scalar_t* dst = o + p.row * Hq * D;
          for (int64_t hq = 0; hq < Hq; ++hq) {
            // a sink joins the softmax's denominator only: exp(sink - max) beside the row's sum
            const acc_t sink = sinks ? static_cast<acc_t>(std::exp(sinks[hq] - static_cast<double>(pm[hq]))) : acc_t(0);
            const acc_t inv = vmul(hq) / (pm[Hq + hq] + sink);
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) dst[hq * D + d] = static_cast<scalar_t>(pacc[hq * D + d] * inv);
          }
        }
      }
    }
  });

  // Rows cut between shares: merge their pieces' partial results (log-sum-exp).  A row's pieces
  // have consecutive slots (shares are consecutive token ranges).
  if (nparts) {
    std::vector<int64_t> slot_row(nparts);
    for (const auto& pieces : shares)
      for (const Piece& p : pieces)
        if (p.slot >= 0) slot_row[p.slot] = p.row;
    std::vector<acc_t> accum(D);
    for (int64_t first = 0, last; first < nparts; first = last + 1) {
      last = first;
      while (last + 1 < nparts && slot_row[last + 1] == slot_row[first]) ++last;
      scalar_t* dst = o + slot_row[first] * Hq * D;
      for (int64_t hq = 0; hq < Hq; ++hq) {
        acc_t mx = -std::numeric_limits<acc_t>::infinity();
        for (int64_t k = first; k <= last; ++k) mx = std::max(mx, part_ml[k * Hq * 2 + hq]);
        acc_t denom = 0;
        std::fill(accum.begin(), accum.end(), acc_t(0));
        for (int64_t k = first; k <= last; ++k) {
          const acc_t w = std::exp(part_ml[k * Hq * 2 + hq] - mx);
          denom += w * part_ml[k * Hq * 2 + Hq + hq];
          const acc_t* pa = part_acc.data() + (k * Hq + hq) * D;
          for (int64_t d = 0; d < D; ++d) accum[d] += w * pa[d];
        }
        if (sinks) denom += static_cast<acc_t>(std::exp(sinks[hq] - static_cast<double>(mx)));
        const acc_t inv = vmul(hq) / denom;
        for (int64_t d = 0; d < D; ++d) dst[hq * D + d] = static_cast<scalar_t>(accum[d] * inv);
      }
    }
  }
}

torch::Tensor paged_attention_cpu(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                                  torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                                  torch::Tensor slot_mapping, torch::Tensor query_pos, torch::Tensor seq_lens,
                                  double scale, int64_t sliding_window, double softcap,
                                  const std::optional<torch::Tensor>& sinks = std::nullopt) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "fxc::paged_attention: caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && key.scalar_type() == k_cache.scalar_type(),
              "fxc::paged_attention (cpu kernel): query/key/cache dtypes must match");
  block_table = block_table.contiguous();
  const int64_t B = query.size(0), Hq = query.size(1), S = query.size(2), D = query.size(3);
  auto out = torch::empty({B, S, Hq, D}, query.options());
  torch::Tensor sinks64;  // [Hq] in double: read once per row and head
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->numel() == Hq, "fxc::paged_attention: sinks must have one value per query head (", Hq,
                "), got ", sinks->sizes());
    sinks64 = sinks->to(torch::kDouble).contiguous();
  }
  const double* sink_ptr = sinks.has_value() ? sinks64.data_ptr<double>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "fxc_paged_attention", [&] {
    write_cache<scalar_t>(key, value, k_cache, v_cache, slot_mapping);
    attend<scalar_t>(query, k_cache, v_cache, block_table, query_pos, seq_lens, scale, sliding_window, softcap,
                     sink_ptr, out);
  });
  return out;
}

void write_cache_cpu(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "fxc write_cache: caches must be contiguous");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type(), "fxc write_cache: key/cache dtypes must match");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "fxc_write_cache", [&] {
    write_cache<scalar_t>(key, value, k_cache, v_cache, slot_mapping.contiguous());
  });
}

// Attention of query [B, Hq, S, D] over the cached context named by the block table, with ATen ops:
// gather the blocks, mask (causal by query position, padding by seq_lens, sliding window) and one
// SDPA (grouped matmuls with a softcap).  fxcompiler/ops/paged_attention.py attend_reference, in C++.
torch::Tensor attend_aten(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                          const torch::Tensor& block_table, const torch::Tensor& query_pos,
                          const torch::Tensor& seq_lens, double scale, int64_t window, double softcap,
                          const std::optional<torch::Tensor>& sinks = std::nullopt) {
  const int64_t B = query.size(0), Hq = query.size(1), S = query.size(2), D = query.size(3);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), MB = block_table.size(1), L = MB * bs;
  const auto flat = block_table.reshape({-1});
  auto k_ctx = k_cache.index_select(0, flat).view({B, L, Hkv, D}).transpose(1, 2);
  auto v_ctx = v_cache.index_select(0, flat).view({B, L, Hkv, D}).transpose(1, 2);
  if (k_ctx.scalar_type() != query.scalar_type()) {
    k_ctx = k_ctx.to(query.scalar_type());
    v_ctx = v_ctx.to(query.scalar_type());
  }
  const auto j = torch::arange(L, query_pos.options()).view({1, 1, L});
  const auto qp = query_pos.unsqueeze(-1);
  auto allowed = j.le(qp).logical_and(j.lt(seq_lens.view({B, 1, 1})));
  if (window > 0) allowed = allowed.logical_and(j.gt(qp - window));
  if (softcap > 0.0 || sinks.has_value()) {
    const int64_t G = Hq / Hkv;
    auto scores = at::matmul(query.reshape({B, Hkv, G * S, D}), k_ctx.transpose(-1, -2)) * scale;
    if (softcap > 0.0) scores = at::tanh(scores / softcap) * softcap;
    const auto mask = allowed.repeat({1, G, 1}).unsqueeze(1);  // rows are g-major like q
    scores = scores.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
    torch::Tensor probs;
    if (sinks.has_value()) {  // one extra logit per query head, dropped after the softmax
      const auto sink = sinks->to(scores.scalar_type()).view({1, Hkv, G, 1, 1}).expand({B, Hkv, G, S, 1})
                            .reshape({B, Hkv, G * S, 1});
      probs = at::softmax(at::cat({scores, sink}, -1), -1).narrow(-1, 0, scores.size(-1));
    } else {
      probs = at::softmax(scores, -1);
    }
    const auto out = at::matmul(probs, v_ctx);
    return out.view({B, Hq, S, D}).transpose(1, 2).contiguous();
  }
  const auto out = at::scaled_dot_product_attention(query, k_ctx, v_ctx, allowed.unsqueeze(1), 0.0, false, scale,
                                                    Hq != Hkv);
  return out.transpose(1, 2).contiguous();
}

// Multi-token calls whose query rows per KV head (tokens x GQA group) fill at least this many of the flash
// kernel's 16-lane tiles take the flash kernel (csrc/flash_attention.cpp); one-token calls and calls with fewer
// rows take the decode kernel, whose cost grows with the rows, not with the lanes (measured 2026-12-02 under
// load, GQA 3, batch 1-16, ctx 136/512: decode ahead up to 4 tokens (12 rows; at batch 1 and ctx 512 the flash
// kernel is ahead from 4 tokens), level at 5 (15 rows), flash ahead from 9).  _set_flash_min_rows changes it.
int64_t g_flash_min_rows = 15;

// Cache write, then the flash kernel (any number of query tokens; query, key and cache of one dtype).
torch::Tensor paged_attention_flash(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor k_cache,
                                    torch::Tensor v_cache, torch::Tensor block_table, torch::Tensor slot_mapping,
                                    torch::Tensor query_pos, torch::Tensor seq_lens, double scale,
                                    int64_t sliding_window, double softcap,
                                    const std::optional<torch::Tensor>& sinks = std::nullopt) {
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && key.scalar_type() == k_cache.scalar_type(),
              "fxc::paged_attention (flash kernel): query/key/cache dtypes must match");
  const int64_t B = query.size(0), Hq = query.size(1), S = query.size(2), D = query.size(3);
  torch::Tensor sinks64;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->numel() == Hq, "fxc::paged_attention: sinks must have one value per query head (", Hq,
                "), got ", sinks->sizes());
    sinks64 = sinks->to(torch::kDouble).contiguous();
  }
  write_cache_cpu(key, value, k_cache, v_cache, slot_mapping);
  auto out = torch::empty({B, S, Hq, D}, query.options());
  fxc_flash_attend(query, k_cache, v_cache, block_table, query_pos, seq_lens, scale, sliding_window, softcap,
                   sinks.has_value() ? sinks64.data_ptr<double>() : nullptr, out);
  return out;
}

// Cache write, then SDPA over the gathered context (the path of calls whose query and cache dtypes differ;
// kept callable for comparisons: benchmarks/attention.py --query-tokens).
torch::Tensor paged_attention_sdpa(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor k_cache,
                                   torch::Tensor v_cache, torch::Tensor block_table, torch::Tensor slot_mapping,
                                   torch::Tensor query_pos, torch::Tensor seq_lens, double scale,
                                   int64_t sliding_window, double softcap,
                                   const std::optional<torch::Tensor>& sinks = std::nullopt) {
  const auto dt = k_cache.scalar_type();
  write_cache_cpu(key.scalar_type() == dt ? key : key.to(dt), value.scalar_type() == dt ? value : value.to(dt),
                  k_cache, v_cache, slot_mapping);
  return attend_aten(query, k_cache, v_cache, block_table, query_pos, seq_lens, scale, sliding_window, softcap,
                     sinks);
}

// int8 caches (KV8): the quantizing cache write, then the kernel a float cache would take: the flash kernel's
// int8 tiles for calls of several query tokens per sequence with >= g_flash_min_rows rows per KV head (prefill,
// chunked prefill, verify steps), the decode kernel otherwise (its rows are (sequence, token) pairs).  Both read
// the codes and convert them to fp32 exactly; decode, the common case, reads a quarter (fp32) or half (bf16) of
// a float cache's bytes.
torch::Tensor paged_attention_q8(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor k_cache,
                                 torch::Tensor v_cache, torch::Tensor block_table, torch::Tensor slot_mapping,
                                 torch::Tensor query_pos, torch::Tensor seq_lens, double scale, int64_t sliding_window,
                                 double softcap, const std::optional<torch::Tensor>& sinks) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "fxc::paged_attention: caches must be contiguous");
  const bool f8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "fxc::paged_attention: k_cache is ",
              k_cache.scalar_type(), ", v_cache is ", v_cache.scalar_type(), " (a quantized cache needs both)");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "fxc::paged_attention (int8/fp8 cache): query/key/value dtypes must match");
  block_table = block_table.contiguous();
  slot_mapping = slot_mapping.contiguous();
  query_pos = query_pos.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = query.size(0), Hq = query.size(1), S = query.size(2), D = query.size(3);
  auto out = torch::empty({B, S, Hq, D}, query.options());
  torch::Tensor sinks64;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->numel() == Hq, "fxc::paged_attention: sinks must have one value per query head (", Hq,
                "), got ", sinks->sizes());
    sinks64 = sinks->to(torch::kDouble).contiguous();
  }
  const double* sink_ptr = sinks.has_value() ? sinks64.data_ptr<double>() : nullptr;
  const std::vector<float> ks = kv8_scales(k_cache), vs = kv8_scales(v_cache);
  // several query tokens per sequence with enough rows per KV head: the flash kernel's int8 tiles, as for a
  // float cache (paged_attention_op); else the decode kernel
  const int64_t G = Hq / std::max<int64_t>(1, k_cache.size(2));
  const bool flash = S > 1 && S * G >= g_flash_min_rows;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "fxc_paged_attention_q8", [&] {
    if (f8) {
      write_cache_q8<scalar_t, fxc::e4m3>(key, value, k_cache, v_cache, slot_mapping);
      if (!flash)
        attend<scalar_t, fxc::e4m3>(query, k_cache, v_cache, block_table, query_pos, seq_lens, scale, sliding_window,
                                    softcap, sink_ptr, out, ks.data(), vs.data());
    } else {
      write_cache_q8<scalar_t>(key, value, k_cache, v_cache, slot_mapping);
      if (!flash)
        attend<scalar_t, int8_t>(query, k_cache, v_cache, block_table, query_pos, seq_lens, scale, sliding_window,
                                 softcap, sink_ptr, out, ks.data(), vs.data());
    }
  });
  if (flash)
    fxc_flash_attend(query, k_cache, v_cache, block_table, query_pos, seq_lens, scale, sliding_window, softcap,
                     sink_ptr, out, ks.data(), vs.data());
  return out;
}

void write_cache_q8_cpu(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && is_code_cache(k_cache) &&
              v_cache.scalar_type() == k_cache.scalar_type(),
              "fxc write_cache_q8: caches must be contiguous int8 or float8_e4m3fn");
  const bool f8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "fxc_write_cache_q8", [&] {
    if (f8) write_cache_q8<scalar_t, fxc::e4m3>(key, value, k_cache, v_cache, slot_mapping.contiguous());
    else write_cache_q8<scalar_t>(key, value, k_cache, v_cache, slot_mapping.contiguous());
  });
}

// The CPU implementation of fxc::paged_attention (query, key and cache of one dtype): the flash kernel for
// calls of several query tokens per sequence with at least g_flash_min_rows query rows per KV head (verify
// steps, chunked prefill, prefill), the decode kernel otherwise.  Mixed dtypes: the cache write in C++ and
// SDPA over the gathered context.
torch::Tensor paged_attention_op(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor k_cache,
                                 torch::Tensor v_cache, torch::Tensor block_table, torch::Tensor slot_mapping,
                                 torch::Tensor query_pos, torch::Tensor seq_lens, double scale, int64_t sliding_window,
                                 double softcap, const std::optional<torch::Tensor>& sinks = std::nullopt) {
  if (is_code_cache(k_cache))
    return paged_attention_q8(query, key, value, k_cache, v_cache, block_table, slot_mapping, query_pos, seq_lens,
                              scale, sliding_window, softcap, sinks);
  if (query.scalar_type() == k_cache.scalar_type() && key.scalar_type() == k_cache.scalar_type() &&
      value.scalar_type() == k_cache.scalar_type()) {
    const int64_t S = query.size(2), G = query.size(1) / std::max<int64_t>(1, k_cache.size(2));
    if (S == 1 || S * G < g_flash_min_rows)
      return paged_attention_cpu(query, key, value, k_cache, v_cache, block_table, slot_mapping.contiguous(),
                                 query_pos.contiguous(), seq_lens.contiguous(), scale, sliding_window, softcap, sinks);
    return paged_attention_flash(query, key, value, k_cache, v_cache, block_table, slot_mapping.contiguous(),
                                 query_pos, seq_lens, scale, sliding_window, softcap, sinks);
  }
  return paged_attention_sdpa(query, key, value, k_cache, v_cache, block_table, slot_mapping, query_pos, seq_lens,
                              scale, sliding_window, softcap, sinks);
}

// fxc::qkv_paged_attention on CPU: the same kernels as the unfused graph (views of the fused projection,
// fxc::rope on q and k, fxc::paged_attention, the [B, S, Hq D] view) in one dispatcher call.
torch::Tensor qkv_paged_attention_op(torch::Tensor qkv, const std::optional<torch::Tensor>& cos,
                                     const std::optional<torch::Tensor>& sin, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_table, torch::Tensor slot_mapping,
                                     torch::Tensor query_pos, torch::Tensor seq_lens, int64_t num_heads,
                                     int64_t num_kv_heads, double scale, int64_t sliding_window, double softcap) {
  TORCH_CHECK(qkv.dim() == 3, "fxc::qkv_paged_attention: qkv must be [B, S, (num_heads + 2 * num_kv_heads) * "
              "head_dim], got ", qkv.sizes());
  const int64_t B = qkv.size(0), S = qkv.size(1), W = qkv.size(2), heads = num_heads + 2 * num_kv_heads;
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && W % heads == 0, "fxc::qkv_paged_attention: qkv's last dim ", W,
              " is not (num_heads + 2 * num_kv_heads) * head_dim for num_heads=", num_heads, ", num_kv_heads=",
              num_kv_heads);
  TORCH_CHECK(cos.has_value() == sin.has_value(), "fxc::qkv_paged_attention: give both cos and sin, or neither");
  const int64_t D = W / heads;
  // [B, h, S, D] views of the projection's columns [start, start + h D): one as_strided each (the graph's
  // narrow -> view -> permute chain makes the same view in three dispatcher calls).
  const bool unit = qkv.stride(2) == 1;
  auto heads_of = [&](int64_t start, int64_t h) {
    if (!unit) return qkv.narrow(2, start, h * D).view({B, S, h, D}).permute({0, 2, 1, 3});
    return qkv.as_strided({B, h, S, D}, {qkv.stride(0), D, qkv.stride(1), 1}, qkv.storage_offset() + start);
  };
  auto q = heads_of(0, num_heads);
  auto k = heads_of(num_heads * D, num_kv_heads);
  auto v = heads_of((num_heads + num_kv_heads) * D, num_kv_heads);
  if (cos.has_value()) {
    q = fxc_rope_cpu(q, *cos, *sin);
    k = fxc_rope_cpu(k, *cos, *sin);
  }
  return paged_attention_op(q, k, v, k_cache, v_cache, block_table, slot_mapping, query_pos, seq_lens, scale,
                            sliding_window, softcap)
      .view({B, S, num_heads * D});
}

std::unique_ptr<torch::Library> g_cpu_impls;  // lives as long as the process: the registrations stay

}  // namespace

// Registers the kernels as the CPU implementations of the fxc ops (in C++, so a call goes
// dispatcher -> kernel with no Python in between).  Called once by backends/cpu/attention.install();
// not at load time, so that a second copy of this module (benchmarks/attention.py --compare-src)
// can be loaded without registering twice.
void register_cpu_kernels(int64_t aten_sum_lanes) {
  g_aten_sum_lanes = static_cast<int>(aten_sum_lanes);
  if (g_cpu_impls) return;
  g_cpu_impls = std::make_unique<torch::Library>(torch::Library::IMPL, "fxc", c10::DispatchKey::CPU, __FILE__,
                                                 __LINE__);
  g_cpu_impls->impl("paged_attention", TORCH_FN(paged_attention_op));
  g_cpu_impls->impl("qkv_paged_attention", TORCH_FN(qkv_paged_attention_op));
  g_cpu_impls->impl("rms_norm", TORCH_FN(fxc_rms_norm_cpu));
  g_cpu_impls->impl("silu_mul", TORCH_FN(fxc_silu_mul_cpu));
  g_cpu_impls->impl("rope", TORCH_FN(fxc_rope_cpu));
  g_cpu_impls->impl("greedy_logprob", TORCH_FN(fxc_greedy_logprob_cpu));
  g_cpu_impls->impl("apply_token_bitmask", TORCH_FN(fxc_apply_token_bitmask_cpu));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_cpu", &paged_attention_cpu, "fxc::paged_attention CPU kernel (decode-shaped calls)",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_table"), py::arg("slot_mapping"), py::arg("query_pos"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("sliding_window"), py::arg("softcap"), py::arg("sinks") = py::none());
  m.def("paged_attention", &paged_attention_op, "fxc::paged_attention on CPU: decode kernel or flash kernel",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_table"), py::arg("slot_mapping"), py::arg("query_pos"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("sliding_window"), py::arg("softcap"), py::arg("sinks") = py::none());
  m.def("paged_attention_flash", &paged_attention_flash, "cache write + the flash (multi-query) kernel",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_table"), py::arg("slot_mapping"), py::arg("query_pos"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("sliding_window"), py::arg("softcap"), py::arg("sinks") = py::none());
  m.def("paged_attention_sdpa", &paged_attention_sdpa, "cache write + SDPA over the gathered context",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_table"), py::arg("slot_mapping"), py::arg("query_pos"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("sliding_window"), py::arg("softcap"), py::arg("sinks") = py::none());
  m.def("_set_flash_min_rows", [](int64_t n) { const int64_t old = g_flash_min_rows; g_flash_min_rows = n; return old; },
        "multi-token calls with at least n query rows (tokens x GQA group) per KV head take the flash kernel, "
        "others the decode kernel; returns the previous n (measurements)", py::arg("n"));
  m.def("_set_prefetch", [](int mode, int dist, int l2) { g_prefetch = mode; g_prefetch_dist = dist; g_l2_streams = l2; },
        "software prefetch of the KV blocks: mode (0 none, 1 T0, 2 T1, 3 NTA), distance in blocks, extra L2 "
        "streams (0 none, 1 V during K, 2 also the next piece's K during V) (measurements)",
        py::arg("mode"), py::arg("dist"), py::arg("l2_streams") = 2);
  m.def("qkv_paged_attention", &qkv_paged_attention_op, "fxc::qkv_paged_attention on CPU");
  m.def("write_cache_q8", &write_cache_q8_cpu, "quantize K/V rows [B, Hkv, S, D] into int8 / fp8 cache slots [B, S] "
        "with the scales of the caches' last block");
  m.def("write_cache", &write_cache_cpu, "write K/V rows [B, Hkv, S, D] into cache slots [B, S]");
  m.def("rms_norm", &fxc_rms_norm_cpu, "fxc::rms_norm CPU kernel");
  m.def("silu_mul", &fxc_silu_mul_cpu, "fxc::silu_mul CPU kernel");
  m.def("rope", &fxc_rope_cpu, "fxc::rope CPU kernel");
  m.def("greedy_logprob", &fxc_greedy_logprob_cpu, "fxc::greedy_logprob CPU kernel");
  m.def("aten_row_sums", &fxc_aten_row_sums, "row sums of a float [R, n] tensor in ATen's order at a vector width");
  m.def("register_cpu_kernels", &register_cpu_kernels, py::arg("aten_sum_lanes"),
        "register the kernels as the CPU implementations of the fxc ops (once per process)");
}
