"""The dQ writer role of the SM90 backward (arch/sm90/flash_bwd.py, FlashBwdSm90).

The producer warpgroup's writer warp (BwdRoles.dq_warp; with BwdTileConfig.dq_writers = w
the w warps from it, taking the walk's query tiles in turn) takes each query tile's dQ partial from
the consumers' fp32 staging buffer in smem (named barriers: full from the consumers, empty
back to them) and adds it into the global fp32 accumulator with a TMA bulk reduce-add: the
whole tile, a warpgroup's head-dim half (dq_half_staging) or, over the flat tile in register
order (dq_flat, arch/common/dq_flat.py), its boxes (without dQ^T's zero rows under
dq_skip_zero_rows).

Deterministic order (FlashBwdSm90(deterministic=True)): key tile n adds its partial of query
tile m only at its turn, when the int32 counter of (batch, head, m) says the key tiles
before it in a fixed order have added theirs and those adds landed; then it adds 1 (release).
The fp32 sums thus happen in one order: bitwise identical run to run.

Under post_overlap each CTA's writers count it done for the postprocess once their adds
landed; a key tile split over parts (BwdTileConfig.tail_split) counts once, by the last of
its parts' writers to land (a counter per tile in sem).

BwdDqWriter is a mixin: it holds no state of its own and reads the kernel's attributes
(config, roles, flat, tile sizes, deterministic, post_overlap, tail_split) and helpers
(_padded_rows, _wait_ready); FlashBwdSm90 derives from it. Torch-free.

Compile without a GPU: CUTE_DSL_ARCH=sm_90a python -m cute_attn compile --arch sm_90a
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..common.mask import TileMask
from ..common.schedule import TailSplit, tail_slot
from ..common.seqlen import SeqInfo
from ..common.timeline import W_CLK_WRITER_END, clock, stamp
from .primitives import tma_tiles


class BwdDqWriter:
    """The dQ writer role of FlashBwdSm90 and the setup of its TMA boxes."""

    def _setup_flat_boxes(self):
        """The dQ writer's units and TMA boxes over the flat tile (dq_flat). A unit is what
        one handoff passes: the tile, a warpgroup's part (dq_half_staging) or its query-column
        half (dq_wg_handoff). A box is the unit, or, under BwdTileConfig.dq_skip_zero_rows
        (dQ^T's head-dim rows past the tensor's, dq_head_dim: D = 96 over 128 rows), the runs
        of warps whose rows are real (DqFlatTile.live_warps): the zero rows are not added, a
        quarter of D = 96's bytes, nor stored (a compact tile: the accumulator's tiles hold
        only their live boxes, dq_unit_base / dq_tile_boxes)."""
        self.dq_box_elems, self.dq_unit_live, self.dq_unit_base = 0, (), ()
        self.dq_unit_boxes = self.dq_tile_boxes = 0
        flat = self.flat
        if flat is None:
            return
        # the writer's units (dq_writer's `parts`), each one box
        units = self.config.dq_units
        self.dq_box_elems = flat.tile_elems // units
        self.dq_unit_live = (1,) * units
        if flat.dims:
            # one group (DqFlatTile checks it): the units are the parts, and the zero rows
            # whole warp runs at the last part's end
            live = [flat.live_warps(p, flat.dims) for p in range(flat.parts)]
            box_warps = math.gcd(4, *live)
            self.dq_box_elems = box_warps * flat.warp_elems
            self.dq_unit_live = tuple(n // box_warps for n in live)
        # each unit's boxes in the staging buffer, its first box within a tile of the
        # accumulator, and a tile's boxes there: a compact tile keeps only the live boxes,
        # which are its prefix (DqFlatTile.dims: the zero runs are the last part's last ones)
        self.dq_unit_boxes = flat.tile_elems // units // self.dq_box_elems
        self.dq_unit_base = tuple(
            sum(self.dq_unit_live[:u]) if flat.dims else u * self.dq_unit_boxes
            for u in range(units)
        )
        self.dq_tile_boxes = flat.acc_elems // self.dq_box_elems
        if flat.acc_elems % self.dq_box_elems:
            raise ValueError(f"a tile of {flat.acc_elems} floats: not whole boxes")
        if self.dq_box_elems % 32 or self.dq_box_elems // 32 > 256:
            raise ValueError(f"flat dQ box of {self.dq_box_elems} floats: not a TMA box")

    @cute.jit
    def dq_writer(
        self,
        tma_atom_dQ: cute.CopyAtom,
        mdQacc: cute.Tensor,
        sdQ: cute.Tensor,
        mSem: cute.Tensor,
        mask: TileMask,
        seq: SeqInfo,
        row_off: Int32,
        n_block: Int32,
        head: Int32,
        m_min: Int32,
        m_max: Int32,
        ready_rows: Int32,
        writer: Int32,
        tail: TailSplit,
        mTimeline: cute.Tensor | None,
        pre_arrive: bool = True,
    ):
        """One key tile's dQ adds. `pre_arrive` (compile-time): hand the consumers every
        staging buffer empty first; a persistent CTA does that once, before its first tile
        (`dq_buffers_empty`), since the handoff barriers run on from tile to tile."""
        roles = self.roles
        lane = cute.arch.lane_idx()
        # BwdTileConfig.dq_writers > 1: the writers take the walk's tiles in turn (counted
        # over every query head of a group_heads CTA, as the consumers count them), each
        # handed over on barriers of its own, so one's wait for its adds to land (the
        # deterministic turn) overlaps the others' next adds
        writers = self.config.dq_writers
        full0 = self._dq_full_barrier(roles.bar_dq_full, writer)
        # (query tile, part) tiles: one part, or one per warpgroup (its head-dim half under
        # dq_half_staging, its query-column half of the flat tile under dq_wg_handoff)
        parts, threads = self.config.dq_units, roles.dq_sync_threads
        if cutlass.const_expr(parts > 1):
            threads = roles.dq_half_sync_threads
        # a buffer per warpgroup: its own, or (dq_wg_handoff) its half of the one buffer
        own_bufs = self.dq_wg_bufs or self.dq_wg_handoff
        step = roles.bar_dq_wg_step
        if cutlass.const_expr(pre_arrive):
            self.dq_buffers_empty(writer)
        walked = Int32(0)  # query tiles walked, over every query head
        for g in cutlass.range(self.heads_per_cta, unroll=1):
            head_q = head * self.heads_per_cta + g
            # one counter per query tile (packed: the padded rows' tiles)
            sem_bh = self._padded_rows(mSem[None, head_q, seq.q_batch], row_off // self.tile_m)
            if cutlass.const_expr(self.flat is not None):
                # a tile's boxes in a row from its first row on (varlen: row_off, a multiple
                # of tile_m)
                gdQ = cute.local_tile(
                    mdQacc[None, None, head_q, seq.q_batch],
                    (32, self.dq_box_elems // 32),
                    (0, None),
                )
                tile0 = row_off // self.tile_m
            else:
                gdQ = cute.local_tile(
                    self._padded_rows(mdQacc[None, None, head_q, seq.q_batch], row_off),
                    (self.tile_m, self.tile_dq // parts),
                    (None, None),
                )
            tdQsdQ, tdQgdQ = tma_tiles(tma_atom_dQ, sdQ, gdQ)
            # the preprocess cleared this head's accumulator
            self._wait_ready(mSem, head_q, seq.q_batch, ready_rows)
            for m_block in cutlass.range(m_min, m_max, unroll=1):
                mine = True
                if cutlass.const_expr(writers > 1):
                    mine = self._writer_of(walked) == writer
                    walked += 1
                if mine:
                    if cutlass.const_expr(self.deterministic and self.config.det_poll_early):
                        # the turn is polled while the consumers still compute this tile: once
                        # the partial is staged the add goes at once, with no L2 round trip
                        # between the handoff and the add while the staging buffer is held
                        self._wait_turn(sem_bh.iterator + m_block, mask, n_block, m_block, lane)
                    for part in cutlass.range_constexpr(parts):
                        # warpgroup `part` staged its part (all of dQ when parts == 1), in its own
                        # buffer or the shared one
                        buf = part if cutlass.const_expr(own_bufs) else 0
                        cute.arch.barrier(barrier_id=full0 + step * part, number_of_threads=threads)
                        if cutlass.const_expr(self.flat is not None):
                            # the unit's boxes that hold real head dims, from the unit's first box
                            # in the accumulator's tile (_setup_flat_boxes)
                            first = (tile0 + m_block) * self.dq_tile_boxes + self.dq_unit_base[part]
                            copies = []
                            for i in cutlass.range_constexpr(self.dq_unit_live[part]):
                                src = tdQsdQ[None, buf * self.dq_unit_boxes + i]
                                copies.append((src, tdQgdQ[None, first + i]))
                        else:
                            copies = [(tdQsdQ[None, buf], tdQgdQ[None, m_block, part])]
                        self._dq_add(
                            tma_atom_dQ, copies, sem_bh, mask, n_block, m_block, lane, part, parts,
                            writers == 1,
                        )  # fmt: skip
                        # the warpgroup's own buffer is free again; a shared half buffer goes to the
                        # next part's warpgroup (the first one's next tile)
                        free = part if cutlass.const_expr(own_bufs) else (part + 1) % parts
                        cute.arch.barrier_arrive(
                            barrier_id=roles.bar_dq_empty + step * free, number_of_threads=threads
                        )
                        if cutlass.const_expr(self.deterministic and writers > 1):
                            if cutlass.const_expr(part == parts - 1):
                                # the turn goes on once this tile's adds landed, with its buffer
                                # already back (the other writer's add runs meanwhile)
                                self._add_when_landed(sem_bh.iterator + m_block, lane)
            if cutlass.const_expr(self.post_overlap):
                # count this CTA done for the postprocess once its adds into head_q landed
                done = mSem.iterator + cute.crd2idx(
                    (mSem.shape[0] - 2, head_q, seq.q_batch), mSem.layout
                )
                if cutlass.const_expr(self.tail_split):
                    if tail_slot(tail) >= 0:
                        # a split tile counts once, when its parts' writers all landed
                        parts_done = mSem.iterator + cute.crd2idx(
                            (2 * n_block + 1, head_q, seq.q_batch), mSem.layout
                        )
                        arrivals = Int32(tail.parts.divisor) * writers
                        self._add_when_landed(parts_done, lane, arrivals, done)
                    else:
                        self._add_when_landed(done, lane)
                else:
                    self._add_when_landed(done, lane)
        if cutlass.const_expr(self.config.timeline):
            if lane == 0 and writer == 0:
                stamp(mTimeline, W_CLK_WRITER_END, clock())

    @cute.jit
    def dq_buffers_empty(self, writer: Int32):
        """Every staging buffer starts empty (one shared half buffer: for the first
        warpgroup): the first writer's arrive on each dq_empty barrier."""
        roles = self.roles
        parts, threads = self.config.dq_units, roles.dq_sync_threads
        if cutlass.const_expr(parts > 1):
            threads = roles.dq_half_sync_threads
        own_bufs = self.dq_wg_bufs or self.dq_wg_handoff
        if writer == 0:
            for buf in cutlass.range_constexpr(parts if own_bufs else self.config.dq_stages):
                cute.arch.barrier_arrive(
                    barrier_id=roles.bar_dq_empty + roles.bar_dq_wg_step * buf,
                    number_of_threads=threads,
                )

    @cute.jit
    def _writer_of(self, walked: Int32) -> Int32:
        """The writer of the walk's query tile number `walked` (counted from 0 over every query
        head of the CTA): round robin over BwdTileConfig.dq_writers."""
        w = walked & 1
        if cutlass.const_expr(self.config.dq_writers > 2):
            w = walked % self.config.dq_writers
        return w

    @cute.jit
    def _dq_full_barrier(self, base, writer: Int32) -> Int32:
        """The id of writer `writer`'s full barrier for the part whose writer-0 id is `base`
        (BwdRoles.dq_full_offsets)."""
        offsets = self.roles.dq_full_offsets
        bar = base + offsets[1] * writer  # two writers: a multiply, no select
        if cutlass.const_expr(self.config.dq_writers > 2):
            bar = Int32(base)
            for w in cutlass.range_constexpr(1, self.config.dq_writers):
                if writer == w:
                    bar = base + offsets[w]
        return bar

    @cute.jit
    def _dq_add(
        self,
        tma_atom_dQ: cute.CopyAtom,
        copies: list,
        sem_bh: cute.Tensor,
        mask: TileMask,
        n_block: Int32,
        m_block: Int32,
        lane: Int32,
        part: cutlass.Constexpr[int],
        parts: cutlass.Constexpr[int],
        hand_on: cutlass.Constexpr[bool] = True,
    ):
        """Reduce-add one staged dQ part (the whole tile, or one warpgroup's half; `copies`:
        its (smem, gmem) boxes) into the fp32 accumulator; returns once the staging buffer may
        be overwritten. Deterministic: the first part waits for this key tile's turn (unless
        BwdTileConfig.det_poll_early: the caller did, before the partial was staged), the last
        hands the turn on once every part has landed (unless not `hand_on`: the caller does,
        after giving the buffer back)."""
        turn = sem_bh.iterator + m_block
        if cutlass.const_expr(self.deterministic and part == 0 and not self.config.det_poll_early):
            self._wait_turn(turn, mask, n_block, m_block, lane)
        for i in cutlass.range_constexpr(len(copies)):
            cute.copy(tma_atom_dQ, copies[i][0], copies[i][1])
        cute.arch.cp_async_bulk_commit_group()
        if cutlass.const_expr(self.deterministic and part == parts - 1 and hand_on):
            # every part must have landed before the next key tile's turn
            self._add_when_landed(turn, lane)
        else:
            # the reduce must have read sdQ before the consumers overwrite it
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _wait_turn(
        self, turn: cute.Pointer, mask: TileMask, n_block: Int32, m_block: Int32, lane: Int32
    ):
        """Return once it is key tile n_block's turn to add into query tile m_block's dQ
        (deterministic order; `turn`: the tile's counter)."""
        # My turn comes when the key tiles before mine in a fixed order have added
        # theirs. The tiles visiting this query tile are a contiguous [n_first, n_end)
        # (band mask). Without a right bound they go left to right; with one (causal)
        # right to left, because the tile nearest the diagonal reaches this query tile
        # first: left to right made every tile wait for tile 0's walk (0.52-0.60x of
        # the unordered speed at D=128 causal). The tiles waited on are launched
        # earlier (the grid is reversed in the right-to-left case; L2 sections launch a
        # pair's key tiles in rank order too), so they are running or done: no deadlock.
        if cutlass.const_expr(self.has_right):
            my_turn = mask.n_block_end_bwd(m_block) - 1 - n_block
        else:
            n_first, _ = mask.n_block_range(m_block)
            my_turn = n_block - n_first
        if lane == 0:
            seen = cute.arch.load(turn, Int32, sem="acquire", scope="gpu")
            while seen != my_turn:
                seen = cute.arch.load(turn, Int32, sem="acquire", scope="gpu")
        cute.arch.sync_warp()
        cute.arch.fence_proxy("async.global")  # the acquire orders the TMA add after it

    @cute.jit
    def _add_when_landed(
        self, counter: cute.Pointer, lane: Int32, of: Int32 | None = None, then=None
    ):
        """Add 1 to `counter` (release) once every reduce-add this warp issued has landed in
        global memory: a query tile's deterministic turn, or the postprocess's done count.
        With `of` and `then` (tail_split): `counter` counts `of` arrivals (acq_rel), and the
        last one adds the tile's writers (BwdTileConfig.dq_writers) to `then` (release)."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_proxy("async.global")
        if lane == 0:
            if cutlass.const_expr(of is None):
                cute.arch.atomic_add(counter, Int32(1), sem="release", scope="gpu")
            else:
                arrived = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
                if arrived == of - 1:
                    writers = Int32(self.config.dq_writers)
                    cute.arch.atomic_add(then, writers, sem="release", scope="gpu")
