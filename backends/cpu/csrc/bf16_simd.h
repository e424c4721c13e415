// bf16 <-> fp32 in AVX-512 registers and the bf16 silu step, shared by csrc/fused_ops.cpp (fxc::silu_mul,
// rope, rms_norm) and csrc/fxc_kernels.cpp (the linear epilogues), so a fused epilogue equals the separate
// ops bit for bit by construction.  Widening is exact; narrowing rounds to nearest even (NaN -> 0x7FC0),
// what c10::BFloat16 and ATen's cvtfp32_bf16 do.
#pragma once

#ifdef __AVX512F__
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sleef.h>  // shipped with torch; libtorch_cpu exports the functions ATen's Vectorized<float> uses

#include <cstdint>

namespace fxc {

inline __m512 bf16_load(const c10::BFloat16* p, __mmask16 k) {
  const __m256i h = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fp32 -> bf16 bits, 16 at a time.
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

// silu(g) * u as ATen computes F.silu(gate) * up on bf16 tensors, from the widened bf16 values g and u: silu in
// fp32 as g / (1 + exp(-g)) with Sleef's expf (u10, what Vectorized<float>::exp() calls), rounded to bf16; the
// product in fp32 (the caller rounds it to bf16).
inline __m512 silu_mul_bf16_512(__m512 g, __m512 u) {
  const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 s = bf16_r(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
  return _mm512_mul_ps(s, u);
}

}  // namespace fxc
#endif
