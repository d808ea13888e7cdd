"""CTA launch order over a (blocks, heads, batches) grid: L2 sections.

The hardware dispatches a grid's CTAs in linear order (x fastest). `l2_section_coords`
renames the linear index so that the grid's (head, batch) pairs are cut into sections of as
many pairs as fit a byte budget (their working set in L2; a power of two), and inside a
section the CTAs go block-rank-major: every pair's rank-0 block, then every pair's rank-1
block, ... The caller maps a rank to its block so that rank 0 is the longest work (the
forward's last query tile, the backward's first key tile under a causal mask): the longest
CTAs of a section start together instead of the last pairs' starting near the grid's end,
and the section's pairs stay in L2 while they run. Sections of one pair give the plain
order (pair after pair, each pair's blocks by rank).

Device-only helpers, traced inside a kernel; no constraint on the grid beyond 32-bit sizes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64


@cute.jit
def l2_section_coords(
    rows: Int32, row_bytes: int, budget_bytes: int, reverse: bool, max_pairs: int = 1024
):
    """(block, head, batch) of this CTA. One (head, batch) pair's working set is rows x
    row_bytes; sections hold the largest power of two of pairs (at most max_pairs, a
    compile-time power of two <= 1024) whose bytes fit budget_bytes, at least one. The grid
    is (blocks, heads, batches); the block of rank r is r, or blocks - 1 - r with `reverse`
    (compile-time)."""
    if cutlass.const_expr(max_pairs < 1 or max_pairs > 1024 or max_pairs & (max_pairs - 1)):
        raise ValueError(f"max_pairs {max_pairs} must be a power of two in [1, 1024]")
    bx, by, bz = cute.arch.block_idx()
    num_blocks, num_h, num_b = cute.arch.grid_dim()
    linear = bx + num_blocks * (by + num_h * bz)
    # log2 of the section width: the largest i with 2^i pairs inside the budget. Compares of
    # constant multiples, no 64-bit division: this runs before the CTA's first load, and the
    # division form (a u64 divide and four 32-bit ones) cost the short CTAs of 1k causal
    # forwards about 2-3% (docs/perf/README.md, fifteenth session).
    pair_bytes = Int64(rows) * row_bytes
    lw = Int32(0)
    for i in cutlass.range_constexpr(1, max_pairs.bit_length()):
        lw = cutlass.select_(pair_bytes * (1 << i) <= budget_bytes, Int32(i), lw)
    num_hb = num_h * num_b
    full = num_hb >> lw  # full sections; the last one holds the remainder
    in_full = (full << lw) * num_blocks  # CTAs of the full sections
    rank = Int32(0)
    hb = Int32(0)
    if linear < in_full:
        # a full section of 2^lw pairs: linear = (section * blocks + rank) * 2^lw + pair
        t = linear >> lw
        section = t // num_blocks
        rank = t - section * num_blocks
        hb = (section << lw) + (linear & ((1 << lw) - 1))
    else:
        cur = num_hb - (full << lw)
        within = linear - in_full
        rank = within // cur
        hb = (full << lw) + within - rank * cur
    batch = hb // num_h
    if cutlass.const_expr(reverse):
        rank = num_blocks - 1 - rank
    return rank, hb - batch * num_h, batch
