"""SM90 building blocks shared by the forward and backward kernels.

* `smem_layout`: a swizzled K-major (row-major) smem layout for a (rows, cols[, stages]) tile,
  the layout TMA writes and wgmma reads;
* `tma_tiles`: (smem, gmem) TMA partitions of a tile pair (no multicast);
* `first_rows`: the first rows of a (rows, cols) smem tile, for a TMA box that covers fewer
  rows than the MMA reads (packed GQA's padded tiles);
* `gemm`: issue one warpgroup GEMM over all k-blocks and commit it as one wgmma group;
* `tma_pipeline`: an mbarrier pipeline filled by one TMA-issuing thread and released once per
  consumer warp;
* `release_after` / `arrive_after`: an mbarrier arrive (a stage's release, or an arrive on a
  barrier nobody waits on) issued only once a value is computed, which keeps ptxas from
  hoisting a later wgmma wait above that value's math;
* `dsmem_address` / `load_dsmem_f32`: a cluster peer's shared memory, read by plain loads
  (`ld.shared::cluster`; the DSL's tensors over DSMEM pointers take no element loads).

Torch-free; used inside @cute.jit / @cute.kernel code only.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum


def smem_layout(
    dtype: type[cutlass.Numeric],
    rows: int,
    cols: int,
    stages: int | None,
    atom_cols: int | None = None,
):
    """K-major (row-major) swizzled smem layout for a (rows, cols[, stages]) tile: the widest
    swizzle that divides `cols`, or `atom_cols` where a wgmma reads the tile transposed
    (MN-major) in column slices of that width, which must each start on a swizzle atom."""
    atom_kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, atom_cols or cols)
    atom = warpgroup.make_smem_layout_atom(atom_kind, dtype)
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    order = (0, 1) if stages is None else (0, 1, 2)
    return cute.tile_to_shape(atom, shape, order=order)


def first_rows(t, rows: int):
    """The first `rows` rows of a (tile rows, cols) smem layout or tensor (itself when that is
    all of it); the swizzle stays that of the whole tile, where TMA and wgmma agree."""
    tile_rows = cute.size(t.shape[0])
    if rows == tile_rows:
        return t
    return cute.composition(
        t, cute.make_layout((rows, cute.size(t.shape[1])), stride=(1, tile_rows))
    )


def tma_tiles(atom: cute.CopyAtom, s: cute.Tensor, g: cute.Tensor, rank: int = 2):
    """(smem, gmem) TMA views of a tile pair whose first `rank` modes are the tile ((rows,
    cols) by default; 1 for a row vector) and the rest a stage or tile index. No multicast."""
    return cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(s, 0, rank), cute.group_modes(g, 0, rank)
    )


@cute.jit
def gemm(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    zero_init: cutlass.Constexpr[bool],
    k_blocks: cutlass.Constexpr[int] = 0,
):
    """Issue one warpgroup GEMM over all k-blocks (or the first `k_blocks`) and commit it (no
    wait)."""
    warpgroup.fence()
    # a fresh atom per call: toggling ACCUMULATE on a shared one breaks SSA dominance
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(k_blocks or cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


def tma_pipeline(mbar, stages: int, tx_bytes: int, consumer_warps: int):
    """PipelineTmaAsync over the mbarriers in `mbar` (a MemRange of 2 * stages Int64). The
    barriers are initialized here (warp 0); the caller runs pipeline_init_arrive / _wait
    (defer_sync) once all of its pipelines exist."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=mbar.data_ptr(),
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        # TmaAsync consumers release once per warp
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=tx_bytes,
        defer_sync=True,
    )


@cute.jit
def release_after(
    pipe: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, dep: cutlass.Float32
):
    """consumer_release(state), issued only once `dep` is computed.

    ptxas moves a wgmma wait no higher than the mbarrier arrive before it, and it hoists such
    an arrive (with the wait behind it) above independent math. Predicating the arrive on
    `dep != -1` ties it to `dep` by data: pass a value computed last in the code the wait
    should stay behind. The predicate is always true for what this is used with (row sums
    are >= 0 or NaN, and NaN != -1).
    """
    if dep != cutlass.Float32(-1.0):
        pipe.consumer_release(state)


@cute.jit
def arrive_after(mbar_ptr: cute.Pointer, dep: cutlass.Float32):
    """One arrive per warp on `mbar_ptr`, issued only once `dep` is computed: the anchor of
    `release_after` without releasing anything (the barrier is nobody's wait; its phases just
    turn over). `dep` must never be -1 (sums of probabilities are not)."""
    if dep != cutlass.Float32(-1.0):
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive(mbar_ptr)


@dsl_user_op
def dsmem_address(ptr: cute.Pointer, rank: Int32, *, loc=None, ip=None) -> Int32:
    """The 32-bit shared::cluster address of this CTA's smem pointer `ptr` in the shared
    memory of cluster CTA `rank` (mapa)."""
    local = llvm.ptrtoint(T.i32(), ptr.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [local, Int32(rank).ir_value(loc=loc, ip=ip)],
            "mapa.shared::cluster.u32 $0, $1, $2;",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def load_dsmem_f32(address: Int32, offset: int, *, loc=None, ip=None) -> Float32:
    """The fp32 at shared::cluster `address` + `offset` bytes (a trace-time constant, folded
    into the instruction). Marked with side effects so that it is not moved above the cluster
    barrier that makes the peer's writes visible."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Int32(address).ir_value(loc=loc, ip=ip)],
            f"ld.shared::cluster.f32 $0, [$1+{int(offset)}];",
            "=f,r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


__all__ = [
    "smem_layout",
    "tma_tiles",
    "gemm",
    "tma_pipeline",
    "release_after",
    "arrive_after",
    "dsmem_address",
    "load_dsmem_f32",
]
