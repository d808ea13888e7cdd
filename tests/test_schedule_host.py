"""The L2-section launch order (arch/common/schedule.py) on the CPU (host_jit.py): for grids
of many shapes and section widths, `l2_section_coords` must map the grid's linear CTA index
onto every (block, head, batch) exactly once, block-rank-major inside each section of
2^log_width (head, batch) pairs, with the pairs of a section consecutive and the last,
partial section last; `reverse` gives the block of rank r as blocks - 1 - r.
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
