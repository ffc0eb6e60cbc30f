// The element-wise steps of a decoder block on the CPU, one pass each instead of the five to
// ten torch ops of the module they replace (quantkit.kernels.elementwise.cpp builds and loads it):
//
//   rms_norm(x [N, H] or [T, heads, D], w, eps, gemma) -> y, x's shape, contiguous
//   add_rms_norm_(x [N, H], delta [N, H], w, eps, gemma) -> y: x += delta in place, y = rms_norm(x)
//   rope_(x [T, heads, D], cos [T, R], sin [T, R]): in place, the first R dims of each head
//   silu_mul(gu [T, 2I]) -> silu(gu[:, :I]) * gu[:, I:]
//   kv_store_(k, v [T, kv_heads, D], k_cache, v_cache [blocks, block_size, kv_heads, D], slots [T],
//       k_scale, v_scale): each token's rows into its cache slot (negative: skipped), in the
//       cache's dtype; fp8 / int8 caches store x / scale (fp8 clamped to +-448, int8 rounded half
//       to even and clamped), as quantkit.kernels.reference.kv_store
//   argmax(x [rows, vocab]) -> int64 [rows]: the first index of each row's maximum, NaN the
//       largest (torch's argmax), in one vectorised pass (torch's CPU argmax is scalar)
//
// Each rounds where the torch code it replaces rounds (quantkit.kernels.reference holds that
// code: the twins), so a bf16 result is the twin's but for the order of the sum of squares
// (tests hold them within a stated tolerance):
//   llama-style norm:  y = w * dtype(x * rsqrt(mean(x^2) + eps))     (two roundings)
//   gemma-style norm:  y = dtype(x * rsqrt(mean(x^2) + eps) * (1 + w))  (fp32 throughout)
//   rope:              y = dtype(dtype(x * cos) + dtype(swap(x) * sin)), swap(x) = [x2, x1] and
//                      sin already carrying the sign (-sin on the first half), as the twin
//   silu_mul:          y = dtype(dtype(g / (1 + exp(-g))) * u), exp from SLEEF as torch's silu
// All arithmetic is in fp32, rows in parallel over torch's threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

// products are rounded before they are added, as torch's separate mul and add round them
// (the build's -ffp-contract=fast would fuse them into FMAs)
#pragma GCC optimize("fp-contract=off")

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>  // shipped with torch and exported by libtorch_cpu: the exp torch's silu uses
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <limits>
#include <vector>

namespace {

#define INLINE inline __attribute__((always_inline))

// W fp32 lanes of GCC vector extensions: one AVX-512 register where the build targets AVX-512,
// one AVX2 register else
#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));

// fp32 <-> storage dtype, rounding to nearest even as torch does: W values at a time, or one
template <typename T>
INLINE vf vload(const T* p) {
  vf v;
  for (int i = 0; i < W; i++) v[i] = static_cast<float>(p[i]);
  return v;
}
template <>
INLINE vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <>
INLINE vf vload(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
}

template <typename T>
INLINE void vstore(T* p, vf v) {
  for (int i = 0; i < W; i++) p[i] = static_cast<T>(v[i]);
}
template <>
INLINE void vstore(float* p, vf v) {
  std::memcpy(p, &v, sizeof v);
}
template <>
INLINE void vstore(c10::BFloat16* p, vf v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh((__m512)v));
#else
  const vu u = (vu)v;
  const vu r = v != v ? vu{} + 0x7FC0u : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // NaN stays NaN
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)r));
#else
  const vh h = __builtin_convertvector(r, vh);
  std::memcpy(p, &h, sizeof h);
#endif
#endif
}

template <typename T>
INLINE vf rnd(vf v) {  // v rounded to T, back in fp32
  T t[W];
  vstore(t, v);
  return vload(t);
}
template <>
INLINE vf rnd<float>(vf v) {
  return v;
}

// one value: the same, through a W-lane vector whose other lanes are ignored
template <typename T>
INLINE float load1(const T* p) {
  return static_cast<float>(*p);
}
template <typename T>
INLINE float rnd1(float f) {
  return rnd<T>(vf{} + f)[0];
}
template <typename T>
INLINE void store1(T* p, float f) {
  T t[W];
  vstore(t, vf{} + f);
  *p = t[0];
}

INLINE float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < W; i++) s += v[i];
  return s;
}

struct Rows {  // [N, H] or [N0, N1, H] (rows r = i0 * N1 + i1) with a contiguous last dim
  int64_t n, h, n1, s0, s1;
  int64_t at(int64_t r) const { return (r / n1) * s0 + (r % n1) * s1; }  // offset of row r
};

Rows rows_of(const at::Tensor& x, const char* what) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, what,
              ": expected [rows, hidden] or [tokens, heads, head_dim] with a contiguous last dim.");
  TORCH_CHECK(x.device().is_cpu(), what, ": these kernels take CPU tensors.");
  if (x.dim() == 2) return {x.size(0), x.size(1), 1, x.stride(0), 0};
  return {x.size(0) * x.size(1), x.size(2), x.size(1), x.stride(0), x.stride(1)};
}

// y[0..h) = norm(x[0..h)), x and y rows of T
template <typename T>
INLINE void norm_row(const T* x, const T* w, T* y, int64_t h, float eps, bool gemma) {
  vf acc{};
  float tail = 0.f;
  int64_t i = 0;
  for (; i + W <= h; i += W) {
    const vf v = vload(x + i);
    acc += v * v;
  }
  for (int64_t j = i; j < h; j++) tail += load1(x + j) * load1(x + j);
  const float r = 1.f / std::sqrt((hsum(acc) + tail) / float(h) + eps);
  for (i = 0; i + W <= h; i += W) {
    const vf v = vload(x + i) * r;
    vstore(y + i, gemma ? v * (1.f + vload(w + i)) : vload(w + i) * rnd<T>(v));
  }
  for (; i < h; i++) {
    const float v = load1(x + i) * r;
    store1(y + i, gemma ? v * (1.f + load1(w + i)) : load1(w + i) * rnd1<T>(v));
  }
}

template <typename F>
void for_rows(int64_t n, int64_t work_per_row, const F& f) {
  at::parallel_for(0, n, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, work_per_row)), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; r++) f(r);
  });
}

template <typename F>
void dispatch_float(at::ScalarType t, const char* what, const F& f) {
  switch (t) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kHalf:
      return f(c10::Half{});
    default:
      TORCH_CHECK(false, what, ": expected float32, bfloat16 or float16, got ", t, ".");
  }
}

void check_weight(const at::Tensor& x, const at::Tensor& w, const char* what) {
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(-1) && w.scalar_type() == x.scalar_type(),
              what, ": the weight must be contiguous [", x.size(-1), "] of x's dtype.");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma) {
  const Rows R = rows_of(x, "rms_norm");
  check_weight(x, w, "rms_norm");
  at::Tensor y = at::empty(x.sizes(), x.options());
  dispatch_float(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T *px = x.const_data_ptr<T>(), *pw = w.const_data_ptr<T>();
    T* py = y.mutable_data_ptr<T>();
    for_rows(R.n, R.h, [&](int64_t r) { norm_row(px + R.at(r), pw, py + r * R.h, R.h, float(eps), gemma); });
  });
  return y;
}

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, double eps, bool gemma) {
  const Rows R = rows_of(x, "add_rms_norm_"), D = rows_of(delta, "add_rms_norm_");
  check_weight(x, w, "add_rms_norm_");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(),
              "add_rms_norm_: delta must be x's shape and dtype.");
  at::Tensor y = at::empty(x.sizes(), x.options());
  dispatch_float(x.scalar_type(), "add_rms_norm_", [&](auto tag) {
    using T = decltype(tag);
    T* px = x.mutable_data_ptr<T>();
    const T *pd = delta.const_data_ptr<T>(), *pw = w.const_data_ptr<T>();
    T* py = y.mutable_data_ptr<T>();
    for_rows(R.n, R.h, [&](int64_t r) {
      T* row = px + R.at(r);
      const T* d = pd + D.at(r);
      int64_t i = 0;
      for (; i + W <= R.h; i += W) vstore(row + i, vload(row + i) + vload(d + i));
      for (; i < R.h; i++) store1(row + i, load1(row + i) + load1(d + i));
      norm_row(row, pw, py + r * R.h, R.h, float(eps), gemma);
    });
  });
  return y;
}

void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.device().is_cpu(),
              "rope_: x must be a CPU [tokens, heads, head_dim] with a contiguous last dim.");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), R = cos.size(-1), half = R / 2;
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == T && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope_: cos and sin must be contiguous [tokens, rotary_dim] of x's dtype.");
  TORCH_CHECK(R % 2 == 0 && R <= D, "rope_: rotary_dim must be even and at most head_dim.");
  dispatch_float(x.scalar_type(), "rope_", [&](auto tag) {
    using E = decltype(tag);
    E* px = x.mutable_data_ptr<E>();
    const E *pc = cos.const_data_ptr<E>(), *ps = sin.const_data_ptr<E>();
    const int64_t s0 = x.stride(0), s1 = x.stride(1);
    for_rows(T, H * R, [&](int64_t t) {
      const E *c = pc + t * R, *s = ps + t * R;
      for (int64_t h = 0; h < H; h++) {
        E* v = px + t * s0 + h * s1;
        int64_t i = 0;  // x1 = v[i], x2 = v[half + i]: both read before either is written
        for (; i + W <= half; i += W) {
          const vf x1 = vload(v + i), x2 = vload(v + half + i);
          vstore(v + i, rnd<E>(x1 * vload(c + i)) + rnd<E>(x2 * vload(s + i)));
          vstore(v + half + i, rnd<E>(x2 * vload(c + half + i)) + rnd<E>(x1 * vload(s + half + i)));
        }
        for (; i < half; i++) {
          const float x1 = load1(v + i), x2 = load1(v + half + i);
          store1(v + i, rnd1<E>(x1 * load1(c + i)) + rnd1<E>(x2 * load1(s + i)));
          store1(v + half + i, rnd1<E>(x2 * load1(c + half + i)) + rnd1<E>(x1 * load1(s + half + i)));
        }
      }
    });
  });
}

INLINE vf silu(vf g) {  // g / (1 + exp(-g))
#if defined(__AVX512F__)
  return g / (1.f + (vf)Sleef_expf16_u10((__m512)-g));
#elif defined(__AVX2__)
  return g / (1.f + (vf)Sleef_expf8_u10((__m256)-g));
#else
  vf e;
  for (int i = 0; i < W; i++) e[i] = std::exp(-g[i]);
  return g / (1.f + e);
#endif
}

at::Tensor silu_mul(const at::Tensor& gu) {
  const Rows R = rows_of(gu, "silu_mul");
  TORCH_CHECK(gu.dim() == 2 && R.h % 2 == 0, "silu_mul: the last dim must be gate and up, of even size.");
  const int64_t I = R.h / 2;
  at::Tensor y = at::empty({R.n, I}, gu.options());
  dispatch_float(gu.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* pg = gu.const_data_ptr<T>();
    T* py = y.mutable_data_ptr<T>();
    for_rows(R.n, I, [&](int64_t r) {
      const T *g = pg + R.at(r), *u = g + I;
      T* out = py + r * I;
      int64_t i = 0;
      for (; i + W <= I; i += W) vstore(out + i, rnd<T>(silu(vload(g + i))) * vload(u + i));
      for (; i < I; i++) store1(out + i, rnd<T>(silu(vf{} + load1(g + i)))[0] * load1(u + i));
    });
  });
  return y;
}

// the first index of the maximum of x[0..n), a NaN counting as larger than any number: one
// pass keeping each lane's largest value and the first index it was seen at
INLINE bool better(float v, int64_t i, float best, int64_t at) {  // v at i beats best at `at`
  if (v != v) return best == best || i < at;
  return best == best && (v > best || (v == best && i < at));
}

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  vf best = vf{} - std::numeric_limits<float>::infinity();
  vu at{};  // index / W of each lane's best (lane j holds index at[j] * W + j)
  const vu none{};
  int64_t i = 0;
  for (uint32_t step = 0; i + W <= n; i += W, step++) {
    const vf v = vload(x + i);
    const auto take = (v > best) | ((v != v) & (best == best));  // a first NaN sticks
    best = take ? v : best;
    at = take ? none + step : at;
  }
  float top = -std::numeric_limits<float>::infinity();
  int64_t arg = 0;
  for (int j = 0; j < W; j++)
    if (i > 0 && better(best[j], int64_t(at[j]) * W + j, top, arg)) top = best[j], arg = int64_t(at[j]) * W + j;
  for (; i < n; i++)
    if (better(load1(x + i), i, top, arg) || (i == 0)) top = load1(x + i), arg = i;
  return arg;
}

at::Tensor argmax(const at::Tensor& x) {
  const Rows R = rows_of(x, "argmax");
  TORCH_CHECK(x.dim() == 2 && R.h > 0, "argmax: expected [rows, vocab] with vocab > 0.");
  at::Tensor out = at::empty({R.n}, x.options().dtype(at::kLong));
  int64_t* po = out.mutable_data_ptr<int64_t>();
  dispatch_float(x.scalar_type(), "argmax", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.const_data_ptr<T>();
    for_rows(R.n, R.h, [&](int64_t r) { po[r] = argmax_row(px + R.at(r), R.h); });
  });
  return out;
}

// one row of D values of x into the cache's dtype, divided by `scale` for fp8 / int8
template <typename X, typename C>
INLINE void store_kv_row(const X* x, C* dst, int64_t D, float scale) {
  if constexpr (std::is_same_v<X, C>) {
    std::memcpy(dst, x, D * sizeof(C));
  } else if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) {
    for (int64_t i = 0; i < D; i++) {
      const float y = static_cast<float>(x[i]) / scale;
      dst[i] = c10::Float8_e4m3fn(y != y ? y : std::min(448.f, std::max(-448.f, y)));
    }
  } else if constexpr (std::is_same_v<C, int8_t>) {
    for (int64_t i = 0; i < D; i++)
      dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, std::nearbyint(static_cast<float>(x[i]) / scale))));
  } else {
    for (int64_t i = 0; i < D; i++) dst[i] = static_cast<C>(static_cast<float>(x[i]));
  }
}

template <typename X, typename C>
void store_kv(const at::Tensor& x, at::Tensor& cache, const int64_t* slots, const std::optional<at::Tensor>& scale) {
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), bs = cache.size(1);
  const X* px = x.const_data_ptr<X>();
  C* pc = cache.mutable_data_ptr<C>();
  const float* ps = scale.has_value() ? scale->const_data_ptr<float>() : nullptr;
  const bool per_head = ps && scale->numel() > 1;
  for (int64_t t = 0; t < T; t++) {
    if (slots[t] < 0) continue;
    C* row = pc + (slots[t] / bs) * cache.stride(0) + (slots[t] % bs) * cache.stride(1);
    for (int64_t h = 0; h < H; h++)
      store_kv_row<X, C>(px + t * x.stride(0) + h * x.stride(1), row + h * cache.stride(2), D,
                         ps ? ps[per_head ? h : 0] : 1.f);
  }
}

void kv_store_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
               const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() && k.stride(2) == 1 &&
                  v.stride(2) == 1,
              "kv_store_: k and v must be [tokens, kv_heads, head_dim] alike, with a contiguous last dim.");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2) && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1,
              "kv_store_: the caches must be [blocks, block_size, kv_heads, head_dim] alike, matching k.");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) && slot_mapping.scalar_type() == at::kLong,
              "kv_store_: slot_mapping must be int64 [tokens].");
  const bool quantized = k_cache.element_size() == 1;
  for (const auto* s : {&k_scale, &v_scale})
    TORCH_CHECK(s->has_value() == quantized && (!quantized || ((*s)->scalar_type() == at::kFloat &&
                                                               (*s)->is_contiguous() &&
                                                               ((*s)->numel() == 1 || (*s)->numel() == k.size(1)))),
                "kv_store_: fp8 / int8 caches need float32 scales [1] or [kv_heads]; float caches none.");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v, &k_cache, &v_cache, &slot_mapping})
    TORCH_CHECK(t->device().is_cpu(), "kv_store_: these kernels take CPU tensors.");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* ps = slots.const_data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < slots.numel(); t++)
    TORCH_CHECK(ps[t] < capacity, "kv_store_: slot ", ps[t], " is past the cache's ", capacity, " slots.");
  dispatch_float(k.scalar_type(), "kv_store_", [&](auto xtag) {
    using X = decltype(xtag);
    auto both = [&](auto ctag) {
      using C = decltype(ctag);
      store_kv<X, C>(k, k_cache, ps, k_scale);
      store_kv<X, C>(v, v_cache, ps, v_scale);
    };
    switch (k_cache.scalar_type()) {
      case at::kFloat: return both(float{});
      case at::kBFloat16: return both(c10::BFloat16{});
      case at::kHalf: return both(c10::Half{});
      case at::kFloat8_e4m3fn: return both(c10::Float8_e4m3fn{});
      case at::kChar: return both(int8_t{});
      default:
        TORCH_CHECK(false, "kv_store_: a cache of ", k_cache.scalar_type(), " is not supported.");
    }
  });
}

}  // namespace

TORCH_LIBRARY(quantkit_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool gemma) -> Tensor", &rms_norm);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps, bool gemma) -> Tensor", &add_rms_norm_);
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", &rope_);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("argmax(Tensor x) -> Tensor", &argmax);
  m.def(
      "kv_store_(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor? k_scale, "
      "Tensor? v_scale) -> ()",
      &kv_store_);
}
