#!/usr/bin/env python3
"""Where the CUDA batch-1 Q4_K GEMV's warps wait, instruction by instruction, under Nsight Compute.

    python kernels/tools/ncu_q4k_gemv.py [--out DIR] [--shape 14336x4096]

Runs `ncu` (full section set, real clocks, caches flushed before each replay, so the weight
comes from HBM) on one launch of the kernel, then writes `gemv.ncu-rep`, the details page as
`details.csv`, the SASS with per-instruction warp-stall samples as `sass.csv`, and prints the
headline figures and the 30 instructions with the most stall samples. `--run` is the child
that ncu profiles: it only builds inputs and calls the kernel.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEADLINES = (
    "Duration",
    "SM Frequency",
    "Executed Instructions",
    "DRAM Throughput",
    "Memory Throughput",
    "Issue Slots Busy",
    "Issued Warp Per Scheduler",
    "Achieved Active Warps Per SM",
    "Registers Per Thread",
    "No Eligible",
)


def run_kernel(n: int, k: int, calls: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from sweep_q4k import load

    task = load(REPO / "kernels/q4k_gemv/task.py", "ncu_task")
    cand = load(REPO / "kernels/q4k_gemv/q4k_gemv.py", "ncu_cand")
    x, w = task.get_inputs(batch=1, n=n, k=k)
    x, w = x.cuda(), w.cuda()
    for _ in range(calls):
        cand.q4k_gemv(x, w)
    torch.cuda.synchronize()


def headlines(details_csv: str) -> list[str]:
    """'name: value unit' for the HEADLINES metrics of ncu's details page (CSV)."""
    table = list(csv.reader(io.StringIO(details_csv)))
    if not table or "Metric Name" not in table[0]:
        return ["(no details table)"]
    # columns move between ncu versions: go by name
    name, unit, value = (table[0].index(c) for c in ("Metric Name", "Metric Unit", "Metric Value"))
    return [f"{row[name]}: {row[value]} {row[unit]}".rstrip() for row in table[1:]
            if len(row) > value and any(h in row[name] for h in HEADLINES)]


def top_stalls(sass_csv: str, count: int = 30) -> list[str]:
    lines = sass_csv.splitlines()  # a "Kernel Name" line comes before the header
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), 0)
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    if not rows:
        return ["(no SASS rows)"]
    columns = list(rows[0])
    sampled = next((c for c in columns if c and "Warp Stall Sampling (All" in c), None)
    reasons = [c for c in columns if c and c.startswith("stall_") and "Not Issued" not in c]
    source = next((c for c in columns if c and c.lower() == "source"), columns[-1])
    if sampled is None:
        return ["(no stall-sampling column; columns: " + ", ".join(columns[:30]) + ")"]

    def number(row: dict, column: str) -> float:  # empty or non-numeric cells count as 0
        try:
            return float(row[column] or 0)
        except ValueError:
            return 0.0

    total = sum(number(r, sampled) for r in rows) or 1.0
    ranked = sorted(rows, key=lambda r: number(r, sampled), reverse=True)[:count]
    by_reason = sorted(((sum(number(r, c) for r in rows), c) for c in reasons), reverse=True)[:8]
    out = [f"{sampled}: {total:.0f} samples; by reason: "
           + ", ".join(f"{c[6:]} {100 * v / total:.1f} %" for v, c in by_reason)]
    for r in ranked:
        why = max(reasons, key=lambda c: number(r, c)) if reasons else ""
        share = 100 * number(r, sampled) / total
        out.append(f"{share:5.1f} %  {r.get('Address', '')[-5:]}  {r[source][:70]:70s} {why[6:]}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--shape", default="14336x4096", help="rows x K of the weight")
    parser.add_argument("--run", action="store_true", help="(the child ncu profiles)")
    args = parser.parse_args()
    n, k = (int(v) for v in args.shape.lower().split("x"))
    if args.run:
        run_kernel(n, k, calls=4)
        return 0
    ncu = shutil.which("ncu")
    if ncu is None:
        print("ncu not found", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    report = args.out / "gemv.ncu-rep"
    profile = subprocess.run(
        [ncu, "--set", "full", "--import-source", "no", "--clock-control", "none", "--warp-sampling-interval", "0",
         "--kernel-name", "regex:q4k_gemv_b1", "--launch-skip", "2", "--launch-count", "1",
         "-f", "-o", str(report.with_suffix("")),
         sys.executable, __file__, "--run", "--shape", args.shape],
        capture_output=True, text=True, timeout=400,
    )
    if profile.returncode != 0 or not report.exists():
        print(profile.stdout[-3000:], profile.stderr[-3000:], file=sys.stderr)
        return 1
    details = subprocess.run([ncu, "-i", str(report), "--page", "details", "--csv"],
                             capture_output=True, text=True, timeout=120).stdout
    (args.out / "details.csv").write_text(details)
    print("\n".join(headlines(details)))
    sass = subprocess.run([ncu, "-i", str(report), "--page", "source", "--csv", "--print-source", "sass"],
                          capture_output=True, text=True, timeout=120)
    (args.out / "sass.csv").write_text(sass.stdout)
    if sass.returncode != 0:
        print(sass.stderr[-2000:], file=sys.stderr)
    print("\n".join(top_stalls(sass.stdout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
