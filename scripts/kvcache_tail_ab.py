"""What a partial last key tile costs a KV-cache decode (H200 helper, not a test).

`flash_attn_with_kvcache` with cache lengths (seqused_k) zeroes the V rows of the last key
tile past each batch row's length in smem (FlashFwdSm90._zero_v_tail: they may be stale cache
rows) and masks that tile; a length that is a multiple of the key tile needs neither. Each
row times lengths L and L - 1 (one key fewer: the same traffic within 1 / L) in one cache of
capacity L + 128, one new token, 32 query heads over 8 KV heads, D=128, bf16, under CUDA
graphs of one and ten calls, in rounds (scripts/decode_splits.graph_rounds). The dense
flash_attn_func call of length L (no cache lengths) is the third variant; L and L - 1 with V
through the ragged view of the cache's rows (tile_config.fwd_ragged_cache forced on: no smem
zeroing) the fourth and fifth.

    python3 scripts/kvcache_tail_ab.py [--rounds 50] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_splits import _TableSwap, graph_rounds, one_and_ten_graphs  # noqa: E402

import cute_attn  # noqa: E402
from cute_attn import fwd_sm90  # noqa: E402
from cute_attn.bench import environment  # noqa: E402
from cute_attn.reference import attention_ref  # noqa: E402

ROWS = {"b1-32k": (1, 32768), "b8-8k": (8, 8192), "b64-8k": (64, 8192)}  # batch, length


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, (b, n) in ROWS.items():
        h, hkv, d = 32, 8, 128
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, n + 128, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn(b, n + 128, hkv, d, device="cuda", dtype=torch.bfloat16)
        # every variant's call (and the cache lengths it holds) lives as long as its graphs: a
        # replay reads its inputs where they were at capture, and until the forty-fifth
        # session each variant's lengths were freed when the next was built, so all but the
        # last variant of a row replayed over reused memory (b1-32k timed 5.4 us a call,
        # 24 TB/s; kvcache_tail_ab_s45_h200.log; most likely B=64's 88 us in the forty-first)
        graphs, keep = {}, []
        for label, length, ragged in (
            ("full", n, False),
            ("minus1", n - 1, False),
            ("ragged-full", n, True),
            ("ragged-minus1", n - 1, True),
        ):
            lens = torch.full((b,), length, dtype=torch.int32, device="cuda")

            def call(q=q, kc=kc, vc=vc, lens=lens):
                return cute_attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)

            rule = fwd_sm90.fwd_ragged_cache
            fwd_sm90.fwd_ragged_cache = lambda r=ragged: r  # plans and memo cleared around
            try:
                with _TableSwap():
                    ref = attention_ref(q, kc[:, :length], vc[:, :length],
                                        compute_dtype=torch.float32)  # fmt: skip
                    err = (call()[0].float() - ref[0]).abs().max().item()
                    assert err < 1e-2, (name, label, err)
                    graphs[label] = (*one_and_ten_graphs(call), err, 0)
                    keep.append(call)
            finally:
                fwd_sm90.fwd_ragged_cache = rule
        k, v = kc[:, :n].contiguous(), vc[:, :n].contiguous()
        ref = attention_ref(q, k, v, compute_dtype=torch.float32)
        err = (cute_attn.flash_attn_func(q, k, v)[0].float() - ref[0]).abs().max().item()
        assert err < 1e-2, (name, "dense", err)

        def dense(q=q, k=k, v=v):
            return cute_attn.flash_attn_func(q, k, v)

        graphs["dense"] = (*one_and_ten_graphs(dense), err, 0)
        rows += graph_rounds(name, graphs, b * n * hkv * d * 2 * 2, args.rounds)
    if args.out:
        json.dump(dict(environment=environment(torch.device("cuda")), rows=rows),
                  open(args.out, "w"), indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
