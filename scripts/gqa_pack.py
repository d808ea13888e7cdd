"""cute_attn against FA4 with and without its pack_gqa (GQA 32/8, D=128, bf16), timed
round-robin in one process: the varlen prefill row of the bench (16 sequences, causal) and three
dense GQA rows. It asks how much of the varlen gap FA4's packed query heads explain.

Run on the GPU machine (FA4 importable): python3 scripts/gqa_pack.py; writes
$OUT/gqa_pack_h200.json (or ./ without OUT). Medians of 60 rounds, one call each.
"""

import contextlib
import json
import os
import statistics

import torch
from flash_attn.cute import flash_attn_func as fa4
from flash_attn.cute import flash_attn_varlen_func as fa4_varlen

import cute_attn
from cute_attn.bench import VARLEN_SEQLENS, _time_rounds, visible_pairs

REPS = 60


def first(x):
    return x[0] if isinstance(x, tuple) else x


def time_round_robin(fns: dict) -> dict:
    """Median ms of each call, timed in rounds by the bench's own timer (cute_attn.bench)."""
    calls = [(contextlib.nullcontext, lambda _set, f=f: f()) for f in fns.values()]
    times = _time_rounds(calls, n_sets=1, warmup=3, reps=REPS)
    return {n: statistics.median(t) for n, t in zip(fns, times)}


def rnd(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def dense_fns(q, k, v, causal: bool) -> dict:
    return {
        "cute_attn": lambda: cute_attn.flash_attn_func(q, k, v, causal=causal),
        "fa4": lambda: fa4(q, k, v, causal=causal),
        "fa4_nopack": lambda: fa4(q, k, v, causal=causal, pack_gqa=False),
    }


def main():
    torch.manual_seed(0)
    res = {}
    s = VARLEN_SEQLENS
    total, mx = sum(s), max(s)
    q, k, v = rnd(total, 32, 128), rnd(total, 8, 128), rnd(total, 8, 128)
    cu = torch.tensor((0, *s), dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=True)
    fns = {
        "cute_attn": lambda: cute_attn.flash_attn_varlen_func(q, k, v, **kw),
        "fa4": lambda: fa4_varlen(q, k, v, **kw),
        "fa4_nopack": lambda: fa4_varlen(q, k, v, **kw, pack_gqa=False),
    }
    ref = first(fns["fa4"]()).float()
    for n, f in fns.items():  # never time a wrong answer
        diff = (first(f()).float() - ref).abs().max().item()
        print(n, "max |out - FA4 out|", diff)
        assert diff < 0.05, n
    flops = 4 * 32 * 128 * sum(visible_pairs(x, x, True) for x in s)
    t = time_round_robin(fns)
    res["varlen"] = {n: dict(ms=m, tflops=flops / m / 1e9) for n, m in t.items()}
    print("varlen", json.dumps(res["varlen"]))
    for b, sq, causal in ((4, 4096, True), (1, 16384, True), (4, 4096, False)):
        fns = dense_fns(rnd(b, sq, 32, 128), rnd(b, sq, 8, 128), rnd(b, sq, 8, 128), causal)
        flops = 4 * b * 32 * 128 * visible_pairs(sq, sq, causal)
        t = time_round_robin(fns)
        name = f"gqa b{b} s{sq} h32/8 d128{' causal' if causal else ''}"
        res[name] = {n: dict(ms=m, tflops=flops / m / 1e9) for n, m in t.items()}
        print(name, json.dumps(res[name]))
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "gqa_pack_h200.json"), "w"),
              indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
