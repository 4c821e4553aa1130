"""`loom-mcp check`: the judge without MCP, for reproducing a report's numbers from a shell."""

from __future__ import annotations

import os
import sys

import anyio

from loom_mcp.config import LoomConfig
from loom_mcp.errors import LoomError


async def _check(
    config: LoomConfig,
    task: str,
    candidate: str,
    baseline: str | None,
    shapes: list[str] | None,
    task_globals: dict | None = None,
) -> dict:
    from loom_mcp import judge
    from loom_mcp.gate import decide
    from loom_mcp.judge_models import CompileEvidence
    from loom_mcp.runtime import open_services

    services = open_services(config)
    stores = (config, services.ledger, services.artifacts)
    call = judge.JudgeCall(task, candidate, shapes, task_globals=task_globals)  # no campaign, no progress
    validation, evidence, _ = await judge.run_validation(*stores, call)
    out: dict = {"validation": validation.model_dump(), "task_globals": task_globals or {}}
    bench_evidence = None
    if validation.passed:
        bench, bench_evidence, findings, _ = await judge.run_benchmark(*stores, call, baseline=baseline)
        out["benchmark"] = bench.model_dump()
    verdict = decide(CompileEvidence(ok=True), evidence, bench_evidence, config.gate)
    out["verdict"] = verdict.model_dump()
    return out


def run_check(
    config: LoomConfig,
    task: str,
    candidate: str,
    baseline: str | None,
    shapes: list[str] | None,
    assignments: list[str] | None = None,
) -> int:
    import orjson

    from loom_mcp.validate.taskfile import parse_task_globals

    # A shell's relative paths mean its working directory (the server refuses relative paths).
    task, candidate = os.path.abspath(task), os.path.abspath(candidate)
    baseline = os.path.abspath(baseline) if baseline else None
    try:
        task_globals = parse_task_globals(assignments or [])
        result = anyio.run(_check, config, task, candidate, baseline, shapes, task_globals)
    except LoomError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0 if result["verdict"]["verdict"] == "accept" else 1
