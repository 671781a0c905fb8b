// 16 lanes of float32 or bfloat16 in an AVX512 vector, for the elementwise
// operators (norm_rotary.cpp, silu_mul.cpp): loads widen to float32, stores
// round to nearest even as c10::BFloat16 rounds (NaN to its 0x7FC0), so that
// a vector loop gives the bits of the scalar loop beside it.  The masked
// forms take the first n < 16 elements of a row's tail.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PREEMPT_SERVE_VEC16 1

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace preempt_serve_vec {

template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
  }
}

// The first n lanes (zero past them).
template <typename T>
inline __m512 load16(const T* p, int64_t n) {
  const __mmask16 m = static_cast<__mmask16>((1u << n) - 1u);
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {
    const __m256i x = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
  }
}

inline __m512i bf16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7FC0));
}

// -x, by its sign bit (as the scalar negation: -0 and NaN's sign too).
inline __m512 negate16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x),
                                              _mm512_set1_epi32(static_cast<int32_t>(0x80000000u))));
}

// x rounded to T and widened again.
template <typename T>
inline __m512 round16(__m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16));
  }
}

template <typename T>
inline void store16(T* p, __m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p, x);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
  }
}

// The first n lanes only.
template <typename T>
inline void store16(T* p, __m512 x, int64_t n) {
  const __mmask16 m = static_cast<__mmask16>((1u << n) - 1u);
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(p, m, x);
  } else {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(x)));
  }
}

}  // namespace preempt_serve_vec

#endif  // AVX512 F, BW, VL
