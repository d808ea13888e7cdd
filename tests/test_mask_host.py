"""TileMask (arch/common/mask.py) against the package's mask rule, on the CPU.

The CuTe DSL runs a `@cute.jit` function without a kernel launch as host code
(host_jit.py), so the forward's tile ranges and per-element mask execute here over host
tensors: one SM90 wgmma accumulator partition per thread of a warpgroup (all 128 threads in
turn), tile by tile, for one query row a query and for packed GQA rows (`rows_per_query` G:
row r is query r // G; where G does not divide the 64 rows, query tile m starts at row
m x G x floor(64 / G), as FlashFwdSm90.tile_rows, and its last rows are padding).
Each result is compared with `reference.visible_mask`, the contract's one mask rule:

* `apply` sets exactly the invisible scores of every row that holds a query to -inf;
* `n_block_range` contains every key tile with a visible key;
* `unmasked_range` and `tile_needs_mask(...) == False` only name fully visible tiles;

and the backward's side (one row a query): `apply(transposed=True)` on S^T tiles (keys as
rows), `m_block_range` / `unmasked_m_range` per key tile, and `n_block_end_bwd`, which must
be one past the last key tile whose query range holds the query tile (the deterministic
mode's turn count).

The per-row keep-bit form (`mask_bits`) uses PTX shifts and is not run here (its SASS is
checked by the compile tests and its results by the GPU tests).
"""

# no `from __future__ import annotations`: the DSL reads the host function's annotations,
# which name the cutlass modules imported inside _mask_grid_fn
import functools

import pytest
import torch
from host_jit import sm90_dsl

from cute_attn.reference import visible_mask

TILE_M, TILE_N = 64, 128
BWD_TILE_M, BWD_TILE_N = 128, 64  # the backward's S^T tile: 64 keys x 128 queries
WINDOWS = [(-1, -1), (-1, 0), (5, 0), (37, 11), (0, 0), (100, -1), (2, 7)]
SHAPES = [(1, 1), (5, 2), (2, 5), (3, 300), (40, 300), (113, 203), (239, 1), (17, 1000)]
# several query and key tiles, more queries than keys: ranges the key length does not cap
# (the forward runs them for groups up to 8 only, to keep the grids small)
LONG_SHAPES = [(777, 333), (300, 457), (1000, 1000)]


@functools.cache
def _mask_grid_fn():
    """The host function (S, R, sq, sk, left, right, G, has_left, has_right); built once."""
    sm90_dsl()
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float32, Int32

    from cute_attn.arch.common.mask import TileMask

    @cute.jit
    def mask_grid(
        mS: cute.Tensor,  # (num_m * TILE_M, num_n * TILE_N) fp32 zeros
        mR: cute.Tensor,  # (num_m, 4 + num_n) int32
        seqlen_q: Int32,
        seqlen_k: Int32,
        window_left: Int32,
        window_right: Int32,
        rows_per_query: cutlass.Constexpr[int],
        has_left: cutlass.Constexpr[bool],
        has_right: cutlass.Constexpr[bool],
        tile_rows: cutlass.Constexpr[int],
    ):
        major = cute.nvgpu.OperandMajorMode.K
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, major, major, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(TILE_M, TILE_N),
        )  # fmt: skip
        mask = TileMask(
            tile_rows, TILE_N, seqlen_q, seqlen_k, window_left, window_right, has_left,
            has_right, False, rows_per_query,
        )  # fmt: skip
        cS = cute.make_identity_tensor((TILE_M, TILE_N))
        num_n = mR.shape[1] - 4
        for m in cutlass.range(mR.shape[0], unroll=1):
            n_min, n_max = mask.n_block_range(m)
            a, b = mask.unmasked_range(m, n_min, n_max)
            mR[m, 0] = n_min
            mR[m, 1] = n_max
            mR[m, 2] = a
            mR[m, 3] = b
            for n in cutlass.range(num_n, unroll=1):
                mR[m, 4 + n] = Int32(cutlass.select_(mask.tile_needs_mask(m, n), 1, 0))
                # tile m's rows start at m x tile_rows (padded tiles overlap the next one by
                # their padding rows, whose query is that tile's first: the same scores)
                gS = cute.local_tile(
                    cute.domain_offset((m * tile_rows, 0), mS), (TILE_M, TILE_N), (0, n)
                )
                for t in cutlass.range(128, unroll=1):
                    thr = tiled_mma.get_slice(t)
                    mask.apply(thr.partition_C(gS), thr.partition_C(cS), m, n)

    return mask_grid


@functools.cache
def _bwd_grid_fn():
    """The backward's host function (ST, R, E, sq, sk, left, right, has_left, has_right)."""
    sm90_dsl()
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float32, Int32

    from cute_attn.arch.common.mask import TileMask

    @cute.jit
    def bwd_grid(
        mST: cute.Tensor,  # (num_n * BWD_TILE_N, num_m * BWD_TILE_M) fp32 zeros: S^T
        mR: cute.Tensor,  # (num_n, 4) int32
        mE: cute.Tensor,  # (num_m,) int32
        seqlen_q: Int32,
        seqlen_k: Int32,
        window_left: Int32,
        window_right: Int32,
        has_left: cutlass.Constexpr[bool],
        has_right: cutlass.Constexpr[bool],
    ):
        major = cute.nvgpu.OperandMajorMode.K
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, major, major, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(BWD_TILE_N, BWD_TILE_M),
        )  # fmt: skip
        mask = TileMask(
            BWD_TILE_M, BWD_TILE_N, seqlen_q, seqlen_k, window_left, window_right, has_left,
            has_right,
        )  # fmt: skip
        cS = cute.make_identity_tensor((BWD_TILE_N, BWD_TILE_M))
        num_m = mE.shape[0]
        for m in cutlass.range(num_m, unroll=1):
            mE[m] = mask.n_block_end_bwd(m)
        for n in cutlass.range(mR.shape[0], unroll=1):
            m_min, m_max = mask.m_block_range(n)
            a, b = mask.unmasked_m_range(n, m_min, m_max)
            mR[n, 0] = m_min
            mR[n, 1] = m_max
            mR[n, 2] = a
            mR[n, 3] = b
            for m in cutlass.range(num_m, unroll=1):
                gS = cute.local_tile(mST, (BWD_TILE_N, BWD_TILE_M), (n, m))
                for t in cutlass.range(128, unroll=1):
                    thr = tiled_mma.get_slice(t)
                    mask.apply(thr.partition_C(gS), thr.partition_C(cS), m, n, transposed=True)

    return bwd_grid


def _run(sq: int, sk: int, left: int, right: int, group: int):
    mask_grid = _mask_grid_fn()  # first: it picks the DSL's arch before cutlass loads
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    rows, tile_rows = group * sq, _tile_rows(group)
    num_m, num_n = -(-rows // tile_rows), -(-sk // TILE_N) + 1  # one key tile past the keys
    S = torch.zeros((num_m - 1) * tile_rows + TILE_M, num_n * TILE_N, dtype=torch.float32)
    R = torch.zeros(num_m, 4 + num_n, dtype=torch.int32)
    mask_grid(
        from_dlpack(S), from_dlpack(R), Int32(sq), Int32(sk), Int32(max(left, 0)),
        Int32(max(right, 0)), group, left >= 0, right >= 0, tile_rows,
    )  # fmt: skip
    return S, R


def _tile_rows(group: int) -> int:
    """The rows a query tile advances (FlashFwdSm90.tile_rows)."""
    from cute_attn.arch.sm90.tile_config import packed_tile_rows

    return packed_tile_rows(TILE_M, group)


@pytest.mark.parametrize("group", [1, 4, 8, 128, 7, 3])  # 7 and 3: padded tiles (63 rows)
@pytest.mark.parametrize("window", WINDOWS)
def test_tile_mask_matches_the_rule(window, group):
    left, right = window
    tile_rows = _tile_rows(group)
    for sq, sk in SHAPES + (LONG_SHAPES if group <= 8 else []):
        S, R = _run(sq, sk, left, right, group)
        rows, cols = S.shape
        # expected per packed row: query r // G, keys past seqlen_k invisible
        vis = torch.zeros(sq, cols, dtype=torch.bool)
        vis[:, :sk] = visible_mask(sq, sk, left, right)
        valid = group * sq
        expect = vis.repeat_interleave(group, dim=0)
        got = S[:valid] == 0.0
        assert torch.equal(got, expect), (sq, sk, window, group)
        assert bool((S[:valid][~expect] == float("-inf")).all())
        for m in range(R.shape[0]):
            lo_row, hi_row = m * tile_rows, min((m + 1) * tile_rows, valid)
            if lo_row >= valid:
                continue
            n_min, n_max, a, b = R[m, :4].tolist()
            block = expect[lo_row:hi_row]
            seen = [
                bool(block[:, n * TILE_N : (n + 1) * TILE_N].any()) for n in range(cols // TILE_N)
            ]
            full = [
                bool(block[:, n * TILE_N : (n + 1) * TILE_N].all()) for n in range(cols // TILE_N)
            ]
            where = (sq, sk, window, group, m)
            # every key tile with a visible key is in [n_min, n_max)
            assert all(n_min <= n < n_max for n, s in enumerate(seen) if s), (where, R[m])
            # the mask-free loop and the tiles that skip the mask are fully visible
            assert all(full[n] for n in range(a, b)) and n_min <= a <= b <= max(n_max, n_min), (
                where, R[m])  # fmt: skip
            needs = R[m, 4:].tolist()
            assert all(full[n] for n, x in enumerate(needs) if not x), (where, needs, full)


@pytest.mark.parametrize("window", WINDOWS)
def test_tile_mask_backward_matches_the_rule(window):
    bwd_grid = _bwd_grid_fn()
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    left, right = window
    for sq, sk in SHAPES + LONG_SHAPES:
        num_m, num_n = -(-sq // BWD_TILE_M), -(-sk // BWD_TILE_N)
        ST = torch.zeros(num_n * BWD_TILE_N, num_m * BWD_TILE_M, dtype=torch.float32)
        R = torch.zeros(num_n, 4, dtype=torch.int32)
        E = torch.zeros(num_m, dtype=torch.int32)
        bwd_grid(
            from_dlpack(ST), from_dlpack(R), from_dlpack(E), Int32(sq), Int32(sk),
            Int32(max(left, 0)), Int32(max(right, 0)), left >= 0, right >= 0,
        )  # fmt: skip
        # expected S^T over every key row of the grid and the real query columns
        expect = torch.zeros(ST.shape[0], sq, dtype=torch.bool)
        expect[:sk] = visible_mask(sq, sk, left, right).T
        assert torch.equal(ST[:, :sq] == 0.0, expect), (sq, sk, window)
        where = (sq, sk, window)
        last_key_tile = {}  # query tile -> the last key tile whose range holds it
        for n in range(num_n):
            m_min, m_max, a, b = R[n].tolist()
            block = expect[n * BWD_TILE_N : (n + 1) * BWD_TILE_N]
            tiles = [block[:, m * BWD_TILE_M : (m + 1) * BWD_TILE_M] for m in range(num_m)]
            seen = [bool(t.any()) for t in tiles]
            full = [bool(t.all()) for t in tiles]
            assert all(m_min <= m < m_max for m, x in enumerate(seen) if x), (where, n, R[n])
            assert all(full[m] for m in range(a, b)), (where, n, R[n], full)
            for m in range(max(m_min, 0), min(m_max, num_m)):
                last_key_tile[m] = n
        for m, n in last_key_tile.items():
            assert E[m] == n + 1, (where, m, E.tolist(), last_key_tile)
