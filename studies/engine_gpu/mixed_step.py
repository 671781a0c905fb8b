"""Mixed steps on a GPU: decodes beside a prefill chunk, op by op and
replayed from the engine's mixed-step graphs (engine/cuda_graphs_mixed.py).

For each mix of D decodes (each over `--context` cached tokens) and one
prefill chunk of P tokens, on a random-weight Llama shape (default
Llama-3.2-1B's, bf16), it times a whole step as the engine runs it
(metadata, forward, lm_head, greedy argmax, sampled ids to the host)
launched op by op and replayed from the bucket that holds D + P tokens,
against the step's floor: the larger of its weights read once at the copy
rate and its matmul FLOPs at the bf16 matmul rate, both measured in the
same run.

    python -m studies.engine_gpu.mixed_step --out studies/engine_gpu/mixed_step.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from bench import gpu_step
from engine.attention import SeqSpan
from engine.cuda_graphs_mixed import MixedGraphs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--mixes", default="0:64,0:512,0:2048,32:64,32:512,127:64,127:512,127:2048",
                   help="decodes:prefill tokens, comma-separated")
    p.add_argument("--max-tokens", type=int, default=4096,
                   help="largest step captured (the scheduler's max_batch_tokens)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    mixes = [tuple(int(x) for x in m.split(":")) for m in args.mixes.split(",")]
    dev = torch.device(args.device)
    max_d = max(d for d, _ in mixes)
    max_p = max(p for _, p in mixes)
    # The shared model builder takes gpu_step's arguments.
    gargs = gpu_step.parse_args([
        "--out", "/dev/null", "--layers", str(args.layers), "--hidden", str(args.hidden),
        "--intermediate", str(args.intermediate), "--heads", str(args.heads),
        "--kv-heads", str(args.kv_heads), "--vocab", str(args.vocab),
        "--batches", str(max(max_d, 1)), "--context", str(args.context),
        "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--prefill-lens", str(max_p), "--backends", "triton"])
    ceil = gpu_step.ceilings(dev, 2 << 30)
    our = gpu_step.OurModel(gpu_step.llama_config(gargs), gargs, dev, torch.bfloat16)
    our.use("triton")
    max_len = max(our.max_len, max_p)
    graphs = MixedGraphs(our.model, our.cache, our.backends["triton"], max(max_d, 1) + 1,
                         args.max_tokens, max_len)
    m = our.model
    layer_params = sum(p.numel() for n, p in m.named_parameters()
                       if n.startswith("layers.") and p.dim() == 2)
    weight_bytes = our.weight_bytes_read_by_decode()
    rows: list[dict[str, Any]] = []
    for d, p in mixes:
        # Decodes step forward from `context`; the chunk is recomputed at
        # position 0 each time (its K/V overwritten with the same values).
        ctx = [args.context]

        def spans() -> list[SeqSpan]:
            return ([SeqSpan(ctx[0], 1, our.table(i)) for i in range(d)]
                    + [SeqSpan(0, p, our.prefill_table(p))])

        def eager() -> None:
            our.step("triton", spans())
            ctx[0] = args.context + (ctx[0] - args.context + 1) % args.steps

        @torch.inference_mode()
        def replay() -> None:
            ss = spans()
            ids = [our.token(s.start_pos + i) for s in ss for i in range(s.num_tokens)]
            pos = [s.start_pos + i for s in ss for i in range(s.num_tokens)]
            last, end = [], 0
            for s in ss:
                end += s.num_tokens
                last.append(end - 1)
            graphs.run(ids, pos, ss, last).argmax(-1).tolist()
            ctx[0] = args.context + (ctx[0] - args.context + 1) % args.steps

        t_eager = gpu_step._median_time(eager, dev, args.steps, args.warmup)
        t_graph = gpu_step._median_time(replay, dev, args.steps, args.warmup)
        tokens = d + p
        flops = 2 * layer_params * tokens
        kv = d * args.context * our.kv_bytes_per_token()
        floor = max((weight_bytes + kv) / ceil["copy_bytes_per_s"],
                    flops / ceil["matmul_flops_per_s"])
        row = {"decodes": d, "prefill": p, "bucket": graphs.bucket_for(tokens),
               "eager_s": t_eager, "graph_s": t_graph, "floor_s": floor,
               "graph_fraction_of_floor": floor / t_graph, "speedup": t_eager / t_graph}
        rows.append(row)
        print(f"{d:4d} decodes + {p:5d} prefill: op by op {1e3 * t_eager:7.2f} ms, "
              f"graph {1e3 * t_graph:7.2f} ms (bucket {row['bucket']}), floor "
              f"{1e3 * floor:6.2f} ms ({100 * floor / t_graph:.0f} %), "
              f"{t_eager / t_graph:.2f}x", flush=True)
    out = {"command": "python -m studies.engine_gpu.mixed_step " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "ceilings": ceil, "shape": {k: getattr(args, k) for k in (
               "layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")},
           "context": args.context, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
