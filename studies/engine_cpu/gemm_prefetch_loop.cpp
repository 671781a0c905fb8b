// The bf16 GEMM's micro-kernel (engine/csrc/gemm_bf16.cpp) two ways: the
// next panel's prefetch checked against its line count at every step of K
// inside the one loop (`checked`, as the kernel had it) and in a loop of
// its own (`split`, as the kernel has it), on SmolLM2's projection shapes.
// Weights are 30 distinct copies used in turn (from memory, as in a decode
// step) or one (from the caches); the rows' prefetch hint is the one
// gemm_bf16.cpp gives a Zen 4 core (T2 at 2-16 rows, T0 at 17-47).
// Rounds alternate the two ways; prints JSON (medians of the rounds), with
// the instruction's own rate on this core beside them: twelve independent
// chains of VDPBF16PS on registers, no loads.
//
//   g++ -O3 -march=native -mavx512bf16 -o /tmp/gemm_prefetch_loop \
//       studies/engine_cpu/gemm_prefetch_loop.cpp
//   taskset -c 0 /tmp/gemm_prefetch_loop > studies/engine_cpu/gemm_prefetch_loop.json

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr int kRows = 8, kPanel = 3;

template <int MR, int NR, int HINT, bool SPLIT>
void micro(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t k2, uint16_t* c,
           int64_t ldc, const char* pf, int64_t pf_lines, int64_t per_step) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int32_t* a32 = reinterpret_cast<const int32_t*>(a);
  const int64_t lda32 = lda / 2;
  const auto step = [&](int64_t kp) __attribute__((always_inline)) {
    __m512bh w[NR];
    for (int j = 0; j < NR; ++j) w[j] = (__m512bh)_mm512_loadu_si512(b + (j * k2 + kp) * 32);
    for (int i = 0; i < MR; ++i) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(a32[i * lda32 + kp]);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, w[j]);
    }
  };
  int64_t kp = 0;
  if constexpr (SPLIT) {
    const int64_t whole = std::min(k2, pf_lines / per_step);
    for (; kp < whole; ++kp) {
      for (int64_t q = 0; q < per_step; ++q)
        _mm_prefetch(pf + (kp * per_step + q) * 64, static_cast<_mm_hint>(HINT));
      step(kp);
    }
    for (int64_t line = whole * per_step; kp < k2 && line < pf_lines; ++line)
      _mm_prefetch(pf + line * 64, static_cast<_mm_hint>(HINT));
    for (; kp < k2; ++kp) step(kp);
  } else {
    for (; kp < k2; ++kp) {
      for (int64_t q = 0; q < per_step; ++q) {
        const int64_t line = kp * per_step + q;
        if (line < pf_lines) _mm_prefetch(pf + line * 64, static_cast<_mm_hint>(HINT));
      }
      step(kp);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * ldc + j * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
}

// Rows [0, m) of x against the whole packed weight, as gemm_range does it:
// row blocks of even size, each panel's next panel prefetched by the blocks
// in turn.  The shapes here are whole panels and m is 8 or 32.
template <int HINT, bool SPLIT>
void gemm(const uint16_t* x, int64_t k, const uint16_t* w, int64_t vectors, uint16_t* y,
          int64_t m) {
  const int64_t k2 = k / 2, blocks = (m + kRows - 1) / kRows;
  const int64_t per_step = (kPanel + blocks - 1) / blocks;
  for (int64_t v = 0; v < vectors; v += kPanel) {
    const int64_t next = std::min<int64_t>(kPanel, std::max<int64_t>(0, vectors - v - kPanel));
    const char* pf = reinterpret_cast<const char*>(w + (v + kPanel) * k2 * 32);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t start = blk * k2 * per_step;
      const int64_t left = std::max<int64_t>(0, next * k2 - start);
      micro<kRows, kPanel, HINT, SPLIT>(x + blk * kRows * k, k, w + v * k2 * 32, k2,
                                        y + blk * kRows * vectors * 16 + v * 16,
                                        vectors * 16, pf + start * 64, left, per_step);
    }
  }
}

template <bool SPLIT>
double seconds(const std::vector<std::vector<uint16_t>>& ws, const uint16_t* x, int64_t k,
               int64_t n, uint16_t* y, int64_t m) {
  const auto run = [&](const std::vector<uint16_t>& w) {
    if (m <= 16) gemm<1, SPLIT>(x, k, w.data(), n / 16, y, m);
    else gemm<3, SPLIT>(x, k, w.data(), n / 16, y, m);
  };
  for (const auto& w : ws) run(w);
  int64_t calls = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double s = 0;
  while (s < 0.2) {
    for (const auto& w : ws) run(w);
    calls += static_cast<int64_t>(ws.size());
    s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return s / calls;
}

// GFLOP/s of VDPBF16PS alone: 12 accumulators (enough to cover its latency),
// operands in registers.
__attribute__((noinline)) double instruction_peak() {
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  constexpr int64_t kIters = 100000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < kIters; ++i) {
#pragma GCC unroll 12
    for (auto& a : acc) a = _mm512_dpbf16_ps(a, x, x);
    asm volatile("" : "+v"(x));  // one operand the compiler cannot see through
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sum = 0;
  for (const auto& a : acc) sum += _mm512_reduce_add_ps(a);
  if (sum == 0) std::fprintf(stderr, "?");  // keeps the chains' results live
  return kIters * 12 * 64.0 / s / 1e9;
}

}  // namespace

int main() {
  const struct { const char* name; int64_t n, k; } shapes[] = {
      {"qkv", 960, 576}, {"o", 576, 576}, {"gate_up", 3072, 576}, {"down", 576, 1536}};
  constexpr int kRounds = 5;
  double peak = 0;
  for (int r = 0; r < 3; ++r) peak = std::max(peak, instruction_peak());
  std::printf("{\"rounds\": %d, \"instruction_peak_gflops\": %.1f, \"results\": [", kRounds,
              peak);
  bool first = true;
  for (int64_t m : {8, 32}) {
    for (const auto& s : shapes) {
      for (int copies : {30, 1}) {
        std::vector<std::vector<uint16_t>> ws(copies, std::vector<uint16_t>(s.n * s.k));
        for (auto& w : ws)
          for (auto& e : w) e = static_cast<uint16_t>(0x3c00 + (std::rand() & 0x3ff));
        std::vector<uint16_t> x(m * s.k, 0x3f80), y(m * s.n);
        std::vector<double> checked, split;
        for (int r = 0; r < kRounds; ++r) {
          checked.push_back(seconds<false>(ws, x.data(), s.k, s.n, y.data(), m));
          split.push_back(seconds<true>(ws, x.data(), s.k, s.n, y.data(), m));
        }
        std::sort(checked.begin(), checked.end());
        std::sort(split.begin(), split.end());
        const double flop = 2.0 * m * s.n * s.k;
        std::printf("%s\n  {\"projection\": \"%s\", \"rows\": %ld, \"weights\": \"%s\", "
                    "\"gflops_checked\": %.1f, \"gflops_split\": %.1f, \"split_over_checked\": "
                    "%.3f}", first ? "" : ",", s.name, static_cast<long>(m),
                    copies > 1 ? "memory" : "caches", flop / checked[kRounds / 2] / 1e9,
                    flop / split[kRounds / 2] / 1e9, checked[kRounds / 2] / split[kRounds / 2]);
        first = false;
      }
    }
  }
  std::printf("\n]}\n");
}
