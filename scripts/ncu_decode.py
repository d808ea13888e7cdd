"""One decode call each of cute_attn, FA4 and cuDNN (torch SDPA) inside a CUDA profiler range,
for Nsight Compute: B sequences of Sk cached keys, one new query token, 32 query heads over 8
KV heads, D=128, bf16 (the decode rows of `python -m cute_attn bench --preset decode`).

Run on the GPU machine (warm-up calls run outside the range, so compiles are not profiled):

    ncu --clock-control none --profile-from-start off --set full -o $OUT/decode -f \\
        python3 scripts/ncu_decode.py 64 8192          # batch, seqlen_k
    ncu --import $OUT/decode.ncu-rep --page details --csv > $OUT/decode_details.csv

Kernels in launch order: cute_attn's, then FA4's (skipped when flash_attn.cute is not
importable), then cuDNN's.
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cute_attn

B, SK = int(sys.argv[1]), int(sys.argv[2])
H, HKV, D = 32, 8, 128
q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(B, SK, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
fns = [lambda: cute_attn.flash_attn_func(q, k, v, causal=True)]
try:
    from flash_attn.cute import flash_attn_func as fa4

    fns.append(lambda: fa4(q, k, v, causal=True))
except ImportError:
    pass
qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))


def cudnn():
    # one query row sees every key: no mask needed for the bottom-right corner
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)


fns.append(cudnn)
for _ in range(3):
    for f in fns:
        f()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for f in fns:
    f()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
