"""Tests for cute_attn.reference, the semantic source of truth (CPU only, small shapes, fast).

Independent oracles: keep masks are built here from the contract formula (never by calling
visible_mask), dense results are checked against torch SDPA's math backend in float64, and a
two-tile online softmax and several masks are written out by hand.

Run: python3 -m pytest tests/test_reference.py
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cute_attn import reference
from cute_attn.problem import normalize_window
from cute_attn.reference import (
    attention_ref,
    attention_ref_backward,
    attention_ref_tiled,
    attention_ref_varlen,
    key_block_range,
    repeat_kv,
    visible_mask,
)

F64 = torch.float64


# --------------------------------------------------------------------------------------------
# independent helpers
# --------------------------------------------------------------------------------------------


def keep_formula(sq, sk, causal=False, window=(None, None)):
    """Keep mask straight from the contract, element by element (no normalize_window)."""
    left, right = window
    off = sk - sq
    keep = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            ok = True
            if causal and j > i + off:
                ok = False
            if left is not None and left >= 0 and j < i + off - left:
                ok = False
            if right is not None and right >= 0 and j > i + off + right:
                ok = False
            keep[i, j] = ok
    return keep


def grid(rows):
    return torch.tensor([[c == "1" for c in r] for r in rows], dtype=torch.bool)


def rand_qkv(b, sq, sk, h, hkv, d, dv=None, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(b, sq, h, d, generator=g, dtype=F64).to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=g, dtype=F64).to(dtype)
    v = torch.randn(b, sk, hkv, dv, generator=g, dtype=F64).to(dtype)
    return q, k, v


def sdpa(q, k, v, keep, scale):
    """torch SDPA (math backend) with a boolean KEEP mask; K/V heads repeated for GQA."""
    h = q.shape[2]
    kr = k.repeat_interleave(h // k.shape[2], dim=2)
    vr = v.repeat_interleave(h // v.shape[2], dim=2)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), attn_mask=keep, scale=scale
        )
    return out.transpose(1, 2)


# --------------------------------------------------------------------------------------------
# the mask rule
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sq,sk,expected",
    [
        # Sk > Sq: the diagonal starts Sk - Sq = 3 columns in (bottom-right aligned).
        (2, 5, ["11110", "11111"]),
        # Sk < Sq: the first Sq - Sk = 3 rows see nothing.
        (5, 2, ["00", "00", "00", "10", "11"]),
        (4, 4, ["1000", "1100", "1110", "1111"]),
    ],
)
def test_causal_corner_grids(sq, sk, expected):
    assert torch.equal(visible_mask(sq, sk, -1, 0), grid(expected))
    assert torch.equal(keep_formula(sq, sk, causal=True), grid(expected))


@pytest.mark.parametrize(
    "sq,sk,left,right,expected",
    [
        # off = 2: row i keeps [i + 1, i + 3]
        (4, 6, 1, 1, ["011100", "001110", "000111", "000011"]),
        # left only: row i keeps j >= i + 2 - 1
        (4, 6, 1, -1, ["011111", "001111", "000111", "000011"]),
        # right only (a look-ahead of 1 past the diagonal)
        (4, 6, -1, 1, ["111100", "111110", "111111", "111111"]),
        # left 0 right 0: only the aligned diagonal
        (3, 3, 0, 0, ["100", "010", "001"]),
        # Sk < Sq with a window: row i keeps [i - 2 - 1, i - 2]
        (4, 2, 1, 0, ["00", "00", "10", "11"]),
    ],
)
def test_window_grids(sq, sk, left, right, expected):
    assert torch.equal(visible_mask(sq, sk, left, right), grid(expected))


def test_visible_mask_matches_formula_and_blocks():
    for sq, sk in [(1, 1), (3, 7), (7, 3), (6, 6), (0, 4), (4, 0)]:
        for causal, window in [
            (False, (None, None)),
            (True, (None, None)),
            (False, (2, 1)),
            (True, (1, 3)),  # causal intersects the right bound -> 0
            (False, (0, None)),
            (True, (-1, -1)),
        ]:
            left, right = normalize_window(causal, window)
            full = visible_mask(sq, sk, left, right)
            assert torch.equal(full, keep_formula(sq, sk, causal, window))
            for q_offset in range(sq):
                for q_len in range(sq - q_offset + 1):
                    blk = visible_mask(sq, sk, left, right, q_offset=q_offset, q_len=q_len)
                    assert torch.equal(blk, full[q_offset : q_offset + q_len])


def test_key_block_range_is_exact():
    # A tile is in the range iff it holds at least one visible key, for every query tile.
    for sq, sk in [(7, 13), (13, 7), (16, 16), (5, 2)]:
        for left, right in [(-1, -1), (-1, 0), (3, 0), (2, 4), (0, -1), (0, 0)]:
            mask = visible_mask(sq, sk, left, right)
            for bm in (1, 3, 4):
                for bn in (1, 2, 5):
                    for m0 in range(0, sq, bm):
                        m1 = min(sq, m0 + bm)
                        lo, hi = key_block_range(m0, m1, sq, sk, left, right, bn)
                        for nt in range(-(-sk // bn)):
                            has = bool(mask[m0:m1, nt * bn : (nt + 1) * bn].any())
                            assert has == (lo <= nt < hi), (sq, sk, left, right, bm, bn, m0, nt)


def test_sdpa_bool_mask_is_a_keep_mask():
    # SDPA's boolean attn_mask means True = attend (a KEEP mask), the same meaning as
    # visible_mask. A key-padding mask (True = ignore) must be inverted before passing it.
    q, k, v = rand_qkv(1, 3, 4, 1, 1, 4)
    scale = 0.5
    keep = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    with sdpa_kernel(SDPBackend.MATH):
        got = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep, scale=scale
        ).transpose(1, 2)
    s = (q[0, :, 0] @ k[0, :, 0].T) * scale
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
    assert torch.allclose(got[0, :, 0], p @ v[0, :, 0], atol=1e-12)
    # Passing the padding meaning (True = masked out) attends to the complement instead.
    pad = ~keep
    p_wrong = torch.softmax(s.masked_fill(~pad, float("-inf")), dim=-1)
    with sdpa_kernel(SDPBackend.MATH):
        got_pad = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=pad, scale=scale
        ).transpose(1, 2)
    assert torch.allclose(got_pad[0, :, 0], p_wrong @ v[0, :, 0], atol=1e-12)
    assert not torch.allclose(got_pad, got)


# --------------------------------------------------------------------------------------------
# dense reference vs SDPA and hand-computed cases
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sq,sk,h,hkv,causal,window",
    [
        (6, 6, 2, 2, False, (None, None)),
        (6, 6, 2, 2, True, (None, None)),
        (4, 9, 4, 2, True, (None, None)),
        (9, 4, 4, 1, True, (None, None)),  # MQA, first rows fully masked
        (7, 11, 6, 2, False, (3, 2)),
        (11, 7, 6, 3, True, (2, None)),
        (8, 8, 2, 1, False, (0, None)),
        (5, 8, 3, 1, False, (None, 1)),
    ],
)
def test_ref_matches_sdpa_fp64(sq, sk, h, hkv, causal, window):
    q, k, v = rand_qkv(2, sq, sk, h, hkv, 8, dv=5)
    scale = 0.3
    keep = keep_formula(sq, sk, causal, window)
    out, lse = attention_ref(
        q, k, v, softmax_scale=scale, causal=causal, window_size=window, compute_dtype=F64
    )
    assert out.dtype == F64 and lse.dtype == F64
    assert out.shape == (2, sq, h, 5) and lse.shape == (2, h, sq)
    rows = keep.any(dim=1)
    expected = sdpa(q, k, v, keep, scale)
    assert torch.allclose(out[:, rows], expected[:, rows], atol=1e-12, rtol=0)
    assert torch.all(out[:, ~rows] == 0)
    # lse: natural-log logsumexp of the scaled, masked scores, with the GQA head mapping.
    kr = repeat_kv(k, h)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    ref_lse = torch.logsumexp(s.masked_fill(~keep, float("-inf")), dim=-1)
    assert torch.allclose(lse[..., rows], ref_lse[..., rows], atol=1e-12, rtol=0)
    assert torch.all(torch.isneginf(lse[..., ~rows]))


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = rand_qkv(1, 3, 5, 2, 2, 16)
    out, _ = attention_ref(q, k, v, compute_dtype=F64)
    exp, _ = attention_ref(q, k, v, softmax_scale=0.25, compute_dtype=F64)
    assert torch.equal(out, exp)


def test_two_tile_online_softmax_by_hand():
    # One query, four keys in two tiles of two; scale 1, D = 1: scores are k itself.
    q = torch.tensor([1.0], dtype=F64).view(1, 1, 1, 1)
    k = torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=F64).view(1, 4, 1, 1)
    v = torch.tensor([10.0, 20.0, 30.0, 40.0], dtype=F64).view(1, 4, 1, 1)
    e = math.exp
    # tile 1 (keys 0, 1): m = 2, l = e^-1 + 1, acc = 10 e^-1 + 20
    m1, l1, acc1 = 2.0, e(-1) + 1.0, 10 * e(-1) + 20.0
    # tile 2 (keys 2, 3): m = 3, rescale by alpha = e^(2 - 3)
    alpha = e(m1 - 3.0)
    l2 = l1 * alpha + e(0.0) + e(-3.0)
    acc2 = acc1 * alpha + 30.0 * e(0.0) + 40.0 * e(-3.0)
    out_hand, lse_hand = acc2 / l2, 3.0 + math.log(l2)
    # and the one-shot formula agrees with the recurrence
    w = [e(1.0), e(2.0), e(3.0), e(0.0)]
    assert math.isclose(out_hand, sum(a * b for a, b in zip(w, [10, 20, 30, 40])) / sum(w))
    assert math.isclose(lse_hand, math.log(sum(w)))

    stats = {}
    out_t, lse_t = attention_ref_tiled(
        q, k, v, softmax_scale=1.0, block_m=1, block_n=2, compute_dtype=F64, stats=stats
    )
    out_d, lse_d = attention_ref(q, k, v, softmax_scale=1.0, compute_dtype=F64)
    assert stats["tiles_computed"] == 2 and stats["tiles_skipped"] == 0
    for out, lse in [(out_t, lse_t), (out_d, lse_d)]:
        assert math.isclose(out.item(), out_hand, rel_tol=1e-13)
        assert math.isclose(lse.item(), lse_hand, rel_tol=1e-13)


def test_gqa_6_to_2_maps_heads_0_0_0_1_1_1():
    # kv head 0 makes key 0 dominant, kv head 1 key 1; v = one-hot(key) + 100 * kv_head,
    # so each query head's output names both the kv head it read and the key it chose.
    sk, d = 3, 4
    q = torch.ones(1, 1, 6, d, dtype=F64)
    k = torch.zeros(1, sk, 2, d, dtype=F64)
    k[0, 0, 0] = 10.0
    k[0, 1, 1] = 10.0
    v = torch.zeros(1, sk, 2, sk, dtype=F64)
    for hk in range(2):
        for j in range(sk):
            v[0, j, hk] = torch.eye(sk, dtype=F64)[j] + 100.0 * hk
    out, _ = attention_ref(q, k, v, softmax_scale=1.0, compute_dtype=F64)
    expected = torch.tensor([[1, 0, 0]] * 3 + [[100, 101, 100]] * 3, dtype=F64)
    assert torch.allclose(out[0, 0], expected, atol=1e-12)
    assert torch.equal(repeat_kv(v, 6)[0, :, :, 0], v[0, :, [0, 0, 0, 1, 1, 1], 0])


def test_fully_masked_rows_give_zero_and_neg_inf():
    q, k, v = rand_qkv(1, 5, 2, 2, 1, 4)
    for fn in (attention_ref, attention_ref_tiled):
        out, lse = fn(q, k, v, causal=True, compute_dtype=F64)
        assert torch.all(out[0, :3] == 0) and torch.all(torch.isneginf(lse[0, :, :3]))
        assert torch.isfinite(out).all() and torch.isfinite(lse[0, :, 3:]).all()
        # row 3 sees only key 0: out = v[0], lse = its score
        assert torch.allclose(out[0, 3], v[0, 0].expand(2, -1), atol=1e-12)
        s30 = (q[0, 3] @ k[0, 0, 0]) / 2.0
        assert torch.allclose(lse[0, :, 3], s30, atol=1e-12)
    dq, dk, dv = attention_ref_backward(
        q, k, v, out, lse, torch.ones_like(out), causal=True, compute_dtype=F64
    )
    assert torch.all(dq[0, :3] == 0)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))


def test_empty_key_sequence():
    q, k, v = rand_qkv(2, 3, 0, 2, 1, 4)
    for fn in (attention_ref, attention_ref_tiled):
        out, lse = fn(q, k, v, compute_dtype=F64)
        assert out.shape == (2, 3, 2, 4) and torch.all(out == 0)
        assert torch.all(torch.isneginf(lse))


def test_softcap_formula():
    q, k, v = rand_qkv(1, 4, 6, 2, 1, 8)
    scale, cap = 0.9, 1.5
    out, lse = attention_ref(q, k, v, softmax_scale=scale, softcap=cap, compute_dtype=F64)
    s = torch.einsum("bqhd,bkd->bhqk", q, k[:, :, 0]) * scale
    s = cap * torch.tanh(s / cap)
    p = torch.softmax(s, dim=-1)
    expected = torch.einsum("bhqk,bkd->bqhd", p, v[:, :, 0])
    assert torch.allclose(out, expected, atol=1e-12)
    assert torch.allclose(lse, torch.logsumexp(s, dim=-1), atol=1e-12)
    # and the cap is not a no-op at this scale
    plain, _ = attention_ref(q, k, v, softmax_scale=scale, compute_dtype=F64)
    assert (plain - out).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------
# tiled recurrence
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sq,sk", [(7, 13), (13, 7), (1, 9)])
@pytest.mark.parametrize(
    "causal,window,softcap",
    [
        (False, (None, None), 0.0),
        (True, (None, None), 0.0),
        (False, (3, 2), 2.0),
        (True, (4, None), 0.0),
    ],
)
def test_tiled_matches_dense(sq, sk, causal, window, softcap):
    q, k, v = rand_qkv(2, sq, sk, 4, 2, 8, dv=6)
    kw = dict(causal=causal, window_size=window, softcap=softcap, compute_dtype=F64)
    out, lse = attention_ref(q, k, v, **kw)
    for bm, bn in [(1, 1), (3, 5), (4, 2), (128, 128)]:
        out_t, lse_t = attention_ref_tiled(q, k, v, block_m=bm, block_n=bn, **kw)
        assert torch.allclose(out_t, out, atol=1e-12, rtol=0)
        masked = torch.isneginf(lse)
        assert torch.equal(torch.isneginf(lse_t), masked)
        assert torch.allclose(lse_t[~masked], lse[~masked], atol=1e-12, rtol=0)


def test_tiled_skips_tiles():
    q, k, v = rand_qkv(1, 64, 64, 2, 2, 8)
    stats = {}
    attention_ref_tiled(q, k, v, causal=True, block_m=16, block_n=16, stats=stats)
    # 4 x 4 tiles, causal on the diagonal: the 6 tiles strictly above it are skipped and the
    # 4 diagonal tiles are the only ones needing an element mask.
    assert stats == {
        "tiles_total": 16,
        "tiles_computed": 10,
        "tiles_skipped": 6,
        "tiles_masked": 4,
    }
    stats = {}
    attention_ref_tiled(q, k, v, window_size=(16, 0), block_m=16, block_n=16, stats=stats)
    # a local band skips on both sides: each query tile needs its own and the previous tile
    assert stats["tiles_computed"] == 7 and stats["tiles_skipped"] == 9
    stats = {}
    attention_ref_tiled(q, k, v, block_m=16, block_n=16, stats=stats)
    assert stats["tiles_skipped"] == 0 and stats["tiles_masked"] == 0


# --------------------------------------------------------------------------------------------
# memory bound
# --------------------------------------------------------------------------------------------


def test_score_budget_forces_query_blocks(monkeypatch):
    q, k, v = rand_qkv(3, 9, 11, 4, 2, 8)
    kw = dict(causal=True, window_size=(4, None), softcap=3.0, compute_dtype=F64)
    full, full_lse = attention_ref(q, k, v, **kw)
    calls = []
    real = reference._forward_block
    monkeypatch.setattr(
        reference, "_forward_block", lambda s, *a: (calls.append(tuple(s.shape)), real(s, *a))[1]
    )
    out, lse = attention_ref(q, k, v, score_budget_bytes=1, **kw)
    assert len(calls) == 3 * 9 and all(c[0] == 1 and c[3] == 1 for c in calls)
    assert torch.allclose(out, full, atol=1e-13) and torch.equal(
        lse.isneginf(), full_lse.isneginf()
    )
    # a budget of exactly two query rows of one batch item
    row_bytes = 4 * 11 * 8 * reference._FWD_SCORE_TEMPS
    calls.clear()
    out2, _ = attention_ref(q, k, v, score_budget_bytes=2 * row_bytes, **kw)
    assert len(calls) == 3 * 5 and max(c[3] for c in calls) == 2
    assert torch.allclose(out2, full, atol=1e-13)
    # the default comes from the environment
    calls.clear()
    monkeypatch.setenv("CUTE_ATTN_REF_BUDGET_BYTES", "1")
    out3, _ = attention_ref(q, k, v, **kw)
    assert len(calls) == 3 * 9 and torch.allclose(out3, full, atol=1e-13)
    # and the backward blocks give the same gradients
    dout = torch.randn_like(full)
    g_full = attention_ref_backward(q, k, v, full, full_lse, dout, score_budget_bytes=1 << 30, **kw)
    g_blk = attention_ref_backward(q, k, v, full, full_lse, dout, score_budget_bytes=1, **kw)
    for a, b in zip(g_full, g_blk):
        assert torch.allclose(a, b, atol=1e-13)


# --------------------------------------------------------------------------------------------
# varlen and paged
# --------------------------------------------------------------------------------------------


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


@pytest.mark.parametrize(
    "causal,window", [(False, (None, None)), (True, (None, None)), (False, (1, 2))]
)
def test_varlen_matches_per_sequence(causal, window):
    lq, lk = [3, 0, 1, 5, 2, 1], [4, 3, 1, 6, 0, 1]
    h, hkv, d, dv = 4, 2, 8, 6
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lq), h, d, generator=g, dtype=F64)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=F64)
    v = torch.randn(sum(lk), hkv, dv, generator=g, dtype=F64)
    kw = dict(causal=causal, window_size=window, compute_dtype=F64)
    out, lse = attention_ref_varlen(q, k, v, cu_seqlens_q=_cu(lq), cu_seqlens_k=_cu(lk), **kw)
    assert out.shape == (sum(lq), h, dv) and lse.shape == (h, sum(lq))
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for b in range(len(lq)):
        o, s = attention_ref(
            q[None, cq[b] : cq[b + 1]], k[None, ck[b] : ck[b + 1]], v[None, ck[b] : ck[b + 1]], **kw
        )
        assert torch.equal(out[cq[b] : cq[b + 1]], o[0])
        assert torch.equal(lse[:, cq[b] : cq[b + 1]], s[0])
    # sequence 4 has keys of length 0: its rows are empty
    assert torch.all(out[cq[4] : cq[5]] == 0) and torch.all(lse[:, cq[4] : cq[5]].isneginf())


def test_varlen_seqused_and_poisoned_tails():
    # spans are larger than the used lengths; the unused q rows come back 0 / -inf and the
    # NaN keys past seqused_k never reach the output.
    span_q, used_q = [4, 3, 2], [2, 3, 0]
    span_k, used_k = [5, 2, 4], [3, 0, 4]
    h, d = 2, 4
    g = torch.Generator().manual_seed(2)
    q = torch.randn(sum(span_q) + 2, h, d, generator=g, dtype=F64)  # 2 trailing rows unused
    k = torch.randn(sum(span_k), 1, d, generator=g, dtype=F64)
    v = torch.randn(sum(span_k), 1, d, generator=g, dtype=F64)
    cq, ck = _cu(span_q).tolist(), _cu(span_k).tolist()
    for b in range(3):
        k[ck[b] + used_k[b] : ck[b + 1]] = float("nan")
        v[ck[b] + used_k[b] : ck[b + 1]] = float("inf")
    out, lse = attention_ref_varlen(
        q,
        k,
        v,
        cu_seqlens_q=_cu(span_q),
        cu_seqlens_k=_cu(span_k),
        seqused_q=torch.tensor(used_q, dtype=torch.int32),
        seqused_k=torch.tensor(used_k, dtype=torch.int32),
        causal=True,
        compute_dtype=F64,
    )
    assert not out.isnan().any() and not lse.isnan().any() and not lse.isposinf().any()
    for b in range(3):
        rows = slice(cq[b], cq[b] + used_q[b])
        o, s = attention_ref(
            q[None, rows],
            k[None, ck[b] : ck[b] + used_k[b]],
            v[None, ck[b] : ck[b] + used_k[b]],
            causal=True,
            compute_dtype=F64,
        )
        assert torch.equal(out[rows], o[0]) and torch.equal(lse[:, rows], s[0])
        unused = slice(cq[b] + used_q[b], cq[b + 1])
        assert torch.all(out[unused] == 0) and torch.all(lse[:, unused].isneginf())
    assert torch.all(out[-2:] == 0) and torch.all(lse[:, -2:].isneginf())


@pytest.mark.parametrize("page_size", [1, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_matches_packed_with_poisoned_pages(page_size, causal):
    lq, lk = [2, 1, 3, 0], [5, 1, 0, 7]
    h, hkv, d, dv = 4, 2, 8, 6
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lq), h, d, generator=g, dtype=F64)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=F64)
    v = torch.randn(sum(lk), hkv, dv, generator=g, dtype=F64)
    kw = dict(causal=causal, window_size=(3, None), softcap=4.0, compute_dtype=F64)
    expected, expected_lse = attention_ref_varlen(
        q, k, v, cu_seqlens_q=_cu(lq), cu_seqlens_k=_cu(lk), **kw
    )

    n_pages = [-(-n // page_size) for n in lk]
    num_pages = sum(n_pages) + 3  # 3 spare pages that nobody owns
    max_pages = max(n_pages) + 1
    perm = torch.randperm(num_pages, generator=g)
    # Every slot starts poisoned: spare pages, unused page-table slots and the tail of each
    # sequence's last page must never be read.
    k_pages = torch.full((num_pages, page_size, hkv, d), float("nan"), dtype=F64)
    v_pages = torch.full((num_pages, page_size, hkv, dv), float("inf"), dtype=F64)
    spare = perm[-1].item()
    page_table = torch.full((len(lk), max_pages), spare, dtype=torch.int32)
    nxt, ck = 0, _cu(lk).tolist()
    for b, n in enumerate(lk):
        for p in range(n_pages[b]):
            page = perm[nxt].item()
            nxt += 1
            page_table[b, p] = page
            rows = slice(p * page_size, min(n, (p + 1) * page_size))
            cnt = rows.stop - rows.start
            k_pages[page, :cnt] = k[ck[b] + rows.start : ck[b] + rows.stop]
            v_pages[page, :cnt] = v[ck[b] + rows.start : ck[b] + rows.stop]
    out, lse = attention_ref_varlen(
        q,
        k_pages,
        v_pages,
        cu_seqlens_q=_cu(lq),
        seqused_k=torch.tensor(lk, dtype=torch.int32),
        page_table=page_table,
        **kw,
    )
    assert torch.isfinite(out).all() and not lse.isnan().any()
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)


# --------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sq,sk,h,hkv,kw,with_dlse",
    [
        (5, 6, 2, 2, dict(), False),
        (5, 6, 2, 2, dict(causal=True), True),
        (6, 9, 4, 2, dict(window_size=(2, 1)), False),
        (6, 6, 3, 1, dict(softcap=2.0, causal=True), True),
        (5, 3, 4, 2, dict(causal=True), True),  # rows 0, 1 fully masked
        (7, 5, 4, 2, dict(window_size=(1, 0), softcap=1.5, score_budget_bytes=1), True),
    ],
)
def test_backward_matches_autograd(sq, sk, h, hkv, kw, with_dlse):
    q, k, v = rand_qkv(2, sq, sk, h, hkv, 8, dv=5, seed=4)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    fwd_kw = dict(kw, compute_dtype=F64)
    out, lse = attention_ref(q, k, v, **fwd_kw)
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(out.shape, generator=g, dtype=F64)
    dlse = torch.randn(lse.shape, generator=g, dtype=F64) if with_dlse else None
    loss = (out * dout).sum()
    if with_dlse:
        finite = torch.isfinite(lse)
        loss = loss + torch.where(finite, lse, torch.zeros_like(lse)).mul(dlse).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    assert all(torch.isfinite(t).all() for t in grads)
    mine = attention_ref_backward(
        q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dout, dlse=dlse, **fwd_kw
    )
    for name, a, b in zip(("dq", "dk", "dv"), mine, grads):
        assert a.shape == b.shape and a.dtype == F64, name
        assert torch.allclose(a, b, atol=1e-11, rtol=1e-9), (name, (a - b).abs().max())
    if with_dlse:
        # the dlse term is not a no-op
        no_dlse = attention_ref_backward(
            q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dout, **fwd_kw
        )
        assert (no_dlse[0] - mine[0]).abs().max() > 1e-6


# --------------------------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs(dtype):
    q, k, v = rand_qkv(2, 9, 12, 4, 2, 16, dtype=dtype, seed=6)
    kw = dict(causal=True, window_size=(6, None))
    out32, lse32 = attention_ref(q, k, v, **kw)
    assert out32.dtype == torch.float32 and lse32.dtype == torch.float32
    out_t, lse_t = attention_ref_tiled(q, k, v, block_m=4, block_n=5, **kw)
    assert torch.allclose(out_t, out32, atol=1e-5) and torch.allclose(lse_t, lse32, atol=1e-5)
    # compute_dtype=None: the same-dtype torch baseline, lse still fp32
    out_n, lse_n = attention_ref(q, k, v, compute_dtype=None, **kw)
    assert out_n.dtype == dtype and lse_n.dtype == torch.float32
    assert torch.isfinite(out_n).all()
    # A few roundings in the input dtype: out (|out| < 3) within 4 eps, lse (|lse| ~ 3, itself
    # rounded to the input dtype by plain torch) within 8 eps. Observed: about 1 eps / 2 eps.
    eps = torch.finfo(dtype).eps
    assert torch.allclose(out_n.float(), out32, atol=4 * eps, rtol=0)
    assert torch.allclose(lse_n, lse32, atol=8 * eps, rtol=0)
    # the baseline really is lower precision than the fp32 path
    assert not torch.equal(out_n.float(), out32)
    dq, dk, dv = attention_ref_backward(q, k, v, out32, lse32, torch.ones_like(out32), **kw)
    assert dq.dtype == torch.float32 and torch.isfinite(dq).all()
    # fully masked rows (Sq=5, Sk=2 causal: rows 0..2) stay 0 / -inf in the native path too
    q, k, v = rand_qkv(1, 5, 2, 2, 1, 16, dtype=dtype, seed=7)
    masked_out, masked_lse = attention_ref(q, k, v, compute_dtype=None, causal=True)
    assert torch.isfinite(masked_out).all() and torch.all(masked_out[0, :3] == 0)
    assert torch.all(masked_lse[0, :, :3].isneginf()) and torch.isfinite(masked_lse[0, :, 3:]).all()
