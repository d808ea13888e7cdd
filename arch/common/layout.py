"""Register-layout views of wgmma accumulators.

An SM90 wgmma accumulator fragment per thread has layout ((2, 2, N/8), MMA_M, MMA_N): the
inner mode is (column pair, row half, column group of 8). Softmax wants rows and columns
separately, and the P @ V GEMM wants the same registers in the A-operand layout of a 16-bit
RS wgmma. Both are pure re-views (no data movement); they are layout algebra done at trace time.
"""

from __future__ import annotations

import cutlass.cute as cute


def acc_rows_cols_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) -> ((2, M), (2, V, N)): mode 0 indexes rows, mode 1 columns."""
    flat = cute.make_layout(acc_layout.shape)  # column-major over the fragment's own shape
    s, d = flat.shape, flat.stride
    rows = ((s[0][1], s[1]), (d[0][1], d[1]))
    cols = ((s[0][0], *s[0][2:], s[2]), (d[0][0], *d[0][2:], d[2]))
    view = cute.make_layout((rows[0], cols[0]), stride=(rows[1], cols[1]))
    return cute.composition(acc_layout, view)


def acc_as_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """Tensor view of an accumulator (or of its coordinate partition) as (rows, cols)."""
    return cute.make_tensor(acc.iterator, acc_rows_cols_layout(acc.layout))


@cute.jit
def acc_as_operand_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) -> ((2, 2, 2), M, (V/2, N)): the 16-bit RS-wgmma A fragment.

    A k-block of 16 columns of the A operand is two consecutive 8-column groups of the
    accumulator, so the column-group mode V splits into (2, V/2) and its outer half becomes
    the k-block mode. V odd (tile_n not a multiple of 16) is rejected by the tile config.
    """
    split = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    s, d = split.shape, split.stride
    return cute.make_layout(
        ((s[0][0], s[0][1], s[0][2][0]), s[1], (s[0][2][1], s[2])),
        stride=((d[0][0], d[0][1], d[0][2][0]), d[1], (d[0][2][1], d[2])),
    )


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, acc_as_operand_a_layout(acc.layout))


def transpose_smem_view(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (possibly swizzled, staged) smem tensor."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def select_modes(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, modes))


def pack_gqa_rows(t: cute.Tensor, group: int, head_mode: int) -> cute.Tensor:
    """The packed-GQA view of t (seq, ..., heads, ...) (features.InputFeatures.pack_gqa): mode
    0 becomes the rows ((group, seq)) of one KV head's `group` query heads, row r + group * i
    at query head kv_head * group + r and position i, and the head mode walks KV heads
    (heads / group, stride group x the head stride). Two strides in one row mode: TMA boxes
    and partitions take it as two dimensions, so a tile's rows need group | tile_m (whole
    positions) or tile_m | group (whole tiles of one position's heads)."""
    shape, stride = list(t.shape), list(t.stride)
    s_head = stride[head_mode]
    shape[0], stride[0] = (group, shape[0]), (s_head, stride[0])
    shape[head_mode], stride[head_mode] = shape[head_mode] // group, s_head * group
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))


__all__ = [
    "acc_rows_cols_layout",
    "acc_as_rows_cols",
    "acc_as_operand_a",
    "acc_as_operand_a_layout",
    "transpose_smem_view",
    "select_modes",
    "pack_gqa_rows",
]
