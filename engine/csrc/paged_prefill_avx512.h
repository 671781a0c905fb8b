// The prefill operator's tiles (paged_prefill.cpp) for AVX512 builds: up to
// 64 rows (64 / group tokens of one KV head) in 1, 2 or 4 vectors, their
// queries transposed [dim][rows], a step's 32 keys' scores [key][rows], the
// online softmax elementwise across the rows' vectors, the output sums
// transposed [dim][rows] and turned back into rows once at the end.  bf16
// scores take VDPBF16PS where the build has the bf16 dot product, and with
// AMX (paged_prefill_amx.h) the scores and the weighted sum go through
// tiles.  Included by paged_prefill.cpp in AVX512 builds; uses its Chunk,
// Layout and Scratch; its driver `prefill_vec` runs these tiles.
#pragma once

#include <immintrin.h>

#include <atomic>

#define PAGED_PREFILL_AVX512 1
#define PAGED_PREFILL_VEC 1

#include "paged_prefill_amx.h"
#include "vec16.h"

namespace {

constexpr int64_t kLanes = 16;  // a tile's 64 rows: at most 4 vectors
// How far a row's running maximum may trail its true one (softmax below).
constexpr float kSlack = 8.0f;

using preempt_serve_vec::exp_nonpositive16;

// 16 bfloat16 values widened to float32, in order.
inline __m512 widen16(const at::BFloat16* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

template <int DIM>
inline void widen_row(const at::BFloat16* src, float* dst) {
  for (int c = 0; c < DIM / 16; ++c) _mm512_storeu_ps(dst + 16 * c, widen16(src + 16 * c));
}

using preempt_serve_vec::prefetch_span;

// Where keys [j, j + n) of KV head kh lie in a sequence's blocks (`table`),
// one division for all of them (the block and offset carried on): rows as
// cache_row says; in the tiles layout, a key's first 32-dim piece and its
// pair's first 16-dim column of values.  Keys into ks, values into vs,
// either left out where null.
template <int DIM, typename T>
inline void locate_rows(const T* kc, const T* vc, const int64_t* table, int64_t kh,
                        const Layout& l, int64_t j, int64_t n, const T** ks, const T** vs) {
  const int64_t k_head = l.tiles ? kh * (DIM / 32) * l.block_size * 32 : kh * DIM;
  const int64_t v_head = l.tiles ? kh * (DIM / 16) * (l.block_size / 2) * 32 : kh * DIM;
  const int64_t k_token = l.tiles ? 32 : l.tok_stride();
  int64_t b = j / l.block_size, off = j % l.block_size;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t blk = table[b] * l.blk_stride();
    if (ks != nullptr) ks[t] = kc + blk + k_head + off * k_token;
    if (vs != nullptr) vs[t] = vc + blk + v_head + (l.tiles ? off / 2 * 32 : off * l.tok_stride());
    if (++off == l.block_size) {
      off = 0;
      ++b;
    }
  }
}

#ifdef PAGED_PREFILL_AMX
// V^T of keys [0, ctx) of a sequence's KV head kh (its block table), in
// 32-key parts (paged_prefill_amx::values_transposed's layout), zero past ctx.
template <int DIM>
void values_of_sequence(const at::BFloat16* vc, const int64_t* table, int64_t ctx, int64_t kh,
                        const Layout& l, uint32_t* vt) {
  const at::BFloat16* vp[32];
  for (int64_t k0 = 0; k0 < ctx; k0 += 32, vt += DIM * 16) {
    const int64_t n = std::min<int64_t>(32, ctx - k0);
    locate_rows<DIM, at::BFloat16>(nullptr, vc, table, kh, l, k0, n, nullptr, vp);
    paged_prefill_amx::values_transposed<DIM>(vp, n, l.tiles, (l.block_size / 2) * 32, vt);
  }
}
#endif

#ifdef __AVX512BF16__
// Whether bf16 weighted sums take VDPBF16PS on pairs of keys (`weighted_sum_pairs`)
// rather than float32 FMAs key by key, and on AMX tiles p in one bf16 term
// rather than two (preempt_serve::set_prefill_value_pairs: studies time both
// in one process).
inline std::atomic<bool>& value_pairs_switch() {
  static std::atomic<bool> on{true};
  return on;
}

using preempt_serve_vec::bf16_round;

// ot[d][rows] += sum over the step's keys of v[t][d] * p[t][rows] on
// VDPBF16PS, two keys an instruction: key pairs (2i, 2i + 1) from the step's
// first key, which lies at a multiple of the step's length, so a pair is the
// same keys for every row and tile, and each row's sum runs over them in one
// order (deterministic mode's invariance holds).  p is rounded to bf16 (to
// nearest even) for it, as ATen's flash attention on CPU and FlashAttention
// on GPUs round it for their bf16 matmul (the softmax's sum is then of the
// rounded p too: prefill_tile).  `vp` as prefill_tile locates it (rows: a
// key's row; tiles: its pair's first column); `wp` and `pp` are scratch for
// the step's value pairs [pairs][DIM] and probability pairs [pairs][R].
template <int DIM, int RV>
inline void weighted_sum_pairs(const at::BFloat16* const* vp, int64_t kt, const float* s,
                               float* ot, const Layout& l, uint32_t* wp, uint32_t* pp) {
  constexpr int R = 16 * RV;
  constexpr int DS = 16 / RV;
  const int64_t pairs = (kt + 1) / 2;
  const int64_t v_column = (l.block_size / 2) * 32;
  // Lane r of a pair's probabilities: bf16 p[2i][r] low, p[2i + 1][r] high.
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    const bool whole = 2 * i + 1 < kt;  // else key 2i + 1 is past the step: weight 0
    for (int v = 0; v < RV; ++v) {
      const __m512 p0 = _mm512_loadu_ps(s + 2 * i * R + 16 * v);
      const __m512 p1 = whole ? _mm512_loadu_ps(s + (2 * i + 1) * R + 16 * v)
                              : _mm512_setzero_ps();
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
      _mm512_storeu_si512(pp + i * R + 16 * v, _mm512_permutexvar_epi16(interleave, both));
    }
    uint32_t* w = wp + i * DIM;
    // Past the step, key 2i + 1's value may be any bits (its cache slot
    // unwritten): its half is cleared, so 0 * v cannot be NaN.
    const __m512i keep = _mm512_set1_epi32(whole ? -1 : 0xffff);
    if (l.tiles) {  // the pair is interleaved in the cache already
      const auto* pr = reinterpret_cast<const int32_t*>(vp[2 * i]);
      for (int n = 0; n < DIM / 16; ++n) {
        _mm512_storeu_si512(w + 16 * n,
                            _mm512_and_si512(_mm512_loadu_si512(pr + n * v_column / 2), keep));
      }
    } else {
      const at::BFloat16* v0 = vp[2 * i];
      const at::BFloat16* v1 = whole ? vp[2 * i + 1] : v0;
      for (int n = 0; n < DIM / 16; ++n) {
        const __m512i lo = _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 16 * n)));
        const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 16 * n))), 16);
        _mm512_storeu_si512(w + 16 * n, _mm512_and_si512(_mm512_or_si512(lo, hi), keep));
      }
    }
  }
  for (int d0 = 0; d0 < DIM; d0 += DS) {
    __m512 acc[DS][RV];
    for (int e = 0; e < DS; ++e)
      for (int v = 0; v < RV; ++v) acc[e][v] = _mm512_loadu_ps(ot + (d0 + e) * R + 16 * v);
    for (int64_t i = 0; i < pairs; ++i) {
      __m512bh pv[RV];
      for (int v = 0; v < RV; ++v) pv[v] = (__m512bh)_mm512_loadu_si512(pp + i * R + 16 * v);
      const uint32_t* w = wp + i * DIM + d0;
      for (int e = 0; e < DS; ++e) {
        const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(w[e]));
        for (int v = 0; v < RV; ++v) acc[e][v] = _mm512_dpbf16_ps(acc[e][v], b, pv[v]);
      }
    }
    for (int e = 0; e < DS; ++e)
      for (int v = 0; v < RV; ++v) _mm512_storeu_ps(ot + (d0 + e) * R + 16 * v, acc[e][v]);
  }
}
#endif

template <typename scalar_t, int DIM, int RV>
void prefill_tile(const scalar_t* q, const scalar_t* kc, const scalar_t* vc,
                  const int64_t* table, int64_t start_pos, int64_t q_base, const Chunk& c,
                  float scale, scalar_t* out, const Layout& l, Scratch& sc) {
  constexpr bool kBf16 = std::is_same_v<scalar_t, at::BFloat16>;
#ifdef __AVX512BF16__
  constexpr bool kNativeDot = kBf16;
#else
  constexpr bool kNativeDot = false;
#endif
  // Keys a step of the online softmax takes: the AMX tiles' steps are
  // longer (paged_prefill_amx.h, kKeys), fixed per build and dtype.
#ifdef PAGED_PREFILL_AMX
  constexpr int64_t KT = kNativeDot ? paged_prefill_amx::kKeys : kKeyTile;
#else
  constexpr int64_t KT = kKeyTile;
#endif
  static_assert(KT <= kMaxKeyTile, "the scratch holds a step");
  constexpr int R = 16 * RV;
  // 16 accumulators in either product: KS keys x RV row vectors for the
  // scores, DS output elements x RV row vectors for the weighted sum.
  constexpr int KS = 16 / RV;
  constexpr int DS = 16 / RV;
  static_assert(KT % KS == 0 && DIM % DS == 0, "whole steps");
  const int64_t group = l.group, kh = c.kv_head;
  const int64_t rows = c.count * group;
  // Row r may attend keys up to base + r / group (inclusive).
  const int64_t base = start_pos + c.first;
  const int64_t num_keys = base + c.count;
  constexpr int64_t row_bytes = DIM * static_cast<int64_t>(sizeof(scalar_t));

#ifdef PREEMPT_SERVE_VEC16
  // The tile's output rows, claimed now so that its stores at the end find
  // them in cache (the output is fresh memory; vec16.h, claim).
  for (int64_t r = 0; r < rows && preempt_serve_vec::claims_on(); ++r) {
    const char* op = reinterpret_cast<const char*>(
        out + ((q_base + c.first + r / group) * l.heads + kh * group + r % group) * DIM);
    for (int64_t b = 0; b < row_bytes; b += 64) preempt_serve_vec::claim(op + b);
    preempt_serve_vec::claim(op + row_bytes - 1);
  }
#endif
  // Queries, transposed; padding rows are zero (finite scores, never stored).
  if constexpr (kNativeDot) {
    auto* qt = reinterpret_cast<int32_t*>(sc.qt.data());
    for (int64_t r = 0; r < R; ++r) {
      const int32_t* qp = r < rows
          ? reinterpret_cast<const int32_t*>(
                q + ((q_base + c.first + r / group) * l.heads + kh * group + r % group) * DIM)
          : nullptr;
      for (int d2 = 0; d2 < DIM / 2; ++d2) qt[d2 * R + r] = qp != nullptr ? qp[d2] : 0;
    }
  } else {
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
  }
  float* ot = sc.ot.data();
  std::memset(ot, 0, sizeof(float) * DIM * R);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 m[RV], lsum[RV];
  for (int v = 0; v < RV; ++v) {
    m[v] = _mm512_set1_ps(neg_inf);
    lsum[v] = _mm512_setzero_ps();
  }
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
#ifdef __AVX512BF16__
  // Read once a tile: every step of it sums its values the same way.
  const bool pairs = kNativeDot && value_pairs_switch().load(std::memory_order_relaxed);
#endif
#ifdef PAGED_PREFILL_AMX
  const bool short_exp = preempt_serve_amx::short_exp_switch().load(std::memory_order_relaxed);
#endif

  // int32 pairs of dims between a key's 32-dim pieces; a tiles layout's
  // value columns (scalar_t elements apart).
  const int64_t k_piece = l.tiles ? l.block_size * 16 : 16;
  const int64_t v_column = (l.block_size / 2) * 32;
  // A step's key rows, and its value rows where the vectors read them (the
  // tiles read V^T: values_of_sequence).
  const auto locate = [&](int64_t j, int64_t n, const scalar_t** ks, const scalar_t** vs) {
    locate_rows<DIM, scalar_t>(kc, vc, table, kh, l, j, n, ks, l.amx ? nullptr : vs);
  };
  // This step's rows and the next one's, by turns.
  const scalar_t* key_rows[2][KT];
  const scalar_t* value_rows[2][KT];
  locate(0, std::min<int64_t>(KT, num_keys), key_rows[0], value_rows[0]);
  for (int64_t j0 = 0, turn = 0; j0 < num_keys; j0 += KT, turn ^= 1) {
    const int64_t kt = std::min<int64_t>(KT, num_keys - j0);
    const scalar_t** kp = key_rows[turn];
    const scalar_t* const* vp = value_rows[turn];
    // A short last step reuses its last row (scores computed, never used).
    for (int64_t t = kt; t < KT; ++t) kp[t] = kp[kt - 1];
    // The next step's rows lie anywhere in the cache: fetch them now.
    const int64_t next = std::min<int64_t>(KT, num_keys - j0 - KT);
    if (next > 0) {
      const scalar_t** kn = key_rows[turn ^ 1];
      const scalar_t** vn = value_rows[turn ^ 1];
      locate(j0 + KT, next, kn, vn);
      for (int64_t t = 0; t < next; ++t) {
        if (l.tiles) {
          for (int c = 0; c < DIM / 32; ++c) __builtin_prefetch(kn[t] + c * l.block_size * 32);
          if (t % 2 == 0 && !l.amx) {
            for (int n = 0; n < DIM / 16; ++n) __builtin_prefetch(vn[t] + n * v_column);
          }
        } else {
          prefetch_span(kn[t], row_bytes);
          if (!l.amx) prefetch_span(vn[t], row_bytes);
        }
      }
    }
    float* s = sc.s.data();
    // Scores [key][rows].
    if constexpr (kNativeDot) {
#ifdef __AVX512BF16__
      const auto* qt = reinterpret_cast<const int32_t*>(sc.qt.data());
      if (l.amx) {  // on AMX tiles where the cache allows (paged_prefill_amx.h)
#ifdef PAGED_PREFILL_AMX
        paged_prefill_amx::scores<DIM, RV>(kp, kt, 2 * k_piece,
                                           l.tiles ? 64 : l.tok_stride() * 2, qt, s);
#endif
      } else {
        const __m512 vscale = _mm512_set1_ps(scale);
        for (int64_t t0 = 0; t0 < kt; t0 += KS) {
          __m512 acc[KS][RV];
          for (int k = 0; k < KS; ++k)
            for (int v = 0; v < RV; ++v) acc[k][v] = _mm512_setzero_ps();
          for (int d2 = 0; d2 < DIM / 2; ++d2) {
            __m512bh qv[RV];
            for (int v = 0; v < RV; ++v) {
              qv[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qt + d2 * R + 16 * v));
            }
            for (int k = 0; k < KS; ++k) {
              const __m512bh kb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(
                  reinterpret_cast<const int32_t*>(kp[t0 + k])[(d2 / 16) * k_piece + d2 % 16]));
              for (int v = 0; v < RV; ++v) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], kb, qv[v]);
            }
          }
          for (int k = 0; k < KS; ++k)
            for (int v = 0; v < RV; ++v)
              _mm512_storeu_ps(s + (t0 + k) * R + 16 * v, _mm512_mul_ps(acc[k][v], vscale));
        }
      }
#endif
    } else {
      const float* krow[KT];
      if constexpr (kBf16) {
        for (int64_t t = 0; t < KT; ++t) {
          if (t < kt) widen_row<DIM>(reinterpret_cast<const at::BFloat16*>(kp[t]),
                                     sc.kw.data() + t * DIM);
          krow[t] = sc.kw.data() + std::min<int64_t>(t, kt - 1) * DIM;
        }
      } else {
        for (int64_t t = 0; t < KT; ++t) krow[t] = reinterpret_cast<const float*>(kp[t]);
      }
      const float* qt = sc.qt.data();
      for (int64_t t0 = 0; t0 < kt; t0 += KS) {
        __m512 acc[KS][RV];
        for (int k = 0; k < KS; ++k)
          for (int v = 0; v < RV; ++v) acc[k][v] = _mm512_setzero_ps();
        for (int d = 0; d < DIM; ++d) {
          __m512 qv[RV];
          for (int v = 0; v < RV; ++v) qv[v] = _mm512_loadu_ps(qt + d * R + 16 * v);
          for (int k = 0; k < KS; ++k) {
            const __m512 kb = _mm512_set1_ps(krow[t0 + k][d]);
            for (int v = 0; v < RV; ++v) acc[k][v] = _mm512_fmadd_ps(kb, qv[v], acc[k][v]);
          }
        }
        for (int k = 0; k < KS; ++k)
          for (int v = 0; v < RV; ++v) _mm512_storeu_ps(s + (t0 + k) * R + 16 * v, acc[k][v]);
      }
    }
    // Causal mask: key j is hidden from the rows before (j - base) * group.
    for (int64_t t = 0; t < kt; ++t) {
      const int64_t j = j0 + t;
      if (j <= base) continue;
      const int64_t first_live = (j - base) * group;
      for (int v = 0; v < RV; ++v) {
        const __mmask16 dead = _mm512_cmplt_epi32_mask(
            _mm512_add_epi32(lane, _mm512_set1_epi32(16 * v)),
            _mm512_set1_epi32(static_cast<int32_t>(first_live)));
        float* sp = s + t * R + 16 * v;
        _mm512_storeu_ps(sp, _mm512_mask_mov_ps(_mm512_loadu_ps(sp), dead,
                                                _mm512_set1_ps(neg_inf)));
      }
    }
    // Online softmax, elementwise over the rows' vectors.  A row's running
    // maximum m moves only where the step's exceeds it by more than kSlack:
    // its weights e^(s - m) are then at most e^kSlack, which float32 holds
    // with room, and the rescale of the output sums, a pass over all of
    // them, runs only on the rare step where some row's maximum jumps, not
    // on nearly every step as an exact running maximum would make it.
    // The AMX path's scores come unscaled: its scale is folded into the
    // exponent, e^(s * scale - m) (on the vectors' scores, x * 1 - m = x - m).
    __m512 alpha[RV];
    bool rescale = false;
    const __m512 s_scale = _mm512_set1_ps(l.amx ? scale : 1.0f);
    for (int v = 0; v < RV; ++v) {
      // Four running maxima: one would chain every step's loads.
      __m512 tops[4];
      for (int i = 0; i < 4; ++i) tops[i] = _mm512_set1_ps(neg_inf);
      int64_t t = 0;
      for (; t + 4 <= kt; t += 4) {
        for (int i = 0; i < 4; ++i) {
          tops[i] = _mm512_max_ps(tops[i], _mm512_loadu_ps(s + (t + i) * R + 16 * v));
        }
      }
      for (; t < kt; ++t) tops[0] = _mm512_max_ps(tops[0], _mm512_loadu_ps(s + t * R + 16 * v));
      const __m512 top = _mm512_max_ps(_mm512_max_ps(tops[0], tops[1]),
                                       _mm512_max_ps(tops[2], tops[3]));
      __m512 mx = _mm512_max_ps(m[v], _mm512_mul_ps(top, s_scale));
      // m starts at -inf; key 0 is live for every row, so mx is finite and
      // every lane moves on the first step.
      const __mmask16 moved =
          _mm512_cmp_ps_mask(mx, _mm512_add_ps(m[v], _mm512_set1_ps(kSlack)), _CMP_GT_OQ);
      mx = _mm512_mask_mov_ps(m[v], moved, mx);
      alpha[v] = exp_nonpositive16(_mm512_sub_ps(m[v], mx));  // exactly 1 where m stays
      rescale |= j0 > 0 && moved != 0;
      m[v] = mx;
      __m512 psum = _mm512_setzero_ps();
#ifdef PAGED_PREFILL_AMX
      if constexpr (kNativeDot) {
        if (l.amx) {  // p straight into the tiles' bf16 terms: one with pairs, else two
          const __m512 log2e = _mm512_set1_ps(preempt_serve_vec::kExpLog2e);
          float* sv = s + 16 * v;
          const __m512 sum =
              !pairs      ? paged_prefill_amx::probabilities<RV, true>(sv, kt, s_scale, mx)
              : short_exp ? paged_prefill_amx::probabilities<RV, false, true>(
                                sv, kt, _mm512_mul_ps(s_scale, log2e), _mm512_mul_ps(mx, log2e))
                          : paged_prefill_amx::probabilities<RV, false>(sv, kt, s_scale, mx);
          lsum[v] = _mm512_fmadd_ps(lsum[v], alpha[v], sum);
          continue;
        }
      }
#endif
      for (int64_t t = 0; t < kt; ++t) {
        float* sp = s + t * R + 16 * v;
        const __m512 x = _mm512_loadu_ps(sp);
        const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(neg_inf), _CMP_NEQ_OQ);
        __m512 p = _mm512_maskz_mov_ps(live, exp_nonpositive16(_mm512_fmsub_ps(x, s_scale, mx)));
#ifdef __AVX512BF16__
        // The weighted sum of key pairs takes p in bf16: the sum that divides
        // it is of the same values, so the weights still add up to one (a
        // row whose one key dominates gets that key's value, not p's
        // rounding of it).
        if (pairs) p = bf16_round(p);
#endif
        _mm512_storeu_ps(sp, p);
        psum = _mm512_add_ps(psum, p);
      }
      lsum[v] = _mm512_fmadd_ps(lsum[v], alpha[v], psum);
    }
    if (rescale) {
      for (int d = 0; d < DIM; ++d)
        for (int v = 0; v < RV; ++v) {
          float* op = ot + d * R + 16 * v;
          _mm512_storeu_ps(op, _mm512_mul_ps(_mm512_loadu_ps(op), alpha[v]));
        }
    }
    // Weighted sum of the values, transposed: ot[d][rows] += v[t][d] * p[t][rows].
#ifdef PAGED_PREFILL_AMX
    if constexpr (kNativeDot) {
      if (l.amx) {  // on AMX tiles (paged_prefill_amx.h)
        // Keys in [kt, the part's end) that the sequence has weigh p = 0
        // against finite values (its cache up to its context is written).
        const uint32_t* vt = sc.vt + j0 / 32 * DIM * 16;
        if (pairs) {
          paged_prefill_amx::weighted_sum<DIM, RV, false>(vt, kt, s, ot);
        } else {
          paged_prefill_amx::weighted_sum<DIM, RV, true>(vt, kt, s, ot);
        }
        continue;
      }
    }
#endif
#ifdef __AVX512BF16__
    if constexpr (kNativeDot) {
      if (pairs) {
        weighted_sum_pairs<DIM, RV>(reinterpret_cast<const at::BFloat16* const*>(vp), kt, s, ot,
                                    l, reinterpret_cast<uint32_t*>(sc.vw.data()),
                                    reinterpret_cast<uint32_t*>(sc.kw.data()));
        continue;
      }
    }
#endif
    const float* vrow[KT];
    if constexpr (kBf16) {
      for (int64_t t = 0; t < kt; ++t) {
        if (l.tiles) {
          // Key j's values: the low (even j) or high halves of its pair's.
          const auto* pr = reinterpret_cast<const int32_t*>(vp[t]);
          const bool odd = (j0 + t) % 2 != 0;
          for (int n = 0; n < DIM / 16; ++n) {
            const __m512i x = _mm512_loadu_si512(pr + n * v_column / 2);
            const __m512i f = odd ? _mm512_and_si512(x, _mm512_set1_epi32(-65536))
                                  : _mm512_slli_epi32(x, 16);
            _mm512_storeu_ps(sc.vw.data() + t * DIM + 16 * n, _mm512_castsi512_ps(f));
          }
        } else {
          widen_row<DIM>(reinterpret_cast<const at::BFloat16*>(vp[t]), sc.vw.data() + t * DIM);
        }
        vrow[t] = sc.vw.data() + t * DIM;
      }
    } else {
      for (int64_t t = 0; t < kt; ++t) vrow[t] = reinterpret_cast<const float*>(vp[t]);
    }
    for (int d0 = 0; d0 < DIM; d0 += DS) {
      __m512 acc[DS][RV];
      for (int e = 0; e < DS; ++e)
        for (int v = 0; v < RV; ++v) acc[e][v] = _mm512_loadu_ps(ot + (d0 + e) * R + 16 * v);
      for (int64_t t = 0; t < kt; ++t) {
        __m512 pv[RV];
        for (int v = 0; v < RV; ++v) pv[v] = _mm512_loadu_ps(s + t * R + 16 * v);
        const float* vr = vrow[t] + d0;
        for (int e = 0; e < DS; ++e) {
          const __m512 b = _mm512_set1_ps(vr[e]);
          for (int v = 0; v < RV; ++v) acc[e][v] = _mm512_fmadd_ps(b, pv[v], acc[e][v]);
        }
      }
      for (int e = 0; e < DS; ++e)
        for (int v = 0; v < RV; ++v) _mm512_storeu_ps(ot + (d0 + e) * R + 16 * v, acc[e][v]);
    }
  }
  alignas(64) float inv[R];
  for (int v = 0; v < RV; ++v) {
    _mm512_store_ps(inv + 16 * v, _mm512_div_ps(_mm512_set1_ps(1.0f), lsum[v]));
  }
  // Rows back out of [dim][rows], 16 x 16 at a time, each times 1 / its sum
  // (store16 rounds as the scalar cast does).
  __m512i b[16];
  for (int v = 0; 16 * v < rows; ++v) {
    for (int n = 0; n < DIM / 16; ++n) {
      for (int d = 0; d < 16; ++d) b[d] = _mm512_loadu_si512(ot + (16 * n + d) * R + 16 * v);
      preempt_serve_vec::transpose16(b);
      for (int64_t i = 0; i < 16 && 16 * v + i < rows; ++i) {
        const int64_t r = 16 * v + i;
        scalar_t* op =
            out + ((q_base + c.first + r / group) * l.heads + kh * group + r % group) * DIM;
        const __m512 o = _mm512_mul_ps(_mm512_castsi512_ps(b[i]), _mm512_set1_ps(inv[r]));
        preempt_serve_vec::store16(op + 16 * n, o);
      }
    }
  }
}

}  // namespace

