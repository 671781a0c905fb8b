"""PredictorService batches, and the Serve deployment class without a cluster."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from predictor.config import ModelConfig
from predictor.model import build_predictor, save_predictor
from predictor.service import PredictorService, bench_latency


@pytest.fixture()
def adapter(tiny_opt: Path, tmp_path: Path) -> Path:
    cfg = ModelConfig(backbone=str(tiny_opt), lora_layers=2, head="bins", max_len=256, head_hidden=16)
    model = build_predictor(cfg)
    model.head.init_prior([40, 50, 60, 200], cfg)
    out = tmp_path / "adapter"
    save_predictor(model, out, {"length_tokenizer": str(tiny_opt)})
    return out


def test_service_predicts_positive_ints(adapter: Path) -> None:
    svc = PredictorService(adapter, padding_ratio=0.15, max_batch_size=4)
    prompts = ["write a poem", "", "explain quantum computing " * 30] + ["hi"] * 7
    preds = svc.predict(prompts)
    assert len(preds) == len(prompts)
    for p in preds:
        assert isinstance(p.predicted_len, int) and p.predicted_len >= 1
        assert p.allocation >= p.predicted_len
    # Batching does not change answers.
    assert svc.predict_lengths(prompts[:1]) == [preds[0].predicted_len]
    rows = bench_latency(svc, prompts, batch_sizes=(1, 4), reps=2)
    assert [r["batch_size"] for r in rows] == [1, 4]
    assert all(r["ms_per_prediction"] > 0 and r["prompts"] == 8 for r in rows)


def test_deployment_batches_without_a_cluster(adapter: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    serve = pytest.importorskip("ray.serve")
    from types import SimpleNamespace

    from deployments.predictor import Predictor, prediction_if_ready

    # @serve.batch only reads max_ongoing_requests from the replica context
    # (to warn); stand in for it rather than start Ray in a unit test.
    monkeypatch.setattr(
        serve, "get_replica_context",
        lambda: SimpleNamespace(_deployment_config=SimpleNamespace(max_ongoing_requests=64)),
    )

    cls = Predictor.func_or_class  # the plain class under @serve.deployment
    replica = cls(adapter_dir=str(adapter), padding_ratio=0.2)

    async def go() -> list[dict[str, int]]:
        return await asyncio.gather(*(replica.predict(f"prompt {i}") for i in range(20)))

    calls: list[int] = []
    inner = replica.service.predict_dicts
    replica.service.predict_dicts = lambda prompts: (calls.append(len(prompts)), inner(prompts))[1]
    out = asyncio.run(go())
    assert len(out) == 20
    assert max(calls) > 1 and sum(calls) == 20  # requests were batched
    assert all(o["predicted_len"] >= 1 and o["allocation"] >= o["predicted_len"] for o in out)
    assert prediction_if_ready(None) is None


def check_serves_what_evaluation_scored(adapter: Path) -> None:
    """The adapter loads, and the service frames and truncates prompts exactly
    as training and evaluation did (same prediction on both paths)."""
    from engine.model_source import ModelSourceError, resolve_model
    from predictor.dataset import LengthPair, encode_prompts
    from predictor.evaluate import predict_pairs

    try:
        resolve_model("embedded:smollm2")
    except ModelSourceError as e:
        pytest.skip(f"embedded SmolLM2 unavailable: {e}")
    svc = PredictorService(adapter, padding_ratio=0.15)
    prompts = ["hi", "Write a Python function that parses a CSV file and sums each column. " * 12]
    served = svc.predict_lengths(prompts)
    pairs = [LengthPair(id=str(i), prompt=p, prompt_tokens=n, response_len=1)
             for i, (p, n) in enumerate(zip(prompts, encode_prompts(svc.length_tokenizer, prompts, 1, 0)[1]))]
    scored = predict_pairs(svc.model, pairs, svc.tokenizer, progress=False)
    # LoRA is merged for serving: float rounding may move a prediction by a token.
    assert all(abs(a - max(1, round(b))) <= 1 for a, b in zip(served, scored))
    assert all(1 <= n <= svc.cfg.max_len for n in served)


def test_shipped_adapter_serves_what_evaluation_scored() -> None:
    from predictor.service import DEFAULT_ADAPTER

    check_serves_what_evaluation_scored(DEFAULT_ADAPTER)


def test_the_wheel_ships_the_whole_default_adapter_and_nothing_else() -> None:
    """package-data lists exactly the files in the adapter folder, so the
    test above, which loads that folder, proves the installed adapter works."""
    tomllib = pytest.importorskip("tomllib")
    from predictor.service import DEFAULT_ADAPTER

    root = Path(__file__).resolve().parents[2]
    pkg = root / "predictor"
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["predictor"]
    shipped = {f for pat in patterns for f in pkg.glob(pat) if f.is_file()}
    present = {f for f in (pkg / "adapters").rglob("*") if f.is_file() and "__pycache__" not in f.parts}
    assert shipped == present
    assert {f.relative_to(DEFAULT_ADAPTER).as_posix() for f in present} == {
        "predictor_config.json", "head.safetensors", "lora/adapter_config.json", "lora/adapter_model.safetensors",
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_service_on_cuda_predicts_what_the_host_does(adapter: Path) -> None:
    prompts = ["write a poem", "explain quantum computing " * 30] + ["hi"] * 5
    host = PredictorService(adapter, max_batch_size=4).predict_lengths(prompts)
    gpu = PredictorService(adapter, max_batch_size=4, device="cuda")
    assert gpu.info()["device"].startswith("cuda")
    assert all(abs(a - b) <= 1 for a, b in zip(gpu.predict_lengths(prompts), host))


def test_deployment_swaps_its_adapter_without_dropping_a_request(
        adapter: Path, tiny_opt: Path, tmp_path: Path) -> None:
    pytest.importorskip("ray.serve")
    from deployments.predictor import Predictor

    # A second adapter whose head has another prior: other predictions.
    cfg = ModelConfig(backbone=str(tiny_opt), lora_layers=2, head="bins", max_len=256,
                      head_hidden=16)
    other = build_predictor(cfg)
    other.head.init_prior([600, 700, 800, 900], cfg)
    second = tmp_path / "second"
    save_predictor(other, second, {"length_tokenizer": str(tiny_opt)})

    replica = Predictor.func_or_class(load=False)  # Serve calls reconfigure first
    prompts = [f"prompt {i}" for i in range(12)]

    async def go() -> None:
        await replica.reconfigure({"adapter": str(adapter), "padding_ratio": 0.2})
        old = replica.service
        before = old.predict_dicts(prompts)
        # The old adapter keeps predicting on the event loop's executor while
        # the new one loads in another worker thread, then replaces it.
        loop = asyncio.get_running_loop()
        during = [loop.run_in_executor(None, old.predict_dicts, prompts) for _ in range(3)]
        await replica.reconfigure({"adapter": str(second), "padding_ratio": 0.2})
        assert all(r == before for r in await asyncio.gather(*during))
        after = replica.service.predict_dicts(prompts)
        assert replica.service is not old
        assert [a["predicted_len"] for a in after] != [b["predicted_len"] for b in before]
        info = await replica.info()
        assert info["adapter"] == str(second) and info["swaps"] == 1
        assert info["padding_ratio"] == 0.2
        # The same adapter again: nothing reloads; a new padding applies at once.
        await replica.reconfigure({"adapter": str(second), "padding_ratio": 0.5})
        assert (await replica.info())["swaps"] == 1
        out = replica.service.predict_dicts(["prompt 0"])[0]
        assert out["allocation"] >= round(out["predicted_len"] * 1.5)

    asyncio.run(asyncio.wait_for(go(), timeout=120))
