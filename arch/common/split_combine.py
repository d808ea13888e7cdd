"""Split-KV combine: merge the fp32 partials of num_splits key ranges into out and lse.

Each split s wrote, for every query row, o_s (normalized over its own keys) and lse_s (natural
log; -inf when its range held no visible key). The result over the union of the disjoint key
ranges is
    lse = log(sum_s exp(lse_s)),   out = sum_s exp(lse_s - lse) * o_s,
and a row no split saw (lse = -inf everywhere) gets out = 0, lse = -inf.

One warp per (batch, query row, head). Lane s holds split s's lse (then s + 32, ...); max and
sum are warp shuffles, and each lane keeps its split's weight exp(lse_s - lse) in a register.
Each lane accumulates head_dim_v / 32 columns (column c = 32 j + lane, so every load and
store of the warp is one contiguous run), `split_unroll` splits per step, each weight
broadcast by a shuffle. The loads a step needs depend neither on each other nor on the lse
values, so they are issued together, and the first step's are issued before the lse
reductions: the whole combine of up to `split_unroll` splits waits on one L2 round trip.
(Before, lse was read three times in a chain, for the max, the sum and the weights, and the
partials' loads waited for all three; docs/perf/README.md, fifteenth session.)

Launched with programmatic dependent launch (PDL): its CTAs may become resident while the
split kernel still runs (that kernel's consumers signal `griddepcontrol.launch_dependents`
when they reach the epilogue; FwdTileConfig.early_dependents moves the signal to its start)
and wait in `griddepcontrol.wait` until every split partial is written and visible. That
hides this launch's latency behind the split kernel's tail (docs/perf/decode_splits_h200.json).
Merging in each tile's last split instead (an int32 arrival counter per tile; the split that
arrives last re-reads the tile's partials and merges them, one warp a row; commit ea84506)
lost on every row of an H100 A/B, 0.4-1.2 us a call at 1-4 rows a tile and 4.9 us at 16
(docs/perf/split_ticket_ab_s53_h100.json): the counter's round trip and the last split's
serial reads cost more than this launch's grid boundary.

Tensors: o_part (splits, batch, seq, heads, dv) fp32, lse_part (splits, batch, heads, seq)
fp32, out (batch, seq, heads, dv) in the output dtype, lse (batch, heads, seq) fp32.
Constraints: head_dim_v a multiple of 32 (every served head dim is).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .softmax import LOG2E

NUM_THREADS = 128
# Partial loads a lane keeps in flight per step: split_unroll * head_dim_v / 32 registers. 64
# holds the 16 splits of the bench's B=1 decode row at D=128 in one step.
STEP_REGISTERS = 64


def default_split_unroll(head_dim_v: int) -> int:
    """The largest power of two <= 16 whose step fits STEP_REGISTERS at head_dim_v."""
    u = 16
    while u > 1 and u * (head_dim_v // 32) > STEP_REGISTERS:
        u //= 2
    return u


class SplitCombine:
    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim_v: int,
        split_unroll: int | None = None,
        use_pdl: bool = True,
    ):
        self.dtype = dtype
        self.head_dim_v = head_dim_v
        # both knobs exist so scripts/decode_splits.py can measure what each buys
        self.split_unroll = split_unroll or default_split_unroll(head_dim_v)
        self.use_pdl = use_pdl
        self._setup_attributes()

    def _setup_attributes(self):
        if self.head_dim_v % 32:
            raise ValueError(f"head_dim_v {self.head_dim_v} must be a multiple of 32")
        if self.split_unroll not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"split_unroll {self.split_unroll} must divide 32")
        self.cols_per_lane = self.head_dim_v // 32
        self.rows_per_cta = NUM_THREADS // 32

    @cute.jit
    def __call__(
        self,
        mOpart: cute.Tensor,  # (splits, b, s, h, dv) fp32
        mLSEpart: cute.Tensor,  # (splits, b, h, s) fp32
        mO: cute.Tensor,  # (b, s, h, dv)
        mLSE: cute.Tensor,  # (b, h, s) fp32
        stream: cuda.CUstream,
    ):
        if cutlass.const_expr(mO.element_type != self.dtype):
            raise TypeError(f"out dtype {mO.element_type} != compiled {self.dtype}")
        rows = cute.size(mO.shape[0]) * cute.size(mO.shape[1]) * cute.size(mO.shape[2])
        grid = (cute.ceil_div(rows, self.rows_per_cta), 1, 1)
        self.kernel(mOpart, mLSEpart, mO, mLSE).launch(
            grid=grid, block=[NUM_THREADS, 1, 1], stream=stream, use_pdl=self.use_pdl
        )

    @cute.kernel
    def kernel(
        self, mOpart: cute.Tensor, mLSEpart: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor
    ):
        tidx = cute.arch.thread_idx()[0]
        lane = tidx % 32
        row = cute.arch.block_idx()[0] * self.rows_per_cta + tidx // 32
        num_splits = mOpart.shape[0]
        heads, seqlen = mO.shape[2], mO.shape[1]
        # heads vary fastest: consecutive warps write consecutive (row, head) runs of out
        head = row % heads
        pos = (row // heads) % seqlen
        batch = row // (heads * seqlen)
        if cutlass.const_expr(self.use_pdl):
            # nothing below may read a partial before the split kernel has finished
            cute.arch.griddepcontrol_wait()
        if batch < mO.shape[0]:  # warp-uniform
            u, cpl, last = self.split_unroll, self.cols_per_lane, num_splits - 1
            # Every load that needs no other load is issued first, together: lane s's lse_s
            # (splits 0..31) and the first step's partials. The reductions below then wait on
            # one L2 round trip, not on one per pass.
            lse_chunk = -Float32.inf
            if lane < num_splits:
                lse_chunk = mLSEpart[lane, batch, head, pos]
            buf = cute.make_rmem_tensor((u * cpl,), Float32)
            self.load_step(mOpart, buf, 0, last, batch, pos, head, lane)
            # pass 1: the largest lse_s, then the sum of exp(lse_s - max), over the splits
            # (past 32 splits the later chunks are read here and again below)
            m = lse_chunk
            for s in cutlass.range(lane + 32, num_splits, 32, unroll=1):
                m = cute.arch.fmax(m, mLSEpart[s, batch, head, pos])
            m = cute.arch.warp_reduction_max(m)
            m_safe = cutlass.select_(m == -Float32.inf, Float32(0.0), m)
            total = cute.math.exp2((lse_chunk - m_safe) * LOG2E)
            for s in cutlass.range(lane + 32, num_splits, 32, unroll=1):
                total += cute.math.exp2((mLSEpart[s, batch, head, pos] - m_safe) * LOG2E)
            total = cute.arch.warp_reduction_sum(total)
            # lse = m + log(total); exp(-inf) = 0 weights every split of an empty row by 0
            lse = -Float32.inf
            if total > Float32(0.0):
                lse = m_safe + cute.math.log2(total) / LOG2E
            lse_safe = cutlass.select_(total > Float32(0.0), lse, Float32(0.0))
            acc = cute.make_rmem_tensor((cpl,), Float32)
            acc.fill(0.0)
            for s32 in cutlass.range(0, num_splits, 32, unroll=1):
                # lane i holds the weight of split s32 + i (0 past the last split: its lse
                # is -inf)
                w_lane = cute.math.exp2((lse_chunk - lse_safe) * LOG2E)
                in_chunk = cutlass.min(32, num_splits - s32)
                for step in cutlass.range(0, in_chunk, u, unroll=1):
                    # buf holds splits s32 + step .. + u - 1 (a split past the last one
                    # re-reads the last, with weight 0)
                    for i in cutlass.range_constexpr(u):
                        w = cute.arch.shuffle_sync(w_lane, step + i)
                        for j in cutlass.range_constexpr(cpl):
                            acc[j] += w * buf[i * cpl + j]
                    if s32 + step + u < num_splits:  # warp-uniform: the next step's partials
                        self.load_step(mOpart, buf, s32 + step + u, last, batch, pos, head, lane)
                lse_chunk = -Float32.inf
                if s32 + 32 + lane < num_splits:
                    lse_chunk = mLSEpart[s32 + 32 + lane, batch, head, pos]
            for j in cutlass.range_constexpr(cpl):
                mO[batch, pos, head, j * 32 + lane] = acc[j].to(self.dtype)
            if lane == 0:
                mLSE[batch, head, pos] = lse

    @cute.jit
    def load_step(
        self,
        mOpart: cute.Tensor,
        buf: cute.Tensor,
        first: Int32,
        last: Int32,
        batch: Int32,
        pos: Int32,
        head: Int32,
        lane: Int32,
    ):
        """buf <- the partials of splits first .. first + split_unroll - 1 (clamped to the
        last split) at this lane's columns: independent loads, all in flight together."""
        for i in cutlass.range_constexpr(self.split_unroll):
            s = cutlass.min(first + i, last)
            for j in cutlass.range_constexpr(self.cols_per_lane):
                buf[i * self.cols_per_lane + j] = mOpart[s, batch, pos, head, j * 32 + lane]


__all__ = ["SplitCombine", "NUM_THREADS"]
