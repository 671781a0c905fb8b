"""What live and simulated commands build from their arguments: the
workload (`_workload_spec`, ShareGPT pools loaded once by `_PoolCache`) and
the load client's configuration (`_client_config`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from bench.dataset import LengthFilter, ShareGPTPool, load_pool
from bench.workload import (
    ArrivalSpec,
    LengthSpec,
    StreamSpec,
    Workload,
    WorkloadSpec,
    build_workload,
)


def _workload_spec(a: argparse.Namespace) -> WorkloadSpec:
    if a.workload_spec is not None:
        data = json.loads(a.workload_spec.read_text())
        if data.get("kind") == "run":  # replay the workload of a recorded run
            data = data["meta"]["workload"]
        elif data.get("kind") == "sweep":
            data = data["points"][0]["meta"]["workload"]
        return WorkloadSpec.model_validate(data)
    flt = LengthFilter(min_len=a.min_len, max_prompt_len=a.max_prompt_len, max_total_len=a.max_total_len)

    def arrivals(rate: float, cv: float) -> ArrivalSpec:
        return ArrivalSpec(process="poisson" if cv == 1.0 else "gamma", rate=rate, cv=cv)

    streams = [
        StreamSpec(
            name="online",
            job_class="online",
            num_requests=a.num_requests,
            lengths=LengthSpec(dataset=a.dataset, input_len=a.input_len, output_len=a.output_len,
                               io_ratio=a.io_ratio, filter=flt),
            arrivals=arrivals(a.rate, a.cv),
            shared_prefix_tokens=a.shared_prefix,
        )
    ]
    if a.offline_num_requests:
        streams.append(
            StreamSpec(
                name="offline",
                job_class="offline",
                priority=a.offline_priority,
                num_requests=a.offline_num_requests,
                lengths=LengthSpec(dataset=a.offline_dataset, input_len=a.offline_input_len,
                                   output_len=a.offline_output_len, filter=flt),
                arrivals=ArrivalSpec(rate=a.offline_rate),
            )
        )
    return WorkloadSpec(seed=a.seed, streams=streams)


class _PoolCache:
    """Loads the ShareGPT pool once per filter (lengths cached on disk)."""

    def __init__(self, tokenizer: str, need_text: bool) -> None:
        self.tokenizer = tokenizer
        self.need_text = need_text
        self._pools: dict[LengthFilter, ShareGPTPool] = {}

    def build(self, spec: WorkloadSpec) -> Workload:
        flts = {s.lengths.filter for s in spec.streams if s.lengths.dataset == "sharegpt"}
        if len(flts) > 1:
            raise SystemExit("all ShareGPT streams must share one length filter")
        pool = None
        if flts:
            flt = next(iter(flts))
            if flt not in self._pools:
                self._pools[flt] = load_pool(tokenizer=self.tokenizer, length_filter=flt,
                                             need_text=self.need_text)
            pool = self._pools[flt]
        return build_workload(spec, pool)


def _client_config(a: argparse.Namespace) -> Any:
    from bench.client import ClientConfig

    return ClientConfig(
        base_url=a.base_url,
        endpoint=a.endpoint,
        model=a.model,
        api_key=a.api_key,
        ignore_eos=not a.no_ignore_eos,
        send_min_tokens=not a.no_min_tokens,
        temperature=a.temperature,
        extra_body=a.extra_body,
        max_tokens=a.max_tokens,
        max_concurrency=a.max_concurrency,
        request_timeout=a.request_timeout,
        max_duration=a.max_duration,
    )
