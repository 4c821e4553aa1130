"""Where a job runs: the pool of this node's devices (one per server and LOOM_HOME), the device
kind a campaign's evidence was recorded on, and the lease a job holds while it runs.

A job asks for a kind (the campaign's, else the kind of the first visible device), waits its
turn in the pool's queue, and runs on whichever slot of that kind came free; `Leased.target`
is then that slot, and `Leased.target.placement` is what the run's record says about it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import orjson

from loom_mcp import __version__
from loom_mcp.config import LoomConfig
from loom_mcp.devices import probe_devices
from loom_mcp.devices.toolchain import probe_toolchain
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.executor.pool import DevicePool, Slot, device_kind
from loom_mcp.executor.slots import first_visible, local_slots
from loom_mcp.models import DeviceInfo, ExecutorState, Placement, Toolchain
from loom_mcp.sandbox.lease import DEVICE_METER
from loom_mcp.sandbox.runner import Progress
from loom_mcp.store import ArtifactStore, Ledger

__all__ = [
    "Leased",
    "Target",
    "campaign_kind",
    "executor_state",
    "first_visible",
    "pick_target",
    "run_on_ray",
    "start_executor",
    "stop_executor",
    "targets_of_kind",
]

log = logging.getLogger("loom_mcp")


@dataclass
class Target:
    """Where jobs run: the torch device string for workers, and the device record for peaks."""

    torch_device: str  # "cuda:N" (CUDA and ROCm builds alike; N = NVML/amdsmi index) or "cpu"
    device: DeviceInfo
    lease_key: str
    software: str = ""  # torch, triton and loom versions as the workers see them
    placement: Placement | None = None  # set once a job holds the slot (Leased)
    probed: list[DeviceInfo] = field(default_factory=list, repr=False)  # the probe it came from

    @property
    def is_gpu(self) -> bool:
        return self.torch_device != "cpu"

    @property
    def kind(self) -> str:
        return device_kind(self.device)


# One pool per LOOM_HOME and executor settings in this process: every call of a server shares it.
_POOLS: dict[tuple[str, str], DevicePool] = {}


def _pool_key(config: LoomConfig) -> tuple[str, str]:
    return str(config.locks_dir), config.executor.model_dump_json()


def local_pool(config: LoomConfig, devices: list[DeviceInfo], toolchain: Toolchain) -> DevicePool:
    """The pool this server's jobs share, built from the first probe (the devices of a node do
    not change while it serves)."""
    key = _pool_key(config)
    pool = _POOLS.get(key)
    if pool is None:
        use_gpus = any(name.startswith("cuda") for name in toolchain.torch_devices)
        slots = local_slots(devices, use_gpus, config.executor.cpu_slots)
        pool = DevicePool(slots, config.locks_dir, config.executor.max_jobs)
        if toolchain.torch is None:
            return pool  # what it would be; kept only once torch says which devices it sees
        _POOLS[key] = pool
        log.info("executor local: %d slot(s) (%s), %d job(s) at once", len(slots), slots[0].kind, pool.max_jobs)
    return pool


def _software(toolchain: Toolchain) -> str:
    return f"torch {toolchain.torch}; triton {toolchain.triton}; loom-mcp {__version__}"


def _target(slot: Slot, devices: list[DeviceInfo], software: str) -> Target:
    # The probe's record of the slot's device: its clocks and temperature as of now.
    fresh = next((d for d in devices if d.vendor == slot.device.vendor and d.index == slot.device.index), slot.device)
    return Target(slot.torch_device, fresh, slot.lease_key, software, probed=devices)


async def _probe(config: LoomConfig) -> tuple[Toolchain, list[DeviceInfo], DevicePool]:
    toolchain = await probe_toolchain(config.cache_dir / "toolchain.json")
    if toolchain.torch is None:
        raise LoomError(
            ErrorCode.TOOLCHAIN_MISSING,
            "torch is not importable by the worker python "
            f"({toolchain.probe_error or 'not installed'}); install torch (and triton) "
            "into the environment loom-mcp runs in: pip install 'loom-mcp[triton]'",
        )
    devices, _ = await anyio.to_thread.run_sync(probe_devices)
    return toolchain, devices, local_pool(config, devices, toolchain)


async def pick_target(config: LoomConfig) -> Target:
    """The first slot of the pool: the server's default kind, and the device facts (arch,
    peaks) a job of that kind will see on whichever slot of it runs the job."""
    toolchain, devices, pool = await _probe(config)
    return _target(pool.slots[0], devices, _software(toolchain))


async def targets_of_kind(config: LoomConfig, kind: str | None) -> list[Target]:
    """Every slot of `kind` (default: the server's), as targets: the places a job could run."""
    toolchain, devices, pool = await _probe(config)
    return [_target(s, devices, _software(toolchain)) for s in pool.slots_of(kind or pool.slots[0].kind)]


async def executor_state(config: LoomConfig, devices: list[DeviceInfo], toolchain: Toolchain) -> ExecutorState:
    if config.executor.kind == "ray":
        pool = local_pool(config, devices, toolchain)
        ex = await anyio.to_thread.run_sync(ray_executor, config, pool)
        return ExecutorState.model_validate(ex.state())
    return local_pool(config, devices, toolchain).state()


# The kind each campaign's first placed run recorded (it never changes once recorded).
_CAMPAIGN_KINDS: dict[tuple[str, str], str] = {}
_KIND_SCAN = 20  # records read to find it: older records without a placement are skipped


def _recorded_kind(record: dict[str, Any]) -> str | None:
    placement = record.get("placement")
    if isinstance(placement, dict) and placement.get("device_kind"):
        return str(placement["device_kind"])
    device = record.get("device")  # benchmark records name their device in full
    if isinstance(device, dict):
        try:
            return device_kind(DeviceInfo.model_validate(device))
        except ValueError:
            return None
    return None


def campaign_kind(ledger: Ledger, artifacts: ArtifactStore, campaign_id: str | None) -> str | None:
    """The device kind the campaign's evidence was recorded on (its oldest run that names one);
    None before its first run: any device of the server's default kind may start it."""
    if not campaign_id:
        return None
    key = (str(ledger.path), campaign_id)
    if key in _CAMPAIGN_KINDS:
        return _CAMPAIGN_KINDS[key]
    rows = sorted(
        [*ledger.runs_of(campaign_id, "validation"), *ledger.runs_of(campaign_id, "benchmark")],
        key=lambda r: r["created_at"],
    )
    for row in rows[:_KIND_SCAN]:
        try:
            kind = _recorded_kind(orjson.loads(artifacts.get_bytes(row["record_sha"])))
        except (OSError, ValueError, LoomError):
            continue
        if kind:
            _CAMPAIGN_KINDS[key] = kind
            return kind
    return None


class Leased:
    """Takes a slot of `kind` (default: the target's own kind) in its turn, holds its lease,
    and measures how long (the device seconds of the call). Inside, `target` is the slot that
    runs the job and `target.placement` says where and after how long a wait."""

    def __init__(self, config: LoomConfig, target: Target, progress: Progress | None, kind: str | None = None) -> None:
        self.config = config
        self.target = target
        self.kind = kind or target.kind
        self.progress = progress
        self.seconds = 0.0

    def _pool(self) -> DevicePool:
        pool = _POOLS.get(_pool_key(self.config))
        if pool is not None and (pool.slots_of(self.kind) or self.kind != self.target.kind):
            return pool
        # A target named outside the pool (no probe made one here): its own lease, as before.
        t = self.target
        return DevicePool([Slot(t.lease_key, t.lease_key, t.torch_device, t.device, self.kind)], self.config.locks_dir)

    async def __aenter__(self) -> Leased:
        pool = self._pool()
        if self.progress:
            ahead = f", {pool.queued} job(s) ahead" if pool.queued else ""
            await self.progress(f"waiting for a free device ({self.kind}{ahead})")
        self._taken = pool.take(self.kind, self.config.lease_timeout_s)
        slot, placement = await self._taken.__aenter__()
        probed = self.target.probed or [slot.device]
        self.target = replace(_target(slot, probed, self.target.software), placement=placement)
        self._start = time.monotonic()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.seconds = time.monotonic() - self._start if self.target.is_gpu else 0.0
        meter = DEVICE_METER.get()
        if meter is not None:
            meter.append(self.seconds)
        await self._taken.__aexit__(*exc)


# ---------------------------------------------------------------- [executor] kind = "ray"

_RAY: dict[str, Any] = {}  # address -> RayExecutor, one per server process


def ray_executor(config: LoomConfig, pool: DevicePool | None = None):
    """The Ray executor of `config`, started once (a clear TOOLCHAIN_MISSING without Ray). A
    private instance ("local") offers this node's pool: one slot per device, named by kind."""
    from loom_mcp.executor.ray_executor import RayExecutor

    address = config.executor.address
    ex = _RAY.get(address)
    if ex is None:
        kinds: dict[str, float] = {}
        for slot in pool.slots if pool else []:
            kinds[slot.kind] = kinds.get(slot.kind, 0) + 1
        cpu_slots = sum(1 for s in pool.slots if s.device.vendor == "cpu") if pool else config.executor.cpu_slots
        ex = RayExecutor(address, kinds, cpu_slots=max(cpu_slots, 1))
        ex.start()
        _RAY[address] = ex
    return ex


async def start_executor(config: LoomConfig) -> None:
    """At server start: Ray joined (or started) now, so a missing or unreachable Ray is an error
    before any tool call, not during one."""
    if config.executor.kind != "ray":
        return
    toolchain = await probe_toolchain(config.cache_dir / "toolchain.json")
    devices, _ = await anyio.to_thread.run_sync(probe_devices)
    pool = local_pool(config, devices, toolchain)
    await anyio.to_thread.run_sync(ray_executor, config, pool)


def stop_executor() -> None:
    """When the server ends: a private Ray instance it started ends with it."""
    for ex in list(_RAY.values()):
        ex.shutdown()
    _RAY.clear()


async def run_on_ray(config: LoomConfig, default: Target, kind: str | None, job, progress: Progress | None):
    """Run a judge job (executor.ray_job.RemoteJob) as a Ray task on a device of `kind` (the
    campaign's, else the server's default); returns its result and the Target it ran on, with
    its placement."""
    from loom_mcp.models import DeviceInfo

    wanted = kind or default.kind
    if progress:
        await progress(f"queued on Ray for a device of kind {wanted}")
    _, _, pool = await _probe(config)
    ex = await anyio.to_thread.run_sync(ray_executor, config, pool)
    submitted = time.time()
    result = await ex.run(job, wanted, gpu=not wanted.startswith("cpu"))
    ended = time.time()
    device = DeviceInfo.model_validate(result.device_info) if result.device_info else default.device
    slot = f"{device.vendor}:{device.index}" if device.vendor != "cpu" else "cpu:0"
    placement = Placement(
        executor="ray",
        node=result.node,
        device=slot,
        device_kind=wanted,
        queued_s=round(max(result.started_at - submitted, 0.0), 3),
        started_at=result.started_at or submitted,
        ended_at=ended,
    )
    target = Target(
        result.device,
        device,
        f"ray:{result.node}:{slot}",
        result.software or default.software,
        placement=placement,
    )
    if target.is_gpu:
        meter = DEVICE_METER.get()
        if meter is not None:
            meter.append(ended - placement.started_at)
    return result, target
