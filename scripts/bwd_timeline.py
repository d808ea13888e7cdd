"""Where a backward grid's SM time goes, CTA by CTA (GPU; a diagnostic, not a test).

Runs the SM90 backward of the table's tile (or an override) built with
BwdTileConfig.timeline, whose CTAs record their SM, work and event clocks
(arch/common/timeline.py), and splits the SMs' time over the main kernel's span into: the
consumers' walks (K / V arrival to the walk's end), each CTA's start (its first clock to
K / V arrival: barrier set-up, the preprocess wait, the K / V and first Q loads), its end
(the walk's end to the later of the dK / dV store and the dQ writer's end), the gaps between
one CTA's end and the next CTA's start on the same SM (exit and launch), and the idle time
before an SM's first CTA and after its last. The SM clock converts to time by each CTA's
clock and global-timer spans. First the timeline kernel's gradients are checked against the
table kernel's, and both are timed round-robin (the records' cost).

    python scripts/bwd_timeline.py --shapes d128-16k,d128-16k-causal --out bwd_timeline.json
    python scripts/bwd_timeline.py --shapes d96-4k-causal \
        --variant tile_m=64,dq_flat=False,s_under_dk=True
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tune_bwd_sm90 import SHAPES, parse_override, problem, variant_key  # noqa: E402

from cute_attn.arch.common import timeline as tl  # noqa: E402
from cute_attn.bwd_sm90 import run_bwd  # noqa: E402
from cute_attn.fwd_sm90 import run_fwd  # noqa: E402


def _u32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int64) & 0xFFFFFFFF


def _delta(later: torch.Tensor, earlier: torch.Tensor) -> torch.Tensor:
    # 32-bit counters: differences modulo 2^32
    return (_u32(later) - _u32(earlier)) & 0xFFFFFFFF


def analyse(rec: torch.Tensor, num_sms: int) -> dict:
    """Summary of an (CTAs, TIMELINE_WORDS) int32 record (CPU tensor)."""
    # CTAs that walked (a packed grid's empty tiles record no events past their start)
    rec = rec[(rec[:, tl.W_CLK_START] != 0) & (rec[:, tl.W_WALK] > 0)]
    start = rec[:, tl.W_CLK_START]
    kv = _delta(rec[:, tl.W_CLK_KV], start)
    loop = _delta(rec[:, tl.W_CLK_LOOP_END], start)
    epi = _delta(rec[:, tl.W_CLK_EPI_END], start)
    writer = _delta(rec[:, tl.W_CLK_WRITER_END], start)
    ready = _delta(rec[:, tl.W_CLK_READY], start)
    end = torch.maximum(epi, writer)
    gt_span = _delta(rec[:, tl.W_GT_END], rec[:, tl.W_GT_START]).double()
    # cycles a ns from each CTA's spans (start to the dK / dV store's end, on both counters)
    ok = gt_span > 0
    ghz = float(statistics.median((epi.double()[ok] / gt_span[ok]).tolist()))
    ns = 1.0 / ghz
    gt0 = _u32(rec[:, tl.W_GT_START])
    gt0 = (gt0 - gt0.min()) & 0xFFFFFFFF  # ns from the first CTA's start
    span_ns = float((gt0.double() + end.double() * ns).max())
    walk = rec[:, tl.W_WALK].double()
    out = dict(ctas=int(rec.shape[0]), sm_ghz=ghz, span_us=span_ns / 1e3)
    # per SM: its CTAs in start order; gaps between one's end and the next one's start (the
    # SM's clock for both), idle before the first and after the last (global timer)
    gaps, head_idle, tail_idle = [], [], []
    sms = rec[:, tl.W_SMID]
    for sm in sms.unique().tolist():
        idx = (sms == sm).nonzero().flatten()
        order = idx[torch.argsort(gt0[idx])]
        s_abs = gt0[order].double()
        e_abs = s_abs + end[order].double() * ns
        head_idle.append(float(s_abs[0]))
        tail_idle.append(span_ns - float(e_abs[-1]))
        for a, b in zip(order[:-1].tolist(), order[1:].tolist()):
            gaps.append(float(_delta(rec[b, tl.W_CLK_START], rec[a, tl.W_CLK_START]) - end[a]))
    unused_sms = num_sms - len(sms.unique())
    total = num_sms * span_ns
    parts = {
        "walk": float((loop - kv).double().sum()) * ns,
        "cta_start": float(kv.double().sum()) * ns,
        "cta_end": float((end - loop).double().sum()) * ns,
        "between_ctas": sum(gaps) * ns,
        "before_first": sum(head_idle),
        "after_last": sum(tail_idle),
        "unused_sms": unused_sms * span_ns,
    }
    out["share"] = {k: v / total for k, v in parts.items()}
    out["share"]["unaccounted"] = 1.0 - sum(out["share"].values())

    def us(x):
        return float(statistics.median(x)) * ns / 1e3

    out["median_us"] = dict(
        cta_start=us(kv.tolist()),
        preprocess_wait=us(ready.tolist()),
        step=float(statistics.median(((loop - kv).double() / walk.clamp(min=1)).tolist()))
        * ns
        / 1e3,
        walk=us((loop - kv).tolist()),
        store_end=us((epi - loop).tolist()),
        writer_end=us((writer - loop).tolist()),
        between_ctas=us(gaps) if gaps else 0.0,
        first_start=float(statistics.median(head_idle)) / 1e3,
    )
    out["mean_walk_tiles"] = float(walk.mean())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="d128-16k,d128-16k-causal,d128-4k-causal,d96-4k-causal")
    ap.add_argument("--variant", default="", help="BwdTileConfig overrides, as tune_bwd_sm90")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="bwd_timeline.json")
    ap.add_argument("--raw", action="store_true", help="keep every CTA's record in the JSON")
    args = ap.parse_args()
    overrides, det, group, pre, _ = parse_override(args.variant)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    results = []
    for shape in args.shapes.split(","):
        b, s, h, d, causal, hkv, dv = (SHAPES[shape] + (None, None))[:7]
        hkv, dv = hkv or h, dv or d
        qkv = [torch.randn(b, s, n, e, device="cuda", dtype=torch.bfloat16)
               for n, e in ((h, d), (hkv, d), (hkv, dv))]  # fmt: skip
        p = problem(*qkv, causal, det)
        out, lse = run_fwd(*qkv, p)
        dout = torch.randn_like(out)
        ov = dict(overrides)
        if variant_key(p, ov, group)[1].tail_split:
            ov["tail_split"] = False  # its workspace is the records' buffer: both kernels without
        key, cfg = variant_key(p, ov, group)
        key_tl, cfg_tl = variant_key(p, {**ov, "timeline": True}, group)
        tiles = -(-s // cfg.tile_n) * h * b
        rec = torch.zeros((tiles, tl.TIMELINE_WORDS), dtype=torch.int32, device="cuda")
        g_ref = run_bwd(*qkv, out, lse, dout, p, key=key, pre_ctas=pre)
        g_tl = run_bwd(*qkv, out, lse, dout, p, key=key_tl, pre_ctas=pre, timeline=rec)
        err = max((a.float() - r.float()).abs().max().item() for a, r in zip(g_tl, g_ref))
        scale = max(r.float().abs().max().item() for r in g_ref)
        times = {"table": [], "timeline": []}
        for _ in range(args.reps):
            for name, kk, kw in (("table", key, {}), ("timeline", key_tl, {"timeline": rec})):
                e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
                e0.record()
                run_bwd(*qkv, out, lse, dout, p, key=kk, pre_ctas=pre, **kw)
                e1.record()
                times[name].append((e0, e1))
        torch.cuda.synchronize()
        ms = {n: statistics.median(a.elapsed_time(b_) for a, b_ in ev) for n, ev in times.items()}
        rec.zero_()
        run_bwd(*qkv, out, lse, dout, p, key=key_tl, pre_ctas=pre, timeline=rec)
        torch.cuda.synchronize()
        summary = analyse(rec.cpu(), num_sms)
        # the same gradients up to the order of the dQ adds (not deterministic)
        same = err <= 2e-2 * scale
        row = dict(shape=shape, variant=args.variant, config=dataclasses.asdict(cfg_tl),
                   grads_match=same, grad_diff=err, grad_scale=scale, median_ms=ms,
                   **summary)  # fmt: skip
        if args.raw:
            row["records"] = rec.cpu().tolist()
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "records"}), flush=True)
        if not same:
            print(f"MISMATCH {shape}: timeline kernel's gradients differ by {err} ({scale})")
    json.dump(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                   results=results), open(args.out, "w"), indent=1)  # fmt: skip
    print(f"\n{'shape':<18} {'ms table/tl':>14} {'span us':>8} "
          + " ".join(f"{k[:10]:>10}" for k in results[0]["share"]))  # fmt: skip
    for r in results:
        ms = r["median_ms"]
        print(f"{r['shape']:<18} {ms['table']:6.3f}/{ms['timeline']:6.3f} {r['span_us']:8.1f} "
              + " ".join(f"{100 * v:9.2f}%" for v in r["share"].values()))  # fmt: skip
    print(f"\n{'shape':<18} " + " ".join(f"{k[:12]:>12}" for k in results[0]["median_us"])
          + "   (medians, us)")  # fmt: skip
    for r in results:
        print(f"{r['shape']:<18} " + " ".join(f"{v:12.2f}" for v in r["median_us"].values()))


if __name__ == "__main__":
    main()
