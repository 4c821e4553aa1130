"""The Ray executor (`[executor] kind = "ray"`): each validation or benchmark is a Ray task that
asks for one GPU plus a custom resource naming the device kind (one CPU slot on CPU-only
nodes), and runs the same sandboxed workers on the node that got it (loom_mcp.executor.ray_job).
The job's files travel with it; the evidence comes back; the ledger, git and the gate stay here.

`address`: "local" starts a private Ray instance on this machine (tests, a single box), "auto"
joins the cluster this machine belongs to, "ray://host:port" a remote one. Ray is an optional
extra (pip install 'loom-mcp[ray]'); without it this executor is a clear error at start.
A task whose worker or node is lost is retried once elsewhere by Ray; lost twice, the call fails
with INTERRUPTED and nothing is recorded as evidence.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

import anyio

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.executor.ray_job import JobFile, RemoteJob, RemoteResult

log = logging.getLogger("loom_mcp.executor")

RESOURCE_PREFIX = "loom_kind_"
# What travels with a job from a task's or candidate's directory: sources, not data.
SHIPPED_SUFFIXES = {".py", ".cu", ".cuh", ".cpp", ".cc", ".h", ".hpp", ".hip", ".json", ".toml"}
MAX_SHIPPED_BYTES = 32 << 20


def kind_resource(kind: str) -> str:
    """The Ray custom resource that names a device kind ("NVIDIA H200 / 580.x" -> a plain name)."""
    return RESOURCE_PREFIX + re.sub(r"[^A-Za-z0-9]+", "_", kind).strip("_").lower()


def ship_directory(directory: Path, as_name: str, must: list[Path]) -> list[JobFile]:
    """The source files of `directory` (not below it), under `as_name/`, and `must` wherever they
    are below it (a candidate's declared sources): a task may import its siblings."""
    chosen: dict[str, Path] = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and not path.is_symlink() and path.suffix in SHIPPED_SUFFIXES:
            chosen[path.name] = path
    for path in must:
        chosen[path.relative_to(directory).as_posix()] = path
    files, total = [], 0
    for rel, path in chosen.items():
        data = path.read_bytes()
        total += len(data)
        if total > MAX_SHIPPED_BYTES:
            raise LoomError(
                ErrorCode.RESOURCE_LIMIT,
                f"the sources beside {directory} are over {MAX_SHIPPED_BYTES >> 20} MiB: too much to send "
                "with a Ray job; keep tasks and candidates in directories of their own",
            )
        files.append(JobFile(path=f"{as_name}/{rel}", data=data))
    return files


def build_job(
    step: str,
    run_id: str,
    task: Path,
    candidate: Path,
    candidate_sources: list[Path],
    settings: dict[str, Any],
    memory_bytes: int,
    disk_bytes: int,
    baseline: Path | None = None,
) -> RemoteJob:
    """The job as it travels: the task's and candidate's directories' sources (and a baseline's),
    paths below the job's own root, and the step's plain settings."""
    files = ship_directory(task.parent, "task", [task]) + ship_directory(candidate.parent, "cand", candidate_sources)
    base = None
    if baseline is not None:
        files += ship_directory(baseline.parent, "base", [baseline])
        base = f"base/{baseline.name}"
    return RemoteJob(
        step=step,
        run_id=run_id,
        files=files,
        task=f"task/{task.name}",
        candidate=f"cand/{candidate.name}",
        baseline=base,
        settings=settings,
        memory_bytes=memory_bytes,
        disk_bytes=disk_bytes,
    )


class RayExecutor:
    """Ray, started (or joined) once per server process."""

    def __init__(self, address: str, local_resources: dict[str, float] | None = None, cpu_slots: int = 1) -> None:
        self.address = address
        self.local_resources = local_resources or {}
        self.cpu_slots = cpu_slots
        self._ray: Any = None
        self._task: Any = None
        self._owned = False  # this object started the Ray instance (and ends it)
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._ray is not None:
                return
            try:
                import ray
            except ImportError:
                raise LoomError(
                    ErrorCode.TOOLCHAIN_MISSING,
                    "[executor] kind = \"ray\" needs Ray in the server's environment: pip install 'loom-mcp[ray]'",
                ) from None
            options: dict[str, Any] = {
                "namespace": "loom",
                "ignore_reinit_error": True,
                "log_to_driver": False,  # workers' prints would reach this process's stdout: the MCP wire
                "include_dashboard": False,
                "logging_level": logging.WARNING,
            }
            self._owned = self.address == "local" and not ray.is_initialized()
            if self.address == "local":
                resources = {kind_resource(k): v for k, v in self.local_resources.items()}
                ray.init(num_cpus=max(self.cpu_slots, 1), resources=resources, **options)
            else:
                ray.init(address=self.address, **options)
            self._ray = ray
            log.info("ray executor: %s, %d node(s)", self.address, len(self.nodes()))

    def nodes(self) -> list[dict[str, Any]]:
        return [n for n in self._ray.nodes() if n.get("Alive")] if self._ray else []

    def state(self) -> dict[str, Any]:
        """Nodes and, per device kind, its slots and whether each is in use (as ExecutorState)."""
        if self._ray is None:
            return {"kind": "ray", "nodes": [], "slots": []}
        total = self._ray.cluster_resources()
        free = self._ray.available_resources()
        slots = []
        for name, count in sorted(total.items()):
            if name.startswith(RESOURCE_PREFIX):
                busy = int(round(count - free.get(name, 0.0)))
                kind = name.removeprefix(RESOURCE_PREFIX)
                slots += [{"device": f"{kind}:{i}", "busy": i < busy} for i in range(int(count))]
        nodes = [str(n.get("NodeManagerHostname") or n.get("NodeID")) for n in self.nodes()]
        return {"kind": "ray", "nodes": nodes, "slots": slots}

    async def run(self, job: RemoteJob, kind: str, gpu: bool) -> RemoteResult:
        """Run `job` on a slot of `kind` somewhere in the cluster; waits in Ray's queue while all
        are busy. A cancelled call cancels the task."""
        self.start()
        ray = self._ray
        resource = kind_resource(kind)
        if resource not in ray.cluster_resources():
            have = sorted(
                k.removeprefix(RESOURCE_PREFIX) for k in ray.cluster_resources() if k.startswith(RESOURCE_PREFIX)
            )
            raise LoomError(
                ErrorCode.DEVICE_BUSY,
                f"no device of kind {kind!r} in the Ray cluster (its loom kinds: {', '.join(have) or 'none'}); "
                f"start each node with --resources '{{\"{resource}\": <devices>}}'",
            )
        if self._task is None:
            from loom_mcp.executor.ray_job import run_remote

            self._task = ray.remote(run_remote)
        task = self._task.options(
            num_cpus=0 if gpu else 1,
            num_gpus=1 if gpu else 0,
            resources={resource: 1},
            max_retries=1,  # a lost worker or node: once more, elsewhere if Ray can
            retry_exceptions=False,  # the job's own failure is its answer
            name=f"loom {job.step} {job.run_id}",
        )
        ref = task.remote(job.model_dump(mode="json"))
        try:
            raw = await anyio.to_thread.run_sync(ray.get, ref, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            ray.cancel(ref, force=True)
            raise
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, LoomError):
                raise cause from None
            raise LoomError(ErrorCode.INTERNAL, f"the Ray job failed: {str(exc)[:800]}") from None
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.OwnerDiedError) as exc:
            raise LoomError(
                ErrorCode.INTERRUPTED,
                f"the {job.step} job {job.run_id} was lost twice with its worker or node "
                f"({type(exc).__name__}); nothing was recorded, call again",
            ) from None
        return RemoteResult.model_validate(raw)

    def shutdown(self) -> None:
        with self._lock:
            if self._ray is not None and self._owned:
                self._ray.shutdown()
            self._ray = None
