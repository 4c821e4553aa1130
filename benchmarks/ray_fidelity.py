"""Does the Ray executor judge like the local one? Same verdicts, same timings, on built-in tasks.

    python benchmarks/ray_fidelity.py [--tasks rmsnorm,softmax] [--repeats 3] [--executors local,ray]
                                      [--shapes N] [--json OUT] [--device auto|cpu]

On the GPU machine:

    bash benchmarks/device_setup.sh python3 benchmarks/ray_fidelity.py --json $OUT/ray_fidelity.json

For each executor (`[executor] kind = "local"`, then `kind = "ray"` with `address = "local"`, a
private Ray instance the server starts and ends), a fresh LOOM_HOME and an in-process server
driven over the real MCP protocol run `run_validation` then `benchmark` of each task's
candidate, --repeats times. Per call it records the wall seconds; per benchmark the per-shape
candidate and baseline medians and the geomean speedup with its CI. A run's verdict is the
validation's pass/fail and what the gate would decide on the benchmark alone
(`gate.benchmark_reasons`). Per task the output compares the verdicts under each executor (they
must be equal) and the ratio ray / local of each shape's candidate median (median over repeats),
flagged past 1 %. Tasks: kernels/<task>/ and `demo` (loom_mcp/demo_data). Without a GPU
Triton's interpreter runs the kernels, so only the --shapes cheapest shapes (1 by default) are
timed and the gate accepts wall-clock timings, as `loom-mcp demo` does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
FLAG = 0.01  # a candidate median off by more than this fraction under Ray is flagged
CPU_GATE = "[gate]\naccept_wall_clock = true\nmax_plausible_speedup = 100.0\nmax_time_s = 3.0\nmin_time_s = 0.3\n"


def task_dir(name: str) -> Path:
    return ROOT / "loom_mcp" / "demo_data" if name == "demo" else ROOT / "kernels" / name


def cheapest_shapes(task_file: Path, n: int) -> list[str] | None:
    """The names of the task's n cheapest SHAPES by bytes_moved (run here, a trusted script);
    None: all of them."""
    if n <= 0:
        return None
    spec = importlib.util.spec_from_file_location(f"ray_fidelity_{task_file.parent.name}", task_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shapes = getattr(module, "SHAPES", None)
    if not shapes:
        return None

    def cost(shape: dict) -> float:
        try:
            return float(module.bytes_moved(**{k: v for k, v in shape.items() if k != "name"}))
        except Exception:
            return float("inf")

    return [s["name"] for s in sorted(shapes, key=cost)[:n]]


def verdict(passed: bool, record: dict, gate: Any) -> tuple[str, list[str]]:
    """Validation pass/fail and the gate's decision on this benchmark's evidence alone, and the
    gate's reasons in words (a reject is only understood with them)."""
    from loom_mcp.gate import benchmark_reasons
    from loom_mcp.judge_models import BenchmarkEvidence, is_review_code

    reasons = benchmark_reasons(BenchmarkEvidence.model_validate(record["evidence"]), gate)
    codes = sorted({c for c, _ in reasons})
    blocking = [c for c in codes if not is_review_code(c)]
    decision = "reject" if blocking or not passed else "needs_review" if codes else "accept"
    words = f"{'valid' if passed else 'invalid'} {decision}" + (f" ({','.join(codes)})" if codes else "")
    return words, [f"{code}: {message}" for code, message in reasons]


async def call(client: Any, tool: str, args: dict[str, Any]) -> tuple[dict, float]:
    t0 = time.monotonic()
    result = await client.call_tool(tool, args)
    wall = time.monotonic() - t0
    if result.is_error:
        raise RuntimeError(f"{tool} failed: {result.content[0].text if result.content else ''}"[:2000])
    return result.structured_content or {}, wall


async def run_executor(kind: str, tasks: list[str], shapes: dict, repeats: int, cpu: bool, root: Path) -> dict:
    from mcp import Client

    from loom_mcp.config import load_config
    from loom_mcp.server import build_server

    home = root / f"home-{kind}"
    home.mkdir(parents=True)
    executor = '[executor]\nkind = "ray"\naddress = "local"\n' if kind == "ray" else '[executor]\nkind = "local"\n'
    # The tasks live in this checkout (kernels/, loom_mcp/demo_data); the jobs under LOOM_HOME.
    roots = json.dumps([str(ROOT), str(root)])
    (home / "loom.toml").write_text(f"allowed_roots = {roots}\n{executor}" + (CPU_GATE if cpu else ""))
    config = load_config(home, environ={})  # loom.toml alone: device_setup.sh's LOOM_* do not apply
    out: dict[str, list[dict]] = {t: [] for t in tasks}
    async with Client(build_server(config)) as client:
        info = (await client.call_tool("device_info", {})).structured_content or {}
        state = info.get("executor") or {}
        say(f"{kind}: executor {state.get('kind')}, slots {[s.get('device') for s in state.get('slots') or []]}")
        for r in range(repeats):
            for task in tasks:
                args: dict[str, Any] = {
                    "task": str(task_dir(task) / "task.py"),
                    "candidate": str(task_dir(task) / "candidate.py"),
                }
                if shapes[task]:
                    args["shapes"] = shapes[task]
                row: dict[str, Any] = {"repeat": r}
                try:
                    validation, row["validation_s"] = await call(client, "run_validation", args)
                    bench, row["benchmark_s"] = await call(client, "benchmark", args)
                    record = json.loads(
                        (await client.read_resource(f"loom://runs/{bench['benchmark_id']}")).contents[0].text
                    )
                except Exception as exc:  # one failed call is a row of the output, not the end of the run
                    row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                    say(f"  {kind} {task} #{r}: ERROR {row['error'][:300]}")
                    out[task].append(row)
                    continue
                words, reasons = verdict(validation["passed"], record, config.gate)
                row |= {
                    "passed": validation["passed"],
                    "verdict": words,
                    "reasons": reasons,
                    "device": bench["device"],
                    "timer": bench["timer"],
                    "geomean": [bench["geomean_speedup"], bench["geomean_ci_low"], bench["geomean_ci_high"]],
                    "shapes": {
                        s["name"]: {"candidate_s": s["candidate_median_s"], "baseline_s": s["baseline_median_s"]}
                        for s in bench["shapes"]
                    },
                    "placement": record.get("placement"),
                }
                say(
                    f"  {kind} {task} #{r}: {row['verdict']}, geomean x{row['geomean'][0]:.3f} "
                    f"in {row['validation_s']:.1f} + {row['benchmark_s']:.1f} s"
                )
                for reason in reasons:
                    say(f"    {reason[:400]}")
                out[task].append(row)
    return out


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def median_of(rows: list[dict], shape: str, arm: str) -> float | None:
    values = [r["shapes"][shape][arm] for r in rows if shape in r.get("shapes", {})]
    return statistics.median(values) if values else None


def compare(tasks: list[str], runs: dict[str, dict]) -> list[dict]:
    """Per task: each executor's verdicts (and the most common one), and per shape the ray /
    local ratio of the candidate's and the baseline's medians over repeats."""
    out = []
    for task in tasks:
        entry: dict[str, Any] = {"task": task, "verdicts": {}, "shapes": {}}
        for kind, run in runs.items():
            seen = [r.get("verdict", "error") for r in run[task]]
            entry["verdicts"][kind] = {"each": seen, "usual": Counter(seen).most_common(1)[0][0] if seen else None}
        usual = {v["usual"] for v in entry["verdicts"].values()}
        entry["verdicts_equal"] = len(usual) == 1 if len(runs) > 1 else None
        if "local" in runs and "ray" in runs:
            names = {n for r in runs["local"][task] for n in r.get("shapes", {})}
            for name in sorted(names):
                cell: dict[str, Any] = {}
                for arm in ("candidate_s", "baseline_s"):
                    local, ray = median_of(runs["local"][task], name, arm), median_of(runs["ray"][task], name, arm)
                    cell[arm] = {"local": local, "ray": ray, "ratio": ray / local if local and ray else None}
                ratio = cell["candidate_s"]["ratio"]
                # The local executor against itself: how far its own repeats lie apart. A few-us
                # kernel's median moves by more than 1 % between calls on one executor.
                own = [r["shapes"][name]["candidate_s"] for r in runs["local"][task] if name in r.get("shapes", {})]
                cell["local_spread"] = max(own) / min(own) - 1 if len(own) > 1 and min(own) > 0 else None
                cell["flagged"] = ratio is None or abs(ratio - 1) > FLAG
                cell["beyond_noise"] = ratio is None or abs(ratio - 1) > max(FLAG, cell["local_spread"] or 0.0)
                entry["shapes"][name] = cell
            ratios = [c["candidate_s"]["ratio"] for c in entry["shapes"].values() if c["candidate_s"]["ratio"]]
            # A bias of the executor shows in every shape alike; the geomean of the ratios is it.
            entry["geomean_ratio"] = statistics.geometric_mean(ratios) if ratios else None
        entry["walls_s"] = {
            kind: {
                step: statistics.median(r[f"{step}_s"] for r in run[task] if f"{step}_s" in r)
                for step in ("validation", "benchmark")
                if any(f"{step}_s" in r for r in run[task])
            }
            for kind, run in runs.items()
        }
        out.append(entry)
    return out


def table(results: list[dict]) -> str:
    lines = [
        f"{'task':<10} {'shape':<26} {'local cand s':>12} {'ray cand s':>12} {'ray/local':>9} "
        f"{'local spread':>12}  flag"
    ]
    for e in results:
        verdicts = "; ".join(f"{k}: {v['usual']}" for k, v in e["verdicts"].items())
        same = {True: "equal", False: "DIFFER", None: "-"}[e["verdicts_equal"]]
        walls = "; ".join(f"{k} {', '.join(f'{s} {w:.1f}s' for s, w in v.items())}" for k, v in e["walls_s"].items())
        lines.append(f"{e['task']:<10} verdicts {same}: {verdicts}")
        lines.append(f"{'':<10} median wall per call: {walls}")
        if e.get("geomean_ratio"):
            lines.append(f"{'':<10} geomean ray/local over shapes: {e['geomean_ratio']:.4f}")
        for name, cell in e["shapes"].items():
            c = cell["candidate_s"]
            fmt = lambda x: f"{x:.4g}" if x is not None else "-"  # noqa: E731
            flag = "BEYOND NOISE" if cell["beyond_noise"] else "FLAG" if cell["flagged"] else ""
            spread = f"{cell['local_spread']:.2%}" if cell.get("local_spread") is not None else "-"
            lines.append(
                f"{'':<10} {name:<26} {fmt(c['local']):>12} {fmt(c['ray']):>12} {fmt(c['ratio']):>9} "
                f"{spread:>12}  {flag}"
            )
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> int:
    from loom_mcp.devices import probe_devices

    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the workers' torch sees no GPU: the pool is CPU slots
    has_gpu = args.device == "auto" and any(d.vendor != "cpu" for d in probe_devices()[0])
    kinds = [k.strip() for k in args.executors.split(",") if k.strip()]
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    missing = [
        t for t in tasks if not (task_dir(t) / "task.py").is_file() or not (task_dir(t) / "candidate.py").is_file()
    ]
    if missing:
        say(f"no task.py and candidate.py for: {', '.join(missing)}")
        return 2
    n_shapes = args.shapes if args.shapes is not None else (0 if has_gpu else 1)
    shapes = {t: cheapest_shapes(task_dir(t) / "task.py", n_shapes) for t in tasks}
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="loom-ray-fidelity-") as tmp:
        for kind in kinds:
            runs[kind] = await run_executor(kind, tasks, shapes, args.repeats, not has_gpu, Path(tmp).resolve())
            if args.json:  # a run cut short by a time limit keeps what it measured
                Path(args.json).write_text(json.dumps({"partial": True, "runs": runs}, indent=2) + "\n")
    results = compare(tasks, runs)
    print(table(results))
    doc = {"gpu": has_gpu, "repeats": args.repeats, "flag_above": FLAG, "shapes": shapes, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(doc | {"runs": runs}, indent=2) + "\n")
    bad = [
        e["task"] for e in results if e["verdicts_equal"] is False or any(c["flagged"] for c in e["shapes"].values())
    ]
    print(f"{len(bad)} of {len(results)} task(s) differ: {', '.join(bad) or 'none'}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tasks", default="rmsnorm,softmax,silu_mul", help="kernels/<task> names or demo, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=3, help="validation + benchmark calls per task and executor")
    parser.add_argument("--executors", default="local,ray", help="executor kinds, comma-separated")
    parser.add_argument(
        "--shapes", type=int, help="time only the N cheapest shapes (0: all; default all on a GPU, 1 on CPU)"
    )
    parser.add_argument("--json", help="write the comparison and every run here too")
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto", help="cpu: hide the GPUs from the workers")
    sys.exit(anyio.run(main, parser.parse_args()))
