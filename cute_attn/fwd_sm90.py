"""Host side of the SM90 forward kernel: compile key, cached build, launch.

The kernel itself (torch-free) is cute_attn.arch.sm90.flash_fwd; this module turns an
AttnProblem plus torch tensors into one launch. The compiled object is a TVM-FFI function
that takes torch tensors directly and launches on torch's current stream (no host sync), so
the per-call host cost is validation + a dict lookup + the FFI call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys

import torch

from .arch.sm90.tile_config import SUPPORTED_HEAD_DIMS, FwdTileConfig, fwd_tile_config
from .cache import KernelKey, compiled_cache
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


def static_features(p: AttnProblem) -> tuple:
    """(dtype, d, dv, h, hkv, has_left, has_right, has_softcap, causal, local): the Sm90Key
    fields after arch, then what the tuning tables also read."""
    return (
        p.dtype, p.head_dim, p.head_dim_v, p.num_heads, p.num_heads_kv, p.window_left >= 0,
        p.window_right >= 0, p.softcap > 0.0, p.causal, p.is_local,
    )  # fmt: skip


def fwd_key(p: AttnProblem, arch: str = ARCH) -> FwdKey:
    return _fwd_key(arch, *static_features(p))


@functools.lru_cache(maxsize=1024)
def _fwd_key(arch, dtype, d, dv, h, hkv, has_left, has_right, has_softcap, causal, local):
    # memoized: the tuning-table lookup and key construction stay off the per-call path
    cfg = fwd_tile_config(d, dv, causal, local)
    tile = dataclasses.astuple(cfg)
    return FwdKey(arch, dtype, d, dv, h, hkv, has_left, has_right, has_softcap, tile)


def _ensure_dsl_arch(arch: str) -> None:
    # The DSL snapshots CUTE_DSL_ARCH at import; without a GPU it would default to sm_100a.
    # This must happen before the disk cache's loader imports cutlass, hence at module import.
    if "cutlass" not in sys.modules:
        os.environ.setdefault("CUTE_DSL_ARCH", arch)


_ensure_dsl_arch(ARCH)


@compiled_cache("sm90_fwd")
def build_fwd(key: FwdKey):
    from .arch.sm90.compile import FwdSpec, compile_fwd  # imports cutlass: only when building

    fields = {f.name for f in dataclasses.fields(FwdSpec)} - {"config"}
    spec = FwdSpec(**{name: getattr(key, name) for name in fields}, config=FwdTileConfig(*key.tile))
    options = ""
    if os.environ.get("CUTE_ATTN_KEEP_ARTIFACTS") == "1":
        # the DSL writes the kept files next to the working directory unless told otherwise
        options = f"--keep-ptx --keep-cubin --dump-dir={_dump_dir()}"
    return compile_fwd(spec, options)


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
    if p.varlen or p.paged:
        return "varlen/paged inputs are not served by the SM90 kernel yet"
    if p.kvcache:
        return "KV-cache calls (flash_attn_with_kvcache) are not served by the SM90 kernel yet"
    if p.num_splits > 1:
        return "num_splits > 1 (split-KV) is not implemented on SM90 yet"
    for name, t in tensors:
        if t.data_ptr() % 16:
            return f"{name} data pointer is not 16-byte aligned (TMA requirement)"
        if any(s % 8 for s in t.stride()[:-1]):
            return f"{name} strides {tuple(t.stride())} are not multiples of 8 elements (TMA)"
    return None


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


def run_fwd(q, k, v, p: AttnProblem) -> tuple[torch.Tensor, torch.Tensor]:
    b, sq, h, _ = q.shape
    out = torch.empty((b, sq, h, p.head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    if b == 0 or sq == 0:
        return out, lse
    if p.seqlen_k == 0:  # no key at all: every row is empty (and TMA cannot map 0-size dims)
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    fn = build_fwd(fwd_key(p))
    scale_log2, premul = softmax_scales(p.softmax_scale, p.softcap)
    args = (q, k, v, out, lse, scale_log2, premul, max(p.window_left, 0), max(p.window_right, 0))
    if q.device.index == torch.cuda.current_device():
        fn(*args)  # launches on torch's current stream of the current device
    else:
        with torch.cuda.device(q.device):  # the launch (and its stream) must be q's device
            fn(*args)
    return out, lse
