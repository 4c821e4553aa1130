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

What the job sees of the file system is set up by init, before the worker starts (it needs the
mount namespace, which comes with the pid namespace): preferably a root of its own, built on a
tmpfs from an allowlist the server computed (`loom_mcp.sandbox.view`: system directories, the
interpreter, a few /etc files, a minimal /dev, private /tmp, the job's own directories); if the
kernel refuses that, the host's tree made read-only outside the job's writable directories.
Each job reports which of the two it got ("view": "allowlist" / "readonly").
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
import stat
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
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_MOVE = 8192
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20
PR_SET_DUMPABLE = 4
# linux/mount.h, linux/fcntl.h; mount_setattr is syscall 442 on every architecture (5.12+)
SYS_MOUNT_SETATTR = 442
MOUNT_ATTR_RDONLY = 0x1
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MNT_DETACH = 2
# pivot_root(2) has no libc wrapper; its number differs per architecture.
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

# The launcher and init count against the job's process limit too.
LAUNCHER_TASKS = 2
# Exit code of the launcher when the sandbox itself could not be set up.
SETUP_FAILED = 125

CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
# The pid namespace comes with a mount namespace (its /proc, the job's root), a UTS one (a job may
# not rename the host) and an IPC one (SysV segments and message queues are otherwise shared
# with the host and with every other job, and outlive the job).
_NS_FLAGS = {"user": CLONE_NEWUSER, "net": CLONE_NEWNET,
             "pid": CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC}


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
        ctypes.c_char_p,
    ]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
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


def _mount(source: bytes | None, target: bytes, fstype: bytes | None, flags: int,
           data: bytes | None = None) -> None:
    _check(_libc().mount(source, target, fstype, flags, data), f"mount {target.decode()}")


def _umount(target: str, flags: int = MNT_DETACH) -> None:
    _check(_libc().umount2(target.encode(), flags), f"umount {target}")


def _pivot_root(new_root: str, put_old: str) -> None:
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown syscall number on {os.uname().machine}")
    ret = _libc().syscall(ctypes.c_long(number), ctypes.c_char_p(new_root.encode()),
                          ctypes.c_char_p(put_old.encode()))
    _check(ret, f"pivot_root {new_root}")


def _mount_setattr(path: str, set_flags: int, clear_flags: int, recursive: bool = True) -> None:
    """mount_setattr(2) on `path` (and every mount below it when `recursive`)."""
    attr = (ctypes.c_uint64 * 4)(set_flags, clear_flags, 0, 0)  # struct mount_attr
    libc = _libc()
    ret = libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD),
                       ctypes.c_char_p(path.encode()), ctypes.c_uint(AT_RECURSIVE if recursive else 0),
                       ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
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


# statvfs f_flag bits -> mount flags: a remount in a user namespace must repeat the flags the
# host locked on the mount (nosuid, nodev, ...), or the kernel refuses it.
_ST_TO_MS = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: 1024, 2048: 2048,
             4096: 1 << 21}


def _make_readonly(path: str, recursive: bool = True) -> None:
    try:
        _mount_setattr(path, MOUNT_ATTR_RDONLY, 0, recursive)
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
        # Before Linux 5.12: remount the top mount only (submounts keep their own flags).
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for st, ms in _ST_TO_MS.items():
            if os.statvfs(path).f_flag & st:
                flags |= ms
        _mount(None, path.encode(), None, flags)


def _touch(path: str) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))


_NEW, _OLD, _STAGE = "/newroot", "/oldroot", "/stage"


def _open_exact(path: str) -> int:
    """An O_PATH descriptor of the host's `path` (under /oldroot), opened one component at a
    time without following any symlink. The server resolved every link when it planned the
    root; one met now was swapped in since (the agent owns its candidate's directory), and
    following it could bind the host's whole tree."""
    fd = os.open(_OLD, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in [part for part in path.split("/") if part]:
            if name in (".", ".."):
                raise OSError(errno.EINVAL, f"{path}: not a plain path")
            nxt = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                raise OSError(errno.ELOOP, f"{path}: a symlink appeared on the way")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fd_path(fd: int) -> bytes:
    # The magic link resolves to the very file the descriptor holds, whatever its path is now.
    return f"{_OLD}/proc/self/fd/{fd}".encode()


def _apply_op(op: dict[str, Any], later_readonly: list[str]) -> None:
    """One entry of the server's plan (`loom_mcp.sandbox.view`), inside the root being built.

    Paths are the job's (absolute, real: no symlink in them, so nothing below resolves out of
    the new root); sources are read through the host's root, now at /oldroot.
    """
    kind, dst = op["op"], _NEW + op["path"]
    if kind == "tmpfs":
        os.makedirs(dst, exist_ok=True)
        _mount(b"tmpfs", dst.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, op["options"].encode())
        if op.get("readonly"):
            later_readonly.append(dst)  # once what is mounted below it has its mount point
    elif kind == "bind":
        fd = _open_exact(op["src"])
        try:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.makedirs(dst, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                if not os.path.exists(dst):
                    _touch(dst)
            _mount(_fd_path(fd), dst.encode(), None, MS_BIND | MS_REC)
        finally:
            os.close(fd)
        if op["mode"] == "ro":
            _make_readonly(dst)
    elif kind == "mask":
        # Something secret inside a directory that is bound as a whole: cover it with an empty
        # read-only tmpfs (a directory) or /dev/null (a file). The job's own directories below
        # it are bound on top afterwards.
        if os.path.isdir(dst):
            _mount(b"tmpfs", dst.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=64k,mode=0755")
            later_readonly.append(dst)
        else:
            _mount(b"/oldroot/dev/null", dst.encode(), None, MS_BIND)
            _make_readonly(dst, recursive=False)
    elif kind == "symlink":
        if not os.path.lexists(dst):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(op["target"], dst)
    elif kind == "proc":
        os.makedirs(dst, exist_ok=True)
        _mount(b"proc", dst.encode(), b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        _harden_proc(dst, _OLD + "/dev/null")  # or no /proc at all
    elif kind == "devpts":
        os.makedirs(dst, exist_ok=True)
        _mount(b"devpts", dst.encode(), b"devpts", MS_NOSUID | MS_NOEXEC,
               b"newinstance,ptmxmode=0666,mode=0620")
    else:
        raise OSError(errno.EINVAL, f"unknown view entry {kind!r}")


def _build_root(view: dict[str, Any], late: bool = False) -> list[str]:
    """Give this mount namespace a root of its own that holds only what `view` lists.

    Run by init of the job's pid namespace (a fresh /proc can be mounted there, while the host's
    is still in sight, which the kernel requires of a user namespace). The steps are
    bubblewrap's: a tmpfs becomes the root with the host's tree at /oldroot, the new root is
    assembled at /newroot from bind mounts of /oldroot paths, the host's tree is detached, and
    /newroot becomes /. Nothing of the host is reachable afterwards except what was bound:
    not its sockets (an AF_UNIX path is a file), not LOOM_HOME, not $HOME, not /etc/shadow.

    With `late` (a pre-started worker, see _enter_late_root) init stops before the last steps:
    it keeps the host's tree at /oldroot and marks /newroot shared, so that the binds of the
    job it is later given (_apply_late) propagate into the worker's copy of /newroot.

    Returns the optional entries that failed (a missing device node, ...). Raises OSError with
    the host's root restored when a required entry fails (the caller falls back), _Broken when
    it could not even be restored.
    """
    cwd = view["cwd"]
    base = "/tmp" if os.path.isdir("/tmp") else cwd
    # Mounted over the host's /tmp only in this namespace, and moved away by the first pivot.
    _mount(b"tmpfs", base.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0700")
    try:
        os.mkdir(base + _NEW, 0o755)
        os.mkdir(base + _OLD, 0o755)
        _pivot_root(base, base + _OLD)
    except OSError:
        with contextlib.suppress(OSError):
            _umount(base)
        raise
    os.chdir("/")
    problems: list[str] = []
    try:
        if late:  # nothing of ours propagates anywhere but into /newroot's copies, made shared below
            _mount(None, b"/", None, MS_REC | MS_PRIVATE)
        _mount(b"tmpfs", _NEW.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=4m,mode=0755")
        later_readonly = [_NEW]
        for op in view["ops"]:
            try:
                _apply_op(op, later_readonly)
            except OSError as exc:
                if not op.get("optional"):
                    raise OSError(exc.errno, f"{op['op']} {op['path']}: {exc.strerror or exc}") from exc
                problems.append(f"{op['path']}: {exc.strerror or exc}")
        for path in later_readonly:
            _make_readonly(path, recursive=False)
        if late:
            os.mkdir(_STAGE, 0o700)
            _mount(None, _NEW.encode(), None, MS_REC | MS_SHARED)
            return problems
        _mount(None, _OLD.encode(), None, MS_REC | MS_PRIVATE)
        _umount(_OLD)
    except BaseException:
        # Back to the host's root: the half-built one goes with the tmpfs it lives on.
        try:
            _pivot_into(_OLD, cwd)
        except OSError as exc:
            raise _Broken(f"cannot restore the root after a failed view: {exc}") from exc
        raise
    # /newroot becomes / (the base tmpfs, stacked on top by pivot_root, is dropped).
    try:
        _pivot_into(_NEW, cwd)
    except OSError as exc:
        raise _Broken(f"cannot enter the new root: {exc}") from exc
    return problems


def _pivot_into(directory: str, cwd: str) -> None:
    """Make `directory` the root (the root it was stacked on is unmounted), then go back to
    `cwd` inside it."""
    os.chdir(directory)
    _pivot_root(".", ".")
    _umount(".")
    os.chdir(cwd)


def _enter_late_root(cwd: str) -> None:
    """In a pre-started worker, before exec: leave init's mount namespace (which still holds the
    host's tree) for a copy of it, take only propagation from init (slave), and make /newroot
    the root. The host's tree goes with the old root; init's later binds still arrive."""
    _check(_libc().unshare(CLONE_NEWNS), "unshare(mount)")
    _mount(None, b"/", None, MS_REC | MS_SLAVE)
    _pivot_into(_NEW, cwd)


def _apply_late(ops: list[dict[str, Any]]) -> list[str]:
    """In init of a pre-started worker: add one job's entries (its own paths) to the root the
    worker already lives in.

    Each mount is made in a private staging directory first, given its read-only flag there and
    only then moved under /newroot: a mount's flags do not propagate, the mount itself does, so
    the worker's copy arrives read-only or not at all. /newroot's own tmpfs is writable in
    init's view only while the mount points are made (the worker's copy stays read-only).
    Returns the optional entries that failed; raises OSError when a required one fails.
    """
    problems: list[str] = []
    _mount_setattr(_NEW, 0, MOUNT_ATTR_RDONLY, recursive=False)
    try:
        for n, op in enumerate(ops):
            try:
                _apply_late_op(op, f"{_STAGE}/{n}")
            except OSError as exc:
                if not op.get("optional"):
                    raise OSError(exc.errno, f"{op['op']} {op['path']}: {exc.strerror or exc}") from exc
                problems.append(f"{op['path']}: {exc.strerror or exc}")
    finally:
        _mount_setattr(_NEW, MOUNT_ATTR_RDONLY, 0, recursive=False)
    return problems


def _apply_late_op(op: dict[str, Any], stage: str) -> None:
    kind, dst = op["op"], _NEW + op["path"]
    if kind == "symlink" or (kind == "tmpfs" and not op.get("readonly")):
        _apply_op(op, [])
        return
    if kind not in ("bind", "mask", "tmpfs"):
        raise OSError(errno.EINVAL, f"{kind!r} cannot be added to a running job")
    src_fd = _open_exact(op["src"]) if kind == "bind" else None
    try:
        if src_fd is not None:
            is_dir, readonly = stat.S_ISDIR(os.fstat(src_fd).st_mode), op["mode"] == "ro"
        else:
            is_dir, readonly = kind == "tmpfs" or os.path.isdir(dst), True
        if is_dir:
            os.mkdir(stage, 0o700)
            os.makedirs(dst, exist_ok=True)
        else:
            _touch(stage)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if not os.path.exists(dst):
                _touch(dst)
        if src_fd is not None:
            _mount(_fd_path(src_fd), stage.encode(), None, MS_BIND | MS_REC)
        elif kind == "tmpfs":
            _mount(b"tmpfs", stage.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, op["options"].encode())
        elif is_dir:
            _mount(b"tmpfs", stage.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=64k,mode=0755")
        else:
            _mount(b"/oldroot/dev/null", stage.encode(), None, MS_BIND)
    finally:
        if src_fd is not None:
            os.close(src_fd)
    if readonly:
        _mount_setattr(stage, MOUNT_ATTR_RDONLY, 0, recursive=True)
    _mount(stage.encode(), dst.encode(), None, MS_MOVE)


def _read_line(fd: int, limit: int = 1 << 22) -> bytes:
    """One line from `fd` (b"" at EOF before any newline)."""
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1 << 16)
        if not chunk or len(data) > limit:
            return b""
        data += chunk
    return bytes(data)


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
    try:
        # No user namespace below this one (the limit is this namespace's own; the host's stays):
        # in a nested one a job without capabilities here would have them all, enough to mount
        # a cgroup hierarchy rooted at its own cgroup and lift its memory and process limits.
        _write("/proc/sys/user/max_user_namespaces", "0")
    except OSError as exc:
        problems.append(f"nested user namespaces stay possible: {exc}")
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
    _harden_proc("/proc", "/dev/null")


# The kernel's knobs under /proc: written by uid, not by capability, so a job running as the
# server's uid (root, when the server is) could set the host's core_pattern (a program run as
# root on the next crash) or sysrq. Read-only in every job; a few that only leak, hidden.
_PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")
_PROC_HIDDEN = ("kcore", "keys", "key-users", "timer_list", "sched_debug", "latency_stats",
                "acpi", "scsi", "asound")


def _harden_proc(proc: str, devnull: str) -> None:
    try:
        _harden_proc_entries(proc, devnull)
    except OSError:
        with contextlib.suppress(OSError):
            _umount(proc)  # a /proc with the host's knobs writable is worse than none
        raise


def _harden_proc_entries(proc: str, devnull: str) -> None:
    for name in _PROC_READONLY:
        path = f"{proc}/{name}"
        if os.path.lexists(path):
            _mount(path.encode(), path.encode(), None, MS_BIND | MS_REC)
            _make_readonly(path)
    for name in _PROC_HIDDEN:
        path = f"{proc}/{name}"
        if not os.path.lexists(path):
            continue
        if os.path.isdir(path):
            _mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=4k,mode=0555")
            _make_readonly(path, recursive=False)
        else:
            _mount(devnull.encode(), path.encode(), None, MS_BIND)
            _make_readonly(path, recursive=False)


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


def parent_pid(pid: int) -> int | None:
    """A process's parent, or None if it is gone."""
    st = _stat(pid)
    return st[0] if st else None


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and of its reaped children; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0.0
    fields = data[data.rfind(b")") + 2 :].split()  # fields[0] is the state (stat field 3)
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / _CLOCK_TICKS


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
    root: int, cgroup: str | list[str] | None = None, deadline_s: float = 5.0,
    include_root: bool = True,
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
        for path in [cgroup] if isinstance(cgroup, str) else cgroup or []:
            victims += cgroup_pids(path)
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


# ----------------------------------------------------------------------------- job cgroups

# Per controller and cgroup version: the file that holds the job's limit.
_LIMIT_FILES = {("pids", "v1"): "pids.max", ("pids", "v2"): "pids.max",
                ("memory", "v1"): "memory.limit_in_bytes", ("memory", "v2"): "memory.max"}


def _cgroup_dirs() -> list[tuple[str, set[str], Path]]:
    """(version, controllers, our own cgroup directory) for each mounted hierarchy."""
    try:
        cgroup_lines = Path("/proc/self/cgroup").read_text().splitlines()
        mount_lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    v2_path = None
    v1_paths: dict[str, str] = {}
    for line in cgroup_lines:
        hier, names, cg_path = line.split(":", 2)
        if hier == "0" and names == "":
            v2_path = cg_path
        else:
            for controller in names.split(","):
                v1_paths[controller] = cg_path
    dirs: list[tuple[str, set[str], Path]] = []
    for line in mount_lines:
        pre, _, post = line.partition(" - ")
        fields, post_fields = pre.split(), post.split()
        if len(fields) < 5 or len(post_fields) < 3:
            continue
        root, mountpoint, fstype = fields[3], fields[4], post_fields[0]
        if fstype == "cgroup":
            controllers = set(post_fields[2].split(",")) & {"pids", "memory"}
            own = v1_paths.get(next(iter(controllers), ""))
            version = "v1"
        elif fstype == "cgroup2" and v2_path:
            own, version = v2_path, "v2"
            controllers = set()
        else:
            continue
        if not own:
            continue
        # A bind-mounted sub-hierarchy (containers): our path is relative to the mount's root.
        if root != "/" and own.startswith(root):
            own = own[len(root) :]
        path = Path(mountpoint) / own.lstrip("/")
        if version == "v2":
            try:
                controllers = set((path / "cgroup.controllers").read_text().split())
            except OSError:
                continue
        dirs.append((version, controllers, path))
    return dirs


def _try_controller(version: str, parent: Path, controller: str) -> bool:
    """Can we create a child of `parent` carrying `controller`'s limit, and join it?

    cgroup v2 only gives a child a controller its parent enables in cgroup.subtree_control,
    which the kernel refuses while the parent itself holds processes (the server's own cgroup,
    usually): then there is no memory cgroup for jobs and the launcher uses RLIMIT_DATA.
    """
    probe = parent / f"loom-probe-{os.getpid()}-{controller}"
    limit_file = _LIMIT_FILES[(controller, version)]
    try:
        probe.mkdir()
    except OSError:
        return False
    try:
        if version == "v2" and not (probe / limit_file).exists():
            with contextlib.suppress(OSError):
                (parent / "cgroup.subtree_control").write_text(f"+{controller}")
        (probe / limit_file).write_text("-1" if limit_file == "memory.limit_in_bytes" else "max")
        # Joining needs write access to cgroup.procs of the common ancestor as well: try it
        # from a child that does nothing else.
        kid = os.fork()
        if kid == 0:
            try:
                _write(str(probe / "cgroup.procs"), "0")
                os._exit(0)
            except BaseException:
                os._exit(1)
        _, status = os.waitpid(kid, 0)
        return os.waitstatus_to_exitcode(status) == 0
    except OSError:
        return False
    finally:
        remove_job_cgroup(str(probe))


@functools.cache
def cgroup_parents() -> dict[str, tuple[str, Path]]:
    """controller ("pids", "memory") -> (cgroup version, directory under which job cgroups with
    that controller's limit can be created and joined). Probed once per process (blocking)."""
    found: dict[str, tuple[str, Path]] = {}
    for version, controllers, path in _cgroup_dirs():
        for controller in ("pids", "memory"):
            if controller in found or controller not in controllers:
                continue
            if _try_controller(version, path, controller):
                found[controller] = (version, path)
                _sweep_stale_cgroups(path)
    return found


def pids_cgroup_parent() -> Path | None:
    """A cgroup directory under which we may create job cgroups with a pids limit, or None."""
    found = cgroup_parents().get("pids")
    return found[1] if found else None


def _sweep_stale_cgroups(parent: Path) -> None:
    """Remove job cgroups left by servers that died before cleaning up (SIGKILL, OOM).

    rmdir only succeeds on an empty cgroup, so a live job elsewhere is never disturbed.
    """
    for entry in parent.glob("loom-*-*"):
        owner = entry.name.split("-")[1]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            with contextlib.suppress(OSError):
                entry.rmdir()


_cgroup_counter = itertools.count()


def create_job_cgroups(max_tasks: int | None, memory_bytes: int | None) -> dict[str, str]:
    """Fresh cgroups for one job: controller -> directory (the launcher joins each).

    `max_tasks`: a pids limit (None: none wanted). `memory_bytes`: memory.max with swap off
    (v2) / memory.limit_in_bytes and memsw (v1); on v2 the OOM killer then ends the whole job
    (memory.oom.group), not one of its processes. Controllers that are not available, or
    whose setup fails, are left out: the caller falls back (RLIMIT_NPROC, RLIMIT_DATA).
    """
    wanted = {"pids": max_tasks, "memory": memory_bytes}
    parents = cgroup_parents()
    made: dict[Path, Path] = {}  # parent -> the job's directory under it
    out: dict[str, str] = {}
    name = f"loom-{os.getpid()}-{next(_cgroup_counter)}"
    for controller, value in wanted.items():
        if not value or controller not in parents:
            continue
        version, parent = parents[controller]
        try:
            path = made.get(parent)
            if path is None:
                path = parent / name
                path.mkdir()
                made[parent] = path
            if controller == "pids":
                (path / "pids.max").write_text(str(value))
            elif version == "v2":
                (path / "memory.max").write_text(str(value))
                for extra, text in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                    with contextlib.suppress(OSError):
                        (path / extra).write_text(text)
            else:
                (path / "memory.limit_in_bytes").write_text(str(value))
                with contextlib.suppress(OSError):  # only where swap accounting is on
                    (path / "memory.memsw.limit_in_bytes").write_text(str(value))
            out[controller] = str(path)
        except OSError:
            continue
    for path in made.values():
        if str(path) not in out.values():
            remove_job_cgroup(str(path))
    return out


def create_job_cgroup(limit: int) -> str | None:
    """A fresh pids cgroup for one job (the launcher joins it), or None if unavailable."""
    return create_job_cgroups(limit, None).get("pids")


def cgroup_oom_kills(path: str) -> int:
    """How many processes the kernel's OOM killer ended in this job cgroup (v2 or v1)."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            text = Path(path, name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return 0


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
    return _probe_outcome(r, pid)


def _probe_outcome(r: int, pid: int) -> dict[str, Any]:
    """What a probe child wrote on its pipe, once it has exited."""
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    try:
        return json.loads(b"".join(chunks) or b"{}") or {"ok": False, "error": "probe died"}
    except ValueError:
        return {"ok": False, "error": "probe died"}


def _view_checks(checks: dict[str, Any]) -> dict[str, bool]:
    """In init, inside a freshly built root: does it hide and show what it should?"""

    def hidden(path: str) -> bool:
        return not os.path.lexists(path)

    def writes(path: str) -> bool:
        try:
            with open(path, "w") as f:
                f.write("x")
            return True
        except OSError:
            return False

    def reads(path: str) -> bool:
        try:
            with open(path) as f:
                return f.read() == "ok"
        except OSError:
            return False

    def connects(path: str) -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(2)
                s.connect(path)
            return True
        except OSError:
            return False

    def rewrites(path: str) -> bool:  # writes back the value it read: harmless if it works
        try:
            with open(path, "r+b") as f:
                data = f.read()
                f.seek(0)
                f.write(data or b"\n")
            return True
        except OSError:
            return False

    def nests_user_namespace() -> bool:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if _libc().unshare(CLONE_NEWUSER) == 0 else 1)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0

    return {
        "proc": os.path.exists("/proc/self") and os.readlink("/proc/self") == "1",
        "proc_sys_readonly": not rewrites("/proc/sys/kernel/core_pattern"),
        "no_nested_user_namespace": not nests_user_namespace(),
        "etc_secrets_hidden": all(hidden(p) for p in ("/etc/shadow", "/etc/gshadow", "/etc/sudoers",
                                                       "/etc/ssh")),
        "etc_passwd_kept": os.path.exists("/etc/passwd") or not checks.get("passwd"),
        "host_files_hidden": hidden(checks["secret"]),
        "host_socket_blocked": not connects(checks["socket"]),
        "loom_home_hidden": all(hidden(p) for p in checks["loom_home"]),
        "home_hidden": all(hidden(p) for p in checks["home"]),
        "readable": reads(checks["readable"]),
        "readable_is_readonly": not writes(checks["readable"]),
        "job_dir_writable": writes(os.path.join(checks["job_dir"], "probe")),
        "tmp_writable": writes("/tmp/probe"),
        "dev_null": writes("/dev/null"),
    }


def _probe_view(features: list[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """In a throw-away child: build a job's root in init of a new pid namespace and check it."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _enter_namespaces(features)
            init = os.fork()
            if init == 0:
                try:
                    problems = _build_root(cfg["view"])
                    out: dict[str, Any] = {"checks": _view_checks(cfg["checks"])}
                    # The two kernel-knob checks are reported, not required: a root of its own
                    # is still far better than the host's tree where they fail.
                    out["ok"] = all(v for k, v in out["checks"].items()
                                    if k not in ("proc_sys_readonly", "no_nested_user_namespace"))
                    if problems:
                        out["problems"] = problems
                    if not out["ok"]:
                        failed = [k for k, v in out["checks"].items() if not v]
                        out["error"] = "the root view did not hold: " + ", ".join(failed)
                except BaseException as exc:
                    out = {"ok": False, "error": str(exc)}
                os.write(w, json.dumps(out).encode())
                os._exit(0)
            os.waitpid(init, 0)
        except BaseException as exc:
            os.write(w, json.dumps({"ok": False, "error": str(exc)}).encode())
        os._exit(0)
    os.close(w)
    return _probe_outcome(r, pid)


def _probe_late(features: list[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """In a throw-away child: a worker in a late root (as a blank worker), then a read-only bind
    added by init; does the worker see it, read-only, and nothing of init's host tree?"""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _enter_namespaces(features)
            init = os.fork()
            if init == 0:
                out: dict[str, Any] = {"ok": False}
                try:
                    _build_root(cfg["view"], late=True)
                    entered_r, entered_w = os.pipe()
                    added_r, added_w = os.pipe()
                    worker = os.fork()
                    if worker == 0:
                        os.close(entered_r)
                        os.close(added_w)
                        _enter_late_root(cfg["view"]["cwd"])
                        os.close(entered_w)
                        os.read(added_r, 1)
                        target = cfg["late"]["path"] + "/file"
                        checks = {"added": os.path.isfile(target) and open(target).read() == "ok",
                                  "added_is_readonly": _stays_readonly(target),
                                  "host_tree_gone": not os.path.lexists(_OLD) and not os.path.lexists(_STAGE)}
                        os.write(w, json.dumps({"ok": all(checks.values()), "checks": checks}).encode())
                        os._exit(0)
                    os.close(entered_w)
                    os.read(entered_r, 1)
                    _apply_late([{"op": "bind", "path": cfg["late"]["path"], "src": cfg["late"]["src"],
                                  "mode": "ro", "optional": False}])
                    os.close(added_w)
                    os.waitpid(worker, 0)
                    os._exit(0)
                except BaseException as exc:
                    out["error"] = str(exc)
                os.write(w, json.dumps(out).encode())
                os._exit(0)
            os.waitpid(init, 0)
        except BaseException as exc:
            os.write(w, json.dumps({"ok": False, "error": str(exc)}).encode())
        os._exit(0)
    os.close(w)
    return _probe_outcome(r, pid)


def _stays_readonly(path: str) -> bool:
    try:
        with open(path, "a") as f:
            f.write("x")
        return False
    except OSError:
        return True


def _probe_main(view_cfg: dict[str, Any] | None) -> NoReturn:
    results = {name: _probe_one(features) for name, features in _PROBES.items()}
    if view_cfg is not None:
        features = next((_PROBES[n] for n in ("user+net+pid", "user+pid") if results[n].get("ok")), None)
        if features is None:
            results["view"] = {"ok": False, "error": "needs a pid (and mount) namespace"}
        else:
            results["view"] = _probe_view(features, view_cfg)
            if results["view"].get("ok"):
                results["late"] = _probe_late(features, view_cfg)
    sys.stdout.write(json.dumps({"uid": os.geteuid(), "probes": results}))
    sys.stdout.flush()
    os._exit(0)


def _view_probe_config(scratch: Path) -> dict[str, Any]:
    """A job view to probe with, and what to look for inside it (server side)."""
    from loom_mcp.sandbox import view as view_plan  # not in the launcher: it is stdlib-only

    job, readable, secret = scratch / "job", scratch / "readable", scratch / "secret"
    for path in (job, readable, secret):
        path.mkdir()
    (readable / "file").write_text("ok")
    (secret / "file").write_text("secret")
    hidden = view_plan.hidden_paths()
    home = Path.home()
    bound = view_plan.system_paths()
    # $HOME's entries that no system bind needs (the interpreter may live under it: pyenv)
    home_entries = []
    with contextlib.suppress(OSError):
        for entry in sorted(home.iterdir())[:50]:
            if not any(b == entry or entry in b.parents or b in entry.parents for b in bound):
                home_entries.append(str(entry))
    return {
        "view": {"ops": view_plan.job_view(job_dir=job, readable=[readable], writable=[],
                                           tmp_bytes=1 << 20),
                 "cwd": str(job)},
        "late": {"path": str(scratch / "late"), "src": str(readable)},
        "checks": {"secret": str(secret / "file"), "socket": str(scratch / "sock"),
                   "loom_home": [str(p) for p in hidden if p.exists()][:5],
                   "home": home_entries[:8], "readable": str(readable / "file"),
                   "job_dir": str(job), "passwd": os.path.exists("/etc/passwd")},
    }


@functools.cache
def capabilities() -> dict[str, Any]:
    """What this machine allows, probed once per server process. Blocking (~0.2 s)."""
    caps: dict[str, Any] = {"uid": os.geteuid(), "probes": {}, "error": None}
    if sys.platform != "linux":
        caps["error"] = f"namespaces need Linux, this is {sys.platform}"
    else:
        import shutil
        import tempfile

        scratch = Path(tempfile.mkdtemp(prefix="loom-probe-"))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(scratch / "sock"))
            listener.listen(1)
            try:
                view_cfg: dict[str, Any] | None = _view_probe_config(scratch)
            except Exception as exc:  # a planning bug must not cost the other protections
                view_cfg = None
                caps["view_error"] = f"cannot plan a root view: {exc}"
            proc = subprocess.run(
                [sys.executable, "-I", "-S", LAUNCHER, "--probe", json.dumps(view_cfg)],
                capture_output=True,
                timeout=30,
                stdin=subprocess.DEVNULL,
            )
            caps.update(json.loads(proc.stdout))
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            caps["error"] = f"probe failed: {exc}"
        finally:
            listener.close()
            shutil.rmtree(scratch, ignore_errors=True)
    parents = cgroup_parents()
    caps["cgroup"] = str(parents["pids"][1]) if "pids" in parents else None
    caps["memory_cgroup"] = (f"{parents['memory'][0]} {parents['memory'][1]}"
                             if "memory" in parents else None)
    return caps


def _ok(caps: dict[str, Any], name: str) -> bool:
    return bool(caps["probes"].get(name, {}).get("ok"))


def plan(caps: dict[str, Any], allow_network: bool) -> dict[str, Any]:
    """Features for one job: namespaces to enter, how to cap the process count, whether it gets
    a root of its own, and how its memory is limited."""
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
        # The root view is built by init, so it needs the pid namespace (and its mount ns).
        # LOOM_SANDBOX_VIEW=readonly is the way back to the read-only host tree, for a machine
        # where a toolchain needs a path the allowlist does not bind.
        "view": "pid" in features and _ok(caps, "view")
        and os.environ.get("LOOM_SANDBOX_VIEW", "allowlist") != "readonly",
        # Paths added to a running job's root (blank workers: sandbox/warm.py)
        "late": "pid" in features and _ok(caps, "view") and _ok(caps, "late"),
        "memory": "cgroup" if caps.get("memory_cgroup") else "rlimit",
    }


def _describe(caps: dict[str, Any]) -> dict[str, str]:
    def why(name: str) -> str:
        if caps.get("error"):
            return caps["error"]
        return caps["probes"].get(name, {}).get("error") or caps.get(f"{name}_error") or "not available"

    cut = plan(caps, allow_network=False)
    features = cut["unshare"]
    checks: dict[str, bool] = caps["probes"].get("view", {}).get("checks") or {}
    view = cut["view"]
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
    if view:
        report["root_view"] = (
            "allowlist: each job gets a root of its own (tmpfs + pivot_root in its mount "
            "namespace) holding only system directories, the interpreter and its packages, GPU "
            "toolkits, a curated /etc, a minimal /dev with the GPU nodes, private /tmp, /run and "
            "/dev/shm, and the directories the job names (probed: " + _passed(checks) + ")"
        )
    elif "pid" in features:
        report["root_view"] = (
            f"not available ({why('view')}): jobs see the host's tree, read-only outside their "
            "own directories"
        )
    else:
        report["root_view"] = "not available: no mount namespace for jobs here"
    if "pid" in features:
        report["filesystem"] = (
            "read-only for judged code outside its job directory and its own compile cache "
            "(each job records the view it had: 'allowlist' or, as a fallback, 'readonly' "
            "via mount_setattr, Linux 5.12+)"
        )
    else:
        report["filesystem"] = "not read-only: no mount namespace for jobs here"

    def held(key: str, yes: str, no: str) -> str:
        return yes if view and checks.get(key) else "not " + no

    report["etc_secrets"] = held(
        "etc_secrets_hidden", "hidden: /etc/shadow, gshadow, sudoers and ssh are not in a job's root",
        "hidden: jobs read the host's /etc (file permissions only)")
    report["host_sockets"] = held(
        "host_socket_blocked", "out of reach: no host path is in a job's root, so no host AF_UNIX "
        "socket (docker.sock, ssh-agent, X11) can be connected to",
        "blocked: the network namespace does not cover path sockets and the host tree is visible")
    report["loom_home"] = held(
        "loom_home_hidden", "hidden: a job sees only its own job and compile-cache directories "
        "(trusted workers: the job directories, read-only; never the ledger or loom.toml)",
        "hidden: LOOM_HOME (ledger, config, other jobs) is readable by jobs")
    report["home"] = held(
        "home_hidden", "private: HOME is the job's own directory and the real one is not in "
        "its root (trusted workers reading allowed roots that contain it: credentials masked)",
        "hidden: HOME points at the job's own directory, but the real one stays readable")
    memory = caps.get("memory_cgroup")
    if memory:
        report["memory_limit"] = (f"enforced per job (job_memory_bytes): cgroup {memory.split()[0]} "
                                  f"under {memory.split(' ', 1)[1]}; an OOM kill is reported as "
                                  "memory_exceeded")
    else:
        report["memory_limit"] = (
            "enforced per job (job_memory_bytes) by RLIMIT_DATA: no writable memory cgroup here; "
            "CPU allocations past it fail (MemoryError) and are reported as memory_exceeded")
    report["disk_quota"] = (
        "enforced per job (job_disk_bytes): the supervisor sums what the job's directories grew "
        "by about once a second and kills it past the quota; its /tmp and /dev/shm are tmpfs of "
        "that size; RLIMIT_FSIZE per file")
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
    if view and cut["late"]:
        report["blank_workers"] = (
            "available: on a GPU host candidates, benchmark arms and the timer start in workers "
            "started ahead (torch imported), whose init adds the job's own paths read-only or "
            "writable as a fresh root would have them; init is non-dumpable and keeps the host "
            "tree out of the worker's mount namespace (probed: " +
            _passed(caps["probes"]["late"].get("checks") or {}) + ")")
    else:
        report["blank_workers"] = (f"not available ({why('late')}): every candidate, arm and "
                                   "timer starts a fresh process")
    report["kernel_knobs"] = held(
        "proc_sys_readonly", "out of reach: /proc/sys, sysrq-trigger, irq, bus and fs are read-only "
        "in a job's /proc (kcore, keys, timer_list and a few more hidden), whatever uid it runs as",
        "read-only: a job running as root could write the host's sysctls (core_pattern)")
    report["nested_namespaces"] = held(
        "no_nested_user_namespace", "refused: a job's user namespace allows none below it, so it "
        "cannot gain capabilities there (to mount its own cgroup and lift its limits)",
        "refused: a job can create user namespaces below its own")
    report["host_ipc"] = ("own UTS and IPC namespaces (the host's SysV segments, message queues "
                          "and hostname out of reach), a fresh session keyring")
    report["capabilities"] = (
        "dropped before exec: empty bounding, permitted, effective and ambient sets, no_new_privs")
    report["core_dumps"] = "off (RLIMIT_CORE=0)"
    report["file_size"] = "limited per job (RLIMIT_FSIZE)"
    report["environment"] = "allowlist; secret-looking names dropped"
    report["output"] = "bounded tail of stdout/stderr; results over a private pipe"
    report["timing"] = ("taken by a trusted timer process that runs no candidate code (CPU: the "
                        "handshake; GPU: the arms' own events, checked against its brackets)")
    report["audit_hook"] = ("in every process that imports candidate code: frame walks, ctypes, "
                            "/proc/self/mem, dynamic code, tracing and gc from candidate code "
                            "are refused and reported (guard.* findings)")
    import shutil

    bwrap = shutil.which("bwrap")
    report["bwrap"] = (f"found at {bwrap}, not used: " if bwrap else "bwrap: not installed, ") + (
        "the launcher builds the view in its own mount namespace")
    return report


def _passed(checks: dict[str, bool]) -> str:
    return ", ".join(k for k, v in checks.items() if v) or "nothing"


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


def _setup_fs(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """In init: the job's file system (its own root, else the host's read-only) and /proc."""
    applied: dict[str, Any] = {"view": "none", "readonly_fs": False, "proc": False}
    errors: dict[str, str] = {}
    view = cfg.get("view")
    if view is not None:
        try:
            problems = _build_root(view, late=bool(cfg.get("late")))
        except OSError as exc:
            # The server planned a root of its own because the probe built one here: failing
            # now is this job's paths (or someone swapping them), and must not buy the job the
            # host's tree, even read-only.
            raise _Broken(f"the job's root could not be built: {exc}") from exc
        else:
            applied.update(view="allowlist", readonly_fs=True)
            applied["proc"] = not any(p.startswith("/proc:") for p in problems)
            if problems:
                errors["view"] = "; ".join(problems)
    writable = cfg.get("writable")
    if applied["view"] == "none" and writable is not None:
        try:
            _readonly_fs(writable)
            applied.update(view="readonly", readonly_fs=True)
        except OSError as exc:
            errors["readonly_fs"] = str(exc)
    if applied["view"] != "allowlist":
        try:
            _mount_proc()
            applied["proc"] = True
        except OSError as exc:
            errors["proc"] = str(exc)
    return applied, errors


def _run_with_init(cfg: dict[str, Any], argv: list[str], meta_fd: int | None,
                   worker_fds: list[int]) -> NoReturn:
    status_r, status_w = os.pipe()
    # init arms PDEATHSIG after fork; if we died before that, this pipe reads EOF.
    alive_r, alive_w = os.pipe()
    ack_fd: int | None = cfg.get("ack_fd")
    init = os.fork()
    if init == 0:
        os.close(status_r)
        os.close(alive_w)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if select.select([alive_r], [], [], 0)[0]:
            os._exit(1)
        # Signals from inside the namespace reach init only where it has a handler: Python's
        # for SIGINT would let the job end itself through init (rc 130) rather than by exiting.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            applied, errors = _setup_fs(cfg)
        except _Broken as exc:
            os.write(2, f"loom sandbox: setup failed: {exc}\n".encode())
            os._exit(SETUP_FAILED)
        late = bool(cfg.get("late")) and applied["view"] == "allowlist"
        if late:
            # init keeps the host's tree: no one may ptrace it or read /proc/1/root or its fds.
            _prctl(PR_SET_DUMPABLE, 0)
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
                    _enter_late_root(cfg["view"]["cwd"])
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
                # moment (the root's read-only one, in _apply_late) would be copied with them.
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
        problems = _apply_late(message.get("ops") or [])
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


SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 250, "s390x": 280}
KEYCTL_JOIN_SESSION_KEYRING = 1


def _fresh_keyring() -> None:
    """A new, empty session keyring for the job: the server's (a login's, with its tokens) is
    otherwise inherited, readable and writable by every job. Best effort: no keyctl, no keys."""
    number = SYS_KEYCTL.get(os.uname().machine)
    if number is not None:
        _libc().syscall(ctypes.c_long(number), ctypes.c_int(KEYCTL_JOIN_SESSION_KEYRING),
                        ctypes.c_char_p(None))


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
    _fresh_keyring()
    fsize = cfg.get("fsize")
    if fsize:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    applied: dict[str, Any] = {"user": False, "net": False, "pid": False, "nproc": None,
                               "memory": None}
    errors: dict[str, str] = {}
    joined: dict[str, str] = {}
    for controller, path in (cfg.get("cgroups") or {}).items():
        if path in joined.values():  # cgroup v2: one directory carries every controller
            joined[controller] = path
            continue
        try:
            _write(os.path.join(path, "cgroup.procs"), "0")
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
        _probe_main(json.loads(sys.argv[2]) if len(sys.argv) > 2 else None)
    if sys.argv[1:2] == ["--config-fd"] and len(sys.argv) > 3:
        with os.fdopen(int(sys.argv[2]), "rb") as config:  # closed: init and the worker never see it
            cfg = json.loads(config.read())
        _launch(cfg, sys.argv[3:])
    if len(sys.argv) < 3:
        os.write(2, b"usage: isolation.py (CONFIG_JSON | --config-fd FD) ARGV...\n")
        os._exit(2)
    _launch(json.loads(sys.argv[1]), sys.argv[2:])


if __name__ == "__main__":
    _main()
