"""The dK / dV epilogue of the SM90 backward (arch/sm90/flash_bwd.py, FlashBwdSm90).

After a key tile's walk the consumer warpgroups hold dK and dV in fp32 registers. The
epilogue converts them (dK times softmax_scale) and stages them in K's and V's smem buffers
through stmatrix (transposing under dkv_swap_ab, whose accumulators are dK^T / dV^T); one
warp stores both tiles by TMA (rows past seqlen_k clipped). Under BwdTileConfig.tail_split
a split tile's parts first add their fp32 partials in part order (`_tail_fixup`), and only
the last part to finish stores.

The persistent form (BwdTileConfig.persistent_ctas) stores from registers instead
(`epilogue_direct`): K's and V's buffers then go back to the producer as soon as the walk's
last GEMM has read them, so the next tile's K / V load under this tile's stores.

BwdEpilogue is a mixin: it holds no state of its own and reads the kernel's attributes
(config, roles, dtype, tile sizes, swap_dkv, varlen) and FlashBwdSm90 derives from it.
Torch-free.

Compile without a GPU: CUTE_DSL_ARCH=sm_90a python -m cute_attn compile --arch sm_90a
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common import timeline as tl
from ..common.layout import transpose_smem_view
from ..common.schedule import TailSplit, tail_slot
from ..common.seqlen import SeqInfo
from .primitives import tma_tiles


class BwdEpilogue:
    # ------------------------------------------------------------------ epilogue role
    @cute.jit
    def epilogue(
        self,
        tiled_mma_dk: cute.TiledMma,
        tiled_mma_dv: cute.TiledMma,
        tma_atom_dK: cute.CopyAtom,
        mdK: cute.Tensor,
        tma_atom_dV: cute.CopyAtom,
        mdV: cute.Tensor,
        sdK: cute.Tensor,  # K's buffer as dK's (tile_n, tile_d) staging
        sV: cute.Tensor,
        acc_dk: cute.Tensor,
        acc_dv: cute.Tensor,
        tidx: Int32,
        seq: SeqInfo,
        n_block: Int32,
        head: Int32,
        softmax_scale: Float32,
        mTimeline: cute.Tensor | None,
    ):
        roles = self.roles
        r_dk, r_dv = self._dkv_out(acc_dk, acc_dv, softmax_scale)
        # dK / dV are staged in the K / V buffers: every warpgroup must be done reading them
        cute.arch.barrier(barrier_id=roles.bar_epilogue, number_of_threads=roles.num_mma_threads)
        # under swap_dkv the accumulators are dK^T / dV^T: a transposing stmatrix puts them
        # back as (key, head dim) rows
        store_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=self.swap_dkv, num_matrices=4),
            self.dtype,
        )
        sK_c, sV_c = sdK, sV
        if cutlass.const_expr(self.swap_dkv):
            sK_c, sV_c = transpose_smem_view(sdK), transpose_smem_view(sV)
        thr_store_dk = cute.make_tiled_copy_C(store_atom, tiled_mma_dk).get_slice(tidx)
        thr_store_dv = cute.make_tiled_copy_C(store_atom, tiled_mma_dv).get_slice(tidx)
        cute.copy(store_atom, thr_store_dk.retile(r_dk), thr_store_dk.partition_D(sK_c))
        cute.copy(store_atom, thr_store_dv.retile(r_dv), thr_store_dv.partition_D(sV_c))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=roles.bar_epilogue, number_of_threads=roles.num_mma_threads)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == roles.store_warp:
            tile_k = (self.tile_n, self.tile_d)
            tile_v = (self.tile_n, self.tile_dv)
            mdK_head = mdK[None, None, head, seq.kv_batch]
            mdV_head = mdV[None, None, head, seq.kv_batch]
            if cutlass.const_expr(self.varlen):
                mdK_head, mdV_head = seq.ragged_rows_k(mdK, head), seq.ragged_rows_k(mdV, head)
            gdK = cute.local_tile(mdK_head, tile_k, (n_block, 0))
            gdV = cute.local_tile(mdV_head, tile_v, (n_block, 0))
            tdKsdK, tdKgdK = tma_tiles(tma_atom_dK, sdK, gdK)
            tdVsdV, tdVgdV = tma_tiles(tma_atom_dV, sV, gdV)
            cute.copy(tma_atom_dK, tdKsdK, tdKgdK)
            cute.copy(tma_atom_dV, tdVsdV, tdVgdV)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            if cutlass.const_expr(self.config.timeline):
                if cute.arch.lane_idx() == 0:
                    tl.stamp(mTimeline, tl.W_CLK_EPI_END, tl.clock())
                    tl.stamp(mTimeline, tl.W_GT_END, tl.globaltimer_lo())

    @cute.jit
    def _tail_fixup(
        self,
        acc_dk: cute.Tensor,
        acc_dv: cute.Tensor,
        mTailAcc: cute.Tensor,
        mSem: cute.Tensor,
        sLSE: cute.Tensor,
        tail: TailSplit,
        seq: SeqInfo,
        n_block: Int32,
        head: Int32,
        tidx: Int32,
    ) -> cutlass.Boolean:
        """tail_split, every consumer thread: whether this CTA stores its tile's dK / dV (True
        when the tile is whole). A part stores its fp32 partials to its workspace slot and
        counts itself in (gpu-scope acq_rel); the last part of the tile to count reads every
        part's slot back in part order, its own too, and sums them in place of its own, so the
        sums do not depend on which part ended last."""
        slot_of = tail_slot(tail)  # its workspace slot: tile x parts + part, -1 when whole
        tail_parts = Int32(tail.parts.divisor)
        roles = self.roles
        nt = roles.num_mma_threads
        n_dk, n_dv = cute.size(acc_dk), cute.size(acc_dv)
        slot = nt * (n_dk + n_dv)
        if cutlass.const_expr(slot != self.config.tail_slot_floats(self.head_dim, self.head_dim_v)):
            raise ValueError(f"tail slot of {slot} floats: not BwdTileConfig.tail_slot_floats")
        final = cutlass.Boolean(True)
        if slot_of >= 0:
            # thread-minor: each element's stores of a warp are 128 contiguous bytes
            mine = slot_of * slot + tidx
            for i in cutlass.range_constexpr(n_dk):
                mTailAcc[mine + i * nt] = acc_dk[i]
            for i in cutlass.range_constexpr(n_dv):
                mTailAcc[mine + (n_dk + i) * nt] = acc_dv[i]
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=roles.bar_epilogue, number_of_threads=nt)
            # sLSE is free: every Q stage (and its lse) was consumed
            if tidx == 0:
                counter = mSem.iterator + cute.crd2idx(
                    (2 * n_block, head, seq.q_batch), mSem.layout
                )
                arrived = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
                sLSE[0] = Float32(arrived)
            cute.arch.barrier(barrier_id=roles.bar_epilogue, number_of_threads=nt)
            final = sLSE[0] == Float32(tail_parts - 1)
            if final:
                cute.arch.fence_acq_rel_gpu()
                acc_dk.fill(0.0)
                acc_dv.fill(0.0)
                first = (slot_of - slot_of % tail_parts) * slot + tidx
                for p in cutlass.range(tail_parts, unroll=1):
                    at = mTailAcc.iterator + (first + p * slot)
                    # L2 loads: the other parts' stores came from other SMs
                    for i in cutlass.range_constexpr(n_dk):
                        acc_dk[i] += cute.arch.load(at + i * nt, Float32, cop="cg")
                    for i in cutlass.range_constexpr(n_dv):
                        acc_dv[i] += cute.arch.load(at + (n_dk + i) * nt, Float32, cop="cg")
        return final

    @cute.jit
    def epilogue_direct(
        self,
        tiled_mma_dk: cute.TiledMma,
        tiled_mma_dv: cute.TiledMma,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        acc_dk: cute.Tensor,
        acc_dv: cute.Tensor,
        tidx: Int32,
        seq: SeqInfo,
        n_block: Int32,
        head: Int32,
        softmax_scale: Float32,
    ):
        """A persistent CTA's dK / dV (BwdTileConfig.persistent_ctas): converted and stored
        from the wgmma accumulators' registers, each thread its pairs of adjacent head dims
        (32-bit stores), so no smem buffer is held and K / V's go back to the producer at
        once. Rows past seqlen_k (the last key tile) are not stored. Dense, register-tile
        dK / dV (not swap_dkv), tile head dims equal to the tensors' (BwdTileConfig)."""
        tn = self.tile_n
        r_dk, r_dv = self._dkv_out(acc_dk, acc_dv, softmax_scale)
        outs = (
            (tiled_mma_dk, r_dk, mdK[None, None, head, seq.kv_batch], self.tile_d),
            (tiled_mma_dv, r_dv, mdV[None, None, head, seq.kv_batch], self.tile_dv),
        )
        rows = seq.seqlen_k - n_block * tn  # this tile's keys (more than tn: all of it)
        for j in cutlass.range_constexpr(len(outs)):
            tiled_mma, r_x, mX, d = outs[j]
            thr = tiled_mma.get_slice(tidx)
            tXgX = thr.partition_C(cute.local_tile(mX, (tn, d), (n_block, 0)))
            if rows >= tn:
                cute.autovec_copy(r_x, tXgX)
            else:
                tXcX = thr.partition_C(cute.make_identity_tensor((tn, d)))
                for i in cutlass.range_constexpr(cute.size(r_x)):
                    if tXcX[i][0] < rows:
                        tXgX[i] = r_x[i]

    @cute.jit
    def _dkv_out(self, acc_dk: cute.Tensor, acc_dv: cute.Tensor, softmax_scale: Float32):
        """dK (times softmax_scale) and dV in the inputs' dtype, in the accumulators' layout."""
        r_dk = cute.make_rmem_tensor_like(acc_dk, self.dtype)
        r_dk.store((acc_dk.load() * softmax_scale).to(self.dtype))
        r_dv = cute.make_rmem_tensor_like(acc_dv, self.dtype)
        r_dv.store(acc_dv.load().to(self.dtype))
        return r_dk, r_dv
