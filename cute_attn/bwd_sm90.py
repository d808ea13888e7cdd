"""Host side of the SM90 backward kernel: compile key, cached build, pre/postprocess, launch.

The kernels (torch-free) are cute_attn.arch.sm90.flash_bwd and the two small CuTe kernels
around it, all on the caller's stream:
  * preprocess (arch/common/bwd_preprocess.py): lse_log2 = lse * log2(e) (+inf for empty rows
    and for the padding up to a multiple of tile_m, so P = 0 there without a bounds check),
    D = rowsum(dO * O) in fp32 (minus the lse gradient when lse is used downstream), the
    fp32 dQ accumulator zeroed. Under the tile's pre_overlap (dense) it is a persistent grid of
    a few CTAs that the main kernel runs beside, waiting per query head for its rows;
  * postprocess (arch/common/bwd_postprocess.py): dQ = accumulator * softmax_scale in the
    input dtype. The accumulator is (batch, rows, heads, dim), or under the tile's dq_flat
    (batch, heads, rows padded to whole tiles, dQ^T's head-dim rows) with each tile in the
    main kernel's register order (arch/common/dq_flat.py), which the postprocess undoes. For
    GQA / MQA dK and dV (written per query head) are summed in fp32 over the query heads
    sharing a KV head by torch, unless the key's `group_heads` variant ran (a CTA
    per KV head walking its query heads, the sum in the kernel's registers; chosen by
    `runtime_bwd_key` from the grid size, bwd_tiles.bwd_group_heads). runtime_bwd_key also
    puts dense causal calls of at most 2k query rows at D = 96 / 128 on 64-row tiles
    (bwd_tiles.bwd_short_rows).

`backward(...)` is the entry the autograd formulas call: SM90 kernel when it serves the
problem, else the reference's analytic backward (recorded in `last_dispatch()`, warned once).
`backward_varlen(...)` is the same for packed sequences (cu_seqlens_q / cu_seqlens_k, no
seqused or pages): the kernels' varlen variants, whose per-row buffers (lse_log2, D, the dQ
accumulator, the deterministic counters) give each sequence whole tile_m-row tiles
(arch/common/seqlen.padded_row_offset), so no tile reaches into another sequence's rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from . import dispatch, reference
from .arch.common.dq_flat import DqFlatTile
from .arch.common.tail_model import tail_split
from .arch.sm90.bwd_tiles import (
    BWD_HEAD_DIMS,
    BWD_PRE_CTAS,
    BWD_TAIL_FIXUP_STEPS,
    BWD_TAIL_MAX_PARTS,
    BWD_TAIL_MIN_STEPS_POST,
    BwdTileConfig,
    bwd_group_heads,
    bwd_short_rows,
    bwd_tile_config,
)
from .cache import KernelKey, compiled_cache, export_only
from .fwd_sm90 import (
    ARCH,
    Sm90Key,
    _artifact_options,
    _num_sms,
    kernel_window,
    softmax_scales,
    static_features,
    unsupported_reason,
    varlen_grad_reason,
)  # fmt: skip
from .problem import AttnProblem


@dataclasses.dataclass(frozen=True)
class BwdKey(Sm90Key):
    """Everything that changes the generated backward code."""

    deterministic: bool
    tile: tuple  # dataclasses.astuple(BwdTileConfig)
    varlen: bool = False  # packed by cu_seqlens_q / cu_seqlens_k (presence, not values)
    # GQA / MQA: a CTA per KV head walks its query heads, dK / dV summed in the kernel
    # (bwd_tiles.bwd_group_heads picks it from the grid size)
    group_heads: bool = False


def bwd_key(
    p: AttnProblem, arch: str = ARCH, group_heads: bool = False, short: bool = False
) -> BwdKey:
    """The key of p's backward variant; `group_heads` and `short` are the run-time buckets
    (bwd_tiles.bwd_group_heads, bwd_short_rows) that runtime_bwd_key decides."""
    return _bwd_key(arch, *static_features(p), p.deterministic, p.varlen, group_heads, short)


@functools.lru_cache(maxsize=1024)
def _bwd_key(
    arch, dtype, d, dv, h, hkv, has_left, has_right, has_softcap, causal, local, det, varlen,
    group_heads, short=False,
):  # fmt: skip
    group_heads = group_heads and h > hkv
    tile = bwd_tile_config(d, dv, causal, local, has_softcap, det, group_heads, varlen, short)
    tile = dataclasses.astuple(tile)
    return BwdKey(
        arch, dtype, d, dv, h, hkv, has_left, has_right, has_softcap, det, tile, varlen,
        group_heads,
    )  # fmt: skip


def runtime_bwd_key(p: AttnProblem, batch: int, seqlen_k: int) -> BwdKey:
    """The key a call runs: bwd_key with group_heads decided from the grid it would launch
    (batch sequences, the longest seqlen_k keys) and the device's SM count, and the short
    causal bucket from p.seqlen_q (dense calls only)."""
    tile_n = BwdTileConfig(*bwd_key(p).tile).tile_n
    ctas = batch * p.num_heads_kv * -(-seqlen_k // tile_n)
    sms = _num_sms(p.device_index)
    group = bwd_group_heads(
        p.qhead_per_kvhead,
        p.head_dim,
        p.causal,
        p.is_local,
        p.deterministic,
        p.varlen,
        ctas,
        sms,
    )
    short = bwd_short_rows(
        p.head_dim, p.causal, p.is_local, p.deterministic, p.varlen, group, p.seqlen_q
    )
    return bwd_key(p, group_heads=group, short=short)


@dataclasses.dataclass(frozen=True)
class BwdAuxKey(KernelKey):
    """The preprocess ("pre") and postprocess ("post") kernels: head counts and lengths are
    runtime values for them."""

    arch: str
    kind: str
    dtype: str
    head_dim: int
    head_dim_v: int
    varlen_tile_m: int = 0  # packed: the main kernel's tile_m, which pads each sequence's rows
    # the main kernel's register-order dQ tile (BwdTileConfig.dq_flat: tile_m, parts, groups, dims;
    # arch/common/dq_flat.DqFlatTile), or () for a (row, dim) accumulator: the preprocess
    # clears its whole tiles, the postprocess reads them back
    dq_flat: tuple[int, ...] = ()
    # postprocess: launched as the main kernel's programmatic dependent, waiting for each
    # (batch, head)'s main CTAs (BwdTileConfig.post_overlap)
    wait_done: bool = False
    # preprocess: the lse gradient is subtracted from D
    dlse: bool = False
    # preprocess: a persistent grid beside the main kernel, counting ready rows
    # (BwdTileConfig.pre_overlap)
    persistent: bool = False
    # both: the padded rows' padding comes first (BwdTileConfig.end_aligned)
    front_pad: bool = False


@compiled_cache("sm90_bwd_aux", exportable=True)
def build_bwd_aux(key: BwdAuxKey):
    from .arch.sm90 import compile as c  # imports cutlass: only when building

    engine, opts, tm = not export_only(), _artifact_options(), key.varlen_tile_m
    if key.kind == "pre":
        flat_dim = DqFlatTile(*key.dq_flat).acc_dim if key.dq_flat else 0
        return c.compile_bwd_preprocess(
            key.dtype, key.head_dim, key.head_dim_v, opts, jit_engine=engine, varlen_tile_m=tm,
            dq_flat_dim=flat_dim, dlse=key.dlse, persistent=key.persistent,
            front_pad=key.front_pad,
        )  # fmt: skip
    return c.compile_bwd_postprocess(
        key.dtype, key.head_dim, opts, jit_engine=engine, varlen_tile_m=tm, dq_flat=key.dq_flat,
        wait_done=key.wait_done, front_pad=key.front_pad,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _aux_keys(
    arch: str,
    dtype: str,
    d: int,
    dv: int,
    varlen_tile_m: int = 0,
    dq_flat: tuple = (),
    wait_done: bool = False,
    persistent: bool = False,
    dlse: bool = False,
    front_pad: bool = False,
) -> tuple[BwdAuxKey, BwdAuxKey]:
    return (
        BwdAuxKey(arch, "pre", dtype, d, dv, varlen_tile_m, dq_flat, dlse=dlse,
                  persistent=persistent, front_pad=front_pad),
        BwdAuxKey(arch, "post", dtype, d, dv, varlen_tile_m, dq_flat, wait_done,
                  front_pad=front_pad),
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _flat_fields(cfg: BwdTileConfig, head_dim: int) -> tuple:
    """The aux keys' dq_flat fields of a tile config (once per config, not per call)."""
    flat = cfg.dq_flat_tile(head_dim)
    return () if flat is None else dataclasses.astuple(flat)


def _dq_accumulator(cfg: BwdTileConfig, batch: int, rows: int, h: int, d: int, device):
    """The fp32 dQ accumulator (the preprocess clears it), (batch, rows, heads, d); under
    dq_flat a (batch, rows, heads, dQ^T's head-dim rows) view of (batch, heads, rows, that)
    storage, each (batch, head) pair's rows back to back (rows: whole tiles; DqFlatTile.acc_dim
    floats wide, D = 96's own 96 when the tile is compact, else dQ^T's 128)."""
    if cfg.dq_flat:
        dq_d = cfg.dq_flat_tile(d).acc_dim
        acc = torch.empty((batch, h, rows, dq_d), dtype=torch.float32, device=device)
        return acc.permute(0, 2, 1, 3)
    return torch.empty((batch, rows, h, d), dtype=torch.float32, device=device)


@compiled_cache("sm90_bwd", exportable=True)
def build_bwd(key: BwdKey):
    from .arch.sm90.compile import BwdSpec, compile_bwd  # imports cutlass: only when building

    fields = {f.name for f in dataclasses.fields(BwdSpec)} - {"config", "features"}
    spec = BwdSpec(**{name: getattr(key, name) for name in fields}, config=BwdTileConfig(*key.tile))
    return compile_bwd(spec, _artifact_options(), jit_engine=not export_only())


def bwd_unsupported_reason(p: AttnProblem, tensors) -> str | None:
    return unsupported_reason(p, tensors, BWD_HEAD_DIMS)


def bwd_kernel_note(p: AttnProblem) -> str | None:
    """What `last_backward_dispatch().reason` adds about the variant: padded head dims."""
    dims = (p.head_dim, p.head_dim_v)
    cfg = BwdTileConfig(*bwd_key(p).tile)
    tile = cfg.tile_head_dims(*dims)
    if tile == dims:
        k_cols = cfg.dq_tile_head_dim(p.head_dim)
        if k_cols == p.head_dim:
            return None
        return f"K's tile {k_cols} columns wide for dQ^T, columns past {p.head_dim} zero-filled"
    if p.head_dim == p.head_dim_v:
        return (
            f"head dim {p.head_dim} on the D={tile[0]} tiles, columns past {p.head_dim} zero-filled"
        )
    return f"head dims {dims} on {tile} tiles, columns past each zero-filled"


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    # dO from autograd can be any view (an expanded zero, a transpose): TMA and the 16-byte
    # vector loads need an aligned base, nonzero 16-byte strides and a contiguous last dim
    st = t.stride()
    if t.data_ptr() % 16 or any(s % 8 or s == 0 for s in st[:-1]) or st[-1] != 1:
        return t.contiguous()
    return t


def _scalars(p: AttnProblem) -> tuple:
    """The main kernel's runtime scalars: softmax_scale_log2, score_premul, softmax_scale,
    window_left, window_right."""
    scale_log2, premul = softmax_scales(p.softmax_scale, p.softcap)
    window = kernel_window(p, p.seqlen_q + p.seqlen_k)
    return scale_log2, premul, p.softmax_scale, *window


def _launch(q, pre, pre_args, main, main_args, post, post_args):
    """The three launches on q's device (torch's current stream there), back to back: with
    BwdTileConfig.pre_overlap / post_overlap the main kernel and the postprocess are their
    predecessors' programmatic dependents, so nothing may be queued between them."""
    with contextlib.ExitStack() as stack:
        if q.device.index != torch.cuda.current_device():
            stack.enter_context(torch.cuda.device(q.device))  # launches go to q's device
        pre(*pre_args)
        main(*main_args)
        post(*post_args)


def _dlse_rows(dlse: torch.Tensor | None) -> torch.Tensor | None:
    """The lse gradient as the preprocess reads it (laid out like lse, fp32, compact)."""
    return None if dlse is None else dlse.float().contiguous()


@functools.lru_cache(maxsize=256)
def _tail_split(num_tiles: int, num_sms: int, steps: int, post_overlap: bool) -> tuple[int, int]:
    """BwdTileConfig.tail_split's (tail tiles, parts) for a grid (one CTA an SM: the warp
    roles' register budgets take the whole file) of walks of `steps` query tiles; none of
    walks shorter than BWD_TAIL_MIN_STEPS_POST under post_overlap."""
    if post_overlap and steps < BWD_TAIL_MIN_STEPS_POST:
        return 0, 1
    return tail_split(num_tiles, num_sms, steps, BWD_TAIL_MAX_PARTS, BWD_TAIL_FIXUP_STEPS)


def run_bwd(
    q, k, v, out, lse, dout, p: AttnProblem, dlse=None, key: BwdKey | None = None,
    pre_ctas: int | None = None, tail: tuple[int, int] | None = None,
    timeline: torch.Tensor | None = None,
):  # fmt: skip
    """dq, dk, dv of the SM90 kernel, in the input dtype. lse (B, H, Sq) fp32 natural log.
    `key`: a variant other than the tuning table's, `pre_ctas`: a persistent preprocess grid
    other than bwd_tiles.BWD_PRE_CTAS, `tail`: (tail tiles, parts) for a tail_split variant
    other than its model's (scripts/tune_bwd_sm90.py, the GPU tests); `timeline`: with a
    `timeline` variant, an int32 tensor of at least (B x H x key tiles) x TIMELINE_WORDS
    words that the CTAs' event records fill (arch/common/timeline.py,
    scripts/bwd_timeline.py)."""
    b, sq, h, d = q.shape
    sk, hkv, dv_dim = k.shape[1], k.shape[2], v.shape[3]
    if b == 0 or sq == 0 or sk == 0:
        return tuple(t.new_zeros(t.shape) for t in (q, k, v))
    key = key or runtime_bwd_key(p, b, sk)
    cfg = BwdTileConfig(*key.tile)
    overlap = cfg.post_overlap or cfg.pre_overlap
    pre_key, post_key = _aux_keys(
        key.arch, p.dtype, d, dv_dim, 0, _flat_fields(cfg, d), cfg.post_overlap, cfg.pre_overlap,
        dlse is not None, cfg.end_aligned,
    )  # fmt: skip
    dout, out = _tma_ready(dout), _tma_ready(out)
    sq_pad = -(-sq // cfg.tile_m) * cfg.tile_m
    f32 = dict(dtype=torch.float32, device=q.device)
    lse_log2, dsum = torch.empty((b, h, sq_pad), **f32), torch.empty((b, h, sq_pad), **f32)
    # dq_flat adds whole tiles: rows padded like lse_log2's, all cleared by the preprocess
    dq_acc = _dq_accumulator(cfg, b, sq_pad if cfg.dq_flat else sq, h, d, q.device)
    dq = torch.empty((b, sq, h, d), dtype=q.dtype, device=q.device)
    h_dkv = hkv if key.group_heads else h  # dK / dV per KV head, or per query head
    dk_h = torch.empty((b, sk, h_dkv, d), dtype=q.dtype, device=q.device)
    dv_h = torch.empty((b, sk, h_dkv, dv_dim), dtype=q.dtype, device=q.device)
    # deterministic: a zeroed turn counter per (batch, head, query tile); then, under the
    # overlaps, [b, h, -2] post_overlap's count of main CTAs whose dQ adds landed and
    # [b, h, -1] pre_overlap's count of rows the preprocess wrote. Neither: the kernel never
    # reads it, so a tiny uninitialized tensor (no fill launch) stands in
    lead = sq_pad // cfg.tile_m if p.deterministic else 0  # sem's counters before the two
    if cfg.persistent_counter:
        lead = 1  # the persistent grid's tile counter, sem[0, 0, 0] (never deterministic)
    # tail_split: the last `tail_tiles` key tiles of the launch order (n fastest, then head,
    # then batch) run as `parts` CTAs each (1: none), with two zeroed counters per key tile
    # of sem first (the parts' dK / dV fixup, their writers' landed adds) and the parts'
    # partials in tail_acc
    num_n = -(-sk // cfg.tile_n)
    num_tiles = num_n * h * b
    tail_tiles, parts, tail_acc = 0, 1, None
    if cfg.tail_split:
        tail_tiles, parts = tail or _tail_split(
            num_tiles, _num_sms(p.device_index), -(-sq // cfg.tile_m), cfg.post_overlap
        )
        if not (0 <= tail_tiles <= num_tiles and parts >= 1):
            raise ValueError(f"tail split {tail_tiles, parts} of a grid of {num_tiles} key tiles")
        if tail_tiles == 0:
            parts = 1
        if parts > 1:
            floats = tail_tiles * parts * cfg.tail_slot_floats(d, dv_dim)
            tail_acc = torch.empty((floats,), **f32)
            lead = 2 * num_n  # (never deterministic: FlashBwdSm90 rejects it)
        else:
            tail_acc = lse_log2.view(-1)  # unread: no allocation
    if cfg.timeline:
        from .arch.common.timeline import TIMELINE_WORDS  # (imports cutlass: diagnostics only)

        if timeline is None or timeline.dtype != torch.int32 or not timeline.is_contiguous():
            raise ValueError("a timeline variant needs a contiguous int32 `timeline` tensor")
        if timeline.numel() < num_tiles * TIMELINE_WORDS:
            raise ValueError(f"timeline of {timeline.numel()} words for {num_tiles} CTAs")
        tail_acc = timeline.view(torch.float32).view(-1)
    if p.deterministic or overlap or parts > 1 or cfg.persistent_counter:
        sem = torch.zeros((b, h, lead + 2 * overlap), dtype=torch.int32, device=q.device)
    else:
        sem = torch.empty((1, h, 1), dtype=torch.int32, device=q.device)
    # the postprocess waits for all ceil(sk / tile_n) main CTAs of its (batch, head), each
    # counted by each of its dQ writer warps
    done = (sem, -(-sk // cfg.tile_n) * cfg.dq_writers) if cfg.post_overlap else (None, 0)
    ready = (None, 0)
    if cfg.pre_overlap:
        # the persistent preprocess keeps at most half the SMs (the main grid takes the rest
        # while it runs)
        ready = (sem, min(pre_ctas or BWD_PRE_CTAS, max(1, _num_sms(p.device_index) // 2)))
    pre, main, post = build_bwd_aux(pre_key), build_bwd(key), build_bwd_aux(post_key)
    _launch(
        q, pre, (out, dout, lse.contiguous(), _dlse_rows(dlse), lse_log2, dsum, dq_acc, None, sq,
                 *ready),
        main, (q, k, v, dout, lse_log2, dsum, dq_acc, dk_h, dv_h, sem, *_scalars(p), sk, None,
               None, tail_acc, num_tiles - tail_tiles, parts),
        post, (dq_acc, dq, p.softmax_scale, None, sq, *done),
    )  # fmt: skip
    return dq, *_sum_groups(dk_h, dv_h, hkv, k.dtype)


def _sum_groups(dk_h, dv_h, hkv: int, dtype):
    """dK / dV per KV head from the kernel's per-query-head ones (GQA / MQA: fp32 sums over
    the query heads sharing a KV head); (..., seq, heads, dim), any leading dims."""
    h = dk_h.shape[-2]
    if h == hkv:
        return dk_h, dv_h
    # a 16-bit sum accumulates in fp32 and rounds once: bitwise the fp32 sum's cast, in one
    # kernel without the fp32 intermediate (H200, 58728 x 32 x 128: 0.253 vs 0.368 ms a
    # tensor, docs/perf/gqa_sum_h200.json)
    return tuple(t.unflatten(-2, (hkv, h // hkv)).sum(-2).to(dtype) for t in (dk_h, dv_h))


def run_bwd_varlen(
    q, k, v, out, lse, dout, p: AttnProblem, *, cu_seqlens_q, cu_seqlens_k, dlse=None,
    key: BwdKey | None = None,
):  # fmt: skip
    """dq, dk, dv of packed sequences: q / out / dout (total_q, H, D[v]), k / v (total_k,
    Hkv, D[v]), lse (H, total_q) fp32, cu_seqlens int32 (B + 1,); p.seqlen_q / p.seqlen_k are
    the longest sequences (they size the grids)."""
    total_q, h, d = q.shape
    total_k, hkv, dv_dim = k.shape[0], k.shape[1], v.shape[2]
    batch = cu_seqlens_q.shape[0] - 1
    if total_k == 0 or batch == 0 or total_q == 0 or p.seqlen_q == 0 or p.seqlen_k == 0:
        return tuple(t.new_zeros(t.shape) for t in (q, k, v))
    key = key or runtime_bwd_key(p, batch, p.seqlen_k)
    cfg = BwdTileConfig(*key.tile)
    tm = cfg.tile_m
    pre_key, post_key = _aux_keys(
        key.arch, p.dtype, d, dv_dim, tm, _flat_fields(cfg, d), dlse=dlse is not None
    )
    dout, out = _tma_ready(dout), _tma_ready(out)
    # sequence b's rows start at floor((cu_q[b] + b * tm) / tm) * tm and span whole tiles:
    # every row lies below total_q + batch * tm (seqlen.padded_row_offset)
    rows = -(-(total_q + batch * tm) // tm) * tm
    f32 = dict(dtype=torch.float32, device=q.device)
    lse_log2, dsum = torch.empty((1, h, rows), **f32), torch.empty((1, h, rows), **f32)
    dq_acc = _dq_accumulator(cfg, 1, rows, h, d, q.device)
    dq = torch.empty((total_q, h, d), dtype=q.dtype, device=q.device)
    h_dkv = hkv if key.group_heads else h  # dK / dV per KV head, or per query head
    dk_h = torch.empty((total_k, h_dkv, d), dtype=q.dtype, device=q.device)
    dv_h = torch.empty((total_k, h_dkv, dv_dim), dtype=q.dtype, device=q.device)
    if p.deterministic:
        sem = torch.zeros((1, h, rows // tm), dtype=torch.int32, device=q.device)
    else:
        sem = torch.empty((1, h, 1), dtype=torch.int32, device=q.device)
    pre, main, post = build_bwd_aux(pre_key), build_bwd(key), build_bwd_aux(post_key)
    q1, k1, v1, o1, do1 = (t.unsqueeze(0) for t in (q, k, v, out, dout))
    dl = None if dlse is None else _dlse_rows(dlse).unsqueeze(0)
    _launch(
        q, pre, (o1, do1, lse.contiguous().unsqueeze(0), dl, lse_log2, dsum, dq_acc, cu_seqlens_q,
                 p.seqlen_q, None, 0),
        main, (q1, k1, v1, do1, lse_log2, dsum, dq_acc, dk_h.unsqueeze(0), dv_h.unsqueeze(0),
               sem, *_scalars(p), p.seqlen_k, cu_seqlens_q, cu_seqlens_k, None, 0, 1),
        post, (dq_acc, dq.unsqueeze(0), p.softmax_scale, cu_seqlens_q, p.seqlen_q, None, 0),
    )  # fmt: skip
    return dq, *_sum_groups(dk_h, dv_h, hkv, k.dtype)


def backward(q, k, v, out, lse, dout, p: AttnProblem, dlse=None):
    """Gradients (dq, dk, dv), contiguous, in the input dtypes: the SM90 kernel when it serves
    the problem, else the reference's analytic backward (warned once per reason, recorded)."""
    d = dispatch.select_backward(
        p, (("q", q), ("k", k), ("v", v), ("out", out)), bwd_unsupported_reason, bwd_kernel_note
    )
    if d.impl == "sm90_bwd":
        return run_bwd(q, k, v, out, lse, dout, p, dlse)
    dq, dk, dv = reference.attention_ref_backward(
        q, k, v, out, lse, dout, softmax_scale=p.softmax_scale, causal=False,
        window_size=(p.window_left, p.window_right), softcap=p.softcap, dlse=dlse,
    )  # fmt: skip
    return tuple(g.to(t.dtype).contiguous() for g, t in ((dq, q), (dk, k), (dv, v)))


def backward_varlen(q, k, v, out, lse, dout, p: AttnProblem, *, cu_seqlens_q, cu_seqlens_k,
                    dlse=None):  # fmt: skip
    """Gradients of a packed call (see run_bwd_varlen): the varlen kernels when they serve it,
    else the reference's analytic backward sequence by sequence (it reads cu_seqlens on the
    host), warned once and recorded like `backward`. Packed q and k / v only: seqused and
    paged problems raise (their forward refuses to run under autograd, see
    fwd_sm90.varlen_grad_reason)."""
    why = varlen_grad_reason(p)
    if why is not None:
        raise NotImplementedError(f"cute_attn: no backward for {why}")
    d = dispatch.select_backward(
        p, (("q", q), ("k", k), ("v", v), ("out", out)), bwd_unsupported_reason, bwd_kernel_note
    )
    if d.impl == "sm90_bwd":
        return run_bwd_varlen(
            q, k, v, out, lse, dout, p, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            dlse=dlse,
        )  # fmt: skip
    grads = [torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        dl = None if dlse is None else dlse[None, :, rq]
        g = reference.attention_ref_backward(
            q[None, rq], k[None, rk], v[None, rk], out[None, rq], lse[None, :, rq],
            dout[None, rq], softmax_scale=p.softmax_scale, causal=False,
            window_size=(p.window_left, p.window_right), softcap=p.softcap, dlse=dl,
            compute_dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
        )  # fmt: skip
        for acc, gb, rows in zip(grads, g, (rq, rk, rk)):
            acc[rows] = gb[0].to(acc.dtype)
    return tuple(grads)
