"""Shared cases and checks of the SM90 inference-path GPU tests (test_inference_sm90.py,
test_pack_gqa_sm90.py): packed varlen sequences and their per-sequence dense reference, dense
KV caches, paged caches with shuffled and poisoned pages, and the dispatch checks those tests
share. Every expectation is cute_attn.reference.attention_ref on each sequence's rows; the
tolerance rule is gpu_cases.assert_matches. Imported by the tests; runs nothing by itself.
"""

from __future__ import annotations

import torch

import cute_attn
from cute_attn import flash_attn_varlen_func, reference
from cute_attn.reference import attention_ref

from gpu_cases import assert_matches

LENS_Q = [0, 1, 113, 5, 239, 300, 2]
LENS_K = [3, 1, 203, 0, 1, 457, 5]


def cuda_gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def packed_rows(lens, h, d, dtype, g):
    return torch.randn(sum(lens), h, d, device="cuda", dtype=dtype, generator=g)


def cu_lens(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")  # fmt: skip


def dense_refs(problems, **kw):
    """(ref32, lse32, same) of each dense (q, k, v) problem, batch dim kept: the package's
    reference in fp32 and in the input dtype (the FlashAttention rule's baseline)."""
    out = []
    for qs, ks, vs in problems:
        r, lse = attention_ref(qs, ks, vs, compute_dtype=torch.float32, **kw)
        s, _ = attention_ref(qs, ks, vs, compute_dtype=None, **kw)
        out.append((r, lse, s))
    return out


def per_sequence_ref(q, k, v, lens_q, lens_k, **kw):
    """(ref32, lse32, same) for packed q / k / v, each sequence its own dense problem."""
    cq, ck = cu_lens(lens_q).tolist(), cu_lens(lens_k).tolist()
    problems = [(q[cq[i] : cq[i + 1]][None], k[ck[i] : ck[i + 1]][None], v[ck[i] : ck[i + 1]][None])
                for i in range(len(lens_q))]  # fmt: skip
    return packed_refs(problems, **kw)


def packed_refs(problems, **kw):
    """(ref32, lse32, same) of dense (1, Sq, ...) problems packed the varlen entry's way:
    out rows (total_q, H, Dv) and lse (H, total_q), sequence after sequence."""
    refs = dense_refs(problems, **kw)
    return (torch.cat([r[0] for r, _, _ in refs]), torch.cat([lse[0] for _, lse, _ in refs], 1),
            torch.cat([s[0] for _, _, s in refs]))  # fmt: skip


def run_varlen(q, k, v, lens_q, lens_k, **kw):
    out, lse = flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_lens(lens_q), cu_seqlens_k=cu_lens(lens_k),
        max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), **kw,
    )  # fmt: skip
    d = cute_attn.last_dispatch()
    assert (d.impl, d.entry) == ("sm90_fwd", "flash_attn_varlen_func"), d
    return out, lse


def check_varlen(h, hkv, d, dtype, mode_kw, num_splits=0, lens_q=LENS_Q, lens_k=LENS_K, seed=0):
    g = cuda_gen(seed)
    q, k = packed_rows(lens_q, h, d, dtype, g), packed_rows(lens_k, hkv, d, dtype, g)
    v = packed_rows(lens_k, hkv, d, dtype, g)
    out, lse = run_varlen(q, k, v, lens_q, lens_k, num_splits=num_splits, **mode_kw)
    ref, ref_lse, same = per_sequence_ref(q, k, v, lens_q, lens_k, **mode_kw)
    assert out.shape == (sum(lens_q), h, d) and lse.shape == (h, sum(lens_q))
    assert_matches(out, lse, ref, ref_lse, same, empty_rows=lambda m: m.transpose(0, 1))
    return q, k, v, out, lse


def check_seqused_q(num_splits, with_seqused_k):
    # sequence b uses its first seqused_q[b] rows (its Sq for the bottom-right corner); the rest
    # of its span gets out 0 / lse -inf, whatever out's memory held before
    lens_q, lens_k = [5, 300, 1, 130, 0], [40, 300, 129, 7, 3]
    used_q, used_k = [2, 257, 0, 130, 0], [40, 211, 129, 1, 3]
    g = cuda_gen(6)
    q = packed_rows(lens_q, 4, 128, torch.bfloat16, g)
    k, v = (
        packed_rows(lens_k, 2, 128, torch.bfloat16, g),
        packed_rows(lens_k, 2, 128, torch.bfloat16, g),
    )
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
    kw = dict(cu_seqlens_q=cu_lens(lens_q), cu_seqlens_k=cu_lens(lens_k), seqused_q=as_t(used_q),
              seqused_k=as_t(used_k) if with_seqused_k else None, causal=True)  # fmt: skip
    junk = torch.full((sum(lens_q), 4, 128), float("nan"), device="cuda", dtype=q.dtype)
    del junk  # its block is free for out: unwritten rows would show as NaN
    out, lse = flash_attn_varlen_func(q, k, v, max_seqlen_q=300, max_seqlen_k=300,
                                      num_splits=num_splits, **kw)  # fmt: skip
    assert cute_attn.last_dispatch().impl == "sm90_fwd"
    ref, ref_lse = reference.attention_ref_varlen(q, k, v, compute_dtype=torch.float32, **kw)
    same, _ = reference.attention_ref_varlen(q, k, v, compute_dtype=None, **kw)
    assert_matches(out, lse, ref, ref_lse, same, empty_rows=lambda m: m.transpose(0, 1))
    cq = cu_lens(lens_q).tolist()
    for b, u in enumerate(used_q):  # unused rows: exactly 0 / -inf
        rows = slice(cq[b] + u, cq[b + 1])
        assert torch.equal(out[rows], torch.zeros_like(out[rows]))
        assert bool((lse[:, rows] == float("-inf")).all())


def cache_case(b, sq, h, hkv, d, s_cache, seed, dtype=torch.bfloat16, b_cache=None):
    g = cuda_gen(seed)

    def mk(*s):
        return torch.randn(*s, device="cuda", dtype=dtype, generator=g)

    b_cache = b_cache or b
    return mk(b, sq, h, d), mk(b_cache, s_cache, hkv, d), mk(b_cache, s_cache, hkv, d)


def cache_ref(q, kc, vc, rows, lens, **kw):
    """Per batch row b: dense attention of q[b] over the first lens[b] rows of cache row
    rows[b]."""
    problems = [(q[b : b + 1], kc[c : c + 1, :n], vc[c : c + 1, :n])
                for b, (c, n) in enumerate(zip(rows, lens))]  # fmt: skip
    return tuple(torch.cat(part) for part in zip(*dense_refs(problems, **kw)))


def feature_flags(keys, name: str) -> list[bool]:
    """InputFeatures.<name> of each forward compile key."""
    from cute_attn.arch.common.features import InputFeatures

    return [getattr(InputFeatures(*k.features), name) for k in keys]


def paged_cache(
    b, hkv, d, page_size, max_pages, lens, g, written=None, dtype=torch.bfloat16, dv=None
):
    """A paged cache whose row b has ceil(lens[b] / page_size) pages at shuffled physical
    positions, holding random keys in its first written[b] (default lens[b]) rows. Later rows
    of those pages hold Inf (k) / NaN (v), spare pages NaN, and table entries past the used
    pages -1: none may reach the output. v's head dim is dv (default d). Returns k_pages,
    v_pages, table (B, max_pages)."""
    written = lens if written is None else written
    dv = dv or d
    used = [-(-n // page_size) for n in lens]
    total = sum(used) + 3  # spare pages nobody uses
    kp = torch.full((total, page_size, hkv, d), float("nan"), device="cuda", dtype=dtype)
    vp = torch.full((total, page_size, hkv, dv), float("nan"), device="cuda", dtype=dtype)
    perm = torch.randperm(total, device="cuda", generator=g)
    table = torch.full((b, max_pages), -1, dtype=torch.int32, device="cuda")
    nxt = 0
    for i, (n, u) in enumerate(zip(written, used)):
        idx = perm[nxt : nxt + u]
        nxt += u
        table[i, :u] = idx.to(torch.int32)
        rk, rv = (torch.randn(u * page_size, hkv, x, device="cuda", dtype=dtype, generator=g)
                  for x in (d, dv))  # fmt: skip
        rk[n:], rv[n:] = float("inf"), float("nan")
        kp[idx], vp[idx] = rk.view(u, page_size, hkv, d), rv.view(u, page_size, hkv, dv)
    return kp, vp, table


def dense_rows(pages, table, lens):
    """Row b's first lens[b] keys of a paged cache, as a list of (1, n, Hkv, D) tensors."""
    ps = pages.shape[1]
    return [pages[table[i, : -(-n // ps)].long()].flatten(0, 1)[None, :n]
            for i, n in enumerate(lens)]  # fmt: skip


def wide_grid_cache(b, hkv, d, cap, layout, g, poison=False, dtype=torch.bfloat16):
    """The KV cache of the wide-grid tests: `b` rows of capacity `cap` (a multiple of 64)
    used to lengths 0, 1, odd and full, laid out as `layout`: "dense", "batch_idx" (cache
    rows in reverse, through cache_batch_idx) or "paged<N>" (shuffled pages of N rows, their
    stale rows Inf / NaN); with `poison` a dense cache's stale rows hold Inf (k) / NaN (v)
    too. Returns (cache_seqlens, k_cache, v_cache, the call's extra kwargs, each row's used
    keys, each row's used values)."""
    lens = [(i * 97) % cap for i in range(b)]
    lens[0], lens[3], lens[5] = cap, 0, 1
    n = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if layout.startswith("paged"):
        page_size = int(layout[5:])
        kc, vc, table = paged_cache(b, hkv, d, page_size, cap // page_size, lens, g)
        ks, vs = dense_rows(kc, table, lens), dense_rows(vc, table, lens)
        return n, kc, vc, {"page_table": table}, ks, vs
    rows = list(range(b))[::-1] if layout == "batch_idx" else list(range(b))
    kc, vc = (torch.randn(b, cap, hkv, d, device="cuda", dtype=dtype, generator=g)
              for _ in range(2))  # fmt: skip
    if poison:
        for c, n_ in zip(rows, lens):
            kc[c, n_:], vc[c, n_:] = float("inf"), float("nan")
    cache = {}
    if layout == "batch_idx":
        cache = {"cache_batch_idx": torch.tensor(rows, dtype=torch.int32, device="cuda")}
    ks = [kc[c : c + 1, :n_] for c, n_ in zip(rows, lens)]
    vs = [vc[c : c + 1, :n_] for c, n_ in zip(rows, lens)]
    return n, kc, vc, cache, ks, vs


def check_route(page_size):
    d = cute_attn.last_dispatch()
    assert d.impl == "sm90_fwd", d
    # honest about what ran: only page sizes without a TMA key tile are gathered first
    assert ("gathers the pages" in d.reason) == (page_size in (1, 8)), d.reason
