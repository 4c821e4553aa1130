"""compile_kernel: Triton, CUDA (nvcc) and HIP (hipcc) in the sandbox, cached by content hash."""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path
from typing import Literal

import orjson

from loom_mcp.compile.reports import (
    estimate_occupancy,
    parse_amd_resource_usage,
    parse_diagnostics,
    parse_ptxas,
)
from loom_mcp.config import LoomConfig
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.models import CompileDiagnostic, CompileResult, KernelResources, Toolchain
from loom_mcp.placement import job_placement
from loom_mcp.sandbox import JobSpec, code_cache, code_cache_env, policy, run_job, safefs
from loom_mcp.sandbox.runner import Progress, limit_error
from loom_mcp.sandbox.sources import code_files
from loom_mcp.store import ArtifactStore, new_run_id

Language = Literal["triton", "cuda", "hip"]
CACHE_VERSION = "1"
MAX_OBJECT_BYTES = 512 << 20  # a compiled object read back from the job directory


# KernelResources field -> the triton compile worker's key for it, per compiled specialization.
_WORKER_KEYS = {
    "registers": "registers",
    "spill_stores_bytes": "spills",
    "shared_memory_bytes": "shared",
    "num_warps": "num_warps",
    "num_stages": "num_stages",
}


def cache_key(*parts: str | bytes) -> str:
    h = hashlib.sha256(CACHE_VERSION.encode())
    for part in parts:
        h.update(b"\0")
        h.update(part if isinstance(part, bytes) else part.encode())
    return h.hexdigest()


def _compiled(
    ok: bool,
    language: Language,
    target: str,
    compiler: str,
    kernels: list[KernelResources],
    diagnostics: list[CompileDiagnostic],
    **details: str | None,
) -> CompileResult:
    """A result compiled just now (not from the cache); compile_source fills in its seconds."""
    if ok:
        next_step = "run_validation(task, candidate) to check correctness"
    else:
        next_step = "fix the errors at the file:line given, then compile_kernel again"
    return CompileResult(
        ok=ok,
        language=language,
        target=target,
        cached=False,
        compiler=compiler,
        kernels=kernels,
        diagnostics=diagnostics,
        seconds=0.0,
        next_step=next_step,
        **details,
    )


async def compile_source(
    config: LoomConfig,
    artifacts: ArtifactStore,
    toolchain: Toolchain,
    *,
    source: Path,
    language: Language,
    target: str | None,
    flags: list[str],
    task: Path | None,
    device: str,
    progress: Progress | None = None,
    task_globals: dict | None = None,
) -> CompileResult:
    """Compiles in a job of its own under config.jobs_dir; the result is cached in config.cache_dir."""
    job_dir = config.jobs_dir / new_run_id("compile")
    timeout_s = config.job_timeout_s
    started = time.perf_counter()
    data = safefs.read_resolved_bytes(source)  # resolved and checked by the caller
    if language == "triton":
        compiler = f"triton {toolchain.triton or 'unknown'}"
        effective_target = target or ("interpreter" if device == "cpu" else device)
        extra = safefs.read_resolved_bytes(task) if task else b""
        if task_globals:  # they size the shape the kernels are specialized on
            extra += orjson.dumps(task_globals, option=orjson.OPT_SORT_KEYS)
    else:
        # The toolchain probe (cached) already located the compiler and read its version.
        tool = "nvcc" if language == "cuda" else "hipcc"
        status = next((t for t in toolchain.tools if t.name == tool and t.found and t.path), None)
        if status is None:
            raise LoomError(
                ErrorCode.TOOLCHAIN_MISSING,
                f"{tool} not found; install the {'CUDA' if tool == 'nvcc' else 'ROCm'} toolkit "
                "or compile on a machine that has it (after installing, device_info(refresh=true))",
            )
        compiler = f"{tool} {status.version or 'unknown'}"
        effective_target = target or ("sm_90" if language == "cuda" else "gfx942")
        extra = b""
    key = cache_key(language, compiler, effective_target, " ".join(flags), data, extra)
    cached_file = config.cache_dir / "compile" / f"{key}.json"
    if cached_file.is_file():
        result = CompileResult.model_validate_json(cached_file.read_bytes())
        result.cached = True
        result.seconds = time.perf_counter() - started
        return result

    job_dir.mkdir(parents=True, exist_ok=True)
    if language == "triton":
        result = await _compile_triton(
            source, task, device, job_dir, timeout_s, compiler, effective_target, progress, task_globals
        )
    else:
        assert status is not None  # found above for every language but triton
        result = await _compile_native(
            source, language, status.path, effective_target, flags, job_dir, timeout_s, compiler, artifacts, progress
        )
    result.seconds = time.perf_counter() - started
    if result.ok or result.diagnostics:  # never cache a timeout or a crash
        cached_file.parent.mkdir(parents=True, exist_ok=True)
        cached_file.write_bytes(orjson.dumps(result.model_dump()))
    return result


async def _compile_native(
    source, language, tool_path, target, flags, job_dir, timeout_s, compiler, artifacts, progress
) -> CompileResult:
    obj = job_dir / "kernel.o"
    if language == "cuda":
        argv = [tool_path, "-c", f"-arch={target}", "-Xptxas", "-v", "-lineinfo", *flags, str(source), "-o", str(obj)]
    else:
        argv = [
            tool_path,
            "-c",
            f"--offload-arch={target}",
            "-Rpass-analysis=kernel-resource-usage",
            *flags,
            str(source),
            "-o",
            str(obj),
        ]
    # The agent's own source and headers (its allowed roots), nothing else of the host: an
    # #include of /etc/shadow or of the ledger would come back in the diagnostics.
    job = await run_job(
        JobSpec(
            argv=argv, job_dir=job_dir, timeout_s=timeout_s, readable=[source.parent, *policy.current().trusted_roots]
        ),
        on_progress=progress,
    )
    text = job.stdout_tail + "\n" + job.stderr_tail
    if (over := limit_error(job, compiler)) is not None:
        raise over
    if job.timed_out:
        raise LoomError(ErrorCode.TIMEOUT, f"{compiler} did not finish in {timeout_s:.0f} s")
    diagnostics = parse_diagnostics(text, source)
    # kernel.o is the job's: a link or FIFO there must not be read (and stored) by the server.
    ok = job.returncode == 0 and safefs.is_file(job_dir, obj.name)
    if not ok and not any(d.severity == "error" for d in diagnostics):
        diagnostics.append(
            CompileDiagnostic(
                severity="error", message=text.strip()[-1500:] or f"{compiler} exited with {job.returncode}"
            )
        )
    kernels: list[KernelResources] = []
    if ok:
        kernels = parse_ptxas(text) if language == "cuda" else parse_amd_resource_usage(text)
        for k in kernels:
            estimate_occupancy(k, target, None)
    artifact_id = None
    if ok:
        data = safefs.read_bytes(job_dir, obj.name, MAX_OBJECT_BYTES)
        artifact_id = artifacts.put_bytes(data, kind=f"{language}-object", name=obj.name)
    return _compiled(ok, language, target, compiler, kernels, diagnostics, artifact_id=artifact_id)


async def _compile_triton(
    source, task, device, job_dir, timeout_s, compiler, target, progress, task_globals=None
) -> CompileResult:
    device, env, visible = job_placement(device)
    cache = code_cache(job_dir, Path(source))
    job = await run_job(
        JobSpec(
            argv=[sys.executable, "-m", "loom_mcp.worker.triton_compile"],
            job_dir=job_dir,
            env={**env, **code_cache_env(cache)},
            writable=[cache],
            # the candidate and the sources it declares, and the task file alone: the candidate's
            # code runs here, and nothing else of either directory may reach it (or its cache)
            readable=[*code_files(Path(source)), *([task] if task else [])],
            visible_devices=visible,
            timeout_s=timeout_s,
            request={
                "source": str(source),
                "task": str(task) if task else None,
                "device": device,
                "task_globals": task_globals or {},
            },
        ),
        on_progress=progress,
    )
    if (over := limit_error(job, f"compiling {source.name}")) is not None:
        raise over
    if job.timed_out:
        raise LoomError(ErrorCode.TIMEOUT, f"compiling {source.name} did not finish in {timeout_s:.0f} s")
    report = job.report  # the worker imports the candidate, which could send anything
    if report is None:
        raise LoomError(
            ErrorCode.WORKER_CRASHED,
            f"the compile worker died ({job.signal or job.returncode}): {job.stderr_tail[-800:]}",
        )
    if report.get("task_error"):
        raise LoomError(
            ErrorCode.BAD_INPUT,
            f"the task failed before the candidate ran (building "
            f"inputs for its first shape): {report['task_error']}; fix the task",
        )
    diagnostics: list[CompileDiagnostic] = []
    if report["error"]:
        diagnostics.append(
            CompileDiagnostic(
                severity="error", message=report["error"], file=report["error_file"], line=report["error_line"]
            )
        )
    kernels: list[KernelResources] = []
    for k in report["kernels"]:
        if not k["compiled"]:
            kernels.append(KernelResources(name=k["name"]))
        for c in k["compiled"]:
            item = KernelResources(name=k["name"], **{field: c[key] for field, key in _WORKER_KEYS.items()})
            estimate_occupancy(item, target if str(target).startswith("sm_") else "sm_90", c["num_warps"])
            kernels.append(item)
    note = None
    if report["interpreted"]:
        note = (
            "no GPU: kernels ran in Triton's interpreter (errors are real; no registers or "
            "occupancy without machine code)"
        )
    elif not report["ran_task"]:
        note = "pass task= so the kernels are specialized on real arguments and compiled"
    if not kernels and not report["error"]:
        note = (note + "; " if note else "") + "no @triton.jit kernels found in the file"
    return _compiled(report["error"] is None, "triton", target, compiler, kernels, diagnostics, note=note)
