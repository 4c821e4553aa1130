"""Where a worker process's start-up time goes on this machine: bare interpreter, `import torch`,
device initialisation, and the same worker inside loom's sandbox (namespaces, read-only mounts).

    python benchmarks/probe_startup.py [--reps 3]     # prints one line per variant, medians in seconds
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "python -c pass": "pass",
    "import torch": "import torch",
    "import torch + device init": (
        "import torch\n"
        "if torch.cuda.is_available():\n"
        "    torch.zeros(1, device='cuda'); torch.cuda.synchronize()"),
    "+ import triton": (
        "import torch, triton, triton.language\n"
        "if torch.cuda.is_available():\n"
        "    torch.zeros(1, device='cuda'); torch.cuda.synchronize()"),
}


def bare(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t0


async def sandboxed(code: str, job_dir: Path) -> float:
    from loom_mcp.sandbox import JobSpec, run_job

    t0 = time.perf_counter()
    result = await run_job(JobSpec(argv=[sys.executable, "-c", code], job_dir=job_dir, timeout_s=120))
    if not result.ok:
        raise RuntimeError(result.failure())
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, code in VARIANTS.items():
            plain = [bare(code) for _ in range(args.reps)]
            boxed = [asyncio.run(sandboxed(code, Path(tmp) / f"j{i}")) for i in range(args.reps)]
            print(f"{name:28s} bare {statistics.median(plain):6.2f} s   sandboxed "
                  f"{statistics.median(boxed):6.2f} s   (min {min(plain):.2f} / {min(boxed):.2f})",
                  flush=True)


if __name__ == "__main__":
    main()
