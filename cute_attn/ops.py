"""torch.library registration of the forward, so that torch.compile traces through cute_attn.

`torch.ops.cute_attn.fwd(q, k, v, softmax_scale, window_left, window_right, softcap, fallback,
deterministic, num_splits, pack_gqa)`
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

`flash_attn_varlen_func` likewise traces into `cute_attn::varlen_fwd(q, k, v, cu_seqlens_q,
cu_seqlens_k, seqused_q, seqused_k, page_table, max_seqlen_q, max_seqlen_k, softmax_scale,
window_left, window_right, softcap, fallback, deterministic, num_splits, pack_gqa) ->
(out, lse)` (max_seqlen_q / _k must then be given: tracing cannot read the lengths), whose
autograd formula calls
`cute_attn::varlen_bwd(q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k,
max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
deterministic) -> (dq, dk, dv)`: the SM90 varlen backward for q and k / v packed by
cu_seqlens; gradients through seqused_q / seqused_k / page_table raise, as in eager mode.

`flash_attn_with_kvcache` traces into `cute_attn::kvcache_fwd(q, k_cache, v_cache,
cache_seqlens, cache_seqlens_int, cache_batch_idx, page_table, softmax_scale, window_left,
window_right, softcap, num_splits, fallback, pack_gqa) -> (out, lse)` for a read-only call, and into
`cute_attn::kvcache_append_fwd(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int,
cache_batch_idx, page_table, rotary_cos, rotary_sin, rotary_interleaved, softmax_scale, ...)`,
declared to mutate k_cache / v_cache, when new k / v are appended (cache_seqlens: the tensor,
else the python int in cache_seqlens_int, else both None for full caches). Both run the eager
entry inside, index-value checks included; neither has an autograd formula (inference only).
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
    num_splits: int = 0,
    pack_gqa: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from .api import _forward

    return _forward(
        q, k, v, softmax_scale=softmax_scale, window_size=(window_left, window_right),
        softcap=softcap, fallback=fallback or None, deterministic=deterministic,
        num_splits=num_splits, pack_gqa=pack_gqa,
    )  # fmt: skip


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, window_left, window_right, softcap, fallback,
              deterministic=False, num_splits=0, pack_gqa=None):  # fmt: skip
    b, sq, h, _ = q.shape
    out = q.new_empty((b, sq, h, v.shape[-1]))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return out, lse


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, window_left, window_right, softcap, _, deterministic = inputs[:9]
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
    return dq, dk, dv, *(None,) * 8


fwd.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------ varlen
@torch.library.custom_op("cute_attn::varlen_fwd", mutates_args=())
def varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    seqused_q: torch.Tensor | None,
    seqused_k: torch.Tensor | None,
    page_table: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    fallback: str,
    deterministic: bool = False,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from .api import flash_attn_varlen_func

    with torch.no_grad():  # gradients come from the registered formula, not the eager entry
        out, lse = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=seqused_q,
            seqused_k=seqused_k, page_table=page_table, softmax_scale=softmax_scale,
            window_size=(window_left, window_right), softcap=softcap,
            deterministic=deterministic, fallback=fallback or None, num_splits=num_splits,
            pack_gqa=pack_gqa,
        )  # fmt: skip
    return out.contiguous(), lse.contiguous()


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
                     max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
                     softcap, fallback, deterministic=False, num_splits=0,
                     pack_gqa=None):  # fmt: skip
    total_q, h, _ = q.shape
    return q.new_empty((total_q, h, v.shape[-1])), q.new_empty((h, total_q), dtype=torch.float32)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, used_q, used_k, table = inputs[:8]
    max_q, max_k, scale, left, right, softcap, _, deterministic = inputs[8:16]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.params = (max_q, max_k, scale, left, right, softcap, deterministic)
    # the varlen backward takes packed q and k / v only (fwd_sm90.varlen_grad_reason)
    ctx.refused = None
    if table is not None:
        ctx.refused = "page_table"
    elif used_q is not None or used_k is not None:
        ctx.refused = "seqused_q / seqused_k"


@torch.library.custom_op("cute_attn::varlen_bwd", mutates_args=())
def varlen_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .api import _varlen_backward

    return _varlen_backward(
        q, k, v, out, lse, dout, dlse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), softcap=softcap, deterministic=deterministic,
    )  # fmt: skip


@varlen_bwd.register_fake
def _varlen_bwd_fake(q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, window_left, window_right, softcap,
                     deterministic=False):  # fmt: skip
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_backward_formula(ctx, dout, dlse):
    if ctx.refused is not None:
        raise NotImplementedError(
            f"cute_attn: no backward for gradients through {ctx.refused} (the varlen backward "
            "takes q and k / v packed by cu_seqlens_q / cu_seqlens_k)"
        )
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    max_q, max_k, scale, left, right, softcap, deterministic = ctx.params
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = varlen_bwd(
        q, k, v, out, lse, dout, dlse, cu_q, cu_k, max_q, max_k, scale, left, right, softcap,
        deterministic,
    )  # fmt: skip
    return dq, dk, dv, *(None,) * 15


varlen_fwd.register_autograd(_varlen_backward_formula, setup_context=_varlen_setup_context)


# ---------------------------------------------------------------------------------- KV cache
def _kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, cache_batch_idx,
                  page_table, rotary_cos, rotary_sin, rotary_interleaved, softmax_scale,
                  window_left, window_right, softcap, num_splits, fallback,
                  pack_gqa):  # fmt: skip
    from .api import flash_attn_with_kvcache

    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v,
        cache_seqlens=cache_seqlens if cache_seqlens is not None else cache_seqlens_int,
        cache_batch_idx=cache_batch_idx, page_table=page_table, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        softmax_scale=softmax_scale, causal=False, window_size=(window_left, window_right),
        softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa, fallback=fallback or None,
    )  # fmt: skip
    # fresh, contiguous outputs (the reference's lse is a permuted view of its own buffer)
    return out.contiguous(), lse.contiguous()


def _kvcache_fake(q, v_cache):
    b, sq, h, _ = q.shape
    return q.new_empty((b, sq, h, v_cache.shape[-1])), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("cute_attn::kvcache_fwd", mutates_args=())
def kvcache_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    cache_seqlens_int: int | None,
    cache_batch_idx: torch.Tensor | None,
    page_table: torch.Tensor | None,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
    fallback: str,
    pack_gqa: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kvcache_call(
        q, k_cache, v_cache, None, None, cache_seqlens, cache_seqlens_int, cache_batch_idx,
        page_table, None, None, True, softmax_scale, window_left, window_right, softcap,
        num_splits, fallback, pack_gqa,
    )  # fmt: skip


@kvcache_fwd.register_fake
def _kvcache_fwd_fake(q, k_cache, v_cache, cache_seqlens, cache_seqlens_int, cache_batch_idx,
                      page_table, softmax_scale, window_left, window_right, softcap, num_splits,
                      fallback, pack_gqa=None):  # fmt: skip
    return _kvcache_fake(q, v_cache)


# A separate op for the append: declaring k_cache / v_cache mutated on every call would let
# functionalization copy a read-only call's cache where it cannot put the mutation back in place.
@torch.library.custom_op("cute_attn::kvcache_append_fwd", mutates_args=("k_cache", "v_cache"))
def kvcache_append_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    cache_seqlens_int: int | None,
    cache_batch_idx: torch.Tensor | None,
    page_table: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    rotary_interleaved: bool,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
    fallback: str,
    pack_gqa: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kvcache_call(
        q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, cache_batch_idx,
        page_table, rotary_cos, rotary_sin, rotary_interleaved, softmax_scale, window_left,
        window_right, softcap, num_splits, fallback, pack_gqa,
    )  # fmt: skip


@kvcache_append_fwd.register_fake
def _kvcache_append_fwd_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int,
                             cache_batch_idx, page_table, rotary_cos, rotary_sin,
                             rotary_interleaved, softmax_scale, window_left, window_right,
                             softcap, num_splits, fallback, pack_gqa=None):  # fmt: skip
    return _kvcache_fake(q, v_cache)
