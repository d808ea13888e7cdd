"""Two open questions of the forty-first session, for the next lent H200 (helper, not a test).

1. Packed GQA rows (tile_config.fwd_pack_gqa forced on): the GPU test
   test_kvcache_pack_gqa_rows[64-16-2-6-1-window] (D=64, 16 / 2 heads, Sq = 6, window
   (37, 11), not causal, one split) failed with only the last query row's lse right. Each
   line below changes one thing from that case (head dim, which bounds, Sq, group, split
   count, appended keys, packing off, the test's poisoned stale rows) and prints the max
   |out - fp32 ref| per batch row and the lse error per query of batch row 0 (cache lengths
   0, 1, 333, 694 before the append).
2. The KV-cache memo under CUDA graphs: kvcache_tail_ab's B=64 full-length row timed 88 us
   (24 TB/s of K + V), one key shorter 482 us. For B = 8 / 64 and both lengths: the first
   (eager) call, a second call through the memo's launcher and a graph replay, each against
   the fp32 reference, and the graph's time a call.

    python3 scripts/pack_gqa_diag.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_splits import _TableSwap  # noqa: E402

import cute_attn  # noqa: E402
from cute_attn import fwd_sm90  # noqa: E402
from cute_attn.bench import capture_graph  # noqa: E402
from cute_attn.reference import attention_ref  # noqa: E402

# (d, H, Hkv, Sq, num_splits, window), overrides of case()'s keywords
PACK_VARIANTS = [
    ((64, 16, 2, 6, 1, (37, 11)), {}),  # the failing test's shape and window
    ((64, 16, 2, 6, 1, (37, 11)), {"poison": True}),  # ... and its Inf / NaN stale rows
    ((64, 16, 2, 6, 1, (37, 11)), {"packed": False}),
    ((128, 16, 2, 6, 1, (37, 11)), {}),
    ((64, 16, 2, 6, 1, (37, 11)), {"new": False}),
    ((64, 16, 2, 6, 1, (None, 11)), {}),
    ((64, 16, 2, 6, 1, (37, None)), {}),
    ((64, 16, 2, 6, 1, (None, None)), {"causal": True}),
    ((64, 8, 2, 6, 1, (37, 11)), {}),
    ((64, 16, 2, 2, 1, (37, 11)), {}),
    ((64, 16, 2, 8, 1, (37, 11)), {}),
    ((64, 16, 2, 6, 0, (37, 11)), {}),
    ((128, 8, 2, 4, 0, (37, 11)), {}),
    ((128, 8, 2, 4, 0, (None, 2)), {}),
]


def _clear():
    # plans, keys, both entries' memos and the paged route (as the A/B scripts' swaps)
    _TableSwap()._clear()


def case(d, h, hkv, sq, splits, window, causal=False, new=True, packed=True, poison=False):
    rule = fwd_sm90.fwd_pack_gqa
    fwd_sm90.fwd_pack_gqa = lambda seqlen_q, tile_m, group: packed
    _clear()
    try:
        g = torch.Generator(device="cuda").manual_seed(d + h + sq)

        def mk(*s):
            return torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)

        b, cap = 4, 700
        q, kc, vc = mk(b, sq, h, d), mk(b, cap, hkv, d), mk(b, cap, hkv, d)
        kn, vn = (mk(b, sq, hkv, d), mk(b, sq, hkv, d)) if new else (None, None)
        lens_old = [0, 1, 333, cap - sq]
        if poison:  # the cache rows past each row's length hold Inf (k) / NaN (v), as in the test
            for i, n_old in enumerate(lens_old):
                kc[i, n_old:] = float("inf")
                vc[i, n_old:] = float("nan")
        n = torch.tensor(lens_old, dtype=torch.int32, device="cuda")
        kw = dict(causal=causal, window_size=window)
        out, lse = cute_attn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=n,
                                                     num_splits=splits, **kw)  # fmt: skip
        errs, lse_err = [], None
        for i, n_old in enumerate(lens_old):
            keys = n_old + sq * new
            ref, ref_lse = attention_ref(q[i : i + 1], kc[i : i + 1, :keys], vc[i : i + 1, :keys],
                                         compute_dtype=torch.float32, **kw)  # fmt: skip
            errs.append((out[i : i + 1].float() - ref).abs().max().item())
            if i == 0:
                lse_err = (lse[0] - ref_lse[0]).abs().amax(dim=0).tolist()
        print(f"d{d} h{h}/{hkv} sq{sq} splits{splits} window{window} causal={causal} new={new} "
              f"packed={packed} poison={poison}: err {[f'{e:.2g}' for e in errs]}, "
              f"lse err by query (row 0) {[f'{e:.2g}' for e in lse_err]}", flush=True)  # fmt: skip
    finally:
        fwd_sm90.fwd_pack_gqa = rule
        _clear()


def memo_graphs(b, n):
    torch.manual_seed(0)
    h, hkv, d = 32, 8, 128
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(b, n + 128, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(b, n + 128, hkv, d, device="cuda", dtype=torch.bfloat16)
    for length in (n, n - 1):
        _clear()
        lens = torch.full((b,), length, dtype=torch.int32, device="cuda")

        def call(lens=lens):
            return cute_attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)

        ref = attention_ref(q, kc[:, :length], vc[:, :length], compute_dtype=torch.float32)[0]
        eager = call()[0].clone()
        memo = call()[0].clone()
        graph, out = capture_graph(call, warmup=3)
        out[0].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        errs = " / ".join(f"{(x.float() - ref).abs().max().item():.2e}"
                          for x in (eager, memo, out[0]))  # fmt: skip
        us = start.elapsed_time(end) / 20 * 1e3
        print(f"B={b} length {length}: err eager / memo / graph {errs}, graph {us:.1f} us a call",
              flush=True)  # fmt: skip


def main():
    for args, kw in PACK_VARIANTS:
        try:
            case(*args, **kw)
        except Exception as e:  # a variant that does not build or run: say so, go on
            print(args, kw, "failed:", type(e).__name__, str(e)[:300], flush=True)
    for b in (8, 64):
        memo_graphs(b, 8192)


if __name__ == "__main__":
    main()
