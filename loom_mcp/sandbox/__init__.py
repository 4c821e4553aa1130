"""Execution sandbox: every job runs in its own limited worker process (docs/architecture.md)."""

from loom_mcp.sandbox.env import worker_env
from loom_mcp.sandbox.isolation import isolation_report
from loom_mcp.sandbox.job import JobResult, JobSpec, code_cache, code_cache_env
from loom_mcp.sandbox.lease import DeviceLease, lease_holder
from loom_mcp.sandbox.runner import limit_error, run_job

__all__ = [
    "DeviceLease",
    "JobResult",
    "JobSpec",
    "code_cache",
    "code_cache_env",
    "isolation_report",
    "lease_holder",
    "limit_error",
    "run_job",
    "worker_env",
]
