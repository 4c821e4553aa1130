"""A node's device pool: a job takes any free device of the kind it asks for, and waits in one
first-come-first-served queue while every such device is busy.

Each slot is one device with its file lease (sandbox/lease.py). The queue orders this server's
calls; the lease still keeps other processes (a second server, a benchmark script) off a device
the pool thinks free, and such a device is skipped until its lease comes free. A slot is
released when its holder leaves, by error or cancellation too.
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.lowlevel

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.models import DeviceInfo, ExecutorSlot, ExecutorState, Placement
from loom_mcp.sandbox.lease import DeviceLease, lease_holder

# Only a lease held by another process wakes nobody; a release inside this pool wakes the queue
# at once, so polling is for the other processes' leases only.
_POLL_MIN_S = 0.01
_POLL_MAX_S = 0.25


def device_kind(device: DeviceInfo) -> str:
    """Model and driver: devices of one kind give comparable evidence, so a campaign's jobs may
    run on any of them and on no other."""
    if device.vendor == "cpu":
        return f"cpu {device.name}"
    return f"{device.vendor} {device.name}, driver {device.driver_version or 'unknown'}"


@dataclass(frozen=True)
class Slot:
    """One device that runs one job at a time."""

    name: str  # "nvidia:3", "amd:0", "cpu:1": what records and device_info call it
    lease_key: str  # its DeviceLease key
    torch_device: str  # "cuda:N" (N the NVML/amdsmi index) or "cpu"
    device: DeviceInfo
    kind: str


@dataclass
class _Waiter:
    kind: str
    queued_at: float = field(default_factory=time.monotonic)
    event: anyio.Event = field(default_factory=anyio.Event)
    slot: Slot | None = None
    lease: DeviceLease | None = None


class DevicePool:
    """`async with pool.take(kind, timeout_s) as (slot, placement):` one slot of `kind`, in turn."""

    def __init__(self, slots: list[Slot], lock_dir: Path, max_jobs: int | None = None, executor: str = "local"):
        if not slots:
            raise LoomError(ErrorCode.INTERNAL, "a device pool needs at least one slot")
        self.slots = slots
        self.lock_dir = Path(lock_dir)
        self.max_jobs = min(max_jobs or len(slots), len(slots))
        self.executor = executor
        self.node = socket.gethostname()
        self._queue: list[_Waiter] = []
        self._held: dict[str, _Waiter] = {}  # slot name -> its holder

    def kinds(self) -> list[str]:
        return list(dict.fromkeys(s.kind for s in self.slots))

    def slots_of(self, kind: str) -> list[Slot]:
        return [s for s in self.slots if s.kind == kind]

    @property
    def queued(self) -> int:
        return len(self._queue)

    def state(self) -> ExecutorState:
        """Each slot and whether a job holds it now (this server's or another process's)."""
        slots = [
            ExecutorSlot(
                device=s.name, busy=s.name in self._held or lease_holder(self.lock_dir, s.lease_key) is not None
            )
            for s in self.slots
        ]
        return ExecutorState(kind="local", nodes=[self.node], slots=slots)

    @asynccontextmanager
    async def take(self, kind: str, timeout_s: float) -> AsyncIterator[tuple[Slot, Placement]]:
        if not self.slots_of(kind):
            have = "; ".join(self.kinds())
            raise LoomError(
                ErrorCode.DEVICE_BUSY,
                f"no device of kind {kind!r} here (this server has: {have}); evidence from another "
                "kind is not comparable, so the job is not run elsewhere",
            )
        waiter = _Waiter(kind)
        self._queue.append(waiter)
        try:
            await self._wait_turn(waiter, timeout_s)
        except BaseException:
            # Cancelled or timed out, perhaps just after a slot was handed over: give it back.
            if waiter in self._queue:
                self._queue.remove(waiter)
            self._release(waiter)
            raise
        assert waiter.slot is not None
        placement = Placement(
            executor=self.executor,
            node=self.node,
            device=waiter.slot.name,
            device_kind=kind,
            queued_s=round(time.monotonic() - waiter.queued_at, 6),
            started_at=time.time(),
        )
        try:
            yield waiter.slot, placement
        finally:
            placement.ended_at = time.time()
            self._release(waiter)

    async def _wait_turn(self, waiter: _Waiter, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        delay = _POLL_MIN_S
        while True:
            self._dispatch()
            if waiter.slot is not None:
                # Cancelled in the same step it was handed the slot: give it back, start nothing.
                await anyio.lowlevel.checkpoint_if_cancelled()
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                busy = ", ".join(s.name for s in self.slots_of(waiter.kind))
                raise LoomError(
                    ErrorCode.DEVICE_BUSY,
                    f"every {waiter.kind} device ({busy}) still busy after {timeout_s:g} s "
                    f"({len(self._queue) - 1} other job(s) queued)",
                )
            with anyio.move_on_after(min(delay, remaining)):
                await waiter.event.wait()
            delay = min(delay * 2, _POLL_MAX_S)

    def _dispatch(self) -> None:
        """Hand free slots to waiters in arrival order. A waiter whose kind has no free slot
        holds back the later waiters of its kind (first come, first served) but not those of
        other kinds, which wait on other devices."""
        blocked: set[str] = set()
        for waiter in list(self._queue):
            if len(self._held) >= self.max_jobs:
                return
            if waiter.kind in blocked:
                continue
            for slot in self.slots_of(waiter.kind):
                if slot.name in self._held:
                    continue
                lease = DeviceLease(self.lock_dir, slot.lease_key)
                if lease.try_enter():  # else another process holds it: try the next
                    waiter.slot, waiter.lease = slot, lease
                    self._held[slot.name] = waiter
                    self._queue.remove(waiter)
                    waiter.event.set()
                    break
            else:
                blocked.add(waiter.kind)

    def _release(self, waiter: _Waiter) -> None:
        slot, lease = waiter.slot, waiter.lease
        waiter.slot = waiter.lease = None
        if slot is None:
            return
        if self._held.get(slot.name) is waiter:
            del self._held[slot.name]
        if lease is not None:
            lease.release()
        self._dispatch()  # the next in line takes it now, not at its next poll
