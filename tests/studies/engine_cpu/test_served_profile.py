"""The served-profile split: samples by function name (never by library
file name), under the compute thread's root only, into ms an iteration from
the window's tokens a second."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from studies.engine_cpu.vllm_cpu.served_profile import OURS, VLLM, system

LIB = "(preempt_serve_paged_decode_avx512_bf16_amx.so)"


def _raw(path: Path, stacks: dict[str, int]) -> Path:
    path.write_text("".join(f"{s} {n}\n" for s, n in stacks.items()))
    return path


def _bench(path: Path) -> Path:
    # Two requests running from 0 to 20 s, one token a second each in
    # [10, 20): 2 tokens a second, so an iteration of 1 s.
    records = [{"send_time": 0.0, "end_time": 20.0, "prompt_tokens": 100,
                "token_times": [float(t) for t in range(1, 20)]} for _ in range(2)]
    path.write_text(json.dumps({"summary": {"output_token_throughput": 2.0},
                                "records": records}))
    return path


def test_ours_split_by_function_name(tmp_path: Path) -> None:
    loop = "Thread.run (threading.py:1);EngineLoop._iterate (deployments/engine_loop.py:2)"
    raw = _raw(tmp_path / "ours.txt", {
        f"{loop};preempt_serve_amx::decode<64> {LIB}": 40,
        f"{loop};packed_linear (engine/models/prepacked.py:9);mkldnn::_linear_pointwise x": 30,
        f"{loop};(anonymous namespace)::silu_mul {LIB}": 10,
        f"{loop};LlamaForCausalLM.forward (engine/models/llama.py:1)": 20,
        "Thread.run (threading.py:1);_worker (x.py:1)": 500,  # another thread
    })
    out = system(raw, _bench(tmp_path / "b.json"), OURS, 10.0, 20.0)
    assert out["samples"] == 100
    # silu_mul lives in the decode operator's library, and is not attention.
    assert out["share"] == {"attention": 0.4, "linear": 0.3, "other": 0.2, "silu x up": 0.1}
    assert out["step_ms"] == pytest.approx(1000.0)
    assert out["ms_per_step"]["attention"] == pytest.approx(400.0)
    assert out["running_mean"] == 2.0


def test_vllm_root_is_the_model_runner(tmp_path: Path) -> None:
    run = "WorkerProc.worker_busy_loop (w.py:1);GPUModelRunner.execute_model (r.py:2)"
    raw = _raw(tmp_path / "vllm.txt", {
        f"{run};cpu_attention::AttentionImpl<x> (_C.so)": 3,
        f"{run};Runner.call (c.py:1);0x7f00 (libdnnl.so)": 1,  # an unnamed frame: other
        "TMonitor.run (t.py:1);Event.wait (t.py:2)": 50,
    })
    out = system(raw, _bench(tmp_path / "b.json"), VLLM, 10.0, 20.0)
    assert out["samples"] == 4
    assert out["share"] == {"attention": 0.75, "other": 0.25}
