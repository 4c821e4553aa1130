"""The local executor's slots: every visible GPU when the workers' torch can use one, else
`cpu_slots` slots on the host CPU.

GPU slots are named and leased by their NVML/amdsmi index ("nvidia:3"), as before the pool. The
first CPU slot keeps the lease key "cpu" that a single CPU slot always had, so a server of an
earlier version and this one still exclude each other on it.
"""

from __future__ import annotations

import os

from loom_mcp.executor.pool import Slot, device_kind
from loom_mcp.models import DeviceInfo

_VISIBLE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def visible_gpus(gpus: list[DeviceInfo]) -> list[DeviceInfo]:
    """The GPUs CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES name (indices or UUID prefixes), in
    their order; every GPU found when none is set or none of its entries matches."""
    for var in _VISIBLE_VARS:
        entries = [e.strip() for e in os.environ.get(var, "").split(",") if e.strip()]
        chosen: list[DeviceInfo] = []
        for entry in entries:
            if entry.isdigit():
                match = [g for g in gpus if g.index == int(entry)]
            elif entry.startswith("GPU-"):
                match = [g for g in gpus if g.uuid and g.uuid.startswith(entry)]
            else:
                match = []
            chosen += [g for g in match if g not in chosen]
        if chosen:
            return chosen
    return list(gpus)


def first_visible(gpus: list[DeviceInfo]) -> DeviceInfo:
    """The GPU the workers' torch calls cuda:0 when they inherit the server's visibility: the
    first the visibility variables name, else the first GPU found."""
    return visible_gpus(gpus)[0]


def local_slots(devices: list[DeviceInfo], use_gpus: bool, cpu_slots: int) -> list[Slot]:
    gpus = visible_gpus([d for d in devices if d.vendor != "cpu"])
    if use_gpus and gpus:
        return [
            Slot(f"{g.vendor}:{g.index}", f"{g.vendor}:{g.index}", f"cuda:{g.index}", g, device_kind(g)) for g in gpus
        ]
    cpu = next(d for d in devices if d.vendor == "cpu")
    return [Slot(f"cpu:{i}", "cpu" if i == 0 else f"cpu:{i}", "cpu", cpu, device_kind(cpu)) for i in range(cpu_slots)]
