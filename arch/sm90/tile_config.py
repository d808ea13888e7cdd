"""Tile configuration and tuning table of the SM90 forward kernel (the backward's:
bwd_tiles.py).

`FwdTileConfig` is everything static about one kernel variant besides the problem's dtypes and
head dims; it is part of the compile key. `fwd_tile_config` is the tuning table: a pure
function of the problem's static features. Each branch cites the measurement behind it
(docs/perf/README.md has the numbers); a branch without a measurement says so.
"""

from __future__ import annotations

import dataclasses

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
