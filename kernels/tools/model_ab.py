#!/usr/bin/env python3
"""A/B the Llama Q4_K model program through loom's own `benchmark_command`, over MCP.

    python kernels/tools/model_ab.py --env LOOM_Q4K_STAGES=16:3,56:4 [--baseline-env K=V ...]
    python kernels/tools/model_ab.py --baseline-revision HEAD~1 [--revision HEAD]
    python kernels/tools/model_ab.py ... [--runs 5] [--warmup 1] [--out DIR] [--home DIR] -- BENCH ARGS

The two arms run `python -m kernels.llama_q4k.bench BENCH ARGS` from this checkout: with other
environment settings (`--env` for the candidate, `--baseline-env` for the baseline; given as
`env K=V` in front of the command), or at two git revisions of this repository (each arm in a
worktree of its own commit, committed content only), or both. It spawns `loom-mcp --stdio` as
an MCP client would and calls `benchmark_command`: runs interleaved ABBA in loom's sandbox,
each run's JSON line parsed, per metric both medians with a CI and the improvement factor with
a bootstrap CI. A kernel change is judged where it is used: the GEMV's ring depth, for one,
ranked one way back to back and the other way inside the model's decode (docs/measurements.md,
tenth session).

Default BENCH ARGS: on a GPU `--random-config llama3-8b --gen 64 --runs 2 --reference none`;
without one the tiny config on the CPU (a check of the plumbing, not of speed). Writes
model_ab.json into --out and prints a Markdown table; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from kernels_campaign import ToolFailed, call, say, server_params  # noqa: E402

GPU_BENCH = ["--random-config", "llama3-8b", "--gen", "64", "--runs", "2", "--reference", "none"]
CPU_BENCH = ["--random-config", "tiny", "--prompt-len", "16", "--gen", "4", "--runs", "2"]
CPU_BENCH += ["--device", "cpu", "--reference", "none"]
METRICS = [
    "decode_tokens_per_s:higher",
    "per_token_latency_ms_p50:lower",
    "per_token_latency_ms_p95:lower",
    "ttft_ms:lower",
    "prefill_tokens_per_s:higher",
]


def env_pairs(items: list[str], flag: str) -> list[str]:
    """`K=V` settings, checked: a name of letters, digits and underscores, then '='."""
    for item in items:
        name, sep, _ = item.partition("=")
        if not sep or not name or not name.replace("_", "").isalnum() or name[0].isdigit():
            raise SystemExit(f"{flag} takes NAME=VALUE, not {item!r}")
    return items


def bench_command(settings: list[str], bench_args: list[str]) -> list[str]:
    """The argv one arm runs: the model benchmark under this interpreter, with `env` in front
    when the arm has settings of its own (the sandbox passes no environment of ours through)."""
    command = [sys.executable, "-m", "kernels.llama_q4k.bench", *bench_args]
    if settings:
        env = shutil.which("env") or "/usr/bin/env"
        command = [env, *settings, *command]
    return command


def tool_arguments(args: argparse.Namespace, bench_args: list[str]) -> dict[str, Any]:
    """The benchmark_command call: the candidate's command, the baseline's where it differs,
    and the revisions where asked for (the baseline command then defaults to the candidate's)."""
    if not (args.env or args.baseline_env or args.baseline_revision):
        raise SystemExit("nothing to compare: give --env, --baseline-env or --baseline-revision")
    if args.revision and not args.baseline_revision:
        raise SystemExit("--revision needs --baseline-revision")
    candidate = bench_command(env_pairs(args.env, "--env"), bench_args)
    baseline = bench_command(env_pairs(args.baseline_env, "--baseline-env"), bench_args)
    arguments: dict[str, Any] = {
        "command": candidate,
        "metrics": METRICS,
        "runs": args.runs,
        "warmup": args.warmup,
        "parser": "json",
        "cwd": str(ROOT),
    }
    if baseline != candidate or not args.baseline_revision:
        arguments["baseline_command"] = baseline
    if args.baseline_revision:
        arguments["baseline_revision"] = args.baseline_revision
        arguments["revision"] = args.revision or "HEAD"
        arguments["repo"] = str(ROOT)
    return arguments


def table(result: dict[str, Any]) -> str:
    """Per metric: each arm's median with its CI, and the improvement factor (> 1: candidate
    better) with its CI."""
    lines = [
        "| metric | baseline median [CI] | candidate median [CI] | improvement [CI] |",
        "|---|---|---|---|",
    ]
    for m in result["metrics"]:
        b, c, r = m["baseline"], m["candidate"], m["ratio"]
        lines.append(
            f"| {m['name']} | {b['median']:.4g} [{m['baseline_ci'][0]:.4g}, {m['baseline_ci'][1]:.4g}]"
            f" | {c['median']:.4g} [{m['candidate_ci'][0]:.4g}, {m['candidate_ci'][1]:.4g}]"
            f" | {r['estimate']:.4f}x [{r['ci_low']:.4f}, {r['ci_high']:.4f}] |"
        )
    return "\n".join(lines)


async def compare(params, arguments: dict[str, Any], timeout: float) -> dict[str, Any]:
    from mcp import Client

    async with Client(params) as client:
        return await call(client, "benchmark_command", arguments, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] | None = None
    if "--" in argv:
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the candidate arm")
    parser.add_argument("--baseline-env", action="append", default=[], help="NAME=VALUE for the baseline arm")
    parser.add_argument("--baseline-revision", help="git revision of this repository for the baseline arm")
    parser.add_argument("--revision", help="the candidate arm's revision (default HEAD)")
    parser.add_argument("--runs", type=int, default=5, help="runs per arm, interleaved ABBA (3-200)")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded runs per arm first")
    parser.add_argument("--out", type=Path, default=None, help="where model_ab.json goes (default $OUT, else .)")
    parser.add_argument("--home", type=Path, default=None, help="loom state directory (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole comparison")
    args = parser.parse_args(argv)
    if bench_args is None:
        import torch

        bench_args = GPU_BENCH if torch.cuda.is_available() else CPU_BENCH
    arguments = tool_arguments(args, bench_args)
    out = args.out or Path(os.environ.get("OUT", "."))
    with tempfile.TemporaryDirectory(prefix="loom-model-ab-") as scratch:
        home = args.home or Path(scratch) / "home"
        params = server_params(home, [ROOT, Path(tempfile.gettempdir())], "WARNING")
        say(f"benchmark_command: {json.dumps({k: v for k, v in arguments.items() if k != 'metrics'})}")
        try:
            result = anyio.run(compare, params, arguments, args.timeout)
        except ToolFailed as exc:
            say(f"benchmark_command failed: {exc}")
            return 1
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_ab.json").write_text(json.dumps({"arguments": arguments, "result": result}, indent=1))
    print(table(result))
    print(
        f"\n{result['runs_per_arm']} runs per arm ({result['runs_requested']} asked), "
        f"{len(result['failed_runs'])} failed; revisions: {result.get('revisions')}; "
        f"benchmark {result.get('benchmark_id')}; {result['seconds']:.1f} s"
    )
    for finding in result.get("findings", []):
        print(f"- {finding.get('message', finding)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
