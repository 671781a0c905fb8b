// Sampling at a temperature on CPU, for rows nothing else changes (no
// bias, bans, penalties, grammar, min_p, top-k or top-p): the inverse of the
// row's cumulative distribution at the row's uniform variate u, as
// engine/sampling.py draws every random row, in two passes over the row's
// logits instead of ATen's six (the row copy, the division by the
// temperature, softmax's three, the float64 copy and its running sum):
//
// 1. the row's largest logit m;
// 2. w_j = exp((x_j - m) / T) for every token, summed per block of 64 tokens
//    in float32 and the blocks' sums kept (a few hundred doubles), their
//    total accumulated in float64;
//
// then the first block whose running sum exceeds u * total, and within it
// the first token whose running sum does.  The block sums are kept, not
// recomputed, so the walk over them ends exactly at the total and u < 1
// always lands inside the row.  Within the chosen block the float64 running
// sum of its weights may fall short of its float32 sum by a rounding; the
// block's last token of nonzero weight then takes the draw.  A token whose
// logit is -inf has weight 0 and is never drawn.  exp is exp_nonpositive
// (kernel_util.h), relative error ~1e-7, the same on every machine this
// builds on up to the compiler's vectorization of the block sums.
//
// A logit of bfloat16 is read as it is (widened to float32 exactly), so a
// bfloat16 model's logits need no float32 copy.  A row without a finite
// largest logit (all -inf, or NaN, or +inf) draws its argmax: what the
// distribution degenerates to.  Registered in the preempt_serve namespace
// beside argmax_rows (logits.cpp, same translation unit).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernel_util.h"

namespace {

using preempt_serve_vec::exp_nonpositive;

constexpr int64_t kBlock = 64;

inline float weight_of(float x, float m, float inv_t) {
  return x == -std::numeric_limits<float>::infinity() ? 0.0f
                                                      : exp_nonpositive((x - m) * inv_t);
}

template <typename T>
int64_t sample_row(const T* row, int64_t n, float inv_t, double u, std::vector<double>& sums) {
  float m = -std::numeric_limits<float>::infinity();
  int bad = 0;
#pragma omp simd reduction(max : m) reduction(| : bad)
  for (int64_t j = 0; j < n; ++j) {
    const float v = widen(row[j]);
    m = v > m ? v : m;
    bad |= (v != v) | (v == std::numeric_limits<float>::infinity());
  }
  if (bad || !std::isfinite(m)) {
    bool tied;
    return argmax_row(row, n, &tied);
  }
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  sums.resize(static_cast<size_t>(blocks));
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kBlock, hi = lo + kBlock < n ? lo + kBlock : n;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = lo; j < hi; ++j) s += weight_of(widen(row[j]), m, inv_t);
    sums[static_cast<size_t>(b)] = s;
    total += s;
  }
  const double target = u * total;
  double run = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const double s = sums[static_cast<size_t>(b)];
    if (run + s > target || b == blocks - 1) {
      const int64_t lo = b * kBlock, hi = lo + kBlock < n ? lo + kBlock : n;
      int64_t last = -1;
      for (int64_t j = lo; j < hi; ++j) {
        const float w = weight_of(widen(row[j]), m, inv_t);
        if (w > 0.0f) last = j;
        run += w;
        if (run > target && w > 0.0f) return j;
      }
      if (last >= 0) return last;
      // A block of zero weights cannot hold the target; the row's argmax
      // (weight 1) is never in one.
      bool tied;
      return argmax_row(row, n, &tied);
    }
    run += s;
  }
  bool tied;
  return argmax_row(row, n, &tied);
}

template <typename T>
void sample_into(const T* src, int64_t n, const int64_t* rows, const float* inv_t,
                 const double* u, int64_t* dst, int64_t count) {
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> sums;
    for (int64_t i = begin; i < end; ++i) {
      dst[i] = sample_row(src + rows[i] * n, n, inv_t[i], u[i], sums);
    }
  });
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& rows,
                       const at::Tensor& inv_temperature, const at::Tensor& u) {
  TORCH_CHECK((logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) &&
                  logits.dim() == 2 && logits.size(1) > 0,
              "sample_rows: 2-D float32 or bfloat16 logits");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "sample_rows: int64 rows");
  const int64_t count = rows.size(0);
  TORCH_CHECK(inv_temperature.scalar_type() == at::kFloat && inv_temperature.numel() == count,
              "sample_rows: one float32 inverse temperature per row");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.numel() == count,
              "sample_rows: one float64 uniform variate per row");
  const at::Tensor xc = logits.contiguous(), rc = rows.contiguous();
  const at::Tensor tc = inv_temperature.contiguous(), uc = u.contiguous();
  const int64_t n = xc.size(1);
  const int64_t* r = rc.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < xc.size(0), "sample_rows: a row index out of range");
  }
  at::Tensor out = at::empty({count}, xc.options().dtype(at::kLong));
  if (xc.scalar_type() == at::kFloat) {
    sample_into(xc.data_ptr<float>(), n, r, tc.data_ptr<float>(), uc.data_ptr<double>(),
                out.data_ptr<int64_t>(), count);
  } else {
    sample_into(xc.data_ptr<at::BFloat16>(), n, r, tc.data_ptr<float>(), uc.data_ptr<double>(),
                out.data_ptr<int64_t>(), count);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preempt_serve, m) {
  m.def("sample_rows(Tensor logits, Tensor rows, Tensor inv_temperature, Tensor u) -> Tensor");
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) { m.impl("sample_rows", &sample_rows); }
