"""Tests of the command line (`python -m cute_attn ...`) and the benchmark's pure helpers.

CPU only and fast: the commands run in subprocesses exactly as a user types them (one torch
import each, a few seconds in all); FLOP counting, percentiles and table / ratio logic are
checked in-process against brute force or independent formulas.

Run: python -m pytest tests/test_cli.py -q
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from cute_attn import bench, cli

ROOT = Path(__file__).resolve().parent.parent
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cute_attn", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------------


def test_help_lists_every_command():
    res = _run("--help")
    assert res.returncode == 0, res.stderr
    for cmd in ("info", "check", "bench", "compile"):
        assert cmd in res.stdout


def test_no_command_is_an_error():
    res = _run()
    assert res.returncode == 2
    assert "required" in res.stderr


def test_info_text(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for label in ("cute_attn", "torch", "nvidia-cutlass-dsl", "apache-tvm-ffi", "device",
                  "kernels", "cache dir", "cache entries", "shared objects"):  # fmt: skip
        assert any(line.startswith(label + " ") for line in out.splitlines()), label
    assert torch.__version__ in out


def test_info_json_parses():
    res = _run("info", "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["torch"] == torch.__version__
    assert Path(info["cute_attn_file"]).name == "__init__.py"
    assert isinstance(info["kernels"], list)
    if not torch.cuda.is_available():
        assert info["device"] is None and info["kernels"] == []


@NO_CUDA
def test_check_quick_passes_on_cpu():
    res = _run("check", "--quick")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if "PASS" in line.split()]
    assert len(rows) >= 20
    # each kind of check ran: dense vs tiled, analytic backward, the public API on CPU
    for kind in ("ref tiled fp64", "ref tiled fp32", "ref bwd fp64", "api cpu", "bwd cpu"):
        assert any(r.startswith(kind) for r in rows), kind
    assert any(r.startswith("bwd cpu") and " varlen " in r for r in rows)
    assert "FAIL" not in res.stdout.replace("0 FAIL", "")
    assert "no supported GPU found: checked the reference path only" in res.stdout


@pytest.mark.parametrize("varlen", [False, True])
def test_check_bwd_row_fails_wrong_gradients(monkeypatch, capsys, varlen):
    # the backward rows compare against autograd through the fp32 reference: an entry whose
    # output is 5% off (so are its gradients) is a FAIL row, the exact one a PASS
    import cute_attn

    name = "flash_attn_varlen_func" if varlen else "flash_attn_func"
    real = getattr(cute_attn, name)
    shape, sem = (2, 37, 53, 4, 2, 32, 32), dict(causal=True)
    for scale, word in ((1.0, "PASS"), (1.05, "FAIL")):
        monkeypatch.setattr(cute_attn, name, lambda *a, s=scale, **kw: tuple(
            t * s if i == 0 else t for i, t in enumerate(real(*a, **kw))))  # fmt: skip
        table = cli._Table()
        gen = torch.Generator().manual_seed(0)
        cli._run_bwd_case(table, "case", shape, sem, torch.bfloat16, "cpu", gen, False, varlen)
        row = capsys.readouterr().out.splitlines()[-1]
        assert row.split()[0] == "case" and word in row.split(), row


@NO_CUDA
def test_bench_without_gpu_says_so(tmp_path):
    out = tmp_path / "b.json"
    res = _run("bench", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "no CUDA GPU found: nothing to benchmark" in res.stdout
    assert not out.exists()


def test_bench_filter_matching_nothing_fails(tmp_path):
    # the words must all be in one row's name: d128 and d96 never are, so nothing would run
    out = tmp_path / "b.json"
    res = _run("bench", "--preset", "bwd", "--filter", "d128", "d96", "--out", str(out))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "no bwd row matched --filter d128 d96" in res.stdout
    assert not out.exists()


def test_bench_rejects_unknown_impl():
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["bench", "--impls", "nope"])
    assert e.value.code == 2


def _fake_aot(monkeypatch, variants):
    import cute_attn

    calls = []

    def compile_variants(arch, head_dims, dtypes, progress, heads=None, jobs=1):
        calls.append((arch, head_dims, dtypes, progress, heads, jobs))
        return variants

    mod = types.ModuleType("cute_attn.aot")
    mod.compile_variants = compile_variants
    monkeypatch.setitem(sys.modules, "cute_attn.aot", mod)
    monkeypatch.setattr(cute_attn, "aot", mod, raising=False)
    return calls


def test_compile_empty_list(monkeypatch, capsys):
    calls = _fake_aot(monkeypatch, [])
    assert cli.main(["compile", "--arch", "sm_100a"]) == 0
    assert "nothing to build for sm_100a yet" in capsys.readouterr().out
    assert calls == [("sm_100a", None, None, True, None, cli._default_jobs())]


def test_compile_reports_variants_and_fails_on_error(monkeypatch, capsys):
    ok = dict(name="fwd_d128_bf16", arch="sm_90a", seconds=3.25, registers=168, spills=0,
              instructions={"HGMMA": True, "UTMALDG": True, "USETMAXREG": False}, ok=True,
              error=None)  # fmt: skip
    calls = _fake_aot(monkeypatch, [ok])
    assert cli.main(["compile", "--arch", "sm_90a", "--head-dims", "64", "128",
                     "--dtypes", "bf16", "--heads", "32:8", "--jobs", "3"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert calls == [("sm_90a", [64, 128], ["bf16"], True, [(32, 8)], 3)]
    line = next(x for x in out.splitlines() if x.startswith("fwd_d128_bf16"))
    assert "3.2" in line and "168" in line and "HGMMA UTMALDG" in line
    assert "missing: USETMAXREG" in line

    bad = dict(ok, name="fwd_d256_bf16", ok=False, error="ptxas: too many resources")
    _fake_aot(monkeypatch, [ok, bad])
    assert cli.main(["compile", "--arch", "sm_90a"]) == 1
    out = capsys.readouterr().out
    assert "FAILED: ptxas: too many resources" in out
    assert "1/2 variants built" in out


def test_compile_variants_rows_in_order(monkeypatch):
    # aot.compile_variants in one process: a row per job in the job list's order, a build's
    # exception reported in its row (the others still build), a disk hit not re-checked, the
    # artifact switch restored after (the spawned-worker path runs in CI's compile test)
    from cute_attn import aot

    def boom(key):
        raise RuntimeError(f"ptxas: too many resources ({key})")

    jobs = [
        ("a", "sm90_fwd", 1, lambda key: object(), ("HGMMA",)),
        ("b", "sm90_fwd", 2, boom, ()),
        ("c", "sm90_aux", 3, lambda key: object(), ()),
    ]
    seen = []
    monkeypatch.setattr(aot, "_job_list", lambda spec: (seen.append(spec), jobs)[1])
    monkeypatch.delenv("CUTE_ATTN_KEEP_ARTIFACTS", raising=False)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")  # (compile_variants only sets a default)
    rows = aot.compile_variants("sm_90a", head_dims=[64], dtypes=["bf16"], heads=[(4, 1)])
    assert seen == [("sm_90a", (64,), ("bf16",), ((4, 1),))]
    assert [r["name"] for r in rows] == ["a", "b", "c"]
    assert [r["ok"] for r in rows] == [True, False, True]
    assert rows[0]["error"] == "loaded from disk cache: SASS not re-checked"
    assert rows[1]["error"] == "RuntimeError: ptxas: too many resources (2)"
    assert "CUTE_ATTN_KEEP_ARTIFACTS" not in os.environ
    assert aot.compile_variants("sm_100a") == []  # no kernels for that arch yet


def test_compile_variants_key_error_stays_in_its_row(monkeypatch):
    # the real job list (D=64, bf16) with every builder stubbed: a variant whose compile key
    # cannot be made fails in its own row, and every other variant still builds
    from cute_attn import aot, bwd_sm90, fwd_sm90

    real_key = fwd_sm90.fwd_key

    def fwd_key(p, arch, features, **kw):
        if features.split_cluster:
            raise ValueError("no cluster here")
        return real_key(p, arch, features, **kw)

    monkeypatch.setattr(fwd_sm90, "fwd_key", fwd_key)
    for mod, name in ((fwd_sm90, "build_fwd"), (fwd_sm90, "build_combine"),
                      (fwd_sm90, "build_index_check"), (bwd_sm90, "build_bwd"),
                      (bwd_sm90, "build_bwd_aux")):  # fmt: skip
        monkeypatch.setattr(mod, name, lambda key: object())
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    rows = aot.compile_variants("sm_90a", head_dims=[64], dtypes=["bf16"])
    failed = [r for r in rows if not r["ok"]]
    assert failed and all("cluster" in r["name"] for r in failed), failed
    assert all(r["error"] == "ValueError: no cluster here" for r in failed), failed
    assert len(rows) - len(failed) > 40, len(rows)


def test_max_abs_diff_treats_matching_infinities_as_equal():
    ninf = float("-inf")
    a = torch.tensor([1.0, ninf, 2.0])
    assert cli._max_abs_diff(a, torch.tensor([1.5, ninf, 2.0])) == 0.5
    assert cli._max_abs_diff(a, torch.tensor([1.0, 0.0, 2.0])) == math.inf
    assert cli._max_abs_diff(a, torch.tensor([1.0, ninf, float("nan")])) == math.inf
    assert cli._max_abs_diff(a, torch.zeros(2)) == math.inf  # shape mismatch


# --------------------------------------------------------------------------------------------
# FLOP / visible-pair counting
# --------------------------------------------------------------------------------------------


def _brute_pairs(sq: int, sk: int, causal: bool, window) -> int:
    # The contract, written out independently: causal keeps j <= i + Sk - Sq; a window keeps
    # [i + Sk - Sq - left, i + Sk - Sq + right]; None / -1 = unbounded; both intersect.
    left, right = window
    off = sk - sq
    n = 0
    for i in range(sq):
        for j in range(sk):
            if causal and j > i + off:
                continue
            if left is not None and left >= 0 and j < i + off - left:
                continue
            if right is not None and right >= 0 and j > i + off + right:
                continue
            n += 1
    return n


_SIZES = [(1, 1), (1, 13), (13, 1), (7, 7), (5, 9), (9, 5), (16, 3), (3, 16), (0, 4), (4, 0)]
_WINDOWS = [(None, None), (-1, -1), (0, 0), (3, None), (None, 2), (2, 5), (0, None), (None, 0),
            (20, 20), (1, -1)]  # fmt: skip


@pytest.mark.parametrize("sq,sk", _SIZES)
def test_visible_pairs_matches_brute_force(sq, sk):
    for causal, window in itertools.product((False, True), _WINDOWS):
        got = bench.visible_pairs(sq, sk, causal, window)
        assert got == _brute_pairs(sq, sk, causal, window), (sq, sk, causal, window)


def test_visible_pairs_matches_reference_mask():
    # Ties the bench's count to the package's one mask rule (cute_attn.reference.visible_mask).
    from cute_attn.problem import normalize_window
    from cute_attn.reference import visible_mask

    windows = [(None, None), (11, 4), (0, None)]
    for (sq, sk), causal, window in itertools.product([(37, 90), (90, 37)], (False, True), windows):
        left, right = normalize_window(causal, window)
        want = int(visible_mask(sq, sk, left, right).sum())
        assert bench.visible_pairs(sq, sk, causal, window) == want


def test_visible_pairs_closed_forms_at_scale():
    s = 16384
    assert bench.visible_pairs(s, s) == s * s
    assert bench.visible_pairs(s, s, causal=True) == s * (s + 1) // 2
    # decode: one query sees every key, causal or not (bottom-right alignment)
    assert bench.visible_pairs(1, 32768, causal=True) == 32768
    # Sq > Sk causal: the first Sq - Sk rows see nothing
    assert bench.visible_pairs(4096, 1024, causal=True) == 1024 * 1025 // 2
    # a (w, 0) window on a long sequence: every row but the first w sees w + 1 keys
    w = 1024
    assert bench.visible_pairs(s, s, window_size=(w, 0)) == (s - w) * (w + 1) + w * (w + 1) // 2


def test_attention_flops():
    b, h, sq, sk = 2, 3, 40, 70
    pairs = bench.visible_pairs(sq, sk, True, (None, None))
    assert bench.attention_flops(b, h, sq, sk, 128, causal=True) == 4 * b * h * 128 * pairs
    assert bench.attention_flops(b, h, sq, sk, 192, 128, causal=True) == 2 * b * h * pairs * 320
    fwd = bench.attention_flops(b, h, sq, sk, 64)
    assert fwd == 4 * b * h * sq * sk * 64
    assert bench.attention_flops(b, h, sq, sk, 64, mode="bwd") == fwd * 5 // 2
    row = bench.Row("r", b, sq, sk, h, 1, 64, 64, causal=True)
    assert row.flops == bench.attention_flops(b, h, sq, sk, 64, causal=True)
    assert row.kv_bytes(2) == b * sk * 1 * 128 * 2


# --------------------------------------------------------------------------------------------
# timing statistics, presets, table
# --------------------------------------------------------------------------------------------


def test_median_p95():
    assert bench.median_p95([3.0]) == (3.0, 3.0)
    med, p95 = bench.median_p95(range(1, 21))  # 1..20
    assert med == 10.5
    assert p95 == pytest.approx(1 + 0.95 * 19)
    rng = random.Random(0)
    for n in (2, 5, 30, 31):
        xs = [rng.lognormvariate(0, 1) for _ in range(n)]
        med, p95 = bench.median_p95(xs)
        assert med == pytest.approx(statistics.median(xs))
        assert min(xs) <= med <= p95 <= max(xs)
    with pytest.raises(ValueError):
        bench.median_p95([])


def test_median_p95_matches_numpy():
    np = pytest.importorskip("numpy")
    xs = [random.Random(1).random() for _ in range(37)]
    xs = [x * (i + 1) for i, x in enumerate(xs)]
    med, p95 = bench.median_p95(xs)
    assert med == pytest.approx(float(np.percentile(xs, 50)))
    assert p95 == pytest.approx(float(np.percentile(xs, 95)))


def test_presets():
    rows = bench.preset_rows("fwd-prefill")
    assert len(rows) == 18
    for r in rows:
        assert r.batch * r.seqlen_q == 16384 and r.heads * r.head_dim == 2048
    assert {r.head_dim for r in rows} == {64, 128, 256}
    assert {r.causal for r in rows} == {False, True}
    dec = bench.preset_rows("decode")
    assert [(r.batch, r.seqlen_k, r.page_size) for r in dec] == [
        (1, 32768, 0), (8, 8192, 0), (64, 8192, 0), (128, 2048, 0), (64, 8192, 64),
        (64, 8192, 128), (64, 8192, 256)]  # fmt: skip
    assert all(r.seqlen_q == 1 and (r.heads, r.heads_kv) == (32, 8) and r.metric == "tbps"
               for r in dec)  # fmt: skip
    spec = bench.preset_rows("spec-decode")
    assert {r.seqlen_q for r in spec} == {2, 4, 8} and all(r.causal for r in spec)
    # 32 / 8 heads, and one row of 28 / 4 (G = 7: packed into padded tiles)
    assert [(r.heads, r.heads_kv) for r in spec].count((32, 8)) == len(spec) - 1
    assert (28, 4) in [(r.heads, r.heads_kv) for r in spec]
    assert all(r.metric == "tbps" for r in spec)
    full = bench.preset_rows("full")
    assert len({r.name for r in full}) == len(full)  # names are unique row keys
    assert any(r.mode == "bwd" for r in full)
    assert any(r.seqlen_q != r.seqlen_k and r.causal for r in full)
    assert any(r.heads_kv == 1 for r in full) and any(r.head_dim_v != r.head_dim for r in full)
    assert any(r.has_window for r in full)
    with pytest.raises(ValueError):
        bench.preset_rows("nope")


def test_ratios_and_table():
    res = [
        dict(row="r1", impl="cute_attn", status="ok", median_ms=1.0, p95_ms=1.2, tflops=500.0),
        dict(row="r1", impl="fa4", status="ok", median_ms=1.5, p95_ms=1.6, tflops=333.0),
        dict(row="r1", impl="sdpa-cudnn", status="ok", median_ms=1.2, p95_ms=1.3, tflops=416.0),
        dict(row="r1", impl="sdpa-flash", status="skip", note="SDPA has no softcap"),
        dict(row="r2", impl="cute_attn", status="error", note="RuntimeError: boom"),
        dict(row="r2", impl="sdpa-flash", status="ok", median_ms=2.0, p95_ms=2.1, tflops=1.0,
             tbps=3.5, max_err=1e-3),
    ]  # fmt: skip
    bench._add_ratios(res)
    assert res[0]["vs_best"] == pytest.approx(1.2)  # best baseline (cuDNN 1.2 ms) / 1.0 ms
    assert res[1]["vs_best"] == pytest.approx(1.2 / 1.5)
    assert "vs_best" not in res[5]  # no baseline measured on r2
    table = bench.format_table(res)
    assert "1.20x" in table and "skip: SDPA has no softcap" in table
    assert "error: RuntimeError: boom" in table and "3.50 TB/s" in table


def test_bench_row_times_impls_in_rounds(monkeypatch):
    # every live impl is timed in one _time_rounds call (they share the GPU's state); a skip
    # stays a skip; when the rounds raise, each impl is timed alone and only the one that
    # raises is an error
    preps = {
        "a": bench._Prepared({"impl": "a", "status": "ok", "note": ""}, call=lambda i: "A"),
        "b": bench._Prepared({"impl": "b", "status": "skip", "note": "no"}),
        "c": bench._Prepared({"impl": "c", "status": "ok", "note": ""}, call=lambda i: "C"),
    }
    rounds = []

    def time_rounds(calls, n_sets, warmup, reps):
        rounds.append(len(calls))
        if len(calls) > 1 and fail:
            raise RuntimeError("one impl broke")
        if fail and calls[0][1](0) == "C":
            raise RuntimeError("c broke")
        return [[float(k + 1)] * reps for k in range(len(calls))]

    def finish(prep, row, sets, ref, times):
        prep.res.update(median_ms=times[0])
        return prep.res

    monkeypatch.setattr(bench, "_prepare_impl", lambda impl, *a: preps[impl])
    monkeypatch.setattr(bench, "_time_rounds", time_rounds)
    monkeypatch.setattr(bench, "_finish_impl", finish)
    args = types.SimpleNamespace(warmup=1, reps=3, sequential=False)
    fail = False
    out = bench._bench_row(["a", "b", "c"], None, [None], None, args)
    assert [r["impl"] for r in out] == ["a", "b", "c"] and rounds == [2]
    assert out[0]["median_ms"] == 1.0 and out[2]["median_ms"] == 2.0
    assert out[1]["status"] == "skip"
    for p in preps.values():
        p.res.pop("median_ms", None)
    fail, rounds[:] = True, []
    out = bench._bench_row(["a", "b", "c"], None, [None], None, args)
    assert rounds == [2, 1, 1]
    assert out[0]["status"] == "ok" and out[0]["median_ms"] == 1.0
    assert out[2]["status"] == "error" and "c broke" in out[2]["note"]
    assert "median_ms" not in out[2]


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    res = [
        dict(row="r1", impl="cute_attn", status="ok", median_ms=1.0, tflops=500.0),
        dict(row="r1", impl="fa4", status="ok", median_ms=1.5, tflops=333.0),
        dict(row="d1", impl="fa4", status="ok", median_ms=0.1, tflops=1.0, tbps=3.0),
    ]
    png = b"\x89PNG\r\n\x1a\n"
    for name, rows in (("both", res), ("tflops", res[:2]), ("tbps", res[2:])):
        path = tmp_path / f"{name}.png"
        bench.plot(rows, path)
        assert path.read_bytes()[:8] == png, name
    bench.plot([dict(row="r", impl="fa4", status="error", note="x")], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()  # nothing measured: no empty figure


# --------------------------------------------------------------------------------------------
# implementation plumbing (layouts, masks, GQA) on CPU tensors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_candidates_match_reference(causal):
    # Each SDPA candidate (enable_gqa, and the untimed repeat_interleave fallback) must compute
    # the package's semantics from (B, S, H, D) inputs, bottom-right causal included (Sq < Sk).
    from cute_attn.reference import attention_ref

    row = bench.Row("r", 2, 5, 11, 6, 2, 16, 16, causal=causal)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g) for s in ((2, 5, 6, 16), (2, 11, 2, 16),
                                                      (2, 11, 2, 16)))  # fmt: skip
    want, _ = attention_ref(q, k, v, causal=causal)
    cands, ctx = bench._build_sdpa("sdpa-flash", row, q, k, v)
    assert [c[0] for c in cands] == ["enable_gqa", "kv repeat_interleave (untimed)"]
    assert cands[1][2][0].shape == (2, 11, 6, 16)  # expanded K in (B, S, H, D)
    for note, fn, _ in cands:
        torch.testing.assert_close(fn(), want, atol=1e-5, rtol=1e-5, msg=note)
    assert callable(ctx)


def test_sdpa_skips_what_it_cannot_express():
    q = k = v = torch.zeros(1, 4, 2, 8)
    for row in (bench.Row("w", 1, 4, 4, 2, 2, 8, 8, window=(2, 0)),
                bench.Row("c", 1, 4, 4, 2, 2, 8, 8, softcap=5.0)):  # fmt: skip
        with pytest.raises(bench.Skip):
            bench._build_sdpa("sdpa-cudnn", row, q, k, v)


def test_fa4_candidates(monkeypatch):
    # FA4's SM90 path asserts on num_splits != 1, so the split heuristic (num_splits=0) is tried
    # first and FA4's own default second; FA4 keyword names are passed, never positions.
    calls = []

    def fake_fa4(q, k, v, qv=None, softmax_scale=None, causal=False, window_size=(None, None),
                 softcap=0.0, num_splits=1, return_lse=False):  # fmt: skip
        calls.append(dict(causal=causal, window_size=window_size, softcap=softcap,
                          num_splits=num_splits, return_lse=return_lse))  # fmt: skip
        return q, None

    monkeypatch.setattr(bench, "_fa4_func", lambda: fake_fa4)
    row = bench.Row("r", 1, 4, 4, 2, 2, 8, 8, causal=True, window=(3, None), softcap=2.0)
    x = torch.zeros(1, 4, 2, 8)
    cands, _ = bench._build_fa4(row, x, x, x)
    assert [c[0] for c in cands] == ["num_splits=0", ""]
    for _, fn, _ in cands:
        assert fn() is x
    assert calls == [
        dict(causal=True, window_size=(3, None), softcap=2.0, num_splits=0, return_lse=True),
        dict(causal=True, window_size=(3, None), softcap=2.0, num_splits=1, return_lse=True),
    ]
    monkeypatch.setattr(bench, "_fa4_func", lambda: None)
    with pytest.raises(bench.Skip):
        bench._build_fa4(row, x, x, x)


def test_bench_graph_keeps_each_candidate_alive(monkeypatch):
    # A graph replays its candidate's tensors by address; paged rows build theirs (pages,
    # table) inside the candidate, so _prepare_impl must keep the candidate with its graph
    # (freed, the replays read whatever took that memory: an illegal address on the H200).
    import contextlib
    import gc
    import weakref

    class Inputs:  # stands for the tensors a candidate's closure owns
        pass

    refs = []

    def candidates(impl, row, q, k, v):
        owned = Inputs()
        refs.append(weakref.ref(owned))
        return [("", lambda: (owned, Inputs())[1], ())], contextlib.nullcontext  # a new output

    class Graph:
        def replay(self):
            pass

    monkeypatch.setattr(bench, "_candidates", candidates)
    monkeypatch.setattr(bench, "capture_graph", lambda fn: (Graph(), fn()))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    row = bench.Row("fwd b1 s1 h1 d64", 1, 1, 1, 1, 1, 64, 64)
    sets = [(None, None, None, None)] * 2
    prep = bench._prepare_impl("fa4", row, sets, types.SimpleNamespace(graph=True))
    gc.collect()
    assert prep.res["status"] == "ok" and "graph" in prep.res["note"]
    assert len(refs) == 2 and all(r() is not None for r in refs)
    assert isinstance(prep.call(1), Inputs)
    del prep
    gc.collect()
    assert all(r() is None for r in refs)  # held by the prepared impl, not leaked
