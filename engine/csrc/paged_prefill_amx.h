// The prefill operator's bf16 products on AMX tiles (paged_prefill.cpp, bf16
// tiles with the bf16 dot product), for builds whose CPU has AMX.
//
// A tile of the prefill holds up to 64 query rows (the query heads of one KV
// head for consecutive tokens) and walks the keys in steps (32 keys on the
// vectors, kKeys on the tiles, in parts of 32); its scores
// lie [key][rows] and its output sums [dim][rows].  On the vectors each
// key's score for 16 rows costs one VDPBF16PS per pair of dims, and each
// value element one FMA per 16 rows.  On the tiles:
//  - scores: S^T[16 keys x 16 rows] += K[16 keys x 32 dims] . Q^T, the keys
//    as the left-hand tile straight from the cache (16 rows of 64 bytes: a
//    tiles-layout piece as it lies, or 16 token rows of the row layout at
//    the cache's token stride, one block holding all 16 since blocks hold a
//    multiple of 16 tokens), the queries as the right-hand tile read from
//    the vector path's transposed copy, whose [dim pair][row] words are the
//    pair-interleaved layout the tile wants, stored where the vector path
//    keeps its scores;
//  - weighted sum: O^T[16 dims x 16 rows] += V^T[16 dims x 32 keys] . P, the
//    output sums' transposed rows loaded and stored as they lie, P's pairs
//    of keys interleaved into the right-hand tile from the probabilities'
//    [key][rows] vectors, and V^T built once per call, sequence and KV
//    head for all of its tiles: a 16-dim column's pairs of keys as 16
//    words each (the tiles layout's rows as they lie; two rows of the row
//    layout interleaved), transposed 16 x 16.  P is rounded to bf16 once
//    (to nearest even), as the vectors' key pairs take it
//    (paged_prefill_avx512.h, weighted_sum_pairs) and ATen's CPU flash
//    attention does: one product a 32-key part and 16 dims, 1.07-1.23x the
//    operator's speed of two terms (hi, p's bits cut to bf16's, and lo =
//    bf16(p - hi), each multiplied, so that p keeps ~16 bits), which
//    set_prefill_value_pairs(false) brings back (products exact, float32
//    sums either way); the decode operator takes p the same way
//    (paged_decode_amx.h).
// The softmax stays on the vectors (the scores' scale folded into its
// exponent; paged_prefill_avx512.h); with p in one term, e^x as 2^(x log2 e)
// on a short polynomial, which p's rounding to bf16 leaves room for
// (preempt_serve_amx::short_exp_switch, as the decode operator's).
//
// A score and an output sum are each one TDPBF16PS chain over their key's
// and row's pairs, in order: fixed by the key (or the dim) and the row
// alone, whatever tile or chunk the row falls in; keys past a
// row's position weigh exactly 0 in both terms.  So deterministic mode's
// guarantee holds as on the vectors (paged_prefill.cpp), and the two cache
// layouts give the same bits.  Their rounding differs from the vectors',
// so a build takes one or the other by the cache alone (block size, the
// tiles' switch), never by the batch.
#pragma once

#include "paged_decode_amx.h"
#include "vec16.h"

#include <limits>

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

// Keys a step of the online softmax takes on the tiles (paged_prefill.cpp
// and paged_prefill_avx512.h; 32 on the vectors): each step's output sums
// are loaded into tiles and stored once, and a step's scores are read back
// long after their tile stores (no forwarding from those to loads).
constexpr int64_t kKeys = 128;

// Every tile 16 rows of 64 bytes: 16 keys by 32 dims (the keys), 16 pairs
// of dims by 16 rows (the queries), 16 keys by 16 rows of float32 scores;
// 16 dims by 32 keys (the values), 16 pairs of keys by 16 rows (p's terms),
// 16 dims by 16 rows of float32 sums.
inline void configure() { preempt_serve_amx::configure_16x64(); }

// Scores of a step's keys [0, kt) for R = 16 * RV rows into s [keys][R],
// unscaled (the softmax scales them), 16 keys at a time up to kt's next 16:
// kp[t] is key t's first piece (past kt, any key's), `piece` elements
// between a key's 32-dim pieces, `key_stride` bytes between keys; qt the
// queries as [DIM / 2][R] pairs of dims.  Tiles 0..RV-1 sum the row tiles'
// scores, 4 holds the keys' piece, 5 and 6 the queries' by turns.
template <int DIM, int RV, typename T>
inline void scores(const T* const* kp, int64_t kt, int64_t piece, int64_t key_stride,
                   const int32_t* qt, float* s) {
  static_assert(sizeof(T) == 2, "bfloat16 keys");
  static_assert(RV == 1 || RV == 2 || RV == 4, "a tile's 16, 32 or 64 rows");
  constexpr int R = 16 * RV;
  constexpr int64_t ld = R * static_cast<int64_t>(sizeof(float));
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
  }
}

// V^T of a step's keys [0, kt), 32 at a time, into vt [32-key part][DIM /
// 16][16][16] words (column n's 16 dims by 16 words, a word the pair of
// keys 2w, 2w + 1), keys past kt zero up to the part's end (a step's last
// keys hold whatever their block held; p = 0 times a NaN is NaN).  vp[t]:
// key t's values, a row of DIM (rows layout) or its pair's row of column 0
// (tiles layout, columns `column` elements apart).
template <int DIM, typename T>
inline void values_transposed(const T* const* vp, int64_t kt, bool tiles, int64_t column,
                              uint32_t* vt) {
  __m512i r[16];
  for (int64_t k0 = 0; k0 < kt; k0 += 32, vt += DIM * 16) {
    for (int n = 0; n < DIM / 16; ++n) {
      for (int w = 0; w < 16; ++w) {
        const int64_t t = k0 + 2 * w;
        const int64_t live = std::min<int64_t>(2, kt - t);
        if (live <= 0) {
          r[w] = _mm512_setzero_si512();
        } else if (tiles) {
          const __m512i x = _mm512_loadu_si512(vp[t] + n * column);
          r[w] = live == 2 ? x : _mm512_maskz_mov_epi16(0x55555555u, x);
        } else {
          const __m512i a = _mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp[t] + 16 * n)));
          const __m512i b = live == 2 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                            reinterpret_cast<const __m256i*>(vp[t + 1] + 16 * n)))
                                      : _mm512_setzero_si512();
          r[w] = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
        }
      }
      preempt_serve_vec::transpose16(r);
      for (int d = 0; d < 16; ++d) _mm512_storeu_si512(vt + (16 * n + d) * 16, r[d]);
    }
  }
}

// Probabilities of one row vector for a step's keys (s: the vector's
// scores, rows R floats apart; keys past kt and masked ones weigh 0),
// e^(s * scale - m), as the right-hand tiles' terms, written over the
// scores up to the last 32-key part's end: the pair of keys w's hi words
// in row 2w, with TWO its lo words in row 2w + 1 (rows whose scores were
// read), hi = p's bits cut to bf16's (p - hi exact), lo = bf16(p - hi)
// rounded to nearest even; without TWO, p rounded to bf16 to nearest even
// in row 2w alone, as the vectors' key pairs take it.  Returns the float32
// sum of what the tiles weigh (p, or without TWO p's rounding, so that the
// weights still add up to one): four running sums (key t in sum t % 4, so
// that the additions' latency does not chain the step), added at the end.
// EXP2 (one term only): scale and m come multiplied by log2(e), and p =
// 2^(s * scale - m) on the short polynomial, which bf16's rounding of p
// leaves room for.
template <int RV, bool TWO, bool EXP2 = false>
inline __m512 probabilities(float* s, int64_t kt, __m512 scale, __m512 m) {
  static_assert(!(TWO && EXP2), "two terms keep ~16 bits of p: the full exponential");
  constexpr int R = 16 * RV;
  const __m512i top = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // Word i of a pair: bf16 i of the even key's 16, then of the odd key's.
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  const auto p_of = [&](int64_t t) {
    const __m512 x = _mm512_loadu_ps(s + t * R);
    const __mmask16 live = _mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ);
    const __m512 y = _mm512_fmsub_ps(x, scale, m);
    if constexpr (EXP2) {
      return _mm512_maskz_mov_ps(live, preempt_serve_vec::exp2_nonpositive16_for_bf16(y));
    } else {
      return _mm512_maskz_mov_ps(live, preempt_serve_vec::exp_nonpositive16(y));
    }
  };
  // Keys 4i .. 4i + 3: two pairs, one a sum each.  Groups whose four keys
  // all lie before kt take no branch per key (most of a step: the keys of
  // a group are independent, and the loop's exponentials overlap).
  const int64_t whole = kt / 4, groups = (kt + 31) / 32 * 8;
  for (int64_t i = 0; i < groups; ++i) {
    __m512 p[4];
    if (i < whole) {
      for (int h = 0; h < 4; ++h) p[h] = p_of(4 * i + h);
    } else {
      for (int h = 0; h < 4; ++h) p[h] = 4 * i + h < kt ? p_of(4 * i + h) : _mm512_setzero_ps();
    }
    for (int k = 0; k < 2; ++k) {
      const int64_t w = 2 * i + k;
      if constexpr (!TWO) {
        // One rounding of the pair to bf16 (to nearest even), interleaved:
        // the words stored are the tiles' terms, and the same words widened
        // (the low word shifted up, the high word masked) are the rounded p
        // that the sums add.
        const __m512i both = _mm512_permutexvar_epi16(
            pairs, (__m512i)_mm512_cvtne2ps_pbh(p[2 * k + 1], p[2 * k]));
        _mm512_storeu_si512(s + 2 * w * R, both);
        sum[2 * k] = _mm512_add_ps(sum[2 * k], _mm512_castsi512_ps(_mm512_slli_epi32(both, 16)));
        sum[2 * k + 1] =
            _mm512_add_ps(sum[2 * k + 1], _mm512_castsi512_ps(_mm512_and_si512(both, top)));
        continue;
      }
      sum[2 * k] = _mm512_add_ps(sum[2 * k], p[2 * k]);
      sum[2 * k + 1] = _mm512_add_ps(sum[2 * k + 1], p[2 * k + 1]);
      const __m512i e = _mm512_castps_si512(p[2 * k]), o = _mm512_castps_si512(p[2 * k + 1]);
      const __m512i eh = _mm512_and_si512(e, top), oh = _mm512_and_si512(o, top);
      _mm512_storeu_si512(s + 2 * w * R, _mm512_or_si512(_mm512_srli_epi32(e, 16), oh));
      const __m512 el = _mm512_sub_ps(p[2 * k], _mm512_castsi512_ps(eh));
      const __m512 ol = _mm512_sub_ps(p[2 * k + 1], _mm512_castsi512_ps(oh));
      const __m512i lo = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(ol, el));
      _mm512_storeu_si512(s + (2 * w + 1) * R, _mm512_permutexvar_epi16(pairs, lo));
    }
  }
  return _mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3]));
}

// ot [DIM][R] += V^T . p over a step's keys [0, kt) (vt from
// values_transposed, p: p's terms from probabilities<RV, TWO>, in the
// scores' rows).  Per row tile and four (or two) 16-dim columns, the output
// tiles stay in 0-3 through the step's 32-key parts, loaded and stored
// once; 4 and 7 hold V^T's columns by turns, 5 and 6 p's two terms (5
// alone without TWO).  An output sum adds its parts in order, hi then lo in
// each.
template <int DIM, int RV, bool TWO>
inline void weighted_sum(const uint32_t* vt, int64_t kt, const float* p, float* ot) {
  constexpr int R = 16 * RV;
  constexpr int N = DIM / 16;
  constexpr int64_t ld = R * static_cast<int64_t>(sizeof(float));
  const int64_t parts = (kt + 31) / 32;
// Output tile C += V^T's column at a (into tile A) . p's terms.
#define PS_PV(C, A, a)                 \
  _tile_loadd(A, a, 64);               \
  _tile_dpbf16ps(C, A, 5);             \
  if constexpr (TWO) _tile_dpbf16ps(C, A, 6);
  for (int v = 0; v < RV; ++v) {
    float* o = ot + 16 * v;
    for (int n = 0; n < N; n += 4) {
      const bool four = n + 4 <= N;  // else a last pair of columns (N is even)
      _tile_loadd(0, o + n * 16 * R, ld);
      _tile_loadd(1, o + (n + 1) * 16 * R, ld);
      if (four) {
        _tile_loadd(2, o + (n + 2) * 16 * R, ld);
        _tile_loadd(3, o + (n + 3) * 16 * R, ld);
      }
      for (int64_t k = 0; k < parts; ++k) {
        _tile_loadd(5, p + 32 * k * R + 16 * v, 2 * ld);
        if constexpr (TWO) _tile_loadd(6, p + (32 * k + 1) * R + 16 * v, 2 * ld);
        const uint32_t* a = vt + k * DIM * 16 + n * 256;
        PS_PV(0, 4, a)
        PS_PV(1, 7, a + 256)
        if (four) {
          PS_PV(2, 4, a + 512)
          PS_PV(3, 7, a + 768)
        }
      }
      _tile_stored(0, o + n * 16 * R, ld);
      _tile_stored(1, o + (n + 1) * 16 * R, ld);
      if (four) {
        _tile_stored(2, o + (n + 2) * 16 * R, ld);
        _tile_stored(3, o + (n + 3) * 16 * R, ld);
      }
    }
  }
#undef PS_PV
}

}  // namespace paged_prefill_amx

#endif  // PAGED_DECODE_AMX
