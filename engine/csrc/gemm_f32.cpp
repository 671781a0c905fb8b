// float32 projections on AVX2 FMA: y = x W^T (+ bias), x [M, K] and W [N, K]
// in float32, for CPUs whose widest vectors are 256 bits.
//
// Why our own: on one AVX2 Zen 3 core MKL's sgemm runs SmolLM2's projection
// shapes at 58-72 GFLOP/s at M = 32 and 37-44 at M = 8, oneDNN's packed
// matmul at 58-70 and 35-60, and the lm_head (49,152 columns) at 40 and 58;
// the core's FMA peak is about 100.  This kernel runs them at 82-99, 63-79
// and 69 (studies/engine_cpu/README.md, "float32 projections on AVX2 FMA").
// The weight is laid out once (pack_f32: [N/16][K][16]) so that the 16
// columns' weights for one k are one 64-byte line, two ymm operands, read in
// order; six rows of x times those 16 columns stay in twelve ymm
// accumulators over the whole of K (6 x 2 accumulators, 2 weight vectors and
// a broadcast: 15 of the 16 registers).  Software prefetch of the next panel
// gained nothing here: the hardware prefetcher follows the panel's lines.
//
// Each output element is one FMA chain over k = 0 .. K-1 from zero, then the
// bias: the same bits whatever M is, wherever the row sits among the others,
// however the rows are cut into blocks and the columns split between
// threads.  So deterministic mode needs no fixed row tiles around it
// (engine/models/batch_invariant.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PREEMPT_SERVE_F32_FMA 1
#endif

namespace {
namespace gemm_f32 {

// Rows one micro-kernel call keeps in registers.
constexpr int64_t kRows = 6;
// Rows of x multiplied against each weight panel before the next panel
// (x's rows stay in the core's L2 while the weight streams past them).
constexpr int64_t kRowBytes = 192 * 1024;

#ifdef PREEMPT_SERVE_F32_FMA

// One k's weights for the panel's 16 columns (`w0`, `w1`) into rows [0, MR)
// of the accumulators, x read at column `kk` of each row.  Written out row
// by row, not as arrays indexed in loops: GCC kept such arrays of ymm
// accumulators on the stack (half the rate).
#define PREEMPT_SERVE_ACC_PARAMS                                                           \
  __m256 &c00, __m256 &c01, __m256 &c10, __m256 &c11, __m256 &c20, __m256 &c21,           \
      __m256 &c30, __m256 &c31, __m256 &c40, __m256 &c41, __m256 &c50, __m256 &c51
#define PREEMPT_SERVE_ACC_ARGS c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51

template <int MR>
__attribute__((always_inline)) inline void fma_rows(const float* a, int64_t lda, int64_t kk,
                                                    __m256 w0, __m256 w1,
                                                    PREEMPT_SERVE_ACC_PARAMS) {
  static_assert(MR >= 1 && MR <= kRows, "one to six rows");
  __m256 x = _mm256_broadcast_ss(a + kk);
  c00 = _mm256_fmadd_ps(x, w0, c00);
  c01 = _mm256_fmadd_ps(x, w1, c01);
  if constexpr (MR > 1) {
    x = _mm256_broadcast_ss(a + lda + kk);
    c10 = _mm256_fmadd_ps(x, w0, c10);
    c11 = _mm256_fmadd_ps(x, w1, c11);
  }
  if constexpr (MR > 2) {
    x = _mm256_broadcast_ss(a + 2 * lda + kk);
    c20 = _mm256_fmadd_ps(x, w0, c20);
    c21 = _mm256_fmadd_ps(x, w1, c21);
  }
  if constexpr (MR > 3) {
    x = _mm256_broadcast_ss(a + 3 * lda + kk);
    c30 = _mm256_fmadd_ps(x, w0, c30);
    c31 = _mm256_fmadd_ps(x, w1, c31);
  }
  if constexpr (MR > 4) {
    x = _mm256_broadcast_ss(a + 4 * lda + kk);
    c40 = _mm256_fmadd_ps(x, w0, c40);
    c41 = _mm256_fmadd_ps(x, w1, c41);
  }
  if constexpr (MR > 5) {
    x = _mm256_broadcast_ss(a + 5 * lda + kk);
    c50 = _mm256_fmadd_ps(x, w0, c50);
    c51 = _mm256_fmadd_ps(x, w1, c51);
  }
}

// Rows [0, MR) of the accumulators, plus the bias, into `c`.
template <int MR>
__attribute__((always_inline)) inline void store_rows(const float* bias, float* c, int64_t ldc,
                                                      PREEMPT_SERVE_ACC_PARAMS) {
  const __m256 b0 = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias != nullptr ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  const __m256 rows[kRows][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                                 {c30, c31}, {c40, c41}, {c50, c51}};
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(c + i * ldc, bias != nullptr ? _mm256_add_ps(rows[i][0], b0) : rows[i][0]);
    _mm256_storeu_ps(c + i * ldc + 8,
                     bias != nullptr ? _mm256_add_ps(rows[i][1], b1) : rows[i][1]);
  }
}

// Rows [0, MR) of `a` times one packed panel `b` (16 columns, K lines) into `c`.
template <int MR>
inline void micro(const float* a, int64_t lda, const float* b, int64_t k, const float* bias,
                  float* c, int64_t ldc) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t kk = 0; kk < k; ++kk) {
    fma_rows<MR>(a, lda, kk, _mm256_loadu_ps(b + kk * 16), _mm256_loadu_ps(b + kk * 16 + 8),
                 PREEMPT_SERVE_ACC_ARGS);
  }
  store_rows<MR>(bias, c, ldc, PREEMPT_SERVE_ACC_ARGS);
}

using Micro = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*,
                       int64_t);
constexpr Micro kMicro[kRows] = {&micro<1>, &micro<2>, &micro<3>, &micro<4>, &micro<5>,
                                 &micro<6>};

// Rows [m0, m1) against panels [p0, p1): each panel against every row block
// in turn, the blocks as even as six-row blocks allow (32 rows: 6,6,5,5,5,5
// rather than five of six and a slow block of two).
void gemm_range(const float* x, int64_t lda, const float* w, int64_t k, const float* bias,
                float* y, int64_t n, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  const int64_t total = m1 - m0, blocks = (total + kRows - 1) / kRows;
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = w + p * k * 16;
    const float* pb = bias == nullptr ? nullptr : bias + p * 16;
    int64_t m = m0;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t rows = total / blocks + (blk < total % blocks ? 1 : 0);
      kMicro[rows - 1](x + m * lda, lda, panel, k, pb, y + m * n + p * 16, n);
      m += rows;
    }
  }
}

#endif  // PREEMPT_SERVE_F32_FMA

// How many row chunks of about `bytes` of x the `m` rows take, cut evenly
// (at K = 1,536, 32 rows as 16 and 16, not 30 and a latency-bound 2).
int64_t row_chunks(int64_t m, int64_t k, int64_t bytes = kRowBytes) {
  const int64_t most = std::max<int64_t>(kRows, bytes / (k * 4) / kRows * kRows);
  return (m + most - 1) / most;
}

bool built() {
#ifdef PREEMPT_SERVE_F32_FMA
  return true;
#else
  return false;
#endif
}

at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat,
              "pack_f32: a 2-D float32 weight [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % 16 == 0, "pack_f32: N must be a multiple of 16, got [", n, ", ", k, "]");
  // [N/16, 16, K] -> [N/16, K, 16]: the 16 columns' weights of one k side by side.
  return w.reshape({n / 16, 16, k}).permute({0, 2, 1}).contiguous();
}

// y = x W^T (+ bias)'s tensors for `op` and a weight of N x K, checked: x
// with contiguous rows, y allocated, the bias in float32.
struct Operands {
  at::Tensor x, y, bias;
  int64_t m, lda;
  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
};

Operands operands(const char* op, const at::Tensor& x, int64_t n, int64_t k,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(built(), op, ": this build has no AVX2 FMA path");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              op, ": x must be a 2-D float32 tensor");
  TORCH_CHECK(x.size(1) == k, op, ": x has ", x.size(1), " columns, the weight ", k);
  at::Tensor xs = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias must be [", n, "]");
    bf = bias->to(at::kFloat).contiguous();
  }
  const int64_t m = xs.size(0);
  return {xs, at::empty({m, n}, x.options()), bf, m, xs.stride(0)};
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 &&
                  packed.scalar_type() == at::kFloat && packed.is_contiguous(),
              "linear_f32: the weight must come from pack_f32");
  const int64_t k = packed.size(1), panels = packed.size(0), n = panels * 16;
  const Operands o = operands("linear_f32", x, n, k, bias);
  const int64_t m = o.m;
  at::Tensor y = o.y;
  if (m == 0) return y;
#ifdef PREEMPT_SERVE_F32_FMA
  const float* xp = o.x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* bp = o.bias_ptr();
  const int64_t lda = o.lda;
  const int64_t chunks = row_chunks(m, k);
  // Threads split the columns by whole panels; each row chunk in turn.
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t m0 = c * m / chunks, m1 = (c + 1) * m / chunks;
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      gemm_range(xp, lda, wp, k, bp, yp, n, m0, m1, p0, p1);
    });
  }
#endif
  return y;
}

}  // namespace gemm_f32
}  // namespace

TORCH_LIBRARY_FRAGMENT(preempt_serve, m) {
  m.def("f32_gemm_built() -> bool", &gemm_f32::built);
  m.def("pack_f32(Tensor w) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) {
  m.impl("pack_f32", &gemm_f32::pack);
  m.impl("linear_f32", &gemm_f32::linear);
}
