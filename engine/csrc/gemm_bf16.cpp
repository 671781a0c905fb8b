// bf16 projections on VDPBF16PS (AVX512-BF16 builds): y = x W^T (+ bias),
// x [M, K] and W [N, K] in bf16, y in bf16, accumulated in float32.
//
// Why our own: a decode step multiplies few rows (M = the batch) by every
// weight of the model, read from memory once a step.  oneDNN's bf16 matmul,
// on a weight reordered once to its blocked layout, runs those shapes at
// 332-361 GFLOP/s on one Zen 5 core (M = 32, SmolLM2's shapes) and 166-192
// at M = 8, while the core's VDPBF16PS peak is about 520 (a 2,048-row
// GEMM); this kernel runs them at 490-515 and 297-389
// (studies/engine_cpu/README.md, "Projections on VDPBF16PS").  Two things do it: the weight is laid out so
// that each 64-byte line is one vector operand (pack_bf16: [N/16][K/2][16][2],
// the pairs of K that one VDPBF16PS multiplies, for 16 output columns), and
// while a panel of 48 columns is multiplied, the next panel's lines are
// prefetched, one or more per step of K, so that the weight streams from
// memory behind the arithmetic instead of stalling the first rows that
// need it (where to, by CPU and row count: prefetch_hints).
//
// Each output element is the sum over K in one fixed order (pairs of K in
// turn, each pair by one VDPBF16PS into a float32 accumulator), then the
// bias, then one rounding to bf16: the same bits whatever M is, wherever the
// row sits among the others, however the rows are cut into blocks and the
// columns split between threads.  So deterministic mode needs no fixed row
// tiles around it (engine/models/batch_invariant.py).  VDPBF16PS treats
// denormal inputs as zero and flushes denormal results, as oneDNN's bf16
// kernels on the same instruction do.
//
// On a build with AMX, weights whose K is a multiple of 32 are multiplied
// on the tiles instead (gemm_bf16_amx.h), on the same packed layout.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "gemm_bf16_amx.h"
#include "vec16.h"

namespace {

// Output rows and 16-column vectors one micro-kernel call keeps in
// registers: 8 x 3 float32 accumulators, 3 weight vectors and a broadcast
// of 32.
constexpr int64_t kRows = 8;
constexpr int64_t kPanel = 3;
// Rows of x multiplied against each weight panel before the next panel
// (x's rows stay in the core's L2 while the weight streams past them).  A
// prefill's 2,048 rows against K = 576 are cut in 12 chunks, so each weight
// streams in from the shared L3 12 times; chunks of 512 KiB (5 passes) were
// no faster on a 2-core Zen 4, quiet or beside a core busy with a server's
// Python and JSON work (studies/engine_cpu/gemm_row_chunks.py).
// set_gemm_row_bytes changes it for studies; the bits do not depend on it.
std::atomic<int64_t>& row_bytes() {
  static std::atomic<int64_t> bytes{192 * 1024};
  return bytes;
}

// Whether a row chunk of more than kRows rows is cut into blocks of even
// size (9 rows as 5 + 4) rather than of kRows and a tail (8 + 1): a block of
// one to three rows runs on as few accumulator chains, bound by their
// latency, and took about as long as a block of eight.  On a Zen 4 core,
// SmolLM2's projections at 9 / 10 / 11 rows 1.18 / 1.10 / 1.06x, at 17-19
// 1.08-1.12x, 1.00-1.03x at 12-16 and 24-40 (studies/engine_cpu/README.md,
// "Row blocks of even size").  set_gemm_even_rows switches it for studies;
// the bits do not depend on it.
std::atomic<bool>& even_blocks() {
  static std::atomic<bool> on{true};
  return on;
}

// Where a row chunk's multiply prefetches the next weight panel's lines
// (_MM_HINT_T0 3: the L1, T1 2, T2 1; 0: not at all), by the chunk's rows:
// one, 2-16, 17-47, 48 and more.  The prefetch into the L1 was measured on
// Zen 5 (1.44x at 32 rows, weights from memory) and stays the hint of every
// other CPU; on a Zen 4 core it slowed SmolLM2's shapes at a few rows and
// at many (studies/engine_cpu/README.md, "The next panel's prefetch on Zen
// 4"): there, against T0, T2 runs them 1.06-1.57x at 2-16 rows, none
// 1.08-1.38x at one row and 1.03-1.10x from 128 rows (0.98-1.05x at 48-64).
// The bits never depend on it.
constexpr int kRowClasses = 4;
int row_class(int64_t rows) { return rows <= 1 ? 0 : rows <= 16 ? 1 : rows < 48 ? 2 : 3; }

bool zen4() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  // "AuthenticAMD" in ebx, edx, ecx.
  if (ebx != 0x68747541u || edx != 0x69746e65u || ecx != 0x444d4163u) return false;
  __get_cpuid(1, &eax, &ebx, &ecx, &edx);
  const unsigned family = ((eax >> 8) & 0xf) + ((eax >> 20) & 0xff);
  // Family 19h with AVX-512 is Zen 4 (Zen 3 has none; Zen 5 is 1Ah).
  __builtin_cpu_init();
  return family == 0x19 && __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

std::array<std::atomic<int>, kRowClasses>& prefetch_hints() {
  static std::array<std::atomic<int>, kRowClasses> hints;
  static const bool set = [] {
    const bool z = zen4();
    const std::array<int, kRowClasses> on_zen4 = {0, 1, 3, 0};
    for (int i = 0; i < kRowClasses; ++i) hints[i].store(z ? on_zen4[i] : 3);
    return true;
  }();
  (void)set;
  return hints;
}

// Outputs wider than this are computed in tiles of kTileColumns (a multiple
// of the panel's 48) and copied out (gemm_share says why).
constexpr int64_t kWideColumns = 4096;
constexpr int64_t kTileColumns = 3072;

#ifdef __AVX512BF16__

// acc[i][j] over every pair of K for the MR rows of `a` and NR 16-column
// vectors of the packed panel `b`; prefetches `pf_lines` lines of the next
// panel from `pf`, `per_step` per pair of K.  MR and NR are compile-time so
// that the accumulators stay in registers (a run-time row count in the loop
// made GCC keep them on the stack: 2.4x slower).  The steps that prefetch
// and those that do not run as two loops rather than one with a bound check
// on every line: on a Zen 4 core SmolLM2's projections ran 1.01-1.03x
// faster so at 8 and 32 rows from the caches, 0.98-1.04x from memory
// (studies/engine_cpu/README.md, "Prefetching in a loop of its own").
template <int MR, int NR, int HINT>
inline void micro(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t k2,
                  const float* bias, uint16_t* c, int64_t ldc, const char* pf,
                  int64_t pf_lines, int64_t per_step) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int32_t* a32 = reinterpret_cast<const int32_t*>(a);
  const int64_t lda32 = lda / 2;
  const auto step = [&](int64_t kp) __attribute__((always_inline)) {
    __m512bh w[NR];
    for (int j = 0; j < NR; ++j)
      w[j] = (__m512bh)_mm512_loadu_si512(b + (j * k2 + kp) * 32);
    for (int i = 0; i < MR; ++i) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(a32[i * lda32 + kp]);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, w[j]);
    }
  };
  int64_t kp = 0;
  if constexpr (HINT > 0) {
    const int64_t whole = std::min(k2, pf_lines / per_step);
    for (; kp < whole; ++kp) {
      for (int64_t q = 0; q < per_step; ++q)
        _mm_prefetch(pf + (kp * per_step + q) * 64, static_cast<_mm_hint>(HINT));
      step(kp);
    }
    // The lines short of a whole step's worth, if any, with the next step.
    for (int64_t line = whole * per_step; kp < k2 && line < pf_lines; ++line)
      _mm_prefetch(pf + line * 64, static_cast<_mm_hint>(HINT));
  }
  for (; kp < k2; ++kp) step(kp);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      __m512 v = acc[i][j];
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j * 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * ldc + j * 16),
                          (__m256i)_mm512_cvtneps_pbh(v));
    }
}

using Micro = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*,
                       uint16_t*, int64_t, const char*, int64_t, int64_t);

template <int HINT, int NR, int... MR>
constexpr std::array<Micro, sizeof...(MR)> micros(std::integer_sequence<int, MR...>) {
  return {&micro<MR + 1, NR, HINT>...};
}

using Kernels = std::array<std::array<Micro, kRows>, kPanel>;

// kernels<HINT>[nr - 1][rows - 1]
template <int HINT>
constexpr Kernels kernels = {micros<HINT, 1>(std::make_integer_sequence<int, kRows>{}),
                             micros<HINT, 2>(std::make_integer_sequence<int, kRows>{}),
                             micros<HINT, 3>(std::make_integer_sequence<int, kRows>{})};

const Kernels& kernels_for(int hint) {
  switch (hint) {
    case 3: return kernels<3>;
    case 2: return kernels<2>;
    case 1: return kernels<1>;
    default: return kernels<0>;
  }
}

// Rows [m0, m1) against column vectors [v0, v1) (of 16 columns each), into
// `out` (row m0, column vector v0; rows `ldo` apart); the panels' prefetches
// run on up to column vector `pf_end`.
void gemm_range(const uint16_t* x, int64_t lda, const uint16_t* w, int64_t k2,
                const float* bias, uint16_t* out, int64_t ldo, int64_t m0, int64_t m1,
                int64_t v0, int64_t v1, int64_t pf_end) {
  const Kernels& kernels =
      kernels_for(prefetch_hints()[row_class(m1 - m0)].load(std::memory_order_relaxed));
  const int64_t blocks = (m1 - m0 + kRows - 1) / kRows;
  const int64_t per_step = (kPanel + blocks - 1) / blocks;
  const bool even = even_blocks().load(std::memory_order_relaxed);
  const int64_t small = (m1 - m0) / blocks, larger = (m1 - m0) % blocks;
  for (int64_t v = v0; v < v1; v += kPanel) {
    const int64_t nr = std::min(kPanel, v1 - v);
    const int64_t next = std::min(kPanel, std::max<int64_t>(0, pf_end - v - nr));
    const char* pf = reinterpret_cast<const char*>(w + (v + nr) * k2 * 32);
    const int64_t pf_total = next * k2;
    const uint16_t* panel = w + v * k2 * 32;
    const float* pb = bias == nullptr ? nullptr : bias + v * 16;
    for (int64_t m = m0, blk = 0, rows = 0; m < m1; m += rows, ++blk) {
      rows = even ? small + (blk < larger ? 1 : 0) : std::min(kRows, m1 - m);
      const int64_t start = blk * k2 * per_step;
      const int64_t left = std::max<int64_t>(0, pf_total - start);
      kernels[nr - 1][rows - 1](x + m * lda, lda, panel, k2, pb,
                                out + (m - m0) * ldo + (v - v0) * 16, ldo,
                                pf + start * 64, left, per_step);
    }
  }
}

// A thread's share of the columns, [v0, v1), for rows [m0, m1).  Over a wide
// output (the lm_head's) the rows lie a multiple of 4 KiB apart, so every
// row's lines fall in the same cache sets: a 32-row block against
// SmolLM2's 49,152-column head ran at 394 GFLOP/s straight into the
// output, 466 through a scratch tile of 3,072 columns copied out after.
void gemm_share(const uint16_t* x, int64_t lda, const uint16_t* w, int64_t k2,
                const float* bias, uint16_t* y, int64_t n, int64_t m0, int64_t m1,
                int64_t v0, int64_t v1) {
  if (n <= kWideColumns) {
    gemm_range(x, lda, w, k2, bias, y + m0 * n + v0 * 16, n, m0, m1, v0, v1, v1);
    return;
  }
  constexpr int64_t tile_vectors = kTileColumns / 16;
  // Not value-initialized: every element is written before it is read.
  std::unique_ptr<uint16_t[]> tile(new uint16_t[static_cast<size_t>((m1 - m0) * kTileColumns)]);
  for (int64_t c0 = v0; c0 < v1; c0 += tile_vectors) {
    const int64_t c1 = std::min(v1, c0 + tile_vectors), width = (c1 - c0) * 16;
    gemm_range(x, lda, w, k2, bias, tile.get(), width, m0, m1, c0, c1, v1);
    for (int64_t r = 0; r < m1 - m0; ++r)
      std::memcpy(y + (m0 + r) * n + c0 * 16, tile.get() + r * width, width * 2);
  }
}

#endif  // __AVX512BF16__

bool bf16_gemm_built() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

at::Tensor pack_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "pack_bf16: a 2-D bfloat16 weight [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % 16 == 0 && k % 2 == 0,
              "pack_bf16: N must be a multiple of 16 and K even, got [", n, ", ", k, "]");
  // [N/16, 16, K/2, 2] -> [N/16, K/2, 16, 2]: each pair of K for 16 columns
  // side by side, one 64-byte vector.
  return w.reshape({n / 16, 16, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x, y and the bias as linear_bf16 and linear_bf16_codes take them.
struct Operands {
  at::Tensor x, y, bias;
  int64_t m, lda;
  const uint16_t* xp() const { return reinterpret_cast<const uint16_t*>(x.data_ptr()); }
  uint16_t* yp() const { return reinterpret_cast<uint16_t*>(y.data_ptr()); }
  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
};

// y: [m, out_cols] (out_cols < 0: n, the weight's columns).
Operands operands(const char* op, const at::Tensor& x, int64_t n, int64_t k,
                  const std::optional<at::Tensor>& bias, int64_t out_cols = -1) {
  TORCH_CHECK(bf16_gemm_built(), op, ": this build has no AVX512-BF16 path");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              op, ": x must be a 2-D bfloat16 tensor");
  TORCH_CHECK(x.size(1) == k, op, ": x has ", x.size(1), " columns, the weight ", k);
  at::Tensor xs = x.stride(1) == 1 && x.stride(0) % 2 == 0 ? x : x.contiguous();
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias must be [", n, "]");
    bf = bias->to(at::kFloat).contiguous();
  }
  const int64_t m = xs.size(0);
  return {xs, at::empty({m, out_cols < 0 ? n : out_cols}, x.options()), bf, m, xs.stride(0)};
}

// o.y = o.x W^T (+ bias), W packed [vectors][k/2][16][2] at `wp`: on the
// tiles wherever this build has them and K suits, by K alone
// (gemm_bf16_amx.h: never by the batch), else on VDPBF16PS.
void multiply(const Operands& o, const uint16_t* wp, int64_t k, int64_t vectors) {
#ifdef __AVX512BF16__
  const int64_t m = o.m, k2 = k / 2, n = vectors * 16, lda = o.lda;
  const uint16_t* xp = o.xp();
  uint16_t* yp = o.yp();
  const float* bp = o.bias_ptr();
#ifdef GEMM_BF16_AMX
  if (preempt_serve_gemm_amx::usable(k)) {
    preempt_serve_gemm_amx::gemm(xp, lda, m, wp, k, vectors, bp, yp);
    return;
  }
#endif
  const int64_t chunk = std::max<int64_t>(kRows, row_bytes().load() / (k * 2) / kRows * kRows);
  const int64_t panels = (vectors + kPanel - 1) / kPanel;
  // Threads split the columns by whole panels; each row chunk in turn.
  for (int64_t m0 = 0; m0 < m; m0 += chunk) {
    const int64_t m1 = std::min(m, m0 + chunk);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      gemm_share(xp, lda, wp, k2, bp, yp, n, m0, m1, p0 * kPanel,
                 std::min(vectors, p1 * kPanel));
    });
  }
#else
  (void)o, (void)wp, (void)k, (void)vectors;
#endif
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "linear_bf16: the weight must come from pack_bf16");
  const int64_t k = 2 * packed.size(1), vectors = packed.size(0);
  const Operands o = operands("linear_bf16", x, vectors * 16, k, bias);
  if (o.m > 0) multiply(o, reinterpret_cast<const uint16_t*>(packed.data_ptr()), k, vectors);
  return o.y;
}

// Whether linear_bf16 multiplies on AMX tiles now (weights with K a multiple
// of 32): where this build has the tiles' path, they are switched on
// (set_gemm_amx) and the OS grants their state.
bool gemm_amx() {
#ifdef GEMM_BF16_AMX
  return preempt_serve_gemm_amx::on();
#else
  return false;
#endif
}

// Switch the tiles on or off from now on; returns gemm_amx() after it.
bool set_gemm_amx(bool enable) {
#ifdef GEMM_BF16_AMX
  preempt_serve_gemm_amx::switched_on().store(enable);
#else
  (void)enable;
#endif
  return gemm_amx();
}

// Whether the tiles' GEMM and the prefill operator claim their output lines
// before they compute them (vec16.h, claim); studies time them both ways in
// one process.  Returns whether this build claims at all.
bool set_output_claims(bool enable) {
#ifdef PREEMPT_SERVE_VEC16
  preempt_serve_vec::claims_switch().store(enable);
  return true;
#else
  (void)enable;
  return false;
#endif
}

// Where row chunks of `rows` prefetch the next panel from now on
// (prefetch_hints), where `hint` is 0-3; returns the setting in effect for
// that many rows after it.
int64_t set_gemm_prefetch(int64_t rows, int64_t hint) {
  TORCH_CHECK(rows >= 1, "set_gemm_prefetch: rows must be at least 1");
  std::atomic<int>& h = prefetch_hints()[row_class(rows)];
  if (hint >= 0 && hint <= 3) h.store(static_cast<int>(hint));
  return h.load();
}

// Bytes of x's rows per chunk from now on (row_bytes), where `bytes` > 0;
// returns the setting in effect after it.
int64_t set_gemm_row_bytes(int64_t bytes) {
  if (bytes > 0) row_bytes().store(bytes);
  return row_bytes().load();
}

// Whether row chunks are cut into row blocks of even size from now on
// (even_blocks); returns the setting after it.
bool set_gemm_even_rows(bool enable) {
  even_blocks().store(enable);
  return even_blocks().load();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preempt_serve, m) {
  m.def("bf16_gemm_built() -> bool", &bf16_gemm_built);
  m.def("set_gemm_even_rows(bool enable) -> bool", &set_gemm_even_rows);
  m.def("set_gemm_row_bytes(int bytes) -> int", &set_gemm_row_bytes);
  m.def("set_gemm_prefetch(int rows, int hint) -> int", &set_gemm_prefetch);
  m.def("set_output_claims(bool enable) -> bool", &set_output_claims);
  m.def("set_gemm_amx(bool enable) -> bool", &set_gemm_amx);
  m.def("gemm_amx() -> bool", &gemm_amx);
  m.def("pack_bf16(Tensor w) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) {
  m.impl("pack_bf16", &pack_bf16);
  m.impl("linear_bf16", &linear_bf16);
}
