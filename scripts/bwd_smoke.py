"""One small backward on the GPU against the fp32 reference: a fast hang/crash detector.

Run on the GPU machine as `timeout 90 python3 scripts/bwd_smoke.py`.
"""

import torch

import cute_attn
from cute_attn.reference import attention_ref

torch.manual_seed(0)
for d, causal in ((128, False), (64, True)):
    q, k, v = (torch.randn(2, 300, h, d, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, _ = cute_attn.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    print("backward dispatch:", cute_attn.last_backward_dispatch())
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, _ = attention_ref(qr, kr, vr, causal=causal)
    gr = torch.autograd.grad(ref, (qr, kr, vr), dout.float())
    errs = [(a.float() - b).abs().max().item() for a, b in zip(g, gr)]
    print(f"d={d} causal={causal} max err dq/dk/dv:", [f"{e:.3e}" for e in errs])
