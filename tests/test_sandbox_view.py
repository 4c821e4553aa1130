"""What a sandboxed job sees and may use: its own root (an allowlist), memory and disk limits.

Real jobs through `loom_mcp.sandbox.run_job`. The attacks each test stands for got through
before the root view existed: a host Unix socket reached past the network namespace, the
ledger, other campaigns' files and $HOME read, a 20 GB allocation that OOM-killed processes
across the machine, job files filling LOOM_HOME's disk.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from loom_mcp.sandbox import JobSpec, isolation, launcher, policy, procs, run_job, view
from loom_mcp.sandbox.isolation import capabilities, plan

PY = sys.executable


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _view_available() -> bool:
    return bool(plan(capabilities(), allow_network=False).get("view"))


needs_view = pytest.mark.skipif(not _view_available(), reason="no root view here: "
                                + str(capabilities()["probes"].get("view", {}).get("error")))


def py(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


# Reports, for each path in PROBE_PATHS (JSON), whether it exists, can be read, can be written.
PROBE = """
import json, os, socket, sys
from loom_mcp.worker.protocol import send_result
out = {}
for name, path in json.loads(os.environ["PROBE_PATHS"]).items():
    entry = {"exists": os.path.lexists(path)}
    try:
        with open(path, "rb") as f:
            entry["read"] = f.read(64).decode(errors="replace")
    except OSError as exc:
        entry["read"] = None
        entry["read_error"] = exc.strerror
    out[name] = entry
for name, path in json.loads(os.environ.get("PROBE_WRITE", "{}")).items():
    try:
        with open(path, "w") as f:
            f.write("written by the job")
        out[name] = "ok"
    except OSError as exc:
        out[name] = exc.strerror
for name, path in json.loads(os.environ.get("PROBE_SOCKETS", "{}")).items():
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(path)
            s.sendall(b"hello from the job")
        out[name] = "connected"
    except OSError as exc:
        out[name] = exc.strerror or str(exc)
out["home"] = os.environ["HOME"]
out["root_entries"] = sorted(os.listdir("/"))
send_result(out)
"""


def _probe(tmp_path: Path, *, paths: dict[str, Path] | None = None,
           write: dict[str, Path] | None = None, sockets: dict[str, Path] | None = None,
           **kw: object) -> JobSpec:
    env = {"PROBE_PATHS": json.dumps({k: str(v) for k, v in (paths or {}).items()}),
           "PROBE_WRITE": json.dumps({k: str(v) for k, v in (write or {}).items()}),
           "PROBE_SOCKETS": json.dumps({k: str(v) for k, v in (sockets or {}).items()})}
    return JobSpec(argv=[PY, "-c", PROBE], job_dir=tmp_path / "job", env=env, timeout_s=60, **kw)


class _Listener:
    """A Unix socket on the host file system that remembers whether anyone connected."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.sock.setblocking(False)

    def accepted(self) -> int:
        count = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return count
            conn.close()
            count += 1

    def close(self) -> None:
        self.sock.close()


# ----------------------------------------------------------------------------- the root view


@needs_view
@pytest.mark.anyio
async def test_a_job_cannot_connect_to_a_host_unix_socket(tmp_path: Path) -> None:
    """An AF_UNIX path is a file: the network namespace does not cover it (docker.sock,
    ssh-agent, X11 sockets). Outside the job's root it does not exist."""
    outside = tmp_path / "outside"
    outside.mkdir()
    host = _Listener(outside / "agent.sock")
    try:
        res = await run_job(_probe(tmp_path, sockets={"host": host.path}))
        assert res.ok, res.stderr_tail
        assert res.view == "allowlist"
        assert res.result["host"] == "No such file or directory"
        assert host.accepted() == 0
    finally:
        host.close()


@needs_view
@pytest.mark.anyio
async def test_a_socket_in_a_readable_directory_stays_reachable(tmp_path: Path) -> None:
    """How a benchmark's arms reach its timer: a socket directory bound read-only (connect()
    needs no write access to the mount; replacing the socket would)."""
    sock_dir = tmp_path / "socks"
    sock_dir.mkdir()
    host = _Listener(sock_dir / "timer.sock")
    try:
        res = await run_job(_probe(tmp_path, sockets={"timer": host.path},
                                   write={"replace": sock_dir / "other.sock"}, readable=[sock_dir]))
        assert res.ok, res.stderr_tail
        assert res.result["timer"] == "connected"
        assert res.result["replace"] == "Read-only file system"
        assert host.accepted() == 1
    finally:
        host.close()


@needs_view
@pytest.mark.anyio
async def test_a_job_sees_only_its_readable_and_writable_paths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger, loom.toml, other campaigns' candidates, a secret next to the task, $HOME and
    /etc/shadow are not in the job's root; its candidate directory is (read-only) and its job
    directory is writable."""
    home = tmp_path / "loom-home"
    (home / "jobs").mkdir(parents=True)
    (home / "ledger.sqlite3").write_text("ledger")
    (home / "loom.toml").write_text("[gate]\n")
    other = tmp_path / "other-campaign"
    other.mkdir()
    (other / "candidate.py").write_text("theirs")
    mine = tmp_path / "campaign"
    mine.mkdir()
    (mine / "candidate.py").write_text("mine")
    user_home = tmp_path / "user-home"
    (user_home / ".ssh").mkdir(parents=True)
    (user_home / ".ssh" / "id_ed25519").write_text("private key")
    monkeypatch.setenv("HOME", str(user_home))
    monkeypatch.setenv("LOOM_HOME", str(home))
    monkeypatch.setattr(policy, "_configured", None)
    spec = _probe(home / "jobs" / "v1", readable=[mine], paths={
        "ledger": home / "ledger.sqlite3", "config": home / "loom.toml",
        "other": other / "candidate.py", "mine": mine / "candidate.py",
        "key": user_home / ".ssh" / "id_ed25519", "shadow": Path("/etc/shadow"),
        "gshadow": Path("/etc/gshadow"), "passwd": Path("/etc/passwd")},
        write={"job_dir": home / "jobs" / "v1" / "job" / "out.txt",
               "mine_w": mine / "candidate.py", "tmp": Path("/tmp/scratch")})
    res = await run_job(spec)
    assert res.ok, res.stderr_tail
    out = res.result
    for hidden in ("ledger", "config", "other", "key", "shadow", "gshadow"):
        assert out[hidden]["exists"] is False, (hidden, out[hidden])
    assert out["mine"]["read"] == "mine"
    assert out["passwd"]["read"]  # the loader and getpass need it
    assert out["job_dir"] == "ok" and out["tmp"] == "ok"
    assert out["mine_w"] == "Read-only file system"
    assert (mine / "candidate.py").read_text() == "mine"
    assert out["home"] == str((home / "jobs" / "v1" / "job" / "home").resolve())
    assert out["home"] != str(user_home)
    assert not Path("/tmp/scratch").exists() or Path("/tmp/scratch").read_text() != "written by the job"


@needs_view
@pytest.mark.anyio
async def test_loom_home_is_masked_inside_a_readable_root(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trusted job reads whole allowed roots; LOOM_HOME inside one stays hidden (the ledger,
    loom.toml), except the job's own directories, bound on top."""
    root = tmp_path / "root"
    home = root / "loom-home"
    (home / "jobs").mkdir(parents=True)
    (home / "ledger.sqlite3").write_text("ledger")
    (root / "task.py").write_text("task")
    monkeypatch.setattr(policy, "_configured", policy.SandboxPolicy(
        memory_bytes=0, disk_bytes=0, trusted_roots=(root,), loom_home=home))
    spec = _probe(home / "jobs" / "v1", readable=[root], paths={
        "ledger": home / "ledger.sqlite3", "task": root / "task.py"},
        write={"job_dir": home / "jobs" / "v1" / "job" / "out.txt", "task_w": root / "task.py"})
    res = await run_job(spec)
    assert res.ok, res.stderr_tail
    assert res.result["ledger"]["exists"] is False
    assert res.result["task"]["read"] == "task"
    assert res.result["job_dir"] == "ok"
    assert res.result["task_w"] == "Read-only file system"


@needs_view
@pytest.mark.anyio
async def test_shm_dir_is_shared_between_jobs(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    res = await run_job(JobSpec(argv=py("open('/dev/shm/seg', 'w').write('shared')"),
                                job_dir=tmp_path / "a", shm_dir=shm))
    assert res.ok, res.stderr_tail
    assert (shm / "seg").read_text() == "shared"
    # Without shm_dir, /dev/shm is the job's own.
    res = await run_job(JobSpec(argv=py("open('/dev/shm/own', 'w').write('x')"), job_dir=tmp_path / "b"))
    assert res.ok, res.stderr_tail
    assert not Path("/dev/shm/own").exists()


@needs_view
@pytest.mark.anyio
async def test_a_failed_view_fails_the_job_rather_than_show_the_host_tree(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe built a root here, so a required entry failing is this job's paths (or someone
    swapping them): the job does not run, not even with the host's tree read-only. (The
    read-only tree is for machines whose probe fails, or LOOM_SANDBOX_VIEW=readonly.)"""
    real = view.job_view

    def broken(**kw):
        return [*real(**kw), {"op": "bind", "path": "/no-such-source", "src": "/no-such-source",
                              "mode": "ro", "optional": False}]

    monkeypatch.setattr(view, "job_view", broken)
    target = tmp_path / "outside.txt"
    target.write_text("kept")
    res = await run_job(_probe(tmp_path, write={"outside": target}))
    assert res.returncode == launcher.SETUP_FAILED and res.result is None, res
    assert "the job's root could not be built" in res.stderr_tail
    assert "/no-such-source" in res.stderr_tail
    assert target.read_text() == "kept"


def test_the_plan_never_binds_the_host_root_home_or_loom_home(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sys.path may hold the server's start directory (/tmp, $HOME): never bound as a system
    path; an explicit bind of / is refused."""
    monkeypatch.setattr(sys, "path", [*sys.path, "/tmp", str(Path.home()), "/"])
    (tmp_path / "job").mkdir()
    view._system_plan.cache_clear()
    try:
        ops = view.job_view(job_dir=tmp_path / "job", readable=[tmp_path / "missing"])
    finally:
        view._system_plan.cache_clear()
    binds = {op["path"] for op in ops if op["op"] == "bind"}
    assert not binds & {"/", "/tmp", str(Path.home().resolve())}
    assert not any(op["op"] == "bind" and op["path"].startswith("/etc/shadow") for op in ops)
    with pytest.raises(ValueError):
        view.job_view(job_dir=tmp_path / "job", writable=[Path("/")])


@needs_view
@pytest.mark.anyio
async def test_a_compiler_named_by_cc_runs_with_its_whole_toolchain(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton builds its launcher with $CC. A toolchain outside PATH (/opt/gcc/bin/gcc on the
    H200 machine) is in the job's root with its prefix: the driver runs a helper from its own
    libexec/, as gcc runs cc1."""
    prefix = tmp_path / "gcc-toolchain"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "libexec").mkdir()
    helper = prefix / "libexec" / "cc1"
    helper.write_text("#!/bin/sh\necho compiled-by-cc1\n")
    helper.chmod(0o755)
    driver = prefix / "bin" / "gcc"
    driver.write_text('#!/bin/sh\nexec "$(dirname "$0")/../libexec/cc1"\n')
    driver.chmod(0o755)
    monkeypatch.setenv("CC", f"{driver} -m64")
    view._system_plan.cache_clear()
    try:
        code = """
import os, subprocess
from loom_mcp.worker.protocol import send_result
cc = os.environ["CC"].split()[0]
out = subprocess.run([cc], capture_output=True, text=True)
send_result({"stdout": out.stdout.strip(), "rc": out.returncode})
"""
        res = await run_job(JobSpec(argv=[PY, "-c", code], job_dir=tmp_path / "job",
                                    env={"CC": os.environ["CC"]}, timeout_s=60))
    finally:
        view._system_plan.cache_clear()
    assert res.ok, res.stderr_tail
    assert res.result == {"stdout": "compiled-by-cc1", "rc": 0}


# ----------------------------------------------------------------------------- memory


MEMORY_BOMB = """
import os, sys
from loom_mcp.worker.protocol import send_result
blocks = []
for _ in range(64):  # 64 x 64 MiB, touched
    blocks.append(bytearray(64 << 20))
send_result({"allocated": len(blocks) * 64})
"""


@pytest.mark.anyio
async def test_memory_beyond_the_limit_is_reported(tmp_path: Path) -> None:
    res = await run_job(JobSpec(argv=py(MEMORY_BOMB), job_dir=tmp_path / "job",
                                max_memory_bytes=512 << 20, timeout_s=120))
    assert not res.ok and res.result is None, res
    assert res.memory_limit in ("cgroup", "rlimit")
    assert res.memory_exceeded, (res.signal, res.stderr_tail[-500:])
    assert "memory limit" in res.failure()


@pytest.mark.anyio
async def test_memory_limit_by_rlimit_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a memory cgroup the launcher sets RLIMIT_DATA: the allocation fails with
    MemoryError inside the job, and the result says the limit was hit."""
    real = isolation.plan
    monkeypatch.setattr(isolation, "plan", lambda caps, allow_network: {
        **real(caps, allow_network), "memory": "rlimit"})
    res = await run_job(JobSpec(argv=py(MEMORY_BOMB), job_dir=tmp_path / "job",
                                max_memory_bytes=512 << 20, timeout_s=120))
    assert res.memory_limit == "rlimit"
    assert res.memory_exceeded and "MemoryError" in res.stderr_tail, res.stderr_tail[-500:]
    # Under the limit nothing is reported.
    ok = await run_job(JobSpec(argv=py("x = bytearray(64 << 20)"), job_dir=tmp_path / "job2",
                               max_memory_bytes=512 << 20))
    assert ok.ok and not ok.memory_exceeded, ok.stderr_tail


# ----------------------------------------------------------------------------- disk


DISK_FILL = """
import os, time
chunk = b"x" * (4 << 20)
with open("fill.bin", "wb") as f:
    for i in range(256):  # 1 GiB at most, slowly enough for a 1 s check
        f.write(chunk)
        f.flush()
        time.sleep(0.02)
print("wrote everything")
"""


@pytest.mark.anyio
async def test_a_job_writing_past_its_disk_quota_is_killed(tmp_path: Path) -> None:
    res = await run_job(JobSpec(argv=py(DISK_FILL), job_dir=tmp_path / "job",
                                max_disk_bytes=32 << 20, timeout_s=60))
    assert res.disk_exceeded and not res.ok, res
    assert "wrote everything" not in res.stdout_tail
    assert "disk quota" in res.failure()
    assert (tmp_path / "job" / "fill.bin").stat().st_size < 512 << 20


@needs_view
@pytest.mark.anyio
async def test_the_private_tmp_is_as_large_as_the_quota(tmp_path: Path) -> None:
    code = """
    import errno
    try:
        with open("/tmp/big", "wb") as f:
            for _ in range(64):
                f.write(b"x" * (1 << 20))
        print("no limit")
    except OSError as exc:
        print(errno.errorcode[exc.errno])
    """
    res = await run_job(JobSpec(argv=py(code), job_dir=tmp_path / "job", max_disk_bytes=16 << 20))
    assert res.stdout_tail.strip() == "ENOSPC", res.stdout_tail


def test_disk_usage_counts_each_file_once_and_follows_no_link(tmp_path: Path) -> None:
    from loom_mcp.sandbox.disk import disk_usage

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_bytes(b"x" * (1 << 20))
    os.link(tmp_path / "a" / "f", tmp_path / "a" / "g")
    (tmp_path / "a" / "link").symlink_to("/usr")
    used = disk_usage((tmp_path, tmp_path / "a"))
    assert 1 << 20 <= used < 2 << 20


# ----------------------------------------------------------------------------- doctor


def test_isolation_report_names_every_protection() -> None:
    report = isolation.isolation_report()
    for key in ("network", "process_tree", "root_view", "etc_secrets", "host_sockets", "loom_home",
                "home", "memory_limit", "disk_quota", "process_limit", "capabilities", "bwrap",
                "blank_workers"):
        assert isinstance(report[key], str) and report[key], key
    if _view_available():
        assert report["root_view"].startswith("allowlist")
        assert not report["etc_secrets"].startswith("not ")
        late = isolation.capabilities()["probes"]["late"]
        assert report["blank_workers"].startswith("available" if late["ok"] else "not available"), late


@pytest.mark.anyio
async def test_many_jobs_leave_no_cgroups_behind(tmp_path: Path) -> None:
    dirs = [path for _, path in procs.cgroup_parents().values()]

    def ours() -> set[str]:
        return {str(e) for d in dirs for e in d.glob(f"loom-{os.getpid()}-*")}

    before = ours()
    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(run_job, JobSpec(argv=py("pass"), job_dir=tmp_path / f"j{i}"))
    assert ours() == before


@pytest.mark.anyio
async def test_a_command_past_its_disk_quota_is_a_resource_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmark_command's runs carry the server's limits; hitting one is [RESOURCE_LIMIT], not
    a broken command."""
    from loom_mcp.bench.command import benchmark_commands
    from loom_mcp.errors import LoomError

    monkeypatch.setattr(policy, "_configured", policy.SandboxPolicy(
        memory_bytes=0, disk_bytes=16 << 20, trusted_roots=(), loom_home=None))
    argv = py(DISK_FILL)
    with pytest.raises(LoomError, match=r"\[RESOURCE_LIMIT\] baseline run 1/3 wrote more than its disk"):
        await benchmark_commands(baseline=argv, candidate=argv, metrics=None, runs=3,
                                 job_dir=tmp_path / "job", timeout_s=30, cwd=None, env=None,
                                 parser="auto")
