"""device_info: what hardware and toolchain this server can use, and what it cannot and why."""

from __future__ import annotations

import anyio

from loom_mcp.config import LoomConfig
from loom_mcp.devices import probe_devices
from loom_mcp.devices.toolchain import probe_toolchain
from loom_mcp.dispatch import executor_state
from loom_mcp.models import DeviceInfo, DeviceInfoResult
from loom_mcp.sandbox.lease import lease_holder


def device_key(device: DeviceInfo) -> str:
    return "cpu" if device.vendor == "cpu" else f"{device.vendor}:{device.index}"


async def device_info(config: LoomConfig, refresh: bool = False) -> DeviceInfoResult:
    devices, backends = await anyio.to_thread.run_sync(probe_devices)
    toolchain = await probe_toolchain(config.cache_dir / "toolchain.json", max_age_s=0.0 if refresh else 3600.0)
    for device in devices:
        device.busy = lease_holder(config.locks_dir, device_key(device)) is not None
    accelerators = [d for d in devices if d.vendor != "cpu"]
    if accelerators:
        next_step = "start_campaign on the repository you want to optimize"
    else:
        next_step = (
            "no GPU found: validation runs on CPU (Triton interpreter), timings are CPU wall-clock; "
            "start_campaign to begin"
        )
    executor = await executor_state(config, devices, toolchain)
    if len(executor.slots) > 1:
        next_step += f"; {len(executor.slots)} devices take jobs at once: several candidates may be judged in parallel"
    return DeviceInfoResult(
        devices=devices, toolchain=toolchain, backends=backends, executor=executor, next_step=next_step
    )
