"""The normalized description of one attention call.

Validation (cute_attn.validation) turns user arguments into an `AttnProblem`; dispatch reads
it to pick an implementation; the kernel runners read it to build a compile key. It holds
plain values only (no tensors), so it is cheap to log and safe to put in a key.

Window convention after normalization: `window_left` / `window_right` are ints, -1 meaning
unbounded on that side. `causal=True` is folded in as `window_right = 0` intersected with the
user's right bound, so downstream code has one mask rule (see reference.visible_mask):

    key j is visible to query i  iff  i + Sk - Sq - left <= j <= i + Sk - Sq + right
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttnProblem:
    # sizes (batch and sequence lengths are runtime values, never compile-key material)
    batch: int
    seqlen_q: int  # max_seqlen_q for varlen
    seqlen_k: int  # max_seqlen_k for varlen (logical, after paging)
    num_heads: int
    num_heads_kv: int
    head_dim: int
    head_dim_v: int
    # dtypes as strings ("bfloat16", "float16", "float32", "float64") and device type
    dtype: str
    device_type: str  # "cuda" or "cpu"
    device_index: int | None
    # semantics
    softmax_scale: float
    causal: bool
    window_left: int  # -1 = unbounded
    window_right: int  # -1 = unbounded; causal folds into 0
    softcap: float  # 0.0 = off
    # layout features
    varlen: bool = False
    has_seqused_q: bool = False
    has_seqused_k: bool = False
    paged: bool = False
    page_size: int = 0
    kvcache: bool = False  # flash_attn_with_kvcache (cache append / decode), not plain dense
    # execution knobs
    num_splits: int = 0  # 0 = let the tuning table decide
    pack_gqa: bool | None = None
    deterministic: bool = False

    @property
    def qhead_per_kvhead(self) -> int:
        return self.num_heads // self.num_heads_kv

    @property
    def is_local(self) -> bool:
        """A window that is not just the causal corner."""
        return self.window_left >= 0 or (self.window_right >= 0 and not self.causal)

    @property
    def has_window(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0


def normalize_window(causal: bool, window_size) -> tuple[int, int]:
    """(left, right) as ints with -1 = unbounded; causal intersects right with 0.

    `window_size` entries may be None or -1 (unbounded) or a non-negative int. Type and range
    checks live in cute_attn.validation; this only normalizes already-valid values.
    """
    left, right = window_size
    left = -1 if left is None or left < 0 else int(left)
    right = -1 if right is None or right < 0 else int(right)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right
