"""The ledger and artifact store on a real SQLite file."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest

from loom_mcp.errors import LoomError
from loom_mcp.store import SCHEMA_VERSION, ArtifactStore, Ledger


def test_schema_is_versioned_and_wal(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    assert ledger.schema_version() == SCHEMA_VERSION
    mode = sqlite3.connect(tmp_path / "ledger.sqlite3").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    ledger.close()
    # Re-opening an up-to-date ledger runs no migration and keeps the data.
    again = Ledger(tmp_path / "ledger.sqlite3")
    assert again.schema_version() == SCHEMA_VERSION


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(LoomError, match="newer than this loom-mcp"):
        Ledger(path)


def test_calls_are_recorded_with_outcomes(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite3")
    a = ledger.begin_call("device_info", {"refresh": False})
    ledger.end_call(a, "ok", device_s=1.5)
    b = ledger.begin_call("start_campaign", {"repo": "/x"})
    ledger.end_call(b, "error", error_code="NOT_ALLOWED")
    rows = ledger.calls()
    assert [(r.tool, r.outcome, r.error_code) for r in rows] == [
        ("device_info", "ok", None),
        ("start_campaign", "error", "NOT_ALLOWED"),
    ]
    assert rows[0].device_s == 1.5 and rows[0].wall_s is not None and rows[0].wall_s >= 0
    # Same arguments in another key order hash the same.
    c = ledger.begin_call("x", {"b": 1, "a": 2})
    d = ledger.begin_call("x", {"a": 2, "b": 1})
    got = {r.id: r.args_hash for r in ledger.calls(tool="x")}
    assert got[c] == got[d]


def test_running_call_of_a_dead_process_becomes_interrupted(tmp_path):
    path = tmp_path / "l.sqlite3"
    # A separate process opens a call and dies without finishing it.
    code = (
        "import os, sys; from pathlib import Path; from loom_mcp.store import Ledger;"
        f"l = Ledger(Path({str(path)!r})); i = l.begin_call('ok_tool', {{}}); l.end_call(i, 'ok');"
        "l.begin_call('slow_tool', {}); os._exit(9)"
    )
    subprocess.run([sys.executable, "-c", code], check=False)
    ledger = Ledger(path)
    assert ledger.interrupted_on_open == 1
    outcomes = {r.tool: r.outcome for r in ledger.calls()}
    assert outcomes == {"ok_tool": "ok", "slow_tool": "interrupted"}
    # A call running in *this* (live) process is left alone by a second open.
    ledger.begin_call("live", {})
    assert Ledger(path).interrupted_on_open == 0


def test_artifacts_are_content_addressed_and_atomic(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite3")
    store = ArtifactStore(tmp_path / "artifacts", ledger)
    sha = store.put_bytes(b"kernel source", kind="candidate", name="k.py")
    assert store.put_bytes(b"kernel source", kind="candidate") == sha
    assert store.get_bytes(sha) == b"kernel source"
    assert store.path_for(sha).parent.name == sha[:2]
    leftovers = [p for p in (tmp_path / "artifacts").rglob(".tmp-*")]
    assert leftovers == []
    with pytest.raises(LoomError, match=r"\[NOT_FOUND\]"):
        store.get_bytes("0" * 64)
    assert os.stat(store.path_for(sha)).st_size == len(b"kernel source")


@pytest.mark.anyio
async def test_a_call_that_fails_holding_a_gpu_is_charged_its_device_seconds(tmp_path):
    """A campaign's device budget counts what a call held, not only what a call that succeeded
    held: failing after minutes on the GPU would otherwise cost nothing."""
    import anyio

    from loom_mcp.config import load_config
    from loom_mcp.errors import ErrorCode
    from loom_mcp.judge import Leased, Target
    from loom_mcp.models import DeviceInfo
    from loom_mcp.runtime import open_services, run_recorded

    config = load_config(tmp_path / "home", environ={"LOOM_ALLOWED_ROOTS": str(tmp_path)})
    services = open_services(config)
    gpu = Target(torch_device="cuda:0", device=DeviceInfo(index=0, vendor="nvidia", name="test GPU"),
                 lease_key="nvidia:0")

    async def body(scope):
        async with Leased(config, gpu, None):
            await anyio.sleep(0.2)
        raise LoomError(ErrorCode.TIMEOUT, "the job timed out")

    with pytest.raises(Exception, match=r"\[TIMEOUT\]"):
        await run_recorded(services, "run_validation", {}, body)
    (row,) = services.ledger.calls("run_validation")
    assert row.outcome == "error" and row.device_s >= 0.2
