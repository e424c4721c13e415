// fxcompiler CPU quantized-weight kernels (issue 17): fxc::linear_w4, fxc::linear_f8, fxc::linear_f8f8.
//
//   fxc::linear_w4(x, w_int4_packed, scales, mins, bias?, n, group_size)
//   fxc::linear_f8(x, w_f8_packed, scales, bias?, n)
//   fxc::linear_f8f8(x, w_f8_packed, scales, bias?, n): linear_f8 on x's rows quantized per token to e4m3
//
// Schema, fake kernel and ATen reference: fxcompiler/ops/quant_linear.py. Layout (NB = 32 columns
// per panel, P = ceil(N/32), G = ceil(K/group_size)):
//   w_int4_packed uint8 [P, K/2, 32]: byte[p, i, j] = q[32p+j, 2i] | q[32p+j, 2i+1] << 4
//   scales, mins  float or half [P, G, 32] (both the same): w = fl(fl(s * q) + m); fp16 ones (GGUF's own
//                 precision: 0.625 byte per weight in all, not 0.75) are upcast exactly with F16C
//
// M <= 4 (decode): each panel is streamed once and dequantised in registers, per group
// s * sum(q * x) + m * sum(x) (direct_w4; the rows' group sums are computed once per call); nibbles become
// floats through a vpermps table (AVX-512); each thread walks its panels as up to 4 streams in lock step.
// M > 4: each (row block, panel) task dequantises its panel into an fp32 [K, 32] tile (bit-exactly the
// reference's values: built with -ffp-contract=off, multiply then add) and multiplies the rows
// of x with it from L1/L2 with a register-blocked micro-kernel (up to 12 rows x 32 columns on AVX-512, 4 on
// AVX2). The weight is
// streamed once per row block at 0.5 byte per value, which is what makes batch-1 decode faster
// than fp32/bf16 weights.
//
// fxc::linear_f8: w_f8_packed float8_e4m3fn [P, K, 32] (fxc::linear_w8's layout), scales float [P*32]
// (one per output channel); w = s * float(q). The e4m3 byte is upcast in the kernel with F16C: its
// magnitude bits shifted left by 7 are the fp16 with the same exponent and mantissa fields, which is
// the e4m3 value times 2^-8 (subnormals included; vcvtph2ps converts fp16 subnormals exactly, whatever
// MXCSR.DAZ says), the sign moves to bit 15, and the NaN codes 0x7F/0xFF become fp16 NaN. The 2^8 is
// folded into the per-channel scale, applied once per output. M <= 4 (decode) streams the panel
// directly, one byte per weight, converting 32 values per k with fmadds into R x 32 accumulators;
// larger M converts each panel once per 64-row block into an fp32 tile and reuses micro<R>.
//
// Build flags choose the ISA: -DFXC_AVX512 (intrinsics) or -DFXC_AVX2 (the same loops written for
// the compiler's auto-vectoriser; linear_f8's upcast uses AVX2 + F16C intrinsics).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include "count_dispatch.h"  // fxc::with_count
#include "kv_fp8.h"  // fxc::e4m3_encode: c10's e4m3 encoder after the +-448 clamp (linear_f8f8's rows)
#ifdef __AVX512F__
#include "bf16_simd.h"  // bf16 rounding and the bf16 silu step, shared with csrc/fused_ops.cpp
#include "simd_math.h"  // fxc::silu_mul512, fxc::silu_mul's fp32 step
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace fxcq {
namespace {

constexpr int NB = 32;
constexpr int64_t MB = 64;  // rows of x per task

// tile[k][j] = s[g][j] * q[k][j] + m[g][j] for k in [0, K)
void dequant_panel(const uint8_t* w, const float* sc, const float* mn, int64_t K, int64_t gs, float* tile) {
  for (int64_t i = 0; i < K / 2; ++i) {
    const int64_t k = 2 * i;
    const float* s = sc + (k / gs) * NB;
    const float* m = mn + (k / gs) * NB;
    const uint8_t* b = w + i * NB;
#if defined(FXC_AVX512)
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(bytes, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
    const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
    const __m512 m0 = _mm512_loadu_ps(m), m1 = _mm512_loadu_ps(m + 16);
    auto cv = [](__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); };
    float* t0 = tile + k * NB;
    float* t1 = t0 + NB;
    _mm512_storeu_ps(t0, _mm512_add_ps(_mm512_mul_ps(cv(_mm256_castsi256_si128(lo)), s0), m0));
    _mm512_storeu_ps(t0 + 16, _mm512_add_ps(_mm512_mul_ps(cv(_mm256_extracti128_si256(lo, 1)), s1), m1));
    _mm512_storeu_ps(t1, _mm512_add_ps(_mm512_mul_ps(cv(_mm256_castsi256_si128(hi)), s0), m0));
    _mm512_storeu_ps(t1 + 16, _mm512_add_ps(_mm512_mul_ps(cv(_mm256_extracti128_si256(hi, 1)), s1), m1));
#else
    float* t0 = tile + k * NB;
    float* t1 = t0 + NB;
    for (int j = 0; j < NB; ++j) {
      t0[j] = static_cast<float>(b[j] & 0x0F) * s[j] + m[j];
      t1[j] = static_cast<float>(b[j] >> 4) * s[j] + m[j];
    }
#endif
  }
}

#ifdef __AVX512F__
constexpr int MRQ = 12;  // rows per micro-kernel call: 2 * MRQ accumulators of 32 zmm
#else
constexpr int MRQ = 4;   // 16 ymm
#endif

// acc[r][0..32) = sum_k x[r][k] * tile[k][.] for R rows.  Its own function (never inlined into a caller's
// dispatch, where GCC may keep the accumulators on the stack); a row's sums do not depend on R.
template <int R>
__attribute__((noinline)) void micro(const float* x, int64_t ldx, const float* tile, int64_t K, float* acc) {
#if defined(FXC_AVX512)
  __m512 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 t0 = _mm512_loadu_ps(tile + k * NB), t1 = _mm512_loadu_ps(tile + k * NB + 16);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      a[r][0] = _mm512_fmadd_ps(xb, t0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(xb, t1, a[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * NB, a[r][0]);
    _mm512_storeu_ps(acc + r * NB + 16, a[r][1]);
  }
#else
  float a[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) a[r][j] = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const float* t = tile + k * NB;
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
#pragma GCC ivdep
      for (int j = 0; j < NB; ++j) a[r][j] += xv * t[j];
    }
  }
  std::memcpy(acc, a, sizeof(float) * R * NB);
#endif
}

// micro<rows>(...) for 1 <= rows <= MRQ.
inline void micro_rows(int rows, const float* x, int64_t ldx, const float* tile, int64_t K, float* acc) {
  fxc::with_count<MRQ>(rows, [&](auto c) { micro<decltype(c)::value>(x, ldx, tile, K, acc); });
}

// The row group size for the rows [r0, r1): balanced, at most MRQ (64 rows: 11 at a time, the last 9; not 4).
inline int64_t row_group(int64_t r0, int64_t r1) {
  const int64_t rows = r1 - r0, groups = (rows + MRQ - 1) / MRQ;
  return (rows + groups - 1) / groups;
}

// ---------------------------------------------------------------------------------------------------
// linear_w4, M <= 4 (decode): the packed panel is streamed once, 0.5 byte per weight plus the group's
// scales and mins, and dequantised in registers. Each weight is fl(fl(s*q) + m), bit-exactly the value
// of the tile path and of the reference (mul then add, no fusion), and is multiplied into R x 32
// accumulators; only the order of the fp32 sum differs. Even and odd k (low and high nibble) go to
// separate accumulators for R <= 2, so that the FMA chains are half as long.
// ---------------------------------------------------------------------------------------------------
#if defined(FXC_AVX512)
struct V4 {
  using reg = __m512;
  using ireg = __m512i;
  static constexpr int L = 16;
  static inline ireg bytes(const uint8_t* p) {  // L bytes -> L dwords
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // nibble -> float through a {0, 1, ..., 15} table: vpermps reads only the low 4 bits of each index,
  // so the low nibble needs no mask (one p5 uop in place of an and and a cvtdq2ps)
  static inline reg table() { return _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }
  static inline reg lo(ireg v) { return _mm512_permutexvar_ps(v, table()); }
  static inline reg hi(ireg v) { return _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table()); }
  static inline reg load(const float* p) { return _mm512_loadu_ps(p); }
  static inline reg load(const uint16_t* p) {  // L fp16 -> fp32, exact
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static inline reg zero() { return _mm512_setzero_ps(); }
  static inline reg set1(float f) { return _mm512_set1_ps(f); }
  static inline reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static inline reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static inline reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
};
#else
struct V4 {
  using reg = __m256;
  using ireg = __m256i;
  static constexpr int L = 8;
  static inline ireg bytes(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static inline reg lo(ireg v) { return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F))); }
  static inline reg hi(ireg v) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)); }
  static inline reg load(const float* p) { return _mm256_loadu_ps(p); }
  static inline reg load(const uint16_t* p) {  // L fp16 -> fp32, exact (F16C)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static inline reg zero() { return _mm256_setzero_ps(); }
  static inline reg set1(float f) { return _mm256_set1_ps(f); }
  static inline reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static inline reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static inline reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
};
#endif

constexpr int kW4PrefetchBytes = 2048;  // weight stream prefetch distance

// n fp16 values (n a multiple of 8) -> fp32, exactly (vcvtph2ps: subnormals too, whatever MXCSR says)
inline void half_to_float(const uint16_t* src, float* dst, int64_t n) {
#if defined(FXC_AVX512)
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  for (; i < n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#else
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
}

// acc[s][r][0..32) = sum_g (s[g] * sum_{k in g} x[r][k] q[k][.] + m[g] * xsum[r][g]) straight from the packed
// panels w[s] (R rows of x, ldx apart; xsum [R, G] are the rows' group sums). S panels are walked in lock step:
// one core draws more DRAM bandwidth from several sequential streams than from one (fxc_kernels.cpp's
// multi-stream GEMV), and the S independent accumulator sets hide the FMA latency. A panel's arithmetic is the
// same whatever S is (the streams only interleave), so the output does not depend on the thread count.
// Sc: float, or uint16_t for fp16 scales and mins (upcast as they are loaded, once per group).
template <int R, int S, typename Sc>
inline void direct_w4(const float* x, int64_t ldx, const float* xsum, int64_t G, const uint8_t* const* w,
                      const Sc* const* sc, const Sc* const* mn, int64_t K, int64_t gs, float* const* acc) {
  using V = V4;
  using reg = typename V::reg;
  constexpr int NV = NB / V::L;
  reg fin[S][R][NV];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) fin[s][r][v] = V::zero();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k0 = g * gs, k1 = std::min(K, k0 + gs);
    reg a[S][R][NV];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) a[s][r][v] = V::zero();
    for (int64_t k = k0; k < k1; k += 2) {
      reg x0[R], x1[R];
      for (int r = 0; r < R; ++r) {
        x0[r] = V::set1(x[r * ldx + k]);
        x1[r] = V::set1(x[r * ldx + k + 1]);
      }
      for (int s = 0; s < S; ++s) {
        const uint8_t* b = w[s] + (k / 2) * NB;
        if ((k & 2) == 0) _mm_prefetch(reinterpret_cast<const char*>(b) + kW4PrefetchBytes, _MM_HINT_T0);
        reg q0[NV], q1[NV];
        for (int v = 0; v < NV; ++v) {
          const typename V::ireg q = V::bytes(b + v * V::L);
          q0[v] = V::lo(q);
          q1[v] = V::hi(q);
        }
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < NV; ++v) a[s][r][v] = V::fmadd(x1[r], q1[v], V::fmadd(x0[r], q0[v], a[s][r][v]));
      }
    }
    for (int s = 0; s < S; ++s)
      for (int v = 0; v < NV; ++v) {
        const reg sv = V::load(sc[s] + g * NB + v * V::L), mv = V::load(mn[s] + g * NB + v * V::L);
        for (int r = 0; r < R; ++r) {
          fin[s][r][v] = V::fmadd(sv, a[s][r][v], fin[s][r][v]);
          fin[s][r][v] = V::fmadd(mv, V::set1(xsum[r * G + g]), fin[s][r][v]);
        }
      }
  }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) V::store(acc[s] + r * NB + v * V::L, fin[s][r][v]);
}

// streams per thread for R rows: the accumulators (2 * S * R * NV registers) stay within 16
constexpr int w4_streams(int r) {
  const int s = 8 / (r * (NB / V4::L));
  return s >= 4 ? 4 : (s < 1 ? 1 : s);
}

// panels [p0, p0 + SS * base) of an M = R call as SS contiguous sub-ranges of base panels walked in lock step;
// emit(p, acc) writes a panel's R x 32 results.
template <int R, int SS, typename Sc, typename Emit>
void lockstep(int64_t p0, int64_t base, const float* x, int64_t ldx, const float* xsum, int64_t G,
              const uint8_t* wp, const Sc* sp, const Sc* mp, int64_t K, int64_t gs, const Emit& emit) {
  alignas(64) float acc[SS][R * NB];
  for (int64_t i = 0; i < base; ++i) {
    const uint8_t* ws[SS];
    const Sc* ss[SS];
    const Sc* ms[SS];
    float* as[SS];
    for (int s = 0; s < SS; ++s) {
      const int64_t p = p0 + s * base + i;
      ws[s] = wp + p * (K / 2) * NB;
      ss[s] = sp + p * G * NB;
      ms[s] = mp + p * G * NB;
      as[s] = acc[s];
    }
    direct_w4<R, SS>(x, ldx, xsum, G, ws, ss, ms, K, gs, as);
    for (int s = 0; s < SS; ++s) emit(p0 + s * base + i, acc[s]);
  }
}

template <int R, typename Sc, typename Emit>
void lockstep_n(int ss, int64_t p0, int64_t base, const float* x, int64_t ldx, const float* xsum, int64_t G,
                const uint8_t* wp, const Sc* sp, const Sc* mp, int64_t K, int64_t gs, const Emit& emit) {
  constexpr int S = w4_streams(R);
  switch (ss) {
    case 4: if constexpr (S >= 4) { lockstep<R, 4>(p0, base, x, ldx, xsum, G, wp, sp, mp, K, gs, emit); break; }
            [[fallthrough]];
    case 3: if constexpr (S >= 3) { lockstep<R, 3>(p0, base, x, ldx, xsum, G, wp, sp, mp, K, gs, emit); break; }
            [[fallthrough]];
    case 2: if constexpr (S >= 2) { lockstep<R, 2>(p0, base, x, ldx, xsum, G, wp, sp, mp, K, gs, emit); break; }
            [[fallthrough]];
    default: lockstep<R, 1>(p0, base * ss, x, ldx, xsum, G, wp, sp, mp, K, gs, emit); break;
  }
}

// panels [p0, p1) of an M = R (<= 4) call: up to S = w4_streams(R) contiguous sub-ranges walked in lock step,
// the leftover panels as one more lock-step group. The stream count is chosen so that no panel is left to
// run alone where that can be avoided (9 panels: 3 x 3, not 4 x 2 + 1): one panel's accumulator chains wait
// on FMA latency.
template <int R, typename Sc, typename Emit>
void direct_panels(int64_t p0, int64_t p1, const float* x, int64_t ldx, const float* xsum, int64_t G,
                   const uint8_t* wp, const Sc* sp, const Sc* mp, int64_t K, int64_t gs, const Emit& emit) {
  constexpr int S = w4_streams(R);
  const int64_t cnt = p1 - p0;
  if (cnt <= 0) return;
  int ss = static_cast<int>(std::min<int64_t>(S, cnt));
  for (int c = ss; c >= 2; --c)
    if (cnt % c != 1) {
      ss = c;
      break;
    }
  const int64_t base = cnt / ss, rem = cnt % ss;
  lockstep_n<R>(ss, p0, base, x, ldx, xsum, G, wp, sp, mp, K, gs, emit);
  if (rem > 0) lockstep_n<R>(static_cast<int>(rem), p0 + base * ss, 1, x, ldx, xsum, G, wp, sp, mp, K, gs, emit);
}

template <typename Sc, typename Emit>
void direct_rows(int rows, int64_t p0, int64_t p1, const float* x, int64_t ldx, const float* xsum, int64_t G,
                 const uint8_t* wp, const Sc* sp, const Sc* mp, int64_t K, int64_t gs, const Emit& emit) {
  switch (rows) {
    case 4: direct_panels<4>(p0, p1, x, ldx, xsum, G, wp, sp, mp, K, gs, emit); break;
    case 3: direct_panels<3>(p0, p1, x, ldx, xsum, G, wp, sp, mp, K, gs, emit); break;
    case 2: direct_panels<2>(p0, p1, x, ldx, xsum, G, wp, sp, mp, K, gs, emit); break;
    default: direct_panels<1>(p0, p1, x, ldx, xsum, G, wp, sp, mp, K, gs, emit); break;
  }
}

// Rows per call that linear_w4_silu_mul computes with gate and up panels paired as lock-step streams (at least
// two streams fit the register budget); more rows run linear_w4, then fxc::silu_mul.
constexpr bool w4_silu_pairs(int64_t rows) { return rows >= 1 && rows <= 4 && w4_streams(static_cast<int>(rows)) >= 2; }

// linear_w4's body. residual ([..., n], x's dtype): added to each output as the graph's `residual + linear(x)` would
// (fp32: fl(y + r); bf16: y rounded to bf16 first, the sum in fp32, rounded again). silu (AVX-512 builds, n = 2H
// with H % 32 == 0, w4_silu_pairs(M): the caller checks): the output is silu(y[..., :H]) * y[..., H:], formed per
// pair of gate panel j and up panel j + H/32 computed together.
at::Tensor w4_linear(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                     const at::Tensor& mins, const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size,
                     const at::Tensor* residual, bool silu) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              op, ": x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t K = x.size(-1);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.size(1) * 2 == K && w.size(2) == NB &&
                  w.is_contiguous(),
              op, ": packed weight must be contiguous uint8 [P, K/2, 32] with K=", K, ", got ", w.sizes());
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0, op, ": group_size must be positive and even, got ",
              group_size);
  const int64_t P = w.size(0);
  const int64_t G = (K + group_size - 1) / group_size;
  TORCH_CHECK(n >= 0 && n <= P * NB, op, ": n=", n, " larger than the packed panels");
  TORCH_CHECK(scales.scalar_type() == mins.scalar_type() &&
                  (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf),
              op, ": scales and mins must both be float32 or both float16, got ", scales.scalar_type(),
              " and ", mins.scalar_type());
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->is_contiguous() && t->dim() == 3 && t->size(0) == P && t->size(1) == G && t->size(2) == NB,
                op, ": scales/mins must be contiguous [P, G, 32] = [", P, ", ", G, ", 32], got ", t->sizes());
  }
  const bool half_sm = scales.scalar_type() == at::kHalf;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = silu ? n / 2 : n;
  at::Tensor out = at::empty(out_shape, x.options());
  at::Tensor rc;
  if (residual != nullptr) {
    TORCH_CHECK(residual->sizes() == out.sizes() && residual->scalar_type() == x.scalar_type(), op,
                ": residual must be ", x.scalar_type(), " ", out.sizes(), " (the output's shape), got ",
                residual->scalar_type(), " ", residual->sizes());
    rc = residual->contiguous();
  }
  const int64_t M = K ? x.numel() / K : 0;
  if (M == 0 || n == 0) return out;
  at::Tensor xf = x.reshape({M, K}).to(at::kFloat).contiguous();
  std::vector<float> bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias must be [n]");
    at::Tensor b = bias->to(at::kFloat).contiguous();
    bf.assign(b.data_ptr<float>(), b.data_ptr<float>() + n);
  }
  const float* rf = rc.defined() && x.scalar_type() == at::kFloat ? rc.data_ptr<float>() : nullptr;
  const c10::BFloat16* rb = rc.defined() && x.scalar_type() == at::kBFloat16 ? rc.data_ptr<c10::BFloat16>() : nullptr;
  const float* xp = xf.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = half_sm ? nullptr : scales.data_ptr<float>();
  const float* mp = half_sm ? nullptr : mins.data_ptr<float>();
  const uint16_t* sph = half_sm ? reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()) : nullptr;
  const uint16_t* mph = half_sm ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr;
  const bool out_bf16 = x.scalar_type() == at::kBFloat16;
  float* of = out_bf16 ? nullptr : out.data_ptr<float>();
  c10::BFloat16* ob = out_bf16 ? out.data_ptr<c10::BFloat16>() : nullptr;
  const bool direct = M <= 4;  // decode: stream the packed panel once, no tile
  std::vector<float> xs(direct ? static_cast<size_t>(M * G) : 0);  // group sums of x's rows
  for (int64_t r = 0; direct && r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      float t = 0.f;
      for (int64_t k = g * group_size; k < std::min(K, (g + 1) * group_size); ++k) t += xp[r * K + k];
      xs[r * G + g] = t;
    }
  // one panel's rows [r0, r0 + rows) of results (acc: rows x 32) plus the bias (and the residual), in x's dtype
  auto emit = [&](int64_t p, int64_t r0, int rows, const float* acc) {
    const int64_t cols = std::min<int64_t>(NB, n - p * NB);
#ifdef __AVX512F__
    // the scalar loop of AVX2 builds, 16 columns at a time (the same operations in the same order)
    for (int h = 0; h < NB; h += 16) {
      const int64_t c = cols - h;
      if (c <= 0) break;
      const __mmask16 k = c >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << c) - 1);
      const __m512 b = bf.empty() ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(k, bf.data() + p * NB + h);
      for (int r = 0; r < rows; ++r) {
        const int64_t base = (r0 + r) * n + p * NB + h;
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc + r * NB + h), b);
        if (out_bf16) {
          if (rb != nullptr) v = _mm512_add_ps(fxc::bf16_r(v), fxc::bf16_load(rb + base, k));
          fxc::bf16_store(ob + base, v, k);
        } else {
          if (rf != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, rf + base));
          _mm512_mask_storeu_ps(of + base, k, v);
        }
      }
    }
#else
    for (int r = 0; r < rows; ++r) {
      const int64_t base = (r0 + r) * n + p * NB;
      for (int64_t j = 0; j < cols; ++j) {
        float v = acc[r * NB + j] + (bf.empty() ? 0.f : bf[p * NB + j]);
        if (out_bf16) {
          if (rb != nullptr) v = static_cast<float>(c10::BFloat16(v)) + static_cast<float>(rb[base + j]);
          ob[base + j] = c10::BFloat16(v);
        } else {
          of[base + j] = rf != nullptr ? v + rf[base + j] : v;
        }
      }
    }
#endif
  };
  const int64_t Pn = (n + NB - 1) / NB;  // the panels that hold output columns
#ifdef __AVX512F__
  if (silu) {
    const int64_t H = n / 2, Q = H / NB;  // Q gate panels; the up panel of gate panel j is j + Q
    // gate panel j's rows from acc_g and its up panel's from acc_u: each half finished as emit finishes a linear
    // output (bias, rounded to bf16 for bf16 x), then fxc::silu_mul's own step
    auto emit_pair = [&](int64_t j, int rows, const float* acc_g, const float* acc_u) {
      for (int r = 0; r < rows; ++r)
        for (int h = 0; h < NB; h += 16) {
          const int64_t cg = j * NB + h;
          __m512 a = _mm512_loadu_ps(acc_g + r * NB + h), b = _mm512_loadu_ps(acc_u + r * NB + h);
          a = _mm512_add_ps(a, bf.empty() ? _mm512_setzero_ps() : _mm512_loadu_ps(bf.data() + cg));
          b = _mm512_add_ps(b, bf.empty() ? _mm512_setzero_ps() : _mm512_loadu_ps(bf.data() + H + cg));
          const int64_t o = r * H + cg;
          if (out_bf16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(ob + o),
                                fxc::bf16_round(fxc::silu_mul_bf16_512(fxc::bf16_r(a), fxc::bf16_r(b))));
          else
            _mm512_storeu_ps(of + o, fxc::silu_mul512(a, b));
        }
    };
    const int rows = static_cast<int>(M);
    auto pairs = [&](auto rows_c, auto sc_tag) {
      constexpr int R = decltype(rows_c)::value;
      using Sc = typename decltype(sc_tag)::type;
      const Sc* spp = half_sm ? reinterpret_cast<const Sc*>(sph) : reinterpret_cast<const Sc*>(sp);
      const Sc* mpp = half_sm ? reinterpret_cast<const Sc*>(mph) : reinterpret_cast<const Sc*>(mp);
      at::parallel_for(0, Q, 1, [&](int64_t b, int64_t e) {
        alignas(64) float acc[4][R * NB];
        auto group = [&](auto ss_c, const int64_t* ps) {
          constexpr int SS = decltype(ss_c)::value;
          const uint8_t* ws[SS];
          const Sc* ss[SS];
          const Sc* ms[SS];
          float* as[SS];
          for (int s = 0; s < SS; ++s) {
            ws[s] = wp + ps[s] * (K / 2) * NB;
            ss[s] = spp + ps[s] * G * NB;
            ms[s] = mpp + ps[s] * G * NB;
            as[s] = acc[s];
          }
          direct_w4<R, SS>(xp, K, xs.data(), G, ws, ss, ms, K, group_size, as);
          for (int s = 0; s < SS; s += 2) emit_pair(ps[s], R, acc[s], acc[s + 1]);
        };
        int64_t half = 0;
        if constexpr (w4_streams(R) >= 4) {  // two halves of the range, each half's gate and up panels a stream
          half = (e - b) / 2;
          for (int64_t i = 0; i < half; ++i) {
            const int64_t j0 = b + i, j1 = b + half + i;
            const int64_t ps[4] = {j0, j0 + Q, j1, j1 + Q};
            group(std::integral_constant<int, 4>{}, ps);
          }
        }
        for (int64_t j = b + 2 * half; j < e; ++j) {
          const int64_t ps[2] = {j, j + Q};
          group(std::integral_constant<int, 2>{}, ps);
        }
      });
    };
    struct F { using type = float; };
    struct U16 { using type = uint16_t; };
    if (rows == 1) {
      if (half_sm) pairs(std::integral_constant<int, 1>{}, U16{}); else pairs(std::integral_constant<int, 1>{}, F{});
    } else {
      if constexpr (w4_silu_pairs(2)) {
        if (half_sm) pairs(std::integral_constant<int, 2>{}, U16{}); else pairs(std::integral_constant<int, 2>{}, F{});
      }
    }
    return out;
  }
#endif
  if (direct) {  // a thread's panels are adjacent; it walks them as several streams
    const int rows = static_cast<int>(M);
    auto emit_all = [&](int64_t p, const float* acc) { emit(p, 0, rows, acc); };
    at::parallel_for(0, Pn, 1, [&](int64_t begin, int64_t end) {
      if (half_sm)
        direct_rows(rows, begin, end, xp, K, xs.data(), G, wp, sph, mph, K, group_size, emit_all);
      else
        direct_rows(rows, begin, end, xp, K, xs.data(), G, wp, sp, mp, K, group_size, emit_all);
    });
    return out;
  }
  const int64_t n_mb = (M + MB - 1) / MB;
  const int64_t tasks = n_mb * Pn;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(static_cast<size_t>(K) * NB);
    std::vector<float> sm_buf(half_sm ? static_cast<size_t>(2 * G * NB) : 0);  // the tile's scales, mins
    float acc[MRQ * NB];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t mb = t / Pn, p = t % Pn;  // panels inner: a thread's panels are adjacent
      const uint8_t* wpan = wp + p * (K / 2) * NB;
      const float* span = half_sm ? sm_buf.data() : sp + p * G * NB;
      const float* mpan = half_sm ? sm_buf.data() + G * NB : mp + p * G * NB;
      if (half_sm) {  // exact upcast (F16C), once per panel and row block
        half_to_float(sph + p * G * NB, sm_buf.data(), G * NB);
        half_to_float(mph + p * G * NB, sm_buf.data() + G * NB, G * NB);
      }
      dequant_panel(wpan, span, mpan, K, group_size, tile.data());
      const int64_t m_end = std::min(M, (mb + 1) * MB);
      const int64_t step = row_group(mb * MB, m_end);
      for (int64_t r0 = mb * MB; r0 < m_end; r0 += step) {
        const int rows = static_cast<int>(std::min<int64_t>(step, m_end - r0));
        micro_rows(rows, xp + r0 * K, K, tile.data(), K, acc);
        emit(p, r0, rows, acc);
      }
    }
  });
  return out;
}


at::Tensor linear_w4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& mins,
                     const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size) {
  return w4_linear("fxc::linear_w4", x, w, scales, mins, bias, n, group_size, nullptr, false);
}

// fxc::linear_w4_add: residual + linear_w4(x, ...) with the sum formed in the output loop (a layer's o_proj /
// down_proj and its residual add as one op), bit for bit the two ops.
at::Tensor linear_w4_add(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& mins,
                         const std::optional<at::Tensor>& bias, const at::Tensor& residual, int64_t n,
                         int64_t group_size) {
  return w4_linear("fxc::linear_w4_add", x, w, scales, mins, bias, n, group_size, &residual, false);
}

// fxc::linear_w4_silu_mul: silu(y[..., :H]) * y[..., H:] of y = linear_w4(x, ...) with n = 2H (a fused gate/up
// projection), H a multiple of 32. Decode rows (M <= 2) on AVX-512 builds: gate panel j and up panel j + H/32 are
// streamed together (a panel's sums do not depend on its stream partners) and the product formed in registers with
// fxc::silu_mul's own step (fp32: silu_mul512; bf16: ATen's, bf16_simd.h), without the 2H-wide intermediate.
// Otherwise exactly the graph it replaces: linear_w4, then fxc::silu_mul on the halves. Both equal that graph bit
// for bit.
at::Tensor linear_w4_silu_mul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                              const at::Tensor& mins, const std::optional<at::Tensor>& bias, int64_t n,
                              int64_t group_size) {
  TORCH_CHECK(n > 0 && n % (2 * NB) == 0, "fxc::linear_w4_silu_mul: n=", n,
              " must be 2 * H with H a multiple of 32 (the gate and up halves on whole panels)");
#ifdef __AVX512F__
  const bool fused = x.dim() >= 1 && x.size(-1) > 0 && w4_silu_pairs(x.numel() / x.size(-1));
#else
  const bool fused = false;
#endif
  if (fused) return w4_linear("fxc::linear_w4_silu_mul", x, w, scales, mins, bias, n, group_size, nullptr, true);
  static const auto silu_mul = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("fxc::silu_mul", "")
                                   .typed<at::Tensor(at::Tensor, at::Tensor)>();
  const at::Tensor y = linear_w4(x, w, scales, mins, bias, n, group_size);
  return silu_mul.call(y.narrow(-1, 0, n / 2), y.narrow(-1, n / 2, n / 2));
}

// ---------------------------------------------------------------------------------------------------
// fxc::linear_f8
// ---------------------------------------------------------------------------------------------------
constexpr float kF8Fold = 256.0f;  // the F16C upcast gives the e4m3 value times 2^-8

#if defined(FXC_AVX512)
// 32 e4m3 bytes -> 32 floats (times 2^-8) in two zmm.
inline void f8x32(const uint8_t* b, __m512& lo, __m512& hi) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi16(0x7F));
  __m512i h = _mm512_or_si512(_mm512_slli_epi16(mag, 7), _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8));
  h = _mm512_mask_mov_epi16(h, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7F)), _mm512_set1_epi16(0x7E00));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}
#else
// 8 e4m3 bytes -> 8 floats (times 2^-8).
inline __m256 f8x8(const uint8_t* b) {
  const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  const __m128i mag = _mm_and_si128(v, _mm_set1_epi16(0x7F));
  __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7), _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8));
  h = _mm_blendv_epi8(h, _mm_set1_epi16(0x7E00), _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7F)));
  return _mm256_cvtph_ps(h);
}
#endif

// tile[k][j] = float(q[k][j]) * 2^-8 for k in [0, K)
void upcast_panel_f8(const uint8_t* w, int64_t K, float* tile) {
  for (int64_t k = 0; k < K; ++k) {
    const uint8_t* b = w + k * NB;
    float* t = tile + k * NB;
#if defined(FXC_AVX512)
    __m512 lo, hi;
    f8x32(b, lo, hi);
    _mm512_storeu_ps(t, lo);
    _mm512_storeu_ps(t + 16, hi);
#else
    for (int j = 0; j < NB; j += 8) _mm256_storeu_ps(t + j, f8x8(b + j));
#endif
  }
}

// acc[r][0..32) = sum_k x[r][k] * float(q[k][.]) * 2^-8 for R rows, straight from the fp8 panel.
template <int R>
inline void micro_f8(const float* x, int64_t ldx, const uint8_t* w, int64_t K, float* acc) {
#if defined(FXC_AVX512)
  __m512 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 t0, t1;
    f8x32(w + k * NB, t0, t1);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      a[r][0] = _mm512_fmadd_ps(xb, t0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(xb, t1, a[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * NB, a[r][0]);
    _mm512_storeu_ps(acc + r * NB + 16, a[r][1]);
  }
#else
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) a[r][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 t[4];
    for (int v = 0; v < 4; ++v) t[v] = f8x8(w + k * NB + 8 * v);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_set1_ps(x[r * ldx + k]);
      for (int v = 0; v < 4; ++v) a[r][v] = _mm256_fmadd_ps(xb, t[v], a[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc + r * NB + 8 * v, a[r][v]);
#endif
}

// The fp8-weight matmul over float rows xp [M, K]: out[r, j] = acc * s[j] (+ bias[j]) (linear_f8), or with
// row scales (linear_f8f8) fl(fl(acc * s[j] + 0) * rs[r]) (+ bias[j]): the values of linear_f8's output
// times the row scale, then the bias, as the ATen composite computes them.
void f8_matmul(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t P, int64_t n, const float* sc,
               const std::vector<float>& bf, const float* rs, float* of, c10::BFloat16* ob) {
  const bool direct = M <= 4;  // decode: stream the fp8 panel once, no tile
  const int64_t n_mb = direct ? 1 : (M + MB - 1) / MB;
  const int64_t tasks = n_mb * P;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(direct ? 0 : static_cast<size_t>(K) * NB);
    float acc[MRQ * NB];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t mb = t / P, p = t % P;  // panels inner: a thread's panels are adjacent
      const int64_t cols = std::min<int64_t>(NB, n - p * NB);
      if (cols <= 0) continue;
      const uint8_t* wpan = wp + p * K * NB;
      if (!direct) upcast_panel_f8(wpan, K, tile.data());
      const int64_t m_end = direct ? M : std::min(M, (mb + 1) * MB);
      const int64_t r_begin = direct ? 0 : mb * MB;
      const int64_t step = direct ? 4 : row_group(r_begin, m_end);
      for (int64_t r0 = r_begin; r0 < m_end; r0 += step) {
        const int rows = static_cast<int>(std::min<int64_t>(step, m_end - r0));
        const float* xr = xp + r0 * K;
        if (direct) {
          switch (rows) {
            case 4: micro_f8<4>(xr, K, wpan, K, acc); break;
            case 3: micro_f8<3>(xr, K, wpan, K, acc); break;
            case 2: micro_f8<2>(xr, K, wpan, K, acc); break;
            default: micro_f8<1>(xr, K, wpan, K, acc); break;
          }
        } else {
          micro_rows(rows, xr, K, tile.data(), K, acc);
        }
        for (int r = 0; r < rows; ++r) {
          const int64_t base = (r0 + r) * n + p * NB;
          for (int64_t j = 0; j < cols; ++j) {
            float v;
            if (rs != nullptr) {
              v = (acc[r * NB + j] * sc[p * NB + j] + 0.f) * rs[r0 + r];
              if (!bf.empty()) v = v + bf[p * NB + j];
            } else {
              v = acc[r * NB + j] * sc[p * NB + j] + (bf.empty() ? 0.f : bf[p * NB + j]);
            }
            if (ob != nullptr) ob[base + j] = c10::BFloat16(v);
            else of[base + j] = v;
          }
        }
      }
    }
  });
}

// The per-token e4m3 rows of fxc::linear_f8f8 (fxcompiler/ops/f8_linear.py quantize_rows_e4m3, bit for bit):
// amax_r = max_k |x[r, k]| (NaN if any is NaN), rs[r] = amax_r / 448 when amax_r > 0 else 1, and
// q[r, k] = float(e4m3(clamp(x[r, k] / rs[r], +-448))) (an IEEE fp32 division, c10's RNE encoder).
void quantize_rows_e4m3(const float* x, int64_t M, int64_t K, float* q, float* rs) {
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * K;
      float amax = 0.f;
      bool nan = false;
      for (int64_t k = 0; k < K; ++k) {
        const float a = std::fabs(xr[k]);
        if (a != a) nan = true;
        else if (a > amax) amax = a;
      }
      const float s = (!nan && amax > 0.f) ? amax / fxc::kE4M3Max : 1.f;
      rs[r] = s;
      float* qr = q + r * K;
      for (int64_t k = 0; k < K; ++k) qr[k] = static_cast<float>(fxc::e4m3_encode(xr[k] / s));
    }
  });
}

struct F8Args {
  int64_t K, P, M;
  std::vector<float> bf, sc;
};

F8Args check_f8(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              op, ": x must be float32 or bfloat16, got ", x.scalar_type());
  F8Args a;
  a.K = x.size(-1);
  TORCH_CHECK(w.scalar_type() == at::kFloat8_e4m3fn && w.dim() == 3 && w.size(1) == a.K && w.size(2) == NB &&
                  w.is_contiguous(),
              op, ": packed weight must be contiguous float8_e4m3fn [P, K, 32] with K=", a.K, ", got ",
              w.scalar_type(), " ", w.sizes());
  a.P = w.size(0);
  TORCH_CHECK(n >= 0 && n <= a.P * NB, op, ": n=", n, " larger than the packed panels");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 1 &&
                  scales.size(0) == a.P * NB,
              op, ": scales must be contiguous float32 [P*32] = [", a.P * NB, "], got ", scales.sizes());
  a.M = a.K ? x.numel() / a.K : 0;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias must be [n]");
    at::Tensor b = bias->to(at::kFloat).contiguous();
    a.bf.assign(b.data_ptr<float>(), b.data_ptr<float>() + n);
  }
  a.sc.resize(static_cast<size_t>(a.P) * NB);
  const float* sp = scales.data_ptr<float>();
  for (int64_t i = 0; i < a.P * NB; ++i) a.sc[i] = sp[i] * kF8Fold;
  return a;
}

at::Tensor f8_out(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  return at::empty(out_shape, x.options());
}

at::Tensor linear_f8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias, int64_t n) {
  F8Args a = check_f8("fxc::linear_f8", x, w, scales, bias, n);
  at::Tensor out = f8_out(x, n);
  if (out.numel() == 0) return out;
  if (a.K == 0) {  // an empty sum: the bias (or zeros)
    out.zero_();
    if (bias.has_value() && bias->defined()) out.add_(bias->to(x.scalar_type()));
    return out;
  }
  at::Tensor xf = x.reshape({a.M, a.K}).to(at::kFloat).contiguous();
  const bool out_bf16 = x.scalar_type() == at::kBFloat16;
  f8_matmul(xf.data_ptr<float>(), a.M, a.K, static_cast<const uint8_t*>(w.data_ptr()), a.P, n, a.sc.data(), a.bf,
            nullptr, out_bf16 ? nullptr : out.data_ptr<float>(), out_bf16 ? out.data_ptr<c10::BFloat16>() : nullptr);
  return out;
}

// fxc::linear_f8f8: the rows of x quantized per token to e4m3 (quantize_rows_e4m3) in the kernel, then
// linear_f8's matmul on their exact fp32 values and the row scales in the epilogue.
at::Tensor linear_f8f8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK_VALUE(w.dim() == 3 && w.size(1) == x.size(-1), "fxc::linear_f8f8: K mismatch: x has K=", x.size(-1),
                    ", the packed weight is ", w.sizes(), " ([P, K, 32])");
  F8Args a = check_f8("fxc::linear_f8f8", x, w, scales, bias, n);
  at::Tensor out = f8_out(x, n);
  if (out.numel() == 0) return out;
  if (a.K == 0) {  // an empty sum: the bias (or zeros)
    out.zero_();
    if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat).to(x.scalar_type()));
    return out;
  }
  at::Tensor xf = x.reshape({a.M, a.K}).to(at::kFloat).contiguous();
  at::Tensor q = at::empty({a.M, a.K}, xf.options());
  std::vector<float> rs(static_cast<size_t>(a.M));
  quantize_rows_e4m3(xf.data_ptr<float>(), a.M, a.K, q.data_ptr<float>(), rs.data());
  const bool out_bf16 = x.scalar_type() == at::kBFloat16;
  f8_matmul(q.data_ptr<float>(), a.M, a.K, static_cast<const uint8_t*>(w.data_ptr()), a.P, n, a.sc.data(), a.bf,
            rs.data(), out_bf16 ? nullptr : out.data_ptr<float>(), out_bf16 ? out.data_ptr<c10::BFloat16>() : nullptr);
  return out;
}


// fxc::embedding_w8 / fxc::embedding_w4: the rows `ids` of an fxc::linear_w8 / fxc::linear_w4 table, dequantised
// as their references do (fxcompiler/ops/quant_embedding.py): w8 fl(s * q), w4 fl(fl(s * q) + m), fp16 scales
// and mins upcast exactly. One pass over the gathered rows, without the reference's index/broadcast temporaries
// (a decode step's lookup: ~35 us of ATen ops -> ~1 us).
struct EmbeddingRows {
  at::Tensor ids;  // int64, contiguous
  at::Tensor out;  // float32 [*ids.shape, K]
};

EmbeddingRows embedding_rows(const char* op, const at::Tensor& ids, int64_t n, int64_t K) {
  TORCH_CHECK(!c10::isFloatingType(ids.scalar_type()) && !c10::isComplexType(ids.scalar_type()) &&
                  ids.scalar_type() != at::kBool,
              op, ": ids must be an integer tensor, got ", ids.scalar_type());
  EmbeddingRows r;
  r.ids = ids.to(at::kLong).contiguous();
  const int64_t T = r.ids.numel();
  const int64_t* id = r.ids.data_ptr<int64_t>();
  if (T) {
    const auto [lo, hi] = std::minmax_element(id, id + T);
    TORCH_CHECK_INDEX(*lo >= 0 && *hi < n, "embedding: index out of range (ids in [", *lo, ", ", *hi,
                      "], table of ", n, " rows)");
  }
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K);
  r.out = at::empty(shape, ids.options().dtype(at::kFloat));
  return r;
}

// fp32 or fp16 [P, G, 32] group parameters (or fp32 [P * 32] per row: w8's per-channel scales) as a float reader
struct GroupParams {
  const void* p;
  bool half;
  float at(int64_t i) const {
    return half ? c10::detail::fp16_ieee_to_fp32_value(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
  }
};

GroupParams group_params(const char* op, const char* what, const at::Tensor& t, int64_t P, int64_t G) {
  TORCH_CHECK(t.is_contiguous() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf), op, ": ", what,
              " must be contiguous float32 or float16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 3 && t.size(0) == P && t.size(1) == G && t.size(2) == NB, op, ": ", what,
              " must be [P, G, 32] = [", P, ", ", G, ", 32], got ", t.sizes());
  return {t.data_ptr(), t.scalar_type() == at::kHalf};
}

at::Tensor embedding_w8(const at::Tensor& ids, const at::Tensor& w, const at::Tensor& scales, int64_t n,
                        int64_t group_size) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 3 && w.size(2) == NB && w.is_contiguous(),
              "fxc::embedding_w8: table must be contiguous int8 [P, K, 32], got ", w.scalar_type(), " ", w.sizes());
  const int64_t P = w.size(0), K = w.size(1);
  TORCH_CHECK(n >= 0 && n <= P * NB, "fxc::embedding_w8: n=", n, " larger than the table's ", P * NB, " rows");
  EmbeddingRows r = embedding_rows("fxc::embedding_w8", ids, n, K);
  const int64_t T = r.ids.numel();
  const int64_t* id = r.ids.data_ptr<int64_t>();
  const int8_t* q = w.data_ptr<int8_t>();
  float* o = r.out.data_ptr<float>();
  if (scales.dim() == 1) {
    TORCH_CHECK(scales.is_contiguous() && (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) &&
                    scales.size(0) == P * NB,
                "fxc::embedding_w8: per-row scales must be contiguous float32 or float16 [", P * NB, "], got ",
                scales.scalar_type(), " ", scales.sizes());
    const GroupParams sc{scales.data_ptr(), scales.scalar_type() == at::kHalf};
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = id[t] / NB, j = id[t] % NB;
      const float s = sc.at(id[t]);
      const int8_t* row = q + p * K * NB + j;
      for (int64_t k = 0; k < K; ++k) o[t * K + k] = static_cast<float>(row[k * NB]) * s;
    }
    return r.out;
  }
  TORCH_CHECK(group_size > 0, "fxc::embedding_w8: group_size must be positive with [P, G, 32] scales, got ",
              group_size);
  const int64_t G = (K + group_size - 1) / group_size;
  const GroupParams sc = group_params("fxc::embedding_w8", "scales", scales, P, G);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = id[t] / NB, j = id[t] % NB;
    const int8_t* row = q + p * K * NB + j;
    for (int64_t k = 0; k < K; ++k)
      o[t * K + k] = static_cast<float>(row[k * NB]) * sc.at((p * G + k / group_size) * NB + j);
  }
  return r.out;
}

at::Tensor embedding_w4(const at::Tensor& ids, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& mins,
                        int64_t n, int64_t group_size) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.size(2) == NB && w.is_contiguous(),
              "fxc::embedding_w4: table must be contiguous uint8 [P, K/2, 32], got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(group_size > 0, "fxc::embedding_w4: group_size must be positive, got ", group_size);
  const int64_t P = w.size(0), K = 2 * w.size(1), G = (K + group_size - 1) / group_size;
  TORCH_CHECK(n >= 0 && n <= P * NB, "fxc::embedding_w4: n=", n, " larger than the table's ", P * NB, " rows");
  const GroupParams sc = group_params("fxc::embedding_w4", "scales", scales, P, G);
  const GroupParams mn = group_params("fxc::embedding_w4", "mins", mins, P, G);
  EmbeddingRows r = embedding_rows("fxc::embedding_w4", ids, n, K);
  const int64_t T = r.ids.numel();
  const int64_t* id = r.ids.data_ptr<int64_t>();
  const uint8_t* b = w.data_ptr<uint8_t>();
  float* o = r.out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = id[t] / NB, j = id[t] % NB;
    const uint8_t* row = b + p * (K / 2) * NB + j;
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t byte = row[(k / 2) * NB];
      const float q = static_cast<float>(k % 2 ? byte >> 4 : byte & 0x0F);
      const int64_t g = (p * G + k / group_size) * NB + j;
      o[t * K + k] = q * sc.at(g) + mn.at(g);  // -ffp-contract=off: fl(fl(s * q) + m)
    }
  }
  return r.out;
}

}  // namespace
}  // namespace fxcq

extern "C" const char* fxc_quant_kernels_isa() {
#if defined(FXC_AVX512)
  return "avx512";
#elif defined(FXC_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

TORCH_LIBRARY_IMPL(fxc, CPU, m) {
  m.impl("linear_w4", &fxcq::linear_w4);
  m.impl("linear_w4_add", &fxcq::linear_w4_add);
  m.impl("linear_w4_silu_mul", &fxcq::linear_w4_silu_mul);
  m.impl("linear_f8", &fxcq::linear_f8);
  m.impl("linear_f8f8", &fxcq::linear_f8f8);
  m.impl("embedding_w8", &fxcq::embedding_w8);
  m.impl("embedding_w4", &fxcq::embedding_w4);
}
