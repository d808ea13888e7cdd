"""Packed GQA rows for more than one query row, against unpacked launches (H200 helper, not a
test).

Speculative decoding calls `flash_attn_with_kvcache` with a few query rows (Sq = 2..8) under
the bottom-right causal corner. Unpacked, each CTA computes one query head's Sq rows and reads
its KV head's whole cache; packed (InputFeatures.pack_gqa, tile_config.fwd_pack_gqa forced on
here), one CTA computes the G x Sq rows of a KV head's G query heads and reads the cache once.
Each row: 32 query heads over 8 KV heads, D=128, bf16, a read-only call over cache lengths L
(the new keys already appended), both variants checked against the fp32 reference, then timed
under CUDA graphs of one and ten calls in rounds (scripts/decode_splits.graph_rounds). TB/s
counts K + V read once.

    python3 scripts/pack_gqa_ab.py [--rounds 50] [--out FILE.json]
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
from cute_attn.arch.common.features import InputFeatures  # noqa: E402
from cute_attn.bench import environment  # noqa: E402
from cute_attn.reference import attention_ref  # noqa: E402

ROWS = {  # batch, cache length, query rows
    "b1-32k-q4": (1, 32768, 4),
    "b8-8k-q2": (8, 8192, 2),
    "b8-8k-q4": (8, 8192, 4),
    "b8-8k-q8": (8, 8192, 8),
    "b64-8k-q4": (64, 8192, 4),
    "b128-2k-q4": (128, 2048, 4),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, (b, n, sq) in ROWS.items():
        h, hkv, d = 32, 8, 128
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        ref = attention_ref(q, kc, vc, causal=True, compute_dtype=torch.float32)[0]

        def call(q=q, kc=kc, vc=vc, lens=lens):
            return cute_attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)

        graphs = {}
        for label, packed in (("unpacked", False), ("packed", True)):
            rule, build, keys = fwd_sm90.fwd_pack_gqa, fwd_sm90.build_fwd, []
            fwd_sm90.fwd_pack_gqa = lambda seqlen_q, group, p=packed: p  # memos cleared around
            fwd_sm90.build_fwd = lambda key, keys=keys, build=build: (keys.append(key),
                                                                     build(key))[1]  # fmt: skip
            try:
                with _TableSwap():
                    out = call()[0]
                    err = (out.float() - ref).abs().max().item()
                    flags = {InputFeatures(*key.features).pack_gqa for key in keys}
                    assert err < 1e-2 and flags == {packed}, (name, label, err, flags)
                    graphs[label] = (*one_and_ten_graphs(call), err, 0)
            finally:
                fwd_sm90.fwd_pack_gqa, fwd_sm90.build_fwd = rule, build
        rows += graph_rounds(name, graphs, b * n * hkv * d * 2 * 2, args.rounds, width=8)
    if args.out:
        json.dump(dict(environment=environment(torch.device("cuda")), rows=rows),
                  open(args.out, "w"), indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
