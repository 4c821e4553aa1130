"""The host CPU as a device: always present, so every tool has somewhere to run (Triton's interpreter)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from loom_mcp.models import DeviceInfo


def _cpuinfo() -> dict[str, str]:
    """First processor block of /proc/cpuinfo (Linux); empty elsewhere."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _meminfo() -> tuple[int | None, int | None]:
    """(total, used) bytes from /proc/meminfo; used = total - available."""
    values: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * 1024  # the kernel reports kB
    except OSError:
        pass
    total = values.get("MemTotal")
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None, None
    available = values.get("MemAvailable")
    return total, (total - available) if available is not None else None


def _usable_cores() -> int | None:
    # The cores this process may run on: what a CPU benchmark actually gets in a container.
    if hasattr(os, "sched_getaffinity"):
        try:
            return len(os.sched_getaffinity(0))
        except OSError:
            pass
    return os.cpu_count()


def probe_cpu() -> DeviceInfo:
    info = _cpuinfo()
    name = info.get("model name") or info.get("Hardware") or platform.processor() or platform.machine()
    total, used = _meminfo()
    return DeviceInfo(
        index=0,
        vendor="cpu",
        name=name or "unknown CPU",
        arch=platform.machine() or None,
        memory_total_bytes=total,
        memory_used_bytes=used,
        compute_units=_usable_cores(),
    )
