// A step's new keys and values into the paged cache on CPU: token t's rows
// (all its KV heads, contiguous in k and v) to slot slots[t] of each cache,
// one copy per token and tensor.  The same bytes as
// `cache.view(-1, kv_heads, dim).index_copy_(0, slots, k)`, without the
// generic index kernel's per-element work (about 40 µs a call for a batch
// of 96 tokens of SmolLM2, two calls a layer).
//
// write_kv_tiles: the same rows into a cache block laid out for AMX tiles
// (engine/kv_layout.py): within a block, keys as [kv_head][32-dim piece]
// [token][32 dims] (16 tokens' piece is one 1 KB tile), values as
// [kv_head][16-dim column][token pair][16 dims][2 tokens] (a pair of keys'
// values interleaved, the right-hand tile's layout for the weighted sum).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

void check_rows(const char* what, const at::Tensor& t, const at::Tensor& cache) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2),
              "write_kv: ", what, " [T, kv_heads, dim] with each token's rows contiguous");
  TORCH_CHECK(cache.is_contiguous() && cache.scalar_type() == t.scalar_type(),
              "write_kv: a contiguous ", what, " cache of the same dtype");
  TORCH_CHECK(cache.numel() % (t.size(1) * t.size(2)) == 0,
              "write_kv: the ", what, " cache is not whole slots of kv_heads x dim");
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor key_cache,
              at::Tensor value_cache, const at::Tensor& slots) {
  check_rows("key", k, key_cache);
  check_rows("value", v, value_cache);
  TORCH_CHECK(v.sizes() == k.sizes(), "write_kv: k and v of one shape");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == k.size(0),
              "write_kv: one int64 slot per token");
  const int64_t tokens = k.size(0), row = k.size(1) * k.size(2);
  const int64_t num_slots = key_cache.numel() / row;
  TORCH_CHECK(value_cache.numel() / row == num_slots, "write_kv: caches of unequal slots");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(s[t] >= 0 && s[t] < num_slots, "write_kv: slot ", s[t], " out of range");
  }
  const int64_t bytes = row * static_cast<int64_t>(k.element_size());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t kstride = k.stride(0) * k.element_size(), vstride = v.stride(0) * v.element_size();
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + s[t] * bytes, ks + t * kstride, bytes);
      std::memcpy(vc + s[t] * bytes, vs + t * vstride, bytes);
    }
  });
}

void write_kv_tiles(const at::Tensor& k, const at::Tensor& v, at::Tensor key_cache,
                    at::Tensor value_cache, const at::Tensor& slots) {
  check_rows("key", k, key_cache);
  check_rows("value", v, value_cache);
  TORCH_CHECK(v.sizes() == k.sizes(), "write_kv_tiles: k and v of one shape");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.size(2) == k.size(1) && key_cache.size(3) == k.size(2),
              "write_kv_tiles: caches [blocks, block_size, kv_heads, dim] matching k");
  TORCH_CHECK(k.element_size() == 2, "write_kv_tiles: a 2-byte dtype (bfloat16)");
  const int64_t bs = key_cache.size(1), kv_heads = k.size(1), dim = k.size(2);
  TORCH_CHECK(dim % 32 == 0 && bs % 2 == 0,
              "write_kv_tiles: head dim a multiple of 32 and an even block size");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == k.size(0),
              "write_kv_tiles: one int64 slot per token");
  const int64_t tokens = k.size(0), num_slots = key_cache.size(0) * bs;
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(s[t] >= 0 && s[t] < num_slots, "write_kv_tiles: slot ", s[t], " out of range");
  }
  const int64_t pieces = dim / 32, cols = dim / 16, block = bs * kv_heads * dim;
  const uint16_t* ks = static_cast<const uint16_t*>(k.data_ptr());
  const uint16_t* vs = static_cast<const uint16_t*>(v.data_ptr());
  uint16_t* kc = static_cast<uint16_t*>(key_cache.data_ptr());
  uint16_t* vc = static_cast<uint16_t*>(value_cache.data_ptr());
  const int64_t kstride = k.stride(0), vstride = v.stride(0);
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = s[t] / bs, off = s[t] % bs;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const uint16_t* kr = ks + t * kstride + h * dim;
        uint16_t* kd = kc + b * block + (h * pieces * bs + off) * 32;
        for (int64_t c = 0; c < pieces; ++c) std::memcpy(kd + c * bs * 32, kr + 32 * c, 64);
        const uint16_t* vr = vs + t * vstride + h * dim;
        uint16_t* vd = vc + b * block + (h * cols * (bs / 2) + off / 2) * 32 + off % 2;
        for (int64_t d = 0; d < dim; ++d) vd[(d / 16) * (bs / 2) * 32 + (d % 16) * 2] = vr[d];
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preempt_serve, m) {
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slots) -> ()");
  m.def("write_kv_tiles(Tensor k, Tensor v, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) {
  m.impl("write_kv", &write_kv);
  m.impl("write_kv_tiles", &write_kv_tiles);
}
