"""torch.library ops: opcheck, and torch.compile(fullgraph=True) through flash_attn_func,
flash_attn_varlen_func and flash_attn_with_kvcache, dynamic shapes included (CPU).

The CPU runs the reference behind the op; on an SM90 GPU the same op runs the kernel (the GPU
test file exercises that path eagerly)."""

from __future__ import annotations

import pytest
import torch

import cute_attn
from cute_attn import ops
from cute_attn.reference import attention_ref


def _inputs(dtype=torch.float64, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 4, 16, dtype=dtype, generator=g)
    k = torch.randn(2, 9, 2, 16, dtype=dtype, generator=g)
    v = torch.randn(2, 9, 2, 16, dtype=dtype, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


@pytest.mark.parametrize("window", [(-1, 0), (3, 1), (-1, -1)])
def test_opcheck(window):
    q, k, v = _inputs(requires_grad=True)
    torch.library.opcheck(ops.fwd, (q, k, v, 0.25, *window, 0.0, "", True))


def test_op_matches_reference_and_grads():
    q, k, v = _inputs(requires_grad=True)
    out, lse = ops.fwd(q, k, v, 0.25, -1, 0, 5.0, "")
    (out.sum() + lse.sum()).backward()  # lse gradient enters through dlse
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_ref(qr, kr, vr, softmax_scale=0.25, causal=True, softcap=5.0,
                                 compute_dtype=torch.float64)  # fmt: skip
    (ref.sum() + ref_lse.sum()).backward()
    torch.testing.assert_close(out, ref)
    # lse is float32 by contract (also for float64 inputs) and the backward recomputes P from
    # it, so the op's gradients carry float32 rounding of lse (~1e-7 relative in P)
    for a, r in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=2e-6)


def test_compile_fullgraph_forward_and_backward():
    def step(q, k, v):
        out, lse = cute_attn.flash_attn_func(q, k, v, causal=True, window_size=(5, None))
        return (out * out).sum() + lse.sum()

    q, k, v = _inputs(torch.float32, requires_grad=True)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    step(q, k, v).backward()
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_dlse", [False, True])
def test_opcheck_backward_op(with_dlse):
    q, k, v = _inputs()
    out, lse = ops.fwd(q, k, v, 0.25, -1, 0, 0.0, "")
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    torch.library.opcheck(ops.bwd, (q, k, v, out, lse, dout, dlse, 0.25, -1, 0, 0.0, False))


def test_backward_op_records_dispatch_and_matches_reference():
    q, k, v = _inputs()
    out, lse = ops.fwd(q, k, v, 0.25, 3, 1, 0.0, "")
    dout = torch.randn_like(out)
    dq, dk, dv = ops.bwd(q, k, v, out, lse, dout, None, 0.25, 3, 1, 0.0)
    d = cute_attn.last_backward_dispatch()
    assert (d.entry, d.impl) == ("backward", "reference"), d
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, _ = attention_ref(qr, kr, vr, softmax_scale=0.25, window_size=(3, 1),
                           compute_dtype=torch.float64)  # fmt: skip
    ref.backward(dout)
    for a, r in ((dq, qr), (dk, kr), (dv, vr)):
        torch.testing.assert_close(a, r.grad, rtol=1e-5, atol=2e-6)


def test_eager_autograd_lse_only_and_lse_gradient():
    # the eager path (no torch.compile) takes the same backward; out unused -> dout None
    q, k, v = _inputs(requires_grad=True)
    _, lse = cute_attn.flash_attn_func(q, k, v, causal=True)
    lse.sum().backward()
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    attention_ref(qr, kr, vr, causal=True, compute_dtype=torch.float64)[1].sum().backward()
    for a, r in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=2e-6)


# ------------------------------------------------------------------------------------ varlen
LENS_Q, LENS_K = (3, 0, 5, 1), (4, 2, 5, 0)


def _varlen_inputs(dtype=torch.float64, requires_grad=False):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(LENS_Q), 4, 16, dtype=dtype, generator=g)
    k = torch.randn(sum(LENS_K), 2, 16, dtype=dtype, generator=g)
    v = torch.randn(sum(LENS_K), 2, 16, dtype=dtype, generator=g)

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    return [t.requires_grad_(requires_grad) for t in (q, k, v)], cu(LENS_Q), cu(LENS_K)


@pytest.mark.parametrize("window", [(-1, 0), (2, 1)])
def test_opcheck_varlen(window):
    (q, k, v), cu_q, cu_k = _varlen_inputs(requires_grad=True)
    args = (q, k, v, cu_q, cu_k, None, None, None, max(LENS_Q), max(LENS_K), 0.25, *window, 0.0,
            "", False)  # fmt: skip
    torch.library.opcheck(ops.varlen_fwd, args)
    q, k, v = (t.detach() for t in (q, k, v))  # the backward op has no formula of its own
    out, lse = ops.varlen_fwd(q, k, v, *args[3:])
    dlse = torch.randn_like(lse)
    bargs = (q, k, v, out, lse, torch.randn_like(out), dlse, cu_q, cu_k, max(LENS_Q),
             max(LENS_K), 0.25, *window, 0.0, False)  # fmt: skip
    torch.library.opcheck(ops.varlen_bwd, bargs)


def test_opcheck_varlen_seqused_and_pages():
    # forward-only inputs (serving under torch.compile): seqused_k, and a paged cache
    (q, k, v), cu_q, cu_k = _varlen_inputs()
    used = torch.tensor([2, 1, 5, 0], dtype=torch.int32)
    args = (q, k, v, cu_q, cu_k, None, used, None, max(LENS_Q), max(LENS_K), 0.25, -1, 0, 0.0,
            "", False)  # fmt: skip
    torch.library.opcheck(ops.varlen_fwd, args)
    pages = torch.randn(6, 4, 2, 16, dtype=torch.float64)  # (num_pages, page_size, Hkv, D)
    table = torch.tensor([[5, 0], [1, 2], [3, 4], [0, 0]], dtype=torch.int32)
    args = (q, pages, pages.clone(), cu_q, cu_k, None, None, table, max(LENS_Q), max(LENS_K),
            0.25, -1, 0, 0.0, "", False)  # fmt: skip
    torch.library.opcheck(ops.varlen_fwd, args)


def test_compile_fullgraph_varlen_forward_and_backward():
    # torch.compile traces flash_attn_varlen_func into the varlen op (max_seqlen given); the
    # compiled step's gradients (the op's backward: the reference sequence by sequence on the
    # CPU) match eager autograd through the reference
    (q, k, v), cu_q, cu_k = _varlen_inputs(requires_grad=True)

    def step(q, k, v):
        out, lse = cute_attn.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(LENS_Q),
            max_seqlen_k=max(LENS_K), causal=True,
        )  # fmt: skip
        return (out * out).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(q, k, v).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    step(q, k, v).backward()
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=2e-6)


def test_varlen_op_refuses_gradients_through_seqused():
    (q, k, v), cu_q, cu_k = _varlen_inputs(requires_grad=True)
    used = torch.tensor(LENS_Q, dtype=torch.int32)
    out, _ = ops.varlen_fwd(q, k, v, cu_q, cu_k, used, None, None, max(LENS_Q), max(LENS_K),
                            0.25, -1, 0, 0.0, "")  # fmt: skip
    with pytest.raises(NotImplementedError, match="seqused_q / seqused_k"):
        out.sum().backward()


# ---------------------------------------------------------------------------------- KV cache
def _cache_inputs(paged=False):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 4, 16, dtype=torch.float64, generator=g)
    shape = (6, 4, 2, 16) if paged else (2, 12, 2, 16)  # pages of 4 / rows of 12 slots
    kc = torch.randn(shape, dtype=torch.float64, generator=g)
    vc = torch.randn(shape, dtype=torch.float64, generator=g)
    kn = torch.randn(2, 3, 2, 16, dtype=torch.float64, generator=g)
    vn = torch.randn(2, 3, 2, 16, dtype=torch.float64, generator=g)
    table = torch.tensor([[5, 0, 3], [1, 2, 4]], dtype=torch.int32) if paged else None
    return q, kc, vc, kn, vn, table


@pytest.mark.parametrize("lengths", ["tensor", "int", "none"])
@pytest.mark.parametrize("paged", [False, True])
def test_opcheck_kvcache(paged, lengths):
    q, kc, vc, _, _, table = _cache_inputs(paged)
    lens = torch.tensor([5, 9], dtype=torch.int32) if lengths == "tensor" else None
    lens_int = 7 if lengths == "int" else None
    args = (q, kc, vc, lens, lens_int, None, table, 0.25, -1, 0, 0.0, 0, "")
    torch.library.opcheck(ops.kvcache_fwd, args)
    if not paged:  # a cache row per batch row through cache_batch_idx, a window and softcap
        idx = torch.tensor([1, 0], dtype=torch.int32)
        torch.library.opcheck(ops.kvcache_fwd, (*args[:5], idx, None, 0.25, 3, 1, 5.0, 0, ""))
    torch.library.opcheck(ops.kvcache_fwd, (*args, True))  # pack_gqa given


@pytest.mark.parametrize("paged", [False, True])
def test_opcheck_kvcache_append(paged):
    q, kc, vc, kn, vn, table = _cache_inputs(paged)
    lens = torch.tensor([2, 6], dtype=torch.int32)
    ang = torch.rand(16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    args = (q, kc, vc, kn, vn, lens, None, None, table, ang.cos(), ang.sin(), False, 0.25, -1,
            0, 0.0, 0, "")  # fmt: skip
    torch.library.opcheck(ops.kvcache_append_fwd, args)
    torch.library.opcheck(ops.kvcache_append_fwd, (*args, False))  # pack_gqa given


@pytest.mark.parametrize("paged", [False, True])
def test_compile_fullgraph_kvcache_decode_loop(paged):
    # a decode loop under torch.compile: three steps that rotate q and the new k, append k / v
    # in place and attend (the append op), then a read-only call (the other op); outputs and
    # caches equal the eager calls' (the same reference runs behind the op on the CPU)
    q, kc, vc, kn, vn, table = _cache_inputs(paged)
    ang = torch.rand(16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    cos, sin = ang.cos(), ang.sin()

    def step(q, kc, vc, kn, vn, lens):
        return cute_attn.flash_attn_with_kvcache(
            q, kc, vc, kn, vn, cache_seqlens=lens, page_table=table, rotary_cos=cos,
            rotary_sin=sin, window_size=(6, None),
        )  # fmt: skip

    def read(q, kc, vc, lens):
        return cute_attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table,
                                                 softcap=3.0)  # fmt: skip

    compiled_step = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled_read = torch.compile(read, fullgraph=True, backend="aot_eager")
    ke, ve, kcomp, vcomp = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    lens = torch.tensor([0, 3], dtype=torch.int32)  # 9 / 12 slots used after three steps
    for t in range(3):
        n = lens + 3 * t
        want = step(q, ke, ve, kn + t, vn - t, n)
        got = compiled_step(q, kcomp, vcomp, kn + t, vn - t, n)
        assert torch.equal(kcomp, ke) and torch.equal(vcomp, ve)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    want, got = read(q, ke, ve, lens + 9), compiled_read(q, kcomp, vcomp, lens + 9)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_compile_keeps_num_splits_and_pack_gqa():
    # the traced ops carry the caller's num_splits / pack_gqa (they were dropped once, so a
    # compiled model ran the tuning table's choice while eager ran the caller's)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n for n in gm.graph.nodes if n.op == "call_function")
        return gm

    q, k, v = _inputs(torch.float32)
    torch.compile(lambda q, k, v: cute_attn.flash_attn_func(q, k, v, num_splits=3,
                                                            pack_gqa=False),
                  fullgraph=True, backend=backend)(q, k, v)  # fmt: skip
    (vq, vk, vv), cu_q, cu_k = _varlen_inputs(torch.float32)
    torch.compile(lambda q, k, v: cute_attn.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(LENS_Q),
        max_seqlen_k=max(LENS_K), num_splits=2, pack_gqa=True,
    ), fullgraph=True, backend=backend)(vq, vk, vv)  # fmt: skip
    qc, kc, vc, kn, vn, _ = _cache_inputs()
    lens = torch.tensor([2, 6], dtype=torch.int32)
    torch.compile(lambda q, kc, vc, n: cute_attn.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=n, num_splits=4, pack_gqa=True,
    ), fullgraph=True, backend=backend)(qc, kc, vc, lens)  # fmt: skip
    torch.compile(lambda q, kc, vc, kn, vn, n: cute_attn.flash_attn_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=n, num_splits=5, pack_gqa=False,
    ), fullgraph=True, backend=backend)(qc, kc, vc, kn, vn, lens)  # fmt: skip
    calls = {str(n.target): n.args for n in seen if "cute_attn" in str(n.target)}
    got = {name: (args[-3], args[-1]) if "kvcache" in name else args[-2:]
           for name, args in calls.items()}  # fmt: skip
    assert got == {"cute_attn.fwd.default": (3, False),
                   "cute_attn.varlen_fwd.default": (2, True),
                   "cute_attn.kvcache_fwd.default": (4, True),
                   "cute_attn.kvcache_append_fwd.default": (5, False)}, got  # fmt: skip


def test_compile_dynamic_shapes():
    # torch.compile(dynamic=True) traces sizes and python floats symbolically; validation's
    # checks must stay traceable there (math.isfinite of a symbolic float was not). Three
    # sequence lengths through one compiled training step, and a KV-cache decode step over
    # three batch sizes
    def loss(q, k, v):
        out, lse = cute_attn.flash_attn_func(q, k, v, causal=True, window_size=(5, None))
        return (out * out).sum() + lse.sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=True, backend="aot_eager")
    for s in (7, 9, 13):
        g = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(2, s + x, h, 16, generator=g, requires_grad=True)
                   for x, h in ((0, 4), (2, 2), (2, 2)))  # fmt: skip
        want = torch.autograd.grad(loss(q, k, v), (q, k, v))
        for got, w in zip(torch.autograd.grad(compiled(q, k, v), (q, k, v)), want):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)

    def decode(q, kc, vc, kn, vn, n):
        return cute_attn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=n)

    compiled = torch.compile(decode, fullgraph=True, dynamic=True, backend="aot_eager")
    for b in (2, 3, 5):
        g = torch.Generator().manual_seed(b)
        q, kn, vn = (torch.randn(b, 1, h, 16, generator=g) for h in (4, 2, 2))
        kc, vc = (torch.randn(b, 20, 2, 16, generator=g) for _ in range(2))
        n = torch.arange(b, dtype=torch.int32) + 3
        kc2, vc2 = kc.clone(), vc.clone()
        want, got = decode(q, kc, vc, kn, vn, n), compiled(q, kc2, vc2, kn, vn, n)
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
        for x, w in zip(got, want):
            torch.testing.assert_close(x, w)
