"""Split-KV combine: merge the fp32 partials of num_splits key ranges into out and lse.

Each split s wrote, for every query row, o_s (normalized over its own keys) and lse_s (natural
log; -inf when its range held no visible key). The result over the union of the disjoint key
ranges is
    lse = log(sum_s exp(lse_s)),   out = sum_s exp(lse_s - lse) * o_s,
and a row no split saw (lse = -inf everywhere) gets out = 0, lse = -inf.

One warp per (batch, query row, head): lanes read the split lse values (lane s holds split s,
then s + 32, ...), reduce max and sum by shuffles, and keep their split's weight
exp(lse_s - lse) in a register. Each lane then accumulates head_dim_v / 32 columns (column
c = 32 j + lane, so every load and store of the warp is one contiguous run), `split_unroll`
splits per step with each weight broadcast by a shuffle: a step's loads depend neither on
each other nor on the accumulator, so they are in flight together. (One split per step
would serialize one L2 round trip per split.)

Launched with programmatic dependent launch (PDL): its CTAs may become resident while the
split kernel still runs (that kernel's consumers signal `griddepcontrol.launch_dependents`
when they reach the epilogue; FwdTileConfig.early_dependents moves the signal to its start)
and wait in `griddepcontrol.wait` until every split partial is written and visible. That
hides this launch's latency behind the split kernel's tail (docs/perf/decode_splits_h200.json).

Tensors: o_part (splits, batch, seq, heads, dv) fp32, lse_part (splits, batch, heads, seq)
fp32, out (batch, seq, heads, dv) in the output dtype, lse (batch, heads, seq) fp32.
Constraints: head_dim_v a multiple of 32 (every served head dim is).
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32

NUM_THREADS = 128
LOG2E = math.log2(math.e)
# splits whose partial loads one step keeps in flight (head_dim_v / 32 loads each per lane)
SPLIT_UNROLL = 8


class SplitCombine:
    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim_v: int,
        split_unroll: int = SPLIT_UNROLL,
        use_pdl: bool = True,
    ):
        self.dtype = dtype
        self.head_dim_v = head_dim_v
        # both knobs exist so scripts/decode_splits.py can measure what each buys
        self.split_unroll = split_unroll
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
            # pass 1: the largest lse_s, then the sum of exp(lse_s - max), over the splits
            m = -Float32.inf
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                m = cute.arch.fmax(m, mLSEpart[s, batch, head, pos])
            m = cute.arch.warp_reduction_max(m)
            m_safe = cutlass.select_(m == -Float32.inf, Float32(0.0), m)
            total = Float32(0.0)
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                total += cute.math.exp2((mLSEpart[s, batch, head, pos] - m_safe) * LOG2E)
            total = cute.arch.warp_reduction_sum(total)
            # lse = m + log(total); exp(-inf) = 0 weights every split of an empty row by 0
            lse = -Float32.inf
            if total > Float32(0.0):
                lse = m_safe + cute.math.log2(total) / LOG2E
            lse_safe = cutlass.select_(total > Float32(0.0), lse, Float32(0.0))
            acc = cute.make_rmem_tensor((self.cols_per_lane,), Float32)
            acc.fill(0.0)
            last = num_splits - 1
            for s32 in cutlass.range(0, num_splits, 32, unroll=1):
                # lane i holds the weight of split s32 + i (0 past the last split)
                w_lane = Float32(0.0)
                if s32 + lane < num_splits:
                    w_lane = cute.math.exp2(
                        (mLSEpart[s32 + lane, batch, head, pos] - lse_safe) * LOG2E
                    )
                in_chunk = cutlass.min(32, num_splits - s32)
                for step in cutlass.range(0, in_chunk, self.split_unroll, unroll=1):
                    # a step past the last split re-reads it (in bounds) with weight 0
                    for i in cutlass.range_constexpr(self.split_unroll):
                        w = cute.arch.shuffle_sync(w_lane, step + i)
                        s = cutlass.min(s32 + step + i, last)
                        for j in cutlass.range_constexpr(self.cols_per_lane):
                            acc[j] += w * mOpart[s, batch, pos, head, j * 32 + lane]
            for j in cutlass.range_constexpr(self.cols_per_lane):
                mO[batch, pos, head, j * 32 + lane] = acc[j].to(self.dtype)
            if lane == 0:
                mLSE[batch, head, pos] = lse


__all__ = ["SplitCombine", "NUM_THREADS"]
