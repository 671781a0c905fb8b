"""`ModelRunner`: executes one scheduler `Plan` per call on one device.

It owns the model, the paged KV cache, the sampler and the per-request
state.  Each `execute` runs all of the plan's chunks as one flattened batch
through one forward pass (decodes first, then prefill chunks), samples the
chunks that reach their sequence's last known token, applies the stop
conditions the engine owns (EOS, stop tokens, stop strings, max_tokens) and
returns one `JobOutput` per chunk, with the logprobs the request asked for:
those of its sampled tokens and of its prompt tokens (computed chunk by chunk
from the prefill's extra logits rows, delivered with the first sampled token).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from transformers import AutoConfig, PreTrainedTokenizerBase

from engine.attention import default_backend_name, get_attention_backend
from engine.attention_cpp import prefill_vectorized
from engine.detokenizer import IncrementalDetokenizer, warm_up
from engine.dtypes import parse_dtype
from engine.kv_cache import KVCache
from engine.length_head import first_token_lengths, first_token_rows, load_head
from engine.lora import load_adapters
from engine.lora_pool import AdapterPool
from engine.speculative import speculative_output
from engine.model_source import resolve_model
from engine.models import model_class
from engine.models.base import fixed_tiles
from engine.models.linear import linear_for
from engine.models.prepacked import PackMode
from engine.pipeline_parallel import SINGLE_STAGE, PipelineStage
from engine.preemption import ForwardPreempted, PreemptFlag, SharedPreemptFlag
from engine.request import RequestState
from engine.sampling import Sampler
from engine.sampling_params import SamplingParams
from engine.prepared import PreparedStep
from engine.runner_prepare import Pending, PlanPreparing, plain_greedy
from engine.runner_shards import ShardDriving
from engine.shards import ShardGroup, ShardTier, SwapsInFlight
from engine.step_logprobs import record_prompt_logprobs, sampled_logprobs
from engine.structured import GrammarCompiler
from engine.swapper import BlockSwapper, HostKVTier
from engine.tensor_parallel import SINGLE, TensorParallel
from engine.threads import pin_threads
from engine.tokenizer import eos_token_ids, load_tokenizer
from engine.weights import iter_weights
from scheduler.plan import BlockOpKind, JobOutput, Plan, StepResult, TokenLogprob

if TYPE_CHECKING:
    from engine.cuda_graphs import DecodeGraphs
    from engine.cuda_graphs_mixed import MixedGraphs


class ModelRunner(PlanPreparing, ShardDriving):
    def __init__(
        self,
        model_path: str | Path,
        dtype: str = "float32",
        device: str = "cpu",
        num_blocks: int = 1024,
        block_size: int = 16,
        max_model_len: int = 2048,
        num_threads: int | None = None,
        attention_backend: str | None = None,
        seed: int | None = None,
        deterministic: bool | Literal["auto"] = False,
        cuda_graph_max_batch: int = 0,
        cuda_graph_max_tokens: int = 0,
        pack_projections: PackMode = "auto", weight_codes: bool = True,
        tensor_parallel: TensorParallel = SINGLE,
        pipeline: PipelineStage = SINGLE_STAGE,
        length_head: str | Path | None = None,
        lora_adapters: dict[str, str] | None = None, max_lora_loaded: int = 8,
    ) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if pack_projections not in get_args(PackMode):
            raise ValueError(f"pack_projections must be one of {get_args(PackMode)}, "
                             f"got {pack_projections!r}")
        # Before anything runs a kernel: the thread pool is sized on first use.
        self.num_threads = pin_threads(num_threads)
        self.model_path = resolve_model(str(model_path))
        self.dtype = parse_dtype(dtype)
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_model_len = max_model_len

        self.config: Any = AutoConfig.from_pretrained(str(self.model_path), local_files_only=True)
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(self.model_path)
        warm_up(self.tokenizer)  # the byte-level table, before any request
        self.eos_token_ids: set[int] = eos_token_ids(self.model_path, self.tokenizer, self.config)

        # With tensor parallelism this runner holds one shard of the model
        # and of the KV cache (engine/tensor_parallel.py), with pipeline
        # parallelism one stage's layers of them (engine/pipeline_parallel.py);
        # the runner of global rank 0 drives the others (`attach_shards`).
        self.tp, self.pp = tensor_parallel, pipeline
        self.world = self.tp.size * self.pp.size
        self.rank = self.pp.stage * self.tp.size + self.tp.rank
        if self.world > 1 and cuda_graph_max_batch > 0:
            raise ValueError("CUDA graphs are not available with tensor or pipeline "
                             "parallelism; set cuda_graph_max_batch to 0")
        cls = model_class(self.config.model_type)
        with torch.no_grad():
            self.model = cls(self.config, self.dtype, self.device, max_model_len,
                             tp=self.tp, pp=self.pp)
            self.model.load_weights(iter_weights(self.model_path), keep_codes=weight_codes
                                    and self.model.codes_wanted(pack_projections))
        self.model.eval()
        # LoRA adapters (engine/lora.py): never on packed weights, tiled as the rest.
        self.adapters = AdapterPool(self.model, load_adapters(
            lora_adapters or {}, self.model, self.world), max_lora_loaded)
        self.lora_linear = linear_for(self.dtype, self.device)
        # On CPU: weights packed for our GEMMs (engine.models.packed_*) or oneDNN's, before tiles.
        with torch.no_grad():
            self.packing_speedup = self.model.pack_projections(pack_projections, weight_codes)
        backend_name = attention_backend or default_backend_name(self.device)
        if deterministic == "auto":  # where it costs nothing (README, "Deterministic mode")
            group = self.model.num_heads // self.model.num_kv_heads
            deterministic = (self.model.packing in ("bf16_dot", "f32_fma")  # untiled GEMMs
                             and backend_name == "cpp"  # prompts on the vector operator
                             and prefill_vectorized(self.model.head_dim, group))
        backend = get_attention_backend(backend_name)
        self.attn = backend(
            self.model.num_heads, self.model.num_kv_heads, self.model.head_dim,
            block_size, self.device, deterministic=deterministic, dtype=self.dtype,
        )
        # Batch-invariant execution: every reduction a token's result goes
        # through runs in an order fixed by that token alone (fixed-shape
        # GEMM tiles here, per-query attention in the backend).
        self.deterministic = bool(deterministic)
        if deterministic:
            self.model.use_fixed_tiles(self.device)
            self.lora_linear = fixed_tiles(self.lora_linear, self.device)
        self.model.set_attention_backend(self.attn)
        self.kv_cache = KVCache(
            self.model.num_layers, num_blocks, block_size, self.model.num_kv_heads,
            self.model.head_dim, self.dtype, self.device, self.attn.kv_layout,
        )
        # Decode-only steps of up to `cuda_graph_max_batch` requests replay
        # CUDA graphs (engine/cuda_graphs.py), and so do mixed steps of up to
        # `cuda_graph_max_tokens` tokens (engine/cuda_graphs_mixed.py; not in
        # deterministic mode): CUDA with the Triton backend only.
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        if cuda_graph_max_batch > 0:
            if self.attn.name != "triton":
                raise ValueError("CUDA graphs need the 'triton' attention backend, not "
                                 f"{self.attn.name!r}")
            from engine import cuda_graphs, cuda_graphs_mixed

            # One memory pool: a step replays one graph at a time.
            pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
            if cuda_graph_max_tokens > 1 and not deterministic:
                # Captured first: the largest activations.
                self.mixed_graphs = cuda_graphs_mixed.MixedGraphs(
                    self.model, self.kv_cache, self.attn, cuda_graph_max_batch,
                    cuda_graph_max_tokens, max_model_len, pool)
            self.graphs = cuda_graphs.DecodeGraphs(
                self.model, self.kv_cache, self.attn, cuda_graph_max_batch, max_model_len,
                pool)
        self.sampler = Sampler(seed=seed, device=self.device, warm_vocab=self.vocab_size)
        # Answer lengths estimated at first tokens (engine/length_head.py).
        self.length_head = None if length_head is None else load_head(
            length_head, self.config.hidden_size, self.pp.enabled, self.device)
        self._requests: dict[str, RequestState] = {}
        self.swapper: BlockSwapper | None = None
        # How long an iteration with no chunks waits for a swap-in to land
        # (so that a loop with nothing runnable does not spin).
        self.swap_wait_s = 0.05
        # Set from another thread to cut a pass the plan marks preemptible
        # between layers (ConServe §4.3; engine/preemption.py); with tensor
        # parallelism every shard stops at the same layer.
        # Pipeline stages are not cut (the flag is never armed there).
        self.preempt_flag: PreemptFlag = (
            SharedPreemptFlag(self.tp, self.device) if self.tp.enabled and not self.pp.enabled
            else PreemptFlag())
        # The other shards, on global rank 0 of a split model.
        self.shards: ShardGroup | None = None
        self._swaps = SwapsInFlight(self.world)
        # The preemptible pass under way, and when it started.
        self.running_pass: tuple[Plan, float] | None = None
        # Leave the text of requests without stop strings to be decoded by
        # whoever delivers it (`JobOutput.text_later`), and call `on_launch`
        # once per `execute` where the host would otherwise wait: on a GPU
        # after the pass and its sampling are queued, before the sampled ids
        # are read; on a CPU, whose pass runs on the calling thread, before
        # it.  The replica's loop decodes and delivers the previous
        # iteration's tokens there, so that on a GPU they cost no device time.
        self.defer_text = False
        self.on_launch: Callable[[], None] | None = None
        self._launch_due = False
        # The launched plan not yet collected, and when the last pass's
        # sampled ids were read (scheduler/ahead.py keeps one in flight).
        self._in_flight: Pending | None = None
        # Imports xgrammar on the first structured request.
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._landed = 0.0

    # KV tier --------------------------------------------------------------

    def set_kv_tier(self, tier: HostKVTier) -> None:
        """Enable SWAP_OUT / SWAP_IN / CHECKPOINT / DROP block ops through
        `tier` (e.g. `kvstore.tier.ObjectStoreTier`); a tensor-parallel
        shard stores its slice of each block under its own key."""
        if self.world > 1:
            tier = ShardTier(tier, self.rank, self.world)  # type: ignore[assignment]
        self.swapper = BlockSwapper(self.kv_cache, tier)

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block over all layers, K and V, over every
        tensor-parallel shard and pipeline stage (host tier sizing)."""
        per_layer = self.kv_cache.bytes_per_block // self.model.num_layers
        return per_layer * self.config.num_hidden_layers * self.tp.size

    # Model facts for the ingress ------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Width of the logits (the vocabulary, maybe padded past the tokenizer's)."""
        return self.model.vocab_size

    # Requests ---------------------------------------------------------------

    def add_request(self, job_id: str, params: SamplingParams, prompt_token_ids: list[int],
                    output_token_ids: list[int] | None = None) -> None:
        """Register a request before its first chunk is scheduled.

        `output_token_ids` resumes a request whose tokens were produced
        elsewhere (migration): their text counts as already streamed.
        """
        if job_id in self._requests:
            raise ValueError(f"request {job_id!r} is already registered")
        if not prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        outputs = list(output_token_ids or [])
        out_of_vocab = [t for t in params.named_token_ids() if t >= self.vocab_size]
        if out_of_vocab:
            raise ValueError(f"token ids {out_of_vocab} (logit_bias, allowed_token_ids, bad "
                             f"words) are outside the vocabulary (size {self.vocab_size})")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        grammar = (None if params.structured is None
                   else self.grammars.start(params.structured, outputs))
        lora = self.adapters.acquire(params)
        self._requests[job_id] = RequestState(
            job_id=job_id, params=params, prompt_token_ids=list(prompt_token_ids),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, list(prompt_token_ids) + outputs, params.stop,
                params.skip_special_tokens, params.include_stop_str_in_output),
            stop_token_ids=frozenset(stop_ids), output_token_ids=outputs, grammar=grammar,
            lora=lora)

    def remove_request(self, job_id: str) -> None:
        """Forget a finished or aborted request (unknown ids are ignored).

        A swap-in still in flight for it is abandoned: the scheduler may hand
        its device blocks to another job at once.
        """
        self._requests.pop(job_id, None)
        if self.swapper is not None:
            self.swapper.forget(job_id)
        if self.shards is not None:
            self._swaps.forget(job_id)
            self.shards.forget(job_id)

    def has_request(self, job_id: str) -> bool:
        return job_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # Iteration ------------------------------------------------------------

    def _forward(self, plan: Plan, batch: Any) -> torch.Tensor:
        """The model's forward pass; for a plan the scheduler marked
        `preemptible_at_layers`, cut between layers (`ForwardPreempted`)
        once `preempt_flag` is set, even if it was set before the pass."""
        # A request that set the flag during a pass that may not be cut is
        # in the next plan anyway: the flag is spent either way.
        self.model.preempt = self.preempt_flag if plan.preemptible_at_layers else None
        if plan.preemptible_at_layers:
            # Read by the replica's request thread to decide a cut.
            self.running_pass = (plan, time.monotonic())
        try:
            return self.model(batch, self.kv_cache)
        finally:
            self.model.preempt = None
            self.running_pass = None
            self.preempt_flag.clear()

    def execute(self, plan: Plan) -> StepResult:
        """Run one iteration: all chunks in one forward pass, then sampling.

        Returns one `JobOutput` per chunk, in plan order: the sampled token,
        its text delta (or, with `defer_text`, for a request without stop
        strings, the call that decodes it) and the finish reason ("stop" /
        "length") for sampling chunks; `token_id=None` for a prefill chunk
        that does not reach the end of its prompt.  `iteration_time` covers batch
        preparation, the forward pass and sampling.

        Block ops run first, in order (swap-outs copy their blocks before the
        forward pass can overwrite them).  Swap-ins that have landed by the
        end of the iteration are reported in `swaps_in_done`; a plan with no
        chunks waits up to `swap_wait_s` for one.

        `on_launch`, if set, runs once, whatever happens (see `__init__`);
        its time is not part of `iteration_time`.
        """
        return self.collect(self.launch(plan))

    def launch(self, plan: Plan) -> Pending:
        """`execute`'s first half: block ops, the pass and sampling queued
        (on a CPU, run), the sampled ids' copy to the host queued; returns
        the handle `collect` takes.  A plan made while another is in flight
        (scheduler/ahead.py) reads that one's sampled ids on the device
        where its decode chunks hold `PENDING_TOKEN`."""
        self._launch_due = self.on_launch is not None
        try:
            return self._launch(plan)
        except BaseException:
            self._launched()
            raise

    def collect(self, pending: Pending) -> StepResult:
        """`execute`'s second half: wait for `pending`'s sampled ids (running
        `on_launch` meanwhile) and apply them to the requests.  The token of
        a request removed since its launch is dropped."""
        try:
            return self._collect(pending)
        finally:
            if self._in_flight is pending:
                self._in_flight = None
            self._launched()

    def _launched(self) -> float:
        """Run `on_launch` if this `execute` has not yet; returns its seconds."""
        if not self._launch_due or self.on_launch is None:
            return 0.0
        self._launch_due = False
        t = time.perf_counter()
        self.on_launch()
        return time.perf_counter() - t

    def _launch(self, plan: Plan) -> Pending:
        if self.device.type != "cuda":
            self._launched()  # the pass would hold this thread
        for job_id in plan.preempted:
            # The request's state (outputs, detokenizer, seed position)
            # stays for when its KV is recomputed or swapped back in.
            state = self._requests.get(job_id)
            if state is not None:
                state.num_preemptions += 1
        if plan.block_ops and self.swapper is None \
                and any(op.kind is not BlockOpKind.DROP for op in plan.block_ops):
            kinds = sorted({op.kind.value for op in plan.block_ops})
            raise NotImplementedError(f"block ops {kinds} need a host KV tier: call "
                                      "set_kv_tier() first")
        started = time.perf_counter()
        prepared = self._prepare(plan) if plan.chunks else None
        self._launch_shards(plan, prepared, 0.0 if plan.chunks else self.swap_wait_s)
        if self.swapper is not None:
            self.swapper.order_after_copies()
            if plan.block_ops:
                self.swapper.apply(plan.block_ops)
        if prepared is None:
            self._launched()  # before waiting for a swap-in
            done, failed = self._poll_swaps(self.swap_wait_s)
            return Pending(plan, None, started, result=StepResult(
                plan.step, [], 0.0, swaps_in_done=done, swaps_in_failed=failed))
        sampled = prepared.sampled
        pending = Pending(plan, prepared, started)
        with torch.inference_mode():
            try:
                logits = self._logits(plan, prepared, pending)
            except ForwardPreempted:
                done, failed = self._poll_swaps(0.0)
                pending.result = StepResult(
                    plan.step, [], time.perf_counter() - started, swaps_in_done=done,
                    swaps_in_failed=failed, interrupted=True)
                return pending
            if logits is not None:
                rows, sampler = logits[: len(sampled) + prepared.num_verify], self.sampler
                tokens = (sampler.greedy_tensor(rows, pending.exact) if plain_greedy(sampled)
                          else sampler.sample_tensor(rows, self._sample_requests(sampled),
                                                     exact=pending.exact))
                pending.tokens, pending.logits = tokens, logits
                pending.reads_logits = bool(prepared.prompt_rows) or any(
                    s.params.logprobs is not None for _, s in sampled)
                pending.rows = {c.job_id: i for i, (c, _) in enumerate(sampled)}
                if tokens.device.type == "cuda":
                    pending.copy_to_host(tokens)
        self._in_flight = pending
        return pending

    def _collect(self, pending: Pending) -> StepResult:
        if pending.result is not None:
            return pending.result
        prepared, plan = pending.prepared, pending.plan
        assert prepared is not None
        sampled = prepared.sampled
        tokens, aside = self._host_tokens(pending)
        logprobs: dict[int, TokenLogprob] = {}
        if pending.logits is not None and pending.reads_logits:
            with torch.inference_mode():
                logprobs = sampled_logprobs(pending.logits[: len(sampled)], sampled, tokens)
                record_prompt_logprobs(pending.logits[len(sampled) + prepared.num_verify:],
                                       prepared.prompt_rows)
        landed = time.perf_counter()
        # From launch, or from the previous pass's landing where this one
        # was queued behind it: this pass's own share of the device.
        iteration_time = landed - max(pending.started, self._landed) - aside
        self._landed = landed

        results: dict[str, JobOutput] = {}
        lengths = pending.head_lengths()
        later = self.defer_text
        requests = self._requests
        for i, ((chunk, state), token) in enumerate(zip(sampled, tokens)):
            if requests.get(chunk.job_id) is not state:
                continue  # ended (or aborted) while this pass was in flight
            if chunk.draft:
                at = len(sampled) + prepared.verify[i]
                results[chunk.job_id] = speculative_output(
                    chunk, state, tokens[at:at + chunk.draft], token, self.max_model_len,
                    later and state.text_can_wait)
                continue
            prompt_lps = state.take_prompt_logprobs() if chunk.output_index == 0 else None
            text, decode = "", None
            if later and state.text_can_wait:
                decode, reason = state.append_later(token, self.max_model_len)
            else:
                text, reason = state.append(token, self.max_model_len)
            results[chunk.job_id] = JobOutput(
                chunk.job_id, token, reason, text, logprobs.get(i), prompt_lps,
                text_later=decode, predicted_output_len=lengths.get(chunk.job_id),
                stop_reason=state.stop_reason)
        outputs = [results.get(c.job_id) or JobOutput(c.job_id, None) for c in plan.chunks]
        done, failed = self._poll_swaps(0.0)
        return StepResult(
            plan.step, outputs, iteration_time, swaps_in_done=done, swaps_in_failed=failed,
            copy_rate=self.swapper.copy_rate.rate if self.swapper is not None else None,
        )

    def _logits(self, plan: Plan, prepared: PreparedStep,
                pending: Pending | None = None) -> torch.Tensor | None:
        """The pass and the lm_head: logits (`CausalLM.vocab_logits`) of the rows
        in `prepared.logits_indices` (None where no row is wanted).  A decode
        step that fits a captured bucket replays its graph, and so does a mixed
        step that fits a bucket of the mixed graphs.  Length head estimates go
        to `pending.lengths`, from the graphs' hidden rows where a graph ran."""
        graphs, mixed = self.graphs, self.mixed_graphs
        head = self.length_head  # read once: `reconfigure` may replace it
        firsts = first_token_rows(head, prepared.sampled)
        if graphs is not None and not (plan.preemptible_at_layers or prepared.prompt_rows
                                       or prepared.lora_rows or prepared.num_verify):
            replayed = graphs.replay_step(prepared, mixed, self._fill)
            if replayed is not None:
                self.preempt_flag.clear()  # as after any pass that may not be cut
                logits, hidden = replayed
                if firsts and pending is not None and head is not None:
                    # Queued behind the replay, before the next one reuses its output.
                    pending.lengths = first_token_lengths(head, hidden, prepared.sampled, firsts)
                return logits if prepared.logits_indices else None
        if self.pp.enabled:
            assert not prepared.fill_rows, "pipeline stages do not run a pass ahead"
            self.preempt_flag.clear()  # stages are not cut
            return self._pipeline_pass(prepared)
        hidden = self._forward(plan, self._forward_batch(prepared))
        if not prepared.logits_indices:
            return None
        if firsts and pending is not None and head is not None:
            pending.lengths = first_token_lengths(head, hidden, prepared.sampled, firsts)
        logits = self.model.compute_logits(hidden)
        if pending is not None:
            pending.exact = self.model.exact_source(hidden, logits)
        return logits

    def logits(self, plan: Plan) -> torch.Tensor:
        """Float32 logits `[sampling chunks, vocab]` of `plan`, in plan order:
        the pass runs (writing the chunks' K/V) but nothing is sampled or
        recorded in any request's state (for tests and profiling)."""
        prepared = self._prepare(plan)
        self._launch_shards(None, prepared)
        with torch.inference_mode():
            logits = self._logits(plan, prepared)
        if self.shards is not None:
            self.shards.finish()
        assert logits is not None, "the plan samples no chunk"
        row = {c.job_id: i for i, (c, _) in enumerate(prepared.sampled)}
        return logits[[row[c.job_id] for c in plan.chunks if c.sample]].float()
