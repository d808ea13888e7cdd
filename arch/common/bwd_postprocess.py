"""Backward postprocess: dQ = dq_acc * softmax_scale in the input dtype, one pass.

The backward main kernel adds unscaled dS K partials into a (batch, seq, heads, dim) fp32
accumulator; this reads it once and writes dQ (16-bit) in the same layout. A group of
threads owns a row; each converts every group-th run of 4 elements (a 16-byte load, an
8-byte store; bwd_preprocess.lane_vectors), so each instruction of a group covers whole
sectors. The group: 32 threads when head_dim / 4 is a multiple of 32, else the largest power
of two dividing it (16 at head_dim 192, 8 at 96).

Packed sequences (`varlen_tile_m` > 0): dq_acc holds sequence b's rows from
seqlen.padded_row_offset (bwd_preprocess), dq is packed by cu_seqlens_q; both unit-batch.

Flat accumulator (`flat`, a dq_flat.DqFlatTile; BwdTileConfig.dq_flat): dq_acc's rows of one
(batch, head) pair lie back to back, DqFlatTile.acc_dim floats apart (dQ^T's head-dim rows, or
a compact tile's own head dims), and each tile of tile_m rows holds its elements in the main
kernel's register order. A CTA per tile then loads the tile with 16-byte loads in that order,
puts each element at its (row, dim) place in a 16-bit smem tile, and stores the tile's rows
with 16-byte stores.

Waiting for the main grid (`wait_done`, BwdTileConfig.post_overlap; dense only): the kernel
is launched as the main kernel's programmatic dependent, so its CTAs may start while the main
grid's last wave runs. Each first waits (thread 0 polls with acquire loads, then a CTA
barrier) until its (batch, head)'s count in `done` reaches `done_target`. Each main CTA adds
1 there once its dQ adds into that head have landed.

Front padding (`front_pad`, BwdTileConfig.end_aligned; dense flat tiles): the tiles' padding
rows come first, so tile m's padded row r is query row m * tile_m + r - s (s = the padded rows
less seqlen_q) and the rows before query row 0 are not stored.

Constraints: head_dim a multiple of 8; dq_acc and dq 16-byte aligned, dim contiguous.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .bwd_preprocess import lane_vectors, row_threads, varlen_rows
from .dq_flat import DqFlatTile, flat_coords
from .dsl import wait_at_least

NUM_THREADS = 128


class BwdPostprocess:
    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        varlen_tile_m: int = 0,
        flat: DqFlatTile | None = None,
        wait_done: bool = False,
        front_pad: bool = False,
    ):
        self.dtype = dtype
        self.head_dim = head_dim
        self.varlen_tile_m = varlen_tile_m  # > 0: packed (see the module docstring)
        self.flat = flat  # the main kernel's register-order tile, or None (row order)
        # launched as the main kernel's programmatic dependent (BwdTileConfig.post_overlap):
        # each CTA first waits until its (batch, head) done count reaches done_target
        self.wait_done = wait_done
        # the flat tiles' padding rows come first (BwdTileConfig.end_aligned): padded row p
        # holds query row p - s, s = the padded rows less seqlen_q
        self.front_pad = front_pad
        self._setup_attributes()

    def _setup_attributes(self):
        if self.head_dim % 8:
            raise ValueError("head_dim must be a multiple of 8 (16-byte vectors)")
        if self.front_pad and (self.varlen_tile_m or self.flat is None):
            raise ValueError("front padding: dense flat dQ tiles only")
        if self.wait_done and self.varlen_tile_m:
            raise ValueError("wait_done counts the dense grid's CTAs per (batch, head)")
        # 4-element runs: row_threads counts 16-bit elements in 16-byte vectors, so twice the
        # head dim
        self.threads_per_row = row_threads(2 * self.head_dim, 32)
        self.vecs = self.head_dim // (4 * self.threads_per_row)  # runs per thread
        self.rows_per_cta = NUM_THREADS // self.threads_per_row
        if self.flat is not None:
            if self.flat.head_dim < self.head_dim:
                raise ValueError(f"flat tile of {self.flat.head_dim} dims < head_dim")
            if self.varlen_tile_m not in (0, self.flat.tile_m):
                raise ValueError("packed rows are padded to the flat tile's tile_m")
            # 16-byte runs a thread loads (NUM_THREADS a step) and 16-bit rows written out.
            # dQ^T's zero rows past head_dim (a wider flat tile: D = 96 over 128 rows) are the
            # tile's last warp runs, never added by the main kernel nor read here: the steps
            # cover the tile's real elements, its first head_dim x tile_m floats (a compact
            # tile's every float; DqFlatTile's own check of `dims` rejects any other layout)
            real = self.flat
            if self.head_dim < real.head_dim:
                real = dataclasses.replace(real, dims=self.head_dim)
            self.flat_steps = -(-real.acc_elems // (4 * NUM_THREADS))
            self.rows_per_cta = self.flat.tile_m
            # the smem tile's row: the tile's dims plus 16 bytes, so rows start on other banks
            self.flat_row = self.flat.head_dim + 8

    @cute.jit
    def __call__(
        self,
        mdQacc: cute.Tensor,  # (b, s_q, h, d) fp32
        mdQ: cute.Tensor,  # (b, s_q, h, d) out
        softmax_scale: Float32,
        mCuSeqlensQ: cute.Tensor | None,  # (sequences + 1,) int32 when varlen, else None
        max_seqlen_q: Int32,  # varlen: sizes the grid; dense: unused
        mDone: cute.Tensor | None,  # wait_done: (b, h, x) int32, the count at [b, h, 0]
        done_target: Int32,  # wait_done: the main CTAs of each (batch, head)
        stream: cuda.CUstream,
    ):
        rows, num_batch = mdQ.shape[1], cute.size(mdQ.shape[0])
        if cutlass.const_expr(self.varlen_tile_m > 0):
            rows, num_batch = max_seqlen_q, mCuSeqlensQ.shape[0] - 1
        grid = (cute.ceil_div(rows, self.rows_per_cta), cute.size(mdQ.shape[2]), num_batch)
        kernel = self.kernel if cutlass.const_expr(self.flat is None) else self.kernel_flat
        kernel(mdQacc, mdQ, softmax_scale, mCuSeqlensQ, mDone, done_target).launch(
            grid=grid, block=[NUM_THREADS, 1, 1], stream=stream, use_pdl=self.wait_done
        )

    @cute.jit
    def _wait_done(self, mDone: cute.Tensor | None, done_target: Int32, head: Int32, batch):
        """wait_done: block until every main CTA of (batch, head) has counted its dQ adds
        done (release after the adds landed; this acquire makes them visible)."""
        if cutlass.const_expr(self.wait_done):
            if cute.arch.thread_idx()[0] == 0:
                ptr = mDone.iterator + cute.crd2idx((batch, head, mDone.shape[2] - 2), mDone.layout)
                wait_at_least(ptr, done_target, 512)
            cute.arch.sync_threads()

    @cute.kernel
    def kernel(
        self,
        mdQacc: cute.Tensor,
        mdQ: cute.Tensor,
        softmax_scale: Float32,
        mCuSeqlensQ: cute.Tensor | None,
        mDone: cute.Tensor | None,
        done_target: Int32,
    ):
        tidx = cute.arch.thread_idx()[0]
        row_block, head, batch = cute.arch.block_idx()
        self._wait_done(mDone, done_target, head, batch)
        lane = tidx % self.threads_per_row
        row = row_block * self.rows_per_cta + tidx // self.threads_per_row
        b, start, pad, seqlen = batch, Int32(0), Int32(0), mdQ.shape[1]
        if cutlass.const_expr(self.varlen_tile_m > 0):
            b = Int32(0)
            start, seqlen, pad = varlen_rows(mCuSeqlensQ, batch, mdQ.shape[1], self.varlen_tile_m)
        if row < seqlen:
            tpr, nv = self.threads_per_row, self.vecs
            g_acc = lane_vectors(mdQacc[b, pad + row, head, None], lane, 4, tpr, nv)
            r_acc = cute.make_rmem_tensor((4, nv), Float32)
            cute.autovec_copy(g_acc, r_acc)
            r_dq = cute.make_rmem_tensor((4, nv), self.dtype)
            r_dq.store((r_acc.load() * softmax_scale).to(self.dtype))
            cute.autovec_copy(r_dq, lane_vectors(mdQ[b, start + row, head, None], lane, 4, tpr, nv))

    @cute.kernel
    def kernel_flat(
        self,
        mdQacc: cute.Tensor,
        mdQ: cute.Tensor,
        softmax_scale: Float32,
        mCuSeqlensQ: cute.Tensor | None,
        mDone: cute.Tensor | None,
        done_target: Int32,
    ):
        tile = self.flat
        tm = tile.tile_m
        tidx = cute.arch.thread_idx()[0]
        m_block, head, batch = cute.arch.block_idx()
        self._wait_done(mDone, done_target, head, batch)
        b, start, pad, seqlen = batch, Int32(0), Int32(0), mdQ.shape[1]
        if cutlass.const_expr(self.varlen_tile_m > 0):
            b = Int32(0)
            start, seqlen, pad = varlen_rows(mCuSeqlensQ, batch, mdQ.shape[1], tm)
        row0 = m_block * tm
        # the query row of the tile's first padded row (front_pad: s rows earlier)
        first = row0
        if cutlass.const_expr(self.front_pad):
            first = row0 - (cute.ceil_div(seqlen, tm) * tm - seqlen)
        sT = cutlass.memory.SmemAllocator().allocate_tensor(
            self.dtype, cute.make_layout((tm, self.flat_row), stride=(self.flat_row, 1)), 16
        )
        if row0 < seqlen:
            # the tile's real elements from its first row on, run tidx of every step
            g_tile = cute.make_tensor(
                mdQacc[b, pad + row0, head, None].iterator,
                cute.make_layout((4, NUM_THREADS, self.flat_steps), stride=(1, 4, 4 * NUM_THREADS)),
            )
            r_acc = cute.make_rmem_tensor((4, self.flat_steps), Float32)
            cute.autovec_copy(g_tile[None, tidx, None], r_acc)
            for step in cutlass.range_constexpr(self.flat_steps):
                d, q = flat_coords(tile, (step * NUM_THREADS + tidx) * 4)
                # a run is rows q, q + 1 of dims d, d + 8
                for v in cutlass.range_constexpr(4):
                    x = self.dtype(r_acc[v, step] * softmax_scale)
                    sT[q + v % 2, d + 8 * (v // 2)] = x
            cute.arch.sync_threads()
            vecs = self.head_dim // 8  # 16-byte vectors of a dQ row
            sT_v = cute.make_tensor(
                sT.iterator, cute.make_layout((8, vecs, tm), stride=(1, 8, self.flat_row))
            )
            for i in cutlass.range_constexpr(-(-tm * vecs // NUM_THREADS)):
                idx = i * NUM_THREADS + tidx
                q, vec = idx // vecs, idx % vecs
                store = idx < tm * vecs and first + q < seqlen
                if cutlass.const_expr(self.front_pad):
                    store = store and first + q >= 0
                if store:
                    g_row = cute.make_tensor(
                        mdQ[b, start + first + q, head, None].iterator,
                        cute.make_layout((8, vecs), stride=(1, 8)),
                    )
                    cute.autovec_copy(sT_v[None, vec, q], g_row[None, vec])


__all__ = ["BwdPostprocess", "NUM_THREADS"]
