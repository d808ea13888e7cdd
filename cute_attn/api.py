"""Public entry points: validate, dispatch, run. Every entry returns `(out, lse)`.

Layout is (batch, seq, heads, dim). WARNING: SDPA uses (batch, heads, seq, dim); a transposed
tensor whose sizes happen to fit is indistinguishable and silently computes something else.
Transpose SDPA-layout inputs with `.transpose(1, 2)` first (see docs/contract.md).
"""

from __future__ import annotations

import torch

# fwd_sm90, the forward's host side, and with it TVM-FFI (how every compiled kernel is called),
# load with the entry points rather than inside the first call: once the kernel is in the disk
# cache, a fresh process's first call is then the load and the launch (docs/perf/README.md,
# "Cold start"). Neither imports cutlass: the DSL loads only when a kernel must be compiled.
from . import dispatch, fwd_sm90, inference, reference
from .validation import (
    _can_read_values,
    _check_bool,
    validate_dense,
    validate_kvcache_static,
    validate_varlen_deferred,
    validate_varlen_static,
    value_checks_enabled,
)


def _ref_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _window(p) -> tuple[int, int]:
    # the problem's window is already normalized (causal folded into window_right)
    return (p.window_left, p.window_right)


class _KernelAttn(torch.autograd.Function):
    """Kernel forward; backward by cute_attn.bwd_sm90.backward (the SM90 backward kernel when
    it serves the problem, else the reference's analytic backward). lse is differentiable:
    its gradient enters through D = rowsum(dO * O) - dlse."""

    @staticmethod
    def forward(ctx, q, k, v, problem):
        out, lse = fwd_sm90.run_fwd(q, k, v, problem)
        ctx.problem = problem
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from .bwd_sm90 import backward

        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = backward(q, k, v, out, lse, dout, ctx.problem, dlse)
        return dq, dk, dv, None


class _KernelAttnVarlen(torch.autograd.Function):
    """`_KernelAttn` for packed sequences (cu_seqlens_q / cu_seqlens_k only: dispatch sends
    seqused, paged and KV-cache calls that need gradients elsewhere); backward by
    cute_attn.bwd_sm90.backward_varlen. lse (H, total_q) is differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, problem, cu_seqlens_q, cu_seqlens_k):
        out, lse = fwd_sm90.run_fwd_varlen(
            q, k, v, problem, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            seqused_k=None, max_seqlen_q=problem.seqlen_q,
        )  # fmt: skip
        ctx.problem = problem
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from .bwd_sm90 import backward_varlen

        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = backward_varlen(
            q, k, v, out, lse, dout, ctx.problem, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            dlse=dlse,
        )  # fmt: skip
        return dq, dk, dv, None, None, None


# The dense entry's host fast path: a call whose signature (every attribute validation and
# dispatch read: shapes, strides, dtypes, devices, 16-byte alignment, the scalar arguments
# with their types) matches an earlier call that a kernel served reuses that call's problem
# and decision, skipping both (they are pure functions of the signature). Measured in
# docs/perf/README.md ("Host cost of a tiny dense call").
_Tensor = torch.Tensor
_dense_memo: dict = {}
_DENSE_MEMO_MAX = 4096


def _lookup(memo: dict, key: tuple | None) -> tuple:
    """(memo entry or None, key or None): a key with an unhashable argument finds nothing and
    is dropped (the full path's validation names what is wrong with it)."""
    if key is None:
        return None, None
    try:
        return memo.get(key), key
    except TypeError:
        return None, None


def _remember(memo: dict, key: tuple, entry: tuple) -> None:
    """Store a memo entry; a memo past _DENSE_MEMO_MAX entries starts over."""
    if len(memo) >= _DENSE_MEMO_MAX:
        memo.clear()
    memo[key] = entry


def _hit_check(values, q, *index):
    """A memo hit's index-value check, built per call from the remembered `values` (a
    KvcacheValues / VarlenValues, or None) where values are read: as _can_read_values (the
    memos take plain tensors only, so not fake ones; nothing read under CUDA graph capture or
    with CUTE_ATTN_CHECK_VALUES=0)."""
    if values is None or not value_checks_enabled():
        return None
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return values.check(*index)


def _dense_signature(q, k, v, knobs: tuple) -> tuple | None:
    """The memo key of a dense call, or None when it must take the full path (tensor
    subclasses such as fake tensors, a window that is not a 2-tuple). The scalar arguments
    enter with their types: True == 1 and 0.0 == 0 hash alike, but validation tells them
    apart."""
    if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
        return None
    window = knobs[2]
    if type(window) is not tuple or len(window) != 2:
        return None
    scale, causal, _, softcap, splits, pack, det, fallback = knobs
    # knobs nested as one tuple, the types spelled out: ~1 us less than star-unpacking maps
    return (
        q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
        v.dtype, q.device, k.device, v.device, (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15,
        knobs, type(scale), type(causal), type(softcap), type(splits), type(pack), type(det),
        type(fallback), type(window[0]), type(window[1]),
    )  # fmt: skip


def _needs_grad(q, k, v) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    fallback: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention. q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), H % Hkv == 0.

    Returns out (B, Sq, H, Dv) in q's dtype and lse (B, H, Sq) float32 (natural log).
    causal is bottom-right aligned (key j visible to query i iff j <= i + Sk - Sq);
    window_size=(left, right) keeps j in [i + Sk - Sq - left, i + Sk - Sq + right]
    (None or -1: unbounded), intersected with causal. Query head h uses KV head
    h // (H // Hkv). A row with no visible key gives out = 0, lse = -inf. softcap > 0 applies
    softcap * tanh(s / softcap) to the scaled scores before masking. No dropout.
    CUDA fp16/bf16 inputs run the cute_attn kernel for the device (SM90); CPU inputs of any
    float dtype run the reference. `fallback="reference"` lets an unserved CUDA call run the
    slow reference instead of raising. `cute_attn.last_dispatch()` says what ran.
    num_splits: key-range splits (0: the tuning table's). pack_gqa: None (and True, which
    asks for no more) lets the table decide whether a GQA call's query heads share the
    kernel's tile rows (up to 32 query rows, where it was timed), False keeps them apart
    (docs/contract.md).
    """
    knobs = (softmax_scale, causal, window_size, softcap, num_splits, pack_gqa, deterministic,
             fallback)  # fmt: skip
    # (under torch.compile the call is traced into the custom op below: no memo)
    key = None if torch.compiler.is_compiling() else _dense_signature(q, k, v, knobs)
    hit, key = _lookup(_dense_memo, key)
    if hit is not None:
        p, decision, launch = hit
        dispatch.replay(decision)
        if _needs_grad(q, k, v):
            return _KernelAttn.apply(q, k, v, p)
        if launch is not None:
            return launch(q, k, v)
        return fwd_sm90.run_fwd(q, k, v, p)
    p = validate_dense(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa, deterministic=deterministic,
    )  # fmt: skip
    if torch.compiler.is_compiling():
        # traced as one opaque op with a fake implementation and an autograd formula
        from . import ops

        return ops.fwd(
            q, k, v, p.softmax_scale, p.window_left, p.window_right, p.softcap, fallback or "",
            p.deterministic, p.num_splits, p.pack_gqa,
        )  # fmt: skip
    return _run(q, k, v, p, fallback, memo_key=key)


def _forward(q, k, v, *, softmax_scale, window_size, softcap, fallback, deterministic=False,
             num_splits=0, pack_gqa=None):  # fmt: skip
    """The eager forward for the torch.library op (window already normalized)."""
    p = validate_dense(
        q, k, v, softmax_scale=softmax_scale, causal=False, window_size=window_size,
        softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa, deterministic=deterministic,
    )  # fmt: skip
    with torch.no_grad():
        out, lse = _run(q, k, v, p, fallback)
    return out, lse


def _backward(
    q, k, v, out, lse, dout, dlse, *, softmax_scale, window_size, softcap, deterministic=False
):
    """The eager backward for the torch.library op (window already normalized)."""
    from .bwd_sm90 import backward

    p = validate_dense(
        q, k, v, softmax_scale=softmax_scale, causal=False, window_size=window_size,
        softcap=softcap, num_splits=0, pack_gqa=None, deterministic=deterministic,
    )  # fmt: skip
    with torch.no_grad():
        return backward(q, k, v, out, lse, dout, p, dlse)


def _varlen_backward(q, k, v, out, lse, dout, dlse, *, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, softmax_scale, window_size, softcap,
                     deterministic=False):  # fmt: skip
    """The eager varlen backward for the torch.library op (window already normalized; the
    index values were checked by the forward)."""
    from .bwd_sm90 import backward_varlen

    with torch.no_grad():
        p, _ = validate_varlen_deferred(
            q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=None,
            seqused_k=None, page_table=None, softmax_scale=softmax_scale, causal=False,
            window_size=window_size, softcap=softcap, num_splits=0, pack_gqa=None,
            deterministic=deterministic,
        )  # fmt: skip
        return backward_varlen(
            q, k, v, out, lse, dout, p, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            dlse=dlse,
        )  # fmt: skip


def _run(q, k, v, p, fallback, memo_key=None):
    d = dispatch.select(p, (("q", q), ("k", k), ("v", v)), fallback=fallback)
    if d.impl == "sm90_fwd":
        if _needs_grad(q, k, v):
            result = _KernelAttn.apply(q, k, v, p)
        else:
            result = fwd_sm90.run_fwd(q, k, v, p)
        if memo_key is not None:
            # bound after the call, so that the launcher's one-time allocation (a prototype
            # for lse) comes after this call's outputs, not between a free and their reuse
            _remember(_dense_memo, memo_key, (p, d, fwd_sm90.dense_launcher(q, p)))
        return result
    out, lse = reference.attention_ref(
        q, k, v, softmax_scale=p.softmax_scale, causal=False, window_size=_window(p),
        softcap=p.softcap, compute_dtype=_ref_compute_dtype(q.dtype),
    )  # fmt: skip
    # same strides as the kernel's output (the reference computes in (B, H, S, D) order)
    return out.to(q.dtype).contiguous(), lse.float().contiguous()


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    fallback: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed variable-length attention. q (total_q, H, D); k/v (total_k, Hkv, D[v]) packed by
    cu_seqlens_k, or (num_pages, page_size, Hkv, D[v]) with page_table (B, max_pages).
    Returns out (total_q, H, Dv) and lse (H, total_q) float32. Each sequence is its own
    problem (bottom-right causal per sequence). Rows past seqused_q give out 0, lse -inf.
    On SM90 the forward kernel serves cu_seqlens_q/k, seqused_q/k and paged k/v (page by page
    by TMA when a key tile fits the page size, e.g. 16, 64, 128, 256; other page sizes are
    gathered into a dense copy first). Gradients: the SM90 varlen backward serves q and k / v
    packed by cu_seqlens_q / cu_seqlens_k (`deterministic` as in flash_attn_func); with
    seqused_q/k or page_table they need fallback='reference' on CUDA.
    """
    index = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table)
    knobs = (softmax_scale, causal, window_size, softcap, num_splits, pack_gqa, deterministic,
             fallback)  # fmt: skip
    # (under torch.compile the call is traced into the custom op below: no memo)
    key = None
    if not torch.compiler.is_compiling():
        key = _varlen_signature(q, k, v, index, max_seqlen_q, max_seqlen_k, knobs)
    hit, key = _lookup(_varlen_memo, key)
    if hit is not None:
        p, decision, values, launch = hit
        dispatch.replay(decision)
        check = _hit_check(values, q, *index)
        if launch is None:
            return _varlen_kernel(q, k, v, p, check, *index)
        # the signature holds the index tensors' strides: unit ones where a launcher is bound
        return _checked_launch(check, launch, q, k, v, *index)
    p, values = validate_varlen_static(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=seqused_q,
        seqused_k=seqused_k, page_table=page_table, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa,
        deterministic=deterministic,
    )  # fmt: skip
    check = None
    if values is not None and _can_read_values(q):
        check = values.check(*index)
    if torch.compiler.is_compiling():
        # traced as one opaque op with a fake implementation and an autograd formula
        from . import ops

        return ops.varlen_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, p.seqlen_q,
            p.seqlen_k, p.softmax_scale, p.window_left, p.window_right, p.softcap,
            fallback or "", p.deterministic, p.num_splits, p.pack_gqa,
        )  # fmt: skip
    d = dispatch.select(p, (("q", q), ("k", k), ("v", v)), fallback=fallback,
                        entry="flash_attn_varlen_func")  # fmt: skip
    if d.impl == "sm90_fwd":
        res = _varlen_kernel(q, k, v, p, check, *index)
        if key is not None:  # bound after the call, as the dense entry's (_run)
            launch = None
            if not _needs_grad(q, k, v):  # (a call with gradients goes through autograd)
                launch = fwd_sm90.varlen_launcher(q, k, p, *index)
            _remember(_varlen_memo, key, (p, d, values, launch))
        return res
    if check is not None:
        check.wait()  # the reference indexes with the values: check them first
    out, lse = reference.attention_ref_varlen(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
        seqused_k=seqused_k, page_table=page_table, softmax_scale=p.softmax_scale,
        causal=False, window_size=_window(p), softcap=p.softcap,
        compute_dtype=_ref_compute_dtype(q.dtype),
    )  # fmt: skip
    return out.to(q.dtype), lse.float()


def _varlen_kernel(q, k, v, p, check, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                   page_table):  # fmt: skip
    """The SM90 forward of a varlen call that dispatch gave the kernel. The index checks are
    flagged on the device and read after the launch, as for a read-only KV-cache call (the
    kernel clamps offsets and lengths into its tensors)."""
    return _checked_launch(check, _varlen_run, q, k, v, p, cu_seqlens_q, cu_seqlens_k, seqused_q,
                           seqused_k, page_table)  # fmt: skip


def _varlen_run(q, k, v, p, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table):
    if _needs_grad(q, k, v):
        # dispatch served it, so only cu_seqlens_q / cu_seqlens_k are given
        return _KernelAttnVarlen.apply(
            q, k, v, p, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
        )
    return fwd_sm90.run_fwd_varlen(
        q, k, v, p, cu_seqlens_q=cu_seqlens_q.contiguous(),
        cu_seqlens_k=None if cu_seqlens_k is None else cu_seqlens_k.contiguous(),
        seqused_k=None if seqused_k is None else seqused_k.contiguous(),
        max_seqlen_q=p.seqlen_q,
        page_table=None if page_table is None else _rows_contiguous(page_table),
        seqused_q=None if seqused_q is None else seqused_q.contiguous(),
    )  # fmt: skip


def _checked_launch(check, launch, *args, **kw):
    """launch(*args, **kw) with a given index-value check deferred behind its flags launch (one
    launch ahead of the kernel) and read after the kernel's: it raises on a bad value, and the
    launched kernel stayed in bounds (it clamps offsets and lengths into its tensors)."""
    if check is not None:
        check.defer(fwd_sm90.index_flags)
    res = launch(*args, **kw)
    if check is not None:
        check.wait()
    return res


# The varlen entry's host fast path, like the dense one's: a call whose signature (q / k / v
# as _dense_signature; every index tensor's shape, strides, dtype and device; max_seqlen_q /
# max_seqlen_k, which must be ints; whether gradients are needed, which dispatch reads) matches
# an earlier call that the kernel served reuses its problem, decision, value-check
# description and bound launcher (fwd_sm90.varlen_launcher, where one applies): the index
# values are still checked on every call. Measured in docs/perf/README.md (forty-seventh and
# forty-eighth sessions).
_varlen_memo: dict = {}


def _varlen_signature(q, k, v, index, max_seqlen_q, max_seqlen_k, knobs) -> tuple | None:
    """The memo key of a varlen call, or None when it must take the full path (as
    _indexed_signature; max_seqlen_q / max_seqlen_k not ints)."""
    if type(max_seqlen_q) is not int or type(max_seqlen_k) is not int:
        return None
    return _indexed_signature(q, k, v, index, knobs, max_seqlen_q, max_seqlen_k,
                              _needs_grad(q, k, v))  # fmt: skip


def _indexed_signature(q, k, v, index, knobs, *extra) -> tuple | None:
    """The memo key of a call with index tensors (`index`, each a tensor or None; the
    KV-cache and varlen entries) and plain values `extra`, as _dense_signature, or None:
    tensor subclasses, a window that is not a 2-tuple."""
    if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
        return None
    for t in index:
        if t is not None and type(t) is not _Tensor:
            return None
    window = knobs[2]
    if type(window) is not tuple or len(window) != 2:
        return None
    return (
        q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
        v.dtype, q.device, k.device, v.device, (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15,
        *map(_index_meta, index), *extra, *knobs, *window, *map(type, knobs),
        *map(type, window),
    )  # fmt: skip


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    *,
    cache_seqlens,
    cache_batch_idx=None,
    page_table=None,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved=True,
    softmax_scale=None,
    causal=True,
    window_size=(None, None),
    softcap=0.0,
    num_splits=0,
    pack_gqa: bool | None = None,
    fallback: str | None = None,
):
    """KV-cache attention for decoding: optionally append new k/v into the cache, then attend.

    q (B, Sq, H, D). Dense cache k_cache (B_cache, S_cache, Hkv, D), v_cache (.., Dv), batch
    row b using cache row cache_batch_idx[b] (default b); or paged: k_cache (num_pages,
    page_size, Hkv, D) with page_table (B, max_pages) int32. cache_seqlens (int32 (B,), an int,
    or None = full) counts the keys already cached. k/v (B, S_new, Hkv, D[v]), if given, are
    written IN PLACE at positions cache_seqlens[b] .. + S_new - 1 of row b's cache. rotary_cos /
    rotary_sin (seqlen_ro, rotary_dim / 2) rotate the new k at those positions and q at
    cache_seqlens[b] + i when causal/windowed, else all q rows at cache_seqlens[b]
    (FlashAttention's rule; needs k/v); rotary_interleaved picks GPT-J pairs (True) or GPT-NeoX
    halves (False). Then q attends to the first cache_seqlens[b] + S_new keys of its row,
    causal bottom-right per row (default causal=True), window / softcap / num_splits /
    pack_gqa as in flash_attn_func.
    Returns out (B, Sq, H, Dv) in q's dtype and lse (B, H, Sq) float32.
    On SM90 the forward kernel serves dense and paged caches (the append and rotary are torch
    ops before it; page sizes that fit no TMA key tile, such as 1 or 8, are gathered into a
    dense copy first, which last_dispatch() reports). CPU runs the reference.
    See cute_attn.inference for the exact semantics.
    """
    knobs = (softmax_scale, causal, window_size, softcap, num_splits, pack_gqa, fallback,
             rotary_interleaved)  # fmt: skip
    key = None
    if k is None and v is None and rotary_cos is None and rotary_sin is None:
        if not torch.compiler.is_compiling():
            key = _kvcache_signature(q, k_cache, v_cache, cache_seqlens, cache_batch_idx,
                                     page_table, knobs)  # fmt: skip
    hit, key = _lookup(_kvcache_memo, key)
    if hit is not None:
        p, decision, values, launch = hit
        dispatch.replay(decision)
        check = _hit_check(values, q, cache_seqlens, cache_batch_idx, page_table)
        if launch is None:
            return _kvcache_kernel(q, k_cache, v_cache, p, check, cache_seqlens,
                                   cache_batch_idx, page_table)  # fmt: skip
        # the signature holds int32 (B,) cache_seqlens on q's device, unit-stride indices
        return _checked_launch(check, launch, q, k_cache, v_cache, cache_seqlens,
                               cache_batch_idx, page_table)  # fmt: skip

    p, values = validate_kvcache_static(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
        page_table=page_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        num_splits=num_splits, pack_gqa=pack_gqa,
    )  # fmt: skip
    _check_bool("rotary_interleaved", rotary_interleaved)
    if torch.compiler.is_compiling():
        # traced as one opaque op (two: the append mutates the caches, a read-only call does
        # not); its eager implementation is this function, value checks and all
        return _kvcache_op(q, k_cache, v_cache, k, v, p, cache_seqlens, cache_batch_idx,
                           page_table, rotary_cos, rotary_sin, rotary_interleaved,
                           fallback)  # fmt: skip
    check = None
    if values is not None and _can_read_values(q):
        check = values.check(cache_seqlens, cache_batch_idx, page_table)
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    if k is not None:
        named += [("k", k), ("v", v)]
    d = dispatch.select(p, tuple(named), fallback=fallback, entry="flash_attn_with_kvcache")
    prep = dict(
        cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, page_table=page_table,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
    )  # fmt: skip
    # A read-only kernel call flags its index values on the device and reads the flags after
    # the launch (ValueCheck.defer): reading them first drained the stream before every
    # decode step (0.66-0.75x of FA4 on the eager paged rows, docs/perf/README.md). Appends
    # (torch index writes) and rotary (torch gathers at cache_seqlens) must not run on
    # unchecked values: they read first.
    read_only = k is None and rotary_cos is None
    if check is not None and not (d.impl == "sm90_fwd" and read_only):
        check.wait()
        check = None
    if d.impl != "sm90_fwd":
        return inference.kvcache_reference(q, k_cache, v_cache, k, v, problem=p, **prep)
    q, seqused_k, _ = inference.kvcache_prepare(
        q, k_cache, v_cache, k, v, problem=p, lengths_dtype=torch.int32, with_pages=False, **prep
    )
    res = _kvcache_kernel(q, k_cache, v_cache, p, check, seqused_k, cache_batch_idx, page_table)
    if key is not None:  # bound after the call, as the dense entry's (_run)
        _remember_kvcache(key, p, d, values, q, k_cache, v_cache, page_table, cache_batch_idx)
    return res


# The KV-cache entry's host fast path, like the dense entry's: a read-only kernel call (no
# append, no rotary) whose signature matches an earlier one reuses its problem, decision,
# value-check description and bound launcher. Only tensor cache_seqlens calls are remembered:
# int or None lengths need a per-call lengths tensor (kvcache_prepare), which the full path
# builds. Measured in docs/perf/README.md ("KV-cache memo").
_kvcache_memo: dict = {}


def _index_meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _kvcache_signature(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, page_table, knobs):
    """The memo key of a read-only KV-cache call (as _indexed_signature), or None: lengths that
    are not a plain tensor too."""
    if type(cache_seqlens) is not _Tensor:
        return None
    index = (cache_seqlens, cache_batch_idx, page_table)
    return _indexed_signature(q, k_cache, v_cache, index, knobs)


def _remember_kvcache(key, p, d, values, q, k_cache, v_cache, page_table,
                      cache_batch_idx) -> None:  # fmt: skip
    launch = fwd_sm90.kvcache_launcher(
        q, k_cache, v_cache, p, batch_idx=cache_batch_idx is not None,
        paged=page_table is not None,
    )  # fmt: skip
    _remember(_kvcache_memo, key, (p, d, values, launch))


def _kvcache_op(q, k_cache, v_cache, k, v, p, cache_seqlens, cache_batch_idx, page_table,
                rotary_cos, rotary_sin, rotary_interleaved, fallback):  # fmt: skip
    """flash_attn_with_kvcache under torch.compile: the validated call as a custom op (the
    window normalized, causal folded into it; cache_seqlens a tensor, an int or None)."""
    from . import ops

    lens = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    lens_int = None if lens is not None else cache_seqlens
    common = (p.softmax_scale, p.window_left, p.window_right, p.softcap, p.num_splits,
              fallback or "", p.pack_gqa)  # fmt: skip
    if k is None:
        return ops.kvcache_fwd(q, k_cache, v_cache, lens, lens_int, cache_batch_idx, page_table,
                               *common)  # fmt: skip
    return ops.kvcache_append_fwd(q, k_cache, v_cache, k, v, lens, lens_int, cache_batch_idx,
                                  page_table, rotary_cos, rotary_sin, rotary_interleaved,
                                  *common)  # fmt: skip


def _kvcache_kernel(q, k_cache, v_cache, p, check, seqused_k, cache_batch_idx, page_table):
    """The SM90 kernel over a validated, already appended cache; a given check is deferred
    behind its flags launch and read after the kernel's (_checked_launch)."""
    return _checked_launch(
        check, fwd_sm90.run_fwd_kvcache, q, k_cache, v_cache, p,
        seqused_k=seqused_k.contiguous(),
        kv_batch_idx=None if cache_batch_idx is None else cache_batch_idx.contiguous(),
        page_table=None if page_table is None else _rows_contiguous(page_table),
    )  # fmt: skip


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """A (rows, cols) index tensor with unit column stride (any row stride), as kernels read
    it; copies only when the columns are strided (clone, not contiguous(), which keeps a
    size-1 dim's odd stride)."""
    return t if t.stride(-1) == 1 else t.clone(memory_format=torch.contiguous_format)
