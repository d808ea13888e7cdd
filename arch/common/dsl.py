"""Small CuTe-DSL plumbing shared by the kernels."""

from __future__ import annotations

import copy

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


class DslStruct:
    """A plain object that the DSL can carry through dynamic control flow.

    Attributes named in `_dynamic_` are DSL values (Int32, Float32, rmem tensors) and are
    threaded through scf.if / scf.for regions; every other attribute is a compile-time
    constant. Without this, an object used inside a dynamic `if` or loop is rejected as a
    Python value that cannot be staged.
    """

    _dynamic_: tuple[str, ...] = ()

    def __extract_mlir_values__(self):
        values, counts = [], []
        for name in self._dynamic_:
            v = cutlass.extract_mlir_values(getattr(self, name))
            values += v
            counts.append(len(v))
        self._value_counts = counts
        return values

    def __new_from_mlir_values__(self, values):
        new = copy.copy(self)
        pos = 0
        for name, n in zip(self._dynamic_, self._value_counts):
            setattr(
                new, name, cutlass.new_from_mlir_values(getattr(self, name), values[pos : pos + n])
            )
            pos += n
        return new


@dsl_user_op
def nanosleep(ns: int, *, loc=None, ip=None) -> None:
    """Suspend the thread for about `ns` nanoseconds (a polling loop's back-off)."""
    llvm.inline_asm(
        None, [], f"nanosleep.u32 {int(ns)};", "", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )  # fmt: skip


@cute.jit
def wait_at_least(ptr: cute.Pointer, target: Int32, backoff_ns: cutlass.Constexpr[int]):
    """Poll the int32 at `ptr` with gpu-scope acquire loads until it is >= target, backing
    off between polls (the counter's writers share L2 with the polling). The caller
    publishes the acquire to its CTA or warp with a barrier."""
    seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
    while seen < target:
        nanosleep(backoff_ns)
        seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")


@dsl_user_op
def block_idx_x_again(*, loc=None, ip=None) -> Int32:
    """The CTA's x index, read again from %ctaid.x: marked with side effects, so the compiler
    neither merges it with an earlier read nor keeps an earlier result live across a loop
    for it (a value recomputed after a main loop costs no register through it)."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [],
            "mov.u32 $0, %ctaid.x;",
            "=r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )
