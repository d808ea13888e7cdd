"""Smallest useful cute_attn call: GQA causal attention, (batch, seq, heads, dim) layout.

    python examples/quickstart.py

On an H100/H200 this runs the SM90 kernel; elsewhere the reference path (CPU tensors).
"""

import torch

import cute_attn

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
q = torch.randn(2, 1000, 8, 128, device=device, dtype=dtype)  # 8 query heads
k = torch.randn(2, 1200, 2, 128, device=device, dtype=dtype)  # 2 KV heads (GQA 4:1)
v = torch.randn(2, 1200, 2, 128, device=device, dtype=dtype)

out, lse = cute_attn.flash_attn_func(q, k, v, causal=True)  # bottom-right causal
print("out", tuple(out.shape), out.dtype, "lse", tuple(lse.shape), lse.dtype)
print("ran:", cute_attn.last_dispatch())
