"""What sampling costs a whole decode step of the shipped model, with the C++
sampling operator and without it (the sampler's torch path), beside greedy.

`bench.engine_bench`'s decode set-up (`batch` sequences over a shared
context, our `ModelRunner` on one thread) with every row at one sampling
setting; the settings alternate step by step so that the host's drift hits
them alike.  Medians of `--steps` timed steps per setting.

    python -m studies.engine_cpu.sampled_step --out studies/engine_cpu/sampled_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

import bench.engine_bench as eb
from bench.report import machine_meta, write_report
from engine import attention_cpp
from engine.dtypes import resolve_dtype
from engine.sampling import SampleRequest
from engine.sampling_params import SamplingParams

SETTINGS: dict[str, tuple[SamplingParams, bool]] = {
    "greedy": (SamplingParams(temperature=0.0, ignore_eos=True), True),
    "temperature 1": (SamplingParams(temperature=1.0, ignore_eos=True), True),
    "temperature 1, torch path": (SamplingParams(temperature=1.0, ignore_eos=True), False),
    "top_p 0.9": (SamplingParams(temperature=1.0, top_p=0.9, ignore_eos=True), True),
    "top_p 0.9, torch path": (SamplingParams(temperature=1.0, top_p=0.9, ignore_eos=True),
                              False),
}


_TEXT = ("The harbour was quiet that morning. Fishing boats came in one by one, and the "
         "gulls followed them, crying over the nets. On the pier an old man mended a sail "
         "while two children counted the boats and argued about which one was the fastest. ")


def ours_tokenizer(benches: dict[str, Any]) -> Any:
    return next(iter(benches.values())).runner.tokenizer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.engine_cpu.sampled_step",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="32,96")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--random-prompt", action="store_true",
                    help="random token ids as the context instead of English text")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    attention_cpp.load_kernel()
    fusable = SampleRequest.fusable
    batches = [int(b) for b in a.batch.split(",") if b]
    args = eb.parse_args(["--dtypes", a.dtype, "--prefill-lens", "16", "--decode-batches",
                          ",".join(map(str, batches)), "--decode-context", str(a.context),
                          "--decode-steps", str(a.steps * len(SETTINGS) + 2), "--warmup", "1"])
    # One runner per setting, so that their sequences stay registered side by side.
    dtype = resolve_dtype(a.dtype, "cpu")
    benches = {name: eb.OursBench(args, dtype) for name in SETTINGS}
    # English text, not random ids: a model's next-token distribution after
    # random ids is nearly flat, and a top-p nucleus then holds thousands of
    # tokens (`--random-prompt` measures that case).
    if a.random_prompt:
        prompt = [int(t) for t in torch.randint(100, 20000, (a.context,),
                                                generator=torch.Generator().manual_seed(0))]
    else:
        ids = ours_tokenizer(benches).encode(_TEXT * 20, add_special_tokens=False)
        prompt = ids[: a.context]
    results: list[dict[str, Any]] = []
    for batch in batches:
        steps: dict[str, list[float]] = {name: [] for name in SETTINGS}
        runs = {}
        for name, (params, _) in SETTINGS.items():
            eb.GREEDY = params  # what OursBench registers its sequences with
            runs[name] = benches[name].start_decode(prompt, batch)
        for _ in range(a.steps):
            for name, (_, fused) in SETTINGS.items():
                SampleRequest.fusable = fusable if fused else property(lambda self: False)
                steps[name].append(runs[name]())
        SampleRequest.fusable = fusable
        for name, times in steps.items():
            r = {"batch": batch, "setting": name, "step_ms": round(statistics.median(times) * 1e3, 2)}
            print(json.dumps(r), flush=True)
            results.append(r)
    write_report({"meta": {**machine_meta(), "context": a.context, "dtype": dtype,
                           "random_prompt": a.random_prompt,
                           "steps": a.steps}, "results": results}, a.out)


if __name__ == "__main__":
    main()
