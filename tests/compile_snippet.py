"""Run a compile-only snippet in a fresh interpreter and read its result (CPU compile tests).

A fresh process gets its own CUTE_DSL_ARCH (the DSL snapshots it at import) and an empty
compile cache under tmp_path; the snippet prints one JSON value on its last stdout line.
Imported by the test files (pytest puts tests/ on sys.path); nothing here is a test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# Source prepended to snippets that read the SASS of a kernel's main loop: mask_windows(sass)
# counts mask selects (FSEL to -INF) between each "first GEMMs done" wait (gsb0 <= 1) and the
# next wgmma wait, one count per such window, in program order.
MASK_WINDOWS = r"""
import re
def mask_windows(sass):
    ops = re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)([^;]*);", sass)
    windows, n, open_ = [], 0, False
    for op, rest in ops:
        if op == "WARPGROUP.DEPBAR.LE" and rest.strip().endswith("0x1"):
            open_, n = True, 0
        elif op == "WARPGROUP.DEPBAR.LE" and open_:
            windows.append(n); open_ = False
        elif op == "FSEL" and "-INF" in rest and open_:
            n += 1
    return windows
"""

# Source prepended to snippets that count a kernel's wgmmas: hgmma_shapes(sass) maps each
# bf16 HGMMA shape ("64x80x16", with " tnspA" where A is read transposed) to its count.
HGMMA_SHAPES = r"""
import re
def hgmma_shapes(sass):
    shapes = {}
    for shape, rest in re.findall(r"HGMMA\.(\d+x\d+x\d+)\.F32\.BF16 ([^;]*);", sass):
        key = shape + (" tnspA" if "tnspA" in rest else "")
        shapes[key] = shapes.get(key, 0) + 1
    return shapes
"""


def run_json_snippet(snippet: str, tmp_path, *argv: str, timeout: int = 900):
    env = dict(os.environ, CUTE_ATTN_CACHE_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", snippet, *argv], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=timeout)  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
