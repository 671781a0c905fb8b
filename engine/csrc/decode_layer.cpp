// One decoder layer of a Llama-shaped model as one operator: the QKV
// projection, the rotation of q and k, the K/V write, the paged attention,
// the output projection and its residual sum with the next norm, the SwiGLU
// MLP and its residual sum with the norm after it.  `decode_layer_*` over a
// step of decodes only (the decode operator answers every row);
// `prefill_layer_*` over a step with prompt chunks (the prefill operator
// answers them, the decode operator the decodes beside them, as
// engine/attention_cpp.py's `_attend` splits the rows).  `*_bf16` on our
// packed bfloat16 projections, `*_f32` on our packed float32 ones (each
// projection on its GGUF codes or on its values, as the op-by-op layer
// dispatches it: engine/models/prepacked.py).
//
// Why: each of those is already one operator of ours, and Python's glue
// between them (ten dispatches from Python a layer, the interpreter's frames,
// splits and views) cost about 2 ms of a 26 ms batch-32 SmolLM2 step on one
// core (studies/engine_cpu/README.md, "One operator a decoder layer"), and
// as much of a short prompt's prefill.  Here the same operators run in the
// same order on the same inputs, called through the dispatcher from C++: the
// same bits as the layer in engine/models/llama.py, which keeps that path
// for everything else (LoRA, tensor parallelism, other dtypes and builds,
// prompts on the reference attention).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

namespace {

using TensorPair = std::tuple<at::Tensor, at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> layer_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using LinearSig = at::Tensor(const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&);
using AddNormSig = TensorPair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);

// The operators a layer calls, looked up once.
struct LayerOps {
  c10::TypedOperatorHandle<LinearSig> linear = layer_op<LinearSig>("preempt_serve::linear_bf16");
  c10::TypedOperatorHandle<LinearSig> linear_codes =
      layer_op<LinearSig>("preempt_serve::linear_bf16_codes");
  c10::TypedOperatorHandle<LinearSig> swiglu_codes =
      layer_op<LinearSig>("preempt_serve::linear_bf16_codes_silu_mul");
  c10::TypedOperatorHandle<LinearSig> linear_f32 =
      layer_op<LinearSig>("preempt_serve::linear_f32");
  c10::TypedOperatorHandle<LinearSig> linear_f32_codes =
      layer_op<LinearSig>("preempt_serve::linear_f32_codes");
  c10::TypedOperatorHandle<TensorPair(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&)>
      rotary = layer_op<TensorPair(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&)>(
          "preempt_serve::rotary_qk");
  using WriteSig = void(const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor,
                        const at::Tensor&);
  c10::TypedOperatorHandle<WriteSig> write = layer_op<WriteSig>("preempt_serve::write_kv");
  c10::TypedOperatorHandle<WriteSig> write_tiles =
      layer_op<WriteSig>("preempt_serve::write_kv_tiles");
  using DecodeSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
  c10::TypedOperatorHandle<DecodeSig> decode =
      layer_op<DecodeSig>("preempt_serve::paged_decode");
  c10::TypedOperatorHandle<DecodeSig> decode_tiles =
      layer_op<DecodeSig>("preempt_serve::paged_decode_tiles");
  using PrefillSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, double, bool);
  c10::TypedOperatorHandle<PrefillSig> prefill =
      layer_op<PrefillSig>("preempt_serve::paged_prefill");
  c10::TypedOperatorHandle<AddNormSig> add_norm =
      layer_op<AddNormSig>("preempt_serve::add_rms_norm_bf16");
  c10::TypedOperatorHandle<AddNormSig> add_norm_f32 =
      layer_op<AddNormSig>("preempt_serve::add_rms_norm_f32");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul =
      layer_op<at::Tensor(const at::Tensor&)>("preempt_serve::silu_mul");
};

const LayerOps& layer_ops() {
  static const LayerOps ops;
  return ops;
}

// A projection as the op-by-op layer's linear takes it: bfloat16 or float32
// weights packed as their codes (uint8) or as their values.
at::Tensor project(const LayerOps& ops, bool f32, const at::Tensor& x, const at::Tensor& w,
                   const std::optional<at::Tensor>& b) {
  const bool codes = w.scalar_type() == at::kByte;
  if (!f32) return (codes ? ops.linear_codes : ops.linear).call(x, w, b);
  return (codes ? ops.linear_f32_codes : ops.linear_f32).call(x, w, b);
}

// x: the residual stream [T, D]; h: its norm by this layer's input norm.
// weights: qkv, o, post_norm, gate_up, down (the projections packed by
// pack_bf16 or pack_f32, or as codes by pack_f32_codes); biases: qkv, o,
// gate_up, down.  slots: where the step's K/V go; positions: each row's, for
// the rotation.  attend(q rotated [T, heads, dim]) -> [T, heads, dim], the
// K/V of the step already in the cache.
// Returns (x + the layer's output, its norm by `next_norm`), or (x + output)
// twice for the last layer, which has none.
template <bool f32, typename Attend>
TensorPair layer(const char* name, const at::Tensor& x, const at::Tensor& h,
                 at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                 const std::optional<at::Tensor>& next_norm, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const at::Tensor& slots,
                 const at::Tensor& positions, const at::Tensor& cos_table,
                 const at::Tensor& sin_table, int64_t num_heads, int64_t num_kv_heads,
                 double eps, bool tiles, const Attend& attend) {
  TORCH_CHECK(weights.size() == 5 && biases.size() == 4, name, ": 5 weights, 4 biases");
  TORCH_CHECK(x.dim() == 2 && h.sizes() == x.sizes(), name, ": x and h [T, D]");
  TORCH_CHECK(x.scalar_type() == (f32 ? at::kFloat : at::kBFloat16), name,
              ": x of the wrong dtype");
  const LayerOps& ops = layer_ops();
  const auto& add_norm = f32 ? ops.add_norm_f32 : ops.add_norm;
  const int64_t t = x.size(0), dim = cos_table.size(1);
  const int64_t q_size = num_heads * dim, kv_size = num_kv_heads * dim;
  const at::Tensor qkv = project(ops, f32, h, weights[0], biases.get(0));
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size,
              name, ": the QKV projection has ", qkv.size(1), " columns, not ",
              q_size + 2 * kv_size);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({t, num_heads, dim});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, num_kv_heads, dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, dim});
  const auto [qr, kr] = ops.rotary.call(q, k, cos_table, sin_table, positions);
  if (tiles) {
    ops.write_tiles.call(kr.contiguous(), v.contiguous(), key_cache, value_cache, slots);
  } else {
    ops.write.call(kr, v, key_cache, value_cache, slots);
  }
  const at::Tensor a = attend(qr);
  const at::Tensor o = project(ops, f32, a.view({t, q_size}), weights[1], biases.get(1));
  const auto [x1, h1] = add_norm.call(x, o, weights[2], eps);
  // bf16 codes: the projection and silu(gate) * up as one operator, which
  // fuses them where it pays (gemm_bf16_codes.cpp), the same bits either way.
  const at::Tensor act =
      !f32 && weights[3].scalar_type() == at::kByte
          ? ops.swiglu_codes.call(h1, weights[3], biases.get(2))
          : ops.silu_mul.call(project(ops, f32, h1, weights[3], biases.get(2)));
  const at::Tensor d = project(ops, f32, act, weights[4], biases.get(3));
  if (next_norm.has_value()) return add_norm.call(x1, d, *next_norm, eps);
  at::Tensor out = x1 + d;
  return {out, out};
}

// step: slots, block_ids, table_starts, context_lens, positions (the decode
// operator's metadata, the K/V write's slots, the rotation's positions).
template <bool f32>
TensorPair decode_layer(const at::Tensor& x, const at::Tensor& h, at::TensorList weights,
                        const c10::List<std::optional<at::Tensor>>& biases,
                        const std::optional<at::Tensor>& next_norm,
                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                        at::TensorList step, const at::Tensor& cos_table,
                        const at::Tensor& sin_table, int64_t num_heads, int64_t num_kv_heads,
                        double eps, double scale, bool tiles) {
  const char* name = f32 ? "decode_layer_f32" : "decode_layer_bf16";
  TORCH_CHECK(step.size() == 5, name, ": 5 step tensors");
  const LayerOps& ops = layer_ops();
  const auto& decode = tiles ? ops.decode_tiles : ops.decode;
  return layer<f32>(name, x, h, weights, biases, next_norm, key_cache, value_cache, step[0],
                    step[4], cos_table, sin_table, num_heads, num_kv_heads, eps, tiles,
                    [&](const at::Tensor& q) {
                      return decode.call(q, key_cache, value_cache, step[1], step[2],
                                         step[3], scale);
                    });
}

// The prefill layer's step tensors, in order (None where the step has none).
enum PrefillStep {
  kSlots, kPrefillBlockIds, kPrefillTableStarts, kPrefillQueryStarts, kPrefillStartPositions,
  kDecodeBlockIds, kDecodeTableStarts, kDecodeContextLens, kPrefillRows, kDecodeRows,
  kPositions, kPrefillStepSize
};

// A step with prompt chunks: the first `num_decodes` rows are decodes and
// the rest the chunks' tokens; or, where `prefill_rows` is given
// (deterministic mode with prompt positions beside others), the rows each
// operator answers, gathered and put back.  As CppAttentionBackend._attend.
template <bool f32>
TensorPair prefill_layer(const at::Tensor& x, const at::Tensor& h, at::TensorList weights,
                         const c10::List<std::optional<at::Tensor>>& biases,
                         const std::optional<at::Tensor>& next_norm,
                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const c10::List<std::optional<at::Tensor>>& step,
                         const at::Tensor& cos_table, const at::Tensor& sin_table,
                         int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                         bool tiles, int64_t num_decodes) {
  const char* name = f32 ? "prefill_layer_f32" : "prefill_layer_bf16";
  TORCH_CHECK(step.size() == kPrefillStepSize, name, ": ", int(kPrefillStepSize),
              " step entries");
  const auto need = [&](int i) -> at::Tensor {
    const std::optional<at::Tensor> got = step.get(i);
    TORCH_CHECK(got.has_value(), name, ": step entry ", i, " is missing");
    return *got;
  };
  const at::Tensor slots = need(kSlots), positions = need(kPositions);
  const at::Tensor p_blocks = need(kPrefillBlockIds), p_tables = need(kPrefillTableStarts);
  const at::Tensor p_queries = need(kPrefillQueryStarts);
  const at::Tensor p_starts = need(kPrefillStartPositions);
  const bool rows = step.get(kPrefillRows).has_value();
  const bool decodes = num_decodes > 0 || rows;
  at::Tensor d_blocks, d_tables, d_lens;
  if (decodes) {
    d_blocks = need(kDecodeBlockIds);
    d_tables = need(kDecodeTableStarts);
    d_lens = need(kDecodeContextLens);
  }
  const at::Tensor p_rows = rows ? need(kPrefillRows) : at::Tensor();
  const at::Tensor d_rows = rows ? need(kDecodeRows) : at::Tensor();
  const LayerOps& ops = layer_ops();
  const auto& decode_op = tiles ? ops.decode_tiles : ops.decode;
  const auto prefill = [&](const at::Tensor& q) {
    return ops.prefill.call(q, key_cache, value_cache, p_blocks, p_tables, p_queries,
                            p_starts, scale, tiles);
  };
  const auto decode = [&](const at::Tensor& q) {
    return decode_op.call(q, key_cache, value_cache, d_blocks, d_tables, d_lens, scale);
  };
  return layer<f32>(
      name, x, h, weights, biases, next_norm, key_cache, value_cache, slots, positions,
      cos_table, sin_table, num_heads, num_kv_heads, eps, tiles,
      [&](const at::Tensor& q) -> at::Tensor {
        const int64_t t = q.size(0);
        TORCH_CHECK(num_decodes >= 0 && num_decodes <= t, name, ": ", num_decodes,
                    " decodes in a step of ", t, " rows");
        if (rows) {
          at::Tensor out = at::empty_like(q);
          out.index_copy_(0, p_rows, prefill(q.index_select(0, p_rows)));
          if (num_decodes > 0) out.index_copy_(0, d_rows, decode(q.index_select(0, d_rows)));
          return out;
        }
        if (num_decodes == 0) return prefill(q);
        at::Tensor out = at::empty_like(q);
        out.narrow(0, 0, num_decodes).copy_(decode(q.narrow(0, 0, num_decodes)));
        out.narrow(0, num_decodes, t - num_decodes)
            .copy_(prefill(q.narrow(0, num_decodes, t - num_decodes)));
        return out;
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preempt_serve, m) {
  for (const char* name : {"decode_layer_bf16", "decode_layer_f32"}) {
    m.def((std::string(name) +
           "(Tensor x, Tensor h, Tensor[] weights, Tensor?[] biases, "
           "Tensor? next_norm, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor[] step, "
           "Tensor cos_table, Tensor sin_table, int num_heads, int num_kv_heads, float eps, "
           "float scale, bool tiles) -> (Tensor, Tensor)")
              .c_str());
  }
  for (const char* name : {"prefill_layer_bf16", "prefill_layer_f32"}) {
    m.def((std::string(name) +
           "(Tensor x, Tensor h, Tensor[] weights, Tensor?[] biases, "
           "Tensor? next_norm, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor?[] step, "
           "Tensor cos_table, Tensor sin_table, int num_heads, int num_kv_heads, float eps, "
           "float scale, bool tiles, int num_decodes) -> (Tensor, Tensor)")
              .c_str());
  }
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) {
  m.impl("decode_layer_bf16", &decode_layer<false>);
  m.impl("decode_layer_f32", &decode_layer<true>);
  m.impl("prefill_layer_bf16", &prefill_layer<false>);
  m.impl("prefill_layer_f32", &prefill_layer<true>);
}
