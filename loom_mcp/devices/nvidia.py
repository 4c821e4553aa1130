"""NVIDIA GPUs through NVML (package nvidia-ml-py, module pynvml), imported lazily.

NVML is initialised once and kept for the life of the process (devices/session.py).
Indices are NVML's, which ignore CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar, cast

from loom_mcp.devices.session import LibrarySession
from loom_mcp.models import DeviceInfo, ThrottleState

_T = TypeVar("_T")

# NVML clock-event reason bits (nvml.h). THROTTLING_REASONS mean the clocks are held down by
# something a benchmark must not average over (heat, a hardware slowdown signal, a power brake).
# sw_power_cap is deliberately informational: it is the steady state of any compute-bound kernel
# (a bf16 matmul on our H200 sat at 690-700 W and 1410-1485 MHz with only this bit set), the
# interleaved baseline and candidate share it, and the sampled clocks already say how far down.
THROTTLING_REASONS: dict[int, str] = {
    0x8: "hw_slowdown",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x200: "board_limit",
    0x400: "reliability",
}
INFO_REASONS: dict[int, str] = {
    0x4: "sw_power_cap",
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x10: "sync_boost",
    0x100: "display_clock_setting",
}

# FP32 cores per SM by compute capability: NVML gives the core count of a whole GPU, but the SM
# count only for MIG instances (nvmlDeviceGetAttributes is NOT_SUPPORTED on a full H200).
_CORES_PER_SM: dict[tuple[int, int], int] = {
    (7, 0): 64, (7, 2): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128,
    (9, 0): 128, (10, 0): 128, (10, 3): 128, (11, 0): 128, (12, 0): 128, (12, 1): 128,
}  # fmt: skip


def _reason(pynvml: ModuleType, err: Exception) -> str:
    value = getattr(err, "value", None)
    known = {
        getattr(
            pynvml, "NVML_ERROR_LIBRARY_NOT_FOUND", -1
        ): "NVML: libnvidia-ml not found (no NVIDIA driver installed)",
        getattr(pynvml, "NVML_ERROR_DRIVER_NOT_LOADED", -1): "NVML: driver not loaded",
        getattr(pynvml, "NVML_ERROR_NO_PERMISSION", -1): "NVML: no permission to query the driver",
        getattr(
            pynvml, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", -1
        ): "NVML: driver/library version mismatch (reboot or reload the driver)",
    }
    return known.get(value, f"NVML: {err}")


def _open_nvml() -> tuple[ModuleType | None, str]:
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py not installed"
    try:
        pynvml.nvmlInit()
    except Exception as err:  # NVMLError subclasses, or OSError from a broken library
        return None, _reason(pynvml, err)
    return pynvml, "ok"


_session = LibrarySession(_open_nvml)  # the initialised pynvml module, or None and why not


def _opt(fn: Callable[..., _T], *args: Any) -> _T | None:
    """One NVML query; None when this GPU or driver does not support it."""
    try:
        return fn(*args)
    except Exception:
        return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def decode_reasons(mask: int) -> ThrottleState:
    reasons = [name for bit, name in THROTTLING_REASONS.items() if mask & bit]
    active = bool(reasons)
    reasons += [name for bit, name in INFO_REASONS.items() if mask & bit]
    return ThrottleState(active=active, reasons=reasons)


def _throttle(pynvml: ModuleType, handle: Any) -> ThrottleState | None:
    getter = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
    )
    mask = _opt(getter, handle) if getter else None
    return decode_reasons(int(mask)) if mask is not None else None


def _cuda_version(pynvml: ModuleType) -> str | None:
    getter = getattr(pynvml, "nvmlSystemGetCudaDriverVersion_v2", None) or pynvml.nvmlSystemGetCudaDriverVersion
    raw = _opt(getter)
    return f"{raw // 1000}.{(raw % 1000) // 10}" if isinstance(raw, int) and raw > 0 else None


def _sm_count(pynvml: ModuleType, handle: Any, capability: tuple[int, int] | None) -> int | None:
    for name in ("nvmlDeviceGetAttributes_v2", "nvmlDeviceGetAttributes"):
        getter = getattr(pynvml, name, None)
        attrs = _opt(getter, handle) if getter else None
        count = getattr(attrs, "multiprocessorCount", None)
        if count:
            return int(count)
    # tuple(): NVML's (major, minor), whatever sequence type it comes as
    per_sm = _CORES_PER_SM.get(cast("tuple[int, int]", tuple(capability))) if capability else None
    getter = getattr(pynvml, "nvmlDeviceGetNumGpuCores", None)
    cores = _opt(getter, handle) if getter and per_sm else None
    return cores // per_sm if cores and per_sm and cores % per_sm == 0 else None


def _device(pynvml: ModuleType, index: int, driver: str | None, cuda: str | None) -> DeviceInfo:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = _opt(pynvml.nvmlDeviceGetMemoryInfo, handle)
    pci = _opt(pynvml.nvmlDeviceGetPciInfo, handle)
    capability = _opt(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    power_mw = _opt(pynvml.nvmlDeviceGetPowerUsage, handle)
    limit_mw = _opt(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    utilization = _opt(pynvml.nvmlDeviceGetUtilizationRates, handle)
    temperature = _opt(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU)
    return DeviceInfo(
        index=index,
        vendor="nvidia",
        name=_text(_opt(pynvml.nvmlDeviceGetName, handle)) or f"NVIDIA GPU {index}",
        arch=f"sm_{capability[0]}{capability[1]}" if capability else None,
        uuid=_text(_opt(pynvml.nvmlDeviceGetUUID, handle)),
        pci_bus_id=_text(getattr(pci, "busId", None)),
        memory_total_bytes=int(memory.total) if memory else None,
        memory_used_bytes=int(memory.used) if memory else None,
        sm_clock_mhz=_opt(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM),
        sm_clock_max_mhz=_opt(pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_SM),
        memory_clock_mhz=_opt(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_MEM),
        memory_clock_max_mhz=_opt(pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_MEM),
        power_w=power_mw / 1000.0 if power_mw is not None else None,
        power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
        temperature_c=float(temperature) if temperature is not None else None,
        utilization_pct=float(utilization.gpu) if utilization is not None else None,
        throttle=_throttle(pynvml, handle),
        driver_version=driver,
        runtime_version=cuda,
        compute_units=_sm_count(pynvml, handle, capability),
    )


def probe_nvidia() -> tuple[list[DeviceInfo], str]:
    """Every NVIDIA GPU NVML sees, and "ok" or a plain reason why none could be read."""
    pynvml, status = _session()
    if pynvml is None:
        return [], status
    try:
        count = pynvml.nvmlDeviceGetCount()
    except Exception as err:
        return [], _reason(pynvml, err)
    if count == 0:
        return [], "NVML: driver loaded but no NVIDIA GPU visible"
    driver = _text(_opt(pynvml.nvmlSystemGetDriverVersion))
    cuda = _cuda_version(pynvml)
    devices: list[DeviceInfo] = []
    problems: list[str] = []
    for index in range(count):
        try:
            devices.append(_device(pynvml, index, driver, cuda))
        except Exception as err:  # one broken GPU (fallen off the bus) must not hide the others
            problems.append(f"GPU {index}: {_reason(pynvml, err)}")
    if not devices:
        return [], "; ".join(problems)
    return devices, "ok" if not problems else "ok (" + "; ".join(problems) + ")"


def sample_clocks(index: int) -> dict[str, Any]:
    """A cheap snapshot for the benchmark: clocks (MHz), power (W), temperature (C), throttling.

    Always returns every key; values are None when unknown, and ``status`` says why.
    """
    sample: dict[str, Any] = {
        "t": time.time(), "sm_clock_mhz": None, "memory_clock_mhz": None, "power_w": None,
        "temperature_c": None, "throttle_reasons": [], "throttled": None, "status": "ok",
    }  # fmt: skip
    pynvml, status = _session()
    if pynvml is None:
        sample["status"] = status
        return sample
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as err:
        sample["status"] = _reason(pynvml, err)
        return sample
    sample["sm_clock_mhz"] = _opt(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM)
    sample["memory_clock_mhz"] = _opt(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_MEM)
    power_mw = _opt(pynvml.nvmlDeviceGetPowerUsage, handle)
    sample["power_w"] = power_mw / 1000.0 if power_mw is not None else None
    temperature = _opt(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU)
    sample["temperature_c"] = float(temperature) if temperature is not None else None
    throttle = _throttle(pynvml, handle)
    if throttle is not None:
        sample["throttle_reasons"] = throttle.reasons
        sample["throttled"] = throttle.active
    return sample
