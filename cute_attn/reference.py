"""Reference attention in plain PyTorch: the single source of truth for semantics.

Every kernel test compares against these functions, and they double as the CPU / fallback
path. They run on any device and any float dtype (fp16, bf16, fp32, fp64) and are written for
clarity and exactness, not speed.

Semantics (the package contract):
  * layout (batch, seq, heads, dim); varlen packs sequences as (total, heads, dim).
  * one mask rule (`visible_mask`): key j is visible to query i iff
        i + Sk - Sq - left <= j <= i + Sk - Sq + right      (a bound is skipped when it is -1)
    with (left, right) from `cute_attn.problem.normalize_window`, which folds `causal` in as
    right = 0 (bottom-right aligned causal).
  * softcap > 0 replaces the scaled score s by softcap * tanh(s / softcap) before masking.
  * GQA / MQA: query head h reads KV head h // (H // Hkv).
  * a query row that sees no key gives out = 0 and lse = -inf (never NaN).
  * lse is the natural-log logsumexp of the (scaled, softcapped) scores, float32
    (float64 when compute_dtype is float64), shape (B, H, Sq) dense or (H, total_q) varlen.

Public functions:
  visible_mask, key_block_range, repeat_kv, attention_ref, attention_ref_tiled,
  attention_ref_varlen, attention_ref_backward.

Memory: `attention_ref` and `attention_ref_backward` process blocks of query rows so that the
score-sized temporaries stay under `score_budget_bytes` (default: env
CUTE_ATTN_REF_BUDGET_BYTES, else 1 GiB); a single query row is the smallest block.

Tests: `python3 -m pytest tests/test_reference.py` (CPU, a few seconds).
"""

from __future__ import annotations

import math
import os

import torch

from cute_attn.problem import normalize_window

__all__ = [
    "visible_mask",
    "key_block_range",
    "repeat_kv",
    "attention_ref",
    "attention_ref_tiled",
    "attention_ref_varlen",
    "attention_ref_backward",
]

_DEFAULT_BUDGET_BYTES = 1 << 30
# Score-sized tensors alive at once per block (raw scores, softcapped/masked scores, exp /
# probabilities; the backward also holds dP and dS). The budget is charged for all of them.
_FWD_SCORE_TEMPS = 3
_BWD_SCORE_TEMPS = 5
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


# --------------------------------------------------------------------------------------------
# mask rule and helpers
# --------------------------------------------------------------------------------------------


def visible_mask(
    seqlen_q: int,
    seqlen_k: int,
    window_left: int = -1,
    window_right: int = -1,
    *,
    device=None,
    q_offset: int = 0,
    q_len: int | None = None,
) -> torch.Tensor:
    """Bool (q_len, seqlen_k) keep mask, True = key visible; THE one mask rule of the package.

    j is visible to i iff i + Sk - Sq - left <= j <= i + Sk - Sq + right, a bound being skipped
    when it is -1. Rows are the query rows [q_offset, q_offset + q_len) (default: all rows
    from q_offset), so blocked evaluation sees exactly the rows of the full mask. Pass windows
    already normalized by `cute_attn.problem.normalize_window` (causal is right = 0).
    """
    if q_len is None:
        q_len = seqlen_q - q_offset
    i = torch.arange(q_offset, q_offset + q_len, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    diag = i + (seqlen_k - seqlen_q)  # the key column aligned with query row i
    mask = torch.ones(q_len, seqlen_k, dtype=torch.bool, device=device)
    if window_left >= 0:
        mask &= j >= diag - window_left
    if window_right >= 0:
        mask &= j <= diag + window_right
    return mask


def key_block_range(
    m_start: int,
    m_end: int,
    seqlen_q: int,
    seqlen_k: int,
    window_left: int,
    window_right: int,
    block_n: int,
) -> tuple[int, int]:
    """Key tiles [n_block_min, n_block_max) that hold a visible key for query rows [m_start, m_end).

    The kernel's tile-skipping rule. Each row's visible keys form one interval and consecutive
    rows shift it by one column, so the union over a query tile is the single interval
    [m_start + off - left, m_end - 1 + off + right] clipped to [0, Sk), off = Sk - Sq. Every
    tile in the returned range therefore holds at least one visible key, and every tile outside
    it holds none (tests check both directions). Returns (0, 0) when nothing is visible.
    """
    off = seqlen_k - seqlen_q
    lo = max(0, m_start + off - window_left) if window_left >= 0 else 0
    hi = min(seqlen_k - 1, m_end - 1 + off + window_right) if window_right >= 0 else seqlen_k - 1
    if m_end <= m_start or lo > hi:
        return 0, 0
    return lo // block_n, hi // block_n + 1


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, S, Hkv, D) -> (B, S, num_heads, D) with query head h reading KV head h // (H // Hkv)."""
    hkv = x.shape[2]
    if num_heads % hkv != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_heads_kv {hkv}")
    return x.repeat_interleave(num_heads // hkv, dim=2)


def _budget(score_budget_bytes: int | None) -> int:
    if score_budget_bytes is not None:
        return int(score_budget_bytes)
    return int(os.environ.get("CUTE_ATTN_REF_BUDGET_BYTES", _DEFAULT_BUDGET_BYTES))


def _plan_blocks(batch: int, seqlen_q: int, row_bytes: int, budget: int) -> tuple[int, int]:
    """(batch items per block, query rows per block) keeping blocks under `budget` bytes.

    `row_bytes` is what one query row of one batch item costs. Whole batch items are grouped
    while they fit; otherwise one item at a time, split into query blocks (>= 1 row).
    """
    per_item = max(1, seqlen_q * row_bytes)
    if budget >= per_item:
        return max(1, min(batch, budget // per_item)), max(1, seqlen_q)
    return 1, max(1, budget // max(1, row_bytes))


def _resolve_dtype(q: torch.Tensor, compute_dtype) -> tuple[torch.dtype, torch.dtype, bool]:
    """(compute dtype, lse dtype, native) -- native: compute_dtype=None, plain same-dtype torch."""
    native = compute_dtype is None
    cdt = q.dtype if native else compute_dtype
    if not cdt.is_floating_point:
        raise TypeError(f"compute dtype must be a float dtype, got {cdt}")
    lse_dtype = torch.float64 if cdt == torch.float64 else torch.float32
    return cdt, lse_dtype, native


def _check_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D (batch, seq, heads, dim)")
    b, _, h, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError("q, k, v must share the batch size")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError("k and v must share seqlen_k and num_heads_kv")
    if k.shape[3] != d:
        raise ValueError("q and k must share head_dim")
    if k.shape[2] == 0 or h % k.shape[2] != 0:
        raise ValueError(f"num_heads {h} is not a multiple of num_heads_kv {k.shape[2]}")


def _scale(q: torch.Tensor, softmax_scale) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def _group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Views for grouped matmuls: q (B, Hkv, G, Sq, D), k^T (B, Hkv, D, Sk), v (B, Hkv, Sk, Dv).

    Query heads are folded as h = hk * G + g, i.e. h -> KV head h // G, without repeating K/V.
    """
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, sq, hkv, h // hkv, d).permute(0, 2, 3, 1, 4)
    return qg, k.permute(0, 2, 3, 1), v.permute(0, 2, 1, 3)


def _scores(qb: torch.Tensor, kt: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Scaled (and softcapped) scores (b, Hkv, G, bm, Sk) for query block qb (b, Hkv, G, bm, D)."""
    b, hkv, g, bm, d = qb.shape
    # Fold G into rows so K is shared by the group instead of broadcast-copied per head.
    s = torch.matmul(qb.reshape(b, hkv, g * bm, d), kt).view(b, hkv, g, bm, -1)
    s = s * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    return s


# --------------------------------------------------------------------------------------------
# dense forward
# --------------------------------------------------------------------------------------------


def _forward_block(s: torch.Tensor, vb: torch.Tensor, mask, native: bool):
    """Softmax(s) @ v for one block; s (b, Hkv, G, bm, Sk), vb (b, Hkv, Sk, Dv), mask (bm, Sk)."""
    b, hkv, g, bm, sk = s.shape
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if native:
        # Plain same-dtype torch, as the FlashAttention error rule's baseline does it.
        lse = torch.logsumexp(s, dim=-1)
        p = torch.softmax(s, dim=-1)
        if mask is not None:
            p = p.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)  # empty rows: NaN -> 0
        out = torch.matmul(p.reshape(b, hkv, g * bm, sk).to(vb.dtype), vb)
        return out.view(b, hkv, g, bm, -1), lse
    # Detached max: out and lse are invariant in it, so autograd stays exact, and with the
    # max at 0 for empty rows exp() gives exact zeros there (no NaN, also in gradients).
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    has = denom > 0
    l_safe = torch.where(has, denom, torch.ones_like(denom))
    out = torch.matmul(e.reshape(b, hkv, g * bm, sk), vb).view(b, hkv, g, bm, -1) / l_safe
    lse = torch.where(has, m + torch.log(l_safe), torch.full_like(denom, float("-inf")))
    return out, lse.squeeze(-1)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size=(None, None),
    softcap: float = 0.0,
    compute_dtype: torch.dtype | None = torch.float32,
    score_budget_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention. q (B,Sq,H,D), k (B,Sk,Hkv,D), v (B,Sk,Hkv,Dv) -> (out, lse).

    out (B, Sq, H, Dv) in compute_dtype; lse (B, H, Sq) float32 (float64 for fp64 compute).
    compute_dtype=None computes in the input dtype without upcasting (matmuls and softmax in
    that dtype via torch.softmax, the "same-dtype torch" baseline); lse is still float32.
    Differentiable with torch.autograd (no NaN in gradients, also for fully masked rows).
    """
    _check_dense(q, k, v)
    cdt, lse_dtype, native = _resolve_dtype(q, compute_dtype)
    scale = _scale(q, softmax_scale)
    left, right = normalize_window(causal, window_size)
    b, sq, h, _ = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    out_dtype = cdt
    if sk == 0 or sq == 0 or b == 0:
        # Nothing visible anywhere (or nothing to compute): out 0, lse -inf.
        out = q.new_zeros((b, sq, h, dv), dtype=out_dtype)
        lse = torch.full((b, h, sq), float("-inf"), dtype=lse_dtype, device=q.device)
        return out, lse
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    qg, kt, vt = _group(q, k, v)
    g = h // hkv
    windowed = left >= 0 or right >= 0
    row_bytes = h * sk * torch.empty((), dtype=cdt).element_size() * _FWD_SCORE_TEMPS
    bb, bm = _plan_blocks(b, sq, row_bytes, _budget(score_budget_bytes))

    outs, lses = [], []
    for b0 in range(0, b, bb):
        b1 = min(b, b0 + bb)
        o_blocks, l_blocks = [], []
        for m0 in range(0, sq, bm):
            m1 = min(sq, m0 + bm)
            s = _scores(qg[b0:b1, :, :, m0:m1], kt[b0:b1], scale, softcap)
            mask = (
                visible_mask(sq, sk, left, right, device=q.device, q_offset=m0, q_len=m1 - m0)
                if windowed
                else None
            )
            o, lse_b = _forward_block(s, vt[b0:b1], mask, native)
            o_blocks.append(o)
            l_blocks.append(lse_b)
        outs.append(torch.cat(o_blocks, dim=3))
        lses.append(torch.cat(l_blocks, dim=3))
    out = torch.cat(outs, dim=0)  # (B, Hkv, G, Sq, Dv)
    lse = torch.cat(lses, dim=0)  # (B, Hkv, G, Sq)
    out = out.permute(0, 3, 1, 2, 4).reshape(b, sq, h, dv).to(out_dtype)
    lse = lse.reshape(b, hkv * g, sq).to(lse_dtype)
    return out, lse


# --------------------------------------------------------------------------------------------
# tiled (the kernel's online-softmax recurrence)
# --------------------------------------------------------------------------------------------


def attention_ref_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size=(None, None),
    softcap: float = 0.0,
    block_m: int = 128,
    block_n: int = 128,
    compute_dtype: torch.dtype | None = torch.float32,
    stats: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's recurrence in PyTorch; same inputs/outputs as `attention_ref`.

    For each block_m query tile, walk the key tiles of `key_block_range` (tiles with no visible
    key are skipped) keeping a running max m, running sum l and a rescaled accumulator acc in
    the exp2 domain (scores * softmax_scale * log2(e)); out = acc / l, lse = (m + log2 l) ln 2.
    If `stats` is a dict it receives counts: tiles_total, tiles_computed, tiles_skipped,
    tiles_masked (computed tiles that needed an element mask). compute_dtype=None computes in
    the input dtype.
    """
    _check_dense(q, k, v)
    if block_m < 1 or block_n < 1:
        raise ValueError("block_m and block_n must be >= 1")
    cdt, lse_dtype, _ = _resolve_dtype(q, compute_dtype)
    scale = _scale(q, softmax_scale)
    left, right = normalize_window(causal, window_size)
    b, sq, h, _ = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = h // hkv
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    qg, kt, vt = _group(q, k, v)
    n_tiles_m = -(-sq // block_m)
    n_tiles_n = -(-sk // block_n)
    counts = {"tiles_total": n_tiles_m * n_tiles_n, "tiles_computed": 0, "tiles_masked": 0}

    if softcap > 0:
        # Same folding as the kernel: tanh(s * scale / softcap) * (softcap * log2 e).
        pre, post = scale / softcap, softcap * _LOG2E
    else:
        pre, post = scale * _LOG2E, 1.0
    neg_inf = float("-inf")
    out_tiles, lse_tiles = [], []
    for mt in range(n_tiles_m):
        m0, m1 = mt * block_m, min(sq, (mt + 1) * block_m)
        rows = m1 - m0
        qb = qg[:, :, :, m0:m1].reshape(b, hkv, g * rows, -1)
        m_run = torch.full((b, hkv, g * rows, 1), neg_inf, dtype=cdt, device=q.device)
        l_run = torch.zeros((b, hkv, g * rows, 1), dtype=cdt, device=q.device)
        acc = torch.zeros((b, hkv, g * rows, dv), dtype=cdt, device=q.device)
        n_min, n_max = key_block_range(m0, m1, sq, sk, left, right, block_n)
        row_mask = visible_mask(sq, sk, left, right, device=q.device, q_offset=m0, q_len=rows)
        for nt in range(n_min, n_max):
            n0, n1 = nt * block_n, min(sk, (nt + 1) * block_n)
            counts["tiles_computed"] += 1
            s2 = torch.matmul(qb, kt[..., n0:n1]) * pre
            if softcap > 0:
                s2 = torch.tanh(s2) * post
            tile_mask = row_mask[:, n0:n1]
            if not bool(tile_mask.all()):
                counts["tiles_masked"] += 1
                # (rows, n) -> (g * rows, n): the mask is the same for every head of a group.
                s2 = s2.masked_fill(~tile_mask.repeat(g, 1), neg_inf)
            m_new = torch.maximum(m_run, s2.amax(dim=-1, keepdim=True))
            # Rows with nothing visible yet keep max -inf; use 0 so exp2 gives 0, not NaN.
            m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp2(m_run - m_safe)
            p = torch.exp2(s2 - m_safe)
            l_run = l_run * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, vt[:, :, n0:n1])
            m_run = m_new
        has = l_run > 0
        l_safe = torch.where(has, l_run, torch.ones_like(l_run))
        out_tiles.append((acc / l_safe).view(b, hkv, g, rows, dv))
        lse_t = torch.where(
            has, (m_run + torch.log2(l_safe)) * _LN2, torch.full_like(l_run, neg_inf)
        )
        lse_tiles.append(lse_t.view(b, hkv, g, rows))
    counts["tiles_skipped"] = counts["tiles_total"] - counts["tiles_computed"]
    if stats is not None:
        stats.update(counts)
    if sq == 0:
        out = q.new_zeros((b, sq, h, dv))
        lse = torch.full((b, h, sq), neg_inf, dtype=lse_dtype, device=q.device)
        return out, lse
    out = torch.cat(out_tiles, dim=3).permute(0, 3, 1, 2, 4).reshape(b, sq, h, dv)
    lse = torch.cat(lse_tiles, dim=3).reshape(b, h, sq).to(lse_dtype)
    return out, lse


# --------------------------------------------------------------------------------------------
# varlen / paged
# --------------------------------------------------------------------------------------------


def _ints(x) -> list[int] | None:
    if x is None:
        return None
    return [int(t) for t in (x.tolist() if isinstance(x, torch.Tensor) else x)]


def attention_ref_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size=(None, None),
    softcap: float = 0.0,
    compute_dtype: torch.dtype | None = torch.float32,
    score_budget_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length (optionally paged) attention, one `attention_ref` call per sequence.

    q (total_q, H, D), sequence b owning rows [cu_seqlens_q[b], cu_seqlens_q[b+1]).
    Without page_table: k/v (total_k, Hkv, D[v]) packed by cu_seqlens_k.
    With page_table (B, max_pages) int: k/v (num_pages, page_size, Hkv, D[v]); sequence b's keys
    are pages page_table[b, 0], page_table[b, 1], ... concatenated, cut to its length.
    Lengths: Sq_b = seqused_q[b] if given else the cu_seqlens_q span; Sk_b = seqused_k[b] if
    given else the cu_seqlens_k span (with a page table, seqused_k or cu_seqlens_k is needed).
    Each sequence is its own problem (causal / window aligned bottom-right to its Sq_b, Sk_b).
    Rows of q not used by any sequence (past seqused_q[b], or outside cu_seqlens_q) get out 0
    and lse -inf (FlashAttention leaves them unwritten; here they are defined).
    Only the used K/V rows are ever gathered, so NaN/Inf in unused pages, in rows past
    seqused_k or in the unused tail of the last page cannot reach the output.
    Returns out (total_q, H, Dv) in compute_dtype and lse (H, total_q).
    """
    if q.dim() != 3:
        raise ValueError("varlen q must be (total_q, heads, dim)")
    cdt, lse_dtype, _ = _resolve_dtype(q, compute_dtype)
    cu_q = _ints(cu_seqlens_q)
    cu_k = _ints(cu_seqlens_k)
    used_q = _ints(seqused_q)
    used_k = _ints(seqused_k)
    nb = len(cu_q) - 1
    total_q, h, _ = q.shape
    hkv, dv = k.shape[-2], v.shape[-1]
    paged = page_table is not None
    if paged:
        if k.dim() != 4 or v.dim() != 4:
            raise ValueError("paged k/v must be (num_pages, page_size, heads_kv, dim)")
        if used_k is None and cu_k is None:
            raise ValueError("a page table needs seqused_k (or cu_seqlens_k) for the key lengths")
        page_size = k.shape[1]
        k_rows = k.reshape(-1, hkv, k.shape[-1])
        v_rows = v.reshape(-1, hkv, dv)
        pt = page_table.to(device=k.device, dtype=torch.long)
    else:
        if k.dim() != 3 or v.dim() != 3:
            raise ValueError("varlen k/v must be (total_k, heads_kv, dim)")
        if cu_k is None:
            raise ValueError("cu_seqlens_k is required without a page table")
    if cu_k is not None and len(cu_k) != nb + 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k describe different batch sizes")

    def zeros_rows(n: int):
        return (
            q.new_zeros((n, h, dv), dtype=cdt),
            torch.full((h, n), float("-inf"), dtype=lse_dtype, device=q.device),
        )

    out_parts, lse_parts = [], []
    pos = 0

    def pad_to(row: int):
        nonlocal pos
        if row > pos:
            o, lse_z = zeros_rows(row - pos)
            out_parts.append(o)
            lse_parts.append(lse_z)
            pos = row

    for bi in range(nb):
        q_start, q_span = cu_q[bi], cu_q[bi + 1] - cu_q[bi]
        sq = used_q[bi] if used_q is not None else q_span
        if not 0 <= sq <= q_span:
            raise ValueError(f"seqused_q[{bi}]={sq} is outside [0, {q_span}]")
        if used_k is not None:
            sk = used_k[bi]
        else:
            sk = cu_k[bi + 1] - cu_k[bi]
        if paged:
            if sk > pt.shape[1] * page_size:
                raise ValueError(f"sequence {bi}: seqlen_k {sk} exceeds its page table")
            j = torch.arange(sk, device=k.device)
            # Gather exactly the used rows: page page_table[b, j // ps], row j % ps.
            idx = pt[bi, j // page_size] * page_size + j % page_size
            kb, vb = k_rows[idx], v_rows[idx]
        else:
            k_start, k_span = cu_k[bi], cu_k[bi + 1] - cu_k[bi]
            if not 0 <= sk <= k_span:
                raise ValueError(f"seqused_k[{bi}]={sk} is outside [0, {k_span}]")
            kb, vb = k[k_start : k_start + sk], v[k_start : k_start + sk]
        pad_to(q_start)
        if sq > 0:
            o, lse_b = attention_ref(
                q[q_start : q_start + sq].unsqueeze(0),
                kb.unsqueeze(0),
                vb.unsqueeze(0),
                softmax_scale=softmax_scale,
                causal=causal,
                window_size=window_size,
                softcap=softcap,
                compute_dtype=compute_dtype,
                score_budget_bytes=score_budget_bytes,
            )
            out_parts.append(o[0])
            lse_parts.append(lse_b[0])
            pos = q_start + sq
        pad_to(q_start + q_span)
    pad_to(total_q)
    if not out_parts:
        return zeros_rows(0)
    return torch.cat(out_parts, dim=0).to(cdt), torch.cat(lse_parts, dim=1).to(lse_dtype)


# --------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------


def attention_ref_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size=(None, None),
    softcap: float = 0.0,
    dlse: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = torch.float32,
    score_budget_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Analytic backward (FlashAttention-2 formulation), recomputing P from lse.

    P = exp(S - lse) with S the scaled, softcapped, masked scores; dV = P^T dO; dP = dO V^T;
    D = rowsum(dO * O) - dlse (the lse gradient enters through D); dS = P (dP - D), times
    (1 - tanh^2) under softcap; dQ = dS K * scale; dK = dS^T Q * scale. GQA: dK/dV are summed
    over the query heads sharing a KV head. Fully masked rows (lse = -inf) give zero grads.
    Returns (dq (B,Sq,H,D), dk (B,Sk,Hkv,D), dv (B,Sk,Hkv,Dv)) in compute_dtype
    (None = input dtype).
    """
    _check_dense(q, k, v)
    cdt, _, _ = _resolve_dtype(q, compute_dtype)
    scale = _scale(q, softmax_scale)
    left, right = normalize_window(causal, window_size)
    b, sq, h, d = q.shape
    sk, hkv, dv_dim = k.shape[1], k.shape[2], v.shape[3]
    g = h // hkv
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    out, dout, lse = out.to(cdt), dout.to(cdt), lse.to(cdt)
    dq = torch.zeros((b, hkv, g, sq, d), dtype=cdt, device=q.device)
    dk = torch.zeros((b, hkv, sk, d), dtype=cdt, device=q.device)
    dv = torch.zeros((b, hkv, sk, dv_dim), dtype=cdt, device=q.device)
    if sk == 0 or sq == 0 or b == 0:
        return (
            dq.permute(0, 3, 1, 2, 4).reshape(b, sq, h, d),
            dk.transpose(1, 2),
            dv.transpose(1, 2),
        )

    qg, kt, vt = _group(q, k, v)
    kk = k.permute(0, 2, 1, 3)  # (B, Hkv, Sk, D)
    og = out.reshape(b, sq, hkv, g, dv_dim).permute(0, 2, 3, 1, 4)
    dog = dout.reshape(b, sq, hkv, g, dv_dim).permute(0, 2, 3, 1, 4)
    lse_g = lse.reshape(b, hkv, g, sq)
    # Empty rows have lse = -inf and all scores -inf; a 0 there makes P = exp(-inf) = 0.
    lse_g = torch.where(torch.isneginf(lse_g), torch.zeros_like(lse_g), lse_g)
    delta = (dog * og).sum(dim=-1)  # (B, Hkv, G, Sq)
    if dlse is not None:
        delta = delta - dlse.to(cdt).reshape(b, hkv, g, sq)
    windowed = left >= 0 or right >= 0
    row_bytes = h * sk * torch.empty((), dtype=cdt).element_size() * _BWD_SCORE_TEMPS
    bb, bm = _plan_blocks(b, sq, row_bytes, _budget(score_budget_bytes))

    for b0 in range(0, b, bb):
        b1 = min(b, b0 + bb)
        nbb = b1 - b0
        for m0 in range(0, sq, bm):
            m1 = min(sq, m0 + bm)
            rows = g * (m1 - m0)
            qb = qg[b0:b1, :, :, m0:m1]
            raw = torch.matmul(qb.reshape(nbb, hkv, rows, d), kt[b0:b1]) * scale
            if softcap > 0:
                t = torch.tanh(raw / softcap)
                s = t * softcap
            else:
                s = raw
            s = s.view(nbb, hkv, g, m1 - m0, sk)
            if windowed:
                mask = visible_mask(
                    sq, sk, left, right, device=q.device, q_offset=m0, q_len=m1 - m0
                )
                s = s.masked_fill(~mask, float("-inf"))
            p = torch.exp(s - lse_g[b0:b1, :, :, m0:m1].unsqueeze(-1)).reshape(nbb, hkv, rows, sk)
            do_b = dog[b0:b1, :, :, m0:m1].reshape(nbb, hkv, rows, dv_dim)
            dv[b0:b1] += torch.matmul(p.transpose(-1, -2), do_b)  # sums the G heads too
            dp = torch.matmul(do_b, vt[b0:b1].transpose(-1, -2))
            ds = p * (dp - delta[b0:b1, :, :, m0:m1].reshape(nbb, hkv, rows, 1))
            if softcap > 0:
                ds = ds * (1.0 - t * t)
            dq[b0:b1, :, :, m0:m1] = (torch.matmul(ds, kk[b0:b1]) * scale).view(
                nbb, hkv, g, m1 - m0, d
            )
            dk[b0:b1] += torch.matmul(ds.transpose(-1, -2), qb.reshape(nbb, hkv, rows, d)) * scale
    dq = dq.permute(0, 3, 1, 2, 4).reshape(b, sq, h, d)
    return dq, dk.transpose(1, 2), dv.transpose(1, 2)
