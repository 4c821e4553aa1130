"""Process trees and job cgroups: finding and killing everything a job started, and the
per-job pids and memory cgroups with their limits. Used by the server and by the launcher (a
subreaper ends its tree with kill_tree), so standard library only.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import time
from pathlib import Path

if __package__:
    from loom_mcp.sandbox import mounts
else:  # run by the launcher with -I -S: its own directory is on sys.path
    import mounts  # type: ignore[import-not-found,no-redef]

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
    root: int,
    cgroup: str | list[str] | None = None,
    deadline_s: float = 5.0,
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
_LIMIT_FILES = {
    ("pids", "v1"): "pids.max",
    ("pids", "v2"): "pids.max",
    ("memory", "v1"): "memory.limit_in_bytes",
    ("memory", "v2"): "memory.max",
}


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
                mounts._write(str(probe / "cgroup.procs"), "0")
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
