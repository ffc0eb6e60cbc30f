// W8A8 on x86 CPUs: the two element-wise passes around oneDNN's int8 GEMM, each one pass over
// memory instead of the ten torch ops they replace (quantkit.kernels.cpu_w8a8 builds and loads it).
//
//   quantize_per_token(x [M, K] bf16 | fp32) -> (q int8 [M, K], scale fp32 [M, 1])
//       scale = max|x_row| / 127.5 (1 for an all-zero row), q = clamp(round_half_even(x / scale),
//       -128, 127): the same IEEE division and rounding as quantkit.primitives, so q and scale
//       equal the torch path's bit for bit (tested).
//   scale_rows_(y [M, N] bf16, scale fp32 [M, 1]): y[m, :] = bf16(fp32(y[m, :]) * scale[m]), in
//       place, rounding to nearest even as torch does.
//
// The AVX-512 code is compiled with function-level target attributes and chosen on CPUID at run
// time, so the file builds for any x86-64 target; other CPUs take the scalar loops.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>

#define W8_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

namespace {

bool has_avx512() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
  if (!(f && dq && bw && vl)) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 0xE6) == 0xE6;  // the OS saves the zmm state
}

const bool kAvx512 = has_avx512();

inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(float v) { return v; }

inline float row_scale(float amax) {
  const float s = amax / 127.5f;
  return s > FLT_MIN ? s : 1.0f;
}

template <typename T>
void quantize_scalar(const T* x, int8_t* q, float* s, int64_t K) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(to_float(x[k])));
  const float scale = row_scale(amax);
  for (int64_t k = 0; k < K; ++k) {
    const float v = std::nearbyint(to_float(x[k]) / scale);
    q[k] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, v)));
  }
  *s = scale;
}

W8_AVX512 inline __m512 load(const at::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

W8_AVX512 inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

W8_AVX512 inline __mmask16 tail(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

template <typename T>
W8_AVX512 void quantize_avx512(const T* x, int8_t* q, float* s, int64_t K) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load(x + k, tail(K - k))));
  const float scale = row_scale(_mm512_reduce_max_ps(amax));
  const __m512 vs = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = tail(K - k);
    __m512 v = _mm512_div_ps(load(x + k, m), vs);
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    _mm512_mask_cvtsepi32_storeu_epi8(q + k, m, _mm512_cvtps_epi32(v));
  }
  *s = scale;
}

void scale_row_scalar(at::BFloat16* y, float s, int64_t N) {
  for (int64_t n = 0; n < N; ++n) y[n] = at::BFloat16(static_cast<float>(y[n]) * s);  // rounds to nearest even
}

W8_AVX512 void scale_row_avx512(at::BFloat16* y, float s, int64_t N) {
  const __m512 vs = _mm512_set1_ps(s);
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  for (int64_t n = 0; n < N; n += 16) {
    const __mmask16 m = tail(N - n);
    const __m512 v = _mm512_mul_ps(load(y + n, m), vs);
    __m512i u = _mm512_castps_si512(v);  // round to nearest even (no NaN here: finite int8 products)
    u = _mm512_add_epi32(_mm512_add_epi32(u, bias), _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
    _mm256_mask_storeu_epi16(y + n, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
  }
}

template <typename T>
void quantize_rows(const T* x, int8_t* q, float* s, int64_t M, int64_t K) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      if (kAvx512)
        quantize_avx512(x + m * K, q + m * K, s + m, K);
      else
        quantize_scalar(x + m * K, q + m * K, s + m, K);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_per_token(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "quantize_per_token: x must be a contiguous [M, K] CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "quantize_per_token: x must be bf16 or fp32");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor s = at::empty({M, 1}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kBFloat16)
    quantize_rows(x.data_ptr<at::BFloat16>(), q.data_ptr<int8_t>(), s.data_ptr<float>(), M, K);
  else
    quantize_rows(x.data_ptr<float>(), q.data_ptr<int8_t>(), s.data_ptr<float>(), M, K);
  return {q, s};
}

void scale_rows_(at::Tensor y, const at::Tensor& s) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kBFloat16 && y.device().is_cpu(),
              "scale_rows_: y must be a contiguous [M, N] bf16 CPU tensor");
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() == y.size(0),
              "scale_rows_: scale must be fp32 with one value per row of y");
  const int64_t M = y.size(0), N = y.size(1);
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const float* sp = s.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      if (kAvx512)
        scale_row_avx512(yp + m * N, sp[m], N);
      else
        scale_row_scalar(yp + m * N, sp[m], N);
    }
  });
}

}  // namespace

TORCH_LIBRARY(quantkit_w8a8, m) {
  m.def("quantize_per_token(Tensor x) -> (Tensor, Tensor)");
  m.def("scale_rows_(Tensor(a!) y, Tensor scale) -> ()");
}

TORCH_LIBRARY_IMPL(quantkit_w8a8, CPU, m) {
  m.impl("quantize_per_token", &quantize_per_token);
  m.impl("scale_rows_", &scale_rows_);
}
