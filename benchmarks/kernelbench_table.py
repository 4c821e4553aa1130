#!/usr/bin/env python3
"""The judge on KernelBench: every problem of the given levels, unchanged, checked with two
candidates each, written as JSON and as a Markdown table.

    python benchmarks/kernelbench_table.py KERNELBENCH [--levels 1,2] [--problems 12,40]
        [--candidates copy,compile] [--set batch_size=2] [--timeout 300]
        [--out kernelbench.json] [--markdown docs/kernelbench.md] [--home DIR]
        [--merge EARLIER.json ...] [--stop-after SECONDS]

KERNELBENCH is a checkout of ScalingIntelligence/KernelBench (holding KernelBench/level1, ...)
or its bare git directory (the problems are extracted to a temporary directory).

Candidates, in KernelBench's format (a file defining `class ModelNew`):
- copy: the problem's source with the class renamed Model -> ModelNew. An honest candidate as
  accurate as PyTorch: it must pass validation and never be accepted (it is no faster).
- compile: the problem's Model renamed, and a ModelNew that runs its forward through
  torch.compile. It should pass validation; it is accepted only where its speedup's CI clears
  the gate.

Each check is what submit_candidate runs: run_validation (policy seeds, every shape), benchmark
when it passed, the gate's decision, under a per-problem timeout. The server's warm workers stay
up across problems, as in a campaign. A failure or timeout is recorded and the run goes on;
both files are rewritten after every check. `--set name=value` overrides a module-level name of
every problem (task_globals), e.g. batch_size=2 to make level 1/2 problems fit a CPU.

The whole table takes longer than one sitting on a lent GPU: `--merge` takes the rows of
earlier runs (each row keeps when and where it was measured), checks only what they lack, and
writes the union; `--stop-after` starts no new check after that many seconds, so a run under a
time limit ends with its files written.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tokenize
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

COMPILED_MODEL = '''

class ModelNew(EagerModel):
    """The problem's Model, its forward compiled by torch.compile (inductor, default mode)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compiled_forward = torch.compile(super().forward)

    def forward(self, *args):
        return self.compiled_forward(*args)
'''


def rename(source: str, old: str, new: str) -> str:
    """Every NAME token `old` -> `new` (the class, super(Model, self), ...); strings untouched."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return tokenize.untokenize(
        (t.type, new if t.type == tokenize.NAME and t.string == old else t.string, t.start, t.end, t.line)
        for t in tokens)


def candidate_source(problem: str, kind: str) -> str:
    if kind == "copy":
        return rename(problem, "Model", "ModelNew")
    if kind == "compile":
        body = rename(problem, "Model", "EagerModel")
        if not re.search(r"^import torch\s*$", body, re.M):
            body = "import torch\n" + body
        return body + COMPILED_MODEL
    raise ValueError(f"unknown candidate kind {kind!r}")


def problem_files(kernelbench: Path, levels: list[int], scratch: Path) -> dict[int, Path]:
    """level -> directory of its problem files: the checkout's own, or extracted from a git dir."""
    found: dict[int, Path] = {}
    for level in levels:
        own = kernelbench / "KernelBench" / f"level{level}"
        if own.is_dir():
            found[level] = own
            continue
        git = ["git", "-C", str(kernelbench)]
        names = subprocess.run([*git, "ls-tree", "-r", "--name-only", "HEAD", f"KernelBench/level{level}"],
                               check=True, capture_output=True, text=True).stdout.split()
        if not names:
            raise SystemExit(f"{kernelbench} has no KernelBench/level{level}")
        target = scratch / f"level{level}"
        target.mkdir(parents=True, exist_ok=True)
        for name in names:
            data = subprocess.run([*git, "show", f"HEAD:{name}"], check=True, capture_output=True).stdout
            (target / Path(name).name).write_bytes(data)
        found[level] = target
    return found


def problem_id(path: Path) -> int | None:
    match = re.match(r"(\d+)_", path.name)
    return int(match.group(1)) if match else None


def worst_case(validation: dict) -> dict[str, Any]:
    """The reported case with the largest error next to the reference's own, for the table."""
    cases = [c for c in (validation.get("failing_cases") or []) + [validation.get("worst_case")] if c]
    if not cases:
        return {}
    case = cases[0]
    return {k: case.get(k) for k in ("max_abs_err", "ref_max_abs_err", "norm_rel_err",
                                     "ref_norm_rel_err", "message")}


async def check_one(services, task: Path, candidate: Path, task_globals: dict, timeout_s: float
                    ) -> dict[str, Any]:
    import anyio

    from loom_mcp import judge
    from loom_mcp.gate import decide
    from loom_mcp.judge_models import CompileEvidence

    config, row = services.config, {}
    started = time.monotonic()
    try:
        with anyio.fail_after(timeout_s):
            call = judge.JudgeCall(task=str(task), candidate=str(candidate), task_globals=task_globals)
            validation, evidence, _ = await judge.run_validation(
                config, services.ledger, services.artifacts, call)
            row["validation_s"] = round(time.monotonic() - started, 2)
            row["validated"] = validation.passed
            row["validation_findings"] = sorted({f.check for f in validation.findings
                                                 if f.severity == "error"})
            row.update(worst_case(validation.model_dump()))
            bench_evidence = None
            if validation.passed:
                _, bench_evidence, _, _ = await judge.run_benchmark(
                    config, services.ledger, services.artifacts, call)
            verdict = decide(CompileEvidence(ok=True), evidence, bench_evidence, config.gate)
        # The sentences too: a code alone does not say which check fired.
        row.update(verdict=verdict.verdict, reason_codes=list(verdict.reason_codes),
                   reasons=[r[:400] for r in verdict.reasons], speedup=verdict.speedup, ci_low=verdict.speedup_ci_low,
                   ci_high=verdict.speedup_ci_high)
    except TimeoutError:
        row.update(verdict="timeout", reason_codes=[], error=f"no result within {timeout_s:g} s")
    except Exception as exc:  # a problem the judge cannot run is a row, not the end of the table
        row.update(verdict="error", reason_codes=[], error=f"{type(exc).__name__}: {exc}"[:500])
    row["check_s"] = round(time.monotonic() - started, 2)
    return row


def fmt_speedup(row: dict) -> str:
    if row.get("speedup") is None:
        return ""
    return f"{row['speedup']:.2f} [{row['ci_low']:.2f}, {row['ci_high']:.2f}]"


def fmt_cell(row: dict | None) -> list[str]:
    if not row:
        return ["", "", "", ""]
    if row.get("validated") is None:
        valid = row["verdict"]
    else:
        valid = "pass" if row["validated"] else "FAIL " + ",".join(
            c.removeprefix("validation.") for c in row.get("validation_findings") or [])
        if row.get("max_abs_err") is not None and row.get("ref_max_abs_err") is not None:
            valid += f" ({row['max_abs_err']:.1e} / {row['ref_max_abs_err']:.1e})"
    verdict = row["verdict"] + ("" if not row.get("reason_codes") else
                                " (" + ", ".join(row["reason_codes"]) + ")")
    return [valid.strip(), verdict, fmt_speedup(row), f"{row['check_s']:.1f}"]


def summary_lines(rows: list[dict], kinds: list[str]) -> list[str]:
    lines = []
    for level in sorted({r["level"] for r in rows}):
        for kind in kinds:
            done = [r[kind] for r in rows if r["level"] == level and r.get(kind)]
            if not done:
                continue
            passed = sum(1 for r in done if r.get("validated"))
            accepted = sum(1 for r in done if r["verdict"] == "accept")
            lines.append(f"| {level} | {kind} | {len(done)} | {passed} ({100 * passed / len(done):.0f} %) "
                         f"| {accepted} | {statistics.median(r['check_s'] for r in done):.1f} |")
    return lines


def problem_ids(spec: str) -> set[int]:
    """"1,4,19-53" -> {1, 4, 19, ..., 53}."""
    ids: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        low, _, high = part.partition("-")
        ids |= set(range(int(low), int(high or low) + 1))
    return ids


def merge_rows(paths: list[str]) -> dict[str, Any]:
    """The rows of earlier runs by (level, id), a later file's checks over an earlier's, and
    the runs they came from."""
    rows: dict[tuple[int, int], dict] = {}
    runs: list[dict] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        runs.extend(data.get("runs") or [{k: data.get(k) for k in ("date", "device", "software", "command")}])
        for row in data["problems"]:
            for kind in ("copy", "compile"):
                if row.get(kind) and "measured" not in row[kind]:
                    row[kind]["measured"] = f"{data.get('date')}, {data.get('device')}"
            key = (row["level"], row["id"])
            rows[key] = {**rows.get(key, {}), **{k: v for k, v in row.items() if v}}
    return {"rows": rows, "runs": runs}


def write_outputs(meta: dict, rows: list[dict], out: Path, markdown: Path | None, kinds: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "problems": rows}, indent=1) + "\n")
    if markdown is None:
        return
    head = [
        "# The judge on KernelBench",
        "",
        f"Produced by `benchmarks/kernelbench_table.py` ({meta['kernelbench']}, levels "
        f"{meta['levels']}{', problems ' + meta['problems'] if meta.get('problems') else ''}) in "
        + "; ".join(f"{r['date']} on {r['device']} ({r['software']})" for r in meta.get("runs") or [meta])
        + ". Each row's checks are from one of these runs.",
        f"Task overrides (task_globals): {json.dumps(meta['task_globals']) if meta['task_globals'] else 'none: the problems as published'}"
        " (each problem gets the names it assigns). "
        f"Timeout per check: {meta['timeout_s']:g} s.",
        "",
        "Candidates: `copy` is the problem's source with Model renamed ModelNew (must pass, must "
        "never be accepted); `compile` runs the Model's forward through `torch.compile` "
        "(accepted only when its speedup's CI clears the gate).",
        "A check is what submit_candidate does: run_validation (policy seeds, every shape), benchmark "
        "when it passed, the gate's decision. Speedup is the geomean baseline/candidate "
        "[95 % CI]; seconds are the whole check's wall time.",
        "",
        "Validation judges the candidate's error against the error the task's Model itself makes in "
        "its dtype on this device (both against a float64 run): 4x the reference's own largest "
        "elementwise and normwise errors are always allowed, and the task's atol/rtol (KernelBench's "
        "1e-4 for fp32) scaled to the output's size below that. `validation` names the failing "
        "checks, or gives the worst case's max abs error / the reference's own on that case.",
        "",
        f"Reproduce: `{meta.get('command', 'python benchmarks/kernelbench_table.py ...')}`",
        "",
        "| level | candidate | problems | validation passed | accepted | median check s |",
        "|---|---|---|---|---|---|",
        *summary_lines(rows, kinds),
        "",
        "| level | problem | " + " | ".join(f"{k}: validation | {k}: verdict | {k}: speedup [CI] | {k}: s"
                                           for k in kinds) + " |",
        "|---|---|" + "---|---|---|---|" * len(kinds),
    ]
    body = [f"| {r['level']} | {r['name']} | " + " | ".join(" | ".join(fmt_cell(r.get(k))) for k in kinds) + " |"
            for r in rows]
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text("\n".join(head + body) + "\n")


async def run_table(args: argparse.Namespace) -> int:
    from loom_mcp.config import load_config
    from loom_mcp.judge import pick_target
    from loom_mcp.runtime import open_services
    from loom_mcp.validate.taskfile import assigned_globals, parse_task_globals

    task_globals = parse_task_globals(args.set)
    kinds = [k.strip() for k in args.candidates.split(",") if k.strip()]
    levels = [int(x) for x in args.levels.split(",")]
    wanted = problem_ids(args.problems) if args.problems else None
    work = Path(args.workdir or tempfile.mkdtemp(prefix="loom-kernelbench-")).resolve()
    home = Path(args.home).resolve() if args.home else work / "home"
    os.environ["LOOM_ALLOWED_ROOTS"] = str(work)
    config = load_config(home)
    config.job_timeout_s = args.timeout
    services = open_services(config)
    target = await pick_target(config)
    dirs = problem_files(Path(args.kernelbench).resolve(), levels, work / "problems")
    meta = {"kernelbench": args.kernelbench, "levels": args.levels, "problems": args.problems,
            "candidates": kinds, "task_globals": task_globals, "timeout_s": args.timeout,
            "device": target.device.name, "software": target.software,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python", "benchmarks/kernelbench_table.py", *sys.argv[1:]])}
    out = Path(args.out)
    markdown = Path(args.markdown) if args.markdown else None
    merged = merge_rows(args.merge)
    meta["runs"] = merged["runs"] + [{k: meta[k] for k in ("date", "device", "software", "command")}]
    rows: list[dict] = list(merged["rows"].values())
    deadline = time.monotonic() + args.stop_after if args.stop_after else None
    for level in levels:
        problems = sorted((p for p in dirs[level].glob("*.py") if problem_id(p) is not None), key=problem_id)
        for path in problems:
            if wanted is not None and problem_id(path) not in wanted:
                continue
            case_dir = work / f"level{level}" / path.stem
            case_dir.mkdir(parents=True, exist_ok=True)
            source = path.read_text()
            task = case_dir / "task.py"
            task.write_text(source)
            # --set is for every problem: each gets the names it assigns (level 1 has N, M, ...).
            defined = set(assigned_globals(ast.parse(source)))
            applied = {k: v for k, v in task_globals.items() if k in defined}
            row = merged["rows"].get((level, problem_id(path)))
            if row is None:
                row = {"level": level, "id": problem_id(path), "name": path.stem, "task_globals": applied}
            for kind in kinds:
                if row.get(kind) and row.get("task_globals", {}) == applied:
                    continue  # measured by an earlier run
                if deadline is not None and time.monotonic() > deadline:
                    break
                candidate = case_dir / f"candidate_{kind}.py"
                candidate.write_text(candidate_source(source, kind))
                row[kind] = await check_one(services, task, candidate, applied, args.timeout)
                row[kind]["measured"] = f"{meta['date']}, {meta['device']}"
                if not any(r is row for r in rows):  # a problem enters the table with its first check
                    rows.append(row)
                print(f"level {level} {path.stem} {kind}: {row[kind]['verdict']} "
                      f"validated={row[kind].get('validated')} {fmt_speedup(row[kind])} "
                      f"{row[kind]['check_s']:.1f} s {row[kind].get('error') or ''}", flush=True)
            rows.sort(key=lambda r: (r["level"], r["id"]))
            write_outputs(meta, rows, out, markdown, kinds)
    write_outputs(meta, rows, out, markdown, kinds)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernelbench", help="KernelBench checkout, or its bare git directory")
    parser.add_argument("--levels", default="1,2")
    parser.add_argument("--problems", help="problem ids (the number before the name): 1,4,19-53")
    parser.add_argument("--candidates", default="copy,compile", help="copy, compile or both")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="task_globals for every problem (batch_size=2); repeatable")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per check")
    # The rows behind docs/kernelbench.md; pass them to --merge to add to the table.
    parser.add_argument("--out", default=str(REPO / "docs" / "kernelbench_h200.json"))
    parser.add_argument("--markdown", default=str(REPO / "docs" / "kernelbench.md"),
                        help="Markdown table ('' for none)")
    parser.add_argument("--home", help="LOOM_HOME for the run (default: a fresh one in --workdir)")
    parser.add_argument("--workdir", help="where problems and candidates are written (default: temp)")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite --markdown from the JSON at --out (no checks)")
    parser.add_argument("--merge", nargs="*", default=[], metavar="JSON",
                        help="rows of earlier runs: kept, and not checked again")
    parser.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                        help="start no new check after this long")
    parser.add_argument("--log-level", default="WARNING", help="INFO shows where each check's time goes")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    if args.render:
        data = json.loads(Path(args.out).read_text())
        rows = data.pop("problems")
        write_outputs(data, rows, Path(args.out), Path(args.markdown), data["candidates"])
        return 0
    import anyio

    return anyio.run(run_table, args)


if __name__ == "__main__":
    sys.exit(main())
