// float32 projections whose weights are kept as the 4- or 8-bit codes they
// were decoded from: y = x W^T (+ bias), bit for bit what gemm_f32.cpp gives
// on the decoded float32 weight.
//
// A model read from a GGUF file (the embedded SmolLM2 is Q4_1, its
// embedding Q8_0) holds float32 weights that are, every 32 along a row,
// m + d q (Q4_1: q in 0..15, d and m float16) or d q (Q8_0: q in -128..127,
// d float16).  Kept as float32 they are 32 bits a weight that every decode
// step reads from memory (SmolLM2: 538 MB, most of a batch-1 step's time on
// one AVX2 core); kept as codes they are 6 (Q4) or 9 (Q8).
// `pack_f32_codes` finds d, m and q for every block of a weight (m the
// block's smallest value, d its range / 15 or its largest magnitude / 127,
// as GGUF's quantizer sets them, to the nearest float16 or the two beside
// it) and keeps them only where every value comes back exactly:
// fma(q, d, m) == w, one rounding, as the decoder's d * q + m (d * q is
// exact, 11 bits times 4 or 8).  (== takes -0 for +0: a zero weight's sign
// never shows in a sum that starts from +0.)  Otherwise it returns an empty
// tensor and the weight stays float32.
//
// Layout: [N/16][K/32][block], one block per 16 columns and 32 k:
//   Q4 (384 bytes): d[16], m[16] float32; then per k 8 bytes, byte j the
//       code of column j in its low nibble and of column j + 8 in its high;
//   Q8 (576 bytes): d[16] float32; then per k 16 signed bytes, one a column.
// For up to six rows the GEMM decodes each k's 16 weights into registers
// and multiplies them at once; for more it decodes a panel (16 columns, all
// K) into a per-thread float32 buffer in gemm_f32.cpp's layout, one FMA or
// multiply per weight, and runs gemm_f32.cpp's micro-kernel on it for every
// row block.  That decode is 14-16 % of the work at 32 rows
// (studies/engine_cpu/README.md) and is paid once per row chunk, so the
// chunks here are 4 MiB of x, not gemm_f32.cpp's 192 KiB (which keep x in
// L2 while float32 weights stream from memory): x's rows stream from L3 at
// an eighth of a byte per FLOP instead (studies/engine_cpu/codes_chunks.py
// times both sizes).
// Either way each output is the same FMA chain over k on the
// same weights as gemm_f32.cpp's, so the same bits, whatever the rows
// (deterministic mode needs no tiles here either).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {
namespace gemm_codes {

constexpr int64_t kBlockK = 32;
constexpr int64_t kQ4Bytes = 64 + 64 + kBlockK * 8;
constexpr int64_t kQ8Bytes = 64 + kBlockK * 16;
// Bytes of x a row chunk takes (the header says why); a macro so that
// studies/engine_cpu/codes_chunks.py can build the previous size beside it.
#ifndef PREEMPT_SERVE_CODES_ROW_BYTES
#define PREEMPT_SERVE_CODES_ROW_BYTES (4 << 20)
#endif
constexpr int64_t kRowBytes = PREEMPT_SERVE_CODES_ROW_BYTES;

float to_half(float v) { return static_cast<float>(c10::Half(v)); }

// The float16 values next to `h` (a float16 value), below and above.
void half_neighbours(float h, float out[2]) {
  const c10::Half hv(h);
  uint16_t bits;
  std::memcpy(&bits, &hv, 2);
  for (int s = 0; s < 2; ++s) {
    const uint16_t b = static_cast<uint16_t>(s == 0 ? bits - 1 : bits + 1);
    c10::Half n;
    std::memcpy(&n, &b, 2);
    out[s] = static_cast<float>(n);
  }
}

// Whether codes `r` (guessed from the values with a reciprocal; only the
// check below must be exact) times `c` plus `m` give back every value of `v`,
// each code in [lo, hi].  Branch-free, so that the compiler vectorizes it:
// a model's every weight goes through here once when the engine starts.
bool codes_fit(const float* v, float c, float m, float lo, float hi, float* r) {
  const float inv = c == 0.0f ? 0.0f : 1.0f / c;
  int bad = 0;
#pragma omp simd reduction(| : bad)
  for (int i = 0; i < kBlockK; ++i) {
    const float ri = std::nearbyint((v[i] - m) * inv);
    bad |= !(ri >= lo && ri <= hi && std::fma(ri, c, m) == v[i]);
    r[i] = ri;
  }
  return bad == 0;
}

// One row's block of 32 values as Q4_1 (d, m, q[32]); false where no float16
// d and m reproduce every value.
bool fit_q4(const float* v, float& d, float& m, uint8_t* q) {
  float lo = v[0], hi = v[0];
#pragma omp simd reduction(min : lo) reduction(max : hi)
  for (int i = 0; i < kBlockK; ++i) {
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
  }
  if (!std::isfinite(lo) || !std::isfinite(hi) || to_half(lo) != lo) return false;
  m = lo;  // the block's smallest value has the code 0
  const float guess = to_half((hi - lo) / 15.0f);
  float cand[3] = {guess, 0.0f, 0.0f}, r[kBlockK];
  half_neighbours(guess, cand + 1);
  for (float c : cand) {
    if (!(c >= 0.0f) || !std::isfinite(c) || (c == 0.0f && hi != lo)) continue;
    if (codes_fit(v, c, m, 0.0f, 15.0f, r)) {
      for (int i = 0; i < kBlockK; ++i) q[i] = static_cast<uint8_t>(r[i]);
      d = c;
      return true;
    }
  }
  return false;
}

// One row's block as Q8_0 (d, q[32]).
bool fit_q8(const float* v, float& d, int8_t* q) {
  float amax = 0.0f;
#pragma omp simd reduction(max : amax)
  for (int i = 0; i < kBlockK; ++i) amax = std::max(amax, std::fabs(v[i]));
  if (!std::isfinite(amax)) return false;
  const float guess = to_half(amax / 127.0f);
  float cand[3] = {guess, 0.0f, 0.0f}, r[kBlockK];
  half_neighbours(guess, cand + 1);
  for (float c : cand) {
    if (!(c >= 0.0f) || !std::isfinite(c) || (c == 0.0f && amax != 0.0f)) continue;
    if (codes_fit(v, c, 0.0f, -128.0f, 127.0f, r)) {
      for (int i = 0; i < kBlockK; ++i) q[i] = static_cast<int8_t>(r[i]);
      d = c;
      return true;
    }
  }
  return false;
}

// Every block of `w` [N, K] in the `bytes`-long format, or an empty tensor.
at::Tensor encode(const float* w, int64_t n, int64_t k, int64_t bytes) {
  const int64_t panels = n / 16, kblocks = k / kBlockK;
  at::Tensor out = at::zeros({panels, kblocks, bytes}, at::kByte);
  uint8_t* o = out.data_ptr<uint8_t>();
  std::atomic<bool> failed{false};
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    uint8_t q4[kBlockK];
    int8_t q8[kBlockK];
    for (int64_t p = p0; p < p1 && !failed.load(std::memory_order_relaxed); ++p) {
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        uint8_t* blk = o + (p * kblocks + kb) * bytes;
        float* d = reinterpret_cast<float*>(blk);
        for (int64_t j = 0; j < 16; ++j) {
          const float* v = w + (p * 16 + j) * k + kb * kBlockK;
          float dj = 0.0f, mj = 0.0f;
          if (bytes == kQ4Bytes ? !fit_q4(v, dj, mj, q4) : !fit_q8(v, dj, q8)) {
            failed.store(true, std::memory_order_relaxed);
            return;
          }
          d[j] = dj;
          if (bytes == kQ4Bytes) {
            d[16 + j] = mj;
            uint8_t* codes = blk + 128;
            for (int64_t i = 0; i < kBlockK; ++i) {
              codes[i * 8 + j % 8] |= static_cast<uint8_t>(q4[i] << (j < 8 ? 0 : 4));
            }
          } else {
            int8_t* codes = reinterpret_cast<int8_t*>(blk + 64);
            for (int64_t i = 0; i < kBlockK; ++i) codes[i * 16 + j] = q8[i];
          }
        }
      }
    }
  });
  return failed.load() ? at::Tensor() : out;
}

at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat,
              "pack_f32_codes: a 2-D float32 weight [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  if (n % 16 != 0 || k % kBlockK != 0 || n == 0 || k == 0) return at::empty({0}, at::kByte);
  at::Tensor wc = w.contiguous();
  for (int64_t bytes : {kQ4Bytes, kQ8Bytes}) {
    at::Tensor got = encode(wc.data_ptr<float>(), n, k, bytes);
    if (got.defined()) return got;
  }
  return at::empty({0}, at::kByte);
}

#ifdef PREEMPT_SERVE_F32_FMA

// One block's scales (and minima) in registers; `at(i)` decodes the 16
// columns' weights of its k = i, one FMA (Q4) or multiply (Q8) a weight.
// The buffer and the register path both decode through it.
template <bool Q4>
struct Block {
  static constexpr int64_t kBytes = Q4 ? kQ4Bytes : kQ8Bytes;
  const uint8_t* codes;
  __m256 d0, d1, m0, m1;

  explicit Block(const uint8_t* blk) {
    const float* d = reinterpret_cast<const float*>(blk);
    d0 = _mm256_loadu_ps(d);
    d1 = _mm256_loadu_ps(d + 8);
    m0 = Q4 ? _mm256_loadu_ps(d + 16) : _mm256_setzero_ps();
    m1 = Q4 ? _mm256_loadu_ps(d + 24) : _mm256_setzero_ps();
    codes = blk + (Q4 ? 128 : 64);
  }

  __attribute__((always_inline)) void at(int64_t i, __m256& w0, __m256& w1) const {
    if constexpr (Q4) {
      const __m256i q = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i * 8)));
      w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15))),
                           d0, m0);
      w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), d1, m1);
    } else {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i * 16));
      w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d0);
      w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), d1);
    }
  }
};

// Panel `blocks` (K/32 blocks) into `buf` [K][16] float32.
template <bool Q4>
void decode_panel(const uint8_t* blocks, int64_t kblocks, float* buf) {
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    const Block<Q4> blk(blocks + kb * Block<Q4>::kBytes);
    float* out = buf + kb * kBlockK * 16;
    for (int64_t i = 0; i < kBlockK; ++i) {
      __m256 w0, w1;
      blk.at(i, w0, w1);
      _mm256_storeu_ps(out + i * 16, w0);
      _mm256_storeu_ps(out + i * 16 + 8, w1);
    }
  }
}

// Rows [0, MR) of `a` times one panel's codes, each k's 16 weights decoded
// into two registers and used at once: where the rows fit one block, the
// decode costs less than a buffer's store and reload.
template <int MR, bool Q4>
void micro_codes(const float* a, int64_t lda, const uint8_t* blocks, int64_t kblocks,
                 const float* bias, float* c, int64_t ldc) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    const Block<Q4> blk(blocks + kb * Block<Q4>::kBytes);
    const float* ak = a + kb * kBlockK;
    for (int64_t i = 0; i < kBlockK; ++i) {
      __m256 w0, w1;
      blk.at(i, w0, w1);
      gemm_f32::fma_rows<MR>(ak, lda, i, w0, w1, PREEMPT_SERVE_ACC_ARGS);
    }
  }
  gemm_f32::store_rows<MR>(bias, c, ldc, PREEMPT_SERVE_ACC_ARGS);
}

using MicroCodes = void (*)(const float*, int64_t, const uint8_t*, int64_t, const float*, float*,
                            int64_t);
constexpr MicroCodes kMicroCodes[2][gemm_f32::kRows] = {
    {&micro_codes<1, false>, &micro_codes<2, false>, &micro_codes<3, false>,
     &micro_codes<4, false>, &micro_codes<5, false>, &micro_codes<6, false>},
    {&micro_codes<1, true>, &micro_codes<2, true>, &micro_codes<3, true>,
     &micro_codes<4, true>, &micro_codes<5, true>, &micro_codes<6, true>}};

#endif  // PREEMPT_SERVE_F32_FMA

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  (packed.size(2) == kQ4Bytes || packed.size(2) == kQ8Bytes),
              "linear_f32_codes: the weight must come from pack_f32_codes");
  const int64_t panels = packed.size(0), kblocks = packed.size(1), bytes = packed.size(2);
  const int64_t n = panels * 16, k = kblocks * kBlockK;
  const gemm_f32::Operands o = gemm_f32::operands("linear_f32_codes", x, n, k, bias);
  const int64_t m = o.m;
  at::Tensor y = o.y;
  if (m == 0) return y;
#ifdef PREEMPT_SERVE_F32_FMA
  const float* xp = o.x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const float* bp = o.bias_ptr();
  const int64_t lda = o.lda;
  const int64_t chunks = gemm_f32::row_chunks(m, k, kRowBytes);
  const bool q4 = bytes == kQ4Bytes;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t m0 = c * m / chunks, m1 = (c + 1) * m / chunks;
    if (m1 - m0 <= gemm_f32::kRows) {
      // Rows that fit one block decode in registers.  Two blocks (up to 12
      // rows) ran no faster that way on a Zen 3 core than through the buffer:
      // decoding twice against once plus the buffer's store and reload.
      const MicroCodes micro = kMicroCodes[q4][m1 - m0 - 1];
      at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) {
          micro(xp + m0 * lda, lda, wp + p * kblocks * bytes, kblocks,
                bp == nullptr ? nullptr : bp + p * 16, yp + m0 * n + p * 16, n);
        }
      });
      continue;
    }
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      thread_local std::vector<float> buf;
      buf.resize(static_cast<size_t>(k) * 16);
      for (int64_t p = p0; p < p1; ++p) {
        (q4 ? decode_panel<true> : decode_panel<false>)(wp + p * kblocks * bytes, kblocks,
                                                       buf.data());
        // The decoded panel stands in for panel 0 of gemm_f32's layout; the
        // output and bias pointers are moved to panel p's columns.
        gemm_f32::gemm_range(xp, lda, buf.data(), k, bp == nullptr ? nullptr : bp + p * 16,
                             yp + p * 16, n, m0, m1, 0, 1);
      }
    });
  }
#endif
  return y;
}

}  // namespace gemm_codes
}  // namespace

TORCH_LIBRARY_FRAGMENT(preempt_serve, m) {
  m.def("pack_f32_codes(Tensor w) -> Tensor");
  m.def("linear_f32_codes(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) {
  m.impl("pack_f32_codes", &gemm_codes::pack);
  m.impl("linear_f32_codes", &gemm_codes::linear);
}
