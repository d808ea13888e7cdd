"""What the varlen grid's idle CTAs cost on the GPU.

The varlen forward's grid is (ceil(max_seqlen_q / tile_m), heads, batch): the query tiles past
a shorter sequence's end launch, read their sequence's bounds and exit. This times varlen
calls (32/8 heads, D=128, causal, 10 back-to-back calls per CUDA-event pair, median of 20)
whose grid is sized by a large max_seqlen_q while the sequences are tiny, against the same
sequences with a tight max_seqlen_q, and the bench's 16-sequence varlen row.

    CUTE_ATTN_CHECK_VALUES=0 OUT=. python scripts/varlen_idle_ctas.py  # -> varlen_idle_ctas.json

(Without CUTE_ATTN_CHECK_VALUES=0 every call syncs on the host to check cu_seqlens.)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from varlen_order import round_robin  # noqa: E402

import cute_attn  # noqa: E402
from cute_attn.bench import VARLEN_SEQLENS  # noqa: E402

CASES = (  # name, sequence lengths, max_seqlen_q (sizes the grid)
    ("16x1 grid8192", (1,) * 16, 8192),
    ("16x1 grid128", (1,) * 16, 128),
    ("16x128 grid8192", (128,) * 16, 8192),
    ("16x128 grid128", (128,) * 16, 128),
    ("bench row", VARLEN_SEQLENS, max(VARLEN_SEQLENS)),
)


def timed(fn, reps: int = 20, inner: int = 10) -> float:
    """Median ms per call: varlen_order.round_robin's timer with one label."""
    return statistics.median(round_robin({"call": fn}, reps, per_event=inner)["call"])


def main():
    out = []
    for name, lens, max_seqlen in CASES:
        total = sum(lens)
        offsets = [0] + torch.tensor(lens).cumsum(0).tolist()
        cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
        q = torch.randn(total, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16)

        def call(q=q, k=k, v=v, cu=cu, m=max_seqlen):
            return cute_attn.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m,
                causal=True,
            )  # fmt: skip

        ms = timed(call)
        ctas = -(-max_seqlen // 128) * 32 * len(lens)
        busy = sum(-(-n // 128) for n in lens) * 32
        out.append(dict(name=name, ms=ms, grid_ctas=ctas, working_ctas=busy))
        print(f"{name:18s} {ms * 1000:9.1f} us  grid {ctas} CTAs, {busy} working", flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "varlen_idle_ctas.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
