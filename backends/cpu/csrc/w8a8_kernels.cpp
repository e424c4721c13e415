// fxcompiler CPU W8A8 kernel: fxc::linear_w8a8 (per-token dynamic int8 activations x per-channel int8 weights).
//
//   fxc::linear_w8a8(x, w_int8_packed, w_scale, w_sums, bias?, n)
//
// Schema, fake kernel, ATen reference, packer: fxcompiler/ops/w8a8_linear.py. Layout (NB = 32 columns per
// panel, P = ceil(N/32), K4 = ceil(K/4)): w int8 [P, K4, 32, 4] (each dword = 4 consecutive k of one column),
// w_scale float [P*32], w_sums int32 [P*32] = sum_k q[n][k].
//
// Step 1, per row of x: amax, inv = 127/amax, q = clamp(nearbyint(x * inv), -127, 127) (fp32, round half to
// even, as the reference), stored as int8 (AVX2 sign trick) or as q + 128 in uint8 (VNNI: vpdpbusd multiplies
// unsigned by signed bytes; the 128 * sum_k w is subtracted once per output from w_sums).
// Step 2, per (row block, panel) task: int32 accumulators of R rows x 32 columns, each k-quad one broadcast
// dword of x per row times the panel's 128 bytes:
//   avx512vnni: 2 zmm per row, vpdpbusd (Zen 4/5, Ice Lake and later);
//   avxvnni:    4 ymm per row, the VEX vpdpbusd (Alder Lake, Zen 5);
//   avx2:       4 ymm per row, |x| (vpsignb x, x) times sign(x)*w (vpsignb w, x) with vpmaddubsw, whose pairs
//               are at most 2*127*127 = 32258 (no saturation: neither side is ever -128), then vpmaddwd by 1;
//   scalar:     plain loops.
// The int32 sums are exact on every path, so every path gives the reference's value bit for bit:
// out = fl(fl(float(acc) * x_scale) * w_scale) + bias (built with -ffp-contract=off).
// The VNNI functions are compiled with target attributes and picked from CPUID at run time, so one library
// (avx2 or avx512 build) serves every CPU; fxc::_w8a8_path(int want) -> int reads (want < 0) or caps the path
// (0 scalar, 1 avx2, 2 avxvnni, 3 avx512vnni), FXCOMPILER_W8A8_PATH=scalar|avx2|avxvnni|avx512vnni at load.

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include "count_dispatch.h"  // fxc::with_count
#include "simd_math.h"  // fxc::silu_mul512: fxc::silu_mul's fp32 step, for the fused epilogue
#ifdef __AVX512F__
#include "bf16_simd.h"  // fxc::bf16_store: c10::BFloat16's rounding, 16 at a time
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace fxcw8a8 {
namespace {

constexpr int NB = 32;
constexpr int64_t MB = 64;  // rows of x per task

enum Path { kScalar = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3 };

bool supported(int p) {
  __builtin_cpu_init();
  switch (p) {
    case kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case kAvxVnni: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avxvnni");
    case kAvx2: return __builtin_cpu_supports("avx2");
    default: return true;
  }
}

// the best path at or below want this CPU runs (an avx512vnni CPU may lack AVX-VNNI: Zen 4, Ice Lake)
int clamp_path(int want) {
  for (int p = std::min(want, static_cast<int>(kAvx512Vnni)); p > kScalar; --p)
    if (supported(p)) return p;
  return kScalar;
}

int env_path() {
  const char* e = std::getenv("FXCOMPILER_W8A8_PATH");
  const std::string s(e == nullptr ? "" : e);
  const int want = s == "scalar" ? kScalar : s == "avx2" ? kAvx2 : s == "avxvnni" ? kAvxVnni : kAvx512Vnni;
  return clamp_path(want);
}

std::atomic<int>& path_ref() {
  static std::atomic<int> p{env_path()};
  return p;
}

int64_t w8a8_path(int64_t want) {
  if (want >= 0) path_ref().store(clamp_path(static_cast<int>(std::min<int64_t>(want, kAvx512Vnni))));
  return path_ref().load();
}

// ---------------------------------------------------------------------------------------------------
// micro-kernels: acc[r][0..32) = sum_i dot4(xq[r][i], w[i][.]) for R rows (ldx dwords apart), K4 k-quads
// (their row and vector loops unrolled by pragma: without it GCC kept the accumulator array on the stack and
// stored it every k-quad, micro_avx512vnni<12> included)
// ---------------------------------------------------------------------------------------------------
template <int R>
void micro_scalar(const int8_t* xq, int64_t ldx, const int8_t* w, int64_t K4, int32_t* acc) {
  int32_t a[R][NB] = {};
  for (int64_t i = 0; i < K4; ++i) {
    const int8_t* wb = w + i * NB * 4;
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq + r * ldx * 4 + i * 4;
      for (int j = 0; j < NB; ++j)
        a[r][j] += xb[0] * wb[4 * j] + xb[1] * wb[4 * j + 1] + xb[2] * wb[4 * j + 2] + xb[3] * wb[4 * j + 3];
    }
  }
  std::memcpy(acc, a, sizeof(a));
}

template <int R>
__attribute__((target("avx2"), noinline)) void micro_avx2(const int8_t* xq, int64_t ldx, const int8_t* w,
                                                          int64_t K4, int32_t* acc) {
  __m256i a[R][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < 4; ++v) a[r][v] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < K4; ++i) {
    const int8_t* wb = w + i * NB * 4;
    __m256i wv[4];
#pragma GCC unroll 16
    for (int v = 0; v < 4; ++v) wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * v));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t d;
      std::memcpy(&d, xq + (r * ldx + i) * 4, 4);
      const __m256i xb = _mm256_set1_epi32(d);
      const __m256i ax = _mm256_sign_epi8(xb, xb);
#pragma GCC unroll 16
      for (int v = 0; v < 4; ++v) {
        const __m256i p16 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[v], xb));
        a[r][v] = _mm256_add_epi32(a[r][v], _mm256_madd_epi16(p16, ones));
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < 4; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * NB + 8 * v), a[r][v]);
}

template <int R>
__attribute__((target("avx2,avxvnni"), noinline)) void micro_avxvnni(const int8_t* xu, int64_t ldx,
                                                                     const int8_t* w, int64_t K4, int32_t* acc) {
  __m256i a[R][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < 4; ++v) a[r][v] = _mm256_setzero_si256();
  for (int64_t i = 0; i < K4; ++i) {
    const int8_t* wb = w + i * NB * 4;
    __m256i wv[4];
#pragma GCC unroll 16
    for (int v = 0; v < 4; ++v) wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * v));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t d;
      std::memcpy(&d, xu + (r * ldx + i) * 4, 4);
      const __m256i xb = _mm256_set1_epi32(d);
#pragma GCC unroll 16
      for (int v = 0; v < 4; ++v) a[r][v] = _mm256_dpbusd_avx_epi32(a[r][v], xb, wv[v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < 4; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * NB + 8 * v), a[r][v]);
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"), noinline)) void micro_avx512vnni(
    const int8_t* xu, int64_t ldx, const int8_t* w, int64_t K4, int32_t* acc) {
  __m512i a[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_si512();
  for (int64_t i = 0; i < K4; ++i) {
    const int8_t* wb = w + i * NB * 4;
    _mm_prefetch(reinterpret_cast<const char*>(wb) + 1024, _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(wb), w1 = _mm512_loadu_si512(wb + 64);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t d;
      std::memcpy(&d, xu + (r * ldx + i) * 4, 4);
      const __m512i xb = _mm512_set1_epi32(d);
      a[r][0] = _mm512_dpbusd_epi32(a[r][0], xb, w0);
      a[r][1] = _mm512_dpbusd_epi32(a[r][1], xb, w1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_si512(acc + r * NB, a[r][0]);
    _mm512_storeu_si512(acc + r * NB + 16, a[r][1]);
  }
}

constexpr int kMaxR = 12;

template <int R>
void micro(int path, const int8_t* xq, int64_t ldx, const int8_t* w, int64_t K4, int32_t* acc) {
  switch (path) {
    case kAvx512Vnni: micro_avx512vnni<R>(xq, ldx, w, K4, acc); break;
    case kAvxVnni: micro_avxvnni<R>(xq, ldx, w, K4, acc); break;
    case kAvx2: micro_avx2<R>(xq, ldx, w, K4, acc); break;
    default: micro_scalar<R>(xq, ldx, w, K4, acc); break;
  }
}

// rows at a time per path: the accumulators stay in registers (24 zmm of 32 for avx512vnni; 8 ymm of 16 for AVX2)
int rows_for(int path) { return path == kAvx512Vnni ? 12 : path == kScalar ? 4 : 2; }

void micro_rows(int path, int rows, const int8_t* xq, int64_t ldx, const int8_t* w, int64_t K4, int32_t* acc) {
  fxc::with_count<kMaxR>(rows, [&](auto c) { micro<decltype(c)::value>(path, xq, ldx, w, K4, acc); });
}

// One row: x_scale = amax / 127, q = clamp(nearbyint(x * (127 / amax))) (+128 for VNNI), zero padded to Kp.
void quantize_row(const float* x, int64_t K, int64_t Kp, bool offset, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float inv = amax > 0.f ? 127.0f / amax : 0.f;
  *scale = amax / 127.0f;
  for (int64_t k = 0; k < K; ++k) {
    float v = std::nearbyint(x[k] * inv);
    v = std::min(127.f, std::max(-127.f, v));
    const int iv = static_cast<int>(v);
    q[k] = offset ? static_cast<int8_t>(static_cast<uint8_t>(iv + 128)) : static_cast<int8_t>(iv);
  }
  for (int64_t k = K; k < Kp; ++k) q[k] = offset ? static_cast<int8_t>(static_cast<uint8_t>(128)) : 0;
}

// The output [..., n] of a linear op, its bias as floats, its rows M; done when nothing is left to compute (an
// empty output, or K == 0: zeros plus the bias).
struct LinearOut {
  at::Tensor out;
  std::vector<float> bias;
  int64_t M = 0;
  bool done = false;
};

// out_cols: the output's last dim when an epilogue changes it (-1: n).
LinearOut linear_out(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t n,
                     int64_t out_cols = -1) {
  LinearOut r;
  const int64_t K = x.size(-1);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_cols < 0 ? n : out_cols;
  r.out = at::empty(shape, x.options());
  r.M = K ? x.numel() / K : 0;
  if (r.out.numel() == 0) {
    r.done = true;
    return r;
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias must be [n]");
    at::Tensor b = bias->to(at::kFloat).contiguous();
    r.bias.assign(b.data_ptr<float>(), b.data_ptr<float>() + n);
  }
  if (K == 0) {
    r.out.zero_();
    if (!r.bias.empty()) r.out.add_(bias->to(x.scalar_type()));
    r.done = true;
  }
  return r;
}

at::Tensor linear_w8a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale, const at::Tensor& w_sums,
                       const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "fxc::linear_w8a8: CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "fxc::linear_w8a8: x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t K = x.size(-1);
  const int64_t K4 = (K + 3) / 4, Kp = 4 * K4;
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 4 && w.size(1) == K4 && w.size(2) == NB && w.size(3) == 4 &&
                  w.is_contiguous(),
              "fxc::linear_w8a8: packed weight must be contiguous int8 [P, K4, 32, 4] with K4=", K4, ", got ",
              w.sizes());
  const int64_t P = w.size(0);
  TORCH_CHECK(K <= 133000, "fxc::linear_w8a8: K=", K, " > 133000 (the int32 sums of 127 x 127 products could overflow)");
  TORCH_CHECK(n >= 0 && n <= P * NB, "fxc::linear_w8a8: n=", n, " larger than the packed panels");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.dim() == 1 &&
                  w_scale.size(0) == P * NB,
              "fxc::linear_w8a8: w_scale must be contiguous float32 [P*32] = [", P * NB, "], got ", w_scale.sizes());
  TORCH_CHECK(w_sums.scalar_type() == at::kInt && w_sums.is_contiguous() && w_sums.dim() == 1 &&
                  w_sums.size(0) == P * NB,
              "fxc::linear_w8a8: w_sums must be contiguous int32 [P*32] = [", P * NB, "], got ", w_sums.sizes());
  LinearOut lo = linear_out("fxc::linear_w8a8", x, bias, n);
  if (lo.done) return lo.out;
  at::Tensor out = lo.out;
  const int64_t M = lo.M;
  const std::vector<float>& bf = lo.bias;
  at::Tensor xf = x.reshape({M, K}).to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const int path = path_ref().load();
  const bool offset = path == kAvxVnni || path == kAvx512Vnni;
  std::vector<int8_t> xq(static_cast<size_t>(M * Kp));
  std::vector<float> xs(static_cast<size_t>(M));
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) quantize_row(xp + r * K, K, Kp, offset, xq.data() + r * Kp, xs.data() + r);
  });
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = w_scale.data_ptr<float>();
  const int32_t* su = w_sums.data_ptr<int32_t>();
  const bool out_bf16 = x.scalar_type() == at::kBFloat16;
  float* of = out_bf16 ? nullptr : out.data_ptr<float>();
  c10::BFloat16* ob = out_bf16 ? out.data_ptr<c10::BFloat16>() : nullptr;
  const int R = rows_for(path);
  const int64_t n_mb = (M + MB - 1) / MB;
  at::parallel_for(0, n_mb * P, 1, [&](int64_t begin, int64_t end) {
    int32_t acc[kMaxR * NB];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t mb = t / P, p = t % P;  // panels inner: a thread's panels are adjacent
      const int64_t cols = std::min<int64_t>(NB, n - p * NB);
      if (cols <= 0) continue;
      const int8_t* wpan = wp + p * K4 * NB * 4;
      const int64_t m_end = std::min(M, (mb + 1) * MB);
      const int64_t groups = (m_end - mb * MB + R - 1) / R;
      const int64_t step = (m_end - mb * MB + groups - 1) / groups;  // balanced row groups of at most R
      for (int64_t r0 = mb * MB; r0 < m_end; r0 += step) {
        const int rows = static_cast<int>(std::min<int64_t>(step, m_end - r0));
        micro_rows(path, rows, xq.data() + r0 * Kp, K4, wpan, K4, acc);
#ifdef __AVX512F__
        if (cols == NB) {  // the scalar loop below, 16 columns at a time: the same operations in the same order
          for (int h = 0; h < NB; h += 16) {
            const __m512i off = offset ? _mm512_mullo_epi32(_mm512_loadu_si512(su + p * NB + h), _mm512_set1_epi32(128))
                                       : _mm512_setzero_si512();
            const __m512 sw = _mm512_loadu_ps(sp + p * NB + h);
            const __m512 bv = bf.empty() ? _mm512_setzero_ps() : _mm512_loadu_ps(bf.data() + p * NB + h);
            for (int r = 0; r < rows; ++r) {
              const __m512i a = _mm512_sub_epi32(_mm512_loadu_si512(acc + r * NB + h), off);  // modulo 2^32
              __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(xs[r0 + r])), sw);
              if (!bf.empty()) v = _mm512_add_ps(v, bv);
              const int64_t base = (r0 + r) * n + p * NB + h;
              if (out_bf16)
                fxc::bf16_store(ob + base, v, 0xFFFF);
              else
                _mm512_storeu_ps(of + base, v);
            }
          }
          continue;
        }
#endif
        for (int r = 0; r < rows; ++r) {
          const int64_t base = (r0 + r) * n + p * NB;
          const float xsr = xs[r0 + r];
          for (int64_t j = 0; j < cols; ++j) {
            int32_t a = acc[r * NB + j];
            // modulo 2^32 (vpdpbusd wraps too): exact whenever the true sum fits in int32
            if (offset)
              a = static_cast<int32_t>(static_cast<uint32_t>(a) - 128u * static_cast<uint32_t>(su[p * NB + j]));
            float v = (static_cast<float>(a) * xsr) * sp[p * NB + j];
            if (!bf.empty()) v += bf[p * NB + j];
            if (out_bf16) ob[base + j] = c10::BFloat16(v);
            else of[base + j] = v;
          }
        }
      }
    }
  });
  return out;
}


// ===================================================================================================
// fxc::linear_w4a8: int4 weights (a scale and a min per group: fxc::linear_w4's values, GGUF Q4_0/Q4_1
// exactly) times int8 activations quantized per row and weight group at run time (llama.cpp's Q4_1 x Q8_1
// numerics). Schema, reference and packer: fxcompiler/ops/w4a8_linear.py. Layout (NB4 = 16 columns a panel,
// P = ceil(N/16), G = ceil(K/gs), K and gs multiples of 8):
//   w uint8 [P, K/8, 16, 4]: byte[p, c, j, t] = q[16p+j, 8c+t] | q[16p+j, 8c+4+t] << 4 (q in [0, 15]): one
//     64-byte load holds 8 k of 16 columns, its low nibbles k 0-3 and its high nibbles k 4-7 of each column,
//     the 4 consecutive k of a column in one dword as vpdpbusd / vpmaddubsw read them (weights are the
//     unsigned side, activation codes the signed one: no offset, no sign trick);
//   scales, mins float32 or float16 [P, G, 16].
// Per row r and group g: amax, dx = amax / 127, qx = clamp(nearbyint(x * (127 / amax)), -127, 127) (fp32, as
// the reference), xs = sum of the group's x (fp32); isum = sum_k q * qx (int32, exact);
// out = sum over g in ascending order of fl(float(isum) * fl(s * dx)), then of fl(m * xs) (+ bias): each product
// and sum rounded to fp32 as the reference's (built with -ffp-contract=off), so every path equals it bit for bit.
// M <= 4 (decode) walks each thread's panels as up to 4 streams in lock step (the weight is read once);
// larger M takes row blocks of 4 over two panels at a time, which then stay in L1. FXC_W4A8_PF (bytes, default 2048,
// 0: off) sets the software prefetch distance along each stream, for measurements (off: decode ~25 % slower).
// ===================================================================================================
constexpr int NB4 = 16;
static const int64_t g_w4a8_pf = [] {  // software prefetch distance in bytes along each stream (0: none)
  const char* e = std::getenv("FXC_W4A8_PF");
  return e == nullptr ? int64_t{2048} : static_cast<int64_t>(std::atoll(e));
}();

struct W4A8 {
  const uint8_t* w;
  const void* sc;
  const void* mn;
  bool half;
  int64_t K, G, gs;
  const int8_t* xq;   // [M, K]
  const float* dx;    // [M, G]
  const float* xs;    // [M, G]
  int64_t panel_bytes() const { return K / 8 * 64; }
  int64_t c0(int64_t g) const { return g * gs / 8; }
  int64_t c1(int64_t g) const { return std::min(K, (g + 1) * gs) / 8; }
};

inline float scale_at(const void* base, bool half, int64_t i) {
  return half ? c10::detail::fp16_ieee_to_fp32_value(static_cast<const uint16_t*>(base)[i])
              : static_cast<const float*>(base)[i];
}

template <int R, int S>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma"))) void w4a8_avx512(
    const W4A8& a, const int64_t* panels, int64_t r0, float* out) {
  __m512 acc[S][R];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) acc[s][r] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const uint8_t* wp[S];
  for (int s = 0; s < S; ++s) wp[s] = a.w + panels[s] * a.panel_bytes();
  for (int64_t g = 0; g < a.G; ++g) {
    // low nibbles into is, the high ones kept in place (v & 0xF0 = 16 q) into ih: one logic op less per load;
    // the group's high sum is ih / 16 exactly (every term a multiple of 16; |ih| <= 15240 * group length < 2^31
    // for groups of at most 2^17 k, which linear_w4a8 checks)
    __m512i is[S][R], ih[S][R];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r) is[s][r] = ih[s][r] = _mm512_setzero_si512();
    for (int64_t c = a.c0(g), ce = a.c1(g); c < ce; ++c) {
      __m512i x0[R], x1[R];
      for (int r = 0; r < R; ++r) {
        int32_t d0, d1;
        std::memcpy(&d0, a.xq + (r0 + r) * a.K + 8 * c, 4);
        std::memcpy(&d1, a.xq + (r0 + r) * a.K + 8 * c + 4, 4);
        x0[r] = _mm512_set1_epi32(d0);
        x1[r] = _mm512_set1_epi32(d1);
      }
      for (int s = 0; s < S; ++s) {
        const uint8_t* wb = wp[s] + c * 64;
        if (g_w4a8_pf) _mm_prefetch(reinterpret_cast<const char*>(wb) + g_w4a8_pf, _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(wb);
        const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_andnot_si512(m4, v);
        for (int r = 0; r < R; ++r) {
          is[s][r] = _mm512_dpbusd_epi32(is[s][r], lo, x0[r]);
          ih[s][r] = _mm512_dpbusd_epi32(ih[s][r], hi, x1[r]);
        }
      }
    }
    for (int s = 0; s < S; ++s) {
      const int64_t o = (panels[s] * a.G + g) * NB4;
      __m512 sv, mv;
      if (a.half) {
        const uint16_t* sh = static_cast<const uint16_t*>(a.sc) + o;
        const uint16_t* mh = static_cast<const uint16_t*>(a.mn) + o;
        sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sh)));
        mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mh)));
      } else {
        sv = _mm512_loadu_ps(static_cast<const float*>(a.sc) + o);
        mv = _mm512_loadu_ps(static_cast<const float*>(a.mn) + o);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 t = _mm512_mul_ps(sv, _mm512_set1_ps(a.dx[(r0 + r) * a.G + g]));
        const __m512i isum = _mm512_add_epi32(is[s][r], _mm512_srai_epi32(ih[s][r], 4));
        acc[s][r] = _mm512_add_ps(acc[s][r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), t));
        acc[s][r] = _mm512_add_ps(acc[s][r], _mm512_mul_ps(mv, _mm512_set1_ps(a.xs[(r0 + r) * a.G + g])));
      }
    }
  }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (s * R + r) * NB4, acc[s][r]);
}

// The other paths: a group's int32 sums of one row and one panel, then the same combination in scalar code.
template <int P>
void w4a8_isum(const uint8_t* wpan, const int8_t* xrow, int64_t c0, int64_t c1, int32_t* isum);

template <>
void w4a8_isum<kScalar>(const uint8_t* wpan, const int8_t* xrow, int64_t c0, int64_t c1, int32_t* isum) {
  for (int j = 0; j < NB4; ++j) isum[j] = 0;
  for (int64_t c = c0; c < c1; ++c)
    for (int j = 0; j < NB4; ++j)
      for (int t = 0; t < 4; ++t) {
        const uint8_t b = wpan[c * 64 + 4 * j + t];
        isum[j] += (b & 0x0F) * xrow[8 * c + t] + (b >> 4) * xrow[8 * c + 4 + t];
      }
}

template <>
__attribute__((target("avx2"))) void w4a8_isum<kAvx2>(const uint8_t* wpan, const int8_t* xrow, int64_t c0,
                                                      int64_t c1, int32_t* isum) {
  __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t c = c0; c < c1; ++c) {
    int32_t d0, d1;
    std::memcpy(&d0, xrow + 8 * c, 4);
    std::memcpy(&d1, xrow + 8 * c + 4, 4);
    const __m256i x0 = _mm256_set1_epi32(d0), x1 = _mm256_set1_epi32(d1);
    for (int v = 0; v < 2; ++v) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wpan + c * 64 + 32 * v));
      const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
      // unsigned codes <= 15 times signed <= 127 in magnitude: a pair is at most 3810, no saturation
      const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
      (v ? a1 : a0) = _mm256_add_epi32(v ? a1 : a0, _mm256_madd_epi16(p, ones));
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(isum), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(isum + 8), a1);
}

template <>
__attribute__((target("avx2,avxvnni"))) void w4a8_isum<kAvxVnni>(const uint8_t* wpan, const int8_t* xrow, int64_t c0,
                                                                 int64_t c1, int32_t* isum) {
  __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int64_t c = c0; c < c1; ++c) {
    int32_t d0, d1;
    std::memcpy(&d0, xrow + 8 * c, 4);
    std::memcpy(&d1, xrow + 8 * c + 4, 4);
    const __m256i x0 = _mm256_set1_epi32(d0), x1 = _mm256_set1_epi32(d1);
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wpan + c * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wpan + c * 64 + 32));
    a0 = _mm256_dpbusd_avx_epi32(a0, _mm256_and_si256(w0, m4), x0);
    a0 = _mm256_dpbusd_avx_epi32(a0, _mm256_and_si256(_mm256_srli_epi16(w0, 4), m4), x1);
    a1 = _mm256_dpbusd_avx_epi32(a1, _mm256_and_si256(w1, m4), x0);
    a1 = _mm256_dpbusd_avx_epi32(a1, _mm256_and_si256(_mm256_srli_epi16(w1, 4), m4), x1);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(isum), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(isum + 8), a1);
}

void w4a8_generic(int path, const W4A8& a, int64_t p, int64_t r, float* out) {
  const uint8_t* wpan = a.w + p * a.panel_bytes();
  const int8_t* xrow = a.xq + r * a.K;
  float acc[NB4] = {};
  int32_t isum[NB4];
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t c0 = a.c0(g), c1 = a.c1(g);
    switch (path) {
      case kAvx2: w4a8_isum<kAvx2>(wpan, xrow, c0, c1, isum); break;
      case kAvxVnni: w4a8_isum<kAvxVnni>(wpan, xrow, c0, c1, isum); break;
      default: w4a8_isum<kScalar>(wpan, xrow, c0, c1, isum); break;
    }
    const float d = a.dx[r * a.G + g], xs = a.xs[r * a.G + g];
    for (int j = 0; j < NB4; ++j) {
      const int64_t o = (p * a.G + g) * NB4 + j;
      acc[j] = acc[j] + static_cast<float>(isum[j]) * (scale_at(a.sc, a.half, o) * d);
      acc[j] = acc[j] + scale_at(a.mn, a.half, o) * xs;
    }
  }
  std::memcpy(out, acc, sizeof(acc));
}

// One row: per group dx = amax / 127, codes clamp(nearbyint(x * (127 / amax)), -127, 127), xs = sum of x.
void w4a8_quantize_row(const float* x, int64_t K, int64_t G, int64_t gs, int8_t* q, float* dx, float* xs) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k0 = g * gs, k1 = std::min(K, k0 + gs);
    float amax = 0.f, sum = 0.f;
    for (int64_t k = k0; k < k1; ++k) {
      amax = std::max(amax, std::fabs(x[k]));
      sum += x[k];
    }
    const float inv = amax > 0.f ? 127.0f / amax : 0.f;
    dx[g] = amax / 127.0f;
    xs[g] = sum;
    for (int64_t k = k0; k < k1; ++k) {
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(x[k] * inv)));
      q[k] = static_cast<int8_t>(static_cast<int>(v));
    }
  }
}

// The same with AVX-512: the amax from 16-lane maxima (exact), the sum in k order as the scalar loop's, the codes
// by vroundps to nearest even (as nearbyint) and a saturating pack.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void w4a8_quantize_row_avx512(
    const float* x, int64_t K, int64_t G, int64_t gs, int8_t* q, float* dx, float* xs) {
  if (gs % 16) return w4a8_quantize_row(x, K, G, gs, q, dx, xs);
  const __m512 lim = _mm512_set1_ps(127.f), nlim = _mm512_set1_ps(-127.f);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k0 = g * gs, k1 = std::min(K, k0 + gs);
    if ((k1 - k0) % 16) {
      w4a8_quantize_row(x + k0, k1 - k0, 1, k1 - k0, q + k0, dx + g, xs + g);
      continue;
    }
    __m512 am = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 16) am = _mm512_max_ps(am, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    float sum = 0.f;
    for (int64_t k = k0; k < k1; ++k) sum += x[k];
    const float amax = _mm512_reduce_max_ps(am);
    const float inv = amax > 0.f ? 127.0f / amax : 0.f;
    dx[g] = amax / 127.0f;
    xs[g] = sum;
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t k = k0; k < k1; k += 16) {
      const __m512 v = _mm512_min_ps(lim, _mm512_max_ps(nlim, _mm512_roundscale_ps(
          _mm512_mul_ps(_mm512_loadu_ps(x + k), iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
    }
  }
}

template <int R, int S>
void w4a8_block(int path, const W4A8& a, const int64_t* panels, int64_t r0, float* out) {
  if (path == kAvx512Vnni) {
    w4a8_avx512<R, S>(a, panels, r0, out);
    return;
  }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) w4a8_generic(path, a, panels[s], r0 + r, out + (s * R + r) * NB4);
}

template <int R, int S>
void w4a8_rows(int rows, int path, const W4A8& a, const int64_t* panels, int64_t r0, float* out) {
  if constexpr (R > 1) {
    if (rows < R) return w4a8_rows<R - 1, S>(rows, path, a, panels, r0, out);
  }
  w4a8_block<R, S>(path, a, panels, r0, out);
}

// A W4A8 call's checked arguments, its output (out_cols columns) and x's rows quantized into the calling
// thread's scratch; done when there is nothing to compute (lo.done).
struct W4A8Call {
  LinearOut lo;
  W4A8 a;
  int path;
  int64_t P;
};

W4A8Call w4a8_prepare(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                      const at::Tensor& mins, const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size,
                      int64_t out_cols = -1) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              op, ": x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t K = x.size(-1);
  TORCH_CHECK(K <= (int64_t{1} << 20), op, ": K=", K, " > 2^20 (the int32 group sums could overflow)");
  TORCH_CHECK(std::min(K, group_size) <= (int64_t{1} << 17), op, ": groups of ", std::min(K, group_size),
              " k > 2^17 (the int32 group sums could overflow); use a smaller group_size");
  TORCH_CHECK(K % 8 == 0 && group_size > 0 && group_size % 8 == 0,
              op, ": K and group_size must be multiples of 8, got K=", K, ", group_size=", group_size);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 4 && w.size(1) == K / 8 && w.size(2) == NB4 &&
                  w.size(3) == 4 && w.is_contiguous(),
              op, ": packed weight must be contiguous uint8 [P, K/8, 16, 4] with K/8=", K / 8, ", got ", w.sizes());
  const int64_t P = w.size(0), G = (K + group_size - 1) / group_size;
  TORCH_CHECK(n >= 0 && n <= P * NB4, op, ": n=", n, " larger than the packed panels");
  TORCH_CHECK(scales.scalar_type() == mins.scalar_type() &&
                  (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf),
              op, ": scales and mins must both be float32 or both float16, got ", scales.scalar_type(), " and ",
              mins.scalar_type());
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == P && t->size(1) == G && t->size(2) == NB4 && t->is_contiguous(),
                op, ": scales/mins must be contiguous [P, G, 16] = [", P, ", ", G, ", 16], got ", t->sizes());
  W4A8Call c{linear_out(op, x, bias, n, out_cols), {}, path_ref().load(), P};
  if (c.lo.done) return c;
  const int64_t M = c.lo.M;
  at::Tensor xf;  // fp32 rows: x itself when it is contiguous fp32 (no dispatcher calls on the decode path)
  if (x.scalar_type() != at::kFloat || !x.is_contiguous()) xf = x.reshape({M, K}).to(at::kFloat).contiguous();
  const float* xp = xf.defined() ? xf.data_ptr<float>() : x.data_ptr<float>();
  // the caller's scratch, reused across calls (no allocation or zeroing on the decode path)
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> dx, xs;
  if (xq.size() < static_cast<size_t>(M * K)) xq.resize(static_cast<size_t>(M * K));
  if (dx.size() < static_cast<size_t>(M * G)) {
    dx.resize(static_cast<size_t>(M * G));
    xs.resize(static_cast<size_t>(M * G));
  }
  const int path = c.path;
  int8_t* xqp = xq.data();
  float* dxp = dx.data();
  float* xsp = xs.data();
  auto quantize = [&](int64_t r) {
    if (path == kAvx512Vnni)
      w4a8_quantize_row_avx512(xp + r * K, K, G, group_size, xqp + r * K, dxp + r * G, xsp + r * G);
    else
      w4a8_quantize_row(xp + r * K, K, G, group_size, xqp + r * K, dxp + r * G, xsp + r * G);
  };
  if (M <= 4) {
    for (int64_t r = 0; r < M; ++r) quantize(r);
  } else {
    at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) quantize(r);
    });
  }
  c.a = W4A8{w.data_ptr<uint8_t>(), scales.data_ptr(), mins.data_ptr(), scales.scalar_type() == at::kHalf,
             K, G, group_size, xqp, dxp, xsp};
  return c;
}

// linear_w4a8's body; with `residual` ([..., n], x's dtype) its value is added to each output as the graph's
// `residual + linear(x)` would (fp32: fl(y + r); bf16: y rounded to bf16 first, the sum in fp32, rounded again).
at::Tensor w4a8_linear(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const at::Tensor& mins, const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size,
                       const at::Tensor* residual) {
  W4A8Call c = w4a8_prepare(op, x, w, scales, mins, bias, n, group_size);
  at::Tensor rc;
  if (residual != nullptr) {
    TORCH_CHECK(residual->sizes() == c.lo.out.sizes() && residual->scalar_type() == x.scalar_type(), op,
                ": residual must be ", x.scalar_type(), " ", c.lo.out.sizes(), " (the output's shape), got ",
                residual->scalar_type(), " ", residual->sizes());
    rc = residual->contiguous();
  }
  if (c.lo.done) return rc.defined() ? c.lo.out.add_(rc) : c.lo.out;
  at::Tensor out = c.lo.out;
  const float* rf = rc.defined() && x.scalar_type() == at::kFloat ? rc.data_ptr<float>() : nullptr;
  const c10::BFloat16* rb = rc.defined() && x.scalar_type() == at::kBFloat16 ? rc.data_ptr<c10::BFloat16>() : nullptr;
  const int64_t M = c.lo.M, P = c.P;
  const std::vector<float>& bf = c.lo.bias;
  const int path = c.path;
  const W4A8& a = c.a;
  const bool out_bf16 = x.scalar_type() == at::kBFloat16;
  float* of = out_bf16 ? nullptr : out.data_ptr<float>();
  c10::BFloat16* ob = out_bf16 ? out.data_ptr<c10::BFloat16>() : nullptr;
  const float* bias_p = bf.empty() ? nullptr : bf.data();
  auto emit = [&](int64_t p, int64_t r0, int rows, float* res) {  // branch-free row loops (vectorised)
    const int64_t cols = std::min<int64_t>(NB4, n - p * NB4);
    for (int r = 0; r < rows; ++r) {
      float* v = res + r * NB4;
      if (bias_p != nullptr)
        for (int64_t j = 0; j < cols; ++j) v[j] += bias_p[p * NB4 + j];
      const int64_t o = (r0 + r) * n + p * NB4;
      if (out_bf16) {
        if (rb != nullptr)
          for (int64_t j = 0; j < cols; ++j)
            ob[o + j] = c10::BFloat16(static_cast<float>(c10::BFloat16(v[j])) + static_cast<float>(rb[o + j]));
        else
          for (int64_t j = 0; j < cols; ++j) ob[o + j] = c10::BFloat16(v[j]);
      } else {
        if (rf != nullptr)
          for (int64_t j = 0; j < cols; ++j) v[j] += rf[o + j];
        std::memcpy(of + o, v, static_cast<size_t>(cols) * sizeof(float));
      }
    }
  };
  if (M <= 4) {
    const int rows = static_cast<int>(M);
    at::parallel_for(0, P, 4, [&](int64_t b, int64_t e) {
      alignas(64) float res[4 * 4 * NB4];
      // ss sub-ranges of base panels walked in lock step (ss chosen so that no panel is left to run alone where
      // that can be avoided: one panel's accumulator chains wait on latency), the leftover panels as one more group
      auto lockstep = [&](int64_t p0, int64_t ss, int64_t base) {
        for (int64_t i = 0; i < base; ++i) {
          int64_t ps[4];
          for (int64_t s = 0; s < ss; ++s) ps[s] = p0 + s * base + i;
          if (ss == 4) w4a8_rows<2, 4>(rows, path, a, ps, 0, res);
          else if (ss == 3) w4a8_rows<2, 3>(rows, path, a, ps, 0, res);
          else if (ss == 2) w4a8_rows<4, 2>(rows, path, a, ps, 0, res);
          else w4a8_rows<4, 1>(rows, path, a, ps, 0, res);
          for (int64_t s = 0; s < ss; ++s) emit(ps[s], 0, rows, res + s * rows * NB4);
        }
      };
      const int64_t cnt = e - b, S = std::min<int64_t>(rows <= 2 ? 4 : 2, cnt);
      int64_t ss = S;
      for (int64_t c = S; c >= 2; --c)
        if (cnt % c != 1) {
          ss = c;
          break;
        }
      const int64_t base = cnt / ss, rem = cnt % ss;
      lockstep(b, ss, base);
      if (rem > 0) lockstep(b + base * ss, rem, 1);  // rem < ss <= S: 3 streams only where rows <= 2
    });
    return out;
  }
  at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t b, int64_t e) {
    alignas(64) float res[2 * 4 * NB4];
    for (int64_t pp = b; pp < e; ++pp) {
      int64_t ps[2] = {2 * pp, 2 * pp + 1};
      const bool two = ps[1] < P;
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const int rows = static_cast<int>(std::min<int64_t>(4, M - r0));
        if (two) w4a8_rows<4, 2>(rows, path, a, ps, r0, res);
        else w4a8_rows<4, 1>(rows, path, a, ps, r0, res);
        for (int s = 0; s < (two ? 2 : 1); ++s) emit(ps[s], r0, rows, res + s * rows * NB4);
      }
    }
  });
  return out;
}

at::Tensor linear_w4a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& mins,
                       const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size) {
  return w4a8_linear("fxc::linear_w4a8", x, w, scales, mins, bias, n, group_size, nullptr);
}

// fxc::linear_w4a8_add: residual + linear_w4a8(x, ...) with the sum formed in the linear's output loop (a layer's
// o_proj / down_proj and its residual add as one op), bit for bit the two ops.
at::Tensor linear_w4a8_add(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& mins,
                           const std::optional<at::Tensor>& bias, const at::Tensor& residual, int64_t n,
                           int64_t group_size) {
  return w4a8_linear("fxc::linear_w4a8_add", x, w, scales, mins, bias, n, group_size, &residual);
}


// fxc::linear_w4a8_silu_mul: silu(y[..., :H]) * y[..., H:] of y = linear_w4a8(x, ...) with n = 2H (a fused
// gate/up projection), H a multiple of 16 so that gate panel j and up panel j + H/16 cover the same columns.
// fp32 x on AVX-512 builds: each pair of panels is computed together (any path: the sums are the same bit for
// bit) and the product formed in registers with fxc::silu_mul's own fp32 step (fxc::silu_mul512 in
// simd_math.h, which csrc/fused_ops.cpp's silu_mul_f32 calls), so the result equals the unfused linear_w4a8 -> split -> silu_mul
// graph bit for bit, without the 2H-wide intermediate, the split and the second op. Otherwise (bf16 x, other
// builds) exactly that graph: linear_w4a8, then fxc::silu_mul on the halves.
at::Tensor linear_w4a8_silu_mul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                                const at::Tensor& mins, const std::optional<at::Tensor>& bias, int64_t n,
                                int64_t group_size) {
  TORCH_CHECK(n > 0 && n % (2 * NB4) == 0, "fxc::linear_w4a8_silu_mul: n=", n,
              " must be 2 * H with H a multiple of 16 (the gate and up halves on whole panels)");
  const int64_t H = n / 2;
#ifdef __AVX512F__
  const bool fused = x.scalar_type() == at::kFloat && x.size(-1) > 0;
#else
  const bool fused = false;
#endif
  if (!fused) {
    static const auto silu_mul = c10::Dispatcher::singleton()
                                     .findSchemaOrThrow("fxc::silu_mul", "")
                                     .typed<at::Tensor(at::Tensor, at::Tensor)>();
    const at::Tensor y = linear_w4a8(x, w, scales, mins, bias, n, group_size);
    return silu_mul.call(y.narrow(-1, 0, H), y.narrow(-1, H, H));
  }
#ifdef __AVX512F__
  W4A8Call c = w4a8_prepare("fxc::linear_w4a8_silu_mul", x, w, scales, mins, bias, n, group_size, H);
  if (c.lo.done) return c.lo.out;  // no rows (K == 0 took the unfused path)
  const int64_t M = c.lo.M, Q = H / NB4;  // Q gate panels; the up panel of gate panel j is j + Q
  const int path = c.path;
  const W4A8& a = c.a;
  float* of = c.lo.out.data_ptr<float>();
  const float* bias_p = c.lo.bias.empty() ? nullptr : c.lo.bias.data();
  // gate panel j's rows r0.. from res (stream sg) and the up panel's (stream su): bias, then silu_mul's step
  auto emit = [&](int64_t j, int64_t r0, int rows, const float* res, int sg, int su) {
    for (int r = 0; r < rows; ++r) {
      alignas(64) float gv[NB4], uv[NB4];
      std::memcpy(gv, res + (sg * rows + r) * NB4, sizeof(gv));
      std::memcpy(uv, res + (su * rows + r) * NB4, sizeof(uv));
      if (bias_p != nullptr)
        for (int64_t t = 0; t < NB4; ++t) {
          gv[t] += bias_p[j * NB4 + t];
          uv[t] += bias_p[H + j * NB4 + t];
        }
      _mm512_storeu_ps(of + (r0 + r) * H + j * NB4, fxc::silu_mul512(_mm512_load_ps(gv), _mm512_load_ps(uv)));
    }
  };
  if (M <= 4) {
    const int rows = static_cast<int>(M);
    at::parallel_for(0, Q, 2, [&](int64_t b, int64_t e) {
      alignas(64) float res[4 * 4 * NB4];
      // rows <= 2: the thread's gate panels as two halves, each half's gate and up panels a stream (4 lock-step
      // streams, each walking consecutive panels, as linear_w4a8's decode loop does); else one pair at a time
      const int64_t half = rows <= 2 ? (e - b) / 2 : 0;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t j0 = b + i, j1 = b + half + i;
        const int64_t ps[4] = {j0, j0 + Q, j1, j1 + Q};
        w4a8_rows<2, 4>(rows, path, a, ps, 0, res);
        emit(j0, 0, rows, res, 0, 1);
        emit(j1, 0, rows, res, 2, 3);
      }
      for (int64_t j = b + 2 * half; j < e; ++j) {
        const int64_t ps[2] = {j, j + Q};
        w4a8_rows<4, 2>(rows, path, a, ps, 0, res);
        emit(j, 0, rows, res, 0, 1);
      }
    });
    return c.lo.out;
  }
  at::parallel_for(0, Q, 1, [&](int64_t b, int64_t e) {
    alignas(64) float res[2 * 4 * NB4];
    for (int64_t j = b; j < e; ++j) {
      const int64_t ps[2] = {j, j + Q};
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const int rows = static_cast<int>(std::min<int64_t>(4, M - r0));
        w4a8_rows<4, 2>(rows, path, a, ps, r0, res);
        emit(j, r0, rows, res, 0, 1);
      }
    }
  });
  return c.lo.out;
#endif
}

}  // namespace
}  // namespace fxcw8a8

TORCH_LIBRARY_FRAGMENT(fxc, m) { m.def("_w8a8_path(int want) -> int", &fxcw8a8::w8a8_path); }

TORCH_LIBRARY_IMPL(fxc, CPU, m) {
  m.impl("linear_w8a8", &fxcw8a8::linear_w8a8);
  m.impl("linear_w4a8", &fxcw8a8::linear_w4a8);
  m.impl("linear_w4a8_silu_mul", &fxcw8a8::linear_w4a8_silu_mul);
  m.impl("linear_w4a8_add", &fxcw8a8::linear_w4a8_add);
}
