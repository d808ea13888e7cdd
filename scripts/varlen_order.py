"""Varlen prefill with and without the longest-first batch order (InputFeatures.batch_order,
off by default since this measurement), timed round-robin in one process on the GPU (H200
helper, not a test).

The bench's varlen row: 16 packed causal sequences (58,728 tokens), 32 query heads over 8 KV
heads, D=128, bf16. Both orders must give bitwise identical outputs (the order only changes
when a CTA runs, not what it computes); then CUDA events around back-to-back calls, median
and p95 of --reps.

    python3 scripts/varlen_order.py [--reps 30] [--out order.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from cute_attn.bench import VARLEN_SEQLENS, attention_flops
from cute_attn.fwd_sm90 import run_fwd_varlen
from cute_attn.validation import validate_varlen


def packed_causal(lens, h: int, hkv: int, d: int):
    """(q, k, v, cu_seqlens, problem): random bf16 packed sequences of `lens` (Sk = Sq per
    sequence), h query heads over hkv KV heads, head dim d, validated as a causal call."""
    total = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v = rnd(total, h, d), rnd(total, hkv, d), rnd(total, hkv, d)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")  # fmt: skip
    p = validate_varlen(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
        max_seqlen_k=max(lens), seqused_q=None, seqused_k=None, page_table=None,
        softmax_scale=None, causal=True, window_size=(None, None), softcap=0.0, num_splits=0,
        pack_gqa=None, deterministic=False,
    )  # fmt: skip
    return q, k, v, cu, p


def round_robin(calls: dict, reps: int, per_event: int = 3) -> dict:
    """Per-call times (ms) of each `calls[label]()`, in rounds so that clock drift hits every
    label alike: 3 warm-up rounds, then `reps` rounds, each an event pair around
    `per_event` back-to-back calls of one label after another."""
    times = {label: [] for label in calls}
    for _ in range(3):
        for fn in calls.values():
            fn()
    for _ in range(reps):
        for label, fn in calls.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(per_event):
                fn()
            e.record()
            e.synchronize()
            times[label].append(s.elapsed_time(e) / per_event)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lens, h, hkv, d = VARLEN_SEQLENS, 32, 8, 128
    q, k, v, cu, p = packed_causal(lens, h, hkv, d)

    def call(ordered):
        return run_fwd_varlen(q, k, v, p, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_k=None,
                              max_seqlen_q=max(lens), order_batches=ordered)  # fmt: skip

    outs = {o: call(o) for o in (True, False)}
    same = torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    times = round_robin({o: (lambda o=o: call(o)) for o in (True, False)}, args.reps)
    flops = sum(attention_flops(1, h, n, n, d, d, True) for n in lens)
    rows = []
    for o, t in times.items():
        t.sort()
        med, p95 = t[len(t) // 2], t[int(0.95 * (len(t) - 1))]
        rows.append(dict(order="longest first" if o else "launch order", median_ms=med,
                         p95_ms=p95, tflops=flops / med / 1e9, bitwise_equal=same))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(args.out, "w"),
                  indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
