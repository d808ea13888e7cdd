"""SM90 varlen backward (q and k / v packed by cu_seqlens) vs the fp32 reference (GPU, `gpu`
marker).

Gradients come through the public path (flash_attn_varlen_func + autograd) with a random dO,
against autograd through `attention_ref_varlen` (one reference call per sequence), under the
FlashAttention rule per gradient: max|g - g_ref32| <= 2 * max|g_torch - g_ref32| + atol, where
g_torch is the same reference in the input dtype and atol covers rounding g_ref32 to it.
Lengths include empty sequences (no queries, no keys, or neither), one-row sequences and
lengths that end inside a tile, so tiles cross into the next packed sequence.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from cute_attn import flash_attn_varlen_func, last_backward_dispatch, last_dispatch
from cute_attn.bench import capture_graph
from cute_attn.reference import attention_ref_varlen

from gpu_cases import SWEEP_MODES, assert_grads_match, force_bwd_tile, mode_kwargs

# (lens_q, lens_k) per case: cross-attention lengths, self-attention lengths, empty sequences
LENGTHS = {
    "mixed": ([113, 0, 1, 300, 64, 257], [203, 5, 0, 300, 1, 129]),
    "self": ([1, 77, 128, 129, 640, 33], [1, 77, 128, 129, 640, 33]),
    "q_past_k": ([300, 7, 190], [100, 7, 64]),
}


def _cu(lens):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")


def _packed(lens_q, lens_k, h, hkv, d, dv, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(*s):
        return torch.randn(*s, device="cuda", dtype=dtype, generator=g)

    tq, tk = sum(lens_q), sum(lens_k)
    return mk(tq, h, d), mk(tk, hkv, d), mk(tk, hkv, dv), mk(tq, h, dv)


def _grads(fn, q, k, v, dout, dlse_w=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    loss = (out.float() * dout.float()).sum()
    if dlse_w is not None:  # lse used downstream: its gradient must flow back too
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse_w).sum()
    return torch.autograd.grad(loss, (q, k, v))


def _run(lens_q, lens_k, q, k, v, dout, dlse_w=None, **kw):
    cu = dict(cu_seqlens_q=_cu(lens_q), cu_seqlens_k=_cu(lens_k))
    maxes = dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    return _grads(
        lambda a, b, c: flash_attn_varlen_func(a, b, c, **cu, **maxes, **kw), q, k, v, dout, dlse_w
    )


def _check(lens_q, lens_k, h=6, hkv=2, d=128, dv=128, dtype=torch.bfloat16, lse_grad=False,
           **kw):  # fmt: skip
    q, k, v, dout = _packed(lens_q, lens_k, h, hkv, d, dv, dtype)
    dlse_w = None
    if lse_grad:
        gen = torch.Generator(device="cuda").manual_seed(7)
        dlse_w = torch.randn(h, q.shape[0], device="cuda", generator=gen)
    got = _run(lens_q, lens_k, q, k, v, dout, dlse_w, **kw)
    assert last_dispatch().impl == "sm90_fwd", last_dispatch()
    bd = last_backward_dispatch()
    assert (bd.entry, bd.impl) == ("backward", "sm90_bwd"), bd
    cu = dict(cu_seqlens_q=_cu(lens_q), cu_seqlens_k=_cu(lens_k))
    rkw = {key: val for key, val in kw.items() if key != "deterministic"}  # kernel-only knob
    f32 = [t.float() for t in (q, k, v, dout)]
    ref = _grads(lambda a, b, c: attention_ref_varlen(a, b, c, **cu, **rkw), *f32, dlse_w)
    same = _grads(
        lambda a, b, c: attention_ref_varlen(a, b, c, **cu, compute_dtype=None, **rkw),
        q, k, v, dout, dlse_w,
    )  # fmt: skip
    assert_grads_match(got, ref, same, q.dtype)
    return got


HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 192), (192, 128), (256, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", HEAD_DIMS)
@pytest.mark.parametrize("lengths", sorted(LENGTHS))
@pytest.mark.parametrize("mode", SWEEP_MODES)
def test_varlen_bwd_sweep(d, dv, lengths, mode):
    _check(*LENGTHS[lengths], d=d, dv=dv, **mode_kwargs(mode))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_varlen_bwd_fp16(d):
    _check(*LENGTHS["mixed"], d=d, dv=d, dtype=torch.float16, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("h,hkv", [(6, 6), (6, 3), (6, 1)])
@pytest.mark.parametrize("window", [(None, None), (64, None), (None, 64), (5, -1)])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_bwd_gqa_windows(h, hkv, window, causal):
    _check(*LENGTHS["mixed"], h=h, hkv=hkv, causal=causal, window_size=window)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("hkv,kw", [(2, {}), (1, {"causal": True}), (3, {"deterministic": True})])
def test_varlen_bwd_group_heads(grouped_heads, d, hkv, kw):
    # a CTA per KV head walking its query heads (forced; see conftest.grouped_heads)
    _check(*LENGTHS["mixed"], h=6, hkv=hkv, d=d, dv=d, **kw)
    assert [key.group_heads for key in grouped_heads] == [True], grouped_heads


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_varlen_bwd_lse_gradient(d):
    # dlse enters D at each row's padded position (bwd_sm90.run_bwd_varlen)
    _check(*LENGTHS["mixed"], d=d, dv=d, lse_grad=True, causal=True)


def _check_deterministic_mixed(d, causal, runs=3):
    """The deterministic order over the "mixed" packed sequences: right against the
    reference, and the same gradients bit for bit over `runs` more runs."""
    lens_q, lens_k = LENGTHS["mixed"]
    _check(lens_q, lens_k, d=d, dv=d, deterministic=True, causal=causal)
    q, k, v, dout = _packed(lens_q, lens_k, 6, 2, d, d, torch.bfloat16)
    first = _run(lens_q, lens_k, q, k, v, dout, deterministic=True, causal=causal)
    for _ in range(runs):
        again = _run(lens_q, lens_k, q, k, v, dout, deterministic=True, causal=causal)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal", [(96, True), (128, False), (256, True)])
@pytest.mark.parametrize("writers", [2, 3])
def test_varlen_bwd_dq_writers(monkeypatch, built_bwd_keys, d, causal, writers):
    # BwdTileConfig.dq_writers = 2 / 3 over packed sequences, deterministic: right, and
    # bitwise over runs
    force_bwd_tile(monkeypatch, dq_writers=writers)
    _check_deterministic_mixed(d, causal)
    assert built_bwd_keys and all(key.varlen for key in built_bwd_keys), built_bwd_keys


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal", [(128, True), (256, True), (256, False)])
def test_varlen_bwd_det_poll_early(monkeypatch, built_bwd_keys, d, causal):
    # BwdTileConfig.det_poll_early over packed sequences: right, and bitwise over runs
    force_bwd_tile(monkeypatch, det_poll_early=True)
    _check_deterministic_mixed(d, causal)
    assert built_bwd_keys and all(key.varlen for key in built_bwd_keys), built_bwd_keys


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_bwd_deterministic_is_bitwise_and_sequences_do_not_leak(d, causal):
    # deterministic=True: the same gradients bit for bit over repeated runs; and perturbing
    # one sequence's q, k, v and dO leaves every other sequence's gradients bitwise unchanged
    # (a tile crossing into a neighbour must neither read its rows into the math nor write
    # or reduce-add into its rows)
    lens_q, lens_k = LENGTHS["mixed"]
    _check(lens_q, lens_k, d=d, dv=d, deterministic=True, causal=causal)  # and it is right
    q, k, v, dout = _packed(lens_q, lens_k, 6, 2, d, d, torch.bfloat16)
    kw = dict(deterministic=True, causal=causal)
    first = _run(lens_q, lens_k, q, k, v, dout, **kw)
    for _ in range(5):
        again = _run(lens_q, lens_k, q, k, v, dout, **kw)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    b = 3  # the 300 / 300 sequence, between two others
    cq, ck = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
    q2, k2, v2, do2 = (t.clone() for t in (q, k, v, dout))
    for t, rows in ((q2, rq), (k2, rk), (v2, rk), (do2, rq)):
        t[rows] = torch.randn_like(t[rows]) * 3
    moved = _run(lens_q, lens_k, q2, k2, v2, do2, **kw)
    keep_q = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    keep_q[rq] = False
    keep_k = torch.ones(k.shape[0], dtype=torch.bool, device="cuda")
    keep_k[rk] = False
    for a, c, keep in zip(first, moved, (keep_q, keep_k, keep_k)):
        assert torch.equal(a[keep], c[keep])
        assert not torch.equal(a[~keep], c[~keep])  # the perturbed sequence did change


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_bwd_nan_in_one_sequence_stays_there(d, causal):
    # NaN in one packed sequence's q, k, v and dO (its own gradients are NaN) must not reach a
    # neighbour's: the tiles that cross into it read its rows, where P = 0 alone gives
    # 0 * NaN = NaN
    lens_q, lens_k = LENGTHS["mixed"]
    q, k, v, dout = _packed(lens_q, lens_k, 6, 2, d, d, torch.bfloat16)
    first = _run(lens_q, lens_k, q, k, v, dout, causal=causal)
    b = 3  # the 300 / 300 sequence, between two others
    cq, ck = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
    q2, k2, v2, do2 = (t.clone() for t in (q, k, v, dout))
    for t, rows in ((q2, rq), (k2, rk), (v2, rk), (do2, rq)):
        t[rows] = float("nan")
    moved = _run(lens_q, lens_k, q2, k2, v2, do2, causal=causal)
    keep_q = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    keep_q[rq] = False
    keep_k = torch.ones(k.shape[0], dtype=torch.bool, device="cuda")
    keep_k[rk] = False
    for name, a, c, keep in zip(("dq", "dk", "dv"), first, moved, (keep_q, keep_k, keep_k)):
        assert torch.equal(a[keep], c[keep]), f"{name}: NaN reached another sequence"


@pytest.mark.gpu
def test_varlen_bwd_torch_compile_training_step():
    # fullgraph: flash_attn_varlen_func traces into the varlen op, whose backward op runs the
    # varlen kernels
    torch._dynamo.reset()
    lens_q, lens_k = LENGTHS["mixed"]
    q, k, v, dout = _packed(lens_q, lens_k, 4, 2, 128, 128, torch.bfloat16)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)

    def step(q, k, v):
        out, lse = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
            max_seqlen_k=max(lens_k), causal=True,
        )  # fmt: skip
        fin = torch.where(torch.isfinite(lse), lse, 0.0)
        return (out.float() * dout.float()).sum() + fin.sum() * 1e-3

    grads = {}
    for name, fn in (("eager", step), ("compiled", torch.compile(step, fullgraph=True))):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        fn(qq, kk, vv).backward()
        assert last_backward_dispatch().impl == "sm90_bwd"
        grads[name] = (qq.grad, kk.grad, vv.grad)
    for a, b in zip(grads["eager"], grads["compiled"]):
        # same kernels, but dQ partials are added in arrival order: not bitwise
        assert (a.float() - b.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_varlen_bwd_cuda_graph_replay_matches_eager():
    # no host sync in the varlen forward (its index check is skipped while capturing) nor in
    # the backward, so a training step captures
    lens_q, lens_k = LENGTHS["self"]
    q, k, v, dout = _packed(lens_q, lens_k, 4, 2, 128, 128, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)

    def fwd_bwd():
        out, _ = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
            max_seqlen_k=max(lens_k), causal=True,
        )  # fmt: skip
        return torch.autograd.grad((out.float() * dout.float()).sum(), (q, k, v))

    eager = fwd_bwd()  # compiles and loads every kernel outside the capture
    graph, captured = capture_graph(fwd_bwd, warmup=2)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert (a.float() - b.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_varlen_bwd_seqused_falls_back_only_with_reference():
    # seqused_q / seqused_k under autograd are not served by the varlen backward: refused on
    # the default policy, the reference's autograd with fallback='reference'
    lens = [5, 9]
    q, k, v, _ = _packed(lens, lens, 2, 2, 64, 64, torch.bfloat16)
    q.requires_grad_()
    used = torch.tensor([3, 9], dtype=torch.int32, device="cuda")
    kw = dict(cu_seqlens_q=_cu(lens), cu_seqlens_k=_cu(lens), max_seqlen_q=9, max_seqlen_k=9,
              seqused_k=used)  # fmt: skip
    with pytest.raises(NotImplementedError, match="seqused"):
        flash_attn_varlen_func(q, k, v, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback warns once per process
        out, _ = flash_attn_varlen_func(q, k, v, fallback="reference", **kw)
    assert last_dispatch().impl == "reference"
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# ---------------------------------------------------------------- CPU: the padded row layout
@pytest.mark.parametrize("tile_m", [64, 128])
def test_padded_rows_give_each_sequence_whole_tiles(tile_m):
    # the kernels' padded row offset (arch/common/seqlen.padded_row_offset) puts every
    # sequence's tiles inside the buffer run_bwd_varlen allocates, without overlapping another
    # sequence's
    for lens in ([0], [1], [5, 0, 0, 3], [64, 64, 1], [127, 129, 0, 300, 1], [200] * 7):
        cu = [0, *itertools.accumulate(lens)]
        total, batch = sum(lens), len(lens)
        rows = -(-(total + batch * tile_m) // tile_m) * tile_m
        spans = []
        for b, n in enumerate(lens):
            start = (cu[b] + b * tile_m) // tile_m * tile_m
            assert start % tile_m == 0
            spans.append((start, start + -(-n // tile_m) * tile_m))
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, (lens, spans)
        assert spans[-1][1] <= rows, (lens, spans, rows)
