"""Per-batch sequence geometry of one CTA: where its query and key rows start and how many
there are, for dense, packed (varlen), KV-cache (seqused_k, cache_batch_idx), paged and split-KV
inputs.

Which inputs exist is static (`features.InputFeatures`, part of the compile key); their values are
runtime tensors read once at the start of the CTA. Packed tensors reach the kernel with a unit
batch mode (the host unsqueezes them), so every tensor is (seq, dim, head, batch) inside and a
sequence is a `domain_offset` along seq: the TMA coordinate tensors offset the same way.

Rows past a sequence's end inside a tile belong to the next packed sequence (or to stale cache
rows): loads may read them, the mask hides them from the scores, and stores never write them.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .dsl import DslStruct

# `ragged_rows`: the seq extent the TMA sees (rows at or past it are clipped on store) and the
# extent of the mode that carries each sequence's end; both inside the TMA's 32-bit box ranges
RAGGED_EXTENT = 1 << 30
RAGGED_ENDS = (1 << 31) - 1


def ragged_rows(t: cute.Tensor) -> cute.Tensor:
    """A view of packed t (seq, dim, head, 1) for a TMA store that stops at each sequence's
    end (FA4 / quack build the same view): seq extent RAGGED_EXTENT, the pointer moved back by
    RAGGED_EXTENT rows, and the unit batch mode replaced by one of the seq stride. Element
    (RAGGED_EXTENT - L + i, d, h, o + L) is then row o + i of t, and the TMA clips every
    i >= L (`SeqInfo.ragged_rows_q` takes that view of one sequence). Packed GQA rows
    ((G, seq), dim, kv head, 1) keep their query-head mode: only the seq part is ragged."""
    nested = isinstance(t.shape[0], tuple)  # packed GQA rows (layout.pack_gqa_rows)
    s_seq = t.stride[0][1] if nested else t.stride[0]
    shifted = cute.domain_offset((_seq_coord(-RAGGED_EXTENT, nested), 0, 0, 0), t).iterator
    # the two extents as runtime values: as constants the layout's static size (~2^73)
    # overflows inside the DSL's layout algebra (a C++ bad_variant_access abort)
    extent = Int32(RAGGED_EXTENT)
    layout = cute.make_layout(
        ((t.shape[0][0], extent) if nested else extent, t.shape[1], t.shape[2],
         Int32(RAGGED_ENDS)),
        stride=(t.stride[0], t.stride[1], t.stride[2], s_seq),
    )  # fmt: skip
    return cute.make_tensor(shifted, layout)


def _seq_coord(position, nested: bool):
    """The row-mode coordinate of a query position: itself, or (0, position) in packed GQA
    rows ((G, seq)), query head 0 of the group."""
    return (0, position) if nested else position


@cute.jit
def _clamp(x: Int32, lo: Int32, hi: Int32) -> Int32:
    return cutlass.min(cutlass.max(x, lo), hi)


class SeqInfo(DslStruct):
    _dynamic_ = ("offset_q", "seqlen_q", "offset_k", "seqlen_k", "q_batch", "kv_batch")

    def __init__(
        self, offset_q, seqlen_q, offset_k, seqlen_k, q_batch, kv_batch, features,
        rows_per_query=1,
    ):  # fmt: skip
        # queries (positions); under packed GQA each is rows_per_query (G) rows of the tile,
        # query head r of the group at row r + G x position (`num_rows`, `first_row`)
        self.offset_q = offset_q
        self.seqlen_q = seqlen_q
        self.offset_k = offset_k
        self.seqlen_k = seqlen_k
        self.q_batch = q_batch  # batch coordinate of q / out (0 when packed)
        # batch coordinate of k / v (0 when packed); paged: the row of the page table
        self.kv_batch = kv_batch
        self.features = features
        self.rows_per_query = rows_per_query

    @staticmethod
    @cute.jit
    def create(
        features: cutlass.Constexpr,
        batch: Int32,
        seqlen_q_static: Int32,
        seqlen_k_static: Int32,
        mCuSeqlensQ,
        mCuSeqlensK,
        mSeqUsedQ,
        mSeqUsedK,
        mKvBatchIdx,
        kv_rows: Int32 | None = None,
        rows_per_query: cutlass.Constexpr[int] = 1,
    ):
        # Offsets and lengths are clamped into the tensors (packed q: [0, total_q]; packed k:
        # [0, total_k]; paged or cached keys: [0, capacity]): the host may check index values
        # only after this launch (cute_attn.validation.ValueCheck.defer), so a bad value must
        # not move a load, and above all the ragged O store, outside the tensors. Valid values
        # pass unchanged.
        offset_q, seqlen_q, q_batch = Int32(0), Int32(seqlen_q_static), batch
        if cutlass.const_expr(features.cu_seqlens_q):
            offset_q = _clamp(mCuSeqlensQ[batch], Int32(0), seqlen_q_static)
            seqlen_q = _clamp(mCuSeqlensQ[batch + 1], offset_q, seqlen_q_static) - offset_q
            q_batch = Int32(0)
        if cutlass.const_expr(features.seqused_q):
            seqlen_q = _clamp(mSeqUsedQ[batch], Int32(0), seqlen_q)
        offset_k, seqlen_k, kv_batch = Int32(0), Int32(seqlen_k_static), batch
        if cutlass.const_expr(features.kv_batch_idx):
            kv_batch = mKvBatchIdx[batch]  # out of range: TMA fills zeros, never faults
        if cutlass.const_expr(features.cu_seqlens_k):
            if cutlass.const_expr(features.paged_kv):
                # the pages say where keys live: only the span counts
                span = mCuSeqlensK[batch + 1] - mCuSeqlensK[batch]
                seqlen_k = _clamp(span, Int32(0), seqlen_k_static)
            else:
                offset_k = _clamp(mCuSeqlensK[batch], Int32(0), seqlen_k_static)
                seqlen_k = _clamp(mCuSeqlensK[batch + 1], offset_k, seqlen_k_static) - offset_k
                kv_batch = Int32(0)
        if cutlass.const_expr(features.seqused_k):
            seqlen_k = _clamp(mSeqUsedK[batch], Int32(0), seqlen_k)
        if cutlass.const_expr(features.ragged_cache):
            # row kv_batch's keys in the flat rows of the cache (kv_rows = B_cache rows of
            # capacity seqlen_k_static); an out-of-range kv_batch_idx value is clamped like the
            # packed offsets (the ragged view has no batch bound for the TMA to stop at)
            offset_k = _clamp(kv_batch, Int32(0), kv_rows - 1) * seqlen_k_static
        return SeqInfo(
            offset_q, seqlen_q, offset_k, seqlen_k, q_batch, kv_batch, features, rows_per_query
        )

    def num_rows(self) -> Int32:
        """This sequence's rows of q / out / lse: its queries, G each under packed GQA."""
        if cutlass.const_expr(self.rows_per_query == 1):
            return self.seqlen_q
        return self.seqlen_q * self.rows_per_query

    def first_row(self) -> Int32:
        """Where this sequence's rows start in the flat row index of q / out / lse."""
        if cutlass.const_expr(self.rows_per_query == 1):
            return self.offset_q
        return self.offset_q * self.rows_per_query

    def rows_q(self, t: cute.Tensor) -> cute.Tensor:
        """(seq, dim) view of one head of q / out starting at this sequence's first row."""
        if cutlass.const_expr(self.features.cu_seqlens_q):
            nested = self.rows_per_query > 1
            return cute.domain_offset((_seq_coord(self.offset_q, nested), 0), t)
        return t

    def ragged_rows_q(self, t: cute.Tensor, head: Int32) -> cute.Tensor:
        """(seq, dim) view of one head of `ragged_rows(out)` (or its TMA coordinates) whose
        row i is this sequence's row i, clipped by the TMA from row seqlen_q on."""
        ends = t[None, None, head, self.offset_q + self.seqlen_q]
        nested = self.rows_per_query > 1
        return cute.domain_offset((_seq_coord(RAGGED_EXTENT - self.seqlen_q, nested), 0), ends)

    def rows_k(self, t: cute.Tensor) -> cute.Tensor:
        if cutlass.const_expr(self.features.cu_seqlens_k and not self.features.paged_kv):
            return cute.domain_offset((self.offset_k, 0), t)
        return t

    def ragged_rows_k(self, t: cute.Tensor, head: Int32) -> cute.Tensor:
        """`ragged_rows_q` for packed k-side rows (the backward's dK / dV; the forward's V,
        also of a `ragged_cache`): row i is this sequence's key row i, clipped by the TMA from
        row seqlen_k on."""
        ends = t[None, None, head, self.offset_k + self.seqlen_k]
        return cute.domain_offset((RAGGED_EXTENT - self.seqlen_k, 0), ends)


@cute.jit
def padded_row_offset(offset: Int32, batch: Int32, tile: cutlass.Constexpr[int]) -> Int32:
    """Where sequence `batch` (packed from row `offset`) starts in a per-row buffer in which
    every sequence starts on a multiple of `tile` and owns ceil(seqlen / tile) whole tiles:
    the backward's lse_log2, D and dQ accumulator under packed q (FA3 pads them the same way),
    so a tile-sized TMA load or reduce-add never touches another sequence's rows. Sequence b
    gets floor((offset + b * tile) / tile) * tile; consecutive starts differ by at least
    floor(seqlen / tile) + 1 tiles, and every row lies below total + batches * tile."""
    return (offset + batch * tile) // tile * tile
