// fxc::paged_attention CPU kernel for multi-token calls (speculative verify, chunked prefill, prefill):
// paged, causal, multi-query, flash-style (online softmax), no gathered copy of the context.
//
// A *tile* is up to L query rows of one (sequence b, KV head h): the rows (token s, group head g) of
// that KV head's GQA group, s-major, cut into runs of L (L = 16 or 32 on AVX-512).  Rows live in the
// lanes of the vector registers: Q^T [D][L] (pre-scaled), scores S^T [16 keys][L], output O^T [D][L].
// The tile walks its sequence's block table once, 16 keys at a time:
//   scores  S^T[t]  = sum_d K[t][d] * Q^T[d]          (K element broadcast, one FMA per d and key)
//   mask    per lane: lo <= j <= hi (causal by query position, padding by seq_lens, sliding window)
//   softmax running max m and sum l per lane, corrections exp(m_old - m_new), all lane-parallel
//   output  O^T[d] = O^T[d] * corr + sum_t V[t][d] * P^T[t]
// so there are no horizontal reductions and no transposes in the inner loops; each K/V row is read
// once per tile, for all of the tile's rows.  fp32 accumulation (fp64 for double caches); bf16 and fp16
// rows, and the int8 / e4m3 codes of a KV8 / KVf8 cache, are converted to fp32 exactly into a 16-row buffer per step
// (KV8: the tile's k_scale is folded into the pre-scaled query, its v_scale into the final normalisation,
// as the decode kernel does).  Logit softcap (tanh) and sinks
// (one extra logit per query head in the denominator) as in the decode kernel and the ATen reference.
//
// Threads: work items are (tile, context piece).  When there are few tiles (batch 1, a verify step),
// each tile's context is cut at block boundaries into pieces whose partial results (m, l, O) are merged
// afterwards (log-sum-exp), so both cores work; items are taken longest first from a shared counter.
//
// One source, two instruction sets: the Ops structs below are AVX-512 (zmm, mask registers) in an
// avx512 build and AVX2/FMA (ymm, blends) in an avx2 build (FXCOMPILER_CPU_ISA=avx2); double caches
// use a portable lane loop.
// ATen's headers only (not torch/extension.h, whose pybind11 and torch API headers tripled the build time);
// the Python bindings live in paged_attention.cpp.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
namespace torch {
using namespace at;  // the torch:: names below (Tensor, empty, kLong, ...) are ATen's
}  // namespace torch
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd_math.h"
#include "kv_fp8.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#include "bf16_simd.h"
#endif

namespace {

constexpr int kChunk = 16;                 // keys per step of the walk
constexpr int64_t kMinPieceKeys = 256;      // shortest context piece worth an item of its own
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// Lane operations.  V: W lanes of T; I: W lanes of int32.
// ---------------------------------------------------------------------------------------------

template <typename T, int W_>
struct OpsGeneric {  // portable: lane loops (double caches, CPUs without AVX2)
  using Scalar = T;
  static constexpr int W = W_;
  struct V { T v[W_]; };
  struct I { int32_t v[W_]; };
  static V zero() { return set1(T(0)); }
  static V set1(T x) { V r; for (int i = 0; i < W; ++i) r.v[i] = x; return r; }
  static V load(const T* p) { V r; std::memcpy(r.v, p, sizeof(r.v)); return r; }
  static void store(T* p, const V& a) { std::memcpy(p, a.v, sizeof(a.v)); }
  static I load_i(const int32_t* p) { I r; std::memcpy(r.v, p, sizeof(r.v)); return r; }
  static V fma(const V& a, const V& b, const V& c) { V r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i]; return r; }
  static V mul(const V& a, const V& b) { V r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] * b.v[i]; return r; }
  static V add(const V& a, const V& b) { V r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] + b.v[i]; return r; }
  static V max(const V& a, const V& b) { V r; for (int i = 0; i < W; ++i) r.v[i] = std::max(a.v[i], b.v[i]); return r; }
  static V allowed(const V& s, const I& lo, const I& hi, int32_t j) {  // s where lo <= j <= hi, else -inf
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = lo.v[i] <= j && j <= hi.v[i] ? s.v[i] : -std::numeric_limits<T>::infinity();
    return r;
  }
  static V exp_from(const V& s, const V& m) {  // exp(s - m), exactly 0 where s = -inf
    V r;
    for (int i = 0; i < W; ++i)
      r.v[i] = s.v[i] == -std::numeric_limits<T>::infinity() ? T(0) : std::exp(s.v[i] - m.v[i]);
    return r;
  }
  static V finite_or_zero(const V& m) {  // -inf lanes (no key yet) -> 0
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = m.v[i] == -std::numeric_limits<T>::infinity() ? T(0) : m.v[i];
    return r;
  }
};

#ifdef __AVX512F__
struct OpsF512 {
  using Scalar = float;
  static constexpr int W = 16;
  using V = __m512;
  using I = __m512i;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a); }
  static I load_i(const int32_t* p) { return _mm512_loadu_si512(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V allowed(V s, I lo, I hi, int32_t j) {
    const __m512i jv = _mm512_set1_epi32(j);
    const __mmask16 ok = _mm512_cmple_epi32_mask(lo, jv) & _mm512_cmple_epi32_mask(jv, hi);
    return _mm512_mask_blend_ps(ok, _mm512_set1_ps(kNegInf), s);
  }
  static V exp_from(V s, V m) {
    const __mmask16 live = _mm512_cmp_ps_mask(s, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
    return _mm512_maskz_mov_ps(live, fxc::exp512(_mm512_sub_ps(s, m)));
  }
  static V finite_or_zero(V m) {
    const __mmask16 none = _mm512_cmp_ps_mask(m, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(none, m, _mm512_setzero_ps());
  }
};
#endif

#ifdef __AVX512F__
// r[j] lane k -> r[k] lane j (a 16 x 16 transpose in registers).
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}

inline __m512 load_row16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_row16(const c10::BFloat16* p) { return fxc::bf16_load(p, 0xFFFF); }
inline void store_row16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store_row16(c10::BFloat16* p, __m512 v) { fxc::bf16_store(p, v, 0xFFFF); }
template <typename X>
constexpr bool kRows16 = std::is_same_v<X, float> || std::is_same_v<X, c10::BFloat16>;
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
struct OpsF256 {
  using Scalar = float;
  static constexpr int W = 8;
  using V = __m256;
  using I = __m256i;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a); }
  static I load_i(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V allowed(V s, I lo, I hi, int32_t j) {
    const __m256i jv = _mm256_set1_epi32(j);
    const __m256i bad = _mm256_or_si256(_mm256_cmpgt_epi32(lo, jv), _mm256_cmpgt_epi32(jv, hi));
    return _mm256_blendv_ps(s, _mm256_set1_ps(kNegInf), _mm256_castsi256_ps(bad));
  }
  static V exp_from(V s, V m) {
    const __m256 live = _mm256_cmp_ps(s, _mm256_set1_ps(kNegInf), _CMP_NEQ_OQ);
    return _mm256_and_ps(live, fxc::exp256(_mm256_sub_ps(s, m)));
  }
  static V finite_or_zero(V m) {
    return _mm256_andnot_ps(_mm256_cmp_ps(m, _mm256_set1_ps(kNegInf), _CMP_EQ_OQ), m);
  }
};
#endif

// ---------------------------------------------------------------------------------------------
// Problem, tiles, items.
// ---------------------------------------------------------------------------------------------

template <typename scalar_t, typename cache_t = scalar_t>
struct Problem {
  const scalar_t* q;  // [B, Hq, S, D], strides qs
  int64_t qs[4];
  const cache_t* kc;  // scalar_t, or int8 codes (KV8) with the scales below
  const cache_t* vc;
  int64_t B, Hq, Hkv, G, S, D, bs, MB, block_stride, tok_stride;
  const int64_t* bt;  // [B, MB] contiguous
  const int64_t* qp;  // [B, S] contiguous
  const int64_t* sl;  // [B]
  int64_t window;
  double scale, softcap;
  const double* sinks;  // [Hq] or null
  scalar_t* out;        // [B, S, Hq, D] contiguous
  const float* ksc = nullptr;  // KV8: k_scale / v_scale [Hkv] (x = code * scale); null for float caches
  const float* vsc = nullptr;
};

// Context tokens [lo, hi] that query token s of sequence b attends to (empty when hi < lo).
template <typename scalar_t, typename cache_t>
inline void row_range(const Problem<scalar_t, cache_t>& P, int64_t b, int64_t s, int64_t& lo, int64_t& hi) {
  const int64_t pos = P.qp[b * P.S + s];
  hi = std::min<int64_t>(pos, std::min<int64_t>(P.sl[b], P.MB * P.bs) - 1);
  lo = P.window > 0 ? std::max<int64_t>(0, pos - P.window + 1) : 0;
}

struct Tile {
  int64_t b, h, r0, nrows;  // rows r0 .. r0 + nrows - 1 of (b, h): row r = token r / G, group head r % G
  int64_t a, e;             // union of the rows' context ranges
  int64_t first_slot, pieces;
};

struct Item {
  int64_t tile, a, e, slot;  // context [a, e] of the tile; slot -1: the whole tile (write the output)
};

// ---------------------------------------------------------------------------------------------
// One item: a tile's rows over context [a, e].
// ---------------------------------------------------------------------------------------------

// O^T[d0 .. d0+DB) = O^T * corr + sum_t V[t][d] P^T[t]
template <typename Ops, int NR, int DB>
inline void pv_block(typename Ops::Scalar* ot, const typename Ops::Scalar* sc,
                     const typename Ops::Scalar* const* vp, int n, int64_t d0, const typename Ops::V* corr) {
  using V = typename Ops::V;
  constexpr int L = NR * Ops::W;
  V o[DB][NR];
#pragma GCC unroll 16
  for (int dd = 0; dd < DB; ++dd)
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) o[dd][r] = Ops::mul(Ops::load(ot + (d0 + dd) * L + r * Ops::W), corr[r]);
  for (int t = 0; t < n; ++t) {
    V p[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) p[r] = Ops::load(sc + t * L + r * Ops::W);
    const typename Ops::Scalar* v = vp[t] + d0;
#pragma GCC unroll 16
    for (int dd = 0; dd < DB; ++dd) {
      const V x = Ops::set1(v[dd]);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) o[dd][r] = Ops::fma(x, p[r], o[dd][r]);
    }
  }
#pragma GCC unroll 16
  for (int dd = 0; dd < DB; ++dd)
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) Ops::store(ot + (d0 + dd) * L + r * Ops::W, o[dd][r]);
}

inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// Buffer (in Scalars) one item needs.
template <int L, int KB>
constexpr int64_t item_buffer(int64_t D) {
  return 2 * D * L + (kChunk + KB) * L + 2 * kChunk * D + 3 * L + 64;
}

template <typename Ops, typename scalar_t, int NR, int KB, int DB, typename cache_t>
void run_item(const Problem<scalar_t, cache_t>& P, const Tile& tile, const Item& it, typename Ops::Scalar* buf,
              typename Ops::Scalar* part) {
  using T = typename Ops::Scalar;
  using V = typename Ops::V;
  using I = typename Ops::I;
  constexpr int W = Ops::W, L = NR * W;
  constexpr bool kConvert = !std::is_same_v<T, cache_t>;
  const int64_t D = P.D, G = P.G;
  T* qt = buf;                         // [D][L]
  T* ot = qt + D * L;                  // [D][L]
  T* sc = ot + D * L;                  // [kChunk + KB][L]
  T* kb = sc + (kChunk + KB) * L;      // [kChunk][D] converted K rows
  T* vb = kb + kChunk * D;             // [kChunk][D] converted V rows
  T* stats = vb + kChunk * D;          // m [L], l [L]
  alignas(64) int32_t lo[L], hi[L];
  const scalar_t* qrow[L];
  const T scale = static_cast<T>(P.ksc ? P.scale * static_cast<double>(P.ksc[tile.h]) : P.scale);
  for (int i = 0; i < L; ++i) {
    if (i < tile.nrows) {
      const int64_t row = tile.r0 + i, s = row / G, hq = tile.h * G + row % G;
      int64_t l0, h0;
      row_range(P, tile.b, s, l0, h0);
      lo[i] = static_cast<int32_t>(std::max(l0, it.a));
      hi[i] = static_cast<int32_t>(std::min(h0, it.e));
      qrow[i] = P.q + tile.b * P.qs[0] + hq * P.qs[1] + s * P.qs[2];
    } else {
      lo[i] = std::numeric_limits<int32_t>::max();
      hi[i] = -1;
      qrow[i] = nullptr;
    }
  }
  // Q^T, pre-scaled (zero lanes past the tile's rows): 16 x 16 blocks transposed in registers where the rows
  // are contiguous, else element by element; the same products either way.
  bool q_done = false;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<Ops, OpsF512> && kRows16<scalar_t>) {
    if (P.qs[3] == 1 && D % 16 == 0) {
      const __m512 sv = _mm512_set1_ps(scale);
      for (int i0 = 0; i0 < L; i0 += 16)
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          __m512 r[16];
          for (int j = 0; j < 16; ++j)
            r[j] = qrow[i0 + j] ? _mm512_mul_ps(load_row16(qrow[i0 + j] + d0), sv) : _mm512_setzero_ps();
          transpose16(r);
          for (int k = 0; k < 16; ++k) _mm512_storeu_ps(qt + (d0 + k) * L + i0, r[k]);
        }
      q_done = true;
    }
  }
#endif
  if (!q_done)
    for (int i = 0; i < L; ++i)
      for (int64_t d = 0; d < D; ++d) qt[d * L + i] = qrow[i] ? static_cast<T>(qrow[i][d * P.qs[3]]) * scale : T(0);
  std::fill(ot, ot + D * L, T(0));
  V m[NR], l[NR];
  I vlo[NR], vhi[NR];
  for (int r = 0; r < NR; ++r) {
    m[r] = Ops::set1(-std::numeric_limits<T>::infinity());
    l[r] = Ops::zero();
    vlo[r] = Ops::load_i(lo + r * W);
    vhi[r] = Ops::load_i(hi + r * W);
  }
  const int64_t* blocks = P.bt + tile.b * P.MB;
  const int64_t hoff = tile.h * D;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(cache_t));
  auto row_offset = [&](int64_t j) { return blocks[j / P.bs] * P.block_stride + (j % P.bs) * P.tok_stride + hoff; };
  const T* kp[kChunk + KB];
  const T* vp[kChunk];
  for (int64_t j0 = it.a; j0 <= it.e; j0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, it.e - j0 + 1));
    for (int t = 0; t < n; ++t) {
      const int64_t off = row_offset(j0 + t);
      if constexpr (kConvert) {
        const cache_t* ks = P.kc + off;
        const cache_t* vs = P.vc + off;
        T* kd = kb + t * D;
        T* vd = vb + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) kd[d] = static_cast<T>(ks[d]);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) vd[d] = static_cast<T>(vs[d]);
        kp[t] = kd;
        vp[t] = vd;
      } else {
        kp[t] = P.kc + off;
        vp[t] = P.vc + off;
      }
    }
    for (int t = n; t < kChunk + KB; ++t) kp[t] = kp[n - 1];
    // the next step's rows (random block ids: no hardware prefetcher would start them early)
    const int64_t j1 = j0 + kChunk;
    if (j1 <= it.e) {
      const int64_t n1 = std::min<int64_t>(kChunk, it.e - j1 + 1);
      for (int64_t t = 0; t < n1; ++t) {
        const int64_t off = row_offset(j1 + t);
        prefetch_row(P.kc + off, row_bytes);
        prefetch_row(P.vc + off, row_bytes);
      }
    }
    // scores S^T[t] = K[t] . Q^T, KB keys at a time
    for (int t0 = 0; t0 < n; t0 += KB) {
      V acc[KB][NR];
      const T* kr[KB];
#pragma GCC unroll 16
      for (int t = 0; t < KB; ++t) {
        kr[t] = kp[t0 + t];
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) acc[t][r] = Ops::zero();
      }
      const T* qd = qt;
      for (int64_t d = 0; d < D; ++d, qd += L) {
        V qv[NR];
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) qv[r] = Ops::load(qd + r * W);
#pragma GCC unroll 16
        for (int t = 0; t < KB; ++t) {
          const V x = Ops::set1(kr[t][d]);
#pragma GCC unroll 4
          for (int r = 0; r < NR; ++r) acc[t][r] = Ops::fma(x, qv[r], acc[t][r]);
        }
      }
#pragma GCC unroll 16
      for (int t = 0; t < KB; ++t)
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) Ops::store(sc + (t0 + t) * L + r * W, acc[t][r]);
    }
    if (P.softcap > 0)
      for (int64_t i = 0; i < static_cast<int64_t>(n) * L; ++i)
        sc[i] = static_cast<T>(std::tanh(sc[i] / P.softcap) * P.softcap);
    // online softmax, lane-parallel
    V corr[NR];
    for (int r = 0; r < NR; ++r) {
      V cm = Ops::set1(-std::numeric_limits<T>::infinity());
      for (int t = 0; t < n; ++t) {
        const V s = Ops::allowed(Ops::load(sc + t * L + r * W), vlo[r], vhi[r], static_cast<int32_t>(j0 + t));
        Ops::store(sc + t * L + r * W, s);
        cm = Ops::max(cm, s);
      }
      const V mn = Ops::max(m[r], cm);
      const V ms = Ops::finite_or_zero(mn);
      corr[r] = Ops::exp_from(m[r], ms);
      V sum = Ops::zero();
      for (int t = 0; t < n; ++t) {
        const V p = Ops::exp_from(Ops::load(sc + t * L + r * W), ms);
        Ops::store(sc + t * L + r * W, p);
        sum = Ops::add(sum, p);
      }
      l[r] = Ops::fma(l[r], corr[r], sum);
      m[r] = mn;
    }
    int64_t d0 = 0;
    for (; d0 + DB <= D; d0 += DB) pv_block<Ops, NR, DB>(ot, sc, vp, n, d0, corr);
    for (; d0 < D; ++d0) pv_block<Ops, NR, 1>(ot, sc, vp, n, d0, corr);
  }
  T* ms = stats;
  T* ls = stats + L;
  for (int r = 0; r < NR; ++r) {
    Ops::store(ms + r * W, m[r]);
    Ops::store(ls + r * W, l[r]);
  }
  // Per row: where O goes and its factor (partial results: m, l and O unnormalised).
  alignas(64) T inv[L];
  void* dst[L];
  for (int64_t i = 0; i < L; ++i) {
    inv[i] = T(0);
    dst[i] = nullptr;
    if (i >= tile.nrows) continue;
    const int64_t row = tile.r0 + i, s = row / G, hq = tile.h * G + row % G;
    if (it.slot >= 0) {
      T* pp = part + (it.slot * L + i) * (D + 2);
      pp[0] = ms[i];
      pp[1] = ls[i];
      dst[i] = pp + 2;
      inv[i] = T(1);
      continue;
    }
    dst[i] = P.out + ((tile.b * P.S + s) * P.Hq + hq) * D;
    if (ms[i] == -std::numeric_limits<T>::infinity()) continue;  // nothing to attend to: zeros, below
    // a sink joins the softmax's denominator only: exp(sink - max) beside the row's sum
    const T sink = P.sinks ? static_cast<T>(std::exp(P.sinks[hq] - static_cast<double>(ms[i]))) : T(0);
    inv[i] = T(1) / (ls[i] + sink) * (P.vsc ? static_cast<T>(P.vsc[tile.h]) : T(1));
  }
  auto out_row = [&](int64_t i, auto* d) {  // element by element (x * 1 is x: partial rows keep their bits)
    using D_t = std::remove_pointer_t<decltype(d)>;
    for (int64_t k = 0; k < D; ++k) d[k] = static_cast<D_t>(ot[k * L + i] * inv[i]);
  };
  bool o_done = false;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<Ops, OpsF512> && kRows16<scalar_t>) {
    if (D % 16 == 0) {  // 16 x 16 blocks of O^T scaled by their rows' factors, transposed in registers
      for (int i0 = 0; i0 < L && i0 < tile.nrows; i0 += 16) {
        const __m512 iv = _mm512_loadu_ps(inv + i0);
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          __m512 r[16];
          for (int k = 0; k < 16; ++k) r[k] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + k) * L + i0), iv);
          transpose16(r);
          for (int j = 0; j < 16 && i0 + j < tile.nrows; ++j) {
            if (it.slot >= 0) store_row16(static_cast<T*>(dst[i0 + j]) + d0, r[j]);
            else store_row16(static_cast<scalar_t*>(dst[i0 + j]) + d0, r[j]);
          }
        }
      }
      o_done = true;
    }
  }
#endif
  for (int64_t i = 0; i < tile.nrows; ++i) {
    if (!o_done) {
      if (it.slot >= 0) out_row(i, static_cast<T*>(dst[i]));
      else out_row(i, static_cast<scalar_t*>(dst[i]));
    }
    if (it.slot < 0 && ms[i] == -std::numeric_limits<T>::infinity()) {
      scalar_t* d = static_cast<scalar_t*>(dst[i]);
      std::fill(d, d + D, scalar_t(0));
    }
  }
}

// The pieces of a split tile, merged (log-sum-exp) into its output rows.
template <typename T, typename scalar_t, typename cache_t>
void merge_tile(const Problem<scalar_t, cache_t>& P, const Tile& tile, const T* part, int L) {
  const int64_t D = P.D, G = P.G;
  std::vector<T> acc(D);
  for (int64_t i = 0; i < tile.nrows; ++i) {
    const int64_t row = tile.r0 + i, s = row / G, hq = tile.h * G + row % G;
    scalar_t* dst = P.out + ((tile.b * P.S + s) * P.Hq + hq) * D;
    T mx = -std::numeric_limits<T>::infinity();
    for (int64_t k = 0; k < tile.pieces; ++k) mx = std::max(mx, part[((tile.first_slot + k) * L + i) * (D + 2)]);
    if (mx == -std::numeric_limits<T>::infinity()) {
      for (int64_t d = 0; d < D; ++d) dst[d] = scalar_t(0);
      continue;
    }
    T denom = 0;
    std::fill(acc.begin(), acc.end(), T(0));
    for (int64_t k = 0; k < tile.pieces; ++k) {
      const T* pp = part + ((tile.first_slot + k) * L + i) * (D + 2);
      if (pp[0] == -std::numeric_limits<T>::infinity()) continue;
      const T w = std::exp(pp[0] - mx);
      denom += w * pp[1];
      for (int64_t d = 0; d < D; ++d) acc[d] += w * pp[2 + d];
    }
    if (P.sinks) denom += static_cast<T>(std::exp(P.sinks[hq] - static_cast<double>(mx)));
    const T inv = T(1) / denom * (P.vsc ? static_cast<T>(P.vsc[tile.h]) : T(1));
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[d] * inv);
  }
}

template <typename Ops, typename scalar_t, int NR, int KB, int DB, typename cache_t>
void run(const Problem<scalar_t, cache_t>& P) {
  using T = typename Ops::Scalar;
  constexpr int L = NR * Ops::W;
  const int64_t rows = P.S * P.G;
  // Tiles, with the union of their rows' context ranges; rows of an empty tile output zeros here.
  std::vector<Tile> tiles;
  int64_t total = 0;
  for (int64_t b = 0; b < P.B; ++b)
    for (int64_t h = 0; h < P.Hkv; ++h)
      for (int64_t r0 = 0; r0 < rows; r0 += L) {
        const int64_t nrows = std::min<int64_t>(L, rows - r0);
        int64_t a = std::numeric_limits<int64_t>::max(), e = -1;
        for (int64_t s = r0 / P.G; s <= (r0 + nrows - 1) / P.G; ++s) {
          int64_t lo, hi;
          row_range(P, b, s, lo, hi);
          if (hi >= lo) {
            a = std::min(a, lo);
            e = std::max(e, hi);
          }
        }
        if (e < 0) {
          for (int64_t i = 0; i < nrows; ++i) {
            const int64_t row = r0 + i, s = row / P.G, hq = h * P.G + row % P.G;
            scalar_t* dst = P.out + ((b * P.S + s) * P.Hq + hq) * P.D;
            std::fill(dst, dst + P.D, scalar_t(0));
          }
          continue;
        }
        tiles.push_back(Tile{b, h, r0, nrows, a, e, -1, 1});
        total += e - a + 1;
      }
  if (tiles.empty()) return;
  const int64_t T_ = at::in_parallel_region() ? 1 : std::max<int64_t>(1, at::get_num_threads());
  // Few tiles for the threads: cut each tile's context into pieces of >= kMinPieceKeys tokens at block
  // boundaries, so that there are about three items per thread.
  const int64_t ntiles = static_cast<int64_t>(tiles.size());
  const int64_t want = T_ > 1 && ntiles < 3 * T_ ? (3 * T_ + ntiles - 1) / ntiles : 1;
  std::vector<Item> items;
  int64_t nslots = 0;
  for (int64_t ti = 0; ti < ntiles; ++ti) {
    Tile& tl = tiles[ti];
    const int64_t span = tl.e - tl.a + 1;
    const int64_t np = std::max<int64_t>(1, std::min<int64_t>(want, span / kMinPieceKeys));
    if (np == 1) {
      items.push_back(Item{ti, tl.a, tl.e, -1});
      continue;
    }
    tl.first_slot = nslots;
    int64_t a = tl.a, k = 0;
    for (int64_t p = 1; p <= np; ++p) {
      int64_t e = p == np ? tl.e : (tl.a + span * p / np) / P.bs * P.bs - 1;
      if (e < a) continue;
      e = std::min(e, tl.e);
      items.push_back(Item{ti, a, e, nslots + k++});
      a = e + 1;
      if (a > tl.e) break;
    }
    tl.pieces = k;
    nslots += k;
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.e - x.a > y.e - y.a; });
  std::vector<T> part(static_cast<size_t>(nslots * L * (P.D + 2)));
  std::atomic<int64_t> next{0};
  const int64_t nitems = static_cast<int64_t>(items.size());
  auto worker = [&]() {
    static thread_local std::vector<T> buf;
    const size_t need = static_cast<size_t>(item_buffer<L, KB>(P.D));
    if (buf.size() < need) buf.resize(need);
    for (int64_t k; (k = next.fetch_add(1)) < nitems;)
      run_item<Ops, scalar_t, NR, KB, DB>(P, tiles[items[k].tile], items[k], buf.data(), part.data());
  };
  const int64_t nthreads = std::min<int64_t>(T_, nitems);
  if (nthreads <= 1) {
    worker();
  } else {
    at::parallel_for(0, nthreads, 1, [&](int64_t tb, int64_t te) {
      for (int64_t t = tb; t < te; ++t) worker();
    });
  }
  for (const Tile& tl : tiles)
    if (tl.first_slot >= 0) merge_tile<T, scalar_t, cache_t>(P, tl, part.data(), L);
}

}  // namespace

// Attention of query [B, Hq, S, D] over the paged cache (already holding this step's rows) into
// out [B, S, Hq, D] (contiguous): the flash kernel.  Any head_dim; query, caches and out of one dtype, or int8
// caches (KV8) with their float32 scales [Hkv] (kscales / vscales; null for float caches).
void fxc_flash_attend(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const torch::Tensor& block_table, const torch::Tensor& query_pos, const torch::Tensor& seq_lens,
                      double scale, int64_t window, double softcap, const double* sinks, torch::Tensor& out,
                      const float* kscales, const float* vscales) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "fxc::paged_attention (flash kernel): caches and output must be contiguous");
  const bool f8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  const bool q8 = k_cache.scalar_type() == at::kChar || f8;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && (q8 ? kscales && vscales
                                                                     : query.scalar_type() == k_cache.scalar_type()),
              "fxc::paged_attention (flash kernel): query/cache dtypes must match (or int8/fp8 caches with scales)");
  const auto bt = block_table.to(torch::kLong).contiguous();
  const auto qp = query_pos.to(torch::kLong).contiguous();
  const auto sl = seq_lens.to(torch::kLong).contiguous();
  const int64_t B = query.size(0), Hq = query.size(1), S = query.size(2), D = query.size(3);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(Hq % Hkv == 0, "fxc::paged_attention: query heads (", Hq, ") must be a multiple of KV heads (", Hkv, ")");
  TORCH_CHECK(bs * bt.size(1) < std::numeric_limits<int32_t>::max(), "fxc::paged_attention: context too long");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "fxc_flash_attend", [&] {
    auto launch = [&](auto cache_tag) {
      using cache_t = decltype(cache_tag);
      Problem<scalar_t, cache_t> P{query.data_ptr<scalar_t>(),
                                   {query.stride(0), query.stride(1), query.stride(2), query.stride(3)},
                                   static_cast<const cache_t*>(k_cache.data_ptr()),
                                   static_cast<const cache_t*>(v_cache.data_ptr()),
                                   B, Hq, Hkv, Hq / Hkv, S, D, bs, bt.size(1), bs * Hkv * D, Hkv * D,
                                   bt.data_ptr<int64_t>(), qp.data_ptr<int64_t>(), sl.data_ptr<int64_t>(),
                                   window, scale, softcap, sinks, out.data_ptr<scalar_t>(), kscales, vscales};
      using acc_t = typename fxc::Acc<scalar_t>::type;
      if constexpr (std::is_same_v<acc_t, double>) {
        run<OpsGeneric<double, 8>, scalar_t, 2, 4, 4>(P);
      } else {
        const bool wide = S * (Hq / Hkv) > 16;  // 32-row tiles where the rows fill them
#if defined(__AVX512F__)
        if (wide) run<OpsF512, scalar_t, 2, 8, 8>(P);
        else run<OpsF512, scalar_t, 1, 8, 8>(P);
#elif defined(__AVX2__)
        (void)wide;
        run<OpsF256, scalar_t, 2, 4, 4>(P);
#else
        (void)wide;
        run<OpsGeneric<float, 16>, scalar_t, 1, 4, 4>(P);
#endif
      }
    };
    if (f8) launch(fxc::e4m3{});
    else if (q8) launch(int8_t{});
    else launch(scalar_t{});
  });
}
