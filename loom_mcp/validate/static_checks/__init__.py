"""Static checks over a candidate's source text: AST only, nothing imported, nothing executed.

They flag constructs that known reward hacks need (see research/kernel_eval.md §2). They are a
backstop, not the defence: the real defences are process isolation, fresh inputs, output checks
and the roofline floor. So each check aims at constructs with no honest use in a single-file
kernel candidate, and honest Triton / load_inline code must pass clean.

Severity policy:
* error: the construct has no honest use in a candidate, or its honest use cannot be told apart
  from a known exploit and an honest alternative exists. An error fails validation.
* warning: the construct is common in honest code, or a dynamic check catches its abuse anyway
  (precision is caught by tolerances, seeding by nonce-derived inputs, build directories by the
  sandbox). Warnings are reported and never decide a verdict.

Checks (stable names; severity):
  static.syntax                error    the source does not parse
  static.monkeypatch           error    assigning/deleting/setattr on torch, triton, time, timeit,
                                        builtins, sys, gc, numpy, inspect, random, importlib, or on
                                        timer/comparison attributes (elapsed_time, synchronize,
                                        allclose, __eq__ ...); aten overrides via torch.library;
                                        timer calls in inline C++/CUDA
  static.threads               error    threading, multiprocessing, concurrent.futures, asyncio,
                                        subprocess, os.fork/spawn/exec/system, signal, atexit,
                                        sched, weakref.finalize, __del__; std::thread,
                                        pthread_create, std::async in inline sources
  static.extra_stream          error    torch.cuda.Stream/stream/ExternalStream/set_stream,
                                        stream= bound to anything but the current stream,
                                        cudaStreamCreate*/hipStreamCreate*/getStreamFromPool
  static.tensor_subclass       error    __torch_function__, __torch_dispatch__, _make_subclass,
                                        as_subclass, subclasses of torch.Tensor, dispatch modes
  static.reference_use         error    any use of the reference class (subclassing, calling,
                                        Model.forward), importing the task/reference module
  static.try_fallback          error    an except handler that computes with torch or the reference
                                        and does not re-raise; a broad except (or suppress) that
                                        swallows errors around a kernel launch or inside forward
                               warning  a broad swallowing except elsewhere
  static.grader_introspection  error    inspect.stack/currentframe, sys._getframe, gc.get_objects,
                                        globals(), frame attributes (f_back, f_globals ...),
                                        __subclasses__, sys.modules, import __main__
  static.io                    error    open(), path reads/writes (but reading a declared source,
                                        see below), sockets, HTTP, pickle/marshal/shelve/sqlite3/
                                        mmap, torch.save/load, numpy save/load, /dev/shm and /proc
                                        paths, fopen/ofstream/shm_open in sources
                               warning  os.makedirs, tempfile, shutil (build directories)
  static.pointer_cache         error    data_ptr()/id()/hash()/tobytes() used as a lookup key;
                                        functools caches on forward; static maps keyed by pointers
                                        in inline sources
  static.precision_downgrade   warning  .half(), .bfloat16(), fp16/bf16/fp8 dtypes, allow_tf32,
                                        set_float32_matmul_precision, autocast, tf32 in tl.dot
  static.seed                  warning  manual_seed, random.seed, numpy.random.seed, rng state
  static.ctypes                error    ctypes, cffi, dlopen/dlsym in inline sources
  static.dynamic_code          error    exec, eval, compile, __import__, importlib.import_module,
                                        runpy, code objects: they hide code from these checks
                               warning  getattr on a guarded module with a computed name
  static.no_kernel             warning  no Triton kernel, no inline extension, no CUDA source

A candidate may read the sibling sources it declares in SOURCES (its CUDA source, say), and
only those, named from `__file__` and string literals:

    SOURCE = Path(__file__).with_name("gemv.cu").read_text()

`declared` resolves such paths; anything it cannot resolve to a declared source stays a
static.io error, as does any write to one. A declared native source (.cu, .h, ...) passed to
`check_candidate_source` under its own name is scanned as inline sources are.

Layout: `rules` holds the checks as data (the names and patterns, and each finding's check,
severity and message); `context` what one candidate's walk knows (imports, aliases, scopes,
findings); `analyzer` the walk, which hands each node to the families: `imports`, `reference`
(the reference and the grader), `patching`, `timing` (streams, threads, deferred work, tensor
subclasses), `escape` (files, native and dynamic code), `shortcuts` (result caches, fallbacks),
`precision` (and seeds) and `native` (string constants, inline C++/CUDA sources); `declared`
the SOURCES a file declares and the paths that name one.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from loom_mcp.judge_models import Finding
from loom_mcp.sandbox.sources import NATIVE_SUFFIXES
from loom_mcp.validate.static_checks.analyzer import Analyzer
from loom_mcp.validate.static_checks.context import Context, make_finding
from loom_mcp.validate.static_checks.declared import declared_names, normalised
from loom_mcp.validate.static_checks.native import check_native_text
from loom_mcp.validate.static_checks.rules import (
    CHECKS,
    CODING_COOKIE,
    DEFAULT_REFERENCE_NAMES,
    DEFAULT_TASK_MODULES,
    NO_KERNEL,
    SYNTAX,
    Severity,
)

__all__ = [
    "CHECKS",
    "DEFAULT_REFERENCE_NAMES",
    "DEFAULT_TASK_MODULES",
    "Severity",
    "check_candidate_file",
    "check_candidate_source",
    "has_errors",
]


# PEP 263: a cookie on either of the first two lines sets the encoding Python decodes with.
_COOKIE = re.compile(r"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)")


def _coding_cookie(source: str) -> str | None:
    """The encoding a source's cookie declares, when it is not UTF-8 (None otherwise)."""
    for line in source.splitlines()[:2]:
        match = _COOKIE.match(line)
        if match:
            name = match.group(1).lower().replace("_", "-")
            return None if name in ("utf-8", "utf8", "utf-8-sig") else match.group(1)
        if line.strip() and not line.lstrip().startswith("#"):
            break
    return None


def check_candidate_source(
    source: str,
    filename: str = "candidate.py",
    *,
    reference_names: Iterable[str] = DEFAULT_REFERENCE_NAMES,
    task_modules: Iterable[str] = (),
    allowed_dtypes: Iterable[str] = (),
    declared_sources: Iterable[str] | None = None,
) -> list[Finding]:
    """All static findings for one candidate's source, ordered by line.

    reference_names: class names of the reference (the task's `Model`).
    task_modules: extra module names the candidate must not import (e.g. the task file's stem).
    allowed_dtypes: canonical dtypes the task itself uses ('bf16', 'fp16', 'fp8'); using them is
        not a precision downgrade (TaskSpec.dtypes gives them).
    declared_sources: the sources this file may read, relative to its directory (for a source a
        candidate declares: the candidate's SOURCES); None: those its own SOURCES declares.
    A native source (a `filename` ending .cu, .h, ...) is scanned as inline native source is.
    """
    if PurePosixPath(filename).suffix in NATIVE_SUFFIXES:
        return _check_native_file(source, filename)
    cookie = _coding_cookie(source)
    if cookie is not None:
        message = CODING_COOKIE.message.format(encoding=cookie)
        return [make_finding(CODING_COOKIE.check, CODING_COOKIE.severity, message, filename, 1)]
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        message = SYNTAX.message.format(msg=exc.msg)
        return [make_finding(SYNTAX.check, SYNTAX.severity, message, filename, exc.lineno)]
    ctx = Context(
        tree,
        filename,
        set(reference_names),
        set(DEFAULT_TASK_MODULES) | set(task_modules),
        set(allowed_dtypes),
        declared_names(tree) if declared_sources is None else normalised(list(declared_sources)),
    )
    analyzer = Analyzer(ctx)
    analyzer.visit(tree)
    analyzer.finish()
    return sorted(ctx.findings, key=lambda f: (f.line or 0, f.check))


def _check_native_file(source: str, filename: str) -> list[Finding]:
    """A declared C++/CUDA/HIP source: what the patterns find in inline sources, and no kernel
    where it defines none (a header, say)."""
    ctx = Context(ast.Module(body=[], type_ignores=[]), filename, set(), set(), set())
    check_native_text(ctx, source, 1)
    if not ctx.kernel_evidence:
        ctx.report(NO_KERNEL, None)
    return sorted(ctx.findings, key=lambda f: (f.line or 0, f.check))


def check_candidate_file(
    path: str | Path,
    *,
    reference_names: Iterable[str] = DEFAULT_REFERENCE_NAMES,
    task_modules: Iterable[str] = (),
    allowed_dtypes: Iterable[str] = (),
    declared_sources: Iterable[str] | None = None,
) -> list[Finding]:
    p = Path(path)
    return check_candidate_source(
        p.read_text(encoding="utf-8"),
        str(p),
        reference_names=reference_names,
        task_modules=task_modules,
        allowed_dtypes=allowed_dtypes,
        declared_sources=declared_sources,
    )


def has_errors(findings: Iterable[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)
