// Prefill attention on CPU over the paged cache: every query token of a
// prefill chunk (a prompt, a later chunk of a chunked prompt, a recompute
// after preemption) attends its sequence's keys up to its own position, read
// in place through the block table after the step's new keys and values were
// written there.  One operator call takes every prefill chunk of a step.
//
// A build for an AVX512 capability (paged_prefill_avx512.h) tiles the work
// as FlashAttention-2 does
// (one pass over the keys with a running maximum and sum), with the tile's
// queries held transposed: a tile is the query heads of one KV head for up to
// 64 / group consecutive tokens (at most 64 rows, row r = token r / group,
// head r % group), stored [dim][rows], so that one key's scores for 16 rows
// are one vector built from broadcasts of the key's elements.  Scores then
// lie [key][rows]: the softmax's maximum and sum over keys are elementwise
// operations across vectors, with no horizontal reduction, and the causal
// mask of a key is a prefix of the rows.  The output accumulates transposed
// too ([dim][rows], each value element broadcast against 16 rows'
// probabilities).  Key and value rows are read straight from the cache
// (bfloat16 values widened once per tile for all the tile's rows); bf16
// scores use VDPBF16PS on pairs of the key's elements where the CPU has it,
// and where it also has AMX (blocks of a multiple of 16 tokens) the scores
// and the weighted sum go through tiles, 16 keys or dims by 16 rows a
// product (paged_prefill_amx.h).  Off the tiles, a bf16 weighted sum takes
// VDPBF16PS on pairs of keys (weighted_sum_pairs), the probabilities rounded
// to bf16 for it as ATen's CPU flash attention rounds them: 1.3x the
// attention's speed on a Zen 4 core (studies/engine_cpu/README.md, "A bf16
// prompt's weighted sum on pairs of keys"); the tiles take p so rounded too.
// Every sum is in float32.  A build for AVX2 + FMA without AVX512 runs the
// same scheme on 8-lane vectors (paged_prefill_avx2.h), and the same driver
// (`prefill_vec`) cuts the chunks into tiles.  Other builds, dtypes and head
// dims take a portable loop (scores of one query over its context, softmax,
// weighted sum).
//
// `tiles`: the cache holds bf16 blocks in the tiles layout
// (engine/kv_layout.py), which the AMX decode reads: a key's pairs of dims
// are read from its 32-dim pieces (a block's `block_size * 32` elements
// apart), a value row is picked out of its pairs of keys as it is widened
// (on the AMX tiles, a pair's words are the values' transposed tile as they
// lie); the same numbers as from rows, so the same results bit for bit.  Only
// the AVX512 path with the bf16 dot product reads it.
//
// A query row's arithmetic does not depend on the tile or chunk it falls
// in: its scores, maximum, sum and weighted sum are computed in its own
// vector lane, over key tiles that start at fixed positions (multiples of 32,
// or of 128 for bf16 on an AMX build: fixed per build and dtype, never by the
// batch), keys past its position weigh exactly 0 and leave its maximum alone,
// and a rescale by exp(0) is a multiply by exactly 1.  So deterministic mode
// (engine/attention_cpp.py) attends prompt positions here however the prompt
// is cut, and every later position through the decode operator.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernel_util.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

struct Chunk {
  int64_t seq;    // which sequence of the call
  int64_t kv_head;
  int64_t first;  // first token of the tile, counted from the chunk's start
  int64_t count;  // tokens in the tile
};

struct Layout {
  int64_t heads, kv_heads, group, block_size, dim;
  bool tiles = false;
  bool amx = false;  // bf16 scores and weighted sum on AMX tiles (paged_prefill_amx.h)
  int64_t tok_stride() const { return kv_heads * dim; }
  int64_t blk_stride() const { return block_size * kv_heads * dim; }
};

// Offset in the cache of key position j of a sequence, KV head kh.
inline int64_t cache_row(const int64_t* table, int64_t j, int64_t kh, const Layout& l) {
  return table[j / l.block_size] * l.blk_stride() + (j % l.block_size) * l.tok_stride() +
         kh * l.dim;
}

// The vector paths' tiles (paged_prefill_avx512.h, paged_prefill_avx2.h).
constexpr int64_t kMaxRows = 64;  // rows of a tile
constexpr int64_t kKeyTile = 32;  // keys per step of the online softmax
constexpr int64_t kMaxKeyTile = 128;  // the AMX path's steps (paged_prefill_amx.h)

// Per-thread scratch of one tile.
struct Scratch {
  std::vector<float> qt;  // [DIM][R] queries, transposed (bf16 pairs: [DIM/2][R] words)
  std::vector<float> s;   // [keys][R] a step's scores, then probabilities (AMX: p's terms)
  std::vector<float> ot;  // [DIM][R] output sums, transposed
  std::vector<float> kw;  // [keys][DIM] widened bf16 keys (no VDPBF16PS)
  std::vector<float> vw;  // [keys][DIM] widened bf16 values
  // AMX: the tile's sequence's V^T for its KV head, from key 0 in 32-key
  // parts (prefill_vec builds it once for all of their tiles).
  const uint32_t* vt = nullptr;
  explicit Scratch(int64_t dim)
      : qt(dim * kMaxRows), s(kMaxKeyTile * kMaxRows), ot(dim * kMaxRows),
        kw(kMaxKeyTile * dim), vw(kMaxKeyTile * dim) {}
};

template <typename scalar_t>
void prefill_portable(const scalar_t* q, const scalar_t* kc, const scalar_t* vc,
                      const int64_t* block_ids, const int64_t* table_starts,
                      const int64_t* query_starts, const int64_t* start_positions,
                      int64_t num_seqs, float scale, scalar_t* out, const Layout& l) {
  at::parallel_for(0, num_seqs * l.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, acc(l.dim), qf(l.dim);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / l.heads, h = w % l.heads, kh = h / l.group;
      const int64_t* table = block_ids + table_starts[i];
      for (int64_t tok = query_starts[i]; tok < query_starts[i + 1]; ++tok) {
        const int64_t ctx = start_positions[i] + (tok - query_starts[i]) + 1;
        const scalar_t* qp = q + (tok * l.heads + h) * l.dim;
        for (int64_t d = 0; d < l.dim; ++d) qf[d] = static_cast<float>(qp[d]) * scale;
        s.resize(ctx);
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < ctx; ++j) {
          const scalar_t* kp = kc + cache_row(table, j, kh, l);
          float dot = 0.0f;
          for (int64_t d = 0; d < l.dim; ++d) dot += qf[d] * static_cast<float>(kp[d]);
          s[j] = dot;
          mx = std::max(mx, dot);
        }
        float sum = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < ctx; ++j) {
          const float p = std::exp(s[j] - mx);
          sum += p;
          const scalar_t* vp = vc + cache_row(table, j, kh, l);
          for (int64_t d = 0; d < l.dim; ++d) acc[d] += p * static_cast<float>(vp[d]);
        }
        scalar_t* op = out + (tok * l.heads + h) * l.dim;
        for (int64_t d = 0; d < l.dim; ++d) op[d] = static_cast<scalar_t>(acc[d] / sum);
      }
    }
  });
}

}  // namespace

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include "paged_prefill_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "paged_prefill_avx2.h"
#endif  // AVX512, AVX2 + FMA

namespace {

#ifdef PAGED_PREFILL_VEC
// Every prefill chunk of the call cut into tiles of up to kMaxRows rows
// (kMaxRows / group tokens of one KV head), spread over the threads; each
// tile on the vector path for its number of row vectors.
template <typename scalar_t, int DIM>
void prefill_vec(const scalar_t* q, const scalar_t* kc, const scalar_t* vc,
                 const int64_t* block_ids, const int64_t* table_starts,
                 const int64_t* query_starts, const int64_t* start_positions,
                 int64_t num_seqs, float scale, scalar_t* out, const Layout& l) {
  const int64_t tile_tokens = std::max<int64_t>(1, kMaxRows / l.group);
  std::vector<Chunk> tiles;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t n = query_starts[i + 1] - query_starts[i];
    for (int64_t kh = 0; kh < l.kv_heads; ++kh) {
      for (int64_t f = 0; f < n; f += tile_tokens) {
        tiles.push_back({i, kh, f, std::min(tile_tokens, n - f)});
      }
    }
  }
#ifdef PAGED_PREFILL_AMX
  // On the tiles, every sequence's values transposed once per KV head (a
  // 16 x 16 transpose per 32 keys and 16 dims), read by all of its tiles
  // instead of each tile transposing every key it reads.
  std::unique_ptr<uint32_t[]> vt;
  // Where sequence i's KV head kh's V^T starts: vt_at[i * kv_heads + kh].
  std::vector<int64_t> vt_at(num_seqs * l.kv_heads + 1, 0);
  const auto context = [&](int64_t i) {
    return start_positions[i] + query_starts[i + 1] - query_starts[i];
  };
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (l.amx) {
      for (int64_t w = 0; w < num_seqs * l.kv_heads; ++w) {
        vt_at[w + 1] = vt_at[w] + (context(w / l.kv_heads) + 31) / 32 * 16 * DIM;
      }
      vt.reset(new uint32_t[vt_at.back()]);
      at::parallel_for(0, num_seqs * l.kv_heads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t w = begin; w < end; ++w) {
          const int64_t i = w / l.kv_heads;
          values_of_sequence<DIM>(vc, block_ids + table_starts[i], context(i), w % l.kv_heads,
                                  l, vt.get() + vt_at[w]);
        }
      });
    }
  }
#endif
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch sc(DIM);
#ifdef PAGED_PREFILL_AMX
    if (l.amx) paged_prefill_amx::configure();
#endif
    for (int64_t w = begin; w < end; ++w) {
      const Chunk& c = tiles[w];
      const int64_t* table = block_ids + table_starts[c.seq];
#ifdef PAGED_PREFILL_AMX
      if (vt) sc.vt = vt.get() + vt_at[c.seq * l.kv_heads + c.kv_head];
#endif
      const int64_t sp = start_positions[c.seq], qb = query_starts[c.seq];
      const int64_t rows = c.count * l.group;
      if (rows <= kLanes) {
        prefill_tile<scalar_t, DIM, 1>(q, kc, vc, table, sp, qb, c, scale, out, l, sc);
      } else if (rows <= 2 * kLanes) {
        prefill_tile<scalar_t, DIM, 2>(q, kc, vc, table, sp, qb, c, scale, out, l, sc);
      } else if (rows <= 4 * kLanes) {
        prefill_tile<scalar_t, DIM, 4>(q, kc, vc, table, sp, qb, c, scale, out, l, sc);
      } else if constexpr (kMaxRows > 4 * kLanes) {  // eight vectors (AVX2)
        prefill_tile<scalar_t, DIM, 8>(q, kc, vc, table, sp, qb, c, scale, out, l, sc);
      }
    }
#ifdef PAGED_PREFILL_AMX
    if (l.amx) _tile_release();
#endif
  });
}
#endif  // PAGED_PREFILL_VEC

template <typename scalar_t>
void dispatch(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
              const int64_t* ids, const int64_t* starts, const int64_t* qstarts,
              const int64_t* spos, int64_t num_seqs, float scale, at::Tensor& out,
              const Layout& l) {
#ifdef PAGED_PREFILL_VEC
  constexpr bool vectorized =
      std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>;
  if constexpr (vectorized) {
    if (l.group <= kMaxRows) {
#define PAGED_PREFILL_DIM(D)                                                                \
  case D:                                                                                  \
    prefill_vec<scalar_t, D>(q.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(),                \
                             vc.data_ptr<scalar_t>(), ids, starts, qstarts, spos,           \
                             num_seqs, scale, out.data_ptr<scalar_t>(), l);                 \
    return;
      switch (l.dim) {
        PAGED_PREFILL_DIM(32)
        PAGED_PREFILL_DIM(64)
        PAGED_PREFILL_DIM(96)
        PAGED_PREFILL_DIM(128)
        PAGED_PREFILL_DIM(256)
        default:
          break;
      }
#undef PAGED_PREFILL_DIM
    }
  }
#endif
  prefill_portable<scalar_t>(q.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(),
                             vc.data_ptr<scalar_t>(), ids, starts, qstarts, spos, num_seqs,
                             scale, out.data_ptr<scalar_t>(), l);
}

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_ids,
                         const at::Tensor& table_starts, const at::Tensor& query_starts,
                         const at::Tensor& start_positions, double scale, bool tiles) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4, "paged_prefill: q [tokens, heads, dim], "
              "caches [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "paged_prefill: cache shapes differ");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type() &&
                  q.scalar_type() == value_cache.scalar_type(),
              "paged_prefill: q and caches must share a dtype");
  TORCH_CHECK(q.size(2) == key_cache.size(3) && q.size(1) % key_cache.size(2) == 0,
              "paged_prefill: head layout of q does not match the cache");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_prefill: caches must be contiguous");
  for (const at::Tensor* t : {&block_ids, &table_starts, &query_starts, &start_positions}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "paged_prefill: index tensors must be contiguous int64 vectors");
  }
  const int64_t num_seqs = table_starts.size(0);
  TORCH_CHECK(start_positions.size(0) == num_seqs && query_starts.size(0) == num_seqs + 1,
              "paged_prefill: one table start and start position per sequence, and "
              "num_seqs + 1 query starts");
  const int64_t* qs = query_starts.data_ptr<int64_t>();
  TORCH_CHECK(num_seqs == 0 || (qs[0] == 0 && qs[num_seqs] == q.size(0)),
              "paged_prefill: query starts must cover q's tokens");
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(qs[i + 1] > qs[i], "paged_prefill: every sequence needs a query token");
  }
  bool amx = false;
#ifdef PAGED_PREFILL_AMX
  amx = q.scalar_type() == at::kBFloat16 &&
        paged_prefill_amx::usable(key_cache.size(1), q.size(2));
#endif
  const Layout l{q.size(1), key_cache.size(2), q.size(1) / key_cache.size(2),
                 key_cache.size(1), q.size(2), tiles, amx};
  if (tiles) {
    constexpr const char* kTilesNeed =
        "paged_prefill: a tiles-layout cache needs the AVX512 build with the bf16 dot product, "
        "bfloat16, an even block size and a head dim of 32, 64, 96, 128 or 256";
#if defined(PAGED_PREFILL_AVX512) && defined(__AVX512BF16__)
    const int64_t d = l.dim;
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 && l.group <= kMaxRows &&
                    l.block_size % 2 == 0 &&
                    (d == 32 || d == 64 || d == 96 || d == 128 || d == 256),
                kTilesNeed);
#else
    TORCH_CHECK(false, kTilesNeed);
#endif
  }
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill",
                                  [&] {
    dispatch<scalar_t>(qc, key_cache, value_cache, block_ids.data_ptr<int64_t>(),
                       table_starts.data_ptr<int64_t>(), qs,
                       start_positions.data_ptr<int64_t>(), num_seqs,
                       static_cast<float>(scale), out, l);
  });
  return out;
}

// Whether bf16 weighted sums take p rounded to bf16 from now on: on the
// vectors VDPBF16PS on pairs of keys (paged_prefill_avx512.h,
// weighted_sum_pairs), on AMX tiles one term (paged_prefill_amx.h); else
// float32 FMAs key by key, or the tiles' two terms.  Returns whether this
// build has the pairs' path (studies and tests run both in one process).
bool set_prefill_value_pairs(bool enable) {
#if defined(PAGED_PREFILL_AVX512) && defined(__AVX512BF16__)
  value_pairs_switch().store(enable);
  return true;
#else
  (void)enable;
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preempt_serve, m) {
  m.def("set_prefill_value_pairs(bool enable) -> bool", &set_prefill_value_pairs);
  m.def(
      "paged_prefill(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_ids, "
      "Tensor table_starts, Tensor query_starts, Tensor start_positions, float scale, "
      "bool tiles=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
