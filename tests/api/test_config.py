"""Application config: a bad value fails at start with the field named."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from api.config import AppConfig
from scheduler.config import SchedulerConfig, SchedulingSettings


def test_predictor_runs_on_cpu_by_default() -> None:
    p = AppConfig().predictor
    assert (p.device, p.num_gpus) == ("cpu", 0.0)


def test_predictor_on_cuda_takes_a_gpu_share() -> None:
    p = AppConfig(predictor={"enabled": True, "device": "cuda", "num_gpus": 0.1}).predictor
    assert (p.device, p.num_gpus) == ("cuda", 0.1)
    with pytest.raises(ValidationError, match=r"predictor\.num_gpus: must be > 0"):
        AppConfig(predictor={"enabled": True, "device": "cuda"})
    with pytest.raises(ValidationError, match=r"predictor\.num_gpus: a GPU share needs"):
        AppConfig(predictor={"num_gpus": 0.5})
    with pytest.raises(ValidationError, match="device"):
        AppConfig(predictor={"device": "tpu"})


def test_engine_length_head_is_checked_at_start(tmp_path: Path) -> None:
    cfg = AppConfig(predictor={"engine_head": "embedded", "padding_ratio": 0.3})
    assert cfg.scheduler_config().length_padding_ratio == 0.3
    with pytest.raises(ValidationError, match=r"predictor\.engine_head[\s\S]*no such file"):
        AppConfig(predictor={"engine_head": str(tmp_path / "none.pt")})
    with pytest.raises(ValidationError, match="engine_head: not available with pipeline"):
        AppConfig(predictor={"engine_head": "embedded"}, pipeline_parallel_size=2)


def test_predicted_settings_need_something_that_predicts() -> None:
    # Without predictions each would act as its default, unannounced.
    with pytest.raises(ValidationError, match=r"mlfq\.skip_join: 'predicted' needs predictor"):
        AppConfig(policy="mlfq", mlfq={"skip_join": "predicted"})
    with pytest.raises(ValidationError, match=r"mlfq\.skip_join"):  # the head comes too late
        AppConfig(policy="mlfq", mlfq={"skip_join": "predicted"},
                  predictor={"engine_head": "embedded"})
    for section in ({"mlfq": {"enst": "predicted"}},
                    {"conserve": {"offline_admission": "predicted"}}):
        field = ".".join([*section, *next(iter(section.values()))])
        with pytest.raises(ValidationError, match=rf"{field}: 'predicted' needs predictions"):
            AppConfig(**section)
        for source in ({"enabled": True}, {"engine_head": "embedded"}):
            AppConfig(**section, predictor=source)
    AppConfig(policy="mlfq", mlfq={"skip_join": "predicted", "enst": "predicted"},
              predictor={"enabled": True})


def test_scheduler_fields_are_the_schedulers_own() -> None:
    # One statement of each scheduling field: the same bounds refuse the
    # same values in the application's config and in the scheduler's.
    base = {"num_blocks": 4096}
    for field, bad in (("block_size", 257), ("max_batch_size", 4097), ("max_batch_tokens", 0),
                       ("max_model_len", 1), ("swap_mode", "never"), ("reserve_blocks", -1),
                       ("policy", "nope"), ("mlfq", {"quantum_ratio": 1.0})):
        for build in (lambda: AppConfig(**{field: bad}),
                      lambda: SchedulerConfig(**base, **{field: bad})):
            with pytest.raises(ValidationError, match=field):
                build()
    cfg = AppConfig(policy="mlfq", block_size=32, kv_cache_tokens=4100, max_model_len=1024,
                    swap_mode="proactive", host_kv_tokens=100, mlfq={"num_queues": 4})
    sc = cfg.scheduler_config()
    assert (sc.num_blocks, sc.host_kv_blocks) == (128, 3)
    assert {k: getattr(sc, k) for k in SchedulingSettings.model_fields} == {
        k: getattr(cfg, k) for k in SchedulingSettings.model_fields}


def test_a_pinned_iteration_cost_is_the_cost_model_and_bad_figures_are_named() -> None:
    assert AppConfig().iteration_cost is None
    pin = {"base_s": 0.012, "prefill_per_token_s": 0.003, "decode_per_seq_s": 0.004,
           "decode_base_s": 0.011}
    cost = AppConfig(iteration_cost=pin).iteration_cost.cost()
    assert (cost.prefill_time(100), cost.decode_time(8)) == pytest.approx((0.312, 0.043))
    for field, bad in (("base_s", 0.0), ("prefill_per_token_s", -1e-3),
                       ("decode_base_s", 0.0), ("decode_per_seq", 0.004)):
        with pytest.raises(ValidationError, match=rf"iteration_cost\.{field}"):
            AppConfig(iteration_cost={**pin, field: bad})
    with pytest.raises(ValidationError, match=r"iteration_cost\.base_s"):
        AppConfig(iteration_cost={"prefill_per_token_s": 0.003, "decode_per_seq_s": 0.004})


def test_a_cache_too_small_names_kv_cache_tokens() -> None:
    with pytest.raises(ValidationError, match=r"kv_cache_tokens: .*max_model_len = 2048"):
        AppConfig(kv_cache_tokens=2000)
    with pytest.raises(ValidationError, match=r"kv_cache_tokens \(num_blocks = 0\)"):
        AppConfig(kv_cache_tokens=16, block_size=32, max_model_len=16)


def test_batch_files_live_under_the_cache_unless_placed(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    monkeypatch.setenv("PREEMPT_SERVE_CACHE", str(tmp_path))
    assert AppConfig().batch.storage_path() == tmp_path / "batches"
    placed = AppConfig(batch={"storage_dir": "~/shared/batches"}).batch
    assert placed.storage_path() == Path("~/shared/batches").expanduser()
    for field, bad in (("max_concurrency", 0), ("max_file_bytes", 10), ("storage", "x")):
        with pytest.raises(ValidationError, match=field):
            AppConfig(batch={field: bad})


def test_attention_backend_is_checked_against_the_device() -> None:
    assert AppConfig().attention_backend == "auto"
    assert AppConfig(attention_backend="torch", device="cuda").attention_backend == "torch"
    for cpu_only in ("compiled", "cpp"):
        with pytest.raises(ValidationError, match=f"attention_backend '{cpu_only}' is a CPU backend"):
            AppConfig(attention_backend=cpu_only, device="cuda")
    assert AppConfig(attention_backend="triton", device="cuda").attention_backend == "triton"
    with pytest.raises(ValidationError, match="attention_backend 'triton' runs on device cuda"):
        AppConfig(attention_backend="triton")
    with pytest.raises(ValidationError, match="attention_backend"):
        AppConfig(attention_backend="flash")


def test_pack_projections_is_checked() -> None:
    assert AppConfig().pack_projections == "auto"
    assert AppConfig(pack_projections="always").pack_projections == "always"
    assert AppConfig(pack_projections="never", device="cuda").pack_projections == "never"
    with pytest.raises(ValidationError, match="pack_projections 'always' packs CPU"):
        AppConfig(pack_projections="always", device="cuda")
    assert AppConfig(pack_projections="bf16_dot").pack_projections == "bf16_dot"
    with pytest.raises(ValidationError, match="pack_projections 'bf16_dot' packs CPU"):
        AppConfig(pack_projections="bf16_dot", device="cuda")
    with pytest.raises(ValidationError, match="pack_projections"):
        AppConfig(pack_projections="yes")


def test_cuda_graphs_follow_the_device_and_backend() -> None:
    from deployments.engine import _graph_limits

    def captured(**kw: object) -> tuple[int, int]:
        cfg = AppConfig(**kw)
        return _graph_limits(cfg, cfg.scheduler_config())

    assert captured(device="cuda", max_batch_size=48, max_batch_tokens=1024) == (48, 1024)
    assert captured(device="cuda", attention_backend="triton", max_batch_size=8,
                    max_batch_tokens=256, policy="conserve",
                    conserve={"offline_max_batch_size": 64,
                              "offline_max_batch_tokens": 2048}) == (64, 2048)
    assert captured(device="cuda", cuda_graphs=False) == (0, 0)
    assert captured(device="cuda", attention_backend="torch") == (0, 0)
    assert captured() == (0, 0)  # cpu


def test_deterministic_mode_needs_a_batch_invariant_backend() -> None:
    # `auto`: the runner decides (on where it costs nothing), with any backend.
    assert AppConfig().deterministic == "auto"
    assert AppConfig(attention_backend="torch").deterministic == "auto"
    assert AppConfig(deterministic=False, attention_backend="torch").deterministic is False
    with pytest.raises(ValidationError, match="deterministic"):
        AppConfig(deterministic="sometimes")
    assert AppConfig(deterministic=True).deterministic is True
    assert AppConfig(deterministic=True, attention_backend="cpp").deterministic is True
    assert AppConfig(deterministic=True, device="cuda").deterministic is True
    assert AppConfig(deterministic=True, device="cuda",
                     attention_backend="triton").deterministic is True
    for backend in ("torch", "compiled"):
        with pytest.raises(ValidationError,
                           match=f"deterministic: true needs attention_backend 'cpp' or "
                                 f"'auto', not '{backend}'"):
            AppConfig(deterministic=True, attention_backend=backend)
    with pytest.raises(ValidationError, match="needs attention_backend 'triton' or 'auto'"):
        AppConfig(deterministic=True, device="cuda", attention_backend="torch")


def test_the_per_queue_wait_needs_skip_join_mlfq_and_the_estimate() -> None:
    assert AppConfig().admission.per_queue_wait is False
    assert AppConfig(policy="mlfq", admission={"per_queue_wait": True}).admission.per_queue_wait
    for bad in ({"policy": "fcfs", "admission": {"per_queue_wait": True}},
                {"policy": "mlfq", "admission": {"per_queue_wait": True,
                                                 "max_queued_tokens": 512}}):
        with pytest.raises(ValidationError, match="admission.per_queue_wait: needs policy"):
            AppConfig(**bad)


def test_engine_cpu_ids_name_distinct_cores_for_one_replica() -> None:
    assert AppConfig().engine_cpu_ids == "auto"
    assert AppConfig(engine_cpu_ids=None).engine_cpu_ids is None
    assert AppConfig(engine_cpu_ids=[0]).engine_cpu_ids == [0]
    # "auto" leaves several replicas unpinned rather than refusing them.
    assert AppConfig(num_engine_replicas=2).engine_cpu_ids == "auto"
    for bad in ([], [1, 1], [-1], "all", "0"):
        with pytest.raises(ValidationError, match="engine_cpu_ids"):
            AppConfig(engine_cpu_ids=bad)
    with pytest.raises(ValidationError, match="engine_cpu_ids pins every engine replica"):
        AppConfig(engine_cpu_ids=[0], num_engine_replicas=2)


def test_tensor_parallel_shards_each_take_a_bundle() -> None:
    from app.builder import engine_bundles

    cfg = AppConfig(tensor_parallel_size=3, engine_num_cpus=0.5)
    assert engine_bundles(cfg) == [{"CPU": 0.5}] * 3
    assert engine_bundles(AppConfig(device="cuda", tensor_parallel_size=2)) == [
        {"CPU": 1.0, "GPU": 1.0}] * 2
    assert len(engine_bundles(AppConfig(tensor_parallel_size=2, pipeline_parallel_size=2))) == 4
    with pytest.raises(ValidationError, match="engine_cpu_ids pins the first shard only"):
        AppConfig(tensor_parallel_size=2, engine_cpu_ids=[0])
    with pytest.raises(ValidationError, match="tensor_parallel_size"):
        AppConfig(tensor_parallel_size=0)


def test_async_scheduling_is_on_for_one_gpu_process_only() -> None:
    assert not AppConfig().schedules_ahead  # cpu
    assert AppConfig(device="cuda").schedules_ahead
    assert not AppConfig(device="cuda", tensor_parallel_size=2).schedules_ahead
    assert not AppConfig(device="cuda", async_scheduling=False).schedules_ahead
    assert AppConfig(async_scheduling=True).schedules_ahead
    with pytest.raises(ValidationError, match="async_scheduling: true runs one model process"):
        AppConfig(async_scheduling=True, pipeline_parallel_size=2)
    with pytest.raises(ValidationError, match="async_scheduling"):
        AppConfig(async_scheduling="sometimes")


def test_autoscaling_starts_within_its_bounds_under_our_policy() -> None:
    from app.builder import engine_scaling

    assert engine_scaling(AppConfig(num_engine_replicas=2)) == {"num_replicas": 2}
    scaled = engine_scaling(AppConfig(autoscaling={"enabled": True, "max_replicas": 3},
                                      num_engine_replicas=2))
    auto = scaled["autoscaling_config"]
    assert (auto["min_replicas"], auto["initial_replicas"], auto["max_replicas"]) == (1, 2, 3)
    assert auto["policy"]["policy_function"] == "deployments.autoscaling:EnginePolicy"
    assert auto["policy"]["policy_kwargs"]["upscale_at"] == 0.5
    with pytest.raises(ValidationError, match="num_engine_replicas \\(4\\) is where autoscaling"):
        AppConfig(autoscaling={"enabled": True, "max_replicas": 3}, num_engine_replicas=4)
    with pytest.raises(ValidationError, match="engine_cpu_ids pins every engine replica"):
        AppConfig(autoscaling={"enabled": True, "max_replicas": 2}, engine_cpu_ids=[0])
    with pytest.raises(ValidationError, match="autoscaling.upscale_at"):
        AppConfig(autoscaling={"upscale_at": 2})
    with pytest.raises(ValidationError, match="autoscaling.nope|nope"):
        AppConfig(autoscaling={"nope": 1})


def test_a_host_tier_too_small_for_survival_checkpoints_is_advised_against() -> None:
    small = AppConfig(kv_cache_tokens=4096, host_kv_tokens=4096, survival={"checkpoint": True})
    (advice,) = small.advice()
    assert "host_kv_tokens (4096)" in advice and "kv_cache_tokens (4096)" in advice
    assert AppConfig(kv_cache_tokens=4096, host_kv_tokens=8192,
                     survival={"checkpoint": True}).advice() == []
    # Without survival checkpoints the host tier holds preempted requests only.
    assert AppConfig(kv_cache_tokens=4096, host_kv_tokens=4096).advice() == []
