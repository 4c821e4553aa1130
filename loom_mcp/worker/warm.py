"""Entry point of a warm worker: import the worker module now, run its job once the server sends it.

    python -m loom_mcp.worker.warm loom_mcp.worker.reference

The job's request is in the usual file (LOOM_REQUEST); the line on stdin carries the secrets
that the module reads from its environment (and, for a blank worker, the rest of the job's
environment). A benchmark process is started for one role (LOOM_BENCH_ROLE), whose pid it takes
before anything is imported, as when it is started fresh. Stdin closing, or nothing arriving within
LOOM_WARM_IDLE_S seconds, ends the process without running anything.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import sys
import tempfile


def main() -> None:
    role = os.environ.get("LOOM_BENCH_ROLE")
    if role:  # a benchmark process: its pid matters to CUDA IPC (protocol.BENCH_PIDS)
        from loom_mcp.worker.protocol import take_bench_pid

        take_bench_pid(role)
    module = importlib.import_module(sys.argv[1])  # the expensive part: torch and friends
    warm_up = getattr(module, "warm_up", None)
    if callable(warm_up):  # what the module loads lazily on first use, before any job is known
        try:
            warm_up()
        except Exception as exc:  # only time lost: the job loads it again when it needs it
            print(f"loom warm worker: warm-up failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    idle_s = float(os.environ.get("LOOM_WARM_IDLE_S", "600"))
    ready, _, _ = select.select([sys.stdin], [], [], idle_s)
    line = sys.stdin.readline() if ready else ""
    if not line.strip():
        return
    os.environ.update({str(k): str(v) for k, v in json.loads(line).get("env", {}).items()})
    tempfile.tempdir = None  # a job may name its own TMPDIR: not the one seen at start-up
    from loom_mcp.worker.protocol import exit_now, mark

    mark("dispatched")
    module.main()
    exit_now()


if __name__ == "__main__":
    main()
