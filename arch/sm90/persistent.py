"""The work units of a persistent forward grid (FwdTileConfig.persistent_ctas > 0).

A persistent CTA walks a static stride over work units of dense inputs: query tiles fastest,
then heads, then batches (the CTAs running together share a head's K and V). Without a mask a
unit is one tile. Under a right bound the first query tiles (the ramp) pair up, complementary
in work, and under a window the tiles after the ramp are one unit each (`unit_tile`). The
producer and the consumers walk the same units in the same order (`walk`); the host part of
the kernel's `__call__` sizes the grid from `ramp` and `units_per_pair`.

Constraints: dense inputs only (no packed sequences, splits, pages or packed GQA rows; the
kernel's attribute setup refuses them). Compiled as part of FlashFwdSm90 (flash_fwd.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..common.features import InputFeatures
from ..common.mask import TileMask
from ..common.seqlen import SeqInfo


class PersistentUnits:
    """Work units of one persistent variant: its tile sizes, mask bounds (static presence),
    input features and mask form (FwdTileConfig.mask_bits)."""

    def __init__(
        self,
        tile_m: int,
        tile_n: int,
        has_left: bool,
        has_right: bool,
        features: InputFeatures,
        mask_bits: bool,
    ):
        self.tile_m, self.tile_n = tile_m, tile_n
        self.has_left, self.has_right = has_left, has_right
        self.masked = has_left or has_right
        self.features = features
        self.mask_bits = mask_bits

    @cute.jit
    def walk(self, tile_args: tuple, q_state, kv_state, tile):
        """This CTA's work units of a persistent grid in order (`cta_units`,
        `unit_tile`), calling `tile(m_block, head, seq, mask, n_min, n_max, q_state,
        kv_state) -> (q_state, kv_state)` for each tile: the producer's and the consumers'
        shared walk, so both see the same tiles in the same order."""
        seqlen_q, seqlen_k, num_heads, num_batch, window_left, _ = tile_args
        num_units, first, stride = self.cta_units(
            seqlen_q, seqlen_k, num_heads, num_batch, window_left
        )
        if cutlass.const_expr(self.masked):
            # each unit is two tiles (the second may not exist): 2 x this CTA's units
            for j in cutlass.range(2 * cute.ceil_div(num_units - first, stride), unroll=1):
                unit, half = first + (j >> 1) * stride, j & 1
                m_block, head, seq, mask, n_min, n_max, valid = self.unit_tile(
                    unit, half, *tile_args
                )
                if valid:
                    q_state, kv_state = tile(
                        m_block, head, seq, mask, n_min, n_max, q_state, kv_state
                    )
        else:
            # its own stride loop: one loop over 2^k tiles a unit for both (k = 0 here) gives
            # the same causal PTX but a different loop in this one, whose PTX is the measured
            # kernel's (docs/perf/README.md, sixteenth session)
            for unit in cutlass.range(first, num_units, stride, unroll=1):
                m_block, head, seq, mask, n_min, n_max, _ = self.unit_tile(unit, 0, *tile_args)
                q_state, kv_state = tile(m_block, head, seq, mask, n_min, n_max, q_state, kv_state)
        return q_state, kv_state

    def ramp(self, num_m_blocks: Int32, seqlen_q: Int32, seqlen_k: Int32, window_left: Int32):
        """Under a right bound, the first query tiles, whose key range starts at key tile 0
        (no left bound cuts it) and grows tile by tile: every tile without a left bound, else
        those with m * tile_m + (seqlen_k - seqlen_q) - window_left < tile_n
        (TileMask.n_block_range). Without a right bound those tiles all see every key: no
        ramp."""
        if cutlass.const_expr(not self.has_right):
            return 0
        if cutlass.const_expr(not self.has_left):
            return num_m_blocks
        edge = window_left + self.tile_n - (seqlen_k - seqlen_q)
        return cutlass.min(cute.ceil_div(cutlass.max(edge, 0), self.tile_m), num_m_blocks)

    def units_per_pair(self, num_m_blocks, ramp):
        """Work units of one (head, batch) of a persistent grid: one per query tile without a
        mask; under a mask one per pair of complementary ramp tiles (`ramp`), then
        one per tile after the ramp (`unit_tile`)."""
        if cutlass.const_expr(not self.masked):
            return num_m_blocks
        if cutlass.const_expr(not self.has_left):
            return (num_m_blocks + 1) // 2  # the ramp is every tile
        return (ramp + 1) // 2 + num_m_blocks - ramp

    @cute.jit
    def cta_units(
        self,
        seqlen_q: Int32,
        seqlen_k: Int32,
        num_heads: Int32,
        num_batch: Int32,
        window_left: Int32,
    ):
        """(unit count, this CTA's first unit, stride) of a persistent grid."""
        num_units = self.num_units(seqlen_q, seqlen_k, num_heads, num_batch, window_left)
        return num_units, cute.arch.block_idx()[0], cute.arch.grid_dim()[0]

    @cute.jit
    def num_units(
        self,
        seqlen_q: Int32,
        seqlen_k: Int32,
        num_heads: Int32,
        num_batch: Int32,
        window_left: Int32,
    ):
        """The work units of a persistent grid over all heads and batches: the device walk's
        count and the host's grid size (at most one CTA a unit)."""
        num_m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        ramp = self.ramp(num_m_blocks, seqlen_q, seqlen_k, window_left)
        return self.units_per_pair(num_m_blocks, ramp) * num_heads * num_batch

    @cute.jit
    def unit_tile(
        self,
        unit: Int32,
        half: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        num_heads: Int32,
        num_batch: Int32,
        window_left: Int32,
        window_right: Int32,
    ):
        """(m_block, head, seq, mask, n_min, n_max, valid) of a persistent grid's work unit
        over dense inputs, its query tiles fastest, then heads, then batches (the CTAs running
        together share a head's K and V). Without a mask a unit is one tile (`half` unused,
        always valid).

        Under a mask the ramp (`ramp`: the first R query tiles, whose key ranges
        start at key tile 0 and end further right tile by tile) goes in units of two tiles,
        the ramp's last tile but u (half 0) and its tile u (half 1; not `valid` where it is
        the same tile, the middle one of an odd ramp). Their key tiles sum to the same count
        for every u (with Sq <= Sk, up to a tile of rounding). Under a window the tiles after
        the ramp are one unit each (half 1 not `valid`): both ends of their key ranges move
        with the tile, so each is about the work of a ramp pair. A static stride over units
        then spreads equal work. Over single tiles a CTA could draw the longest tile of every
        pass: -35% at 4k causal D=128 in a first try that ordered tiles longest first in
        passes of alternating direction; pairs over all of a window's tiles lost 10% at 16k
        with a 4k window (docs/perf/README.md). Tiles whose key range the right bound clips
        at seqlen_k (a window reaching right of the diagonal) are lighter; not paired."""
        num_m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        ramp = self.ramp(num_m_blocks, seqlen_q, seqlen_k, window_left)
        per_pair = self.units_per_pair(num_m_blocks, ramp)
        m_block = unit % per_pair
        rest = unit // per_pair
        head = rest % num_heads
        valid = True
        if cutlass.const_expr(self.masked):
            mirror = ramp - 1 - m_block
            if cutlass.const_expr(self.has_left):
                ramp_units = (ramp + 1) // 2
                in_ramp = m_block < ramp_units
                valid = (half == 0) | (in_ramp & (mirror != m_block))
                m_block = cutlass.select_(
                    in_ramp,
                    cutlass.select_(half == 0, mirror, m_block),
                    m_block - ramp_units + ramp,
                )
            else:
                valid = (half == 0) | (mirror != m_block)
                m_block = cutlass.select_(half == 0, mirror, m_block)
        seq = SeqInfo.create(
            self.features, rest // num_heads, seqlen_q, seqlen_k, None, None, None, None, None
        )
        mask = TileMask(
            self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k, window_left, window_right,
            self.has_left, self.has_right, self.mask_bits,
        )  # fmt: skip
        n_min, n_max = mask.n_block_range(m_block)
        return m_block, head, seq, mask, n_min, n_max, valid
