"""Per-wave cost of the packed decode kernel (H200 helper, not a test).

Decode rows (one new token, 32 query heads over 8 KV heads, D=128, bf16) whose grids hold the
same K/V bytes in 2, 4 or 8 waves of one CTA per SM (B x 8 KV heads CTAs on 132 SMs: B=33, 66,
132), and the bench's B=64 / B=128 rows, for cute_attn (`flash_attn_func`) and SDPA's cuDNN
backend. 10 back-to-back eager calls per CUDA-event pair (these shapes are GPU-bound), 40
rounds over all rows and both impls, median us per call. If each wave paid a fixed start/drain
cost, the 8-wave row would be slower than the 4-wave row of the same bytes.

    python3 scripts/decode_waves.py decode_waves.json
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
import torch.nn.functional as F

import cute_attn

INNER = 10
ROWS = [(66, 8192), (132, 4096), (33, 16384), (64, 8192), (128, 2048), (132, 2048), (264, 1024)]


def main(path: str) -> None:
    calls = []
    for b, sk in ROWS:
        q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, sk, 8, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, sk, 8, 128, device="cuda", dtype=torch.bfloat16)

        def ours(q=q, k=k, v=v):
            for _ in range(INNER):
                cute_attn.flash_attn_func(q, k, v)

        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        def cudnn(qt=qt, kt=kt, vt=vt):
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                for _ in range(INNER):
                    F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        for name, fn in (("cute_attn", ours), ("cudnn", cudnn)):
            fn()  # compile / plan, then one warm call
            fn()
            calls.append(((b, sk, name), fn, []))
    for _ in range(40):
        for _key, fn, times in calls:
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / INNER)
    out = []
    for (b, sk, name), _fn, times in calls:
        med = statistics.median(times)
        tbps = 2 * b * sk * 8 * 128 * 2 / (med * 1e-6) / 1e12
        out.append(dict(batch=b, seqlen_k=sk, impl=name, us=med, tbps=tbps))
        print(f"b{b:<4} sk{sk:<6} {name:<10} {med:8.1f} us {tbps:5.2f} TB/s")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode_waves.json")
