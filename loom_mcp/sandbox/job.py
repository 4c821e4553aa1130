"""Contracts of one sandboxed job: what to run (JobSpec) and what happened (JobResult)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from loom_mcp.fields import empty_list, optional


def code_cache(job_dir: Path, code: Path) -> Path:
    """The compile-cache directory for jobs that run `code` (a candidate or baseline file):
    shared by every job running the same bytes, so the compile step's kernels are reused by
    validation and the benchmark, and private to those bytes, so no other file's code can
    plant binaries there. `job_dir` is a top-level job directory (LOOM_HOME/jobs/<run>)."""
    from loom_mcp.sandbox.sources import code_digest

    # `code` is an agent's file, resolved and checked by the caller: read (with the sources it
    # declares) without following a link swapped in since.
    digest = code_digest(code)[:24]
    return job_dir.resolve().parent.parent / "cache" / "triton" / digest


def code_cache_env(cache: Path) -> dict[str, str]:
    """Where a job's compilers keep what they build, all inside `cache`: Triton's kernels,
    torch.utils.cpp_extension's builds (load_inline), whose default under HOME is read-only
    in the sandbox, and torch.compile's (inductor's default is under the job's private TMPDIR,
    so validation and each benchmark arm compiled the same graphs again)."""
    return {
        "TRITON_CACHE_DIR": str(cache),
        "TORCH_EXTENSIONS_DIR": str(cache / "torch_extensions"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
    }


# For the processes that run a candidate's (or a baseline's) ModelNew beside a timed arm:
# torch.compile compiles in the process itself. Its default pool of compile workers (one per
# core, each importing torch) was still starting while the other arm was timed, and an honest
# compiled candidate was rejected as busy while idle. (Not for benchmark_command's workloads.)
MODEL_JOB_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}

# For the trusted reference workers (validation's and the benchmark's input preparation, one
# warm pool): the pid it takes before importing torch (protocol.BENCH_PIDS), as CUDA IPC needs.
REFERENCE_JOB_ENV = {"LOOM_BENCH_ROLE": "reference"}


class JobSpec(BaseModel):
    """One worker process to run in the sandbox."""

    model_config = ConfigDict(extra="forbid")

    argv: list[str] = Field(min_length=1, description="Command line; argv[0] is looked up in PATH")
    job_dir: Path = Field(description="Created if missing; the worker's cwd and TMPDIR")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra variables set on purpose by the server; secret-looking names are dropped",
    )
    timeout_s: float = Field(default=600.0, gt=0)
    max_output_bytes: int = Field(
        default=1 << 20, ge=0, description="Per stream; the tail is kept, the total is counted"
    )
    max_file_bytes: int = Field(default=8 << 30, gt=0, description="RLIMIT_FSIZE")
    max_processes: int = Field(default=512, ge=1, description="Tasks (processes and threads)")
    max_memory_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Memory of the whole job (cgroup memory.max, else RLIMIT_DATA). None: the "
        "server's job_memory_bytes; 0: no limit",
    )
    max_disk_bytes: int | None = Field(
        default=None,
        ge=0,
        description="What job_dir and `writable` may grow by while the job runs (checked about "
        "once a second; the job is killed past it); also the size of its private /tmp and "
        "/dev/shm. None: the server's job_disk_bytes; 0: no quota",
    )
    visible_devices: list[int] | None = optional(
        "Physical GPU indices to expose. None leaves the server's setting; [] hides all GPUs"
    )
    allow_network: bool = False
    readonly_fs: bool = Field(
        default=True,
        description="The job sees only its allowlisted root (system, interpreter, `readable`, "
        "job_dir, `writable`) where the kernel allows it, else the host's tree read-only but for "
        "job_dir, `writable` and /dev/shm. Off: the host's tree, writable (tests only)",
    )
    readable: list[Path] = empty_list(
        "Files and directories the job may read, bound read-only at the same path: "
        "the task's and the candidate's directories (a candidate imports its siblings)"
    )
    writable: list[Path] = empty_list(
        "Directories the job may write besides job_dir (created if missing), e.g. "
        "the compile cache of the one file it runs"
    )
    shm_dir: Path | None = optional(
        "A host directory to bind at /dev/shm instead of a private tmpfs, so the "
        "processes of one benchmark share POSIX shared memory and CUDA IPC files"
    )
    request: dict[str, Any] | None = optional("JSON for the worker: job_dir/request.json, path in LOOM_REQUEST")

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not name or "=" in name or "\0" in name or "\0" in value[name]:
                raise ValueError(f"invalid environment variable {name!r}")
        return value

    @field_validator("visible_devices")
    @classmethod
    def _devices(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(i < 0 for i in value):
            raise ValueError("device indices must be >= 0")
        return value


class JobResult(BaseModel):
    """What happened to a job. A crash is a result, not an exception."""

    returncode: int | None = Field(description="Exit code; None when a signal ended the worker")
    signal: str | None = Field(description="e.g. 'SIGSEGV' when a signal ended the worker")
    timed_out: bool
    cancelled: bool = Field(
        default=False,
        description="Ended because its caller was cancelled (run_job re-raises instead)",
    )
    wall_s: float
    stdout_tail: str
    stderr_tail: str
    stdout_bytes: int = Field(description="Total written, even when the tail was truncated")
    stderr_bytes: int
    result: dict[str, Any] | list[Any] | None = Field(
        description="What the worker sent over the private result pipe; None if nothing or invalid"
    )
    result_error: str | None = optional("Why `result` is None although the worker sent something")
    marks: dict[str, float] | None = optional("Moments of the worker's life (epoch seconds) sent with its result")
    network_isolated: bool
    readonly_fs: bool = Field(
        default=False, description="The file system outside the job's writable paths was read-only"
    )
    view: Literal["allowlist", "readonly", "none"] = Field(
        default="none",
        description="What the job saw of the file system: 'allowlist' (a root of its own holding "
        "only what it needs), 'readonly' (the host's tree, read-only; the fallback), 'none'",
    )
    memory_limit: Literal["cgroup", "rlimit"] | None = optional(
        "How the job's memory was limited (cgroup memory.max or RLIMIT_DATA)"
    )
    memory_limit_bytes: int | None = None
    memory_exceeded: bool = Field(
        default=False,
        description="The job failed on its memory limit (an OOM kill in its cgroup, or an "
        "allocation refused under RLIMIT_DATA)",
    )
    disk_limit_bytes: int | None = None
    disk_exceeded: bool = Field(default=False, description="Killed because its directories grew past its disk quota")

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.cancelled and not self.disk_exceeded

    @property
    def report(self) -> dict[str, Any] | None:
        """What the worker sent, when it ended well and sent a JSON object: the workers that
        run candidate code could send anything (an array, a number) through the same pipe."""
        if self.ok and isinstance(self.result, dict) and self.result:
            return self.result
        return None

    @property
    def limit_exceeded(self) -> str | None:
        """Which resource limit ended the job, in words, or None."""
        if self.memory_exceeded:
            size = f" of {_gib(self.memory_limit_bytes)}" if self.memory_limit_bytes else ""
            return f"exceeded its memory limit{size} (job_memory_bytes in loom.toml)"
        if self.disk_exceeded:
            size = f" of {_gib(self.disk_limit_bytes)}" if self.disk_limit_bytes else ""
            return f"wrote more than its disk quota{size} (job_disk_bytes in loom.toml)"
        return None

    def timeline(self, since: float) -> str:
        """The worker's marks (epoch seconds sent with its result) as seconds since `since`."""
        if not self.marks:
            return "no marks"
        try:
            ordered = sorted((float(at), str(name)) for name, at in self.marks.items())
        except (TypeError, ValueError):
            return "unreadable marks"
        return ", ".join(f"{name} +{at - since:.2f}" for at, name in ordered)

    def failure(self) -> str:
        """Why the job did not succeed, in one line: timeout, signal, or exit code and stderr tail."""
        if self.limit_exceeded:
            return self.limit_exceeded
        if self.timed_out:
            return f"timed out after {self.wall_s:.0f} s"
        if self.signal:
            return f"died with {self.signal}"
        if self.ok and self.result is not None and not isinstance(self.result, dict):
            return f"exited with 0 after sending a {type(self.result).__name__}, not a result object"
        tail = " | ".join(self.stderr_tail.strip().splitlines()[-6:])
        return f"exited with {self.returncode}: {tail}"


def _gib(n: int | None) -> str:
    return f"{(n or 0) / 2**30:.3g} GiB"
