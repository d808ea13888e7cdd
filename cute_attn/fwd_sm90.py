"""Host side of the SM90 forward kernel: compile key, cached build, launch.

The kernel itself (torch-free) is cute_attn.arch.sm90.flash_fwd; this module turns an
AttnProblem plus torch tensors into one launch. The compiled object is a TVM-FFI function
that takes torch tensors directly and launches on torch's current stream (no host sync), so
the per-call host cost is validation + a dict lookup + the FFI call.

Entry points: `run_fwd` (dense), `run_fwd_varlen` (packed by cu_seqlens), `run_fwd_kvcache`
(a KV cache with per-row lengths, after the host appended the new keys). All three can split
the key range over CTAs (split-KV: fp32 partials, then the combine kernel; two splits merge
inside a thread-block cluster instead, `tile_config.fwd_split_cluster`); decode-shaped calls
(one query row, GQA) pack the query heads of a KV head into the rows of one tile (a host
view); other GQA calls of up to 32 query rows pack them inside the kernel (`_pack_gqa_rows`,
tile_config.fwd_pack_gqa), on the decode view's tiles (`_plan`'s `wide`). Paged k / v
(varlen and KV-cache entries) are read page by page by TMA when a key tile fits a page
(`paged_tile_n`: page sizes with a multiple-of-16 divisor, e.g. 16, 48, 64, 128, 256); other
page sizes (1-15, 200, ...) are first gathered into a dense copy by torch (`paged_route`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys

import torch

# Imported with the module, not at the first disk hit: a compiled kernel is a tvm_ffi.Function,
# and this import (~60 ms on the H200 host: it loads cuda.bindings and ml_dtypes) would be
# most of a fresh process's first call.
import tvm_ffi  # noqa: F401

from .arch.common.features import InputFeatures
from .arch.sm90.tile_config import (
    SUPPORTED_HEAD_DIMS,
    FwdTileConfig,
    fills_tall_tiles,
    fills_two_ctas_per_sm,
    fwd_num_splits,
    fwd_pack_gqa,
    fwd_pack_gqa_wide,
    fwd_persistent,
    fwd_ragged_cache,
    fwd_split_cluster,
    fwd_tile_config,
    packed_tile_rows,
    paged_tile_n,
)
from .cache import KernelKey, compiled_cache, export_only
from .problem import AttnProblem

ARCH = "sm_90a"


@dataclasses.dataclass(frozen=True)
class Sm90Key(KernelKey):
    """The static problem features every SM90 attention kernel specializes on. Lengths and
    window values are runtime; which window bounds exist is not."""

    arch: str
    dtype: str
    head_dim: int
    head_dim_v: int
    num_heads: int
    num_heads_kv: int
    has_left: bool
    has_right: bool
    has_softcap: bool


@dataclasses.dataclass(frozen=True)
class FwdKey(Sm90Key):
    """Everything that changes the generated forward code."""

    tile: tuple  # dataclasses.astuple(FwdTileConfig)
    features: tuple = dataclasses.astuple(InputFeatures())  # which optional inputs exist


def static_features(p: AttnProblem) -> tuple:
    """(dtype, d, dv, h, hkv, has_left, has_right, has_softcap, causal, local): the Sm90Key
    fields after arch, then what the tuning tables also read."""
    return (
        p.dtype, p.head_dim, p.head_dim_v, p.num_heads, p.num_heads_kv, p.window_left >= 0,
        p.window_right >= 0, p.softcap > 0.0, p.causal, p.is_local,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CombineKey(KernelKey):
    """The split-KV combine kernel: output dtype and head_dim_v (lengths, heads and the split
    count are runtime)."""

    arch: str
    dtype: str
    head_dim_v: int


@dataclasses.dataclass(frozen=True)
class IndexCheckKey(KernelKey):
    """The index-value check (arch/common/index_check.py): which index tensors exist."""

    arch: str
    cu_seqlens_q: bool
    cu_seqlens_k: bool
    seqused_q: bool
    seqused_k: bool
    batch_idx: bool
    paged: bool


_DENSE = InputFeatures()
# The inputs whose packed-decode calls may take the two-CTAs-per-SM tile (`wide`): every input
# set a decode call packs. Dense: docs/perf/tune_decode_*_h200.json (B=64 8k 4.47-4.49 ->
# 4.56 TB/s, B=128 2k 4.41 -> 4.49). KV cache: test_kvcache_decode_wide_grid checks the
# dense, cache_batch_idx and paged (16, 64) variants against the reference; B=64 8k paged
# (bench_decode_graph_paged_{anywide,base}_*_h200.json, CUDA graphs, alternated runs, ms
# wide / the default tile): page 64 0.485-0.490 / 0.487-0.489, page 128 0.486-0.489 /
# 0.494-0.497, page 256 0.486-0.488 / 0.494-0.495.
_WIDE_INPUTS = frozenset({
    _DENSE,
    InputFeatures(seqused_k=True),
    InputFeatures(seqused_k=True, kv_batch_idx=True),
    InputFeatures(seqused_k=True, paged_kv=True),
    # the same caches with V through the ragged view (how V loads, not the grid)
    InputFeatures(seqused_k=True, ragged_cache=True),
    InputFeatures(seqused_k=True, kv_batch_idx=True, ragged_cache=True),
})  # fmt: skip
# In-kernel packed GQA rows (tile_config.fwd_pack_gqa_wide) may take it from these, packed
# sequences included (a serving engine's decode batch through the varlen entry: packed keys,
# packed keys used to seqused_k, or pages; the last two timed in the forty-seventh session,
# 2.2-7.0% faster on it: tile_config.fwd_pack_gqa_wide).
_WIDE_PACKED_INPUTS = _WIDE_INPUTS | {
    InputFeatures(cu_seqlens_q=True, cu_seqlens_k=True),
    InputFeatures(cu_seqlens_q=True, cu_seqlens_k=True, seqused_k=True),
    InputFeatures(cu_seqlens_q=True, seqused_k=True, paged_kv=True),
}  # fmt: skip


def _cache_features(v_cache, *, batch_idx: bool, paged: bool) -> InputFeatures:
    """The inputs of a KV-cache call: cache lengths, maybe a batch-row map or pages, and
    `ragged_cache` where the rule takes it (tile_config.fwd_ragged_cache) for a dense cache
    whose batch rows lie back to back (row b's keys from flat row b x capacity)."""
    rows, row_stride = v_cache.shape[1], v_cache.stride(1)
    back_to_back = v_cache.shape[0] == 1 or v_cache.stride(0) == rows * row_stride
    ragged = not paged and back_to_back and fwd_ragged_cache()
    return InputFeatures(
        seqused_k=True, kv_batch_idx=batch_idx, paged_kv=paged, ragged_cache=ragged
    )


def fwd_key(
    p: AttnProblem,
    arch: str = ARCH,
    features: InputFeatures = _DENSE,
    decode: bool = False,
    tall: bool = False,
    wide: bool = False,
    persistent_sms: int = 0,
) -> FwdKey:
    """`decode`: p is the packed decode view (query heads of a KV head as rows). With
    features.paged_kv the page size picks the key tile (tile_config.paged_tile_config).
    `tall`: the query length bucket of tile_config.fills_tall_tiles; `wide`: the decode grid
    bucket of tile_config.fills_two_ctas_per_sm; `persistent_sms`: the SM count when the
    problem takes a persistent grid (tile_config.fwd_persistent), else 0."""
    page_size = p.page_size if features.paged_kv else 0
    return _fwd_key(
        arch, *static_features(p), features, decode, page_size, tall, wide, persistent_sms
    )


@functools.lru_cache(maxsize=1024)
def _fwd_key(arch, dtype, d, dv, h, hkv, has_left, has_right, has_softcap, causal, local, feats,
             decode, page_size, tall, wide=False, persistent_sms=0):  # fmt: skip
    # memoized: the tuning-table lookup and key construction stay off the per-call path
    cfg = fwd_tile_config(d, dv, causal, local, decode, page_size, tall, wide, persistent_sms)
    tile = dataclasses.astuple(cfg)
    return FwdKey(
        arch, dtype, d, dv, h, hkv, has_left, has_right, has_softcap, tile,
        dataclasses.astuple(feats),
    )  # fmt: skip


def _ensure_dsl_arch(arch: str) -> None:
    # The DSL snapshots CUTE_DSL_ARCH at import; without a GPU it would default to sm_100a.
    # This must happen before the disk cache's loader imports cutlass, hence at module import.
    if "cutlass" not in sys.modules:
        os.environ.setdefault("CUTE_DSL_ARCH", arch)


_ensure_dsl_arch(ARCH)


@compiled_cache("sm90_fwd", exportable=True)
def build_fwd(key: FwdKey):
    from .arch.sm90.compile import FwdSpec, compile_fwd  # imports cutlass: only when building

    fields = {f.name for f in dataclasses.fields(FwdSpec)} - {"config", "features"}
    spec = FwdSpec(
        **{name: getattr(key, name) for name in fields},
        config=FwdTileConfig(*key.tile),
        features=InputFeatures(*key.features),
    )
    return compile_fwd(spec, _artifact_options(), jit_engine=not export_only())


def _artifact_options() -> str:
    """Compile options that keep PTX and cubin (CUTE_ATTN_KEEP_ARTIFACTS=1, what cute_attn.aot
    sets to read registers, spills and SASS), else none."""
    if os.environ.get("CUTE_ATTN_KEEP_ARTIFACTS") == "1":
        # the DSL writes the kept files next to the working directory unless told otherwise
        return f"--keep-ptx --keep-cubin --dump-dir={_dump_dir()}"
    return ""


@compiled_cache("sm90_combine", exportable=True)
def build_combine(key: CombineKey):
    from .arch.sm90.compile import compile_split_combine

    return compile_split_combine(
        key.dtype, key.head_dim_v, _artifact_options(), jit_engine=not export_only()
    )


@compiled_cache("sm90_index_check", exportable=True)
def build_index_check(key: IndexCheckKey):
    from .arch.sm90.compile import compile_index_check

    present = {f.name: getattr(key, f.name) for f in dataclasses.fields(key) if f.name != "arch"}
    return compile_index_check(_artifact_options(), jit_engine=not export_only(), **present)


@functools.lru_cache(maxsize=64)
def _index_check_fn(present: tuple):
    # memoized: the key construction and cache lookup stay off the per-call path
    return build_index_check(IndexCheckKey(ARCH, *present))


def index_flags(
    batch: int, tensors: tuple, total_q: int, total_k: int, capacity: int, max_q: int,
    max_k: int, batch_cache: int, page_size: int, num_pages: int,
) -> torch.Tensor:  # fmt: skip
    """One launch flagging the bad index values of a varlen or KV-cache call: (batch,) int32
    on the index tensors' device, 0 where row b's values are valid (IndexCheck's bits).
    tensors: (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, cache_batch_idx, page_table),
    int32 tensors or None; the scalars are IndexCheck's bounds."""
    like = next(t for t in tensors if t is not None)
    # the check reads compact vectors and unit-stride table rows (no-ops for the usual inputs)
    vectors = [None if t is None else t.contiguous() for t in tensors[:5]]
    table = tensors[5]
    if table is not None and table.stride(-1) != 1:
        table = table.clone(memory_format=torch.contiguous_format)
    flags = torch.empty((batch,), dtype=torch.int32, device=like.device)
    if batch == 0:
        return flags  # nothing to check (and no empty grid to launch)
    fn = _index_check_fn(tuple(t is not None for t in tensors))
    with contextlib.nullcontext() if like.device.index == torch.cuda.current_device() else (
        torch.cuda.device(like.device)
    ):  # fmt: skip
        fn(
            flags, *vectors, table, total_q, total_k, capacity, max_q, max_k, batch_cache,
            page_size, num_pages,
        )  # fmt: skip
    return flags


@functools.cache
def _dump_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="cute_attn_artifacts_")


def unsupported_reason(p: AttnProblem, tensors, head_dims=SUPPORTED_HEAD_DIMS) -> str | None:
    """Why an SM90 kernel cannot serve this problem, or None. Cheap: attribute reads only.
    The backward passes its own head-dim table."""
    if p.dtype not in ("bfloat16", "float16"):
        return f"dtype {p.dtype} (kernels take float16/bfloat16)"
    if (p.head_dim, p.head_dim_v) not in head_dims:
        return f"head dims ({p.head_dim}, {p.head_dim_v}) not in {head_dims}"
    if (p.varlen or p.kvcache) and torch.is_grad_enabled():
        if any(t.requires_grad for _, t in tensors):
            reason = varlen_grad_reason(p)
            if reason is not None:
                return reason
    for name, t in tensors:
        if t.data_ptr() % 16:
            return f"{name} data pointer is not 16-byte aligned (TMA requirement)"
        if any(s % 8 for s in t.stride()[:-1]):
            return f"{name} strides {tuple(t.stride())} are not multiples of 8 elements (TMA)"
    return None


def varlen_grad_reason(p: AttnProblem) -> str | None:
    """Why the SM90 varlen backward cannot serve gradients of this packed / KV-cache problem,
    or None: it takes q and k / v packed by cu_seqlens_q / cu_seqlens_k, nothing else."""
    if p.paged or p.kvcache:
        return "gradients through paged / KV-cache calls (the varlen backward takes packed k / v)"
    if p.has_seqused_q or p.has_seqused_k:
        return "gradients through seqused_q / seqused_k (the varlen backward takes cu_seqlens only)"
    return None


@functools.lru_cache(maxsize=1024)
def paged_route(p: AttnProblem) -> str | None:
    """How the kernel reads a paged cache: "tma" (page by page) when a key tile of the tuning
    table's variant fits the page size, else "gather" (torch copies the pages into a dense
    cache first, a full extra read and write of it); None when p is not paged. Memoized:
    dispatch and the runner both ask, on every call."""
    if not p.paged:
        return None
    pack = p.kvcache and _pack_decode(p, p.seqlen_q)  # as run_fwd_kvcache decides it
    kp = _kernel_problem(p, pack)
    # calls the decode view does not pack may pack their rows in the kernel (the decode tile
    # too); p.seqlen_q is a varlen call's longest sequence, as _run's max_seqlen_q
    decode = pack or _pack_gqa_rows(p, p.seqlen_q)
    # (the `tall` bucket only changes D=64's row count, never tile_n, and `wide`'s 64 keys
    # find a TMA tile for every page size the default's 128 do: no effect on the route)
    cfg = fwd_tile_config(p.head_dim, p.head_dim_v, kp.causal, kp.is_local, decode)
    return "tma" if paged_tile_n(cfg.tile_n, p.page_size) is not None else "gather"


def route_note(p: AttnProblem) -> str:
    """What dispatch records beyond "SM90 forward kernel" (honest about what ran): how a
    GQA call's query heads share tiles, and a paged cache's gathered route."""
    note = ""
    group = p.qhead_per_kvhead
    if group > 1 and not p.varlen and _pack_decode(p, p.seqlen_q):
        note = f"; the {group} query heads of each KV head share one tile (GQA decode view)"
    elif group > 1 and _pack_gqa_rows(p, p.seqlen_q):
        note = f"; the {group} query heads of each KV head packed into the tile's rows (pack_gqa)"
    if paged_route(p) == "gather":
        note += (
            f"; page size {p.page_size} fits no TMA key tile, so torch gathers the pages into "
            f"a dense copy first"
        )
    return note


@functools.lru_cache(maxsize=256)
def softmax_scales(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """(softmax_scale_log2, score_premul): the kernel's runtime scalars.

    Without softcap the kernel computes exp2(s * scale * log2 e - m'). With softcap it first
    maps s -> tanh(s * scale / softcap) (score_premul) and then uses softcap * log2 e as the
    exp2 scale, which is softcap * tanh(s * scale / softcap) in natural units.
    """
    log2e = math.log2(math.e)
    if softcap > 0.0:
        return softcap * log2e, softmax_scale / softcap
    return softmax_scale * log2e, 1.0


def kernel_window(p: AttnProblem, bound: int) -> tuple[int, int]:
    """(left, right) as the kernels' Int32 values: 0 for an absent side (the kernel's
    has_left / has_right say which exist) and each side clamped to `bound`, the query plus key
    length (the longest of packed sequences). A side that wide cuts no key already (left >=
    Sk - 1, right >= Sq - 1 suffice), so the clamp is exact, and the kernels' row + offset -
    left arithmetic stays inside Int32 for any window the caller passes (window sizes are
    unbounded Python ints)."""
    return min(max(p.window_left, 0), bound), min(max(p.window_right, 0), bound)


def _num_sms(index: int | None) -> int:
    return _sm_count(index if index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=4096)
def _num_splits(
    num_splits, d, dv, causal, local, decode, page_size, batch, rows, heads, seqlen_k, num_sms,
    tall=False, group=1,
):  # fmt: skip
    """The user's num_splits, or (0) the tuning table's choice for this grid; `group`: the
    query heads packed a position inside the kernel (a padded group's tiles hold fewer rows,
    tile_config.packed_tile_rows)."""
    if num_splits > 0:
        return num_splits
    cfg = fwd_tile_config(d, dv, causal, local, decode, page_size, tall)
    tile_rows = (packed_tile_rows(cfg.tile_m, group) if group > 1 else None) or cfg.tile_m
    ctas = batch * heads * -(-rows // tile_rows)
    return fwd_num_splits(ctas, -(-seqlen_k // cfg.tile_n), num_sms)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything about one launch that depends only on the problem, not on the tensors:
    built once per distinct call signature (lru-cached), so the per-call host work is the
    allocations and the launches."""

    fn: object  # the compiled forward
    combine: object | None  # the compiled combine, when the splits leave fp32 partials
    scalars: tuple  # (scale_log2, premul, window_left, window_right, rows, splits)
    splits: int
    group: int  # query heads packed per KV head by the host view (1: not packed that way)

    @property
    def partials(self) -> bool:
        """The kernel writes fp32 partials stacked by split, which the combine merges (splits
        merged inside a cluster write out / lse themselves, and build no combine)."""
        return self.splits > 1 and self.combine is not None


@functools.lru_cache(maxsize=1024)
def _plan(
    p: AttnProblem, features: InputFeatures, batch: int, max_seqlen_q: int, seqlen_k: int,
    pack: bool, device_index: int | None,
) -> _Plan:  # fmt: skip
    group = p.qhead_per_kvhead if pack else 1
    kp = _kernel_problem(p, pack)
    rows, heads = (group, p.num_heads_kv) if pack else (max_seqlen_q, p.num_heads)
    # the kernel's packed rows (G x Sq a KV head) take the packed decode view's tile too
    decode = pack
    if not pack and _pack_gqa_rows(p, max_seqlen_q):
        features = dataclasses.replace(features, pack_gqa=True)
        rows, heads, decode = p.qhead_per_kvhead * max_seqlen_q, p.num_heads_kv, True
    page_size = p.page_size if features.paged_kv else 0
    tall = tall_rows(kp, features, decode, max_seqlen_q)
    num_sms = _num_sms(device_index)
    in_kernel_group = p.qhead_per_kvhead if features.pack_gqa else 1
    splits = _num_splits(
        p.num_splits, p.head_dim, p.head_dim_v, kp.causal, kp.is_local, decode, page_size,
        batch, rows, heads, seqlen_k, num_sms, tall, in_kernel_group,
    )  # fmt: skip
    # a split decode grid, or an unsplit one that fills two CTAs per SM, takes that tile
    # (tile_m 64 either way, so the split count above stands); in-kernel packed rows where
    # tile_config.fwd_pack_gqa_wide says so, a padded group's tiles holding fewer rows
    tile_rows = packed_tile_rows(64, in_kernel_group) if in_kernel_group > 1 else 64
    ctas = batch * heads * -(-rows // tile_rows)
    wide = (
        features in _WIDE_INPUTS if pack else features.pack_gqa and fwd_pack_gqa_wide()
        and dataclasses.replace(features, pack_gqa=False) in _WIDE_PACKED_INPUTS
    ) and (splits > 1 or fills_two_ctas_per_sm(ctas, num_sms))  # fmt: skip
    feats = features
    if splits > 1:
        feats = dataclasses.replace(
            features, split_kv=True, split_cluster=fwd_split_cluster(splits, p.head_dim_v)
        )
    # dense and unsplit in fwd_persistent's bucket (its window is the kernel's: the packed
    # decode view has none); the table itself keeps decode on one CTA per tile
    persistent = feats == _DENSE and fwd_persistent(
        p.head_dim, seqlen_k, kp.window_left, kp.window_right
    )
    scale_log2, premul = softmax_scales(p.softmax_scale, p.softcap)
    combine = None
    if feats.partials:
        combine = build_combine(CombineKey(ARCH, p.dtype, p.head_dim_v))
    key = fwd_key(kp, features=feats, decode=decode, tall=tall, wide=wide,
                  persistent_sms=num_sms if persistent else 0)  # fmt: skip
    return _Plan(
        fn=build_fwd(key),
        combine=combine,
        scalars=(scale_log2, premul, *kernel_window(kp, max_seqlen_q + seqlen_k), rows, splits),
        splits=splits,
        group=group,
    )


def tall_rows(kp: AttnProblem, features: InputFeatures, pack: bool, max_seqlen_q: int) -> bool:
    """Whether a launch of kernel problem kp takes the tuning table's long-query variant
    (`tall`): dense query rows of a length tile_config.fills_tall_tiles accepts. Packed
    sequences (cu_seqlens_q) pad each sequence's last tile, so they keep the default row
    count, as packed decode does."""
    if pack or features.cu_seqlens_q:
        return False
    return fills_tall_tiles(max_seqlen_q, kp.window_left, kp.window_right)


def _kernel_problem(p: AttnProblem, pack: bool) -> AttnProblem:
    """The problem the kernel sees: p, or with `pack` its packed decode view, where the one
    query row sees every key (no right bound) and the G query heads of a KV head are G rows."""
    if not pack:
        return p
    return dataclasses.replace(
        p, seqlen_q=p.qhead_per_kvhead, num_heads=p.num_heads_kv, causal=False, window_right=-1
    )


def _pack_rows(t: torch.Tensor, group: int) -> torch.Tensor:
    """(B, 1, H, X) -> (B, group, H / group, X): the query heads of one KV head become rows."""
    b, _, h, x = t.shape
    s0, _, s2, s3 = t.stride()
    return t.as_strided((b, group, h // group, x), (s0, s2, group * s2, s3))


def _pack_lse(t: torch.Tensor, group: int) -> torch.Tensor:
    """(B, H, 1) -> (B, H / group, group), compact like the kernel's lse."""
    b, h, _ = t.shape
    return t.as_strided((b, h // group, group), (t.stride(0), group * t.stride(1), t.stride(1)))


def _run(
    q, k, v, p: AttnProblem, out, lse, *, features: InputFeatures, max_seqlen_q: int,
    batch: int, seqlen_k: int, pack: bool = False, cu_q=None, cu_k=None, seqused_q=None,
    seqused_k=None, kv_batch_idx=None, page_table=None, batch_order=None,
) -> None:  # fmt: skip
    """Launch into out (B, Sq, H, Dv) / lse (B, H, Sq) (B = 1 when packed by cu_seqlens_q):
    directly (splits merged in a cluster included), or through fp32 split partials and the
    combine. `pack` (decode: Sq = 1, GQA,
    no left window) views the query heads of each KV head as the rows of one tile, so each
    K/V tile is read once for all of them. With seqused_q the rows past each sequence's used
    rows are never computed: they get out 0 / lse -inf from a fill here (of out / lse, or of
    the split partials, which the combine then turns into 0 / -inf)."""
    plan = _plan(p, features, batch, max_seqlen_q, seqlen_k, pack, q.device.index)
    splits, group = plan.splits, plan.group
    o_k, l_k = out, lse
    if plan.partials:  # fp32, stacked along batch: split s of batch row b is s * B + b
        o_k = torch.empty((splits * out.shape[0], *out.shape[1:]), dtype=torch.float32,
                          device=q.device)  # fmt: skip
        l_k = torch.empty((splits * lse.shape[0], *lse.shape[1:]), dtype=torch.float32,
                          device=q.device)  # fmt: skip
    if seqused_q is not None:
        _empty_rows(o_k, l_k)
    qk, ok, lk = q, o_k, l_k
    if group > 1:
        qk, ok, lk = _pack_rows(q, group), _pack_rows(o_k, group), _pack_lse(l_k, group)
    on_device = q.device.index == torch.cuda.current_device()
    # the launches (and their stream: torch's current one) must be on q's device
    with contextlib.nullcontext() if on_device else torch.cuda.device(q.device):
        plan.fn(
            qk, k, v, ok, lk, *plan.scalars, cu_q, cu_k, seqused_q, seqused_k, kv_batch_idx,
            page_table, batch_order,
        )  # fmt: skip
        if plan.partials:
            plan.combine(o_k.view(splits, *out.shape), l_k.view(splits, *lse.shape), out, lse)


def _pack_gqa_rows(p: AttnProblem, seqlen_q: int) -> bool:
    """Pack the query heads of a KV head into the tile's rows inside the kernel
    (InputFeatures.pack_gqa), for a GQA call the decode view does not pack (more than one
    query row, a left window, or packed sequences; seqlen_q: the longest one's rows): where
    the tuning rule takes it (tile_config.fwd_pack_gqa: up to 32 query rows; pack_gqa=True
    asks for no more than None does), never with pack_gqa=False, nor for a group larger than
    the decode tile's rows that they do not divide (the guard holds under a forced rule
    too). A smaller group that does not divide them pads each tile: floor(tile_m / G)
    positions a tile (FlashFwdSm90.tile_rows)."""
    group = p.qhead_per_kvhead
    if group == 1 or p.pack_gqa is False:
        return False
    if seqlen_q == 1 and p.window_left < 0 and not p.varlen:
        return False  # the decode view's (_pack_decode)
    tile_m = fwd_tile_config(p.head_dim, p.head_dim_v, p.causal, p.is_local, True).tile_m
    return fwd_pack_gqa(seqlen_q, tile_m, group) and packed_tile_rows(tile_m, group) is not None


def _pack_decode(p: AttnProblem, seqlen_q: int) -> bool:
    """Pack the query heads of a KV head into one tile's rows: one query row (decode), GQA,
    no left window (the packed rows all sit at the one position, which a left bound would
    need per row); pack_gqa=False opts out."""
    return (
        seqlen_q == 1 and p.qhead_per_kvhead > 1 and p.window_left < 0 and p.pack_gqa is not False
    )


def _empty_rows(out: torch.Tensor, lse: torch.Tensor) -> None:
    out.zero_()
    lse.fill_(float("-inf"))


def run_fwd(q, k, v, p: AttnProblem) -> tuple[torch.Tensor, torch.Tensor]:
    b, sq, h, _ = q.shape
    out = torch.empty((b, sq, h, p.head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    if b == 0 or sq == 0:
        return out, lse
    if p.seqlen_k == 0:  # no key at all: every row is empty (and TMA cannot map 0-size dims)
        _empty_rows(out, lse)
        return out, lse
    _run(
        q, k, v, p, out, lse, features=_DENSE, max_seqlen_q=sq, batch=b, seqlen_k=p.seqlen_k,
        pack=_pack_decode(p, sq),
    )  # fmt: skip
    return out, lse


def dense_launcher(q, p: AttnProblem):
    """A launcher `(q, k, v) -> (out, lse)` for later dense calls with q's exact signature
    (the dense entry's memo holds it), or None for empty sizes (run_fwd's fills). It runs
    what run_fwd would, with the plan and every argument that depends only on the signature
    bound once."""
    b, sq, _, _ = q.shape
    if b == 0 or sq == 0 or p.seqlen_k == 0:
        return None
    return _bound_launch(q, p, _DENSE, sq, p.seqlen_k, _pack_decode(p, sq))


def kvcache_launcher(q, k_cache, v_cache, p: AttnProblem, *, batch_idx: bool, paged: bool):
    """A launcher `(q, k_cache, v_cache, seqused_k, kv_batch_idx, page_table) -> (out, lse)`
    for later read-only KV-cache calls with this exact signature (the entry's memo holds it),
    or None where run_fwd_kvcache does more than allocate and launch (empty sizes, the
    gathered page route)."""
    b, sq, _, _ = q.shape
    capacity = p.seqlen_k  # S_cache, or max_pages * page_size (validate_kvcache)
    if b == 0 or sq == 0 or k_cache.shape[0] * capacity == 0:
        return None
    if paged and paged_route(p) == "gather":
        return None
    feats = _cache_features(v_cache, batch_idx=batch_idx, paged=paged)
    return _bound_launch(q, p, feats, sq, capacity, _pack_decode(p, sq))


def varlen_launcher(q, k, p: AttnProblem, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                    page_table):  # fmt: skip
    """A launcher `(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table) ->
    (out, lse)` for later varlen calls with this exact signature (the entry's memo holds it),
    or None where run_fwd_varlen does more than allocate and launch (empty sizes, the gathered
    page route) or an index tensor would need a copy (strided: `.contiguous()` per call)."""
    total_q, batch = q.shape[0], cu_seqlens_q.shape[0] - 1
    paged = page_table is not None
    if total_q == 0 or batch == 0 or p.seqlen_q == 0 or k.shape[0] == 0:
        return None
    if paged and (page_table.shape[1] * k.shape[1] == 0 or paged_route(p) == "gather"):
        return None
    for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        if t is not None and not t.is_contiguous():
            return None
    if paged and page_table.stride(-1) != 1:
        return None
    feats = InputFeatures(
        cu_seqlens_q=True, cu_seqlens_k=cu_seqlens_k is not None, seqused_q=seqused_q is not None,
        seqused_k=seqused_k is not None, paged_kv=paged,
    )  # fmt: skip
    # run_fwd_varlen's launch: one batch row of total_q query rows, dense keys as one row too
    inner = _bound_launch(q.unsqueeze(0), p, feats, p.seqlen_q, p.seqlen_k, False, batch=batch)

    def launch(q, k, v, cu_q, cu_k, used_q, used_k, pages):
        if pages is None:
            k, v = k.unsqueeze(0), v.unsqueeze(0)
        out, lse = inner(q.unsqueeze(0), k, v, used_k, None, pages, cu_q, cu_k, used_q)
        return out[0], lse[0]

    return launch


def _bound_launch(q, p: AttnProblem, features: InputFeatures, max_seqlen_q, seqlen_k, pack,
                  batch=None):  # fmt: skip
    """What `_run` does for q's exact signature, with the plan, shapes and packed views
    computed once: per call, the allocations (2, or 4 with split partials), the fill of
    seqused_q's empty rows, the packed views and the launches (one, or two with the combine).
    batch: the problem's (cu_seqlens_q's sequences), where q is the one row of packed ones."""
    b, sq, h, _ = q.shape
    index = q.device.index
    plan = _plan(p, features, b if batch is None else batch, max_seqlen_q, seqlen_k, pack, index)
    fn, combine, scalars = plan.fn, plan.combine, plan.scalars
    splits, group, partials = plan.splits, plan.group, plan.partials
    stacked = splits if partials else 1  # batch rows of the kernel's out / lse per batch row
    dv, f32 = p.head_dim_v, torch.float32
    out_shape, lse_shape = (b, sq, h, dv), (b, h, sq)
    part_o, part_l = (splits * b, sq, h, dv), (splits * b, h, sq)
    stack_o, stack_l = (splits, *out_shape), (splits, *lse_shape)
    if group > 1:
        # _pack_rows / _pack_lse as fixed (size, stride) pairs: q's strides are part of the
        # signature, the outputs are contiguous (B, 1, H, X) / (B, H, 1)
        s0, _, s2, s3 = q.stride()
        q_view = ((b, group, h // group, q.shape[3]), (s0, s2, group * s2, s3))
        o_view = ((b * stacked, group, h // group, dv), (h * dv, dv, group * dv, 1))
        l_view = ((b * stacked, h // group, group), (h, group, 1))
    current = torch.cuda.current_device
    # The outputs as `torch.empty_like` of a tensor of their shape and dtype, which parses no
    # shape or dtype: 3.9 us for both against 5.2 for two `new_empty` on the H200 host
    # (docs/perf/host_overhead_tiny_s33b_h200.json). out's is q itself when Dv = D, lse's a
    # one-element fp32 tensor expanded to (B, H, Sq) (one small block per bound signature);
    # contiguous_format makes both outputs contiguous whatever the prototype's strides.
    empty_like, contiguous = torch.empty_like, torch.contiguous_format
    lse_proto = torch.empty((1, 1, 1), dtype=f32, device=q.device).expand(lse_shape)
    same_shape = tuple(q.shape) == out_shape

    if splits == 1 and group == 1 and features == _DENSE:
        # the tiny-call path: two allocations and one launch, nothing else per call
        tail = (*scalars, None, None, None, None, None, None, None)

        def launch_one(q, k, v):
            # q's dtype and device, contiguous
            if same_shape:
                out = empty_like(q, memory_format=contiguous)
            else:
                out = q.new_empty(out_shape)
            lse = empty_like(lse_proto, memory_format=contiguous)
            if current() == index:
                fn(q, k, v, out, lse, *tail)
            else:  # the launch (and its stream: torch's current one) must be on q's device
                with torch.cuda.device(index):
                    fn(q, k, v, out, lse, *tail)
            return out, lse

        return launch_one

    fill_rows = features.seqused_q

    def launch(q, k, v, seqused_k=None, kv_batch_idx=None, page_table=None, cu_q=None,
               cu_k=None, seqused_q=None):  # fmt: skip
        # q's dtype and device, contiguous
        out = empty_like(q, memory_format=contiguous) if same_shape else q.new_empty(out_shape)
        lse = empty_like(lse_proto, memory_format=contiguous)
        o_k, l_k = out, lse
        if partials:  # fp32, stacked along batch (as in _run)
            o_k, l_k = q.new_empty(part_o, dtype=f32), q.new_empty(part_l, dtype=f32)
        if fill_rows:  # rows past seqused_q are never computed (as in _run)
            _empty_rows(o_k, l_k)
        qk, ok, lk = q, o_k, l_k
        if group > 1:
            qk, ok, lk = q.as_strided(*q_view), o_k.as_strided(*o_view), l_k.as_strided(*l_view)
        tail = (cu_q, cu_k, seqused_q, seqused_k, kv_batch_idx, page_table, None)
        if current() == index:
            fn(qk, k, v, ok, lk, *scalars, *tail)
            if partials:
                combine(o_k.view(stack_o), l_k.view(stack_l), out, lse)
        else:  # the launches (and their stream: torch's current one) must be on q's device
            with torch.cuda.device(index):
                fn(qk, k, v, ok, lk, *scalars, *tail)
                if partials:
                    combine(o_k.view(stack_o), l_k.view(stack_l), out, lse)
        return out, lse

    return launch


def _gather_pages(cache: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """(num_pages, page_size, Hkv, D) pages -> (B, max_pages * page_size, Hkv, D), row b the
    pages page_table[b] in order. Entries past a row's used pages may hold anything: they are
    clamped into range (their rows lie past the row's length, which the kernel never reads)."""
    b, n = page_table.shape
    idx = page_table.clamp(0, cache.shape[0] - 1).reshape(-1).to(torch.int64)
    return cache.index_select(0, idx).view(b, n * cache.shape[1], *cache.shape[2:])


def run_fwd_varlen(
    q, k, v, p: AttnProblem, *, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q: int,
    page_table=None, seqused_q=None, order_batches: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Packed sequences: q (total_q, H, D), cu_seqlens int32, k / v (total_k, Hkv, D[v]), or
    paged (num_pages, page_size, Hkv, D[v]) with page_table (B, max_pages) int32 (then
    cu_seqlens_k, if given, only gives lengths). seqused_q (B,) int32: sequence b uses its
    first seqused_q[b] rows (its Sq); the rest get out 0 / lse -inf. order_batches: launch
    the longest sequences' CTAs first (InputFeatures.batch_order). Off by default: on the
    16-sequence causal prefill it measured 5.08 vs 5.00 ms in launch order
    (docs/perf/varlen_order_h200.json, round-robin in one process).
    Returns out (total_q, H, Dv) and lse (H, total_q)."""
    total_q, h, _ = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    out = torch.empty((1, total_q, h, p.head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((1, h, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0 or batch == 0 or max_seqlen_q == 0:
        return out[0], lse[0]
    paged = page_table is not None
    if k.shape[0] == 0 or (paged and page_table.shape[1] * k.shape[1] == 0):
        _empty_rows(out, lse)  # no key in any sequence (TMA cannot map 0-size dims)
        return out[0], lse[0]
    used_q = seqused_q is not None

    def key_lengths():
        return seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]

    order = None
    if batch > 1 and order_batches:
        # longest sequences first (their CTAs are dispatched first): no sync, small kernels
        order = torch.argsort(key_lengths(), descending=True, stable=True).to(torch.int32)
    feats = InputFeatures(
        cu_seqlens_q=True, cu_seqlens_k=cu_seqlens_k is not None, seqused_q=used_q,
        seqused_k=seqused_k is not None, paged_kv=paged, batch_order=order is not None,
    )  # fmt: skip
    if paged and paged_route(p) == "gather":
        k, v = _gather_pages(k, page_table), _gather_pages(v, page_table)
        if seqused_k is None:
            seqused_k = key_lengths().to(torch.int32)
        feats = InputFeatures(cu_seqlens_q=True, seqused_q=used_q, seqused_k=True,
                              batch_order=order is not None)  # fmt: skip
        cu_seqlens_k, page_table = None, None
    elif not paged:
        k, v = k.unsqueeze(0), v.unsqueeze(0)
    _run(
        q.unsqueeze(0), k, v, p, out, lse, features=feats, max_seqlen_q=max_seqlen_q,
        batch=batch, seqlen_k=p.seqlen_k, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k,
        seqused_q=seqused_q, seqused_k=seqused_k, page_table=page_table, batch_order=order,
    )  # fmt: skip
    return out[0], lse[0]


def run_fwd_kvcache(
    q, k_cache, v_cache, p: AttnProblem, *, seqused_k, kv_batch_idx, page_table=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, Sq, H, D) over the first seqused_k[b] (int32 (B,)) keys of batch row
    b's cache: row kv_batch_idx[b] (or b) of a dense cache (B_cache, S_cache, Hkv, D[v]), or
    the pages page_table[b] of a paged one (num_pages, page_size, Hkv, D[v])."""
    b, sq, h, _ = q.shape
    out = torch.empty((b, sq, h, p.head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    if b == 0 or sq == 0:
        return out, lse
    capacity = k_cache.shape[1] if page_table is None else page_table.shape[1] * k_cache.shape[1]
    if k_cache.shape[0] * capacity == 0:
        _empty_rows(out, lse)
        return out, lse
    feats = _cache_features(v_cache, batch_idx=kv_batch_idx is not None,
                            paged=page_table is not None)  # fmt: skip
    if page_table is not None and paged_route(p) == "gather":
        k_cache, v_cache = _gather_pages(k_cache, page_table), _gather_pages(v_cache, page_table)
        feats, page_table = _cache_features(v_cache, batch_idx=False, paged=False), None
    _run(
        q, k_cache, v_cache, p, out, lse, features=feats, max_seqlen_q=sq, batch=b,
        seqlen_k=capacity, pack=_pack_decode(p, sq), seqused_k=seqused_k,
        kv_batch_idx=kv_batch_idx, page_table=page_table,
    )  # fmt: skip
    return out, lse
