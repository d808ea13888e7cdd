"""Compile cache for JIT-compiled CuTe DSL kernels: in memory, and on disk across processes.

What
----
`cute.compile` costs about a second per kernel variant, so every kernel runner wraps its
`build(key) -> compiled` function in `@compiled_cache(name)`. A *key* is a frozen dataclass
deriving from `KernelKey` holding only plain values (dtype names, tile sizes, feature flags,
target arch, ...); it is everything that changes the generated code and nothing else (never
batch or sequence lengths, never tensors). The decorated function returns

1. the object from the in-process memory cache (a dict lookup: the per-call hot path), else
2. the artifact saved on disk by an earlier process (a TVM-FFI shared object opened by
   `tvm_ffi.load_module`, a few ms and no cutlass import; else the object file, JIT-linked by
   the DSL after its ~0.6 s import), else
3. a fresh build, which is then saved to disk for the next process (and, for builders
   declared `exportable`, loaded back from that save: see `export_only`).

On-disk layout
--------------
::

    <cache_dir()>/
      <name>/                       one folder per decorated builder (name sanitized)
        <digest>.json               sidecar: name, key class, key fields, fingerprint, file list,
                                    build seconds, creation time. Written last; an entry is
                                    valid only if its sidecar exists and matches the key.
        <digest>.o                  the artifact(s) written by the save hook (default: a TVM-FFI
        <digest>.so                 object file exported with `export_to_c`, and that object
                                    linked into a shared object where a C compiler is found)
        <digest>.lock               flock target serializing builders of this key across
                                    processes (never deleted: unlinking a flock file races)
        .tmp.<digest>.<pid>...      in-flight writes, renamed into place with os.replace

`<digest>` is `key.digest()`: sha256 over the key's class name, its fields, and
`source_fingerprint()` (the kernel sources under cute_attn/arch, the nvidia-cutlass-dsl and
apache-tvm-ffi versions, cute_attn's version, the platform). Editing any kernel source or
upgrading the DSL therefore changes every digest: stale entries are never loaded, only left
behind (delete the folder to reclaim space).

Environment (read at call time, so tests can monkeypatch it)
-------------------------------------------------------------
- `CUTE_ATTN_DISK_CACHE=0` (or false/off/no): memory cache only; nothing is written. Wins over
  `CUTE_ATTN_CACHE_DIR`.
- `CUTE_ATTN_SHARED_LIB=0`: the default hooks neither link nor load the `.so` copies (a disk hit
  then goes through the DSL's loader, which imports cutlass).
- `CUTE_ATTN_CACHE_DIR=/path`: use this folder as-is (shared by all fingerprints; the digest
  keeps them apart).
- default: `${XDG_CACHE_HOME:-~/.cache}/cute_attn/<fingerprint[:16]>`.

Safety guarantees
-----------------
- A memory hit touches no file and takes no lock. Keys are validated at construction
  (`TypeError` naming the field for anything that is not str/int/float/bool/None or a tuple of
  those), so a tensor can never end up in a key or a sidecar.
- A miss takes an in-process per-key `threading.Lock` and then a per-key `fcntl.flock`, and
  re-checks memory and disk under them: N threads or processes asking for the same key build
  it once; the others load the result.
- Writes are atomic: the save hook writes under a temporary name in the same folder, files are
  `os.replace`d into place, and the sidecar is written (atomically) last. A crash leaves at worst
  an entry without a sidecar, which counts as absent.
- A corrupt entry (sidecar unreadable or not matching the key, a listed file missing, the load
  hook raising or returning None) counts as a miss: a warning goes to the "cute_attn" logger,
  the entry is deleted, and the key is rebuilt.
- Disk errors (unwritable folder, full disk, no flock support) never fail the call: they are
  logged and the result stays in memory only.
- Key equality is dataclass equality, where `1 == 1.0 == True`; the digest, however, is
  type-exact. Give each field one type (as its annotation says) to keep the two consistent.

Usage
-----
::

    @dataclasses.dataclass(frozen=True)
    class FwdKey(KernelKey):
        dtype: str
        head_dim: int
        causal: bool

    @compiled_cache("sm90_fwd")
    def _build_fwd(key: FwdKey):
        return cute.compile(kernel, *fake_args, options="--enable-tvm-ffi")

    compiled = _build_fwd(FwdKey("bfloat16", 128, True))

Tests: `python -m pytest tests/test_cache.py` (add `-m "not compile"` to skip the real CuTe DSL
export/load round trip, which takes a few seconds on the CPU).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import operator
import os
import pathlib
import platform
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

try:  # POSIX only; elsewhere cross-process builds are not serialized (still correct, just dup work)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "KernelKey",
    "cache_dir",
    "cache_stats",
    "clear_memory_cache",
    "compiled_cache",
    "disk_entries",
    "export_only",
    "source_fingerprint",
]

logger = logging.getLogger("cute_attn")

_SIDECAR_FORMAT = 1
_PLAIN_SCALARS = (str, int, float, bool, type(None))
_FAST_OK = frozenset((str, int, bool, type(None)))  # scalars that need no further check
_DISABLE_VALUES = ("0", "false", "off", "no")


# ----------------------------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------------------------

# Per-class tuple of field names; dataclasses.fields() is slow enough to matter when keys are
# built on every kernel call.
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(cls))
        _FIELD_NAMES[cls] = names
    return names


# Per-class getter returning all field values as a tuple (works with and without slots).
_GETTERS: dict[type, Callable[[Any], tuple]] = {}


def _getter(cls: type) -> Callable[[Any], tuple]:
    names = _field_names(cls)
    if len(names) == 1:  # attrgetter of one name returns the value, not a 1-tuple
        getter = lambda obj: (getattr(obj, names[0]),)
    elif names:
        getter = operator.attrgetter(*names)
    else:
        getter = lambda obj: ()
    _GETTERS[cls] = getter
    return getter


def _all_plain(values: tuple) -> bool:
    """True iff every value is a plain scalar (floats not NaN) or a tuple of plain values."""
    for v in values:
        t = type(v)
        if t in _FAST_OK:
            continue
        if t is float:
            if v != v:  # NaN
                return False
        elif t is not tuple or not (set(map(type, v)) <= _FAST_OK or _all_plain(v)):
            return False
    return True


def _check_plain(value: Any, where: str) -> None:
    t = type(value)
    # Exact types on purpose: numpy ints, enums, torch.dtype etc. have unstable or
    # version-dependent reprs and would make digests drift.
    if t in _PLAIN_SCALARS:
        if t is float and math.isnan(value):
            # NaN != NaN: the key would never hit the memory cache.
            raise ValueError(f"{where}: NaN is not allowed in a compile key")
        return
    if t is tuple:
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where}: compile-key fields must be plain values (str/int/float/bool/None or tuples "
        f"of them), got {t.__module__}.{t.__qualname__}"
    )


def _canon(value: Any) -> str:
    """Type-tagged canonical text of a plain value (stable across processes and versions)."""
    t = type(value)
    if value is None:
        return "n"
    if t is bool:
        return "b:1" if value else "b:0"
    if t is int:
        return f"i:{value}"
    if t is float:
        return f"f:{value + 0.0!r}"  # + 0.0 folds -0.0 into 0.0 (they compare equal)
    if t is str:
        return "s:" + json.dumps(value)
    if t is tuple:
        return "(" + ",".join(_canon(v) for v in value) + ")"
    raise TypeError(f"not a plain value: {t.__qualname__}")  # unreachable after validation


class KernelKey:
    """Base class for compile keys. Subclass as a frozen dataclass of plain values::

        @dataclasses.dataclass(frozen=True)      # slots=True also works and hashes faster
        class FwdKey(KernelKey):
            dtype: str
            head_dim: int

    Construction validates every field (TypeError naming the field otherwise). A subclass
    defining its own `__post_init__` must call `super().__post_init__()`.
    """

    __slots__ = ()

    def __post_init__(self) -> None:
        # Keys may be built on every kernel call: str/int/bool/None-only keys pass with one
        # C-level set check, floats and tuples with a short loop; only rejects take the slow,
        # message-building path.
        cls = type(self)
        values = (_GETTERS.get(cls) or _getter(cls))(self)
        if set(map(type, values)) <= _FAST_OK or _all_plain(values):
            return
        for name in _field_names(cls):  # slow path: find the offending field, raise
            _check_plain(getattr(self, name), f"{cls.__qualname__}.{name}")

    def fields_dict(self) -> dict[str, Any]:
        """The key's fields as a dict (values as stored; tuples stay tuples)."""
        return {name: getattr(self, name) for name in _field_names(type(self))}

    def digest(self) -> str:
        """sha256 hex of (class qualname, sorted fields, source_fingerprint()).

        Independent of PYTHONHASHSEED, the process and field declaration order.
        """
        cls = type(self)
        items = sorted(self.fields_dict().items())
        text = "\n".join(
            [
                "cute_attn.KernelKey/v1",
                cls.__qualname__,
                ";".join(f"{k}={_canon(v)}" for k, v in items),
                source_fingerprint(),
            ]
        )
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------------------------
# Fingerprint and location
# ----------------------------------------------------------------------------------------------


def _arch_dir() -> pathlib.Path | None:
    """The installed cute_attn.arch package folder, without importing it (kernels import
    cutlass, which must not happen as a side effect of computing a digest)."""
    try:
        spec = importlib.util.find_spec("cute_attn.arch")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return pathlib.Path(next(iter(spec.submodule_search_locations)))
    # Uninstalled source checkout (repo root on sys.path): arch/ sits next to cute_attn/.
    root = pathlib.Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "arch").is_dir():
        return root / "arch"
    return None


# The import package of each distribution the fingerprint names: its dist-info folder normally
# sits next to the package, so one listing of that folder finds the version.
_DIST_PACKAGES = {"nvidia-cutlass-dsl": "nvidia_cutlass_dsl", "apache-tvm-ffi": "tvm_ffi"}


@functools.cache
def _dist_infos(folder: str) -> dict[str, str]:
    """{normalized name: version} from the `<name>-<version>.dist-info` folders in folder."""
    found: dict[str, str] = {}
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return found
    for n in names:
        if n.endswith(".dist-info") and "-" in n:
            name, _, version = n[: -len(".dist-info")].partition("-")
            found.setdefault(re.sub(r"[-_.]+", "_", name).lower(), version)
    return found


def _dist_version(dist: str) -> str:
    """The installed version of a distribution, without `importlib.metadata` where the
    dist-info folder can be found by listing (a fresh process's first disk hit computes the
    fingerprint, and two `importlib.metadata.version` calls cost ~5 ms there): first the
    folder holding its import package, then sys.path in order (importlib.metadata's search
    order), then importlib.metadata itself (egg-info and other layouts)."""
    norm = re.sub(r"[-_.]+", "_", dist).lower()
    folders = []
    package = _DIST_PACKAGES.get(dist)
    if package is not None:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            folders.append(os.path.dirname(next(iter(spec.submodule_search_locations))))
    for folder in (*folders, *sys.path):
        version = _dist_infos(folder).get(norm)
        if version is not None:
            return version
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not-installed"


def _arch_sources(folder: str, rel: str = "") -> list[tuple[str, str]]:
    """(relative posix path, path) of every *.py under folder, outside __pycache__."""
    found = []
    with os.scandir(folder) as entries:
        for e in entries:
            if e.is_dir():
                if e.name != "__pycache__":
                    found += _arch_sources(e.path, f"{rel}{e.name}/")
            elif e.name.endswith(".py"):
                found.append((rel + e.name, e.path))
    return found


def _cute_attn_version() -> str:
    try:
        import cute_attn

        version = getattr(cute_attn, "__version__", None)
    except ImportError:
        version = None
    return str(version) if version is not None else _dist_version("cute-attn")


@functools.cache
def source_fingerprint() -> str:
    """sha256 hex over everything outside a key that changes a compiled artifact.

    Covers every *.py under the cute_attn/arch package (sorted by relative path, path and
    content), the nvidia-cutlass-dsl and apache-tvm-ffi versions (the .o files use the TVM-FFI
    ABI), cute_attn.__version__, and OS/CPU (a shared home directory may serve several
    machines). Computed once per process.
    """
    h = hashlib.sha256(b"cute_attn-fingerprint/v1\0")
    arch = _arch_dir()
    if arch is None:
        logger.warning("cute_attn cache: kernel sources not found; fingerprint omits them")
        h.update(b"arch:missing\0")
    else:
        for rel, path in sorted(_arch_sources(str(arch))):
            h.update(rel.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read() + b"\0")
    for part in (
        "nvidia-cutlass-dsl=" + _dist_version("nvidia-cutlass-dsl"),
        "apache-tvm-ffi=" + _dist_version("apache-tvm-ffi"),
        "cute_attn=" + _cute_attn_version(),
        f"platform={sys.platform}-{platform.machine()}",
    ):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def cache_dir() -> pathlib.Path | None:
    """The on-disk cache folder, or None when the disk cache is disabled (see module doc)."""
    if os.environ.get("CUTE_ATTN_DISK_CACHE", "1").strip().lower() in _DISABLE_VALUES:
        return None
    explicit = os.environ.get("CUTE_ATTN_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "cute_attn" / source_fingerprint()[:16]


# ----------------------------------------------------------------------------------------------
# Default save/load: TVM-FFI object files
# ----------------------------------------------------------------------------------------------


def _c_identifier(text: str) -> str:
    ident = re.sub(r"\W", "_", text, flags=re.ASCII)
    return ident if ident[:1].isalpha() else "k_" + ident


def _export_name(name: str, key: KernelKey) -> str:
    return f"cute_attn_{_c_identifier(name)}_{key.digest()[:16]}"


def _shared_lib_enabled() -> bool:
    return os.environ.get("CUTE_ATTN_SHARED_LIB", "1").strip().lower() not in _DISABLE_VALUES


def _c_compiler() -> str | None:
    """A C compiler driver that can link a shared object: $CC, else cc / gcc / clang on PATH
    (the same requirement Triton's launcher has)."""
    explicit = os.environ.get("CC")
    if explicit:
        return shutil.which(explicit)
    return next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))), None)


def _link_shared(obj: pathlib.Path, out: pathlib.Path) -> bool:
    """Link the exported object file into a shared object that `tvm_ffi.load_module` can open
    without the DSL: against libcute_dsl_runtime and libtvm_ffi, their folders as rpath. Only
    called right after a build, when cutlass is imported anyway. False (logged) if it fails;
    the entry then keeps the object file only."""
    from cutlass.cute.runtime import find_runtime_libraries

    cc = _c_compiler()
    libs = [pathlib.Path(p) for p in find_runtime_libraries(enable_tvm_ffi=True)]
    if cc is None or len(libs) != 2 or not all(p.is_file() for p in libs):
        logger.debug("cute_attn cache: no shared object (compiler %s, libraries %s)", cc, libs)
        return False
    rpath = ":".join(sorted({str(p.parent) for p in libs}))
    cmd = [cc, "-shared", "-o", str(out), str(obj), *map(str, libs), f"-Wl,-rpath,{rpath}"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        logger.debug("cute_attn cache: linking %s failed: %s", out, e)
        return False
    if res.returncode:
        logger.debug("cute_attn cache: linking %s failed: %s", out, res.stderr[-2000:])
        return False
    return True


_EXPORT_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "cute_attn_export_only", default=False
)


def export_only() -> bool:
    """True while a builder declared `compiled_cache(..., exportable=True)` runs and its result
    will only be exported: the cache saves it and loads the saved shared object back, never
    calling what the builder returned. The builder may then skip the DSL's in-process
    execution engine (`no_jit_engine`), about 0.6 s of a D=128 forward build on the CPU. False
    everywhere else (the result must be callable)."""
    return _EXPORT_ONLY.get()


def _keep_artifacts(built: Any, loaded: Any) -> None:
    """The PTX and cubin a build kept (`--keep-ptx` / `--keep-cubin`: `cute_attn.aot` and the
    compile tests read the SASS off them) stay readable on the loaded function that replaces
    the build."""
    for name in ("__ptx__", "__cubin__"):
        try:
            artifact = getattr(built, name, None)
        except Exception:  # noqa: BLE001 - an artifact that was not kept
            artifact = None
        if artifact:
            setattr(loaded, name, artifact)


def _exportable() -> bool:
    """Whether a fresh build can go straight to a loadable shared object (a C compiler, shared
    objects not turned off)."""
    return _shared_lib_enabled() and _c_compiler() is not None


def _tvm_ffi_hooks(name: str):
    """Save: the TVM-FFI object file, plus (where a C compiler links it) the same code as a
    shared object. Load: the shared object through `tvm_ffi.load_module`, which needs neither
    cutlass nor its JIT linker (a fresh process then skips the DSL's ~0.6 s import), else the
    object file through `cute.runtime.load_module` (JIT-linked by the DSL's engine)."""

    def save(compiled: Any, base: pathlib.Path, key: KernelKey) -> list[pathlib.Path]:
        path = pathlib.Path(f"{base}.o")
        # Only TVM-FFI functions take object_file_path=/function_name=; anything else raises
        # (AttributeError/TypeError/DSL error) and the caller keeps the entry memory-only.
        compiled.export_to_c(object_file_path=str(path), function_name=_export_name(name, key))
        shared = pathlib.Path(f"{base}.so")
        if _shared_lib_enabled() and _link_shared(path, shared):
            return [path, shared]
        return [path]

    def load(base: pathlib.Path, key: KernelKey) -> Any:
        shared = pathlib.Path(f"{base}.so")
        if _shared_lib_enabled() and shared.exists():
            try:
                import tvm_ffi

                # kept alive (never unloaded) by TVM-FFI's module registry, like the DSL's engines
                module = tvm_ffi.load_module(str(shared), keep_module_alive=True)
                return module[_export_name(name, key)]
            except Exception as e:  # moved runtime libraries, ...: the object file still works
                _warn_once(
                    (name, "shared"),
                    "cute_attn cache: cannot load %s (%s: %s); loading the object file",
                    shared,
                    type(e).__name__,
                    e,
                )
        import cutlass.cute as cute

        module = cute.runtime.load_module(f"{base}.o", enable_tvm_ffi=True)
        # The returned tvm_ffi.Function keeps the module's execution engine alive.
        return module[_export_name(name, key)]

    return save, load


# ----------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------

_MISSING = object()
_WARNED: set[tuple[str, str]] = set()
_WARNED_GUARD = threading.Lock()


def _warn_once(tag: tuple[str, str], msg: str, *args: Any) -> None:
    with _WARNED_GUARD:
        first = tag not in _WARNED
        _WARNED.add(tag)
    logger.log(logging.WARNING if first else logging.DEBUG, msg, *args)


class _FileLock:
    """Exclusive flock on `path` for the duration of a `with`; degrades to no lock on error."""

    def __init__(self, path: pathlib.Path, cache_name: str):
        self.path = path
        self.cache_name = cache_name
        self.fd: int | None = None

    def __enter__(self) -> _FileLock:
        if fcntl is None:
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            _warn_once(
                (self.cache_name, "lock"), "cute_attn cache: cannot open %s: %s", self.path, e
            )
            return self
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:  # e.g. ENOLCK on some network filesystems
            os.close(fd)
            _warn_once(
                (self.cache_name, "lock"), "cute_attn cache: flock(%s) failed: %s", self.path, e
            )
            return self
        self.fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
                self.fd = None


class _gc_paused:
    """No cyclic garbage collection while a kernel traces and compiles. A build allocates
    enough to trigger collections, and a full one walks every object of the process: 0.14 s
    with torch and the DSL loaded, in about one build of five (CPU machine, forward builds
    counted with gc.callbacks). The collector runs again at its next threshold once the
    build is done. A thread building another key at the same time may re-enable it early,
    which only costs that thread the pause."""

    def __enter__(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: Any) -> None:
        if self.was_enabled:
            gc.enable()


def _unlink_quietly(path: pathlib.Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("cute_attn cache: cannot delete %s: %s", path, e)


class _Cache:
    """State of one decorated builder. The hot path lives in the wrapper closure."""

    def __init__(
        self, name: str, build: Callable, save: Callable, load: Callable, exportable: bool
    ):
        self.name = name
        self.exportable = exportable  # the builder honors export_only() (default hooks only)
        self.dir_name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        self.build = build
        self.save = save
        self.load = load
        self.memory: dict[KernelKey, Any] = {}
        self.key_locks: dict[KernelKey, threading.Lock] = {}
        self.guard = threading.Lock()
        self.memory_hits = 0
        self.disk_hits = 0
        self.misses = 0
        self.corrupt = 0
        self.build_seconds = 0.0
        self.load_seconds = 0.0

    # -- slow path -----------------------------------------------------------------------------

    def get_slow(self, key: KernelKey) -> Any:
        if not isinstance(key, KernelKey):
            raise TypeError(
                f"compiled_cache({self.name!r}) needs a KernelKey, got {type(key).__qualname__}"
            )
        with self.guard:
            lock = self.key_locks.setdefault(key, threading.Lock())
        with lock:
            value = self.memory.get(key, _MISSING)
            if value is not _MISSING:  # another thread built it while we waited
                self.memory_hits += 1
                return value
            folder = self._folder()
            if folder is None:
                value, _ = self._build(key)
            else:
                entry = folder / key.digest()
                with _FileLock(entry.with_name(entry.name + ".lock"), self.name):
                    value = self._load(entry, key)
                    if value is _MISSING:
                        value = self._build_and_save(entry, key)
            self.memory[key] = value
            return value

    def _folder(self) -> pathlib.Path | None:
        root = cache_dir()
        if root is None:
            return None
        folder = root / self.dir_name
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            _warn_once(
                (self.name, "mkdir"),
                "cute_attn cache: cannot create %s (%s); caching %r in memory only",
                folder,
                e,
                self.name,
            )
            return None
        return folder

    def _build_and_save(self, entry: pathlib.Path, key: KernelKey) -> Any:
        if not (self.exportable and _exportable()):
            value, seconds = self._build(key)
            self._save(entry, key, value, seconds)
            return value
        # The build only has to be exportable: save it, then load the saved shared object
        # (what every later process does too), so the DSL need not build an execution engine.
        value, seconds = self._build(key, export=True)
        self._save(entry, key, value, seconds)
        loaded = self._load(entry, key, count=False)
        if loaded is not _MISSING:
            _keep_artifacts(value, loaded)
            return loaded
        _warn_once(
            (self.name, "reload"),
            "cute_attn cache: could not load the entry %s just saved; building %r again with "
            "an in-process engine",
            entry,
            self.name,
        )
        return self._build(key)[0]

    def _build(self, key: KernelKey, export: bool = False) -> tuple[Any, float]:
        t0 = time.perf_counter()
        token = _EXPORT_ONLY.set(export)
        try:
            with _gc_paused():
                value = self.build(key)
        finally:
            _EXPORT_ONLY.reset(token)
        seconds = time.perf_counter() - t0
        if value is None:
            raise TypeError(f"compiled_cache({self.name!r}): build returned None for {key!r}")
        self.misses += 1
        self.build_seconds += seconds
        logger.debug("cute_attn cache: built %s %r in %.3f s", self.name, key, seconds)
        return value, seconds

    # -- disk ----------------------------------------------------------------------------------

    def _meta_for(self, key: KernelKey) -> dict[str, Any]:
        return {
            "format": _SIDECAR_FORMAT,
            "name": self.name,
            "key_class": type(key).__qualname__,
            "digest": key.digest(),
            "fingerprint": source_fingerprint(),
            # JSON round trip so that tuples compare equal to the lists read back
            "fields": json.loads(json.dumps(key.fields_dict())),
        }

    def _load(self, entry: pathlib.Path, key: KernelKey, count: bool = True) -> Any:
        """The entry's value, or _MISSING. `count`: a disk hit in the stats (False for the
        load right after a build, which stays a miss)."""
        sidecar = entry.with_name(entry.name + ".json")
        if not sidecar.exists():
            return _MISSING
        t0 = time.perf_counter()
        try:
            meta = json.loads(sidecar.read_text())
            expected = self._meta_for(key)
            mismatch = [k for k, v in expected.items() if meta.get(k) != v]
            if mismatch:
                raise ValueError(f"sidecar does not match the key ({', '.join(mismatch)})")
            files = [entry.with_name(entry.name + s) for s in meta.get("files", [])]
            missing = [str(f) for f in files if not f.exists()]
            if missing:
                raise FileNotFoundError(f"missing artifact files {missing}")
            value = self.load(entry, key)
            if value is None:
                raise ValueError("load hook returned None")
        except Exception as e:  # anything wrong with the entry: treat as a miss and rebuild
            self.corrupt += 1
            logger.warning(
                "cute_attn cache: discarding unusable entry %s (%s: %s); rebuilding",
                sidecar,
                type(e).__name__,
                e,
            )
            self._delete(entry)
            return _MISSING
        if count:
            self.disk_hits += 1
            self.load_seconds += time.perf_counter() - t0
        return value

    def _delete(self, entry: pathlib.Path) -> None:
        # Sidecar first: once it is gone the entry is invalid even if a later unlink fails.
        _unlink_quietly(entry.with_name(entry.name + ".json"))
        for path in entry.parent.glob(entry.name + ".*"):
            if not path.name.endswith(".lock"):
                _unlink_quietly(path)

    def _save(self, entry: pathlib.Path, key: KernelKey, value: Any, seconds: float) -> None:
        tmp_base = entry.with_name(
            f".tmp.{entry.name}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}"
        )
        try:
            written = [pathlib.Path(p) for p in self.save(value, tmp_base, key)]
        except Exception as e:
            _warn_once(
                (self.name, "save"),
                "cute_attn cache: cannot save %r to disk (%s: %s); keeping it in memory only",
                self.name,
                type(e).__name__,
                e,
            )
            self._remove_tmp(tmp_base)
            return
        try:
            suffixes = []
            for path in written:
                if path.parent != tmp_base.parent or not path.name.startswith(tmp_base.name):
                    raise ValueError(f"save hook wrote {path}, not {tmp_base}<suffix>")
                suffix = path.name[len(tmp_base.name) :]
                os.replace(path, entry.with_name(entry.name + suffix))
                suffixes.append(suffix)
            meta = self._meta_for(key)
            meta.update(
                files=suffixes,
                build_seconds=round(seconds, 6),
                created=time.time(),
                pid=os.getpid(),
            )
            tmp_json = tmp_base.with_name(tmp_base.name + ".json")
            tmp_json.write_text(json.dumps(meta, indent=1, sort_keys=True))
            os.replace(tmp_json, entry.with_name(entry.name + ".json"))
        except Exception as e:  # disk full, read-only, bad hook output: stay memory-only
            _warn_once(
                (self.name, "write"),
                "cute_attn cache: writing %s failed (%s: %s); keeping it in memory only",
                entry,
                type(e).__name__,
                e,
            )
            self._remove_tmp(tmp_base)

    @staticmethod
    def _remove_tmp(tmp_base: pathlib.Path) -> None:
        try:
            for path in tmp_base.parent.glob(tmp_base.name + "*"):
                _unlink_quietly(path)
        except OSError:
            pass

    def stats(self) -> dict[str, Any]:
        return {
            "memory_hits": self.memory_hits,
            "disk_hits": self.disk_hits,
            "misses": self.misses,
            "corrupt": self.corrupt,
            "build_seconds": self.build_seconds,
            "load_seconds": self.load_seconds,
            "memory_entries": len(self.memory),
        }


_REGISTRY: dict[str, _Cache] = {}


def compiled_cache(
    name: str,
    *,
    save: Callable[[Any, pathlib.Path, KernelKey], list[pathlib.Path]] | None = None,
    load: Callable[[pathlib.Path, KernelKey], Any] | None = None,
    exportable: bool = False,
) -> Callable[[Callable[[KernelKey], Any]], Callable[[KernelKey], Any]]:
    """Decorator for `build(key: KernelKey) -> compiled`: memory cache plus on-disk cache.

    `name` must be unique per builder (it names the disk folder and the stats entry).

    `save(compiled, base, key) -> list[Path]` writes the artifact as files named `base + suffix`
    (for example `f"{base}.o"`) and returns their paths; `base` is a temporary name in the
    cache folder and the files are renamed into place afterwards, so hooks need not be atomic.
    `load(base, key) -> compiled | None` reads them back from the final `base`; raising or
    returning None marks the entry corrupt (it is deleted and rebuilt).

    The defaults use TVM-FFI export: `compiled.export_to_c(object_file_path=f"{base}.o",
    function_name=...)`, linked into `{base}.so` where a C compiler is found, and on a hit
    `tvm_ffi.load_module(f"{base}.so")[function_name]` (no cutlass import), else
    `cutlass.cute.runtime.load_module(f"{base}.o", enable_tvm_ffi=True)[function_name]`;
    compile with `options="--enable-tvm-ffi"`. `exportable=True` (default hooks only) declares
    that the builder honors `export_only()`: with a C compiler, a fresh build is then saved
    and loaded back from its `.so`, the builder's own result is never called, and the builder
    may pass `no_jit_engine=True` to `cute.compile` (no in-process engine: ~0.6 s less); if
    that save or reload fails, it builds again with the engine. A loaded
    entry is a positional-only `tvm_ffi.Function`, not the `cute.compile` result class. If
    export fails (not a TVM-FFI function), that is logged once and entries stay memory-only.
    """
    if (save is None) != (load is None):
        raise ValueError("compiled_cache: give both save and load, or neither")
    if save is None:
        save, load = _tvm_ffi_hooks(name)
    elif exportable:
        raise ValueError("compiled_cache: exportable=True needs the default save/load hooks")

    def decorate(build: Callable[[KernelKey], Any]) -> Callable[[KernelKey], Any]:
        cache = _Cache(name, build, save, load, exportable)
        if name in _REGISTRY:
            logger.debug("cute_attn cache: re-registering %r (module reload?)", name)
        _REGISTRY[name] = cache
        memory = cache.memory
        get_slow = cache.get_slow

        # Hot path: one dict lookup (the key's dataclass __hash__/__eq__) and a counter.
        @functools.wraps(build)
        def cached(key: KernelKey) -> Any:
            try:
                value = memory[key]
            except KeyError:
                return get_slow(key)
            cache.memory_hits += 1
            return value

        cached.cache_name = name  # type: ignore[attr-defined]
        return cached

    return decorate


def _caches(name: str | None) -> list[_Cache]:
    if name is None:
        return list(_REGISTRY.values())
    try:
        return [_REGISTRY[name]]
    except KeyError:
        raise KeyError(f"no compiled_cache named {name!r}; known: {sorted(_REGISTRY)}") from None


def cache_stats(name: str | None = None) -> dict[str, Any]:
    """Counters of one cache, or totals over all caches of this process when name is None:
    memory_hits, disk_hits, misses (= builds), corrupt (entries discarded), build_seconds,
    load_seconds (disk loads), memory_entries."""
    total: dict[str, Any] = {
        "memory_hits": 0,
        "disk_hits": 0,
        "misses": 0,
        "corrupt": 0,
        "build_seconds": 0.0,
        "load_seconds": 0.0,
        "memory_entries": 0,
    }
    for cache in _caches(name):
        for k, v in cache.stats().items():
            total[k] += v
    return total


def clear_memory_cache(name: str | None = None) -> None:
    """Drop the in-memory entries (of one cache, or all). Disk entries and counters stay."""
    for cache in _caches(name):
        cache.memory.clear()


def disk_entries(name: str | None = None) -> list[dict[str, Any]]:
    """The sidecars found in cache_dir() (of one cache name, or all), each with `path` (the
    sidecar) and `current` (fingerprint matches this process). Unreadable sidecars are skipped.
    """
    root = cache_dir()
    if root is None or not root.is_dir():
        return []
    if name is None:
        pattern = "*/*.json"
    else:
        pattern = re.sub(r"[^A-Za-z0-9_.-]", "_", name) + "/*.json"
    fingerprint = source_fingerprint()
    out = []
    for sidecar in sorted(root.glob(pattern)):
        if sidecar.name.startswith("."):
            continue
        try:
            meta = json.loads(sidecar.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(meta, dict):
            continue
        meta["path"] = str(sidecar)
        meta["current"] = meta.get("fingerprint") == fingerprint
        out.append(meta)
    return out
