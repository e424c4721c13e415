// Shared helpers of fxcompiler's CPU kernels: the accumulation type per dtype and a
// vectorised exp (Cephes-style polynomial, ~2 ulp on [-88, 88]).
#pragma once

#include <cmath>
#include <cstdint>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fxc {

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

#ifdef __AVX512F__
inline __m512 exp512(__m512 v) {
  v = _mm512_max_ps(_mm512_min_ps(v, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(v, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  v = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), v);
  v = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), v);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(v, v), _mm512_add_ps(v, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// silu(g) * u in fp32, 16 lanes: g / (1 + exp512(-g)) * u. fxc::silu_mul's fp32 kernel and the fused W4A8
// gate/up epilogue (w8a8_kernels.cpp) both call this, so the fused op equals the two ops bit for bit.
inline __m512 silu_mul512(__m512 g, __m512 u) {
  const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(s, u);
}

// Lane t of the result = the sum of the 16 lanes of v[t]: a transpose-add tree (45 ops for 16
// horizontal sums instead of ~10 each).
inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit chunk: [v0a+v0c, v1a+v1c, v0b+v0d, v1b+v1d]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit chunk: the chunk's partial sums of v[4i..4i+3]
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
  const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp on 8 lanes (AVX2 + FMA): exp512's polynomial.
inline __m256 exp256(__m256 v) {
  v = _mm256_max_ps(_mm256_min_ps(v, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(v, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  v = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), v);
  v = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), v);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(v, v), _mm256_add_ps(v, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// x[i] = exp(x[i]) over a row.
inline void exp_row(float* x, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp512(_mm512_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

inline void exp_row(double* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
}

}  // namespace fxc
