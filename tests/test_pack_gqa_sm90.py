"""SM90 forward with the query heads of each KV head packed into the tile's rows
(InputFeatures.pack_gqa; GPU tests carry the `gpu` marker): KV-cache decode and speculative
rows (plain, paged, every head dim's decode tile, groups that pad the tile), the dense and
varlen entries, `pack_gqa=True` against the table's rule, and the CPU compile checks of those
variants for sm_90a. The table's rule (tile_config.fwd_pack_gqa) is forced on by the
`pack_gqa_built` fixture where a test covers the kernel rather than the rule.

Every expectation is cute_attn.reference.attention_ref on each sequence's or row's keys with
the FlashAttention tolerance rule (gpu_cases.assert_matches).
    python3 -m pytest tests/test_pack_gqa_sm90.py            (GPU tests skip without an SM90)
"""

from __future__ import annotations

import pytest
import torch
from compile_snippet import run_json_snippet

import cute_attn
from cute_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from cute_attn.reference import attention_ref

from gpu_cases import assert_matches, forced_host_rule, mode_kwargs
from inference_cases import (
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
    packed_refs,
    packed_rows,
    paged_cache,
    per_sequence_ref,
    wide_grid_cache,
)

# ------------------------------------------------------------------ packed GQA rows


@pytest.fixture
def pack_gqa_built(monkeypatch):
    """tile_config.fwd_pack_gqa forced on (the table's rule packs up to 32 query rows;
    forced, every packable call: longer runs too); yields the forward keys built or looked up
    meanwhile. No plan or memo entry outlives the test."""
    with forced_host_rule(
        monkeypatch, "fwd_pack_gqa", lambda seqlen_q, tile_m, group: True
    ) as keys:
        yield keys


# (head dim, H, Hkv, Sq, num_splits, mode): G = 4 / 8 / 16 / 128 query heads a KV head;
# unsplit, the table's splits, fp32 partials and the cluster merge; the causal corner, with a
# left window, softcap and an unbounded window; G x Sq past one tile of rows (40 x 4); G
# larger than the tile (128 heads of MQA: two tiles a position); every head dim's decode tile
PACK_CASES = [
    (128, 8, 2, 4, 0, "causal"), (128, 8, 2, 4, 1, "causal"), (128, 8, 2, 3, 3, "left"),
    (128, 16, 2, 7, 1, "softcap"), (128, 8, 1, 5, 2, "causal"), (64, 32, 8, 2, 0, "causal"),
    (64, 16, 2, 6, 1, "window"), (256, 8, 2, 4, 0, "causal"), (256, 32, 2, 3, 1, "causal"),
    (128, 8, 2, 40, 1, "causal"), (64, 128, 1, 2, 1, "causal"), (96, 8, 2, 4, 2, "causal"),
    (192, 16, 4, 2, 0, "softcap"),
    # groups that do not divide the tile's rows (padded tiles): 7 (Qwen2.5-7B's 28 / 4),
    # 5 with fp32 partials, 6 merged in a cluster under a left window, 3 over two tiles of
    # rows with softcap, 7 at D=256 under an unbounded window
    (128, 28, 4, 3, 0, "causal"), (128, 40, 8, 4, 3, "causal"), (64, 12, 2, 5, 2, "left"),
    (128, 6, 2, 40, 1, "softcap"), (256, 14, 2, 4, 0, "window"),
]  # fmt: skip
PACK_MODES = {
    "causal": {"causal": True},
    "left": {"causal": True, "window_size": (5, None)},
    "softcap": {"causal": True, "softcap": 20.0},
    # flash_attn_with_kvcache defaults to causal=True and the reference to False: say it
    # (without it the API intersected the window with the causal corner and the reference
    # did not, which failed this case in the forty-first session)
    "window": {"causal": False, "window_size": (37, 11)},
}


@pytest.mark.gpu
@pytest.mark.parametrize("d,h,hkv,sq,num_splits,mode", PACK_CASES)
def test_kvcache_pack_gqa_rows(pack_gqa_built, d, h, hkv, sq, num_splits, mode):
    # speculative decoding: Sq new tokens appended at each row's length, then attended with
    # the query heads of each KV head packed into the tile's rows (InputFeatures.pack_gqa).
    # Lengths 0 (only the new keys: under the causal corner the first rows see fewer than
    # Sq), 1, odd, and up to the capacity; unwritten cache rows hold Inf (k) / NaN (v). A
    # read-only repeat through the memo's launcher gives the same bits.
    b, cap, kw = 4, 700, PACK_MODES[mode]
    q, kc, vc = cache_case(b, sq, h, hkv, d, cap, seed=d + h + sq + num_splits)
    g = cuda_gen(sq)
    kn = torch.randn(b, sq, hkv, d, device="cuda", dtype=q.dtype, generator=g)
    vn = torch.randn(b, sq, hkv, d, device="cuda", dtype=q.dtype, generator=g)
    lens_old = [0, 1, 333, cap - sq]
    for i, n_old in enumerate(lens_old):
        kc[i, n_old:] = float("inf")
        vc[i, n_old:] = float("nan")
    n = torch.tensor(lens_old, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=n, num_splits=num_splits,
                                       **kw)  # fmt: skip
    assert cute_attn.last_dispatch().impl == "sm90_fwd"
    assert pack_gqa_built and all(feature_flags(pack_gqa_built, "pack_gqa")), pack_gqa_built
    lens = [x + sq for x in lens_old]
    ref, ref_lse, same = cache_ref(q, kc, vc, range(b), lens, **kw)
    assert_matches(out, lse, ref, ref_lse, same)
    n_new = n + sq
    for _ in range(2):  # the first call builds the memo entry, the second launches through it
        again, lse_again = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n_new,
                                                   num_splits=num_splits, **kw)  # fmt: skip
        assert torch.equal(again, out) and torch.equal(lse_again, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_batch_idx_pack_gqa_rows(pack_gqa_built, num_splits):
    # speculative rows over cache rows picked by cache_batch_idx (out of order, two cache rows
    # unused), packed, unsplit and through fp32 partials: the causal corner, a left window,
    # softcap (test_inference_sm90's batch-index case, whose Sq = 3 packs once the rule does)
    q, kc, vc = cache_case(3, 3, 8, 2, 64, 700, seed=12, b_cache=5)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    lens = [700, 33, 129]
    n = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for kw in ({"causal": True}, {"window_size": (100, 0)}, {"softcap": 20.0, "causal": True}):
        pack_gqa_built.clear()
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, cache_batch_idx=rows,
                                           num_splits=num_splits, **kw)  # fmt: skip
        assert cute_attn.last_dispatch().impl == "sm90_fwd"
        assert pack_gqa_built and all(feature_flags(pack_gqa_built, "pack_gqa")), pack_gqa_built
        ref, ref_lse, same = cache_ref(q, kc, vc, rows.tolist(), lens, **kw)
        assert_matches(out, lse, ref, ref_lse, same)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_kvcache_paged_pack_gqa_rows(pack_gqa_built, page_size):
    # packed rows over a paged cache (one TMA box per key tile of a page), pages shuffled,
    # partial last pages poisoned
    b, h, hkv, d, sq = 4, 16, 4, 128, 3
    g = cuda_gen(300 + page_size)
    max_pages = -(-900 // page_size)
    lens = [0, 1, 517, max_pages * page_size]
    kp, vp, table = paged_cache(b, hkv, d, page_size, max_pages, lens, g)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    n = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=n, page_table=table)
    check_route(page_size)
    assert pack_gqa_built and all(feature_flags(pack_gqa_built, "pack_gqa")), pack_gqa_built
    ks, vs = dense_rows(kp, table, lens), dense_rows(vp, table, lens)
    problems = [(q[i : i + 1], ks[i], vs[i]) for i in range(b)]
    ref, ref_lse, same = (torch.cat(x) for x in zip(*dense_refs(problems, causal=True)))
    assert_matches(out, lse, ref, ref_lse, same)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dense", "batch_idx", "paged64"])
@pytest.mark.parametrize("h,hkv,b", [(32, 8, 17), (28, 4, 34)])
def test_kvcache_pack_gqa_rows_wide_grid(pack_gqa_built, monkeypatch, h, hkv, b, layout):
    # speculative rows (Sq = 4) on an unsplit grid that keeps every SM busy with two CTAs
    # each (136 CTAs: tile_config.fills_two_ctas_per_sm), so packed rows take the decode
    # view's two-CTAs-per-SM tile (tile_config.fwd_pack_gqa_wide): whole tiles (G = 4) and
    # padded ones (G = 7), over lengths 0, 1, odd and full, stale cache rows poisoned
    from cute_attn import fwd_sm90
    from cute_attn.arch.sm90.tile_config import FwdTileConfig, fills_two_ctas_per_sm

    # (the fixture's teardown clears the plans built meanwhile)
    monkeypatch.setattr(fwd_sm90, "fwd_pack_gqa_wide", lambda: True)
    d, sq, cap = 128, 4, 704
    assert fills_two_ctas_per_sm(b * hkv, fwd_sm90._num_sms(None))
    g = cuda_gen(h + b)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    n, kc, vc, cache, ks, vs = wide_grid_cache(b, hkv, d, cap, layout, g, poison=True)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, **cache)
    assert cute_attn.last_dispatch().impl == "sm90_fwd"
    assert all(feature_flags(pack_gqa_built, "pack_gqa")), pack_gqa_built
    assert [FwdTileConfig(*k.tile).ctas_per_sm for k in pack_gqa_built] == [2], pack_gqa_built
    problems = [(q[i : i + 1], ks[i], vs[i]) for i in range(b)]
    ref, ref_lse, same = (torch.cat(x) for x in zip(*dense_refs(problems, causal=True)))
    assert_matches(out, lse, ref, ref_lse, same)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "sq,sk,dtype,kw,heads",
    [(1, 700, torch.bfloat16, {"window_size": (50, None)}, (32, 8)),
     (17, 1000, torch.bfloat16, {"causal": True}, (32, 8)),
     (100, 333, torch.float16, {}, (32, 8)),
     (40, 20, torch.bfloat16, {"causal": True, "window_size": (9, None)}, (32, 8)),
     (17, 1000, torch.bfloat16, {"causal": True}, (28, 4)),
     (100, 333, torch.float16, {"window_size": (20, 30)}, (40, 8))],
)  # fmt: skip
def test_dense_pack_gqa_rows(pack_gqa_built, sq, sk, dtype, kw, heads):
    # flash_attn_func with packed rows: one query row under a left window (the decode view
    # cannot take it), a few rows, several tiles of rows, rows that see no key (Sq > Sk under
    # the causal corner, with a left window), padded tiles (groups of 7 and 5);
    # pack_gqa=False keeps query heads apart
    from gpu_cases import attn_inputs

    q, k, v = attn_inputs(3, sq, sk, *heads, 128, 128, dtype, seed=sq)
    for pack, flag in ((None, True), (False, False)):
        pack_gqa_built.clear()
        out, lse = flash_attn_func(q, k, v, pack_gqa=pack, **kw)
        assert cute_attn.last_dispatch().impl == "sm90_fwd"
        assert feature_flags(pack_gqa_built, "pack_gqa") == [flag], pack_gqa_built
        ref, ref_lse = attention_ref(q, k, v, compute_dtype=torch.float32, **kw)
        same, _ = attention_ref(q, k, v, compute_dtype=None, **kw)
        assert_matches(out, lse, ref, ref_lse, same)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "sq,kw,heads",
    [(4, {"causal": True}, (32, 8)), (6, {"window_size": (40, 3)}, (16, 2)),
     (3, {"causal": True, "softcap": 15.0}, (28, 4))],
)  # fmt: skip
def test_dense_pack_gqa_rows_grads(pack_gqa_built, sq, kw, heads):
    # a few query rows with gradients: the forward packs (its lse is what the backward
    # recomputes from), the backward runs as it does for unpacked rows; every gradient
    # against the fp32 reference with the FlashAttention rule
    from gpu_cases import assert_grads_match, attn_inputs

    q, k, v, dout = attn_inputs(2, sq, 300, *heads, 128, 128, torch.bfloat16, seed=sq,
                                with_dout=True)  # fmt: skip

    def grads(fn, *args):
        args = [t.detach().clone().requires_grad_() for t in args]
        out, _ = fn(*args)
        return torch.autograd.grad((out.float() * dout.float()).sum(), args)

    got = grads(lambda a, b, c: flash_attn_func(a, b, c, **kw), q, k, v)
    assert feature_flags(pack_gqa_built, "pack_gqa") == [True], pack_gqa_built
    assert cute_attn.last_backward_dispatch().impl == "sm90_bwd"
    ref = grads(lambda a, b, c: attention_ref(a, b, c, **kw), *(t.float() for t in (q, k, v)))
    same = grads(lambda a, b, c: attention_ref(a, b, c, compute_dtype=None, **kw), q, k, v)
    assert_grads_match(got, ref, same, q.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,packed", [((32, 8), True), ((8, 1), True), ((28, 4), True)])
def test_pack_gqa_true_asks_for_packed_rows(monkeypatch, heads, packed):
    # pack_gqa=True with the table's rule as it is: speculative rows over a KV cache and
    # through the dense entry pack where packing was timed (Sq <= 32) on whole tiles (G = 4
    # and 8) and padded ones (G = 7) alike (tile_config.fwd_pack_gqa), not for a prefill's
    # 300 rows; dispatch's reason says which, and every call matches the reference
    from cute_attn.arch.sm90 import tile_config

    from gpu_cases import attn_inputs

    h, hkv = heads
    note = "packed into the tile's rows"
    with forced_host_rule(monkeypatch, "fwd_pack_gqa", tile_config.fwd_pack_gqa) as keys:
        b, sq, d, cap = 3, 4, 128, 600
        q, kc, vc = cache_case(b, sq, h, hkv, d, cap, seed=h)
        lens = [5, 301, cap]
        n = torch.tensor(lens, dtype=torch.int32, device="cuda")
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, pack_gqa=True)
        got = cute_attn.last_dispatch()
        assert got.impl == "sm90_fwd" and (note in got.reason) is packed, got
        assert feature_flags(keys, "pack_gqa") == [packed], keys
        ref, ref_lse, same = cache_ref(q, kc, vc, range(b), lens, causal=True)
        assert_matches(out, lse, ref, ref_lse, same)
        for sq, want in ((6, packed), (300, False)):
            keys.clear()
            q, k, v = attn_inputs(2, sq, 500, h, hkv, d, d, torch.bfloat16, seed=h + sq)
            out, lse = flash_attn_func(q, k, v, causal=True, pack_gqa=True)
            got = cute_attn.last_dispatch()
            assert got.impl == "sm90_fwd" and (note in got.reason) is want, (sq, got)
            assert feature_flags(keys, "pack_gqa") == [want], (sq, keys)
            ref, ref_lse = attention_ref(q, k, v, causal=True, compute_dtype=torch.float32)
            same, _ = attention_ref(q, k, v, causal=True, compute_dtype=None)
            assert_matches(out, lse, ref, ref_lse, same)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "d,mode,num_splits,heads",
    [(128, "full", 1, (8, 2)), (128, "causal", 1, (8, 2)), (128, "window", 1, (8, 2)),
     (128, "softcap", 3, (8, 2)), (64, "causal", 3, (8, 2)), (128, "causal", 1, (14, 2)),
     (128, "window", 3, (10, 2))],
)  # fmt: skip
def test_varlen_pack_gqa_rows(pack_gqa_built, d, mode, num_splits, heads):
    # packed sequences (lengths 0, 1, odd, past a tile of rows) with each KV head's query
    # heads packed into the rows: Q loads from each sequence's first row, O stores stop at
    # its last (the ragged view's seq part), so neighbours stay untouched; also padded
    # tiles (groups of 7 and 5, the latter through fp32 partials)
    check_varlen(*heads, d, torch.bfloat16, mode_kwargs(mode), num_splits)
    assert pack_gqa_built and all(feature_flags(pack_gqa_built, "pack_gqa")), pack_gqa_built


@pytest.mark.gpu
def test_varlen_seqused_q_pack_gqa_rows(pack_gqa_built):
    check_seqused_q(3, True)
    assert pack_gqa_built and all(feature_flags(pack_gqa_built, "pack_gqa")), pack_gqa_built


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_varlen_decode_paged_pack_gqa_rows(pack_gqa_built, page_size):
    # decode through the varlen entry as a paged serving engine calls it: one query row a
    # sequence (and a 3-row and an empty one), keys in shuffled pages, lengths from
    # seqused_k, the causal corner
    h, hkv, d = 32, 8, 128
    lens_q, lens_k = [1, 1, 3, 0, 1], [1, 517, 64, 5, 900]
    g = cuda_gen(400 + page_size)
    max_pages = -(-max(lens_k) // page_size) + 1
    kp, vp, table = paged_cache(len(lens_k), hkv, d, page_size, max_pages, lens_k, g)
    q = packed_rows(lens_q, h, d, torch.bfloat16, g)
    n = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_varlen_func(
        q, kp, vp, cu_seqlens_q=cu_lens(lens_q), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
        page_table=table, seqused_k=n, causal=True,
    )  # fmt: skip
    check_route(page_size)
    assert pack_gqa_built and all(feature_flags(pack_gqa_built, "pack_gqa")), pack_gqa_built
    k = torch.cat([x[0] for x in dense_rows(kp, table, lens_k)])
    v = torch.cat([x[0] for x in dense_rows(vp, table, lens_k)])
    ref, ref_lse, same = per_sequence_ref(q, k, v, lens_q, lens_k, causal=True)
    assert_matches(out, lse, ref, ref_lse, same, empty_rows=lambda m: m.transpose(0, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("h,hkv,b", [(32, 8, 17), (28, 4, 34)])
def test_varlen_pack_gqa_rows_wide_grid(pack_gqa_built, monkeypatch, h, hkv, b):
    # a decode batch through the varlen entry (one query row a sequence, some with a few,
    # one empty) on an unsplit grid of 136 CTAs: packed rows on the two-CTAs-per-SM decode
    # tile (tile_config.fwd_pack_gqa_wide), whole tiles (G = 4) and padded ones (G = 7)
    from cute_attn import fwd_sm90
    from cute_attn.arch.sm90.tile_config import FwdTileConfig

    monkeypatch.setattr(fwd_sm90, "fwd_pack_gqa_wide", lambda: True)
    lens_q = [1] * b
    lens_q[1], lens_q[4], lens_q[6] = 4, 0, 3
    lens_k = [(i * 131) % 700 + 4 for i in range(b)]
    lens_k[2] = 1
    check_varlen(h, hkv, 128, torch.bfloat16, {"causal": True}, 0, lens_q, lens_k, seed=b)
    assert all(feature_flags(pack_gqa_built, "pack_gqa")), pack_gqa_built
    assert [FwdTileConfig(*k.tile).ctas_per_sm for k in pack_gqa_built] == [2], pack_gqa_built


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["paged16", "paged64", "used"])
@pytest.mark.parametrize("h,hkv,b", [(32, 8, 17), (28, 4, 34)])
def test_varlen_cache_pack_gqa_rows_wide_grid(pack_gqa_built, monkeypatch, h, hkv, b, layout):
    # a serving engine's decode batch through the varlen entry over a cache: one query row a
    # sequence (a few with 3-4), keys from pages (cu_seqlens_q, seqused_k, page_table) or
    # packed with seqused_k under each span ("used", the stale rows poisoned), on an unsplit
    # 136-CTA grid: packed rows on the two-CTAs-per-SM tile (fwd_sm90._WIDE_PACKED_INPUTS)
    from cute_attn import fwd_sm90
    from cute_attn.arch.sm90.tile_config import FwdTileConfig

    monkeypatch.setattr(fwd_sm90, "fwd_pack_gqa_wide", lambda: True)
    d, cap = 128, 704
    lens_q = [1] * b
    lens_q[1], lens_q[4], lens_q[6] = 4, 3, 4
    g = cuda_gen(h + b + len(layout))
    q = packed_rows(lens_q, h, d, torch.bfloat16, g)
    n, kc, vc, cache, ks, vs = wide_grid_cache(b, hkv, d, cap, layout.replace("used", "dense"),
                                               g, poison=True)  # fmt: skip
    if layout == "used":  # the cache rows back to back, each span cap keys, n of them used
        kc, vc = kc.flatten(0, 1), vc.flatten(0, 1)
        cache = {"cu_seqlens_k": cu_lens([cap] * b)}
    out, lse = flash_attn_varlen_func(
        q, kc, vc, cu_seqlens_q=cu_lens(lens_q), seqused_k=n, max_seqlen_q=max(lens_q),
        max_seqlen_k=cap, causal=True, **cache,
    )  # fmt: skip
    assert cute_attn.last_dispatch().impl == "sm90_fwd"
    assert all(feature_flags(pack_gqa_built, "pack_gqa")), pack_gqa_built
    assert [FwdTileConfig(*k.tile).ctas_per_sm for k in pack_gqa_built] == [2], pack_gqa_built
    starts = cu_lens(lens_q).tolist()
    problems = [(q[None, starts[i] : starts[i + 1]], ks[i], vs[i]) for i in range(b)]
    ref, ref_lse, same = packed_refs(problems, causal=True)
    assert_matches(out, lse, ref, ref_lse, same, empty_rows=lambda m: m.transpose(0, 1))


_PACK_GQA_SNIPPET = r"""
import glob, json, os, re, tempfile
dump = tempfile.mkdtemp()
os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ir", CUTE_DSL_DUMP_DIR=dump)
from cute_attn.aot import _sass
from cute_attn.arch.common.features import InputFeatures as F
from cute_attn.arch.sm90.compile import FwdSpec, compile_fwd
from cute_attn.arch.sm90.tile_config import fwd_tile_config
cache = dict(seqused_k=True, pack_gqa=True)
cases = {  # name: (d, heads, kv heads, left, right, features, page size)
    "cache_causal": (128, 32, 8, False, True, F(**cache), 0),
    "window_partials": (64, 16, 2, True, True, F(split_kv=True, **cache), 0),
    "cluster": (128, 32, 8, False, True, F(split_kv=True, split_cluster=True, **cache), 0),
    "paged": (128, 32, 8, False, True, F(paged_kv=True, **cache), 64),
    "batch_idx_split": (64, 8, 2, True, True, F(kv_batch_idx=True, split_kv=True, **cache), 0),
    "d256": (256, 32, 2, False, True, F(**cache), 0),
    "dense_mqa": (64, 128, 1, False, False, F(pack_gqa=True), 0),
    "varlen": (128, 32, 8, False, True, F(cu_seqlens_q=True, cu_seqlens_k=True, pack_gqa=True), 0),
    "varlen_paged_split": (128, 32, 8, False, True, F(cu_seqlens_q=True, seqused_q=True,
                           seqused_k=True, paged_kv=True, split_kv=True, pack_gqa=True), 64),
    # groups that do not divide the 64 rows: padded tiles (FlashFwdSm90.tile_rows)
    "g7_cache": (128, 28, 4, False, True, F(**cache), 0),
    "g5_partials": (128, 40, 8, False, True, F(split_kv=True, **cache), 0),
    "g6_cluster": (64, 48, 8, False, True, F(split_kv=True, split_cluster=True, **cache), 0),
    "g3_varlen": (128, 6, 2, True, True, F(cu_seqlens_q=True, cu_seqlens_k=True, pack_gqa=True), 0),
}
out = {}
for name, (d, h, hkv, left, right, feats, page) in cases.items():
    for f in glob.glob(os.path.join(dump, "*")):
        os.remove(f)
    cfg = fwd_tile_config(d, d, right and not left, left, True, page)
    spec = FwdSpec("bfloat16", d, d, h, hkv, left, right, False, cfg, feats)
    sass = _sass(compile_fwd(spec, f"--keep-cubin --dump-dir={dump}").__cubin__)
    ir = "".join(open(f).read() for f in glob.glob(os.path.join(dump, "*.mlir")))
    out[name] = {"sass": bool(sass), "spills": sass.count("STL") + sass.count("LDL"),
                 "hgmma": sass.count("HGMMA"), "tma_loads": sass.count("UTMALDG"),
                 "group": h // hkv, "tile_m": cfg.tile_m,
                 "boxes": sorted(set(re.findall(r'tma_gbasis = <"\(([0-9,()]+)\)', ir)))}
print(json.dumps(out))
"""


@pytest.mark.compile
def test_pack_gqa_rows_build(tmp_path):
    # InputFeatures.pack_gqa (off in the table until measured): the KV-cache, windowed split,
    # cluster-merged, paged, cache rows by index (windowed, split), D=256, dense MQA (G = 128
    # > tile_m) and packed-sequence (O stored through the ragged view; paged with split
    # partials) variants, and those of
    # groups that do not divide the tile (7, 5 with split partials, 6 merged in a cluster, 3
    # packed under a window), build spill-free with wgmma and TMA loads, and Q's TMA box
    # spans the packed rows as two dimensions: (G, tile_m // G) query heads x positions, or
    # (tile_m, 1) heads of one position when G > tile_m
    r = run_json_snippet(_PACK_GQA_SNIPPET, tmp_path)
    if not r["cache_causal"]["sass"]:
        pytest.skip("nvdisasm not installed: cannot read SASS")
    for name, v in r.items():
        assert v["spills"] == 0 and v["hgmma"] > 0 and v["tma_loads"] > 0, (name, v)
        g, m = v["group"], v["tile_m"]
        rows = f"{g},{m // g}," if g <= m else f"{m},1,"
        assert any(b.split(",", 1)[1].startswith(rows) for b in v["boxes"]), (name, v)


def test_pack_gqa_rows_kernel_checks():
    # the kernel's own checks (the host never asks for these): a group past the tile's rows
    # that they do not divide (96 over 64; 6 pads the tile), and a persistent grid
    import cutlass

    from cute_attn.arch.common.features import InputFeatures
    from cute_attn.arch.sm90.flash_fwd import FlashFwdSm90
    from cute_attn.arch.sm90.tile_config import fwd_tile_config

    feats = InputFeatures(seqused_k=True, pack_gqa=True)
    decode = fwd_tile_config(128, 128, True, False, True)
    args = (cutlass.BFloat16, 128, 128)
    FlashFwdSm90(*args, 4, False, True, False, decode, feats)
    assert FlashFwdSm90(*args, 6, False, True, False, decode, feats).tile_rows == 60
    with pytest.raises(ValueError, match="96 query heads a KV head vs tile_m 64"):
        FlashFwdSm90(*args, 96, False, True, False, decode, feats)
    persistent = fwd_tile_config(128, 128, False, False, persistent_sms=132)
    with pytest.raises(ValueError, match="persistent"):
        FlashFwdSm90(*args, 4, False, False, False, persistent, InputFeatures(pack_gqa=True))
