"""The launcher: the process between the server and a worker.

    python -I -S launcher.py --config-fd FD ARGV...     run ARGV as a job (the plan in FD)
    python -I -S launcher.py --probe [VIEW_JSON]         what this machine allows (probe.py)

It applies limits, enters namespaces and reports what it applied on a private pipe, then runs
the worker and exits the way the worker did. It stays standard-library only and runs with
`-I -S` (no site-packages, no environment influence) so that it starts in a few milliseconds
and cannot be hijacked by PYTHONPATH or a `.pth` file; its siblings `mounts.py`, `procs.py` and
`probe.py` come from its own directory.

Process layout with a pid namespace (the normal case on Linux with user namespaces):

    server ── launcher (host pid ns, session leader)
                 └── init (pid 1 of the job's pid ns, own /proc)
                        └── worker (pid 2)  ── anything it spawns

When init exits the kernel kills every process left in the namespace, setsid() or not, so
"kill the job" is "kill init". Without a pid namespace the launcher is a child subreaper: every
orphan of the job is re-parented to it and stays findable by a /proc scan.

What the job sees of the file system is set up by init, before the worker starts (mounts.py):
a root of its own built from the allowlist the server computed (`view.py`), or, where the
probe could not build one, the host's tree made read-only outside the job's directories. Each
job reports which it got ("view": "allowlist" / "readonly"). A blank worker's init stays to
add the job's paths when the job comes (`_serve_late`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import resource
import select
import signal
import sys
from typing import Any, NoReturn

if __package__:
    from loom_mcp.sandbox import mounts, probe, procs
else:  # run as a script with -I -S: its siblings (standard library only) from its directory
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))
    import mounts  # type: ignore[import-not-found,no-redef]
    import probe  # type: ignore[import-not-found,no-redef]
    import procs  # type: ignore[import-not-found,no-redef]


def _read_line(fd: int, limit: int = 1 << 22) -> bytes:
    """One line from `fd` (b"" at EOF before any newline)."""
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1 << 16)
        if not chunk or len(data) > limit:
            return b""
        data += chunk
    return bytes(data)


# The launcher and init count against the job's process limit too.
LAUNCHER_TASKS = 2
# Exit code of the launcher when the sandbox itself could not be set up.
SETUP_FAILED = 125


# ----------------------------------------------------------------------------- launcher


def _write_meta(fd: int | None, record: dict[str, Any]) -> None:
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.write(fd, (json.dumps(record) + "\n").encode())


def _close(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _drop_capabilities() -> None:
    """Leave the worker no capabilities, in its user namespace or outside it.

    uid 0 keeps every capability across exec, and inside the job's own user namespace that
    includes CAP_SYS_ADMIN over the job's mount namespace: a worker running as root could
    remount / read-write and rewrite the task, the harness or the ledger (a job did exactly
    that before this existed). With the bounding and inheritable sets empty, exec grants
    nothing; no_new_privs keeps setuid and file-capability binaries from granting more.
    Best effort for the parts a non-root launcher may not do (it has nothing to drop then).
    """
    libc = mounts._libc()
    libc.prctl(mounts.PR_CAP_AMBIENT, mounts.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    for cap in range(64):
        if libc.prctl(mounts.PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            if ctypes.get_errno() == errno.EINVAL:  # past the kernel's last capability
                break
    header = (ctypes.c_uint32 * 2)(mounts.LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words, all zero
    libc.capset(ctypes.byref(header), ctypes.byref(data))
    mounts._prctl(mounts.PR_SET_NO_NEW_PRIVS, 1)


def _exec_worker(argv: list[str]) -> NoReturn:
    # Python ignores SIGPIPE and SIGXFSZ, and ignored signals survive exec: give the worker
    # the defaults a shell would.
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    try:
        _drop_capabilities()
    except OSError as exc:
        os.write(2, f"loom sandbox: cannot drop privileges: {exc.strerror}\n".encode())
        os._exit(SETUP_FAILED)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        os.write(2, f"loom sandbox: cannot execute {argv[0]!r}: {exc.strerror}\n".encode())
    os._exit(127)


def _exit_like(status: int) -> NoReturn:
    """Exit the way a child with this wait status did, so the server sees the real fate."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _wait_for(pid: int) -> int:
    """Reap children (orphans included) until `pid` exits; return its wait status."""
    while True:
        try:
            got, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 0
        if got == pid:
            return status


def _setup_fs(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """In init: the job's file system (its own root, else the host's read-only) and /proc."""
    applied: dict[str, Any] = {"view": "none", "readonly_fs": False, "proc": False}
    errors: dict[str, str] = {}
    view = cfg.get("view")
    if view is not None:
        try:
            problems = mounts._build_root(view, late=bool(cfg.get("late")))
        except OSError as exc:
            # The server planned a root of its own because the probe built one here: failing
            # now is this job's paths (or someone swapping them), and must not buy the job the
            # host's tree, even read-only.
            raise mounts._Broken(f"the job's root could not be built: {exc}") from exc
        else:
            applied.update(view="allowlist", readonly_fs=True)
            applied["proc"] = not any(p.startswith("/proc:") for p in problems)
            if problems:
                errors["view"] = "; ".join(problems)
    writable = cfg.get("writable")
    if applied["view"] == "none" and writable is not None:
        try:
            mounts._readonly_fs(writable)
            applied.update(view="readonly", readonly_fs=True)
        except OSError as exc:
            errors["readonly_fs"] = str(exc)
    if applied["view"] != "allowlist":
        try:
            mounts._mount_proc()
            applied["proc"] = True
        except OSError as exc:
            errors["proc"] = str(exc)
    return applied, errors


def _run_with_init(cfg: dict[str, Any], argv: list[str], meta_fd: int | None, worker_fds: list[int]) -> NoReturn:
    status_r, status_w = os.pipe()
    # init arms PDEATHSIG after fork; if we died before that, this pipe reads EOF.
    alive_r, alive_w = os.pipe()
    ack_fd: int | None = cfg.get("ack_fd")
    init = os.fork()
    if init == 0:
        os.close(status_r)
        os.close(alive_w)
        mounts._prctl(mounts.PR_SET_PDEATHSIG, signal.SIGKILL)
        if select.select([alive_r], [], [], 0)[0]:
            os._exit(1)
        # Signals from inside the namespace reach init only where it has a handler: Python's
        # for SIGINT would let the job end itself through init (rc 130) rather than by exiting.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            applied, errors = _setup_fs(cfg)
        except mounts._Broken as exc:
            os.write(2, f"loom sandbox: setup failed: {exc}\n".encode())
            os._exit(SETUP_FAILED)
        late = bool(cfg.get("late")) and applied["view"] == "allowlist"
        if late:
            # init keeps the host's tree: no one may ptrace it or read /proc/1/root or its fds.
            mounts._prctl(mounts.PR_SET_DUMPABLE, 0)
        _write_meta(meta_fd, {"stage": "init", "applied": applied, "errors": errors})
        _close(meta_fd)
        feed_r, feed_w = os.pipe() if ack_fd is not None else (None, None)
        entered_r, entered_w = os.pipe() if late else (None, None)
        worker = os.fork()
        if worker == 0:
            if feed_r is not None:  # the worker's stdin comes from init, never from the server
                os.dup2(feed_r, 0)
                _close(feed_r, feed_w, ack_fd, entered_r)
            if late:
                try:
                    mounts._enter_late_root(cfg["view"]["cwd"])
                except OSError as exc:
                    os.write(2, f"loom sandbox: cannot enter the job's root: {exc}\n".encode())
                    os._exit(SETUP_FAILED)
                _close(entered_w)  # init may change its own mounts now: ours are copied already
            _exec_worker(argv)
        _close(*worker_fds)
        if feed_w is not None:
            _close(feed_r, entered_w)
            if entered_r is not None:
                # Until the worker has its own copy of the mounts, a flag init clears for a
                # moment (the root's read-only one, in mounts._apply_late) would be copied with them.
                os.read(entered_r, 1)
                _close(entered_r)
            _serve_late(worker, late, ack_fd, feed_w, status_w)
        status = _wait_for(worker)
        os.write(status_w, str(status).encode())
        # Exiting as pid 1 makes the kernel kill whatever the worker left behind.
        os._exit(0)
    os.close(status_w)
    os.close(alive_r)
    _close(meta_fd, ack_fd, *worker_fds)
    init_status = _wait_for(init)
    data = os.read(status_r, 64)
    _exit_like(int(data) if data else init_status)


def _serve_late(worker: int, late: bool, ack_fd: int | None, feed_w: int, status_w: int) -> None:
    """In init of a pre-started worker: wait for the job (one line on stdin from the server:
    {"ops": [...], "go": "..."}), add its paths to the worker's root, say so on the ack pipe,
    and only then pass `go` on to the worker's stdin. Returns once the worker has its line (or
    stdin closed: the worker is told nothing and runs nothing)."""
    line = b""
    while not line:
        try:
            ready = select.select([0], [], [], 1.0)[0]
        except InterruptedError:
            ready = []
        got, status = os.waitpid(worker, os.WNOHANG)
        if got == worker:  # it died idle (or timed out): report it, as any worker's end
            os.write(status_w, str(status).encode())
            os._exit(0)
        if ready:
            line = _read_line(0)
            if not line:  # the server discarded us
                _close(feed_w, ack_fd)
                return
    try:
        message = json.loads(line)
        if not late:
            raise OSError(errno.ENOTSUP, "no root of its own to add paths to")
        problems = mounts._apply_late(message.get("ops") or [])
    except (OSError, ValueError) as exc:
        _write_meta(ack_fd, {"ok": False, "error": str(exc)})
        os.kill(worker, signal.SIGKILL)
        _wait_for(worker)
        os._exit(SETUP_FAILED)
    _write_meta(ack_fd, {"ok": True, "problems": problems})
    _close(ack_fd)
    with contextlib.suppress(OSError):
        os.write(feed_w, str(message.get("go", "")).encode() + b"\n")
    _close(feed_w)


def _run_with_subreaper(argv: list[str], meta_fd: int | None, worker_fds: list[int]) -> NoReturn:
    me = os.getpid()
    mounts._prctl(mounts.PR_SET_CHILD_SUBREAPER, 1)
    _close(meta_fd)
    worker = os.fork()
    if worker == 0:
        mounts._prctl(mounts.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != me:
            os._exit(1)
        _exec_worker(argv)
    _close(*worker_fds)
    status = _wait_for(worker)
    # Whatever the worker left behind was re-parented to us: end it before we report.
    procs.kill_tree(me, include_root=False)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    _exit_like(status)


SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 250, "s390x": 280}
KEYCTL_JOIN_SESSION_KEYRING = 1


def _fresh_keyring() -> None:
    """A new, empty session keyring for the job: the server's (a login's, with its tokens) is
    otherwise inherited, readable and writable by every job. Best effort: no keyctl, no keys."""
    number = SYS_KEYCTL.get(os.uname().machine)
    if number is not None:
        mounts._libc().syscall(ctypes.c_long(number), ctypes.c_int(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_char_p(None))


def _launch(cfg: dict[str, Any], argv: list[str]) -> NoReturn:
    meta_fd: int | None = cfg.get("meta_fd")
    worker_fds: list[int] = cfg.get("worker_fds", [])
    parent = cfg.get("parent_pid")
    if parent is not None:
        # Die with the server: a crashed server must not leave jobs holding the GPU.
        mounts._prctl(mounts.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(SETUP_FAILED)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _fresh_keyring()
    fsize = cfg.get("fsize")
    if fsize:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    applied: dict[str, Any] = {"user": False, "net": False, "pid": False, "nproc": None, "memory": None}
    errors: dict[str, str] = {}
    joined: dict[str, str] = {}
    for controller, path in (cfg.get("cgroups") or {}).items():
        if path in joined.values():  # cgroup v2: one directory carries every controller
            joined[controller] = path
            continue
        try:
            mounts._write(os.path.join(path, "cgroup.procs"), "0")
            joined[controller] = path
        except OSError as exc:
            errors[f"cgroup {controller}"] = str(exc)
    if joined:
        applied["cgroup"] = sorted(set(joined.values()))
    memory = cfg.get("memory_bytes")
    if memory:
        if "memory" in joined:
            applied["memory"] = "cgroup"
        else:
            # No memory cgroup: RLIMIT_DATA (brk and private writable mappings). Not RLIMIT_AS:
            # CUDA reserves far more address space than it uses and fails to initialise under
            # it; under RLIMIT_DATA = 8 GiB CUDA starts, a 20 GiB GPU allocation works and a
            # 12 GiB CPU tensor fails with a RuntimeError (measured on the H200 host).
            resource.setrlimit(resource.RLIMIT_DATA, (memory, memory))
            applied["memory"] = "rlimit"
    features: list[str] = cfg.get("unshare", [])
    if features:
        try:
            problems = mounts._enter_namespaces(features)
        except mounts._Broken as exc:
            os.write(2, f"loom sandbox: setup failed: {exc}\n".encode())
            os._exit(SETUP_FAILED)
        except OSError as exc:
            errors["namespaces"] = str(exc)
        else:
            applied.update({f: True for f in features})
            if problems:
                errors["namespaces"] = "; ".join(problems)
    if not applied["pid"]:
        # The job's own root (or the read-only host tree) is set up by init, in the mount
        # namespace that comes with the pid namespace; without one the tree stays as it is.
        applied.update(view="none", readonly_fs=False)
        if cfg.get("view") is not None or cfg.get("writable") is not None:
            errors["view"] = "no mount namespace of its own"
    nproc = cfg.get("nproc")
    if nproc and applied["user"]:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc + LAUNCHER_TASKS,) * 2)
        applied["nproc"] = nproc
    _write_meta(meta_fd, {"stage": "launcher", "applied": applied, "errors": errors})
    if applied["pid"]:
        _run_with_init(cfg, argv, meta_fd, worker_fds)
    _close(cfg.get("ack_fd"))  # no init to add a job's paths: the server sees EOF and falls back
    _run_with_subreaper(argv, meta_fd, worker_fds)


def _main() -> NoReturn:
    if sys.argv[1:2] == ["--probe"]:
        probe._probe_main(json.loads(sys.argv[2]) if len(sys.argv) > 2 else None)
    if sys.argv[1:2] == ["--config-fd"] and len(sys.argv) > 3:
        with os.fdopen(int(sys.argv[2]), "rb") as config:  # closed: init and the worker never see it
            cfg = json.loads(config.read())
        _launch(cfg, sys.argv[3:])
    if len(sys.argv) < 3:
        os.write(2, b"usage: launcher.py (CONFIG_JSON | --config-fd FD) ARGV...\n")
        os._exit(2)
    _launch(json.loads(sys.argv[1]), sys.argv[2:])


if __name__ == "__main__":
    _main()
