"""What a job can reach of the kernel itself, with code the audit hook never sees.

A job runs as the server's uid (an identity map keeps file ownership): when the server runs as
root, that is uid 0 with no capabilities, and the kernel grants some things by uid alone. Each
test runs a probe in a real sandboxed process, fresh and (where this kernel allows) in a blank
worker, and checks every way out is shut: the host's sysctls and sysrq, nested user namespaces
(from which a job could mount its own cgroup and lift its limits), the host's SysV IPC, hostname
and session keyring, and a readable directory swapped for a symlink after the server planned
the root.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

import pytest

from loom_mcp.sandbox import JobSpec, isolation, launcher, run_job, runner, view, warm

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
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _no_idle_workers_left():
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
