// Paged decode attention on CPU: one query token per sequence, attended
// over the sequence's cache blocks in place (no gather, no padding).
//
// Built at first use by torch.utils.cpp_extension (engine/cpp_ops.py)
// with the vector ISA flags of the machine's ATen capability, and registered
// as the torch operator preempt_serve::paged_decode.
//
// Layout: key/value cache [num_blocks, block_size, kv_heads, head_dim], a
// sequence's blocks listed in block_ids[table_starts[i] : ...] in order.
// One sequence at a time, all of its heads together, so each cached block
// (every KV head of its tokens) is read once, front to back; the next block
// is prefetched while the current one is computed on, because blocks lie at
// random places in a cache far larger than the CPU's caches and the
// hardware prefetcher cannot guess the next one.  Softmax is taken online
// block by block (running max and sum, as in FlashAttention), in float32
// whatever the cache dtype.  That portable loop serves every build; a build
// for an AVX512 capability takes float32 and bfloat16 caches through the
// vectorized passes further down (decode_avx512) instead, and an AVX2 build
// float32 caches through this loop's walk with its scores and weighted sums
// in 8-lane vectors (paged_decode_avx2.h).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernel_util.h"
#include "paged_decode_amx.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

using preempt_serve_vec::exp_nonpositive;

using preempt_serve_vec::prefetch_span;

// One thread's state for a sequence's decode with an online softmax (the
// portable loop below and paged_decode_avx2.h): each head's scaled query,
// weighted sum of values, running maximum and running sum of weights.
struct OnlineState {
  std::vector<float> qf, acc, run_max, run_sum;

  OnlineState(int64_t heads, int64_t dim)
      : qf(heads * dim), acc(heads * dim), run_max(heads), run_sum(heads) {}

  // Before a sequence: its queries `q` [heads, dim] times `scale`, the rest
  // from nothing.
  template <typename T>
  void start(const T* q, int64_t heads, int64_t dim, float scale) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t d = 0; d < dim; ++d) {
        qf[h * dim + d] = to_float(q[h * dim + d]) * scale;
        acc[h * dim + d] = 0.0f;
      }
      run_max[h] = -std::numeric_limits<float>::infinity();
      run_sum[h] = 0.0f;
    }
  }

  // Head h's scores of one block, s[0, len), into their weights (the online
  // softmax, FlashAttention): the running maximum taken up to the block's,
  // and where it grows, what was summed so far rescaled.
  void weigh_block(int64_t h, float* s, int64_t len, int64_t dim) {
    float m = run_max[h];
    for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
    const float corr = exp_nonpositive(run_max[h] - m);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      const float p = exp_nonpositive(s[t] - m);
      s[t] = p;
      sum += p;
    }
    run_sum[h] = run_sum[h] * corr + sum;
    run_max[h] = m;
    if (corr != 1.0f) {
      float* a = acc.data() + h * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] *= corr;
    }
  }

  // After it: each head's weighted sum over its sum of weights into `out`.
  template <typename T>
  void finish(T* out, int64_t heads, int64_t dim) const {
    for (int64_t h = 0; h < heads; ++h) {
      const float inv = 1.0f / run_sum[h];
      for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = static_cast<T>(acc[h * dim + d] * inv);
    }
  }
};

// DIM > 0: the head dim as a constant the loops unroll on; 0: read from dim.
template <typename scalar_t, int DIM_T>
void decode(int64_t dim, const scalar_t* q, const scalar_t* key_cache, const scalar_t* value_cache,
            const int64_t* block_ids, const int64_t* table_starts,
            const int64_t* context_lens, float scale, scalar_t* out, int64_t num_seqs,
            int64_t heads, int64_t kv_heads, int64_t block_size) {
  const int64_t DIM = DIM_T > 0 ? DIM_T : dim;
  const int64_t group = heads / kv_heads;
  const int64_t tok_stride = kv_heads * DIM;
  const int64_t blk_stride = block_size * tok_stride;
  const int64_t tok_bytes = tok_stride * static_cast<int64_t>(sizeof(scalar_t));
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    OnlineState st(heads, DIM);
    std::vector<float> sc_buf(heads * block_size);
    const float* qf = st.qf.data();
    float* acc = st.acc.data();
    float* sc = sc_buf.data();
    for (int64_t i = begin; i < end; ++i) {
      st.start(q + i * heads * DIM, heads, DIM, scale);
      const int64_t ctx = context_lens[i];
      const int64_t* table = block_ids + table_starts[i];
      const int64_t num_blocks = (ctx + block_size - 1) / block_size;
      for (int64_t bi = 0; bi < num_blocks; ++bi) {
        const int64_t len = bi == num_blocks - 1 ? ctx - bi * block_size : block_size;
        const scalar_t* kb = key_cache + table[bi] * blk_stride;
        const scalar_t* vb = value_cache + table[bi] * blk_stride;
        const scalar_t* kn =
            key_cache + (bi + 1 < num_blocks ? table[bi + 1] : table[bi]) * blk_stride;
        // Scores of every head against the block's tokens; V of this block
        // is fetched meanwhile.
        for (int64_t t = 0; t < len; ++t) {
          prefetch_span(reinterpret_cast<const char*>(vb + t * tok_stride), tok_bytes);
          for (int64_t kh = 0; kh < kv_heads; ++kh) {
            const scalar_t* kp = kb + t * tok_stride + kh * DIM;
            for (int64_t g = 0; g < group; ++g) {
              const int64_t h = kh * group + g;
              const float* qh = qf + h * DIM;
              float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < DIM; ++d) dot += qh[d] * to_float(kp[d]);
              sc[h * block_size + t] = dot;
            }
          }
        }
        for (int64_t h = 0; h < heads; ++h) st.weigh_block(h, sc + h * block_size, len, DIM);
        // Weighted sum of V; K of the next block is fetched meanwhile.
        for (int64_t t = 0; t < len; ++t) {
          prefetch_span(reinterpret_cast<const char*>(kn + t * tok_stride), tok_bytes);
          for (int64_t kh = 0; kh < kv_heads; ++kh) {
            const scalar_t* vp = vb + t * tok_stride + kh * DIM;
            for (int64_t g = 0; g < group; ++g) {
              const int64_t h = kh * group + g;
              const float p = sc[h * block_size + t];
              float* a = acc + h * DIM;
#pragma omp simd
              for (int64_t d = 0; d < DIM; ++d) a[d] += p * to_float(vp[d]);
            }
          }
        }
      }
      st.finish(out + i * heads * DIM, heads, DIM);
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// The same attention with explicit AVX512 vectors, for float32 and bfloat16
// caches on a build for an AVX512 capability.  The loop above is bound by
// latency, not arithmetic: one 64-wide reduction per (token, head), a
// running maximum whose every block rescales the sums, and in bfloat16 each
// cached row converted once per query head of its group.  Here, per
// sequence:
//  1. scores of every head against every key, a block at a time, 16 tokens
//     of a KV head at once: per token a vector of partial products, the 16
//     folded into one vector of 16 scores by a shuffle tree (15 adds); bf16
//     keys are multiplied as they lie in the cache by VDPBF16PS where the
//     build has it (exact bf16 products, float32 sums), else widened;
//  2. the softmax over the whole context at once (its maximum first), with
//     no running rescale and no step waiting on the one before;
//  3. the weighted sum of the values, a block at a time, each value row read
//     once for up to four heads of its group with their sums in registers.
// A bf16 row is widened two halves at a time (even elements by a shift, odd
// ones by a mask), so the sums of each 32-element piece are kept as its 16
// even then its 16 odd elements (the widened query is permuted the same
// way) and put back in order when written out.  The scores take 4 bytes per
// head and context token of scratch.  Everything after the multiplies is in
// float32, and the order of every reduction depends only on the sequence's
// own context, never on the batch.
#include <immintrin.h>

#define PAGED_DECODE_AVX512 1

inline __m512 lane_sums16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

using preempt_serve_vec::exp_nonpositive16;

// Scores of one query (DIM floats) against n <= 16 rows of k, lane t for row t.
// pf: where not null, row t of pf (same stride) is prefetched as row t is
// computed on, so that the prefetches are spread among the multiplies.
template <int DIM, typename P>
inline __m512 scores16(const float* q, const float* k, int64_t stride, int64_t n,
                       const P* pf = nullptr, int64_t pf_stride = 0) {
  constexpr int V = DIM / 16;
  __m512 qv[V];
  for (int c = 0; c < V; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  __m512 part[16];
  for (int t = 0; t < 16; ++t) {
    if (pf != nullptr) {
      prefetch_span(reinterpret_cast<const char*>(pf + t * pf_stride),
                    DIM * static_cast<int64_t>(sizeof(P)));
    }
    if (t < n) {
      const float* kp = k + t * stride;
      __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kp));
      for (int c = 1; c < V; ++c) s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kp + 16 * c), s);
      part[t] = s;
    } else {
      part[t] = _mm512_setzero_ps();
    }
  }
  return lane_sums16(part);
}

#ifdef __AVX512BF16__
// Scores of a bfloat16 query against n <= 16 bfloat16 rows, straight from
// the cache: VDPBF16PS multiplies pairs of bf16 exactly and sums them in
// float32, so the keys need no widening.
template <int DIM>
inline __m512 scores16_bf16(const at::BFloat16* q, const at::BFloat16* k, int64_t stride,
                            int64_t n, const at::BFloat16* pf = nullptr) {
  constexpr int V = DIM / 32;
  __m512bh qv[V];
  for (int c = 0; c < V; ++c) qv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + 32 * c));
  __m512 part[16];
  for (int t = 0; t < 16; ++t) {
    if (pf != nullptr) {
      prefetch_span(reinterpret_cast<const char*>(pf + t * stride),
                    DIM * static_cast<int64_t>(sizeof(at::BFloat16)));
    }
    __m512 s = _mm512_setzero_ps();
    if (t < n) {
      const at::BFloat16* kp = k + t * stride;
      for (int c = 0; c < V; ++c) {
        s = _mm512_dpbf16_ps(s, qv[c], reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp + 32 * c)));
      }
    }
    part[t] = s;
  }
  return lane_sums16(part);
}
#endif

// A bfloat16 row widened to float32, each 32-element piece as its even
// elements then its odd ones.
template <int DIM>
inline void widen_bf16(const at::BFloat16* src, float* dst) {
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int c = 0; c < DIM / 32; ++c) {
    const __m512i x = _mm512_loadu_si512(src + 32 * c);
    _mm512_storeu_ps(dst + 32 * c, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
    _mm512_storeu_ps(dst + 32 * c + 16, _mm512_castsi512_ps(_mm512_and_si512(x, high)));
  }
}

// The next sequence's cache blocks (its keys, then its values) asked for
// while this sequence is computed on, a share at each of its steps.  Blocks
// lie at random places in a cache far larger than the CPU's, so that only
// the software knows what comes next; one block ahead alone (the prefetches
// in the passes) leaves a sequence whose blocks are far from the CPU waiting
// on memory at every block.  A sequence's K and V (tens of KiB) fit in L2.
// Blocks the next sequence shares with this one at the same place (a common
// prefix) are already near and skipped.
template <typename scalar_t>
struct NextSequence {
  const scalar_t* key_cache;
  const scalar_t* value_cache;
  const int64_t* block_ids;
  const int64_t* table_starts;
  const int64_t* context_lens;
  int64_t block_size, blk_stride;
  const int64_t* table = nullptr;  // the next sequence's
  const int64_t* current = nullptr;  // this sequence's
  int64_t current_blocks = 0, half = 0, lines_per_block = 0, block = 0, line = 0, per_step = 0;

  int64_t blocks_of(int64_t seq) const {
    return (context_lens[seq] + block_size - 1) / block_size;
  }
  bool shared(int64_t b) const { return b < current_blocks && table[b] == current[b]; }

  // Before sequence `seq`'s work of `steps` step() calls.
  void start(int64_t seq, int64_t next_seq, int64_t steps) {
    block = line = half = 0;
    if (next_seq < 0) return;
    current = block_ids + table_starts[seq];
    current_blocks = blocks_of(seq);
    table = block_ids + table_starts[next_seq];
    half = blocks_of(next_seq);
    lines_per_block = (blk_stride * static_cast<int64_t>(sizeof(scalar_t)) + 63) / 64;
    int64_t own = 0;
    for (int64_t b = 0; b < half; ++b) own += shared(b) ? 0 : 1;
    per_step = (2 * own * lines_per_block + steps - 1) / (steps > 0 ? steps : 1);
  }

  void step() {
    int64_t left = per_step;
    while (left > 0 && block < 2 * half) {
      const int64_t b = block < half ? block : block - half;
      if (line == 0 && shared(b)) {
        ++block;
        continue;
      }
      const char* base = reinterpret_cast<const char*>(
          (block < half ? key_cache : value_cache) + table[b] * blk_stride);
      const int64_t stop = line + left < lines_per_block ? line + left : lines_per_block;
      left -= stop - line;
      for (; line < stop; ++line) _mm_prefetch(base + 64 * line, _MM_HINT_T1);
      if (line == lines_per_block) {
        line = 0;
        ++block;
      }
    }
  }
};

// Pass 2's inner loop: GN heads' sums (CW vectors of each) plus the
// weighted rows of one block, rows t < len of `rows` (stride apart), weights
// probs[g * padded + t]; the sums are read from and written back to
// sums[g * DIM + ...].
template <typename scalar_t, int GN, int CW, int DIM>
inline void weigh_rows(const scalar_t* rows, int64_t stride, int64_t len, const float* probs,
                       int64_t padded, float* sums, const scalar_t* pf) {
  constexpr int64_t row_bytes = DIM * static_cast<int64_t>(sizeof(scalar_t));
  __m512 acc[GN][CW];
  for (int g = 0; g < GN; ++g) {
    for (int c = 0; c < CW; ++c) acc[g][c] = _mm512_loadu_ps(sums + g * DIM + 16 * c);
  }
  for (int64_t t = 0; t < len; ++t) {
    if (pf != nullptr) prefetch_span(reinterpret_cast<const char*>(pf + t * stride), row_bytes);
    const scalar_t* vp = rows + t * stride;
    __m512 row[CW];
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
      for (int c = 0; c < CW; c += 2) {
        const __m512i x = _mm512_loadu_si512(vp + 16 * c);
        row[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        row[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
      }
    } else {
      for (int c = 0; c < CW; ++c) row[c] = _mm512_loadu_ps(vp + 16 * c);
    }
    for (int g = 0; g < GN; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * padded + t]);
      for (int c = 0; c < CW; ++c) acc[g][c] = _mm512_fmadd_ps(p, row[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g) {
    for (int c = 0; c < CW; ++c) _mm512_storeu_ps(sums + g * DIM + 16 * c, acc[g][c]);
  }
}

// Whether float32 decodes ask for the next sequence's blocks too
// (NextSequence; bf16 decodes always do).  It depends on the CPU: on a Zen 5
// core the look-ahead made float32 decodes slower (10.1 -> 11.2 ms, SmolLM2,
// batch 32 of 128 tokens), on a Zen 4 core it nearly halves them (22.2 ->
// 11.5-12.0 ms: K/V read at 16-17 GB/s instead of 9, as bf16 decodes read
// them); engine/cpp_ops.py sets it by CPU when it loads the operators
// (studies/engine_cpu/README.md, "float32 decodes' look-ahead on Zen 4").
inline std::atomic<bool>& f32_lookahead() {
  static std::atomic<bool> on{false};
  return on;
}

template <typename scalar_t, int DIM>
void decode_avx512(const scalar_t* q, const scalar_t* key_cache, const scalar_t* value_cache,
                   const int64_t* block_ids, const int64_t* table_starts,
                   const int64_t* context_lens, float scale, scalar_t* out, int64_t num_seqs,
                   int64_t heads, int64_t kv_heads, int64_t block_size) {
  constexpr bool kBf16 = std::is_same_v<scalar_t, at::BFloat16>;
  static_assert(kBf16 || std::is_same_v<scalar_t, float>, "float32 or bfloat16 caches");
  static_assert(DIM % (kBf16 ? 32 : 16) == 0, "head dim in whole vectors");
#ifdef __AVX512BF16__
  constexpr bool kNativeDot = kBf16;
#else
  constexpr bool kNativeDot = false;
#endif
  constexpr int V = DIM / 16;
  // The weighted sum keeps HT heads x CW vectors of accumulators in
  // registers; a row wider than CW vectors is summed a slice at a time.
  constexpr int HT = 4;
  constexpr int CW = V <= 4 ? V : (V % 4 == 0 ? 4 : 2);
  static_assert(V % CW == 0, "slices of whole pieces");
  const int64_t group = heads / kv_heads;
  const int64_t tok_stride = kv_heads * DIM;
  const int64_t blk_stride = block_size * tok_stride;
  constexpr int64_t row_bytes = DIM * static_cast<int64_t>(sizeof(scalar_t));
  // The next block's rows are prefetched a KV head's rows at a time before
  // they are needed (bf16), or one row at a time among the multiplies
  // (float32, twice the lines a row): each the faster on an AVX512 EPYC.
  constexpr bool kSpread = !kBf16;
  const bool lookahead_f32 = f32_lookahead().load(std::memory_order_relaxed);
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf_buf(heads * DIM), acc_buf(heads * DIM);
    std::vector<float> sc_buf;
    std::vector<float> inv(heads);
    float* qf = qf_buf.data();
    float* accm = acc_buf.data();
    NextSequence<scalar_t> next{key_cache, value_cache, block_ids, table_starts, context_lens,
                                block_size, blk_stride};
    for (int64_t i = begin; i < end; ++i) {
      // float32 only where switched on (f32_lookahead); otherwise the
      // look-ahead is given no sequence, and its steps do nothing.
      next.start(i, i + 1 < end && (kBf16 || lookahead_f32) ? i + 1 : -1,
                 2 * kv_heads * ((context_lens[i] + block_size - 1) / block_size));
      for (int64_t h = 0; h < heads && !kNativeDot; ++h) {
        const scalar_t* qp = q + (i * heads + h) * DIM;
        float* qh = qf + h * DIM;
        if constexpr (kBf16) {
          widen_bf16<DIM>(qp, qh);
        } else {
          std::memcpy(qh, qp, DIM * sizeof(float));
        }
        for (int64_t d = 0; d < DIM; ++d) qh[d] *= scale;
      }
      const int64_t ctx = context_lens[i];
      const int64_t* table = block_ids + table_starts[i];
      const int64_t num_blocks = (ctx + block_size - 1) / block_size;
      // Room for a whole vector past the last score.
      const int64_t padded = (ctx + 15) / 16 * 16;
      if (static_cast<int64_t>(sc_buf.size()) < heads * padded) sc_buf.resize(heads * padded);
      float* sc = sc_buf.data();
      // Pass 1: every head's scores against every key of the context, a
      // block (all its KV heads, one contiguous span) at a time.
      for (int64_t bi = 0; bi < num_blocks; ++bi) {
        const int64_t len = bi == num_blocks - 1 ? ctx - bi * block_size : block_size;
        const scalar_t* kb = key_cache + table[bi] * blk_stride;
        // The next block's keys (after the last, the first block's values)
        // are fetched while this one is computed on: blocks lie anywhere in a
        // cache far larger than the CPU's.
        const scalar_t* ahead = bi + 1 < num_blocks ? key_cache + table[bi + 1] * blk_stride
                                                    : value_cache + table[0] * blk_stride;
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
          next.step();
          if constexpr (!kSpread) {
            for (int64_t t = 0; t < block_size; ++t) {
              prefetch_span(reinterpret_cast<const char*>(ahead + t * tok_stride + kh * DIM),
                            row_bytes);
            }
          }
          for (int64_t t0 = 0; t0 < block_size; t0 += 16) {
            // Rows of the block ahead, for a part of the block this one lacks.
            const scalar_t* pf_rows = kSpread ? ahead + t0 * tok_stride + kh * DIM : nullptr;
            if (t0 >= len) {
              if constexpr (!kSpread) continue;
              for (int64_t t = 0; t < 16 && t0 + t < block_size; ++t) {
                prefetch_span(reinterpret_cast<const char*>(pf_rows + t * tok_stride), row_bytes);
              }
              continue;
            }
            const int64_t n = len - t0 < 16 ? len - t0 : 16;
            const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
            const scalar_t* krows = kb + t0 * tok_stride + kh * DIM;
            const int64_t pos = bi * block_size + t0;
            // Without the bf16 dot the chunk is widened once for the group.
            alignas(64) float widened[kBf16 && !kNativeDot ? 16 * DIM : 1];
            if constexpr (kBf16 && !kNativeDot) {
              for (int64_t t = 0; t < n; ++t) {
                widen_bf16<DIM>(krows + t * tok_stride, widened + t * DIM);
              }
            }
            for (int64_t g = 0; g < group; ++g) {
              const int64_t h = kh * group + g;
              __m512 s;
              const scalar_t* pf = g == 0 ? pf_rows : nullptr;
#ifdef __AVX512BF16__
              if constexpr (kNativeDot) {
                s = _mm512_mul_ps(
                    scores16_bf16<DIM>(q + (i * heads + h) * DIM, krows, tok_stride, n, pf),
                    _mm512_set1_ps(scale));
              } else
#endif
              if constexpr (kBf16) {
                s = scores16<DIM>(qf + h * DIM, widened, DIM, n, pf, tok_stride);
              } else {
                s = scores16<DIM>(qf + h * DIM, reinterpret_cast<const float*>(krows),
                                  tok_stride, n, pf, tok_stride);
              }
              _mm512_mask_storeu_ps(sc + h * padded + pos, live, s);
            }
          }
        }
      }
      // Softmax over the whole context at once: no running maximum, no
      // rescaling, every step independent of the one before.
      for (int64_t h = 0; h < heads; ++h) {
        float* s = sc + h * padded;
        const __m512 m = _mm512_set1_ps(preempt_serve_vec::max_of(s, ctx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < ctx; j += 16) {
          const __mmask16 live = preempt_serve_vec::first_lanes(ctx - j);
          const __m512 p = _mm512_maskz_mov_ps(
              live, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
          _mm512_storeu_ps(s + j, p);
          sum = _mm512_add_ps(sum, p);
        }
        inv[h] = 1.0f / _mm512_reduce_add_ps(sum);
      }
      // Pass 2: the weighted sum of the values, a block at a time; each value
      // row is read once for up to HT heads of its group, a slice of CW
      // vectors at a time, with the sums in registers across the block.
      std::memset(accm, 0, heads * DIM * sizeof(float));
      for (int64_t bi = 0; bi < num_blocks; ++bi) {
        const int64_t len = bi == num_blocks - 1 ? ctx - bi * block_size : block_size;
        const scalar_t* vb = value_cache + table[bi] * blk_stride;
        const scalar_t* ahead = bi + 1 < num_blocks ? value_cache + table[bi + 1] * blk_stride
                                                    : nullptr;
        const int64_t pos = bi * block_size;
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
          next.step();
          for (int64_t t = 0; t < block_size && ahead != nullptr && !kSpread; ++t) {
            prefetch_span(reinterpret_cast<const char*>(ahead + t * tok_stride + kh * DIM),
                          row_bytes);
          }
          for (int64_t g0 = 0; g0 < group; g0 += HT) {
            const int64_t gn = group - g0 < HT ? group - g0 : HT;
            const int64_t h0 = kh * group + g0;
            for (int cs = 0; cs < V; cs += CW) {
              // The block ahead's rows, spread among the first slice's work.
              const scalar_t* pf =
                  kSpread && ahead != nullptr && g0 == 0 && cs == 0 ? ahead + kh * DIM : nullptr;
              const scalar_t* vrows = vb + kh * DIM + 16 * cs;
              const float* probs = sc + h0 * padded + pos;
              float* sums = accm + h0 * DIM + 16 * cs;
              // The head count as a constant: a run-time count kept the
              // sums out of registers.
              switch (gn) {
                case 1: weigh_rows<scalar_t, 1, CW, DIM>(vrows, tok_stride, len, probs, padded,
                                                         sums, pf); break;
                case 2: weigh_rows<scalar_t, 2, CW, DIM>(vrows, tok_stride, len, probs, padded,
                                                         sums, pf); break;
                case 3: weigh_rows<scalar_t, 3, CW, DIM>(vrows, tok_stride, len, probs, padded,
                                                         sums, pf); break;
                default: weigh_rows<scalar_t, HT, CW, DIM>(vrows, tok_stride, len, probs,
                                                           padded, sums, pf); break;
              }
            }
          }
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* op = out + (i * heads + h) * DIM;
        const float* a = accm + h * DIM;
        const float k = inv[h];
        if constexpr (kBf16) {
          // Back in order: each 32-element piece was its even then odd elements.
          for (int64_t c = 0; c < DIM / 32; ++c) {
            for (int64_t j = 0; j < 16; ++j) {
              op[32 * c + 2 * j] = static_cast<scalar_t>(a[32 * c + j] * k);
              op[32 * c + 2 * j + 1] = static_cast<scalar_t>(a[32 * c + 16 + j] * k);
            }
          }
        } else {
          for (int64_t d = 0; d < DIM; ++d) op[d] = a[d] * k;
        }
      }
    }
  });
}

// bf16 decodes on AMX tiles where the build has them and the shape suits
// (paged_decode_amx.h), the rest on the AVX512 passes above.
template <typename scalar_t, int DIM>
void decode_vectorized(const scalar_t* q, const scalar_t* key_cache,
                       const scalar_t* value_cache, const int64_t* block_ids,
                       const int64_t* table_starts, const int64_t* context_lens, float scale,
                       scalar_t* out, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                       int64_t block_size) {
#ifdef PAGED_DECODE_AMX
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (preempt_serve_amx::usable(heads / kv_heads, block_size)) {
      preempt_serve_amx::decode<DIM>(q, key_cache, value_cache, block_ids, table_starts,
                                     context_lens, scale, out, num_seqs, heads, kv_heads,
                                     block_size);
      return;
    }
  }
#endif
  decode_avx512<scalar_t, DIM>(q, key_cache, value_cache, block_ids, table_starts,
                               context_lens, scale, out, num_seqs, heads, kv_heads, block_size);
}

#endif  // AVX512

#if !defined(PAGED_DECODE_AVX512) && defined(__AVX2__) && defined(__FMA__)
#include "paged_decode_avx2.h"
#endif

template <typename scalar_t>
void dispatch_dim(int64_t dim, const at::Tensor& q, const at::Tensor& kc,
                  const at::Tensor& vc, const int64_t* ids, const int64_t* starts,
                  const int64_t* ctx, float scale, at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1);
  const int64_t block_size = kc.size(1), kv_heads = kc.size(2);
#ifdef PAGED_DECODE_AVX512
  // Head dims in whole vectors (bfloat16: whole 32-element pieces).
  constexpr bool vectorized =
      std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>;
  if constexpr (vectorized) {
#define PAGED_DECODE_AVX512_DIM(D)                                                       \
  case D:                                                                               \
    decode_vectorized<scalar_t, D>(q.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(),       \
                                   vc.data_ptr<scalar_t>(), ids, starts, ctx, scale,      \
                                   out.data_ptr<scalar_t>(), n, heads, kv_heads,          \
                                   block_size);                                           \
    return;
    switch (dim) {
      PAGED_DECODE_AVX512_DIM(32)
      PAGED_DECODE_AVX512_DIM(64)
      PAGED_DECODE_AVX512_DIM(96)
      PAGED_DECODE_AVX512_DIM(128)
      PAGED_DECODE_AVX512_DIM(256)
      default:
        break;
    }
#undef PAGED_DECODE_AVX512_DIM
  }
#endif
#ifdef PAGED_DECODE_AVX2
  if constexpr (std::is_same_v<scalar_t, float>) {
#define PAGED_DECODE_AVX2_DIM(D)                                                           \
  case D:                                                                                 \
    decode_avx2<D>(q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), ids,    \
                   starts, ctx, scale, out.data_ptr<float>(), n, heads, kv_heads,          \
                   block_size);                                                           \
    return;
    switch (dim) {
      PAGED_DECODE_AVX2_DIM(32)
      PAGED_DECODE_AVX2_DIM(64)
      PAGED_DECODE_AVX2_DIM(96)
      PAGED_DECODE_AVX2_DIM(128)
      PAGED_DECODE_AVX2_DIM(256)
      default:
        break;
    }
#undef PAGED_DECODE_AVX2_DIM
  }
#endif
#define PAGED_DECODE_DIM(D)                                                             \
  case D:                                                                               \
    decode<scalar_t, D>(dim, q.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(),                \
                        vc.data_ptr<scalar_t>(), ids, starts, ctx, scale,               \
                        out.data_ptr<scalar_t>(), n, heads, kv_heads, block_size);      \
    return;
  switch (dim) {
    PAGED_DECODE_DIM(32)
    PAGED_DECODE_DIM(64)
    PAGED_DECODE_DIM(80)
    PAGED_DECODE_DIM(96)
    PAGED_DECODE_DIM(128)
    PAGED_DECODE_DIM(256)
    default:
      decode<scalar_t, 0>(dim, q.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(),
                          vc.data_ptr<scalar_t>(), ids, starts, ctx, scale,
                          out.data_ptr<scalar_t>(), n, heads, kv_heads, block_size);
  }
#undef PAGED_DECODE_DIM
}

void check_decode_args(const at::Tensor& q, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_ids,
                       const at::Tensor& table_starts, const at::Tensor& context_lens) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4, "paged_decode: q [n, heads, dim], "
              "caches [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "paged_decode: cache shapes differ");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type() &&
                  q.scalar_type() == value_cache.scalar_type(),
              "paged_decode: q and caches must share a dtype");
  TORCH_CHECK(q.size(2) == key_cache.size(3) && q.size(1) % key_cache.size(2) == 0,
              "paged_decode: head layout of q does not match the cache");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_decode: caches must be contiguous");
  for (const at::Tensor* t : {&block_ids, &table_starts, &context_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "paged_decode: index tensors must be contiguous int64 vectors");
  }
  TORCH_CHECK(table_starts.size(0) == q.size(0) && context_lens.size(0) == q.size(0),
              "paged_decode: one table start and one context length per query");
}

bool tiles_shape_ok(int64_t group, int64_t block_size, int64_t head_dim);

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_ids,
                        const at::Tensor& table_starts, const at::Tensor& context_lens,
                        double scale) {
  check_decode_args(q, key_cache, value_cache, block_ids, table_starts, context_lens);
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    dispatch_dim<scalar_t>(q.size(2), qc, key_cache, value_cache,
                           block_ids.data_ptr<int64_t>(), table_starts.data_ptr<int64_t>(),
                           context_lens.data_ptr<int64_t>(), static_cast<float>(scale), out);
  });
  return out;
}

// Decodes over a cache in the tiles layout (engine/kv_layout.py), which
// only the AMX path reads: an error wherever it cannot run.
at::Tensor paged_decode_tiles(const at::Tensor& q, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& block_ids,
                              const at::Tensor& table_starts, const at::Tensor& context_lens,
                              double scale) {
  check_decode_args(q, key_cache, value_cache, block_ids, table_starts, context_lens);
  TORCH_CHECK(tiles_shape_ok(q.size(1) / key_cache.size(2), key_cache.size(1), q.size(2)) &&
                  q.scalar_type() == at::kBFloat16,
              "paged_decode_tiles: needs the AMX build, bfloat16, a head dim in 32s, at most 16 "
              "query heads per KV head and blocks of a multiple of 16 tokens");
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
#ifdef PAGED_DECODE_AMX
  const int64_t n = q.size(0), heads = q.size(1), bs = key_cache.size(1), kvh = key_cache.size(2);
  const auto* qp = qc.data_ptr<at::BFloat16>();
  const auto* kp = key_cache.data_ptr<at::BFloat16>();
  const auto* vp = value_cache.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  const int64_t* starts = table_starts.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
#define PAGED_DECODE_TILES_DIM(D)                                                          \
  case D:                                                                                  \
    preempt_serve_amx::decode<D, true>(qp, kp, vp, ids, starts, ctx, sc, op, n, heads, kvh, bs); \
    break;
  switch (q.size(2)) {
    PAGED_DECODE_TILES_DIM(32)
    PAGED_DECODE_TILES_DIM(64)
    PAGED_DECODE_TILES_DIM(96)
    PAGED_DECODE_TILES_DIM(128)
    PAGED_DECODE_TILES_DIM(256)
    default:
      TORCH_CHECK(false, "paged_decode_tiles: head dim ", q.size(2), " not built");
  }
#undef PAGED_DECODE_TILES_DIM
#endif
  return out;
}

// Whether the AMX path can decode a tiles-layout cache of this shape
// (query heads per KV head, block size, head dim) in this process.
bool tiles_shape_ok(int64_t group, int64_t block_size, int64_t head_dim) {
#ifdef PAGED_DECODE_AMX
  return group >= 1 && group <= 16 && block_size % 16 == 0 &&
         (head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128 ||
          head_dim == 256) &&
         preempt_serve_amx::tiles_permitted();
#else
  (void)group;
  (void)block_size;
  (void)head_dim;
  return false;
#endif
}

// Whether a backend set up now should keep such a cache in the tiles layout:
// as tiles_shape_ok, and AMX decodes not switched off (set_decode_amx).
bool tiles_decodable(int64_t group, int64_t block_size, int64_t head_dim) {
#ifdef PAGED_DECODE_AMX
  if (!preempt_serve_amx::switched_on().load()) return false;
#endif
  return tiles_shape_ok(group, block_size, head_dim);
}

// Whether bfloat16 decodes go through the AMX tiles from now on: `enable`
// where this build has the AMX path and the OS grants the tiles' state;
// returns what holds after the call (false wherever there is no AMX path).
bool set_decode_amx(bool enable) {
#ifdef PAGED_DECODE_AMX
  preempt_serve_amx::switched_on().store(enable);
  return enable && preempt_serve_amx::tiles_permitted();
#else
  (void)enable;
  return false;
#endif
}

// Whether AMX decodes take p as one bf16 term (else two) from now on;
// returns whether this build has the AMX path.
bool set_decode_value_terms(bool one) {
#ifdef PAGED_DECODE_AMX
  preempt_serve_amx::one_term_switch().store(one);
  return true;
#else
  (void)one;
  return false;
#endif
}

// Whether the AMX operators' one-term p (decode and prefill) take the
// short base-2 exponential from now on (paged_decode_amx.h,
// short_exp_switch); returns whether this build has them.
bool set_short_exp(bool enable) {
#ifdef PAGED_DECODE_AMX
  preempt_serve_amx::short_exp_switch().store(enable);
  return true;
#else
  (void)enable;
  return false;
#endif
}

// Whether float32 decodes on the AVX512 passes ask for the next sequence's
// blocks from now on (f32_lookahead); returns the setting before the call
// (false, and no effect, on a build without those passes).
bool set_decode_lookahead_f32(bool enable) {
#ifdef PAGED_DECODE_AVX512
  return f32_lookahead().exchange(enable);
#else
  (void)enable;
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(preempt_serve, m) {
  m.def(
      "paged_decode(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_ids, "
      "Tensor table_starts, Tensor context_lens, float scale) -> Tensor");
  m.def(
      "paged_decode_tiles(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_ids, "
      "Tensor table_starts, Tensor context_lens, float scale) -> Tensor");
  m.def("set_decode_amx(bool enable) -> bool", &set_decode_amx);
  m.def("set_decode_value_terms(bool one) -> bool", &set_decode_value_terms);
  m.def("set_short_exp(bool enable) -> bool", &set_short_exp);
  m.def("set_decode_lookahead_f32(bool enable) -> bool", &set_decode_lookahead_f32);
  m.def("tiles_decodable(int group, int block_size, int head_dim) -> bool", &tiles_decodable);
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_decode_tiles", &paged_decode_tiles);
}
