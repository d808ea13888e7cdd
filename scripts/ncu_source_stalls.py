"""Warp-stall samples per kernel and per SASS instruction from an Nsight Compute source page.

Reads the CSV (optionally gzipped) that

    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > sass.csv

writes for every profiled kernel, and prints, for the kernels picked by their index in the file
(0 = the first kernel profiled): the total of each stall reason, and the instructions with the
most samples (all reasons, or one reason grouped by opcode). CPU only.

    python3 scripts/ncu_source_stalls.py docs/perf/ncu_bwd_d64_4k_h200_sass.csv.gz --kernels 1,4
    python3 scripts/ncu_source_stalls.py sass.csv.gz --kernels 1,4 --reason short_sb --top 8
    python3 scripts/ncu_source_stalls.py sass.csv.gz --kernels 0,1 --regions

--regions compares kernels by region instead: before the first HGMMA, between the first and
the last (the main loop, in address order), after the last; in each, the samples and executed
warp instructions of code run at most once a warp ("once": executed no more often than the
kernel's first instruction) and of the rest, then per opcode after the last HGMMA. Sampling
noise: a count of n samples varies by about sqrt(n).

Stalls that ncu does not break out in its source columns (a warpgroup MMA waiting for the
tensor cores) count in an instruction's all-samples total but in no reason column.
"""

import argparse
import collections
import csv
import gzip


def read_kernels(path: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(kernel name, header, rows) for each kernel block of the source-page CSV."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = f.read().splitlines()
    kernels, i = [], 0
    while i < len(lines):
        if not lines[i].startswith('"Kernel Name"'):
            i += 1
            continue
        name = next(csv.reader([lines[i]]))[1]
        header = next(csv.reader([lines[i + 1]]))
        j, rows = i + 2, []
        while j < len(lines) and not lines[j].startswith('"Kernel Name"'):
            rows.append(next(csv.reader([lines[j]])))
            j += 1
        kernels.append((name, header, rows))
        i = j
    return kernels


def _opcode(source: str) -> str:
    words = source.split()
    op = words[1] if words[0].startswith("@") else words[0]
    return op.split(".")[0]


def _int(x: str) -> int:
    try:
        return int(x)
    except ValueError:
        return 0


def regions(kernels: list, picks: list[int]) -> None:
    """Samples and executed warp instructions per region (pre / loop / post around the first
    and last HGMMA) and kind (once / many), and per opcode after the last HGMMA."""
    post_ops = []
    for k in picks:
        name, header, rows = kernels[k]
        col = {h: n for n, h in enumerate(header)}
        samples, executed = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]
        src = [r[col["Source"]].strip() for r in rows]
        mma = [i for i, s in enumerate(src) if "HGMMA" in s]
        once = _int(rows[0][executed])  # every warp runs the kernel's first instruction once
        cells, ops = collections.Counter(), collections.Counter()
        for i, r in enumerate(rows):
            region = "pre" if i < mma[0] else "post" if i > mma[-1] else "loop"
            kind = "once" if _int(r[executed]) <= once else "many"
            cells[region, kind, "samples"] += _int(r[samples])
            cells[region, kind, "executed"] += _int(r[executed])
            if region == "post" and src[i]:
                ops[_opcode(src[i]), "samples"] += _int(r[samples])
                ops[_opcode(src[i]), "executed"] += _int(r[executed])
        total = sum(_int(r[samples]) for r in rows)
        print(f"== [{k}] {name[:100]}: {total} samples")
        for region in ("pre", "loop", "post"):
            parts = [
                f"{kind} {cells[region, kind, 'samples']:6d} samples "
                f"{cells[region, kind, 'executed']:11d} executed"
                for kind in ("once", "many")
            ]
            print(f"   {region:<4} " + " | ".join(parts))
        post_ops.append(ops)
    names = sorted(
        {op for ops in post_ops for op, _ in ops},
        key=lambda op: -sum(ops[op, "samples"] for ops in post_ops),
    )
    print("   after the last HGMMA, per opcode (samples / executed, kernel by kernel):")
    for op in names[:24]:
        cells = "  ".join(f"{ops[op, 'samples']:6d} / {ops[op, 'executed']:9d}" for ops in post_ops)
        print(f"   {op:<16} {cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--kernels", default="", help="comma-separated indices (default: all)")
    ap.add_argument("--top", type=int, default=20, help="instructions listed per kernel")
    ap.add_argument("--reason", default="", help="one stall reason, e.g. short_sb, mio, wait")
    ap.add_argument("--regions", action="store_true", help="pre / loop / post breakdown")
    args = ap.parse_args()
    kernels = read_kernels(args.csv)
    picks = [int(k) for k in args.kernels.split(",")] if args.kernels else range(len(kernels))
    if args.regions:
        regions(kernels, list(picks))
        return
    for k in picks:
        name, header, rows = kernels[k]
        col = {h: n for n, h in enumerate(header)}
        reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        total = col["Warp Stall Sampling (All Samples)"]
        per_reason = collections.Counter()
        for r in rows:
            for h in reasons:
                per_reason[h[6:]] += int(r[col[h]] or 0)
        print(f"== [{k}] {name[:100]}")
        print(f"   {len(rows)} instructions, {sum(int(r[total] or 0) for r in rows)} samples")
        print("   " + ", ".join(f"{h}={v}" for h, v in per_reason.most_common(12)))
        key = col["stall_" + args.reason] if args.reason else total
        if args.reason:
            by_op = collections.Counter()
            for r in rows:
                by_op[_opcode(r[col["Source"]].strip())] += int(r[key] or 0)
            print(f"   {args.reason} by opcode: {by_op.most_common(8)}")
        for r in sorted(rows, key=lambda r: -int(r[key] or 0))[: args.top]:
            top3 = sorted(((h[6:], int(r[col[h]] or 0)) for h in reasons), key=lambda x: -x[1])
            why = ", ".join(f"{h}={v}" for h, v in top3[:3] if v)
            src = r[col["Source"]].strip()[:60]
            print(f"   {r[col['Address']][-5:]} {src:<60} {r[key]:>6}  {why}")


if __name__ == "__main__":
    main()
