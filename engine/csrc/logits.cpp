// The greedy argmax of a step's logits on CPU, which ATen's reduction takes
// at about 2 GB/s on one core (float32) and slower still on bfloat16.  A
// bfloat16 model's logits are read as they leave the lm_head, without the
// float32 copy of every row (5-6 ms of a batch-96 SmolLM2 step): widening
// bfloat16 to float32 is exact and keeps the order, so the index is the one
// argmax of the float32 copy would give.  Registered next to paged_decode in
// the preempt_serve namespace (engine/attention_cpp.py builds both into one
// library).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "vec16.h"

namespace {

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

// The first index of the row's largest value, NaN counting as largest, as
// torch.argmax has it.
template <typename T>
int64_t argmax_scalar(const T* row, int64_t n) {
  int64_t best = 0;
  float best_v = widen(row[0]);
  for (int64_t j = 0; j < n; ++j) {
    const float v = widen(row[j]);
    if (std::isnan(v)) return j;
    if (v > best_v) {
      best = j;
      best_v = v;
    }
  }
  return best;
}

// Two vectorizable passes (the largest value, then whether any is NaN) and
// a scan for the first index holding it.
template <typename T>
int64_t argmax_portable(const T* row, int64_t n) {
  float m = widen(row[0]);
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t j = 0; j < n; ++j) {
    const float v = widen(row[j]);
    m = v > m ? v : m;
    nan |= v != v;
  }
  if (nan) return argmax_scalar(row, n);
  for (int64_t j = 0; j < n; ++j) {
    if (widen(row[j]) == m) return j;
  }
  return 0;
}

#if defined(PREEMPT_SERVE_VEC16)
// 16 lanes, each keeping its largest value and the first index it was seen
// at; the lanes are then merged by value, ties to the lowest index.
template <typename T>
int64_t argmax_avx512(const T* row, int64_t n) {
  using preempt_serve_vec::load16;
  if (n < 16 || n >= (int64_t{1} << 31)) return argmax_scalar(row, n);
  __m512 best = load16(row);
  __m512i best_idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i idx = best_idx;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  int64_t j = 16;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = load16(row + j);
    idx = _mm512_add_epi32(idx, step);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  if (nan) return argmax_scalar(row, n);
  const float m = _mm512_reduce_max_ps(best);
  const __mmask16 at_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
  int64_t found = _mm512_mask_reduce_min_epi32(at_max, best_idx);
  // The tail past the last whole vector.
  float found_v = widen(row[found]);
  for (; j < n; ++j) {
    const float v = widen(row[j]);
    if (std::isnan(v)) return j;
    if (v > found_v) {
      found = j;
      found_v = v;
    }
  }
  return found;
}
#endif

template <typename T>
void argmax_into(const T* src, int64_t* dst, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#if defined(PREEMPT_SERVE_VEC16)
      dst[r] = argmax_avx512(src + r * n, n);
#else
      dst[r] = argmax_portable(src + r * n, n);
#endif
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(preempt_serve, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
}
