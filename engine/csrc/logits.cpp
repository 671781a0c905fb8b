// The greedy argmax of a step's logits on CPU, which ATen's reduction takes
// at about 2 GB/s on one core (float32) and slower still on bfloat16.  A
// bfloat16 model's logits are read as they leave the lm_head, without the
// float32 copy of every row (5-6 ms of a batch-96 SmolLM2 step): widening
// bfloat16 to float32 is exact and keeps the order, so the index is the one
// argmax of the float32 copy would give.  Rounding is monotonic, so the
// rounded logits never order two tokens against their exact values; they only
// tie them, and `argmax_rows_exact` breaks a tie at the top by the exact
// logits.  Registered next to paged_decode in the preempt_serve namespace
// (engine/cpp_ops.py builds both into one library).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec16.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

// The first index of the row's largest value, NaN counting as largest, as
// torch.argmax has it.  `*tied` tells whether that value occurs again (never
// for a NaN).
template <typename T>
int64_t argmax_scalar(const T* row, int64_t n, bool* tied) {
  int64_t best = 0;
  float best_v = widen(row[0]);
  bool twice = false;
  *tied = false;
  if (std::isnan(best_v)) return 0;
  for (int64_t j = 1; j < n; ++j) {
    const float v = widen(row[j]);
    if (std::isnan(v)) {
      *tied = false;
      return j;
    }
    if (v > best_v) {
      best = j;
      best_v = v;
      twice = false;
    } else if (v == best_v) {
      twice = true;
    }
  }
  *tied = twice;
  return best;
}

// Two vectorizable passes (the largest value, then whether any is NaN) and
// a scan for the first index holding it.
template <typename T>
int64_t argmax_portable(const T* row, int64_t n, bool* tied) {
  float m = widen(row[0]);
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t j = 0; j < n; ++j) {
    const float v = widen(row[j]);
    m = v > m ? v : m;
    nan |= v != v;
  }
  if (nan) return argmax_scalar(row, n, tied);
  int64_t first = -1;
  for (int64_t j = 0; j < n; ++j) {
    if (widen(row[j]) == m) {
      if (first >= 0) {
        *tied = true;
        return first;
      }
      first = j;
    }
  }
  *tied = false;
  return first < 0 ? 0 : first;
}

// The vector paths' end: the lanes gave `found` (value `found_v`, met
// again if `twice`); the elements [j, n) past the last whole vector go on
// from there.
template <typename T>
int64_t argmax_tail(const T* row, int64_t j, int64_t n, int64_t found, float found_v,
                    bool twice, bool* tied) {
  for (; j < n; ++j) {
    const float v = widen(row[j]);
    if (std::isnan(v)) {
      *tied = false;
      return j;
    }
    if (v > found_v) {
      found = j;
      found_v = v;
      twice = false;
    } else if (v == found_v) {
      twice = true;
    }
  }
  *tied = twice;
  return found;
}

#if defined(PREEMPT_SERVE_VEC16)
// 16 lanes, each keeping its largest value and the first index it was seen
// at; the lanes are then merged by value, ties to the lowest index.
template <typename T>
int64_t argmax_avx512(const T* row, int64_t n, bool* tied) {
  using preempt_serve_vec::load16;
  if (n < 16 || n >= (int64_t{1} << 31)) return argmax_scalar(row, n, tied);
  __m512 best = load16(row);
  __m512i best_idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i idx = best_idx;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  // Lanes that have met their current best value more than once.
  __mmask16 again = 0;
  int64_t j = 16;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = load16(row + j);
    idx = _mm512_add_epi32(idx, step);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    again = (again & ~gt) | _mm512_cmp_ps_mask(v, best, _CMP_EQ_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  if (nan) return argmax_scalar(row, n, tied);
  const float m = _mm512_reduce_max_ps(best);
  const __mmask16 at_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
  int64_t found = _mm512_mask_reduce_min_epi32(at_max, best_idx);
  bool twice = (at_max & (at_max - 1)) != 0 || (again & at_max) != 0;
  return argmax_tail(row, j, n, found, widen(row[found]), twice, tied);
}
#endif

#if !defined(PREEMPT_SERVE_VEC16) && defined(__AVX2__)
// argmax_avx512's lanes on AVX2: two sets of eight (so that the compare and
// blend of one set overlap the other's), merged the same way.  The portable
// loops ran at about 2.4 ns a float32 logit on a Zen 3 core, 3.7 ms of a
// batch-32 SmolLM2 step; this runs at about an eighth of that
// (studies/engine_cpu/layer_ops.py).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}

// Lane l: the index j + l.
inline __m256i lane_index8(int64_t j) {
  return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(j)),
                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// One set of lanes: each lane's largest value, the first index it was seen
// at, whether it was seen again, and whether any value was NaN.
struct Lanes8 {
  __m256 best, again, nan;
  __m256i idx;

  template <typename T>
  void start(const T* row, int64_t j) {
    best = load8(row + j);
    idx = lane_index8(j);
    again = _mm256_setzero_ps();
    nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
  }

  __attribute__((always_inline)) void take(__m256 v, int64_t j) {
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    again = _mm256_or_ps(_mm256_andnot_ps(gt, again), _mm256_cmp_ps(v, best, _CMP_EQ_OQ));
    best = _mm256_blendv_ps(best, v, gt);
    idx = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(idx), _mm256_castsi256_ps(lane_index8(j)), gt));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
};

template <typename T>
int64_t argmax_avx2(const T* row, int64_t n, bool* tied) {
  if (n < 16 || n >= (int64_t{1} << 31)) return argmax_scalar(row, n, tied);
  Lanes8 a, b;
  a.start(row, 0);
  b.start(row, 8);
  int64_t j = 16;
  for (; j + 16 <= n; j += 16) {
    a.take(load8(row + j), j);
    b.take(load8(row + j + 8), j + 8);
  }
  if (_mm256_movemask_ps(_mm256_or_ps(a.nan, b.nan)) != 0) return argmax_scalar(row, n, tied);
  alignas(32) float best[16], again[16];
  alignas(32) int32_t idx[16];
  _mm256_store_ps(best, a.best);
  _mm256_store_ps(best + 8, b.best);
  _mm256_store_ps(again, a.again);
  _mm256_store_ps(again + 8, b.again);
  _mm256_store_si256(reinterpret_cast<__m256i*>(idx), a.idx);
  _mm256_store_si256(reinterpret_cast<__m256i*>(idx + 8), b.idx);
  // The lanes by value, ties to the lowest index; a value met twice in one
  // lane, or in two lanes, is tied.
  float m = best[0];
  for (int l = 1; l < 16; ++l) m = best[l] > m ? best[l] : m;
  int64_t found = n;
  int at_max = 0;
  bool twice = false;
  for (int l = 0; l < 16; ++l) {
    if (best[l] != m) continue;
    ++at_max;
    twice = twice || again[l] != 0.0f;
    found = std::min<int64_t>(found, idx[l]);
  }
  return argmax_tail(row, j, n, found, m, twice || at_max > 1, tied);
}
#endif

template <typename T>
int64_t argmax_row(const T* row, int64_t n, bool* tied) {
#if defined(PREEMPT_SERVE_VEC16)
  return argmax_avx512(row, n, tied);
#elif defined(__AVX2__)
  return argmax_avx2(row, n, tied);
#else
  return argmax_portable(row, n, tied);
#endif
}

template <typename T>
void argmax_into(const T* src, int64_t* dst, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    bool tied;
    for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(src + r * n, n, &tied);
  });
}

// A logit as the lm_head computes it before rounding to the model's dtype:
// the dot product of the row's hidden state and the token's head row,
// accumulated in float32 in one fixed order (so per row, whatever the batch).
template <typename W>
float exact_logit(const W* h, const W* w, int64_t dim) {
  float acc = 0.0f;
  for (int64_t d = 0; d < dim; ++d) acc += widen(h[d]) * widen(w[d]);
  return acc;
}

// argmax_into, but where a row's largest value occurs at several indices
// (a bfloat16 lm_head rounds logits a few hundredths apart to one value, at
// SmolLM2's magnitudes 1/16-1/8 apart), the index of the largest exact logit
// among them (ties of those to the lowest index).
template <typename T, typename W>
void argmax_exact_into(const T* src, const W* hidden, const W* weight, int64_t* dst,
                       int64_t rows, int64_t n, int64_t dim) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = src + r * n;
      bool tied = false;
      int64_t best = argmax_row(row, n, &tied);
      if (tied) {
        const float m = widen(row[best]);
        const W* h = hidden + r * dim;
        float best_exact = exact_logit(h, weight + best * dim, dim);
        for (int64_t j = best + 1; j < n; ++j) {
          if (widen(row[j]) != m) continue;
          const float e = exact_logit(h, weight + j * dim, dim);
          if (e > best_exact) {
            best = j;
            best_exact = e;
          }
        }
      }
      dst[r] = best;
    }
  });
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 2,
              "argmax_rows: a 2-D float32 or bfloat16 tensor");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows must not be empty");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  at::Tensor out = at::empty({rows}, xc.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  if (xc.scalar_type() == at::kFloat) {
    argmax_into(xc.data_ptr<float>(), dst, rows, n);
  } else {
    argmax_into(xc.data_ptr<at::BFloat16>(), dst, rows, n);
  }
  return out;
}

at::Tensor argmax_rows_exact(const at::Tensor& x, const at::Tensor& hidden,
                             const at::Tensor& weight) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 2,
              "argmax_rows_exact: 2-D float32 or bfloat16 logits");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows_exact: rows must not be empty");
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(0) >= x.size(0) &&
                  weight.size(0) == x.size(1) && hidden.size(1) == weight.size(1) &&
                  hidden.scalar_type() == weight.scalar_type() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "argmax_rows_exact: hidden [rows, dim] and weight [vocab, dim] of one dtype");
  const at::Tensor xc = x.contiguous(), hc = hidden.contiguous(), wc = weight.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1), dim = wc.size(1);
  at::Tensor out = at::empty({rows}, xc.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  auto run = [&](auto* src) {
    if (wc.scalar_type() == at::kFloat) {
      argmax_exact_into(src, hc.data_ptr<float>(), wc.data_ptr<float>(), dst, rows, n, dim);
    } else {
      argmax_exact_into(src, hc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), dst,
                        rows, n, dim);
    }
  };
  if (xc.scalar_type() == at::kFloat) {
    run(xc.data_ptr<float>());
  } else {
    run(xc.data_ptr<at::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preempt_serve, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("argmax_rows_exact(Tensor x, Tensor hidden, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("argmax_rows_exact", &argmax_rows_exact);
}
