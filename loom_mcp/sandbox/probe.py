"""What this machine allows, probed in throw-away children of the launcher (`launcher.py
--probe`): which namespaces can be entered, whether RLIMIT_NPROC bites, whether a job's own root
can be built and holds, whether paths can be added to a running job's root. Standard library
only.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import socket
import sys
from collections.abc import Callable
from typing import Any, NoReturn

if __package__:
    from loom_mcp.sandbox import mounts
else:  # run by the launcher with -I -S: its own directory is on sys.path
    import mounts  # type: ignore[import-not-found,no-redef]

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
            problems = mounts._enter_namespaces(features)
            if "pid" in features:
                # Test from inside the new pid namespace, as init will run: once this first
                # child exits the namespace is dead and nothing more can be forked into it.
                init = os.fork()
                if init == 0:
                    try:
                        mounts._mount_proc()
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


def _probe_outcome(r: int, pid: int | None) -> dict[str, Any]:
    """What a probe child wrote on its pipe, once it has exited."""
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    if pid is not None:
        os.waitpid(pid, 0)
    try:
        return json.loads(b"".join(chunks) or b"{}") or {"ok": False, "error": "probe died"}
    except ValueError:
        return {"ok": False, "error": "probe died"}


def writes(path: str) -> bool:
    """Can this process write `path` (a probe's scratch file: it is overwritten)?"""
    try:
        with open(path, "w") as f:
            f.write("x")
        return True
    except OSError:
        return False


def _view_checks(checks: dict[str, Any]) -> dict[str, bool]:
    """In init, inside a freshly built root: does it hide and show what it should?"""

    def hidden(path: str) -> bool:
        return not os.path.lexists(path)

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
            os._exit(0 if mounts._libc().unshare(mounts.CLONE_NEWUSER) == 0 else 1)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0

    return {
        "proc": os.path.exists("/proc/self") and os.readlink("/proc/self") == "1",
        "proc_sys_readonly": not rewrites("/proc/sys/kernel/core_pattern"),
        "no_nested_user_namespace": not nests_user_namespace(),
        "etc_secrets_hidden": all(hidden(p) for p in ("/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/etc/ssh")),
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


def _in_probe_init(features: list[str], body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """In a throw-away child: enter `features`, then run `body` in init of the new pid namespace
    (a job's root is built there); what it returns comes back over a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            mounts._enter_namespaces(features)
            init = os.fork()
            if init == 0:
                try:
                    out = body()
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


def _probe_view(features: list[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """Build a job's root in init of a new pid namespace and check it."""

    def body() -> dict[str, Any]:
        problems = mounts._build_root(cfg["view"])
        out: dict[str, Any] = {"checks": _view_checks(cfg["checks"])}
        # The two kernel-knob checks are reported, not required: a root of its own is still far
        # better than the host's tree where they fail.
        out["ok"] = all(
            v for k, v in out["checks"].items() if k not in ("proc_sys_readonly", "no_nested_user_namespace")
        )
        if problems:
            out["problems"] = problems
        if not out["ok"]:
            failed = [k for k, v in out["checks"].items() if not v]
            out["error"] = "the root view did not hold: " + ", ".join(failed)
        return out

    return _in_probe_init(features, body)


def _probe_late(features: list[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """A worker in a late root (as a blank worker), then a read-only bind added by init: does
    the worker see it, read-only, and nothing of init's host tree?"""

    def body() -> dict[str, Any]:
        mounts._build_root(cfg["view"], late=True)
        entered_r, entered_w = os.pipe()
        added_r, added_w = os.pipe()
        report_r, report_w = os.pipe()
        worker = os.fork()
        if worker == 0:
            for fd in (entered_r, added_w, report_r):
                os.close(fd)
            mounts._enter_late_root(cfg["view"]["cwd"])
            os.close(entered_w)
            os.read(added_r, 1)
            target = cfg["late"]["path"] + "/file"
            checks = {
                "added": os.path.isfile(target) and open(target).read() == "ok",
                "added_is_readonly": not writes(target),
                "host_tree_gone": not any(os.path.lexists(p) for p in (mounts._OLD, mounts._STAGE)),
            }
            os.write(report_w, json.dumps({"ok": all(checks.values()), "checks": checks}).encode())
            os._exit(0)
        for fd in (entered_w, added_r, report_w):
            os.close(fd)
        os.read(entered_r, 1)
        mounts._apply_late(
            [{"op": "bind", "path": cfg["late"]["path"], "src": cfg["late"]["src"], "mode": "ro", "optional": False}]
        )
        os.close(added_w)
        os.waitpid(worker, 0)
        return _probe_outcome(report_r, None)

    return _in_probe_init(features, body)


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
