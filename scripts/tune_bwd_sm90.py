"""Measure SM90 backward tile-config variants against each other on the GPU, in one process.

Each variant is a BwdTileConfig override of the tuning table's choice (split_mask_loops,
stagger_start, ...), run through the library's own backward launcher (`run_bwd` with the
variant's key: preprocess, main kernel, postprocess). Each is first checked against the fp32
reference backward on a small odd-sized problem, then all variants of a shape are timed
round-robin (one call of each per round, so clock drift hits them alike) with CUDA events:
median and p95 over --reps, TFLOP/s counting 2.5x the forward FLOPs like the bench.

    python scripts/tune_bwd_sm90.py --out tune_bwd.json --shapes d128-16k,d128-16k-causal \
        --variant base= --variant split=split_mask_loops=True --variant det=deterministic=1

--varlen runs each shape's batch as that many packed sequences of seqlen tokens
(cu_seqlens, `run_bwd_varlen`), the varlen kernels' own table entries and code. --fa4 times
FA4's backward (flash-attn-4, through autograd as the bench times it) in the same rounds, so a
variant's ratio to FA4 comes from one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics

import torch

from cute_attn import api, validation
from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig
from cute_attn.bench import visible_pairs
from cute_attn.bwd_sm90 import bwd_key, run_bwd, run_bwd_varlen
from cute_attn.fwd_sm90 import run_fwd
from cute_attn.reference import attention_ref, attention_ref_backward

SHAPES = {  # name: (batch, seqlen, heads, head_dim, causal) -- the bench's backward rows
    "d128-16k": (1, 16384, 16, 128, False),
    "d128-16k-causal": (1, 16384, 16, 128, True),
    "d128-4k": (4, 4096, 16, 128, False),
    "d128-8k": (2, 8192, 16, 128, False),
    "d128-8k-causal": (2, 8192, 16, 128, True),
    "d128-4k-causal": (4, 4096, 16, 128, True),
    "d128-1k": (16, 1024, 16, 128, False),
    "d128-1k-causal": (16, 1024, 16, 128, True),
    "d128-2k-causal": (8, 2048, 16, 128, True),
    "d64-16k": (1, 16384, 32, 64, False),
    "d64-16k-causal": (1, 16384, 32, 64, True),
    "d64-4k": (4, 4096, 32, 64, False),
    "d64-4k-causal": (4, 4096, 32, 64, True),
    "d64-1k": (16, 1024, 32, 64, False),
    "d64-1k-causal": (16, 1024, 32, 64, True),
    # D=96 (the bwd preset's rows: 2048 / 96 -> 21 heads)
    "d96-16k": (1, 16384, 21, 96, False),
    "d96-16k-causal": (1, 16384, 21, 96, True),
    "d96-4k": (4, 4096, 21, 96, False),
    "d96-4k-causal": (4, 4096, 21, 96, True),
    "d96-1k": (16, 1024, 21, 96, False),
    "d96-2k": (8, 2048, 21, 96, False),
    "d96-1k-causal": (16, 1024, 21, 96, True),
    "d96-2k-causal": (8, 2048, 21, 96, True),
    "d96-8k-causal": (2, 8192, 21, 96, True),
    # the wide (dkv_swap_ab) tiles: D=256 as in the bwd preset (8 heads), D=192 as in the full
    # preset (10 heads; its own 64 x 96 tiles)
    "d256-16k": (1, 16384, 8, 256, False),
    "d256-16k-causal": (1, 16384, 8, 256, True),
    "d256-4k": (4, 4096, 8, 256, False),
    "d256-4k-causal": (4, 4096, 8, 256, True),
    "d256-1k": (16, 1024, 8, 256, False),
    "d256-1k-causal": (16, 1024, 8, 256, True),
    "d192-4k": (4, 4096, 10, 192, False),
    "d192-4k-causal": (4, 4096, 10, 192, True),
    "d192-1k": (16, 1024, 10, 192, False),
    "d192-1k-causal": (16, 1024, 10, 192, True),
    "d192-16k-causal": (1, 16384, 10, 192, True),
    # (192, 128) as in the full preset (a 7th field: head_dim_v)
    "d192v128-4k": (4, 4096, 16, 192, False, None, 128),
    "d192v128-4k-causal": (4, 4096, 16, 192, True, None, 128),
    "d192v128-1k-causal": (8, 1024, 16, 192, True, None, 128),
    "d192v128-1k": (8, 1024, 16, 192, False, None, 128),
    "d192v128-16k-causal": (1, 16384, 16, 192, True, None, 128),
    "d192v128-16k": (1, 16384, 16, 192, False, None, 128),
    # GQA (32 query heads over 8 KV heads, a 6th field) and MQA, for group_heads
    "gqa-d128-16k-causal": (1, 16384, 32, 128, True, 8),
    "gqa-d128-4k": (4, 4096, 32, 128, False, 8),
    "gqa-d128-4k-causal": (4, 4096, 32, 128, True, 8),
    "gqa-d128-2k-causal": (2, 2048, 32, 128, True, 8),
    "gqa-d128-1k-b4-causal": (4, 1024, 32, 128, True, 8),
    "gqa-d128-1k-b2-causal": (2, 1024, 32, 128, True, 8),
    "mqa-d128-4k-b8-causal": (8, 4096, 32, 128, True, 1),
    "gqa8-d128-4k-b2-causal": (2, 4096, 64, 128, True, 8),
    "gqa8-d128-2k-b4-causal": (4, 2048, 64, 128, True, 8),
    "gqa16-d128-4k-b4-causal": (4, 4096, 32, 128, True, 2),
    "gqa-d128-1k": (16, 1024, 32, 128, False, 8),
    "gqa-d128-1k-b2": (2, 1024, 32, 128, False, 8),
    "gqa-d128-1k-b1": (1, 1024, 32, 128, False, 8),
    "gqa-d128-16k": (1, 16384, 32, 128, False, 8),
    "mqa-d128-1k-b2": (2, 1024, 32, 128, False, 1),
    "gqa-d64-4k": (4, 4096, 32, 64, False, 8),
    "gqa-d96-4k": (4, 4096, 32, 96, False, 8),
    "gqa-d96-4k-causal": (4, 4096, 32, 96, True, 8),
    "mqa-d96-4k-causal": (4, 4096, 32, 96, True, 1),
    "gqa-d256-4k": (4, 4096, 16, 256, False, 4),
    "gqa-d64-4k-causal": (4, 4096, 32, 64, True, 8),
    "gqa-d256-4k-causal": (4, 4096, 16, 256, True, 4),
    "mqa-d128-4k-causal": (4, 4096, 32, 128, True, 1),
}

INNER = 3


def parse_override(text: str) -> tuple[dict, bool, bool, int | None, int | None]:
    """`k=v,...` -> (BwdTileConfig overrides, deterministic, group_heads, pre_ctas,
    tail_parts); `deterministic=1` and `group_heads=1` are not tile fields but key fields,
    `pre_ctas=N` the persistent preprocess's grid (a launch value, run_bwd's pre_ctas),
    `tail_parts=N` (with tail_split=True) N parts a tail tile instead of the model's count
    (the check problem splits every tile, the timed one its last partial wave)."""
    out, det, group, pre_ctas, tail_parts = {}, False, False, None, None
    for item in filter(None, text.split(",")):
        k, v = item.split("=")
        if k in ("pre_ctas", "tail_parts"):
            pre_ctas, tail_parts = (int(v), tail_parts) if k == "pre_ctas" else (pre_ctas, int(v))
            continue
        if k in ("deterministic", "group_heads"):
            det, group = (v in ("1", "True"), group) if k == "deterministic" else (det, v == "1")
            continue
        out[k] = {"True": True, "False": False}.get(v, None)
        if out[k] is None:
            out[k] = int(v)
    return out, det, group, pre_ctas, tail_parts


def forced_tail(q, k, cfg: BwdTileConfig, parts: int | None, whole: bool):
    """run_bwd's `tail` for a `tail_parts=N` variant: every key tile (`whole`) or the last
    partial wave's, N parts each; None: the model's."""
    if parts is None or not cfg.tail_split:
        return None
    b, sq, h = q.shape[:3]
    tiles = -(-k.shape[1] // cfg.tile_n) * h * b
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return (tiles if whole else tiles % sms), parts


def problem(q, k, v, causal, deterministic=False, mask=None):
    mask = mask or dict(window_size=(None, None), softcap=0.0)
    return validation.validate_dense(
        q, k, v, softmax_scale=None, causal=causal, num_splits=0, pack_gqa=None,
        deterministic=deterministic, **mask,
    )  # fmt: skip


class Packed:
    """--varlen: a dense (B, S, H, D) problem run as B packed sequences of S tokens. Same
    calls as the dense path (problem, fwd, bwd) over the packed views; gradients come back in
    the dense shapes, so the reference check is the dense one."""

    @staticmethod
    def _cu(t):
        b, s = t.shape[:2]
        return torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=t.device)

    @staticmethod
    def _flat(t):
        return t.reshape(-1, *t.shape[2:])

    @classmethod
    def problem(cls, q, k, v, causal, deterministic=False, mask=None):
        mask = mask or dict(window_size=(None, None), softcap=0.0)
        return validation.validate_varlen(
            *(cls._flat(t) for t in (q, k, v)), cu_seqlens_q=cls._cu(q), cu_seqlens_k=cls._cu(k),
            max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1], seqused_q=None, seqused_k=None,
            page_table=None, softmax_scale=None, causal=causal, num_splits=0, pack_gqa=None,
            deterministic=deterministic, **mask,
        )  # fmt: skip

    @classmethod
    def fwd(cls, q, k, v, p):
        out, lse = api.flash_attn_varlen_func(
            *(cls._flat(t) for t in (q, k, v)), cu_seqlens_q=cls._cu(q),
            cu_seqlens_k=cls._cu(k), max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1],
            causal=p.causal, window_size=(p.window_left, p.window_right), softcap=p.softcap,
        )  # fmt: skip
        b, s, h = q.shape[:3]
        return out.view(b, s, h, -1), lse.view(h, b, s).transpose(0, 1)

    @classmethod
    def bwd(cls, q, k, v, out, lse, dout, p, key, pre_ctas=None, tail=None):
        flat = (cls._flat(t) for t in (q, k, v, out))
        lse = lse.transpose(0, 1).reshape(lse.shape[1], -1)
        g = run_bwd_varlen(
            *flat, lse, cls._flat(dout), p, cu_seqlens_q=cls._cu(q), cu_seqlens_k=cls._cu(k),
            key=key,
        )  # fmt: skip
        return tuple(t.view(r.shape) for t, r in zip(g, (q, k, v)))


def variant_key(p, overrides: dict, group: bool = False):
    # the table's tile without the run-time buckets (group_heads unless asked, and never the
    # short rows: `tile_m=64,dq_flat=False,s_under_dk=True` is that variant)
    key = bwd_key(p, group_heads=group)
    cfg = dataclasses.replace(BwdTileConfig(*key.tile), **overrides)
    return dataclasses.replace(key, tile=dataclasses.astuple(cfg)), cfg


def fa4_variant(small, do_small, ref_g, big, do_big, causal, mask):
    """FA4's backward (flash_attn.cute, autograd.grad over a kept forward graph, as the bench
    times it): (max error against the fp32 reference on the small problem, [], its call)."""
    from flash_attn.cute import flash_attn_func

    kw = dict(causal=causal)
    if mask["softcap"]:
        kw["softcap"] = mask["softcap"]
    if mask["window_size"] != (None, None):
        kw["window_size"] = mask["window_size"]

    def graph(ts):
        leaves = [t.detach().requires_grad_() for t in ts]
        out = flash_attn_func(*leaves, **kw)
        return (out[0] if isinstance(out, tuple) else out), leaves

    out_s, leaves_s = graph(small)
    g = torch.autograd.grad(out_s, leaves_s, do_small)
    err = max((a.float() - r).abs().max().item() for a, r in zip(g, ref_g))
    out_b, leaves_b = graph(big)

    def call():
        return torch.autograd.grad(out_b, leaves_b, do_big, retain_graph=True)

    for _ in range(2):
        call()
    return err, [], call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", default=[], help="name=overrides")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="tune_bwd.json")
    ap.add_argument("--softcap", type=float, default=0.0, help="every shape and variant")
    ap.add_argument("--window", default=None, help="LEFT,RIGHT for every shape (-1: none)")
    ap.add_argument("--varlen", action="store_true", help="B packed sequences of S tokens")
    ap.add_argument(
        "--fa4", action="store_true", help="FA4's backward as one more variant (dense only)"
    )
    args = ap.parse_args()
    if args.varlen:
        mk_problem, fwd, bwd = Packed.problem, Packed.fwd, Packed.bwd
    else:
        mk_problem, fwd = problem, run_fwd

        def bwd(q, k, v, out, lse, dout, p, key, pre_ctas=None, tail=None):
            return run_bwd(q, k, v, out, lse, dout, p, key=key, pre_ctas=pre_ctas, tail=tail)

    win = (None, None)
    if args.window:
        win = tuple(None if int(x) < 0 else int(x) for x in args.window.split(","))
    mask = dict(window_size=win, softcap=args.softcap)
    variants = [v.split("=", 1) for v in (args.variant or ["base="])]
    rows = []
    torch.manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    for shape in args.shapes.split(","):
        b, s, h, d, causal, hkv, dv = (SHAPES[shape] + (None, None))[:7]
        hkv, dv = hkv or h, dv or d
        # the small check problem: odd lengths, every mask corner of the variant's code
        small = [rnd(2, 333, h, d), rnd(2, 301, hkv, d), rnd(2, 301, hkv, dv)]
        ref_o, ref_lse = attention_ref(*small, causal=causal, **mask)
        do_small = rnd(*ref_o.shape)
        ref_g = attention_ref_backward(
            *(t.float() for t in small), ref_o, ref_lse, do_small.float(), causal=causal, **mask
        )
        big = [rnd(b, s, h, d), rnd(b, s, hkv, d), rnd(b, s, hkv, dv)]
        p_big = mk_problem(*big, causal, mask=mask)
        o_big, lse_big = fwd(*big, p_big)
        do_big = rnd(*o_big.shape)
        flops = 2.5 * 2 * b * h * (d + dv) * visible_pairs(s, s, causal, win)
        live = []
        for name, ov in variants:
            try:
                overrides, det, group, pre, parts = parse_override(ov)
                p_small = mk_problem(*small, causal, det, mask)
                key, cfg = variant_key(p_small, overrides, group)
                o_s, lse_s = fwd(*small, p_small)
                tail = forced_tail(*small[:2], cfg, parts, True)
                g = bwd(*small, o_s, lse_s, do_small, p_small, key, pre, tail)
                err = max((a.float() - r).abs().max().item() for a, r in zip(g, ref_g))
                p = dataclasses.replace(p_big, deterministic=det)
                key_big, _ = variant_key(p, overrides, group)
                tail = forced_tail(*big[:2], cfg, parts, False)
                for _ in range(2):
                    bwd(*big, o_big, lse_big, do_big, p, key_big, pre, tail)
                call = functools.partial(bwd, *big, o_big, lse_big, do_big, p, key_big, pre, tail)
                live.append((name, cfg, det, (key_big, pre, tail), err, [], call))
            except Exception as e:
                rows.append(dict(shape=shape, variant=name, error=f"{type(e).__name__}: {e}"[:300]))
        if args.fa4 and not args.varlen:
            try:
                err, times, call = fa4_variant(small, do_small, ref_g, big, do_big, causal, mask)
                live.append(("fa4", None, False, (None, None, None), err, times, call))
            except Exception as e:
                rows.append(
                    dict(shape=shape, variant="fa4", error=f"{type(e).__name__}: {e}"[:300])
                )
        for _rep in range(args.reps):
            for *_, times, call in live:
                # a call queued before the first event and INNER calls between the events: the
                # host's launch work overlaps GPU work instead of showing up as idle time
                st, en = torch.cuda.Event(True), torch.cuda.Event(True)
                call()
                st.record()
                for _ in range(INNER):
                    call()
                en.record()
                en.synchronize()
                times.append(st.elapsed_time(en) / INNER)
        for name, cfg, det, (_key, pre, tail), err, times, _call in live:
            times.sort()
            med = statistics.median(times)
            p95 = times[int(0.95 * (len(times) - 1))]
            row = dict(shape=shape, variant=name, config=cfg and dataclasses.asdict(cfg),
                       deterministic=det, pre_ctas=pre, tail=tail, varlen=args.varlen, err=err,
                       median_ms=med, p95_ms=p95,
                       tflops=flops / med / 1e9)  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    json.dump(rows, open(args.out, "w"), indent=1)
    # `xfa4`: FA4's median over the variant's (above 1: faster than FA4), with --fa4
    fa4 = {r["shape"]: r["median_ms"] for r in rows if r["variant"] == "fa4" and "error" not in r}
    print(f"\n{'shape':<18} {'variant':<12} {'ms':>8} {'p95':>8} {'TFLOP/s':>8} {'err':>9} xfa4")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<18} {r['variant']:<12} ERROR {r['error'][:60]}")
        else:
            vs = f" {fa4[r['shape']] / r['median_ms']:.3f}" if r["shape"] in fa4 else ""
            print(f"{r['shape']:<18} {r['variant']:<12} {r['median_ms']:8.3f} {r['p95_ms']:8.3f} "
                  f"{r['tflops']:8.1f} {r['err']:9.2e}{vs}")  # fmt: skip


if __name__ == "__main__":
    main()
