// W4A16 and W8A16 GEMMs for fp32 activations on x86 CPUs with AVX2+FMA or AVX-512:
// y[M, N] (fp32) = x[M, K] (fp32) . dequant(W)^T, fp32 accumulation, the weight dequantized in
// registers (or, for many rows, one L1-sized block at a time), never as a whole.
// The Python side is quantkit.kernels.cpu_int4_avx (repack at load, the ISA and crossover).
//
// int4 weight layout (built at load, never saved): int32 [T = N_pad/16][groups][G/8 + 2][16].
//   Rows 0 .. G/8-1 of (t, g): word (kb, i) holds the 8 nibbles u = q + 8 of channel 16t + i for
//   k = gG + 8kb .. +7, the first in bits 0..3 (the on-disk words, transposed);
//   row G/8: s (fp32 bits) of channels 16t .. 16t+15, row G/8+1: zs = -(8 + z) s, so
//   w = (q - z) s = u s + zs. N_pad is N rounded up to 16 (zero channels). One tile of 16
//   channels is one contiguous stream of words and scales.
// int8 weight layout: int8 [T][K][16] (q of channel 16t + i at k), scales fp32 [N_pad]; w = q s.
//
// Schedules (lanes along output channels, 16 channels a tile; the caller passes the crossover):
//   few rows (M <= few_rows, in chunks of RMAX = 4 on AVX2, 8 on AVX-512): per word row, nibble j
//     is taken in place (v & 15 << 4j, exact as fp32: u 2^4j; the top one v >> 28) and converted,
//     and every row's x[k] 2^-4j (pre-scaled per call, exact) is fma'd into a per-group
//     accumulator; at the group's end y += s acc + zs sum(x over the group). The weight streams
//     once per call (a tile stays in L1 between its chunks of rows), software-prefetched 4 KB ahead.
//   more rows: per block of 128 rows, x is packed once ([K][R] per R rows: one contiguous stream
//     for the broadcasts); per panel of PANEL channels (16 on AVX2, 32 on AVX-512), KC = 256 k of
//     the weight at a time are dequantized into an L1 buffer [KC][PANEL] fp32 and multiplied by an
//     R x PANEL register-blocked fp32 micro-kernel (6 x 16 on AVX2, 8 x 32 on AVX-512) into the
//     panel's contiguous y block [128][PANEL], then copied into y.
//   Measured alternative, not taken: the dequantized blocks multiplied by at::mm (slower at every M).
//
// ISAs: the kernel body (the #else branch at the end) is compiled twice, into namespace avx2
// (target avx2,fma,no-avx512f: VEX encodings and ymm registers only, plain vector extensions, no
// intrinsics, whose headers carry -march=native's AVX-512) and avx512 (zmm), and the caller passes
// which to run (`isa`: 1 AVX2, 2 AVX-512); isa_level() says what the CPU and OS allow.

#ifndef QK_AVX_BODY

#if !defined(__x86_64__)
#error "the AVX int4 CPU kernel is for x86-64 CPUs"
#endif

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "../cpu_isa.h"
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct Problem {
  const float* x;      // [M, K]
  const float* xs;     // [M, K]: x[m, k] 2^-4(k % 8) (k % 8 < 7), x[m, k] (k % 8 == 7); few rows, int4
  const float* sums;   // [M, groups]: sum of x over each group; few rows, int4
  const int32_t* w4;   // int4 layout
  const int8_t* w8;    // int8 layout
  const float* s8;     // int8 scales [N_pad]
  float* y;            // [M, N]
  int64_t M, N, K, G, groups;
  int64_t gstride, tstride;  // int32 words per (tile, group) and per tile (int4)
};

const int64_t kIsa = quantkit_isa::level();

}  // namespace

#define QK_AVX_BODY

#pragma GCC push_options
#pragma GCC target("avx2,fma,no-avx512f")
namespace avx2 {
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef float vf_m __attribute__((vector_size(32), aligned(4), may_alias));  // unaligned memory
typedef uint32_t vu_m __attribute__((vector_size(32), aligned(4), may_alias));
constexpr int W = 8;      // fp32 lanes per vector
constexpr int RMAX = 4;   // few rows at a time (2 x RMAX accumulators of 16 ymm)
// int4 accumulator chains at one row (decode): 2 x 2 ymm, not the 4 x 2 of chains<1>(), which
// spill the nibble masks (Zen 4, forced AVX2, 576 -> 3072 in cache: 2.13x -> 2.48x fp32, docs/benchmarks.md)
constexpr int ONE_ROW_CHAINS4 = 2;
constexpr int R_MM = 6;   // micro-kernel rows: 6 x 2 ymm accumulators
inline vf splat(float s) { return vf{s, s, s, s, s, s, s, s}; }
// 16 int8 -> 2 vectors of int32 (vpmovsxbd through the builtin: the intrinsics' header carries
// -march=native's AVX-512, which this namespace has switched off).
inline void load_i8x16(const int8_t* p, vi (&out)[2]) {
  typedef char v16qi __attribute__((vector_size(16), aligned(1), may_alias));
  typedef char v16qa __attribute__((vector_size(16)));
  const v16qa b = *reinterpret_cast<const v16qi*>(p);
  out[0] = (vi)__builtin_ia32_pmovsxbd256(b);
  out[1] = (vi)__builtin_ia32_pmovsxbd256(__builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
}
#include "int4_avx.cpp"  // this file again: the #else branch below
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")
namespace avx512 {
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef float vf_m __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint32_t vu_m __attribute__((vector_size(64), aligned(4), may_alias));
constexpr int W = 16;
constexpr int RMAX = 8;   // 8 accumulators and 8 y vectors of 32 zmm
constexpr int ONE_ROW_CHAINS4 = 8;  // as chains<1>() (4 measured the same)
#ifndef QK_R512
#define QK_R512 8
#endif
constexpr int R_MM = QK_R512;   // micro-kernel rows: 8 x 2 zmm accumulators
inline vf splat(float s) { return vf{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
inline void load_i8x16(const int8_t* p, vi (&out)[1]) {
  out[0] = (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#include "int4_avx.cpp"  // this file again: the #else branch below
}  // namespace avx512
#pragma GCC pop_options

namespace {

using Runner = void (*)(const Problem&, int64_t, int64_t);
struct Kernels {
  Runner few, many;
  void (*prescale)(const Problem&, float*, float*);
};

void check_isa(int64_t isa) {
  TORCH_CHECK(isa == 1 || isa == 2, "isa must be 1 (AVX2) or 2 (AVX-512), not ", isa);
  TORCH_CHECK(isa <= kIsa, isa == 2 ? "this CPU (or its OS) has no AVX-512" : "this CPU has no AVX2 + FMA");
}

// Up to few_rows rows: registers, tiles of 16 channels (grain 4); more: L1 blocks, panels of 16
// (AVX2) or 32 (AVX-512) channels.
void run(const Problem& p, int64_t isa, int64_t few_rows, const Kernels& kern) {
  const int64_t tiles = (p.N + 15) / 16;
  if (p.M <= few_rows) {
    at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) { kern.few(p, t0, t1); });
  } else {
    const int64_t per = isa == 2 ? 2 : 1, panels = (tiles + per - 1) / per;
    at::parallel_for(0, panels, 1, [&](int64_t a, int64_t b) { kern.many(p, a * per, std::min(tiles, b * per)); });
  }
}

torch::Tensor int4_gemm(const torch::Tensor& x, const torch::Tensor& w, int64_t n, int64_t group_size, int64_t isa,
                        int64_t few_rows) {
  check_isa(isa);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kInt && w.is_contiguous() && w.size(3) == 16 &&
                  w.size(2) == group_size / 8 + 2 && 16 * w.size(0) >= n && 16 * (w.size(0) - 1) < n,
              "w must be int32 [ceil(N/16), K/G, G/8 + 2, 16]");
  const int64_t k = x.size(1), groups = w.size(1);
  TORCH_CHECK(group_size % 8 == 0 && groups * group_size == k, "x has ", k, " features, the weight takes ",
              groups * group_size);
  auto y = torch::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  Problem p{x.data_ptr<float>(), nullptr, nullptr, w.data_ptr<int32_t>(), nullptr, nullptr, y.data_ptr<float>(),
            x.size(0), n, k, group_size, groups, (group_size / 8 + 2) * 16, groups * (group_size / 8 + 2) * 16};
  static const Kernels k2{avx2::few_rows4, avx2::many_rows4, avx2::prescale};
  static const Kernels k512{avx512::few_rows4, avx512::many_rows4, avx512::prescale};
  const Kernels& kern = isa == 2 ? k512 : k2;
  std::vector<float> xs, sums;
  if (p.M <= few_rows) {
    xs.resize(p.M * k), sums.resize(p.M * groups);
    kern.prescale(p, xs.data(), sums.data());
    p.xs = xs.data(), p.sums = sums.data();
  }
  run(p, isa, few_rows, kern);
  return y;
}

torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales, int64_t n,
                        int64_t isa, int64_t few_rows) {
  check_isa(isa);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(2) == 16 &&
                  16 * q.size(0) >= n && 16 * (q.size(0) - 1) < n,
              "q must be int8 [ceil(N/16), K, 16]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == 16 * q.size(0),
              "scales must be fp32 [N_pad]");
  const int64_t k = x.size(1);
  TORCH_CHECK(q.size(1) == k, "x has ", k, " features, the weight takes ", q.size(1));
  auto y = torch::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  Problem p{x.data_ptr<float>(), nullptr, nullptr, nullptr, q.data_ptr<int8_t>(), scales.data_ptr<float>(),
            y.data_ptr<float>(), x.size(0), n, k, k, 1, 0, 0};
  static const Kernels k2{avx2::few_rows8, avx2::many_rows8, nullptr};
  static const Kernels k512{avx512::few_rows8, avx512::many_rows8, nullptr};
  run(p, isa, few_rows, isa == 2 ? k512 : k2);
  return y;
}

int64_t isa_level() { return kIsa; }

}  // namespace

TORCH_LIBRARY(quantkit_int4_avx, m) {
  m.def("int4_gemm(Tensor x, Tensor w, int n, int group_size, int isa, int few_rows) -> Tensor", &int4_gemm);
  m.def("int8_gemm(Tensor x, Tensor q, Tensor scales, int n, int isa, int few_rows) -> Tensor", &int8_gemm);
  m.def("isa_level() -> int", &isa_level);  // 0: neither, 1: AVX2 + FMA, 2: AVX-512 (F, BW, VL, DQ) too
}

#else  // QK_AVX_BODY: the kernels, written once for the vector type vf of W fp32 lanes (included twice above)

constexpr int V = 16 / W;           // vectors per tile of 16 channels
constexpr int PANEL = 2 * W;        // channels per micro-kernel panel (two vectors)
#ifndef QK_KC  // -D overrides for tuning builds
#define QK_KC 256
#define QK_MB 128
#define QK_AHEAD 4096
#endif
constexpr int64_t KC = QK_KC;         // k per dequantized block: KC x PANEL fp32 (16 / 32 KB), in L1
constexpr int64_t MB = QK_MB;         // rows per y block [MB][PANEL] (16 / 32 KB)
constexpr int64_t AHEAD = QK_AHEAD;   // software prefetch distance in the weight stream, bytes

#define QK_INLINE inline __attribute__((always_inline))

// std::min is compiled for -march=native, so this namespace would call it rather than inline it.
QK_INLINE int64_t lesser(int64_t a, int64_t b) { return a < b ? a : b; }

// Plain vector-extension code (no intrinsics: their headers carry -march=native's ISA, which
// the avx2 namespace has switched off).
QK_INLINE vf loadf(const float* p) { return *reinterpret_cast<const vf_m*>(p); }
QK_INLINE vu loadu(const int32_t* p) { return *reinterpret_cast<const vu_m*>(p); }
QK_INLINE void storef(float* p, vf v) { *reinterpret_cast<vf_m*>(p) = v; }

// rows of y (fp32 [rows][cols] at c, ldc apart) -> y[m0 .., n0 ..] (the columns before N).
QK_INLINE void store_rows(const Problem& p, const float* c, int64_t ldc, int64_t rows, int64_t m0, int64_t n0,
                          int64_t cols) {
  const int64_t valid = lesser(cols, p.N - n0);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(p.y + (m0 + r) * p.N + n0, c + r * ldc, valid * sizeof(float));
}

// ---------------------------------------------------------------- few rows

// Independent accumulator chains per (row, vector) for R rows, so that at least 8 fma chains
// are in flight (at one row a single chain was bound by the fma latency: 4 weights a cycle).
template <int R>
constexpr int chains() {
  return R * V >= 8 ? 1 : 8 / (R * V);
}

// x -> xs = x 2^-4(k % 8) ([M, K]) and sums over groups ([M, groups]) for few4.
void prescale(const Problem& p, float* xs, float* sums) {
  static constexpr float f[8] = {1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.f};
  for (int64_t m = 0; m < p.M; ++m) {
    const float* x = p.x + m * p.K;
    for (int64_t k = 0; k < p.K; ++k) xs[m * p.K + k] = x[k] * f[k & 7];
    for (int64_t g = 0; g < p.groups; ++g) {
      float s = 0.f;
      for (int64_t k = g * p.G; k < (g + 1) * p.G; ++k) s += x[k];
      sums[m * p.groups + g] = s;
    }
  }
}

// R rows (m0 ..) of y for int4 tile t: the weight's 16 channels in V vectors, every row's x
// broadcast against them, per-group accumulators (nibble j into chain j % A) folded into y with
// the group's s and zs.
template <int R>
void few4(const Problem& p, int64_t t, int64_t m0) {
  constexpr int A = R == 1 ? ONE_ROW_CHAINS4 : chains<R>();
  const int32_t* src = p.w4 + t * p.tstride;
  const float* xs = p.xs + m0 * p.K;
  const float* sums = p.sums + m0 * p.groups;
  const int64_t rows8 = p.G / 8;
  vf out[R][V] = {};
  for (int64_t g = 0; g < p.groups; ++g, src += p.gstride) {
    vf acc[A][R][V] = {};
    const float* xg = xs + g * p.G;
    for (int64_t kb = 0; kb < rows8; ++kb) {
      __builtin_prefetch(reinterpret_cast<const char*>(src + 16 * kb) + AHEAD);
      vu v[V];
#pragma GCC unroll 4
      for (int h = 0; h < V; ++h) v[h] = loadu(src + 16 * kb + W * h);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        vf xb[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) xb[r] = splat(xg[r * p.K + 8 * kb + j]);
#pragma GCC unroll 4
        for (int h = 0; h < V; ++h) {
          const vi b = j == 7 ? (vi)(v[h] >> 28) : (vi)(v[h] & (15u << (4 * j)));
          const vf wv = __builtin_convertvector(b, vf);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[j % A][r][h] += wv * xb[r];
        }
      }
    }
#pragma GCC unroll 8
    for (int a = 1; a < A; ++a)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int h = 0; h < V; ++h) acc[0][r][h] += acc[a][r][h];
    const float* sc = reinterpret_cast<const float*>(src + 16 * rows8);
#pragma GCC unroll 4
    for (int h = 0; h < V; ++h) {
      const vf s = loadf(sc + W * h), zs = loadf(sc + 16 + W * h);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) out[r][h] += s * acc[0][r][h] + zs * splat(sums[r * p.groups + g]);
    }
  }
  alignas(64) float c[R][16];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int h = 0; h < V; ++h) storef(c[r] + W * h, out[r][h]);
  store_rows(p, c[0], 16, R, m0, 16 * t, 16);
}

// One k of int8 tile `src` for R rows of x into acc.
template <int R>
QK_INLINE void step8(const Problem& p, const int8_t* src, const float* x, int64_t k, vf (&acc)[R][V]) {
  if ((k & 3) == 0) __builtin_prefetch(src + 16 * k + AHEAD);
  vi qv[V];
  load_i8x16(src + 16 * k, qv);
#pragma GCC unroll 4
  for (int h = 0; h < V; ++h) {
    const vf wv = __builtin_convertvector(qv[h], vf);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][h] += wv * splat(x[r * p.K + k]);
  }
}

// R rows of y for int8 tile t (k into chain k % A; per-channel scales applied on the way out).
template <int R>
void few8(const Problem& p, int64_t t, int64_t m0) {
  constexpr int A = chains<R>();
  const int8_t* src = p.w8 + t * p.K * 16;
  const float* x = p.x + m0 * p.K;
  vf acc[A][R][V] = {};
  int64_t k = 0;
  for (; k + A <= p.K; k += A)
#pragma GCC unroll 8
    for (int a = 0; a < A; ++a) step8<R>(p, src, x, k + a, acc[a]);
  for (; k < p.K; ++k) step8<R>(p, src, x, k, acc[0]);
  alignas(64) float c[R][16];
#pragma GCC unroll 4
  for (int h = 0; h < V; ++h) {
    const vf s = loadf(p.s8 + 16 * t + W * h);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      vf sum = acc[0][r][h];
#pragma GCC unroll 8
      for (int a = 1; a < A; ++a) sum += acc[a][r][h];
      storef(c[r] + W * h, sum * s);
    }
  }
  store_rows(p, c[0], 16, R, m0, 16 * t, 16);
}

template <void (*F1)(const Problem&, int64_t, int64_t), void (*F2)(const Problem&, int64_t, int64_t),
          void (*F3)(const Problem&, int64_t, int64_t), void (*F4)(const Problem&, int64_t, int64_t),
          void (*F5)(const Problem&, int64_t, int64_t), void (*F6)(const Problem&, int64_t, int64_t),
          void (*F7)(const Problem&, int64_t, int64_t), void (*F8)(const Problem&, int64_t, int64_t)>
void few_tiles(const Problem& p, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t m0 = 0; m0 < p.M; m0 += RMAX) {
      switch (lesser(RMAX, p.M - m0)) {
        case 1: F1(p, t, m0); break;
        case 2: F2(p, t, m0); break;
        case 3: F3(p, t, m0); break;
        case 4: F4(p, t, m0); break;
        case 5: F5(p, t, m0); break;
        case 6: F6(p, t, m0); break;
        case 7: F7(p, t, m0); break;
        default: F8(p, t, m0); break;
      }
    }
  }
}

void few_rows4(const Problem& p, int64_t t0, int64_t t1) {
  few_tiles<few4<1>, few4<2>, few4<3>, few4<4>, few4<std::min(5, RMAX)>, few4<std::min(6, RMAX)>,
            few4<std::min(7, RMAX)>, few4<std::min(8, RMAX)>>(p, t0, t1);
}

void few_rows8(const Problem& p, int64_t t0, int64_t t1) {
  few_tiles<few8<1>, few8<2>, few8<3>, few8<4>, few8<std::min(5, RMAX)>, few8<std::min(6, RMAX)>,
            few8<std::min(7, RMAX)>, few8<std::min(8, RMAX)>>(p, t0, t1);
}

// ---------------------------------------------------------------- many rows

// k in [k0, k1) of int4 tiles t .. t+P-1 -> buf [k1 - k0][ldb] fp32 (16 P channels at the start of
// each row). k0, k1 multiples of 8. Per group segment and nibble j: w = cvt(v & 15 << 4j) (s 2^-4j) + zs.
void dequant4(const Problem& p, int64_t t, int64_t P, int64_t k0, int64_t k1, float* buf, int64_t ldb) {
  static constexpr float f[8] = {1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.f};
  const int64_t rows8 = p.G / 8;
  for (int64_t q = 0; q < P; ++q) {
    const int32_t* tile = p.w4 + (t + q) * p.tstride;
    for (int64_t kb = k0 / 8; kb < k1 / 8;) {
      const int64_t g = kb / rows8, end = lesser(k1 / 8, (g + 1) * rows8);
      const int32_t* src = tile + g * (p.gstride - 16 * rows8);  // word row kb of group g at src + 16 kb
      const float* sc = reinterpret_cast<const float*>(tile + g * p.gstride + 16 * rows8);
#pragma GCC unroll 4
      for (int h = 0; h < V; ++h) {
        const vf s = loadf(sc + W * h), zs = loadf(sc + 16 + W * h);
        float* dst = buf + 16 * q + W * h;
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const vf sj = s * f[j];
          for (int64_t r = kb; r < end; ++r) {
            const vu v = loadu(src + 16 * r + W * h);
            const vi b = j == 7 ? (vi)(v >> 28) : (vi)(v & (15u << (4 * j)));
            storef(dst + (8 * r + j - k0) * ldb, __builtin_convertvector(b, vf) * sj + zs);
          }
        }
      }
      kb = end;
    }
  }
}

// k in [k0, k1) of int8 tiles t .. t+P-1 -> buf [k1 - k0][ldb] fp32, w = q s.
void dequant8(const Problem& p, int64_t t, int64_t P, int64_t k0, int64_t k1, float* buf, int64_t ldb) {
  for (int64_t q = 0; q < P; ++q) {
    const int8_t* src = p.w8 + (t + q) * p.K * 16;
    vf s[V];
#pragma GCC unroll 4
    for (int h = 0; h < V; ++h) s[h] = loadf(p.s8 + 16 * (t + q) + W * h);
    for (int64_t k = k0; k < k1; ++k) {
      vi qv[V];
      load_i8x16(src + 16 * k, qv);
#pragma GCC unroll 4
      for (int h = 0; h < V; ++h)
        storef(buf + (k - k0) * ldb + 16 * q + W * h, __builtin_convertvector(qv[h], vf) * s[h]);
    }
  }
}

// c[R rows, ldc apart][PANEL] (+)= x . b: x packed [kc][R_MM] (R of its rows used), b [kc][PANEL];
// R x 2 vector accumulators, x broadcast.
template <int R>
void micro(const float* x, const float* b, int64_t kc, float* c, int64_t ldc, bool first) {
  vf acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) acc[r][h] = first ? vf{} : loadf(c + r * ldc + W * h);
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const vf b0 = loadf(b + k * PANEL), b1 = loadf(b + k * PANEL + W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vf xb = splat(x[k * R_MM + r]);
      acc[r][0] += b0 * xb;
      acc[r][1] += b1 * xb;
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) storef(c + r * ldc + W * h, acc[r][h]);
}

// micro<r> for r = 1 .. R.
template <int R>
QK_INLINE void micro_any(int64_t r, const float* x, const float* b, int64_t kc, float* c, bool first) {
  if constexpr (R > 1) {
    if (r < R) return micro_any<R - 1>(r, x, b, kc, c, first);
  }
  micro<R>(x, b, kc, c, PANEL, first);
}

// rows of packed x (blocks of R_MM rows, [K][R_MM] each; k from k0) times b [kc][PANEL] into c [rows][PANEL].
void micro_rows(int64_t rows, const float* xp, int64_t K, int64_t k0, const float* b, int64_t kc, float* c,
                bool first) {
  for (int64_t r = 0; r < rows; r += R_MM) {
    const float* xr = xp + r * K + k0 * R_MM;
    float* cr = c + r * PANEL;
    micro_any<R_MM>(lesser(R_MM, rows - r), xr, b, kc, cr, first);
  }
}

// x[m0 .. m0+rows, :] -> xp, blocks of R_MM rows, each [K][R_MM] (rows past the end 0).
void pack_x(const Problem& p, int64_t m0, int64_t rows, float* xp) {
  for (int64_t r0 = 0; r0 < rows; r0 += R_MM) {
    float* dst = xp + r0 * p.K;
    for (int r = 0; r < R_MM; ++r) {
      const float* src = p.x + (m0 + r0 + r) * p.K;
      if (r0 + r < rows) {
        for (int64_t k = 0; k < p.K; ++k) dst[k * R_MM + r] = src[k];
      } else {
        for (int64_t k = 0; k < p.K; ++k) dst[k * R_MM + r] = 0.f;
      }
    }
  }
}

// Tiles [t0, t1), all rows: per block of MBR rows, x is packed once (contiguous streams for the
// broadcasts, L2); per panel of PANEL channels, KC k of the weight at a time are dequantized into
// L1 and multiplied into the panel's y block [MBR][PANEL] (contiguous: y's rows, N apart, would
// fall into a few cache sets), which is then written to y.
template <void (*Dequant)(const Problem&, int64_t, int64_t, int64_t, int64_t, float*, int64_t)>
void many_rows(const Problem& p, int64_t t0, int64_t t1) {
  constexpr int per = PANEL / 16;  // tiles per panel
  constexpr int64_t MBR = MB / R_MM * R_MM;
  const int64_t total = KC * PANEL + MBR * PANEL + MBR * p.K + 16;
  static thread_local std::vector<float> bufs;
  if (bufs.size() < size_t(total)) bufs.resize(total);
  float* buf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(bufs.data()) + 63) & ~uintptr_t(63));
  float* c = buf + KC * PANEL;
  float* xp = c + MBR * PANEL;
  const int64_t kblocks = (p.K + KC - 1) / KC, kstep = ((p.K + kblocks - 1) / kblocks + 7) / 8 * 8;  // even blocks
  for (int64_t m0 = 0; m0 < p.M; m0 += MBR) {
    const int64_t rows = lesser(MBR, p.M - m0);
    pack_x(p, m0, rows, xp);
    for (int64_t t = t0; t < t1; t += per) {
      const int64_t P = lesser(per, t1 - t);
      if (P < per) std::memset(buf, 0, KC * PANEL * sizeof(float));  // the missing tile's lanes stay 0
      for (int64_t k0 = 0; k0 < p.K; k0 += kstep) {
        const int64_t kc = lesser(kstep, p.K - k0);
        Dequant(p, t, P, k0, k0 + kc, buf, PANEL);
        micro_rows(rows, xp, p.K, k0, buf, kc, c, k0 == 0);
      }
      store_rows(p, c, PANEL, rows, m0, 16 * t, 16 * P);
    }
  }
}

void many_rows4(const Problem& p, int64_t t0, int64_t t1) { many_rows<dequant4>(p, t0, t1); }
void many_rows8(const Problem& p, int64_t t0, int64_t t1) { many_rows<dequant8>(p, t0, t1); }

#undef QK_INLINE

#endif  // QK_AVX_BODY
