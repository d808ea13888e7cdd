"""Where the forward's query rows land, run on the CPU (host_jit.py): `SeqInfo` over packed
sequences (cu_seqlens_q, seqused_q) and `layout.pack_gqa_rows`, through the same views the
kernel's loads and stores take (`rows_q` for Q and split partials, `seqlen.ragged_rows` +
`ragged_rows_q` for the O store, `first_row` for lse).

Each host call writes a marker through every row a CTA of sequence b and (KV) head g owns
(its `num_rows`); the test checks that each marker sits at the position and query head the
contract says (row r + G x i: query head g x G + r, position cu_seqlens_q[b] + i), that no
row is written twice and that nothing outside the sequences' used rows is touched.
"""

# no `from __future__ import annotations`: the DSL reads the host function's annotations
import functools

import pytest
import torch
from host_jit import sm90_dsl


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


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("with_used", [False, True])
def test_packed_rows_land_where_the_contract_says(group, with_used):
    write_rows = _rows_fn()
    from cutlass.cute.runtime import from_dlpack

    lens = [5, 0, 1, 37, 2, 64]
    used = [3, 0, 1, 37, 0, 60] if with_used else lens
    h, d = 8, 4
    total = sum(lens)
    q = torch.zeros(1, total, h, d)
    o = torch.zeros(1, total, h, d)
    lse = torch.zeros(1, h, total)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seqused = torch.tensor(used, dtype=torch.int32)
    # dynamic 64-bit strides, as the kernel's tensors have (the ragged view's row offsets
    # pass 2^30 rows)
    q_, o_, lse_ = (from_dlpack(t).mark_layout_dynamic() for t in (q, o, lse))
    write_rows(q_, o_, lse_, from_dlpack(cu), from_dlpack(seqused), group, with_used)
    want = _expected(lens, used, h, group)
    assert torch.equal(q[0, :, :, 0], want), (q[0, :, :, 0] - want).nonzero()[:8]
    assert torch.equal(o[0, :, :, 1], want), (o[0, :, :, 1] - want).nonzero()[:8]
    assert torch.equal(lse[0].T, want), (lse[0].T - want).nonzero()[:8]
    # nothing else written: the other columns of q / o stay zero
    assert not q[..., 1:].any() and not o[..., 0].any() and not o[..., 2:].any()
