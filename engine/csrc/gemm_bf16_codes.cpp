// bf16 projections on weights kept both as the 4- or 8-bit codes a GGUF
// file stores them in and as their bf16 values: y = x W^T (+ bias), bit for
// bit what linear_bf16 gives on the packed bf16 weight.
//
// A bfloat16 model read from the embedded SmolLM2's GGUF holds weights that
// are bf16(w), w = m + d q in float32 (gemm_f32_codes.cpp says how its
// pack_f32_codes finds d, m and q so that fma(q, d, m) == w exactly).  The
// loader fits those codes on the float32 values before it rounds them
// (engine/models/weight_codes.py), and this kernel decodes each block of 16
// columns x 32 k back into w in float32, rounds it to bf16 to nearest even
// (VCVTNE2PS2BF16, as the cast that made the model's weight; no value here is
// denormal, whose handling would differ) and multiplies the result on the
// AMX tiles exactly as gemm_bf16_amx.h multiplies the packed bf16 weight: the
// same operands in the same order.
//
// Why: a decode step reads every weight from memory, and at a few rows the
// tiles multiply faster than one core streams bf16 weights (SmolLM2's
// projections, 212 MB in bf16: ~14.5 ms a step at 1-8 rows on a Xeon core).
// Their codes are 80 MB, and decoding a block into the tiles' right-hand
// operand costs about 5 cycles a line of 32 values: 1.4-1.6x the projections'
// rate at 1-32 rows, 1.2x at 64 (studies/engine_cpu/README.md, "GGUF codes
// under bf16").  With more rows the tiles' work grows and the decode, which
// bf16 values do not need, stops paying: past kDecodeRows rows the kernel
// multiplies the bf16 values, kept beside the codes.  Both ways give the
// same bits, so the choice by the rows' count keeps every row's result
// independent of the batch.
//
// Layout: one uint8 buffer shaped [N/16][K/32][bytes + 1024] that holds
// every block's codes (gemm_f32_codes.cpp's 384-byte Q4 or 576-byte Q8
// blocks, [N/16][K/32][bytes], the codes in weight_codes.to_bf16_layout's
// order), then the packed bf16 weight (pack_bf16's [N/16][K/2][16][2]): each
// path streams its own region.  (Each block's codes and values side by side
// made both paths slower than the bf16 weight alone: the core's prefetchers
// fetched the lines each skipped.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "silu_table.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {
namespace gemm_bf16_codes {

// gemm_f32_codes.cpp's blocks of 16 columns x 32 k.
constexpr int64_t kQ4Bytes = 384;
constexpr int64_t kQ8Bytes = 576;
// bf16 values of one block: 16 lines [pair of k][16 columns][2].
constexpr int64_t kBlockValues = 512;
constexpr int64_t kTileBytes = kBlockValues * 2;
// Up to this many rows of x (four tiles), the tiles multiply the codes, each
// block decoded once; beyond, the bf16 values.
#ifndef PREEMPT_SERVE_CODES_DECODE_ROWS
#define PREEMPT_SERVE_CODES_DECODE_ROWS 64
#endif
constexpr int64_t kDecodeRows = PREEMPT_SERVE_CODES_DECODE_ROWS;
// How far ahead of its decode a block's codes are prefetched: the hardware's
// streamer alone fed one core's decode at about half of its rate.
#ifndef PREEMPT_SERVE_CODES_PREFETCH
#define PREEMPT_SERVE_CODES_PREFETCH 8
#endif
constexpr int64_t kPrefetchBlocks = PREEMPT_SERVE_CODES_PREFETCH;
// Blocks decoded ahead of the one the tiles read (a tile load waits until
// the stores it reads have left the core's store buffer).
#ifndef PREEMPT_SERVE_CODES_AHEAD
#define PREEMPT_SERVE_CODES_AHEAD 1
#endif
constexpr int64_t kDecodeAhead = PREEMPT_SERVE_CODES_AHEAD;
constexpr int64_t kRing = kDecodeAhead + 1;

#ifdef __AVX512BF16__

// Lanes of a line's two halves (A: columns 0-7, B: columns 8-15): lane
// 2j + e holds column j's (or 8 + j's) value of k = 2 kp + e, so that
// VCVTNE2PS2BF16 of (B, A) is the line as the tiles read it.
alignas(64) constexpr int32_t kLanesA[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
alignas(64) constexpr int32_t kLanesB[16] = {8,  8,  9,  9,  10, 10, 11, 11,
                                             12, 12, 13, 13, 14, 14, 15, 15};

// One block into `out` (kBlockValues bf16, the packed layout's 16 lines),
// from weight_codes.to_bf16_layout's codes: per line, Q4 16 bytes, byte i
// lane i of A in its low nibble and of B in its high one; Q8 32 bytes,
// A's 16 lanes then B's.  Eight vector instructions a line.
template <bool Q4>
inline void decode_block(const uint8_t* blk, uint16_t* out) {
  const float* s = reinterpret_cast<const float*>(blk);
  const __m512i la = _mm512_load_si512(kLanesA), lb = _mm512_load_si512(kLanesB);
  const __m512 d = _mm512_loadu_ps(s);
  const __m512 da = _mm512_permutexvar_ps(la, d), db = _mm512_permutexvar_ps(lb, d);
  const __m512 mn = Q4 ? _mm512_loadu_ps(s + 16) : _mm512_setzero_ps();
  const __m512 ma = _mm512_permutexvar_ps(la, mn), mb = _mm512_permutexvar_ps(lb, mn);
  const uint8_t* codes = blk + (Q4 ? 128 : 64);
  for (int64_t kp = 0; kp < 16; ++kp) {
    __m512 wa, wb;
    if constexpr (Q4) {
      const __m512i q = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + kp * 16)));
      const __m512i qa = _mm512_and_si512(q, _mm512_set1_epi32(15));
      const __m512i qb = _mm512_srli_epi32(q, 4);
      wa = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qa), da, ma);
      wb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qb), db, mb);
    } else {
      const auto* c = reinterpret_cast<const __m128i*>(codes + kp * 32);
      wa = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c))), da);
      wb = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c + 1))), db);
    }
    _mm512_storeu_si512(out + kp * 32, (__m512i)_mm512_cvtne2ps_pbh(wb, wa));
  }
}

#ifdef GEMM_BF16_AMX
namespace amx = preempt_serve_gemm_amx;

// C (tiles 0..MT-1, MT <= 4) = the MT row tiles of `rt` times one panel's
// codes (`kblocks` blocks from `panel`), each block decoded into a ring of L1
// line buffers kDecodeAhead steps before the tiles read it, so that the
// vector units decode while the tiles multiply.  `acc` receives C as
// [MT * 16][16] float32.  Each C tile sums its products over K in order from
// zero, one TDPBF16PS a step: gemm_bf16_amx.h's sums, bit for bit.
template <int MT, bool Q4>
void codes_block(const amx::RowTile* rt, const uint8_t* panel, int64_t kblocks, int64_t bytes,
                 float* acc) {
  alignas(64) uint16_t lines[kRing][kBlockValues];
  _tile_zero(0);
  if constexpr (MT > 1) _tile_zero(1);
  if constexpr (MT > 2) _tile_zero(2);
  if constexpr (MT > 3) _tile_zero(3);
  for (int64_t s = 0; s < std::min(kDecodeAhead, kblocks); ++s)
    decode_block<Q4>(panel + s * bytes, lines[s % kRing]);
  for (int64_t s = 0; s < kblocks; ++s) {
    const int64_t next = s + kDecodeAhead;
    if (next < kblocks) {
      // The codes kPrefetchBlocks beyond it (into the next panel's, which
      // follow; past the codes' end, the values' first lines, unused).
      const uintptr_t ahead =
          reinterpret_cast<uintptr_t>(panel) + (next + kPrefetchBlocks) * bytes;
      for (int64_t l = 0; l < bytes; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + l), _MM_HINT_T0);
      decode_block<Q4>(panel + next * bytes, lines[next % kRing]);
    }
    // B in 6 and 7 by turns, A in 4 and 5 (tile registers are not renamed: a
    // register is loaded again once the products that read it are issued).
    const uint16_t* b = lines[s % kRing];
#define PREEMPT_SERVE_CODES_STEP(B)                 \
  _tile_loadd(B, b, 64);                            \
  _tile_loadd(4, rt[0].p + s * 32, rt[0].stride);   \
  _tile_dpbf16ps(0, 4, B);                          \
  if constexpr (MT > 1) {                           \
    _tile_loadd(5, rt[1].p + s * 32, rt[1].stride); \
    _tile_dpbf16ps(1, 5, B);                        \
  }                                                 \
  if constexpr (MT > 2) {                           \
    _tile_loadd(4, rt[2].p + s * 32, rt[2].stride); \
    _tile_dpbf16ps(2, 4, B);                        \
  }                                                 \
  if constexpr (MT > 3) {                           \
    _tile_loadd(5, rt[3].p + s * 32, rt[3].stride); \
    _tile_dpbf16ps(3, 5, B);                        \
  }
    if (s & 1) {
      PREEMPT_SERVE_CODES_STEP(7)
    } else {
      PREEMPT_SERVE_CODES_STEP(6)
    }
#undef PREEMPT_SERVE_CODES_STEP
  }
  _tile_stored(0, acc, 64);
  if constexpr (MT > 1) _tile_stored(1, acc + 256, 64);
  if constexpr (MT > 2) _tile_stored(2, acc + 512, 64);
  if constexpr (MT > 3) _tile_stored(3, acc + 768, 64);
}

// y [m, n] = x [m, k] W^T (+ bias) on the tiles from W's codes, m <= 64:
// threads split the panels, each decoded once.
template <bool Q4>
void gemm_codes(const uint16_t* x, int64_t lda, int64_t m, const uint8_t* codes,
                int64_t kblocks, int64_t bytes, int64_t vectors, const float* bias, uint16_t* y) {
  const int64_t k = kblocks * 32, n = vectors * 16;
  const int mt = static_cast<int>((m + 15) / 16);
  std::vector<uint16_t> pad;
  const std::vector<amx::RowTile> rts = amx::row_tiles(x, lda, m, k, pad);
  at::parallel_for(0, vectors, 1, [&](int64_t v0, int64_t v1) {
    amx::configure();
    alignas(64) float acc[4 * 256];
    for (int64_t v = v0; v < v1; ++v) {
      const uint8_t* panel = codes + v * kblocks * bytes;
      switch (mt) {
        case 1: codes_block<1, Q4>(rts.data(), panel, kblocks, bytes, acc); break;
        case 2: codes_block<2, Q4>(rts.data(), panel, kblocks, bytes, acc); break;
        case 3: codes_block<3, Q4>(rts.data(), panel, kblocks, bytes, acc); break;
        default: codes_block<4, Q4>(rts.data(), panel, kblocks, bytes, acc); break;
      }
      amx::store(acc, mt, 1, rts.data(), 0, v, bias, y, n);
    }
    _tile_release();
  });
}
#endif  // GEMM_BF16_AMX

#endif  // __AVX512BF16__

// pack_bf16's weight in `w`'s buffer (header, "Layout").
const uint16_t* values(const at::Tensor& w, int64_t bytes) {
  return reinterpret_cast<const uint16_t*>(w.data_ptr<uint8_t>() + w.size(0) * w.size(1) * bytes);
}

// The codes' bytes of a block of `w` (a weight from pack_bf16_codes).
int64_t code_bytes(const char* op, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  (w.size(2) == kQ4Bytes + kTileBytes || w.size(2) == kQ8Bytes + kTileBytes),
              op, ": the weight must come from pack_bf16_codes");
  TORCH_CHECK(bf16_gemm_built(), op, ": this build has no AVX512-BF16 path");
  return w.size(2) - kTileBytes;
}

// The buffer (header, "Layout") from the codes [N/16][K/32][bytes] (in
// weight_codes.to_bf16_layout's order) and pack_bf16's weight of them.
at::Tensor pack_bf16_codes(const at::Tensor& codes, const at::Tensor& packed) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte &&
                  (codes.size(2) == kQ4Bytes || codes.size(2) == kQ8Bytes),
              "pack_bf16_codes: codes [N/16, K/32, 384 or 576] uint8");
  const int64_t panels = codes.size(0), kblocks = codes.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(0) == panels && packed.size(1) == kblocks * 16 &&
                  packed.size(2) == 16 && packed.size(3) == 2,
              "pack_bf16_codes: the values must be pack_bf16's weight of the codes' shape");
  return at::cat({codes.reshape({-1}), packed.contiguous().view(at::kByte).reshape({-1})})
      .view({panels, kblocks, codes.size(2) + kTileBytes});
}

// The bf16 weight [N, K] that `w`'s codes decode to (pack's check, tests).
at::Tensor unpack_bf16_codes(const at::Tensor& w) {
  const int64_t bytes = code_bytes("unpack_bf16_codes", w);
  const int64_t panels = w.size(0), kblocks = w.size(1);
  at::Tensor out = at::empty({panels, kblocks * 16, 16, 2}, w.options().dtype(at::kBFloat16));
#ifdef __AVX512BF16__
  const uint8_t* wp = w.data_ptr<uint8_t>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, panels * kblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (bytes == kQ4Bytes) decode_block<true>(wp + b * bytes, op + b * kBlockValues);
      else decode_block<false>(wp + b * bytes, op + b * kBlockValues);
    }
  });
#else
  (void)bytes;
#endif
  return out.permute({0, 2, 1, 3}).reshape({panels * 16, kblocks * 32});
}

at::Tensor linear_bf16_codes(const at::Tensor& x, const at::Tensor& w,
                             const std::optional<at::Tensor>& bias) {
  const int64_t bytes = code_bytes("linear_bf16_codes", w);
  const int64_t vectors = w.size(0), kblocks = w.size(1), k = kblocks * 32;
  const Operands o = operands("linear_bf16_codes", x, vectors * 16, k, bias);
  if (o.m == 0) return o.y;
#ifdef GEMM_BF16_AMX
  if (amx::usable(k)) {
    if (o.m <= kDecodeRows) {
      (bytes == kQ4Bytes ? gemm_codes<true> : gemm_codes<false>)(
          o.xp(), o.lda, o.m, w.data_ptr<uint8_t>(), kblocks, bytes, vectors, o.bias_ptr(),
          o.yp());
      return o.y;
    }
  }
#endif
  // The values, on the tiles or (where they are off) on VDPBF16PS.
  multiply(o, values(w, bytes), k, vectors);
  return o.y;
}

// SwiGLU on the gate_up projection (decode_layer.cpp): silu(g) * u of
// [g | u] = x W^T (+ bias), bit for bit linear_bf16_codes then silu_mul.
// Past kDecodeRows rows, where the values multiply on the tiles and K suits
// (gemm_bf16_amx.h, swiglu_fits), in one pass that never stores the
// projection's output (gemm_swiglu); else the two operators.  Either way
// by the rows' count and the shapes alone, and with the same bits.
at::Tensor linear_bf16_codes_silu_mul(const at::Tensor& x, const at::Tensor& w,
                                      const std::optional<at::Tensor>& bias) {
  static const auto silu_mul = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("preempt_serve::silu_mul", "")
                                   .typed<at::Tensor(const at::Tensor&)>();
  const int64_t bytes = code_bytes("linear_bf16_codes_silu_mul", w);
  const int64_t vectors = w.size(0), k = w.size(1) * 32;
#if defined(GEMM_BF16_AMX) && defined(PREEMPT_SERVE_VEC16)
  if (x.dim() == 2 && x.size(0) > kDecodeRows && amx::swiglu_fits(k, vectors)) {
    const Operands o =
        operands("linear_bf16_codes_silu_mul", x, vectors * 16, k, bias, vectors * 8);
    amx::gemm_swiglu(o.xp(), o.lda, o.m, values(w, bytes), k, vectors, o.bias_ptr(),
                     preempt_serve_silu::bf16_silu_table(), o.yp());
    return o.y;
  }
#else
  (void)bytes, (void)vectors, (void)k;
#endif
  return silu_mul.call(linear_bf16_codes(x, w, bias));
}

// Whether linear_bf16_codes_silu_mul may take the fused pass from now on;
// returns whether this build has it.
bool set_swiglu_fused(bool enable) {
#if defined(GEMM_BF16_AMX) && defined(PREEMPT_SERVE_VEC16)
  amx::swiglu_switch().store(enable);
  return true;
#else
  (void)enable;
  return false;
#endif
}

}  // namespace gemm_bf16_codes
}  // namespace

TORCH_LIBRARY_FRAGMENT(preempt_serve, m) {
  m.def("pack_bf16_codes(Tensor codes, Tensor packed) -> Tensor");
  m.def("unpack_bf16_codes(Tensor w) -> Tensor");
  m.def("linear_bf16_codes(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("linear_bf16_codes_silu_mul(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("set_swiglu_fused(bool enable) -> bool", &gemm_bf16_codes::set_swiglu_fused);
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) {
  m.impl("pack_bf16_codes", &gemm_bf16_codes::pack_bf16_codes);
  m.impl("unpack_bf16_codes", &gemm_bf16_codes::unpack_bf16_codes);
  m.impl("linear_bf16_codes", &gemm_bf16_codes::linear_bf16_codes);
  m.impl("linear_bf16_codes_silu_mul", &gemm_bf16_codes::linear_bf16_codes_silu_mul);
}
