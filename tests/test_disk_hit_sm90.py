"""Kernels loaded from the disk cache in a fresh process run, and match the ones that were built.

GPU (`gpu` marker). One script runs in three fresh processes over one cache folder:

1. "build": compiles every kernel it calls (dense forward, a split-KV KV-cache decode with its
   combine and index check, the deterministic backward with its pre/postprocess) and saves
   each to disk;
2. "shared": the default disk hit, the shared objects loaded by `tvm_ffi.load_module`; the
   process must never import cutlass;
3. "object": CUTE_ATTN_SHARED_LIB=0, the object files JIT-linked by the DSL's loader.

Every phase must reproduce phase 1's outputs bit for bit (same binaries, same inputs; the
backward runs in deterministic mode), the loading phases must build nothing, and a CUDA graph
captured around a loaded kernel must replay to the same result (the launch follows torch's
current stream: a launch on another stream breaks the capture). The dense output is also held
to the fp32 reference.

    python -m pytest -m gpu tests/test_disk_hit_sm90.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from cute_attn.reference import attention_ref

from gpu_cases import assert_matches, attn_inputs

_SCRIPT = r"""
import json, sys
import torch
from cute_attn import cache, flash_attn_func, flash_attn_with_kvcache, last_dispatch
sys.path.insert(0, sys.argv[3])
from gpu_cases import attn_inputs

phase, out_path = sys.argv[1], sys.argv[2]
res = {}
q, k, v = attn_inputs(2, 300, 411, 6, 2, 64, 64, torch.bfloat16)
res["dense"], res["dense_lse"] = flash_attn_func(q, k, v, causal=True)
assert last_dispatch().impl == "sm90_fwd", last_dispatch()
q2, k2, v2 = attn_inputs(1, 257, 257, 4, 4, 128, 128, torch.float16, seed=1)
res["window"], _ = flash_attn_func(q2, k2, v2, window_size=(64, 32))

# split-KV decode over a dense cache: forward split kernel, combine, index check
g = torch.Generator(device="cuda").manual_seed(2)
qd = torch.randn(3, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
kc = torch.randn(3, 700, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
vc = torch.randn(3, 700, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
lens = torch.tensor([1, 350, 700], dtype=torch.int32, device="cuda")
res["decode"], res["decode_lse"] = flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens,
                                                           num_splits=3)
assert last_dispatch().impl == "sm90_fwd", last_dispatch()

# deterministic backward (bitwise run to run): the dQ order is fixed
qb, kb, vb, dout = (t.requires_grad_(i < 3) for i, t in enumerate(
    attn_inputs(1, 200, 333, 4, 2, 128, 128, torch.bfloat16, seed=3, with_dout=True)))
ob, _ = flash_attn_func(qb, kb, vb, causal=True, deterministic=True)
res["dq"], res["dk"], res["dv"] = torch.autograd.grad(ob, (qb, kb, vb), dout)

# a CUDA graph around a loaded kernel
graph_out = torch.empty_like(res["dense"])
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    flash_attn_func(q, k, v, causal=True)  # warm-up on the capture stream
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        o, _ = flash_attn_func(q, k, v, causal=True)
        graph_out.copy_(o)
torch.cuda.current_stream().wait_stream(side)
graph.replay()
torch.cuda.synchronize()
res["graph"] = graph_out

stats = cache.cache_stats()
torch.save({name: t.detach().cpu() for name, t in res.items()}, out_path)
print(json.dumps({"misses": stats["misses"], "disk_hits": stats["disk_hits"],
                  "cutlass": "cutlass" in sys.modules}))
"""


@pytest.mark.gpu
def test_disk_hit_runs_the_built_kernels(tmp_path):
    from cute_attn.cache import _c_compiler

    script = tmp_path / "disk_hit.py"
    script.write_text(_SCRIPT)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, CUTE_ATTN_CACHE_DIR=str(tmp_path / "cache"), CUTE_ATTN_FALLBACK="error")

    def run(phase, **extra):
        out = tmp_path / f"{phase}.pt"
        proc = subprocess.run(
            [sys.executable, str(script), phase, str(out), tests_dir],
            env=dict(env, **extra),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stderr[-8000:]
        return json.loads(proc.stdout.strip().splitlines()[-1]), torch.load(out)

    built_stats, built = run("build")
    assert built_stats["misses"] > 0 and built_stats["disk_hits"] == 0, built_stats
    phases = {"object": run("object", CUTE_ATTN_SHARED_LIB="0")}
    if _c_compiler() is not None:
        phases["shared"] = run("shared")
        assert not phases["shared"][0]["cutlass"], "the shared-object disk hit imported cutlass"
    assert phases["object"][0]["cutlass"]
    for phase, (stats, got) in phases.items():
        assert stats["misses"] == 0, (phase, stats)
        assert stats["disk_hits"] == built_stats["misses"], (phase, stats, built_stats)
        for name, t in built.items():
            assert torch.equal(got[name].nan_to_num(), t.nan_to_num()), (phase, name)
            assert torch.equal(got[name].isnan(), t.isnan()), (phase, name)
    assert torch.equal(built["graph"], built["dense"])

    q, k, v = attn_inputs(2, 300, 411, 6, 2, 64, 64, torch.bfloat16)
    ref, ref_lse = attention_ref(q, k, v, causal=True, compute_dtype=torch.float32)
    same, _ = attention_ref(q, k, v, causal=True, compute_dtype=None)
    assert_matches(built["dense"].cuda(), built["dense_lse"].cuda(), ref, ref_lse, same)
