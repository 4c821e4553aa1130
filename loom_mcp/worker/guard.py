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

Standard library only: imported by workers before torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, cast

# Check name -> what it means, for reports.
CHECKS: dict[str, str] = {
    "guard.frame_introspection": "reached for a Python frame (the way to another module's "
    "globals and locals)",
    "guard.ctypes": "used ctypes, which reads and writes any memory of the process",
    "guard.proc_mem": "opened the process's memory file (or a path the guard could not check)",
    "guard.dynamic_code": "compiled or executed code at run time, hidden from the static checks",
    "guard.tracing": "installed a trace, profile or monitoring hook, which sees every frame",
    "guard.gc_introspection": "searched the heap with gc, the way to objects it was not given",
    "guard.audit_hook": "tried to add an audit hook",
    "guard.monkeypatch": "replaced a function's code or an object's class",
    "guard.process": "started a process (os.system, subprocess, exec, fork)",
    "guard.harness_import": "imported loom_mcp, the harness's own package",
    "guard.harness_tamper": "rebound a global of the harness",
    "guard.internal": "made an event the worker's audit hook failed to judge",
}

FRAME_EVENTS = frozenset({"sys._getframe", "sys._current_frames", "sys._current_exceptions"})
FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
CTYPES_EVENTS = frozenset({
    "ctypes.addressof", "ctypes.call_function", "ctypes.cdata", "ctypes.cdata/buffer",
    "ctypes.create_string_buffer", "ctypes.create_unicode_buffer", "ctypes.dlopen",
    "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.get_errno", "ctypes.set_errno",
    "ctypes.get_last_error", "ctypes.set_last_error", "ctypes.set_exception",
    "ctypes.string_at", "ctypes.wstring_at", "ctypes.PyObj_FromPtr", "ctypes.seh_exception",
})
CTYPES_MODULES = frozenset({"ctypes", "_ctypes", "cffi", "_cffi_backend"})
DYNAMIC_EVENTS = frozenset({"compile", "exec", "marshal.loads", "marshal.load", "code.__new__",
                            "function.__new__"})
TRACING_EVENTS = frozenset({"sys.settrace", "sys.setprofile", "sys.monitoring.register_callback",
                            "sys._settraceallthreads", "sys._setprofileallthreads"})
GC_EVENTS = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"})
SETATTR_EVENTS = frozenset({"object.__setattr__", "object.__delattr__"})
PROCESS_EVENTS = frozenset({"os.system", "subprocess.Popen", "os.exec", "os.posix_spawn",
                            "os.spawn", "os.fork", "os.forkpty", "pty.spawn"})
LINK_EVENTS = frozenset({"os.symlink", "os.link"})
WATCHED = (FRAME_EVENTS | CTYPES_EVENTS | DYNAMIC_EVENTS | TRACING_EVENTS | GC_EVENTS
           | SETATTR_EVENTS | PROCESS_EVENTS | LINK_EVENTS
           | {"object.__getattr__", "open", "import", "sys.addaudithook"})
MEM_FILES = frozenset({"mem", "kmem", "port"})
PATCH_ATTRS = frozenset({"__code__", "__class__", "__bases__"})
# Standard-library modules that set __bases__ or __class__ on classes they build for the caller.
CLASS_BUILDERS = frozenset({"typing.py", "enum.py", "dataclasses.py"})

# Standard-library modules (path relative to the stdlib directory) that use frames or generate
# code on their caller's behalf and never hand a frame back.
FRAME_CONSUMERS = frozenset({"warnings.py", "typing.py", "enum.py", "dataclasses.py"})
FRAME_CONSUMER_FUNCTIONS = frozenset({("logging/__init__.py", "findCaller"),
                                      ("collections/__init__.py", "namedtuple")})
CODE_GENERATORS = frozenset({"dataclasses.py", "collections/__init__.py", "typing.py"})
IMPORTLIB = frozenset({"<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>",
                       "importlib/_bootstrap.py", "importlib/_bootstrap_external.py",
                       "<frozen importlib.util>", "<frozen importlib.machinery>",
                       "importlib/__init__.py", "importlib/util.py", "importlib/machinery.py"})
STDERR_PREFIX = "loom-guard: "

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


def install(candidate_paths: Iterable[str | os.PathLike], *,
            watch: Iterable[ModuleType | str] = (), echo: bool = True,
            max_records: int = 200) -> Guard:
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
    hook, read, own = _build(candidate_paths, watch, echo, max_records)
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
        out[check] = {"check": check, "severity": severity, "message": message[:500],
                      "where": where if isinstance(where, str) else None, "repeats": count - 1}

    # A list from a worker's reply, which candidate code can forge: anything else counts as none.
    for v in violations if isinstance(violations, list) else []:
        if isinstance(v, dict) and isinstance(v.get("check"), str):
            count = (cast(int, v.get("count"))
                     if isinstance(v.get("count"), int) and v["count"] > 0 else 1)
            add(v["check"], str(v.get("severity", "error")), str(v.get("message") or v["check"]),
                v.get("where"), count)
    for line in stderr.splitlines():
        if line.startswith(STDERR_PREFIX):
            words = line[len(STDERR_PREFIX):].split(" ", 1)
            if words and words[0] not in out:
                add(words[0], "error",
                    f"{CHECKS.get(words[0], words[0])}: {words[1] if len(words) > 1 else ''}"
                    "; reported by the worker's guard", None, 1)
    result = []
    for f in out.values():
        repeats = f.pop("repeats")
        if repeats > 0:
            f["message"] += f" (and {repeats} more time{'s' if repeats > 1 else ''})"
        result.append(f)
    return result


def _real(path: str) -> str:
    try:
        return os.path.realpath(path)
    except (OSError, ValueError):
        return path


def _lexical(path: str) -> str:
    """An absolute path with '.', '..' and repeated slashes folded, by text alone."""
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    return "/" + "/".join(parts)


def _roots() -> tuple[list[str], list[str]]:
    """(standard-library directories, installed-package directories), each as written and as
    resolved."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    packages = {paths.get("purelib"), paths.get("platlib")}
    try:
        packages.update(site.getsitepackages())
    except AttributeError:  # an old virtualenv's site module
        pass
    packages.add(getattr(site, "getusersitepackages", lambda: None)())
    packages.add(str(Path(__file__).resolve().parents[1]))  # loom_mcp itself
    stdlib = {paths.get("stdlib"), paths.get("platstdlib")}

    def forms(roots) -> list[str]:
        return sorted({_lexical(f) for r in roots if r for f in (os.path.abspath(r), _real(r))})

    return forms(stdlib), forms(packages)


def _cache_roots() -> list[str]:
    """Where compilers write the modules they generate (never the candidate's own files)."""
    import getpass
    import tempfile

    roots = [os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR",
                                          "TORCHINDUCTOR_CACHE_DIR")]
    home = os.path.expanduser("~")
    roots += [os.path.join(home, ".triton"), os.path.join(home, ".cache")]
    try:
        user = getpass.getuser()
    except Exception:
        user = ""
    roots.append(os.path.join(tempfile.gettempdir(), f"torchinductor_{user}"))
    return sorted({_lexical(f) for r in roots if r for f in (os.path.abspath(r), _real(r))})


def _build(candidate_paths, watch, echo: bool, max_records: int):  # noqa: C901 - one closure
    """The hook and its readers.

    Everything the hook uses is bound here, in closure cells: module globals, builtins and
    classes can be rebound by candidate code (through sys.modules), closure cells cannot be
    reached without the function object, which only the interpreter's hook list holds. Only C
    functions are called on paths the candidate chooses (no os.path, whose module globals are
    rebindable), and never a method of an object the hook was handed (strings of str subclasses
    are copied with str.__str__, types compared by identity): no candidate code runs while the
    hook is busy and deaf."""
    import _thread
    import threading

    stdlib_roots, package_roots = _roots()
    cache_roots = _cache_roots()
    cand_files: set[str] = set()
    cand_dirs: set[str] = set()

    def add_candidate(path: str, is_dir: bool) -> None:
        raw = os.path.abspath(os.fspath(path))
        for form in {_lexical(raw), _lexical(_real(raw))}:
            if is_dir:
                cand_dirs.add(form)
            else:
                cand_files.add(form)
                cand_dirs.add(form.rsplit("/", 1)[0] or "/")

    for p in candidate_paths:
        add_candidate(p, False)
    tainted: dict[int, Any] = {}  # id(code) -> code (held, so the id stays its own)
    tainted_names: set[str] = set()
    kinds: dict[str, tuple[str, str]] = {}  # co_filename -> ("C"|"S"|"L", stdlib-relative name)
    busy: set[int] = set()
    records: list[dict[str, Any]] = []
    counts: dict[tuple, dict[str, Any]] = {}
    snapshot = []
    for m in watch:
        module = sys.modules.get(m) if isinstance(m, str) else m
        if module is not None:
            namespace = vars(module)
            snapshot.append((module.__name__, module, namespace, list(namespace.items())))

    try:
        import _signal  # type: ignore[import-not-found]  # CPython's C module; typeshed has no stub

        signals = sorted(_signal.valid_signals())
        getsignal = _signal.getsignal
    except (ImportError, AttributeError):  # no signals on this platform
        signals, getsignal = [], None
    import _imp

    get_frozen = getattr(_imp, "get_frozen_object", lambda name: None)
    get_ident = _thread.get_ident
    get_limit, set_limit = sys.getrecursionlimit, sys.setrecursionlimit
    getframe = sys._getframe
    getcwd = os.getcwd
    modules = sys.modules
    threading_dict = threading.__dict__
    write = os.write
    fs_encoding, fs_errors = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()
    bytes_decode = bytes.decode
    bytes_slice = bytes.__getitem__
    str_str = str.__str__
    code_type = type(_build.__code__)
    function_type = type(_build)
    method_type = type(Guard.__init__.__get__(object()))
    base_new = BaseException.__new__
    set_args = cast(Any, BaseException.args).__set__  # a getset descriptor; typeshed says tuple
    refused_type = type("GuardViolation", (GuardViolation,), {"__module__": __name__})
    lexical = _lexical
    checks = dict(CHECKS)
    frame_consumers, frame_consumer_functions = FRAME_CONSUMERS, FRAME_CONSUMER_FUNCTIONS
    generators, importlib_names, watched = CODE_GENERATORS, IMPORTLIB, WATCHED
    frame_events, frame_attrs = FRAME_EVENTS, FRAME_ATTRS
    ctypes_events, ctypes_modules = CTYPES_EVENTS, CTYPES_MODULES
    dynamic_events, tracing_events = DYNAMIC_EVENTS, TRACING_EVENTS
    gc_events, setattr_events = GC_EVENTS, SETATTR_EVENTS
    process_events, link_events, mem_files = PROCESS_EVENTS, LINK_EVENTS, MEM_FILES
    patch_attrs, class_builders = PATCH_ATTRS, CLASS_BUILDERS
    prefix = STDERR_PREFIX
    missing = object()
    _len, _type, _issubclass, _dict, _id = len, type, issubclass, dict, id
    _getattr, _open, _compile, _any, _slice, _repr = getattr, open, compile, any, slice, repr

    def text(value) -> str | None:
        """An exact str copy of a str (or str subclass) without running its methods."""
        if _type(value) is str:
            return value
        if _issubclass(_type(value), str):
            return str_str(value)
        return None

    def under(path: str, roots) -> bool:
        for r in roots:
            if path == r or path.startswith(r + "/"):
                return True
        return False

    def classify(code) -> tuple[str, str]:
        name = text(code.co_filename) or ""
        if name in tainted_names and tainted.get(_id(code)) is code:
            return ("C", "")
        kind = kinds.get(name)
        if kind is None:
            kind = kinds[name] = kind_of(name)
        return kind

    def kind_of(name: str) -> tuple[str, str]:
        if name.startswith("<frozen "):
            return ("S", name)
        if not name.startswith("/"):
            return ("L", "")  # <string>, <eval_with_key>.3 ...: generated by whoever ran it
        path = lexical(name)
        if path in cand_files:
            return ("C", "")
        if under(path, package_roots):
            return ("L", "")
        for root in stdlib_roots:
            if path.startswith(root + "/"):
                return ("S", path[_len(root) + 1:])
        if under(path, cache_roots):
            return ("L", "")
        if under(path, cand_dirs):
            return ("C", "")
        return ("L", "")

    def taint_code(code) -> None:
        todo = [code]
        while todo:
            c = todo.pop()
            if tainted.get(_id(c)) is c:
                continue
            tainted[_id(c)] = c
            tainted_names.add(text(c.co_filename) or "")
            todo.extend(k for k in c.co_consts if _type(k) is code_type)

    def own_file(name: str) -> None:
        cand_files.add(lexical(name))
        kinds[name] = ("C", "")

    def own(*paths) -> None:
        for p in paths:
            add_candidate(p, os.path.isdir(p))
        kinds.clear()

    def walk():
        """(kind of the first frame outside the stdlib or None, that frame, stdlib frames
        passed as (stdlib name, function name))."""
        f = getframe(2).f_back  # 0: walk, 1: decide, 2: hook; then where the event was raised
        passed = []
        while f is not None:
            code = f.f_code
            kind, std = classify(code)
            if kind != "S":
                return kind, f, passed
            passed.append((std, text(code.co_name) or ""))
            f = f.f_back
        return None, None, passed

    def record(check: str, event: str, detail: str, frame, severity: str = "error") -> dict:
        where = None
        if frame is not None:
            where = f"{(text(frame.f_code.co_filename) or '?').rsplit('/', 1)[-1]}:{frame.f_lineno}"
        key = (check, event, where, detail)
        entry = counts.get(key)
        if entry is not None:
            entry["count"] += 1
            return entry
        how = ("found changed by the worker's guard" if check == "guard.harness_tamper"
               else "refused by the worker's audit hook")
        message = (f"{checks.get(check, check)}: {event}{' ' + detail if detail else ''}"
                   f"{' at ' + where if where else ''}; {how}")
        entry = {"check": check, "severity": severity, "event": event, "detail": detail,
                 "where": where, "message": message, "count": 1}
        counts[key] = entry  # repeats only count, whether or not the entry fits the record
        if _len(records) < max_records:
            records.append(entry)
        if echo:
            try:
                write(2, f"{prefix}{check} {event} {detail} at {where}\n".encode(errors="replace"))
            except OSError:
                pass
        return entry

    def refuse(check: str, event: str, detail: str, frame):
        entry = record(check, event, detail, frame)
        exc: BaseException = base_new(refused_type)
        set_args(exc, (f"loom guard: {entry['message']}",))
        return exc

    def path_text(path) -> str | None:
        """The path as text, without running any code of the caller's: str and bytes (and
        their subclasses, through the base type's C methods); None for anything else, os.PathLike
        included (its __fspath__, even pathlib's, is Python code a candidate can rebind)."""
        if _issubclass(_type(path), bytes):
            return bytes_decode(bytes_slice(path, _slice(0, None)), fs_encoding, fs_errors)
        return text(path)

    def proc_mem(path) -> bool | None:
        """True: the process's memory file; None: a path object the hook will not call into."""
        if _type(path) is int:
            return False  # a file descriptor, already open
        value = path_text(path)
        if value is None:
            return None
        folded = lexical(value)
        if folded.rsplit("/", 1)[-1] not in mem_files:
            return False
        # Relative: to a directory the hook cannot see (dir_fd, a chdir race), so refused too.
        return not value.startswith("/") or folded.startswith(("/proc/", "/dev/"))

    def link_to_proc(args) -> bool:
        """os.symlink/os.link to anything under /proc, or to a memory file."""
        if _len(args) < 2:
            return False
        src, dst = path_text(args[0]), path_text(args[1])
        if src is None or dst is None:
            return True
        if not src.startswith("/"):
            if not dst.startswith("/"):
                dst = getcwd() + "/" + dst
            src = lexical(dst).rsplit("/", 1)[0] + "/" + src
        target = lexical(src)
        return target == "/proc" or target.startswith("/proc/") or proc_mem(target) is True

    def verified(code) -> bool:
        """Module code run for an import the candidate asked for: the installed file's own (or
        the interpreter's own frozen module's)?"""
        try:
            name = text(code.co_filename)
            assert name is not None  # co_filename is a str; a failure returns False as before
            if name.startswith("<frozen ") and name.endswith(">"):
                return get_frozen(name[8:-1]) == code
            with _open(name, "rb") as f:
                source = f.read()
            return _compile(source, name, "exec", dont_inherit=True) == code
        except Exception:
            return False

    def candidate_function(fn) -> bool:
        if _type(fn) is method_type:
            fn = _getattr(fn, "__func__")
        if _type(fn) is not function_type:
            return False
        return classify(_getattr(fn, "__code__"))[0] == "C"

    def decide(event: str, args: tuple):
        """None to allow, or the exception to raise."""
        if event == "object.__getattr__":
            if _len(args) < 2 or text(args[1]) not in frame_attrs:
                return None
            check = "guard.frame_introspection"
        elif event in frame_events:
            check = "guard.frame_introspection"
        elif event in ctypes_events:
            check = "guard.ctypes"
        elif event == "open":
            if not args:
                return None
            bad = proc_mem(args[0])
            if bad:
                return refuse("guard.proc_mem", event, _repr(path_text(args[0])), walk()[1])
            if bad is None:  # an object the hook will not call into: judged by who opens it
                kind, frame, _ = walk()
                if kind == "C":
                    return refuse("guard.proc_mem", event,
                                  "a path given as an object, which the guard will not read "
                                  "(a str or bytes path would be checked)", frame)
            return None
        elif event in link_events:
            if link_to_proc(args):
                return refuse("guard.proc_mem", event, _repr(path_text(args[0])), walk()[1])
            return None
        elif event == "import":
            name = (text(args[0]) if args else None) or ""
            root = name.split(".", 1)[0]
            if root in ctypes_modules:
                check = "guard.ctypes"
            elif root == "loom_mcp":
                check = "guard.harness_import"
            else:
                return None
        elif event in dynamic_events:
            check = "guard.dynamic_code"
        elif event in tracing_events:
            check = "guard.tracing"
        elif event in gc_events:
            check = "guard.gc_introspection"
        elif event in process_events:
            check = "guard.process"
        elif event == "sys.addaudithook":
            check = "guard.audit_hook"
        elif event in setattr_events:
            if _len(args) < 2 or text(args[1]) not in patch_attrs:
                return None  # a class's __name__, __qualname__, __module__, __doc__
            check = "guard.monkeypatch"
        else:
            return None

        kind, frame, passed = walk()
        detail = ""
        if event == "import":
            detail = (text(args[0]) if args else None) or ""
        elif event.startswith("object.") and _len(args) > 1:
            detail = text(args[1]) or ""
        if kind != "C":
            if check == "guard.tracing":
                if (event == "sys.monitoring.register_callback" and args
                        and candidate_function(args[0])):
                    return refuse(check, event, "a candidate callback", None)
                if kind is None:  # all standard library: a thread starting runs threading's hooks
                    hooks = (threading_dict.get("_trace_hook"),
                             threading_dict.get("_profile_hook"))
                    if candidate_function(hooks[0]) or candidate_function(hooks[1]):
                        return refuse(check, event, "threading.settrace/setprofile", None)
            return None

        stds = {std for std, _ in passed}
        if _any(name == "<module>" for _, name in passed):
            # A standard-library module's own body, run by an import: its code, not the
            # candidate's request (the module code itself is checked at its exec).
            return None
        if check == "guard.monkeypatch":
            if stds & class_builders:  # typing.NamedTuple/Generic, enum, dataclasses
                return None
        elif check == "guard.frame_introspection":
            if stds & frame_consumers or _any(p in frame_consumer_functions for p in passed):
                return None
        elif check == "guard.dynamic_code":
            code = args[0] if args and _type(args[0]) is code_type else None
            if stds & importlib_names and event in ("compile", "exec", "marshal.loads"):
                # An import the candidate asked for: module code said to come from the
                # installed packages or the stdlib must be that file's own; anything else
                # becomes the candidate's.
                if event == "exec" and code is not None and classify(code)[0] != "C":
                    name = text(code.co_filename) or ""
                    path = lexical(name) if name.startswith("/") else ""
                    trusted = under(path, package_roots) or under(path, stdlib_roots)
                    if (trusted or name.startswith("<frozen ")) and verified(code):
                        pass
                    elif path and not trusted:
                        own_file(name)
                    else:
                        taint_code(code)
                return None
            if stds & generators and event in ("compile", "exec", "function.__new__"):
                if code is not None:  # namedtuple's or a dataclass's methods: the candidate's
                    taint_code(code)
                return None
            if code is not None:
                detail = text(code.co_filename) or ""
            elif event == "compile" and _len(args) > 1:
                detail = text(args[1]) or ""
        return refuse(check, event, detail, frame)

    def hook(event, args):
        if _type(event) is not str or event not in watched:
            return
        tid = get_ident()
        if tid in busy:  # the hook's own frame walking raises events too
            return
        busy.add(tid)
        try:
            try:
                error = decide(event, args)
            except RecursionError:  # an event raised near the recursion limit: room for the walk
                limit = get_limit()
                set_limit(limit + 500)
                try:
                    error = decide(event, args)
                finally:
                    set_limit(limit)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # fail closed: an event the hook could not judge is refused
            error = refuse("guard.internal", event, _type(exc).__name__, None)
        finally:
            busy.discard(tid)
        if error is not None:
            raise error

    def read() -> list[dict[str, Any]]:
        tid = get_ident()
        busy.add(tid)
        try:
            def once(check: str, event: str, detail: str) -> None:  # however often read
                if (check, event, None, detail) not in counts:
                    record(check, event, detail, None)

            # A signal handler is called with the frame the signal interrupted (a harness
            # frame, most likely), and installing one raises no audit event: found here.
            for sig in signals:
                try:
                    handler = getsignal(sig)
                except (OSError, ValueError):
                    continue
                if candidate_function(handler):
                    once("guard.tracing", "signal.signal", f"a candidate handler for signal {sig}")
            for name, module, current, items in snapshot:
                if modules.get(name) is not module:
                    once("guard.harness_tamper", "sys.modules", f"{name} replaced")
                for key, value in items:
                    if current.get(key, missing) is not value:
                        once("guard.harness_tamper", "global", f"{name}.{key} rebound")
            return [_dict(r) for r in records]
        finally:
            busy.discard(tid)

    return hook, read, own
