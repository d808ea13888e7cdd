"""Inputs and sweep cases shared by the GPU kernel tests (test_fwd_sm90, test_bwd_sm90).

Imported by those test files (pytest puts tests/ on sys.path); nothing here is a test.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

SWEEP_MODES = ("full", "causal", "window", "softcap")


def attn_inputs(b, sq, sk, h, hkv, d, dv, dtype, seed=0, with_dout=False):
    """Seeded random q (b, sq, h, d), k (b, sk, hkv, d), v (b, sk, hkv, dv) on the GPU, and
    dout (b, sq, h, dv) when `with_dout` (drawn last, so q/k/v match the forward tests')."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(*s):
        return torch.randn(*s, device="cuda", dtype=dtype, generator=g)

    out = [mk(b, sq, h, d), mk(b, sk, hkv, d), mk(b, sk, hkv, dv)]
    if with_dout:
        out.append(mk(b, sq, h, dv))
    return tuple(out)


def mode_kwargs(mode: str) -> dict:
    """flash_attn_func keyword arguments of a sweep mode."""
    return {
        "full": {},
        "causal": {"causal": True},
        "window": {"window_size": (37, 11)},
        "softcap": {"softcap": 15.0, "causal": True},
    }[mode]


def sweep_batch(sq: int, sk: int) -> int:
    """A batch size in 1..3 that varies with the shape, so the sweep covers batch > 1."""
    return 1 + (sq * 7 + sk) % 3


def assert_matches(out, lse, ref, ref_lse, same, empty_rows=None):
    """The FlashAttention rule: max|out - ref32| <= 2 * max|same - ref32| + atol, where `same`
    is the same math in plain torch in the input dtype and atol covers rounding ref32 to that
    dtype; lse in fp32 with the same -inf (empty row) pattern; empty rows give out exactly 0.
    `empty_rows` indexes out's rows the way `~isfinite(ref_lse)` is laid out (a callable from
    that mask to out's rows); default: dense (B, H, Sq) lse vs (B, Sq, H, Dv) out."""
    assert not out.isnan().any(), "unwritten or NaN output element"
    err = (out.float() - ref).abs().max().item() if out.numel() else 0.0
    base = (same.float() - ref).abs().max().item() if out.numel() else 0.0
    atol = (ref.to(out.dtype).float() - ref).abs().max().item() + 1e-5 if out.numel() else 0.0
    assert err <= 2 * base + atol, f"out err {err:.3e} > 2 * {base:.3e} + {atol:.3e}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)), "lse -inf pattern differs"
    assert (lse[~fin] == float("-inf")).all()
    if fin.any():
        lerr = (lse[fin] - ref_lse[fin]).abs().max().item()
        assert lerr <= 1e-3 * max(1.0, ref_lse[fin].abs().max().item()), f"lse err {lerr}"
    empty = (empty_rows or (lambda m: m.transpose(1, 2)))(~fin)
    if empty.any():
        assert (out[empty] == 0).all()


def assert_grads_match(got, ref, same, dtype):
    """The FlashAttention rule per gradient (dq, dk, dv): max|g - ref32| <= 2 * max|same -
    ref32| + atol, where `same` is autograd through the reference in `dtype` and atol covers
    rounding ref32 to it; gradients in `dtype`, shaped like the reference's, never NaN."""
    for name, g, r, s in zip(("dq", "dk", "dv"), got, ref, same):
        assert g.dtype == dtype and g.shape == s.shape, (name, g.dtype, g.shape)
        assert not g.isnan().any(), f"{name}: NaN"
        err = (g.float() - r).abs().max().item()
        base = (s.float() - r).abs().max().item()
        atol = (r.to(dtype).float() - r).abs().max().item() + 1e-5
        assert err <= 2 * base + atol, f"{name} err {err:.3e} > 2 * {base:.3e} + {atol:.3e}"


@contextlib.contextmanager
def forced_host_rule(monkeypatch, name: str, value):
    """Calls inside run with cute_attn.fwd_sm90's `name` (a tuning rule or the table it
    imported) replaced by `value`; yields the list of forward compile keys they build or look
    up. The host's key, plan, paged-route and launcher memos are cleared before and after, so
    no call reuses a kernel chosen under the other rule."""
    from cute_attn import api, fwd_sm90

    keys, build = [], fwd_sm90.build_fwd
    monkeypatch.setattr(fwd_sm90, name, value)
    monkeypatch.setattr(fwd_sm90, "build_fwd", lambda key: (keys.append(key), build(key))[1])
    clears = (
        fwd_sm90._fwd_key.cache_clear,
        fwd_sm90._plan.cache_clear,
        fwd_sm90.paged_route.cache_clear,
        api._dense_memo.clear,
        api._kvcache_memo.clear,
        api._varlen_memo.clear,  # (its decisions' reasons name the packing)
    )
    for clear in clears:
        clear()
    try:
        yield keys
    finally:
        for clear in clears:
            clear()


def force_bwd_tile(monkeypatch, when=lambda p: True, **fields):
    """Backward keys whose problem `when` accepts take these BwdTileConfig fields, whatever
    the tuning table says (the backward asks bwd_key on every call: no memo to clear)."""
    import cute_attn.bwd_sm90 as host
    from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig

    table = host.bwd_key

    def forced(p, *args, **kw):
        key = table(p, *args, **kw)
        if not when(p):
            return key
        cfg = dataclasses.replace(BwdTileConfig(*key.tile), **fields)
        return dataclasses.replace(key, tile=dataclasses.astuple(cfg))

    monkeypatch.setattr(host, "bwd_key", forced)
