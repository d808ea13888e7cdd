"""FlashAttention forward for Hopper (SM90) in the CuTe DSL.

One CTA computes one (tile_m query rows, head, batch) output tile:
  * warpgroup 0 (producer, registers lowered by setmaxnreg): warp 0 issues TMA loads of the
    Q tile and of the K/V tiles that hold at least one visible key, into a multi-stage smem
    pipeline completing on mbarriers (K and V in separate pipelines);
  * warpgroups 1..N (consumers, registers raised): each owns 64 query rows. Per key tile:
    S = Q K^T (wgmma, SS), mask only when the tile crosses a mask boundary, online softmax
    in the exp2 domain, O += P V (wgmma, RS: P stays in registers). With intra-warpgroup
    overlap S(j) is issued before P(j-1) V(j-1), so softmax(j) runs while that GEMM is in
    flight; with ping-pong the consumer warpgroups take turns issuing GEMMs (named barriers)
    so one warpgroup's softmax hides under the other's tensor-core work;
  * epilogue: O is normalized, converted, written to smem (aliasing Q) with stmatrix and
    stored by TMA (which clips rows past seqlen_q; packed q stores through a ragged view
    whose extent ends at each sequence's last row, `seqlen.ragged_rows`); lse (natural log)
    is written per row. Split-KV variants store their fp32 partials from registers with a
    row predicate instead; with split_cluster the splits of a tile form one thread-block
    cluster and the leader merges its peers' partials out of their smem (`_merge_splits`)
    before that predicated store of the final out / lse.

Optional inputs (`InputFeatures`, arch/common/seqlen.py; presence is static): cu_seqlens_q/k
(packed sequences, one CTA row range each), seqused_q (rows used per packed sequence),
seqused_k and cache_batch_idx (KV cache), page_table (paged k / v: one TMA box per key tile
from the page that holds it), split-KV (grid z = batch x splits, each CTA an equal share of its
key-tile range; the partials are merged by arch/common/split_combine.py, or with
split_cluster inside the cluster of the tile's splits). The V rows past a sequence inside its
last key tile never reach P V: packed, unpaged k / v load V through a ragged view that ends at
each sequence's last key (TMA fills the rest with zeros); with seqused_k alone or pages they
are zeroed in smem. batch_order: grid z-slice z computes batch row batch_order[z] (longest
first). pack_gqa: the grid walks KV heads and a tile's rows are the (query head, position)
pairs of one KV head's G query heads, G rows a position (`layout.pack_gqa_rows`: TMA boxes
and partitions see the row mode (G, seqlen_q) as two strides); the mask reads row // G as the
query. A tile holds whole positions, floor(tile_m / G) of them (`tile_rows`; where G does not
divide tile_m the rows past them are padding that the MMA computes and the epilogue drops), or
tile_m divides G (whole tiles of one position's heads).

Constraints: fp16/bf16; (head_dim, head_dim_v) from tile_config.SUPPORTED_HEAD_DIMS;
last dim contiguous and every other stride a multiple of 8 elements (16 B, for TMA);
tensors in (batch, seq, heads, dim) layout (packed ones with a unit batch mode); lse
(batch, heads, seq) fp32.

Compile without a GPU (arch/sm90/compile.py holds the fake-tensor signature):
    CUTE_DSL_ARCH=sm_90a python -m cute_attn compile --arch sm_90a
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

from ..common.convert import convert_pairs
from ..common.features import InputFeatures
from ..common.layout import (
    acc_as_operand_a,
    acc_as_rows_cols,
    pack_gqa_rows,
    select_modes,
    transpose_smem_view,
)
from ..common.mask import TileMask, apply_softcap
from ..common.schedule import L2Sections, l2_section_coords
from ..common.seqlen import SeqInfo, ragged_rows
from ..common.softmax import LN2, LOG2E, OnlineSoftmax
from .persistent import PersistentUnits
from .primitives import (
    arrive_after,
    dsmem_address,
    first_rows,
    gemm,
    load_dsmem_f32,
    release_after,
    smem_layout,
    tma_pipeline,
    tma_tiles,
)
from .tile_config import (
    L2_BYTES_SM90,
    SMEM_BYTES_PER_SM_SM90,
    SMEM_BYTES_SM90,
    SUPPORTED_HEAD_DIMS,
    FwdTileConfig,
    packed_tile_rows,
)


@dataclasses.dataclass(frozen=True)
class FwdRoles:
    """Warp roles, register budgets and named-barrier ids of the kernel, in one place."""

    num_mma_warpgroups: int = 2
    load_warp: int = 0  # the one warp of warpgroup 0 that issues TMA loads
    store_warp: int = 4  # first consumer warp: issues the O TMA store
    producer_regs: int = 24
    mma_regs: int = 240
    # named barrier ids (0 is __syncthreads)
    bar_epilogue: int = 1
    bar_sched_first: int = 2  # ping-pong: ids bar_sched_first + consumer warpgroup index

    @property
    def num_threads(self) -> int:
        return 128 * (self.num_mma_warpgroups + 1)

    @property
    def num_mma_threads(self) -> int:
        return 128 * self.num_mma_warpgroups


def _roles_for(num_mma_warpgroups: int, ctas_per_sm: int = 1) -> FwdRoles:
    # 65536 registers / 384 threads: producer 24 + 2 x 240 consumer budgets sum to 504 <= 512.
    # Two CTAs of 256 threads per SM launch at 128 registers each: 56 + 200 = 2 x 128.
    budgets = {1: (56, 256), 2: (24, 240), 3: (32, 160)}[num_mma_warpgroups]
    if ctas_per_sm == 2:
        budgets = (56, 200)
    return FwdRoles(
        num_mma_warpgroups=num_mma_warpgroups, producer_regs=budgets[0], mma_regs=budgets[1]
    )


class FlashFwdSm90:
    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        head_dim_v: int,
        qhead_per_kvhead: int,
        has_left: bool,
        has_right: bool,
        has_softcap: bool,
        config: FwdTileConfig,
        features: InputFeatures | None = None,
    ):
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.qhead_per_kvhead = qhead_per_kvhead
        self.has_left = has_left
        self.has_right = has_right
        self.has_softcap = has_softcap
        self.config = config
        self.features = features or InputFeatures()
        self.roles = _roles_for(config.num_mma_warpgroups, config.ctas_per_sm)
        self._setup_attributes()

    def _setup_attributes(self):
        cfg = self.config
        if self.dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"SM90 forward supports fp16/bf16, got {self.dtype}")
        if (self.head_dim, self.head_dim_v) not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"unsupported head dims ({self.head_dim}, {self.head_dim_v})")
        if self.head_dim_v > self.head_dim:
            raise ValueError("sO aliases sQ, so head_dim_v must be <= head_dim")
        smem = cfg.smem_bytes(self.head_dim, self.head_dim_v)
        if smem > SMEM_BYTES_SM90 or (smem + 1024) * cfg.ctas_per_sm > SMEM_BYTES_PER_SM_SM90:
            raise ValueError(f"tile config needs {smem} B of smem x {cfg.ctas_per_sm} CTAs/SM")
        feats = self.features
        if feats.paged_kv and not (feats.seqused_k or feats.cu_seqlens_k):
            raise ValueError("paged_kv needs key lengths: seqused_k or cu_seqlens_k")
        if feats.seqused_q and not (feats.cu_seqlens_q or feats.split_kv):
            # the dense TMA store clips at the tensor's end, not at a sequence's used rows
            raise ValueError("seqused_q needs packed q (cu_seqlens_q) or split-KV partials")
        if feats.paged_kv and feats.kv_batch_idx:
            raise ValueError("paged_kv maps batch rows to pages itself: no kv_batch_idx")
        # packed GQA: G = qhead_per_kvhead rows a query position; a tile's TMA boxes over
        # (G, seq) take whole positions: tile_rows = G x floor(tile_m / G) of the tile's rows
        # (padding past them where G does not divide tile_m), or whole tiles of one
        # position's heads (tile_m | G)
        self.pack_rows = self.qhead_per_kvhead if feats.pack_gqa else 1
        self.tile_rows = cfg.tile_m
        if feats.pack_gqa:
            g, m = self.qhead_per_kvhead, cfg.tile_m
            self.tile_rows = packed_tile_rows(m, g)
            if g == 1 or self.tile_rows is None:
                raise ValueError(f"pack_gqa: {g} query heads a KV head vs tile_m {m}")
            if cfg.persistent_ctas:
                raise ValueError("pack_gqa: not with a persistent grid")
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.num_stages = cfg.num_stages
        # ping-pong: the consumer warpgroups take turns round-robin (the table decides when)
        self.use_pingpong = cfg.pingpong and cfg.num_mma_warpgroups >= 2
        # a persistent grid (FwdTileConfig.persistent_ctas) walks the tiles of dense inputs in a
        # static stride (under a mask in pairs of complementary work: persistent.PersistentUnits)
        self.persistent = cfg.persistent_ctas > 0
        # L2 sections reorder a one-CTA-per-tile grid of dense inputs, or with
        # l2_sections_packed of packed sequences (q and k / v by cu_seqlens, unsplit, in launch
        # order, k / v not paged); the other inference layouts keep their grid order, a
        # persistent grid has its own
        packed = (
            cfg.l2_sections_packed
            and feats.cu_seqlens_q
            and feats.cu_seqlens_k
            and not (feats.split_kv or feats.batch_order or feats.paged_kv or feats.kv_batch_idx)
        )
        self.l2_sections = (
            cfg.lpt_l2_sections and cfg.lpt_order and self.has_right
            and (feats == InputFeatures() or packed) and not self.persistent
        )  # fmt: skip
        self.masked = self.has_left or self.has_right
        self.units = PersistentUnits(
            self.tile_m, self.tile_n, self.has_left, self.has_right, feats, cfg.mask_bits
        )
        # packed, unpaged k / v and caches whose batch rows lie back to back: V loads through
        # a ragged view (FwdTileConfig.ragged_v_loads) fill the rows past a sequence's keys
        # with zeros; else they are zeroed in smem where they may hold anything
        # (InputFeatures.clean_v_tail)
        self.ragged_v = cfg.ragged_v_loads and (
            (feats.cu_seqlens_k and not feats.paged_kv) or feats.ragged_cache
        )
        self.clean_v_tail = feats.clean_v_tail and not self.ragged_v
        if self.persistent and feats != InputFeatures():
            raise ValueError("persistent_ctas takes dense inputs (no varlen, paged or split-KV)")
        # split_cluster: a split's consumers leave their fragments of O and lse (fp32) in smem
        # from sQ's start over sK and sV (contiguous: 1024-aligned members of 1024-multiple
        # sizes), where the cluster's leader reads them
        self.cluster_merge = feats.split_cluster
        if self.cluster_merge:
            xchg = self.roles.num_mma_threads * (self.head_dim_v // 2 + 2) * 4
            qkv = (self.tile_m * self.head_dim + cfg.num_stages * cfg.tile_n
                   * (self.head_dim + self.head_dim_v)) * 2  # fmt: skip
            if xchg > qkv:
                raise ValueError(f"split_cluster: {xchg} B of fragments exceed sQ..sV ({qkv} B)")
        # rescaling O before the next PV GEMM only hides under S(j+1) with the overlap
        self.rescale_before_pv = cfg.rescale_before_pv and cfg.intra_wg_overlap
        # pin_pv_wait holds the PV wait with the K release unless it has an anchor of its own
        self.pin_by_k_release = cfg.pin_pv_wait and cfg.pin_pv_anchor == 0
        # the anchor's probabilities: part of a thread's first row, or whole rows (a 64-row
        # wgmma atom gives each thread 2 rows of tile_n / 4 columns)
        cols = self.tile_n // 4
        k = cfg.pin_pv_anchor
        if k and not (k < cols or (k % cols == 0 and k // cols <= 2)):
            raise ValueError(f"pin_pv_anchor {k}: < {cols}, {cols} or {2 * cols} (tile_n / 4)")

    # ------------------------------------------------------------------ host-side launch
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s_q, h, d)
        mK: cute.Tensor,  # (b, s_k, h_kv, d)
        mV: cute.Tensor,  # (b, s_k, h_kv, dv)
        mO: cute.Tensor,  # (b, s_q, h, dv); split-KV: (splits * b, s_q, h, dv) fp32
        mLSE: cute.Tensor,  # (b, h, s_q) fp32; split-KV: (splits * b, h, s_q)
        softmax_scale_log2: Float32,  # scale * log2(e), or softcap * log2(e) with softcap
        score_premul: Float32,  # scale / softcap with softcap (tanh argument), else unused
        window_left: Int32,
        window_right: Int32,
        max_seqlen_q: Int32,  # sizes the grid (packed q: the longest sequence)
        num_splits: Int32,  # key-range splits per (query tile, head, batch); 1 without split_kv
        mCuSeqlensQ: cute.Tensor | None,  # (batch + 1,) int32, with features.cu_seqlens_q
        mCuSeqlensK: cute.Tensor | None,  # (batch + 1,) int32, with features.cu_seqlens_k
        mSeqUsedQ: cute.Tensor | None,  # (batch,) int32, with features.seqused_q
        mSeqUsedK: cute.Tensor | None,  # (batch,) int32, with features.seqused_k
        mKvBatchIdx: cute.Tensor | None,  # (batch,) int32, with features.kv_batch_idx
        mPageTable: cute.Tensor | None,  # (batch, max_pages) int32, with features.paged_kv
        mBatchOrder: cute.Tensor | None,  # (batch,) int32, with features.batch_order
        stream: cuda.CUstream,
    ):
        feats = self.features
        if cutlass.const_expr(mQ.element_type != self.dtype):
            raise TypeError(f"q dtype {mQ.element_type} != compiled {self.dtype}")
        o_dtype = Float32 if cutlass.const_expr(feats.partials) else self.dtype
        if cutlass.const_expr(mO.element_type != o_dtype):
            raise TypeError(f"out dtype {mO.element_type} != {o_dtype}")
        # (seq, dim, head, batch): the seq x dim tile is what TMA and wgmma see
        mQ, mO = [select_modes(t, [1, 3, 2, 0]) for t in (mQ, mO)]
        mK, mV = [select_modes(t, [1, 3, 2, 0]) for t in (mK, mV)]
        mLSE = select_modes(mLSE, [2, 1, 0])  # (seq, head, batch)
        if cutlass.const_expr(feats.pack_gqa):
            # rows ((G, seq)) of each KV head's query heads; the grid walks KV heads
            mQ, mO = [pack_gqa_rows(t, self.pack_rows, 2) for t in (mQ, mO)]
            mLSE = pack_gqa_rows(mLSE, self.pack_rows, 1)

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K,
            Float32,
            atom_layout_mnk=(self.config.num_mma_warpgroups, 1, 1),
            tiler_mn=(64, self.tile_n),
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(self.config.num_mma_warpgroups, 1, 1),
            tiler_mn=(64, self.head_dim_v),
            a_source=warpgroup.OperandSource.RMEM,
        )

        sQ_layout = smem_layout(self.dtype, self.tile_m, self.head_dim, None)
        sK_layout = smem_layout(self.dtype, self.tile_n, self.head_dim, self.num_stages)
        sV_layout = smem_layout(self.dtype, self.tile_n, self.head_dim_v, self.num_stages)
        sO_layout = smem_layout(self.dtype, self.tile_m, self.head_dim_v, None)

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        # Q's and O's TMA boxes fill the first tile_rows rows of the tile (all but packed GQA's
        # padding rows, which the load leaves as they are and the store never reads)
        sQ_box, sO_box = (first_rows(x, self.tile_rows) for x in (sQ_layout, sO_layout))
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            tma_load, mQ, sQ_box, (self.tile_rows, self.head_dim)
        )
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            tma_load, mK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, self.head_dim)
        )
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            tma_load,
            ragged_rows(mV) if cutlass.const_expr(self.ragged_v) else mV,
            cute.select(sV_layout, mode=[0, 1]),
            (self.tile_n, self.head_dim_v),
        )
        tma_atom_O, tma_O = None, mO
        if cutlass.const_expr(not feats.direct_store):
            # packed q: a view whose seq extent ends at each sequence's last row, so a tile
            # crossing into the next packed sequence is clipped there
            mO_store = ragged_rows(mO) if cutlass.const_expr(feats.cu_seqlens_q) else mO
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(),
                mO_store,
                sO_box,
                (self.tile_rows, self.head_dim_v),
            )
        # the box's elements (size_in_bytes counts a swizzled layout's cosize: past the
        # padded box's own bytes, and the Q barrier would wait for bytes that never come)
        self.tx_bytes_q = self.tile_rows * self.head_dim * self.dtype.width // 8
        self.tx_bytes_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        self.tx_bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))

        # persistent: O's own buffer (else O is staged in Q's; an empty member takes no smem)
        o_elems = cute.cosize(sO_layout) if cutlass.const_expr(self.persistent) else 0

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_anchor: cutlass.Int64  # pin_pv_anchor: arrived on, never waited on
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, o_elems], 1024]

        self.shared_storage = SharedStorage

        num_m_blocks = cute.ceil_div(max_seqlen_q, self.tile_rows)
        num_batch = mQ.shape[3]
        if cutlass.const_expr(feats.cu_seqlens_q):
            num_batch = mCuSeqlensQ.shape[0] - 1
        grid = (num_m_blocks, cute.size(mQ.shape[2]), num_batch * num_splits)
        if cutlass.const_expr(self.persistent):
            # (no packed GQA rows on a persistent grid: tile_rows == tile_m, as num_units uses)
            num_units = self.units.num_units(
                mQ.shape[0], mK.shape[0], cute.size(mQ.shape[2]), num_batch, window_left
            )
            grid = (cutlass.min(num_units, self.config.persistent_ctas), 1, 1)
        sections = None
        if cutlass.const_expr(self.l2_sections):
            # longest first across the heads of an L2 section (their K and V fit in L2); packed
            # sequences size a pair's K / V by the longest query length (prefill: Sk = Sq)
            keys = max_seqlen_q if cutlass.const_expr(feats.cu_seqlens_k) else mK.shape[0]
            sections = L2Sections.create(
                num_m_blocks, cute.size(mQ.shape[2]) * num_batch, keys,
                (self.head_dim + self.head_dim_v) * 2, L2_BYTES_SM90,
                self.config.l2_section_max_pairs,
            )  # fmt: skip
        self.kernel(
            tiled_mma_qk,
            tiled_mma_pv,
            tma_atom_Q,
            tma_Q,
            tma_atom_K,
            tma_K,
            tma_atom_V,
            tma_V,
            tma_atom_O,
            tma_O,
            mLSE,
            sQ_layout,
            sK_layout,
            sV_layout,
            sO_layout,
            softmax_scale_log2,
            score_premul,
            window_left,
            window_right,
            num_batch,
            num_splits,
            mCuSeqlensQ,
            mCuSeqlensK,
            mSeqUsedQ,
            mSeqUsedK,
            mKvBatchIdx,
            mPageTable,
            mBatchOrder,
            sections,
        ).launch(
            grid=grid,
            block=[self.roles.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=self.config.ctas_per_sm,
            # all of the SM's memory as smem (percent): two CTAs need it; set here, the DSL
            # also skips the device query it would otherwise make at compile time
            preferred_smem_carveout=100 if self.config.ctas_per_sm > 1 else None,
            # split_cluster: the splits of a tile (consecutive grid z) form one cluster
            cluster=[1, 1, num_splits] if self.cluster_merge else None,
        )

    # ------------------------------------------------------------------ device entry
    @cute.kernel
    def kernel(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tma_atom_Q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        mV: cute.Tensor,
        tma_atom_O: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        softmax_scale_log2: Float32,
        score_premul: Float32,
        window_left: Int32,
        window_right: Int32,
        num_batch: Int32,
        num_splits: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mKvBatchIdx: cute.Tensor | None,
        mPageTable: cute.Tensor | None,
        mBatchOrder: cute.Tensor | None,
        sections: L2Sections | None,
    ):
        roles = self.roles
        feats = self.features
        if cutlass.const_expr(feats.partials and self.config.early_dependents):
            # the combine kernel (launched with PDL) may become resident now; it waits for this
            # grid's completion in griddepcontrol.wait, so only its launch latency is hidden
            cute.arch.griddepcontrol_launch_dependents()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == roles.load_warp:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V):
                cpasync.prefetch_descriptor(atom)
            if cutlass.const_expr(not feats.direct_store):
                cpasync.prefetch_descriptor(tma_atom_O)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)

        warps = roles.num_mma_threads // 32  # consumer warps: each releases a stage once
        pipe_q = tma_pipeline(storage.mbar_q, 1, self.tx_bytes_q, warps)
        pipe_k = tma_pipeline(storage.mbar_k, self.num_stages, self.tx_bytes_k, warps)
        pipe_v = tma_pipeline(storage.mbar_v, self.num_stages, self.tx_bytes_v, warps)
        anchor = storage.mbar_anchor.ptr
        if cutlass.const_expr(self.config.pin_pv_anchor > 0):
            if warp_idx == 0:
                cute.arch.mbarrier_init(anchor, 1)
            cute.arch.mbarrier_init_fence()
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if cutlass.const_expr(self.persistent):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
            wg_idx = cute.arch.make_warp_uniform(warp_idx // 4)
            if wg_idx == 0:
                cute.arch.setmaxregister_decrease(roles.producer_regs)
                if warp_idx == roles.load_warp:
                    self.load_persistent(
                        tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV,
                        pipe_q, pipe_k, pipe_v, num_batch, window_left, window_right,
                    )  # fmt: skip
            else:
                cute.arch.setmaxregister_increase(roles.mma_regs)
                self.mma_persistent(
                    tiled_mma_qk, tiled_mma_pv, tma_atom_O, mO, mLSE, sQ, sK, sV, sO,
                    pipe_q, pipe_k, pipe_v, mK.shape[0], num_batch, window_left, window_right,
                    softmax_scale_log2, score_premul, anchor,
                )  # fmt: skip
        else:
            # O is staged through the Q buffer once every consumer is done reading Q
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner, dtype=self.dtype)
            # block coordinates; LPT: for causal/local the last query tiles see the most keys
            m_block, head, batch = cute.arch.block_idx()
            split = Int32(0)
            if cutlass.const_expr(feats.split_kv):
                split = batch % num_splits
                batch = batch // num_splits
            if cutlass.const_expr(feats.batch_order):
                batch = mBatchOrder[batch]
            if cutlass.const_expr(self.l2_sections):
                m_block, head, batch = l2_section_coords(
                    sections, cute.size(mQ.shape[2]), reverse=True
                )
            elif cutlass.const_expr(self.config.lpt_order and self.has_right):
                m_block = cute.arch.grid_dim()[0] - 1 - m_block
            capacity_k = mK.shape[0]  # keys per batch row of k / v; paged: per page
            if cutlass.const_expr(feats.paged_kv):
                capacity_k = mPageTable.shape[1] * mK.shape[0]
            seqlen_q = mQ.shape[0]
            if cutlass.const_expr(feats.pack_gqa):
                seqlen_q = mQ.shape[0][1]  # rows (G, seqlen_q): the positions
            seq = SeqInfo.create(
                feats, batch, seqlen_q, capacity_k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ,
                mSeqUsedK, mKvBatchIdx, mK.shape[3], self.pack_rows,
            )  # fmt: skip
            mask = TileMask(
                self.tile_rows,  # the rows a tile advances (packed GQA's padding left out)
                self.tile_n,
                seq.seqlen_q,
                seq.seqlen_k,
                window_left,
                window_right,
                self.has_left,
                self.has_right,
                self.config.mask_bits,
                self.pack_rows,
            )
            n_min, n_max = mask.n_block_range(m_block)
            if cutlass.const_expr(feats.split_kv):
                # contiguous, equal shares of this tile's key range; an empty share still writes
                # its partial (out 0, lse -inf), which the combine weighs by exp(-inf) = 0
                per_split = cute.ceil_div(cutlass.max(n_max - n_min, 0), num_splits)
                n_min = n_min + split * per_split
                n_max = cutlass.min(n_max, n_min + per_split)
            # where this CTA's out / lse rows go: split partials are stacked along batch
            out_batch = seq.q_batch + split * num_batch
            if cutlass.const_expr(feats.cu_seqlens_q):
                out_batch = split

            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

            # a packed batch's grid is sized by its longest sequence: tiles past this one's end
            # have nothing to do (every role leaves together)
            if m_block * self.tile_rows < seq.num_rows():
                wg_idx = cute.arch.make_warp_uniform(warp_idx // 4)
                if wg_idx == 0:
                    cute.arch.setmaxregister_decrease(roles.producer_regs)
                    if warp_idx == roles.load_warp:
                        self.load(
                            tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV,
                            pipe_q, pipe_k, pipe_v, seq, m_block, head, n_min, n_max, mPageTable,
                            *self._pipeline_states(pipeline.PipelineUserType.Producer),
                        )  # fmt: skip
                    if cutlass.const_expr(self.cluster_merge):
                        # every thread of the cluster takes part in the merge's two barriers
                        for _ in cutlass.range_constexpr(2):
                            cute.arch.cluster_arrive()
                            cute.arch.cluster_wait()
                else:
                    cute.arch.setmaxregister_increase(roles.mma_regs)
                    xchg = None
                    if cutlass.const_expr(self.cluster_merge):
                        xchg = cute.recast_ptr(storage.sQ.data_ptr(), dtype=Float32)
                    self.mma(
                        tiled_mma_qk, tiled_mma_pv, tma_atom_O, mO, mLSE, sQ, sK, sV, sO,
                        pipe_q, pipe_k, pipe_v, mask, seq, m_block, head, out_batch, n_min, n_max,
                        softmax_scale_log2, score_premul, anchor,
                        *self._pipeline_states(pipeline.PipelineUserType.Consumer), xchg,
                    )  # fmt: skip

    # ------------------------------------------------------------------ producer role
    @cute.jit
    def load(
        self,
        tma_atom_Q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        mV: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        pipe_q: pipeline.PipelineAsync,
        pipe_k: pipeline.PipelineAsync,
        pipe_v: pipeline.PipelineAsync,
        seq: SeqInfo,
        m_block: Int32,
        head: Int32,
        n_min: Int32,
        n_max: Int32,
        mPageTable: cute.Tensor | None,
        q_state: pipeline.PipelineState,
        kv_state: pipeline.PipelineState,
    ):
        """Q and the K / V tiles of one query tile. Returns the pipeline states after them (a
        persistent CTA's next tile continues from there)."""
        head_kv = head  # packed GQA: the grid walks KV heads
        if cutlass.const_expr(not self.features.pack_gqa):
            head_kv = head // self.qhead_per_kvhead
        gQ = cute.local_tile(
            seq.rows_q(mQ[None, None, head, seq.q_batch]),
            (self.tile_rows, self.head_dim),
            (m_block, 0),
        )
        paged = self.features.paged_kv
        tQsQ, tQgQ = tma_tiles(tma_atom_Q, first_rows(sQ, self.tile_rows), gQ)
        tKsK, tKgK = tma_tiles(tma_atom_K, sK, self._key_tiles(mK, seq, head_kv, seq.kv_batch))
        gV = self._key_tiles(mV, seq, head_kv, seq.kv_batch, ragged=self.ragged_v)
        tVsV, tVgV = tma_tiles(tma_atom_V, sV, gV)
        if n_max > n_min:
            # Q first. FA4 loads the first K tile before Q: no gain at D=256 / D=128 (one CTA a
            # tile), 2% lost at D=256 4k causal (tune_fwd_cta_s51_h100.json)
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            if cutlass.const_expr(self.persistent):
                q_state.advance()
            # paged: `page` is the page-table entry of the tile being loaded (_load_tile)
            tiles_per_page, page = Int32(1), Int32(0)
            if cutlass.const_expr(paged):
                tiles_per_page = mK.shape[0] // self.tile_n
                page = mPageTable[seq.kv_batch, (n_max - 1) // tiles_per_page]
            # key tiles walk right to left: the boundary tile (the one that needs a mask)
            # comes first, so the consumers' first-iteration special case handles it
            kv = (seq, head_kv, tiles_per_page)
            # in the order the consumers read them (S(j+1) is issued before P(j) V(j)):
            # K(n_max - 1); then K(n), V(n + 1) per tile; then V(n_min). Against K(j), V(j)
            # pairs (K(j+1) waiting behind V(j)'s stage): within 0.5% on every row measured
            # (docs/perf/tune_fwd_vlag_h200.json); this one is the order the consumers read
            self._load_tile(tma_atom_K, mK, sK, tKsK, tKgK, pipe_k, kv_state, n_max - 1, page,
                            kv)  # fmt: skip
            for i in cutlass.range(n_max - n_min - 1, unroll=1):
                n_block = n_max - 2 - i
                page_prev = page
                if cutlass.const_expr(paged):
                    page = mPageTable[seq.kv_batch, n_block // tiles_per_page]
                v_state = kv_state.clone()
                kv_state.advance()
                self._load_tile(tma_atom_K, mK, sK, tKsK, tKgK, pipe_k, kv_state, n_block, page,
                                kv)  # fmt: skip
                self._load_tile(tma_atom_V, mV, sV, tVsV, tVgV, pipe_v, v_state, n_block + 1,
                                page_prev, kv)  # fmt: skip
            self._load_tile(tma_atom_V, mV, sV, tVsV, tVgV, pipe_v, kv_state, n_min, page, kv)
            kv_state.advance()
            if cutlass.const_expr(not self.persistent):
                self._producer_tail(pipe_k, pipe_v, kv_state)
        return q_state, kv_state

    @cute.jit
    def load_persistent(
        self,
        tma_atom_Q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        mV: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        pipe_q: pipeline.PipelineAsync,
        pipe_k: pipeline.PipelineAsync,
        pipe_v: pipeline.PipelineAsync,
        num_batch: Int32,
        window_left: Int32,
        window_right: Int32,
    ):
        """The producer of a persistent CTA: `load` for each of its tiles in turn, the
        pipelines running on from one tile to the next (the next tile's Q and first K / V
        tiles land while the consumers still work on this one)."""
        q_state, kv_state = self._pipeline_states(pipeline.PipelineUserType.Producer)
        seqlen_q, num_heads = mQ.shape[0], mQ.shape[2]

        def tile(m_block, head, seq, mask, n_min, n_max, q_state, kv_state):
            return self.load(
                tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV, pipe_q, pipe_k,
                pipe_v, seq, m_block, head, n_min, n_max, None, q_state, kv_state,
            )  # fmt: skip

        tile_args = (seqlen_q, mK.shape[0], num_heads, num_batch, window_left, window_right)
        q_state, kv_state = self.units.walk(tile_args, q_state, kv_state, tile)
        self._producer_tail(pipe_k, pipe_v, kv_state)

    @cute.jit
    def _producer_tail(
        self,
        pipe_k: pipeline.PipelineAsync,
        pipe_v: pipeline.PipelineAsync,
        kv_state: pipeline.PipelineState,
    ):
        # wait for the last releases before exiting; producer_tail advances the state it is
        # given, so each pipeline gets its own copy
        pipe_k.producer_tail(kv_state.clone())
        pipe_v.producer_tail(kv_state)

    @cute.jit
    def _load_tile(
        self,
        tma_atom: cute.CopyAtom,
        mX: cute.Tensor,
        sX: cute.Tensor,
        tXsX: cute.Tensor,
        tXgX: cute.Tensor,
        pipe: pipeline.PipelineAsync,
        state: pipeline.PipelineState,
        n_block: Int32,
        page: Int32,
        kv: tuple,
    ):
        """TMA-load key tile n_block of k or v into `state`'s stage once it is free. Paged: k / v
        are (page_size, dim, heads, pages) here and the tuning table made tile_n divide
        page_size, so key tile n is tile n % tiles_per_page of `page` (the page-table entry of
        tile n), one TMA box."""
        seq, head_kv, tiles_per_page = kv
        src = None
        if cutlass.const_expr(self.features.paged_kv):
            # fresh names: the smem side is unchanged
            _, tXgX_page = tma_tiles(tma_atom, sX, self._key_tiles(mX, seq, head_kv, page))
            src = tXgX_page[None, n_block % tiles_per_page]
        else:
            src = tXgX[None, n_block]
        pipe.producer_acquire(state)
        cute.copy(
            tma_atom, src, tXsX[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state)
        )

    def _key_tiles(
        self, mX: cute.Tensor, seq: SeqInfo, head_kv: Int32, kv_batch: Int32, ragged: bool = False
    ):
        """(tile_n, dim, n) key tiles of one head of k or v at a batch index (paged: a page).
        `ragged`: mX is the TMA tensor of packed k / v's ragged view (`ragged_rows`), whose
        rows past seqlen_k lie outside it (zero-filled)."""
        if ragged:
            rows = seq.ragged_rows_k(mX, head_kv)
        else:
            rows = seq.rows_k(mX[None, None, head_kv, kv_batch])
        return cute.local_tile(rows, (self.tile_n, mX.shape[1]), (None, 0))

    # ------------------------------------------------------------------ consumer role
    @cute.jit
    def mma(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tma_atom_O: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sO: cute.Tensor,
        pipe_q: pipeline.PipelineAsync,
        pipe_k: pipeline.PipelineAsync,
        pipe_v: pipeline.PipelineAsync,
        mask: TileMask,
        seq: SeqInfo,
        m_block: Int32,
        head: Int32,
        out_batch: Int32,
        n_min: Int32,
        n_max: Int32,
        softmax_scale_log2: Float32,
        score_premul: Float32,
        anchor: cute.Pointer,
        q_state: pipeline.PipelineState,
        kv_state: pipeline.PipelineState,
        xchg: cute.Pointer | None = None,
    ):
        """One query tile: the main loop, then the epilogue. Returns the pipeline states after
        it (a persistent CTA's next tile continues from there). `xchg`: with split_cluster,
        this CTA's fp32 exchange buffer (`_merge_splits`)."""
        tidx = cute.arch.thread_idx()[0] - 128  # index among consumer threads
        # consumer warpgroup 0 .. N-1; marked warp-uniform so the wgmma descriptors derived from
        # it live in uniform registers (else 16 R2UR moves per iteration sit before the HGMMAs)
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_threads = cute.make_layout(self.config.num_mma_warpgroups, stride=128)
        # wgmma fragments are per warpgroup; coordinates (for masks) are per thread
        wg_mma_qk = tiled_mma_qk.get_slice(wg_threads(wg))
        wg_mma_pv = tiled_mma_pv.get_slice(wg_threads(wg))
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        sVt = transpose_smem_view(sV)  # (dv, tile_n, stages): B of O += P V, MN-major
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        acc_shape_s = wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
        acc_o = cute.make_rmem_tensor(
            wg_mma_pv.partition_shape_C((self.tile_m, self.head_dim_v)), Float32
        )
        tOrP = cute.make_rmem_tensor(
            wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)), self.dtype
        )
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        num_rows = cute.size(acc_as_rows_cols(tScS), mode=[0])
        softmax = OnlineSoftmax(
            softmax_scale_log2,
            num_rows,
            self.config.rescale_threshold,
            self.config.exp2_emu_every,
            self.config.row_max_form,
        )
        softmax.reset()
        acc_o.fill(0.0)

        if cutlass.const_expr(self.use_pingpong):
            # warpgroup 0 goes first: pre-arrive on its own scheduler barrier
            if wg == 0:
                cute.arch.barrier_arrive(
                    barrier_id=self.roles.bar_sched_first,
                    number_of_threads=2 * 128,
                )

        if n_max > n_min:
            pipe_q.consumer_wait(q_state)
            # ---- first key tile (rightmost): always masked, no PV yet
            n_block = n_max - 1
            pipe_k.consumer_wait(kv_state)
            self._sched_wait(wg)
            acc_s = cute.make_rmem_tensor(acc_shape_s, Float32)
            gemm(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, kv_state.index], True)
            self._sched_arrive(wg)
            warpgroup.wait_group(0)
            pipe_k.consumer_release(kv_state)
            if cutlass.const_expr(self.has_softcap):
                apply_softcap(acc_s, score_premul)
            mask.apply(acc_s, tScS, m_block, n_block)
            # with rescale_before_pv the scale of tile j is applied in the next iteration, while
            # S(j+1) runs on the tensor cores; the first tile's is 1 (acc_o is still zero)
            row_scale = softmax.step(acc_s, is_first=True)
            pending_scale = None
            if cutlass.const_expr(self.rescale_before_pv):
                pending_scale = cute.make_rmem_tensor(num_rows, Float32)
                pending_scale.store(row_scale.load())
            convert_pairs(acc_as_operand_a(acc_s), tOrP)
            if cutlass.const_expr(self.clean_v_tail):
                if n_max * self.tile_n > mask.seqlen_k:
                    self._zero_v_tail(sV, pipe_v, kv_state, mask.seqlen_k - n_block * self.tile_n)
            v_state = kv_state.clone()
            kv_state.advance()
            # ---- remaining tiles, right to left: (masked, one past the first tile, count)
            # segments, so the unmasked middle runs without mask code or a per-tile branch
            segments = [(True, n_max - 1, n_max - 1 - n_min)]  # (test each tile, top, count)
            if cutlass.const_expr(self.config.split_mask_loops):
                free_lo, free_hi = mask.unmasked_range(m_block, n_min, n_max - 1)
                segments = [(False, free_hi, free_hi - free_lo)]
                # the edge segments keep the test (in practice all of them need the mask; a
                # loop masking without the test made ptxas spill at D=192 / 256 causal)
                if cutlass.const_expr(mask.has_right):
                    segments.insert(0, (True, n_max - 1, n_max - 1 - free_hi))
                if cutlass.const_expr(mask.has_left):
                    segments.append((True, free_lo, free_lo - n_min))
            for seg in cutlass.range_constexpr(len(segments)):
                test_mask, top, count = segments[seg]
                kv_state, v_state = self._mma_tiles(
                    tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, acc_shape_s, acc_o, tOrP,
                    tScS, pending_scale, softmax, pipe_k, pipe_v, kv_state, v_state, mask, wg,
                    m_block, top, count, test_mask, score_premul, anchor,
                )  # fmt: skip
            if cutlass.const_expr(self.persistent):
                # every S GEMM of this tile is done (waited for in the loop): the producer
                # may load the next tile's Q while the last P V and the epilogue run
                pipe_q.consumer_release(q_state)
                q_state.advance()
            # ---- last P V
            if cutlass.const_expr(self.rescale_before_pv):
                softmax.rescale(acc_o, pending_scale)
            pipe_v.consumer_wait(v_state)
            gemm(tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, v_state.index], False)
            # the row sums' reduction, 1 / l and lse moved here, under this GEMM: no gain on the
            # H200 (tune_fwd_epi_s52_h200.json, D=256 4k / 16k, D=128 16k)
            warpgroup.wait_group(0)
            pipe_v.consumer_release(v_state)
        else:
            if cutlass.const_expr(self.use_pingpong):
                # keep the ping-pong barrier phases balanced for a tile with no work
                self._sched_wait(wg)
                self._sched_arrive(wg)
        if cutlass.const_expr(self.use_pingpong):
            # the last warpgroup's last arrive on warpgroup 0's barrier has no partner yet:
            # complete it so no named barrier is left half-arrived
            if wg == 0:
                self._sched_wait(wg)

        if cutlass.const_expr(self.features.partials and not self.config.early_dependents):
            # the PDL-launched combine may become resident once every CTA got here (or exited):
            # its launch overlaps this grid's epilogues, its waiting warps not the main loops
            cute.arch.griddepcontrol_launch_dependents()
        lse = softmax.finalize(acc_o)
        if cutlass.const_expr(self.cluster_merge):
            used = None  # every row (FwdTileConfig.merge_used_rows off)
            if cutlass.const_expr(self.config.merge_used_rows):
                used = self._used_rows(tiled_mma_pv, tidx, m_block, seq.num_rows())
            if self._merge_splits(acc_o, lse, tidx, xchg, used):
                self.epilogue(
                    tiled_mma_pv, tma_atom_O, mO, mLSE, sO, acc_o, lse, tidx, seq, m_block,
                    head, out_batch,
                )  # fmt: skip
            cute.arch.cluster_wait()  # the merge's second barrier (arrived in _merge_splits)
        else:
            self.epilogue(
                tiled_mma_pv, tma_atom_O, mO, mLSE, sO, acc_o, lse, tidx, seq, m_block, head,
                out_batch,
            )  # fmt: skip
        return q_state, kv_state

    @cute.jit
    def mma_persistent(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tma_atom_O: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sO: cute.Tensor,
        pipe_q: pipeline.PipelineAsync,
        pipe_k: pipeline.PipelineAsync,
        pipe_v: pipeline.PipelineAsync,
        seqlen_k: Int32,
        num_batch: Int32,
        window_left: Int32,
        window_right: Int32,
        softmax_scale_log2: Float32,
        score_premul: Float32,
        anchor: cute.Pointer,
    ):
        """The consumers of a persistent CTA: `mma` for each of its tiles in the producer's
        order; O's last TMA store must have read sO before the CTA exits."""
        q_state, kv_state = self._pipeline_states(pipeline.PipelineUserType.Consumer)
        seqlen_q, num_heads = mO.shape[0], mO.shape[2]

        def tile(m_block, head, seq, mask, n_min, n_max, q_state, kv_state):
            return self.mma(
                tiled_mma_qk, tiled_mma_pv, tma_atom_O, mO, mLSE, sQ, sK, sV, sO, pipe_q,
                pipe_k, pipe_v, mask, seq, m_block, head, seq.q_batch, n_min, n_max,
                softmax_scale_log2, score_premul, anchor, q_state, kv_state,
            )  # fmt: skip

        tile_args = (seqlen_q, seqlen_k, num_heads, num_batch, window_left, window_right)
        q_state, kv_state = self.units.walk(tile_args, q_state, kv_state, tile)
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == self.roles.store_warp:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _mma_tiles(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tSrQ: cute.Tensor,
        tSrK: cute.Tensor,
        tOrVt: cute.Tensor,
        acc_shape_s: tuple,
        acc_o: cute.Tensor,
        tOrP: cute.Tensor,
        tScS: cute.Tensor,
        pending_scale: cute.Tensor | None,
        softmax: OnlineSoftmax,
        pipe_k: pipeline.PipelineAsync,
        pipe_v: pipeline.PipelineAsync,
        kv_state: pipeline.PipelineState,
        v_state: pipeline.PipelineState,
        mask: TileMask,
        wg: Int32,
        m_block: Int32,
        top: Int32,
        count: Int32,
        test_mask: cutlass.Constexpr,
        score_premul: Float32,
        anchor: cute.Pointer,
    ):
        """Key tiles top - 1 down to top - count after the first: S(j) = Q K(j)^T, then
        P(j-1) V(j-1), then softmax(j) (under the PV GEMM with the overlap). `test_mask`: mask
        the tiles `tile_needs_mask` picks; False: no mask code (the caller proved every tile
        fully visible). Returns the K and V pipeline states for the next tiles."""
        for i in cutlass.range(count, unroll=1):
            n_block = top - 1 - i
            acc_s = cute.make_rmem_tensor(acc_shape_s, Float32)
            pipe_k.consumer_wait(kv_state)
            self._sched_wait(wg)
            gemm(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, kv_state.index], True)
            if cutlass.const_expr(not self.config.intra_wg_overlap):
                self._sched_arrive(wg)
                warpgroup.wait_group(0)
                pipe_k.consumer_release(kv_state)
            if cutlass.const_expr(self.rescale_before_pv):
                # the FMULs on acc_o overlap S(j) (which does not touch acc_o); the PV
                # GEMM below needs them done, which the wgmma fence before it orders
                softmax.rescale(acc_o, pending_scale)
            pipe_v.consumer_wait(v_state)
            gemm(tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, v_state.index], False)
            if cutlass.const_expr(self.config.intra_wg_overlap):
                self._sched_arrive(wg)
                warpgroup.wait_group(1)  # S(j) done; P(j-1) V(j-1) may still run
                if cutlass.const_expr(not self.pin_by_k_release):
                    pipe_k.consumer_release(kv_state)
            else:
                # no overlap: P(j-1) V(j-1) completes before softmax(j) rescales O
                warpgroup.wait_group(0)
                pipe_v.consumer_release(v_state)
            if cutlass.const_expr(self.has_softcap):
                apply_softcap(acc_s, score_premul)
            if cutlass.const_expr(test_mask):
                if mask.tile_needs_mask(m_block, n_block):
                    mask.apply(acc_s, tScS, m_block, n_block)
            # a tile of the fully visible loop has a finite max in every row
            visible = not test_mask and self.config.unguarded_visible_max
            if cutlass.const_expr(self.config.interleave_rescale):
                # the anchor's probabilities, the P V wait, then the rest of the softmax with
                # O's rescale inside it (FwdTileConfig.interleave_rescale)
                k = self.config.pin_pv_anchor
                row_scale, m_scaled = softmax.step_head(acc_s, k, visible)
                arrive_after(anchor, self._anchor_dep(acc_s, softmax))
                warpgroup.wait_group(0)
                pipe_v.consumer_release(v_state)
                softmax.step_tail(acc_s, acc_o, row_scale, m_scaled, k, visible)
            else:
                row_scale = self._softmax_then_pv_wait(
                    acc_s, acc_o, softmax, pipe_k, pipe_v, kv_state, v_state, anchor, visible
                )
            if cutlass.const_expr(self.rescale_before_pv):
                pending_scale.store(row_scale.load())
            convert_pairs(acc_as_operand_a(acc_s), tOrP)
            v_state = kv_state.clone()
            kv_state.advance()
        return kv_state, v_state

    @cute.jit
    def _softmax_then_pv_wait(
        self,
        acc_s: cute.Tensor,
        acc_o: cute.Tensor,
        softmax: OnlineSoftmax,
        pipe_k: pipeline.PipelineAsync,
        pipe_v: pipeline.PipelineAsync,
        kv_state: pipeline.PipelineState,
        v_state: pipeline.PipelineState,
        anchor: cute.Pointer,
        visible: cutlass.Constexpr[bool],
    ) -> cute.Tensor:
        """softmax(j) in one piece, the P(j-1) V(j-1) wait after it in program order (ptxas
        hoists the wait up to the pin's arrive, or to K(j)'s release without a pin), then O's
        rescale unless rescale_before_pv defers it. Returns the row scale. `visible`: a tile
        of the fully visible loop (OnlineSoftmax.step)."""
        row_scale = softmax.step(acc_s, is_first=False, visible=visible)
        if cutlass.const_expr(self.config.intra_wg_overlap):
            if cutlass.const_expr(self.config.pin_pv_wait):
                # keeps the P V wait below (part of) the softmax: ptxas hoists a wgmma wait
                # no higher than an mbarrier arrive, and these wait for their data
                if cutlass.const_expr(self.config.pin_pv_anchor > 0):
                    arrive_after(anchor, self._anchor_dep(acc_s, softmax))
                else:
                    release_after(pipe_k, kv_state, softmax.sum_of_row_sums())
            warpgroup.wait_group(0)
            pipe_v.consumer_release(v_state)
        if cutlass.const_expr(not self.rescale_before_pv):
            softmax.rescale(acc_o, row_scale)
        return row_scale

    # ------------------------------------------------------------------ split merge
    @cute.jit
    def _used_rows(
        self, tiled_mma_pv: cute.TiledMma, tidx: Int32, m_block: Int32, num_rows: Int32
    ) -> list:
        """Per fragment row of this thread: whether its query row is one the epilogue stores
        (FwdTileConfig.merge_used_rows)."""
        cO = cute.make_identity_tensor((self.tile_m, self.head_dim_v))
        tOcO = acc_as_rows_cols(tiled_mma_pv.get_slice(tidx).partition_C(cO))
        rows = cute.size(tOcO, mode=[0])
        return [self._stored_row(m_block, tOcO[r, 0][0], num_rows) for r in range(rows)]

    def _stored_row(self, m_block: Int32, row_in_tile: Int32, num_rows: Int32):
        """Whether row `row_in_tile` of query tile m_block holds a row of out / lse: below
        the sequence's rows, and not one of packed GQA's padding rows."""
        used = m_block * self.tile_rows + row_in_tile < num_rows
        if cutlass.const_expr(self.tile_rows < self.tile_m):
            used = used & (row_in_tile < self.tile_rows)
        return used

    @cute.jit
    def _merge_splits(
        self,
        acc_o: cute.Tensor,
        lse: cute.Tensor,
        tidx: Int32,
        xchg: cute.Pointer,
        used: list | None,
    ) -> cutlass.Boolean:
        """split_cluster: merge the cluster's split partials into the leader's (rank 0's)
        registers. Every other split leaves its normalized O fragment and its rows' lse in its
        own smem, thread-interleaved (element i of thread t at i * threads + t: conflict-free),
        and after a cluster barrier the leader's thread t reads thread t's elements of every
        peer through distributed shared memory, so no value crosses threads:
            lse = log(sum_s exp(lse_s)),   out = sum_s exp(lse_s - lse) * o_s,
        out 0 / lse -inf for a row no split saw. `used[r]`: whether row r of the fragment is
        merged at all (`_used_rows`; a row the epilogue does not store is left as it is); None:
        every row.
        Arrives on the second cluster barrier (peers may exit once the leader has read them);
        the caller waits on it. Returns whether this CTA is the leader, which writes
        out / lse."""
        roles = self.roles
        o = acc_as_rows_cols(acc_o)
        rows, cols = cute.size(o, mode=[0]), cute.size(o, mode=[1])
        if cutlass.const_expr(used is None):
            used = [True] * rows  # trace-time constants: no branch
        threads = roles.num_mma_threads
        xchg_layout = cute.make_layout((threads, rows * cols + rows), stride=(1, threads))
        rank = cute.arch.block_idx_in_cluster()
        # every consumer warpgroup is done with sQ / sK / sV (another may still be in its loop)
        cute.arch.barrier(barrier_id=roles.bar_epilogue, number_of_threads=threads)
        if rank > 0:
            sX = cute.make_tensor(xchg, xchg_layout)
            for r in cutlass.range_constexpr(rows):
                if used[r]:
                    for c in cutlass.range_constexpr(cols):
                        sX[tidx, r * cols + c] = o[r, c]
                    sX[tidx, rows * cols + r] = lse[r]
        cute.arch.cluster_arrive()  # release: the fragments above
        cute.arch.cluster_wait()  # acquire: every peer's fragments
        if rank == 0:
            splits = cute.arch.cluster_size()
            m = cute.make_rmem_tensor(rows, Float32)
            total = cute.make_rmem_tensor(rows, Float32)
            for r in cutlass.range_constexpr(rows):
                m[r] = lse[r]
            # a peer's address of this thread's first element; element i lies 4 * threads * i
            # bytes past it (an immediate offset of each load): O's (r, c) at i = r * cols + c,
            # row r's lse at i = rows * cols + r
            stride = 4 * threads
            for peer in cutlass.range(1, splits, unroll=1):
                base = dsmem_address(xchg, peer) + tidx * 4
                for r in cutlass.range_constexpr(rows):
                    if used[r]:
                        lse_p = load_dsmem_f32(base, stride * (rows * cols + r))
                        m[r] = cutlass.max(m[r], lse_p)
            for r in cutlass.range_constexpr(rows):
                if used[r]:
                    # a row no split saw: m = -inf; offset by 0 so every weight is 0
                    m[r] = cutlass.select_(m[r] == -Float32.inf, Float32(0.0), m[r])
                    w = cute.math.exp2((lse[r] - m[r]) * LOG2E, fastmath=True)
                    total[r] = w
                    for c in cutlass.range_constexpr(cols):
                        o[r, c] = o[r, c] * w
            for peer in cutlass.range(1, splits, unroll=1):
                base = dsmem_address(xchg, peer) + tidx * 4
                for r in cutlass.range_constexpr(rows):
                    if used[r]:
                        lse_p = load_dsmem_f32(base, stride * (rows * cols + r))
                        w = cute.math.exp2((lse_p - m[r]) * LOG2E, fastmath=True)
                        total[r] = total[r] + w
                        for c in cutlass.range_constexpr(cols):
                            o_p = load_dsmem_f32(base, stride * (r * cols + c))
                            o[r, c] = o[r, c] + w * o_p
            for r in cutlass.range_constexpr(rows):
                if used[r]:
                    empty = total[r] == 0.0
                    inv = cute.arch.rcp_approx(Float32(cutlass.select_(empty, 1.0, total[r])))
                    inv = Float32(cutlass.select_(empty, 0.0, inv))
                    lse_r = m[r] + cute.math.log2(total[r], fastmath=True) * LN2
                    lse[r] = Float32(cutlass.select_(empty, -Float32.inf, lse_r))
                    for c in cutlass.range_constexpr(cols):
                        o[r, c] = o[r, c] * inv
        cute.arch.cluster_arrive()  # release: the leader's reads of the peers' smem
        return rank == 0

    # ------------------------------------------------------------------ epilogue role
    @cute.jit
    def epilogue(
        self,
        tiled_mma_pv: cute.TiledMma,
        tma_atom_O: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        sO: cute.Tensor,
        acc_o: cute.Tensor,
        lse: cute.Tensor,
        tidx: Int32,
        seq: SeqInfo,
        m_block: Int32,
        head: Int32,
        out_batch: Int32,
    ):
        seqlen_q = seq.num_rows()
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        # lse: the thread holding column 0 of a row writes it. Before O's conversion: after O's
        # TMA store it lost 4.7% at D=256 4k causal (tune_fwd_epi_s52_h200.json)
        cO = cute.make_identity_tensor((self.tile_m, self.head_dim_v))
        tOcO = acc_as_rows_cols(thr_mma_pv.partition_C(cO))
        if tOcO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
                if self._stored_row(m_block, tOcO[r, 0][0], seqlen_q):
                    row = m_block * self.tile_rows + tOcO[r, 0][0]
                    mLSE[seq.first_row() + row, head, out_batch] = lse[r]

        if cutlass.const_expr(self.features.direct_store):
            self._store_o_direct(tiled_mma_pv, mO, acc_o, tOcO, tidx, seq, m_block, head, out_batch)
        else:
            mO_head = mO[None, None, head, out_batch]
            if cutlass.const_expr(self.features.cu_seqlens_q):
                mO_head = seq.ragged_rows_q(mO, head)
            self._store_o_tma(tiled_mma_pv, tma_atom_O, mO_head, sO, acc_o, tidx, m_block)

    @cute.jit
    def _store_o_tma(
        self,
        tiled_mma_pv: cute.TiledMma,
        tma_atom_O: cute.CopyAtom,
        mO_head: cute.Tensor,
        sO: cute.Tensor,
        acc_o: cute.Tensor,
        tidx: Int32,
        m_block: Int32,
    ):
        """Registers -> smem (stmatrix, aliasing Q) -> TMA store into `mO_head` (one head's
        (seq, dim) TMA coordinates), which clips rows past its seq extent: seqlen_q for dense
        inputs, the sequence's end for packed ones (`ragged_rows`)."""
        roles = self.roles
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        r_o = cute.make_rmem_tensor_like(acc_o, self.dtype)
        r_o.store(acc_o.load().to(self.dtype))
        if cutlass.const_expr(self.persistent):
            # O's own buffer: the previous tile's store must have read it (that wait is
            # deferred to here so the store overlaps this tile's main loop)
            if warp_idx == roles.store_warp:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        # every consumer warpgroup must be done reading sQ (persistent: the store warp done
        # waiting) before O overwrites it
        cute.arch.barrier(barrier_id=roles.bar_epilogue, number_of_threads=roles.num_mma_threads)
        store_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        thr_store = cute.make_tiled_copy_C(store_atom, tiled_mma_pv).get_slice(tidx)
        cute.copy(store_atom, thr_store.retile(r_o), thr_store.partition_D(sO))
        # generic-proxy smem writes must be visible to the TMA (async proxy) before the store
        cute.arch.fence_view_async_shared()
        # every consumer waits. FA4's form (the store warp waits, the others arrive and leave):
        # no gain, 4% lost at D=256 4k causal (tune_fwd_cta_s51_h100.json)
        cute.arch.barrier(barrier_id=roles.bar_epilogue, number_of_threads=roles.num_mma_threads)
        if warp_idx == roles.store_warp:
            gO = cute.local_tile(mO_head, (self.tile_rows, self.head_dim_v), (m_block, 0))
            tOsO, tOgO = tma_tiles(tma_atom_O, first_rows(sO, self.tile_rows), gO)
            cute.copy(tma_atom_O, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(not self.persistent):
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _store_o_direct(
        self,
        tiled_mma_pv: cute.TiledMma,
        mO: cute.Tensor,
        acc_o: cute.Tensor,
        tOcO: cute.Tensor,
        tidx: Int32,
        seq: SeqInfo,
        m_block: Int32,
        head: Int32,
        out_batch: Int32,
    ):
        """Registers -> global, row-predicated, in mO's dtype (fp32 split partials): nothing
        past this sequence's last row is written, so packed neighbours stay untouched."""
        r_o = cute.make_rmem_tensor_like(acc_o, mO.element_type)
        r_o.store(acc_o.load().to(mO.element_type))
        thr_mma = tiled_mma_pv.get_slice(tidx)
        mO_rows = seq.rows_q(mO[None, None, head, out_batch])
        tOrO = acc_as_rows_cols(r_o)
        tOgO = None
        if cutlass.const_expr(self.tile_rows == self.tile_m):
            gO = cute.local_tile(mO_rows, (self.tile_m, self.head_dim_v), (m_block, 0))
            tOgO = acc_as_rows_cols(thr_mma.partition_C(gO))
        for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
            row_in_tile = tOcO[r, 0][0]
            if self._stored_row(m_block, row_in_tile, seq.num_rows()):
                dst = tOgO
                if cutlass.const_expr(tOgO is None):
                    # packed GQA rows with padding: no tile_m-row tile of mO starts at
                    # m_block x tile_rows, so the row is seen as a tile of tile_m copies of
                    # it (row stride 0) whose partition holds its columns in fragment order
                    row = mO_rows[m_block * self.tile_rows + row_in_tile, None]
                    g_row = cute.make_tensor(
                        row.iterator,
                        cute.make_layout((self.tile_m, self.head_dim_v), stride=(0, 1)),
                    )
                    dst = acc_as_rows_cols(thr_mma.partition_C(g_row))
                cute.autovec_copy(tOrO[r, None], dst[r, None])

    # ------------------------------------------------------------------ helpers
    def _pipeline_states(self, user: pipeline.PipelineUserType):
        """Fresh (Q, K / V) pipeline states of one side."""
        return (
            pipeline.make_pipeline_state(user, 1),
            pipeline.make_pipeline_state(user, self.num_stages),
        )

    @cute.jit
    def _zero_v_tail(
        self,
        sV: cute.Tensor,
        pipe_v: pipeline.PipelineAsync,
        state: pipeline.PipelineState,
        valid_rows: Int32,
    ):
        """Zero rows [valid_rows, tile_n) of V's stage `state` once its TMA landed: they
        lie past seqlen_k and may be stale cache rows (NaN/Inf), which P = 0 alone does not
        neutralize. Every consumer thread writes a share, then all are ordered before the
        wgmma (async proxy) reads the stage."""
        tidx = cute.arch.thread_idx()[0] - 128
        pipe_v.consumer_wait(state)  # waiting again later on the same phase returns at once
        num_threads = self.roles.num_mma_threads
        # threads per row: the most that divide the row evenly with every row covered
        per_row = (
            max(
                p
                for p in range(1, 9)
                if self.head_dim_v % p == 0 and p * self.tile_n <= num_threads
            )
            if num_threads >= self.tile_n
            else 1
        )
        cols = self.head_dim_v // per_row
        sVs = sV[None, None, state.index]
        for row in cutlass.range(tidx // per_row, self.tile_n, num_threads // per_row):
            if row >= valid_rows:
                col0 = (tidx % per_row) * cols
                for c in cutlass.range_constexpr(cols):
                    sVs[row, col0 + c] = self.dtype(0.0)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(
            barrier_id=self.roles.bar_epilogue, number_of_threads=self.roles.num_mma_threads
        )

    def _anchor_dep(self, acc_s: cute.Tensor, softmax: OnlineSoftmax) -> Float32:
        """What the pin_pv_wait anchor waits for: the first `pin_pv_anchor` probabilities of
        this thread's (rows, cols) view in row order: whole rows through their row sums (no
        extra math), else a partial row added as a tree. Plain Python at trace time."""
        k = self.config.pin_pv_anchor
        p = acc_as_rows_cols(acc_s)
        cols = cute.size(p, mode=[1])
        if k % cols == 0:
            return softmax.sum_of_row_sums(k // cols)
        vals = [p[0, c] for c in range(min(k, cols))]
        while len(vals) > 1:
            nxt = [vals[i] + vals[i + 1] for i in range(0, len(vals) - 1, 2)]
            vals = nxt + ([vals[-1]] if len(vals) % 2 else [])
        return vals[0]

    @cute.jit
    def _sched_wait(self, wg: Int32):
        if cutlass.const_expr(self.use_pingpong):
            cute.arch.barrier(barrier_id=self.roles.bar_sched_first + wg, number_of_threads=2 * 128)

    @cute.jit
    def _sched_arrive(self, wg: Int32):
        # hand the turn to the next warpgroup (round-robin over all consumers): one waiter and
        # one arriver per barrier phase, hence 2 x 128 threads whatever the warpgroup count
        if cutlass.const_expr(self.use_pingpong):
            nxt = wg + 1
            if cutlass.const_expr(self.config.num_mma_warpgroups == 2):
                nxt = 1 - wg
            else:
                nxt = Int32(cutlass.select_(nxt == self.config.num_mma_warpgroups, 0, nxt))
            cute.arch.barrier_arrive(
                barrier_id=self.roles.bar_sched_first + nxt, number_of_threads=2 * 128
            )
