"""Inference building blocks: merging partial attention states and the KV-cache reference path.

What
----
* `merge_attn_states(out_a, lse_a, out_b, lse_b)`: combine two attention results computed over
  DISJOINT key sets of the same queries into the result over their union. This is the
  split-KV combine step, the cascade (shared prefix + per-request suffix) combine and the
  context-parallel combine. Plain torch ops, any device, no host sync.
* `kvcache_reference(...)`: the PyTorch semantics of `cute_attn.flash_attn_with_kvcache`
  (append new keys into a dense or paged cache in place, rotary embedding, then attention over
  each row's cache prefix). `api.flash_attn_with_kvcache` validates and dispatches, then calls it.

Semantics of the KV-cache call (FlashAttention's `flash_attn_with_kvcache`)
-------------------------------------------------------------------------
Batch row b uses cache row c = cache_batch_idx[b] (or b) of a dense cache
(B_cache, S_cache, Hkv, D), or the pages page_table[b, :] of a paged cache
(num_pages, page_size, Hkv, D), logical position j living at page page_table[b, j // page_size],
slot j % page_size. Let n_b = cache_seqlens[b] (int for all rows, int32 (B,), or None = full).
  1. rotary (rotary_cos/sin (seqlen_ro, rotary_dim / 2) given; needs new k/v): the new keys
     k[b, i] are rotated at position n_b + i. q[b, i] is rotated at n_b + i when the call is
     causal or windowed, else every q row at position n_b (FlashAttention's rule: a non-causal
     block of queries is treated as one position). Only the first rotary_dim dims rotate;
     interleaved rotates pairs (x0, x1), (x2, x3), ... (GPT-J); not interleaved rotates
     (x[i], x[i + rotary_dim / 2]) (GPT-NeoX). Computed in fp32 (fp64 for fp64), stored back in
     the input dtype, as FlashAttention's kernels do.
  2. append (k, v (B, S_new, Hkv, D[v]) given): the (rotated) k and v are written IN PLACE at
     positions n_b .. n_b + S_new - 1 of row b's cache; nothing else in the cache changes.
  3. attention of q over the first Sk_b = n_b + S_new keys of row b's cache, each batch row its
     own problem: bottom-right causal (key j visible to query i iff j <= i + Sk_b - Sq), window
     and softcap as in flash_attn_func. Only those Sk_b rows are ever read, so stale or NaN data
     elsewhere in the cache cannot reach the output.
Returns out (B, Sq, H, Dv) in q's dtype and lse (B, H, Sq) float32.

Reference implementation: a dense cache is viewed as a paged one whose pages are whole cache
rows (page_size = S_cache, page_table = cache_batch_idx[:, None]), so both layouts run through
the one `reference.attention_ref_varlen` (no second attention implementation here).

Mapping to the future SM90 paths
--------------------------------
The kernel version fuses steps 1-3: the producer warp rotates and stores the new K/V rows
(append) and loads cache tiles by page (paged TMA / cp.async gather); decode-shaped calls
(Sq small, Sk long) need split-KV over the cache, and `merge_attn_states` is exactly the
combine that split-KV (and a cascade over a shared prefix) performs on the partial (out, lse).
Today the SM90 path runs steps 1 and 2 here (`kvcache_prepare`, torch ops) and step 3 in the
forward kernel (per-row key counts, cache_batch_idx, split-KV, query heads packed per KV head
when Sq = 1); paged caches still run the reference.

Run the tests: python -m pytest -q tests/test_inference.py
"""

from __future__ import annotations

import torch

from . import reference
from .problem import AttnProblem
from .validation import _check_shape, _check_tensor, _describe

__all__ = ["merge_attn_states", "kvcache_reference", "apply_rotary"]

_LSE_DTYPES = (torch.float32, torch.float64)


# --------------------------------------------------------------------------------------------
# merging partial attention states
# --------------------------------------------------------------------------------------------


def _check_merge_args(out_a, lse_a, out_b, lse_b) -> None:
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        _check_tensor(name, t)
    if not out_a.dtype.is_floating_point:
        raise TypeError(f"out_a: expected a float dtype, got {out_a.dtype}")
    if out_b.dtype != out_a.dtype:
        raise TypeError(f"out_b: expected dtype {out_a.dtype} (same as out_a), got {out_b.dtype}")
    if lse_a.dtype not in _LSE_DTYPES:
        raise TypeError(
            f"lse_a: expected dtype torch.float32 (or torch.float64), got {lse_a.dtype}"
        )
    if lse_b.dtype != lse_a.dtype:
        raise TypeError(f"lse_b: expected dtype {lse_a.dtype} (same as lse_a), got {lse_b.dtype}")
    if out_a.dim() == 4:
        b, s, h, _ = out_a.shape
        lse_dims = (("batch", b, "out_a's batch"), ("num_heads", h, "out_a's num_heads"),
                    ("seqlen", s, "out_a's seqlen"))  # fmt: skip
    elif out_a.dim() == 3:
        t, h, _ = out_a.shape
        lse_dims = (("num_heads", h, "out_a's num_heads"), ("total", t, "out_a's total"))
    else:
        raise ValueError(
            f"out_a: expected a 4-D (batch, seqlen, num_heads, head_dim) or 3-D varlen "
            f"(total, num_heads, head_dim) tensor, got {_describe(out_a)}"
        )
    out_dims = tuple((f"dim{i}", n, "out_a's") for i, n in enumerate(out_a.shape))
    _check_shape("out_b", out_b, out_dims)
    _check_shape("lse_a", lse_a, lse_dims)
    _check_shape("lse_b", lse_b, lse_dims)
    for name, t in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if t.device != out_a.device:
            raise ValueError(f"{name}: expected a tensor on {out_a.device} (out_a's device), "
                             f"got {t.device}")  # fmt: skip


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over key set A and over a disjoint key set B into attention over A u B.

    Dense: out (B, S, H, D) with lse (B, H, S); varlen: out (T, H, D) with lse (H, T) (chosen
    by out_a.ndim). lse float32 (or float64), natural log, as every cute_attn entry returns.
    lse = logaddexp(lse_a, lse_b); out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse),
    computed in fp32 (fp64 if out or lse is fp64); out in out_a's dtype, lse in lse_a's dtype.
    A row with lse -inf on one side (no visible key there) takes the other side exactly, even
    if that side's out holds garbage; a row -inf on both sides gives out 0 and lse -inf.
    Any device, plain torch ops, no host sync; differentiable.
    """
    _check_merge_args(out_a, lse_a, out_b, lse_b)
    wide = torch.float64 in (out_a.dtype, lse_a.dtype)
    cdt = torch.float64 if wide else torch.float32
    la, lb = lse_a.to(cdt), lse_b.to(cdt)
    m = torch.maximum(la, lb)
    # Both -inf: shift by 0 so exp gives 0 + 0 and log(0) = -inf, never (-inf) - (-inf) = NaN.
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    lse = m + torch.log(torch.exp(la - m) + torch.exp(lb - m))
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    wa, wb = torch.exp(la - lse_safe), torch.exp(lb - lse_safe)
    # lse (B, H, S) -> (B, S, H, 1) to broadcast against out; varlen (H, T) -> (T, H, 1).
    if out_a.dim() == 4:
        wa, wb = wa.transpose(1, 2).unsqueeze(-1), wb.transpose(1, 2).unsqueeze(-1)
    else:
        wa, wb = wa.transpose(0, 1).unsqueeze(-1), wb.transpose(0, 1).unsqueeze(-1)
    # A zero weight drops that side entirely (0 * NaN would otherwise leak unwritten rows).
    zero = torch.zeros((), dtype=cdt, device=out_a.device)
    out = torch.where(wa > 0, out_a.to(cdt) * wa, zero) + torch.where(
        wb > 0, out_b.to(cdt) * wb, zero
    )
    return out.to(out_a.dtype), lse.to(lse_a.dtype)


# --------------------------------------------------------------------------------------------
# rotary embedding
# --------------------------------------------------------------------------------------------


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """Rotate the first rotary_dim dims of x (B, S, H, D) at positions (B, S) (int64).

    cos / sin: (seqlen_ro, rotary_dim / 2). Interleaved rotates pairs (x[2i], x[2i+1]) by angle
    i; otherwise (x[i], x[i + rotary_dim/2]). Computed in fp32 (fp64 for fp64), returned in
    x's dtype; the dims past rotary_dim are copied unchanged.
    """
    half = cos.shape[1]
    rd = 2 * half
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos.to(cdt)[positions].unsqueeze(2)  # (B, S, 1, half): one angle for every head
    s = sin.to(cdt)[positions].unsqueeze(2)
    xr = x[..., :rd].to(cdt)
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


# --------------------------------------------------------------------------------------------
# KV-cache reference
# --------------------------------------------------------------------------------------------


def _page_table(k_cache, cache_batch_idx, page_table, batch: int) -> torch.Tensor:
    """Row b's pages as (B, max_pages) int64, for either cache layout.

    A dense cache (B_cache, S_cache, Hkv, D) is read as S_cache-sized pages, one per cache row,
    so row b's page table is [its cache row]; the page size is k_cache.shape[1] either way.
    """
    if page_table is not None:
        return page_table.to(torch.int64)
    if cache_batch_idx is not None:
        return cache_batch_idx.to(torch.int64).unsqueeze(1)
    return torch.arange(batch, dtype=torch.int64, device=k_cache.device).unsqueeze(1)


def kvcache_prepare(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    *,
    problem: AttnProblem,
    cache_seqlens,
    cache_batch_idx: torch.Tensor | None,
    page_table: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    rotary_interleaved: bool,
    lengths_dtype: torch.dtype = torch.int64,
    with_pages: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Steps 1 and 2 of a validated KV-cache call (module docstring): rotary, then the in-place
    append. Returns (q, rotated when asked; seqused_k (B,) in lengths_dtype = keys each row
    attends to; the (B, max_pages) int64 page table, a dense cache's being its cache rows, or
    None when with_pages is False and nothing was appended).

    The kernel path asks for int32 lengths and no page table: without an append or rotary and
    with int32 cache_seqlens on q's device this launches no torch op at all (each small op
    costs host time on the per-token decode path).

    `problem` is what validation.validate_kvcache returned for these arguments (its window is
    normalized, softmax_scale resolved). Rotary reads the largest cache_seqlens on the host
    (one sync) to check the rotary table's length; nothing else syncs.
    """
    p = problem
    device = q.device
    batch, seqlen_q, num_heads, _ = q.shape
    seqlen_new = 0 if k is None else k.shape[1]
    pt = None
    if with_pages or seqlen_new > 0:
        pt = _page_table(k_cache, cache_batch_idx, page_table, batch)
    page_size = k_cache.shape[1]
    # n_b = cache_seqlens[b]: keys already in row b's cache before this call.
    if isinstance(cache_seqlens, torch.Tensor):
        n_old = cache_seqlens.to(device=device, dtype=lengths_dtype)  # no-op when it already is
    else:
        full = p.seqlen_k if cache_seqlens is None else cache_seqlens
        n_old = torch.full((batch,), full, dtype=lengths_dtype, device=device)

    if rotary_cos is not None:  # with new k / v (validation)
        seqlen_ro = rotary_cos.shape[0]
        # Causal / windowed: q row i sits at n_b + i; otherwise every q row at n_b (FA's rule).
        q_steps = seqlen_q if p.has_window else 1
        last = int(n_old.max()) + max(q_steps, seqlen_new) - 1 if batch else -1
        if last >= seqlen_ro:
            raise ValueError(
                f"rotary_cos: seqlen_ro (rotary_cos.shape[0] = {seqlen_ro}) must exceed the "
                f"largest rotated position {last} (of q or the new k, counted from cache_seqlens)"
            )
        steps = torch.arange(seqlen_q, device=device)
        if not p.has_window:
            steps = torch.zeros_like(steps)
        q = apply_rotary(q, rotary_cos, rotary_sin, n_old[:, None] + steps, rotary_interleaved)
        pos_k = n_old[:, None] + torch.arange(seqlen_new, device=device)
        k = apply_rotary(k, rotary_cos, rotary_sin, pos_k, rotary_interleaved)

    if seqlen_new > 0:
        # Logical position j of row b lives at page pt[b, j // page_size], slot j % page_size.
        pos = n_old[:, None] + torch.arange(seqlen_new, device=device)  # (B, S_new)
        pages = torch.gather(pt, 1, pos // page_size)
        slots = pos % page_size
        k_cache[pages, slots] = k  # index_put_: in place, one write per new row, no host sync
        v_cache[pages, slots] = v
    return q, (n_old + seqlen_new if seqlen_new else n_old), pt


def kvcache_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    *,
    problem: AttnProblem,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary, in-place append and attention of a validated KV-cache call (module docstring);
    kwargs are kvcache_prepare's. The attention is reference.attention_ref_varlen over the
    used rows of each batch row's pages."""
    p = problem
    q, seqused_k, pt = kvcache_prepare(q, k_cache, v_cache, k, v, problem=p, **kwargs)
    device = q.device
    batch, seqlen_q, num_heads, _ = q.shape
    page_size = k_cache.shape[1]
    if k_cache.shape[0] * page_size == 0:
        # A cache with no slots holds no key (every Sk_b is 0): out 0, lse -inf. Handled here
        # because the reference's row gather cannot reshape an empty cache.
        out = q.new_zeros((batch, seqlen_q, num_heads, p.head_dim_v))
        lse = torch.full((batch, num_heads, seqlen_q), float("-inf"), dtype=torch.float32,
                         device=device)  # fmt: skip
        return out, lse
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    cu_q = torch.arange(batch + 1, dtype=torch.int64, device=device) * seqlen_q
    out, lse = reference.attention_ref_varlen(
        q.reshape(batch * seqlen_q, num_heads, q.shape[3]), k_cache, v_cache,
        cu_seqlens_q=cu_q, seqused_k=seqused_k, page_table=pt,
        softmax_scale=p.softmax_scale, causal=False, window_size=(p.window_left, p.window_right),
        softcap=p.softcap, compute_dtype=cdt,
    )  # fmt: skip
    out = out.reshape(batch, seqlen_q, num_heads, p.head_dim_v).to(q.dtype)
    lse = lse.reshape(num_heads, batch, seqlen_q).permute(1, 0, 2).float()
    return out, lse
