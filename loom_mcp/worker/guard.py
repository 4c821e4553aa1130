"""In-process guard for workers that import untrusted candidate code: a PEP 578 audit hook.

Defence in depth, not the defence. The verdicts rest on process isolation, on outputs checked
by a trusted process, and on timing taken outside the candidate's process. Inside that process
a candidate can still try to reach the harness through the interpreter: walk frames to another
module's globals, poke memory with ctypes, read /proc/self/mem, install a tracer, search the
heap with gc. This module installs an audit hook, before the candidate is imported, that refuses
those requests *when they come from candidate code* and records each one, even when the
candidate catches the exception.

Use, in a worker's main function, before the candidate is imported::

    from loom_mcp.worker import guard as guard_module

    violations = guard_module.install(
        [candidate_path], watch=[sys.modules[__name__], guard_module]).violations
    ... import and run the candidate ...
    result["guard"] = violations()   # list of dicts, see Guard

and on the server side, loom_mcp.worker.guard.findings(result["guard"], job.stderr_tail) gives
one finding per check, every one an error. Keep `violations` in a local variable of
the worker's main function, bound right after install: module globals and class attributes are
reachable (and rebindable) from candidate code through sys.modules; a function's locals are not,
short of the frame access this hook refuses.

Who asked: at each watched event the hook walks the Python stack from the point the event was
raised. Frames of the standard library are passed over (so candidate -> traceback -> frame access
counts as the candidate's); the first other frame decides. If it is candidate code (the candidate
files, modules beside them, modules the candidate imported from outside the installed packages,
code generated on its behalf), the request is refused; if it is library code (torch, Triton,
inductor's generated modules, load_inline's build, the harness), it is allowed. torch.compile,
Triton and load_inline use exec, compile, ctypes, threads and frame access all the time, from
their own frames, and are unaffected.

Refused from candidate code (check names are stable; each is an error finding):

  guard.frame_introspection  sys._getframe, sys._current_frames, sys._current_exceptions and the
                             audited frame attributes tb_frame, gi_frame, cr_frame, ag_frame
                             (CPython audits no other way to get a frame; f_back, f_globals and
                             f_locals are not audited, so the first frame is what is refused).
                             Allowed when a standard-library consumer that never hands the frame
                             back asked for it on the candidate's behalf: warnings.warn,
                             logging's findCaller, typing (TypeVar/NamedTuple), enum,
                             collections.namedtuple, dataclasses.
  guard.ctypes               every ctypes.* audit event (dlopen, dlsym, cdata = from_address,
                             addressof, string_at, buffers, PyObj_FromPtr ...) and importing
                             ctypes/_ctypes/cffi (see below for what ctypes does unaudited)
  guard.proc_mem             opening /proc/<pid>/mem (any spelling: the path is normalized and a
                             relative path named 'mem' is refused too), /dev/mem, /dev/kmem,
                             /dev/port, and a symbolic link made to anything under /proc: from
                             any code, the candidate's or not; and any open by candidate code of
                             a path given as an os.PathLike object (the hook runs no method of
                             an object it is handed, and a str or bytes path is checkable)
  guard.dynamic_code         compile, exec/eval, marshal.loads, code.__new__, function.__new__
                             (imports are allowed and checked: module code run for an import the
                             candidate asked for must be the installed file's, else it counts as
                             the candidate's; namedtuple/dataclass code is the candidate's)
  guard.tracing              sys.settrace, sys.setprofile, sys.monitoring.register_callback, a
                             candidate function left in threading.settrace/setprofile, and (found
                             by violations(), not refused: no event covers it) a candidate
                             function installed as a signal handler, which is called with the
                             interrupted frame
  guard.gc_introspection     gc.get_objects, gc.get_referrers, gc.get_referents
  guard.audit_hook           sys.addaudithook (CPython drops the new hook silently)
  guard.monkeypatch          object.__setattr__/__delattr__ events for a function's __code__,
                             an object's __class__, a class's __bases__
  guard.process              os.system, subprocess.Popen, os.exec*, os.posix_spawn, os.spawn*,
                             os.fork (load_inline's compiler runs from torch's frames: allowed)
  guard.harness_import       importing loom_mcp modules (an import of one already loaded raises
                             no event; the record is out of reach of module globals anyway)
  guard.harness_tamper       (not an audit event) a watched module's global rebound or removed,
                             found when violations() compares it with its state at install
  guard.internal             the hook failed on an event; it refuses it (fails closed), so a
                             candidate cannot get past it by making it fail

What it cannot stop, by design of CPython's audit hooks:
* native code: load_inline and Triton kernels run whatever they were compiled from;
* memory reached with no audited call: ctypes.cast(address, POINTER(T))[i] or ctypes.memmove
  once ctypes is loaded (torch loads it, and importing a loaded module raises no event; only
  dlopen/dlsym, from_address, string_at, addressof and buffers are audited), numpy's
  __array_interface__ over an arbitrary address;
* library functions that do the refused thing when handed a callable or a name (the library's
  frame is then the innermost one);
* module globals rebound through sys.modules, which no event covers: guard.harness_tamper finds
  it afterwards for the watched modules;
* a candidate that owns the process can also forge the worker's result.
Hence: defence in depth.

The record is held in closures only (no module global refers to it); every violation is also
written to stderr at once, as a line starting with 'loom-guard:'.

The hook itself is built in loom_mcp.worker.guard_hook; the directories it trusts come from
loom_mcp.worker.guard_paths. Both are part of the guard: watching this module watches them too.

Standard library only: imported by workers before torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from types import ModuleType
from typing import Any, cast

from loom_mcp.worker import guard_hook, guard_paths
from loom_mcp.worker.guard_hook import CHECKS, STDERR_PREFIX

_installed = False


class GuardViolation(RuntimeError):
    """A request refused because candidate code made it. A RuntimeError, so that CPython drops
    a refused sys.addaudithook silently. (The hook raises a private subclass, built without
    running any method a candidate could have replaced.)"""


class Guard:
    """Handle on the installed hook; nothing here can clear or loosen it.

    guard.violations(): every refusal so far, oldest first, plus any watched global rebound since
        install (checked at each call), as dicts {"check", "severity", "event", "detail",
        "where", "message", "count"}; `count` counts repeats of the same (check, event,
        where, detail).
    guard.own(*paths): count more files or directories as the candidate's.

    Both are the closures themselves, stored on the instance: bind them to local variables before
    the candidate is imported (`violations = guard.violations`) and call those. Candidate code can
    rebind attributes of any class it reaches through sys.modules, this one included, but not a
    local variable of the harness (frames are what the hook guards).
    """

    __slots__ = ("violations", "own")

    def __init__(self, violations, own) -> None:
        self.violations = violations
        self.own = own


def install(
    candidate_paths: Iterable[str | os.PathLike],
    *,
    watch: Iterable[ModuleType | str] = (),
    echo: bool = True,
    max_records: int = 200,
) -> Guard:
    """Install the audit hook in this process (once; it cannot be removed) and return its Guard.

    candidate_paths: the candidate's files. Modules in the same directories count as the
        candidate's too, except inside the installed packages or the compile caches.
    watch: modules (or their names) whose globals must not be rebound, e.g. the harness's own
        (sys.modules[__name__]); checked at each Guard.violations() call.
    echo: also write each violation to stderr as it happens, as one line starting with
        STDERR_PREFIX (a second channel, for a server that reads the worker's stderr).
    """
    global _installed
    if _installed:
        raise RuntimeError("the guard is already installed in this process")
    _installed = True  # before the snapshot of watched globals is taken
    watch = list(watch)
    if any(m is sys.modules[__name__] or m == __name__ for m in watch):
        # The guard's code spans these modules too: watching the guard watches all of it.
        watch += [guard_hook, guard_paths]
    hook, read, own = guard_hook.build(candidate_paths, watch, echo, max_records, GuardViolation)
    sys.addaudithook(hook)
    return Guard(read, own)


def findings(violations: Iterable[dict[str, Any]] | None, stderr: str = "") -> list[dict[str, Any]]:
    """Findings {"check", "severity", "message", "where"} for a report: one per check, from a
    worker's violations() and from its stderr lines (the echo), which a candidate cannot take
    back. Server side; trusts nothing in its input but the check names."""
    out: dict[str, dict[str, Any]] = {}

    def add(check: str, severity: str, message: str, where: Any, count: int) -> None:
        if check not in CHECKS:
            return
        if severity not in ("error", "warning"):
            severity = "error"
        if check in out:
            out[check]["repeats"] += count
            return
        out[check] = {
            "check": check,
            "severity": severity,
            "message": message[:500],
            "where": where if isinstance(where, str) else None,
            "repeats": count - 1,
        }

    # A list from a worker's reply, which candidate code can forge: anything else counts as none.
    for v in violations if isinstance(violations, list) else []:
        if isinstance(v, dict) and isinstance(v.get("check"), str):
            count = cast(int, v.get("count")) if isinstance(v.get("count"), int) and v["count"] > 0 else 1
            add(v["check"], str(v.get("severity", "error")), str(v.get("message") or v["check"]), v.get("where"), count)
    for line in stderr.splitlines():
        if line.startswith(STDERR_PREFIX):
            words = line[len(STDERR_PREFIX) :].split(" ", 1)
            if words and words[0] not in out:
                add(
                    words[0],
                    "error",
                    f"{CHECKS.get(words[0], words[0])}: {words[1] if len(words) > 1 else ''}"
                    "; reported by the worker's guard",
                    None,
                    1,
                )
    result = []
    for f in out.values():
        repeats = f.pop("repeats")
        if repeats > 0:
            f["message"] += f" (and {repeats} more time{'s' if repeats > 1 else ''})"
        result.append(f)
    return result
