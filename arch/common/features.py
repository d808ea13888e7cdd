"""Which optional inputs a forward kernel variant takes: `InputFeatures`, part of the compile key.

Plain Python (no cutlass, no torch): the host layer builds keys from it on every call, and a
disk-cache hit must not pay the DSL's import (about 0.6 s) to do so.
"""

from __future__ import annotations

import dataclasses

__all__ = ["InputFeatures"]


@dataclasses.dataclass(frozen=True)
class InputFeatures:
    """Which optional inputs a forward kernel variant takes (presence specializes; values are
    runtime)."""

    cu_seqlens_q: bool = False  # q / out / lse packed (total_q, ...)
    cu_seqlens_k: bool = False  # k / v packed (total_k, ...)
    # query rows used per sequence (packed q): rows past it are not computed and not written
    # (the host fills them with out 0 / lse -inf)
    seqused_q: bool = False
    seqused_k: bool = False  # keys used per batch row (KV cache lengths)
    kv_batch_idx: bool = False  # batch row b reads cache row kv_batch_idx[b]
    split_kv: bool = False  # CTAs split the key range; fp32 partial out / lse per split
    # k / v are (num_pages, page_size, heads, dim); key tile n of batch row b is read from page
    # page_table[b, n // (page_size / tile_n)]. Lengths come from seqused_k or the spans of
    # cu_seqlens_k (which then offsets nothing: the pages say where keys live)
    paged_kv: bool = False
    # grid z-slice z computes batch row batch_order[z]: the host sorts sequences longest first,
    # so the hardware's in-order block dispatch starts the longest CTAs first (LPT over
    # sequences; blocks of one z-slice are dispatched before the next)
    batch_order: bool = False
    # with split_kv: the splits of a tile run as one thread-block cluster (num_splits <= 8, the
    # portable cluster size) and merge their partials through distributed shared memory, so
    # out / lse are final (in the output dtype): no fp32 partials, no combine launch
    split_cluster: bool = False
    # with seqused_k, dense (unpacked, unpaged) k / v whose batch rows lie back to back (batch
    # stride = rows x row stride; the host checks v's): V loads through the ragged view of all
    # B x capacity rows, which ends at each row's last used key (row kv_batch's keys start at
    # row kv_batch x capacity), so the TMA zero-fills the rest of the last key tile
    ragged_cache: bool = False
    # GQA with the G = H / Hkv query heads of a KV head packed into one tile's rows: q / out /
    # lse rows (r, i) of query head g * G + r and position i form the hierarchical row mode
    # (G, seqlen_q) of KV head g (row r + G * i), so each K/V tile is read once for all G
    # heads; the mask maps row -> position i = row // G. The grid walks KV heads. Packed q
    # (cu_seqlens_q) offsets and clips the seq part of that mode
    pack_gqa: bool = False

    def __post_init__(self):
        if self.split_cluster and not self.split_kv:
            raise ValueError("split_cluster merges split-KV partials: needs split_kv")
        if self.ragged_cache and not (
            self.seqused_k and not self.cu_seqlens_k and not self.paged_kv
        ):
            raise ValueError("ragged_cache: dense k / v with seqused_k (not packed, not paged)")

    @property
    def partials(self) -> bool:
        """out / lse are fp32 partials stacked by split (merged later by the combine kernel)."""
        return self.split_kv and not self.split_cluster

    @property
    def direct_store(self) -> bool:
        """O leaves registers with predicated stores instead of the TMA store: split partials
        are fp32 (and stacked by split); a cluster-merged split writes only the rows it holds
        from the leader's registers. Packed q takes the TMA store over `ragged_rows`."""
        return self.split_kv

    @property
    def clean_v_tail(self) -> bool:
        """V rows past seqlen_k inside the last key tile may hold anything (stale cache rows,
        the next packed sequence's values, NaN): they must not reach the output, because P = 0
        there still gives 0 * NaN = NaN. The SM90 forward zeroes them in smem, or for packed,
        unpaged k / v (and `ragged_cache` caches) loads V through a ragged view that stops at
        each sequence's last key (FwdTileConfig.ragged_v_loads). Dense inputs need neither:
        past the tensor's end the TMA fills zeros."""
        return self.seqused_k or self.cu_seqlens_k or self.paged_kv
