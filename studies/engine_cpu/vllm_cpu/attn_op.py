"""vLLM-CPU's decode attention operator alone, on SmolLM2's shapes, for a side
by side with `studies.engine_cpu.decode_op` (run in vLLM's venv, README
"Exact commands"; it imports nothing of ours):

    taskset -c 0 ~/.cache/peer-vllm/venv/bin/python \\
        studies/engine_cpu/vllm_cpu/attn_op.py BATCH CONTEXT [BLOCK_SIZE]

Its AMX path ("amx") and its vector path ("vec"), each on a cold layout
(every sequence's blocks drawn at random from a cache eight times larger
than needed) and a hot one (every sequence reads the same blocks), one
thread, bfloat16, blocks of 128 tokens unless told (the AMX path needs a
multiple of 32)."""

import statistics
import sys
import time

import torch
from vllm import _custom_ops as ops

torch.set_num_threads(1)
# Linux grants the AMX tiles' state to a process that asks; vLLM asks at start.
torch._C._cpu._init_amx()
batch, context = int(sys.argv[1]), int(sys.argv[2])
bs = int(sys.argv[3]) if len(sys.argv) > 3 else 128
heads, kv_heads, dim = 9, 3, 64
for isa in ("amx", "vec"):
    for hot in (False, True):
        g = torch.Generator().manual_seed(0)
        per = -(-context // bs)
        need = batch * per
        total = per if hot else need * 8
        cache = torch.randn(total, kv_heads, bs, 2 * dim, generator=g).bfloat16()
        kc, vc = cache.view(total, kv_heads, bs * 2, dim).chunk(2, dim=2)
        ids = torch.arange(need) % per if hot else torch.randperm(total, generator=g)[:need]
        table = ids.view(batch, per).int().contiguous()
        q = torch.randn(batch, heads, dim, generator=g).bfloat16()
        out = torch.empty_like(q)
        qsl = torch.arange(batch + 1, dtype=torch.int32)
        lens = torch.full((batch,), context, dtype=torch.int32)
        md = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=batch, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=lens,
            dtype=torch.bfloat16, query_start_loc=qsl, causal=True, sliding_window_size=-1,
            isa=isa, enable_kv_split=True)

        def call() -> None:
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
                seq_lens=lens, scale=dim**-0.5, causal=True, alibi_slopes=None,
                sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=md,
                s_aux=None)

        call()
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        gbs = 2 * batch * context * kv_heads * dim * 2 / ms / 1e6
        print(f"vllm {isa} {'hot' if hot else 'cold'} batch {batch} context {context} "
              f"block {bs}: {ms:.3f} ms ({gbs:.1f} GB/s of K/V)", flush=True)
