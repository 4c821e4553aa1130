"""Device leases: one holder at a time, across coroutines and across processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.sandbox import DeviceLease, lease_holder


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_same_loop_holders_are_serialized(tmp_path: Path) -> None:
    spans: list[tuple[float, float]] = []

    async def hold(name: str) -> None:
        async with DeviceLease(tmp_path, "nvidia:0", timeout_s=10):
            t0 = time.monotonic()
            holder = lease_holder(tmp_path, "nvidia:0")
            assert holder is not None and holder["pid"] == os.getpid()
            assert holder["device"] == "nvidia:0"
            await anyio.sleep(0.3)
            spans.append((t0, time.monotonic()))

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(hold, f"t{i}")
    spans.sort()
    assert len(spans) == 3
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert start >= end
    assert lease_holder(tmp_path, "nvidia:0") is None


@pytest.mark.anyio
async def test_devices_are_independent(tmp_path: Path) -> None:
    async with DeviceLease(tmp_path, "nvidia:0", timeout_s=1):
        async with DeviceLease(tmp_path, "nvidia:1", timeout_s=1):
            assert lease_holder(tmp_path, "nvidia:1") is not None
        async with DeviceLease(tmp_path, "cpu", timeout_s=1):
            pass
    # Escaping keeps look-alike keys apart.
    async with DeviceLease(tmp_path, "nvidia:0", timeout_s=1):
        async with DeviceLease(tmp_path, "nvidia_0", timeout_s=1):
            pass


@pytest.mark.anyio
async def test_timeout_raises_device_busy(tmp_path: Path) -> None:
    async with DeviceLease(tmp_path, "amd:0"):
        t0 = time.monotonic()
        with pytest.raises(LoomError) as info:
            async with DeviceLease(tmp_path, "amd:0", timeout_s=0.3):
                pytest.fail("acquired a held lease")
        assert info.value.code is ErrorCode.DEVICE_BUSY
        assert str(info.value).startswith("[DEVICE_BUSY]")
        assert f"pid {os.getpid()}" in str(info.value)
        assert 0.25 < time.monotonic() - t0 < 2


@pytest.mark.anyio
async def test_cancelled_wait_leaves_no_trace(tmp_path: Path) -> None:
    async with DeviceLease(tmp_path, "cpu"):
        with anyio.move_on_after(0.2) as scope:
            async with DeviceLease(tmp_path, "cpu", timeout_s=30):
                pytest.fail("acquired a held lease")
        assert scope.cancelled_caught
    async with DeviceLease(tmp_path, "cpu", timeout_s=1):
        pass


HOLDER = """
import anyio, sys, time
from pathlib import Path
from loom_mcp.sandbox import DeviceLease

async def main():
    async with DeviceLease(Path(sys.argv[1]), "nvidia:0", timeout_s=10):
        print("held", flush=True)
        await anyio.sleep(float(sys.argv[2]))
        print(time.monotonic(), flush=True)

anyio.run(main)
"""


async def _start_holder(lock_dir: Path, hold_s: float) -> anyio.abc.Process:
    proc = await anyio.open_process(
        [sys.executable, "-c", textwrap.dedent(HOLDER), str(lock_dir), str(hold_s)],
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    with anyio.fail_after(10):
        assert (await proc.stdout.receive()).startswith(b"held")
    return proc


@pytest.mark.anyio
async def test_separate_processes_are_serialized(tmp_path: Path) -> None:
    proc = await _start_holder(tmp_path, 0.8)
    async with proc:
        holder = lease_holder(tmp_path, "nvidia:0")
        assert holder is not None and holder["pid"] == proc.pid
        assert holder["held_s"] >= 0
        async with DeviceLease(tmp_path, "nvidia:0", timeout_s=10):
            acquired = time.monotonic()
            assert lease_holder(tmp_path, "nvidia:0")["pid"] == os.getpid()  # type: ignore[index]
        assert proc.stdout is not None
        released = float((await proc.stdout.receive()).decode().strip())
        await proc.wait()
    # time.monotonic() is system-wide on Linux, so the two clocks compare.
    assert acquired >= released


@pytest.mark.anyio
async def test_killed_holder_frees_the_device(tmp_path: Path) -> None:
    proc = await _start_holder(tmp_path, 60)
    async with proc:
        with pytest.raises(LoomError):
            async with DeviceLease(tmp_path, "nvidia:0", timeout_s=0.2):
                pass
        proc.kill()
        await proc.wait()
    # The kernel dropped the dead holder's lock; its stale label does not count.
    assert lease_holder(tmp_path, "nvidia:0") is None
    async with DeviceLease(tmp_path, "nvidia:0", timeout_s=2):
        pass
