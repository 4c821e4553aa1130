#!/usr/bin/env python3
"""Judge the built-in kernel candidates with loom's own loop, over the real MCP protocol.

    python benchmarks/kernels_campaign.py [--tasks rmsnorm,silu_mul,...] [--out DIR] [--home DIR]
                                     [--timeout S] [--max-shapes N]

It copies `kernels/` into a fresh git repository (every file committed except the candidates
being judged, which stay as the working-tree change a developer would submit), spawns
`loom-mcp --stdio` as an MCP client would, and calls device_info -> start_campaign ->
submit_candidate (one per task) -> campaign_report. For each task it records the verdict and
reasons, the geomean speedup with its CI, the per-shape speedups (read from the benchmark record
at loom://runs/{benchmark_id}), the evidence ids and the commit on loom/<campaign> when
accepted. It writes kernels_campaign.json and kernels_campaign.md into --out and prints the
Markdown table on stdout; progress goes to stderr.

Without a GPU the candidates' Triton kernels run in Triton's interpreter and every timing is a
CPU wall-clock timing: such a run checks the plumbing and the validation, not GPU speed. There the
gate is told to accept wall-clock timings (as `loom-mcp demo` does) and, because the interpreter
takes minutes per call at the real shapes, each task keeps only its --max-shapes cheapest shapes
(2 by default on CPU, all on a GPU); the output says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pprint
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
CPU_MAX_SHAPES = 2


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- tasks and the target repository


def discover_tasks(kernels: Path) -> list[str]:
    return sorted(
        d.name
        for d in kernels.iterdir()
        if (d / "task.py").is_file() and (d / "candidate.py").is_file()
    )


def select_tasks(requested: str | None, kernels: Path) -> tuple[list[str], list[str]]:
    """(tasks to judge, notes about requested ones that cannot be)."""
    available = discover_tasks(kernels)
    if not requested:
        return available, []
    tasks, notes = [], []
    for name in (t.strip() for t in requested.split(",")):
        if not name or name in tasks:
            continue
        if name in available:
            tasks.append(name)
        elif not (kernels / name).is_dir():
            notes.append(f"{name}: no kernels/{name}/ directory, skipped")
        else:
            missing = [f for f in ("task.py", "candidate.py") if not (kernels / name / f).is_file()]
            notes.append(f"{name}: kernels/{name}/ has no {' or '.join(missing)}, skipped")
    return tasks, notes


SHAPE_LIMIT = """

# ---- added by benchmarks/kernels_campaign.py for a CPU run: Triton's interpreter takes minutes per
# call at the real shapes, so only the {n} cheapest shapes (by bytes_moved) are judged here.
# Written out as a literal: the server reads SHAPES without running the file.
SHAPES = {shapes}
"""


def cheapest_shapes(task_file: Path, n: int) -> list[dict]:
    """The task's n cheapest SHAPES by bytes_moved (run here, in this trusted script)."""
    spec = importlib.util.spec_from_file_location(
        f"kernels_campaign_{task_file.parent.name}", task_file
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def cost(shape: dict) -> float:
        try:
            return float(module.bytes_moved(**shape))
        except Exception:
            return float("inf")

    return sorted(module.SHAPES, key=cost)[:n]


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        [
            "git",
            "-c",
            "user.name=loom kernels campaign",
            "-c",
            "user.email=kernels@loom.invalid",
            *args,
        ],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


def make_repo(workdir: Path, kernels: Path, tasks: list[str], max_shapes: int) -> tuple[Path, str]:
    """A fresh repository holding kernels/ (not its tools/): all committed but the judged candidates. Returns (repo, HEAD)."""
    repo = workdir / "repo"
    repo.mkdir(parents=True)
    shutil.copytree(
        kernels, repo / "kernels", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "tools")
    )
    if max_shapes > 0:
        for task in tasks:
            task_file = repo / "kernels" / task / "task.py"
            shapes = pprint.pformat(cheapest_shapes(task_file, max_shapes), sort_dicts=False)
            task_file.write_text(
                task_file.read_text() + SHAPE_LIMIT.format(n=max_shapes, shapes=shapes)
            )
    (repo / ".gitignore").write_text("__pycache__/\n*.pyc\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    for task in tasks:  # the change under judgment: left in the working tree, as a developer's edit
        _git(repo, "rm", "-q", "--cached", f"kernels/{task}/candidate.py")
    message = "kernels: tasks and baselines" + (
        f" (shapes cut to {max_shapes} per task)" if max_shapes else ""
    )
    _git(repo, "commit", "-q", "-m", message)
    return repo, _git(repo, "rev-parse", "HEAD")


def write_cpu_config(home: Path) -> bool:
    """CPU-only run: let the gate accept wall-clock timings. Never overwrites a human's loom.toml."""
    config = home / "loom.toml"
    if config.exists():
        return False
    home.mkdir(parents=True, exist_ok=True)
    # As `loom-mcp demo` does on CPU: accept wall-clock timings, widen the plausibility cap (CPU
    # ratios against a float64-heavy baseline swing with allocator page faults) and shorten the
    # timing loop per shape.
    config.write_text(
        "[gate]\naccept_wall_clock = true\nmax_plausible_speedup = 100.0\nmax_time_s = 3.0\nmin_time_s = 0.3\n"
    )
    return True


# ---------------------------------------------------------------- the MCP client


def server_command() -> tuple[str, list[str]]:
    script = Path(sys.executable).with_name("loom-mcp")
    if script.is_file() and os.access(script, os.X_OK):
        return str(script), []
    found = shutil.which("loom-mcp")
    if found:
        return found, []
    return sys.executable, ["-m", "loom_mcp.cli"]


def server_params(home: Path, roots: list[Path], log_level: str):
    from mcp import StdioServerParameters

    from loom_mcp.demo import server_env  # the import path and GPU selection, passed through

    command, prefix = server_command()
    env = server_env(home) | {"LOOM_ALLOWED_ROOTS": os.pathsep.join(str(r) for r in roots)}
    args = [*prefix, "--stdio", "--home", str(home), "--log-level", log_level]
    return StdioServerParameters(command=command, args=args, env=env)


class ToolFailed(RuntimeError):
    pass


HEARTBEAT_EVERY_S = 10.0


class ProgressLines:
    """Which progress messages reach stderr: all of them, except the server's per-second
    heartbeats, of which one in HEARTBEAT_EVERY_S seconds (a log of a 10-minute run stays
    readable, and a stuck run still shows it is alive)."""

    def __init__(self, every_s: float = HEARTBEAT_EVERY_S) -> None:
        from loom_mcp.sandbox.runner import HEARTBEAT  # the format, where the server makes it

        self.heartbeat = HEARTBEAT
        self.every_s = every_s
        self.last = float("-inf")

    def wanted(self, message: str, now: float) -> bool:
        if not self.heartbeat.search(message):
            return True
        if now - self.last < self.every_s:
            return False
        self.last = now
        return True


async def call(
    client, tool: str, args: dict[str, Any], timeout: float | None = None, prefix: str = ""
) -> dict:
    lines = ProgressLines()

    async def on_progress(progress, total, message):
        if message and lines.wanted(message, time.monotonic()):
            say(f"    {prefix}… {message}")

    result = await client.call_tool(
        tool, args, read_timeout_seconds=timeout, progress_callback=on_progress
    )
    text = result.content[0].text if result.content else ""
    if result.is_error:
        raise ToolFailed(text or f"{tool} failed")
    return result.structured_content or {}


async def read_json_resource(client, uri: str) -> dict | None:
    try:
        result = await client.read_resource(uri)
        return json.loads(result.contents[0].text)
    except Exception as exc:  # evidence details are a bonus; the verdict stands without them
        say(f"    (could not read {uri}: {type(exc).__name__}: {exc})")
        return None


def shape_rows(record: dict | None) -> tuple[list[dict], dict]:
    """Per-shape speedups and run facts from a benchmark record (loom://runs/{benchmark_id})."""
    if not record:
        return [], {}
    evidence = record.get("evidence") or {}
    rows = []
    for s in evidence.get("shapes") or []:
        ratio = s.get("ratio") or {}
        rows.append(
            {
                "name": s.get("name"),
                "baseline_median_s": (s.get("baseline") or {}).get("median"),
                "candidate_median_s": (s.get("candidate") or {}).get("median"),
                "speedup": ratio.get("estimate"),
                "ci_low": ratio.get("ci_low"),
                "ci_high": ratio.get("ci_high"),
                "pairs": min(
                    (s.get("baseline") or {}).get("n", 0), (s.get("candidate") or {}).get("n", 0)
                ),
                "roofline_fraction": s.get("roofline_fraction"),
            }
        )
    geomean = evidence.get("geomean") or {}
    device = record.get("device") or {}
    facts = {
        "device": device.get("name") or evidence.get("device"),
        "timer": evidence.get("timer"),
        "ci_level": geomean.get("level"),
        "proof_of_execution": evidence.get("proof_of_execution"),
    }
    return rows, facts


def validation_counts(record: dict | None) -> dict:
    if not record:
        return {}
    cases = (record.get("evidence") or {}).get("cases") or []
    return {"cases_total": len(cases), "cases_failed": sum(1 for c in cases if not c.get("passed"))}


async def probe(params) -> dict:
    from mcp import Client

    async with Client(params) as client:
        return await call(client, "device_info", {})


async def campaign(params, repo: Path, tasks: list[str], timeout: float, goal: str) -> dict:
    from mcp import Client

    out: dict[str, Any] = {"results": []}
    async with Client(params) as client:
        started = await call(client, "start_campaign", {"repo": str(repo), "goal": goal})
        cid = started["campaign_id"]
        out["campaign"] = started
        say(
            f"campaign {cid} on {repo} (base {started['base_commit'][:12]}, branch {started['branch']})"
        )
        for i, task in enumerate(tasks, 1):
            say(f"[{i}/{len(tasks)}] submit_candidate {task}")
            row: dict[str, Any] = {"task": task}
            t0 = time.monotonic()
            try:
                res = await call(
                    client,
                    "submit_candidate",
                    {
                        "campaign_id": cid,
                        "task": str(repo / "kernels" / task / "task.py"),
                        "candidate": str(repo / "kernels" / task / "candidate.py"),
                    },
                    timeout=timeout,
                    prefix=f"{task}: ",
                )
            except Exception as exc:  # a tool error or a client-side timeout: record it, go on
                row.update(verdict="error", error=f"{type(exc).__name__}: {exc}"[:2000])
                row["wall_s"] = round(time.monotonic() - t0, 1)
                say(f"    {task}: ERROR after {row['wall_s']} s: {row['error'][:300]}")
                out["results"].append(row)
                continue
            row["wall_s"] = round(time.monotonic() - t0, 1)
            row.update(
                {
                    k: res.get(k)
                    for k in (
                        "verdict",
                        "reasons",
                        "reason_codes",
                        "speedup",
                        "speedup_ci_low",
                        "speedup_ci_high",
                        "submission_id",
                        "validation_id",
                        "benchmark_id",
                        "commit",
                        "branch",
                        "change_digest",
                    )
                }
            )
            if res.get("benchmark_id"):
                row["shapes"], row["benchmark"] = shape_rows(
                    await read_json_resource(client, f"loom://runs/{res['benchmark_id']}")
                )
            if res.get("validation_id"):
                row["validation"] = validation_counts(
                    await read_json_resource(client, f"loom://runs/{res['validation_id']}")
                )
            say(f"    {task}: {row['verdict']} {fmt_speedup(row)} in {row['wall_s']} s")
            # The ids go to the log at once, so a run cut short still names its evidence.
            say(
                f"      evidence: submission {row.get('submission_id')}, validation "
                f"{row.get('validation_id')}, benchmark {row.get('benchmark_id')}, commit {row.get('commit')}"
            )
            for reason in row.get("reasons") or []:
                say(f"      - {reason[:240]}")
            out["results"].append(row)
        say("campaign_report")
        try:
            out["report"] = await call(client, "campaign_report", {"campaign_id": cid})
        except Exception as exc:
            out["report"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    return out


# ---------------------------------------------------------------- output


def fmt_speedup(row: dict) -> str:
    if row.get("speedup") is None:
        return "—"
    low, high = row.get("speedup_ci_low"), row.get("speedup_ci_high")
    ci = f" [{low:.3f}, {high:.3f}]" if low is not None and high is not None else ""
    return f"x{row['speedup']:.3f}{ci}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(doc: dict) -> str:
    level = next(
        (
            r["benchmark"]["ci_level"]
            for r in doc["results"]
            if (r.get("benchmark") or {}).get("ci_level")
        ),
        0.95,
    )
    lines = [
        f"# Kernel candidates judged by loom-mcp {doc.get('loom_mcp') or ''}".rstrip(),
        "",
        f"- date: {doc['date']}",
        f"- device: {doc['device']}" + (f" (timer: {doc['timer']})" if doc.get("timer") else ""),
        f"- campaign: `{doc.get('campaign_id')}` on a fresh repository (base `{(doc.get('base_commit') or '')[:12]}`)",
        f"- loom home: `{doc['home']}`; report: `{doc.get('report_markdown') or '-'}`",
    ]
    for note in doc["notes"]:
        lines.append(f"- note: {note}")
    lines += [
        "",
        f"| task | verdict | geomean speedup [{level * 100:.0f}% CI] | evidence ids | commit |",
        "|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        ids = (
            ", ".join(
                f"`{r[k]}`" for k in ("submission_id", "validation_id", "benchmark_id") if r.get(k)
            )
            or "—"
        )
        commit = f"`{r['commit'][:12]}`" if r.get("commit") else "—"
        lines.append(f"| {r['task']} | {r['verdict']} | {fmt_speedup(r)} | {ids} | {commit} |")
    for r in doc["results"]:
        if not (r.get("shapes") or r.get("reasons") or r.get("error")):
            continue
        lines += ["", f"## {r['task']}: {r['verdict']} ({r['wall_s']} s)"]
        counts = r.get("validation") or {}
        if counts:
            lines.append(
                f"validation: {counts['cases_total'] - counts['cases_failed']}/{counts['cases_total']} cases passed"
            )
        for reason in r.get("reasons") or []:
            lines.append(f"- {_cell(reason)}")
        if r.get("error"):
            lines.append(f"- error: {_cell(r['error'][:500])}")
        if r.get("shapes"):
            lines += ["", "| shape | baseline | candidate | speedup [CI] |", "|---|---|---|---|"]
            for s in r["shapes"]:
                b, c = s.get("baseline_median_s"), s.get("candidate_median_s")
                sp = (
                    f"x{s['speedup']:.3f} [{s['ci_low']:.3f}, {s['ci_high']:.3f}]"
                    if s.get("speedup") is not None
                    else "—"
                )
                lines.append(f"| {s['name']} | {_us(b)} | {_us(c)} | {sp} |")
    return "\n".join(lines) + "\n"


def _us(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e6:.1f} us"


def summary(md: str) -> str:
    """The header and the verdict table: everything before the per-task sections."""
    return md.split("\n## ", 1)[0].rstrip()


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tasks",
        help="comma-separated task names (default: every kernels/ dir with task.py and candidate.py)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT") or "."),
        help="where to write kernels_campaign.{json,md} (default $OUT or .)",
    )
    p.add_argument(
        "--home",
        type=Path,
        help="LOOM_HOME for the spawned server (default: a fresh dir beside the repo)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds per submission (client side; default 3600)",
    )
    p.add_argument(
        "--max-shapes",
        type=int,
        default=None,
        help=f"judge only the N cheapest shapes per task; 0 = all (default: all on a GPU, {CPU_MAX_SHAPES} on CPU)",
    )
    p.add_argument(
        "--workdir", type=Path, help="where to create the repository (default: a temp dir, kept)"
    )
    p.add_argument("--kernels", type=Path, default=KERNELS, help=argparse.SUPPRESS)
    p.add_argument(
        "--server-log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tasks, notes = select_tasks(args.tasks, args.kernels)
    for note in notes:
        say(f"note: {note}")
    if not tasks:
        say("no task to judge")
        return 2
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="loom-kernels-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    home = (args.home or workdir / "loom-home").resolve()
    home.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    params = server_params(home, [workdir], args.server_log_level)
    say(f"server: {params.command} {' '.join(params.args)}; home {home}")

    info = anyio.run(probe, params)
    gpus = [d for d in info["devices"] if d["vendor"] != "cpu"]
    torch_gpu = any(n.startswith("cuda") for n in info["toolchain"].get("torch_devices") or [])
    on_gpu = bool(gpus) and torch_gpu
    device = (
        gpus[0]["name"]
        if on_gpu
        else next((d["name"] for d in info["devices"] if d["vendor"] == "cpu"), "CPU")
    )
    say(f"device: {device}" + ("" if on_gpu else " (no GPU torch can use)"))
    if not on_gpu:
        say(
            "no GPU: Triton runs interpreted and every timing is a CPU wall-clock timing, not GPU speed"
        )
        notes.append(
            "no GPU: candidates' Triton kernels ran in Triton's interpreter; timings are CPU wall clock"
        )
        if write_cpu_config(home):
            notes.append(
                f"wrote {home / 'loom.toml'}: gate accepts wall-clock timings, plausibility cap 100x, at most 3 s of timing per shape"
            )
        else:
            notes.append(f"kept the existing {home / 'loom.toml'}")
    max_shapes = (
        args.max_shapes if args.max_shapes is not None else (0 if on_gpu else CPU_MAX_SHAPES)
    )
    if max_shapes:
        notes.append(
            f"each task judged on its {max_shapes} cheapest shapes (by bytes_moved), not all"
        )

    repo, base = make_repo(workdir, args.kernels, tasks, max_shapes)
    say(f"repository {repo} at {base[:12]}; judging {', '.join(tasks)}")
    started = time.monotonic()
    run = anyio.run(
        campaign, params, repo, tasks, args.timeout, "faster built-in kernels: " + ", ".join(tasks)
    )

    report = run.get("report") or {}
    files = report.get("files") or {}
    copied = out / "loom_report"
    if files:
        copied.mkdir(exist_ok=True)
        for path in files.values():
            if Path(path).is_file():
                shutil.copy2(path, copied / Path(path).name)
    timers = {(r.get("benchmark") or {}).get("timer") for r in run["results"]} - {None}
    bench_devices = {(r.get("benchmark") or {}).get("device") for r in run["results"]} - {None}
    doc = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "loom_mcp": info["toolchain"].get("loom_mcp"),
        "device": ", ".join(sorted(bench_devices)) or device,
        "on_gpu": on_gpu,
        "timer": ", ".join(sorted(timers)) or None,
        "toolchain": {
            k: info["toolchain"].get(k)
            for k in ("python", "torch", "torch_cuda", "torch_hip", "triton")
        },
        "campaign_id": (run.get("campaign") or {}).get("campaign_id"),
        "base_commit": base,
        "branch": (run.get("campaign") or {}).get("branch"),
        "repo": str(repo),
        "home": str(home),
        "max_shapes": max_shapes or None,
        "notes": notes,
        "results": run["results"],
        "report": report,
        "report_markdown": files.get("markdown"),
        "report_copy": str(copied) if files else None,
        "wall_s": round(time.monotonic() - started, 1),
    }
    md = markdown(doc)
    (out / "kernels_campaign.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / "kernels_campaign.md").write_text(md)
    say(
        f"\nwrote {out / 'kernels_campaign.md'} and {out / 'kernels_campaign.json'} in {doc['wall_s']} s"
    )
    print(summary(md))
    return 1 if any(r["verdict"] == "error" for r in run["results"]) or "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
