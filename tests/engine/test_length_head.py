"""The engine's length head (engine/length_head.py): fitting, the file, and
the estimate the runner hands out with each job's first token."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.length_head import EMBEDDED, LengthHead, fit_head
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from predictor.fit_head import fit_from_answers, prompt_states
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.job import Job
from tests.engine.helpers import random_prompts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _random_head(hidden: int, seed: int = 0) -> LengthHead:
    g = torch.Generator().manual_seed(seed)
    return LengthHead(torch.zeros(hidden), torch.ones(hidden),
                      0.05 * torch.randn(hidden, generator=g), 0.3, math.log(40.0), 400)


def test_fit_recovers_a_log_linear_relation() -> None:
    g = torch.Generator().manual_seed(1)
    n, h = 600, 24
    x = 3.0 + 2.0 * torch.randn(n, h, generator=g)
    plens = torch.randint(5, 500, (n,), generator=g)
    w = 0.2 * torch.randn(h, generator=g)
    true_log = ((x - 3.0) / 2.0) @ w + 0.4 * plens.double().log().float() + 2.0
    lengths = true_log.exp().round().long().clamp(min=1)
    head = fit_head(x[:400], plens[:400], lengths[:400], lam=1.0, cap=10_000)
    est = head.predict(x[400:], plens[400:])
    rel = ((est.float() - lengths[400:].float()).abs() / lengths[400:].float()).median()
    assert float(rel) < 0.02
    assert abs(head.prompt_coef - 0.4) < 0.02


def test_cap_bounds_the_fit_and_the_estimate() -> None:
    """Answers cut at the cap count as the cap: the head estimates
    min(length, cap), and never returns more."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 8, generator=g)
    plens = torch.full((300,), 50)
    lengths = (x[:, 0] * 2.0 + 6.0).exp().round().long()  # up to tens of thousands
    cap = 300
    rows = [{"prompt_ids": [1] * 50, "length": min(int(n), cap), "censored": int(n) >= cap}
            for n in lengths]
    head = fit_from_answers(rows, x, cap, 1.0, "")
    est = head.predict(x, plens)
    assert int(est.max()) <= cap
    long = lengths >= 4 * cap
    assert float(est[long].float().median()) >= 0.9 * cap
    assert int(est[long].min()) >= 0.7 * cap


def test_file_round_trip_and_errors(tmp_path: Path) -> None:
    head = _random_head(16)
    head.save(tmp_path / "h.pt")
    back = LengthHead.load(tmp_path / "h.pt")
    x = torch.randn(5, 16)
    plens = torch.tensor([3, 30, 300, 7, 70])
    assert torch.equal(back.predict(x, plens), head.predict(x, plens))
    with pytest.raises(FileNotFoundError, match="no such file"):
        LengthHead.load(tmp_path / "missing.pt")
    d = torch.load(tmp_path / "h.pt", weights_only=True)
    d["scale"] = torch.ones(8)
    torch.save(d, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="inconsistent shapes"):
        LengthHead.load(tmp_path / "bad.pt")


def test_shipped_head_matches_the_embedded_model(smollm2_path: Path) -> None:
    from transformers import AutoConfig

    head = LengthHead.load("embedded")
    assert EMBEDDED.is_file()
    assert head.hidden_size == AutoConfig.from_pretrained(smollm2_path).hidden_size
    assert head.cap >= 256 and head.fit["rows"] >= 500


def test_runner_rejects_a_head_of_another_model(tmp_path: Path, tiny_llama_path: Path) -> None:
    _random_head(32).save(tmp_path / "h.pt")
    with pytest.raises(ValueError, match="size 32.*are 64"):
        ModelRunner(tiny_llama_path, num_blocks=16, block_size=4, max_model_len=64,
                    length_head=tmp_path / "h.pt")


@pytest.mark.parametrize("model,policy", [("tiny_llama_path", "fcfs"),
                                          ("tiny_opt_path", "fcfs"),
                                          ("tiny_llama_path", "econoserve"),
                                          ("tiny_llama_path", "mlfq")])
def test_first_token_carries_the_heads_estimate(
        model: str, policy: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """With chunked prefill and several jobs in one step, each job's first
    token (and only it) carries the head applied to the model's final
    hidden state at the prompt's last position, as `transformers` computes
    it (float32), and the scheduler core takes it as the job's prediction,
    padded for its allocation, which EconoServe then gives the job in place
    of the predictor's."""
    path: Path = request.getfixturevalue(model)
    head = _random_head(64)
    head.save(tmp_path / "h.pt")
    runner = ModelRunner(path, dtype="float32", num_blocks=64, block_size=4,
                         max_model_len=128, length_head=tmp_path / "h.pt")
    _check_first_tokens(runner, path, head, policy)


@pytest.mark.parametrize("model", ["tiny_llama_path", "tiny_opt_path"])
def test_the_estimate_comes_from_graph_replays(model: str, request: pytest.FixtureRequest,
                                               tmp_path: Path) -> None:
    """With decode and mixed steps replayed from CUDA graphs (on CUDA; off
    it, the same static buffers run under Triton's interpreter), passes that
    sample first tokens replay too, and the head reads the hidden rows the
    replay left: the same estimates as above, and no pass ran op by op."""
    path: Path = request.getfixturevalue(model)
    head = _random_head(64)
    head.save(tmp_path / "h.pt")
    runner = ModelRunner(path, dtype="float32", device=DEVICE, num_blocks=64, block_size=4,
                         max_model_len=128, length_head=tmp_path / "h.pt",
                         attention_backend="triton", cuda_graph_max_batch=4,
                         cuda_graph_max_tokens=32)
    steps = _check_first_tokens(runner, path, head, "fcfs")
    assert runner.graphs is not None and runner.mixed_graphs is not None
    assert runner.mixed_graphs.num_runs > 0
    assert runner.graphs.num_runs + runner.mixed_graphs.num_runs == steps


def _check_first_tokens(runner: ModelRunner, path: Path, head: LengthHead, policy: str) -> int:
    """Drives four prompts to six tokens each through `policy`; returns the
    number of passes."""
    prompts = random_prompts([5, 9, 23, 41], seed=3)
    expected = head.predict(prompt_states(path, list(prompts.values()), log_every=0),
                            torch.tensor([len(p) for p in prompts.values()])).tolist()
    core = SchedulerCore(SchedulerConfig(
        policy=policy, block_size=4, num_blocks=64, max_batch_size=4, max_batch_tokens=20,
        max_model_len=128, length_padding_ratio=0.25), clock=lambda: 0.0)
    jobs = {}
    for jid, p in prompts.items():
        jobs[jid] = Job(jid, p, 6, arrival_time=0.0, predicted_output_len=2,
                        allocated_output_len=2)
        core.add(jobs[jid])
        runner.add_request(jid, SamplingParams(max_tokens=6, ignore_eos=True), p)
    seen: dict[str, list[int | None]] = {j: [] for j in prompts}
    steps = 0
    while core.has_work:
        plan = core.schedule()
        step = runner.execute(plan)
        steps += 1
        for out in step.outputs:
            if out.token_id is not None:
                seen[out.job_id].append(out.predicted_output_len)
            else:
                assert out.predicted_output_len is None  # a prompt chunk short of its end
        for ev in core.complete(plan, step):
            if policy == "econoserve" and len(seen[ev.job_id]) == 1:
                assert core.policy.allocation(jobs[ev.job_id]) == 6  # max_tokens, not 2
            if ev.finished:
                runner.remove_request(ev.job_id)
    for (jid, got), want in zip(seen.items(), expected):
        # Equal up to the rounding of float32 sums taken in another order.
        assert got[0] is not None and abs(got[0] - want) <= max(1, 0.01 * want), jid
        assert got[1:] == [None] * 5, jid
        assert jobs[jid].predicted_output_len == got[0]
        assert jobs[jid].allocated_output_len == math.ceil(got[0] * 1.25 - 1e-9)
        assert jobs[jid].length_from_engine
    return steps


def test_runner_without_a_head_hands_out_none(tiny_llama_path: Path) -> None:
    runner = ModelRunner(tiny_llama_path, dtype="float32", num_blocks=32, block_size=4,
                         max_model_len=64)
    core = SchedulerCore(SchedulerConfig(policy="fcfs", block_size=4, num_blocks=32,
                                         max_model_len=64), clock=lambda: 0.0)
    core.add(Job("a", [5, 6, 7], 2, arrival_time=0.0, predicted_output_len=9))
    runner.add_request("a", SamplingParams(max_tokens=2, ignore_eos=True), [5, 6, 7])
    plan = core.schedule()
    step = runner.execute(plan)
    assert step.outputs[0].predicted_output_len is None
    core.complete(plan, step)
    assert core.jobs["a"].predicted_output_len == 9 and not core.jobs["a"].length_from_engine


def test_fit_head_reads_the_servers_log(tmp_path: Path, tiny_llama_path: Path) -> None:
    """`python -m predictor fit-head` on a folder of served-*.jsonl logs:
    lines without prompt ids and answers cut short of the cap are left out;
    the head it writes loads into a runner of that model."""
    from predictor.__main__ import main
    from predictor.fit_head import read_answers

    logs = tmp_path / "served"
    logs.mkdir()
    prompts = random_prompts([3 + k % 17 for k in range(40)], seed=5)
    lines = [{"prompt_ids": p, "output_len": 5 + 3 * k, "censored": False}
             for k, p in enumerate(prompts.values())]
    lines += [{"prompt": "old line, no ids", "output_len": 9, "censored": False},
              {"prompt_ids": [5, 6], "output_len": 12, "censored": True},  # short of the cap
              {"prompt_ids": [5, 6, 7], "output_len": 64, "censored": True}]  # at the cap
    for part in (0, 1):
        (logs / f"served-{part}.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in lines[part::2]))
    (logs / "other.jsonl").write_text("not a log\n")
    rows, left_out = read_answers(logs, cap=64)
    assert (len(rows), left_out) == (41, 2)
    assert {"prompt_ids": [5, 6, 7], "length": 64, "censored": True} in rows
    main(["fit-head", "--answers", str(logs), "--out", str(tmp_path / "h.pt"),
          "--model", str(tiny_llama_path), "--cap", "64", "--lambda", "10"])
    head = LengthHead.load(tmp_path / "h.pt")
    assert head.fit["rows"] == 41 and head.fit["left_out"] == 2 and head.cap == 64
    runner = ModelRunner(tiny_llama_path, num_blocks=16, block_size=4, max_model_len=64,
                         length_head=tmp_path / "h.pt")
    assert runner.length_head is not None and runner.length_head.hidden_size == 64
