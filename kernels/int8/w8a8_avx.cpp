// W8A8 for fp32 activations on x86 CPUs without AMX: y[M, N] (fp32) = (Q(x) . W^T) s_x s_w, with
// x quantized to int8 per token inside the call (scale max|x| / 127.5, round half to even: the
// same IEEE division and rounding as quantkit.primitives) and int8 x int8 products summed in int32
// exactly. The Python side is quantkit.kernels.int8.avx (repack at load, the ISA).
//
// Two code paths, each its own weight layout (built at load, never saved):
//   AVX2 (isa 1): vpmaddwd only. x and w are sign-extended to int16 and vpmaddwd sums pairs of
//     int16 products into int32 lanes: exact (|q_x q_w| <= 2^14, a pair fits in int32), no
//     saturation. vpmaddubsw (u8 x s8 -> int16 pairs) would need 7-bit activations to stay clear
//     of int16 saturation (255 * 127 * 2 > 32767) and gives the same number of products per
//     port-0/1 instruction (it needs a vpmaddwd by ones behind it), so it is not used.
//     Weight: int16 [T][K2][16][2], T = ceil(N / 16), K2 = ceil(K / 2): for tile t and k-pair j,
//     channel 16t + i's (w[2j], w[2j+1]), sign-extended at load (two vpmovsxbw per k-pair on every
//     call measured 1.30-1.40x fp32 at 64 rows against 1.39-1.50x); two vectors of 8 channels.
//     x: int16 pairs (one int32 word per k-pair, the first k in the low half), broadcast.
//   AVX-512 VNNI (isa 2): vpdpbusd, u8 x s8 in groups of 4 into int32 (no intermediate
//     saturation). x is shifted to unsigned, u = q + 128, and the shift is taken back per channel
//     at the end: sum u w = sum q w + 128 sum w, comp[n] = 128 sum_k w[n, k] (precomputed).
//     Weight: int8 [T][K4][32][4], T = ceil(N / 32), K4 = ceil(K / 4); 128 bytes per k-quad.
// Channels past N and k past K are zero (their products vanish; q = 0 pads x).
//
// Schedule: x is quantized once per call into blocks of R rows (6 on AVX2, 8 on AVX-512) laid
// out [block][k-word][R], so that a block's broadcasts are one contiguous stream. Per tile of
// channels (parallel over tiles), each block runs an R x tile register-blocked micro-kernel over
// all of K (12 / 16 int32 accumulators; 16 KB of the tile's weight at a time, see QK_TILES), then
// y = float(acc) s_w s_x. With few rows (M <= R) that is the GEMV schedule: one block, the weight
// streams once per call; with many rows a tile's chunk stays in L1 while the blocks stream by.
// The last block has M mod R rows (micro-kernels for 1 .. R rows), so no row is padded.
//
// The AVX2 namespace is compiled with AVX-512 disabled (VEX encodings, ymm registers only, GCC
// builtins rather than intrinsics, whose headers carry -march=native's AVX-512), so forcing it on
// an AVX-512 CPU runs what an AVX2-only CPU runs.

#if !defined(__x86_64__)
#error "the AVX W8A8 CPU kernel is for x86-64 CPUs"
#endif

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "../cpu_isa.h"
#include <immintrin.h>

#include <cfloat>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct Problem {
  const float* x;      // [M, K]
  int32_t* xq;         // quantized x, [block][KW][rows of the block] words
  float* sx;           // [M] per-token scales
  const int8_t* w;     // the ISA's weight layout
  const float* sw;     // [T * TW] per-channel scales
  const int32_t* comp; // [T * TW] 128 sum w (AVX-512 VNNI), else null
  float* y;            // [M, N]
  int64_t M, N, K, KW;  // KW: k-words (pairs on AVX2, quads on AVX-512)
};

const int64_t kIsa = quantkit_isa::level(true);

inline float row_scale(float amax) {
  const float s = amax / 127.5f;
  return s > FLT_MIN ? s : 1.0f;
}

constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: (v + kMagic) - kMagic rounds |v| < 2^22 half to even

// y rows [m0, m0 + rows) x channels [n0, n0 + cols) from c ([rows][ldc]), the columns before N.
inline void store_rows(const Problem& p, const float* c, int64_t ldc, int64_t rows, int64_t m0, int64_t n0,
                       int64_t cols) {
  const int64_t valid = std::min(cols, p.N - n0);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(p.y + (m0 + r) * p.N + n0, c + r * ldc, valid * sizeof(float));
}

// Blocks [b0, b1) of x: each row quantized by quantize_row(p, m, Q*) into tmp (KW words a row),
// then the block transposed into the packed x ([KW][rows of the block] words).
template <int R, int P, typename Q, typename F>
void quantize_blocks(const Problem& p, int64_t b0, int64_t b1, F quantize_row) {
  std::vector<int32_t> tmp(R * p.KW);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t rows = std::min<int64_t>(R, p.M - b * R);
    for (int64_t r = 0; r < rows; ++r) quantize_row(p, b * R + r, reinterpret_cast<Q*>(tmp.data() + r * p.KW));
    int32_t* dst = p.xq + b * R * p.KW;
    for (int64_t j = 0; j < p.KW; ++j)
      for (int64_t r = 0; r < rows; ++r) dst[j * rows + r] = tmp[r * p.KW + j];
  }
}

// Tiles [t0, t1) of y for blocks of rows [b0, b1) (a panel of about 64 rows: its packed x stays
// in L2 while every tile passes), each tile over KC k-words of the weight at a time (a tile's KC
// words stay in L1, 16 KB, while the panel's blocks stream by: the last block of x M mod R rows),
// int32 partial sums kept in `part` between the chunks. Defined in each ISA's namespace, with its
// R, KC and block<RB>.
#define QK_TILES                                                                                 \
  void tiles(const Problem& p, int64_t t0, int64_t t1, int64_t b0, int64_t b1) {                 \
    std::vector<int32_t> part((b1 - b0) * R * TW);                                               \
    for (int64_t t = t0; t < t1; ++t)                                                            \
      for (int64_t j0 = 0; j0 < p.KW; j0 += KC) {                                                \
        const int64_t j1 = std::min<int64_t>(p.KW, j0 + KC);                                     \
        for (int64_t b = b0; b < b1; ++b) {                                                      \
          int32_t* pb = part.data() + (b - b0) * R * TW;                                         \
          switch (std::min<int64_t>(R, p.M - b * R)) {                                           \
            case 1: block<1>(p, t, b, j0, j1, pb); break;                                        \
            case 2: block<2>(p, t, b, j0, j1, pb); break;                                        \
            case 3: block<3>(p, t, b, j0, j1, pb); break;                                        \
            case 4: block<4>(p, t, b, j0, j1, pb); break;                                        \
            case 5: block<5>(p, t, b, j0, j1, pb); break;                                        \
            case 6: block<6>(p, t, b, j0, j1, pb); break;                                        \
            case 7: block<R < 7 ? R : 7>(p, t, b, j0, j1, pb); break;                            \
            default: block<R>(p, t, b, j0, j1, pb); break;                                       \
          }                                                                                      \
        }                                                                                        \
      }                                                                                          \
  }


}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma,no-avx512f")
namespace avx2 {
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef short v16hi __attribute__((vector_size(32)));
typedef short v8hi_m __attribute__((vector_size(16), aligned(2), may_alias));
typedef short v8hi __attribute__((vector_size(16)));
typedef float vf_m __attribute__((vector_size(32), aligned(4), may_alias));
typedef short v16hi_m __attribute__((vector_size(32), aligned(2), may_alias));
typedef int32_t vi_m __attribute__((vector_size(32), aligned(4), may_alias));
constexpr int R = 6, TW = 16, P = 2;
constexpr int64_t KC = 256;  // k-words (pairs) per chunk: 16 x 256 x 2 int16 = 16 KB

#define QK_INLINE inline __attribute__((always_inline))

QK_INLINE vi splat(int32_t v) { return vi{v, v, v, v, v, v, v, v}; }
QK_INLINE vf splatf(float v) { return vf{v, v, v, v, v, v, v, v}; }

// x row -> int16 q (K2 pairs, zero-padded) and its scale.
void quantize_row(const Problem& p, int64_t m, int16_t* q) {
  const float* x = p.x + m * p.K;
  vf vmax[4] = {};  // four chains: one would wait on vmaxps' latency
  int64_t k = 0;
  for (; k + 32 <= p.K; k += 32)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const vf v = (vf)((vi)(*reinterpret_cast<const vf_m*>(x + k + 8 * c)) & splat(0x7FFFFFFF));
      vmax[c] = v > vmax[c] ? v : vmax[c];
    }
  for (; k + 8 <= p.K; k += 8) {
    const vf v = (vf)((vi)(*reinterpret_cast<const vf_m*>(x + k)) & splat(0x7FFFFFFF));
    vmax[0] = v > vmax[0] ? v : vmax[0];
  }
  float amax = 0.f;
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < 8; ++i) amax = vmax[c][i] > amax ? vmax[c][i] : amax;
  for (int64_t kk = k; kk < p.K; ++kk) amax = __builtin_fabsf(x[kk]) > amax ? __builtin_fabsf(x[kk]) : amax;
  const float s = row_scale(amax);
  const vf vs = splatf(s), magic = splatf(kMagic), lo = splatf(-128.f), hi = splatf(127.f);
  for (k = 0; k + 8 <= p.K; k += 8) {
    vf v = (*reinterpret_cast<const vf_m*>(x + k) / vs + magic) - magic;
    v = v < lo ? lo : v;
    v = v > hi ? hi : v;
    *reinterpret_cast<v8hi_m*>(q + k) = __builtin_convertvector(__builtin_convertvector(v, vi), v8hi);
  }
  for (; k < p.K; ++k) {
    float v = (x[k] / s + kMagic) - kMagic;
    v = v < -128.f ? -128.f : (v > 127.f ? 127.f : v);
    q[k] = static_cast<int16_t>(v);
  }
  for (; k < P * p.KW; ++k) q[k] = 0;
  p.sx[m] = s;
}

void quantize(const Problem& p, int64_t b0, int64_t b1) { quantize_blocks<R, P, int16_t>(p, b0, b1, quantize_row); }

// RB rows (block b) x the 16 channels of tile t, k-words [j0, j1): int32 sums from / to part
// ([RB][16]) between chunks, y after the last one.
template <int RB>
void block(const Problem& p, int64_t t, int64_t b, int64_t j0, int64_t j1, int32_t* part) {
  const int16_t* w = reinterpret_cast<const int16_t*>(p.w) + t * p.KW * 32;
  const int32_t* x = p.xq + b * R * p.KW;
  vi acc[RB][2] = {};
  if (j0 > 0)
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r)
      for (int h = 0; h < 2; ++h) acc[r][h] = *reinterpret_cast<const vi_m*>(part + TW * r + 8 * h);
  for (int64_t j = j0; j < j1; ++j) {
    const v16hi w0 = *reinterpret_cast<const v16hi_m*>(w + 32 * j), w1 = *reinterpret_cast<const v16hi_m*>(w + 32 * j + 16);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const v16hi xb = (v16hi)splat(x[j * RB + r]);
      acc[r][0] += (vi)__builtin_ia32_pmaddwd256(w0, xb);
      acc[r][1] += (vi)__builtin_ia32_pmaddwd256(w1, xb);
    }
  }
  if (j1 < p.KW) {
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r)
      for (int h = 0; h < 2; ++h) *reinterpret_cast<vi_m*>(part + TW * r + 8 * h) = acc[r][h];
    return;
  }
  alignas(32) float c[RB][TW];
  const vf s0 = *reinterpret_cast<const vf_m*>(p.sw + TW * t), s1 = *reinterpret_cast<const vf_m*>(p.sw + TW * t + 8);
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    const vf sx = splatf(p.sx[b * R + r]);
    *reinterpret_cast<vf_m*>(c[r]) = __builtin_convertvector(acc[r][0], vf) * s0 * sx;
    *reinterpret_cast<vf_m*>(c[r] + 8) = __builtin_convertvector(acc[r][1], vf) * s1 * sx;
  }
  store_rows(p, c[0], TW, RB, b * R, TW * t, TW);
}

QK_TILES
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace avx512 {
constexpr int R = 8, TW = 32, P = 4;
constexpr int64_t KC = 128;  // k-words (quads) per chunk: 32 x 128 x 4 int8 = 16 KB

// x row -> u8 u = q + 128 (K4 quads, padded with u = 128, q = 0) and its scale.
void quantize_row(const Problem& p, int64_t m, uint8_t* u) {
  const float* x = p.x + m * p.K;
  __m512 amax = _mm512_setzero_ps();
  auto tail = [](int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); };
  for (int64_t k = 0; k < p.K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail(p.K - k), x + k)));
  const float s = row_scale(_mm512_reduce_max_ps(amax));
  const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  const __m512i off = _mm512_set1_epi32(128);
  for (int64_t k = 0; k < p.K; k += 16) {
    const __mmask16 mk = tail(p.K - k);
    __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(mk, x + k), vs);
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    _mm512_mask_cvtepi32_storeu_epi8(u + k, mk, _mm512_add_epi32(_mm512_cvtps_epi32(v), off));
  }
  for (int64_t k = p.K; k < P * p.KW; ++k) u[k] = 128;
  p.sx[m] = s;
}

void quantize(const Problem& p, int64_t b0, int64_t b1) { quantize_blocks<R, P, uint8_t>(p, b0, b1, quantize_row); }

// RB rows (block b) x the 32 channels of tile t, k-words [j0, j1), as avx2::block.
template <int RB>
void block(const Problem& p, int64_t t, int64_t b, int64_t j0, int64_t j1, int32_t* part) {
  const int8_t* w = p.w + t * p.KW * 128;
  const int32_t* x = p.xq + b * R * p.KW;
  __m512i acc[RB][2];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
    for (int h = 0; h < 2; ++h) acc[r][h] = j0 > 0 ? _mm512_loadu_si512(part + TW * r + 16 * h) : _mm512_setzero_si512();
  for (int64_t j = j0; j < j1; ++j) {
    const __m512i w0 = _mm512_loadu_si512(w + 128 * j), w1 = _mm512_loadu_si512(w + 128 * j + 64);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512i xb = _mm512_set1_epi32(x[j * RB + r]);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, w1);
    }
  }
  if (j1 < p.KW) {
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r)
      for (int h = 0; h < 2; ++h) _mm512_storeu_si512(part + TW * r + 16 * h, acc[r][h]);
    return;
  }
  alignas(64) float c[RB][TW];
  const __m512 s0 = _mm512_loadu_ps(p.sw + TW * t), s1 = _mm512_loadu_ps(p.sw + TW * t + 16);
  const __m512i c0 = _mm512_loadu_si512(p.comp + TW * t), c1 = _mm512_loadu_si512(p.comp + TW * t + 16);
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    const __m512 sx = _mm512_set1_ps(p.sx[b * R + r]);
    _mm512_store_ps(c[r], _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][0], c0)), s0), sx));
    _mm512_store_ps(c[r] + 16, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][1], c1)), s1), sx));
  }
  store_rows(p, c[0], TW, RB, b * R, TW * t, TW);
}

QK_TILES
}  // namespace avx512
#pragma GCC pop_options

namespace {

// x [M, K] fp32, w the ISA's layout (int8 [T, KW, TW, P]), sw fp32 [T TW], comp int32 [T TW]
// (AVX-512; empty for AVX2) -> y [M, n] fp32.
torch::Tensor w8a8_gemm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& sw,
                        const torch::Tensor& comp, int64_t n, int64_t isa) {
  TORCH_CHECK(isa == 1 || isa == 2, "isa must be 1 (AVX2) or 2 (AVX-512 VNNI), not ", isa);
  TORCH_CHECK(isa <= kIsa, isa == 2 ? "this CPU (or its OS) has no AVX-512 VNNI" : "this CPU has no AVX2 + FMA");
  const int64_t tw = isa == 2 ? 32 : 16, pk = isa == 2 ? 4 : 2;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == (isa == 2 ? at::kChar : at::kShort) && w.is_contiguous() &&
                  w.size(2) == tw && w.size(3) == pk &&
                  tw * w.size(0) >= n && tw * (w.size(0) - 1) < n,
              "w must be ", isa == 2 ? "int8" : "int16", " [ceil(N/", tw, "), ceil(K/", pk, "), ", tw, ", ", pk, "]");
  TORCH_CHECK(sw.scalar_type() == at::kFloat && sw.is_contiguous() && sw.numel() == tw * w.size(0), "sw must be fp32 [N_pad]");
  TORCH_CHECK(isa == 1 || (comp.scalar_type() == at::kInt && comp.is_contiguous() && comp.numel() == sw.numel()),
              "comp must be int32 [N_pad]");
  const int64_t M = x.size(0), K = x.size(1), KW = w.size(1);
  TORCH_CHECK((K + pk - 1) / pk == KW, "x has ", K, " features, the weight takes ", KW * pk, " (padded)");
  auto y = torch::empty({M, n}, x.options());
  if (M == 0) return y;
  std::vector<int32_t> xq(M * KW);
  std::vector<float> sx(M);
  Problem p{x.data_ptr<float>(), xq.data(), sx.data(), static_cast<const int8_t*>(w.data_ptr()), sw.data_ptr<float>(),
            isa == 2 ? comp.data_ptr<int32_t>() : nullptr, y.data_ptr<float>(), M, n, K, KW};
  const int64_t tiles = w.size(0);
  if (isa == 2) {
    at::parallel_for(0, (M + 7) / 8, 2, [&](int64_t a, int64_t b) { avx512::quantize(p, a, b); });
    for (int64_t b0 = 0; b0 < (M + 7) / 8; b0 += 8) {  // panels of 64 rows
      const int64_t b1 = std::min<int64_t>((M + 7) / 8, b0 + 8);
      at::parallel_for(0, tiles, 1, [&](int64_t a, int64_t b) { avx512::tiles(p, a, b, b0, b1); });
    }
  } else {
    at::parallel_for(0, (M + 5) / 6, 2, [&](int64_t a, int64_t b) { avx2::quantize(p, a, b); });
    for (int64_t b0 = 0; b0 < (M + 5) / 6; b0 += 11) {  // panels of 66 rows
      const int64_t b1 = std::min<int64_t>((M + 5) / 6, b0 + 11);
      at::parallel_for(0, tiles, 1, [&](int64_t a, int64_t b) { avx2::tiles(p, a, b, b0, b1); });
    }
  }
  return y;
}

int64_t isa_level() { return kIsa; }

}  // namespace

TORCH_LIBRARY(quantkit_w8a8_avx, m) {
  m.def("w8a8_gemm(Tensor x, Tensor w, Tensor sw, Tensor comp, int n, int isa) -> Tensor", &w8a8_gemm);
  m.def("isa_level() -> int", &isa_level);  // 0: neither, 1: AVX2 + FMA, 2: AVX-512 (F, BW, VL, DQ) + VNNI too
}
