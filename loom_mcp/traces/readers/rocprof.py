"""rocprofv3 (rocprofiler-sdk tool) JSON: agents, kernel symbols and buffer records.

Timestamps are nanoseconds; they are turned into microseconds like every other reader.
Host API records (hip_api) link kernels to their launches through the internal correlation id;
a trace collected with kernel tracing only has none, which the analysis flags.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import ijson
import orjson

from loom_mcp.traces.events import KIND_KERNEL, KIND_MEMCPY, NO_ID, TraceData
from loom_mcp.traces.jsonstream import BigIntSafeReader, open_bytes
from loom_mcp.traces.secrets import inspect_block

ROOT = "rocprofiler-sdk-tool"
# Above this (uncompressed) size the file is read in several streaming passes instead of
# being loaded whole; each pass costs a full tokenisation but memory stays flat.
WHOLE_LOAD_LIMIT = 512 << 20

_MEMCPY_KIND_INDEX = 10  # MEMORY_COPY in rocprofiler's buffer-record kind enum


def _uncompressed_size(path: Path) -> int:
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(2) != b"\x1f\x8b":
            return size
        f.seek(-4, 2)
        isize = struct.unpack("<I", f.read(4))[0]  # modulo 2**32, like gzip's own trailer
    return max(isize, size)


def _handle(v: Any) -> int:
    if isinstance(v, dict):
        v = v.get("handle", v.get("internal"))
    return int(v) if isinstance(v, (int, float)) else NO_ID


def _sections(path: Path) -> list[dict[str, Any]]:
    """One dict per profiled process, with the members this reader uses."""
    if _uncompressed_size(path) <= WHOLE_LOAD_LIMIT:
        with open_bytes(path) as f:
            doc = orjson.loads(f.read())
        tools = doc.get(ROOT) or []
        return [t for t in tools if isinstance(t, dict)]
    # Streaming: one pass per member (each pass is flat in memory). Only one process section
    # is supported on this path, which is what rocprofv3 writes per output file.
    sec: dict[str, Any] = {"buffer_records": {}, "strings": {}}
    base = f"{ROOT}.item"
    passes = {
        "metadata": f"{base}.metadata",
        "agents": f"{base}.agents.item",
        "kernel_symbols": f"{base}.kernel_symbols.item",
        "strings.buffer_records": f"{base}.strings.buffer_records.item",
        "buffer_records.kernel_dispatch": f"{base}.buffer_records.kernel_dispatch.item",
        "buffer_records.memory_copy": f"{base}.buffer_records.memory_copy.item",
        "buffer_records.hip_api": f"{base}.buffer_records.hip_api.item",
    }
    for key, prefix in passes.items():
        with open_bytes(path) as f:
            items = list(ijson.items(BigIntSafeReader(f), prefix, use_float=True))
        if key == "metadata":
            sec["metadata"] = items[0] if items else {}
        elif "." in key:
            outer, inner = key.split(".", 1)
            sec[outer][inner] = items
        else:
            sec[key] = items
    return [sec]


def read_rocprofv3(path: Path) -> TraceData:
    td = TraceData("rocprofv3")
    names = td.names
    for n_sec, sec in enumerate(_sections(path)):
        if "metadata" in sec:
            # hostname, command line, environment-derived config: inspected, never kept.
            td.metadata_blocks[f"metadata[{n_sec}]" if n_sec else "metadata"] = inspect_block(
                sec["metadata"]
            )
        gpu_agents: set[int] = set()
        for a in sec.get("agents") or []:
            if a.get("type") == 2:  # GPU agent
                h = _handle(a.get("id"))
                gpu_agents.add(h)
                td.devices[h] = str(
                    a.get("product_name") or a.get("marketing_name") or a.get("name") or "AMD GPU"
                )
        symbols: dict[int, str] = {}
        for s in sec.get("kernel_symbols") or []:
            symbols[int(s.get("kernel_id", -1))] = str(
                s.get("formatted_kernel_name")
                or s.get("demangled_kernel_name")
                or s.get("kernel_name")
                or "?"
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
        td.notes.append(
            "no HIP API records (collected without --hip-trace): kernels cannot be linked to launches"
        )
    return td
