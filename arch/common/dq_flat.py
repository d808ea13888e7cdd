"""The backward's dQ accumulator tile in register order ("flat" dQ staging).

With dQ^T = K^T dS^T on SM90 (BwdTileConfig.dq_swap_ab) each thread's accumulator holds, per
8 query columns, a 2 x 2 block: query rows q, q + 1 of head dims d, d + 8. In a (query, head
dim) staging tile those four floats sit in two rows, so the staging takes 32-bit stores. The
flat tile instead stores each block as 4 contiguous floats, thread after thread (chunk j of
every thread, then chunk j + 1), so a warp's 128-bit stores cover 512 contiguous bytes (no
bank conflicts), and the writer adds the tile into global memory as one contiguous run
(BwdTileConfig.dq_flat). The fp32 accumulator in global memory is then (batch, head, row,
dq_head_dim) with each tile of tile_m rows holding its elements in this order, and the
postprocess (bwd_postprocess) maps them back to (row, dim).

One part is a 64-row head-dim slice of dQ^T (the wgmma M of one warpgroup) over the tile's
tile_m query columns: under dq_half_staging each warpgroup owns one part (parts = 2, groups
= 1), else the warpgroups split the query columns of the one part (parts = 1, groups = the
warpgroups). Within a part, element (d, q) of the 128-thread wgmma C fragment (thread t = 32
w + l with d = 16 w + l / 4 + 8 h, q = 8 j + 2 (l % 4) + e, group g's columns after group g -
1's) sits at ((g J + j) 128 + t) 4 + 2 h + e, J = tile_m / groups / 8. The tile is `parts`
parts in a row.

Pure Python (DqFlatTile) plus one DSL helper (flat_coords) that inverts the layout; the unit
test checks both against each other (tests/test_bwd_dq_flat.py).
"""

from __future__ import annotations

import dataclasses

PART_DIM = 64  # head-dim rows of one part: a warpgroup's wgmma M


@dataclasses.dataclass(frozen=True)
class DqFlatTile:
    tile_m: int  # query rows (columns of dQ^T) of a tile
    parts: int  # 64-row head-dim parts, in a row
    groups: int  # warpgroups that split the query columns of each part

    def __post_init__(self):
        if self.tile_m % (8 * self.groups):
            raise ValueError(f"tile_m {self.tile_m}: 8 query columns per chunk and group")

    @property
    def head_dim(self) -> int:
        """dQ^T's head-dim rows (the accumulator's row length in global memory)."""
        return PART_DIM * self.parts

    @property
    def part_elems(self) -> int:
        return PART_DIM * self.tile_m

    @property
    def tile_elems(self) -> int:
        return self.parts * self.part_elems

    @property
    def chunks(self) -> int:
        """Query-column chunks of 8 per group (J)."""
        return self.tile_m // self.groups // 8

    def part_layout(self) -> tuple[tuple, tuple]:
        """(shape, stride) of one part as a (head dim, query) -> offset layout: head dim as
        (l / 4, h, w), query as (e, l % 4, j, g)."""
        j = self.chunks
        return ((8, 2, 4), (2, 4, j, self.groups)), ((16, 2, 128), (1, 4, 512, 512 * j))

    def offset(self, d: int, q: int) -> int:
        """Flat offset of (head dim d, query q) within the tile (pure Python, for tests)."""
        p, d = divmod(d, PART_DIM)
        (sd, sq), (td, tq) = self.part_layout()
        off = p * self.part_elems
        for x, shape, stride in ((d, sd, td), (q, sq, tq)):
            for n, s in zip(shape, stride):
                off += (x % n) * s
                x //= n
        return off


def flat_coords(tile: DqFlatTile, o):
    """(head dim, query) of flat offset `o` in a tile: the inverse of DqFlatTile.offset. Works
    on Python ints and on DSL integers (constant divisors only)."""
    part, r = o // tile.part_elems, o % tile.part_elems
    g, r = r // (512 * tile.chunks), r % (512 * tile.chunks)
    j, r = r // 512, r % 512
    t, v = r // 4, r % 4
    w, lane = t // 32, t % 32
    d = part * PART_DIM + 16 * w + lane // 4 + 8 * (v // 2)
    q = g * 8 * tile.chunks + 8 * j + 2 * (lane % 4) + v % 2
    return d, q


__all__ = ["PART_DIM", "DqFlatTile", "flat_coords"]
