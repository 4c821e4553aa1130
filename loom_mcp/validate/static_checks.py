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
  static.io                    error    open(), pathlib reads/writes, sockets, HTTP, pickle/marshal/
                                        shelve/sqlite3/mmap, torch.save/load, numpy save/load,
                                        /dev/shm and /proc paths, fopen/ofstream/shm_open in sources
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
"""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from loom_mcp.judge_models import Finding

Severity = Literal["error", "warning"]

CHECKS: dict[str, str] = {
    "static.syntax": "error",
    "static.monkeypatch": "error",
    "static.threads": "error",
    "static.extra_stream": "error",
    "static.tensor_subclass": "error",
    "static.reference_use": "error",
    "static.try_fallback": "error/warning",
    "static.grader_introspection": "error",
    "static.io": "error/warning",
    "static.pointer_cache": "error",
    "static.precision_downgrade": "warning",
    "static.seed": "warning",
    "static.ctypes": "error",
    "static.dynamic_code": "error/warning",
    "static.no_kernel": "warning",
}

DEFAULT_REFERENCE_NAMES: tuple[str, ...] = ("Model",)
# Module names a candidate has no reason to import: where harnesses keep the reference.
DEFAULT_TASK_MODULES: tuple[str, ...] = ("reference", "ref", "task", "problem", "loom_task")

# Patching anything under these roots is how timers, syncs and comparisons get faked.
GUARDED_ROOTS = frozenset(
    {
        "torch",
        "triton",
        "time",
        "timeit",
        "builtins",
        "sys",
        "gc",
        "numpy",
        "inspect",
        "random",
        "importlib",
    }
)
# Honest global switches: assigning them is configuration, not patching (precision flags among
# them are reported as precision warnings instead).
CONFIG_PREFIXES = (
    "torch.backends.",
    "torch._dynamo.config.",
    "torch._inductor.config.",
    "torch._functorch.config.",
)
# Attributes whose replacement fakes timing or comparison, whatever object they hang on.
SENSITIVE_ATTRS = frozenset(
    {
        "elapsed_time",
        "synchronize",
        "record",
        "query",
        "perf_counter",
        "perf_counter_ns",
        "monotonic",
        "monotonic_ns",
        "process_time",
        "time_ns",
        "do_bench",
        "do_bench_cudagraph",
        "allclose",
        "isclose",
        "equal",
        "assert_close",
        "assert_allclose",
        "__eq__",
        "__ne__",
        "__class__",
        "__code__",
    }
)
PRECISION_FLAGS = frozenset(
    {
        "allow_tf32",
        "allow_fp16_reduced_precision_reduction",
        "allow_bf16_reduced_precision_reduction",
    }
)

THREAD_MODULES = (
    "threading",
    "_thread",
    "multiprocessing",
    "concurrent.futures",
    "asyncio",
    "subprocess",
    "torch.multiprocessing",
    "pty",
    # Code that runs later, at a moment the candidate does not control but can aim: a timer
    # signal, interpreter exit, an event scheduler. Work deferred that way can land while the
    # other arm is being timed.
    "signal",
    "atexit",
    "sched",
)
# Calls that register code to run later (object finalization, GC callbacks).
DEFERRED_CALLS = frozenset({"weakref.finalize", "gc.callbacks.append", "sys.addaudithook"})
PROCESS_CALLS = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.system",
        "os.popen",
        "os.posix_spawn",
        "os.posix_spawnp",
        "os.startfile",
        "os.register_at_fork",
    }
)
PROCESS_CALL_PREFIXES = ("os.spawn", "os.exec")

CTYPES_MODULES = ("ctypes", "_ctypes", "cffi")
IO_MODULES = (
    "socket",
    "ssl",
    "urllib",
    "http",
    "requests",
    "httpx",
    "aiohttp",
    "ftplib",
    "smtplib",
    "xmlrpc",
    "websocket",
    "websockets",
    "paramiko",
    "pickle",
    "_pickle",
    "cPickle",
    "dill",
    "cloudpickle",
    "joblib",
    "shelve",
    "marshal",
    "dbm",
    "sqlite3",
    "mmap",
)
IO_CALLS = frozenset(
    {
        "builtins.open",
        "io.open",
        "io.FileIO",
        "os.open",
        "os.read",
        "os.write",
        "os.listdir",
        "os.scandir",
        "os.walk",
        "os.remove",
        "os.unlink",
        "os.rename",
        "os.replace",
        "os.mkfifo",
        "os.fdopen",
        "os.pipe",
        "glob.glob",
        "glob.iglob",
        "torch.save",
        "torch.load",
        "torch.from_file",
        "torch.UntypedStorage.from_file",
        "torch.TypedStorage.from_file",
        "numpy.save",
        "numpy.savez",
        "numpy.savez_compressed",
        "numpy.load",
        "numpy.memmap",
        "numpy.fromfile",
        "numpy.savetxt",
        "numpy.loadtxt",
        "numpy.genfromtxt",
    }
)
IO_WARNING_CALLS = frozenset({"os.makedirs", "os.mkdir"})
IO_WARNING_PREFIXES = ("tempfile.", "shutil.")
PATH_IO_METHODS = frozenset(
    {"open", "read_text", "read_bytes", "write_text", "write_bytes", "touch", "unlink", "iterdir"}
)
IO_PATH_MARKERS = ("/dev/shm", "/proc/", "/dev/mem")

STREAM_CALLS = frozenset(
    {
        "torch.cuda.Stream",
        "torch.cuda.stream",
        "torch.cuda.ExternalStream",
        "torch.cuda.set_stream",
        "torch.cuda.StreamContext",
        "torch.cuda.streams.Stream",
        "torch.cuda.streams.ExternalStream",
        "torch.Stream",
        "torch.xpu.Stream",
        "torch.cuda.Stream.__new__",
    }
)
BENIGN_STREAM_SUFFIXES = ("current_stream", "default_stream", "current_device_stream")

INTROSPECTION_CALLS = frozenset(
    {
        "inspect.stack",
        "inspect.currentframe",
        "inspect.getouterframes",
        "inspect.getinnerframes",
        "inspect.trace",
        "inspect.getframeinfo",
        "inspect.getsource",
        "inspect.getsourcefile",
        "inspect.getmembers",
        "sys._getframe",
        "sys._current_frames",
        "sys.settrace",
        "sys.setprofile",
        "sys.exc_info",
        "threading.settrace",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "traceback.extract_stack",
        "traceback.walk_stack",
        "traceback.format_stack",
        "traceback.print_stack",
        "builtins.globals",
    }
)
INTROSPECTION_ATTRS = frozenset(
    {
        "f_back",
        "f_locals",
        "f_globals",
        "f_builtins",
        "f_code",
        "tb_frame",
        "tb_next",
        "gi_frame",
        "cr_frame",
        "ag_frame",
        "__globals__",
        "__subclasses__",
        "__closure__",
    }
)

SUBCLASS_HOOKS = frozenset({"__torch_function__", "__torch_dispatch__", "_make_subclass"})
TENSOR_BASES = frozenset(
    {
        "torch.Tensor",
        "torch.nn.Parameter",
        "torch.nn.parameter.Parameter",
        "torch._C._TensorBase",
        "torch._C.TensorBase",
        "torch.tensor._TensorBase",
    }
)
DISPATCH_MODULES = ("torch.utils._python_dispatch", "torch.overrides", "torch._subclasses")

# Lower-precision dtypes -> canonical name. A dtype the task itself uses is not a downgrade.
LOW_DTYPES: dict[str, str] = {
    "torch.float16": "fp16",
    "torch.half": "fp16",
    "torch.bfloat16": "bf16",
    "torch.float8_e4m3fn": "fp8",
    "torch.float8_e4m3fnuz": "fp8",
    "torch.float8_e5m2": "fp8",
    "torch.float8_e5m2fnuz": "fp8",
    "torch.float8_e8m0fnu": "fp8",
    "triton.language.float16": "fp16",
    "triton.language.bfloat16": "bf16",
    "triton.language.float8e4nv": "fp8",
    "triton.language.float8e5": "fp8",
    "triton.language.float8e4b15": "fp8",
    "triton.language.float8e4b8": "fp8",
    "triton.language.float8e5b16": "fp8",
}
LOW_PRECISION_METHODS: dict[str, str] = {"half": "fp16", "bfloat16": "bf16"}
AUTOCAST_CALLS = frozenset(
    {"torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "torch.cpu.amp.autocast"}
)
SEED_CALLS = frozenset(
    {
        "torch.manual_seed",
        "torch.seed",
        "torch.initial_seed",
        "torch.random.manual_seed",
        "torch.random.seed",
        "torch.set_rng_state",
        "torch.get_rng_state",
        "torch.cuda.manual_seed",
        "torch.cuda.manual_seed_all",
        "torch.cuda.set_rng_state",
        "torch.cuda.get_rng_state",
        "torch.cuda.initial_seed",
        "random.seed",
        "random.setstate",
        "numpy.random.seed",
        "numpy.random.set_state",
    }
)

DYNAMIC_CALLS = frozenset(
    {
        "builtins.exec",
        "builtins.eval",
        "builtins.compile",
        "builtins.__import__",
        "importlib.import_module",
        "importlib.__import__",
        "importlib.reload",
        "importlib.util.spec_from_file_location",
        "importlib.util.spec_from_loader",
        "importlib.util.module_from_spec",
        "importlib.machinery.SourceFileLoader",
        "runpy.run_path",
        "runpy.run_module",
        "types.FunctionType",
        "types.CodeType",
        "types.ModuleType",
    }
)
DYNAMIC_MODULES = ("runpy", "code", "codeop")

# Calls that prove the candidate brings its own kernel (for static.no_kernel).
KERNEL_MARKERS = (
    "triton.jit",
    "triton.autotune",
    "triton.heuristics",
    "triton.language",
    "torch.utils.cpp_extension.load_inline",
    "torch.utils.cpp_extension.load",
    "torch.cuda.jiterator",
    "cupy.RawKernel",
    "cupy.RawModule",
    "numba.cuda.jit",
    "cutlass",
    "tilelang",
    "helion",
)

# torch calls a handler may make without computing a fallback result.
NON_COMPUTE_TORCH = frozenset(
    {
        "torch.cuda.synchronize",
        "torch.cuda.empty_cache",
        "torch.cuda.is_available",
        "torch.cuda.get_device_name",
        "torch.cuda.get_device_capability",
        "torch.cuda.device_count",
        "torch.cuda.current_device",
        "torch.is_tensor",
        "torch.get_default_dtype",
    }
)
# Tensor methods that compute: a handler calling them on anything is a PyTorch fallback.
TENSOR_COMPUTE_METHODS = frozenset(
    {
        "matmul",
        "mm",
        "bmm",
        "addmm",
        "softmax",
        "log_softmax",
        "sum",
        "mean",
        "exp",
        "relu",
        "sigmoid",
        "tanh",
        "norm",
        "conv2d",
        "forward",
        "__call__",
        "pow",
        "sqrt",
        "rsqrt",
        "max",
        "min",
        "cumsum",
        "layer_norm",
        "mul",
        "add",
        "div",
    }
)

# Inline C++/CUDA/HIP source: token -> (check, severity, what it does).
SOURCE_PATTERNS: tuple[tuple[re.Pattern[str], str, Severity, str], ...] = (
    (
        re.compile(r"\b(cuda|hip)StreamCreate\w*|\bgetStreamFromPool\b|\bcudaStreamPerThread\b"),
        "static.extra_stream",
        "error",
        "creates or uses a non-current stream, whose work escapes the timer",
    ),
    (
        re.compile(r"\bsetCurrent(CUDA|HIP)Stream\b"),
        "static.extra_stream",
        "error",
        "switches the current stream, whose work escapes the timer",
    ),
    (
        re.compile(r"\bstd::thread\b|\bpthread_create\b|\bstd::async\b|#include\s*<thread>"),
        "static.threads",
        "error",
        "starts a host thread, which can finish work after the timer stops",
    ),
    (
        re.compile(r"\bfork\s*\(|\bpopen\s*\(|\bsystem\s*\("),
        "static.threads",
        "error",
        "starts a process from native code",
    ),
    (
        re.compile(r"\bfopen\s*\(|std::[io]?fstream|\bshm_open\b|/dev/shm|\bsocket\s*\("),
        "static.io",
        "error",
        "reads or writes files, shared memory or sockets from native code",
    ),
    (
        re.compile(r"\bdlopen\b|\bdlsym\b|LD_PRELOAD"),
        "static.ctypes",
        "error",
        "loads or interposes native symbols",
    ),
    (
        re.compile(r"\b(cuda|hip|cu)EventElapsedTime\b|\bcudaEventRecord\b|\bhipEventRecord\b"),
        "static.monkeypatch",
        "error",
        "touches timing events, which only the harness may do",
    ),
    (
        re.compile(r"__float2half|__float2bfloat16|precision::tf32|CUBLAS_TF32|COMPUTE_32F_FAST"),
        "static.precision_downgrade",
        "warning",
        "computes in a lower precision than fp32",
    ),
)
_STATIC_MAP = re.compile(r"static\s+(?:std::)?(?:unordered_)?map\s*<")
_POINTER_KEY = re.compile(r"data_ptr|void\s*\*|uintptr_t|intptr_t")
_NATIVE_SOURCE = re.compile(r"__global__|#include|torch::|at::|\bextern\s+\"C\"")

_BUILTIN_NAMES = frozenset(dir(builtins))
# Calls whose value identifies a tensor by address or content: keys of result caches.
_IDENTITY_METHODS = frozenset({"data_ptr", "tobytes", "_cdata", "__array_interface__"})


def _root(qualname: str) -> str:
    return qualname.split(".", 1)[0]


def _is_under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


class _Analyzer(ast.NodeVisitor):
    def __init__(
        self,
        tree: ast.Module,
        filename: str,
        reference_names: set[str],
        task_modules: set[str],
        allowed_dtypes: set[str],
    ) -> None:
        self.tree = tree
        self.filename = filename
        self.reference_names = reference_names
        self.task_modules = task_modules
        self.allowed_dtypes = allowed_dtypes
        self.findings: list[Finding] = []
        self._seen: set[tuple[str, int | None, str]] = set()
        self.aliases: dict[str, str] = {}
        self.local_names: set[str] = set()
        # Names and attribute targets (as source text, 'self.side') bound to a stream creation.
        self.stream_names: set[str] = set()
        self.identity_names: set[str] = set()  # names bound to expressions holding data_ptr/id
        self.functions: list[str] = []
        self.classes: list[tuple[str, list[str]]] = []
        self.kernel_evidence = False
        self._collect_bindings()

    # ------------------------------------------------------------ plumbing

    def add(self, check: str, severity: Severity, node: ast.AST | int | None, message: str) -> None:
        line = node if isinstance(node, int) or node is None else getattr(node, "lineno", None)
        # Errors are reported at every line (each must be fixed); a repeated warning once, at its
        # first line, so a bf16 kernel does not bury the result under identical notes.
        key = (check, line if severity == "error" else None, message)
        if key in self._seen:
            return
        self._seen.add(key)
        self.findings.append(
            Finding(
                check=check,
                severity=severity,
                message=message,
                where=f"{self.filename}:{line}" if line is not None else self.filename,
                line=line,
            )
        )

    def _collect_bindings(self) -> None:
        """Imports and simple aliases (`E = torch.cuda.Event`), flow-insensitively."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        self.aliases[top] = top
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.local_names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.local_names.add(node.id)
            elif isinstance(node, ast.arg):
                self.local_names.add(node.arg)
        # Attribute-chain aliases, resolved to a fixed point (chains of aliases are short).
        for _ in range(4):
            changed = False
            for node in ast.walk(self.tree):
                if (
                    isinstance(node, ast.Assign)
                    and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, (ast.Name, ast.Attribute))
                ):
                    q = self.chain(node.value)
                    name = node.targets[0].id
                    if q and self.aliases.get(name) != q and _root(q) != name:
                        self.aliases[name] = q
                        changed = True
            if not changed:
                break
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                if isinstance(node.value, ast.Call):
                    q = self.chain(node.value.func) or ""
                    if q in STREAM_CALLS and not self._benign_stream(node.value):
                        self.stream_names.update(
                            ast.unparse(t) for t in targets if isinstance(t, ast.Attribute)
                        )
                        self.stream_names.update(names)
                if not names:
                    continue
                if self._contains_identity(node.value):
                    self.identity_names.update(names)

    def chain(self, node: ast.AST) -> str | None:
        """Dotted name of a pure attribute chain rooted at an import or a builtin, else None.

        getattr(x, "lit") and vars(x) are followed, because they are the usual way to reach a
        module attribute without writing its name.
        """
        if isinstance(node, ast.Name):
            if node.id in self.aliases:
                return self.aliases[node.id]
            if node.id == "__builtins__":
                return "builtins"
            if node.id in _BUILTIN_NAMES and node.id not in self.local_names:
                return f"builtins.{node.id}"
            return None
        if isinstance(node, ast.Attribute):
            base = self.chain(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call) and node.args:
            func = self.chain(node.func)
            if func == "builtins.getattr" and len(node.args) >= 2:
                base = self.chain(node.args[0])
                arg = node.args[1]
                if base and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    return f"{base}.{arg.value}"
                return f"{base}.?" if base else None
            if func == "builtins.vars":
                base = self.chain(node.args[0])
                return f"{base}.__dict__" if base else None
        return None

    def call_name(self, call: ast.Call) -> str | None:
        return self.chain(call.func)

    def _contains_identity(self, node: ast.AST) -> bool:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                f = sub.func
                if isinstance(f, ast.Attribute) and f.attr in _IDENTITY_METHODS:
                    return True
                if self.chain(f) == "builtins.id":
                    return True
            elif isinstance(sub, ast.Attribute) and sub.attr in ("_cdata", "__array_interface__"):
                return True
            elif isinstance(sub, ast.Name) and sub.id in self.identity_names:
                return True
        return False

    def _benign_stream(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Constant) and node.value in (None, 0):
            return True
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and sub.attr in BENIGN_STREAM_SUFFIXES:
                return True
            if isinstance(sub, ast.Name) and sub.id in BENIGN_STREAM_SUFFIXES:
                return True
        return False

    def _src(self, node: ast.AST) -> str:
        text = ast.unparse(node)
        return text if len(text) <= 60 else text[:57] + "..."

    # ------------------------------------------------------------ scopes

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if node.name == "__del__" and self.classes:
            self.add(
                "static.threads",
                "error",
                node,
                "Defines __del__, which runs when the garbage collector decides: work can land "
                "after the timer stops or while the other arm is timed.",
            )
        if node.name in ("__torch_function__", "__torch_dispatch__"):
            self.add(
                "static.tensor_subclass",
                "error",
                node,
                f"Defines {node.name}, which lets a tensor defer or fake work outside the timed call.",
            )
        for dec in node.decorator_list:
            target = dec.func if isinstance(dec, ast.Call) else dec
            q = self.chain(target) or ""
            if _is_under(q, KERNEL_MARKERS):
                self.kernel_evidence = True
            if q in ("functools.lru_cache", "functools.cache") and node.name in (
                "forward",
                "__call__",
            ):
                self.add(
                    "static.pointer_cache",
                    "error",
                    dec,
                    f"Caches the results of {node.name}, so repeated calls skip the work.",
                )
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases: list[str] = []
        for base in node.bases:
            q = self.chain(base) or ""
            bases.append(q or (base.id if isinstance(base, ast.Name) else ""))
            if q in TENSOR_BASES:
                self.add(
                    "static.tensor_subclass",
                    "error",
                    node,
                    f"Class {node.name} subclasses {q}; outputs must be plain tensors that did "
                    "their work inside the call.",
                )
        self.classes.append((node.name, bases))
        self.generic_visit(node)
        self.classes.pop()

    def _in_forward(self) -> bool:
        return any(f in ("forward", "__call__") for f in self.functions)

    # ------------------------------------------------------------ imports

    def _check_module(self, module: str, node: ast.AST) -> bool:
        """Report a forbidden module; True when it was reported."""
        before = len(self.findings)
        if _is_under(module, THREAD_MODULES):
            self.add(
                "static.threads",
                "error",
                node,
                f"Imports {module}; background threads or processes can finish work after the "
                "timer stops.",
            )
        if _is_under(module, CTYPES_MODULES):
            self.add(
                "static.ctypes",
                "error",
                node,
                f"Imports {module}, which reaches native code and memory outside the checked paths.",
            )
        if _is_under(module, IO_MODULES):
            self.add(
                "static.io",
                "error",
                node,
                f"Imports {module}; a kernel needs no files, network or serialized caches.",
            )
        if _is_under(module, DISPATCH_MODULES):
            self.add(
                "static.tensor_subclass",
                "error",
                node,
                f"Imports {module}, the machinery of tensor subclasses and dispatch modes.",
            )
        if _is_under(module, DYNAMIC_MODULES):
            self.add(
                "static.dynamic_code",
                "error",
                node,
                f"Imports {module}, which runs code these checks cannot read.",
            )
        if module == "__main__" or _root(module) in self.task_modules:
            what = "the harness's main module" if module == "__main__" else "the task's module"
            check = (
                "static.grader_introspection" if module == "__main__" else "static.reference_use"
            )
            self.add(check, "error", node, f"Imports {module}, {what}; a candidate stands alone.")
        return len(self.findings) > before

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self._check_module(a.name, node)
            if _is_under(a.name, KERNEL_MARKERS):
                self.kernel_evidence = True

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level:
            self.add(
                "static.reference_use",
                "error",
                node,
                "Uses a relative import; a candidate stands alone and must not reach the task's "
                "package.",
            )
        module_flagged = self._check_module(module, node) if module else False
        for a in node.names:
            full = f"{module}.{a.name}" if module else a.name
            if not module_flagged:
                self._check_module(full, node)
            if _is_under(full, KERNEL_MARKERS) or _is_under(module, KERNEL_MARKERS):
                self.kernel_evidence = True
            if a.name in self.reference_names and not module_flagged:
                self.add(
                    "static.reference_use",
                    "error",
                    node,
                    f"Imports {a.name} from {module or 'a relative module'}; the reference must "
                    "not be used by the candidate.",
                )
            if full in PROCESS_CALLS or full.startswith(PROCESS_CALL_PREFIXES):
                self.add(
                    "static.threads", "error", node, f"Imports {full}, which starts processes."
                )

    # ------------------------------------------------------------ names and attributes

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.reference_names and isinstance(node.ctx, ast.Load):
            inside_copy = any(name in self.reference_names for name, _ in self.classes)
            if not inside_copy:
                self.add(
                    "static.reference_use",
                    "error",
                    node,
                    f"Uses {node.id}, the reference implementation; the candidate must compute "
                    "the result itself.",
                )
        if node.id == "__builtins__":
            self.add(
                "static.monkeypatch",
                "error",
                node,
                "Touches __builtins__, which can rewrite any built-in the harness relies on.",
            )

    def visit_Attribute(self, node: ast.Attribute) -> None:
        q = self.chain(node)
        if q:
            if _is_under(q, KERNEL_MARKERS):
                self.kernel_evidence = True
            if q in LOW_DTYPES and LOW_DTYPES[q] not in self.allowed_dtypes:
                self.add(
                    "static.precision_downgrade",
                    "warning",
                    node,
                    f"Uses {q.replace('triton.language', 'tl')}; computing below the task's "
                    "precision fails fp32 tolerances.",
                )
            if _is_under(q, ("sys.modules",)):
                self.add(
                    "static.grader_introspection",
                    "error",
                    node,
                    "Reads sys.modules, where the harness's and the task's modules live.",
                )
        if node.attr in INTROSPECTION_ATTRS:
            self.add(
                "static.grader_introspection",
                "error",
                node,
                f"Reads .{node.attr}, which walks frames, closures or classes to reach the grader.",
            )
        if node.attr in SUBCLASS_HOOKS:
            self.add(
                "static.tensor_subclass",
                "error",
                node,
                f"Uses {node.attr}, the hook of tensor subclasses that can defer or fake work.",
            )
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if not isinstance(node.value, str):
            return
        text = node.value
        if text in SUBCLASS_HOOKS:
            self.add(
                "static.tensor_subclass",
                "error",
                node,
                f"Names {text}, the hook of tensor subclasses that can defer or fake work.",
            )
        for marker in IO_PATH_MARKERS:
            if marker in text and not _NATIVE_SOURCE.search(text):
                self.add(
                    "static.io",
                    "error",
                    node,
                    f"Refers to {marker}, a place to stash or read results outside the process.",
                )
        if _NATIVE_SOURCE.search(text):
            self._check_native_source(node, text)

    def _check_native_source(self, node: ast.Constant, text: str) -> None:
        if "__global__" in text:
            self.kernel_evidence = True
        start = node.lineno
        for pattern, check, severity, what in SOURCE_PATTERNS:
            for m in pattern.finditer(text):
                line = start + text.count("\n", 0, m.start())
                self.add(check, severity, line, f"Inline native source uses {m.group(0)}: {what}.")
        for m in _STATIC_MAP.finditer(text):
            window = text[m.start() : m.start() + 200]
            if _POINTER_KEY.search(window):
                line = start + text.count("\n", 0, m.start())
                self.add(
                    "static.pointer_cache",
                    "error",
                    line,
                    "Inline native source keeps a static map keyed by pointers: results cached "
                    "across calls.",
                )

    # ------------------------------------------------------------ assignments

    def _check_store_target(self, target: ast.AST, value: ast.AST | None, verb: str) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                self._check_store_target(elt, None, verb)
            return
        if isinstance(target, ast.Starred):
            self._check_store_target(target.value, value, verb)
            return
        if isinstance(target, ast.Attribute):
            full = self.chain(target)
            base = self.chain(target.value)
            if target.attr in PRECISION_FLAGS:
                if not (isinstance(value, ast.Constant) and value.value is False):
                    self.add(
                        "static.precision_downgrade",
                        "warning",
                        target,
                        f"Sets {self._src(target)}; TF32/reduced-precision math fails fp32 "
                        "tolerances.",
                    )
                return
            if full and full.startswith(CONFIG_PREFIXES):
                if target.attr == "suppress_errors":
                    self.add(
                        "static.try_fallback",
                        "warning",
                        target,
                        "Sets torch._dynamo suppress_errors, which silently falls back to eager.",
                    )
                return
            if base and _root(base) in GUARDED_ROOTS:
                self.add(
                    "static.monkeypatch",
                    "error",
                    target,
                    f"{verb} {self._src(target)}, patching {_root(base)}; timers, syncs and "
                    "library functions must stay as the harness expects.",
                )
                return
            root_is_self = isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")
            if target.attr in SENSITIVE_ATTRS and not root_is_self:
                self.add(
                    "static.monkeypatch",
                    "error",
                    target,
                    f"{verb} {self._src(target)}, replacing a timing or comparison method.",
                )
            return
        if isinstance(target, ast.Subscript):
            base = self.chain(target.value)
            if base and (_root(base) in GUARDED_ROOTS or base.endswith("__dict__")):
                self.add(
                    "static.monkeypatch",
                    "error",
                    target,
                    f"{verb} {self._src(target)}, rewriting a module's namespace.",
                )
            elif isinstance(target.value, ast.Attribute) and target.value.attr == "__dict__":
                self.add(
                    "static.monkeypatch",
                    "error",
                    target,
                    f"{verb} {self._src(target)}, rewriting an object's namespace.",
                )
            self._check_key(target.slice, target)

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self._check_store_target(t, node.value, "Assigns")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_store_target(node.target, node.value, "Assigns")
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._check_store_target(node.target, node.value, "Assigns")
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for t in node.targets:
            self._check_store_target(t, None, "Deletes")
        self.generic_visit(node)

    # ------------------------------------------------------------ keys (pointer caches)

    def _check_key(self, key: ast.AST, where: ast.AST) -> None:
        if self._contains_identity(key):
            self.add(
                "static.pointer_cache",
                "error",
                where,
                f"Uses {self._src(key)} as a lookup key, built from tensor addresses, ids or "
                "bytes: a result cache that skips the work on repeated inputs.",
            )

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Load):
            self._check_key(node.slice, node)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            self._check_key(node.left, node)
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for k in node.keys:
            if k is not None:
                self._check_key(k, node)
        self.generic_visit(node)

    # ------------------------------------------------------------ calls

    def visit_Call(self, node: ast.Call) -> None:
        q = self.call_name(node) or ""
        func = node.func
        attr = func.attr if isinstance(func, ast.Attribute) else None

        if _is_under(q, KERNEL_MARKERS):
            self.kernel_evidence = True

        # monkeypatch via setattr and friends
        if q in ("builtins.setattr", "builtins.delattr") or attr in ("__setattr__", "__delattr__"):
            self._check_setattr(node, q or f"{attr}")
        if q.startswith("torch.library.") and self._overrides_aten(node):
            self.add(
                "static.monkeypatch",
                "error",
                node,
                "Registers an implementation for an aten operator, replacing what the reference "
                "and harness run.",
            )

        # threads and processes
        if q in PROCESS_CALLS or q.startswith(PROCESS_CALL_PREFIXES):
            self.add("static.threads", "error", node, f"Calls {q}, which starts a process.")
        if q in DEFERRED_CALLS:
            self.add("static.threads", "error", node,
                     f"Calls {q}, which registers code to run later, outside the timed call.")

        # streams
        if q in STREAM_CALLS:
            self.add(
                "static.extra_stream",
                "error",
                node,
                f"Calls {q}; work on another stream escapes the timer and the output checks.",
            )
        for kw in node.keywords:
            if kw.arg == "stream" and not self._benign_stream(kw.value):
                value = kw.value
                # A name or attribute is suspicious when it holds a created stream; any other
                # call is, unless it is the current/default stream (checked above).
                suspicious = (
                    isinstance(value, (ast.Name, ast.Attribute))
                    and ast.unparse(value) in self.stream_names
                ) or isinstance(value, ast.Call)
                if suspicious:
                    self.add(
                        "static.extra_stream",
                        "error",
                        node,
                        f"Passes stream={self._src(value)}; kernels must run on the current "
                        "stream.",
                    )

        # tensor subclasses
        if attr == "as_subclass":  # _make_subclass is reported where the attribute is read
            self.add(
                "static.tensor_subclass",
                "error",
                node,
                "Calls .as_subclass(), which turns an output into a tensor subclass.",
            )

        # grader introspection
        if q in INTROSPECTION_CALLS or (q == "builtins.vars" and not node.args):
            self.add(
                "static.grader_introspection",
                "error",
                node,
                f"Calls {q.removeprefix('builtins.')}(), which can reach the grader's frames, "
                "objects or reference outputs.",
            )

        # I/O
        if q in IO_CALLS:
            self.add(
                "static.io",
                "error",
                node,
                f"Calls {q.removeprefix('builtins.')}(); a kernel needs no files, and files can "
                "carry results between runs.",
            )
        elif q in IO_WARNING_CALLS or q.startswith(IO_WARNING_PREFIXES):
            self.add(
                "static.io",
                "warning",
                node,
                f"Calls {q}; fine for a build directory, never for storing results.",
            )
        elif attr in PATH_IO_METHODS and isinstance(func, ast.Attribute):
            base = self.chain(func.value) or ""
            if base.startswith("pathlib") or (
                isinstance(func.value, ast.Call)
                and (self.chain(func.value.func) or "").startswith("pathlib")
            ):
                self.add(
                    "static.io", "error", node, f"Calls Path.{attr}(); a kernel needs no files."
                )
        if attr == "tofile":
            self.add("static.io", "error", node, "Calls .tofile(), writing tensor data to disk.")

        # pointer caches through dict methods
        if attr in ("get", "setdefault", "pop", "__contains__", "__getitem__") and node.args:
            self._check_key(node.args[0], node)

        # precision
        if (
            attr in LOW_PRECISION_METHODS
            and not node.args
            and LOW_PRECISION_METHODS[attr] not in self.allowed_dtypes
        ):
            self.add(
                "static.precision_downgrade",
                "warning",
                node,
                f"Calls .{attr}(); computing below the task's precision fails fp32 tolerances.",
            )
        if q == "torch.set_float32_matmul_precision":
            arg = node.args[0] if node.args else None
            if not (isinstance(arg, ast.Constant) and arg.value == "highest"):
                self.add(
                    "static.precision_downgrade",
                    "warning",
                    node,
                    "Lowers float32 matmul precision (TF32 or bf16), which fails fp32 tolerances.",
                )
        if q in AUTOCAST_CALLS:
            self.add(
                "static.precision_downgrade",
                "warning",
                node,
                f"Uses {q}, which runs ops in lower precision.",
            )
        for kw in node.keywords:
            low_tf32 = kw.arg == "allow_tf32" and not (
                isinstance(kw.value, ast.Constant) and kw.value.value is False
            )
            tf32_precision = (
                kw.arg == "input_precision"
                and isinstance(kw.value, ast.Constant)
                and isinstance(kw.value.value, str)
                and kw.value.value.startswith("tf32")
            )
            if low_tf32 or tf32_precision:
                self.add(
                    "static.precision_downgrade",
                    "warning",
                    node,
                    f"Passes {kw.arg}={self._src(kw.value)}: TF32 math fails fp32 tolerances.",
                )

        # seeds
        if q in SEED_CALLS or attr == "manual_seed":
            self.add(
                "static.seed",
                "warning",
                node,
                f"Calls {q or '.manual_seed'}(); a candidate has no use for RNG state, which can "
                "be used to predict inputs.",
            )

        # dynamic code
        if q in DYNAMIC_CALLS:
            self.add(
                "static.dynamic_code",
                "error",
                node,
                f"Calls {q.removeprefix('builtins.')}(), which runs code these checks cannot read.",
            )
        if q == "builtins.getattr" and len(node.args) >= 2:
            base = self.chain(node.args[0]) or ""
            name = node.args[1]
            if _root(base) in GUARDED_ROOTS and not (
                isinstance(name, ast.Constant) and isinstance(name.value, str)
            ):
                self.add(
                    "static.dynamic_code",
                    "warning",
                    node,
                    f"Looks up an attribute of {base} by a computed name, which hides what is used.",
                )
        if q == "contextlib.suppress" and self._broad_types(node.args):
            self._report_swallow(node, "contextlib.suppress(...) of broad exceptions")

        self.generic_visit(node)

    def _check_setattr(self, node: ast.Call, how: str) -> None:
        args = list(node.args)
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("__setattr__", "__delattr__"):
            obj_node: ast.AST = func.value
            if self.chain(obj_node) in ("builtins.object", "builtins.type"):
                if not args:
                    return
                obj_node, args = args[0], args[1:]
        elif args:
            obj_node, args = args[0], args[1:]
        else:
            return
        base = self.chain(obj_node)
        name = args[0] if args else None
        literal = name.value if isinstance(name, ast.Constant) else None
        if base and _root(base) in GUARDED_ROOTS:
            self.add(
                "static.monkeypatch",
                "error",
                node,
                f"Calls {how.removeprefix('builtins.')} on {base}, patching {_root(base)}.",
            )
        elif literal in SENSITIVE_ATTRS or literal in SUBCLASS_HOOKS:
            self.add(
                "static.monkeypatch",
                "error",
                node,
                f"Calls {how.removeprefix('builtins.')} for {literal!r}, replacing a timing or "
                "comparison method.",
            )

    def _overrides_aten(self, node: ast.Call) -> bool:
        for arg in [*node.args, *(kw.value for kw in node.keywords)]:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if arg.value == "aten" or arg.value.startswith("aten::"):
                    return True
        return False

    # ------------------------------------------------------------ try/except fallbacks

    def _broad_types(self, types: list[ast.expr]) -> bool:
        for t in types:
            elts = t.elts if isinstance(t, ast.Tuple) else [t]
            for e in elts:
                q = self.chain(e) or (e.id if isinstance(e, ast.Name) else "")
                if q.removeprefix("builtins.") in ("Exception", "BaseException"):
                    return True
        return False

    def _handler_is_broad(self, handler: ast.ExceptHandler) -> bool:
        return handler.type is None or self._broad_types([handler.type])

    @staticmethod
    def _reraises(body: list[ast.stmt]) -> bool:
        return bool(body) and isinstance(body[-1], ast.Raise)

    def _computes(self, body: list[ast.stmt]) -> str | None:
        """What a handler computes with, if it computes a replacement result."""
        for stmt in body:
            for sub in ast.walk(stmt):
                if not isinstance(sub, ast.Call):
                    continue
                q = self.call_name(sub) or ""
                if _root(q) == "torch" and q not in NON_COMPUTE_TORCH:
                    return q
                f = sub.func
                if isinstance(f, ast.Name) and f.id in self.reference_names:
                    return f.id
                if isinstance(f, ast.Attribute):
                    inner = f.value
                    if (
                        isinstance(inner, ast.Call)
                        and isinstance(inner.func, ast.Name)
                        and inner.func.id == "super"
                    ):
                        return f"super().{f.attr}"
                    if f.attr in TENSOR_COMPUTE_METHODS and _root(q) not in ("builtins", "math"):
                        return f".{f.attr}"
        return None

    def _launches_kernel(self, body: list[ast.stmt]) -> bool:
        for stmt in body:
            for sub in ast.walk(stmt):
                if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Subscript):
                    return True  # kernel[grid](...)
        return False

    def _has_call(self, body: list[ast.stmt]) -> bool:
        only_imports = all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in body)
        return not only_imports and any(
            isinstance(sub, ast.Call) for s in body for sub in ast.walk(s)
        )

    def _report_swallow(self, node: ast.AST, what: str, body: list[ast.stmt] | None = None) -> None:
        hot = self._in_forward() or (body is not None and self._launches_kernel(body))
        self.add(
            "static.try_fallback",
            "error" if hot else "warning",
            node,
            f"Swallows every exception with {what}"
            + (
                " around the kernel call; a failing kernel must fail, not fall back."
                if hot
                else "; errors should surface, not disappear."
            ),
        )

    def visit_Try(self, node: ast.Try) -> None:
        for handler in node.handlers:
            if self._reraises(handler.body):
                continue
            used = self._computes(handler.body)
            if used:
                self.add(
                    "static.try_fallback",
                    "error",
                    handler,
                    f"An except handler computes with {used} instead of re-raising: a failing "
                    "kernel would fall back to PyTorch and still pass.",
                )
            elif self._handler_is_broad(handler) and self._has_call(node.body):
                label = (
                    "a bare except"
                    if handler.type is None
                    else "except " + ast.unparse(handler.type)
                )
                self._report_swallow(handler, label, node.body)
        self.generic_visit(node)

    visit_TryStar = visit_Try  # type: ignore[assignment]

    # ------------------------------------------------------------ finish

    def finish(self) -> None:
        if not self.kernel_evidence:
            self.add(
                "static.no_kernel",
                "warning",
                None,
                "Found no Triton kernel, inline extension or CUDA/HIP source; any speed would come "
                "from PyTorch itself.",
            )


def check_candidate_source(
    source: str,
    filename: str = "candidate.py",
    *,
    reference_names: Iterable[str] = DEFAULT_REFERENCE_NAMES,
    task_modules: Iterable[str] = (),
    allowed_dtypes: Iterable[str] = (),
) -> list[Finding]:
    """All static findings for one candidate's source, ordered by line.

    reference_names: class names of the reference (the task's `Model`).
    task_modules: extra module names the candidate must not import (e.g. the task file's stem).
    allowed_dtypes: canonical dtypes the task itself uses ('bf16', 'fp16', 'fp8'); using them is
        not a precision downgrade (TaskSpec.dtypes gives them).
    """
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        line = exc.lineno
        return [
            Finding(
                check="static.syntax",
                severity="error",
                message=f"The source does not parse: {exc.msg}.",
                where=f"{filename}:{line}" if line else filename,
                line=line,
            )
        ]
    analyzer = _Analyzer(
        tree,
        filename,
        set(reference_names),
        set(DEFAULT_TASK_MODULES) | set(task_modules),
        set(allowed_dtypes),
    )
    analyzer.visit(tree)
    analyzer.finish()
    return sorted(analyzer.findings, key=lambda f: (f.line or 0, f.check))


def check_candidate_file(
    path: str | Path,
    *,
    reference_names: Iterable[str] = DEFAULT_REFERENCE_NAMES,
    task_modules: Iterable[str] = (),
    allowed_dtypes: Iterable[str] = (),
) -> list[Finding]:
    p = Path(path)
    return check_candidate_source(
        p.read_text(encoding="utf-8"),
        str(p),
        reference_names=reference_names,
        task_modules=task_modules,
        allowed_dtypes=allowed_dtypes,
    )


def has_errors(findings: Iterable[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)
