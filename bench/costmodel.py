"""Cost models: how long one iteration (and one KV swap) takes.

The simulator (bench/simulator.py) asks a cost model for the duration of
each `Plan` the scheduler emits.  Two models:

1. `AnalyticCostModel` -- OPT-13B / 66B / 175B (FastServe Table 1 shapes)
   and Llama-2-7B (ConServe's model) on NVIDIA A100s, a per-layer
   roofline.  Assumptions:

   - FP16 weights and KV cache (FastServe §6.1), OPT layer = QKV, output
     projection, two FFN matrices (4h): 12·h² weights and 13·h biases per
     layer; vocabulary 50272, 2048 positions.  OPT-13B comes out at 12.9 B
     parameters (25.7 GB), 66B at 65.7 B, 175B at 174.6 B.  Llama-2-7B:
     a gated MLP of width 11,008 (three matrices), rotary positions, an
     untied LM head and vocabulary 32,000: 6.74 B parameters.
   - Per GPU and per layer, each operator group costs
     max(FLOPs / (peak · compute_eff), bytes / (HBM · memory_eff)):
       * the linear layers: 2·W·T/tp FLOPs for T batched tokens and W
         matmul weights per layer (12h² for OPT), reading
         the layer's weights once per iteration (all jobs of the batch share
         one read) plus activations (16h values per token);
       * attention: 4·h/tp FLOPs per (query, key) pair -- a decode token
         attends to its whole context, a prefill chunk of c tokens at offset
         s to c·s + c(c+1)/2 pairs -- reading each sequence's KV once per
         iteration (2·h/tp values per context token) and writing the new
         tokens' KV.
     The groups are summed over the layers of a pipeline stage.
   - A100: 312 TFLOP/s dense FP16 peak; HBM 2.0 TB/s (80 GB) or 1.555 TB/s
     (40 GB, FastServe's testbed); compute_eff 0.6 and memory_eff 0.8 by
     default (what tuned GEMM and decode-attention kernels reach).
   - Tensor parallelism (Megatron): FLOPs and bytes split tp ways; two
     ring all-reduces of T·h FP16 values per layer over NVLink
     (300 GB/s per direction per GPU, 10 µs latency each):
     2·(tp-1)/tp · bytes / bw + latency.
   - Pipeline parallelism: layers split evenly over pp stages; one batch in
     flight, so an iteration takes the sum of the stages plus (pp-1)
     activation sends (T·h FP16 values; NVLink inside an 8-GPU node, 400
     Gb/s EFA = 50 GB/s between nodes).  Several micro-batches in flight
     (FastServe §5) would raise throughput but need a scheduler core with
     more than one plan outstanding; until then PP costs latency like a
     deeper model.
   - LM head: logits only for sampled rows (2·h·V FLOPs each), reading the
     embedding matrix once, on the last stage.  A fixed 1 ms per
     iteration covers sampling, kernel launches and scheduling.
   - Swapping: a block holds block_size tokens × 2 (K, V) × layers/pp ×
     h/tp FP16 values per GPU; each GPU copies its share over its own PCIe
     4.0 ×16 link at 25 GB/s, plus 10 µs per swap operation batch.
   - KV capacity (number of blocks): 90% of GPU memory (vLLM's
     gpu_memory_utilization) minus the weights' share and 1 GiB of
     activations, divided by the block's bytes per GPU.
   Presets follow FastServe Figure 11: OPT-13B on 1 GPU, OPT-66B on 4
   (tp 4), OPT-175B on 16 (tp 8 × pp 2); Llama-2-7B on 1 (ConServe §6.1).

2. `TableCostModel` (bench/costtable.py) -- fitted to our engine's measurements by the profiler
   (bench/profiler.py): decode time interpolated in the measured (batch
   size, context) grid, prefill work (tokens, attention pairs, chunks) a
   non-negative linear fit on top, and swap time linear in blocks.  It is
   what the live-vs-simulated validation uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from scheduler.plan import BlockOpKind, Plan

if TYPE_CHECKING:
    from bench.costtable import TableCostModel

GiB = 1 << 30


# ---------------------------------------------------------------- batch shape


@dataclass(slots=True)
class BatchShape:
    """What a cost model needs to know about one iteration's plan."""

    prefill_tokens: int = 0  # tokens of chunks longer than one token
    prefill_chunks: int = 0
    # Σ over prefill tokens of the context each attends to (causal pairs).
    prefill_attn: int = 0
    # KV tokens prefill chunks read (their context incl. the new tokens).
    prefill_kv: int = 0
    decode_tokens: int = 0  # one-token chunks: the decode batch size
    decode_context: int = 0  # Σ context length of the decode chunks
    num_sampled: int = 0  # chunks that sample a token (LM head rows)
    swap_blocks: int = 0  # blocks copied between device and host

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @classmethod
    def of(cls, plan: Plan) -> "BatchShape":
        s = cls.of_spans([(c.start_pos, len(c.token_ids)) for c in plan.chunks])
        s.num_sampled = sum(c.sample for c in plan.chunks)
        for op in plan.block_ops:
            if op.kind is not BlockOpKind.DROP:
                s.swap_blocks += op.num_blocks
        return s

    @classmethod
    def of_spans(cls, spans: "Iterable[tuple[int, int]]") -> "BatchShape":
        """From each chunk's (start position, number of tokens)."""
        s = cls()
        for start, n in spans:
            ctx = start + n
            if n == 1:
                s.decode_tokens += 1
                s.decode_context += ctx
            else:
                s.prefill_tokens += n
                s.prefill_chunks += 1
                s.prefill_attn += n * start + n * (n + 1) // 2
                s.prefill_kv += ctx
        return s

    def features(self) -> list[float]:
        """Regressors of the table model, in `TABLE_FEATURES` order."""
        return [
            1.0,
            float(self.prefill_tokens),
            float(self.prefill_attn),
            float(self.prefill_chunks),
            float(self.decode_tokens),
            float(self.decode_context),
        ]


TABLE_FEATURES = (
    "const",
    "prefill_tokens",
    "prefill_attn",
    "prefill_chunks",
    "decode_tokens",
    "decode_context",
)


class CostModel(Protocol):
    name: str

    def iteration_time(self, shape: BatchShape) -> float:
        """Seconds of the forward pass of one iteration (no swaps)."""
        ...

    def swap_time(self, num_blocks: int) -> float:
        """Seconds to copy `num_blocks` KV blocks over PCIe."""
        ...

    def describe(self) -> dict[str, Any]: ...


# ------------------------------------------------------------- analytic model


class ModelShape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    num_layers: int
    num_heads: int
    hidden: int
    vocab: int = 50272
    # Learned position embeddings (OPT); 0 for rotary ones (Llama).
    max_positions: int = 2048
    dtype_bytes: int = 2
    # MLP width (None: 4 x hidden, OPT) and whether it is gated (SwiGLU:
    # three matrices instead of two, Llama).
    ffn_hidden: int | None = None
    gated_ffn: bool = False
    # The LM head shares the embedding's weights (OPT) or has its own (Llama).
    tied_head: bool = True

    @property
    def linear_params_per_layer(self) -> int:
        """Weights of one layer's matmuls: QKV and output (4h²) and the MLP."""
        h = self.hidden
        f = self.ffn_hidden or 4 * h
        return 4 * h * h + (3 if self.gated_ffn else 2) * h * f

    @property
    def params_per_layer(self) -> int:
        return self.linear_params_per_layer + 13 * self.hidden

    @property
    def num_params(self) -> int:
        h = self.hidden
        embeddings = self.vocab * (1 if self.tied_head else 2) + self.max_positions
        return self.num_layers * self.params_per_layer + embeddings * h + 2 * h

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers (whole model)."""
        return 2 * self.num_layers * self.hidden * self.dtype_bytes


MODELS: dict[str, ModelShape] = {
    # FastServe Table 1.
    "opt-13b": ModelShape(name="OPT-13B", num_layers=40, num_heads=40, hidden=5120),
    "opt-66b": ModelShape(name="OPT-66B", num_layers=64, num_heads=72, hidden=9216),
    "opt-175b": ModelShape(name="OPT-175B", num_layers=96, num_heads=96, hidden=12288),
    # ConServe's evaluation model (§6.1): 6.74 B parameters, multi-head
    # attention (its KV per token is 2 x 32 x 4,096 x 2 bytes, 0.5 MiB).
    "llama-2-7b": ModelShape(name="Llama-2-7B", num_layers=32, num_heads=32, hidden=4096,
                             vocab=32000, max_positions=0, ffn_hidden=11008,
                             gated_ffn=True, tied_head=False),
}


class GPUSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    memory_bytes: int
    fp16_flops: float = 312e12
    hbm_bandwidth: float = 2.0e12
    # Per GPU and direction, what a ring all-reduce sees.
    nvlink_bandwidth: float = 300e9
    pcie_bandwidth: float = 25e9
    gpus_per_node: int = 8
    internode_bandwidth: float = 50e9  # 400 Gb/s EFA (p4d)


GPUS: dict[str, GPUSpec] = {
    "a100-80gb": GPUSpec(name="A100-80GB", memory_bytes=80 * GiB, hbm_bandwidth=2.0e12),
    "a100-40gb": GPUSpec(name="A100-40GB", memory_bytes=40 * GiB, hbm_bandwidth=1.555e12),
}

# FastServe Figure 11: GPUs per model -> (tp, pp).
PRESET_PARALLELISM: dict[str, tuple[int, int]] = {
    "opt-13b": (1, 1),
    "opt-66b": (4, 1),
    "opt-175b": (8, 2),
    "llama-2-7b": (1, 1),
}


class AnalyticCostModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["analytic"] = "analytic"
    model: ModelShape
    gpu: GPUSpec
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    compute_efficiency: float = Field(0.6, gt=0, le=1)
    memory_efficiency: float = Field(0.8, gt=0, le=1)
    allreduce_latency: float = 10e-6
    iteration_overhead: float = 1e-3
    swap_op_latency: float = 10e-6
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    activation_reserve_bytes: int = GiB
    block_size: int = Field(16, ge=1)

    @property
    def name(self) -> str:
        return f"{self.model.name}/{self.gpu.name}/tp{self.tp}pp{self.pp}"

    @classmethod
    def preset(cls, model: str, gpu: str = "a100-80gb", **kw: Any) -> "AnalyticCostModel":
        tp, pp = PRESET_PARALLELISM[model]
        kw.setdefault("tp", tp)
        kw.setdefault("pp", pp)
        return cls(model=MODELS[model], gpu=GPUS[gpu], **kw)

    # Capacity -------------------------------------------------------

    def block_bytes_per_gpu(self, block_size: int | None = None) -> float:
        m = self.model
        return (block_size or self.block_size) * 2 * (m.num_layers / self.pp) * (m.hidden / self.tp) * m.dtype_bytes

    def num_kv_blocks(self, block_size: int | None = None) -> int:
        free = (
            self.gpu.memory_bytes * self.gpu_memory_utilization
            - self.model.weight_bytes / (self.tp * self.pp)
            - self.activation_reserve_bytes
        )
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit on {self.tp * self.pp} x {self.gpu.name}")
        return int(free // self.block_bytes_per_gpu(block_size))

    # Time -----------------------------------------------------------

    def _roofline(self, flops: float, nbytes: float) -> float:
        return max(
            flops / (self.gpu.fp16_flops * self.compute_efficiency),
            nbytes / (self.gpu.hbm_bandwidth * self.memory_efficiency),
        )

    def layer_time(self, shape: BatchShape) -> float:
        m, tp = self.model, self.tp
        h, b = m.hidden, m.dtype_bytes
        T = shape.num_tokens
        lin = self._roofline(
            2.0 * m.linear_params_per_layer * T / tp,
            b * (m.params_per_layer + 16 * h * T) / tp,
        )
        pairs = shape.prefill_attn + shape.decode_context
        kv_read = shape.prefill_kv + shape.decode_context
        attn = self._roofline(4.0 * h * pairs / tp, b * 2 * h * (kv_read + T) / tp)
        comm = 0.0
        if tp > 1:
            nbytes = b * T * h
            comm = 2 * (self.allreduce_latency + 2 * (tp - 1) / tp * nbytes / self.gpu.nvlink_bandwidth)
        return lin + attn + comm

    def iteration_time(self, shape: BatchShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        m = self.model
        t = m.num_layers * self.layer_time(shape)  # pp stages run one after another
        head = self._roofline(
            2.0 * m.hidden * m.vocab * shape.num_sampled / self.tp,
            m.dtype_bytes * m.hidden * m.vocab / self.tp,
        )
        hop = 0.0
        if self.pp > 1:
            bw = (
                self.gpu.nvlink_bandwidth
                if self.tp * self.pp <= self.gpu.gpus_per_node
                else self.gpu.internode_bandwidth
            )
            hop = (self.pp - 1) * (m.dtype_bytes * shape.num_tokens * m.hidden / bw + 10e-6)
        return t + head + hop + self.iteration_overhead

    def swap_time(self, num_blocks: int) -> float:
        if num_blocks <= 0:
            return 0.0
        return self.swap_op_latency + num_blocks * self.block_bytes_per_gpu() / self.gpu.pcie_bandwidth

    def describe(self) -> dict[str, Any]:
        d = self.model_dump()
        d["name"] = self.name
        d["num_params"] = self.model.num_params
        return d


def make_cost_model(
    spec: str,
    gpu: str = "a100-80gb",
    **overrides: Any,
) -> AnalyticCostModel | TableCostModel:
    """A preset of `MODELS` (`opt-13b`, `llama-2-7b`, …), or the path of a
    cost table JSON."""
    if spec in MODELS:
        return AnalyticCostModel.preset(spec, gpu, **overrides)
    path = Path(spec)
    if path.is_file():
        from bench.costtable import TableCostModel

        return TableCostModel.load(path, **overrides)
    raise ValueError(
        f"cost model {spec!r} is neither one of {sorted(MODELS)} nor a cost table file"
    )
