"""Argument validation for the public cute_attn entry points.

What: `validate_dense`, `validate_varlen` and `validate_kvcache` check a call's arguments before
anything else runs and return the normalized `AttnProblem` (cute_attn.problem). Every failure is
a ValueError (bad value or shape) or a TypeError (bad type or dtype) whose message starts with
the argument's name and says what was expected and what was given. Nothing is silently
truncated, broadcast or reinterpreted.

LAYOUT HAZARD -- cute_attn expects (batch, seqlen, num_heads, head_dim), NOT the
(batch, num_heads, seqlen, head_dim) layout of torch's scaled_dot_product_attention. A tensor in
the wrong layout has the same rank and, e.g. for self-attention without GQA (q, k, v all
(B, H, S, D)), perfectly consistent shapes: validation CANNOT detect that case, and the result
is attention over heads instead of positions, silently wrong. Where the mix-up does make shapes
inconsistent (a head-count or per-tensor mismatch that swapping dims 1 and 2 would explain),
the error carries the hint "did you pass (B, H, S, D)? cute_attn expects (B, S, H, D)".

Constraints and decisions:
  * Devices: all tensors on q's device, which must be "cuda" or "cpu". dtypes: q, k, v (and
    caches, new k/v, rotary cos/sin) share one float dtype; on CUDA only float16/bfloat16 (the
    GPU kernels serve nothing else -- fp32 inputs on CUDA are rejected, not upcast), on CPU
    (reference path) also float32/float64. Index tensors (cu_seqlens, seqused, page_table,
    cache_seqlens, cache_batch_idx) are int32, on q's device.
  * Sizes: batch, seqlen_q and seqlen_k may be 0 (empty output; with seqlen_k = 0 every row sees
    no key, so out = 0 and lse = -inf). num_heads, num_heads_kv, head_dim, head_dim_v, page_size
    must be >= 1, and num_heads must be a multiple of num_heads_kv.
  * Strides: q, k, v (and caches, cos/sin, index tensors) need stride(-1) == 1; other strides
    are free. Kernel-specific alignment, stride divisibility and head_dim limits are NOT checked
    here: cute_attn.dispatch checks them because they differ per kernel.
  * Scalars are python values: softmax_scale None or a finite number > 0 (default
    1/sqrt(head_dim)); causal / deterministic bools; window_size None or a 2-sequence of None /
    int >= -1 (-1 and None = unbounded); softcap a finite number >= 0 (0 = off); num_splits an
    int >= 0 (0 = auto); pack_gqa None or bool. bools are not accepted as numbers, tensors are
    not accepted as scalars (reading them would need a device sync).

Cost: the dense path does attribute reads and python comparisons only (no tensor ops, no device
sync; a few microseconds). varlen and kvcache must look at index *values* (cu_seqlens, seqused,
page_table, cache_seqlens, cache_batch_idx): `validate_varlen_deferred` /
`validate_kvcache_deferred` return those checks unread as a `ValueCheck`. Read at once
(`validate_varlen` / `validate_kvcache`, the reference path, appends and rotary) they gather the
values into one tensor and read it with one `.tolist()`, ONE host sync before the launch. A
kernel call instead `defer()`s them: one device launch flags bad rows (arch/common/index_check),
the flags travel to pinned memory behind it, the attention kernel is launched, and `wait()`
then reads the flags (still one sync per call, but after the launch, so the stream never
drains ahead of the kernel; a set flag reruns the synchronous checks to name the bad entry).
The checks are skipped (only shapes, dtypes and devices are checked) where reading values is
impossible: under torch.compile tracing, during CUDA graph capture, and for fake tensors; and
everywhere with CUTE_ATTN_CHECK_VALUES=0 (eager loops that vouch for their index tensors and
cannot afford any sync).

Run the tests: python -m pytest tests/test_validation.py -q
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import threading

import torch

from cute_attn.problem import AttnProblem, normalize_window

__all__ = [
    "validate_dense",
    "validate_varlen",
    "validate_varlen_deferred",
    "validate_varlen_static",
    "validate_kvcache",
    "validate_kvcache_deferred",
    "validate_kvcache_static",
]

_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CUDA_DTYPES = (torch.float16, torch.bfloat16)
_BSHD_HINT = "did you pass (B, H, S, D)? cute_attn expects (B, S, H, D)"
_PAGED_HINT = (
    "did you pass (num_pages, num_heads_kv, page_size, head_dim)? "
    "cute_attn expects (num_pages, page_size, num_heads_kv, head_dim)"
)

# A dims spec is a tuple of (label, expected size or None for free, where the expectation comes
# from, e.g. "q's batch"); the expected shape in messages reads (batch=2, seqlen_k, ...).
_Dims = tuple


# --------------------------------------------------------------------------------------------
# small shared checks (the happy path of each is a couple of attribute reads and comparisons)
# --------------------------------------------------------------------------------------------


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a torch.Tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    text = repr(x)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(x).__name__} {text}"


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {_describe(t)}")


def _check_bool(name: str, x) -> bool:
    if x is not True and x is not False:
        raise TypeError(f"{name}: expected a bool, got {_describe(x)}")
    return x


def _check_int(name: str, x, minimum: int) -> int:
    """A python (or numpy) integer >= minimum; bools and tensors are rejected."""
    if type(x) is not int:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            extra = " (pass a python int, not a tensor)" if isinstance(x, torch.Tensor) else ""
            raise TypeError(f"{name}: expected a python int, got {_describe(x)}{extra}")
        x = int(x)
    if x < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {x}")
    return x


def _check_real(name: str, x) -> float:
    """A python (or numpy) real number; bools and tensors (even 0-dim) are rejected."""
    if type(x) is float or type(x) is int:
        return float(x)
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        extra = (
            " (0-dim tensors are not accepted: reading one needs a device sync; pass float(t))"
            if isinstance(x, torch.Tensor)
            else ""
        )
        raise TypeError(f"{name}: expected a python float, got {_describe(x)}{extra}")
    return float(x)


def _fmt_dims(dims: _Dims) -> str:
    parts = [label if want is None else f"{label}={want}" for label, want, _ in dims]
    return "(" + ", ".join(parts) + (",)" if len(parts) == 1 else ")")


def _dims_match(shape, dims: _Dims) -> bool:
    if len(shape) != len(dims):
        return False
    for got, (_, want, _) in zip(shape, dims):
        if want is not None and got != want:
            return False
    return True


def _check_shape(name: str, t: torch.Tensor, dims: _Dims, hint: str | None = None) -> None:
    """t's shape must match dims; `hint` is appended when swapping dims 1 and 2 would fit."""
    shape = t.shape
    if _dims_match(shape, dims):
        return
    got = tuple(int(s) for s in shape)
    if len(shape) != len(dims):
        msg = f"{name}: expected a {len(dims)}-D tensor {_fmt_dims(dims)}, got {len(shape)}-D {got}"
    else:
        why = [
            f"{label} is {g} but must equal {src} {want}"
            for g, (label, want, src) in zip(got, dims)
            if want is not None and g != want
        ]
        msg = f"{name}: expected shape {_fmt_dims(dims)}, got {got}: " + "; ".join(why)
        if hint is not None and len(shape) >= 3:
            swapped = (got[0], got[2], got[1]) + got[3:]
            if _dims_match(swapped, dims):
                msg += f" ({hint})"
    raise ValueError(msg)


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (q's device), got {t.device}")


def _main_device(q: torch.Tensor) -> torch.device:
    device = q.device
    if device.type != "cuda" and device.type != "cpu":
        raise ValueError(
            f"q: expected a CUDA tensor (GPU kernels) or a CPU tensor (reference path), "
            f"got device {device}"
        )
    return device


def _check_float_dtypes(q: torch.Tensor, device: torch.device, others) -> str:
    """q's dtype must be served on its device; every (name, tensor) in others must match it."""
    dtype = q.dtype
    if device.type == "cuda":
        if dtype not in _CUDA_DTYPES:
            raise TypeError(
                f"q: dtype {dtype} is not supported on CUDA: the GPU kernels serve only "
                f"torch.float16 and torch.bfloat16 (fp32/fp64 inputs on CUDA are not served by "
                f"kernels; cast to bf16/fp16, or use CPU tensors for the reference path, which "
                f"also accepts float32 and float64)"
            )
    elif dtype not in _CPU_DTYPES:
        raise TypeError(
            f"q: expected a float dtype (torch.float16, torch.bfloat16, torch.float32 or "
            f"torch.float64 on CPU), got {dtype}"
        )
    for name, t in others:
        if t.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype} (same as q), got {t.dtype}")
    return str(dtype).removeprefix("torch.")


def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected a contiguous last dim (stride(-1) == 1), got strides "
            f"{tuple(t.stride())} for shape {tuple(t.shape)}; call {name}.contiguous() first"
        )


def _check_index_tensor(name: str, t, dims: _Dims, device: torch.device) -> None:
    """An int32 index tensor (cu_seqlens, seqused, page_table, ...) on q's device."""
    _check_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    _check_shape(name, t, dims)
    _check_device(name, t, device)
    if t.dim() > 0 and t.stride(-1) != 1:
        _check_last_dim_contiguous(name, t)


def _check_heads_and_dims(
    num_heads, num_heads_kv, head_dim, head_dim_v, where: tuple[str, str], hint: str | None
) -> None:
    """Sizes that must be >= 1 and the GQA ratio. `where` names the dims, e.g. q.shape[2]."""
    q_where, k_where = where
    if num_heads < 1:
        raise ValueError(f"q: num_heads ({q_where}) must be >= 1, got {num_heads}")
    if num_heads_kv < 1:
        raise ValueError(f"k: num_heads_kv ({k_where}) must be >= 1, got {num_heads_kv}")
    if num_heads % num_heads_kv != 0:
        msg = (
            f"q, k: num_heads ({q_where} = {num_heads}) must be a multiple of num_heads_kv "
            f"({k_where} = {num_heads_kv})"
        )
        raise ValueError(msg + (f" ({hint})" if hint else ""))
    if head_dim < 1:
        raise ValueError(f"q: head_dim (last dim) must be >= 1, got {head_dim}")
    if head_dim_v < 1:
        raise ValueError(f"v: head_dim_v (last dim) must be >= 1, got {head_dim_v}")


def _bshd_hint(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """The (B, H, S, D) hint for a failed head check, when a dims-1/2 swap could explain it.

    Covers q and k both swapped (q.shape[1] % k.shape[1]), only q swapped
    (q.shape[1] % k.shape[2]) and only k swapped (q.shape[2] % k.shape[1]).
    """
    q1, q2, k1, k2 = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    for a, b in ((q1, k1), (q1, k2), (q2, k1)):
        if b > 0 and a > 0 and a % b == 0:
            return _BSHD_HINT
    return None


def _paged_hint(num_heads, page_size) -> str | None:
    # A (num_pages, Hkv, page_size, D) cache puts the head count where page_size belongs.
    return _PAGED_HINT if page_size > 0 and num_heads % page_size == 0 else None


def _free_dims(*labels: str) -> _Dims:
    return tuple((label, None, None) for label in labels)


def _window_entry(i: int, w) -> int:
    if w is None:
        return -1
    if type(w) is int and w >= -1:
        return w
    return _check_int(f"window_size[{i}]", w, -1)


def _check_knobs(head_dim, softmax_scale, causal, window_size, softcap, num_splits):
    """The scalar arguments shared by all entry points, resolved for AttnProblem."""
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        scale = _check_real("softmax_scale", softmax_scale)
        # comparisons, not math.isfinite: under torch.compile a float may be symbolic (NaN
        # fails both comparisons)
        if not (0.0 < scale < math.inf):
            raise ValueError(f"softmax_scale: expected None or a finite float > 0, got {scale}")
    _check_bool("causal", causal)
    if window_size is None:
        window = (-1, -1)
    else:
        if not isinstance(window_size, (tuple, list)):
            raise TypeError(
                f"window_size: expected a (left, right) tuple of None/int, got "
                f"{_describe(window_size)}"
            )
        if len(window_size) != 2:
            raise ValueError(
                f"window_size: expected 2 entries (left, right), got {len(window_size)}: "
                f"{tuple(window_size)!r}"
            )
        window = (_window_entry(0, window_size[0]), _window_entry(1, window_size[1]))
    left, right = normalize_window(causal, window)
    cap = _check_real("softcap", softcap)
    if not (0.0 <= cap < math.inf):
        raise ValueError(f"softcap: expected a finite float >= 0 (0 = off), got {cap}")
    splits = _check_int("num_splits", num_splits, 0)
    return scale, left, right, cap, splits


def _check_pack_gqa(pack_gqa) -> bool | None:
    if pack_gqa is not None and pack_gqa is not True and pack_gqa is not False:
        raise TypeError(f"pack_gqa: expected None or a bool, got {_describe(pack_gqa)}")
    return pack_gqa


def value_checks_enabled() -> bool:
    """False when CUTE_ATTN_CHECK_VALUES is 0 / false / off / no (read per call)."""
    flag = os.environ.get("CUTE_ATTN_CHECK_VALUES", "1").strip().lower()
    return flag not in ("0", "false", "off", "no")


def _can_read_values(t: torch.Tensor) -> bool:
    """Whether index values may be read on the host (one sync) right now."""
    if not value_checks_enabled():
        return False
    if torch.compiler.is_compiling():
        return False
    if _is_fake(t):
        return False
    if t.device.type == "cuda":
        # A CUDA tensor without a usable CUDA runtime can only be fake/meta-like.
        if not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
            return False
    return True


def _is_fake(t: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - private torch API moved
        return False
    return is_fake(t)


def _read_values(parts: list[torch.Tensor]) -> list[list[int]]:
    """All int32 pieces in one `.tolist()` (one host sync), split back per piece."""
    flat = torch.cat([p.reshape(-1) for p in parts]).tolist() if parts else []
    out, pos = [], 0
    for p in parts:
        n = p.numel()
        out.append(flat[pos : pos + n])
        pos += n
    return out


class ValueCheck:
    """Index-value checks of one call, not read yet.

    `wait()` alone builds the checks' torch pieces, reads them (one host sync) and raises what
    they find. `defer(flags_fn)` is for read-only kernel calls: it queues
    `flags_fn(*index_args)` (one device launch flagging bad rows, fwd_sm90.index_flags) and
    an asynchronous copy of the flags into pinned host memory, so the kernel launched next is
    already on the stream while the later `wait()` waits for the copy only. When a flag is set,
    `wait()` runs the synchronous checks to name the entry. Only for kernels that stay inside
    their tensors on any index value (the forward kernel clamps packed offsets and every length
    into its tensors, arch/common/seqlen.SeqInfo; its TMA loads fill out-of-range page or
    cache-row coordinates with zeros), so a bad value costs a discarded output and the same
    ValueError, not a fault."""

    def __init__(self, build, judge, index_args: tuple):
        self._build = build  # () -> list of int32 device tensors (the values judge reads)
        self._judge = judge  # per-piece value lists -> what the checks derive, or raises
        self.index_args = index_args  # fwd_sm90.index_flags' arguments
        self._flags: tuple | None = None  # (pinned flags, event, any_set) once deferred

    def defer(self, flags_fn) -> None:
        flags = flags_fn(*self.index_args)
        self._flags = _readback(flags)

    def wait(self) -> None:
        if self._flags is not None:
            pinned, event, any_set = self._flags
            event.synchronize()
            if not any_set(pinned):
                return
        self.read_now()

    def read_now(self):
        """Run the synchronous checks (one host sync); returns what they derive."""
        return self._judge(_read_values(self._build()))


# Each thread reuses one pinned buffer and one event per (device, stream, flag count): a check
# is deferred and waited within one entry call, so a thread's next call finds its buffer read;
# and should a call fail between the two, a later copy into that buffer is queued behind the
# unread one on the same stream. (A new pinned tensor, copy and event per call cost ~10 us of
# host; docs/perf/README.md, "KV-cache host fast path".)
_readbacks = threading.local()


def _readback(flags: torch.Tensor) -> tuple:
    """Queue the copy of device flags into this thread's pinned buffer and an event behind it;
    returns (pinned, event, any_set) for ValueCheck.wait."""
    pool = getattr(_readbacks, "pool", None)
    if pool is None:
        pool = _readbacks.pool = {}
    stream = torch.cuda.current_stream(flags.device)
    key = (flags.device.index, stream.cuda_stream, flags.shape[0])
    entry = pool.get(key)
    if entry is None:
        pinned = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        entry = pool[key] = (pinned, torch.cuda.Event(), _any_set_fn(pinned))
    pinned, event, _ = entry
    pinned.copy_(flags, non_blocking=True)
    event.record(stream)
    return entry


def _any_set_fn(pinned: torch.Tensor):
    """A fast "any flag set" reader of a pinned int32 buffer: its bytes against zeros through
    numpy (0.1 us), or torch's any() (4 us) without numpy."""
    try:
        view = pinned.numpy()
    except (ImportError, RuntimeError):  # torch built or installed without numpy
        return lambda t: bool(t.any())
    zeros = bytes(view.nbytes)
    return lambda t: view.tobytes() != zeros


_INT32_MAX = 2**31 - 1


def _bad_pages(
    page_table: torch.Tensor, lengths: torch.Tensor, page_size: int, num_pages: int
) -> torch.Tensor:
    """Mask of page_table entries that are used (page j < ceil(len_b / page_size)) but invalid.

    Entries past a sequence's last used page may hold anything (e.g. -1) and are not checked.
    """
    needed = (lengths.to(torch.int64) + (page_size - 1)) // page_size
    cols = torch.arange(page_table.shape[1], device=page_table.device)
    used = cols[None, :] < needed[:, None]
    return used & ((page_table < 0) | (page_table >= num_pages))


def _count(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum().to(torch.int32).reshape(1)


def _raise_bad_page(
    mask: torch.Tensor, page_table: torch.Tensor, page_size: int, num_pages: int, length_of
) -> None:
    # Error path only: a second sync to point at the first offending entry.
    b, j = mask.nonzero()[0].tolist()
    value = int(page_table[b, j].item())
    raise ValueError(
        f"page_table: entry [{b}, {j}] = {value} is not a page index in [0, num_pages = "
        f"{num_pages}); sequence {b} has {length_of(b)} keys, so its first "
        f"ceil({length_of(b)} / page_size {page_size}) pages must be valid"
    )


def _check_cu_seqlens(name: str, vals: list[int], total: int | None, total_src: str) -> list[int]:
    """First 0, nondecreasing, last == total (if given); returns the per-sequence lengths."""
    if vals[0] != 0:
        raise ValueError(f"{name}: first element must be 0, got {vals[0]}")
    for i in range(1, len(vals)):
        if vals[i] < vals[i - 1]:
            raise ValueError(
                f"{name}: must be nondecreasing, but {name}[{i}] = {vals[i]} < "
                f"{name}[{i - 1}] = {vals[i - 1]}"
            )
    if total is not None and vals[-1] != total:
        raise ValueError(f"{name}: last element must equal {total_src} = {total}, got {vals[-1]}")
    return [b - a for a, b in zip(vals, vals[1:])]


def _check_seqused(name: str, used: list[int], limits: list[int], limit_src: str) -> None:
    for b, (u, lim) in enumerate(zip(used, limits)):
        if u < 0 or u > lim:
            raise ValueError(f"{name}: {name}[{b}] = {u} must be in [0, {lim}] ({limit_src})")


def _check_max_seqlen(name: str, given: int | None, lengths: list[int], src: str) -> int:
    longest = max(lengths, default=0)
    if given is None:
        return longest
    if given < longest:
        b = lengths.index(longest)
        raise ValueError(
            f"{name}: expected >= the longest sequence ({longest}, sequence {b} of {src}), "
            f"got {given}"
        )
    return given


# --------------------------------------------------------------------------------------------
# public validators
# --------------------------------------------------------------------------------------------


def validate_dense(
    q, k, v, *, softmax_scale, causal, window_size, softcap, num_splits, pack_gqa, deterministic
) -> AttnProblem:
    """Validate a dense call: q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv).

    No tensor ops and no device sync: only attribute reads and python comparisons.
    """
    _check_tensor("q", q)
    _check_tensor("k", k)
    _check_tensor("v", v)
    device = _main_device(q)
    _check_device("k", k, device)
    _check_device("v", v, device)
    dtype = _check_float_dtypes(q, device, (("k", k), ("v", v)))
    # Fast path: plain comparisons; the dims specs (for the messages) are built only on failure.
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) != 4:
        _check_shape("q", q, _free_dims("batch", "seqlen_q", "num_heads", "head_dim"))
    batch, seqlen_q, num_heads, head_dim = qs
    if len(ks) != 4 or ks[0] != batch or ks[3] != head_dim:
        k_dims = (
            ("batch", batch, "q's batch"),
            ("seqlen_k", None, None),
            ("num_heads_kv", None, None),
            ("head_dim", head_dim, "q's head_dim"),
        )
        _check_shape("k", k, k_dims, _BSHD_HINT)
    seqlen_k, num_heads_kv = ks[1], ks[2]
    if len(vs) != 4 or vs[0] != batch or vs[1] != seqlen_k or vs[2] != num_heads_kv:
        v_dims = (
            ("batch", batch, "q's batch"),
            ("seqlen_k", seqlen_k, "k's seqlen_k"),
            ("num_heads_kv", num_heads_kv, "k's num_heads_kv"),
            ("head_dim_v", None, None),
        )
        _check_shape("v", v, v_dims, _BSHD_HINT)
    head_dim_v = vs[3]
    if num_heads < 1 or num_heads_kv < 1 or num_heads % num_heads_kv != 0 or head_dim < 1:
        hint = _bshd_hint(q, k)
        where = ("q.shape[2]", "k.shape[2]")
        _check_heads_and_dims(num_heads, num_heads_kv, head_dim, head_dim_v, where, hint)
    if head_dim_v < 1:
        raise ValueError(f"v: head_dim_v (last dim) must be >= 1, got {head_dim_v}")
    _check_last_dim_contiguous("q", q)
    _check_last_dim_contiguous("k", k)
    _check_last_dim_contiguous("v", v)
    scale, left, right, cap, splits = _check_knobs(
        head_dim, softmax_scale, causal, window_size, softcap, num_splits
    )
    return AttnProblem(
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        num_heads=num_heads,
        num_heads_kv=num_heads_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=dtype,
        device_type=device.type,
        device_index=device.index,
        softmax_scale=scale,
        causal=causal,
        window_left=left,
        window_right=right,
        softcap=cap,
        num_splits=splits,
        pack_gqa=_check_pack_gqa(pack_gqa),
        deterministic=_check_bool("deterministic", deterministic),
    )


@dataclasses.dataclass(frozen=True)
class VarlenValues:
    """What a varlen call's index-value checks need besides the index tensors: plain values,
    a pure function of the call's signature (so the entry's memo can keep it and build the
    next call's `ValueCheck` without validating again). max_seqlen_q / max_seqlen_k None:
    the checks derive them (and return them from `ValueCheck.read_now`)."""

    batch: int
    total_q: int
    total_k: int | None  # k.shape[0] (packed keys); None when paged
    capacity: int  # keys a sequence may hold: max_pages * page_size, or total_k
    page_size: int  # 1 when not paged
    num_pages: int  # 0 when not paged
    paged: bool
    max_seqlen_q: int | None
    max_seqlen_k: int | None

    def check(self, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table) -> ValueCheck:
        """The checks of these index tensors' values (those of the call validated), unread."""
        c = self
        pieces = {}

        def build() -> list[torch.Tensor]:
            parts = [cu_seqlens_q]
            for t in (cu_seqlens_k, seqused_q, seqused_k):
                if t is not None:
                    parts.append(t)
            if c.paged:
                if seqused_k is not None:
                    lengths_k_dev = seqused_k
                else:
                    lengths_k_dev = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
                pieces["bad"] = _bad_pages(page_table, lengths_k_dev, c.page_size, c.num_pages)
                parts.append(_count(pieces["bad"]))
            return parts

        def judge(values: list[list[int]]) -> tuple[int, int]:
            vals = iter(values)
            lens_q = _check_cu_seqlens(
                "cu_seqlens_q", next(vals), c.total_q, "q.shape[0] (total_q)"
            )
            lens_k = None
            if cu_seqlens_k is not None:
                lens_k = _check_cu_seqlens(
                    "cu_seqlens_k", next(vals), c.total_k, "k.shape[0] (total_k)"
                )
                if c.paged:
                    for b, n in enumerate(lens_k):
                        if n > c.capacity:
                            raise ValueError(
                                f"cu_seqlens_k: sequence {b} has {n} keys, more than page_table "
                                f"holds (max_pages * page_size = {c.capacity})"
                            )
            used_q = next(vals) if seqused_q is not None else None
            used_k = next(vals) if seqused_k is not None else None
            if used_q is not None:
                _check_seqused(
                    "seqused_q", used_q, lens_q, "the cu_seqlens_q span of that sequence"
                )
            if used_k is not None:
                if lens_k is not None:
                    _check_seqused("seqused_k", used_k, lens_k, "the cu_seqlens_k span")
                else:
                    _check_seqused(
                        "seqused_k",
                        used_k,
                        [c.capacity] * c.batch,
                        "page_table capacity max_pages * page_size",
                    )
            mq = _check_max_seqlen("max_seqlen_q", c.max_seqlen_q, lens_q, "cu_seqlens_q")
            if lens_k is not None:
                mk = _check_max_seqlen("max_seqlen_k", c.max_seqlen_k, lens_k, "cu_seqlens_k")
            else:
                mk = _check_max_seqlen("max_seqlen_k", c.max_seqlen_k, used_k, "seqused_k")
            if c.paged and next(vals)[0] > 0:
                eff = used_k if used_k is not None else lens_k
                _raise_bad_page(
                    pieces["bad"], page_table, c.page_size, c.num_pages, lambda b: eff[b]
                )
            return mq, mk

        tensors = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, None, page_table)
        index_args = (
            c.batch, tensors, c.total_q, -1 if c.paged else c.total_k, c.capacity,
            c.max_seqlen_q, c.max_seqlen_k, 0, c.page_size, c.num_pages,
        )  # fmt: skip
        return ValueCheck(build, judge, index_args)


def validate_varlen_static(
    q,
    k,
    v,
    *,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q,
    seqused_k,
    page_table,
    softmax_scale,
    causal,
    window_size,
    softcap,
    num_splits,
    pack_gqa,
    deterministic,
) -> tuple[AttnProblem, ValueCheck | None]:
    """Validate a varlen call (sequences packed along dim 0).

    q (total_q, H, D). Without page_table: k (total_k, Hkv, D), v (total_k, Hkv, Dv), packed by
    cu_seqlens_k. With page_table (B, max_pages) int32: k (num_pages, page_size, Hkv, D),
    v (num_pages, page_size, Hkv, Dv); cu_seqlens_k is then optional (if given, its spans are
    the key lengths and its last element is not tied to k.shape[0]); without it seqused_k is
    required. batch = len(cu_seqlens_q) - 1.

    max_seqlen_q / max_seqlen_k: python ints >= the longest sequence, or None to take the
    longest (not possible under torch.compile / CUDA graph capture: pass them there).

    Returns (AttnProblem, VarlenValues or None): what the index-value checks need besides the
    index tensors, a pure function of the call's signature (the entry's memo keeps it; the
    caller builds a call's checks where values can be read, `_can_read_values`), or None
    when the values were read here (max_seqlen_q or max_seqlen_k None: the problem's
    lengths come from them).
    """
    paged = page_table is not None
    _check_tensor("q", q)
    _check_tensor("k", k)
    _check_tensor("v", v)
    device = _main_device(q)
    _check_device("k", k, device)
    _check_device("v", v, device)
    dtype = _check_float_dtypes(q, device, (("k", k), ("v", v)))
    if q.dim() == 4:
        raise ValueError(
            f"q: expected a 3-D tensor (total_q, num_heads, head_dim) with all sequences packed "
            f"along dim 0, got 4-D {tuple(q.shape)}; for (batch, seqlen, heads, dim) inputs "
            f"use the dense entry point"
        )
    _check_shape("q", q, _free_dims("total_q", "num_heads", "head_dim"))
    total_q, num_heads, head_dim = q.shape
    if paged:
        k_dims = (
            ("num_pages", None, None),
            ("page_size", None, None),
            ("num_heads_kv", None, None),
            ("head_dim", head_dim, "q's head_dim"),
        )
        _check_shape("k", k, k_dims, _PAGED_HINT)
        num_pages, page_size, num_heads_kv = k.shape[0], k.shape[1], k.shape[2]
        v_dims = (
            ("num_pages", num_pages, "k's num_pages"),
            ("page_size", page_size, "k's page_size"),
            ("num_heads_kv", num_heads_kv, "k's num_heads_kv"),
            ("head_dim_v", None, None),
        )
        _check_shape("v", v, v_dims, _PAGED_HINT)
        if page_size < 1:
            raise ValueError(f"k: page_size (k.shape[1]) must be >= 1, got {page_size}")
        k_heads_where, hint = "k.shape[2]", _paged_hint(num_heads, page_size)
    else:
        if k.dim() == 4:
            raise ValueError(
                f"k: expected a 3-D tensor (total_k, num_heads_kv, head_dim) packed by "
                f"cu_seqlens_k, got 4-D {tuple(k.shape)}; a paged KV cache "
                f"(num_pages, page_size, num_heads_kv, head_dim) needs page_table"
            )
        k_dims = (
            ("total_k", None, None),
            ("num_heads_kv", None, None),
            ("head_dim", head_dim, "q's head_dim"),
        )
        _check_shape("k", k, k_dims)
        total_k, num_heads_kv = k.shape[0], k.shape[1]
        v_dims = (
            ("total_k", total_k, "k's total_k"),
            ("num_heads_kv", num_heads_kv, "k's num_heads_kv"),
            ("head_dim_v", None, None),
        )
        _check_shape("v", v, v_dims)
        k_heads_where, hint = "k.shape[1]", None
    head_dim_v = v.shape[-1]
    _check_heads_and_dims(
        num_heads, num_heads_kv, head_dim, head_dim_v, ("q.shape[1]", k_heads_where), hint
    )
    _check_last_dim_contiguous("q", q)
    _check_last_dim_contiguous("k", k)
    _check_last_dim_contiguous("v", v)

    # index tensors: dtype, shape, device (no values yet)
    _check_index_tensor("cu_seqlens_q", cu_seqlens_q, _free_dims("batch + 1"), device)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q: expected at least 1 entry (batch + 1), got 0")
    batch = cu_seqlens_q.shape[0] - 1
    cu_dims = (("batch + 1", batch + 1, "len(cu_seqlens_q)"),)
    if cu_seqlens_k is not None:
        _check_index_tensor("cu_seqlens_k", cu_seqlens_k, cu_dims, device)
    elif not paged:
        raise ValueError(
            "cu_seqlens_k: required without page_table (it says where each sequence's keys "
            "start in k), got None"
        )
    b_dims = (("batch", batch, "len(cu_seqlens_q) - 1"),)
    if seqused_q is not None:
        _check_index_tensor("seqused_q", seqused_q, b_dims, device)
    if seqused_k is not None:
        _check_index_tensor("seqused_k", seqused_k, b_dims, device)
    if paged:
        pt_dims = (("batch", batch, "len(cu_seqlens_q) - 1"), ("max_pages", None, None))
        _check_index_tensor("page_table", page_table, pt_dims, device)
        if cu_seqlens_k is None and seqused_k is None:
            raise ValueError(
                "seqused_k: required when page_table is given without cu_seqlens_k (it gives "
                "each sequence's key count), got None"
            )
        capacity = page_table.shape[1] * page_size
    if max_seqlen_q is not None:
        max_seqlen_q = _check_int("max_seqlen_q", max_seqlen_q, 0)
    if max_seqlen_k is not None:
        max_seqlen_k = _check_int("max_seqlen_k", max_seqlen_k, 0)
    scale, left, right, cap, splits = _check_knobs(
        head_dim, softmax_scale, causal, window_size, softcap, num_splits
    )
    pack_gqa = _check_pack_gqa(pack_gqa)
    _check_bool("deterministic", deterministic)

    values = VarlenValues(
        batch=batch, total_q=total_q, total_k=None if paged else k.shape[0],
        capacity=capacity if paged else k.shape[0], page_size=page_size if paged else 1,
        num_pages=num_pages if paged else 0, paged=paged, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
    )  # fmt: skip
    if max_seqlen_q is None or max_seqlen_k is None:
        if not _can_read_values(q):
            name = "max_seqlen_q" if max_seqlen_q is None else "max_seqlen_k"
            raise ValueError(
                f"{name}: required (a python int) under torch.compile / CUDA graph "
                f"capture or with CUTE_ATTN_CHECK_VALUES=0, where the cu_seqlens values "
                f"are not read; got None"
            )
        # the problem's lengths come from the values: read them now
        index = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table)
        max_seqlen_q, max_seqlen_k = values.check(*index).read_now()
        values = None

    problem = AttnProblem(
        batch=batch,
        seqlen_q=max_seqlen_q,
        seqlen_k=max_seqlen_k,
        num_heads=num_heads,
        num_heads_kv=num_heads_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=dtype,
        device_type=device.type,
        device_index=device.index,
        softmax_scale=scale,
        causal=causal,
        window_left=left,
        window_right=right,
        softcap=cap,
        varlen=True,
        has_seqused_q=seqused_q is not None,
        has_seqused_k=seqused_k is not None,
        paged=paged,
        page_size=page_size if paged else 0,
        num_splits=splits,
        pack_gqa=pack_gqa,
        deterministic=deterministic,
    )
    return problem, values


def validate_varlen_deferred(q, k, v, **kwargs) -> tuple[AttnProblem, ValueCheck | None]:
    """Validate a varlen call (validate_varlen_static's arguments). Returns (AttnProblem,
    ValueCheck or None): the checks of the index values (cu_seqlens, seqused, used
    page_table entries), not read yet (see validate_kvcache_deferred; one host sync when
    read). With max_seqlen_q or max_seqlen_k None they are read here (the problem's lengths
    come from them) and None is returned; also None where values are not read
    (torch.compile, CUDA graph capture, fake tensors, CUTE_ATTN_CHECK_VALUES=0)."""
    problem, values = validate_varlen_static(q, k, v, **kwargs)
    if values is None or not _can_read_values(q):
        return problem, None
    index = [kwargs[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k",
                                 "page_table")]  # fmt: skip
    return problem, values.check(*index)


def validate_varlen(q, k, v, **kwargs) -> AttnProblem:
    """validate_varlen_deferred, with its value checks read at once (one host sync)."""
    problem, check = validate_varlen_deferred(q, k, v, **kwargs)
    if check is not None:
        check.wait()
    return problem


@dataclasses.dataclass(frozen=True)
class KvcacheValues:
    """What a KV-cache call's index-value checks need besides the index tensors: plain values,
    a pure function of the call's signature (so the entry's memo can keep it and build the
    next call's `ValueCheck` without validating again)."""

    batch: int
    seqlen_new: int
    capacity: int
    batch_cache: int  # k_cache.shape[0]: cache rows (dense) or pages (paged)
    page_size: int  # 1 when not paged
    num_pages: int  # 0 when not paged
    paged: bool
    seqlens_tensor: bool
    uniform_seqlens: int | None  # an int cache_seqlens
    batch_idx: bool
    append: bool

    def check(self, cache_seqlens, cache_batch_idx, page_table) -> ValueCheck:
        """The checks of these index tensors' values (those of the call validated), unread."""
        c = self
        pieces = {}

        def length_of(b: int, seqlens=None) -> int:
            if c.seqlens_tensor:
                return seqlens[b] + c.seqlen_new
            return c.capacity if c.uniform_seqlens is None else c.uniform_seqlens + c.seqlen_new

        def build() -> list[torch.Tensor]:
            parts = []
            if c.seqlens_tensor:
                parts.append(cache_seqlens)
            if c.batch_idx:
                parts.append(cache_batch_idx)
            if c.paged:
                if c.seqlens_tensor:
                    lengths_dev = cache_seqlens.to(torch.int64) + c.seqlen_new
                else:
                    lengths_dev = torch.full(
                        (c.batch,), length_of(0), dtype=torch.int64, device=page_table.device
                    )
                pieces["bad"] = _bad_pages(page_table, lengths_dev, c.page_size, c.num_pages)
                parts.append(_count(pieces["bad"]))
            return parts

        def judge(values: list[list[int]]) -> None:
            vals = iter(values)
            seqlens = None
            if c.seqlens_tensor:
                seqlens = next(vals)
                for b, n in enumerate(seqlens):
                    if n < 0 or n + c.seqlen_new > c.capacity:
                        raise ValueError(
                            f"cache_seqlens: cache_seqlens[{b}] = {n} must be in [0, capacity "
                            f"{c.capacity} - seqlen_new {c.seqlen_new}] (a larger value writes "
                            f"or reads past the cache)"
                        )
            if c.batch_idx:
                seen: dict[int, int] = {}
                for b, row in enumerate(next(vals)):
                    if row < 0 or row >= c.batch_cache:
                        raise ValueError(
                            f"cache_batch_idx: cache_batch_idx[{b}] = {row} is not a cache row "
                            f"in [0, batch_cache = {c.batch_cache})"
                        )
                    if c.append and row in seen:
                        raise ValueError(
                            f"cache_batch_idx: cache_batch_idx[{seen[row]}] and "
                            f"cache_batch_idx[{b}] are both {row}: appending k/v to one cache "
                            f"row from two batch rows is ambiguous"
                        )
                    seen[row] = b
            if c.paged and next(vals)[0] > 0:
                _raise_bad_page(
                    pieces["bad"], page_table, c.page_size, c.num_pages,
                    lambda b: length_of(b, seqlens),
                )  # fmt: skip

        # an int cache_seqlens is every row's length: it bounds the used pages as capacity
        bound = c.uniform_seqlens if c.uniform_seqlens is not None and c.paged else c.capacity
        tensors = (None, None, None, cache_seqlens if c.seqlens_tensor else None,
                   cache_batch_idx, page_table)  # fmt: skip
        index_args = (
            c.batch, tensors, 0, -1, bound, 0, _INT32_MAX, c.batch_cache, c.page_size,
            c.num_pages,
        )  # fmt: skip
        return ValueCheck(build, judge, index_args)


def validate_kvcache_static(
    q,
    k_cache,
    v_cache,
    k,
    v,
    *,
    cache_seqlens,
    cache_batch_idx,
    page_table,
    rotary_cos,
    rotary_sin,
    softmax_scale,
    causal,
    window_size,
    softcap,
    num_splits,
    pack_gqa=None,
) -> tuple[AttnProblem, ValueCheck | None]:
    """Validate a KV-cache (decode / append) call.

    q (B, Sq, H, D). Dense cache: k_cache (B_cache, S_cache, Hkv, D), v_cache (B_cache, S_cache,
    Hkv, Dv), B_cache == B unless cache_batch_idx (B,) int32 maps batch rows to cache rows.
    Paged cache: k_cache (num_pages, page_size, Hkv, D) etc. with page_table (B, max_pages) int32
    (cache_batch_idx is rejected: the page table already maps rows to memory). Capacity is
    S_cache, or max_pages * page_size when paged.

    k, v: new keys/values (B, S_new, Hkv, D[v]) appended at cache_seqlens, both or neither.
    cache_seqlens: int32 (B,), a python int for all rows, or None (= every cache full, so no
    append is possible). cache_seqlens + S_new > capacity is an error. cache_batch_idx must be in
    [0, B_cache) and, when k/v are appended, without duplicates (two rows writing one cache row
    would be ambiguous; duplicates are fine for read-only calls, e.g. a shared prefix).
    rotary_cos / rotary_sin: (seqlen_ro, rotary_dim / 2) both or neither, q's dtype,
    rotary_dim <= D, and seqlen_ro >= capacity (every position the cache can hold).

    Returns (AttnProblem, KvcacheValues or None). AttnProblem: seqlen_k is the capacity;
    has_seqused_k says cache_seqlens was given. Nothing here reads an index value: the
    KvcacheValues (None without an index tensor) builds the ValueCheck of the tensor
    cache_seqlens / cache_batch_idx / page_table values (`validate_kvcache_deferred`):
    `validate_kvcache` waits for it at once; a read-only kernel call may `defer()` it, launch,
    then `wait()` (the read no longer drains the stream before the launch).
    """
    paged = page_table is not None
    _check_tensor("q", q)
    _check_tensor("k_cache", k_cache)
    _check_tensor("v_cache", v_cache)
    if (k is None) != (v is None):
        raise ValueError(
            f"k, v: pass both new k and v or neither, got k={'None' if k is None else 'a tensor'}"
            f" and v={'None' if v is None else 'a tensor'}"
        )
    append = k is not None
    if append:
        _check_tensor("k", k)
        _check_tensor("v", v)
    device = _main_device(q)
    named = [("k_cache", k_cache), ("v_cache", v_cache)] + ([("k", k), ("v", v)] if append else [])
    for name, t in named:
        _check_device(name, t, device)
    dtype = _check_float_dtypes(q, device, named)

    _check_shape("q", q, _free_dims("batch", "seqlen_q", "num_heads", "head_dim"))
    batch, seqlen_q, num_heads, head_dim = q.shape
    if paged:
        kc_dims = (
            ("num_pages", None, None),
            ("page_size", None, None),
            ("num_heads_kv", None, None),
            ("head_dim", head_dim, "q's head_dim"),
        )
        _check_shape("k_cache", k_cache, kc_dims, _PAGED_HINT)
        vc_dims = (
            ("num_pages", k_cache.shape[0], "k_cache's num_pages"),
            ("page_size", k_cache.shape[1], "k_cache's page_size"),
            ("num_heads_kv", k_cache.shape[2], "k_cache's num_heads_kv"),
            ("head_dim_v", None, None),
        )
        _check_shape("v_cache", v_cache, vc_dims, _PAGED_HINT)
        num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
        if page_size < 1:
            raise ValueError(f"k_cache: page_size (k_cache.shape[1]) must be >= 1, got {page_size}")
        hint = _paged_hint(num_heads, page_size)
    else:
        kc_dims = (
            ("batch_cache", None, None),
            ("seqlen_cache", None, None),
            ("num_heads_kv", None, None),
            ("head_dim", head_dim, "q's head_dim"),
        )
        _check_shape("k_cache", k_cache, kc_dims, _BSHD_HINT)
        vc_dims = (
            ("batch_cache", k_cache.shape[0], "k_cache's batch_cache"),
            ("seqlen_cache", k_cache.shape[1], "k_cache's seqlen_cache"),
            ("num_heads_kv", k_cache.shape[2], "k_cache's num_heads_kv"),
            ("head_dim_v", None, None),
        )
        _check_shape("v_cache", v_cache, vc_dims, _BSHD_HINT)
        batch_cache, capacity = k_cache.shape[0], k_cache.shape[1]
        hint = _bshd_hint(q, k_cache)
        if cache_batch_idx is None and batch_cache != batch:
            raise ValueError(
                f"k_cache: batch_cache (k_cache.shape[0] = {batch_cache}) must equal q's batch "
                f"{batch} when cache_batch_idx is not given"
            )
    num_heads_kv, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    _check_heads_and_dims(
        num_heads, num_heads_kv, head_dim, head_dim_v, ("q.shape[2]", "k_cache.shape[2]"), hint
    )
    seqlen_new = 0
    if append:
        k_dims = (
            ("batch", batch, "q's batch"),
            ("seqlen_new", None, None),
            ("num_heads_kv", num_heads_kv, "k_cache's num_heads_kv"),
            ("head_dim", head_dim, "q's head_dim"),
        )
        _check_shape("k", k, k_dims, _BSHD_HINT)
        seqlen_new = k.shape[1]
        v_dims = (
            ("batch", batch, "q's batch"),
            ("seqlen_new", seqlen_new, "k's seqlen_new"),
            ("num_heads_kv", num_heads_kv, "k_cache's num_heads_kv"),
            ("head_dim_v", head_dim_v, "v_cache's head_dim_v"),
        )
        _check_shape("v", v, v_dims, _BSHD_HINT)
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            # Appending writes into the cache: a broadcast (stride 0) dim would alias rows.
            for size, stride in zip(t.shape, t.stride()):
                if stride == 0 and size > 1:
                    raise ValueError(
                        f"{name}: is written in place (k/v given) but has a broadcast "
                        f"(stride 0) dim: strides {tuple(t.stride())}; pass a real tensor "
                        f"({name}.contiguous())"
                    )
    for name, t in [("q", q)] + named:
        _check_last_dim_contiguous(name, t)

    if paged:
        if cache_batch_idx is not None:
            raise ValueError(
                "cache_batch_idx: not supported with page_table (the page table already maps "
                "each batch row to its pages); got a tensor"
            )
        pt_dims = (("batch", batch, "q's batch"), ("max_pages", None, None))
        _check_index_tensor("page_table", page_table, pt_dims, device)
        capacity = page_table.shape[1] * page_size
    elif cache_batch_idx is not None:
        _check_index_tensor(
            "cache_batch_idx", cache_batch_idx, (("batch", batch, "q's batch"),), device
        )

    seqlens_tensor = isinstance(cache_seqlens, torch.Tensor)
    if cache_seqlens is None:
        if seqlen_new > 0:
            raise ValueError(
                f"cache_seqlens: None means every cache is full (capacity {capacity}), so "
                f"appending {seqlen_new} new keys would write past capacity; pass cache_seqlens"
            )
    elif seqlens_tensor:
        _check_index_tensor(
            "cache_seqlens", cache_seqlens, (("batch", batch, "q's batch"),), device
        )
    else:
        cache_seqlens = _check_int("cache_seqlens", cache_seqlens, 0)
        if cache_seqlens + seqlen_new > capacity:
            raise ValueError(
                f"cache_seqlens: {cache_seqlens} + seqlen_new {seqlen_new} (k.shape[1]) "
                f"= {cache_seqlens + seqlen_new} writes past the cache capacity {capacity}"
            )

    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(
            "rotary_cos, rotary_sin: pass both or neither, got "
            f"rotary_cos={'None' if rotary_cos is None else 'a tensor'} and "
            f"rotary_sin={'None' if rotary_sin is None else 'a tensor'}"
        )
    if rotary_cos is not None:
        if not append:
            # FlashAttention silently ignores rotary without new keys; q's positions would be
            # ambiguous then (the cache already holds them), so say so instead.
            raise ValueError(
                "rotary_cos: rotary embedding rotates q and the new k at their cache positions "
                "and needs new k/v; pass k and v, or rotate q yourself and drop rotary_cos/sin"
            )
        _check_tensor("rotary_cos", rotary_cos)
        ro_dims = (("seqlen_ro", None, None), ("rotary_dim / 2", None, None))
        _check_shape("rotary_cos", rotary_cos, ro_dims)
        seqlen_ro, half = rotary_cos.shape
        ro_dims = (
            ("seqlen_ro", seqlen_ro, "rotary_cos's seqlen_ro"),
            ("rotary_dim / 2", half, "rotary_cos's rotary_dim / 2"),
        )
        _check_tensor("rotary_sin", rotary_sin)
        _check_shape("rotary_sin", rotary_sin, ro_dims)
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _check_device(name, t, device)
            if t.dtype != q.dtype:
                raise TypeError(f"{name}: expected dtype {q.dtype} (same as q), got {t.dtype}")
            _check_last_dim_contiguous(name, t)
        if half < 1 or 2 * half > head_dim:
            raise ValueError(
                f"rotary_cos: rotary_dim = 2 * rotary_cos.shape[1] = {2 * half} must be in "
                f"[2, head_dim = {head_dim}]"
            )
        if seqlen_ro < capacity:
            raise ValueError(
                f"rotary_cos: seqlen_ro (rotary_cos.shape[0] = {seqlen_ro}) must cover every "
                f"cache position, i.e. be >= the cache capacity {capacity}"
            )

    scale, left, right, cap, splits = _check_knobs(
        head_dim, softmax_scale, causal, window_size, softcap, num_splits
    )

    spec = None
    if seqlens_tensor or cache_batch_idx is not None or paged:
        spec = KvcacheValues(
            batch=batch, seqlen_new=seqlen_new, capacity=capacity,
            batch_cache=k_cache.shape[0], page_size=page_size if paged else 1,
            num_pages=num_pages if paged else 0, paged=paged, seqlens_tensor=seqlens_tensor,
            uniform_seqlens=cache_seqlens if isinstance(cache_seqlens, int) else None,
            batch_idx=cache_batch_idx is not None, append=append,
        )  # fmt: skip

    problem = AttnProblem(
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=capacity,
        num_heads=num_heads,
        num_heads_kv=num_heads_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=dtype,
        device_type=device.type,
        device_index=device.index,
        softmax_scale=scale,
        causal=causal,
        window_left=left,
        window_right=right,
        softcap=cap,
        has_seqused_k=cache_seqlens is not None,
        paged=paged,
        page_size=page_size if paged else 0,
        kvcache=True,
        num_splits=splits,
        pack_gqa=_check_pack_gqa(pack_gqa),
    )
    return problem, spec


def validate_kvcache_deferred(
    q, k_cache, v_cache, k, v, **kwargs
) -> tuple[AttnProblem, ValueCheck | None]:
    """validate_kvcache_static, with the ValueCheck of this call's index tensors (unread), or
    None where values cannot or need not be read (torch.compile, CUDA graph capture, fake
    tensors, CUTE_ATTN_CHECK_VALUES=0, no index tensor)."""
    problem, spec = validate_kvcache_static(q, k_cache, v_cache, k, v, **kwargs)
    if spec is None or not _can_read_values(q):
        return problem, None
    values = (kwargs["cache_seqlens"], kwargs["cache_batch_idx"], kwargs["page_table"])
    return problem, spec.check(*values)


def validate_kvcache(q, k_cache, v_cache, k, v, **kwargs) -> AttnProblem:
    """validate_kvcache_deferred, with its value checks read at once.

    HOST SYNC: tensor cache_seqlens / cache_batch_idx / page_table values are checked with one
    `.tolist()` per call; skipped under torch.compile, CUDA graph capture and fake tensors."""
    problem, check = validate_kvcache_deferred(q, k_cache, v_cache, k, v, **kwargs)
    if check is not None:
        check.wait()
    return problem
