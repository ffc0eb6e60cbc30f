// Paged attention on the CPU, reading K/V blocks where they lie (no gather): decode, one
// query per sequence, and prefill, the new tokens of each sequence over its cached ones.
// Same semantics as quantkit.kernels.reference.paged_attention / paged_prefill; built and
// loaded by kernels/cpu_ext.py, called from kernels/attention/cpu.py.
//
// `attend` (prefill, and decode where neither decode kernel below applies): a work item is (sequence,
// KV head, tile of queries). Its rows are the (query, head) pairs that share that KV head, so K/V
// are read once for all of them: a tile of up to W tokens at a time, dequantised to fp32 into a
// scratch buffer, then folded into every row with an online softmax (running max m, sum l,
// accumulator acc), all in fp32. Work items are handed out to torch's threads (at::parallel_for)
// longest first, from a shared counter.
//
// `decode_f32_item` (decode with fp32 q, any cache, head_dim 64 or 128): a work item is a sequence
// with all its KV heads, its blocks read once into L2 with plain loads, then every score, one
// softmax per head and P · V in fp32 (the comment above it says more).
//
// `decode_item` (decode with bf16 q on a CPU with AVX512-BF16; bf16, fp8 or int8 cache; head_dim
// 64 or 128; group <= 16): a work item is a sequence with all its KV heads. Its blocks are first
// read once with plain loads, K and V a block after the other (`stream_in`): the core's prefetcher
// streams that at ~10 GB/s here, where software prefetches or loads spread through the compute
// made it slower, not faster (measured 2026-12: memory and compute do not overlap on one thread,
// so the step costs ~48 ms of reading plus the compute). Then two passes from L2: every score of
// the context (with AMX: S = K · Qᵀ per 16-token tile, K loaded in place as the A operand; else
// vdpbf16ps per row), one softmax per head over all of them (no running max, no rescaling), and
// P · V with the accumulators in registers, fp32. On smollm2's decode step (bf16, one thread) this
// took the kernel from ~40 to ~20 ms with K/V in L2 and from ~85 to ~75 ms from memory.
//
// `prefill_item` (prefill with bf16 q on a CPU with AMX-BF16 that the OS grants it, QUANTKIT_NO_AMX
// not 1; bf16, fp8 or int8 cache; head_dim 64 or 128; any group, window, softcap): a work item is
// (sequence, KV head, up to 256 queries), per tile of 16 queries and head, keys in chunks of 128,
// transposed so that lanes are queries: Sᵀ = K · Qᵀ in AMX tiles (K in place from a bf16 cache whose
// block size is a multiple of 16), a column-wise online softmax in fp32 with a polynomial 2^x, P
// rounded to bf16 for Oᵀ = Vᵀ · Pᵀ in AMX tiles (Vᵀ packed once per item); the products are exact,
// the sums fp32. Against fp64 its error is close to that of rounding the exact result to bf16.
// It replaced SDPA for the prefill of bf16 models: ~550 GFLOP/s on one core here (2026-12).
//
// Vectors are W fp32 lanes in GCC vector extensions: W = 16 (one register) where the compiler
// targets AVX-512 (-march=native), else 8 (one AVX2 register). Loads of bf16/fp16/fp8/int8
// use AVX-512 or AVX2/F16C intrinsics where there are such, plain loops elsewhere; with
// AVX512-BF16 and bf16 queries the q · k dot products run in vdpbf16ps (AMX tiles for decode
// and prefill where the CPU has AMX-BF16, the OS grants the tile state and QUANTKIT_NO_AMX is not 1).
// head_dim 64 and 128 get unrolled loops, other multiples of 16 a generic one.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QK_AVX512 1
#if defined(__AVX512BF16__)
#define QK_BF16DP 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define QK_AMX 1
#endif
#endif
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#ifdef QK_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#ifdef QK_AVX512
constexpr int W = 16;  // lanes of a vector, tokens of a K/V tile
#else
constexpr int W = 8;  // one AVX2 register; GCC would split 16 lanes through the stack
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

#define INLINE inline __attribute__((always_inline))

INLINE vf ld(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
INLINE void st(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
INLINE vf splat(float x) { return vf{} + x; }

INLINE float hsum(vf v) {
#ifdef QK_AVX512
  return _mm512_reduce_add_ps(v);
#else
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  return v[0] + v[1];
#endif
}

INLINE float hmax(vf v) {
#ifdef QK_AVX512
  return _mm512_reduce_max_ps(v);
#else
  vf u = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v = v > u ? v : u;
  u = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v = v > u ? v : u;
  return std::max(v[0], v[1]);
#endif
}

// e^x, x <= 88: 2^n · e^r with n = round(x / ln 2), |r| <= ln 2 / 2, Cephes' expf polynomial
// (about 1 ulp); 0 below -87 (and for -inf), NaN for NaN.
INLINE vf vexp(vf x) {
  vi tiny = x < splat(-87.f);
  x = tiny ? splat(-87.f) : x;
  vf n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest
  vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf y = p * (vf)e;
  return tiny ? splat(0.f) : y;
}

INLINE vf vtanh(vf x) {  // 1 - 2 / (e^2x + 1)
  vf x2 = x + x;
  vf e = vexp(x2 < splat(88.f) ? x2 : splat(88.f));
  return 1.f - 2.f / (e + 1.f);
}

// W cache values -> fp32 (dequantisation scales are applied by the caller)
template <typename C>
INLINE vf loadw(const C* p) {
  vf v;
  for (int i = 0; i < W; i++) v[i] = static_cast<float>(p[i]);
  return v;
}
template <>
INLINE vf loadw(const float* p) {
  return ld(p);
}
#ifdef QK_AVX512
template <>
INLINE vf loadw(const c10::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <>
INLINE vf loadw(const c10::Half* p) {
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <>
INLINE vf loadw(const int8_t* p) {
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
template <>
INLINE vf loadw(const c10::Float8_e4m3fn* p) {
  // e4m3 bits s.eeee.mmm become the fp16 s.0eeee.mmm0000000, which is the value / 2^8
  // (subnormals included); 0x7f / 0xff is NaN
  __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i mag = _mm256_and_si256(x, _mm256_set1_epi16(0x7f));
  __m256i sign = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8);
  __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(_mm256_slli_epi16(mag, 7), sign)), _mm512_set1_ps(256.f));
  __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
  return (vf)_mm512_mask_blend_ps(nan, f, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}
#elif defined(__AVX2__)
template <>
INLINE vf loadw(const c10::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <>
INLINE vf loadw(const int8_t* p) {
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#ifdef __F16C__
template <>
INLINE vf loadw(const c10::Half* p) {
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <>
INLINE vf loadw(const c10::Float8_e4m3fn* p) {  // as the AVX-512 one
  __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m128i mag = _mm_and_si128(x, _mm_set1_epi16(0x7f));
  __m128i sign = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8);
  __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(_mm_slli_epi16(mag, 7), sign)), _mm256_set1_ps(256.f));
  __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f))));
  return (vf)_mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan);
}
#endif
#endif

// a row of q or out, [D] in its dtype <-> fp32
void load_row(const void* p, at::ScalarType t, float* dst, int64_t n, float mul) {
  switch (t) {
    case at::kFloat:
      for (int64_t i = 0; i < n; i++) dst[i] = static_cast<const float*>(p)[i] * mul;
      break;
    case at::kBFloat16:
      for (int64_t i = 0; i < n; i++) dst[i] = static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]) * mul;
      break;
    default:
      for (int64_t i = 0; i < n; i++) dst[i] = static_cast<float>(static_cast<const c10::Half*>(p)[i]) * mul;
  }
}

void store_row(void* p, at::ScalarType t, const float* src, int64_t n, float mul) {
  switch (t) {
    case at::kFloat:
      for (int64_t i = 0; i < n; i++) static_cast<float*>(p)[i] = src[i] * mul;
      break;
    case at::kBFloat16:
      for (int64_t i = 0; i < n; i++) static_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(src[i] * mul);
      break;
    default:
      for (int64_t i = 0; i < n; i++) static_cast<c10::Half*>(p)[i] = c10::Half(src[i] * mul);
  }
}

struct Problem {
  const char* q;  // [tokens, heads, D], strides in bytes
  int64_t q_s0, q_s1;
  at::ScalarType q_type;
  char* out;  // [tokens, heads, D], contiguous, q's dtype
  const char* k;  // [num_blocks, block_size, kv_heads, D], strides in elements
  const char* v;
  int64_t k_s[3], v_s[3];
  const int32_t* tables;  // [num_seqs, max_blocks]
  int64_t tables_s0, tables_s1, max_blocks, num_blocks, block_size;
  int64_t heads, kv_heads, group, D;
  const float* k_scale;  // [1] or [kv_heads], or null
  const float* v_scale;
  bool k_per_head, v_per_head;
  float scale, softcap;  // softcap 0: none
  int64_t window;  // 0: none
};

struct Item {  // sequence seq, KV head kh; queries q0.. q0 + nq - 1 of q, at positions pos0.. pos0 + nq - 1
  int64_t seq, kh, q0, nq, pos0, cost;
};

struct Scratch {
  std::vector<float> q, acc, m, l, k, v;  // l: each row's running sum, lane by lane
  Scratch(int64_t rows, int64_t D) : q(rows * D), acc(rows * D), m(rows), l(rows * W), k(W * D), v(W * D) {}
};

// the K or V rows of KV head kh in a block, into the cache ahead of their use
template <typename C>
INLINE void prefetch_rows(const char* base, const int64_t* s, int64_t block, int64_t n, int64_t kh, int64_t D) {
  const char* x = reinterpret_cast<const char*>(reinterpret_cast<const C*>(base) + block * s[0] + kh * s[2]);
  for (int64_t t = 0; t < n; t++, x += s[1] * sizeof(C))
    for (int64_t i = 0; i < D * int64_t(sizeof(C)); i += 64) __builtin_prefetch(x + i);
}

// NC: head_dim / W when fixed at compile time (loops unrolled, q and acc in registers), 0 for any

// n rows of a tile (tokens of one block and KV head, row stride `stride`) -> dst [W, D] fp32, rows n.. zero
template <typename C, int NC>
INLINE void load_tile(const C* x, int64_t stride, int64_t n, int64_t D, float* dst) {
  const int64_t d_end = NC ? NC * W : D;
  for (int64_t t = 0; t < n; t++, x += stride, dst += d_end)
    for (int64_t d = 0; d < d_end; d += W) st(dst + d, loadw(x + d));
  std::fill(dst, dst + (W - n) * d_end, 0.f);
}

// [s_0 .. s_W-1] with s_t the sum of a[t]'s lanes: a shuffle-and-add tree (30 shuffles for 16 sums)
INLINE vf reduce_w(const vf* a) {
#ifdef QK_AVX512
  vf b[8], c[4], d[2];
  for (int i = 0; i < 8; i++)  // lanes 0-7: a[2i]'s partial sums, 8-15: a[2i+1]'s
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; i++)  // four lanes per a[4i + j]
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; i++)  // two lanes per a[8i + j]
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  vf b[4], c[2];
  for (int i = 0; i < 4; i++)  // lanes 0-3: a[2i]'s partial sums, 4-7: a[2i+1]'s
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; i++)  // two lanes per a[4i + j]
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

template <int NC>
INLINE vf scores(const float* qr, const float* sk, int64_t D) {  // [q · k_t for the W rows of sk]
  vf a[W];
  if constexpr (NC > 0) {
    vf qv[NC];
    for (int c = 0; c < NC; c++) qv[c] = ld(qr + c * W);
    for (int t = 0; t < W; t++) {
      a[t] = qv[0] * ld(sk + t * NC * W);
      for (int c = 1; c < NC; c++) a[t] += qv[c] * ld(sk + t * NC * W + c * W);
    }
  } else {
    for (int t = 0; t < W; t++) {
      a[t] = vf{};
      for (int64_t d = 0; d < D; d += W) a[t] += ld(qr + d) * ld(sk + t * D + d);
    }
  }
  return reduce_w(a);
}

#ifdef QK_BF16DP
// bf16 q (D = NC * 16 values) against n bf16 K rows in place, pairs of products summed in fp32 (vdpbf16ps)
template <int NC>
INLINE vf scores_bf16(const c10::BFloat16* qr, const c10::BFloat16* k, int64_t stride, int64_t n) {
  static_assert(NC % 2 == 0, "bf16 dot products take 32 values at a time");
  vf a[W];
  __m512bh qv[NC / 2];
  for (int c = 0; c < NC / 2; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qr + c * 2 * W);
  for (int t = 0; t < W; t++) {
    __m512 x = _mm512_setzero_ps();
    if (t < n)
      for (int c = 0; c < NC / 2; c++) x = _mm512_dpbf16_ps(x, qv[c], (__m512bh)_mm512_loadu_si512(k + t * stride + c * 2 * W));
    a[t] = (vf)x;
  }
  return reduce_w(a);
}
#endif

#ifdef QK_BF16DP
// n rows of fp8 / int8 K -> dst [n, NC * 16] bf16, exactly (at most 4 / 8 significant bits)
template <typename C, int NC>
INLINE const c10::BFloat16* load_tile_bf16(const C* x, int64_t stride, int64_t n, c10::BFloat16* dst) {
  for (int64_t t = 0; t < n; t++, x += stride)
    for (int c = 0; c < NC; c++)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t * NC * W + c * W),
                          (__m256i)_mm512_cvtneps_pbh(loadw(x + c * W)));
  return dst;
}
#else
template <typename C, int NC>
INLINE const c10::BFloat16* load_tile_bf16(const C*, int64_t, int64_t, c10::BFloat16*) { return nullptr; }
#endif

// acc = acc · alpha + Σ_t p_t v_t over tile rows a..e-1 of sv
template <int NC>
INLINE void add_pv(float* acc, float alpha, vf p, const float* sv, int64_t a, int64_t e, int64_t D) {
  if constexpr (NC > 0) {
    vf o[NC];
    for (int c = 0; c < NC; c++) o[c] = ld(acc + c * W) * alpha;
    for (int64_t t = a; t < e; t++) {
      const float pt = p[t];
      for (int c = 0; c < NC; c++) o[c] += pt * ld(sv + t * NC * W + c * W);
    }
    for (int c = 0; c < NC; c++) st(acc + c * W, o[c]);
  } else {
    for (int64_t d = 0; d < D; d += W) {
      vf o = ld(acc + d) * alpha;
      for (int64_t t = a; t < e; t++) o += p[t] * ld(sv + t * D + d);
      st(acc + d, o);
    }
  }
}

// one row: fold the scores s of tile rows a..e-1 into its running max m, sums l and acc
template <int NC>
INLINE void fold(const Problem& P, vf s, const float* sv, int64_t a, int64_t e, float& m, float* l, float* acc) {
#ifdef QK_AVX512
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7};
#endif
  if (P.softcap > 0.f) s = P.softcap * vtanh(s * (1.f / P.softcap));
  s = (lane >= int32_t(a)) & (lane < int32_t(e)) ? s : splat(NEG_INF);
  const float top = hmax(s);
  if (top == NEG_INF) return;  // every score -inf
  float alpha = 1.f;
  if (top > m) {
    alpha = std::exp(m - top);  // 0 while m is -inf
    m = top;
    st(l, ld(l) * alpha);
  }
  const vf p = vexp(s - m);
  st(l, ld(l) + p);
  add_pv<NC>(acc, alpha, p, sv, a, e, P.D);
}

// DP (a CPU with AVX512-BF16, bf16 q): q · k in vdpbf16ps, from a bf16 cache in place or from
// fp8 / int8 K converted exactly to bf16
template <typename C, int NC, bool DP>
void attend(const Problem& P, const Item& it, Scratch& s) {
  const int64_t D = P.D, g = P.group, rows = it.nq * g, bs = P.block_size;
  // row r = j * g + h: query it.q0 + j, head it.kh * g + h, position it.pos0 + j
  const float qmul = P.scale * (P.k_scale ? P.k_scale[P.k_per_head ? it.kh : 0] : 1.f);
  for (int64_t r = 0; r < rows; r++) {
    const char* src = P.q + (it.q0 + r / g) * P.q_s0 + (it.kh * g + r % g) * P.q_s1;
    if constexpr (DP)
      std::memcpy(reinterpret_cast<c10::BFloat16*>(s.q.data()) + r * D, src, D * sizeof(c10::BFloat16));
    else
      load_row(src, P.q_type, s.q.data() + r * D, D, qmul);
  }
  std::fill(s.m.begin(), s.m.begin() + rows, NEG_INF);
  std::fill(s.l.begin(), s.l.begin() + rows * W, 0.f);
  std::fill(s.acc.begin(), s.acc.begin() + rows * D, 0.f);
  const int64_t lo = P.window ? std::max<int64_t>(0, it.pos0 - P.window + 1) : 0, hi = it.pos0 + it.nq;
  const int32_t* table = P.tables + it.seq * P.tables_s0;
  const C *kc = reinterpret_cast<const C*>(P.k) + it.kh * P.k_s[2], *vc = reinterpret_cast<const C*>(P.v) + it.kh * P.v_s[2];
  for (int64_t p0 = lo; p0 < hi;) {
    const int64_t b = p0 / bs, p1 = std::min({hi, (b + 1) * bs, p0 + W}), n = p1 - p0;
    const int64_t block = table[b * P.tables_s1];
    TORCH_CHECK(0 <= block && block < P.num_blocks, "paged attention: sequence ", it.seq, " names block ", block,
                " of a cache with ", P.num_blocks, " blocks.");
    if (p0 == lo || p0 == b * bs) {  // a new block: fetch the next one while this one is used
      const int64_t next = (b + 1) * bs < hi ? table[(b + 1) * P.tables_s1] : -1, ahead = std::min(bs, hi - (b + 1) * bs);
      if (0 <= next && next < P.num_blocks) {
        prefetch_rows<C>(P.k, P.k_s, next, ahead, it.kh, D);
        prefetch_rows<C>(P.v, P.v_s, next, ahead, it.kh, D);
      }
    }
    const C* kt = kc + block * P.k_s[0] + (p0 - b * bs) * P.k_s[1];
    const c10::BFloat16* kb = nullptr;  // DP: the K rows in bf16, in place or converted (exactly) into s.k
    int64_t kb_stride = D;
    if constexpr (!DP) {
      load_tile<C, NC>(kt, P.k_s[1], n, D, s.k.data());
    } else if constexpr (std::is_same_v<C, c10::BFloat16>) {
      kb = kt, kb_stride = P.k_s[1];
    } else {
      kb = load_tile_bf16<C, NC>(kt, P.k_s[1], n, reinterpret_cast<c10::BFloat16*>(s.k.data()));
    }
    load_tile<C, NC>(vc + block * P.v_s[0] + (p0 - b * bs) * P.v_s[1], P.v_s[1], n, D, s.v.data());
    for (int64_t r = 0; r < rows; r++) {
      const int64_t pos = it.pos0 + r / g;
      const int64_t a = (P.window ? std::max(p0, pos - P.window + 1) : p0) - p0, e = std::min(p1, pos + 1) - p0;
      if (a >= e) continue;
      vf sc;
#ifdef QK_BF16DP
      if constexpr (DP)
        sc = scores_bf16<NC>(reinterpret_cast<const c10::BFloat16*>(s.q.data()) + r * D, kb, kb_stride, n) * qmul;
      else
#endif
        sc = scores<NC>(s.q.data() + r * D, s.k.data(), D);
      fold<NC>(P, sc, s.v.data(), a, e, s.m[r], s.l.data() + r * W, s.acc.data() + r * D);
    }
    p0 = p1;
  }
  const float vmul = P.v_scale ? P.v_scale[P.v_per_head ? it.kh : 0] : 1.f;
  const int64_t esize = c10::elementSize(P.q_type);
  for (int64_t r = 0; r < rows; r++) {
    char* dst = P.out + ((it.q0 + r / g) * P.heads + it.kh * g + r % g) * D * esize;
    const float l = hsum(ld(s.l.data() + r * W));
    store_row(dst, P.q_type, s.acc.data() + r * D, D, l > 0.f ? vmul / l : 0.f);
  }
}

// Read a sequence's K and V blocks once with plain loads, before it is computed on: one block's
// K and V after the other, each in address order, is what the core's prefetcher streams fastest
// (~10 GB/s here; see the header). A sequence's blocks (<= ~0.5 MB for smollm2) then sit in L2.
template <typename C>
void stream_in(const Problem& P, const Item& it, const int32_t* table, int64_t b_lo, int64_t b_hi, int64_t hi) {
  const int64_t row = ((P.kv_heads - 1) * P.k_s[2] + P.D) * int64_t(sizeof(C));  // bytes of a token, all heads
  char any = 0;
  for (int64_t b = b_lo; b < b_hi; b++) {
    const int64_t block = table[b * P.tables_s1], n = std::min(P.block_size, hi - b * P.block_size);
    TORCH_CHECK(0 <= block && block < P.num_blocks, "paged attention: sequence ", it.seq, " names block ", block,
                " of a cache with ", P.num_blocks, " blocks.");
    const char* k = P.k + block * P.k_s[0] * int64_t(sizeof(C));
    const char* v = P.v + block * P.v_s[0] * int64_t(sizeof(C));
    if (P.k_s[1] * int64_t(sizeof(C)) == row && P.v_s[1] == P.k_s[1] && P.v_s[2] == P.k_s[2]) {  // rows back to back
      for (int64_t i = 0; i < n * row; i += 64) any |= k[i] | v[i];  // a load per cache line
    }
  }
  volatile char sink = any;  // keeps the loads
  (void)sink;
}

#ifdef QK_BF16DP
// ---------------------------------------------------------------- decode
// One query per sequence (the header says when); a work item is a sequence with all its KV heads,
// read block by block (a block's K rows of all heads lie together). Two passes: every score first,
// into s.sc [kv_heads][span][gp] (gp: the group padded to a power of two, so that lane i of a
// vector is row i % gp), then per head one softmax over all of them and one P·V pass with the
// accumulators in registers. No running max, no rescaling per tile.

struct DecodeScratch {
  std::vector<float> sc;  // [kv_heads][span][gp]: scores, then exp(score - max)
  std::vector<c10::BFloat16> qb, kb;  // q rows [heads][D] (AMX: Qᵀ [kv_heads][D / 2][gp][2]); fp8 / int8 K tile [W][D]
  DecodeScratch(int64_t heads, int64_t kv_heads, int64_t gp, int64_t span, int64_t D)
      : sc(kv_heads * span * gp), qb(std::max(heads, kv_heads * gp) * D), kb(W * D) {}
};

INLINE int64_t pad_group(int64_t g) {
  int64_t gp = 1;
  while (gp < g) gp *= 2;
  return gp;
}

#ifdef QK_AMX
// Linux hands out the AMX tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
// QUANTKIT_NO_AMX=1 keeps to AVX-512 (tests compare the two)
bool amx_usable() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  const char* off = std::getenv("QUANTKIT_NO_AMX");
  return granted && !(off && off[0] == '1');
}

struct alignas(64) TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tile 0: C, 16 tokens x gp rows fp32; 1, 2: A, 16 K rows x 32 bf16; 3, 4: B, Qᵀ as 16 pairs x gp rows
void amx_config(int64_t gp) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 5; t++) cfg.rows[t] = 16, cfg.colsb[t] = t == 1 || t == 2 ? 64 : uint16_t(gp * 4);
  _tile_loadconfig(&cfg);
}

// 16 bf16 K rows (row stride `stride` values) · Qᵀ (qt: D / 32 steps of [16 pairs][gp][2]) -> dst [16][gp]
template <int NC>
INLINE void amx_scores(const c10::BFloat16* k, int64_t stride, const c10::BFloat16* qt, int64_t gp, float* dst) {
  static_assert(NC % 4 == 0, "AMX takes head_dim in pairs of 32-value steps");
  _tile_zero(0);
  for (int s = 0; s < NC / 2; s += 2) {  // two 32-value steps at a time, on tiles 1, 3 and 2, 4
    _tile_loadd(1, k + s * 32, stride * 2);
    _tile_loadd(3, qt + s * 32 * gp, gp * 4);
    _tile_loadd(2, k + (s + 1) * 32, stride * 2);
    _tile_loadd(4, qt + (s + 1) * 32 * gp, gp * 4);
    _tile_dpbf16ps(0, 1, 3);
    _tile_dpbf16ps(0, 2, 4);
  }
  _tile_stored(0, dst, gp * 4);
}
#else
bool amx_usable() { return false; }
#endif

// one head: its scores sc [span][gp] -> exp(score · mul (capped) - the row's max) in place,
// 0 outside tokens [a, e) and in the padding rows; l[j]: row j's sum
INLINE void softmax_head(const Problem& P, float* sc, int64_t span, int64_t a, int64_t e, int64_t gp, float mul, float* l) {
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vi pad = (lane & int32_t(gp - 1)) >= int32_t(P.group);
  const int64_t n = span * gp, first = a * gp, last = e * gp;  // floats
  vf top = splat(NEG_INF);
  for (int64_t i = 0; i < n; i += W) {
    vf x = ld(sc + i) * mul;
    if (P.softcap > 0.f) x = P.softcap * vtanh(x * (1.f / P.softcap));
    const vi at = lane + int32_t(i);
    x = (at >= int32_t(first)) & (at < int32_t(last)) ? x : splat(NEG_INF);
    x = pad ? splat(0.f) : x;  // the padding rows may hold anything (NaN from a NaN K row · 0)
    st(sc + i, x);
    top = top > x ? top : x;
  }
  float m[W];
  std::fill(m, m + gp, NEG_INF);
  for (int i = 0; i < W; i++) m[i % gp] = std::max(m[i % gp], top[i]);
  vf mv, sum{};
  for (int i = 0; i < W; i++) mv[i] = m[i % gp];
  for (int64_t i = 0; i < n; i += W) {
    const vf p = vexp(ld(sc + i) - mv);
    st(sc + i, p);
    sum += p;
  }
  std::fill(l, l + gp, 0.f);
  for (int i = 0; i < W; i++) l[i % gp] += sum[i];
}

// a V row -> NC vectors; bf16 ones in the order even, odd values of each 32 (no shuffles), undone by `unpermute`
template <typename C, int NC>
INLINE void load_v(const C* v, vf* x) {
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    for (int c = 0; c < NC; c += 2) {
      const __m512i h = _mm512_loadu_si512(v + c * W);
      x[c] = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
      x[c + 1] = (vf)_mm512_castsi512_ps(_mm512_and_si512(h, _mm512_set1_epi32(int32_t(0xffff0000u))));
    }
  } else {
    for (int c = 0; c < NC; c++) x[c] = loadw(v + c * W);
  }
}

template <typename C, int NC>
INLINE void unpermute(const float* a, float* dst) {
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    for (int c = 0; c < NC; c += 2)
      for (int i = 0; i < W; i++) dst[c * W + 2 * i] = a[c * W + i], dst[c * W + 2 * i + 1] = a[(c + 1) * W + i];
  } else {
    std::copy(a, a + NC * W, dst);
  }
}

// rows j0 .. j0 + R - 1 of one head: acc [R][D] = Σ_t p[t][j] · v_t over tokens lo .. hi - 1
template <typename C, int NC, int R>
void pv_rows(const Problem& P, const int32_t* table, const C* vh, const float* p, int64_t gp, int64_t lo, int64_t hi,
             float* acc) {
  vf o[R][NC] = {};
  const int64_t bs = P.block_size;
  for (int64_t b = lo / bs; b * bs < hi; b++) {
    const int64_t t0 = std::max(lo, b * bs), t1 = std::min(hi, (b + 1) * bs);
    const C* v = vh + table[b * P.tables_s1] * P.v_s[0] + (t0 - b * bs) * P.v_s[1];
    const float* pt = p + (t0 - lo) * gp;
    for (int64_t t = t0; t < t1; t++, v += P.v_s[1], pt += gp) {
      vf x[NC];
      load_v<C, NC>(v, x);
      for (int r = 0; r < R; r++) {
        const vf pr = splat(pt[r]);
        for (int c = 0; c < NC; c++) o[r][c] += pr * x[c];
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < NC; c++) st(acc + r * NC * W + c * W, o[r][c]);
}

// AMX: K tiles of 16 rows from a block row that is a multiple of 16 (block_size % 16 == 0); rows
// past the sequence's end (junk, even NaN) only reach their own scores, which the softmax masks
template <typename C, int NC, bool AMX>
void decode_item(const Problem& P, const Item& it, DecodeScratch& s) {
  constexpr int64_t D = NC * W;
  constexpr int RMAX = NC == 4 ? 4 : 2;  // rows of P·V at once: R * NC accumulators in registers
  const int64_t g = P.group, gp = pad_group(g), bs = P.block_size, H = P.kv_heads;
  const int64_t hi = it.pos0 + 1, lo = P.window ? std::max<int64_t>(0, hi - P.window) : 0;
  const int64_t base = AMX ? lo / W * W : lo, span = (hi - base + W - 1) / W * W;  // sc: tokens base .. base + span - 1
  const char* qrow = P.q + it.q0 * P.q_s0;
  auto k_mul = [&](int64_t h) { return P.k_scale ? P.k_scale[P.k_per_head ? h : 0] : 1.f; };
  for (int64_t h = 0; h < H; h++)
    for (int64_t j = 0; j < g; j++) {
      const char* src = qrow + (h * g + j) * P.q_s1;
      if constexpr (AMX) {  // Qᵀ in VNNI pairs: value d of row j at [d / 2][j][d % 2]
        const c10::BFloat16* x = reinterpret_cast<const c10::BFloat16*>(src);
        c10::BFloat16* qt = s.qb.data() + h * gp * D;
        for (int64_t d = 0; d < D; d++) qt[(d / 2) * 2 * gp + 2 * j + d % 2] = x[d];
        for (int64_t jp = g; jp < gp; jp++)
          for (int64_t d = 0; d < D; d++) qt[(d / 2) * 2 * gp + 2 * jp + d % 2] = c10::BFloat16(0.f);
      } else {
        std::memcpy(s.qb.data() + (h * g + j) * D, src, D * sizeof(c10::BFloat16));
      }
    }
  const int32_t* table = P.tables + it.seq * P.tables_s0;
  const C *kc = reinterpret_cast<const C*>(P.k), *vc = reinterpret_cast<const C*>(P.v);
  const int64_t b_lo = lo / bs, b_hi = (hi - 1) / bs + 1;
  stream_in<C>(P, it, table, b_lo, b_hi, hi);
#ifdef QK_AMX
  if constexpr (AMX) amx_config(gp);
#endif
  for (int64_t b = b_lo; b < b_hi; b++) {
    const int64_t block = table[b * P.tables_s1];
    TORCH_CHECK(0 <= block && block < P.num_blocks, "paged attention: sequence ", it.seq, " names block ", block,
                " of a cache with ", P.num_blocks, " blocks.");
    const int64_t t1 = std::min(hi, (b + 1) * bs);
    for (int64_t p0 = std::max(lo, b * bs); p0 < t1;) {
      const int64_t ts = AMX ? p0 / W * W : p0, p1 = std::min(t1, ts + W), n = p1 - p0;  // AMX: rows ts .. ts + 15
      for (int64_t h = 0; h < H; h++) {
        const C* kt = kc + block * P.k_s[0] + (ts - b * bs) * P.k_s[1] + h * P.k_s[2];
        float* sc = s.sc.data() + (h * span + ts - base) * gp;
#ifdef QK_AMX
        if constexpr (AMX) {
          if constexpr (std::is_same_v<C, c10::BFloat16>)
            amx_scores<NC>(kt, P.k_s[1], s.qb.data() + h * gp * D, gp, sc);
          else
            amx_scores<NC>(load_tile_bf16<C, NC>(kt, P.k_s[1], W, s.kb.data()), D, s.qb.data() + h * gp * D, gp, sc);
          continue;
        }
#endif
        if constexpr (!AMX) {  // vdpbf16ps, one row at a time
          const c10::BFloat16* kb;
          int64_t stride = P.k_s[1];
          if constexpr (std::is_same_v<C, c10::BFloat16>)
            kb = kt;
          else
            kb = load_tile_bf16<C, NC>(kt, P.k_s[1], n, s.kb.data()), stride = D;
          for (int64_t j = 0; j < g; j++) {
            const vf x = scores_bf16<NC>(s.qb.data() + (h * g + j) * D, kb, stride, n);
            for (int64_t t = 0; t < n; t++) sc[t * gp + j] = x[t];
          }
        }
      }
      p0 = p1;
    }
  }
#ifdef QK_AMX
  if constexpr (AMX) _tile_release();
#endif
  const int64_t esize = c10::elementSize(P.q_type);
  float l[W], acc[RMAX * D], row[D];
  for (int64_t h = 0; h < H; h++) {
    float* sc = s.sc.data() + h * span * gp;
    softmax_head(P, sc, span, lo - base, hi - base, gp, P.scale * k_mul(h), l);
    const C* vh = vc + h * P.v_s[2];
    const float* p = sc + (lo - base) * gp;
    const float vmul = P.v_scale ? P.v_scale[P.v_per_head ? h : 0] : 1.f;
    for (int64_t j0 = 0; j0 < g; j0 += RMAX) {
      const int64_t R = std::min<int64_t>(RMAX, g - j0);
      switch (R) {
        case 1: pv_rows<C, NC, 1>(P, table, vh, p + j0, gp, lo, hi, acc); break;
        case 2: pv_rows<C, NC, 2>(P, table, vh, p + j0, gp, lo, hi, acc); break;
        case 3: pv_rows<C, NC, RMAX >= 3 ? 3 : 1>(P, table, vh, p + j0, gp, lo, hi, acc); break;
        default: pv_rows<C, NC, RMAX>(P, table, vh, p + j0, gp, lo, hi, acc);
      }
      for (int64_t r = 0; r < R; r++) {
        const int64_t j = j0 + r;
        unpermute<C, NC>(acc + r * D, row);
        char* dst = P.out + (it.q0 * P.heads + h * g + j) * D * esize;
        store_row(dst, P.q_type, row, D, l[j] > 0.f ? vmul / l[j] : 0.f);
      }
    }
  }
}

template <typename C, int NC>
void run_decode(const Problem& P, std::vector<Item>& items) {
  // longest first
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.cost != b.cost ? a.cost > b.cost : a.seq < b.seq;
  });
  const bool amx = amx_usable() && P.block_size % W == 0;
  int64_t span = 0;
  for (const Item& it : items) span = std::max(span, it.cost + 2 * W);
  const int64_t n = items.size(), threads = at::get_num_threads(), gp = pad_group(P.group);
  auto work = [&](DecodeScratch& s, const Item& it) {
    if (amx) return decode_item<C, NC, true>(P, it, s);
    decode_item<C, NC, false>(P, it, s);
  };
  if (threads <= 1 || n <= 1 || at::in_parallel_region()) {
    DecodeScratch s(P.heads, P.kv_heads, gp, span, NC * W);
    for (const Item& it : items) work(s, it);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, n), 1, [&](int64_t, int64_t) {
    DecodeScratch s(P.heads, P.kv_heads, gp, span, NC * W);
    for (int64_t i; (i = next.fetch_add(1)) < n;) work(s, items[i]);
  });
}
#endif  // QK_BF16DP

#ifdef QK_AMX
// ---------------------------------------------------------------- prefill with AMX
// bf16 q on a bf16, fp8 or int8 cache, head_dim 64 or 128 (the header says when). A work item is
// (sequence, KV head, up to AMX_QUERIES queries); per tile of 16 queries and per head of the group,
// keys in chunks of up to CHUNK, transposed so that lanes are queries (no horizontal reductions):
// Sᵀ = K · Qᵀ in AMX tiles (K the A operand, 16 rows in place from a bf16 cache, Qᵀ in VNNI pairs
// the B operand, made once per tile), then per query (lane) the max over the chunk, P = 2^(s ·
// scale · log2 e - max) (polynomial), rounded to bf16 in VNNI pairs of keys, and Oᵀ += Vᵀ · Pᵀ in
// AMX tiles with fp32 accumulators, rescaled between chunks (online softmax). Vᵀ (and K for fp8 /
// int8 caches, converted exactly, or a block size not a multiple of 16) is packed once per item,
// zeros where no query of the item looks. Tiles: Sᵀ = K · Qᵀ: 0-3 Qᵀ (head_dim / 32 of them), 4-5
// Sᵀ, 6-7 K; Oᵀ = Vᵀ · Pᵀ: 0-3 Oᵀ (64 values of head_dim at a time), 4 Pᵀ, 5-7 Vᵀ.

constexpr int64_t AMX_QUERIES = 256;  // queries per work item: K / V are packed once for them all
constexpr int64_t CHUNK = 128;  // keys per softmax step, a multiple of 32

struct Lanes {  // per query of a tile: running max (log2 units), sum, this chunk's rescaling
  __m512 m, l, alpha;
};

template <typename T>
struct Aligned {  // n values on 64-byte boundaries: AMX rows that straddle cache lines load at a third of the speed
  T* p;
  explicit Aligned(int64_t n) : p(static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64))) {
    TORCH_CHECK(p, "paged prefill: out of memory.");
  }
  ~Aligned() { std::free(p); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  T* data() const { return p; }
};

struct PrefillScratch {
  Aligned<c10::BFloat16> kp, vt, qt, pt, zero;  // K rows [n][D] (when packed), Vᵀ [n / 32][D][32],
                                                // Qᵀ [group][D / 2][16][2], Pᵀ [2][CHUNK / 2][16][2], [32][D] zeros
  Aligned<float> sc, acc;  // Sᵀ [2][CHUNK][16]; Oᵀ [group][D][16]
  std::vector<const c10::BFloat16*> kt;  // the item's 16-key K tiles
  std::vector<int64_t> ks;  // their row strides, bytes
  std::vector<Lanes> lanes;  // [group]
  PrefillScratch(int64_t n, int64_t D, int64_t g)
      : kp(n * D), vt(n * D), qt(g * 16 * D), pt(2 * CHUNK * 16), zero(32 * D), sc(2 * CHUNK * 16), acc(g * 16 * D), kt(n / 16),
        ks(n / 16), lanes(g) {
    std::memset(zero.data(), 0, 32 * D * sizeof(c10::BFloat16));
  }
};

void amx_config_prefill() {  // all eight tiles 16 rows x 64 bytes
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

INLINE void transpose16(__m512i* r) {  // 16 x 16 dwords, in place
  __m512i t[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 4; j++) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; j++) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// the row of key t of one cache and KV head (checked), or null outside [lo, hi)
template <typename C>
INLINE const C* key_row(const Problem& P, const int32_t* table, const C* cache, const int64_t* s, int64_t seq, int64_t t,
                        int64_t lo, int64_t hi) {
  if (t < lo || t >= hi) return nullptr;
  const int64_t block = table[t / P.block_size * P.tables_s1];
  TORCH_CHECK(0 <= block && block < P.num_blocks, "paged attention: sequence ", seq, " names block ", block,
              " of a cache with ", P.num_blocks, " blocks.");
  return cache + block * s[0] + t % P.block_size * s[1];
}

// key t's row -> bf16 [D] at dst (exact for the caches this path takes); zeros for null
template <typename C, int NC>
INLINE void row_bf16(const C* x, c10::BFloat16* dst) {
  if (!x) {
    std::memset(dst, 0, NC * W * 2);
  } else if constexpr (std::is_same_v<C, c10::BFloat16>) {
    std::memcpy(dst, x, NC * W * 2);
  } else {
    for (int c = 0; c < NC; c++)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * W), (__m256i)_mm512_cvtneps_pbh(loadw(x + c * W)));
  }
}

// keys [base, base + n) of the item's KV head (n a multiple of 32), zeros outside [lo, hi): s.vt
// [n / 32][D][32] (Vᵀ per 32 keys), s.kt / s.ks the K tiles (in place, else packed into s.kp)
template <typename C, int NC>
void pack_kv(const Problem& P, const Item& it, int64_t base, int64_t n, int64_t lo, int64_t hi, PrefillScratch& s) {
  constexpr int64_t D = NC * W;
  const int32_t* table = P.tables + it.seq * P.tables_s0;
  const C *kc = reinterpret_cast<const C*>(P.k) + it.kh * P.k_s[2], *vc = reinterpret_cast<const C*>(P.v) + it.kh * P.v_s[2];
  const bool in_place = std::is_same_v<C, c10::BFloat16> && P.block_size % 16 == 0;
  __m512i idx[2];  // V rows a, b -> a0 b0 a1 b1 ... of values 0-15 (idx[0]), 16-31 (idx[1]) of 32
  {
    alignas(64) int16_t i0[32], i1[32];
    for (int i = 0; i < 16; i++) i0[2 * i] = i, i0[2 * i + 1] = 32 + i, i1[2 * i] = 16 + i, i1[2 * i + 1] = 48 + i;
    idx[0] = _mm512_load_si512(i0), idx[1] = _mm512_load_si512(i1);
  }
  c10::BFloat16* rows = s.kp.data();  // V rows of 32 keys in bf16 (before K is packed there)
  for (int64_t k0 = n - 32; k0 >= 0; k0 -= 32) {  // from the end: K rows overwrite V's scratch behind
    for (int r = 0; r < 32; r++)
      row_bf16<C, NC>(key_row<C>(P, table, vc, P.v_s, it.seq, base + k0 + r, lo, hi), rows + r * D);
    c10::BFloat16* dst = s.vt.data() + k0 * D;
    for (int gi = 0; gi < NC; gi++) {  // values 16 gi .. 16 gi + 15: [16 pairs of keys][16] dwords, transposed
      __m512i w[16];
      for (int i = 0; i < 16; i++)
        w[i] = _mm512_permutex2var_epi16(_mm512_loadu_si512(rows + 2 * i * D + gi / 2 * 32), idx[gi % 2],
                                         _mm512_loadu_si512(rows + (2 * i + 1) * D + gi / 2 * 32));
      transpose16(w);
      for (int i = 0; i < 16; i++) _mm512_storeu_si512(dst + (16 * gi + i) * 32, w[i]);
    }
    for (int half = 0; half < 2; half++) {
      const int64_t t = base + k0 + 16 * half, u = (k0 + 16 * half) / 16;
      if (t + 16 <= lo || t >= hi) {  // no query of the item looks: not read (it may hold anything)
        s.kt[u] = s.zero.data(), s.ks[u] = D * 2;
      } else if (in_place) {
        const C* x = key_row<C>(P, table, kc, P.k_s, it.seq, t, 0, t + 1);
        s.kt[u] = reinterpret_cast<const c10::BFloat16*>(x), s.ks[u] = P.k_s[1] * 2;
      } else {
        for (int r = 0; r < 16; r++)
          row_bf16<C, NC>(key_row<C>(P, table, kc, P.k_s, it.seq, t + r, lo, hi), s.kp.data() + (k0 + 16 * half + r) * D);
        s.kt[u] = s.kp.data() + (k0 + 16 * half) * D, s.ks[u] = D * 2;
      }
    }
  }
}

// Sᵀ [16 keys][16 queries] per K tile (sc [tiles * 16][16]) = K tiles · Qᵀ (qt); tiles even
template <int NC>
INLINE void amx_qk(const c10::BFloat16* qt, const c10::BFloat16* const* kt, const int64_t* ks, int64_t tiles, float* sc) {
  _tile_loadd(0, qt, 64);
  _tile_loadd(1, qt + 512, 64);
  if constexpr (NC == 8) {
    _tile_loadd(2, qt + 1024, 64);
    _tile_loadd(3, qt + 1536, 64);
  }
  for (int64_t u = 0; u < tiles; u += 2) {
    const c10::BFloat16 *k0 = kt[u], *k1 = kt[u + 1];
    const int64_t s0 = ks[u], s1 = ks[u + 1];
    _tile_zero(4);
    _tile_zero(5);
#define QK_STEP(S)                     \
  _tile_loadd(6, k0 + (S) * 32, s0);   \
  _tile_dpbf16ps(4, 6, S);             \
  _tile_loadd(7, k1 + (S) * 32, s1);   \
  _tile_dpbf16ps(5, 7, S);
    QK_STEP(0)
    QK_STEP(1)
    if constexpr (NC == 8) {
      QK_STEP(2)
      QK_STEP(3)
    }
#undef QK_STEP
    _tile_stored(4, sc + u * 256, 64);
    _tile_stored(5, sc + u * 256 + 256, 64);
  }
}

// Oᵀ (acc [D][16]) (+)= Vᵀ (vt: steps of [D][32]) · Pᵀ (pt: steps of [16 pairs][16][2]); `first`: from zero
template <int NC>
INLINE void amx_pv(const c10::BFloat16* pt, const c10::BFloat16* vt, int64_t steps, bool first, float* acc) {
  constexpr int64_t D = NC * W;
  for (int64_t h = 0; h < D; h += 64) {
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_loadd(0, acc + h * 16, 64);
      _tile_loadd(1, acc + h * 16 + 256, 64);
      _tile_loadd(2, acc + h * 16 + 512, 64);
      _tile_loadd(3, acc + h * 16 + 768, 64);
    }
    for (int64_t u = 0; u < steps; u++) {
      const c10::BFloat16* v = vt + u * 32 * D + h * 32;  // rows h .. h + 63 of this step's Vᵀ
      _tile_loadd(4, pt + u * 512, 64);
      _tile_loadd(5, v, 64);
      _tile_dpbf16ps(0, 5, 4);
      _tile_loadd(6, v + 512, 64);
      _tile_dpbf16ps(1, 6, 4);
      _tile_loadd(7, v + 1024, 64);
      _tile_dpbf16ps(2, 7, 4);
      _tile_loadd(5, v + 1536, 64);
      _tile_dpbf16ps(3, 5, 4);
    }
    _tile_stored(0, acc + h * 16, 64);
    _tile_stored(1, acc + h * 16 + 256, 64);
    _tile_stored(2, acc + h * 16 + 512, 64);
    _tile_stored(3, acc + h * 16 + 768, 64);
  }
}

// 2^x (x <= 127), about 3e-6 relative: p(x - floor x) · 2^floor x with a minimax polynomial p;
// 2^-125 below -125 and for -inf, never a subnormal (those take a microcode assist, ~150 cycles
// each); NaN for NaN
INLINE __m512 exp2_fast(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-125.f), x);  // NaN stays NaN
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF);  // x - floor x, [0, 1)
  __m512 p = _mm512_set1_ps(1.3534167781472206e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.201146379113197e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.414427548646927e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.930038332939148e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000026226043701f));
  return _mm512_scalef_ps(p, x);
}

// Sᵀ of keys c0 .. c0 + nk - 1 (sc [nk][16]; lane j: the query at pos0 + j, j < nq) -> Pᵀ (pt, VNNI
// pairs of keys), 0 where masked; updates m, l, alpha. mul: scale · k_scale. Returns whether some
// accumulator needs rescaling.
bool softmax_chunk(const Problem& P, float* sc, c10::BFloat16* pt, int64_t nq, int64_t pos0, int64_t c0, int64_t nk,
                   float mul, Lanes& q) {
  constexpr float LOG2E = 1.4426950408889634f;
  const bool cap = P.softcap > 0.f || !(mul > 0.f);  // scores transformed before the max
  const __m512 mul2 = _mm512_set1_ps(cap ? 1.f : mul * LOG2E), neg_inf = _mm512_set1_ps(NEG_INF);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __mmask16 real = __mmask16((1u << nq) - 1);
  // keys [a, e) are visible to some query; those outside [a2, e2) (pairs) get P = 0
  const int64_t a = std::max(c0, P.window ? pos0 - P.window + 1 : 0), e = std::min(c0 + nk, pos0 + nq);
  const int64_t a2 = (a - c0) / 2 * 2, e2 = std::min(nk, (e - c0 + 1) / 2 * 2);
  // lane j sees key c0 + i when d <= j (and j <= d + window - 1), d = c0 + i - pos0: all lanes
  // for i in [f0, f1) (none when nq < 16)
  int64_t f0 = std::max(a2, P.window ? pos0 - c0 + 16 - P.window : a2), f1 = std::min(e2, pos0 - c0 + 1);
  if (cap || nq < 16 || f0 > f1) f0 = f1 = a2;
  __m512 top = neg_inf, t1 = neg_inf, t2 = neg_inf, t3 = neg_inf;
  int64_t i = f0;
  for (; i + 4 <= f1; i += 4) {  // four chains: vmaxps has a latency of 4
    top = _mm512_max_ps(top, _mm512_load_ps(sc + i * 16));
    t1 = _mm512_max_ps(t1, _mm512_load_ps(sc + i * 16 + 16));
    t2 = _mm512_max_ps(t2, _mm512_load_ps(sc + i * 16 + 32));
    t3 = _mm512_max_ps(t3, _mm512_load_ps(sc + i * 16 + 48));
  }
  for (; i < f1; i++) top = _mm512_max_ps(top, _mm512_load_ps(sc + i * 16));
  top = _mm512_max_ps(_mm512_max_ps(top, t1), _mm512_max_ps(t2, t3));
  auto edge = [&](int64_t i) {  // a key some lanes do not see (or any key, with a softcap): masked, stored
    __m512 x = _mm512_load_ps(sc + i * 16);
    const int64_t d = c0 + i - pos0;
    if (cap) {
      vf y = (vf)x * mul;
      if (P.softcap > 0.f) y = P.softcap * vtanh(y * (1.f / P.softcap));
      x = (__m512)(y * LOG2E);
    }
    __mmask16 vis = real & _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(int32_t(std::max<int64_t>(d, -1))));
    if (P.window) vis &= _mm512_cmple_epi32_mask(lane, _mm512_set1_epi32(int32_t(std::min<int64_t>(d + P.window - 1, 16))));
    x = _mm512_mask_blend_ps(vis, neg_inf, x);
    _mm512_store_ps(sc + i * 16, x);
    top = _mm512_max_ps(top, x);
  };
  for (int64_t i = a2; i < f0; i++) edge(i);
  for (int64_t i = f1; i < e2; i++) edge(i);
  const __m512 m = _mm512_max_ps(q.m, _mm512_mul_ps(top, mul2));
  const __mmask16 none = _mm512_cmpeq_ps_mask(m, neg_inf);  // no key seen yet
  const __m512 m0 = _mm512_mask_blend_ps(none, m, _mm512_setzero_ps());
  const __mmask16 same = _mm512_cmpeq_ps_mask(q.m, m);
  q.alpha = _mm512_mask_blend_ps(same, exp2_fast(_mm512_sub_ps(q.m, m0)), _mm512_set1_ps(1.f));  // ~0 from -inf
  const bool rescale = __mmask16(~same & ~_mm512_cmpeq_ps_mask(q.m, neg_inf));  // (a lane at -inf holds zeros)
  q.m = m;
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                                         20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // p0, p1 -> p0_0 p1_0 p0_1 p1_1 ...
  __m512 sum = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  std::memset(pt, 0, a2 * 32);
  auto pair = [&](int64_t i, __m512& acc) {  // keys i, i + 1 -> row i / 2 of Pᵀ
    const __m512 p0 = exp2_fast(_mm512_fmsub_ps(_mm512_load_ps(sc + i * 16), mul2, m0));
    const __m512 p1 = exp2_fast(_mm512_fmsub_ps(_mm512_load_ps(sc + i * 16 + 16), mul2, m0));
    acc = _mm512_add_ps(acc, _mm512_add_ps(p0, p1));
    _mm512_store_si512(pt + i * 16, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
  };
  int64_t k = a2;
  for (; k + 4 <= e2; k += 4) pair(k, sum), pair(k + 2, sum1);
  if (k < e2) pair(k, sum);
  sum = _mm512_add_ps(sum, sum1);
  std::memset(pt + e2 * 16, 0, (nk - e2) * 32);
  q.l = _mm512_fmadd_ps(q.l, q.alpha, sum);
  return rescale;
}

// Qᵀ of queries q0 .. q0 + nq - 1, head `head` -> qt [D / 2][16][2] (VNNI pairs), zeros past nq
template <int NC>
INLINE void load_qt(const Problem& P, int64_t q0, int64_t nq, int64_t head, c10::BFloat16* qt) {
  for (int c = 0; c < NC / 2; c++) {
    __m512i r[16];
    for (int j = 0; j < 16; j++)
      r[j] = j < nq ? _mm512_loadu_si512(P.q + (q0 + j) * P.q_s0 + head * P.q_s1 + c * 64) : _mm512_setzero_si512();
    transpose16(r);
    for (int i = 0; i < 16; i++) _mm512_storeu_si512(qt + (16 * c + i) * 32, r[i]);
  }
}

// Oᵀ (acc [D][16]) / l · vmul -> the rows of queries q0 .. q0 + nq - 1, head `head`, bf16
template <int NC>
INLINE void store_out(const Problem& P, const float* acc, __m512 l, float vmul, int64_t q0, int64_t nq, int64_t head) {
  const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(l, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(vmul), l);
  alignas(64) float f[16];
  _mm512_store_ps(f, inv);
  for (int g = 0; g < NC; g++) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(acc + (16 * g + i) * 16);
    transpose16(r);  // r[j]: values 16 g .. 16 g + 15 of query j
    for (int64_t j = 0; j < nq; j++) {
      c10::BFloat16* dst = reinterpret_cast<c10::BFloat16*>(P.out) + ((q0 + j) * P.heads + head) * NC * W + 16 * g;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_castsi512_ps(r[j]), _mm512_set1_ps(f[j]))));
    }
  }
}

template <typename C, int NC>
void prefill_item(const Problem& P, const Item& it, PrefillScratch& s) {
  constexpr int64_t D = NC * W;
  const int64_t g = P.group, hi = it.pos0 + it.nq;
  const int64_t lo = P.window ? std::max<int64_t>(0, it.pos0 - P.window + 1) : 0, base = lo / 32 * 32;
  pack_kv<C, NC>(P, it, base, (hi - base + 31) / 32 * 32, lo, hi, s);
  amx_config_prefill();
  const float mul = P.scale * (P.k_scale ? P.k_scale[P.k_per_head ? it.kh : 0] : 1.f);
  const float vmul = P.v_scale ? P.v_scale[P.v_per_head ? it.kh : 0] : 1.f;
  for (int64_t j0 = 0; j0 < it.nq; j0 += 16) {
    const int64_t nq = std::min<int64_t>(16, it.nq - j0), pos0 = it.pos0 + j0;
    const int64_t t_lo = P.window ? std::max<int64_t>(0, pos0 - P.window + 1) / 32 * 32 : 0;  // keys of this tile
    const int64_t t_hi = base + (pos0 + nq - base + 31) / 32 * 32;
    for (int64_t h = 0; h < g; h++) {
      load_qt<NC>(P, it.q0 + j0, nq, it.kh * g + h, s.qt.data() + h * 16 * D);
      s.lanes[h] = {_mm512_set1_ps(NEG_INF), _mm512_setzero_ps(), _mm512_setzero_ps()};
    }
    // steps i: chunk i / g, head i % g (a chunk's K and V stay in L1 for the heads of the group).
    // The scores of step i + 1 are issued before the softmax of step i: AMX computes them meanwhile.
    const int64_t steps = (t_hi - t_lo + CHUNK - 1) / CHUNK * g;
    auto qk = [&](int64_t i) {
      const int64_t c0 = t_lo + i / g * CHUNK, u = (c0 - base) / 16;
      amx_qk<NC>(s.qt.data() + i % g * 16 * D, s.kt.data() + u, s.ks.data() + u, std::min(CHUNK, t_hi - c0) / 16,
                 s.sc.data() + i % 2 * CHUNK * 16);
    };
    qk(0);
    for (int64_t i = 0; i < steps; i++) {
      if (i + 1 < steps) qk(i + 1);
      const int64_t c0 = t_lo + i / g * CHUNK, nk = std::min(CHUNK, t_hi - c0);
      float* acc = s.acc.data() + i % g * 16 * D;
      c10::BFloat16* pt = s.pt.data() + i % 2 * CHUNK * 16;
      Lanes& q = s.lanes[i % g];
      if (softmax_chunk(P, s.sc.data() + i % 2 * CHUNK * 16, pt, nq, pos0, c0, nk, mul, q))
        for (int64_t d = 0; d < D; d++) _mm512_store_ps(acc + d * 16, _mm512_mul_ps(_mm512_load_ps(acc + d * 16), q.alpha));
      amx_pv<NC>(pt, s.vt.data() + (c0 - base) * D, nk / 32, c0 == t_lo, acc);
    }
    for (int64_t h = 0; h < g; h++)
      store_out<NC>(P, s.acc.data() + h * 16 * D, s.lanes[h].l, vmul, it.q0 + j0, nq, it.kh * g + h);
  }
  _tile_release();
}

template <typename C, int NC>
void run_prefill_amx(const Problem& P, std::vector<Item>& items) {
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.cost != b.cost ? a.cost > b.cost : a.seq != b.seq ? a.seq < b.seq : a.q0 != b.q0 ? a.q0 < b.q0 : a.kh < b.kh;
  });
  int64_t keys = 0;
  for (const Item& it : items) keys = std::max(keys, it.pos0 + it.nq + 64);
  const int64_t n = items.size(), threads = at::get_num_threads();
  if (threads <= 1 || n <= 1 || at::in_parallel_region()) {
    PrefillScratch s(keys, NC * W, P.group);
    for (const Item& it : items) prefill_item<C, NC>(P, it, s);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, n), 1, [&](int64_t, int64_t) {
    PrefillScratch s(keys, NC * W, P.group);
    for (int64_t i; (i = next.fetch_add(1)) < n;) prefill_item<C, NC>(P, items[i], s);
  });
}
#endif  // QK_AMX

template <typename C, int NC, bool DP = false>
void run_items(const Problem& P, std::vector<Item>& items, int64_t max_rows) {
  // longest first; a sequence's KV heads one after the other, so its blocks are still in L2
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.cost != b.cost ? a.cost > b.cost : a.seq != b.seq ? a.seq < b.seq : a.q0 != b.q0 ? a.q0 < b.q0 : a.kh < b.kh;
  });
  const int64_t n = items.size(), threads = at::get_num_threads();
  if (threads <= 1 || n <= 1 || at::in_parallel_region()) {
    Scratch s(max_rows, P.D);
    for (const Item& it : items) attend<C, NC, DP>(P, it, s);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, n), 1, [&](int64_t, int64_t) {
    Scratch s(max_rows, P.D);
    for (int64_t i; (i = next.fetch_add(1)) < n;) attend<C, NC, DP>(P, items[i], s);
  });
}

// ---------------------------------------------------------------- decode with fp32 q
// fp32 q (the engine's dtype on CPUs without native bf16) on any cache, head_dim 64 or 128: a work
// item is a sequence with all its KV heads. Its K and V blocks are first read once with plain loads
// (`stream_in`, one stream per block, into L2), then three passes: every score of the context, W tokens at a time
// per query head (K in place, q in registers, the W dot products reduced by one shuffle tree),
// softcapped where asked; one softmax per query head over all of them (no running max, no
// rescaling); then P · V, per tile and head, into fp32 accumulators in L1. Products and sums fp32.
// On the Zen 4 EPYC (64 sequences of 52-532 tokens, 9 heads on 3 KV heads of 64, fp32 cache, 30
// layers, one thread) it took a decode step's attention from 132 ms (`attend`, 6.2 GB/s of K and V)
// to 67 (12.1 GB/s): without `stream_in` it was 123 ms, so the loads first are most of the gain.

struct F32Scratch {
  std::vector<float> q, sc, acc, l;  // q [heads][D] scaled; sc [heads][span + W]; acc [heads][D]; l [heads]
  F32Scratch(int64_t heads, int64_t span, int64_t D) : q(heads * D), sc(heads * (span + W)), acc(heads * D), l(heads) {}
};

template <typename C, int NC>
void decode_f32_item(const Problem& P, const Item& it, F32Scratch& s) {
  constexpr int64_t D = NC * W;
  const int64_t g = P.group, heads = P.heads, bs = P.block_size;
  const int64_t hi = it.pos0 + 1, lo = P.window ? std::max<int64_t>(0, hi - P.window) : 0, stride = hi - lo + W;
  for (int64_t r = 0; r < heads; r++) {
    const float kmul = P.k_scale ? P.k_scale[P.k_per_head ? r / g : 0] : 1.f;
    load_row(P.q + it.q0 * P.q_s0 + r * P.q_s1, P.q_type, s.q.data() + r * D, D, P.scale * kmul);
  }
  const int32_t* table = P.tables + it.seq * P.tables_s0;
  const C *kc = reinterpret_cast<const C*>(P.k), *vc = reinterpret_cast<const C*>(P.v);
  const int64_t b_lo = lo / bs, b_hi = (hi - 1) / bs + 1;
  stream_in<C>(P, it, table, b_lo, b_hi, hi);
  auto tiles = [&](auto&& body) {  // body(block, p0, n): tiles of up to W tokens, none across a block's end
    for (int64_t b = b_lo; b < b_hi; b++) {
      const int64_t block = table[b * P.tables_s1];
      TORCH_CHECK(0 <= block && block < P.num_blocks, "paged attention: sequence ", it.seq, " names block ", block,
                  " of a cache with ", P.num_blocks, " blocks.");
      const int64_t t1 = std::min(hi, (b + 1) * bs);
      for (int64_t p0 = std::max(lo, b * bs); p0 < t1; p0 += W) body(block, p0 - b * bs, p0, std::min<int64_t>(W, t1 - p0));
    }
  };
  tiles([&](int64_t block, int64_t row, int64_t p0, int64_t n) {  // scores
    const C* kt = kc + block * P.k_s[0] + row * P.k_s[1];
    for (int64_t r = 0; r < heads; r++) {
      const C* kh = kt + (r / g) * P.k_s[2];
      vf qv[NC], a[W];
      for (int c = 0; c < NC; c++) qv[c] = ld(s.q.data() + r * D + c * W);
      for (int t = 0; t < W; t++) {
        const C* kr = kh + (t < n ? t : 0) * P.k_s[1];  // past n: row 0 again (its lanes are overwritten or masked)
        a[t] = qv[0] * loadw(kr);
        for (int c = 1; c < NC; c++) a[t] += qv[c] * loadw(kr + c * W);
      }
      st(s.sc.data() + r * stride + (p0 - lo), reduce_w(a));
    }
  });
  const int64_t span = hi - lo;
  for (int64_t r = 0; r < heads; r++) {  // softmax per head: sc <- exp(s - max), l <- the sum
    float* sc = s.sc.data() + r * stride;
    if (P.softcap > 0.f)
      for (int64_t t = 0; t < span; t += W) st(sc + t, P.softcap * vtanh(ld(sc + t) * (1.f / P.softcap)));
    std::fill(sc + span, sc + span + W, NEG_INF);
    vf top = splat(NEG_INF);
    for (int64_t t = 0; t < span; t += W) {
      const vf x = ld(sc + t);
      top = top > x ? top : x;
    }
    const float m = hmax(top);
    vf sum = {};
    for (int64_t t = 0; t < span; t += W) {
      const vf p = vexp(ld(sc + t) - m);
      st(sc + t, p);
      sum += p;
    }
    s.l[r] = hsum(sum);
  }
  std::fill(s.acc.begin(), s.acc.begin() + heads * D, 0.f);
  tiles([&](int64_t block, int64_t row, int64_t p0, int64_t n) {  // P · V
    const C* vt = vc + block * P.v_s[0] + row * P.v_s[1];
    for (int64_t r = 0; r < heads; r++) {
      const C* vh = vt + (r / g) * P.v_s[2];
      const float* p = s.sc.data() + r * stride + (p0 - lo);
      float* acc = s.acc.data() + r * D;
      vf o[NC];
      for (int c = 0; c < NC; c++) o[c] = ld(acc + c * W);
      for (int64_t t = 0; t < n; t++) {
        const float pt = p[t];
        for (int c = 0; c < NC; c++) o[c] += pt * loadw(vh + t * P.v_s[1] + c * W);
      }
      for (int c = 0; c < NC; c++) st(acc + c * W, o[c]);
    }
  });
  const int64_t esize = c10::elementSize(P.q_type);
  for (int64_t r = 0; r < heads; r++) {
    const float vmul = P.v_scale ? P.v_scale[P.v_per_head ? r / g : 0] : 1.f;
    store_row(P.out + (it.q0 * heads + r) * D * esize, P.q_type, s.acc.data() + r * D, D, s.l[r] > 0.f ? vmul / s.l[r] : 0.f);
  }
}

template <typename C, int NC>
void run_decode_f32(const Problem& P, std::vector<Item>& items) {
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {  // longest first
    return a.cost != b.cost ? a.cost > b.cost : a.seq < b.seq;
  });
  int64_t span = 0;
  for (const Item& it : items) span = std::max(span, it.cost + W);
  const int64_t n = items.size(), threads = at::get_num_threads();
  if (threads <= 1 || n <= 1 || at::in_parallel_region()) {
    F32Scratch s(P.heads, span, NC * W);
    for (const Item& it : items) decode_f32_item<C, NC>(P, it, s);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, n), 1, [&](int64_t, int64_t) {
    F32Scratch s(P.heads, span, NC * W);
    for (int64_t i; (i = next.fetch_add(1)) < n;) decode_f32_item<C, NC>(P, items[i], s);
  });
}

// decode items (one per sequence, kh -1) -> one per (sequence, KV head), for `attend`
void split_heads(const Problem& P, std::vector<Item>& items) {
  std::vector<Item> split;
  for (const Item& it : items)
    for (int64_t kh = 0; kh < P.kv_heads; kh++) split.push_back({it.seq, kh, it.q0, it.nq, it.pos0, it.cost});
  items.swap(split);
}

template <typename C>
void run(const Problem& P, std::vector<Item>& items, int64_t max_rows, bool decode) {  // NC = head_dim / W
  // bf16 q and a cache whose values bf16 holds exactly: q · k in bf16
  constexpr bool exact = std::is_same_v<C, c10::BFloat16> || std::is_same_v<C, c10::Float8_e4m3fn> ||
                         std::is_same_v<C, int8_t>;
  const bool dp = exact && P.q_type == at::kBFloat16;
  (void)dp;
#ifdef QK_BF16DP
  // decode: `decode_item` (fp32 q: `decode_f32_item`, below; fp16 q keeps `attend`)
  if constexpr (exact) {
    if (decode && dp && P.group <= W && (P.D == 64 || P.D == 128))
      return P.D == 64 ? run_decode<C, 4>(P, items) : run_decode<C, 8>(P, items);
  }
#endif
  if (decode && P.q_type == at::kFloat && (P.D == 64 || P.D == 128))
    return P.D == 64 ? run_decode_f32<C, 64 / W>(P, items) : run_decode_f32<C, 128 / W>(P, items);
  if (decode) split_heads(P, items);
#ifdef QK_BF16DP
  if constexpr (exact) {
    if (dp && P.D == 64) return run_items<C, 4, true>(P, items, max_rows);
    if (dp && P.D == 128) return run_items<C, 8, true>(P, items, max_rows);
  }
#endif
  if (P.D == 64) return run_items<C, 64 / W>(P, items, max_rows);
  if (P.D == 128) return run_items<C, 128 / W>(P, items, max_rows);
  run_items<C, 0>(P, items, max_rows);
}

#ifndef QK_BF16DP
bool amx_usable() { return false; }
#endif

// the AMX prefill can take these (the header says when)
bool amx_prefill_ok(at::ScalarType q_type, at::ScalarType cache_type, int64_t D) {
  return amx_usable() && q_type == at::kBFloat16 && (D == 64 || D == 128) &&
         (cache_type == at::kBFloat16 || cache_type == at::kFloat8_e4m3fn || cache_type == at::kChar);
}

void dispatch_amx_prefill(const Problem& P, at::ScalarType cache_type, std::vector<Item>& items) {
#ifdef QK_AMX
  auto run = [&](auto c) {
    using C = decltype(c);
    P.D == 64 ? run_prefill_amx<C, 4>(P, items) : run_prefill_amx<C, 8>(P, items);
  };
  if (cache_type == at::kBFloat16) return run(c10::BFloat16());
  if (cache_type == at::kFloat8_e4m3fn) return run(c10::Float8_e4m3fn());
  return run(int8_t());
#endif
}

void dispatch(const Problem& P, at::ScalarType cache_type, std::vector<Item>& items, int64_t max_rows, bool decode) {
  switch (cache_type) {
    case at::kFloat:
      return run<float>(P, items, max_rows, decode);
    case at::kBFloat16:
      return run<c10::BFloat16>(P, items, max_rows, decode);
    case at::kHalf:
      return run<c10::Half>(P, items, max_rows, decode);
    case at::kFloat8_e4m3fn:
      return run<c10::Float8_e4m3fn>(P, items, max_rows, decode);
    case at::kChar:
      return run<int8_t>(P, items, max_rows, decode);
    default:
      TORCH_CHECK(false, "paged attention: a cache of ", cache_type,
                  " is not supported; use float32, bfloat16, float16, float8_e4m3fn or int8.");
  }
}

const float* scale_ptr(const std::optional<at::Tensor>& s, int64_t kv_heads, bool& per_head, const char* name) {
  if (!s.has_value()) return nullptr;
  TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && (s->numel() == 1 || s->numel() == kv_heads),
              "paged attention: ", name, " must be contiguous float32 [1] or [", kv_heads, "].");
  per_head = s->numel() > 1;
  return s->data_ptr<float>();
}

Problem make_problem(const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged attention: q must be [tokens, heads, head_dim] with a contiguous last dim.");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "paged attention: q must be float32, bfloat16 or float16.");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged attention: k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_dim] alike.");
  const int64_t heads = q.size(1), kv_heads = k_cache.size(2), D = q.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 16 == 0,
              "paged attention: head_dim must match the cache and be a multiple of 16; got ", D, ".");
  TORCH_CHECK(heads % kv_heads == 0, "paged attention: ", heads, " heads are not a multiple of ", kv_heads, " KV heads.");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt,
              "paged attention: block_tables must be int32 [num_seqs, max_blocks].");
  TORCH_CHECK(k_cache.element_size() > 1 || (k_scale.has_value() && v_scale.has_value()),
              "paged attention: fp8 / int8 caches need k_scale and v_scale.");
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &block_tables})
    TORCH_CHECK(t->device().is_cpu(), "paged attention: these kernels take CPU tensors; got one on ", t->device(), ".");
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged attention: window and softcap must be >= 0 (0: off).");
  Problem P{};
  P.q = static_cast<const char*>(q.data_ptr());
  P.q_s0 = q.stride(0) * q.element_size();
  P.q_s1 = q.stride(1) * q.element_size();
  P.q_type = q.scalar_type();
  P.out = static_cast<char*>(out.data_ptr());
  P.k = static_cast<const char*>(k_cache.data_ptr());
  P.v = static_cast<const char*>(v_cache.data_ptr());
  for (int i = 0; i < 3; i++) P.k_s[i] = k_cache.stride(i), P.v_s[i] = v_cache.stride(i);
  P.tables = block_tables.data_ptr<int32_t>();
  P.tables_s0 = block_tables.stride(0), P.tables_s1 = block_tables.stride(1);
  P.max_blocks = block_tables.size(1);
  P.num_blocks = k_cache.size(0);
  P.block_size = k_cache.size(1);
  P.heads = heads, P.kv_heads = kv_heads, P.group = heads / kv_heads, P.D = D;
  P.k_scale = scale_ptr(k_scale, kv_heads, P.k_per_head, "k_scale");
  P.v_scale = scale_ptr(v_scale, kv_heads, P.v_per_head, "v_scale");
  P.scale = static_cast<float>(scale), P.softcap = static_cast<float>(softcap), P.window = window;
  return P;
}

void check_len(const Problem& P, int64_t seq, int64_t len) {
  TORCH_CHECK(0 <= len && len <= P.max_blocks * P.block_size, "paged attention: sequence ", seq, " has length ", len,
              " but its block table holds ", P.max_blocks * P.block_size, " tokens.");
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                           int64_t window, double softcap) {
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  Problem P = make_problem(q, out, k_cache, v_cache, block_tables, k_scale, v_scale, scale, window, softcap);
  const int64_t num_seqs = q.size(0);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.numel() == num_seqs && seq_lens.scalar_type() == at::kInt &&
                  block_tables.size(0) == num_seqs,
              "paged attention: seq_lens must be int32 [num_seqs] and block_tables [num_seqs, max_blocks].");
  at::Tensor lens_c = seq_lens.contiguous();
  const int32_t* lens = lens_c.data_ptr<int32_t>();
  std::vector<Item> items;
  for (int64_t i = 0; i < num_seqs; i++) {
    check_len(P, i, lens[i]);
    if (lens[i] == 0) {
      out[i].zero_();
      continue;
    }
    const int64_t cost = window ? std::min<int64_t>(lens[i], window) : lens[i];
    items.push_back({i, -1, i, 1, lens[i] - 1, cost});
  }
  dispatch(P, k_cache.scalar_type(), items, P.group, true);
  return out;
}

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_lens,
                         double scale, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale, int64_t window, double softcap, int64_t tile,
                         int64_t max_work) {
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  Problem P = make_problem(q, out, k_cache, v_cache, block_tables, k_scale, v_scale, scale, window, softcap);
  const int64_t num_seqs = block_tables.size(0);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.numel() == num_seqs && seq_lens.scalar_type() == at::kInt &&
                  query_lens.dim() == 1 && query_lens.numel() == num_seqs && query_lens.scalar_type() == at::kInt,
              "paged prefill: seq_lens and query_lens must be int32 [num_seqs].");
  TORCH_CHECK(tile > 0, "paged prefill: tile must be positive.");
  at::Tensor lens_c = seq_lens.contiguous(), qlens_c = query_lens.contiguous();
  const int32_t *lens = lens_c.data_ptr<int32_t>(), *qlens = qlens_c.data_ptr<int32_t>();
  const bool amx = amx_prefill_ok(P.q_type, k_cache.scalar_type(), P.D);
#ifdef QK_AMX
  if (amx) tile = AMX_QUERIES;
#endif
  std::vector<Item> items;
  int64_t start = 0;
  for (int64_t i = 0; i < num_seqs; i++) {
    check_len(P, i, lens[i]);
    TORCH_CHECK(0 <= qlens[i] && qlens[i] <= lens[i], "paged prefill: sequence ", i, " has query_len ", qlens[i],
                " > seq_len ", lens[i], ".");
    const bool skip = max_work > 0 && int64_t(qlens[i]) * lens[i] > max_work;  // left to the caller
    for (int64_t j = 0; j < (skip ? 0 : qlens[i]); j += tile) {
      const int64_t nq = std::min<int64_t>(tile, qlens[i] - j), pos0 = lens[i] - qlens[i] + j;
      const int64_t cost = nq * (window ? std::min<int64_t>(pos0 + nq, window + nq) : pos0 + nq);
      for (int64_t kh = 0; kh < P.kv_heads; kh++) items.push_back({i, kh, start + j, nq, pos0, cost});
    }
    start += qlens[i];
  }
  TORCH_CHECK(start == q.size(0), "paged prefill: q has ", q.size(0), " tokens but query_lens add up to ", start, ".");
  if (amx)
    dispatch_amx_prefill(P, k_cache.scalar_type(), items);
  else
    dispatch(P, k_cache.scalar_type(), items, tile * P.group, false);
  return out;
}

bool amx_prefill(const at::Tensor& q, const at::Tensor& k_cache) {
  return q.dim() == 3 && k_cache.dim() == 4 && amx_prefill_ok(q.scalar_type(), k_cache.scalar_type(), q.size(2));
}

}  // namespace

TORCH_LIBRARY(quantkit_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, "
      "Tensor? k_scale, Tensor? v_scale, int window, float softcap) -> Tensor",
      &paged_attention);
  m.def(
      "paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_lens, float scale, Tensor? k_scale, Tensor? v_scale, int window, float softcap, int tile, "
      "int max_work) -> Tensor",
      &paged_prefill);
  m.def("amx_prefill(Tensor q, Tensor k_cache) -> bool", &amx_prefill);
}
