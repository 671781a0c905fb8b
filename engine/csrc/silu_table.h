// silu in AVX512 builds, shared by silu_mul.cpp and the fused SwiGLU
// projection (gemm_bf16_amx.h, gemm_swiglu): silu16, silu(x) of 16 lanes as
// ATen's AVX512 silu computes it (x / (1 + exp(-x)) with SLEEF's exp, which
// libtorch_cpu exports), and bf16_silu_table, silu's bf16 result for every
// one of the 65,536 bf16 values, indexed by its bits (built once, 128 KiB).
// One table for the whole library: an inline function's static is one
// object across the units that include it.
#pragma once

#include "vec16.h"

#ifdef PREEMPT_SERVE_VEC16
#include <ATen/ATen.h>
#include <immintrin.h>
#include <sleef.h>

#include <cstdint>
#include <vector>

namespace preempt_serve_silu {

inline __m512 silu16(__m512 x) {
  using namespace preempt_serve_vec;
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), Sleef_expf16_u10(negate16(x))));
}

// One entry more than 65,536, so that a gather's 4-byte read of the last
// entry stays inside.
inline const uint16_t* bf16_silu_table() {
  static const std::vector<uint16_t> table = [] {
    using namespace preempt_serve_vec;
    std::vector<uint16_t> t(65536 + 1);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int32_t i = 0; i < 65536; i += 16) {
      const __m512i bits = _mm512_add_epi32(_mm512_set1_epi32(i), lanes);
      store16(reinterpret_cast<at::BFloat16*>(t.data() + i),
              silu16(_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16))));
    }
    return t;
  }();
  return table.data();
}

}  // namespace preempt_serve_silu

#endif  // PREEMPT_SERVE_VEC16
