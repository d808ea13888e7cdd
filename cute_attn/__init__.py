"""cute_attn: exact FlashAttention kernels in the CuTe DSL for Hopper (SM90) and Blackwell.

Public API (every entry point returns `(out, lse)`):
    flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, last_dispatch

Layout is (batch, seq, heads, dim) -- NOT SDPA's (batch, heads, seq, dim); a transposed input
of compatible sizes cannot always be detected. See docs/contract.md.
"""

__version__ = "0.1.0"

from .api import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .dispatch import last_dispatch

__all__ = [
    "__version__",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "last_dispatch",
]
