"""The same causal problem as dense tensors and as packed sequences of equal length
(cu_seqlens, every sequence a multiple of 128 rows), for cute_attn and FA4, timed round-robin
in one process: what the packed path costs over the dense one, per library. cute_attn's dense
call runs twice: as dispatched (a persistent grid where tile_config.fwd_persistent holds) and
on one CTA per tile (`cute_dense_tiles`, the grid the packed path has).

Run on the GPU machine (FA4 importable), with the per-call host checks off so that only the
kernels differ: CUTE_ATTN_CHECK_VALUES=0 python3 scripts/varlen_vs_dense.py; writes
$OUT/varlen_vs_dense_h200.json (or ./ without OUT). Medians of 60 rounds, one call each.
"""

import contextlib
import json
import os
import statistics

import torch
from flash_attn.cute import flash_attn_func as fa4
from flash_attn.cute import flash_attn_varlen_func as fa4_varlen

import cute_attn
from cute_attn import api, fwd_sm90
from cute_attn.bench import _time_rounds, visible_pairs

REPS = 60
# batch, seqlen, H, Hkv
ROWS = ((4, 4096, 32, 8), (4, 4096, 16, 16), (16, 1024, 32, 8), (2, 8192, 32, 8))


def one_cta_per_tile(f):
    """f with the dense dispatch's persistent bucket off (the memo and the plan cache cleared
    around the call, so the plan is made again: the call must be GPU-bound for its time to be
    the kernel's)."""

    def call():
        persistent = fwd_sm90.fwd_persistent
        fwd_sm90.fwd_persistent = lambda *a, **k: False
        api._dense_memo.clear()
        fwd_sm90._plan.cache_clear()
        try:
            return f()
        finally:
            fwd_sm90.fwd_persistent = persistent
            api._dense_memo.clear()
            fwd_sm90._plan.cache_clear()

    return call


def time_round_robin(fns: dict) -> dict:
    """Median ms of each call, timed in rounds by the bench's own timer (cute_attn.bench)."""
    calls = [(contextlib.nullcontext, lambda _set, f=f: f()) for f in fns.values()]
    times = _time_rounds(calls, n_sets=1, warmup=3, reps=REPS)
    return {n: statistics.median(t) for n, t in zip(fns, times)}


def row_fns(b: int, s: int, h: int, hk: int) -> dict:
    q = torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hk, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hk, 128, device="cuda", dtype=torch.bfloat16)
    qp, kp, vp = (x.reshape(b * s, *x.shape[2:]) for x in (q, k, v))
    cu = torch.arange(0, b + 1, dtype=torch.int32, device="cuda") * s
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s, causal=True)

    def dense():
        return cute_attn.flash_attn_func(q, k, v, causal=True)

    return {
        "cute_dense": dense,
        "cute_dense_tiles": one_cta_per_tile(dense),
        "cute_varlen": lambda: cute_attn.flash_attn_varlen_func(qp, kp, vp, **kw),
        "fa4_dense": lambda: fa4(q, k, v, causal=True),
        "fa4_varlen": lambda: fa4_varlen(qp, kp, vp, **kw),
    }


def main():
    torch.manual_seed(0)
    res = {}
    for b, s, h, hk in ROWS:
        fns = row_fns(b, s, h, hk)
        dense = fns["cute_dense"]()[0].reshape(b * s, h, 128)
        for other in ("cute_varlen", "cute_dense_tiles"):
            o = fns[other]()[0].reshape(b * s, h, 128)
            diff = (dense.float() - o.float()).abs().max().item()
            print(f"dense vs {other} max diff", diff)  # the same rows, the same tile math
            assert diff == 0.0, other
        flops = 4 * b * h * 128 * visible_pairs(s, s, True)
        t = time_round_robin(fns)
        name = f"b{b} s{s} h{h}/{hk} d128 causal"
        res[name] = {n: dict(ms=m, tflops=flops / m / 1e9) for n, m in t.items()}
        print(name, {n: round(flops / m / 1e9, 1) for n, m in t.items()})
    path = os.path.join(os.environ.get("OUT", "."), "varlen_vs_dense_h200.json")
    json.dump(res, open(path, "w"), indent=1)


if __name__ == "__main__":
    main()
