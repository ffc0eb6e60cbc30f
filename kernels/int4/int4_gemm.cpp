// W4A16 GEMM on x86 CPUs: y[M, N] (bf16) = x[M, K] (bf16) . dequant(W)^T, fp32 accumulation.
// The Python side is quantkit.kernels.int4.cpp (repack at load; the schedule by row count is chosen here).
//
// Weight layout (built at load by cpu_int4.repack, never saved):
//   nibbles int16 [N/4, K]: word (c, k) holds u[4c + i, k] at bits 4i .. 4i+3, u = q + 8 in 0..15
//           (N padded to a multiple of 16 with zero channels);
//   scales  float [N, K/G] s,  zs float [N, K/G] = -(8 + z) * s, so w = (q - z) * s = u * s + zs.
//
// Dequantization is a table look-up: a channel and a group share a 16-entry table
// bf16(u * s + zs) (the fma is exact for bf16 scales, so the weights equal the twin's bit for
// bit), and one vpermw turns 32 nibbles (a shifted 16-bit word each) into 32 bf16 weights; one
// 64-byte load feeds four channels.
//
// Up to 4 rows (AVX512-BF16, no tiles): each channel's 32 looked-up weights (lanes along k) are
//   multiplied with x's 32 bf16 by vdpbf16ps into 16 fp32 lanes per row and channel, 8 channels
//   (2 nibble rows) at a time, 4 KB software prefetch ahead in each nibble stream; the lanes are
//   summed at the end of each 16-channel tile. The weight streams once per call (at M = 1 ~2x
//   faster than the AMX schedule, which wastes 15 of 16 tile rows there).
// AMX (CPUs with AMX-BF16), two schedules above that:
//   5 to 64 rows, 32 at a time: the weight is the A operand (a tile row is one channel); 8 k steps of a pair
//     of weight tiles are looked up into an L1 ring and multiplied at once, C stays in the tiles
//     over all of K, and C = W x^T is transposed on the way out (x repacked into VNNI pairs);
//   more rows: the weight is the B operand, looked up and transposed into VNNI pairs of k once
//     per call, ~0.5 MB of tiles at a time (L2); x is the A operand, its tiles loaded where x
//     lies (rows past M from a zeroed copy); 2 x 2 tiles of C per pair of x tiles and pair of
//     weight tiles, 8 k steps at a time (x's slice stays in L1), fp32 between k blocks, and y
//     written a pair of rows by the block's columns at a time. Measured (benchmarks.md): at
//     about the speed of oneDNN's bf16 GEMM from 96 rows on (0.85-1.1x).
// dequantize (AVX512-BF16): the whole weight in bf16 (the tests' bit-for-bit check).
//
// Everything CPU-specific is compiled with function-level target attributes and chosen on CPUID
// at run time, so this file builds for any x86-64 target; `isa_level` says what the CPU runs.

#if !defined(__x86_64__)
#error "the int4 CPU kernel is for x86-64 CPUs"
#endif

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#define QK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define QK_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")))

namespace {

// ---------------------------------------------------------------- CPU features

struct Features {
  bool avx512bf16 = false;
  bool amx = false;
  std::string note;
};

uint64_t xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

Features detect() {
  Features f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27)) || __get_cpuid_max(0, nullptr) < 7) {
    f.note = "this CPU has no AVX-512";
    return f;
  }
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx512 = (b >> 16 & 1) && (b >> 17 & 1) && (b >> 30 & 1) && (b >> 31 & 1);  // F, DQ, BW, VL
  const bool amx_hw = (d >> 22 & 1) && (d >> 24 & 1);                                        // AMX-BF16, AMX-TILE
  __cpuid_count(7, 1, a, b, c, d);
  const bool bf16 = a >> 5 & 1;
  f.avx512bf16 = avx512 && bf16 && (xcr0() & 0xE6) == 0xE6;  // the OS saves the zmm state
  if (!f.avx512bf16) {
    f.note = avx512 ? "this CPU has AVX-512 but no AVX512-BF16" : "this CPU has no AVX-512";
    return f;
  }
  if (!amx_hw) {
    f.note = "this CPU has AVX512-BF16 but no AMX";
    return f;
  }
  // Linux hands out the AMX tile state only on request: ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA.
  const long rc = syscall(SYS_arch_prctl, 0x1023, 18);
  f.amx = rc == 0 && (xcr0() & (3ull << 17)) == (3ull << 17);
  f.note = f.amx ? "AMX-BF16 and AVX512-BF16" : "the OS refused the AMX tile state (arch_prctl)";
  return f;
}

const Features& features() {
  static const Features f = detect();
  return f;
}

struct Problem {
  const uint16_t* x;       // [M, K] bf16 bits
  const uint16_t* nibbles;  // [N_pad/4, K]
  const float* s;          // [N_pad, groups]
  const float* zs;
  uint16_t* y;  // [M, N] bf16 bits
  int64_t M, N, K, G, groups;
};

// A 64-byte aligned view of v, grown to `elems` (thread-local buffers: no page faults after the first call).
uint16_t* scratch(std::vector<uint16_t>& v, int64_t elems) {
  if (int64_t(v.size()) < elems + 32) v.resize(elems + 32);
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
}

// ---------------------------------------------------------------- shared AVX-512 pieces

// In-register 16 x 16 transpose of 32-bit elements.
QK_AVX512 inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
#pragma GCC unroll 4
  for (int b = 0; b < 4; ++b) {
    t[b] = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x88);
    t[4 + b] = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xdd);
    t[8 + b] = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x88);
    t[12 + b] = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xdd);
  }
#pragma GCC unroll 4
  for (int b = 0; b < 4; ++b) {
    r[b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0x88);
    r[4 + b] = _mm512_shuffle_i32x4(t[4 + b], t[12 + b], 0x88);
    r[8 + b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0xdd);
    r[12 + b] = _mm512_shuffle_i32x4(t[4 + b], t[12 + b], 0xdd);
  }
}

// The look-up table of channel n in group g: words j and 16 + j both hold bf16(j * s + zs), so
// vpermw may ignore bit 4 of its indices.
QK_AVX512 inline __m512i table(const Problem& p, int64_t n, int64_t g) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t i = n * p.groups + g;
  const __m512 w = _mm512_fmadd_ps(iota, _mm512_set1_ps(p.s[i]), _mm512_set1_ps(p.zs[i]));
  return (__m512i)_mm512_cvtne2ps_pbh(w, w);
}

// 32 words of nibbles (k .. k+31 of channels 4c .. 4c+3) -> 32 bf16 weights of each channel.
QK_AVX512 inline void lookup4(const uint16_t* src, const __m512i* tables, __m512i (&w)[4]) {
  const __m512i v = _mm512_loadu_si512(src);
  w[0] = _mm512_permutexvar_epi16(v, tables[0]);
  w[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), tables[1]);
  w[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), tables[2]);
  w[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), tables[3]);
}

// C tiles c0 (channels n0 .. n0+15) and c1 (n0+16 .., or nullptr), fp32 [16 channels][16 rows]
// -> y[m0 + j, n0 ..], one 64-byte row of y per row of x.
QK_AVX512 void store_pair(const Problem& p, const float* c0, const float* c1, int64_t m0, int64_t n0) {
  __m512i a[16], b[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) a[i] = _mm512_load_si512(c0 + 16 * i);
  transpose16(a);
  if (c1 != nullptr) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) b[i] = _mm512_load_si512(c1 + 16 * i);
    transpose16(b);
  } else {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) b[i] = _mm512_setzero_si512();
  }
  const int64_t cols = std::min<int64_t>(c1 != nullptr ? 32 : 16, p.N - n0), rows = std::min<int64_t>(16, p.M - m0);
  const __mmask32 keep = cols >= 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
  for (int64_t j = 0; j < rows; ++j) {
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(_mm512_castsi512_ps(b[j]), _mm512_castsi512_ps(a[j]));
    _mm512_mask_storeu_epi16(p.y + (m0 + j) * p.N + n0, keep, h);
  }
}

// ---------------------------------------------------------------- dequantize

// The whole weight in bf16, [N, K] row-major (channels [n0, n1), n0 and n1 multiples of 4).
QK_AVX512 void dequantize_rows(const Problem& p, int64_t n0, int64_t n1, uint16_t* out) {
  const int64_t steps = p.G / 32;
  for (int64_t n = n0; n < n1; n += 4) {
    const uint16_t* src = p.nibbles + n / 4 * p.K;
    for (int64_t g = 0; g < p.groups; ++g) {
      __m512i tables[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) tables[i] = table(p, n + i, g);
      for (int64_t t = g * steps; t < (g + 1) * steps; ++t) {
        __m512i w[4];
        lookup4(src + 32 * t, tables, w);
        for (int i = 0; i < 4 && n + i < p.N; ++i) _mm512_storeu_si512(out + (n + i) * p.K + 32 * t, w[i]);
      }
    }
  }
}

// ---------------------------------------------------------------- few rows (AVX512-BF16)

// Measured (one thread, weights from memory, smollm2's shapes): up to 4 rows this beats the AMX
// schedule (M = 1: 2.5-3.5x bf16 against ~1.3x; M = 4: 1.6-2.2x), at 8 rows AMX wins. Prefetching
// 4 KB ahead in each nibble stream (into the next tile's rows when K is small) took M = 1 from ~2x to 2.5-3.5x.
constexpr int64_t GEMV_ROWS = 4, GEMV_AHEAD = 4096;

// Lane i of the result holds the sum of v[i]'s 16 lanes.
QK_AVX512 inline __m512 hsum16(const __m512 (&v)[16]) {
  __m512 r[8], s[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(r[2 * i]), b = _mm512_castps_pd(r[2 * i + 1]);
    s[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x88), _mm512_shuffle_f32x4(s[0], s[1], 0xdd));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], 0x88), _mm512_shuffle_f32x4(s[2], s[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xdd));
}

// R rows of x (x, K apart) by the 4 Q channels of nibble rows c0 .. c0+Q-1, all of K: the
// look-up's bf16 weights (32 k of one channel per vector) dot x's bf16 with vdpbf16ps, 16 lanes
// of fp32 partial sums per row and channel -> out[r * 256 + 16 j + lane] (j: channel - 4 c0).
template <int R, int Q>
QK_AVX512 void dot_quads(const Problem& p, const uint16_t* x, int64_t c0, float* out) {
  __m512 acc[R][4 * Q];
#pragma GCC unroll 32
  for (int j = 0; j < R * 4 * Q; ++j) acc[j / (4 * Q)][j % (4 * Q)] = _mm512_setzero_ps();
  const int64_t steps = p.G / 32;
  const uint16_t* src = p.nibbles + c0 * p.K;
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512i tables[4 * Q];
#pragma GCC unroll 16
    for (int j = 0; j < 4 * Q; ++j) tables[j] = table(p, 4 * c0 + j, g);
    for (int64_t t = g * steps; t < (g + 1) * steps; ++t) {
#pragma GCC unroll 4
      for (int q = 0; q < Q; ++q) {
        __m512i w[4];
        _mm_prefetch(reinterpret_cast<const char*>(src + q * p.K + 32 * t) + GEMV_AHEAD, _MM_HINT_T0);
        lookup4(src + q * p.K + 32 * t, tables + 4 * q, w);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * p.K + 32 * t);
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) acc[r][4 * q + i] = _mm512_dpbf16_ps(acc[r][4 * q + i], (__m512bh)w[i], xv);
        }
      }
    }
  }
#pragma GCC unroll 32
  for (int j = 0; j < R * 4 * Q; ++j) _mm512_store_ps(out + (j / (4 * Q)) * 256 + 16 * (j % (4 * Q)), acc[j / (4 * Q)][j % (4 * Q)]);
}

template <int R, int Q>
QK_AVX512 void dot_tile(const Problem& p, const uint16_t* x, int64_t tile, float* out) {
  for (int q = 0; q < 4; q += Q) dot_quads<R, Q>(p, x, 4 * tile + q, out + 64 * q);
}

// Up to GEMV_ROWS rows, weight tiles [tile0, tile1) (16 channels each): the weight streams once
// (per 4 rows; a tile's 8 K bytes of nibbles stay in L1 between them), looked up as for the AMX
// path (same bf16 weights) and multiplied with vdpbf16ps, lanes along k; the 16 lanes of each
// channel are summed at the tile's end.
QK_AVX512 void gemv_rows(const Problem& p, int64_t tile0, int64_t tile1) {
  alignas(64) float part[4 * 256];  // [row][channel][lane]
  for (int64_t tile = tile0; tile < tile1; ++tile) {
    const int64_t n0 = 16 * tile, cols = std::min<int64_t>(16, p.N - n0);
    const __mmask16 keep = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    for (int64_t m0 = 0; m0 < p.M; m0 += 4) {
      const int64_t rows = std::min<int64_t>(4, p.M - m0);
      const uint16_t* x = p.x + m0 * p.K;
      if (rows == 1) dot_tile<1, 2>(p, x, tile, part);
      else if (rows == 2) dot_tile<2, 2>(p, x, tile, part);
      else if (rows == 3) dot_tile<3, 1>(p, x, tile, part);
      else dot_tile<4, 1>(p, x, tile, part);
      for (int64_t r = 0; r < rows; ++r) {
        __m512 v[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) v[j] = _mm512_load_ps(part + 256 * r + 16 * j);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(hsum16(v));
        _mm256_mask_storeu_epi16(p.y + (m0 + r) * p.N + n0, keep, h);
      }
    }
  }
}

// ---------------------------------------------------------------- AMX

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

QK_AMX void tile_config() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

// k steps [t0, t1) of weight tile `tile` (channels 16 tile .. +15) -> dst [t1 - t0][16][32] bf16.
QK_AMX void dequant_tile(const Problem& p, int64_t tile, int64_t t0, int64_t t1, uint16_t* dst) {
  const int64_t steps = p.G / 32;
  const uint16_t* src = p.nibbles + 4 * tile * p.K;
  for (int64_t t = t0; t < t1;) {
    const int64_t g = t / steps, end = std::min(t1, (g + 1) * steps);
    __m512i tables[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) tables[i] = table(p, 16 * tile + i, g);
    for (; t < end; ++t) {
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        __m512i w[4];
        lookup4(src + q * p.K + 32 * t, tables + 4 * q, w);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) _mm512_store_si512(dst + (t - t0) * 512 + (4 * q + i) * 32, w[i]);
      }
    }
  }
}

// Rows m0 .. m0+15 of x (zero past M) -> dst [K/32][16 k pairs][16 rows][2] bf16: AMX's B operand.
QK_AMX void repack_x(const Problem& p, int64_t m0, uint16_t* dst) {
  const int64_t rows = std::min<int64_t>(16, p.M - m0);
  const __mmask16 all = 0xFFFF;
  for (int64_t t = 0; t < p.K / 32; ++t) {
    __m512i r[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      r[i] = _mm512_maskz_loadu_epi32(i < rows ? all : 0, p.x + (m0 + std::min<int64_t>(i, rows - 1)) * p.K + 32 * t);
    transpose16(r);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) _mm512_store_si512(dst + t * 512 + 32 * i, r[i]);
  }
}

// C tiles 0..3 hold c[j][i] = tile a_j x tile b_i (c + (2 j + i) * 256 in memory); tiles 4, 5
// take a_0, a_1 and 6, 7 take b_0, b_1, one k step (512 bf16) after another. NT: a tiles (1 or 2),
// MT: b tiles. Small M: a = weight, b = x; more rows (`rows_tiles`): a = x, b = weight.
template <int NT, int MT>
QK_AMX inline void tiles_zero() {
  _tile_zero(0);
  if constexpr (MT == 2) _tile_zero(1);
  if constexpr (NT == 2) _tile_zero(2);
  if constexpr (NT == 2 && MT == 2) _tile_zero(3);
}

template <int NT, int MT>
QK_AMX inline void tiles_steps(const uint16_t* a0, const uint16_t* a1, const uint16_t* b0, const uint16_t* b1,
                               int64_t steps) {
  for (int64_t t = 0; t < steps; ++t) {
    _tile_loadd(4, a0 + t * 512, 64);
    _tile_loadd(6, b0 + t * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (MT == 2) {
      _tile_loadd(7, b1 + t * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (NT == 2) {
      _tile_loadd(5, a1 + t * 512, 64);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (MT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

template <int NT, int MT>
QK_AMX inline void tiles_store(float* c) {
  _tile_stored(0, c, 64);
  if constexpr (MT == 2) _tile_stored(1, c + 256, 64);
  if constexpr (NT == 2) _tile_stored(2, c + 512, 64);
  if constexpr (NT == 2 && MT == 2) _tile_stored(3, c + 768, 64);
}

// Ask for the lines of y that store_block(.., nt, mt, m0, n0) writes, for writing (they are
// often far away in L3; the tile products in between hide the wait).
QK_AMX void prefetch_block(const Problem& p, int nt, int mt, int64_t m0, int64_t n0) {
  const int64_t rows = std::min<int64_t>(16 * mt, p.M - m0), bytes = 2 * std::min<int64_t>(16 * nt, p.N - n0);
  for (int64_t j = 0; j < rows; ++j) {
    const char* row = reinterpret_cast<const char*>(p.y + (m0 + j) * p.N + n0);
    _mm_prefetch(row, _MM_HINT_ET0);
    if ((reinterpret_cast<uintptr_t>(row) & 63) + bytes > 64) _mm_prefetch(row + bytes - 1, _MM_HINT_ET0);
  }
}

// The nt x mt block of C (as tiles_store wrote it) -> y.
QK_AMX void store_block(const Problem& p, const float* c, int nt, int mt, int64_t m0, int64_t n0) {
  for (int i = 0; i < mt; ++i) store_pair(p, c + 256 * i, nt == 2 ? c + 512 + 256 * i : nullptr, m0 + 16 * i, n0);
}

// Up to 32 rows of x (xv: MT repacked tiles): for each pair of weight tiles, dequantize CHUNK
// k steps at a time into an L1-sized ring and multiply them right away; C stays in the tiles.
template <int MT>
QK_AMX void amx_few_rows(const Problem& p, const uint16_t* xv, int64_t tile0, int64_t tile1) {
  constexpr int64_t CHUNK = 8;
  tile_config();
  const int64_t steps = p.K / 32;
  alignas(64) uint16_t ring[2 * CHUNK * 512];
  alignas(64) float c[4 * 256];
  const uint16_t* b1 = xv + steps * 512;
  for (int64_t j = tile0; j < tile1; j += 2) {
    const bool two = j + 1 < tile1;
    prefetch_block(p, two ? 2 : 1, MT, 0, 16 * j);
    if (two) tiles_zero<2, MT>();
    else tiles_zero<1, MT>();
    for (int64_t t = 0; t < steps; t += CHUNK) {
      const int64_t n = std::min(CHUNK, steps - t);
      dequant_tile(p, j, t, t + n, ring);
      if (two) {
        dequant_tile(p, j + 1, t, t + n, ring + CHUNK * 512);
        tiles_steps<2, MT>(ring, ring + CHUNK * 512, xv + t * 512, b1 + t * 512, n);
      } else {
        tiles_steps<1, MT>(ring, nullptr, xv + t * 512, b1 + t * 512, n);
      }
    }
    if (two) tiles_store<2, MT>(c);
    else tiles_store<1, MT>(c);
    store_block(p, c, two ? 2 : 1, MT, 0, 16 * j);
  }
  _tile_release();
}

// Weight tile `tile`, all of K -> dst [K/32][16 k pairs][16 channels][2] bf16: AMX's B operand
// (the look-up's rows, one per channel, transposed as pairs of k).
QK_AMX void dequant_tile_vnni(const Problem& p, int64_t tile, uint16_t* dst) {
  const int64_t steps = p.G / 32;
  const uint16_t* src = p.nibbles + 4 * tile * p.K;
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512i tables[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) tables[i] = table(p, 16 * tile + i, g);
    for (int64_t t = g * steps; t < (g + 1) * steps; ++t) {
      __m512i w[16];
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        __m512i v[4];
        lookup4(src + q * p.K + 32 * t, tables + 4 * q, v);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) w[4 * q + i] = v[i];
      }
      transpose16(w);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) _mm512_store_si512(dst + t * 512 + 32 * i, w[i]);
    }
  }
}

// C tiles 0..3 hold c[i][j] = x tile a_i x weight tile b_j (c + (2 i + j) * 256 in memory). The
// x tiles (tiles 4, 5) are read where x lies, lda elements between rows; the weight tiles (6, 7)
// are VNNI, 512 bf16 per k step. C starts at zero when `first`, else from c, and goes back to c.
template <int MT, int NT>
QK_AMX void rows_tiles(const uint16_t* a, int64_t lda, const uint16_t* b0, const uint16_t* b1, int64_t steps,
                       float* c, bool first) {
  if (first) {
    tiles_zero<MT, NT>();
  } else {
    _tile_loadd(0, c, 64);
    if constexpr (NT == 2) _tile_loadd(1, c + 256, 64);
    if constexpr (MT == 2) _tile_loadd(2, c + 512, 64);
    if constexpr (MT == 2 && NT == 2) _tile_loadd(3, c + 768, 64);
  }
  const uint16_t* a1 = a + 16 * lda;
  const int64_t stride = 2 * lda;
  for (int64_t t = 0; t < steps; ++t) {
    _tile_loadd(4, a + 32 * t, stride);
    _tile_loadd(6, b0 + 512 * t, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) {
      _tile_loadd(7, b1 + 512 * t, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MT == 2) {
      _tile_loadd(5, a1 + 32 * t, stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (NT == 2) _tile_stored(1, c + 256, 64);
  if constexpr (MT == 2) _tile_stored(2, c + 512, 64);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, c + 768, 64);
}

QK_AMX void rows_tiles_any(int mt, int nt, const uint16_t* a, int64_t lda, const uint16_t* b0, const uint16_t* b1,
                           int64_t steps, float* c, bool first) {
  if (mt == 2 && nt == 2) rows_tiles<2, 2>(a, lda, b0, b1, steps, c, first);
  else if (mt == 2) rows_tiles<2, 1>(a, lda, b0, b1, steps, c, first);
  else if (nt == 2) rows_tiles<1, 2>(a, lda, b0, b1, steps, c, first);
  else rows_tiles<1, 1>(a, lda, b0, b1, steps, c, first);
}

// C (as rows_tiles wrote it: mt tiles of rows by nt tiles of channels) -> y[m0 .., n0 ..].
QK_AMX void store_rows(const Problem& p, const float* c, int mt, int nt, int64_t m0, int64_t n0) {
  const int64_t cols = std::min<int64_t>(16 * nt, p.N - n0);
  const __mmask32 keep = cols >= 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
  for (int i = 0; i < mt; ++i) {
    const int64_t rows = std::min<int64_t>(16, p.M - m0 - 16 * i);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 lo = _mm512_load_ps(c + 512 * i + 16 * r);
      const __m512 hi = nt == 2 ? _mm512_load_ps(c + 512 * i + 256 + 16 * r) : _mm512_setzero_ps();
      _mm512_mask_storeu_epi16(p.y + (m0 + 16 * i + r) * p.N + n0, keep, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// A block of C that tiles_stored wrote, stored into y one tile product later: vector loads
// right behind the tile stores of the same lines stall the core.
struct Pending {
  const float* c = nullptr;
  int mt = 0, nt = 0;
  int64_t m0 = 0, n0 = 0;
  QK_AMX void flush(const Problem& p) {
    if (c != nullptr) store_rows(p, c, mt, nt, m0, n0);
    c = nullptr;
  }
};

// Many rows: a block of weight tiles (~0.5 MB, stays in L2) is looked up into VNNI bf16 tiles
// once per call; then for each pair of 16-row x tiles (read where x lies) and each block of up
// to KMAX k steps (whose x slice stays in L1), every pair of the block's weight tiles is
// multiplied in, C kept in fp32 between k blocks. Each pair of rows writes the block's columns
// of y contiguously, converted one tile product after its tile store.
QK_AMX void amx_many_rows(const Problem& p, int64_t tile0, int64_t tile1) {
  constexpr int64_t WBYTES = 1 << 19, KMAX = 8;  // measured: 0.5 MB of weight tiles, 8 k steps (16 KB of x tiles)
  tile_config();
  const int64_t steps = p.K / 32, tile_elems = p.K * 16;
  const int64_t wblock = std::max<int64_t>(2, WBYTES / (2 * tile_elems) / 2 * 2);
  const int64_t kblocks = (steps + KMAX - 1) / KMAX, kstep = (steps + kblocks - 1) / kblocks;
  static thread_local std::vector<uint16_t> ws, xs;
  static thread_local std::vector<float> cs;
  uint16_t* wbuf = scratch(ws, std::min(wblock, tile1 - tile0) * tile_elems);
  uint16_t* tail = scratch(xs, 32 * p.K);
  if (int64_t(cs.size()) < (wblock / 2 + 1) * 1024 + 16) cs.resize((wblock / 2 + 1) * 1024 + 16);
  float* cbuf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(cs.data()) + 63) & ~uintptr_t(63));
  Pending pending;
  for (int64_t wb = tile0; wb < tile1; wb += wblock) {
    const int64_t ncount = std::min(wblock, tile1 - wb);
    for (int64_t j = 0; j < ncount; ++j) dequant_tile_vnni(p, wb + j, wbuf + j * tile_elems);
    for (int64_t m0 = 0; m0 < p.M; m0 += 32) {
      const int64_t rows = std::min<int64_t>(32, p.M - m0);
      const int mt = rows > 16 ? 2 : 1;
      const uint16_t* a = p.x + m0 * p.K;
      if (rows != 16 * mt) {  // a partial tile: copy the rows, zero past M
        std::memcpy(tail, a, rows * p.K * 2);
        std::memset(tail + rows * p.K, 0, (32 - rows) * p.K * 2);
        a = tail;
      }
      for (int64_t t = 0; t < steps; t += kstep) {
        const int64_t n = std::min(kstep, steps - t);
        const bool first = t == 0, last = t + n == steps;
        for (int64_t j = 0; j < ncount; j += 2) {
          const int nt = j + 1 < ncount ? 2 : 1;
          float* c = cbuf + j / 2 * 1024;
          if (pending.c == c) pending.flush(p);
          const uint16_t* b0 = wbuf + j * tile_elems + t * 512;
          rows_tiles_any(mt, nt, a + 32 * t, p.K, b0, b0 + tile_elems, n, c, first);
          pending.flush(p);
          if (last) pending = {c, mt, nt, m0, (wb + j) * 16};
        }
      }
    }
    pending.flush(p);
  }
  _tile_release();
}

QK_AMX void repack_x_all(const Problem& p, uint16_t* dst) {
  for (int64_t m0 = 0; m0 < p.M; m0 += 16) repack_x(p, m0, dst + m0 * p.K);
}

// ---------------------------------------------------------------- entry points

torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& nibbles, const torch::Tensor& scales,
                   const torch::Tensor& zs, int64_t n, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be contiguous bf16 [M, K]");
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.scalar_type() == at::kShort && nibbles.is_contiguous() &&
                  nibbles.size(0) % 4 == 0 && 4 * nibbles.size(0) >= n,
              "nibbles must be int16 [N_pad/4, K] with N_pad % 16 == 0");
  const int64_t k = nibbles.size(1), n_pad = 4 * nibbles.size(0);
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " features, the weight takes ", k);
  TORCH_CHECK(k % 32 == 0 && group_size % 32 == 0 && k % group_size == 0, "unsupported K / group size");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && zs.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  zs.is_contiguous() && scales.numel() == n_pad * (k / group_size) && zs.numel() == scales.numel(),
              "scales and zs must be float [N_pad, K/G]");
  const Features& f = features();
  TORCH_CHECK(f.amx, "int4 GEMM: ", f.note);
  auto y = torch::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  const Problem p{reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(nibbles.data_ptr<int16_t>()),
                  scales.data_ptr<float>(),
                  zs.data_ptr<float>(),
                  reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
                  x.size(0),
                  n,
                  k,
                  group_size,
                  k / group_size};
  const int64_t tiles = n_pad / 16;
  if (p.M <= GEMV_ROWS) {
    at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) { gemv_rows(p, t0, t1); });
  } else if (p.M <= 64) {  // 32 rows at a time (measured: faster than the blocked schedule up to 64 rows)
    std::vector<uint16_t> xs;
    uint16_t* xv = scratch(xs, (p.M + 31) / 32 * 32 * k);
    repack_x_all(p, xv);
    at::parallel_for(0, tiles, 2, [&](int64_t t0, int64_t t1) {
      for (int64_t m0 = 0; m0 < p.M; m0 += 32) {
        Problem rows = p;
        rows.x += m0 * k, rows.y += m0 * n, rows.M = std::min<int64_t>(32, p.M - m0);
        if (rows.M <= 16) amx_few_rows<1>(rows, xv + m0 * k, t0, t1);
        else amx_few_rows<2>(rows, xv + m0 * k, t0, t1);
      }
    });
  } else {
    const int64_t grain = std::max<int64_t>(2, (1 << 19) / (32 * k) / 2 * 2);
    at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) { amx_many_rows(p, t0, t1); });
  }
  return y;
}

torch::Tensor dequantize(const torch::Tensor& nibbles, const torch::Tensor& scales, const torch::Tensor& zs, int64_t n,
                         int64_t group_size) {
  const Features& f = features();
  TORCH_CHECK(f.avx512bf16, "int4 dequantize: ", f.note);
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.scalar_type() == at::kShort && nibbles.is_contiguous() &&
                  4 * nibbles.size(0) >= n && scales.is_contiguous() && zs.is_contiguous(),
              "nibbles must be int16 [N_pad/4, K]");
  const int64_t k = nibbles.size(1);
  TORCH_CHECK(k % 32 == 0 && group_size % 32 == 0 && k % group_size == 0, "unsupported K / group size");
  auto w = torch::empty({n, k}, nibbles.options().dtype(at::kBFloat16));
  const Problem p{nullptr, reinterpret_cast<const uint16_t*>(nibbles.data_ptr<int16_t>()), scales.data_ptr<float>(),
                  zs.data_ptr<float>(), nullptr, 0, n, k, group_size, k / group_size};
  uint16_t* out = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  at::parallel_for(0, (n + 3) / 4, 16, [&](int64_t q0, int64_t q1) { dequantize_rows(p, 4 * q0, 4 * q1, out); });
  return w;
}

int64_t isa_level() {
  const Features& f = features();
  return f.amx ? 2 : f.avx512bf16 ? 1 : 0;
}

std::string isa_note() { return features().note; }

}  // namespace

TORCH_LIBRARY(quantkit_int4, m) {
  m.def("gemm(Tensor x, Tensor nibbles, Tensor scales, Tensor zs, int n, int group_size) -> Tensor", &gemm);
  m.def("dequantize(Tensor nibbles, Tensor scales, Tensor zs, int n, int group_size) -> Tensor", &dequantize);
  m.def("isa_level() -> int", &isa_level);  // 0: neither, 1: AVX512-BF16, 2: AMX-BF16 too
  m.def("isa_note() -> str", &isa_note);
}
