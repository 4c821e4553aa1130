"""A vendor's management library (NVML's pynvml, ROCm's amdsmi) opened once per process.

Opening costs tens of milliseconds, every query after it microseconds, and device_info must stay
fast when warm; a failure is remembered for RETRY_AFTER_S so a warm call never re-probes a dead
stack, then tried again (a driver loaded since is found).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import ModuleType

RETRY_AFTER_S = 30.0

# Imports and initialises the library: the module, or None and the plain reason why not.
Opener = Callable[[], tuple[ModuleType | None, str]]


class LibrarySession:
    """The initialised library module, or None and why not, opened at most once at a time."""

    def __init__(self, open_library: Opener) -> None:
        self._open = open_library
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._status: str | None = None  # None until the first attempt; then "ok" or the reason
        self._failed_at = 0.0

    def __call__(self) -> tuple[ModuleType | None, str]:
        with self._lock:
            if self._status == "ok" or (
                self._status is not None and time.monotonic() - self._failed_at < RETRY_AFTER_S
            ):
                return self._module, self._status
            self._failed_at = time.monotonic()
            self._module, self._status = self._open()
            return self._module, self._status
