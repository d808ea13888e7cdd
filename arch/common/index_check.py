"""Device-side check of a call's index values (varlen and KV-cache): one launch, no host sync.

What: one flag word per batch row b, 0 when every index value the attention kernel reads for
row b is valid, else the OR of:
  BAD_CU_Q      cu_seqlens_q: cu[b+1] < cu[b], cu[0] != 0, cu[batch] != total_q, or a span
                longer than max_seqlen_q;
  BAD_CU_K      cu_seqlens_k: the same with total_k (not tied when total_k < 0, i.e. paged)
                and max_seqlen_k; paged: a span longer than the page table's capacity;
  BAD_USED_Q    seqused_q[b] outside [0, the cu_seqlens_q span];
  BAD_LENGTH    seqused_k[b] (cache_seqlens) outside [0, the cu_seqlens_k span, else the
                capacity], or past max_seqlen_k without cu_seqlens_k;
  BAD_BATCH_IDX cache_batch_idx[b] outside [0, batch_cache);
  BAD_PAGE      a used page-table entry of row b (page j < ceil(len_b / page_size), len_b
                clamped into [0, capacity] as the attention kernel clamps it) outside
                [0, num_pages). Entries past a row's used pages may hold anything.
These are the rules of cute_attn.validation's synchronous checks (duplicate cache rows only
matter for appends, which keep those checks).

Why: the synchronous checks read the values with small torch ops and a `.tolist()` before the
launch, a host sync that drained the stream ahead of every call. This kernel is queued ahead
of the attention kernel instead; the host copies its flags to pinned memory and reads them
after the attention launch (cute_attn.validation.ValueCheck). A set flag sends the host to the
synchronous checks, which name the bad entry and raise. The kernel only flags: the attention
kernel stays inside its tensors on any value (arch/common/seqlen.SeqInfo clamps offsets and
lengths; TMA loads fill out-of-range page or cache-row coordinates with zeros), so a bad value
costs a discarded output and the usual ValueError.

One warp per batch row; lanes stride over the row's used pages (`row_flags` holds one row's
rules; tests/test_index_check_host.py runs it on the CPU against the host's checks).
Constraints: int32 tensors; page_table rows may be padded (any row stride). Compiled by
cute_attn.arch.sm90.compile.compile_index_check (nothing arch-specific in it).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32

BAD_LENGTH, BAD_BATCH_IDX, BAD_PAGE, BAD_CU_Q, BAD_CU_K, BAD_USED_Q = 1, 2, 4, 8, 16, 32


class IndexCheck:
    def __init__(
        self,
        cu_seqlens_q: bool = False,
        cu_seqlens_k: bool = False,
        seqused_q: bool = False,
        seqused_k: bool = False,
        batch_idx: bool = False,
        paged: bool = False,
    ):
        # which index tensors exist (the rest are None at the call): presence specializes
        self.cu_seqlens_q = cu_seqlens_q
        self.cu_seqlens_k = cu_seqlens_k
        self.seqused_q = seqused_q
        self.seqused_k = seqused_k
        self.batch_idx = batch_idx
        self.paged = paged
        self._setup_attributes()

    def _setup_attributes(self):
        if not (self.cu_seqlens_q or self.cu_seqlens_k or self.seqused_k or self.batch_idx
                or self.paged):  # fmt: skip
            raise ValueError("IndexCheck needs at least one index tensor to check")
        if self.seqused_q and not self.cu_seqlens_q:
            raise ValueError("seqused_q is checked against cu_seqlens_q spans")
        if self.paged and self.batch_idx:
            raise ValueError("paged caches map rows to pages themselves: no cache_batch_idx")

    @cute.jit
    def __call__(
        self,
        mFlags: cute.Tensor,  # (batch,) int32, written
        mCuSeqlensQ: cute.Tensor | None,  # (batch + 1,)
        mCuSeqlensK: cute.Tensor | None,  # (batch + 1,)
        mSeqUsedQ: cute.Tensor | None,  # (batch,)
        mSeqUsedK: cute.Tensor | None,  # (batch,) seqused_k / cache_seqlens
        mBatchIdx: cute.Tensor | None,  # (batch,) cache_batch_idx
        mPageTable: cute.Tensor | None,  # (batch, max_pages)
        total_q: Int32,
        total_k: Int32,  # < 0: cu_seqlens_k's last entry is free (paged)
        capacity: Int32,  # keys a row can hold (S_cache, max_pages * page_size, or total_k)
        max_q: Int32,
        max_k: Int32,
        batch_cache: Int32,
        page_size: Int32,
        num_pages: Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(
            mFlags, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mBatchIdx, mPageTable,
            total_q, total_k, capacity, max_q, max_k, batch_cache, page_size, num_pages,
        ).launch(grid=[mFlags.shape[0], 1, 1], block=[32, 1, 1], stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mFlags: cute.Tensor,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mBatchIdx: cute.Tensor | None,
        mPageTable: cute.Tensor | None,
        total_q: Int32,
        total_k: Int32,
        capacity: Int32,
        max_q: Int32,
        max_k: Int32,
        batch_cache: Int32,
        page_size: Int32,
        num_pages: Int32,
    ):
        lane = cute.arch.thread_idx()[0]
        b = cute.arch.block_idx()[0]
        flags, bad_pages = self.row_flags(
            b, lane, 32, mFlags.shape[0] - 1, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
            mBatchIdx, mPageTable, total_q, total_k, capacity, max_q, max_k, batch_cache,
            page_size, num_pages,
        )  # fmt: skip
        if cutlass.const_expr(self.paged):
            if cute.arch.vote_any_sync(bad_pages != 0):
                flags = flags | BAD_PAGE
        if lane == 0:
            mFlags[b] = flags

    @cute.jit
    def row_flags(
        self,
        b: Int32,
        first_page: Int32,
        page_step: int,
        last: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mBatchIdx: cute.Tensor | None,
        mPageTable: cute.Tensor | None,
        total_q: Int32,
        total_k: Int32,
        capacity: Int32,
        max_q: Int32,
        max_k: Int32,
        batch_cache: Int32,
        page_size: Int32,
        num_pages: Int32,
    ):
        """(flags of batch row b but BAD_PAGE, nonzero if a used page-table entry this caller
        reads is bad): the kernel's lanes read used pages first_page, first_page + 32, ...
        and vote; one caller with (0, 1) reads them all (the CPU tests run it on the host).
        `last`: the last batch row."""
        flags = Int32(0)
        span_q = Int32(0)
        if cutlass.const_expr(self.cu_seqlens_q):
            span_q, bad_q = self._cu_seqlens_flags(mCuSeqlensQ, b, last, total_q, max_q, BAD_CU_Q)
            flags = flags | bad_q
        # every row full unless lengths say otherwise (a KV-cache call with an int
        # cache_seqlens passes that length as the capacity)
        length_k = capacity
        if cutlass.const_expr(self.cu_seqlens_k):
            length_k, bad_k = self._cu_seqlens_flags(mCuSeqlensK, b, last, total_k, max_k, BAD_CU_K)
            flags = flags | bad_k
            if cutlass.const_expr(self.paged):
                flags = flags | self._flag(length_k > capacity, BAD_CU_K)
        if cutlass.const_expr(self.seqused_q):
            used = mSeqUsedQ[b]
            flags = flags | self._flag((used < 0) | (used > span_q), BAD_USED_Q)
        if cutlass.const_expr(self.seqused_k):
            used = mSeqUsedK[b]
            flags = flags | self._flag((used < 0) | (used > length_k), BAD_LENGTH)
            if cutlass.const_expr(not self.cu_seqlens_k):
                flags = flags | self._flag(used > max_k, BAD_LENGTH)
            length_k = used
        if cutlass.const_expr(self.batch_idx):
            row = mBatchIdx[b]
            flags = flags | self._flag((row < 0) | (row >= batch_cache), BAD_BATCH_IDX)
        bad = Int32(0)
        if cutlass.const_expr(self.paged):
            used_pages = cute.ceil_div(cutlass.min(cutlass.max(length_k, 0), capacity), page_size)
            for j in cutlass.range(first_page, used_pages, page_step, unroll=1):
                page = mPageTable[b, j]
                bad = bad | self._flag((page < 0) | (page >= num_pages), 1)
        return flags, bad

    @cute.jit
    def _cu_seqlens_flags(
        self, mCu: cute.Tensor, b: Int32, last: Int32, total: Int32, max_len: Int32, bit: int
    ):
        """(span of row b, `bit` if cu_seqlens breaks a rule there): nondecreasing, first entry
        0, last entry `total` (free when total < 0), no span longer than max_len."""
        start, end = mCu[b], mCu[b + 1]
        span = end - start
        bad = self._flag(span < 0, bit) | self._flag(span > max_len, bit)
        bad = bad | self._flag((b == 0) & (start != 0), bit)
        bad = bad | self._flag((b == last) & (total >= 0) & (end != total), bit)
        return span, bad

    @cute.jit
    def _flag(self, cond, bit: int) -> Int32:
        return cutlass.select_(cond, Int32(bit), Int32(0))


__all__ = [
    "IndexCheck", "BAD_LENGTH", "BAD_BATCH_IDX", "BAD_PAGE", "BAD_CU_Q", "BAD_CU_K", "BAD_USED_Q"
]  # fmt: skip
