"""Where a forward variant's build time goes: tracing, the DSL's pass pipeline, and its passes
(CPU only, not a test).

Builds each named variant for sm_90a without a GPU (export-only, as the disk cache does),
after one warm-up build so that one-time imports stay out of the numbers, and prints the
seconds spent tracing (`generate_original_ir`) and in the DSL's MLIR pipeline
(`Compiler.compile`). With --passes the pipeline's own timing report (MLIR's
`PassManager.enable_timing`) goes to stderr; `CudaToBinaryPass` there is LLVM's NVPTX code
generation plus ptxas.

    python3 scripts/compile_passes.py 128:causal 128 256:causal [--passes]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from cutlass.base_dsl import compiler, dsl  # noqa: E402

from cute_attn.arch.sm90.compile import FwdSpec, compile_fwd  # noqa: E402
from cute_attn.arch.sm90.tile_config import fwd_tile_config  # noqa: E402

SECONDS: dict[str, float] = {}


def _timed(owner, name: str, label: str):
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SECONDS[label] = SECONDS.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)


def _with_pass_timing():
    """Every PassManager the DSL parses reports its passes' wall time when it is destroyed."""
    inner = compiler.Compiler.compile

    def compile_timed(self, module, pipeline, *args, **kwargs):
        pm_class = self.passmanager.PassManager
        parse = pm_class.parse

        def parse_timed(text, *a, **kw):
            pm = parse(text, *a, **kw)
            pm.enable_timing()
            return pm

        pm_class.parse = staticmethod(parse_timed)
        try:
            return inner(self, module, pipeline, *args, **kwargs)
        finally:
            pm_class.parse = parse

    compiler.Compiler.compile = compile_timed


def build(name: str) -> float:
    dim, _, mask = name.partition(":")
    d, causal = int(dim), mask == "causal"
    cfg = fwd_tile_config(d, d, causal, False)
    spec = FwdSpec("bfloat16", d, d, 16, 16, False, causal, False, cfg)
    start = time.perf_counter()
    compile_fwd(spec, jit_engine=False)
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+", help="HEAD_DIM or HEAD_DIM:causal")
    ap.add_argument("--passes", action="store_true", help="MLIR pass timing to stderr")
    args = ap.parse_args()
    build("64")  # warm-up: imports and the DSL's first-build setup
    _timed(dsl.BaseDSL, "generate_original_ir", "trace")
    _timed(compiler.Compiler, "compile", "pipeline")
    if args.passes:
        _with_pass_timing()
    for name in args.variants:
        SECONDS.clear()
        total = build(name)
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in SECONDS.items())
        print(f"{name}: {total:.2f} s ({parts})", flush=True)


if __name__ == "__main__":
    main()
