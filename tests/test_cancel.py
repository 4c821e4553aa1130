"""Cancelling an MCP request kills the job it started: the worker tree is gone and the ledger
records the call as cancelled, while the server keeps serving."""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import pytest
from mcp import Client

from loom_mcp.config import load_config
from loom_mcp.sandbox import isolation, procs, warm
from loom_mcp.server import build_server
from loom_mcp.store import Ledger

REDTEAM = Path(__file__).parent / "redteam"

HANGS = '''
import time
import torch


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()

    def forward(self, x):
        time.sleep(3600)
        return x
'''


def our_jobs() -> list[str]:
    """Sandbox launchers (and their inits) started by this process (the in-process server),
    except idle warm workers, which wait for a later call by design (and go with the server)."""
    idle = set()
    for worker in warm.idle_workers():  # the launcher and what it forked (its init)
        idle |= {worker.process.pid, *procs.descendants(worker.process.pid)}
    jobs = []
    for pid in procs.descendants(os.getpid()):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if isolation.LAUNCHER in args and pid not in idle:
            jobs.append(args)
    return jobs


@pytest.mark.anyio
async def test_cancelled_validation_kills_its_worker(tmp_path):
    candidate = tmp_path / "hangs_forever.py"
    candidate.write_text(HANGS)
    home = tmp_path / "home"
    server = build_server(load_config(home, environ={"LOOM_ALLOWED_ROOTS": f"{tmp_path}:{REDTEAM}"}))
    async with Client(server) as client:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                async def call() -> None:
                    await client.call_tool("run_validation", {
                        "task": str(REDTEAM / "task_rmsnorm.py"), "candidate": str(candidate)})
                    pytest.fail("the hanging candidate returned")

                tg.start_soon(call)
                deadline = time.monotonic() + 30
                while not our_jobs():  # the candidate is running (and hanging) in its sandbox
                    assert time.monotonic() < deadline, "no job ever started"
                    await anyio.sleep(0.1)
                await anyio.sleep(1.0)
                scope.cancel()
        deadline = time.monotonic() + 15
        while our_jobs() and time.monotonic() < deadline:
            await anyio.sleep(0.1)
        assert our_jobs() == [], "a cancelled job left processes behind"
        info = await client.call_tool("device_info", {})
        assert info.is_error is False  # still serving
    calls = Ledger(home / "ledger.sqlite3").calls(tool="run_validation")
    assert calls[-1].outcome == "cancelled" and calls[-1].error_code == "CANCELLED"
