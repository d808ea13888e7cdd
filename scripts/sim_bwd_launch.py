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
"""

from __future__ import annotations

import argparse
import heapq


def makespan(order, tiles, sms, lag=None):
    """Time the last CTA of `order` ((pair, key tile) in launch order) ends; `lag`: the
    deterministic turns' landing time (None: no turns)."""
    free = [0.0] * sms
    landed = {}  # (pair, n) -> {m: time key tile n's add of query tile m landed}
    end = 0.0
    for p, n in order:
        t = heapq.heappop(free)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=32, help="(head, batch) pairs")
    ap.add_argument("--tiles", type=int, default=64, help="key (= query) tiles a pair")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--section", type=int, default=2, help="default order's L2 section pairs")
    ap.add_argument("--lag", type=float, default=0.5, help="turn landing time, in tile-steps")
    args = ap.parse_args()
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
