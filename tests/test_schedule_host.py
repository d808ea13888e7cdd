"""The launch orders on the CPU (host_jit.py).

* L2 sections (arch/common/schedule.py): for grids of many shapes and section widths,
  `l2_section_coords` maps the grid's linear CTA index onto every (block, head, batch)
  exactly once, block-rank-major inside each section of 2^log_width (head, batch) pairs,
  with the pairs of a section consecutive and the last, partial section last (or the last
  k sections as one, `last_sections`, where a section holds at most `last_max_pairs`
  pairs); `reverse` gives the block of rank r as blocks - 1 - r;
  a pair's block of rank r - 1 is launched before its block of rank r (the backward's
  deterministic turns rely on it).
* The backward's tail split: `tail_split_coords` (arch/common/schedule.py) names every key
  tile before the tail once, whole and in the plain grid's order, and every tile of the tail
  once per part; `tail_split`'s model (arch/common/tail_model.py) against a brute-force list
  schedule, and its choices on the bench's grids.
* The persistent grid (PersistentUnits.unit_tile, arch/sm90/persistent.py): its work units,
  both halves under a mask, name every (query tile, head, batch) exactly once, unmasked,
  causal and under windows with and without a ramp.
"""

# no `from __future__ import annotations`: the DSL reads the host function's annotations
import functools
import heapq
import itertools

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
        last: cutlass.Constexpr[int],
        last_max: cutlass.Constexpr[int],
    ):
        sections = L2Sections.create(
            num_blocks,
            num_heads * num_batches,
            rows,
            row_bytes,
            budget,
            max_pairs,
            last,
            last_max,
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


# (last_sections, last_max_pairs): merged only where a section holds at most last_max_pairs
@pytest.mark.parametrize("last", [(1, 2), (2, 2), (3, 2), (3, 1024)])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("grid", GRIDS)
def test_l2_sections_visit_every_tile_rank_major(grid, reverse, last):
    last, last_max = last
    coords = _coords_fn()
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    blocks, heads, batches, rows, row_bytes, budget, max_pairs = grid
    out = torch.full((blocks * heads * batches, 4), -1, dtype=torch.int32)
    coords(from_dlpack(out), Int32(blocks), Int32(batches), Int32(rows), heads, row_bytes,
           budget, max_pairs, reverse, last, last_max)  # fmt: skip
    width = int(out[0, 3])
    fit = [w for w in (1 << i for i in range(11)) if w <= max_pairs and w * rows * row_bytes
           <= budget]  # fmt: skip
    assert width == max(fit or [1]), (grid, width)
    tiles = [tuple(t) for t in out[:, :3].tolist()]
    assert sorted(tiles) == [(x, y, z) for x in range(blocks) for y in range(heads)
                             for z in range(batches)], grid  # fmt: skip
    pairs = heads * batches
    full = pairs // width * width
    if last > 1 and width <= last_max:  # the last `last` sections, a partial one among them
        full = max(-(-pairs // width) - last, 0) * width
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
def _tail_coords_fn():
    sm90_dsl()
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from cute_attn.arch.common.schedule import TailSplit, tail_split_coords

    @cute.jit
    def coords(
        mOut: cute.Tensor,  # (CTAs, 5) int32: block, head, batch, part, parts
        num_ctas: Int32,
        num_blocks: Int32,
        start: Int32,
        parts: Int32,
        num_heads: cutlass.Constexpr[int],
    ):
        tail = TailSplit.create(start, parts, num_blocks)
        for linear in cutlass.range(num_ctas, unroll=1):
            block, head, batch, part, parts_of = tail_split_coords(tail, num_heads, linear)
            mOut[linear, 0] = block
            mOut[linear, 1] = head
            mOut[linear, 2] = batch
            mOut[linear, 3] = part
            mOut[linear, 4] = parts_of

    return coords


# (blocks, heads, batches, tail tiles, parts): no tail, a short one, every tile, one tile
TAIL_GRIDS = [(7, 3, 5, 0, 1), (16, 8, 3, 68, 3), (5, 6, 7, 210, 2), (9, 5, 1, 1, 4),
              (128, 16, 1, 68, 3), (3, 32, 2, 17, 4)]  # fmt: skip


@pytest.mark.parametrize("grid", TAIL_GRIDS)
def test_tail_split_coords_cover_every_part_once(grid):
    coords = _tail_coords_fn()
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    blocks, heads, batches, tail, parts = grid
    tiles = blocks * heads * batches
    start, ctas = tiles - tail, tiles + tail * (parts - 1)
    out = torch.full((ctas, 5), -1, dtype=torch.int32)
    coords(from_dlpack(out), Int32(ctas), Int32(blocks), Int32(start), Int32(parts), heads)
    plain = list(itertools.product(range(batches), range(heads), range(blocks)))
    got = [(b, h, x, p, n) for x, h, b, p, n in out.tolist()]
    # before the tail: the plain grid's order, part 0 of 1; the tail: each tile's parts in order
    assert got[:start] == [(*t, 0, 1) for t in plain[:start]], grid
    assert got[start:] == [(*t, p, parts) for t in plain[start:] for p in range(parts)], grid


def _heap_schedule_end(tiles: int, slots: int, steps: int, tail: int, parts: int, fix: int):
    """Brute force: every CTA of the split grid, in launch order, on the first free slot."""
    cost = -(-steps // parts) + fix
    jobs = [steps] * (tiles - tail) + [cost] * (tail * parts if parts > 1 else tail)
    free = [0] * slots
    end = 0
    for job in jobs:
        t = heapq.heappop(free)
        end = max(end, t + job)
        heapq.heappush(free, t + job)
    return end


def test_tail_split_model_matches_brute_force():
    from cute_attn.arch.common.tail_model import _list_schedule_end, tail_split

    for tiles, slots, steps in itertools.product(
        (1, 5, 64, 131, 132, 133, 140, 200, 2048, 2688, 4096), (8, 132), (1, 2, 5, 13, 52, 205)
    ):
        tail, parts = tail_split(tiles, slots, steps, 4, 2)
        plain = _heap_schedule_end(tiles, slots, steps, 0, 1, 0)
        if parts == 1:
            assert tail == 0
            # no parts count would have gained 1% (and a step)
            for p in range(2, min(4, steps) + 1):
                r = tiles % slots
                if r:
                    end = _heap_schedule_end(tiles, slots, steps, r, p, 2)
                    assert end > plain - max(1, plain // 100), (tiles, slots, steps, p)
            continue
        assert tail == tiles % slots and 2 <= parts <= min(4, steps), (tiles, slots, steps)
        end = _heap_schedule_end(tiles, slots, steps, tail, parts, 2)
        assert end <= plain - max(1, plain // 100), (tiles, slots, steps, tail, parts)
    # the closed form of equal jobs on two groups of slots
    for jobs, cost, a, at_a, b in itertools.product((1, 7, 132, 204, 500), (1, 5, 70),
                                                    (1, 64, 132), (0, 10), (0, 3, 68)):  # fmt: skip
        at_b = at_a + 13
        free = [at_a] * a + [at_b] * b
        heapq.heapify(free)
        end = 0
        for _ in range(jobs):
            t = heapq.heappop(free)
            end = max(end, t + cost)
            heapq.heappush(free, t + cost)
        assert _list_schedule_end(jobs, cost, a, at_a, b, at_b) == end, (jobs, cost, a, b)


def test_tail_split_on_the_bench_grids():
    # the bwd bench's unmasked rows on 132 SMs: D = 128 / 256 launch 2048 key tiles (68 in
    # the last wave), D = 96 2688 (48), D = 64 4096 (4); walks of 13 query tiles (1k at
    # tile_m 80) gain too little for the fixup
    from cute_attn.arch.common.tail_model import tail_split

    assert tail_split(2048, 132, 205, 4, 2) == (68, 3)
    assert tail_split(2048, 132, 52, 4, 2) == (68, 3)
    assert tail_split(2048, 132, 13, 4, 2) == (0, 1)
    assert tail_split(2688, 132, 43, 4, 2) == (48, 2)
    assert tail_split(4096, 132, 16, 4, 2) == (4, 4)
    assert tail_split(132 * 15, 132, 205, 4, 2) == (0, 1)  # full waves


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
