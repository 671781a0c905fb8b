// The prefill operator's scores on AMX tiles (paged_prefill.cpp, bf16 tiles
// with the bf16 dot product), for builds whose CPU has AMX.
//
// A tile of the prefill holds up to 64 query rows (the query heads of one KV
// head for consecutive tokens) and walks the keys 32 at a time; its scores
// lie [key][rows].  On the vectors each key's score for 16 rows costs one
// VDPBF16PS per pair of dims.  On the tiles, S^T[16 keys x 16 rows] +=
// K[16 keys x 32 dims] . Q^T: the keys as the left-hand tile straight from
// the cache (16 rows of 64 bytes: a tiles-layout piece as it lies, or 16
// token rows of the row layout at the cache's token stride, one block
// holding all 16 since blocks hold a multiple of 16 tokens), the queries as
// the right-hand tile read from the vector path's transposed copy, whose
// [dim pair][row] words are the pair-interleaved layout the tile wants, and
// the result stored into the scores as the vector path lays them out.  The
// softmax and the weighted sum stay on the vectors.
//
// A score is one TDPBF16PS chain over its key's and row's pairs of dims, in
// order, then the scale: fixed by the key and the row alone, whatever tile
// or chunk the row falls in, so deterministic mode's guarantee holds as on
// the vectors (paged_prefill.cpp), and the two cache layouts give the same
// bits.  Its rounding differs from the VDPBF16PS chain's, so a build takes
// one or the other by the cache alone (block size, the tiles' switch),
// never by the batch.
#pragma once

#include "paged_decode_amx.h"

#if defined(PAGED_DECODE_AMX)
#define PAGED_PREFILL_AMX 1

namespace paged_prefill_amx {

// Every key tile must lie within one block; switched off with the decode's
// tiles (set_decode_amx).
inline bool usable(int64_t block_size, int64_t dim) {
  return block_size % 16 == 0 && dim % 32 == 0 &&
         preempt_serve_amx::switched_on().load(std::memory_order_relaxed) &&
         preempt_serve_amx::tiles_permitted();
}

// Every tile 16 rows of 64 bytes: 16 keys by 32 dims (the keys), 16 pairs
// of dims by 16 rows (the queries), 16 keys by 16 rows of float32 scores.
inline void configure() { preempt_serve_amx::configure_16x64(); }

// Scores of keys [0, kt) of a 32-key step for R = 16 * RV rows into
// s [32][R], scaled: kp[t] is key t's first piece, `piece` elements
// between a key's 32-dim pieces, `key_stride` bytes between keys; qt the
// queries as [DIM / 2][R] pairs of dims.  Tiles 0..RV-1 sum the row tiles'
// scores, 4 holds the keys' piece, 5 and 6 the queries' by turns.
template <int DIM, int RV, typename T>
inline void scores(const T* const* kp, int64_t kt, int64_t piece, int64_t key_stride,
                   const int32_t* qt, float scale, float* s) {
  static_assert(sizeof(T) == 2, "bfloat16 keys");
  static_assert(RV == 1 || RV == 2 || RV == 4, "a tile's 16, 32 or 64 rows");
  constexpr int R = 16 * RV;
  constexpr int64_t ld = R * static_cast<int64_t>(sizeof(float));
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t u = 0; 16 * u < kt; ++u) {
    _tile_zero(0);
    if constexpr (RV > 1) _tile_zero(1);
    if constexpr (RV > 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int c = 0; c < DIM / 32; ++c) {
      const int32_t* q = qt + c * 16 * R;
      _tile_loadd(4, kp[16 * u] + c * piece, key_stride);
      _tile_loadd(5, q, ld);
      _tile_dpbf16ps(0, 4, 5);
      if constexpr (RV > 1) {
        _tile_loadd(6, q + 16, ld);
        _tile_dpbf16ps(1, 4, 6);
      }
      if constexpr (RV > 2) {
        _tile_loadd(5, q + 32, ld);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, q + 48, ld);
        _tile_dpbf16ps(3, 4, 6);
      }
    }
    float* su = s + 16 * u * R;
    _tile_stored(0, su, ld);
    if constexpr (RV > 1) _tile_stored(1, su + 16, ld);
    if constexpr (RV > 2) {
      _tile_stored(2, su + 32, ld);
      _tile_stored(3, su + 48, ld);
    }
    for (int t = 0; t < 16; ++t)
      for (int v = 0; v < RV; ++v) {
        float* p = su + t * R + 16 * v;
        _mm512_storeu_ps(p, _mm512_mul_ps(_mm512_loadu_ps(p), vscale));
      }
  }
}

}  // namespace paged_prefill_amx

#endif  // PAGED_DECODE_AMX
