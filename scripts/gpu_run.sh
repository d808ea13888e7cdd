#!/usr/bin/env bash
# One call on the GPU machine: environment info, the GPU tests, a benchmark preset.
# Full logs go under $OUT (or ./out); the short tables come last on stdout.
#   bash scripts/gpu_run.sh [pytest -k expression] [bench preset | none]
# env: TESTS (test files; default forward, backward and varlen backward), MAXFAIL (default 10),
# TEST_TIMEOUT (default 500 s), BENCH_ARGS, BENCH_TIMEOUT (default 400 s)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
KEXPR=${1:-}
PRESET=${2:-fwd-prefill}
export PYTHONUNBUFFERED=1 CUTE_ATTN_CACHE_DIR=${CUTE_ATTN_CACHE_DIR:-/tmp/cute_attn_cache}
python3 -m cute_attn info > "$OUT/info.txt" 2>&1; cat "$OUT/info.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >> "$OUT/info.txt" 2>&1
read -r -a files <<< "${TESTS:-tests/test_fwd_sm90.py tests/test_bwd_sm90.py tests/test_bwd_varlen_sm90.py}"
args=(-m gpu -q --maxfail="${MAXFAIL:-10}" -p no:cacheprovider "${files[@]}")
[ -n "$KEXPR" ] && args+=(-k "$KEXPR")
timeout ${TEST_TIMEOUT:-500} python3 -m pytest "${args[@]}" > "$OUT/gpu_tests.log" 2>&1
rc=$?
echo "== gpu tests rc=$rc"; tail -25 "$OUT/gpu_tests.log"
if [ "$PRESET" != "none" ]; then
  timeout ${BENCH_TIMEOUT:-400} python3 -m cute_attn bench --preset "$PRESET" --out "$OUT/bench.json" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "== bench rc=$?"; tail -45 "$OUT/bench.log"
fi
exit $rc
