// A Llama layer's RMSNorm (bfloat16 and float32; also with the residual sum
// before it, which the norm reads anyway) and the rotation of q and k, each
// one operator on CPU instead of four and ten small ATen ones: at decode
// every one of those costs a few microseconds of dispatch whatever the batch
// (about 1.5 ms of a batch-8 SmolLM2 step, 30 layers).  The CPU
// counterparts of engine/models/fused_triton.py, rounding where the
// op-by-op versions in engine/models/llama.py and rotary.py round: the norm
// in float32, then the weight product in the model dtype; each rotary
// product, then their sum, in the model dtype, never fused into one
// multiply-add (so float32 gives the same bits as the ATen ops).  A build
// for an AVX512 capability rotates float32 and bf16 rows 16 pairs at a time
// with the same roundings, an AVX2 build float32 rows 8 pairs at a time.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "vec16.h"

namespace {

template <typename T>
inline float rnd(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// One row's norm: in float32, then the weight product rounded to T.  Not
// inlined, so that rms_norm and add_rms_norm run the same code (the same
// order of the sum of squares: eight or sixteen lanes, then their sum).
template <typename T>
__attribute__((noinline)) void norm_row(const T* xr, const T* w, int64_t n, float e, T* yr) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) {
    const float v = static_cast<float>(xr[j]);
    ss += v * v;
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + e);
  for (int64_t j = 0; j < n; ++j) {
    const float normed = rnd<T>(static_cast<float>(xr[j]) * inv);
    yr[j] = static_cast<T>(normed * static_cast<float>(w[j]));
  }
}

template <typename T>
void check_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  constexpr bool f32 = std::is_same_v<T, float>;
  constexpr auto dtype = f32 ? at::kFloat : at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == dtype && weight.scalar_type() == dtype,
              op, ": ", f32 ? "float32" : "bfloat16", " x and weight");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x [T, n], rows contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              op, ": weight [n]");
}

template <typename T>
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const char* op) {
  check_norm_args<T>(op, x, weight);
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  const T* src = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(src + r * stride, w, n, e, dst + r * n);
  });
  return out;
}

// The residual sum x + r (rounded to T, as ATen's add rounds) and its norm,
// in one pass over the rows: a layer's `x = x + o; h = norm(x)`.
template <typename T>
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                                const at::Tensor& weight, double eps,
                                                const char* op) {
  check_norm_args<T>(op, x, weight);
  TORCH_CHECK(r.scalar_type() == x.scalar_type() && r.sizes() == x.sizes() && r.stride(1) == 1,
              op, ": r [T, n] of x's dtype, rows contiguous");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor sum = at::empty({rows, n}, x.options());
  at::Tensor out = at::empty({rows, n}, x.options());
  const T* xs = x.data_ptr<T>();
  const T* rs = r.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* ss = sum.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t xstride = x.stride(0), rstride = r.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* a = xs + row * xstride;
      const T* b = rs + row * rstride;
      T* y = ss + row * n;
      int64_t j = 0;
#ifdef PREEMPT_SERVE_VEC16
      for (; j + 16 <= n; j += 16) {
        preempt_serve_vec::store16(y + j, _mm512_add_ps(preempt_serve_vec::load16(a + j),
                                                        preempt_serve_vec::load16(b + j)));
      }
#endif
      for (; j < n; ++j) {
        y[j] = static_cast<T>(static_cast<float>(a[j]) + static_cast<float>(b[j]));
      }
      norm_row(y, w, n, e, dst + row * n);
    }
  });
  return {sum, out};
}

at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm<at::BFloat16>(x, weight, eps, "rms_norm_bf16");
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_bf16(const at::Tensor& x, const at::Tensor& r,
                                                     const at::Tensor& weight, double eps) {
  return add_rms_norm<at::BFloat16>(x, r, weight, eps, "add_rms_norm_bf16");
}

// float32 rows: ATen's norm is seven small operators; this is one (the
// residual sum and norm of 32 rows of 576: 15 against 46 us on a Zen 3 core,
// studies/engine_cpu/README.md, "Around the matmuls on AVX2, float32").  Its
// sum of squares runs in another order than ATen's, so a value may differ
// from ATen's in its last bits; each row's still depends on that row alone.
at::Tensor rms_norm_f32(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm<float>(x, weight, eps, "rms_norm_f32");
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_f32(const at::Tensor& x, const at::Tensor& r,
                                                    const at::Tensor& weight, double eps) {
  return add_rms_norm<float>(x, r, weight, eps, "add_rms_norm_f32");
}

#ifdef PREEMPT_SERVE_VEC16
#define ROTARY_AVX512 1
using namespace preempt_serve_vec;
#elif defined(__AVX2__)
#include <immintrin.h>
#define ROTARY_AVX2 1
#endif

template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate_rows(
    const T* x, int64_t t_stride, int64_t h_stride, int64_t heads, int64_t dim, const T* cos_t,
    const T* sin_t, const int64_t* positions, int64_t tokens, T* out) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos_t + positions[t] * dim;
      const T* s = sin_t + positions[t] * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * t_stride + h * h_stride;
        T* yr = out + (t * heads + h) * dim;
        int64_t d = 0;
#ifdef ROTARY_AVX512
        // The same products and sums, 16 pairs at a time (no fused multiply-add).
        if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
          for (; d + 16 <= half; d += 16) {
            const __m512 x1 = load16(xr + d), x2 = load16(xr + d + half);
            const __m512 a = round16<T>(_mm512_mul_ps(x1, load16(c + d)));
            const __m512 b = round16<T>(
                _mm512_mul_ps(negate16(x2), load16(s + d)));
            store16(yr + d, _mm512_add_ps(a, b));
            const __m512 a2 = round16<T>(_mm512_mul_ps(x2, load16(c + d + half)));
            const __m512 b2 = round16<T>(_mm512_mul_ps(x1, load16(s + d + half)));
            store16(yr + d + half, _mm512_add_ps(a2, b2));
          }
        }
#endif
#ifdef ROTARY_AVX2
        // float32 rows 8 pairs at a time, the same products and sums.
        if constexpr (std::is_same_v<T, float>) {
          const __m256 sign = _mm256_set1_ps(-0.0f);
          for (; d + 8 <= half; d += 8) {
            const __m256 x1 = _mm256_loadu_ps(xr + d), x2 = _mm256_loadu_ps(xr + d + half);
            const __m256 a = _mm256_mul_ps(x1, _mm256_loadu_ps(c + d));
            const __m256 b = _mm256_mul_ps(_mm256_xor_ps(x2, sign), _mm256_loadu_ps(s + d));
            _mm256_storeu_ps(yr + d, _mm256_add_ps(a, b));
            const __m256 a2 = _mm256_mul_ps(x2, _mm256_loadu_ps(c + d + half));
            const __m256 b2 = _mm256_mul_ps(x1, _mm256_loadu_ps(s + d + half));
            _mm256_storeu_ps(yr + d + half, _mm256_add_ps(a2, b2));
          }
        }
#endif
        for (; d < half; ++d) {
          const float x1 = static_cast<float>(xr[d]), x2 = static_cast<float>(xr[d + half]);
          const float a = rnd<T>(x1 * static_cast<float>(c[d]));
          const float b = rnd<T>(-x2 * static_cast<float>(s[d]));
          yr[d] = static_cast<T>(a + b);
          const float a2 = rnd<T>(x2 * static_cast<float>(c[d + half]));
          const float b2 = rnd<T>(x1 * static_cast<float>(s[d + half]));
          yr[d + half] = static_cast<T>(a2 + b2);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& cos_table,
                                             const at::Tensor& sin_table,
                                             const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rotary_qk: q [T, H, D] and k [T, KVH, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) % 2 == 0,
              "rotary_qk: head rows contiguous, an even head dim");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos_table.scalar_type() == q.scalar_type() &&
                  sin_table.scalar_type() == q.scalar_type(),
              "rotary_qk: q, k and the tables share a dtype");
  TORCH_CHECK(cos_table.is_contiguous() && sin_table.is_contiguous() &&
                  cos_table.dim() == 2 && cos_table.size(1) == q.size(2) &&
                  sin_table.sizes() == cos_table.sizes(),
              "rotary_qk: contiguous [max_positions, D] tables");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.is_contiguous() && positions.size(0) == q.size(0),
              "rotary_qk: one int64 position per token");
  const int64_t tokens = q.size(0), dim = q.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_table.size(0),
                "rotary_qk: position ", pos[t], " beyond the tables");
  }
  at::Tensor q_out = at::empty({tokens, q.size(1), dim}, q.options());
  at::Tensor k_out = at::empty({tokens, k.size(1), dim}, k.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_qk", [&] {
    rotate_rows<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), q.size(1), dim,
                          cos_table.data_ptr<scalar_t>(), sin_table.data_ptr<scalar_t>(), pos,
                          tokens, q_out.data_ptr<scalar_t>());
    rotate_rows<scalar_t>(k.data_ptr<scalar_t>(), k.stride(0), k.stride(1), k.size(1), dim,
                          cos_table.data_ptr<scalar_t>(), sin_table.data_ptr<scalar_t>(), pos,
                          tokens, k_out.data_ptr<scalar_t>());
  });
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preempt_serve, m) {
  m.def("rms_norm_bf16(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_bf16(Tensor x, Tensor r, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_f32(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_f32(Tensor x, Tensor r, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_qk(Tensor q, Tensor k, Tensor cos_table, Tensor sin_table, Tensor positions) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) {
  m.impl("rms_norm_bf16", &rms_norm_bf16);
  m.impl("add_rms_norm_bf16", &add_rms_norm_bf16);
  m.impl("rms_norm_f32", &rms_norm_f32);
  m.impl("add_rms_norm_f32", &add_rms_norm_f32);
  m.impl("rotary_qk", &rotary_qk);
}
