"""Run one trace analysis in a child process with a memory and a wall-time bound.

The server analyses agent-supplied files. The readers stream and enforce the nesting and
inflation limits themselves (`jsonstream.GuardedReader`), but what an analysis costs in the end
(a million unique kernel names, one 3 GB string, a SQLite file built to be slow, a bug) is only
bounded for sure by the operating system. So `analyze_trace_cached` runs `analyze_trace_file` in
a child process of our own code (not the candidate sandbox: nothing untrusted is executed, only
parsed) with RLIMIT_AS = `memory_bytes` and a `timeout_s` wall clock; whatever the trace does,
the server loses at most that child and keeps answering. The child writes the artifacts and
`summary.json` into the output directory; the parent reads them back.

Used as a module: `python -P -m loom_mcp.traces.isolate` reads one JSON request on stdin and
prints one result line, `LOOM_RESULT {...}`, on stdout.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.traces.limits import ENV, TraceLimits, human_bytes
from loom_mcp.traces.secrets import scrub_text

log = logging.getLogger(__name__)

RESULT_PREFIX = "LOOM_RESULT "
# Analyses running at once, server-wide: each may use up to `memory_bytes`.
MAX_CONCURRENT = 2
_SLOTS = threading.BoundedSemaphore(MAX_CONCURRENT)
_PKG_PARENT = str(Path(__file__).resolve().parents[2])


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_PARENT, env.get("PYTHONPATH", "")) if p)
    # One thread per BLAS/OpenMP pool: each would otherwise reserve address space per core,
    # which counts against RLIMIT_AS on a many-core host.
    for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[k] = "1"
    env["MALLOC_ARENA_MAX"] = "2"
    env["MPLBACKEND"] = "Agg"
    return env


def analyze_isolated(
    trace: Path,
    *,
    baseline: Path | None,
    top_k: int,
    out_dir: Path,
    limits: TraceLimits | None = None,
) -> dict[str, Any]:
    """`analyze_trace_file(trace, baseline=..., top_k=..., out_dir=out_dir)` in a bounded child.

    Returns the child's report (peak RSS); raises LoomError, `[BAD_INPUT]` naming the limit
    when the trace hit one."""
    limits = limits or TraceLimits.from_env()
    name = scrub_text(Path(trace).name)
    request = json.dumps(
        {
            "trace": str(trace),
            "baseline": str(baseline) if baseline is not None else None,
            "top_k": top_k,
            "out_dir": str(out_dir),
            "limits": limits.to_dict(),
        }
    )
    cmd = [sys.executable]
    if sys.version_info >= (3, 11):
        cmd.append("-P")  # the working directory never lands on sys.path
    cmd += ["-m", "loom_mcp.traces.isolate"]
    with _SLOTS:
        try:
            proc = subprocess.run(
                cmd,
                input=request,
                capture_output=True,
                text=True,
                timeout=limits.timeout_s,
                env=_child_env(),
                cwd=str(Path(out_dir).parent),
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"{name}: analysis exceeded the wall-time limit of {limits.timeout_s:g} s "
                f"({ENV['timeout_s']}) and was stopped",
            ) from exc
    result = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            try:
                result = json.loads(line[len(RESULT_PREFIX) :])
            except ValueError:
                result = None
            break
    if proc.stderr.strip():
        log.warning("trace analysis child (rc %s): %s", proc.returncode, scrub_text(proc.stderr[-4000:]))
    if result is not None and result.get("ok"):
        return result
    if result is not None:
        try:
            code = ErrorCode(result.get("code"))
        except ValueError:
            code = ErrorCode.INTERNAL
        raise LoomError(code, scrub_text(str(result.get("message", "analysis failed"))))
    if proc.returncode < 0:
        try:
            sig = signal.Signals(-proc.returncode).name
        except ValueError:
            sig = str(-proc.returncode)
        raise LoomError(
            ErrorCode.BAD_INPUT,
            f"{name}: the analysis process died ({sig}); the trace needs more than the memory "
            f"limit of {human_bytes(limits.memory_bytes)} ({ENV['memory_bytes']}) or is malformed",
        )
    raise LoomError(
        ErrorCode.INTERNAL,
        f"{name}: trace analysis failed unexpectedly (exit {proc.returncode}); the server log has details",
    )


# --- child side ---------------------------------------------------------------------------


def _set_limits(limits: TraceLimits) -> None:
    import resource

    def lower(which: int, value: int) -> None:
        soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))

    lower(resource.RLIMIT_AS, int(limits.memory_bytes))
    lower(resource.RLIMIT_CORE, 0)
    # CPU seconds as a backstop should the parent be gone and its wall clock with it.
    lower(resource.RLIMIT_CPU, int(limits.timeout_s) + 30)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the server
        except (OSError, AttributeError):
            pass


def _child_main() -> int:
    import resource

    req = json.loads(sys.stdin.read())
    limits = TraceLimits(**req["limits"])
    _set_limits(limits)
    trace = Path(req["trace"])
    name = scrub_text(trace.name)

    def report(**kw: Any) -> None:
        kw["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        sys.stdout.write(RESULT_PREFIX + json.dumps(kw) + "\n")
        sys.stdout.flush()

    try:
        from loom_mcp.traces.api import analyze_trace_file
        from loom_mcp.traces.limits import use_limits

        with use_limits(limits):
            analyze_trace_file(
                trace,
                baseline=Path(req["baseline"]) if req["baseline"] else None,
                top_k=int(req["top_k"]),
                out_dir=Path(req["out_dir"]),
            )
    except LoomError as exc:
        report(ok=False, code=exc.code.value, message=scrub_text(exc.message))
        return 0
    except (MemoryError, RecursionError) as exc:
        if isinstance(exc, MemoryError):
            limit = f"{human_bytes(limits.memory_bytes)} ({ENV['memory_bytes']})"
            why = f"analysis needs more than the memory limit of {limit}"
        else:
            why = f"trace structure nests too deeply to analyse ({ENV['max_depth']})"
        report(ok=False, code=ErrorCode.BAD_INPUT.value, message=f"{name}: {why}")
        return 0
    except Exception as exc:  # a bug, or input no check foresaw: the parent logs stderr
        import traceback

        traceback.print_exc()
        report(
            ok=False,
            code=ErrorCode.INTERNAL.value,
            message=f"{name}: trace analysis failed unexpectedly ({type(exc).__name__}); the server log has details",
        )
        return 0
    report(ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
