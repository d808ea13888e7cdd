"""Torch-free compile entry for the SM90 forward: fake tensors over symbolic dims.

`compile_fwd(spec)` returns a TVM-FFI compiled function taking torch tensors directly
(q, k, v, out, lse, softmax_scale_log2, score_premul, window_left, window_right, max_seqlen_q,
num_splits, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, kv_batch_idx, page_table,
batch_order) on torch's current stream; the seven optional int32 tensors are None unless
spec.features says the variant takes them (k / v are (num_pages, page_size, heads, dim) with
page_table).
Batch and sequence lengths and all strides but the last are symbolic, so one compiled object
serves every length; head counts and head dims are static (they are in the compile key).
Strides carry divisibility 8 (16-byte TMA rule), checked by the host.

Run on any machine (no GPU needed) with CUTE_DSL_ARCH=sm_90a set before cutlass is imported.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute

from ..common.bwd_postprocess import BwdPostprocess
from ..common.bwd_preprocess import BwdPreprocess
from ..common.dq_flat import DqFlatTile
from ..common.features import InputFeatures
from ..common.index_check import IndexCheck
from ..common.split_combine import SplitCombine
from .bwd_tiles import BwdTileConfig
from .flash_bwd import FlashBwdSm90
from .flash_fwd import FlashFwdSm90
from .tile_config import FwdTileConfig

DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


@dataclasses.dataclass(frozen=True)
class FwdSpec:
    dtype: str
    head_dim: int
    head_dim_v: int
    num_heads: int
    num_heads_kv: int
    has_left: bool
    has_right: bool
    has_softcap: bool
    config: FwdTileConfig
    features: InputFeatures = InputFeatures()  # forward only


@dataclasses.dataclass(frozen=True)
class BwdSpec(FwdSpec):
    config: BwdTileConfig
    deterministic: bool = False
    varlen: bool = False  # q packed by cu_seqlens_q, k / v by cu_seqlens_k
    # GQA / MQA: a CTA per KV head walks its query heads; dK / dV come out per KV head
    group_heads: bool = False


def _fake_bshd(dtype, heads: int, dim: int, b, s):
    stride = (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8))
    return cute.runtime.make_fake_tensor(
        dtype,
        (b, s, heads, dim),
        stride=(*stride, cute.sym_int64(divisibility=8), 1),
        assumed_align=16,
    )


def _fake_rows(b, heads: int, s):
    """(batch, heads, seq) fp32 per-row statistics (lse, D), compact."""
    return cute.runtime.make_fake_compact_tensor(
        cutlass.Float32, (b, heads, s), stride_order=(2, 1, 0), assumed_align=4
    )


def _kernel_args(spec: FwdSpec) -> tuple:
    """The constructor arguments FlashFwdSm90 and FlashBwdSm90 share, from a spec."""
    return (
        DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v, spec.num_heads // spec.num_heads_kv,
        spec.has_left, spec.has_right, spec.has_softcap, spec.config,
    )  # fmt: skip


def _fake_qkv(spec: FwdSpec, b, sq):
    """Fake q, k, v over symbolic batch / lengths, and the symbolic seqlen_k."""
    dtype, sk = DTYPES[spec.dtype], cute.sym_int()
    q = _fake_bshd(dtype, spec.num_heads, spec.head_dim, b, sq)
    k = _fake_bshd(dtype, spec.num_heads_kv, spec.head_dim, cute.sym_int(), sk)
    v = _fake_bshd(dtype, spec.num_heads_kv, spec.head_dim_v, cute.sym_int(), sk)
    return q, k, v, sk


def _fake_int32_vector():
    return cute.runtime.make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)


def _compile(kernel, *args, options: str, jit_engine: bool):
    """cute.compile with the TVM-FFI entry point. With `jit_engine` False the DSL builds no
    in-process execution engine (about 0.6 s of a D=128 build on the CPU): the result cannot
    be called, only exported (`export_to_c`), which is what the host's disk cache does before
    it loads the exported code itself."""
    extra = {} if jit_engine else {"no_jit_engine": True}
    return cute.compile(kernel, *args, options=("--enable-tvm-ffi " + options).strip(), **extra)


def compile_fwd(spec: FwdSpec, options: str = "", jit_engine: bool = True):
    feats = spec.features
    kernel = FlashFwdSm90(*_kernel_args(spec), feats)
    b, sq = cute.sym_int(), cute.sym_int()
    q, k, v, _ = _fake_qkv(spec, b, sq)
    # split partials are fp32 and stacked along batch (splits * batch rows of the batch mode)
    o_dtype = cutlass.Float32 if feats.partials else DTYPES[spec.dtype]
    bo = cute.sym_int() if feats.partials else b
    o = _fake_bshd(o_dtype, spec.num_heads, spec.head_dim_v, bo, sq)
    lse = _fake_rows(bo, spec.num_heads, sq)
    optional = [
        _fake_int32_vector() if present else None
        for present in (
            feats.cu_seqlens_q, feats.cu_seqlens_k, feats.seqused_q, feats.seqused_k,
            feats.kv_batch_idx,
        )
    ]  # fmt: skip
    page_table = None
    if feats.paged_kv:  # (batch, max_pages), rows possibly padded (any row stride)
        page_table = cute.runtime.make_fake_tensor(
            cutlass.Int32, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1),
            assumed_align=4,
        )  # fmt: skip
    order = _fake_int32_vector() if feats.batch_order else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return _compile(
        kernel, q, k, v, o, lse, cutlass.Float32(1.0), cutlass.Float32(1.0), cutlass.Int32(0),
        cutlass.Int32(0), cutlass.Int32(1), cutlass.Int32(1), *optional, page_table, order,
        stream, options=options, jit_engine=jit_engine,
    )  # fmt: skip


def compile_bwd(spec: BwdSpec, options: str = "", jit_engine: bool = True):
    """TVM-FFI function (q, k, v, dout, lse_log2, dsum, dq_accum, dk, dv, sem,
    softmax_scale_log2, score_premul, softmax_scale, window_left, window_right, max_seqlen_k,
    cu_seqlens_q, cu_seqlens_k, tail_acc, tail_start, tail_parts); lse_log2 and dsum are
    padded to a multiple of tile_m rows, dk / dv are per query head, sem is a zeroed (batch,
    heads, query tiles) int32 tensor (any int32 (x, heads, y) tensor unless deterministic);
    with spec.group_heads dk / dv have the KV heads (the kernel sums over each KV head's query
    heads). spec.varlen: every tensor has a unit batch, the per-row buffers (lse_log2, dsum,
    dq_accum, sem) are padded per sequence (seqlen.padded_row_offset) and the cu_seqlens are
    int32 vectors; else they are None.
    spec.config.tail_split: tail_acc is an fp32 vector (FlashBwdSm90.__call__), sem holds two
    counters per key tile first; spec.config.timeline: tail_acc is the CTAs' event records
    (arch/common/timeline.py); else tail_acc is None and tail_start / tail_parts unread."""
    dtype = DTYPES[spec.dtype]
    kernel = FlashBwdSm90(*_kernel_args(spec), spec.deterministic, spec.varlen, spec.group_heads)
    h, d, dv = spec.num_heads, spec.head_dim, spec.head_dim_v
    b, sq, sq_pad = cute.sym_int(), cute.sym_int(), cute.sym_int()
    q, k, v, sk = _fake_qkv(spec, b, sq)
    do = _fake_bshd(dtype, h, dv, b, sq)
    # packed, or dq_flat (whole tiles, rows of dQ^T's head dims): the accumulator has padded
    # rows (sq_pad), not q's
    padded = spec.varlen or spec.config.dq_flat
    dq_d = spec.config.dq_flat_tile(d).acc_dim if spec.config.dq_flat else d
    dq_acc = _fake_bshd(cutlass.Float32, h, dq_d, b, sq_pad if padded else sq)
    h_dkv = spec.num_heads_kv if spec.group_heads else h
    dk = _fake_bshd(dtype, h_dkv, d, b, sk)
    dvt = _fake_bshd(dtype, h_dkv, dv, b, sk)
    lse, dsum = _fake_rows(b, h, sq_pad), _fake_rows(b, h, sq_pad)
    sem = cute.runtime.make_fake_compact_tensor(
        cutlass.Int32, (cute.sym_int(), h, cute.sym_int()), stride_order=(2, 1, 0), assumed_align=4
    )
    cu = [_fake_int32_vector(), _fake_int32_vector()] if spec.varlen else [None, None]
    tail_acc = None
    if spec.config.tail_split or spec.config.timeline:
        tail_acc = cute.runtime.make_fake_compact_tensor(
            cutlass.Float32, (cute.sym_int(),), assumed_align=16
        )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return _compile(
        kernel, q, k, v, do, lse, dsum, dq_acc, dk, dvt, sem,
        cutlass.Float32(1.0), cutlass.Float32(1.0), cutlass.Float32(1.0),
        cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(1), *cu, tail_acc, cutlass.Int32(0),
        cutlass.Int32(1), stream, options=options, jit_engine=jit_engine,
    )  # fmt: skip


def compile_bwd_preprocess(
    dtype_name: str,
    head_dim: int,
    head_dim_v: int,
    options: str = "",
    jit_engine: bool = True,
    varlen_tile_m: int = 0,
    dq_flat_dim: int = 0,
    dlse: bool = False,
    persistent: bool = False,
    front_pad: bool = False,
):
    """TVM-FFI function (out, dout, lse, dlse, lse_log2, dsum, dq_accum, cu_seqlens_q,
    max_seqlen_q, ready, num_ctas); see BwdPreprocess (varlen_tile_m > 0: packed,
    cu_seqlens_q an int32 vector; else None; dq_flat_dim > 0: register-order dQ tiles, the
    accumulator's rows that wide and padded like lse_log2's; dlse: the lse gradient, laid out
    like lse, else None; persistent: ready is the main kernel's (batch, heads, x) int32 sem
    and num_ctas the grid, else None and unused; front_pad: the padded rows' padding first,
    BwdTileConfig.end_aligned)."""
    dtype = DTYPES[dtype_name]
    b, sq, sq_pad, h = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    o = _fake_bshd(dtype, h, head_dim_v, b, sq)
    do = _fake_bshd(dtype, h, head_dim_v, b, sq)
    padded = varlen_tile_m or dq_flat_dim
    dq_acc = _fake_bshd(cutlass.Float32, h, dq_flat_dim or head_dim, b, sq_pad if padded else sq)
    cu = _fake_int32_vector() if varlen_tile_m else None
    ready = None
    if persistent:
        ready = cute.runtime.make_fake_compact_tensor(
            cutlass.Int32, (b, h, cute.sym_int()), stride_order=(2, 1, 0), assumed_align=4
        )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return _compile(
        BwdPreprocess(
            dtype, head_dim, head_dim_v, varlen_tile_m, dq_flat_dim, dlse, persistent, front_pad
        ),
        o, do, _fake_rows(b, h, sq), _fake_rows(b, h, sq) if dlse else None,
        _fake_rows(b, h, sq_pad), _fake_rows(b, h, sq_pad), dq_acc, cu, cutlass.Int32(1), ready,
        cutlass.Int32(1), stream, options=options, jit_engine=jit_engine,
    )  # fmt: skip


def compile_bwd_postprocess(
    dtype_name: str,
    head_dim: int,
    options: str = "",
    jit_engine: bool = True,
    varlen_tile_m: int = 0,
    dq_flat: tuple[int, int, int] = (),
    wait_done: bool = False,
    front_pad: bool = False,
):
    """TVM-FFI function (dq_accum, dq, softmax_scale, cu_seqlens_q, max_seqlen_q, done,
    done_target); see BwdPostprocess (varlen_tile_m as in compile_bwd_preprocess; dq_flat:
    the main kernel's DqFlatTile fields, whose accumulator rows are padded to whole tiles;
    wait_done: done is the main kernel's (batch, heads, x) int32 sem, else None; front_pad:
    the flat tiles' padding rows first, BwdTileConfig.end_aligned)."""
    dtype = DTYPES[dtype_name]
    b, sq, sq_pad, h = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    flat = DqFlatTile(*dq_flat) if dq_flat else None
    padded = varlen_tile_m or flat is not None
    acc_dim = head_dim if flat is None else flat.acc_dim
    dq_acc = _fake_bshd(cutlass.Float32, h, acc_dim, b, sq_pad if padded else sq)
    dq = _fake_bshd(dtype, h, head_dim, b, sq)
    cu = _fake_int32_vector() if varlen_tile_m else None
    done = None
    if wait_done:
        done = cute.runtime.make_fake_compact_tensor(
            cutlass.Int32, (b, h, cute.sym_int()), stride_order=(2, 1, 0), assumed_align=4
        )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return _compile(
        BwdPostprocess(dtype, head_dim, varlen_tile_m, flat, wait_done, front_pad), dq_acc, dq,
        cutlass.Float32(1.0), cu, cutlass.Int32(1), done, cutlass.Int32(1), stream,
        options=options, jit_engine=jit_engine,
    )  # fmt: skip


def compile_split_combine(
    dtype_name: str, head_dim_v: int, options: str = "", jit_engine: bool = True, **knobs
):
    """TVM-FFI function (o_part, lse_part, out, lse); see SplitCombine (knobs: its
    split_unroll / use_pdl, defaults as the library runs it). All four compact."""
    b, s, h, splits = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    f32 = cutlass.Float32

    def compact(dtype, shape, align=16):
        order = tuple(range(len(shape) - 1, -1, -1))  # row-major
        return cute.runtime.make_fake_compact_tensor(
            dtype, shape, stride_order=order, assumed_align=align
        )

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = SplitCombine(DTYPES[dtype_name], head_dim_v, **knobs)
    return _compile(
        kernel, compact(f32, (splits, b, s, h, head_dim_v)),
        compact(f32, (splits, b, h, s), 4), compact(DTYPES[dtype_name], (b, s, h, head_dim_v)),
        compact(f32, (b, h, s), 4), stream, options=options, jit_engine=jit_engine,
    )  # fmt: skip


def compile_index_check(options: str = "", jit_engine: bool = True, **present):
    """TVM-FFI function (flags, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
    cache_batch_idx, page_table, total_q, total_k, capacity, max_q, max_k, batch_cache,
    page_size, num_pages); see IndexCheck, whose keyword flags `present` passes on (which
    index tensors exist; absent ones are None at the call)."""
    b, b1 = cute.sym_int(), cute.sym_int()

    def vector(n):
        return cute.runtime.make_fake_compact_tensor(cutlass.Int32, (n,), assumed_align=4)

    kernel = IndexCheck(**present)
    table = None
    if kernel.paged:  # (batch, max_pages), rows possibly padded (any row stride)
        table = cute.runtime.make_fake_tensor(
            cutlass.Int32, (b, cute.sym_int()), stride=(cute.sym_int64(), 1), assumed_align=4
        )
    tensors = [
        vector(b1) if kernel.cu_seqlens_q else None,
        vector(b1) if kernel.cu_seqlens_k else None,
        vector(b) if kernel.seqused_q else None,
        vector(b) if kernel.seqused_k else None,
        vector(b) if kernel.batch_idx else None,
        table,
    ]
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    scalars = [cutlass.Int32(0)] * 8
    return _compile(
        kernel, vector(b), *tensors, *scalars, stream, options=options, jit_engine=jit_engine,
    )  # fmt: skip
