#!/usr/bin/env python3
"""A vs A on CPU: how often the gate accepts a candidate identical to its baseline.

    python benchmarks/cpu_bias.py [--tries 20] [--out DIR] [--gate 'wall_clock_max_blocks = 6' ...]

Times a softmax task against itself `tries` times through the judge (judge.run_benchmark, then
gate.decide with accept_wall_clock = true, as submit_candidate would), and prints each try's
verdict, geomean CI and per-block speedups, then how many were accepted. An honest interval
accepts at most 1 in 20. Writes cpu_bias.json to --out (default $OUT or .).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

# Same code in both arms: the task's Model is the baseline, the candidate's ModelNew is a copy.
SOFTMAX_TASK = '''
import torch
SHAPES = [{"name": "rows256_d1024", "rows": 256, "dim": 1024},
          {"name": "rows64_d4096", "rows": 64, "dim": 4096}]


class Model(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


def get_inputs(rows=256, dim=1024):
    return [torch.randn(rows, dim)]


def get_init_inputs(rows=256, dim=1024):
    return []
'''
SAME_AS_BASELINE = '''
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)
'''


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--gate", action="append", default=[],
                        help="an extra [gate] line of loom.toml, e.g. 'wall_clock_blocks = 6'")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    from loom_mcp import judge
    from loom_mcp.config import load_config
    from loom_mcp.gate import decide
    from loom_mcp.judge_models import CompileEvidence
    from loom_mcp.runtime import open_services

    work = Path(tempfile.mkdtemp(prefix="loom-cpu-bias-"))
    (work / "home").mkdir()
    (work / "home" / "loom.toml").write_text(
        "[gate]\naccept_wall_clock = true\n" + "".join(f"{line}\n" for line in args.gate))
    task = work / "softmax_task.py"
    task.write_text(SOFTMAX_TASK)
    candidate = work / "same_as_baseline.py"
    candidate.write_text(SAME_AS_BASELINE)
    config = load_config(work / "home", environ={"LOOM_ALLOWED_ROOTS": str(work)})
    services = open_services(config)
    _, validation, _ = await judge.run_validation(
        config, services.ledger, services.artifacts, task=str(task), candidate=str(candidate),
        seeds=None, shapes=None, campaign_id=None, progress=None)
    if not validation.passed:
        print("the candidate did not validate: nothing to time", file=sys.stderr)
        return 1
    tries: list[dict] = []
    for i in range(args.tries):
        result, evidence, _, _ = await judge.run_benchmark(
            config, services.ledger, services.artifacts, task=str(task), candidate=str(candidate),
            baseline=None, shapes=None, campaign_id=None, progress=None)
        verdict = decide(CompileEvidence(ok=True), validation, evidence, config.gate)
        g = evidence.geomean
        assert g is not None
        tries.append({
            "verdict": verdict.verdict, "reason_codes": verdict.reason_codes,
            "geomean": g.estimate, "ci": [g.ci_low, g.ci_high], "method": g.method,
            "blocks": evidence.blocks, "block_geomeans": evidence.block_geomeans,
            "shapes": {s.name: {"speedup": s.ratio.estimate, "ci": [s.ratio.ci_low, s.ratio.ci_high],
                                "block_ratios": s.block_ratios} for s in evidence.shapes},
            "seconds": result.seconds})
        blocks = ", ".join(f"{r:.3f}" for r in evidence.block_geomeans or [])
        print(f"try {i + 1}: {verdict.verdict:12s} {g.estimate:.3f} [{g.ci_low:.3f}, {g.ci_high:.3f}] "
              f"{evidence.blocks} blocks ({blocks}) {result.seconds:.0f} s", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        summary = {"tries": len(tries), "accepted": sum(t["verdict"] == "accept" for t in tries),
                   "gate": config.gate.model_dump(include={
                       "min_gain", "ci_level", "wall_clock_blocks", "wall_clock_max_blocks",
                       "wall_clock_ci_target", "wall_clock_block_time_s", "min_time_s"}),
                   "runs": tries}
        (args.out / "cpu_bias.json").write_text(json.dumps(summary, indent=1))
    accepted = sum(t["verdict"] == "accept" for t in tries)
    print(f"A vs A accepted {accepted} of {len(tries)} (an honest interval: at most 1 in 20)")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
