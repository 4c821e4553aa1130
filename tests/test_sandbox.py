"""The execution sandbox, exercised with real child processes."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import anyio
import pytest

from loom_mcp.judge import first_visible
from loom_mcp.models import DeviceInfo
from loom_mcp.placement import job_placement
from loom_mcp.sandbox import (
    JobSpec,
    isolation,
    isolation_report,
    launcher,
    run_job,
    runner,
    view,
    warm,
    worker_env,
)
from loom_mcp.sandbox.isolation import capabilities, plan

PY = sys.executable


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["auto", "user+net", "bare"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the machine's best isolation, and again with the fallbacks forced.

    "user+net" has no pid namespace and "bare" no namespace at all: the launcher is then a
    subreaper and ends the tree by scanning /proc.
    """
    if request.param == "auto":
        return "auto"
    features = {"user+net": ["user", "net"], "bare": []}[request.param]
    if features and not capabilities()["probes"].get(request.param, {}).get("ok"):
        pytest.skip(f"{request.param} namespaces not available here")
    monkeypatch.setattr(
        isolation, "plan", lambda caps, allow_network: {"unshare": features, "limit_by": None}
    )
    return request.param


def py(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


def spec(tmp_path: Path, argv: list[str], **kw: object) -> JobSpec:
    return JobSpec(argv=argv, job_dir=tmp_path / "job", **kw)


def pids_with(marker: str) -> list[int]:
    """Host pids whose command line contains `marker` (zombies have an empty cmdline)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# A worker that leaves a setsid()'d, double-forked grandchild behind and then hangs.
ESCAPER = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", "{marker}"])
    os._exit(0)
time.sleep(600)
"""


async def watch_for(marker: str, found: list[int]) -> None:
    while not found:
        found.extend(pids_with(marker))
        await anyio.sleep(0.02)


# ----------------------------------------------------------------------------- basics


@pytest.mark.anyio
async def test_result_over_private_pipe_and_request(tmp_path: Path) -> None:
    code = """
    import os
    from loom_mcp.worker.protocol import read_request, send_result
    req = read_request()
    print("log line on stdout")
    send_result({"echo": req, "cwd": os.getcwd(), "big": "x" * (4 << 20)})
    """
    res = await run_job(spec(tmp_path, py(code), request={"n": 7, "s": "hé"}))
    assert res.ok, res.stderr_tail
    assert res.result is not None
    assert res.result["echo"] == {"n": 7, "s": "hé"}
    assert res.result["cwd"] == str((tmp_path / "job").resolve())
    assert len(res.result["big"]) == 4 << 20  # larger than any pipe buffer: no deadlock
    assert res.stdout_tail == "log line on stdout\n"
    assert (tmp_path / "job" / "request.json").exists()


@pytest.mark.anyio
async def test_exit_code_invalid_result_and_missing_program(tmp_path: Path, mode: str) -> None:
    code = """
    import os, sys
    os.write(int(os.environ["LOOM_RESULT_FD"]), b"{not json")
    sys.exit(3)
    """
    res = await run_job(spec(tmp_path, py(code)))
    assert (res.returncode, res.signal, res.ok) == (3, None, False)
    assert res.result is None and res.result_error and "JSON" in res.result_error

    res = await run_job(spec(tmp_path, ["/nonexistent/program"]))
    assert res.returncode == 127
    assert "cannot execute" in res.stderr_tail


@pytest.mark.anyio
async def test_segfault_is_a_result(tmp_path: Path, mode: str) -> None:
    res = await run_job(spec(tmp_path, py("import ctypes; ctypes.string_at(0)")))
    assert res.signal == "SIGSEGV"
    assert res.returncode is None
    assert not res.ok and not res.timed_out


@pytest.mark.anyio
async def test_abort_reports_sigabrt(tmp_path: Path, mode: str) -> None:
    # The worker is not pid 1 of its namespace, so self-sent signals are not swallowed.
    res = await run_job(spec(tmp_path, py("import os; os.abort()")))
    assert res.signal == "SIGABRT"


# ----------------------------------------------------------------------------- limits


@pytest.mark.anyio
async def test_timeout_kills_setsid_grandchild(tmp_path: Path, mode: str) -> None:
    marker = f"loom-escaper-{uuid.uuid4().hex}"
    found: list[int] = []
    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_for, marker, found)
        res = await run_job(spec(tmp_path, py(ESCAPER.format(marker=marker)), timeout_s=1.5))
        tg.cancel_scope.cancel()
    assert res.timed_out and not res.ok
    assert res.signal == "SIGKILL"
    assert time.monotonic() - t0 < 5
    assert found, "the grandchild never started"
    assert all(gone(pid) for pid in found)
    assert pids_with(marker) == []


@pytest.mark.anyio
async def test_cancellation_kills_tree_and_propagates(tmp_path: Path, mode: str) -> None:
    marker = f"loom-cancel-{uuid.uuid4().hex}"
    found: list[int] = []
    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_for, marker, found)
        with anyio.move_on_after(1.0) as scope:
            await run_job(spec(tmp_path, py(ESCAPER.format(marker=marker)), timeout_s=60))
        tg.cancel_scope.cancel()
    assert scope.cancelled_caught
    assert time.monotonic() - t0 < 5
    assert found
    assert all(gone(pid) for pid in found)


@pytest.mark.anyio
async def test_output_is_bounded(tmp_path: Path) -> None:
    code = """
    import sys
    block = b"x" * (1 << 20)
    for _ in range(100):
        sys.stdout.buffer.write(block)
    sys.stdout.buffer.write(b"END")
    sys.stderr.write("err tail")
    """
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    res = await run_job(spec(tmp_path, py(code), max_output_bytes=64 << 10))
    assert res.ok, res.stderr_tail
    assert time.monotonic() - t0 < 10
    assert res.stdout_bytes == (100 << 20) + 3
    assert len(res.stdout_tail) == 64 << 10
    assert res.stdout_tail.endswith("xxxEND")
    assert res.stderr_tail == "err tail" and res.stderr_bytes == 8
    # ru_maxrss is in KiB; keeping 100 MB would raise the peak by at least that much.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 32 << 10


@pytest.mark.anyio
async def test_file_size_limit(tmp_path: Path) -> None:
    code = """
    from loom_mcp.worker.protocol import send_result
    try:
        with open("big.bin", "wb") as f:
            f.write(b"0" * (2 << 20))
        send_result({"errno": None})
    except OSError as exc:
        send_result({"errno": exc.errno})
    """
    res = await run_job(spec(tmp_path, py(code), max_file_bytes=1 << 20))
    assert res.result == {"errno": errno.EFBIG}


def _process_limit_enforced(allow_network: bool = False) -> bool:
    return plan(capabilities(), allow_network=allow_network)["limit_by"] is not None


@pytest.mark.anyio
async def test_fork_bomb_is_contained(tmp_path: Path) -> None:
    if not _process_limit_enforced():
        pytest.skip(isolation_report()["process_limit"])
    marker = f"loom-bomb-{uuid.uuid4().hex}"
    # Bounded by the loop even if the limit failed, and every child dies with the job.
    code = f"""
    import os, sys, time
    from loom_mcp.worker.protocol import send_result
    forked, err = 0, None
    for _ in range(200):
        try:
            pid = os.fork()
        except OSError as exc:
            err = exc.errno
            break
        if pid == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
        forked += 1
    send_result({{"forked": forked, "errno": err}})
    """
    res = await run_job(spec(tmp_path, py(code), max_processes=16, timeout_s=15))
    assert res.result is not None, res.stderr_tail
    assert res.result["errno"] == errno.EAGAIN
    assert res.result["forked"] < 16
    assert pids_with(marker) == []


# ----------------------------------------------------------------------------- environment


def test_worker_env_allowlist_and_secrets() -> None:
    parent = {
        "PATH": "/usr/bin",
        "HOME": "/home/u",
        "LC_ALL": "C.UTF-8",
        "CUDA_HOME": "/usr/local/cuda",
        "TORCHINDUCTOR_CACHE_DIR": "/c",
        "HF_TOKEN": "hf_x",
        "MY_API_KEY": "k",
        "AWS_SECRET_ACCESS_KEY": "a",
        "TORCH_HUB_TOKEN": "t",  # allowlisted prefix, secret name
        "GITHUB_TOKEN": "g",
        "RANDOM_THING": "r",
        "LD_PRELOAD": "/evil.so",
    }
    env = worker_env({"TRITON_CACHE_DIR": "/t", "SERVICE_PASSWORD": "p"}, parent=parent)
    assert env["PATH"] == "/usr/bin" and env["LC_ALL"] == "C.UTF-8"
    assert env["CUDA_HOME"] == "/usr/local/cuda" and env["TORCHINDUCTOR_CACHE_DIR"] == "/c"
    assert env["TRITON_CACHE_DIR"] == "/t"
    assert env["PYTHONUNBUFFERED"] == "1" and env["PYTHONDONTWRITEBYTECODE"] == "1"
    for name in (
        "HF_TOKEN",
        "MY_API_KEY",
        "AWS_SECRET_ACCESS_KEY",
        "TORCH_HUB_TOKEN",
        "GITHUB_TOKEN",
        "RANDOM_THING",
        "LD_PRELOAD",
        "SERVICE_PASSWORD",
    ):
        assert name not in env


@pytest.mark.anyio
async def test_secrets_invisible_in_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = {
        "HF_TOKEN": "hf_secret",
        "MY_API_KEY": "key_secret",
        "AWS_SECRET_ACCESS_KEY": "aws_secret",
        "TORCH_HUB_TOKEN": "torch_secret",
        "ANTHROPIC_API_KEY": "sk-secret",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    code = """
    import os
    from loom_mcp.worker.protocol import send_result
    send_result(dict(os.environ))
    """
    res = await run_job(spec(tmp_path, py(code), env={"LOOM_EXTRA": "yes"}))
    env = res.result
    assert isinstance(env, dict), res.stderr_tail
    for name, value in secrets.items():
        assert name not in env
        assert value not in str(env)
    job_dir = str((tmp_path / "job").resolve())
    assert env["TMPDIR"] == job_dir
    assert env["CUDA_LAUNCH_BLOCKING"] == "1"
    assert env["LOOM_EXTRA"] == "yes"
    assert "PATH" in env


@pytest.mark.anyio
async def test_visible_devices_pinning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    code = """
    import os
    from loom_mcp.worker.protocol import send_result
    send_result({k: os.environ.get(k) for k in
                 ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")})
    """
    res = await run_job(spec(tmp_path, py(code), visible_devices=[1, 3]))
    assert res.result == {
        "CUDA_VISIBLE_DEVICES": "1,3",
        "HIP_VISIBLE_DEVICES": "0,1",
        "ROCR_VISIBLE_DEVICES": "1,3",
    }
    res = await run_job(spec(tmp_path, py(code), visible_devices=[]))
    assert res.result is not None and res.result["CUDA_VISIBLE_DEVICES"] == "-1"
    res = await run_job(spec(tmp_path, py(code)))
    assert res.result == {
        "CUDA_VISIBLE_DEVICES": "5",
        "HIP_VISIBLE_DEVICES": None,
        "ROCR_VISIBLE_DEVICES": None,
    }


# ----------------------------------------------------------------------------- network


@pytest.mark.anyio
async def test_network_cut(tmp_path: Path) -> None:
    if "net" not in plan(capabilities(), allow_network=False)["unshare"]:
        pytest.skip(isolation_report()["network"])
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        code = f"""
        import socket
        from loom_mcp.worker.protocol import send_result
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
            send_result({{"connected": True}})
        except OSError as exc:
            send_result({{"connected": False, "error": str(exc)}})
        """
        res = await run_job(spec(tmp_path, py(code)))
        assert res.network_isolated
        assert res.result is not None and res.result["connected"] is False, res.result

        # Control: the same worker reaches the listener when the network is allowed.
        res = await run_job(spec(tmp_path, py(code), allow_network=True))
        assert not res.network_isolated
        assert res.result == {"connected": True}


# ----------------------------------------------------------------------------- progress


@pytest.mark.anyio
async def test_progress_messages(tmp_path: Path) -> None:
    messages: list[str] = []

    async def on_progress(msg: str) -> None:
        messages.append(msg)

    res = await run_job(spec(tmp_path, py("import time; time.sleep(2.3)")), on_progress)
    assert res.ok
    assert len(messages) >= 2
    assert all(m.startswith("running ") and m.endswith(" s") for m in messages)


def test_isolation_report_shape() -> None:
    report = isolation_report()
    for key in ("network", "process_tree", "process_limit", "core_dumps", "file_size"):
        assert isinstance(report[key], str) and report[key]


# ------------------------------------------------------------------ read-only file system

TAMPER = """
import os, json
report = {}
for name, path in [("outside", os.environ["OUTSIDE"]), ("job_dir", os.path.join(os.environ["LOOM_JOB_DIR"], "a")),
                   ("writable", os.path.join(os.environ["EXTRA"], "b")),
                   ("triton_cache", os.path.join(os.environ["TRITON_CACHE_DIR"], "c")),
                   ("torch_extensions", os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "ext", "d"))]:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)  # as load_inline makes its build dir
        with open(path, "w") as f:
            f.write("written by the job")
        report[name] = "ok"
    except OSError as exc:
        report[name] = exc.strerror
with open("/dev/null", "w") as f:
    f.write("x")  # device nodes stay usable on a read-only mount
print(json.dumps(report))
"""


@pytest.mark.anyio
async def test_a_job_cannot_write_outside_its_own_directories(tmp_path: Path) -> None:
    """Candidate code must not be able to rewrite the task, the harness, the ledger or another
    file's compile cache for the jobs that come after it; its own build caches (Triton's and
    load_inline's) stay writable."""
    outside = tmp_path / "task.py"
    outside.write_text("TOLERANCE = 'strict'\n")
    extra = tmp_path / "cache" / "one-file"
    # The task is in the job's root (read-only), as a candidate's own directory would be.
    spec = JobSpec(argv=[sys.executable, "-c", TAMPER], job_dir=tmp_path / "job", writable=[extra],
                   readable=[tmp_path], env={"OUTSIDE": str(outside), "EXTRA": str(extra)})
    result = await run_job(spec)
    assert result.ok, result.stderr_tail
    if not result.readonly_fs:
        pytest.skip("this kernel gives jobs no mount namespace or no mount_setattr")
    report = json.loads(result.stdout_tail)
    assert report == {"outside": "Read-only file system", "job_dir": "ok", "writable": "ok",
                      "triton_cache": "ok", "torch_extensions": "ok"}
    assert outside.read_text() == "TOLERANCE = 'strict'\n"
    assert (extra / "b").read_text() == "written by the job"


UNLOCK = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
report = {"caps": [line.split()[1] for line in open("/proc/self/status")
                   if line.startswith(("CapEff", "CapPrm", "CapBnd"))]}
if os.environ["ROUTE"] == "nested_userns":
    # A fresh user namespace gives its creator every capability again, over a new mount
    # namespace whose copied read-only mounts must stay locked.
    libc.unshare(0x10000000 | 0x00020000)
    for path, text in (("setgroups", "deny"), ("uid_map", "0 0 1"), ("gid_map", "0 0 1")):
        try:
            open(f"/proc/self/{path}", "w").write(text)
        except OSError:
            pass
report["remount"] = libc.mount(None, b"/", None, MS_REMOUNT | MS_BIND | MS_REC, None)
attr = (ctypes.c_uint64 * 4)(0, 1, 0, 0)  # mount_setattr: clear MOUNT_ATTR_RDONLY
report["mount_setattr"] = libc.syscall(442, -100, b"/", 0x8000, ctypes.byref(attr), 32)
try:
    open(os.environ["OUTSIDE"], "w").write("rewritten")
    report["write"] = "ok"
except OSError as exc:
    report["write"] = exc.strerror
print(json.dumps(report))
"""


@pytest.mark.anyio
@pytest.mark.parametrize("route", ["remount", "nested_userns"])
async def test_a_job_cannot_make_the_file_system_writable_again(tmp_path: Path, route: str) -> None:
    """The job's mount namespace is its own; as uid 0 in its user namespace it used to keep
    CAP_SYS_ADMIN there and remounted / read-write (seen before capabilities were dropped)."""
    outside = tmp_path / "task.py"
    outside.write_text("TOLERANCE = 'strict'\n")
    spec = JobSpec(argv=[sys.executable, "-c", UNLOCK], job_dir=tmp_path / "job",
                   readable=[tmp_path], env={"OUTSIDE": str(outside), "ROUTE": route})
    result = await run_job(spec)
    assert result.ok, result.stderr_tail
    if not result.readonly_fs:
        pytest.skip("this kernel gives jobs no mount namespace or no mount_setattr")
    report = json.loads(result.stdout_tail)
    assert report["write"] == "Read-only file system", report
    assert report["remount"] == -1 and report["mount_setattr"] == -1, report
    if route == "remount":
        assert report["caps"] == ["0000000000000000"] * 3, report
    assert outside.read_text() == "TOLERANCE = 'strict'\n"


@pytest.mark.anyio
async def test_opting_out_keeps_the_file_system_writable(tmp_path: Path) -> None:
    target = tmp_path / "agent-output.txt"
    code = f"open({str(target)!r}, 'w').write('ok')"
    result = await run_job(JobSpec(argv=[sys.executable, "-c", code], job_dir=tmp_path / "job", readonly_fs=False))
    assert result.ok and not result.readonly_fs and target.read_text() == "ok"


def test_code_cache_is_per_content(tmp_path: Path) -> None:
    from loom_mcp.sandbox import code_cache

    jobs = tmp_path / "home" / "jobs"
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("x = 1\n")
    b.write_text("x = 1\n")
    c.write_text("x = 2\n")
    assert code_cache(jobs / "run1", a) == code_cache(jobs / "run2", b)
    assert code_cache(jobs / "run1", a) != code_cache(jobs / "run1", c)
    assert code_cache(jobs / "run1", a).parent == tmp_path / "home" / "cache" / "triton"


# Both sides as jobs see them: the same user, no capabilities (the launcher drops them all;
# a process holding capabilities its peer lacks is out of its reach anyway).
HOLDER = """
import sys, time
from loom_mcp.sandbox.launcher import _drop_capabilities
from loom_mcp.worker.protocol import forbid_inspection
_drop_capabilities()
if sys.argv[1] == "forbid":
    assert forbid_inspection()
print("ready", flush=True)
time.sleep(60)
"""

PEEKER = """
import sys
from loom_mcp.sandbox.launcher import _drop_capabilities
_drop_capabilities()
try:
    open(f"/proc/{sys.argv[1]}/environ", "rb").read()
    print("read")
except PermissionError:
    print("denied")
"""


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("forbid", [False, True])
def test_a_trusted_worker_hides_its_memory_from_the_same_user(forbid: bool) -> None:
    """Where a candidate shares the reference's pid namespace and user (the sandbox's fallback),
    a non-dumpable reference still cannot be read through /proc or ptrace."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "forbid" if forbid else "allow"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        peek = subprocess.run([sys.executable, "-c", PEEKER, str(holder.pid)], capture_output=True,
                              text=True, timeout=60)
        assert peek.stdout.strip() == ("denied" if forbid else "read"), peek.stderr
    finally:
        holder.kill()
        holder.wait()


def test_compile_caches_live_in_the_code_cache(tmp_path: Path) -> None:
    """Triton's and load_inline's builds of one source land in that source's cache directory,
    shared by its compile, validation and benchmark jobs and by no other file."""
    from loom_mcp.sandbox import code_cache, code_cache_env

    run = tmp_path / "jobs" / "v1"
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("x = 2\n")
    cache = code_cache(run, a)
    env = code_cache_env(cache)
    assert env["TRITON_CACHE_DIR"] == str(cache)
    assert Path(env["TORCH_EXTENSIONS_DIR"]).parent == cache
    assert Path(env["TORCHINDUCTOR_CACHE_DIR"]).parent == cache  # torch.compile's, too
    assert code_cache(tmp_path / "jobs" / "v2", a) == cache  # another job, same bytes
    assert code_cache(run, b) != cache


def test_torch_compile_runs_without_a_worker_pool(tmp_path: Path) -> None:
    """A candidate's torch.compile compiles in its own process: inductor's pool of compile
    workers kept the candidate's processes busy while the other arm was timed."""
    pytest.importorskip("torch")
    from loom_mcp.sandbox.job import MODEL_JOB_ENV

    env = {**os.environ, **MODEL_JOB_ENV}
    out = subprocess.run([sys.executable, "-c", "import torch._inductor.config as c; print(c.compile_threads)"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "1", out.stderr[-2000:]


# ---------------------------------------------------------------------- the kernel itself
# What a job can reach of the kernel itself, with code the audit hook never sees.
#
# A job runs as the server's uid (an identity map keeps file ownership): when the server runs as
# root, that is uid 0 with no capabilities, and the kernel grants some things by uid alone. Each
# test runs a probe in a real sandboxed process, fresh and (where this kernel allows) in a blank
# worker, and checks every way out is shut: the host's sysctls and sysrq, nested user namespaces
# (from which a job could mount its own cgroup and lift its limits), the host's SysV IPC, hostname
# and session keyring, and a readable directory swapped for a symlink after the server planned
# the root.

# Runs inside the job: each entry is True when the way out is open.
PROBE = r'''
import ctypes, errno, json, os, sys

libc = ctypes.CDLL(None, use_errno=True)

def writable(path):
    try:
        with open(path, "r+b") as f:
            data = f.read()
            f.seek(0)
            f.write(data or b"\n")  # the value it has: harmless if it gets through
        return True
    except OSError:
        return False

def nested_user_namespace():
    pid = os.fork()
    if pid == 0:
        os._exit(0 if libc.unshare(0x10000000) == 0 else 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0

def session_keyring():
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(250, 0, -3, 0)  # keyctl(KEYCTL_GET_KEYRING_ID, session, no create)

def main():
    request = json.load(open(os.environ["LOOM_REQUEST"])) if os.environ.get("LOOM_REQUEST") else json.loads(sys.argv[1])
    swapped = request["swapped"]
    print(json.dumps({
        "core_pattern": writable("/proc/sys/kernel/core_pattern"),
        "hostname_sysctl": writable("/proc/sys/kernel/hostname"),
        "sysrq": writable("/proc/sysrq-trigger"),
        "max_user_namespaces": writable("/proc/sys/user/max_user_namespaces"),
        "nested_user_namespace": nested_user_namespace(),
        "host_uts": os.readlink("/proc/self/ns/uts") == request["uts"],
        "host_ipc": os.readlink("/proc/self/ns/ipc") == request["ipc"],
        "host_keyring": session_keyring() == request["keyring"],
        "kcore": os.path.exists("/proc/kcore") and os.path.getsize("/proc/kcore") > 0,
        "swapped_link": os.path.exists(swapped + "/etc/hostname") or os.path.exists(swapped + "/etc/passwd"),
    }))

if __name__ == "__main__":
    main()
'''

CLOSED = {"core_pattern": False, "hostname_sysctl": False, "sysrq": False,
          "max_user_namespaces": False, "nested_user_namespace": False, "host_uts": False,
          "host_ipc": False, "host_keyring": False, "kcore": False, "swapped_link": False}


@pytest.fixture
def _no_idle_workers_left():
    """Autouse where these tests came from: here only they use it (usefixtures on each)."""
    yield
    warm.discard_all()


def _plan() -> dict:
    return isolation.plan(isolation.capabilities(), allow_network=False)


needs_view = pytest.mark.skipif(not _plan().get("view"), reason="no root view on this kernel")


def _session_keyring() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return int(libc.syscall(250, 0, -3, 0))


def _host_facts(swapped: Path) -> dict:
    return {"uts": os.readlink("/proc/self/ns/uts"), "ipc": os.readlink("/proc/self/ns/ipc"),
            "keyring": _session_keyring(), "swapped": str(swapped)}


def _swap_after_planning(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """Win the race deterministically: once the server has planned the root (every path
    resolved), the readable directory becomes a symlink to the host's root."""
    real_job_view = view.job_view

    def plan_then_swap(**kwargs):
        ops = real_job_view(**kwargs)
        if directory.is_dir() and not directory.is_symlink():
            directory.rmdir()
            directory.symlink_to("/")
        return ops

    monkeypatch.setattr(view, "job_view", plan_then_swap)


@needs_view
@pytest.mark.usefixtures("_no_idle_workers_left")
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe's keyctl number is x86_64's")
@pytest.mark.anyio
async def test_a_fresh_job_reaches_no_kernel_knob_and_no_swapped_path(tmp_path: Path, monkeypatch) -> None:
    swapped = tmp_path / "readable"
    swapped.mkdir()
    _swap_after_planning(monkeypatch, swapped)
    result = await run_job(JobSpec(argv=[sys.executable, "-c", PROBE + "\nmain()\n",
                                         json.dumps(_host_facts(swapped))],
                                   job_dir=tmp_path / "job", readable=[swapped], timeout_s=60))
    assert result.ok, result.stderr_tail
    assert result.view == "allowlist"
    assert json.loads(result.stdout_tail.strip().splitlines()[-1]) == CLOSED


@needs_view
@pytest.mark.usefixtures("_no_idle_workers_left")
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe's keyctl number is x86_64's")
@pytest.mark.anyio
async def test_a_blank_worker_reaches_no_kernel_knob_and_no_swapped_path(tmp_path: Path, monkeypatch) -> None:
    if not _plan().get("late"):
        pytest.skip("no blank workers on this kernel")
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "loom_kernel_probe.py").write_text(PROBE)
    swapped = tmp_path / "readable"
    swapped.mkdir()
    base_env = {"PYTHONPATH": str(modules)}
    spec = JobSpec(argv=[sys.executable, "-m", "loom_kernel_probe"], job_dir=tmp_path / "run" / "probe",
                   env=base_env, readable=[swapped], timeout_s=60, request=_host_facts(swapped))
    pool = tmp_path / "warm"
    template = warm._blank_template(spec, base_env).model_copy(update={"readable": [modules]})
    warm.prewarm(template, pool, blank=True)
    worker = warm._take_idle(warm._key(template, pool, blank=True))
    assert worker is not None
    _swap_after_planning(monkeypatch, swapped)
    # The readable bind is optional (a missing path fails in the job): swapped, it is left out.
    alias = spec.job_dir.parent.resolve() / spec.job_dir.name
    assert warm.dispatch_late(worker, spec, base_env, alias) is None
    result = await runner.supervise(worker)
    assert result.ok, result.stderr_tail
    assert json.loads(result.stdout_tail.strip().splitlines()[-1]) == CLOSED


@needs_view
@pytest.mark.usefixtures("_no_idle_workers_left")
@pytest.mark.anyio
async def test_a_root_that_cannot_be_built_fails_the_job_instead_of_showing_the_host(
        tmp_path: Path, monkeypatch) -> None:
    """A required path (the job's writable directory) swapped for a symlink after planning: the
    job must not fall back to the host's tree, read-only or not."""
    writable = tmp_path / "out"
    writable.mkdir()
    _swap_after_planning(monkeypatch, writable)
    result = await run_job(JobSpec(argv=[sys.executable, "-c", "print('ran')"], job_dir=tmp_path / "job",
                                   writable=[writable], timeout_s=60))
    assert result.returncode == launcher.SETUP_FAILED, (result.returncode, result.stdout_tail)
    assert "ran" not in result.stdout_tail
    assert "symlink appeared" in result.stderr_tail


# ---------------------------------------------------------------- job placement
# Job placement: a GPU job sees exactly its GPU; a CPU job sees none and interprets Triton.


def test_gpu_job_is_pinned_to_its_physical_index():
    assert job_placement("cuda:3") == ("cuda", {}, [3])


def test_cpu_job_hides_gpus_and_interprets_triton():
    assert job_placement("cpu") == ("cpu", {"TRITON_INTERPRET": "1"}, [])


def test_unknown_device_strings_pass_through_unpinned():
    assert job_placement("auto") == ("auto", {}, None)


# ---- the judge's target GPU
# Which GPU the judge times: the one the workers' torch will call cuda:0.

GPUS = [DeviceInfo(index=i, vendor="nvidia", name="NVIDIA H200", uuid=f"GPU-{i}0a1b") for i in range(3)]


def test_visible_devices_index_and_uuid(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert first_visible(GPUS).index == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-10a")
    assert first_visible(GPUS).index == 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    assert first_visible(GPUS).index == 1


def test_default_is_the_first_gpu(monkeypatch):
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    assert first_visible(GPUS).index == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # not present: fall back, never crash
    assert first_visible(GPUS).index == 0
