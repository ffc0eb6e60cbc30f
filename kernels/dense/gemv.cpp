// fp32 GEMV for float linears at a few rows on the CPU (quantkit.kernels.dense.cpp builds and loads it):
//
//   gemv(x [M, K] fp32, w [N, K] fp32, row-major as nn.Linear keeps it) -> y [M, N] = x . w^T
//
// for M <= 4 (decode): the weight streams once, 4 output channels at a time (4 rows of w in
// flight, one 16-lane vector of each per step, M x 4 accumulators), each product exact in fp32
// and summed in fp32 (FMA), the 16 partial sums of a channel added at its end. The next channels'
// lines are software-prefetched AHEAD bytes ahead of the stream. K need not be a multiple of 16
// (a masked tail). Channels are split over torch's threads (at::parallel_for), 64 at a time.
//
// Why: at 3 and 4 rows torch's F.linear (MKL's sgemm) streams the weight at about half the speed
// it reaches at one row; this loop keeps near that speed (1.2-1.7x MKL on smollm2's shapes, one
// thread). At 1 and 2 rows MKL is as fast or faster, and quantkit.kernels.dense.cpp calls it there.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef float vf_m __attribute__((vector_size(64), aligned(4), may_alias));
constexpr int W = 16;          // fp32 lanes per vector (one zmm, or two ymm on AVX2)
constexpr int NB = 4;          // output channels at a time
constexpr int64_t AHEAD = 2048;  // prefetch distance in bytes

#define QK_INLINE inline __attribute__((always_inline))

QK_INLINE vf load(const float* p) { return *reinterpret_cast<const vf_m*>(p); }
QK_INLINE float hsum(vf v) {
  float s = 0.f;
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

// y[m, n0 .. n0 + NB) for M rows (template), channels n0 .. n0 + nb (nb <= NB; the rest skipped).
template <int M>
QK_INLINE void block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0, int nb) {
  vf acc[M][NB] = {};
  const float* rows[NB];
  for (int c = 0; c < NB; ++c) rows[c] = w + (n0 + (c < nb ? c : 0)) * K;
  const int64_t kv = K / W * W;
  for (int64_t k = 0; k < kv; k += W) {
    vf wv[NB];
#pragma GCC unroll 4
    for (int c = 0; c < NB; ++c) {
      __builtin_prefetch(reinterpret_cast<const char*>(rows[c] + k) + AHEAD);
      wv[c] = load(rows[c] + k);
    }
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const vf xv = load(x + m * K + k);
#pragma GCC unroll 4
      for (int c = 0; c < NB; ++c) acc[m][c] += xv * wv[c];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < nb; ++c) {
      float s = hsum(acc[m][c]);
      for (int64_t k = kv; k < K; ++k) s += x[m * K + k] * rows[c][k];
      y[m * N + n0 + c] = s;
    }
}

template <int M>
void run(const float* x, const float* w, float* y, int64_t K, int64_t N) {
  at::parallel_for(0, (N + NB - 1) / NB, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB;
      block<M>(x, w, y, K, N, n0, static_cast<int>(N - n0 < NB ? N - n0 : NB));
    }
  });
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "w must be contiguous fp32 [N, K]");
  TORCH_CHECK(x.size(1) == w.size(1), "x has ", x.size(1), " features, the weight takes ", w.size(1));
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 4, "gemv takes 1 to 4 rows, not ", x.size(0));
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (M) {
    case 1: run<1>(xp, wp, yp, K, N); break;
    case 2: run<2>(xp, wp, yp, K, N); break;
    case 3: run<3>(xp, wp, yp, K, N); break;
    default: run<4>(xp, wp, yp, K, N); break;
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(quantkit_dense, m) { m.def("gemv(Tensor x, Tensor w) -> Tensor", &gemv); }
