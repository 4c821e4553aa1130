"""Compilers, profilers and the Python GPU stack this server can drive, with versions.

torch and triton are never imported here (the server must not import torch): their facts come
from a short-lived worker, ``python -m loom_mcp.worker.probe_torch``, run through the sandbox.
Everything is cached in a JSON file keyed by what would change the answer (interpreter, the
torch/triton install, the tools found on PATH), so a warm device_info only stats files.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.util import find_spec
from pathlib import Path
from typing import Any, cast

import anyio

import loom_mcp
from loom_mcp.models import Toolchain, ToolStatus

TOOLS: tuple[str, ...] = (
    "nvcc", "hipcc", "ncu", "nsys", "rocprofv3", "rocprof", "compute-sanitizer",
    "nvidia-smi", "amd-smi", "rocminfo", "git",
)  # fmt: skip

# How each tool states its version; tools not listed get `<tool> --version`.
_VERSION_ARGS: dict[str, list[str]] = {"amd-smi": ["version"]}
_VERSION_PATTERNS: dict[str, str] = {
    "nvcc": r"\bV(\d+\.\d+\.\d+)",
    "hipcc": r"HIP version:\s*([\w.\-]+)",
    "nvidia-smi": r"NVIDIA-SMI version\s*:\s*([\w.]+)",
    "amd-smi": r"AMDSMI Tool:\s*([\w.+\-]+)",
    "git": r"git version\s+([\w.]+)",
}
_GENERIC_VERSION = re.compile(r"\b(\d+\.\d+(?:\.\d+)*(?:[-+][\w.]+)?)")
VERSION_TIMEOUT_S = 5.0
WORKER_TIMEOUT_S = 120.0  # a cold `import torch` from a slow disk can take tens of seconds
CACHE_SCHEMA = 1


def _extra_dirs() -> list[Path]:
    """Where toolkits install tools that are often not on PATH."""
    dirs = [os.environ.get(var) for var in ("CUDA_HOME", "CUDA_PATH", "ROCM_PATH", "ROCM_HOME")]
    candidates = [Path(d) / "bin" for d in dirs if d]
    candidates += [Path("/usr/local/cuda/bin"), Path("/opt/rocm/bin")]
    return [d for d in candidates if d.is_dir()]


def _locate(tool: str) -> tuple[str | None, str | None]:
    """(path, note): PATH first, then the usual toolkit bin folders."""
    found = shutil.which(tool)
    if found:
        return found, None
    for folder in _extra_dirs():
        candidate = folder / tool
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate), f"not on PATH; found in {folder}"
    return None, None


def parse_version(tool: str, output: str) -> str | None:
    """A short version string from a tool's --version output."""
    pattern = _VERSION_PATTERNS.get(tool)
    if pattern and (m := re.search(pattern, output)):
        return m.group(1)
    # Prefer a line that says "version"; banners often carry copyright years first.
    lines = [line for line in output.splitlines() if "version" in line.lower()] + output.splitlines()
    for line in lines:
        if m := _GENERIC_VERSION.search(line):
            return m.group(1)
    return None


def _status(tool: str) -> ToolStatus:
    path, note = _locate(tool)
    if path is None:
        return ToolStatus(name=tool, found=False)
    argv = [path, *_VERSION_ARGS.get(tool, ["--version"])]
    try:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=VERSION_TIMEOUT_S, errors="replace",
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return ToolStatus(name=tool, found=True, path=path, note=f"`{' '.join(argv[1:])}` timed out")
    except OSError as err:
        return ToolStatus(name=tool, found=True, path=path, note=f"cannot run: {err}")
    version = parse_version(tool, f"{done.stdout}\n{done.stderr}")
    if version is None:
        tail = (done.stdout or done.stderr).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        note = "; ".join(filter(None, [note, f"no version in output: {tail[0][:120]}"]))
    return ToolStatus(name=tool, found=True, version=version, path=path, note=note)


def find_tools() -> list[ToolStatus]:
    """Each of TOOLS: found or not, path and version. Blocking: call it from a thread."""
    with ThreadPoolExecutor(max_workers=len(TOOLS)) as pool:
        return list(pool.map(_status, TOOLS))


# ---------------------------------------------------------------- cache


def _package_stamp(name: str) -> list[Any]:
    """Where a package is installed and when it last changed, without importing it."""
    try:
        spec = find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return [name, None]
    origin = Path(spec.origin)
    stamps: list[int | None] = []
    for path in (origin, origin.parent, origin.parent / "version.py"):
        try:
            stamps.append(path.stat().st_mtime_ns)
        except OSError:
            stamps.append(None)
    return [name, str(origin), *stamps]


def cache_key() -> list[Any]:
    """Everything whose change should re-probe. Only stats files: no process is started."""
    tools = []
    for tool in TOOLS:
        path, _ = _locate(tool)
        try:
            mtime = Path(path).stat().st_mtime_ns if path else None
        except OSError:
            mtime = None
        tools.append([tool, path, mtime])
    return [
        CACHE_SCHEMA, sys.executable, platform.python_version(), loom_mcp.__version__,
        _package_stamp("torch"), _package_stamp("triton"), tools,
    ]  # fmt: skip


def _read_cache(path: Path, key: list[Any], max_age_s: float) -> Toolchain | None:
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key or time.time() - float(data["written_at"]) > max_age_s:
            return None
        return Toolchain.model_validate(data["toolchain"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing, stale, or written by another version: probe again


def _write_cache(path: Path, key: list[Any], toolchain: Toolchain) -> None:
    payload = {"key": key, "written_at": time.time(), "toolchain": toolchain.model_dump(mode="json")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".toolchain-", suffix=".json")
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass  # a read-only cache dir only costs speed


# ---------------------------------------------------------------- torch worker


async def _probe_torch() -> tuple[dict[str, Any] | None, str | None]:
    """(facts, error). facts is what the worker sent; error says why there are none."""
    try:
        from loom_mcp.sandbox import JobSpec, run_job
    except ImportError as err:
        return None, f"sandbox unavailable: {err}"
    job_dir = Path(tempfile.mkdtemp(prefix="loom-probe-torch-"))
    try:
        spec = JobSpec(
            argv=[sys.executable, "-m", "loom_mcp.worker.probe_torch"],
            job_dir=job_dir,
            timeout_s=WORKER_TIMEOUT_S,
            request=None,
        )
        result = await run_job(spec)
    except Exception as err:
        return None, f"torch probe worker failed to run: {type(err).__name__}: {err}"
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
    if not getattr(result, "ok", False) or not isinstance(getattr(result, "result", None), dict):
        tail = (getattr(result, "stderr_tail", "") or "").strip().splitlines()[-3:]
        return None, "torch probe worker failed" + (f": {' | '.join(tail)}" if tail else "")
    return cast("dict[str, Any]", result.result), None  # a dict: checked just above


def _toolchain(facts: dict[str, Any] | None, error: str | None, tools: list[ToolStatus]) -> Toolchain:
    facts = facts or {}
    # A missing or broken torch is a fact about this machine, not a failed probe, but it is the
    # one thing the agent must hear about, so it travels in probe_error too.
    torch_error = facts.get("torch_error")
    return Toolchain(
        python=platform.python_version(),
        loom_mcp=loom_mcp.__version__,
        torch=facts.get("torch"),
        torch_cuda=facts.get("torch_cuda"),
        torch_hip=facts.get("torch_hip"),
        triton=facts.get("triton"),
        torch_devices=list(facts.get("torch_devices") or []),
        tools=tools,
        probe_error=error or (f"torch not usable: {torch_error}" if torch_error else None),
    )


async def probe_toolchain(cache_path: Path | None = None, max_age_s: float = 3600) -> Toolchain:
    """Versions of Python, torch, triton (from a worker) and the command-line tools.

    With ``cache_path`` a result younger than ``max_age_s`` whose key still matches is returned
    without starting any process; ``max_age_s=0`` forces a fresh probe. A failed worker run is
    never cached, so the next call tries again.
    """
    key = await anyio.to_thread.run_sync(cache_key) if cache_path else None
    if cache_path and key is not None and max_age_s > 0:
        cached = _read_cache(cache_path, key, max_age_s)
        if cached is not None:
            return cached

    outcome: dict[str, Any] = {}

    async def tools() -> None:
        outcome["tools"] = await anyio.to_thread.run_sync(find_tools)

    async def torch() -> None:
        outcome["torch"] = await _probe_torch()

    async with anyio.create_task_group() as group:
        group.start_soon(tools)
        group.start_soon(torch)
    facts, error = outcome["torch"]
    toolchain = _toolchain(facts, error, outcome["tools"])
    if cache_path and key is not None and error is None:
        await anyio.to_thread.run_sync(_write_cache, cache_path, key, toolchain)
    return toolchain
