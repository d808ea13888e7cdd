"""A per-CTA event record for kernel diagnostics (a debug switch, never in a tuning table).

A kernel built with its config's `timeline` switch writes, for each CTA, TIMELINE_WORDS int32
words into a caller's buffer at the CTA's linear launch index (x fastest, then y, z): the SM
it ran on, what it worked on, and the SM clock (%clock, cycles) and the low word of the
global nanosecond timer (%globaltimer_lo) at named events. SM clocks are per SM (compare
events of CTAs on one SM, or of one CTA); the global timer orders CTAs across SMs, at the
resolution the driver gives it. One thread of the role that owns an event writes its word
(plain global stores: nothing waits for them, nothing reads them in the kernel).

Words (the `W_*` names): 0 the SM id, 1-3 the work (key tile, head, tiles walked), 4 / 5 the
global timer at the CTA's start / at its epilogue's end, 6.. the clock at: the CTA's start,
the load warp's first query load (after any wait for the preprocess), the consumers' K / V
arrival, the end of the consumers' walk, the end of the dK / dV store, the dQ writer's
end. scripts/bwd_timeline.py reads it.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

TIMELINE_WORDS = 16
(
    W_SMID,
    W_N_BLOCK,
    W_HEAD,
    W_WALK,
    W_GT_START,
    W_GT_END,
    W_CLK_START,
    W_CLK_READY,
    W_CLK_KV,
    W_CLK_LOOP_END,
    W_CLK_EPI_END,
    W_CLK_WRITER_END,
) = range(12)


def _sreg(name: str):
    @dsl_user_op
    def read(*, loc=None, ip=None) -> Int32:
        # inline asm with side effects: the read stays where the event is, never merged with
        # or hoisted past another read
        return Int32(
            llvm.inline_asm(
                T.i32(),
                [],
                f"mov.u32 $0, %{name};",
                "=r",
                has_side_effects=True,
                is_align_stack=False,
                asm_dialect=llvm.AsmDialect.AD_ATT,
            )  # fmt: skip
        )

    return read


clock = _sreg("clock")
globaltimer_lo = _sreg("globaltimer_lo")
smid = _sreg("smid")


def stamp(buf: cute.Tensor, word: int, value: Int32):
    """Store `value` as word `word` of this CTA's record in `buf` (an fp32 vector reused as
    int32 words; the caller picks the one thread that writes)."""
    bx, by, bz = cute.arch.block_idx()
    gx, gy, _ = cute.arch.grid_dim()
    cta = bx + gx * (by + gy * bz)
    ptr = cute.recast_ptr(buf.iterator + (cta * TIMELINE_WORDS + word), dtype=Int32)
    cute.make_tensor(ptr, cute.make_layout(1))[0] = value
