"""openat2(2) through libc's syscall(), probed once, and the open flags safefs uses.

Linux >= 5.6 resolves a path beneath a directory with no symlink followed in one call; where it
is missing (or a seccomp filter answers ENOSYS/EPERM) safefs walks the components itself.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_NOCTTY = getattr(os, "O_NOCTTY", 0)
_O_PATH = getattr(os, "O_PATH", 0)
_AT_FDCWD = -100

_READ_FLAGS = os.O_RDONLY | _O_NONBLOCK | _O_NOCTTY | _O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC

# openat2(2): Linux >= 5.6. The syscall number is the same on every architecture but alpha.
_SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_openat2_state: dict[str, object] = {}
_probe_lock = threading.Lock()


def _raw_openat2(dirfd: int, path: bytes, flags: int, mode: int, resolve: int) -> int:
    fn = _openat2_state["syscall"]
    how = _OpenHow(flags, mode, resolve)
    fd = fn(
        ctypes.c_long(_SYS_OPENAT2),
        ctypes.c_int(dirfd),
        ctypes.c_char_p(path),  # type: ignore[operator]
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(path))
    return int(fd)


def openat2_available() -> bool:
    """Whether openat2(2) works here (probed once; seccomp filters can answer ENOSYS/EPERM)."""
    if "ok" in _openat2_state:
        return bool(_openat2_state["ok"])
    with _probe_lock:
        if "ok" in _openat2_state:
            return bool(_openat2_state["ok"])
        ok = False
        if sys.platform.startswith("linux") and os.uname().machine != "alpha" and _O_PATH:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fn = libc.syscall
                fn.restype = ctypes.c_long
                _openat2_state["syscall"] = fn
                fd = _raw_openat2(_AT_FDCWD, b"/", _O_PATH | _O_DIRECTORY | _O_CLOEXEC, 0, RESOLVE_NO_SYMLINKS)
                os.close(fd)
                ok = True
            except (OSError, AttributeError):
                ok = False
        _openat2_state["ok"] = ok
        return ok


def _use_fallback(value: bool) -> None:
    """Tests: force the component walk (False restores the probe's answer)."""
    _openat2_state.pop("ok", None)
    if value:
        _openat2_state["ok"] = False


__all__ = [
    "RESOLVE_BENEATH",
    "RESOLVE_NO_MAGICLINKS",
    "RESOLVE_NO_SYMLINKS",
    "RESOLVE_NO_XDEV",
    "openat2_available",
]
