"""benchmark_command through the protocol: two real programs, parsed metrics, a CI, a record."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import anyio
import pytest
from mcp import Client

from loom_mcp.config import load_config
from loom_mcp.server import build_server

PROGRAM = '''
import json, os, random
speed = float(os.environ.get("SPEED", "1"))
random.seed()
print("warming up")
print(json.dumps({"decode_tokens_per_s": 100 * speed * random.uniform(0.995, 1.005),
                  "ttft_ms": 50 / speed * random.uniform(0.995, 1.005)}))
'''


@pytest.mark.anyio
async def test_faster_program_wins_on_both_metrics(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    fast = tmp_path / "fast.py"
    fast.write_text(f"import os\nos.environ['SPEED'] = '1.3'\nexec(open({str(script)!r}).read())\n")
    server = build_server(load_config(tmp_path / "home", environ={"LOOM_ALLOWED_ROOTS": str(tmp_path)}))
    async with Client(server) as client:
        result = await client.call_tool("benchmark_command", {
            "baseline_command": [sys.executable, str(script)], "command": [sys.executable, str(fast)],
            "runs": 5, "parser": "json"})
        assert result.is_error is False, result.content
        data = result.structured_content
        by_name = {m["name"]: m for m in data["metrics"]}
        assert by_name["decode_tokens_per_s"]["higher_is_better"] is True
        assert by_name["ttft_ms"]["higher_is_better"] is False
        for metric in by_name.values():
            assert 1.2 < metric["ratio"]["estimate"] < 1.4
            assert metric["ratio"]["ci_low"] > 1.0
        assert len(json.dumps(data)) < 4096
        record = await client.read_resource(f"loom://runs/{data['benchmark_id']}")
        assert json.loads(record.contents[0].text)["mode"] == "command"



def git(repo, *args) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "HOME": str(repo), "PATH": os.environ["PATH"]}
    done = subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True)
    return done.stdout.strip()


def program_at(speed: float) -> str:
    return ("import json, random\n"
            f"print(json.dumps({{'decode_tokens_per_s': 100 * {speed} * random.uniform(0.995, 1.005)}}))\n")


def two_commit_repo(tmp_path):
    """bench/program.py slow in the first commit, 1.3x faster in the second, and 9x faster in an
    uncommitted edit that neither revision may see."""
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    for speed, message in ((1.0, "slow"), (1.3, "fast")):
        (repo / "bench" / "program.py").write_text(program_at(speed))
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", message)
    (repo / "bench" / "program.py").write_text(program_at(9.0))
    return repo


def worktrees(repo) -> list[str]:
    return [line for line in git(repo, "worktree", "list", "--porcelain").splitlines()
            if line.startswith("worktree ")]


@pytest.mark.anyio
async def test_one_command_at_two_revisions(tmp_path):
    repo = two_commit_repo(tmp_path)
    server = build_server(load_config(tmp_path / "home", environ={"LOOM_ALLOWED_ROOTS": str(tmp_path)}))
    async with Client(server) as client:
        result = await client.call_tool("benchmark_command", {
            "command": [sys.executable, "program.py"], "cwd": str(repo / "bench"),
            "baseline_revision": "HEAD~1", "runs": 5, "parser": "json"})
        assert result.is_error is False, result.content
        data = result.structured_content
        assert data["revisions"] == {"baseline": git(repo, "rev-parse", "HEAD~1"),
                                     "candidate": git(repo, "rev-parse", "HEAD")}
        (metric,) = data["metrics"]
        # the committed 1.3x, not the uncommitted 9x, and a warning that the edit was left out
        assert 1.2 < metric["ratio"]["estimate"] < 1.4 and metric["ratio"]["ci_low"] > 1.0
        (left_out,) = [f for f in data["findings"] if f["check"] == "bench.command.uncommitted"]
        assert left_out["severity"] == "warning" and "bench/program.py" in left_out["message"]
        assert "1 file(s)" in left_out["message"]
        record = json.loads((await client.read_resource(f"loom://runs/{data['benchmark_id']}")).contents[0].text)
        assert record["result"]["revisions"] == data["revisions"]
        ran_in = record["samples"]["cwd"]
        assert ran_in["baseline"] != ran_in["candidate"] and ran_in["baseline"].endswith("bench")
    assert len(worktrees(repo)) == 1  # the two checkouts are gone
    assert "9.0" in (repo / "bench" / "program.py").read_text()  # the user's edit untouched


@pytest.mark.anyio
async def test_revision_mistakes_are_refused_and_leave_no_worktree(tmp_path):
    repo = two_commit_repo(tmp_path)
    git(repo, "rm", "-q", "-r", "-f", "bench")
    git(repo, "commit", "-q", "-m", "no bench")
    server = build_server(load_config(tmp_path / "home", environ={"LOOM_ALLOWED_ROOTS": str(tmp_path)}))
    base = {"command": [sys.executable, "program.py"], "runs": 3, "parser": "json"}
    async with Client(server) as client:
        async def refused(arguments: dict, *words: str) -> None:
            result = await client.call_tool("benchmark_command", {**base, **arguments})
            text = result.content[0].text
            assert result.is_error is True and all(w in text for w in words), text

        await refused({"cwd": str(repo), "baseline_revision": "no-such-branch"}, "[NOT_FOUND]", "no-such-branch")
        await refused({"cwd": str(repo / "bench"), "baseline_revision": "HEAD~1"},
                      "[NOT_FOUND]", "bench", "HEAD")  # gone at the candidate revision
        await refused({"cwd": str(repo), "revision": "HEAD"}, "[BAD_INPUT]", "baseline_revision")
        await refused({}, "[BAD_INPUT]", "baseline_command")
        await refused({"cwd": str(tmp_path), "baseline_revision": "HEAD"}, "not inside a git repository")
        # a command that fails at the baseline revision: refused, checkouts removed all the same
        await refused({"cwd": str(repo), "baseline_revision": "HEAD~2", "revision": "HEAD~1",
                       "command": [sys.executable, "bench/missing.py"]}, "[BAD_INPUT]", "first run")
    assert len(worktrees(repo)) == 1


@pytest.mark.anyio
async def test_revision_worktrees_are_removed_when_the_benchmark_is_cancelled(tmp_path):
    from loom_mcp.bench.revisions import revision_checkouts

    repo = two_commit_repo(tmp_path)
    seen: list = []
    with anyio.move_on_after(1.0) as scope:
        async with revision_checkouts(repo, {"baseline": "HEAD~1", "candidate": "HEAD"},
                                      tmp_path / "job" / "revisions", repo / "bench") as checkouts:
            seen.append(checkouts)
            assert len(worktrees(repo)) == 3
            assert "1.3" in (checkouts.cwds["candidate"] / "program.py").read_text()
            assert "1.0" in (checkouts.cwds["baseline"] / "program.py").read_text()
            await anyio.sleep(30)  # a long benchmark, cut short
    assert scope.cancelled_caught and seen
    assert len(worktrees(repo)) == 1
    assert not (tmp_path / "job" / "revisions").exists()


@pytest.mark.anyio
async def test_revisions_of_a_campaigns_repository(tmp_path):
    repo = two_commit_repo(tmp_path)
    server = build_server(load_config(tmp_path / "home", environ={"LOOM_ALLOWED_ROOTS": str(tmp_path)}))
    async with Client(server) as client:
        started = await client.call_tool("start_campaign", {"repo": str(repo), "goal": "decode speed"})
        assert started.is_error is False, started.content
        campaign_id = started.structured_content["campaign_id"]
        result = await client.call_tool("benchmark_command", {
            "command": [sys.executable, "bench/program.py"], "baseline_revision": "HEAD~1",
            "campaign_id": campaign_id, "runs": 3, "parser": "json"})
        assert result.is_error is False, result.content
        assert result.structured_content["revisions"]["candidate"] == git(repo, "rev-parse", "HEAD")
        assert result.structured_content["metrics"][0]["ratio"]["estimate"] > 1.2
    assert len(worktrees(repo)) == 1


@pytest.mark.anyio
async def test_a_stopped_servers_revision_checkouts_are_swept_at_start(tmp_path):
    from loom_mcp.bench.revisions import REVISIONS_DIR, revision_checkouts

    repo = two_commit_repo(tmp_path)
    home = tmp_path / "home"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = home / "worktrees" / REVISIONS_DIR / f"{dead.stdout.strip()}-b20261201-dead"
    live = home / "worktrees" / REVISIONS_DIR / f"{os.getpid()}-b20261201-live"
    held = []  # entered and never left (held, so no finaliser leaves them): a killed server's state
    for root in (stale, live):
        held.append(revision_checkouts(repo, {"baseline": "HEAD~1", "candidate": "HEAD"}, root))
        await held[-1].__aenter__()
    assert len(worktrees(repo)) == 5
    server = build_server(load_config(home, environ={"LOOM_ALLOWED_ROOTS": str(tmp_path)}))
    async with Client(server) as client:
        assert (await client.list_tools()).tools
    assert not stale.exists()  # its process is gone: removed, and git forgot them
    assert sorted(p.name for p in live.iterdir()) == ["baseline", "candidate"]  # a live one's kept
    assert len(worktrees(repo)) == 3


def test_uncommitted_paths_are_content_changes_only(tmp_path):
    from loom_mcp import gitops
    from loom_mcp.bench.revisions import uncommitted_finding

    repo = two_commit_repo(tmp_path)  # bench/program.py edited after the last commit
    assert gitops.uncommitted_paths(repo) == ["bench/program.py"]
    git(repo, "checkout", "--", "bench/program.py")
    os.utime(repo / "bench" / "program.py", (1, 1))  # touched, same content: not a change
    (repo / ".gitignore").write_text("*.log\n")
    (repo / "run.log").write_text("ignored\n")
    assert gitops.uncommitted_paths(repo) == [".gitignore"]  # untracked and not ignored
    git(repo, "add", ".gitignore")
    git(repo, "commit", "-q", "-m", "ignore logs")
    assert gitops.uncommitted_paths(repo / "bench") == []  # any directory of the repository
    (repo / "bench" / "program.py").unlink()
    assert gitops.uncommitted_paths(repo) == ["bench/program.py"]
    head, previous = git(repo, "rev-parse", "HEAD"), git(repo, "rev-parse", "HEAD~1")
    assert gitops.uncommitted_paths(repo, head=previous) == []  # edits to another commit than HEAD
    (finding,) = uncommitted_finding(repo / "bench", head)
    assert finding.check == "bench.command.uncommitted" and "bench/program.py" in finding.message
    assert uncommitted_finding(repo, previous) == []  # the candidate arm was not HEAD
    # a repository git cannot read any more: no note, and no error over the measurement
    (repo / ".git" / "HEAD").write_text("garbage\n")
    assert uncommitted_finding(repo, head) == []
