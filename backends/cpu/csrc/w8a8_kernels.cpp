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
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

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
__attribute__((target("avx2"))) void micro_avx2(const int8_t* xq, int64_t ldx, const int8_t* w, int64_t K4,
                                                int32_t* acc) {
  __m256i a[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) a[r][v] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < K4; ++i) {
    const int8_t* wb = w + i * NB * 4;
    __m256i wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * v));
    for (int r = 0; r < R; ++r) {
      int32_t d;
      std::memcpy(&d, xq + (r * ldx + i) * 4, 4);
      const __m256i xb = _mm256_set1_epi32(d);
      const __m256i ax = _mm256_sign_epi8(xb, xb);
      for (int v = 0; v < 4; ++v) {
        const __m256i p16 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[v], xb));
        a[r][v] = _mm256_add_epi32(a[r][v], _mm256_madd_epi16(p16, ones));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * NB + 8 * v), a[r][v]);
}

template <int R>
__attribute__((target("avx2,avxvnni"))) void micro_avxvnni(const int8_t* xu, int64_t ldx, const int8_t* w,
                                                           int64_t K4, int32_t* acc) {
  __m256i a[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) a[r][v] = _mm256_setzero_si256();
  for (int64_t i = 0; i < K4; ++i) {
    const int8_t* wb = w + i * NB * 4;
    __m256i wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * v));
    for (int r = 0; r < R; ++r) {
      int32_t d;
      std::memcpy(&d, xu + (r * ldx + i) * 4, 4);
      const __m256i xb = _mm256_set1_epi32(d);
      for (int v = 0; v < 4; ++v) a[r][v] = _mm256_dpbusd_avx_epi32(a[r][v], xb, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * NB + 8 * v), a[r][v]);
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void micro_avx512vnni(const int8_t* xu, int64_t ldx,
                                                                                      const int8_t* w, int64_t K4,
                                                                                      int32_t* acc) {
  __m512i a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_si512();
  for (int64_t i = 0; i < K4; ++i) {
    const int8_t* wb = w + i * NB * 4;
    _mm_prefetch(reinterpret_cast<const char*>(wb) + 1024, _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(wb), w1 = _mm512_loadu_si512(wb + 64);
    for (int r = 0; r < R; ++r) {
      int32_t d;
      std::memcpy(&d, xu + (r * ldx + i) * 4, 4);
      const __m512i xb = _mm512_set1_epi32(d);
      a[r][0] = _mm512_dpbusd_epi32(a[r][0], xb, w0);
      a[r][1] = _mm512_dpbusd_epi32(a[r][1], xb, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_si512(acc + r * NB, a[r][0]);
    _mm512_storeu_si512(acc + r * NB + 16, a[r][1]);
  }
}

constexpr int kMaxR = 8;

template <int R>
void micro(int path, const int8_t* xq, int64_t ldx, const int8_t* w, int64_t K4, int32_t* acc) {
  switch (path) {
    case kAvx512Vnni: micro_avx512vnni<R>(xq, ldx, w, K4, acc); break;
    case kAvxVnni: micro_avxvnni<R>(xq, ldx, w, K4, acc); break;
    case kAvx2: micro_avx2<R>(xq, ldx, w, K4, acc); break;
    default: micro_scalar<R>(xq, ldx, w, K4, acc); break;
  }
}

// rows at a time per path: the accumulators stay in registers (16 zmm of 32 for avx512vnni; 8 ymm of 16 for AVX2)
int rows_for(int path) { return path == kAvx512Vnni ? 8 : path == kScalar ? 4 : 2; }

void micro_rows(int path, int rows, const int8_t* xq, int64_t ldx, const int8_t* w, int64_t K4, int32_t* acc) {
  switch (rows) {
    case 8: micro<8>(path, xq, ldx, w, K4, acc); break;
    case 7: micro<7>(path, xq, ldx, w, K4, acc); break;
    case 6: micro<6>(path, xq, ldx, w, K4, acc); break;
    case 5: micro<5>(path, xq, ldx, w, K4, acc); break;
    case 4: micro<4>(path, xq, ldx, w, K4, acc); break;
    case 3: micro<3>(path, xq, ldx, w, K4, acc); break;
    case 2: micro<2>(path, xq, ldx, w, K4, acc); break;
    default: micro<1>(path, xq, ldx, w, K4, acc); break;
  }
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
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, x.options());
  const int64_t M = K ? x.numel() / K : 0;
  if (out.numel() == 0) return out;
  std::vector<float> bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "fxc::linear_w8a8: bias must be [n]");
    at::Tensor b = bias->to(at::kFloat).contiguous();
    bf.assign(b.data_ptr<float>(), b.data_ptr<float>() + n);
  }
  if (K == 0) {
    out.zero_();
    if (!bf.empty()) out.add_(bias->to(x.scalar_type()));
    return out;
  }
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
      for (int64_t r0 = mb * MB; r0 < m_end; r0 += R) {
        const int rows = static_cast<int>(std::min<int64_t>(R, m_end - r0));
        micro_rows(path, rows, xq.data() + r0 * Kp, K4, wpan, K4, acc);
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

}  // namespace
}  // namespace fxcw8a8

TORCH_LIBRARY_FRAGMENT(fxc, m) { m.def("_w8a8_path(int want) -> int", &fxcw8a8::w8a8_path); }

TORCH_LIBRARY_IMPL(fxc, CPU, m) { m.impl("linear_w8a8", &fxcw8a8::linear_w8a8); }
