"""One job per device at a time: a file lock per device, shared by coroutines and processes.

flock() locks belong to an open file description, so two opens of the same lock file conflict
even inside one process (two coroutines) as well as across processes (two servers, or a
server and a benchmark script). The kernel drops the lock when its holder dies, so a crashed
holder never wedges a device; the holder file next to the lock is only a label and is ignored
whenever the lock itself is free.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import time
from contextvars import ContextVar
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio

from loom_mcp.errors import ErrorCode, LoomError

# The device seconds of the tool call being served, failed and cancelled steps included: the
# server gives each call its own list, and every lease the call holds adds to it.
DEVICE_METER: ContextVar[list[float] | None] = ContextVar("loom_device_meter", default=None)

_POLL_MIN_S = 0.01
_POLL_MAX_S = 0.25


def _stem(device_key: str) -> str:
    # Injective escaping so "nvidia:0" and "nvidia_0" cannot share a lock.
    return re.sub(r"[^A-Za-z0-9.-]", lambda m: f"_{ord(m.group()):02x}", device_key)


def _paths(lock_dir: Path, device_key: str) -> tuple[Path, Path]:
    stem = _stem(device_key)
    return lock_dir / f"{stem}.lock", lock_dir / f"{stem}.holder.json"


def _try_lock(path: Path) -> int | None:
    """An fd holding the exclusive lock, or None if someone else holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_holder(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def lease_holder(lock_dir: Path, device_key: str) -> dict[str, Any] | None:
    """Who holds the device now: {"pid", "host", "device", "since", "held_s"}, or None if free."""
    lock_path, holder_path = _paths(Path(lock_dir), device_key)
    if not lock_path.exists():
        return None
    # The lock, not the label, is the truth: a label left by a crashed holder means nothing.
    fd = _try_lock(lock_path)
    if fd is not None:
        os.close(fd)
        return None
    holder = _read_holder(holder_path) or {"pid": None, "host": None, "device": device_key}
    if isinstance(holder.get("since_epoch"), (int, float)):
        holder["held_s"] = round(time.time() - holder["since_epoch"], 3)
    holder.pop("since_epoch", None)
    return holder


class DeviceLease:
    """`async with DeviceLease(lock_dir, "nvidia:0"):` — exclusive use of one device.

    Waits by polling (never blocks the event loop) and raises LoomError(DEVICE_BUSY) after
    `timeout_s`. Cancelling the waiting task abandons the wait cleanly.
    """

    def __init__(self, lock_dir: Path, device_key: str, timeout_s: float = 600.0) -> None:
        self.lock_dir = Path(lock_dir)
        self.device_key = device_key
        self.timeout_s = timeout_s
        self._lock_path, self._holder_path = _paths(self.lock_dir, device_key)
        self._fd: int | None = None

    async def __aenter__(self) -> DeviceLease:
        if self._fd is not None:
            raise LoomError(ErrorCode.INTERNAL, f"lease on {self.device_key} entered twice")
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.timeout_s
        delay = _POLL_MIN_S
        while True:
            fd = _try_lock(self._lock_path)
            if fd is not None:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                holder = lease_holder(self.lock_dir, self.device_key)
                who = ""
                if holder and holder.get("pid"):
                    who = f" (held by pid {holder['pid']} since {holder.get('since')})"
                raise LoomError(
                    ErrorCode.DEVICE_BUSY,
                    f"device {self.device_key} still busy after {self.timeout_s:g} s{who}",
                )
            await anyio.sleep(min(delay, remaining))
            delay = min(delay * 2, _POLL_MAX_S)
        self._hold(fd)
        return self

    def _hold(self, fd: int) -> None:
        self._fd = fd
        try:
            self._write_holder()
        except BaseException:
            self._release()
            raise

    def try_enter(self) -> bool:
        """Take the lease now if it is free (True), else False at once: a pool that picks among
        several devices tries each without waiting on any."""
        if self._fd is not None:
            raise LoomError(ErrorCode.INTERNAL, f"lease on {self.device_key} entered twice")
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        fd = _try_lock(self._lock_path)
        if fd is None:
            return False
        self._hold(fd)
        return True

    def release(self) -> None:
        self._release()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._release()

    def _write_holder(self) -> None:
        now = time.time()
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "device": self.device_key,
            "since": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
            "since_epoch": now,
        }
        tmp = self._holder_path.with_name(f"{self._holder_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self._holder_path)

    def _release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        # Label first, lock second: the next holder writes its label only after locking.
        with contextlib.suppress(OSError):
            self._holder_path.unlink()
        os.close(fd)
