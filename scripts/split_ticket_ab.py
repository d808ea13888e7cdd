"""Split-KV partials merged by the combine kernel against the tile's last split
(`InputFeatures.split_ticket`), round-robin under CUDA graphs (GPU helper, not a test).

32 query heads over 8 KV heads, bf16, at the table's split count. Rows: one new token at
D=128 (B=1 Sk=32k: 16 splits; B=4 Sk=16k: 4 splits), the same B=1 row through
`flash_attn_with_kvcache` (cache lengths), four speculative query rows under the causal corner
(B=1 Sk=32k: 16 packed GQA rows a tile), and one new token at D=256 (B=8 Sk=8k: two splits,
which D=256 merges through partials, tile_config.fwd_split_cluster). Each variant is checked
against the fp32 reference (err column), captured as a CUDA graph of one call and of ten, and
the graphs are replayed in rounds (every variant once a round); median and p95 us per call.

    OUT=. python3 scripts/split_ticket_ab.py   # -> $OUT/split_ticket_ab_<gpu>.json
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
from cute_attn import fwd_sm90, split_tickets  # noqa: E402
from cute_attn.bench import environment  # noqa: E402
from cute_attn.reference import attention_ref  # noqa: E402

ROUNDS = 40
# name: (batch, seqlen_k, query rows, head dim, through the KV-cache entry)
ROWS = {
    "b1-32k": (1, 32768, 1, 128, False),
    "b4-16k": (4, 16384, 1, 128, False),
    "kvcache-b1-32k": (1, 32768, 1, 128, True),
    "spec-b1-32k-q4": (1, 32768, 4, 128, False),
    "b8-8k-d256": (8, 8192, 1, 256, False),
}


class _TicketSwap:
    """Within the block, split partials merge in the last split (`on`) or in the combine."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        self.orig = fwd_sm90.fwd_split_ticket
        fwd_sm90.fwd_split_ticket = lambda rows: self.on
        ds._TableSwap()._clear()

    def __exit__(self, *exc):
        fwd_sm90.fwd_split_ticket = self.orig
        ds._TableSwap()._clear()


def main():
    out = []
    for name, (b, sk, sq, d, cache) in ROWS.items():
        torch.manual_seed(0)
        q = torch.randn(b, sq, 32, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, sk, 8, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, sk, 8, d, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
        ref = attention_ref(q, k, v, compute_dtype=torch.float32, causal=True)[0]
        graphs = {}
        for label, on in (("combine", False), ("ticket", True)):
            with _TicketSwap(on):

                def fn(q=q, k=k, v=v, lens=lens, cache=cache):
                    if cache:
                        return cute_attn.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)[0]
                    return cute_attn.flash_attn_func(q, k, v, causal=True)[0]

                # which merge ran: the last-split one asks split_tickets for counters
                asked = []
                take = split_tickets.tickets
                split_tickets.tickets = lambda *a, asked=asked, take=take: (
                    asked.append(a), take(*a))[1]  # fmt: skip
                try:
                    err = float((fn().float() - ref).abs().max())
                finally:
                    split_tickets.tickets = take
                assert bool(asked) == on, (name, label, asked)
                one, ten = ds.one_and_ten_graphs(fn)
                print(f"{name} {label}: err {err:.2e}, counters {asked}", flush=True)
            graphs[label] = (one, ten, err, 0)
        out += ds.graph_rounds(name, graphs, 2 * k.numel() * 2, ROUNDS, width=8)
    gpu = torch.cuda.get_device_name().split()[1].lower()
    path = os.path.join(os.environ.get("OUT", "."), f"split_ticket_ab_{gpu}.json")
    with open(path, "w") as f:
        json.dump({"environment": environment(torch.device("cuda")), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
