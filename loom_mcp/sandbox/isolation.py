"""OS isolation for worker processes: the launcher, its capability probe and tree killing.

This file has two roles:

* imported by the server: `capabilities()` / `isolation_report()` (what this machine allows),
  `plan()` (which features one job gets), `kill_tree()` and the pids-cgroup helpers;
* executed as a script, `python -I -S isolation.py CONFIG ARGV...`: the *launcher* that sits
  between the server and the worker. It applies limits, enters namespaces and reports what it
  applied on a private pipe, then runs the worker and exits the way the worker did.

It must stay standard-library only: the launcher runs with `-I -S` (no site-packages, no
environment influence) so that it starts in a few milliseconds and cannot be hijacked by
PYTHONPATH or a `.pth` file.

Process layout with a pid namespace (the normal case on Linux with user namespaces):

    server ── launcher (host pid ns, session leader)
                 └── init (pid 1 of the job's pid ns, own /proc)
                        └── worker (pid 2)  ── anything it spawns

When init exits the kernel kills every process left in the namespace, setsid() or not, so
"kill the job" is "kill init". Without a pid namespace the launcher is a child subreaper: every
orphan of the job is re-parented to it and stays findable by a /proc scan.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import itertools
import json
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

LAUNCHER = os.path.abspath(__file__)

# linux/sched.h, linux/prctl.h, linux/mount.h, linux/if.h, linux/sockios.h
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
# linux/mount.h, linux/fcntl.h; mount_setattr is syscall 442 on every architecture (5.12+)
SYS_MOUNT_SETATTR = 442
MOUNT_ATTR_RDONLY = 0x1
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

# The launcher and init count against the job's process limit too.
LAUNCHER_TASKS = 2
# Exit code of the launcher when the sandbox itself could not be set up.
SETUP_FAILED = 125

_NS_FLAGS = {"user": CLONE_NEWUSER, "net": CLONE_NEWNET, "pid": CLONE_NEWPID | CLONE_NEWNS}


# ----------------------------------------------------------------------------- libc helpers


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.unshare.argtypes = [ctypes.c_int]
    libc.mount.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
    ]
    libc.prctl.argtypes = [
        ctypes.c_int,
        ctypes.c_ulong,
        ctypes.c_ulong,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return libc


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg: int) -> None:
    _check(_libc().prctl(option, arg, 0, 0, 0), f"prctl({option})")


def _mount(source: bytes | None, target: bytes, fstype: bytes | None, flags: int) -> None:
    _check(_libc().mount(source, target, fstype, flags, None), f"mount {target.decode()}")


def _mount_setattr(path: str, set_flags: int, clear_flags: int) -> None:
    """mount_setattr(2) on `path` and every mount below it."""
    attr = (ctypes.c_uint64 * 4)(set_flags, clear_flags, 0, 0)  # struct mount_attr
    libc = _libc()
    ret = libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD),
                       ctypes.c_char_p(path.encode()), ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr),
                       ctypes.c_size_t(ctypes.sizeof(attr)))
    _check(ret, f"mount_setattr {path}")


def _readonly_fs(writable: list[str]) -> None:
    """Make the whole file system read-only for this job, except `writable`.

    A worker runs code the server does not trust. Without this it could rewrite the harness it
    is timed by, the ledger, the campaign's repository or another candidate's compile cache,
    and the next job would run what it wrote. Needs the job's own mount namespace (it comes
    with the pid namespace). Each writable directory is bound onto itself first, so it is a
    mount of its own whose read-only flag can be cleared again; device nodes stay usable (a
    read-only mount does not stop writes to a character device), and /proc is mounted later.
    """
    for path in writable:
        os.makedirs(path, exist_ok=True)
        _mount(path.encode(), path.encode(), None, MS_BIND | MS_REC)
    _mount_setattr("/", MOUNT_ATTR_RDONLY, 0)
    for path in writable:
        _mount_setattr(path, 0, MOUNT_ATTR_RDONLY)
    # The working directory still points into the mount underneath (now read-only): enter it
    # again by name, which lands on the writable bind mount on top.
    os.chdir(os.getcwd())


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class _Broken(Exception):
    """Namespaces were entered but could not be made usable; the process must not go on."""


def _enter_namespaces(features: list[str]) -> list[str]:
    """unshare() the requested namespaces; map our own uid/gid so files keep their owners.

    Raises OSError when nothing changed (unshare refused), _Broken when we are half-way in.
    Returns the problems that do not spoil the isolation.
    """
    flags = 0
    for feature in features:
        flags |= _NS_FLAGS[feature]
    uid, gid = os.geteuid(), os.getegid()
    _check(_libc().unshare(flags), "unshare(" + "+".join(features) + ")")
    # An identity map: the worker keeps its uid (so HOME caches, the job dir and device nodes
    # behave as outside) but is unprivileged in the initial namespace — which is what makes
    # RLIMIT_NPROC bite for non-root users.
    try:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    except OSError as exc:
        raise _Broken(f"uid/gid map: {exc}") from exc
    problems = []
    if "net" in features:
        # A fresh net namespace has only `lo`, and it is down. Bring it up so that code which
        # talks to itself over 127.0.0.1 still works; the host stays unreachable.
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                ifr = struct.pack("16sh", b"lo", 0)
                cur = struct.unpack("16sh", _ioctl(s, SIOCGIFFLAGS, ifr))[1]
                _ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", cur | IFF_UP))
        except OSError as exc:
            problems.append(f"loopback stays down: {exc}")
    if "pid" in features:
        # Our /proc mount in init must not propagate anywhere. (A mount namespace owned by a
        # new user namespace already turns shared mounts into slaves; this is belt and braces.)
        try:
            _mount(None, b"/", None, MS_REC | MS_PRIVATE)
        except OSError as exc:
            problems.append(str(exc))
    return problems


def _ioctl(sock: socket.socket, req: int, arg: bytes) -> bytes:
    import fcntl

    return fcntl.ioctl(sock.fileno(), req, arg)


def _mount_proc() -> None:
    """In init of a new pid namespace: a /proc that shows the job's pids, not the host's.

    Without it os.getpid() (namespace pid) and /proc/<pid> (host pid) would disagree and tools
    such as psutil would read the wrong process.
    """
    _mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


# ----------------------------------------------------------------------------- /proc helpers


def _stat(pid: int) -> tuple[int, str] | None:
    """(ppid, state) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    return int(fields[1]), fields[0].decode()


def descendants(root: int) -> dict[int, str]:
    """All descendants of `root` (pid -> state letter), from one scan of /proc."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st is not None:
            children.setdefault(st[0], []).append(int(entry))
            states[int(entry)] = st[1]
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for kid in children.get(todo.pop(), ()):
            if kid not in found:
                found[kid] = states[kid]
                todo.append(kid)
    return found


def kill_tree(
    root: int, cgroup: str | None = None, deadline_s: float = 5.0, include_root: bool = True
) -> None:
    """SIGKILL every descendant of `root`, then `root`. Blocking; call it from a thread.

    Descendants go first: the launcher is their subreaper (or their pid namespace's parent),
    so killing it first would let orphans slip out of its subtree. The loop repeats until no
    descendant is left, which also catches processes forked while we were killing.
    """
    end = time.monotonic() + deadline_s
    own = root == os.getpid()
    while True:
        if own:
            _reap_nohang()
        kids = descendants(root)
        victims = [pid for pid, state in kids.items() if state != "Z"]
        if cgroup:
            victims += cgroup_pids(cgroup)
        if not kids and not victims:
            break
        for pid in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > end:
            break
        # Zombies vanish once their parent (the launcher, init) reaps them.
        time.sleep(0.005)
    if include_root:
        with contextlib.suppress(ProcessLookupError):
            os.kill(root, signal.SIGKILL)


def _reap_nohang() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# ----------------------------------------------------------------------------- pids cgroup


def _pids_cgroup_dirs() -> list[Path]:
    """Our own cgroup directory in each hierarchy that could carry a pids limit."""
    try:
        cgroup_lines = Path("/proc/self/cgroup").read_text().splitlines()
        mount_lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    v1_path = v2_path = None
    for line in cgroup_lines:
        hier, controllers, path = line.split(":", 2)
        if hier == "0" and controllers == "":
            v2_path = path
        elif "pids" in controllers.split(","):
            v1_path = path
    dirs = []
    for line in mount_lines:
        pre, _, post = line.partition(" - ")
        fields, post_fields = pre.split(), post.split()
        if len(fields) < 5 or len(post_fields) < 3:
            continue
        root, mountpoint, fstype = fields[3], fields[4], post_fields[0]
        if fstype == "cgroup" and "pids" in post_fields[2].split(",") and v1_path:
            own = v1_path
        elif fstype == "cgroup2" and v2_path:
            own = v2_path
        else:
            continue
        # A bind-mounted sub-hierarchy (containers): our path is relative to the mount's root.
        if root != "/" and own.startswith(root):
            own = own[len(root) :]
        dirs.append(Path(mountpoint) / own.lstrip("/"))
    return dirs


_cgroup_counter = itertools.count()


def _make_cgroup(parent: Path, name: str, limit: int) -> Path:
    path = parent / name
    path.mkdir()
    try:
        (path / "pids.max").write_text(str(limit))
    except OSError:
        path.rmdir()
        raise
    return path


@functools.cache
def pids_cgroup_parent() -> Path | None:
    """A cgroup directory under which we may create job cgroups with a pids limit, or None."""
    for parent in _pids_cgroup_dirs():
        try:
            _make_cgroup(parent, f"loom-probe-{os.getpid()}", 10).rmdir()
        except OSError:
            continue
        _sweep_stale_cgroups(parent)
        return parent
    return None


def _sweep_stale_cgroups(parent: Path) -> None:
    """Remove job cgroups left by servers that died before cleaning up (SIGKILL, OOM).

    rmdir only succeeds on an empty cgroup, so a live job elsewhere is never disturbed.
    """
    for entry in parent.glob("loom-*-*"):
        owner = entry.name.split("-")[1]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            with contextlib.suppress(OSError):
                entry.rmdir()


def create_job_cgroup(limit: int) -> str | None:
    """A fresh pids cgroup for one job (the launcher joins it), or None if unavailable."""
    parent = pids_cgroup_parent()
    if parent is None:
        return None
    try:
        return str(_make_cgroup(parent, f"loom-{os.getpid()}-{next(_cgroup_counter)}", limit))
    except OSError:
        return None


def cgroup_pids(path: str) -> list[int]:
    try:
        return [int(p) for p in Path(path, "cgroup.procs").read_text().split()]
    except OSError:
        return []


def remove_job_cgroup(path: str, deadline_s: float = 2.0) -> None:
    """Kill what is left in a job cgroup and remove it. Blocking; call it from a thread."""
    end = time.monotonic() + deadline_s
    while True:
        for pid in cgroup_pids(path):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            # EBUSY while the last tasks are still exiting.
            if time.monotonic() > end:
                return
            time.sleep(0.01)


# ----------------------------------------------------------------------------- probe


_PROBES: dict[str, list[str]] = {
    "user+net+pid": ["user", "net", "pid"],
    "user+pid": ["user", "pid"],
    "user+net": ["user", "net"],
    "user": ["user"],
}


def _nproc_bites() -> bool:
    """Does the kernel enforce RLIMIT_NPROC on this process? (Never for global root.)"""
    resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
    try:
        kid = os.fork()
    except BlockingIOError:
        return True
    if kid == 0:
        os._exit(0)
    os.waitpid(kid, 0)
    return False


def _probe_one(features: list[str]) -> dict[str, Any]:
    """In a throw-away child: can we set up these namespaces, and does RLIMIT_NPROC bite?"""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        out: dict[str, Any] = {"ok": False}
        try:
            problems = _enter_namespaces(features)
            if "pid" in features:
                # Test from inside the new pid namespace, as init will run: once this first
                # child exits the namespace is dead and nothing more can be forked into it.
                init = os.fork()
                if init == 0:
                    try:
                        _mount_proc()
                        if os.readlink("/proc/self") != "1":
                            os._exit(2)
                        os._exit(10 if _nproc_bites() else 11)
                    except BaseException:
                        os._exit(1)
                _, status = os.waitpid(init, 0)
                code = os.waitstatus_to_exitcode(status)
                if code not in (10, 11):
                    raise OSError(errno.EPERM, "cannot mount a /proc for the new pid namespace")
                out["nproc_enforced"] = code == 10
            else:
                out["nproc_enforced"] = _nproc_bites()
            out["ok"] = True
            if problems:
                out["problems"] = problems
        except BaseException as exc:
            out["error"] = str(exc)
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    try:
        return json.loads(b"".join(chunks) or b"{}") or {"ok": False, "error": "probe died"}
    except ValueError:
        return {"ok": False, "error": "probe died"}


def _probe_main() -> NoReturn:
    results = {name: _probe_one(features) for name, features in _PROBES.items()}
    sys.stdout.write(json.dumps({"uid": os.geteuid(), "probes": results}))
    sys.stdout.flush()
    os._exit(0)


@functools.cache
def capabilities() -> dict[str, Any]:
    """What this machine allows, probed once per server process. Blocking (~0.1 s)."""
    caps: dict[str, Any] = {"uid": os.geteuid(), "probes": {}, "error": None}
    if sys.platform != "linux":
        caps["error"] = f"namespaces need Linux, this is {sys.platform}"
    else:
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-S", LAUNCHER, "--probe"],
                capture_output=True,
                timeout=30,
                stdin=subprocess.DEVNULL,
            )
            caps.update(json.loads(proc.stdout))
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            caps["error"] = f"probe failed: {exc}"
    caps["cgroup"] = str(pids_cgroup_parent() or "") or None
    return caps


def _ok(caps: dict[str, Any], name: str) -> bool:
    return bool(caps["probes"].get(name, {}).get("ok"))


def plan(caps: dict[str, Any], allow_network: bool) -> dict[str, Any]:
    """Features for one job: namespaces to enter and how to cap the process count."""
    if not allow_network and _ok(caps, "user+net+pid"):
        name = "user+net+pid"
    elif not allow_network and _ok(caps, "user+net"):
        # A cut network matters more than the pid namespace (tree kill has a fallback).
        name = "user+net"
    elif _ok(caps, "user+pid"):
        name = "user+pid"
    elif _ok(caps, "user"):
        name = "user"
    else:
        name = None
    features = _PROBES[name] if name else []
    nproc = bool(name) and bool(caps["probes"][name].get("nproc_enforced"))
    return {
        "unshare": features,
        "limit_by": "nproc" if nproc else ("cgroup" if caps.get("cgroup") else None),
    }


def _describe(caps: dict[str, Any]) -> dict[str, str]:
    def why(name: str) -> str:
        if caps.get("error"):
            return caps["error"]
        return caps["probes"].get(name, {}).get("error") or "not available"

    cut = plan(caps, allow_network=False)
    features = cut["unshare"]
    report: dict[str, str] = {}
    if "net" in features:
        report["network"] = "cut (user+net namespace; the job has only its own loopback)"
    else:
        report["network"] = f"not cut: {why('user+net')}"
    if "pid" in features:
        report["process_tree"] = (
            "pid namespace with its own /proc: ending the job kills every process in it, "
            "setsid()/daemonized ones included"
        )
    else:
        report["process_tree"] = (
            "no pid namespace (" + why("user+pid") + "); the launcher is a child subreaper and "
            "kills its whole subtree by /proc scan"
        )
    if "pid" in features:
        report["filesystem"] = (
            "read-only for judged code outside its job directory and its own compile cache "
            "(mount namespace + mount_setattr, Linux 5.12+; each job records whether it held)"
        )
    else:
        report["filesystem"] = "writable: no mount namespace for jobs here"
    if cut["limit_by"] == "nproc":
        report["process_limit"] = "enforced: RLIMIT_NPROC inside a user namespace"
    elif cut["limit_by"] == "cgroup":
        report["process_limit"] = f"enforced: pids cgroup under {caps['cgroup']}"
    elif caps["uid"] == 0:
        report["process_limit"] = (
            "not enforced: running as root (the kernel ignores RLIMIT_NPROC for root) "
            "and no writable pids cgroup"
        )
    else:
        report["process_limit"] = "not enforced: no user namespace and no writable pids cgroup"
    report["core_dumps"] = "off (RLIMIT_CORE=0)"
    report["file_size"] = "limited per job (RLIMIT_FSIZE)"
    report["environment"] = "allowlist; secret-looking names dropped"
    report["output"] = "bounded tail of stdout/stderr; results over a private pipe"
    return report


@functools.cache
def isolation_report() -> dict[str, str]:
    """What the sandbox enforces on this machine, in words (cached; blocking on first call)."""
    return _describe(capabilities())


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
    libc = _libc()
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            if ctypes.get_errno() == errno.EINVAL:  # past the kernel's last capability
                break
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words, all zero
    libc.capset(ctypes.byref(header), ctypes.byref(data))
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


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


def _run_with_init(argv: list[str], meta_fd: int | None, worker_fds: list[int]) -> NoReturn:
    status_r, status_w = os.pipe()
    # init arms PDEATHSIG after fork; if we died before that, this pipe reads EOF.
    alive_r, alive_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(status_r)
        os.close(alive_w)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if select.select([alive_r], [], [], 0)[0]:
            os._exit(1)
        try:
            _mount_proc()
            _write_meta(meta_fd, {"stage": "init", "proc": True})
        except OSError as exc:
            _write_meta(meta_fd, {"stage": "init", "proc": False, "error": str(exc)})
        _close(meta_fd)
        worker = os.fork()
        if worker == 0:
            _exec_worker(argv)
        _close(*worker_fds)
        status = _wait_for(worker)
        os.write(status_w, str(status).encode())
        # Exiting as pid 1 makes the kernel kill whatever the worker left behind.
        os._exit(0)
    os.close(status_w)
    os.close(alive_r)
    _close(meta_fd, *worker_fds)
    init_status = _wait_for(init)
    data = os.read(status_r, 64)
    _exit_like(int(data) if data else init_status)


def _run_with_subreaper(argv: list[str], meta_fd: int | None, worker_fds: list[int]) -> NoReturn:
    me = os.getpid()
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _close(meta_fd)
    worker = os.fork()
    if worker == 0:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != me:
            os._exit(1)
        _exec_worker(argv)
    _close(*worker_fds)
    status = _wait_for(worker)
    # Whatever the worker left behind was re-parented to us: end it before we report.
    kill_tree(me, include_root=False)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    _exit_like(status)


def _launch(cfg: dict[str, Any], argv: list[str]) -> NoReturn:
    meta_fd: int | None = cfg.get("meta_fd")
    worker_fds: list[int] = cfg.get("worker_fds", [])
    parent = cfg.get("parent_pid")
    if parent is not None:
        # Die with the server: a crashed server must not leave jobs holding the GPU.
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(SETUP_FAILED)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    fsize = cfg.get("fsize")
    if fsize:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    applied: dict[str, Any] = {"user": False, "net": False, "pid": False, "nproc": None}
    errors: dict[str, str] = {}
    if cfg.get("cgroup"):
        try:
            _write(os.path.join(cfg["cgroup"], "cgroup.procs"), "0")
            applied["cgroup"] = cfg["cgroup"]
        except OSError as exc:
            errors["cgroup"] = str(exc)
    features: list[str] = cfg.get("unshare", [])
    if features:
        try:
            problems = _enter_namespaces(features)
        except _Broken as exc:
            os.write(2, f"loom sandbox: setup failed: {exc}\n".encode())
            os._exit(SETUP_FAILED)
        except OSError as exc:
            errors["namespaces"] = str(exc)
        else:
            applied.update({f: True for f in features})
            if problems:
                errors["namespaces"] = "; ".join(problems)
    writable = cfg.get("writable")
    if writable is not None:
        applied["readonly_fs"] = False
        if applied["pid"]:  # the mount namespace comes with it
            try:
                _readonly_fs(writable)
                applied["readonly_fs"] = True
            except OSError as exc:
                errors["readonly_fs"] = str(exc)
        else:
            errors["readonly_fs"] = "no mount namespace of its own"
    nproc = cfg.get("nproc")
    if nproc and applied["user"]:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc + LAUNCHER_TASKS,) * 2)
        applied["nproc"] = nproc
    _write_meta(meta_fd, {"stage": "launcher", "applied": applied, "errors": errors})
    if applied["pid"]:
        _run_with_init(argv, meta_fd, worker_fds)
    _run_with_subreaper(argv, meta_fd, worker_fds)


def _main() -> NoReturn:
    if sys.argv[1:2] == ["--probe"]:
        _probe_main()
    if len(sys.argv) < 3:
        os.write(2, b"usage: isolation.py CONFIG_JSON ARGV...\n")
        os._exit(2)
    _launch(json.loads(sys.argv[1]), sys.argv[2:])


if __name__ == "__main__":
    _main()
