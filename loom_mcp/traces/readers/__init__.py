"""Trace readers: each turns one profiler's output into a `TraceData`."""

from __future__ import annotations

from pathlib import Path

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.traces.events import TraceData
from loom_mcp.traces.jsonstream import open_trace_file, peek
from loom_mcp.traces.secrets import scrub_text

SQLITE_MAGIC = b"SQLite format 3\x00"


def detect_format(path: Path) -> str:
    """'nsys' (SQLite export), 'rocprofv3' (rocprofiler-sdk JSON) or 'kineto' (Chrome JSON)."""
    with open_trace_file(path) as f:
        magic = f.read(16)
    if magic == SQLITE_MAGIC:
        return "nsys"
    head = peek(path, 4096).lstrip()
    if head.startswith(b"{") and b'"rocprofiler-sdk-tool"' in head[:200]:
        return "rocprofv3"
    if head[:1] in (b"{", b"["):
        return "kineto"
    raise LoomError(
        ErrorCode.BAD_INPUT,
        f"{scrub_text(path.name)}: not a Kineto/PyTorch, rocprofv3 or nsys trace",
    )


def read_trace(path: Path) -> TraceData:
    """Read any supported trace. Every reader's output leaves through here, scrubbed: no name,
    device or annotation from the file reaches the analysis with a secret in it."""
    if not path.is_file():
        raise LoomError(ErrorCode.NOT_FOUND, f"trace not found: {scrub_text(str(path))}")
    fmt = detect_format(path)
    if fmt == "nsys":
        from loom_mcp.traces.readers.nsys import read_nsys

        td = read_nsys(path)
    elif fmt == "rocprofv3":
        from loom_mcp.traces.readers.rocprof import read_rocprofv3

        td = read_rocprofv3(path)
    else:
        from loom_mcp.traces.readers.kineto import read_kineto

        td = read_kineto(path)
    td.scrub()
    return td
