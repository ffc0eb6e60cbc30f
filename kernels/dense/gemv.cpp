// fp32 GEMV for float linears at a few rows on the CPU (quantkit.kernels.dense.cpp builds and loads it):
//
//   gemv(x [M, K] fp32, w [N, K] fp32, row-major as nn.Linear keeps it, isa) -> y [M, N] = x . w^T
//
// for M <= 4 (decode): one output channel at a time, all M rows of x (in L1) against it, so the
// weight is read as one sequential stream from its first byte to its last, which the CPU's
// hardware prefetcher follows at close to its read bandwidth. Each product is exact in fp32 and
// summed in fp32 (FMA) into U vector accumulators per row, added at the channel's end. K need not
// be a multiple of the vector width (a scalar tail). Channels are split over torch's threads
// (at::parallel_for) in contiguous ranges, one stream per thread.
//
// Why: measured on a Zen 4 EPYC (one thread, weights from memory), MKL's sgemm reads smollm2's
// weights at 4-15 GB/s at 1-4 rows, and a schedule of 4 channels in flight (4 streams, software
// prefetch) at 8-14; this one at 13-28 GB/s, where the core's read bandwidth (a sum over 512 MB)
// is ~27 GB/s. docs/benchmarks.md has the table.
//
// ISAs: the body (the #else branch at the end) is compiled twice, into namespace avx2 (target
// avx2,fma,no-avx512f: ymm registers only) and avx512 (zmm), as int4_avx.cpp is; `isa` (1 AVX2,
// 2 AVX-512) says which runs and isa_level() what the CPU and OS allow.

#ifndef QK_GEMV_BODY

#if !defined(__x86_64__)
#error "the C++ fp32 GEMV is for x86-64 CPUs"
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../cpu_isa.h"

#include <cstdint>

namespace {

const int64_t kIsa = quantkit_isa::level();

}  // namespace

#define QK_GEMV_BODY

#pragma GCC push_options
#pragma GCC target("avx2,fma,no-avx512f")
namespace avx2 {
typedef float vf __attribute__((vector_size(32)));
typedef float vf_m __attribute__((vector_size(32), aligned(4), may_alias));  // unaligned memory
constexpr int W = 8;  // fp32 lanes per vector
#define QK_W 8
#include "gemv.cpp"   // this file again: the #else branch below
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f")
namespace avx512 {
typedef float vf __attribute__((vector_size(64)));
typedef float vf_m __attribute__((vector_size(64), aligned(4), may_alias));
constexpr int W = 16;
#undef QK_W
#define QK_W 16
#include "gemv.cpp"
}  // namespace avx512
#pragma GCC pop_options

namespace {

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "w must be contiguous fp32 [N, K]");
  TORCH_CHECK(x.size(1) == w.size(1), "x has ", x.size(1), " features, the weight takes ", w.size(1));
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 4, "gemv takes 1 to 4 rows, not ", x.size(0));
  TORCH_CHECK(isa == 1 || isa == 2, "isa must be 1 (AVX2) or 2 (AVX-512), not ", isa);
  TORCH_CHECK(isa <= kIsa, isa == 2 ? "this CPU (or its OS) has no AVX-512" : "this CPU has no AVX2 + FMA");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto fn = isa == 2 ? avx512::run : avx2::run;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { fn(xp, wp, yp, M, K, N, n0, n1); });
  return y;
}

int64_t isa_level() { return kIsa; }

}  // namespace

TORCH_LIBRARY(quantkit_dense, m) {
  m.def("gemv(Tensor x, Tensor w, int isa) -> Tensor", &gemv);
  m.def("isa_level() -> int", &isa_level);  // 0: neither, 1: AVX2 + FMA, 2: AVX-512 (F, DQ, BW, VL) too
}

#else  // QK_GEMV_BODY: the kernel, written once for the vector type vf of W fp32 lanes (included twice above)

#define QK_INLINE inline __attribute__((always_inline))

QK_INLINE vf load(const float* p) { return *reinterpret_cast<const vf_m*>(p); }

// The sum of a vector's lanes, as a tree of halves (a chain of W scalar adds cost more than a
// short channel's loads).
QK_INLINE float hsum(vf a) {
#if QK_W == 16
  typedef float v8 __attribute__((vector_size(32)));
  const v8 h8 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const vf h8 = a;
#endif
  typedef float v4 __attribute__((vector_size(16)));
  const v4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// y[m, n] for the M rows of x and channels n0 .. n1, U accumulators per row.
template <int M, int U>
void channels(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int64_t step = W * U;
  const int64_t kv = K / step * step, kw = K / W * W;
  for (int64_t n = n0; n < n1; ++n) {
    const float* row = w + n * K;
    vf acc[M][U] = {};
    int64_t k = 0;
    for (; k < kv; k += step) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        const vf wv = load(row + k + W * u);
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) acc[m][u] += load(x + m * K + k + W * u) * wv;
      }
    }
    for (; k < kw; k += W) {
      const vf wv = load(row + k);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) acc[m][0] += load(x + m * K + k) * wv;
    }
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      vf a = acc[m][0];
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) a += acc[m][u];
      float s = hsum(a);
      for (int64_t j = kw; j < K; ++j) s += x[m * K + j] * row[j];
      y[m * N + n] = s;
    }
  }
}

void run(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  switch (M) {
    case 1: channels<1, 2>(x, w, y, K, N, n0, n1); break;
    case 2: channels<2, 2>(x, w, y, K, N, n0, n1); break;
    case 3: channels<3, 2>(x, w, y, K, N, n0, n1); break;
    default: channels<4, 2>(x, w, y, K, N, n0, n1); break;
  }
}

#undef QK_INLINE

#endif  // QK_GEMV_BODY
