"""Packed causal prefill with and without L2 sections (longest first across the heads of a
section, FwdTileConfig.lpt_l2_sections, over packed sequences with
FwdTileConfig.l2_sections_packed), timed round-robin in one process (H200 helper, not a
test).

Rows: the bench's varlen row (16 packed causal sequences, 58,728 tokens, 32 query heads over
8 KV heads) at D=128 and D=64, at D=256 and D=192 with 8 / 2 heads, and 64 short sequences
(256-1,024 tokens) at D=128. Variants: sections on (`sections`), off (`plain`: the previous
launch order, LPT per head), and wider sections (`pairs16` / `pairs32`, at most that many
(head, sequence) pairs a section). Every variant's outputs must be bitwise equal to the
first's (the order only changes when a CTA runs); then CUDA events around three
back-to-back calls, median and p95 per call, in rounds. `--variant name=overrides` (as in
tune_sm90.py, repeatable) times those table overrides instead of the section variants.

    python3 scripts/varlen_sections_ab.py [--reps 30] [--rows ROW ...] [--out FILE.json]
        [--variant ragged=ragged_v_loads=True --variant clean=ragged_v_loads=False]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import decode_splits as ds  # noqa: E402
from tune_sm90 import parse_override  # noqa: E402
from varlen_order import packed_causal, round_robin  # noqa: E402

from cute_attn import fwd_sm90  # noqa: E402
from cute_attn.bench import VARLEN_SEQLENS, attention_flops, environment  # noqa: E402
from cute_attn.fwd_sm90 import run_fwd_varlen  # noqa: E402

SHORT = tuple(random.Random(0).randrange(256, 1025) for _ in range(64))
ROWS = {  # name: (lengths, heads, kv heads, head dim)
    "16seq-d128": (VARLEN_SEQLENS, 32, 8, 128),
    "16seq-d64": (VARLEN_SEQLENS, 32, 8, 64),
    "16seq-d256": (VARLEN_SEQLENS, 8, 2, 256),
    "16seq-d192": (VARLEN_SEQLENS, 8, 2, 192),
    "64short-d128": (SHORT, 32, 8, 128),
}
# (the first run, varlen_sections_ab_h200.json, predates the switch: the kernel then took the
# sections over packed sequences at every head dim, and `plain` turned lpt_l2_sections off)
VARIANTS = {
    "sections": {"l2_sections_packed": True},
    "plain": {"l2_sections_packed": False},
    "pairs16": {"l2_sections_packed": True, "l2_section_max_pairs": 16},
    "pairs32": {"l2_sections_packed": True, "l2_section_max_pairs": 32},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--variant", action="append", default=[], help="name=overrides")
    args = ap.parse_args()
    variants = VARIANTS
    if args.variant:
        variants = {n: parse_override(o) for n, o in (v.split("=", 1) for v in args.variant)}
    rows = []
    for name in args.rows:
        lens, h, hkv, d = ROWS[name]
        q, k, v, cu, p = packed_causal(lens, h, hkv, d)

        def call(q=q, k=k, v=v, p=p, cu=cu, lens=lens):
            return run_fwd_varlen(q, k, v, p, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_k=None,
                                  max_seqlen_q=max(lens))  # fmt: skip

        # one plan per variant: bind each variant's compiled kernel while its table is in place
        fns, first, same = {}, None, {}
        for label, overrides in variants.items():
            with ds._TableSwap(**overrides):
                out = call()
                feats = fwd_sm90.InputFeatures(cu_seqlens_q=True, cu_seqlens_k=True)
                plan = fwd_sm90._plan(p, feats, len(lens), max(lens), p.seqlen_k, False,
                                      q.device.index)  # fmt: skip
            fns[label] = plan
            if first is None:
                first = out
            same[label] = torch.equal(out[0], first[0]) and torch.equal(out[1], first[1])

        def run_plan(plan, q=q, k=k, v=v, cu=cu, h=h):
            # what fwd_sm90._run launches for these inputs, with this plan
            out = torch.empty((1, *q.shape), device="cuda", dtype=q.dtype)
            lse = torch.empty((1, h, q.shape[0]), device="cuda", dtype=torch.float32)
            plan.fn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out, lse, *plan.scalars,
                    cu, cu, None, None, None, None, None)  # fmt: skip
            return out[0]

        for label, plan in fns.items():  # the bound plans run what call() ran
            assert torch.equal(run_plan(plan), first[0]), label
        calls = {label: (lambda plan=plan: run_plan(plan)) for label, plan in fns.items()}
        times = round_robin(calls, args.reps)
        flops = sum(attention_flops(1, h, n, n, d, d, True) for n in lens)
        for label, t in times.items():
            t.sort()
            med, p95 = t[len(t) // 2], t[int(0.95 * (len(t) - 1))]
            row = dict(row=name, variant=label, median_ms=med, p95_ms=p95,
                       tflops=flops / med / 1e9, bitwise_equal=same[label])  # fmt: skip
            rows.append(row)
            print(f"{name:14s} {label:9s} {med:7.3f} ms p95 {p95:7.3f} {row['tflops']:6.1f} "
                  f"TFLOP/s equal={same[label]}", flush=True)  # fmt: skip
    if args.out:
        json.dump(dict(environment=environment(torch.device("cuda")), rows=rows),
                  open(args.out, "w"), indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
