"""LOOM_HOME faults and rule tampering: a ledger that is not a sound loom ledger, a loom.toml
that broke or changed under a running server, budgets raised in the ledger, a full disk, a
read-only LOOM_HOME, secrets in the worker environment and weak HTTP bearer tokens.

Startup refusals run the installed console script as a real subprocess (exit status, one coded
line on stderr, nothing on stdout, no traceback); tool-visible behaviour goes through the MCP
protocol in process."""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import anyio
import git
import orjson
import pytest
from mcp import Client

from loom_mcp.cli import token_problem
from loom_mcp.config import load_config
from loom_mcp.errors import ErrorCode, LoomError, storage_error
from loom_mcp.runtime import CallScope, open_services, run_recorded
from loom_mcp.sandbox import isolation, procs, warm
from loom_mcp.sandbox.env import worker_env
from loom_mcp.server import build_server
from loom_mcp.store import Ledger

from .conftest import make_git_repo

LOOM = str(Path(sys.executable).with_name("loom-mcp"))
REDTEAM = Path(__file__).parent / "redteam"

# What an agent's benchmark_command appended to LOOM_HOME/loom.toml to loosen the human's gate.
# Appended to a file that already has a [gate] table it no longer parses (TOML forbids declaring
# a table twice): the next start must refuse it with [CONFIG_INVALID] and the file:line, never
# fall back to defaults.
GATE_APPEND_ATTACK = """
[gate]
min_gain = -1.0
max_plausible_speedup = 1000000.0
accept_wall_clock = true
"""
# An agent that reached the ledger raises every campaign's budgets far above the human's ceilings.
# Budgets are re-capped by the server's configured ceilings at every check, so this must not let
# one more candidate through.
RAISE_BUDGET_ATTACK = (
    "UPDATE campaigns SET budgets_json = '{\"gpu_seconds\": 1e9, \"candidates\": 100000, \"wall_seconds\": 1e9}';"
)
DEMO = resources.files("loom_mcp") / "demo_data"


def spawn(home: Path, roots: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The console script, stdin at EOF: a server that does start exits at once (status 0)."""
    environ = {**os.environ, "LOOM_ALLOWED_ROOTS": str(roots), "PYTHONUNBUFFERED": "1", **env}
    environ.pop("LOOM_HOME", None)
    if "LOOM_HTTP_TOKEN" not in env:
        environ.pop("LOOM_HTTP_TOKEN", None)
    return subprocess.run([LOOM, "--home", str(home), *(args or ("--stdio",))],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, env=environ,
                          timeout=120)


def assert_refused(done: subprocess.CompletedProcess, status: int, code: str) -> str:
    assert done.returncode == status, (done.returncode, done.stderr[-3000:])
    assert done.stdout == ""  # stdout is the MCP wire
    assert f"[{code}]" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stderr


def env_for(tmp_path: Path) -> dict[str, str]:
    return {"LOOM_ALLOWED_ROOTS": str(tmp_path)}


def text_of(result) -> str:
    return " ".join(getattr(c, "text", "") for c in result.content)


# ----------------------------------------------------------------------------- the ledger


def real_ledger(path: Path, calls: int = 300) -> None:
    """A ledger with a few pages of history, checkpointed into its main file."""
    ledger = Ledger(path)
    for i in range(calls):
        ledger.end_call(ledger.begin_call("device_info", {"i": i}), "ok")
    ledger.close()
    assert not Path(f"{path}-wal").exists()


def write_garbage(path: Path) -> None:
    path.write_bytes(os.urandom(8192))


def write_empty(path: Path) -> None:
    path.write_bytes(b"")


def write_truncated(path: Path) -> None:
    real_ledger(path)
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


def write_foreign(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE moz_places (id INTEGER PRIMARY KEY, url TEXT)")
    db.execute("INSERT INTO moz_places(url) VALUES ('https://example.invalid')")
    db.commit()
    db.close()


def write_hollow(path: Path) -> None:
    """Stamped with our schema version, but the tables are not ours."""
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE calls (id INTEGER PRIMARY KEY)")
    db.execute("PRAGMA user_version=4")
    db.commit()
    db.close()


BROKEN_LEDGERS = {
    "garbage": (write_garbage, "not an SQLite database"),
    "zero_bytes": (write_empty, "is empty (0 bytes"),
    "truncated": (write_truncated, "is damaged"),
    "foreign_schema": (write_foreign, "not a loom ledger"),
    "hollow_schema": (write_hollow, "does not have the schema"),
}


@pytest.mark.parametrize("kind", sorted(BROKEN_LEDGERS))
def test_a_broken_ledger_is_refused_at_start_and_never_recreated(tmp_path, kind):
    home = tmp_path / "home"
    home.mkdir()
    ledger = home / "ledger.sqlite3"
    write, reason = BROKEN_LEDGERS[kind]
    write(ledger)
    before = ledger.read_bytes()
    stderr = assert_refused(spawn(home, tmp_path), 3, "LEDGER_CORRUPT")
    assert reason in stderr
    assert "mv " in stderr and "creates a new one" in stderr  # the recovery hint
    if kind != "zero_bytes":
        assert ".recover" in stderr
    assert ledger.read_bytes() == before  # not recreated, not migrated, not touched
    with pytest.raises(LoomError) as raised:
        Ledger(ledger)
    assert raised.value.code is ErrorCode.LEDGER_CORRUPT
    assert ledger.read_bytes() == before


def test_only_a_missing_ledger_is_created(tmp_path):
    home = tmp_path / "home"
    done = spawn(home, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == ""
    ledger = Ledger(home / "ledger.sqlite3")
    assert ledger.schema_version() >= 1
    assert not list(home.glob(".ledger-new-*"))  # built aside, linked into place, cleaned up


def test_a_ledger_whose_first_migration_never_committed_is_migrated(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")  # header written, then the process died
    db.close()
    assert Ledger(path).schema_version() >= 1


# ----------------------------------------------------------------------------- loom.toml


def base_toml(tmp_path: Path, candidates: int = 5) -> str:
    return (f'allowed_roots = ["{tmp_path}"]\n[budgets]\ncandidates = {candidates}\n'
            "[gate]\nmin_gain = 0.05\n")


def test_an_unparsable_loom_toml_is_refused_with_file_line_and_a_recovery_hint(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    config_file = home / "loom.toml"
    config_file.write_text(base_toml(tmp_path))
    first = spawn(home, tmp_path)  # a good start: remembers the file it started with
    assert first.returncode == 0, first.stderr[-2000:]
    payload = GATE_APPEND_ATTACK
    config_file.write_text(config_file.read_text() + payload)
    line = config_file.read_text().splitlines().index("[gate]", 5) + 1  # the second [gate]
    stderr = assert_refused(spawn(home, tmp_path), 2, "CONFIG_INVALID")
    assert f"{config_file}:{line}:" in stderr
    assert "loom.toml.last-start" in stderr and "diff " in stderr
    # The doctor says the same, and exits non-zero, without serving.
    doctor = spawn(home, tmp_path, "doctor", "--json")
    assert doctor.returncode == 1, doctor.stderr[-2000:]
    state = orjson.loads(doctor.stdout)["state"]
    assert state["loom.toml"].startswith("[CONFIG_INVALID]")
    assert "changed on disk since the server last started" in state["loom.toml since the last start"]


def test_an_invalid_value_is_refused_with_its_key_and_line(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "loom.toml").write_text(base_toml(tmp_path) + "min_gian = 3\n")
    stderr = assert_refused(spawn(home, tmp_path), 2, "CONFIG_INVALID")
    assert f"{home / 'loom.toml'}:6: gate.min_gian" in stderr


@pytest.mark.anyio
async def test_loom_toml_edited_while_the_server_runs_is_reported_not_applied(tmp_path):
    repo = make_git_repo(tmp_path / "target")
    home = tmp_path / "home"
    home.mkdir()
    config_file = home / "loom.toml"
    config_file.write_text(base_toml(tmp_path))
    async with Client(build_server(load_config(home, environ=env_for(tmp_path)))) as client:
        first = (await client.call_tool("start_campaign", {"repo": str(repo), "goal": "g"})).structured_content
        assert "WARNING" not in first["next_step"]
        rules = first["config_fingerprint"]

        # A valid edit that loosens everything: reported, not applied.
        config_file.write_text(base_toml(tmp_path, candidates=100000).replace("0.05", "0.0"))
        second = (await client.call_tool("start_campaign", {"repo": str(repo), "goal": "g"})).structured_content
        assert "loom.toml changed on disk since the server started" in second["next_step"]
        assert "keeps the rules it started with" in second["next_step"]
        assert f"rules fingerprint {rules} -> " in second["next_step"]
        assert second["config_fingerprint"] == rules and second["budgets"]["candidates"] == 5

        # The attack payload: the file no longer loads; the server goes on under its rules.
        config_file.write_text(base_toml(tmp_path) + GATE_APPEND_ATTACK)
        report = await client.call_tool("campaign_report", {"campaign_id": first["campaign_id"]})
        assert report.is_error is False, text_of(report)
        assert "loom.toml changed on disk since the server started" in report.structured_content["next_step"]
        assert "no longer loads: [CONFIG_INVALID]" in report.structured_content["next_step"]
        data = orjson.loads(Path(report.structured_content["files"]["json"]).read_bytes())
        assert data["fingerprint"]["config_fingerprint"] == rules
        assert data["fingerprint"]["server_config_fingerprint"] == rules
        assert any("changed on disk" in w for w in data["fingerprint"]["warnings"])
        # Errors carry the warning too.
        failed = await client.call_tool("campaign_report", {"campaign_id": "c-nope"})
        assert failed.is_error and "[NOT_FOUND]" in text_of(failed)
        assert "changed on disk" in text_of(failed)

        # Put back as it was: no more warning.
        config_file.write_text(base_toml(tmp_path))
        third = (await client.call_tool("start_campaign", {"repo": str(repo), "goal": "g"})).structured_content
        assert "WARNING" not in third["next_step"]


# ----------------------------------------------------------------------------- budgets


@pytest.mark.anyio
async def test_a_budget_raised_in_the_ledger_lets_no_more_candidates_through(tmp_path):
    repo = make_git_repo(tmp_path / "target")
    for name in ("task.py", "candidate.py"):
        (repo / name).write_text((DEMO / name).read_text())
    r = git.Repo(repo)
    r.index.add(["task.py"])
    r.index.commit("task")
    home = tmp_path / "home"
    home.mkdir()
    (home / "loom.toml").write_text(base_toml(tmp_path, candidates=1))
    async with Client(build_server(load_config(home, environ=env_for(tmp_path)))) as client:
        started = await client.call_tool("start_campaign", {"repo": str(repo), "goal": "g"})
        cid = started.structured_content["campaign_id"]
        assert started.structured_content["budgets"]["candidates"] == 1
        db = sqlite3.connect(home / "ledger.sqlite3")
        # One candidate already judged (the whole budget), as if submitted before...
        db.execute("INSERT INTO submissions(id, campaign_id, created_at, status, task, task_sha,"
                   " candidate, candidate_sha, pid) VALUES ('s-old', ?, ?, 'reject', 't', 'x', 'c', 'y', 1)",
                   (cid, time.time()))
        # ...then the agent raises the budget in the ledger.
        db.executescript(RAISE_BUDGET_ATTACK)
        db.commit()
        db.close()
        submitted = await client.call_tool("submit_candidate", {
            "campaign_id": cid, "task": str(repo / "task.py"), "candidate": str(repo / "candidate.py")})
        message = text_of(submitted)
        assert submitted.is_error and "[BUDGET_EXHAUSTED]" in message, message
        assert "above this server's ceilings" in message and "candidates 100000 > 1" in message
        resource = await client.read_resource(f"loom://campaigns/{cid}")
        row = orjson.loads(resource.contents[0].text)
        assert row["budgets"]["candidates"] == 100000 and row["budgets_in_force"]["candidates"] == 1
        report = await client.call_tool("campaign_report", {"campaign_id": cid})
        assert report.structured_content["budgets"]["limit"]["candidates"] == 1


# ----------------------------------------------------------------------------- disk full, read-only


@pytest.fixture
def mounts():
    """Mount tmpfs file systems (root only); unmounted, lazily, at teardown."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root on Linux to mount a tmpfs")
    mounted: list[Path] = []

    def mount(target: Path, options: str) -> Path:
        target.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"mount not permitted here: {done.stderr.strip()}")
        mounted.append(target)
        return target

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def fill(directory: Path) -> Path:
    filler = directory / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


@pytest.mark.anyio
async def test_a_full_disk_is_a_coded_error_and_the_server_lives_on(tmp_path, mounts):
    repo = make_git_repo(tmp_path / "target")
    home = mounts(tmp_path / "home", "size=2m")
    async with Client(build_server(load_config(home, environ=env_for(tmp_path)))) as client:
        started = await client.call_tool("start_campaign", {"repo": str(repo), "goal": "g"})
        assert started.is_error is False, text_of(started)
        cid = started.structured_content["campaign_id"]
        filler = fill(home)
        for tool, args in (("start_campaign", {"repo": str(repo), "goal": "g"}),
                           ("campaign_report", {"campaign_id": cid})):
            result = await client.call_tool(tool, args)
            message = text_of(result)
            assert result.is_error and "[DISK_FULL]" in message, message
            assert "[INTERNAL]" not in message and "free space" in message
        filler.unlink()
        again = await client.call_tool("start_campaign", {"repo": str(repo), "goal": "g"})
        assert again.is_error is False, text_of(again)


@pytest.mark.anyio
async def test_a_read_only_part_of_loom_home_is_a_coded_error(tmp_path, mounts):
    repo = make_git_repo(tmp_path / "target")
    home = tmp_path / "home"
    async with Client(build_server(load_config(home, environ=env_for(tmp_path)))) as client:
        started = await client.call_tool("start_campaign", {"repo": str(repo), "goal": "g"})
        cid = started.structured_content["campaign_id"]
        mounts(home / "reports", "ro,size=1m")
        result = await client.call_tool("campaign_report", {"campaign_id": cid})
        message = text_of(result)
        assert result.is_error and "[READ_ONLY]" in message, message
        assert "read-write" in message


def test_a_read_only_loom_home_is_refused_at_start(tmp_path, mounts):
    home = mounts(tmp_path / "home", "size=4m")
    Ledger(home / "ledger.sqlite3").close()
    subprocess.run(["mount", "-o", "remount,ro", str(home)], check=True)
    stderr = assert_refused(spawn(home, tmp_path), 3, "READ_ONLY")
    assert str(home) in stderr and "--home" in stderr


def test_a_full_loom_home_is_refused_at_start(tmp_path, mounts):
    home = mounts(tmp_path / "home", "size=1m")
    fill(home)
    assert_refused(spawn(home, tmp_path), 3, "DISK_FULL")


@pytest.mark.anyio
async def test_the_fault_reaches_the_agent_when_the_ledger_cannot_record_it(tmp_path, monkeypatch):
    from mcp.server.mcpserver.exceptions import ToolError

    services = open_services(load_config(tmp_path / "home", environ=env_for(tmp_path)))

    def ledger_full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    async def body(scope: CallScope):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "home" / "jobs" / "x"))

    monkeypatch.setattr(services.ledger, "end_call", ledger_full)
    with pytest.raises(ToolError, match=r"^\[DISK_FULL\] no space left .*not in the ledger either"):
        await run_recorded(services, "profile", {}, body)
    monkeypatch.setattr(services.ledger, "begin_call", ledger_full)
    with pytest.raises(ToolError, match=r"^\[DISK_FULL\] .*profile was not run: the ledger could not record it"):
        await run_recorded(services, "profile", {}, body)


def test_storage_errors_are_classified(tmp_path):
    home = tmp_path
    assert storage_error(OSError(errno.EDQUOT, "Disk quota exceeded", "/x"), home).code is ErrorCode.DISK_FULL
    assert storage_error(OSError(errno.EROFS, "Read-only file system", "/x"), home).code is ErrorCode.READ_ONLY
    denied = OSError(errno.EACCES, "Permission denied", str(home / "artifacts" / "ab"))
    assert storage_error(denied, home).code is ErrorCode.READ_ONLY
    # Permission denied elsewhere is not LOOM_HOME's problem.
    assert storage_error(OSError(errno.EACCES, "Permission denied", "/etc/shadow"), home) is None
    readonly_db = sqlite3.OperationalError("attempt to write a readonly database")
    assert storage_error(readonly_db, home).code is ErrorCode.READ_ONLY
    wrapped = RuntimeError("while writing")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert storage_error(wrapped, home).code is ErrorCode.DISK_FULL
    assert storage_error(ValueError("nope"), home) is None


# ----------------------------------------------------------------------------- environment


def test_worker_env_drops_credentials_under_allowed_prefixes():
    parent = {
        "PATH": "/usr/bin",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
        "CUDA_VISIBLE_DEVICES": "0",
        "CUDA_HOME": "/usr/local/cuda",
        "CUDA_LAUNCH_BLOCKING": "1",
        "NVIDIA_VISIBLE_DEVICES": "all",
        "HIP_VISIBLE_DEVICES": "0",
        "ROCR_VISIBLE_DEVICES": "0",
        "TORCH_CUDA_ARCH_LIST": "9.0",
        "TORCHINDUCTOR_CACHE_DIR": "/c",
        "TRITON_CACHE_DIR": "/t",
        "OMP_NUM_THREADS": "4",
        # credentials, several under allowed prefixes
        "CUDA_CREDS": "user:pw",
        "CUDAFOO": "x",
        "MY_PASSWORD": "p",
        "TRITON_DB_PASS": "p",
        "TORCH_SESSION_ID": "s",
        "HIP_SIGNING_KEY": "k",
        "ROCM_CLIENT_CERT": "/cert.pem",
        "NVIDIA_API_KEY": "nvapi-x",
        "AMD_PORTAL_LOGIN": "x",
        "TORCHELASTIC_RUN_ID": "x",
        "TORCHINDUCTOR_REDIS_URL": "redis://loom:hunter2@cache:6379/0",
        "LOOM_GO_SIGNER": "inherited-not-forwarded",
    }
    env = worker_env({"LOOM_GO_SIGNER": "token", "LOOM_NONCE": "7", "SERVICE_PASSWORD": "p"},
                     parent=parent)
    for name in ("LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_LAUNCH_BLOCKING",
                 "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                 "TORCH_CUDA_ARCH_LIST", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                 "OMP_NUM_THREADS"):
        assert env[name] == parent[name], name
    for name in ("CUDA_CREDS", "CUDAFOO", "MY_PASSWORD", "TRITON_DB_PASS", "TORCH_SESSION_ID",
                 "HIP_SIGNING_KEY", "ROCM_CLIENT_CERT", "NVIDIA_API_KEY", "AMD_PORTAL_LOGIN",
                 "TORCHELASTIC_RUN_ID", "TORCHINDUCTOR_REDIS_URL", "SERVICE_PASSWORD"):
        assert name not in env, name
    # What the server hands its own workers on purpose goes through; the parent's copy does not.
    assert env["LOOM_GO_SIGNER"] == "token" and env["LOOM_NONCE"] == "7"


# ----------------------------------------------------------------------------- HTTP bearer token


def test_bearer_token_rule():
    import secrets

    assert token_problem(secrets.token_urlsafe(32)) is None
    assert token_problem(" " * 16) == "it contains whitespace"
    assert token_problem("  " + secrets.token_urlsafe(32)) == "it contains whitespace"
    assert token_problem("Ab3-_x9Z") == "it has 8 characters"
    assert "different characters" in token_problem("ab" * 16)
    assert "characters other than" in token_problem("ä" * 4 + secrets.token_urlsafe(16))
    assert token_problem(secrets.token_hex(16) + "==") is None


@pytest.mark.parametrize("token", [" " * 16, "\t" * 20, "short-Tok3n", "abababababababababab"])
def test_a_weak_bearer_token_is_refused(tmp_path, token):
    done = spawn(tmp_path / "h", tmp_path, "--http", "--host", "0.0.0.0", "--allow-remote",
                 LOOM_HTTP_TOKEN=token)
    assert done.returncode == 2 and done.stdout == ""
    assert "LOOM_HTTP_TOKEN is not an acceptable bearer token" in done.stderr
    assert "at least 16 characters, at least 8 of them different" in done.stderr


def test_a_weak_bearer_token_is_refused_on_loopback_too(tmp_path):
    done = spawn(tmp_path / "h", tmp_path, "--http", "--port", "1", LOOM_HTTP_TOKEN="t" * 32)
    assert done.returncode == 2 and "only 1 different characters" in done.stderr


# ---- cancelling a request
# Cancelling an MCP request kills the job it started: the worker tree is gone and the ledger
# records the call as cancelled, while the server keeps serving.

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
