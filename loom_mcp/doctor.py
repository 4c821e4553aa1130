"""`loom-mcp doctor`: what this machine offers, and what will not work here and why."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
from pydantic import BaseModel

from loom_mcp import __version__
from loom_mcp.config import (
    CONFIG_FILE,
    LAST_STARTED,
    LoomConfig,
    file_sha256,
    load_config,
    resolve_home,
)
from loom_mcp.devices import probe_devices
from loom_mcp.devices.toolchain import probe_toolchain
from loom_mcp.dispatch import executor_state
from loom_mcp.errors import LoomError, filesystem_state, storage_hint
from loom_mcp.models import DeviceInfo, ExecutorState, Toolchain
from loom_mcp.sandbox.isolation import isolation_report


class DoctorReport(BaseModel):
    version: str
    home: str
    allowed_roots: list[str]
    devices: list[DeviceInfo]
    backends: dict[str, str]
    toolchain: Toolchain
    executor: ExecutorState | None = None
    isolation: dict[str, str]
    state: dict[str, str] = {}
    limitations: list[str]


def limitations_for(devices: list[DeviceInfo], toolchain: Toolchain, isolation: dict[str, str]) -> list[str]:
    tools = {t.name: t for t in toolchain.tools}

    def have(name: str) -> bool:
        return name in tools and tools[name].found

    found: list[str] = []
    vendors = {d.vendor for d in devices}
    if vendors <= {"cpu"}:
        found.append(
            "no GPU: validation runs on CPU (Triton interpreter); benchmark times are CPU "
            "wall-clock and say so; profilers other than torch are unavailable"
        )
    if toolchain.torch is None:
        found.append(
            "torch not importable by the worker python: run_validation, benchmark and "
            "profile(torch) cannot run (pip install 'loom-mcp[triton]' or use your own build)"
        )
    if toolchain.triton is None:
        found.append("triton not importable: Triton candidates cannot compile or run")
    if not have("nvcc"):
        found.append("nvcc not found: compile_kernel(language='cuda') unavailable")
    if not have("hipcc"):
        found.append("hipcc not found: compile_kernel(language='hip') unavailable")
    if "nvidia" in vendors and not have("ncu"):
        found.append("ncu not found: no kernel-level NVIDIA metrics")
    if "nvidia" in vendors and not have("nsys"):
        found.append("nsys not found: profile(profiler='nsys') unavailable")
    if "amd" in vendors and not have("rocprofv3"):
        found.append("rocprofv3 not found: profile(profiler='rocprofv3') unavailable")
    for key, value in isolation.items():
        if value.startswith("not "):
            found.append(f"sandbox {key}: {value}")
    return found


def state_report(
    home: Path, config: LoomConfig | None, config_error: LoomError | None
) -> tuple[dict[str, str], list[str]]:
    """LOOM_HOME as a server would find it: loom.toml, the ledger, the filesystem. Reads only.
    Returns the entries and the problems among them (each one stops a server from starting, or
    says that a running one is not using the file on disk)."""
    from loom_mcp.store import check_ledger

    state: dict[str, str] = {}
    problems: list[str] = []
    config_file = home / CONFIG_FILE
    if config_error is not None:
        state["loom.toml"] = str(config_error)
        problems.append(f"loom.toml: {config_error}")
    elif not config_file.is_file():
        state["loom.toml"] = "absent: the defaults apply"
    else:
        state["loom.toml"] = (
            f"ok (sha256 {(file_sha256(config_file) or '')[:12]}, rules fingerprint "
            f"{config.fingerprint() if config else '?'})"
        )
    last = home / "cache" / LAST_STARTED
    if last.is_file() and config_file.is_file():
        before, now = file_sha256(last) or "", file_sha256(config_file) or ""
        if before != now:
            note = (
                f"loom.toml changed on disk since the server last started (sha256 {before[:12]} -> "
                f"{now[:12]}); a running server keeps the rules it started with until a human "
                f"restarts it; `diff {last} {config_file}` shows what changed"
            )
            state["loom.toml since the last start"] = note
            problems.append(note)
    ledger = home / "ledger.sqlite3"
    if not ledger.exists():
        state["ledger"] = "none yet: the first server start creates it"
    else:
        try:
            state["ledger"] = f"ok (schema v{check_ledger(ledger)})"
        except LoomError as exc:
            state["ledger"] = str(exc)
            problems.append(f"ledger: {exc}")
        except Exception as exc:  # reported; the doctor goes on
            state["ledger"] = f"could not be checked: {type(exc).__name__}: {exc}"
            problems.append(f"ledger: {state['ledger']}")
    if home.is_dir():
        fs = filesystem_state(home)
        state["filesystem"] = "writable" if fs is None else f"[{fs.value}] {storage_hint(fs, home)}"
        if fs is not None:
            problems.append(f"LOOM_HOME: {state['filesystem']}")
    else:
        state["filesystem"] = "LOOM_HOME does not exist yet: the first server start creates it"
    return state, problems


def sandbox_limits(isolation: dict[str, str], config: LoomConfig) -> dict[str, str]:
    """The probed protections with this config's amounts, and how jobs on this machine see the
    file system (probed by building one job's root, not assumed from the kernel version)."""
    gib = 2**30
    for key, amount in (("memory_limit", config.job_memory_bytes), ("disk_quota", config.job_disk_bytes)):
        if key in isolation:
            isolation[key] = f"{amount / gib:.3g} GiB per job; {isolation[key]}"
    return isolation


async def build_report(home: Path | None) -> DoctorReport:
    resolved = resolve_home(home)
    config_error: LoomError | None = None
    try:
        config: LoomConfig | None = load_config(home)
    except LoomError as exc:
        config_error, config = exc, None
    state, problems = state_report(resolved, config, config_error)
    if config is None:  # report the machine anyway; the server itself would refuse to start
        config = LoomConfig(home=resolved, allowed_roots=[])
    devices, backends = await anyio.to_thread.run_sync(probe_devices)
    toolchain = await probe_toolchain(config.cache_dir / "toolchain.json", max_age_s=0.0)
    isolation = sandbox_limits(dict(await anyio.to_thread.run_sync(isolation_report)), config)
    return DoctorReport(
        version=__version__,
        home=str(config.home),
        allowed_roots=[str(r) for r in config.allowed_roots],
        devices=devices,
        backends=backends,
        toolchain=toolchain,
        executor=await executor_state(config, devices, toolchain),
        isolation=isolation,
        state=state,
        limitations=problems + limitations_for(devices, toolchain, isolation),
    )


def render(report: DoctorReport) -> str:
    lines = [
        f"loom-mcp {report.version}",
        f"home: {report.home}",
        f"allowed roots: {', '.join(report.allowed_roots)}",
        "",
        "devices:",
    ]
    for d in report.devices:
        mem = f"{d.memory_total_bytes / 2**30:.0f} GiB" if d.memory_total_bytes else "? GiB"
        peak = ""
        if d.peak:
            peak = f", peak {d.peak.memory_bandwidth_bytes_s / 1e12:.2f} TB/s"
            if "bf16" in d.peak.flops:
                peak += f", bf16 {d.peak.flops['bf16'] / 1e12:.0f} TFLOP/s"
        lines.append(
            f"  [{d.vendor}:{d.index}] {d.name} ({d.arch or 'arch ?'}), {mem}"
            f"{', driver ' + d.driver_version if d.driver_version else ''}"
            f"{', runtime ' + d.runtime_version if d.runtime_version else ''}{peak}"
        )
    lines.append("backends:")
    lines += [f"  {k}: {v}" for k, v in report.backends.items()]
    tc = report.toolchain
    lines += [
        "toolchain:",
        f"  python {tc.python}",
        f"  torch {tc.torch or 'not found'}"
        + (f" (cuda {tc.torch_cuda})" if tc.torch_cuda else "")
        + (f" (hip {tc.torch_hip})" if tc.torch_hip else ""),
        f"  triton {tc.triton or 'not found'}",
    ]
    if tc.probe_error:
        lines.append(f"  worker probe: {tc.probe_error}")
    for t in tc.tools:
        lines.append(
            f"  {t.name}: {t.version or 'found' if t.found else 'not found'}" + (f" ({t.path})" if t.path else "")
        )
    if report.executor:
        ex = report.executor
        lines.append(f"executor: {ex.kind} on {', '.join(ex.nodes)}")
        lines += [f"  {slot.device}: {'busy' if slot.busy else 'free'}" for slot in ex.slots]
    lines.append("sandbox:")
    lines += [f"  {k}: {v}" for k, v in report.isolation.items()]
    if report.state:
        lines.append("state:")
        lines += [f"  {k}: {v}" for k, v in report.state.items()]
    lines.append("will not work here:" if report.limitations else "everything is available")
    lines += [f"  - {item}" for item in report.limitations]
    return "\n".join(lines)


def run_doctor(home: Path | None, as_json: bool = False) -> int:
    report = anyio.run(build_report, home)
    sys.stdout.write((report.model_dump_json(indent=2) if as_json else render(report)) + "\n")
    # 1 when a server could not start on this LOOM_HOME (a coded problem in `state`).
    return 1 if any(value.startswith("[") for value in report.state.values()) else 0
