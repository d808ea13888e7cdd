"""Measure SM90 forward tile-config variants against each other on the GPU, in one process.

Each variant is a FwdTileConfig override (tile_n, num_stages, pingpong, intra_wg_overlap,
rescale_threshold, ...) compiled through the same cached builder the library uses; each is
first checked against the fp32 reference on a small odd-sized problem, then timed with CUDA
events (median and p95 of --reps after warm-up, inputs rotated past L2).

    python scripts/tune_sm90.py --out tune.json \
        --variant base= --variant tn176=tile_n=176 --variant nopp=pingpong=False

Window shapes (an eighth field, the left size) run the sliding-window mask (left, 0) in the
table's local variant; the reference check on the small problem takes a window of 100 keys.

Decode shapes run the packed-decode layout the library launches at Sq = 1 with 32 query heads
over 8 KV heads (q as (B, 4, 8, D): the 4 query heads of a KV head are 4 rows, no mask) from
the decode tile config, and report TB/s of K + V read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from cute_attn.arch.sm90.tile_config import fills_tall_tiles, fwd_persistent, fwd_tile_config
from cute_attn.bench import visible_pairs
from cute_attn.fwd_sm90 import FwdKey, build_fwd, softmax_scales
from cute_attn.reference import attention_ref

SHAPES = {  # name: (batch, seqlen_q, seqlen_k, heads, head_dim, causal, decode[, window left])
    "d128-16k": (1, 16384, 16384, 16, 128, False, False),
    "d128-16k-causal": (1, 16384, 16384, 16, 128, True, False),
    "d128-4k": (4, 4096, 4096, 16, 128, False, False),
    "d128-1k-causal": (16, 1024, 1024, 16, 128, True, False),
    "d128-1k": (16, 1024, 1024, 16, 128, False, False),
    "d128-4k-causal": (4, 4096, 4096, 16, 128, True, False),
    "d128-2k-causal": (8, 2048, 2048, 16, 128, True, False),
    "d128-8k-causal": (2, 8192, 8192, 16, 128, True, False),
    "d128-6k-causal": (3, 6144, 6144, 16, 128, True, False),
    "d128-2k": (8, 2048, 2048, 16, 128, False, False),
    "d128-8k": (2, 8192, 8192, 16, 128, False, False),
    "d96-16k": (1, 16384, 16384, 16, 96, False, False),  # 16 heads (2048 / 96 is no integer)
    "d96-4k": (4, 4096, 4096, 16, 96, False, False),
    "d96-4k-causal": (4, 4096, 4096, 16, 96, True, False),
    "d64-16k": (1, 16384, 16384, 32, 64, False, False),
    "d64-16k-causal": (1, 16384, 16384, 32, 64, True, False),
    "d64-4k": (4, 4096, 4096, 32, 64, False, False),
    "d64-4k-causal": (4, 4096, 4096, 32, 64, True, False),
    "d64-1k": (16, 1024, 1024, 32, 64, False, False),
    "d256-16k": (1, 16384, 16384, 8, 256, False, False),
    "d256-16k-causal": (1, 16384, 16384, 8, 256, True, False),
    "d192-4k": (4, 4096, 4096, 12, 192, False, False),
    "d192-4k-causal": (4, 4096, 4096, 12, 192, True, False),
    "d192-16k": (1, 16384, 16384, 12, 192, False, False),
    "d192-16k-causal": (1, 16384, 16384, 12, 192, True, False),
    "d192-1k": (16, 1024, 1024, 12, 192, False, False),
    "d192-1k-causal": (16, 1024, 1024, 12, 192, True, False),
    # (D, Dv) = (192, 128): DV names the value head dim
    "d192v128-4k": (4, 4096, 4096, 12, 192, False, False),
    "d192v128-4k-causal": (4, 4096, 4096, 12, 192, True, False),
    "d192v128-16k-causal": (1, 16384, 16384, 12, 192, True, False),
    "d256-4k": (4, 4096, 4096, 8, 256, False, False),
    "d256-4k-causal": (4, 4096, 4096, 8, 256, True, False),
    "d256-1k": (16, 1024, 1024, 8, 256, False, False),
    "d256-1k-causal": (16, 1024, 1024, 8, 256, True, False),
    "d64-1k-causal": (16, 1024, 1024, 32, 64, True, False),
    "d64-2k-causal": (8, 2048, 2048, 32, 64, True, False),
    "d64-8k-causal": (2, 8192, 8192, 32, 64, True, False),
    "d64-6k-causal": (3, 6144, 6144, 32, 64, True, False),
    "d64-5k-causal": (3, 5120, 5120, 32, 64, True, False),
    "d64-2k": (8, 2048, 2048, 32, 64, False, False),
    "d64-8k": (2, 8192, 8192, 32, 64, False, False),
    # sliding windows (left, 0): the local mask
    "d128-4k-win1k": (4, 4096, 4096, 16, 128, False, False, 1024),
    "d128-8k-win1k": (2, 8192, 8192, 16, 128, False, False, 1024),
    "d128-16k-win4k": (1, 16384, 16384, 16, 128, False, False, 4096),
    "d64-8k-win1k": (2, 8192, 8192, 32, 64, False, False, 1024),
    "d128-16k-win1k": (1, 16384, 16384, 16, 128, False, False, 1024),
    "d64-4k-win128": (4, 4096, 4096, 32, 64, False, False, 128),
    "d64-8k-win256": (2, 8192, 8192, 32, 64, False, False, 256),
    "d64-8k-win512": (2, 8192, 8192, 32, 64, False, False, 512),
    "d96-8k-win1k": (2, 8192, 8192, 16, 96, False, False, 1024),
    "d192-8k-win1k": (2, 8192, 8192, 12, 192, False, False, 1024),
    "d192v128-8k-win1k": (2, 8192, 8192, 16, 192, False, False, 1024),
    "d256-8k-win1k": (2, 8192, 8192, 8, 256, False, False, 1024),
    "d256-16k-win4k": (1, 16384, 16384, 8, 256, False, False, 4096),
    "d64-16k-win512": (1, 16384, 16384, 32, 64, False, False, 512),
    "d64-16k-win1k": (1, 16384, 16384, 32, 64, False, False, 1024),
    "d64-16k-win2k": (1, 16384, 16384, 32, 64, False, False, 2048),
    "d64-16k-win4k": (1, 16384, 16384, 32, 64, False, False, 4096),
    "decode-b8-8k": (8, 4, 8192, 8, 128, False, True),
    "decode-b64-8k": (64, 4, 8192, 8, 128, False, True),
    "decode-b128-2k": (128, 4, 2048, 8, 128, False, True),
    # grids of 1 to 3 waves without a split (8 KV heads: 128, 192, 264, 384 CTAs)
    "decode-b16-8k": (16, 4, 8192, 8, 128, False, True),
    "decode-b24-8k": (24, 4, 8192, 8, 128, False, True),
    "decode-b33-8k": (33, 4, 8192, 8, 128, False, True),
    "decode-b48-4k": (48, 4, 4096, 8, 128, False, True),
}

DV = {name: 128 for name in SHAPES if name.startswith("d192v128-")}  # Dv where it is not D

INNER = 5


def parse_override(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        k, v = item.split("=")
        out[k] = {"True": True, "False": False}.get(v, None)
        if out[k] is None:
            try:
                out[k] = float(v) if "." in v else int(v)
            except ValueError:  # a string knob (kv_l2_hint=first)
                out[k] = v
    return out


def run(fn_key, q, k, v, window, scale, out=None, lse=None):
    fn = build_fwd(fn_key)
    if out is None:
        out = q.new_empty(*q.shape[:3], v.shape[3])
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device="cuda", dtype=torch.float32)
    s_log2, premul = softmax_scales(scale, 0.0)
    left, right = (max(w, 0) for w in window)
    fn(q, k, v, out, lse, s_log2, premul, left, right, q.shape[1], 1, *[None] * 7)
    return out, lse


def key_for(d, dv, h, window, cfg):
    has_left, has_right = (w >= 0 for w in window)
    cfg = dataclasses.astuple(cfg)
    return FwdKey("sm_90a", "bfloat16", d, dv, h, h, has_left, has_right, False, cfg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", default=[], help="name=overrides")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="tune.json")
    args = ap.parse_args()
    variants = [v.split("=", 1) for v in (args.variant or ["base="])]
    rows = []
    for shape in args.shapes.split(","):
        b, sq, sk, h, d, causal, decode, *left = SHAPES[shape]
        dv = DV.get(shape, d)
        left = left[0] if left else -1
        local = left >= 0  # a sliding window (left, 0)
        # (left, right), -1 for an open side; the small check takes a window of 100 keys (the
        # window is a runtime value of the same kernel)
        window = (left, 0 if causal or local else -1)
        small_window = (min(left, 100), window[1])
        ref_window = tuple(None if w < 0 else w for w in small_window)
        # the variant the library runs for this shape (tall: the long-query bucket; the
        # persistent-grid bucket of dense rows)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        tall = not decode and fills_tall_tiles(sq, *window)
        base = fwd_tile_config(
            d, dv, causal, local, decode, tall=tall,
            persistent_sms=sms if fwd_persistent(d, sk, *window) else 0,
        )  # fmt: skip
        n_sets = max(1, (200 << 20) // ((sq + 2 * sk) * b * h * d * 2))

        def rnd(*shape):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

        sets = [[rnd(b, sq, h, d), rnd(b, sk, h, d), rnd(b, sk, h, dv)] for _ in range(n_sets)]
        small = [rnd(2, sq if decode else 333, h, d), rnd(2, 333, h, d), rnd(2, 333, h, dv)]
        ref, _ = attention_ref(*small, causal=causal, window_size=ref_window)
        # Q K^T and P V: 2 flops a multiply-add, d and dv of them per visible pair
        pairs = visible_pairs(sq, sk, causal, tuple(None if w < 0 else w for w in window))
        flops = 2 * b * h * (d + dv) * pairs
        kv_bytes = b * sk * h * (d + dv) * 2
        # compile and check every variant first, then time them round-robin so that clock
        # and thermal drift hit all variants alike (sequential blocks differed by ~7% for
        # the very same kernel on the H200)
        live = []
        for name, ov in variants:
            try:
                cfg = dataclasses.replace(base, **parse_override(ov))
                key = key_for(d, dv, h, window, cfg)
                o, _ = run(key, *small, small_window, d**-0.5)
                err = (o.float() - ref).abs().max().item()
                for i in range(3):
                    run(key, *sets[i % n_sets], window, d**-0.5)
                live.append((name, cfg, key, err, []))
            except Exception as e:
                rows.append(dict(shape=shape, variant=name, error=f"{type(e).__name__}: {e}"[:300]))
        outs = [
            (q.new_empty(b, sq, h, dv), torch.empty(b, h, sq, device="cuda")) for q, _, _ in sets
        ]
        for rep in range(args.reps):
            for _name, _cfg, key, _err, times in live:
                # INNER back-to-back launches per event pair: the host's launch cost overlaps
                # the previous kernel instead of showing up as GPU idle time
                st, en = torch.cuda.Event(True), torch.cuda.Event(True)
                run(key, *sets[rep % n_sets], window, d**-0.5, *outs[rep % n_sets])
                st.record()
                for i in range(INNER):
                    j = (rep + i) % n_sets
                    run(key, *sets[j], window, d**-0.5, *outs[j])
                en.record()
                en.synchronize()
                times.append(st.elapsed_time(en) / INNER)
        for name, cfg, _key, err, times in live:
            times.sort()
            med = statistics.median(times)
            row = dict(shape=shape, variant=name, config=dataclasses.asdict(cfg), err=err,
                       median_ms=med, p95_ms=times[int(0.95 * (len(times) - 1))],
                       tflops=flops / med / 1e9, tbps=kv_bytes / med / 1e9)  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    json.dump(rows, open(args.out, "w"), indent=1)
    print(f"\n{'shape':<18} {'variant':<12} {'ms':>8} {'p95':>8} {'TFLOP/s':>8} {'TB/s':>6} "
          f"{'err':>9}")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<18} {r['variant']:<12} ERROR {r['error'][:60]}")
        else:
            print(f"{r['shape']:<18} {r['variant']:<12} {r['median_ms']:8.3f} {r['p95_ms']:8.3f} "
                  f"{r['tflops']:8.1f} {r['tbps']:6.2f} {r['err']:9.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
