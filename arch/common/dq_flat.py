"""The backward's dQ accumulator tile in register order ("flat" dQ staging).

With dQ^T = K^T dS^T on SM90 (BwdTileConfig.dq_swap_ab) each thread's accumulator holds, per
8 query columns, a 2 x 2 block: query rows q, q + 1 of head dims d, d + 8. In a (query, head
dim) staging tile those four floats sit in two rows, so the staging takes 32-bit stores. The
flat tile instead stores each block as 4 contiguous floats, lane after lane (a warp's chunk j,
then its chunk j + 1, then the next warp's), so a warp's 128-bit stores cover 512 contiguous
bytes (no bank conflicts), and the writer adds the tile into global memory in contiguous runs
(BwdTileConfig.dq_flat). The fp32 accumulator in global memory is then (batch, head, row,
dq_head_dim) with each tile of tile_m rows holding its elements in this order, and the
postprocess (bwd_postprocess) maps them back to (row, dim).

One part is a 64-row head-dim slice of dQ^T (the wgmma M of one warpgroup) over the tile's
tile_m query columns: under dq_half_staging each warpgroup owns one part (parts = 2, groups
= 1), else the warpgroups split the query columns of the one part (parts = 1, groups = the
warpgroups). Within a part, element (d, q) of the 128-thread wgmma C fragment (thread t = 32
w + l with d = 16 w + l / 4 + 8 h, q = 8 j + 2 (l % 4) + e, group g's columns after group g -
1's) sits at (((g 4 + w) J + j) 32 + l) 4 + 2 h + e, J = tile_m / groups / 8: warp-major, so
each warp's 16 head-dim rows of a group are one contiguous run (warp_elems). Where dQ^T's rows
run past the tensor's head dim (BwdTileConfig.dq_head_dim: D = 96 over 128 rows) the zero
rows are then whole runs at a part's end (live_warps), which the writer never adds and the
postprocess never reads. The tile is `parts` parts in a row.

Compact tiles (`dims` > 0, BwdTileConfig.dq_skip_zero_rows): when only the last part has zero
rows, they are the tile's last runs, so the accumulator keeps just the first `dims` x tile_m
floats of each tile (acc_dim floats a row: D = 96 stores 96, not 128, a quarter less memory
for the preprocess to clear). The offsets within a tile are the same either way.

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
    # 0: the accumulator holds every head-dim row of dQ^T; else it holds only the tensor's
    # first `dims` (the live runs, a prefix of each tile: compact, see the module docstring)
    dims: int = 0

    def __post_init__(self):
        if self.tile_m % (8 * self.groups):
            raise ValueError(f"tile_m {self.tile_m}: 8 query columns per chunk and group")
        if self.dims and not (
            self.groups == 1
            and self.dims % 16 == 0
            and PART_DIM * (self.parts - 1) < self.dims <= self.head_dim
        ):
            # one group: a part's runs are its warps' in order, so dropped runs of the last
            # part are the tile's tail; whole 16-row warp runs only
            raise ValueError(
                f"compact flat tile of {self.dims} dims: one group, whole warp runs of the last"
                f" part (of {self.parts} x {PART_DIM})"
            )

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
    def acc_dim(self) -> int:
        """Floats a row of the accumulator in global memory: its tiles are acc_elems apart."""
        return self.dims or self.head_dim

    @property
    def acc_elems(self) -> int:
        """A tile's floats in the accumulator: the first acc_elems of its flat order."""
        return self.acc_dim * self.tile_m

    @property
    def chunks(self) -> int:
        """Query-column chunks of 8 per group (J)."""
        return self.tile_m // self.groups // 8

    @property
    def warp_elems(self) -> int:
        """One warp's 16 head-dim rows over one group's query columns: a contiguous run."""
        return 128 * self.chunks

    def live_warps(self, part: int, dims: int) -> int:
        """Warps of `part` whose rows hold any of dQ^T's first `dims` head dims (the others
        hold only the zero rows of a wider dQ^T tile, BwdTileConfig.dq_head_dim)."""
        return min(4, max(0, -(-(dims - PART_DIM * part) // 16)))

    def part_layout(self) -> tuple[tuple, tuple]:
        """(shape, stride) of one part as a (head dim, query) -> offset layout: head dim as
        (l / 4, h, w), query as (e, l % 4, j, g)."""
        j = self.chunks
        return ((8, 2, 4), (2, 4, j, self.groups)), ((16, 2, 128 * j), (1, 4, 128, 512 * j))

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
    g, r = r // (4 * tile.warp_elems), r % (4 * tile.warp_elems)
    w, r = r // tile.warp_elems, r % tile.warp_elems
    j, r = r // 128, r % 128
    lane, v = r // 4, r % 4
    d = part * PART_DIM + 16 * w + lane // 4 + 8 * (v // 2)
    q = g * 8 * tile.chunks + 8 * j + 2 * (lane % 4) + v % 2
    return d, q


__all__ = ["PART_DIM", "DqFlatTile", "flat_coords"]
