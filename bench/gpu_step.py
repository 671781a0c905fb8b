"""GPU step benchmark: our engine's decode and prefill against the HBM and
matmul floors and against Hugging Face's SDPA forward, in one run.

On a random-weight Llama shape (default: Llama-3-8B, bf16; no weights are
downloaded) it measures, on the GPU it runs on:

- the two ceilings: device-to-device copy bandwidth (bytes read + written)
  and the bf16 matrix rate (8192³);
- decode attention alone (one layer's `forward`, KV store + attention) per
  backend, against its KV bytes at the copy bandwidth;
- a whole decode step of our model (metadata built on the host, forward,
  lm_head, greedy argmax and the one copy of the sampled ids to the host) at
  each batch size, per attention backend, against the HBM floor of the same
  step (weights read once, every sequence's KV read once), launched op by
  op and, for the triton backend, also replayed from the engine's captured
  CUDA graphs (`engine.cuda_graphs.DecodeGraphs`, as `ModelRunner` runs
  decode-only steps on CUDA);
- HF `LlamaForCausalLM` (SDPA attention, `DynamicCache`) decode steps of the
  same batches and contexts;
- prefill tokens/s of our model and of HF, against the matmul floor;
- with `triton-det` among the backends, the same in deterministic mode (the
  batch-invariant Triton GEMM and attention), op by op and from graphs:
  the price of batch invariance; `triton-det64` (any power of two) gives
  its attention query tiles of that many rows instead of
  `DETERMINISTIC_ROWS` (`engine/attention_triton.py`).

Our side is driven at the model level (`engine.models` + attention backend
+ `KVCache`), without the `ModelRunner`'s request bookkeeping, so that the
script needs neither a checkpoint nor a tokenizer.

    python -m bench.gpu_step --out /tmp/gpu_step.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.attention import SeqSpan, get_attention_backend
from engine.kv_cache import KVCache
from engine.models import ForwardBatch, model_class

BLOCK_SIZE = 16
# Deterministic mode: the triton backend's batch-invariant kernel and the
# batch-invariant GEMM (engine.models.matmul_triton).
DET = "triton-det"


def is_det(backend: str) -> bool:
    """A deterministic-mode backend: `triton-det`, or `triton-det<rows>`."""
    return backend.startswith(DET)


def has_graphs(backend: str) -> bool:
    """Whether `backend`'s decode steps are also replayed from CUDA graphs
    (as `<backend>+graphs`)."""
    return backend == "triton" or is_det(backend)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_step", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True,
                   help="JSON results file; a plot is written beside it (.png)")
    p.add_argument("--replot", action="store_true",
                   help="only redraw the plot of an existing --out file")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batches", type=_ints, default=[1, 8, 32, 128])
    p.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    p.add_argument("--steps", type=int, default=10,
                   help="timed decode steps per batch (attention alone: twice as many; "
                        "prefill: half)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prefill-lens", type=_ints, default=[512, 2048])
    p.add_argument("--backends", default=f"triton,{DET},torch")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face reference")
    p.add_argument("--no-graphs", action="store_true",
                   help="skip the decode steps replayed from CUDA graphs")
    p.add_argument("--graph-max-len", type=int, default=4096,
                   help="max_model_len the graphs are captured for (sets their block-table "
                        "width and decode split)")
    p.add_argument("--profile", type=Path, default=None,
                   help="write a torch.profiler table of 3 decode steps (first backend, "
                        "batch 32 or the largest) here")
    p.add_argument("--ceiling-bytes", type=int, default=2 << 30,
                   help="buffer size of the copy-bandwidth probe")
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ceilings(device: torch.device, nbytes: int) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul rate."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), device, 10, 3)
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    tm = _median_time(lambda: a @ b, device, 10, 3)
    return {"copy_bytes_per_s": 2 * nbytes / t, "matmul_flops_per_s": 2 * n**3 / tm,
            "matmul_n": n}


def llama_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
    )


class OurModel:
    """Our Llama with random weights, a KV cache of random values and one
    block table per sequence slot."""

    def __init__(self, config: Any, args: argparse.Namespace, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.device = device
        self.max_len = args.context + args.warmup + args.steps + 2
        self.model = model_class("llama")(config, dtype, device, max(self.max_len,
                                                                     max(args.prefill_lens)))
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.normal_(1.0 if "norm" in name else 0.0, 0.02 if "norm" not in name else 0.1)
        self.model.eval()
        # One block table per decode slot, then one long enough for the
        # longest prompt.
        self.blocks_per_seq = -(-self.max_len // BLOCK_SIZE)
        self.prefill_base = max(args.batches) * self.blocks_per_seq
        prefill_blocks = -(-max(args.prefill_lens) // BLOCK_SIZE)
        m = self.model
        self.cache = KVCache(m.num_layers, self.prefill_base + prefill_blocks, BLOCK_SIZE,
                             m.num_kv_heads, m.head_dim, dtype, device)
        self.cache.data.normal_()
        self.backends = {}
        for name in args.backends.split(","):
            tile = name[len(DET):] if is_det(name) else ""  # "triton-det64": 64 rows
            rows = {"deterministic_rows": int(tile)} if tile else {}
            self.backends[name] = get_attention_backend("triton" if is_det(name) else name)(
                m.num_heads, m.num_kv_heads, m.head_dim, BLOCK_SIZE, device,
                deterministic=is_det(name), **rows)
        self.linears = (m.linear, m.head_linear)
        self.graphs: dict[str, Any] = {}

    def token(self, pos: int) -> int:
        """A token id for position `pos` (any will do: the weights are random)."""
        return (7 * pos) % min(1000, self.model.vocab_size - 3) + 3

    def table(self, seq: int) -> list[int]:
        return list(range(seq * self.blocks_per_seq, (seq + 1) * self.blocks_per_seq))

    def prefill_table(self, length: int) -> list[int]:
        return list(range(self.prefill_base, self.prefill_base + -(-length // BLOCK_SIZE)))

    def weight_bytes_read_by_decode(self) -> int:
        # The embedding is looked up by row; everything else is read whole.
        m = self.model
        total = sum(p.numel() * p.element_size() for p in m.parameters())
        if m.lm_head is not None:
            total -= m.embed.numel() * m.embed.element_size()
        return total

    def kv_bytes_per_token(self) -> int:
        m = self.model
        return m.num_layers * 2 * m.num_kv_heads * m.head_dim * self.cache.data.element_size()

    def batch(self, backend: str, spans: list[SeqSpan], logits_rows: list[int]) -> ForwardBatch:
        ids: list[int] = []
        pos: list[int] = []
        for s in spans:
            ids.extend(self.token(s.start_pos + i) for i in range(s.num_tokens))
            pos.extend(range(s.start_pos, s.context_len))
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            attn_metadata=self.backends[backend].build_metadata(spans),
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
        )

    def use(self, backend: str) -> None:
        """Attend with `backend`; project with the batch-invariant GEMM for DET."""
        m = self.model
        m.set_attention_backend(self.backends[backend])
        m.linear, m.head_linear = self.linears
        if is_det(backend):
            m.use_fixed_tiles(self.device)

    def capture(self, backend: str, max_batch: int, max_model_len: int) -> None:
        """The engine's decode graphs (engine/cuda_graphs.py) over `backend`,
        as `ModelRunner` captures them at start."""
        from engine.cuda_graphs import DecodeGraphs

        self.use(backend)
        self.graphs[f"{backend}+graphs"] = DecodeGraphs(
            self.model, self.cache, self.backends[backend], max_batch, max_model_len)

    @torch.inference_mode()
    def step(self, backend: str, spans: list[SeqSpan]) -> list[int]:
        """One iteration as the engine runs it: metadata, forward, logits,
        greedy argmax, sampled ids to the host."""
        if backend in self.graphs:
            ids = [self.token(s.start_pos) for s in spans]
            return self.graphs[backend].run(ids, spans).argmax(-1).tolist()
        self.use(backend)
        rows, end = [], 0
        for s in spans:
            end += s.num_tokens
            rows.append(end - 1)
        batch = self.batch(backend, spans, rows)
        hidden = self.model(batch, self.cache)
        return self.model.compute_logits(hidden).argmax(-1).tolist()


def bench_decode(our: OurModel, args: argparse.Namespace, ceil: dict[str, float],
                 backend: str, b: int) -> dict[str, Any]:
    dev = our.device
    ctx = [args.context]

    def one() -> None:
        spans = [SeqSpan(ctx[0], 1, our.table(i)) for i in range(b)]
        our.step(backend, spans)
        ctx[0] += 1

    t = _median_time(one, dev, args.steps, args.warmup)
    mean_ctx = args.context + args.warmup + args.steps / 2
    floor_bytes = our.weight_bytes_read_by_decode() + b * mean_ctx * our.kv_bytes_per_token()
    floor = floor_bytes / ceil["copy_bytes_per_s"]
    return {"backend": backend, "batch": b, "context": args.context, "step_s": t,
            "floor_s": floor, "fraction_of_floor": floor / t, "tokens_per_s": b / t}


def bench_attention(our: OurModel, args: argparse.Namespace, ceil: dict[str, float],
                    backend: str, b: int) -> dict[str, Any]:
    """One layer's decode attention (store + attend) over `context` tokens."""
    m, dev = our.model, our.device
    attn = our.backends[backend]
    our.use(backend)
    spans = [SeqSpan(args.context, 1, our.table(i)) for i in range(b)]
    md = attn.build_metadata(spans)
    q = torch.randn(b, m.num_heads, m.head_dim, dtype=m.dtype, device=dev)
    k = torch.randn(b, m.num_kv_heads, m.head_dim, dtype=m.dtype, device=dev)
    v = torch.randn_like(k)
    kc, vc = our.cache.key(0), our.cache.value(0)
    with torch.inference_mode():
        t = _median_time(lambda: attn.forward(q, k, v, kc, vc, md, m.scale), dev,
                         2 * args.steps, args.warmup)
    kv = b * (args.context + 1) * our.kv_bytes_per_token() / m.num_layers
    floor = kv / ceil["copy_bytes_per_s"]
    return {"backend": backend, "batch": b, "context": args.context, "layer_s": t,
            "floor_s": floor, "fraction_of_floor": floor / t}


def bench_prefill(our: OurModel, args: argparse.Namespace, ceil: dict[str, float],
                  backend: str, length: int) -> dict[str, Any]:
    dev = our.device
    spans = [SeqSpan(0, length, our.prefill_table(length))]
    t = _median_time(lambda: our.step(backend, spans), dev, max(1, args.steps // 2),
                     max(1, args.warmup - 1))
    return {"backend": backend, "prompt": length, "step_s": t, "tokens_per_s": length / t,
            "floor_s": prefill_flops(our.model, length) / ceil["matmul_flops_per_s"]}


def prefill_flops(m: Any, length: int) -> float:
    """Matmul work of one prompt: 2 × weights × tokens (lm_head for the
    last token only) + causal attention (QKᵀ and PV, half the square)."""
    per_token = sum(p.numel() for n, p in m.named_parameters()
                    if p.dim() == 2 and n.startswith("layers."))
    head = m.vocab_size * m.config.hidden_size
    attn = 2 * 2 * m.num_layers * m.num_heads * m.head_dim * length * length / 2
    return 2 * per_token * length + 2 * head + attn


def profile_decode(our: OurModel, args: argparse.Namespace, backend: str, b: int) -> None:
    """Host and device time per op of 3 decode steps, sorted by host time."""
    from torch.profiler import ProfilerActivity, profile

    spans = [SeqSpan(args.context, 1, our.table(i)) for i in range(b)]
    our.step(backend, spans)
    activities = [ProfilerActivity.CPU]
    if our.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(3):
            our.step(backend, spans)
    _sync(our.device)
    avg = prof.key_averages()
    text = [f"{backend} decode, batch {b}, context {args.context}, 3 steps",
            avg.table(sort_by="cpu_time_total", row_limit=25),
            avg.table(sort_by="self_cuda_time_total" if our.device.type == "cuda"
                      else "self_cpu_time_total", row_limit=25)]
    args.profile.parent.mkdir(parents=True, exist_ok=True)
    args.profile.write_text("\n".join(text))


class HFModel:
    def __init__(self, config: Any, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        with torch.device(device):
            self.model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation="sdpa").eval()
        self.device, self.dtype, self.config = device, dtype, config

    @torch.inference_mode()
    def decode(self, args: argparse.Namespace, b: int) -> float:
        from transformers import DynamicCache

        c, dev = self.config, self.device
        hd = c.hidden_size // c.num_attention_heads
        cache = DynamicCache(config=c)
        for layer in range(c.num_hidden_layers):
            kv = torch.randn(2, b, c.num_key_value_heads, args.context, hd, dtype=self.dtype,
                             device=dev)
            cache.update(kv[0], kv[1], layer)
        ids = torch.full((b, 1), 11, dtype=torch.long, device=dev)
        pos = [args.context]

        def one() -> None:
            p = torch.full((b, 1), pos[0], dtype=torch.long, device=dev)
            out = self.model(input_ids=ids, past_key_values=cache, position_ids=p,
                             use_cache=True, logits_to_keep=1)
            out.logits[:, -1].argmax(-1).tolist()
            pos[0] += 1

        return _median_time(one, dev, args.steps, args.warmup)

    @torch.inference_mode()
    def prefill(self, length: int) -> float:
        ids = torch.randint(3, min(1000, self.config.vocab_size), (1, length),
                            device=self.device)

        def one() -> None:
            out = self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
            out.logits[:, -1].argmax(-1).tolist()

        return _median_time(one, self.device, 5, 2)


def plot(result: dict[str, Any], path: Path) -> None:
    """Decode ms/step by batch per backend beside the HBM floor; prefill tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    by_backend: dict[str, list[dict[str, Any]]] = {}
    for r in result["decode"]:
        by_backend.setdefault(r["backend"], []).append(r)
    for backend, rows in by_backend.items():
        ax1.plot([r["batch"] for r in rows], [1e3 * r["step_s"] for r in rows], "o-",
                 label=backend)
    ours = next(r["backend"] for r in result["decode"] if "floor_s" in r)
    floor = [r for r in result["decode"] if r["backend"] == ours]
    ax1.plot([r["batch"] for r in floor], [1e3 * r["floor_s"] for r in floor], "k--",
             label="HBM floor")
    ax1.set(xscale="log", yscale="log", xlabel="decode batch", ylabel="ms / step",
            title=f"decode, context {result['decode'][0]['context']}")
    ax1.legend(fontsize=8)
    prefill: dict[str, list[dict[str, Any]]] = {}
    for r in result["prefill"]:
        prefill.setdefault(r["backend"], []).append(r)
    width = 0.8 / max(1, len(prefill))
    lengths = sorted({r["prompt"] for r in result["prefill"]})
    for i, (backend, rows) in enumerate(prefill.items()):
        rate = {r["prompt"]: r["tokens_per_s"] for r in rows}
        ax2.bar([j + i * width for j in range(len(lengths))],
                [rate.get(n, 0.0) for n in lengths], width, label=backend)
    ax2.set_xticks([j + width * (len(prefill) - 1) / 2 for j in range(len(lengths))],
                   [str(n) for n in lengths])
    ax2.set(xlabel="prompt tokens", ylabel="tokens / s", title="prefill (batch 1)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{result['device']}, {result['dtype']}, Llama shape {result['shape']}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    result: dict[str, Any] = {
        "command": "python -m bench.gpu_step " + " ".join(argv or []),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "dtype": args.dtype,
        "shape": {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads",
                                                "kv_heads", "vocab")},
    }
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        pass
    ceil = result["ceilings"] = ceilings(dev, args.ceiling_bytes)
    print(f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    config = llama_config(args)
    our = OurModel(config, args, dev, dtype)
    result["weight_bytes_read_by_decode"] = our.weight_bytes_read_by_decode()
    backends = list(our.backends)
    result["attention"] = []
    result["decode"] = []
    result["prefill"] = []
    for backend in backends:
        for b in args.batches:
            r = bench_attention(our, args, ceil, backend, b)
            result["attention"].append(r)
            print(f"attention {backend:7s} b={b:4d}: {r['layer_s'] * 1e6:8.1f} us/layer "
                  f"({100 * r['fraction_of_floor']:.0f}% of floor)", flush=True)
    decode_backends = list(backends)
    for backend in backends:
        if has_graphs(backend) and not args.no_graphs:
            t0 = time.perf_counter()
            our.capture(backend, max(args.batches), args.graph_max_len)
            result.setdefault("graph_capture_s", {})[backend] = time.perf_counter() - t0
            decode_backends.insert(decode_backends.index(backend) + 1, f"{backend}+graphs")
    for backend in decode_backends:
        for b in args.batches:
            r = bench_decode(our, args, ceil, backend, b)
            result["decode"].append(r)
            print(f"decode {backend:13s} b={b:4d}: {r['step_s'] * 1e3:7.2f} ms/step "
                  f"({100 * r['fraction_of_floor']:.0f}% of floor {r['floor_s'] * 1e3:.2f} ms)",
                  flush=True)
        if backend in our.graphs:
            continue
        for n in args.prefill_lens:
            r = bench_prefill(our, args, ceil, backend, n)
            result["prefill"].append(r)
            print(f"prefill {backend:7s} {n:5d} tokens: {r['tokens_per_s']:9.0f} tok/s "
                  f"({100 * r['floor_s'] / r['step_s']:.0f}% of matmul floor)", flush=True)
    if args.profile is not None:
        profile_decode(our, args, backends[0], min(32, max(args.batches)))
    if not args.no_hf:
        del our
        torch.cuda.empty_cache() if dev.type == "cuda" else None
        hf = HFModel(config, dev, dtype)
        for b in args.batches:
            t = hf.decode(args, b)
            result["decode"].append({"backend": "hf-sdpa", "batch": b, "context": args.context,
                                     "step_s": t, "tokens_per_s": b / t})
            print(f"decode hf-sdpa b={b:4d}: {t * 1e3:7.2f} ms/step", flush=True)
        for n in args.prefill_lens:
            t = hf.prefill(n)
            result["prefill"].append({"backend": "hf-sdpa", "prompt": n, "step_s": t,
                                      "tokens_per_s": n / t})
            print(f"prefill hf-sdpa {n:5d} tokens: {n / t:9.0f} tok/s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and its plot")


if __name__ == "__main__":
    main()
