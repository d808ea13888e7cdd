"""Tests for cute_attn.validation: every check raises the right exception type naming the argument.

CPU only (CUDA-specific rules are exercised with fake CUDA tensors, which need no GPU); a couple
of seconds in all. Run: python -m pytest tests/test_validation.py -q
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from op_count import CountOps
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from cute_attn.problem import AttnProblem
from cute_attn.validation import (
    validate_dense,
    validate_kvcache,
    validate_kvcache_deferred,
    validate_kvcache_static,
    validate_varlen,
    validate_varlen_deferred,
)

I32 = torch.int32
HINT = "did you pass (B, H, S, D)? cute_attn expects (B, S, H, D)"


def names(arg: str) -> str:
    """pytest.raises `match` pattern: the message starts with the argument's name."""
    return "^" + re.escape(arg + ":")


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


# ------------------------------------------------------------------------------------------------
# dense
# ------------------------------------------------------------------------------------------------


def knobs(**over):
    base = dict(
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        num_splits=0,
        pack_gqa=None,
        deterministic=False,
    )
    base.update(over)
    return base


def qkv(B=2, Sq=5, Sk=7, H=6, Hkv=3, D=16, Dv=8, dtype=torch.float16, device="cpu"):
    q = torch.empty(B, Sq, H, D, dtype=dtype, device=device)
    k = torch.empty(B, Sk, Hkv, D, dtype=dtype, device=device)
    v = torch.empty(B, Sk, Hkv, Dv, dtype=dtype, device=device)
    return q, k, v


def dense(q, k, v, **over):
    return validate_dense(q, k, v, **knobs(**over))


def test_dense_fills_problem():
    q, k, v = qkv(dtype=torch.bfloat16)
    p = dense(q, k, v, causal=True, window_size=(4, None), num_splits=3, pack_gqa=True)
    assert isinstance(p, AttnProblem)
    assert (p.batch, p.seqlen_q, p.seqlen_k) == (2, 5, 7)
    assert (p.num_heads, p.num_heads_kv, p.head_dim, p.head_dim_v) == (6, 3, 16, 8)
    assert (p.dtype, p.device_type, p.device_index) == ("bfloat16", "cpu", None)
    assert p.softmax_scale == pytest.approx(1 / math.sqrt(16))
    assert (p.causal, p.window_left, p.window_right) == (True, 4, 0)
    assert (p.softcap, p.num_splits, p.pack_gqa, p.deterministic) == (0.0, 3, True, False)
    assert not p.varlen and not p.paged and p.page_size == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dense_cpu_accepts_all_float_dtypes(dtype):
    p = dense(*qkv(dtype=dtype))
    assert p.dtype == str(dtype).removeprefix("torch.")


def test_dense_explicit_knobs():
    p = dense(*qkv(), softmax_scale=2, window_size=[None, 3], softcap=30, deterministic=True)
    assert p.softmax_scale == 2.0 and isinstance(p.softmax_scale, float)
    assert (p.window_left, p.window_right) == (-1, 3)
    assert p.softcap == 30.0 and p.deterministic is True
    assert dense(*qkv(), window_size=None).window_left == -1


@pytest.mark.parametrize(
    "sizes", [dict(Sq=0), dict(Sk=0), dict(B=0), dict(Sq=0, Sk=0)], ids=["Sq0", "Sk0", "B0", "S0"]
)
def test_dense_empty_sizes_allowed(sizes):
    p = dense(*qkv(**sizes))
    assert (p.batch, p.seqlen_q, p.seqlen_k) == (
        sizes.get("B", 2),
        sizes.get("Sq", 5),
        sizes.get("Sk", 7),
    )


def test_dense_noncontiguous_outer_dims_allowed():
    # (B, H, S, D) storage viewed as (B, S, H, D): stride(-1) == 1, so it is accepted.
    q = torch.empty(2, 6, 5, 16, dtype=torch.float16).transpose(1, 2)
    _, k, v = qkv()
    assert dense(q, k, v).seqlen_q == 5


def test_dense_does_no_tensor_ops():
    # The dense path must stay attribute reads + python comparisons: no aten op may run.
    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    q, k, v = qkv()
    with Record() as rec:
        dense(q, k, v, causal=True, window_size=(3, 2), softcap=5.0)
    assert rec.ops == []


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_dense_rejects_non_tensors(which):
    t = dict(zip("qkv", qkv()))
    t[which] = t[which].numpy()
    with pytest.raises(TypeError, match=names(which)):
        dense(t["q"], t["k"], t["v"])


def test_dense_dtype_mismatch():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=names("k") + ".*float16.*float32"):
        dense(q, k.float(), v)
    with pytest.raises(TypeError, match=names("v") + ".*bfloat16"):
        dense(q, k, v.bfloat16())


def test_dense_rejects_non_float_dtype():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=names("q") + ".*int32"):
        dense(q.to(I32), k.to(I32), v.to(I32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_cuda_rejects_fp32_fp64(dtype):
    # Fake CUDA tensors carry device and dtype without a GPU; validation only reads attributes.
    with FakeTensorMode():
        q, k, v = qkv(dtype=dtype, device="cuda")
    with pytest.raises(TypeError, match=names("q") + ".*" + str(dtype) + ".*CUDA"):
        dense(q, k, v)


def test_dense_cuda_accepts_bf16():
    with FakeTensorMode():
        q, k, v = qkv(dtype=torch.bfloat16, device="cuda")
    p = dense(q, k, v)
    assert (p.device_type, p.device_index, p.dtype) == ("cuda", 0, "bfloat16")


def test_dense_device_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=names("v") + ".*cpu.*meta"):
        dense(q, k, v.to("meta"))
    with pytest.raises(ValueError, match=names("q") + ".*meta"):
        dense(*qkv(device="meta"))


def test_dense_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=names("q") + ".*4-D.*3-D"):
        dense(q[0], k, v)
    with pytest.raises(ValueError, match=names("k") + ".*4-D"):
        dense(q, k[0], v)


def test_dense_k_head_dim_mismatch_message():
    q, _, v = qkv(D=64)
    k = torch.empty(2, 7, 3, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match=names("k")) as e:
        dense(q, k, v)
    msg = str(e.value)
    assert "(batch=2, seqlen_k, num_heads_kv, head_dim=64)" in msg
    assert "got (2, 7, 3, 32)" in msg and "q's head_dim 64" in msg
    assert HINT not in msg  # a head_dim mismatch is not a layout mix-up


def test_dense_batch_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=names("k") + ".*batch is 1 but must equal q's batch 2"):
        dense(q, k[:1], v[:1])


@pytest.mark.parametrize(
    "v_shape,label",
    [((2, 6, 3, 8), "seqlen_k"), ((2, 7, 1, 8), "num_heads_kv"), ((1, 7, 3, 8), "batch")],
)
def test_dense_v_must_match_k(v_shape, label):
    q, k, _ = qkv()
    with pytest.raises(ValueError, match=names("v") + f".*{label} is"):
        dense(q, k, torch.empty(v_shape, dtype=torch.float16))


def test_dense_gqa_ratio():
    q, k, v = qkv(H=6, Hkv=4, Sq=5, Sk=7)
    with pytest.raises(ValueError, match=names("q, k") + ".*multiple of num_heads_kv") as e:
        dense(q, k, v)
    assert "= 6" in str(e.value) and "= 4" in str(e.value)


def test_dense_bhsd_hint_when_detectable():
    # All three in (B, H, S, D): heads read as 5 vs 7 -> not a multiple; hint must be given.
    q, k, v = qkv(B=2, Sq=5, Sk=7, H=4, Hkv=2)
    with pytest.raises(ValueError, match=names("q, k")) as e:
        dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert HINT in str(e.value)
    # Only v transposed: v's (seqlen_k, heads) are swapped, which the hint explains.
    q, k, v = qkv()
    with pytest.raises(ValueError, match=names("v")) as e:
        dense(q, k, v.transpose(1, 2))
    assert HINT in str(e.value)


@pytest.mark.parametrize(
    "shapes,arg",
    [
        (dict(H=0, Hkv=1), "q"),
        (dict(Hkv=0), "k"),
        (dict(D=0), "q"),
        (dict(Dv=0), "v"),
    ],
)
def test_dense_zero_sizes_rejected(shapes, arg):
    with pytest.raises(ValueError, match=names(arg) + ".*>= 1"):
        dense(*qkv(**shapes))


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_dense_last_dim_must_be_contiguous(which):
    t = dict(zip("qkv", qkv()))
    x = t[which]
    t[which] = torch.empty(*x.shape[:-2], x.shape[-1], x.shape[-2], dtype=x.dtype).transpose(-1, -2)
    with pytest.raises(ValueError, match=names(which) + r".*stride\(-1\) == 1.*contiguous\(\)"):
        dense(t["q"], t["k"], t["v"])


@pytest.mark.parametrize(
    "arg,value,exc",
    [
        ("softmax_scale", torch.tensor(0.5), TypeError),
        ("softmax_scale", True, TypeError),
        ("softmax_scale", "0.5", TypeError),
        ("softmax_scale", 0.0, ValueError),
        ("softmax_scale", -1.0, ValueError),
        ("softmax_scale", float("inf"), ValueError),
        ("softmax_scale", float("nan"), ValueError),
        ("causal", 1, TypeError),
        ("causal", None, TypeError),
        ("softcap", -1.0, ValueError),
        ("softcap", float("nan"), ValueError),
        ("softcap", float("inf"), ValueError),
        ("softcap", None, TypeError),
        ("softcap", torch.tensor(1.0), TypeError),
        ("num_splits", -1, ValueError),
        ("num_splits", 2.0, TypeError),
        ("num_splits", True, TypeError),
        ("pack_gqa", 1, TypeError),
        ("deterministic", None, TypeError),
    ],
)
def test_dense_scalar_knobs(arg, value, exc):
    with pytest.raises(exc, match=names(arg)):
        dense(*qkv(), **{arg: value})


@pytest.mark.parametrize(
    "window,exc,arg",
    [
        ((-2, 0), ValueError, "window_size[0]"),
        ((0, -5), ValueError, "window_size[1]"),
        ((True, 0), TypeError, "window_size[0]"),
        ((0, 1.5), TypeError, "window_size[1]"),
        ((0, torch.tensor(3)), TypeError, "window_size[1]"),
        ((1, 2, 3), ValueError, "window_size"),
        (5, TypeError, "window_size"),
        ("ab", TypeError, "window_size"),
    ],
)
def test_dense_window_size(window, exc, arg):
    with pytest.raises(exc, match=names(arg)):
        dense(*qkv(), window_size=window)


# ------------------------------------------------------------------------------------------------
# varlen
# ------------------------------------------------------------------------------------------------


def vknobs(**over):
    base = dict(
        cu_seqlens_q=i32([0, 3, 5]),
        cu_seqlens_k=i32([0, 4, 9]),
        max_seqlen_q=None,
        max_seqlen_k=None,
        seqused_q=None,
        seqused_k=None,
        page_table=None,
    )
    base.update(knobs())
    base.update(over)
    return base


def packed(total_q=5, total_k=9, H=4, Hkv=2, D=16, Dv=16, dtype=torch.float16, device="cpu"):
    return (
        torch.empty(total_q, H, D, dtype=dtype, device=device),
        torch.empty(total_k, Hkv, D, dtype=dtype, device=device),
        torch.empty(total_k, Hkv, Dv, dtype=dtype, device=device),
    )


def paged_kv(num_pages=6, page_size=4, Hkv=2, D=16, Dv=16, dtype=torch.float16):
    return (
        torch.empty(num_pages, page_size, Hkv, D, dtype=dtype),
        torch.empty(num_pages, page_size, Hkv, Dv, dtype=dtype),
    )


def varlen(q, k, v, **over):
    return validate_varlen(q, k, v, **vknobs(**over))


def test_varlen_fills_problem():
    p = varlen(*packed(), seqused_q=i32([2, 2]), causal=True)
    assert (p.batch, p.seqlen_q, p.seqlen_k) == (2, 3, 5)  # longest spans
    assert p.varlen and p.has_seqused_q and not p.has_seqused_k and not p.paged
    assert (p.num_heads, p.num_heads_kv, p.window_right) == (4, 2, 0)
    p = varlen(*packed(), max_seqlen_q=8, max_seqlen_k=5)
    assert (p.seqlen_q, p.seqlen_k) == (8, 5)


def test_varlen_deferred_check_only_with_both_max_seqlens():
    # with max_seqlen_q/k given the value checks come back unread (a kernel call launches,
    # then waits for them); without, they are read at once since the lengths come from them
    q, k, v = packed()
    bad = i32([0, 4, 5])  # sequence 0 longer than max_seqlen_q = 3
    p, check = validate_varlen_deferred(
        q, k, v, **vknobs(cu_seqlens_q=bad, max_seqlen_q=3, max_seqlen_k=5)
    )
    assert p.seqlen_q == 3 and check is not None
    tensors = check.index_args[1]
    assert tensors[0] is bad and tensors[4:] == (None, None)
    with pytest.raises(ValueError, match="max_seqlen_q: expected >= the longest"):
        check.wait()
    p, check = validate_varlen_deferred(q, k, v, **vknobs())
    assert check is None and (p.seqlen_q, p.seqlen_k) == (3, 5)


def test_varlen_empty_batch_and_empty_sequences():
    p = varlen(*packed(0, 0), cu_seqlens_q=i32([0]), cu_seqlens_k=i32([0]))
    assert (p.batch, p.seqlen_q, p.seqlen_k) == (0, 0, 0)
    p = varlen(*packed(3, 4), cu_seqlens_q=i32([0, 0, 3]), cu_seqlens_k=i32([0, 4, 4]))
    assert (p.batch, p.seqlen_q, p.seqlen_k) == (2, 3, 4)


def test_varlen_rank_and_layout():
    q, k, v = packed()
    with pytest.raises(ValueError, match=names("q") + ".*3-D.*dense"):
        varlen(q[None], k, v)
    with pytest.raises(ValueError, match=names("k") + ".*page_table"):
        varlen(q, k[None], v)
    with pytest.raises(ValueError, match=names("v") + ".*total_k is 8"):
        varlen(q, k, v[:8])
    with pytest.raises(ValueError, match=names("q, k") + ".*multiple"):
        varlen(*packed(H=3))


@pytest.mark.parametrize("arg", ["cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k"])
def test_varlen_index_tensors_must_be_int32(arg):
    good = vknobs(seqused_q=i32([3, 2]), seqused_k=i32([4, 5]))
    with pytest.raises(TypeError, match=names(arg) + ".*int32.*int64"):
        varlen(*packed(), **{**good, arg: good[arg].long()})
    with pytest.raises(TypeError, match=names(arg) + ".*torch.Tensor"):
        varlen(*packed(), **{**good, arg: good[arg].tolist()})


@pytest.mark.parametrize(
    "over,arg,pattern",
    [
        (dict(cu_seqlens_q=i32([[0, 3, 5]])), "cu_seqlens_q", "1-D"),
        (dict(cu_seqlens_q=i32([])), "cu_seqlens_q", "at least 1"),
        (dict(cu_seqlens_k=i32([0, 9])), "cu_seqlens_k", "batch \\+ 1 is 2"),
        (dict(cu_seqlens_q=i32([1, 3, 5])), "cu_seqlens_q", "first element must be 0"),
        (dict(cu_seqlens_k=i32([0, 10, 9])), "cu_seqlens_k", "nondecreasing"),
        (dict(cu_seqlens_q=i32([0, 3, 4])), "cu_seqlens_q", "total_q\\) = 5, got 4"),
        (dict(cu_seqlens_k=i32([0, 4, 10])), "cu_seqlens_k", "total_k\\) = 9, got 10"),
        (dict(cu_seqlens_k=None), "cu_seqlens_k", "required"),
        (dict(seqused_q=i32([4, 2])), "seqused_q", "seqused_q\\[0\\] = 4"),
        (dict(seqused_k=i32([4, -1])), "seqused_k", "seqused_k\\[1\\] = -1"),
        (dict(seqused_k=i32([4, 5, 6])), "seqused_k", "batch is 3"),
        (dict(max_seqlen_q=2), "max_seqlen_q", "longest sequence \\(3"),
        (dict(max_seqlen_k=4), "max_seqlen_k", "longest sequence \\(5"),
        (dict(max_seqlen_k=-1), "max_seqlen_k", ">= 0"),
    ],
)
def test_varlen_value_errors(over, arg, pattern):
    with pytest.raises(ValueError, match=names(arg) + ".*" + pattern):
        varlen(*packed(), **over)


@pytest.mark.parametrize("value", [torch.tensor(3), 3.0, True])
def test_varlen_max_seqlen_must_be_python_int(value):
    with pytest.raises(TypeError, match=names("max_seqlen_q")):
        varlen(*packed(), max_seqlen_q=value)


def test_varlen_index_tensor_device():
    with pytest.raises(ValueError, match=names("cu_seqlens_k") + ".*cpu.*meta"):
        varlen(*packed(), cu_seqlens_k=i32([0, 4, 9]).to("meta"))
    with FakeTensorMode():
        q, k, v = packed(device="cuda")
    with pytest.raises(ValueError, match=names("cu_seqlens_q") + ".*cuda"):
        varlen(q, k, v)


def test_varlen_value_checks_skipped_when_values_unreadable():
    # Fake CUDA tensors stand in for torch.compile tracing: shapes/dtypes are still checked,
    # values are not (they cannot be read), so max_seqlen_* must be given.
    with FakeTensorMode():
        q, k, v = packed(device="cuda")
        cu_q, cu_k = (torch.zeros(3, dtype=I32, device="cuda") for _ in range(2))
    over = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    p = varlen(q, k, v, max_seqlen_q=3, max_seqlen_k=5, **over)
    assert (p.device_type, p.seqlen_q, p.seqlen_k) == ("cuda", 3, 5)
    with pytest.raises(ValueError, match=names("max_seqlen_q") + ".*required"):
        varlen(q, k, v, **over)
    with pytest.raises(TypeError, match=names("cu_seqlens_k") + ".*int32"):
        varlen(q, k, v, max_seqlen_q=3, max_seqlen_k=5, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k.long())


@pytest.mark.parametrize("flag", ["0", "off", "False"])
def test_value_checks_can_be_turned_off(monkeypatch, flag):
    # CUTE_ATTN_CHECK_VALUES=0: no index value is read (no tensor op, so no host sync on a
    # device), malformed values pass unnoticed, shapes are still checked, max_seqlen_* required
    monkeypatch.setenv("CUTE_ATTN_CHECK_VALUES", flag)
    bad = dict(cu_seqlens_q=i32([0, 9, 5]), cu_seqlens_k=i32([0, 4, 9]))
    tensors, kw = packed(), vknobs(max_seqlen_q=9, max_seqlen_k=5, **bad)
    with CountOps() as ops:
        p = validate_varlen(*tensors, **kw)
    assert ops.n == 0 and (p.seqlen_q, p.seqlen_k) == (9, 5)
    with pytest.raises(ValueError, match="CUTE_ATTN_CHECK_VALUES"):
        varlen(*packed(), **bad)
    with pytest.raises(ValueError, match="num_heads"):  # shapes are still checked
        varlen(*packed(H=3), max_seqlen_q=9, max_seqlen_k=5, **bad)
    q, kc, vc, k, v = kv_tensors()
    kw = kvknobs(cache_seqlens=i32([99, -3]))
    with CountOps() as ops:
        validate_kvcache(q, kc, vc, k, v, **kw)
    assert ops.n == 0
    monkeypatch.setenv("CUTE_ATTN_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match="first element|nondecreasing"):
        varlen(*packed(), **bad)


def paged_over(**over):
    # batch 2, page_size 4, 3 pages per sequence (capacity 12); sequence 0 uses 5 keys -> 2 pages,
    # sequence 1 uses 4 keys -> 1 page. Unused entries hold -1 and must not be rejected.
    base = dict(
        cu_seqlens_k=None,
        seqused_k=i32([5, 4]),
        page_table=i32([[3, 0, -1], [5, -1, -1]]),
    )
    base.update(over)
    return base


def test_varlen_paged_ok():
    q, _, _ = packed()
    k, v = paged_kv()
    p = varlen(q, k, v, **paged_over())
    assert p.paged and p.page_size == 4 and p.has_seqused_k and p.seqlen_k == 5
    # With cu_seqlens_k, its spans are the key lengths; its total is not tied to num_pages.
    p = varlen(q, k, v, **paged_over(cu_seqlens_k=i32([0, 5, 9]), seqused_k=None))
    assert p.seqlen_k == 5 and not p.has_seqused_k


@pytest.mark.parametrize(
    "over,exc,arg,pattern",
    [
        (dict(seqused_k=None), ValueError, "seqused_k", "required"),
        (dict(seqused_k=i32([13, 4])), ValueError, "seqused_k", "\\[0, 12\\]"),
        (dict(page_table=i32([[3, 0, -1]])), ValueError, "page_table", "batch is 1"),
        (dict(page_table=i32([3, 0, 1, 5])), ValueError, "page_table", "2-D"),
        (dict(page_table=torch.tensor([[3, 0, 1], [5, 1, 1]])), TypeError, "page_table", "int32"),
        (dict(page_table=i32([[3, -1, -1], [5, -1, -1]])), ValueError, "page_table", "\\[0, 1\\]"),
        (dict(page_table=i32([[3, 0, 0], [6, 0, 0]])), ValueError, "page_table", "\\[1, 0\\] = 6"),
        (
            dict(cu_seqlens_k=i32([0, 13, 14]), seqused_k=None),
            ValueError,
            "cu_seqlens_k",
            "13 keys",
        ),
    ],
)
def test_varlen_paged_errors(over, exc, arg, pattern):
    q, _, _ = packed()
    k, v = paged_kv()
    with pytest.raises(exc, match=names(arg) + ".*" + pattern):
        varlen(q, k, v, **paged_over(**over))


def test_varlen_paged_shapes():
    q, _, _ = packed()
    k, v = paged_kv()
    with pytest.raises(ValueError, match=names("v") + ".*page_size is 2"):
        varlen(q, k, v[:, :2], **paged_over())
    k0, v0 = paged_kv(page_size=0)
    with pytest.raises(ValueError, match=names("k") + ".*page_size.*>= 1"):
        varlen(q, k0, v0, **paged_over())
    # A (num_pages, Hkv, page_size, D) cache read as page_size 2, Hkv 3: 4 heads are not a
    # multiple of 3 but are of 2, so the error carries the paged-layout hint.
    k, v = paged_kv(page_size=2, Hkv=3)
    with pytest.raises(ValueError, match=names("q, k")) as e:
        varlen(q, k, v, **paged_over())
    assert "cute_attn expects (num_pages, page_size, num_heads_kv, head_dim)" in str(e.value)


# ------------------------------------------------------------------------------------------------
# kvcache
# ------------------------------------------------------------------------------------------------


def kvknobs(**over):
    base = dict(
        cache_seqlens=None,
        cache_batch_idx=None,
        page_table=None,
        rotary_cos=None,
        rotary_sin=None,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        num_splits=0,
    )
    base.update(over)
    return base


def kv_tensors(B=2, Sq=1, H=4, Hkv=2, D=16, Dv=16, B_cache=2, S_cache=10, S_new=1):
    dt = torch.float16
    q = torch.empty(B, Sq, H, D, dtype=dt)
    k_cache = torch.empty(B_cache, S_cache, Hkv, D, dtype=dt)
    v_cache = torch.empty(B_cache, S_cache, Hkv, Dv, dtype=dt)
    k = torch.empty(B, S_new, Hkv, D, dtype=dt)
    v = torch.empty(B, S_new, Hkv, Dv, dtype=dt)
    return q, k_cache, v_cache, k, v


def kvcache(q, k_cache, v_cache, k=None, v=None, **over):
    return validate_kvcache(q, k_cache, v_cache, k, v, **kvknobs(**over))


def test_kvcache_deferred_check_raises_on_wait_only():
    # the deferred form returns the value checks unread: wait() raises (a read-only kernel call
    # launches in between, after defer() queued the device-side flags on index_args)
    q, kc, vc, _, _ = kv_tensors()
    lens = i32([3, 11])
    p, check = validate_kvcache_deferred(q, kc, vc, None, None, **kvknobs(cache_seqlens=lens))
    assert p.seqlen_k == 10 and check is not None
    batch, tensors, _, _, capacity, _, _, batch_cache, _, _ = check.index_args
    assert (batch, capacity, batch_cache) == (2, 10, 2)
    assert tensors[3] is lens and tensors[:3] == (None,) * 3 and tensors[4:] == (None, None)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 11"):
        check.wait()
    _, ok = validate_kvcache_deferred(q, kc, vc, None, None, **kvknobs(cache_seqlens=i32([3, 9])))
    ok.wait()  # valid values: nothing raised
    _, none = validate_kvcache_deferred(q, kc, vc, None, None, **kvknobs())
    assert none is None  # no index tensor: nothing to read


def test_kvcache_static_values_build_each_calls_check():
    # the memo keeps validate_kvcache_static's KvcacheValues; check() binds another call's
    # tensors of the same signature, and wait() judges those values
    q, kc, vc, _, _ = kv_tensors()
    p, values = validate_kvcache_static(q, kc, vc, None, None, **kvknobs(cache_seqlens=i32([3, 9])))
    assert p.seqlen_k == 10 and values.capacity == 10 and values.seqlens_tensor
    bad = i32([3, 12])
    check = values.check(bad, None, None)
    assert check.index_args[1][3] is bad
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 12"):
        check.wait()
    values.check(i32([0, 10]), None, None).wait()
    assert validate_kvcache_static(q, kc, vc, None, None, **kvknobs(cache_seqlens=4))[1] is None


@pytest.mark.parametrize("numpy_ok", [True, False])
def test_any_set_reader(monkeypatch, numpy_ok):
    # ValueCheck.wait's reader of the pinned flags: bytes against zeros, or torch's any()
    from cute_attn import validation

    flags = torch.zeros(5, dtype=torch.int32)
    if not numpy_ok:
        monkeypatch.setattr(torch.Tensor, "numpy", lambda self: (_ for _ in ()).throw(
            RuntimeError("Numpy is not available")))  # fmt: skip
    any_set = validation._any_set_fn(flags)
    assert not any_set(flags)
    flags[3] = 16  # any nonzero bit (BAD_CU_K)
    assert any_set(flags)
    flags.zero_()
    assert not any_set(flags)


def test_kvcache_fills_problem():
    q, kc, vc, k, v = kv_tensors()
    p = kvcache(q, kc, vc, k, v, cache_seqlens=i32([3, 9]), causal=True, num_splits=2)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.num_splits) == (2, 1, 10, 2)
    assert p.has_seqused_k and not p.paged and not p.varlen and p.window_right == 0
    p = kvcache(q, kc, vc)  # no append, no cache_seqlens: every cache full
    assert p.seqlen_k == 10 and not p.has_seqused_k
    assert kvcache(q, kc, vc, k, v, cache_seqlens=9).has_seqused_k
    assert p.pack_gqa is None
    for pack in (True, False):
        assert kvcache(q, kc, vc, cache_seqlens=9, pack_gqa=pack).pack_gqa is pack


def test_kvcache_python_int_path_does_no_tensor_ops():
    q, kc, vc, k, v = kv_tensors()
    with CountOps() as ops:
        kvcache(q, kc, vc, k, v, cache_seqlens=4)
    assert ops.n == 0


def test_kvcache_new_kv_both_or_neither():
    q, kc, vc, k, v = kv_tensors()
    with pytest.raises(ValueError, match=names("k, v")):
        kvcache(q, kc, vc, k, None, cache_seqlens=1)
    with pytest.raises(ValueError, match=names("k, v")):
        kvcache(q, kc, vc, None, v, cache_seqlens=1)


@pytest.mark.parametrize(
    "cache_seqlens,exc,pattern",
    [
        (i32([3, 10]), ValueError, "cache_seqlens\\[1\\] = 10"),  # 10 + 1 new > 10
        (i32([-1, 3]), ValueError, "cache_seqlens\\[0\\] = -1"),
        (10, ValueError, "past the cache capacity 10"),
        (-1, ValueError, ">= 0"),
        (None, ValueError, "None means every cache is full"),
        (torch.tensor([3, 4]), TypeError, "int32"),
        (i32([3, 4, 5]), ValueError, "batch is 3"),
        (3.0, TypeError, "python int"),
    ],
)
def test_kvcache_seqlens_errors(cache_seqlens, exc, pattern):
    q, kc, vc, k, v = kv_tensors()
    with pytest.raises(exc, match=names("cache_seqlens") + ".*" + pattern):
        kvcache(q, kc, vc, k, v, cache_seqlens=cache_seqlens)


def test_kvcache_full_cache_ok_without_append():
    q, kc, vc, _, _ = kv_tensors()
    assert kvcache(q, kc, vc, cache_seqlens=i32([10, 10])).seqlen_k == 10


def test_kvcache_batch_idx():
    q, kc, vc, k, v = kv_tensors(B_cache=4)
    with pytest.raises(ValueError, match=names("k_cache") + ".*cache_batch_idx"):
        kvcache(q, kc, vc, k, v, cache_seqlens=2)
    assert kvcache(q, kc, vc, k, v, cache_seqlens=2, cache_batch_idx=i32([3, 0])).batch == 2
    with pytest.raises(ValueError, match=names("cache_batch_idx") + ".*ambiguous"):
        kvcache(q, kc, vc, k, v, cache_seqlens=2, cache_batch_idx=i32([1, 1]))
    # Read-only calls may share a cache row (no write, nothing ambiguous).
    assert kvcache(q, kc, vc, cache_seqlens=2, cache_batch_idx=i32([1, 1])).batch == 2
    with pytest.raises(ValueError, match=names("cache_batch_idx") + ".*\\[0, batch_cache = 4\\)"):
        kvcache(q, kc, vc, k, v, cache_seqlens=2, cache_batch_idx=i32([0, 4]))
    with pytest.raises(TypeError, match=names("cache_batch_idx") + ".*int32"):
        kvcache(q, kc, vc, k, v, cache_seqlens=2, cache_batch_idx=torch.tensor([0, 1]))


def test_kvcache_shapes():
    q, kc, vc, k, v = kv_tensors()
    with pytest.raises(ValueError, match=names("v_cache") + ".*seqlen_cache is 9"):
        kvcache(q, kc, vc[:, :9], k, v, cache_seqlens=1)
    with pytest.raises(ValueError, match=names("k") + ".*num_heads_kv is 1"):
        kvcache(q, kc, vc, k[:, :, :1], v, cache_seqlens=1)
    with pytest.raises(ValueError, match=names("v") + ".*seqlen_new is 2"):
        kvcache(q, kc, vc, k, torch.cat([v, v], 1), cache_seqlens=1)
    with pytest.raises(TypeError, match=names("v_cache") + ".*float16"):
        kvcache(q, kc, vc.float(), k, v, cache_seqlens=1)
    # cache stored (B, Hkv, S, D): the head check fails with the layout hint.
    with pytest.raises(ValueError, match=names("q, k")) as e:
        kvcache(q, kc.transpose(1, 2), vc.transpose(1, 2), cache_seqlens=1)
    assert HINT in str(e.value)


def test_kvcache_broadcast_cache_not_written():
    q, kc, vc, k, v = kv_tensors(B_cache=1)
    kc, vc = kc.expand(2, -1, -1, -1), vc.expand(2, -1, -1, -1)
    with pytest.raises(ValueError, match=names("k_cache") + ".*stride 0"):
        kvcache(q, kc, vc, k, v, cache_seqlens=1)
    assert kvcache(q, kc, vc, cache_seqlens=1).batch == 2  # read-only: fine


def test_kvcache_paged():
    q, _, _, k, v = kv_tensors()
    kc, vc = paged_kv()  # 6 pages of 4 -> capacity 3 * 4 = 12 with 3 pages per row
    pt = i32([[2, 4, -1], [1, -1, -1]])
    p = kvcache(q, kc, vc, k, v, cache_seqlens=i32([7, 3]), page_table=pt)
    assert p.paged and p.page_size == 4 and p.seqlen_k == 12
    # Appending at 4 needs a second page for row 1, whose entry is -1.
    with pytest.raises(ValueError, match=names("page_table") + ".*\\[1, 1\\] = -1"):
        kvcache(q, kc, vc, k, v, cache_seqlens=i32([7, 4]), page_table=pt)
    with pytest.raises(ValueError, match=names("page_table") + ".*\\[0, 1\\] = 6"):
        kvcache(q, kc, vc, cache_seqlens=5, page_table=i32([[2, 6, 0], [1, 1, 1]]))
    with pytest.raises(ValueError, match=names("cache_batch_idx") + ".*page_table"):
        kvcache(q, kc, vc, cache_seqlens=5, page_table=pt, cache_batch_idx=i32([0, 1]))
    with pytest.raises(ValueError, match=names("cache_seqlens") + ".*capacity 12"):
        kvcache(q, kc, vc, k, v, cache_seqlens=12, page_table=pt)


def test_kvcache_rotary():
    q, kc, vc, k, v = kv_tensors(D=16)
    cos = torch.empty(10, 4, dtype=torch.float16)
    ok = dict(cache_seqlens=1, rotary_cos=cos, rotary_sin=cos.clone())
    assert kvcache(q, kc, vc, k, v, **ok).batch == 2
    with pytest.raises(ValueError, match=names("rotary_cos, rotary_sin")):
        kvcache(q, kc, vc, k, v, **{**ok, "rotary_sin": None})
    with pytest.raises(ValueError, match=names("rotary_sin") + ".*rotary_dim / 2 is 3"):
        kvcache(q, kc, vc, k, v, **{**ok, "rotary_sin": cos[:, :3]})
    with pytest.raises(TypeError, match=names("rotary_cos") + ".*float32"):
        kvcache(q, kc, vc, k, v, **{**ok, "rotary_cos": cos.float()})
    big = torch.empty(10, 9, dtype=torch.float16)
    with pytest.raises(ValueError, match=names("rotary_cos") + ".*rotary_dim = .* = 18"):
        kvcache(q, kc, vc, k, v, **{**ok, "rotary_cos": big, "rotary_sin": big})
    short = torch.empty(9, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match=names("rotary_cos") + ".*capacity 10"):
        kvcache(q, kc, vc, k, v, **{**ok, "rotary_cos": short, "rotary_sin": short})


def test_kvcache_shares_scalar_checks():
    q, kc, vc, _, _ = kv_tensors()
    with pytest.raises(ValueError, match=names("window_size[0]")):
        kvcache(q, kc, vc, cache_seqlens=1, window_size=(-3, 0))
    with pytest.raises(TypeError, match=names("softmax_scale")):
        kvcache(q, kc, vc, cache_seqlens=1, softmax_scale=torch.tensor(1.0))
    with pytest.raises(TypeError, match=names("pack_gqa")):
        kvcache(q, kc, vc, cache_seqlens=1, pack_gqa=1)
