"""Packed GQA rows for more than one query row, against unpacked launches (H200 helper, not a
test).

Speculative decoding calls `flash_attn_with_kvcache` with a few query rows (Sq = 2..32) under
the bottom-right causal corner; a serving engine's decode batch calls `flash_attn_varlen_func`
with one query row a sequence. Unpacked, each CTA computes one query head's rows and reads its
KV head's keys; packed (InputFeatures.pack_gqa, tile_config.fwd_pack_gqa forced on here), one
CTA computes the G x Sq rows of a KV head's G query heads and reads them once. Each row: 32
query heads over 8 KV heads unless it says otherwise, D=128, bf16, causal; KV-cache rows make
a read-only call over cache lengths L (the new keys already appended), varlen rows pack B
sequences of Sq rows over B x L keys, dense rows are causal prefill (Sq = L, flash_attn_func;
they bound the rule), and varlen Sq = 1 rows add the KV-cache decode of the same data (the
host's packed decode view) as a third variant. Every variant is checked against the fp32
reference with the tests' FlashAttention rule (max |out - ref32| <= 2 x the bf16
reference's error + rounding), then timed under CUDA graphs of one and ten calls in rounds
(scripts/decode_splits.graph_rounds).
TB/s counts K + V read once (meaningless for the compute-bound dense rows).

With --wide, a third variant packs onto the two-CTAs-per-SM decode tile
(tile_config.fwd_pack_gqa_wide forced on; "packed" forces it off), in its grid buckets, for
every input set (also those outside fwd_sm90._WIDE_PACKED_INPUTS: the paged and seqused_k
varlen rows).

    python3 scripts/pack_gqa_ab.py [--rounds 50] [--rows NAME ...] [--wide] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_splits import _TableSwap, graph_rounds, one_and_ten_graphs  # noqa: E402

import cute_attn  # noqa: E402
from cute_attn import fwd_sm90  # noqa: E402
from cute_attn.arch.common.features import InputFeatures  # noqa: E402
from cute_attn.arch.sm90.tile_config import FwdTileConfig  # noqa: E402
from cute_attn.bench import environment  # noqa: E402
from cute_attn.reference import attention_ref  # noqa: E402

ROWS = {  # entry, batch, keys a batch row, query rows[, query heads, KV heads (else 32, 8)]
    "b1-32k-q4": ("cache", 1, 32768, 4),
    "b8-8k-q2": ("cache", 8, 8192, 2),
    "b8-8k-q4": ("cache", 8, 8192, 4),
    "b8-8k-q8": ("cache", 8, 8192, 8),
    "b64-8k-q4": ("cache", 64, 8192, 4),
    "b128-2k-q4": ("cache", 128, 2048, 4),
    "varlen-b8-8k-q1": ("varlen", 8, 8192, 1),
    "varlen-b64-8k-q1": ("varlen", 64, 8192, 1),
    "varlen-b64-2k-q4": ("varlen", 64, 2048, 4),
    # where the rule should stop: more query rows, up to prefill (dense: Sq = L)
    "b8-8k-q16": ("cache", 8, 8192, 16),
    "b8-8k-q32": ("cache", 8, 8192, 32),
    "b8-8k-q64": ("cache", 8, 8192, 64),
    "b8-8k-q128": ("cache", 8, 8192, 128),
    "b8-8k-q256": ("cache", 8, 8192, 256),
    "dense-b8-1k": ("dense", 8, 1024, 1024),
    "dense-b2-4k": ("dense", 2, 4096, 4096),
    # groups that do not divide the decode tile's 64 rows (padded tiles): Qwen2.5-7B's 28 / 4
    # heads (G = 7), and G = 5 (Qwen2.5-14B / 32B's 40 / 8)
    "g7-b8-8k-q4": ("cache", 8, 8192, 4, 28, 4),
    "g5-b8-8k-q4": ("cache", 8, 8192, 4, 40, 8),
    "g7-varlen-b64-2k-q4": ("varlen", 64, 2048, 4, 28, 4),
    # a serving engine's paged decode batch (cu_seqlens_q, seqused_k, page_table; pages in a
    # random order), and packed keys with seqused_k: inputs the wide tile was not timed on
    "varlen-paged16-b64-8k-q1": ("varlen-paged16", 64, 8192, 1),
    "varlen-paged64-b64-8k-q1": ("varlen-paged64", 64, 8192, 1),
    "varlen-used-b64-8k-q1": ("varlen-used", 64, 8192, 1),
}


class _AnyInputs:
    """Stands in for fwd_sm90._WIDE_PACKED_INPUTS in the wide variant: every input set may
    take the wide tile (still in its grid buckets), so rows outside the library's set are
    timed on it too."""

    def __contains__(self, features) -> bool:
        return True


def _calls(entry, q, kc, vc):
    """The timed call on (B, Sq, H, D) q over (B, L, Hkv, D) keys, and for Sq = 1 varlen rows
    the KV-cache decode of the same data (None otherwise)."""
    b, sq, _, _ = q.shape
    n = kc.shape[1]
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")

    def cache(q=q, kc=kc, vc=vc, lens=lens):
        return cute_attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)

    if entry == "cache":
        return cache, None
    if entry == "dense":
        return (lambda: cute_attn.flash_attn_func(q, kc, vc, causal=True)), None
    qp, kp, vp = q.flatten(0, 1), kc.flatten(0, 1), vc.flatten(0, 1)
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device="cuda")
    cu_k = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device="cuda")
    kw = dict(cu_seqlens_k=cu_k)
    if entry == "varlen-used":
        kw = dict(cu_seqlens_k=cu_k, seqused_k=lens)
    elif entry.startswith("varlen-paged"):
        # page i of the dense keys lands at page perm[i]: page_table[b, j] = perm[b x n / ps + j]
        ps = int(entry.removeprefix("varlen-paged"))
        perm = torch.randperm(b * n // ps, device="cuda")
        kp, vp = (torch.empty_like(x.view(-1, ps, *x.shape[2:])) for x in (kc, vc))
        kp[perm], vp[perm] = kc.reshape(kp.shape), vc.reshape(vp.shape)
        table = perm.to(torch.int32).view(b, n // ps)
        kw = dict(seqused_k=lens, page_table=table)

        def cache(q=q, kp=kp, vp=vp, lens=lens, table=table):
            return cute_attn.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens,
                                                     page_table=table, causal=True)  # fmt: skip

    def varlen():
        out, lse = cute_attn.flash_attn_varlen_func(
            qp, kp, vp, cu_seqlens_q=cu_q, max_seqlen_q=sq, max_seqlen_k=n, causal=True, **kw
        )  # fmt: skip
        return out.view(q.shape[0], sq, *out.shape[1:]), lse

    return varlen, cache if sq == 1 else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--wide", action="store_true", help="add packed rows on the wide tile")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for name in args.rows:
        entry, b, n, sq, *heads = ROWS[name]
        (h, hkv), d = heads or (32, 8), 128
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
        ref = attention_ref(q, kc, vc, causal=True, compute_dtype=torch.float32)[0]
        same = attention_ref(q, kc, vc, causal=True, compute_dtype=None)[0]
        # the FlashAttention rule (tests/gpu_cases.assert_matches): a fixed 1e-2 stopped the
        # first run at the dense 1k causal rows (unpacked 1.05e-2, forty-fifth session)
        bound = (2 * (same.float() - ref).abs().max().item()
                 + (ref.to(q.dtype).float() - ref).abs().max().item() + 1e-5)  # fmt: skip
        del same
        call, view = _calls(entry, q, kc, vc)
        graphs = {}
        if view is not None:
            err = (view()[0].float() - ref).abs().max().item()
            assert err <= bound, (name, "decode-view", err, bound)
            graphs["decode-view"] = (*one_and_ten_graphs(view), err, 0)
        variants = [("unpacked", False, False), ("packed", True, False)]
        if args.wide:
            variants.append(("packed-wide", True, True))
        for label, packed, wide in variants:
            rule, wide_rule = fwd_sm90.fwd_pack_gqa, fwd_sm90.fwd_pack_gqa_wide
            build, keys, inputs = fwd_sm90.build_fwd, [], fwd_sm90._WIDE_PACKED_INPUTS
            # the rules forced either way (the memos are cleared around each variant)
            fwd_sm90.fwd_pack_gqa = lambda seqlen_q, tile_m, group, p=packed: p
            fwd_sm90.fwd_pack_gqa_wide = lambda w=wide: w
            if wide:
                fwd_sm90._WIDE_PACKED_INPUTS = _AnyInputs()
            fwd_sm90.build_fwd = lambda key, keys=keys, build=build: (keys.append(key),
                                                                     build(key))[1]  # fmt: skip
            try:
                with _TableSwap():
                    out = call()[0]
                    err = (out.float() - ref).abs().max().item()
                    flags = {InputFeatures(*key.features).pack_gqa for key in keys}
                    # the wide tile is the one with two CTAs an SM
                    two = {FwdTileConfig(*key.tile).ctas_per_sm == 2 for key in keys}
                    assert err <= bound and flags == {packed}, (name, label, err, bound, flags)
                    if packed and two != {wide}:  # outside the wide tile's inputs / buckets
                        assert wide and two == {False}, (name, label, two)
                        print(f"{name}: no wide tile here", flush=True)
                        continue
                    graphs[label] = (*one_and_ten_graphs(call), err, 0)
            finally:
                fwd_sm90.fwd_pack_gqa, fwd_sm90.fwd_pack_gqa_wide = rule, wide_rule
                fwd_sm90.build_fwd, fwd_sm90._WIDE_PACKED_INPUTS = build, inputs
        rows += graph_rounds(name, graphs, b * n * hkv * d * 2 * 2, args.rounds, width=11)
        if args.out:  # after every row: a run cut short by its time limit keeps what it timed
            json.dump(dict(environment=environment(torch.device("cuda")), rows=rows),
                      open(args.out, "w"), indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
