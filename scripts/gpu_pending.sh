#!/usr/bin/env bash
# GPU work left for the next machine (after the GPU bundle is unpacked and cute_attn
# installed there), by steps; the default is what is still pending, all on an H200:
# `pers_tests pers_ab pers_short epi_tests epi_ab bwd_bench sdk_rows cta_cost preov_ab
# sdk_ab det_ratio` (det_ratio's four lowest shapes ran on an H200 in the seventieth
# session). No machine ran in the seventy-third session (six starts refused, then loans
# paused); it added FA4 to every A/B step (`tune_bwd_sm90.py --fa4`) and pers_short. The
# seventy-second session ran `align_tests align_ab timeline` on an H100 (end_aligned passed
# and won: now in the table; the timeline's second run failed on a bad variant, since
# fixed); pers_* (the persistent backward) and epi_* are its own, which no machine ran: call
# `pers_tests pers_ab pers_short` first (`pers_quick` or `pers_mini` on a short budget),
# then `epi_tests epi_ab`, then bwd_bench on an H200. The
# seventieth session ran `decode_bench bwd_bench v128_ab
# bwd192_bench` on an H100 (its v128_ab an A/A run, since fixed), then `bwd_bench
# decode_bench smask_ab v128_ab bwd192_bench` and `det_ratio` on four shapes on an H200
# (docs/perf/README.md). The sixty-ninth session ran `dyn_tests` (passed), `bwd_bench
# bwd192_bench sdk_ab` and `v128_ab` on H100s, then the (192, 128) tile it took and its
# tests (docs/perf/README.md). The sixty-seventh session ran `table66_tests w_tests
# bwd_touched det_ratio` and the rest of the backward sweep on an H100 (every test passed;
# docs/perf/README.md). The sixty-sixth session ran `balance_ab balance_tests det_w2_tests
# bwd_bench det_ratio bwd192_bench` and `det_wide_ov` on an H100. At
# most 8 files come back from $OUT a call: steps write few, and a call should run few steps.
# The sixty-first session also ran `det_big_tests` and the backward sweep's cases 457-480 on
# an H100 (both passed) and removed det_part_turns and det_chains (a deterministic variant
# of its own), which lost everywhere in its A/B (docs/perf/tune_bwd_det_chains_s61_h100.json).
# The fifty-eighth session put L2 sections in the unmasked deterministic order
# (bwd_tile_config) and removed
# BwdTileConfig.det_free_early (it lost everywhere), and checked the persistent preprocess
# on 896 threads (`preov_896 preov_tests preov_fp16`) and the new deterministic tests
# (`det_sec_tests`), on an H100 only; the fifty-ninth put BwdTileConfig.dq_skip_zero_rows in
# the table (D = 96's flat dQ adds without dQ^T's zero rows; `skip_ab skip_tests`, H100
# only). The pre_overlap A/B (`preov_ab`) is owed on an H200 too; the fifty-fourth session
# measured BwdTileConfig.s_under_dk and the wider short-rows bucket on H100s only, so their A/B
# (`sdk_ab sdk_rows`), the `bwd_bench` rows and the backward tests they touch
# (`bwd_touched`) are owed on an H200. The forward sweep has passed whole on H200s
# (forty-eighth and fifty-second sessions) and the other forward GPU tests on H100s
# (`fwd_rest` from 77 still owed on an H200); the backward sweep passed whole on an H100 in
# the fifty-third session (479 passed, its one strict xfail).
# Each step has its own time limit, so a slow one cannot starve the rest; full logs and JSON
# go under $OUT (JSON names end in the GPU, e.g. _h200), the tails come last on stdout.
#   bash scripts/gpu_pending.sh [step ...]
# steps:
#   preov_ab    scripts/tune_bwd_sm90.py: BwdTileConfig.pre_overlap off, and on with 32 / 48
#               / 66 persistent preprocess CTAs (preov_ab2: 16 / 24 / 32; preov_ab3: off /
#               16 / 32 on the 16k rows and 1k causal); preov_tests / preov_rest: the backward
#               tests it touches (sweep bf16 D <= 128, lse gradient dense and packed, CUDA
#               graphs, torch.compile; group_heads, deterministic)
#   v128_ab     scripts/tune_bwd_sm90.py: (192, 128): the table (one dS buffer, two dO
#               stages) against the old form (two dS buffers, one dO stage), unmasked and
#               causal
#   smask_ab    scripts/tune_bwd_sm90.py: split_mask_loops, and the last 8 causal L2 sections
#               as one, each against the table on D = 128's causal rows (seventieth session,
#               an H200: neither taken)
#   sdk_ab      scripts/tune_bwd_sm90.py: BwdTileConfig.s_under_dk (the next query tile's S^T
#               issued before the wait for this tile's dK) off / on, on the taller tiles
#               (the script does not take the short-rows bucket), D = 64 / 96 / 128 unmasked
#               and causal (D = 64 causal excluded: ptxas serializes its wgmmas there), and
#               in the deterministic order
#   skip_ab     scripts/tune_bwd_sm90.py: BwdTileConfig.dq_skip_zero_rows off / on at D = 96,
#               default and deterministic order; skip_tests: the backward tests the
#               warp-major flat tile and the skipped rows touch (193)
#   det_big     the same script: the deterministic order against the default one at D = 192
#               and 256, and in L2 sections
#   compact_tests  D = 96's compact flat accumulator (96 floats a row): its backward tests
#               (104); compact_ab: off (dq_skip_zero_rows=False) / on, D = 96, 4 shapes
#   det_big_tests  the deterministic tests at D = 192 / 256 (26)
#   w2_ab       scripts/tune_bwd_sm90.py: one / two dQ writer warps (BwdTileConfig.dq_writers),
#               deterministic and default order, D = 96 to 256; w2_tests: their tests (30)
#   pe_ab       the same script: BwdTileConfig.det_poll_early (the writer polls its turn
#               before the consumers stage the tile, not after) off / on, with two and three
#               dQ writers, D = 128 to 256, deterministic, the default order beside;
#               pe_tests: its tests (29)
#   split_ab    the same script: BwdTileConfig.tail_split off / on (the model's parts, and 2 / 3
#               / 4 forced) on the bench's unmasked rows; split_tests: its tests (79)
#   balance_ab  the same script: BwdTileConfig.post_overlap / pre_overlap off (the table) / on
#               past D = 128 and l2_last_sections 1 / 2 / 4 on causal rows; tail_split at
#               D = 192 without / with the overlaps on unmasked ones; balance_tests: their
#               tests (34)
#   pe_quick    pe_ab's and dq2_ab's main rows in one call (D = 256 4k causal and 4k, D = 192
#               4k causal)
#   dq2_ab      the same script at D = 256, deterministic: one Q stage with a dQ staging
#               buffer per warpgroup (num_stages=1, dq_stages=2), with and without
#               det_poll_early, against the table's two Q stages and one shared buffer
#   w3_ab       the same script: two / three dQ writer warps in the deterministic order, D = 96
#               to 256 (w3_quick: its first three shapes); w_tests: the tests with 2 and 3
#               writers forced (60)
#   det_w2_tests  every deterministic backward GPU test (57) on the table's two writers
#   det_ratio   the same script: the default order / deterministic on the bench's shapes
#               (DET_RATIO_SHAPES: a comma-separated subset)
#   cta_cost    scripts/bwd_cta_cost.py: a backward CTA's fixed cost (launch, prologue,
#               epilogue) fitted from unmasked D=128 timings at two key lengths, cute_attn and FA4
#   align_tests the GPU tests of BwdTileConfig.end_aligned (forced on the flat-dQ tiles, no
#               short-rows bucket: 20 cases); align_ab: the table (which takes it on the dense
#               causal 80- and 96-row tiles) against it off (tune_bwd_sm90.py)
#   pers_tests  the GPU tests of BwdTileConfig.persistent_ctas (12 cases: 5 / 132 CTAs, stride
#               and counter walks, D = 64 / 96 / 128); pers_ab: the persistent grid (stride,
#               stride without pre_overlap, counter) against the table on five rows;
#               pers_short: D=96 4k causal's short-rows tile and its counter walk;
#               pers_quick / pers_mini: the D=128 cases and a shorter A/B. Every A/B step
#               times FA4's backward in the same rounds (tune_bwd_sm90.py --fa4)
#   epi_tests   the GPU tests of BwdTileConfig.epilogue_first (forced on every dense key: five
#               head dims, unmasked, causal, deterministic bitwise, tail_split) and the table's
#               end_aligned domain; epi_ab: its A/B against the table (tune_bwd_sm90.py)
#   timeline    scripts/bwd_timeline.py: the backward's SM time split CTA by CTA (walks, CTA
#               start and end, gaps between CTAs, idle SMs) on the D=128 16k / 4k and D=96 4k
#               causal rows, and the short-rows tile at D=96 4k / D=128 2k causal
#   sdk_rows    the same script under the causal mask at D = 128 / 96 (and D = 96 unmasked):
#               64 query rows (dQ^T, swizzled staging), with and without s_under_dk, with it
#               on the flat staging, and the 80 rows with it, against the table
#   pack_tests  the packed-GQA GPU tests (padded groups, pack_gqa=True, the wide decode tile)
#   new_tests   the wide-grid tests (KV-cache, varlen, varlen over a cache; decode view), the
#               memo-hit tests (KV-cache, varlen) and the varlen bound-launcher tests of the
#               packed-GQA and inference files
#   bwd_m64     scripts/tune_bwd_sm90.py: D=128's 64-row dQ = dS K tile against the table's
#               80 rows, unmasked, 4k to 16k (the forty-ninth session's H100 run)
#   bwd_l2      the same script under the causal mask at D = 96 / 128: L2 sections off, of
#               half and twice BWD_L2_SECTION_BYTES, and (D = 96) 80 query rows; at D = 128
#               m80 is the table's tile again, a measure of the noise
#   bwd_touched the backward GPU tests s_under_dk and the short-rows bucket touch (262: the
#               sweep's unmasked cases, its causal ones at D <= 128, short rows, group_heads,
#               lse gradient, CUDA graphs, torch.compile), under a 560 s limit
#   softcap96   the backward tests of D=96 under softcap on its own columns that the
#               fifty-fifth session's sweep run did not cover (varlen softcap sweep cases,
#               group_heads: 53, passed on an H100 in the fifty-sixth session), under a 400 s
#               limit
#   dyn_tests   the torch.compile GPU tests of the backward and inference files, among them
#               the dynamic=True training step and KV-cache decode step (card-agnostic)
#   bwd_rest    the backward GPU tests but the sweep (tests/test_bwd_sm90.py -k "not sweep"),
#               under a 380 s limit
#   bwd_tail    the 39 of them that the forty-ninth session's H100 did not reach before that
#               limit (deterministic order, fallback, non-contiguous views, torch.compile
#               training step, CUDA-graph replay), with the 13 other deterministic ones: 52
#               (all passed on the fiftieth session's H100)
#   fwd_rest    the forward GPU tests but the sweep (tests/test_fwd_sm90.py -k "not sweep"),
#               from test FWD_REST_FROM (default 77) in collection order, under a 560 s limit
#   fwd_sweep   the forward GPU sweep (tests/test_fwd_sm90.py -k sweep, 480 cases) from case
#               SWEEP_FROM (default 1) to SWEEP_TO (default the last), under a 560 s limit
#               (140 cases took 185 s on the fifty-second session's H200: ranges of ~300)
#   bwd_sweep   the backward GPU sweep (tests/test_bwd_sm90.py -k sweep, 480 cases, one a
#               strict xfail) from case BWD_SWEEP_FROM (default 1) to BWD_SWEEP_TO (default
#               the last), under a 560 s limit (the whole sweep took 405 s on the
#               fifty-third session's H100)
#   pack_ab     unpacked / packed / packed on the wide tile, speculative rows (whole and
#               padded groups; PACK_AB_ROWS overrides them): what fwd_pack_gqa's padded tiles
#               and fwd_pack_gqa_wide rest on
#   wide_varlen the same over the varlen decode batches with seqused_k or paged K/V (pages
#               of 16 and 64), the wide variant forced for their inputs, and the plain varlen
#               decode batch beside them: what fwd_sm90._WIDE_PACKED_INPUTS rests on
#   tail_ab     the KV-cache tail A/B (what tile_config.fwd_ragged_cache rests on)
#   inference   the other inference GPU tests (tests/test_inference_sm90.py; 450 s ran 243 of
#               251 on a cold cache in the forty-sixth session: a call of its own)
#   spec_bench  bench --preset spec-decode under CUDA graphs against FA4 and cuDNN
#   decode_bench  bench --preset decode under CUDA graphs against FA4 and cuDNN (the Sq = 1
#               rows, last benched in the thirty-eighth session)
#   fwd_bench   bench --preset fwd-prefill (issue #3's rows) against FA4 and cuDNN
#   bwd_bench   bench --preset bwd (issue #4's rows) against FA4 and cuDNN
#   bwd192_bench  the full preset's D = 192 and (192, 128) backward rows against FA4 and cuDNN
#               (not benched since the twenty-sixth session)
#   host        scripts/host_overhead.py --tiny-only and scripts/compile_time.py --dims 128 256
#               (issue #3's host-time and first-call bars)
#   host_varlen scripts/host_overhead.py --varlen-only (the varlen entry's memo on / off, its
#               hits without the bound launcher)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUTE_ATTN_CACHE_DIR=${CUTE_ATTN_CACHE_DIR:-/tmp/cute_attn_cache}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(pers_tests pers_ab pers_short epi_tests epi_ab bwd_bench
                                sdk_rows cta_cost preov_ab sdk_ab det_ratio)
# the GPU's name in the JSON files' names: h100, h200 (the device tool may lend either)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
      | grep -o -i 'h[0-9]00' | tr 'H' 'h')
gpu=${gpu:-gpu}
python3 -m cute_attn info > "$OUT/info.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv \
    >> "$OUT/info.txt" 2>&1
# gpu_tests LIMIT LOG PYTEST_ARGS...: the GPU tests of PYTEST_ARGS under a time limit, into
# $OUT/LOG
gpu_tests() {
  local limit=$1 log=$2; shift 2
  timeout "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider "$@" > "$OUT/$log" 2>&1
}
# sweep_cases LIMIT LOG FILE FROM TO [KEXPR]: FILE's GPU tests that -k KEXPR (default
# sweep) selects, FROM..TO (1-based, in collection order; TO '$': the last), under a time
# limit; nothing runs when the range is empty (an empty id list would run every GPU test of
# the file)
sweep_cases() {
  local limit=$1 log=$2 file=$3 ids
  ids=$(python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider "$file" \
      -k "${6:-sweep}" 2>/dev/null | grep "::" | sed -n "$4,$5p")
  # -vv (gpu_tests passes -q): a run cut by its limit still names the tests that passed
  # shellcheck disable=SC2086  # one test id a word
  [ -n "$ids" ] && gpu_tests "$limit" "$log" -vv $ids
}
declare -A rcs
for step in "${steps[@]}"; do
  case "$step" in
    pack_tests) gpu_tests 300 gpu_tests_pack_gqa.log tests/test_pack_gqa_sm90.py ;;
    new_tests)
      gpu_tests 330 gpu_tests_wide_memo.log tests/test_pack_gqa_sm90.py \
          tests/test_inference_sm90.py -k "wide_grid or memo_hit or bound_launcher" ;;
    bwd_m64)
      timeout 200 python3 scripts/tune_bwd_sm90.py --reps 30 \
          --shapes d128-16k,d128-8k,d128-4k,gqa-d128-16k,d96-16k \
          --variant base= --variant m64=tile_m=64,dq_flat=False \
          --out "$OUT/tune_bwd_m64_$gpu.json" > "$OUT/tune_bwd_m64.log" 2>&1 ;;
    v128_ab)
      # (192, 128): the table's one dS buffer with two dO stages (the sixty-ninth session's
      # change) against the old two dS buffers and one dO stage. Once that change was in the
      # table, the step's old form compared it with itself (the seventieth session's first
      # run, an A/A: tune_bwd_v128_same_s70_h100)
      timeout 400 python3 scripts/tune_bwd_sm90.py --reps 30 \
          --shapes d192v128-4k,d192v128-16k,d192v128-1k,d192v128-4k-causal,d192v128-16k-causal \
          --variant old=single_ds=False,do_stages=1 --variant table= \
          --out "$OUT/tune_bwd_v128_$gpu.json" > "$OUT/tune_bwd_v128.log" 2>&1 ;;
    smask_ab)
      # split_mask_loops (the query tiles that see every key in a mask-free loop of their own)
      # on D = 128's 80-row causal tile (on the old 64-row tile and on D = 96's 96 rows it
      # tied or lost; spill-free for sm_90a), and the last 8 causal L2 sections as one (where
      # a section holds at most 2 pairs: the 16k row) against the table's 4 (the sixty-sixth
      # session measured 1 / 2 / 4). On an H200 (seventieth session) -0.5% and +0.4% at 16k
      # causal, the latter within the script's A/A spread: neither taken
      timeout 300 python3 scripts/tune_bwd_sm90.py --reps 30 \
          --shapes d128-16k-causal,d128-4k-causal,gqa-d128-4k-causal,d128-2k-causal \
          --variant base= --variant smask=split_mask_loops=True \
          --variant last8=l2_last_sections=8 \
          --out "$OUT/tune_bwd_smask_$gpu.json" > "$OUT/tune_bwd_smask.log" 2>&1 ;;
    sdk_ab)
      timeout 420 python3 scripts/tune_bwd_sm90.py --reps 30 \
          --shapes d128-4k,d128-16k,d128-4k-causal,d128-16k-causal,d96-4k,d96-4k-causal,d96-16k-causal,d128-1k,d128-2k-causal,gqa-d128-4k-causal,d64-4k,d64-16k \
          --variant off=s_under_dk=False --variant sdk=s_under_dk=True \
          --out "$OUT/tune_bwd_sdk_$gpu.json" > "$OUT/tune_bwd_sdk.log" 2>&1
      timeout 200 python3 scripts/tune_bwd_sm90.py --reps 20 --shapes d128-4k-causal,d96-4k \
          --variant det=deterministic=1,s_under_dk=False \
          --variant det_sdk=deterministic=1,s_under_dk=True \
          --out "$OUT/tune_bwd_sdk_det_$gpu.json" > "$OUT/tune_bwd_sdk_det.log" 2>&1 ;;
    postov_ab)
      # BwdTileConfig.post_overlap (the postprocess as the main kernel's programmatic
      # dependent, converting each head once its main CTAs are done) against the table
      timeout 330 python3 scripts/tune_bwd_sm90.py --reps 30 \
          --shapes d128-4k,d128-16k,d128-4k-causal,d128-16k-causal,d96-4k,d96-16k-causal,d64-4k \
          --variant base= --variant post=post_overlap=True \
          --out "$OUT/tune_bwd_post_overlap_$gpu.json" > "$OUT/tune_bwd_post_overlap.log" 2>&1
      timeout 120 python3 scripts/tune_bwd_sm90.py --reps 30 --shapes d96-4k-causal \
          --variant short=tile_m=64,dq_flat=False,s_under_dk=True \
          --variant short_post=tile_m=64,dq_flat=False,s_under_dk=True,post_overlap=True \
          --out "$OUT/tune_bwd_post_overlap_short_$gpu.json" \
          > "$OUT/tune_bwd_post_overlap_short.log" 2>&1 ;;
    preov_ab)
      # BwdTileConfig.pre_overlap (the persistent preprocess beside the main grid) off, and
      # on with 32 / 48 / 66 CTAs (one compiled main kernel for the three)
      timeout 420 python3 scripts/tune_bwd_sm90.py --reps 20 \
          --shapes d128-4k,d128-16k,d128-4k-causal,d96-4k-causal,d96-16k-causal,d128-1k,d64-4k \
          --variant off=pre_overlap=False --variant p32=pre_ctas=32 \
          --variant p48=pre_ctas=48 --variant p66=pre_ctas=66 \
          --out "$OUT/tune_bwd_pre_overlap_$gpu.json" > "$OUT/tune_bwd_pre_overlap.log" 2>&1 ;;
    preov_ab2)
      timeout 200 python3 scripts/tune_bwd_sm90.py --reps 20 \
          --shapes d128-4k,d128-4k-causal,d96-16k-causal,d128-1k,d64-4k \
          --variant p16=pre_ctas=16 --variant p24=pre_ctas=24 --variant p32=pre_ctas=32 \
          --out "$OUT/tune_bwd_pre_overlap_b_$gpu.json" > "$OUT/tune_bwd_pre_overlap_b.log" 2>&1 ;;
    preov_ab3)
      # the long rows, where the preprocess is the smallest share
      timeout 300 python3 scripts/tune_bwd_sm90.py --reps 30 \
          --shapes d128-16k-causal,d64-16k-causal,d128-16k,d96-16k,d64-16k,d128-1k-causal \
          --variant off=pre_overlap=False --variant p16=pre_ctas=16 --variant p32=pre_ctas=32 \
          --out "$OUT/tune_bwd_pre_overlap_c_$gpu.json" > "$OUT/tune_bwd_pre_overlap_c.log" 2>&1 ;;
    det_ov)
      # post_overlap and pre_overlap in the deterministic order (sem's counts after the
      # turns): off / on, and the default order for the ratio; then its GPU tests
      timeout 240 python3 scripts/tune_bwd_sm90.py --reps 20 \
          --shapes d128-4k,d128-4k-causal,d96-4k-causal,d64-4k,d128-16k-causal \
          --variant base= --variant det_off=deterministic=1,pre_overlap=False,post_overlap=False \
          --variant det_on=deterministic=1 \
          --out "$OUT/tune_bwd_det_overlap_$gpu.json" > "$OUT/tune_bwd_det_overlap.log" 2>&1
      gpu_tests 300 gpu_tests_det_overlap.log tests/test_bwd_sm90.py -k "deterministic and \
          not 192 and not 256" ;;
    preov_896)
      # the persistent preprocess on 896 threads a CTA (1,024 spilled one fp16 form): off /
      # on again
      timeout 150 python3 scripts/tune_bwd_sm90.py --reps 20 \
          --shapes d128-4k,d128-1k,d64-4k,d96-16k-causal \
          --variant off=pre_overlap=False --variant on= \
          --out "$OUT/tune_bwd_pre_overlap_896_$gpu.json" > "$OUT/tune_bwd_pre_overlap_896.log" 2>&1 ;;
    det_free)
      # the deterministic order with and without L2 sections (the table's: unmasked, D <=
      # 128) against the default order for the ratio (the fifty-eighth session's run also
      # had BwdTileConfig.det_free_early, since removed)
      timeout 420 python3 scripts/tune_bwd_sm90.py --reps 20 \
          --shapes d128-4k,d128-4k-causal,d96-4k-causal,d64-4k,d128-1k \
          --variant base= --variant det=deterministic=1 \
          --variant det_nosec=deterministic=1,l2_section_bytes=0 \
          --out "$OUT/tune_bwd_det_free_$gpu.json" > "$OUT/tune_bwd_det_free.log" 2>&1 ;;
    skip_ab)
      # BwdTileConfig.dq_skip_zero_rows (D = 96's flat dQ^T adds without its zero rows
      # 96..127): off / on, in the default and the deterministic order
      timeout 470 python3 scripts/tune_bwd_sm90.py --reps 20 \
          --shapes d96-4k,d96-1k,d96-4k-causal,d96-16k-causal \
          --variant noskip=dq_skip_zero_rows=False --variant skip= \
          --variant det_noskip=deterministic=1,dq_skip_zero_rows=False \
          --variant det=deterministic=1 \
          --out "$OUT/tune_bwd_skip_zero_$gpu.json" > "$OUT/tune_bwd_skip_zero.log" 2>&1 ;;
    det_big)
      # the deterministic order against the default one past D = 128 (not measured since the
      # twenty-fourth session's D = 192 run), and in L2 sections of 32 MiB (the table's
      # unmasked deterministic order at D <= 128; it lost under the causal mask there)
      timeout 380 python3 scripts/tune_bwd_sm90.py --reps 12 \
          --shapes d256-4k,d256-4k-causal,d256-1k,d192-4k,d192-4k-causal \
          --variant base= --variant det=deterministic=1 \
          --variant det_sec=deterministic=1,l2_section_bytes=33554432 \
          --out "$OUT/tune_bwd_det_big_$gpu.json" > "$OUT/tune_bwd_det_big.log" 2>&1 ;;
    skip_tests)
      # the warp-major flat dQ tile (every dq_flat tile: D = 64 / 96 / 128) and D = 96's adds
      # without its zero rows: the sweep's bf16 cases at D = 64 / 128 and D = 96's in both
      # dtypes, the lse-gradient tests (dense and packed), D = 96 deterministic and
      # group_heads, CUDA graphs (193)
      gpu_tests 560 gpu_tests_skip_zero.log tests/test_bwd_sm90.py tests/test_bwd_varlen_sm90.py \
          -k "(sweep and (64-64-dtype0 or 96-96 or 128-128-dtype0)) or lse_gradient or \
          only_lse or (deterministic and 96) or (group_heads and 96) or cuda_graph" ;;
    det_big_tests)
      # the deterministic tests past D = 128 (their unmasked order in L2 sections since the
      # sixtieth session; 26)
      gpu_tests 400 gpu_tests_det_big.log tests/test_bwd_sm90.py tests/test_bwd_varlen_sm90.py \
          -k "deterministic and (192 or 256)" ;;
    w2_ab)
      # the deterministic order with one / two dQ writer warps, the default order beside
      timeout 400 python3 scripts/tune_bwd_sm90.py --reps 10 \
          --shapes d256-4k,d256-4k-causal,d256-1k,d192-4k-causal,d192-4k,d128-4k-causal,d96-4k \
          --variant base= --variant w2=dq_writers=2 --variant det=deterministic=1 \
          --variant det_w2=deterministic=1,dq_writers=2 \
          --out "$OUT/tune_bwd_dq_writers_$gpu.json" > "$OUT/tune_bwd_dq_writers.log" 2>&1 ;;
    w2_tests)
      # BwdTileConfig.dq_writers = 2 forced: dense (default and deterministic order, every
      # head dim, unmasked and causal), group_heads and packed (30)
      gpu_tests 400 gpu_tests_dq_writers.log tests/test_bwd_sm90.py tests/test_bwd_varlen_sm90.py \
          -k "two_dq_writers" ;;
    w3_ab)
      # the deterministic order with two (the table's) / three dQ writer warps, the default
      # order beside
      timeout 400 python3 scripts/tune_bwd_sm90.py --reps 10 \
          --shapes d256-4k-causal,d256-4k,d256-1k,d192-4k-causal,d128-4k-causal,d96-4k \
          --variant base= --variant det=deterministic=1 \
          --variant det_w3=deterministic=1,dq_writers=3 \
          --out "$OUT/tune_bwd_dq_writers3_$gpu.json" > "$OUT/tune_bwd_dq_writers3.log" 2>&1 ;;
    w3_quick)
      # w3_ab's first three shapes (D = 256 4k causal and 4k, D = 192 4k causal), for a call
      # that runs w_tests too
      timeout 200 python3 scripts/tune_bwd_sm90.py --reps 10 \
          --shapes d256-4k-causal,d256-4k,d192-4k-causal \
          --variant base= --variant det=deterministic=1 \
          --variant det_w3=deterministic=1,dq_writers=3 \
          --out "$OUT/tune_bwd_dq_writers3_$gpu.json" > "$OUT/tune_bwd_dq_writers3.log" 2>&1 ;;
    pe_ab)
      # BwdTileConfig.det_poll_early off / on, with the table's two dQ writers and with three,
      # in the deterministic order; the default order beside (for the ratio)
      timeout 480 python3 scripts/tune_bwd_sm90.py --reps 10 \
          --shapes d256-4k-causal,d256-4k,d256-1k,d192-4k-causal,d128-4k-causal \
          --variant base= --variant det=deterministic=1 \
          --variant det_pe=deterministic=1,det_poll_early=True \
          --variant det_w3=deterministic=1,dq_writers=3 \
          --variant det_w3pe=deterministic=1,dq_writers=3,det_poll_early=True \
          --out "$OUT/tune_bwd_poll_early_$gpu.json" > "$OUT/tune_bwd_poll_early.log" 2>&1 ;;
    balance_ab)
      # the grid's last wave, three ways (scripts/tune_bwd_sm90.py, round-robin). Causal rows:
      # the table / both overlaps (BwdTileConfig.post_overlap, pre_overlap; the table's up to
      # D = 128) / the last 2 or 4 L2 sections launched as one (l2_last_sections; the list-
      # scheduling model of scripts/sim_bwd_launch.py --bench puts the table's order 1.5-4.2%
      # over the ideal on the first five rows, 0.5-1.5% with them; D = 256 4k: 0.2%, a
      # control; each row's lines are logged as it ends, so a run cut by its limit keeps the
      # rows before). Unmasked rows whose last wave tail_split's model splits: without / with
      # it, each without / with both overlaps (under post_overlap the walk-length floor turns
      # the split off at 4k, so ov_t is ov there); D = 192 4k's grid is 13 waves and 4 key
      # tiles (1,720 on 132 SMs), which the model cuts in 4 parts each
      timeout ${BALANCE_CAUSAL_LIMIT:-300} python3 scripts/tune_bwd_sm90.py --reps 10 \
          --shapes ${BALANCE_CAUSAL_SHAPES:-d192-4k-causal,d192-16k-causal,d96-16k-causal,\
d192v128-16k-causal,d192v128-4k-causal,d256-4k-causal} \
          --variant base= --variant ov=post_overlap=True,pre_overlap=True \
          --variant ls2=l2_last_sections=2 --variant ls4=l2_last_sections=4 \
          --out "$OUT/tune_bwd_balance_causal_$gpu.json" > "$OUT/tune_bwd_balance_causal.log" 2>&1
      timeout ${BALANCE_SPLIT_LIMIT:-260} python3 scripts/tune_bwd_sm90.py --reps 10 \
          --shapes ${BALANCE_SPLIT_SHAPES:-d192-4k,d192v128-16k,d256-4k,d256-16k} \
          --variant base=tail_split=False --variant t=tail_split=True \
          --variant ov=post_overlap=True,pre_overlap=True,tail_split=False \
          --variant ov_t=post_overlap=True,pre_overlap=True,tail_split=True \
          --out "$OUT/tune_bwd_balance_split_$gpu.json" > "$OUT/tune_bwd_balance_split.log" 2>&1 ;;
    balance_tests)
      # their tests (34): D = 192 / (192, 128) / 256 with both overlaps forced (every mask,
      # softcap, deterministic bitwise, longer walks, fp16, with tail_split's parts) and the
      # last L2 sections merged (causal; unmasked deterministic, bitwise)
      gpu_tests 450 gpu_tests_balance.log tests/test_bwd_sm90.py -vv \
          -k "overlaps_wide or l2_last_sections" ;;
    det_wide_ov)
      # the deterministic order past D = 128 without / with both overlaps (the table's since
      # the sixty-sixth session; its H100 run's table is tune_bwd_det_wide_ov_s66_h100.log)
      timeout 150 python3 scripts/tune_bwd_sm90.py --reps 10 \
          --shapes d256-4k-causal,d256-4k,d192-4k-causal,d192-4k \
          --variant det=deterministic=1 \
          --variant det_noov=deterministic=1,post_overlap=False,pre_overlap=False \
          --out "$OUT/tune_bwd_det_wide_ov_$gpu.json" > "$OUT/tune_bwd_det_wide_ov.log" 2>&1 ;;
    table66_tests)
      # the backward tests of the sixty-sixth session's table (both overlaps at every head
      # dim, the last 4 causal sections as one where a section holds at most 2 pairs) that
      # its H100 did not run: the section cover tests (a 3-pair budget: sections of 2, whose
      # last ones now merge) and the deterministic order in sections; below D = 192 the
      # change reaches only long causal calls (sections of at most 2 pairs), which the
      # sweep's lengths never make (bwd_touched runs the sweep there)
      gpu_tests 300 gpu_tests_table66.log tests/test_bwd_sm90.py -vv \
          -k "l2_sections_cover or in_l2_sections or l2_last_sections" ;;
    pe_quick)
      # one call's worth of pe_ab and dq2_ab: D = 256 4k causal (the issue's 0.85 row) and
      # 4k, D = 192 4k causal; det_poll_early with two and three writers, and with D = 256's
      # buffer per warpgroup on one Q stage
      timeout 420 python3 scripts/tune_bwd_sm90.py --reps 10 \
          --shapes d256-4k-causal,d256-4k,d192-4k-causal \
          --variant base= --variant det=deterministic=1 \
          --variant det_pe=deterministic=1,det_poll_early=True \
          --variant det_w3pe=deterministic=1,dq_writers=3,det_poll_early=True \
          --variant det_q1pe=deterministic=1,num_stages=1,dq_stages=2,det_poll_early=True \
          --out "$OUT/tune_bwd_poll_early_quick_$gpu.json" \
          > "$OUT/tune_bwd_poll_early_quick.log" 2>&1 ;;
    dq2_ab)
      # D = 256 in the deterministic order with a staging buffer per warpgroup (dq_stages=2),
      # which fits only with one Q stage (num_stages=1: 209.5 KiB; the table's two Q stages and
      # one shared buffer: 217.75), with and without det_poll_early; the default order beside
      timeout 300 python3 scripts/tune_bwd_sm90.py --reps 10 \
          --shapes d256-4k-causal,d256-4k,d256-1k-causal \
          --variant base= --variant det=deterministic=1 \
          --variant det_pe=deterministic=1,det_poll_early=True \
          --variant det_q1=deterministic=1,num_stages=1,dq_stages=2 \
          --variant det_q1pe=deterministic=1,num_stages=1,dq_stages=2,det_poll_early=True \
          --out "$OUT/tune_bwd_d256_dq2_$gpu.json" > "$OUT/tune_bwd_d256_dq2.log" 2>&1 ;;
    split_ab)
      # BwdTileConfig.tail_split (the grid's last partial wave of key tiles split by query
      # tiles, dK / dV partials summed by the last part) off / on with the model's parts count
      # and with 2 / 3 / 4 parts forced, on the bench's unmasked rows (every one a partial
      # last wave: D = 128 / 256 2048 key tiles on 132 SMs, D = 96 2688, D = 64 4096) and
      # D = 128 4k causal without L2 sections
      timeout 500 python3 scripts/tune_bwd_sm90.py --reps 10 \
          --shapes d128-16k,d128-4k,d128-1k,d256-4k,d96-4k,d64-4k,d64-1k \
          --variant base= --variant split=tail_split=True \
          --variant split2=tail_split=True,tail_parts=2 \
          --variant split3=tail_split=True,tail_parts=3 \
          --variant split4=tail_split=True,tail_parts=4 \
          --out "$OUT/tune_bwd_tail_split_$gpu.json" > "$OUT/tune_bwd_tail_split.log" 2>&1 ;;
    split_tests)
      # tail_split forced: every head dim, unmasked / causal / window / softcap, 2 to 4 parts
      # of every key tile, right and dK / dV bitwise over runs; a third of the tiles split,
      # fp16 too; the model's own split on a grid with a short last wave (79)
      gpu_tests 540 gpu_tests_tail_split.log tests/test_bwd_sm90.py -vv -k "tail_split" ;;
    pe_tests)
      # det_poll_early forced: every head dim's tile, unmasked and causal, two and three
      # writers, group_heads and packed (29), right and bitwise over runs
      gpu_tests 450 gpu_tests_poll_early.log tests/test_bwd_sm90.py \
          tests/test_bwd_varlen_sm90.py -vv -k "det_poll_early" ;;
    w_tests)
      # BwdTileConfig.dq_writers = 2 and 3 forced (three writers: the consumers count the
      # walk): dense, group_heads and packed (60), -vv so a run cut by its limit
      # (W_TESTS_LIMIT, default 560 s) still names the tests that passed
      gpu_tests "${W_TESTS_LIMIT:-560}" gpu_tests_dq_writers.log tests/test_bwd_sm90.py \
          tests/test_bwd_varlen_sm90.py -vv -k "dq_writers" ;;
    det_w2_tests)
      # every deterministic test (windows, softcap, L2 sections, 20-run bitwise, packed,
      # group_heads) on the table's two dQ writers (57)
      gpu_tests 500 gpu_tests_det_w2.log tests/test_bwd_sm90.py tests/test_bwd_varlen_sm90.py \
          -k deterministic ;;
    det_ratio)
      # the deterministic order against the default one on the bench's backward shapes
      # (DET_RATIO_SHAPES: a subset, e.g. the rows past D = 128 where the ratio is lowest)
      timeout 500 python3 scripts/tune_bwd_sm90.py --reps 10 \
          --shapes "${DET_RATIO_SHAPES:-d64-4k,d64-4k-causal,d64-16k,d96-4k-causal,d96-16k,\
d128-1k,d128-4k,d128-16k,d256-4k,d256-4k-causal,d256-16k,d256-16k-causal,d192-4k,\
d192-4k-causal,d192v128-4k-causal}" \
          --variant base= --variant det=deterministic=1 \
          --out "$OUT/tune_bwd_det_ratio_$gpu.json" > "$OUT/tune_bwd_det_ratio.log" 2>&1 ;;
    compact_tests)
      # D = 96's compact flat accumulator (DqFlatTile.dims: 96 floats a row, not 128): its
      # sweep cases in both dtypes, deterministic, group_heads, lse gradient and packed (104
      # then, 108 now; "lse" spelled out as in bwd_touched, the same 108 here)
      gpu_tests 300 gpu_tests_compact.log tests/test_bwd_sm90.py tests/test_bwd_varlen_sm90.py \
          -k "(sweep and 96-96) or (deterministic and 96) or (group_heads and 96) or \
          ((lse_gradient or only_lse) and 96) or (varlen and 96)" ;;
    compact_ab)
      # the same kernels with and without it (noskip: the whole 128-float tile added and
      # stored, as before the fifty-ninth session)
      timeout 250 python3 scripts/tune_bwd_sm90.py --reps 20 \
          --shapes d96-4k,d96-16k,d96-4k-causal,d96-1k \
          --variant noskip=dq_skip_zero_rows=False --variant compact= \
          --out "$OUT/tune_bwd_compact_$gpu.json" > "$OUT/tune_bwd_compact.log" 2>&1 ;;
    det_sec_tests)
      # the unmasked deterministic order in L2 sections: the test with a partial last
      # section, and the deterministic tests at D = 96 (its 16 MiB sections)
      gpu_tests 240 gpu_tests_det_sections.log tests/test_bwd_sm90.py -k \
          "deterministic_in_l2 or (deterministic and 96)" ;;
    det_tests)
      # the deterministic tests at D <= 128 (the table's order: put a variant in it first)
      gpu_tests 300 gpu_tests_det_free.log tests/test_bwd_sm90.py -k "deterministic and \
          not 192 and not 256" ;;
    preov_tests)
      # pre_overlap in the table and the lse gradient folded into every preprocess: the
      # sweep's bf16 cases at D <= 128 in every mode, the lse-gradient tests (dense and
      # packed), CUDA graphs, torch.compile
      gpu_tests 330 gpu_tests_pre_overlap.log tests/test_bwd_sm90.py \
          tests/test_bwd_varlen_sm90.py -k "(sweep and (64-64-dtype0 or 96-96-dtype0 or \
          128-128-dtype0)) or lse_gradient or only_lse or cuda_graph or torch_compile" ;;
    preov_fp16)
      # the fp16 forms of the persistent preprocess (1,024 threads spilled one at D = 64)
      gpu_tests 240 gpu_tests_pre_overlap_fp16.log tests/test_bwd_sm90.py -k "sweep and \
          (64-64-dtype1 or 128-128-dtype1)" ;;
    preov_rest)
      gpu_tests 300 gpu_tests_pre_overlap_rest.log tests/test_bwd_sm90.py -k "group_heads or \
          deterministic_bitwise_over" ;;
    postov_rest)
      # the post_overlap tests postov_check did not reach before its limit (24: group_heads,
      # lse gradient, deterministic group_heads, torch.compile, CUDA graphs), in a selection
      # of 31 that also has the three group_heads cases it ran and the other deterministic
      # ones ("lse" alone would match every "False" in a test id)
      gpu_tests 300 gpu_tests_post_overlap_rest.log tests/test_bwd_sm90.py -k "group_heads or \
          lse_gradient or only_lse or deterministic_bitwise_over or torch_compile or \
          cuda_graph" ;;
    postov_check)
      # post_overlap in the table: its A/B again at D=128 4k / 16k, then the backward tests
      # it touches most (the sweep's bf16 cases at D <= 128 in every mode, group_heads, lse
      # gradient, CUDA graphs, torch.compile)
      timeout 120 python3 scripts/tune_bwd_sm90.py --reps 40 --shapes d128-16k,d128-4k \
          --variant off=post_overlap=False --variant on=post_overlap=True \
          --out "$OUT/tune_bwd_post_overlap_b_$gpu.json" > "$OUT/tune_bwd_post_overlap_b.log" 2>&1
      gpu_tests 280 gpu_tests_post_overlap.log tests/test_bwd_sm90.py -k "(sweep and \
          (64-64-dtype0 or 96-96-dtype0 or 128-128-dtype0)) or group_heads or lse or \
          cuda_graph or torch_compile" ;;
    order_ab)
      # does an impl's place in the bench's rounds move its time? The D=128 backward rows
      # with cute_attn first / FA4 first (no cuDNN), then each alone
      for o in "cute_attn fa4" "fa4 cute_attn" "cute_attn" "fa4"; do
        tag=$(echo $o | tr ' ' '_')
        timeout 150 python3 -m cute_attn bench --preset bwd --filter d128 --impls $o \
            --reps 20 --no-check --no-plot --out "$OUT/bench_bwd_order_${tag}_$gpu.json" \
            > "$OUT/bench_bwd_order_$tag.log" 2>&1
      done ;;
    cta_cost)
      # a backward CTA's fixed cost (scripts/bwd_cta_cost.py): unmasked D=128 at Sk 4k / 8k
      # over five query lengths each, cute_attn and FA4 round-robin
      timeout 200 python3 scripts/bwd_cta_cost.py --reps 20 \
          --out "$OUT/bwd_cta_cost_$gpu.json" > "$OUT/bwd_cta_cost.log" 2>&1 ;;
    align_ab)
      # BwdTileConfig.end_aligned (query tiles aligned to the sequence's end; the seventy-first
      # session's CPU arithmetic: 2.8% / 1.1% / 0.2% fewer causal tile-steps at D=128 4k / 8k
      # / 16k, 0.4% at D=96 16k) against the table, on the causal rows of the 80- and 96-row
      # tiles; D=128 16k unmasked as a control (the same tile count either way)
      timeout 420 python3 scripts/tune_bwd_sm90.py --reps 30 --variant base= \
          --shapes d128-4k-causal,d128-8k-causal,d128-16k-causal,d96-16k-causal,d128-16k \
          --variant unaligned=end_aligned=False \
          --out "$OUT/tune_bwd_align_$gpu.json" > "$OUT/tune_bwd_align.log" 2>&1 ;;
    align_tests)
      gpu_tests 400 gpu_tests_end_aligned.log tests/test_bwd_sm90.py -k end_aligned ;;
    epi_tests)
      gpu_tests 450 gpu_tests_epilogue_first.log tests/test_bwd_sm90.py \
          -k "epilogue_first or table_end_aligned" ;;
    pers_tests)
      gpu_tests 450 gpu_tests_persistent.log tests/test_bwd_sm90.py -k "bwd_persistent" ;;
    pers_ab)
      # BwdTileConfig.persistent_ctas (bwd_persistent.py; the timeline's CTA starts, ends and
      # gaps: 1.9% of the D=128 16k causal grid, 7.0% of 4k causal's, H100) against the table,
      # with the preprocess beside it (its 16 SMs' CTAs start late and keep their tiles) and
      # before it
      timeout 540 python3 scripts/tune_bwd_sm90.py --fa4 --reps 30 --variant base= \
          --shapes d128-4k-causal,d128-16k-causal,d128-4k,d96-16k-causal,d64-4k \
          --variant p132=persistent_ctas=132,tail_split=False \
          --variant p132pre=persistent_ctas=132,tail_split=False,pre_overlap=False \
          --variant p132c=persistent_ctas=132,tail_split=False,persistent_counter=True \
          --out "$OUT/tune_bwd_persistent_$gpu.json" > "$OUT/tune_bwd_persistent.log" 2>&1 ;;
    pers_short)
      # D=96 4k causal runs the short-rows tile (64 swizzled rows with s_under_dk; 0.984x FA4
      # on the H200 in the seventieth session), which the script takes only as overrides: that
      # tile against its persistent counter walk
      short=tile_m=64,dq_flat=False,s_under_dk=True,dq_skip_zero_rows=False,end_aligned=False
      timeout 200 python3 scripts/tune_bwd_sm90.py --fa4 --reps 30 --shapes d96-4k-causal \
          --variant "short=$short" \
          --variant "short_p132c=$short,persistent_ctas=132,tail_split=False,persistent_counter=True" \
          --out "$OUT/tune_bwd_persistent_short_$gpu.json" > "$OUT/tune_bwd_persistent_short.log" 2>&1 ;;
    pers_quick)
      # the persistent grid's first run: its D=128 GPU cases, then the A/B on three rows
      gpu_tests 250 gpu_tests_persistent.log -vv tests/test_bwd_sm90.py -k "bwd_persistent and dims2"
      timeout 300 python3 scripts/tune_bwd_sm90.py --fa4 --reps 30 --variant base= \
          --shapes d128-4k-causal,d128-16k-causal,d128-4k \
          --variant p132pre=persistent_ctas=132,tail_split=False,pre_overlap=False \
          --variant p132c=persistent_ctas=132,tail_split=False,persistent_counter=True \
          --out "$OUT/tune_bwd_persistent_$gpu.json" > "$OUT/tune_bwd_persistent.log" 2>&1 ;;
    pers_mini)
      # pers_quick on a short budget: the 5-CTA D=128 cases, two causal rows
      gpu_tests 130 gpu_tests_persistent.log -vv tests/test_bwd_sm90.py \
          -k "bwd_persistent and dims2 and 5"
      timeout 170 python3 scripts/tune_bwd_sm90.py --fa4 --reps 20 --variant base= \
          --shapes d128-4k-causal,d128-16k-causal \
          --variant p132c=persistent_ctas=132,tail_split=False,persistent_counter=True \
          --variant p132pre=persistent_ctas=132,tail_split=False,pre_overlap=False \
          --out "$OUT/tune_bwd_persistent_$gpu.json" > "$OUT/tune_bwd_persistent.log" 2>&1 ;;
    epi_ab)
      # BwdTileConfig.epilogue_first (the seventy-second session's timeline, H100: a CTA's end
      # is 1.0% of the D=128 16k causal grid's SM time and 3.6% of 4k causal's; its dK / dV
      # store ran after the dQ writer's last add, 2.6-3.0 us against its 1.7-1.9 us at D=128)
      # against the table, on each head dim's tiles (D=96 4k causal: the short-rows tile)
      timeout 480 python3 scripts/tune_bwd_sm90.py --fa4 --reps 30 --variant base= \
          --shapes d128-4k-causal,d128-16k-causal,d96-4k-causal,d128-4k,d128-16k,d64-4k,d256-4k-causal \
          --variant epi=epilogue_first=True \
          --out "$OUT/tune_bwd_epi_$gpu.json" > "$OUT/tune_bwd_epi.log" 2>&1 ;;
    timeline)
      # where the backward's SM time goes, CTA by CTA (scripts/bwd_timeline.py): the D=128
      # 16k rows (tail_split off in both kernels there), 4k causal, D=96 4k causal (the table's
      # 96 rows; its short-rows tile in the second run)
      timeout 240 python3 scripts/bwd_timeline.py --reps 10 \
          --shapes d128-16k,d128-16k-causal,d128-4k-causal,d128-4k,d96-4k-causal \
          --out "$OUT/bwd_timeline_$gpu.json" > "$OUT/bwd_timeline.log" 2>&1
      timeout 120 python3 scripts/bwd_timeline.py --reps 10 --shapes d96-4k-causal,d128-2k-causal \
          --variant tile_m=64,dq_flat=False,s_under_dk=True,dq_skip_zero_rows=False,end_aligned=False \
          --out "$OUT/bwd_timeline_short_$gpu.json" > "$OUT/bwd_timeline_short.log" 2>&1 ;;
    sdk_rows)
      # the swizzled staging takes neither the flat tiles' zero-row skip (D=96) nor end_aligned
      no_flat=dq_skip_zero_rows=False,end_aligned=False
      # m64f_sdk: the 64 rows with the flat dQ staging (never timed past 1k causal; builds
      # spill-free for sm_90a at D=128 causal, seventy-first session)
      timeout 420 python3 scripts/tune_bwd_sm90.py --fa4 --reps 30 \
          --shapes d128-4k-causal,d128-16k-causal,d96-4k-causal,d96-16k-causal,d96-4k \
          --variant base= --variant m64=tile_m=64,dq_flat=False,$no_flat \
          --variant m64_sdk=tile_m=64,dq_flat=False,s_under_dk=True,$no_flat \
          --variant m64f_sdk=tile_m=64,s_under_dk=True \
          --variant m80_sdk=tile_m=80,s_under_dk=True \
          --out "$OUT/tune_bwd_sdk_rows_$gpu.json" > "$OUT/tune_bwd_sdk_rows.log" 2>&1 ;;
    bwd_l2)
      timeout 300 python3 scripts/tune_bwd_sm90.py --reps 30 \
          --shapes d96-4k-causal,d96-16k-causal,d128-4k-causal,d128-16k-causal \
          --variant base= --variant l2off=l2_section_bytes=0 \
          --variant l2x2=l2_section_bytes=67108864 --variant l2half=l2_section_bytes=16777216 \
          --variant m80=tile_m=80 \
          --out "$OUT/tune_bwd_l2_causal_$gpu.json" > "$OUT/tune_bwd_l2_causal.log" 2>&1 ;;
    bwd_touched)
      # the backward tests s_under_dk, tail_split and the short-rows bucket touch: the sweep's
      # unmasked cases and its causal ones at D <= 128, short rows, group_heads, lse gradient,
      # CUDA graphs, torch.compile (pytest's -k ignores case: a bare "lse" took every id with
      # a False in it too, 267 tests for the 179 meant, and the sixty-seventh session's call
      # ran past the step's limit)
      ids=$( (python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider \
          tests/test_bwd_sm90.py -k "short_rows or group_heads or lse_gradient or only_lse or \
          cuda_graph or torch_compile or s_under_dk or (sweep and full)" 2>/dev/null | grep "::"
        python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider tests/test_bwd_sm90.py \
          -k "sweep and causal" 2>/dev/null | grep "::" | awk -F'-' '$4 <= 128') )
      # shellcheck disable=SC2086  # one test id a word
      [ -n "$ids" ] && gpu_tests 560 gpu_tests_bwd_touched.log -vv $ids ;;
    softcap96)
      # D=96 under softcap on its own columns (fifty-fifth session): its backward tests but
      # the causal sweep cases (20, passed before the table took it): the varlen sweep's
      # softcap cases and group_heads (softcap at D=96 among them)
      gpu_tests 400 gpu_tests_softcap96.log tests/test_bwd_sm90.py \
          tests/test_bwd_varlen_sm90.py -k "(softcap and 96) or group_heads" ;;
    dyn_tests)
      # torch.compile(dynamic=True) on the GPU: a training step over three sequence lengths and
      # a KV-cache decode step over three batch sizes, with the other torch.compile tests
      gpu_tests 300 gpu_tests_compile_dynamic.log tests/test_bwd_sm90.py \
          tests/test_inference_sm90.py -k "torch_compile" ;;
    bwd_rest) gpu_tests 380 gpu_tests_bwd_rest.log tests/test_bwd_sm90.py -k "not sweep" ;;
    bwd_tail)
      gpu_tests 380 gpu_tests_bwd_tail.log tests/test_bwd_sm90.py \
          -k "deterministic or unserved or noncontiguous or torch_compile or cuda_graph_replay" ;;
    fwd_rest)
      sweep_cases 560 gpu_tests_fwd_rest.log tests/test_fwd_sm90.py "${FWD_REST_FROM:-77}" \
          '$' "not sweep" ;;
    fwd_sweep)
      sweep_cases 560 gpu_tests_fwd_sweep.log tests/test_fwd_sm90.py "${SWEEP_FROM:-1}" \
          "${SWEEP_TO:-\$}" ;;
    bwd_sweep)
      sweep_cases 560 gpu_tests_bwd_sweep.log tests/test_bwd_sm90.py "${BWD_SWEEP_FROM:-1}" \
          "${BWD_SWEEP_TO:-\$}" ;;
    pack_ab)
      read -r -a rows <<< "${PACK_AB_ROWS:-b64-8k-q4 b8-8k-q4 b1-32k-q4 g7-b8-8k-q4 \
          g5-b8-8k-q4 varlen-b64-8k-q1 g7-varlen-b64-2k-q4}"
      timeout 240 python3 scripts/pack_gqa_ab.py --rounds 20 --wide --rows "${rows[@]}" \
          --out "$OUT/pack_gqa_ab_wide_$gpu.json" > "$OUT/pack_gqa_ab_wide.log" 2>&1 ;;
    wide_varlen)
      timeout 240 python3 scripts/pack_gqa_ab.py --rounds 20 --wide --rows varlen-b64-8k-q1 \
          varlen-used-b64-8k-q1 varlen-paged16-b64-8k-q1 varlen-paged64-b64-8k-q1 \
          --out "$OUT/pack_gqa_ab_wide_varlen_$gpu.json" > "$OUT/pack_gqa_ab_wide_varlen.log" 2>&1 ;;
    tail_ab)
      timeout 90 python3 scripts/kvcache_tail_ab.py --out "$OUT/kvcache_tail_ab_$gpu.json" \
          > "$OUT/kvcache_tail_ab.log" 2>&1 ;;
    inference) gpu_tests 450 gpu_tests_inference.log tests/test_inference_sm90.py ;;
    spec_bench)
      timeout 200 python3 -m cute_attn bench --preset spec-decode --graph --impls cute_attn fa4 \
          sdpa-cudnn --reps 50 --out "$OUT/bench_spec_decode_graph_$gpu.json" \
          > "$OUT/bench_spec_decode_graph.log" 2>&1 ;;
    decode_bench)
      timeout 200 python3 -m cute_attn bench --preset decode --graph --impls cute_attn fa4 \
          sdpa-cudnn --reps 50 --out "$OUT/bench_decode_graph_$gpu.json" \
          > "$OUT/bench_decode_graph.log" 2>&1 ;;
    fwd_bench)
      timeout 420 python3 -m cute_attn bench --preset fwd-prefill --impls cute_attn fa4 \
          sdpa-cudnn --reps 30 --out "$OUT/bench_fwd_prefill_$gpu.json" \
          > "$OUT/bench_fwd_prefill.log" 2>&1 ;;
    bwd_bench)
      timeout 420 python3 -m cute_attn bench --preset bwd --impls cute_attn fa4 sdpa-cudnn \
          --reps 20 --out "$OUT/bench_bwd_$gpu.json" > "$OUT/bench_bwd.log" 2>&1 ;;
    bwd192_bench)
      timeout 400 python3 -m cute_attn bench --preset full --filter bwd d192 --impls cute_attn \
          fa4 sdpa-cudnn --reps 20 --out "$OUT/bench_bwd_d192_$gpu.json" \
          > "$OUT/bench_bwd_d192.log" 2>&1 ;;
    host)
      timeout 120 python3 scripts/host_overhead.py --tiny-only \
          --out "$OUT/host_overhead_tiny_$gpu.json" > "$OUT/host_overhead_tiny.log" 2>&1
      timeout 240 python3 scripts/compile_time.py --dims 128 256 \
          --out "$OUT/compile_time_$gpu.json" > "$OUT/compile_time.log" 2>&1 ;;
    host_varlen)
      timeout 150 python3 scripts/host_overhead.py --varlen-only \
          --out "$OUT/host_overhead_varlen_$gpu.json" > "$OUT/host_overhead_varlen.log" 2>&1 ;;
    *) echo "unknown step: $step"; exit 2 ;;
  esac
  rcs[$step]=$?
done
head -3 "$OUT/info.txt"
for step in "${steps[@]}"; do
  echo "== $step rc=${rcs[$step]}"
  case "$step" in
    pack_tests) tail -15 "$OUT/gpu_tests_pack_gqa.log" ;;
    new_tests) tail -8 "$OUT/gpu_tests_wide_memo.log" ;;
    fwd_sweep) tail -8 "$OUT/gpu_tests_fwd_sweep.log" ;;
    bwd_sweep) tail -8 "$OUT/gpu_tests_bwd_sweep.log" ;;
    fwd_rest) tail -8 "$OUT/gpu_tests_fwd_rest.log" ;;
    bwd_rest) tail -8 "$OUT/gpu_tests_bwd_rest.log" ;;
    bwd_touched) tail -8 "$OUT/gpu_tests_bwd_touched.log" ;;
    softcap96) tail -8 "$OUT/gpu_tests_softcap96.log" ;;
    bwd_tail) tail -8 "$OUT/gpu_tests_bwd_tail.log" ;;
    sdk_rows) tail -32 "$OUT/tune_bwd_sdk_rows.log" ;;
    cta_cost) tail -26 "$OUT/bwd_cta_cost.log" ;;
    align_ab) tail -14 "$OUT/tune_bwd_align.log" ;;
    align_tests) tail -6 "$OUT/gpu_tests_end_aligned.log" ;;
    epi_tests) tail -6 "$OUT/gpu_tests_epilogue_first.log" ;;
    pers_tests) tail -6 "$OUT/gpu_tests_persistent.log" ;;
    pers_quick|pers_mini) tail -6 "$OUT/gpu_tests_persistent.log"; tail -16 "$OUT/tune_bwd_persistent.log" ;;
    pers_ab) tail -27 "$OUT/tune_bwd_persistent.log" ;;
    pers_short) tail -5 "$OUT/tune_bwd_persistent_short.log" ;;
    epi_ab) tail -23 "$OUT/tune_bwd_epi.log" ;;
    timeline) tail -14 "$OUT/bwd_timeline.log"; tail -8 "$OUT/bwd_timeline_short.log" ;;
    v128_ab) tail -12 "$OUT/tune_bwd_v128.log" ;;
    smask_ab) tail -14 "$OUT/tune_bwd_smask.log" ;;
    sdk_ab) tail -26 "$OUT/tune_bwd_sdk.log"; tail -6 "$OUT/tune_bwd_sdk_det.log" ;;
    bwd_l2) tail -22 "$OUT/tune_bwd_l2_causal.log" ;;
    bwd_m64) tail -12 "$OUT/tune_bwd_m64.log" ;;
    pack_ab) tail -30 "$OUT/pack_gqa_ab_wide.log" ;;
    wide_varlen) tail -30 "$OUT/pack_gqa_ab_wide_varlen.log" ;;
    tail_ab) tail -20 "$OUT/kvcache_tail_ab.log" ;;
    inference) tail -15 "$OUT/gpu_tests_inference.log" ;;
    spec_bench) tail -22 "$OUT/bench_spec_decode_graph.log" ;;
    decode_bench) tail -22 "$OUT/bench_decode_graph.log" ;;
    fwd_bench) grep -E "cute_attn|^row" "$OUT/bench_fwd_prefill.log" | tail -20 ;;
    bwd_bench) grep -E "cute_attn|^row" "$OUT/bench_bwd.log" | tail -20 ;;
    bwd192_bench) grep -E "^bwd" "$OUT/bench_bwd_d192.log" | tail -36 ;;
    postov_rest) tail -6 "$OUT/gpu_tests_post_overlap_rest.log" ;;
    preov_ab) tail -30 "$OUT/tune_bwd_pre_overlap.log" ;;
    preov_ab2) tail -17 "$OUT/tune_bwd_pre_overlap_b.log" ;;
    preov_ab3) tail -20 "$OUT/tune_bwd_pre_overlap_c.log" ;;
    det_ov) tail -17 "$OUT/tune_bwd_det_overlap.log"; tail -4 "$OUT/gpu_tests_det_overlap.log" ;;
    preov_896) tail -10 "$OUT/tune_bwd_pre_overlap_896.log" ;;
    det_free) tail -26 "$OUT/tune_bwd_det_free.log" ;;
    det_tests) tail -4 "$OUT/gpu_tests_det_free.log" ;;
    det_sec_tests) tail -4 "$OUT/gpu_tests_det_sections.log" ;;
    skip_ab) tail -30 "$OUT/tune_bwd_skip_zero.log" ;;
    det_big) tail -12 "$OUT/tune_bwd_det_big.log" ;;
    compact_tests) tail -4 "$OUT/gpu_tests_compact.log" ;;
    det_big_tests) tail -4 "$OUT/gpu_tests_det_big.log" ;;
    compact_ab) tail -12 "$OUT/tune_bwd_compact.log" ;;
    w2_ab) tail -32 "$OUT/tune_bwd_dq_writers.log" ;;
    w2_tests) tail -4 "$OUT/gpu_tests_dq_writers.log" ;;
    det_w2_tests) tail -4 "$OUT/gpu_tests_det_w2.log" ;;
    w3_ab|w3_quick) tail -26 "$OUT/tune_bwd_dq_writers3.log" ;;
    w_tests) tail -4 "$OUT/gpu_tests_dq_writers.log" ;;
    pe_ab) tail -28 "$OUT/tune_bwd_poll_early.log" ;;
    pe_tests) tail -4 "$OUT/gpu_tests_poll_early.log" ;;
    split_ab) tail -40 "$OUT/tune_bwd_tail_split.log" ;;
    split_tests) tail -6 "$OUT/gpu_tests_tail_split.log" ;;
    dq2_ab) tail -18 "$OUT/tune_bwd_d256_dq2.log" ;;
    pe_quick) tail -18 "$OUT/tune_bwd_poll_early_quick.log" ;;
    balance_ab) tail -26 "$OUT/tune_bwd_balance_causal.log"
      tail -18 "$OUT/tune_bwd_balance_split.log" ;;
    balance_tests) tail -6 "$OUT/gpu_tests_balance.log" ;;
    det_wide_ov) grep -A10 "^shape" "$OUT/tune_bwd_det_wide_ov.log" ;;
    table66_tests) tail -6 "$OUT/gpu_tests_table66.log" ;;
    det_ratio) tail -32 "$OUT/tune_bwd_det_ratio.log" ;;
    skip_tests) tail -6 "$OUT/gpu_tests_skip_zero.log" ;;
    preov_tests) tail -8 "$OUT/gpu_tests_pre_overlap.log" ;;
    preov_rest) tail -8 "$OUT/gpu_tests_pre_overlap_rest.log" ;;
    preov_fp16) tail -6 "$OUT/gpu_tests_pre_overlap_fp16.log" ;;
    postov_check) grep -A6 "^shape" "$OUT/tune_bwd_post_overlap_b.log"
      tail -6 "$OUT/gpu_tests_post_overlap.log" ;;
    postov_ab) for f in tune_bwd_post_overlap tune_bwd_post_overlap_short; do
        grep -A16 "^shape" "$OUT/$f.log"; grep -i error "$OUT/$f.log" | cut -c1-300; done ;;
    order_ab) for f in "$OUT"/bench_bwd_order_*.log; do echo "== $f"; grep -E "^bwd" "$f"; done ;;
    host_varlen) tail -8 "$OUT/host_overhead_varlen.log" ;;
    host) tail -12 "$OUT/host_overhead_tiny.log"; tail -12 "$OUT/compile_time.log" ;;
  esac
done
