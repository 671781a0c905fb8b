// Paged decode attention on CPU: one query token per sequence, attended
// over the sequence's cache blocks in place (no gather, no padding).
//
// Built at first use by torch.utils.cpp_extension (engine/attention_cpp.py)
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
// whatever the cache dtype.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// exp(x) for x <= 0 (scores minus their running max): 2^n * e^r with
// |r| <= ln2/2 and a degree-7 polynomial; relative error ~1e-7.  Written
// without library calls so that the compiler vectorizes the loop using it.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline void prefetch_span(const char* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
}

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
    std::vector<float> qf_buf(heads * DIM), acc_buf(heads * DIM), sc_buf(heads * block_size);
    std::vector<float> run_max(heads), run_sum(heads);
    float* qf = qf_buf.data();
    float* acc = acc_buf.data();
    float* sc = sc_buf.data();
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* qp = q + (i * heads + h) * DIM;
        for (int64_t d = 0; d < DIM; ++d) {
          qf[h * DIM + d] = to_float(qp[d]) * scale;
          acc[h * DIM + d] = 0.0f;
        }
        run_max[h] = -std::numeric_limits<float>::infinity();
        run_sum[h] = 0.0f;
      }
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
        // Online softmax: rescale what was accumulated when the max grows.
        for (int64_t h = 0; h < heads; ++h) {
          float* s = sc + h * block_size;
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
            float* a = acc + h * DIM;
#pragma omp simd
            for (int64_t d = 0; d < DIM; ++d) a[d] *= corr;
          }
        }
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
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* op = out + (i * heads + h) * DIM;
        const float inv = 1.0f / run_sum[h];
        for (int64_t d = 0; d < DIM; ++d) op[d] = static_cast<scalar_t>(acc[h * DIM + d] * inv);
      }
    }
  });
}

template <typename scalar_t>
void dispatch_dim(int64_t dim, const at::Tensor& q, const at::Tensor& kc,
                  const at::Tensor& vc, const int64_t* ids, const int64_t* starts,
                  const int64_t* ctx, float scale, at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1);
  const int64_t block_size = kc.size(1), kv_heads = kc.size(2);
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

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_ids,
                        const at::Tensor& table_starts, const at::Tensor& context_lens,
                        double scale) {
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
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    dispatch_dim<scalar_t>(q.size(2), qc, key_cache, value_cache,
                           block_ids.data_ptr<int64_t>(), table_starts.data_ptr<int64_t>(),
                           context_lens.data_ptr<int64_t>(), static_cast<float>(scale), out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(preempt_serve, m) {
  m.def(
      "paged_decode(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_ids, "
      "Tensor table_starts, Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) { m.impl("paged_decode", &paged_decode); }
