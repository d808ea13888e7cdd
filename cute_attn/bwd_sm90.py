"""Host side of the SM90 backward kernel: compile key, cached build, pre/postprocess, launch.

The kernels (torch-free) are cute_attn.arch.sm90.flash_bwd and the two small CuTe kernels
around it, all on the caller's stream:
  * preprocess (arch/common/bwd_preprocess.py): lse_log2 = lse * log2(e) (+inf for empty rows
    and for the padding up to a multiple of tile_m, so P = 0 there without a bounds check),
    D = rowsum(dO * O) in fp32, the fp32 dQ accumulator zeroed; an lse gradient is then
    subtracted from D here (D = rowsum(dO * O) - dlse);
  * postprocess (arch/common/bwd_postprocess.py): dQ = accumulator * softmax_scale in the
    input dtype; for GQA / MQA dK and dV (written per query head) are summed in fp32 over the
    query heads sharing a KV head by torch.

`backward(...)` is the entry the autograd formulas call: SM90 kernel when it serves the
problem, else the reference's analytic backward (recorded in `last_dispatch()`, warned once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from . import dispatch, reference
from .arch.sm90.tile_config import BWD_HEAD_DIMS, BwdTileConfig, bwd_tile_config
from .cache import KernelKey, compiled_cache, export_only
from .fwd_sm90 import (
    ARCH,
    Sm90Key,
    _artifact_options,
    softmax_scales,
    static_features,
    unsupported_reason,
)  # fmt: skip
from .problem import AttnProblem


@dataclasses.dataclass(frozen=True)
class BwdKey(Sm90Key):
    """Everything that changes the generated backward code."""

    deterministic: bool
    tile: tuple  # dataclasses.astuple(BwdTileConfig)


def bwd_key(p: AttnProblem, arch: str = ARCH) -> BwdKey:
    return _bwd_key(arch, *static_features(p), p.deterministic)


@functools.lru_cache(maxsize=1024)
def _bwd_key(arch, dtype, d, dv, h, hkv, has_left, has_right, has_softcap, causal, local, det):
    tile = dataclasses.astuple(bwd_tile_config(d, dv, causal, local, has_softcap, det))
    return BwdKey(arch, dtype, d, dv, h, hkv, has_left, has_right, has_softcap, det, tile)


@dataclasses.dataclass(frozen=True)
class BwdAuxKey(KernelKey):
    """The preprocess ("pre") and postprocess ("post") kernels: head counts and lengths are
    runtime values for them."""

    arch: str
    kind: str
    dtype: str
    head_dim: int
    head_dim_v: int


@compiled_cache("sm90_bwd_aux", exportable=True)
def build_bwd_aux(key: BwdAuxKey):
    from .arch.sm90 import compile as c  # imports cutlass: only when building

    engine = not export_only()
    if key.kind == "pre":
        return c.compile_bwd_preprocess(key.dtype, key.head_dim, key.head_dim_v, jit_engine=engine)
    return c.compile_bwd_postprocess(key.dtype, key.head_dim, jit_engine=engine)


@functools.lru_cache(maxsize=64)
def _aux_keys(arch: str, dtype: str, d: int, dv: int) -> tuple[BwdAuxKey, BwdAuxKey]:
    return BwdAuxKey(arch, "pre", dtype, d, dv), BwdAuxKey(arch, "post", dtype, d, dv)


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
    tile = BwdTileConfig(*bwd_key(p).tile).tile_head_dims(*dims)
    if tile == dims:
        return None
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


def run_bwd(q, k, v, out, lse, dout, p: AttnProblem, dlse=None, key: BwdKey | None = None):
    """dq, dk, dv of the SM90 kernel, in the input dtype. lse (B, H, Sq) fp32 natural log.
    `key`: a variant other than the tuning table's (scripts/tune_bwd_sm90.py)."""
    b, sq, h, d = q.shape
    sk, hkv, dv_dim = k.shape[1], k.shape[2], v.shape[3]
    if b == 0 or sq == 0 or sk == 0:
        return tuple(t.new_zeros(t.shape) for t in (q, k, v))
    key = key or bwd_key(p)
    pre_key, post_key = _aux_keys(key.arch, p.dtype, d, dv_dim)
    cfg = BwdTileConfig(*key.tile)
    dout, out = _tma_ready(dout), _tma_ready(out)
    sq_pad = -(-sq // cfg.tile_m) * cfg.tile_m
    f32 = dict(dtype=torch.float32, device=q.device)
    lse_log2, dsum = torch.empty((b, h, sq_pad), **f32), torch.empty((b, h, sq_pad), **f32)
    dq_acc = torch.empty((b, sq, h, d), **f32)
    dq = torch.empty((b, sq, h, d), dtype=q.dtype, device=q.device)
    dk_h = torch.empty((b, sk, h, d), dtype=q.dtype, device=q.device)
    dv_h = torch.empty((b, sk, h, dv_dim), dtype=q.dtype, device=q.device)
    # deterministic: one zeroed turn counter per (batch, head, query tile); otherwise the
    # kernel never reads it, so a tiny uninitialized tensor (no fill launch) stands in
    if p.deterministic:
        sem = torch.zeros((b, h, sq_pad // cfg.tile_m), dtype=torch.int32, device=q.device)
    else:
        sem = torch.empty((1, h, 1), dtype=torch.int32, device=q.device)
    pre, main, post = build_bwd_aux(pre_key), build_bwd(key), build_bwd_aux(post_key)
    scale_log2, premul = softmax_scales(p.softmax_scale, p.softcap)
    windows = (max(p.window_left, 0), max(p.window_right, 0))
    with contextlib.ExitStack() as stack:
        if q.device.index != torch.cuda.current_device():
            stack.enter_context(torch.cuda.device(q.device))  # launches go to q's device
        pre(out, dout, lse.contiguous(), lse_log2, dsum, dq_acc)
        if dlse is not None:
            dsum[:, :, :sq] -= dlse.float()
        main(q, k, v, dout, lse_log2, dsum, dq_acc, dk_h, dv_h, sem, scale_log2, premul,
             p.softmax_scale, *windows)  # fmt: skip
        post(dq_acc, dq, p.softmax_scale)
    if h == hkv:
        return dq, dk_h, dv_h
    g = h // hkv
    dk = dk_h.view(b, sk, hkv, g, d).sum(3, dtype=torch.float32).to(k.dtype)
    dv = dv_h.view(b, sk, hkv, g, dv_dim).sum(3, dtype=torch.float32).to(v.dtype)
    return dq, dk, dv


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
