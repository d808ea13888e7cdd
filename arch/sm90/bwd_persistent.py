"""The persistent grid of the SM90 backward (arch/sm90/flash_bwd.py, FlashBwdSm90).

With BwdTileConfig.persistent_ctas = P the main grid is P CTAs. CTA c walks the plain grid's
tiles c, c + P, c + 2P, ... in that grid's launch order (key tiles fastest, then heads, then
batches; the L2 sections' order on top where the config has them), so a CTA's start (barrier
set-up, the first K / V and Q / dO loads) and its end (the dK / dV stores, the dQ writer's
last add) are paid once a CTA instead of once a tile. Every role walks the same tiles:

  * the load warp carries its pipeline states from one tile into the next: the next tile's
    K / V load as soon as the consumers release this tile's, right after the walk's last
    GEMM, and its first Q / dO stages as soon as they are free;
  * the dQ writer hands the consumers every staging buffer empty once, before its first tile,
    and the consumers wait for its last add once, after their last tile: the handoff's named
    barriers run on from tile to tile as a ring (a second "empty" arrive before the
    consumers' wait would complete a barrier generation early);
  * the consumers store dK / dV from registers (BwdEpilogue.epilogue_direct), not through
    K / V's buffers, so those go back to the producer before the stores.

The measurement behind it (docs/design.md, section 10; bwd_timeline_s72_h100.json): a CTA's
start, end and the gaps between CTAs were 1.9% of the D=128 16k causal grid's SM time and 7.0%
of 4k causal's on an H100.

Two walks. The static one fixes a CTA's tiles by its index, so an SM that starts late (beside
the persistent preprocess, BwdTileConfig.pre_overlap) keeps its tiles, and a causal grid's
unequal walks are dealt out blind. With BwdTileConfig.persistent_counter every tile comes
from a global counter (sem[0, 0, 0], zeroed by the host), a CTA's first too, so one that
starts late takes a later tile: the load warp adds 1 to it while it loads the current tile
and hands the index on through a two-slot smem ring (a PipelineAsync; 32 producer
arrivals, the writer warp's and the consumers' 288 releases); an index past the last tile
ends every role's walk.

Constraints (FlashBwdSm90._setup_attributes, BwdTileConfig): dense inputs, the default order,
one CTA a query head (no group_heads), one dQ writer, register-tile dK / dV, no tail_split or
timeline.

BwdPersistent is a mixin: it holds no state of its own and calls the kernel's roles (load,
dq_writer, mma) and `_tile`; FlashBwdSm90 derives from it. Torch-free.

Compile without a GPU: CUTE_DSL_ARCH=sm_90a python -m cute_attn compile --arch sm_90a
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32

from ..common.schedule import L2Sections, TailSplit, tail_split_coords


class BwdPersistent:
    @cute.jit
    def _persistent_roles(
        self,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dk: cute.TiledMma,
        tiled_mma_dv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        tiled_mma_dq_part: cute.TiledMma,
        tma_atom_Q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_dO: cute.CopyAtom,
        mdO: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        mV: cute.Tensor,
        tma_atom_dQ: cute.CopyAtom,
        mdQacc: cute.Tensor,
        tma_atom_LSE: cute.CopyAtom,
        mLSE: cute.Tensor,
        tma_atom_Dsum: cute.CopyAtom,
        mDsum: cute.Tensor,
        mSem: cute.Tensor,
        sQ: cute.Tensor,
        sdO: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sdS: cute.Tensor,
        sP: cute.Tensor,
        sdQ: cute.Tensor,
        sdK: cute.Tensor,
        sLSE: cute.Tensor,
        sDsum: cute.Tensor,
        pipe_kv: pipeline.PipelineAsync,
        pipe_q: pipeline.PipelineAsync,
        pipe_do: pipeline.PipelineAsync,
        tma_atom_dK: cute.CopyAtom,
        mdK: cute.Tensor,
        tma_atom_dV: cute.CopyAtom,
        mdV: cute.Tensor,
        softmax_scale_log2: Float32,
        score_premul: Float32,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        sections: L2Sections | None,
        mTailAcc: cute.Tensor | None,
        tail: TailSplit,
        sched: tuple | None,
    ):
        """Every role's walk over this CTA's tiles (tail.start: the plain grid's tile count;
        tail.blocks: its key tiles a (head, batch)); `sched`: the counter's ring and slots
        (persistent_counter), else None."""
        roles = self.roles
        tile_args = (mQ, mK, mCuSeqlensQ, mCuSeqlensK, sections, tail, window_left, window_right)
        first, stride = cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
        num_tiles = tail.start
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        if cutlass.const_expr(self.post_overlap):
            # as the one-tile grid: the postprocess's CTAs wait for their head's done count
            cute.arch.griddepcontrol_launch_dependents()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(warp_idx // 4)
        counter = self.config.persistent_counter
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(roles.producer_regs)
            if warp_idx == roles.load_warp:
                producer = pipeline.PipelineUserType.Producer
                kv_state, state, state_do = self._pipeline_states(producer)
                ring_state = pipeline.make_pipeline_state(producer, 2)
                t = first
                if cutlass.const_expr(counter):
                    # every tile from the counter, the first too: a CTA that starts late
                    # (beside the persistent preprocess) takes a later one
                    t = self._take_tile(mSem)
                    ring_state = self._publish(sched, ring_state, t)
                while t < num_tiles:
                    t_next = t + stride
                    if cutlass.const_expr(counter):
                        # the next tile is taken (and handed on) while this one loads
                        t_next = self._take_tile(mSem)
                        ring_state = self._publish(sched, ring_state, t_next)
                    n_block, head, seq, row_off, _, m_min, m_max = self._tile_at(t, tile_args)
                    kv_state, state, state_do = self.load(
                        tma_atom_Q, mQ, tma_atom_dO, mdO, tma_atom_K, mK, tma_atom_V, mV,
                        tma_atom_LSE, mLSE, tma_atom_Dsum, mDsum,
                        sQ, sdO, sK, sV, sLSE, sDsum, pipe_kv, pipe_q, pipe_do,
                        seq, row_off, n_block, head, m_min, m_max, mSem, None,
                        states=(kv_state, state, state_do),
                    )  # fmt: skip
                    t = t_next
                pipe_q.producer_tail(state)
                pipe_do.producer_tail(state_do)
                pipe_kv.producer_tail(kv_state)
                if cutlass.const_expr(counter):
                    sched[0].producer_tail(ring_state)
            if warp_idx == roles.dq_warp:
                ring_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
                t = first
                if cutlass.const_expr(counter):
                    t, ring_state = self._read_tile(sched, ring_state)
                if t < num_tiles:
                    self.dq_buffers_empty(Int32(0))
                while t < num_tiles:
                    t_next, ring_state = self._next_tile(t, stride, sched, ring_state)
                    n_block, head, seq, row_off, mask, m_min, m_max = self._tile_at(t, tile_args)
                    self.dq_writer(
                        tma_atom_dQ, mdQacc, sdQ, mSem, mask, seq, row_off, n_block, head,
                        m_min, m_max, mLSE.shape[0], Int32(0), tail, None, pre_arrive=False,
                    )  # fmt: skip
                    t = t_next
        else:
            cute.arch.setmaxregister_increase(roles.mma_regs)
            consumer = pipeline.PipelineUserType.Consumer
            kv_state, state, state_do = self._pipeline_states(consumer)
            ring_state = pipeline.make_pipeline_state(consumer, 2)
            t = first
            if cutlass.const_expr(counter):
                t, ring_state = self._read_tile(sched, ring_state)
            walked = t < num_tiles
            while t < num_tiles:
                t_next, ring_state = self._next_tile(t, stride, sched, ring_state)
                n_block, head, seq, _, mask, m_min, m_max = self._tile_at(t, tile_args)
                kv_state, state, state_do = self.mma(
                    tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq, tiled_mma_dq_part,
                    tma_atom_dK, mdK, tma_atom_dV, mdV,
                    sQ, sdO, sK, sV, sdS, sP, sdQ, sdK, sLSE, sDsum, pipe_kv, pipe_q, pipe_do,
                    mask, seq, n_block, head, m_min, m_max,
                    softmax_scale_log2, score_premul, softmax_scale, None, mSem, tail,
                    states=(kv_state, state, state_do),
                )  # fmt: skip
                t = t_next
            if walked:
                # the writer's last arrive (its "every buffer empty" came once, before the
                # first tile)
                wg = cute.arch.make_warp_uniform((cute.arch.thread_idx()[0] - 128) // 128)
                self._drain_dq(wg)

    @cute.jit
    def _tile_at(self, t: Int32, tile_args: tuple):
        """`_tile` of the plain grid's tile number `t` (key tiles fastest, then heads, then
        batches: `tail` holds no split here, only the divisor by the key tiles)."""
        mQ, tail = tile_args[0], tile_args[5]
        block, head, batch, _, _ = tail_split_coords(tail, cute.size(mQ.shape[2]), linear=t)
        return self._tile((block, head, batch), *tile_args)

    @cute.jit
    def _next_tile(self, t: Int32, stride: Int32, sched: tuple | None, ring_state):
        """The tile after `t` for the dQ writer and the consumers: `stride` on, or the next
        index the load warp handed on (persistent_counter)."""
        t_next = t + stride
        if cutlass.const_expr(self.config.persistent_counter):
            t_next, ring_state = self._read_tile(sched, ring_state)
        return t_next, ring_state

    def _tile_ring(self, ptr: cute.Pointer):
        """persistent_counter's ring over the `sched` smem words: (PipelineAsync of two
        stages, an Int32 view of its two tile slots). The load warp commits (32 arrivals);
        the dQ writer warp and every consumer thread release."""
        ring = pipeline.PipelineAsync.create(
            barrier_storage=ptr + 2,
            num_stages=2,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 32 + self.roles.num_mma_threads
            ),
            defer_sync=True,
        )
        slots = cute.make_tensor(cute.recast_ptr(ptr, dtype=Int32), cute.make_layout(2))
        return ring, slots

    @cute.jit
    def _publish(self, sched: tuple, ring_state, t: Int32):
        """Hand tile index `t` to the other roles (the load warp, every lane)."""
        ring, slots = sched
        ring.producer_acquire(ring_state)
        if cute.arch.lane_idx() == 0:
            slots[ring_state.index] = t
        cute.arch.sync_warp()
        ring.producer_commit(ring_state)
        ring_state.advance()
        return ring_state

    @cute.jit
    def _read_tile(self, sched: tuple, ring_state):
        """The next tile index from the load warp (the dQ writer warp and the consumers)."""
        ring, slots = sched
        ring.consumer_wait(ring_state)
        t = slots[ring_state.index]
        ring.consumer_release(ring_state)
        ring_state.advance()
        return t, ring_state

    @cute.jit
    def _take_tile(self, mSem: cute.Tensor) -> Int32:
        """The next tile of the launch order nobody took yet (the load warp, every lane):
        the counter at sem[0, 0, 0] counts the tiles taken."""
        t = Int32(0)
        if cute.arch.lane_idx() == 0:
            t = cute.arch.atomic_add(mSem.iterator, Int32(1), sem="relaxed", scope="gpu")
        return cute.arch.shuffle_sync(t, 0)
