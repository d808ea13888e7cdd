"""B=1 Sk=32k decode on the H200: the split kernel's tile and stage count (not a test).

One new token, 32 query heads over 8 KV heads, D=128, bf16, through `flash_attn_func` with
an explicit num_splits: the library's decode tile (128 keys x 3 stages), 64 keys x 4 or 6
stages (16 and 32 splits), 128 keys x 2 stages; timed as CUDA-graph replays of one call (the
bench's --graph method) and of ten, with scripts/decode_splits.py's timer and table swap.
Each variant is checked against the fp32 reference first (err column). Prints one line per
variant (docs/perf/decode_b1_tiles_s8_h200.log).

    python3 scripts/decode_b1_tiles.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import decode_splits as ds  # noqa: E402

from cute_attn.reference import attention_ref  # noqa: E402

VARIANTS = [  # (name, tile-config overrides); base and n64s6 twice, to see the spread
    ("base", {}),
    ("n64s4", dict(tile_n=64, num_stages=4)),
    ("n64s6", dict(tile_n=64, num_stages=6)),
    ("s2", dict(num_stages=2)),
    ("n64s6", dict(tile_n=64, num_stages=6)),
    ("base", {}),
]


def main():
    torch.manual_seed(0)
    b, sk, h, hkv, d = 1, 32768, 32, 8, 128
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    tensors = (q, k, v, attention_ref(q, k, v, compute_dtype=torch.float32)[0])
    res = []
    for inner in (1, 10):
        for name, ov in VARIANTS:
            for splits in (16, 32) if name.startswith("n64") else (16,):
                swap = ds._TableSwap(**ov) if ov else None
                try:
                    ds._measure(res, f"i{inner}", tensors, name, splits, 50, swap=swap, inner=inner)
                except Exception as e:  # noqa: BLE001 - a variant that does not build
                    print(name, splits, "error", type(e).__name__, str(e)[:200], flush=True)


if __name__ == "__main__":
    main()
