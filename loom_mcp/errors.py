"""Typed errors with stable codes. The MCP layer turns them into ToolError("[CODE] message")."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from enum import Enum
from pathlib import Path


class ErrorCode(str, Enum):
    BAD_INPUT = "BAD_INPUT"
    NOT_FOUND = "NOT_FOUND"
    COMPILE_ERROR = "COMPILE_ERROR"
    TIMEOUT = "TIMEOUT"
    CANCELLED = "CANCELLED"
    DEVICE_BUSY = "DEVICE_BUSY"
    BUDGET_EXHAUSTED = "BUDGET_EXHAUSTED"
    TOOLCHAIN_MISSING = "TOOLCHAIN_MISSING"
    WORKER_CRASHED = "WORKER_CRASHED"
    NOT_ALLOWED = "NOT_ALLOWED"
    INTERNAL = "INTERNAL"
    # A job ended on one of its sandbox limits (memory, disk quota) or its disk was full.
    RESOURCE_LIMIT = "RESOURCE_LIMIT"
    # Append new members at the end; never reorder (codes are recorded in ledgers).
    DISK_FULL = "DISK_FULL"  # ENOSPC / EDQUOT / SQLITE_FULL under LOOM_HOME or a job directory
    READ_ONLY = "READ_ONLY"  # LOOM_HOME (or the ledger) cannot be written: EROFS, EACCES, EPERM
    LEDGER_CORRUPT = "LEDGER_CORRUPT"  # ledger.sqlite3 is not a readable loom ledger
    CONFIG_INVALID = "CONFIG_INVALID"  # loom.toml (the human's file) does not parse or validate
    INTERRUPTED = "INTERRUPTED"  # the node or worker running a job was lost, twice (Ray executor)


class LoomError(Exception):
    """An error the agent can act on. `str(err)` is "[CODE] message"."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code.value}] {self.message}"

    def __reduce__(self):
        # Raised in a Ray task, it is pickled back to the server with its code.
        return (type(self), (self.code, self.message))


# ---------------------------------------------------------------- storage faults

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_READ_ONLY_ERRNOS = frozenset({errno.EROFS})
_DENIED_ERRNOS = frozenset({errno.EACCES, errno.EPERM})
_SQLITE_READONLY, _SQLITE_IOERR, _SQLITE_FULL, _SQLITE_CANTOPEN = 8, 10, 13, 14
# Below this much free space a filesystem counts as full: SQLite, git and the workers all need
# room for more than a page or two.
FULL_BELOW_BYTES = 1 << 20


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception, what caused it or was being handled, and the members of exception groups."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack.extend(e for e in (current.__cause__, current.__context__) if e is not None)
        members = getattr(current, "exceptions", None)  # an ExceptionGroup (3.10: the backport)
        if isinstance(members, tuple):
            stack.extend(m for m in members if isinstance(m, BaseException))


def _under(path: str | bytes | int | None, home: Path | None) -> bool:
    if home is None or not isinstance(path, (str, bytes)):
        return False
    try:
        resolved = Path(os.fsdecode(path)).resolve()
    except (OSError, ValueError):
        return False
    return resolved == home or home in resolved.parents


def filesystem_state(path: Path) -> ErrorCode | None:
    """READ_ONLY when the filesystem holding `path` is mounted read-only or `path` cannot be
    written by this process, DISK_FULL when it has less than FULL_BELOW_BYTES free, else None."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY or not os.access(path, os.W_OK):
        return ErrorCode.READ_ONLY
    free_blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # root may use reserved blocks
    if free_blocks * st.f_frsize < FULL_BELOW_BYTES:
        return ErrorCode.DISK_FULL
    return None


def storage_hint(code: ErrorCode, home: Path | None) -> str:
    where = f"LOOM_HOME ({home})" if home else "LOOM_HOME"
    if code is ErrorCode.DISK_FULL:
        return (
            f"free space on the filesystem holding {where} (old job directories under its jobs/ "
            "can go; `df -h` shows what is left) or start the server with --home on a larger "
            "disk, then retry"
        )
    return (
        f"loom-mcp writes its ledger, artifacts and job directories under {where}: remount it "
        "read-write, fix its ownership/permissions, or start the server with --home on a "
        "writable directory"
    )


def storage_error(exc: BaseException, home: Path | None) -> LoomError | None:
    """A DISK_FULL / READ_ONLY LoomError when `exc` (or anything in its chain) is a storage fault
    under `home`: ENOSPC/EDQUOT anywhere, EROFS anywhere, EACCES/EPERM on a path under `home`,
    SQLite's FULL/READONLY, or an I/O error while the filesystem holding `home` is full or
    read-only. None for anything else."""
    import sqlite3

    code: ErrorCode | None = None
    detail = ""
    probe = False
    for current in _causes(exc):
        if isinstance(current, OSError) and current.errno is not None:
            name = current.filename if current.filename is not None else ""
            what = f"{current.strerror or current}{f': {name}' if name else ''}"
            if current.errno in _FULL_ERRNOS:
                code, detail = ErrorCode.DISK_FULL, what
                break
            if current.errno in _READ_ONLY_ERRNOS or (
                current.errno in _DENIED_ERRNOS and _under(current.filename, home)
            ):
                code, detail = ErrorCode.READ_ONLY, what
                break
            if current.errno == errno.EIO:
                probe = True
        elif isinstance(current, sqlite3.Error):
            sqlite_code = getattr(current, "sqlite_errorcode", None)
            primary = None if sqlite_code is None else int(sqlite_code) & 0xFF
            text = str(current)
            if primary == _SQLITE_FULL or "disk is full" in text:
                code, detail = ErrorCode.DISK_FULL, f"ledger: {text}"
                break
            if primary == _SQLITE_READONLY or "readonly database" in text:
                code, detail = ErrorCode.READ_ONLY, f"ledger: {text}"
                break
            if primary in (_SQLITE_IOERR, _SQLITE_CANTOPEN) or "disk I/O error" in text:
                probe = True
    if code is None and probe and home is not None:
        code = filesystem_state(home)
        detail = "I/O error while the filesystem is " + ("full" if code is ErrorCode.DISK_FULL else "read-only")
    if code is None:
        return None
    what = "no space left" if code is ErrorCode.DISK_FULL else "cannot write"
    return LoomError(code, f"{what} ({detail}); {storage_hint(code, home)}")
