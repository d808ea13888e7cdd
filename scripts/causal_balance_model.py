"""A list-scheduling model of the backward's causal grids on the CPU: how far the launch order
(L2 sections, BwdTileConfig.l2_last_sections) puts a grid's end past the ideal.

The model: one CTA an SM (the backward's register budgets take the whole file), CTAs start in
launch order on the first free SM, a key tile costs its query tiles plus `--overhead` (its
prologue and dK / dV epilogue, in query-tile units). The ideal is the total cost over the SMs;
LPT is every tile of the grid longest first (one section of every pair, which the
twenty-fifth session measured 33-42% slower at 4k for its L2 misses: the model has no L2).
A model, not a measurement: it says where to look (scripts/gpu_pending.sh balance_ab times
it). D = 64's table has no sections: its k columns are sections of one pair.

    python scripts/causal_balance_model.py [--sms 132] [--overhead 3] [--last 1 2 3 4]
"""

from __future__ import annotations

import argparse
import heapq

from cute_attn.arch.sm90.tile_config import bwd_short_rows, bwd_tile_config

# the bench's causal backward rows: (name, head dim, head dim v, heads) at 16 x 1k, 4 x 4k,
# 1 x 16k tokens (cute_attn.bench, preset bwd and the full preset's D = 192 rows)
ROWS = [("d64", 64, 64, 32), ("d96", 96, 96, 21), ("d128", 128, 128, 16),
        ("d192", 192, 192, 10), ("d192/128", 192, 128, 16), ("d256", 256, 256, 8)]  # fmt: skip
LENGTHS = [(1024, 16), (4096, 4), (16384, 1)]


def key_tile_walks(seqlen: int, tile_m: int, tile_n: int) -> list[int]:
    """Query tiles each key tile walks under the causal mask (Sq = Sk), key tile 0 first."""
    num_m = -(-seqlen // tile_m)
    return [num_m - (tile_n * n) // tile_m for n in range(-(-seqlen // tile_n))]


def section_width(rows: int, row_bytes: int, budget: int, max_pairs: int = 1024) -> int:
    """L2Sections.create's pairs a section: the largest power of two whose bytes fit."""
    width = 1
    while width * 2 <= max_pairs and rows * row_bytes * width * 2 <= budget:
        width *= 2
    return width


def launch_order(walks: list[int], pairs: int, width: int, last: int) -> list[int]:
    """The walks in launch order: sections of `width` pairs, rank-major inside; the last
    `last` sections (a partial one among them) as one."""
    full = max(-(-pairs // width) - last, 0) * width
    order = []
    for _ in range(0, full, width):
        order += [w for w in walks for _ in range(width)]
    return order + [w for w in walks for _ in range(pairs - full)]


def makespan(order: list[int], sms: int, overhead: float) -> float:
    free = [0.0] * sms
    end = 0.0
    for walk in order:
        t = heapq.heappop(free) + walk + overhead
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--overhead", type=float, default=3.0)
    ap.add_argument("--last", type=int, nargs="+", default=[1, 2, 3, 4])
    args = ap.parse_args()
    print(f"{'row':<16} {'tile':>7} {'pairs/sec':>9} " + " ".join(f"{'k=' + str(k):>7}" for k in
          args.last) + f" {'LPT':>7}   (grid end / ideal)")  # fmt: skip
    for name, d, dv, heads in ROWS:
        for seqlen, batch in LENGTHS:
            short = bwd_short_rows(d, True, False, False, False, False, seqlen)
            cfg = bwd_tile_config(d, dv, True, False, short=short)
            walks = key_tile_walks(seqlen, cfg.tile_m, cfg.tile_n)
            pairs = heads * batch
            row_bytes = 6 * d + 2 * dv + 8  # FlashBwdSm90.l2_row_bytes
            width = section_width(seqlen, row_bytes, cfg.l2_section_bytes) if (
                cfg.l2_section_bytes) else 1  # fmt: skip
            ideal = sum(w + args.overhead for w in walks) * pairs / args.sms
            ends = [makespan(launch_order(walks, pairs, width, k), args.sms, args.overhead)
                    for k in args.last]  # fmt: skip
            lpt = makespan(sorted(launch_order(walks, pairs, width, 1), reverse=True), args.sms,
                           args.overhead)  # fmt: skip
            label = f"{name} {seqlen // 1024}k"
            ratios = " ".join(f"{e / ideal:7.4f}" for e in ends)
            print(f"{label:<16} {cfg.tile_m:>3}x{cfg.tile_n:<3} {width:>9} {ratios} "
                  f"{lpt / ideal:7.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
