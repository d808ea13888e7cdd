"""Online softmax over wgmma accumulator rows, in the exp2 domain (paper names m, l, acc).

For each query row the kernel keeps the running max `m` (in raw score units) and the running
sum `l` of exp2(s * scale_log2 - m * scale_log2). A new key tile with row max m' > m rescales
`l` and the output accumulator `acc` by exp2((m - m') * scale_log2).

Conditional rescaling (`rescale_threshold` > 0, in log2 units): while
(m' - m) * scale_log2 <= threshold the old max is kept and nothing is rescaled; the
probabilities of that tile are then at most 2**threshold instead of 1. This is exact after the
final normalization (out = acc / l, lse = m * scale + ln l use the same m). fp32 safety: each
P <= 2**threshold, so with threshold 8 a row sum over 2**20 keys is <= 2**28, far below
fp32 max (2**128), and P (<= 256) is exactly representable in the bf16/fp16 exponent range
(fp16 max 65504); the threshold is capped at 8 by the tile config.

A row that has seen no visible key has m = -inf; the helpers substitute 0 for the max in
the exponent so exp2 gives 0 (never NaN), and `finalize` returns l = 0 for it, which the
epilogue turns into out = 0, lse = -inf.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .dsl import DslStruct
from .fast_math import exp2_fma
from .layout import acc_as_rows_cols

LN2 = math.log(2.0)
LOG2E = math.log2(math.e)


@cute.jit
def _row_sum_ilp(s: cute.Tensor, r: cutlass.Constexpr[int]) -> Float32:
    """Sum of row r with four independent partial sums.

    fp32 adds are not reassociated by the compiler, so a plain reduce is one dependent chain
    (tile_n / 4 adds of ~4 cycles each per row, on the softmax's critical path); four chains
    and a final pairwise combine cut that latency by ~4x.
    """
    n = cute.size(s, mode=[1])  # tile_n / 4 >= 4 (tile_n >= 16 by the tile config)
    part = [s[r, 0], s[r, 1], s[r, 2], s[r, 3]]
    for j in cutlass.range_constexpr(4, n):
        part[j % 4] = part[j % 4] + s[r, j]
    return (part[0] + part[1]) + (part[2] + part[3])


@cute.jit
def _row_max_ilp(s: cute.Tensor, r: cutlass.Constexpr[int]) -> Float32:
    """Max of row r as four independent FMNMX chains joined pairwise (FA4's shape for SM90);
    the generic reduce builds a tree that ptxas interleaves with the other row's work."""
    n = cute.size(s, mode=[1])
    part = [s[r, 0], s[r, 1], s[r, 2], s[r, 3]]
    for j in cutlass.range_constexpr(4, n):
        part[j % 4] = cute.arch.fmax(part[j % 4], s[r, j])
    return cute.arch.fmax(cute.arch.fmax(part[0], part[1]), cute.arch.fmax(part[2], part[3]))


def _spread(n: int, slots: int) -> list[int]:
    """How many of n items are due after each of `slots` steps, spread evenly (trace time)."""
    return [(i + 1) * n // slots for i in range(slots)]


class OnlineSoftmax(DslStruct):
    """Per-thread softmax state for the rows this thread holds (2 per 64-row wgmma atom).

    Row values live in 4 lanes (a quad); the max is reduced across the quad at every tile,
    the sum only once in `finalize` (each lane keeps a partial sum until then).
    """

    _dynamic_ = ("scale_log2", "row_max", "row_sum")

    def __init__(
        self,
        scale_log2: Float32,
        num_rows: int,
        rescale_threshold: float,
        exp2_emu_every: int = 0,
        row_max_form: int = 0,
    ):
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.rescale_threshold = rescale_threshold
        # how a row's max is reduced (FwdTileConfig.row_max_form): 0 the DSL reduce and
        # shuffle steps as they come, 1 the shuffle steps as one FMNMX each, 2 four FMNMX
        # chains per row and every row's max before any row's exponentials
        self.row_max_form = row_max_form
        # 0: all exponentials on the SFU; k: every k-th column of a row on the FMA pipe
        self.exp2_emu_every = exp2_emu_every
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    @cute.jit
    def reset(self):
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def step(
        self,
        acc_s: cute.Tensor,
        is_first: cutlass.Constexpr[bool],
        visible: cutlass.Constexpr[bool] = False,
    ) -> cute.Tensor:
        """Turn scores `acc_s` into probabilities in place; return the per-row O rescale.
        `visible`: every score of the tile is finite (a tile the caller proved fully
        visible), so no -inf guard on the maxes (`_new_max`)."""
        s = acc_as_rows_cols(acc_s)
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        m_scaled = cute.make_rmem_tensor(self.num_rows, Float32)
        # form 2: every row's max before any row's exponentials (trace-time list)
        maxes_first = self.row_max_form == 2
        tile_maxes = [self._tile_max(s, r) for r in range(self.num_rows)] if maxes_first else []
        for r in cutlass.range_constexpr(self.num_rows):
            tile_max = tile_maxes[r] if maxes_first else self._tile_max(s, r)
            self._new_max(r, tile_max, row_scale, m_scaled, is_first, visible)
            m_row = m_scaled[r]
            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                self._exp(s, r, c, m_row)
            self._add_row_sum(s, r, row_scale, is_first)
        return row_scale

    @cute.jit
    def step_head(
        self,
        acc_s: cute.Tensor,
        k: cutlass.Constexpr[int],
        visible: cutlass.Constexpr[bool] = False,
    ):
        """First part of a non-first `step` whose O rescale runs inside the exponentials
        (FwdTileConfig.interleave_rescale): the row maxes (all of them with row_max_form 2,
        else those of the rows the first k probabilities touch), the row scales and the
        thread's first `k` probabilities in row order. Returns (row_scale, m_scaled) for
        `step_tail`. Between the two the caller waits for the P V GEMM that writes acc_o.
        `visible` as in `step` (pass the same to `step_tail`)."""
        s = acc_as_rows_cols(acc_s)
        cols = cute.size(s, mode=[1])
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        m_scaled = cute.make_rmem_tensor(self.num_rows, Float32)
        max_rows = self.num_rows if self.row_max_form == 2 else -(-k // cols)
        tile_maxes = [self._tile_max(s, r) for r in range(max_rows)]
        for r in cutlass.range_constexpr(max_rows):
            self._new_max(r, tile_maxes[r], row_scale, m_scaled, False, visible)
            self._tie_to_scale(r, row_scale, m_scaled)
        m_rows = [m_scaled[r] for r in range(max_rows)]
        for i in cutlass.range_constexpr(k):
            self._exp(s, i // cols, i % cols, m_rows[i // cols])
            if cutlass.const_expr(i % cols == cols - 1):
                self._add_row_sum(s, i // cols, row_scale, False)
        return row_scale, m_scaled

    @cute.jit
    def step_tail(
        self,
        acc_s: cute.Tensor,
        acc_o: cute.Tensor,
        row_scale: cute.Tensor,
        m_scaled: cute.Tensor,
        k: cutlass.Constexpr[int],
        visible: cutlass.Constexpr[bool] = False,
    ):
        """The rest of `step_head`'s step: the remaining probabilities, row maxes and row sums,
        with the O rescale's multiplies spread over the exponentials in program order. With
        one consumer warpgroup in its softmax at a time, an SM sub-partition's SFU works for
        one warp; the multiplies fill its issue slots between exponentials (FA4's SASS has
        them there) instead of lengthening the step after the last one."""
        s = acc_as_rows_cols(acc_s)
        o = acc_as_rows_cols(acc_o)
        cols = cute.size(s, mode=[1])
        ocols = cute.size(o, mode=[1])
        for r in cutlass.range_constexpr(self.num_rows):
            if cutlass.const_expr(self.row_max_form != 2 and r * cols >= k):
                self._new_max(r, self._tile_max(s, r), row_scale, m_scaled, False, visible)
                self._tie_to_scale(r, row_scale, m_scaled)
            c0 = max(k - r * cols, 0)  # this row's first probability left to compute
            # O multiplies due after each remaining exponential (all up front for a row the
            # head finished)
            due = _spread(ocols, cols - c0)
            done = 0
            m_row, scale_row = m_scaled[r], row_scale[r]
            for c in cutlass.range_constexpr(c0, cols):
                self._exp(s, r, c, m_row)
                for j in cutlass.range_constexpr(done, due[c - c0]):
                    o[r, j] = o[r, j] * scale_row
                done = due[c - c0]
            for j in cutlass.range_constexpr(done, ocols):
                o[r, j] = o[r, j] * scale_row
            if cutlass.const_expr(c0 < cols):
                self._add_row_sum(s, r, row_scale, False)

    @cute.jit
    def _new_max(
        self,
        r: cutlass.Constexpr[int],
        tile_max: Float32,
        row_scale: cute.Tensor,
        m_scaled: cute.Tensor,
        is_first: cutlass.Constexpr[bool],
        visible: cutlass.Constexpr[bool] = False,
    ):
        """Row r's new running max from its tile max; its O / l rescale into row_scale[r] and
        the max in exponent units (0 for a row with no visible key yet) into m_scaled[r].

        `visible`: tile_max is finite (every key of the tile visible to the row), so m_new is
        too and the three -inf guards go (six compares and selects a tile for a thread's
        two rows): with m_old = -inf the scale is exp2(-inf) = 0 by itself, which zeroes an
        l and acc that are 0 already (scale_log2 > 0: validation keeps softmax_scale > 0)."""
        m_old = self.row_max[r]
        m_new = cute.arch.fmax(m_old, tile_max)
        if cutlass.const_expr(is_first):
            m_new = tile_max
            row_scale[r] = Float32(1.0)
        else:
            if cutlass.const_expr(self.rescale_threshold > 0.0):
                # keep the old max while the growth is small (and the old max is finite)
                keep = (m_new - m_old) * self.scale_log2 <= self.rescale_threshold
                m_new = m_old if keep else m_new
            if cutlass.const_expr(visible):
                row_scale[r] = cute.math.exp2((m_old - m_new) * self.scale_log2, fastmath=True)
            else:
                m_cur_safe = Float32(cutlass.select_(m_new == -Float32.inf, 0.0, m_new))
                scale = cute.math.exp2((m_old - m_cur_safe) * self.scale_log2, fastmath=True)
                # m_old = -inf: nothing accumulated yet (exp2(-inf) is 0 already; the select
                # keeps NaN out when m_new is -inf too)
                row_scale[r] = Float32(cutlass.select_(m_old == -Float32.inf, 0.0, scale))
        self.row_max[r] = m_new
        if cutlass.const_expr(visible):
            m_scaled[r] = m_new * self.scale_log2
        else:
            m_scaled[r] = (m_new if m_new != -Float32.inf else Float32(0.0)) * self.scale_log2

    @cute.jit
    def _tie_to_scale(
        self, r: cutlass.Constexpr[int], row_scale: cute.Tensor, m_scaled: cute.Tensor
    ):
        """Make row r's exponentials wait for its O rescale factor: m_scaled + 0 * row_scale
        (one FFMA; row_scale is finite, in [0, 1], so the value is unchanged). ptxas orders
        the SFU's exponentials by their own critical paths and issues the rescale factor's
        last, which holds O's multiplies after every probability; with the tie it goes
        first and the multiplies can fill the issue slots between exponentials."""
        m_scaled[r] = row_scale[r] * Float32(0.0) + m_scaled[r]

    @cute.jit
    def _exp(
        self,
        s: cute.Tensor,
        r: cutlass.Constexpr[int],
        c: cutlass.Constexpr[int],
        m_row: Float32,
    ):
        """p = exp2(s * scale_log2 - m) in place; m_row is the row's m_scaled entry (read once
        per row by the callers: an element's own read added two IR ops per exponential)."""
        x = s[r, c] * self.scale_log2 - m_row
        if cutlass.const_expr(self.exp2_emu_every > 0 and c % self.exp2_emu_every == 0):
            s[r, c] = exp2_fma(x)  # balance the SFU and FMA pipes
        else:
            s[r, c] = cute.math.exp2(x, fastmath=True)

    @cute.jit
    def _add_row_sum(
        self,
        s: cute.Tensor,
        r: cutlass.Constexpr[int],
        row_scale: cute.Tensor,
        is_first: cutlass.Constexpr[bool],
    ):
        tile_sum = _row_sum_ilp(s, r)
        if cutlass.const_expr(is_first):
            self.row_sum[r] = tile_sum
        else:
            self.row_sum[r] = self.row_sum[r] * row_scale[r] + tile_sum

    def _tile_max(self, s: cute.Tensor, r: cutlass.Constexpr[int]) -> Float32:
        if cutlass.const_expr(self.row_max_form == 2):
            return cute.arch.warp_reduction_max(_row_max_ilp(s, r), threads_in_group=4)
        tile_max = s[r, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
        if cutlass.const_expr(self.row_max_form == 0):
            return cute.arch.warp_reduction_max(tile_max, threads_in_group=4)
        # as Float32 the shuffle steps use one FMNMX each; the reduce's own result type takes
        # the DSL's generic max (compare, NaN test, select) on the first step
        return cute.arch.warp_reduction_max(Float32(tile_max), threads_in_group=4)

    @cute.jit
    def sum_of_row_sums(self, rows: cutlass.Constexpr[int] = 0) -> Float32:
        """This thread's first `rows` row sums added (0: all): >= 0 or NaN, and ready only
        once each of those rows is."""
        total = self.row_sum[0]
        for r in cutlass.range_constexpr(1, min(rows, self.num_rows) if rows else self.num_rows):
            total = total + self.row_sum[r]
        return total

    @cute.jit
    def rescale(self, acc_o: cute.Tensor, row_scale: cute.Tensor):
        o = acc_as_rows_cols(acc_o)
        for r in cutlass.range_constexpr(self.num_rows):
            scale_row = row_scale[r]
            for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                o[r, c] = o[r, c] * scale_row

    @cute.jit
    def finalize(self, acc_o: cute.Tensor) -> cute.Tensor:
        """Normalize `acc_o` by the row sums; return lse (natural log, -inf for empty rows)."""
        o = acc_as_rows_cols(acc_o)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            l_row = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            empty = (l_row == 0.0) | (l_row != l_row)
            inv = cute.arch.rcp_approx(Float32(cutlass.select_(empty, 1.0, l_row)))
            inv = Float32(cutlass.select_(empty, 0.0, inv))
            m_row = self.row_max[r]
            lse_r = (m_row * self.scale_log2 + cute.math.log2(l_row, fastmath=True)) * LN2
            lse[r] = Float32(cutlass.select_(empty, -Float32.inf, lse_r))
            for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                o[r, c] = o[r, c] * inv
        return lse
