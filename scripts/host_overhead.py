"""Host cost per call and GPU-only time of the decode paths (H200 helper, not a test).

For each case: eager time per call from CUDA events around back-to-back calls (what `bench`
reports: when the host is slower than the kernels this is host time), host time per call
(perf_counter over calls issued without syncing), and the GPU time of the same call replayed
from a CUDA graph (no host work). Cases: a tiny dense call, the decode rows through
`flash_attn_func` and through `flash_attn_with_kvcache` (dense cache; B=1 also with
CUTE_ATTN_CHECK_VALUES=0, B=64 also paged). The tiny call and the B=1 KV-cache call also get a
per-piece breakdown of their host time (each piece timed alone in a loop), the tiny call's
with torch SDPA and FA4 (when installed) on the same tensors as yardsticks. --varlen-only:
a decode batch through `flash_attn_varlen_func` (B sequences of one query row over packed
keys) with and without the entry's memo (api._varlen_memo), with the memo's hits without
its bound launcher (fwd_sm90.varlen_launcher), each with and without value checks.

    python3 scripts/host_overhead.py [--out host.json] [--profile] [--tiny-only | --varlen-only]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import cute_attn
from cute_attn import api, fwd_sm90
from cute_attn.bench import capture_graph

_varlen_signature = api._varlen_signature
_launcher = fwd_sm90.varlen_launcher


def _events(fn, reps=50):
    for _ in range(5):
        fn()
    s = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    e = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        s[i].record()
        fn()
        e[i].record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) for a, b in zip(s, e))
    return t[len(t) // 2] * 1e3


def _host(fn, reps=200):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / reps * 1e6


def _graph(fn, reps=50):
    graph, _ = capture_graph(fn, warmup=3)
    return _events(graph.replay, reps)


def _breakdown(q, k, v) -> dict:
    """Host us per call of each piece of the tiny dense call (`flash_attn_func(q, k, v,
    causal=True)`), each timed alone in a loop of its own (launches are queued, not synced)."""
    from cute_attn import dispatch, fwd_sm90
    from cute_attn.validation import validate_dense

    kw = dict(softmax_scale=None, causal=True, window_size=(None, None), softcap=0.0,
              num_splits=0, pack_gqa=None, deterministic=False)  # fmt: skip
    p = validate_dense(q, k, v, **kw)
    tensors = (("q", q), ("k", k), ("v", v))
    b, sq, h, _ = q.shape
    out = torch.empty((b, sq, h, p.head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    plan = fwd_sm90._plan(p, fwd_sm90._DENSE, b, sq, p.seqlen_k, False, q.device.index)

    def launch():
        plan.fn(q, k, v, out, lse, *plan.scalars, *[None] * 7)

    def alloc():
        torch.empty((b, sq, h, p.head_dim_v), dtype=q.dtype, device=q.device)
        torch.empty((b, h, sq), dtype=torch.float32, device=q.device)

    out_shape, lse_shape, f32 = (b, sq, h, p.head_dim_v), (b, h, sq), torch.float32
    lse_proto = torch.empty((1, 1, 1), dtype=f32, device=q.device).expand(lse_shape)
    cf = torch.contiguous_format

    def alloc_new_empty():
        q.new_empty(out_shape)
        q.new_empty(lse_shape, dtype=f32)

    def alloc_like():  # no shape or dtype to parse: q itself and a one-element prototype
        torch.empty_like(q, memory_format=cf)
        torch.empty_like(lse_proto, memory_format=cf)

    from cute_attn import api

    knobs = (None, True, (None, None), 0.0, 0, None, False, None)
    memo = api._dense_memo
    launcher = fwd_sm90.dense_launcher(q, p)

    pieces = {
        "whole call": lambda: cute_attn.flash_attn_func(q, k, v, causal=True),
        "memo key + lookup": lambda: memo.get(api._dense_signature(q, k, v, knobs)),
        "bound launcher (2 allocations + FFI call)": lambda: launcher(q, k, v),
        "validate_dense": lambda: validate_dense(q, k, v, **kw),
        "dispatch.select": lambda: dispatch.select(p, tensors),
        "run_fwd": lambda: fwd_sm90.run_fwd(q, k, v, p),
        "two torch.empty": alloc,
        "two q.new_empty": alloc_new_empty,
        "two torch.empty_like (q, expanded prototype)": alloc_like,
        "plan lookup": lambda: fwd_sm90._plan(p, fwd_sm90._DENSE, b, sq, p.seqlen_k, False, 0),
        "kernel launch (TVM-FFI call)": launch,
    }
    # the same call through the two yardsticks, timed alike in this process (host
    # speed differs between machines: compare within one run)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # its (B, H, S, D)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    pieces["torch SDPA (is_causal, default backend)"] = lambda: sdpa(qt, kt, vt, is_causal=True)
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except ImportError:
        fa4 = None
    if fa4 is not None:
        fa4(q, k, v, causal=True)
        pieces["FA4 flash_attn_func"] = lambda: fa4(q, k, v, causal=True)
    # 500 queued launches stay inside the launch queue (a full queue would time the GPU)
    out = {name: _host(fn, reps=500) for name, fn in pieces.items()}
    # SDPA with each backend forced (the context is entered once, around the whole loop), the
    # GPU time of one call beside it: a host figure is only host time if the GPU keeps up
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        for causal in (True, False):
            name = f"torch SDPA {backend.lower()}{' is_causal' if causal else ''}"
            try:
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    call = lambda c=causal: sdpa(qt, kt, vt, is_causal=c)  # noqa: E731
                    call()
                    torch.cuda.synchronize()
                    out[name] = _host(call, reps=500)
                    out[name + " (GPU us, events)"] = _events(call)
            except RuntimeError as e:  # backend unavailable for this shape / build
                out[name] = f"unavailable: {str(e).splitlines()[0][:80]}"
    return out


def _kv_breakdown(q, kc, vc, n) -> dict:
    """Host us per call of each piece of a read-only KV-cache call on a memo hit
    (`flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n)`), each timed alone in a loop."""
    from cute_attn import api, fwd_sm90, validation

    call = lambda: cute_attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n)  # noqa: E731
    call()
    knobs = (None, True, (None, None), 0.0, 0, None, True)
    key = api._kvcache_signature(q, kc, vc, n, None, None, knobs)
    p, _, values, launch = api._kvcache_memo[key]

    def check():
        c = values.check(n, None, None)
        c.defer(fwd_sm90.index_flags)
        c.wait()

    pieces = {
        "whole call (memo hit)": call,
        "memo key + lookup": lambda: api._kvcache_memo.get(
            api._kvcache_signature(q, kc, vc, n, None, None, knobs)
        ),
        "value check: flags launch, pinned copy, wait": check,
        "index_flags launch alone": lambda: fwd_sm90.index_flags(
            *values.check(n, None, None).index_args
        ),  # fmt: skip
        "bound launcher (allocs + launches)": lambda: launch(q, kc, vc, n),
        "full path (validation + dispatch)": lambda: (api._kvcache_memo.clear(), call()),
        "validate_kvcache_static": lambda: validation.validate_kvcache_static(
            q,
            kc,
            vc,
            None,
            None,
            cache_seqlens=n,
            cache_batch_idx=None,
            page_table=None,
            rotary_cos=None,
            rotary_sin=None,
            softmax_scale=None,
            causal=True,
            window_size=(None, None),
            softcap=0.0,
            num_splits=0,
        ),
    }
    return {name: _host(fn, reps=500) for name, fn in pieces.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="cProfile the host path of each case")
    ap.add_argument("--tiny-only", action="store_true", help="only the tiny dense call")
    ap.add_argument("--varlen-only", action="store_true", help="only the varlen decode cases")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    rows = []
    cases = [("dense tiny b1 s128 h8 d64", 1, 128, 128, 8, 8, 64, "dense")]
    if args.varlen_only:
        cases = [(f"varlen {kind[7:]} b{b} sk{sk} h32/8 d128", b, 1, sk, 32, 8, 128, kind)
                 for b, sk in ((1, 4096), (8, 8192))
                 for kind in ("varlen memo", "varlen nolauncher", "varlen nomemo",
                              "varlen memo nochecks", "varlen nolauncher nochecks",
                              "varlen nomemo nochecks")]  # fmt: skip
        args.tiny_only = True
    for b, sk in () if args.tiny_only else ((1, 32768), (8, 8192), (64, 8192), (128, 2048)):
        cases.append((f"decode b{b} sk{sk} h32/8 d128", b, 1, sk, 32, 8, 128, "dense"))
        cases.append((f"kvcache b{b} sk{sk} h32/8 d128", b, 1, sk, 32, 8, 128, "kvcache"))
    # the host-only cost: without value checks the host never waits, so it runs ahead
    if not args.tiny_only:
        cases.append(("kvcache nochecks b1 sk32768 h32/8 d128", 1, 1, 32768, 32, 8, 128,
                      "nochecks"))  # fmt: skip
        cases.append(("kvcache paged64 b64 sk8192 h32/8 d128", 64, 1, 8192, 32, 8, 128, "paged"))
    for name, b, sq, sk, h, hkv, d, kind in cases:
        q = torch.randn(b, sq, h, d, device=dev, dtype=dt)
        k = torch.randn(b, sk, hkv, d, device=dev, dtype=dt)
        v = torch.randn(b, sk, hkv, d, device=dev, dtype=dt)
        if kind == "dense":

            def fn(q=q, k=k, v=v):
                return cute_attn.flash_attn_func(q, k, v, causal=True)
        elif kind == "paged":
            n = torch.full((b,), sk, dtype=torch.int32, device=dev)
            ps = 64
            perm = torch.randperm(b * sk // ps, device=dev)
            table = perm.view(b, sk // ps).to(torch.int32)
            kp, vp = (x.view(b * sk // ps, ps, hkv, d)[perm.argsort()] for x in (k, v))

            def fn(q=q, kp=kp, vp=vp, n=n, table=table):
                return cute_attn.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=n,
                                                         page_table=table)  # fmt: skip
        elif kind.startswith("varlen"):
            cu_q = torch.arange(0, b + 1, dtype=torch.int32, device=dev)
            cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=dev)
            qp, kp, vp = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)

            def fn(qp=qp, kp=kp, vp=vp, cu_q=cu_q, cu_k=cu_k, sk=sk):
                return cute_attn.flash_attn_varlen_func(
                    qp, kp, vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1,
                    max_seqlen_k=sk, causal=True,
                )  # fmt: skip
        else:
            n = torch.full((b,), sk, dtype=torch.int32, device=dev)

            def fn(q=q, k=k, v=v, n=n):
                return cute_attn.flash_attn_with_kvcache(q, k, v, cache_seqlens=n)

        # read per call: set for this case's whole measurement
        os.environ["CUTE_ATTN_CHECK_VALUES"] = "0" if kind.endswith("nochecks") else "1"
        # the memo off: every call takes the full path (validation and dispatch)
        api._varlen_memo.clear()
        api._varlen_signature = (lambda *a: None) if "nomemo" in kind else _varlen_signature
        # memo hits without the bound launcher: the forward's own path (run_fwd_varlen)
        fwd_sm90.varlen_launcher = (lambda *a: None) if "nolauncher" in kind else _launcher

        fn()
        parts = None
        if "tiny" in name:
            parts = _breakdown(q, k, v)
            print("host us per call of each piece (tiny dense call):")
        elif name == "kvcache b1 sk32768 h32/8 d128":
            parts = _kv_breakdown(q, k, v, n)
            print("host us per call of each piece (KV-cache b1 call):")
        for piece, us in (parts or {}).items():
            print(f"  {piece:<44} {us:6.1f}" if isinstance(us, float) else f"  {piece:<44} {us}")
        row = {"case": name, "eager_us": _events(fn), "host_us": _host(fn), "graph_us": _graph(fn),
               "dispatch": cute_attn.last_dispatch().impl}  # fmt: skip
        if parts:
            row["host_breakdown_us"] = parts
        row["graph_tbps"] = 2 * b * sk * hkv * d * 2 / (row["graph_us"] * 1e-6) / 1e12
        rows.append(row)
        if args.profile and (" b1 " in name or "tiny" in name):  # (memo hits after fn())
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.runcall(lambda: [fn() for _ in range(200)])
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        print(f"{name:<34} eager {row['eager_us']:8.1f} us  host {row['host_us']:7.1f} us  "
              f"graph {row['graph_us']:8.1f} us ({row['graph_tbps']:.2f} TB/s)",
              flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
