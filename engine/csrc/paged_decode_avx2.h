// The decode operator (paged_decode.cpp) for float32 caches on AVX2 + FMA
// builds, in 8-lane vectors.  The portable loop takes one DIM-wide reduction
// per (token, head) and one weighted row per (token, head); here, block by
// block of the sequence's cache, as that loop goes:
//  1. every head's scores against the block's keys, 8 tokens of a KV head
//     at once: per token a vector of partial products, the 8 folded into
//     one vector of 8 scores (three rounds of horizontal adds);
//  2. the portable loop's online softmax (OnlineState::weigh_block);
//  3. the weighted sum of the values, each value row read once for up to
//     four heads of its group, 16 of its elements at a time, the sums in
//     registers across the block.
// Memory, not arithmetic, bounds a decode whose blocks are not in the CPU's
// caches (distinct requests' K/V: 6 MB a layer at 32 sequences of 128
// tokens of SmolLM2): while step 1 runs, the block's values are prefetched,
// and while step 3 runs, the next block's keys, each spread evenly over the
// calls and rows of the step (Share below).  On a Zen 3 core it runs
// SmolLM2's decodes somewhat faster than the portable loop, from memory and
// from the caches (studies/engine_cpu/decode_avx2.py).  The order of every
// sum depends on the sequence's own context only, never on the batch
// (deterministic mode).
// Included by paged_decode.cpp in builds without AVX512.

#pragma once

#include <immintrin.h>

#define PAGED_DECODE_AVX2 1

namespace {

// A share of a span to prefetch, spread over a loop's rows: `lines` cache
// lines from `base`, `per_row` of them as each row is computed on.  Blocks
// lie at random places in memory, so the software asks for the next span;
// asked for a whole block at once, the requests outran the core's miss
// buffers on a Zen 3 core (decodes slower than the portable loop's, which
// asks for a row at a time).
struct Share {
  const char* base = nullptr;
  int64_t lines = 0, per_row = 0;

  // Share `part` of `parts` of the span [p, p + bytes), over `rows` rows.
  static Share of(const void* p, int64_t bytes, int64_t part, int64_t parts, int64_t rows) {
    const int64_t total = (bytes + 63) / 64, each = (total + parts - 1) / parts;
    const int64_t first = std::min(total, part * each);
    const int64_t lines = std::min(total - first, each);
    return {static_cast<const char*>(p) + 64 * first, lines, (lines + rows - 1) / rows};
  }

  __attribute__((always_inline)) void row(int64_t t) const {
    const int64_t hi = std::min(lines, (t + 1) * per_row);
    for (int64_t l = t * per_row; l < hi; ++l) __builtin_prefetch(base + 64 * l);
  }
};

// Lane t: the sum of v[t]'s eight lanes.
inline __m256 lane_sums8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Scores of one query (DIM floats, in L1) against n <= 8 rows of k, lane t
// for row t; row t of `pf` (where not null, same stride) is prefetched as
// row t is computed on.
template <int DIM>
inline __m256 scores8(const float* q, const float* k, int64_t stride, int64_t n,
                      const Share& pf) {
  __m256 part[8];
  for (int t = 0; t < 8; ++t) {
    pf.row(t);
    if (t < n) {
      const float* kp = k + t * stride;
      // Two chains, so that the FMAs' latency overlaps.
      __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(kp));
      __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(q + 8), _mm256_loadu_ps(kp + 8));
      for (int c = 2; c < DIM / 8; c += 2) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(kp + 8 * c), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c + 8), _mm256_loadu_ps(kp + 8 * c + 8),
                             s1);
      }
      part[t] = _mm256_add_ps(s0, s1);
    } else {
      part[t] = _mm256_setzero_ps();
    }
  }
  return lane_sums8(part);
}

// GN heads' sums (16 elements of each, at sums[g * DIM]) plus the weighted
// rows t < len of `rows` (stride apart), weights probs[g * padded + t].
template <int GN, int DIM>
inline void weigh_rows8(const float* rows, int64_t stride, int64_t len, const float* probs,
                        int64_t padded, float* sums, const Share& pf) {
  __m256 acc[GN][2];
  for (int g = 0; g < GN; ++g) {
    acc[g][0] = _mm256_loadu_ps(sums + g * DIM);
    acc[g][1] = _mm256_loadu_ps(sums + g * DIM + 8);
  }
  for (int64_t t = 0; t < len; ++t) {
    pf.row(t);
    const __m256 r0 = _mm256_loadu_ps(rows + t * stride);
    const __m256 r1 = _mm256_loadu_ps(rows + t * stride + 8);
    for (int g = 0; g < GN; ++g) {
      const __m256 p = _mm256_broadcast_ss(probs + g * padded + t);
      acc[g][0] = _mm256_fmadd_ps(p, r0, acc[g][0]);
      acc[g][1] = _mm256_fmadd_ps(p, r1, acc[g][1]);
    }
  }
  for (int g = 0; g < GN; ++g) {
    _mm256_storeu_ps(sums + g * DIM, acc[g][0]);
    _mm256_storeu_ps(sums + g * DIM + 8, acc[g][1]);
  }
}

template <int DIM>
void decode_avx2(const float* q, const float* key_cache, const float* value_cache,
                 const int64_t* block_ids, const int64_t* table_starts,
                 const int64_t* context_lens, float scale, float* out, int64_t num_seqs,
                 int64_t heads, int64_t kv_heads, int64_t block_size) {
  static_assert(DIM % 16 == 0, "head dim in 16s");
  constexpr int HT = 4;  // heads of a group summed together
  const int64_t group = heads / kv_heads;
  const int64_t tok_stride = kv_heads * DIM;
  const int64_t blk_stride = block_size * tok_stride;
  const int64_t padded = (block_size + 7) / 8 * 8;
  const int64_t tok_bytes = tok_stride * static_cast<int64_t>(sizeof(float));
  const int64_t blk_bytes = block_size * tok_bytes;
  // Calls of the weighted sum a block: KV heads x tiles of heads x slices.
  const int64_t groups = (group + HT - 1) / HT, calls = kv_heads * groups * (DIM / 16);
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    OnlineState st(heads, DIM);
    std::vector<float> sc_buf(heads * padded);
    const float* qf = st.qf.data();
    float* accm = st.acc.data();
    float* sc = sc_buf.data();
    for (int64_t i = begin; i < end; ++i) {
      st.start(q + i * heads * DIM, heads, DIM, scale);
      const int64_t ctx = context_lens[i];
      const int64_t* table = block_ids + table_starts[i];
      const int64_t num_blocks = (ctx + block_size - 1) / block_size;
      for (int64_t bi = 0; bi < num_blocks; ++bi) {
        const int64_t len = bi == num_blocks - 1 ? ctx - bi * block_size : block_size;
        const float* kb = key_cache + table[bi] * blk_stride;
        const float* vb = value_cache + table[bi] * blk_stride;
        const float* kn = bi + 1 < num_blocks ? key_cache + table[bi + 1] * blk_stride : nullptr;
        // Scores of every head against the block's keys; the block's values
        // are fetched meanwhile.
        for (int64_t t0 = 0; t0 < len; t0 += 8) {
          const int64_t n = std::min<int64_t>(len - t0, 8);
          for (int64_t kh = 0; kh < kv_heads; ++kh) {
            const float* krows = kb + t0 * tok_stride + kh * DIM;
            for (int64_t g = 0; g < group; ++g) {
              const int64_t h = kh * group + g;
              // This chunk's values, for the weighted sum below.
              const Share pf = Share::of(vb + t0 * tok_stride, n * tok_bytes, h, heads, 8);
              const __m256 s = scores8<DIM>(qf + h * DIM, krows, tok_stride, n, pf);
              _mm256_storeu_ps(sc + h * padded + t0, s);  // lanes past len: padding
            }
          }
        }
        for (int64_t h = 0; h < heads; ++h) st.weigh_block(h, sc + h * padded, len, DIM);
        // The weighted values, each row read once for up to HT heads of its
        // group, 16 elements at a time; the next block's keys fetched
        // meanwhile.
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
          for (int64_t g0 = 0; g0 < group; g0 += HT) {
            const int64_t gn = std::min<int64_t>(group - g0, HT);
            const int64_t h0 = kh * group + g0;
            for (int cs = 0; cs < DIM; cs += 16) {
              // The next block's keys, a share in each call.
              const int64_t part = (kh * groups + g0 / HT) * (DIM / 16) + cs / 16;
              const Share pf = kn == nullptr ? Share{}
                                             : Share::of(kn, blk_bytes, part, calls, len);
              const float* vrows = vb + kh * DIM + cs;
              const float* probs = sc + h0 * padded;
              float* sums = accm + h0 * DIM + cs;
              switch (gn) {
                case 1: weigh_rows8<1, DIM>(vrows, tok_stride, len, probs, padded, sums, pf);
                  break;
                case 2: weigh_rows8<2, DIM>(vrows, tok_stride, len, probs, padded, sums, pf);
                  break;
                case 3: weigh_rows8<3, DIM>(vrows, tok_stride, len, probs, padded, sums, pf);
                  break;
                default: weigh_rows8<HT, DIM>(vrows, tok_stride, len, probs, padded, sums, pf);
                  break;
              }
            }
          }
        }
      }
      st.finish(out + i * heads * DIM, heads, DIM);
    }
  });
}

}  // namespace
