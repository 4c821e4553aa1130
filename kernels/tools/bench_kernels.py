#!/usr/bin/env python3
"""Kernel roofline table for the built-in GPU kernel tasks (the H200 targets of the kernels issue).

What it measures, on a CUDA (or ROCm) device:

1. Device bandwidth: `dst.copy_(src)` of 2 GiB (read + write bytes counted) and a Triton kernel
   that sums a 2 GiB int32 buffer (bytes read); median of 20 timed runs after warm-up.
2. For each task under kernels/ (a directory with task.py and candidate.py) and each shape in its
   SHAPES: the baseline and the candidate `ModelNew`, L2-cold. R rotating copies of the inputs
   (R x input bytes >= 3 x L2, at most 64 sets and bounded by free memory) go through ONE CUDA
   graph that calls the module once per set; per-call time = replay time / R, median and P10-P90
   over ~30 replays. A module that cannot be captured (host syncs, CPU round trips) is timed
   eagerly over the same sets and its row says `eager`. Derived: effective TB/s from
   `bytes_moved`, % of the copy and read bandwidths, TFLOP/s from `flops`, and the speedup.
   For q4k_gemm, also cuBLAS bf16 `x @ w.T` on weights dequantized once, outside the timing.

`--smoke` runs the same code on the CPU, for checking the script without a GPU: each task's
smallest shape, wall-clock timing, two input sets, a few iterations, Triton under its
interpreter (`TRITON_INTERPRET=1`). Its figures are not device figures.

Usage:
    python kernels/tools/bench_kernels.py                                   # every task and shape
    python kernels/tools/bench_kernels.py --tasks rmsnorm q4k_gemv --shapes decode b8
    python kernels/tools/bench_kernels.py --smoke --out /tmp/bk             # CPU check, < 2 min

Writes bench_kernels.json (rewritten after each row, so a timeout leaves what was measured) and
bench_kernels.md into --out (default $OUT, else the current directory), and prints the markdown.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
KERNELS_DIR = REPO / "kernels"

MIB = 2**20
GIB = 2**30
L2_FALLBACK_BYTES = 60 * MIB  # H200
L2_MULTIPLE = 3  # rotating sets cover at least this many L2s
MAX_SETS = 64
SET_MEMORY_FRACTION = 0.3  # of free device memory, for the rotating input sets
GRAPH_MEMORY_FRACTION = 0.5  # of free device memory, for one arm's outputs and scratch
# Cycles the stream is held before each timed step, so the step's launches are queued when the
# start event fires (about 100 us at H200 clocks), as loom's benchmark worker does.
HOLD_CYCLES = 200_000
# Tasks with a dense cuBLAS reference on pre-dequantized Q4_K weights.
CUBLAS_TASKS = frozenset({"q4k_gemm"})
# Packages only the reference `Model`s use (q4k tasks import gguf at module level). The bench
# never runs a reference, so where one is missing a placeholder stands in for it.
REFERENCE_ONLY_PACKAGES = {"gguf": ("quants",)}
# (BLOCK elements, num_warps) tried for the read-bandwidth kernel; the best is reported.
READ_CONFIGS = ((4096, 4), (8192, 8), (16384, 8))


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Config:
    device: torch.device
    smoke: bool
    warmup: int  # graph replays (or eager passes) before timing
    iters: int  # timed replays (or passes), fewer when one is slow
    min_iters: int  # timed replays however slow one is
    arm_budget_s: float  # rough cap on the timed part of one arm
    max_sets: int
    l2_bytes: int
    bw_bytes: int

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Timing:
    mode: str  # "graph", "eager" (capture failed) or "wall" (smoke, CPU)
    sets: int  # rotating input sets per step
    samples: int
    median_us: float
    p10_us: float
    p90_us: float
    l2_cold: bool  # sets x input bytes >= L2_MULTIPLE x L2
    note: str = ""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--tasks", nargs="+", help="task names (default: all under kernels/)")
    parser.add_argument("--shapes", nargs="+", help="keep shapes whose name contains any of these")
    parser.add_argument(
        "--smoke", action="store_true", help="CPU check: smallest shape, wall clock"
    )
    parser.add_argument("--out", type=Path, help="output directory (default: $OUT or cwd)")
    parser.add_argument("--kernels-dir", type=Path, default=KERNELS_DIR, help="task directories")
    parser.add_argument("--iters", type=int, default=30, help="timed graph replays per arm")
    parser.add_argument("--warmup", type=int, default=5, help="untimed replays per arm")
    parser.add_argument("--max-sets", type=int, default=MAX_SETS, help="rotating input sets cap")
    parser.add_argument("--arm-budget-s", type=float, default=20.0, help="timed seconds per arm")
    parser.add_argument("--bw-gib", type=float, default=2.0, help="bandwidth buffer size, GiB")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth probes")
    return parser.parse_args(argv)


def make_config(args: argparse.Namespace) -> Config:
    if args.smoke:
        return Config(
            device=torch.device("cpu"),
            smoke=True,
            warmup=1,
            iters=3,
            min_iters=1,
            arm_budget_s=5.0,
            max_sets=2,
            l2_bytes=L2_FALLBACK_BYTES,
            bw_bytes=64 * MIB,
        )
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    l2 = int(getattr(props, "L2_cache_size", 0) or L2_FALLBACK_BYTES)
    return Config(
        device=device,
        smoke=False,
        warmup=args.warmup,
        iters=args.iters,
        min_iters=3,
        arm_budget_s=args.arm_budget_s,
        max_sets=args.max_sets,
        l2_bytes=l2,
        bw_bytes=int(args.bw_gib * GIB),
    )


# ----------------------------------------------------------------------------- environment


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        pass
    try:
        return Path("/proc/driver/nvidia/version").read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return None


def environment(cfg: Config) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mode": "smoke (CPU, wall clock)" if cfg.smoke else "gpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version(),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "l2_bytes": cfg.l2_bytes,
    }
    if cfg.gpu:
        props = torch.cuda.get_device_properties(cfg.device)
        meta.update(
            gpu=props.name,
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / GIB, 1),
            driver=driver_version(),
        )
    else:
        meta.update(
            gpu=None,
            cpu=platform.processor() or platform.machine(),
            threads=torch.get_num_threads(),
        )
    return meta


# ----------------------------------------------------------------------------- timing


def synchronize(cfg: Config) -> None:
    if cfg.gpu:
        torch.cuda.synchronize(cfg.device)


def release(cfg: Config) -> None:
    gc.collect()
    if cfg.gpu:
        torch.cuda.synchronize(cfg.device)
        torch.cuda.empty_cache()


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def time_steps(step: Callable[[], object], reps: int, cfg: Config) -> list[float]:
    """Seconds per call of step, reps times: CUDA events on a GPU, the wall clock otherwise."""
    if not cfg.gpu:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return times
    pairs = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(HOLD_CYCLES)
        start.record()
        step()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize(cfg.device)
    return [start.elapsed_time(end) / 1e3 for start, end in pairs]


def timed_reps(step: Callable[[], object], cfg: Config) -> list[float]:
    """Warm up, then as many timed steps as the budget allows (cfg.min_iters to cfg.iters)."""
    estimate = max(time_steps(step, 1, cfg)[0], 1e-9)
    more = min(cfg.warmup - 1, int(cfg.arm_budget_s / 4 // estimate))  # a slow step warms less
    if more > 0:
        estimate = max(min(time_steps(step, more, cfg)), 1e-9)
    reps = int(min(cfg.iters, max(cfg.min_iters, cfg.arm_budget_s // estimate)))
    return time_steps(step, reps, cfg)


def summarize(samples: list[float], mode: str, sets: int, l2_cold: bool, note: str) -> Timing:
    return Timing(
        mode=mode,
        sets=sets,
        samples=len(samples),
        median_us=percentile(samples, 0.5) * 1e6,
        p10_us=percentile(samples, 0.1) * 1e6,
        p90_us=percentile(samples, 0.9) * 1e6,
        l2_cold=l2_cold,
        note=note,
    )


def capture_graph(
    fn: Callable[..., object], sets: list[list[Any]], cfg: Config
) -> tuple[torch.cuda.CUDAGraph | None, list[object], str]:
    """One graph calling fn once per set; (None, [], why) when fn cannot be captured."""
    stream = torch.cuda.Stream(cfg.device)
    stream.wait_stream(torch.cuda.current_stream(cfg.device))
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch's capture rules ask
        for inputs in sets:
            fn(*inputs)
    torch.cuda.current_stream(cfg.device).wait_stream(stream)
    torch.cuda.synchronize(cfg.device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            outputs = [fn(*inputs) for inputs in sets]
    except Exception as exc:
        del graph
        try:
            torch.cuda.synchronize(cfg.device)
        except Exception:
            pass
        return None, [], f"graph capture failed: {type(exc).__name__}: {first_line(exc)}"
    return graph, outputs, ""


def time_module(
    fn: Callable[..., object], sets: list[list[Any]], l2_cold: bool, cfg: Config
) -> Timing:
    """Per-call time of fn over the rotating sets: graph replay, else eager passes."""

    def eager_pass() -> None:
        for inputs in sets:
            fn(*inputs)

    if not cfg.gpu:
        samples = timed_reps(eager_pass, cfg)
        return summarize([t / len(sets) for t in samples], "wall", len(sets), l2_cold, "")
    graph, outputs, note = capture_graph(fn, sets, cfg)
    if graph is None:
        samples = timed_reps(eager_pass, cfg)
        return summarize([t / len(sets) for t in samples], "eager", len(sets), l2_cold, note)
    samples = timed_reps(graph.replay, cfg)
    del graph, outputs
    return summarize([t / len(sets) for t in samples], "graph", len(sets), l2_cold, "")


# ----------------------------------------------------------------------------- device bandwidth

_READ_KERNEL: Any = None


def read_kernel() -> Any:
    """The read-bandwidth kernel: each program sums one BLOCK of int32 into partial[pid]."""
    global _READ_KERNEL, tl
    if _READ_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def sum_blocks_kernel(src_ptr, partial_ptr, BLOCK: tl.constexpr):
            # No mask (the buffer is whole blocks), so the loads are 16-byte vectors.
            pid = tl.program_id(0)
            values = tl.load(src_ptr + pid * BLOCK + tl.arange(0, BLOCK))
            tl.store(partial_ptr + pid, tl.sum(values, axis=0))

        _READ_KERNEL = sum_blocks_kernel
    return _READ_KERNEL


def copy_bandwidth(cfg: Config) -> dict[str, Any]:
    elements = cfg.bw_bytes // 4
    src = torch.ones(elements, dtype=torch.int32, device=cfg.device)
    dst = torch.empty_like(src)

    def step() -> None:
        dst.copy_(src)

    time_steps(step, 3, cfg)
    median = percentile(time_steps(step, 5 if cfg.smoke else 20, cfg), 0.5)
    moved = 2 * elements * 4
    return {"bytes": moved, "median_us": median * 1e6, "tbps": moved / median / 1e12}


def read_bandwidth(cfg: Config) -> dict[str, Any]:
    kernel = read_kernel()
    configs = READ_CONFIGS[:1] if cfg.smoke else READ_CONFIGS
    whole = max(block for block, _ in configs)  # whole blocks for every config
    nbytes = 4 * MIB if cfg.smoke else cfg.bw_bytes  # the interpreter is slow
    elements = max(nbytes // 4 // whole, 1) * whole
    src = torch.ones(elements, dtype=torch.int32, device=cfg.device)
    best: dict[str, Any] | None = None
    for block, warps in configs:
        grid = (elements // block,)
        partial = torch.empty(grid[0], dtype=torch.int32, device=cfg.device)

        def step(
            grid: tuple[int] = grid, block: int = block, warps: int = warps, out: Any = partial
        ) -> None:
            kernel[grid](src, out, BLOCK=block, num_warps=warps)

        time_steps(step, 3, cfg)
        total = int(partial.sum(dtype=torch.int64))
        if total != elements:
            raise RuntimeError(f"read kernel summed {total}, expected {elements}")
        median = percentile(time_steps(step, 5 if cfg.smoke else 20, cfg), 0.5)
        result = {
            "bytes": elements * 4,
            "median_us": median * 1e6,
            "tbps": elements * 4 / median / 1e12,
            "block": block,
            "num_warps": warps,
        }
        if best is None or result["tbps"] > best["tbps"]:
            best = result
    assert best is not None
    return best


def measure_bandwidth(cfg: Config) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, probe in (("copy", copy_bandwidth), ("read", read_bandwidth)):
        try:
            results[name] = probe(cfg)
        except Exception as exc:
            results[name] = {"error": describe(exc)}
        release(cfg)  # the probe's buffers are gone once it returns
        print(f"[bandwidth] {name}: {fmt_bw(results[name])}", flush=True)
    return results


# ----------------------------------------------------------------------------- tasks


@dataclass
class Task:
    name: str
    path: Path
    module: ModuleType


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


def describe(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {first_line(exc)}{where}"


class _Missing:
    """Stands in for a name from a package that is not installed; fails once it is used."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Missing:
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise ModuleNotFoundError(f"{self._name}: not installed (placeholder from bench_kernels)")


def stub_missing_packages() -> list[str]:
    """Placeholders for missing REFERENCE_ONLY_PACKAGES, so task.py files import; their names."""
    stubbed = []
    for package, submodules in REFERENCE_ONLY_PACKAGES.items():
        try:
            importlib.import_module(package)
            continue
        except ImportError:
            pass
        for name in (package, *(f"{package}.{sub}" for sub in submodules)):
            module = ModuleType(name)
            module.__getattr__ = lambda attr, name=name: _Missing(f"{name}.{attr}")  # type: ignore[method-assign]
            sys.modules[name] = module
        stubbed.append(package)
        print(f"[bench_kernels] {package} is not installed: a placeholder stands in", flush=True)
    return stubbed


@contextmanager
def on_sys_path(directory: Path) -> Iterator[None]:
    """The task's directory first on sys.path while its files load, for sibling imports."""
    sys.path.insert(0, str(directory))
    try:
        yield
    finally:
        sys.path.remove(str(directory))


def load_file(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with on_sys_path(path.parent):
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # no half-imported module for the next shape
        raise
    return module


def module_name(task: str, role: str) -> str:
    return f"_bench_kernels_{task}_{role}"


def discover(kernels_dir: Path, wanted: Sequence[str] | None) -> list[str]:
    names = sorted(
        d.name
        for d in kernels_dir.iterdir()
        if (d / "task.py").is_file() and (d / "candidate.py").is_file()
    )
    if not wanted:
        return names
    picked = [n for item in wanted for n in item.split(",") if n]
    missing = [n for n in picked if n not in names]
    if missing:
        print(f"[tasks] not found (need task.py and candidate.py): {missing}", flush=True)
    return [n for n in picked if n in names]


def call_with_shape(fn: Callable[..., Any], shape: dict[str, Any]) -> Any:
    """fn(**shape without its name), keeping only the keywords fn takes unless it has **kwargs."""
    kwargs = {k: v for k, v in shape.items() if k != "name"}
    params = inspect.signature(fn).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        names = {p.name for p in params}
        kwargs = {k: v for k, v in kwargs.items() if k in names}
    return fn(**kwargs)


def shape_figure(task: Task, attr: str, shape: dict[str, Any]) -> float | None:
    fn = getattr(task.module, attr, None)
    return float(call_with_shape(fn, shape)) if callable(fn) else None


def select_shapes(task: Task, filters: Sequence[str] | None, smoke: bool) -> list[dict[str, Any]]:
    shapes = [dict(s) for s in getattr(task.module, "SHAPES", None) or [{"name": "default"}]]
    for i, shape in enumerate(shapes):
        shape.setdefault("name", f"shape{i}")
    if filters:
        subs = [s for item in filters for s in item.split(",") if s]
        shapes = [s for s in shapes if any(sub in s["name"] for sub in subs)]
    if smoke and shapes:

        def size(shape: dict[str, Any]) -> float:
            for attr in ("bytes_moved", "flops"):
                value = shape_figure(task, attr, shape)
                if value is not None:
                    return value
            return 0.0

        shapes = [min(shapes, key=size)]
    return shapes


def tensor_bytes(values: object) -> int:
    if isinstance(values, torch.Tensor):
        return values.numel() * values.element_size()
    if isinstance(values, (list, tuple)):
        return sum(tensor_bytes(v) for v in values)
    if isinstance(values, dict):
        return sum(tensor_bytes(v) for v in values.values())
    return 0


def covers_l2(count: int, set_bytes: int, cfg: Config) -> bool:
    return count * set_bytes >= L2_MULTIPLE * cfg.l2_bytes


def plan_sets(input_bytes: int, cfg: Config) -> int:
    """Rotating sets for inputs of input_bytes: enough to cover L2_MULTIPLE x L2 if they fit."""
    per_set = max(input_bytes, 1)
    count = min(cfg.max_sets, max(2, math.ceil(L2_MULTIPLE * cfg.l2_bytes / per_set)))
    if cfg.gpu:
        free, _ = torch.cuda.mem_get_info(cfg.device)
        count = min(count, max(1, int(SET_MEMORY_FRACTION * free // per_set)))
    return count


def make_sets(base: list[Any], count: int, cfg: Config) -> list[list[Any]]:
    first = [v.to(cfg.device) if isinstance(v, torch.Tensor) else v for v in base]
    sets = [first]
    for _ in range(count - 1):
        sets.append([v.clone() if isinstance(v, torch.Tensor) else v for v in first])
    return sets


def build_model(task: Task, role: str, shape: dict[str, Any], cfg: Config) -> torch.nn.Module:
    name = module_name(task.name, role)
    module = sys.modules.get(name) or load_file(task.path / f"{role}.py", name)  # once per task
    init_fn = getattr(task.module, "get_init_inputs", None)
    init = list(call_with_shape(init_fn, shape)) if init_fn else []
    torch.manual_seed(0)  # the same weights in every arm
    return module.ModelNew(*init).to(cfg.device).eval()


def sets_for_memory(fn: Callable[..., object], sets: list[list[Any]], cfg: Config) -> int:
    """How many sets one arm can use: a graph keeps every call's output and scratch alive."""
    if not cfg.gpu:
        fn(*sets[0])
        return len(sets)
    torch.cuda.synchronize(cfg.device)
    torch.cuda.reset_peak_memory_stats(cfg.device)
    before = torch.cuda.memory_allocated(cfg.device)
    out_bytes = tensor_bytes(fn(*sets[0]))
    torch.cuda.synchronize(cfg.device)
    scratch = torch.cuda.max_memory_allocated(cfg.device) - before
    free, _ = torch.cuda.mem_get_info(cfg.device)
    room = GRAPH_MEMORY_FRACTION * free - scratch
    return max(1, min(len(sets), int(room // max(out_bytes, 1))))


def run_arm(
    factory: Callable[[], Callable[..., object]],
    sets: list[list[Any]],
    set_bytes: int,
    cfg: Config,
) -> dict[str, Any]:
    """{"timing": ...} or {"error": ...} for one module over the rotating sets."""
    fn = None
    try:
        with torch.no_grad():
            fn = factory()
            usable = sets_for_memory(fn, sets, cfg)  # also the first (compiling) call
            cold = covers_l2(usable, set_bytes, cfg)
            timing = time_module(fn, sets[:usable], cold, cfg)
        return {"timing": asdict(timing)}
    except Exception as exc:
        return {"error": describe(exc)}
    finally:
        del fn
        release(cfg)


# ----------------------------------------------------------------------------- cuBLAS reference


class DenseMatmul(torch.nn.Module):
    """cuBLAS on dense weights: y = x @ w.T in x's dtype."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x @ weight.T


def q4k_dequantizer(task: Task, kernels_dir: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    fn = getattr(task.module, "dequantize_q4_k_torch", None)
    if callable(fn):
        return fn
    fmt = load_file(kernels_dir / "q4k" / "format.py", "_bench_kernels_q4k_format")
    return fmt.dequantize_q4_k


def run_cublas(task: Task, base: list[Any], kernels_dir: Path, cfg: Config) -> dict[str, Any]:
    dense: list[Any] = []
    try:
        x, packed = base[0], base[1]
        with torch.no_grad():
            weight = q4k_dequantizer(task, kernels_dir)(packed.to(cfg.device)).to(x.dtype)
        dense = [x, weight.contiguous()]
        del weight
        set_bytes = tensor_bytes(dense)
        sets = make_sets(dense, plan_sets(set_bytes, cfg), cfg)
    except Exception as exc:
        release(cfg)
        return {"error": f"dequantize: {describe(exc)}"}
    result = run_arm(DenseMatmul, sets, set_bytes, cfg)
    del sets, dense
    release(cfg)
    return result


# ----------------------------------------------------------------------------- rows


def derive(row: dict[str, Any], bandwidth: dict[str, Any]) -> None:
    """Effective TB/s, % of device bandwidths, TFLOP/s, speedup and % of cuBLAS, in place."""
    copy_tbps = bandwidth.get("copy", {}).get("tbps")
    read_tbps = bandwidth.get("read", {}).get("tbps")
    for role in ("baseline", "candidate", "cublas"):
        arm = row.get(role)
        if not arm or "timing" not in arm:
            continue
        seconds = arm["timing"]["median_us"] / 1e6
        if row.get("bytes_moved") is not None and role != "cublas":
            arm["tbps"] = row["bytes_moved"] / seconds / 1e12
            if copy_tbps:
                arm["pct_copy_bw"] = 100 * arm["tbps"] / copy_tbps
            if read_tbps:
                arm["pct_read_bw"] = 100 * arm["tbps"] / read_tbps
        if row.get("flops") is not None:
            arm["tflops"] = row["flops"] / seconds / 1e12
    median = {
        role: row[role]["timing"]["median_us"]
        for role in ("baseline", "candidate", "cublas")
        if row.get(role) and "timing" in row[role]
    }
    if "baseline" in median and "candidate" in median:
        row["speedup"] = median["baseline"] / median["candidate"]
    if "cublas" in median and "candidate" in median:
        row["pct_cublas"] = 100 * median["cublas"] / median["candidate"]


def bench_shape(
    task: Task, shape: dict[str, Any], kernels_dir: Path, cfg: Config, bandwidth: dict[str, Any]
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "shape": shape["name"],
        "params": {k: v for k, v in shape.items() if k != "name"},
    }
    try:
        row["bytes_moved"] = shape_figure(task, "bytes_moved", shape)
        row["flops"] = shape_figure(task, "flops", shape)
        torch.manual_seed(0)
        base = list(call_with_shape(task.module.get_inputs, shape))
        row["input_bytes"] = tensor_bytes(base)
        sets = make_sets(base, plan_sets(row["input_bytes"], cfg), cfg)
    except Exception as exc:
        row["error"] = f"inputs: {describe(exc)}"
        release(cfg)
        return row
    for role in ("baseline", "candidate"):
        if not (task.path / f"{role}.py").is_file():
            row[role] = {"error": f"no {role}.py"}
            continue
        row[role] = run_arm(
            lambda role=role: build_model(task, role, shape, cfg), sets, row["input_bytes"], cfg
        )
    del sets
    release(cfg)
    if task.name in CUBLAS_TASKS:
        row["cublas"] = run_cublas(task, base, kernels_dir, cfg)
    derive(row, bandwidth)
    return row


def bench_task(
    name: str,
    args: argparse.Namespace,
    cfg: Config,
    report: dict[str, Any],
    save: Callable[[], None],
) -> None:
    entry: dict[str, Any] = {"rows": []}
    report["tasks"][name] = entry
    try:
        path = args.kernels_dir / name
        task = Task(name, path, load_file(path / "task.py", module_name(name, "task")))
        shapes = select_shapes(task, args.shapes, cfg.smoke)
    except Exception as exc:
        entry["error"] = describe(exc)
        print(f"[{name}] error: {entry['error']}", flush=True)
        save()
        return
    if not shapes:
        print(f"[{name}] no shape matches {args.shapes}", flush=True)
    for shape in shapes:
        t0 = time.perf_counter()
        with on_sys_path(task.path):  # for sibling imports made at call time
            row = bench_shape(task, shape, args.kernels_dir, cfg, report["bandwidth"])
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        entry["rows"].append(row)
        print(progress_line(name, row), flush=True)
        save()


# ----------------------------------------------------------------------------- formatting


def fmt_num(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "–"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1 or value == 0:
        return f"{value:.{digits}f}"
    return f"{value:.3g}"


def fmt_bw(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"error: {result['error']}"
    extra = f", BLOCK={result['block']}, {result['num_warps']} warps" if "block" in result else ""
    size = (
        f"{result['bytes'] / GIB:.2f} GiB"
        if result["bytes"] >= GIB
        else f"{result['bytes'] / MIB:.0f} MiB"
    )
    return f"{fmt_num(result['tbps'], 3)} TB/s ({size} in {fmt_num(result['median_us'])} µs{extra})"


def arm_us(arm: dict[str, Any] | None, spread: bool = False) -> str:
    if not arm:
        return "–"
    if "error" in arm:
        return "error"
    t = arm["timing"]
    text = fmt_num(t["median_us"])
    if spread:
        text += f" [{fmt_num(t['p10_us'])}–{fmt_num(t['p90_us'])}]"
    return text


def mode_cell(row: dict[str, Any]) -> str:
    timings = {
        role: row[role]["timing"]
        for role in ("baseline", "candidate")
        if row.get(role) and "timing" in row[role]
    }
    if not timings:
        return "–"
    labels = {role: f"{t['mode']} ×{t['sets']}" for role, t in timings.items()}
    if len(set(labels.values())) == 1:
        text = next(iter(labels.values()))
    else:
        text = " / ".join(f"{role[:4]} {label}" for role, label in labels.items())
    if not all(t["l2_cold"] for t in timings.values()):
        text += " †"
    return text


def progress_line(task: str, row: dict[str, Any]) -> str:
    if "error" in row:
        return f"[{task}] {row['shape']}: {row['error']}"
    parts = []
    for role in ("baseline", "candidate", "cublas"):
        arm = row.get(role)
        if not arm:
            continue
        if "error" in arm:
            parts.append(f"{role} error: {arm['error']}")
        else:
            t = arm["timing"]
            parts.append(
                f"{role} {fmt_num(t['median_us'])} µs [{fmt_num(t['p10_us'])}–"
                f"{fmt_num(t['p90_us'])}] ({t['mode']} ×{t['sets']})"
            )
    if "speedup" in row:
        parts.append(f"speedup {row['speedup']:.2f}x")
    tbps = row.get("candidate", {}).get("tbps")
    if tbps is not None:
        parts.append(f"{tbps:.3f} TB/s")
    return f"[{task}] {row['shape']}: " + " | ".join(parts) + f" ({row.get('wall_s', 0)} s)"


def task_table(name: str, entry: dict[str, Any]) -> list[str]:
    rows = entry["rows"]
    has_flops = any(r.get("flops") is not None for r in rows)
    cublas = name in CUBLAS_TASKS
    header = ["shape", "baseline µs", "candidate µs [P10–P90]", "speedup", "TB/s", "% copy BW"]
    header += ["% read BW"] + (["TFLOP/s"] if has_flops else [])
    header += (["cuBLAS µs", "cuBLAS TFLOP/s", "% cuBLAS"] if cublas else []) + ["timing"]
    lines = [f"## {name}", ""]
    if "error" in entry:
        return lines + [f"error: {entry['error']}", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    errors = []
    for row in rows:
        cand = row.get("candidate") or {}
        cells = [f"`{row['shape']}`", arm_us(row.get("baseline")), arm_us(cand, spread=True)]
        speedup = row.get("speedup")
        cells += [f"{speedup:.2f}×" if speedup else "–", fmt_num(cand.get("tbps"), 3)]
        cells += [fmt_num(cand.get("pct_copy_bw"), 1), fmt_num(cand.get("pct_read_bw"), 1)]
        if has_flops:
            cells.append(fmt_num(cand.get("tflops"), 3))
        if cublas:
            dense = row.get("cublas") or {}
            cells += [
                arm_us(dense),
                fmt_num(dense.get("tflops")),
                fmt_num(row.get("pct_cublas"), 1),
            ]
        cells.append(mode_cell(row))
        lines.append("| " + " | ".join(cells) + " |")
        errors += row_errors(row)
    return lines + [""] + errors + ([""] if errors else [])


def row_errors(row: dict[str, Any]) -> list[str]:
    found = [f"- `{row['shape']}`: {row['error']}"] if "error" in row else []
    for role in ("baseline", "candidate", "cublas"):
        arm = row.get(role) or {}
        if "error" in arm:
            found.append(f"- `{row['shape']}` {role}: {arm['error']}")
        elif arm.get("timing", {}).get("note"):
            found.append(f"- `{row['shape']}` {role}: {arm['timing']['note']}")
    return found


def markdown(report: dict[str, Any]) -> str:
    meta, bandwidth, smoke = report["meta"], report["bandwidth"], report["config"]["smoke"]
    lines = ["# Kernel roofline (H200 targets)", ""]
    if smoke:
        lines += [
            "**SMOKE RUN: CPU wall clock, Triton interpreter, smallest shape per task, 2 input "
            "sets. These are not device figures; they only show the script works.**",
            "",
        ]
    device = meta.get("gpu") or f"CPU ({meta.get('cpu')}, {meta.get('threads')} threads)"
    if meta.get("gpu"):
        device += f", {meta['sms']} SMs, {meta['memory_gib']} GiB"
    lines += [
        f"- date (UTC): {meta['date_utc']}",
        f"- device: {device}; L2 {meta['l2_bytes'] / MIB:.0f} MiB"
        + (" (assumed)" if smoke else ""),
        f"- driver: {meta.get('driver') or '–'}",
        f"- torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda'] or '–'}"
        + (f", HIP {meta['hip']}" if meta.get("hip") else ""),
    ]
    if meta.get("stubbed_packages"):
        lines.append(
            f"- not installed, placeholders (reference models only): {meta['stubbed_packages']}"
        )
    for name, label in (
        ("copy", "copy bandwidth (D2D, read+write)"),
        ("read", "read bandwidth (Triton sum)"),
    ):
        if name in bandwidth:
            lines.append(f"- {label}: {fmt_bw(bandwidth[name])}")
    lines += [
        "- timing: "
        + (
            "wall clock per call over 2 input sets, no graphs or events."
            if smoke
            else "one CUDA graph calls the module once per rotating input set (sets × input bytes "
            f"≥ {L2_MULTIPLE}× L2); per call = replay / sets, median of up to "
            f"{report['config']['iters']} replays, P10–P90 over replays. `eager`: capture failed, "
            "timed as eager passes over the same sets."
        ),
        "- TB/s = `bytes_moved` / candidate time; % BW against the measured bandwidths above; "
        "† = the rotating sets cover less than "
        f"{L2_MULTIPLE}× L2 (inputs too small for {report['config']['max_sets']} sets): L2-warm.",
        "",
    ]
    for name, entry in report["tasks"].items():
        lines += task_table(name, entry)
    return "\n".join(lines) + "\n"


def write_outputs(report: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "bench_kernels.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(out_dir / "bench_kernels.json")
    (out_dir / "bench_kernels.md").write_text(markdown(report))


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("warning: triton was imported before TRITON_INTERPRET=1 was set", flush=True)
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU
    elif not torch.cuda.is_available():
        print("no CUDA/ROCm device: run with --smoke for the CPU check", file=sys.stderr)
        return 2
    cfg = make_config(args)
    out_dir = args.out or Path(os.environ.get("OUT") or Path.cwd())
    report: dict[str, Any] = {
        "meta": environment(cfg),
        "config": {
            "smoke": cfg.smoke,
            "iters": cfg.iters,
            "warmup": cfg.warmup,
            "max_sets": cfg.max_sets,
            "l2_multiple": L2_MULTIPLE,
            "bw_bytes": cfg.bw_bytes,
        },
        "bandwidth": {},
        "tasks": {},
    }
    print(
        f"[bench_kernels] {report['meta']['mode']} on {report['meta'].get('gpu') or 'CPU'}",
        flush=True,
    )
    report["meta"]["stubbed_packages"] = stub_missing_packages()
    if not args.no_bandwidth:
        report["bandwidth"] = measure_bandwidth(cfg)
    write_outputs(report, out_dir)
    for name in discover(args.kernels_dir, args.tasks):
        bench_task(name, args, cfg, report, lambda: write_outputs(report, out_dir))
    write_outputs(report, out_dir)
    print(flush=True)
    print(markdown(report), flush=True)
    print(
        f"[bench_kernels] wrote {out_dir / 'bench_kernels.json'} and bench_kernels.md", flush=True
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
