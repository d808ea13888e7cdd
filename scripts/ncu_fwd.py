"""One forward of cute_attn and one of FA4 inside a CUDA profiler range, for Nsight Compute;
with a fourth argument `bwd`, one backward of each instead (the forwards run outside the range).

Run on the GPU machine (after warm-up calls outside the range, so compiles are not profiled):

    ncu --clock-control none --profile-from-start off --set full -o $OUT/fwd -f \\
        python3 scripts/ncu_fwd.py 128 4096 0        # head_dim, seqlen, causal (0/1) [bwd]
    ncu --import $OUT/fwd.ncu-rep --page details --csv > $OUT/fwd_details.csv
    ncu --import $OUT/fwd.ncu-rep --page source --csv --print-source sass > $OUT/fwd_sass.csv

Shapes follow the bench matrix: 16k tokens, hidden 2048 (H = 2048 / D), bf16. Kernel ID 0 is
cute_attn, ID 1 FA4 (skipped when flash_attn.cute is not importable); a backward profiles
each library's pre- and postprocess kernels around its main kernel. A trailing `tall` runs
the D=64 forward on the 192-row tile whatever the length (tile_config.fills_tall_tiles).
"""

import sys

import torch

import cute_attn

D, S, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
bwd = "bwd" in sys.argv[4:]
if "tall" in sys.argv[4:]:
    import cute_attn.fwd_sm90

    cute_attn.fwd_sm90.fills_tall_tiles = lambda *args: True
H, B = 2048 // D, 16384 // S
q, k, v = (
    torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=bwd)
    for _ in range(3)
)
attns = [lambda: cute_attn.flash_attn_func(q, k, v, causal=causal)[0]]
try:
    from flash_attn.cute import flash_attn_func as fa4

    attns.append(lambda: fa4(q, k, v, causal=causal, return_lse=True)[0])
except ImportError:
    pass
fns = attns
if bwd:
    dout = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    outs = [f() for f in attns]  # the graphs the profiled backward calls walk

    def grad_of(out):
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    fns = [grad_of(o) for o in outs]
for _ in range(3):
    for f in fns:
        f()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for f in fns:
    f()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
