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
def l2_section_coords(rows: Int32, row_bytes: int, budget_bytes: int, reverse: bool):
    """(block, head, batch) of this CTA. One (head, batch) pair's working set is rows x
    row_bytes; sections hold the largest power of two of pairs (at most 1024) whose bytes fit
    budget_bytes, at least one. The grid is (blocks, heads, batches); the block of rank r is
    r, or blocks - 1 - r with `reverse` (compile-time)."""
    bx, by, bz = cute.arch.block_idx()
    num_blocks, num_h, num_b = cute.arch.grid_dim()
    linear = bx + num_blocks * (by + num_h * bz)
    pair_bytes = Int64(rows) * row_bytes
    fit = Int64(budget_bytes) // cutlass.max(pair_bytes, Int64(1))
    width = Int32(1)
    for _ in cutlass.range_constexpr(10):  # sections of up to 1024 pairs
        width = Int32(cutlass.select_(Int64(width * 2) <= fit, width * 2, width))
    num_hb = num_h * num_b
    width = cutlass.min(width, num_hb)
    section = linear // (width * num_blocks)
    within = linear - section * width * num_blocks
    full = num_hb // width
    # the last section holds the remainder of the pairs
    cur = Int32(cutlass.select_(section < full, width, num_hb - full * width))
    rank = within // cur
    hb = section * width + (within - rank * cur)
    batch = hb // num_h
    if cutlass.const_expr(reverse):
        rank = num_blocks - 1 - rank
    return rank, hb - batch * num_h, batch
