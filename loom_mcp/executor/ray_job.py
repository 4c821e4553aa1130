"""One judge job (a validation or a benchmark) as it runs inside a Ray task, on whichever node
Ray gave it: the job's files are unpacked into a private directory there, the sandbox is pointed
at it, and the same domain functions as a local run (validate_candidate, benchmark_candidate)
start the same sandboxed workers. Only the evidence goes back to the server, which keeps the
ledger, git and the gate.

Runs in a Ray worker process: no MCP, no server state, and no torch (the jobs' own workers
import it).
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path, PurePosixPath
from types import SimpleNamespace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class JobFile(BaseModel):
    """A file the job needs, by its path below the job's own root (`task/task.py`, ...)."""

    model_config = ConfigDict(extra="forbid")
    path: str
    data: bytes


class RemoteJob(BaseModel):
    """What the server sends: which step, its files, and the step's settings."""

    model_config = ConfigDict(extra="forbid")
    step: str = Field(pattern="^(validate|benchmark)$")
    run_id: str
    files: list[JobFile]
    task: str  # paths below the job's root
    candidate: str
    baseline: str | None = None
    settings: dict[str, Any]  # the step's keyword arguments that are plain data
    memory_bytes: int
    disk_bytes: int


class RemoteResult(BaseModel):
    """What comes back: the evidence (and a benchmark's findings), and where it ran."""

    model_config = ConfigDict(extra="forbid")
    evidence: dict[str, Any]
    findings: list[dict[str, Any]] = Field(default_factory=list)
    node: str
    device: str  # the torch device the job ran on there
    device_info: dict[str, Any] | None = None  # its DeviceInfo, probed there
    software: str = ""
    started_at: float = 0.0  # epoch seconds the job began on its node
    clocks_before: dict[str, Any] | None = None
    clocks_after: dict[str, Any] | None = None


def _unpack(root: Path, files: list[JobFile]) -> None:
    for f in files:
        rel = PurePosixPath(f.path)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise ValueError(f"bad job file path {f.path!r}")
        target = root.joinpath(*rel.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(f.data)


def _device() -> str:
    """The GPU Ray gave this task (its physical index, as NVML counts), or the CPU."""
    import ray

    ids = ray.get_gpu_ids()
    return f"cuda:{int(ids[0])}" if ids else "cpu"


def _sampler(info: dict[str, Any] | None):
    """Clock samples of the job's GPU, taken here where it is (throttled samples are dropped)."""
    if not info or info.get("vendor") not in ("nvidia", "amd"):
        return None
    index = int(info["index"])
    if info["vendor"] == "nvidia":
        from loom_mcp.devices.nvidia import sample_clocks

        return lambda: sample_clocks(index)
    from loom_mcp.devices.amd import sample_clocks_amd

    return lambda: sample_clocks_amd(index)


def _device_info(device: str) -> dict[str, Any] | None:
    from loom_mcp.devices import probe_devices

    found = probe_devices()[0]
    index = int(device[5:]) if device.startswith("cuda:") else None
    for d in found:
        if (index is None and d.vendor == "cpu") or (index is not None and d.vendor != "cpu" and d.index == index):
            return d.model_dump(mode="json")
    return None


def _software() -> str:
    """The versions the job's workers import here (read without importing torch)."""
    from importlib.metadata import PackageNotFoundError, version

    from loom_mcp import __version__

    def of(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return f"torch {of('torch')}; triton {of('triton')}; loom-mcp {__version__}"


def run_job(job: RemoteJob) -> RemoteResult:
    import time

    import anyio

    started_at = time.time()

    from loom_mcp.sandbox import policy

    root = Path(tempfile.mkdtemp(prefix=f"loom-ray-{job.run_id}-"))
    files, home = root / "files", root / "home"
    try:
        _unpack(files, job.files)
        (home / "jobs").mkdir(parents=True)
        policy.configure(
            SimpleNamespace(
                job_memory_bytes=job.memory_bytes,
                job_disk_bytes=job.disk_bytes,
                allowed_roots=[str(files)],
                home=str(home),
            )
        )
        device = _device()
        info = _device_info(device)  # probed once: the record and the clock samples
        job_dir = home / "jobs" / job.run_id
        task, candidate = files / job.task, files / job.candidate
        if job.step == "validate":
            from loom_mcp.validate.runner import validate_candidate

            async def validate():
                return await validate_candidate(
                    task=task, candidate=candidate, job_dir=job_dir, device=device, keep_warm=False, **job.settings
                )

            evidence = anyio.run(validate)
            return RemoteResult(
                evidence=evidence.model_dump(mode="json"),
                node=socket.gethostname(),
                device=device,
                device_info=info,
                software=_software(),
                started_at=started_at,
            )
        from loom_mcp.bench.runner import benchmark_candidate
        from loom_mcp.judge_models import GateConfig
        from loom_mcp.models import DevicePeak

        settings = dict(job.settings)
        gate = GateConfig.model_validate(settings.pop("gate"))
        peak = settings.pop("peak")
        sampler = _sampler(info)
        before = sampler() if sampler else None

        async def benchmark():
            return await benchmark_candidate(
                task=task,
                candidate=candidate,
                baseline=files / job.baseline if job.baseline else None,
                job_dir=job_dir,
                device=device,
                gate=gate,
                peak=DevicePeak.model_validate(peak) if peak else None,
                clock_sampler=sampler,
                keep_warm=False,
                **settings,
            )

        bench_evidence, findings = anyio.run(benchmark)
        after = sampler() if sampler else None
        return RemoteResult(
            evidence=bench_evidence.model_dump(mode="json"),
            findings=[f.model_dump(mode="json") for f in findings],
            node=socket.gethostname(),
            device=device,
            device_info=info,
            software=_software(),
            started_at=started_at,
            clocks_before=before,
            clocks_after=after,
        )
    finally:
        policy.reset()
        shutil.rmtree(root, ignore_errors=True)


def run_remote(job: dict[str, Any]) -> dict[str, Any]:
    """The Ray task's entry point: plain data in and out (the server validates both ends)."""
    return run_job(RemoteJob.model_validate(job)).model_dump(mode="json")
