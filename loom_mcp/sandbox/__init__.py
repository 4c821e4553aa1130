"""Execution sandbox: every candidate runs in a fresh, limited worker process (DESIGN §6)."""

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
