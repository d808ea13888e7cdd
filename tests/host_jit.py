"""Running arch/ code on the CPU: the CuTe DSL executes a `@cute.jit` function that launches
no kernel as host code, so index math, layouts and the mask's arithmetic can be checked
against the reference without a GPU (anything that emits PTX, such as shuffles or inline
assembly, cannot run this way). Imported by the test files; nothing here is a test.
"""

from __future__ import annotations

import torch


def sm90_dsl():
    """Call before cutlass loads: importing cute_attn.fwd_sm90 sets CUTE_DSL_ARCH=sm_90a,
    which the DSL reads once (its wgmma helpers check it)."""
    import cute_attn.fwd_sm90  # noqa: F401


def int32(xs) -> torch.Tensor:
    """A CPU int32 tensor of python ints (index tensors for the host functions)."""
    return torch.tensor(xs, dtype=torch.int32)
