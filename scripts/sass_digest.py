"""Digests of the sm_90a SASS of named forward variants (CPU only, not a test).

A change meant to leave kernels alone (a host rule, a refactor) is checked by running this at
two commits and comparing: each variant is compiled for sm_90a without a GPU, disassembled
(nvdisasm, from nvidia-cuda-nvdisasm) and hashed with the address comments stripped, so two
builds of the same instructions give the same digest. To run the script at another commit,
install that commit's tree editable (its `cute_attn.arch` comes from there), e.g.

    git worktree add /tmp/old <commit> && pip install --no-deps -e /tmp/old
    python3 scripts/sass_digest.py > old.json         (then reinstall this tree; again > new.json)
    python3 scripts/sass_digest.py [--only NAME ...]

Variants: the packed-GQA rows over a KV cache (causal, split partials, the cluster merge, a
left window, softcap; D = 64 / 128 / 256), over packed sequences, and the persistent and
one-CTA-a-tile dense forwards.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

_KV = {"seqused_k": True, "pack_gqa": True}
# name: (head dim, H, Hkv, left bound, right bound, softcap, decode tile, persistent SMs,
# InputFeatures fields)
VARIANTS = {
    "pack kvcache causal d128 g4": (128, 8, 2, False, True, False, True, 0, _KV),
    "pack kvcache split d128 g4": (128, 8, 2, False, True, False, True, 0,
                                   {**_KV, "split_kv": True}),
    "pack kvcache cluster d128 g4": (128, 8, 2, False, True, False, True, 0,
                                     {**_KV, "split_kv": True, "split_cluster": True}),
    "pack kvcache left d128 g4": (128, 8, 2, True, True, False, True, 0, _KV),
    "pack kvcache softcap d128 g8": (128, 16, 2, False, True, True, True, 0, _KV),
    "pack varlen causal d128 g4": (128, 32, 8, False, True, False, True, 0,
                                   {"cu_seqlens_q": True, "cu_seqlens_k": True, "pack_gqa": True}),
    "pack kvcache causal d64 g4": (64, 32, 8, False, True, False, True, 0, _KV),
    "pack kvcache causal d256 g4": (256, 8, 2, False, True, False, True, 0, _KV),
    "persistent plain d128": (128, 8, 8, False, False, False, False, 132, {}),
    "persistent causal d128": (128, 8, 8, False, True, False, False, 132, {}),
    "dense causal d128": (128, 8, 8, False, True, False, False, 0, {}),
    "dense d128": (128, 16, 16, False, False, False, False, 0, {}),
    "dense d256": (256, 8, 8, False, False, False, False, 0, {}),
    "dense causal d256": (256, 8, 8, False, True, False, False, 0, {}),
}  # fmt: skip


def digest(name: str) -> str:
    from cute_attn.aot import _sass
    from cute_attn.arch.common.features import InputFeatures
    from cute_attn.arch.sm90.compile import FwdSpec, compile_fwd
    from cute_attn.arch.sm90.tile_config import fwd_tile_config

    d, h, hkv, left, right, softcap, decode, sms, feats = VARIANTS[name]
    if sms:
        cfg = fwd_tile_config(d, d, right and not left, left, persistent_sms=sms)
    else:
        cfg = fwd_tile_config(d, d, right and not left, left, decode)
    spec = FwdSpec("bfloat16", d, d, h, hkv, left, right, softcap, cfg, InputFeatures(**feats))
    sass = _sass(compile_fwd(spec, "--keep-cubin").__cubin__)
    if not sass:
        raise SystemExit("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    sass = re.sub(r"/\*[0-9a-f]{4,}\*/", "", sass)  # instruction addresses
    return f"{hashlib.md5(sass.encode()).hexdigest()[:12]} {len(sass)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=sorted(VARIANTS), default=None)
    args = ap.parse_args()
    import cute_attn.arch.sm90.flash_fwd as kernel

    print(f"kernel source: {kernel.__file__}", file=sys.stderr)
    out = {}
    for name in args.only or VARIANTS:
        out[name] = digest(name)
        print(f"{name}: {out[name]}", file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
