"""Blank workers: started before their job is known, given the job's paths when it comes.

A blank worker's root holds the system, the interpreter and a directory of its own; its init
keeps the host's tree so that it can add a job's paths later (sandbox/warm.py,
mounts._apply_late). These tests run the real launcher with real namespaces: a probe module
reports what the worker can reach once it has its job, and the same attacks as for fresh
processes run through MCP in blank workers.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from mcp import Client

from loom_mcp.config import load_config
from loom_mcp.sandbox import JobSpec, isolation, procs, runner, view, warm
from loom_mcp.server import build_server

REDTEAM = Path(__file__).parent / "redteam"

# Runs inside the worker once it has its job: what it can read, write and see.
PROBE = r'''
import json, os, sys

def opens(path):
    try:
        with open(path, "rb") as f:
            f.read(1)
        return True
    except OSError:
        return False

def lists(path):
    try:
        return bool(os.listdir(path))
    except OSError:
        return False

def writes(path):
    try:
        with open(path, "w") as f:
            f.write("x")
        return True
    except OSError:
        return False

def main():
    request = json.load(open(os.environ["LOOM_REQUEST"]))
    init_fds = [fd for fd in range(32) if opens(f"/proc/1/fd/{fd}")]
    report = {
        "reads_readable": open(request["readable_file"]).read() == "ok",
        "writes_readable": writes(request["readable_file"]),
        "writes_writable": writes(os.path.join(request["writable"], "out")),
        "writes_alias": writes(os.path.join(request["alias"], "via-alias")),
        "writes_root": writes("/planted"),
        "writes_usr": writes("/usr/planted"),
        "sees_secret": opens(request["secret"]),
        "sees_staging": [p for p in ("/oldroot", "/stage", "/newroot") if os.path.lexists(p)],
        "init_root": lists("/proc/1/root") or opens("/proc/1/root/etc/hostname"),
        "init_cwd": lists("/proc/1/cwd"),
        "init_fds": init_fds,
        "init_mem": opens("/proc/1/mem") or opens("/proc/1/environ"),
        "init_mnt_ns": opens("/proc/1/ns/mnt"),
        "init_cmdline_plan": "ops" in open("/proc/1/cmdline").read(),
        "own_fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "job_env": os.environ.get("LOOM_PROBE_JOB"),
        "tmpdir": os.environ.get("TMPDIR"),
    }
    print(json.dumps(report))
'''


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _no_idle_workers_left():
    yield
    warm.discard_all()


def _late_binds() -> bool:
    return runner.late_binds_possible(JobSpec(argv=["true"], job_dir=Path("/nonexistent")))


needs_late = pytest.mark.skipif(not _late_binds(), reason="no root view in a pid namespace here")


def test_late_entries_are_what_the_root_lacks_and_never_cover_it() -> None:
    base = [{"op": "tmpfs", "path": "/tmp", "options": "size=1m", "readonly": False},
            {"op": "bind", "path": "/jobs/warm/b1", "src": "/jobs/warm/b1", "mode": "rw", "optional": False}]
    extra = {"op": "bind", "path": "/work/cand", "src": "/work/cand", "mode": "ro", "optional": True}
    assert view.late_entries(base, [*base, extra]) == [extra]
    # The same path again with another source or mode is stacked on top: allowed.
    shm = {"op": "bind", "path": "/tmp", "src": "/dev/shm/x", "mode": "rw", "optional": False}
    assert view.late_entries(base, [*base, shm]) == [shm]
    # An entry above one the root already has would hide it (the worker's own directory).
    for covering in ("/jobs", "/jobs/warm"):
        with pytest.raises(ValueError, match="would cover /jobs/warm/b1"):
            view.late_entries(base, [*base, {**extra, "path": covering, "src": covering}])
    with pytest.raises(ValueError, match="cannot be added later"):
        view.late_entries(base, [*base, {"op": "proc", "path": "/proc2"}])


@needs_late
@pytest.mark.anyio
async def test_a_blank_worker_gets_exactly_its_jobs_paths_and_nothing_of_init(tmp_path: Path) -> None:
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "loom_blank_probe.py").write_text(PROBE)
    readable, writable, secret = tmp_path / "readable", tmp_path / "writable", tmp_path / "secret"
    for path in (readable, secret):
        path.mkdir()
    (readable / "file").write_text("ok")
    (secret / "file").write_text("secret")
    base_env = {"PYTHONPATH": str(modules)}
    spec = JobSpec(argv=[sys.executable, "-m", "loom_blank_probe"], job_dir=tmp_path / "run" / "probe",
                   env={**base_env, "LOOM_PROBE_JOB": "given with the job"}, visible_devices=[],
                   readable=[readable], writable=[writable], timeout_s=60,
                   request={"readable_file": str(readable / "file"), "writable": str(writable),
                            "alias": str(tmp_path / "run" / "probe"), "secret": str(secret / "file")})
    pool = tmp_path / "warm"
    # The probe module must be in the blank root: its directory is the one path it starts with.
    template = warm._blank_template(spec, base_env).model_copy(update={"readable": [modules]})
    warm.prewarm(template, pool, blank=True)
    (worker,) = warm.idle_workers()
    assert worker.alive() and worker.view_ops is not None
    taken = warm._take_idle(warm._key(template, pool, blank=True))
    assert taken is worker
    alias = spec.job_dir.parent.resolve() / spec.job_dir.name
    assert warm.dispatch_late(worker, spec, base_env, alias) is None
    warm.link_into(worker, alias)
    result = await runner.supervise(worker)
    assert result.ok, result.stderr_tail
    assert result.view == "allowlist"
    report = json.loads(result.stdout_tail.strip().splitlines()[-1])
    assert report == {
        "reads_readable": True, "writes_readable": False, "writes_writable": True,
        "writes_alias": True, "writes_root": False, "writes_usr": False, "sees_secret": False,
        "sees_staging": [], "init_root": False, "init_cwd": False, "init_fds": [],
        "init_mem": False, "init_mnt_ns": False, "init_cmdline_plan": False,
        "own_fds": report["own_fds"], "job_env": "given with the job",
        "tmpdir": str(worker.job_dir)}, report
    # stdin, stdout, stderr, the result pipe and the listing's own descriptor: no pipe of
    # init's (ack, feed, status), no launcher plan
    assert len(report["own_fds"]) <= 5, report["own_fds"]
    assert (writable / "out").read_text() == "x"
    # The job's directory, as the caller named it, is the worker's own.
    assert (spec.job_dir / "via-alias").read_text() == "x"
    assert not (readable / "file").read_text() != "ok"


@needs_late
@pytest.mark.anyio
async def test_a_job_whose_paths_would_cover_the_root_gets_a_fresh_process(tmp_path: Path) -> None:
    """A readable directory above the pool would hide the worker's own directory: the worker is
    discarded and the job runs in a fresh process, with the same result."""
    pool = tmp_path / "warm"
    spec = JobSpec(argv=[sys.executable, "-m", "this"], job_dir=tmp_path / "run" / "j",
                   readable=[tmp_path], timeout_s=60)
    template = warm._blank_template(spec, {})
    warm.prewarm(template, pool, blank=True)
    (idle,) = warm.idle_workers()
    launched = await warm.start(spec, pool, base_env={}, refill=False)
    assert launched is not idle and not idle.alive()
    assert launched.job_dir == (tmp_path / "run" / "j").resolve()
    result = await runner.supervise(launched)
    assert result.ok, result.stderr_tail


@pytest.fixture
def blank_server(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(warm, "BLANK_ON_CPU", True)
    shutil.copytree(REDTEAM, tmp_path / "redteam")
    (tmp_path / "other-campaign").mkdir()
    (tmp_path / "other-campaign" / "candidate.py").write_text("# another campaign's candidate\n")
    (tmp_path / "home").mkdir()
    # A benchmark here is checked for where its processes ran, not for its CI: two blocks of
    # fresh arms (the fewest allowed) instead of four.
    (tmp_path / "home" / "loom.toml").write_text("[gate]\nwall_clock_blocks = 2\nwall_clock_max_blocks = 2\n")
    server = build_server(load_config(tmp_path / "home", environ={"LOOM_ALLOWED_ROOTS": str(tmp_path)}))
    yield server
    warm.discard_all()


async def _validate(client: Client, root: Path, candidate: str) -> dict:
    result = await client.call_tool("run_validation", {
        "task": str(root / "redteam" / "task_rmsnorm.py"), "candidate": str(root / "redteam" / candidate)})
    assert result.is_error is False, result.content
    return result.structured_content


def _candidate_dirs(home: Path) -> list[Path]:
    return sorted((home / "jobs").glob("v*/cand"), key=lambda p: p.lstat().st_mtime)


@needs_late
@pytest.mark.slow
@pytest.mark.anyio
async def test_validation_in_blank_workers_passes_honest_code_and_holds_against_attacks(
        blank_server, tmp_path: Path) -> None:
    async with Client(blank_server) as client:
        first = await _validate(client, tmp_path, "honest_torch.py")  # fresh; leaves a blank behind
        assert first["passed"], first
        honest = await _validate(client, tmp_path, "honest_torch.py")
        assert honest["passed"], honest
        ledger = await _validate(client, tmp_path, "attack_read_ledger.py")
        wrong = await _validate(client, tmp_path, "cheat_zero_softmax.py")
    dirs = _candidate_dirs(tmp_path / "home")
    assert len(dirs) == 4
    assert not dirs[0].is_symlink()
    for later in dirs[1:]:  # each later candidate ran in a blank worker started before it
        assert later.is_symlink() and later.resolve().parent.name == "warm"
        assert later.resolve().name.startswith("b")
    assert ledger["cases_total"] > 0 and ledger["cases_failed"] == 0, ledger  # nothing was read
    assert not wrong["passed"]  # the verdict itself is unchanged


@needs_late
@pytest.mark.slow
@pytest.mark.anyio
async def test_a_benchmark_runs_its_arms_and_timer_in_blank_workers(blank_server, tmp_path: Path) -> None:
    args = {"task": str(tmp_path / "redteam" / "task_rmsnorm.py"),
            "candidate": str(tmp_path / "redteam" / "honest_torch.py")}
    async with Client(blank_server) as client:
        for _ in range(2):  # the first leaves blank workers behind for the second
            result = await client.call_tool("benchmark", args)
            assert result.is_error is False, result.content
            assert result.structured_content["shapes"], result.structured_content
            assert result.structured_content["blocks"] == 2
    runs = sorted((tmp_path / "home" / "jobs").glob("b*/timer"), key=lambda p: p.lstat().st_mtime)
    assert len(runs) == 2 and not runs[0].is_symlink()
    second = runs[1].parent
    for role in ("timer", "baseline", "candidate"):
        assert (second / role).is_symlink(), role
        assert (second / role).resolve().name.startswith("b")
    assert isolation.capabilities()  # probed once for the whole run


@needs_late
def test_a_worker_near_its_idle_limit_is_never_handed_a_job(tmp_path: Path) -> None:
    """One given its job as its idle time runs out could exit without running it, which would
    read as the job's own failure: it is discarded and another started."""
    spec = JobSpec(argv=[sys.executable, "-m", "this"], job_dir=tmp_path / "run" / "j", timeout_s=60)
    template, pool = warm._blank_template(spec, {}), tmp_path / "warm"
    warm.prewarm(template, pool, blank=True)
    (old,) = warm.idle_workers()
    old.born -= warm.IDLE_S * 0.95
    assert warm._take_idle(warm._key(template, pool, blank=True)) is None
    assert not old.alive()


@needs_late
def test_a_worker_that_died_idle_does_not_turn_blank_workers_off(tmp_path: Path) -> None:
    import signal

    spec = JobSpec(argv=[sys.executable, "-m", "this"], job_dir=tmp_path / "run" / "j", timeout_s=60)
    template, pool = warm._blank_template(spec, {}), tmp_path / "warm"
    warm.prewarm(template, pool, blank=True)
    (worker,) = warm.idle_workers()
    deadline = time.monotonic() + 30
    while len(procs.descendants(worker.process.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # until init and the worker exist
    for pid in procs.descendants(worker.process.pid):  # init and the worker, not the launcher
        os.kill(pid, signal.SIGKILL)
    error = warm.dispatch_late(worker, spec, {}, tmp_path / "run" / "j")
    assert error is not None
    assert warm._late_failed == []
