"""The launch orders on the CPU (host_jit.py).

* L2 sections (arch/common/schedule.py): for grids of many shapes and section widths,
  `l2_section_coords` maps the grid's linear CTA index onto every (block, head, batch)
  exactly once, block-rank-major inside each section of 2^log_width (head, batch) pairs,
  with the pairs of a section consecutive and the last, partial section last; `reverse`
  gives the block of rank r as blocks - 1 - r; a pair's block of rank r - 1 is launched
  before its block of rank r (the backward's deterministic turns rely on it).
* The persistent grid (PersistentUnits.unit_tile, arch/sm90/persistent.py): its work units,
  both halves under a mask, name every (query tile, head, batch) exactly once, unmasked,
  causal and under windows with and without a ramp.
"""

# no `from __future__ import annotations`: the DSL reads the host function's annotations
import functools

import pytest
import torch
from host_jit import sm90_dsl


@functools.cache
def _coords_fn():
    sm90_dsl()
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from cute_attn.arch.common.schedule import L2Sections, l2_section_coords

    @cute.jit
    def coords(
        mOut: cute.Tensor,  # (blocks * heads * batches, 4) int32: block, head, batch, width
        num_blocks: Int32,
        num_batches: Int32,
        rows: Int32,
        num_heads: cutlass.Constexpr[int],
        row_bytes: cutlass.Constexpr[int],
        budget: cutlass.Constexpr[int],
        max_pairs: cutlass.Constexpr[int],
        reverse: cutlass.Constexpr[bool],
    ):
        sections = L2Sections.create(
            num_blocks, num_heads * num_batches, rows, row_bytes, budget, max_pairs
        )
        for z in cutlass.range(num_batches, unroll=1):
            for y in cutlass.range(num_heads, unroll=1):
                for x in cutlass.range(num_blocks, unroll=1):
                    linear = x + num_blocks * (y + num_heads * z)
                    block, head, batch = l2_section_coords(sections, num_heads, reverse, (x, y, z))
                    mOut[linear, 0] = block
                    mOut[linear, 1] = head
                    mOut[linear, 2] = batch
                    mOut[linear, 3] = Int32(1) << sections.log_width

    return coords


# (blocks, heads, batches, rows, row bytes, budget bytes, max pairs): sections of 1, 2, 4, 8
# and 1024 pairs, with and without a partial last section
GRIDS = [
    (7, 3, 5, 300, 512, 300 * 512 * 4, 1024), (1, 1, 1, 1, 2, 1 << 20, 4),
    (16, 8, 3, 4096, 512, 50 << 20, 1024), (5, 6, 7, 100, 256, 100 * 256 * 3, 2),
    (3, 32, 2, 64, 64, 1 << 30, 1024), (9, 5, 1, 1000, 1024, 1000 * 1024, 8),
]  # fmt: skip


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("grid", GRIDS)
def test_l2_sections_visit_every_tile_rank_major(grid, reverse):
    coords = _coords_fn()
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    blocks, heads, batches, rows, row_bytes, budget, max_pairs = grid
    out = torch.full((blocks * heads * batches, 4), -1, dtype=torch.int32)
    coords(from_dlpack(out), Int32(blocks), Int32(batches), Int32(rows), heads, row_bytes,
           budget, max_pairs, reverse)  # fmt: skip
    width = int(out[0, 3])
    fit = [w for w in (1 << i for i in range(11)) if w <= max_pairs and w * rows * row_bytes
           <= budget]  # fmt: skip
    assert width == max(fit or [1]), (grid, width)
    tiles = [tuple(t) for t in out[:, :3].tolist()]
    assert sorted(tiles) == [(x, y, z) for x in range(blocks) for y in range(heads)
                             for z in range(batches)], grid  # fmt: skip
    pairs = heads * batches
    full = pairs // width * width
    for linear, (block, head, batch) in enumerate(tiles):
        rank = blocks - 1 - block if reverse else block
        pair = batch * heads + head
        if linear < full * blocks:  # a full section: (section, rank, pair in the section)
            section, rest = divmod(linear, width * blocks)
            assert (rank, pair) == (rest // width, section * width + rest % width), grid
        else:  # the last, partial section: rank-major over its pairs
            rest = linear - full * blocks
            assert (rank, pair) == (rest // (pairs - full), full + rest % (pairs - full)), grid
    # the backward's deterministic turns (flash_bwd._dq_add): a key tile waits for the pair's
    # tiles of lower rank, so each of them must be launched before it (no deadlock)
    launched = {}
    for linear, (block, head, batch) in enumerate(tiles):
        launched[batch * heads + head, blocks - 1 - block if reverse else block] = linear
    for (pair, rank), linear in launched.items():
        assert rank == 0 or launched[pair, rank - 1] < linear, (grid, pair, rank)


@functools.cache
def _persistent_fn(has_left: bool, has_right: bool):
    """Every work unit of a persistent forward grid, as the kernel walks them
    (PersistentUnits.walk): (m_block, head, batch, valid) per (unit, half)."""
    sm90_dsl()
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from cute_attn.arch.sm90.flash_fwd import FlashFwdSm90
    from cute_attn.arch.sm90.tile_config import fwd_tile_config

    cfg = fwd_tile_config(128, 128, has_right and not has_left, has_left, persistent_sms=132)
    kernel = FlashFwdSm90(cutlass.BFloat16, 128, 128, 1, has_left, has_right, False, cfg)

    @cute.jit
    def units(
        mOut: cute.Tensor,  # (2 x units, 4) int32
        seqlen_q: Int32,
        seqlen_k: Int32,
        num_heads: Int32,
        num_batch: Int32,
        window_left: Int32,
        window_right: Int32,
    ):
        num_units = kernel.units.num_units(seqlen_q, seqlen_k, num_heads, num_batch, window_left)
        for j in cutlass.range(2 * num_units, unroll=1):
            m_block, head, seq, _, _, _, valid = kernel.units.unit_tile(
                j >> 1, j & 1, seqlen_q, seqlen_k, num_heads, num_batch, window_left,
                window_right,
            )  # fmt: skip
            mOut[j, 0] = m_block
            mOut[j, 1] = head
            mOut[j, 2] = seq.q_batch
            flag = Int32(1)  # unmasked units are always valid (a Python True)
            if cutlass.const_expr(kernel.masked):
                flag = Int32(cutlass.select_(valid, 1, 0))
            mOut[j, 3] = flag
        mOut[2 * num_units, 0] = -7  # the end marker: the unit count the host expects

    return kernel, units


@pytest.mark.parametrize(
    "window", [(-1, -1), (-1, 0), (150, 0), (37, 11), (20, -1)],
    ids=["dense", "causal", "window-ramp", "window", "window-left"],
)  # fmt: skip
@pytest.mark.parametrize("sq,sk", [(457, 301), (1000, 1000), (128, 4096), (3001, 3001)])
def test_persistent_units_cover_every_tile_once(window, sq, sk):
    # the masked walk takes both halves of a unit and skips the invalid ones; unmasked
    # units are one tile each (half 0)
    left, right = window
    kernel, units = _persistent_fn(left >= 0, right >= 0)
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    heads, batches = 3, 2
    num_m = -(-sq // kernel.tile_m)
    out = torch.zeros(2 * num_m * heads * batches + 1, 4, dtype=torch.int32)
    units(from_dlpack(out), Int32(sq), Int32(sk), Int32(heads), Int32(batches),
          Int32(max(left, 0)), Int32(max(right, 0)))  # fmt: skip
    end = int((out[:, 0] == -7).nonzero()[0])
    rows = out[:end].tolist()
    if not kernel.masked:
        rows = rows[0::2]  # half 0 only
    tiles = sorted((m, h, b) for m, h, b, valid in rows if valid)
    assert tiles == [(m, h, b) for m in range(num_m) for h in range(heads)
                     for b in range(batches)], (window, sq, sk)  # fmt: skip
