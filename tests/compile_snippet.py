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


def run_json_snippet(snippet: str, tmp_path, *argv: str, timeout: int = 900):
    env = dict(os.environ, CUTE_ATTN_CACHE_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", snippet, *argv], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=timeout)  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
