"""The static checks as data: the names and patterns each family looks for, and the finding
(check, severity, message) each match produces. The handler modules hold only the logic."""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

Severity = Literal["error", "warning"]


class Rule(NamedTuple):
    """One kind of finding; `message` is a str.format template whose fields the handler fills."""

    check: str
    severity: Severity
    message: str


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

# The tables below stay packed, several names a line, so that all of them fit in one module.
# fmt: off

SYNTAX = Rule("static.syntax", "error", "The source does not parse: {msg}.")

# ---------------------------------------------------------------- reference and grader

DEFAULT_REFERENCE_NAMES: tuple[str, ...] = ("Model",)
# Module names a candidate has no reason to import: where harnesses keep the reference.
DEFAULT_TASK_MODULES: tuple[str, ...] = ("reference", "ref", "task", "problem", "loom_task")

INTROSPECTION_CALLS = frozenset({
    "inspect.stack", "inspect.currentframe", "inspect.getouterframes", "inspect.getinnerframes",
    "inspect.trace", "inspect.getframeinfo", "inspect.getsource", "inspect.getsourcefile",
    "inspect.getmembers", "sys._getframe", "sys._current_frames", "sys.settrace",
    "sys.setprofile", "sys.exc_info", "threading.settrace", "gc.get_objects", "gc.get_referrers",
    "gc.get_referents", "traceback.extract_stack", "traceback.walk_stack",
    "traceback.format_stack", "traceback.print_stack", "builtins.globals",
})
INTROSPECTION_ATTRS = frozenset({
    "f_back", "f_locals", "f_globals", "f_builtins", "f_code", "tb_frame", "tb_next", "gi_frame",
    "cr_frame", "ag_frame", "__globals__", "__subclasses__", "__closure__",
})

REFERENCE_NAME = Rule("static.reference_use", "error", "Uses {name}, the reference implementation; "
                      "the candidate must compute the result itself.")
REFERENCE_IMPORT = Rule("static.reference_use", "error", "Imports {name} from {module}; the "
                        "reference must not be used by the candidate.")
RELATIVE_IMPORT = Rule("static.reference_use", "error", "Uses a relative import; a candidate "
                       "stands alone and must not reach the task's package.")
TASK_IMPORT = Rule("static.reference_use", "error",
                   "Imports {name}, the task's module; a candidate stands alone.")
MAIN_IMPORT = Rule("static.grader_introspection", "error",
                   "Imports {name}, the harness's main module; a candidate stands alone.")
INTROSPECTION_CALL = Rule("static.grader_introspection", "error", "Calls {name}(), which can "
                          "reach the grader's frames, objects or reference outputs.")
INTROSPECTION_ATTR = Rule("static.grader_introspection", "error",
                          "Reads .{name}, which walks frames, closures or classes to reach the grader.")
SYS_MODULES = Rule("static.grader_introspection", "error",
                   "Reads sys.modules, where the harness's and the task's modules live.")

# ---------------------------------------------------------------- monkeypatching

# Patching anything under these roots is how timers, syncs and comparisons get faked.
GUARDED_ROOTS = frozenset({
    "torch", "triton", "time", "timeit", "builtins", "sys", "gc", "numpy", "inspect", "random",
    "importlib",
})
# Honest global switches: assigning them is configuration, not patching (precision flags among
# them are reported as precision warnings instead).
CONFIG_PREFIXES = (
    "torch.backends.", "torch._dynamo.config.", "torch._inductor.config.",
    "torch._functorch.config.",
)
# Attributes whose replacement fakes timing or comparison, whatever object they hang on.
SENSITIVE_ATTRS = frozenset({
    "elapsed_time", "synchronize", "record", "query", "perf_counter", "perf_counter_ns",
    "monotonic", "monotonic_ns", "process_time", "time_ns", "do_bench", "do_bench_cudagraph",
    "allclose", "isclose", "equal", "assert_close", "assert_allclose", "__eq__", "__ne__",
    "__class__", "__code__",
})

GUARDED_STORE = Rule("static.monkeypatch", "error", "{verb} {target}, patching {root}; timers, "
                     "syncs and library functions must stay as the harness expects.")
SENSITIVE_STORE = Rule("static.monkeypatch", "error",
                       "{verb} {target}, replacing a timing or comparison method.")
MODULE_NAMESPACE_STORE = Rule("static.monkeypatch", "error",
                              "{verb} {target}, rewriting a module's namespace.")
OBJECT_NAMESPACE_STORE = Rule("static.monkeypatch", "error",
                              "{verb} {target}, rewriting an object's namespace.")
GUARDED_SETATTR = Rule("static.monkeypatch", "error", "Calls {how} on {base}, patching {root}.")
SENSITIVE_SETATTR = Rule("static.monkeypatch", "error",
                         "Calls {how} for {attr!r}, replacing a timing or comparison method.")
ATEN_OVERRIDE = Rule("static.monkeypatch", "error", "Registers an implementation for an aten "
                     "operator, replacing what the reference and harness run.")
BUILTINS_NAME = Rule("static.monkeypatch", "error",
                     "Touches __builtins__, which can rewrite any built-in the harness relies on.")

# ---------------------------------------------------------------- work that escapes the timer

THREAD_MODULES = (
    "threading", "_thread", "multiprocessing", "concurrent.futures", "asyncio", "subprocess",
    "torch.multiprocessing", "pty",
    # Code that runs later, at a moment the candidate does not control but can aim: a timer
    # signal, interpreter exit, an event scheduler. Work deferred that way can land while the
    # other arm is being timed.
    "signal", "atexit", "sched",
)
# Calls that register code to run later (object finalization, GC callbacks).
DEFERRED_CALLS = frozenset({"weakref.finalize", "gc.callbacks.append", "sys.addaudithook"})
PROCESS_CALLS = frozenset({
    "os.fork", "os.forkpty", "os.system", "os.popen", "os.posix_spawn", "os.posix_spawnp",
    "os.startfile", "os.register_at_fork",
})
PROCESS_CALL_PREFIXES = ("os.spawn", "os.exec")

STREAM_CALLS = frozenset({
    "torch.cuda.Stream", "torch.cuda.stream", "torch.cuda.ExternalStream", "torch.cuda.set_stream",
    "torch.cuda.StreamContext", "torch.cuda.streams.Stream", "torch.cuda.streams.ExternalStream",
    "torch.Stream", "torch.xpu.Stream", "torch.cuda.Stream.__new__",
})
BENIGN_STREAM_SUFFIXES = ("current_stream", "default_stream", "current_device_stream")

SUBCLASS_HOOKS = frozenset({"__torch_function__", "__torch_dispatch__", "_make_subclass"})
TENSOR_BASES = frozenset({
    "torch.Tensor", "torch.nn.Parameter", "torch.nn.parameter.Parameter", "torch._C._TensorBase",
    "torch._C.TensorBase", "torch.tensor._TensorBase",
})
DISPATCH_MODULES = ("torch.utils._python_dispatch", "torch.overrides", "torch._subclasses")

THREAD_IMPORT = Rule("static.threads", "error", "Imports {name}; background threads or processes "
                     "can finish work after the timer stops.")
PROCESS_IMPORT = Rule("static.threads", "error", "Imports {name}, which starts processes.")
PROCESS_CALL = Rule("static.threads", "error", "Calls {name}, which starts a process.")
DEFERRED_CALL = Rule("static.threads", "error",
                     "Calls {name}, which registers code to run later, outside the timed call.")
DEL_METHOD = Rule("static.threads", "error", "Defines __del__, which runs when the garbage "
                  "collector decides: work can land after the timer stops or while the other arm "
                  "is timed.")
STREAM_CALL = Rule("static.extra_stream", "error", "Calls {name}; work on another stream escapes "
                   "the timer and the output checks.")
STREAM_ARG = Rule("static.extra_stream", "error",
                  "Passes stream={value}; kernels must run on the current stream.")
DISPATCH_IMPORT = Rule("static.tensor_subclass", "error",
                       "Imports {name}, the machinery of tensor subclasses and dispatch modes.")
SUBCLASS_HOOK_DEF = Rule("static.tensor_subclass", "error", "Defines {name}, which lets a tensor "
                         "defer or fake work outside the timed call.")
SUBCLASS_HOOK_USE = Rule("static.tensor_subclass", "error",
                         "Uses {name}, the hook of tensor subclasses that can defer or fake work.")
SUBCLASS_HOOK_NAMED = Rule("static.tensor_subclass", "error",
                           "Names {name}, the hook of tensor subclasses that can defer or fake work.")
TENSOR_SUBCLASS = Rule("static.tensor_subclass", "error", "Class {name} subclasses {base}; "
                       "outputs must be plain tensors that did their work inside the call.")
AS_SUBCLASS = Rule("static.tensor_subclass", "error",
                   "Calls .as_subclass(), which turns an output into a tensor subclass.")

# ---------------------------------------------------------------- files, native code, hidden code

CTYPES_MODULES = ("ctypes", "_ctypes", "cffi")
IO_MODULES = (
    "socket", "ssl", "urllib", "http", "requests", "httpx", "aiohttp", "ftplib", "smtplib",
    "xmlrpc", "websocket", "websockets", "paramiko", "pickle", "_pickle", "cPickle", "dill",
    "cloudpickle", "joblib", "shelve", "marshal", "dbm", "sqlite3", "mmap",
)
IO_CALLS = frozenset({
    "builtins.open", "io.open", "io.FileIO", "os.open", "os.read", "os.write", "os.listdir",
    "os.scandir", "os.walk", "os.remove", "os.unlink", "os.rename", "os.replace", "os.mkfifo",
    "os.fdopen", "os.pipe", "glob.glob", "glob.iglob", "torch.save", "torch.load",
    "torch.from_file", "torch.UntypedStorage.from_file", "torch.TypedStorage.from_file",
    "numpy.save", "numpy.savez", "numpy.savez_compressed", "numpy.load", "numpy.memmap",
    "numpy.fromfile", "numpy.savetxt", "numpy.loadtxt", "numpy.genfromtxt",
})
IO_WARNING_CALLS = frozenset({"os.makedirs", "os.mkdir"})
IO_WARNING_PREFIXES = ("tempfile.", "shutil.")
PATH_IO_METHODS = frozenset({
    "open", "read_text", "read_bytes", "write_text", "write_bytes", "touch", "unlink", "iterdir",
})
IO_PATH_MARKERS = ("/dev/shm", "/proc/", "/dev/mem")

DYNAMIC_CALLS = frozenset({
    "builtins.exec", "builtins.eval", "builtins.compile", "builtins.__import__",
    "importlib.import_module", "importlib.__import__", "importlib.reload",
    "importlib.util.spec_from_file_location", "importlib.util.spec_from_loader",
    "importlib.util.module_from_spec", "importlib.machinery.SourceFileLoader", "runpy.run_path",
    "runpy.run_module", "types.FunctionType", "types.CodeType", "types.ModuleType",
})
DYNAMIC_MODULES = ("runpy", "code", "codeop")

CTYPES_IMPORT = Rule("static.ctypes", "error", "Imports {name}, which reaches native code and "
                     "memory outside the checked paths.")
IO_IMPORT = Rule("static.io", "error",
                 "Imports {name}; a kernel needs no files, network or serialized caches.")
IO_CALL = Rule("static.io", "error", "Calls {name}(); a kernel needs no files, and files can "
               "carry results between runs.")
IO_WARNING_CALL = Rule("static.io", "warning",
                       "Calls {name}; fine for a build directory, never for storing results.")
PATH_IO = Rule("static.io", "error", "Calls Path.{name}(); a kernel needs no files.")
TOFILE = Rule("static.io", "error", "Calls .tofile(), writing tensor data to disk.")
IO_PATH = Rule("static.io", "error",
               "Refers to {name}, a place to stash or read results outside the process.")
DYNAMIC_IMPORT = Rule("static.dynamic_code", "error",
                      "Imports {name}, which runs code these checks cannot read.")
DYNAMIC_CALL = Rule("static.dynamic_code", "error",
                    "Calls {name}(), which runs code these checks cannot read.")
COMPUTED_GETATTR = Rule("static.dynamic_code", "warning", "Looks up an attribute of {name} by a "
                        "computed name, which hides what is used.")

# Each import family: the modules (and everything under them) and what importing one means.
MODULE_RULES: tuple[tuple[tuple[str, ...], Rule], ...] = (
    (THREAD_MODULES, THREAD_IMPORT),
    (CTYPES_MODULES, CTYPES_IMPORT),
    (IO_MODULES, IO_IMPORT),
    (DISPATCH_MODULES, DISPATCH_IMPORT),
    (DYNAMIC_MODULES, DYNAMIC_IMPORT),
)

# ---------------------------------------------------------------- result caches and fallbacks

# Calls whose value identifies a tensor by address or content: keys of result caches.
IDENTITY_METHODS = frozenset({"data_ptr", "tobytes", "_cdata", "__array_interface__"})
IDENTITY_ATTRS = ("_cdata", "__array_interface__")
# Dict methods whose first argument is a lookup key.
KEY_METHODS = ("get", "setdefault", "pop", "__contains__", "__getitem__")
CACHE_DECORATORS = ("functools.lru_cache", "functools.cache")

# torch calls a handler may make without computing a fallback result.
NON_COMPUTE_TORCH = frozenset({
    "torch.cuda.synchronize", "torch.cuda.empty_cache", "torch.cuda.is_available",
    "torch.cuda.get_device_name", "torch.cuda.get_device_capability", "torch.cuda.device_count",
    "torch.cuda.current_device", "torch.is_tensor", "torch.get_default_dtype",
})
# Tensor methods that compute: a handler calling them on anything is a PyTorch fallback.
TENSOR_COMPUTE_METHODS = frozenset({
    "matmul", "mm", "bmm", "addmm", "softmax", "log_softmax", "sum", "mean", "exp", "relu",
    "sigmoid", "tanh", "norm", "conv2d", "forward", "__call__", "pow", "sqrt", "rsqrt", "max",
    "min", "cumsum", "layer_norm", "mul", "add", "div",
})

POINTER_KEY = Rule("static.pointer_cache", "error", "Uses {key} as a lookup key, built from "
                   "tensor addresses, ids or bytes: a result cache that skips the work on "
                   "repeated inputs.")
CACHED_FORWARD = Rule("static.pointer_cache", "error",
                      "Caches the results of {name}, so repeated calls skip the work.")
HANDLER_FALLBACK = Rule("static.try_fallback", "error", "An except handler computes with {name} "
                        "instead of re-raising: a failing kernel would fall back to PyTorch and "
                        "still pass.")
SWALLOW_AROUND_KERNEL = Rule("static.try_fallback", "error", "Swallows every exception with "
                             "{what} around the kernel call; a failing kernel must fail, not fall "
                             "back.")
SWALLOW = Rule("static.try_fallback", "warning",
               "Swallows every exception with {what}; errors should surface, not disappear.")
SUPPRESS_ERRORS = Rule("static.try_fallback", "warning",
                       "Sets torch._dynamo suppress_errors, which silently falls back to eager.")

# ---------------------------------------------------------------- precision and RNG state

PRECISION_FLAGS = frozenset({
    "allow_tf32", "allow_fp16_reduced_precision_reduction",
    "allow_bf16_reduced_precision_reduction",
})
# Lower-precision dtypes -> canonical name. A dtype the task itself uses is not a downgrade.
LOW_DTYPES: dict[str, str] = {
    "torch.float16": "fp16", "torch.half": "fp16", "torch.bfloat16": "bf16",
    "torch.float8_e4m3fn": "fp8", "torch.float8_e4m3fnuz": "fp8", "torch.float8_e5m2": "fp8",
    "torch.float8_e5m2fnuz": "fp8", "torch.float8_e8m0fnu": "fp8",
    "triton.language.float16": "fp16", "triton.language.bfloat16": "bf16",
    "triton.language.float8e4nv": "fp8", "triton.language.float8e5": "fp8",
    "triton.language.float8e4b15": "fp8", "triton.language.float8e4b8": "fp8",
    "triton.language.float8e5b16": "fp8",
}
LOW_PRECISION_METHODS: dict[str, str] = {"half": "fp16", "bfloat16": "bf16"}
AUTOCAST_CALLS = frozenset({
    "torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "torch.cpu.amp.autocast",
})
SEED_CALLS = frozenset({
    "torch.manual_seed", "torch.seed", "torch.initial_seed", "torch.random.manual_seed",
    "torch.random.seed", "torch.set_rng_state", "torch.get_rng_state", "torch.cuda.manual_seed",
    "torch.cuda.manual_seed_all", "torch.cuda.set_rng_state", "torch.cuda.get_rng_state",
    "torch.cuda.initial_seed", "random.seed", "random.setstate", "numpy.random.seed",
    "numpy.random.set_state",
})

PRECISION_FLAG = Rule("static.precision_downgrade", "warning",
                      "Sets {target}; TF32/reduced-precision math fails fp32 tolerances.")
LOW_DTYPE = Rule("static.precision_downgrade", "warning",
                 "Uses {name}; computing below the task's precision fails fp32 tolerances.")
LOW_PRECISION_METHOD = Rule("static.precision_downgrade", "warning",
                            "Calls .{name}(); computing below the task's precision fails fp32 "
                            "tolerances.")
MATMUL_PRECISION = Rule("static.precision_downgrade", "warning", "Lowers float32 matmul "
                        "precision (TF32 or bf16), which fails fp32 tolerances.")
AUTOCAST = Rule("static.precision_downgrade", "warning",
                "Uses {name}, which runs ops in lower precision.")
TF32_ARG = Rule("static.precision_downgrade", "warning",
                "Passes {arg}={value}: TF32 math fails fp32 tolerances.")
SEED_CALL = Rule("static.seed", "warning", "Calls {name}(); a candidate has no use for RNG "
                 "state, which can be used to predict inputs.")

# ---------------------------------------------------------------- kernels and native sources

# Calls that prove the candidate brings its own kernel (for static.no_kernel).
KERNEL_MARKERS = (
    "triton.jit", "triton.autotune", "triton.heuristics", "triton.language",
    "torch.utils.cpp_extension.load_inline", "torch.utils.cpp_extension.load",
    "torch.cuda.jiterator", "cupy.RawKernel", "cupy.RawModule", "numba.cuda.jit", "cutlass",
    "tilelang", "helion",
)
NO_KERNEL = Rule("static.no_kernel", "warning", "Found no Triton kernel, inline extension or "
                 "CUDA/HIP source; any speed would come from PyTorch itself.")

# A string constant that looks like C++/CUDA/HIP source is scanned with the patterns below.
NATIVE_SOURCE = re.compile(r"__global__|#include|torch::|at::|\bextern\s+\"C\"")
# Inline C++/CUDA/HIP source: a token and the finding it makes ({token} is what matched).
NATIVE_PATTERNS: tuple[tuple[re.Pattern[str], Rule], ...] = (
    (re.compile(r"\b(cuda|hip)StreamCreate\w*|\bgetStreamFromPool\b|\bcudaStreamPerThread\b"),
     Rule("static.extra_stream", "error", "Inline native source uses {token}: creates or uses a "
          "non-current stream, whose work escapes the timer.")),
    (re.compile(r"\bsetCurrent(CUDA|HIP)Stream\b"),
     Rule("static.extra_stream", "error", "Inline native source uses {token}: switches the "
          "current stream, whose work escapes the timer.")),
    (re.compile(r"\bstd::thread\b|\bpthread_create\b|\bstd::async\b|#include\s*<thread>"),
     Rule("static.threads", "error", "Inline native source uses {token}: starts a host thread, "
          "which can finish work after the timer stops.")),
    (re.compile(r"\bfork\s*\(|\bpopen\s*\(|\bsystem\s*\("),
     Rule("static.threads", "error",
          "Inline native source uses {token}: starts a process from native code.")),
    (re.compile(r"\bfopen\s*\(|std::[io]?fstream|\bshm_open\b|/dev/shm|\bsocket\s*\("),
     Rule("static.io", "error", "Inline native source uses {token}: reads or writes files, "
          "shared memory or sockets from native code.")),
    (re.compile(r"\bdlopen\b|\bdlsym\b|LD_PRELOAD"),
     Rule("static.ctypes", "error",
          "Inline native source uses {token}: loads or interposes native symbols.")),
    (re.compile(r"\b(cuda|hip|cu)EventElapsedTime\b|\bcudaEventRecord\b|\bhipEventRecord\b"),
     Rule("static.monkeypatch", "error", "Inline native source uses {token}: touches timing "
          "events, which only the harness may do.")),
    (re.compile(r"__float2half|__float2bfloat16|precision::tf32|CUBLAS_TF32|COMPUTE_32F_FAST"),
     Rule("static.precision_downgrade", "warning", "Inline native source uses {token}: computes "
          "in a lower precision than fp32.")),
)
# A static map whose key type (within this many characters) is a pointer caches results.
STATIC_MAP = re.compile(r"static\s+(?:std::)?(?:unordered_)?map\s*<")
POINTER_KEY_TYPE = re.compile(r"data_ptr|void\s*\*|uintptr_t|intptr_t")
STATIC_MAP_WINDOW = 200
STATIC_POINTER_MAP = Rule("static.pointer_cache", "error", "Inline native source keeps a static "
                          "map keyed by pointers: results cached across calls.")

# fmt: on
