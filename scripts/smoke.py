"""Quick GPU smoke: a few shapes through flash_attn_func vs the fp32 reference, printed as
they finish (a hang shows which case). `python scripts/smoke.py`"""

import time

import torch

from cute_attn import flash_attn_func, last_dispatch
from cute_attn.reference import attention_ref

CASES = [(128, 128, False, 128), (113, 203, False, 128), (300, 457, True, 128), (1, 1, False, 64),
         (1024, 1024, True, 256), (200, 300, False, 192), (64, 16, True, 96)]  # fmt: skip
torch.manual_seed(0)
for sq, sk, causal, d in CASES:
    q = torch.randn(2, sq, 4, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, sk, 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, sk, 2, d, device="cuda", dtype=torch.bfloat16)
    t = time.time()
    o, lse = flash_attn_func(q, k, v, causal=causal)
    torch.cuda.synchronize()
    dt = time.time() - t
    r, rl = attention_ref(q, k, v, causal=causal)
    fin = torch.isfinite(rl)
    print(
        f"{sq:5d} {sk:5d} causal={causal!s:5} d={d:3d} first call {dt:.2f}s "
        f"{last_dispatch().impl} out err {(o.float() - r).abs().max().item():.3e} "
        f"lse err {(lse[fin] - rl[fin]).abs().max().item():.3e}",
        flush=True,
    )
