"""SM90 backward kernel vs the fp32 reference (GPU, `gpu` marker).

Gradients come through the public path (flash_attn_func + autograd) with a random dO. The
tolerance is the FlashAttention rule per gradient: max|g - g_ref32| <= 2 * max|g_torch -
g_ref32| + atol, where g_torch is plain torch autograd of the reference in the input dtype and
atol covers rounding the fp32 reference gradient to the input dtype.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from compile_snippet import HGMMA_SHAPES, MASK_WINDOWS, run_json_snippet

import cute_attn.dispatch
from cute_attn import flash_attn_func, last_backward_dispatch
from cute_attn.arch.sm90.bwd_tiles import bwd_tile_config
from cute_attn.reference import attention_ref

from gpu_cases import (
    SWEEP_MODES,
    assert_grads_match,
    attn_inputs,
    force_bwd_tile,
    mode_kwargs,
    sweep_batch,
)


def _inputs(*args, **kw):
    return attn_inputs(*args, with_dout=True, **kw)


def _grads(fn, q, k, v, dout, dlse_w=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    loss = (out.float() * dout.float()).sum()
    if dlse_w is not None:  # lse used downstream: its gradient must flow back too
        fin = torch.isfinite(lse)
        loss = loss + (torch.where(fin, lse, 0.0) * dlse_w).sum()
    gq, gk, gv = torch.autograd.grad(loss, (q, k, v))
    return out, gq, gk, gv


def _assert_bitwise(q, k, v, dout, runs, **kw):
    """The kernel's gradients are bitwise equal over `runs` calls (the deterministic order)."""
    first = _grads(lambda a, b, c: flash_attn_func(a, b, c, **kw), q, k, v, dout)[1:]
    assert last_backward_dispatch().impl == "sm90_bwd"
    for _ in range(runs - 1):
        again = _grads(lambda a, b, c: flash_attn_func(a, b, c, **kw), q, k, v, dout)[1:]
        for a, b in zip(first, again):
            assert torch.equal(a, b), "deterministic backward differs between runs"


def _check(q, k, v, dout, lse_grad=False, expect="sm90_bwd", **kw):
    dlse_w = None
    if lse_grad:
        gen = torch.Generator(device="cuda").manual_seed(7)
        dlse_w = torch.randn(q.shape[0], q.shape[2], q.shape[1], device="cuda", generator=gen)
    _, *got = _grads(lambda a, b, c: flash_attn_func(a, b, c, **kw), q, k, v, dout, dlse_w)
    d = last_backward_dispatch()
    assert (d.entry, d.impl) == ("backward", expect), d
    f32 = [t.float() for t in (q, k, v, dout)]
    rkw = {key: val for key, val in kw.items() if key != "deterministic"}  # kernel-only knob
    _, *ref = _grads(lambda a, b, c: attention_ref(a, b, c, **rkw), *f32, dlse_w)
    _, *same = _grads(
        lambda a, b, c: attention_ref(a, b, c, compute_dtype=None, **rkw), q, k, v, dout, dlse_w
    )
    assert_grads_match(got, ref, same, q.dtype)
    return got


SEQLENS = [(1, 1), (2, 5), (5, 2), (113, 203), (239, 1), (1, 300), (128, 128), (1024, 1024),
           (333, 777), (777, 333)]  # fmt: skip
# 96: its own tiles, K padded to 128 (softcap: dQ = dS K, no padding); past 128 the
# swapped dK / dV tiles (192 on its own 64 x 96 tiles with S = Q K^T)
HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 192), (192, 128), (256, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,dv", HEAD_DIMS)
@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("mode", SWEEP_MODES)
def test_bwd_sweep(request, dtype, d, dv, sq, sk, mode):
    if (dtype, d, sq, sk, mode) == (torch.bfloat16, 256, 239, 1, "full"):
        # A known failure, kept visible rather than given a wider tolerance. With one key the
        # exact dS (so dK) is 0; the kernel's D = rowsum(dO * O) uses the bf16 O, so dP - D is
        # rounding noise summed over D = 256 (FA4 computes D the same way). H200: dK max
        # error 2.22e-5 against the rule's 2 * 5.66e-6 + 1.00e-5 = 2.13e-5, with either dQ
        # swizzle (dK does not depend on it). Strict: a pass is reported and must be looked at.
        request.applymarker(pytest.mark.xfail(strict=True, reason="dK noise at one key, D=256"))
    _check(*_inputs(sweep_batch(sq, sk), sq, sk, 6, 2, d, dv, dtype), **mode_kwargs(mode))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(2**40, 0), (2**31 - 1, 3)])
def test_bwd_window_wider_than_int32(window):
    # the backward's window scalars are clamped like the forward's (bwd_sm90._scalars)
    _check(*_inputs(2, 300, 120, 6, 2, 128, 128, torch.bfloat16), window_size=window)


@pytest.mark.gpu
@pytest.mark.parametrize("h,hkv", [(6, 6), (6, 3), (6, 1)])
@pytest.mark.parametrize("window", [(None, None), (0, 0), (64, None), (None, 64), (5, -1)])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_gqa_windows(h, hkv, window, causal):
    _check(*_inputs(3, 300, 457, h, hkv, 128, 128, torch.bfloat16), causal=causal,
           window_size=window)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", [(192, 128), (256, 256)])
@pytest.mark.parametrize("h,hkv", [(6, 3), (6, 1)])
@pytest.mark.parametrize("window", [(None, None), (64, None), (5, -1)])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_wide_gqa_windows(d, dv, h, hkv, window, causal):
    # the swapped dK / dV tiles under GQA / MQA, windows and a window with a negative bound
    _check(*_inputs(2, 300, 457, h, hkv, d, dv, torch.bfloat16), causal=causal,
           window_size=window)  # fmt: skip


# group_heads (a CTA per KV head walks its query heads, dK / dV summed in registers): the
# tuning rule takes it for unmasked GQA grids of 3/4 of a wave or more; forced here on every
# head-dim family, mask and group size
GROUPED = [
    ((64, 64), (6, 3), {}), ((64, 64), (6, 2), {"causal": True}),
    ((96, 96), (6, 3), {"softcap": 5.0}), ((96, 96), (6, 2), {}),
    ((96, 96), (6, 1), {"causal": True}),
    ((128, 128), (6, 3), {}), ((128, 128), (6, 1), {"causal": True}),
    ((128, 128), (6, 2), {"window_size": (64, 5)}), ((128, 128), (8, 2), {"softcap": 5.0}),
    ((192, 192), (6, 2), {"causal": True}), ((192, 128), (6, 3), {}),
    ((256, 256), (6, 2), {}), ((256, 256), (6, 1), {"causal": True}),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dims,heads,kw", GROUPED)
def test_bwd_group_heads(grouped_heads, dims, heads, kw):
    _check(*_inputs(2, 300, 457, *heads, *dims, torch.bfloat16), **kw)
    assert [key.group_heads for key in grouped_heads] == [True], grouped_heads


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [96, 128])
def test_bwd_group_heads_deterministic_bitwise(grouped_heads, causal, d):
    q, k, v, dout = _inputs(2, 1024, 1024, 8, 2, d, d, torch.bfloat16)
    kw = dict(causal=causal, deterministic=True)
    _check(q, k, v, dout, **kw)
    _assert_bitwise(q, k, v, dout, 6, **kw)
    assert {key.group_heads for key in grouped_heads} == {True}


@pytest.mark.gpu
def test_bwd_group_heads_lse_gradient(grouped_heads):
    _check(*_inputs(2, 300, 457, 6, 2, 128, 128, torch.bfloat16), lse_grad=True)
    assert [key.group_heads for key in grouped_heads] == [True]


# dense causal calls of at most 2k query rows at D = 128 (8k at D = 96) run 64-row tiles
# with s_under_dk (bwd_tiles.bwd_short_rows); "table" forces the taller tiles longer calls
# run onto the same shapes, so both kernels see the diagonal, residual tiles and odd lengths
@pytest.mark.gpu
@pytest.mark.parametrize("rows", ["auto", "table"])
@pytest.mark.parametrize("d", [96, 128])
@pytest.mark.parametrize(
    "sq,sk", [(113, 203), (777, 333), (1024, 1024), (2048, 1999), (2100, 1500)]
)
def test_bwd_causal_short_rows(monkeypatch, built_bwd_keys, rows, d, sq, sk):
    import cute_attn.bwd_sm90 as host
    from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig

    if rows == "table":
        monkeypatch.setattr(host, "bwd_short_rows", lambda *_: False)
    _check(*_inputs(sweep_batch(sq, sk), sq, sk, 6, 2, d, d, torch.bfloat16), causal=True)
    taller, limit = {96: (96, 8192), 128: (80, 2048)}[d]
    want = 64 if rows == "auto" and sq <= limit else taller
    assert [BwdTileConfig(*key.tile).tile_m for key in built_bwd_keys] == [want]
    assert [BwdTileConfig(*key.tile).s_under_dk for key in built_bwd_keys] == [want == 64]


# unmasked calls of at most 1k query rows at D = 96 run the same 64-row tiles; the last
# shape is one row past the bucket
@pytest.mark.gpu
@pytest.mark.parametrize("rows", ["auto", "table"])
@pytest.mark.parametrize("sq,sk", [(113, 203), (777, 1333), (1024, 1024), (1025, 999)])
def test_bwd_unmasked_short_rows_d96(monkeypatch, built_bwd_keys, rows, sq, sk):
    import cute_attn.bwd_sm90 as host
    from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig

    if rows == "table":
        monkeypatch.setattr(host, "bwd_short_rows", lambda *_: False)
    _check(*_inputs(sweep_batch(sq, sk), sq, sk, 6, 2, 96, 96, torch.bfloat16))
    want = 64 if rows == "auto" and sq <= 1024 else 96
    assert [BwdTileConfig(*key.tile).tile_m for key in built_bwd_keys] == [want]
    assert [BwdTileConfig(*key.tile).s_under_dk for key in built_bwd_keys] == [want == 64]


# L2 sections (the causal table's launch order): a budget of three (head, batch) pairs makes
# sections of two and a last one of one, so every CTA's renamed (key tile, head, batch) and the
# remainder section are checked against the reference; grouped too (pairs of KV heads)
@pytest.mark.gpu
@pytest.mark.parametrize("d,heads", [(128, (3, 3)), (256, (3, 3)), (128, (6, 3))])
def test_bwd_l2_sections_cover_every_tile(monkeypatch, grouped_heads, d, heads):
    import cute_attn.arch.sm90.bwd_tiles as tc
    from cute_attn.bwd_sm90 import _bwd_key

    sq = 457
    budget = 3 * sq * tc.bwd_l2_row_bytes(d, d)  # three pairs' bytes: sections of two
    monkeypatch.setattr(tc, "BWD_L2_SECTION_BYTES", budget)
    _bwd_key.cache_clear()
    try:
        _check(*_inputs(3, sq, 300, *heads, d, d, torch.bfloat16), causal=True)
    finally:
        _bwd_key.cache_clear()
    (key,) = grouped_heads
    assert key.group_heads == (heads[0] > heads[1]), key
    assert tc.BwdTileConfig(*key.tile).l2_section_bytes == budget, key


# The unmasked deterministic order in sections of two (head, batch) pairs and a partial last
# one (9 pairs): each key tile's turn waits for the tile of the rank before, launched two
# CTAs earlier; against the reference and bitwise over runs
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 96, 128])
def test_bwd_deterministic_in_l2_sections(monkeypatch, built_bwd_keys, d):
    import cute_attn.arch.sm90.bwd_tiles as tc
    from cute_attn.bwd_sm90 import _bwd_key

    sq, pair_bytes = 457, 457 * tc.bwd_l2_row_bytes(d, d)
    # D = 96 takes half the table's budget: 3 pairs' bytes either way (a section of 2)
    monkeypatch.setattr(tc, "BWD_L2_SECTION_BYTES", (6 if d == 96 else 3) * pair_bytes)
    _bwd_key.cache_clear()
    try:
        q, k, v, dout = _inputs(3, sq, 1000, 3, 3, d, d, torch.bfloat16)
        _check(q, k, v, dout, deterministic=True)
        _assert_bitwise(q, k, v, dout, 6, deterministic=True)
    finally:
        _bwd_key.cache_clear()
    assert {tc.BwdTileConfig(*key.tile).l2_section_bytes for key in built_bwd_keys} == {
        3 * pair_bytes
    }, built_bwd_keys


# BwdTileConfig.l2_last_sections: sections of two (head, batch) pairs (a budget of three
# pairs' bytes) over 9 pairs, the last 2 / 3 sections (the partial one among them) launched
# as one; causal, and the unmasked deterministic order, whose turns wait for the rank before
# (the merged section still launches it first), bitwise over runs
@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(96, 96), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("last", [2, 3])
def test_bwd_l2_last_sections(monkeypatch, built_bwd_keys, dims, last):
    from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig, bwd_l2_row_bytes

    d, dv = dims
    sq = 457
    budget = 3 * sq * bwd_l2_row_bytes(d, dv)
    force_bwd_tile(monkeypatch, l2_section_bytes=budget, l2_last_sections=last, tail_split=False)
    _check(*_inputs(3, sq, 300, 3, 3, d, dv, torch.bfloat16), causal=True)
    q, k, v, dout = _inputs(3, sq, 1000, 3, 3, d, dv, torch.bfloat16)
    _check(q, k, v, dout, deterministic=True)
    _assert_bitwise(q, k, v, dout, 3, deterministic=True)
    cfgs = [BwdTileConfig(*key.tile) for key in built_bwd_keys]
    assert cfgs and all(c.l2_last_sections == last for c in cfgs), cfgs


# BwdTileConfig.dq_writers = 2 / 3: the writer warps take the query tiles in turn, each
# handed its tiles on barriers of its own (the consumers pick them by Q stage with two
# writers on two stages, by counting the walk with three); against the
# reference, and in the deterministic order bitwise over runs, on every head dim's tile,
# unmasked and causal, odd lengths (a tile count no multiple of the writers) and a
# group_heads CTA (its tile count runs on over the query heads)
@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (128, 128), (192, 192), (192, 128),
                                  (256, 256)])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("det", [False, True])
@pytest.mark.parametrize("writers", [2, 3])
def test_bwd_dq_writers(monkeypatch, built_bwd_keys, dims, causal, det, writers):
    from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig

    force_bwd_tile(monkeypatch, dq_writers=writers)
    q, k, v, dout = _inputs(2, 333, 777, 4, 2, *dims, torch.bfloat16)
    _check(q, k, v, dout, deterministic=det, causal=causal)
    if det:
        _assert_bitwise(q, k, v, dout, 5, deterministic=True, causal=causal)
    cfgs = [BwdTileConfig(*key.tile) for key in built_bwd_keys]
    assert cfgs and all(c.dq_writers == writers for c in cfgs), cfgs


# BwdTileConfig.det_poll_early: each writer polls its tile's deterministic turn before the
# consumers stage the partial (not after): right, and bitwise over runs, on every head dim's
# tile, unmasked and causal, with the table's two writers and with three, and grouped
@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (128, 128), (192, 192), (192, 128),
                                  (256, 256)])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("writers", [2, 3])
def test_bwd_det_poll_early(monkeypatch, built_bwd_keys, dims, causal, writers):
    from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig

    force_bwd_tile(monkeypatch, det_poll_early=True, dq_writers=writers)
    q, k, v, dout = _inputs(2, 333, 777, 4, 2, *dims, torch.bfloat16)
    _check(q, k, v, dout, deterministic=True, causal=causal)
    _assert_bitwise(q, k, v, dout, 5, deterministic=True, causal=causal)
    cfgs = [BwdTileConfig(*key.tile) for key in built_bwd_keys]
    assert cfgs and all(c.det_poll_early and c.dq_writers == writers for c in cfgs), cfgs


def _force_tail_split(monkeypatch, split):
    """BwdTileConfig.tail_split on (L2 sections off: the split takes the plain launch order)
    and the split `split(tiles)` -> (tail tiles, parts) instead of the model's; returns the
    splits the backward launched."""
    import cute_attn.bwd_sm90 as host

    force_bwd_tile(monkeypatch, tail_split=True, l2_section_bytes=0)
    launched = []

    def forced(tiles, sms, steps, post_overlap):
        launched.append(split(tiles))
        return launched[-1]

    monkeypatch.setattr(host, "_tail_split", forced)
    return launched


def _assert_dkv_bitwise(q, k, v, dout, runs, **kw):
    """dK and dV bitwise equal over `runs` calls: a split tile's parts are summed in part order
    whichever ends last (dQ's reduce-adds are unordered outside the deterministic mode)."""
    first = _grads(lambda a, b, c: flash_attn_func(a, b, c, **kw), q, k, v, dout)[2:]
    for _ in range(runs - 1):
        again = _grads(lambda a, b, c: flash_attn_func(a, b, c, **kw), q, k, v, dout)[2:]
        for a, b in zip(first, again):
            assert torch.equal(a, b), "split tiles' dK / dV differ between runs"


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (128, 128), (192, 192), (192, 128),
                                  (256, 256)])  # fmt: skip
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window_size": (100, 50)}, {"softcap": 5.0}])
@pytest.mark.parametrize("parts", [2, 3, 4])
def test_bwd_tail_split(monkeypatch, built_bwd_keys, dims, kw, parts):
    from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig

    # every key tile split (each one's fixup), whatever the model says: 333 query rows over
    # 777 keys leave the causal mask's last key tiles one or two query tiles, so some parts
    # walk none; with post_overlap (D <= 128) the postprocess waits for split tiles' counts
    launched = _force_tail_split(monkeypatch, lambda tiles: (tiles, parts))
    q, k, v, dout = _inputs(2, 333, 777, 4, 2, *dims, torch.bfloat16)
    _check(q, k, v, dout, **kw)
    _assert_dkv_bitwise(q, k, v, dout, 3, **kw)
    assert launched and all(s[1] == parts for s in launched), launched
    cfgs = [BwdTileConfig(*key.tile) for key in built_bwd_keys]
    assert cfgs and all(c.tail_split for c in cfgs), cfgs


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_tail_split_last_wave(monkeypatch, d, causal):
    # a third of the grid's tiles split, the rest whole (the launch's two kinds of CTA mixed,
    # the linear grid's coordinates across both), on a longer walk; fp16 too. One KV head a
    # query head: this grid's GQA would take group_heads, which tail_split is not built for
    launched = _force_tail_split(monkeypatch, lambda tiles: (tiles // 3, 3))
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v, dout = _inputs(2, 1000, 1100, 6, 6, d, d, dtype)
        _check(q, k, v, dout, causal=causal)
    assert launched and all(0 < s[0] and s[1] == 3 for s in launched), launched


@pytest.mark.gpu
def test_bwd_tail_split_model(monkeypatch):
    # the table's tail_split and the model's own choice on this device: D = 256 (no
    # post_overlap, so no walk-length floor), heads picked so the grid's last wave is a few
    # tiles (13 key tiles of 64 x 2 batches x h), which it splits; 16 query tiles a walk
    import cute_attn.bwd_sm90 as host

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    h = next(h for h in range(sms // 26 + 1, 4 * sms) if 1 <= (26 * h) % sms <= 16)
    chosen = []
    model = host._tail_split

    def spy(*args):
        chosen.append(model(*args))
        return chosen[-1]

    monkeypatch.setattr(host, "_tail_split", spy)
    q, k, v, dout = _inputs(2, 1024, 777, h, h, 256, 256, torch.bfloat16)
    _check(q, k, v, dout)
    assert chosen and chosen[0][1] > 1 and chosen[0][0] == (26 * h) % sms, chosen


# post_overlap and pre_overlap past D = 128 (the table takes them up to 128; gpu_pending.sh
# balance_ab times them on the wide tiles): the main kernel counts its CTAs' landed dQ adds
# for the waiting postprocess and waits for the persistent preprocess's rows a query head.
# Against the reference on every mask, softcap and the deterministic order (bitwise over
# runs), GQA, odd lengths; then on six heads of longer walks, fp16 too, and with tail_split's
# parts (a split tile counts itself done once, by its last part)
@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(192, 192), (192, 128), (256, 256)])
@pytest.mark.parametrize(
    "kw",
    [{}, {"causal": True}, {"window_size": (100, 50)}, {"softcap": 5.0},
     {"deterministic": True}, {"deterministic": True, "causal": True}],
)  # fmt: skip
def test_bwd_overlaps_wide(monkeypatch, built_bwd_keys, dims, kw):
    from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig

    force_bwd_tile(monkeypatch, post_overlap=True, pre_overlap=True)
    q, k, v, dout = _inputs(2, 333, 777, 4, 2, *dims, torch.bfloat16)
    _check(q, k, v, dout, **kw)
    if kw.get("deterministic"):
        _assert_bitwise(q, k, v, dout, 3, **kw)
    cfgs = [BwdTileConfig(*key.tile) for key in built_bwd_keys]
    assert cfgs and all(c.post_overlap and c.pre_overlap for c in cfgs), cfgs


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(192, 192), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_bwd_overlaps_wide_long(monkeypatch, dims, causal, split):
    force_bwd_tile(monkeypatch, post_overlap=True, pre_overlap=True)
    if split:  # (the forces compose: this one wraps the one above)
        launched = _force_tail_split(monkeypatch, lambda tiles: (tiles // 3, 3))
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v, dout = _inputs(2, 1000, 1100, 6, 6, *dims, dtype)
        _check(q, k, v, dout, causal=causal)
    if split:
        assert launched and all(0 < s[0] and s[1] == 3 for s in launched), launched


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
def test_bwd_det_poll_early_group_heads(monkeypatch, grouped_heads, d):
    force_bwd_tile(monkeypatch, det_poll_early=True)
    q, k, v, dout = _inputs(2, 301, 457, 6, 2, d, d, torch.bfloat16)
    _check(q, k, v, dout, deterministic=True, causal=True)
    _assert_bitwise(q, k, v, dout, 3, deterministic=True, causal=True)
    assert grouped_heads and all(key.group_heads for key in grouped_heads), grouped_heads


@pytest.mark.gpu
@pytest.mark.parametrize("d", [96, 128, 256])
@pytest.mark.parametrize("writers", [2, 3])
def test_bwd_dq_writers_group_heads(monkeypatch, grouped_heads, d, writers):
    force_bwd_tile(monkeypatch, dq_writers=writers)
    q, k, v, dout = _inputs(2, 301, 457, 6, 2, d, d, torch.bfloat16)
    _check(q, k, v, dout, deterministic=True, causal=True)
    _assert_bitwise(q, k, v, dout, 3, deterministic=True, causal=True)
    assert grouped_heads and all(key.group_heads for key in grouped_heads), grouped_heads


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq,sk", [(333, 777), (777, 333), (1024, 1024)])
@pytest.mark.parametrize(
    "kw",
    [{}, {"causal": True}, {"window_size": (100, 50)}, {"window_size": (200, None)},
     {"causal": True, "window_size": (300, None)}],
)  # fmt: skip
def test_bwd_split_mask_loops_every_segment(monkeypatch, d, sq, sk, kw):
    # split_mask_loops forced on whatever the tuning table says (it turns it on only for the
    # D=64 causal tile): a left bound adds the third, left-edge segment, and the key tile
    # crossing seqlen_k walks every query tile in the masked segment
    force_bwd_tile(monkeypatch, split_mask_loops=True)
    _check(*_inputs(2, sq, sk, 4, 2, d, d, torch.bfloat16), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 4, 9])
def test_bwd_batches_and_long(b):
    _check(*_inputs(b, 4224 // b, 4224 // b, 4, 4, 128, 128, torch.bfloat16), causal=True)


@pytest.mark.gpu
def test_bwd_empty_rows_and_unseen_keys():
    # Sq > Sk causal: the first Sq - Sk rows see nothing (zero dQ rows, no NaN)
    q, k, v, dout = _inputs(2, 300, 40, 4, 2, 64, 64, torch.float16)
    got = _check(q, k, v, dout, causal=True, softmax_scale=0.3)
    assert (got[0][:, :260] == 0).all()
    # a left window leaves the first keys unseen by any query: their dK / dV are exactly 0
    got = _check(*_inputs(2, 64, 400, 4, 4, 128, 128, torch.bfloat16), window_size=(10, 0))
    assert (got[1][:, :300] == 0).all() and (got[2][:, :300] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_lse_gradient(causal):
    _check(*_inputs(2, 257, 300, 4, 2, 128, 128, torch.bfloat16), lse_grad=True, causal=causal)


@pytest.mark.gpu
def test_bwd_only_lse_used():
    q, k, v, _ = _inputs(1, 100, 120, 2, 2, 64, 64, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    _, lse = flash_attn_func(q, k, v)
    lse.sum().backward()  # out unused: its gradient arrives as None
    assert last_backward_dispatch().impl == "sm90_bwd"
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    attention_ref(qr, kr, vr)[1].sum().backward()
    for a, r in ((q, qr), (k, kr), (v, vr)):
        rg = torch.zeros_like(r) if r.grad is None else r.grad  # lse does not depend on v
        assert (a.grad.float() - rg).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", HEAD_DIMS)
@pytest.mark.parametrize("kw", [{"causal": True}, {"window_size": (100, 30)}, {}])
@pytest.mark.parametrize("sq,sk", [(300, 457), (457, 300)])
def test_bwd_deterministic_matches_reference(d, dv, kw, sq, sk):
    _check(*_inputs(3, sq, sk, 6, 2, d, dv, torch.bfloat16), deterministic=True, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dv", [(128, 128), (192, 192), (192, 128), (256, 256)])
def test_bwd_deterministic_bitwise_over_20_runs(causal, d, dv):
    # long enough that many key tiles add into each query tile's dQ (where order matters)
    q, k, v, dout = _inputs(2, 2048, 2048, 4, 2, d, dv, torch.bfloat16)
    _assert_bitwise(q, k, v, dout, 20, causal=causal, deterministic=True)


@pytest.mark.gpu
def test_bwd_unserved_problem_falls_back_to_reference(monkeypatch):
    # every head dim the forward kernel serves has a backward kernel now, so no real problem
    # reaches the fallback after a kernel forward: force the backward's reason to check it
    # end to end (the exact reference backward, recorded with its reason)
    import cute_attn.bwd_sm90 as host

    monkeypatch.setattr(host, "bwd_unsupported_reason", lambda p, tensors: "forced by the test")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _check(*_inputs(1, 70, 90, 2, 1, 256, 256, torch.bfloat16), causal=True,
               expect="reference")  # fmt: skip
    assert "forced by the test" in last_backward_dispatch().reason


@pytest.mark.gpu
def test_bwd_noncontiguous_dout_and_views():
    qkv = torch.randn(2, 333, 3, 8, 128, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(2, 8, 333, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    _check(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dout, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True])
def test_bwd_torch_compile_training_step(dynamic, monkeypatch):
    # a compiled training step (fullgraph) against eager; dynamic=True traces symbolic sequence
    # lengths, so one compiled step runs the SM90 kernels at three (odd, past a tile, Sk > Sq)
    torch._dynamo.reset()

    def step(q, k, v, dout):
        out, lse = flash_attn_func(q, k, v, causal=True)
        return (out.float() * dout.float()).sum() + lse.sum() * 1e-3

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    for sq, sk in ((200, 207), (333, 340), (517, 524)) if dynamic else ((256, 256),):
        q, k, v, dout = _inputs(2, sq, sk, 4, 2, 128, 128, torch.bfloat16)
        grads = []
        for fn in (step, compiled):
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
            # the record is process-wide: cleared, so each backward must leave its own
            monkeypatch.setattr(cute_attn.dispatch, "_last_backward", None)
            fn(qq, kk, vv, dout).backward()
            assert last_backward_dispatch().impl == "sm90_bwd"
            grads.append((qq.grad, kk.grad, vv.grad))
        for a, b in zip(*grads):
            # same kernels, but dQ partials are added in arrival order: not bitwise
            assert (a.float() - b.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_bwd_cuda_graph_replay_matches_eager():
    q, k, v, dout = _inputs(2, 300, 300, 4, 2, 128, 128, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fwd_bwd():
        out, _ = flash_attn_func(q, k, v, causal=True)
        return torch.autograd.grad((out.float() * dout.float()).sum(), (q, k, v))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: compile and load every kernel outside the capture
            eager = fwd_bwd()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fwd_bwd()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert (a.float() - b.float()).abs().max().item() < 2e-2


# ---------------------------------------------------------------- CPU: compile for sm_90a
_AUX_SNIPPET = r"""
import json, os, sys, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.arch.common.dq_flat import DqFlatTile
from cute_attn.arch.sm90.compile import compile_bwd_postprocess, compile_bwd_preprocess
from cute_attn.aot import _sass
rows = []
for dt in ("bfloat16", "float16"):
    # D = 96's flat tile is compact (its accumulator rows 96 floats, DqFlatTile.dims)
    for d, tm, flat in ((64, 0, ()), (96, 0, ()), (128, 0, ()), (128, 80, ()), (256, 64, ()),
                        (64, 0, (128, 1, 2)), (96, 0, (96, 2, 1, 96)), (128, 80, (80, 2, 1))):
        flat_dim = DqFlatTile(*flat).acc_dim if flat else 0
        for kind, build in (
            ("pre", lambda: compile_bwd_preprocess(dt, d, d, opts, varlen_tile_m=tm,
                                                   dq_flat_dim=flat_dim)),
            ("post", lambda: compile_bwd_postprocess(dt, d, opts, varlen_tile_m=tm, dq_flat=flat)),
        ):
            opts = f"--keep-cubin --dump-dir={tempfile.mkdtemp()}"
            sass = _sass(build().__cubin__)
            rows.append({"kind": kind, "dtype": dt, "d": d, "varlen": tm, "sass": bool(sass),
                         "flat": list(flat), "sts16": sass.count("STS.U16"),
                         "ldg128": sass.count("LDG.E.128"), "stg128": sass.count("STG.E.128"),
                         "stg64": sass.count("STG.E.64"),
                         "spills": sass.count("STL") + sass.count("LDL")})
print(json.dumps(rows))
"""


@pytest.mark.compile
def test_compile_bwd_aux_kernels(tmp_path):
    # dense and packed (varlen, rows padded per sequence) forms of both kernels
    rows = run_json_snippet(_AUX_SNIPPET, tmp_path)
    assert len(rows) == 32
    for r in rows:
        if not r["sass"]:
            pytest.skip("nvdisasm not installed: cannot read SASS")
        # 16-byte vectors of dO and O in, of the cleared dQ accumulator out (pre); the fp32
        # accumulator in 16-byte vectors, each out as 4 16-bit elements in one 8-byte store
        # (post, bwd_preprocess.lane_vectors). A register-order tile (dq_flat): its 16-byte
        # runs in, each element to its (row, dim) place in smem, rows out in 16-byte stores
        assert r["spills"] == 0, r
        if r["flat"] and r["kind"] == "post":
            # 16-byte runs a thread, over the tensor's head dims only: D = 96's rows 96..127
            # of the 128-row flat tile are whole warp runs the main kernel does not add
            tm = r["flat"][0]
            runs = -(-tm * r["d"] // (4 * 128))
            assert r["ldg128"] == runs and r["sts16"] == 4 * runs and r["stg128"] >= 1, r
        elif r["kind"] == "pre":
            assert r["ldg128"] >= 2 and r["stg128"] >= 1, r
        else:
            assert r["ldg128"] >= 1 and r["stg64"] == r["ldg128"] and r["stg128"] == 0, r


_BWD_MASK_LOOP_SNIPPET = r"""  # run after MASK_WINDOWS
import dataclasses, json, os, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.sm90.compile import BwdSpec, compile_bwd
from cute_attn.arch.sm90.bwd_tiles import bwd_tile_config
out = {}
for split in (True, False):
    cfg = dataclasses.replace(bwd_tile_config(64, 64, True, False), split_mask_loops=split)
    spec = BwdSpec("bfloat16", 64, 64, 8, 8, False, True, False, cfg)
    fn = compile_bwd(spec, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}")
    sass = _sass(fn.__cubin__)
    windows = mask_windows(sass)  # two per main-loop body (after S^T / dP^T and after dQ)
    spills = sass.count("STL") + sass.count("LDL")
    out[str(split)] = {"windows": windows, "spills": spills, "sass": bool(sass),
                       "table": cfg == bwd_tile_config(64, 64, True, False)}
print(json.dumps(out))
"""


@pytest.mark.compile
def test_bwd_split_mask_loops_leaves_the_middle_loop_mask_free(tmp_path):
    # D=64 causal (the table's split variant): the query tiles every key of the CTA sees run
    # in a loop with no mask select; the diagonal loop keeps the mask (behind its test)
    r = run_json_snippet(MASK_WINDOWS + _BWD_MASK_LOOP_SNIPPET, tmp_path, timeout=900)
    on, off = r["True"], r["False"]
    if not on["sass"]:
        pytest.skip("nvdisasm not installed: cannot read SASS")
    assert on["table"] and not off["table"], r
    assert on["spills"] == 0 and off["spills"] == 0, r
    assert len(on["windows"]) == 4 and on["windows"][0] > 0 and on["windows"][1:] == [0, 0, 0], r
    assert len(off["windows"]) == 2 and off["windows"][0] > 0 and off["windows"][1] == 0, r


_DQ_SWIZZLE_SNIPPET = r"""  # run after HGMMA_SHAPES
import json, os, re, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.sm90.compile import BwdSpec, compile_bwd
from cute_attn.arch.sm90.bwd_tiles import bwd_tile_config
out = {}
for name in ("False", "True", "d64", "d96"):
    det, d = name == "True", {"d64": 64, "d96": 96}.get(name, 128)
    cfg = bwd_tile_config(d, d, True, False, deterministic=det)
    spec = BwdSpec("bfloat16", d, d, 8, 8, False, True, False, cfg, deterministic=det)
    sass = _sass(compile_bwd(spec, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}").__cubin__)
    spills = sass.count("STL") + sass.count("LDL")
    # the writer waits for warpgroup 1's own half on named barrier 5 (one warpgroup + the
    # writer warp: 160 = 0xa0 threads), not for the whole tile on 3 (both: 288 = 0x120)
    shapes = hgmma_shapes(sass)
    out[name] = {"swizzle": cfg.dq_swizzle, "sass": bool(sass), "shapes": shapes,
                     "tile": [cfg.tile_m, cfg.dq_swap_ab], "spills": spills,
                     "reduces": sass.count("UTMAREDG"), "sts32": len(re.findall(r"STS \[", sass)),
                     "sts128": sass.count("STS.128 "), "flat": cfg.dq_flat,
                     # a 160-thread handoff (one warpgroup and a writer): id 5, or a register
                     # under several writers (BwdTileConfig.dq_writers: 5 / 11 / 15 by turn)
                     "wg_handoff": bool(re.search(r"BAR\.SYNC\.DEFER_BLOCKING (0x5|R\d+), 0xa0",
                                                  sass)),
                     "joint_handoff": bool(re.search(r"BAR\.[A-Z_.]+ [^,;]+, 0x120 ;", sass))}
print(json.dumps(out))
"""


@pytest.mark.compile
def test_bwd_swapped_dq_reaches_the_kernel(tmp_path):
    # the table's D=128 tile is what the kernel builds, default and deterministic: 80 query
    # rows, dQ^T = K^T dS^T as 64 x 80 wgmmas with a transposed A (K^T), each warpgroup
    # handing its own head-dim half to the writer, staged in register order (dq_flat): 10
    # 128-bit stores a thread and tile (40 floats), one contiguous reduce-add a half
    r = run_json_snippet(HGMMA_SHAPES + _DQ_SWIZZLE_SNIPPET, tmp_path, timeout=900)
    default, det = r["False"], r["True"]
    if not default["sass"]:
        pytest.skip("nvdisasm not installed: cannot read SASS")
    for v in (default, det):
        assert v["tile"] == [80, True] and v["swizzle"] == 128 and v["spills"] == 0, r
        assert v["wg_handoff"] and not v["joint_handoff"], r
        # per k-step of 16: S^T and dP^T over D = 128 (8 each), dQ^T over the 128 keys (8);
        # dV and dK over the 80 query rows (5 each)
        assert v["shapes"] == {"64x80x16": 16, "64x80x16 tnspA": 8, "64x128x16": 10}, r
        assert v["flat"] and v["sts128"] == 10, r
    # one reduce-add a warpgroup's half (dq_flat: each a contiguous run)
    assert default["reduces"] == det["reduces"] == 2, r
    # D=64 (the table's 128-row tile): one 64-row head-dim tile whose query columns the
    # warpgroups split (64 x 64 wgmmas, two loops under the split mask), staged in register
    # order (8 128-bit stores a thread and tile in each loop), each warpgroup's half handed
    # over on its own barriers and added as its own run (dq_wg_handoff)
    d64 = r["d64"]
    assert d64["tile"] == [128, True] and d64["spills"] == 0, r
    assert d64["shapes"] == {"64x128x16": 16, "64x64x16": 32, "64x64x16 tnspA": 16}, r
    assert d64["flat"] and d64["reduces"] == 2 and d64["sts128"] == 16, r
    assert d64["wg_handoff"] and not d64["joint_handoff"], r
    # D=96 (96 query rows): S^T, dP^T over its own 96 columns (6 k-steps each) and dV, dK as
    # N = 96 over the 96 rows (6 each); only dQ^T keeps 128 head-dim rows (K's padded tile,
    # 2 x 64 with a transposed A over the 128 keys: 8)
    d96 = r["d96"]
    assert d96["tile"] == [96, True] and d96["spills"] == 0, r
    assert d96["shapes"] == {"64x96x16": 24, "64x96x16 tnspA": 8}, r
    assert d96["wg_handoff"] and not d96["joint_handoff"], r
    assert d96["flat"] and d96["sts128"] == 12, r
    # dq_skip_zero_rows: the first half in two boxes of two warp runs, of the second half
    # only the box of rows 64..95 (rows 96..127 of dQ^T are K's zero columns)
    assert d96["reduces"] == 3, r


_S_UNDER_DK_SNIPPET = r"""  # run after HGMMA_SHAPES
import json, os, re, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.sm90.compile import BwdSpec, compile_bwd
from cute_attn.arch.sm90.bwd_tiles import bwd_tile_config
out = {}
for name, group in (("dense", False), ("group", True)):
    cfg = bwd_tile_config(128, 128, False, False, group_heads=group)
    spec = BwdSpec("bfloat16", 128, 128, 8, 2 if group else 8, False, False, False, cfg)
    sass = _sass(compile_bwd(spec, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}").__cubin__)
    shapes = hgmma_shapes(sass)
    out[name] = {"sass": bool(sass), "on": cfg.s_under_dk, "tile_m": cfg.tile_m,
                 "spills": sass.count("STL") + sass.count("LDL"), "shapes": shapes,
                 "waits": len(re.findall(r"WARPGROUP\.DEPBAR", sass))}
print(json.dumps(out))
"""


@pytest.mark.compile
def test_bwd_s_under_dk_reaches_the_kernel(tmp_path):
    # D=128 unmasked (the table's s_under_dk): S^T = K Q^T is issued twice in the code, once
    # before the loop and once at the end of each query tile (behind its dK), and ptxas keeps
    # the wgmmas asynchronous: a handful of waits, not one after every wgmma (42 here when it
    # serialized them, for want of registers or over the loop's exit), and no spills
    r = run_json_snippet(HGMMA_SHAPES + _S_UNDER_DK_SNIPPET, tmp_path, timeout=900)
    if not r["dense"]["sass"]:
        pytest.skip("nvdisasm not installed: cannot read SASS")
    for name, rows in (("dense", 80), ("group", 64)):
        v = r[name]
        assert v["on"] and v["tile_m"] == rows and v["spills"] == 0, r
        n = str(rows)
        # per k-step of 16: S^T twice and dP^T over D = 128 (8 each), dQ^T over the 128 keys
        # (8, transposed A); dV and dK over the query rows (rows / 16 each)
        assert v["shapes"] == {f"64x{n}x16": 24, f"64x{n}x16 tnspA": 8,
                               "64x128x16": rows // 8}, r  # fmt: skip
        assert v["waits"] <= 6, r


def _force_end_aligned(monkeypatch, **fields):
    """BwdTileConfig.end_aligned (and `fields`) on every dense key, and no short-rows bucket
    (its 64-row tiles keep the swizzled staging, which end_aligned rejects), so the table's
    flat-dQ 80- / 96-row tiles run with it whatever the length."""
    import cute_attn.bwd_sm90 as host

    force_bwd_tile(monkeypatch, when=lambda p: not p.varlen, end_aligned=True, **fields)
    monkeypatch.setattr(host, "bwd_short_rows", lambda *a, **kw: False)


# BwdTileConfig.end_aligned: the query tiles aligned to the sequence's end (333 rows: 67
# padding rows before row 0 on the 80-row tile, 51 on the 96-row one), against the reference
# under the causal mask with as many keys, more and fewer (rows that see no key), two windows,
# the lse gradient and unmasked; the deterministic order bitwise over runs (softcap's tiles
# have no flat dQ)
@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(96, 96), (128, 128)])
@pytest.mark.parametrize(
    "sk,kw",
    [
        (333, {"causal": True}),
        (777, {"causal": True}),
        (201, {"causal": True}),
        (500, {"window_size": (100, 50)}),
        (600, {"window_size": (200, 0)}),
        (333, {}),
    ],
)  # fmt: skip
def test_bwd_end_aligned(monkeypatch, built_bwd_keys, dims, sk, kw):
    from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig

    _force_end_aligned(monkeypatch)
    q, k, v, dout = _inputs(2, 333, sk, 4, 2, *dims, torch.bfloat16)
    _check(q, k, v, dout, **kw)
    if kw == {"causal": True} and sk == 333:
        _check(q, k, v, dout, lse_grad=True, **kw)
        _check(q, k, v, dout, deterministic=True, **kw)
        _assert_bitwise(q, k, v, dout, 3, deterministic=True, **kw)
    cfgs = [BwdTileConfig(*key.tile) for key in built_bwd_keys]
    assert cfgs and any(c.end_aligned for c in cfgs), cfgs


# ... on longer rows (the persistent preprocess's items over several tiles), fp16, a length
# that is a multiple of the tile (no padding: the plain grid) and one tile of rows
@pytest.mark.gpu
@pytest.mark.parametrize("sq", [80, 2001, 2080])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bwd_end_aligned_lengths(monkeypatch, built_bwd_keys, sq, dtype):
    from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig

    _force_end_aligned(monkeypatch)
    _check(*_inputs(1, sq, sq, 3, 3, 128, 128, dtype), causal=True)
    cfgs = [BwdTileConfig(*key.tile) for key in built_bwd_keys]
    assert cfgs and all(c.end_aligned for c in cfgs), cfgs


# ... with the preprocess launched before the main grid (pre_overlap off: its one-row-a-group
# form, front-padded too) and the postprocess after it
@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(96, 96), (128, 128)])
def test_bwd_end_aligned_no_overlap(monkeypatch, built_bwd_keys, dims):
    from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig

    _force_end_aligned(monkeypatch, pre_overlap=False, post_overlap=False)
    _check(*_inputs(2, 333, 400, 4, 2, *dims, torch.bfloat16), causal=True)
    cfgs = [BwdTileConfig(*key.tile) for key in built_bwd_keys]
    assert cfgs and all(c.end_aligned and not c.pre_overlap for c in cfgs), cfgs


# BwdTileConfig.epilogue_first (dK / dV stored before the wait for the dQ writer's last add)
# on every dense key: each head dim's table tile (flat, swizzled, split-column and wide dQ
# stagings; end_aligned's causal tiles) causal and unmasked, GQA over the host sum; under the
# causal mask the deterministic order bitwise, and tail_split's parts (each one's fixup, then
# the epilogue)
@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)])
def test_bwd_epilogue_first(monkeypatch, built_bwd_keys, dims):
    from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig

    force_bwd_tile(monkeypatch, when=lambda p: not p.varlen, epilogue_first=True)
    q, k, v, dout = _inputs(2, 1000, 1100, 4, 2, *dims, torch.bfloat16)
    _check(q, k, v, dout)
    _check(q, k, v, dout, causal=True)
    _check(q, k, v, dout, causal=True, deterministic=True)
    _assert_bitwise(q, k, v, dout, 3, causal=True, deterministic=True)
    cfgs = [BwdTileConfig(*key.tile) for key in built_bwd_keys]
    assert cfgs and all(c.epilogue_first for c in cfgs), cfgs
    launched = _force_tail_split(monkeypatch, lambda tiles: (tiles // 3, 3))  # over the above
    q, k, v, dout = _inputs(2, 1000, 1100, 6, 6, *dims, torch.bfloat16)
    _check(q, k, v, dout, causal=True)
    _assert_dkv_bitwise(q, k, v, dout, 3, causal=True)
    assert launched and all(0 < s[0] and s[1] == 3 for s in launched), launched


# BwdTileConfig.persistent_ctas: 5 CTAs over 72 tiles (each carries its pipelines and the dQ
# handoff's ring from tile to tile, and stores dK / dV from registers, the last key tile's
# rows past seqlen_k not stored) and 132 (more CTAs than tiles: some walk none), at a fixed
# stride and from the tile counter (persistent_counter: the ring that hands tiles on), on each
# head dim's table tile (D <= 128: flat and swizzled dQ stagings, the short-rows tiles under
# the causal mask, end_aligned), unmasked, causal over more keys than queries, a window and
# the lse gradient; the preprocess beside the grid and before it
@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (128, 128)])
@pytest.mark.parametrize("ctas", [5, 132])
@pytest.mark.parametrize("counter", [False, True], ids=["stride", "counter"])
def test_bwd_persistent(monkeypatch, built_bwd_keys, dims, ctas, counter):
    from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig

    force_bwd_tile(
        monkeypatch, when=lambda p: not p.varlen, persistent_ctas=ctas, tail_split=False,
        persistent_counter=counter,
    )  # fmt: skip
    q, k, v, dout = _inputs(2, 1000, 1100, 4, 4, *dims, torch.bfloat16)
    _check(q, k, v, dout)
    _check(q, k, v, dout, causal=True)
    _check(q, k, v, dout, window_size=(300, 100), lse_grad=True)
    cfgs = [BwdTileConfig(*key.tile) for key in built_bwd_keys]
    assert cfgs and all(c.persistent_ctas == ctas for c in cfgs), cfgs
    if ctas == 5:
        force_bwd_tile(monkeypatch, pre_overlap=False, post_overlap=False)
        _check(*_inputs(1, 2500, 2500, 3, 3, *dims, torch.float16), causal=True)


_PERSISTENT_SNIPPET = r"""
import dataclasses, json, os, re, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.sm90.compile import BwdSpec, compile_bwd
from cute_attn.arch.sm90.bwd_tiles import bwd_tile_config
out = {}
# "96s": D = 96's short-rows tile (64 swizzled rows with s_under_dk; D=96 4k causal's)
for name, causal, counter in ((128, True, False), (96, True, False), (64, False, False),
                              ("96s", True, False), ("128c", True, True)):
    d = 128 if counter else int(str(name).rstrip("s"))
    short = str(name).endswith("s")
    for ctas in (132,) if counter else (0, 132):
        cfg = dataclasses.replace(bwd_tile_config(d, d, causal, False, short=short),
                                  persistent_ctas=ctas, tail_split=False,
                                  persistent_counter=counter)
        spec = BwdSpec("bfloat16", d, d, 8, 8, False, causal, False, cfg)
        sass = _sass(compile_bwd(spec, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}").__cubin__)
        out[f"{name} {ctas}"] = {
            "sass": bool(sass), "spills": sass.count("STL") + sass.count("LDL"),
            "hgmma": sass.count("HGMMA"), "tma_store": sass.count("UTMASTG"),
            "stg": len(re.findall(r"\bSTG\.E\b", sass)), "atom": sass.count("ATOMG")}
print(json.dumps(out))
"""


@pytest.mark.compile
def test_bwd_persistent_builds(tmp_path):
    # the persistent grid's kernels keep the one-tile grid's wgmmas, spill-free, and store
    # dK / dV from registers (32-bit stores) instead of by TMA
    r = run_json_snippet(_PERSISTENT_SNIPPET, tmp_path, timeout=1200)
    if not r["128 0"]["sass"]:
        pytest.skip("nvdisasm not installed: cannot read SASS")
    for d in (128, 96, 64, "96s"):
        one, many = r[f"{d} 0"], r[f"{d} 132"]
        assert one["spills"] == many["spills"] == 0 and one["hgmma"] == many["hgmma"], r
        assert one["tma_store"] > 0 and many["tma_store"] == 0 and many["stg"] > 0, r
    # the tile counter: the same kernel plus the load warp's atomic adds (its first tile's
    # and each next one's)
    counter = r["128c 132"]
    assert counter["spills"] == 0 and counter["hgmma"] == r["128 132"]["hgmma"], r
    assert counter["atom"] == 2 and r["128 132"]["atom"] == 0, r


def test_bwd_persistent_rejects():
    # what the persistent grid is not built for, refused before anything compiles
    from cute_attn.arch.sm90.flash_bwd import FlashBwdSm90

    base = dataclasses.replace(bwd_tile_config(128, 128, True, False), persistent_ctas=132)
    for field, value in (("tail_split", True), ("timeline", True), ("dq_writers", 2)):
        with pytest.raises(ValueError, match="persistent_ctas"):
            dataclasses.replace(base, **{field: value})
    with pytest.raises(ValueError, match="persistent_ctas"):
        dataclasses.replace(base, persistent_ctas=0, persistent_counter=True)
    wide = bwd_tile_config(256, 256, True, False)
    with pytest.raises(ValueError, match="persistent_ctas"):
        dataclasses.replace(wide, persistent_ctas=132, tail_split=False)
    import cutlass

    # (packed sequences: with the dense-only overlaps and end_aligned off, which refuse first)
    packed = dataclasses.replace(base, pre_overlap=False, post_overlap=False, end_aligned=False)
    for cfg, kw in ((base, {"deterministic": True}), (packed, {"varlen": True}),
                    (base, {"group_heads": True})):  # fmt: skip
        with pytest.raises(ValueError, match="persistent_ctas"):
            FlashBwdSm90(cutlass.BFloat16, 128, 128, 4, False, True, False, cfg, **kw)
    FlashBwdSm90(cutlass.BFloat16, 128, 128, 4, False, True, False, base)  # dense: accepted


def test_bwd_end_aligned_needs_flat_dq():
    # its padding rows are the flat tiles' first: the row-order accumulator has none
    with pytest.raises(ValueError, match="end_aligned"):
        dataclasses.replace(bwd_tile_config(128, 128, True, False), dq_flat=False, end_aligned=True)


_END_ALIGNED_SNIPPET = r"""
import dataclasses, json, os, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.common.dq_flat import DqFlatTile
from cute_attn.arch.sm90.compile import (BwdSpec, compile_bwd, compile_bwd_postprocess,
                                         compile_bwd_preprocess)
from cute_attn.arch.sm90.bwd_tiles import bwd_tile_config
def opts():
    return f"--keep-cubin --dump-dir={tempfile.mkdtemp()}"
def info(fn):
    sass = _sass(fn.__cubin__)
    return {"sass": bool(sass), "spills": sass.count("STL") + sass.count("LDL"),
            "hgmma": sass.count("HGMMA")}
out = {}
for d in (96, 128):
    for on in (False, True):
        cfg = dataclasses.replace(bwd_tile_config(d, d, True, False), end_aligned=on)
        spec = BwdSpec("bfloat16", d, d, 8, 8, False, True, False, cfg)
        out[f"main {d} {on}"] = info(compile_bwd(spec, opts()))
    epi = dataclasses.replace(cfg, epilogue_first=True)
    spec = BwdSpec("bfloat16", d, d, 8, 8, False, True, False, epi)
    out[f"main {d} epi"] = info(compile_bwd(spec, opts()))
    flat = cfg.dq_flat_tile(d)
    for persistent in (False, True):
        out[f"pre {d} {persistent}"] = info(compile_bwd_preprocess(
            "bfloat16", d, d, opts(), dq_flat_dim=flat.acc_dim, persistent=persistent,
            front_pad=True))
    out[f"post {d}"] = info(compile_bwd_postprocess(
        "bfloat16", d, opts(), dq_flat=dataclasses.astuple(flat), wait_done=True, front_pad=True))
print(json.dumps(out))
"""


@pytest.mark.compile
def test_bwd_end_aligned_builds(tmp_path):
    # end_aligned's main kernel (D = 96 / 128 causal) keeps the wgmmas of the kernel without
    # it, spill-free, and so does epilogue_first's; the front-padded preprocess (both forms)
    # and postprocess build spill-free
    r = run_json_snippet(_END_ALIGNED_SNIPPET, tmp_path, timeout=1200)
    if not r["main 128 False"]["sass"]:
        pytest.skip("nvdisasm not installed: cannot read SASS")
    assert all(v["spills"] == 0 for v in r.values()), r
    for d in (96, 128):
        hgmma = r[f"main {d} False"]["hgmma"]
        assert r[f"main {d} True"]["hgmma"] == r[f"main {d} epi"]["hgmma"] == hgmma, r


def test_bwd_table_end_aligned_domain():
    # the table's end_aligned: dense causal 80- / 96-row flat tiles, where it was measured
    from cute_attn.arch.sm90.bwd_tiles import bwd_tile_config as table

    for d in (96, 128):
        assert table(d, d, True, False).end_aligned
        assert not table(d, d, False, False).end_aligned
        assert not table(d, d, True, True).end_aligned  # a window
        assert not table(d, d, True, False, softcap=True).end_aligned
        assert not table(d, d, True, False, deterministic=True).end_aligned
        assert not table(d, d, True, False, varlen=True).end_aligned
        assert not table(d, d, True, False, group_heads=True).end_aligned
        assert not table(d, d, True, False, short=True).end_aligned
    assert not any(
        table(d, v, True, False).end_aligned for d, v in ((64, 64), (192, 128), (256, 256))
    )
    assert not any(
        table(*dims, c, False).epilogue_first
        for dims in ((96, 96), (128, 128))
        for c in (False, True)
    )


_TIMELINE_SNIPPET = r"""
import dataclasses, json, os, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.sm90.compile import BwdSpec, compile_bwd
from cute_attn.arch.sm90.bwd_tiles import bwd_tile_config
out = {}
for on in (False, True):
    cfg = dataclasses.replace(bwd_tile_config(128, 128, True, False), timeline=on)
    spec = BwdSpec("bfloat16", 128, 128, 8, 8, False, True, False, cfg)  # causal: right bound
    sass = _sass(compile_bwd(spec, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}").__cubin__)
    out[str(on)] = {"sass": bool(sass), "spills": sass.count("STL") + sass.count("LDL"),
                    "hgmma": sass.count("HGMMA"), "clock": sass.count("SR_CLOCKLO"),
                    "timer": sass.count("SR_GLOBALTIMERLO")}
print(json.dumps(out))
"""


@pytest.mark.compile
def test_bwd_timeline_records_only_when_asked(tmp_path):
    # BwdTileConfig.timeline (scripts/bwd_timeline.py): the D=128 causal kernel reads the SM
    # clock at its six events and the global timer at two, spill-free with the same wgmmas;
    # without it no special register is read
    r = run_json_snippet(_TIMELINE_SNIPPET, tmp_path, timeout=900)
    off, on = r["False"], r["True"]
    if not off["sass"]:
        pytest.skip("nvdisasm not installed: cannot read SASS")
    assert off["clock"] == off["timer"] == 0 and off["spills"] == 0, r
    assert on["clock"] >= 6 and on["timer"] >= 2 and on["spills"] == 0, r
    assert on["hgmma"] == off["hgmma"], r


def test_bwd_timeline_excludes_tail_split():
    # both use the tail workspace
    with pytest.raises(ValueError, match="timeline"):
        dataclasses.replace(bwd_tile_config(128, 128, False, False), timeline=True)


_POST_OVERLAP_SNIPPET = r"""
import json, os, re, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.sm90.compile import (BwdSpec, compile_bwd, compile_bwd_postprocess,
                                         compile_bwd_preprocess)
from cute_attn.arch.sm90.bwd_tiles import bwd_tile_config
def keep():
    return f"--keep-cubin --dump-dir={tempfile.mkdtemp()}"
out = {}
for det in (False, True):
    cfg = bwd_tile_config(128, 128, False, False, deterministic=det)
    spec = BwdSpec("bfloat16", 128, 128, 8, 8, False, False, False, cfg, deterministic=det)
    sass = _sass(compile_bwd(spec, keep()).__cubin__)
    out["det" if det else "main"] = {
        "sass": bool(sass), "on": cfg.post_overlap, "pre_on": cfg.pre_overlap,
        "spills": sass.count("STL") + sass.count("LDL"), "trigger": sass.count("PREEXIT"),
        # (with tail_split, D = 128's table form, a split tile's count returns its value)
        "count": len(re.findall(r"(REDG|ATOMG)\.E\.ADD\.STRONG\.GPU", sass)),
        "poll": len(re.findall(r"LDG\.E\.STRONG\.GPU", sass)),
        "proxy": sass.count("FENCE.VIEW.ASYNC.G"),
    }
flat = bwd_tile_config(128, 128, False, False).dq_flat_tile(128)
fields = (flat.tile_m, flat.parts, flat.groups)
sass = _sass(compile_bwd_postprocess("bfloat16", 128, keep(), dq_flat=fields,
                                     wait_done=True).__cubin__)
out["post"] = {"poll": len(re.findall(r"LDG\.E\.STRONG\.GPU", sass)),
               "sleep": sass.count("NANOSLEEP")}
sass = _sass(compile_bwd_preprocess("bfloat16", 128, 128, keep(), dq_flat_dim=128,
                                    persistent=True).__cubin__)
out["pre"] = {"trigger": sass.count("PREEXIT"), "loads": sass.count("LDG.E.128"),
              "count": len(re.findall(r"REDG\.E\.ADD\.STRONG\.GPU", sass)),
              "spills": sass.count("STL") + sass.count("LDL")}
print(json.dumps(out))
"""


@pytest.mark.compile
def test_bwd_overlaps_reach_every_kernel(tmp_path):
    # post_overlap (the table's choice at D=128 unmasked, default and deterministic order):
    # the main kernel lets its dependent launch (griddepcontrol.launch_dependents, SASS
    # PREEXIT) and counts each CTA done with a release add, spill-free; the waiting
    # postprocess polls its count with strong loads and backs off between them.
    # pre_overlap: the main kernel's load and dQ-writer warps poll their head's ready count
    # with strong loads and fence the async proxy after it; the persistent preprocess lets
    # the main kernel launch, loads its rows' O / dO (4 rows x 2 vectors at D = 128) before
    # any reduction, and counts rows ready with release adds, spill-free
    r = run_json_snippet(_POST_OVERLAP_SNIPPET, tmp_path, timeout=900)
    if not r["main"]["sass"]:
        pytest.skip("nvdisasm not installed: cannot read SASS")
    for v in (r["main"], r["det"]):
        assert v["on"] and v["pre_on"] and v["trigger"] == 1 and v["spills"] == 0, r
        assert v["count"] >= 1 and v["poll"] >= 2 and v["proxy"] >= 2, r
    assert r["post"]["poll"] >= 1 and r["post"]["sleep"] >= 1, r
    assert r["pre"]["trigger"] == 1 and r["pre"]["loads"] == 8, r
    assert r["pre"]["count"] >= 1 and r["pre"]["spills"] == 0, r


# The wide tiles' main kernel and persistent preprocess built for sm_90a with both overlaps
# forced (argv[1]: JSON [[d, dv, causal, deterministic], ...])
_WIDE_OVERLAP_SNIPPET = r"""
import dataclasses, json, os, re, sys, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.sm90.compile import BwdSpec, compile_bwd, compile_bwd_preprocess
from cute_attn.arch.sm90.bwd_tiles import bwd_tile_config
def keep():
    return f"--keep-cubin --dump-dir={tempfile.mkdtemp()}"
out = {}
for d, dv, causal, det in json.loads(sys.argv[1]):
    cfg = bwd_tile_config(d, dv, causal, False, deterministic=det)
    cfg = dataclasses.replace(cfg, post_overlap=True, pre_overlap=True)
    spec = BwdSpec("bfloat16", d, dv, 8, 8, False, causal, False, cfg, deterministic=det)
    sass = _sass(compile_bwd(spec, keep()).__cubin__)
    pre = _sass(compile_bwd_preprocess("bfloat16", d, dv, keep(), persistent=True).__cubin__)
    out[f"{d}-{dv}-{causal}-{det}"] = {
        "sass": bool(sass), "spills": sass.count("STL") + sass.count("LDL"),
        "trigger": sass.count("PREEXIT"), "poll": len(re.findall(r"LDG\.E\.STRONG\.GPU", sass)),
        "count": len(re.findall(r"(REDG|ATOMG)\.E\.ADD\.STRONG\.GPU", sass)),
        "pre_spills": pre.count("STL") + pre.count("LDL"), "pre_trigger": pre.count("PREEXIT"),
    }
print(json.dumps(out))
"""


@pytest.mark.compile
def test_bwd_overlaps_wide_compile_spill_free(tmp_path):
    # post_overlap / pre_overlap forced past D = 128 (D = 192's S = Q K^T tile, (192, 128),
    # D = 256's dK^T / dV^T register tiles with the table's tail_split, the deterministic
    # order): spill-free, the dependent launch allowed, the heads' counts polled and added
    forms = [[192, 192, False, False], [192, 128, True, False], [256, 256, False, False],
             [256, 256, True, True]]  # fmt: skip
    r = run_json_snippet(_WIDE_OVERLAP_SNIPPET, tmp_path, json.dumps(forms), timeout=900)
    if not next(iter(r.values()))["sass"]:
        pytest.skip("nvdisasm not installed: cannot read SASS")
    for name, v in r.items():
        assert v["spills"] == 0 and v["trigger"] == 1 and v["poll"] >= 2, (name, v)
        assert v["count"] >= 1 and v["pre_spills"] == 0 and v["pre_trigger"] == 1, (name, v)


# The deterministic kernel built for sm_90a with BwdTileConfig overrides, one build a form
# (argv[1]: JSON [[d, causal, varlen, {field: value}], ...]): spills, turn polls, and whether
# the third writer's full barrier (id 13) is an operand of the id's select or a BAR
_DET_WRITER_FORMS_SNIPPET = r"""
import dataclasses, json, os, re, sys, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.sm90.compile import BwdSpec, compile_bwd
from cute_attn.arch.sm90.bwd_tiles import bwd_tile_config
out = {}
for d, causal, varlen, fields in json.loads(sys.argv[1]):
    cfg = bwd_tile_config(d, d, causal, False, deterministic=True, varlen=varlen)
    cfg = dataclasses.replace(cfg, **fields)
    spec = BwdSpec("bfloat16", d, d, 8, 8, False, causal, False, cfg, deterministic=True,
                   varlen=varlen)
    sass = _sass(compile_bwd(spec, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}").__cubin__)
    out[f"{d}-{causal}-{varlen}"] = {
        "sass": bool(sass), "spills": sass.count("STL") + sass.count("LDL"),
        "id13": bool(re.search(r"(SEL|BAR\.[A-Z_.]+) [^;]*\b0xd\b", sass)),
        "polls": len(re.findall(r"LDG\.E\.STRONG\.GPU", sass)),
    }
print(json.dumps(out))
"""


def _det_writer_forms(tmp_path, forms):
    """_DET_WRITER_FORMS_SNIPPET's result over `forms`; skips without nvdisasm."""
    r = run_json_snippet(_DET_WRITER_FORMS_SNIPPET, tmp_path, json.dumps(forms), timeout=900)
    if not next(iter(r.values()))["sass"]:
        pytest.skip("nvdisasm not installed: cannot read SASS")
    return r


@pytest.mark.compile
def test_bwd_three_dq_writers_compile_spill_free(tmp_path):
    # BwdTileConfig.dq_writers = 3 (built, not in the table): the deterministic kernel builds
    # for sm_90a on every staging form without spills, polls its turns, and hands tiles to the
    # third writer on barrier 13. Forms: the shared half buffer past D = 128, the flat tile's
    # per-warpgroup buffers with post_overlap at D = 128, D = 64's whole-tile handoff, and
    # packed D = 128
    three = {"dq_writers": 3}
    forms = [[256, True, False, three], [128, False, False, three], [64, True, False, three],
             [128, True, True, three]]  # fmt: skip
    for v in _det_writer_forms(tmp_path, forms).values():
        assert v["spills"] == 0 and v["id13"] and v["polls"] >= 1, v


@pytest.mark.compile
def test_bwd_det_poll_early_compile_spill_free(tmp_path):
    # BwdTileConfig.det_poll_early (built, not in the table): the deterministic kernel builds
    # for sm_90a without spills on the staging forms it changes, and still polls its turns.
    # Forms: the shared half buffer (D = 256 causal), the flat tile's per-warpgroup buffers
    # (D = 128 unmasked), both on two writers, and D = 64's whole-tile handoff on one
    def early(writers):
        return {"det_poll_early": True, "dq_writers": writers}

    forms = [[256, True, False, early(2)], [128, False, False, early(2)],
             [64, True, False, early(1)]]  # fmt: skip
    for v in _det_writer_forms(tmp_path, forms).values():
        assert v["spills"] == 0 and v["polls"] >= 1, v


# The default-order kernel built for sm_90a with BwdTileConfig.tail_split, one build a form
# (argv[1]: JSON [[d, dv, causal], ...]): spills, returning atomics (the parts' fixup count,
# the writers' landed count) and L2-only loads (the last part's reads of the partials)
_TAIL_SPLIT_SNIPPET = r"""
import dataclasses, json, os, re, sys, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.sm90.compile import BwdSpec, compile_bwd
from cute_attn.arch.sm90.bwd_tiles import bwd_tile_config
out = {}
for d, dv, causal in json.loads(sys.argv[1]):
    cfg = bwd_tile_config(d, dv, causal, False)
    cfg = dataclasses.replace(cfg, tail_split=True, l2_section_bytes=0)
    spec = BwdSpec("bfloat16", d, dv, 8, 8, False, causal, False, cfg)
    sass = _sass(compile_bwd(spec, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}").__cubin__)
    out[f"{d}-{dv}-{causal}"] = {
        "sass": bool(sass), "spills": sass.count("STL") + sass.count("LDL"),
        "atoms": len(re.findall(r"ATOMG\.E\.ADD", sass)),
        "l2_loads": len(re.findall(r"LDG\.E\.STRONG\.GPU", sass)),
        "slot": cfg.tail_slot_floats(d, dv) // 256,
    }
print(json.dumps(out))
"""


@pytest.mark.compile
def test_bwd_tail_split_compile_spill_free(tmp_path):
    # BwdTileConfig.tail_split (the table's at unmasked D = 128 / 256; forced here on other
    # forms too): the kernel builds for sm_90a without spills on D = 128's flat tile with
    # post_overlap and s_under_dk, D = 192's S = Q K^T and D = 256's dK^T / dV^T register
    # tiles, and D = 64 causal; each counts its parts in with a returning atomic (and the
    # writers' landed adds under post_overlap: D <= 128) and reads the partials back from
    # L2, a load per element of a thread's dK / dV partial
    forms = [[128, 128, False], [192, 192, False], [256, 256, False], [64, 64, True]]
    r = run_json_snippet(_TAIL_SPLIT_SNIPPET, tmp_path, json.dumps(forms), timeout=900)
    if not next(iter(r.values()))["sass"]:
        pytest.skip("nvdisasm not installed: cannot read SASS")
    for name, v in r.items():
        overlap = int(name.split("-")[0]) <= 128
        assert v["spills"] == 0 and v["atoms"] >= 1 + overlap, (name, v)
        assert v["l2_loads"] >= v["slot"], (name, v)


@pytest.mark.parametrize("d,flat", [(64, 0), (64, 64), (96, 0), (96, 128), (128, 0), (128, 128)])
def test_persistent_preprocess_counts_every_row_once(d, flat):
    # the main kernel waits for a head's ready count to reach its padded rows: the persistent
    # preprocess's items, passes and warps (kernel_persistent's arithmetic, mirrored) write
    # each padded row once and count it once, for any thread count's row groups
    from cute_attn.arch.common.bwd_preprocess import BwdPreprocess

    p = BwdPreprocess(None, d, d, dq_flat_dim=flat, persistent=True)
    for seqlen, tile_m in ((1, 64), (333, 80), (4096, 80), (1000, 96), (127, 128)):
        rows = -(-seqlen // tile_m) * tile_m
        written, counted = [], 0
        for item in range(-(-rows // p.item_rows)):
            row0 = item * p.item_rows
            for warp in range(p.num_threads // 32):
                g0 = warp * p.groups_per_warp
                for u in range(p.unroll):
                    first = row0 + u * p.rows_per_cta + g0
                    counted += max(min(rows - first, p.groups_per_warp), 0)
                    written += [r for r in range(first, first + p.groups_per_warp) if r < rows]
        assert counted == rows and sorted(written) == list(range(rows)), (seqlen, tile_m)


_SOFTCAP_D96_SNIPPET = r"""  # run after HGMMA_SHAPES
import json, os, re, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.sm90.compile import BwdSpec, compile_bwd
from cute_attn.arch.sm90.bwd_tiles import bwd_tile_config
out = {}
for causal in (False, True):
    cfg = bwd_tile_config(96, 96, causal, False, softcap=True)
    spec = BwdSpec("bfloat16", 96, 96, 8, 2, False, causal, True, cfg)
    sass = _sass(compile_bwd(spec, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}").__cubin__)
    shapes = hgmma_shapes(sass)
    out[str(causal)] = {"sass": bool(sass), "spills": sass.count("STL") + sass.count("LDL"),
                        "shapes": shapes, "pad": cfg.padded_head_dim, "tile_m": cfg.tile_m,
                        "waits": len(re.findall(r"WARPGROUP\.DEPBAR", sass))}
print(json.dumps(out))
"""


@pytest.mark.compile
def test_bwd_softcap_d96_runs_its_own_columns(tmp_path):
    # D=96 under softcap: softcap's 64-row tile (dQ = dS K) on the 96 columns, no padding.
    # Per k-step of 16: S^T and dP^T over D = 96 (6 each), dV and dK as N = 96 over the 64
    # query rows (4 each), dQ as each warpgroup's N = 48 half over the 128 keys (8); the
    # wgmmas stay asynchronous (a handful of waits) and nothing spills
    r = run_json_snippet(HGMMA_SHAPES + _SOFTCAP_D96_SNIPPET, tmp_path, timeout=900)
    if not r["False"]["sass"]:
        pytest.skip("nvdisasm not installed: cannot read SASS")
    for v in r.values():
        assert v["pad"] == 0 and v["tile_m"] == 64 and v["spills"] == 0, r
        assert v["shapes"] == {"64x64x16": 12, "64x96x16": 8, "64x48x16": 8}, r
        assert v["waits"] <= 6, r


_WIDE_SNIPPET = r"""  # run after HGMMA_SHAPES
import json, os, re, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.sm90.compile import BwdSpec, compile_bwd
from cute_attn.arch.sm90.bwd_tiles import bwd_tile_config
out = {}
for d, dv in ((256, 256), (192, 128)):
    cfg = bwd_tile_config(d, dv, True, False)
    spec = BwdSpec("bfloat16", d, dv, 8, 8, False, True, False, cfg)
    sass = _sass(compile_bwd(spec, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}").__cubin__)
    shapes = hgmma_shapes(sass)
    out[f"{d}-{dv}"] = {"sass": bool(sass), "spills": sass.count("STL") + sass.count("LDL"),
                        "shapes": shapes, "swap": cfg.dkv_swap_ab}
print(json.dumps(out))
"""


@pytest.mark.compile
def test_bwd_wide_head_dim_builds_the_swapped_gemms(tmp_path):
    # D=256 causal: S^T / dP^T as 64 x 32 per warpgroup (the query split), dK^T / dV^T as
    # 64 x 64 wgmmas with both smem operands transposed, dQ as 64 x 128; no spills. (192, 128)
    # on its own 64 x 96 tiles: S / dP and dK^T / dV^T as 64 x 48 per warpgroup (the key
    # split), dQ as 64 x 96
    out = run_json_snippet(HGMMA_SHAPES + _WIDE_SNIPPET, tmp_path, timeout=900)
    r, r192 = out["256-256"], out["192-128"]
    if not r["sass"]:
        pytest.skip("nvdisasm not installed: cannot read SASS")
    assert r["swap"] and r["spills"] == 0, r
    # per k-step of 16: S^T and dP^T over D = 256 (16 each), dV^T and dK^T over the 64 query
    # rows in two 64-row head-dim tiles (8 each), dQ over the 64 keys (4)
    assert r["shapes"] == {"64x32x16": 32, "64x64x16 tnspA": 16, "64x128x16": 4}, r
    # (192, 128): S over 192 columns (12 k-steps) and dP over 128 (8); dK^T over three 64-row
    # head-dim tiles and dV^T over two, 4 query k-steps each (12 + 8); dQ over 96 keys (6)
    assert r192["swap"] and r192["spills"] == 0, r192
    assert r192["shapes"] == {"64x48x16": 20, "64x48x16 tnspA": 20, "64x96x16": 6}, r192
