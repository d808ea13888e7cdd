"""Backward preprocess: per query row D = rowsum(dO * O) in fp32, lse moved to the exp2
domain, and the fp32 dQ accumulator row cleared. One launch instead of ~10 torch ops.

Per (batch, head, row) of the padded row range [0, seqlen_q rounded up to the backward's
tile_m):
    lse_log2[b, h, i] = lse * log2(e), or +inf where lse = -inf (an empty row: its scores are
                        all -inf, and +inf makes P = exp2(-inf - inf) = 0 instead of NaN)
                        and on padding rows (P = 0 there without a bounds check)
    dsum[b, h, i]     = sum_d dO[b, i, h, d] * O[b, i, h, d] (fp32), 0 on padding rows
    dq_acc[b, i, h,:] = 0
A group of threads owns a row (row_threads: dv / 8 when that is a power of two, else the
largest power of two dividing it, e.g. 4 for dv = 96): each loads every group-th 16-byte
vector of dO and O (lane_vectors) and the group reduces with shuffles. The lse gradient, when
there is one, is subtracted from dsum by the host.

Packed sequences (`varlen_tile_m` > 0, the backward's tile_m): O, dO and lse are packed by
cu_seqlens_q (unit batch; lse (1, heads, total_q)); lse_log2, dsum and dq_acc are per-row
buffers in which sequence b starts at seqlen.padded_row_offset and owns its rows rounded up to
a tile: the padding rows of each sequence get +inf / 0 like the dense tail. The grid's z is the
sequence and its x covers max_seqlen_q rounded up to the tile.

Register-order dQ tiles (`dq_flat_dim` > 0, BwdTileConfig.dq_flat): the accumulator's rows
are dq_flat_dim wide (DqFlatTile.acc_dim: dQ^T's head-dim rows, or at D = 96 the compact
tile's 96) and a tile holds its elements in the main kernel's order (arch/common/dq_flat.py),
so its every row is cleared, padding rows and columns included: the tile's real elements sit
anywhere in it.

Front padding (`front_pad`, BwdTileConfig.end_aligned; dense flat tiles only): the padding
rows come first, so padded row p holds query row p - s (s = padded rows - seqlen_q) and rows
p < s get +inf / 0, as the main kernel's query tiles are aligned to the sequence's end.

The lse gradient (`dlse`): when lse is used downstream its gradient enters D, so dsum = dot
- dlse[b, h, i] on the query rows (dlse laid out like lse).

Persistent, beside the main grid (`persistent`, BwdTileConfig.pre_overlap; dense only): a grid
of `num_ctas` CTAs of PERSISTENT_THREADS threads (one an SM: the registers of two do not
fit) walks items of `item_rows` rows of one (batch, head) pair, pair after pair in the main
grid's order. Each CTA allows the main kernel to launch at once
(griddepcontrol.launch_dependents), so the main grid takes the other SMs while this runs;
every warp, once its rows of an item are written, adds their count to `ready[b, h, -1]` with
a release, and the main kernel's load and dQ-writer warps wait (acquire) for their head's
count to reach its padded rows before they read lse_log2 / D or add into the accumulator.
Each thread loads `unroll` rows before it reduces any, so one SM keeps enough bytes in
flight to stream at a share of HBM bandwidth. The rows of an item past the query rows load
the last query row (every call has one) and are zeroed like padding.

Constraints: fp16/bf16 dO and O, (batch, seq, heads, dim) with contiguous dim and 16-byte
aligned rows; head_dim and head_dim_v multiples of 8 with head_dim a multiple of
4 * row_threads(head_dim_v) (so each thread clears as many 16-byte chunks of the dQ row).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .seqlen import padded_row_offset
from .softmax import LOG2E

NUM_THREADS = 128
# the persistent form: one CTA an SM, at most 72 registers a thread (1,024 threads, 64
# registers, spilled fp16 D=64's row-order form; the fifty-seventh session's GPU runs had 1,024)
PERSISTENT_THREADS = 896
# 16-byte loads of dO / O a thread has in flight in the persistent form (rows x vectors)
PERSISTENT_LOADS = 8


def row_threads(dim: int, limit: int) -> int:
    """Threads sharing one row of `dim` 16-bit elements: the largest power of two <= limit
    that splits the row into whole 16-byte vectors (a power of two, so a group never
    straddles a warp and shuffles reduce it)."""
    if dim % 8:
        raise ValueError(f"head dim {dim} must be a multiple of 8 (16-byte vectors)")
    t = 1
    while 2 * t <= limit and (dim // 8) % (2 * t) == 0:
        t *= 2
    return t


def lane_vectors(row: cute.Tensor, lane: Int32, vec: int, threads: int, n: int) -> cute.Tensor:
    """Vectors lane, lane + threads, lane + 2 threads, ... (n of them, vec elements each) of a
    contiguous row, as a (vec, n) view. A group's accesses then cover threads x vec contiguous
    elements per instruction, whole 32-byte sectors. Contiguous runs per thread (thread i
    owning vectors i n .. i n + n - 1) touched half of each sector per instruction: at D=192
    on the H200 that doubled the L2 write requests and made these kernels L2-bound, 107 / 58
    us against FA4's 63 / 44 (docs/perf/ncu_bwd_d192_h200_details.csv)."""
    layout = cute.make_layout((vec, threads, n), stride=(1, vec, vec * threads))
    return cute.make_tensor(row.iterator, layout)[None, lane, None]


def varlen_rows(
    mCuSeqlens: cute.Tensor, batch: Int32, total: Int32, tile: cutlass.Constexpr[int]
) -> tuple[Int32, Int32, Int32]:
    """(first packed row, length, first padded row) of sequence `batch`: the offsets clamped
    into [0, total] as the main kernel's SeqInfo clamps them."""
    start = cutlass.min(cutlass.max(mCuSeqlens[batch], Int32(0)), total)
    end = cutlass.min(cutlass.max(mCuSeqlens[batch + 1], start), total)
    return start, end - start, padded_row_offset(start, batch, tile)


class BwdPreprocess:
    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        head_dim_v: int,
        varlen_tile_m: int = 0,
        dq_flat_dim: int = 0,
        dlse: bool = False,
        persistent: bool = False,
        front_pad: bool = False,
    ):
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        # > 0: packed sequences, padded per sequence to this many rows (the backward's tile_m)
        self.varlen_tile_m = varlen_tile_m
        # > 0: register-order dQ tiles with rows this wide (see the module docstring)
        self.dq_flat_dim = dq_flat_dim
        # the lse gradient is subtracted from D
        self.dlse = dlse
        # a grid of a few CTAs beside the main kernel, counting ready rows per (batch, head)
        self.persistent = persistent
        # the padding rows at the front (BwdTileConfig.end_aligned): padded row p holds query
        # row p - s, s = the padded rows less seqlen_q
        self.front_pad = front_pad
        self._setup_attributes()

    def _setup_attributes(self):
        if self.head_dim_v % 8 or self.head_dim % 8:
            raise ValueError("head dims must be multiples of 8 (16-byte vectors)")
        if self.persistent and self.varlen_tile_m:
            raise ValueError("the persistent preprocess walks the dense (batch, head) pairs")
        if self.front_pad and (self.varlen_tile_m or not self.dq_flat_dim):
            raise ValueError("front padding: dense rows of whole flat dQ tiles only")
        self.threads_per_row = row_threads(self.head_dim_v, 32)
        # 16-byte vectors a thread loads of dO / O (8 elements each) and clears of dQ (4 fp32)
        self.o_vecs = self.head_dim_v // (8 * self.threads_per_row)
        # the accumulator row a group clears: the head dim, or a register-order tile's row
        self.dq_row = self.dq_flat_dim or self.head_dim
        if self.dq_row % (4 * self.threads_per_row):
            raise ValueError("each thread must clear whole 16-byte chunks of the dQ row")
        self.dq_vecs = self.dq_row // (4 * self.threads_per_row)
        self.num_threads = PERSISTENT_THREADS if self.persistent else NUM_THREADS
        self.rows_per_cta = self.num_threads // self.threads_per_row
        # persistent: rows a thread group loads before reducing, and an item's rows
        self.unroll = max(1, PERSISTENT_LOADS // (2 * self.o_vecs)) if self.persistent else 1
        self.item_rows = self.unroll * self.rows_per_cta
        self.groups_per_warp = 32 // self.threads_per_row

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (b, s_q, h, dv)
        mdO: cute.Tensor,  # (b, s_q, h, dv)
        mLSE: cute.Tensor,  # (b, h, s_q) fp32, natural log
        mdLSE: cute.Tensor | None,  # dlse: (b, h, s_q) fp32, the lse gradient; else None
        mLSE2: cute.Tensor,  # (b, h, s_q padded) fp32, out
        mDsum: cute.Tensor,  # (b, h, s_q padded) fp32, out
        mdQacc: cute.Tensor,  # (b, s_q, h, d) fp32, out (zeroed); dq_flat_dim: (b, s_pad, h, that)
        mCuSeqlensQ: cute.Tensor | None,  # (sequences + 1,) int32 when varlen, else None
        max_seqlen_q: Int32,  # varlen: sizes the grid; dense: unused
        mReady: cute.Tensor | None,  # persistent: (b, h, x) int32, ready rows at [b, h, x - 1]
        num_ctas: Int32,  # persistent: the grid
        stream: cuda.CUstream,
    ):
        if cutlass.const_expr(self.persistent):
            self.kernel_persistent(mO, mdO, mLSE, mdLSE, mLSE2, mDsum, mdQacc, mReady).launch(
                grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], stream=stream
            )
        else:
            rows, num_batch = mLSE2.shape[2], cute.size(mO.shape[0])
            if cutlass.const_expr(self.varlen_tile_m > 0):
                tm = self.varlen_tile_m
                rows, num_batch = cute.ceil_div(max_seqlen_q, tm) * tm, mCuSeqlensQ.shape[0] - 1
            grid = (cute.ceil_div(rows, self.rows_per_cta), cute.size(mO.shape[2]), num_batch)
            self.kernel(mO, mdO, mLSE, mdLSE, mLSE2, mDsum, mdQacc, mCuSeqlensQ).launch(
                grid=grid, block=[self.num_threads, 1, 1], stream=stream
            )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdLSE: cute.Tensor | None,
        mLSE2: cute.Tensor,
        mDsum: cute.Tensor,
        mdQacc: cute.Tensor,
        mCuSeqlensQ: cute.Tensor | None,
    ):
        tidx = cute.arch.thread_idx()[0]
        row_block, head, batch = cute.arch.block_idx()
        lane = tidx % self.threads_per_row
        row = row_block * self.rows_per_cta + tidx // self.threads_per_row
        # packed rows of O / dO / lse start at `start`, padded rows at `pad`; `rows` of them
        # are written (the sequence's tiles)
        b, start, pad = batch, Int32(0), Int32(0)
        seqlen, rows = mO.shape[1], mLSE2.shape[2]
        if cutlass.const_expr(self.varlen_tile_m > 0):
            tm = self.varlen_tile_m
            b = Int32(0)
            start, seqlen, pad = varlen_rows(mCuSeqlensQ, batch, mO.shape[1], tm)
            rows = cute.ceil_div(seqlen, tm) * tm
        if cutlass.const_expr(self.front_pad):
            start = seqlen - rows  # query row start + row of padded row `row`
        dot = Float32(0.0)
        if self._is_query(row, start, seqlen):
            r_o, r_do = self._load_row(mO, mdO, b, start + row, head, lane)
            dot = self._dot(r_o, r_do)
        self._finish_row(
            mLSE, mdLSE, mLSE2, mDsum, mdQacc, b, start, pad, row, head, lane, seqlen, rows, dot
        )

    @cute.kernel
    def kernel_persistent(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdLSE: cute.Tensor | None,
        mLSE2: cute.Tensor,
        mDsum: cute.Tensor,
        mdQacc: cute.Tensor,
        mReady: cute.Tensor,
    ):
        # the main kernel may launch now: its CTAs take the SMs this grid leaves free and wait
        # for their heads' ready counts
        cute.arch.griddepcontrol_launch_dependents()
        tidx = cute.arch.thread_idx()[0]
        lane = tidx % self.threads_per_row
        group = tidx // self.threads_per_row
        warp_lane = cute.arch.lane_idx()
        # this warp's first row group: the warp's count covers its groups of each pass
        warp_group0 = cute.arch.make_warp_uniform(tidx // 32) * self.groups_per_warp
        seqlen, rows = mO.shape[1], mLSE2.shape[2]
        start = Int32(0)  # query row start + row of padded row `row`
        if cutlass.const_expr(self.front_pad):
            start = seqlen - rows
        heads = cute.size(mO.shape[2])
        per_pair = cute.ceil_div(rows, self.item_rows)
        num_items = per_pair * heads * cute.size(mO.shape[0])
        first, _, _ = cute.arch.block_idx()
        step, _, _ = cute.arch.grid_dim()
        # pair-major, pairs (head fastest) in the main grid's order, so the heads its first
        # CTAs need are ready first
        for item in cutlass.range(first, num_items, step, unroll=1):
            pair = item // per_pair
            row0 = (item - pair * per_pair) * self.item_rows
            head, b = pair % heads, pair // heads
            # every load first (padding rows load the last query row, or under front_pad the
            # first; zeroed below)
            loaded = []
            for u in cutlass.range_constexpr(self.unroll):
                row = row0 + u * self.rows_per_cta + group
                src = cutlass.min(row, seqlen - 1)
                if cutlass.const_expr(self.front_pad):
                    # (an item's rows run past `rows` at the end: clamped both ways)
                    src = cutlass.max(cutlass.min(row + start, seqlen - 1), 0)
                loaded.append(self._load_row(mO, mdO, b, src, head, lane))
            for u in cutlass.range_constexpr(self.unroll):
                row = row0 + u * self.rows_per_cta + group
                real = self._is_query(row, start, seqlen)
                dot = cutlass.select_(real, self._dot(*loaded[u]), Float32(0.0))
                self._finish_row(
                    mLSE, mdLSE, mLSE2, mDsum, mdQacc, b, start, Int32(0), row, head, lane,
                    seqlen, rows, dot,
                )  # fmt: skip
            # the warp's rows of this item (below `rows`) are written: count them ready. The
            # warp barrier orders every lane's stores before lane 0's release.
            cute.arch.sync_warp()
            if warp_lane == 0:
                done = Int32(0)
                for u in cutlass.range_constexpr(self.unroll):
                    left = rows - (row0 + u * self.rows_per_cta + warp_group0)
                    done += cutlass.max(cutlass.min(left, self.groups_per_warp), 0)
                if done > 0:
                    ptr = mReady.iterator + cute.crd2idx(
                        (b, head, mReady.shape[2] - 1), mReady.layout
                    )
                    cute.arch.atomic_add(ptr, done, sem="release", scope="gpu")

    @cute.jit
    def _is_query(self, row: Int32, start: Int32, seqlen: Int32) -> cutlass.Boolean:
        """Whether padded row `row` holds a query row (start + row): the first seqlen padded
        rows, or under front_pad the last seqlen."""
        if cutlass.const_expr(self.front_pad):
            return row + start >= 0 and row + start < seqlen
        return row < seqlen

    @cute.jit
    def _load_row(self, mO, mdO, b, row, head, lane):
        """This lane's vectors of O and dO at (b, row, head) (lane_vectors)."""
        tpr, nv = self.threads_per_row, self.o_vecs
        r_o = cute.make_rmem_tensor((8, nv), self.dtype)
        r_do = cute.make_rmem_tensor((8, nv), self.dtype)
        cute.autovec_copy(lane_vectors(mO[b, row, head, None], lane, 8, tpr, nv), r_o)
        cute.autovec_copy(lane_vectors(mdO[b, row, head, None], lane, 8, tpr, nv), r_do)
        return r_o, r_do

    @cute.jit
    def _dot(self, r_o: cute.Tensor, r_do: cute.Tensor) -> Float32:
        """This lane's part of sum_d dO * O, in fp32."""
        prod = r_o.load().to(Float32) * r_do.load().to(Float32)
        return prod.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)

    @cute.jit
    def _finish_row(
        self, mLSE, mdLSE, mLSE2, mDsum, mdQacc, b, start, pad, row, head, lane, seqlen, rows,
        dot,
    ):  # fmt: skip
        """Clear the row's accumulator part, reduce the group's dot and write lse_log2 / D."""
        # the accumulator row: the query rows', or (register-order tiles) every padded row's
        zero_rows = seqlen
        if cutlass.const_expr(self.dq_flat_dim > 0):
            zero_rows = rows
        if row < zero_rows:
            zeros = cute.make_rmem_tensor((4, self.dq_vecs), Float32)
            zeros.fill(0.0)
            acc_row = mdQacc[b, pad + row, head, None]
            tpr = self.threads_per_row
            cute.autovec_copy(zeros, lane_vectors(acc_row, lane, 4, tpr, self.dq_vecs))
        # every lane of the group takes part in the shuffles, padding rows included
        dot = cute.arch.warp_reduction_sum(dot, threads_in_group=self.threads_per_row)
        if lane == 0 and row < rows:
            lse2 = Float32.inf
            if self._is_query(row, start, seqlen):
                lse = mLSE[b, head, start + row]
                lse2 = cutlass.select_(lse == -Float32.inf, Float32.inf, lse * LOG2E)
                if cutlass.const_expr(self.dlse):
                    dot = dot - mdLSE[b, head, start + row]
            mLSE2[b, head, pad + row] = lse2
            mDsum[b, head, pad + row] = dot


__all__ = [
    "BwdPreprocess",
    "NUM_THREADS",
    "PERSISTENT_THREADS",
    "lane_vectors",
    "row_threads",
    "varlen_rows",
]
