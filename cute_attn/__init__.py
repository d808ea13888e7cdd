"""cute_attn: exact FlashAttention kernels in the CuTe DSL for Hopper (SM90) and Blackwell.

Public API (every entry point returns `(out, lse)`):
    flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, merge_attn_states,
    last_dispatch, last_backward_dispatch (process-wide: autograd runs backward on its own
    threads)

Layout is (batch, seq, heads, dim) -- NOT SDPA's (batch, heads, seq, dim); a transposed input
of compatible sizes cannot always be detected. See docs/contract.md.

Attributes load lazily so that `python -m cute_attn --help` and the cache module do not pay
for importing torch.
"""

__version__ = "0.1.0"

_API = {
    "flash_attn_func": "api",
    "flash_attn_varlen_func": "api",
    "flash_attn_with_kvcache": "api",
    "last_dispatch": "dispatch",
    "last_backward_dispatch": "dispatch",
    "merge_attn_states": "inference",
}

__all__ = ["__version__", *_API]


def __getattr__(name):
    if name in _API:
        import importlib

        value = getattr(importlib.import_module(f".{_API[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cute_attn' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
