"""Shared test helpers: tiny random checkpoints, the HF reference, the driver loop."""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.job import Job
from scheduler.plan import TokenLogprob

# Random prompts draw from this id range: ordinary tokens of the SmolLM2
# tokenizer that the tiny models reuse, all inside their small vocabulary.
TINY_VOCAB = 1024

# A C++ compiler for the CPU operators (engine/cpp_ops.py builds them).
HAS_CXX = any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def save_random_model(config: object, tokenizer_src: Path, out: Path, seed: int = 0) -> Path:
    """A randomly initialised HF model (with SmolLM2's tokenizer) saved to `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Sharper logits than the default init: random models with near-uniform
    # logits have near-ties that make greedy parity a coin flip on rounding.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15 if "embed" not in name else 1.0)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_src).save_pretrained(out)
    return out


def load_hf(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", local_files_only=True
    ).eval()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    """The reference: greedy decoding with HF's own forward and KV cache,
    one sequence at a time (no padding), ignoring EOS."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt])
    out: list[int] = []
    for _ in range(num_tokens):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        token = int(logits[0, -1].argmax())
        out.append(token)
        ids = torch.tensor([[token]])
    return out


def reference_adjust(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
    banned: tuple[int, ...] = (),
) -> torch.Tensor:
    """One row of logits `[vocab]` after logit bias, bans and penalties, in
    vLLM's order: HF's processor for the repetition penalty, OpenAI's
    formula for presence / frequency (a copy; the input is left as is)."""
    from collections import Counter

    from transformers import RepetitionPenaltyLogitsProcessor

    row = logits.clone().unsqueeze(0)
    for tok, bias in params.logit_bias.items():
        row[0, tok] += bias
    for tok in banned:
        row[0, tok] = float("-inf")
    if params.repetition_penalty != 1.0:
        history = torch.tensor([list(prompt) + list(output)])
        row = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(history, row)
    for tok, count in Counter(output).items():
        row[0, tok] -= params.frequency_penalty * count + params.presence_penalty
    return row[0]


@torch.inference_mode()
def hf_adjusted_greedy(
    model: torch.nn.Module, prompt: list[int], params: SamplingParams, num_tokens: int
) -> list[int]:
    """Greedy decoding with HF's full forward (no cache) and `reference_adjust`
    before each argmax, one sequence at a time, ignoring EOS."""
    out: list[int] = []
    for _ in range(num_tokens):
        logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1].float()
        out.append(int(reference_adjust(logits, params, prompt, out).argmax()))
    return out


@torch.inference_mode()
def hf_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """`[len(tokens), vocab]`: row q is the float32 log-distribution of the
    token after `tokens[: q + 1]`, from one full HF forward."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    return logits.log_softmax(dim=-1)


def random_prompts(lengths: list[int], seed: int, vocab: int = TINY_VOCAB) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"job{i}": torch.randint(3, vocab, (n,), generator=gen).tolist()
        for i, n in enumerate(lengths)
    }


@dataclass
class DriveResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    text: dict[str, str] = field(default_factory=dict)
    finish: dict[str, str | None] = field(default_factory=dict)
    # Per sampled token, when the request asked for logprobs.
    logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)
    # Delivered once, with the first token, when asked for.
    prompt_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)
    num_preemptions: int = 0
    # Preemptions of jobs that had already sampled tokens (mid-generation).
    num_mid_generation_preemptions: int = 0
    # Preemptions of jobs part-way through their prompt (some of it computed).
    num_mid_prompt_preemptions: int = 0
    num_steps: int = 0
    # Text deltas the runner left for later (`JobOutput.text_later`).
    num_deferred_texts: int = 0
    # The runner's length-head estimates, where it has a head.
    head_estimates: dict[str, int] = field(default_factory=dict)
    core: SchedulerCore | None = None


def drive(
    runner: ModelRunner,
    prompts: dict[str, list[int]],
    params: SamplingParams | dict[str, SamplingParams],
    *,
    num_blocks: int,
    block_size: int,
    max_batch_tokens: int = 512,
    max_batch_size: int = 32,
    max_model_len: int = 256,
    defer_text: bool = False,
    predictions: dict[str, list[int]] | None = None,
    **sched_extra: object,
) -> DriveResult:
    """Run `prompts` to completion through the real scheduler core (FCFS).

    `predictions`: a job's prediction of its answer (drafts, with
    `speculative` settings).  `defer_text`: the runner leaves the text of
    requests without stop strings for later, and this decodes it only once every job has
    finished and left the runner (in token order per job)."""
    assert block_size == runner.block_size
    assert num_blocks <= runner.kv_cache.num_blocks
    clock = itertools.count()
    core = SchedulerCore(
        SchedulerConfig(
            policy="fcfs",
            block_size=block_size,
            num_blocks=num_blocks,
            max_batch_size=max_batch_size,
            max_batch_tokens=max_batch_tokens,
            max_model_len=max_model_len,
            **sched_extra,  # type: ignore[arg-type]
        ),
        clock=lambda: float(next(clock)),
    )
    result = DriveResult()
    for job_id, prompt in prompts.items():
        p = params[job_id] if isinstance(params, dict) else params
        assert p.max_tokens is not None
        job = Job(job_id, prompt, p.max_tokens, arrival_time=0.0,
                  prediction=(predictions or {}).get(job_id))
        # As the engine loop does: drafts for the requests it can verify.
        job.speculate = bool(core.config.speculative.num_tokens) and p.draftable
        core.add(job)
        runner.add_request(job_id, p, prompt)
        result.tokens[job_id] = []
        result.text[job_id] = ""
        result.logprobs[job_id] = []
    later: dict[str, list[Callable[[], str]]] = {j: [] for j in prompts}
    runner.defer_text = defer_text
    try:
        _drive(runner, core, result, later)
    finally:
        runner.defer_text = False
    for job_id, calls in later.items():
        for decode in calls:
            result.text[job_id] += decode()
    core.blocks.check()
    assert core.blocks.num_free == num_blocks
    result.num_preemptions = core.num_preemptions
    result.core = core
    return result


def _drive(runner: ModelRunner, core: SchedulerCore, result: DriveResult,
           later: dict[str, list[Callable[[], str]]]) -> None:
    while core.has_work:
        computed = {j: job.num_computed_tokens for j, job in core.jobs.items()}
        plan = core.schedule()
        if not plan.chunks:  # only swaps in flight: the runner waits for them
            assert plan.block_ops or runner.num_swaps_in_flight, (
                "scheduler made no progress"
            )
        result.num_mid_generation_preemptions += sum(
            1 for j in plan.preempted if core.jobs[j].num_output_tokens > 0
        )
        result.num_mid_prompt_preemptions += sum(
            1 for j in plan.preempted if 0 < computed[j] < core.jobs[j].num_prompt_tokens
        )
        step = runner.execute(plan)
        assert step.iteration_time > 0 or not plan.chunks
        for out in step.outputs:
            if out.predicted_output_len is not None:
                assert out.job_id not in result.head_estimates, "estimated twice"
                result.head_estimates[out.job_id] = out.predicted_output_len
        for ev in core.complete(plan, step):
            assert ev.token_id is not None
            result.tokens[ev.job_id] += [*(ev.accepted or ()), ev.token_id]
            result.logprobs[ev.job_id] += [None] * len(ev.accepted or ())
            if ev.text_later is not None:
                assert ev.text == ""
                later[ev.job_id].append(ev.text_later)
                result.num_deferred_texts += 1
            elif later[ev.job_id]:
                later[ev.job_id].append(lambda text=ev.text: text)
            else:
                result.text[ev.job_id] += ev.text
            result.logprobs[ev.job_id].append(ev.logprobs)
            if ev.prompt_logprobs is not None:
                assert len(result.tokens[ev.job_id]) == 1, "prompt logprobs after the first token"
                assert ev.job_id not in result.prompt_logprobs, "prompt logprobs delivered twice"
                result.prompt_logprobs[ev.job_id] = ev.prompt_logprobs
            if ev.finished:
                result.finish[ev.job_id] = ev.finish_reason
                runner.remove_request(ev.job_id)
        result.num_steps += 1
        assert result.num_steps < 10_000


@contextmanager
def split_runner(path: Path, shards: int, stages: int = 1,
                 **kwargs: object) -> Iterator[ModelRunner]:
    """Global rank 0's runner of the model at `path` split into `shards`
    tensor-parallel shards × `stages` pipeline stages, the other ranks Ray
    actors (a Ray cluster must be up)."""
    from deployments.shard_workers import RayShardGroup

    args = dict(kwargs, model_path=str(path))
    group = RayShardGroup(shards, args, stages=stages)
    try:
        tp, pp = group.join()
        runner = ModelRunner(**args, tensor_parallel=tp, pipeline=pp)  # type: ignore[arg-type]
        group.wait_ready()
        runner.attach_shards(group)
        yield runner
    finally:
        group.close()
