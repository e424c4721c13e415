// fxcompiler CPU kernel library: weight-streaming linear kernels.
//
//   fxc::linear(x, w_packed, bias?, n)                        fp32 / bf16 weights
//   fxc::linear_w8(x, w_int8_packed, scales, bias?, n, gs)    int8 weight-only
//
// The operator schemas are defined from Python (backends/cpu/_ops.py) together
// with their fake kernels and an ATen fallback registered under
// CompositeExplicitAutograd.  Loading this library adds CPU kernels, which take
// precedence over the composite fallback for CPU tensors.
//
// Packed layouts (NB = 32 output columns per panel, P = ceil(N / NB) panels,
// tail columns zero padded):
//   fp32  : float    [P, K, 32]            w[p, k, j]    = W[p*32 + j, k]
//   bf16  : bfloat16 [P, ceil(K/2), 32, 2] w[p, q, j, s] = W[p*32 + j, 2q + s]
//           (pairs of k interleaved: one 32-bit lane holds (k even, k odd),
//            which converts to two fp32 vectors with a shift and a mask)
//   int8  : int8     [P, K, 32]
//           scales: per channel float [P*32], per group float [P, K/G, 32]
//
// Every panel is contiguous and the panels a thread owns are adjacent, so each
// thread streams one contiguous region of the weight exactly once (M <= MRMAX).
//
// Build flags choose the ISA: -DFXC_AVX512 (AVX-512 F/BW/VL/DQ) or -DFXC_AVX2.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cpuid.h>
#include <immintrin.h>
#if defined(FXC_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <cstring>
#include <optional>
#include <vector>

#include "count_dispatch.h"  // fxc::with_count: run-time rows -> a register-blocked instance
#if defined(FXC_AVX512)
#include "bf16_simd.h"  // bf16 rounding and the bf16 silu step, shared with csrc/fused_ops.cpp
#include "simd_math.h"  // fxc::silu_mul512, fxc::silu_mul's fp32 step
#endif

#ifndef FXC_PF_DIST
#define FXC_PF_DIST 4096  // software prefetch distance in bytes (per stream)
#endif

#define FXC_INLINE inline __attribute__((always_inline))
// A register-blocked panel kernel stays its own function: inlined into a dispatching lambda beside other row
// counts, GCC kept some instances' accumulators on the stack, stored every k step (fp32 at M = 64: the 9-row
// block ran at half the rate of the 11-row ones, 28 % of the time for 14 % of the work).
#define FXC_PANEL __attribute__((noinline))

namespace fxc {
namespace {

// --------------------------------------------------------------------------
// Vector abstraction
// --------------------------------------------------------------------------
#if defined(FXC_AVX512)
struct Vec {
  using reg = __m512;
  static constexpr int L = 16;
  static constexpr int MRMAX = 12;         // rows per register block (2*MR accumulators)
  static constexpr int MR_GROUP_DIRECT = 3;  // int8 per-group, direct path (4*MR accumulators)
  static constexpr int ACC_BUDGET = 16;      // accumulator registers for the multi-stream kernel
  static constexpr int MR_PASS = 4;          // decode rows (M <= 4) of one panel in one pass
  static FXC_INLINE reg zero() { return _mm512_setzero_ps(); }
  static FXC_INLINE reg load(const float* p) { return _mm512_loadu_ps(p); }
  static FXC_INLINE void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static FXC_INLINE reg set1(float f) { return _mm512_set1_ps(f); }
  static FXC_INLINE reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static FXC_INLINE reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static FXC_INLINE reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  // 2*L bf16 values laid out as L (even k, odd k) pairs -> two fp32 vectors.
  static FXC_INLINE void load_bf16_pair(const uint16_t* p, reg& ev, reg& od) {
    const __m512i a = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
    ev = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
    od = _mm512_castsi512_ps(_mm512_and_si512(a, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static FXC_INLINE reg load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};
constexpr const char* kIsa = "avx512";
#elif defined(FXC_AVX2)
struct Vec {
  using reg = __m256;
  static constexpr int L = 8;
  static constexpr int MRMAX = 3;
  static constexpr int MR_GROUP_DIRECT = 1;
  static constexpr int ACC_BUDGET = 8;
  static constexpr int MR_PASS = 2;  // 4 rows x 4 ymm accumulators and a step's weights exceed 16 ymm
  static FXC_INLINE reg zero() { return _mm256_setzero_ps(); }
  static FXC_INLINE reg load(const float* p) { return _mm256_loadu_ps(p); }
  static FXC_INLINE void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static FXC_INLINE reg set1(float f) { return _mm256_set1_ps(f); }
  static FXC_INLINE reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static FXC_INLINE reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static FXC_INLINE reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static FXC_INLINE void load_bf16_pair(const uint16_t* p, reg& ev, reg& od) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    ev = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
    od = _mm256_castsi256_ps(_mm256_and_si256(a, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static FXC_INLINE reg load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
};
constexpr const char* kIsa = "avx2";
#else
#error "build with -DFXC_AVX512 or -DFXC_AVX2"
#endif

using reg = Vec::reg;
constexpr int NB = 32;            // output columns per panel
constexpr int NV = NB / Vec::L;   // vectors per panel row
constexpr int MRMAX = Vec::MRMAX;

// A prefetch with a hint chosen at run time: 0=T0 1=T1 2=T2 3=NTA, anything else: none.
FXC_INLINE void prefetch_hint(const void* p, int hint) {
  switch (hint) {
    case 0: _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); break;
    case 1: _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); break;
    case 2: _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T2); break;
    case 3: _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_NTA); break;
    default: break;
  }
}

#ifdef FXC_TUNE
// Tuning knobs (only in FXC_TUNE builds) are read from the environment.
static int64_t env_i64(const char* name, int64_t dflt) {
  const char* e = std::getenv(name);
  return e ? std::atol(e) : dflt;
}
// FXC_PF_DIST bytes ahead for the FMA kernels' weight prefetch (FXC_PF_HINT, as prefetch_hint, for every kind).
static int64_t g_pf_dist = env_i64("FXC_PF_DIST", FXC_PF_DIST);
#undef FXC_PF_DIST
#define FXC_PF_DIST g_pf_dist
#endif

// Software prefetch of the decode kernels' weight streams, FXC_PF_DIST ahead, with a hint per weight kind
// (fp32, bf16, int8): prefetch_hint's codes, -1 none.  Not AMD: T0 for every kind.  AMD Zen 5 (family 0x1A) and
// later: NTA for fp32 and int8 weights, none for bf16 (SmolLM2 batch-1 decode, medians of in-process A/Bs against
// none: fp32 NTA 1.086-1.104x, T0 0.99-1.04x; W8A16 NTA 1.07-1.17x; bf16 NTA 0.95x in a quiet hour, T0 0.925x).
// Older AMD CPUs: none for every kind, as measured on Zen 4 (bf16 1.1-1.25x faster without T0; NTA not measured
// there).  NTA lines skip L2 and L3, which then keep the KV cache, activations and code that the step's
// other operators read between two linears.  FXCOMPILER_CPU_PREFETCH=0|1|t0|nta sets one hint for every kind;
// fxc_set_prefetch_hints() changes them in-process (benchmarks, tests).
bool amd_cpu() {
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  return b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "Auth" "enti" "cAMD"
}
// CPUID family (base + extended): 0x19 Zen 3 / Zen 4, 0x1A Zen 5.
unsigned amd_family() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  const unsigned base = (a >> 8) & 0xF;
  return base == 0xF ? base + ((a >> 20) & 0xFF) : base;
}
constexpr int kPfNone = -1, kPfT0 = 0, kPfNta = 3;
struct PrefetchHints {
  int kind[3];  // fp32, bf16, int8
};
PrefetchHints decide_prefetch() {
  const char* env = std::getenv("FXCOMPILER_CPU_PREFETCH");
#ifdef FXC_TUNE
  if (std::getenv("FXC_PF_HINT")) {
    const int h = static_cast<int>(env_i64("FXC_PF_HINT", 0));
    return {{h, h, h}};
  }
#endif
  if (env) {
    const std::string v(env);
    if (v == "0") return {{kPfNone, kPfNone, kPfNone}};
    if (v == "1" || v == "t0") return {{kPfT0, kPfT0, kPfT0}};
    if (v == "nta") return {{kPfNta, kPfNta, kPfNta}};
  }
  if (amd_cpu()) return amd_family() >= 0x1A ? PrefetchHints{{kPfNta, kPfNone, kPfNta}}
                                             : PrefetchHints{{kPfNone, kPfNone, kPfNone}};
  return {{kPfT0, kPfT0, kPfT0}};
}
PrefetchHints g_prefetch = decide_prefetch();
template <class W>
FXC_INLINE void prefetch(const void* p) {
  prefetch_hint(p, g_prefetch.kind[W::PF]);
}

// --------------------------------------------------------------------------
// Weight formats: one "step" covers KS consecutive k for all 32 columns.
// --------------------------------------------------------------------------
struct WF32 {
  using T = float;
  static constexpr int PF = 0;  // PrefetchHints::kind index
  static constexpr int KS = 1;
  static constexpr int STEP = NB;  // elements per step
  static FXC_INLINE void load(const T* p, reg (&v)[KS][NV]) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) v[0][j] = Vec::load(p + j * Vec::L);
  }
};
struct WBF16 {
  using T = uint16_t;
  static constexpr int PF = 1;
  static constexpr int KS = 2;
  static constexpr int STEP = 2 * NB;
  static FXC_INLINE void load(const T* p, reg (&v)[KS][NV]) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) Vec::load_bf16_pair(p + j * 2 * Vec::L, v[0][j], v[1][j]);
  }
};
struct WI8 {
  using T = int8_t;
  static constexpr int PF = 2;
  static constexpr int KS = 1;
  static constexpr int STEP = NB;
  static FXC_INLINE void load(const T* p, reg (&v)[KS][NV]) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) v[0][j] = Vec::load_i8(p + j * Vec::L);
  }
};

template <class W>
FXC_INLINE void prefetch_steps(const typename W::T* w, int64_t s, int nsteps_here) {
  constexpr int BPS = W::STEP * sizeof(typename W::T);  // bytes per step
  const char* base = reinterpret_cast<const char*>(w + s * W::STEP) + FXC_PF_DIST;
  const int bytes = BPS * nsteps_here;
  for (int off = 0; off < bytes; off += 64) prefetch<W>(base + off);
}

// acc[m][:] += sum_{s < nsteps} x[m, s*KS:(s+1)*KS] * w[s]   (MR rows, register blocked)
template <class W, int MR>
FXC_INLINE void ukernel(const float* __restrict x, int64_t ldx, const typename W::T* __restrict w,
                        int64_t nsteps, reg (&acc)[MR][NV]) {
  constexpr int BPS = W::STEP * sizeof(typename W::T);
  constexpr int SPL = BPS >= 64 ? 1 : 64 / BPS;  // steps per cache line
  for (int64_t s = 0; s < nsteps; ++s) {
    const typename W::T* ws = w + s * W::STEP;
    if (BPS >= 64) {
      prefetch_steps<W>(w, s, 1);
    } else if ((s % SPL) == 0) {
      prefetch<W>(reinterpret_cast<const char*>(ws) + FXC_PF_DIST);
    }
    reg v[W::KS][NV];
    W::load(ws, v);
    const float* xs = x + s * W::KS;
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 2
      for (int q = 0; q < W::KS; ++q) {
        const reg b = Vec::set1(xs[m * ldx + q]);
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) acc[m][j] = Vec::fmadd(b, v[q][j], acc[m][j]);
      }
    }
  }
}

// Single row: U independent accumulator sets to hide FMA latency.
template <class W, int U = 4>
FXC_INLINE void ukernel_m1(const float* __restrict x, const typename W::T* __restrict w, int64_t nsteps,
                           reg (&acc)[1][NV]) {
  reg a[U][NV];
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) a[u][j] = Vec::zero();
  int64_t s = 0;
  for (; s + U <= nsteps; s += U) {
    prefetch_steps<W>(w, s, U);
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      reg v[W::KS][NV];
      W::load(w + (s + u) * W::STEP, v);
#pragma GCC unroll 2
      for (int q = 0; q < W::KS; ++q) {
        const reg b = Vec::set1(x[(s + u) * W::KS + q]);
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) a[u][j] = Vec::fmadd(b, v[q][j], a[u][j]);
      }
    }
  }
  for (; s < nsteps; ++s) {
    reg v[W::KS][NV];
    W::load(w + s * W::STEP, v);
#pragma GCC unroll 2
    for (int q = 0; q < W::KS; ++q) {
      const reg b = Vec::set1(x[s * W::KS + q]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) a[0][j] = Vec::fmadd(b, v[q][j], a[0][j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NV; ++j) {
    reg t = a[0][j];
#pragma GCC unroll 8
    for (int u = 1; u < U; ++u) t = Vec::add(t, a[u][j]);
    acc[0][j] = Vec::add(acc[0][j], t);
  }
}

template <class W, int MR>
FXC_INLINE void run_ukernel(const float* x, int64_t ldx, const typename W::T* w, int64_t nsteps,
                            reg (&acc)[MR][NV]) {
  if constexpr (MR == 1) {
    ukernel_m1<W>(x, w, nsteps, acc);
  } else {
    ukernel<W, MR>(x, ldx, w, nsteps, acc);
  }
}

// --------------------------------------------------------------------------
// Problem description + epilogue
// --------------------------------------------------------------------------
struct Problem {
  const float* x = nullptr;  // fp32 [M, ldx]
  const uint16_t* xb = nullptr;  // AMX path with bf16 x: the bf16 bits [M, K] (x is then null)
  int64_t ldx = 0;
  int64_t M = 0;
  int64_t K = 0;       // logical K
  int64_t Kp = 0;      // K rounded up to the weight's k step
  int64_t n = 0;       // valid output columns
  int64_t P = 0;       // panels
  const void* w = nullptr;
  const float* bias = nullptr;       // [n] or null
  const float* col_scale = nullptr;  // int8 per channel [P*32] or null
  const float* grp_scale = nullptr;  // int8 per group [P, G, 32] or null
  int64_t group = 0;                 // group size along K (per-group int8)
  int64_t ngroups = 0;
  float* out_f = nullptr;            // [M, n]
  c10::BFloat16* out_h = nullptr;    // [M, n]
  const float* res_f = nullptr;          // residual [M, n] added to the output (fxc::linear_w8_add), fp32 out
  const c10::BFloat16* res_h = nullptr;  // the same, bf16 out
};

#if defined(FXC_AVX512)
// One output row segment (32 columns of panel p, row m) from two fp32 vectors of column sums: per-channel
// scale, bias, bf16 rounding or fp32 store, masked N tail.  Every AVX-512 path (FMA, AMX, VDPBF16PS) ends here.
FXC_INLINE void store_row_vec(const Problem& pb, int64_t p, int64_t m, __m512 v0, __m512 v1) {
  const int64_t c0 = p * NB;
  const int nc = static_cast<int>(std::min<int64_t>(NB, pb.n - c0));
  const __mmask16 k0 = nc >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << nc) - 1);
  const __mmask16 k1 = nc >= 32 ? __mmask16(0xFFFF) : (nc > 16 ? static_cast<__mmask16>((1u << (nc - 16)) - 1) : __mmask16(0));
  if (pb.col_scale) {  // padded to P*32: full loads
    v0 = _mm512_mul_ps(v0, _mm512_loadu_ps(pb.col_scale + c0));
    v1 = _mm512_mul_ps(v1, _mm512_loadu_ps(pb.col_scale + c0 + 16));
  }
  if (pb.bias) {
    v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(k0, pb.bias + c0));
    v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(k1, pb.bias + c0 + 16));
  }
  const int64_t o = m * pb.n + c0;
  if (pb.res_f) {  // residual + linear as the graph adds them: fl(y + r)
    v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(k0, pb.res_f + o));
    v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(k1, pb.res_f + o + 16));
  } else if (pb.res_h) {  // bf16: y rounded to bf16 first, the sum in fp32 (rounded below)
    v0 = _mm512_add_ps(bf16_r(v0), bf16_load(pb.res_h + o, k0));
    v1 = _mm512_add_ps(bf16_r(v1), bf16_load(pb.res_h + o + 16, k1));
  }
  if (pb.out_f) {
    _mm512_mask_storeu_ps(pb.out_f + o, k0, v0);
    _mm512_mask_storeu_ps(pb.out_f + o + 16, k1, v1);
  } else {
    uint16_t* dst = reinterpret_cast<uint16_t*>(pb.out_h + o);
    _mm256_mask_storeu_epi16(dst, k0, bf16_round(v0));
    _mm256_mask_storeu_epi16(dst + 16, k1, bf16_round(v1));
  }
}
#else
// One output row of panel p from 32 fp32 column sums in tmp (modified in place).
FXC_INLINE void store_row(const Problem& pb, int64_t p, int64_t m, float* tmp) {
  const int64_t c0 = p * NB;
  const int nc = static_cast<int>(std::min<int64_t>(NB, pb.n - c0));
  if (pb.col_scale) {
    for (int c = 0; c < nc; ++c) tmp[c] *= pb.col_scale[c0 + c];
  }
  if (pb.bias) {
    for (int c = 0; c < nc; ++c) tmp[c] += pb.bias[c0 + c];
  }
  const int64_t o = m * pb.n + c0;
  if (pb.res_f) {
    for (int c = 0; c < nc; ++c) tmp[c] += pb.res_f[o + c];
  } else if (pb.res_h) {
    for (int c = 0; c < nc; ++c)
      tmp[c] = static_cast<float>(c10::BFloat16(tmp[c])) + static_cast<float>(pb.res_h[o + c]);
  }
  if (pb.out_f) {
    std::memcpy(pb.out_f + o, tmp, sizeof(float) * nc);
  } else {
    for (int c = 0; c < nc; ++c) pb.out_h[o + c] = c10::BFloat16(tmp[c]);  // round to nearest even
  }
}
#endif

// The rows m0 .. m0+MR of panel p from their accumulators.
template <int MR>
FXC_INLINE void epilogue(const Problem& pb, int64_t p, int64_t m0, reg (&acc)[MR][NV]) {
#if defined(FXC_AVX512)
  for (int m = 0; m < MR; ++m) store_row_vec(pb, p, m0 + m, acc[m][0], acc[m][1]);
#else
  alignas(64) float tmp[NB];
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) Vec::store(tmp + j * Vec::L, acc[m][j]);
    store_row(pb, p, m0 + m, tmp);
  }
#endif
}

// Direct path: weights converted in registers, rows m0 .. m0+MR of panel p.  ONE_CHAIN: one accumulator chain per
// (row, column vector) in k order also for MR = 1, whose default interleaves 4 (ukernel_m1).
template <class W, int MR, bool ONE_CHAIN = false>
FXC_PANEL void panel_direct(const Problem& pb, int64_t p, int64_t m0) {
  reg acc[MR][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[m][j] = Vec::zero();
  const auto* w = static_cast<const typename W::T*>(pb.w) + p * (pb.Kp * NB);
  if constexpr (ONE_CHAIN)
    ukernel<W, MR>(pb.x + m0 * pb.ldx, pb.ldx, w, pb.Kp / W::KS, acc);
  else
    run_ukernel<W, MR>(pb.x + m0 * pb.ldx, pb.ldx, w, pb.Kp / W::KS, acc);
  epilogue<MR>(pb, p, m0, acc);
}

// fp32 weights, several row blocks per panel (MRMAX < M, weights read in place): the first block of a
// panel would wait on DRAM (one sequential stream at the core's ~12 GB/s) and the others run from L2, so
// memory and FMAs take turns.  Instead, while row block b of mb of panel p runs, part b of the next panel
// (1/mb of its lines, spread evenly over the k steps: 1.07x over one line per step from the first) is
// prefetched into L2: the weight stream runs during every block and the first block of the next panel
// starts from L2 (SmolLM2 fp32 at M = 32, 1 thread, weights from DRAM: 1.3-1.5x per linear).
// FXCOMPILER_CPU_PANEL_PREFETCH=0 (or fxc_set_panel_prefetch(0)) switches it off; numerics unchanged.
int decide_panel_prefetch() {
  const char* env = std::getenv("FXCOMPILER_CPU_PANEL_PREFETCH");
  return env && env[0] == '0' ? 0 : 1;
}
int g_panel_prefetch = decide_panel_prefetch();

// fp32 rows m0 .. m0+MR of panel p from x packed k-major for this row block (xp[k * MR_BASE + m], one
// sequential stream instead of MR rows ldx apart: 1.2-1.45x at M = 32, the same products in the same order),
// prefetching pf_lines lines from pf into L2 on the way.
template <int MR>
FXC_PANEL void panel_f32_packed(const Problem& pb, int64_t p, int64_t m0, const float* __restrict xp, int64_t xstride,
                      const char* pf, int64_t pf_lines) {
  reg acc[MR][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[m][j] = Vec::zero();
  const float* __restrict w = static_cast<const float*>(pb.w) + p * (pb.Kp * NB);
  const int64_t nsteps = pb.Kp;
  int64_t pf_acc = 0;
  for (int64_t s = 0; s < nsteps; ++s) {
    prefetch_steps<WF32>(w, s, 1);
    pf_acc += pf_lines;  // pf_lines <= nsteps lines, spread evenly over the steps
    if (pf_acc >= nsteps) {
      pf_acc -= nsteps;
      _mm_prefetch(pf, _MM_HINT_T1);
      pf += 64;
    }
    reg v[1][NV];
    WF32::load(w + s * NB, v);
    const float* xs = xp + s * xstride;
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const reg b = Vec::set1(xs[m]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[m][j] = Vec::fmadd(b, v[0][j], acc[m][j]);
    }
  }
  epilogue<MR>(pb, p, m0, acc);
}

// int8 with per-group scales, direct path (small MR only: 4*MR accumulators).
template <int MR>
FXC_PANEL void panel_i8_grouped(const Problem& pb, int64_t p, int64_t m0) {
  reg fin[MR][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) fin[m][j] = Vec::zero();
  const int8_t* w = static_cast<const int8_t*>(pb.w) + p * (pb.K * NB);
  const float* sc = pb.grp_scale + p * pb.ngroups * NB;
  const float* x = pb.x + m0 * pb.ldx;
  for (int64_t g = 0; g < pb.ngroups; ++g) {
    reg acc[MR][NV];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[m][j] = Vec::zero();
    run_ukernel<WI8, MR>(x + g * pb.group, pb.ldx, w + g * pb.group * NB, pb.group, acc);
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const reg s = Vec::load(sc + g * NB + j * Vec::L);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) fin[m][j] = Vec::fmadd(acc[m][j], s, fin[m][j]);
    }
  }
  epilogue<MR>(pb, p, m0, fin);
}

// Scratch path (M > MRMAX): convert the panel once to fp32 [Kp, 32], reuse for all row blocks.
template <class W>
void convert_panel(const Problem& pb, int64_t p, float* __restrict dst) {
  if constexpr (std::is_same_v<W, WBF16>) {
    const uint16_t* w = static_cast<const uint16_t*>(pb.w) + p * (pb.Kp * NB);
    for (int64_t q = 0; q < pb.Kp / 2; ++q) {
      reg v[2][NV];
      WBF16::load(w + q * 2 * NB, v);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) {
        Vec::store(dst + (2 * q) * NB + j * Vec::L, v[0][j]);
        Vec::store(dst + (2 * q + 1) * NB + j * Vec::L, v[1][j]);
      }
    }
  } else {
    static_assert(std::is_same_v<W, WI8>);
    const int8_t* w = static_cast<const int8_t*>(pb.w) + p * (pb.K * NB);
    for (int64_t k = 0; k < pb.K; ++k) {
      reg v[1][NV];
      WI8::load(w + k * NB, v);
      if (pb.grp_scale) {
        const float* sc = pb.grp_scale + (p * pb.ngroups + k / pb.group) * NB;
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) v[0][j] = Vec::mul(v[0][j], Vec::load(sc + j * Vec::L));
      }
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) Vec::store(dst + k * NB + j * Vec::L, v[0][j]);
    }
  }
}

template <int MR>
FXC_PANEL void panel_scratch(const Problem& pb, const float* panel, int64_t p, int64_t m0) {
  reg acc[MR][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[m][j] = Vec::zero();
  ukernel<WF32, MR>(pb.x + m0 * pb.ldx, pb.ldx, panel, pb.Kp, acc);
  epilogue<MR>(pb, p, m0, acc);
}


// --------------------------------------------------------------------------
// AMX (bf16 tiles) for larger M.  x is split into bf16 hi + lo parts when it is
// fp32 (x ~= hi + lo to ~2^-17 relative), so fp32 activations keep ~fp32
// accuracy; bf16 activations use one pass and are exact.  Products are summed in
// fp32 by TDPBF16PS.  Weights: the bf16 packed layout is already the VNNI layout a
// B tile wants (16 k-pairs x 16 columns x 2, row stride 128 bytes); int8 weights
// are converted exactly to bf16 per panel (|q| <= 127 is exact in bf16).
//
// Structure (weights are read from memory exactly once per call):
//   * the 2 threads split the panels (N), never M, so each weight byte is read by
//     one thread; each thread walks its panels in S interleaved sub-ranges
//     (several sequential streams for the hardware prefetcher) and software-
//     prefetches the next panel (L2) spread over the work on the current one;
//   * per panel, all M rows are computed while the panel sits in L1/L2: C tiles
//     0..3 = 2 row blocks of 16 x 2 column halves, A tiles 4/5, B tiles 6/7;
//     the K loop is blocked (kblk chunks of 32 k) so that the activation tiles of
//     one K block stay in L1 across the row blocks, C partial sums go through a
//     per-thread fp32 buffer [rows, 32] between K blocks;
//   * the epilogue converts/stores that buffer row by row with AVX-512 (bias,
//     per-channel scale, bf16 rounding, masked N tail).
// Activations are packed once per call (in parallel for large M) into
// thread_local buffers: bf16 [Mpad/16][chunks][16 rows][32 k], zero padded.
// --------------------------------------------------------------------------
#if defined(FXC_AMX)
bool amx_usable() {
  static const bool ok = [] {
    const char* env = std::getenv("FXCOMPILER_CPU_AMX");
    if (env && env[0] == '0') return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;  // AMX-TILE, AMX-BF16
    if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    if ((xlo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG | XTILEDATA enabled by the OS
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kAmxMinM = 8;  // below: the FMA kernels (bandwidth bound anyway)

// Tuning constants (FXC_TUNE builds read them from the environment).
#ifdef FXC_TUNE
static int64_t g_amx_streams = env_i64("FXC_AMX_STREAMS", 4);     // interleaved panel sub-ranges per thread
static int64_t g_amx_pf_ahead = env_i64("FXC_AMX_PF_AHEAD", 1);   // prefetch the panel this many ahead (0: off)
static int64_t g_amx_pf_hint = env_i64("FXC_AMX_PF_HINT", 1);     // as prefetch_hint
static int64_t g_amx_kbytes = env_i64("FXC_AMX_KBYTES", 40960);   // B (weight) bytes per K block
#define FXC_AMX_STREAMS g_amx_streams
#define FXC_AMX_PF_AHEAD g_amx_pf_ahead
#define FXC_AMX_KBYTES g_amx_kbytes
static int64_t g_amx_epi = env_i64("FXC_AMX_EPI", 1);  // 1: epilogue interleaved with the next panel
#define FXC_AMX_EPI g_amx_epi

FXC_INLINE void amx_prefetch(const void* p) { prefetch_hint(p, g_amx_pf_hint); }
#else
#define FXC_AMX_STREAMS 4
#define FXC_AMX_PF_AHEAD 1
#define FXC_AMX_KBYTES 40960
#define FXC_AMX_EPI 1
FXC_INLINE void amx_prefetch(const void* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }
#endif

// Grow-only 64-byte aligned scratch (one per thread and use: no per-call allocation).
struct ScratchBuf {
  void* p = nullptr;
  size_t cap = 0;
  ~ScratchBuf() { std::free(p); }
  template <class T>
  T* get(size_t count) {
    const size_t bytes = count * sizeof(T);
    if (bytes > cap) {
      std::free(p);
      cap = (bytes + 4095) & ~size_t(4095);
      p = std::aligned_alloc(64, cap);
      TORCH_CHECK(p != nullptr, "fxc: out of memory (", cap, " bytes of scratch)");
    }
    return static_cast<T*>(p);
  }
};

struct AmxPlan {
  int64_t Q = 0;        // k pairs (incl. a zero odd k when K is odd)
  int64_t chunks = 0;   // 32-k chunks = A/B tile steps
  int64_t cfull = 0;    // chunks readable in place from a bf16 panel (the rest: tail buffer)
  int64_t kblk = 0;     // chunks per K block
  int64_t Mpad = 0;     // rows rounded up to 16
  int64_t pstride = 0;  // panel stride in weight elements
  bool int8_w = false;
  bool lo = false;      // fp32 x: second (lo) pass
  bool grouped = false;
  int64_t cpg = 0;      // chunks per scale group
  const uint16_t* xh = nullptr;
  const uint16_t* xl = nullptr;
};

// Rows [m0, m1) of the A buffers (m1 <= Mpad); rows >= M and k >= K are zero.
void amx_pack_rows(const Problem& pb, const AmxPlan& pl, uint16_t* xh, uint16_t* xl, int64_t m0, int64_t m1) {
  const int64_t K = pb.K, kp = pl.chunks * 32;
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t row = (m / 16) * pl.chunks * 512 + (m % 16) * 32;  // + c * 512 + (k % 32)
    const bool real = m < pb.M;
    for (int64_t k = 0; k < kp; k += 16) {
      const int64_t o = row + (k / 32) * 512 + (k % 32);
      const int nk = real ? static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, K - k))) : 0;
      const __mmask16 mk = static_cast<__mmask16>((1u << nk) - 1);
      if (pb.xb) {  // bf16 x: copy, exact
        const __m256i h = _mm256_maskz_loadu_epi16(mk, pb.xb + m * K + k);
        _mm256_store_si256(reinterpret_cast<__m256i*>(xh + o), h);
      } else {
        const __m512 v = _mm512_maskz_loadu_ps(mk, pb.x + m * pb.ldx + k);
        const __m256i hi = bf16_round(v);
        _mm256_store_si256(reinterpret_cast<__m256i*>(xh + o), hi);
        if (xl) {
          const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
          _mm256_store_si256(reinterpret_cast<__m256i*>(xl + o), bf16_round(_mm512_sub_ps(v, hf)));
        }
      }
    }
  }
}

// int8 panel -> bf16 B layout [chunks][16 pairs][32][2] (zero padded); lane j of pair q =
// (bf16(w[2q+1][j]) << 16) | bf16(w[2q][j]), exact for |w| <= 127.
void amx_convert_i8_panel(const Problem& pb, const AmxPlan& pl, int64_t p, uint16_t* dst) {
  const int8_t* w8 = static_cast<const int8_t*>(pb.w) + p * pb.K * NB;
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t qfull = pb.K / 2;
  int64_t q = 0;
  for (; q < qfull; ++q) {
#pragma GCC unroll 2
    for (int j = 0; j < NB; j += 16) {
      const __m512 ev = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w8 + 2 * q * NB + j))));
      const __m512 od = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w8 + (2 * q + 1) * NB + j))));
      // (od & 0xFFFF0000) | (ev >> 16)
      const __m512i pair = _mm512_ternarylogic_epi32(_mm512_castps_si512(od), hi_mask,
                                                     _mm512_srli_epi32(_mm512_castps_si512(ev), 16), 0xEA);
      _mm512_store_si512(reinterpret_cast<void*>(dst + q * 2 * NB + 2 * j), pair);
    }
  }
  if (q < pl.Q) {  // odd K: the last pair has no odd k
    for (int j = 0; j < NB; j += 16) {
      const __m512 ev = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w8 + 2 * q * NB + j))));
      _mm512_store_si512(reinterpret_cast<void*>(dst + q * 2 * NB + 2 * j), _mm512_srli_epi32(_mm512_castps_si512(ev), 16));
    }
    ++q;
  }
  std::memset(dst + q * 2 * NB, 0, sizeof(uint16_t) * (pl.chunks * 16 - q) * 2 * NB);
}

// One output row segment (32 columns of panel p, row m) from fp32 sums.
FXC_INLINE void amx_store_row(const Problem& pb, int64_t p, int64_t m, const float* src) {
  store_row_vec(pb, p, m, _mm512_load_ps(src), _mm512_load_ps(src + 16));
}

// Software prefetch of the next D panels (in processing order), spread over the steps of the current
// one: while panel i is computed, part D-j of D of panel i+j is prefetched (j = 1..D), so D sequential
// streams are in flight and each panel is complete in L2 one panel ahead.
// The same hook also writes the previous panel's output rows a few per step (epilogue of panel i-1
// interleaved with the tile work of panel i, so that the vector conversion and the output stores, which
// miss the caches for large outputs, run in the shadow of the TDPBF16PS chain).
constexpr int kPfMax = 4;
struct PanelPrefetch {
  const char* p[kPfMax] = {};
  const char* end[kPfMax] = {};
  int n = 0;
  int per_step = 0;
  // pending epilogue: rows [m, m_end) of panel ep from sums at ebuf (row m0 first)
  const Problem* pb = nullptr;
  const float* ebuf = nullptr;
  int64_t ep = 0, m0 = 0, m = 0, m_end = 0;
  int rows_per_step = 0;
  FXC_INLINE void step() {
    for (int s = 0; s < n; ++s)
      for (int i = 0; i < per_step && p[s] < end[s]; ++i, p[s] += 64) amx_prefetch(p[s]);
    for (int i = 0; i < rows_per_step && m < m_end; ++i, ++m) amx_store_row(*pb, ep, m, ebuf + (m - m0) * NB);
  }
  void flush() {
    for (; m < m_end; ++m) amx_store_row(*pb, ep, m, ebuf + (m - m0) * NB);
  }
};

// Chunks [c0, c1) for the row blocks at ah (and ah + arow when TWO) into C tiles 0..3.  The operand
// that is used once per panel is loaded with TILELOADDT1 (streaming hint) so that the reused one stays
// in L1: with several row pairs that is A (B is reused by every row pair), with one row pair B (A is
// reused by every panel).  Measured (1 core, M=256, K=576): ~11.7 ns per TDPBF16PS with plain loads,
// ~9 with A streamed; the TDPBF16PS throughput itself is ~7.2 ns.
template <bool LO, bool TWO, bool STREAM_A>
FXC_INLINE void amx_steps(const AmxPlan& pl, const uint16_t* wb, const uint16_t* tailb, int64_t c0, int64_t c1,
                          const uint16_t* ah, const uint16_t* al, PanelPrefetch& pf) {
  const int64_t arow = pl.chunks * 512;
  auto load_a = [&](const uint16_t* a) {  // the row block(s) of one chunk into A tiles 4 (and 5)
    if constexpr (STREAM_A) {
      _tile_stream_loadd(4, a, 64);
      if constexpr (TWO) _tile_stream_loadd(5, a + arow, 64);
    } else {
      _tile_loadd(4, a, 64);
      if constexpr (TWO) _tile_loadd(5, a + arow, 64);
    }
  };
  auto multiply = [] {  // C tiles 0..3 += A tiles x B tiles 6/7
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  };
  for (int64_t c = c0; c < c1; ++c) {
    const uint16_t* b = c < pl.cfull ? wb + c * 1024 : tailb;
    if constexpr (STREAM_A) {
      _tile_loadd(6, b, 2 * NB * 2);
      _tile_loadd(7, b + 32, 2 * NB * 2);
    } else {
      _tile_stream_loadd(6, b, 2 * NB * 2);
      _tile_stream_loadd(7, b + 32, 2 * NB * 2);
    }
    load_a(ah + c * 512);
    multiply();
    if constexpr (LO) {  // fp32 x: the lo parts against the same B tiles
      load_a(al + c * 512);
      multiply();
    }
    pf.step();
  }
}

template <bool LO, bool TWO>
FXC_INLINE void amx_steps_sel(bool stream_a, const AmxPlan& pl, const uint16_t* wb, const uint16_t* tailb,
                              int64_t c0, int64_t c1, const uint16_t* ah, const uint16_t* al, PanelPrefetch& pf) {
  if (stream_a)
    amx_steps<LO, TWO, true>(pl, wb, tailb, c0, c1, ah, al, pf);
  else
    amx_steps<LO, TWO, false>(pl, wb, tailb, c0, c1, ah, al, pf);
}

// One thread: panels [p0, p1) x row blocks [rb0, rb1) of 16.
void amx_thread(const Problem& pb, const AmxPlan& pl, int64_t p0, int64_t p1, int64_t rb0, int64_t rb1) {
  static thread_local ScratchBuf s_b, s_c, s_order;
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);

  const int64_t nrow = (rb1 - rb0) * 16;
  // [2][nrow][32]: sums of the current panel and of the previous one (its epilogue still running)
  float* cbuf2 = s_c.get<float>(static_cast<size_t>(2 * nrow) * NB);
  // B staging: int8 weights (whole panel converted) or the partial last chunk of a bf16 panel.
  uint16_t* bbuf = s_b.get<uint16_t>(static_cast<size_t>(pl.int8_w ? pl.chunks : 1) * 1024);
  alignas(64) float gtmp[32 * NB];

  // Panel order: S interleaved contiguous sub-ranges.
  const int64_t cnt = p1 - p0;
  const int64_t S = std::max<int64_t>(1, std::min<int64_t>(FXC_AMX_STREAMS, cnt));
  int64_t* order = s_order.get<int64_t>(static_cast<size_t>(cnt));
  {
    const int64_t base = cnt / S, rem = cnt % S;
    int64_t i = 0;
    for (int64_t r = 0; r <= base; ++r)
      for (int64_t s = 0; s < S; ++s) {
        const int64_t len = base + (s < rem ? 1 : 0);
        if (r < len) order[i++] = p0 + s * base + std::min<int64_t>(s, rem) + r;
      }
  }
  const int64_t esz = pl.int8_w ? 1 : 2;
  const int64_t pbytes = pl.pstride * esz;
  const int64_t npairs = (rb1 - rb0 + 1) / 2;
  const bool stream_a = npairs > 1;
  const int64_t steps = npairs * pl.chunks;
  const int64_t pf_d = std::max<int64_t>(0, std::min<int64_t>(kPfMax, FXC_AMX_PF_AHEAD));
  const int64_t part_lines = pf_d > 0 ? ((pbytes + 63) / 64 + pf_d - 1) / pf_d : 0;
  const int per_step = static_cast<int>((part_lines + steps - 1) / steps);

  const int64_t mend = std::min<int64_t>(pb.M, rb1 * 16);
  const int rows_per_step = FXC_AMX_EPI ? static_cast<int>((mend - rb0 * 16 + steps - 1) / steps) : 0;
  PanelPrefetch pend;  // epilogue of the previous panel
  for (int64_t i = 0; i < cnt; ++i) {
    const int64_t p = order[i];
    float* cbuf = cbuf2 + (i & 1) * nrow * NB;
    PanelPrefetch pf = pend;
    pf.per_step = per_step;
    for (int64_t j = 1; j <= pf_d && i + j < cnt; ++j) {
      const char* base = static_cast<const char*>(pb.w) + order[i + j] * pbytes;
      const int64_t lo = (pf_d - j) * part_lines * 64;
      pf.p[pf.n] = base + std::min(lo, pbytes);
      pf.end[pf.n] = base + std::min(lo + part_lines * 64, pbytes);
      ++pf.n;
    }
    const uint16_t* wb;
    if (pl.int8_w) {
      amx_convert_i8_panel(pb, pl, p, bbuf);
      wb = bbuf;
    } else {
      wb = static_cast<const uint16_t*>(pb.w) + p * pl.pstride;
      if (pl.cfull < pl.chunks) {  // partial last chunk: copy into a zero padded tile
        const int64_t qt = pl.Q - pl.cfull * 16;
        std::memcpy(bbuf, wb + pl.cfull * 1024, sizeof(uint16_t) * qt * 2 * NB);
        std::memset(bbuf + qt * 2 * NB, 0, sizeof(uint16_t) * (16 - qt) * 2 * NB);
      }
    }
    for (int64_t kb0 = 0; kb0 < pl.chunks; kb0 += pl.kblk) {
      const int64_t kb1 = std::min(pl.chunks, kb0 + pl.kblk);
      for (int64_t rb = rb0; rb < rb1; rb += 2) {
        const bool two = rb + 1 < rb1;
        float* crow = cbuf + (rb - rb0) * 16 * NB;
        if (kb0 == 0 || pl.grouped) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, crow, NB * 4);
          _tile_loadd(1, crow + 16, NB * 4);
          if (two) {
            _tile_loadd(2, crow + 16 * NB, NB * 4);
            _tile_loadd(3, crow + 16 * NB + 16, NB * 4);
          }
        }
        const uint16_t* ah = pl.xh + rb * pl.chunks * 512;
        const uint16_t* al = pl.lo ? pl.xl + rb * pl.chunks * 512 : nullptr;
        if (pl.lo) {
          if (two)
            amx_steps_sel<true, true>(stream_a, pl, wb, bbuf, kb0, kb1, ah, al, pf);
          else
            amx_steps_sel<true, false>(stream_a, pl, wb, bbuf, kb0, kb1, ah, al, pf);
        } else {
          if (two)
            amx_steps_sel<false, true>(stream_a, pl, wb, bbuf, kb0, kb1, ah, al, pf);
          else
            amx_steps_sel<false, false>(stream_a, pl, wb, bbuf, kb0, kb1, ah, al, pf);
        }
        float* cdst = pl.grouped ? gtmp : crow;
        _tile_stored(0, cdst, NB * 4);
        _tile_stored(1, cdst + 16, NB * 4);
        if (two) {
          _tile_stored(2, cdst + 16 * NB, NB * 4);
          _tile_stored(3, cdst + 16 * NB + 16, NB * 4);
        }
        if (pl.grouped) {
          const float* sc = pb.grp_scale + (p * pb.ngroups + kb0 / pl.cpg) * NB;
          const __m512 s0 = _mm512_loadu_ps(sc), s1 = _mm512_loadu_ps(sc + 16);
          const int rows = two ? 32 : 16;
          if (kb0 == 0) {
            for (int r = 0; r < rows; ++r) {
              _mm512_store_ps(crow + r * NB, _mm512_mul_ps(_mm512_load_ps(gtmp + r * NB), s0));
              _mm512_store_ps(crow + r * NB + 16, _mm512_mul_ps(_mm512_load_ps(gtmp + r * NB + 16), s1));
            }
          } else {
            for (int r = 0; r < rows; ++r) {
              _mm512_store_ps(crow + r * NB, _mm512_fmadd_ps(_mm512_load_ps(gtmp + r * NB), s0, _mm512_load_ps(crow + r * NB)));
              _mm512_store_ps(crow + r * NB + 16,
                              _mm512_fmadd_ps(_mm512_load_ps(gtmp + r * NB + 16), s1, _mm512_load_ps(crow + r * NB + 16)));
            }
          }
        }
      }
    }
    pf.flush();  // rest of the previous panel's rows
    pend = PanelPrefetch();
    pend.pb = &pb;
    pend.ebuf = cbuf;
    pend.ep = p;
    pend.m0 = pend.m = rb0 * 16;
    pend.m_end = mend;
    pend.rows_per_step = rows_per_step;
  }
  pend.flush();
  _tile_release();
}

bool amx_eligible(int64_t M, int64_t group) {
  return M >= kAmxMinM && (group <= 0 || group % 32 == 0) && amx_usable();
}

void run_amx(const Problem& pb, bool int8_w) {
  static thread_local ScratchBuf s_xh, s_xl;
  AmxPlan pl;
  pl.int8_w = int8_w;
  pl.Q = (int8_w ? pb.K + 1 : pb.Kp) / 2;
  pl.chunks = (pl.Q + 15) / 16;
  pl.cfull = int8_w ? pl.chunks : pl.Q / 16;
  pl.pstride = int8_w ? pb.K * NB : pl.Q * 2 * NB;
  pl.Mpad = (pb.M + 15) / 16 * 16;
  pl.lo = pb.xb == nullptr;
  pl.grouped = pb.grp_scale != nullptr;
  if (pl.grouped) {
    pl.cpg = pb.group / 32;
    pl.kblk = pl.cpg;
  } else {
    // One row pair: no reuse of B, no K blocking.  More rows: B blocks of ~FXC_AMX_KBYTES stay in L1
    // while all row pairs use them (C partial sums spill to cbuf between K blocks).
    pl.kblk = pl.Mpad <= 32 ? pl.chunks : std::max<int64_t>(1, std::min<int64_t>(pl.chunks, FXC_AMX_KBYTES / 2048));
    // K blocks of (nearly) equal size
    const int64_t nkb = (pl.chunks + pl.kblk - 1) / pl.kblk;
    pl.kblk = (pl.chunks + nkb - 1) / nkb;
  }
  const size_t asz = static_cast<size_t>(pl.Mpad) * pl.chunks * 32;
  uint16_t* xh = s_xh.get<uint16_t>(asz);
  uint16_t* xl = pl.lo ? s_xl.get<uint16_t>(asz) : nullptr;
  pl.xh = xh;
  pl.xl = xl;
  const int64_t nblk = pl.Mpad / 16;
  // Pack in parallel only when it is worth a second fork/join: fp32 x (hi/lo split) from 64 rows x 1K k,
  // bf16 x (a copy) from 256 rows x 1K k.
  if (pl.Mpad * pl.chunks >= (pl.lo ? 2048 : 8192)) {
    at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) { amx_pack_rows(pb, pl, xh, xl, b0 * 16, b1 * 16); });
  } else {
    amx_pack_rows(pb, pl, xh, xl, 0, pl.Mpad);
  }
  const int64_t nt = at::get_num_threads();
  if (pb.P >= nt || nblk < 2 * nt) {
    at::parallel_for(0, pb.P, 1, [&](int64_t p0, int64_t p1) { amx_thread(pb, pl, p0, p1, 0, nblk); });
  } else {  // few panels, many rows: split row-block pairs
    const int64_t npairs = (nblk + 1) / 2;
    at::parallel_for(0, npairs, 1, [&](int64_t q0, int64_t q1) {
      amx_thread(pb, pl, 0, pb.P, 2 * q0, std::min(nblk, 2 * q1));
    });
  }
}
#else
bool amx_eligible(int64_t, int64_t) { return false; }
void run_amx(const Problem&, bool) {}
#endif

// --------------------------------------------------------------------------
// AVX-512-BF16 (VDPBF16PS) for bf16 weights and bf16 activations, M > kMultiMaxM rows,
// on CPUs without AMX (or with it switched off): AMD Zen 4/5, Intel Cooper Lake, and
// Sapphire Rapids and later under FXCOMPILER_CPU_AMX=0.
//
// The packed bf16 panel [ceil(K/2)][32][2] already is the layout VDPBF16PS wants for one
// operand: 32-bit lane j of pair q holds (W[j, 2q], W[j, 2q+1]), so a pair step of a panel
// is two zmm loads, and one 32-bit broadcast of (x[m, 2q], x[m, 2q+1]) per row gives the
// other operand.  No weight conversion at all (the FMA path widens every weight to fp32).
// Register block: up to 12 rows x 32 columns = 24 zmm accumulators, 2 weight registers,
// the row broadcasts from memory (vpbroadcastd m32, a load-port op).  The two threads
// split the panels (N) first, as the FMA path, so each weight byte is read from memory
// once per call; a thread walks its panels one after the other and runs every row block
// of a panel while it sits in L1/L2 (a panel is K * 64 bytes: 36 KB at K = 576, 96 KB at
// K = 1536; the activations [M, K] bf16 stay in L2 for M * K * 2 <= ~1 MB).
//
// Accuracy: bf16 x bf16 products are exact in fp32; VDPBF16PS adds them to the fp32
// accumulator (two roundings per pair instead of one per FMA, denormal inputs/outputs
// flushed to zero) -- the same sums as the AMX path, within the tests' fp32 bound.
// fp32 activations keep the FMA path (their bf16 rounding would cost accuracy).
//
// Selected at run time: compiled in when the compiler accepts -mavx512bf16 (only these
// functions are compiled for it, via the target attribute, so the library still loads on
// AVX-512 CPUs without BF16), used when CPUID says AVX512_BF16 and FXCOMPILER_CPU_BF16DOT
// is not 0 (fxc_set_bf16dot() switches it in-process for benchmarks and tests).
// --------------------------------------------------------------------------
#if defined(FXC_AVX512) && defined(FXC_BF16DOT)
#define FXC_BF16_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))

bool bf16dot_cpu() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    return ((a >> 5) & 1u) != 0;  // CPUID.(EAX=7,ECX=1):EAX[5] = AVX512_BF16
  }();
  return ok;
}

int g_bf16dot = -1;  // -1: not decided yet; 0/1 (fxc_set_bf16dot changes it)

bool bf16dot_usable() {
  if (g_bf16dot < 0) {
    const char* env = std::getenv("FXCOMPILER_CPU_BF16DOT");
    g_bf16dot = (bf16dot_cpu() && !(env && env[0] == '0')) ? 1 : 0;
  }
  return g_bf16dot == 1;
}

// Rows [m0, m0 + MR) x panel p: x pairs [M][Q] (row stride ldq pairs), the panel's Q pair steps.
// w: the panel's pairs [Q][32][2] (the packed bf16 weight's panel p, or an int8 panel converted by
// int8_panel_pairs).
template <int MR>
FXC_BF16_TARGET __attribute__((noinline)) void dot_panel(const Problem& pb, const uint16_t* __restrict w,
                                                         const uint32_t* __restrict xq, int64_t ldq, int64_t Q,
                                                         int64_t p, int64_t m0) {
  __m512 acc[MR][2];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const uint32_t* x = xq + m0 * ldq;
  for (int64_t q = 0; q < Q; ++q) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + q * 2 * NB));
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + q * 2 * NB + NB));
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      uint32_t xv;
      std::memcpy(&xv, x + m * ldq + q, sizeof(xv));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(xv));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) store_row_vec(pb, p, m0 + m, acc[m][0], acc[m][1]);
}

constexpr int kDotMR = 12;  // rows per register block (24 accumulators)
int64_t g_dot_xbytes = 192 * 1024;  // activation bytes per row group (L2: 1-2 MB per core); FXC_TUNE: settable

// An int8 panel [K][32] as bf16 pairs [Q][32][2] (Q = ceil(K/2), an odd K's last pair padded with 0), the
// layout dot_panel reads. Exact: an integer of at most 8 bits is a float whose low 16 bits are zero, so its
// bf16 is the float's high half. The column scales are applied in the output store, as on the AMX path.
FXC_BF16_TARGET void int8_panel_pairs(const int8_t* __restrict w, int64_t K, int64_t Q, uint16_t* __restrict out) {
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  auto widen = [](const int8_t* src) {
    return _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)))));
  };
  for (int64_t q = 0; q < Q; ++q) {
    const int8_t* r0 = w + 2 * q * NB;
    const bool odd_tail = 2 * q + 1 >= K;
    for (int h = 0; h < 2; ++h) {
      const __m512i a = widen(r0 + 16 * h);
      const __m512i b = odd_tail ? _mm512_setzero_si512() : widen(r0 + NB + 16 * h);
      _mm512_storeu_si512(reinterpret_cast<void*>(out + q * 2 * NB + h * NB),
                          _mm512_or_si512(_mm512_srli_epi32(a, 16), _mm512_and_si512(b, hi)));
    }
  }
}

constexpr int64_t kDotMinM = 5;  // fewer rows: the multi-stream GEMV (memory bound, converts in registers)

bool bf16dot_eligible(int64_t M) { return M >= kDotMinM && bf16dot_usable(); }

// bf16 weights, or int8 weights with per-column scales (int8_w: converted a panel at a time), bf16 x (pb.xb,
// [M, K] contiguous).
void run_bf16dot(const Problem& pb, bool int8_w) {
  static thread_local std::vector<uint16_t> s_pad;
  const int64_t Q = int8_w ? (pb.K + 1) / 2 : pb.Kp / 2;
  const uint32_t* xq;
  int64_t ldq = Q;
  if (pb.K % 2 == 0) {
    xq = reinterpret_cast<const uint32_t*>(pb.xb);  // read with memcpy: any 2-byte alignment is fine
  } else {  // odd K: rows padded with a zero k (the weight's padded k is zero too)
    s_pad.resize(static_cast<size_t>(pb.M) * 2 * Q);
    uint16_t* buf = s_pad.data();
    for (int64_t m = 0; m < pb.M; ++m) {
      std::memcpy(buf + m * 2 * Q, pb.xb + m * pb.K, sizeof(uint16_t) * pb.K);
      buf[m * 2 * Q + pb.K] = 0;
    }
    xq = reinterpret_cast<const uint32_t*>(buf);
  }
  const int64_t mb = (pb.M + kDotMR - 1) / kDotMR;  // balanced row blocks of <= kDotMR rows
  const int64_t mr_base = (pb.M + mb - 1) / mb;
  // Row groups whose activations (~g_dot_xbytes) stay in L2 while the thread's panels pass by: each panel
  // is read once per group (from L2/L3 after the first), the activations once per panel from L2.
  // Activations that fit L2 beside a panel (<= 512 KB) are one group.
  const int64_t group = pb.M * Q * 4 <= 512 * 1024
                            ? mb
                            : std::max<int64_t>(1, g_dot_xbytes / std::max<int64_t>(1, mr_base * Q * 4));
  auto work = [&](int64_t p0, int64_t p1, int64_t r0, int64_t r1) {
    static thread_local std::vector<uint16_t> s_panel;  // int8_w: the panel's bf16 pairs (K x 64 bytes)
    if (int8_w) s_panel.resize(static_cast<size_t>(Q) * 2 * NB);
    for (int64_t g0 = r0; g0 < r1; g0 += group) {
      const int64_t g1 = std::min(r1, g0 + group);
      for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* w;
        if (int8_w) {
          int8_panel_pairs(static_cast<const int8_t*>(pb.w) + p * pb.K * NB, pb.K, Q, s_panel.data());
          w = s_panel.data();
        } else {
          w = static_cast<const uint16_t*>(pb.w) + p * (pb.Kp * NB);
        }
        for (int64_t rb = g0; rb < g1; ++rb) {
          const int64_t m0 = rb * mr_base;
          const int mr = static_cast<int>(std::min<int64_t>(mr_base, pb.M - m0));
          with_count<kDotMR>(mr, [&](auto c) { dot_panel<decltype(c)::value>(pb, w, xq, ldq, Q, p, m0); });
        }
      }
    }
  };
  // Threads split the panels (each weight byte read by one thread) when that balances; else the row blocks.
  const int64_t nt = at::get_num_threads();
  if (pb.P % nt == 0 || pb.P >= 4 * nt || mb < nt)
    at::parallel_for(0, pb.P, 1, [&](int64_t p0, int64_t p1) { work(p0, p1, 0, mb); });
  else
    at::parallel_for(0, mb, 1, [&](int64_t r0, int64_t r1) { work(0, pb.P, r0, r1); });
}
#else
bool bf16dot_usable() { return false; }
bool bf16dot_eligible(int64_t) { return false; }
void run_bf16dot(const Problem&, bool) {}
#endif

// --------------------------------------------------------------------------
// Multi-stream kernel for small M (bandwidth bound).  One core reaches far more
// DRAM bandwidth reading S separate sequential streams than one (measured on the
// dev VM: ~10-12 GB/s with 1 stream vs ~17-18 GB/s with 4 per core), so each
// thread splits its panel range into S contiguous sub-ranges and walks them in
// lock step: S panels at a time, one accumulator set per panel.
// --------------------------------------------------------------------------
constexpr int streams_for(int mr, bool grouped) {
  const int budget = grouped ? Vec::ACC_BUDGET / 2 : Vec::ACC_BUDGET;
  const int s = budget / (mr * NV);
  return s >= 4 ? 4 : (s < 1 ? 1 : s);
}
constexpr int kMultiMaxM = 4;  // rows handled by the multi-stream kernel

#if defined(FXC_AVX512)
// fxc::linear_w8_silu_mul's epilogue: rows m0 .. m0+MR of gate panel pg (sums g) and of its up panel (sums u,
// panel pg + H/32) -> silu(gate) * up into the [M, H] output.  Each half is finished exactly as store_row_vec
// finishes a linear output (scale, bias, rounded to bf16 for bf16 out) and the product formed with
// fxc::silu_mul's own step (silu_mul512 / silu_mul_bf16_512), so the result is the unfused graph's bit for bit.
template <int MR>
FXC_INLINE void silu_epilogue(const Problem& pb, int64_t pg, int64_t m0, reg (&g)[MR][NV], reg (&u)[MR][NV]) {
  const int64_t H = pb.n / 2, cg = pg * NB, cu = cg + H;
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NV; ++j) {
      __m512 a = g[m][j], b = u[m][j];
      if (pb.col_scale) {
        a = _mm512_mul_ps(a, _mm512_loadu_ps(pb.col_scale + cg + j * 16));
        b = _mm512_mul_ps(b, _mm512_loadu_ps(pb.col_scale + cu + j * 16));
      }
      if (pb.bias) {
        a = _mm512_add_ps(a, _mm512_loadu_ps(pb.bias + cg + j * 16));
        b = _mm512_add_ps(b, _mm512_loadu_ps(pb.bias + cu + j * 16));
      }
      const int64_t o = (m0 + m) * H + cg + j * 16;
      if (pb.out_f)
        _mm512_storeu_ps(pb.out_f + o, fxc::silu_mul512(a, b));
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb.out_h + o),
                            bf16_round(fxc::silu_mul_bf16_512(bf16_r(a), bf16_r(b))));
    }
}
#endif

// S panels ps[0..S) in lock step, rows m0 .. m0+MR.  SILU: the streams are (gate, up) pairs whose sums meet in
// silu_epilogue instead of being stored.
template <class W, int MR, int S, bool GROUPED, bool SILU = false>
FXC_PANEL void panels_multi(const Problem& pb, const int64_t* ps, int64_t m0) {
  using T = typename W::T;
  constexpr int BPS = W::STEP * sizeof(T);
  const T* w[S];
  for (int s = 0; s < S; ++s) w[s] = static_cast<const T*>(pb.w) + ps[s] * (pb.Kp * NB);
  const float* x = pb.x + m0 * pb.ldx;
  const int64_t nsteps = pb.Kp / W::KS;
  const int64_t gsteps = GROUPED ? pb.group / W::KS : nsteps;
  reg acc[S][MR][NV];
  reg fin[GROUPED ? S : 1][MR][NV];
  if constexpr (GROUPED) {
    for (int s = 0; s < S; ++s)
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < NV; ++j) fin[s][m][j] = Vec::zero();
  }
  for (int64_t g0 = 0; g0 < nsteps; g0 += gsteps) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) acc[s][m][j] = Vec::zero();
    const int64_t g1 = g0 + gsteps;
    for (int64_t st = g0; st < g1; ++st) {
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        const T* ws = w[s] + st * W::STEP;
        if constexpr (BPS >= 64) {
#pragma GCC unroll 4
          for (int off = 0; off < BPS; off += 64) prefetch<W>(reinterpret_cast<const char*>(ws) + FXC_PF_DIST + off);
        } else {
          if (((st * BPS) & 63) == 0) prefetch<W>(reinterpret_cast<const char*>(ws) + FXC_PF_DIST);
        }
        reg v[W::KS][NV];
        W::load(ws, v);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
          for (int q = 0; q < W::KS; ++q) {
            const reg b = Vec::set1(x[m * pb.ldx + st * W::KS + q]);
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) acc[s][m][j] = Vec::fmadd(b, v[q][j], acc[s][m][j]);
          }
      }
    }
    if constexpr (GROUPED) {
      const int64_t g = g0 / gsteps;
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) {
          const reg sc = Vec::load(pb.grp_scale + (ps[s] * pb.ngroups + g) * NB + j * Vec::L);
#pragma GCC unroll 4
          for (int m = 0; m < MR; ++m) fin[s][m][j] = Vec::fmadd(acc[s][m][j], sc, fin[s][m][j]);
        }
    }
  }
  if constexpr (SILU) {
#if defined(FXC_AVX512)
    static_assert(S % 2 == 0, "gate/up stream pairs");
    for (int s = 0; s < S; s += 2) {
      if constexpr (GROUPED)
        silu_epilogue<MR>(pb, ps[s], m0, fin[s], fin[s + 1]);
      else
        silu_epilogue<MR>(pb, ps[s], m0, acc[s], acc[s + 1]);
    }
#endif
  } else {
    for (int s = 0; s < S; ++s) {
      if constexpr (GROUPED)
        epilogue<MR>(pb, ps[s], m0, fin[s]);
      else
        epilogue<MR>(pb, ps[s], m0, acc[s]);
    }
  }
}

// Rows m0 .. m0+MR of panel p, one accumulator chain per (row, column vector) in k order.
template <int MR>
FXC_INLINE void panel_chain(const Problem& pb, int kind, int64_t p, int64_t m0) {
  if (kind == 0)
    panel_direct<WF32, MR, true>(pb, p, m0);
  else if (kind == 1)
    panel_direct<WBF16, MR, true>(pb, p, m0);
  else
    panel_direct<WI8, MR, true>(pb, p, m0);
}

// Single-panel kernel for (kind, rows): the direct paths above.
template <int MR>
FXC_INLINE void panel_single(const Problem& pb, int kind, bool grouped, int64_t p, int64_t m0) {
  if constexpr (MR > Vec::MR_PASS) {
    // AVX2, 3-4 decode rows (per-channel weights; per-group int8 takes the scratch path there): passes of 2 rows,
    // the later ones reading the panel from L1/L2.  One pass of all rows spills its accumulators, and 4 rows of
    // bf16 or int8 weights went through the fp32 scratch panel (AMD Zen 5, 576 x 3072: 4 rows bf16 214 -> 145 us,
    // int8 189 -> 93; 3 rows int8 95 -> 87, fp32 165 -> 148).  3 rows of bf16 stay one pass: the lone third row's
    // pass waits on FMA latency (104 vs 116 us).  Every row's sums are one fp32 chain in k order either way, as in
    // the scratch path.
    if (MR == 3 && kind == 1) {
      panel_direct<WBF16, MR>(pb, p, m0);
    } else {
      panel_chain<Vec::MR_PASS>(pb, kind, p, m0);
      panel_chain<MR - Vec::MR_PASS>(pb, kind, p, m0 + Vec::MR_PASS);
    }
  } else if (kind == 0) {
    panel_direct<WF32, MR>(pb, p, m0);
  } else if (kind == 1) {
    panel_direct<WBF16, MR>(pb, p, m0);
  } else if (grouped) {
    if constexpr (MR <= Vec::MR_GROUP_DIRECT) panel_i8_grouped<MR>(pb, p, m0);
  } else {
    panel_direct<WI8, MR>(pb, p, m0);
  }
}

// panels_multi over ss (1..4, at most S) sub-ranges of base consecutive panels from p0, walked in lock step.
template <class W, int MR, int S, bool GROUPED>
void lockstep_panels(const Problem& pb, int64_t p0, int64_t ss, int64_t base) {
  for (int64_t i = 0; i < base; ++i) {
    int64_t ps[4];
    for (int64_t s = 0; s < ss; ++s) ps[s] = p0 + s * base + i;
    if (ss == 1) panels_multi<W, MR, 1, GROUPED>(pb, ps, 0);
    if constexpr (S >= 2) if (ss == 2) panels_multi<W, MR, 2, GROUPED>(pb, ps, 0);
    if constexpr (S >= 3) if (ss == 3) panels_multi<W, MR, 3, GROUPED>(pb, ps, 0);
    if constexpr (S >= 4) if (ss == 4) panels_multi<W, MR, 4, GROUPED>(pb, ps, 0);
  }
}

template <class W, int MR, bool GROUPED>
void run_multi_chunk(const Problem& pb, int kind, int64_t t0, int64_t t1) {
  constexpr int S = streams_for(MR, GROUPED);
  const int64_t cnt = t1 - t0;
  if constexpr (MR == 1 && S >= 2) {
    // One row: every panel through panels_multi (one accumulator chain per column vector, k in order), so a
    // panel's sums do not depend on how panels are grouped into streams (fxc::linear_w8_silu_mul pairs gate and
    // up panels).  ss streams, chosen so that no panel runs alone where that can be avoided (one panel's chains
    // wait on FMA latency); the leftover panels as one more, narrower group.
    int64_t ss = std::min<int64_t>(S, cnt);
    for (int64_t c = ss; c >= 2; --c)
      if (cnt % c != 1) {
        ss = c;
        break;
      }
    if (ss < 1) return;
    const int64_t base = cnt / ss, rem = cnt % ss;
    lockstep_panels<W, MR, S, GROUPED>(pb, t0, ss, base);
    if (rem > 0) lockstep_panels<W, MR, S, GROUPED>(pb, t0 + base * ss, rem, 1);
    return;
  }
  if (S == 1 || cnt < S) {
    for (int64_t p = t0; p < t1; ++p) panel_single<MR>(pb, kind, GROUPED, p, 0);
    return;
  }
  if constexpr (S > 1) {
    const int64_t base = cnt / S, rem = cnt % S;
    int64_t start[S];
    for (int s = 0; s < S; ++s) start[s] = t0 + s * base + std::min<int64_t>(s, rem);
    for (int64_t i = 0; i < base; ++i) {
      int64_t ps[S];
      for (int s = 0; s < S; ++s) ps[s] = start[s] + i;
      panels_multi<W, MR, S, GROUPED>(pb, ps, 0);
    }
    for (int s = 0; s < rem; ++s) panel_single<MR>(pb, kind, GROUPED, start[s] + base, 0);
  }
}

enum class Kind { F32, BF16, I8 };

void run(const Problem& pb, Kind kind) {
  const bool grouped = pb.grp_scale != nullptr;
  // Row blocking: balanced blocks of at most MRMAX rows.
  const int64_t mb = (pb.M + MRMAX - 1) / MRMAX;
  const int64_t mr_base = (pb.M + mb - 1) / mb;
  // bf16 / int8 row blocks convert each panel once to fp32; decode rows (M <= kMultiMaxM, more than one block only
  // on AVX2) stream it directly, in passes of Vec::MR_PASS rows
  const bool scratch = kind != Kind::F32 && ((mb > 1 && pb.M > kMultiMaxM) || (grouped && pb.M > Vec::MR_GROUP_DIRECT));
  if (pb.M <= kMultiMaxM && !scratch) {
    const int mr = static_cast<int>(pb.M);
    at::parallel_for(0, pb.P, 1, [&](int64_t t0, int64_t t1) {
      with_count<kMultiMaxM>(mr, [&](auto c) {
        constexpr int MR = decltype(c)::value;
        if (kind == Kind::F32)
          run_multi_chunk<WF32, MR, false>(pb, 0, t0, t1);
        else if (kind == Kind::BF16)
          run_multi_chunk<WBF16, MR, false>(pb, 1, t0, t1);
        else if (grouped)
          run_multi_chunk<WI8, MR, true>(pb, 2, t0, t1);
        else
          run_multi_chunk<WI8, MR, false>(pb, 2, t0, t1);
      });
    });
    return;
  }
  const int64_t ntasks = pb.P * mb;  // panel-major: a thread's tasks are adjacent panels
  // fp32 weights, several row blocks: x packed k-major per row block ([mb][Kp][mr_base]) for panel_f32_packed
  const bool packed_x = kind == Kind::F32 && mb > 1;
  float* xpk = nullptr;
  if (packed_x) {
    // Grow-only and not cleared: the slots of the rows past M in the last block are never read.
    static thread_local std::vector<float> xpk_buf;
    const size_t need = static_cast<size_t>(mb * pb.Kp * mr_base);
    if (xpk_buf.size() < need) xpk_buf.resize(need);
    xpk = xpk_buf.data();
    // Block by block, k outer: the stores run sequentially through the block, the loads along its rows (a
    // row-by-row scatter with an mr_base stride took ~20 % of an M = 32, K = 1536 call).
    at::parallel_for(0, mb, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t r0 = b * mr_base;
        const int rows = static_cast<int>(std::min<int64_t>(mr_base, pb.M - r0));
        const float* src = pb.x + r0 * pb.ldx;
        float* dst = xpk + b * pb.Kp * mr_base;
        with_count<MRMAX>(rows, [&](auto c) {
          constexpr int R = decltype(c)::value;
          for (int64_t k = 0; k < pb.Kp; ++k)
#pragma GCC unroll 16
            for (int m = 0; m < R; ++m) dst[k * mr_base + m] = src[m * pb.ldx + k];
        });
      }
    });
  }
  at::parallel_for(0, ntasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf;
    int64_t buf_panel = -1;
    if (scratch) buf.resize(static_cast<size_t>(pb.Kp) * NB + 16);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = t / mb;
      const int64_t m0 = (t % mb) * mr_base;
      const int mr = static_cast<int>(std::min<int64_t>(mr_base, pb.M - m0));
      if (scratch) {
        if (buf_panel != p) {
          if (kind == Kind::BF16)
            convert_panel<WBF16>(pb, p, buf.data());
          else
            convert_panel<WI8>(pb, p, buf.data());
          buf_panel = p;
        }
        with_count<MRMAX>(mr, [&](auto c) { panel_scratch<decltype(c)::value>(pb, buf.data(), p, m0); });
      } else if (packed_x) {
        // part (t % mb) of the next panel this thread computes, into L2 (none after its last panel)
        const char* pf = nullptr;
        int64_t pf_lines = 0;
        if (g_panel_prefetch && (p + 1) * mb < t1) {
          const int64_t lines = pb.Kp * NB * static_cast<int64_t>(sizeof(float)) / 64;  // per panel
          const int64_t b = t % mb, l0 = lines * b / mb;
          pf = static_cast<const char*>(pb.w) + ((p + 1) * pb.Kp * NB) * static_cast<int64_t>(sizeof(float)) + l0 * 64;
          pf_lines = lines * (b + 1) / mb - l0;
        }
        const float* xp = xpk + (t % mb) * pb.Kp * mr_base;
        with_count<MRMAX>(mr, [&](auto c) { panel_f32_packed<decltype(c)::value>(pb, p, m0, xp, mr_base, pf, pf_lines); });
      } else if (kind == Kind::F32) {
        with_count<MRMAX>(mr, [&](auto c) { panel_direct<WF32, decltype(c)::value>(pb, p, m0); });
      } else if (kind == Kind::BF16) {
        with_count<MRMAX>(mr, [&](auto c) { panel_direct<WBF16, decltype(c)::value>(pb, p, m0); });
      } else if (grouped) {
        with_count<Vec::MR_GROUP_DIRECT>(mr, [&](auto c) { panel_i8_grouped<decltype(c)::value>(pb, p, m0); });
      } else {
        with_count<MRMAX>(mr, [&](auto c) { panel_direct<WI8, decltype(c)::value>(pb, p, m0); });
      }
    }
  });
}

#if defined(FXC_AVX512)
// Whether run_silu computes int8 rows M (the multi-stream kernel with at least one gate/up pair of streams).
bool silu_fusable(const Problem& pb) {
  if (pb.M < 1 || pb.M > kMultiMaxM) return false;
  const bool grouped = pb.grp_scale != nullptr;
  if (grouped && pb.M > Vec::MR_GROUP_DIRECT) return false;
  bool ok = false;
  with_count<kMultiMaxM>(static_cast<int>(pb.M), [&](auto c) {
    ok = grouped ? streams_for(decltype(c)::value, true) >= 2 : streams_for(decltype(c)::value, false) >= 2;
  });
  return ok;
}

// int8 weights, n = 2H, H % 32 == 0, silu_fusable: each thread takes a range of gate panels j (up panel j + Q);
// two halves of it walk as 4 lock-step streams (gate and up of each) where the register budget allows, else
// one pair at a time.
template <int MR, bool GROUPED>
void run_silu_rows(const Problem& pb) {
  constexpr int S = streams_for(MR, GROUPED);
  const int64_t Q = pb.P / 2;
  at::parallel_for(0, Q, 1, [&](int64_t b, int64_t e) {
    int64_t half = 0;
    if constexpr (S >= 4) {
      half = (e - b) / 2;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t j0 = b + i, j1 = b + half + i;
        const int64_t ps[4] = {j0, j0 + Q, j1, j1 + Q};
        panels_multi<WI8, MR, 4, GROUPED, true>(pb, ps, 0);
      }
    }
    for (int64_t j = b + 2 * half; j < e; ++j) {
      const int64_t ps[2] = {j, j + Q};
      panels_multi<WI8, MR, 2, GROUPED, true>(pb, ps, 0);
    }
  });
}

void run_silu(const Problem& pb) {
  const bool grouped = pb.grp_scale != nullptr;
  with_count<kMultiMaxM>(static_cast<int>(pb.M), [&](auto c) {
    constexpr int MR = decltype(c)::value;
    if constexpr (streams_for(MR, true) >= 2 && MR <= Vec::MR_GROUP_DIRECT) {
      if (grouped) return run_silu_rows<MR, true>(pb);
    }
    if constexpr (streams_for(MR, false) >= 2) {
      if (!grouped) run_silu_rows<MR, false>(pb);
    }
  });
}
#endif

// --------------------------------------------------------------------------
// Operator front ends
// --------------------------------------------------------------------------
struct Prepared {
  Problem pb;
  at::Tensor out;
  std::vector<float> xbuf;
  at::Tensor x_keep;
  at::Tensor bias_f;
};

// x: [..., K] fp32 or bf16 -> fp32 rows with stride ldx >= Kp (zero padded).
// amx: the AMX path reads x itself (fp32 [M, K] or bf16 bits [M, K], contiguous), no copy.
void prepare_common(Prepared& pr, const at::Tensor& x, int64_t Kp, int64_t n, int64_t P,
                    const std::optional<at::Tensor>& bias, const char* op, bool amx = false) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(n > 0 && n <= P * NB && n > (P - 1) * NB, op, ": n=", n, " does not match ", P,
              " packed panels of ", NB);
  const int64_t K = x.size(-1);
  TORCH_CHECK(K > 0, op, ": K must be positive");
  const int64_t M = x.numel() / K;
  Problem& pb = pr.pb;
  pb.M = M;
  pb.K = K;
  pb.Kp = Kp;
  pb.n = n;
  pb.P = P;

  std::vector<int64_t> osz(x.sizes().begin(), x.sizes().end());
  osz.back() = n;
  pr.out = at::empty(osz, x.options());
  if (x.scalar_type() == at::kFloat)
    pb.out_f = pr.out.data_ptr<float>();
  else
    pb.out_h = pr.out.data_ptr<c10::BFloat16>();

  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, op, ": bias must have n=", n, " elements, got ", bias->numel());
    pr.bias_f = bias->to(at::kFloat).contiguous();
    pb.bias = pr.bias_f.data_ptr<float>();
  }

  const at::Tensor xc = x.contiguous();
  if (amx) {
    pr.x_keep = xc;
    pb.ldx = K;
    if (x.scalar_type() == at::kFloat)
      pb.x = xc.data_ptr<float>();
    else
      pb.xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
  } else if (x.scalar_type() == at::kFloat && Kp == K) {
    pr.x_keep = xc;
    pb.x = xc.data_ptr<float>();
    pb.ldx = K;
  } else {
    pr.xbuf.assign(static_cast<size_t>(M) * Kp, 0.f);
    pb.ldx = Kp;
    if (x.scalar_type() == at::kFloat) {
      const float* src = xc.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m) std::memcpy(pr.xbuf.data() + m * Kp, src + m * K, sizeof(float) * K);
    } else {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
      for (int64_t m = 0; m < M; ++m) {
        uint32_t* dst = reinterpret_cast<uint32_t*>(pr.xbuf.data() + m * Kp);  // fp32 bits
        for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<uint32_t>(src[m * K + k]) << 16;
      }
    }
    pb.x = pr.xbuf.data();
  }
}

// residual ([..., n], x's dtype) for the output loop to add (store_row_vec / store_row): the graph's
// `residual + linear(x)`, bit for bit.  The contiguous copy it may make is kept in rc for the call.
void set_residual(Prepared& pr, const at::Tensor& x, const at::Tensor& residual, at::Tensor& rc, const char* op) {
  TORCH_CHECK(residual.sizes() == pr.out.sizes() && residual.scalar_type() == x.scalar_type(), op,
              ": residual must be ", x.scalar_type(), " ", pr.out.sizes(), " (the output's shape), got ",
              residual.scalar_type(), " ", residual.sizes());
  rc = residual.contiguous();
  if (x.scalar_type() == at::kFloat)
    pr.pb.res_f = rc.data_ptr<float>();
  else
    pr.pb.res_h = rc.data_ptr<c10::BFloat16>();
}

// fxc::linear's body; residual: fxc::linear_add (the sum formed in the output loop), else null.
at::Tensor linear_impl(const char* op, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                       int64_t n, const at::Tensor* residual) {
  TORCH_CHECK(w.device().is_cpu() && x.device().is_cpu(), op, ": CPU tensors expected");
  TORCH_CHECK(w.is_contiguous(), op, ": packed weight must be contiguous");
  const int64_t K = x.size(-1);
  Kind kind;
  int64_t Kp;
  if (w.scalar_type() == at::kFloat) {
    TORCH_CHECK(w.dim() == 3 && w.size(1) == K && w.size(2) == NB,
                op, ": fp32 packed weight must be [P, K, 32] with K=", K, ", got ", w.sizes());
    kind = Kind::F32;
    Kp = K;
  } else if (w.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(w.dim() == 4 && w.size(1) == (K + 1) / 2 && w.size(2) == NB && w.size(3) == 2,
                op, ": bf16 packed weight must be [P, ceil(K/2), 32, 2] with K=", K, ", got ", w.sizes());
    kind = Kind::BF16;
    Kp = 2 * w.size(1);
  } else {
    TORCH_CHECK(false, op, ": packed weight must be float32 or bfloat16, got ", w.scalar_type());
  }
  Prepared pr;
  const bool amx = kind == Kind::BF16 && K > 0 && amx_eligible(x.numel() / K, 0);
  // bf16 weights and bf16 x without AMX: VDPBF16PS (reads x in place, like the AMX path)
  const bool dot = !amx && kind == Kind::BF16 && x.scalar_type() == at::kBFloat16 && K > 0 &&
                   bf16dot_eligible(x.numel() / K);
  prepare_common(pr, x, Kp, n, w.size(0), bias, op, amx || dot);
  at::Tensor rc;
  if (residual != nullptr) set_residual(pr, x, *residual, rc, op);
  if (pr.pb.M == 0) return pr.out;
  pr.pb.w = w.data_ptr();
  if (amx)
    run_amx(pr.pb, false);
  else if (dot)
    run_bf16dot(pr.pb, false);
  else
    run(pr.pb, kind);
  return pr.out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t n) {
  return linear_impl("fxc::linear", x, w, bias, n, nullptr);
}

// fxc::linear_add: residual + linear(x, ...) with the sum formed in the linear's epilogue (a layer's o_proj /
// down_proj and its residual add as one op), bit for bit the two ops, on every path (FMA, AMX, VDPBF16PS, AVX2).
at::Tensor linear_add(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                      const at::Tensor& residual, int64_t n) {
  return linear_impl("fxc::linear_add", x, w, bias, n, &residual);
}

// linear_w8's body.  residual ([..., n], x's dtype): added to each output as the graph's `residual + linear(x)`
// would (store_row_vec / store_row).  silu: n = 2H and the caller has checked that run_silu takes these rows;
// the output is then [..., H].
at::Tensor w8_linear(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size, const at::Tensor* residual,
                     bool silu) {
  TORCH_CHECK(w.device().is_cpu() && x.device().is_cpu(), op, ": CPU tensors expected");
  const int64_t K = x.size(-1);
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 3 && w.size(1) == K && w.size(2) == NB && w.is_contiguous(),
              op, ": packed weight must be contiguous int8 [P, K, 32] with K=", K, ", got ", w.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), op, ": scales must be contiguous float32");
  const int64_t P = w.size(0);
  Prepared pr;
  const bool per_channel = group_size <= 0 || group_size == K;
  const bool amx = !silu && K > 0 && amx_eligible(x.numel() / K, per_channel ? 0 : group_size);
  // per-channel int8 weights and bf16 x without AMX: VDPBF16PS on each panel converted to bf16 pairs
  const bool dot = !amx && !silu && per_channel && x.scalar_type() == at::kBFloat16 && K > 0 &&
                   bf16dot_eligible(x.numel() / K);
  prepare_common(pr, x, K, n, P, bias, op, amx || dot);
  if (per_channel) {
    TORCH_CHECK(scales.dim() == 1 && scales.size(0) == P * NB, op, ": per-channel scales must be [P*32], got ",
                scales.sizes());
    pr.pb.col_scale = scales.data_ptr<float>();
  } else {
    TORCH_CHECK(K % group_size == 0, op, ": group_size ", group_size, " must divide K=", K);
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == P && scales.size(1) == K / group_size && scales.size(2) == NB,
                op, ": per-group scales must be [P, K/group_size, 32], got ", scales.sizes());
    pr.pb.grp_scale = scales.data_ptr<float>();
    pr.pb.group = group_size;
    pr.pb.ngroups = K / group_size;
  }
  at::Tensor rc;
  if (residual != nullptr) set_residual(pr, x, *residual, rc, op);
  if (silu) {
    std::vector<int64_t> osz(x.sizes().begin(), x.sizes().end());
    osz.back() = n / 2;
    pr.out = at::empty(osz, x.options());
    pr.pb.out_f = x.scalar_type() == at::kFloat ? pr.out.data_ptr<float>() : nullptr;
    pr.pb.out_h = x.scalar_type() == at::kFloat ? nullptr : pr.out.data_ptr<c10::BFloat16>();
  }
  if (pr.pb.M == 0) return pr.out;
  pr.pb.w = w.data_ptr();
#if defined(FXC_AVX512)
  if (silu) {
    run_silu(pr.pb);
    return pr.out;
  }
#endif
  if (amx)
    run_amx(pr.pb, true);
  else if (dot)
    run_bf16dot(pr.pb, true);
  else
    run(pr.pb, Kind::I8);
  return pr.out;
}

at::Tensor linear_w8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size) {
  return w8_linear("fxc::linear_w8", x, w, scales, bias, n, group_size, nullptr, false);
}

// fxc::linear_w8_add: residual + linear_w8(x, ...) with the sum formed in the linear's epilogue (a layer's o_proj /
// down_proj and its residual add as one op), bit for bit the two ops, on every path (FMA, AMX, scratch).
at::Tensor linear_w8_add(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                         const std::optional<at::Tensor>& bias, const at::Tensor& residual, int64_t n,
                         int64_t group_size) {
  return w8_linear("fxc::linear_w8_add", x, w, scales, bias, n, group_size, &residual, false);
}

// fxc::linear_w8_silu_mul: silu(y[..., :H]) * y[..., H:] of y = linear_w8(x, ...) with n = 2H (a fused gate/up
// projection), H a multiple of 32 so that gate panel j and up panel j + H/32 cover the same columns.  Decode rows
// (M <= 4) on AVX-512 builds: each pair of panels is computed together and the product formed in registers
// (silu_epilogue), without the 2H-wide intermediate, the split and the second op.  Otherwise (more rows, AVX2
// builds) exactly the graph it replaces: linear_w8, then fxc::silu_mul on the halves.  Both equal that graph bit
// for bit.
at::Tensor linear_w8_silu_mul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                              const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size) {
  TORCH_CHECK(n > 0 && n % (2 * NB) == 0, "fxc::linear_w8_silu_mul: n=", n,
              " must be 2 * H with H a multiple of 32 (the gate and up halves on whole panels)");
  const int64_t H = n / 2;
  bool fused = false;
#if defined(FXC_AVX512)
  if (x.dim() >= 1 && x.size(-1) > 0) {
    Problem probe;
    probe.M = x.numel() / x.size(-1);
    const int64_t K = x.size(-1);
    if (!(group_size <= 0 || group_size == K)) probe.grp_scale = static_cast<const float*>(scales.data_ptr());
    fused = silu_fusable(probe);
  }
#endif
  if (fused) return w8_linear("fxc::linear_w8_silu_mul", x, w, scales, bias, n, group_size, nullptr, true);
  static const auto silu_mul = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("fxc::silu_mul", "")
                                   .typed<at::Tensor(at::Tensor, at::Tensor)>();
  const at::Tensor y = linear_w8(x, w, scales, bias, n, group_size);
  return silu_mul.call(y.narrow(-1, 0, H), y.narrow(-1, H, H));
}

// The ATen op fxc::linear_by_m replaced, on the dense weight: [K, N] with w_kn, x @ W (+ bias); else [N, K],
// F.linear.
at::Tensor linear_dense(const at::Tensor& x, const at::Tensor& w_dense, bool w_kn,
                        const std::optional<at::Tensor>& bias) {
  if (!w_kn) return at::linear(x, w_dense, bias);
  at::Tensor y = at::matmul(x, w_dense);
  return bias.has_value() && bias->defined() ? at::add(y, *bias) : y;
}

// fxc::linear_by_m: the per-M-range choice of passes/lower_cpu_kernels, made per call from M = numel / K
// (fxc_m: inclusive [lo, hi] pairs, hi = -1 unbounded, where fxc::linear wins; elsewhere the ATen op it
// replaced, on the dense weight: [K, N] with w_kn, x @ W (+ bias); else [N, K], F.linear).
at::Tensor linear_by_m(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& w_dense, bool w_kn,
                       const std::optional<at::Tensor>& bias, int64_t n, at::IntArrayRef fxc_m) {
  const int64_t K = x.size(-1);
  const int64_t M = K > 0 ? x.numel() / K : 0;
  for (size_t i = 0; i + 1 < fxc_m.size(); i += 2)
    if (M >= fxc_m[i] && (fxc_m[i + 1] < 0 || M <= fxc_m[i + 1])) return linear(x, w_packed, bias, n);
  return linear_dense(x, w_dense, w_kn, bias);
}

// fxc::linear_by_m_add: residual + linear_by_m(...): in fxc::linear's M ranges the sum is formed in its epilogue
// (fxc::linear_add), elsewhere the ATen op and one add; bit for bit the two ops either way.
at::Tensor linear_by_m_add(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& w_dense, bool w_kn,
                           const std::optional<at::Tensor>& bias, const at::Tensor& residual, int64_t n,
                           at::IntArrayRef fxc_m) {
  const int64_t K = x.size(-1);
  const int64_t M = K > 0 ? x.numel() / K : 0;
  for (size_t i = 0; i + 1 < fxc_m.size(); i += 2)
    if (M >= fxc_m[i] && (fxc_m[i + 1] < 0 || M <= fxc_m[i + 1]))
      return linear_impl("fxc::linear_by_m_add", x, w_packed, bias, n, &residual);
  const at::Tensor y = linear_dense(x, w_dense, w_kn, bias);
  TORCH_CHECK(residual.sizes() == y.sizes() && residual.scalar_type() == y.scalar_type(),
              "fxc::linear_by_m_add: residual must be ", y.scalar_type(), " ", y.sizes(),
              " (the output's shape), got ", residual.scalar_type(), " ", residual.sizes());
  return at::add(residual, y);
}

}  // namespace
}  // namespace fxc

TORCH_LIBRARY_IMPL(fxc, CPU, m) {
  m.impl("linear", &fxc::linear);
  m.impl("linear_w8", &fxc::linear_w8);
  m.impl("linear_w8_add", &fxc::linear_w8_add);
  m.impl("linear_w8_silu_mul", &fxc::linear_w8_silu_mul);
  m.impl("linear_by_m", &fxc::linear_by_m);
  m.impl("linear_add", &fxc::linear_add);
  m.impl("linear_by_m_add", &fxc::linear_by_m_add);
}

// The ISA this library was compiled for, queried from Python via ctypes.
extern "C" const char* fxc_kernels_isa() { return fxc::kIsa; }

// Evicts [p, p + bytes) from every cache level (one clflush per 64-byte line): the autotuner's timed calls then
// read their weight from DRAM, as a step of a model larger than the last-level cache reads every weight.
extern "C" void fxc_evict(const void* p, long bytes) {
  const char* c = static_cast<const char*>(p);
  for (long off = 0; off < bytes; off += 64) _mm_clflush(c + off);
  _mm_mfence();
}

// Whether the AMX path is compiled in and usable on this CPU/OS (1) or not (0).
#ifdef FXC_TUNE
extern "C" void fxc_set_tune(long dist, int hint) {
  fxc::g_pf_dist = dist;
  fxc::g_prefetch = {{hint, hint, hint}};
}
#if defined(FXC_AVX512) && defined(FXC_BF16DOT)
extern "C" void fxc_set_dot_tune(long xbytes) { fxc::g_dot_xbytes = xbytes; }
#endif
#ifdef FXC_AMX
// AMX knobs: panel streams per thread, prefetch panels ahead (0 = off), hint, B bytes per K block, step order.
extern "C" void fxc_set_amx_tune(long streams, long pf_ahead, long hint, long kbytes, long epi) {
  fxc::g_amx_epi = epi;
  fxc::g_amx_streams = streams;
  fxc::g_amx_pf_ahead = pf_ahead;
  fxc::g_amx_pf_hint = hint;
  fxc::g_amx_kbytes = kbytes;
}
#endif
#endif

// The decode kernels' weight-stream prefetch hint for fp32 (kind 0), bf16 (1) and int8 (2) weights: 0 T0, 1 T1,
// 2 T2, 3 NTA, -1 none.
extern "C" int fxc_prefetch_hint(int kind) { return kind >= 0 && kind < 3 ? fxc::g_prefetch.kind[kind] : -1; }

// Set the three hints in this process (benchmarks, tests; results are the same bits with any hint).
extern "C" void fxc_set_prefetch_hints(int f32, int bf16, int i8) { fxc::g_prefetch = {{f32, bf16, i8}}; }

// Whether the fp32 multi-row-block path prefetches the next panel into L2 (1) or not (0); fxc_set_panel_prefetch
// switches it in this process (benchmarks, tests); returns the new state.
extern "C" int fxc_kernels_panel_prefetch() { return fxc::g_panel_prefetch; }
extern "C" int fxc_set_panel_prefetch(int on) {
  fxc::g_panel_prefetch = on ? 1 : 0;
  return fxc::g_panel_prefetch;
}

// Whether the AVX-512-BF16 (VDPBF16PS) path is compiled in and in use (1) or not (0).
extern "C" int fxc_kernels_bf16dot() { return fxc::bf16dot_usable() ? 1 : 0; }

// Switch the VDPBF16PS path on (1, where the CPU has it) or off (0) in this process; returns the new state.
// For benchmarks and tests that compare it with the FMA path in one process (FXCOMPILER_CPU_BF16DOT=0 sets
// the initial state for a whole process).
extern "C" int fxc_set_bf16dot(int on) {
#if defined(FXC_AVX512) && defined(FXC_BF16DOT)
  fxc::g_bf16dot = (on && fxc::bf16dot_cpu()) ? 1 : 0;
#else
  (void)on;
#endif
  return fxc_kernels_bf16dot();
}

extern "C" int fxc_kernels_amx() {
#if defined(FXC_AMX)
  return fxc::amx_usable() ? 1 : 0;
#else
  return 0;
#endif
}
