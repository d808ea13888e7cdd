"""Dispatch policy on the CPU: which implementation a problem gets, and the errors otherwise.

Device capability is faked by replacing dispatch.device_arch (the one reader of it), so every
branch runs without a GPU; no kernel is launched here.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
import torch

import cute_attn
from cute_attn import dispatch
from cute_attn.problem import AttnProblem

BASE = AttnProblem(
    batch=2, seqlen_q=100, seqlen_k=120, num_heads=8, num_heads_kv=2, head_dim=128,
    head_dim_v=128, dtype="bfloat16", device_type="cuda", device_index=0,
    softmax_scale=128**-0.5, causal=True, window_left=-1, window_right=0, softcap=0.0,
)  # fmt: skip


def _tensors(d=128, stride_ok=True):
    q = torch.empty(2, 100, 8, d, dtype=torch.bfloat16)
    if not stride_ok:
        q = torch.empty(2, 100, 8, d + 1, dtype=torch.bfloat16)[..., :d]
    k = torch.empty(2, 120, 2, d, dtype=torch.bfloat16)
    return (("q", q), ("k", k), ("v", k))


@pytest.fixture
def fake_arch(monkeypatch):
    def use(arch):
        monkeypatch.setattr(dispatch, "device_arch", lambda index: arch)

    dispatch._warned.clear()
    return use


def test_cpu_problem_runs_reference():
    d = dispatch.select(dataclasses.replace(BASE, device_type="cpu"), ())
    assert d.impl == "reference" and d.arch is None
    assert dispatch.last_dispatch() == d


def test_sm90_serves_supported_problem(fake_arch):
    fake_arch("sm_90a")
    d = dispatch.select(BASE, _tensors())
    assert (d.impl, d.arch) == ("sm90_fwd", "sm_90a")


@pytest.mark.parametrize(
    "change,needle",
    [
        (dict(head_dim=80, head_dim_v=80), "head dims (80, 80)"),
        (dict(dtype="float32"), "dtype float32"),
    ],
)
def test_sm90_unserved_problem_raises_with_reason(fake_arch, change, needle):
    fake_arch("sm_90a")
    with pytest.raises(NotImplementedError) as e:
        dispatch.select(dataclasses.replace(BASE, **change), _tensors())
    assert needle in str(e.value) and "fallback='reference'" in str(e.value)
    assert dispatch.last_dispatch().impl == "none"


@pytest.mark.parametrize(
    "change",
    [dict(varlen=True), dict(varlen=True, has_seqused_k=True, has_seqused_q=True),
     dict(num_splits=4)],
)  # fmt: skip
def test_sm90_serves_varlen_and_splits(fake_arch, change):
    fake_arch("sm_90a")
    assert dispatch.select(dataclasses.replace(BASE, **change), _tensors()).impl == "sm90_fwd"


ROUTES = [(1, "gather"), (8, "gather"), (16, "tma"), (64, "tma"), (200, "gather"), (256, "tma")]


@pytest.mark.parametrize("page_size,route", ROUTES)
@pytest.mark.parametrize("kvcache", [False, True])
def test_sm90_serves_paged_and_says_how(fake_arch, page_size, route, kvcache):
    # paged k / v run the kernel; dispatch's reason says when torch gathers the pages first
    from cute_attn.fwd_sm90 import paged_route

    fake_arch("sm_90a")
    sq = 1 if kvcache else BASE.seqlen_q
    p = dataclasses.replace(
        BASE, varlen=not kvcache, kvcache=kvcache, paged=True, page_size=page_size, seqlen_q=sq
    )
    d = dispatch.select(p, _tensors())
    assert d.impl == "sm90_fwd" and paged_route(p) == route
    assert ("gathers the pages" in d.reason) == (route == "gather"), d.reason


# (Sq, H, Hkv, left window, pack_gqa, varlen, what the reason says of GQA tiles)
GQA_NOTES = [
    (1, 8, 2, -1, None, False, "share one tile (GQA decode view)"),
    (1, 8, 2, -1, True, False, "share one tile (GQA decode view)"),
    (1, 8, 2, -1, False, False, None),
    (4, 8, 2, -1, None, False, "the 4 query heads of each KV head packed"),  # the rule
    (4, 8, 2, -1, True, False, "the 4 query heads of each KV head packed"),
    (100, 8, 2, -1, True, False, None),  # 100 query rows: packing loses there
    (100, 8, 2, -1, None, False, None),
    (1, 8, 2, 50, True, False, "packed into the tile's rows"),  # no decode view: a left bound
    (4, 8, 2, -1, True, True, "packed into the tile's rows"),  # packed sequences
    (4, 28, 4, -1, True, False, "packed into the tile's rows"),  # G = 7: padded tiles
    (4, 28, 4, -1, None, False, "the 7 query heads of each KV head packed"),
    (4, 28, 4, -1, False, False, None),
    (4, 96, 1, -1, True, False, None),  # G = 96: past a tile, not a multiple of it
    (4, 8, 8, -1, True, False, None),  # MHA
]


@pytest.mark.parametrize("sq,h,hkv,left,pack,varlen,note", GQA_NOTES)
def test_sm90_says_how_gqa_heads_share_tiles(fake_arch, sq, h, hkv, left, pack, varlen, note):
    # the table's rule (tile_config.fwd_pack_gqa; pack_gqa=True asks for no more) packs a few
    # query rows in the kernel, padded tiles too; the reason says what the launch does
    fake_arch("sm_90a")
    p = dataclasses.replace(
        BASE, seqlen_q=sq, num_heads=h, num_heads_kv=hkv, window_left=left, pack_gqa=pack,
        varlen=varlen,
    )  # fmt: skip
    d = dispatch.select(p, _tensors())
    assert d.impl == "sm90_fwd"
    if note is None:
        assert d.reason == "SM90 forward kernel", d.reason
    else:
        assert note in d.reason, d.reason


def test_varlen_gradients_need_packed_kv(fake_arch):
    # packed q and k / v under autograd run the kernel (the varlen backward serves them);
    # seqused, pages and KV-cache calls that need gradients are refused with the reason
    fake_arch("sm_90a")
    tensors = tuple((name, t.requires_grad_()) for name, t in _tensors())
    assert dispatch.select(dataclasses.replace(BASE, varlen=True), tensors).impl == "sm90_fwd"
    assert dispatch.select(BASE, tensors).impl == "sm90_fwd"  # dense: the kernel backward
    refused = [
        ({"has_seqused_q": True}, "seqused_q"),
        ({"has_seqused_k": True}, "seqused_q / seqused_k"),
        ({"paged": True, "page_size": 64}, "paged / KV-cache"),
    ]
    for change, words in refused:
        p = dataclasses.replace(BASE, varlen=True, **change)
        with pytest.raises(NotImplementedError, match=f"gradients through {words}"):
            dispatch.select(p, tensors)
    with pytest.raises(NotImplementedError, match="gradients through paged / KV-cache"):
        dispatch.select(dataclasses.replace(BASE, kvcache=True), tensors)
    with torch.no_grad():  # no gradients needed: every layout runs the forward kernel
        p = dataclasses.replace(BASE, varlen=True, has_seqused_q=True)
        assert dispatch.select(p, tensors).impl == "sm90_fwd"


def test_varlen_backward_dispatch_names_the_kernel(fake_arch):
    # the backward of a packed call records the SM90 kernel; a seqused or paged problem has no
    # varlen backward at all (its tensors do not carry the lengths / pages): it raises
    from cute_attn.bwd_sm90 import backward_varlen, bwd_kernel_note, bwd_unsupported_reason

    fake_arch("sm_90a")
    p = dataclasses.replace(BASE, varlen=True)
    d = dispatch.select_backward(p, _tensors(), bwd_unsupported_reason, bwd_kernel_note)
    assert (d.entry, d.impl) == ("backward", "sm90_bwd"), d
    for change in ({"has_seqused_k": True}, {"paged": True, "page_size": 16}):
        with pytest.raises(NotImplementedError, match="no backward for gradients through"):
            backward_varlen(*(None,) * 6, dataclasses.replace(p, **change),
                            cu_seqlens_q=None, cu_seqlens_k=None)  # fmt: skip


def test_unaligned_strides_are_named(fake_arch):
    fake_arch("sm_90a")
    with pytest.raises(NotImplementedError, match="q strides"):
        dispatch.select(BASE, _tensors(stride_ok=False))


def test_other_arch_raises_then_falls_back_once(fake_arch, monkeypatch):
    fake_arch("sm_80")
    with pytest.raises(NotImplementedError, match="no cute_attn kernel for sm_80"):
        dispatch.select(BASE, _tensors())
    with pytest.warns(RuntimeWarning, match="slow reference"):
        d = dispatch.select(BASE, _tensors(), fallback="reference")
    assert d.impl == "reference" and d.reason.startswith("fallback:")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: no warning
        dispatch.select(BASE, _tensors(), fallback="reference")
    monkeypatch.setenv("CUTE_ATTN_FALLBACK", "reference")
    assert dispatch.select(BASE, _tensors()).impl == "reference"


def test_bad_fallback_value(fake_arch):
    fake_arch("sm_80")
    with pytest.raises(ValueError, match="fallback"):
        dispatch.select(BASE, _tensors(), fallback="maybe")


def test_decisions_are_logged(fake_arch, caplog):
    fake_arch("sm_90a")
    with caplog.at_level(logging.DEBUG, logger="cute_attn"):
        dispatch.select(BASE, _tensors(), entry="flash_attn_func")
    assert "flash_attn_func -> sm90_fwd" in caplog.text


def test_api_records_reference_on_cpu():
    q = torch.randn(1, 4, 2, 8)
    cute_attn.flash_attn_func(q, q, q)
    assert cute_attn.last_dispatch().impl == "reference"


def test_support_summary_without_gpu():
    s = dispatch.support_summary()
    if not torch.cuda.is_available():
        assert s["kernels"] == [] and s["arch"] is None


# ------------------------------------------------- the dense entry's host fast path (memo)
@pytest.fixture
def served_on_cpu(monkeypatch):
    """CPU tensors treated as if the SM90 kernel served them: dispatch says so, the kernel is
    a stub, and validate_dense calls are counted (the memo exists to skip them)."""
    from cute_attn import api, fwd_sm90

    calls = {"validate": 0, "run": 0}
    real_validate = api.validate_dense

    def counting_validate(*a, **kw):
        calls["validate"] += 1
        return real_validate(*a, **kw)

    def select(p, tensors, fallback=None, entry="flash_attn_func"):
        return dispatch._record(dispatch.Decision("sm90_fwd", "sm_90a", "stub", entry))

    def run_fwd(q, k, v, p):
        calls["run"] += 1
        return ("stub", p)

    monkeypatch.setattr(api, "validate_dense", counting_validate)
    monkeypatch.setattr(dispatch, "select", select)
    monkeypatch.setattr(fwd_sm90, "run_fwd", run_fwd)
    # no bound launcher (the default stub): memo hits go through run_fwd, which counts them
    monkeypatch.setattr(fwd_sm90, "dense_launcher", lambda q, p: calls.get("launcher"))
    api._dense_memo.clear()
    yield calls
    api._dense_memo.clear()


def test_fast_path_reuses_problem_and_decision(served_on_cpu):
    q = torch.randn(2, 10, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 12, 2, 64, dtype=torch.bfloat16)
    first = cute_attn.flash_attn_func(q, k, k, causal=True)
    dispatch._local.decision = None
    second = cute_attn.flash_attn_func(q, k, k, causal=True)
    assert served_on_cpu == {"validate": 1, "run": 2}
    assert first[1] is second[1]  # the very problem validation built
    assert cute_attn.last_dispatch().impl == "sm90_fwd"  # the decision is recorded again
    # other shapes, strides, scalars or scalar types miss the memo and validate
    cute_attn.flash_attn_func(q[:, :9], k, k, causal=True)
    cute_attn.flash_attn_func(q, k, k, causal=True, softcap=1.0)
    cute_attn.flash_attn_func(q.transpose(1, 2).contiguous().transpose(1, 2), k, k, causal=True)
    assert served_on_cpu["validate"] == 4


def test_fast_path_calls_the_bound_launcher(served_on_cpu, monkeypatch):
    # a memo hit with a launcher (what dense_launcher binds for a one-launch call) runs it
    # with the call's own tensors, and records the decision again
    seen = []
    served_on_cpu["launcher"] = lambda q, k, v: seen.append((q, k, v)) or ("launched",)
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 9, 2, 64, dtype=torch.bfloat16)
    assert cute_attn.flash_attn_func(q, k, k)[0] == "stub"  # the first call runs run_fwd
    dispatch._local.decision = None
    q2 = q.clone()
    assert cute_attn.flash_attn_func(q2, k, k) == ("launched",)
    assert len(seen) == 1 and seen[0][0] is q2 and seen[0][1] is k
    assert served_on_cpu["validate"] == 1 and served_on_cpu["run"] == 1
    assert cute_attn.last_dispatch().impl == "sm90_fwd"
    # a call that needs gradients never takes the launcher (autograd wraps run_fwd)
    monkeypatch.setattr(cute_attn.api._KernelAttn, "apply", lambda *a: ("autograd",))
    assert cute_attn.flash_attn_func(q.clone().requires_grad_(), k, k) == ("autograd",)
    assert len(seen) == 1


def test_fast_path_keeps_type_errors(served_on_cpu):
    # True == 1 and hash(True) == hash(1): the memo must not serve causal=1
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    cute_attn.flash_attn_func(q, q, q, causal=True)
    with pytest.raises(TypeError, match="causal"):
        cute_attn.flash_attn_func(q, q, q, causal=1)
    with pytest.raises(TypeError):  # unhashable: the full path names the argument
        cute_attn.flash_attn_func(q, q, q, softcap=[1.0])


# ----------------------------------------------- the KV-cache entry's host fast path (memo)
def _stub_served(monkeypatch, calls: dict, static_name: str) -> None:
    """The kernel path's surroundings for CPU calls: `api.<static_name>` (validation) counted,
    dispatch serving every call with the SM90 kernel (counted), and value checks that record
    their index_args instead of launching or reading anything."""
    from cute_attn import api, validation

    calls.update(validate=0, select=0, defer=0, wait=0, checked=[])
    real_static = getattr(api, static_name)

    def counting_static(*a, **kw):
        calls["validate"] += 1
        return real_static(*a, **kw)

    def select(p, tensors, fallback=None, entry="flash_attn_func"):
        calls["select"] += 1
        return dispatch._record(dispatch.Decision("sm90_fwd", "sm_90a", "stub", entry))

    def defer(self, flags_fn):
        calls["defer"] += 1
        calls["checked"].append(self.index_args)

    def wait(self):
        calls["wait"] += 1

    monkeypatch.setattr(api, static_name, counting_static)
    monkeypatch.setattr(dispatch, "select", select)
    monkeypatch.setattr(validation.ValueCheck, "defer", defer)
    monkeypatch.setattr(validation.ValueCheck, "wait", wait)


def _stub_launcher(monkeypatch, calls: dict, name: str) -> None:
    """`fwd_sm90.<name>` (a memo's launcher builder) as a stub: counts the launchers bound
    (calls["bound"]); each launcher records its call's arguments (calls["launch"]) and returns
    ("launched", the problem it was bound with)."""
    from cute_attn import fwd_sm90

    calls.update(launch=[], bound=0)

    def launcher(*args, **kw):
        calls["bound"] += 1
        p = next(a for a in args if isinstance(a, AttnProblem))

        def launch(*call_args):
            calls["launch"].append(call_args)
            return ("launched", p)

        return launch

    monkeypatch.setattr(fwd_sm90, name, launcher)


@pytest.fixture
def kvcache_served_on_cpu(monkeypatch):
    """CPU KV-cache calls treated as served by the SM90 kernel: dispatch says so, the kernel
    and the bound launcher are stubs, validation and value checks are counted."""
    from cute_attn import api, fwd_sm90

    calls = {"run": 0}
    _stub_served(monkeypatch, calls, "validate_kvcache_static")
    _stub_launcher(monkeypatch, calls, "kvcache_launcher")

    def run_fwd_kvcache(q, k_cache, v_cache, p, **kw):
        calls["run"] += 1
        return ("run", p)

    monkeypatch.setattr(fwd_sm90, "run_fwd_kvcache", run_fwd_kvcache)
    api._kvcache_memo.clear()
    yield calls
    api._kvcache_memo.clear()


def _kv_inputs(b=3, paged=False):
    q = torch.randn(b, 1, 8, 64, dtype=torch.bfloat16)
    if paged:
        kc = torch.randn(10, 16, 2, 64, dtype=torch.bfloat16)
        table = torch.arange(b * 2, dtype=torch.int32).view(b, 2)
        return q, kc, table
    return q, torch.randn(b, 40, 2, 64, dtype=torch.bfloat16), None


def test_kvcache_fast_path_skips_validation_and_checks_each_call(kvcache_served_on_cpu):
    calls = kvcache_served_on_cpu
    q, kc, _ = _kv_inputs()
    lens = torch.tensor([5, 40, 0], dtype=torch.int32)
    first = cute_attn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens)
    assert first[0] == "run" and calls["validate"] == 1
    dispatch._local.decision = None
    lens2 = torch.tensor([1, 2, 3], dtype=torch.int32)
    q2 = q.clone()
    second = cute_attn.flash_attn_with_kvcache(q2, kc, kc, cache_seqlens=lens2)
    assert second == ("launched", first[1])  # the very problem validation built
    assert calls["validate"] == 1
    assert cute_attn.last_dispatch().entry == "flash_attn_with_kvcache"
    (args,) = calls["launch"]
    assert args[0] is q2 and args[1] is kc and args[3] is lens2  # the call's own tensors
    # each call's own index values are checked: deferred and read after the launch
    assert calls["defer"] == calls["wait"] == 2
    assert calls["checked"][0][1][3] is lens and calls["checked"][1][1][3] is lens2


def test_kvcache_fast_path_misses(kvcache_served_on_cpu, monkeypatch):
    calls = kvcache_served_on_cpu
    q, kc, table = _kv_inputs(paged=True)
    lens = torch.tensor([5, 32, 0], dtype=torch.int32)
    for _ in range(2):
        cute_attn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, page_table=table)
    assert calls["validate"] == 1 and len(calls["launch"]) == 1
    # another page table shape, scalar, scalar type or lengths type takes the full path
    cute_attn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, page_table=table[:, :1])
    cute_attn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, page_table=table, softcap=2.0)
    with pytest.raises(TypeError, match="causal"):
        cute_attn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, page_table=table, causal=1)
    cute_attn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=5, page_table=table)
    cute_attn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=5, page_table=table)
    assert calls["validate"] == 6 and len(calls["launch"]) == 1  # int lengths: never memoized
    # an append always validates (its values are read before the write)
    new = torch.randn(3, 1, 2, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(cute_attn.inference, "kvcache_prepare", lambda *a, **kw: (q, lens, None))
    cute_attn.flash_attn_with_kvcache(q, kc, kc, new, new, cache_seqlens=lens, page_table=table)
    cute_attn.flash_attn_with_kvcache(q, kc, kc, new, new, cache_seqlens=lens, page_table=table)
    assert calls["validate"] == 8


def test_kvcache_fast_path_without_launcher(kvcache_served_on_cpu, monkeypatch):
    # no bound launcher (gathered pages, empty sizes): a memo hit still skips validation and
    # runs the kernel path with the call's own tensors
    from cute_attn import fwd_sm90

    calls = kvcache_served_on_cpu
    monkeypatch.setattr(fwd_sm90, "kvcache_launcher", lambda *a, **kw: None)
    q, kc, table = _kv_inputs(paged=True)
    lens = torch.tensor([5, 32, 0], dtype=torch.int32)
    for _ in range(3):
        out = cute_attn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, page_table=table)
    assert out[0] == "run" and calls["run"] == 3 and calls["validate"] == 1
    assert calls["defer"] == calls["wait"] == 3 and calls["launch"] == []


def test_kvcache_fast_path_without_value_checks(kvcache_served_on_cpu, monkeypatch):
    # CUTE_ATTN_CHECK_VALUES is read per call, on memo hits too
    calls = kvcache_served_on_cpu
    q, kc, _ = _kv_inputs()
    lens = torch.tensor([5, 40, 0], dtype=torch.int32)
    monkeypatch.setenv("CUTE_ATTN_CHECK_VALUES", "0")
    cute_attn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens)
    cute_attn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens)
    assert calls["defer"] == 0 and calls["validate"] == 1
    monkeypatch.setenv("CUTE_ATTN_CHECK_VALUES", "1")
    cute_attn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens)
    assert calls["defer"] == calls["wait"] == 1 and calls["validate"] == 1


# --------------------------------------------------- the varlen entry's host fast path (memo)
@pytest.fixture
def varlen_served_on_cpu(monkeypatch):
    """CPU varlen calls treated as served by the SM90 kernel: dispatch says so, the kernel and
    the bound launcher are stubs, validation, dispatch and value checks are counted."""
    from cute_attn import api, fwd_sm90

    calls = {"run": []}
    _stub_served(monkeypatch, calls, "validate_varlen_static")
    _stub_launcher(monkeypatch, calls, "varlen_launcher")

    def run_fwd_varlen(q, k, v, p, **kw):
        calls["run"].append((q, kw))
        return ("run", p)

    monkeypatch.setattr(fwd_sm90, "run_fwd_varlen", run_fwd_varlen)
    api._varlen_memo.clear()
    yield calls
    api._varlen_memo.clear()


def _varlen_inputs(paged=False):
    q = torch.randn(7, 8, 64, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 1, 5, 7], dtype=torch.int32)
    if paged:
        kc = torch.randn(10, 16, 2, 64, dtype=torch.bfloat16)
        table = torch.arange(6, dtype=torch.int32).view(3, 2)
        return q, kc, dict(cu_seqlens_q=cu_q, page_table=table,
                           seqused_k=torch.tensor([3, 32, 0], dtype=torch.int32))  # fmt: skip
    k = torch.randn(40, 2, 64, dtype=torch.bfloat16)
    return (
        q,
        k,
        dict(cu_seqlens_q=cu_q, cu_seqlens_k=torch.tensor([0, 5, 35, 40], dtype=torch.int32)),
    )


def test_varlen_fast_path_skips_validation_and_checks_each_call(varlen_served_on_cpu, monkeypatch):
    calls = varlen_served_on_cpu
    q, k, index = _varlen_inputs()
    first = cute_attn.flash_attn_varlen_func(q, k, k, max_seqlen_q=4, max_seqlen_k=30,
                                             causal=True, **index)  # fmt: skip
    assert first[0] == "run" and calls["validate"] == calls["select"] == 1
    dispatch._local.decision = None
    q2, cu_k2 = q.clone(), torch.tensor([0, 1, 2, 40], dtype=torch.int32)
    second = cute_attn.flash_attn_varlen_func(q2, k, k, max_seqlen_q=4, max_seqlen_k=30,
                                              causal=True, cu_seqlens_q=index["cu_seqlens_q"],
                                              cu_seqlens_k=cu_k2)  # fmt: skip
    assert second == ("launched", first[1])  # the very problem validation built
    assert calls["validate"] == calls["select"] == 1
    assert cute_attn.last_dispatch().entry == "flash_attn_varlen_func"
    # the bound launcher runs with the call's own tensors, index tensors in the entry's order
    (args,) = calls["launch"]
    assert args[0] is q2 and args[1] is args[2] is k and args[3] is index["cu_seqlens_q"]
    assert args[4] is cu_k2 and args[5:] == (None, None, None)
    # each call's own index values are checked: deferred and read after the launch
    assert calls["defer"] == calls["wait"] == 2
    assert calls["checked"][0][1][1] is index["cu_seqlens_k"] and calls["checked"][1][1][1] is cu_k2
    assert calls["checked"][0][2:] == calls["checked"][1][2:] == (7, 40, 40, 4, 30, 0, 1, 0)
    # a call that needs gradients (dispatch reads it) takes the full path, then its own entry
    monkeypatch.setattr(cute_attn.api._KernelAttnVarlen, "apply", lambda *a: ("autograd",))
    for _ in range(2):
        res = cute_attn.flash_attn_varlen_func(q.clone().requires_grad_(), k, k, max_seqlen_q=4,
                                               max_seqlen_k=30, causal=True, **index)  # fmt: skip
        assert res == ("autograd",)
    # (bound for the first signature only: the kernel path with gradients is autograd's)
    assert calls["validate"] == calls["select"] == 2 and calls["bound"] == 1
    assert len(calls["run"]) == len(calls["launch"]) == 1


def test_varlen_fast_path_without_launcher(varlen_served_on_cpu, monkeypatch):
    # no bound launcher (gathered pages, empty sizes, strided index tensors): a memo hit still
    # skips validation and runs the kernel path with the call's own tensors, checked
    from cute_attn import fwd_sm90

    calls = varlen_served_on_cpu
    monkeypatch.setattr(fwd_sm90, "varlen_launcher", lambda *a: None)
    q, kc, index = _varlen_inputs(paged=True)
    for _ in range(3):
        out = cute_attn.flash_attn_varlen_func(q, kc, kc, max_seqlen_q=4, max_seqlen_k=32,
                                               **index)  # fmt: skip
    assert out[0] == "run" and len(calls["run"]) == 3 and calls["validate"] == 1
    assert calls["defer"] == calls["wait"] == 3 and calls["launch"] == []
    assert calls["run"][2][1]["page_table"] is index["page_table"]


def test_varlen_fast_path_misses(varlen_served_on_cpu, monkeypatch):
    calls = varlen_served_on_cpu
    q, kc, index = _varlen_inputs(paged=True)
    kw = dict(max_seqlen_q=4, max_seqlen_k=32, **index)
    for _ in range(2):
        cute_attn.flash_attn_varlen_func(q, kc, kc, **kw)
    assert calls["validate"] == 1 and len(calls["run"]) == len(calls["launch"]) == 1
    assert calls["checked"][1][2:] == (7, -1, 32, 4, 32, 0, 16, 10)
    # another max_seqlen, page table shape, scalar, scalar type or index tensor set takes the
    # full path
    cute_attn.flash_attn_varlen_func(q, kc, kc, **{**kw, "max_seqlen_k": 31})
    cute_attn.flash_attn_varlen_func(
        q,
        kc,
        kc,
        **{**kw, "page_table": index["page_table"][:, :1], "seqused_k": index["seqused_k"] // 2},
    )
    cute_attn.flash_attn_varlen_func(q, kc, kc, softcap=2.0, **kw)
    with pytest.raises(TypeError, match="causal"):
        cute_attn.flash_attn_varlen_func(q, kc, kc, causal=1, **kw)
    cute_attn.flash_attn_varlen_func(
        q,
        kc,
        kc,
        **{
            **kw,
            "seqused_k": None,
            "cu_seqlens_k": torch.tensor([0, 3, 35, 35], dtype=torch.int32),
        },
    )
    assert calls["validate"] == 6 and calls["select"] == 5
    # max_seqlen None (read from the values): never memoized
    cute_attn.flash_attn_varlen_func(q, kc, kc, **{**kw, "max_seqlen_q": None})
    cute_attn.flash_attn_varlen_func(q, kc, kc, **{**kw, "max_seqlen_q": None})
    assert calls["validate"] == 8


def test_varlen_fast_path_without_value_checks(varlen_served_on_cpu, monkeypatch):
    # CUTE_ATTN_CHECK_VALUES is read per call, on memo hits too: a first call without checks
    # does not leave later calls unchecked
    calls = varlen_served_on_cpu
    q, k, index = _varlen_inputs()
    monkeypatch.setenv("CUTE_ATTN_CHECK_VALUES", "0")
    for _ in range(2):
        cute_attn.flash_attn_varlen_func(q, k, k, max_seqlen_q=4, max_seqlen_k=30, **index)
    assert calls["defer"] == 0 and calls["validate"] == 1
    monkeypatch.setenv("CUTE_ATTN_CHECK_VALUES", "1")
    cute_attn.flash_attn_varlen_func(q, k, k, max_seqlen_q=4, max_seqlen_k=30, **index)
    assert calls["defer"] == calls["wait"] == 1 and calls["validate"] == 1


def _layout(x):
    """A launch argument's layout (a tensor's shape, strides, dtype and offset; anything else
    as is): the bound launchers must pass the kernels what the unbound path does."""
    if not isinstance(x, torch.Tensor):
        return x
    return (x.shape, x.stride(), x.dtype, x.storage_offset())


@pytest.mark.parametrize(
    "splits,group,kvcache,cluster",
    [(3, 4, True, False), (1, 4, True, False), (2, 1, True, False), (1, 1, True, False),
     (1, 1, False, False), (3, 4, False, False), (3, 4, True, True), (2, 1, False, True)],
)  # fmt: skip
def test_bound_launch_matches_run(monkeypatch, splits, group, kvcache, cluster):
    # the bound launcher passes the kernels what _run does (packed decode rows, split
    # partials, the combine's stacked views; splits merged in a cluster write out / lse
    # themselves, no combine), with fresh outputs per call
    from cute_attn import fwd_sm90

    seen = {"fn": [], "combine": []}
    combine = None if cluster else (lambda *a: seen["combine"].append(a))
    plan = fwd_sm90._Plan(
        fn=lambda *a: seen["fn"].append(a), combine=combine,
        scalars=(1.0, 1.0, 0, 0, group, splits), splits=splits, group=group,
    )  # fmt: skip
    monkeypatch.setattr(fwd_sm90, "_plan", lambda *a: plan)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    p = dataclasses.replace(BASE, batch=2, seqlen_q=1, seqlen_k=300, device_type="cpu",
                            device_index=None)  # fmt: skip
    q = torch.randn(2, 8, 1, 128, dtype=torch.bfloat16).transpose(1, 2)  # strided q
    k = torch.randn(2, 300, 2, 128, dtype=torch.bfloat16)
    lens = torch.tensor([7, 300], dtype=torch.int32) if kvcache else None
    out, lse = torch.empty(2, 1, 8, 128, dtype=torch.bfloat16), torch.empty(2, 8, 1)
    feats = fwd_sm90.InputFeatures(seqused_k=True) if kvcache else fwd_sm90._DENSE
    fwd_sm90._run(q, k, k, p, out, lse, features=feats, max_seqlen_q=1, batch=2, seqlen_k=300,
                  pack=group > 1, seqused_k=lens)  # fmt: skip
    launch = fwd_sm90._bound_launch(q, p, feats, 1, 300, group > 1)
    out2, lse2 = launch(q, k, k, lens) if kvcache else launch(q, k, k)
    assert out2.shape == out.shape and lse2.shape == lse.shape and out2.dtype == out.dtype

    (a_run, a_bound) = seen["fn"]
    assert [_layout(x) for x in a_run] == [_layout(x) for x in a_bound]
    assert a_bound[0].data_ptr() == q.data_ptr() and a_bound[11] is None and a_bound[14] is lens
    if splits == 1 or cluster:
        assert seen["combine"] == [] and a_bound[3].data_ptr() == out2.data_ptr()
        assert a_bound[3].dtype == out2.dtype and a_bound[4].data_ptr() == lse2.data_ptr()
        return
    (c_run, c_bound) = seen["combine"]
    assert [_layout(x) for x in c_run] == [_layout(x) for x in c_bound]
    assert c_bound[2] is out2 and c_bound[3] is lse2
    # the (packed) partials are views of the stacked ones the combine reads
    assert a_bound[3].data_ptr() == c_bound[0].data_ptr()


@pytest.mark.parametrize(
    "splits,used_q,paged", [(1, False, False), (3, False, False), (1, True, False),
                            (3, True, False), (1, False, True), (2, True, True)],
)  # fmt: skip
def test_varlen_launcher_matches_run_fwd_varlen(monkeypatch, splits, used_q, paged):
    # the varlen entry's bound launcher passes the kernels what run_fwd_varlen does (packed
    # rows as one batch row, dense keys viewed as one, seqused_q's rows filled, split partials
    # and the combine's stacked views), with fresh outputs per call; None where
    # run_fwd_varlen does more (gathered pages, empty sizes) or an index tensor is strided
    from cute_attn import fwd_sm90
    from cute_attn.validation import validate_varlen_static

    seen = {"fn": [], "combine": []}
    plan = fwd_sm90._Plan(
        fn=lambda *a: seen["fn"].append(a), combine=lambda *a: seen["combine"].append(a),
        scalars=(1.0, 1.0, 0, 0, 4, splits), splits=splits, group=1,
    )  # fmt: skip
    monkeypatch.setattr(fwd_sm90, "_plan", lambda *a: plan)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    q = torch.randn(7, 8, 64, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 1, 5, 7], dtype=torch.int32)
    index = dict(cu_seqlens_q=cu_q, cu_seqlens_k=torch.tensor([0, 5, 35, 40], dtype=torch.int32),
                 seqused_q=None, seqused_k=None, page_table=None)  # fmt: skip
    k = torch.randn(40, 2, 64, dtype=torch.bfloat16)
    if paged:
        k = torch.randn(10, 16, 2, 64, dtype=torch.bfloat16)
        index.update(cu_seqlens_k=None, seqused_k=torch.tensor([3, 32, 0], dtype=torch.int32),
                     page_table=torch.arange(6, dtype=torch.int32).view(3, 2))  # fmt: skip
    if used_q:
        index["seqused_q"] = torch.tensor([1, 2, 0], dtype=torch.int32)
    p, _ = validate_varlen_static(
        q, k, k, max_seqlen_q=4, max_seqlen_k=32, softmax_scale=None, causal=True,
        window_size=(None, None), softcap=0.0, num_splits=0, pack_gqa=None,
        deterministic=False, **index,
    )  # fmt: skip
    out, lse = fwd_sm90.run_fwd_varlen(q, k, k, p, max_seqlen_q=p.seqlen_q, **index)
    launch = fwd_sm90.varlen_launcher(q, k, p, *index.values())
    out2, lse2 = launch(q, k, k, *index.values())
    assert (out2.shape, out2.stride(), out2.dtype) == (out.shape, out.stride(), out.dtype)
    assert (lse2.shape, lse2.stride(), lse2.dtype) == (lse.shape, lse.stride(), lse.dtype)

    (a_run, a_bound) = seen["fn"]
    assert [_layout(x) for x in a_run] == [_layout(x) for x in a_bound]
    assert a_bound[0].data_ptr() == q.data_ptr() and a_bound[1].data_ptr() == k.data_ptr()
    for i, name in enumerate(index):  # the call's own index tensors
        assert a_bound[11 + i + (i > 3)] is index[name]
    if used_q:  # rows past seqused_q: out 0 / lse -inf before the launch (or the partials)
        assert bool((a_bound[3] == 0).all()) and bool((a_bound[4] == float("-inf")).all())
    if splits == 1:
        assert seen["combine"] == [] and a_bound[3].data_ptr() == out2.data_ptr()
    else:
        (c_run, c_bound) = seen["combine"]
        assert [_layout(x) for x in c_run] == [_layout(x) for x in c_bound]
        assert c_bound[2].data_ptr() == out2.data_ptr() and c_bound[3].data_ptr() == lse2.data_ptr()
    # not bound: a strided index tensor, the gathered page route, no keys
    strided = torch.tensor([0, 0, 1, 0, 5, 0, 7, 0], dtype=torch.int32)[::2]
    assert fwd_sm90.varlen_launcher(q, k, p, strided, *list(index.values())[1:]) is None
    monkeypatch.setattr(fwd_sm90, "paged_route", lambda p: "gather" if p.paged else None)
    assert (fwd_sm90.varlen_launcher(q, k, p, *index.values()) is None) == paged
    assert fwd_sm90.varlen_launcher(q, k[:0], p, *index.values()) is None


def test_backward_reason_names_the_padded_head_dim(fake_arch):
    # D=96 pads only K's tile (to 128 columns, for dQ^T): the record says so. Under softcap
    # (dQ = dS K) it pads nothing, and 192 runs its own tiles
    from cute_attn import bwd_sm90

    fake_arch("sm_90a")
    cases = (
        (96, 96, 0.0, "K's tile 128 columns wide"),
        (96, 96, 30.0, None),
        (128, 128, 0.0, None),
        (192, 192, 0.0, None),
        (192, 128, 0.0, None),
        (256, 256, 0.0, None),
    )
    for d, dv, softcap, note in cases:
        p = dataclasses.replace(
            BASE, head_dim=d, head_dim_v=dv, softmax_scale=d**-0.5, softcap=softcap
        )
        q, k, _ = (t for _, t in _tensors(d))
        v = torch.empty(*k.shape[:3], dv, dtype=k.dtype)
        got = dispatch.select_backward(
            p, (("q", q), ("k", k), ("v", v)), bwd_sm90.bwd_unsupported_reason,
            bwd_sm90.bwd_kernel_note,
        )  # fmt: skip
        assert got.impl == "sm90_bwd", got
        assert (note in got.reason) if note else got.reason == "SM90 backward kernel", got
    p = dataclasses.replace(BASE, head_dim=80, head_dim_v=80, softmax_scale=80**-0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = dispatch.select_backward(
            p, _tensors(80), bwd_sm90.bwd_unsupported_reason, bwd_sm90.bwd_kernel_note
        )
    assert got.impl == "reference" and "head dims (80, 80)" in got.reason, got


@pytest.mark.parametrize("rule", [False, True])
def test_kvcache_features_ragged_cache_rule(monkeypatch, rule):
    # InputFeatures.ragged_cache: where tile_config.fwd_ragged_cache takes it, for dense caches
    # whose batch rows lie back to back (the kernel addresses row b's keys from flat row b x
    # capacity); never for pages, nor for a cache sliced out of a longer one
    from cute_attn import fwd_sm90

    monkeypatch.setattr(fwd_sm90, "fwd_ragged_cache", lambda: rule)
    cache = torch.empty(3, 40, 2, 16)
    one_row = torch.empty(1, 50, 2, 16)[:, :40]  # a single batch row: any batch stride
    for v, batch_idx, paged, want in (
        (cache, False, False, rule),
        (cache, True, False, rule),
        (one_row, False, False, rule),
        (cache[:, :30], False, False, False),  # batch stride 40 rows, capacity 30
        (cache, False, True, False),
    ):
        feats = fwd_sm90._cache_features(v, batch_idx=batch_idx, paged=paged)
        assert feats.ragged_cache == want and feats.seqused_k, (v.shape, v.stride(), feats)
        assert (feats.kv_batch_idx, feats.paged_kv) == (batch_idx, paged)
    with pytest.raises(ValueError, match="ragged_cache"):
        fwd_sm90.InputFeatures(seqused_k=True, paged_kv=True, ragged_cache=True)
    with pytest.raises(ValueError, match="ragged_cache"):
        fwd_sm90.InputFeatures(cu_seqlens_k=True, seqused_k=True, ragged_cache=True)
