"""A list-scheduling model of the SM90 backward's causal launch orders (not a test; CPU only).

Each CTA owns key tile n of a (head, batch) pair and walks the query tiles n..tiles-1 (a
square causal problem: tiles - n tile-steps of work, one time unit each); CTAs start in launch
order on the first SM to free up, one CTA an SM. In the deterministic order key tile n adds
into query tile m only after key tile n + 1's add of m has landed (`--lag` units later,
right-to-left turns, BwdDqWriter._wait_turn), which is why that order launches each pair's
key tiles shortest first (the tiles waited on are then launched earlier: resident or done,
whatever the residency, so no deadlock). The default order launches longest first, rank-major
in L2 sections of `--section` pairs. The model prints each order's makespan against the
ideal (all work spread evenly over the SMs) as an efficiency.

What it shows (docs/design.md, section 5b): at D = 256 4k causal (32 pairs of 64 key tiles,
132 SMs) shortest-first launch leaves a tail of the longest CTAs: 92.7% against 99.3% for
the default order, whatever the lag; staggering or sectioning the pairs only reaches 94%.

    python scripts/sim_bwd_launch.py --pairs 32 --tiles 64

`--bench` models the default order on the bench's causal rows instead, with the table's tiles
(tile_m rows against tile_n keys, so key tile n walks ceil(S / tile_m) - n * tile_n // tile_m
query tiles) and L2 section widths, a CTA costing its walk plus `--overhead` (prologue and
dK / dV epilogue, in query-tile steps), and the last k sections launched as one
(BwdTileConfig.l2_last_sections, which the kernel applies only to sections of at most
BWD_L2_LAST_MAX_PAIRS pairs; the model likewise): grid end over the ideal, for each k and
for the whole grid longest first (LPT: one section of every pair, 33-42% slower at 4k in
the twenty-fifth session for its L2 misses, which the model does not have). D = 64's table
has no sections: its k columns are sections of one pair. A model, not a measurement: it
says where to look (scripts/gpu_pending.sh balance_ab timed it on an H100 in the
sixty-sixth session, docs/perf/tune_bwd_balance_causal_s66_h100.json;
docs/perf/causal_balance_model_s65.txt, _s66.txt).

    python scripts/sim_bwd_launch.py --bench [--overhead 3] [--last 1 2 3 4]
"""

from __future__ import annotations

import argparse
import heapq


def makespan(order, tiles, sms, lag=None, walk=None, overhead=0.0):
    """Time the last CTA of `order` ((pair, key tile) in launch order) ends; `lag`: the
    deterministic turns' landing time (None: no turns); `walk(n)`: key tile n's query tiles
    without turns (default tiles - n), `overhead` more a CTA."""
    free = [0.0] * sms
    landed = {}  # (pair, n) -> {m: time key tile n's add of query tile m landed}
    end = 0.0
    for p, n in order:
        t = heapq.heappop(free) + overhead
        if lag is None:
            t += walk(n) if walk else tiles - n
            heapq.heappush(free, t)
            end = max(end, t)
            continue
        adds = {}
        for m in range(n, tiles):
            t += 1.0
            if lag is not None and m > n:
                # key tile n + 1 was launched earlier (its entry exists)
                t = max(t, landed[(p, n + 1)][m] + lag)
            adds[m] = t
        landed[(p, n)] = adds
        heapq.heappush(free, t)
        end = max(end, t)
    return end


# the bench's causal backward rows: (name, head dim, head dim v, heads) at 16 x 1k, 4 x 4k,
# 1 x 16k tokens (cute_attn.bench's bwd preset and the full preset's D = 192 rows)
BENCH_ROWS = [
    ("d64", 64, 64, 32), ("d96", 96, 96, 21), ("d128", 128, 128, 16), ("d192", 192, 192, 10),
    ("d192/128", 192, 128, 16), ("d256", 256, 256, 8),
]  # fmt: skip


def sections_order(pairs, tiles, width, last):
    """(pair, key tile) in the default order: sections of `width` pairs, rank-major inside
    (key tile 0, the longest, first); the last `last` sections (a partial one among them) as
    one (L2Sections.create's last_sections)."""
    full = max(-(-pairs // width) - last, 0) * width
    starts = [(s, width) for s in range(0, full, width)] + [(full, pairs - full)]
    return [(p, n) for s, w in starts for n in range(tiles) for p in range(s, s + w)]


def bench_table(sms, overhead, lasts):
    from cute_attn.arch.sm90.bwd_tiles import (
        BWD_L2_LAST_MAX_PAIRS,
        bwd_l2_row_bytes,
        bwd_short_rows,
        bwd_tile_config,
    )

    ks = " ".join(f"{'k=' + str(k):>7}" for k in lasts)
    print(f"{'row':<14} {'tile':>7} {'pairs/sec':>9} {ks} {'LPT':>7}   (grid end / ideal)")
    for name, d, dv, heads in BENCH_ROWS:
        for seqlen, batch in ((1024, 16), (4096, 4), (16384, 1)):
            short = bwd_short_rows(d, True, False, False, False, False, seqlen)
            cfg = bwd_tile_config(d, dv, True, False, short=short)
            num_m, tiles = -(-seqlen // cfg.tile_m), -(-seqlen // cfg.tile_n)

            def walk(n, num_m=num_m, cfg=cfg):
                return num_m - n * cfg.tile_n // cfg.tile_m

            pairs, width = heads * batch, 1
            pair_bytes = seqlen * bwd_l2_row_bytes(d, dv)
            while cfg.l2_section_bytes and 2 * width * pair_bytes <= cfg.l2_section_bytes:
                width *= 2
            ideal = pairs * sum(walk(n) + overhead for n in range(tiles)) / sms
            merge = width <= BWD_L2_LAST_MAX_PAIRS  # L2Sections.create's last_max_pairs
            ends = [makespan(sections_order(pairs, tiles, width, k if merge else 1), tiles, sms,
                             None, walk, overhead) for k in lasts]  # fmt: skip
            lpt = sorted(sections_order(pairs, tiles, width, 1), key=lambda pn: pn[1])
            ends.append(makespan(lpt, tiles, sms, None, walk, overhead))
            ratios = " ".join(f"{e / ideal:7.4f}" for e in ends)
            label = f"{name} {seqlen // 1024}k"
            print(f"{label:<14} {cfg.tile_m:>3}x{cfg.tile_n:<3} {width:>9} {ratios}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", action="store_true", help="the bench's causal rows (above)")
    ap.add_argument("--overhead", type=float, default=3.0, help="--bench: a CTA's fixed cost")
    ap.add_argument("--last", type=int, nargs="+", default=[1, 2, 3, 4], help="--bench: k")
    ap.add_argument("--pairs", type=int, default=32, help="(head, batch) pairs")
    ap.add_argument("--tiles", type=int, default=64, help="key (= query) tiles a pair")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--section", type=int, default=2, help="default order's L2 section pairs")
    ap.add_argument("--lag", type=float, default=0.5, help="turn landing time, in tile-steps")
    args = ap.parse_args()
    if args.bench:
        return bench_table(args.sms, args.overhead, args.last)
    P, T = args.pairs, args.tiles
    ideal = P * T * (T + 1) / 2 / args.sms
    w = args.section
    orders = {
        "deterministic: pair after pair, shortest first": (
            [(p, n) for p in range(P) for n in reversed(range(T))],
            args.lag,
        ),
        f"default: longest first, rank-major in sections of {w}": (
            [(p, n) for s in range(0, P, w) for n in range(T) for p in range(s, min(P, s + w))],
            None,
        ),
        "default: longest first, pair after pair": (
            [(p, n) for p in range(P) for n in range(T)],
            None,
        ),
    }
    for name, (order, lag) in orders.items():
        end = makespan(order, T, args.sms, lag)
        print(f"{name:<56} makespan {end:7.1f}  efficiency {ideal / end:.3f}")
    for s in (1, 4, 16):
        key = sorted(((T - 1 - n) + p * s, p, n) for p in range(P) for n in range(T))
        end = makespan([(p, n) for _, p, n in key], T, args.sms, args.lag)
        label = f"deterministic: pairs staggered by {s}, shortest first"
        print(f"{label:<56} makespan {end:7.1f}  efficiency {ideal / end:.3f}")


if __name__ == "__main__":
    main()
