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
//
// bfloat16 gates on AVX512: a gate has only 65,536 values, so silu's bf16
// result for each is computed once (the SLEEF loop below, over every bit
// pattern) into a 128 KiB table, and a row's gates are looked up 16 at a
// time by one gather: the same bits as the computed loop for every gate and
// up, 1.5-1.8x its rate from 8 rows to 2,048 on a Xeon with AMX
// (studies/engine_cpu/README.md, "SiLU of a bf16 gate by table").

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "silu_table.h"
#include "vec16.h"

#if defined(PREEMPT_SERVE_VEC16) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <sleef.h>
#endif

namespace {

#ifdef PREEMPT_SERVE_VEC16
using preempt_serve_silu::bf16_silu_table;
using preempt_serve_silu::silu16;

// Whether bf16 rows look silu up in the table (preempt_serve::set_silu_by_table:
// studies time it against the computed loop in one process).
std::atomic<bool>& by_table_switch() {
  static std::atomic<bool> on{true};
  return on;
}

// One row of bf16 gates and ups: silu(gate) from the table, widened, times up.
void silu_mul_bf16_row(const at::BFloat16* g, const at::BFloat16* u, int64_t n,
                       at::BFloat16* o, const uint16_t* table) {
  using namespace preempt_serve_vec;
  const auto silu = [&](__m256i gates) {
    const __m512i s = _mm512_i32gather_epi32(_mm512_cvtepu16_epi32(gates), table, 2);
    return _mm512_castsi512_ps(_mm512_slli_epi32(s, 16));
  };
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256i gates = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + j));
    store16(o + j, _mm512_mul_ps(silu(gates), load16(u + j)));
  }
  if (j < n) {
    // Lanes past the row's end look up entry 0 and are not stored.
    const int64_t left = n - j;
    const __mmask16 m = static_cast<__mmask16>((1u << left) - 1u);
    const __m256i gates = _mm256_maskz_loadu_epi16(m, g + j);
    store16(o + j, _mm512_mul_ps(silu(gates), load16(u + j, left)), left);
  }
}
#endif

template <typename T>
void silu_mul_rows(const T* y, int64_t stride, int64_t rows, int64_t n, T* out) {
#ifdef PREEMPT_SERVE_VEC16
  [[maybe_unused]] const uint16_t* table =
      std::is_same_v<T, at::BFloat16> && by_table_switch().load(std::memory_order_relaxed)
          ? bf16_silu_table()
          : nullptr;
#endif
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = y + r * stride;
      const T* u = g + n;
      T* o = out + r * n;
      int64_t j = 0;
#ifdef PREEMPT_SERVE_VEC16
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (table != nullptr) {
          silu_mul_bf16_row(g, u, n, o, table);
          j = n;
        }
      }
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
        using namespace preempt_serve_vec;
        // Two vectors a turn, so that their exps and divisions overlap
        // (studies/engine_cpu/README.md, "The work around the matmuls").
        for (; j + 32 <= n; j += 32) {
          const __m512 x0 = load16(g + j), x1 = load16(g + j + 16);
          store16(o + j, _mm512_mul_ps(round16<T>(silu16(x0)), load16(u + j)));
          store16(o + j + 16, _mm512_mul_ps(round16<T>(silu16(x1)), load16(u + j + 16)));
        }
        for (; j < n; j += 16) {
          const int64_t left = n - j;
          const __m512 x = left >= 16 ? load16(g + j) : load16(g + j, left);
          const __m512 up = left >= 16 ? load16(u + j) : load16(u + j, left);
          const __m512 s = round16<T>(silu16(x));
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

// Whether bf16 rows take the table from now on; returns whether this build
// has it (an AVX512 one).
bool set_silu_by_table(bool enable) {
#ifdef PREEMPT_SERVE_VEC16
  by_table_switch().store(enable);
  return true;
#else
  (void)enable;
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preempt_serve, m) {
  m.def("silu_mul(Tensor y) -> Tensor");
  m.def("set_silu_by_table(bool enable) -> bool", &set_silu_by_table);
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) {
  m.impl("silu_mul", &silu_mul);
}
