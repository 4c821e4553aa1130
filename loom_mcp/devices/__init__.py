"""What hardware this machine has: NVIDIA (NVML), AMD (amdsmi) and the host CPU, with datasheet peaks."""

from __future__ import annotations

from collections.abc import Callable

from loom_mcp.devices.amd import probe_amd
from loom_mcp.devices.cpu import probe_cpu
from loom_mcp.devices.nvidia import probe_nvidia
from loom_mcp.devices.peaks import PEAKS, lookup_peak
from loom_mcp.models import DeviceInfo

__all__ = ["PEAKS", "lookup_peak", "probe_cpu", "probe_devices"]


def _guarded(probe: Callable[[], tuple[list[DeviceInfo], str]], label: str) -> tuple[list[DeviceInfo], str]:
    # A vendor library can fail in ways its docs never mention; device_info must still answer.
    try:
        return probe()
    except Exception as err:
        return [], f"{label}: probe failed ({type(err).__name__}: {err})"


def probe_devices() -> tuple[list[DeviceInfo], dict[str, str]]:
    """Every accelerator plus the CPU, each with its datasheet peak; never raises.

    Returns (devices, backends) where backends maps "nvidia" / "amd" / "cpu" to "ok" or the
    plain reason that vendor's library could not be used.
    """
    nvidia, nvidia_status = _guarded(probe_nvidia, "NVML")
    amd, amd_status = _guarded(probe_amd, "amdsmi")
    try:
        cpu, cpu_status = [probe_cpu()], "ok"
    except Exception as err:
        cpu, cpu_status = [], f"cpu probe failed ({type(err).__name__}: {err})"
    devices = [
        device.model_copy(update={"peak": lookup_peak(device.name, device.arch)})
        if device.vendor != "cpu" and device.peak is None
        else device
        for device in [*nvidia, *amd, *cpu]
    ]
    return devices, {"nvidia": nvidia_status, "amd": amd_status, "cpu": cpu_status}
