"""CPU tests of the SM90 forward tuning table: length bucket, switches (no GPU, no compile)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from cute_attn.arch.common.features import InputFeatures
from cute_attn.arch.sm90.bwd_tiles import (
    BWD_SHORT_ROWS_MAX_SEQLEN,
    BWD_SHORT_ROWS_MAX_SEQLEN_D96,
    BWD_SHORT_ROWS_MAX_SEQLEN_D96_UNMASKED,
    bwd_group_heads,
    bwd_short_rows,
    bwd_tile_config,
)
from cute_attn.arch.sm90.tile_config import (
    PACK_GQA_TIMED_SEQLEN_Q,
    SUPPORTED_HEAD_DIMS,
    FwdTileConfig,
    fills_tall_tiles,
    fills_two_ctas_per_sm,
    fwd_pack_gqa,
    fwd_split_cluster,
    fwd_tile_config,
    paged_tile_n,
)
from cute_attn.fwd_sm90 import tall_rows
from cute_attn.problem import AttnProblem

PLAIN = AttnProblem(
    batch=1, seqlen_q=4096, seqlen_k=4096, num_heads=8, num_heads_kv=8, head_dim=64,
    head_dim_v=64, dtype="bfloat16", device_type="cuda", device_index=0, softmax_scale=0.125,
    causal=False, window_left=-1, window_right=-1, softcap=0.0,
)  # fmt: skip


@pytest.mark.parametrize(
    "sq,tall",
    [(1, False), (384, False), (1024, False), (2000, False), (2048, True), (2500, False),
     (3001, True), (4096, True), (4224, True), (5120, True), (6144, True), (8192, True),
     (8300, True), (16384, True)],
)  # fmt: skip
def test_fills_tall_tiles(sq, tall):
    # >= 2048 rows, padded to 192 by at most 4% more than to 128 (2500: 2688 vs 2560 rows)
    assert fills_tall_tiles(sq) is tall
    # under the causal mask (a right bound) from 4k rows (3k not measured); with a left
    # window bound from 16k rows (at 8k it lost) and only for windows >= 4096 keys wide or
    # open on the right (narrow windows lost at 16k)
    assert fills_tall_tiles(sq, -1, 0) is (tall and sq >= 4096)
    assert fills_tall_tiles(sq, -1, 37) is (tall and sq >= 4096)
    for left, right in ((4096, 0), (4000, 96), (100, -1), (0, 1 << 20)):
        assert fills_tall_tiles(sq, left, right) is (tall and sq >= 16384)
    for left, right in ((4095, 0), (2048, 0), (37, 11), (0, 0), (511, 1)):
        assert not fills_tall_tiles(sq, left, right)


def test_tall_only_changes_d64():
    for causal, local in ((False, False), (True, False), (False, True)):
        tall = fwd_tile_config(64, 64, causal, local, tall=True)
        assert (tall.tile_m, tall.num_mma_warpgroups, tall.intra_wg_overlap) == (192, 3, True)
        short = fwd_tile_config(64, 64, causal, local)
        assert (short.tile_m, short.num_mma_warpgroups, short.ctas_per_sm) == (64, 1, 2)
        # same key tile: fwd_sm90.paged_route decides the paged route without the bucket
        assert tall.tile_n == fwd_tile_config(64, 64, causal, local).tile_n
        for d, dv in ((96, 96), (128, 128), (192, 128), (256, 256)):
            assert fwd_tile_config(d, dv, causal, local, tall=True) == fwd_tile_config(
                d, dv, causal, local
            )
    # the packed decode layout keeps its own tile whatever the bucket says
    assert fwd_tile_config(64, 64, False, False, decode=True, tall=True).tile_m == 64


@pytest.mark.parametrize(
    "batch,wide",
    [(8, False), (16, False), (17, True), (24, True), (33, True), (40, False), (48, False),
     (64, True), (128, True)],
)  # fmt: skip
def test_fills_two_ctas_per_sm(batch, wide):
    # 8 KV heads on 132 SMs: every SM busy, and the last two-CTA wave no emptier than the last
    # one-CTA wave (B=48: 384 CTAs, 528 two-CTA slots vs 396 one-CTA slots)
    assert fills_two_ctas_per_sm(batch * 8, 132) is wide


def test_wide_only_changes_d128_decode():
    wide = fwd_tile_config(128, 128, False, False, decode=True, wide=True)
    assert (wide.tile_m, wide.tile_n, wide.num_stages, wide.ctas_per_sm) == (64, 64, 2, 2)
    assert fwd_tile_config(128, 128, False, False, decode=True).ctas_per_sm == 1
    for d, dv in ((64, 64), (96, 96), (192, 128), (256, 256)):
        assert fwd_tile_config(d, dv, False, False, decode=True, wide=True) == fwd_tile_config(
            d, dv, False, False, decode=True
        )
    for d in (64, 128):  # dense tiles ignore the bucket
        assert fwd_tile_config(d, d, True, False, wide=True) == fwd_tile_config(d, d, True, False)
    # the paged route (fwd_sm90.paged_route asks the default tile): the same for either tile
    default = fwd_tile_config(128, 128, False, False, decode=True)
    for page in (1, 8, 16, 48, 64, 80, 128, 200, 256, 1024):
        assert (paged_tile_n(default.tile_n, page) is None) == (
            paged_tile_n(wide.tile_n, page) is None
        )


def test_plan_takes_wide_tile_for_split_and_full_decode_grids(monkeypatch):
    # _plan: packed decode, split, or unsplit on a grid that fills two CTAs per SM -> the
    # wide tile (B=8 Sk=8k: the table splits it in two)
    from cute_attn import fwd_sm90

    built = []
    monkeypatch.setattr(fwd_sm90, "build_fwd", lambda key: built.append(key) or key)
    monkeypatch.setattr(fwd_sm90, "build_combine", lambda key: key)
    monkeypatch.setattr(fwd_sm90, "_num_sms", lambda index: 132)
    fwd_sm90._plan.cache_clear()
    wide_tile = dataclasses.astuple(fwd_tile_config(128, 128, False, False, True, wide=True))
    cases = ((64, 0, True), (48, 0, False), (8, 0, True), (8, 1, False), (64, 2, True))
    for batch, splits, wide in cases:
        p = AttnProblem(
            batch=batch, seqlen_q=1, seqlen_k=8192, num_heads=32, num_heads_kv=8, head_dim=128,
            head_dim_v=128, dtype="bfloat16", device_type="cuda", device_index=0,
            softmax_scale=0.1, causal=True, window_left=-1, window_right=0, softcap=0.0,
            num_splits=splits,
        )  # fmt: skip
        # dense and KV-cache inputs alike (fwd_sm90._WIDE_INPUTS)
        for feats in (InputFeatures(), InputFeatures(seqused_k=True),
                      InputFeatures(seqused_k=True, kv_batch_idx=True)):  # fmt: skip
            plan = fwd_sm90._plan(p, feats, batch, 1, 8192, True, 0)
            assert (plan.fn.tile == wide_tile) is wide, (batch, splits, feats)
        paged = dataclasses.replace(p, paged=True, page_size=128)
        plan = fwd_sm90._plan(paged, InputFeatures(seqused_k=True, paged_kv=True), batch, 1,
                              8192, True, 0)  # fmt: skip
        assert (FwdTileConfig(*plan.fn.tile).ctas_per_sm == 2) is wide, (batch, splits)
    fwd_sm90._plan.cache_clear()


def test_split_cluster_rule_and_plans(monkeypatch):
    # two splits merge in a cluster (no combine, final out / lse), other counts and Dv = 256
    # through fp32 partials and the combine (tile_config.fwd_split_cluster)
    from cute_attn import fwd_sm90

    assert fwd_split_cluster(2, 128) and fwd_split_cluster(2, 192)
    assert not any(fwd_split_cluster(n, 128) for n in (1, 3, 4, 8, 16))
    assert not fwd_split_cluster(2, 256)
    with pytest.raises(ValueError, match="needs split_kv"):
        InputFeatures(split_cluster=True)
    assert not InputFeatures(split_kv=True, split_cluster=True).partials
    assert InputFeatures(split_kv=True).partials

    monkeypatch.setattr(fwd_sm90, "build_fwd", lambda key: key)
    monkeypatch.setattr(fwd_sm90, "build_combine", lambda key: key)
    monkeypatch.setattr(fwd_sm90, "_num_sms", lambda index: 132)
    fwd_sm90._plan.cache_clear()
    for d, splits, cluster in ((128, 2, True), (128, 0, True), (128, 3, False), (256, 2, False)):
        p = AttnProblem(
            batch=8, seqlen_q=1, seqlen_k=8192, num_heads=32, num_heads_kv=8, head_dim=d,
            head_dim_v=d, dtype="bfloat16", device_type="cuda", device_index=0,
            softmax_scale=0.1, causal=True, window_left=-1, window_right=0, softcap=0.0,
            num_splits=splits,
        )  # fmt: skip
        plan = fwd_sm90._plan(p, InputFeatures(seqused_k=True), 8, 1, 8192, True, 0)
        feats = InputFeatures(*plan.fn.features)
        assert plan.splits > 1 and feats.split_kv, (d, splits)
        assert feats.split_cluster is cluster and plan.partials is not cluster, (d, splits)
        assert (plan.combine is None) is cluster, (d, splits)
    fwd_sm90._plan.cache_clear()


def test_pack_gqa_rule_takes_timed_rows_on_whole_and_padded_tiles():
    # up to PACK_GQA_TIMED_SEQLEN_Q query rows: every tile the kernel packs (G dividing the
    # tile's rows or a multiple of them, and padded tiles: G = 3, 5, 6, 7); neither G = 96
    # (past a tile, not a multiple of it) nor past the timed rows
    for tile_m, group, rule in (
        (64, 2, True), (64, 4, True), (64, 8, True), (64, 64, True), (64, 128, True),
        (128, 16, True), (64, 3, True), (64, 7, True), (128, 5, True), (64, 96, False),
    ):  # fmt: skip
        for sq in (1, 2, 16, PACK_GQA_TIMED_SEQLEN_Q):
            assert fwd_pack_gqa(sq, tile_m, group) is rule, (sq, tile_m, group)
        for sq in (PACK_GQA_TIMED_SEQLEN_Q + 1, 4096):
            assert not fwd_pack_gqa(sq, tile_m, group)


def test_plan_packs_gqa_rows_where_the_rule_takes_them(monkeypatch):
    # fwd_sm90._pack_gqa_rows / _plan: with tile_config.fwd_pack_gqa forced on, the GQA calls
    # the Sq = 1 host view does not pack (more query rows, a left window, packed sequences)
    # build InputFeatures.pack_gqa on the decode tile, over G x Sq rows of the KV heads
    # (groups that do not divide its rows too: the kernel pads the tile); groups past a tile
    # that it does not divide, MHA and pack_gqa=False stay unpacked.
    from cute_attn import fwd_sm90

    monkeypatch.setattr(fwd_sm90, "build_fwd", lambda key: key)
    monkeypatch.setattr(fwd_sm90, "build_combine", lambda key: key)
    monkeypatch.setattr(fwd_sm90, "_num_sms", lambda index: 132)
    cache = InputFeatures(seqused_k=True)

    def problem(sq, h, hkv, left=-1, pack=None, d=128, varlen=False):
        return AttnProblem(
            batch=2, seqlen_q=sq, seqlen_k=1000, num_heads=h, num_heads_kv=hkv, head_dim=d,
            head_dim_v=d, dtype="bfloat16", device_type="cuda", device_index=0,
            softmax_scale=0.1, causal=True, window_left=left, window_right=0, softcap=0.0,
            kvcache=not varlen, varlen=varlen, pack_gqa=pack,
        )  # fmt: skip

    # the table's rule under None and True packs where packing was timed (Sq <= 32), on
    # whole tiles (G divides the decode tile's rows or is a multiple of them) and padded ones
    # (G = 7, 5); False never does
    for sq, h, hkv, rule in (
        (4, 32, 8, True), (32, 32, 8, True), (33, 32, 8, False), (4096, 32, 8, False),
        (2, 128, 1, True), (4, 28, 4, True), (4, 40, 8, True), (4, 96, 1, False),
    ):  # fmt: skip
        assert fwd_sm90._pack_gqa_rows(problem(sq, h, hkv, pack=True), sq) is rule, (sq, h)
        assert fwd_sm90._pack_gqa_rows(problem(sq, h, hkv), sq) is rule, (sq, h)
        assert not fwd_sm90._pack_gqa_rows(problem(sq, h, hkv, pack=False), sq)
    p = problem(4, 32, 8, pack=True)
    plan = fwd_sm90._plan(p, cache, 2, 4, 1000, False, 0)
    assert InputFeatures(*plan.fn.features).pack_gqa and plan.scalars[4] == 16
    monkeypatch.setattr(fwd_sm90, "fwd_pack_gqa", lambda seqlen_q, tile_m, group: True)
    fwd_sm90._plan.cache_clear()
    cases = [  # (Sq, H, Hkv, left, pack_gqa, packed in the kernel)
        (4, 32, 8, -1, None, True), (4, 32, 8, -1, True, True), (4, 32, 8, -1, False, False),
        (1, 32, 8, -1, None, False),  # the decode view packs it (no kernel feature)
        (1, 32, 8, 100, None, True), (7, 16, 2, 5, None, True), (3, 128, 1, -1, None, True),
        (4, 8, 8, -1, None, False),  # MHA
        (4, 12, 2, -1, None, True),  # G = 6: 10 positions a 64-row tile, 4 rows padding
        (2, 28, 4, -1, None, True),  # G = 7 (Qwen2.5-7B's heads): 9 positions, 1 row
        (4, 96, 1, -1, None, False),  # G = 96: more than a tile, not a multiple of it
    ]  # fmt: skip
    for sq, h, hkv, left, pack, packed in cases:
        p = problem(sq, h, hkv, left, pack)
        assert fwd_sm90._pack_gqa_rows(p, sq) is packed, (sq, h, hkv, left, pack)
        plan = fwd_sm90._plan(p, cache, 2, sq, 1000, fwd_sm90._pack_decode(p, sq), 0)
        feats = InputFeatures(*plan.fn.features)
        assert feats.pack_gqa is packed and plan.group == (
            1 if packed or sq > 1 or left >= 0 else h // hkv
        ), (sq, h, hkv, left)
        if packed:  # the decode tile, the grid's rows G x Sq, the key's heads unchanged
            decode = fwd_tile_config(128, 128, True, left >= 0, True)
            assert FwdTileConfig(*plan.fn.tile).tile_m == decode.tile_m
            assert plan.scalars[4] == h // hkv * sq
            assert (plan.fn.num_heads, plan.fn.num_heads_kv) == (h, hkv)
    # packed sequences, one query row each included (no decode view there): G x the longest
    # sequence's rows
    packed_q = InputFeatures(cu_seqlens_q=True, cu_seqlens_k=True)
    for sq in (1, 5):
        p = problem(sq, 32, 8, varlen=True)
        assert fwd_sm90._pack_gqa_rows(p, sq)
        plan = fwd_sm90._plan(p, packed_q, 6, sq, 1000, False, 0)
        assert InputFeatures(*plan.fn.features).pack_gqa and plan.scalars[4] == 4 * sq
    fwd_sm90._plan.cache_clear()


def test_plan_packed_rows_take_the_wide_tile_where_the_rule_does(monkeypatch):
    # _plan: in-kernel packed GQA rows take the two-CTAs-per-SM decode tile (D=128) where
    # tile_config.fwd_pack_gqa_wide says so, in the decode view's buckets (split grids, and
    # unsplit grids that fill two CTAs an SM, counting a padded group's fewer rows a tile)
    # and over its inputs plus packed sequences; never where the rule says no
    from cute_attn import fwd_sm90

    monkeypatch.setattr(fwd_sm90, "build_fwd", lambda key: key)
    monkeypatch.setattr(fwd_sm90, "build_combine", lambda key: key)
    monkeypatch.setattr(fwd_sm90, "_num_sms", lambda index: 132)
    monkeypatch.setattr(fwd_sm90, "fwd_pack_gqa", lambda seqlen_q, tile_m, group: True)
    cache = InputFeatures(seqused_k=True)
    paged = InputFeatures(seqused_k=True, paged_kv=True)
    packed_q = InputFeatures(cu_seqlens_q=True, cu_seqlens_k=True)
    used_q = InputFeatures(cu_seqlens_q=True, cu_seqlens_k=True, seqused_q=True)

    def ctas_per_sm(rule, feats, b, sq, h, hkv, d=128):
        monkeypatch.setattr(fwd_sm90, "fwd_pack_gqa_wide", lambda: rule)
        fwd_sm90._plan.cache_clear()
        p = AttnProblem(
            batch=b, seqlen_q=sq, seqlen_k=8192, num_heads=h, num_heads_kv=hkv, head_dim=d,
            head_dim_v=d, dtype="bfloat16", device_type="cuda", device_index=0,
            softmax_scale=0.1, causal=True, window_left=-1, window_right=0, softcap=0.0,
            kvcache=not feats.cu_seqlens_q, varlen=feats.cu_seqlens_q,
            paged=feats.paged_kv, page_size=64 if feats.paged_kv else 0,
        )  # fmt: skip
        plan = fwd_sm90._plan(p, feats, b, sq, 8192, False, 0)
        assert InputFeatures(*plan.fn.features).pack_gqa
        return FwdTileConfig(*plan.fn.tile).ctas_per_sm

    for feats, b, sq, h, hkv, wide in (
        (cache, 64, 4, 32, 8, True),  # 512 CTAs, unsplit: fills two a SM
        (cache, 8, 4, 32, 8, True),  # 64 CTAs: split
        (paged, 64, 4, 32, 8, True),
        (cache, 17, 4, 32, 8, True),  # 136 CTAs
        (cache, 34, 4, 28, 4, True),  # G = 7: 9 positions a tile, 136 CTAs
        (cache, 34, 16, 28, 4, False),  # 112 rows: 2 tiles, 272 CTAs (a worse last wave)
        (packed_q, 17, 1, 32, 8, True),
        (used_q, 17, 1, 32, 8, False),  # not among the inputs
    ):  # fmt: skip
        assert ctas_per_sm(True, feats, b, sq, h, hkv) == (2 if wide else 1), (feats, b, sq, h)
        assert ctas_per_sm(False, feats, b, sq, h, hkv) == 1, (feats, b, sq, h)
    assert ctas_per_sm(True, cache, 64, 4, 32, 8, d=64) == 1  # the wide tile is D=128's
    fwd_sm90._plan.cache_clear()


def test_num_splits_counts_a_padded_groups_tiles():
    # the split count sees the grid the kernel launches: 192 packed rows of G = 6 (Sq = 32)
    # take four 60-row tiles (ten positions each), not three of 64; 11 KV heads, B=1, 8k keys
    from cute_attn import fwd_sm90

    args = (0, 128, 128, True, False, True, 0, 1, 192, 11, 8192, 132)
    assert fwd_sm90._num_splits(*args) == 4  # 33 CTAs unsplit: 4 splits fill the SMs
    assert fwd_sm90._num_splits(*args, False, 6) == 3  # 44 CTAs: 3
    assert fwd_sm90._num_splits(*args, False, 4) == 4  # G = 4 tiles 64 rows: as unpacked


def test_plan_takes_persistent_grid_in_its_bucket(monkeypatch):
    # _plan: dense, unsplit calls in tile_config.fwd_persistent's bucket get a persistent grid
    # of one wave on this device (132 SMs; two CTAs an SM for the 64-row D=64 tile); split,
    # packed and decode calls, and windows outside the bucket, keep one CTA per tile
    from cute_attn import fwd_sm90

    monkeypatch.setattr(fwd_sm90, "build_fwd", lambda key: key)
    monkeypatch.setattr(fwd_sm90, "build_combine", lambda key: key)
    monkeypatch.setattr(fwd_sm90, "_num_sms", lambda index: 132)
    fwd_sm90._plan.cache_clear()

    def ctas(d, sq, sk, causal=False, splits=0, feats=None, b=4, h=16, left=-1, right=-1):
        p = AttnProblem(
            batch=b, seqlen_q=sq, seqlen_k=sk, num_heads=h, num_heads_kv=h, head_dim=d,
            head_dim_v=d, dtype="bfloat16", device_type="cuda", device_index=0,
            softmax_scale=0.1, causal=causal, window_left=left,
            window_right=0 if causal else right, softcap=0.0, num_splits=splits,
        )  # fmt: skip
        plan = fwd_sm90._plan(p, feats or InputFeatures(), b, sq, sk, False, 0)
        return FwdTileConfig(*plan.fn.tile).persistent_ctas

    try:
        assert ctas(128, 4096, 4096) == 132 and ctas(128, 8192, 8192) == 132
        assert ctas(128, 16384, 16384) == 0 and ctas(96, 4096, 16384) == 0
        assert ctas(64, 1024, 1024) == 264 and ctas(64, 16384, 16384) == 132  # the tall tile
        assert ctas(256, 1024, 1024) == 0 and ctas(128, 4096, 4096, causal=True) == 132
        assert ctas(128, 16384, 16384, causal=True) == 0 and ctas(96, 8192, 8192, causal=True)
        assert ctas(64, 2048, 2048, causal=True) == 264 and ctas(64, 4096, 4096, causal=True) == 0
        assert ctas(256, 1024, 1024, causal=True) == 0
        # sliding windows at D=96 / 128, any length; at D=64 up to 512 keys wide; not a left
        # bound alone
        assert ctas(128, 16384, 16384, causal=True, left=4096) == 132
        assert ctas(96, 16384, 16384, left=100, right=7) == 132
        assert ctas(64, 8192, 8192, causal=True, left=512) == 264
        assert ctas(64, 8192, 8192, left=500, right=13) == 0
        # at 16k a window this narrow keeps the 64-row tile (fills_tall_tiles), persistent
        assert ctas(64, 16384, 16384, causal=True, left=512) == 264
        assert ctas(64, 16384, 16384, causal=True, left=4096) == 0  # the tall tile
        assert ctas(128, 4096, 4096, left=1024) == 0
        assert ctas(128, 4096, 4096, splits=2) == 0  # split partials
        assert ctas(128, 64, 8192, b=1, h=2) == 0  # a grid of 2 CTAs splits the keys
        assert ctas(128, 4096, 4096, feats=InputFeatures(seqused_k=True)) == 0
    finally:
        fwd_sm90._plan.cache_clear()


def test_tall_rows_only_for_dense_query_rows():
    dense, packed = InputFeatures(), InputFeatures(cu_seqlens_q=True, cu_seqlens_k=True)
    assert tall_rows(PLAIN, dense, False, 4096)
    assert not tall_rows(PLAIN, dense, True, 4096)  # packed decode view
    assert not tall_rows(PLAIN, packed, False, 4096)  # varlen: each sequence pads its last tile
    assert not tall_rows(PLAIN, dense, False, 1024)
    assert tall_rows(PLAIN, InputFeatures(seqused_k=True, split_kv=True), False, 4096)
    causal = dataclasses.replace(PLAIN, causal=True, window_right=0)
    assert not tall_rows(causal, dense, False, 3072)
    assert tall_rows(causal, dense, False, 4096)
    assert tall_rows(causal, dense, False, 16384)
    window = dataclasses.replace(PLAIN, window_left=100)
    assert not tall_rows(window, dense, False, 4096)


def test_pin_pv_wait_where_measured():
    # D=64 holds the PV wait with an anchor on 2 probabilities (64-row tile) or 4 (192-row
    # tile, with row_max_form 2), next to the split loops (tune_fwd_d64_split*_h200.json,
    # tune_fwd_rowmax_*_h200.json); D=96 / 128 with an anchor on 4
    # (tune_fwd_anchor_k*_h200.json), D=256 too under the causal mask
    # (tune_fwd_d256_anchor_h200.json), D=192 without a window (tune_fwd_interleave_a4_h200.json);
    # off for D=192 windows, D=256 without a causal mask and packed decode, where it lost or
    # was not measured
    from cute_attn.arch.sm90.tile_config import FwdTileConfig

    for causal, local in ((False, False), (True, False), (False, True)):
        for tall, k in ((False, 2), (True, 4)):
            cfg = fwd_tile_config(64, 64, causal, local, tall=tall)
            assert cfg.pin_pv_wait and cfg.pin_pv_anchor == k
        for d in (96, 128):
            cfg = fwd_tile_config(d, d, causal, local)
            assert cfg.pin_pv_wait and cfg.pin_pv_anchor == 4
        for d, dv in ((192, 192), (192, 128)):
            cfg = fwd_tile_config(d, dv, causal, local)
            assert cfg.pin_pv_wait != local and cfg.pin_pv_anchor == (0 if local else 4)
        cfg = fwd_tile_config(256, 256, causal, local)
        assert cfg.pin_pv_wait == causal and cfg.pin_pv_anchor == (4 if causal else 0)
    assert not fwd_tile_config(128, 128, False, False, decode=True).pin_pv_wait
    assert not fwd_tile_config(256, 256, True, False, decode=True).pin_pv_wait
    with pytest.raises(ValueError, match="intra_wg_overlap"):
        FwdTileConfig(intra_wg_overlap=False, pin_pv_wait=True)
    with pytest.raises(ValueError, match="needs pin_pv_wait"):
        FwdTileConfig(pin_pv_anchor=4)
    with pytest.raises(ValueError, match=">= 0"):
        FwdTileConfig(pin_pv_wait=True, pin_pv_anchor=-1)
    with pytest.raises(ValueError, match="interleave_rescale"):
        FwdTileConfig(pin_pv_wait=True, interleave_rescale=True)
    with pytest.raises(ValueError, match="interleave_rescale"):
        FwdTileConfig(
            pin_pv_wait=True, pin_pv_anchor=4, rescale_before_pv=True, interleave_rescale=True
        )


def test_interleave_rescale_where_measured():
    # on for the D=64 192-row tile under the causal mask and for D=192 / (192, 128) without a
    # window (tune_fwd_interleave*_h200.json, tune_fwd_d192_anchor_h200.json); off elsewhere,
    # where it lost or was not measured
    for causal, local in ((False, False), (True, False), (False, True)):
        assert fwd_tile_config(64, 64, causal, local, tall=True).interleave_rescale == causal
        assert not fwd_tile_config(64, 64, causal, local).interleave_rescale
        for d in (96, 128, 256):
            assert not fwd_tile_config(d, d, causal, local).interleave_rescale
        for d, dv in ((192, 192), (192, 128)):
            assert fwd_tile_config(d, dv, causal, local).interleave_rescale != local
    assert not fwd_tile_config(192, 192, False, False, decode=True).interleave_rescale


def test_pin_pv_anchor_counts_a_partial_row_or_whole_rows():
    # the anchor waits for part of a thread's first row (< tile_n / 4 probabilities) or for
    # whole rows (their row sums); anything else is rejected when the kernel is set up
    import cutlass

    from cute_attn.arch.sm90.flash_fwd import FlashFwdSm90

    def kernel(k):
        cfg = dataclasses.replace(fwd_tile_config(128, 128, False, False), pin_pv_anchor=k)
        return FlashFwdSm90(cutlass.BFloat16, 128, 128, 1, False, False, False, cfg)

    for k in (1, 4, 31, 32, 64):
        kernel(k)
    for k in (33, 40, 96):
        with pytest.raises(ValueError, match="pin_pv_anchor"):
            kernel(k)


def test_mask_loops_and_bits_where_measured():
    # split_mask_loops: on for D <= 128 (measured at D=128 and, with an anchor, at both D=64
    # tiles; D=96 takes the D=128 branch), off for D >= 192 (a loss at D=256) but for D=192
    # under a sliding window (with mask_bits: +4.7% at 8k rows, window 1024).
    # mask_bits (the keep-bit mask, R2P): every forward tile at D <= 128 and every tile under
    # a sliding window; off under the causal mask past D=128 (D=256 -1.7..-4.6%) and on
    # decode tiles (not measured); every backward variant
    for causal, local in ((False, False), (True, False), (False, True)):
        for cfg in [fwd_tile_config(d, d, causal, local) for d in (64, 96, 128)] + [
            fwd_tile_config(64, 64, causal, local, tall=True)
        ]:
            assert cfg.split_mask_loops and cfg.mask_bits, cfg
        for d, dv in ((192, 192), (192, 128), (256, 256)):
            cfg = fwd_tile_config(d, dv, causal, local)
            assert cfg.split_mask_loops == (local and d == 192), (d, dv, local)
            assert cfg.mask_bits == local, (d, dv, local)
        for d in (64, 96, 128, 192, 256):
            assert bwd_tile_config(d, d, causal, local, False, False).mask_bits
    assert not fwd_tile_config(128, 128, False, False, decode=True).mask_bits
    assert not fwd_tile_config(256, 256, False, True, decode=True).mask_bits


def test_unguarded_visible_max_where_measured():
    # the mask-free loop without the row max's -inf guards: under the causal mask on the D=64
    # 192-row tile and at D=96 / 128 (+1.1% at D=64 16k causal, +1.5% at D=128 16k causal);
    # off without a mask (-5% at D=64 16k), on the D=64 64-row tile (no consistent sign),
    # under sliding windows (not measured) and where split_mask_loops is off
    for causal, local in ((False, False), (True, False), (False, True), (True, True)):
        on = causal and not local
        for cfg in [fwd_tile_config(d, d, causal, local) for d in (96, 128)] + [
            fwd_tile_config(64, 64, causal, local, tall=True)
        ]:
            assert cfg.unguarded_visible_max == on, (cfg, causal, local)
        for d, dv in ((64, 64), (192, 192), (192, 128), (256, 256)):
            assert not fwd_tile_config(d, dv, causal, local).unguarded_visible_max
    with pytest.raises(ValueError, match="unguarded_visible_max"):
        FwdTileConfig(unguarded_visible_max=True)


def test_fwd_l2_sections_where_measured():
    # forward L2 sections (they act only under a right bound on dense grids): D=128 (and D=96,
    # its branch) at most 8 pairs a section (1024 pairs lose 4% at 1k causal); D > 128 and the
    # D=64 tall tile uncapped; the D=64 64-row tile under the causal mask only (+1.5% at 4k
    # causal with host-side sizes; sliding windows not measured)
    for d in (96, 128):
        cfg = fwd_tile_config(d, d, True, False)
        assert cfg.lpt_l2_sections and cfg.l2_section_max_pairs == 8
    for d, dv in ((192, 192), (192, 128), (256, 256)):
        cfg = fwd_tile_config(d, dv, True, False)
        assert cfg.lpt_l2_sections and cfg.l2_section_max_pairs == 1024
    assert fwd_tile_config(64, 64, True, False, tall=True).lpt_l2_sections
    assert fwd_tile_config(64, 64, True, False).lpt_l2_sections
    assert not fwd_tile_config(64, 64, True, True).lpt_l2_sections
    assert not fwd_tile_config(64, 64, False, True).lpt_l2_sections
    # over packed sequences at D=256 only (+2.5%; D=64 / 128 lost, D=192 tied)
    for d, dv in SUPPORTED_HEAD_DIMS:
        for tall in (False, True):
            cfg = fwd_tile_config(d, dv, True, False, tall=tall)
            assert cfg.l2_sections_packed is (d == 256), (d, dv, tall)


def test_fwd_persistent_where_measured():
    # persistent grids: dense forwards at D <= 128 (O's own smem buffer does not fit past it),
    # at D=96 / 128 only up to 8k keys (16k lost 1-2%), at D=64 under a causal mask up to 2k
    # (4k lost 0.6%), under a sliding window at D=96 / 128 (any length: measured to 16k) and
    # at D=64 up to 512 keys wide (1k lost 1.7%) and 8k keys; a wave of CTAs (2 per SM for
    # the two-CTA D=64 tile); never under a left bound alone, for decode or a paged cache
    from cute_attn.arch.sm90.tile_config import fwd_persistent

    assert fwd_persistent(64, 1 << 20) and fwd_persistent(128, 8192)
    assert not fwd_persistent(128, 8193) and not fwd_persistent(96, 16384)
    assert not fwd_persistent(192, 1024) and not fwd_persistent(256, 1024)
    assert fwd_persistent(128, 8192, -1, 0) and not fwd_persistent(128, 8193, -1, 0)
    assert fwd_persistent(64, 2048, -1, 0) and not fwd_persistent(64, 2049, -1, 0)
    assert fwd_persistent(128, 100, -1, 5) and not fwd_persistent(256, 1024, -1, 0)
    assert fwd_persistent(128, 1 << 20, 4096, 0) and fwd_persistent(96, 1 << 20, 100, 7)
    assert fwd_persistent(64, 8192, 128, 0) and fwd_persistent(64, 8192, 500, 12)
    assert fwd_persistent(64, 1 << 20, 128, 0)  # measured to 16k keys
    assert not fwd_persistent(64, 4096, 1024, 0) and not fwd_persistent(256, 4096, 128, 0)
    assert not fwd_persistent(128, 4096, 1024, -1)  # a left bound alone

    def ctas(*a, **k):
        return fwd_tile_config(*a, **k).persistent_ctas

    assert ctas(128, 128, False, False, persistent_sms=132) == 132
    assert ctas(64, 64, False, False, persistent_sms=132) == 264
    assert ctas(64, 64, False, False, tall=True, persistent_sms=114) == 114
    assert ctas(128, 128, False, False) == 0
    assert ctas(128, 128, True, False, persistent_sms=132) == 132
    for kw in ({"causal": True, "local": True}, {"causal": False, "local": True}):
        assert ctas(128, 128, **kw, persistent_sms=132) == 132  # the host's bucket decides
    assert ctas(128, 128, False, False, True, persistent_sms=132) == 0
    assert ctas(128, 128, False, False, page_size=64, persistent_sms=132) == 0
    assert ctas(256, 256, False, False, persistent_sms=132) == 0


def test_bwd_split_mask_loops_where_measured():
    # on for the D=64 128-row tile under the causal mask (measured +2% at 4k / 16k causal;
    # unmasked it spills), off at D=128 (neutral), for the D=64 64-row tile of softcap (57
    # spill instructions at 128 rows) and under windows (not measured)
    from cute_attn.arch.sm90.bwd_tiles import bwd_tile_config

    assert bwd_tile_config(64, 64, True, False).split_mask_loops
    assert not bwd_tile_config(64, 64, False, False).split_mask_loops
    for causal in (False, True):
        assert not bwd_tile_config(64, 64, causal, False, softcap=True).split_mask_loops
        assert not bwd_tile_config(128, 128, causal, False).split_mask_loops
    assert not bwd_tile_config(64, 64, False, True).split_mask_loops


def test_bwd_s_under_dk_where_measured():
    # the next tile's S^T behind this tile's dK: on for D=128's unmasked dense tiles, 80 rows
    # and group_heads' 64 (+1.0-1.9%, tune_bwd_sdk_*_s54_h100.json), and on the short-rows
    # tiles; off on the taller tiles under the causal mask and in the deterministic order
    # (where it lost), at D=64 / 96's own tiles (even or behind), and for windows, softcap and
    # packed sequences (not measured)
    from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig, bwd_tile_config

    assert bwd_tile_config(128, 128, False, False).s_under_dk
    assert bwd_tile_config(128, 128, False, False, group_heads=True).s_under_dk
    # and the short-rows tiles (bwd_short_rows)
    for d, causal in ((96, True), (96, False), (128, True)):
        assert bwd_tile_config(d, d, causal, False, short=True).s_under_dk
    for kw in (dict(causal=True), dict(local=True), dict(softcap=True),
               dict(deterministic=True), dict(varlen=True)):  # fmt: skip
        flags = dict(causal=False, local=False) | kw
        assert not bwd_tile_config(128, 128, **flags).s_under_dk, kw
    for d, dv in ((64, 64), (96, 96), (192, 192), (192, 128), (256, 256)):
        for causal in (False, True):
            assert not bwd_tile_config(d, dv, causal, False).s_under_dk
    # built for the dK / dV register tiles walked in one loop
    with pytest.raises(ValueError, match="s_under_dk"):
        BwdTileConfig(tile_n=64, dkv_swap_ab=True, do_stages=1, s_under_dk=True)
    with pytest.raises(ValueError, match="s_under_dk"):
        BwdTileConfig(tile_m=128, split_mask_loops=True, s_under_dk=True)


def test_bwd_overlaps_where_measured():
    # post_overlap, the postprocess under the main grid's last wave (+0.8-2.5% from 4k, even
    # at 16k, tune_bwd_post_overlap*_s56_h100.json), and pre_overlap, the persistent
    # preprocess beside the main grid (+0.5-5% on an H100 at 1k-16k,
    # tune_bwd_pre_overlap*_s57_h100.json; past D = 128 both +0.8-5.3%,
    # tune_bwd_balance_*_s66_h100.json): on for dense calls at every head dim, mask mode and
    # tile, the deterministic order too (its counts after the turns in sem,
    # tune_bwd_det_overlap_s57_h100.json, tune_bwd_det_wide_ov_s66_h100.log); off for packed
    # sequences (counts per dense (batch, head)). 16 preprocess CTAs (32 even or behind, 48 /
    # 66 behind)
    from cute_attn.arch.sm90.bwd_tiles import BWD_HEAD_DIMS, BWD_PRE_CTAS, bwd_tile_config

    assert BWD_PRE_CTAS == 16
    flags = ("causal", "local", "softcap", "group_heads", "short")
    for field in ("post_overlap", "pre_overlap"):
        for d, dv in BWD_HEAD_DIMS:
            for on in itertools.product((False, True), repeat=len(flags)):
                kw = dict(zip(flags, on))
                assert getattr(bwd_tile_config(d, dv, **kw), field), (field, d, dv, kw)
                det = bwd_tile_config(d, dv, **kw, deterministic=True)
                assert getattr(det, field), (field, d, dv, kw)
                assert not getattr(bwd_tile_config(d, dv, **kw, varlen=True), field), (d, kw)


def test_bwd_l2_last_sections_where_measured():
    # the last 4 L2 sections as one under the causal mask (+0.5-3% at 16k on an H100, sections
    # of 1-2 pairs; lost up to 1.6% at 4k, sections of 2-8 pairs, where L2Sections.create
    # keeps them apart: BWD_L2_LAST_MAX_PAIRS; tune_bwd_last_sections_s66_h100.json): wherever
    # the default order takes sections, except packed sequences and group_heads (not measured)
    from cute_attn.arch.sm90.bwd_tiles import BWD_HEAD_DIMS, BWD_L2_LAST_MAX_PAIRS, bwd_tile_config

    assert BWD_L2_LAST_MAX_PAIRS == 2
    flags = ("causal", "local", "softcap", "deterministic", "group_heads", "varlen", "short")
    for d, dv in BWD_HEAD_DIMS:
        for on in itertools.product((False, True), repeat=len(flags)):
            kw = dict(zip(flags, on))
            cfg = bwd_tile_config(d, dv, **kw)
            sections = cfg.l2_section_bytes and not (kw["deterministic"] or kw["local"])
            want = 4 if sections and not (kw["varlen"] or kw["group_heads"]) else 1
            assert cfg.l2_last_sections == want, (d, dv, kw, cfg)


def test_bwd_dq_staging_where_measured():
    # D=96 / 128: 80 query rows (96 at D=96) with dQ^T = K^T dS^T, whose 32-bit staging
    # stores are conflict-free under the 128-byte swizzle (+7-12% over the 64-row tile,
    # tune_bwd_m80_h100.json), every mask and order; under softcap or group_heads that tile
    # spills at D=128: group_heads takes 64 rows with dQ^T (+12% MQA, tune_bwd_grp_d128_h200.json),
    # softcap the 64-row dQ = dS K tile (dQ^T within 1.6% either way). D=64: 128 rows with
    # dQ^T (+2-7%, tune_bwd_d64_swap_h200.json), windows included (+10% over its old 64-row
    # tile); softcap keeps 64 rows with dQ = dS K. dQ = dS K takes the 32-byte swizzle
    # (conflict-free 64-bit stores) except in the deterministic order, whose waits on each dQ
    # add measured faster with the 128-byte swizzle's wider TMA boxes; dQ^T the 128-byte one
    from cute_attn.arch.sm90.bwd_tiles import BwdTileConfig, bwd_tile_config

    for causal, local, softcap in ((False, False, False), (True, False, False),
                                   (False, True, False), (True, False, True)):  # fmt: skip
        for det, group in itertools.product((False, True), repeat=2):
            for d in (96, 128):
                cfg = bwd_tile_config(d, d, causal, local, softcap, det, group)
                assert (cfg.dq_half_staging, cfg.dq_stages) == (True, 2), cfg
                if softcap:
                    assert (cfg.tile_m, cfg.dq_swap_ab) == (64, False), cfg
                    assert cfg.dq_swizzle == (128 if det else 32), cfg
                else:
                    # D=96's own tiles take 96 rows (+2.4-2.7% at >= 4k over 80,
                    # tune_bwd_d96_rows*_h200.json), group_heads too (+5-7% over 64,
                    # tune_bwd_grp_d96_h200.json); D=128 group_heads 64 (80 spills)
                    rows = 96 if d == 96 else (64 if group else 80)
                    assert (cfg.tile_m, cfg.dq_swap_ab, cfg.dq_swizzle) == (rows, True, 128), cfg
                    # register-order dQ^T staging on the 80 / 96-row tiles (D=128 16k +2.1%,
                    # D=96 16k +5.4%; tune_bwd_dq_flat_h200.json), not on 64 rows
                    assert cfg.dq_flat == (rows > 64), cfg
                if softcap:
                    assert not cfg.dq_flat, cfg
            cfg = bwd_tile_config(64, 64, causal, local, softcap, det, group)
            if softcap:
                assert (cfg.tile_m, cfg.dq_swap_ab) == (64, False), cfg
                assert cfg.dq_swizzle == (128 if det else 32), cfg
                assert not cfg.dq_flat and not cfg.dq_wg_handoff, cfg
            else:
                assert (cfg.tile_m, cfg.dq_swap_ab, cfg.dq_swizzle) == (128, True, 128), cfg
                # D=64: register-order dQ^T with a handoff per warpgroup (4k +6.3%, 16k
                # causal +9.7%, deterministic and packed too; tune_bwd_d64_handoff*_h200.json)
                assert cfg.dq_flat and cfg.dq_wg_handoff, cfg
        for d in (96, 128):
            # the head-dim halves are handed over per warpgroup already (dq_half_staging)
            assert not bwd_tile_config(d, d, causal, local, softcap).dq_wg_handoff
    with pytest.raises(ValueError, match="dq_swizzle"):
        BwdTileConfig(dq_swizzle=16)
    # dQ^T in head-dim halves needs a buffer per warpgroup; query rows go in 16-row steps;
    # it does not combine with dkv_swap_ab (which splits dQ's head dim its own way)
    half = dict(dq_half_staging=True, dq_stages=2)
    assert BwdTileConfig(tile_m=80, dq_swap_ab=True, **half).tile_m == 80
    with pytest.raises(ValueError, match="dq_stages = 2"):
        BwdTileConfig(tile_m=80, dq_swap_ab=True, dq_half_staging=True)
    # without the halves (a 64-column head dim) the warpgroups split dQ^T's query columns
    assert BwdTileConfig(tile_m=128, dq_swap_ab=True).dq_swap_ab
    with pytest.raises(ValueError, match="16..128"):
        BwdTileConfig(tile_m=72, dq_swap_ab=True, **half)
    with pytest.raises(ValueError, match="tile_m 80 must be 64"):
        BwdTileConfig(tile_m=80, **half)
    with pytest.raises(ValueError, match="no dq_swap_ab"):
        BwdTileConfig(tile_n=64, dkv_swap_ab=True, dq_swap_ab=True, **half)


def test_row_max_form_where_measured():
    # the four-chain, maxes-first row max only on the 192-row D=64 tile (+3-5% unmasked,
    # tune_fwd_rowmax_*_h200.json); it lost at D=128 / 256 and on the 64-row tile's 4k causal
    from cute_attn.arch.sm90.tile_config import FwdTileConfig

    for causal, local in ((False, False), (True, False), (False, True)):
        assert fwd_tile_config(64, 64, causal, local, tall=True).row_max_form == 2
        for d, dv in ((64, 64), (96, 96), (128, 128), (192, 192), (192, 128), (256, 256)):
            assert fwd_tile_config(d, dv, causal, local).row_max_form == 0
    with pytest.raises(ValueError, match="row_max_form"):
        FwdTileConfig(row_max_form=3)


def test_bwd_d96_runs_its_own_tiles_with_a_padded_k():
    # D=96, dQ^T tiles: S^T, dP^T, dV and dK over the 96 columns, 96 query rows; only K's smem
    # tile (dQ^T's A operand, M = 2 x 64) is 128 wide (tune_bwd_d96_own_h200.json,
    # tune_bwd_d96_rows*_h200.json). Softcap keeps dQ = dS K and with it the padded D=128 tile
    from cute_attn.arch.sm90.bwd_tiles import BWD_HEAD_DIMS, BwdTileConfig, bwd_tile_config
    from cute_attn.arch.sm90.tile_config import SMEM_BYTES_SM90

    assert (96, 96) in BWD_HEAD_DIMS
    for causal, local, det in itertools.product((False, True), repeat=3):
        cfg = bwd_tile_config(96, 96, causal, local, deterministic=det)
        d128 = bwd_tile_config(128, 128, causal, local, deterministic=det)
        assert (cfg.padded_head_dim, cfg.dq_head_dim, cfg.tile_m) == (0, 128, 96)
        # D=128's unmasked dense tile alone takes s_under_dk (test_bwd_s_under_dk_where_measured)
        # and a deterministic section twice D=96's (test_bwd_l2_sections_where_measured)
        # the flat tile's adds skip dQ^T's zero rows 96..127 (dq_skip_zero_rows)
        assert cfg.dq_skip_zero_rows
        assert d128 == dataclasses.replace(
            cfg, dq_head_dim=0, tile_m=80, s_under_dk=d128.s_under_dk,
            l2_section_bytes=d128.l2_section_bytes, dq_skip_zero_rows=False,
            tail_split=d128.tail_split,
        )  # fmt: skip
        assert cfg.tile_head_dims(96, 96) == (96, 96)
        assert cfg.dq_tile_head_dim(96) == 128
        assert cfg.smem_bytes(96, 96) <= SMEM_BYTES_SM90
    # group_heads takes 96 rows too (D=128's takes 64), same K
    for causal in (False, True):
        cfg = bwd_tile_config(96, 96, causal, False, group_heads=True)
        assert (cfg.tile_m, cfg.dq_head_dim, cfg.padded_head_dim) == (96, 128, 0)
        assert bwd_tile_config(128, 128, causal, False, group_heads=True).tile_m == 64
    # softcap: the D=128 tile (dQ = dS K) on the 96 columns themselves, no padding (+4-7% over
    # the zero-filled D=128 columns, tune_bwd_d96_softcap_own_s55_h100.json)
    for causal in (False, True):
        cfg = bwd_tile_config(96, 96, causal, False, softcap=True)
        assert cfg.padded_head_dim == 0 and cfg.dq_head_dim == 0 and not cfg.dq_swap_ab
        assert cfg == bwd_tile_config(128, 128, causal, False, softcap=True)
        assert cfg.tile_head_dims(96, 96) == (96, 96) and cfg.dq_tile_head_dim(96) == 96
        assert cfg.smem_bytes(96, 96) < cfg.smem_bytes(128, 128)
        # the deterministic order stages dQ in 128-byte swizzle atoms (32 columns), which a
        # 48-column half cannot take: the D=128 tile over zero-filled columns there
        det = bwd_tile_config(96, 96, causal, False, softcap=True, deterministic=True)
        assert det.padded_head_dim == 128 and det.tile_head_dims(96, 96) == (128, 128)
        # (its unmasked deterministic sections are D = 96's: half of D = 128's budget)
        d128 = bwd_tile_config(128, 128, causal, False, softcap=True, deterministic=True)
        assert d128 == dataclasses.replace(
            det, padded_head_dim=0, l2_section_bytes=d128.l2_section_bytes
        )
    assert bwd_tile_config(128, 128, False, False).tile_head_dims(128, 128) == (128, 128)
    assert bwd_tile_config(128, 128, False, False).dq_tile_head_dim(128) == 128
    # each head dim rounds up to a multiple of the padding on its own
    assert BwdTileConfig(padded_head_dim=128).tile_head_dims(96, 64) == (128, 128)
    assert BwdTileConfig(padded_head_dim=128).tile_head_dims(192, 128) == (256, 128)
    with pytest.raises(ValueError, match="padded_head_dim 64"):
        BwdTileConfig(padded_head_dim=64)
    # the K padding is for dQ^T's two head-dim halves only, and not on top of padded tiles
    with pytest.raises(ValueError, match="dq_head_dim"):
        BwdTileConfig(dq_head_dim=128)
    with pytest.raises(ValueError, match="dq_head_dim"):
        BwdTileConfig(tile_m=80, dq_swap_ab=True, dq_half_staging=True, dq_stages=2,
                      padded_head_dim=128, dq_head_dim=128)  # fmt: skip


def test_bwd_wide_head_dims_take_the_swapped_tiles():
    # past D=128: dK^T / dV^T with head-dim rows, two Q stages, dQ staged in halves. D=256:
    # 64 x 64 tiles with S^T, the warpgroups taking the head dim's 64-row tiles in turn.
    # D=192: 64 x 96 with S = Q K^T, each warpgroup's dK^T / dV^T over its own 48 keys and
    # the whole head dim, unpadded
    from cute_attn.arch.sm90.bwd_tiles import BWD_HEAD_DIMS, BwdTileConfig, bwd_tile_config
    from cute_attn.arch.sm90.tile_config import SMEM_BYTES_SM90

    for d, dv in ((192, 192), (192, 128), (256, 256)):
        assert (d, dv) in BWD_HEAD_DIMS
        for causal, local, softcap, det in itertools.product((False, True), repeat=4):
            cfg = bwd_tile_config(d, dv, causal, local, softcap, det)
            # one dO stage at D=192 and 256; D=192 spends the smem a second would take on a
            # dQ half buffer per warpgroup (+9-11%, tune_bwd_d192_knobs_h200.json,
            # tune_bwd_d192_ds_h200.json), with one dS buffer to fit it; at D=256 the
            # warpgroups take turns on one, which the wide TMA boxes drain faster. (192, 128)
            # has room for both with one dS buffer (+0.2-4.1% against two dS buffers and one dO
            # stage, tune_bwd_v128{,_b,_varlen}_s69_h100.json)
            v128 = (d, dv) == (192, 128)
            assert cfg.dkv_swap_ab and cfg.dq_half_staging and cfg.do_stages == (2 if v128 else 1)
            assert cfg.dq_stages == (2 if d == 192 else 1)
            assert cfg.single_ds == (d == 192)
            # packed sequences at D=192 keep one dS buffer but the warpgroups take turns on
            # one dQ half buffer (a buffer per warpgroup spills there); no L2 sections in
            # their deterministic order (test_bwd_l2_sections_where_measured), no last
            # sections merged and no overlaps (test_bwd_overlaps_where_measured)
            packed = bwd_tile_config(d, dv, causal, local, softcap, det, varlen=True)
            cfg = dataclasses.replace(
                cfg, l2_section_bytes=packed.l2_section_bytes, tail_split=packed.tail_split,
                l2_last_sections=1, post_overlap=False, pre_overlap=False,
            )  # fmt: skip
            turns = dataclasses.replace(cfg, dq_stages=1)
            assert packed == (turns if d == dv == 192 else cfg)
            assert cfg.dq_swizzle == 128
            tile_n = 96 if d == 192 else 64
            assert (cfg.tile_m, cfg.tile_n, cfg.num_stages) == (64, tile_n, 2)
            assert cfg.sdp_swap_ab == (d == 256)
            assert cfg.tile_head_dims(d, dv) == (d, dv)
            assert cfg.smem_bytes(d, dv) <= SMEM_BYTES_SM90
        # what does not fit: a second dO stage at D = 192 and 256 (at (192, 128), which has
        # one, beside two dS buffers), and at dv > 128 the whole dQ staged at once (one
        # buffer, or one half buffer per warpgroup) unless dS takes one buffer
        cfg = bwd_tile_config(d, dv, False, False)
        two_do = dataclasses.replace(cfg, do_stages=2, single_ds=cfg.single_ds and dv > 128)
        assert two_do.smem_bytes(d, dv) > SMEM_BYTES_SM90
        if dv > 128:
            two_ds = dataclasses.replace(cfg, single_ds=False, dq_stages=1)
            whole = dataclasses.replace(two_ds, dq_half_staging=False)
            assert whole.smem_bytes(d, dv) > SMEM_BYTES_SM90
            two = dataclasses.replace(two_ds, dq_stages=2)
            assert two.smem_bytes(d, dv) > SMEM_BYTES_SM90
    for d in (64, 96, 128):
        for causal, local, softcap, det in itertools.product((False, True), repeat=4):
            cfg = bwd_tile_config(d, d, causal, local, softcap, det)
            assert not cfg.dkv_swap_ab and cfg.do_stages == 2
            assert cfg.smem_bytes(d, d) <= SMEM_BYTES_SM90
            # 64 query rows (or 80 / 96 with dQ^T) split dQ by head dim: each warpgroup stages
            # its half in a buffer of its own; D=64's 128-row dQ^T tile splits its query
            # columns and stages the tile whole
            assert (cfg.dq_half_staging, cfg.dq_stages) == (
                (True, 2) if cfg.tile_m in (64, 80, 96) else (False, 1)
            )
    with pytest.raises(ValueError, match="with S\\^T takes tile_n = 64"):
        BwdTileConfig(tile_n=128, dkv_swap_ab=True)
    with pytest.raises(ValueError, match="with S takes tile_n 64 or 96"):
        BwdTileConfig(tile_n=128, dkv_swap_ab=True, sdp_swap_ab=False)
    with pytest.raises(ValueError, match="takes tile_m = 64"):
        BwdTileConfig(tile_m=128, tile_n=96, dkv_swap_ab=True, sdp_swap_ab=False)
    with pytest.raises(ValueError, match="needs dkv_swap_ab"):
        BwdTileConfig(sdp_swap_ab=False)
    with pytest.raises(ValueError, match="must be 1 or 2"):
        BwdTileConfig(tile_n=64, num_stages=3, dkv_swap_ab=True)
    with pytest.raises(ValueError, match="do_stages must not exceed"):
        BwdTileConfig(tile_n=64, num_stages=1, do_stages=2, dkv_swap_ab=True)
    with pytest.raises(ValueError, match="dq_half_staging needs tile_m = 64"):
        BwdTileConfig(tile_m=128, dq_half_staging=True)
    with pytest.raises(ValueError, match="dq_stages 3"):
        BwdTileConfig(dq_stages=3)
    with pytest.raises(ValueError, match="set dq_half_staging"):
        BwdTileConfig(dq_stages=2)


def test_bwd_row_threads():
    # threads per row of the backward pre/postprocess: a power of two of whole 16-byte vectors
    from cute_attn.arch.common.bwd_preprocess import row_threads

    assert [row_threads(d, 32) for d in (64, 96, 128, 192, 256)] == [8, 4, 16, 8, 32]
    assert row_threads(512, 32) == 32 and row_threads(512, 128) == 64
    with pytest.raises(ValueError, match="multiple of 8"):
        row_threads(100, 32)


def test_bwd_group_heads_rule():
    # GQA grids of at least 3/4 of a wave walk the KV head's query heads; under the causal mask
    # only groups of up to 4 and with L2 sections (not deterministic, not packed); windows and
    # grids too small to fill the SMs keep a CTA per query head
    def rule(g, ctas, causal=False, local=False, det=False, varlen=False, d=128):
        return bwd_group_heads(g, d, causal, local, det, varlen, ctas, 132)

    assert rule(4, 128) and rule(4, 1024) and rule(32, 1024) and rule(4, 1024, det=True)
    assert not rule(4, 64)  # measured slower (0.148 vs 0.124 ms)
    assert not rule(1, 1024)  # no group
    assert not rule(32, 16)  # 16 CTAs where 512 would run
    assert rule(4, 1024, causal=True) and rule(2, 256, causal=True)
    assert not rule(8, 512, causal=True)  # measured slower (3.368 vs 2.936 ms)
    assert not rule(32, 256, causal=True)  # MQA: 8.91 vs 5.48 ms
    assert not rule(4, 1024, causal=True, det=True)  # right to left, no sections
    assert rule(4, 1024, causal=True, varlen=True)  # packed grids have sections too
    assert not rule(4, 1024, local=True) and not rule(4, 1024, causal=True, local=True)
    assert rule(4, 1024, d=64) and rule(4, 1024, causal=True, d=96)
    assert not rule(4, 1024, causal=True, d=64)  # that variant spills (32 B)


def test_bwd_short_rows_rule_and_tiles():
    # dense causal problems of at most 2k query rows at D = 128 and 8k at D = 96, and unmasked
    # ones of at most 1k at D = 96, take 64 query rows with s_under_dk (+0.3-4.8% at 1k-2k,
    # +3.6% at D=96 4k causal, tune_bwd_sdk_*_s54_h100.json); longer, windowed, deterministic,
    # packed and grouped calls keep the table's tile
    def rule(d=128, causal=True, local=False, det=False, varlen=False, group=False, sq=1024):
        return bwd_short_rows(d, causal, local, det, varlen, group, sq)

    assert BWD_SHORT_ROWS_MAX_SEQLEN == 2048
    assert BWD_SHORT_ROWS_MAX_SEQLEN_D96 == 8192
    assert BWD_SHORT_ROWS_MAX_SEQLEN_D96_UNMASKED == 1024
    assert rule() and rule(d=96) and rule(sq=2048) and rule(sq=1)
    assert not rule(sq=2049) and rule(d=96, sq=8192) and not rule(d=96, sq=8193)
    assert rule(d=96, causal=False, sq=1024) and not rule(d=96, causal=False, sq=1025)
    assert not rule(causal=False, sq=1) and not rule(local=True) and not rule(d=96, local=True)
    assert not rule(det=True) and not rule(varlen=True) and not rule(group=True)
    assert not rule(d=96, causal=False, det=True) and not rule(d=96, causal=False, varlen=True)
    assert not any(rule(d=d, causal=c) for d in (64, 192, 256) for c in (False, True))
    for causal in (True, False):
        for d, long_rows in ((96, 96), (128, 80)):
            base = bwd_tile_config(d, d, causal, False)
            short = bwd_tile_config(d, d, causal, False, short=True)
            assert (base.tile_m, short.tile_m) == (long_rows, 64)
            # the same kernel on fewer rows, with the swizzled dQ staging (dq_flat lost at 64
            # rows, and end_aligned, which pads the flat tiles, with it) and the next tile's
            # S^T behind dK
            assert base.dq_flat and not short.dq_flat and short.s_under_dk
            assert base.end_aligned == causal and not short.end_aligned
            assert short == dataclasses.replace(
                base, tile_m=64, dq_flat=False, s_under_dk=True, dq_skip_zero_rows=False,
                end_aligned=False,
            )  # fmt: skip
            # softcap's tile has 64 rows already: the bucket changes nothing there
            sc = bwd_tile_config(d, d, causal, False, softcap=True)
            assert bwd_tile_config(d, d, causal, False, softcap=True, short=True) == sc


def test_bwd_l2_sections_where_measured():
    # L2 sections under the causal mask at D >= 96 (+2..3% at 4k, equal at 1k and 16k), not at
    # D=64 (-2.5% at 1k); never windowed; unmasked only in the deterministic order (its turns'
    # launch distance: +6..21% on an H100 from 1k to 4k at D <= 128, +2..16% past it), half
    # the budget at D = 96 and 192, dense and per query head (packed sequences and group_heads
    # not measured), never under its causal mask (which launches right to left: -1.5..19%)
    from cute_attn.arch.sm90.bwd_tiles import BWD_L2_SECTION_BYTES, bwd_tile_config

    def sections(d, dv, causal, local=False, det=False, **kw):
        return bwd_tile_config(d, dv, causal, local, False, det, **kw).l2_section_bytes

    for d, dv in ((96, 96), (128, 128), (192, 192), (192, 128), (256, 256)):
        assert sections(d, dv, True) == BWD_L2_SECTION_BYTES
        assert sections(d, dv, False) == sections(d, dv, True, det=True) == 0
        assert sections(d, dv, True, local=True) == sections(d, dv, False, local=True) == 0
        assert sections(d, dv, False, local=True, det=True) == 0
    assert sections(64, 64, True) == sections(64, 64, False) == 0
    assert sections(64, 64, True, det=True) == 0
    half, whole = BWD_L2_SECTION_BYTES // 2, BWD_L2_SECTION_BYTES
    for d, dv, budget in ((64, 64, whole), (96, 96, half), (128, 128, whole), (192, 192, half),
                          (192, 128, half), (256, 256, whole)):  # fmt: skip
        assert sections(d, dv, False, det=True) == budget, d
        assert sections(d, dv, False, det=True, varlen=True) == 0, d
        assert sections(d, dv, False, det=True, group_heads=True) == 0, d


def test_kernel_window_clamp_is_exact():
    # fwd_sm90.kernel_window clamps each window side to Sq + Sk for the kernels' Int32 math;
    # a side that wide cuts nothing, so the mask is the unclamped one (reference rule)
    from cute_attn.fwd_sm90 import kernel_window
    from cute_attn.reference import visible_mask

    for sq, sk in ((1, 1), (300, 120), (120, 300), (5, 2), (64, 64)):
        for left, right in ((2**40, 0), (2**31 - 1, 3), (7, 2**40), (-1, 2**33), (3, -1)):
            p = dataclasses.replace(PLAIN, seqlen_q=sq, seqlen_k=sk, window_left=left,
                                    window_right=right)  # fmt: skip
            cl, cr = kernel_window(p, sq + sk)
            assert 0 <= cl <= sq + sk and 0 <= cr <= sq + sk
            # the kernel's values with the absent sides marked absent again
            cl, cr = (cl if left >= 0 else -1), (cr if right >= 0 else -1)
            want = visible_mask(sq, sk, left, right)
            assert bool((visible_mask(sq, sk, cl, cr) == want).all()), (sq, sk, left, right)


def test_bwd_two_dq_writers_in_the_deterministic_order_only():
    # BwdTileConfig.dq_writers = 2 where measured (+1.6..8.3% deterministic, D = 96 to 256 on an
    # H200), every deterministic variant; the default order keeps one (tied or lost there).
    # The producer warpgroup has three warps after the load's: at most 3 writers
    from cute_attn.arch.sm90.bwd_tiles import BWD_HEAD_DIMS, BwdTileConfig, bwd_tile_config

    for (d, dv), flags in itertools.product(
        BWD_HEAD_DIMS, itertools.product((False, True), repeat=7)
    ):
        det = flags[3]
        assert bwd_tile_config(d, dv, *flags).dq_writers == (2 if det else 1), (d, dv, flags)
    for bad in (0, 4):
        with pytest.raises(ValueError, match="dq_writers"):
            BwdTileConfig(dq_writers=bad)
    # the consumers count the writers' turns themselves: any Q stage count
    one_stage = dataclasses.replace(bwd_tile_config(256, 256, False, False), num_stages=1)
    assert dataclasses.replace(one_stage, dq_writers=3).dq_writers == 3
