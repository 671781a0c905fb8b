"""ModelRunner behaviour: stop conditions, seeds across preemption, bf16, errors."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from scheduler.plan import BlockOp, BlockOpKind, Plan, ScheduledChunk
from tests.engine.helpers import drive, random_prompts


@pytest.fixture(scope="module")
def tiny(tiny_llama_path: Path) -> ModelRunner:
    return ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=96, block_size=4,
                       max_model_len=80, num_threads=1)


def _greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)  # type: ignore[arg-type]


def _run(runner: ModelRunner, prompt: list[int], params: SamplingParams, **sched: int):
    sched = {"num_blocks": 96, "block_size": 4, "max_model_len": 80} | sched
    got = drive(runner, {"j": prompt}, params, **sched)
    return got.tokens["j"], got.text["j"], got.finish["j"]


PROMPT = random_prompts([9], seed=3)["job0"]


def test_stop_token_ids_and_min_tokens(tiny: ModelRunner) -> None:
    free, _, _ = _run(tiny, PROMPT, _greedy(8, ignore_eos=True))
    # A stop token ends the request and its text is not returned.
    toks, text, reason = _run(tiny, PROMPT, _greedy(8, stop_token_ids=[free[2]]))
    assert toks == free[:3] and reason == "stop"
    assert text == tiny.tokenizer.decode(free[:2])
    # min_tokens: the stop token cannot be sampled before 4 outputs exist.
    toks, _, _ = _run(tiny, PROMPT, _greedy(8, stop_token_ids=[free[0]], min_tokens=4))
    assert len(toks) >= 4 and free[0] not in toks[:4]


def test_eos_and_ignore_eos(tiny: ModelRunner) -> None:
    free, _, _ = _run(tiny, PROMPT, _greedy(6, ignore_eos=True))
    saved = tiny.eos_token_ids
    tiny.eos_token_ids = {free[1]}  # snapshotted by add_request
    try:
        toks, _, reason = _run(tiny, PROMPT, _greedy(6))
        assert toks == free[:2] and reason == "stop"
        toks, _, reason = _run(tiny, PROMPT, _greedy(6, ignore_eos=True))
        assert toks == free and reason == "length"
        toks, _, reason = _run(tiny, PROMPT, _greedy(6, min_tokens=3))
        assert len(toks) >= 3 and free[1] not in toks[:3]
    finally:
        tiny.eos_token_ids = saved


def test_max_model_len_finishes_with_length(tiny: ModelRunner) -> None:
    prompt = random_prompts([75], seed=4)["job0"]
    toks, _, reason = _run(tiny, prompt, _greedy(50, ignore_eos=True))
    assert len(toks) == 5 and reason == "length"


def test_stop_string_truncates(smollm2_runner: ModelRunner) -> None:
    r = smollm2_runner
    prompt = r.tokenizer.encode("The capital of France is", add_special_tokens=False)
    _, full, _ = _run(r, prompt, _greedy(12, ignore_eos=True))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    toks, text, reason = _run(r, prompt, _greedy(12, ignore_eos=True, stop=[stop, "zzzz"]))
    assert reason == "stop" and text == full[: full.index(stop)]
    assert len(toks) < 12


@pytest.mark.parametrize("stop", [[], ["zzzz"]])
def test_text_decoded_later_is_the_text_decoded_at_once(smollm2_runner: ModelRunner,
                                                        stop: list[str]) -> None:
    """With `defer_text` a request without stop strings gets its text from
    calls made after the fact (here: after every job left the runner),
    with the same text and finish as when decoded at once; one with stop
    strings is decoded at once either way.  Greedy, float32, same batches."""
    r = smollm2_runner
    enc = r.tokenizer.encode
    prompts = {
        "fr": enc("La capitale de la France est", add_special_tokens=False),
        "zh": enc("中国的首都是", add_special_tokens=False),
        "emoji": enc("Three emoji: 🤖", add_special_tokens=False),
    }
    free = _run(r, prompts["fr"], _greedy(10, ignore_eos=True))[0]
    params = {
        "fr": _greedy(10, ignore_eos=True, stop=stop),  # ends on length
        "zh": _greedy(14, ignore_eos=True, stop=stop),
        # Ends on a stop token (its own text is not returned).
        "emoji": _greedy(10, stop_token_ids=[free[4]], stop=stop),
    }
    sched = {"num_blocks": 96, "block_size": 4, "max_model_len": 80}
    prompts["emoji"] = prompts["fr"]
    at_once = drive(r, prompts, params, **sched)
    later = drive(r, prompts, params, defer_text=True, **sched)
    assert later.tokens == at_once.tokens
    assert later.finish == at_once.finish == {"fr": "length", "zh": "length",
                                              "emoji": "stop"}
    assert later.text == at_once.text
    assert all(at_once.text.values())
    assert at_once.num_deferred_texts == 0
    num_tokens = sum(len(t) for t in later.tokens.values())
    assert later.num_deferred_texts == (0 if stop else num_tokens)


def test_on_launch_runs_once_per_execute_before_the_pass_on_a_cpu(tiny: ModelRunner) -> None:
    """`on_launch` runs once per `execute` (with a pass or without one), on
    a CPU before the pass, and its time is not the iteration's."""
    calls: list[int] = []
    written: list[bool] = []

    def hook() -> None:
        calls.append(1)
        written.append(bool(tiny.kv_cache.data.abs().sum() > 0))
        time.sleep(0.3)

    tiny.kv_cache.data.zero_()
    tiny.add_request("h", _greedy(2, ignore_eos=True), PROMPT)
    tiny.on_launch = hook
    try:
        first = tiny.execute(Plan(step=1, chunks=[ScheduledChunk(
            "h", PROMPT, 0, list(range(3)), True, 0)]))
        assert calls == [1] and written == [False]  # the pass came after
        assert first.outputs[0].token_id is not None
        assert first.iteration_time < 0.3
        tiny.execute(Plan(step=2))  # no chunks: still once
        assert calls == [1, 1]
    finally:
        tiny.on_launch = None
        tiny.remove_request("h")


def test_seeded_sampling_survives_preemption_and_batching(tiny: ModelRunner) -> None:
    prompts = random_prompts([5, 23, 41, 60, 2], seed=5)
    params = {
        j: SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=12, ignore_eos=True)
        for i, j in enumerate(prompts)
    }
    together = drive(tiny, prompts, params, num_blocks=96, block_size=4, max_model_len=80)
    squeezed = drive(tiny, prompts, params, num_blocks=20, block_size=4, max_model_len=80,
                     max_batch_tokens=24)
    assert squeezed.num_mid_generation_preemptions > 0
    assert squeezed.tokens == together.tokens
    for j, p in prompts.items():
        alone = drive(tiny, {j: p}, params[j], num_blocks=96, block_size=4, max_model_len=80)
        assert alone.tokens[j] == together.tokens[j]
    # Unseeded sampling is random, not greedy.
    hot = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True)
    greedy = drive(tiny, prompts, _greedy(12, ignore_eos=True), num_blocks=96, block_size=4,
                   max_model_len=80)
    hot_run = drive(tiny, prompts, hot, num_blocks=96, block_size=4, max_model_len=80)
    assert hot_run.tokens != greedy.tokens


def test_prefill_chunk_without_sampling(tiny: ModelRunner) -> None:
    tiny.add_request("p", _greedy(4), PROMPT)
    try:
        first = ScheduledChunk("p", PROMPT[:4], 0, [0, 1, 2], sample=False, output_index=0)
        res = tiny.execute(Plan(1, [first]))
        assert [(o.job_id, o.token_id, o.text) for o in res.outputs] == [("p", None, "")]
        rest = ScheduledChunk("p", PROMPT[4:], 4, [0, 1, 2], sample=True, output_index=0)
        res = tiny.execute(Plan(2, [rest]))
        assert res.outputs[0].token_id is not None and res.iteration_time > 0
    finally:
        tiny.remove_request("p")


def test_contract_errors(tiny: ModelRunner) -> None:
    with pytest.raises(KeyError, match="never added"):
        tiny.execute(Plan(1, [ScheduledChunk("ghost", [5], 0, [0], True, 0)]))
    tiny.add_request("e", _greedy(4), PROMPT)
    try:
        with pytest.raises(ValueError, match="already registered"):
            tiny.add_request("e", _greedy(4), PROMPT)
        bad = ScheduledChunk("e", PROMPT, 0, [0, 1, 2], sample=True, output_index=3)
        with pytest.raises(RuntimeError, match="scheduler samples output 3"):
            tiny.execute(Plan(1, [bad]))
        op = BlockOp(BlockOpKind.SWAP_OUT, "e", 0, [0])
        with pytest.raises(NotImplementedError, match="swap_out"):
            tiny.execute(Plan(2, [], block_ops=[op]))
        assert tiny.execute(Plan(3)).outputs == []
    finally:
        tiny.remove_request("e")
    with pytest.raises(ValueError, match="at least one prompt token"):
        tiny.add_request("empty", _greedy(1), [])


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_opt350_path", "smollm2_path"])
def test_bfloat16_runs_with_finite_logits(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    prompt = PROMPT[:6]
    logits = {}
    for dtype in ("float32", "bfloat16"):
        r = ModelRunner(path, dtype, "cpu", num_blocks=8, block_size=4, max_model_len=32,
                        num_threads=1)
        r.add_request("b", _greedy(2), prompt)
        logits[dtype] = r.logits(Plan(1, [ScheduledChunk("b", prompt, 0, [0, 1], True, 0)]))
        assert r.kv_cache.data.dtype == r.model.embed.dtype
    assert logits["bfloat16"].dtype == torch.float32
    assert torch.isfinite(logits["bfloat16"]).all()
    # bf16 keeps ~3 significant digits: the logits agree to a loose tolerance.
    err = (logits["bfloat16"] - logits["float32"]).abs().max()
    assert err < 0.05 * logits["float32"].abs().max() + 0.1


def test_bfloat16_logits_on_cpu_sample_as_their_float32_copy(
        tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A bf16 model on CPU keeps its logits in bf16 (no float32 copy of every
    # row); every sampling path must give what the float32 copy gave: plain
    # greedy (the argmax reads bf16), greedy with logprobs, penalties and a
    # logit bias, seeded sampling, prompt logprobs.
    from engine.models.base import CausalLM as Model

    r = ModelRunner(tiny_llama_path, "bfloat16", "cpu", num_blocks=96, block_size=4,
                    max_model_len=80, num_threads=1)
    prompts = random_prompts([5, 23, 41, 9, 2], seed=7)
    params = dict(zip(prompts, [
        _greedy(10, ignore_eos=True),
        _greedy(10, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        _greedy(10, ignore_eos=True, repetition_penalty=1.3, logit_bias={5: 2.0}),
        SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=10, ignore_eos=True,
                       logprobs=1),
        SamplingParams(temperature=1.0, top_p=0.9, seed=12, max_tokens=10, ignore_eos=True,
                       presence_penalty=0.5),
    ]))
    seen: list[torch.dtype] = []
    real = Model.vocab_logits

    def spy(self: Model, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor | None:
        out = real(self, hidden, head)
        seen.append(out.dtype)
        return out

    # Each pair of runs below has the same batches, so bf16 arithmetic is
    # the same in both; only what the sampler reads differs.
    greedy = _greedy(10, ignore_eos=True)
    monkeypatch.setattr(Model, "vocab_logits", spy)
    kept = drive(r, prompts, params, num_blocks=96, block_size=4, max_model_len=80)
    # Every request plain greedy: the argmax reads the bf16 rows themselves.
    kept_greedy = drive(r, prompts, greedy, num_blocks=96, block_size=4, max_model_len=80)
    assert set(seen) == {torch.bfloat16}
    monkeypatch.setattr(Model, "vocab_logits",
                        lambda self, hidden, head: real(self, hidden, head).float())
    # The widened copy's ties broken as the bf16 rows' are (engine.logits_cpu).
    monkeypatch.setattr(Model, "exact_source", lambda self, hidden, logits: (
        hidden, self.head_weight()[: logits.shape[1]]))
    widened = drive(r, prompts, params, num_blocks=96, block_size=4, max_model_len=80)
    widened_greedy = drive(r, prompts, greedy, num_blocks=96, block_size=4, max_model_len=80)
    assert kept.tokens == widened.tokens
    assert kept.logprobs == widened.logprobs and kept.logprobs["job1"]
    assert kept.prompt_logprobs == widened.prompt_logprobs and kept.prompt_logprobs["job1"]
    assert kept_greedy.tokens == widened_greedy.tokens



def _next_bf16(x: torch.Tensor, up: bool) -> None:
    """Move the bf16 scalar view `x` to its neighbour above (`up`) or below."""
    bits = x.view(torch.int16)
    bits += 1 if (float(x) >= 0) == up else -1


def test_bfloat16_greedy_breaks_a_tie_of_rounded_logits_by_the_exact_ones(
        tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A bf16 lm_head rounds two close logits to one value; the greedy token
    # must then be the one whose exact logit is larger, not the lower id
    # (engine.logits_cpu).  Token b gets token a's head row moved by one bf16
    # step in the dimension that moves its exact logit most, upwards.
    r = ModelRunner(tiny_llama_path, "bfloat16", "cpu", num_blocks=32, block_size=4,
                    max_model_len=80, num_threads=1)
    model = type(r.model)
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = model.compute_logits

    def spy(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
        out = real(self, hidden)
        calls.append((hidden.clone(), out.clone()))
        return out

    monkeypatch.setattr(model, "compute_logits", spy)
    prompts = random_prompts([9], seed=3)
    one = _greedy(1, ignore_eos=True)

    def first_token() -> tuple[int, torch.Tensor, torch.Tensor]:
        calls.clear()
        got = drive(r, prompts, one, num_blocks=32, block_size=4, max_model_len=80)
        hidden, logits = calls[0]
        return got.tokens["job0"][0], hidden[0], logits[0]

    a, hidden, logits = first_token()
    assert logits.dtype == torch.bfloat16
    head = r.model.head_weight()
    b = head.shape[0] - 1
    assert a < b and b not in prompts["job0"]
    row_a = head[a].clone()
    tied = False
    for d in hidden.float().abs().argsort(descending=True)[:8].tolist():
        with torch.no_grad():
            head[b] = row_a
            _next_bf16(head[b, d], up=float(hidden[d]) > 0)
        exact = head[[a, b]].float() @ hidden.float()
        assert exact[1] > exact[0]
        token, _, logits = first_token()
        if logits[a] == logits[b]:
            tied = True
            break
    assert tied, "no dimension gave a tie of the rounded logits"
    assert token == b
    # The rounded logits alone would have given the lower id.
    monkeypatch.setattr(model, "exact_source", lambda self, hidden, logits: None)
    assert first_token()[0] == a

def test_model_facts_for_the_ingress(smollm2_runner: ModelRunner) -> None:
    r = smollm2_runner
    assert r.vocab_size == 49152
    assert 2 in r.eos_token_ids
    from engine.tokenizer import chat_template, encode_chat

    assert chat_template(r.tokenizer) is not None
    ids = encode_chat(r.tokenizer, [{"role": "user", "content": "hi"}])
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert r.tokenizer.decode(ids).rstrip().endswith("assistant")


def test_chat_prompt_is_the_templates_own_tokenization(smollm2_path: Path) -> None:
    # The ingress renders then encodes (it keeps the text); the runner
    # encodes at once: both are transformers' tokenized template.
    from engine.tokenizer import encode_chat, encode_chat_text, load_tokenizer, render_chat

    tok = load_tokenizer(smollm2_path)
    messages = [{"role": "system", "content": "Be brief. <|im_start|>"},
                {"role": "user", "content": "hi", "name": "bob"}]
    ids = encode_chat(tok, messages)
    assert encode_chat_text(tok, render_chat(tok, messages)) == ids
    assert ids == list(tok.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True, return_dict=False))
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(tok, messages)
