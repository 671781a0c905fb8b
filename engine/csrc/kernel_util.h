// Helpers the CPU operators share (paged_decode.cpp, paged_prefill.cpp,
// sample_rows.cpp).
//
// prefetch_span: asks for every cache line of a span, for data at an
// unpredictable place (a cache block) that is needed soon.
//
// exp_nonpositive16 (AVX512 builds), exp_nonpositive8 (AVX2 + FMA builds):
// exp(x) for x <= 0 on 16 / 8 float32 lanes
// (scores minus their maximum are never positive; the prefill operator's
// exceed a running maximum by at most 8, where the same reduction and
// accuracy hold): 2^n * e^r with
// |r| <= ln2/2 and a degree-7 polynomial, relative error ~1e-7; inputs below
// -87 are clamped there (a weight of ~1.6e-38; where a caller needs an exact
// zero it masks).  exp_nonpositive (every build) is the same reduction and
// polynomial on one float.  exp2_nonpositive16_for_bf16 (AVX512 builds):
// 2^y for y <= 0 to ~3e-6 relative, for weights rounded to bf16 next.
// first_lanes / max_of (AVX512 builds): the mask
// of a vector's first n lanes; the largest of n floats.
#pragma once

#include <cstdint>
#include <cstring>

namespace preempt_serve_vec {

// exp_nonpositive's constants, which the vector forms below share: log2(e),
// ln 2 in two parts (exact high bits, then the rest), the polynomial's
// coefficients from the highest degree down.
constexpr float kExpLog2e = 1.44269504088896341f;
constexpr float kExpLn2Hi = 0.693359375f;
constexpr float kExpLn2Lo = 2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// exp(x) for x <= 0 (scores minus their running max): 2^n * e^r with
// |r| <= ln2/2 and a degree-7 polynomial; relative error ~1e-7.  Written
// without library calls so that the compiler vectorizes the loop using it
// (paged_decode.cpp's scalar path, sample_rows.cpp).
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = __builtin_floorf(x * kExpLog2e + 0.5f);
  const float r = x - n * kExpLn2Hi + n * kExpLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o);
}

}  // namespace preempt_serve_vec

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>

namespace preempt_serve_vec {

inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kExpLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(kExpLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// 2^y for y <= 0 (scores minus their maximum, in base 2), for weights that
// are rounded to bf16 next (the AMX prefill's p, paged_prefill_amx.h): n = y
// rounded, 2^(y - n) = 1 + f (c1 + f (c2 + f (c3 + f c4))) with f in
// [-1/2, 1/2], fitted for the least largest relative error (2.9e-6, against
// bf16's half step of 2^-9: the rounding lands elsewhere than exp's exact
// value's for ~0.15% of weights, one bf16 step), exactly 1 at y = 0, then
// scaled by 2^n.  Against exp_nonpositive16 it leaves out the multiply by
// log2(e) (folded into the caller's scale), the two-part reduction and three
// of the polynomial's terms.  Inputs below -126 are clamped there (a weight
// of ~1.2e-38; where a caller needs an exact zero it masks).
inline __m512 exp2_nonpositive16_for_bf16(__m512 y) {
  y = _mm512_max_ps(y, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(9.58281849e-3f), f, _mm512_set1_ps(5.59063703e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40240991e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93124175e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The first n lanes' mask of a 16-lane vector (all of them for n >= 16).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : (n > 0 ? static_cast<__mmask16>((1u << n) - 1u) : static_cast<__mmask16>(0));
}

// The largest of s[0..n), n >= 1.
inline float max_of(const float* s, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  __m512 mv = neg_inf;
  for (int64_t j = 0; j < n; j += 16) {
    mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(neg_inf, first_lanes(n - j), s + j));
  }
  return _mm512_reduce_max_ps(mv);
}

}  // namespace preempt_serve_vec

#endif  // AVX512

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace preempt_serve_vec {

// exp_nonpositive16 on 8 lanes; 2^n built in the
// exponent bits (n >= -126 after the clamp: a normal float).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kExpLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(kExpLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

}  // namespace preempt_serve_vec

#endif  // AVX2 + FMA
