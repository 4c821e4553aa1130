"""The workers' audit hook (loom_mcp.worker.guard): what candidate code is refused, that the
refusal is recorded even when the candidate swallows it, that library code may do the same
things, and that honest torch, Triton and torch.compile candidates run clean under it.

An audit hook cannot be removed, so every check runs in a fresh interpreter: a driver script
(the stand-in for a worker) installs the guard, imports the candidate written to tmp_path and
prints what happened as JSON. Last, red-team candidates go through MCP run_validation and must
be rejected with the guard's named check.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loom_mcp.worker import guard

REPO = Path(__file__).resolve().parents[1]
REDTEAM = Path(__file__).parent / "redteam"

# The worker's part: install the guard before the candidate is imported, keep the reader in a
# local variable, print the outcome. Candidate code must not reach main()'s locals.
DRIVER = """
import importlib.util, json, sys
sys.path.insert(0, {repo!r})
import ctypes, gc  # loaded before the guard, as torch loads them in a real worker
from loom_mcp.worker import guard as guard_module

WATCHED_HELPER = len


def load(path, name):  # as loom_mcp.worker.harness.load_module: its directory goes on sys.path
    sys.path.insert(0, path.rsplit("/", 1)[0])
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main():
    paths = sys.argv[1:]
    violations = guard_module.install(paths, watch=[sys.modules[__name__]]).violations
    outcome = {{}}
{body}
    print(json.dumps({{"outcome": outcome, "violations": violations()}}, default=str))


main()
"""


def run_driver(tmp_path: Path, body: str, candidates: dict[str, str], *, files: dict[str, str] | None = None,
               env: dict[str, str] | None = None, timeout: float = 120) -> tuple[dict, str]:
    """Write the candidate files (under tmp_path/cand) and any other files, run the driver in a
    fresh interpreter; (its JSON, its stderr)."""
    for rel, source in {**{f"cand/{k}": v for k, v in candidates.items()}, **(files or {})}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(repo=str(REPO), body=textwrap.indent(textwrap.dedent(body), "    ")))
    proc = subprocess.run(
        [sys.executable, str(driver), *(str(tmp_path / "cand" / k) for k in candidates)],
        capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def by_check(violations: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for v in violations:
        out.setdefault(v["check"], []).append(v)
    return out


# ---------------------------------------------------------------- attacks from candidate code

ATTACKS = """
import os, pathlib, sys, threading

OUT = {}
LINK = os.path.join(os.path.dirname(__file__), "link")


def attempt(name, fn):
    try:
        fn()
        OUT[name] = "allowed"
    except RuntimeError as exc:  # the refusal, swallowed as a cheat would
        OUT[name] = "refused" if "loom guard" in str(exc) else f"error: {exc}"
    except Exception as exc:
        OUT[name] = f"error: {type(exc).__name__}: {exc}"


def traceback_frame():
    # The attack that got through: raise, catch, take the traceback's frame, walk out.
    try:
        raise LookupError("probe")
    except LookupError as caught:
        frame = getattr(getattr(caught, "__trace" + "back__"), "".join(["tb_", "frame"]))
    getattr(frame, "f_" + "back").f_globals["WATCHED_HELPER"] = None


def relative_mem():
    here = os.getcwd()
    os.chdir("/proc/self")
    try:
        open("mem", "rb")
    finally:
        os.chdir(here)


class Other:
    pass


def thread_with_tracer():
    threading.settrace(lambda *a: None)
    try:
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
    finally:
        threading.settrace(None)


ctypes = sys.modules["ctypes"]
gc = sys.modules["gc"]
ATTACKS = {
    "guard.frame_introspection": {
        "traceback frame": traceback_frame,
        "sys._getframe": lambda: sys._getframe(1),
        "sys._current_frames": lambda: sys._current_frames(),
        "generator frame": lambda: (x for x in ()).gi_frame,
        "inspect.currentframe": lambda: __import__("inspect").currentframe(),
        "traceback.walk_stack": lambda: list(__import__("traceback").walk_stack(None)),
    },
    "guard.ctypes": {
        "string_at": lambda: ctypes.string_at(id(OUT), 8),
        "from_address": lambda: ctypes.c_ssize_t.from_address(id(OUT)),
        "dlopen": lambda: ctypes.CDLL(None),
        "pythonapi": lambda: ctypes.pythonapi.PyFrame_GetBack,
    },
    "guard.proc_mem": {
        "open": lambda: open("/proc/self/mem", "rb"),
        "os.open through root": lambda: os.open("/proc/self/root/proc/./self//mem", os.O_RDONLY),
        "pathlib": lambda: pathlib.Path("/proc/self/mem").open("rb"),
        "relative": relative_mem,
        "symlink": lambda: os.symlink("/proc/self/mem", LINK),
        "symlink to /proc": lambda: os.symlink("/proc/self", LINK),
    },
    "guard.dynamic_code": {
        "exec": lambda: exec("x = 1"),
        "eval": lambda: eval("1 + 1"),
        "compile": lambda: compile("1", "<s>", "eval"),
        "code.replace": lambda: attempt.__code__.replace(co_filename="/usr/lib/python3/x.py"),
        "FunctionType": lambda: type(attempt)(attempt.__code__, {}),
        "marshal.loads": lambda: __import__("marshal").loads(__import__("marshal").dumps(1)),
    },
    "guard.tracing": {
        "settrace": lambda: sys.settrace(lambda *a: None),
        "setprofile": lambda: sys.setprofile(lambda *a: None),
    },
    "guard.gc_introspection": {
        "get_referrers": lambda: gc.get_referrers(attempt),
        "get_referents": lambda: gc.get_referents(attempt),
        "get_objects": lambda: gc.get_objects(),
    },
    "guard.monkeypatch": {
        "__code__": lambda: setattr(relative_mem, "__code__", traceback_frame.__code__),
        "__class__": lambda: setattr(Other(), "__class__", type("Sub", (Other,), {})),
    },
    "guard.process": {
        "os.system": lambda: os.system("true"),
        "subprocess": lambda: __import__("subprocess").run(["true"]),
    },
    "guard.harness_import": {
        "loom_mcp.server": lambda: __import__("loom_mcp.server"),
    },
}
if hasattr(sys, "monitoring"):  # Python 3.12+
    ATTACKS["guard.tracing"]["sys.monitoring"] = lambda: sys.monitoring.register_callback(
        0, sys.monitoring.events.PY_START, lambda *a: None)


def run():
    for check, attacks in ATTACKS.items():
        for name, fn in attacks.items():
            attempt(f"{check}: {name}", fn)
    added = []
    attempt("guard.audit_hook: addaudithook", lambda: sys.addaudithook(lambda *a: added.append(a)))
    OUT["hook added"] = bool(added) or None
    sys.audit("loom.test")
    OUT["hook added"] = bool(added)
    attempt("guard.tracing: threading.settrace", thread_with_tracer)
    return OUT
"""


@pytest.fixture(scope="module")
def attacked(tmp_path_factory) -> tuple[dict, str]:
    tmp = tmp_path_factory.mktemp("attacks")
    return run_driver(tmp, "outcome.update(load(paths[0], 'cand').run())", {"cand.py": ATTACKS})


def test_every_attack_is_refused_even_when_swallowed(attacked):
    (result, _) = attacked
    outcome = result["outcome"]
    special = {"guard.audit_hook: addaudithook", "guard.tracing: threading.settrace", "hook added"}
    not_refused = {k: v for k, v in outcome.items() if k not in special and v != "refused"}
    assert not_refused == {}
    assert outcome["hook added"] is False  # CPython dropped the candidate's hook


def test_every_refusal_is_recorded_with_its_check_and_line(attacked):
    (result, _) = attacked
    checks = by_check(result["violations"])
    expected = {k.split(":")[0] for k in result["outcome"] if k.startswith("guard.")}
    assert expected <= set(checks), expected - set(checks)
    assert "guard.internal" not in checks
    for check, found in checks.items():
        if check in ("guard.tracing", "guard.harness_tamper"):
            continue  # a thread's tracer is refused in the thread, where no candidate frame is
        assert all(v["where"] and v["where"].startswith("cand.py:") for v in found), found
        assert all(v["severity"] == "error" and v["message"] for v in found)
    # One record per (check, event, place), however often it happens.
    keys = [(v["check"], v["event"], v["where"]) for v in result["violations"]]
    assert len(keys) == len(set(keys))


def test_the_traceback_attack_is_refused_at_the_first_frame(attacked):
    (result, _) = attacked
    tb = [v for v in result["violations"] if v["event"] == "object.__getattr__"]
    assert {v["detail"] for v in tb} >= {"tb_frame", "gi_frame"}


def test_a_tracer_left_for_the_next_thread_is_refused_there(attacked):
    (result, _) = attacked
    tracing = by_check(result["violations"])["guard.tracing"]
    assert any(v["detail"] == "threading.settrace/setprofile" for v in tracing)


def test_each_refusal_is_also_written_to_stderr_at_once(attacked):
    (result, stderr) = attacked
    lines = [line for line in stderr.splitlines() if line.startswith(guard.STDERR_PREFIX)]
    assert {line.split()[1] for line in lines} == {v["check"] for v in result["violations"]}
    # The server reads either channel: stderr alone gives the same checks.
    from_stderr = {f["check"] for f in guard.findings(None, stderr)}
    assert from_stderr == {f["check"] for f in guard.findings(result["violations"])}


# ---------------------------------------------------------------- the same from library code

LIBRARY = """
import ctypes, gc, os, subprocess, sys, traceback


def everything():
    try:
        raise LookupError
    except LookupError as caught:
        frame = caught.__traceback__.tb_frame.f_back
    sys._getframe(1)
    sys._current_frames()
    list(traceback.walk_stack(None))
    ctypes.string_at(id(frame), 8)
    ctypes.c_ssize_t.from_address(id(frame))
    ctypes.CDLL(None).getpid()
    exec("x = 1", {})
    eval(compile("1 + 1", "<generated>", "eval"))
    gc.get_referrers(everything)
    gc.get_objects()
    old = sys.gettrace()
    sys.settrace(None)
    sys.settrace(old)
    subprocess.run(["true"], check=True)
    return "ok"


def proc_mem():
    try:
        open("/proc/self/mem", "rb")
    except RuntimeError as exc:
        return "refused" if "loom guard" in str(exc) else str(exc)
    return "allowed"
"""


def test_library_code_may_do_the_same_even_when_the_candidate_calls_it(tmp_path):
    # The library is imported by the harness (as torch is): a module the candidate itself
    # imports from outside the installed packages would count as the candidate's.
    candidate = """
    import libmod

    def run():
        return {"from candidate": libmod.everything(), "proc_mem": libmod.proc_mem()}
    """
    body = """
    sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0] + "/lib")
    import libmod
    outcome.update(load(paths[0], "cand").run())
    outcome["from harness"] = libmod.everything()
    """
    result, _ = run_driver(tmp_path, body, {"cand.py": candidate}, files={"lib/libmod.py": LIBRARY})
    assert result["outcome"] == {"from candidate": "ok", "from harness": "ok", "proc_mem": "refused"}
    # /proc/self/mem is refused whoever opens it; nothing else was.
    assert {v["check"] for v in result["violations"]} == {"guard.proc_mem"}


# ---------------------------------------------------------------- honest standard-library use

HONEST_STDLIB = """
from __future__ import annotations

import collections, dataclasses, enum, logging, sys, typing, warnings
from typing import NamedTuple

import helper  # a module beside the candidate


class Config(NamedTuple):
    block: int
    warps: int = 4


@dataclasses.dataclass
class Options:
    scale: float = 1.0
    names: list = dataclasses.field(default_factory=list)


class Mode(enum.Enum):
    FAST = 1


T = typing.TypeVar("T")


def run():
    warnings.warn("a warning from the candidate")
    logging.getLogger("candidate").warning("a log line from the candidate")
    Pair = collections.namedtuple("Pair", "a b")
    Kind = enum.Enum("Kind", "A B")
    hints = typing.get_type_hints(Config)
    import fractions  # a standard-library module not loaded yet
    import __hello__  # a frozen one (in 3.11+ builds)
    return {"config": Config(8)._asdict(), "options": dataclasses.asdict(Options()),
            "pair": Pair(1, 2)._asdict(), "kind": Kind.A.name, "hints": sorted(hints),
            "helper": helper.twice(2), "fraction": str(fractions.Fraction(1, 3)),
            "mode": Mode.FAST.value}
"""


def test_honest_standard_library_use_is_not_refused(tmp_path):
    result, _ = run_driver(tmp_path, "outcome.update(load(paths[0], 'cand').run())",
                           {"cand.py": HONEST_STDLIB, "helper.py": "def twice(x):\n    return 2 * x\n"})
    assert result["violations"] == []
    assert result["outcome"]["config"] == {"block": 8, "warps": 4}
    assert result["outcome"]["helper"] == 4 and result["outcome"]["fraction"] == "1/3"


# ---------------------------------------------------------------- code made for the candidate

def test_code_generated_or_imported_for_the_candidate_is_the_candidates(tmp_path):
    candidate = """
    import importlib.machinery, importlib.util, json, sys, typing

    OUT = {}


    def attempt(name, fn):
        try:
            fn()
            OUT[name] = "allowed"
        except RuntimeError as exc:
            OUT[name] = "refused" if "loom guard" in str(exc) else str(exc)


    class Annotated:
        frame: "sys._getframe(0)"  # evaluated by typing, on the candidate's behalf


    class Forged(importlib.machinery.SourceFileLoader):
        # Module code compiled under the name of an installed file.
        def get_code(self, fullname):
            source = b"import sys\\ndef grab():\\n    return sys._getframe(0)\\n"
            return self.source_to_code(source, json.__file__)


    def forged():
        spec = importlib.util.spec_from_loader("forged", Forged("forged", json.__file__))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.grab()


    def elsewhere():
        sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0] + "/elsewhere")
        import planted  # written outside the candidate's directory, imported by it
        return planted.grab()


    def run():
        attempt("annotation", lambda: typing.get_type_hints(Annotated, globalns={"sys": sys}))
        attempt("forged loader", forged)
        attempt("planted module", elsewhere)
        return OUT
    """
    planted = "import sys\n\n\ndef grab():\n    return sys._getframe(0)\n"
    result, _ = run_driver(tmp_path, "outcome.update(load(paths[0], 'cand').run())",
                           {"cand.py": candidate}, files={"elsewhere/planted.py": planted})
    assert result["outcome"] == {"annotation": "refused", "forged loader": "refused",
                                 "planted module": "refused"}
    # Where: the annotation's generated code, the forged module (named as json's __init__.py),
    # the planted module.
    wheres = {v["where"] for v in result["violations"]}
    assert wheres == {"<string>:1", "__init__.py:3", "planted.py:5"}


# ---------------------------------------------------------------- the record is out of reach

def test_the_record_survives_a_candidate_that_reaches_the_guard_module(tmp_path):
    candidate = """
    import sys

    g = sys.modules["loom_mcp.worker.guard"]
    g._installed = False
    second = g.install([])  # another hook: it can only refuse more
    g.Guard.violations = property(lambda self: (lambda: []))
    g.findings = lambda *a, **k: []
    g.WATCHED = frozenset()
    g.FRAME_EVENTS = frozenset()
    sys.modules["__main__"].WATCHED_HELPER = max  # a watched global of the harness


    def run():
        try:
            sys._getframe(0)
            return {"after tampering": "allowed"}
        except RuntimeError:
            return {"after tampering": "refused", "second": second.violations() != []}
    """
    result, _ = run_driver(tmp_path, "outcome.update(load(paths[0], 'cand').run())",
                           {"cand.py": candidate})
    assert result["outcome"] == {"after tampering": "refused", "second": False}
    checks = by_check(result["violations"])
    assert set(checks) == {"guard.frame_introspection", "guard.harness_tamper"}
    assert checks["guard.harness_tamper"][0]["detail"] == "__main__.WATCHED_HELPER rebound"


def test_a_candidate_signal_handler_is_found(tmp_path):
    # Called with whatever frame the signal interrupts, and installed without an audit event.
    candidate = """
    import sys

    def handler(signum, frame):
        frame.f_globals["WATCHED_HELPER"] = None

    sig = sys.modules["signal"]
    sig.signal(sig.SIGUSR1, handler)
    """
    body = """
    import signal
    load(paths[0], "cand")
    """
    result, _ = run_driver(tmp_path, body, {"cand.py": candidate})
    assert [(v["check"], v["event"], v["detail"]) for v in result["violations"]] == [
        ("guard.tracing", "signal.signal", f"a candidate handler for signal {int(signal.SIGUSR1)}")]


def test_an_event_at_the_recursion_limit_is_still_refused(tmp_path):
    # Near the limit the hook's own calls overflow; it must fail closed, never allow.
    candidate = """
    import sys


    def deep(n):
        if n:
            return deep(n - 1)
        try:
            sys._getframe(1)
            return "frame"
        except RecursionError:
            return "recursion error"
        except RuntimeError:
            return "refused"


    def run():
        seen = set()
        limit = sys.getrecursionlimit()
        for depth in range(limit - 1, limit - 80, -1):
            try:
                seen.add(deep(depth))
            except RecursionError:
                seen.add("recursion error")
        return {"seen": sorted(seen)}
    """
    result, _ = run_driver(tmp_path, "outcome.update(load(paths[0], 'cand').run())",
                           {"cand.py": candidate})
    assert "frame" not in result["outcome"]["seen"] and "refused" in result["outcome"]["seen"]
    assert {v["check"] for v in result["violations"]} <= {"guard.frame_introspection",
                                                          "guard.internal"}


def test_install_is_once_per_process(tmp_path):
    body = """
    try:
        guard_module.install(paths)
        outcome["second"] = "installed"
    except RuntimeError as exc:
        outcome["second"] = str(exc)
    """
    result, _ = run_driver(tmp_path, body, {"cand.py": "x = 1\n"})
    assert result["outcome"]["second"] == "the guard is already installed in this process"


@pytest.mark.parametrize("watched", ["guard_module", "'loom_mcp.worker.guard'"])
def test_watching_the_guard_watches_the_modules_its_hook_is_built_from(tmp_path, watched):
    # The hook's code lives in guard_hook and guard_paths: rebinding their globals is tampering too.
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(REPO)!r})
        from loom_mcp.worker import guard as guard_module
        violations = guard_module.install([], watch=[{watched}]).violations
        sys.modules["loom_mcp.worker.guard_paths"]._lexical = str
        sys.modules["loom_mcp.worker.guard_hook"].EVENT_CHECKS = {{}}
        print(json.dumps(violations()))
    """))
    proc = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    details = {v["detail"] for v in json.loads(proc.stdout) if v["check"] == "guard.harness_tamper"}
    assert details == {"loom_mcp.worker.guard_paths._lexical rebound",
                       "loom_mcp.worker.guard_hook.EVENT_CHECKS rebound"}


def test_findings_summarise_one_per_check():
    violations = [
        {"check": "guard.ctypes", "severity": "error", "message": "used ctypes", "where": "c.py:3",
         "count": 2},
        {"check": "guard.ctypes", "severity": "error", "message": "again", "where": "c.py:9",
         "count": 1},
        {"check": "not.a.guard.check", "severity": "error", "message": "forged", "count": 1},
    ]
    out = guard.findings(violations, "noise\nloom-guard: guard.tracing sys.settrace  at c.py:4\n")
    assert [(f["check"], f["severity"], f["where"]) for f in out] == [
        ("guard.ctypes", "error", "c.py:3"), ("guard.tracing", "error", None)]
    assert out[0]["message"] == "used ctypes (and 2 more times)"


# ---------------------------------------------------------------- honest candidates run clean

pytest.importorskip("torch")
pytest.importorskip("triton")

HONEST_RUN = """
import torch
sys.path.insert(0, {repo!r})
from loom_mcp.worker.harness import build_model, load_module, make_case, task_shapes
import tests.test_kernels as kernels

cases = [  # (task file, candidate file, shapes)
    ("tests/redteam/task_rmsnorm.py", "tests/redteam/honest_torch.py", None),
    ("tests/redteam/task_rmsnorm.py", "tests/redteam/honest_triton.py", None),
    ("loom_mcp/demo_data/task.py", "loom_mcp/demo_data/candidate.py", "small"),
] + [(f"kernels/{{c.name}}/task.py", f"kernels/{{c.name}}/candidate.py", c.name)
     for c in kernels.TASKS if c.name in {kernel_names!r}]
for task_file, cand_file, shapes in cases:
    task = load_module({repo!r} + "/" + task_file, "task_" + cand_file.replace("/", "_"))
    cand = load_module({repo!r} + "/" + cand_file, "cand_" + cand_file.replace("/", "_"))
    if shapes in kernels.TASK_BY_NAME:
        case = kernels.TASK_BY_NAME[shapes]
        outcome[cand_file] = kernels.judge(task, cand, case.small_shapes, seeds=range(1)).passed
        continue
    plan = task_shapes(task)
    if shapes == "small":
        plan = [{{"name": "small", "tokens": 3, "hidden": 40}}]
    ok = True
    for shape in plan:
        inputs, init = make_case(task, shape, 0, "normal")
        model = build_model(cand.ModelNew, {{"inputs": inputs, "init_inputs": init, "seed": 0}},
                            torch.device("cpu"))
        ref = task.Model(*init)
        if list(ref.state_dict()) == list(model.state_dict()):
            ref.load_state_dict(model.state_dict())
        with torch.no_grad():
            ok = ok and torch.allclose(model(*inputs), ref(*inputs), atol=1e-4, rtol=1e-4)
    outcome[cand_file] = bool(ok)
"""

HONEST_FILES = [
    "tests/redteam/honest_torch.py", "tests/redteam/honest_triton.py",
    "loom_mcp/demo_data/candidate.py",
    *(f"kernels/{name}/candidate.py" for name in ("rmsnorm", "silu_mul", "softmax", "rope",
                                                  "q4k_gemm", "q4k_gemv")),
]


def run_honest(tmp_path: Path, kernel_names: list[str]) -> dict:
    files = [f for f in HONEST_FILES if not f.startswith("kernels/")
             or f.split("/")[1] in kernel_names]
    driver = tmp_path / "driver.py"
    body = HONEST_RUN.format(repo=str(REPO), kernel_names=kernel_names)
    driver.write_text(DRIVER.format(repo=str(REPO), body=textwrap.indent(textwrap.dedent(body), "    ")))
    proc = subprocess.run(
        [sys.executable, str(driver), *(str(REPO / f) for f in files)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_honest_torch_and_triton_candidates_run_clean(tmp_path):
    result = run_honest(tmp_path, ["rmsnorm", "silu_mul", "softmax", "rope", "q4k_gemm"])
    assert result["violations"] == []
    assert all(result["outcome"].values()) and len(result["outcome"]) == 8, result["outcome"]


@pytest.mark.slow
def test_honest_q4k_gemv_runs_clean(tmp_path):
    result = run_honest(tmp_path, ["q4k_gemv"])
    assert result["violations"] == [] and all(result["outcome"].values()), result


@pytest.mark.slow
def test_honest_torch_compile_candidate_runs_clean(tmp_path):
    """dynamo + inductor on CPU: exec, compile, generated modules, a C++ compiler, ctypes."""
    body = f"""
    import torch
    sys.path.insert(0, {str(REPO)!r})
    from loom_mcp.worker.harness import build_model, load_module, make_case, task_shapes
    task = load_module({str(REDTEAM / "task_rmsnorm.py")!r}, "task")
    cand = load_module(paths[0], "cand")
    for shape in task_shapes(task):
        inputs, init = make_case(task, shape, 0, "normal")
        model = build_model(cand.ModelNew, {{"inputs": inputs, "init_inputs": init, "seed": 0}},
                            torch.device("cpu"))
        ref = task.Model(*init)
        ref.load_state_dict(model.state_dict())
        with torch.no_grad():
            outcome[shape["name"]] = bool(torch.allclose(model(*inputs), ref(*inputs), atol=1e-5))
    """
    source = (REPO / "tests" / "candidates" / "honest_torch_compile.py").read_text()
    result, _ = run_driver(tmp_path, body, {"honest_torch_compile.py": source}, timeout=900,
                           env={"TRITON_INTERPRET": "1",
                                "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert result["violations"] == []
    assert result["outcome"] == {"rows8_d64": True, "rows5_d37": True}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="needs a C++ compiler")
def test_honest_load_inline_candidate_runs_clean(tmp_path):
    """load_inline runs ninja and the compiler in subprocesses and imports the built module:
    from torch's frames, so allowed."""
    candidate = '''
    import torch
    from torch.utils.cpp_extension import load_inline

    source = """
    torch::Tensor twice(torch::Tensor x) { return x * 2; }
    """
    ext = load_inline(name="loom_guard_twice", cpp_sources=source, functions=["twice"])


    class ModelNew(torch.nn.Module):
        def forward(self, x):
            return ext.twice(x)
    '''
    body = """
    import torch
    cand = load(paths[0], "cand")
    outcome["ok"] = bool(torch.equal(cand.ModelNew()(torch.ones(3)), torch.full((3,), 2.0)))
    """
    result, _ = run_driver(tmp_path, body, {"cand.py": candidate}, timeout=900,
                           env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    assert result == {"outcome": {"ok": True}, "violations": []}


# ---------------------------------------------------------------- through MCP run_validation

# red-team candidate -> the guard check that must reject it (each computes the right answer)
GUARD_CHEATS = {
    "cheat_frame_walk.py": "guard.frame_introspection",
    "cheat_ctypes_poke.py": "guard.ctypes",
    "cheat_settrace.py": "guard.tracing",
    "cheat_gc_referrers.py": "guard.gc_introspection",
    "cheat_sys_modules.py": "guard.harness_tamper",
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("guard-redteam")
    shutil.copytree(REDTEAM, root / "redteam")
    shutil.copy(REPO / "tests" / "candidates" / "honest_torch_compile.py", root / "redteam")
    return root


@pytest.fixture(scope="module")
def server(workspace):
    from loom_mcp.config import load_config
    from loom_mcp.server import build_server

    home = workspace / "home"
    return build_server(load_config(home, environ={"LOOM_ALLOWED_ROOTS": str(workspace)}))


async def validate(server, workspace: Path, candidate: str) -> dict:
    from mcp import Client

    async with Client(server) as client:
        result = await client.call_tool("run_validation", {
            "task": str(workspace / "redteam" / "task_rmsnorm.py"),
            "candidate": str(workspace / "redteam" / candidate)})
    assert result.is_error is False, result.content
    return result.structured_content


@pytest.mark.anyio
@pytest.mark.parametrize("candidate", sorted(GUARD_CHEATS))
@pytest.mark.slow
async def test_guard_cheats_are_rejected_with_the_named_check(server, workspace, candidate):
    report = await validate(server, workspace, candidate)
    errors = {f["check"] for f in report["findings"] if f["severity"] == "error"}
    assert report["passed"] is False
    # The static checks saw nothing worse than warnings and the outputs are right: the guard's
    # finding is what rejects it.
    assert errors == {GUARD_CHEATS[candidate]}, report["findings"]
    assert report["cases_failed"] == 0


@pytest.mark.slow
@pytest.mark.anyio
async def test_honest_torch_compile_candidate_is_not_refused_in_validation(server, workspace):
    report = await validate(server, workspace, "honest_torch_compile.py")
    assert not [f for f in report["findings"] if f["check"].startswith("guard.")]
    # Inductor's first compile leaves its worker threads (and tqdm's monitor) running after
    # forward returns: started by torch, so not the candidate's.
    errors = {f["check"] for f in report["findings"] if f["severity"] == "error"}
    assert errors == set(), report["findings"]
    assert report["passed"] is True


@pytest.mark.anyio
@pytest.mark.slow
async def test_profile_of_a_candidate_runs_under_the_guard(server, workspace):
    from mcp import Client

    task = str(workspace / "redteam" / "task_rmsnorm.py")
    async with Client(server) as client:
        honest = await client.call_tool("profile", {
            "task": task, "candidate": str(workspace / "redteam" / "honest_triton.py"),
            "warmup": 1, "active": 1})
        cheat = await client.call_tool("profile", {
            "task": task, "candidate": str(workspace / "redteam" / "cheat_frame_walk.py"),
            "warmup": 1, "active": 1})
    assert honest.is_error is False, honest.content
    assert cheat.is_error and "refused by the worker's guard" in cheat.content[0].text
    assert "tb_frame" in cheat.content[0].text


# ---------------------------------------------------------------- whose code started a thread
# Whose code started a thread: installed code the candidate cannot write is the library's,
# wherever the distribution put it; anything the candidate could have written is not.
# (REPO above is the same repository root these tests used.)

PROBE = textwrap.dedent("""
    import json, sys
    sys.path[1:1] = sys.argv[2:]  # the import roots, as a distribution or PYTHONPATH puts them
    from loom_mcp.worker.harness import code_classifier
    classify = code_classifier(sys.argv[1])
    names = {name: classify(path) for name, path in [
        ("readonly_root", sys.argv[2] + "/tqdm_like.py"),
        ("writable_root", sys.argv[3] + "/planted.py"),
        ("candidate_sibling", sys.argv[4] + "/cand/helper.py"),
        ("candidate", sys.argv[1]),
    ]}
    print(json.dumps(names))
""")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_readonly_import_roots_are_library_code(tmp_path: Path) -> None:
    readonly, writable, tree = tmp_path / "dist", tmp_path / "rw", tmp_path / "tree"
    for d in (readonly, writable, tree / "cand"):
        d.mkdir(parents=True)
    candidate = tree / "cand" / "candidate.py"
    candidate.write_text("x = 1\n")
    # A read-only mount of `readonly` and of `tree` (which holds the candidate: being read-only
    # does not make the candidate's own directory library code).
    script = (f"mount --bind {readonly} {readonly} && mount -o remount,bind,ro {readonly} && "
              f"mount --bind {tree} {tree} && mount -o remount,bind,ro {tree} && "
              f'exec "$0" -c "$1" {candidate} {readonly} {writable} {tree}')
    run = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script,
                          sys.executable, PROBE], capture_output=True, text=True, timeout=180,
                         cwd=REPO, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    if run.returncode != 0 and "unshare" in run.stderr and "Operation not permitted" in run.stderr:
        pytest.skip("this kernel refuses unprivileged mount namespaces")
    assert run.returncode == 0, run.stderr[-2000:]
    kinds = __import__("json").loads(run.stdout.strip().splitlines()[-1])
    assert kinds == {"readonly_root": "library", "writable_root": "unknown",
                     "candidate_sibling": "candidate", "candidate": "candidate"}
