"""AMD GPUs through amdsmi (ROCm's AMD SMI Python package), imported lazily.

Two halves, so the conversion can be tested without a GPU: ``collect_records`` makes the library
calls and keeps each raw answer (None when a call is unsupported); ``amd_device_from_records``
turns those answers into a DeviceInfo. amdsmi's return shapes drift between ROCm releases (clock
key ``cur_clk`` became ``clk``; power moved to ``socket_power``; the power limit went from W to
uW; unsupported values read "N/A" or all-ones), so the conversion accepts each known spelling.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from loom_mcp.devices.peaks import lookup_peak
from loom_mcp.devices.session import LibrarySession
from loom_mcp.models import DeviceInfo, ThrottleState

# PCI device ids for names amdsmi may report as a codename ("Aqua Vanjaram") on older stacks.
# From the Linux pci.ids database; 0x75a0 is also what rocprofv3 reports for an MI350X.
AMD_DEVICE_IDS: dict[int, str] = {
    0x7408: "AMD Instinct MI250X",
    0x740C: "AMD Instinct MI250X/MI250",
    0x740F: "AMD Instinct MI210",
    0x74A0: "AMD Instinct MI300A",
    0x74A1: "AMD Instinct MI300X",
    0x74A5: "AMD Instinct MI325X",
    0x74B5: "AMD Instinct MI300X VF",
    0x75A0: "AMD Instinct MI350X",
}

# amdsmi_get_violation_status "active_*" flags. As on NVIDIA (see nvidia.THROTTLING_REASONS),
# running at the package power limit is the normal state of a busy GPU and only informational;
# thermal limits are what make a timing sample unrepresentative.
VIOLATIONS: dict[str, str] = {
    "active_prochot_thrm": "prochot_thermal",
    "active_socket_thrm": "socket_thermal",
    "active_vr_thrm": "vr_thermal",
    "active_hbm_thrm": "hbm_thermal",
    "active_ppt_pwr": "ppt_power",
    "active_gfx_clk_below_host_limit": "gfx_clk_below_host_limit",
}
INFO_VIOLATIONS = frozenset({"ppt_power", "gfx_clk_below_host_limit"})

# gpu_metrics "indep_throttle_status": the kernel's SMU_THROTTLER_*_BIT numbering (amdgpu_smu.h).
THROTTLER_BITS: dict[int, str] = {
    0: "ppt0", 1: "ppt1", 2: "ppt2", 3: "ppt3", 4: "spl", 5: "fppt", 6: "sppt", 7: "sppt_apu",
    16: "tdc_gfx", 17: "tdc_soc", 18: "tdc_mem", 19: "tdc_vdd", 20: "tdc_cvip", 21: "edc_cpu",
    22: "edc_gfx", 23: "apcc", 32: "temp_gpu", 33: "temp_core", 34: "temp_mem", 35: "temp_edge",
    36: "temp_hotspot", 37: "temp_soc", 38: "temp_vr_gfx", 39: "temp_vr_soc", 40: "temp_vr_mem0",
    41: "temp_vr_mem1", 42: "temp_liquid0", 43: "temp_liquid1", 44: "vrhot0", 45: "vrhot1",
    46: "prochot_cpu", 47: "prochot_gfx", 56: "ppm", 57: "fit",
}  # fmt: skip
# Bits 0-23 are power and current limits: informational, like ppt_power above.
INFO_THROTTLER_BITS = frozenset(bit for bit in THROTTLER_BITS if bit < 32)

_MiB = 1 << 20


# ---------------------------------------------------------------- pure conversion


def _num(value: Any) -> float | None:
    """A number from an amdsmi field, or None for "N/A", all-ones sentinels and junk."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value.split()[0])
        except (ValueError, IndexError):
            return None
    if not isinstance(value, int | float) or not math.isfinite(value):
        return None
    if value < 0 or int(value) in (0xFFFF, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF):
        return None
    return float(value)


def _first(*values: Any) -> float | None:
    for value in values:
        number = _num(value)
        if number is not None:
            return number
    return None


def _get(records: dict[str, Any], key: str, field: str) -> Any:
    block = records.get(key)
    return block.get(field) if isinstance(block, dict) else None


def _int(value: float | None) -> int | None:
    return round(value) if value is not None else None


def _watts(value: float | None) -> float | None:
    # amdsmi documents W on bare metal but uW in some releases and on hosts; no GPU draws 100 kW.
    if value is None:
        return None
    return value / 1e6 if value > 100_000 else value


def _celsius(value: float | None) -> float | None:
    # Older stacks passed the kernel's millidegrees through.
    if value is None:
        return None
    return value / 1000.0 if value > 1000 else value


def _mib_to_bytes(value: float | None) -> int | None:
    if value is None:
        return None
    # vram_* fields are MB; a value this large can only already be bytes.
    return int(value) if value > 1e7 else int(value) * _MiB


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if not isinstance(value, str):
        return None
    value = value.strip().strip("\x00").strip()
    return value if value and value.upper() != "N/A" else None


def _device_id(asic: dict[str, Any]) -> int | None:
    raw = asic.get("device_id")
    if isinstance(raw, int):
        return raw
    text = _text(raw)
    try:
        return int(text, 0) if text else None
    except ValueError:
        return None


def _name(index: int, records: dict[str, Any]) -> str:
    asic = records.get("asic_info") or {}
    market = _text(asic.get("market_name"))
    board = _text(_get(records, "board_info", "product_name"))
    by_id = AMD_DEVICE_IDS.get(_device_id(asic) or -1)
    for candidate in (market, board):
        # Hex ids ("0x74a1") and codenames are valid answers that name no product we know.
        if candidate and not re.fullmatch(r"0x[0-9a-fA-F]+", candidate):
            if lookup_peak(candidate) is not None or by_id is None:
                return candidate
            return f"{by_id} ({candidate})"
    return by_id or f"AMD GPU {index}"


def _arch(records: dict[str, Any]) -> str | None:
    raw = _get(records, "asic_info", "target_graphics_version")
    if isinstance(raw, int):
        raw = "gfx" + format(raw, "x")
    text = (_text(raw) or "").lower()
    return text if re.fullmatch(r"gfx[0-9a-f]{3,4}", text) else None


def _rocm_version(records: dict[str, Any]) -> str | None:
    raw = records.get("rocm_version")
    if isinstance(raw, list | tuple):  # amdsmi_get_rocm_version() -> (ok, version)
        ok, value = (raw[0], raw[1]) if len(raw) == 2 else (True, raw[0] if raw else None)
        return _text(value) if ok else None
    return _text(raw)


def throttle_from_records(records: dict[str, Any]) -> ThrottleState | None:
    """Prefer amdsmi's violation status (ROCm 6.4+); else decode the SMU throttler bits."""
    violations = records.get("violation_status")
    if isinstance(violations, dict) and any(isinstance(violations.get(k), bool) for k in VIOLATIONS):
        reasons = [name for key, name in VIOLATIONS.items() if violations.get(key) is True]
        return ThrottleState(active=any(r not in INFO_VIOLATIONS for r in reasons), reasons=reasons)
    metrics = records.get("gpu_metrics") or {}
    raw = metrics.get("indep_throttle_status")
    # Kept an int: bits up to 57 do not survive a trip through float.
    if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < 0xFFFFFFFFFFFFFFFF:
        bits = raw
        hard = [name for bit, name in THROTTLER_BITS.items() if bits >> bit & 1 and bit not in INFO_THROTTLER_BITS]
        soft = [name for bit, name in THROTTLER_BITS.items() if bits >> bit & 1 and bit in INFO_THROTTLER_BITS]
        unknown = bits & ~sum(1 << bit for bit in THROTTLER_BITS)
        if unknown:
            hard.append(f"other_bits={unknown:#x}")
        return ThrottleState(active=bool(hard), reasons=hard + soft)
    legacy = _num(metrics.get("throttle_status"))
    if legacy is not None:  # ASIC-specific bit layout: report it raw rather than guess
        return ThrottleState(active=legacy != 0, reasons=[f"throttle_status={int(legacy):#x}"] if legacy else [])
    return None


def _clock(records: dict[str, Any], key: str, field: str) -> float | None:
    # amdsmi <= 6.0 said "cur_clk", later releases "clk".
    if field == "clk":
        return _first(_get(records, key, "clk"), _get(records, key, "cur_clk"))
    return _num(_get(records, key, field))


def amd_device_from_records(index: int, records: dict[str, Any]) -> DeviceInfo:
    """One DeviceInfo from the raw amdsmi answers of one GPU (keys as ``collect_records`` writes)."""
    metrics = records.get("gpu_metrics") or {}
    gfxclks = metrics.get("current_gfxclks")
    first_gfxclk = gfxclks[0] if isinstance(gfxclks, list) and gfxclks else None
    vram_total = _first(_get(records, "vram_usage", "vram_total"), _get(records, "vram_info", "vram_size"))
    power = _first(
        _get(records, "power_info", "socket_power"),
        _get(records, "power_info", "current_socket_power"),
        _get(records, "power_info", "average_socket_power"),
        metrics.get("current_socket_power"),
        metrics.get("average_socket_power"),
    )
    limit = _first(_get(records, "power_cap_info", "power_cap"), _get(records, "power_info", "power_limit"))
    temperature = _first(records.get("temp_hotspot"), metrics.get("temperature_hotspot"))
    return DeviceInfo(
        index=index,
        vendor="amd",
        name=_name(index, records),
        arch=_arch(records),
        uuid=_text(records.get("uuid")),
        pci_bus_id=_text(records.get("bdf")),
        memory_total_bytes=_mib_to_bytes(vram_total),
        memory_used_bytes=_mib_to_bytes(_num(_get(records, "vram_usage", "vram_used"))),
        sm_clock_mhz=_int(_first(_clock(records, "clock_gfx", "clk"), metrics.get("current_gfxclk"), first_gfxclk)),
        sm_clock_max_mhz=_int(_clock(records, "clock_gfx", "max_clk")),
        memory_clock_mhz=_int(_first(_clock(records, "clock_mem", "clk"), metrics.get("current_uclk"))),
        memory_clock_max_mhz=_int(_clock(records, "clock_mem", "max_clk")),
        power_w=_watts(power),
        power_limit_w=_watts(limit),
        temperature_c=_celsius(temperature),
        utilization_pct=_first(_get(records, "activity", "gfx_activity"), metrics.get("average_gfx_activity")),
        throttle=throttle_from_records(records),
        driver_version=_text(_get(records, "driver_info", "driver_version")),
        runtime_version=_rocm_version(records),
        compute_units=_int(_num(_get(records, "asic_info", "num_compute_units"))),
    )


def sample_from_records(records: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's clock snapshot (same keys as nvidia.sample_clocks) from raw answers."""
    device = amd_device_from_records(0, records)
    throttle = device.throttle
    return {
        "t": time.time(),
        "sm_clock_mhz": device.sm_clock_mhz,
        "memory_clock_mhz": device.memory_clock_mhz,
        "power_w": device.power_w,
        "temperature_c": device.temperature_c,
        "throttle_reasons": throttle.reasons if throttle else [],
        "throttled": throttle.active if throttle else None,
        "status": "ok",
    }


# ---------------------------------------------------------------- library calls


def _open_amdsmi() -> tuple[ModuleType | None, str]:
    try:
        import amdsmi
    except ImportError:
        return None, "amdsmi not installed"
    except Exception as err:  # the package loads libamd_smi.so at import time
        return None, f"amdsmi: library not loadable ({err})"
    try:
        amdsmi.amdsmi_init()
    except Exception as err:
        return None, f"amdsmi: {err}".strip()
    return amdsmi, "ok"


_session = LibrarySession(_open_amdsmi)  # amdsmi initialised once per process (devices/session.py)


def _call(fn: Callable[..., Any] | None, *args: Any) -> Any:
    if fn is None:
        return None
    try:
        return fn(*args)
    except Exception:  # unsupported on this ASIC or release: the field stays unknown
        return None


def _enum(amdsmi: ModuleType, enum: str, *members: str) -> Any:
    holder = getattr(amdsmi, enum, None)
    for member in members:
        if holder is not None and hasattr(holder, member):
            return getattr(holder, member)
    return None


def collect_records(amdsmi: ModuleType, handle: Any, *, sample_only: bool = False) -> dict[str, Any]:
    """The raw amdsmi answers for one GPU; keys are what ``amd_device_from_records`` reads."""

    def fn(name: str) -> Callable[..., Any] | None:
        return getattr(amdsmi, name, None)

    gfx = _enum(amdsmi, "AmdSmiClkType", "GFX", "SYS")
    mem = _enum(amdsmi, "AmdSmiClkType", "MEM")
    hotspot = _enum(amdsmi, "AmdSmiTemperatureType", "HOTSPOT", "JUNCTION", "EDGE")
    current = _enum(amdsmi, "AmdSmiTemperatureMetric", "CURRENT")
    records: dict[str, Any] = {
        "clock_gfx": _call(fn("amdsmi_get_clock_info"), handle, gfx) if gfx is not None else None,
        "clock_mem": _call(fn("amdsmi_get_clock_info"), handle, mem) if mem is not None else None,
        "power_info": _call(fn("amdsmi_get_power_info"), handle),
        "temp_hotspot": _call(fn("amdsmi_get_temp_metric"), handle, hotspot, current)
        if hotspot is not None and current is not None
        else None,
        "violation_status": _call(fn("amdsmi_get_violation_status"), handle),
        "gpu_metrics": _call(fn("amdsmi_get_gpu_metrics_info"), handle),
    }
    if sample_only:
        return records
    records.update(
        asic_info=_call(fn("amdsmi_get_gpu_asic_info"), handle),
        board_info=_call(fn("amdsmi_get_gpu_board_info"), handle),
        bdf=_call(fn("amdsmi_get_gpu_device_bdf"), handle),
        uuid=_call(fn("amdsmi_get_gpu_device_uuid"), handle),
        vram_info=_call(fn("amdsmi_get_gpu_vram_info"), handle),
        vram_usage=_call(fn("amdsmi_get_gpu_vram_usage"), handle),
        power_cap_info=_call(fn("amdsmi_get_power_cap_info"), handle),
        activity=_call(fn("amdsmi_get_gpu_activity"), handle),
        driver_info=_call(fn("amdsmi_get_gpu_driver_info"), handle),
        rocm_version=_call(fn("amdsmi_get_rocm_version")),
    )
    return records


def probe_amd() -> tuple[list[DeviceInfo], str]:
    """Every AMD GPU amdsmi sees, and "ok" or a plain reason why none could be read."""
    amdsmi, status = _session()
    if amdsmi is None:
        return [], status
    try:
        handles = amdsmi.amdsmi_get_processor_handles()
    except Exception as err:
        return [], f"amdsmi: {err}"
    if not handles:
        return [], "amdsmi: no AMD GPU visible"
    devices: list[DeviceInfo] = []
    problems: list[str] = []
    for index, handle in enumerate(handles):
        try:
            devices.append(amd_device_from_records(index, collect_records(amdsmi, handle)))
        except Exception as err:  # one bad GPU must not hide the others
            problems.append(f"GPU {index}: {err}")
    if not devices:
        return [], "amdsmi: " + "; ".join(problems)
    return devices, "ok" if not problems else "ok (" + "; ".join(problems) + ")"


def sample_clocks_amd(index: int) -> dict[str, Any]:
    """Same snapshot as nvidia.sample_clocks, for AMD GPU ``index`` (amdsmi's order)."""
    amdsmi, status = _session()
    if amdsmi is not None:
        try:
            handle = amdsmi.amdsmi_get_processor_handles()[index]
        except Exception as err:
            status = f"amdsmi: GPU {index}: {err}"
        else:
            return sample_from_records(collect_records(amdsmi, handle, sample_only=True))
    return {
        "t": time.time(), "sm_clock_mhz": None, "memory_clock_mhz": None, "power_w": None,
        "temperature_c": None, "throttle_reasons": [], "throttled": None, "status": status,
    }  # fmt: skip
