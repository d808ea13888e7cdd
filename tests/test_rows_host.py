"""Where the forward's rows come from and land, run on the CPU (host_jit.py).

* `SeqInfo` over packed sequences (cu_seqlens_q, seqused_q) and `layout.pack_gqa_rows`,
  through the same views the kernel's loads and stores take (`rows_q` for Q and split
  partials, `seqlen.ragged_rows` + `ragged_rows_q` for the O store, `first_row` for lse):
  a marker written through every row a CTA of sequence b and (KV) head g owns (its
  `num_rows`) must sit at the position and query head the contract says (row r + G x i:
  query head g x G + r, position cu_seqlens_q[b] + i), no row written twice and nothing
  outside the sequences' used rows touched. The same markers also go through the query
  tiles the kernel walks (tiles of FlashFwdSm90.tile_rows rows: G x floor(64 / G) where G
  does not divide 64, padded tiles) as Q's TMA tile and the split partials' per-row stores
  index them.
* `SeqInfo.create` on valid and on bad index values (negative, decreasing, past the
  tensors): offsets and lengths stay inside the tensors (the host checks values only after
  the launch), and valid values pass unchanged.
"""

# no `from __future__ import annotations`: the DSL reads the host function's annotations
import functools

import pytest
import torch
from host_jit import int32, sm90_dsl


@functools.cache
def _rows_fn():
    sm90_dsl()
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from cute_attn.arch.common.features import InputFeatures
    from cute_attn.arch.common.layout import pack_gqa_rows, select_modes
    from cute_attn.arch.common.seqlen import SeqInfo, ragged_rows

    @cute.jit
    def write_rows(
        mQ: cute.Tensor,  # (1, total, H, D) fp32 zeros: marked through rows_q (loads)
        mO: cute.Tensor,  # (1, total, H, D) fp32 zeros: marked through the ragged store view
        mLSE: cute.Tensor,  # (1, H, total) fp32 zeros: marked at first_row() + row
        mCuSeqlensQ: cute.Tensor,
        mSeqUsedQ: cute.Tensor,
        group: cutlass.Constexpr[int],
        used: cutlass.Constexpr[bool],
        tile_rows: cutlass.Constexpr[int],
    ):
        feats = InputFeatures(cu_seqlens_q=True, cu_seqlens_k=True, seqused_q=used)
        q, o = [select_modes(t, [1, 3, 2, 0]) for t in (mQ, mO)]
        lse = select_modes(mLSE, [2, 1, 0])
        if cutlass.const_expr(group > 1):
            q, o = [pack_gqa_rows(t, group, 2) for t in (q, o)]
            lse = pack_gqa_rows(lse, group, 1)
        positions = q.shape[0][1] if cutlass.const_expr(group > 1) else q.shape[0]
        o_ragged = ragged_rows(o)
        for b in cutlass.range(mCuSeqlensQ.shape[0] - 1, unroll=1):
            seq = SeqInfo.create(
                feats, b, positions, Int32(1), mCuSeqlensQ, mCuSeqlensQ,
                mSeqUsedQ if cutlass.const_expr(used) else None, None, None,
                rows_per_query=group,
            )  # fmt: skip
            for g in cutlass.range(cute.size(q.shape[2]), unroll=1):
                rows_q = seq.rows_q(q[None, None, g, seq.q_batch])
                rows_o = seq.ragged_rows_q(o_ragged, g)
                for r in cutlass.range(seq.num_rows(), unroll=1):
                    # marker: 1 + b * 2^16 + g * 2^10 + row (exact in fp32)
                    mark = Float32(1 + b * 65536 + g * 1024 + r)
                    rows_q[r, 0] = rows_q[r, 0] + mark
                    rows_o[r, 1] = rows_o[r, 1] + mark
                    lse[seq.first_row() + r, g, 0] = lse[seq.first_row() + r, g, 0] + mark
                # tile by tile: Q's tile (column 2) and a partial's row by flat index (column 3)
                for m in cutlass.range(cute.ceil_div(seq.num_rows(), tile_rows), unroll=1):
                    gQ = cute.local_tile(rows_q, (tile_rows, q.shape[1]), (m, 0))
                    for r in cutlass.range(tile_rows, unroll=1):
                        row = m * tile_rows + r
                        if row < seq.num_rows():
                            mark = Float32(1 + b * 65536 + g * 1024 + row)
                            gQ[r, 2] = gQ[r, 2] + mark
                            o_row = seq.rows_q(o[None, None, g, seq.q_batch])[row, None]
                            o_row[3] = o_row[3] + mark

    return write_rows


def _expected(lens, used, h, group):
    """(total, H) fp32 markers where each row should land, zero elsewhere."""
    want = torch.zeros(sum(lens), h)
    start = 0
    for b, (n, u) in enumerate(zip(lens, used)):
        for g in range(h // group):
            for row in range(u * group):
                pos, head = start + row // group, g * group + row % group
                want[pos, head] = 1 + b * 65536 + g * 1024 + row
        start += n
    return want


@pytest.mark.parametrize("group", [1, 4, 8, 7, 3])  # 7, 3: padded tiles (63 rows)
@pytest.mark.parametrize("with_used", [False, True])
def test_packed_rows_land_where_the_contract_says(group, with_used):
    write_rows = _rows_fn()
    from cutlass.cute.runtime import from_dlpack

    lens = [5, 0, 1, 37, 2, 64]
    used = [3, 0, 1, 37, 0, 60] if with_used else lens
    h, d = 2 * group if 8 % group else 8, 4
    total = sum(lens)
    q = torch.zeros(1, total, h, d)
    o = torch.zeros(1, total, h, d)
    lse = torch.zeros(1, h, total)
    cu = int32([0, *torch.tensor(lens).cumsum(0).tolist()])
    seqused = int32(used)
    # dynamic 64-bit strides, as the kernel's tensors have (the ragged view's row offsets
    # pass 2^30 rows)
    q_, o_, lse_ = (from_dlpack(t).mark_layout_dynamic() for t in (q, o, lse))
    from cute_attn.arch.sm90.tile_config import packed_tile_rows

    tile_rows = packed_tile_rows(64, group)  # FlashFwdSm90.tile_rows of the 64-row tile
    write_rows(q_, o_, lse_, from_dlpack(cu), from_dlpack(seqused), group, with_used, tile_rows)
    want = _expected(lens, used, h, group)
    for name, got in (("q", q[0, :, :, 0]), ("o", o[0, :, :, 1]), ("lse", lse[0].T),
                      ("q tiles", q[0, :, :, 2]), ("o rows", o[0, :, :, 3])):  # fmt: skip
        assert torch.equal(got, want), (name, (got - want).nonzero()[:8])
    # nothing else written: the other columns of q / o stay zero
    assert not q[..., 1].any() and not q[..., 3].any() and not o[..., 0].any()
    assert not o[..., 2].any()


@functools.cache
def _seqinfo_fn(features):
    """(offset_q, seqlen_q, offset_k, seqlen_k, q_batch, kv_batch) of SeqInfo.create per
    batch row, for one static InputFeatures."""
    sm90_dsl()
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from cute_attn.arch.common.seqlen import SeqInfo

    @cute.jit
    def fields(
        mOut: cute.Tensor,  # (batch, 6) int32
        total_q: Int32,
        total_k: Int32,
        kv_rows: Int32,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mSeqUsedQ: cute.Tensor,
        mSeqUsedK: cute.Tensor,
        mKvBatchIdx: cute.Tensor,
    ):
        f = features
        for b in cutlass.range(mOut.shape[0], unroll=1):
            seq = SeqInfo.create(
                f, b, total_q, total_k,
                mCuSeqlensQ if cutlass.const_expr(f.cu_seqlens_q) else None,
                mCuSeqlensK if cutlass.const_expr(f.cu_seqlens_k) else None,
                mSeqUsedQ if cutlass.const_expr(f.seqused_q) else None,
                mSeqUsedK if cutlass.const_expr(f.seqused_k) else None,
                mKvBatchIdx if cutlass.const_expr(f.kv_batch_idx) else None,
                kv_rows,
            )  # fmt: skip
            for i, v in enumerate((seq.offset_q, seq.seqlen_q, seq.offset_k, seq.seqlen_k,
                                   seq.q_batch, seq.kv_batch)):  # fmt: skip
                mOut[b, i] = v

    return fields


@pytest.mark.parametrize("bad", [False, True])
@pytest.mark.parametrize("layout", ["varlen", "varlen_used", "cache", "ragged_cache"])
def test_seqinfo_keeps_every_row_inside_the_tensors(layout, bad):
    # SeqInfo.create clamps offsets and lengths into the tensors, because the host may check
    # index values only after the launch (ValueCheck.defer): a bad value must not move a load
    # or the ragged O store outside them. Valid values pass unchanged.
    from cute_attn.arch.common.features import InputFeatures

    feats = {
        "varlen": InputFeatures(cu_seqlens_q=True, cu_seqlens_k=True),
        "varlen_used": InputFeatures(
            cu_seqlens_q=True, cu_seqlens_k=True, seqused_q=True, seqused_k=True
        ),  # fmt: skip
        "cache": InputFeatures(seqused_k=True, kv_batch_idx=True),
        "ragged_cache": InputFeatures(seqused_k=True, kv_batch_idx=True, ragged_cache=True),
    }[layout]
    fields = _seqinfo_fn(feats)
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    total_q, total_k, kv_rows = 40, 90, 3  # packed rows; a cache's capacity and its rows
    if bad:  # out of range, decreasing, negative
        cu_q, cu_k = int32([5, -3, 60, 20, 41]), int32([0, 100, 7, -1, 95])
        used_q, used_k, idx = int32([7, -2, 50, 3]), int32([-5, 200, 4, 1]), int32(
            [-4, 1, 3, 10**6])  # fmt: skip
    else:
        cu_q, cu_k = int32([0, 3, 10, 10, 40]), int32([0, 20, 21, 60, 90])
        used_q, used_k, idx = int32([2, 7, 0, 29]), int32([20, 1, 39, 15]), int32(
            [2, 0, 1, 2])  # fmt: skip
    out = torch.full((4, 6), -99, dtype=torch.int32)
    fields(from_dlpack(out), Int32(total_q), Int32(total_k), Int32(kv_rows), *(
        from_dlpack(t) for t in (cu_q, cu_k, used_q, used_k, idx)))  # fmt: skip
    for b, (off_q, len_q, off_k, len_k, q_batch, kv_batch) in enumerate(out.tolist()):
        where = (layout, bad, b, out[b].tolist())
        if feats.cu_seqlens_q:
            assert 0 <= off_q and 0 <= len_q and off_q + len_q <= total_q, where
            assert q_batch == 0 and kv_batch == 0, where
        else:
            assert (off_q, len_q, q_batch) == (0, total_q, b), where
        if feats.cu_seqlens_k:
            assert 0 <= off_k and 0 <= len_k and off_k + len_k <= total_k, where
        elif feats.ragged_cache:  # row kv_batch's keys start at kv_batch x capacity, clamped
            assert off_k == min(max(int(idx[b]), 0), kv_rows - 1) * total_k, where
            assert 0 <= len_k <= total_k, where
        else:
            assert off_k == 0 and 0 <= len_k <= total_k and kv_batch == int(idx[b]), where
        if not bad:  # valid values pass unchanged
            if feats.cu_seqlens_q:
                want_q = int(cu_q[b + 1] - cu_q[b])
                assert (off_q, len_q) == (int(cu_q[b]), min(want_q, int(used_q[b]))
                                          if feats.seqused_q else want_q), where  # fmt: skip
            want_k = int(used_k[b]) if feats.seqused_k else int(cu_k[b + 1] - cu_k[b])
            if feats.cu_seqlens_k:
                want_k = min(want_k, int(cu_k[b + 1] - cu_k[b]))
            assert len_k == want_k, where
