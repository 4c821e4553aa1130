"""Campaigns end to end through the real protocol: submit_candidate's verdicts and commits, budgets,
the report, a kill -9 in the middle of a submission, and two clients submitting at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import anyio
import git
import pytest
from mcp import Client, StdioServerParameters

from loom_mcp.config import load_config
from loom_mcp.server import build_server
from loom_mcp.store import Ledger

from .conftest import campaign_workspace, clear_win_demo_task

LOOM = str(Path(sys.executable).with_name("loom-mcp"))
DEMO = resources.files("loom_mcp") / "demo_data"
# CPU wall-clock ratios against the demo task's float64 accumulation swing with allocator page
# faults; the plausibility review itself is covered by the gate's own tests.
# The stopping rule stops once the medians are precise, so a shape is sampled for min_time_s
# only: long enough that a burst of load from elsewhere on a 2-core machine does not cover it.
GATE = "[gate]\naccept_wall_clock = true\nmax_plausible_speedup = 1000.0\nmax_time_s = 1.5\nmin_time_s = 0.5\n"


# Four blocks at least, as the suite's quick setting, but up to eight while the CI is wide: one
# block caught under a burst of load otherwise widens a t interval on 3 degrees of freedom past 1.
ADAPTIVE_BLOCKS = "wall_clock_blocks = 4\nwall_clock_max_blocks = 8\nwall_clock_ci_target = 0.08\n"


def demo_workspace(tmp_path, gate: str = GATE, clear_win: bool = False):
    files = {name: (DEMO / name).read_text() for name in ("task.py", "candidate.py", "cheat.py")}
    if clear_win:  # a submit that must be accepted on CPU wall clock
        files["task.py"] = clear_win_demo_task()
    return campaign_workspace(tmp_path, files, gate)


@pytest.fixture
def setup(tmp_path):
    return demo_workspace(tmp_path)


def user_state(repo: Path) -> tuple:
    r = git.Repo(repo)
    files = {p.name: p.read_bytes() for p in repo.iterdir() if p.is_file()}
    return r.head.commit.hexsha, r.active_branch.name, r.git.status("--porcelain"), files


async def start(client, repo: Path, **extra) -> str:
    result = await client.call_tool("start_campaign", {"repo": str(repo), "goal": "faster rmsnorm", **extra})
    assert result.is_error is False, result.content
    return result.structured_content["campaign_id"]


@pytest.mark.anyio
@pytest.mark.slow
async def test_accept_commits_reject_does_not_and_report_tells_it(tmp_path):
    """One campaign, one accepted run (each campaign run times the candidate for seconds), with
    what rides on it: validations the agent ran first are reused for the accepted bytes and not
    for the ones that failed."""
    repo, home = demo_workspace(tmp_path, GATE + ADAPTIVE_BLOCKS, clear_win=True)
    before = user_state(repo)
    async with Client(build_server(load_config(home))) as client:
        cid = await start(client, repo)
        # A candidate that failed once on these bytes is validated afresh at submission, so a
        # lucky pass cannot be fished for and then reused.
        failed = (await client.call_tool("run_validation", {
            "task": str(repo / "task.py"), "candidate": str(repo / "cheat.py")})).structured_content
        assert failed["passed"] is False
        bad = (await client.call_tool("submit_candidate", {
            "campaign_id": cid, "task": str(repo / "task.py"), "candidate": str(repo / "cheat.py")})).structured_content
        assert bad["verdict"] == "reject" and bad["commit"] is None
        assert any(code.startswith("validation.") for code in bad["reason_codes"])
        assert bad["validation_id"] != failed["validation_id"]
        # run_validation before submitting is not paid twice: same task and candidate bytes, same
        # device, software and policy, and every such validation passed.
        checked = await client.call_tool("run_validation", {
            "task": str(repo / "task.py"), "candidate": str(repo / "candidate.py")})
        assert checked.is_error is False and checked.structured_content["passed"]
        good = (await client.call_tool("submit_candidate", {
            "campaign_id": cid, "task": str(repo / "task.py"), "candidate": str(repo / "candidate.py")})).structured_content
        assert good["verdict"] == "accept", good["reasons"]
        assert good["speedup_ci_low"] > 1.02
        assert good["validation_id"] == checked.structured_content["validation_id"]
        report = (await client.call_tool("campaign_report", {"campaign_id": cid})).structured_content
        markdown = await client.read_resource(f"loom://campaigns/{cid}/report")
    assert user_state(repo) == before  # the user's branch, index and files are untouched
    r = git.Repo(repo)
    branch = r.commit(f"loom/{cid}")
    assert branch.hexsha == good["commit"] and branch.parents[0].hexsha == before[0]
    message = branch.message
    assert "Loom-Verdict: accept" in message and "Loom-Speedup:" in message and "Loom-Evidence:" in message
    assert "candidate.py" in branch.stats.files
    assert report["accepted"] == 1 and report["attempts"] == 2
    assert report["outcome_rates"] == {"accept": 0.5, "reject_validation": 0.5}
    data = json.loads(Path(report["files"]["json"]).read_text())
    assert data["schema_version"].startswith("loom.campaign_report/")
    assert Path(report["files"]["speedup_png"]).read_bytes()[:4] == b"\x89PNG"
    assert "From " in Path(report["files"]["patch"]).read_text()
    assert cid in markdown.contents[0].text and "Reproduce" in markdown.contents[0].text


@pytest.mark.anyio
@pytest.mark.slow
async def test_budget_is_enforced_from_the_ledger(setup):
    repo, home = setup
    async with Client(build_server(load_config(home))) as client:
        cid = await start(client, repo, max_candidates=1)
        args = {"campaign_id": cid, "task": str(repo / "task.py"), "candidate": str(repo / "cheat.py")}
        first = await client.call_tool("submit_candidate", args)
        assert first.is_error is False
        second = await client.call_tool("submit_candidate", args)
        assert second.is_error and "[BUDGET_EXHAUSTED]" in second.content[0].text


def rpc(msg_id, method, params=None) -> bytes:
    msg = {"jsonrpc": "2.0", "method": method, **({"id": msg_id} if msg_id is not None else {}),
           **({"params": params} if params is not None else {})}
    return (json.dumps(msg) + "\n").encode()


def test_kill_9_during_submission_leaves_nothing_half_done(setup):
    repo, home = setup
    env = {**os.environ, "LOOM_HOME": str(home)}
    init = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}
    proc = subprocess.Popen([LOOM, "--stdio"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env)
    try:
        proc.stdin.write(rpc(1, "initialize", init) + rpc(None, "notifications/initialized"))
        proc.stdin.write(rpc(2, "tools/call", {"name": "start_campaign",
                                                "arguments": {"repo": str(repo), "goal": "x"}}))
        proc.stdin.flush()
        while True:
            msg = json.loads(proc.stdout.readline())
            if msg.get("id") == 2:
                cid = msg["result"]["structuredContent"]["campaign_id"]
                break
        proc.stdin.write(rpc(3, "tools/call", {"name": "submit_candidate", "arguments": {
            "campaign_id": cid, "task": str(repo / "task.py"), "candidate": str(repo / "candidate.py")}}))
        proc.stdin.flush()
        worktrees = home / "worktrees" / cid
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (worktrees.exists() and any(worktrees.iterdir())):
            time.sleep(0.05)
        assert worktrees.exists() and any(worktrees.iterdir()), "the submission never made its worktree"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Restart: the server cleans up on open.
    build_server(load_config(home))
    ledger = Ledger(home / "ledger.sqlite3")
    rows = ledger.submissions(cid)
    assert [r["status"] for r in rows] == ["interrupted"] and rows[0]["worktree"] is None
    assert not any(worktrees.iterdir())
    r = git.Repo(repo)
    assert f"loom/{cid}" not in [h.name for h in r.heads]
    assert "loom" not in r.git.worktree("list")
    assert [c.tool for c in ledger.calls(campaign_id=cid)] == ["start_campaign", "submit_candidate"]
    assert ledger.calls(campaign_id=cid)[0].outcome == "ok"


@pytest.mark.anyio
@pytest.mark.slow
async def test_two_clients_submitting_at_once_stay_linear(tmp_path):
    # What is checked is the order of the two submissions and the branch, whatever the verdicts:
    # two blocks of fresh arms each (the fewest allowed) are enough timing for that.
    files = {name: (DEMO / name).read_text() for name in ("task.py", "candidate.py", "cheat.py")}
    repo, home = campaign_workspace(tmp_path, files, GATE + "wall_clock_blocks = 2\nwall_clock_max_blocks = 2\n")
    (repo / "candidate2.py").write_text((repo / "candidate.py").read_text().replace("EPS = 1e-6", "EPS = 1.0e-6"))
    async with Client(build_server(load_config(home))) as first:
        cid = await start(first, repo)
    results: dict[str, dict] = {}

    async def submit(name: str) -> None:
        params = StdioServerParameters(command=LOOM, args=["--stdio"], env={"LOOM_HOME": str(home)})
        async with Client(params) as client:
            r = await client.call_tool("submit_candidate", {
                "campaign_id": cid, "task": str(repo / "task.py"), "candidate": str(repo / name)})
            assert r.is_error is False, r.content
            results[name] = r.structured_content

    async with anyio.create_task_group() as tg:
        tg.start_soon(submit, "candidate.py")
        tg.start_soon(submit, "candidate2.py")
    ledger = Ledger(home / "ledger.sqlite3")
    rows = ledger.submissions(cid)
    assert len(rows) == 2 and all(r["status"] in ("accept", "reject") for r in rows)
    spans = sorted((r["created_at"], r["finished_at"]) for r in rows)
    assert spans[0][1] <= spans[1][0], "the two submissions overlapped: not serialized"
    commits = [r["commit_sha"] for r in rows if r["commit_sha"]]
    log = list(git.Repo(repo).iter_commits(f"loom/{cid}")) if commits else []
    # Linear: every accepted commit is on the branch, each the parent of the next.
    assert {c.hexsha for c in log[: len(commits)]} == set(commits)
    assert all(len(c.parents) == 1 for c in log[: len(commits)])


@pytest.mark.anyio
async def test_a_submission_may_not_edit_the_task(setup):
    """The task is the yardstick: a change that loosens it is refused before anything runs."""
    repo, home = setup
    async with Client(build_server(load_config(home))) as client:
        cid = await start(client, repo)
        (repo / "task.py").write_text((repo / "task.py").read_text() + "\nTOLERANCE = {'float32': {'atol': 1.0, 'rtol': 1.0}}\n")
        result = await client.call_tool("submit_candidate", {
            "campaign_id": cid, "task": str(repo / "task.py"), "candidate": str(repo / "cheat.py"),
            "paths": ["task.py"]})
    assert result.is_error and "[BAD_INPUT]" in result.content[0].text
    assert "task.py" in result.content[0].text


SLOW_ORACLE_TASK = '''
import time
import torch
BASELINE = "plain.py"
class Model(torch.nn.Module):
    def forward(self, x):
        time.sleep(0.02)  # an oracle: correct, and no speed reference
        return x * 2.0
def get_inputs():
    return [torch.randn(4096)]
def get_init_inputs():
    return []
'''
PLAIN = "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x * 2.0\n"


@pytest.mark.anyio
@pytest.mark.slow
async def test_benchmark_times_the_tasks_baseline_not_its_oracle(setup):
    """A task whose Model is a slow oracle names a BASELINE; timing against the oracle would
    report a 1000x 'speedup' for a copy of the baseline."""
    repo, home = setup
    (repo / "oracle_task.py").write_text(SLOW_ORACLE_TASK)
    (repo / "plain.py").write_text(PLAIN)
    (repo / "same.py").write_text(PLAIN)
    async with Client(build_server(load_config(home))) as client:
        result = await client.call_tool("benchmark", {
            "task": str(repo / "oracle_task.py"), "candidate": str(repo / "same.py")})
    assert result.is_error is False, result.content
    speedup = result.structured_content["geomean_speedup"]
    assert 0.5 < speedup < 2.0, speedup
    assert result.structured_content["baseline"].endswith("plain.py")
