// bf16 projections on AMX tiles, for builds whose CPU has AMX (amx_tile,
// amx_bf16; engine/cpp_ops.py adds the flags), on the same packed
// weight as the VDPBF16PS kernel (gemm_bf16.cpp, pack_bf16's
// [N/16][K/2][16][2]).
//
// Why: on such a CPU oneDNN multiplies bf16 on the tiles, and our vector
// kernel, one VDPBF16PS per 16 columns and pair of K, does not keep up with
// it beyond a few rows.  The packed layout already is the tiles' right-hand
// operand: 16 pairs of K for one panel of 16 columns are 16 consecutive
// 64-byte lines, one tile load.  x's 16 rows by 32 values of K are the
// left-hand tile (read in place, the last partial tile of rows from a
// zero-padded copy), and each 16 x 16 block of float32 sums stays in a tile
// over all of K (where x's rows outgrow L1, over passes of K, the sums stored
// and loaded again, exactly, between them).
//
// Each output element is C += A . B over K in 32-value steps, in order, one
// TDPBF16PS a step, then the bias and one rounding: the same instructions on
// the same operands whatever M is, wherever the row sits, whichever variant
// of the block (one or two tiles of rows, one to four panels) computes it.
// So it is batch-invariant as the vector kernel is (deterministic mode needs
// no row tiles around it); its bits differ from the vector kernel's, so a
// build takes one or the other for a weight by K alone (K a multiple of 32
// here), never by the batch.  TDPBF16PS, like VDPBF16PS, treats denormal
// inputs as zero and flushes denormal results.
#pragma once

#include "paged_decode_amx.h"
#include "vec16.h"

#ifdef PAGED_DECODE_AMX
#define GEMM_BF16_AMX 1

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace preempt_serve_gemm_amx {

// Switched off by preempt_serve::set_gemm_amx (studies and tests run the
// vector kernel of the same build beside this one).
inline std::atomic<bool>& switched_on() {
  static std::atomic<bool> on{true};
  return on;
}

// Whether weights go to the tiles now: switched on, and the OS grants the
// tiles' state.
inline bool on() {
  return switched_on().load(std::memory_order_relaxed) && preempt_serve_amx::tiles_permitted();
}

inline bool usable(int64_t k) { return k % 32 == 0 && on(); }

// Every tile is 16 rows of 64 bytes: 16 rows of x by 32 values of K (A),
// 16 pairs of K by 16 columns (B), 16 rows by 16 float32 sums (C).
inline void configure() { preempt_serve_amx::configure_16x64(); }

// Where one tile's 16 rows of x are read.
struct RowTile {
  const uint16_t* p;
  int64_t stride;  // bytes between rows
  int64_t rows;    // rows that are x's (the rest are padding)
};

// A block's C tiles loaded from `acc` ([MT * 16][NT * 16] float32), as
// `block` stores them.
template <int MT, int NT>
inline void load_sums(const float* acc) {
  constexpr int64_t ld = NT * 16 * static_cast<int64_t>(sizeof(float));
  _tile_loadd(0, acc, ld);
  if constexpr (MT == 1) {
    if constexpr (NT > 1) _tile_loadd(1, acc + 16, ld);
    if constexpr (NT > 2) _tile_loadd(2, acc + 32, ld);
    if constexpr (NT > 3) _tile_loadd(3, acc + 48, ld);
  } else {
    _tile_loadd(2, acc + 16 * NT * 16, ld);
    if constexpr (NT > 1) {
      _tile_loadd(1, acc + 16, ld);
      _tile_loadd(3, acc + 16 * NT * 16 + 16, ld);
    }
  }
}

// Tiles: MT = 1: C 0..NT-1 (panel j), A 4, B 5, 6, 7 (and 5 again for a
// fourth panel).  MT = 2: C 2i + j (row tile i, panel j), A 4 and 5, B 6
// and 7.  `acc` receives C as [MT * 16][NT * 16] float32.  Over K steps
// [s0, s1) only where asked (s1 < 0: to the end of K), the sums from `acc`
// when s0 > 0: a float32 tile stored and loaded again is exact, so K in
// passes gives the bits of one pass over all of K.  The block's panels lie
// `apart` elements apart (0: one packed panel, the next ones).
template <int MT, int NT>
inline void block(const RowTile* rt, const uint16_t* panel, int64_t k2, float* acc,
                  int64_t s0 = 0, int64_t s1 = -1, int64_t apart = 0) {
  static_assert((MT == 1 && NT >= 1 && NT <= 4) || (MT == 2 && NT >= 1 && NT <= 2));
  const int64_t pe = apart > 0 ? apart : k2 * 32;  // elements from one panel to the next
  const int64_t end = s1 < 0 ? k2 / 16 : s1;
  if (s0 > 0) {
    load_sums<MT, NT>(acc);
  } else {
    _tile_zero(0);
    if constexpr (NT > 1) _tile_zero(1);
    if constexpr (MT == 2 || NT > 2) _tile_zero(2);
    if constexpr ((MT == 2 && NT > 1) || NT > 3) _tile_zero(3);
  }
  const uint16_t* a0 = rt[0].p;
  const uint16_t* a1 = MT == 2 ? rt[1].p : nullptr;
  // The weight's tiles are loaded with the streaming hint (TILELOADDT1): a
  // block reads each once, and loaded plainly they evict x's rows from L1,
  // which every panel of the group reads again (1.06-1.28x the GEMM's rate
  // at 128-512 rows, no change at a few; studies/engine_cpu/README.md).
  for (int64_t s = s0; s < end; ++s) {
    const uint16_t* b = panel + s * 512;
    if constexpr (MT == 1) {
      _tile_loadd(4, a0 + s * 32, rt[0].stride);
      _tile_stream_loadd(5, b, 64);
      _tile_dpbf16ps(0, 4, 5);
      if constexpr (NT > 1) {
        _tile_stream_loadd(6, b + pe, 64);
        _tile_dpbf16ps(1, 4, 6);
      }
      if constexpr (NT > 2) {
        _tile_stream_loadd(7, b + 2 * pe, 64);
        _tile_dpbf16ps(2, 4, 7);
      }
      if constexpr (NT > 3) {
        _tile_stream_loadd(5, b + 3 * pe, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    } else {
      // Each register is loaded again as soon as the previous step's last
      // product that reads it is issued (tile registers are not renamed).
      _tile_loadd(4, a0 + s * 32, rt[0].stride);
      _tile_stream_loadd(6, b, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NT > 1) {
        _tile_stream_loadd(7, b + pe, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      _tile_loadd(5, a1 + s * 32, rt[1].stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NT > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t ld = NT * 16 * static_cast<int64_t>(sizeof(float));
  if constexpr (MT == 1) {
    _tile_stored(0, acc, ld);
    if constexpr (NT > 1) _tile_stored(1, acc + 16, ld);
    if constexpr (NT > 2) _tile_stored(2, acc + 32, ld);
    if constexpr (NT > 3) _tile_stored(3, acc + 48, ld);
  } else {
    _tile_stored(0, acc, ld);
    _tile_stored(2, acc + 16 * NT * 16, ld);
    if constexpr (NT > 1) {
      _tile_stored(1, acc + 16, ld);
      _tile_stored(3, acc + 16 * NT * 16 + 16, ld);
    }
  }
}

// The block's sums (+ bias) rounded once into y's rows of its row tiles and
// its panels' columns (column vector v, of 16 columns).
inline void store(const float* acc, int mt, int nt, const RowTile* rt, int64_t m, int64_t v,
                  const float* bias, uint16_t* y, int64_t n) {
  for (int i = 0; i < mt; ++i)
    for (int64_t r = 0; r < rt[i].rows; ++r) {
      const float* a = acc + (i * 16 + r) * nt * 16;
      uint16_t* out = y + (m + i * 16 + r) * n + v * 16;
      for (int j = 0; j < nt; ++j) {
        __m512 s = _mm512_loadu_ps(a + j * 16);
        if (bias != nullptr) s = _mm512_add_ps(s, _mm512_loadu_ps(bias + (v + j) * 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * 16),
                            (__m256i)_mm512_cvtneps_pbh(s));
      }
    }
}

// Asks for y's lines of a block's rows and columns [col, col + cols) in
// the exclusive state, before the block's K loop, so that its stores find
// them in cache.  A prefill's output is fresh memory (gate_up's 6 MB at
// 1,024 rows): stored into cold, every line's read for ownership stalled
// the stores at the block's end (gate_up at 1,024 rows 0.68-0.73x oneDNN's
// rate with the caches cold; studies/engine_cpu/README.md).
inline void claim_out(const RowTile* rt, int mt, int64_t m, int64_t col, int64_t cols,
                      uint16_t* y, int64_t n) {
  for (int i = 0; i < mt; ++i)
    for (int64_t r = 0; r < rt[i].rows; ++r) {
      const uint16_t* row = y + (m + i * 16 + r) * n;
      for (int64_t c = col; c < col + cols; c += 32) preempt_serve_vec::claim(row + c);
      preempt_serve_vec::claim(row + col + cols - 1);
    }
}

template <int MT>
inline void block_nt(int nt, const RowTile* rt, const uint16_t* panel, int64_t k2, float* acc) {
  if constexpr (MT == 1) {
    switch (nt) {
      case 1: block<1, 1>(rt, panel, k2, acc); break;
      case 2: block<1, 2>(rt, panel, k2, acc); break;
      case 3: block<1, 3>(rt, panel, k2, acc); break;
      default: block<1, 4>(rt, panel, k2, acc); break;
    }
  } else {
    if (nt == 1) block<2, 1>(rt, panel, k2, acc);
    else block<2, 2>(rt, panel, k2, acc);
  }
}

// Row tiles of a chunk cut so that x's rows of one chunk (kChunkBytes)
// stay in the core's L2 (2 MB where there is AMX) while every panel streams
// past them once: half of it, so that 512 rows of K 576 read the weight from
// memory once (192 KB: four times, gate_up 0.80x oneDNN's rate there against
// 0.96x now).
constexpr int64_t kChunkBytes = 1024 * 1024;
// Panels one thread's step takes (the MT = 1 block's four, the MT = 2
// block's two twice).
constexpr int64_t kGroup = 4;
// With more than two tiles of rows, the panels a thread takes in one step
// (each pair of row tiles passes over all of them, its x in L1, the panels
// in L2).
constexpr int64_t kWideGroup = 16;
// Where two row tiles of x over all of K outgrow L1 (a K of more than 768),
// every panel would read them from L2 again: K is then taken in passes of
// kPassSteps steps (128 values), each pair of row tiles over kPassGroup
// panels per pass with its slice of x in L1 and the panels' sums in a
// float32 buffer between passes (down's K of 1,536 at 128-512 rows: 0.72-0.82x
// oneDNN's rate before, 0.81-0.93x with passes; at K 576, where x fits, they
// were 0.8-0.9x the one-pass rate).
constexpr int64_t kL1Bytes = 48 * 1024;
constexpr int64_t kPassSteps = 4;
constexpr int64_t kPassGroup = 8;

// x's m rows [m, k] as tiles of 16 rows, read in place but the last
// partial tile's, copied into `pad` zero-padded to 16.
inline std::vector<RowTile> row_tiles(const uint16_t* x, int64_t lda, int64_t m, int64_t k,
                                      std::vector<uint16_t>& pad) {
  const int64_t tiles = (m + 15) / 16, tail = m % 16;
  pad.assign(tail ? static_cast<size_t>(16 * k) : 0, 0);
  std::vector<RowTile> rts(static_cast<size_t>(tiles));
  for (int64_t t = 0; t < tiles; ++t) {
    if (tail && t == tiles - 1) {
      for (int64_t r = 0; r < tail; ++r)
        std::memcpy(pad.data() + r * k, x + (t * 16 + r) * lda, static_cast<size_t>(k) * 2);
      rts[t] = {pad.data(), k * 2, tail};
    } else {
      rts[t] = {x + t * 16 * lda, lda * 2, 16};
    }
  }
  return rts;
}

// y [m, n] = x [m, k] W^T (+ bias), W packed [n/16][k/2][16][2].
inline void gemm(const uint16_t* x, int64_t lda, int64_t m, const uint16_t* w, int64_t k,
                 int64_t vectors, const float* bias, uint16_t* y) {
  const int64_t k2 = k / 2, n = vectors * 16;
  const int64_t tiles = (m + 15) / 16;
  std::vector<uint16_t> pad;
  const std::vector<RowTile> rts = row_tiles(x, lda, m, k, pad);
  const int64_t chunk = std::max<int64_t>(2, kChunkBytes / (16 * k * 2) / 2 * 2);
  const bool passes = tiles > 2 && 2 * 16 * k * 2 > kL1Bytes;
  const int64_t group = passes ? kPassGroup : tiles > 2 ? kWideGroup : kGroup;
  const int64_t groups = (vectors + group - 1) / group;
  // Claimed only where it paid (studies/engine_cpu/output_claims.json):
  // outputs whose rows are wider than a 4 KB page (gate_up's 6 KB: the
  // stores jump a page every 512 bytes, ahead of what the prefetchers
  // follow; 1.10-1.18x at 256-2,048 rows), not the 1-2 KB rows of the
  // others (0.96-0.98x), and none smaller than x's chunk, which may still
  // be in L2 from the step before (a decode's).
  const bool claim = preempt_serve_vec::claims_on() && n * 2 > 4096 && m * n * 2 >= kChunkBytes;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    configure();
    alignas(64) float acc[2 * 16 * kGroup * 16];
    alignas(64) float sums[kPassGroup / 2 * 1024];
    for (int64_t c0 = 0; c0 < tiles; c0 += chunk) {
      const int64_t c1 = std::min(tiles, c0 + chunk);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t v0 = g * group, v1 = std::min(vectors, v0 + group);
        for (int64_t t = c0; t < c1; t += 2) {
          const RowTile* rt = rts.data() + t;
          if (passes && t + 1 < c1) {
            const int64_t pairs = (v1 - v0) / 2, steps = k2 / 16;
            if (claim) claim_out(rt, 2, t * 16, v0 * 16, (v1 - v0) * 16, y, n);
            for (int64_t s0 = 0; s0 < steps; s0 += kPassSteps)
              for (int64_t i = 0; i < pairs; ++i)
                block<2, 2>(rt, w + (v0 + 2 * i) * k2 * 32, k2, sums + i * 1024, s0,
                            std::min(steps, s0 + kPassSteps));
            for (int64_t i = 0; i < pairs; ++i)
              store(sums + i * 1024, 2, 2, rt, t * 16, v0 + 2 * i, bias, y, n);
            if ((v1 - v0) % 2) {  // the group's odd panel, in one pass
              block_nt<2>(1, rt, w + (v1 - 1) * k2 * 32, k2, acc);
              store(acc, 2, 1, rt, t * 16, v1 - 1, bias, y, n);
            }
          } else if (t + 1 < c1) {
            for (int64_t v = v0; v < v1; v += 2) {
              const int nt = static_cast<int>(std::min<int64_t>(2, v1 - v));
              if (claim) claim_out(rt, 2, t * 16, v * 16, nt * 16, y, n);
              block_nt<2>(nt, rt, w + v * k2 * 32, k2, acc);
              store(acc, 2, nt, rt, t * 16, v, bias, y, n);
            }
          } else {
            for (int64_t v = v0; v < v1; v += kGroup) {
              const int nt = static_cast<int>(std::min<int64_t>(kGroup, v1 - v));
              block_nt<1>(nt, rt, w + v * k2 * 32, k2, acc);
              store(acc, 1, nt, rt, t * 16, v, bias, y, n);
            }
          }
        }
      }
    }
    _tile_release();
  });
}

// SwiGLU's product fused with its elementwise half: out [m, n] = silu(g) *
// u, where [g | u] = x [m, k] W^T (+ bias) is the gate_up projection (W
// packed as `vectors` panels, the first half the gate's).  Each block
// multiplies gate panel v and up panel v + vectors / 2 for its rows (the
// same TDPBF16PS chains as `gemm`), rounds each to bf16 as `store` does,
// and writes silu(g) (looked up in `table`, silu_table.h) times u rounded
// as silu_mul.cpp rounds it: the bits of `gemm` then `silu_mul`, without
// the projection's output stored and read again.  For K that two row tiles
// keep in L1 (k <= kL1Bytes / 64; `gemm` takes larger K in passes).
// Switched off by preempt_serve::set_swiglu_fused (studies time the two
// operators against the fused one in one process).
inline std::atomic<bool>& swiglu_switch() {
  static std::atomic<bool> on{true};
  return on;
}

inline bool swiglu_fits(int64_t k, int64_t vectors) {
  return swiglu_switch().load(std::memory_order_relaxed) && usable(k) && vectors % 2 == 0 &&
         2 * 16 * k * 2 <= kL1Bytes;
}

inline void store_swiglu(const float* acc, int mt, const RowTile* rt, int64_t m, int64_t v,
                         int64_t half, const float* bias, const uint16_t* table, uint16_t* out,
                         int64_t n) {
  for (int i = 0; i < mt; ++i)
    for (int64_t r = 0; r < rt[i].rows; ++r) {
      const float* a = acc + (i * 16 + r) * 32;
      __m512 g = _mm512_loadu_ps(a), u = _mm512_loadu_ps(a + 16);
      if (bias != nullptr) {
        g = _mm512_add_ps(g, _mm512_loadu_ps(bias + v * 16));
        u = _mm512_add_ps(u, _mm512_loadu_ps(bias + (v + half) * 16));
      }
      const __m512i gb = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(g));
      const __m512i ub = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(u));
      const __m512 silu =
          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_i32gather_epi32(gb, table, 2), 16));
      const __m512 prod = _mm512_mul_ps(silu, _mm512_castsi512_ps(_mm512_slli_epi32(ub, 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m + i * 16 + r) * n + v * 16),
                          _mm512_cvtepi32_epi16(preempt_serve_vec::bf16_bits(prod)));
    }
}

inline void gemm_swiglu(const uint16_t* x, int64_t lda, int64_t m, const uint16_t* w, int64_t k,
                        int64_t vectors, const float* bias, const uint16_t* table,
                        uint16_t* out) {
  const int64_t k2 = k / 2, half = vectors / 2, n = half * 16, apart = half * k2 * 32;
  const int64_t tiles = (m + 15) / 16;
  std::vector<uint16_t> pad;
  const std::vector<RowTile> rts = row_tiles(x, lda, m, k, pad);
  const int64_t chunk = std::max<int64_t>(2, kChunkBytes / (16 * k * 2) / 2 * 2);
  // Gate panels a thread's step takes (each with its up panel): as `gemm`'s
  // groups, counted in weight panels.
  const int64_t group = (tiles > 2 ? kWideGroup : kGroup) / 2;
  const int64_t groups = (half + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    configure();
    alignas(64) float acc[2 * 16 * 2 * 16];
    for (int64_t c0 = 0; c0 < tiles; c0 += chunk) {
      const int64_t c1 = std::min(tiles, c0 + chunk);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t v0 = g * group, v1 = std::min(half, v0 + group);
        for (int64_t t = c0; t < c1; t += 2) {
          const RowTile* rt = rts.data() + t;
          const int mt = t + 1 < c1 ? 2 : 1;
          for (int64_t v = v0; v < v1; ++v) {
            if (mt == 2) block<2, 2>(rt, w + v * k2 * 32, k2, acc, 0, -1, apart);
            else block<1, 2>(rt, w + v * k2 * 32, k2, acc, 0, -1, apart);
            store_swiglu(acc, mt, rt, t * 16, v, half, bias, table, out, n);
          }
        }
      }
    }
    _tile_release();
  });
}

}  // namespace preempt_serve_gemm_amx

#endif  // PAGED_DECODE_AMX
