"""OS isolation, the server's side: what this machine allows (`capabilities()`, probed once by
running the launcher with `--probe`), which features one job gets (`plan()`), and what the
sandbox enforces in words (`isolation_report()`, for `doctor`).

The launcher itself is `launcher.py` (standard library only, run with `-I -S`); what it does
to the kernel is `mounts.py`, the probes `probe.py`, process trees and cgroups `procs.py`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from loom_mcp.sandbox.probe import _PROBES
from loom_mcp.sandbox.procs import cgroup_parents

LAUNCHER = str(Path(__file__).with_name("launcher.py"))


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
        "view": {
            "ops": view_plan.job_view(job_dir=job, readable=[readable], writable=[], tmp_bytes=1 << 20),
            "cwd": str(job),
        },
        "late": {"path": str(scratch / "late"), "src": str(readable)},
        "checks": {
            "secret": str(secret / "file"),
            "socket": str(scratch / "sock"),
            "loom_home": [str(p) for p in hidden if p.exists()][:5],
            "home": home_entries[:8],
            "readable": str(readable / "file"),
            "job_dir": str(job),
            "passwd": os.path.exists("/etc/passwd"),
        },
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
    caps["memory_cgroup"] = f"{parents['memory'][0]} {parents['memory'][1]}" if "memory" in parents else None
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
        "view": "pid" in features
        and _ok(caps, "view")
        and os.environ.get("LOOM_SANDBOX_VIEW", "allowlist") != "readonly",
        # Paths added to a running job's root (blank workers: sandbox/warm.py)
        "late": "pid" in features and _ok(caps, "view") and _ok(caps, "late"),
        "memory": "cgroup" if caps.get("memory_cgroup") else "rlimit",
    }


# What a job's own root keeps from it, where the view probe confirmed it: report entry ->
# (the probe's check, what holds, what does not after "not ").
_HELD_BY_VIEW = {
    "etc_secrets": (
        "etc_secrets_hidden",
        "hidden: /etc/shadow, gshadow, sudoers and ssh are not in a job's root",
        "hidden: jobs read the host's /etc (file permissions only)",
    ),
    "host_sockets": (
        "host_socket_blocked",
        "out of reach: no host path is in a job's root, so no host AF_UNIX "
        "socket (docker.sock, ssh-agent, X11) can be connected to",
        "blocked: the network namespace does not cover path sockets and the host tree is visible",
    ),
    "loom_home": (
        "loom_home_hidden",
        "hidden: a job sees only its own job and compile-cache directories "
        "(trusted workers: the job directories, read-only; never the ledger or loom.toml)",
        "hidden: LOOM_HOME (ledger, config, other jobs) is readable by jobs",
    ),
    "home": (
        "home_hidden",
        "private: HOME is the job's own directory and the real one is not in "
        "its root (trusted workers reading allowed roots that contain it: credentials masked)",
        "hidden: HOME points at the job's own directory, but the real one stays readable",
    ),
    "kernel_knobs": (
        "proc_sys_readonly",
        "out of reach: /proc/sys, sysrq-trigger, irq, bus and fs are read-only "
        "in a job's /proc (kcore, keys, timer_list and a few more hidden), whatever uid it runs as",
        "read-only: a job running as root could write the host's sysctls (core_pattern)",
    ),
    "nested_namespaces": (
        "no_nested_user_namespace",
        "refused: a job's user namespace allows none below it, so it "
        "cannot gain capabilities there (to mount its own cgroup and lift its limits)",
        "refused: a job can create user namespaces below its own",
    ),
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
            f"not available ({why('view')}): jobs see the host's tree, read-only outside their own directories"
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

    for name, (check, yes, no) in _HELD_BY_VIEW.items():
        report[name] = yes if view and checks.get(check) else "not " + no
    memory = caps.get("memory_cgroup")
    if memory:
        report["memory_limit"] = (
            f"enforced per job (job_memory_bytes): cgroup {memory.split()[0]} "
            f"under {memory.split(' ', 1)[1]}; an OOM kill is reported as "
            "memory_exceeded"
        )
    else:
        report["memory_limit"] = (
            "enforced per job (job_memory_bytes) by RLIMIT_DATA: no writable memory cgroup here; "
            "CPU allocations past it fail (MemoryError) and are reported as memory_exceeded"
        )
    report["disk_quota"] = (
        "enforced per job (job_disk_bytes): the supervisor sums what the job's directories grew "
        "by about once a second and kills it past the quota; its /tmp and /dev/shm are tmpfs of "
        "that size; RLIMIT_FSIZE per file"
    )
    if cut["limit_by"] == "nproc":
        report["process_limit"] = "enforced: RLIMIT_NPROC inside a user namespace"
    elif cut["limit_by"] == "cgroup":
        report["process_limit"] = f"enforced: pids cgroup under {caps['cgroup']}"
    elif caps["uid"] == 0:
        report["process_limit"] = (
            "not enforced: running as root (the kernel ignores RLIMIT_NPROC for root) and no writable pids cgroup"
        )
    else:
        report["process_limit"] = "not enforced: no user namespace and no writable pids cgroup"
    if view and cut["late"]:
        report["blank_workers"] = (
            "available: on a GPU host candidates, benchmark arms and the timer start in workers "
            "started ahead (torch imported), whose init adds the job's own paths read-only or "
            "writable as a fresh root would have them; init is non-dumpable and keeps the host "
            "tree out of the worker's mount namespace (probed: "
            + _passed(caps["probes"]["late"].get("checks") or {})
            + ")"
        )
    else:
        report["blank_workers"] = (
            f"not available ({why('late')}): every candidate, arm and timer starts a fresh process"
        )
    report["host_ipc"] = (
        "own UTS and IPC namespaces (the host's SysV segments, message queues "
        "and hostname out of reach), a fresh session keyring"
    )
    report["capabilities"] = "dropped before exec: empty bounding, permitted, effective and ambient sets, no_new_privs"
    report["core_dumps"] = "off (RLIMIT_CORE=0)"
    report["file_size"] = "limited per job (RLIMIT_FSIZE)"
    report["environment"] = "allowlist; secret-looking names dropped"
    report["output"] = "bounded tail of stdout/stderr; results over a private pipe"
    report["timing"] = (
        "taken by a trusted timer process that runs no candidate code (CPU: the "
        "handshake; GPU: the arms' own events, checked against its brackets)"
    )
    report["audit_hook"] = (
        "in every process that imports candidate code: frame walks, ctypes, "
        "/proc/self/mem, dynamic code, tracing and gc from candidate code "
        "are refused and reported (guard.* findings)"
    )
    import shutil

    bwrap = shutil.which("bwrap")
    report["bwrap"] = (f"found at {bwrap}, not used: " if bwrap else "bwrap: not installed, ") + (
        "the launcher builds the view in its own mount namespace"
    )
    return report


def _passed(checks: dict[str, bool]) -> str:
    return ", ".join(k for k, v in checks.items() if v) or "nothing"


@functools.cache
def isolation_report() -> dict[str, str]:
    """What the sandbox enforces on this machine, in words (cached; blocking on first call)."""
    return _describe(capabilities())
