"""Nsight Systems SQLite export (`nsys export --type sqlite`).

Built to the documented schema: CUPTI_ACTIVITY_KIND_KERNEL / _MEMCPY / _MEMSET (GPU work, ns),
CUPTI_ACTIVITY_KIND_RUNTIME (host API calls, joined by correlationId), StringIds (names),
TARGET_INFO_GPU (device names) and, when present, NVTX_EVENTS (ranges that become the "ops"
launches are attributed to; `emit_nvtx` ranges carry `sizes = [...]` which the FLOP models use).
Columns differ across nsys versions, so every query is built from the columns that exist.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from pathlib import Path
from typing import IO
from urllib.parse import quote

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.traces.events import KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET, NO_ID, OpSig, TraceData
from loom_mcp.traces.jsonstream import open_trace_file
from loom_mcp.traces.secrets import inspect_block, scrub_text

_NVTX_SIZES = re.compile(r"sizes\s*=\s*(\[.*\])")
_MAX_NVTX_SIZES = 64 << 10  # longer range names are not emit_nvtx shape records


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}  # noqa: S608 - fixed names


def _tables(db: sqlite3.Connection) -> set[str]:
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def _name_expr(cols: set[str], strings: bool, *candidates: str) -> str:
    """A SQL expression giving the event's name: a StringIds id column or a text column."""
    parts = []
    for c in candidates:
        if c in cols:
            if strings:
                parts.append(f"(SELECT value FROM StringIds WHERE id = t.{c})")
            parts.append(f"CASE WHEN typeof(t.{c}) = 'text' THEN t.{c} END")
    return "COALESCE(" + ", ".join(parts + ["'?'"]) + ")" if parts else "'?'"


def _col(cols: set[str], name: str, default: str = "-1") -> str:
    return f"t.{name}" if name in cols else default


def _connect(path: Path) -> tuple[sqlite3.Connection, IO[bytes]]:
    """Read-only connection to the file `open_trace_file` opened (no symlink followed, regular
    file only): on Linux SQLite opens it again through /proc/self/fd, i.e. the very inode that
    was checked, whatever the path points to by now."""
    fh = open_trace_file(path)
    try:
        fd_path = f"/proc/self/fd/{fh.fileno()}"
        target = fd_path if os.path.exists(fd_path) else os.path.abspath(path)
        db = sqlite3.connect(f"file:{quote(target)}?mode=ro", uri=True)
        db.execute("SELECT 1 FROM sqlite_master LIMIT 1")
    except sqlite3.DatabaseError as exc:
        fh.close()
        raise LoomError(ErrorCode.BAD_INPUT, f"{scrub_text(path.name)}: not a readable SQLite file ({exc})") from exc
    except BaseException:
        fh.close()
        raise
    return db, fh


def read_nsys(path: Path) -> TraceData:
    td = TraceData("nsys")
    names = td.names
    db, fh = _connect(path)
    try:
        tables = _tables(db)
        strings = "StringIds" in tables
        gpu_tables = [
            ("CUPTI_ACTIVITY_KIND_KERNEL", KIND_KERNEL),
            ("CUPTI_ACTIVITY_KIND_MEMCPY", KIND_MEMCPY),
            ("CUPTI_ACTIVITY_KIND_MEMSET", KIND_MEMSET),
        ]
        for table, kind in gpu_tables:
            if table not in tables:
                continue
            cols = _columns(db, table)
            if kind == KIND_KERNEL:
                name = _name_expr(cols, strings, "demangledName", "shortName", "mangledName")
            elif kind == KIND_MEMCPY:
                name = (
                    "'Memcpy ' || COALESCE((SELECT label FROM ENUM_CUDA_MEMCPY_OPER WHERE id = t.copyKind), "
                    "CAST(t.copyKind AS TEXT))"
                    if "copyKind" in cols and "ENUM_CUDA_MEMCPY_OPER" in tables
                    else "'Memcpy'"
                )
            else:
                name = "'Memset'"
            q = (
                f"SELECT {name}, t.start, t.end, {_col(cols, 'deviceId', '0')}, "
                f"{_col(cols, 'streamId')}, {_col(cols, 'correlationId')}, {_col(cols, 'bytes', '0')} "
                f"FROM {table} AS t"
            )
            for nm, start, end, dev, stream, corr, nbytes in db.execute(q):
                td.g_name.append(names(str(nm)))
                td.g_kind.append(kind)
                td.g_ts.append(start / 1000.0)
                td.g_dur.append(max(0, end - start) / 1000.0)
                td.g_dev.append(int(dev))
                td.g_stream.append(int(stream))
                td.g_corr.append(int(corr))
                td.g_ext.append(NO_ID)
                td.g_bytes.append(int(nbytes or 0))

        if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
            cols = _columns(db, "CUPTI_ACTIVITY_KIND_RUNTIME")
            name = _name_expr(cols, strings, "nameId", "name")
            q = (
                f"SELECT {name}, t.start, t.end, {_col(cols, 'globalTid', '0')}, t.correlationId "
                "FROM CUPTI_ACTIVITY_KIND_RUNTIME AS t"
            )
            for nm, start, end, tid, corr in db.execute(q):
                nm = str(nm)
                if "BeginCapture" in nm:
                    td.stream_capture_calls += 1
                td.l_name.append(names(nm))
                td.l_ts.append(start / 1000.0)
                td.l_dur.append(max(0, end - start) / 1000.0)
                td.l_thread.append(td.threads(("tid", int(tid))))  # type: ignore[arg-type]
                td.l_corr.append(int(corr))
                td.l_ext.append(NO_ID)
        else:
            td.notes.append("no CUDA runtime table: kernels cannot be linked to launches")

        if "NVTX_EVENTS" in tables:
            cols = _columns(db, "NVTX_EVENTS")
            text = _name_expr(cols, strings, "textId", "text")
            where = "WHERE t.end IS NOT NULL AND t.end > t.start"
            if "eventType" in cols:
                where += " AND t.eventType IN (59, 60, 70)"  # push/pop and start/end ranges
            q = f"SELECT {text}, t.start, t.end, {_col(cols, 'globalTid', '0')} FROM NVTX_EVENTS AS t {where}"
            for nm, start, end, tid in db.execute(q):
                nm = str(nm)
                dims = None
                m = _NVTX_SIZES.search(nm) if len(nm) <= _MAX_NVTX_SIZES else None
                opname = nm.split(",")[0].strip()
                if m:
                    try:
                        dims = json.loads(m.group(1))
                    except (ValueError, RecursionError):
                        dims = None
                key = json.dumps((opname, dims)).encode()
                sig = td.sig_ids.get(key)
                if sig is None:
                    sig = len(td.sigs)
                    td.sig_ids[key] = sig
                    td.sigs.append(OpSig(opname, dims, None, None))
                td.o_ext.append(NO_ID)
                td.o_sig.append(sig)
                td.o_ts.append(start / 1000.0)
                td.o_dur.append(max(0, end - start) / 1000.0)
                td.o_thread.append(td.threads(("tid", int(tid))))  # type: ignore[arg-type]

        for table, id_col in (("TARGET_INFO_GPU", "id"), ("TARGET_INFO_CUDA_DEVICE", "cudaId")):
            if table in tables:
                cols = _columns(db, table)
                if "name" in cols and id_col in cols:
                    for dev, nm in db.execute(f"SELECT {id_col}, name FROM {table}"):
                        td.devices.setdefault(int(dev), str(nm))

        # nsys records the whole process environment (DeviceEnvironment) and the command line;
        # they are inspected for the metadata note only, never kept.
        if "TARGET_INFO_SYSTEM_ENV" in tables:
            cols = _columns(db, "TARGET_INFO_SYSTEM_ENV")
            key_expr = _name_expr(cols, strings, "nameId", "name")
            val_expr = _name_expr(cols, strings, "valueId", "value")
            env = {
                str(k): str(v) for k, v in db.execute(f"SELECT {key_expr}, {val_expr} FROM TARGET_INFO_SYSTEM_ENV AS t")
            }
            td.metadata_blocks["TARGET_INFO_SYSTEM_ENV"] = inspect_block(env)
    finally:
        db.close()
        fh.close()
    return td
