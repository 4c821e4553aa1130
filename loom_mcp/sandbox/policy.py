"""The sandbox's share of the server's configuration: default job limits, what trusted jobs may
read, and the state directory no job may see.

JobSpecs are built deep inside validation, the benchmark, compilation and profiling, which do
not carry the config; the server sets this once when it opens its services (`configure`).
Library callers and tests that never do get the same values from the environment's config
(LOOM_HOME, LOOM_ALLOWED_ROOTS), read again on every call.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_DISK_BYTES = 16 << 30


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_memory_bytes() -> int:
    """Three quarters of the machine's RAM: one job may use most of it, not all of it (the
    server, the other jobs of a benchmark and the rest of the machine keep a quarter)."""
    total = physical_memory_bytes()
    return total * 3 // 4 if total else 16 << 30


@dataclass(frozen=True)
class SandboxPolicy:
    memory_bytes: int  # per job; 0: no limit
    disk_bytes: int  # per job: what its directories may grow by; 0: no quota
    trusted_roots: tuple[Path, ...]  # read-only for trusted workers and the agent's commands
    loom_home: Path | None  # never visible to a job, except the job's own directories in it

    def hidden(self) -> list[Path]:
        """Paths masked wherever a directory bound into a job's root contains them."""
        return [self.loom_home] if self.loom_home else []


_lock = threading.Lock()
_configured: SandboxPolicy | None = None


def from_config(config: Any) -> SandboxPolicy:
    return SandboxPolicy(
        memory_bytes=int(getattr(config, "job_memory_bytes", None) or default_memory_bytes()),
        disk_bytes=int(getattr(config, "job_disk_bytes", None) or DEFAULT_DISK_BYTES),
        trusted_roots=tuple(Path(p) for p in config.allowed_roots),
        loom_home=Path(config.home),
    )


def configure(config: Any) -> SandboxPolicy:
    """Use this config (a LoomConfig) for every job this process starts from now on."""
    global _configured
    policy = from_config(config)
    with _lock:
        _configured = policy
    return policy


def reset() -> None:
    """Forget the configured policy (tests)."""
    global _configured
    with _lock:
        _configured = None


def current() -> SandboxPolicy:
    with _lock:
        if _configured is not None:
            return _configured
    try:
        from loom_mcp.config import load_config

        return from_config(load_config())
    except Exception:  # a broken loom.toml must not stop jobs that need none of it
        return SandboxPolicy(default_memory_bytes(), DEFAULT_DISK_BYTES, (), None)
