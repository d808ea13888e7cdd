"""Time the backward's GQA sum of per-query-head dK / dV on the GPU: fp32 sum then a cast
(two kernels, an fp32 intermediate) against a 16-bit sum (one kernel; torch accumulates 16-bit
reductions in fp32 and rounds once). Checks the two give bitwise-equal results first.

    python scripts/gqa_sum.py [--total 58728] [--heads 32] [--heads-kv 8] [--dim 128]

Shape default: the bench's varlen backward row (bwd_sm90._sum_groups on dk_h / dv_h).
"""

from __future__ import annotations

import argparse
import json

import torch

from cute_attn.bench import median_p95


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total", type=int, default=58728)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    g = a.heads // a.heads_kv
    x = torch.randn(a.total, a.heads, a.dim, device="cuda", dtype=torch.bfloat16)
    forms = {
        "fp32 sum + cast": lambda: (
            x.unflatten(-2, (a.heads_kv, g)).sum(-2, dtype=torch.float32).to(x.dtype)
        ),
        "bf16 sum": lambda: x.unflatten(-2, (a.heads_kv, g)).sum(-2),
    }
    ref = forms["fp32 sum + cast"]()
    equal = {name: torch.equal(fn(), ref) for name, fn in forms.items()}
    times = {name: [] for name in forms}
    for _ in range(5):  # warm-up
        for fn in forms.values():
            fn()
    for _ in range(a.reps):  # rounds: each form once per round, same clocks
        for name, fn in forms.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": [a.total, a.heads, a.dim],
        "heads_kv": a.heads_kv,
        "bitwise_equal": equal,
        "ms": {name: dict(zip(("median", "p95"), median_p95(t))) for name, t in times.items()},
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
