"""The backward's tail split, host side: how many of a grid's last key tiles to split, and
into how many parts (BwdTileConfig.tail_split; the kernel side is in schedule.py).

Plain Python without the DSL, so the host layer imports it on a compile-cache disk hit
without importing cutlass. `tail_split` is a list-scheduling model; tests/test_schedule_host.py
checks it against a brute-force schedule.
"""

from __future__ import annotations


def tail_split(
    num_tiles: int, num_slots: int, steps: int, max_parts: int, fixup_steps: int
) -> tuple[int, int]:
    """(tail, parts): run the last `tail` tiles of a grid's launch order as `parts` CTAs each,
    part p walking the p-th contiguous share of the tile's `steps` (a backward key tile's
    query tiles), or (0, 1) to keep one CTA a tile. Host side, plain ints.

    A grid of equal tiles on `num_slots` CTA slots ends with a partial wave when num_slots
    does not divide num_tiles: r = num_tiles mod num_slots tiles run while the other slots
    idle. Cut into parts, the tail's work spreads over more slots. The model: CTAs start in
    launch order on the first free slot (list scheduling), a tile takes `steps`, a part
    ceil(steps / parts) + fixup_steps (its partial's round trip through global memory). It
    picks the parts count (2..max_parts, at most steps) whose grid ends first, if that beats
    the plain grid by at least 1% (and a step): smaller gains are within what the model leaves
    out (the part's launch, its L2 misses, the last part's reads of the others'); ties take
    fewer parts."""
    if num_tiles < 1 or num_slots < 1 or steps < 2:
        return 0, 1
    tail = num_tiles % num_slots
    if tail == 0:
        return 0, 1  # full waves: nothing idles
    whole, late = divmod(num_tiles - tail, num_slots)
    plain = -(-num_tiles // num_slots) * steps
    best, best_parts = plain - max(1, plain // 100) + 1, 1
    for parts in range(2, min(max_parts, steps) + 1):
        cost = -(-steps // parts) + fixup_steps
        end = _list_schedule_end(
            tail * parts, cost, num_slots - late, whole * steps, late, (whole + 1) * steps
        )
        if late:
            end = max(end, (whole + 1) * steps)
        if end < best:
            best, best_parts = end, parts
    return (tail, best_parts) if best_parts > 1 else (0, 1)


def _list_schedule_end(jobs: int, cost: int, free_a: int, at_a: int, free_b: int, at_b: int):
    """When the last of `jobs` equal jobs of `cost` ends, started in order on the first free
    of free_a slots free from at_a and free_b slots free from at_b (at_a < at_b)."""
    started, k_a, k_b = 0, 0, 0
    while True:
        t_a = at_a + k_a * cost
        t_b = at_b + k_b * cost if free_b else t_a + 1
        if t_a <= t_b:
            started, t, k_a = started + free_a, t_a, k_a + 1
        else:
            started, t, k_b = started + free_b, t_b, k_b + 1
        if started >= jobs:
            return t + cost
