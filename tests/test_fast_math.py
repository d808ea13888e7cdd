"""The FMA-pipe exp2 (arch/common/fast_math.py): its math, modelled in numpy instruction by
instruction, and its presence in a compiled kernel when the tile config turns it on."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from cute_attn.arch.common import fast_math


def _f32_hex(v: float) -> str:
    return f"0f{struct.unpack('<I', struct.pack('<f', v))[0]:08X}"


def test_ptx_constants_are_the_documented_polynomial():
    assert (fast_math._C1, fast_math._C2, fast_math._C3) == tuple(
        _f32_hex(c) for c in fast_math.EXP2_POLY
    )
    assert fast_math._ROUND == _f32_hex(1.5 * 2**23) and fast_math._LOWEST == _f32_hex(-127.0)


def _model(x: np.ndarray) -> np.ndarray:
    """The PTX sequence in float32/uint32 arithmetic."""
    c1, c2, c3 = (np.float32(c) for c in fast_math.EXP2_POLY)
    xc = np.maximum(x.astype(np.float32), np.float32(-127.0))
    xr = (np.floor(xc.astype(np.float64)) + 1.5 * 2**23).astype(np.float32)  # add.rm
    f = (xc - (xr - np.float32(1.5 * 2**23))).astype(np.float32)
    p = ((c3 * f + c2) * f + c1).astype(np.float32)
    p = (p * f + np.float32(1.0)).astype(np.float32)
    shifted = (xr.view(np.uint32).astype(np.uint64) << 23) & 0xFFFFFFFF
    bits = (p.view(np.uint32).astype(np.uint64) + shifted) & 0xFFFFFFFF
    return bits.astype(np.uint32).view(np.float32)


def test_relative_error_below_half_a_bf16_ulp():
    # the softmax feeds it s * scale - m: <= 0, or <= 8 with conditional rescaling
    x = np.linspace(-126.0, 8.0, 1_000_001, dtype=np.float32)
    rel = np.abs(_model(x) / np.exp2(x.astype(np.float64)) - 1.0)
    assert rel.max() < 1e-4 < 2.0**-9


def test_exact_at_integers_and_zero_below_range():
    ints = np.arange(-126, 9, dtype=np.float32)
    assert np.array_equal(_model(ints), np.exp2(ints))
    assert np.all(_model(np.array([-127.0, -200.0, -np.inf], dtype=np.float32)) < 1e-37)


@pytest.mark.compile
def test_emulation_variant_compiles_and_offloads(tmp_path):
    code = r"""
import os, dataclasses
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.arch.sm90.compile import FwdSpec, compile_fwd
from cute_attn.arch.sm90.tile_config import fwd_tile_config
counts = []
for every in (0, 4):
    cfg = dataclasses.replace(fwd_tile_config(64, 64, False, False), exp2_emu_every=every)
    f = compile_fwd(FwdSpec("bfloat16", 64, 64, 4, 4, False, False, False, cfg), "--keep-ptx")
    ptx = f.__ptx__
    counts.append((ptx.count("ex2.approx"), ptx.count("add.rm.f32")))
print(counts)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env=dict(os.environ), timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    (mufu_off, emu_off), (mufu_on, emu_on) = eval(res.stdout.strip().splitlines()[-1])
    assert emu_off == 0 and emu_on > 0
    assert mufu_on == mufu_off - emu_on  # every emulated exponential left the SFU
