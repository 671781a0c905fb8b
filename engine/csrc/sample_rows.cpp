// Sampling on CPU for the rows no bias, ban, penalty or grammar changes:
// temperature, then min_p, top-k and top-p as engine/sampling.py applies
// them, then the inverse of the kept tokens' cumulative distribution at the
// row's uniform variate u, as engine/sampling.py draws every random row.
//
// Without top-k and top-p it takes two passes over the row's logits instead
// of ATen's six (the row copy, the division by the temperature, softmax's
// three, the float64 copy and its running sum):
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
// logit is -inf, or whose key is below ln(min_p), has weight 0 and is never
// drawn.  exp is exp_nonpositive
// (kernel_util.h), relative error ~1e-7, the same on every machine this
// builds on up to the compiler's vectorization of the block sums.
//
// With top-k or top-p (`sample_truncated`), a vectorized pass writes every
// token's key (x - m) / T, weight and bucket (1/16 nat steps below the
// largest key) to a scratch row, and a second counts and weighs the
// buckets.  Every token of a bucket before the one holding the k-th largest
// key is in the top k, and only that bucket's tokens are sorted (by key,
// ties by index) to cut it exactly, ties with the k-th kept.  Then top-p: a
// token stays if the kept weight of larger keys is below top_p of the kept
// weight (of the row's whole weight without top-k), the first always staying
// and equal keys together (as the GPU's cuts, engine/top_k_top_p.py);
// every token of a bucket before the one where that weight is reached stays,
// and only that bucket's tokens are sorted to find the last.  min_p drops a
// key below ln(min_p).  The draw runs over the kept tokens in index order, as
// over the masked row, whatever the distribution's shape: a flat row whose
// nucleus holds thousands of tokens sorts one bucket of them.
//
// A logit of bfloat16 is read as it is (widened to float32 exactly), so a
// bfloat16 model's logits need no float32 copy.  A row without a finite
// largest logit (all -inf, or NaN, or +inf) draws its argmax: what the
// distribution degenerates to.  Registered in the preempt_serve namespace
// beside argmax_rows (logits.cpp, same translation unit).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "kernel_util.h"

namespace {

using preempt_serve_vec::exp_nonpositive;

constexpr int64_t kBlock = 64;

// A token's weight exp((x - m) / T), 0 for a logit of -inf or a key below
// `floor` (min_p's ln(min_p)).
inline float weight_of(float x, float m, float inv_t, float floor) {
  const float key = (x - m) * inv_t;
  return x == -std::numeric_limits<float>::infinity() || key < floor ? 0.0f
                                                                      : exp_nonpositive(key);
}

template <typename T>
float row_max(const T* row, int64_t n, bool* bad_out) {
  float m = -std::numeric_limits<float>::infinity();
  int bad = 0;
#pragma omp simd reduction(max : m) reduction(| : bad)
  for (int64_t j = 0; j < n; ++j) {
    const float v = widen(row[j]);
    m = v > m ? v : m;
    bad |= (v != v) | (v == std::numeric_limits<float>::infinity());
  }
  *bad_out = bad || !std::isfinite(m);
  return m;
}

template <typename T>
int64_t sample_row(const T* row, int64_t n, float m, float inv_t, float floor, double u,
                   std::vector<double>& sums) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  sums.resize(static_cast<size_t>(blocks));
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kBlock, hi = lo + kBlock < n ? lo + kBlock : n;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = lo; j < hi; ++j) s += weight_of(widen(row[j]), m, inv_t, floor);
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
        const float w = weight_of(widen(row[j]), m, inv_t, floor);
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

constexpr int kBuckets = 512;
constexpr float kBucketsPerNat = 16.0f;  // keys below -32 share the last bucket

// SampleScratch of one thread: each token's key and weight, and its bucket.
struct SampleScratch {
  std::vector<float> key, weight;
  std::vector<int16_t> bucket;
  std::vector<std::pair<float, int64_t>> cand;
};

template <typename T>
int64_t sample_truncated(const T* row, int64_t n, float m, float inv_t, int64_t top_k,
                         float top_p, float min_p, double u, SampleScratch& sc) {
  const float floor = min_p > 0.0f ? std::log(min_p) : -std::numeric_limits<float>::infinity();
  const float ninf = -std::numeric_limits<float>::infinity();
  sc.key.resize(static_cast<size_t>(n));
  sc.weight.resize(static_cast<size_t>(n));
  sc.bucket.resize(static_cast<size_t>(n));
  float* key = sc.key.data();
  float* weight = sc.weight.data();
  int16_t* bucket = sc.bucket.data();
  // Vectorizable: keys, weights (0 for a dropped token) and buckets.
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float x = widen(row[j]);
    const float k = (x - m) * inv_t;
    const bool drop = x == ninf || k < floor;
    key[j] = drop ? ninf : k;
    weight[j] = drop ? 0.0f : exp_nonpositive(k);
    // 1/16-nat steps below the largest key; a dropped token in a bucket
    // past the last, which no cut reaches.
    float at = -k * kBucketsPerNat;
    at = at > kBuckets - 1 ? kBuckets - 1 : at;
    bucket[j] = static_cast<int16_t>(drop ? kBuckets : static_cast<int>(at));
  }
  int64_t count[kBuckets + 1] = {};
  double mass[kBuckets + 1] = {};
  for (int64_t j = 0; j < n; ++j) {
    ++count[bucket[j]];
    mass[bucket[j]] += weight[j];
  }
  double total = 0.0;
  for (int b = 0; b < kBuckets; ++b) total += mass[b];
  // The kept set is every token of a bucket before `edge`, and those of
  // bucket `edge` whose key reaches `cut_key` (ties at either cut kept):
  // only one bucket's tokens are ever sorted.
  int edge = kBuckets;  // nothing cut: every token of weight > 0
  float cut_key = -std::numeric_limits<float>::infinity();
  auto& cand = sc.cand;
  // The tokens of bucket b (of them, those already kept), by key then index.
  auto sorted_bucket = [&](int b) {
    cand.clear();
    for (int64_t j = 0; j < n; ++j) {
      if (bucket[j] == b && (b != edge || key[j] >= cut_key)) cand.emplace_back(key[j], j);
    }
    std::sort(cand.begin(), cand.end(), [](const auto& x, const auto& y) {
      return x.first > y.first || (x.first == y.first && x.second < y.second);
    });
  };
  double kept_mass[kBuckets + 1];
  std::copy(mass, mass + kBuckets + 1, kept_mass);
  kept_mass[kBuckets] = 0.0;
  double z = total;
  if (top_k < n) {
    int64_t seen = 0;
    for (int b = 0; b < kBuckets; ++b) {
      if (seen + count[b] >= top_k) {  // the k-th largest key is in bucket b
        sorted_bucket(b);
        edge = b;
        cut_key = cand[static_cast<size_t>(top_k - seen) - 1].first;  // ties stay
        double in_edge = 0.0;
        for (const auto& c : cand) {
          if (c.first >= cut_key) in_edge += weight[c.second];
        }
        kept_mass[b] = in_edge;
        for (int r = b + 1; r < kBuckets; ++r) kept_mass[r] = 0.0;
        z = 0.0;
        for (int r = 0; r <= b; ++r) z += kept_mass[r];
        break;
      }
      seen += count[b];
    }
  }
  if (top_p < 1.0f) {
    // A token stays if the kept weight ranked above it is below top_p * z
    // (so does every token tied with it): every token of a bucket before
    // the one where that weight is reached.
    double above = 0.0;
    const int stop = edge < kBuckets ? edge : kBuckets - 1;
    for (int b = 0; b <= stop; ++b) {
      if (kept_mass[b] > 0.0 && (above + kept_mass[b] >= top_p * z || b == stop)) {
        sorted_bucket(b);
        size_t i = 0;
        for (; i < cand.size(); ++i) {
          if (i > 0 || above > 0.0) {
            if (above >= top_p * z) break;
          }
          above += weight[cand[i].second];
        }
        if (i > 0) {  // the tokens tied with the last kept stay with it
          edge = b;
          cut_key = cand[i - 1].first;
        }
        break;
      }
      above += kept_mass[b];
    }
  }
  // The draw, over the kept tokens in index order.
  auto kept = [&](int64_t j) {
    const int b = bucket[j];
    return weight[j] > 0.0f &&
           (b < edge || (b == edge && key[j] >= cut_key));
  };
  double sum = 0.0;
  int64_t last_kept = -1;
  for (int64_t j = 0; j < n; ++j) {
    if (kept(j)) {
      sum += weight[j];
      last_kept = j;
    }
  }
  const double target = u * sum;
  double run = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    if (kept(j)) {
      run += weight[j];
      if (run > target) return j;
    }
  }
  return last_kept;
}

// Per row i of `rows`: top_k (n or more: off), top_p (1: off), min_p (0:
// off), each null where no row uses it.
struct Cuts {
  const int64_t* top_k;
  const float* top_p;
  const float* min_p;
};

template <typename T>
void sample_into(const T* src, int64_t n, const int64_t* rows, const float* inv_t,
                 const double* u, Cuts cuts, int64_t* dst, int64_t count) {
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> sums;
    SampleScratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const T* row = src + rows[i] * n;
      bool bad;
      const float m = row_max(row, n, &bad);
      if (bad) {  // no finite largest logit: what the distribution degenerates to
        bool tied;
        dst[i] = argmax_row(row, n, &tied);
        continue;
      }
      const int64_t k = cuts.top_k != nullptr ? cuts.top_k[i] : n;
      const float p = cuts.top_p != nullptr ? cuts.top_p[i] : 1.0f;
      const float mp = cuts.min_p != nullptr ? cuts.min_p[i] : 0.0f;
      if (k < n || p < 1.0f) {
        dst[i] = sample_truncated(row, n, m, inv_t[i], k < 1 ? 1 : k, p, mp, u[i], scratch);
      } else {
        const float floor =
            mp > 0.0f ? std::log(mp) : -std::numeric_limits<float>::infinity();
        dst[i] = sample_row(row, n, m, inv_t[i], floor, u[i], sums);
      }
    }
  });
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& rows,
                       const at::Tensor& inv_temperature, const at::Tensor& u,
                       const c10::optional<at::Tensor>& top_k,
                       const c10::optional<at::Tensor>& top_p,
                       const c10::optional<at::Tensor>& min_p) {
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
  auto per_row = [&](const c10::optional<at::Tensor>& t, at::ScalarType type,
                     const char* what) -> at::Tensor {
    if (!t.has_value()) return at::Tensor();
    TORCH_CHECK(t->scalar_type() == type && t->numel() == count, "sample_rows: one ", what,
                " per row");
    return t->contiguous();
  };
  const at::Tensor kc = per_row(top_k, at::kLong, "int64 top_k");
  const at::Tensor pc = per_row(top_p, at::kFloat, "float32 top_p");
  const at::Tensor mc = per_row(min_p, at::kFloat, "float32 min_p");
  const Cuts cuts{kc.defined() ? kc.data_ptr<int64_t>() : nullptr,
                  pc.defined() ? pc.data_ptr<float>() : nullptr,
                  mc.defined() ? mc.data_ptr<float>() : nullptr};
  const int64_t n = xc.size(1);
  const int64_t* r = rc.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < xc.size(0), "sample_rows: a row index out of range");
  }
  at::Tensor out = at::empty({count}, xc.options().dtype(at::kLong));
  if (xc.scalar_type() == at::kFloat) {
    sample_into(xc.data_ptr<float>(), n, r, tc.data_ptr<float>(), uc.data_ptr<double>(), cuts,
                out.data_ptr<int64_t>(), count);
  } else {
    sample_into(xc.data_ptr<at::BFloat16>(), n, r, tc.data_ptr<float>(), uc.data_ptr<double>(),
                cuts, out.data_ptr<int64_t>(), count);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preempt_serve, m) {
  m.def(
      "sample_rows(Tensor logits, Tensor rows, Tensor inv_temperature, Tensor u, "
      "Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) { m.impl("sample_rows", &sample_rows); }
