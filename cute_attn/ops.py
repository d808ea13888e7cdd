"""torch.library registration of the forward, so that torch.compile traces through cute_attn.

`torch.ops.cute_attn.fwd(q, k, v, softmax_scale, window_left, window_right, softcap, fallback,
deterministic)`
returns `(out, lse)` with the package contract; the window is already normalized (causal folded
into window_right = 0, -1 = unbounded) and `fallback` is "" for the default policy. Inside, the
same dispatch as the eager API runs (kernel on SM90, reference on CPU or on request). A fake
implementation gives shapes to the tracer. Its autograd formula calls a second op,
`cute_attn::bwd(q, k, v, out, lse, dout, dlse, softmax_scale, window_left, window_right,
softcap, deterministic) -> (dq, dk, dv)`, which runs the SM90 backward kernel (or the
reference backward where the kernel does not serve the problem) and also has a fake
implementation, so the traced backward graph holds it as one opaque node.

`flash_attn_func` calls this op only while torch.compile is tracing; eager calls keep the
direct path, which costs no dispatcher overhead.
"""

from __future__ import annotations

import torch

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
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    from .api import _forward

    return _forward(
        q, k, v, softmax_scale=softmax_scale, window_size=(window_left, window_right),
        softcap=softcap, fallback=fallback or None, deterministic=deterministic,
    )  # fmt: skip


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, window_left, window_right, softcap, fallback,
              deterministic=False):  # fmt: skip
    b, sq, h, _ = q.shape
    out = q.new_empty((b, sq, h, v.shape[-1]))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return out, lse


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, window_left, window_right, softcap, _, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.params = (softmax_scale, (window_left, window_right), softcap, deterministic)


@torch.library.custom_op("cute_attn::bwd", mutates_args=())
def bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .api import _backward

    return _backward(
        q, k, v, out, lse, dout, dlse, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), softcap=softcap, deterministic=deterministic,
    )  # fmt: skip


@bwd.register_fake
def _bwd_fake(q, k, v, out, lse, dout, dlse, softmax_scale, window_left, window_right, softcap,
              deterministic=False):  # fmt: skip
    # gradients are always contiguous, whatever views q, k, v were
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    softmax_scale, (left, right), softcap, deterministic = ctx.params
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = bwd(
        q, k, v, out, lse, dout, dlse, softmax_scale, left, right, softcap, deterministic
    )
    return dq, dk, dv, None, None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)
