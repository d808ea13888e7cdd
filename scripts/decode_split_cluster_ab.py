"""Split decode merged inside a thread-block cluster against fp32 partials and the combine
kernel, round-robin under CUDA graphs (H200 helper, not a test).

One new token, 32 query heads over 8 KV heads, D=128, bf16, through `flash_attn_func`. Per
row, variants: the fp32 partials and the PDL-launched combine (`partials`, the library's
before tile_config.fwd_split_cluster) and the cluster merge (`cluster`, InputFeatures.
split_cluster) at the table's split count, the cluster merge at other counts, and on the
three-stage decode tile instead of the two-CTAs-per-SM one (`3stage`). Each variant is
checked against the fp32 reference (err column), captured as a CUDA graph of one call and of
ten, and the graphs are replayed in rounds (every variant once a round) so that clock drift
hits them alike; median and p95 us per call.

    OUT=. python3 scripts/decode_split_cluster_ab.py   # -> decode_split_cluster_ab_h200.json
    SECOND=1 OUT=. python3 scripts/decode_split_cluster_ab.py   # -> ..._ab_b_h200.json
    THIRD=1 OUT=. python3 scripts/decode_split_cluster_ab.py    # -> ..._ab_c_h200.json
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
from cute_attn import fwd_sm90  # noqa: E402
from cute_attn.bench import environment  # noqa: E402

THREE_STAGE = dict(tile_n=128, num_stages=3, ctas_per_sm=1)
# name: (batch, seqlen_k, [(label, splits or None for the table's, cluster, tile overrides)])
ROWS_FIRST = {  # the first run (decode_split_cluster_ab_h200.json)
    "b8-8k": (
        8,
        8192,
        [
            ("partials", None, False, {}),
            ("cluster", None, True, {}),
            ("cluster-3stage", None, True, THREE_STAGE),
            ("cluster-3", 3, True, {}),
            ("cluster-4", 4, True, {}),
        ],
    ),
    "b4-16k": (
        4,
        16384,
        [("partials", None, False, {}), ("cluster", None, True, {}), ("cluster-8", 8, True, {})],
    ),
    "b1-32k": (
        1,
        32768,
        [
            ("partials", None, False, {}),
            ("cluster-8", 8, True, {}),
            ("cluster-8-3stage", 8, True, THREE_STAGE),
        ],
    ),
}
ROWS_SECOND = {  # clusters of 3 / 4 on the one-CTA-per-SM tile (decode_split_cluster_ab_b_h200)
    "b8-8k": (8, 8192, [("partials", None, False, {}), ("cluster", None, True, {}),
                        ("partials-3", 3, False, {}), ("cluster-3", 3, True, {}),
                        ("cluster-3-3stage", 3, True, THREE_STAGE)]),
    "b4-16k": (4, 16384, [("partials", None, False, {}), ("cluster", None, True, {}),
                          ("cluster-3stage", None, True, THREE_STAGE),
                          ("partials-2", 2, False, {}), ("cluster-2", 2, True, {})]),
}  # fmt: skip
# deeper pipelines of short key tiles on one CTA an SM (the split grids fill one wave of one
# CTA an SM, so the table's two-CTA tile leaves half its smem unused), and the merge over the
# used rows only (FwdTileConfig.merge_used_rows); spill-free on sm_90a
DEEP = {f"{n}x{s}": dict(tile_n=n, num_stages=s, ctas_per_sm=1)
        for n, s in ((64, 3), (64, 4), (64, 6), (32, 8))}  # fmt: skip
ROWS_THIRD = {  # decode_split_cluster_ab_c_h200.json
    "b8-8k": (8, 8192, [("cluster", None, True, {}),
                        ("cluster-usedrows", None, True, {"merge_used_rows": True})]
              + [(f"cluster-{k}", None, True, o) for k, o in DEEP.items()]),
    "b1-32k": (1, 32768, [("partials", None, False, {})]
               + [(f"partials-{k}", None, False, o) for k, o in DEEP.items()]),
}  # fmt: skip
ROWS, SUFFIX = {"SECOND": (ROWS_SECOND, "_b"), "THIRD": (ROWS_THIRD, "_c")}.get(
    next((k for k in ("SECOND", "THIRD") if os.environ.get(k)), ""), (ROWS_FIRST, "")
)
ROUNDS = 80


class _ClusterSwap:
    """Within the block, splits merge in a cluster (`on`) or through partials (not `on`)."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        self.orig = fwd_sm90.fwd_split_cluster

        def patched(num_splits, head_dim_v):
            return self.on and self.orig(num_splits, head_dim_v)

        fwd_sm90.fwd_split_cluster = patched
        ds._TableSwap()._clear()

    def __exit__(self, *exc):
        fwd_sm90.fwd_split_cluster = self.orig
        ds._TableSwap()._clear()


def main():
    out = []
    for name, (b, sk, variants) in ROWS.items():
        torch.manual_seed(0)
        q, k, v, ref, table = ds.decode_inputs(b, sk)
        graphs = {}
        for label, splits, cluster, overrides in variants:
            n = splits or table
            with _ClusterSwap(cluster), ds._TableSwap(**overrides):

                def fn(n=n, q=q, k=k, v=v):
                    return cute_attn.flash_attn_func(q, k, v, num_splits=n)[0]

                err = float((fn().float() - ref).abs().max())
                one, ten = ds.one_and_ten_graphs(fn)
            graphs[label] = (one, ten, err, n)
        out += ds.graph_rounds(name, graphs, 2 * k.numel() * 2, ROUNDS, width=16)
    path = os.path.join(os.environ.get("OUT", "."), f"decode_split_cluster_ab{SUFFIX}_h200.json")
    with open(path, "w") as f:
        json.dump({"environment": environment(torch.device("cuda")), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
