"""The device index check against the host's value checks, on the CPU (host_jit.py).

A read-only varlen or KV-cache call queues `IndexCheck` (arch/common/index_check.py) instead
of reading index values before the launch; the host reads its flags afterwards and only when
one is set runs the synchronous checks (cute_attn.validation.ValueCheck). So a value those
checks reject must set a flag, or a bad call would return garbage without an error, and a
valid one must set none, or every call would pay the sync. Here `IndexCheck.row_flags` (the
kernel's per-row rules; its lanes' page reads done by one caller) runs on the host over the
very arguments the host would launch it with (`ValueCheck.index_args`), for valid calls and
for calls with one random bad value each, and its verdict must equal the synchronous checks'.
"""

# no `from __future__ import annotations`: the DSL reads the host function's annotations
import functools
import random

import pytest
import torch
from host_jit import int32, sm90_dsl

from cute_attn.validation import validate_kvcache_deferred, validate_varlen_deferred


@functools.cache
def _flags_fn(present: tuple):
    """Host function (flags, cu_q, cu_k, used_q, used_k, batch_idx, page_table, scalars...)
    for IndexCheck(*present)."""
    sm90_dsl()
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from cute_attn.arch.common.index_check import BAD_PAGE, IndexCheck

    check = IndexCheck(*present)

    @cute.jit
    def flags_of(
        mFlags: cute.Tensor,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mBatchIdx: cute.Tensor | None,
        mPageTable: cute.Tensor | None,
        total_q: Int32,
        total_k: Int32,
        capacity: Int32,
        max_q: Int32,
        max_k: Int32,
        batch_cache: Int32,
        page_size: Int32,
        num_pages: Int32,
    ):
        last = mFlags.shape[0] - 1
        for b in cutlass.range(mFlags.shape[0], unroll=1):
            flags, bad_pages = check.row_flags(
                b, Int32(0), 1, last, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mBatchIdx,
                mPageTable, total_q, total_k, capacity, max_q, max_k, batch_cache, page_size,
                num_pages,
            )  # fmt: skip
            if cutlass.const_expr(check.paged):
                flags = flags | Int32(cutlass.select_(bad_pages != 0, BAD_PAGE, 0))
            mFlags[b] = flags

    return flags_of


def _device_flags(index_args) -> torch.Tensor:
    """What the index check would flag for these arguments (fwd_sm90.index_flags' order)."""
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    batch, tensors, *scalars = index_args
    fn = _flags_fn(tuple(t is not None for t in tensors))
    flags = torch.full((batch,), -1, dtype=torch.int32)
    fn(from_dlpack(flags), *(None if t is None else from_dlpack(t.contiguous()) for t in tensors),
       *(Int32(x) for x in scalars))  # fmt: skip
    return flags


def _host_rejects(check) -> bool:
    try:
        check.wait()
    except ValueError:
        return True
    return False


def _table(rng, lens, page_size, max_pages, num_pages):
    """A page table whose used entries are valid pages and whose unused ones hold junk."""
    t = torch.tensor([[rng.randrange(-5, num_pages + 5) for _ in range(max_pages)]
                      for _ in lens], dtype=torch.int32)  # fmt: skip
    for b, n in enumerate(lens):
        used = -(-n // page_size)
        t[b, :used] = torch.tensor([rng.randrange(num_pages) for _ in range(used)])
    return t


def _varlen_case(rng, kind: str, bad: bool):
    """(kwargs of validate_varlen_deferred, description) for a random packed batch."""
    h, hkv, d, page_size, max_pages, num_pages = 4, 2, 8, 16, 6, 20
    lens_q = [rng.randrange(0, 9) for _ in range(rng.randrange(1, 6))]
    lens_k = [rng.randrange(0, 90) for _ in lens_q]
    cu_q = [0, *torch.tensor(lens_q).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(lens_k).cumsum(0).tolist()]
    used_q = [rng.randrange(0, n + 1) for n in lens_q]
    used_k = [rng.randrange(0, n + 1) for n in lens_k]
    paged = kind == "paged"
    kw = dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), cu_seqlens_k=None,
              seqused_q=None, seqused_k=None, page_table=None)  # fmt: skip
    vals = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    if kind == "used":
        vals.update(seqused_q=used_q, seqused_k=used_k)
    if paged:
        vals = {"cu_seqlens_q": cu_q, "seqused_k": used_k}
        kw["max_seqlen_k"] = max_pages * page_size
    what = "valid"
    if bad:
        name = rng.choice(sorted(vals))
        i = rng.randrange(len(vals[name]))
        delta = rng.choice([-1000, -3, -1, 1, 2, 500])
        vals[name] = list(vals[name])
        vals[name][i] += delta
        what = f"{name}[{i}] {delta:+d}"
    total_q, total_k = cu_q[-1], cu_k[-1]
    q = torch.zeros(total_q, h, d)
    if paged:
        k = torch.zeros(num_pages, page_size, hkv, d)
        kw["page_table"] = _table(rng, used_k, page_size, max_pages, num_pages)
        if bad and rng.random() < 0.5:  # a bad page among the used ones instead
            rows = [b for b, n in enumerate(used_k) if n > 0]
            if rows:
                b = rng.choice(rows)
                kw["page_table"][b, rng.randrange(-(-used_k[b] // page_size))] = rng.choice(
                    [-1, num_pages, 10**6])  # fmt: skip
                vals = {"cu_seqlens_q": cu_q, "seqused_k": used_k}
                what = f"page of row {b}"
    else:
        k = torch.zeros(total_k, hkv, d)
    kw.update({name: int32(v) for name, v in vals.items()})
    return q, k, kw, what


@pytest.mark.parametrize("kind", ["cu", "used", "paged"])
def test_varlen_index_check_agrees_with_the_host_checks(kind):
    rng = random.Random(7)
    seen = {True: 0, False: 0}
    for case in range(120):
        q, k, kw, what = _varlen_case(rng, kind, bad=case % 3 != 0)
        try:
            _, check = validate_varlen_deferred(
                q, k, k, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                num_splits=0, pack_gqa=None, deterministic=False, **kw,
            )  # fmt: skip
        except ValueError:
            continue  # a bad value the static checks already catch (e.g. max_seqlen)
        flagged = bool(_device_flags(check.index_args).any())
        rejected = _host_rejects(check)
        assert flagged == rejected, (kind, case, what, kw)
        seen[rejected] += 1
    assert seen[True] > 20 and seen[False] > 20, seen  # both verdicts exercised


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_index_check_agrees_with_the_host_checks(paged):
    rng = random.Random(11)
    h, hkv, d, cap, page_size, max_pages, num_pages = 4, 2, 8, 64, 16, 5, 12
    seen = {True: 0, False: 0}
    for case in range(120):
        batch = rng.randrange(1, 6)
        bad = case % 3 != 0
        capacity = max_pages * page_size if paged else cap
        seqlens = [rng.randrange(0, capacity + 1) for _ in range(batch)]
        rows = [rng.randrange(0, 7) for _ in range(batch)]
        kw = dict(cache_seqlens=seqlens, cache_batch_idx=None if paged else rows,
                  page_table=None)  # fmt: skip
        if bad:
            name = rng.choice(["cache_seqlens"] if paged else ["cache_seqlens", "cache_batch_idx"])
            i = rng.randrange(batch)
            kw[name] = list(kw[name])
            kw[name][i] += rng.choice([-1000, -1, 1, capacity + 1])
        if paged:
            table = _table(rng, [min(max(n, 0), capacity) for n in kw["cache_seqlens"]],
                           page_size, max_pages, num_pages)  # fmt: skip
            if bad and rng.random() < 0.5:
                kw["cache_seqlens"] = seqlens  # a bad used page instead
                used = [b for b, n in enumerate(seqlens) if n > 0]
                if used:
                    b = rng.choice(used)
                    table[b, rng.randrange(-(-seqlens[b] // page_size))] = num_pages
            kw["page_table"] = table
            kc = torch.zeros(num_pages, page_size, hkv, d)
        else:
            kc = torch.zeros(7, cap, hkv, d)
        kw = {n: int32(v) if isinstance(v, list) else v for n, v in kw.items()}
        q = torch.zeros(batch, 1, h, d)
        _, check = validate_kvcache_deferred(
            q, kc, kc, None, None, rotary_cos=None, rotary_sin=None, softmax_scale=None,
            causal=True, window_size=(None, None), softcap=0.0, num_splits=0, **kw,
        )  # fmt: skip
        flagged = bool(_device_flags(check.index_args).any())
        rejected = _host_rejects(check)
        assert flagged == rejected, (paged, case, kw)
        seen[rejected] += 1
    assert seen[True] > 20 and seen[False] > 20, seen
