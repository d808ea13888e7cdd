"""A backward CTA's fixed cost, fitted from timings (GPU; not a test).

Every backward CTA of the SM90 kernel (and of FA4's) owns one key tile and walks the query
tiles; what it costs beyond its walk (launch, K / V load and the first Q / dO before the
first GEMM, the dK / dV epilogue, the dQ writer's drain) is paid once per CTA. A causal grid
has the unmasked grid's CTA count over half the walk, so that cost weighs twice as much
there. This script measures it without touching the kernels: unmasked D=128 problems over
B=1, H heads and Sk keys (Sk / 128 key tiles a head, H * Sk / 128 CTAs, whole waves of the
SMs when that is a multiple of their count) with query lengths that are multiples of both
libraries' 80- and 64-row tiles, so a CTA walks Sq / tile_m whole tiles. The time of the
backward (autograd, after the forward; round-robin over the shapes and libraries, CUDA
events, median) fits t = a + b * Sq per (library, Sk); the work per query row is b, and at
equal work a grid with twice the CTAs (Sk doubled, Sq halved) differs by one CTA's fixed
cost per wave. The fit's intercept a over the waves, in query rows (a / b / waves), is that
cost counted as walked rows; both libraries alike.

    python scripts/bwd_cta_cost.py --out bwd_cta_cost.json [--heads 33] [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import cute_attn
from cute_attn.bench import _fa4_func


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=33, help="33 x 32 key tiles: 8 waves of 132")
    ap.add_argument("--sk", default="4096,8192")
    ap.add_argument("--sq", default="640,1280,2560,5120,10240")
    ap.add_argument("--causal", action="store_true", help="Sq = Sk only (the bench's rows)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bwd_cta_cost.json")
    args = ap.parse_args()
    impls = {"cute_attn": cute_attn.flash_attn_func}
    fa4 = _fa4_func()
    if fa4 is not None:
        impls["fa4"] = fa4
    h, d = args.heads, 128
    shapes = [(int(sk), int(sq)) for sk in args.sk.split(",") for sq in args.sq.split(",")]
    if args.causal:
        shapes = [(s, s) for s, _ in dict.fromkeys(shapes)]
    torch.manual_seed(0)
    calls = []
    for sk, sq in shapes:
        q = torch.randn(1, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, sk, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, sk, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(1, sq, h, d, device="cuda", dtype=torch.bfloat16)
        for name, fn in impls.items():
            res = fn(q, k, v, causal=args.causal)
            out = res[0] if isinstance(res, tuple) else res
            grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            # never time zeros: every gradient has nonzero, finite entries
            for g in grads:
                assert torch.isfinite(g).all() and g.abs().amax() > 0, (name, sk, sq)

            def call(out=out, q=q, k=k, v=v, dout=dout):
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

            calls.append(((name, sk, sq), call))
    for _ in range(3):
        for _, c in calls:
            c()
    times = {tag: [] for tag, _ in calls}
    for _ in range(args.reps):
        for tag, c in calls:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            c()
            e1.record()
            times[tag].append((e0, e1))
    torch.cuda.synchronize()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for (name, sk, sq), ev in times.items():
        ms = sorted(a.elapsed_time(b) for a, b in ev)
        rows.append(dict(impl=name, sk=sk, sq=sq, median_ms=statistics.median(ms),
                         p95_ms=ms[int(0.95 * (len(ms) - 1))]))  # fmt: skip
    fits = []
    if not args.causal:
        for name in impls:
            for sk in dict.fromkeys(s for s, _ in shapes):
                pts = [
                    (r["sq"], r["median_ms"]) for r in rows if (r["impl"], r["sk"]) == (name, sk)
                ]
                n = len(pts)
                mx = sum(x for x, _ in pts) / n
                my = sum(y for _, y in pts) / n
                b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
                a = my - b * mx
                waves = h * (sk // 128) / sms
                fits.append(dict(impl=name, sk=sk, intercept_us=a * 1e3, us_per_row=b * 1e3,
                                 waves=waves, cta_cost_rows=a / b / waves,
                                 cta_cost_us=a * 1e3 / waves))  # fmt: skip
    print(f"{'impl':10s} {'sk':>6s} {'sq':>6s} {'median ms':>10s} {'p95 ms':>8s}")
    for r in rows:
        print(
            f"{r['impl']:10s} {r['sk']:6d} {r['sq']:6d} {r['median_ms']:10.4f} {r['p95_ms']:8.4f}"
        )
    for f in fits:
        print(f"fit {f['impl']:10s} sk={f['sk']:5d}: t = {f['intercept_us']:.1f} us + "
              f"{f['us_per_row']:.4f} us/row; {f['waves']:.2f} waves; a CTA's fixed cost "
              f"{f['cta_cost_us']:.2f} us = {f['cta_cost_rows']:.1f} query rows")  # fmt: skip
    dev = torch.cuda.get_device_name(0)
    with open(args.out, "w") as fh:
        json.dump(dict(device=dev, heads=h, head_dim=d, causal=args.causal, reps=args.reps,
                       cute_attn=cute_attn.__version__, torch=torch.__version__, rows=rows,
                       fits=fits), fh, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
