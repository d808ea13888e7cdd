"""Inputs and sweep cases shared by the GPU kernel tests (test_fwd_sm90, test_bwd_sm90).

Imported by those test files (pytest puts tests/ on sys.path); nothing here is a test.
"""

from __future__ import annotations

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
