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

`L2Sections.create` runs in the host part of a `@cute.jit` entry (it sizes the sections
and builds the divisors' magic numbers once a launch); `l2_section_coords` runs in the
kernel, before the CTA's first load, where it costs a few integer instructions (two
multiply-high divisions and one by the static head count) instead of the division chains
of computing everything from the grid. No constraint on the grid beyond 32-bit sizes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .dsl import DslStruct, block_idx_x_again


class L2Sections(DslStruct):
    """One launch's section sizes: 2^log_width pairs a full section, `full_pairs` pairs in
    the full sections, whose `full_ctas` CTAs come first; `blocks` divides by the grid's
    block count, `rest` by the pair count of the last, partial section (1 when there is
    none: that branch is then never taken)."""

    _dynamic_ = ("log_width", "full_pairs", "full_ctas", "blocks", "rest")

    def __init__(self, log_width, full_pairs, full_ctas, blocks, rest):
        self.log_width = log_width
        self.full_pairs = full_pairs
        self.full_ctas = full_ctas
        self.blocks = blocks
        self.rest = rest

    @staticmethod
    def create(
        num_blocks: Int32,
        num_pairs: Int32,
        rows: Int32,
        row_bytes: int,
        budget_bytes: int,
        max_pairs: int = 1024,
        last_sections: int = 1,
        last_max_pairs: int = 1024,
    ) -> L2Sections:
        """Host side. One (head, batch) pair's working set is rows x row_bytes; sections hold
        the largest power of two of pairs (at most max_pairs, a compile-time power of two <=
        1024) whose bytes fit budget_bytes, at least one. `last_sections` (compile time): the
        last that many sections, the partial one among them, run as one section (rank-major
        over all their pairs) when a section holds at most `last_max_pairs` pairs (a
        run-time choice, from the sizes; the default: at any width; the backward's table
        keeps it to long sequences, bwd_tiles.BWD_L2_LAST_MAX_PAIRS): wider sections keep
        their own."""
        if max_pairs < 1 or max_pairs > 1024 or max_pairs & (max_pairs - 1):
            raise ValueError(f"max_pairs {max_pairs} must be a power of two in [1, 1024]")
        pair_bytes = Int64(rows) * row_bytes
        log_width = Int32(0)
        for i in range(1, max_pairs.bit_length()):
            log_width = cutlass.select_(pair_bytes * (1 << i) <= budget_bytes, Int32(i), log_width)
        full_pairs = (num_pairs >> log_width) << log_width
        if cutlass.const_expr(last_sections > 1):
            # the sections before the last `last_sections` (a partial last one counts as one)
            before = ((num_pairs - 1) >> log_width) - (last_sections - 1)
            merged = cutlass.max(before, 0) << log_width
            full_pairs = cutlass.select_((1 << log_width) <= last_max_pairs, merged, full_pairs)
        rest = cutlass.max(num_pairs - full_pairs, 1)
        return L2Sections(
            log_width,
            full_pairs,
            full_pairs * num_blocks,
            cute.fast_divmod_create_divisor_v2(num_blocks),
            cute.fast_divmod_create_divisor_v2(rest),
        )


@cute.jit
def l2_section_coords(
    sections: L2Sections, num_heads: cutlass.Constexpr[int], reverse: bool, block=None
):
    """(block, head, batch) of this CTA on a (blocks, num_heads, batches) grid; the block of
    rank r is r, or blocks - 1 - r with `reverse` (compile-time). `block`: the CTA's (x, y,
    z) grid index, default its own (tests pass others on the host)."""
    bx, by, bz = cute.arch.block_idx() if cutlass.const_expr(block is None) else block
    num_blocks = sections.blocks.divisor
    linear = bx + num_blocks * (by + num_heads * bz)
    lw = sections.log_width
    rank = Int32(0)
    hb = Int32(0)
    if linear < sections.full_ctas:
        # a full section of 2^lw pairs: linear = (section * blocks + rank) * 2^lw + pair
        section, rank = divmod(linear >> lw, sections.blocks)
        hb = (section << lw) + (linear & ((Int32(1) << lw) - 1))
    else:
        # the last section's pairs: linear - full_ctas = rank * rest + pair
        rank, pair = divmod(linear - sections.full_ctas, sections.rest)
        hb = sections.full_pairs + pair
    batch = hb // num_heads
    if cutlass.const_expr(reverse):
        rank = num_blocks - 1 - rank
    return rank, hb - batch * num_heads, batch


class TailSplit(DslStruct):
    """One launch's tail_split: the first tile of the tail (`start`, in the plain grid's
    order) and divisors by its parts count and by the grid's block count (their magic
    numbers built once a launch, so the kernel divides with a multiply-high)."""

    _dynamic_ = ("start", "parts", "blocks")

    def __init__(self, start, parts, blocks):
        self.start = start
        self.parts = parts
        self.blocks = blocks

    @staticmethod
    def create(start: Int32, parts: Int32, num_blocks: Int32) -> TailSplit:
        """Host side (the host part of a `@cute.jit` entry)."""
        return TailSplit(
            start,
            cute.fast_divmod_create_divisor_v2(parts),
            cute.fast_divmod_create_divisor_v2(num_blocks),
        )


@cute.jit
def tail_split_coords(tail: TailSplit, num_heads: cutlass.Constexpr[int], linear=None):
    """(block, head, batch, part, parts) of this CTA on the linear grid of a (blocks,
    num_heads, batches) problem whose tiles from tail.start on (in the plain grid's order,
    blocks fastest) run as tail.parts CTAs each (tail_split): CTA start + t * parts + p is
    part p of tile start + t; a CTA of a whole tile is part 0 of 1. `linear`: the CTA's x
    index, default its own (tests pass others on the host)."""
    if cutlass.const_expr(linear is None):
        linear = cute.arch.block_idx()[0]
    tile, part, parts = linear, Int32(0), Int32(1)
    if linear >= tail.start:
        t, part = divmod(linear - tail.start, tail.parts)
        tile = tail.start + t
        parts = Int32(tail.parts.divisor)
    hb, block = divmod(tile, tail.blocks)
    batch = hb // num_heads
    return block, hb - batch * num_heads, batch, part, parts


@cute.jit
def tail_slot(tail: TailSplit) -> Int32:
    """This CTA's workspace slot under tail_split: t * parts + p for part p of the tail's
    tile t, -1 for a whole tile. Read afresh from %ctaid.x (block_idx_x_again) where it is
    needed, after a main loop, rather than kept live across it."""
    slot = block_idx_x_again() - tail.start
    if slot < 0:
        slot = Int32(-1)
    return slot
