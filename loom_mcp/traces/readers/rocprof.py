"""rocprofv3 (rocprofiler-sdk tool) JSON: agents, kernel symbols and buffer records.

Timestamps are nanoseconds; they are turned into microseconds like every other reader.
Host API records (hip_api) link kernels to their launches through the internal correlation id;
a trace collected with kernel tracing only has none, which the analysis flags.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ijson
import orjson

from loom_mcp.traces.events import KIND_KERNEL, KIND_MEMCPY, NO_ID, TraceData
from loom_mcp.traces.jsonstream import (
    BigIntSafeReader,
    json_error,
    open_bytes,
    open_trace_file,
)
from loom_mcp.traces.secrets import inspect_block

ROOT = "rocprofiler-sdk-tool"
# Up to this (uncompressed) size the file is parsed in one go, which holds the whole document as
# Python objects (about 7x the JSON: 37 MB -> 280 MB RSS); above it, in several streaming
# passes, each a full tokenisation, with the records consumed one at a time so memory stays flat.
WHOLE_LOAD_LIMIT = 128 << 20

_MEMCPY_KIND_INDEX = 10  # MEMORY_COPY in rocprofiler's buffer-record kind enum
_CHUNK = 1 << 20


def _claimed_size(path: Path) -> int:
    """Uncompressed size as the file claims it (gzip trailer, modulo 2**32). Only a hint for
    choosing the path: a file that claims less than it holds is cut off at the limit anyway."""
    size = path.stat().st_size
    with open_trace_file(path) as f:
        if f.read(2) != b"\x1f\x8b":
            return size
        f.seek(-4, 2)
        isize = struct.unpack("<I", f.read(4))[0]
    return max(isize, size)


def _read_capped(path: Path, cap: int) -> bytes | None:
    """The whole (inflated) file, or None when it holds more than `cap` bytes."""
    parts: list[bytes] = []
    total = 0
    with open_bytes(path) as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                return b"".join(parts)
            total += len(b)
            if total > cap:
                return None
            parts.append(b)


def _handle(v: Any) -> int:
    if isinstance(v, dict):
        v = v.get("handle", v.get("internal"))
    return int(v) if isinstance(v, (int, float)) else NO_ID


class _Records:
    """The items under one prefix, read by a streaming pass when iterated (once)."""

    def __init__(self, path: Path, prefix: str) -> None:
        self.path = path
        self.prefix = prefix

    def __iter__(self) -> Iterator[Any]:
        with open_bytes(self.path) as f:
            try:
                yield from ijson.items(BigIntSafeReader(f), self.prefix, use_float=True)
            except ijson.JSONError as exc:
                raise json_error(self.path, exc) from exc


def _sections(path: Path) -> list[dict[str, Any]]:
    """One dict per profiled process, with the members this reader uses."""
    data = _read_capped(path, WHOLE_LOAD_LIMIT) if _claimed_size(path) <= WHOLE_LOAD_LIMIT else None
    if data is not None:
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            if "memory" in str(exc).lower():  # orjson reports a failed allocation this way
                raise MemoryError(str(exc)) from exc
            raise json_error(path, exc) from exc
        del data
        tools = doc.get(ROOT) if isinstance(doc, dict) else None
        return [t for t in tools or [] if isinstance(t, dict)]
    # Streaming: one pass per member. Only one process section is supported on this path,
    # which is what rocprofv3 writes per output file. The small members are kept; the record
    # arrays are consumed one record at a time by the reader.
    base = f"{ROOT}.item"

    def small(prefix: str) -> list[Any]:
        return list(_Records(path, f"{base}.{prefix}"))

    metadata = small("metadata")
    return [
        {
            "metadata": metadata[0] if metadata else {},
            "agents": small("agents.item"),
            "kernel_symbols": small("kernel_symbols.item"),
            "strings": {"buffer_records": small("strings.buffer_records.item")},
            "buffer_records": {
                kind: _Records(path, f"{base}.buffer_records.{kind}.item")
                for kind in ("kernel_dispatch", "memory_copy", "hip_api")
            },
        }
    ]


def read_rocprofv3(path: Path) -> TraceData:
    td = TraceData("rocprofv3")
    names = td.names
    for n_sec, sec in enumerate(_sections(path)):
        if "metadata" in sec:
            # hostname, command line, environment-derived config: inspected, never kept.
            td.metadata_blocks[f"metadata[{n_sec}]" if n_sec else "metadata"] = inspect_block(sec["metadata"])
        gpu_agents: set[int] = set()
        for a in sec.get("agents") or []:
            if a.get("type") == 2:  # GPU agent
                h = _handle(a.get("id"))
                gpu_agents.add(h)
                td.devices[h] = str(a.get("product_name") or a.get("marketing_name") or a.get("name") or "AMD GPU")
        symbols: dict[int, str] = {}
        for s in sec.get("kernel_symbols") or []:
            symbols[int(s.get("kernel_id", -1))] = str(
                s.get("formatted_kernel_name") or s.get("demangled_kernel_name") or s.get("kernel_name") or "?"
            )
        kinds = (sec.get("strings") or {}).get("buffer_records") or []
        ops_by_kind = [k.get("operations") or [] for k in kinds]
        buffers = sec.get("buffer_records") or {}

        for r in buffers.get("kernel_dispatch") or []:
            di = r.get("dispatch_info") or {}
            start, end = r.get("start_timestamp", 0), r.get("end_timestamp", 0)
            corr = r.get("correlation_id") or {}
            td.g_name.append(names(symbols.get(int(di.get("kernel_id", -1)), "?")))
            td.g_kind.append(KIND_KERNEL)
            td.g_ts.append(start / 1000.0)
            td.g_dur.append(max(0, end - start) / 1000.0)
            td.g_dev.append(_handle(di.get("agent_id")))
            td.g_stream.append(_handle(di.get("queue_id")))
            td.g_corr.append(int(corr.get("internal", NO_ID)) if isinstance(corr, dict) else NO_ID)
            ext = corr.get("external", 0) if isinstance(corr, dict) else 0
            td.g_ext.append(int(ext) if ext else NO_ID)
            td.g_bytes.append(0)

        copy_ops = ops_by_kind[_MEMCPY_KIND_INDEX] if len(ops_by_kind) > _MEMCPY_KIND_INDEX else []
        for r in buffers.get("memory_copy") or []:
            start, end = r.get("start_timestamp", 0), r.get("end_timestamp", 0)
            op = int(r.get("operation", 0))
            label = copy_ops[op] if 0 <= op < len(copy_ops) else f"MEMORY_COPY_{op}"
            dst, src = _handle(r.get("dst_agent_id")), _handle(r.get("src_agent_id"))
            dev = dst if dst in gpu_agents else src
            corr = r.get("correlation_id") or {}
            td.g_name.append(names("Memcpy " + label.replace("MEMORY_COPY_", "")))
            td.g_kind.append(KIND_MEMCPY)
            td.g_ts.append(start / 1000.0)
            td.g_dur.append(max(0, end - start) / 1000.0)
            td.g_dev.append(dev)
            td.g_stream.append(NO_ID)
            td.g_corr.append(int(corr.get("internal", NO_ID)) if isinstance(corr, dict) else NO_ID)
            td.g_ext.append(NO_ID)
            td.g_bytes.append(int(r.get("bytes", 0) or 0))

        for r in buffers.get("hip_api") or []:
            kind, op = int(r.get("kind", 0)), int(r.get("operation", 0))
            table = ops_by_kind[kind] if 0 <= kind < len(ops_by_kind) else []
            name = table[op] if 0 <= op < len(table) else f"hip_api_{op}"
            if "BeginCapture" in name:
                td.stream_capture_calls += 1
            corr = r.get("correlation_id") or {}
            start, end = r.get("start_timestamp", 0), r.get("end_timestamp", 0)
            td.l_name.append(names(name))
            td.l_ts.append(start / 1000.0)
            td.l_dur.append(max(0, end - start) / 1000.0)
            td.l_thread.append(td.threads(("tid", r.get("thread_id"))))  # type: ignore[arg-type]
            td.l_corr.append(int(corr.get("internal", NO_ID)) if isinstance(corr, dict) else NO_ID)
            td.l_ext.append(NO_ID)
    if not len(td.l_ts):
        td.notes.append("no HIP API records (collected without --hip-trace): kernels cannot be linked to launches")
    return td
