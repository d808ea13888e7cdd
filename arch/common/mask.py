"""The score transforms applied to a tile in registers before the softmax (softcap, then the
attention mask), and the tile ranges the mask leaves visible.

One rule, the package contract (cute_attn.reference.visible_mask is its PyTorch twin): with
offset = seqlen_k - seqlen_q (bottom-right alignment), key j is visible to query i iff
    j < seqlen_k
    and (no left bound  or j >= i + offset - window_left)
    and (no right bound or j <= i + offset + window_right).
Causal is window_right = 0 (folded in by the host). Which bounds exist is compile-time
(`has_left`, `has_right`); their values are runtime Int32 so windows never recompile.

Under packed GQA (features.InputFeatures.pack_gqa) a forward tile's rows are (query head,
position) pairs, G rows a position: row r is query i = r // G (`rows_per_query` = G, static),
and every bound above applies to i. The backward's ranges take one row a query.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .dsl import DslStruct
from .layout import acc_as_rows_cols


@cute.jit
def apply_softcap(acc_s: cute.Tensor, score_premul: Float32):
    """Softcap, before masking as the contract says: s <- tanh(s * scale / softcap) in place
    (score_premul = scale / softcap); the softcap factor itself is folded into the exp2 scale
    by the host (cute_attn.fwd_sm90.softmax_scales)."""
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        acc_s[i] = cute.math.tanh(acc_s[i] * score_premul, fastmath=True)


@dsl_user_op
def _shift_ones(n: Int32, left: bool, *, loc=None, ip=None) -> Uint32:
    """0xFFFFFFFF shifted by n >= 0 bits (left or right), 0 when n >= 32: PTX clamps a shift
    amount past the width, where an LLVM shift by >= 32 would be undefined."""
    op = "shl" if left else "shr"
    return Uint32(
        llvm.inline_asm(
            T.i32(),
            [Uint32(0xFFFFFFFF).ir_value(loc=loc, ip=ip), Int32(n).ir_value(loc=loc, ip=ip)],
            f"{op}.b32 $0, $1, $2;",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def _is_wgmma_columns(col_offs: list[int]) -> bool:
    """A thread's columns of an SM90 wgmma accumulator row: pairs 8 apart (0, 1, 8, 9, ...)."""
    return col_offs == [8 * (j // 2) + j % 2 for j in range(len(col_offs))]


@cute.jit
def _elements_below(t: Int32) -> Int32:
    """How many of a thread's wgmma row elements (columns 0, 1, 8, 9, ... past its first one)
    lie left of column t (relative to its first)."""
    tt = cutlass.max(t, 0)
    return (tt >> 3) * 2 + cutlass.min(tt & 7, 2)


class TileMask(DslStruct):
    _dynamic_ = ("seqlen_q", "seqlen_k", "window_left", "window_right")

    def __init__(
        self,
        tile_m: int,
        tile_n: int,
        seqlen_q: Int32,
        seqlen_k: Int32,
        window_left: Int32,
        window_right: Int32,
        has_left: bool,
        has_right: bool,
        bits: bool = False,
        rows_per_query: int = 1,
    ):
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k
        self.window_left = window_left
        self.window_right = window_right
        self.has_left = has_left
        self.has_right = has_right
        # apply() through per-row keep bits (FwdTileConfig.mask_bits)
        self.bits = bits
        # packed GQA: tile row r holds query r // rows_per_query (seqlen_q counts queries)
        self.rows_per_query = rows_per_query

    def _query(self, row: Int32) -> Int32:
        """The query (position) of tile row `row`."""
        if cutlass.const_expr(self.rows_per_query == 1):
            return row
        return row // self.rows_per_query

    def _one_row_a_query(self, what: str):
        if self.rows_per_query != 1:
            raise ValueError(f"TileMask.{what} takes one row a query (no packed GQA rows)")

    @cute.jit
    def n_block_range(self, m_block: Int32):
        """[n_min, n_max) of key tiles with at least one visible key for this query tile."""
        offset = self.seqlen_k - self.seqlen_q
        n_max = cute.ceil_div(self.seqlen_k, self.tile_n)
        if cutlass.const_expr(self.has_right):
            # the last row of the tile sees furthest right
            last_row = cutlass.min(m_block * self.tile_m + self.tile_m, self.seqlen_q) - 1
            if cutlass.const_expr(self.rows_per_query > 1):
                last_row = cutlass.min(
                    self._query(m_block * self.tile_m + self.tile_m - 1), self.seqlen_q - 1
                )
            right_edge = last_row + offset + self.window_right + 1
            n_max = cutlass.min(n_max, cute.ceil_div(cutlass.max(right_edge, 0), self.tile_n))
        n_min = Int32(0)
        if cutlass.const_expr(self.has_left):
            left_edge = self._query(m_block * self.tile_m) + offset - self.window_left
            n_min = cutlass.max(left_edge, 0) // self.tile_n
        return n_min, n_max

    @cute.jit
    def m_block_range(self, n_block: Int32):
        """[m_min, m_max) of query tiles with at least one row that sees a key of this key tile
        (the backward walks these for one K/V tile). Empty when m_max <= m_min."""
        self._one_row_a_query("m_block_range")
        offset = self.seqlen_k - self.seqlen_q
        m_max = cute.ceil_div(self.seqlen_q, self.tile_m)
        m_min = Int32(0)
        if cutlass.const_expr(self.has_right):
            # key j is visible to rows i >= j - offset - window_right; the tile's first key
            first_row = n_block * self.tile_n - offset - self.window_right
            m_min = cutlass.max(first_row, 0) // self.tile_m
        if cutlass.const_expr(self.has_left):
            # ... and to rows i <= j - offset + window_left; the tile's last key
            last_key = cutlass.min(n_block * self.tile_n + self.tile_n, self.seqlen_k) - 1
            last_row = last_key - offset + self.window_left
            m_max = cutlass.min(m_max, cute.ceil_div(cutlass.max(last_row + 1, 0), self.tile_m))
        return m_min, m_max

    @cute.jit
    def unmasked_range(self, m_block: Int32, n_lo: Int32, n_hi: Int32):
        """[a, b) within [n_lo, n_hi): the key tiles of this query tile that need no mask
        (`tile_needs_mask` is False for every tile in it: inside seqlen_k, left of the right
        bound, right of the left bound). Tiles in [b, n_hi) and [n_lo, a) may need one. The
        forward runs the three ranges as separate loops, so the unmasked one carries no mask
        code and no per-tile branch."""
        offset = self.seqlen_k - self.seqlen_q
        b = cutlass.min(n_hi, self.seqlen_k // self.tile_n)
        if cutlass.const_expr(self.has_right):
            # tile n ends at (n + 1) * tile_n - 1 <= the first row's right bound
            edge = self._query(m_block * self.tile_m) + offset + self.window_right + 1
            b = cutlass.min(b, cutlass.max(edge, 0) // self.tile_n)
        b = cutlass.max(b, n_lo)
        a = n_lo
        if cutlass.const_expr(self.has_left):
            # tile n starts at n * tile_n >= the last row's left bound
            edge = self._query(m_block * self.tile_m + self.tile_m - 1) + offset - self.window_left
            a = cutlass.min(cutlass.max(cute.ceil_div(cutlass.max(edge, 0), self.tile_n), n_lo), b)
        return a, b

    @cute.jit
    def unmasked_m_range(self, n_block: Int32, m_lo: Int32, m_hi: Int32):
        """[a, b) within [m_lo, m_hi): the query tiles that need no mask with this key tile
        (`tile_needs_mask(m, n_block)` is False for every m in it), the backward's twin of
        `unmasked_range`. Tiles in [m_lo, a) and [b, m_hi) may need one. Without a left bound
        b = m_hi; a key tile crossing seqlen_k needs the mask everywhere: a = b = m_hi."""
        self._one_row_a_query("unmasked_m_range")
        offset = self.seqlen_k - self.seqlen_q
        col_lo = n_block * self.tile_n
        col_hi = col_lo + self.tile_n - 1
        a = m_lo
        if cutlass.const_expr(self.has_right):
            # the tile's first row must see the tile's last key: m * tile_m + offset + right
            # >= col_hi
            a = cute.ceil_div(cutlass.max(col_hi - offset - self.window_right, 0), self.tile_m)
        b = m_hi
        if cutlass.const_expr(self.has_left):
            # the tile's last row must not see left of the tile's first key:
            # (m + 1) * tile_m - 1 + offset - left <= col_lo
            b = cutlass.max(col_lo - offset + self.window_left + 1, 0) // self.tile_m
        if col_hi >= self.seqlen_k:
            a = m_hi
        a = cutlass.min(cutlass.max(a, m_lo), m_hi)
        b = cutlass.max(cutlass.min(b, m_hi), a)
        return a, b

    @cute.jit
    def n_block_end_bwd(self, m_block: Int32):
        """One past the last key tile whose `m_block_range` contains m_block: the right end of
        the key tiles that add into this query tile's dQ in the backward. Unlike
        `n_block_range` it does not clip the query tile at seqlen_q, because m_block_range
        does not either (a key tile may visit a query tile whose real rows cannot see it;
        its P is 0 there), and the deterministic turn count must match that set exactly."""
        self._one_row_a_query("n_block_end_bwd")
        n_end = cute.ceil_div(self.seqlen_k, self.tile_n)
        if cutlass.const_expr(self.has_right):
            offset = self.seqlen_k - self.seqlen_q
            right_edge = m_block * self.tile_m + self.tile_m + offset + self.window_right
            n_end = cutlass.min(n_end, cute.ceil_div(cutlass.max(right_edge, 0), self.tile_n))
        return n_end

    @cute.jit
    def tile_needs_mask(self, m_block: Int32, n_block: Int32) -> cutlass.Boolean:
        """True unless every (row, col) of the tile is visible (rows past seqlen_q ignored)."""
        offset = self.seqlen_k - self.seqlen_q
        col_lo = n_block * self.tile_n
        col_hi = col_lo + self.tile_n - 1
        row_lo = m_block * self.tile_m
        row_hi = row_lo + self.tile_m - 1
        row_lo, row_hi = self._query(row_lo), self._query(row_hi)
        need = col_hi >= self.seqlen_k
        if cutlass.const_expr(self.has_right):
            need = need or col_hi > row_lo + offset + self.window_right
        if cutlass.const_expr(self.has_left):
            need = need or col_lo < row_hi + offset - self.window_left
        return need

    @cute.jit
    def apply(
        self,
        acc_s: cute.Tensor,
        coords: cute.Tensor,
        m_block: Int32,
        n_block: Int32,
        transposed: cutlass.Constexpr[bool] = False,
    ):
        """Set invisible scores of the tile to -inf. `coords` is the thread's partition of an
        identity tensor over the tile, in the accumulator's layout: (tile_m, tile_n) for S,
        or (tile_n, tile_m) for the transposed S^T the backward computes (`transposed`:
        rows are keys, columns queries). Per accumulator row the visible columns form one
        interval [lo, hi), so each element costs two compares and a select, or with `bits`
        a test of its bit in the row's keep word (`_apply_bits`).

        An element's column is the thread's first column plus a static offset (the
        partition's layout evaluated at trace time): one add an element, where reading each
        element's coordinate from `coords` traced about 17 IR ops (a fifth of a causal
        forward's IR, which ptxas turned into the same SASS)."""
        s = acc_as_rows_cols(acc_s)
        c = acc_as_rows_cols(coords)
        col_first = c[0, 0][1]  # the thread's column of element (0, 0), dynamic
        # each column's offset from it, static (a row's elements share the columns of row 0)
        cols = range(cute.size(s, mode=[1]))
        col_offs = [c.layout((0, j))[1] - c.layout((0, 0))[1] for j in cols]
        bits = self.bits and _is_wgmma_columns(col_offs)
        # without the bound that gives lo (the left one; the right one for S^T) lo = -col0
        # <= every column, so the bit form leaves it out (the compare form keeps its SASS)
        has_lo = self.has_right if cutlass.const_expr(transposed) else self.has_left
        offset = self.seqlen_k - self.seqlen_q
        col0 = m_block * self.tile_m if cutlass.const_expr(transposed) else n_block * self.tile_n
        row0 = n_block * self.tile_n if cutlass.const_expr(transposed) else m_block * self.tile_m
        if cutlass.const_expr(transposed):
            self._one_row_a_query("apply(transposed=True)")
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            row = row0 + c[r, 0][0]  # a few rows a thread: read as is
            if cutlass.const_expr(transposed):
                # key row j sees queries i in [j - offset - right, j - offset + left]
                lo = Int32(0) - col0
                if cutlass.const_expr(self.has_right):
                    lo = row - offset - self.window_right - col0
                hi = Int32(self.tile_m)
                if cutlass.const_expr(self.has_left):
                    hi = row - offset + self.window_left + 1 - col0
                # keys past seqlen_k see nothing (their K rows are TMA zero fill)
                hi = cutlass.select_(row < self.seqlen_k, hi, lo)
            else:
                # query row i sees keys j in [i + offset - left, i + offset + right], j < Sk
                row = self._query(row)
                hi = self.seqlen_k - col0
                if cutlass.const_expr(self.has_right):
                    hi = cutlass.min(hi, row + offset + self.window_right + 1 - col0)
                lo = Int32(0) - col0
                if cutlass.const_expr(self.has_left):
                    lo = row + offset - self.window_left - col0
            if cutlass.const_expr(bits):
                self._apply_bits(s, r, hi - col_first, lo - col_first, has_lo)
            else:
                for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    col = col_first + col_offs[j]
                    # a select, not a conditional store: a store under `if` into a register
                    # array made the compiler emit a select chain quadratic in the row length
                    outside = (col >= hi) | (col < lo)
                    s[r, j] = Float32(cutlass.select_(outside, -Float32.inf, s[r, j]))

    @cute.jit
    def _apply_bits(self, s: cute.Tensor, r: int, hi: Int32, lo: Int32, has_lo: bool):
        """Row r of `s` keeps the elements whose column (relative to the thread's first) lies
        in [lo, hi). Visible elements are a contiguous run of the row's element indices, so
        each 32 elements take one word of keep bits, built by a shift or two; each element
        then tests its constant bit (ptxas: R2P, 7 predicates an instruction, and an FSEL)."""
        n_cols = cute.size(s, mode=[1])
        hi_n = _elements_below(hi)
        lo_n = hi_n  # unused without a lower bound
        if cutlass.const_expr(has_lo):
            lo_n = _elements_below(lo)
        for w in cutlass.range_constexpr((n_cols + 31) // 32):
            keep = _shift_ones(cutlass.max(32 * w + 32 - hi_n, 0), left=False)
            if cutlass.const_expr(has_lo):
                keep = keep & _shift_ones(cutlass.max(lo_n - 32 * w, 0), left=True)
            for j in cutlass.range_constexpr(32 * w, min(n_cols, 32 * w + 32)):
                visible = (keep & Uint32(1 << (j - 32 * w))) != Uint32(0)
                s[r, j] = Float32(cutlass.select_(visible, s[r, j], -Float32.inf))
