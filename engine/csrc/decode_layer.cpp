// One decoder layer of a Llama-shaped model over a decode-only step, as one
// operator: the QKV projection, the rotation of q and k, the K/V write, the
// paged decode attention, the output projection and its residual sum with
// the next norm, the SwiGLU MLP and its residual sum with the norm after it.
// `decode_layer_bf16` on our packed bfloat16 projections, `decode_layer_f32`
// on our packed float32 ones (each projection on its GGUF codes or on its
// values, as the op-by-op layer dispatches it: engine/models/prepacked.py).
//
// Why: each of those is already one operator of ours, and Python's glue
// between them (ten dispatches from Python a layer, the interpreter's frames,
// splits and views) cost about 2 ms of a 26 ms batch-32 SmolLM2 step on one
// core (studies/engine_cpu/README.md, "One operator a decoder layer").  Here
// the same operators run in the same order on the same inputs, called
// through the dispatcher from C++: the same bits as the layer in
// engine/models/llama.py, which keeps that path for everything else
// (prefill chunks, LoRA, tensor parallelism, other dtypes and builds).

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
// gate_up, down.
// step: slots, block_ids, table_starts, context_lens, positions (the decode
// operator's metadata, the K/V write's slots, the rotation's positions).
// Returns (x + the layer's output, its norm by `next_norm`), or (x + output)
// twice for the last layer, which has none.
template <bool f32>
TensorPair decode_layer(const at::Tensor& x, const at::Tensor& h, at::TensorList weights,
                        const c10::List<std::optional<at::Tensor>>& biases,
                        const std::optional<at::Tensor>& next_norm,
                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                        at::TensorList step, const at::Tensor& cos_table,
                        const at::Tensor& sin_table, int64_t num_heads, int64_t num_kv_heads,
                        double eps, double scale, bool tiles) {
  const char* name = f32 ? "decode_layer_f32" : "decode_layer_bf16";
  TORCH_CHECK(weights.size() == 5 && biases.size() == 4 && step.size() == 5,
              name, ": 5 weights, 4 biases, 5 step tensors");
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
  const auto [qr, kr] = ops.rotary.call(q, k, cos_table, sin_table, step[4]);
  if (tiles) {
    ops.write_tiles.call(kr.contiguous(), v.contiguous(), key_cache, value_cache, step[0]);
  } else {
    ops.write.call(kr, v, key_cache, value_cache, step[0]);
  }
  const auto& decode = tiles ? ops.decode_tiles : ops.decode;
  const at::Tensor a = decode.call(qr, key_cache, value_cache, step[1], step[2], step[3], scale);
  const at::Tensor o = project(ops, f32, a.view({t, q_size}), weights[1], biases.get(1));
  const auto [x1, h1] = add_norm.call(x, o, weights[2], eps);
  const at::Tensor gate_up = project(ops, f32, h1, weights[3], biases.get(2));
  const at::Tensor d = project(ops, f32, ops.silu_mul.call(gate_up), weights[4], biases.get(3));
  if (next_norm.has_value()) return add_norm.call(x1, d, *next_norm, eps);
  at::Tensor out = x1 + d;
  return {out, out};
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
}

TORCH_LIBRARY_IMPL(preempt_serve, CPU, m) {
  m.impl("decode_layer_bf16", &decode_layer<false>);
  m.impl("decode_layer_f32", &decode_layer<true>);
}
