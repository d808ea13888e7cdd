"""fp32 -> fp16/bf16 register conversion, two values per instruction.

On the RS A-operand view of a wgmma accumulator, `tensor.load().to(dtype)` emitted one
`cvt.rn.bf16x2.f32` per pair at tile_n = 128 but one scalar `cvt.rn.bf16.f32` per element at
tile_n = 80 (40 per S tile at D=256, read from the PTX; other widths not checked).
`convert_pairs` always packs: logical elements 2i and 2i+1 of the source become the two halves
of 32-bit register i of the destination.

Constraint: the destination is a compact register tensor whose logical order is its physical
order (what `cute.make_rmem_tensor` makes), with an even number of elements; the caller's
source view must pair the elements the destination expects next to each other (for a wgmma
accumulator and the RS A-operand view, logical pairs are adjacent columns of one row).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def cvt_pack_16bit(lo: Float32, hi: Float32, to_bf16: bool, *, loc=None, ip=None) -> Int32:
    """(lo, hi) fp32 -> one 32-bit register holding two round-to-nearest 16-bit values, lo in
    the low half (the order a 16-bit register tensor uses). No side effects, so the compiler
    may schedule it freely (the DSL's own cvt_f32x2_bf16x2 is marked side-effecting)."""
    kind = "bf16x2" if to_bf16 else "f16x2"
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{kind}.f32 $0, $1, $2;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def convert_pairs(src: cute.Tensor, dst: cute.Tensor):
    """dst[i] = src[i] converted to dst's 16-bit dtype, two elements per instruction."""
    to_bf16 = cutlass.const_expr(dst.element_type == cutlass.BFloat16)
    dst_words = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(dst_words)):
        dst_words[i] = cvt_pack_16bit(src[2 * i], src[2 * i + 1], to_bf16)


__all__ = ["cvt_pack_16bit", "convert_pairs"]
