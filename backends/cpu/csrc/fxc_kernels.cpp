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
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>
#if defined(FXC_AMX)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#ifndef FXC_PF_DIST
#define FXC_PF_DIST 4096  // software prefetch distance in bytes (per stream)
#endif

#define FXC_INLINE inline __attribute__((always_inline))

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

#ifdef FXC_TUNE
// Tuning knobs (only in FXC_TUNE builds): FXC_PF_DIST bytes, FXC_PF_HINT 0=T0 1=T1 2=NTA 3=off.
static int64_t g_pf_dist = [] { const char* e = std::getenv("FXC_PF_DIST"); return e ? std::atol(e) : FXC_PF_DIST; }();
static int g_pf_hint = [] { const char* e = std::getenv("FXC_PF_HINT"); return e ? std::atoi(e) : 0; }();
#undef FXC_PF_DIST
#define FXC_PF_DIST g_pf_dist
FXC_INLINE void prefetch(const void* p) {
  switch (g_pf_hint) {
    case 0: _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); break;
    case 1: _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); break;
    case 2: _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_NTA); break;
    default: break;
  }
}
#else
FXC_INLINE void prefetch(const void* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}
#endif

// --------------------------------------------------------------------------
// Weight formats: one "step" covers KS consecutive k for all 32 columns.
// --------------------------------------------------------------------------
struct WF32 {
  using T = float;
  static constexpr int KS = 1;
  static constexpr int STEP = NB;  // elements per step
  static FXC_INLINE void load(const T* p, reg (&v)[KS][NV]) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) v[0][j] = Vec::load(p + j * Vec::L);
  }
};
struct WBF16 {
  using T = uint16_t;
  static constexpr int KS = 2;
  static constexpr int STEP = 2 * NB;
  static FXC_INLINE void load(const T* p, reg (&v)[KS][NV]) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) Vec::load_bf16_pair(p + j * 2 * Vec::L, v[0][j], v[1][j]);
  }
};
struct WI8 {
  using T = int8_t;
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
  for (int off = 0; off < bytes; off += 64) prefetch(base + off);
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
      prefetch(reinterpret_cast<const char*>(ws) + FXC_PF_DIST);
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
};

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
  if (pb.out_f) {
    std::memcpy(pb.out_f + o, tmp, sizeof(float) * nc);
  } else {
    for (int c = 0; c < nc; ++c) pb.out_h[o + c] = c10::BFloat16(tmp[c]);  // round to nearest even
  }
}

template <int MR>
FXC_INLINE void epilogue(const Problem& pb, int64_t p, int64_t m0, reg (&acc)[MR][NV]) {
  alignas(64) float tmp[NB];
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) Vec::store(tmp + j * Vec::L, acc[m][j]);
    store_row(pb, p, m0 + m, tmp);
  }
}

// Direct path: weights converted in registers, rows m0 .. m0+MR of panel p.
template <class W, int MR>
void panel_direct(const Problem& pb, int64_t p, int64_t m0) {
  reg acc[MR][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[m][j] = Vec::zero();
  const auto* w = static_cast<const typename W::T*>(pb.w) + p * (pb.Kp * NB);
  run_ukernel<W, MR>(pb.x + m0 * pb.ldx, pb.ldx, w, pb.Kp / W::KS, acc);
  epilogue<MR>(pb, p, m0, acc);
}

// int8 with per-group scales, direct path (small MR only: 4*MR accumulators).
template <int MR>
void panel_i8_grouped(const Problem& pb, int64_t p, int64_t m0) {
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
void panel_scratch(const Problem& pb, const float* panel, int64_t p, int64_t m0) {
  reg acc[MR][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[m][j] = Vec::zero();
  ukernel<WF32, MR>(pb.x + m0 * pb.ldx, pb.ldx, panel, pb.Kp, acc);
  epilogue<MR>(pb, p, m0, acc);
}

// Runtime rows -> template MR dispatch.
template <int MR, class F>
FXC_INLINE void dispatch_mr(int mr, F&& f) {
  if constexpr (MR >= 1) {
    if (mr == MR) {
      f(std::integral_constant<int, MR>{});
      return;
    }
    dispatch_mr<MR - 1>(mr, std::forward<F>(f));
  }
}

// --------------------------------------------------------------------------
// AMX (bf16 tiles) for larger M.  x is split into bf16 hi + lo parts when it is
// fp32 (x ~= hi + lo to ~2^-17 relative), so fp32 activations keep ~fp32
// accuracy; bf16 activations use one pass and are exact.  Products are summed in
// fp32 by TDPBF16PS.  Weights: the bf16 packed layout is already the VNNI layout a
// B tile wants (16 k-pairs x 16 columns x 2, row stride 128 bytes); int8 weights
// are converted exactly to bf16 per panel (|q| <= 127 is exact in bf16).
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

// Tiles: 0..3 C (2 row blocks x 2 column halves), 4/5 A (row blocks), 6/7 B (column halves).
// xh/xl: bf16 activations blocked as [Mpad/16][chunks][16 rows][32 k] (zero padded), xl may be null.
void run_amx(const Problem& pb, bool int8_w, const uint16_t* xh, const uint16_t* xl, int64_t Mpad) {
  const int64_t Q = (int8_w ? pb.K + 1 : pb.Kp) / 2;  // k pairs
  const int64_t chunks = (Q + 15) / 16;                 // 32 k per chunk
  const int64_t mpairs = (Mpad / 16 + 1) / 2;
  const bool grouped = pb.grp_scale != nullptr;
  const int64_t chunks_per_group = grouped ? pb.group / 32 : chunks;
  const int64_t ntasks = pb.P * mpairs;
  at::parallel_for(0, ntasks, 1, [&](int64_t t0, int64_t t1) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    // Panel in B layout, used when the packed panel cannot be read in place
    // (int8 weights, or a K tail that is not a whole chunk).
    std::vector<uint16_t> bbuf;
    int64_t b_panel = -1;
    alignas(64) float cbuf[32 * NB];
    std::vector<float> gacc;  // per-group scaled sums [32, 32]
    if (grouped) gacc.resize(32 * NB);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = t / mpairs;
      const int64_t m0 = (t % mpairs) * 32;
      const bool two = m0 + 16 < Mpad;
      const uint16_t* wb;
      if (!int8_w && Q % 16 == 0) {
        wb = static_cast<const uint16_t*>(pb.w) + p * Q * 2 * NB;
      } else {
        if (b_panel != p) {
          bbuf.assign(static_cast<size_t>(chunks) * 16 * 2 * NB, 0);
          if (int8_w) {
            // lane j of pair q = (bf16(w[2q+1][j]) << 16) | bf16(w[2q][j]); exact for int8 values
            const int8_t* w8 = static_cast<const int8_t*>(pb.w) + p * pb.K * NB;
            const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
            for (int64_t q = 0; q < Q; ++q) {
              for (int j = 0; j < NB; j += 16) {
                const __m512i ev = _mm512_castps_si512(_mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w8 + 2 * q * NB + j)))));
                __m512i od = _mm512_setzero_si512();
                if (2 * q + 1 < pb.K)
                  od = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(w8 + (2 * q + 1) * NB + j)))));
                const __m512i pair = _mm512_or_si512(_mm512_and_si512(od, hi_mask), _mm512_srli_epi32(ev, 16));
                _mm512_storeu_si512(reinterpret_cast<void*>(bbuf.data() + q * 2 * NB + 2 * j), pair);
              }
            }
          } else {
            std::memcpy(bbuf.data(), static_cast<const uint16_t*>(pb.w) + p * Q * 2 * NB, sizeof(uint16_t) * Q * 2 * NB);
          }
          b_panel = p;
        }
        wb = bbuf.data();
      }
      if (grouped) std::fill(gacc.begin(), gacc.end(), 0.f);
      for (int64_t g0 = 0; g0 < chunks; g0 += chunks_per_group) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const int64_t g1 = std::min(chunks, g0 + chunks_per_group);
        for (int64_t c = g0; c < g1; ++c) {
          const uint16_t* bsrc = wb + c * 16 * 2 * NB;
          // weights stream from memory: prefetch 2 chunks (4 KB) ahead, into the next panel
          for (int off = 0; off < 2048; off += 64) prefetch(reinterpret_cast<const char*>(bsrc) + 4096 + off);
          _tile_loadd(6, bsrc, 2 * NB * 2);
          _tile_loadd(7, bsrc + 32, 2 * NB * 2);
          const int64_t ao = ((m0 / 16) * chunks + c) * 512;  // A tiles: contiguous 16 x 32 blocks
          _tile_loadd(4, xh + ao, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, xh + ao + chunks * 512, 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          if (xl) {
            _tile_loadd(4, xl + ao, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
              _tile_loadd(5, xl + ao + chunks * 512, 64);
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
        }
        _tile_stored(0, cbuf, NB * 4);
        _tile_stored(1, cbuf + 16, NB * 4);
        if (two) {
          _tile_stored(2, cbuf + 16 * NB, NB * 4);
          _tile_stored(3, cbuf + 16 * NB + 16, NB * 4);
        }
        if (grouped) {
          const float* sc = pb.grp_scale + (p * pb.ngroups + g0 / chunks_per_group) * NB;
          const int rows = two ? 32 : 16;
          for (int r = 0; r < rows; ++r)
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) {
              float* ga = gacc.data() + r * NB + j * Vec::L;
              Vec::store(ga, Vec::fmadd(Vec::load(cbuf + r * NB + j * Vec::L), Vec::load(sc + j * Vec::L), Vec::load(ga)));
            }
        }
      }
      const float* res = grouped ? gacc.data() : cbuf;
      const int64_t mend = std::min<int64_t>(pb.M, m0 + (two ? 32 : 16));
      alignas(64) float tmp[NB];
      for (int64_t m = m0; m < mend; ++m) {
        std::memcpy(tmp, res + (m - m0) * NB, sizeof(tmp));
        store_row(pb, p, m, tmp);
      }
    }
    _tile_release();
  });
}

// Returns false when AMX is not used for this problem.
// fp32 -> bf16 bits, round to nearest even (NaN stays NaN), 16 at a time.
FXC_INLINE __m256i bf16_rne(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

bool try_amx(const Problem& pb, bool int8_w, bool x_is_bf16) {
  if (pb.M < kAmxMinM || !amx_usable()) return false;
  if (pb.grp_scale && pb.group % 32 != 0) return false;
  const int64_t K = pb.K;
  const int64_t chunks = (K + 31) / 32;
  const int64_t Mpad = (pb.M + 15) / 16 * 16;
  std::vector<uint16_t> xh(static_cast<size_t>(Mpad) * chunks * 32, 0), xl;
  if (!x_is_bf16) xl.assign(xh.size(), 0);
  // x ~= hi + lo with hi = bf16(x), lo = bf16(x - hi); for bf16 x, hi is exact and lo = 0.
  for (int64_t m = 0; m < pb.M; ++m) {
    const float* src = pb.x + m * pb.ldx;
    const int64_t row = (m / 16) * chunks * 512 + (m % 16) * 32;  // + c * 512 + (k % 32)
    for (int64_t k = 0; k < K; k += 16) {
      const int nk = static_cast<int>(std::min<int64_t>(16, K - k));
      const __mmask16 mk = static_cast<__mmask16>((1u << nk) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(mk, src + k);
      const __m256i hi = bf16_rne(v);
      const int64_t o = row + (k / 32) * 512 + (k % 32);
      _mm256_mask_storeu_epi16(xh.data() + o, mk, hi);
      if (!x_is_bf16) {
        const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
        _mm256_mask_storeu_epi16(xl.data() + o, mk, bf16_rne(_mm512_sub_ps(v, hf)));
      }
    }
  }
  run_amx(pb, int8_w, xh.data(), xl.empty() ? nullptr : xl.data(), Mpad);
  return true;
}
#else
bool try_amx(const Problem&, bool, bool) { return false; }
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

template <class W, int MR, int S, bool GROUPED>
void panels_multi(const Problem& pb, const int64_t* ps, int64_t m0) {
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
          for (int off = 0; off < BPS; off += 64) prefetch(reinterpret_cast<const char*>(ws) + FXC_PF_DIST + off);
        } else {
          if (((st * BPS) & 63) == 0) prefetch(reinterpret_cast<const char*>(ws) + FXC_PF_DIST);
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
  for (int s = 0; s < S; ++s) {
    if constexpr (GROUPED)
      epilogue<MR>(pb, ps[s], m0, fin[s]);
    else
      epilogue<MR>(pb, ps[s], m0, acc[s]);
  }
}

// Single-panel kernel for (kind, rows): the direct paths above.
template <int MR>
FXC_INLINE void panel_single(const Problem& pb, int kind, bool grouped, int64_t p, int64_t m0) {
  if (kind == 0)
    panel_direct<WF32, MR>(pb, p, m0);
  else if (kind == 1)
    panel_direct<WBF16, MR>(pb, p, m0);
  else if (grouped) {
    if constexpr (MR <= Vec::MR_GROUP_DIRECT) panel_i8_grouped<MR>(pb, p, m0);
  } else
    panel_direct<WI8, MR>(pb, p, m0);
}

template <class W, int MR, bool GROUPED>
void run_multi_chunk(const Problem& pb, int kind, int64_t t0, int64_t t1) {
  constexpr int S = streams_for(MR, GROUPED);
  const int64_t cnt = t1 - t0;
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
  const bool scratch = kind != Kind::F32 && (mb > 1 || (grouped && pb.M > Vec::MR_GROUP_DIRECT));
  if (pb.M <= kMultiMaxM && !scratch) {
    const int mr = static_cast<int>(pb.M);
    at::parallel_for(0, pb.P, 1, [&](int64_t t0, int64_t t1) {
      dispatch_mr<kMultiMaxM>(mr, [&](auto c) {
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
        dispatch_mr<MRMAX>(mr, [&](auto c) { panel_scratch<decltype(c)::value>(pb, buf.data(), p, m0); });
      } else if (kind == Kind::F32) {
        dispatch_mr<MRMAX>(mr, [&](auto c) { panel_direct<WF32, decltype(c)::value>(pb, p, m0); });
      } else if (kind == Kind::BF16) {
        dispatch_mr<MRMAX>(mr, [&](auto c) { panel_direct<WBF16, decltype(c)::value>(pb, p, m0); });
      } else if (grouped) {
        dispatch_mr<Vec::MR_GROUP_DIRECT>(mr, [&](auto c) { panel_i8_grouped<decltype(c)::value>(pb, p, m0); });
      } else {
        dispatch_mr<MRMAX>(mr, [&](auto c) { panel_direct<WI8, decltype(c)::value>(pb, p, m0); });
      }
    }
  });
}

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
void prepare_common(Prepared& pr, const at::Tensor& x, int64_t Kp, int64_t n, int64_t P,
                    const std::optional<at::Tensor>& bias, const char* op) {
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
  if (x.scalar_type() == at::kFloat && Kp == K) {
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

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(w.device().is_cpu() && x.device().is_cpu(), "fxc::linear: CPU tensors expected");
  TORCH_CHECK(w.is_contiguous(), "fxc::linear: packed weight must be contiguous");
  const int64_t K = x.size(-1);
  Kind kind;
  int64_t Kp;
  if (w.scalar_type() == at::kFloat) {
    TORCH_CHECK(w.dim() == 3 && w.size(1) == K && w.size(2) == NB,
                "fxc::linear: fp32 packed weight must be [P, K, 32] with K=", K, ", got ", w.sizes());
    kind = Kind::F32;
    Kp = K;
  } else if (w.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(w.dim() == 4 && w.size(1) == (K + 1) / 2 && w.size(2) == NB && w.size(3) == 2,
                "fxc::linear: bf16 packed weight must be [P, ceil(K/2), 32, 2] with K=", K, ", got ", w.sizes());
    kind = Kind::BF16;
    Kp = 2 * w.size(1);
  } else {
    TORCH_CHECK(false, "fxc::linear: packed weight must be float32 or bfloat16, got ", w.scalar_type());
  }
  Prepared pr;
  prepare_common(pr, x, Kp, n, w.size(0), bias, "fxc::linear");
  if (pr.pb.M == 0) return pr.out;
  pr.pb.w = w.data_ptr();
  if (kind == Kind::BF16 && try_amx(pr.pb, false, x.scalar_type() == at::kBFloat16)) return pr.out;
  run(pr.pb, kind);
  return pr.out;
}

at::Tensor linear_w8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size) {
  TORCH_CHECK(w.device().is_cpu() && x.device().is_cpu(), "fxc::linear_w8: CPU tensors expected");
  const int64_t K = x.size(-1);
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 3 && w.size(1) == K && w.size(2) == NB && w.is_contiguous(),
              "fxc::linear_w8: packed weight must be contiguous int8 [P, K, 32] with K=", K, ", got ", w.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "fxc::linear_w8: scales must be contiguous float32");
  const int64_t P = w.size(0);
  Prepared pr;
  prepare_common(pr, x, K, n, P, bias, "fxc::linear_w8");
  const bool per_channel = group_size <= 0 || group_size == K;
  if (per_channel) {
    TORCH_CHECK(scales.dim() == 1 && scales.size(0) == P * NB,
                "fxc::linear_w8: per-channel scales must be [P*32], got ", scales.sizes());
    pr.pb.col_scale = scales.data_ptr<float>();
  } else {
    TORCH_CHECK(K % group_size == 0, "fxc::linear_w8: group_size ", group_size, " must divide K=", K);
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == P && scales.size(1) == K / group_size && scales.size(2) == NB,
                "fxc::linear_w8: per-group scales must be [P, K/group_size, 32], got ", scales.sizes());
    pr.pb.grp_scale = scales.data_ptr<float>();
    pr.pb.group = group_size;
    pr.pb.ngroups = K / group_size;
  }
  if (pr.pb.M == 0) return pr.out;
  pr.pb.w = w.data_ptr();
  if (try_amx(pr.pb, true, x.scalar_type() == at::kBFloat16)) return pr.out;
  run(pr.pb, Kind::I8);
  return pr.out;
}

}  // namespace
}  // namespace fxc

TORCH_LIBRARY_IMPL(fxc, CPU, m) {
  m.impl("linear", &fxc::linear);
  m.impl("linear_w8", &fxc::linear_w8);
}

// The ISA this library was compiled for, queried from Python via ctypes.
extern "C" const char* fxc_kernels_isa() { return fxc::kIsa; }

// Whether the AMX path is compiled in and usable on this CPU/OS (1) or not (0).
#ifdef FXC_TUNE
extern "C" void fxc_set_tune(long dist, int hint) {
  fxc::g_pf_dist = dist;
  fxc::g_pf_hint = hint;
}
#endif

extern "C" int fxc_kernels_amx() {
#if defined(FXC_AMX)
  return fxc::amx_usable() ? 1 : 0;
#else
  return 0;
#endif
}
