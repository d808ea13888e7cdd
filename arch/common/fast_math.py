"""exp2 on the FMA pipe: a software 2**x for a fraction of the softmax's exponentials.

The SFU (MUFU.EX2) issues 16 exponentials per clock per SM; at small head dims the
exponentials of a score tile take as long as its two GEMMs. Computing some of them with FMA-pipe
instructions instead (which issue 128 per clock per SM) balances the two pipes.

Method: clamp x to >= -127, split x = j + f with j = floor(x) obtained by one add in
round-toward-minus-infinity mode against 1.5 * 2**23 (j lands in the low mantissa bits), a
cubic p(f) ~ 2**f on [0, 1) with p(0) = 1, and 2**j applied by adding j << 23 to p's bits.
The cubic's coefficients are our own fit (iteratively reweighted least squares on relative
error); its max relative error on [-126, 8] is 8.6e-5, below bf16/fp16 rounding of P
(2**-9 / 2**-11), and P and the row sum l are both computed from the same values, so the
normalization stays consistent. x <= -127 gives 0 (like ex2.approx.ftz). The numpy model of
this exact instruction sequence is tests/test_fast_math.py.
"""

from __future__ import annotations

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# p(f) = 1 + C1 f + C2 f^2 + C3 f^3 (float32 values; hex below is what the PTX uses)
EXP2_POLY = (0.6951165795326233, 0.22764593362808228, 0.07706617563962936)
_C1, _C2, _C3 = "0f3F31F329", "0f3E691C04", "0f3D9DD4DF"
_ROUND = "0f4B400000"  # 1.5 * 2**23
_LOWEST = "0fC2FE0000"  # -127.0

_PTX = f"""{{
.reg .f32 xc, xr, xb, f, p;
.reg .b32 ib, pb;
max.f32 xc, $1, {_LOWEST};
add.rm.f32 xr, xc, {_ROUND};
sub.f32 xb, xr, {_ROUND};
sub.f32 f, xc, xb;
fma.rn.f32 p, f, {_C3}, {_C2};
fma.rn.f32 p, p, f, {_C1};
fma.rn.f32 p, p, f, 0f3F800000;
mov.b32 ib, xr;
shl.b32 ib, ib, 23;
mov.b32 pb, p;
add.s32 pb, pb, ib;
mov.b32 $0, pb;
}}"""


@dsl_user_op
def exp2_fma(x: Float32, *, loc=None, ip=None) -> Float32:
    """2**x computed on the FMA/ALU pipes (no MUFU). See the module docstring for accuracy."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            _PTX,
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )
