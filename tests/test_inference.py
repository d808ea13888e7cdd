"""CPU tests of cute_attn.inference: merge_attn_states and flash_attn_with_kvcache (reference).

Ground truth is cute_attn.reference.attention_ref on explicitly built key sets (fp64, so the
comparisons are tight), and an independent rotary implementation written here with complex
multiplication. The CUDA path is covered by dispatch-level tests with a faked arch.

Run: python -m pytest -q tests/test_inference.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cute_attn
from cute_attn import dispatch, inference
from cute_attn.reference import attention_ref
from cute_attn.validation import validate_kvcache

F64 = torch.float64
TIGHT = dict(rtol=1e-12, atol=1e-12)


def _slice_attn(q, k, v, lo, hi, causal):
    """Attention of q over keys [lo, hi) with the mask of the FULL problem (bottom-right).

    Global rule j <= i + Sk - Sq becomes j' <= i + (hi - lo) - Sq + (Sk - hi) in slice indices,
    i.e. a right window of Sk - hi relative to the slice's own bottom-right diagonal.
    """
    sk = k.shape[1]
    window = (-1, sk - hi) if causal else (-1, -1)
    return attention_ref(q, k[:, lo:hi], v[:, lo:hi], window_size=window, compute_dtype=F64)


def _qkv(b, sq, sk, h=4, hkv=2, d=16, dv=8, dtype=F64):
    q = torch.randn(b, sq, h, d, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, dtype=dtype)
    v = torch.randn(b, sk, hkv, dv, dtype=dtype)
    return q, k, v


# --------------------------------------------------------------------------------------------
# merge_attn_states
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,split", [(5, 12, 9), (8, 6, 3), (4, 10, 0), (3, 7, 7)])
def test_merge_two_halves_equals_full(seed, causal, sq, sk, split):
    q, k, v = _qkv(2, sq, sk)
    full_out, full_lse = attention_ref(q, k, v, causal=causal, compute_dtype=F64)
    oa, la = _slice_attn(q, k, v, 0, split, causal)
    ob, lb = _slice_attn(q, k, v, split, sk, causal)
    out, lse = cute_attn.merge_attn_states(oa, la, ob, lb)
    assert out.dtype == F64 and lse.dtype == F64
    torch.testing.assert_close(out, full_out, **TIGHT)
    torch.testing.assert_close(lse, full_lse, **TIGHT)
    assert not out.isnan().any() and not lse.isnan().any()
    if causal and sq > sk:
        # rows with i + Sk - Sq < 0 see no key on either side: exactly 0 and -inf
        empty = sq - sk
        assert torch.isneginf(lse[:, :, :empty]).all()
        assert (out[:, :empty] == 0).all()
    if causal and (sq, sk, split) == (5, 12, 9):
        # the suffix half is fully masked for rows 0, 1 (diag 7, 8 < 9): the prefix is taken
        assert torch.isneginf(lb[:, :, :2]).all()
        assert torch.equal(out[:, :2], oa[:, :2]) and torch.equal(lse[:, :, :2], la[:, :, :2])


@pytest.mark.parametrize("causal", [False, True])
def test_merge_three_way_is_associative(seed, causal):
    q, k, v = _qkv(2, 6, 15)
    full_out, full_lse = attention_ref(q, k, v, causal=causal, compute_dtype=F64)
    a, b, c = (_slice_attn(q, k, v, lo, hi, causal) for lo, hi in ((0, 4), (4, 11), (11, 15)))
    left = cute_attn.merge_attn_states(*cute_attn.merge_attn_states(*a, *b), *c)
    right = cute_attn.merge_attn_states(*a, *cute_attn.merge_attn_states(*b, *c))
    for out, lse in (left, right):
        torch.testing.assert_close(out, full_out, **TIGHT)
        torch.testing.assert_close(lse, full_lse, **TIGHT)


def test_merge_varlen_layout_matches_dense(seed):
    q, k, v = _qkv(1, 7, 9)
    (oa, la), (ob, lb) = _slice_attn(q, k, v, 0, 5, True), _slice_attn(q, k, v, 5, 9, True)
    dense_out, dense_lse = inference.merge_attn_states(oa, la, ob, lb)
    out, lse = inference.merge_attn_states(oa[0], la[0], ob[0], lb[0])  # (T, H, D), (H, T)
    assert out.shape == oa[0].shape and lse.shape == la[0].shape
    torch.testing.assert_close(out, dense_out[0], rtol=0, atol=0)
    torch.testing.assert_close(lse, dense_lse[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_merge_dtypes_and_one_sided_rows(seed, dtype):
    b, s, h, d = 2, 5, 3, 8
    oa, ob = torch.randn(b, s, h, d).to(dtype), torch.randn(b, s, h, d).to(dtype)
    la, lb = torch.randn(b, h, s) * 3, torch.randn(b, h, s) * 3
    la[0, 1, 2] = float("-inf")  # only b's side has keys: b's row exactly, a's garbage ignored
    oa[0, 2, 1] = float("nan")
    lb[1, 0, 4] = float("-inf")  # only a's side
    la[1, 2, 0] = lb[1, 2, 0] = float("-inf")  # neither side
    oa[1, 0, 2] = ob[1, 0, 2] = float("nan")
    out, lse = inference.merge_attn_states(oa, la, ob, lb)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(out[0, 2, 1], ob[0, 2, 1]) and lse[0, 1, 2] == lb[0, 1, 2]
    assert torch.equal(out[1, 4, 0], oa[1, 4, 0]) and lse[1, 0, 4] == la[1, 0, 4]
    assert (out[1, 0, 2] == 0).all() and torch.isneginf(lse[1, 2, 0])
    assert not out.isnan().any() and not lse.isnan().any()
    # everything else: the fp64 formula on the same inputs, rounded to dtype
    ok = torch.isfinite(la) & torch.isfinite(lb)
    la64, lb64 = la.double(), lb.double()
    lse64 = torch.logaddexp(la64, lb64)
    wa = torch.exp(la64 - lse64).transpose(1, 2).unsqueeze(-1)
    wb = torch.exp(lb64 - lse64).transpose(1, 2).unsqueeze(-1)
    want = oa.double() * wa + ob.double() * wb
    rows = ok.transpose(1, 2)
    torch.testing.assert_close(out[rows], want[rows].to(dtype))  # dtype's default tolerance
    torch.testing.assert_close(lse[ok].double(), lse64[ok], rtol=1e-6, atol=1e-6)


def test_merge_validation_errors():
    o, lse = torch.zeros(2, 5, 3, 8), torch.zeros(2, 3, 5)
    with pytest.raises(TypeError, match="^out_b: expected a torch.Tensor"):
        inference.merge_attn_states(o, lse, None, lse)
    with pytest.raises(TypeError, match="^out_b: expected dtype torch.float32"):
        inference.merge_attn_states(o, lse, o.double(), lse)
    with pytest.raises(TypeError, match="^lse_a: expected dtype torch.float32"):
        inference.merge_attn_states(o, lse.bfloat16(), o, lse.bfloat16())
    with pytest.raises(TypeError, match="^lse_b: expected dtype torch.float32"):
        inference.merge_attn_states(o, lse, o, lse.double())
    with pytest.raises(TypeError, match="^out_a: expected a float dtype"):
        inference.merge_attn_states(o.int(), lse, o.int(), lse)
    with pytest.raises(ValueError, match="^out_a: expected a 4-D"):
        inference.merge_attn_states(o[0, 0], lse, o[0, 0], lse)
    with pytest.raises(ValueError, match="^out_b: expected shape"):
        inference.merge_attn_states(o, lse, o[:, :4], lse)
    with pytest.raises(ValueError, match="^lse_a: expected shape"):  # (B, S, H) instead
        inference.merge_attn_states(o, lse.transpose(1, 2), o, lse)
    with pytest.raises(ValueError, match="^lse_b: expected a 2-D"):  # dense lse with varlen out
        inference.merge_attn_states(o[0], lse[0].t().t(), o[0], lse)
    with pytest.raises(ValueError, match="^lse_b: expected a tensor on cpu"):
        inference.merge_attn_states(o, lse, o, lse.to("meta"))


# --------------------------------------------------------------------------------------------
# flash_attn_with_kvcache: helpers
# --------------------------------------------------------------------------------------------


def _expected(q, kc, vc, rows, n, k_new=None, v_new=None, causal=True, **kw):
    """Per batch row: attention_ref over cat(cache row[:n_b], new keys), bottom-right."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        keys, vals = kc[rows[b], : n[b]], vc[rows[b], : n[b]]
        if k_new is not None:
            keys, vals = torch.cat((keys, k_new[b])), torch.cat((vals, v_new[b]))
        o, lse = attention_ref(
            q[b : b + 1], keys[None], vals[None], causal=causal, compute_dtype=F64, **kw
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses).float()


def _cache_case(b=3, sq=2, s_new=2, cap=12, n=(0, 5, 9), h=4, hkv=2, d=16, dv=8, b_cache=None):
    q = torch.randn(b, sq, h, d, dtype=F64)
    kc = torch.randn(b_cache or b, cap, hkv, d, dtype=F64)
    vc = torch.randn(b_cache or b, cap, hkv, dv, dtype=F64)
    kn = torch.randn(b, s_new, hkv, d, dtype=F64) if s_new else None
    vn = torch.randn(b, s_new, hkv, dv, dtype=F64) if s_new else None
    return q, kc, vc, kn, vn, torch.tensor(n, dtype=torch.int32)


def _written(kc, rows, n, k_new):
    """kc with k_new[b] placed at positions n[b] .. of cache row rows[b]."""
    kc = kc.clone()
    for b, r in enumerate(rows):
        kc[r, n[b] : n[b] + k_new.shape[1]] = k_new[b]
    return kc


def _rotate_ref(x, theta, interleaved):
    """Independent rotary: complex multiplication by exp(i * theta), theta (B, S, rd / 2)."""
    half = theta.shape[-1]
    rd = 2 * half
    e = torch.polar(torch.ones_like(theta), theta).unsqueeze(2)  # (B, S, 1, half)
    xr = x[..., :rd]
    if interleaved:
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], half, 2).contiguous()) * e
        rot = torch.view_as_real(z).flatten(-2)
    else:
        z = torch.complex(xr[..., :half], xr[..., half:]) * e
        rot = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((rot, x[..., rd:]), dim=-1)


# --------------------------------------------------------------------------------------------
# flash_attn_with_kvcache
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sq", [1, 2, 3])
def test_append_then_attend_dense(seed, sq):
    q, kc, vc, kn, vn, n = _cache_case(sq=sq, s_new=sq)
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = cute_attn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=n)
    want_out, want_lse = _expected(q, kc0, vc0, [0, 1, 2], n.tolist(), kn, vn)
    assert out.shape == (3, sq, 4, 8) and out.dtype == F64 and lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out, **TIGHT)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    # exactly the new rows were written, nothing else changed
    assert torch.equal(kc, _written(kc0, [0, 1, 2], n.tolist(), kn))
    assert torch.equal(vc, _written(vc0, [0, 1, 2], n.tolist(), vn))
    last = cute_attn.last_dispatch()
    assert (last.impl, last.entry) == ("reference", "flash_attn_with_kvcache")


def test_speculative_rows_are_bottom_right_causal(seed):
    # Sq = 3 new tokens: query i sees cached keys and new keys 0..i, never the later ones.
    q, kc, vc, kn, vn, n = _cache_case(sq=3, s_new=3)
    out1, _ = cute_attn.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=n)
    kn2, vn2 = kn.clone(), vn.clone()
    kn2[:, 1:] += 1.0
    vn2[:, 1:] -= 2.0
    out2, _ = cute_attn.flash_attn_with_kvcache(q, kc, vc, kn2, vn2, cache_seqlens=n)
    assert torch.equal(out1[:, 0], out2[:, 0])
    assert not torch.equal(out1[:, 1:], out2[:, 1:])


def test_cache_seqlens_int_equals_tensor(seed):
    q, kc, vc, kn, vn, _ = _cache_case(n=(6, 6, 6))
    a = cute_attn.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=6)
    b = cute_attn.flash_attn_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=torch.full((3,), 6, dtype=torch.int32)
    )
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_read_only_and_full_cache(seed):
    q, kc, vc, _, _, n = _cache_case(s_new=0, n=(3, 0, 12))
    kc0 = kc.clone()
    out, lse = cute_attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n)
    want = _expected(q, kc, vc, [0, 1, 2], n.tolist())
    torch.testing.assert_close(out, want[0], **TIGHT)
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()  # cache_seqlens 0: no key
    assert torch.equal(kc, kc0)
    out, _ = cute_attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=None)  # None = full
    torch.testing.assert_close(out, _expected(q, kc, vc, [0, 1, 2], [12] * 3)[0], **TIGHT)


def test_empty_cache_and_empty_batch():
    q = torch.randn(2, 1, 2, 8, dtype=F64)
    kc = torch.empty(2, 0, 1, 8, dtype=F64)
    out, lse = cute_attn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=0)
    assert (out == 0).all() and torch.isneginf(lse).all() and out.shape == (2, 1, 2, 8)
    kc = torch.randn(0, 4, 1, 8, dtype=F64)
    out, lse = cute_attn.flash_attn_with_kvcache(q[:0], kc, kc, cache_seqlens=1)
    assert out.shape == (0, 1, 2, 8) and lse.shape == (0, 2, 1)


def test_cache_batch_idx_permutation(seed):
    rows = [4, 0, 2]
    q, kc, vc, kn, vn, n = _cache_case(b_cache=5)
    kc[[1, 3]] = float("nan")  # rows no batch entry uses
    kc0, vc0 = kc.clone(), vc.clone()
    idx = torch.tensor(rows, dtype=torch.int32)
    out, lse = cute_attn.flash_attn_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=n, cache_batch_idx=idx
    )
    want_out, want_lse = _expected(q, kc0, vc0, rows, n.tolist(), kn, vn)
    torch.testing.assert_close(out, want_out, **TIGHT)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert torch.equal(kc.nan_to_num(7.0), _written(kc0, rows, n.tolist(), kn).nan_to_num(7.0))
    assert torch.equal(vc, _written(vc0, rows, n.tolist(), vn))


def test_nan_in_unused_cache_rows_does_not_leak(seed):
    q, kc, vc, kn, vn, n = _cache_case(sq=1, s_new=1)
    clean = cute_attn.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=n)
    for b, nb in enumerate(n.tolist()):
        kc[b, nb + 1 :] = float("nan")  # past this call's last key
        vc[b, nb + 1 :] = float("inf")
    out, lse = cute_attn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=n)
    assert torch.equal(out, clean[0]) and torch.equal(lse, clean[1])


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_cache_matches_dense(seed, page_size):
    b, max_pages = 3, -(-12 // page_size)
    cap = max_pages * page_size
    q, kc, vc, kn, vn, n = _cache_case(cap=cap, n=(0, 5, 9), sq=2, s_new=2)
    dense_out = cute_attn.flash_attn_with_kvcache(
        q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=n
    )
    kc_after = _written(kc, [0, 1, 2], n.tolist(), kn)
    # scatter the dense rows over shuffled pages, with extra pages full of NaN
    num_pages = b * max_pages + 4
    perm = torch.randperm(num_pages)
    table = perm[: b * max_pages].reshape(b, max_pages)
    kp = torch.full((num_pages, page_size) + kc.shape[2:], float("nan"), dtype=F64)
    vp = torch.full((num_pages, page_size) + vc.shape[2:], float("nan"), dtype=F64)
    used = (n + 2 + page_size - 1) // page_size
    for bi in range(b):
        for j in range(max_pages):
            if j < used[bi]:
                kp[table[bi, j]] = kc[bi, j * page_size : (j + 1) * page_size]
                vp[table[bi, j]] = vc[bi, j * page_size : (j + 1) * page_size]
    table = table.to(torch.int32)
    table[torch.arange(max_pages)[None, :] >= used[:, None]] = -1  # unused entries: anything
    kp0 = kp.clone()
    out, lse = cute_attn.flash_attn_with_kvcache(
        q, kp, vp, kn, vn, cache_seqlens=n, page_table=table
    )
    torch.testing.assert_close(out, dense_out[0], **TIGHT)
    torch.testing.assert_close(lse, dense_out[1], rtol=0, atol=0)
    # the new keys landed at their logical positions; every other slot is unchanged
    expect = kp0.clone()
    for bi in range(b):
        for pos in range(int(n[bi]), int(n[bi]) + 2):
            expect[table[bi, pos // page_size], pos % page_size] = kc_after[bi, pos]
    assert torch.equal(kp.nan_to_num(7.0), expect.nan_to_num(7.0))


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary(seed, interleaved, causal):
    rd, cap = 8, 12
    q, kc, vc, kn, vn, n = _cache_case(sq=3, s_new=3, d=16, cap=cap, n=(0, 5, 9))
    freqs = 10000.0 ** (-torch.arange(rd // 2, dtype=F64) * 2 / rd)
    theta = torch.arange(cap + 3, dtype=F64)[:, None] * freqs[None, :]  # (seqlen_ro, rd / 2)
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = cute_attn.flash_attn_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=n, rotary_cos=theta.cos(), rotary_sin=theta.sin(),
        rotary_interleaved=interleaved, causal=causal,
    )  # fmt: skip
    pos = n.long()[:, None] + torch.arange(3)
    # FlashAttention's rule: without causal/window every q row sits at position cache_seqlens
    q_pos = pos if causal else n.long()[:, None].expand(-1, 3)
    q_rot = _rotate_ref(q, theta[q_pos], interleaved)
    k_rot = _rotate_ref(kn, theta[pos], interleaved)
    assert torch.equal(q_rot[..., rd:], q[..., rd:])  # dims past rotary_dim do not move
    want_out, want_lse = _expected(q_rot, kc0, vc0, [0, 1, 2], n.tolist(), k_rot, vn, causal)
    torch.testing.assert_close(out, want_out, **TIGHT)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kc, _written(kc0, [0, 1, 2], n.tolist(), k_rot), **TIGHT)
    assert torch.equal(vc, _written(vc0, [0, 1, 2], n.tolist(), vn))  # v is never rotated


def test_window_and_softcap(seed):
    q, kc, vc, kn, vn, n = _cache_case(sq=3, s_new=3, n=(2, 5, 9))
    kw = dict(window_size=(4, 0), softcap=2.5, softmax_scale=0.3)
    out, lse = cute_attn.flash_attn_with_kvcache(
        q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=n, **kw
    )
    want_out, want_lse = _expected(q, kc, vc, [0, 1, 2], n.tolist(), kn, vn, **kw)
    torch.testing.assert_close(out, want_out, **TIGHT)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


def test_low_precision_output_dtypes(seed):
    q, kc, vc, kn, vn, n = _cache_case()
    args = [t.bfloat16() for t in (q, kc, vc, kn, vn)]
    out, lse = cute_attn.flash_attn_with_kvcache(*args, cache_seqlens=n)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want = _expected(*[t.double() for t in args[:3]], [0, 1, 2], n.tolist(), *args[3:])
    torch.testing.assert_close(out.double(), want[0], rtol=2e-2, atol=2e-2)


def test_kvcache_argument_errors(seed):
    q, kc, vc, kn, vn, n = _cache_case(sq=3, s_new=1)
    kc0 = kc.clone()
    cos = torch.ones(12, 4, dtype=F64)
    with pytest.raises(ValueError, match="^rotary_cos: .*needs new k/v"):
        cute_attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, rotary_cos=cos,
                                          rotary_sin=cos)  # fmt: skip
    with pytest.raises(ValueError, match="^rotary_cos: seqlen_ro"):  # q rows 11..13 of 12
        cute_attn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=11, rotary_cos=cos,
                                          rotary_sin=cos)  # fmt: skip
    with pytest.raises(TypeError, match="^rotary_interleaved: expected a bool"):
        cute_attn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=n, rotary_cos=cos,
                                          rotary_sin=cos, rotary_interleaved=1)  # fmt: skip
    assert torch.equal(kc, kc0)  # every error comes before the cache is written


def test_kvcache_problems_claimed_by_sm90_dense_and_paged(monkeypatch):
    # Validate on CPU with a head dim the SM90 kernel serves, then pretend the tensors are CUDA.
    q = torch.randn(2, 1, 4, 128, dtype=torch.bfloat16)
    kc = torch.randn(2, 16, 2, 128, dtype=torch.bfloat16)
    p = validate_kvcache(
        q, kc, kc, None, None, cache_seqlens=3, cache_batch_idx=None, page_table=None,
        rotary_cos=None, rotary_sin=None, softmax_scale=None, causal=True,
        window_size=(None, None), softcap=0.0, num_splits=0,
    )  # fmt: skip
    assert p.kvcache and not p.varlen and not p.paged
    p = dataclasses.replace(p, device_type="cuda", device_index=0)
    tensors = (("q", q), ("k_cache", kc), ("v_cache", kc))
    dispatch._warned.clear()
    monkeypatch.setattr(dispatch, "device_arch", lambda index: "sm_90a")
    d = dispatch.select(p, tensors, entry="flash_attn_with_kvcache")
    assert (d.impl, d.entry) == ("sm90_fwd", "flash_attn_with_kvcache")
    paged = dataclasses.replace(p, paged=True, page_size=16)
    d = dispatch.select(paged, tensors, entry="flash_attn_with_kvcache")
    assert (d.impl, d.entry) == ("sm90_fwd", "flash_attn_with_kvcache")
    # a head dim the kernel does not serve: the reference only on request
    unserved = dataclasses.replace(p, head_dim=80, head_dim_v=80)
    with pytest.raises(NotImplementedError, match="head dims"):
        dispatch.select(unserved, tensors, entry="flash_attn_with_kvcache")
    with pytest.warns(RuntimeWarning, match="slow reference"):
        d = dispatch.select(unserved, tensors, fallback="reference",
                            entry="flash_attn_with_kvcache")  # fmt: skip
    assert (d.impl, d.entry) == ("reference", "flash_attn_with_kvcache")


def test_dispatch_runs_before_the_cache_is_written(seed, monkeypatch):
    q, kc, vc, kn, vn, n = _cache_case()
    kc0 = kc.clone()
    seen = {}

    def refuse(p, tensors, *, fallback=None, entry="flash_attn_func"):
        seen.update(fallback=fallback, entry=entry, names=[name for name, _ in tensors])
        raise NotImplementedError("no kernel (test)")

    monkeypatch.setattr(dispatch, "select", refuse)
    with pytest.raises(NotImplementedError, match="no kernel"):
        cute_attn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=n, fallback="error")
    assert torch.equal(kc, kc0)
    assert seen == dict(fallback="error", entry="flash_attn_with_kvcache",
                        names=["q", "k_cache", "v_cache", "k", "v"])  # fmt: skip


# --------------------------------------------------------------------------------------------
# SM90 host plan pieces that need no GPU: the split table and the packed-decode views
# --------------------------------------------------------------------------------------------


def test_split_table_fills_one_wave_at_most():
    from cute_attn.arch.sm90.tile_config import fwd_num_splits

    # decode rows of the bench: B=1 and B=8 (8 KV heads, packed) split, B=64 does not
    assert fwd_num_splits(8, 256, 132) == 16
    assert fwd_num_splits(64, 64, 132) == 2
    assert fwd_num_splits(512, 64, 132) == 1
    assert fwd_num_splits(8, 3, 132) == 1  # too few key tiles to share
    for ctas in (1, 2, 7, 50, 131, 132, 1000):
        for tiles in (1, 4, 9, 64, 1000):
            s = fwd_num_splits(ctas, tiles, 132)
            assert s >= 1 and (s == 1 or (ctas * s <= 132 and tiles // s >= 2)), (ctas, tiles, s)


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("decode", [False, True])
def test_paged_tile_fits_inside_a_page(d, dv, decode):
    # every TMA key tile must lie inside one page: tile_n divides the page size, is a multiple
    # of 16 (the P V wgmma's K step), never above the dense table's tile, and the smaller tile
    # keeps the variant inside smem; sizes without such a tile take the gather route
    from cute_attn.arch.sm90.tile_config import (
        SMEM_BYTES_SM90,
        fwd_tile_config,
        paged_tile_config,
        paged_tile_n,
    )

    base = fwd_tile_config(d, dv, True, False, decode)
    for page in (1, 8, 15, 16, 24, 32, 48, 64, 80, 96, 100, 128, 200, 256, 512, 1024):
        n = paged_tile_n(base.tile_n, page)
        if n is None:
            assert all(page % m for m in range(16, base.tile_n + 1, 16)), page
            with pytest.raises(ValueError, match="no TMA key tile"):
                fwd_tile_config(d, dv, True, False, decode, page)
            continue
        cfg = fwd_tile_config(d, dv, True, False, decode, page)
        assert cfg == paged_tile_config(base, d, dv, page)
        assert cfg.tile_n == n and page % n == 0 and n % 16 == 0 and n <= base.tile_n
        assert cfg.smem_bytes(d, dv) <= SMEM_BYTES_SM90
        assert cfg.num_stages >= base.num_stages
        # the largest such tile: no bigger multiple of 16 up to the table's tile divides page
        assert all(page % m for m in range(n + 16, base.tile_n + 1, 16))
        # only the key tile and stage count change
        assert dataclasses.replace(cfg, tile_n=base.tile_n, num_stages=base.num_stages) == base
    assert paged_tile_n(128, 64) == 64 and paged_tile_n(128, 256) == 128
    assert paged_tile_n(80, 256) == 64 and paged_tile_n(128, 8) is None


def test_packed_decode_views_map_heads_to_rows():
    from cute_attn.fwd_sm90 import _pack_lse, _pack_rows

    b, h, group, d = 3, 8, 4, 16
    q = torch.randn(b, 1, h, d)
    packed = _pack_rows(q, group)
    assert packed.shape == (b, group, h // group, d)
    for hk in range(h // group):
        for g in range(group):  # row g of KV head hk is query head hk * group + g
            assert torch.equal(packed[:, g, hk], q[:, 0, hk * group + g])
    lse = torch.randn(b, h, 1)
    pl = _pack_lse(lse, group)
    assert pl.shape == (b, h // group, group) and pl.is_contiguous()  # the kernel's compact lse
    assert torch.equal(pl.reshape(b, h), lse[..., 0])


def test_kernel_path_prepare_launches_nothing_without_append():
    # the per-token decode call without append / rotary: int32 lengths go to the kernel as
    # they are (no cast, no add, no page table), so the host issues no torch op for them
    from op_count import CountOps

    q = torch.randn(2, 1, 4, 16)
    kc = torch.randn(2, 32, 2, 16)
    n = torch.tensor([3, 17], dtype=torch.int32)
    p = validate_kvcache(
        q, kc, kc, None, None, cache_seqlens=n, cache_batch_idx=None, page_table=None,
        rotary_cos=None, rotary_sin=None, softmax_scale=None, causal=True,
        window_size=(None, None), softcap=0.0, num_splits=0,
    )  # fmt: skip
    kw = dict(problem=p, cache_seqlens=n, cache_batch_idx=None, page_table=None,
              rotary_cos=None, rotary_sin=None, rotary_interleaved=True)  # fmt: skip
    with CountOps() as ops:
        q2, used, pt = inference.kvcache_prepare(
            q, kc, kc, None, None, lengths_dtype=torch.int32, with_pages=False, **kw
        )
    assert ops.n == 0 and q2 is q and used is n and pt is None
    # the reference's call still gets int64 lengths and the page table
    _, used64, pt64 = inference.kvcache_prepare(q, kc, kc, None, None, **kw)
    assert used64.dtype == torch.int64 and used64.tolist() == [3, 17]
    assert pt64.tolist() == [[0], [1]]


def test_gather_pages_builds_dense_rows_and_ignores_unused_entries():
    # the gather route for page sizes without a TMA tile: row b = pages table[b] in order;
    # entries past a row's used pages (-1, or out of range) are clamped, never an index error
    from cute_attn.fwd_sm90 import _gather_pages

    pages = torch.arange(5 * 3 * 2 * 4, dtype=torch.float32).view(5, 3, 2, 4)
    table = torch.tensor([[4, 0, -1], [2, 99, -7]], dtype=torch.int32)
    dense = _gather_pages(pages, table)
    assert dense.shape == (2, 9, 2, 4)
    assert torch.equal(dense[0, :6], torch.cat([pages[4], pages[0]]))
    assert torch.equal(dense[1, :3], pages[2])
