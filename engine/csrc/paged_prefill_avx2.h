// The prefill operator's tiles (paged_prefill.cpp) for AVX2 + FMA builds:
// the AVX512 path's scheme on 8-lane vectors.  A tile holds up to 64 rows
// (64 / group tokens of one KV head: each key read from memory serves as
// many rows as there), 1, 2, 4 or 8 vectors of rows, taken four vectors at a
// time against a step's keys (in L1 by then), so that the 8 accumulators of
// either product, the row vectors and a broadcast fit the 16 ymm registers.
// Each row keeps its own lane through the scores, the online softmax and the
// weighted sum, over key tiles at fixed positions (0, 32, 64, ...): a row's
// arithmetic does not depend on its tile or chunk, as deterministic mode
// needs (paged_prefill.cpp).  Included by it in builds without AVX512; uses
// its Chunk, Layout, cache_row and Scratch; its driver `prefill_vec` runs these
// tiles.

#pragma once

#include <immintrin.h>

#define PAGED_PREFILL_VEC 1

namespace {

constexpr int64_t kLanes = 8;  // a tile's 64 rows: at most 8 vectors

using preempt_serve_vec::exp_nonpositive8;
using preempt_serve_vec::prefetch_span;

// 8 bfloat16 values widened to float32, in order.
inline __m256 widen8(const at::BFloat16* p) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}

template <int DIM>
inline void widen_row(const at::BFloat16* src, float* dst) {
  for (int c = 0; c < DIM / 8; ++c) _mm256_storeu_ps(dst + 8 * c, widen8(src + 8 * c));
}

template <typename scalar_t, int DIM, int RV>
void prefill_tile(const scalar_t* q, const scalar_t* kc, const scalar_t* vc,
                  const int64_t* table, int64_t start_pos, int64_t q_base, const Chunk& c,
                  float scale, scalar_t* out, const Layout& l, Scratch& sc) {
  constexpr bool kBf16 = std::is_same_v<scalar_t, at::BFloat16>;
  constexpr int R = 8 * RV;
  constexpr int RG = RV < 4 ? RV : 4;  // row vectors taken together
  constexpr int KS = 8 / RG;  // keys per step of the scores
  constexpr int DS = 8 / RG;  // output elements per step of the weighted sum
  static_assert(kKeyTile % KS == 0 && DIM % DS == 0, "whole steps");
  const int64_t group = l.group, kh = c.kv_head;
  const int64_t rows = c.count * group;
  // Row r may attend keys up to base + r / group (inclusive).
  const int64_t base = start_pos + c.first;
  const int64_t num_keys = base + c.count;
  constexpr int64_t row_bytes = DIM * static_cast<int64_t>(sizeof(scalar_t));

  // Queries, transposed and scaled; padding rows are zero (finite scores,
  // never stored).
  float* qt = sc.qt.data();
  for (int64_t r = 0; r < R; ++r) {
    if (r >= rows) {
      for (int d = 0; d < DIM; ++d) qt[d * R + r] = 0.0f;
      continue;
    }
    const scalar_t* qp =
        q + ((q_base + c.first + r / group) * l.heads + kh * group + r % group) * DIM;
    for (int d = 0; d < DIM; ++d) qt[d * R + r] = static_cast<float>(qp[d]) * scale;
  }
  float* ot = sc.ot.data();
  std::memset(ot, 0, sizeof(float) * DIM * R);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m[RV], lsum[RV];
  for (int v = 0; v < RV; ++v) {
    m[v] = neg_inf;
    lsum[v] = _mm256_setzero_ps();
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);

  const scalar_t* kp[kKeyTile];
  const scalar_t* vp[kKeyTile];
  for (int64_t j0 = 0; j0 < num_keys; j0 += kKeyTile) {
    const int64_t kt = std::min<int64_t>(kKeyTile, num_keys - j0);
    for (int64_t t = 0; t < kt; ++t) {
      const int64_t off = cache_row(table, j0 + t, kh, l);
      kp[t] = kc + off;
      vp[t] = vc + off;
    }
    // A short last step reuses its last row (scores computed, never used).
    for (int64_t t = kt; t < kKeyTile; ++t) kp[t] = kp[kt - 1];
    // The next step's rows lie anywhere in the cache: fetch them now.
    for (int64_t t = 0; t < kKeyTile && j0 + kKeyTile + t < num_keys; ++t) {
      const int64_t off = cache_row(table, j0 + kKeyTile + t, kh, l);
      prefetch_span(kc + off, row_bytes);
      prefetch_span(vc + off, row_bytes);
    }
    float* s = sc.s.data();
    // Scores [key][rows]: one key's scores for 8 rows from broadcasts of its
    // elements, each row's dot product one FMA chain over the dims in order.
    const float* krow[kKeyTile];
    if constexpr (kBf16) {
      for (int64_t t = 0; t < kKeyTile; ++t) {
        if (t < kt) widen_row<DIM>(reinterpret_cast<const at::BFloat16*>(kp[t]),
                                   sc.kw.data() + t * DIM);
        krow[t] = sc.kw.data() + std::min<int64_t>(t, kt - 1) * DIM;
      }
    } else {
      for (int64_t t = 0; t < kKeyTile; ++t) krow[t] = reinterpret_cast<const float*>(kp[t]);
    }
    for (int g = 0; g < R; g += 8 * RG) {
      for (int64_t t0 = 0; t0 < kt; t0 += KS) {
        __m256 acc[KS][RG];
        for (int k = 0; k < KS; ++k)
          for (int v = 0; v < RG; ++v) acc[k][v] = _mm256_setzero_ps();
        for (int d = 0; d < DIM; ++d) {
          __m256 qv[RG];
          for (int v = 0; v < RG; ++v) qv[v] = _mm256_loadu_ps(qt + d * R + g + 8 * v);
          for (int k = 0; k < KS; ++k) {
            const __m256 kb = _mm256_broadcast_ss(krow[t0 + k] + d);
            for (int v = 0; v < RG; ++v) acc[k][v] = _mm256_fmadd_ps(kb, qv[v], acc[k][v]);
          }
        }
        for (int k = 0; k < KS; ++k)
          for (int v = 0; v < RG; ++v) _mm256_storeu_ps(s + (t0 + k) * R + g + 8 * v, acc[k][v]);
      }
    }
    // Causal mask: key j is hidden from the rows before (j - base) * group.
    for (int64_t t = 0; t < kt; ++t) {
      const int64_t j = j0 + t;
      if (j <= base) continue;
      const __m256i first_live = _mm256_set1_epi32(static_cast<int32_t>((j - base) * group));
      for (int v = 0; v < RV; ++v) {
        const __m256 dead = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(first_live, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * v))));
        float* sp = s + t * R + 8 * v;
        _mm256_storeu_ps(sp, _mm256_blendv_ps(_mm256_loadu_ps(sp), neg_inf, dead));
      }
    }
    // Online softmax, elementwise over the rows' vectors.
    __m256 alpha[RV];
    bool rescale = false;
    for (int v = 0; v < RV; ++v) {
      __m256 mx = m[v];
      for (int64_t t = 0; t < kt; ++t) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t * R + 8 * v));
      // m starts at -inf; key 0 is live for every row, so mx is finite.
      alpha[v] = exp_nonpositive8(_mm256_sub_ps(m[v], mx));
      rescale |= j0 > 0 && _mm256_movemask_ps(_mm256_cmp_ps(mx, m[v], _CMP_NEQ_OQ)) != 0;
      m[v] = mx;
      __m256 psum = _mm256_setzero_ps();
      for (int64_t t = 0; t < kt; ++t) {
        float* sp = s + t * R + 8 * v;
        const __m256 x = _mm256_loadu_ps(sp);
        const __m256 live = _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ);
        const __m256 p = _mm256_and_ps(live, exp_nonpositive8(_mm256_sub_ps(x, mx)));
        _mm256_storeu_ps(sp, p);
        psum = _mm256_add_ps(psum, p);
      }
      lsum[v] = _mm256_fmadd_ps(lsum[v], alpha[v], psum);
    }
    if (rescale) {
      for (int d = 0; d < DIM; ++d)
        for (int v = 0; v < RV; ++v) {
          float* op = ot + d * R + 8 * v;
          _mm256_storeu_ps(op, _mm256_mul_ps(_mm256_loadu_ps(op), alpha[v]));
        }
    }
    // Weighted sum of the values, transposed: ot[d][rows] += v[t][d] * p[t][rows].
    const float* vrow[kKeyTile];
    if constexpr (kBf16) {
      for (int64_t t = 0; t < kt; ++t) {
        widen_row<DIM>(reinterpret_cast<const at::BFloat16*>(vp[t]), sc.vw.data() + t * DIM);
        vrow[t] = sc.vw.data() + t * DIM;
      }
    } else {
      for (int64_t t = 0; t < kt; ++t) vrow[t] = reinterpret_cast<const float*>(vp[t]);
    }
    for (int g = 0; g < R; g += 8 * RG) {
      for (int d0 = 0; d0 < DIM; d0 += DS) {
        __m256 acc[DS][RG];
        for (int e = 0; e < DS; ++e)
          for (int v = 0; v < RG; ++v)
            acc[e][v] = _mm256_loadu_ps(ot + (d0 + e) * R + g + 8 * v);
        for (int64_t t = 0; t < kt; ++t) {
          __m256 pv[RG];
          for (int v = 0; v < RG; ++v) pv[v] = _mm256_loadu_ps(s + t * R + g + 8 * v);
          const float* vr = vrow[t] + d0;
          for (int e = 0; e < DS; ++e) {
            const __m256 b = _mm256_broadcast_ss(vr + e);
            for (int v = 0; v < RG; ++v) acc[e][v] = _mm256_fmadd_ps(b, pv[v], acc[e][v]);
          }
        }
        for (int e = 0; e < DS; ++e)
          for (int v = 0; v < RG; ++v)
            _mm256_storeu_ps(ot + (d0 + e) * R + g + 8 * v, acc[e][v]);
      }
    }
  }
  alignas(32) float inv[R];
  for (int v = 0; v < RV; ++v) {
    _mm256_store_ps(inv + 8 * v, _mm256_div_ps(_mm256_set1_ps(1.0f), lsum[v]));
  }
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* op =
        out + ((q_base + c.first + r / group) * l.heads + kh * group + r % group) * DIM;
    for (int d = 0; d < DIM; ++d) op[d] = static_cast<scalar_t>(ot[d * R + r] * inv[r]);
  }
}

}  // namespace
