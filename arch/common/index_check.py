"""Device-side check of a read-only KV-cache call's index values: one launch, no host sync.

What: one flag word per batch row b, 0 when every index value the attention kernel reads for
row b is valid; bit 0: cache_seqlens[b] outside [0, capacity]; bit 1: cache_batch_idx[b]
outside [0, batch_cache); bit 2: a used page-table entry of row b (page j < ceil(len_b /
page_size), len_b clamped into [0, capacity] as the attention kernel clamps it) outside
[0, num_pages). Entries past a row's used pages may hold anything and are not read.

Why: the host's value checks (cute_attn.validation.ValueCheck) used to gather these values
with a dozen small torch ops and read them before the launch, a host sync that drained the
stream ahead of every decode step. This kernel replaces those ops with one launch queued ahead
of the attention kernel; the host copies its flags to pinned memory and reads them after the
attention launch. A nonzero flag sends the host to the synchronous checks, which name the bad
entry. The kernel only flags: the attention kernel stays inside its tensors on any value (it
clamps key lengths, and its TMA loads fill out-of-range page or cache-row coordinates with
zeros), so a bad value costs a discarded output and the usual ValueError.

One warp per batch row; lanes stride over the row's used pages. Constraints: int32 tensors;
page_table rows may be padded (any row stride). Compiled by
cute_attn.arch.sm90.compile.compile_kv_index_check (it has no arch-specific instruction).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32

BAD_LENGTH, BAD_BATCH_IDX, BAD_PAGE = 1, 2, 4


class KvIndexCheck:
    def __init__(self, has_lengths: bool, has_batch_idx: bool, paged: bool):
        # which index tensors exist (the rest are None at the call): presence specializes
        self.has_lengths = has_lengths
        self.has_batch_idx = has_batch_idx
        self.paged = paged
        self._setup_attributes()

    def _setup_attributes(self):
        if not (self.has_lengths or self.has_batch_idx or self.paged):
            raise ValueError("KvIndexCheck needs at least one index tensor to check")
        if self.paged and self.has_batch_idx:
            raise ValueError("paged caches map rows to pages themselves: no cache_batch_idx")

    @cute.jit
    def __call__(
        self,
        mFlags: cute.Tensor,  # (batch,) int32, written
        mLengths: cute.Tensor | None,  # (batch,) int32 cache_seqlens
        mBatchIdx: cute.Tensor | None,  # (batch,) int32 cache_batch_idx
        mPageTable: cute.Tensor | None,  # (batch, max_pages) int32
        uniform_length: Int32,  # every row's length when mLengths is None
        capacity: Int32,
        batch_cache: Int32,
        page_size: Int32,
        num_pages: Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(
            mFlags, mLengths, mBatchIdx, mPageTable, uniform_length, capacity, batch_cache,
            page_size, num_pages,
        ).launch(grid=[mFlags.shape[0], 1, 1], block=[32, 1, 1], stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mFlags: cute.Tensor,
        mLengths: cute.Tensor | None,
        mBatchIdx: cute.Tensor | None,
        mPageTable: cute.Tensor | None,
        uniform_length: Int32,
        capacity: Int32,
        batch_cache: Int32,
        page_size: Int32,
        num_pages: Int32,
    ):
        lane = cute.arch.thread_idx()[0]
        b = cute.arch.block_idx()[0]
        flags = Int32(0)
        length = uniform_length
        if cutlass.const_expr(self.has_lengths):
            length = mLengths[b]
            if length < 0:
                flags = flags | BAD_LENGTH
            if length > capacity:
                flags = flags | BAD_LENGTH
        if cutlass.const_expr(self.has_batch_idx):
            row = mBatchIdx[b]
            if row < 0:
                flags = flags | BAD_BATCH_IDX
            if row >= batch_cache:
                flags = flags | BAD_BATCH_IDX
        if cutlass.const_expr(self.paged):
            used = cute.ceil_div(cutlass.min(cutlass.max(length, 0), capacity), page_size)
            bad = Int32(0)
            for j in cutlass.range(lane, used, 32, unroll=1):
                page = mPageTable[b, j]
                if page < 0:
                    bad = Int32(1)
                if page >= num_pages:
                    bad = Int32(1)
            if cute.arch.vote_any_sync(bad != 0):
                flags = flags | BAD_PAGE
        if lane == 0:
            mFlags[b] = flags


__all__ = ["KvIndexCheck", "BAD_LENGTH", "BAD_BATCH_IDX", "BAD_PAGE"]
