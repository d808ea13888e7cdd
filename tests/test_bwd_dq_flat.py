"""CPU: the register-order dQ tile (arch/common/dq_flat.py) that the SM90 backward stages and
its postprocess reads back, for every flat tile the backward table picks."""

from __future__ import annotations

import itertools

import pytest

from cute_attn.arch.common.dq_flat import DqFlatTile, flat_coords
from cute_attn.arch.sm90.bwd_tiles import BWD_HEAD_DIMS, BwdTileConfig, bwd_tile_config


def _table_flat_tiles():
    tiles = set()
    flag_sets = list(itertools.product((False, True), repeat=7))
    for (d, dv), flags in itertools.product(BWD_HEAD_DIMS, flag_sets):
        tile = bwd_tile_config(d, dv, *flags).dq_flat_tile(d)
        if tile is not None:
            tiles.add((d, tile))
    return sorted(tiles, key=str)


def test_table_flat_tiles_are_the_swapped_dq_tiles():
    tiles = _table_flat_tiles()
    assert tiles, "the table uses no flat dQ tile"
    assert {d for d, _ in tiles} == {64, 96, 128}, tiles
    for d, tile in tiles:
        if d == 64:
            # D=64's 128-row tile: one 64-row part whose query columns the two warpgroups
            # split, each half handed over on its own (BwdTileConfig.dq_wg_handoff)
            assert (tile.tile_m, tile.parts, tile.groups, tile.head_dim) == (128, 1, 2, 64)
            continue
        # a 64-row part per warpgroup (D=96 over 128 head-dim rows, D=128) on the 80 / 96-row
        # tiles
        assert tile.tile_m == (96 if d == 96 else 80), (d, tile)
        assert (tile.parts, tile.groups, tile.head_dim) == (2, 1, 128), (d, tile)
    # D = 96's tiles skip dQ^T's zero rows (BwdTileConfig.dq_skip_zero_rows) and so are
    # compact: the accumulator's rows are the tensor's 96 floats, not 128
    assert {(d, tile.acc_dim) for d, tile in tiles} == {(64, 64), (96, 96), (128, 128)}, tiles


def test_each_warpgroups_half_of_a_split_tile_is_one_contiguous_run():
    # dq_wg_handoff: the writer adds warpgroup g's query columns as the g-th half of the
    # flat tile, so every element of those columns must lie in that half
    tile = DqFlatTile(128, 1, 2)
    half = tile.tile_elems // 2
    for d in range(tile.head_dim):
        for q in range(tile.tile_m):
            assert tile.offset(d, q) // half == q // (tile.tile_m // 2), (d, q)


@pytest.mark.parametrize(
    "tile",
    [DqFlatTile(128, 1, 2), DqFlatTile(80, 2, 1), DqFlatTile(96, 2, 1), DqFlatTile(64, 2, 1)]
    + [t for _, t in _table_flat_tiles()],
    ids=str,
)
def test_flat_layout_is_a_bijection_and_flat_coords_inverts_it(tile):
    offsets = set()
    for d in range(tile.head_dim):
        for q in range(tile.tile_m):
            o = tile.offset(d, q)
            assert 0 <= o < tile.tile_elems
            assert flat_coords(tile, o) == (d, q)
            offsets.add(o)
    assert len(offsets) == tile.tile_elems


def test_flat_layout_puts_each_threads_2x2_block_in_one_16_byte_run():
    # wgmma C fragment (m64nNk16): thread t = 32 w + l holds rows d = 16 w + l // 4 (+ 8) and
    # columns q = 8 j + 2 (l % 4) (+ 1) of each group's columns; its block j is 4 contiguous
    # floats at ((w * J + j) * 32 + l) * 4, so a warp's 128-bit stores cover 512 contiguous
    # bytes, and each warp's blocks are one run of warp_elems
    tile = DqFlatTile(80, 2, 1)
    for w, lane, j in itertools.product(range(4), range(32), range(tile.chunks)):
        d, q = 16 * w + lane // 4, 8 * j + 2 * (lane % 4)
        block = [tile.offset(d + 8 * h, q + e) for h in (0, 1) for e in (0, 1)]
        assert block == [((w * tile.chunks + j) * 32 + lane) * 4 + i for i in range(4)]
        assert block[0] // tile.warp_elems == w


@pytest.mark.parametrize("tile", [DqFlatTile(96, 2, 1), DqFlatTile(80, 2, 1)], ids=str)
def test_zero_rows_past_the_head_dim_are_whole_runs_at_the_part_end(tile):
    # D = 96 over dQ^T's 128 rows (BwdTileConfig.dq_head_dim): the writer adds only the
    # live_warps runs of each part, so every real element must lie in them and every element
    # of the rows past 96 after them
    dims = 96
    assert [tile.live_warps(p, dims) for p in range(tile.parts)] == [4, 2]
    for d in range(tile.head_dim):
        for q in range(tile.tile_m):
            part, r = divmod(tile.offset(d, q), tile.part_elems)
            live = r < tile.live_warps(part, dims) * tile.warp_elems
            assert live == (d < dims), (d, q)


def test_a_compact_tile_stores_exactly_its_real_elements_as_a_prefix():
    # DqFlatTile.dims: the accumulator keeps each tile's first acc_elems floats, so every
    # element of the tensor's head dims must lie there and every zero row's element past it
    for tile in [t for _, t in _table_flat_tiles() if t.dims] + [DqFlatTile(80, 2, 1, 112)]:
        assert tile.acc_elems == tile.dims * tile.tile_m
        for d in range(tile.head_dim):
            for q in range(tile.tile_m):
                assert (tile.offset(d, q) < tile.acc_elems) == (d < tile.dims), (tile, d, q)


@pytest.mark.parametrize(
    "tile", [(96, 1, 2, 32), (96, 2, 1, 40), (96, 2, 1, 64), (96, 2, 1, 144)], ids=str
)
def test_a_compact_tile_drops_only_whole_runs_of_its_last_part(tile):
    # split query columns interleave the groups' runs; 40 dims is not whole warp runs; 64
    # would drop a whole part; 144 is past dQ^T's rows
    with pytest.raises(ValueError, match="compact flat tile"):
        DqFlatTile(*tile)


def test_dq_flat_needs_the_swapped_dq_gemm():
    with pytest.raises(ValueError, match="dq_swap_ab"):
        BwdTileConfig(tile_m=64, dq_flat=True)


def test_dq_wg_handoff_needs_a_flat_tile_split_by_query_columns():
    with pytest.raises(ValueError, match="dq_wg_handoff"):
        BwdTileConfig(tile_m=128, dq_swap_ab=True, dq_swizzle=128, dq_wg_handoff=True)
    with pytest.raises(ValueError, match="dq_wg_handoff"):
        BwdTileConfig(
            tile_m=80, dq_swap_ab=True, dq_half_staging=True, dq_stages=2, dq_flat=True,
            dq_wg_handoff=True,
        )  # fmt: skip
