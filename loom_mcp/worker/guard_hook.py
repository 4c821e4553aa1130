"""The worker's audit hook itself: the events it watches, the check each counts under, and
`build`, which makes the hook and its readers out of closures. loom_mcp.worker.guard installs it
and says what it refuses, from whom, and why.

Standard library only: imported by workers before torch, with the guard.
"""

from __future__ import annotations

import os
import sys
from typing import Any, cast

from loom_mcp.worker.guard_paths import _cache_roots, _lexical, _real, _roots

# Check name -> what it means, for reports.
CHECKS: dict[str, str] = {
    "guard.frame_introspection": "reached for a Python frame (the way to another module's globals and locals)",
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
CTYPES_EVENTS = frozenset(
    {
        "ctypes.addressof",
        "ctypes.call_function",
        "ctypes.cdata",
        "ctypes.cdata/buffer",
        "ctypes.create_string_buffer",
        "ctypes.create_unicode_buffer",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.dlsym/handle",
        "ctypes.get_errno",
        "ctypes.set_errno",
        "ctypes.get_last_error",
        "ctypes.set_last_error",
        "ctypes.set_exception",
        "ctypes.string_at",
        "ctypes.wstring_at",
        "ctypes.PyObj_FromPtr",
        "ctypes.seh_exception",
    }
)
CTYPES_MODULES = frozenset({"ctypes", "_ctypes", "cffi", "_cffi_backend"})
DYNAMIC_EVENTS = frozenset({"compile", "exec", "marshal.loads", "marshal.load", "code.__new__", "function.__new__"})
TRACING_EVENTS = frozenset(
    {
        "sys.settrace",
        "sys.setprofile",
        "sys.monitoring.register_callback",
        "sys._settraceallthreads",
        "sys._setprofileallthreads",
    }
)
GC_EVENTS = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"})
SETATTR_EVENTS = frozenset({"object.__setattr__", "object.__delattr__"})
PROCESS_EVENTS = frozenset(
    {"os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "pty.spawn"}
)
LINK_EVENTS = frozenset({"os.symlink", "os.link"})
WATCHED = (
    FRAME_EVENTS
    | CTYPES_EVENTS
    | DYNAMIC_EVENTS
    | TRACING_EVENTS
    | GC_EVENTS
    | SETATTR_EVENTS
    | PROCESS_EVENTS
    | LINK_EVENTS
    | {"object.__getattr__", "open", "import", "sys.addaudithook"}
)
MEM_FILES = frozenset({"mem", "kmem", "port"})
PATCH_ATTRS = frozenset({"__code__", "__class__", "__bases__"})
# Standard-library modules that set __bases__ or __class__ on classes they build for the caller.
CLASS_BUILDERS = frozenset({"typing.py", "enum.py", "dataclasses.py"})

# Standard-library modules (path relative to the stdlib directory) that use frames or generate
# code on their caller's behalf and never hand a frame back.
FRAME_CONSUMERS = frozenset({"warnings.py", "typing.py", "enum.py", "dataclasses.py"})
FRAME_CONSUMER_FUNCTIONS = frozenset({("logging/__init__.py", "findCaller"), ("collections/__init__.py", "namedtuple")})
CODE_GENERATORS = frozenset({"dataclasses.py", "collections/__init__.py", "typing.py"})
IMPORTLIB = frozenset(
    {
        "<frozen importlib._bootstrap>",
        "<frozen importlib._bootstrap_external>",
        "importlib/_bootstrap.py",
        "importlib/_bootstrap_external.py",
        "<frozen importlib.util>",
        "<frozen importlib.machinery>",
        "importlib/__init__.py",
        "importlib/util.py",
        "importlib/machinery.py",
    }
)
STDERR_PREFIX = "loom-guard: "

# Events refused by their name alone when candidate code raises them; `open`, links, imports,
# attribute access and setattr are judged by their arguments too.
EVENT_CHECKS: dict[str, str] = {
    **dict.fromkeys(FRAME_EVENTS, "guard.frame_introspection"),
    **dict.fromkeys(CTYPES_EVENTS, "guard.ctypes"),
    **dict.fromkeys(DYNAMIC_EVENTS, "guard.dynamic_code"),
    **dict.fromkeys(TRACING_EVENTS, "guard.tracing"),
    **dict.fromkeys(GC_EVENTS, "guard.gc_introspection"),
    **dict.fromkeys(PROCESS_EVENTS, "guard.process"),
    "sys.addaudithook": "guard.audit_hook",
}


def build(
    candidate_paths,
    watch,
    echo: bool,
    max_records: int,  # noqa: C901 - one closure
    refused: type[BaseException],
):
    """The hook and its readers (hook, violations, own). What the hook raises is a private
    subclass of `refused`, in `refused`'s module.

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
    code_type = type(build.__code__)
    function_type = type(build)
    method_type = type(build.__get__(object()))
    base_new = BaseException.__new__
    set_args = cast(Any, BaseException.args).__set__  # a getset descriptor; typeshed says tuple
    refused_type = type("GuardViolation", (refused,), {"__module__": refused.__module__})
    lexical = _lexical
    checks = dict(CHECKS)
    frame_consumers, frame_consumer_functions = FRAME_CONSUMERS, FRAME_CONSUMER_FUNCTIONS
    generators, importlib_names, watched = CODE_GENERATORS, IMPORTLIB, WATCHED
    event_checks, frame_attrs, ctypes_modules = dict(EVENT_CHECKS), FRAME_ATTRS, CTYPES_MODULES
    setattr_events, link_events, mem_files = SETATTR_EVENTS, LINK_EVENTS, MEM_FILES
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
                return ("S", path[_len(root) + 1 :])
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
        how = (
            "found changed by the worker's guard"
            if check == "guard.harness_tamper"
            else "refused by the worker's audit hook"
        )
        message = (
            f"{checks.get(check, check)}: {event}{' ' + detail if detail else ''}"
            f"{' at ' + where if where else ''}; {how}"
        )
        entry = {
            "check": check,
            "severity": severity,
            "event": event,
            "detail": detail,
            "where": where,
            "message": message,
            "count": 1,
        }
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

    def check_by_args(event: str, args: tuple) -> str | None:
        """The check of an event judged by an argument (an attribute's name, a module's), or
        None where that argument makes it harmless."""
        if event == "object.__getattr__":
            return "guard.frame_introspection" if _len(args) > 1 and text(args[1]) in frame_attrs else None
        if event in setattr_events:  # not a class's __name__, __qualname__, __module__, __doc__
            return "guard.monkeypatch" if _len(args) > 1 and text(args[1]) in patch_attrs else None
        if event == "import":
            root = ((text(args[0]) if args else None) or "").split(".", 1)[0]
            if root in ctypes_modules:
                return "guard.ctypes"
            if root == "loom_mcp":
                return "guard.harness_import"
        return None

    def decide(event: str, args: tuple):
        """None to allow, or the exception to raise. Calls walk() itself: walk counts frames."""
        if event == "open":
            if not args:
                return None
            bad = proc_mem(args[0])
            if bad:
                return refuse("guard.proc_mem", event, _repr(path_text(args[0])), walk()[1])
            if bad is None:  # an object the hook will not call into: judged by who opens it
                kind, frame, _ = walk()
                if kind == "C":
                    return refuse(
                        "guard.proc_mem",
                        event,
                        "a path given as an object, which the guard will not read "
                        "(a str or bytes path would be checked)",
                        frame,
                    )
            return None
        if event in link_events:
            if link_to_proc(args):
                return refuse("guard.proc_mem", event, _repr(path_text(args[0])), walk()[1])
            return None
        check = event_checks.get(event) or check_by_args(event, args)
        if check is None:
            return None

        kind, frame, passed = walk()
        detail = ""
        if event == "import":
            detail = (text(args[0]) if args else None) or ""
        elif event.startswith("object.") and _len(args) > 1:
            detail = text(args[1]) or ""
        if kind != "C":
            if check == "guard.tracing":
                if event == "sys.monitoring.register_callback" and args and candidate_function(args[0]):
                    return refuse(check, event, "a candidate callback", None)
                if kind is None:  # all standard library: a thread starting runs threading's hooks
                    hooks = (threading_dict.get("_trace_hook"), threading_dict.get("_profile_hook"))
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
