"""profile: run a workload under a profiler in the sandbox, scrub and store the trace, headline it.

torch.profiler runs inside a worker (a task's Model or a candidate, or a Python script);
rocprofv3 and nsys wrap an arbitrary command when they are installed. Stored traces have their
environment/metadata blocks removed first (public traces have leaked tokens that way).
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from loom_mcp.config import LoomConfig
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.models import HeadlineOp, ProfileResult
from loom_mcp.placement import job_placement
from loom_mcp.sandbox import JobSpec, policy, run_job, safefs
from loom_mcp.sandbox.runner import Progress
from loom_mcp.store import ArtifactStore, Ledger, new_run_id
from loom_mcp.traces import analyze_trace_cached, scrub_trace

Profiler = Literal["torch", "rocprofv3", "nsys"]

# A raw trace copied out of a job directory: the largest real ones are about 1 GB.
MAX_TRACE_FILE_BYTES = 4 << 30


async def _torch_trace(
    job_dir: Path, *, workload: dict[str, Any], device: str, timeout_s: float, progress: Progress | None
) -> str:
    """Run the workload (the profile_torch worker's request, less the trace file and the device)
    under torch.profiler; the trace's name inside `job_dir`."""
    trace = job_dir / "trace.json"
    device, env, visible = job_placement(device)
    files = [workload[name] for name in ("task", "candidate", "script") if workload[name]]
    job = await run_job(
        JobSpec(
            argv=[sys.executable, "-m", "loom_mcp.worker.profile_torch"],
            job_dir=job_dir,
            env=env,
            visible_devices=visible,
            readable=[Path(p).parent for p in files],  # they import siblings
            timeout_s=timeout_s,
            request={"trace_file": str(trace), **workload, "device": device},
        ),
        on_progress=progress,
    )
    report = job.report  # the workload is candidate code, which could send anything
    if report is None:
        raise LoomError(ErrorCode.WORKER_CRASHED, f"the profiled workload {job.failure()}")
    if report["error"]:
        code = ErrorCode.BAD_INPUT if "unknown shape" in report["error"] else ErrorCode.WORKER_CRASHED
        raise LoomError(code, "the profiled workload failed: " + report["error"])
    return trace.name


async def _vendor_trace(job_dir: Path, profiler: str, command: list[str], timeout_s, progress) -> str:
    """Run `command` under a vendor profiler; its output's name inside `job_dir`."""
    tool = shutil.which(profiler)
    if tool is None:
        raise LoomError(
            ErrorCode.TOOLCHAIN_MISSING,
            f"{profiler} is not on PATH here; use profiler='torch' or install "
            f"{'ROCm (rocprofiler-sdk)' if profiler == 'rocprofv3' else 'Nsight Systems'}",
        )
    out = job_dir / "profile"
    if profiler == "rocprofv3":
        argv = [
            tool,
            "--kernel-trace",
            "--memory-copy-trace",
            "--output-format",
            "json",
            "-d",
            str(out),
            "-o",
            "trace",
            "--",
            *command,
        ]
    else:
        argv = [
            tool,
            "profile",
            "--trace=cuda,nvtx,osrt",
            "--force-overwrite=true",
            "--export=sqlite",
            "-o",
            str(out / "trace"),
            *command,
        ]
    out.mkdir(parents=True, exist_ok=True)
    # A vendor profiler around the agent's own command, sandboxed like benchmark_command: the
    # allowed roots and the profiler's install tree read-only, its config and temp files in the
    # job's private HOME and /tmp, LOOM_HOME and the real HOME out of sight.
    tool_root = Path(os.path.realpath(tool)).parent.parent
    job = await run_job(
        JobSpec(argv=argv, job_dir=job_dir, timeout_s=timeout_s, readable=[*policy.current().trusted_roots, tool_root]),
        on_progress=progress,
    )
    if not job.ok:
        raise LoomError(ErrorCode.WORKER_CRASHED, f"{profiler} {job.failure()}")
    suffix = ".json" if profiler == "rocprofv3" else ".sqlite"
    # Regular files only, found without following links (the command could have planted some).
    found = safefs.find_files(job_dir, out.name, suffix=suffix)
    if not found:
        raise LoomError(ErrorCode.WORKER_CRASHED, f"{profiler} wrote no *{suffix} output under {out}")
    return found[0][0]


async def profile_workload(
    config: LoomConfig,
    ledger: Ledger,
    artifacts: ArtifactStore,
    *,
    profiler: Profiler,
    task: Path | None,
    candidate: Path | None,
    shape: str | None,
    script: Path | None,
    args: list[str],
    command: list[str] | None,
    warmup: int,
    active: int,
    device: str,
    campaign_id: str | None,
    progress: Progress | None,
) -> ProfileResult:
    """The job runs in its own directory under config.jobs_dir, for at most config.job_timeout_s."""
    started = time.monotonic()
    trace_id = new_run_id("trace")
    job_dir = config.jobs_dir / trace_id
    job_dir.mkdir(parents=True, exist_ok=True)
    if profiler == "torch":
        if task is None and script is None:
            raise LoomError(ErrorCode.BAD_INPUT, "profiler='torch' needs task= (optionally candidate=) or script=")
        workload = {
            "task": str(task) if task else None,
            "candidate": str(candidate) if candidate else None,
            "shape": shape,
            "script": str(script) if script else None,
            "args": args,
            "warmup": warmup,
            "active": active,
        }
        raw_name = await _torch_trace(
            job_dir, workload=workload, device=device, timeout_s=config.job_timeout_s, progress=progress
        )
    else:
        if not command:
            raise LoomError(ErrorCode.BAD_INPUT, f"profiler='{profiler}' needs command=[...] to run")
        raw_name = await _vendor_trace(job_dir, profiler, command, config.job_timeout_s, progress)
    if progress:
        await progress("scrubbing and storing the trace")
    suffix = Path(raw_name).suffix
    # The job directory is the job's: anything there may be a link, a FIFO or a hard link to a
    # file of the server's. The trace is copied out once (regular file, no link followed, size
    # capped) into a private directory of the server's, and scrubbed and read only there.
    staging = Path(tempfile.mkdtemp(prefix="profile-", dir=_staging_root(config.cache_dir)))
    try:
        raw = staging / ("raw" + suffix)
        scrubbed = staging / ("scrubbed" + suffix)
        safefs.copy_out(job_dir, raw_name, raw, max_bytes=MAX_TRACE_FILE_BYTES)
        report = scrub_trace(raw, scrubbed)
        data = scrubbed.read_bytes()
        if suffix == ".json":
            data = gzip.compress(data, compresslevel=6)
        sha = artifacts.put_bytes(
            data, kind=f"trace-{profiler}", name=f"{trace_id}{suffix}{'.gz' if suffix == '.json' else ''}"
        )
        analysis = analyze_trace_cached(
            artifact_path_with_suffix(artifacts, sha, suffix), top_k=5, cache_root=config.cache_dir / "traces"
        )
        tl = analysis.timeline
        # Without GPU activity the analysis ranks host ops, as analyze_trace shows them.
        top_ops = [HeadlineOp(name=o.name[:120], us=o.us, pct=o.pct) for o in analysis.top_ops[:5]]
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    result = ProfileResult(
        trace_id=trace_id,
        profiler=profiler,
        device=analysis.device,
        trace_bytes=len(data),
        scrubbed=report.removed_blocks,
        gpu_busy_pct=tl.busy_pct if tl.gpu_events else None,
        total_us=tl.total_us if tl.gpu_events else None,
        top_ops=top_ops,
        seconds=round(time.monotonic() - started, 3),
        next_step=f"analyze_trace(trace='{trace_id}') for the breakdown, roofline and ranked findings",
    )
    ledger.insert_run(trace_id, "trace", sha, result.model_dump(), campaign_id)
    return result


def _staging_root(cache_dir: Path) -> Path:
    """Where the server copies a job's output to work on it: under its own cache, which no job
    may write (a job writes its directory and only its own compile cache, cache/triton/<hash>)."""
    root = cache_dir / "staging"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return root


def artifact_path_with_suffix(artifacts: ArtifactStore, sha: str, suffix: str) -> Path:
    """Readers pick the format by file name: expose the stored blob under a named hard link."""
    blob = artifacts.path_for(sha)
    name = {".json": "trace.json.gz", ".sqlite": "trace.sqlite"}.get(suffix, "trace" + suffix)
    named = blob.parent / f"{sha}.{name}"
    if not named.exists():
        try:
            named.hardlink_to(blob)
        except OSError:
            shutil.copyfile(blob, named)
    return named
