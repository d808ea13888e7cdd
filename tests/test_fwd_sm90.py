"""SM90 forward kernel vs the fp32 reference (GPU, `gpu` marker), plus CPU compile checks.

Tolerance is the FlashAttention rule: max|out - ref32| <= 2 * max|out_torch - ref32| + atol,
where out_torch is the same math done by plain torch in the input dtype
(reference.attention_ref(compute_dtype=None)) and atol covers rounding the fp32 reference to
the output dtype. lse is compared in fp32 (both -inf on empty rows).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from compile_snippet import MASK_WINDOWS, run_json_snippet

from cute_attn import flash_attn_func, last_dispatch
from cute_attn.arch.common.features import InputFeatures
from cute_attn.reference import attention_ref

from gpu_cases import (
    SWEEP_MODES,
    assert_matches,
    attn_inputs,
    forced_host_rule,
    mode_kwargs,
    sweep_batch,
)

POISON = float("nan")


def _check(q, k, v, **kw):
    out, lse = flash_attn_func(q, k, v, **kw)
    assert last_dispatch().impl == "sm90_fwd", last_dispatch()
    ref, ref_lse = attention_ref(q, k, v, compute_dtype=torch.float32, **kw)
    same, _ = attention_ref(q, k, v, compute_dtype=None, **kw)
    assert_matches(out, lse, ref, ref_lse, same)
    return out, lse


def _forced_table(monkeypatch, change):
    """Calls inside run the tuning table's configs passed through `change`; yields the list of
    compile keys they build (gpu_cases.forced_host_rule)."""
    from cute_attn import fwd_sm90

    table = fwd_sm90.fwd_tile_config
    return forced_host_rule(monkeypatch, "fwd_tile_config", lambda *a, **k: change(table(*a, **k)))


SEQLENS = [(1, 1), (2, 5), (5, 2), (113, 203), (239, 1), (1, 4096), (128, 128), (1024, 1024),
           (333, 777), (777, 333)]  # fmt: skip
HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 192), (192, 128), (256, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,dv", HEAD_DIMS)
@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("mode", SWEEP_MODES)
def test_fwd_sweep(dtype, d, dv, sq, sk, mode):
    _check(*attn_inputs(sweep_batch(sq, sk), sq, sk, 6, 2, d, dv, dtype), **mode_kwargs(mode))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(2**40, 0), (2**31 - 1, 3), (7, 2**40), (2**31 - 1, -1)])
def test_fwd_window_wider_than_int32(window):
    # window sides are unbounded python ints: the host clamps them, exactly, before the
    # kernels' Int32 arithmetic (fwd_sm90.kernel_window). With Sq > Sk, row + offset is
    # negative for the first rows, where an unclamped 2**31 - 1 left bound would wrap.
    q, k, v = attn_inputs(2, 300, 120, 6, 2, 128, 128, torch.bfloat16)
    _check(q, k, v, window_size=window)


@pytest.mark.gpu
@pytest.mark.parametrize("h,hkv", [(6, 6), (6, 3), (6, 1)])
@pytest.mark.parametrize("window", [(None, None), (0, 0), (64, None), (None, 64), (-1, 3), (5, -1)])
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_gqa_windows(h, hkv, window, causal):
    _check(*attn_inputs(3, 300, 457, h, hkv, 128, 128, torch.bfloat16), causal=causal,
           window_size=window)  # fmt: skip


def _check_tall(b, sq, sk, h, hkv, dtype, **kw):
    # long query rows take the 192-row, three-consumer-warpgroup D=64 variant
    from cute_attn.fwd_sm90 import tall_rows
    from cute_attn.validation import validate_dense

    q, k, v = attn_inputs(b, sq, sk, h, hkv, 64, 64, dtype)
    p = validate_dense(q, k, v, softmax_scale=None, causal=kw.get("causal", False),
                       window_size=kw.get("window_size", (None, None)),
                       softcap=kw.get("softcap", 0.0), num_splits=0, pack_gqa=None,
                       deterministic=False)  # fmt: skip
    assert tall_rows(p, InputFeatures(), False, sq)
    _check(q, k, v, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sq,sk", [(3001, 3001), (2048, 3001), (2100, 700), (4224, 4224)])
def test_fwd_tall_d64(dtype, sq, sk):
    _check_tall(1 if sq * sk > 8_000_000 else 2, sq, sk, 6, 2, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk", [(16384, 16384), (16500, 16000)])
@pytest.mark.parametrize("mode", ["causal", "window", "softcap"])
def test_fwd_tall_d64_masked(sq, sk, mode):
    # under a mask the tall variant starts at 16k rows with a sliding window of >= 4096 keys,
    # at 4k without one
    kw = {"window_size": (4000, 101)} if mode == "window" else mode_kwargs(mode)
    _check_tall(1, sq, sk, 2, 1, torch.bfloat16, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "sq,sk", [(4096, 4100), (5120, 5200), (8192, 8192), (8300, 8000), (8200, 9001)]
)
def test_fwd_tall_d64_causal_mid(sq, sk):
    # the causal mask takes the tall variant from 4k rows
    _check_tall(1, sq, sk, 2, 1, torch.bfloat16, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("d,sq,sk", [(128, 300, 427), (96, 300, 427), (64, 4096, 4223)])
def test_fwd_row_unseen_until_the_visible_loop(d, sq, sk):
    # Sk - Sq = 127 under the causal mask: query tile 0's first row sees keys 0..127 only, so
    # no key of the tiles run before key tile 0 (the peeled first tile and the edge loop),
    # and it enters the mask-free loop, whose max is unguarded (unguarded_visible_max), with
    # m = -inf: its rescale must come out 0 from exp2(-inf) alone (D=64: the 192-row tile)
    if d == 64:
        _check_tall(1, sq, sk, 2, 1, torch.bfloat16, causal=True)
    else:
        _check(*attn_inputs(2, sq, sk, 6, 2, d, d, torch.bfloat16), causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 4, 9])
def test_fwd_batches_and_long(b):
    _check(*attn_inputs(b, 4224 // b, 4224 // b, 4, 4, 128, 128, torch.bfloat16), causal=True)


@pytest.mark.gpu
def test_fwd_all_rows_empty_and_scale():
    # Sq > Sk causal: the first Sq - Sk rows see nothing; a custom scale
    _check(*attn_inputs(2, 300, 40, 4, 2, 64, 64, torch.float16), causal=True, softmax_scale=0.3)
    # window that excludes everything for some rows: left=0,right=0 with Sk < Sq
    _check(*attn_inputs(2, 64, 16, 4, 4, 64, 64, torch.bfloat16), window_size=(0, 0))


@pytest.mark.gpu
def test_fwd_poisoned_output_fully_written():
    # the outputs are allocated uninitialized; make that memory NaN first so unwritten cells
    # show: the first call (validation, dispatch, run_fwd) and a memo hit (the bound
    # launcher's torch.empty_like)
    from cute_attn import api

    q, k, v = attn_inputs(2, 257, 300, 4, 2, 128, 128, torch.bfloat16)
    api._dense_memo.clear()
    for _ in range(2):
        # same-size blocks freed just before the call are what the caching allocator hands
        # out next
        junk_o = torch.full((2, 257, 4, 128), POISON, device="cuda", dtype=torch.bfloat16)
        junk_l = torch.full((2, 4, 257), POISON, device="cuda", dtype=torch.float32)
        ptrs = {junk_o.data_ptr(), junk_l.data_ptr()}
        del junk_o, junk_l
        out, lse = _check(q, k, v, causal=True)
        assert {out.data_ptr(), lse.data_ptr()} == ptrs, "poisoned blocks were not reused"
        del out, lse
    assert len(api._dense_memo) == 1


@pytest.mark.gpu
def test_fwd_mixed_problems_same_ratio():
    # same GQA ratio, different head counts: must not share a compiled kernel
    a = attn_inputs(2, 200, 300, 6, 2, 128, 128, torch.bfloat16, seed=1)
    bb = attn_inputs(2, 200, 300, 12, 4, 128, 128, torch.bfloat16, seed=2)
    for x in (a, bb, a):
        _check(*x, causal=True)


@pytest.mark.gpu
def test_fwd_noncontiguous_views():
    # q/k/v as views of one packed qkv tensor (strides not compact, still TMA-legal)
    qkv = torch.randn(2, 333, 3, 8, 128, device="cuda", dtype=torch.bfloat16)
    _check(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)


@pytest.mark.gpu
def test_fwd_memo_hit_matches_first_call():
    # the second identical call skips validation and dispatch (api._dense_memo); it must run
    # the same kernel, and a grad-requiring call with the same signature must still get grads
    from cute_attn import api

    q, k, v = attn_inputs(2, 300, 301, 6, 2, 64, 64, torch.bfloat16)
    api._dense_memo.clear()
    first = flash_attn_func(q, k, v, causal=True)
    assert len(api._dense_memo) == 1
    assert next(iter(api._dense_memo.values()))[2] is not None  # a bound one-launch launcher
    second = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert last_dispatch().impl == "sm90_fwd"
    qg = q.clone().requires_grad_()
    out, _ = flash_attn_func(qg, k, v, causal=True)
    assert torch.equal(out, first[0]) and out.grad_fn is not None
    out.float().sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_fwd_memo_hit_decode_split_packed(num_splits):
    # decode rows (Sq = 1, GQA) pack the query heads of a KV head and may split the keys:
    # the bound launcher allocates the partials and runs the combine as run_fwd does
    from cute_attn import api

    q, k, v = attn_inputs(3, 1, 5000, 8, 2, 128, 128, torch.bfloat16)
    api._dense_memo.clear()
    first = flash_attn_func(q, k, v, causal=True, num_splits=num_splits)
    assert next(iter(api._dense_memo.values()))[2] is not None
    second = flash_attn_func(q.clone(), k, v, causal=True, num_splits=num_splits)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    ref, ref_lse = attention_ref(q, k, v, compute_dtype=torch.float32, causal=True)
    same, _ = attention_ref(q, k, v, compute_dtype=None, causal=True)
    assert_matches(second[0], second[1], ref, ref_lse, same)


@pytest.mark.gpu
def test_fwd_decode_wide_grid(monkeypatch):
    # 17 x 8 KV heads fill every SM unsplit: the two-CTAs-per-SM decode tile, odd Sk
    from cute_attn import api, fwd_sm90
    from cute_attn.arch.sm90.tile_config import FwdTileConfig

    keys, build = [], fwd_sm90.build_fwd
    monkeypatch.setattr(fwd_sm90, "build_fwd", lambda key: (keys.append(key), build(key))[1])
    fwd_sm90._plan.cache_clear()
    api._dense_memo.clear()
    q, k, v = attn_inputs(17, 1, 333, 32, 8, 128, 128, torch.bfloat16)
    _check(q, k, v, causal=True)
    q, k, v = attn_inputs(17, 1, 5000, 32, 8, 128, 128, torch.float16)
    _check(q, k, v, causal=True, softcap=15.0)
    assert [FwdTileConfig(*key.tile).ctas_per_sm for key in keys] == [2, 2], keys


# L2 sections (the causal table's launch order at D=128 and D > 128): at most max_pairs
# (head, batch) pairs a section, so 9 pairs make sections of 2 (or 4) and a last one of 1,
# and every CTA's renamed (query tile, head, batch) in both kinds of section is checked
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("max_pairs", [2, 4])
@pytest.mark.parametrize("kw", [{"causal": True}, {"window_size": (None, 40)}])
def test_fwd_l2_sections_cover_every_tile(monkeypatch, d, max_pairs, kw):
    from cute_attn.arch.sm90.tile_config import FwdTileConfig

    def change(cfg):
        return dataclasses.replace(cfg, lpt_l2_sections=True, l2_section_max_pairs=max_pairs)

    with _forced_table(monkeypatch, change) as keys:
        _check(*attn_inputs(3, 457, 300, 3, 3, d, d, torch.bfloat16), **kw)
    (key,) = keys
    cfg = FwdTileConfig(*key.tile)
    assert cfg.lpt_l2_sections and cfg.l2_section_max_pairs == max_pairs, key


# FwdTileConfig.interleave_rescale (the softmax split at the P V anchor, O's rescale spread
# over the remaining exponentials), forced wherever it applies: anchors on part of a row,
# both row-max forms (the D=64 192-row tile at 3001 rows takes form 2), odd lengths (partial
# query and key tiles), masks and softcap
@pytest.mark.gpu
@pytest.mark.parametrize(
    "d,dv,sq,sk", [(64, 64, 457, 300), (64, 64, 3001, 3001), (128, 128, 457, 300),
                   (192, 128, 300, 457), (256, 256, 457, 300)]
)  # fmt: skip
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window_size": (40, 7)}, {"softcap": 30.0}])
def test_fwd_interleave_rescale_forced(monkeypatch, d, dv, sq, sk, kw):
    from cute_attn.arch.sm90.tile_config import FwdTileConfig

    def change(cfg):
        return dataclasses.replace(
            cfg, pin_pv_wait=True, pin_pv_anchor=cfg.pin_pv_anchor or 4, interleave_rescale=True
        )

    with _forced_table(monkeypatch, change) as keys:
        _check(*attn_inputs(2, sq, sk, 4, 2, d, dv, torch.bfloat16), **kw)
    (key,) = keys
    assert FwdTileConfig(*key.tile).interleave_rescale, key


# Persistent grids (FwdTileConfig.persistent_ctas): CTA c walks the (query tile, head, batch)
# tiles c, c + ctas, ... (under a mask: passes of `ctas` tiles in alternating directions) with
# its pipelines running on from tile to tile. 1 and 5 CTAs give every CTA many tiles across
# heads and batches (odd lengths: a partial last query tile and key tile), 132 one or two.
# Sq > Sk: under the causal mask the first query rows see no key, so whole tiles have no work
# (out 0, lse -inf) between tiles that have. Windows: a ramp of paired tiles, then single ones
# (PersistentUnits.unit_tile), and a left bound alone (single tiles). The outputs start
# poisoned, so a tile left unwritten shows.
@pytest.mark.gpu
@pytest.mark.parametrize("d,sq", [(64, 457), (64, 2200), (96, 300), (128, 457)])
@pytest.mark.parametrize("ctas", [1, 5, 132])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"softcap": 9.0},
        {"causal": True},
        {"window_size": (37, 11)},
        {"window_size": (150, 0)},
        {"window_size": (20, -1)},
    ],
    ids=["dense", "softcap", "causal", "window", "window-ramp", "window-left"],
)
def test_fwd_persistent_covers_every_tile(monkeypatch, d, sq, ctas, kw):
    from cute_attn.arch.sm90.tile_config import FwdTileConfig

    def change(cfg):
        return dataclasses.replace(cfg, persistent_ctas=ctas)

    with _forced_table(monkeypatch, change) as keys:
        q, k, v = attn_inputs(3, sq, 301, 6, 2, d, d, torch.bfloat16)
        junk_o = torch.full((3, sq, 6, d), POISON, device="cuda", dtype=torch.bfloat16)
        junk_l = torch.full((3, 6, sq), POISON, device="cuda", dtype=torch.float32)
        ptrs = {junk_o.data_ptr(), junk_l.data_ptr()}
        del junk_o, junk_l
        out, lse = _check(q, k, v, **kw)
    assert {out.data_ptr(), lse.data_ptr()} == ptrs, "poisoned blocks were not reused"
    (key,) = keys
    assert FwdTileConfig(*key.tile).persistent_ctas == ctas, key


# D=64 at 16k rows under a narrow sliding window: the 64-row tile on a persistent grid
# (tile_config.fills_tall_tiles keeps 192-row tiles for windows >= 4096 keys wide)
@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk,window", [(16384, 16384, (512, 0)), (16500, 16000, (300, 200))])
def test_fwd_d64_long_narrow_window(monkeypatch, sq, sk, window):
    from cute_attn.arch.sm90.tile_config import FwdTileConfig

    with _forced_table(monkeypatch, lambda cfg: cfg) as keys:
        _check(*attn_inputs(1, sq, sk, 2, 1, 64, 64, torch.bfloat16), window_size=window)
    (key,) = keys
    cfg = FwdTileConfig(*key.tile)
    assert cfg.tile_m == 64 and cfg.persistent_ctas > 0, key


@pytest.mark.gpu
def test_fwd_grad_matches_reference():
    q, k, v = (t.requires_grad_() for t in attn_inputs(1, 64, 80, 2, 1, 64, 64, torch.float16))
    out, _ = flash_attn_func(q, k, v, causal=True)
    out.float().sum().backward()
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, _ = attention_ref(qr, kr, vr, causal=True)
    ref.sum().backward()
    for a, r in ((q, qr), (k, kr), (v, vr)):
        assert (a.grad.float() - r.grad).abs().max().item() < 2e-2


# ---------------------------------------------------------------- CPU: compile for sm_90a
_COMPILE_SNIPPET = r"""
import json, os, sys
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import compile_variants
# one build process per core (CI: 2), as `python -m cute_attn compile` does by default
# where memory allows
rows = compile_variants("sm_90a", head_dims=[int(x) for x in sys.argv[1].split(",")],
                        dtypes=sys.argv[2].split(","), progress=False,
                        jobs=len(os.sched_getaffinity(0)))
print(json.dumps(rows))
"""


@pytest.mark.compile
@pytest.mark.parametrize(
    "head_dims,dtypes", [("64,96,128,192,256", "bf16"), ("64,96,128,192,256", "fp16")]
)
def test_compile_sm90_variants(head_dims, dtypes, tmp_path):
    rows = run_json_snippet(_COMPILE_SNIPPET, tmp_path, head_dims, dtypes, timeout=1800)
    assert rows, "no variant compiled"
    aux = [r for r in rows if r["kind"] == "sm90_aux"]
    # the combine per head_dim_v (64, 96, 128, 192, 256) and every index-check set
    assert len([r for r in aux if "combine" in r["name"]]) == 5, aux
    assert len([r for r in aux if "index_check" in r["name"]]) == 15, aux
    # the backward's pre/postprocess per head-dim pair: dense, and packed per table tile_m
    # (64 and 128 at D=64; 96 / 80, and 64 for softcap / group_heads, at D=96 / 128; 64 past
    # D=128); the register-order dQ tiles (dq_flat: D=64's 128 rows, D=96 / 128's 96 / 80)
    # have their own, dense and packed: 2 kinds x (4 + 4 + 4 + 2 + 2 + 2 forms); and the dense
    # ones are the postprocesses that wait for the main grid's done counts (post_overlap)
    # and the persistent preprocesses that count ready rows (pre_overlap), in row order at
    # every head-dim pair and register order too at D <= 128: 9 of each (the lse gradient's
    # preprocess builds at its first call)
    bwd_aux = [r for r in aux if r["name"].startswith("sm90_bwd_")]
    assert len(bwd_aux) == 36, aux
    assert len([r for r in bwd_aux if "dq_flat" in r["name"]]) == 12, aux
    assert len([r for r in bwd_aux if r["name"].endswith("wait_done")]) == 9, aux
    assert len([r for r in bwd_aux if r["name"].endswith("pre_overlap")]) == 9, aux
    # the GQA backward that walks a KV head's query heads, per head-dim pair (heads 8:2),
    # unmasked and causal (in L2 sections; not D=64 causal, see bwd_tiles.bwd_group_heads),
    # and causal on packed sequences (from D=96 too)
    grouped = [r for r in rows if r["name"].endswith(" group_heads")]
    assert len([r for r in grouped if "varlen" not in r["name"]]) == 11, rows
    assert len([r for r in grouped if "varlen" in r["name"]]) == 5, rows
    # persistent grids of dense forwards: unmasked at D = 64 (both row buckets), 96 and 128;
    # causal at D = 64, 96 and 128; under a sliding window (128 keys) at D = 64, 96 and 128
    persistent = [r for r in rows if r["name"].endswith(" persistent")]
    masked = ("causal persistent", "window persistent")
    assert len([r for r in persistent if not r["name"].endswith(masked)]) == 4, rows
    assert len([r for r in persistent if "causal persistent" in r["name"]]) == 3, rows
    assert len([r for r in persistent if "window persistent" in r["name"]]) == 3, rows
    # packed GQA rows (KV-cache, split, packed sequences; heads 8:2) per head-dim pair, where
    # the rule packs a few query rows (tile_config.fwd_pack_gqa), and the KV-cache ones on
    # the wide decode tile where fwd_pack_gqa_wide takes it
    from cute_attn.arch.sm90.tile_config import fwd_pack_gqa, fwd_pack_gqa_wide

    packed = [r for r in rows if " pack_gqa " in r["name"]]
    assert len(packed) == (3 + fwd_pack_gqa_wide()) * 6 * fwd_pack_gqa(2, 64, 4), rows
    for r in rows:
        assert r["ok"], r
        assert r["spills"] == 0, r
        if r["kind"] == "sm90_aux":
            continue  # their instructions meant are in r["instructions"], checked by ok
        for instr in ("HGMMA", "UTMALDG", "USETMAXREG"):
            assert r["instructions"][instr], (instr, r)
        # O leaves by TMA store except where split partials need row-predicated stores
        # (aot.DIRECT_STORE_INPUTS); packed sequences store through a ragged TMA view
        direct = " split" in r["name"]
        assert r["instructions"].get("UTMASTG", False) != direct or "sm90_bwd" in r["name"], r


_PTX_SNIPPET = r"""
import json, os, sys
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.arch.sm90.compile import FwdSpec, compile_fwd
from cute_attn.arch.sm90.tile_config import fwd_tile_config
d = int(sys.argv[1])
spec = FwdSpec("bfloat16", d, d, 8, 8, False, False, False, fwd_tile_config(d, d, False, False))
ptx = compile_fwd(spec, "--keep-ptx").__ptx__
print(json.dumps({"tile_n": spec.config.tile_n, "packed": ptx.count("cvt.rn.bf16x2.f32"),
                  "scalar": ptx.count("cvt.rn.bf16.f32")}))
"""


@pytest.mark.compile
def test_p_conversion_is_packed_for_odd_column_groups(tmp_path):
    # tile_n = 80 (D=256): 10 column groups of 8 per accumulator row, where the DSL's
    # .load().to() converted P one element at a time (arch/common/convert.py)
    r = run_json_snippet(_PTX_SNIPPET, tmp_path, "256", timeout=600)
    assert r["tile_n"] % 32 != 0, r
    assert r["scalar"] == 0 and r["packed"] > 0, r


_MASK_LOOP_SNIPPET = r"""  # run after MASK_WINDOWS
import dataclasses, json, os, sys, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.sm90.compile import FwdSpec, compile_fwd
from cute_attn.arch.sm90.tile_config import fwd_tile_config

def inf_tests(sass):
    # per main-loop window (as mask_windows): the compares against -inf (the row max guards)
    ops = re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)([^;]*);", sass)
    out, n = [], None
    for op, rest in ops:
        if op == "WARPGROUP.DEPBAR.LE" and rest.strip().endswith("0x1"):
            n = 0
        elif op == "WARPGROUP.DEPBAR.LE" and n is not None:
            out.append(n); n = None
        elif n is not None and op.startswith("FSETP") and "-INF" in rest:
            n += 1
    return out

out = {}
for causal, split in ((True, True), (True, False), (False, True)):
    # the one-loop variant with the compare form of the mask (mask_bits off) as well
    table = fwd_tile_config(128, 128, causal, False)
    cfg = dataclasses.replace(
        table, split_mask_loops=split, mask_bits=split,
        unguarded_visible_max=split and table.unguarded_visible_max,
    )
    spec = FwdSpec("bfloat16", 128, 128, 8, 8, False, causal, False, cfg)
    fn = compile_fwd(spec, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}")
    # one window per main-loop body (the peeled first tile waits with gsb0 <= 0 only)
    sass = _sass(fn.__cubin__)
    windows = mask_windows(sass)
    table = cfg == table
    # integer divisions (I2F.RP / MUFU.RCP / F2I) before the first Q load
    head = sass[: sass.index("UTMALDG")]
    divisions = sum(head.count(op) for op in ("I2F", "MUFU.RCP", "F2I"))
    out[f"{causal},{split}"] = {"windows": windows, "table": table, "divisions": divisions,
                                "r2p": sass.count("R2P"), "guards": inf_tests(sass)}  # fmt: skip
print(json.dumps(out))
"""


@pytest.mark.compile
def test_split_mask_loops_leaves_the_middle_loop_mask_free(tmp_path):
    # split_mask_loops (on at D=128): the fully visible key tiles run in a loop with no mask
    # select at all; the causal edge loop keeps the mask (behind its per-tile test); without
    # the split the one loop carries the mask code (taken or not, per tile). Also mask_bits
    r = run_json_snippet(MASK_WINDOWS + _MASK_LOOP_SNIPPET, tmp_path, timeout=900)
    on, off, plain = r["True,True"], r["True,False"], r["False,True"]
    assert on["table"] and plain["table"] and not off["table"], r
    assert len(on["windows"]) == 2 and sorted(on["windows"])[0] == 0 < on["windows"][0], r
    assert len(off["windows"]) == 1 and off["windows"][0] >= 64, r
    assert plain["windows"] == [0], r
    # the causal table variant takes L2 sections; their sizes and divisors come from the
    # host (L2Sections), so no warp divides before the CTA's first load
    assert on["divisions"] == 0, r
    # mask_bits: the edge tiles' keep bits reach the predicates through R2P (7 at a time),
    # where the compare form has one or two ISETP an element and no R2P
    assert on["r2p"] >= 8 and off["r2p"] == 0, r
    # unguarded_visible_max (the causal table variant): the mask-free loop compares nothing
    # with -inf; the edge loop keeps the row max guards, and so does the unmasked variant,
    # whose table entry leaves the switch off
    assert on["guards"][on["windows"].index(0)] == 0, r
    assert on["guards"][1 - on["windows"].index(0)] > 0 and plain["guards"][0] > 0, r


_PV_WAIT_SNIPPET = r"""
import dataclasses, json, os, re, sys, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.sm90.compile import FwdSpec, compile_fwd
from cute_attn.arch.sm90.tile_config import fwd_tile_config

def windows(cfg, d):
    spec = FwdSpec("bfloat16", d, d, 8, 8, False, False, False, cfg)
    fn = compile_fwd(spec, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}")
    ops = re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)[^;]*?(?:gsb0, (0x[01]))?\s*;",
                     _sass(fn.__cubin__))
    # per "S done" wait (gsb0 <= 1) up to the next "all done" (gsb0 <= 0): the exponentials
    # in between, and whether an mbarrier arrive (K's release) comes before the first one
    out, cur = [], None
    for op, depth in ops:
        if op == "WARPGROUP.DEPBAR.LE" and depth == "0x1":
            cur = {"exp": 0, "arrive_first": False}
        elif op == "WARPGROUP.DEPBAR.LE" and depth == "0x0" and cur is not None:
            out.append(cur); cur = None
        elif cur is not None and op == "MUFU.EX2":
            cur["exp"] += 1
        elif cur is not None and op.startswith("SYNCS.ARRIVE") and cur["exp"] == 0:
            cur["arrive_first"] = True
    return out

tall = fwd_tile_config(64, 64, False, False, tall=True)
d128 = fwd_tile_config(128, 128, False, False)
out = {n: [c.pin_pv_wait, c.pin_pv_anchor] for n, c in (("tall", tall), ("d128", d128))}
out["tall,table"] = windows(tall, 64)
krel = dataclasses.replace(tall, pin_pv_anchor=0, split_mask_loops=False)
out["tall,krel"] = windows(krel, 64)
out["tall,off"] = windows(dataclasses.replace(krel, pin_pv_wait=False), 64)
out["d128,table"] = windows(d128, 128)
out["d128,off"] = windows(dataclasses.replace(d128, pin_pv_wait=False, pin_pv_anchor=0), 128)
print(json.dumps(out))
"""


@pytest.mark.compile
def test_pin_pv_wait_keeps_softmax_before_the_pv_wait(tmp_path):
    # with the overlap, softmax(j) should run while P(j-1) V(j-1) is on the tensor cores.
    # Without pin_pv_wait, ptxas 13.0 hoists the PV wait to just below K(j)'s release at the
    # top of the softmax (0 exponentials before it). With the anchor on a barrier of its own
    # after k probabilities (the table: k = 4 at D=128 and at the 192-row D=64 tile), K is
    # released before the first exponential and some exponentials (at least the anchor's k)
    # run before the wait.
    # The K release as the anchor (pin_pv_anchor=0, no table entry now) holds the wait after
    # the row sums: every exponential of the S tile (2 rows x tile_n / 4 columns, + 2 row
    # rescales) comes first.
    r = run_json_snippet(_PV_WAIT_SNIPPET, tmp_path, timeout=900)
    assert r["tall"] == [True, 4] and r["d128"] == [True, 4], r  # what the tuning table picks
    for name, k in (("tall", 4), ("d128", 4)):
        # the main-loop windows (the split loop's two, or more); the first tile has no PV wait
        table = r[f"{name},table"]
        assert table and all(w["arrive_first"] and w["exp"] >= k for w in table), r
    krel, off = r["tall,krel"], r["tall,off"]
    assert krel and min(w["exp"] for w in krel) >= 2 * 128 // 4, r
    assert off and max(w["exp"] for w in off) == 0, r
    off = r["d128,off"]
    assert off and all(w["exp"] == 0 for w in off), r


_INTERLEAVE_SNIPPET = r"""
import dataclasses, json, os, re, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.sm90.compile import FwdSpec, compile_fwd
from cute_attn.arch.sm90.tile_config import fwd_tile_config

def windows(cfg):
    spec = FwdSpec("bfloat16", 64, 64, 8, 8, False, True, False, cfg)
    fn = compile_fwd(spec, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}")
    ops = re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)\s*([^;]*);", _sass(fn.__cubin__))
    # from each P V wait (gsb0 <= 0) to the next wgmma wait: O's rescale (in-place FMULs by a
    # register) and the exponentials issued after its first multiply
    out, cur = [], None
    for op, args in ops:
        if op == "WARPGROUP.DEPBAR.LE":
            if cur is not None:
                out.append(cur)
            cur = {"fmul": 0, "exp_after": 0} if args.strip().endswith("0x0") else None
        elif cur is not None and op == "MUFU.EX2" and cur["fmul"]:
            cur["exp_after"] += 1
        elif cur is not None and op == "FMUL":
            a = [x.strip() for x in args.split(",")]
            if len(a) == 3 and a[0] == a[1] and re.fullmatch(r"R\d+(\.reuse)?", a[2]):
                cur["fmul"] += 1
    return [w for w in out if w["fmul"]]

table = fwd_tile_config(64, 64, True, False, tall=True)
out = {"table": table.interleave_rescale, "on": windows(table)}
out["off"] = windows(dataclasses.replace(table, interleave_rescale=False))
print(json.dumps(out))
"""


@pytest.mark.compile
def test_interleave_rescale_puts_o_multiplies_among_the_exponentials(tmp_path):
    # interleave_rescale (the D=64 192-row tile under the causal mask): O's 32 rescale
    # multiplies a thread start right after the P V wait, with most of the 64 exponentials
    # still to come; without it ptxas issues them after all but the last few
    r = run_json_snippet(_INTERLEAVE_SNIPPET, tmp_path, timeout=900)
    assert r["table"], r
    # the main loops (the split loop's edge and middle); the first tile has no rescale
    assert len(r["on"]) >= 2 and all(w["fmul"] == 32 and w["exp_after"] >= 32 for w in r["on"]), r
    assert len(r["off"]) >= 2 and all(w["fmul"] == 32 and w["exp_after"] <= 16 for w in r["off"]), r


_ROW_MAX_SNIPPET = r"""
import dataclasses, json, os, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_attn.aot import _sass
from cute_attn.arch.sm90.compile import FwdSpec, compile_fwd
from cute_attn.arch.sm90.tile_config import fwd_tile_config

out = {}
for form in (0, 1):
    cfg = dataclasses.replace(fwd_tile_config(64, 64, False, False), row_max_form=form)
    spec = FwdSpec("bfloat16", 64, 64, 8, 8, False, False, False, cfg)
    sass = _sass(compile_fwd(spec, f"--keep-cubin --dump-dir={tempfile.mkdtemp()}").__cubin__)
    out[form] = {op: sass.count(op) for op in ("FSETP.NAN", "SHFL.BFLY", "MUFU.EX2", "STL")}
print(json.dumps(out))
"""


@pytest.mark.compile
def test_row_max_form_1_shuffles_with_one_fmnmx(tmp_path):
    # form 0 (the table's default) takes the DSL's generic max on the first shuffle step of
    # each row max: a NaN test and a select around the compare (FSETP.NAN in the SASS); form 1
    # passes the reduce's result as Float32, so every step is one FMNMX. Same math otherwise.
    r = run_json_snippet(_ROW_MAX_SNIPPET, tmp_path, timeout=900)
    form0, form1 = r["0"], r["1"]
    assert form0["FSETP.NAN"] > 0 and form1["FSETP.NAN"] == 0, r
    for op in ("SHFL.BFLY", "MUFU.EX2"):
        assert form0[op] == form1[op] > 0, r
    assert form0["STL"] == form1["STL"] == 0, r
