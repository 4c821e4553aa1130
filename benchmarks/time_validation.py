#!/usr/bin/env python3
"""Where the time of one run_validation and one benchmark goes (per sandboxed step), for a task
and candidate:  python benchmarks/time_validation.py TASK CANDIDATE [SHAPE ...]"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
import time
from pathlib import Path


async def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    from loom_mcp import judge
    from loom_mcp.config import load_config
    from loom_mcp.runtime import open_services

    task, cand, shapes = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3:] or None
    home = Path(tempfile.mkdtemp())
    config = load_config(home, environ={"LOOM_ALLOWED_ROOTS": os.pathsep.join(["/tmp", str(Path(task).resolve().parents[2])])})
    services = open_services(config)
    for attempt in range(2):
        t0 = time.perf_counter()
        result, _, _ = await judge.run_validation(config, services.ledger, services.artifacts, task=task,
                                                  candidate=cand, seeds=None, shapes=shapes,
                                                  campaign_id=None, progress=None)
        t1 = time.perf_counter()
        bench, _, _, _ = await judge.run_benchmark(config, services.ledger, services.artifacts, task=task,
                                                   candidate=cand, baseline=None, shapes=shapes,
                                                   campaign_id=None, progress=None)
        t2 = time.perf_counter()
        print(f"attempt {attempt}: validation {t1 - t0:.2f} s passed={result.passed}; benchmark {t2 - t1:.2f} s "
              f"geomean {bench.geomean_speedup:.3f} [{bench.geomean_ci_low:.3f}, {bench.geomean_ci_high:.3f}]",
              flush=True)
        for s in bench.shapes:
            print(f"   {s.name}: base {s.baseline_median_s * 1e6:.2f} us cand {s.candidate_median_s * 1e6:.2f} us "
                  f"x{s.speedup:.3f} [{s.ci_low:.3f},{s.ci_high:.3f}] pairs {s.pairs} cv {s.candidate_cv:.4f} "
                  f"roofline {s.roofline_fraction}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
