// Paged decode attention on AMX tiles, for bfloat16 caches on a build whose
// CPU has AMX (amx_tile, amx_bf16) and AVX512-BF16 (engine/cpp_ops.py
// adds the flags where /proc/cpuinfo lists them).
//
// The AVX512 path (paged_decode.cpp, decode_avx512) is bound by its
// arithmetic about as much as by memory: one 64-wide reduction per key and
// query head, one broadcast FMA per value and head.  On a tile unit the
// same products are a few instructions per 16 keys, and what is left is
// mostly the cache's read (studies/engine_cpu/decode_op.py).  Per
// sequence, as in decode_avx512 (three passes, the order of every reduction
// fixed by the sequence's own context, never by the batch):
//  1. scores: S^T[16 keys x group] += K[16 keys x 32 dims] . Q^T, the keys
//     loaded as a tile straight from the cache (a KV head's row of 32 dims
//     is 64 contiguous bytes; the tile's stride is the cache's token
//     stride), the group's queries as the pair-interleaved right-hand tile
//     built once per sequence; each head's column of the tile is picked
//     out by two permutes and a blend (a group of up to four heads) or a
//     gather into the head's row of scores;
//  2. the softmax over the whole context at once, in float32 (with p in one
//     term, e^x as 2^(x log2 e) on a degree-4 polynomial, short_exp_switch);
//  3. O[group x 16 dims] += P[group x 32 keys] . V[32 keys x 16 dims], the
//     values interleaved by pairs of keys into the right-hand tile's layout
//     (two unpacks per pair of rows and 32 dims), P as bfloat16: p rounded
//     once (to nearest even, the softmax's sum over the rounded values), as
//     the prefill operator and ATen's CPU flash attention take it; one
//     product a 32-key step and 16 dims (1.04-1.14x the operator, 1.02-1.06x
//     a decode step, studies/engine_cpu/decode_value_terms.py).
//     set_decode_value_terms(false) brings back two terms, hi = bf16(p) and
//     lo = bf16(p - hi), each multiplied: p keeps ~16 bits, not 8, and the
//     sum the float32 path's accuracy (products exact, float32 sums).
// Every key block must hold a multiple of 16 tokens (one tile of keys lies
// within a block); other block sizes and float32 take decode_avx512.
//
// decode<DIM, true> reads a cache in the tiles layout (engine/kv_layout.py)
// instead: a KV head's 16 keys of a 32-dim piece are one 1 KB tile in a
// row, its values already interleaved by pairs of keys (no unpacks), each
// block prefetched whole.  On blocks of 32 (or any multiple) its products
// and sums are those of the row layout, bit for bit; on blocks of 16 a
// value tile spans the block's 8 pairs of keys, so the weighted sum takes
// 16 keys a tile multiply and its float32 sums round a little differently.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGED_DECODE_AMX 1

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "kernel_util.h"

namespace preempt_serve_amx {

// Linux gives a process the tile registers' state only when it asks
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); asked once.
inline bool tiles_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023;
    constexpr long kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// Switched off by preempt_serve::set_decode_amx (benchmarks and tests run
// the AVX512 path of the same build beside this one).
inline std::atomic<bool>& switched_on() {
  static std::atomic<bool> on{true};
  return on;
}

// How far ahead the keys and values are fetched: blocks of keys, 32-key
// steps of values (one or two were as fast as three or four on an Intel
// Xeon with AMX; one was slower on some runs).
constexpr int64_t kAhead = 2;

inline bool usable(int64_t group, int64_t block_size) {
  return switched_on().load(std::memory_order_relaxed) && group >= 1 && group <= 16 &&
         block_size % 16 == 0 && tiles_permitted();
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile registers are named by number (the compiler's tile intrinsics paste
// it into the instruction's text).  Pass 1: tiles 0 and 1 take the scores
// of alternate 16-key chunks, 2 and 3 the keys, 4-7 the group's queries
// (a 32-dim piece each; rows of dim pairs, a column per head).  Pass 3:
// tiles 0-3 sum four 16-dim columns of the output (a row per head), 4 (and
// 5, with two terms) p for 32 keys, 6 and 7 the values (rows of key pairs).

// Whether the weighted sum takes p as one bf16 term (rounded to nearest
// even, the softmax's sum over the rounded values) rather than two
// (preempt_serve::set_decode_value_terms: studies time both in one process).
inline std::atomic<bool>& one_term_switch() {
  static std::atomic<bool> on{true};
  return on;
}

// Whether p in one bf16 term, here and in the prefill operator's tiles
// (paged_prefill_amx.h), is e^x computed as 2^(x log2 e) on the short
// polynomial (kernel_util.h, exp2_nonpositive16_for_bf16), which p's
// rounding to bf16 leaves room for, rather than exp_nonpositive16
// (preempt_serve::set_short_exp: studies time both in one process).
inline std::atomic<bool>& short_exp_switch() {
  static std::atomic<bool> on{true};
  return on;
}

// GCC 12 dropped some of a configuration's stores before the ldtilecfg
// that reads them (found as a fault on an all-zero column width): the
// barrier makes every store land first.
inline void load_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Every tile 16 rows of 64 bytes: the bf16 GEMM's (gemm_bf16_amx.h) and the
// prefill scores' (paged_prefill_amx.h) shapes.
inline void configure_16x64() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_config(cfg);
}

inline void configure_scores(int group) {
  TileConfig cfg;
  for (int t : {0, 1, 4, 5, 6, 7}) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = static_cast<uint16_t>(4 * group);
  }
  for (int t : {2, 3}) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_config(cfg);
}

// `keys`: how many keys one step of the weighted sum takes (32, or 16 in
// a tiles-layout cache of blocks of 16: a value tile lies within a block).
inline void configure_values(int group, int keys) {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) cfg.rows[t] = static_cast<uint8_t>(group);
  for (int t = 0; t < 4; ++t) cfg.colsb[t] = 64;
  cfg.colsb[4] = cfg.colsb[5] = static_cast<uint16_t>(2 * keys);
  cfg.rows[6] = cfg.rows[7] = static_cast<uint8_t>(keys / 2);
  cfg.colsb[6] = cfg.colsb[7] = 64;
  load_config(cfg);
}

// The group's queries for pieces 0..min(P, 4)-1 into tiles 4-7.
template <int P>
inline void load_queries(const uint32_t* bq) {
  _tile_loadd(4, bq, 64);
  if constexpr (P >= 2) _tile_loadd(5, bq + 256, 64);
  if constexpr (P >= 3) _tile_loadd(6, bq + 512, 64);
  if constexpr (P >= 4) _tile_loadd(7, bq + 768, 64);
}

// Scores of 16 keys (rows of k, `stride` bytes apart; a row's 32-dim pieces
// `piece` elements apart) into tile S (a macro: the tile's number must be a
// literal).
#define PS_DEFINE_SCORE_CHUNK(S)                                                       \
  template <int P>                                                                     \
  inline void score_chunk##S(const at::BFloat16* k, int64_t stride, int64_t piece,     \
                             const uint32_t* bq) {                                     \
    _tile_zero(S);                                                                     \
    if constexpr (P <= 4) {                                                            \
      _tile_loadd(2, k, stride);                                                       \
      _tile_dpbf16ps(S, 2, 4);                                                         \
      if constexpr (P >= 2) {                                                          \
        _tile_loadd(3, k + piece, stride);                                             \
        _tile_dpbf16ps(S, 3, 5);                                                       \
      }                                                                                \
      if constexpr (P >= 3) {                                                          \
        _tile_loadd(2, k + 2 * piece, stride);                                         \
        _tile_dpbf16ps(S, 2, 6);                                                       \
      }                                                                                \
      if constexpr (P >= 4) {                                                          \
        _tile_loadd(3, k + 3 * piece, stride);                                         \
        _tile_dpbf16ps(S, 3, 7);                                                       \
      }                                                                                \
    } else {                                                                           \
      for (int c = 0; c < P; ++c) {                                                    \
        _tile_loadd(2, k + piece * c, stride);                                         \
        _tile_loadd(4, bq + 256 * c, 64);                                              \
        _tile_dpbf16ps(S, 2, 4);                                                       \
      }                                                                                \
    }                                                                                  \
  }
PS_DEFINE_SCORE_CHUNK(0)
PS_DEFINE_SCORE_CHUNK(1)
#undef PS_DEFINE_SCORE_CHUNK

// Every cache line of tokens [begin, end) of a sequence's rows (all KV heads).
template <typename T>
inline void prefetch_tokens(const T* cache, const int64_t* table, int64_t block_size,
                            int64_t tok_stride, int64_t begin, int64_t end) {
  while (begin < end) {
    const int64_t b = begin / block_size, off = begin % block_size;
    const int64_t n = std::min(end - begin, block_size - off);
    preempt_serve_vec::prefetch_span(cache + (table[b] * block_size + off) * tok_stride,
                                     n * tok_stride * static_cast<int64_t>(sizeof(T)));
    begin += n;
  }
}

inline __m512 widen16(__m256i bf16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

// Values of 32 keys (rows[0..31], nullptr past the context), pieces c0 and
// c0 + 1 (where c0 + 1 < P), interleaved by pairs of keys into vt[0..3].
template <int P>
inline void interleave_values(const uint16_t* const* rows, int c0, uint16_t (*vt)[16][32]) {
  alignas(64) static const uint16_t zeros[64] = {};
  for (int r = 0; r < 16; ++r) {
    const uint16_t* a = rows[2 * r] != nullptr ? rows[2 * r] + 32 * c0 : zeros;
    const uint16_t* b = rows[2 * r + 1] != nullptr ? rows[2 * r + 1] + 32 * c0 : zeros;
    for (int c = 0; c < 2 && c0 + c < P; ++c) {
      const __m512i x = _mm512_loadu_si512(a + 32 * c);
      const __m512i y = _mm512_loadu_si512(b + 32 * c);
      _mm512_store_si512(vt[2 * c][r], _mm512_unpacklo_epi16(x, y));
      _mm512_store_si512(vt[2 * c + 1][r], _mm512_unpackhi_epi16(x, y));
    }
  }
}

// Values of keys j0.. (a tile of `pairs` key pairs at src, a tiles-layout
// cache's rows of 64 bytes) past the context's end zeroed into dst: the
// keys there hold whatever the block held before, and p = 0 times a NaN
// left there would still be NaN.
inline void values_to_end(const uint16_t* src, int64_t pairs, int64_t live_keys,
                          uint16_t (*dst)[32]) {
  for (int64_t r = 0; r < pairs; ++r) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(2, live_keys - 2 * r));
    const __mmask32 keep = n == 2 ? 0xFFFFFFFFu : (n == 1 ? 0x55555555u : 0u);
    _mm512_store_si512(dst[r], _mm512_maskz_mov_epi16(keep, _mm512_loadu_si512(src + 32 * r)));
  }
}

// TILES: the cache holds blocks in the tiles layout (engine/kv_layout.py):
// every key and value tile is loaded as one run of memory, and nothing is
// interleaved; on blocks of a multiple of 32 every reduction runs in the
// row layout's order, so both give the same result.
template <int DIM, bool TILES = false>
void decode(const at::BFloat16* q, const at::BFloat16* key_cache,
            const at::BFloat16* value_cache, const int64_t* block_ids,
            const int64_t* table_starts, const int64_t* context_lens, float scale,
            at::BFloat16* out, int64_t num_seqs, int64_t heads, int64_t kv_heads,
            int64_t block_size) {
  static_assert(DIM % 32 == 0, "head dim in whole 32-element pieces");
  constexpr int P = DIM / 32;  // 32-dim pieces of a row: one tile of keys each
  constexpr int N = DIM / 16;  // 16-dim column tiles of the output
  const int64_t group = heads / kv_heads;
  const int64_t tok_stride = kv_heads * DIM;
  const int64_t tok_bytes = tok_stride * static_cast<int64_t>(sizeof(at::BFloat16));
  const int64_t blk_stride = block_size * tok_stride;
  const int64_t blk_bytes = blk_stride * static_cast<int64_t>(sizeof(at::BFloat16));
  // The keys of one KV head as tiles: where in a block they start, rows of
  // 16 keys `k_stride` bytes apart, a row's pieces `k_piece` elements apart.
  const int64_t k_head = TILES ? P * block_size * 32 : DIM;
  const int64_t k_token = TILES ? 32 : tok_stride;
  const int64_t k_stride = TILES ? 64 : tok_bytes;
  const int64_t k_piece = TILES ? block_size * 32 : 32;
  // Keys a step of the weighted sum takes: a value tile lies within a block.
  const int64_t v_keys = TILES && block_size % 32 != 0 ? 16 : 32;
  const bool one_term = one_term_switch().load(std::memory_order_relaxed);
  const bool short_exp = one_term && short_exp_switch().load(std::memory_order_relaxed);
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    // Per KV head and piece, the right-hand tile of the queries: row r,
    // column g = the pair of dims (32c + 2r, 32c + 2r + 1) of head g.
    std::vector<uint32_t> bq(kv_heads * P * 16 * 16);
    std::vector<float> sc_buf, acc_buf(heads * DIM), inv(heads);
    std::vector<uint16_t> hi_buf, lo_buf;
    std::vector<const uint16_t*> vrows;
    // A chunk's scores, a row of `group` floats per key (and room to read
    // four whole vectors).
    alignas(64) float tile_out[2][16 * 16];
    alignas(64) uint16_t vt[4][16][32];  // the values' right-hand tiles
    // Head g's scores sit at t * group + g: two two-vector permutes and a
    // blend fetch them for a group of up to four; a gather for larger ones.
    __m512i pick[4];
    __mmask16 upper[4];
    for (int g = 0; g < 4; ++g) {
      pick[g] = _mm512_add_epi32(
          _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                             _mm512_set1_epi32(static_cast<int>(group))),
          _mm512_set1_epi32(g));
      upper[g] = _mm512_cmpge_epi32_mask(pick[g], _mm512_set1_epi32(32));
    }
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t ctx = context_lens[i];
      const int64_t* table = block_ids + table_starts[i];
      const int64_t num_blocks = (ctx + block_size - 1) / block_size;
      const int64_t padded = (ctx + 31) / 32 * 32;
      if (static_cast<int64_t>(sc_buf.size()) < heads * padded) {
        sc_buf.resize(heads * padded);
        hi_buf.resize(heads * padded);
        lo_buf.resize(heads * padded);
      }
      if constexpr (!TILES) vrows.assign(padded, nullptr);  // the row layout's values
      float* sc = sc_buf.data();
      const uint32_t* qd = reinterpret_cast<const uint32_t*>(q + i * heads * DIM);
      std::fill(bq.begin(), bq.end(), 0u);
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
        for (int64_t g = 0; g < group; ++g) {
          const uint32_t* qh = qd + (kh * group + g) * (DIM / 2);
          for (int c = 0; c < P; ++c) {
            for (int r = 0; r < 16; ++r) bq[((kh * P + c) * 16 + r) * 16 + g] = qh[16 * c + r];
          }
        }
      }
      // Pass 1: scores, a KV head at a time; while the first head's are
      // computed, the keys kAhead blocks on (past the last, the first
      // values) are fetched, every head's at once: blocks lie anywhere in a
      // cache far larger than the CPU's, and the later heads find them in L2.
      configure_scores(static_cast<int>(group));
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
        const uint32_t* bqh = bq.data() + kh * P * 256;
        if constexpr (P <= 4) load_queries<P>(bqh);
        int64_t chunk = 0;
        for (int64_t bi = 0; bi < num_blocks; ++bi) {
          const int64_t len = bi == num_blocks - 1 ? ctx - bi * block_size : block_size;
          if (TILES && kh == 0) {
            // Whole blocks: a block's heads lie one after another.
            for (int64_t f = bi == 0 ? 1 : kAhead; f <= kAhead; ++f) {
              const int64_t fb = bi + f;
              if (fb < num_blocks) {
                preempt_serve_vec::prefetch_span(key_cache + table[fb] * blk_stride, blk_bytes);
              } else if (fb - num_blocks < std::min(kAhead, num_blocks)) {
                preempt_serve_vec::prefetch_span(value_cache + table[fb - num_blocks] * blk_stride,
                                                 blk_bytes);
              }
            }
          } else if (kh == 0) {
            if (bi == 0) {
              prefetch_tokens(key_cache, table, block_size, tok_stride, block_size,
                              std::min(ctx, kAhead * block_size));
            }
            const int64_t from = (bi + kAhead) * block_size;
            if (from < ctx) {
              prefetch_tokens(key_cache, table, block_size, tok_stride, from,
                              std::min(ctx, from + block_size));
            } else if (from < ctx + block_size) {
              prefetch_tokens(value_cache, table, block_size, tok_stride, 0,
                              std::min<int64_t>(ctx, 32 * kAhead));
            }
          }
          const at::BFloat16* kb = key_cache + table[bi] * blk_stride + kh * k_head;
          for (int64_t t0 = 0; t0 < len; t0 += 16, ++chunk) {
            float* dense = tile_out[chunk & 1];
            if (chunk & 1) {
              score_chunk1<P>(kb + t0 * k_token, k_stride, k_piece, bqh);
              _tile_stored(1, dense, 4 * group);
            } else {
              score_chunk0<P>(kb + t0 * k_token, k_stride, k_piece, bqh);
              _tile_stored(0, dense, 4 * group);
            }
            const int64_t n = len - t0 < 16 ? len - t0 : 16;
            const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
            float* dst = sc + kh * group * padded + bi * block_size + t0;
            if (group <= 4) {
              const __m512 v0 = _mm512_load_ps(dense), v1 = _mm512_load_ps(dense + 16);
              const __m512 v2 = _mm512_load_ps(dense + 32), v3 = _mm512_load_ps(dense + 48);
              for (int64_t g = 0; g < group; ++g) {
                const __m512 s = _mm512_mask_blend_ps(
                    upper[g], _mm512_permutex2var_ps(v0, pick[g], v1),
                    _mm512_permutex2var_ps(v2, pick[g], v3));
                _mm512_mask_storeu_ps(dst + g * padded, live, _mm512_mul_ps(s, scale_v));
              }
            } else {
              for (int64_t g = 0; g < group; ++g) {
                const __m512 s = _mm512_i32gather_ps(
                    _mm512_add_epi32(pick[0], _mm512_set1_epi32(static_cast<int>(g))), dense, 4);
                _mm512_mask_storeu_ps(dst + g * padded, live, _mm512_mul_ps(s, scale_v));
              }
            }
          }
        }
      }
      // The softmax over the whole context, then p split into two bf16
      // terms (zero past the context, up to a whole tile of keys).
      for (int64_t h = 0; h < heads; ++h) {
        float* s = sc + h * padded;
        const float top = preempt_serve_vec::max_of(s, ctx);
        const __m512 m = _mm512_set1_ps(top);
        // In base 2 for the short exponential: s log2 e - m log2 e.
        const __m512 log2e = _mm512_set1_ps(preempt_serve_vec::kExpLog2e);
        const __m512 m2 = _mm512_set1_ps(top * preempt_serve_vec::kExpLog2e);
        __m512 sum = _mm512_setzero_ps();
        uint16_t* ph = hi_buf.data() + h * padded;
        uint16_t* pl = lo_buf.data() + h * padded;
        for (int64_t j = 0; j < padded; j += 16) {
          const __mmask16 live = preempt_serve_vec::first_lanes(ctx - j);
          const __m512 x = _mm512_maskz_loadu_ps(live, s + j);
          const __m512 p = _mm512_maskz_mov_ps(
              live, short_exp ? preempt_serve_vec::exp2_nonpositive16_for_bf16(
                                    _mm512_fmsub_ps(x, log2e, m2))
                              : preempt_serve_vec::exp_nonpositive16(_mm512_sub_ps(x, m)));
          const __m256i hi = (__m256i)_mm512_cvtneps_pbh(p);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(ph + j), hi);
          if (one_term) {
            sum = _mm512_add_ps(sum, widen16(hi));
          } else {
            sum = _mm512_add_ps(sum, p);
            const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(p, widen16(hi)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pl + j), lo);
          }
        }
        inv[h] = 1.0f / _mm512_reduce_add_ps(sum);
      }
      // Pass 3: the weighted sum of the values, per KV head four 16-dim
      // columns at a time summed in tiles over the whole context, v_keys
      // keys a step (on the first sweep, the values ahead fetched meanwhile).
      if constexpr (!TILES) {
        for (int64_t t = 0, b = 0, off = 0; t < ctx; ++t) {
          vrows[t] = reinterpret_cast<const uint16_t*>(
              value_cache + (table[b] * block_size + off) * tok_stride);
          if (++off == block_size) {
            off = 0;
            ++b;
          }
        }
      }
      configure_values(static_cast<int>(group), static_cast<int>(v_keys));
      float* acc = acc_buf.data();
      const int64_t p_stride = padded * static_cast<int64_t>(sizeof(uint16_t));
      const uint16_t* rows[32];
      const uint16_t* vsrc[4] = {vt[0][0], vt[1][0], vt[2][0], vt[3][0]};
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
        const int64_t h0 = kh * group;
        for (int cg = 0; cg < (N + 3) / 4; ++cg) {
          const bool four = 4 * cg + 4 <= N;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t j0 = 0; j0 < ctx; j0 += v_keys) {
            if constexpr (TILES) {
              const int64_t b = j0 / block_size, off = j0 % block_size;
              if (kh == 0 && cg == 0 && off == 0 && b + kAhead < num_blocks) {
                preempt_serve_vec::prefetch_span(value_cache + table[b + kAhead] * blk_stride,
                                                 blk_bytes);
              }
              // Column n's tile of the step: v_keys / 2 rows of 64 bytes.
              const uint16_t* base = reinterpret_cast<const uint16_t*>(value_cache) +
                                     table[b] * blk_stride +
                                     ((kh * N + 4 * cg) * (block_size / 2) + off / 2) * 32;
              for (int n = 0; n < (four ? 4 : 2); ++n) {
                vsrc[n] = base + n * (block_size / 2) * 32;
                if (j0 + v_keys > ctx) {
                  values_to_end(vsrc[n], v_keys / 2, ctx - j0, vt[n]);
                  vsrc[n] = vt[n][0];
                }
              }
            } else {
              if (kh == 0 && cg == 0) {
                prefetch_tokens(value_cache, table, block_size, tok_stride,
                                std::min(ctx, j0 + 32 * kAhead),
                                std::min(ctx, j0 + 32 * kAhead + 32));
              }
              for (int r = 0; r < 32; ++r) {
                rows[r] = vrows[j0 + r] != nullptr ? vrows[j0 + r] + kh * DIM : nullptr;
              }
              interleave_values<P>(rows, 2 * cg, vt);
            }
            _tile_loadd(4, hi_buf.data() + h0 * padded + j0, p_stride);
            if (!one_term) _tile_loadd(5, lo_buf.data() + h0 * padded + j0, p_stride);
// Output tile OUT += p's one or two terms (tiles 4, 5) . the values
// vsrc[n], loaded into tile V (6 and 7 alternate, so that one loads while
// the other multiplies).
#define PS_ACCUMULATE(OUT, V, n)           \
  _tile_loadd(V, vsrc[n], 64);             \
  _tile_dpbf16ps(OUT, 4, V);               \
  if (!one_term) _tile_dpbf16ps(OUT, 5, V);
            PS_ACCUMULATE(0, 6, 0)
            PS_ACCUMULATE(1, 7, 1)
            if (four) {
              PS_ACCUMULATE(2, 6, 2)
              PS_ACCUMULATE(3, 7, 3)
            }
#undef PS_ACCUMULATE
          }
          constexpr int64_t acc_stride = DIM * static_cast<int64_t>(sizeof(float));
          float* o = acc + h0 * DIM + 64 * cg;
          _tile_stored(0, o, acc_stride);
          _tile_stored(1, o + 16, acc_stride);
          if (four) {
            _tile_stored(2, o + 32, acc_stride);
            _tile_stored(3, o + 48, acc_stride);
          }
        }
      }
      // Rows layout: column l of tile n = 2c + s holds dim
      // 32c + 8(l / 4) + 4s + l % 4 (the unpacks' order); tiles layout: dim
      // 16n + l.
      for (int64_t h = 0; h < heads; ++h) {
        at::BFloat16* op = out + (i * heads + h) * DIM;
        const float* a = acc + h * DIM;
        for (int n = 0; n < N; ++n) {
          for (int l = 0; l < 16; ++l) {
            const int d = TILES ? 16 * n + l : 32 * (n / 2) + 8 * (l / 4) + 4 * (n % 2) + l % 4;
            op[d] = static_cast<at::BFloat16>(a[16 * n + l] * inv[h]);
          }
        }
      }
    }
    _tile_release();
  });
}

}  // namespace preempt_serve_amx

#endif  // AMX
