"""The Ray executor on this machine: a private local Ray instance with two CPU slots runs the
judge's jobs with the same verdicts as a local run, and a job whose Ray worker is killed is run
once more, then reported INTERRUPTED."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import anyio
import orjson
import pytest

ray = pytest.importorskip("ray")

from loom_mcp.errors import ErrorCode, LoomError  # noqa: E402
from loom_mcp.executor.ray_executor import RayExecutor, build_job, kind_resource  # noqa: E402
from loom_mcp.sandbox.sources import code_files  # noqa: E402
from loom_mcp.validate.runner import validate_candidate  # noqa: E402

pytestmark = [pytest.mark.slow]

TASK = """
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2


def get_inputs():
    return [torch.randn(64, 64)]


def get_init_inputs():
    return []
"""

HONEST = """
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return x + x
"""

WRONG = HONEST.replace("x + x", "x + 1")

SLOW = HONEST.replace("return x + x", "import time\n        time.sleep(1.5)\n        return x + x")


def _cpu_kind() -> str:
    from loom_mcp.devices import probe_devices
    from loom_mcp.executor.pool import device_kind

    return device_kind(next(d for d in probe_devices()[0] if d.vendor == "cpu"))


@pytest.fixture(scope="module")
def executor():
    from loom_mcp import dispatch

    # The machine's own CPU kind: a server in this process (address "local") joins this instance.
    ex = RayExecutor("local", {_cpu_kind(): 2}, cpu_slots=2)
    ex.start()
    yield ex
    ex.shutdown()
    dispatch._RAY.clear()


def _files(tmp_path: Path, candidate: str) -> tuple[Path, Path]:
    (tmp_path / "task").mkdir()
    (tmp_path / "cand").mkdir()
    task, cand = tmp_path / "task" / "task.py", tmp_path / "cand" / "cand.py"
    task.write_text(TASK)
    cand.write_text(candidate)
    return task, cand


def _job(task: Path, cand: Path, run_id: str):
    settings = {"seeds": 2, "shapes": None, "timeout_s": 120, "validation_id": run_id, "task_globals": {}}
    return build_job("validate", run_id, task, cand, code_files(cand), settings, 8 << 30, 1 << 30)


def test_the_executor_reports_its_node_and_two_cpu_slots(executor) -> None:
    state = executor.state()
    assert state["kind"] == "ray" and len(state["nodes"]) == 1
    name = kind_resource(_cpu_kind()).removeprefix("loom_kind_")
    assert state["slots"] == [{"device": f"{name}:0", "busy": False}, {"device": f"{name}:1", "busy": False}]
    assert kind_resource("NVIDIA H200 / 580.159") == "loom_kind_nvidia_h200_580_159"


@pytest.mark.parametrize("candidate", [HONEST, WRONG], ids=["honest", "wrong"])
def test_a_validation_through_ray_gives_the_local_verdict(
        executor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, candidate: str) -> None:
    from types import SimpleNamespace

    from loom_mcp.sandbox import policy

    # The local run's trusted workers read the task: its directory is an allowed root.
    monkeypatch.setattr(policy, "_configured", policy.from_config(SimpleNamespace(
        job_memory_bytes=8 << 30, job_disk_bytes=1 << 30, allowed_roots=[str(tmp_path)], home=str(tmp_path / "home"))))
    task, cand = _files(tmp_path, candidate)
    remote = anyio.run(executor.run, _job(task, cand, "v-ray"), _cpu_kind(), False)

    async def local():
        return await validate_candidate(task=task, candidate=cand, job_dir=tmp_path / "jobs" / "v-local",
                                        seeds=2, shapes=None, device="cpu", timeout_s=120,
                                        validation_id="v-local", keep_warm=False)

    here = anyio.run(local)
    assert remote.device == "cpu" and remote.node
    assert remote.evidence["passed"] is here.passed is (candidate == HONEST)
    assert len(remote.evidence["cases"]) == len(here.cases) == 2
    assert sorted(f["check"] for f in remote.evidence["findings"]) == sorted(f.check for f in here.findings)


def _kill_job_workers(run_id: str, times: int, deadline_s: float = 60) -> int:
    """SIGKILL the Ray worker running `run_id`'s task, `times` times (each once it runs again)."""
    killed, seen = 0, set()
    deadline = time.monotonic() + deadline_s
    while killed < times and time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid in seen:
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if cmdline.startswith("ray::") and run_id in cmdline:
                time.sleep(1.0)  # let it start its sandboxed workers
                os.kill(int(pid), signal.SIGKILL)
                seen.add(pid)
                killed += 1
                break
        time.sleep(0.05)
    return killed


@pytest.mark.parametrize("kills", [1, 2])
def test_a_job_whose_worker_dies_runs_once_more_then_is_interrupted(executor, tmp_path: Path, kills: int) -> None:
    task, cand = _files(tmp_path, SLOW)
    run_id = f"v-kill{kills}"
    killer_result: list[int] = []
    killer = threading.Thread(target=lambda: killer_result.append(_kill_job_workers(run_id, kills)))
    killer.start()
    try:
        if kills == 1:
            remote = anyio.run(executor.run, _job(task, cand, run_id), _cpu_kind(), False)
            assert remote.evidence["passed"] is True
        else:
            with pytest.raises(LoomError) as raised:
                anyio.run(executor.run, _job(task, cand, run_id), _cpu_kind(), False)
            assert raised.value.code is ErrorCode.INTERRUPTED and run_id in raised.value.message
    finally:
        killer.join(90)
    assert killer_result == [kills]


# ---------------------------------------------------------------- through MCP, kind = "ray"


def _home(tmp_path: Path, name: str, executor_toml: str) -> Path:
    home = tmp_path / name / "home"
    home.mkdir(parents=True)
    (home / "loom.toml").write_text(f'allowed_roots = ["{tmp_path}"]\n{executor_toml}')
    return home


@pytest.mark.anyio
async def test_validation_and_benchmark_through_mcp_on_the_ray_executor(executor, tmp_path: Path) -> None:
    """A server with [executor] kind = "ray" (joining this process's local instance): the tools
    run as Ray tasks, the records name the executor and node, device_info lists the slots, and
    the verdicts are the local executor's (a clearly slower candidate rejected by both)."""
    from mcp import Client

    from loom_mcp.config import load_config
    from loom_mcp.server import build_server

    task, _ = _files(tmp_path, HONEST)
    slow = tmp_path / "cand" / "slow.py"
    slow.write_text(HONEST.replace("return x + x", "import time\n        time.sleep(0.02)\n        return x + x"))
    arguments = {"task": str(task), "candidate": str(slow)}
    verdicts = {}
    for kind in ("ray", "local"):
        home = _home(tmp_path, kind, f'[executor]\nkind = "{kind}"\ncpu_slots = 2\n')
        async with Client(build_server(load_config(home))) as client:
            info = (await client.call_tool("device_info", {})).structured_content["executor"]
            assert info["kind"] == kind and len(info["slots"]) == 2, info
            validation = (await client.call_tool("run_validation", arguments)).structured_content
            bench = await client.call_tool("benchmark", arguments)
            assert bench.is_error is False, bench.content
            result = bench.structured_content
            record = (await client.read_resource(f"loom://runs/{result['benchmark_id']}")).contents[0].text
            placement = orjson.loads(record)["placement"]
            assert placement["executor"] == kind and placement["node"], placement
            verdicts[kind] = (validation["passed"], result["geomean_speedup"] < 0.5, result["next_step"][:40])
    assert verdicts["ray"] == verdicts["local"] == (True, True, verdicts["local"][2])


def test_kind_ray_without_ray_installed_is_refused_at_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    home = _home(tmp_path, "x", '[executor]\nkind = "ray"\n')
    script = "import sys; sys.modules['ray'] = None; from loom_mcp.cli import main; sys.exit(main())"
    run = subprocess.run([sys.executable, "-c", script, "--stdio"], env={**os.environ, "LOOM_HOME": str(home)},
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert run.returncode != 0 and run.stdout == ""
    assert "[TOOLCHAIN_MISSING]" in run.stderr and "loom-mcp[ray]" in run.stderr, run.stderr


@pytest.mark.anyio
async def test_two_campaigns_submitting_at_once_on_ray_stay_linear_within_budget(executor, tmp_path: Path) -> None:
    """Two campaigns, each with a budget of one candidate, each sent two submissions at once, on
    the Ray executor's two slots: one submission per campaign is judged (the others are refused
    on budget, before any job), and each campaign's branch stays linear."""
    from importlib import resources

    import git
    from mcp import Client

    from loom_mcp.config import load_config
    from loom_mcp.server import build_server
    from loom_mcp.store import Ledger

    from .conftest import campaign_workspace

    demo = resources.files("loom_mcp") / "demo_data"
    files = {name: (demo / name).read_text() for name in ("task.py", "candidate.py")}
    gate = "[gate]\naccept_wall_clock = true\nmax_plausible_speedup = 1000.0\nmax_time_s = 1.5\nmin_time_s = 0.5\n"
    repo, home = campaign_workspace(tmp_path, files, gate + '[executor]\nkind = "ray"\ncpu_slots = 2\n')
    (repo / "candidate2.py").write_text(files["candidate.py"].replace("EPS = 1e-6", "EPS = 1.0e-6"))
    outcomes: dict[str, list] = {}
    async with Client(build_server(load_config(home))) as client:
        cids = []
        for goal in ("first", "second"):
            started = await client.call_tool("start_campaign", {"repo": str(repo), "goal": goal, "max_candidates": 1})
            assert started.is_error is False, started.content
            cids.append(started.structured_content["campaign_id"])

        async def submit(cid: str, name: str) -> None:
            r = await client.call_tool("submit_candidate", {
                "campaign_id": cid, "task": str(repo / "task.py"), "candidate": str(repo / name)})
            outcomes.setdefault(cid, []).append(r)

        async with anyio.create_task_group() as tg:
            for cid in cids:
                for name in ("candidate.py", "candidate2.py"):
                    tg.start_soon(submit, cid, name)
        for cid in cids:
            for r in outcomes[cid]:
                if not r.is_error:  # judged on Ray: its validation's record says so
                    run = r.structured_content["validation_id"]
                    record = orjson.loads((await client.read_resource(f"loom://runs/{run}")).contents[0].text)
                    assert record["placement"]["executor"] == "ray", record["placement"]
        # The report counts the campaign's jobs per device, with their queue waits.
        report = (await client.call_tool("campaign_report", {"campaign_id": cids[0]})).structured_content
        devices = orjson.loads(Path(report["files"]["json"]).read_text())["devices"]
        assert {d["executor"] for d in devices} == {"ray"} and sum(d["jobs"] for d in devices) == 2, devices
        assert "## Devices" in Path(report["files"]["markdown"]).read_text()
    ledger = Ledger(home / "ledger.sqlite3")
    for cid in cids:
        judged = [r for r in outcomes[cid] if not r.is_error]
        refused = [r for r in outcomes[cid] if r.is_error]
        assert len(judged) == 1 and len(refused) == 1, [r.content for r in outcomes[cid]]
        assert "[BUDGET_EXHAUSTED]" in refused[0].content[0].text
        rows = ledger.submissions(cid)
        assert len(rows) == 1 and rows[0]["status"] in ("accept", "reject")
        if rows[0]["commit_sha"]:
            log = list(git.Repo(repo).iter_commits(f"loom/{cid}"))
            assert log[0].hexsha == rows[0]["commit_sha"] and len(log[0].parents) == 1
