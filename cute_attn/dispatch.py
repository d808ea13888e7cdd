"""Dispatch: which implementation serves a call, and why. The only reader of device capability.

Policy
------
* A CUDA input that a kernel serves runs the kernel.
* A CUDA input that no kernel serves raises `NotImplementedError` naming the reason, unless
  the caller opted into the memory-bounded reference with `fallback="reference"` (argument) or
  `CUTE_ATTN_FALLBACK=reference` (environment). The fallback warns once per reason.
* CPU inputs always run the reference (any float dtype), so the API works everywhere.

Every decision is recorded (`last_dispatch()`, thread-local) and logged at DEBUG on the
"cute_attn" logger (NullHandler by default; `CUTE_ATTN_LOG_LEVEL=DEBUG` adds a console
handler).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import warnings

from .problem import AttnProblem

logger = logging.getLogger("cute_attn")
logger.addHandler(logging.NullHandler())
if os.environ.get("CUTE_ATTN_LOG_LEVEL"):
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("[cute_attn %(levelname)s] %(message)s"))
    logger.addHandler(_h)
    logger.setLevel(os.environ["CUTE_ATTN_LOG_LEVEL"].upper())

FALLBACK_CHOICES = (None, "error", "reference")


@dataclasses.dataclass(frozen=True)
class Decision:
    impl: str  # "sm90_fwd" | "sm90_bwd" | "reference" | "none"
    arch: str | None  # "sm_90a", "sm_100a", ... or None on CPU
    reason: str
    entry: str = "flash_attn_func"


_local = threading.local()


def last_dispatch() -> Decision | None:
    """The decision of the most recent call on this thread (None before any call)."""
    return getattr(_local, "decision", None)


_backward_lock = threading.Lock()
_last_backward: Decision | None = None


def last_backward_dispatch() -> Decision | None:
    """The decision of the most recent backward in this process (None before any).

    Process-wide, not thread-local: autograd runs CUDA backward passes on its own worker
    threads, where the caller's `last_dispatch()` cannot see them."""
    with _backward_lock:
        return _last_backward


def _record(d: Decision) -> Decision:
    global _last_backward
    if d.entry == "backward":
        with _backward_lock:
            _last_backward = d
    _local.decision = d
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s -> %s (%s): %s", d.entry, d.impl, d.arch, d.reason)
    return d


def replay(d: Decision) -> Decision:
    """Record again a decision made for an identical earlier call (the dense entry's host
    fast path skips validation and dispatch, not the record)."""
    return _record(d)


@functools.cache
def device_arch(index: int) -> str | None:
    """'sm_90a' for compute capability 9.0, 'sm_100a' for 10.x, else e.g. 'sm_80'."""
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) == (9, 0):
        return "sm_90a"
    if major == 10:
        return "sm_100a"
    return f"sm_{major}{minor}"


@functools.cache
def _sm90_unsupported_reason():
    # imported on first use: fwd_sm90 pulls in the compile cache and the tile table
    from .fwd_sm90 import unsupported_reason

    return unsupported_reason


def _sm90_route_note(p: AttnProblem) -> str:
    if not p.paged and p.num_heads == p.num_heads_kv:  # one route: nothing to add
        return ""
    from .fwd_sm90 import route_note

    return route_note(p)


def _fallback_mode(fallback: str | None) -> str:
    mode = fallback if fallback is not None else os.environ.get("CUTE_ATTN_FALLBACK", "error")
    if mode not in ("error", "reference"):
        raise ValueError(f"fallback: expected None, 'error' or 'reference', got {mode!r}")
    return mode


_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"cute_attn: running the slow reference path on CUDA because {reason}",
            RuntimeWarning,
            stacklevel=4,
        )


def select(
    p: AttnProblem, tensors, *, fallback: str | None = None, entry: str = "flash_attn_func"
) -> Decision:
    """Pick the implementation for a validated problem; raise if none serves it."""
    if p.device_type != "cuda":
        return _record(Decision("reference", None, "CPU tensors run the reference path", entry))
    arch = device_arch(p.device_index or 0)
    reason = None
    if arch == "sm_90a":
        reason = _sm90_unsupported_reason()(p, tensors)
        if reason is None:
            note = _sm90_route_note(p)
            return _record(Decision("sm90_fwd", arch, "SM90 forward kernel" + note, entry))
    else:
        reason = f"no cute_attn kernel for {arch} (kernels exist for sm_90a)"
    if _fallback_mode(fallback) == "reference":
        _warn_once(reason)
        return _record(Decision("reference", arch, f"fallback: {reason}", entry))
    _record(Decision("none", arch, reason, entry))
    raise NotImplementedError(
        f"cute_attn: no kernel serves this call on {arch}: {reason}. Pass "
        "fallback='reference' (or set CUTE_ATTN_FALLBACK=reference) to run the slow, "
        "memory-bounded reference instead."
    )


def select_backward(p: AttnProblem, tensors, unsupported_reason, kernel_note=None) -> Decision:
    """The backward of a call whose forward already ran. The SM90 backward kernel when
    `unsupported_reason(p, tensors)` is None; otherwise the exact reference backward, with a
    one-time warning (raising here, after a forward that succeeded, would strand a training
    step; the choice is recorded like any other). `kernel_note(p)`, when given, returns what
    the served reason adds about the variant that runs (or None)."""
    entry = "backward"
    if p.device_type != "cuda":
        return _record(Decision("reference", None, "CPU tensors run the reference path", entry))
    arch = device_arch(p.device_index or 0)
    if arch == "sm_90a":
        reason = unsupported_reason(p, tensors)
        if reason is None:
            note = kernel_note(p) if kernel_note is not None else None
            served = "SM90 backward kernel" + (f" ({note})" if note else "")
            return _record(Decision("sm90_bwd", arch, served, entry))
    else:
        reason = f"no cute_attn backward kernel for {arch}"
    _warn_once(f"the backward kernel does not serve this call ({reason})")
    return _record(Decision("reference", arch, f"fallback: {reason}", entry))


def support_summary() -> dict:
    """What this machine's default device gets: for `python -m cute_attn info`."""
    try:
        import torch

        if not torch.cuda.is_available():
            return {
                "device": None,
                "arch": None,
                "kernels": [],
                "reason": "no CUDA device: the reference path serves CPU tensors",
            }
        idx = torch.cuda.current_device()
        arch = device_arch(idx)
        name = torch.cuda.get_device_name(idx)
    except Exception as e:  # a broken driver should not break `info`
        return {"device": None, "arch": None, "kernels": [], "reason": f"CUDA query failed: {e}"}
    if arch == "sm_90a":
        kernels = ["sm90_fwd", "sm90_bwd"]
        return {"device": name, "arch": arch, "kernels": kernels, "reason": "SM90 kernels"}
    return {
        "device": name,
        "arch": arch,
        "kernels": [],
        "reason": f"no cute_attn kernel for {arch}; reference only with fallback='reference'",
    }
