"""Training on a tiny random OPT: loss goes down, checkpoints resume exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from predictor.config import DatasetConfig, ModelConfig, TrainConfig
from predictor.dataset import build_pairs, load_tokenizer, split_validation
from predictor.evaluate import evaluate_model
from predictor.model import load_predictor
from predictor.train import CHECKPOINT_SUBDIR, STATE_FILE, train

from .conftest import synthetic_records


def _pairs(path: Path):  # type: ignore[no-untyped-def]
    tok = load_tokenizer(str(path))
    return build_pairs(synthetic_records(120), tok, DatasetConfig(tokenizer=str(path), n_finetune=80))


def _cfg(path: Path, head: str = "bins") -> ModelConfig:
    return ModelConfig(backbone=str(path), lora_layers=2, prompt_head=12, prompt_tail=4,
                       head=head, head_hidden=16, max_len=256)


def test_training_reduces_loss(tiny_opt: Path, tmp_path: Path) -> None:
    s = _pairs(tiny_opt)
    for head in ("bins", "log"):
        tc = TrainConfig(max_train_samples=16, batch_size=16, max_steps=25, lr=1e-2, head_lr=1e-2,
                         warmup_steps=0, eval_samples=8, checkpoint_every=0)
        out = tmp_path / head
        summary = train(_cfg(tiny_opt, head), tc, s.train, s.test, out, progress=False)
        losses = summary["losses"]
        assert len(losses) == 25
        assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, head
        assert (out / "lora" / "adapter_model.safetensors").is_file()
        assert len((out / "curve.jsonl").read_text().splitlines()) == 1
        report = evaluate_model(load_predictor(out), s.train, s.test, progress=False)
        assert report["model"]["n"] == len(s.test)
        assert set(report["baselines"]) == {"train_median", "bucket_median"}


def test_checkpoint_resume_restores_step_and_weights(tiny_opt: Path, tmp_path: Path) -> None:
    s = _pairs(tiny_opt)
    cfg = _cfg(tiny_opt)
    kw = dict(max_train_samples=32, batch_size=8, lr=5e-3, warmup_steps=1, eval_samples=8, checkpoint_every=1)
    # Uninterrupted: 4 steps.
    full = tmp_path / "full"
    train(cfg, TrainConfig(max_steps=4, **kw), s.train, s.test, full, progress=False)
    # Interrupted after 2 steps, then resumed to 4.
    part = tmp_path / "part"
    train(cfg, TrainConfig(max_steps=4, **kw), s.train, s.test, part, progress=False, stop_at=2)
    state = torch.load(part / CHECKPOINT_SUBDIR / STATE_FILE, weights_only=False)
    assert state["step"] == 2
    # A run killed between a curve point and its next checkpoint left a point past it.
    with (part / "curve.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "mae": -1.0}) + "\n")
    summary = train(cfg, TrainConfig(max_steps=4, **kw), s.train, s.test, part, resume=True, progress=False)
    assert summary["steps"] == 4 and len(summary["losses"]) == 2  # only steps 3 and 4 ran
    assert summary["start_step"] == 2
    curve = [json.loads(x) for x in (part / "curve.jsonl").read_text().splitlines()]
    assert [p["step"] for p in curve] == [2, 4] and curve[-1]["mae"] >= 0
    # Resumed at its last step (killed before its summary was written): nothing
    # runs, and the summary still carries the last point.
    again = train(cfg, TrainConfig(max_steps=4, **kw), s.train, s.test, part, resume=True, progress=False)
    assert again["losses"] == [] and again["final"] == {k: curve[-1][k] for k in ("mae", "acc50", "acc100")}
    assert json.loads((part / "predictor_config.json").read_text())["step"] == 4
    a, b = load_predictor(full), load_predictor(part)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb
        assert torch.allclose(pa, pb, atol=1e-6), na


def test_validation_slice_replaces_the_test_pairs(tiny_opt: Path, tmp_path: Path) -> None:
    s = _pairs(tiny_opt)
    fit, val = split_validation(s.train, 0.25, seed=0)
    tc = TrainConfig(batch_size=8, max_steps=3, warmup_steps=0, eval_samples=1000, checkpoint_every=0,
                     val_fraction=0.25, seed=3)
    summary = train(_cfg(tiny_opt), tc, s.train, s.test, tmp_path, progress=False)
    # Trained on the fit part only, scored on the whole slice (not on the test pairs).
    assert summary["eval_on"] == "validation"
    assert (summary["n_train"], summary["n_eval"]) == (len(fit), len(val))
    curve = [json.loads(x) for x in (tmp_path / "curve.jsonl").read_text().splitlines()]
    assert summary["final"] == {k: curve[-1][k] for k in ("mae", "acc50", "acc100")}
    model = load_predictor(tmp_path)
    again = evaluate_model(model, fit, val, progress=False)["model"]
    assert abs(again["mae"] - summary["final"]["mae"]) < 1e-6


def test_device_is_checked_at_config_time() -> None:
    with pytest.raises(ValidationError, match="device"):
        TrainConfig(device="tpu")
    assert TrainConfig(device="cuda:1").device == "cuda:1"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_on_cuda_matches_the_host(tiny_llama: Path, tmp_path: Path) -> None:
    s = _pairs(tiny_llama)
    kw = dict(batch_size=8, max_steps=6, warmup_steps=0, eval_samples=16, checkpoint_every=3)
    # No dropout anywhere (OPT has some inside its layers, the Llama none): the
    # host and the GPU draw their masks from different generators.
    cfg = _cfg(tiny_llama).model_copy(update={"lora_dropout": 0.0, "head_dropout": 0.0})
    gpu = train(cfg, TrainConfig(device="cuda", **kw), s.train, s.test, tmp_path / "gpu",
                progress=False)
    cpu = train(cfg, TrainConfig(**kw), s.train, s.test, tmp_path / "cpu", progress=False)
    assert gpu["device"].startswith("cuda")
    # Same seed, same weights, same batches: the first loss agrees to float32
    # rounding; later ones drift only as far as the kernels' summation order.
    assert abs(gpu["losses"][0] - cpu["losses"][0]) < 1e-4
    assert max(abs(a - b) for a, b in zip(gpu["losses"], cpu["losses"])) < 2e-2
    # The saved adapter loads and scores the same on either device.
    model = load_predictor(tmp_path / "gpu")
    on_cpu = evaluate_model(model, s.train, s.test, progress=False)["model"]["mae"]
    on_gpu = evaluate_model(model.to("cuda"), s.train, s.test, progress=False)["model"]["mae"]
    assert abs(on_cpu - on_gpu) < 1.0
