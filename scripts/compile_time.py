"""First calls that must compile: fresh processes, each with an empty disk cache (not a test).

The issue's bar: the first call (compile) of a variant takes <= 2 s. Each fresh process times
`flash_attn_func` on a (1, 512, 8, D) bf16 problem twice: first causal (or not), which pays
the CuTe DSL's import and one build, then the other mask, a second variant's build alone.
Both with the default disk cache (the build is saved, linked into a shared object and loaded
back from it, with no DSL execution engine) and with CUTE_ATTN_SHARED_LIB=0 (the DSL builds
its in-process engine, as before the shared objects). The two settings alternate process by
process, so a drift in host speed hits both alike.

    python3 scripts/compile_time.py [--out compile_time.json] [--dims 64 128 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys, time, torch, cute_attn
from cute_attn import cache
d, causal = int(sys.argv[1]), sys.argv[2] == "1"
q = torch.randn(1, 512, 8, d, dtype=torch.bfloat16, device="cuda")
torch.cuda.synchronize()
t = time.perf_counter()
cute_attn.flash_attn_func(q, q, q, causal=causal)
torch.cuda.synchronize()
first = time.perf_counter() - t
t = time.perf_counter()
cute_attn.flash_attn_func(q, q, q, causal=not causal)
torch.cuda.synchronize()
second = time.perf_counter() - t
s = cache.cache_stats("sm90_fwd")
print(json.dumps({"first": first, "second": second, "build_seconds": s["build_seconds"],
                  "misses": s["misses"]}))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    args = ap.parse_args()
    rows = []
    for d in args.dims:
        for causal in ("1", "0"):
            for shared in ("1", "0"):
                env = dict(os.environ, CUTE_ATTN_CACHE_DIR=tempfile.mkdtemp(),
                           CUTE_ATTN_SHARED_LIB=shared)  # fmt: skip
                res = subprocess.run([sys.executable, "-c", _CHILD, str(d), causal], env=env,
                                     capture_output=True, text=True, check=False)  # fmt: skip
                if res.returncode:
                    raise RuntimeError(res.stderr[-3000:])
                row = json.loads(res.stdout.strip().splitlines()[-1])
                row.update(head_dim=d, causal=causal == "1", shared_lib=shared == "1")
                rows.append(row)
                print(f"D={d} {'causal' if causal == '1' else 'plain '} "
                      f"{'export-only + .so' if shared == '1' else 'DSL engine      '}: first "
                      f"call (DSL import + build) {row['first']:.2f} s, second variant "
                      f"{row['second']:.2f} s", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
