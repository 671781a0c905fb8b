// 16 lanes of float32 or bfloat16 in an AVX512 vector, for the elementwise
// operators (norm_rotary.cpp, silu_mul.cpp): loads widen to float32, stores
// round to nearest even as c10::BFloat16 rounds (NaN to its 0x7FC0), so that
// a vector loop gives the bits of the scalar loop beside it.  The masked
// forms take the first n < 16 elements of a row's tail.  transpose16: a
// 16 x 16 block of 32-bit words (the prefill operator's [dim][rows] sums
// back into rows, its values' pairs of keys into the tiles' layout).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PREEMPT_SERVE_VEC16 1

#include <immintrin.h>

#include <atomic>
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

// Asks for p's cache line in the exclusive state (PREFETCHW: every CPU with
// AVX512 has it), for an output about to be stored into fresh memory: the
// stores then find their lines in cache instead of each waiting on its read
// for ownership (the GEMM's and the prefill operator's outputs).
inline void claim(const void* p) {
  asm volatile("prefetchw %0" : : "m"(*static_cast<const char*>(p)));
}

// Whether the operators claim their outputs (preempt_serve::set_output_claims:
// studies time them both ways in one process).
inline std::atomic<bool>& claims_switch() {
  static std::atomic<bool> on{true};
  return on;
}
inline bool claims_on() { return claims_switch().load(std::memory_order_relaxed); }

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

#ifdef __AVX512BF16__
// x rounded to bf16 to nearest even and widened again, on the CPU's own
// conversion (round16<at::BFloat16> for x that is not NaN).
inline __m512 bf16_round(__m512 x) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

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

// 16 x 16 words transposed in place: pairs of words, then pairs of pairs
// within each 128-bit lane, then the four lanes of four vectors.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + c], lane L: rows 4g..4g+3 of column 4L + c.
  __m512i u[16];
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i e = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i f = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(a, e, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);
  }
}

}  // namespace preempt_serve_vec

#endif  // AVX512 F, BW, VL
