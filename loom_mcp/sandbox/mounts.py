"""What the launcher does to the kernel before a worker runs: the namespaces it enters, the root
it builds for the job (or the host's tree made read-only), the paths a blank worker's init adds
later, and a /proc whose kernel knobs are out of reach.

Standard library only: it runs inside the launcher (`launcher.py`, started with `-I -S`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import socket
import stat
import struct
from typing import Any

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


CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
# The pid namespace comes with a mount namespace (its /proc, the job's root), a UTS one (a job may
# not rename the host) and an IPC one (SysV segments and message queues are otherwise shared
# with the host and with every other job, and outlive the job).
_NS_FLAGS = {
    "user": CLONE_NEWUSER,
    "net": CLONE_NEWNET,
    "pid": CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC,
}


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


def _mount(source: bytes | None, target: bytes, fstype: bytes | None, flags: int, data: bytes | None = None) -> None:
    _check(_libc().mount(source, target, fstype, flags, data), f"mount {target.decode()}")


def _umount(target: str, flags: int = MNT_DETACH) -> None:
    _check(_libc().umount2(target.encode(), flags), f"umount {target}")


def _pivot_root(new_root: str, put_old: str) -> None:
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown syscall number on {os.uname().machine}")
    ret = _libc().syscall(ctypes.c_long(number), ctypes.c_char_p(new_root.encode()), ctypes.c_char_p(put_old.encode()))
    _check(ret, f"pivot_root {new_root}")


def _mount_setattr(path: str, set_flags: int, clear_flags: int, recursive: bool = True) -> None:
    """mount_setattr(2) on `path` (and every mount below it when `recursive`)."""
    attr = (ctypes.c_uint64 * 4)(set_flags, clear_flags, 0, 0)  # struct mount_attr
    libc = _libc()
    ret = libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        ctypes.c_char_p(path.encode()),
        ctypes.c_uint(AT_RECURSIVE if recursive else 0),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
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
_ST_TO_MS = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}


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
        _mount(b"devpts", dst.encode(), b"devpts", MS_NOSUID | MS_NOEXEC, b"newinstance,ptmxmode=0666,mode=0620")
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
_PROC_HIDDEN = ("kcore", "keys", "key-users", "timer_list", "sched_debug", "latency_stats", "acpi", "scsi", "asound")


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
