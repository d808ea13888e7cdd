"""Tests of cute_attn.cache: key digests, memory/disk hits, corruption, locking, TVM-FFI export.

All CPU. The `compile` test builds a real CuTe DSL kernel for sm_90a in a subprocess (the DSL
snapshots CUTE_DSL_ARCH at import) and loads it back from disk in a second, fresh subprocess.

    python -m pytest tests/test_cache.py            # everything, ~5-8 s
    python -m pytest tests/test_cache.py -m "not compile"
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import multiprocessing
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import timeit

import pytest

import cute_attn.cache as cache_mod
from cute_attn.cache import (
    KernelKey,
    cache_dir,
    cache_stats,
    clear_memory_cache,
    compiled_cache,
    disk_entries,
    source_fingerprint,
)

REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class AttnKey(KernelKey):
    dtype: str
    head_dim: int
    num_heads: int
    num_heads_kv: int
    causal: bool
    softcap: float = 0.0
    tile: tuple = (128, 128)
    pack_gqa: bool | None = None


def _key(**kw) -> AttnKey:
    base = dict(dtype="bfloat16", head_dim=128, num_heads=6, num_heads_kv=2, causal=True)
    base.update(kw)
    return AttnKey(**base)


def _pickle_save(obj, base, key):
    path = pathlib.Path(f"{base}.pkl")
    path.write_bytes(pickle.dumps(obj))
    return [path]


def _pickle_load(base, key):
    return pickle.loads(pathlib.Path(f"{base}.pkl").read_bytes())


_counter = iter(range(10**9))


def _make(save=_pickle_save, load=_pickle_load, delay=0.0):
    """A fresh, uniquely named cached fake builder and the list of keys it was called with."""
    calls = []
    name = f"fake_{next(_counter)}"

    def build(key):
        calls.append(key)
        if delay:
            time.sleep(delay)
        return {"fields": key.fields_dict(), "build_no": len(calls)}

    if save is None:
        return compiled_cache(name)(build), calls, name
    return compiled_cache(name, save=save, load=load)(build), calls, name


def _entry_files(name):
    folder = cache_dir() / name
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# ---------------------------------------------------------------------------------------------
# keys
# ---------------------------------------------------------------------------------------------


def test_digest_distinguishes_head_counts_with_same_gqa_ratio():
    a, b = _key(num_heads=6, num_heads_kv=2), _key(num_heads=12, num_heads_kv=4)
    assert a.num_heads // a.num_heads_kv == b.num_heads // b.num_heads_kv
    assert a != b
    assert a.digest() != b.digest()
    assert _key().digest() == _key().digest()
    assert len(a.digest()) == 64 and int(a.digest(), 16) >= 0


def test_digest_is_type_exact_and_field_sensitive():
    base = _key()
    others = [
        _key(causal=False),
        _key(softcap=30.0),
        _key(tile=(128, 64)),
        _key(pack_gqa=False),
        _key(dtype="float16"),
    ]
    digests = {k.digest() for k in [base, *others]}
    assert len(digests) == 1 + len(others)
    # -0.0 == 0.0 as dict keys, so they must share a digest too.
    assert _key(softcap=-0.0).digest() == base.digest()


def test_digest_stable_across_processes_and_hash_seeds():
    key = _key(softcap=50.0, tile=(64, (1, 2)), pack_gqa=True)
    code = textwrap.dedent(
        """
        import sys
        sys.path[:0] = [sys.argv[1], sys.argv[2]]
        from test_cache import _key
        print(_key(softcap=50.0, tile=(64, (1, 2)), pack_gqa=True).digest())
        """
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code, str(REPO), str(REPO / "tests")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == key.digest()


def test_key_rejects_non_plain_values():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"AttnKey\.head_dim.*torch\.Tensor"):
        _key(head_dim=torch.tensor(128))
    with pytest.raises(TypeError, match=r"AttnKey\.tile\[1\].*list"):
        _key(tile=(128, [64]))
    with pytest.raises(TypeError, match=r"AttnKey\.dtype.*torch\.dtype"):
        _key(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="NaN"):
        _key(softcap=float("nan"))
    with pytest.raises(ValueError, match=r"AttnKey\.tile\[1\]\[0\].*NaN"):
        _key(tile=(128, (float("nan"), 1.0)))
    assert _key(tile=(128, (0.5, None, "x", True))).tile[1][0] == 0.5  # nested plain is fine
    fn, calls, _ = _make()
    with pytest.raises(TypeError, match="KernelKey"):
        fn(("bfloat16", 128))
    assert calls == []


# ---------------------------------------------------------------------------------------------
# memory and disk behaviour
# ---------------------------------------------------------------------------------------------


def test_memory_hit_returns_same_object_and_is_fast():
    fn, calls, name = _make()
    first = fn(_key())
    assert fn(_key()) is first  # an equal, freshly built key hits
    assert len(calls) == 1
    stats = cache_stats(name)
    assert (stats["misses"], stats["memory_hits"], stats["disk_hits"]) == (1, 1, 0)

    key = _key()
    n = 2000
    per_call = min(timeit.repeat(lambda: fn(key), number=n, repeat=5)) / n
    print(f"memory hit: {per_call * 1e6:.2f} us")
    assert per_call < 5e-6
    assert cache_stats(name)["memory_hits"] == 1 + 5 * n


def test_disk_round_trip_and_sidecar():
    fn, calls, name = _make()
    k1, k2 = _key(), _key(num_heads=12, num_heads_kv=4)
    v1, v2 = fn(k1), fn(k2)
    files = _entry_files(name)
    for key in (k1, k2):
        assert {f"{key.digest()}.pkl", f"{key.digest()}.json", f"{key.digest()}.lock"} <= set(files)
    assert not [f for f in files if f.startswith(".tmp")]

    entries = disk_entries(name)
    assert len(entries) == 2
    by_digest = {e["digest"]: e for e in entries}
    meta = by_digest[k2.digest()]
    assert meta["name"] == name and meta["key_class"] == "AttnKey"
    assert meta["fields"]["num_heads"] == 12 and meta["fields"]["tile"] == [128, 128]
    assert meta["fingerprint"] == source_fingerprint() and meta["current"]
    assert meta["files"] == [".pkl"] and meta["build_seconds"] >= 0

    clear_memory_cache(name)
    assert cache_stats(name)["memory_entries"] == 0
    w1, w2 = fn(k1), fn(k2)
    assert len(calls) == 2  # nothing rebuilt
    assert (w1, w2) == (v1, v2) and w1 is not v1
    assert fn(k1) is w1  # and now in memory again
    stats = cache_stats(name)
    assert (stats["misses"], stats["disk_hits"], stats["memory_hits"]) == (2, 2, 1)
    assert stats["load_seconds"] > 0


@pytest.mark.parametrize("damage", ["artifact", "sidecar_garbage", "sidecar_mismatch"])
def test_corrupt_entry_is_rebuilt(damage, caplog):
    fn, calls, name = _make()
    key = _key()
    fn(key)
    entry = cache_dir() / name / key.digest()
    sidecar = pathlib.Path(f"{entry}.json")
    if damage == "artifact":
        pathlib.Path(f"{entry}.pkl").write_bytes(b"not a pickle")
    elif damage == "sidecar_garbage":
        sidecar.write_text("{trunc")
    else:
        meta = json.loads(sidecar.read_text())
        meta["fields"]["head_dim"] = 64
        sidecar.write_text(json.dumps(meta))

    clear_memory_cache(name)
    with caplog.at_level(logging.WARNING, logger="cute_attn"):
        value = fn(key)
    assert len(calls) == 2 and value["build_no"] == 2
    assert any("discarding unusable entry" in r.getMessage() for r in caplog.records)
    stats = cache_stats(name)
    assert (stats["misses"], stats["corrupt"], stats["disk_hits"]) == (2, 1, 0)

    clear_memory_cache(name)  # the rebuilt entry is valid again
    assert fn(key)["build_no"] == 2 and len(calls) == 2
    assert cache_stats(name)["disk_hits"] == 1


def test_missing_sidecar_means_absent():
    # A crash between the artifact rename and the sidecar write leaves an artifact alone.
    fn, calls, name = _make()
    key = _key()
    fn(key)
    pathlib.Path(f"{cache_dir() / name / key.digest()}.json").unlink()
    clear_memory_cache(name)
    fn(key)
    assert len(calls) == 2
    assert cache_stats(name)["corrupt"] == 0
    assert len(disk_entries(name)) == 1


def test_disk_cache_disabled_writes_nothing(monkeypatch, tmp_path):
    root = tmp_path / "should_not_exist"
    monkeypatch.setenv("CUTE_ATTN_CACHE_DIR", str(root))
    monkeypatch.setenv("CUTE_ATTN_DISK_CACHE", "0")
    assert cache_dir() is None
    fn, calls, name = _make()
    v = fn(_key())
    assert fn(_key()) is v
    clear_memory_cache(name)
    fn(_key())
    assert len(calls) == 2
    assert not root.exists()
    assert disk_entries() == []


def test_host_layer_imports_without_cutlass():
    # a disk hit must not pay the DSL's import: nothing the entry points import may pull it in
    code = (
        "import sys, cute_attn\n"
        "from cute_attn import api, bwd_sm90, cache, fwd_sm90, inference\n"
        "assert cute_attn.flash_attn_func is api.flash_attn_func\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cutlass'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("CUTE_ATTN_CACHE_DIR", raising=False)
    monkeypatch.delenv("CUTE_ATTN_DISK_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "cute_attn" / source_fingerprint()[:16]
    monkeypatch.setenv("CUTE_ATTN_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.setenv("CUTE_ATTN_DISK_CACHE", "off")
    assert cache_dir() is None


def test_unwritable_cache_dir_falls_back_to_memory(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("CUTE_ATTN_CACHE_DIR", str(blocker / "sub"))  # mkdir fails even as root
    fn, calls, name = _make()
    with caplog.at_level(logging.WARNING, logger="cute_attn"):
        v = fn(_key())
    assert fn(_key()) is v and len(calls) == 1
    assert any("in memory only" in r.getMessage() for r in caplog.records)


def test_default_tvm_ffi_save_failure_is_memory_only_and_logged_once(caplog):
    fn, calls, name = _make(save=None)  # default hooks; a dict has no export_to_c
    with caplog.at_level(logging.WARNING, logger="cute_attn"):
        a = fn(_key())
        b = fn(_key(head_dim=64))
    assert fn(_key()) is a and fn(_key(head_dim=64)) is b
    assert len(calls) == 2  # one build per key: a builder not declared exportable is kept as is
    warnings = [r for r in caplog.records if "cannot save" in r.getMessage()]
    assert len(warnings) == 1
    assert [f for f in _entry_files(name) if not f.endswith(".lock")] == []
    assert disk_entries(name) == []


def test_exportable_needs_the_default_hooks():
    with pytest.raises(ValueError, match="exportable"):
        compiled_cache("x", save=lambda *a: [], load=lambda *a: None, exportable=True)


def test_stats_totals_and_unknown_name():
    fn1, _, n1 = _make()
    fn2, _, n2 = _make()
    fn1(_key())
    fn2(_key())
    fn2(_key())
    total = cache_stats()
    assert total["misses"] >= 2 and total["memory_hits"] >= 1
    assert cache_stats(n2)["memory_hits"] == 1
    with pytest.raises(KeyError, match="no compiled_cache named"):
        cache_stats("no_such_cache")


# ---------------------------------------------------------------------------------------------
# concurrency
# ---------------------------------------------------------------------------------------------


def test_threads_build_once():
    fn, calls, name = _make(delay=0.2)
    barrier = threading.Barrier(8)
    results = [None] * 8

    def worker(i):
        barrier.wait()
        results[i] = fn(_key())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert all(r is results[0] for r in results)
    stats = cache_stats(name)
    assert (stats["misses"], stats["memory_hits"], stats["disk_hits"]) == (1, 7, 0)


def _race_worker(cache_root, count_file, barrier, queue):
    # Runs in a spawned process: own memory cache, shared disk folder.
    os.environ["CUTE_ATTN_CACHE_DIR"] = cache_root

    def build(key):
        with open(count_file, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.3)  # keep the window open so the other process really waits on the lock
        return {"builder": os.getpid()}

    fn = compiled_cache("race", save=_pickle_save, load=_pickle_load)(build)
    barrier.wait()
    value = fn(_key())
    queue.put((os.getpid(), value["builder"], cache_stats("race")))


def test_processes_race_on_one_key_build_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    count_file = tmp_path / "builds.txt"
    root = str(cache_dir())
    procs = [
        ctx.Process(target=_race_worker, args=(root, str(count_file), barrier, queue))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    builders = count_file.read_text().split()
    assert len(builders) == 1
    assert {builder for _, builder, _ in results} == {int(builders[0])}
    assert sorted((s["misses"], s["disk_hits"]) for _, _, s in results) == [(0, 1), (1, 0)]
    assert len(disk_entries("race")) == 1


# ---------------------------------------------------------------------------------------------
# real CuTe DSL export / load (CPU only: compile for sm_90a, never launch)
# ---------------------------------------------------------------------------------------------

# The end of both scripts below: get the kernel through the cache, call it with host arrays (the
# real TVM-FFI entry point rejects them before any launch), and report to the file in argv[2].
_CALL_AND_REPORT = """
t0 = time.perf_counter()
fn = build(AddKey("float32", 128))
seconds = time.perf_counter() - t0
import numpy as np
x = np.zeros(16, np.float32)
try:
    fn(x, x, x)
    call_error = None
except Exception as e:
    call_error = f"{type(e).__name__}: {e}"
report = {
    "seconds": seconds,
    "type": f"{type(fn).__module__}.{type(fn).__qualname__}",
    "callable": callable(fn),
    "call_error": call_error,
    "stats": cache_stats("dsl_add"),
    "cutlass_imported": "cutlass" in sys.modules,
}
json.dump({**report, **extra()}, open(sys.argv[2], "w"))
"""

_DSL_SCRIPT = (
    """
import dataclasses, json, os, sys, time

assert os.environ["CUTE_DSL_ARCH"] == "sm_90a"
import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda

from cute_attn.cache import KernelKey, cache_stats, compiled_cache, disk_entries, export_only

mode = sys.argv[1]
seen = []


@cute.kernel
def add_kernel(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, block: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * block + tidx
    if i < cute.size(a):
        c[i] = a[i] + b[i]


@cute.jit
def add(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, block: cutlass.Constexpr,
        stream: cuda.CUstream):
    n = cute.size(a)
    add_kernel(a, b, c, block).launch(
        grid=((n + block - 1) // block, 1, 1), block=(block, 1, 1), stream=stream
    )


@dataclasses.dataclass(frozen=True)
class AddKey(KernelKey):
    dtype: str
    block: int


@compiled_cache("dsl_add", exportable=True)
def build(key):
    if mode != "build":
        raise AssertionError("the load phases must not build")
    n = cute.sym_int()
    fakes = [cute.runtime.make_fake_compact_tensor(cutlass.Float32, (n,)) for _ in range(3)]
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    seen.append(export_only())
    # as the library's builders do: no in-process engine when the cache only exports the result
    return cute.compile(add, *fakes, key.block, stream, options="--enable-tvm-ffi",
                        no_jit_engine=export_only())


def extra():
    return {"entries": len(disk_entries("dsl_add")), "export_only": seen}
"""
    + _CALL_AND_REPORT
)


# A fresh process that loads the entry above without the DSL: same key class, no cutlass import.
_BARE_SCRIPT = (
    """
import dataclasses, json, sys, time

import tvm_ffi  # noqa: F401  (imports torch when installed: a user's process has both already)

from cute_attn.cache import KernelKey, cache_stats, compiled_cache


@dataclasses.dataclass(frozen=True)
class AddKey(KernelKey):
    dtype: str
    block: int


@compiled_cache("dsl_add")
def build(key):
    raise AssertionError("the bare load must not build")


def extra():
    return {}
"""
    + _CALL_AND_REPORT
)


@pytest.mark.compile
@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs nvidia-cutlass-dsl")
def test_real_cute_dsl_export_and_load_round_trip(tmp_path):
    script = tmp_path / "dsl_add.py"  # the DSL needs a real source file for its jit functions
    script.write_text(_DSL_SCRIPT)
    bare = tmp_path / "bare_load.py"
    bare.write_text(_BARE_SCRIPT)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)

    def run(path, mode, **extra):
        out = tmp_path / f"{mode}.json"
        proc = subprocess.run(
            [sys.executable, str(path), mode, str(out)],
            env=dict(env, **extra),
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-8000:]
        return json.loads(out.read_text())

    built = run(script, "build")
    assert built["stats"]["misses"] == 1 and built["stats"]["disk_hits"] == 0
    assert built["entries"] == 1
    suffixes = sorted(p.suffix for p in (cache_dir() / "dsl_add").iterdir())
    # the shared object needs a C compiler to link it; CI's machine has one
    linked = cache_mod._c_compiler() is not None
    assert suffixes == [".json", ".lock", ".o"] + [".so"] * linked

    # with a shared object the build made no engine: what it returned is the saved .so, loaded
    assert built["export_only"] == [linked]
    if linked:
        assert built["type"] == "tvm_ffi.core.Function"

    # fresh processes: each must come from disk, never from build()
    loaded = run(script, "load")
    from_object = run(script, "load_object", CUTE_ATTN_SHARED_LIB="0")
    results = [built, loaded, from_object]
    if linked:
        results.append(run(bare, "bare"))
        assert not results[-1]["cutlass_imported"]  # the disk hit skipped the DSL entirely
    for result in results[1:]:
        assert result["stats"]["disk_hits"] == 1 and result["stats"]["misses"] == 0
        assert result["type"] == "tvm_ffi.core.Function" and result["callable"]
    # The loaded symbol is the real kernel entry: it checks its signature and device.
    for result in results:
        assert "cuda" in result["call_error"], result["call_error"]
    print(
        f"\nbuild+export {built['seconds']:.3f} s (build {built['stats']['build_seconds']:.3f} s);"
        f" disk load in a fresh process {loaded['seconds']:.3f} s, object file"
        f" {from_object['seconds']:.3f} s"
        + (f", without the DSL {results[-1]['seconds']:.3f} s" if linked else "")
    )
