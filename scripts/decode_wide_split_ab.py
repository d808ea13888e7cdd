"""Split decode rows on the two decode tiles, round-robin under CUDA graphs (H200 helper, not a
test).

One new token, 32 query heads over 8 KV heads, D=128, bf16, through `flash_attn_func` at the
table's split count: the 128-key, three-stage packed-decode tile against the 64-key, two-stage
tile with two CTAs per SM (the table's since the thirty-fifth session), and that tile at twice
the splits. Each variant is checked against the fp32 reference (err column), captured as a CUDA
graph of one call and of ten, and the graphs are replayed in rounds (every variant once a
round) so that clock drift hits them alike; median and p95 us per call.

    OUT=. python3 scripts/decode_wide_split_ab.py   # -> decode_wide_split_ab_s35_h200.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import decode_splits as ds  # noqa: E402

import cute_attn  # noqa: E402

ROWS = {"b1-32k": (1, 32768), "b8-8k": (8, 8192)}
THREE_STAGE = dict(tile_n=128, num_stages=3, ctas_per_sm=1)
TWO_CTA = dict(tile_n=64, num_stages=2, ctas_per_sm=2)
ROUNDS = 80


def main():
    out = []
    for name, (b, sk) in ROWS.items():
        torch.manual_seed(0)
        q, k, v, ref, splits = ds.decode_inputs(b, sk)
        variants = {"table": (THREE_STAGE, splits), "wide": (TWO_CTA, splits),
                    "wide2x": (TWO_CTA, 2 * splits)}  # fmt: skip
        graphs = {}
        for label, (overrides, n) in variants.items():
            with ds._TableSwap(**overrides):

                def fn(n=n, q=q, k=k, v=v):
                    return cute_attn.flash_attn_func(q, k, v, num_splits=n)[0]

                err = float((fn().float() - ref).abs().max())
                one, ten = ds.one_and_ten_graphs(fn)
            graphs[label] = (one, ten, err, n)
        out += ds.graph_rounds(name, graphs, 2 * k.numel() * 2, ROUNDS)
    path = os.path.join(os.environ.get("OUT", "."), "decode_wide_split_ab_s35_h200.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
