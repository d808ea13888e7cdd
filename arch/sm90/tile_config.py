"""Tile configuration and tuning table of the SM90 forward kernel.

`FwdTileConfig` is everything static about one kernel variant besides the problem's dtypes and
head dims; it is part of the compile key. `fwd_tile_config` is the tuning table: a pure
function of the problem's static features. Each branch cites the measurement behind it
(docs/perf/README.md has the numbers); a branch without a measurement says so.
"""

from __future__ import annotations

import dataclasses

from ..common.dq_flat import DqFlatTile

SMEM_BYTES_SM90 = 227 * 1024  # opt-in dynamic smem per CTA on H100/H200
SMEM_BYTES_PER_SM_SM90 = 228 * 1024  # per SM, shared by resident CTAs (1 KiB reserved each)
L2_BYTES_SM90 = 50 * 1024 * 1024  # H100 SXM / H200 L2 (the K/V working set of lpt_l2_sections)


@dataclasses.dataclass(frozen=True)
class FwdTileConfig:
    tile_m: int = 128  # query rows per CTA (64 per consumer warpgroup)
    tile_n: int = 128  # keys per mainloop iteration
    num_stages: int = 2  # K and V smem stages
    num_mma_warpgroups: int = 2
    # issue S(j) = Q K(j)^T before P(j-1) V(j-1) so softmax(j) runs while PV is in flight
    intra_wg_overlap: bool = True
    # with the overlap: rescale O by tile j's row scale in iteration j+1, after S(j+1) is
    # issued and before P(j) V(j), so the FMULs run under the QK GEMM instead of after PV
    rescale_before_pv: bool = False
    # with the overlap: keep the P(j-1) V(j-1) wait below (part of) softmax(j). ptxas moves
    # a wgmma wait up to the nearest mbarrier arrive above it, which is K(j)'s release right
    # after S(j) lands, so by default softmax(j) starts only once the PV GEMM is done (seen in
    # the SASS and in ncu's stall samples). An arrive issued only once some softmax value is
    # computed (arch/sm90/primitives.release_after / arrive_after) holds the wait below it.
    # pin_pv_anchor = 0: that arrive is K(j)'s release, after the row sums (K held longer);
    # k > 0: an arrive on a barrier of its own (nobody waits on it) after the thread's first
    # k probabilities in row order, and K(j) is released right after S(j) as without the pin
    pin_pv_wait: bool = False
    pin_pv_anchor: int = 0
    # with an anchor (pin_pv_anchor > 0): split the softmax at the anchor's k probabilities,
    # wait for P V there in program order, and spread O's rescale multiplies over the
    # remaining exponentials (OnlineSoftmax.step_head / step_tail); off: the rescale follows
    # the whole softmax, where ptxas leaves it
    interleave_rescale: bool = False
    # run the fully visible key tiles as a loop of their own, without mask code or a per-tile
    # test (the edge tiles that may need a mask keep the test); off: one loop testing each tile
    split_mask_loops: bool = False
    # with split_mask_loops: the fully visible loop's softmax drops the row max's -inf guards
    # (three compares and selects a row a tile; every row of those tiles has a finite max)
    unguarded_visible_max: bool = False
    # mask a row's elements through a bitmask of its visible columns (TileMask.apply,
    # `bits`): per row one shift builds 32 elements' keep bits, which ptxas moves into
    # predicates (R2P), instead of one or two compares an element
    mask_bits: bool = False
    # order the consumer warpgroups' GEMM issue round-robin through named barriers (ping-pong)
    pingpong: bool = True
    # skip O / l rescaling while the row max grows by <= this many log2 units (0 = off)
    rescale_threshold: float = 0.0
    # reverse m-block order for causal/local so the longest CTAs start first (LPT)
    lpt_order: bool = True
    # with lpt_order on a dense causal/local grid: longest-first across the heads of an L2
    # section (as many heads as fit K/V in L2), not one head after another
    lpt_l2_sections: bool = False
    # the most (head, batch) pairs an L2 section holds (a power of two <= 1024)
    l2_section_max_pairs: int = 1024
    # with lpt_l2_sections: packed sequences (q and k / v by cu_seqlens, unsplit, unpaged) take
    # the sections too, each (head, sequence) a pair (off: dense grids only)
    l2_sections_packed: bool = False
    # compute every k-th exponential with FMA-pipe instructions (0 = all on the SFU)
    exp2_emu_every: int = 0
    # resident CTAs per SM (registers and smem split between them): 2 lets one CTA's prologue
    # and epilogue overlap another's main loop when each CTA has few key tiles
    ctas_per_sm: int = 1
    # split-KV only: signal griddepcontrol.launch_dependents (the PDL-launched combine may
    # become resident) at kernel start (True) or once the consumers reach the epilogue
    early_dependents: bool = False
    # softmax row max: 0 the DSL's reduce and shuffle steps as they come (the first shuffle
    # step a compare / NaN test / select), 1 one FMNMX per shuffle step, 2 four FMNMX chains
    # per row, every row's max before any row's exponentials (FA4's shape)
    row_max_form: int = 0
    # 0: one CTA per (query tile, head, batch). n > 0: a persistent grid of at most n CTAs
    # (the host passes the SM count times ctas_per_sm), CTA c taking tiles c, c + n, ...; the
    # producer loads the next tile's Q and K / V while the consumers finish the current one,
    # and O gets an smem buffer of its own so that its store overlaps the next tile. Dense
    # inputs only; under a mask CTA c takes pairs of query tiles whose key ranges are
    # complementary (PersistentUnits.unit_tile): equal work under the causal mask, not
    # under a window (which the table leaves on one CTA per tile)
    persistent_ctas: int = 0
    # packed k / v (cu_seqlens_k, not paged): V's TMA loads go through a view whose key extent
    # ends at each sequence's last used key (`seqlen.ragged_rows`), so the rows of a last key
    # tile past it arrive as zeros; off: they arrive as the next sequence's rows and the
    # consumers zero them in smem (`FlashFwdSm90._zero_v_tail`, which paged and cached keys
    # still need). Either way no value past a sequence's keys reaches its output (0 * NaN).
    # Round-robin, TFLOP/s, ragged / zeroed, outputs bitwise equal
    # (varlen_ragged_v_ab_h200.json): the bench's 16 packed causal sequences, GQA 32/8, D=128
    # 592.6 / 586.4, D=64 422.2 / 412.2; 64 sequences of 256-1024 rows, D=128 271.4 / 258.6
    ragged_v_loads: bool = True
    # split_cluster only: the merge skips the fragment rows past the tile's used query rows
    # (the peers' smem writes, the leader's distributed-smem reads and weights), which the
    # epilogue never stores. A packed decode tile uses the GQA group's rows (4 of 64 at 32 /
    # 8 heads), so the leader's critical path reads about half its fragment instead of all of
    # it. Spill-free on sm_90a; its GPU tests pass; measured at B=8 Sk=8k (two splits in a
    # cluster, graphs of ten calls): 64.4 us against 65.0 (decode_split_cluster_ab_c_h200.json,
    # within 1%, one run): off.
    merge_used_rows: bool = False

    def __post_init__(self):
        if self.tile_m != 64 * self.num_mma_warpgroups:
            raise ValueError(f"tile_m {self.tile_m} must be 64 * num_mma_warpgroups")
        if self.tile_n % 16 != 0 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n {self.tile_n} must be a multiple of 16 in [16, 256]")
        if self.num_stages < 1:
            raise ValueError("num_stages must be >= 1")
        if self.exp2_emu_every < 0:
            raise ValueError("exp2_emu_every must be >= 0")
        if self.ctas_per_sm not in (1, 2) or (
            self.ctas_per_sm == 2 and self.num_mma_warpgroups != 1
        ):
            raise ValueError("ctas_per_sm: 1, or 2 with one consumer warpgroup (register budget)")
        if self.pin_pv_wait and not self.intra_wg_overlap:
            raise ValueError("pin_pv_wait orders the overlap's PV wait: needs intra_wg_overlap")
        if self.pin_pv_anchor < 0:
            raise ValueError("pin_pv_anchor must be >= 0")
        if self.pin_pv_anchor and not self.pin_pv_wait:
            raise ValueError("pin_pv_anchor is how pin_pv_wait holds the wait: needs pin_pv_wait")
        if self.interleave_rescale and (not self.pin_pv_anchor or self.rescale_before_pv):
            raise ValueError(
                "interleave_rescale splits the softmax at the P V anchor: needs pin_pv_anchor > 0"
                " and rescale_before_pv off"
            )
        if self.unguarded_visible_max and not self.split_mask_loops:
            raise ValueError("unguarded_visible_max acts on split_mask_loops' visible loop")
        if self.row_max_form not in (0, 1, 2):
            raise ValueError(f"row_max_form {self.row_max_form} must be 0, 1 or 2")
        m = self.l2_section_max_pairs
        if not 1 <= m <= 1024 or m & (m - 1):
            raise ValueError(f"l2_section_max_pairs {m} must be a power of two in [1, 1024]")
        if self.persistent_ctas < 0:
            raise ValueError("persistent_ctas must be >= 0")
        if not 0.0 <= self.rescale_threshold <= 8.0:
            raise ValueError("rescale_threshold must be in [0, 8] (fp32/bf16 safety bound)")

    def smem_bytes(self, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> int:
        q = self.tile_m * head_dim * elem_bytes
        k = self.num_stages * self.tile_n * head_dim * elem_bytes
        v = self.num_stages * self.tile_n * head_dim_v * elem_bytes
        # persistent: O's own buffer (else O is staged in Q's)
        o = self.tile_m * head_dim_v * elem_bytes if self.persistent_ctas else 0
        return q + k + v + o + 1024  # barriers and alignment


SUPPORTED_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 192), (192, 128), (256, 256))


# the narrowest sliding window (left + right keys) whose D=64 forwards take the 192-row tile
TALL_MIN_WINDOW_D64 = 4096


def fills_tall_tiles(seqlen_q: int, window_left: int = -1, window_right: int = -1) -> bool:
    """Whether a dense query length suits 192-row tiles (the D=64 `tall` variant): padded to a
    multiple of 192 by at most 4% more rows than to a multiple of 128 (1024 rows become 1152,
    12.5% more, and cost 5%), and long enough where measured to win. The window is the kernel
    problem's (-1: that side unbounded; the causal corner is (-1, 0)).

    No mask: >= 2048 rows (+2% at 4k, +6.5% at 16k; tune_d64_tiles_h200.json).

    A right bound only (the causal corner): >= 4096 rows. The 64-row two-CTA tile / the
    192-row tile of today's table (round-robin, TFLOP/s): 2k 392.3 / 336.6, 4k 420.5 / 413.6,
    8k 443.6 / 473.4 (tune_fwd_d64_tall_mid_causal_h200.json); 6k 431.0 / 457.8, 8k 439.8 /
    470.8 (tune_fwd_d64_tall_6k8k_causal_h200.json); 16k 461.4 / 491.8
    (tune_fwd_d64_tall_persistent_causal_h200.json); 4k 412.3 / 405.8, 5k 422.2 / 435.4, 6k
    428.3 / 454.0 (tune_fwd_d64_tall_5k_causal_h200.json). 4.5k not measured. With the
    section sizes from the host (thirty-third session): 2k 401.8 / 341.3, 4k 420.7 / 418.8
    (tune_fwd_d64_tall_l2_host_h200.json): the threshold stayed at 5k then. Once the
    192-row tile's causal loop lost its row max guards (unguarded_visible_max, thirty-seventh
    session), 4k twice: 418.1 / 420.7 (tune_fwd_edges_tall_h200.json) and 430.5 / 434.9
    (tune_fwd_d64_tall_4k_causal_s37_h200.json, 40 reps): from 4k rows since.

    A left bound: >= 16384 rows and a window at least TALL_MIN_WINDOW_D64 keys wide (or open
    on the right). A CTA's work is the window's, not the query length's; window (w, 0), same
    columns: at 8k, 512 keys 278.5 / 207.2, 1k 355.8 / 305.2
    (tune_fwd_d64_tall_window_8k_h200.json); at 16k, 512 keys 273.2 / 205.5, 1k 346.4 /
    294.6, 2k 390.6 / 373.1, 4k 425.6 / 436.7 (tune_fwd_d64_tall_window_16k_h200.json). Wide
    windows below 16k rows not measured."""
    if window_left >= 0:
        wide = window_right < 0 or window_left + window_right >= TALL_MIN_WINDOW_D64
        if seqlen_q < 16384 or not wide:
            return False
    elif seqlen_q < (4096 if window_right >= 0 else 2048):
        return False
    return -(-seqlen_q // 192) * 192 <= 1.04 * (-(-seqlen_q // 128) * 128)


# the largest head dim with a persistent forward variant (its O buffer fits smem), and the
# longest key lengths whose forwards take one (fwd_persistent): D=96 / 128 with or without a
# causal mask, D=64 under a causal mask (D=64 without a mask, and D=96 / 128 under a sliding
# window: any length; D=64 under a sliding window up to a width)
PERSISTENT_MAX_HEAD_DIM = 128
PERSISTENT_MAX_KEYS = 8192
PERSISTENT_MAX_KEYS_D64_CAUSAL = 2048
# the widest sliding window (left + right keys) whose D=64 forwards take one
PERSISTENT_MAX_WINDOW_D64 = 512


def fwd_persistent(
    head_dim: int, seqlen_k: int, window_left: int = -1, window_right: int = -1
) -> bool:
    """Whether a dense, unsplit forward takes a persistent grid (FwdTileConfig.persistent_ctas):
    the host's bucket, passed to fwd_tile_config as the SM count. The window is the kernel
    problem's (-1: that side unbounded; the causal corner is (-1, 0)). A CTA's prologue (Q and
    the first K / V loads) and epilogue cost about the same per tile whatever the key length,
    so the gain shrinks as the keys grow.

    Unmasked. Round-robin, TFLOP/s, one CTA per tile / persistent
    (tune_fwd_persistent_*_h200.json): D=128 1k 578 / 644, 2k 662 / 697, 4k 630 / 648, 8k 649 /
    654, 16k 658 / 655 and 651 / 644; D=96 4k 539 / 547, 16k 569 / 556 and 572 / 561; D=64 1k
    (the 64-row two-CTA tile, 264 CTAs) 405 / 432, 2k 444 / 472, 4k 492 / 507, 8k 524 / 534,
    16k 532 / 534 and 532 / 537. At 16k D=96 / 128 lose 1-2%, hence the key-length cap there
    (8k measured at D=128 only).

    A right bound only: the causal corner, or a window reaching right of it (units of two
    complementary query tiles, PersistentUnits.unit_tile). Round-robin, TFLOP/s, one CTA per
    tile / persistent (tune_fwd_pcausal2_*_h200.json, causal): D=128 1k 425 / 493, 2k 501 /
    553, 4k 560 / 587, 8k 610 / 616, 16k 642 / 634; D=96 4k 501 / 515; D=64 (264 CTAs) 1k 318 /
    345, 2k 383 / 393, 4k 432 / 429, 8k 455 / 444; D=64 16k (the 192-row tile, 132 CTAs) 508 /
    493. The same 8k cap at D=96 / 128, 2k at D=64. Right bounds past the diagonal follow
    the causal rule, not measured on their own.

    A sliding window (both sides bounded: pairs over the ramp of tiles whose key range starts
    at key 0, one tile a unit after it). Window (left, 0), same columns
    (tune_fwd_winramp_*_h200.json): D=128 4k with 1k keys 438 / 479, 8k with 1k keys 504 /
    520, 16k with 1k keys 445 / 474, 16k with 4k keys 591 / 596; D=96 8k with 1k keys 420 /
    441; D=64 (264 CTAs) 4k with 128 keys 114 / 122, 8k with 256 keys 190 / 191, 512 keys
    272 / 278, 1k keys 355 / 349; D=64 16k (the 64-row tile, which fills_tall_tiles keeps
    for windows this narrow; tune_fwd_d64_tall_window_16k_h200.json) with 512 keys 273 / 277,
    1k 346 / 352, 2k 391 / 394, 4k 426 / 426. Taken at D=96 / 128 for every window and length
    (a row's keys are the window's, not seqlen_k); at D=64 for windows up to 512 keys wide,
    any length (measured to 16k; 1k-2k keys: -1.7% at 8k, +0.7-1.5% at 16k, left alone).
    Pairs over every tile of a window had lost 10% at 16k with 4k keys
    (tune_fwd_pwindow*_h200.json).

    A left bound only: each tile sees fewer keys than the one before it, which the units do
    not pair; not measured, one CTA per tile. Past D=128, O's own smem buffer does not fit
    beside two K / V stages."""
    if head_dim > PERSISTENT_MAX_HEAD_DIM:
        return False
    if window_left >= 0:
        if window_right < 0 or head_dim > 64:
            return window_right >= 0
        return window_left + window_right <= PERSISTENT_MAX_WINDOW_D64
    if window_right >= 0 and head_dim <= 64:
        return seqlen_k <= PERSISTENT_MAX_KEYS_D64_CAUSAL
    return head_dim <= 64 or seqlen_k <= PERSISTENT_MAX_KEYS


def fwd_tile_config(
    head_dim: int,
    head_dim_v: int,
    causal: bool,
    local: bool,
    decode: bool = False,
    page_size: int = 0,
    tall: bool = False,
    wide: bool = False,
    persistent_sms: int = 0,
) -> FwdTileConfig:
    """The tuning table. Inputs are static problem features, plus three buckets; `decode`
    is the packed decode layout (one query row, the query heads of a KV head as the tile's
    rows); `page_size` > 0: K/V come from a paged cache by TMA, one page lookup per key tile, so
    the key tile must lie inside one page (`paged_tile_config`); `tall`: a dense query length
    for which `fills_tall_tiles` holds; `wide`: a packed-decode grid that is split, or
    unsplit and `fills_two_ctas_per_sm`; `persistent_sms` > 0: a dense, unsplit problem for which
    `fwd_persistent` holds, on a device of that many SMs (the host decides all three; each
    picks between two compiled variants, none is a length in the key).

    Measurements: docs/perf/tune_switches.json (H200, bf16, round-robin timing of variants in
    one process, 40 reps each) and docs/perf/README.md.
    """
    cfg = _dense_tile_config(head_dim, head_dim_v, causal, local, decode, tall, wide)
    if persistent_sms > 0 and not decode and not page_size and head_dim <= PERSISTENT_MAX_HEAD_DIM:
        # a persistent grid of one wave: the SM count times the CTAs an SM holds
        cfg = dataclasses.replace(cfg, persistent_ctas=persistent_sms * cfg.ctas_per_sm)
    if page_size > 0:
        paged = paged_tile_config(cfg, head_dim, head_dim_v, page_size)
        if paged is None:
            raise ValueError(f"no TMA key tile fits page size {page_size} (see paged_tile_n)")
        return paged
    return cfg


def _dense_tile_config(
    head_dim: int,
    head_dim_v: int,
    causal: bool,
    local: bool,
    decode: bool,
    tall: bool,
    wide: bool = False,
) -> FwdTileConfig:
    if (head_dim, head_dim_v) not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"SM90 forward has no variant for head dims ({head_dim}, {head_dim_v})")
    if decode and (head_dim, head_dim_v) == (128, 128) and wide:
        # Unsplit packed-decode grids for which fills_two_ctas_per_sm holds: 64 keys x 2
        # stages, two CTAs per SM, so one CTA streams while the other starts or drains (D=64 /
        # 96 not measured: they keep the tile below). H200, 32/8 heads, D=128, round-robin
        # against the tile below, TB/s (tune_decode_skip_l2_h200.json,
        # tune_decode_cta2_waves_h200.json): B=64 Sk=8k 4.56 vs 4.47-4.49, B=128 Sk=2k 4.49
        # vs 4.41, B=24 Sk=8k 4.15 vs 3.93, B=33 Sk=8k 4.57 vs 4.55. 3 stages or 96 keys:
        # no better (B=64 4.54 / 4.56). Where the bucket says no: B=48 Sk=4k 4.28 vs 4.41,
        # B=8 unsplit 2.99 vs 3.41 (the library splits that one).
        # Split decode grids (the split count fwd_num_splits picks: at most one wave of one
        # CTA an SM) take it too. Round-robin, CUDA graphs of one / ten calls, us per call,
        # the tile below / this (decode_wide_split_ab_s35_h200.json): B=1 Sk=32k, 16 splits,
        # 40.8 / 40.0 and 36.7 / 36.3; B=8 Sk=8k, 2 splits, 70.0 / 69.6 and 65.6 / 65.1. The
        # fifteenth session's run (decode_wide_split_ab_h200.json): B=1 38.5-38.6 / 38.6-38.8
        # and 36.9-37.0 / 36.6-36.7, B=8 68.8-69.1 / 67.9-68.3 and 66.6-66.7 / 65.8-66.0. Twice
        # the splits on this tile: B=1 40.5 and 37.2, B=8 68.8 and 65.5 (better than the
        # table's count in one of four cells): the split count stays.
        return FwdTileConfig(tile_m=64, tile_n=64, num_stages=2, num_mma_warpgroups=1,
                             pingpong=False, ctas_per_sm=2)  # fmt: skip
    if decode and head_dim <= 128:
        # Packed decode: a KV head's query heads (GQA groups are <= 64 in practice) fill at
        # most one 64-row warpgroup, so a second consumer warpgroup only doubles tensor-core
        # time; the smem it frees holds a third K/V stage for a memory-bound loop. H200,
        # 32/8 heads, D=128, CUDA-graph time, this vs the default tile (two sessions, not one
        # run; docs/perf/host_overhead_h200*.json): B=1 Sk=32k 41.1 vs 42.7 us, B=8 Sk=8k
        # 68.6 vs 69.8, B=64 Sk=8k 480 vs 521, B=128 Sk=2k 245 vs 278.
        # ctas_per_sm=2 (64 or 96 keys, 2-3 stages; tune_decode_ctas_h200.json, round-robin in
        # one process): B=128 Sk=2k 0.241 vs 0.249 ms (+3%), B=64 Sk=8k equal (then; +1.5% in
        # the later runs above), B=8 Sk=8k 0.084-0.096 vs 0.078 ms (-8 to -23%, a one-wave
        # split grid, an older kernel): unsplit grids take `wide` where it fits, split grids
        # since the thirty-fifth session's measurement (above).
        # Also measured on this tile and dropped (tune_decode_skip_l2_h200.json): softmax
        # skipped in the three warps that hold no query row (B=64 4.46 vs 4.47, B=8 3.29 vs
        # 3.41), an L2 evict-first or evict-last hint on the K / V loads (within 0.5%).
        return FwdTileConfig(tile_m=64, num_mma_warpgroups=1, num_stages=3, pingpong=False)
    # mask_bits (per-row keep bits, R2P; thirty-fourth session) on every tile that runs its
    # masked key tiles in loops of their own (split_mask_loops). Round-robin, TFLOP/s, bits /
    # compares, three runs (tune_fwd_mask_bits{,_b,_c}_h200.json): windows gain most, D=64
    # 16k window 4096 474.8 / 449.3, 4k window 128 145.0 / 122.4, 8k window 1024 342.1 /
    # 331.1; D=96 8k window 1024 460.6 / 440.3; D=128 8k window 1024 548.2 / 528.6 and 444.1
    # / 424.7, 16k window 1024 512.8 / 501.1. Causal: D=64 6k 475.4 / 468.3 and 470.4 /
    # 467.2, 16k 515.3 / 512.6 and 509.4 / 506.7, 4k 409.8 / 410.6 and 412.2 / 412.3, 1k
    # 351.4 / 346.5; D=96 4k 507.7 / 499.4; D=128 4k 638.2 / 624.8 and 573.5 / 573.1, 16k
    # 639.6 / 639.2, 1k 424.7 / 422.9. Off at D > 128 under the causal mask, where one loop
    # tests each tile and holds the mask code: D=256 causal lost in all three runs (4k 703.3
    # / 715.3, 599.7 / 619.3, 608.7 / 627.7; 16k 680.2 / 712.8), D=192 even (4k causal 596.4
    # / 595.4, 16k causal 691.9 / 691.3); under sliding windows they take it (their
    # branches). Decode tiles not measured: off.
    if head_dim <= 64 and tall:
        # 192 x 128 with three consumer warpgroups (160 registers each; the current kernel is
        # spill-free with the overlap, an older one spilled 57 registers). Round-robin, TFLOP/s
        # (tune_fwd_overlap_h200.json): with overlap 506 vs 486 without at 16k, 453 vs 441 at
        # 4k, 16k causal equal (444 / 443). Earlier, without overlap, against the 128 x 128
        # variant below (tune_d64_tiles_h200.json): 16k 478 vs 449, 16k causal 468 vs 457, 4k
        # 438 vs 429; but 1k 345 vs 363 (padding to 1152 rows) and 4k causal 378 vs 387
        # (tune_d64_tall_causal_h200.json); with overlap 1k 362 vs 365, 1k causal 228 vs 264,
        # 4k causal 379 vs 380 (tune_fwd_overlap_h200.json), hence only for the query lengths
        # fills_tall_tiles accepts. Also measured and lost everywhere: tile_n 160 / 176 (two
        # warpgroups; -11..-18% at 1k and causal), 192 x 96 (3 stages or 2); 192 x 128 with 3
        # stages: equal to 2 stages (443 vs 442 at 4k).
        # Ping-pong round-robin over the three warpgroups and LPT over L2 sections of heads
        # (tune_fwd_pingpong_l2_h200.json, round-robin, TFLOP/s; base / ping-pong / L2
        # sections / both): 16k 496 / 517 / 494 / 514, 4k 451 / 472 / 450 / 472 (sections only
        # act under a mask), 16k causal 433 / 464 / 464 / 498.
        # pin_pv_wait on (tune_fwd_pin_h200.json, round-robin, on / off): 16k 524 / 502, 4k
        # 456 / 440 TFLOP/s; 16k causal 495 / 482 (tune_fwd_pin_d64_causal_h200.json). Off
        # everywhere else: D=64 64-row tile 1k 402 / 412, 4k causal 385 / 403; D=256 4k 654 /
        # 684, 16k causal 678 / 707; D=128 -3% (D=96 / 128 anchor it on a barrier of their
        # own, below). Anchors alone (tune_fwd_anchor_k64b_h200.json, k = 2 / 4 vs the K
        # release): 16k 523 / 518 vs 516, 4k 486 / 479 vs 480: within 1.5%.
        # split_mask_loops with a 2-probability anchor, against the K-release pin without the
        # split (round-robin, TFLOP/s, two runs: tune_fwd_d64_split_h200.json and
        # tune_fwd_d64_split_confirm_tall_h200.json): 16k 516 / 509 and 518 / 510, 4k 466 /
        # 464 and 474 / 472, 16k causal 493 / 483 and 494 / 485. The split alone: -0.8..+1.4%.
        # row_max_form=2 with a 4-probability anchor (ncu, 16k: 51k samples of MUFU stalled
        # on MIO throttle vs FA4's 35k, most in a burst of row 0's exponentials while row 1's
        # max was still reducing; FA4 reduces every row's max first). Round-robin, TFLOP/s,
        # old table (form 0, k = 2) / form 1 / form 2 / form 2 with k = 4
        # (tune_fwd_rowmax_c_h200.json): 16k 519 / 518 / 533 / 539, 4k 468 / 473 / 482 / 490,
        # 16k causal 496 / 499 / 499 / 498; k = 2 / 4 with form 2 in another run
        # (tune_fwd_rowmax_k_h200.json): 16k 528 / 536, 4k 488 / 494, 16k causal 501 / 501.
        # interleave_rescale under the causal mask (ncu of 16k causal against FA4: same
        # instruction mix in the main loop, but O's 32 rescale multiplies after the last
        # exponential, where FA4 has them between exponentials; ncu_fwd_d64_16k_causal_h200_*).
        # Round-robin, TFLOP/s, off / on: 16k causal 506.5 / 515.0
        # (tune_fwd_interleave_h200.json) and 493.4 / 501.7 (40 reps,
        # tune_fwd_interleave_d64_16kc_h200.json). Off without a mask: 16k 546 / 537, 4k 508 /
        # 501 (same first file); windows not measured: off.
        # unguarded_visible_max under the causal mask (thirty-seventh session; round-robin,
        # TFLOP/s, guarded / unguarded, tune_fwd_unguarded{,_b}_h200.json): 16k causal 506.5 /
        # 512.1 and 506.6 / 511.9. Off without a mask, where ptxas schedules the loop worse
        # for 8 fewer instructions: 16k 544.8 / 516.4, 4k 506.3 / 484.4; windows not measured.
        return FwdTileConfig(
            tile_m=192,
            num_mma_warpgroups=3,
            pingpong=True,
            lpt_l2_sections=True,
            split_mask_loops=True,
            unguarded_visible_max=causal and not local,
            pin_pv_wait=True,
            pin_pv_anchor=4,
            row_max_form=2,
            interleave_rescale=causal and not local,
            mask_bits=True,
        )
    if head_dim <= 64:
        # 64-row tiles, one consumer warpgroup, two CTAs per SM (128 launch registers, 56 / 200
        # budgets): one CTA's prologue (Q and first K/V loads) and epilogue overlap the other's
        # main loop, which pays where CTAs are short. tune_fwd_2cta_h200.json (round-robin,
        # TFLOP/s; 128 x 128 two warpgroups with ping-pong under a mask / this / this with 3
        # stages / this with tile_n 64): 1k 364 / 412 / 408 / 368, 1k causal 276 / 315 / 308 /
        # 300, 4k causal 366 / 404 / 401 / 361. Not measured against the tall tile at >= 2k
        # unmasked rows, which keeps those (fills_tall_tiles). Earlier, for the 128 x 128 tile:
        # ping-pong on under a mask (4k causal 377 -> 395, 1k causal 262 -> 275,
        # tune_fwd_pingpong_l2_h200.json); exp2_emu_every off (every 4th exponential on the FMA
        # pipe -8..-10%, every 8th -1..-2%, tune_exp2_emu_d64_h200.json; on today's 64- and
        # 192-row tiles every 8th / 32nd -4..-9% / -2.9..-4.4%, and at D=128 16k -6% / -2.5%,
        # tune_fwd_exp2_emu_s29_h200.json); overlap on (off: 388
        # vs 445 at 16k, tune_d64_tiles.json). split_mask_loops with a 2-probability P V anchor
        # against neither (round-robin, TFLOP/s, two runs: tune_fwd_d64_split_h200.json and
        # tune_fwd_d64_split_confirm_short_h200.json): 1k 392 / 389 and 393 / 388, 1k causal
        # 321 / 314 (second run), 4k causal 401 / 390 and 411 / 399. The 192-row tile at these
        # lengths still loses with both (same file: 1k 355, 1k causal 236, 4k causal 392).
        # row_max_form 0 / 1 / 2 (tune_fwd_rowmax_c_h200.json, tune_fwd_rowmax_a_h200.json): 1k
        # 391 / 398 / 401 and 395 / 402 / 405, 4k causal 407 / 403 / 401 and 409 / 407 / 405,
        # 1k causal 320 / 320 / 320: form 0 kept for the >= 4k row.
        # interleave_rescale (tune_fwd_interleave_h200.json, off / on): 4k causal 422 / 409, 1k
        # causal 347 / 340: off.
        # LPT over L2 sections under the causal mask, once their sizes came from the host
        # (thirty-third session; tune_fwd_d64_sections{,_b}_h200.json, round-robin, TFLOP/s,
        # off / on, three runs): 4k causal 396.7 / 402.6, 399.9 / 405.9, 397.0 / 402.8; 2k
        # causal 367.6 / 366.0 and 366.4 / 366.7; 1k causal 346.9 / 347.2 (1k-2k take the
        # persistent grid in the library, which has no sections). On with the in-kernel
        # coordinates they were even at 4k (408 / 408, tune_fwd_l2fast_h200.json). Windows
        # not measured: off.
        # unguarded_visible_max (guarded / unguarded, tune_fwd_unguarded{,_b}_h200.json): 4k
        # causal 446.2 / 437.5 and 403.5 / 409.8, no consistent sign: off.
        return FwdTileConfig(
            tile_m=64,
            num_mma_warpgroups=1,
            pingpong=False,
            ctas_per_sm=2,
            split_mask_loops=True,
            pin_pv_wait=True,
            pin_pv_anchor=2,
            lpt_l2_sections=causal and not local,
            mask_bits=True,
        )
    if head_dim <= 128:
        # D=128: overlap off costs 17% (508 vs 615 at 16k); ping-pong is within 2% either way
        # (16k: 615 on / 626 off; 1k causal: 292 on / 283 off): kept on. 3 stages: no gain
        # (618 vs 655 in a sequential run). tune_fwd_pingpong_l2_h200.json (TFLOP/s, base /
        # tile_n 144 / 160 / 176 / L2 sections / ping-pong off): 16k 613 / 626 / 638 / 635 /
        # 609 / 627, 4k 588 / 587 / 599 / 593 / 589 / 599, 1k 457 / 423 / 433 / 452 / 457 /
        # 453, 16k causal 615 / 611 / 623 / 624 / 609 / 605, 4k causal 519 / 503 / 512 / 507 /
        # 534 / 504, 1k causal 374 / 335 / 342 / 332 / 358 / 353: wider key tiles (spill-free
        # now) help long unmasked rows only and would need a length bucket; not adopted.
        # Re-measured after the warp-uniform index (tune_fwd_tn_h200.json, base / 160 / 176 /
        # 192): 16k 638 / 636 / 637 / 637, 4k 610 / 599 / 593 / 591, 16k causal 621 / 630 /
        # 631 / 631, 4k causal 535 / 525 / 521 / 527: still not adopted.
        # split_mask_loops on (tune_fwd_split_h200.json, round-robin, on / off): 4k causal
        # 570 / 535, 16k causal 643 / 612, 4k 611 / 605, 16k 636 / 632, 1k 499 / 492. It loses
        # at D=256 (-3..-6%), where it stays off. LPT over L2 sections of heads, base /
        # sections (tune_fwd_d128_causal_l2_h200.json): 4k causal 538 / 549, 1k causal 386 /
        # 365, 16k causal 631 / 623. With the section coordinates computed without divisions
        # by 64-bit values (arch/common/schedule.py) and at most 8 pairs a section, base /
        # sections of up to 1024 / 8 pairs (tune_fwd_l2fast_h200.json, causal, TFLOP/s):
        # 1k 428 / 411 / 425, 2k 512 / 515 / 520, 4k 548 / 566 / 565, 8k 588 / 610 / 610,
        # 16k 631 / 626 / 626. Before the cheaper coordinates (tune_fwd_l2cap_h200.json) the
        # 8-pair sections gave 1k 383 vs 395: their division chain before the first load cost
        # the short 1k CTAs ~2%. On, at 8 pairs. (D=96 shares this branch; not measured.)
        # pin_pv_wait with a 4-probability anchor (the P V wait after the row maxes and ~18
        # exponentials instead of before the first one; round-robin, TFLOP/s, base / anchor,
        # two runs, tune_fwd_anchor_k_h200.json and tune_fwd_anchor_k2_h200.json): 16k 636 /
        # 675 and 630 / 665, 4k 609 / 639 and 605 / 635, 1k 516 / 534 and 509 / 527; causal
        # within 0.3% (16k 649 / 649 and 644 / 644, 4k 552 / 552 twice, 1k 395 / 396). Anchors
        # on 8-32 probabilities gain less (16k 646-654); the K release as the anchor
        # (pin_pv_wait alone) loses (615 vs 634, tune_fwd_anchor_d128_h200.json). D=96, anchor
        # / none (16 heads, tune_fwd_anchor_d96_h200.json): 16k 585 / 551, 4k 552 / 523, 4k
        # causal 514 / 497. Window and softcap share the loop (not measured).
        # row_max_form 0 / 1 / 2 (tune_fwd_rowmax_*_h200.json): 16k 665 / 662 / 653, 4k 638 /
        # 639 / 631, 4k causal 553 / 559 / 555, 16k causal 644 / 641 / 646, 1k 501 / 504 / 498:
        # form 1 within 1%, form 2 -1..-2% unmasked; form 0 kept.
        # interleave_rescale (tune_fwd_interleave_h200.json, off / on): 16k 672 / 665, 16k
        # causal 646 / 643, 4k 651 / 648, 4k causal 605 / 605, 1k causal 438 / 445; D=96 4k
        # causal 533 / 527: off.
        # unguarded_visible_max under the causal mask (round-robin, TFLOP/s, guarded /
        # unguarded, tune_fwd_unguarded{,_b}_h200.json): 16k causal 639.7 / 649.3, 4k causal
        # 598.1 / 600.0 and 556.6 / 562.3; D=96 4k causal 548.2 / 547.2 (even). Without a mask
        # 4k 643.3 / 648.2 but 16k 663.9 / 659.1: off there; windows not measured.
        return FwdTileConfig(
            tile_n=128,
            split_mask_loops=True,
            unguarded_visible_max=causal and not local,
            pin_pv_wait=True,
            pin_pv_anchor=4,
            lpt_l2_sections=True,
            l2_section_max_pairs=8,
            mask_bits=True,
        )
    # D > 128: overlap on. Round-robin, TFLOP/s, overlap (rescale after PV) / no overlap /
    # overlap with the rescale moved before PV (`rescale_before_pv`), tune_fwd_overlap_h200.json:
    # D=256 16k 722 / 675 / 696, 16k causal 691 / 667 / 688, 4k 666 / 627 / 646, 1k 592 / 565 /
    # 578; D=192 4k 664 / 640 / 664, 4k causal 563 / 542 / 565. (Overlap lost at D=256 in an
    # older kernel, 617 vs 672 in tune_switches.json: before the four-way row sum and the
    # packed P conversion, which tile_n = 80 needs.) rescale_before_pv does not pay: off.
    # Ping-pong off: neutral at D=256 (616 vs 617, tune_switches.json); with overlap, on vs off
    # (tune_fwd_pingpong_l2_h200.json): 4k 665 vs 679, 16k causal 669 vs 678, 4k causal 543 vs
    # 544, 1k causal 400 vs 386. LPT over L2 sections of heads on (same file, base / sections):
    # D=256 4k causal 544 / 603, 16k causal 678 / 686, 1k causal 386 / 398 (D=192 not
    # measured, follows D=256).
    if head_dim <= 192:
        # 112 keeps 2 K/V stages inside 227 KiB at D=192.
        # pin_pv_wait with a 4-probability anchor (D=128's form) and interleave_rescale,
        # round-robin, TFLOP/s. tune_fwd_interleave_a4_h200.json (none / anchor / both): 4k 668
        # / 701 / 702, 4k causal 574 / 599 / 602. tune_fwd_d192_anchor_h200.json, same
        # columns: 4k 633 / 665 / 666, 4k causal 554 / 577 / 579, 16k 671 / 708 / 709, 16k
        # causal 635 / 670 / 673, 1k 490 / 509 / 512, 1k causal 370 / 376 / 381; (192, 128)
        # 4k 631 / 636 / 662, 4k causal 559 / 574 / 578, 16k causal 642 / 666 / 673.
        # Windows and decode not measured: off.
        # Under a sliding window, split_mask_loops with mask_bits (nearly every tile of a
        # narrow window is masked). Round-robin, TFLOP/s, 8k rows, window 1024, split + bits /
        # bits / table, two runs in reverse orders (tune_fwd_wide_window_bits{,_b}_h200.json):
        # D=192 473.7 / 457.8 / 452.0 and 472.4 / 456.2 / 451.1, (192, 128) 498.4 / 463.1 /
        # 475.6. Under the causal mask both lose or tie (see mask_bits above).
        anchor = not local and not decode
        window = local and not decode
        return FwdTileConfig(
            tile_n=112 if head_dim_v > 128 else 128,
            pingpong=False,
            lpt_l2_sections=True,
            pin_pv_wait=anchor,
            pin_pv_anchor=4 if anchor else 0,
            interleave_rescale=anchor,
            split_mask_loops=window,
            mask_bits=window,
        )
    # D=256: 80-key tiles keep Q + 2 stages of K and V (224 KiB) inside the smem limit.
    # row_max_form 0 / 1 / 2 (tune_fwd_rowmax_b_h200.json): 16k 721 / 718 / 692, 4k causal
    # 630 / 630 / 629; form 0 kept.
    # pin_pv_wait with a 4-probability anchor (D=128's form) under the causal mask: base /
    # anchor (tune_fwd_d256_anchor_h200.json, round-robin, TFLOP/s): 4k causal 627 / 639, 16k
    # causal 679 / 696; 4k unmasked 768 / 768, so off there. On an older kernel the pin alone
    # lost (4k 654 / 684 against none, tune_fwd_pin_h200.json) and so did anchors on 1, 2, 8
    # and 32 probabilities (-3..-5%, tune_fwd_anchor_d64_d256_h200.json,
    # tune_fwd_anchor_k64_h200.json). Windows and decode (memory-bound) not measured: off.
    # interleave_rescale (tune_fwd_interleave_h200.json, off / on): 4k causal 677 / 651, 16k
    # causal 717 / 679; with the anchor added without a mask (tune_fwd_interleave_a4_h200.json,
    # none / anchor / both): 4k 702 / 702 / 666, 16k 738 / 737 / 694: off.
    # mask_bits under a sliding window (the one loop; split loops lose). Round-robin, TFLOP/s,
    # split + bits / bits / table, two runs (tune_fwd_wide_window_bits{,_b}_h200.json): 8k
    # window 1024 544.4 / 553.0 / 547.3 and 544.2 / 552.7 / 546.5, 16k window 4096 620.0 /
    # 644.7 / 636.7 and 620.2 / 644.1 / 636.1.
    # L2 sections over packed sequences (the bench's 16 causal sequences, 58,728 tokens;
    # round-robin, ms, table / sections, varlen_sections_ab_h200.json): D=256 (8 / 2 heads)
    # 2.181 / 2.127; D=128 4.669 / 4.700 and D=64 3.283 / 3.362 lose (their branches keep it
    # off), 64 short sequences at D=128 even (0.866 / 0.866). Again on another machine
    # (varlen_sections_ab_b_h200.json): D=256 2.210 / 2.154; D=192 1.674 / 1.671, within the
    # noise: off there.
    anchor = causal and not local and not decode
    return FwdTileConfig(
        tile_n=80,
        pingpong=False,
        lpt_l2_sections=True,
        l2_sections_packed=True,
        pin_pv_wait=anchor,
        pin_pv_anchor=4 if anchor else 0,
        mask_bits=local and not decode,
    )


def paged_tile_n(tile_n: int, page_size: int) -> int | None:
    """The key tile for a paged cache: the largest multiple of 16 (the P V wgmma's K step) not
    above the table's tile_n that divides page_size, so every key tile lies inside one page
    and is one TMA box. None (page sizes 1-15, or with no multiple-of-16 divisor such as
    8 or 200): the host gathers those pages into a dense copy instead."""
    for n in range(tile_n - tile_n % 16, 15, -16):
        if page_size % n == 0:
            return n
    return None


def paged_tile_config(
    cfg: FwdTileConfig, head_dim: int, head_dim_v: int, page_size: int
) -> FwdTileConfig | None:
    """`cfg` with its key tile cut to fit a page. A smaller tile gets more stages, keeping the
    bytes in flight of the dense config (the decode loop is memory-bound), within smem and at
    most 8 stages. Not tuned separately: the bench's paged decode rows (docs/perf/README.md)
    measure page sizes 64-256 against the dense cache."""
    tile_n = paged_tile_n(cfg.tile_n, page_size)
    if tile_n is None:
        return None
    if tile_n == cfg.tile_n:
        return cfg
    stages = min(8, cfg.num_stages * cfg.tile_n // tile_n)
    while stages > cfg.num_stages:
        smaller = dataclasses.replace(cfg, tile_n=tile_n, num_stages=stages)
        if smaller.smem_bytes(head_dim, head_dim_v) <= SMEM_BYTES_SM90:
            break
        stages -= 1
    return dataclasses.replace(cfg, tile_n=tile_n, num_stages=stages)


def fills_two_ctas_per_sm(num_ctas: int, num_sms: int) -> bool:
    """Whether an unsplit packed-decode grid takes the two-CTAs-per-SM tile (`wide`): every SM
    busy (64 CTAs on 132 SMs: 2.99 vs 3.41 TB/s) and its last wave of two-CTA slots no emptier
    than the last wave of one-CTA slots (B=48 Sk=4k: 384 CTAs fill 2.91 one-CTA waves but 1.45
    two-CTA waves, 4.28 vs 4.41 TB/s; B=24: 192 CTAs, 1.45 vs 0.73 waves, 4.15 vs 3.93). A
    grid of at most one wave has no tail. Measurements in fwd_tile_config's `wide` branch."""
    if num_ctas < num_sms:
        return False

    def slots(per_wave: int) -> int:  # CTA slots the grid occupies until its last CTA ends
        return num_ctas if num_ctas <= per_wave else -(-num_ctas // per_wave) * per_wave

    return slots(2 * num_sms) <= slots(num_sms)


def fwd_num_splits(num_ctas: int, num_n_blocks: int, num_sms: int) -> int:
    """Split-KV count for num_splits=0, from the grid the call would launch without splits
    (num_ctas) and its key tiles per CTA: split only when that grid leaves SMs idle, into at
    most one wave, keeping >= 2 key tiles per split (the partials and the combine cost about
    one tile's traffic each). Measured against every nearby count on the decode rows
    (docs/perf/decode_splits_h200.json, CUDA graphs, 32/8 heads, D=128): B=1 Sk=32k picks 16
    (37.5 us; 8: 42.9, 12: 43.2, 20: 47.7, 24: 46.1, 32: 44.4, 33: 45.2, 48: 48.1); B=8 Sk=8k
    picks 2 (65.2 us; 1: 75.0, 3: 74.3, 4: 69.1); B=64 and B=128 pick 1 (2 splits: +2-3%).
    The winners fill one wave (B=1: 16 splits x 8 KV heads = 128 CTAs on 132 SMs); fewer
    leave SMs idle, more need a second, partial wave."""
    if num_ctas >= num_sms or num_n_blocks < 4:
        return 1
    return max(1, min(num_sms // num_ctas, num_n_blocks // 2, 128))


def fwd_ragged_cache() -> bool:
    """Whether a dense KV cache whose batch rows lie back to back (InputFeatures.ragged_cache)
    loads V through a ragged view that ends at each row's used keys, instead of zeroing the
    stale rows of its last key tile in smem (FlashFwdSm90._zero_v_tail). Packed prefill
    measured +1.1% (16 causal sequences) to +5% (64 short ones) for the same change
    (varlen_ragged_v_ab_h200.json); on caches it is built (sm_90a, spill-free: the decode
    variant drops from 2,848 to 2,056 SASS instructions), and its GPU tests (forced on) passed
    on the H200 (forty-first session), but its only timing there reused the first variant's
    launcher (the A/B swap left the KV-cache memo in place), and the forty-fifth session's
    rerun replayed freed cache lengths (void but for each row's last variant). Its fixed
    rerun (forty-sixth session, an H100: kvcache_tail_ab_s46_h100.json, CUDA graphs of ten
    calls, us a call, L and L - 1 keys with smem zeroing, then with the ragged view): B=1
    Sk=32k 50.7 / 50.7 and 50.6 / 50.6, B=8 8k 92.4 / 92.5 and 92.6 / 92.6, B=64 8k 695.8 /
    694.9 and 694.5 / 694.5: no difference past run-to-run spread (the partial tile itself
    costs nothing measurable), so it stays off (one variant fewer to build).
    Turning it on: the dense-cache rows of cute_attn.aot.FWD_INPUTS take ragged_cache too."""
    return False


def packed_tile_rows(tile_m: int, group: int) -> int | None:
    """The rows a query tile of `tile_m` rows takes under packed GQA rows of `group` query heads
    a position (FlashFwdSm90.tile_rows; its TMA boxes over (group, seq) take whole positions):
    group x floor(tile_m / group) for a smaller group (the rest of the tile is padding), tile_m
    for a multiple of it (whole tiles of one position's heads), None otherwise (no packing)."""
    if group < tile_m:
        return tile_m // group * group
    return tile_m if group % tile_m == 0 else None


# The most query rows (a sequence's) for which packed GQA rows are taken. H200, 32 / 8 heads,
# D=128, causal, B=8 over 8k cached keys, CUDA graphs of ten calls, us a call, unpacked /
# packed: Sq 4 180.1 / 65.1, 16 182.7 / 66.6, 32 180.7 / 79.6, 64 183.9 / 157.9, 128 199.7 /
# 335.9, 256 392.5 / 663.1 (pack_gqa_ab_rows_h200.json, forty-fifth session; Sq 1-8 also
# over other batches and packed sequences, 2.4-3.5x: pack_gqa_ab_h200.json, forty-first).
# Packed, a KV head's G x Sq rows take ceil(G x Sq / tile_m) decode tiles, each reading the
# keys once; unpacked, its G query heads read them once each (Sq fits a prefill tile). Up
# to Sq = tile_m / 2 (32 on the 64-row decode tile) packing reads them at most half as
# often, for any G; at Sq = 64 as often (1.16x measured), past it more often (0.59x at 128).
PACK_GQA_TIMED_SEQLEN_Q = 32


def fwd_pack_gqa(seqlen_q: int, tile_m: int, group: int) -> bool:
    """Whether a GQA forward that the Sq = 1 host view does not pack (more than one query
    row, e.g. speculative decoding, a left window, or packed sequences: seqlen_q is then the
    longest) packs its `group` query heads into the rows of its tiles of `tile_m` rows inside
    the kernel (InputFeatures.pack_gqa): each K/V tile is then read once for the group
    instead of once per query head. On up to PACK_GQA_TIMED_SEQLEN_Q query rows (where it
    was timed, above), on whole tiles (G divides tile_m or is a multiple of it) and padded
    ones (G = 3, 5, 6, 7 on 64 rows, e.g. 28 / 4 heads: floor(tile_m / G) positions a tile).
    Whole tiles, H200, `bench --preset spec-decode --graph` against FA4 in the same run
    (bench_spec_decode_graph_s45_h200.json, 32 / 8 heads, D=128, causal): B=1 Sk=32k Sq=4 39 us
    (FA4 338), B=8 Sk=8k Sq=2 / 4 / 8 66-67 us (FA4 92; unpacked, 186 in the forty-first
    session's bench), B=64 484 us (FA4 472; unpacked 1,498). Padded tiles, H100 (the only
    machine lent in the forty-sixth session), Sq=4, CUDA graphs of ten calls, us a call,
    unpacked / packed (pack_gqa_ab_wide_h100.json): 28 / 4 heads B=8 Sk=8k 176.6 / 53.7, 40
    / 8 heads B=8 Sk=8k 264.2 / 95.6, 28 / 4 heads over 64 packed sequences of 2k keys
    352.1 / 98.5. The GPU tests pass with it on (forty-sixth session, H100: the packed 52,
    the inference 251, the GQA forward and backward 144)."""
    return seqlen_q <= PACK_GQA_TIMED_SEQLEN_Q and packed_tile_rows(tile_m, group) is not None


def fwd_pack_gqa_wide() -> bool:
    """Whether in-kernel packed GQA rows (InputFeatures.pack_gqa) take the packed decode view's
    two-CTAs-per-SM tile (`wide`: 64 keys x 2 stages, D=128) in the same grid buckets (split
    grids, and unsplit ones for which fills_two_ctas_per_sm holds) and over the same inputs
    plus packed sequences (fwd_sm90._WIDE_PACKED_INPUTS). H100 (forty-sixth session), D=128,
    causal, CUDA graphs of ten calls, round-robin, us a call, packed on the tile of
    fwd_tile_config's decode branch / on this one (pack_gqa_ab_wide_h100.json): Sq=4 over
    8k keys, 32 / 8 heads B=64 727.4 / 696.4 (unsplit, 512 CTAs), B=8 96.0 / 93.0 (2
    splits); 28 / 4 heads B=8 53.7 / 51.7, 40 / 8 B=8 95.6 / 92.1; B=1 Sk=32k 53.1 / 50.7
    (16 splits); packed sequences, 64 of one row over 8k keys 724.5 / 694.2 (the KV-cache
    decode view: 694.2), 28 / 4 heads 64 of 4 rows over 2k 98.5 / 95.0. Forty-seventh
    session (H100, pack_gqa_ab_wide_varlen_s47_h100.json), a decode batch of 64 sequences of
    one row over 8k keys each, 32 / 8 heads: keys from pages of 16 (cu_seqlens_q,
    seqused_k, page_table) 750.2 / 697.6, pages of 64 696.2 / 680.1, packed keys used to
    seqused_k 690.4 / 675.3 (the KV-cache decode view of the same data 695.7, 679.7, 675.3)."""
    return True


# the portable thread-block cluster size: the most splits the kernel merges in a cluster
MAX_CLUSTER_SPLITS = 8


def fwd_split_cluster(num_splits: int, head_dim_v: int) -> bool:
    """Whether a split-KV forward merges its splits inside a thread-block cluster
    (InputFeatures.split_cluster: the leader reads its peers' partials through distributed
    shared memory and writes out / lse) rather than through fp32 partials in global memory and
    the PDL-launched combine kernel. The kernel takes up to MAX_CLUSTER_SPLITS; the rule takes
    two. H200, decode (one new token, 32 / 8 heads, D=128), round-robin under CUDA graphs of
    ten calls, us per call, partials / cluster (decode_split_cluster_ab{,_b}_h200.json): B=8
    Sk=8k 2 splits 65.1 / 63.7 and 65.4 / 64.0, B=4 Sk=16k 2 splits 90.1 / 87.9; 3 splits
    (B=8) 70.1 / 69.7; 4 splits (B=4 Sk=16k, the split count's own pick) 65.3 / 71.9 and 65.1
    / 71.8, and 8 splits lose too (B=1 Sk=32k: 52.1 against 36.5 for 16 split partials).
    Clusters of 3 / 4 / 8 on the one-CTA-per-SM decode tile lose more (77.7, 94.0, 48.0).
    Not at Dv = 256, where the merge's loads beside the 128-float O fragment make ptxas
    spill (125 spill instructions, sm_90a; none at Dv <= 192)."""
    return num_splits == 2 and head_dim_v <= 192


# BwdTileConfig.pre_overlap: the persistent preprocess's CTAs (one an SM; run_bwd keeps it to
# at most half the SMs). Round-robin on an H100, TFLOP/s, 16 / 32 CTAs (48 and 66 lost to 32
# at every shape but D=96 16k causal, tune_bwd_pre_overlap_s57_h100.json): D=128 4k 599.9 /
# 599.8, 4k causal 517.4 / 516.7, 1k 473.0 / 467.5, D=96 16k causal 528.9 / 530.2, D=64 4k
# 535.2 / 534.9 (tune_bwd_pre_overlap_b_s57_h100.json); D=128 16k causal 620.4 / 609.7, 16k
# 628.3 / 628.7, D=64 16k causal 554.5 / 547.9, D=96 16k 565.3 / 560.7, D=128 1k causal
# 299.0 / 301.8 (tune_bwd_pre_overlap_c_s57_h100.json)
BWD_PRE_CTAS = 16
# BwdTileConfig.tail_split's model (arch/common/tail_model.py): at most 4 parts a key tile,
# and a part's fixup (its 2 x 64 KB fp32 partial written, the last part's reads of the
# others') costed as two query tiles' steps. Neither measured on its own: the A/B in
# bwd_tile_config's tail_split comment took the model's splits as they are
BWD_TAIL_MAX_PARTS = 4
BWD_TAIL_FIXUP_STEPS = 2
# ... and under post_overlap, whose postprocess already runs on the last wave's idle SMs, no
# split of walks shorter than this many query tiles: D=128 4k (52) lost 0.6-1.4% split, 16k
# (205) gained 1.2-1.9% (bwd_tile_config's tail_split comment); 8k (102) not measured
BWD_TAIL_MIN_STEPS_POST = 128


@dataclasses.dataclass(frozen=True)
class BwdTileConfig:
    """Static shape of one backward variant. A CTA owns tile_n keys and walks the query tiles
    of tile_m rows that see them. Without dkv_swap_ab each consumer warpgroup owns 64 of the
    keys (tile_n = 64 per warpgroup); with it the warpgroups split the query columns of S^T
    and the head dims of dK^T / dV^T (the layout for head dims past 128), or with
    sdp_swap_ab=False the keys of S and of dK^T / dV^T."""

    tile_m: int = 64  # query rows per mainloop iteration
    tile_n: int = 128  # keys per CTA
    num_stages: int = 2  # Q (with lse) and dS smem stages (dS: one under single_ds)
    do_stages: int = 2  # dO (with D) and, under dkv_swap_ab, P smem stages
    num_mma_warpgroups: int = 2
    # walk the query tiles that see every key of the CTA's tile as a loop of their own,
    # without mask code or a per-tile test (the forward's switch of the same name)
    split_mask_loops: bool = False
    # the forward's switch of the same name, on S^T / S. On everywhere: round-robin, TFLOP/s,
    # bits / compares (tune_bwd_mask_bits{,_win,_win_b}_h200.json): causal D=64 4k 470.6 /
    # 467.1, D=128 4k 517.9 / 517.6, 16k 607.6 / 607.6, D=256 4k 380.1 / 379.7; window
    # (1024, 0) D=64 4k 381.9 / 375.7, 16k 381.2 / 375.0, D=96 4k 353.7 / 352.0, D=128 4k
    # 426.1 / 421.9, 1k 334.0 / 330.8, D=192 4k 350.4 / 349.2, D=256 4k 316.4 / 316.3
    mask_bits: bool = True
    # swizzle (bytes) of the fp32 dQ staging tile. A half-warp's 64-bit accumulator stores
    # cover 4 rows x 32 B: the 128-byte swizzle maps rows 2i and 2i + 1 onto the same banks
    # (ncu, D=128 16k causal: every dQ store 2-way conflicted, 4 wavefronts instead of 2);
    # with 32-byte rows the 4 rows fill one 128-byte line
    dq_swizzle: int = 32
    # 0: the tiles span the problem's head dims. Else each head dim of the tiles (smem, TMA
    # boxes, wgmma M / N) is the tensor's rounded up to a multiple of this: TMA fills the
    # columns past a tensor's head dim with zeros on every load and drops them on every store
    # and reduce-add, so the extra products are exact zeros that never reach memory. S^T and
    # dP^T, whose k-steps run over the head dims, stop at the tensors' own
    padded_head_dim: int = 0
    # dK^T += Q^T dS and dV^T += dO^T P (both operands from smem, P staged there too): the
    # accumulators hold head-dim rows split over the warpgroups (64 x tile_n per warpgroup
    # and 64 rows of head dim), so D = 256 needs 2 x 64 fp32 registers a thread for dK and dV
    # instead of 2 x 128. S^T / dP^T split their query columns over the warpgroups.
    dkv_swap_ab: bool = False
    # stage dQ (fp32) by the warpgroups' head-dim halves, each handed to the writer on its own
    # barriers: with dq_stages = 1 the warpgroups take turns on one (tile_m, D / 2) buffer,
    # which halves the staging smem (64 KB -> 32 KB at D = 256); with 2 each has its own
    dq_half_staging: bool = False
    # half buffers under dq_half_staging (1 shared, 2 one per warpgroup). Two alternating
    # whole-tile buffers without it were measured and removed: no faster at D=128
    # (tune_bwd_lse_dq2_h200.json)
    dq_stages: int = 1
    # dQ^T = K^T dS^T: the warpgroups' 64-row wgmma tiles are dQ's head-dim halves and the
    # query rows are its N, so tile_m need not be a multiple of 64 (FA3's 80-row D=128 tile).
    # Each warpgroup stages its half through a transposed view of its buffer
    # (dq_half_staging, dq_stages = 2); 32-bit stores, conflict-free under the 128-byte
    # swizzle. Without dq_half_staging (a 64-column head dim) the warpgroups split dQ^T's
    # query columns and stage the whole tile
    dq_swap_ab: bool = False
    # > 0: launch a dense grid in L2 sections (arch/common/schedule.py) of as many (head,
    # batch) pairs as fit this many bytes of Q, dO, lse, D and the dQ accumulator, key tile
    # 0 of every pair in a section first (under a causal mask the longest CTAs); 0: pair after
    # pair, each pair's key tiles in order. In the deterministic order (key tiles by rank,
    # right to left under a causal mask) it also spaces a pair's consecutive key tiles, whose
    # dQ turns follow each other, a section's width apart in the launch order
    l2_section_bytes: int = 0
    # 0: dQ^T's head-dim rows are the tiles' head dim. Else (dq_swap_ab with dq_half_staging)
    # K's smem tile spans this many columns, zero-filled by TMA past the tensor's, so dQ^T =
    # K^T dS^T keeps its two 64-row wgmma tiles while S^T, dP^T, dV and dK run over the
    # problem's own head dim (D = 96: a fifth less MMA work than the padded D = 128 tiles)
    dq_head_dim: int = 0
    # under dkv_swap_ab: True, S^T = K Q^T (the 64 keys as wgmma M, the warpgroups split the
    # query columns); False, S = Q K^T with the warpgroups splitting the keys (N = tile_n / 2
    # each), and dK^T / dV^T the same keys: each warpgroup's head-dim rows span the whole
    # head dim (any multiple of 64, so D = 192 without padding) and tile_n may be 96
    sdp_swap_ab: bool = True
    # dS in one smem buffer instead of one per Q stage: a warpgroup overwrites its part of it
    # only after the other warpgroup's dQ / dK GEMMs of the previous query tile read it (a
    # pair of named barriers, FlashBwdSm90.mma). Frees tile_m x tile_n x 2 bytes (12 KB at
    # 64 x 96) for a dQ half buffer per warpgroup at D = 192
    single_ds: bool = False
    # dq_swap_ab only: stage each thread's dQ^T accumulator in register order (128-bit stores,
    # 4 contiguous floats a 2 x 2 block; arch/common/dq_flat.py) and add the tile into a
    # (batch, head, row, dim) accumulator as one contiguous run; the postprocess puts the
    # elements back in (row, dim) order. Without it: 32-bit stores into a swizzled (row, dim)
    # tile (dq_swizzle)
    dq_flat: bool = False
    # dq_flat whose warpgroups split the query columns (no dq_half_staging, D = 64): each
    # warpgroup's columns are a contiguous half of the flat tile, which it hands to the writer
    # on barriers of its own and the writer adds as a run of its own, so neither warpgroup
    # waits for the other's staging or for the add of the other's half
    dq_wg_handoff: bool = False
    # dq_flat with dq_head_dim: the writer adds only the warp runs of the flat tile that hold
    # the tensor's head dims (dq_flat.DqFlatTile.live_warps), in boxes of those runs, not dQ^T's
    # zero rows past it (D = 96: 36 of the tile's 48 KB), and the accumulator holds only those
    # runs (a compact DqFlatTile: 96 floats a row, not 128). The postprocess never reads the
    # zero rows either way
    dq_skip_zero_rows: bool = False
    # issue the next query tile's S^T = K Q^T right after this tile's dQ^T is staged, before
    # the wait for this tile's dK, so the tensor cores have it queued behind dK while the
    # warpgroup stages dQ^T and loops (FA4 waits for dK first). The S^T accumulator lives
    # across the loop's back edge and dQ^T accumulates in it (FlashBwdSm90.mma); built for
    # the dK / dV register tiles walked in one loop (not dkv_swap_ab, not split_mask_loops)
    s_under_dk: bool = False
    # the postprocess (dQ to 16 bits) launched as a programmatic dependent of the main
    # kernel: each main CTA allows it to start at once (griddepcontrol.launch_dependents) and
    # counts itself done per query head once its dQ adds have landed; a postprocess CTA waits
    # for its head's count, so it converts on the SMs the main grid's last wave leaves idle
    # instead of after the whole grid. Dense (counts in sem after the deterministic turns)
    post_overlap: bool = False
    # the preprocess as a persistent grid of BWD_PRE_CTAS CTAs (one an SM) that the main
    # kernel, its programmatic dependent, runs beside on the other SMs; each main CTA's load
    # and dQ-writer warps wait per query head for the rows the preprocess counts ready
    # (arch/common/bwd_preprocess.py). Dense (like post_overlap)
    pre_overlap: bool = False
    # dQ writer warps: 1, or 2 / 3 taking the walk's query tiles in turn (the producer
    # warpgroup's third and fourth warps are otherwise idle), each with its own handoff
    # barriers. In the deterministic order each waits for its tile's adds to land before
    # handing the turn on; with more than one, that wait overlaps the others' next adds, and
    # the staging buffer goes back as soon as the add has read it
    dq_writers: int = 1
    # deterministic order: each writer polls its next tile's turn before it waits for the
    # consumers to stage that tile's partial, not after, so a turn that came while they
    # computed costs no acquire load's L2 round trip between the handoff and the add (the
    # staging buffer is held meanwhile; at D = 256 it is the one buffer both warpgroups share)
    det_poll_early: bool = False
    # the grid's last partial wave of key tiles (launch order) split by query tiles over
    # several CTAs (arch/common/tail_model.py picks how many at run time), each
    # storing its fp32 dK / dV partial to a workspace; the tile's last part to finish adds the
    # partials in part order (so dK / dV stay bitwise the same run to run) and stores them.
    # Not in the deterministic order (its dQ turns are per key tile), L2 sections (their
    # launch order), packed sequences or group_heads
    tail_split: bool = False
    # L2 sections: the grid's last k sections launched as one (rank-major over their pairs),
    # so the last pairs' longest key tiles start before the grid's last wave, not in it; their
    # working set is k sections' while they run (arch/common/schedule.py, L2Sections.create)
    l2_last_sections: int = 1

    def __post_init__(self):
        if self.l2_last_sections < 1 or (self.l2_last_sections > 1 and not self.l2_section_bytes):
            raise ValueError(f"l2_last_sections {self.l2_last_sections}: 1, or more with sections")
        if self.s_under_dk and (self.dkv_swap_ab or self.split_mask_loops):
            raise ValueError(
                "s_under_dk is built for the dK / dV register tiles in one loop: no dkv_swap_ab"
                " or split_mask_loops"
            )
        if self.dq_flat and not self.dq_swap_ab:
            raise ValueError("dq_flat stages dQ^T's accumulator: needs dq_swap_ab")
        if self.dq_wg_handoff and not (self.dq_flat and not self.dq_half_staging):
            raise ValueError("dq_wg_handoff hands over query-column halves: dq_flat without halves")
        if self.dq_skip_zero_rows and not (self.dq_flat and self.dq_head_dim):
            raise ValueError("dq_skip_zero_rows skips dq_head_dim's rows of a dq_flat tile")
        if self.dq_writers not in (1, 2, 3):
            raise ValueError(f"dq_writers {self.dq_writers}: 1, 2 or 3")
        if self.dq_stages not in (1, 2):
            raise ValueError(f"dq_stages {self.dq_stages} must be 1 or 2")
        if self.dq_stages == 2 and not self.dq_half_staging:
            raise ValueError("dq_stages = 2 is a half buffer per warpgroup: set dq_half_staging")
        if self.padded_head_dim not in (0, 128):
            raise ValueError(f"padded_head_dim {self.padded_head_dim} must be 0 or 128")
        if self.dq_swizzle not in (32, 64, 128):
            raise ValueError(f"dq_swizzle {self.dq_swizzle} must be 32, 64 or 128 (bytes)")
        if self.dq_head_dim and not (self.dq_swap_ab and self.dq_half_staging):
            raise ValueError(
                "dq_head_dim pads dQ^T's head-dim halves: needs dq_swap_ab and dq_half_staging"
            )
        if self.dq_head_dim and self.padded_head_dim:
            raise ValueError("dq_head_dim pads K's tile only; padded_head_dim pads every tile")
        if self.dkv_swap_ab and self.dq_swap_ab:
            raise ValueError("dkv_swap_ab splits dQ's head dim already: no dq_swap_ab")
        if not self.sdp_swap_ab and not self.dkv_swap_ab:
            raise ValueError("sdp_swap_ab = False (S = Q K^T) needs dkv_swap_ab")
        if self.dkv_swap_ab:
            # S^T's 64 key rows are one wgmma M and its query columns split over the
            # warpgroups, or S's 64 query rows are and its keys split (N a multiple of 16 for
            # the 16 x 16 stmatrix blocks of P and dS); dQ (64 rows) splits its head dim
            if self.tile_m != 64:
                raise ValueError("dkv_swap_ab takes tile_m = 64")
            if self.sdp_swap_ab and self.tile_n != 64:
                raise ValueError("dkv_swap_ab with S^T takes tile_n = 64")
            if not self.sdp_swap_ab and self.tile_n not in (64, 96):
                raise ValueError(f"dkv_swap_ab with S takes tile_n 64 or 96, not {self.tile_n}")
            if self.num_stages not in (1, 2) or self.do_stages not in (1, 2):
                raise ValueError(f"stages ({self.num_stages}, {self.do_stages}) must be 1 or 2")
            if self.do_stages > self.num_stages:
                # not an ordering need (FlashBwdSm90.mma orders P by dO's pipeline, dS by Q's):
                # the GPU tests ran (2, 1) and (2, 2), the table's, and nothing else is built
                raise ValueError("do_stages must not exceed num_stages")
            return
        if self.tile_n != 64 * self.num_mma_warpgroups:
            raise ValueError(f"tile_n {self.tile_n} must be 64 * num_mma_warpgroups")
        if self.dq_swap_ab:
            # query rows are the N of S^T / dP^T / dQ^T and the K of dV / dK (16-row steps)
            if self.tile_m % 16 or not 16 <= self.tile_m <= 128:
                raise ValueError(f"dq_swap_ab takes tile_m {self.tile_m}: 16..128, step 16")
            if self.dq_half_staging and self.dq_stages != 2:
                raise ValueError("dq_swap_ab stages each warpgroup's half (dq_stages = 2)")
        elif self.tile_m not in (64, 64 * self.num_mma_warpgroups):
            # dQ's wgmma takes 64 rows per warpgroup: split over rows or over the head dim
            raise ValueError(f"tile_m {self.tile_m} must be 64 or 64 * num_mma_warpgroups")
        if self.dq_half_staging and self.tile_m != 64 and not self.dq_swap_ab:
            # the halves are the warpgroups' head-dim halves of dQ: dQ split by head dim
            raise ValueError("dq_half_staging needs tile_m = 64 (dQ split by head dim)")
        if self.num_stages != 2 or self.do_stages != 2:
            raise ValueError("the backward double-buffers Q, dO and dS: num_stages must be 2")

    def tile_head_dims(self, head_dim: int, head_dim_v: int) -> tuple[int, int]:
        """The head dims the kernel's tiles span for a problem's (head_dim, head_dim_v)."""
        if self.padded_head_dim:
            m = self.padded_head_dim
            return -(-head_dim // m) * m, -(-head_dim_v // m) * m
        return head_dim, head_dim_v

    def dq_flat_tile(self, head_dim: int) -> DqFlatTile | None:
        """The flat dQ tile (dq_flat) for the tensors' `head_dim`, else None; compact (only
        the runs of the tensor's head dims in the accumulator) under dq_skip_zero_rows."""
        if not self.dq_flat:
            return None
        halves = self.dq_half_staging
        wgs = self.num_mma_warpgroups
        dims = head_dim if self.dq_skip_zero_rows and head_dim < self.dq_head_dim else 0
        return DqFlatTile(self.tile_m, 2 if halves else 1, 1 if halves else wgs, dims)

    @property
    def dq_units(self) -> int:
        """The dQ writer's units a tile (one handoff each): a warpgroup's part
        (dq_half_staging) or query-column half (dq_wg_handoff), else the whole tile."""
        return self.num_mma_warpgroups if self.dq_half_staging or self.dq_wg_handoff else 1

    def dq_tile_head_dim(self, head_dim: int) -> int:
        """The head dim of K's smem tile and of dQ^T's rows (staging, reduce-add boxes)."""
        return max(self.tile_head_dims(head_dim, head_dim)[0], self.dq_head_dim)

    @property
    def row_stage_stride(self) -> int:
        """fp32 elements from one smem stage of the lse / D row vectors to the next: tile_m
        rounded up to 128 bytes, as a TMA destination must be aligned (80 rows: 320 B)."""
        return -(-self.tile_m // 32) * 32

    def tail_slot_floats(self, head_dim: int, head_dim_v: int) -> int:
        """fp32 elements of one part's dK / dV partial in the tail_split workspace."""
        head_dim, head_dim_v = self.tile_head_dims(head_dim, head_dim_v)
        return self.tile_n * (head_dim + head_dim_v)

    def smem_bytes(self, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> int:
        dk = self.dq_tile_head_dim(head_dim)
        head_dim, head_dim_v = self.tile_head_dims(head_dim, head_dim_v)
        sq, sdo = self.num_stages, self.do_stages
        q = sq * self.tile_m * head_dim * elem_bytes
        do = sdo * self.tile_m * head_dim_v * elem_bytes
        kv = self.tile_n * (dk + head_dim_v) * elem_bytes
        # dS, and P when dK / dV take it from smem
        ds_stages = 1 if self.single_ds else sq
        ds = (ds_stages + sdo * self.dkv_swap_ab) * self.tile_m * self.tile_n * elem_bytes
        # fp32 staging for the dQ reduce-add
        dq = self.dq_stages * self.tile_m * dk * 4 // (1 + self.dq_half_staging)
        rows = (sq + sdo) * self.row_stage_stride * 4  # lse and D per query row
        return q + do + kv + ds + dq + rows + 1024


# Without dkv_swap_ab, dK and dV accumulate in registers as 64 keys x D per warpgroup, twice:
# D <= 128. D = 96 runs its own tiles with dQ^T, whose two 64-row head-dim halves read a
# 128-column K tile (BwdTileConfig.dq_head_dim); under softcap (dQ = dS K) it runs the D = 128
# tiles (padded_head_dim): its own would split dQ's head dim over two warpgroups as N = 48,
# which the MN-major (transposed K) wgmma operand cannot take with a 64-byte swizzle, and 128
# query rows (dQ split by rows) need 256 KB of smem. Head dims past 128 take dkv_swap_ab
# (dK^T / dV^T as head-dim rows): D = 256 with S^T, its 64-row wgmma tiles split over the two
# warpgroups; D = 192 with S = Q K^T (sdp_swap_ab=False), each warpgroup all three 64-row tiles
# over its own keys.
BWD_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 192), (192, 128), (256, 256))
# the backward's L2 sections (bwd_tile_config) and the largest GQA group that a causal grid
# runs grouped (bwd_group_heads)
BWD_L2_SECTION_BYTES = 32 * 1024 * 1024


def bwd_l2_row_bytes(head_dim: int, head_dim_v: int) -> int:
    """An L2 section pair's working set a query row: Q, dO, the fp32 dQ accumulator, lse and
    D of one query head (a group_heads CTA walks its query heads one at a time)."""
    return 2 * head_dim + 2 * head_dim_v + 4 * head_dim + 8


BWD_GROUP_MAX_MASKED = 4
# the longest dense query lengths that take the short-rows tiles (bwd_short_rows): causal at
# D = 128, causal at D = 96, unmasked at D = 96
BWD_SHORT_ROWS_MAX_SEQLEN = 2048
BWD_SHORT_ROWS_MAX_SEQLEN_D96 = 8192
BWD_SHORT_ROWS_MAX_SEQLEN_D96_UNMASKED = 1024


def bwd_short_rows(
    head_dim: int,
    causal: bool,
    local: bool,
    deterministic: bool,
    varlen: bool,
    group_heads: bool,
    seqlen_q: int,
) -> bool:
    """Whether a backward call takes 64 query rows where the table's tile has more (D = 96:
    96, D = 128: 80; both dQ^T = K^T dS^T), with s_under_dk (bwd_tile_config): dense causal
    problems of at most BWD_SHORT_ROWS_MAX_SEQLEN query rows at D = 128 and
    BWD_SHORT_ROWS_MAX_SEQLEN_D96 at D = 96, and unmasked ones of at most
    BWD_SHORT_ROWS_MAX_SEQLEN_D96_UNMASKED at D = 96. There the causal diagonal and the last,
    partly filled query tile are a larger share of each CTA's walk, and the shorter tile wastes
    less of both; its smaller GEMMs leave the tensor cores idle longer while a warpgroup stages
    dQ^T, which s_under_dk fills with the next S^T.

    First without s_under_dk: round-robin on the H200, TFLOP/s, the table's rows / 64 rows
    (tune_bwd_short_rows_h200.json, bf16, 2048 model dims): D=96 1k causal 298.6 / 310.3, 2k
    causal 379.3 / 389.8; D=128 1k causal 346.2 / 354.4, 2k causal 463.9 / 470.0; same
    gradients (err columns). Not where 64 rows lost or tied: D=96 4k causal 456.5 / 449.5,
    D=128 4k causal 509.0 / 510.8, D=96 1k unmasked 408.4 / 399.6 (same file).

    With s_under_dk on the 64 rows, round-robin on an H100, TFLOP/s, the table's rows / 64
    rows / 64 rows with s_under_dk (tune_bwd_sdk_short_b_s54_h100.json,
    tune_bwd_sdk_rows_s54_h100.json, tune_bwd_sdk_short_s54_h100.json,
    tune_bwd_sdk_m64_s54_h100.json; same gradients): D=96 causal 1k 237.1 / 279.3 / 285.0, 2k
    346.3 / 367.7 / 385.5, 4k 445.3 / 434.4 / 462.0 (and 430.9 / - / 446.3), 8k 493.5 / 464.7 /
    498.2 (and 480.3 / - / 484.7), but 16k 537.3 / 487.5 / 533.0; D=128 causal 1k 305.3 /
    311.6 / 312.5, 2k 413.0 / 414.0 / 417.5, 4k 495.9 / 492.0 / 499.2 (+0.7%: left at 80
    rows), 16k 615.6 / 582.0 / 598.1; D=96 unmasked 1k 378.8 / 389.9 / 396.8, 2k 457.0 / 446.7
    / 459.8 (+0.6%: left at 96 rows), 4k 514.4 / - / 498.9, 16k 555.3 / - / 524.0; D=128
    unmasked (80 rows with s_under_dk) 4k 573.6 / - / 563.3, 16k 621.1 / - / 601.6. The
    deterministic order, windows, group_heads (already 64 rows at D=128) and packed sequences
    (whose longest sequence would pick it for all) were not measured: they keep the table's
    tile."""
    if head_dim not in (96, 128) or local or deterministic or varlen or group_heads:
        return False
    if not causal:
        return head_dim == 96 and seqlen_q <= BWD_SHORT_ROWS_MAX_SEQLEN_D96_UNMASKED
    limit = BWD_SHORT_ROWS_MAX_SEQLEN_D96 if head_dim == 96 else BWD_SHORT_ROWS_MAX_SEQLEN
    return seqlen_q <= limit


def bwd_group_heads(
    qhead_per_kvhead: int,
    head_dim: int,
    causal: bool,
    local: bool,
    deterministic: bool,
    varlen: bool,
    num_ctas: int,
    num_sms: int,
) -> bool:
    """GQA / MQA backward: whether a CTA per KV head walks its query heads (dK / dV summed in
    registers, stored once per KV head) instead of a CTA per query head whose dK / dV a torch
    sum adds up afterwards. local: a window other than the causal corner; num_ctas: the
    grouped grid (key tiles x KV heads x batch).

    Unmasked (tune_bwd_group_heads_h200.json, round-robin, bf16, ms, per query head + sum /
    grouped), 32 / 8 heads at D=128: 16k 20.06 / 19.80, 4k x 4 5.05 / 4.90, 1k x 16 1.67 /
    1.39, 1k x 2 (128 grouped CTAs) 0.233 / 0.183, but 1k x 1 (64 CTAs) 0.124 / 0.148; D=64 4k
    3.02 / 2.87, D=256 (16 / 4) 4k 7.14 / 6.99; MQA 1k x 2 (16 CTAs) 0.226 / 1.021. So a grid
    of at least 3/4 of the SMs (between the 64 CTAs that lost and the 128 that won on 132).

    Causal: a grouped CTA of key tile 0 is G times the longest ungrouped one, and launched head
    after head the last heads' longest CTAs start near the grid's end: 16k 9.30 / 10.04, 2k x
    2 0.459 / 0.521, MQA 4k 2.67 / 5.15 (same file). With L2 sections (bwd_tile_config: key
    tile 0 of a section's pairs first) it wins (tune_bwd_l2sec_*_h200.json, base / grouped
    with sections, ms): 32 / 8 at D=128 4k x 4 2.977 / 2.643, 2k x 2 0.518 / 0.408 and 0.457
    / 0.384, 1k x 4 0.315 / 0.263, 1k x 2 (128 CTAs) 0.182 / 0.173, 16k 10.49 / 9.95 (no
    sections there: one pair's working set fills the budget); D=64 4k x 4 1.665 / 1.516; D=256
    16 / 4 4k x 4 3.821 / 3.564. Larger groups lose: 64 / 8 at 4k x 2 2.936 / 3.368, 2k x 4
    1.725 / 1.890; 32 / 2 at 4k x 4 2.816 / 4.202; MQA 4k x 8 5.48 / 8.91. So causal takes
    groups of up to BWD_GROUP_MAX_MASKED. Packed sequences have sections too (sized by the
    longest sequence) and group the same way: the bench's 16-sequence causal 32 / 8 row at
    D=128 (varlen_bwd_sections_group_h200.json, ms, in rounds: per query head 14.83, with
    sections 14.77, grouped 13.91, grouped with sections 13.77). The deterministic order has
    no sections, and windows were not measured: those stay per query head. So does D=64: its
    causal grouped variant (128-row tiles, split mask loops, the head loop) makes ptxas spill
    32 B, reloaded 16 times an iteration; it measured faster even so (above), but a table
    variant must not spill (CI's compile check)."""
    if qhead_per_kvhead < 2 or local or 4 * num_ctas < 3 * num_sms:
        return False
    if causal:
        return not deterministic and qhead_per_kvhead <= BWD_GROUP_MAX_MASKED and head_dim > 64
    return True


def bwd_tile_config(
    head_dim: int,
    head_dim_v: int,
    causal: bool,
    local: bool,
    softcap: bool = False,
    deterministic: bool = False,
    group_heads: bool = False,
    varlen: bool = False,
    short: bool = False,
) -> BwdTileConfig:
    """Backward tuning table; pure function of static problem features (`group_heads`: the
    GQA form whose CTA walks a KV head's query heads, chosen by bwd_group_heads; `varlen`:
    packed sequences; `short`: the short causal bucket, chosen by bwd_short_rows)."""
    cfg = _bwd_tiles(
        head_dim, head_dim_v, causal, local, softcap, deterministic, group_heads, varlen, short
    )
    # L2 sections under the causal mask (BwdTileConfig.l2_section_bytes; key tile 0 of every
    # pair in a section first). Round-robin, ms, base / sections of 32 MiB
    # (tune_bwd_l2sec_h200.json, tune_bwd_l2sec_b_h200.json): D=128 4k 1.451 / 1.415, 1k 0.530
    # / 0.531, 16k 4.961 / 5.001 (one 16k pair fills 32 MiB: the same order); D=256 4k 1.867 /
    # 1.805, 1k 0.649 / 0.636; D=64 4k 1.619 / 1.600 and 1.629 / 1.620, but 1k 0.598 / 0.613
    # and 0.602 / 0.618: off at D=64 (where causal GQA also stays per query head, see
    # bwd_group_heads). D=96 and 192 take them as measured at 128 / 256, not measured on
    # their own tiles. Larger budgets: D=128 1k 0.580 with 128 MiB (sections of 64 pairs),
    # D=64 1k 0.700; every (head, batch) pair in one section (key tile major over the whole
    # grid): D=128 4k 2.060 ms against 1.387, the Q / dO / dQ working set no longer fits L2
    # (tune_bwd_lpt_h200.json). The deterministic order launches right to left instead
    # (below: its unmasked grids take sections of their own).
    if causal and not local and not deterministic and head_dim > 64:
        cfg = dataclasses.replace(cfg, l2_section_bytes=BWD_L2_SECTION_BYTES)
    # The unmasked deterministic order in L2 sections too: a key tile's dQ turn waits for the
    # pair's tile of the rank before, which sections launch a section's width (2^k pairs)
    # earlier instead of right before it, so it is that much further on its walk. Round-robin
    # on an H100, TFLOP/s, default order / deterministic without / with sections of 32 MiB
    # (tune_bwd_det_free_s58_h100.json, tune_bwd_det_sec_rows_s58_h100.json; same gradients):
    # D=128 4k 601.4 / 500.9 / 555.5, 1k 480.3 / 401.1 / 426.1, 16k 633.9 / 604.1 / 603.6 (one
    # pair a section); D=64 4k 544.4 / 432.2 / 522.5, 1k 429.5 / 344.9 / 395.8, 16k 556.0 /
    # 547.9 / 552.2. D=96 took 16 MiB: without / 32 / 16 / 8 MiB
    # (tune_bwd_det_sec_width_s58_h100.json, _c_): 1k 319.8 / 285.0 / 341.7 / 339.0, 4k 419.6
    # / 447.7 / 459.9 / 445.1 and 424.2 / 448.7 / 466.9 / -, 16k 496.9 / 496.8 / 490.7 / -;
    # D=128 and 64 kept 32 MiB, 32 / 16 / 24 MiB (_b_): D=128 4k 563.0 / 547.9 / 562.0, D=64 4k
    # 514.3 / 513.3 / 514.3, 1k 385.5 / 372.3 / 371.4. Not under a causal mask, whose turns run
    # right to left and whose sections then start each pair's longest tile last: 4k causal,
    # without / with, D=128 483.3 / 476.1, D=96 399.8 / 365.0; 1k causal, without / 16 / 32
    # MiB, D=96 233.3 / 219.9 / 189.1, D=128 297.4 / 292.1 / 280.1. Past D = 128 (sixtieth
    # session, H100, TFLOP/s, default order / deterministic without / 16 / 32 / 64 MiB;
    # tune_bwd_det_big_sec_s60_h100.json, and without / 32 MiB in tune_bwd_det_big_s60_h100.json):
    # D=256 4k 396.9 / 300.6 / 299.9 / 315.8 / 314.9 and 396.4 / 300.6 / - / 316.6, 1k 318.6 /
    # 228.2 / 247.5 / 264.8 / 243.1 and 319.4 / 224.9 / - / 264.3, 16k 410.7 / 328.6 / 334.6 /
    # 334.1 / 335.2; D=192 4k 475.1 / 395.7 / 425.3 / 416.9 / 406.8 and 473.4 / 393.4 / - /
    # 414.4: 32 MiB at D=256, 16 MiB at D=192 (whose (192, 128) form takes it unmeasured).
    # Under the causal mask, without / 32 MiB, D=256 4k 286.1 / 285.6, D=192 4k 367.6 /
    # 358.9. Windows, packed sequences and group_heads were not measured; softcap takes it
    # unmeasured (the same turns and launch order).
    if deterministic and not (causal or local or varlen or group_heads):
        half = head_dim in (96, 192)
        budget = BWD_L2_SECTION_BYTES // 2 if half else BWD_L2_SECTION_BYTES
        cfg = dataclasses.replace(cfg, l2_section_bytes=budget)
    # s_under_dk (the next query tile's S^T queued behind this tile's dK) on D = 128's
    # unmasked dense tiles. Two round-robin runs on an H100, TFLOP/s, table / s_under_dk
    # (tune_bwd_sdk_s54_h100.json, tune_bwd_sdk_b_s54_h100.json; same gradients): 16k 607.4 /
    # 626.5 and 611.4 / 623.0, 8k 580.5 / 590.4, 4k 571.9 / 579.9 and 540.3 / 548.7, 1k 436.0 /
    # 440.9 and 425.2 / 429.3, GQA 32/8 4 x 4k (group_heads) 552.7 / 560.6. Not where it lost
    # or tied: D=128 causal 4k 493.3 / 490.2, 16k 612.3 / 604.8, 2k (short rows) 406.3 /
    # 403.7, GQA causal 485.4 / 482.6; deterministic 4k causal 469.8 / 458.5; D=96 4k 513.0 /
    # 510.2, 16k 550.9 / 545.0, causal within 0.5%; D=64 4k 508.2 / 506.4, 16k 537.7 / 535.5
    # (at D=64 causal ptxas serializes its wgmmas). Windows, softcap and packed sequences
    # were not measured.
    # The short-rows tiles (bwd_short_rows, its measurements) take it too; short=True
    # changes nothing past D = 96 / 128, where bwd_short_rows never sets it.
    if not (local or softcap or deterministic or varlen) and (
        (short and head_dim in (96, 128)) or (head_dim == 128 and not causal)
    ):
        cfg = dataclasses.replace(cfg, s_under_dk=True)
    # post_overlap (the postprocess converts each (batch, head) once its main CTAs are done,
    # on the SMs the main grid's last wave leaves idle). Round-robin on an H100, TFLOP/s,
    # table / post_overlap (tune_bwd_post_overlap_s56_h100.json; same gradients): D=128 4k
    # 579.5 / 589.6, 4k causal 504.2 / 510.9, 16k 628.4 / 621.3, 16k causal 615.6 / 618.2;
    # D=96 4k 515.1 / 527.2, 16k causal 533.0 / 537.5, 4k causal (short rows) 459.7 / 471.3;
    # D=64 4k 521.0 / 530.6; again with the postprocess's 512 ns back-off
    # (tune_bwd_post_overlap_b_s56_h100.json): D=128 16k 629.4 / 628.5, 4k 567.7 / 574.1.
    # Dense (the deterministic order too: below), head dims up to 128 (not measured past)
    if not varlen and head_dim <= 128:
        cfg = dataclasses.replace(cfg, post_overlap=True)
    # pre_overlap (the preprocess as a persistent grid of BWD_PRE_CTAS CTAs beside the main
    # grid, which waits per query head for its rows). Round-robin on an H100, TFLOP/s, off /
    # 32 CTAs (tune_bwd_pre_overlap_s57_h100.json, same gradients): D=128 4k 575.3 / 597.3,
    # 16k 625.8 / 633.2, 4k causal 502.9 / 522.3, 1k 416.9 / 432.6; D=96 4k causal 456.9 /
    # 463.6, 16k causal 531.4 / 538.6; D=64 4k 523.4 / 537.9. Off / 16 CTAs
    # (tune_bwd_pre_overlap_c_s57_h100.json): D=128 16k causal 616.0 / 620.4, 16k 619.2 /
    # 628.3, 1k causal 291.4 / 299.0; D=96 16k 554.5 / 565.3; D=64 16k 551.7 / 555.5, 16k
    # causal 551.9 / 554.5. The domain of post_overlap (packed grids not built; not measured
    # past D = 128). In the deterministic order both (their counts after the turns in sem),
    # off / on (tune_bwd_det_overlap_s57_h100.json): D=128 4k 501.7 / 516.0, 4k causal 462.8
    # / 488.1, 16k causal 566.8 / 573.2; D=96 4k causal 384.4 / 401.2; D=64 4k 437.3 / 448.4
    if not varlen and head_dim <= 128:
        cfg = dataclasses.replace(cfg, pre_overlap=True)
    # dq_writers = 2 in the deterministic order: each writer waits for its tile's adds to land
    # before it hands the turn on, and with two that wait overlaps the other's add. Round-robin
    # on an H200, TFLOP/s, default order / default with 2 / deterministic / deterministic with
    # 2 (tune_bwd_dq_writers_s61_h200.json; same gradients): D=256 4k 400.7 / 401.4 / 338.8 /
    # 349.4, 4k causal 384.2 / 382.9 / 302.5 / 324.5, 1k 337.2 / 337.5 / 285.9 / 300.0; D=192
    # 4k causal 449.2 / 448.6 / 389.1 / 421.3, 4k 470.2 / 458.0 / 429.2 / 461.1; D=128 4k
    # causal 529.8 / 521.9 / 494.3 / 502.2; D=96 4k 537.9 / 532.4 / 504.9 / 526.1. Not in the
    # default order, whose writer waits only for the add to read its buffer (tied or lost
    # there). D = 64, windows, softcap, packed sequences and group_heads take it unmeasured
    # (the same writer; their GPU tests passed with it). Before it the sixty-first session
    # measured two other forms on an H100 that lost everywhere, and removed them: a turn per
    # writer unit (a second landed wait a tile: D=256 4k 317.2 -> 265.1 TFLOP/s) and two dQ
    # accumulators with a turn chain each (288.1 -> 239.8 at D=256 4k causal;
    # tune_bwd_det_chains_s61_h100.json)
    if deterministic:
        cfg = dataclasses.replace(cfg, dq_writers=2)
    # det_poll_early (each writer polls its turn before the consumers' handoff) at D = 256.
    # Round-robin on an H100, TFLOP/s, default order / deterministic / with det_poll_early
    # (tune_bwd_poll_early{,_quick}_s64_h100.json; same gradients): D=256 4k causal 369.0 /
    # 315.0 / 336.6 and 370.7 / 318.1 / 337.6, 4k 393.3 / 342.5 / 356.2 and 394.2 / 343.1 /
    # 356.3, 1k 282.9 / 251.8 / 267.8. Not where it tied or lost (deterministic / with it):
    # D=192 4k causal 405.5 / 406.7 and 415.3 / 416.9, D=128 4k causal 488.6 / 489.9, 4k
    # 565.7 / 563.8, D=96 4k 524.9 / 511.6, 4k causal 484.7 / 485.2, D=64 4k causal 469.6 /
    # 467.8 (tune_bwd_poll_early_small_s64_h100.json); three writers with it were no faster (D=256
    # 4k causal 334.2). Windows, softcap, packed sequences and group_heads take it unmeasured
    # (the same writer; their deterministic GPU tests at D = 256 passed with it)
    if deterministic and head_dim == 256:
        cfg = dataclasses.replace(cfg, det_poll_early=True)
    # tail_split (the last partial wave's key tiles split over CTAs; FlashBwdSm90._tail_fixup)
    # on unmasked D = 256 and D = 128. Round-robin on an H100, TFLOP/s, table / tail_split
    # with the model's split (tune_bwd_tail_split{,_b}_s64_h100.json; same gradients): D=256
    # 4k 390.9 / 395.4 and 389.2 / 394.1, 16k 391.9 / 401.7 (3 parts forced, the same split:
    # 393.7); D=128 16k 618.3 / 630.2 and 611.5 / 618.8. Where post_overlap runs its
    # postprocess on the last wave's idle SMs a split of shorter walks lost: D=128 4k 555.3 /
    # 552.2 and 567.4 / 559.4 (hence BWD_TAIL_MIN_STEPS_POST), D=96 4k 540.5 / 532.3, 16k
    # 558.9 / 556.7, D=64 4k 529.8 / 525.6, 1k 421.6 / 410.2: off there. D=192 (no
    # post_overlap), windows and softcap were not measured; group_heads, L2 sections and the
    # deterministic order are not built
    if head_dim in (128, 256) and not (
        causal or local or softcap or deterministic or varlen or group_heads
    ):
        cfg = dataclasses.replace(cfg, tail_split=True)
    return cfg


def _bwd_tiles(
    head_dim: int,
    head_dim_v: int,
    causal: bool,
    local: bool,
    softcap: bool,
    deterministic: bool,
    group_heads: bool = False,
    varlen: bool = False,
    short: bool = False,
) -> BwdTileConfig:
    """The backward table's tile shape, stages and dQ staging."""
    if (head_dim, head_dim_v) not in BWD_HEAD_DIMS:
        raise ValueError(f"SM90 backward has no variant for head dims ({head_dim}, {head_dim_v})")
    # dq_swizzle (tune_bwd_dqsw_h200.json, round-robin, TFLOP/s, 32 / 128 bytes): D=128 16k
    # causal 590 / 542, 16k 573 / 518, 4k 551 / 532, 1k 448 / 437; D=64 16k causal 518 / 481,
    # 4k 501 / 474, 1k causal 288 / 287. The deterministic order waits for each dQ add to land,
    # and the 32-byte swizzle's 8-float TMA boxes (4x as many) make that wait longer: 403 /
    # 508 at D=128 16k causal, 348 / 394 at D=64 4k, so it keeps the 128-byte swizzle.
    dq_swizzle = 128 if deterministic else 32
    if head_dim <= 64 and not softcap:
        # 128 query rows per iteration (FA3's D=64 shape): the S^T / dP^T wgmmas get N = 128
        # instead of 64. bench_bwd_d64_h200.json: 0.88-0.94x FA4 with it (0.28-0.68x in
        # bench_bwd_h200_v0.json with 64 rows, before the other v1 changes). With softcap the
        # tanh registers make ptxas spill 2 (57 with split_mask_loops), so it keeps 64 rows.
        # Windows took 64 rows too until dQ^T (below), with which 128 rows compile without
        # spills there; window (1024, 0), round-robin, TFLOP/s, 64 rows / 64 rows dQ^T / 128
        # rows dQ^T (tune_bwd_win_d64_h200.json): 4k 330 / 327 / 360, 16k 334 / 337 / 371.
        # split_mask_loops on under the causal mask (tune_bwd_causal_h200.json, round-robin,
        # TFLOP/s, on / off): 16k causal 497 / 485, 4k causal 425 / 417; deterministic 477 /
        # 472, 415 / 411. Without a mask it has nothing to split and its second loop copy makes
        # ptxas spill 6 registers: off there.
        # dQ^T = K^T dS^T (dq_swap_ab; the warpgroups split its 128 query columns) staged
        # with the 128-byte swizzle, against dQ = dS K (tune_bwd_d64_swap_h200.json,
        # round-robin, TFLOP/s, dQ / dQ^T): 16k 490 / 499, 16k causal 491 / 498, 4k 459 /
        # 470, 4k causal 421 / 432, 1k 383 / 395, 1k causal 278 / 290; deterministic
        # (tune_bwd_d64_swap_det_h200.json) 16k causal 463 / 495, 4k 411 / 431. Same
        # gradients (err columns).
        # dq_flat (register-order staging, 8 STS.128 instead of 32 STS a tile) alone buys
        # nothing here: round-robin, TFLOP/s, off / on (tune_bwd_dq_flat_h200.json): 4k 487.0
        # / 486.0, 4k causal 448.2 / 447.9, 16k 508.1 / 507.0, 16k causal 507.6 / 507.8, 1k
        # 396.5 / 395.4, 1k causal 294.4 / 293.0. What it enables does: each warpgroup's
        # query columns are a contiguous half of the flat tile, handed to the writer on its
        # own barriers (dq_wg_handoff), so a warpgroup no longer waits for the other's
        # staging and the add of both halves before it stages its next tile. Round-robin,
        # TFLOP/s, off / dq_flat / dq_flat with the handoff (tune_bwd_d64_handoff_h200.json):
        # 4k 483.0 / 483.4 / 513.4, 4k causal 434.4 / 433.8 / 466.7, 16k 499.9 / 505.4 /
        # 539.2, 16k causal 497.5 / 503.4 / 545.7, 1k 348.4 / 347.6 / 365.4, 1k causal 285.8 /
        # 284.5 / 295.6; deterministic, off / handoff (tune_bwd_d64_handoff_det_h200.json): 4k
        # causal 446.7 / 461.6, 16k 499.0 / 538.4, 1k 319.1 / 337.3; packed sequences
        # (tune_bwd_d64_handoff_varlen_h200.json): 4k causal 455.6 / 476.2, 4k 481.2 / 519.6.
        # Same gradients (err columns). Windows and group_heads, table / neither
        # (tune_bwd_d64_handoff_window_h200.json, tune_bwd_d64_handoff_group_h200.json):
        # window (1024, 0) 4k 367.1 / 346.1, 16k 378.5 / 354.3; GQA 32/8 4 x 4k with
        # group_heads 529.5 / 490.3.
        return BwdTileConfig(
            tile_m=128, split_mask_loops=causal and not local, dq_swizzle=128, dq_swap_ab=True,
            dq_flat=True, dq_wg_handoff=True,
        )  # fmt: skip
    if head_dim == 96:
        # The D = 128 dQ^T tile (every mask and order but softcap) with S^T, dP^T, dV and dK
        # over the 96 columns themselves; only K's smem tile, dQ^T's A operand (M = 2 x 64),
        # is 128 wide with zero columns (dq_head_dim): a fifth less MMA work than the padded
        # D = 128 tiles. Round-robin, TFLOP/s, 80 rows, own / padded
        # (tune_bwd_d96_own_h200.json): 16k 528 / 466, 16k causal 503 / 452, 4k 484 / 431, 4k
        # causal 425 / 387, 1k 362 / 329; same gradients (err columns). Its freed smem and
        # registers take 96 query rows spill-free, 80 / 96 / 64 rows in two runs
        # (tune_bwd_d96_rows_h200.json, tune_bwd_d96_rows2_h200.json): 16k 518 / 529 / 499
        # and 518 / 532, 16k causal 502 / 514 / 498 and 502 / 514, 4k 479 / 493 / 467 and 472 /
        # 483, 4k causal 407 / 421 / 416 and 417 / 428, 1k 382 / 382 / 375 and 378 / 379;
        # split_mask_loops on the 96 rows (second run): 16k causal 508, 4k causal 425, so
        # off. group_heads takes 96 rows too (round-robin, TFLOP/s, 64 / 80 / 96 rows / the
        # padded 64-row tile, 4 x 4k, 32 query heads, tune_bwd_grp_d96_h200.json: GQA 32/8
        # 478 / 500 / 512 / 462, GQA 32/8 causal 431 / 427 / 453 / 425, MQA 32/1 causal
        # 263 / 270 / 279 / 254; same gradients), unlike D = 128, whose 80 rows spill there.
        # Softcap's tile (dQ = dS K, 64 rows) runs on the 96 columns too: each warpgroup's
        # 48-column half of dQ starts on one of K's 32-byte swizzle atoms (FlashBwdSm90
        # builds K's tile so). Round-robin on an H100, TFLOP/s, softcap 30, the D = 128 tile
        # over zero-filled columns / its own (tune_bwd_d96_softcap_own_s55_h100.json, 20
        # reps; same gradients): 4k 440.1 / 458.7, 4k causal 386.6 / 415.1. Without softcap
        # the same dQ form on the 64-row tile lost to the padded dQ^T, padded / own
        # (tune_bwd_d96_unpadded_s55_h100.json): 4k causal 446.0 / 434.8, 16k causal 519.0 /
        # 505.8, 4k 498.4 / 471.8, 1k causal 283.6 / 262.5.
        # History: the padded D = 128 kernel had beaten D = 96's own tiles with dQ on one
        # warpgroup (N = 96, tune_bwd_d96_single_dq_h200.json: 16k 431 / 449), a variant since
        # removed.
        tile = _bwd_d128_tile(softcap, group_heads, dq_swizzle, short)
        if tile.dq_swap_ab:
            # dq_flat with the 96 rows as on D = 128's 80 (_bwd_d128_tile's measurement);
            # under group_heads (96 rows here, 64 at D = 128) taken without a measurement of
            # its own
            # dq_skip_zero_rows: the writer adds 36 of the flat tile's 48 KB, not dQ^T's zero
            # rows 96..127. Round-robin on an H100, TFLOP/s, off / on, default order and
            # deterministic (tune_bwd_skip_zero_s59_h100.json, _b_; same gradients): 4k 542.7 /
            # 552.4, det 457.5 / 505.6; 1k 367.1 / 378.3, det 323.8 / 353.4; 4k causal 462.6 /
            # 468.4, det 395.2 / 436.4; 16k causal 542.9 / 540.7, det 458.3 / 516.5; 16k 564.5 /
            # 557.0 (p95 10.7 / 10.9 ms: noisy), det 488.8 / 550.2; 1k causal (this 96-row
            # tile; bwd_short_rows takes 64 rows there) 241.1 / 263.1, det 236.1 / 261.7. Each
            # deterministic add waits for the one before it (its link of the turn chain), so
            # the bytes it skips count there most.
            rows = 64 if short else 96
            return dataclasses.replace(
                tile, tile_m=rows, dq_head_dim=128, dq_flat=rows > 64,
                dq_skip_zero_rows=rows > 64,
            )  # fmt: skip
        if deterministic:
            # the deterministic order's 128-byte dQ staging swizzle (above) spans 32 columns,
            # not a 48-column half: the D = 128 tile over zero-filled columns, as before
            return dataclasses.replace(tile, padded_head_dim=128)
        return tile  # softcap: dQ = dS K over the 96 columns (above)
    if head_dim == 192:
        # S = Q K^T with the warpgroups splitting 96 keys (sdp_swap_ab=False): dK^T / dV^T
        # over each warpgroup's own 48 keys and every 64-row tile of the head dim, so 192
        # needs no padding to 256 and a CTA keeps 96 keys (FA3's D = 192 tile shape).
        # Round-robin, TFLOP/s, 64 x 96 / the old 64 x 64 tiles padded to 256 / 64 x 64
        # with S (tune_bwd_d192_h200.json): D=192 4k 443 / 317 / 360, 4k causal 416 / 300
        # / 338, 1k causal 265 / 213 / 230, 16k causal 466 / 325 / 377; (192, 128) 4k 436 /
        # 288 / 329, 4k causal 394 / 278 / 310; same gradients (err columns). Then
        # (tune_bwd_d192_knobs_h200.json, base / variant): one dO stage with a dQ half
        # buffer per warpgroup at (192, 128) 418 / 462, causal 388 / 423, adopted (at D=192
        # the second half buffer does not fit); one Q stage for it 444 / 321; the 64-byte
        # dQ swizzle 444 / 435 (the 128-byte one as at D = 256, below); split_mask_loops 4k
        # causal 417 / 422, off: noise, as the unmasked (192, 128) 4k row, where no tile
        # needs a mask either way, read 418 / 434.
        # D=192 fits the dQ half buffer per warpgroup with one dS buffer (single_ds), base /
        # single_ds + dQ buffer per warpgroup (tune_bwd_d192_ds_h200.json): 4k 432 / 467, 4k
        # causal 400 / 430, 16k causal 449 / 498. (192, 128), base / single_ds / single_ds
        # with two dO stages (tune_bwd_d192v128_ds_h200.json): 4k 438 / 435 / 453, 4k causal
        # 409 / 406 / 401: kept as it was. Packed sequences at D=192 take single_ds with the
        # warpgroups' turns on one dQ half buffer: a buffer per warpgroup spills 5 registers
        # there (sm_90a; 8 / 2, 16 / 16 and 10 / 10 heads), and so did the two dS stages
        # before at 16 / 16 and 10 / 10 heads; one dS buffer spills at none of 8 / 2, 16 /
        # 16, 10 / 10, 32 / 8, 8 / 1. Packed 4 x 4k, 10 heads, round-robin, TFLOP/s, one /
        # two dS buffers (tune_bwd_varlen_d192_single_ds_h200.json): 444.3 / 446.8, causal
        # 424.7 / 418.9; same gradients.
        own_dq = head_dim_v == 128 or not varlen
        return BwdTileConfig(
            tile_m=64, tile_n=96, num_stages=2, do_stages=1, dkv_swap_ab=True,
            sdp_swap_ab=False, dq_half_staging=True, dq_stages=2 if own_dq else 1,
            dq_swizzle=128, single_ds=head_dim_v > 128,
        )  # fmt: skip
    if head_dim > 128:
        # D = 256: 64 x 64 tiles with dK^T / dV^T split over the warpgroups' head-dim rows
        # (see BWD_HEAD_DIMS). Two Q stages with dQ staged in halves. All of it in SM90's
        # 227 KB (218 KB).
        # The warpgroups take turns on one half-size dQ buffer, so the writer's reduce of the
        # first half must have read it before the second is staged: there the 128-byte
        # swizzle's 4 TMA boxes a half beat the 32-byte one's 16 (tune_bwd_d256_sw_h200.json,
        # round-robin, TFLOP/s, swizzle 32 / 64 / 128): D=256 16k 322 / 393 / 407, 16k causal
        # 320 / 405 / 416, 4k 304 / 375 / 399, 4k causal 292 / 343 / 355, 1k 273 / 321 / 336;
        # D=192 (then on these tiles, padded) 4k 282 / 294 / 305. One Q stage with a buffer
        # per warpgroup (no turns) lost: 4k 301 with the 32-byte swizzle, 281 with the
        # 128-byte (tune_bwd_d256_dq_h200.json).
        # split_mask_loops under the causal mask, off / on (tune_bwd_d256_split_h200.json):
        # 4k 372 / 370, 16k 408 / 408, 1k 262 / 261: off.
        return BwdTileConfig(
            tile_m=64, tile_n=64, num_stages=2, do_stages=1, dkv_swap_ab=True,
            dq_half_staging=True, dq_swizzle=128,
        )  # fmt: skip
    if head_dim <= 64:
        # D=64 with softcap: 64 x 128 with dQ = dS K, each warpgroup staging its 32-column
        # head-dim half. dQ^T on these 64 rows (the warpgroups split its query columns) did not
        # pay (tune_bwd_sc_d64_h200.json, softcap 30, round-robin, TFLOP/s, dQ / dQ^T): 4k
        # 413 / 404, 4k causal 373 / 373.
        return _bwd_64_rows(dq_swizzle)
    return _bwd_d128_tile(softcap, group_heads, dq_swizzle, short)


def _bwd_64_rows(dq_swizzle: int) -> BwdTileConfig:
    """64 x 128 with dQ = dS K, each warpgroup staging its head-dim half."""
    # D=128's tile until the 80-row one (_bwd_d128_tile), measured there: split_mask_loops
    # (bench_bwd_h200_v0.json, on / off): 16k causal 566 / 563, 4k causal 481 / 479, 1k causal 327 /
    # 328: within noise, off (it doubles the main loop's code). dQ staged per warpgroup: each stages
    # its head-dim half in a buffer of its own and hands it to the writer on its own barriers (the
    # same 32 KB as one whole-tile buffer), so neither waits for the other's half. Two round-robin
    # runs, TFLOP/s, whole tile / per warpgroup (tune_bwd_d128_dq_h200.json,
    # tune_bwd_d128_sw_h200.json): 16k 561 / 558 and 566 / 564, 16k causal 581 / 592 and 574 / 592,
    # 4k 545 / 556 and 529 / 547, 1k causal 330 / 335, 1k 434 / 443; with the 64- or 128-byte
    # swizzle it lost (16k causal 535, 536). Deterministic, whole tile / alternating whole tiles /
    # per warpgroup (128-byte swizzle): 16k 502 / 540 / 549, 16k causal 481 / 504 / 526, 4k 450 /
    # 461 / 475, 1k causal 294 / 307 / 305.
    return BwdTileConfig(dq_swizzle=dq_swizzle, dq_half_staging=True, dq_stages=2)


def _bwd_d128_tile(
    softcap: bool, group_heads: bool, dq_swizzle: int, short: bool = False
) -> BwdTileConfig:
    """D = 128 (and D = 96: dQ^T over K zero-filled to 128 columns, or softcap's tile on its
    own 96), every mask and order; softcap and group_heads excepted (below).

    80 x 128 with dQ^T = K^T dS^T (dq_swap_ab; FA3's non-causal D=128 tile). Round-robin on an
    H100 SXM (the lent machine of that session), TFLOP/s, 64 rows (the old table) / 64 rows
    with dQ^T / 80 rows with dQ^T / 80 rows with dQ^T and the 32-byte swizzle
    (tune_bwd_m80_h100.json): 16k 548 / 589 / 614 / 545, 4k 499 / 527 / 544 / 494, 1k 393 /
    414 / 422 / 389, 16k causal 544 / 585 / 605 / 541, 4k causal 452 / 488 / 489 / 442, 1k
    causal 280 / 305 / 298 / 272. Same gradients (err columns). GQA 32/8 (per query head +
    torch sum, 4 x 4k): 514 / 542 / 559, causal 447 / 484 / 480
    (tune_bwd_m80_d96_h100.json). Deterministic (tune_bwd_m80_det_h100.json): 16k 549 / 554
    / 618, 4k causal 453 / 467 / 483, 1k 358 / 367 / 380. The swapped dQ accumulator's
    rows are head dims, so each thread's two adjacent elements are two query rows of the
    staging tile: 32-bit stores, conflict-free only under the 128-byte swizzle (the 32-byte
    one, which is what the unswapped 64-bit stores need, loses 8-11%). Against the 64-row
    dQ^T the 80-row tile loses at 1k causal (-2.4%) and GQA 4k causal (-0.9%) only; one
    variant everywhere (the key has no length bucket for it). The tile fills the smem
    (231,936 B of 232,448) and 240 registers without spills.

    Under softcap (its tanh derivative) and group_heads (the head loop) the 80-row tile
    spills (26 and 7-10 spill instructions in bf16); the 64-row dQ^T does not.

    The 80- and 96-row tiles stage dQ^T in register order (dq_flat): 10 / 12 STS.128 a
    thread and tile instead of 40 / 48 STS. Round-robin, TFLOP/s, off / on, same gradients
    (tune_bwd_dq_flat_h200.json, tune_bwd_dq_flat_1k_h200.json): D=128 16k 588.9 / 601.1,
    16k causal 590.9 / 599.1, 4k 568.8 / 565.2, 4k causal 515.6 / 513.9, 1k 449.5 / 452.8
    and 490.2 / 490.5; D=96 16k 521.8 / 549.8, 16k causal 503.7 / 520.9, 4k 495.0 / 511.8
    and 503.8 / 517.9, 4k causal 442.5 / 445.3, 1k 418.2 / 405.5 (-3%, kept: the key has no
    length bucket for unmasked calls). The 64-row tiles (short causal, group_heads) keep the
    swizzled staging: D=128 1k causal 329.2 / 328.1, D=96 1k causal 287.5 / 271.7. With
    group_heads it beats the 64-row dQ = dS K tile (tune_bwd_grp_d128_h200.json,
    round-robin, TFLOP/s, dQ / dQ^T): MQA 32/1 4 x 4k causal 277 / 311, GQA 32/8 4 x 4k
    causal 521 / 524, 16k causal 572 / 568. Under softcap it was within 1.6% either way
    (tune_bwd_sc_d128_h200.json, softcap 30): 4k 531 / 538, 16k causal 554 / 549, 1k 418 /
    425, so softcap keeps dQ = dS K, the form its GPU tests ran longest. Short causal
    problems take 64 rows too (bwd_short_rows)."""
    if softcap:
        return _bwd_64_rows(dq_swizzle)
    return BwdTileConfig(
        tile_m=64 if group_heads or short else 80, dq_swap_ab=True, dq_swizzle=128,
        dq_half_staging=True, dq_stages=2, dq_flat=not (group_heads or short),
    )  # fmt: skip
