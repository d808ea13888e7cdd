"""Attention benchmark: cute_attn against torch SDPA backends and FlashAttention-4.

What: times every available implementation over a named shape matrix (`--preset`), reports
median / p95 latency, TFLOP/s (or TB/s of K+V read for decode rows), peak memory, first-call
(compile) time, max abs error against a chunked fp32 reference, and the ratio to the best of
FA4 / cuDNN. Writes a JSON file with every measurement and, unless `--no-plot`, a PNG next to it.
The implementations of a row are timed in rounds (one call of each per round, so they share the
GPU's clock and power state; `--sequential`: all reps of one, then the next).

Constraints: needs a CUDA GPU for anything but the pure helpers (`visible_pairs`,
`attention_flops`, `median_p95`), which tests exercise on the CPU. Without a GPU `run_bench`
prints a message and returns 0. torch is imported lazily so the helpers stay cheap.

How to run:
    python -m cute_attn bench                       # fwd-prefill preset, all impls
    python -m cute_attn bench --preset decode --impls cute_attn fa4 --reps 50
    python -m cute_attn bench --preset full --filter bwd --no-check --out /tmp/b.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

from .dispatch import device_arch
from .problem import normalize_window

ALL_IMPLS = ("cute_attn", "fa4", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
# The "vs best" column divides the faster of these by each impl's median.
BASELINE_IMPLS = ("fa4", "sdpa-cudnn")
PRESETS = ("fwd-prefill", "bwd", "decode", "spec-decode", "varlen", "full")
L2_FALLBACK_BYTES = 50 * 2**20  # H100 / H200 L2
_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


# --------------------------------------------------------------------------------------------
# Pure helpers (no torch)
# --------------------------------------------------------------------------------------------


def _sum_clamped(n: int, c: int, lo: int, hi: int) -> int:
    """sum_{i=0}^{n-1} clamp(i + c, lo, hi) in closed form (lo <= hi)."""
    if n <= 0:
        return 0
    i0 = min(max(lo - c, 0), n)  # i < i0: value clamps to lo
    i1 = min(max(hi - c + 1, 0), n)  # i >= i1: value clamps to hi
    i1 = max(i1, i0)
    mid = i1 - i0
    return i0 * lo + (n - i1) * hi + mid * c + (i0 + i1 - 1) * mid // 2


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(None, None)):
    """Exact number of (i, j) pairs with key j visible to query i (bottom-right aligned mask).

    Key j is visible iff i + Sk - Sq - left <= j <= i + Sk - Sq + right, unbounded sides
    dropped. Per row the count is clamp(i+off+right, -1, Sk-1) - clamp(i+off-left, 0, Sk) + 1,
    which is exact even when the band misses [0, Sk) entirely; summing both clamps in closed
    form makes this O(1) for any sequence length.
    """
    left, right = normalize_window(causal, window_size or (None, None))
    off = seqlen_k - seqlen_q
    if right >= 0:
        hi_sum = _sum_clamped(seqlen_q, off + right, -1, seqlen_k - 1)
    else:
        hi_sum = seqlen_q * (seqlen_k - 1)
    lo_sum = _sum_clamped(seqlen_q, off - left, 0, seqlen_k) if left >= 0 else 0
    return hi_sum - lo_sum + seqlen_q


def attention_flops(
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    head_dim_v: int | None = None,
    causal: bool = False,
    window_size=(None, None),
    mode: str = "fwd",
) -> int:
    """Matmul FLOPs over visible pairs: 2*B*H*pairs*(D+Dv) (= 4*B*H*D*pairs when Dv == D).

    bwd counts 2.5x the forward (five matmuls against two), the FlashAttention convention.
    """
    dv = head_dim if head_dim_v is None else head_dim_v
    fwd = 2 * batch * heads * visible_pairs(seqlen_q, seqlen_k, causal, window_size)
    fwd *= head_dim + dv
    return fwd if mode == "fwd" else fwd * 5 // 2


def percentile(sorted_samples: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of already sorted samples."""
    if not sorted_samples:
        raise ValueError("no samples")
    pos = (len(sorted_samples) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_samples) - 1)
    frac = pos - lo
    return sorted_samples[lo] * (1.0 - frac) + sorted_samples[hi] * frac


def median_p95(samples) -> tuple[float, float]:
    """(median, 95th percentile) of a non-empty sequence of timings."""
    s = sorted(float(x) for x in samples)
    return percentile(s, 50.0), percentile(s, 95.0)


# --------------------------------------------------------------------------------------------
# Shape matrix
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    causal: bool = False
    window: tuple = (None, None)
    softcap: float = 0.0
    mode: str = "fwd"  # "fwd" or "bwd"
    metric: str = "tflops"  # "tflops" or "tbps" (decode: bytes of K+V read)
    deterministic: bool = False  # cute_attn only; the baselines run their default
    # packed varlen row: one (Sq = Sk) length per sequence; batch / seqlen_* are then the
    # sequence count and the longest length
    seqlens: tuple = ()
    # > 0: decode over a paged KV cache of this page size (pages in shuffled order), the same
    # K / V values as the dense row
    page_size: int = 0

    @property
    def flops(self) -> int:
        if self.seqlens:
            return sum(
                attention_flops(
                    1,
                    self.heads,
                    s,
                    s,
                    self.head_dim,
                    self.head_dim_v,
                    self.causal,
                    self.window,
                    self.mode,
                )  # fmt: skip
                for s in self.seqlens
            )
        return attention_flops(
            self.batch, self.heads, self.seqlen_q, self.seqlen_k, self.head_dim,
            self.head_dim_v, self.causal, self.window, self.mode,
        )  # fmt: skip

    def kv_bytes(self, elem_size: int) -> int:
        per_token = self.heads_kv * (self.head_dim + self.head_dim_v) * elem_size
        return (sum(self.seqlens) if self.seqlens else self.batch * self.seqlen_k) * per_token

    @property
    def has_window(self) -> bool:
        return any(w is not None and w >= 0 for w in self.window)


def _prefill_rows(mode: str = "fwd", dims=(64, 128, 256), seqlens=(1024, 4096, 16384)):
    rows = []
    for d in dims:
        for s in seqlens:
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                tag = f"{mode} b{b} s{s} h{h} d{d}" + (" causal" if causal else "")
                rows.append(Row(tag, b, s, s, h, h, d, d, causal=causal, mode=mode))
    return rows


def _decode_rows():
    # One new token; bottom-right causal with Sq=1 sees every key, so causal=False is the same
    # mask and keeps SDPA backends (which would need causal_lower_right) in the comparison.
    rows = []
    for b, sk in ((1, 32768), (8, 8192), (64, 8192), (128, 2048)):
        rows.append(Row(f"decode b{b} sk{sk} h32/8 d128", b, 1, sk, 32, 8, 128, 128,
                        metric="tbps"))  # fmt: skip
    # the inference issue's paged bar: page sizes 64..256 within 10% of the dense row
    for ps in (64, 128, 256):
        rows.append(Row(f"decode b64 sk8192 h32/8 d128 paged{ps}", 64, 1, 8192, 32, 8, 128, 128,
                        metric="tbps", page_size=ps))  # fmt: skip
    return rows


def _spec_decode_rows():
    # Speculative decoding: a few new query rows under the bottom-right causal corner, over a
    # dense cache (the decode rows' shapes); the query heads of a KV head read the same keys,
    # which packed GQA rows (tile_config.fwd_pack_gqa) read once; 28 / 4 heads (G = 7,
    # Qwen2.5-7B's) pack into padded tiles (nine positions a 64-row tile)
    return [Row(f"spec-decode b{b} sk{sk} sq{sq} h{h}/{hkv} d128 causal", b, sq, sk, h, hkv,
                128, 128, causal=True, metric="tbps")
            for b, sk, sq, h, hkv in ((1, 32768, 4, 32, 8), (8, 8192, 2, 32, 8),
                                      (8, 8192, 4, 32, 8), (8, 8192, 8, 32, 8),
                                      (64, 8192, 4, 32, 8), (8, 8192, 4, 28, 4))]  # fmt: skip


# 16 mixed lengths, 58,728 tokens: the varlen prefill row of the inference issue
VARLEN_SEQLENS = (512, 8192, 1024, 6000, 3000, 256, 7000, 2048, 4096, 5000, 300, 6500, 1500,
                  4000, 8000, 1300)  # fmt: skip


def _varlen_rows():
    # the same packed batch forward (the inference issue's row) and backward (training on
    # packed sequences; cute_attn also in its deterministic mode)
    s = VARLEN_SEQLENS
    name = f"varlen {len(s)} seqs {sum(s)} tok h32/8 d128 causal"
    return [Row(f"{tag}{name}{det * ' det'}", len(s), max(s), max(s), 32, 8, 128, 128,
                causal=True, seqlens=s, mode=mode, deterministic=det)
            for tag, mode, det in (("", "fwd", False), ("bwd ", "bwd", False),
                                   ("bwd ", "bwd", True))]  # fmt: skip


def preset_rows(preset: str) -> list[Row]:
    """The named shape matrix (see module docstring and `--help`)."""
    if preset == "fwd-prefill":
        return _prefill_rows()
    if preset == "bwd":
        # the backward matrix and D=96
        return _prefill_rows("bwd", dims=(64, 96, 128, 256))
    if preset == "decode":
        return _decode_rows()
    if preset == "spec-decode":
        return _spec_decode_rows()
    if preset == "varlen":
        return _varlen_rows()
    if preset != "full":
        raise ValueError(f"unknown preset {preset!r}; choose from {PRESETS}")
    rows = _prefill_rows() + _decode_rows() + _spec_decode_rows() + _varlen_rows()
    for causal in (False, True):
        c = " causal" if causal else ""
        rows += [
            Row(f"fwd b4 sq1024 sk4096 h16 d128{c}", 4, 1024, 4096, 16, 16, 128, 128, causal),
            Row(f"fwd b4 sq4096 sk1024 h16 d128{c}", 4, 4096, 1024, 16, 16, 128, 128, causal),
            Row(f"fwd b4 s4096 h32/8 d128 gqa{c}", 4, 4096, 4096, 32, 8, 128, 128, causal),
            Row(f"fwd b4 s4096 h32/1 d128 mqa{c}", 4, 4096, 4096, 32, 1, 128, 128, causal),
            Row(f"fwd b4 s4096 h10 d192{c}", 4, 4096, 4096, 10, 10, 192, 192, causal),
            Row(f"fwd b4 s4096 h16 d192/128{c}", 4, 4096, 4096, 16, 16, 192, 128, causal),
            Row(f"bwd b4 s4096 h32/8 d96 gqa{c}", 4, 4096, 4096, 32, 8, 96, 96, causal,
                mode="bwd"),
            Row(f"bwd b16 s1024 h10 d192{c}", 16, 1024, 1024, 10, 10, 192, 192, causal,
                mode="bwd"),
            Row(f"bwd b4 s4096 h10 d192{c}", 4, 4096, 4096, 10, 10, 192, 192, causal,
                mode="bwd"),
            Row(f"bwd b1 s16384 h10 d192{c}", 1, 16384, 16384, 10, 10, 192, 192, causal,
                mode="bwd"),
            Row(f"bwd b8 s1024 h16 d192/128{c}", 8, 1024, 1024, 16, 16, 192, 128, causal,
                mode="bwd"),
            Row(f"bwd b4 s4096 h16 d192/128{c}", 4, 4096, 4096, 16, 16, 192, 128, causal,
                mode="bwd"),
            Row(f"bwd b1 s16384 h16 d192/128{c}", 1, 16384, 16384, 16, 16, 192, 128, causal,
                mode="bwd"),
        ]  # fmt: skip
    rows += [
        Row("fwd b2 s8192 h16 d128 window(1024,0)", 2, 8192, 8192, 16, 16, 128, 128,
            window=(1024, 0)),
        Row("fwd b2 s8192 h16 d128 window(256,256)", 2, 8192, 8192, 16, 16, 128, 128,
            window=(256, 256)),
    ]  # fmt: skip
    rows += _prefill_rows("bwd", dims=(64, 128))
    return rows


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


def dist_version(*names: str) -> str | None:
    """Installed version of the first distribution found among `names`, else None."""
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def cuda_driver_version() -> str | None:
    """The NVIDIA driver version (nvidia-smi), else the CUDA driver API version, else None."""
    import shutil

    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            res = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=False,
            )  # fmt: skip
            line = res.stdout.strip().splitlines()[0] if res.returncode == 0 else ""
            if line:
                return line.strip()
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if int(err) != 0:
            return None
        err, ver = driver.cuDriverGetVersion()
        if int(err) == 0:
            return f"CUDA {ver // 1000}.{ver % 1000 // 10} (driver API)"
    except Exception:  # noqa: BLE001 - any failure just means "unknown"
        pass
    return None


def sources_sha256() -> str:
    """sha256 (first 16 hex digits) over the host package's and the kernels' *.py files, by
    relative path and content: `python -c "from cute_attn.bench import sources_sha256 as f;
    print(f())"` on a checkout tells whether a JSON came from it."""
    import hashlib

    from .cache import _arch_dir

    h = hashlib.sha256()
    for root in (Path(__file__).resolve().parent, _arch_dir()):
        if root is None:
            continue
        for path in sorted(root.rglob("*.py"), key=lambda q: q.relative_to(root).as_posix()):
            if "__pycache__" not in path.parts:
                h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        res = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return (res.stdout.strip() or None) if res.returncode == 0 else None


def _fa4_func():
    """FlashAttention-4's flash_attn_func (package flash-attn-4), or None if not importable."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:  # noqa: BLE001 - an import error of any kind means "not available"
        return None
    return flash_attn_func


def environment(device) -> dict:
    import torch

    import cute_attn

    props = torch.cuda.get_device_properties(device)
    return {
        "device": props.name,
        "capability": device_arch(torch.device(device).index or 0),
        "sm_count": props.multi_processor_count,
        "driver": cuda_driver_version(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "cutlass_dsl": dist_version("nvidia-cutlass-dsl"),
        "flash_attn_4": dist_version("flash-attn-4", "flash_attn_4"),
        "cute_attn": getattr(cute_attn, "__version__", None),
        # on the lent GPU machine the checkout's .git can lag the copied working tree (it read
        # c3b9c05-dirty for later code): sources_sha256 identifies the code that ran
        "git_commit": git_commit(),
        "sources_sha256": sources_sha256(),
    }


# --------------------------------------------------------------------------------------------
# Implementations: each builder returns candidates (note, fn, kv) and a context factory; the
# first candidate whose first call succeeds is timed. fn() returns the output in (B, S, H, Dv)
# layout; kv are the K and V tensors fn differentiates against (expanded ones for SDPA's
# repeat_interleave GQA path). Raising Skip says the impl does not support the row by design
# (recorded as "skip" with the reason, not as an error).
# --------------------------------------------------------------------------------------------


class Skip(Exception):
    pass


def _build_cute_attn(row: Row, q, k, v):
    import cute_attn

    def fn():
        return cute_attn.flash_attn_func(
            q, k, v, causal=row.causal, window_size=row.window, softcap=row.softcap,
            deterministic=row.deterministic,
        )[0]  # fmt: skip

    return [("", fn, (k, v))], contextlib.nullcontext


def _build_fa4(row: Row, q, k, v):
    import inspect

    func = _fa4_func()
    if func is None:
        raise Skip("flash_attn.cute not importable")
    kwargs = {"causal": row.causal}
    params = inspect.signature(func).parameters
    if row.has_window:
        if "window_size" not in params:
            raise Skip("this FA4 has no window_size")
        kwargs["window_size"] = row.window
    if row.softcap:
        kwargs["softcap"] = row.softcap
    if "return_lse" in params and row.mode == "fwd":
        kwargs["return_lse"] = True  # the same work as cute_attn, which always writes lse

    def make(**extra):
        def fn():
            res = func(q, k, v, **kwargs, **extra)
            return res[0] if isinstance(res, tuple) else res

        return fn

    cands = [("", make(), (k, v))]
    if "num_splits" in params:
        # FA4 defaults to num_splits=1; 0 asks for its split heuristic, like cute_attn's
        # default. Where FA4 cannot split (its SM90 path asserts), its default is what runs.
        cands.insert(0, ("num_splits=0", make(num_splits=0), (k, v)))
    return cands, contextlib.nullcontext


_SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
}


def _build_sdpa(impl: str, row: Row, q, k, v):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if row.has_window:
        raise Skip("SDPA has no sliding-window mask")
    if row.softcap:
        raise Skip("SDPA has no softcap")
    kwargs = {}
    if row.causal and row.seqlen_q == row.seqlen_k:
        kwargs["is_causal"] = True
    elif row.causal:
        try:
            from torch.nn.attention.bias import causal_lower_right
        except ImportError as e:
            raise Skip("bottom-right causal (Sq != Sk) needs causal_lower_right") from e
        kwargs["attn_mask"] = causal_lower_right(row.seqlen_q, row.seqlen_k)

    def make(kk, vv, **extra):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, kk, vv))  # (B, H, S, D) views, no copy

        def fn():
            return F.scaled_dot_product_attention(qt, kt, vt, **kwargs, **extra).transpose(1, 2)

        return fn

    cands = []
    if row.heads != row.heads_kv:
        cands.append(("enable_gqa", make(k, v, enable_gqa=True), (k, v)))
        # Fallback for backends without enable_gqa: expand here, outside the timed region.
        ratio = row.heads // row.heads_kv
        ke, ve = (t.detach().repeat_interleave(ratio, dim=2).requires_grad_(t.requires_grad)
                  for t in (k, v))  # fmt: skip
        cands.append(("kv repeat_interleave (untimed)", make(ke, ve), (ke, ve)))
    else:
        cands.append(("", make(k, v), (k, v)))
    backend = getattr(SDPBackend, _SDPA_BACKENDS[impl])
    return cands, (lambda: sdpa_kernel(backend))


def _build_varlen(impl: str, row: Row, q, k, v):
    """Packed rows: q (total, H, D), k / v (total, Hkv, D). cute_attn and FA4 take the packed
    tensors with cu_seqlens; SDPA has no varlen entry, so its backends loop over the sequences
    (Sq = Sk per sequence: its top-left causal is the contract's bottom-right)."""
    import torch

    lens = torch.tensor((0, *row.seqlens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu = lens.to(q.device)
    mx = max(row.seqlens)
    if impl == "cute_attn":
        import cute_attn

        def fn():
            return cute_attn.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx,
                causal=row.causal, deterministic=row.deterministic,
            )[0]  # fmt: skip

        return [("", fn, (k, v))], contextlib.nullcontext
    if impl == "fa4":
        try:
            from flash_attn.cute import flash_attn_varlen_func
        except Exception as e:  # noqa: BLE001 - any import failure means "not available"
            raise Skip("flash_attn.cute varlen not importable") from e

        def fn_fa4():
            res = flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx,
                causal=row.causal,
            )  # fmt: skip
            return res[0] if isinstance(res, tuple) else res

        return [("", fn_fa4, (k, v))], contextlib.nullcontext
    if impl in _SDPA_BACKENDS:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        bounds = lens.tolist()
        views = [(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                  v[a:b].transpose(0, 1)[None]) for a, b in zip(bounds, bounds[1:])]  # fmt: skip

        def fn_sdpa():
            # a fresh output per call: backward rows keep every call's autograd graph, which
            # writes into one shared buffer would invalidate
            out = torch.empty(q.shape[0], row.heads, row.head_dim_v, device=q.device,
                              dtype=q.dtype)  # fmt: skip
            for (qs, ks, vs), a, b in zip(views, bounds, bounds[1:]):
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=row.causal, enable_gqa=row.heads != row.heads_kv
                )
                out[a:b] = o[0].transpose(0, 1)
            return out

        backend = getattr(SDPBackend, _SDPA_BACKENDS[impl])
        return [("looped per sequence", fn_sdpa, (k, v))], (lambda: sdpa_kernel(backend))
    raise ValueError(f"unknown impl {impl!r}")


def _paged_cache(row: Row, k, v):
    """k / v (B, Sk, Hkv, D) as (B * Sk / page_size, page_size, Hkv, D) pages in a random
    physical order, and the (B, Sk / page_size) int32 page table that maps them back."""
    import torch

    b, sk = k.shape[:2]
    per_row = sk // row.page_size
    perm = torch.randperm(b * per_row, device=k.device)

    def pages(t):
        out = torch.empty((b * per_row, row.page_size, *t.shape[2:]), dtype=t.dtype,
                          device=t.device)  # fmt: skip
        out[perm] = t.detach().reshape(b * per_row, row.page_size, *t.shape[2:])
        return out

    return pages(k), pages(v), perm.view(b, per_row).to(torch.int32)


def _build_paged(impl: str, row: Row, q, k, v):
    """Decode over a paged cache (Sk a multiple of page_size, every row full): cute_attn's
    KV-cache entry and FA4's varlen entry with page_table; SDPA has no paged input."""
    import torch

    if impl not in ("cute_attn", "fa4"):
        raise Skip("no paged KV input")
    kp, vp, table = _paged_cache(row, k, v)
    lens = torch.full((row.batch,), row.seqlen_k, dtype=torch.int32, device=q.device)
    if impl == "cute_attn":
        import cute_attn

        def fn():
            return cute_attn.flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=lens, page_table=table, causal=row.causal
            )[0]

        return [("", fn, (k, v))], contextlib.nullcontext
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        raise Skip("flash_attn.cute varlen not importable") from e

    def fn_fa4():
        res = flash_attn_varlen_func(
            q, kp, vp, seqused_k=lens, page_table=table, max_seqlen_q=row.seqlen_q,
            max_seqlen_k=row.seqlen_k, causal=row.causal, return_lse=True,
        )  # fmt: skip
        return res[0] if isinstance(res, tuple) else res

    return [("", fn_fa4, (k, v))], contextlib.nullcontext


def _candidates(impl: str, row: Row, q, k, v):
    if row.page_size:
        return _build_paged(impl, row, q, k, v)
    if row.seqlens:
        return _build_varlen(impl, row, q, k, v)
    if impl == "cute_attn":
        return _build_cute_attn(row, q, k, v)
    if impl == "fa4":
        return _build_fa4(row, q, k, v)
    if impl in _SDPA_BACKENDS:
        return _build_sdpa(impl, row, q, k, v)
    raise ValueError(f"unknown impl {impl!r}")


# --------------------------------------------------------------------------------------------
# Reference (chunked fp32) and timing
# --------------------------------------------------------------------------------------------


def reference_outputs(row: Row, q, k, v, dout=None, budget_bytes: int | None = None):
    """fp32 reference output (and (dq, dk, dv) when `dout` is given) for one row.

    attention_ref / attention_ref_backward walk query blocks whose score temporaries stay
    under `budget_bytes`, so even 16k x 16k rows fit next to the benchmark's own tensors.
    """
    import torch

    from cute_attn import reference

    sem = dict(softmax_scale=1.0 / math.sqrt(row.head_dim), causal=row.causal,
               window_size=row.window, softcap=row.softcap, compute_dtype=torch.float32,
               score_budget_bytes=budget_bytes)  # fmt: skip
    if row.seqlens:  # packed: each sequence its own dense problem
        outs, grads, a = [], [], 0
        for n in row.seqlens:
            qs, ks, vs = q[None, a : a + n], k[None, a : a + n], v[None, a : a + n]
            out, lse = reference.attention_ref(qs, ks, vs, **sem)
            outs.append(out[0])
            if dout is not None:
                g = reference.attention_ref_backward(qs, ks, vs, out, lse, dout[None, a : a + n],
                                                     **sem)  # fmt: skip
                grads.append([t[0] for t in g])
            a += n
        if dout is None:
            return torch.cat(outs), None
        return torch.cat(outs), tuple(torch.cat(parts) for parts in zip(*grads))
    out, lse = reference.attention_ref(q, k, v, **sem)
    if dout is None:
        return out, None
    return out, reference.attention_ref_backward(q, k, v, out, lse, dout, **sem)


def _max_err(got, ref) -> float:
    return float((got.float() - ref).abs().max().item()) if got.numel() else 0.0


def _reduce_groups(g, heads_kv: int):
    # Grads w.r.t. an expanded (..., S, H, D) K/V: sum each group back onto its KV head.
    h = g.shape[-2]
    return g.unflatten(-2, (heads_kv, h // heads_kv)).sum(-2) if h != heads_kv else g


def capture_graph(fn, warmup: int = 1):
    """(graph, output) of fn captured on a side stream after `warmup` calls there (compiles and
    allocator pools settle outside the capture). Also used by scripts/."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _time_rounds(calls, n_sets: int, warmup: int, reps: int) -> list[list[float]]:
    """CUDA-event times (ms) of each `(context factory, call)` in `calls`, taken in rounds:
    round r runs every call once, back to back, so every impl sees the same clocks and power
    state (an H200 under sustained load moves its clocks: timed one impl after another, the
    same row measured 656 and 699 TFLOP/s in two runs). A running counter picks each call's
    input set, so no call reads the set the call before it just read (L2 stays cold where the
    sets allow). Calls are queued without syncs; each call's context (e.g. the SDPA backend)
    is entered outside its events."""
    import torch

    count = 0
    for _ in range(warmup):
        for ctx, fn in calls:
            with ctx():
                fn(count % n_sets)
            count += 1
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(reps)] for _ in calls]  # fmt: skip
    for r in range(reps):
        for (ctx, fn), ev in zip(calls, events):
            with ctx():
                ev[r][0].record()
                fn(count % n_sets)
                ev[r][1].record()
            count += 1
    torch.cuda.synchronize()
    return [[a.elapsed_time(b) for a, b in ev] for ev in events]


@dataclasses.dataclass
class _Prepared:
    """One impl on one row after its first (compile) call: `call(set_index)` runs it under
    `context()`; `call` is None when `res` is already final (skip or error)."""

    res: dict
    context: object = contextlib.nullcontext
    call: object = None


def _prepare_impl(impl, row, sets, args) -> _Prepared:
    """Build and first-call one impl on one row (the first call = compile, timed apart)."""
    import torch

    res = {"impl": impl, "status": "ok", "note": ""}
    bwd = row.mode == "bwd"
    try:
        built = [_candidates(impl, row, *s[:3]) for s in sets]
    except Skip as e:
        return _Prepared({**res, "status": "skip", "note": str(e)})
    context = built[0][1]
    with context():
        # First call = compile (cute_attn / FA4 JIT) or plan build (cuDNN): timed on its own.
        err = None
        for ci, (note, fn0, kv0) in enumerate(built[0][0]):
            try:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with warnings.catch_warnings():  # SDPA warns per backend it cannot use
                    warnings.simplefilter("ignore", UserWarning)
                    out0 = fn0()
                if bwd:
                    torch.autograd.grad(out0, (sets[0][0], *kv0), sets[0][3])
                torch.cuda.synchronize()
                res["compile_ms"] = (time.perf_counter() - t0) * 1e3
                res["note"], chosen = note, ci
                break
            except NotImplementedError as e:  # dispatch: no kernel serves this row
                return _Prepared({**res, "status": "skip", "note": str(e)[:500]})
            except Exception as e:  # noqa: BLE001 - the next candidate may work
                err = e
        else:
            note = f"{type(err).__name__}: {err}"[:500]
            return _Prepared({**res, "status": "error", "note": note})
        del out0
        if impl == "cute_attn":
            import cute_attn

            # the backward runs on autograd's thread: its decision is process-wide
            d = cute_attn.last_backward_dispatch() if bwd else cute_attn.last_dispatch()
            res["dispatch"] = getattr(d, "impl", None)
            res["dispatch_reason"] = getattr(d, "reason", None)
            if res["dispatch"] == "reference":
                reason = getattr(d, "reason", "")
                note = f"dispatched to reference: {reason}"
                return _Prepared({**res, "status": "skip", "note": note})
        cands = [b[0][chosen] for b in built]
        if bwd:
            outs = [c[1]() for c in cands]  # one graph per set, reused with retain_graph
            leaves = [(s[0], *c[2]) for s, c in zip(sets, cands)]

            def call(i):
                return torch.autograd.grad(outs[i], leaves[i], sets[i][3], retain_graph=True)
        elif getattr(args, "graph", False):
            # GPU time only: each set's call captured once in a CUDA graph, then replayed
            # (candidate, graph, output): a graph reads its candidate's tensors, and paged rows
            # build theirs (pages, table) inside the candidate, so the candidate stays alive
            # with its graph. Before, they were freed here and the replays read whatever took
            # their memory next (an illegal address once FA4's paged inputs reused it).
            try:
                graphs = [(c, *capture_graph(c[1])) for c in cands]
            except Exception as e:  # noqa: BLE001 - e.g. a host sync inside the call
                note = f"graph capture: {type(e).__name__}: {e}"[:500]
                return _Prepared({**res, "status": "error", "note": note})
            res["note"] = (res["note"] + " graph").strip()

            def call(i):
                _, graph, out = graphs[i]
                graph.replay()
                return out
        else:

            def call(i):
                return cands[i][1]()

    return _Prepared(res, context, call)


def _finish_impl(prep: _Prepared, row, sets, ref, times) -> dict:
    """Median / p95 / rate of one impl's times, its peak memory and max error (one more call
    outside the timed rounds)."""
    import torch

    res = prep.res
    with prep.context():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = prep.call(0)
        torch.cuda.synchronize()
        res["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    med, p95 = median_p95(times)
    res.update(median_ms=med, p95_ms=p95, tflops=row.flops / (med * 1e-3) / 1e12)
    if row.metric == "tbps":
        res["tbps"] = row.kv_bytes(sets[0][0].element_size()) / (med * 1e-3) / 1e12
    if ref is not None:
        if row.mode == "bwd":
            gq, gk, gv = result
            gk, gv = _reduce_groups(gk, row.heads_kv), _reduce_groups(gv, row.heads_kv)
            res["max_err"] = max(_max_err(g, r) for g, r in zip((gq, gk, gv), ref[1]))
        else:
            res["max_err"] = _max_err(result, ref[0])
    return res


def _bench_row(impls, row, sets, ref, args) -> list[dict]:
    """Every impl on one row: each prepared (compiled, first call), then all timed together in
    rounds (`_time_rounds`; `--sequential`: one impl's reps after another's, the older method).
    If the rounds fail (one impl raising mid-run), each impl is timed alone to find it."""
    preps = []
    for impl in impls:
        try:
            preps.append(_prepare_impl(impl, row, sets, args))
        except Exception as e:  # noqa: BLE001 - one failure must not end the sweep
            preps.append(_Prepared({"impl": impl, "status": "error",
                                    "note": f"{type(e).__name__}: {e}"[:500]}))  # fmt: skip
    live = [p for p in preps if p.call is not None]
    n_sets = len(sets)
    times = None
    if live and not getattr(args, "sequential", False):
        try:
            times = _time_rounds([(p.context, p.call) for p in live], n_sets, args.warmup,
                                 args.reps)  # fmt: skip
        except Exception:  # noqa: BLE001 - timed alone below, which names the failing impl
            times = None
    if times is None:
        times = []
        for p in live:
            try:
                times.append(_time_rounds([(p.context, p.call)], n_sets, args.warmup, args.reps)[0])
            except Exception as e:  # noqa: BLE001
                times.append(None)
                p.res.update(status="error", note=f"{type(e).__name__}: {e}"[:500])
    for p, t in zip(live, times):
        if t is not None:
            try:
                _finish_impl(p, row, sets, ref, t)
            except Exception as e:  # noqa: BLE001
                p.res.update(status="error", note=f"{type(e).__name__}: {e}"[:500])
        if p.res["status"] != "ok":
            for key in ("median_ms", "p95_ms", "tflops", "tbps", "peak_mib", "max_err"):
                p.res.pop(key, None)
    return [p.res for p in preps]


def _make_inputs(row: Row, dtype, device, l2_bytes: int, gen):
    import torch

    def rnd(*shape):
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        return t.requires_grad_(row.mode == "bwd")

    if row.seqlens:  # packed (total, heads, dim); one set: far larger than L2
        total = sum(row.seqlens)
        dout = None
        if row.mode == "bwd":
            dout = rnd(total, row.heads, row.head_dim_v).detach()
        return [(rnd(total, row.heads, row.head_dim), rnd(total, row.heads_kv, row.head_dim),
                 rnd(total, row.heads_kv, row.head_dim_v), dout)]  # fmt: skip
    b, sq, sk = row.batch, row.seqlen_q, row.seqlen_k
    elem = torch.empty((), dtype=dtype).element_size()
    set_bytes = elem * b * (sq * row.heads * (row.head_dim + 2 * row.head_dim_v)
                            + sk * row.heads_kv * (row.head_dim + row.head_dim_v))  # fmt: skip
    # Rotate among enough sets that their total exceeds L2, so no rep reads a warm cache.
    # (Capped: a row that small is launch-bound anyway.)
    n_sets = 1 if set_bytes > l2_bytes else min(64, l2_bytes // set_bytes + 1)
    sets = []
    for _ in range(n_sets):
        q = rnd(b, sq, row.heads, row.head_dim)
        k = rnd(b, sk, row.heads_kv, row.head_dim)
        v = rnd(b, sk, row.heads_kv, row.head_dim_v)
        dout = rnd(b, sq, row.heads, row.head_dim_v).detach() if row.mode == "bwd" else None
        sets.append((q, k, v, dout))
    return sets


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _fmt_row(r: dict) -> list[str]:
    """Cells of one table line; the last cell (the note) is never padded."""
    note = r.get("note", "").replace("\n", " ")
    if r["status"] != "ok":
        return [r["row"], r["impl"], *["-"] * 8, f"{r['status']}: {note[:160]}"]

    def num(key, fmt):
        return "-" if r.get(key) is None else format(r[key], fmt)

    rate = f"{r['tbps']:.2f} TB/s" if "tbps" in r else f"{r['tflops']:.1f}"
    ratio = f"{r['vs_best']:.2f}x" if r.get("vs_best") else "-"
    compile_s = "-" if r.get("compile_ms") is None else f"{r['compile_ms'] / 1e3:.2f}"
    return [r["row"], r["impl"], num("median_ms", ".3f"), num("p95_ms", ".3f"), rate,
            num("max_err", ".2e"), ratio, num("peak_mib", ".0f"), compile_s,
            r.get("dispatch") or "-", note]  # fmt: skip


def format_table(results: list[dict]) -> str:
    head = ["row", "impl", "median ms", "p95 ms", "TFLOP/s", "max err", "vs best", "peak MiB",
            "1st call s", "dispatch", "note"]  # fmt: skip
    body = [_fmt_row(r) for r in results]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head) - 1)] + [0]
    lines = ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in [head, *body]]
    lines.insert(1, "-" * max(len(x) for x in lines))
    lines.append(
        "TFLOP/s counts only visible (i, j) pairs; decode rows give TB/s of K+V read. "
        "'vs best' = best median of " + "/".join(BASELINE_IMPLS) + " divided by this median "
        "(>1 is faster). max err: max |out - fp32 reference| (grads for bwd rows). "
        "1st call = compile / plan build, timed apart from the reps."
    )
    return "\n".join(lines)


def _add_ratios(results: list[dict]) -> None:
    by_row: dict[str, float] = {}
    for r in results:
        if r["status"] == "ok" and r["impl"] in BASELINE_IMPLS:
            by_row[r["row"]] = min(by_row.get(r["row"], math.inf), r["median_ms"])
    for r in results:
        if r["status"] == "ok" and r["row"] in by_row:
            r["vs_best"] = by_row[r["row"]] / r["median_ms"]


def plot(results: list[dict], path: Path) -> bool:
    """Bars per row per impl (TFLOP/s; TB/s for decode rows); False if nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r["status"] == "ok"]
    groups = [
        ("tflops", [r for r in ok if "tbps" not in r]),
        ("tbps", [r for r in ok if "tbps" in r]),
    ]
    groups = [(m, rs) for m, rs in groups if rs]
    if not groups:
        return False
    fig, axes = plt.subplots(len(groups), 1, figsize=(16, 5.5 * len(groups)), squeeze=False)
    for ax, (metric, rs) in zip(axes[:, 0], groups):
        rows = list(dict.fromkeys(r["row"] for r in rs))
        impls = list(dict.fromkeys(r["impl"] for r in rs))
        width = 0.8 / len(impls)
        for j, impl in enumerate(impls):
            vals = {r["row"]: r["tbps" if metric == "tbps" else "tflops"]
                    for r in rs if r["impl"] == impl}  # fmt: skip
            xs = [i + j * width for i, row in enumerate(rows) if row in vals]
            ax.bar(xs, [vals[row] for row in rows if row in vals], width, label=impl)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
        ax.set_xticklabels(rows, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("TB/s (K+V read)" if metric == "tbps" else "TFLOP/s")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


class _Progress:
    """tqdm when installed, else one plain line per step."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="run", file=sys.stderr)
        except ImportError:
            self._bar = None
        self._total, self._n = total, 0

    def step(self, label: str) -> None:
        self._n += 1
        if self._bar is not None:
            self._bar.set_postfix_str(label[:60])
            self._bar.update(1)
        else:
            print(f"[{self._n}/{self._total}] {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def run_bench(args) -> int:
    """Entry point for `python -m cute_attn bench` (args from cli.add_bench_arguments)."""
    import torch

    rows = preset_rows(args.preset)
    if args.filter:
        rows = [r for r in rows if all(f in r.name for f in args.filter)]
        if not rows:
            # fail, as `check` does: an empty run would write an empty JSON and exit 0
            words = " ".join(args.filter)
            print(f"no {args.preset} row matched --filter {words} (a row must contain every word)")
            return 1
    if not torch.cuda.is_available():
        print("no CUDA GPU found: nothing to benchmark")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, _DTYPES[args.dtype])
    if getattr(args, "deterministic", False):
        rows = [dataclasses.replace(r, name=r.name + " det", deterministic=True) for r in rows]
    impls = list(args.impls or ALL_IMPLS)
    env = environment(device)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or L2_FALLBACK_BYTES
    gen = torch.Generator(device=device).manual_seed(args.seed)
    budget = int(args.ref_budget_gb * 2**30)
    print(f"{env['device']} ({env['capability']}), torch {env['torch']}, CUDA {env['torch_cuda']}"
          f", {len(rows)} rows x {len(impls)} impls", file=sys.stderr)  # fmt: skip
    results: list[dict] = []
    out = Path(args.out)
    payload = {"environment": env, "preset": args.preset, "dtype": args.dtype,
               "reps": args.reps, "warmup": args.warmup}  # fmt: skip
    progress = _Progress(len(rows) * len(impls))
    try:
        for row in rows:
            try:
                sets = _make_inputs(row, dtype, device, l2, gen)
                ref = None
                if not args.no_check:
                    q, k, v, dout = sets[0]
                    with torch.no_grad():
                        ref = reference_outputs(row, q.detach(), k.detach(), v.detach(), dout,
                                                budget)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: record, keep going
                for impl in impls:
                    results.append({"row": row.name, "impl": impl, "status": "error",
                                    "note": f"setup: {type(e).__name__}: {e}"[:500],
                                    **_row_meta(row, dtype)})  # fmt: skip
                    progress.step(f"{row.name} {impl}")
                continue
            for res in _bench_row(impls, row, sets, ref, args):
                results.append({"row": row.name, **res, **_row_meta(row, dtype)})
                progress.step(f"{row.name} {res['impl']}")
            del sets, ref
            torch.cuda.empty_cache()
            _save(out, payload, results)
    finally:
        progress.close()
    _save(out, payload, results)
    wrote = [str(out)]
    if not args.no_plot:
        try:
            if plot(results, out.with_suffix(".png")):
                wrote.append(str(out.with_suffix(".png")))
        except Exception as e:  # noqa: BLE001 - e.g. matplotlib missing: the JSON is what counts
            print(f"plot skipped: {type(e).__name__}: {e}", file=sys.stderr)
    print(format_table(results))
    print("wrote " + " and ".join(wrote))
    return 0


def _save(path: Path, payload: dict, results: list[dict]) -> None:
    # Rewritten after every row (atomically), so a crash or a killed run keeps what it measured.
    _add_ratios(results)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**payload, "results": results}, indent=1, default=str))
    tmp.replace(path)


def _row_meta(row: Row, dtype) -> dict:
    meta = dataclasses.asdict(row)
    meta.pop("name")
    meta["dtype"] = str(dtype).removeprefix("torch.")
    meta["flops"] = row.flops
    return meta
