"""Tile configuration and tuning table of the SM90 backward kernel (the forward's:
tile_config.py).

`BwdTileConfig` is everything static about one backward variant besides the problem's dtypes,
head dims and head counts; it is part of the compile key (`cute_attn.bwd_sm90.BwdKey`).
`bwd_tile_config` is the tuning table: a pure function of the problem's static features and
of the run-time buckets `bwd_group_heads` (the GQA grid form, from the grid size) and
`bwd_short_rows` (the short causal tiles, from the query length). Each branch cites the
measurement behind it (docs/perf/README.md has the runs); a branch without a measurement says
so. Torch-free; the CPU tests are tests/test_tile_config.py.
"""

from __future__ import annotations

import dataclasses

from ..common.dq_flat import DqFlatTile

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
    # 64 x 96) for a dQ half buffer per warpgroup at D = 192, for a second dO stage at
    # (192, 128)
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
    # working set is k sections' while they run (arch/common/schedule.py, L2Sections.create);
    # only where a section holds at most BWD_L2_LAST_MAX_PAIRS pairs (decided at launch)
    l2_last_sections: int = 1
    # the query tiles aligned to the end of the sequence, where the bottom-right causal
    # diagonal is anchored, not to its start: tile m holds rows m * tile_m - s .. (m + 1) *
    # tile_m - s - 1 with s = (-seqlen_q) mod tile_m, so the partial tile is the first one
    # (every key tile's walk under the causal mask ends at the last tile, and only the
    # first key tiles' walks start at tile 0). The s rows before row 0 load as TMA zeros and
    # sit at the front of the padded per-row buffers (lse_log2 +inf, D 0, the flat dQ tiles'
    # first rows, which the postprocess skips); the mask sees seqlen_q rounded up to the
    # tile. Needs the flat dQ accumulator (whole padded tiles); dense only
    end_aligned: bool = False
    # the consumers convert and store dK / dV before they wait for the dQ writer's last add
    # to read its staging buffer (the wait only balances that arrive: the epilogue stages in
    # K / V's buffers, not sdQ), so the CTA's end overlaps the two instead of chaining them
    epilogue_first: bool = False
    # a persistent grid of this many CTAs (0: one CTA a key tile), each walking the plain
    # grid's tiles (its launch order, L2 sections included) at a stride of the grid: the
    # pipelines run on from one tile into the next, so the next tile's K / V and first Q / dO
    # load while this tile's dK / dV are stored, from registers (K / V's buffers go back
    # after the walk's last GEMM; FlashBwdSm90.epilogue_direct). Dense, default order, one
    # dQ writer, the register-tile dK / dV (not dkv_swap_ab, single_ds or a padded head dim);
    # not with tail_split or timeline
    persistent_ctas: int = 0
    # ... whose CTAs take their tiles from a global counter at run time (the load warp's
    # atomic add, handed to the other roles through a two-slot smem ring), in the plain
    # grid's launch order, instead of a fixed stride: an SM that starts late (beside the
    # persistent preprocess) or walks short tiles takes fewer
    persistent_counter: bool = False
    # diagnostics only (never in the table): each CTA records its SM, work and event clocks
    # into the tail workspace's buffer (arch/common/timeline.py; run_bwd's `timeline`,
    # scripts/bwd_timeline.py), which tail_split would otherwise own
    timeline: bool = False

    def __post_init__(self):
        if self.persistent_counter and not self.persistent_ctas:
            raise ValueError(
                "persistent_counter deals a persistent grid's tiles: needs persistent_ctas"
            )
        if self.persistent_ctas and (
            self.tail_split
            or self.timeline
            or self.dq_writers > 1
            or self.dkv_swap_ab
            or self.single_ds
            or self.padded_head_dim
        ):
            raise ValueError(
                "persistent_ctas: one dQ writer, register-tile dK / dV (no dkv_swap_ab,"
                " single_ds or padded_head_dim), no tail_split or timeline"
            )  # fmt: skip
        if self.end_aligned and not self.dq_flat:
            raise ValueError("end_aligned pads the front of the flat dQ tiles: needs dq_flat")
        if self.timeline and self.tail_split:
            raise ValueError("timeline records into tail_split's workspace: not both")
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
# BwdTileConfig.l2_last_sections merges sections of at most this many pairs (bwd_tile_config)
BWD_L2_LAST_MAX_PAIRS = 2


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
    # The last 4 sections as one (l2_last_sections; where a section holds at most
    # BWD_L2_LAST_MAX_PAIRS pairs: long sequences). Round-robin on an H100, TFLOP/s, table /
    # the last 2 / 3 / 4 as one (tune_bwd_last_sections_s66_h100.json,
    # tune_bwd_balance_causal_s66_h100.json; same gradients): 16k causal (sections of 1 pair,
    # D=96 2) D=96 539.1 / 555.4 / 555.5 / 554.8 and 539.2 / 555.3 / - / 559.3, D=128 613.8 /
    # 614.2 / 615.0 / 617.1, D=192 493.8 / 498.5 / - / 504.5, (192, 128) 459.4 / 463.9 / - /
    # 464.9, D=256 407.1 / 408.4 / 413.9 / 412.7. At 4k (sections of 2 to 8 pairs) it lost or
    # tied: D=96 465.2 / 460.3 / 459.8 / 457.8, D=192 443.0 / 448.0 / - / 444.0, (192, 128)
    # 398.8 / 402.0 / - / 399.7, D=128 515.0 / 515.3 / 514.5 / 512.9. Packed sequences and
    # group_heads were not measured
    if cfg.l2_section_bytes and not (varlen or group_heads):
        cfg = dataclasses.replace(cfg, l2_last_sections=4)
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
    # end_aligned: the query tiles end at the sequence's last row, so under the causal mask the
    # partial tile is walked only by the first key tiles, not by all of them. Round-robin on an
    # H100, ms, table / end_aligned (tune_bwd_align_s72_h100.json; same gradients): D=128 4k
    # causal 1.323 / 1.293, 8k causal 2.379 / 2.356, 16k causal 4.360 / 4.358; D=96 16k causal
    # 4.793 / 4.768; D=128 16k (unmasked, the same tile-steps either way) 8.503 / 8.483. The
    # 80- and 96-row flat tiles (D=64's 128 rows leave no partial tile at the bench's lengths;
    # the short-rows tiles are not flat); windows, softcap, group_heads and the deterministic
    # order were not measured
    if (
        causal
        and head_dim in (96, 128)
        and cfg.dq_flat
        and not (local or softcap or deterministic or varlen or group_heads or short)
    ):
        cfg = dataclasses.replace(cfg, end_aligned=True)
    # post_overlap (the postprocess converts each (batch, head) once its main CTAs are done,
    # on the SMs the main grid's last wave leaves idle). Round-robin on an H100, TFLOP/s,
    # table / post_overlap (tune_bwd_post_overlap_s56_h100.json; same gradients): D=128 4k
    # 579.5 / 589.6, 4k causal 504.2 / 510.9, 16k 628.4 / 621.3, 16k causal 615.6 / 618.2;
    # D=96 4k 515.1 / 527.2, 16k causal 533.0 / 537.5, 4k causal (short rows) 459.7 / 471.3;
    # D=64 4k 521.0 / 530.6; again with the postprocess's 512 ns back-off
    # (tune_bwd_post_overlap_b_s56_h100.json): D=128 16k 629.4 / 628.5, 4k 567.7 / 574.1.
    # Dense (the deterministic order too: below). Past D = 128 with pre_overlap (below).
    # pre_overlap (the preprocess as a persistent grid of BWD_PRE_CTAS CTAs beside the main
    # grid, which waits per query head for its rows). Round-robin on an H100, TFLOP/s, off /
    # 32 CTAs (tune_bwd_pre_overlap_s57_h100.json, same gradients): D=128 4k 575.3 / 597.3,
    # 16k 625.8 / 633.2, 4k causal 502.9 / 522.3, 1k 416.9 / 432.6; D=96 4k causal 456.9 /
    # 463.6, 16k causal 531.4 / 538.6; D=64 4k 523.4 / 537.9. Off / 16 CTAs
    # (tune_bwd_pre_overlap_c_s57_h100.json): D=128 16k causal 616.0 / 620.4, 16k 619.2 /
    # 628.3, 1k causal 291.4 / 299.0; D=96 16k 554.5 / 565.3; D=64 16k 551.7 / 555.5, 16k
    # causal 551.9 / 554.5. The domain of post_overlap (packed grids not built). In the
    # deterministic order both (their counts after the turns in sem),
    # off / on (tune_bwd_det_overlap_s57_h100.json): D=128 4k 501.7 / 516.0, 4k causal 462.8
    # / 488.1, 16k causal 566.8 / 573.2; D=96 4k causal 384.4 / 401.2; D=64 4k 437.3 / 448.4.
    # Past D = 128 both, round-robin on an H100, TFLOP/s, table / both
    # (tune_bwd_balance_{causal,split}_s66_h100.json, tune_bwd_wide_rows_s66_h100.json; same
    # gradients): D=192 4k causal 443.0 / 465.8, 16k causal 493.8 / 497.9, 1k causal 267.4 /
    # 278.0, 4k 457.8 / 478.9, 1k 352.9 / 370.0; (192, 128) 4k causal 398.8 / 414.7, 16k causal
    # 459.4 / 470.3, 1k causal 243.3 / 254.7, 4k 438.6 / 447.5, 16k 466.6 / 476.6; D=256 4k
    # causal 366.6 / 381.9, 16k causal 414.6 / 418.8, 1k causal 245.1 / 257.9, 1k 316.1 /
    # 332.7, 4k 390.4 / 404.8 with tail_split off in both and 395.4 / 403.3 with it (the
    # table's), 16k with it 414.8 / 407.6 and 408.1 / 410.7 (tune_bwd_post_split_s66_h100.json).
    # The deterministic order, without / with both (tune_bwd_det_wide_ov_s66_h100.log, the
    # run's printed table; its bitwise GPU tests passed with both: gpu_tests_balance_s66_h100.log
    # and gpu_tests_wide_table_b_s66_h100.log): D=192 4k causal 414.7 / 443.5, 4k 457.5 / 471.2,
    # D=256 4k causal 338.3 / 341.3, 4k 355.9 / 358.7
    if not varlen:
        cfg = dataclasses.replace(cfg, post_overlap=True, pre_overlap=True)
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
    # 558.9 / 556.7, D=64 4k 529.8 / 525.6, 1k 421.6 / 410.2: off there. D = 192 (sixty-sixth
    # session, tune_bwd_balance_split_s66_h100.json): 4k table / tail_split / both overlaps /
    # both with it 457.8 / 480.7 / 478.9 / 477.4 and (192, 128) 16k 466.6 / 471.0 / 476.6 /
    # 469.1: the overlaps (above) and no split. Windows and softcap were not measured;
    # group_heads, L2 sections and the deterministic order are not built
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
        # (192, 128) measured again in the sixty-ninth session, with both overlaps in the
        # table (since the sixty-sixth), took single_ds with two dO stages. Round-robin on an
        # H100, TFLOP/s, the old table (two dS buffers, one dO stage) / single_ds with two dO
        # stages, two runs (tune_bwd_v128_s69_h100.json, tune_bwd_v128_b_s69_h100.json; same
        # gradients): 4k 448.9 / 460.3 and 450.1 / 462.0, 16k 472.1 / 481.2 and 465.4 / 471.0,
        # 1k 337.7 / 351.0 and 336.6 / 350.4, 4k causal 414.8 / 418.7 and 412.1 / 415.4, 16k
        # causal 459.0 / 463.4, 1k causal 253.2 / 257.1; deterministic 4k 423.2 / 422.0, 16k
        # 455.9 / 460.2, 1k 336.9 / 338.3, 4k causal 397.6 / 402.1, 1k causal 249.3 / 250.4;
        # packed 4 x 4k (tune_bwd_v128_varlen_s69_h100.json) 442.5 / 454.4, causal 401.7 /
        # 402.5, 8 x 1k 318.6 / 327.9. Every form compiles spill-free for sm_90a (bf16 and fp16,
        # causal, windows, softcap, GQA, deterministic, packed). On an H200, before the
        # overlaps, the causal rows had lost (above, and tune_bwd_d192v128_sd2_h200.json, 30
        # reps: 4k causal 404.8 / 399.0, 16k causal 451.9 / 443.9, 1k causal 263.5 / 264.2;
        # 4k 439.5 / 449.4). With today's kernels it wins on an H200 too, the causal rows
        # included (seventieth session, tune_bwd_v128_s70_h200.json, round-robin, TFLOP/s, old /
        # this tile): 4k 440.7 / 449.1, 16k 461.9 / 469.5, 1k 349.2 / 363.2, 4k causal 414.1 /
        # 417.6, 16k causal 458.2 / 462.7; so taken under every mask.
        own_dq = head_dim_v == 128 or not varlen
        return BwdTileConfig(
            tile_m=64, tile_n=96, num_stages=2, dkv_swap_ab=True,
            sdp_swap_ab=False, dq_half_staging=True, dq_stages=2 if own_dq else 1,
            dq_swizzle=128, single_ds=True, do_stages=2 if head_dim_v == 128 else 1,
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
