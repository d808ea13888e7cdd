"""torch.library registration of the forward, so that torch.compile traces through cute_attn.

`torch.ops.cute_attn.fwd(q, k, v, softmax_scale, window_left, window_right, softcap, fallback)`
returns `(out, lse)` with the package contract; the window is already normalized (causal folded
into window_right = 0, -1 = unbounded) and `fallback` is "" for the default policy. Inside, the
same dispatch as the eager API runs (kernel on SM90, reference on CPU or on request). A fake
implementation gives shapes to the tracer; the registered autograd formula is the analytic
backward recomputed from lse (reference.attention_ref_backward) until the SM90 backward kernel
exists.

`flash_attn_func` calls this op only while torch.compile is tracing; eager calls keep the
direct path, which costs no dispatcher overhead.
"""

from __future__ import annotations

import torch

from . import reference

_NAME = "cute_attn::fwd"


@torch.library.custom_op(_NAME, mutates_args=())
def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    fallback: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    from .api import _forward

    return _forward(
        q, k, v, softmax_scale=softmax_scale, window_size=(window_left, window_right),
        softcap=softcap, fallback=fallback or None,
    )  # fmt: skip


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, window_left, window_right, softcap, fallback):
    b, sq, h, _ = q.shape
    out = q.new_empty((b, sq, h, v.shape[-1]))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return out, lse


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, window_left, window_right, softcap, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.params = (softmax_scale, (window_left, window_right), softcap)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    softmax_scale, window, softcap = ctx.params
    dq, dk, dv = reference.attention_ref_backward(
        q, k, v, out, lse, dout, softmax_scale=softmax_scale, causal=False,
        window_size=window, softcap=softcap, dlse=dlse,
    )  # fmt: skip
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)
