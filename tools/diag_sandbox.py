#!/usr/bin/env python3
"""Run tools/diag_events.py directly and inside the sandbox, to compare event timings."""

import asyncio
import subprocess
import sys
from pathlib import Path

from loom_mcp.sandbox import JobSpec, run_job

script = str(Path(__file__).with_name("diag_events.py"))


async def main() -> None:
    print("direct:", subprocess.run([sys.executable, script], capture_output=True, text=True).stdout, flush=True)
    probe = "import os; print('affinity', len(os.sched_getaffinity(0)), 'nice', os.nice(0))"
    job = await run_job(JobSpec(argv=[sys.executable, "-c", probe], job_dir=Path("/tmp/diag0")))
    print("sandbox env:", job.stdout_tail, job.stderr_tail[-300:])
    job = await run_job(JobSpec(argv=[sys.executable, script], job_dir=Path("/tmp/diag1"), timeout_s=120))
    print("sandboxed:", job.stdout_tail, job.stderr_tail[-500:], flush=True)


asyncio.run(main())
