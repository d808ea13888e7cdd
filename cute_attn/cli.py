"""Command line: `python -m cute_attn {info,check,bench,compile}` (also the `cute-attn` script).

What:
  info     versions (cute_attn, python, torch, CUDA driver, CuTe DSL, tvm-ffi, FA4), the device
           and its arch, which kernels serve it, the kernel cache; `--json` for machines.
  check    correctness sweep against cute_attn.reference; a PASS/FAIL table, exit 1 on any
           FAIL. Always checks the reference itself (dense vs tiled, analytic backward vs
           autograd, the public API on CPU tensors, gradients through flash_attn_func and
           flash_attn_varlen_func); on an SM90 GPU also flash_attn_func on CUDA bf16/fp16 and
           the backward kernels (dense and packed, a subset of the masks) with the
           FlashAttention error rule. `--quick` for a short subset.
  bench    benchmark over a shape matrix (see cute_attn.bench); exits 0 without a GPU.
  compile  ahead-of-time build of kernel variants for an arch (cute_attn.aot), on any machine.

Constraints: every heavy import (torch, the kernels, matplotlib) happens inside the command
that needs it, so `--help` and `info` work even when parts of the package are missing or
broken. The CPU check finishes in well under a minute on two cores.

How to run:
    python -m cute_attn info --json
    python -m cute_attn check --quick
    python -m cute_attn bench --preset decode
    python -m cute_attn compile --arch sm_90a --head-dims 64 128 --dtypes bf16
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sys
import time

# --------------------------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------------------------


def _guard(fn, default=None):
    """fn() or a short 'unavailable (...)' string: one broken piece must not hide the rest."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - info reports, it never fails
        return default if default is not None else f"unavailable ({type(e).__name__}: {e})"


def collect_info() -> dict:
    """Everything `info` prints, as a JSON-friendly dict."""
    import cute_attn
    from cute_attn.bench import cuda_driver_version, dist_version

    info: dict = {
        "cute_attn": getattr(cute_attn, "__version__", None),
        "cute_attn_file": getattr(cute_attn, "__file__", None),
        "python": f"{platform.python_version()} ({sys.executable})",
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
    except Exception as e:  # noqa: BLE001
        torch = None
        info["torch"] = f"unavailable ({type(e).__name__}: {e})"
        info["torch_cuda"] = None
    info["cuda_driver"] = _guard(cuda_driver_version)
    info["cutlass_dsl"] = dist_version("nvidia-cutlass-dsl")
    info["tvm_ffi"] = dist_version("apache-tvm-ffi")
    info["flash_attn_4"] = dist_version("flash-attn-4", "flash_attn_4")

    def summary():
        from cute_attn.dispatch import support_summary

        return support_summary()

    s = _guard(summary)
    if isinstance(s, dict):
        info["device"] = s.get("device")
        info["arch"] = s.get("arch")
        info["kernels"] = list(s.get("kernels") or [])
        info["dispatch_reason"] = s.get("reason")
    else:  # dispatch missing or broken: still say what torch sees
        has_cuda = torch is not None and _guard(torch.cuda.is_available, False)
        info["device"] = _guard(lambda: torch.cuda.get_device_name()) if has_cuda else None
        info["arch"] = None
        info["kernels"] = []
        info["dispatch_reason"] = s

    def cache():
        from cute_attn import cache as c

        d = c.cache_dir()
        return (str(d) if d is not None else None), len(c.disk_entries())

    c = _guard(cache)
    if isinstance(c, tuple):
        info["cache_dir"], info["cache_entries"] = c
    else:
        info["cache_dir"], info["cache_entries"] = c, None

    def shared_objects():
        from cute_attn import cache as c

        if not c._shared_lib_enabled():
            return "off (CUTE_ATTN_SHARED_LIB)"
        cc = c._c_compiler()
        if cc is None:
            return "no C compiler: disk hits load object files through the DSL"
        return f"linked with {cc}: disk hits load them without the DSL"

    info["shared_objects"] = _guard(shared_objects)
    return info


def cmd_info(args) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    labels = [
        ("cute_attn", f"{info['cute_attn']}  ({info['cute_attn_file']})"),
        ("python", info["python"]),
        ("torch", f"{info['torch']}  (CUDA {info['torch_cuda'] or 'none'})"),
        ("CUDA driver", info["cuda_driver"] or "none"),
        ("nvidia-cutlass-dsl", info["cutlass_dsl"] or "not installed"),
        ("apache-tvm-ffi", info["tvm_ffi"] or "not installed"),
        ("flash-attn-4", info["flash_attn_4"] or "not installed"),
        ("device", info["device"] or "none"),
        ("arch", info["arch"] or "-"),
        ("kernels", ", ".join(info["kernels"]) or "none (reference path only)"),
        ("dispatch", info["dispatch_reason"] or "-"),
        ("cache dir", info["cache_dir"] or "none (disk cache off)"),
        ("cache entries", "-" if info["cache_entries"] is None else str(info["cache_entries"])),
        ("shared objects", str(info["shared_objects"])),
    ]
    width = max(len(k) for k, _ in labels)
    for k, v in labels:
        print(f"{k.ljust(width)}  {v}")
    return 0


# --------------------------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------------------------

_MASKS = {
    # name: (causal, window_size, softcap)
    "full": (False, (None, None), 0.0),
    "causal": (True, (None, None), 0.0),
    "window(17,5)": (False, (17, 5), 0.0),
    "causal+window(33)": (True, (33, None), 0.0),
    "diag window(0,0)": (False, (0, 0), 0.0),
    "softcap5": (False, (None, None), 5.0),
    "causal softcap5": (True, (None, None), 5.0),
}
# (B, Sq, Sk, H, Hkv, D, Dv): odd sizes, GQA/MQA, Sq > Sk (rows with no visible key under a
# causal mask), Dv != D, single-token decode.
_REF_SHAPES = [
    (2, 113, 203, 6, 2, 64, 64),
    (1, 239, 1, 6, 1, 32, 32),
    (2, 203, 113, 4, 4, 40, 24),
    (1, 1, 515, 4, 2, 64, 64),
    (1, 1, 1, 4, 4, 16, 16),
]
_REF_MASKS_QUICK = ("full", "causal", "window(17,5)", "causal softcap5")
_TILES = ((17, 29), (64, 32))


class _Table:
    """Prints check rows as they finish (a long GPU sweep shows progress) and counts them."""

    cols = (("case", 60), ("impl", 10), ("max err", 9), ("tol", 9), ("lse err", 9), ("tol", 8))

    def __init__(self):
        self.passed = self.failed = self.skipped = 0
        self.impls: dict[str, int] = {}
        print("  ".join(name.ljust(w) for name, w in self.cols) + "  result")
        print("-" * (sum(w + 2 for _, w in self.cols) + 6))

    def add(self, case, impl, err, tol, lse_err=None, lse_tol=None, ok=None, note=""):
        """ok: True / False, "skip" (not served by design), or None to compare err with tol."""
        if ok is None:
            ok = err <= tol and (lse_err is None or lse_err <= lse_tol)
        skip = ok == "skip"
        self.skipped += skip
        self.passed += ok is True
        self.failed += ok is False
        self.impls[impl] = self.impls.get(impl, 0) + 1

        def num(x):
            return "-" if x is None else f"{x:.2e}"

        cells = (case, impl, num(err), num(tol), num(lse_err), num(lse_tol))
        line = "  ".join(str(c).ljust(w) for c, (_, w) in zip(cells, self.cols))
        word = "SKIP" if skip else "PASS" if ok else "FAIL"
        print(f"{line}  {word}{'  ' + note if note else ''}", flush=True)


def _max_abs_diff(a, b) -> float:
    """max |a - b| over float tensors, with -inf == -inf (and +inf == +inf) counted as 0."""
    import torch

    a, b = a.double(), b.double()
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    same_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    d = torch.where(same_inf, torch.zeros_like(a), (a - b).abs())
    d = torch.nan_to_num(d, nan=math.inf, posinf=math.inf)
    return float(d.max())


def _finite_absmax(t) -> float:
    import torch

    t = t.double()
    t = t[torch.isfinite(t)]
    return float(t.abs().max()) if t.numel() else 0.0


def _rounding_tol(dtype, seqlen_k: int, *refs) -> float:
    """Error bound for two exact-arithmetic-equivalent evaluations in `dtype`.

    Both sum over up to Sk terms in a different order; random-walk rounding growth is
    ~eps * sqrt(Sk) relative to the magnitude of the values, and the factor 10 covers the
    handful of extra operations (rescaling, exp) per term.
    """
    import torch

    eps = torch.finfo(dtype).eps
    scale = max([1.0] + [_finite_absmax(r) for r in refs])
    return 10.0 * eps * math.sqrt(max(seqlen_k, 1)) * scale


def _randn(shape, dtype, device, gen):
    import torch

    return torch.randn(*shape, generator=gen, dtype=torch.float32, device=device).to(dtype)


def _ref_inputs(shape, dtype, gen, device="cpu"):
    b, sq, sk, h, hkv, d, dv = shape
    return (
        _randn((b, sq, h, d), dtype, device, gen),
        _randn((b, sk, hkv, d), dtype, device, gen),
        _randn((b, sk, hkv, dv), dtype, device, gen),
    )


def _shape_name(shape) -> str:
    b, sq, sk, h, hkv, d, dv = shape
    heads = f"h{h}" if h == hkv else f"h{h}/{hkv}"
    dims = f"d{d}" if d == dv else f"d{d}/{dv}"
    return f"b{b} {sq}x{sk} {heads} {dims}"


def _check_reference(table: _Table, quick: bool, flt: str | None) -> None:
    """Self-consistency of the CPU reference: the oracle every other check trusts."""
    import torch

    from cute_attn import reference

    gen = torch.Generator().manual_seed(0)
    shapes = _REF_SHAPES[:3] if quick else _REF_SHAPES
    masks = _REF_MASKS_QUICK if quick else tuple(_MASKS)
    for shape in shapes:
        for mname in masks:
            causal, window, softcap = _MASKS[mname]
            sem = dict(causal=causal, window_size=window, softcap=softcap)
            base = f"{_shape_name(shape)} {mname}"
            sk = shape[2]
            for dtype in (torch.float64, torch.float32):
                tag = "fp64" if dtype == torch.float64 else "fp32"
                case = f"ref tiled {tag} {base}"
                if flt and flt not in case:
                    continue
                q, k, v = _ref_inputs(shape, dtype, gen)
                out, lse = reference.attention_ref(q, k, v, compute_dtype=dtype, **sem)
                bm, bn = _TILES[0] if dtype == torch.float64 else _TILES[1]
                out_t, lse_t = reference.attention_ref_tiled(
                    q, k, v, compute_dtype=dtype, block_m=bm, block_n=bn, **sem
                )
                table.add(
                    case, "reference",
                    _max_abs_diff(out_t, out), _rounding_tol(dtype, sk, out),
                    _max_abs_diff(lse_t, lse), _rounding_tol(dtype, sk, lse),
                )  # fmt: skip
            case = f"ref bwd fp64 {base}"
            if flt and flt not in case:
                continue
            q, k, v = (t.requires_grad_() for t in _ref_inputs(shape, torch.float64, gen))
            out, lse = reference.attention_ref(q, k, v, compute_dtype=torch.float64, **sem)
            dout = _randn(out.shape, torch.float64, "cpu", gen)
            auto = torch.autograd.grad(out, (q, k, v), dout)
            ana = reference.attention_ref_backward(
                q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dout,
                compute_dtype=torch.float64, **sem,
            )  # fmt: skip
            err = max(_max_abs_diff(a, b) for a, b in zip(ana, auto))
            table.add(case, "reference", err, _rounding_tol(torch.float64, sk, *auto))


def _fa_rule(out, ref_out, base_out, lse, ref_lse):
    """FlashAttention's rule: err <= 2 * (same-dtype torch error) + 1e-5; lse abs 1e-3."""
    err = _max_abs_diff(out.float(), ref_out)
    tol = 2.0 * _max_abs_diff(base_out.float(), ref_out) + 1e-5
    return err, tol, _max_abs_diff(lse.float(), ref_lse), 1e-3


def _guarded(table, case, require_kernel, fn):
    """fn() of one check row, or None once a row for its exception is added: dispatch's
    NotImplementedError is a SKIP (FAIL with --require-kernel), anything else a FAIL."""
    try:
        return fn()
    except NotImplementedError as e:
        # No kernel serves this case on this device (dispatch said so): not a wrong answer.
        ok = False if require_kernel else "skip"
        table.add(case, "none", None, None, ok=ok, note=str(e)[:300])
    except Exception as e:  # noqa: BLE001 - a raising case is a FAIL row, the sweep goes on
        table.add(case, "error", None, None, ok=False, note=f"{type(e).__name__}: {e}"[:300])
    return None


def _run_api_case(table, case, shape, sem, dtype, device, gen, require_kernel):
    """flash_attn_func vs the fp32 reference under the FlashAttention rule, one table row."""
    import torch

    import cute_attn
    from cute_attn import reference

    q, k, v = _ref_inputs(shape, dtype, gen, device)

    def run():
        res = cute_attn.flash_attn_func(q, k, v, **sem)
        return res, getattr(cute_attn.last_dispatch(), "impl", "?")

    res = _guarded(table, case, require_kernel, run)
    if res is None:
        return
    (out, lse), impl = res
    ref_out, ref_lse = reference.attention_ref(q, k, v, compute_dtype=torch.float32, **sem)
    base_out, _ = reference.attention_ref(q, k, v, compute_dtype=None, **sem)
    err, tol, lse_err, lse_tol = _fa_rule(out, ref_out, base_out, lse, ref_lse)
    notes = []
    if out.dtype != dtype:
        notes.append(f"out dtype {out.dtype} != {dtype}")
    if lse.dtype != torch.float32:
        notes.append(f"lse dtype {lse.dtype} != float32")
    if require_kernel and impl == "reference":
        notes.append("fell back to the reference (--require-kernel)")
    ok = not notes and err <= tol and lse_err <= lse_tol
    table.add(case, impl, err, tol, lse_err, lse_tol, ok=ok, note="; ".join(notes))


def _varlen_lens(b: int, s: int) -> list[int]:
    """Sequence lengths for a packed backward row of batch b: the first sequence of length s,
    the others shorter and odd-sized (tiles then cross into the next sequence)."""
    return [s] + [s // (i + 1) + 1 for i in range(1, b)]


def _loss_grads(fn, inputs, dout, dlse_w):
    """Gradients of sum(out * dout) + sum(lse * dlse_w) (finite lse only) w.r.t. inputs."""
    import torch

    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out, lse = fn(*leaves)
    loss = (out.float() * dout.float()).sum()
    loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse_w).sum()
    return torch.autograd.grad(loss, leaves)


def _run_bwd_case(table, case, shape, sem, dtype, device, gen, require_kernel, varlen=False):
    """Gradients (dq, dk, dv, the lse gradient included) of flash_attn_func, or of
    flash_attn_varlen_func over packed sequences, vs autograd through the fp32 reference,
    under the FlashAttention rule per gradient; one table row showing the gradient nearest
    its bound."""
    import torch

    import cute_attn
    from cute_attn import reference

    b, sq, sk, h, hkv, d, dv = shape
    if varlen:
        lens_q, lens_k = _varlen_lens(b, sq), _varlen_lens(b, sk)
        q = _randn((sum(lens_q), h, d), dtype, device, gen)
        k = _randn((sum(lens_k), hkv, d), dtype, device, gen)
        v = _randn((sum(lens_k), hkv, dv), dtype, device, gen)
        cu = {
            name: torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32,
                               device=device)
            for name, lens in (("cu_seqlens_q", lens_q), ("cu_seqlens_k", lens_k))
        }  # fmt: skip
        lengths = dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))

        def api(a, b_, c):
            return cute_attn.flash_attn_varlen_func(a, b_, c, **cu, **lengths, **sem)

        def ref(a, b_, c, **kw):
            return reference.attention_ref_varlen(a, b_, c, **cu, **sem, **kw)

        out_shape, lse_shape = (q.shape[0], h, dv), (h, q.shape[0])
    else:
        q, k, v = _ref_inputs(shape, dtype, gen, device)

        def api(a, b_, c):
            return cute_attn.flash_attn_func(a, b_, c, **sem)

        def ref(a, b_, c, **kw):
            return reference.attention_ref(a, b_, c, **sem, **kw)

        out_shape, lse_shape = (b, sq, h, dv), (b, h, sq)
    dout = _randn(out_shape, dtype, device, gen)
    dlse_w = _randn(lse_shape, torch.float32, device, gen)

    def run():
        before = cute_attn.last_backward_dispatch()
        got = _loss_grads(api, (q, k, v), dout, dlse_w)
        # a kernel forward records its backward's decision; the reference forward's gradients
        # are plain autograd, which records none
        after = cute_attn.last_backward_dispatch()
        return got, after.impl if after is not None and after is not before else "reference"

    res = _guarded(table, case, require_kernel, run)
    if res is None:
        return
    got, impl = res
    f32 = [t.float() for t in (q, k, v)]
    ref_g = _loss_grads(lambda a, b_, c: ref(a, b_, c, compute_dtype=torch.float32), f32, dout,
                        dlse_w)  # fmt: skip
    base_g = _loss_grads(lambda a, b_, c: ref(a, b_, c, compute_dtype=None), (q, k, v), dout,
                         dlse_w)  # fmt: skip
    rows, notes = [], []
    for name, g, r, s in zip(("dq", "dk", "dv"), got, ref_g, base_g):
        if g.dtype != dtype or g.shape != r.shape:
            notes.append(f"{name} {g.dtype} {tuple(g.shape)}")
        err = _max_abs_diff(g.float(), r)
        atol = _max_abs_diff(r.to(dtype).float(), r) + 1e-5
        tol = 2.0 * _max_abs_diff(s.float(), r) + atol
        rows.append((err / tol, name, err, tol))
    worst, name, err, tol = max(rows)
    if require_kernel and impl == "reference":
        notes.append("fell back to the reference (--require-kernel)")
    ok = not notes and all(r[0] <= 1.0 for r in rows)
    table.add(case, impl, err, tol, ok=ok, note="; ".join([f"worst {name}", *notes]))


_TAGS = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def _check_api_cpu(table: _Table, quick: bool, flt: str | None) -> None:
    """The public API on CPU tensors runs the reference path; it must match attention_ref."""
    import torch

    gen = torch.Generator().manual_seed(1)
    shapes = _REF_SHAPES[:3] if quick else _REF_SHAPES
    masks = _REF_MASKS_QUICK if quick else tuple(_MASKS)
    for shape in shapes:
        for mname in masks:
            causal, window, softcap = _MASKS[mname]
            sem = dict(causal=causal, window_size=window, softcap=softcap)
            dtypes = (torch.bfloat16, torch.float16, torch.float32)
            for dtype in dtypes[:1] if quick else dtypes:
                tag = _TAGS[str(dtype)]
                case = f"api cpu {tag} {_shape_name(shape)} {mname}"
                if not flt or flt in case:
                    _run_api_case(table, case, shape, sem, dtype, "cpu", gen, False)
            # gradients through the public entries (the reference's autograd on the CPU)
            for varlen in (False, True):
                case = f"bwd cpu bf16 {_shape_name(shape)} {mname}" + " varlen" * varlen
                if not flt or flt in case:
                    _run_bwd_case(table, case, shape, sem, torch.bfloat16, "cpu", gen, False,
                                  varlen)  # fmt: skip


# GPU sweep: head dims (D, Dv), masks, GQA ratios rotated across combos, odd lengths.
_GPU_DIMS = ((64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128))
_GPU_MASKS = {
    "full": (False, (None, None), 0.0),
    "causal": (True, (None, None), 0.0),
    "window(64,32)": (False, (64, 32), 0.0),
    "causal+window(96)": (True, (96, None), 0.0),
    "softcap5": (False, (None, None), 5.0),
}
_GPU_BWD_MASKS = ("causal", "window(64,32)", "softcap5")
_GPU_HEADS = ((6, 6), (6, 2), (6, 1))
_GPU_LENS = ((2, 113, 203), (1, 1, 1), (1, 239, 1), (1, 1, 4096), (2, 128, 128), (1, 1000, 1000))


def _check_gpu(table: _Table, quick: bool, flt: str | None, require_kernel: bool) -> None:
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(0)
    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16)
    dims = ((64, 64), (128, 128), (192, 128)) if quick else _GPU_DIMS
    masks = ("full", "causal", "window(64,32)") if quick else tuple(_GPU_MASKS)
    lens = ((2, 113, 203), (1, 239, 1), (1, 1, 4096)) if quick else _GPU_LENS
    combo = 0
    for dtype in dtypes:
        tag = _TAGS[str(dtype)]
        for d, dv in dims:
            for mname in masks:
                causal, window, softcap = _GPU_MASKS[mname]
                sem = dict(causal=causal, window_size=window, softcap=softcap)
                h, hkv = _GPU_HEADS[combo % len(_GPU_HEADS)]
                combo += 1
                for b, sq, sk in lens:
                    shape = (b, sq, sk, h, hkv, d, dv)
                    case = f"cuda {tag} {_shape_name(shape)} {mname}"
                    if not flt or flt in case:
                        _run_api_case(table, case, shape, sem, dtype, device, gen, require_kernel)
                # the backward (dense and packed), on fewer masks: each row compiles a
                # forward and a backward variant (a few seconds each)
                if mname not in _GPU_BWD_MASKS or (quick and mname != "causal"):
                    continue
                for varlen in (False, True):
                    shape = (2, 113, 203, h, hkv, d, dv)
                    case = f"cuda bwd {tag} {_shape_name(shape)} {mname}" + " varlen" * varlen
                    if not flt or flt in case:
                        _run_bwd_case(table, case, shape, sem, dtype, device, gen,
                                      require_kernel, varlen)  # fmt: skip


def _has_supported_gpu() -> bool:
    import torch

    if not torch.cuda.is_available():
        return False
    from cute_attn.dispatch import support_summary

    return bool(support_summary().get("kernels"))


def cmd_check(args) -> int:
    t0 = time.perf_counter()
    table = _Table()
    _check_reference(table, args.quick, args.filter)
    _check_api_cpu(table, args.quick, args.filter)
    gpu = _has_supported_gpu()
    if gpu:
        _check_gpu(table, args.quick, args.filter, args.require_kernel)
    total = table.passed + table.failed + table.skipped
    print(
        f"\n{total} cases: {table.passed} PASS, {table.failed} FAIL, {table.skipped} SKIP "
        f"({time.perf_counter() - t0:.1f} s); impls: "
        + ", ".join(f"{k} x{n}" for k, n in sorted(table.impls.items()))
    )
    print(
        "tolerances: reference rows 10*eps*sqrt(Sk)*max|ref|; api rows the FlashAttention rule "
        "max|out - ref_fp32| <= 2*max|torch_same_dtype - ref_fp32| + atol (atol = 1e-5), "
        "lse abs 1e-3 (-inf == -inf); bwd rows the same rule for each of dq, dk, dv (loss "
        "sum(out * dout) + sum(lse * w); atol = rounding the fp32 gradient to the dtype + "
        "1e-5), the gradient nearest its bound shown"
    )
    if not gpu:
        print("no supported GPU found: checked the reference path only")
    if total == 0:
        print("no case matched --filter")
        return 1
    return 1 if table.failed else 0


def cmd_bench(args) -> int:
    from cute_attn.bench import run_bench

    return run_bench(args)


# --------------------------------------------------------------------------------------------
# compile
# --------------------------------------------------------------------------------------------


def _default_jobs() -> int:
    """Build processes for `compile`: one per usable core, but no more than one per 2 GB of
    memory (a process held 0.57 GB after 57 builds on the CPU machine, its memory cache
    growing with each build) and at most 32."""
    if hasattr(os, "sched_getaffinity"):  # the cores this process may run on (Linux)
        cpus = len(os.sched_getaffinity(0))
    else:
        cpus = os.cpu_count() or 1
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): cores alone
        mem_gb = 2.0 * cpus
    return max(1, min(cpus, int(mem_gb // 2), 32))


def cmd_compile(args) -> int:
    from cute_attn import aot

    heads = [tuple(int(x) for x in h.split(":")) for h in args.heads] if args.heads else None
    if args.jobs < 0:
        raise SystemExit(f"--jobs: expected N >= 0, got {args.jobs}")
    jobs = args.jobs or _default_jobs()
    variants = aot.compile_variants(
        args.arch, args.head_dims, args.dtypes, progress=True, heads=heads, jobs=jobs
    )
    if not variants:
        print(f"nothing to build for {args.arch} yet")
        return 0
    name_w = max(len(str(v.get("name"))) for v in variants)
    print(f"{'variant'.ljust(name_w)}  {'seconds':>8}  {'regs':>5}  {'spills':>6}  instructions")
    failed = 0
    for v in variants:
        ok = bool(v.get("ok"))
        failed += not ok
        insns = v.get("instructions") or {}
        present = " ".join(k for k, has in insns.items() if has) or "-"
        missing = [k for k, has in insns.items() if not has]
        if missing:
            present += "  (missing: " + " ".join(missing) + ")"

        def num(x, fmt):
            return "-" if x is None else format(x, fmt)

        line = (
            f"{str(v.get('name')).ljust(name_w)}  {num(v.get('seconds'), '8.1f')}  "
            f"{num(v.get('registers'), '>5')}  {num(v.get('spills'), '>6')}  {present}"
        )
        print(line if ok else f"{line}  FAILED: {v.get('error')}")
    print(f"{len(variants) - failed}/{len(variants)} variants built for {args.arch}")
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------
# parser
# --------------------------------------------------------------------------------------------


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    from cute_attn.bench import ALL_IMPLS, PRESETS  # no torch: cheap

    p.add_argument("--preset", choices=PRESETS, default="fwd-prefill",
                   help="shape matrix: fwd-prefill (16k tokens, hidden 2048), bwd, decode, "
                        "spec-decode (2-8 causal query rows over a cache), varlen (16 "
                        "packed sequences), or full (adds Sq!=Sk, GQA/MQA, windows, D=192, "
                        "bwd rows)")  # fmt: skip
    p.add_argument(
        "--impls",
        nargs="+",
        choices=ALL_IMPLS,
        metavar="IMPL",
        help=f"implementations to run (default: all of {', '.join(ALL_IMPLS)})",
    )
    p.add_argument("--reps", type=int, default=30, help="timed repetitions (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls after the first")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument(
        "--filter",
        nargs="+",
        metavar="TEXT",
        help="keep rows whose name contains every TEXT (e.g. --filter causal d128)",
    )
    p.add_argument("--out", default="bench.json", help="JSON output (PNG written next to it)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--no-check", action="store_true", help="skip the fp32 reference error")
    p.add_argument(
        "--ref-budget-gb",
        type=float,
        default=4.0,
        help="score-memory budget of the fp32 reference (GiB, default 4)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true",
                   help="run cute_attn with deterministic=True (baselines unchanged)")  # fmt: skip
    p.add_argument(
        "--graph",
        action="store_true",
        help="time CUDA-graph replays: GPU time only, no host cost (forward rows)",
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="time one impl's reps after another's (default: all impls of a row in rounds, "
        "one call each per round, so they share the GPU's clock and power state)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cute_attn",
        description="cute_attn: exact FlashAttention kernels in the CuTe DSL (SM90 / SM100).",
    )
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{info,check,bench,compile}")

    p = sub.add_parser("info", help="versions, device, kernels and cache")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("check", help="correctness sweep against the reference")
    p.add_argument("--quick", action="store_true", help="a short subset of the cases")
    p.add_argument("--filter", help="only cases whose name contains this text")
    p.add_argument("--require-kernel", action="store_true",
                   help="GPU cases that no kernel serves (SKIP) or that the reference "
                        "fallback served count as FAIL")  # fmt: skip
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("bench", help="benchmark against SDPA backends and FlashAttention-4")
    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("compile", help="ahead-of-time build of kernel variants for an arch")
    p.add_argument("--arch", required=True, choices=("sm_90a", "sm_100a"))
    p.add_argument("--head-dims", nargs="+", type=int, metavar="D")
    p.add_argument("--dtypes", nargs="+", choices=("bf16", "fp16"))
    p.add_argument(
        "--heads",
        nargs="+",
        metavar="H:HKV",
        help="query:KV head counts to build (head counts are in the compile key; default 8:2)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=0,
        metavar="N",
        help="build in N processes (default 0: one per core, at most one per 2 GB of memory "
        "and 32; 1: in this process)",
    )
    p.set_defaults(func=cmd_compile)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
