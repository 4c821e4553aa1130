"""Warm trusted workers: started ahead of need in the real sandbox, given their job later.

Each test runs the real trusted worker (`loom_mcp.worker.reference`) in a sandboxed process:
what it writes shows the job it received, including the secret that only travels over stdin.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest

from loom_mcp.sandbox import JobSpec, run_job, runner, warm
from loom_mcp.worker import handoff
from loom_mcp.worker.reference import derive_seed

TASK = '''
import time
import torch

SHAPES = [{"name": "small", "n": 16}]


class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2


def get_inputs(n=16):
    if n == 0:
        time.sleep(60)  # a task that hangs while preparing
    return [torch.randn(n)]


def get_init_inputs(n=16):
    return []
'''


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _no_idle_workers_left():
    yield
    warm.discard_all()


def _template(tmp_path: Path) -> JobSpec:
    return JobSpec(argv=warm.warm_argv(sys.executable, "loom_mcp.worker.reference"),
                   job_dir=tmp_path / "unused", env={"TRITON_INTERPRET": "1"}, visible_devices=[],
                   timeout_s=60)


def _request(task: Path, worker) -> dict:
    return {"mode": "prepare_bench", "task": str(task), "shapes": None,
            "cases_file": str(worker.job_dir / "sets"), "max_sets": 2}


@pytest.mark.anyio
async def test_a_prewarmed_worker_is_taken_and_runs_its_job_with_the_secret_from_stdin(tmp_path: Path) -> None:
    task = tmp_path / "task.py"
    task.write_text(TASK)
    template, pool = _template(tmp_path), tmp_path / "warm"
    warm.prewarm(template, pool)
    (idle_dir,) = [p for p in pool.iterdir()]
    worker = await warm.take(template, pool, refill=False)
    assert worker.job_dir == idle_dir  # the prewarmed one, not a new one
    assert template.job_dir.resolve() == idle_dir.resolve()  # the run's directory links to it
    # a nonce as long as the server's (62 random bits): a short one such as 4242 turns up in
    # the run directory's timestamp (14:24:25) and fails the check below by chance
    nonce = 3141592653589793238
    result = await warm.run_warm(worker, _request(task, worker), secret_env={"LOOM_NONCE": str(nonce)},
                                 timeout_s=60)
    assert result.ok, result.stderr_tail
    assert result.result["shapes"][0]["sets"] == 2
    # Its timeline: torch was imported before the job was given, the result came after.
    assert result.marks["torch_imported"] <= result.marks["dispatched"] <= result.marks["result"]
    assert "dispatched +" in result.timeline(result.marks["torch_imported"])
    sets = handoff.read_bundle(worker.job_dir / "sets")["shapes"][0]["sets"]
    assert [s["seed"] for s in sets] == [derive_seed(nonce, "small", 1000), derive_seed(nonce, "small", 1001)]
    # The secret never touched the disk: the request file has no nonce.
    assert str(nonce) not in (worker.job_dir / "request.json").read_text()
    assert "LOOM_NONCE" not in json.loads((worker.job_dir / "request.json").read_text())


@pytest.mark.anyio
async def test_take_refills_and_a_worker_is_used_once(tmp_path: Path) -> None:
    task = tmp_path / "task.py"
    task.write_text(TASK)
    template, pool = _template(tmp_path), tmp_path / "warm"
    first = await warm.take(template, pool, refill=True)
    second = await warm.take(template, pool, refill=False)
    assert first.job_dir != second.job_dir
    for worker in (first, second):
        result = await warm.run_warm(worker, _request(task, worker), secret_env={"LOOM_NONCE": "1"},
                                     timeout_s=60)
        assert result.ok, result.stderr_tail
        assert not worker.alive()


@pytest.mark.anyio
async def test_a_worker_idle_too_long_exits_and_is_replaced(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(warm, "IDLE_S", 1.0)
    template, pool = _template(tmp_path), tmp_path / "warm"
    warm.prewarm(template, pool)
    (idle_dir,) = list(pool.iterdir())
    deadline = time.monotonic() + 60
    while any(w.alive() for w in warm.idle_workers()) and time.monotonic() < deadline:
        await anyio.sleep(0.2)
    worker = await warm.take(template, pool, refill=False)
    assert worker.job_dir != idle_dir
    worker.discard()


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_hanging_warm_job_times_out_and_its_tree_is_killed(tmp_path: Path) -> None:
    task = tmp_path / "task.py"
    task.write_text(TASK.replace('SHAPES = [{"name": "small", "n": 16}]',
                                 'SHAPES = [{"name": "hang", "n": 0}]'))
    template, pool = _template(tmp_path), tmp_path / "warm"
    worker = await warm.take(template, pool, refill=False)
    started = time.monotonic()
    result = await warm.run_warm(worker, _request(task, worker), secret_env={"LOOM_NONCE": "1"},
                                 timeout_s=8)
    assert result.timed_out and not result.ok
    assert time.monotonic() - started < 30
    assert not worker.alive()


def test_idle_workers_are_bounded(tmp_path: Path) -> None:
    pools = [tmp_path / f"pool{i}" for i in range(warm.MAX_IDLE + 2)]
    for pool in pools:
        warm.prewarm(_template(tmp_path), pool)
    idle = warm.idle_workers()
    assert len(idle) == warm.MAX_IDLE
    assert all(w.alive() for w in idle)
    assert {w.job_dir.parent for w in idle} == set(pools[-warm.MAX_IDLE:])  # the oldest went


@pytest.mark.anyio
async def test_a_deeper_pool_hands_out_its_oldest_worker_first(tmp_path: Path) -> None:
    """With depth 2 a step that follows a refill at once still meets a worker that has had
    time to start, not the one started a moment ago."""
    template, pool = _template(tmp_path), tmp_path / "warm"
    warm.prewarm(template, pool, depth=2)
    first, second = warm.idle_workers()
    warm.prewarm(template, pool, depth=2)  # already deep enough: nothing new
    assert warm.idle_workers() == [first, second]
    taken = await warm.take(template, pool, refill=True, depth=2)
    assert taken is first
    assert warm.idle_workers()[0] is second and len(warm.idle_workers()) == 2
    taken.discard()


def test_a_job_dies_with_the_thread_that_forked_it(tmp_path: Path) -> None:
    """Why jobs are forked on the event loop's thread: the launcher arms PDEATHSIG ("die with
    the server"), and Linux sends it when the forking *thread* exits. Jobs forked from anyio's
    pooled threads were SIGKILLed when those idled out (an arm mid-benchmark on the H200 host)."""
    box: dict = {}

    def fork_and_wait_until_running() -> None:
        box["job"] = runner.spawn(JobSpec(
            argv=[sys.executable, "-c", "import pathlib, time; pathlib.Path('up').touch(); time.sleep(60)"],
            job_dir=tmp_path / "job", timeout_s=60))
        deadline = time.monotonic() + 30
        while not (tmp_path / "job" / "up").exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    thread = threading.Thread(target=fork_and_wait_until_running)
    thread.start()
    thread.join()
    try:
        assert box["job"].process.wait(10) == -signal.SIGKILL
    finally:
        box["job"].discard()


@pytest.mark.anyio
async def test_jobs_and_warm_workers_are_forked_on_the_event_loop_thread(tmp_path: Path, monkeypatch) -> None:
    forked_on: list[int] = []
    real_spawn = runner.spawn

    def recording_spawn(spec, **kwargs):
        forked_on.append(threading.get_ident())
        return real_spawn(spec, **kwargs)

    monkeypatch.setattr(runner, "spawn", recording_spawn)
    monkeypatch.setattr(warm, "spawn", recording_spawn)
    loop_thread = threading.get_ident()
    result = await run_job(JobSpec(argv=[sys.executable, "-c", "pass"], job_dir=tmp_path / "j", timeout_s=60))
    assert result.ok, result.failure()
    worker = await warm.take(_template(tmp_path), tmp_path / "warm", refill=True)
    worker.discard()
    assert len(forked_on) == 3 and set(forked_on) == {loop_thread}


@pytest.mark.anyio
@pytest.mark.parametrize("keep_warm", [True, False])
@pytest.mark.slow
async def test_the_humans_config_decides_whether_a_worker_is_kept_warm(tmp_path: Path, keep_warm: bool) -> None:
    from mcp import Client

    from loom_mcp.config import load_config
    from loom_mcp.server import build_server

    redteam = Path(__file__).parent / "redteam"
    home = tmp_path / "home"
    home.mkdir()
    (home / "loom.toml").write_text(f"warm_workers = {str(keep_warm).lower()}\n")
    server = build_server(load_config(home, environ={"LOOM_ALLOWED_ROOTS": str(redteam)}))
    async with Client(server) as client:
        result = await client.call_tool("run_validation", {
            "task": str(redteam / "task_rmsnorm.py"), "candidate": str(redteam / "honest_torch.py")})
    assert result.is_error is False, result.content
    idle_here = [w for w in warm.idle_workers() if home in w.job_dir.parents]
    assert len(idle_here) == (1 if keep_warm else 0)
