"""SM90 forward kernel on the inference paths (GPU, `gpu` marker): packed varlen sequences,
split-KV, flash_attn_with_kvcache over a dense cache (per-row lengths, cache_batch_idx, append,
rotary, query heads packed per KV head at Sq = 1) and paged KV (page sizes 1..256, pages in
shuffled order, poisoned partial pages and spare pages) for both entries. Query heads packed
into the kernel's tile rows (Sq > 1, windows, packed sequences): test_pack_gqa_sm90.py; the
cases and checks both files share: inference_cases.py.

Every expectation is the per-sequence dense reference (cute_attn.reference.attention_ref on
that sequence's rows) with the FlashAttention tolerance rule (gpu_cases.assert_matches).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from compile_snippet import run_json_snippet

import cute_attn
from cute_attn import (
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    reference,
)
from cute_attn.inference import apply_rotary
from cute_attn.reference import attention_ref

from gpu_cases import SWEEP_MODES, assert_matches, forced_host_rule, mode_kwargs
from inference_cases import (
    LENS_K,
    LENS_Q,
    cache_case,
    cache_ref,
    check_route,
    check_seqused_q,
    check_varlen,
    cu_lens,
    cuda_gen,
    dense_refs,
    dense_rows,
    feature_flags,
    packed_rows,
    paged_cache,
    per_sequence_ref,
    run_varlen,
    wide_grid_cache,
)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mode", SWEEP_MODES)
def test_varlen_sweep(mode, d, num_splits):
    check_varlen(6, 2, d, torch.bfloat16, mode_kwargs(mode), num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("h,hkv", [(6, 6), (6, 3), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_varlen_gqa(h, hkv, dtype):
    check_varlen(h, hkv, 128, dtype, {"causal": True, "window_size": (64, None)})


# past D = 128 a sliding window takes tiles of its own (split loops and the keep-bit mask at
# D = 192 and (192, 128), the keep-bit mask at 256), as do the paged and KV-cache variants
# derived from them
LARGE_DIM_MODES = {
    "causal": {"causal": True},
    "window": {"window_size": (50, 7)},
    "causal_window": {"causal": True, "window_size": (64, None)},
}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(LARGE_DIM_MODES))
@pytest.mark.parametrize("d,dv", [(96, 96), (192, 128), (192, 192), (256, 256)])
def test_varlen_other_head_dims(d, dv, mode):
    g = cuda_gen(1)
    q, k = (
        packed_rows(LENS_Q, 4, d, torch.bfloat16, g),
        packed_rows(LENS_K, 2, d, torch.bfloat16, g),
    )
    v = packed_rows(LENS_K, 2, dv, torch.bfloat16, g)
    kw = LARGE_DIM_MODES[mode]
    out, lse = run_varlen(q, k, v, LENS_Q, LENS_K, **kw)
    ref, ref_lse, same = per_sequence_ref(q, k, v, LENS_Q, LENS_K, **kw)
    assert_matches(out, lse, ref, ref_lse, same, empty_rows=lambda m: m.transpose(0, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_varlen_no_leak_between_sequences(num_splits):
    # perturbing sequence i leaves every other sequence's output bitwise unchanged
    lens_q, lens_k = [130, 7, 200, 64], [140, 300, 9, 64]
    q, k, v, out, lse = check_varlen(4, 2, 128, torch.bfloat16, {"causal": True}, num_splits,
                                      lens_q, lens_k)  # fmt: skip
    cq, ck = cu_lens(lens_q).tolist(), cu_lens(lens_k).tolist()
    for i in range(len(lens_q)):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[cq[i] : cq[i + 1]] *= -1.5
        k2[ck[i] : ck[i + 1]] += 1.0
        v2[ck[i] : ck[i + 1]] = float("nan")  # would poison any row that read it
        out2, lse2 = run_varlen(q2, k2, v2, lens_q, lens_k, causal=True, num_splits=num_splits)
        keep = torch.ones(sum(lens_q), dtype=torch.bool, device="cuda")
        keep[cq[i] : cq[i + 1]] = False
        assert torch.equal(out2[keep], out[keep]), f"sequence {i} leaked into others"
        assert torch.equal(lse2[:, keep], lse[:, keep])


@pytest.mark.gpu
def test_varlen_poisoned_outputs_fully_written():
    # out and lse over 1 MiB each: they come from the caching allocator's large pool, where the
    # small temporaries of validation cannot take the poisoned blocks first
    lens_q, lens_k = [0, 40001, 1, 29998], [5, 200, 0, 64]
    g = cuda_gen(3)
    q = packed_rows(lens_q, 4, 128, torch.bfloat16, g)
    k, v = (
        packed_rows(lens_k, 2, 128, torch.bfloat16, g),
        packed_rows(lens_k, 2, 128, torch.bfloat16, g),
    )
    cu_q, cu_k = cu_lens(lens_q), cu_lens(lens_k)
    junk_o = torch.full((1, sum(lens_q), 4, 128), float("nan"), device="cuda", dtype=q.dtype)
    junk_l = torch.full((1, 4, sum(lens_q)), float("nan"), device="cuda")
    ptrs = {junk_o.data_ptr(), junk_l.data_ptr()}
    del junk_o, junk_l
    out, lse = flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=40001, max_seqlen_k=200
    )
    assert {out.data_ptr(), lse.data_ptr()} == ptrs, "poisoned blocks were not reused"
    ref, ref_lse, same = per_sequence_ref(q, k, v, lens_q, lens_k)
    assert_matches(out, lse, ref, ref_lse, same, empty_rows=lambda m: m.transpose(0, 1))


@pytest.mark.gpu
def test_varlen_seqused_k_ignores_poisoned_tail():
    lens_q, lens_k, used = [3, 50, 1], [40, 300, 129], [17, 300, 128]
    g = cuda_gen(4)
    q = packed_rows(lens_q, 4, 64, torch.bfloat16, g)
    k, v = (
        packed_rows(lens_k, 1, 64, torch.bfloat16, g),
        packed_rows(lens_k, 1, 64, torch.bfloat16, g),
    )
    ck = cu_lens(lens_k).tolist()
    for i, u in enumerate(used):  # rows past seqused_k hold NaN / Inf
        k[ck[i] + u : ck[i + 1]] = float("inf")
        v[ck[i] + u : ck[i + 1]] = float("nan")
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    for splits in (1, 3):
        out, lse = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_lens(lens_q), cu_seqlens_k=cu_lens(lens_k), max_seqlen_q=50,
            max_seqlen_k=300, seqused_k=seqused, causal=True, num_splits=splits,
        )  # fmt: skip
        assert cute_attn.last_dispatch().impl == "sm90_fwd"
        kk = torch.cat([k[ck[i] : ck[i] + u] for i, u in enumerate(used)])
        vv = torch.cat([v[ck[i] : ck[i] + u] for i, u in enumerate(used)])
        ref, ref_lse, same = per_sequence_ref(q, kk, vv, lens_q, used, causal=True)
        assert_matches(out, lse, ref, ref_lse, same, empty_rows=lambda m: m.transpose(0, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("with_seqused_k", [False, True])
def test_varlen_seqused_q(num_splits, with_seqused_k):
    check_seqused_q(num_splits, with_seqused_k)


@pytest.mark.gpu
@pytest.mark.parametrize("used", [False, True])
@pytest.mark.parametrize("mode", ["full", "causal", "window"])
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_many_sequences(d, mode, used):
    # more sequences than a warp has lanes (a grid over the packed query tiles would search
    # them 32 a step: docs/perf/varlen_packed_tiles.diff); empty sequences, one row, whole
    # tiles and odd lengths, seqused_q below the spans; outputs over poisoned blocks (each
    # over 1 MiB: from the caching allocator's large pool, see above)
    gen = torch.Generator().manual_seed(d + len(mode) + used)
    lens_q = torch.randint(0, 1500, (75,), generator=gen).tolist()
    lens_q[:8] = [0, 128, 1, 256, 0, 129, 64, 1000]
    lens_k = torch.randint(0, 1500, (75,), generator=gen).tolist()
    lens_k[:8] = [5, 128, 0, 256, 9, 300, 64, 1]
    g = cuda_gen(d)
    q = packed_rows(lens_q, 8, d, torch.bfloat16, g)
    k, v = (
        packed_rows(lens_k, 2, d, torch.bfloat16, g),
        packed_rows(lens_k, 2, d, torch.bfloat16, g),
    )
    kw = dict(cu_seqlens_q=cu_lens(lens_q), cu_seqlens_k=cu_lens(lens_k), **mode_kwargs(mode))
    if used:
        kw["seqused_q"] = torch.tensor([n - n // 3 for n in lens_q], dtype=torch.int32,
                                       device="cuda")  # fmt: skip
    junk_o = torch.full((1, sum(lens_q), 8, d), float("nan"), device="cuda", dtype=q.dtype)
    junk_l = torch.full((1, 8, sum(lens_q)), float("nan"), device="cuda")
    ptrs = {junk_o.data_ptr(), junk_l.data_ptr()}
    del junk_o, junk_l
    out, lse = flash_attn_varlen_func(q, k, v, max_seqlen_q=max(lens_q),
                                      max_seqlen_k=max(lens_k), num_splits=1, **kw)  # fmt: skip
    assert cute_attn.last_dispatch().impl == "sm90_fwd"
    assert {out.data_ptr(), lse.data_ptr()} == ptrs, "poisoned blocks were not reused"
    ref, ref_lse = reference.attention_ref_varlen(q, k, v, compute_dtype=torch.float32, **kw)
    same, _ = reference.attention_ref_varlen(q, k, v, compute_dtype=None, **kw)
    assert_matches(out, lse, ref, ref_lse, same, empty_rows=lambda m: m.transpose(0, 1))


# ------------------------------------------------------------------ dense split-KV


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 2, 7, 64])
@pytest.mark.parametrize("mode", SWEEP_MODES)
def test_dense_split_kv(mode, num_splits):
    """2 splits merge inside a cluster (tile_config.fwd_split_cluster), 7 and 64 through fp32
    partials and the combine kernel."""
    g = cuda_gen(5)
    q = torch.randn(2, 70, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 3000, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 3000, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    kw = mode_kwargs(mode)
    out, lse = flash_attn_func(q, k, v, num_splits=num_splits, **kw)
    assert cute_attn.last_dispatch().impl == "sm90_fwd"
    ref, ref_lse = attention_ref(q, k, v, compute_dtype=torch.float32, **kw)
    same, _ = attention_ref(q, k, v, compute_dtype=None, **kw)
    assert_matches(out, lse, ref, ref_lse, same)


@pytest.fixture
def clusters_up_to_max(monkeypatch):
    """Every split count the kernel can merge in a cluster (MAX_CLUSTER_SPLITS) takes that
    path, not only the table's two splits (plans and the dense memo cleared around it)."""
    from cute_attn import api, fwd_sm90
    from cute_attn.arch.sm90.tile_config import MAX_CLUSTER_SPLITS

    def clear():
        fwd_sm90._plan.cache_clear()
        api._dense_memo.clear()

    rule = fwd_sm90.fwd_split_cluster
    monkeypatch.setattr(
        fwd_sm90, "fwd_split_cluster", lambda n, dv: rule(2, dv) and n <= MAX_CLUSTER_SPLITS
    )
    clear()
    yield
    monkeypatch.undo()
    clear()


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("d", [64, 128, 192])
def test_split_cluster_empty_shares_and_rows(clusters_up_to_max, num_splits, d):
    """Splits merged inside a cluster (2, and 3 / 8 forced) where most splits get no key tile
    (2 key tiles over 3 or 8 splits: their partials are out 0 / lse -inf) and, under the
    bottom-right causal corner with Sq > Sk, rows no split sees (out 0, lse -inf); out over
    a poisoned block."""
    g = cuda_gen(num_splits * 100 + d)
    q = torch.randn(2, 1100, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 200, 2, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 200, 2, d, device="cuda", dtype=torch.bfloat16, generator=g)
    for causal in (False, True):
        # out (>= 1 MiB: the caching allocator's large pool) over a block of NaN
        junk = torch.full((2, 1100, 4, d), float("nan"), device="cuda", dtype=q.dtype)
        ptr = junk.data_ptr()
        del junk
        out, lse = flash_attn_func(q, k, v, causal=causal, num_splits=num_splits)
        assert out.data_ptr() == ptr, "the poisoned block was not reused"
        ref, ref_lse = attention_ref(q, k, v, compute_dtype=torch.float32, causal=causal)
        same, _ = attention_ref(q, k, v, compute_dtype=None, causal=causal)
        assert_matches(out, lse, ref, ref_lse, same)
        if causal:  # rows 0 .. 899 see no key
            assert torch.equal(out[:, :900], torch.zeros_like(out[:, :900]))
            assert bool(torch.isneginf(lse[:, :, :900]).all())


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("case", ["decode", "kvcache", "rows70"])
def test_split_cluster_merge_used_rows(clusters_up_to_max, monkeypatch, case, num_splits):
    """FwdTileConfig.merge_used_rows forced on (off in the table until measured): the merge
    skips the fragment rows past the tile's used query rows. Packed decode (4 of a tile's 64
    rows used), a KV-cache decode with lengths, and 70 query rows (a partial second tile)."""
    from cute_attn import api, fwd_sm90

    table = fwd_sm90.fwd_tile_config
    monkeypatch.setattr(fwd_sm90, "fwd_tile_config",
                        lambda *a, **kw: dataclasses.replace(table(*a, **kw),
                                                             merge_used_rows=True))  # fmt: skip
    fwd_sm90._plan.cache_clear()
    api._dense_memo.clear()
    api._kvcache_memo.clear()
    g = cuda_gen(num_splits + len(case))
    sq, h, hkv, d, sk = (70, 4, 2, 128, 3000) if case == "rows70" else (1, 32, 8, 128, 2500)
    q = torch.randn(3, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(3, sk, hkv, d, device="cuda", dtype=q.dtype, generator=g)
            for _ in range(2))  # fmt: skip
    try:
        if case == "kvcache":
            lens = [1, 1300, sk]
            n = torch.tensor(lens, dtype=torch.int32, device="cuda")
            out, lse = flash_attn_with_kvcache(q, k, v, cache_seqlens=n, num_splits=num_splits)
            ref, ref_lse, same = cache_ref(q, k, v, range(3), lens, causal=True)
        else:
            out, lse = flash_attn_func(q, k, v, causal=True, num_splits=num_splits)
            ref, ref_lse = attention_ref(q, k, v, compute_dtype=torch.float32, causal=True)
            same, _ = attention_ref(q, k, v, compute_dtype=None, causal=True)
    finally:
        fwd_sm90._plan.cache_clear()
        api._dense_memo.clear()
        api._kvcache_memo.clear()
    assert cute_attn.last_dispatch().impl == "sm90_fwd"
    assert_matches(out, lse, ref, ref_lse, same)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 7, 16, 17, 33, 70])
@pytest.mark.parametrize("dv", [64, 128, 256])
def test_split_combine_kernel(splits, dv):
    """The combine kernel alone on random partials: split counts below, at and past one step
    (16 / 8 splits by head_dim_v) and one 32-split chunk, splits that saw no key (lse -inf,
    o 0) and a row no split saw (out 0, lse -inf)."""
    from cute_attn.fwd_sm90 import ARCH, CombineKey, build_combine

    g = cuda_gen(splits * 1000 + dv)
    b, sq, h = 3, 5, 6
    o_part = torch.randn(splits, b, sq, h, dv, device="cuda", generator=g)
    lse_part = 4 * torch.randn(splits, b, h, sq, device="cuda", generator=g)
    empty = torch.rand(splits, b, h, sq, device="cuda", generator=g) < 0.3
    empty[:, 1, 2, 3] = True  # no split saw this row
    lse_part[empty] = float("-inf")
    o_part.masked_fill_(empty.permute(0, 1, 3, 2).unsqueeze(-1), 0.0)
    out = torch.full((b, sq, h, dv), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((b, h, sq), float("nan"), device="cuda")
    build_combine(CombineKey(ARCH, "bfloat16", dv))(o_part, lse_part, out, lse)
    ref_lse = torch.logsumexp(lse_part, dim=0)
    w = torch.exp(lse_part - ref_lse).nan_to_num(0.0)  # (splits, b, h, sq); empty row: 0
    ref = (w.permute(0, 1, 3, 2).unsqueeze(-1) * o_part).sum(0)
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    finite = ~ref_lse.isinf()
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)
    # the kernel sums in fp32 and rounds once to bf16
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    assert torch.equal(out[1, 3, 2], torch.zeros_like(out[1, 3, 2]))


# ------------------------------------------------------------------ KV cache


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 1, 5])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("h,hkv", [(8, 2), (6, 6), (6, 1)])
@pytest.mark.parametrize("new", [0, 1])
def test_kvcache_decode(h, hkv, sq, num_splits, new):
    b, d, s_cache = 4, 128, 1000
    q, kc, vc = cache_case(b, sq, h, hkv, d, s_cache, seed=sq * 10 + hkv)
    lens_old = [0, 1, 517, s_cache - sq * new][:b]
    n = torch.tensor(lens_old, dtype=torch.int32, device="cuda")
    kn = vn = None
    if new:
        g = cuda_gen(7)
        kn = torch.randn(b, sq, hkv, d, device="cuda", dtype=q.dtype, generator=g)
        vn = torch.randn(b, sq, hkv, d, device="cuda", dtype=q.dtype, generator=g)
    for i, n_old in enumerate(lens_old):  # never-written rows hold NaN / Inf
        kc[i, n_old + sq * new :] = float("inf")
        vc[i, n_old + sq * new :] = float("nan")
    kc_ref, vc_ref = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=n, num_splits=num_splits)
    d_ = cute_attn.last_dispatch()
    assert (d_.impl, d_.entry) == ("sm90_fwd", "flash_attn_with_kvcache"), d_
    if new:  # the append wrote exactly the new rows
        for i, n_old in enumerate(lens_old):
            kc_ref[i, n_old : n_old + sq] = kn[i]
            vc_ref[i, n_old : n_old + sq] = vn[i]
        assert torch.equal(kc.nan_to_num(1e4, 1e4), kc_ref.nan_to_num(1e4, 1e4))
        assert torch.equal(vc.nan_to_num(1e4, 1e4), vc_ref.nan_to_num(1e4, 1e4))
    lens = [x + sq * new for x in lens_old]
    ref, ref_lse, same = cache_ref(q, kc, vc, range(b), lens, causal=True)
    assert_matches(out, lse, ref, ref_lse, same)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sq", [1, 3])  # 3: speculative rows (packed where fwd_pack_gqa takes them)
def test_kvcache_batch_idx_window_softcap(sq, num_splits):
    q, kc, vc = cache_case(3, sq, 8, 2, 64, 700, seed=11, b_cache=5)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    lens = [700, 33, 129]
    n = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for kw in ({"causal": True}, {"window_size": (100, 0)}, {"softcap": 20.0, "causal": True}):
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, cache_batch_idx=rows,
                                           num_splits=num_splits, **kw)  # fmt: skip
        assert cute_attn.last_dispatch().impl == "sm90_fwd"
        ref, ref_lse, same = cache_ref(q, kc, vc, rows.tolist(), lens, **kw)
        assert_matches(out, lse, ref, ref_lse, same)


@pytest.fixture
def ragged_cache_built(monkeypatch):
    """tile_config.fwd_ragged_cache forced on (off in the table until measured); yields the
    forward keys built or looked up meanwhile. No plan or memo entry outlives the test."""
    with forced_host_rule(monkeypatch, "fwd_ragged_cache", lambda: True) as keys:
        yield keys


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 1, 2])  # the table's (partials), none, a cluster
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_kvcache_ragged_cache(ragged_cache_built, d, sq, num_splits):
    # V through the ragged view of the cache's flat rows (InputFeatures.ragged_cache): every
    # cache row's keys past its length hold Inf (k) / NaN (v), rows no batch row reads too;
    # lengths 0, 1, odd, a partial last tile and the full capacity; batch rows through a
    # permuted cache_batch_idx into a larger cache, and without it
    b, h, hkv, cap = 4, 8, 2, 700
    q, kc, vc = cache_case(b, sq, h, hkv, d, cap, seed=d + sq + num_splits, b_cache=6)
    lens = [0, 1, 333, cap]
    for c in range(6):  # cache row c holds lens[c % 4] keys (rows 4, 5: nobody's)
        kc[c, lens[c % 4] :] = float("inf")
        vc[c, lens[c % 4] :] = float("nan")
    n = torch.tensor(lens, dtype=torch.int32, device="cuda")
    rows = torch.tensor([4, 1, 2, 3], dtype=torch.int32, device="cuda")  # row 4: no key
    for kw, used in (({"cache_batch_idx": rows}, rows.tolist()), ({}, None)):
        kcs, vcs = (kc, vc) if kw else (kc[:b], vc[:b])  # (B_cache = B without the map)
        ragged_cache_built.clear()
        out, lse = flash_attn_with_kvcache(q, kcs, vcs, cache_seqlens=n, num_splits=num_splits,
                                           **kw)  # fmt: skip
        assert cute_attn.last_dispatch().impl == "sm90_fwd"
        assert all(feature_flags(ragged_cache_built, "ragged_cache")) and ragged_cache_built
        ref, ref_lse, same = cache_ref(q, kcs, vcs, used or range(b), lens, causal=True)
        assert_matches(out, lse, ref, ref_lse, same)


@pytest.mark.gpu
def test_kvcache_ragged_cache_needs_rows_back_to_back(ragged_cache_built):
    # a cache sliced out of a longer one (batch stride != capacity x row stride) keeps the
    # smem zeroing; the memo's later hits of both layouts match the reference
    b, h, hkv, d = 3, 8, 2, 128
    q, kc, vc = cache_case(b, 1, h, hkv, d, 900, seed=5)
    lens = [5, 600, 129]
    n = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for cut, flag in ((900, True), (640, False)):
        ks, vs = kc[:, :cut], vc[:, :cut]
        for i, m in enumerate(lens):
            vs[i, m:] = float("nan")
        for _ in range(2):  # the full path, then the memo's bound launcher
            ragged_cache_built.clear()
            out, lse = flash_attn_with_kvcache(q, ks, vs, cache_seqlens=n)
            assert set(feature_flags(ragged_cache_built, "ragged_cache")) <= {flag}
            ref, ref_lse, same = cache_ref(q, ks, vs, range(b), lens, causal=True)
            assert_matches(out, lse, ref, ref_lse, same)


@pytest.mark.gpu
@pytest.mark.parametrize("new", [0, 1])
def test_kvcache_gathered_pages_ragged_cache(ragged_cache_built, new):
    # pages of 8 fit no TMA key tile: torch gathers them into a dense cache, whose rows lie
    # back to back, so V takes the ragged view there
    test_kvcache_paged(8, 4, new)
    assert any(feature_flags(ragged_cache_built, "ragged_cache"))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 3])
@pytest.mark.parametrize("sq", [1, 5])
@pytest.mark.parametrize("d", [192, 256])
def test_kvcache_windows_large_head_dims(d, sq, num_splits):
    q, kc, vc = cache_case(3, sq, 8, 2, d, 700, seed=d + sq)
    lens = [700, 33, 129]
    n = torch.tensor(lens, dtype=torch.int32, device="cuda")
    # (flash_attn_with_kvcache is causal unless told otherwise)
    for kw in ({"causal": False, "window_size": (100, 0)},
               {"causal": False, "window_size": (40, 3), "softcap": 10.0},
               {"causal": True, "window_size": (300, None)}):  # fmt: skip
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, num_splits=num_splits, **kw)
        assert cute_attn.last_dispatch().impl == "sm90_fwd"
        ref, ref_lse, same = cache_ref(q, kc, vc, range(3), lens, **kw)
        assert_matches(out, lse, ref, ref_lse, same)


@pytest.mark.gpu
def test_kvcache_rotary_append():
    q, kc, vc = cache_case(2, 1, 8, 2, 128, 300, seed=12)
    g = cuda_gen(13)
    kn = torch.randn(2, 1, 2, 128, device="cuda", dtype=q.dtype, generator=g)
    vn = torch.randn(2, 1, 2, 128, device="cuda", dtype=q.dtype, generator=g)
    ang = torch.rand(400, 32, device="cuda", generator=g) * 6.28
    n = torch.tensor([5, 290], dtype=torch.int32, device="cuda")
    kw = dict(rotary_cos=ang.cos().to(q.dtype), rotary_sin=ang.sin().to(q.dtype),
              rotary_interleaved=False)  # fmt: skip
    kc2, vc2 = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=n, **kw)
    assert cute_attn.last_dispatch().impl == "sm90_fwd"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference path on CUDA warns once
        flash_attn_with_kvcache(q, kc2, vc2, kn, vn, cache_seqlens=n, fallback="reference", **kw)
    # both paths rotate and append with the same torch code: identical caches
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    qr = apply_rotary(q, kw["rotary_cos"], kw["rotary_sin"], n.long()[:, None], False)
    ref, ref_lse, same = cache_ref(qr, kc, vc, range(2), (n + 1).tolist(), causal=True)
    assert_matches(out, lse, ref, ref_lse, same)


@pytest.mark.gpu
def test_kvcache_torch_compile_decode_loop():
    # torch.compile(fullgraph=True) around decode steps that rotate, append in place and attend
    # (the custom ops run the kernel): caches and outputs equal the eager calls' (the same
    # kernel on the same inputs), and the last step matches the reference
    q, kc, vc = cache_case(2, 1, 8, 2, 128, 300, seed=14)
    g = cuda_gen(15)
    ang = torch.rand(400, 32, device="cuda", generator=g) * 6.28
    cos, sin = ang.cos().to(q.dtype), ang.sin().to(q.dtype)

    def step(q, kc, vc, kn, vn, n):
        return flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=n, rotary_cos=cos,
                                       rotary_sin=sin)  # fmt: skip

    compiled = torch.compile(step, fullgraph=True)
    ke, ve, kcomp, vcomp = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    n = torch.tensor([5, 290], dtype=torch.int32, device="cuda")
    for t in range(3):
        kn = torch.randn(2, 1, 2, 128, device="cuda", dtype=q.dtype, generator=g)
        vn = torch.randn(2, 1, 2, 128, device="cuda", dtype=q.dtype, generator=g)
        out, lse = step(q, ke, ve, kn, vn, n + t)
        assert cute_attn.last_dispatch().impl == "sm90_fwd"
        got = compiled(q, kcomp, vcomp, kn, vn, n + t)
        assert cute_attn.last_dispatch().impl == "sm90_fwd"
        assert torch.equal(kcomp, ke) and torch.equal(vcomp, ve)
        assert torch.equal(got[0], out) and torch.equal(got[1], lse)
    qr = apply_rotary(q, cos, sin, (n + 2).long()[:, None], True)
    ref, ref_lse, same = cache_ref(qr, ke, ve, range(2), (n + 3).tolist(), causal=True)
    assert_matches(out, lse, ref, ref_lse, same)


@pytest.mark.gpu
def test_kvcache_torch_compile_dynamic_batch(monkeypatch):
    # torch.compile(dynamic=True): one decode step traced with a symbolic batch size appends in
    # place and attends through the SM90 kernels at three batch sizes, equal to eager (the same
    # kernel on the same inputs), and matches the reference
    torch._dynamo.reset()

    def step(q, kc, vc, kn, vn, n):
        return flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=n)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for b in (2, 3, 5):
        q, kc, vc = cache_case(b, 1, 8, 2, 128, 300, seed=20 + b)
        g = cuda_gen(30 + b)
        kn, vn = (torch.randn(b, 1, 2, 128, device="cuda", dtype=q.dtype, generator=g)
                  for _ in range(2))  # fmt: skip
        n = torch.arange(b, dtype=torch.int32, device="cuda") * 71 + 5  # up to 289 of 300
        ke, ve, kcomp, vcomp = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        out, lse = step(q, ke, ve, kn, vn, n)
        assert cute_attn.last_dispatch().impl == "sm90_fwd"
        # cleared, so the compiled call must leave its own record
        monkeypatch.setattr(cute_attn.dispatch._local, "decision", None)
        got = compiled(q, kcomp, vcomp, kn, vn, n)
        assert cute_attn.last_dispatch().impl == "sm90_fwd"
        assert torch.equal(kcomp, ke) and torch.equal(vcomp, ve)
        assert torch.equal(got[0], out) and torch.equal(got[1], lse)
        ref, ref_lse, same = cache_ref(q, ke, ve, range(b), (n + 1).tolist(), causal=True)
        assert_matches(out, lse, ref, ref_lse, same)


# ------------------------------------------------------------------ paged KV

# 1 and 8 fit no TMA key tile (gathered by torch first), 48 cuts the tile to 48 keys, 16 the
# smallest TMA tile, 64 cuts the decode tile, 128 is the tile, 256 holds two tiles per page
PAGE_SIZES = [1, 8, 16, 48, 64, 128, 256]


@pytest.mark.gpu
@pytest.mark.parametrize("new", [0, 1])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_kvcache_paged(page_size, sq, new):
    b, h, hkv, d = 4, 8, 2, 128
    g = cuda_gen(100 + page_size)
    max_pages = -(-1000 // page_size)
    cap = max_pages * page_size
    lens_old = [0, 1, 517, cap - sq * new]
    lens = [n + sq * new for n in lens_old]
    # the rows the append writes start poisoned like any unwritten row
    kp, vp, table = paged_cache(b, hkv, d, page_size, max_pages, lens, g, written=lens_old)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kn = vn = None
    if new:
        kn = torch.randn(b, sq, hkv, d, device="cuda", dtype=q.dtype, generator=g)
        vn = torch.randn(b, sq, hkv, d, device="cuda", dtype=q.dtype, generator=g)
    n = torch.tensor(lens_old, dtype=torch.int32, device="cuda")
    splits = 0 if new else 3
    out, lse = flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=n, page_table=table,
                                       num_splits=splits)  # fmt: skip
    check_route(page_size)
    ks, vs = dense_rows(kp, table, lens), dense_rows(vp, table, lens)
    if new:  # the append landed at positions lens_old[b] .. + sq of row b's pages
        for i, n_old in enumerate(lens_old):
            assert torch.equal(ks[i][0, n_old:], kn[i]) and torch.equal(vs[i][0, n_old:], vn[i])
    problems = [(q[i : i + 1], ks[i], vs[i]) for i in range(b)]
    ref, ref_lse, same = (torch.cat(x) for x in zip(*dense_refs(problems, causal=True)))
    assert_matches(out, lse, ref, ref_lse, same)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("lengths", ["seqused_k", "cu_seqlens_k"])
def test_varlen_paged(page_size, lengths):
    h, hkv, d = 6, 2, 128
    g = cuda_gen(200 + page_size)
    max_pages = -(-max(LENS_K) // page_size) + 1
    kp, vp, table = paged_cache(len(LENS_K), hkv, d, page_size, max_pages, LENS_K, g)
    q = packed_rows(LENS_Q, h, d, torch.bfloat16, g)
    kw = {"seqused_k": torch.tensor(LENS_K, dtype=torch.int32, device="cuda")}
    if lengths == "cu_seqlens_k":
        kw = {"cu_seqlens_k": cu_lens(LENS_K)}
    for mode_kw in ({"causal": True}, {"window_size": (50, 7), "softcap": 10.0}):
        out, lse = flash_attn_varlen_func(
            q, kp, vp, cu_seqlens_q=cu_lens(LENS_Q), max_seqlen_q=max(LENS_Q),
            max_seqlen_k=max(LENS_K), page_table=table, **kw, **mode_kw,
        )  # fmt: skip
        check_route(page_size)
        k = torch.cat([x[0] for x in dense_rows(kp, table, LENS_K)])
        v = torch.cat([x[0] for x in dense_rows(vp, table, LENS_K)])
        ref, ref_lse, same = per_sequence_ref(q, k, v, LENS_Q, LENS_K, **mode_kw)
        assert_matches(out, lse, ref, ref_lse, same, empty_rows=lambda m: m.transpose(0, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("d,dv", [(192, 128), (192, 192), (256, 256)])
def test_paged_windows_large_head_dims(d, dv, page_size):
    # the paged variants past D = 128 derive from the dense table's window tiles: packed
    # prefill over pages and a paged KV-cache decode, each under windows and the causal mask
    h, hkv = 6, 2
    g = cuda_gen(300 + d + dv + page_size)
    max_pages = -(-max(LENS_K) // page_size) + 1
    kp, vp, table = paged_cache(len(LENS_K), hkv, d, page_size, max_pages, LENS_K, g, dv=dv)
    q = packed_rows(LENS_Q, h, d, torch.bfloat16, g)
    k = torch.cat([x[0] for x in dense_rows(kp, table, LENS_K)])
    v = torch.cat([x[0] for x in dense_rows(vp, table, LENS_K)])
    n = torch.tensor(LENS_K, dtype=torch.int32, device="cuda")
    qd = torch.randn(len(LENS_K), 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    for mode_kw in LARGE_DIM_MODES.values():
        mode_kw = {"causal": False, **mode_kw}  # (flash_attn_with_kvcache defaults to causal)
        out, lse = flash_attn_varlen_func(
            q, kp, vp, cu_seqlens_q=cu_lens(LENS_Q), max_seqlen_q=max(LENS_Q),
            max_seqlen_k=max(LENS_K), page_table=table, seqused_k=n, **mode_kw,
        )  # fmt: skip
        check_route(page_size)
        ref, ref_lse, same = per_sequence_ref(q, k, v, LENS_Q, LENS_K, **mode_kw)
        assert_matches(out, lse, ref, ref_lse, same, empty_rows=lambda m: m.transpose(0, 1))
        out, lse = flash_attn_with_kvcache(qd, kp, vp, cache_seqlens=n, page_table=table,
                                           num_splits=2, **mode_kw)  # fmt: skip
        check_route(page_size)
        ks, vs = dense_rows(kp, table, LENS_K), dense_rows(vp, table, LENS_K)
        problems = [(qd[i : i + 1], ks[i], vs[i]) for i in range(len(LENS_K))]
        ref, ref_lse, same = (torch.cat(x) for x in zip(*dense_refs(problems, **mode_kw)))
        assert_matches(out, lse, ref, ref_lse, same)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["paged", "dense", "dense_ragged"])
def test_kvcache_read_only_checks_after_launch(layout, monkeypatch):
    # A read-only call queues its index checks, launches, then reads them (ValueCheck.defer):
    # a bad cache_seqlens / page_table / cache_batch_idx entry must still raise the same
    # ValueError, and the kernel that already ran on it must have stayed inside its tensors
    # (the next valid call, on the same stream, is still exact). dense_ragged: V through the
    # ragged view of the cache's flat rows (fwd_ragged_cache forced), where the kernel clamps
    # a bad cache_batch_idx (that view has no batch bound for the TMA to stop at)
    from cute_attn import api, fwd_sm90, validation

    if layout == "dense_ragged":
        monkeypatch.setattr(fwd_sm90, "fwd_ragged_cache", lambda: True)
        fwd_sm90._plan.cache_clear()
        api._kvcache_memo.clear()

    b, h, hkv, d, page_size = 3, 8, 2, 128, 64
    g = cuda_gen(7)
    lens = [5, 300, 129]
    max_pages = 6
    cap = max_pages * page_size
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    n = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if layout == "paged":
        kc, vc, table = paged_cache(b, hkv, d, page_size, max_pages, lens, g)
        cache = {"page_table": table}
        ks, vs = dense_rows(kc, table, lens), dense_rows(vc, table, lens)
    else:
        kc, vc = (torch.randn(b, cap, hkv, d, device="cuda", dtype=q.dtype, generator=g)
                  for _ in range(2))  # fmt: skip
        cache = {"cache_batch_idx": torch.tensor([2, 0, 1], dtype=torch.int32, device="cuda")}
        ks = [kc[c : c + 1, :n_] for c, n_ in zip((2, 0, 1), lens)]
        vs = [vc[c : c + 1, :n_] for c, n_ in zip((2, 0, 1), lens)]
    deferred = []
    defer = validation.ValueCheck.defer
    monkeypatch.setattr(validation.ValueCheck, "defer",
                        lambda self, fn: (deferred.append(1), defer(self, fn))[1])  # fmt: skip
    bad_lens = n.clone()
    bad_lens[1] = cap + 1000  # past the capacity: the kernel clamps it
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 1384"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=bad_lens, num_splits=2, **cache)
    if layout == "paged":
        bad = table.clone()
        bad[2, 1] = 10**6  # a used entry past the last page: TMA fills zeros
        with pytest.raises(ValueError, match=r"entry \[2, 1\] = 1000000"):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, page_table=bad)
    else:
        bad = cache["cache_batch_idx"].clone()
        bad[0] = -5  # not a cache row: TMA fills zeros (ragged: clamped to row 0)
        with pytest.raises(ValueError, match=r"cache_batch_idx\[0\] = -5"):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, cache_batch_idx=bad)
        bad[0] = 10**6  # past the last cache row (ragged: clamped to the last)
        with pytest.raises(ValueError, match=r"cache_batch_idx\[0\] = 1000000"):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, cache_batch_idx=bad)
    # read-only calls read their checks after the launch
    assert len(deferred) == (2 if layout == "paged" else 3), deferred
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, **cache)
    torch.cuda.synchronize()
    assert cute_attn.last_dispatch().impl == "sm90_fwd"
    problems = [(q[i : i + 1], ks[i], vs[i]) for i in range(b)]
    ref, ref_lse, same = (torch.cat(x) for x in zip(*dense_refs(problems, causal=True)))
    assert_matches(out, lse, ref, ref_lse, same)
    # an append keeps the check before its writes (not deferred)
    kn = torch.randn(b, 1, hkv, d, device="cuda", dtype=q.dtype, generator=g)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=bad_lens, **cache)
    assert len(deferred) == (3 if layout == "paged" else 4)
    fwd_sm90._plan.cache_clear()
    api._kvcache_memo.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("layout", ["dense", "batch_idx", "paged", "paged8"])
def test_kvcache_memo_hit_matches_first_call(layout, num_splits):
    # A read-only call with an earlier call's signature skips validation and dispatch
    # (api._kvcache_memo) and runs the bound launcher (or, for gathered pages, the full
    # kernel path): same output as the first call, the reference for other lengths, and a
    # bad index value still raises through the memo hit.
    from cute_attn import api

    b, h, hkv, d = 3, 8, 2, 128
    page_size = 8 if layout == "paged8" else 64
    g = cuda_gen(31)
    lens, lens2 = [5, 300, 129], [3, 200, 0]
    max_pages = -(-384 // page_size)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    if layout.startswith("paged"):
        kc, vc, table = paged_cache(b, hkv, d, page_size, max_pages, lens, g)
        cache = {"page_table": table}

        def rows_of(ls):
            return dense_rows(kc, table, ls), dense_rows(vc, table, ls)
    else:
        rows = [2, 0, 1] if layout == "batch_idx" else [0, 1, 2]
        kc, vc = (torch.randn(b, 384, hkv, d, device="cuda", dtype=q.dtype, generator=g)
                  for _ in range(2))  # fmt: skip
        cache = {}
        if layout == "batch_idx":
            cache = {"cache_batch_idx": torch.tensor(rows, dtype=torch.int32, device="cuda")}

        def rows_of(ls):
            return ([kc[c : c + 1, :n_] for c, n_ in zip(rows, ls)],
                    [vc[c : c + 1, :n_] for c, n_ in zip(rows, ls)])  # fmt: skip

    def call(qq, lengths, **over):
        n = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        return flash_attn_with_kvcache(qq, kc, vc, cache_seqlens=n, num_splits=num_splits,
                                       **{**cache, **over})  # fmt: skip

    api._kvcache_memo.clear()
    first = call(q, lens)
    assert len(api._kvcache_memo) == 1
    launch = next(iter(api._kvcache_memo.values()))[3]
    assert (launch is None) == (layout == "paged8")  # gathered pages: no bound launcher
    second = call(q.clone(), lens)
    assert len(api._kvcache_memo) == 1
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert cute_attn.last_dispatch().entry == "flash_attn_with_kvcache"
    for ls, (out, lse) in ((lens, second), (lens2, call(q, lens2))):
        ks, vs = rows_of(ls)
        problems = [(q[i : i + 1], ks[i], vs[i]) for i in range(b)]
        ref, ref_lse, same = (torch.cat(x) for x in zip(*dense_refs(problems, causal=True)))
        assert_matches(out, lse, ref, ref_lse, same)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 1000"):
        call(q, [5, 1000, 129])
    assert len(api._kvcache_memo) == 1  # every call above was a hit


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["packed", "paged"])
def test_varlen_memo_hit_matches_first_call(layout):
    # A varlen call with an earlier call's signature skips validation and dispatch
    # (api._varlen_memo): same output as the first call, the reference for other lengths of
    # the same shapes, and a bad index value still raises through the memo hit
    from cute_attn import api

    h, hkv, d = 8, 2, 128
    g = cuda_gen(33)
    lens_q, lens_k, lens_k2 = [1, 4, 0, 2], [5, 300, 129, 7], [150, 150, 1, 140]
    q = packed_rows(lens_q, h, d, torch.bfloat16, g)
    if layout == "paged":
        kc, vc, table = paged_cache(4, hkv, d, 64, 5, [320] * 4, g)
        index = {"page_table": table}

        def keys_of(ls):
            return torch.cat([x[0] for x in dense_rows(kc, table, ls)]), torch.cat(
                [x[0] for x in dense_rows(vc, table, ls)])  # fmt: skip
    else:
        kc, vc = (packed_rows([320] * 4, hkv, d, torch.bfloat16, g) for _ in range(2))
        index = {"cu_seqlens_k": cu_lens([320] * 4)}

        def keys_of(ls):
            rows = torch.cat([torch.arange(b * 320, b * 320 + n) for b, n in enumerate(ls)])
            return kc[rows.cuda()], vc[rows.cuda()]

    def call(ls_k, ls_q=lens_q):
        n = torch.tensor(ls_k, dtype=torch.int32, device="cuda")
        return flash_attn_varlen_func(q, kc, vc, cu_seqlens_q=cu_lens(ls_q), seqused_k=n,
                                      max_seqlen_q=4, max_seqlen_k=320, causal=True,
                                      **index)  # fmt: skip

    api._varlen_memo.clear()
    try:
        first = call(lens_k)
        assert len(api._varlen_memo) == 1
        second = call(lens_k)
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
        assert cute_attn.last_dispatch().entry == "flash_attn_varlen_func"
        for ls, (out, lse) in ((lens_k, second), (lens_k2, call(lens_k2))):
            k, v = keys_of(ls)
            ref, ref_lse, same = per_sequence_ref(q, k, v, lens_q, ls, causal=True)
            assert_matches(out, lse, ref, ref_lse, same, empty_rows=lambda m: m.transpose(0, 1))
        with pytest.raises(ValueError, match="seqused_k"):
            call([5, 321, 129, 7])
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            call(lens_k, [1, 4, 3, -1])
        assert len(api._varlen_memo) == 1  # every call above was a hit
    finally:
        api._varlen_memo.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["used_q_split", "decode_split", "paged_used_q"])
def test_varlen_bound_launcher_matches_reference(case):
    # A memo hit runs the varlen entry's bound launcher (fwd_sm90.varlen_launcher) on what it
    # does besides the launch: rows past seqused_q filled, fp32 split partials and the
    # combine, paged keys. The hit equals the first (full path) call bitwise and matches the
    # reference, with out's memory poisoned before each call.
    from cute_attn import api

    g = cuda_gen(34)
    h, hkv, d, splits = 8, 2, 128, 3
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
    if case == "decode_split":  # one row per sequence over long keys
        lens_q, lens_k, kw = [1, 1, 1, 1], [4096, 5, 3000, 0], {}
    else:
        lens_q, lens_k = [5, 300, 1, 130], [40, 300, 129, 7]
        kw = dict(seqused_q=as_t([2, 257, 0, 130]))
        splits = 3 if case == "used_q_split" else 1
    q = packed_rows(lens_q, h, d, torch.bfloat16, g)
    if case == "paged_used_q":
        k, v, table = paged_cache(4, hkv, d, 64, 5, lens_k, g)
        kw.update(page_table=table, seqused_k=as_t(lens_k))
    else:
        k, v = (packed_rows(lens_k, hkv, d, torch.bfloat16, g) for _ in range(2))
        kw.update(cu_seqlens_k=cu_lens(lens_k))
    kw.update(cu_seqlens_q=cu_lens(lens_q), causal=True)

    def call():
        junk = torch.full((sum(lens_q), h, d), float("nan"), device="cuda", dtype=q.dtype)
        del junk  # its block is free for out: unwritten rows would show as NaN
        return flash_attn_varlen_func(
            q, k, v, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), num_splits=splits, **kw
        )

    api._varlen_memo.clear()
    try:
        first = call()
        (entry,) = api._varlen_memo.values()
        assert entry[3] is not None, "no bound launcher"
        second = call()
        assert len(api._varlen_memo) == 1
    finally:
        api._varlen_memo.clear()
    assert cute_attn.last_dispatch().impl == "sm90_fwd"
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    ref, ref_lse = reference.attention_ref_varlen(q, k, v, compute_dtype=torch.float32, **kw)
    same, _ = reference.attention_ref_varlen(q, k, v, compute_dtype=None, **kw)
    assert_matches(second[0], second[1], ref, ref_lse, same,
                   empty_rows=lambda m: m.transpose(0, 1))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("ragged", [False, True], ids=["table", "ragged"])
@pytest.mark.parametrize("layout", ["dense", "batch_idx", "paged64", "paged16"])
def test_kvcache_decode_wide_grid(layout, ragged, monkeypatch):
    # 17 batch rows x 8 KV heads keep every SM busy unsplit: the two-CTAs-per-SM decode tile
    # (64 keys, 2 stages; tile_config.fills_two_ctas_per_sm), over lengths 0, 1, odd and full.
    # The library takes it for every KV-cache input set (fwd_sm90._WIDE_INPUTS), with V
    # through the ragged view of a dense cache's rows too (`ragged`: fwd_ragged_cache forced)
    from cute_attn import api, fwd_sm90
    from cute_attn.arch.sm90.tile_config import FwdTileConfig, fills_two_ctas_per_sm

    if ragged:
        monkeypatch.setattr(fwd_sm90, "fwd_ragged_cache", lambda: True)
    b, h, hkv, d, cap = 17, 32, 8, 128, 704
    assert fills_two_ctas_per_sm(b * hkv, fwd_sm90._num_sms(None))
    keys, build = [], fwd_sm90.build_fwd
    monkeypatch.setattr(fwd_sm90, "build_fwd", lambda key: (keys.append(key), build(key))[1])
    fwd_sm90._plan.cache_clear()
    api._kvcache_memo.clear()
    g = cuda_gen(41)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    n, kc, vc, cache, ks, vs = wide_grid_cache(b, hkv, d, cap, layout, g)
    try:
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, **cache)
    finally:  # no plan or memo entry of the forced tile outlives the test
        fwd_sm90._plan.cache_clear()
        api._kvcache_memo.clear()
    assert cute_attn.last_dispatch().impl == "sm90_fwd"
    assert [FwdTileConfig(*k.tile).ctas_per_sm for k in keys] == [2], keys  # the wide tile
    problems = [(q[i : i + 1], ks[i], vs[i]) for i in range(b)]
    ref, ref_lse, same = (torch.cat(x) for x in zip(*dense_refs(problems, causal=True)))
    assert_matches(out, lse, ref, ref_lse, same)


@pytest.mark.gpu
def test_kvcache_paged_uniform_length_read_only():
    # an int cache_seqlens with a page table: the device check covers the pages of that
    # length only (entries past them may be -1), a bad used entry still raises
    b, h, hkv, d, page_size, max_pages, n = 2, 8, 2, 128, 64, 8, 300
    g = cuda_gen(21)
    kc, vc, table = paged_cache(b, hkv, d, page_size, max_pages, [n] * b, g)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, page_table=table)
    check_route(page_size)
    ks, vs = dense_rows(kc, table, [n] * b), dense_rows(vc, table, [n] * b)
    problems = [(q[i : i + 1], ks[i], vs[i]) for i in range(b)]
    ref, ref_lse, same = (torch.cat(x) for x in zip(*dense_refs(problems, causal=True)))
    assert_matches(out, lse, ref, ref_lse, same)
    bad = table.clone()
    bad[1, 4] = -3  # page 4 holds keys 256..299: used
    with pytest.raises(ValueError, match=r"entry \[1, 4\] = -3"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, page_table=bad)


@pytest.mark.gpu
def test_index_flags_match_the_rules():
    # the device-side flags of fwd_sm90.index_flags against the rules, row by row (bits:
    # arch/common/index_check.py); entries past a row's used pages are free
    from cute_attn.fwd_sm90 import index_flags

    g = torch.Generator().manual_seed(3)
    b, max_pages, page_size, num_pages = 70, 40, 16, 500
    cap = max_pages * page_size
    lens = torch.randint(-3, cap + 4, (b,), generator=g, dtype=torch.int32)
    table = torch.randint(0, num_pages, (b, max_pages), generator=g, dtype=torch.int32)
    for i in range(0, b, 3):  # some bad entries, used or not
        table[i, torch.randint(0, max_pages, (1,), generator=g)] = (-1) ** i * num_pages
    idx = torch.randint(-2, 9, (b,), generator=g, dtype=torch.int32)

    def bad_pages(lengths):
        used = -(-lengths.clamp(0, cap) // page_size)
        cols = torch.arange(max_pages)[None] < used[:, None]
        return (cols & ((table < 0) | (table >= num_pages))).any(1).int()

    def dev(*ts):
        return tuple(None if t is None else t.cuda() for t in ts)

    # a padded page table (row stride 48), as the kernels accept it
    padded = torch.zeros(b, 48, dtype=torch.int32, device="cuda")[:, :max_pages]
    padded.copy_(table)
    big = 2**31 - 1
    # KV cache: cache_seqlens (bit 0) with pages (bit 2); cache_batch_idx (bit 1)
    got = index_flags(b, (*dev(None, None, None, lens), None, padded), 0, -1, cap, 0, big, 1,
                      page_size, num_pages)  # fmt: skip
    want = ((lens < 0) | (lens > cap)).int() + 4 * bad_pages(lens)
    assert torch.equal(got.cpu(), want)
    got = index_flags(b, dev(None, None, None, None, idx, None), 0, -1, 300, 0, big, 7, 1, 0)
    assert torch.equal(got.cpu(), 2 * ((idx < 0) | (idx >= 7)).int())
    # varlen: cu_seqlens_q (bit 3), cu_seqlens_k (bit 4), seqused_q (bit 5), seqused_k (bit 0)
    span_q = torch.randint(0, 50, (b,), generator=g, dtype=torch.int32)
    span_k = torch.randint(0, 70, (b,), generator=g, dtype=torch.int32)
    span_q[5], span_k[9] = -4, -1  # decreasing cu_seqlens
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int32), span_q.cumsum(0).int()])
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), span_k.cumsum(0).int()])
    cu_q[0] = 1  # first entry not 0
    used_q = torch.randint(-1, 52, (b,), generator=g, dtype=torch.int32)
    used_k = torch.randint(-1, 72, (b,), generator=g, dtype=torch.int32)
    total_q, total_k, max_q, max_k = int(cu_q[-1]), int(cu_k[-1]) + 1, 45, 66
    got = index_flags(b, dev(cu_q, cu_k, used_q, used_k, None, None), total_q, total_k,
                      total_k, max_q, max_k, 0, 1, 0)  # fmt: skip
    sq, sk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    want = 8 * ((sq < 0) | (sq > max_q)).int() + 16 * ((sk < 0) | (sk > max_k)).int()
    want[0] |= 8 * int(cu_q[0] != 0)
    want[-1] |= 16  # cu_seqlens_k's end is not total_k
    want += 32 * ((used_q < 0) | (used_q > sq)).int() + ((used_k < 0) | (used_k > sk)).int()
    assert torch.equal(got.cpu(), want)
    # paged varlen: cu_seqlens_k spans against the capacity, pages of the used keys
    got = index_flags(b, (*dev(None, cu_k, None, None), None, padded), 0, -1, cap, 0, big, 0,
                      page_size, num_pages)  # fmt: skip
    want = 16 * (sk < 0).int() + 4 * bad_pages(sk)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
def test_varlen_checks_after_launch():
    # varlen index checks are read after the launch too: a bad cu_seqlens_q (past total_q,
    # which would move the ragged O store outside out) raises the usual ValueError, and the
    # next valid call is exact (the kernel clamped the bad offsets into its tensors)
    h, hkv, d = 4, 2, 128
    g = cuda_gen(11)
    q, k = (
        packed_rows(LENS_Q, h, d, torch.bfloat16, g),
        packed_rows(LENS_K, hkv, d, torch.bfloat16, g),
    )
    v = packed_rows(LENS_K, hkv, d, torch.bfloat16, g)
    kw = dict(max_seqlen_q=max(LENS_Q), max_seqlen_k=max(LENS_K), causal=True)
    # a canary next to the inputs (best effort: the allocator decides what lies past out)
    guard = torch.full((4096, h, d), 7.0, device="cuda", dtype=torch.bfloat16)
    for bad_q, bad_k, match in (
        ([0, 0, 1, 114, 119, 5000, 658, 660], cu_lens(LENS_K).tolist(), "cu_seqlens_q"),
        (cu_lens(LENS_Q).tolist(), [0, 3, 4, 207, 207, -50, 670], "cu_seqlens_k"),
    ):
        cu_q, cu_k = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (bad_q, bad_k))
        with pytest.raises(ValueError, match=match):
            flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    torch.cuda.synchronize()  # an out-of-bounds access would surface here
    assert bool((guard == 7.0).all())
    out, lse = run_varlen(q, k, v, LENS_Q, LENS_K, causal=True)
    ref, ref_lse, same = per_sequence_ref(q, k, v, LENS_Q, LENS_K, causal=True)
    assert_matches(out, lse, ref, ref_lse, same, empty_rows=lambda m: m.transpose(0, 1))


# ---------------------------------------------------------------- CPU: compile for sm_90a
_COMBINE_SNIPPET = r"""
import json, os, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.arch.sm90.compile import compile_split_combine
from cute_attn.aot import _sass
rows = []
for dt in ("bfloat16", "float16"):
    for dv in (64, 96, 128, 192, 256):
        cubin = compile_split_combine(dt, dv, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}")
        sass = _sass(cubin.__cubin__)
        rows.append({"dtype": dt, "dv": dv, "sass": bool(sass), "shfl": sass.count("SHFL.BFLY"),
                     "bcast": sass.count("SHFL.IDX"), "pdl_wait": "ACQBULK" in sass,
                     "spills": sass.count("STL") + sass.count("LDL")})
print(json.dumps(rows))
"""


_INDEX_CHECK_SNIPPET = r"""
import json, os, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.arch.sm90.compile import compile_index_check
from cute_attn.aot import _sass
rows = []
for present in ({"seqused_k": True, "paged": True}, {"seqused_k": True, "batch_idx": True},
                {"paged": True},
                {"cu_seqlens_q": True, "cu_seqlens_k": True},
                {"cu_seqlens_q": True, "cu_seqlens_k": True, "seqused_q": True,
                 "seqused_k": True, "paged": True}):
    fn = compile_index_check(f"--keep-cubin --dump-dir={tempfile.mkdtemp()}", **present)
    sass = _sass(fn.__cubin__)
    rows.append({"present": present, "sass": bool(sass), "vote": "VOTE" in sass,
                 "spills": sass.count("STL") + sass.count("LDL")})
print(json.dumps(rows))
"""


@pytest.mark.compile
def test_compile_index_check(tmp_path):
    rows = run_json_snippet(_INDEX_CHECK_SNIPPET, tmp_path)
    assert len(rows) == 5
    for r in rows:
        assert r["sass"] and r["spills"] == 0, r
        # the page loop's warp vote, only where there are pages
        assert r["vote"] == r["present"].get("paged", False), r


@pytest.mark.compile
def test_compile_split_combine(tmp_path):
    rows = run_json_snippet(_COMBINE_SNIPPET, tmp_path)
    assert len(rows) == 10
    for r in rows:
        if not r["sass"]:
            pytest.skip("nvdisasm not installed: cannot read SASS")
        # max and sum over the splits reduce by butterfly shuffles; the weights of one step's
        # splits (8 or 16) are broadcast by index shuffles; the PDL launch waits on the split kernel
        # (griddepcontrol.wait is ACQBULK in SASS); nothing spills
        assert r["shfl"] >= 10 and r["bcast"] >= 8 and r["pdl_wait"], r
        assert r["spills"] == 0, r


_V_TAIL_SNIPPET = r"""
import dataclasses, json, os, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.common.features import InputFeatures
from cute_attn.arch.sm90.compile import FwdSpec, compile_fwd
from cute_attn.arch.sm90.tile_config import fwd_tile_config
packed = InputFeatures(cu_seqlens_q=True, cu_seqlens_k=True)
cached = InputFeatures(seqused_k=True)
flat = InputFeatures(seqused_k=True, ragged_cache=True)
flat_idx = InputFeatures(seqused_k=True, kv_batch_idx=True, ragged_cache=True)
out = {}
for name, feats, ragged in (("packed", packed, True), ("packed_clean", packed, False),
                            ("cached", cached, True), ("ragged_cache", flat, True),
                            ("ragged_cache_idx", flat_idx, True)):
    cfg = dataclasses.replace(fwd_tile_config(128, 128, True, False), ragged_v_loads=ragged)
    spec = FwdSpec("bfloat16", 128, 128, 8, 2, False, True, False, cfg, feats)
    fn = compile_fwd(spec, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}")
    sass = _sass(fn.__cubin__)
    out[name] = {"sass": bool(sass), "zero_stores": sass.count("STS.U16"),
                 "spills": sass.count("STL") + sass.count("LDL")}
print(json.dumps(out))
"""


@pytest.mark.compile
def test_packed_v_tail_arrives_as_zeros_from_the_ragged_view(tmp_path):
    # packed k / v (ragged_v_loads, on in the table): V's TMA loads stop at each sequence's
    # last key, so nothing zeroes the last tile's rows past it in smem (the 16-bit stores of
    # FlashFwdSm90._zero_v_tail); with the switch off, and for cached keys (seqused_k: rows
    # past it lie inside the cache row), the consumers still zero them, unless the cache's
    # batch rows are flat rows of one ragged view (InputFeatures.ragged_cache)
    r = run_json_snippet(_V_TAIL_SNIPPET, tmp_path)
    if not r["packed"]["sass"]:
        pytest.skip("nvdisasm not installed: cannot read SASS")
    for name in ("packed", "ragged_cache", "ragged_cache_idx"):
        assert r[name]["zero_stores"] == 0, r
    assert r["packed_clean"]["zero_stores"] > 0 and r["cached"]["zero_stores"] > 0, r
    assert all(v["spills"] == 0 for v in r.values()), r


_MERGE_ROWS_SNIPPET = r"""
import dataclasses, hashlib, json, os, re, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.common.features import InputFeatures
from cute_attn.arch.sm90.compile import FwdSpec, compile_fwd
from cute_attn.arch.sm90.tile_config import fwd_tile_config
feats = InputFeatures(seqused_k=True, split_kv=True, split_cluster=True)
base = fwd_tile_config(128, 128, False, False, decode=True, wide=True)
out = {}
for on in (False, True):
    cfg = dataclasses.replace(base, merge_used_rows=on)
    spec = FwdSpec("bfloat16", 128, 128, 8, 8, False, False, False, cfg, feats)
    sass = _sass(compile_fwd(spec, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}").__cubin__)
    body = "\n".join(re.sub(r"/\*[0-9a-f]+\*/", "", l) for l in sass.splitlines() if "/*" in l)
    out[str(on)] = {"sass": bool(sass), "spills": sass.count("STL") + sass.count("LDL"),
                    "cluster_waits": sass.count("UCGABAR_WAIT"),
                    "hash": hashlib.md5(body.encode()).hexdigest()}
print(json.dumps(out))
"""


@pytest.mark.compile
def test_merge_used_rows_builds(tmp_path):
    # FwdTileConfig.merge_used_rows (off in the table until measured) on the KV-cache split
    # decode variant: spill-free, both cluster barriers kept, and a different kernel
    r = run_json_snippet(_MERGE_ROWS_SNIPPET, tmp_path)
    if not r["True"]["sass"]:
        pytest.skip("nvdisasm not installed: cannot read SASS")
    assert all(v["spills"] == 0 and v["cluster_waits"] >= 2 for v in r.values()), r
    assert r["True"]["hash"] != r["False"]["hash"], r
