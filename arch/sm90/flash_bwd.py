"""FlashAttention backward for Hopper (SM90) in the CuTe DSL: dQ, dK, dV from saved lse.

One CTA owns one (tile_n keys, query head, batch) tile of K and V (group_heads: of a KV head,
below) and walks the query tiles (tile_m rows) that can see any of those keys:
  * warpgroup 0 (registers lowered by setmaxnreg): warp 0 loads K and V once and then Q with
    lse and dO with D per query tile by TMA into two-stage mbarrier pipelines; warp 1 is the
    dQ writer (arch/sm90/bwd_dq_writer.py): it adds each query tile's dQ partial (fp32,
    staged in smem) into the global fp32 accumulator with a TMA bulk reduce-add. Staging
    (BwdTileConfig.dq_half_staging, dq_stages): the whole tile handed over by both warpgroups
    together, or each warpgroup's head-dim half in a buffer of its own on its own named
    barriers (D <= 128, dQ split by head dim), or the two halves in turn in one buffer (past
    D = 128, for smem);
  * warpgroups 1..2 (registers raised) each own 64 of the keys. Per query tile, with the
    transposed products so the key rows stay in registers:
        S^T = K Q^T, dP^T = V dO^T                     (wgmma SS)
        P^T = exp2(S^T * scale_log2 - lse_log2)         (lse from the forward, exp2 domain)
        dS^T = P^T (dP^T - D)   [times 1 - tanh^2 under softcap]
        dV += P^T dO, dK += dS^T Q                      (wgmma RS: P^T, dS^T from registers)
        dQ  = dS K                                      (wgmma SS: dS through smem, both
                                                         warpgroups' keys, split along D)
    or, swapped (BwdTileConfig.dq_swap_ab: the table's D = 128 tile of 80 query rows, D = 96's
    of 96, 64 rows under group_heads, and D = 64's 128 rows),
        dQ^T = K^T dS^T                                 (wgmma SS: 64 head dims a warpgroup,
                                                         the query rows as N, any multiple of 16)
    staged in each warpgroup's half buffer; at D = 64 the warpgroups split dQ^T's query
    columns instead and stage the whole tile. The table's 80- and 96-row tiles stage dQ^T in
    register order (BwdTileConfig.dq_flat, arch/common/dq_flat.py: 128-bit stores, one
    contiguous reduce-add a part into a (batch, head, row, dim) accumulator whose tiles the
    postprocess puts back in order); the others through the transpose of a swizzled (row,
    dim) buffer (32-bit stores);
    masks as in the forward (only on tiles that cross a boundary); query tiles no key of the
    tile can see are never visited. With BwdTileConfig.s_under_dk (D = 128 unmasked, the
    short-rows 64-row tiles) the next query tile's S^T is issued once dQ^T is staged, behind
    this tile's dK, and dQ^T accumulates in the S^T registers;
  * epilogue: dK (times softmax_scale) and dV converted, staged in the K/V smem and stored by
    TMA (rows past seqlen_k clipped). A key tile no query sees stores zeros. With
    BwdTileConfig.epilogue_first it runs before the wait for the dQ writer's last add, not
    after, so the two overlap at the CTA's end.
  * deterministic (compile-time switch): the dQ writer of key tile n adds its partial of query
    tile m only after the key tiles left of it that see m did (a per-(batch, head, m) int32
    semaphore counts them), and waits for its add to land before releasing the next one. The
    fp32 sums then happen in one fixed order: bitwise identical run to run. The table gives
    that order two writer warps (BwdTileConfig.dq_writers, up to three: warps 1, 2 (and 3)
    take the walk's tiles in turn, each handed its tiles on barriers of its own), so one's
    wait for its adds to land overlaps the other's add.
  * padded head dim (BwdTileConfig.padded_head_dim): each head dim of the tiles rounds up to a
    multiple of 128 (D = 96 under softcap in the deterministic order -> 128); TMA zero-fills
    the columns past the tensors' on load and drops them on store / reduce-add. With
    dq_head_dim only K's tile is wider (D = 96: 128 columns, so dQ^T keeps two 64-row
    head-dim halves); S^T and dP^T then run over the first head_dim columns of K, and dK is
    staged in K's buffer through a (tile_n, head_dim) layout of its own. The flat tile's
    writer then adds only the warp runs of dQ^T's real rows (BwdTileConfig.dq_skip_zero_rows).
  * head dims past 128 (BwdTileConfig.dkv_swap_ab): 64 keys x 64 query rows. The warpgroups
    split S^T / dP^T by query columns (32 each); P^T and dS go to smem, and
        dV^T += dO^T P, dK^T += Q^T dS                  (wgmma SS, both operands transposed)
    accumulate head-dim rows, 64-row wgmma tiles taken by the warpgroups in turn (D = 256:
    2 x 64 fp32 registers a thread for dK and dV). dQ = dS K splits its head dim as before.
    Q has two stages, dO its own count (BwdTileConfig.do_stages), and with dq_half_staging each
    warpgroup stages its half of dQ in turn in a (64, D / 2) buffer: that fits D = 256 in
    SM90's smem (218 KB). Or (BwdTileConfig.sdp_swap_ab = False, D = 192: 64 x 96)
        S = Q K^T, dP = dO V^T                          (wgmma SS, 64 query rows, the
                                                         warpgroups split the keys)
    and each warpgroup's dK^T / dV^T span every 64-row tile of the head dim over its own keys
    (N = tile_n / 2), so any multiple of 64 needs no padding; K's and dS / P's smem swizzle
    is narrowed so that the column slices the warpgroups read transposed start on an atom.
  * packed sequences (`varlen`, compile-time): q / dO / dQ rows packed by cu_seqlens_q and
    k / v / dK / dV rows by cu_seqlens_k, each a unit-batch tensor; grid z is the sequence,
    grid x is sized by the longest key sequence and tiles past a sequence's end leave at
    once. Q, dO, K and V load through views whose seq extent ends at each sequence's last
    row (`seqlen.ragged_rows`): rows past it arrive as zeros, not as the next sequence's
    (whose NaN or Inf would survive P = 0 as 0 * NaN), the mask hides those keys and those
    queries meet lse_log2 = +inf, so P = dS = 0 there; lse_log2, D, the dQ accumulator and the
    deterministic counters are per-row buffers in which each sequence starts on a tile_m
    boundary (`seqlen.padded_row_offset`), so no tile-sized load or reduce-add reaches
    another sequence's rows; dK / dV are TMA-stored through a view that ends at each
    sequence's last key (`seqlen.ragged_rows`).
  * launch order (BwdTileConfig.l2_section_bytes, the table's choice under a causal mask):
    the (head, batch) pairs in L2 sections, key tile 0 of every pair of a section first
    (arch/common/schedule.py); on packed grids a pair's rows are the grid's key length (the
    longest sequence). The deterministic order keeps its turns deadlock-free in sections
    too: the key tile whose turn comes before a CTA's has the rank before its own, so it is
    launched a section's width earlier.
  * GQA / MQA with `group_heads` (compile-time): the grid's head mode is the KV head and the
    CTA walks that head's query heads in turn, each with its query tiles, on the same Q / dO
    pipelines and dQ handoff; dK / dV keep accumulating in registers across the query heads
    and are stored once, per KV head. Without it a CTA per query head writes dK / dV per query
    head and the host sums them.
  * end-aligned query tiles (BwdTileConfig.end_aligned): the partial tile is the first, which
    only the first key tiles walk under the causal mask, not the last, which all walk. Q and
    dO load from row -s (TMA zero-fills rows before 0), the per-row buffers put the padding
    first (front_pad) and the mask counts rows from there: the diagonal does not move;
  * diagnostics (BwdTileConfig.timeline, never in the table): each CTA records its SM, work
    and the SM clock at its events in the tail workspace's buffer (arch/common/timeline.py,
    scripts/bwd_timeline.py); without it no special register is read.

Host side (cute_attn.bwd_sm90) prepares lse_log2 (+inf for empty rows and padding) and
D = rowsum(dO * O) - dlse, zeroes the fp32 dQ accumulator, and afterwards scales and converts
dQ and (without group_heads) sums dK/dV over the query heads of a KV head (GQA).

Constraints: fp16/bf16; head dims from bwd_tiles.BWD_HEAD_DIMS; (batch, seq, heads, dim)
layout with contiguous last dim and 16-byte strides; lse_log2 and D are (batch, heads,
seqlen_q rounded up to tile_m) fp32 (packed: (1, heads, total_q + sequences * tile_m)).

Compile without a GPU: CUTE_DSL_ARCH=sm_90a python -m cute_attn compile --arch sm_90a
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..common import timeline as tl
from ..common.dsl import wait_at_least
from ..common.features import InputFeatures
from ..common.layout import acc_as_operand_a, acc_as_rows_cols, select_modes, transpose_smem_view
from ..common.mask import TileMask, apply_softcap
from ..common.schedule import L2Sections, TailSplit, l2_section_coords, tail_split_coords
from ..common.seqlen import SeqInfo, padded_row_offset, ragged_rows
from .bwd_dq_writer import BwdDqWriter
from .bwd_epilogue import BwdEpilogue
from .bwd_persistent import BwdPersistent
from .bwd_tiles import BWD_HEAD_DIMS, BWD_L2_LAST_MAX_PAIRS, BwdTileConfig, bwd_l2_row_bytes
from .primitives import gemm, smem_layout, tma_pipeline, tma_tiles
from .tile_config import SMEM_BYTES_SM90

DQ_SWIZZLE_ATOMS = {
    32: warpgroup.SmemLayoutAtomKind.K_SW32,
    64: warpgroup.SmemLayoutAtomKind.K_SW64,
    128: warpgroup.SmemLayoutAtomKind.K_SW128,
}


@dataclasses.dataclass(frozen=True)
class BwdRoles:
    """Warp roles, register budgets and named-barrier ids of the backward kernel."""

    num_mma_warpgroups: int = 2
    load_warp: int = 0  # TMA loads of K, V, Q, dO
    # TMA reduce-add of each dQ partial; with BwdTileConfig.dq_writers = w > 1 the w warps
    # from dq_warp on take the walk's query tiles in turn (a writer's index is its warp's
    # offset from dq_warp)
    dq_warp: int = 1
    store_warp: int = 4  # first consumer warp: issues the dK/dV TMA stores
    producer_regs: int = 24
    mma_regs: int = 240
    # named barrier ids (0 is __syncthreads)
    bar_epilogue: int = 1
    bar_ds: int = 2  # both consumer warpgroups wrote their half of dS
    bar_dq_full: int = 3  # consumers -> dQ writer: sdQ holds a partial
    bar_dq_empty: int = 4  # dQ writer -> consumers: sdQ may be overwritten
    # under dq_half_staging warpgroup w hands its half over on bar_dq_full + 2 w and waits for
    # its buffer on bar_dq_empty + 2 w (ids 3 / 4 and 5 / 6)
    bar_dq_wg_step: int = 2
    # dq_writers > 1: writer w's handoff (w >= 1) on ids bar_dq_full_more[w - 1] (and + 2
    # for the second warpgroup's part): 9 / 11 and 13 / 15 beside writer 0's 3 / 5
    bar_dq_full_more: tuple[int, ...] = (9, 13)
    # single_ds: the other warpgroup finished reading the one dS buffer, warpgroup w may
    # overwrite its part: id 7 + w (w waits, the other warpgroup arrives)
    bar_ds_free: int = 7

    def __post_init__(self):
        if not (self.load_warp < self.dq_warp and self.dq_warp + self.max_dq_writers <= 4):
            raise ValueError("the dQ writers are the producer warpgroup's warps after the load's")
        if max(self.bar_dq_full_more) + self.bar_dq_wg_step > 15:
            raise ValueError("named barrier ids end at 15")

    @property
    def max_dq_writers(self) -> int:
        return 1 + len(self.bar_dq_full_more)

    @property
    def dq_full_offsets(self) -> tuple[int, ...]:
        """Writer w's full barrier ids are writer 0's plus dq_full_offsets[w] (the writer and
        the consumers select it by writer index)."""
        return (0, *(b - self.bar_dq_full for b in self.bar_dq_full_more))

    @property
    def num_threads(self) -> int:
        return 128 * (self.num_mma_warpgroups + 1)

    @property
    def num_mma_threads(self) -> int:
        return 128 * self.num_mma_warpgroups

    @property
    def dq_sync_threads(self) -> int:
        return self.num_mma_threads + 32

    @property
    def dq_half_sync_threads(self) -> int:
        return 128 + 32  # one consumer warpgroup and the dQ writer warp


class FlashBwdSm90(BwdDqWriter, BwdEpilogue, BwdPersistent):
    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        head_dim_v: int,
        qhead_per_kvhead: int,
        has_left: bool,
        has_right: bool,
        has_softcap: bool,
        config: BwdTileConfig,
        deterministic: bool = False,
        varlen: bool = False,
        group_heads: bool = False,
    ):
        self.dtype = dtype
        self.deterministic = deterministic
        # packed q and k / v (cu_seqlens_q and cu_seqlens_k); the backward takes no seqused,
        # paged or cached keys
        self.varlen = varlen
        self.features = InputFeatures(cu_seqlens_q=varlen, cu_seqlens_k=varlen)
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.qhead_per_kvhead = qhead_per_kvhead
        # GQA / MQA: a CTA per KV head that walks its query heads in turn, so dK / dV sum over
        # them in registers and are stored once per KV head
        self.group_heads = group_heads and qhead_per_kvhead > 1
        self.heads_per_cta = qhead_per_kvhead if self.group_heads else 1
        self.has_left = has_left
        self.has_right = has_right
        self.has_softcap = has_softcap
        self.config = config
        self.roles = BwdRoles(num_mma_warpgroups=config.num_mma_warpgroups)
        self._setup_attributes()

    def _setup_attributes(self):
        cfg = self.config
        if self.dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"SM90 backward supports fp16/bf16, got {self.dtype}")
        if (self.head_dim, self.head_dim_v) not in BWD_HEAD_DIMS:
            raise ValueError(f"unsupported head dims ({self.head_dim}, {self.head_dim_v})")
        if cfg.dq_writers > self.roles.max_dq_writers:
            raise ValueError(f"dq_writers {cfg.dq_writers}: at most {self.roles.max_dq_writers}")
        if cfg.num_mma_warpgroups != 2:
            raise ValueError("the backward splits dQ's head dim over exactly 2 warpgroups")
        self.l2_sections = cfg.l2_section_bytes > 0
        self.l2_row_bytes = bwd_l2_row_bytes(self.head_dim, self.head_dim_v)
        # the head dims the tiles span: the tensors' own, or padded (BwdTileConfig)
        self.tile_d, self.tile_dv = cfg.tile_head_dims(self.head_dim, self.head_dim_v)
        # K's smem tile and dQ^T's head-dim rows: tile_d, or wider (BwdTileConfig.dq_head_dim)
        self.tile_dq = cfg.dq_tile_head_dim(self.head_dim)
        self.swap_dkv = cfg.dkv_swap_ab
        # S^T = K Q^T (keys as wgmma M), or S = Q K^T (BwdTileConfig.sdp_swap_ab)
        self.swap_sdp = cfg.sdp_swap_ab
        rows = 64 * cfg.num_mma_warpgroups if self.swap_sdp else 64
        if self.swap_dkv and (self.tile_d % rows or self.tile_dv % rows):
            # dK^T / dV^T: each warpgroup takes 64-row wgmma tiles of the head dims in turn, or
            # (S = Q K^T) all of them over its own keys
            raise ValueError(
                f"dkv_swap_ab needs tile head dims that are multiples of {rows}, got"
                f" ({self.tile_d}, {self.tile_dv}): set padded_head_dim"
            )
        smem = cfg.smem_bytes(self.head_dim, self.head_dim_v)
        if smem > SMEM_BYTES_SM90:
            raise ValueError(f"tile config needs {smem} B of smem > {SMEM_BYTES_SM90}")
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.num_stages = cfg.num_stages
        self.do_stages = cfg.do_stages
        # dQ staging (BwdTileConfig.dq_half_staging / dq_stages): the whole tile in one buffer,
        # or each warpgroup's head-dim half, in turn in one buffer or each in its own
        self.dq_halves = cfg.dq_half_staging
        self.dq_wg_bufs = cfg.dq_half_staging and cfg.dq_stages == 2
        # each warpgroup hands its query columns of the flat tile over on its own barriers
        # (BwdTileConfig.dq_wg_handoff): the writer adds one run per warpgroup
        self.dq_wg_handoff = cfg.dq_wg_handoff
        # dQ's wgmma takes 64 rows per warpgroup: split its rows (tile_m = 64 per warpgroup)
        # or its head dim (tile_m = 64)
        self.dq_split_rows = cfg.tile_m == 64 * cfg.num_mma_warpgroups and not cfg.dq_swap_ab
        # or dQ^T = K^T dS^T (BwdTileConfig.dq_swap_ab): at D = 128 its 64-row tiles are the
        # warpgroups' head-dim halves (dq_half_staging); at D = 64 the warpgroups split its
        # query columns and stage the whole tile
        self.swap_dq = cfg.dq_swap_ab
        # dQ^T staged in register order (BwdTileConfig.dq_flat, arch/common/dq_flat.py)
        self.flat = cfg.dq_flat_tile(self.head_dim)
        self.post_overlap = cfg.post_overlap
        # the persistent preprocess runs beside this grid (BwdTileConfig.pre_overlap)
        self.pre_overlap = cfg.pre_overlap
        if (self.post_overlap or self.pre_overlap) and self.varlen:
            raise ValueError("post_overlap / pre_overlap count per dense (batch, head)")
        # query tiles aligned to the sequence's end (BwdTileConfig.end_aligned)
        self.end_aligned = cfg.end_aligned
        if self.end_aligned and self.varlen:
            raise ValueError("end_aligned: dense only (packed rows pad each sequence's end)")
        # the grid's last key tiles split by query tiles (BwdTileConfig.tail_split): a linear
        # grid of one CTA a key tile and query head
        self.tail_split = cfg.tail_split
        if self.tail_split and (
            self.deterministic or self.varlen or self.group_heads or self.l2_sections
        ):
            raise ValueError(
                "tail_split: not in the deterministic order, packed, group_heads or L2 sections"
            )
        # a persistent grid (BwdTileConfig.persistent_ctas): dense, in the default order, a
        # CTA a (key tile, query head); its own field checks the rest
        self.persistent = cfg.persistent_ctas > 0
        if self.persistent and (self.deterministic or self.varlen or self.group_heads):
            raise ValueError("persistent_ctas: dense, default order, no group_heads")
        if self.flat is not None and self.flat.head_dim != self.tile_dq:
            raise ValueError(f"dq_flat tile of {self.flat.head_dim} head dims, not {self.tile_dq}")
        self._setup_flat_boxes()
        if not (self.dq_split_rows or self.swap_dq) and cfg.tile_m != 64:
            raise ValueError(f"tile_m {cfg.tile_m} must be 64 or 64 * num_mma_warpgroups")
        dq_half = self.tile_dq // cfg.num_mma_warpgroups
        if (
            not (self.dq_split_rows or self.swap_dq)
            and cfg.dq_half_staging
            and dq_half % (cfg.dq_swizzle // 4)
        ):
            # each warpgroup's head-dim half of dQ is a column slice of the fp32 staging tile
            raise ValueError(
                f"dQ's head-dim halves of {dq_half} columns need a dq_swizzle of at most"
                f" {4 * (dq_half & -dq_half)} bytes, not {cfg.dq_swizzle}"
            )
        swap_d = 64 * cfg.num_mma_warpgroups if cfg.dq_half_staging else 64
        if self.swap_dq and self.tile_dq != swap_d:
            raise ValueError(
                f"dq_swap_ab with dq_half_staging={cfg.dq_half_staging} takes head dim"
                f" {swap_d}, not {self.tile_dq}"
            )
        if self.head_dim % 16 or self.head_dim_v % 16:
            # S^T and dP^T take k-steps of 16 over the tensors' own head dims
            raise ValueError(f"head dims ({self.head_dim}, {self.head_dim_v}): multiples of 16")

    # ------------------------------------------------------------------ host-side launch
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s_q, h, d)
        mK: cute.Tensor,  # (b, s_k, h_kv, d)
        mV: cute.Tensor,  # (b, s_k, h_kv, dv)
        mdO: cute.Tensor,  # (b, s_q, h, dv)
        mLSE: cute.Tensor,  # (b, h, s_q padded) fp32, log2 domain, +inf on empty rows
        mDsum: cute.Tensor,  # (b, h, s_q padded) fp32, rowsum(dO * O) - dlse
        # (b, s_q, h, d) fp32, zeroed; receives dS K (unscaled). dq_flat: (b, rows padded to
        # tiles, h, dQ^T's head dim), a view of (b, h, rows, that) storage, each tile in
        # register order
        mdQacc: cute.Tensor,
        mdK: cute.Tensor,  # (b, s_k, h, d): per query head (group_heads: (b, s_k, h_kv, d))
        mdV: cute.Tensor,  # (b, s_k, h, dv): per query head (group_heads: (b, s_k, h_kv, dv))
        # (b, h, x) int32, zeroed: deterministic, a turn counter per query tile first; then,
        # under post_overlap / pre_overlap, [b, h, x - 2] counts this grid's CTAs done and
        # [b, h, x - 1] the preprocess's ready rows; else unread
        mSem: cute.Tensor,
        softmax_scale_log2: Float32,
        score_premul: Float32,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        # varlen: every tensor above has a unit batch, rows packed (q / dO / dK / dV) or
        # padded per sequence (lse_log2, D, dQ accumulator, sem; seqlen.padded_row_offset);
        # max_seqlen_k sizes the grid, cu_seqlens are (sequences + 1,) int32. Dense: unused
        max_seqlen_k: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        # tail_split: fp32, (tiles of the tail) x tail_parts x BwdTileConfig.tail_slot_floats
        # (the parts' dK / dV partials), and the first tile of the tail and its parts (the
        # grid's tiles; 1 part: no split). Else None, unread
        mTailAcc: cute.Tensor | None,
        tail_start: Int32,
        tail_parts: Int32,
        stream: cuda.CUstream,
    ):
        if cutlass.const_expr(mQ.element_type != self.dtype):
            raise TypeError(f"q dtype {mQ.element_type} != compiled {self.dtype}")
        # (seq, dim, head, batch): the seq x dim tile is what TMA and wgmma see
        mQ, mK, mV, mdO, mdQacc, mdK, mdV = [
            select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mdO, mdQacc, mdK, mdV)
        ]
        # (seq, head, batch)
        mLSE, mDsum, mSem = [select_modes(t, [2, 1, 0]) for t in (mLSE, mDsum, mSem)]
        d, dv, tm, tn = self.tile_d, self.tile_dv, self.tile_m, self.tile_n
        dq_d = self.tile_dq
        nwg = self.config.num_mma_warpgroups

        def tiled_mma(a_major, b_major, atom_mnk, tiler_mn, a_rmem):
            return sm90_utils.make_trivial_tiled_mma(
                self.dtype,
                self.dtype,
                a_major,
                b_major,
                Float32,
                atom_layout_mnk=atom_mnk,
                tiler_mn=tiler_mn,
                a_source=warpgroup.OperandSource.RMEM if a_rmem else warpgroup.OperandSource.SMEM,
            )

        K, MN = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        if cutlass.const_expr(self.swap_dkv and not self.swap_sdp):
            # S = Q K^T, dP = dO V^T: the 64 query rows are one wgmma M, the warpgroups split
            # the keys; dK^T += Q^T dS, dV^T += dO^T P over the same keys, every 64-row tile
            # of the head dim in each warpgroup
            tiled_mma_sdp = tiled_mma(K, K, (1, nwg, 1), (tm, tn // nwg), False)
            tiled_mma_dk = tiled_mma(MN, MN, (1, nwg, 1), (64, tn // nwg), False)
            tiled_mma_dv = tiled_mma(MN, MN, (1, nwg, 1), (64, tn // nwg), False)
        elif cutlass.const_expr(self.swap_dkv):
            # S^T = K Q^T, dP^T = V dO^T: the 64 keys are one wgmma M, the warpgroups split
            # the query columns
            tiled_mma_sdp = tiled_mma(K, K, (1, nwg, 1), (64, tm // nwg), False)
            # dK^T += Q^T dS, dV^T += dO^T P, all four operands transposed views of smem:
            # the warpgroups take 64-row tiles of the head dim in turn
            tiled_mma_dk = tiled_mma(MN, MN, (nwg, 1, 1), (64, tn), False)
            tiled_mma_dv = tiled_mma(MN, MN, (nwg, 1, 1), (64, tn), False)
        else:
            # S^T = K Q^T and dP^T = V dO^T: warpgroups split the keys (the M mode)
            tiled_mma_sdp = tiled_mma(K, K, (nwg, 1, 1), (64, tm), False)
            # dK += dS^T Q, dV += P^T dO: A from registers (the S^T accumulator rows are keys)
            tiled_mma_dk = tiled_mma(K, MN, (nwg, 1, 1), (64, d), True)
            tiled_mma_dv = tiled_mma(K, MN, (nwg, 1, 1), (64, dv), True)
        # dQ = dS K: every warpgroup needs all keys, so they split the query rows when there
        # are 64 per warpgroup, else the head dim
        if cutlass.const_expr(self.dq_split_rows):
            tiled_mma_dq = tiled_mma(K, MN, (nwg, 1, 1), (64, d), False)
        elif cutlass.const_expr(self.swap_dq and self.dq_halves):
            # dQ^T = K^T dS^T: A the (head dim, key) view of sK, B dS as stored (query, key)
            tiled_mma_dq = tiled_mma(MN, K, (nwg, 1, 1), (64, tm), False)
        elif cutlass.const_expr(self.swap_dq):
            # the same with one 64-row head-dim tile: the warpgroups split its query columns
            tiled_mma_dq = tiled_mma(MN, K, (1, nwg, 1), (64, tm // nwg), False)
        else:
            tiled_mma_dq = tiled_mma(K, MN, (1, nwg, 1), (tm, d // nwg), False)
        # one warpgroup's (tm, d / nwg) part of dQ: how it lands in the half-size staging
        # buffer under dq_half_staging (the same per-thread fragment as in tiled_mma_dq; its
        # (d / nwg, tm) transpose under swap_dq)
        tiled_mma_dq_part = tiled_mma_dq  # unused without dq_half_staging
        if cutlass.const_expr(self.swap_dq and self.dq_halves):
            tiled_mma_dq_part = tiled_mma(MN, K, (1, 1, 1), (dq_d // nwg, tm), False)
        elif cutlass.const_expr(self.dq_halves):
            tiled_mma_dq_part = tiled_mma(K, MN, (1, 1, 1), (tm, d // nwg), False)

        stages, do_stages = self.num_stages, self.do_stages
        sQ_layout = smem_layout(self.dtype, tm, d, stages)
        sdO_layout = smem_layout(self.dtype, tm, dv, do_stages)
        # transposed MN-major wgmma operands read in per-warpgroup column slices must start on
        # a swizzle atom: K^T's head-dim halves in dQ = dS K, and under S = Q K^T the keys of
        # dS / P in dK^T / dV^T (D = 192, tile_n = 96: slices of 96 and 48 columns). Under
        # S^T = K Q^T K's widest swizzle takes halves of 32 / 64 / 128 columns; 48-column ones
        # (D = 96 without padding) need its 32-byte atoms
        odd_dq_half = not (self.swap_dq or self.dq_split_rows) and (dq_d // nwg) % 32
        k_atom = dq_d // nwg if cutlass.const_expr(not self.swap_sdp or odd_dq_half) else None
        ds_atom = tn // nwg if cutlass.const_expr(not self.swap_sdp) else None
        sK_layout = smem_layout(self.dtype, tn, dq_d, None, k_atom)
        # dK's staging in K's buffer for its TMA store: (tn, d), K's own layout unless K's
        # tile is wider (dq_head_dim)
        sdK_layout = sK_layout
        if cutlass.const_expr(dq_d != d):
            sdK_layout = smem_layout(self.dtype, tn, d, None)
        sV_layout = smem_layout(self.dtype, tn, dv, None)
        ds_stages = 1 if cutlass.const_expr(self.config.single_ds) else stages
        sdS_layout = smem_layout(self.dtype, tm, tn, ds_stages, ds_atom)
        # P^T's 16-bit copy for dV^T under swap_dkv, staged with dO (see mma)
        sP_layout = smem_layout(self.dtype, tm, tn, do_stages, ds_atom)
        p_size = cute.cosize(sP_layout) if cutlass.const_expr(self.swap_dkv) else 1
        p_align = 1024 if cutlass.const_expr(self.swap_dkv) else 16
        # fp32 dQ staging, swizzled as the config says (BwdTileConfig.dq_swizzle)
        dq_atom_kind = DQ_SWIZZLE_ATOMS[self.config.dq_swizzle]
        sdQ_atom = warpgroup.make_smem_layout_atom(dq_atom_kind, Float32)
        dq_cols = dq_d // nwg if cutlass.const_expr(self.dq_halves) else dq_d
        # (tm, dq_cols, dq_stages): with two, a half buffer per warpgroup
        sdQ_layout = cute.tile_to_shape(
            sdQ_atom, (tm, dq_cols, self.config.dq_stages), order=(0, 1, 2)
        )
        mdQ_reduce, dq_box = mdQacc, (tm, dq_cols)
        if cutlass.const_expr(self.flat is not None):
            # register order (dq_flat): each buffer holds one part, seen by TMA as boxes
            # (_setup_flat_boxes) of rows of 32 floats; the accumulator's (row, dim) block of
            # one (head, batch) pair is such rows too (dim contiguous, rows acc_dim apart:
            # the host allocates it so; compact tiles, DqFlatTile.dims, hold 96 of D = 96's 128)
            box = self.dq_box_elems
            sdQ_layout = cute.make_layout(
                (32, box // 32, self.config.dq_stages * (self.flat.part_elems // box)),
                stride=(1, 32, box),
            )
            flat_shape = (32, mdQacc.shape[0] * (self.flat.acc_dim // 32), *mdQacc.shape[2:])
            mdQ_reduce = cute.make_tensor(
                mdQacc.iterator,
                cute.make_layout(flat_shape, stride=(1, 32, *mdQacc.layout.stride[2:])),
            )
            dq_box = (32, box // 32)

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_store = cpasync.CopyBulkTensorTileS2GOp()

        def tma(op, m, s_layout, tile):
            return cpasync.make_tiled_tma_atom(op, m, cute.select(s_layout, mode=[0, 1]), tile)

        # packed sequences: Q, dO, K and V load through views whose seq extent ends at each
        # sequence's last row (`seqlen.ragged_rows`), so a tile crossing into the next packed
        # sequence gets zeros there instead of its rows: with P = 0 on those rows and keys
        # alone, a NaN or Inf there would still reach dQ, dK and dV (0 * NaN)
        mQ_l, mdO_l, mK_l, mV_l = mQ, mdO, mK, mV
        if cutlass.const_expr(self.varlen):
            mQ_l, mdO_l, mK_l, mV_l = [ragged_rows(t) for t in (mQ, mdO, mK, mV)]
        tma_atom_Q, tma_Q = tma(tma_load, mQ_l, sQ_layout, (tm, d))
        tma_atom_dO, tma_dO = tma(tma_load, mdO_l, sdO_layout, (tm, dv))
        tma_atom_K, tma_K = tma(tma_load, mK_l, sK_layout, (tn, dq_d))
        # per-row statistics ride with Q (lse) and dO (D): one 1-D TMA tile each
        # each stage 128-byte aligned (BwdTileConfig.row_stage_stride)
        rs = self.config.row_stage_stride
        sLSE_layout = cute.make_layout((tm, stages), stride=(1, rs))
        sDsum_layout = cute.make_layout((tm, do_stages), stride=(1, rs))
        tma_atom_LSE, tma_LSE = cpasync.make_tiled_tma_atom(
            tma_load, mLSE, cute.make_layout(tm), (tm,)
        )
        tma_atom_Dsum, tma_Dsum = cpasync.make_tiled_tma_atom(
            tma_load, mDsum, cute.make_layout(tm), (tm,)
        )
        tma_atom_V, tma_V = tma(tma_load, mV_l, sV_layout, (tn, dv))
        # packed keys: views whose seq extent ends at each sequence's last key, so the store
        # of a tile crossing into the next packed sequence is clipped there
        mdK_store, mdV_store = mdK, mdV
        if cutlass.const_expr(self.varlen):
            mdK_store, mdV_store = ragged_rows(mdK), ragged_rows(mdV)
        tma_atom_dK, tma_dK = tma(tma_store, mdK_store, sdK_layout, (tn, d))
        tma_atom_dV, tma_dV = tma(tma_store, mdV_store, sV_layout, (tn, dv))
        if cutlass.const_expr(self.persistent):
            tma_dK, tma_dV = mdK, mdV  # stored from registers (epilogue_direct), not by TMA
        tma_reduce = cpasync.CopyReduceBulkTensorTileS2GOp()
        tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(
            tma_reduce, mdQ_reduce, cute.select(sdQ_layout, mode=[0, 1]), dq_box
        )

        def tile_bytes(layout):
            return cute.size_in_bytes(self.dtype, cute.select(layout, mode=[0, 1]))

        self.tx_bytes_q = tile_bytes(sQ_layout) + tm * 4
        self.tx_bytes_do = tile_bytes(sdO_layout) + tm * 4
        self.tx_bytes_kv = tile_bytes(sK_layout) + tile_bytes(sV_layout)

        # the persistent counter's two tile slots and its ring's four mbarriers (else unused)
        n_sched = 6 if self.config.persistent_counter else 1

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, stages * 2]
            mbar_do: cute.struct.MemRange[cutlass.Int64, do_stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]
            # unused without swap_dkv: a 16-byte-aligned stub there, which costs no 1 KB pad
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, p_size], p_align]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sLSE_layout)], 128]
            sDsum: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sDsum_layout)], 128]
            sched: cute.struct.MemRange[cutlass.Int64, n_sched]

        self.shared_storage = SharedStorage
        # the config's estimate (checked in _setup_attributes) leaves out alignment padding
        if cutlass.const_expr(SharedStorage.size_in_bytes() > SMEM_BYTES_SM90):
            raise ValueError(f"shared storage {SharedStorage.size_in_bytes()} B > SM90's smem")

        num_n_blocks = cute.ceil_div(mK.shape[0], tn)
        num_batch = cute.size(mQ.shape[3])
        if cutlass.const_expr(self.varlen):
            num_n_blocks = cute.ceil_div(max_seqlen_k, tn)
            num_batch = mCuSeqlensQ.shape[0] - 1
        # one CTA per key tile and query head, or per key tile and KV head (group_heads)
        grid_heads = cute.size(mQ.shape[2]) // self.heads_per_cta
        grid = (num_n_blocks, grid_heads, num_batch)
        if cutlass.const_expr(self.tail_split):
            # the plain grid's CTAs in its launch order, the tail's tiles tail_parts each
            tiles = num_n_blocks * grid_heads * num_batch
            grid = (tiles + (tiles - tail_start) * (tail_parts - 1), 1, 1)
            tail = TailSplit.create(tail_start, tail_parts, num_n_blocks)
        elif cutlass.const_expr(self.persistent):
            # persistent CTAs over the plain grid's tiles (bwd_persistent.py): no tile split,
            # so `tail` carries the tile count and the divisor by the key tiles
            tiles = num_n_blocks * grid_heads * num_batch
            grid = (self.config.persistent_ctas, 1, 1)
            tail = TailSplit.create(tiles, 1, num_n_blocks)
        else:
            tail = TailSplit(tail_start, tail_parts, num_n_blocks)  # unread
        sections = None
        if cutlass.const_expr(self.l2_sections):
            # a pair's query rows: the dense length, or for packed sequences the grid's key
            # length (the longest sequence's), which overestimates the shorter pairs
            rows = mQ.shape[0]
            if cutlass.const_expr(self.varlen):
                rows = num_n_blocks * tn
            sections = L2Sections.create(
                num_n_blocks, grid_heads * num_batch, rows, self.l2_row_bytes,
                self.config.l2_section_bytes, last_sections=self.config.l2_last_sections,
                last_max_pairs=BWD_L2_LAST_MAX_PAIRS,
            )  # fmt: skip
        self.kernel(
            tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq, tiled_mma_dq_part,
            tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
            tma_atom_dK, tma_dK, tma_atom_dV, tma_dV, tma_atom_dQ, tma_dQ,
            tma_atom_LSE, tma_LSE, tma_atom_Dsum, tma_Dsum, mSem,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sP_layout, sdQ_layout,
            sdK_layout, sLSE_layout, sDsum_layout,
            softmax_scale_log2, score_premul, softmax_scale, window_left, window_right,
            mCuSeqlensQ, mCuSeqlensK, sections, mTailAcc, tail,
        ).launch(
            grid=grid,
            block=[self.roles.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
            # pre_overlap: launched while the persistent preprocess runs (its CTAs allow it at
            # once); the roles that read its output wait for their head's ready count
            use_pdl=self.pre_overlap,
        )  # fmt: skip

    # ------------------------------------------------------------------ device entry
    @cute.kernel
    def kernel(
        self,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dk: cute.TiledMma,
        tiled_mma_dv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        tiled_mma_dq_part: cute.TiledMma,
        tma_atom_Q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_dO: cute.CopyAtom,
        mdO: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        mV: cute.Tensor,
        tma_atom_dK: cute.CopyAtom,
        mdK: cute.Tensor,
        tma_atom_dV: cute.CopyAtom,
        mdV: cute.Tensor,
        tma_atom_dQ: cute.CopyAtom,
        mdQacc: cute.Tensor,
        tma_atom_LSE: cute.CopyAtom,
        mLSE: cute.Tensor,
        tma_atom_Dsum: cute.CopyAtom,
        mDsum: cute.Tensor,
        mSem: cute.Tensor,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        sdQ_layout: cute.ComposedLayout | cute.Layout,
        sdK_layout: cute.ComposedLayout,
        sLSE_layout: cute.Layout,
        sDsum_layout: cute.Layout,
        softmax_scale_log2: Float32,
        score_premul: Float32,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        sections: L2Sections | None,
        mTailAcc: cute.Tensor | None,
        tail: TailSplit,
    ):
        roles = self.roles
        timeline = self.config.timeline  # mTailAcc is the CTAs' event records
        if cutlass.const_expr(timeline):
            if cute.arch.thread_idx()[0] == 0:
                tl.stamp(mTailAcc, tl.W_CLK_START, tl.clock())
                tl.stamp(mTailAcc, tl.W_GT_START, tl.globaltimer_lo())
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == roles.load_warp:
            for atom in (tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V, tma_atom_LSE):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)

        warps = roles.num_mma_threads // 32  # consumer warps: each releases a stage once
        pipe_kv = tma_pipeline(storage.mbar_kv, 1, self.tx_bytes_kv, warps)
        pipe_q = tma_pipeline(storage.mbar_q, self.num_stages, self.tx_bytes_q, warps)
        pipe_do = tma_pipeline(storage.mbar_do, self.do_stages, self.tx_bytes_do, warps)
        sched = None
        if cutlass.const_expr(self.config.persistent_counter):
            sched = self._tile_ring(storage.sched.data_ptr())
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sdK = storage.sK.get_tensor(sdK_layout.outer, swizzle=sdK_layout.inner)  # dK's staging
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sP = sdS  # unused without swap_dkv
        if cutlass.const_expr(self.swap_dkv):
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        if cutlass.const_expr(self.flat is not None):
            sdQ = storage.sdQ.get_tensor(sdQ_layout)
        else:
            sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        sLSE = storage.sLSE.get_tensor(sLSE_layout)
        sDsum = storage.sDsum.get_tensor(sDsum_layout)

        if cutlass.const_expr(self.persistent):
            self._persistent_roles(
                tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq, tiled_mma_dq_part,
                tma_atom_Q, mQ, tma_atom_dO, mdO, tma_atom_K, mK, tma_atom_V, mV,
                tma_atom_dQ, mdQacc, tma_atom_LSE, mLSE, tma_atom_Dsum, mDsum, mSem,
                sQ, sdO, sK, sV, sdS, sP, sdQ, sdK, sLSE, sDsum, pipe_kv, pipe_q, pipe_do,
                tma_atom_dK, mdK, tma_atom_dV, mdV,
                softmax_scale_log2, score_premul, softmax_scale, window_left, window_right,
                mCuSeqlensQ, mCuSeqlensK, sections, mTailAcc, tail, sched,
            )  # fmt: skip
        else:
            n_block, head, seq, row_off, mask, m_min, m_max = self._tile(
                cute.arch.block_idx(), mQ, mK, mCuSeqlensQ, mCuSeqlensK, sections, tail,
                window_left, window_right,
            )  # fmt: skip
            if cutlass.const_expr(timeline):
                if cute.arch.thread_idx()[0] == 0:
                    tl.stamp(mTailAcc, tl.W_SMID, tl.smid())
                    tl.stamp(mTailAcc, tl.W_N_BLOCK, n_block)
                    tl.stamp(mTailAcc, tl.W_HEAD, head)
                    tl.stamp(mTailAcc, tl.W_WALK, m_max - m_min)

            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
            if cutlass.const_expr(self.post_overlap):
                # the postprocess may start once every CTA got here: its CTAs wait for their
                # head's done count (dq_writer), so they only take SMs the grid has left
                cute.arch.griddepcontrol_launch_dependents()

            # a packed batch's grid is sized by its longest key sequence: tiles past this one's
            # end have nothing to do, not even zeros to store (every role leaves together)
            if n_block * self.tile_n < seq.seqlen_k:
                wg_idx = cute.arch.make_warp_uniform(warp_idx // 4)
                if wg_idx == 0:
                    cute.arch.setmaxregister_decrease(roles.producer_regs)
                    if warp_idx == roles.load_warp:
                        self.load(
                            tma_atom_Q, mQ, tma_atom_dO, mdO, tma_atom_K, mK, tma_atom_V, mV,
                            tma_atom_LSE, mLSE, tma_atom_Dsum, mDsum,
                            sQ, sdO, sK, sV, sLSE, sDsum, pipe_kv, pipe_q, pipe_do,
                            seq, row_off, n_block, head, m_min, m_max, mSem, mTailAcc,
                        )  # fmt: skip
                    # the dQ writers: warp 1, and (dq_writers > 1) the warps after it
                    last_writer = roles.dq_warp + self.config.dq_writers - 1
                    if warp_idx >= roles.dq_warp and warp_idx <= last_writer:
                        self.dq_writer(
                            tma_atom_dQ, mdQacc, sdQ, mSem, mask, seq, row_off, n_block, head,
                            m_min, m_max, mLSE.shape[0], warp_idx - roles.dq_warp, tail, mTailAcc,
                        )  # fmt: skip
                else:
                    cute.arch.setmaxregister_increase(roles.mma_regs)
                    self.mma(
                        tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq, tiled_mma_dq_part,
                        tma_atom_dK, mdK, tma_atom_dV, mdV,
                        sQ, sdO, sK, sV, sdS, sP, sdQ, sdK, sLSE, sDsum, pipe_kv, pipe_q, pipe_do,
                        mask, seq, n_block, head, m_min, m_max,
                        softmax_scale_log2, score_premul, softmax_scale, mTailAcc, mSem, tail,
                    )  # fmt: skip

    @cute.jit
    def _tile(
        self,
        block,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        sections: L2Sections | None,
        tail: TailSplit,
        window_left: Int32,
        window_right: Int32,
    ):
        """A tile's coordinates and walk, (n_block, head, seq, row_off, mask, m_min, m_max),
        from its index `block` on the plain (key tiles, heads, batches) grid: the CTA's own
        (x, y, z), or a persistent CTA's tile there. tail_split's part, the L2 sections'
        launch order and the deterministic order's right-to-left launch are applied here."""
        n_block, head, batch = block
        # tail_split: this CTA's part of its key tile (0 of 1 for a whole tile)
        part, parts = Int32(0), Int32(1)
        if cutlass.const_expr(self.tail_split):
            n_block, head, batch, part, parts = tail_split_coords(tail, cute.size(mQ.shape[2]))
        if cutlass.const_expr(self.l2_sections):
            pairs_heads = cute.size(mQ.shape[2]) // self.heads_per_cta
            if cutlass.const_expr(self.persistent):
                n_block, head, batch = l2_section_coords(
                    sections, pairs_heads, reverse=False, block=(n_block, head, batch)
                )
            else:
                n_block, head, batch = l2_section_coords(sections, pairs_heads, reverse=False)
        if cutlass.const_expr(self.deterministic and self.has_right):
            # right-to-left turns (see dq_writer) wait on higher key tiles: launch those first.
            # Warp-uniform, or ptxas keeps the value per thread and the consumers spill at D=64.
            n_block = cute.arch.make_warp_uniform(cute.arch.grid_dim()[0] - 1 - n_block)
        # dense: offsets 0, lengths the tensors' and batch coordinates `batch`; packed: the
        # sequence's rows, batch coordinates 0
        seq = SeqInfo.create(
            self.features, batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK,
            None, None, None,
        )  # fmt: skip
        # first row of this sequence in the per-row buffers (lse_log2, D, dQ accumulator)
        row_off = Int32(0)
        if cutlass.const_expr(self.varlen):
            row_off = padded_row_offset(seq.offset_q, batch, self.tile_m)
        # end_aligned: rows counted from the front padding (the diagonal, anchored at the last
        # row, stays put; padding rows have zero Q and dO and lse_log2 +inf: P = dS = 0)
        mask_rows = seq.seqlen_q
        if cutlass.const_expr(self.end_aligned):
            mask_rows = cute.ceil_div(seq.seqlen_q, self.tile_m) * self.tile_m
        mask = TileMask(
            self.tile_m,
            self.tile_n,
            mask_rows,
            seq.seqlen_k,
            window_left,
            window_right,
            self.has_left,
            self.has_right,
            self.config.mask_bits,
        )
        m_min, m_max = mask.m_block_range(n_block)
        if cutlass.const_expr(self.tail_split):
            # part p of a split tile walks the p-th contiguous share of its query tiles
            span = m_max - m_min
            m_lo = m_min + span * part // parts
            m_max = m_min + span * (part + 1) // parts
            m_min = m_lo
        return n_block, head, seq, row_off, mask, m_min, m_max

    # ------------------------------------------------------------------ producer role
    @cute.jit
    def load(
        self,
        tma_atom_Q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_dO: cute.CopyAtom,
        mdO: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        mV: cute.Tensor,
        tma_atom_LSE: cute.CopyAtom,
        mLSE: cute.Tensor,
        tma_atom_Dsum: cute.CopyAtom,
        mDsum: cute.Tensor,
        sQ: cute.Tensor,
        sdO: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sLSE: cute.Tensor,
        sDsum: cute.Tensor,
        pipe_kv: pipeline.PipelineAsync,
        pipe_q: pipeline.PipelineAsync,
        pipe_do: pipeline.PipelineAsync,
        seq: SeqInfo,
        row_off: Int32,
        n_block: Int32,
        head: Int32,
        m_min: Int32,
        m_max: Int32,
        mSem: cute.Tensor,
        mTimeline: cute.Tensor | None,
        states: tuple | None = None,
    ):
        """One key tile's loads. A persistent CTA passes its pipeline states (K / V, Q,
        dO) in and gets them back, advanced, for its next tile, and drains them itself."""
        head_kv = head * self.heads_per_cta // self.qhead_per_kvhead
        d, dv, tm, tn = self.tile_d, self.tile_dv, self.tile_m, self.tile_n
        qb = seq.q_batch
        gK = cute.local_tile(
            self._head_rows(seq, mK, head_kv, keys=True), (tn, self.tile_dq), (n_block, 0)
        )
        gV = cute.local_tile(self._head_rows(seq, mV, head_kv, keys=True), (tn, dv), (n_block, 0))
        tKsK, tKgK = tma_tiles(tma_atom_K, sK, gK)
        tVsV, tVgV = tma_tiles(tma_atom_V, sV, gV)
        persistent = states is not None
        if cutlass.const_expr(not persistent):
            # a state of its own for dO even when the stage counts agree: the DSL carries
            # each name through the loop separately, so an alias of `state` would not
            # advance with it
            states = self._pipeline_states(pipeline.PipelineUserType.Producer)
        kv_state, state, state_do = states
        if m_max > m_min:
            pipe_kv.producer_acquire(kv_state)
            kv_bar = pipe_kv.producer_get_barrier(kv_state)
            cute.copy(tma_atom_K, tKgK, tKsK, tma_bar_ptr=kv_bar)
            cute.copy(tma_atom_V, tVgV, tVsV, tma_bar_ptr=kv_bar)
            # the tail below waits on the parity of the *next* use of the stage: without this
            # advance it waited for a release that never comes (a hang once the consumers
            # had already released K/V)
            kv_state.advance()
            for g in cutlass.range(self.heads_per_cta, unroll=1):
                head_q = head * self.heads_per_cta + g
                gQ = cute.local_tile(self._query_rows(seq, mQ, head_q), (tm, d), (None, 0))
                gdO = cute.local_tile(self._query_rows(seq, mdO, head_q), (tm, dv), (None, 0))
                gLSE = cute.local_tile(
                    self._padded_rows(mLSE[None, head_q, qb], row_off), (tm,), (None,)
                )
                gDsum = cute.local_tile(
                    self._padded_rows(mDsum[None, head_q, qb], row_off), (tm,), (None,)
                )
                tQsQ, tQgQ = tma_tiles(tma_atom_Q, sQ, gQ)
                tdOsdO, tdOgdO = tma_tiles(tma_atom_dO, sdO, gdO)
                tLsL, tLgL = tma_tiles(tma_atom_LSE, sLSE, gLSE, rank=1)
                tDsD, tDgD = tma_tiles(tma_atom_Dsum, sDsum, gDsum, rank=1)
                self._wait_ready(mSem, head_q, qb, mLSE.shape[0])
                if cutlass.const_expr(self.config.timeline):
                    if cute.arch.lane_idx() == 0:
                        tl.stamp(mTimeline, tl.W_CLK_READY, tl.clock())
                for m_block in cutlass.range(m_min, m_max, unroll=1):
                    pipe_q.producer_acquire(state)
                    q_bar = pipe_q.producer_get_barrier(state)
                    cute.copy(
                        tma_atom_Q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=q_bar
                    )
                    cute.copy(
                        tma_atom_LSE,
                        tLgL[None, m_block],
                        tLsL[None, state.index],
                        tma_bar_ptr=q_bar,
                    )
                    pipe_do.producer_acquire(state_do)
                    do_bar = pipe_do.producer_get_barrier(state_do)
                    cute.copy(
                        tma_atom_dO,
                        tdOgdO[None, m_block],
                        tdOsdO[None, state_do.index],
                        tma_bar_ptr=do_bar,
                    )
                    cute.copy(
                        tma_atom_Dsum,
                        tDgD[None, m_block],
                        tDsD[None, state_do.index],
                        tma_bar_ptr=do_bar,
                    )
                    state.advance()
                    state_do.advance()
            if cutlass.const_expr(not persistent):
                pipe_q.producer_tail(state)
                pipe_do.producer_tail(state_do)
                pipe_kv.producer_tail(kv_state)
        return kv_state, state, state_do

    # ------------------------------------------------------------------ consumer role
    @cute.jit
    def mma(
        self,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dk: cute.TiledMma,
        tiled_mma_dv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        tiled_mma_dq_part: cute.TiledMma,
        tma_atom_dK: cute.CopyAtom,
        mdK: cute.Tensor,
        tma_atom_dV: cute.CopyAtom,
        mdV: cute.Tensor,
        sQ: cute.Tensor,
        sdO: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sdS: cute.Tensor,
        sP: cute.Tensor,
        sdQ: cute.Tensor,
        sdK: cute.Tensor,
        sLSE: cute.Tensor,
        sDsum: cute.Tensor,
        pipe_kv: pipeline.PipelineAsync,
        pipe_q: pipeline.PipelineAsync,
        pipe_do: pipeline.PipelineAsync,
        mask: TileMask,
        seq: SeqInfo,
        n_block: Int32,
        head: Int32,
        m_min: Int32,
        m_max: Int32,
        softmax_scale_log2: Float32,
        score_premul: Float32,
        softmax_scale: Float32,
        mTailAcc: cute.Tensor | None,
        mSem: cute.Tensor,
        tail: TailSplit,
        states: tuple | None = None,
    ):
        """One key tile's walk and dK / dV. A persistent CTA passes its pipeline states in
        and gets them back for its next tile; its dK / dV go out from registers, and it
        waits for the dQ writer's last add itself, after its last tile (`_drain_dq`)."""
        roles = self.roles
        tm, tn = self.tile_m, self.tile_n
        single_ds = self.config.single_ds
        tidx = cute.arch.thread_idx()[0] - 128  # index among consumer threads
        wg = cute.arch.make_warp_uniform(tidx // 128)  # wgmma descriptors in uniform registers
        wg_threads = cute.make_layout(self.config.num_mma_warpgroups, stride=128)
        wg_sdp = tiled_mma_sdp.get_slice(wg_threads(wg))
        wg_dk = tiled_mma_dk.get_slice(wg_threads(wg))
        wg_dv = tiled_mma_dv.get_slice(wg_threads(wg))
        wg_dq = tiled_mma_dq.get_slice(wg_threads(wg))
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        thr_dq = tiled_mma_dq.get_slice(tidx)

        # operand fragments (smem descriptors); stage modes stay last
        if cutlass.const_expr(self.swap_sdp):
            tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
            tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
            tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
            tdPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        else:
            tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ))
            tSrK = wg_sdp.make_fragment_B(wg_sdp.partition_B(sK))
            tdPrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO))
            tdPrV = wg_sdp.make_fragment_B(wg_sdp.partition_B(sV))
        if cutlass.const_expr(self.swap_dq):
            tdQrKt = wg_dq.make_fragment_A(wg_dq.partition_A(transpose_smem_view(sK)))
            tdQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(sdS))
        else:
            tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
            tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_smem_view(sK)))
        if cutlass.const_expr(self.swap_dkv):
            # dV^T = dO^T P, dK^T = Q^T dS: (head dim, query) A, (key, query) B views
            tdVrdOt = wg_dv.make_fragment_A(wg_dv.partition_A(transpose_smem_view(sdO)))
            tdVrP = wg_dv.make_fragment_B(wg_dv.partition_B(transpose_smem_view(sP)))
            tdKrQt = wg_dk.make_fragment_A(wg_dk.partition_A(transpose_smem_view(sQ)))
            tdKrdS = wg_dk.make_fragment_B(wg_dk.partition_B(transpose_smem_view(sdS)))
            dk_shape, dv_shape = (self.tile_d, tn), (self.tile_dv, tn)
        else:
            tdVrdOt = wg_dv.make_fragment_B(wg_dv.partition_B(transpose_smem_view(sdO)))
            tdKrQt = wg_dk.make_fragment_B(wg_dk.partition_B(transpose_smem_view(sQ)))
            dk_shape, dv_shape = (tn, self.tile_d), (tn, self.tile_dv)

        # S^T / dP^T as (key, query), or S / dP as (query, key)
        st_shape = (tn, tm) if cutlass.const_expr(self.swap_sdp) else (tm, tn)
        acc_shape_st = wg_sdp.partition_shape_C(st_shape)
        acc_shape_dq = thr_dq.partition_shape_C(
            (self.tile_dq, tm) if cutlass.const_expr(self.swap_dq) else (tm, self.tile_d)
        )
        if cutlass.const_expr(
            self.config.s_under_dk and cute.size(acc_shape_dq) > cute.size(acc_shape_st)
        ):
            # s_under_dk accumulates dQ^T in the S^T registers
            raise ValueError("s_under_dk: dQ^T's accumulator must fit in S^T's registers")
        acc_dk = cute.make_rmem_tensor(wg_dk.partition_shape_C(dk_shape), Float32)
        acc_dv = cute.make_rmem_tensor(wg_dv.partition_shape_C(dv_shape), Float32)
        acc_dk.fill(0.0)
        acc_dv.fill(0.0)

        # (key, query) coordinates of this thread's S^T elements ((query, key) of S's)
        tScS = thr_sdp.partition_C(cute.make_identity_tensor(st_shape))
        # dS^T registers -> dS in smem: transposing stmatrix through the S^T MMA's C layout
        # (S's registers are dS's rows already)
        store_ds_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=self.swap_sdp, num_matrices=4),
            self.dtype,
        )
        thr_store_ds = cute.make_tiled_copy_C(store_ds_atom, tiled_mma_sdp).get_slice(tidx)
        sdS_c, sP_c = sdS, sP
        if cutlass.const_expr(self.swap_sdp):
            sdS_c, sP_c = transpose_smem_view(sdS), transpose_smem_view(sP)
        tdSsdS = thr_store_ds.partition_D(sdS_c)
        tPsP = thr_store_ds.partition_D(sP_c)
        if cutlass.const_expr(self.flat is not None):
            # dQ^T in register order (arch/common/dq_flat.py): a (d part, tm, buffer) view
            shape, stride = self.flat.part_layout()
            sdQ_t = cute.make_tensor(
                sdQ.iterator,
                cute.make_layout(
                    (*shape, self.config.dq_stages), stride=(*stride, self.flat.part_elems)
                ),
            )
            if cutlass.const_expr(self.dq_halves):
                tdQsdQ = tiled_mma_dq_part.get_slice(tidx % 128).partition_C(sdQ_t)
            else:
                tdQsdQ = thr_dq.partition_C(sdQ_t)
        elif cutlass.const_expr(self.swap_dq and self.dq_halves):
            # this warpgroup's (d / 2, tm) part of dQ^T, through the transpose of its buffer
            tdQsdQ = tiled_mma_dq_part.get_slice(tidx % 128).partition_C(transpose_smem_view(sdQ))
        elif cutlass.const_expr(self.swap_dq):
            # this warpgroup's query columns of dQ^T, through the transpose of the whole tile
            tdQsdQ = thr_dq.partition_C(transpose_smem_view(sdQ))
        elif cutlass.const_expr(self.dq_halves):
            # this warpgroup's (tm, d / 2) part of dQ, in the half-size staging buffer
            tdQsdQ = tiled_mma_dq_part.get_slice(tidx % 128).partition_C(sdQ)
        else:
            tdQsdQ = thr_dq.partition_C(sdQ)
        bar_dq_full, bar_dq_empty, dq_threads, dq_buf = self._dq_handoff(wg)

        # lse / D of the query of each S^T (S) element: the (tm, stages) row vectors seen
        # through a (tn, tm, stages) ((tm, tn, stages)) view that ignores the key (stride 0)
        rs = self.config.row_stage_stride
        row_stride = (0, 1) if cutlass.const_expr(self.swap_sdp) else (1, 0)
        sLSE_st = cute.make_tensor(
            sLSE.iterator, cute.make_layout((*st_shape, self.num_stages), stride=(*row_stride, rs))
        )
        sDsum_st = cute.make_tensor(
            sDsum.iterator, cute.make_layout((*st_shape, self.do_stages), stride=(*row_stride, rs))
        )

        persistent = states is not None
        if cutlass.const_expr(not persistent):
            states = self._pipeline_states(pipeline.PipelineUserType.Consumer)
        kv_state, state, state_do = states
        if m_max > m_min:
            pipe_kv.consumer_wait(kv_state)
            if cutlass.const_expr(self.config.timeline):
                if tidx == 0:
                    tl.stamp(mTailAcc, tl.W_CLK_KV, tl.clock())
            # dO, D and P: their own stages (BwdTileConfig.do_stages), with a state of their
            # own even when the stage counts agree (see load). No warp overwrites a stage of P
            # or dS another warp still reads: P's stage of tile m is rewritten in tile
            # m + do_stages after that tile's dO wait, so after every warp released dO of
            # tile m, which each does once its dV GEMM (P's reader) is done; dS's (Q's stage)
            # in tile m + num_stages after Q's wait, so after every warp finished tile m's dK.
            # With single_ds a warpgroup writes its part of the one dS buffer once the other
            # warpgroup's GEMMs of the tile before are done (bar_ds_free), which starts free.
            if cutlass.const_expr(single_ds):
                cute.arch.barrier_arrive(
                    barrier_id=roles.bar_ds_free + 1 - wg, number_of_threads=roles.num_mma_threads
                )
            # (test each tile, first, end) segments of the query tiles: with split_mask_loops
            # the ones every key of this tile sees fully run without mask code or per-tile test
            segments = [(True, m_min, m_max)]
            if cutlass.const_expr(self.config.split_mask_loops):
                free_lo, free_hi = mask.unmasked_m_range(n_block, m_min, m_max)
                segments = [(True, m_min, free_lo), (False, free_lo, free_hi)]
                if cutlass.const_expr(mask.has_left):
                    segments.append((True, free_hi, m_max))
            walked = Int32(0)  # query tiles walked (dq_writers > 1: whose writer, dq_writer)
            s_ahead = self.config.s_under_dk
            if cutlass.const_expr(s_ahead):
                # the S^T accumulator lives across iterations; the first tile's S^T is issued
                # here, each next one at the end of the tile before it. tiles_left: the query
                # tiles after the current one (a group_heads CTA walks them for each head)
                acc_s_ahead = cute.make_rmem_tensor(acc_shape_st, Float32)
                tiles_left = (m_max - m_min) * self.heads_per_cta
                pipe_q.consumer_wait(state)
                self._issue_s(tiled_mma_sdp, acc_s_ahead, tSrK, tSrQ, state.index)
            # GQA with group_heads: the query heads of the KV head in turn, one pipeline
            # run across them (dK / dV keep accumulating)
            for _g in cutlass.range(self.heads_per_cta, unroll=1):
                for seg in cutlass.range_constexpr(len(segments)):
                    test_mask, m_lo, m_hi = segments[seg]
                    for m_block in cutlass.range(m_lo, m_hi, unroll=1):
                        stage, stage_do = state.index, state_do.index
                        ds_stage = 0 if cutlass.const_expr(single_ds) else stage
                        if cutlass.const_expr(s_ahead):
                            tiles_left -= 1
                        # ---- S^T = K Q^T, dP^T = V dO^T (lse / D arrived in smem with Q / dO)
                        acc_dp = cute.make_rmem_tensor(acc_shape_st, Float32)
                        if cutlass.const_expr(s_ahead):
                            acc_s = acc_s_ahead
                        else:
                            acc_s = cute.make_rmem_tensor(acc_shape_st, Float32)
                            pipe_q.consumer_wait(state)
                            self._issue_s(tiled_mma_sdp, acc_s, tSrK, tSrQ, stage)
                        # this thread's query columns of lse_log2 / D, read from smem where used
                        # (loading lse into registers here, before the GEMMs, measured no faster:
                        # tune_bwd_lse_dq2_h200.json)
                        t_lse = self._query_stat(thr_sdp.partition_C(sLSE_st[None, None, stage]))
                        pipe_do.consumer_wait(state_do)
                        a_dp, b_dp = tdPrV, tdPrdO[None, None, None, stage_do]
                        if cutlass.const_expr(not self.swap_sdp):
                            a_dp, b_dp = b_dp, a_dp
                        gemm(
                            tiled_mma_sdp, acc_dp, a_dp, b_dp, True,
                            k_blocks=self.head_dim_v // 16,
                        )  # fmt: skip
                        warpgroup.wait_group(1)
                        # ---- P^T (16-bit, for dV) and dS^T = P^T (dP^T - D)
                        if cutlass.const_expr(self.has_softcap):
                            apply_softcap(acc_s, score_premul)
                        if cutlass.const_expr(test_mask):
                            if mask.tile_needs_mask(m_block, n_block):
                                mask.apply(acc_s, tScS, m_block, n_block, transposed=self.swap_sdp)
                        t_dsum = self._query_stat(
                            thr_sdp.partition_C(sDsum_st[None, None, stage_do])
                        )
                        r_p = self._probs_and_ds(acc_s, acc_dp, t_lse, t_dsum, softmax_scale_log2)
                        r_ds = cute.make_rmem_tensor_like(acc_dp, self.dtype)
                        r_ds.store(acc_dp.load().to(self.dtype))
                        r_ds_st = thr_store_ds.retile(r_ds)
                        if cutlass.const_expr(single_ds):
                            cute.arch.barrier(
                                barrier_id=roles.bar_ds_free + wg,
                                number_of_threads=roles.num_mma_threads,
                            )
                        cute.copy(store_ds_atom, r_ds_st, tdSsdS[None, None, None, ds_stage])
                        if cutlass.const_expr(self.swap_dkv):
                            # P^T and dS of both warpgroups' query columns feed dV^T and dK^T
                            cute.copy(
                                store_ds_atom,
                                thr_store_ds.retile(r_p),
                                tPsP[None, None, None, stage_do],
                            )
                        else:
                            # ---- dV += P^T dO (overlaps the dS exchange below)
                            gemm(
                                tiled_mma_dv, acc_dv, acc_as_operand_a(r_p),
                                tdVrdOt[None, None, None, stage_do], False,
                            )  # fmt: skip
                        # dS written by both warpgroups must be visible to the async proxy (wgmma)
                        cute.arch.fence_view_async_shared()
                        cute.arch.barrier(
                            barrier_id=roles.bar_ds, number_of_threads=roles.num_mma_threads
                        )
                        if cutlass.const_expr(self.swap_dkv):
                            # ---- dV^T += dO^T P
                            gemm(
                                tiled_mma_dv, acc_dv, tdVrdOt[None, None, None, stage_do],
                                tdVrP[None, None, None, stage_do], False,
                            )  # fmt: skip
                        # ---- dQ = dS K, dK += dS^T Q (dK^T += Q^T dS under swap_dkv)
                        if cutlass.const_expr(s_ahead):
                            # dQ^T accumulates in the S^T registers (dead once dS is formed;
                            # the next S^T overwrites them once dQ^T is staged): a wgmma reads
                            # its accumulator even when it zero-fills it, so a separate S^T
                            # accumulator would stay live through dQ^T and dK (ptxas then
                            # serializes every wgmma for want of registers)
                            acc_dq = cute.make_tensor(
                                acc_s_ahead.iterator, cute.make_layout(acc_shape_dq)
                            )
                        else:
                            acc_dq = cute.make_rmem_tensor(acc_shape_dq, Float32)
                        r_dqs = tdQrdS[None, None, None, ds_stage]
                        if cutlass.const_expr(self.swap_dq):
                            gemm(tiled_mma_dq, acc_dq, tdQrKt, r_dqs, True)  # dQ^T = K^T dS^T
                        else:
                            gemm(tiled_mma_dq, acc_dq, r_dqs, tdQrKt, True)
                        if cutlass.const_expr(self.swap_dkv):
                            gemm(
                                tiled_mma_dk, acc_dk, tdKrQt[None, None, None, stage],
                                tdKrdS[None, None, None, ds_stage], False,
                            )  # fmt: skip
                        else:
                            # dS^T's registers, as dK's A operand
                            gemm(
                                tiled_mma_dk, acc_dk, acc_as_operand_a(r_ds),
                                tdKrQt[None, None, None, stage], False,
                            )  # fmt: skip
                        warpgroup.wait_group(1)  # dV and dQ done
                        pipe_do.consumer_release(state_do)
                        # ---- hand the dQ partial to the writer warp
                        cute.arch.barrier(barrier_id=bar_dq_empty, number_of_threads=dq_threads)
                        tdQsdQ[None, None, None, dq_buf].store(acc_dq.load())
                        cute.arch.fence_view_async_shared()
                        full = bar_dq_full
                        writers = self.config.dq_writers
                        if cutlass.const_expr(writers > 1 and writers == self.num_stages):
                            # this tile's writer (dq_writer: the walk's tiles in turn) is its
                            # Q stage, which cycles alike: no counter
                            full = self._dq_full_barrier(bar_dq_full, stage)
                        elif cutlass.const_expr(writers > 1):
                            full = self._dq_full_barrier(bar_dq_full, self._writer_of(walked))
                            walked += 1
                        cute.arch.barrier_arrive(barrier_id=full, number_of_threads=dq_threads)
                        if cutlass.const_expr(s_ahead):
                            if tiles_left > 0:
                                # the next tile's S^T queues behind this tile's dK
                                state_next = state.clone()
                                state_next.advance()
                                pipe_q.consumer_wait(state_next)
                                self._issue_s(
                                    tiled_mma_sdp, acc_s_ahead, tSrK, tSrQ, state_next.index
                                )
                                warpgroup.wait_group(1)  # dK done
                            else:
                                # no wait after the loop (ptxas serializes for one, C7514); it
                                # drains the next S^T in the latch instead (C7517). A loop
                                # rotated so nothing is in flight there measured slower
                                # (docs/design.md, section 5b)
                                warpgroup.wait_group(0)
                        else:
                            warpgroup.wait_group(0)  # dK done: Q (and this dS stage) are free
                        pipe_q.consumer_release(state)
                        if cutlass.const_expr(single_ds):
                            cute.arch.barrier_arrive(
                                barrier_id=roles.bar_ds_free + 1 - wg,
                                number_of_threads=roles.num_mma_threads,
                            )
                        state.advance()
                        state_do.advance()
            if cutlass.const_expr(single_ds):
                # the other warpgroup's arrive after the last tile
                cute.arch.barrier(
                    barrier_id=roles.bar_ds_free + wg, number_of_threads=roles.num_mma_threads
                )
            pipe_kv.consumer_release(kv_state)
            if cutlass.const_expr(persistent):
                kv_state.advance()
            if cutlass.const_expr(self.config.timeline):
                if tidx == 0:
                    tl.stamp(mTailAcc, tl.W_CLK_LOOP_END, tl.clock())
        if cutlass.const_expr(persistent):
            # K / V's buffers are the producer's again: dK / dV go out from registers
            self.epilogue_direct(
                tiled_mma_dk, tiled_mma_dv, mdK, mdV, acc_dk, acc_dv, tidx, seq, n_block, head,
                softmax_scale,
            )  # fmt: skip
            return kv_state, state, state_do
        if cutlass.const_expr(not self.config.epilogue_first):
            self._drain_dq(wg)
        final = cutlass.Boolean(True)
        if cutlass.const_expr(self.tail_split):
            final = self._tail_fixup(
                acc_dk, acc_dv, mTailAcc, mSem, sLSE, tail, seq, n_block, head, tidx
            )  # fmt: skip
        if final:
            self.epilogue(
                tiled_mma_dk, tiled_mma_dv, tma_atom_dK, mdK, tma_atom_dV, mdV, sdK, sV,
                acc_dk, acc_dv, tidx, seq, n_block, head, softmax_scale, mTailAcc,
            )  # fmt: skip
        if cutlass.const_expr(self.config.epilogue_first):
            self._drain_dq(wg)

    # ------------------------------------------------------------------ helpers
    def _pipeline_states(self, kind):
        """Fresh (K / V, Q, dO) pipeline states of one side (`kind`)."""
        return tuple(
            pipeline.make_pipeline_state(kind, n) for n in (1, self.num_stages, self.do_stages)
        )

    @cute.jit
    def _dq_handoff(self, wg: Int32):
        """The dQ handoff of warpgroup `wg`: (full barrier, empty barrier, their thread
        count, its staging buffer), the writer's barriers for this warpgroup's part, or for
        all of dQ."""
        roles = self.roles
        bar_dq_full, bar_dq_empty = roles.bar_dq_full, roles.bar_dq_empty
        dq_threads = roles.dq_sync_threads
        dq_buf = 0  # this warpgroup's staging buffer
        if cutlass.const_expr(self.dq_halves or self.dq_wg_handoff):
            bar_dq_full = roles.bar_dq_full + roles.bar_dq_wg_step * wg
            bar_dq_empty = roles.bar_dq_empty + roles.bar_dq_wg_step * wg
            if cutlass.const_expr(self.dq_wg_bufs):
                dq_buf = wg
            dq_threads = roles.dq_half_sync_threads
        return bar_dq_full, bar_dq_empty, dq_threads, dq_buf

    @cute.jit
    def _drain_dq(self, wg: Int32):
        """Balance the writer's last arrive on dq_empty (it also means the last reduce read
        sdQ): with a buffer per warpgroup each waits on its own barrier; with one shared half
        buffer that arrive is the first warpgroup's."""
        _, bar_dq_empty, dq_threads, _ = self._dq_handoff(wg)
        if cutlass.const_expr(self.dq_halves and not self.dq_wg_bufs):
            if wg == 0:
                cute.arch.barrier(barrier_id=bar_dq_empty, number_of_threads=dq_threads)
        else:
            cute.arch.barrier(barrier_id=bar_dq_empty, number_of_threads=dq_threads)

    @cute.jit
    def _wait_ready(self, mSem: cute.Tensor, head_q: Int32, batch: Int32, rows: Int32):
        """pre_overlap: a warp waits until the persistent preprocess has written `rows` rows of
        (batch, head_q) (lse_log2, D, the cleared accumulator), then orders its TMA reads
        and reduce-adds (async proxy) after that acquire."""
        if cutlass.const_expr(self.pre_overlap):
            if cute.arch.lane_idx() == 0:
                ptr = mSem.iterator + cute.crd2idx((mSem.shape[0] - 1, head_q, batch), mSem.layout)
                wait_at_least(ptr, rows, 128)
            cute.arch.sync_warp()
            cute.arch.fence_proxy("async.global")

    def _head_rows(self, seq: SeqInfo, t: cute.Tensor, head: Int32, keys: bool = False):
        """(seq, dim) rows of one head of a loaded tensor (q / dO, or with `keys` k / v) from
        this sequence's first row on; packed, through its ragged view (__call__), so the rows
        past the sequence's last one are outside it."""
        if cutlass.const_expr(self.varlen):
            return seq.ragged_rows_k(t, head) if keys else seq.ragged_rows_q(t, head)
        if keys:
            return seq.rows_k(t[None, None, head, seq.kv_batch])
        return seq.rows_q(t[None, None, head, seq.q_batch])

    def _query_rows(self, seq: SeqInfo, t: cute.Tensor, head: Int32):
        """q / dO rows of one head as the query tiles take them: from row 0, or under
        end_aligned from row -s (s = (-seqlen_q) mod tile_m), so the first tile is the partial
        one; TMA zero-fills the rows before row 0."""
        rows = self._head_rows(seq, t, head)
        if cutlass.const_expr(self.end_aligned):
            front = cute.ceil_div(seq.seqlen_q, self.tile_m) * self.tile_m - seq.seqlen_q
            rows = cute.domain_offset((-front, 0), rows)
        return rows

    def _padded_rows(self, t: cute.Tensor, row_off: Int32) -> cute.Tensor:
        """t's rows from this sequence's first one in a padded per-row buffer (varlen)."""
        if cutlass.const_expr(self.varlen):
            return cute.domain_offset((row_off,) + (0,) * (cute.rank(t) - 1), t)
        return t

    @cute.jit
    def _issue_s(
        self,
        tiled_mma_sdp: cute.TiledMma,
        acc_s: cute.Tensor,
        tSrK: cute.Tensor,
        tSrQ: cute.Tensor,
        q_stage: Int32,
    ):
        """Issue S^T = K Q^T (S = Q K^T) of the query tile in Q's smem stage q_stage. Zero-filled
        columns (padded_head_dim, dq_head_dim) stay out of the k-blocks: only the tensors' own
        head dims."""
        a_s, b_s = tSrK, tSrQ[None, None, None, q_stage]
        if cutlass.const_expr(not self.swap_sdp):
            a_s, b_s = b_s, a_s
        gemm(tiled_mma_sdp, acc_s, a_s, b_s, True, k_blocks=self.head_dim // 16)

    @cute.jit
    def _query_stat(self, tSsX: cute.Tensor) -> cute.Tensor:
        """A per-query-row statistic (lse_log2 or D) for each query column of this thread's
        S^T elements (each query row of its S elements), in smem: tSsX is the S^T (S)
        partition of its stride-0 (key, query) ((query, key)) view."""
        if cutlass.const_expr(self.swap_sdp):
            return acc_as_rows_cols(tSsX)[0, None]
        return acc_as_rows_cols(tSsX)[None, 0]

    @cute.jit
    def _probs_and_ds(
        self,
        acc_s: cute.Tensor,
        acc_dp: cute.Tensor,
        t_lse: cute.Tensor,
        t_dsum: cute.Tensor,
        scale_log2: Float32,
    ) -> cute.Tensor:
        """P^T = exp2(S^T * scale_log2 - lse_log2) and, in acc_dp, dS^T = P^T (dP^T - D)
        (times 1 - tanh^2 under softcap). Waits for the dP GEMM. Returns P^T in 16 bits, in
        the S^T accumulator's layout.

        Without softcap the exponentials run while dP is still in flight. With it, dP is
        awaited first so that one pass has tanh, P and dP together: keeping 1 - tanh^2 in a
        separate fragment made the D=128 variant spill. Masked scores are -inf, so P = 0, and
        max(.., 0) keeps 0 * (1 - inf^2) from becoming NaN.
        """
        s = acc_as_rows_cols(acc_s)
        dp = acc_as_rows_cols(acc_dp)
        rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
        # the statistics are per query: S^T's column j, or S's row r
        by_col = self.swap_sdp
        if cutlass.const_expr(not self.has_softcap):
            for r in cutlass.range_constexpr(rows):
                for j in cutlass.range_constexpr(cols):
                    q = j if by_col else r
                    s[r, j] = cute.math.exp2(s[r, j] * scale_log2 - t_lse[q], fastmath=True)
            warpgroup.wait_group(0)
            for r in cutlass.range_constexpr(rows):
                for j in cutlass.range_constexpr(cols):
                    q = j if by_col else r
                    dp[r, j] = s[r, j] * (dp[r, j] - t_dsum[q])
        else:
            warpgroup.wait_group(0)
            for r in cutlass.range_constexpr(rows):
                for j in cutlass.range_constexpr(cols):
                    q = j if by_col else r
                    t = s[r, j]
                    p = cute.math.exp2(t * scale_log2 - t_lse[q], fastmath=True)
                    s[r, j] = p
                    dtanh = cute.arch.fmax(1.0 - t * t, Float32(0.0))
                    dp[r, j] = p * (dp[r, j] - t_dsum[q]) * dtanh
        r_p = cute.make_rmem_tensor_like(acc_s, self.dtype)
        r_p.store(acc_s.load().to(self.dtype))
        return r_p
