// SwiGLU's elementwise half on CPU: silu(gate) * up, with gate and up side
// by side in each row of one GEMM's output (engine/models/llama.py), in one
// pass instead of ATen's silu over a strided half, then a multiply.  It
// rounds where those ops round: silu(gate) to the model dtype, then the
// product.  silu(x) = x / (1 + exp(-x)) as ATen computes it; an AVX512 build
// takes exp from the SLEEF function ATen's own AVX512 silu calls
// (Sleef_expf16_u10, exported by libtorch_cpu) for every element, a row's
// tail included; an AVX2 build does the same for float32 rows, eight lanes
// at a time with Sleef_expf8_u10 (ATen's AVX2 silu); other cases use
// std::exp.  Each element depends on its own inputs only, so the result
// does not depend on the batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "vec16.h"

#if defined(PREEMPT_SERVE_VEC16) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <sleef.h>
#endif

namespace {

template <typename T>
void silu_mul_rows(const T* y, int64_t stride, int64_t rows, int64_t n, T* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = y + r * stride;
      const T* u = g + n;
      T* o = out + r * n;
      int64_t j = 0;
#ifdef PREEMPT_SERVE_VEC16
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
        using namespace preempt_serve_vec;
        const __m512 one = _mm512_set1_ps(1.0f);
        // Two vectors a turn: their exps and divisions overlap (1.1-1.3x the
        // operator on a Xeon with AMX, studies/engine_cpu/README.md).
        for (; j + 32 <= n; j += 32) {
          const __m512 x0 = load16(g + j), x1 = load16(g + j + 16);
          const __m512 e0 = Sleef_expf16_u10(negate16(x0));
          const __m512 e1 = Sleef_expf16_u10(negate16(x1));
          const __m512 s0 = round16<T>(_mm512_div_ps(x0, _mm512_add_ps(one, e0)));
          const __m512 s1 = round16<T>(_mm512_div_ps(x1, _mm512_add_ps(one, e1)));
          store16(o + j, _mm512_mul_ps(s0, load16(u + j)));
          store16(o + j + 16, _mm512_mul_ps(s1, load16(u + j + 16)));
        }
        for (; j < n; j += 16) {
          const int64_t left = n - j;
          const __m512 x = left >= 16 ? load16(g + j) : load16(g + j, left);
          const __m512 up = left >= 16 ? load16(u + j) : load16(u + j, left);
          const __m512 s = round16<T>(
              _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(negate16(x)))));
          if (left >= 16) {
            store16(o + j, _mm512_mul_ps(s, up));
          } else {
            store16(o + j, _mm512_mul_ps(s, up), left);
          }
        }
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, float>) {
        const __m256 one = _mm256_set1_ps(1.0f);
        const __m256 sign = _mm256_set1_ps(-0.0f);
        const auto product = [&](__m256 x, __m256 up) {
          return _mm256_mul_ps(
              _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(x, sign)))), up);
        };
        for (; j + 8 <= n; j += 8) {
          _mm256_storeu_ps(o + j, product(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
        }
        if (j < n) {
          // The tail through a buffer, so that it too gets SLEEF's exp
          // (masked stores are slow on some AVX2 cores).
          alignas(32) float x[8] = {}, up[8] = {}, out[8];
          std::copy(g + j, g + n, x);
          std::copy(u + j, u + n, up);
          _mm256_store_ps(out, product(_mm256_load_ps(x), _mm256_load_ps(up)));
          std::copy(out, out + (n - j), o + j);
          j = n;
        }
      }
#endif
      for (; j < n; ++j) {
        const float x = static_cast<float>(g[j]);
        const float s = static_cast<float>(static_cast<T>(x / (1.0f + std::exp(-x))));
        o[j] = static_cast<T>(s * static_cast<float>(u[j]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& y) {
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.size(1) % 2 == 0,
              "silu_mul: y [T, 2n] (gate, then up), rows contiguous");
  const int64_t rows = y.size(0), n = y.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, y.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(y.data_ptr<scalar_t>(), y.stride(0), rows, n,
                            out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preempt_serve, m) {
  m.def("silu_mul(Tensor y) -> Tensor");
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) {
  m.impl("silu_mul", &silu_mul);
}
