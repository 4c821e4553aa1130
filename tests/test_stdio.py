"""The installed console script as a real subprocess: stdio, HTTP, kill -9, an external client."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters

from loom_mcp.demo import wall_clock_notice, write_config
from loom_mcp.store import Ledger

LOOM = str(Path(sys.executable).with_name("loom-mcp"))


def server_env(home: Path, roots: Path) -> dict[str, str]:
    return {"LOOM_HOME": str(home), "LOOM_ALLOWED_ROOTS": str(roots), "PYTHONUNBUFFERED": "1"}


def params(home: Path, roots: Path) -> StdioServerParameters:
    return StdioServerParameters(command=LOOM, args=["--stdio"], env=server_env(home, roots))


def rpc(msg_id: int | None, method: str, params: dict | None = None) -> bytes:
    msg: dict = {"jsonrpc": "2.0", "method": method}
    if msg_id is not None:
        msg["id"] = msg_id
    if params is not None:
        msg["params"] = params
    return (json.dumps(msg) + "\n").encode()


INIT = {"protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "raw-test", "version": "0"}}


def read_response(proc: subprocess.Popen, want_id: int, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("server closed stdout")
        msg = json.loads(line)  # every byte on stdout must be protocol
        if msg.get("id") == want_id:
            return msg
    raise AssertionError("no response")


@pytest.mark.anyio
async def test_stdio_client_lists_and_calls(tmp_path):
    async with Client(params(tmp_path / "home", tmp_path)) as client:
        tools = {t.name for t in (await client.list_tools()).tools}
        assert {"device_info", "start_campaign"} <= tools
        result = await client.call_tool("device_info", {})
        assert result.is_error is False
        assert any(d["vendor"] == "cpu" for d in result.structured_content["devices"])


def test_stdout_carries_only_protocol(tmp_path):
    proc = subprocess.Popen([LOOM, "--stdio"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **server_env(tmp_path / "h", tmp_path)})
    proc.stdin.write(rpc(1, "initialize", INIT))
    proc.stdin.write(rpc(None, "notifications/initialized"))
    proc.stdin.write(rpc(2, "tools/list"))
    proc.stdin.write(rpc(3, "tools/call", {"name": "device_info", "arguments": {}}))
    proc.stdin.flush()
    out, err = proc.communicate(timeout=120)
    messages = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
    ids = {m.get("id") for m in messages}
    assert {1, 2, 3} <= ids
    assert proc.returncode == 0, err.decode()[-2000:]


def test_ledger_survives_kill_9_mid_call(tmp_path):
    home = tmp_path / "home"
    proc = subprocess.Popen([LOOM, "--stdio"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env={**os.environ, **server_env(home, tmp_path)})
    try:
        proc.stdin.write(rpc(1, "initialize", INIT))
        proc.stdin.write(rpc(None, "notifications/initialized"))
        proc.stdin.write(rpc(2, "tools/call", {"name": "device_info", "arguments": {}}))
        proc.stdin.flush()
        assert "result" in read_response(proc, 2)
        # refresh=True spawns a worker that imports torch: long enough to kill the server mid-call.
        proc.stdin.write(rpc(3, "tools/call", {"name": "device_info", "arguments": {"refresh": True}}))
        proc.stdin.flush()
        ledger_path = home / "ledger.sqlite3"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            running = [r for r in Ledger(ledger_path).calls() if r.outcome == "running"]
            if running:
                break
            time.sleep(0.02)
        assert running, "the refresh call never started"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    ledger = Ledger(home / "ledger.sqlite3")
    assert ledger.interrupted_on_open == 1
    assert [r.outcome for r in ledger.calls(tool="device_info")] == ["ok", "interrupted"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError("server did not listen")


@pytest.mark.anyio
@pytest.mark.slow
async def test_http_transport_on_loopback(tmp_path):
    port = free_port()
    proc = subprocess.Popen([LOOM, "--http", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, **server_env(tmp_path / "h", tmp_path)})
    try:
        wait_listening(port, proc)
        async with Client(f"http://127.0.0.1:{port}/mcp") as client:
            result = await client.call_tool("device_info", {})
            assert result.is_error is False
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_remote_bind_needs_flag_and_token(tmp_path):
    env = {**os.environ, **server_env(tmp_path / "h", tmp_path)}
    env.pop("LOOM_HTTP_TOKEN", None)
    no_flag = subprocess.run([LOOM, "--http", "--host", "0.0.0.0"], env=env, capture_output=True, timeout=30)
    assert no_flag.returncode == 2 and b"--allow-remote" in no_flag.stderr
    no_token = subprocess.run([LOOM, "--http", "--host", "0.0.0.0", "--allow-remote"], env=env,
                              capture_output=True, timeout=30)
    assert no_token.returncode == 2 and b"LOOM_HTTP_TOKEN" in no_token.stderr


def test_bearer_token_is_enforced(tmp_path):
    import urllib.error
    import urllib.request

    port = free_port()
    token = "loom-test-T0ken_" + "x9Qz" * 4  # a real token: >= 16 characters, >= 8 distinct
    env = {**os.environ, **server_env(tmp_path / "h", tmp_path), "LOOM_HTTP_TOKEN": token}
    proc = subprocess.Popen([LOOM, "--http", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port, proc)
        body = rpc(1, "initialize", INIT)
        headers = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/mcp", data=body, headers=headers)
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(request, timeout=10)
        assert denied.value.code == 401
        request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=10) as ok:
            assert ok.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_version_and_doctor(tmp_path):
    version = subprocess.run([LOOM, "--version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and version.stdout.startswith("loom-mcp ")
    env = {**os.environ, **server_env(tmp_path / "h", tmp_path)}
    doctor = subprocess.run([LOOM, "doctor", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert doctor.returncode == 0, doctor.stderr[-2000:]
    report = json.loads(doctor.stdout)
    assert any(d["vendor"] == "cpu" for d in report["devices"])
    assert "network" in report["isolation"]
    if not any(d["vendor"] != "cpu" for d in report["devices"]):
        assert any("no GPU" in item for item in report["limitations"])


@pytest.mark.skipif(shutil.which("npx") is None, reason="npx is not installed")
@pytest.mark.slow
def test_mcp_inspector_cli_lists_calls_and_reads(tmp_path):
    """An external client: the MCP Inspector's CLI lists tools, calls two, and reads a resource."""
    from .conftest import make_git_repo

    repo = make_git_repo(tmp_path / "repo")
    env = {**os.environ, **server_env(tmp_path / "h", tmp_path)}
    base = ["npx", "-y", "@modelcontextprotocol/inspector", "--cli",
            "-e", f"LOOM_HOME={tmp_path / 'h'}", "-e", f"LOOM_ALLOWED_ROOTS={tmp_path}", LOOM, "--stdio"]

    def inspector(*args: str) -> dict:
        done = subprocess.run([*base, *args], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    names = {t["name"] for t in inspector("--method", "tools/list")["tools"]}
    assert {"device_info", "start_campaign", "submit_candidate", "analyze_trace"} <= names
    info = inspector("--method", "tools/call", "--tool-name", "device_info")
    assert any(d["vendor"] == "cpu" for d in info["structuredContent"]["devices"])
    started = inspector("--method", "tools/call", "--tool-name", "start_campaign",
                        "--tool-arg", f"repo={repo}", "--tool-arg", "goal=inspector check")
    cid = started["structuredContent"]["campaign_id"]
    read = inspector("--method", "resources/read", "--uri", f"loom://campaigns/{cid}")
    assert json.loads(read["contents"][0]["text"])["id"] == cid


def processes_working_under(root: Path) -> list[int]:
    """Pids whose working directory lies under `root` (a job's cwd is its job directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/cwd").startswith(str(root)):
                    found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.mark.anyio
@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="needs /proc")
@pytest.mark.slow
async def test_idle_warm_workers_go_when_the_server_does(tmp_path):
    redteam = Path(__file__).parent / "redteam"
    for name in ("task_rmsnorm.py", "honest_torch.py"):
        shutil.copy(redteam / name, tmp_path / name)
    home = tmp_path / "home"
    async with Client(params(home, tmp_path)) as client:
        result = await client.call_tool("run_validation", {
            "task": str(tmp_path / "task_rmsnorm.py"), "candidate": str(tmp_path / "honest_torch.py")})
        assert result.is_error is False, result.content
        # Validation left a warm trusted worker for the next call.
        assert processes_working_under(home / "jobs" / "warm")
    deadline = time.monotonic() + 20
    while processes_working_under(home / "jobs" / "warm") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_working_under(home / "jobs" / "warm") == []


# ---- The README's main job: `loom-mcp demo` drives the loop through a real stdio server and
# ends with the cheat rejected, the candidate accepted and a report; every tool result stays
# compact.


@pytest.mark.slow
def test_demo_runs_the_whole_loop(tmp_path):
    done = subprocess.run([LOOM, "demo", "--workdir", str(tmp_path / "demo")], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-2])
    assert summary["cheat"] == "reject"
    assert summary["candidate"] == "accept"
    report = Path(summary["report"]).read_text()
    assert "Accepted chain" in report and "Every attempt" in report
    assert "speedup_png" in report and "breakdown_png" in report  # plots for people
    for step in ("device_info", "start_campaign", "profile", "analyze_trace", "compile_kernel",
                 "run_validation", "benchmark", "submit_candidate", "campaign_report"):
        assert step in summary["largest_result_bytes"], step
    too_big = {k: v for k, v in summary["largest_result_bytes"].items() if v > 4096}
    assert not too_big, f"tool results over 4 KB: {too_big}"
    if summary["wall_clock_accepts_allowed"]:  # a CPU-only machine: the demo must say why it accepts
        assert "sets [gate] accept_wall_clock = true" in done.stdout
        assert "only because this demo's loom.toml allows it" in done.stdout


def test_demo_config_says_when_it_allows_wall_clock_accepts(tmp_path):
    write_config(tmp_path / "cpu", tmp_path, cpu_only=True)
    notice = wall_clock_notice(tmp_path / "cpu")
    assert notice and "accept_wall_clock = true" in notice and "needs_review" in notice
    write_config(tmp_path / "gpu", tmp_path, cpu_only=False)
    assert wall_clock_notice(tmp_path / "gpu") is None
