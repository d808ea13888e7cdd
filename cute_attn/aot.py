"""Ahead-of-time builds of the kernel variants for an arch, on any machine (GPU or not).

`compile_variants` fills the disk cache (so GPU hosts with the same versions skip the JIT) and
reports, per variant, compile time, registers, spills and whether the instructions the kernel
is meant to use are in its SASS. Used by `python -m cute_attn compile` and by CI. With
`jobs` > 1 the builds run in spawned worker processes (a caller's script then needs the
`if __name__ == "__main__":` guard that multiprocessing's spawn asks for).

The DSL reads CUTE_DSL_ARCH at import: call this in a process that has not imported cutlass
yet, or that imported it with the same arch.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import struct
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path

from .problem import AttnProblem

MEANT = {"sm_90a": ("HGMMA", "UTMALDG", "UTMASTG", "USETMAXREG")}
# per kernel kind, beyond MEANT: the backward adds dQ partials with a TMA reduce-add
MEANT_EXTRA = {"sm90_bwd": ("UTMAREDG",)}
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "bfloat16": "bfloat16", "float16": "float16"}
# (label, causal, window_left, window_right, softcap, deterministic): each specializes a kernel
FEATURES = (
    ("plain", False, -1, -1, 0.0, False),
    ("causal", True, -1, 0, 0.0, False),
    ("local", False, 128, 0, 0.0, False),
    ("softcap", True, -1, 0, 30.0, False),
)
# the backward also specializes on the deterministic dQ order
BWD_FEATURES = FEATURES + (("deterministic causal", True, -1, 0, 0.0, True),)
# forward input layouts beyond dense (InputFeatures fields; "decode": the packed decode tile
# config; "tall": the long-query tile config), built with the causal feature, or without a
# mask for decode (packed rows sit at one position: the causal corner is no mask there)
FWD_INPUTS = (
    ("split", {"split_kv": True}),
    ("varlen", {"cu_seqlens_q": True, "cu_seqlens_k": True}),
    ("varlen seqused split", {"cu_seqlens_q": True, "cu_seqlens_k": True, "seqused_q": True,
                              "seqused_k": True, "split_kv": True, "batch_order": True}),
    ("kvcache", {"seqused_k": True}),
    ("kvcache batch_idx split", {"seqused_k": True, "kv_batch_idx": True, "split_kv": True}),
    ("decode kvcache", {"seqused_k": True, "decode": True}),
    # "wide": the two-CTAs-per-SM decode tile of split grids and of unsplit grids that fill two
    # CTAs per SM (tile_config.fills_two_ctas_per_sm; the dense and KV-cache inputs of
    # fwd_sm90._WIDE_INPUTS)
    ("decode split wide", {"split_kv": True, "decode": True, "wide": True}),
    # two splits merge inside a cluster (tile_config.fwd_split_cluster; not at Dv = 256)
    ("decode split wide cluster", {"split_kv": True, "split_cluster": True, "decode": True,
                                   "wide": True}),
    ("kvcache batch_idx split cluster", {"seqused_k": True, "kv_batch_idx": True,
                                         "split_kv": True, "split_cluster": True}),
    ("decode wide", {"decode": True, "wide": True}),
    ("decode kvcache wide", {"seqused_k": True, "decode": True, "wide": True}),
    ("decode paged128 wide", {"seqused_k": True, "paged_kv": True, "decode": True,
                              "page_size": 128, "wide": True}),
    # paged: "page_size" picks the key tile (tile_config.paged_tile_config): 64 cuts the decode
    # tile to 64 keys with more stages, 16 the smallest TMA tile, 256 keeps the table's tile
    ("decode paged64", {"seqused_k": True, "paged_kv": True, "decode": True, "page_size": 64}),
    ("varlen paged16", {"cu_seqlens_q": True, "cu_seqlens_k": True, "paged_kv": True,
                        "page_size": 16}),
    ("kvcache paged256 split", {"seqused_k": True, "paged_kv": True, "split_kv": True,
                                "page_size": 256}),
    # GQA calls the Sq = 1 decode view does not pack (speculative decoding's few query rows,
    # packed sequences) pack a KV head's query heads into the decode tile's rows in the kernel
    # (tile_config.fwd_pack_gqa), under the causal corner; built where the rule packs
    ("pack_gqa kvcache", {"seqused_k": True, "pack_gqa": True, "decode": True, "mask": "causal"}),
    ("pack_gqa kvcache split", {"seqused_k": True, "pack_gqa": True, "split_kv": True,
                                "decode": True, "mask": "causal"}),
    ("pack_gqa varlen", {"cu_seqlens_q": True, "cu_seqlens_k": True, "pack_gqa": True,
                         "decode": True, "mask": "causal"}),
    # and on the two-CTAs-per-SM decode tile, where tile_config.fwd_pack_gqa_wide takes it
    ("pack_gqa kvcache wide", {"seqused_k": True, "pack_gqa": True, "decode": True,
                               "wide": True, "mask": "causal"}),
    # the long-query bucket (tile_config.fills_tall_tiles): D=64 gets 192-row tiles
    ("tall", {"tall": True}),
    # the persistent grid of dense forwards (tile_config.fwd_persistent; D <= 128), built for
    # the SM count of an H100 SXM / H200 (132) without a mask ("tall" too at D=64), under
    # the causal one and under a sliding window ("mask": the feature row it is built with)
    ("persistent", {"persistent": True}),
    ("tall persistent", {"tall": True, "persistent": True}),
    ("causal persistent", {"persistent": True, "mask": "causal"}),
    ("window persistent", {"persistent": True, "mask": "local"}),
)  # fmt: skip
# the SM count the AOT build of a persistent variant assumes (others JIT their own)
AOT_NUM_SMS = 132
# The small kernels around the attention ones, also JIT-compiled at a first call: the split-KV
# combine per (dtype, head_dim_v), and the index-value check per set of index tensors the
# varlen and KV-cache entries pass (validation: cu_seqlens_q always in varlen, cu_seqlens_k
# unless paged lengths come from seqused_k; KV-cache: cache_seqlens, cache_batch_idx or pages).
INDEX_CHECK_SETS = tuple(
    {"cu_seqlens_q": True, "cu_seqlens_k": cu_k, "seqused_q": used_q, "seqused_k": used_k,
     "paged": paged}
    for paged, cu_k, used_q, used_k in itertools.product((False, True), repeat=4)
    if cu_k or (paged and used_k)
) + tuple(
    {"seqused_k": used_k, "batch_idx": rows == "batch_idx", "paged": rows == "paged"}
    for used_k, rows in itertools.product((True, False), ("", "batch_idx", "paged"))
    if used_k or rows
)  # fmt: skip
# split partials (fp32) leave registers by predicated stores, not the TMA store; packed
# sequences use the TMA store through a ragged view (arch/common/seqlen.ragged_rows)
DIRECT_STORE_INPUTS = ("split_kv",)


def _nvdisasm() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    cand = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13" / "bin" / "nvdisasm"
    return str(cand) if cand.exists() else None


def _cubin_registers(cubin: bytes) -> int | None:
    """Register count of the kernel from the cubin's .nv.info attributes (EIATTR_REGCOUNT)."""
    if cubin[:4] != b"\x7fELF":
        return None
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    str_off = secs[shstrndx][4]
    regs = None
    for sec in secs:
        name = cubin[str_off + sec[0] : cubin.index(b"\0", str_off + sec[0])].decode()
        if not name.startswith(".nv.info"):
            continue
        pos, end = sec[4], sec[4] + sec[5]
        while pos + 2 <= end:  # entries: u8 format, u8 attribute, then by format
            fmt, attr = cubin[pos], cubin[pos + 1]
            if fmt == 4:  # EIFMT_SVAL: u16 size, payload
                size = struct.unpack_from("<H", cubin, pos + 2)[0]
                if attr == 0x2F:  # EIATTR_REGCOUNT: (symbol index, registers)
                    regs = max(regs or 0, struct.unpack_from("<II", cubin, pos + 4)[1])
                pos += 4 + size
            else:  # EIFMT_NVAL has no value; BVAL/HVAL carry a 2-byte value
                pos += 2 if fmt == 1 else 4
    return regs


def _sass(cubin: bytes) -> str:
    tool = _nvdisasm()
    if tool is None:
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, timeout=300)
    return res.stdout


def _variant_problems(head_dims, dtypes, heads):
    """(name, kind, problem, inputs) for every forward and backward variant in the tuning
    tables; inputs is the forward's InputFeatures fields (empty: dense)."""
    from .arch.sm90.bwd_tiles import BWD_HEAD_DIMS, bwd_group_heads, bwd_short_rows
    from .arch.sm90.tile_config import (
        SUPPORTED_HEAD_DIMS,
        fwd_pack_gqa_wide,
        fwd_persistent,
        fwd_split_cluster,
    )
    from .fwd_sm90 import _pack_gqa_rows

    plain, causal = FEATURES[0], FEATURES[1]
    by_label = {f[0]: f for f in FEATURES}

    def feature_row(kw: dict) -> tuple:
        if "mask" in kw:
            return by_label[kw["mask"]]
        return plain if kw.get("decode") or kw.get("persistent") else causal

    fwd = [(f, "", {}) for f in FEATURES] + [(feature_row(kw), lbl, kw) for lbl, kw in FWD_INPUTS]
    # packed sequences (cu_seqlens_q / cu_seqlens_k) specialize the backward too, and so does
    # group_heads (GQA grids of 3/4 of a wave or more: unmasked, or causal with L2 sections;
    # built where the rule can take it), and the short-rows buckets (bwd_short_rows)
    bwd = [(f, "", {}) for f in BWD_FEATURES] + [
        (causal, "varlen", {"varlen": True}), (plain, "group_heads", {"group_heads": True}),
        (causal, "group_heads", {"group_heads": True}),
        (causal, "varlen group_heads", {"varlen": True, "group_heads": True}),
        (causal, "short", {"short": True}), (plain, "short", {"short": True}),
    ]  # fmt: skip
    kinds = (("sm90_fwd", SUPPORTED_HEAD_DIMS, fwd), ("sm90_bwd", BWD_HEAD_DIMS, bwd))
    for kind, table, variants in kinds:
        for (d, dv), dt, (h, hkv), variant in itertools.product(table, dtypes, heads, variants):
            if head_dims and d not in head_dims:
                continue
            (label, causal, left, right, softcap, deterministic), in_label, inputs = variant
            p = AttnProblem(
                batch=1, seqlen_q=1, seqlen_k=1, num_heads=h, num_heads_kv=hkv, head_dim=d,
                head_dim_v=dv, dtype=DTYPE_NAMES[dt], device_type="cuda", device_index=0,
                softmax_scale=d**-0.5, causal=causal, window_left=left, window_right=right,
                softcap=softcap, deterministic=deterministic,
            )  # fmt: skip
            # persistent grids only where the runtime rule can pick them (any key length),
            # the tall one only where it differs (D=64)
            if inputs.get("persistent") and (
                not fwd_persistent(d, 1, left, right) or (inputs.get("tall") and d > 64)
            ):
                continue
            # packed GQA rows only where the runtime rule can pick them (a few query rows; a
            # group below the decode tile's rows, or a multiple of them)
            if inputs.get("pack_gqa") and not _pack_gqa_rows(p, 2):
                continue
            if inputs.get("pack_gqa") and inputs.get("wide") and not fwd_pack_gqa_wide():
                continue
            # cluster-merged splits only where the runtime rule can pick them
            if inputs.get("split_cluster") and not fwd_split_cluster(2, dv):
                continue
            # short-rows tiles only where the runtime rule can pick them (their own tile)
            if inputs.get("short") and not bwd_short_rows(
                d, causal, p.is_local, deterministic, varlen=False, group_heads=False, seqlen_q=1
            ):
                continue
            # grouped variants only where the runtime rule can pick them (any grid size)
            if inputs.get("group_heads") and not bwd_group_heads(
                p.qhead_per_kvhead, d, causal, p.is_local, deterministic,
                inputs.get("varlen", False), 1 << 30, 1,
            ):  # fmt: skip
                continue
            name = f"{kind} d{d}x{dv} {dt} h{h}:{hkv} {label}" + (f" {in_label}" * bool(in_label))
            yield name, kind, p, inputs


def compile_variants(
    arch: str,
    head_dims: list[int] | None = None,
    dtypes: list[str] | None = None,
    progress: bool = False,
    heads: list[tuple[int, int]] | None = None,
    jobs: int = 1,
) -> list[dict]:
    """Build every variant (rows in a fixed order: the tables', then the small kernels'). With
    `jobs` > 1 the builds run in that many fresh (spawned) processes, each importing the DSL
    once: a build is one CPU core's work (trace, the DSL's passes, ptxas), and the disk
    cache is safe across processes (per-key flock, atomic renames)."""
    if arch not in MEANT:
        return []  # no kernels for this arch yet (sm_100a: none)
    os.environ.setdefault("CUTE_DSL_ARCH", arch)
    spec = (arch, tuple(head_dims or ()), tuple(dtypes or ()), tuple(heads or ()))
    old = os.environ.get("CUTE_ATTN_KEEP_ARTIFACTS")
    os.environ["CUTE_ATTN_KEEP_ARTIFACTS"] = "1"  # (inherited by spawned workers)
    try:
        if jobs > 1:
            return _build_parallel(spec, jobs, progress)
        return [_report(_build_row(job), progress) for job in _job_list(spec)]
    finally:
        if old is None:
            os.environ.pop("CUTE_ATTN_KEEP_ARTIFACTS", None)
        else:
            os.environ["CUTE_ATTN_KEEP_ARTIFACTS"] = old


def _job_list(spec: tuple) -> list[tuple]:
    """(name, kind, compile key, build, instructions meant) of every variant `spec` = (arch,
    head_dims, dtypes, heads) selects (empty tuples: the defaults); the same list, in the same
    order, in every process that asks. A few variants share a key (e.g. D=256's plain dense
    forward and its wide decode tile: the tables give them one config)."""
    arch, head_dims, dtypes, heads = spec
    from .arch.common.features import InputFeatures
    from .bwd_sm90 import build_bwd, bwd_key
    from .fwd_sm90 import build_fwd, fwd_key

    def make_fwd_key(p, arch, inputs):
        inputs = dict(inputs)
        decode = inputs.pop("decode", False)
        tall = inputs.pop("tall", False)
        wide = inputs.pop("wide", False)
        sms = AOT_NUM_SMS if inputs.pop("persistent", False) else 0
        inputs.pop("mask", None)  # which feature row it was built with: p says it
        if "page_size" in inputs:
            p = dataclasses.replace(p, paged=True, page_size=inputs.pop("page_size"))
        return fwd_key(p, arch, InputFeatures(**inputs), decode=decode, tall=tall, wide=wide,
                       persistent_sms=sms)  # fmt: skip

    def make_bwd_key(p, arch, inputs):
        p = dataclasses.replace(p, varlen=inputs.get("varlen", False))
        group, short = inputs.get("group_heads", False), inputs.get("short", False)
        return bwd_key(p, arch, group_heads=group, short=short)

    builders = {"sm90_fwd": (build_fwd, make_fwd_key), "sm90_bwd": (build_bwd, make_bwd_key)}

    head_dims = list(head_dims) or None
    dtypes = [d for d in (dtypes or ("bf16", "fp16")) if DTYPE_NAMES[d]]
    jobs = []
    for name, kind, p, inputs in _variant_problems(head_dims, dtypes, heads or [(8, 2)]):
        meant = MEANT[arch] + MEANT_EXTRA.get(kind, ())
        if any(inputs.get(f) for f in DIRECT_STORE_INPUTS):
            meant = tuple(i for i in meant if i != "UTMASTG")
        if inputs.get("split_cluster"):
            meant += ("UCGABAR_WAIT",)  # the cluster barriers of the merge
        elif inputs.get("split_kv"):
            meant += ("PREEXIT",)  # griddepcontrol.launch_dependents for the PDL combine
        build, make_key = builders[kind]
        try:
            key = make_key(p, arch, inputs)
        except Exception as e:  # reported in this variant's row; the others still build
            key, build = ("no key", name), _raiser(e)
        jobs.append((name, kind, key, build, meant))
    return jobs + list(_aux_jobs(arch, head_dims, dtypes))


def _raiser(error: Exception):
    def build(key):
        raise error

    return build


def _build_row(job: tuple) -> dict:
    """Build one job; its report row (an exception is reported, not raised: one broken
    variant must not hide the others)."""
    name, kind, key, build, meant = job
    row = _row(name, kind, os.environ.get("CUTE_DSL_ARCH"))
    t0 = time.perf_counter()
    try:
        fn = build(key)
        row["seconds"] = round(time.perf_counter() - t0, 2)
        cubin = getattr(fn, "__cubin__", None)
        if cubin:  # None when it came from the disk cache (no artifacts kept)
            sass = _sass(cubin)
            row["registers"] = _cubin_registers(cubin)
            row["spills"] = sass.count("STL") + sass.count("LDL") if sass else None
            row["instructions"] = {i: i in sass for i in meant} if sass else {}
            row["ok"] = bool(sass) and all(row["instructions"].values())
            if not sass:
                row["error"] = "nvdisasm not found: cannot check SASS"
            elif not row["ok"]:
                row["error"] = "missing instructions"
        else:
            row["ok"] = True
            row["error"] = "loaded from disk cache: SASS not re-checked"
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
    return row


def _row(name: str, kind: str, arch: str | None, error: str | None = None) -> dict:
    """A variant's report row before (or without) its build."""
    return {"name": name, "kind": kind, "arch": arch, "seconds": None, "registers": None,
            "spills": None, "instructions": {}, "ok": False, "error": error}  # fmt: skip


def _report(row: dict, progress: bool) -> dict:
    if progress:
        print(
            f"  {row['name']:<40} {row['seconds']}s regs={row['registers']} "
            f"spills={row['spills']} ok={row['ok']}",
            flush=True,
        )
    return row


def _aux_jobs(arch, head_dims, dtypes):
    """(name, kind, key, build, instructions meant) of the small kernels around the attention
    ones: one split-KV combine per dtype and head_dim_v of the selected head dims, every
    index-check set, and the backward's pre/postprocess per dtype and head-dim pair (dense,
    and packed for each tile_m the backward table uses at that pair)."""
    from .arch.sm90.bwd_tiles import BWD_HEAD_DIMS, bwd_tile_config
    from .arch.sm90.tile_config import SUPPORTED_HEAD_DIMS
    from .bwd_sm90 import _aux_keys, _flat_fields, build_bwd_aux
    from .fwd_sm90 import CombineKey, IndexCheckKey, build_combine, build_index_check

    dvs = sorted({dv for d, dv in SUPPORTED_HEAD_DIMS if not head_dims or d in head_dims})
    for dt, dv in itertools.product(dtypes, dvs):
        key = CombineKey(arch, DTYPE_NAMES[dt], dv)
        # butterfly shuffles reduce max and sum over splits; ACQBULK: the PDL wait
        yield f"sm90_combine dv{dv} {dt}", "sm90_aux", key, build_combine, (
            "SHFL.BFLY", "ACQBULK")  # fmt: skip
    fields = [f.name for f in dataclasses.fields(IndexCheckKey) if f.name != "arch"]
    for present in INDEX_CHECK_SETS:
        key = IndexCheckKey(arch, *(present.get(f, False) for f in fields))
        label = "+".join(f for f in fields if getattr(key, f))
        # a warp vote over the page loop, only where there are pages
        yield f"sm90_index_check {label}", "sm90_aux", key, build_index_check, (
            ("VOTE",) if key.paged else ())  # fmt: skip
    for dt, (d, dv) in itertools.product(dtypes, BWD_HEAD_DIMS):
        if head_dims and d not in head_dims:
            continue
        # the packed forms pad each sequence to the main kernel's tile_m (run_bwd_varlen),
        # and a register-order dQ tile (dq_flat) has a postprocess of its own; the table
        # picks both from (causal, local, softcap, deterministic, group_heads, varlen, short)
        # (and post_overlap a postprocess that waits for the main grid's done counts, pre_overlap
        # a persistent preprocess that counts ready rows; the lse gradient's preprocess builds
        # at its first call)
        forms = set()
        for flags in itertools.product((False, True), repeat=7):
            cfg = bwd_tile_config(d, dv, *flags)
            forms.add(
                (cfg.tile_m if flags[5] else 0, _flat_fields(cfg, d), cfg.post_overlap,
                 cfg.pre_overlap)
            )  # fmt: skip
        keys = {}
        for tm, flat, wait, persistent in sorted(forms):
            for key in _aux_keys(arch, DTYPE_NAMES[dt], d, dv, tm, flat, wait, persistent):
                keys[key] = tm
        for key, tm in keys.items():
            form = f"varlen tile_m {tm}" if tm else "dense"
            if key.dq_flat:
                form += " dq_flat " + "x".join(map(str, key.dq_flat))
            if key.wait_done:
                form += " wait_done"
            if key.persistent:
                form += " pre_overlap"
            # 16-byte vector loads of dO / O (pre) or of the fp32 accumulator (post)
            yield f"sm90_bwd_{key.kind} d{d}x{dv} {dt} {form}", "sm90_aux", key, build_bwd_aux, (
                "LDG.E.128",)  # fmt: skip


# a spawned worker's job list, built at its first task: each worker rebuilds the list from
# the spec (plain values) and runs jobs by index, so no builder needs to pickle
_WORKER_JOBS: dict = {}


def _build_in_worker(spec: tuple, index: int) -> dict:
    if spec not in _WORKER_JOBS:
        _WORKER_JOBS[spec] = _job_list(spec)
    return _build_row(_WORKER_JOBS[spec][index])


def _build_parallel(spec: tuple, jobs: int, progress: bool) -> list[dict]:
    import concurrent.futures
    import multiprocessing

    job_list = _job_list(spec)  # (also checks the spec before any worker starts)
    # one build per distinct key, in the first job that names it; the others get its row
    # under their own names (in one process they would be memory hits of the same object,
    # but two workers would build one key twice, or the second would load it from disk
    # without the cubin the SASS checks need)
    first: dict = {}
    for i, job in enumerate(job_list):
        first.setdefault(job[2], i)
    built: dict[int, dict] = {}
    # spawn, not fork: a forked child of a process that loaded the DSL's MLIR libraries (and
    # their threads) is not safe; each worker imports the DSL once
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(first)), mp_context=ctx) as pool:
        futures = {pool.submit(_build_in_worker, spec, i): i for i in first.values()}
        for fut in concurrent.futures.as_completed(futures):
            i = futures[fut]
            try:
                row = fut.result()
            except Exception as e:  # a worker died (BrokenProcessPool) or could not pickle
                row = _row(*job_list[i][:2], spec[0], f"{type(e).__name__}: {e}"[:2000])
            built[i] = _report(row, progress)
    rows = []
    for i, job in enumerate(job_list):
        j = first[job[2]]
        rows.append(built[i] if i == j else dict(built[j], name=job[0], kind=job[1]))
    return rows
