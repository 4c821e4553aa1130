"""Helpers shared by the worker processes (they import torch; the server never imports this).

Inputs are generated on the CPU from a seed, so every process that asks for case (shape, seed,
kind) gets the same bits without trusting a file another process could have edited.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from loom_mcp.worker.protocol import mark

mark("torch_imported")

INPUT_KINDS = ("normal", "normal", "heavy_tailed", "scaled_1e-3", "scaled_64")

CANONICAL_DTYPES = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.bool: "bool",
}


def canonical_dtype(dtype: torch.dtype) -> str:
    if dtype in CANONICAL_DTYPES:
        return CANONICAL_DTYPES[dtype]
    if "float8" in str(dtype):
        return "fp8"
    if not dtype.is_floating_point and not dtype.is_complex:
        return "int"
    return str(dtype).replace("torch.", "")


def load_module(path: str | Path, name: str) -> ModuleType:
    """Import a file as a fresh module; its directory goes on sys.path for sibling imports."""
    path = Path(path).resolve()
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def pick_device(requested: str | None = None) -> torch.device:
    if requested and requested != "auto":
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def task_shapes(task: ModuleType) -> list[dict[str, Any]]:
    shapes = getattr(task, "SHAPES", None)
    if not shapes:
        return [{"name": "default"}]
    named = []
    for i, shape in enumerate(shapes):
        shape = dict(shape)
        shape.setdefault("name", f"shape{i}")
        named.append(shape)
    return named


def shape_kwargs(shape: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in shape.items() if k != "name"}


def _call_with_shape(fn, shape: dict[str, Any]):
    kwargs = shape_kwargs(shape)
    params = inspect.signature(fn).parameters
    if not kwargs:
        return fn()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


call_with_shape = _call_with_shape  # the task's get_inputs/get_init_inputs for one shape


def _transform(tensor: torch.Tensor, kind: str, seed: int, generators: dict) -> torch.Tensor:
    """Stress variants of a floating input: tails and scales that expose tolerance games.
    One generator per device and case, drawn from in input order."""
    if not tensor.is_floating_point() or kind == "normal":
        return tensor
    if kind == "heavy_tailed":
        # Log-normal magnitudes: most values stay near 1, a few are 10-100x larger.
        key = str(tensor.device)
        if key not in generators:
            generators[key] = torch.Generator(device=tensor.device).manual_seed(seed ^ 0x5EED)
        generator = generators[key]
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32, device=tensor.device)
        return (tensor.float() * torch.exp(noise * 1.2)).to(tensor.dtype)
    if kind.startswith("scaled_"):
        return (tensor.float() * float(kind.removeprefix("scaled_"))).to(tensor.dtype)
    raise ValueError(f"unknown input kind {kind!r}")


def _generate_inputs(
    task: ModuleType, shape: dict[str, Any], seed: int, device: torch.device | None, host_fallback: bool = True
) -> list:
    torch.manual_seed(seed)
    if device is None or device.type == "cpu":
        return list(_call_with_shape(task.get_inputs, shape))
    try:
        with device:  # factory calls without a device land on the accelerator
            return list(_call_with_shape(task.get_inputs, shape))
    except torch.OutOfMemoryError:
        if not host_fallback:  # drawn on the host they would be other numbers
            raise
        torch.manual_seed(seed)
        return list(_call_with_shape(task.get_inputs, shape))
    except Exception:  # a get_inputs that needs host tensors (.numpy(), ...): make them there
        torch.manual_seed(seed)
        return list(_call_with_shape(task.get_inputs, shape))


def make_case(
    task: ModuleType,
    shape: dict[str, Any],
    seed: int,
    kind: str,
    device: torch.device | None = None,
    host_fallback: bool = True,
    on_device: bool = False,
) -> tuple[list, list]:
    """(inputs, init_inputs) for one case, returned on the CPU, bit-for-bit reproducible from the
    seed on a given kind of device. With an accelerator `device`, the task's random inputs are
    drawn there and copied back: on the H200 host drawing 220 MB of validation inputs on the
    CPU took 4-5 s of the critical path and its threads slowed the candidate's start-up beside it.
    (The same seed draws different numbers on a CPU and on a GPU; each is reproducible.)
    host_fallback: a draw that fails on the device is made on the host instead; off where the
    numbers must match an earlier draw (out of memory then raises). on_device: the inputs stay
    where they were drawn."""
    inputs = _generate_inputs(task, shape, seed, device, host_fallback)
    init_fn = getattr(task, "get_init_inputs", None)
    init_inputs = list(_call_with_shape(init_fn, shape)) if init_fn else []
    on = device if device is not None and device.type != "cpu" else None
    generators: dict[str, torch.Generator] = {}
    # One copy to the host at the end (none with `on_device`): a 6 GiB input went there and back.
    inputs = [
        _transform(x.to(on) if on is not None else x, kind, seed, generators)
        if isinstance(x, torch.Tensor) and x.is_floating_point()
        else x
        for x in inputs
    ]
    if not on_device:
        inputs = [x.cpu() if isinstance(x, torch.Tensor) else x for x in inputs]
    return inputs, init_inputs


def build_model(model_cls, case: dict[str, Any], device: torch.device):
    """Construct a Model/ModelNew for a prepared case: seeded like the reference, then given the
    reference's weights when the parameter names and shapes match (KernelBench relies on the
    seed alone; copying the weights also covers a candidate that creates them in another order)."""
    torch.manual_seed(case["seed"])
    model = model_cls(*case["init_inputs"])
    if isinstance(model, torch.nn.Module):
        state = case.get("state_dict") or {}
        own = model.state_dict()
        if state and set(own) == set(state) and all(own[k].shape == state[k].shape for k in own):
            model.load_state_dict(state)
        model = model.to(device).eval()
    return model


def input_bytes(values: list) -> int:
    """Bytes held by the tensors among `values`."""
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def tensor_digest(values: list | tuple) -> str:
    """Hash of every tensor's bytes, dtype and shape (non-tensors by repr)."""
    h = hashlib.sha256()
    for value in values:
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            # The bytes in place: a copy of a 6 GB input was 6 GB more at the reference's peak.
            h.update(
                memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                if t.numel()
                else b""
            )
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def to_device(values: list, device: torch.device) -> list:
    return [v.to(device) if isinstance(v, torch.Tensor) else v for v in values]


def as_output_list(out: Any) -> list:
    if isinstance(out, (tuple, list)):
        return list(out)
    return [out]


def wait_for_go(path: str | Path, timeout_s: float = 3600.0) -> dict[str, Any]:
    """Block until the orchestrator publishes this step's go-file, check its MAC, return its payload.

    Workers start early so their imports and device setup overlap the previous step. The file
    sits where a candidate running as the same user could write, so it is signed with a token
    that only this process received, in its environment (invisible from another pid namespace).
    """
    import hashlib
    import hmac
    import json
    import os
    import time

    path = Path(path)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go signal at {path}")
        time.sleep(0.01)
    mark(f"go:{path.name}")
    message = json.loads(path.read_text())
    token = os.environ.get("LOOM_GO_SIGNER", "").encode()
    payload = message["payload"].encode()
    expected = hmac.new(token, payload, hashlib.sha256).hexdigest()
    if not token or not hmac.compare_digest(expected, message.get("mac", "")):
        raise PermissionError(f"go signal at {path} is not signed by the server")
    return json.loads(payload)


def user_traceback(exc: BaseException, user_file: str, limit_chars: int = 1500) -> str:
    """The exception with only the frames inside the user's file: what the agent can fix."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == user_file]
    where = "".join(f"  {Path(f.filename).name}:{f.lineno} in {f.name}: {f.line}\n" for f in frames[-5:])
    text = f"{type(exc).__name__}: {exc}\n{where}"
    return text[-limit_chars:]


def apply_task_globals(module: ModuleType, overrides: dict[str, Any] | None, *, strict: bool) -> None:
    """Set module-level names (KernelBench's `batch_size`, `dim`, ...) that get_inputs and
    get_init_inputs read, before either is called. On the task (`strict`) every name must be
    defined already; on a candidate only the names it defines too are set, so a copy of the
    task's code sees the same shapes."""
    for name, value in (overrides or {}).items():
        if hasattr(module, name):
            setattr(module, name, list(value) if isinstance(value, list) else value)
        elif strict:
            raise ValueError(f"task_globals names {name!r}, which the task does not define")


# ---------------------------------------------------------------- threads left running
#
# A thread still running after forward returned can change outputs after they were checked or
# race with the next call. torch.compile leaves threads of its own behind (inductor's compile
# pool, tqdm's monitor): those are the library's and are allowed. Each thread is attributed by
# the code that started it, recorded when it starts (not by its name, which anyone can choose):
# the first frame outside the standard library that called threading.Thread.start. A thread
# whose stack shows candidate code when the check runs is the candidate's whatever started it,
# and one that no wrapper saw start (_thread directly, the original start) counts as the
# candidate's too.

_current_frames = sys._current_frames  # bound before any candidate code can rebind sys's


def _roots_of_code() -> tuple[list[str], list[str], list[str]]:
    """(standard-library directories, installed library code, compiler caches)."""
    import importlib.util
    import os
    import site
    import sysconfig
    import tempfile

    paths = sysconfig.get_paths()
    stdlib = {paths.get("stdlib"), paths.get("platstdlib")}
    libraries = {paths.get("purelib"), paths.get("platlib"), str(Path(__file__).resolve().parents[1])}
    try:
        libraries.update(site.getsitepackages())
    except AttributeError:
        pass
    for package in ("torch", "triton"):  # also where they are a checkout on sys.path
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.origin:
            libraries.add(str(Path(spec.origin).resolve().parents[1]))
    # Where torch.compile and Triton write what they generate; the candidate can write there.
    caches = {os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    caches.add(str(Path(tempfile.gettempdir()) / "torchinductor_"))

    def forms(roots) -> list[str]:
        return sorted({f for r in roots if r for f in (os.path.abspath(r), os.path.realpath(r))})

    return forms(stdlib), forms(libraries), forms(caches)


def code_classifier(candidate_file: str | Path):
    """filename -> "candidate" (its file and directory, the siblings it imports), "library"
    (installed packages; names like "<string>": code torch generates), "stdlib", "generated"
    (compiler caches) or "unknown" (anywhere else: the candidate can write to its job directory
    and its compile cache and import from there). For code objects' co_filename."""
    import os

    stdlib, libraries, caches = _roots_of_code()
    cand = Path(candidate_file)
    cand_files = {os.path.abspath(cand), os.path.realpath(cand)}
    cand_dirs = {os.path.dirname(f) for f in cand_files}
    kinds: dict[str, str] = {}

    def under(path: str, roots) -> bool:
        return any(
            path == r or path.startswith(r.rstrip("/") + "/") or (r.endswith("_") and path.startswith(r)) for r in roots
        )

    # Every import root this process cannot write (the sandbox mounts them read-only) and that
    # holds no candidate file: a distribution's packages may sit apart from torch's (e.g.
    # /usr/lib/python3/dist-packages, where tqdm's monitor thread comes from).
    libraries = libraries + sorted(
        os.path.realpath(p)
        for p in sys.path
        if p
        and os.path.isabs(p)
        and os.path.isdir(p)
        and not os.access(p, os.W_OK)
        and not any(under(d, [os.path.realpath(p), os.path.abspath(p)]) for d in cand_dirs)
    )

    def kind_of(name: str) -> str:
        if name.startswith("<frozen "):
            return "stdlib"
        if not name.startswith("/"):
            return "library"
        path = os.path.normpath(name)
        if path in cand_files:
            return "candidate"
        if under(path, libraries):
            return "library"
        if under(path, stdlib):
            return "stdlib"
        if under(path, cand_dirs):
            return "candidate"
        if under(path, caches):
            return "generated"
        return "unknown"

    def classify(name: str) -> str:
        kind = kinds.get(name)
        if kind is None:
            kind = kinds[name] = kind_of(name)
        return kind

    return classify


def _where(frame) -> str:
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}"


def track_threads(candidate_file: str | Path):
    """Record who starts each thread from now on (wrap threading.Thread.start; call it before
    the candidate is imported) and return `left_running(before)`: the threads running now that
    were not in `before` (a set of thread ids, from `running_thread_ids()`) and are not the
    library's, as dicts {"name", "started_at", "running"}."""
    import threading

    classify = code_classifier(candidate_file)
    original_start = threading.Thread.start
    getframe = sys._getframe
    origins: dict[int, tuple[str, str]] = {}  # thread id -> (kind, where it was started)

    def first_outside_stdlib(frame):
        while frame is not None:
            kind = classify(frame.f_code.co_filename)
            if kind != "stdlib":
                return kind, frame
            frame = frame.f_back
        return "stdlib", None

    def start(self) -> None:
        kind, frame = first_outside_stdlib(getframe(1))
        original_start(self)
        if self.ident is not None:
            origins[self.ident] = (kind, _where(frame) if frame is not None else "the standard library")

    def running_candidate_code(frame) -> str | None:
        while frame is not None:
            if classify(frame.f_code.co_filename) == "candidate":
                return _where(frame)
            frame = frame.f_back
        return None

    def left_running(before: set[int]) -> list[dict[str, str | None]]:
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        found = []
        for ident, frame in _current_frames().items():
            if ident == me or ident in before:
                continue
            kind, started_at = origins.get(ident, ("unknown", None))
            running = running_candidate_code(frame)
            # Only installed code starts threads the candidate is not answerable for (e.g.
            # inductor's compile pool, started by torch.compile); code in a compiler cache or
            # anywhere else the candidate could have written counts as its own.
            if kind in ("library", "stdlib") and running is None:
                continue
            found.append(
                {
                    "name": names.get(ident, f"thread {ident}"),
                    "running": running,
                    "started_at": started_at or "outside threading.Thread.start",
                }
            )
        return found

    threading.Thread.start = start  # type: ignore[method-assign]
    return left_running


def running_thread_ids() -> set[int]:
    return set(_current_frames())
