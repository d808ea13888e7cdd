"""Decode split-KV on the H200: the combine kernel's variants and the split count (not a test).

Decode rows of the bench (one new token, 32 query heads over 8 KV heads, D=128, bf16) timed as
CUDA-graph replays: each graph holds INNER back-to-back calls of `flash_attn_func`, CUDA events
around each replay, median and p95 per call over --reps replays. Every variant is first checked
against the fp32 reference (max |err| recorded).

  * combine variants (on the rows the table splits): the library's combine (8 splits per step,
    PDL launch), the same without PDL, the one-split-per-step loop without PDL (the previous
    kernel's loop), and no combine at all (the split kernel alone: its output is not used, this
    is only the time the combine adds);
  * where the split kernel lets the PDL combine launch: at its start ("early") or when its
    consumers reach the epilogue (the library's); 16 splits per combine step ("unroll16");
  * the two-CTAs-per-SM tile of wide unsplit grids on the split rows ("wide1x" at the
    table's split count, "wide2x" at twice it);
  * one call per replay ("inner1", the bench's --graph method) against INNER per replay;
  * split counts: num_splits over a range, library combine.

    python3 scripts/decode_splits.py --out decode_splits.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json

import torch

import cute_attn
import cute_attn.api as api
import cute_attn.fwd_sm90 as fwd_sm90
from cute_attn.arch.sm90.compile import compile_split_combine
from cute_attn.bench import capture_graph, environment, median_p95
from cute_attn.reference import attention_ref

INNER = 10
ROWS = {  # name: (batch, seqlen_k, split counts to sweep)
    "b1-32k": (1, 32768, (4, 8, 12, 16, 20, 24, 32, 33, 48)),
    "b8-8k": (8, 8192, (1, 2, 3, 4)),
    "b64-8k": (64, 8192, (1, 2)),
    "b128-2k": (128, 2048, (1, 2)),
}


def _graph_ms(fn, reps: int, inner: int = INNER) -> tuple[float, float]:
    """(median, p95) ms per call: a graph of `inner` back-to-back calls, events per replay."""

    def calls():
        for _ in range(inner):
            fn()

    graph, _ = capture_graph(calls, warmup=3)
    for _ in range(3):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return median_p95(s.elapsed_time(e) / inner for s, e in zip(starts, ends))


def one_and_ten_graphs(fn):
    """CUDA graphs of one call of fn and of ten back-to-back calls (the A/B scripts' pair).
    The caller keeps fn's input tensors alive while it replays them (a replay reads them
    where they were at capture; freed, their memory may hold anything by then)."""
    one, _ = capture_graph(fn, warmup=3)
    ten, _ = capture_graph(lambda: [fn() for _ in range(10)], warmup=3)
    return one, ten


def graph_rounds(name: str, graphs: dict, kv_bytes: int, rounds: int, width: int = 7) -> list:
    """Replay every variant's graphs once a round (`graphs`: label -> (one-call graph, ten-call
    graph, max |err|, splits)), `rounds` rounds, CUDA events per replay, so that clock drift
    hits every variant alike; print and return one row per (variant, calls per graph) with
    the median / p95 us per call and the TB/s of `kv_bytes` (K + V read)."""
    times = {(label, inner): [] for label in graphs for inner in (1, 10)}
    for _ in range(rounds):
        for label, (one, ten, _, _) in graphs.items():
            for inner, graph in ((1, one), (10, ten)):
                s = torch.cuda.Event(enable_timing=True)
                e = torch.cuda.Event(enable_timing=True)
                s.record()
                graph.replay()
                e.record()
                e.synchronize()
                times[(label, inner)].append(s.elapsed_time(e) / inner)
    rows = []
    for (label, inner), t in times.items():
        med, p95 = median_p95(t)
        _, _, err, n = graphs[label]
        row = dict(row=name, variant=label, splits=n, inner=inner, median_us=med * 1e3,
                   p95_us=p95 * 1e3, tbps=kv_bytes / (med * 1e-3) / 1e12, err=err)  # fmt: skip
        rows.append(row)
        print(f"{name} {label:{width}s} splits {n:3d} inner {inner:2d} {row['median_us']:7.1f} us "
              f"p95 {row['p95_us']:7.1f} {row['tbps']:.2f} TB/s err {err:.2e}",
              flush=True)  # fmt: skip
    return rows


def decode_inputs(b: int, sk: int, h: int = 32, hkv: int = 8, d: int = 128):
    """One decode row: q (B, 1, H, D) and k / v (B, Sk, Hkv, D) in bf16 from torch's current
    seed, the fp32 reference output, and the split count the table takes for the row (as
    fwd_sm90._plan computes it)."""
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    ref = attention_ref(q, k, v, compute_dtype=torch.float32)[0]
    table = fwd_sm90._num_splits(
        0, d, d, False, False, True, 0, b, h // hkv, hkv, sk, fwd_sm90._num_sms(None)
    )
    return q, k, v, ref, table


def _clear_memo():
    """Drop the dense and KV-cache entries' memos and the paged route: a memo hit reuses the
    launcher (and its plan: kernel and combine) bound at the first call of that signature, so
    a swap that leaves it in place measures the previous variant again. Before this, every
    variant after the first at one split count ran the first one's kernels (docs/perf/README.md,
    fifteenth session); until the forty-first session the KV-cache memo was left in place.
    The varlen entry's memo holds no plan, only its decisions (whose reasons name the
    packing): cleared too."""
    api._dense_memo.clear()
    api._kvcache_memo.clear()
    api._varlen_memo.clear()
    fwd_sm90.paged_route.cache_clear()


class _TableSwap:
    """Within the block, the tuning table's configs get `overrides` (compile caches cleared)."""

    def __init__(self, **overrides):
        self.overrides = overrides

    def _clear(self):
        fwd_sm90._fwd_key.cache_clear()
        fwd_sm90._plan.cache_clear()
        _clear_memo()

    def __enter__(self):
        self.orig = fwd_sm90.fwd_tile_config

        def patched(*a, **kw):
            return dataclasses.replace(self.orig(*a, **kw), **self.overrides)

        fwd_sm90.fwd_tile_config = patched
        self._clear()

    def __exit__(self, *exc):
        fwd_sm90.fwd_tile_config = self.orig
        self._clear()


class _CombineSwap:
    """Within the block, every plan that splits runs `combine` instead of the library's."""

    def __init__(self, combine):
        self.combine = combine

    def __enter__(self):
        self.orig = fwd_sm90._plan

        def patched(*a):
            plan = self.orig(*a)
            if plan.combine is None:
                return plan
            return dataclasses.replace(plan, combine=self.combine)

        fwd_sm90._plan = patched
        _clear_memo()

    def __exit__(self, *exc):
        fwd_sm90._plan = self.orig
        _clear_memo()


def _measure(results, name, tensors, label, splits, reps, combine=None, swap=None, inner=INNER):
    q, k, v, ref = tensors

    def fn():
        return cute_attn.flash_attn_func(q, k, v, num_splits=splits)[0]

    if swap is None:
        swap = _CombineSwap(combine) if combine is not None else contextlib.nullcontext()
    with swap:
        # the split kernel alone leaves out unwritten: nothing to check
        err = None if label == "none" else float((fn().float() - ref).abs().max())
        med, p95 = _graph_ms(fn, reps, inner)
    kv_bytes = 2 * k.numel() * k.element_size()
    row = dict(row=name, variant=label, num_splits=splits, median_ms=med, p95_ms=p95,
               tbps=kv_bytes / (med * 1e-3) / 1e12, max_err=err)  # fmt: skip
    results.append(row)
    e = "-" if err is None else f"{err:.2e}"
    print(f"{name:8s} {label:8s} splits={splits:3d} {med * 1e3:8.1f} us p95 {p95 * 1e3:8.1f} "
          f"{row['tbps']:.2f} TB/s err {e}", flush=True)  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="decode_splits.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    h, hkv, d = 32, 8, 128
    combines = {
        "unroll8": compile_split_combine("bfloat16", d, use_pdl=False),
        "serial": compile_split_combine("bfloat16", d, split_unroll=1, use_pdl=False),
        # 16 splits' loads per step with the PDL launch: B=1's 16 splits in one step
        "unroll16": compile_split_combine("bfloat16", d, split_unroll=16),
        "none": lambda *a: None,
    }
    results = []
    for name in args.rows.split(","):
        b, sk, sweep = ROWS[name]
        # table_splits: the table's split count for this row, for the A/B
        *tensors, table_splits = decode_inputs(b, sk, h, hkv, d)
        _measure(results, name, tensors, "library", 0, args.reps)
        # one call per graph replay (the bench's --graph method) instead of INNER
        _measure(results, name, tensors, "inner1", 0, args.reps, inner=1)
        if table_splits > 1:
            for label, combine in combines.items():
                _measure(results, name, tensors, label, table_splits, args.reps, combine)
            early = _TableSwap(early_dependents=True)
            _measure(results, name, tensors, "early", table_splits, args.reps, swap=early)
            # the two-CTAs-per-SM tile of wide unsplit grids on this split grid, at the
            # table's split count and at twice it (as many CTAs as two per SM hold)
            for mult in (1, 2):
                wide = _TableSwap(ctas_per_sm=2, tile_n=64, num_stages=2)
                _measure(results, name, tensors, f"wide{mult}x", mult * table_splits,
                         args.reps, swap=wide)  # fmt: skip
        for s in sweep:
            _measure(results, name, tensors, "library", s, args.reps)
    with open(args.out, "w") as f:
        json.dump({"environment": environment(torch.device("cuda")), "inner": INNER,
                   "rows": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
