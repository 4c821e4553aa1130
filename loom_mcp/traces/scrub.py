"""Remove environment dumps, tokens and keys from a trace before it is stored or shared.

Kineto traces are streamed: events pass through one at a time (re-serialised in batches, with
secret-looking strings replaced), so memory stays flat. Top-level members that PyTorch itself
writes are kept (after redaction); anything else a harness added (`metadata`, `environment`,
...) is dropped unless it is a plain number or boolean.
"""

from __future__ import annotations

import gzip
import shutil
import sqlite3
from pathlib import Path
from typing import IO, Any

import orjson

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.traces.jsonstream import JsonEventStream, json_error
from loom_mcp.traces.models import ScrubReport
from loom_mcp.traces.readers import detect_format
from loom_mcp.traces.secrets import (
    KINETO_KEYS,
    REDACTED,
    SECRET_VALUE_BYTES_RE,
    SECRET_VALUE_RE,
    inspect_block,
    redact_value,
    scrub_text,
)

_BATCH_BYTES = 1 << 20


def _open_out(dst: Path) -> IO[bytes]:
    if dst.suffix == ".gz":
        return gzip.open(dst, "wb", compresslevel=6)  # type: ignore[return-value]
    return open(dst, "wb")  # noqa: SIM115 - closed by the caller


def _split_top(top: dict[str, Any]) -> tuple[dict[str, Any], list[str], int, int]:
    kept: dict[str, Any] = {}
    removed: list[str] = []
    removed_keys = redacted = 0
    for k, v in top.items():
        if k == "traceEvents":
            continue
        if k in KINETO_KEYS or isinstance(v, (bool, int, float)):
            kept[k], n = redact_value(v)
            redacted += n
        else:
            removed.append(k)
            removed_keys += inspect_block(v)[0]
    return kept, removed, removed_keys, redacted


def _scrub_kineto(src: Path, dst: Path) -> ScrubReport:
    stream = JsonEventStream(src, "traceEvents")
    redacted = 0
    events = 0
    dumps = orjson.dumps
    with _open_out(dst) as out:
        out.write(b'{"traceEvents": [\n')
        batch: list[bytes] = []
        size = 0
        first = True

        def flush() -> None:
            nonlocal redacted, first, batch, size
            if not batch:
                return
            blob = b",\n".join(batch)
            blob, n = SECRET_VALUE_BYTES_RE.subn(REDACTED.encode(), blob)
            redacted += n
            out.write(blob if first else b",\n" + blob)
            first = False
            batch, size = [], 0

        for ev in stream:
            b = dumps(ev)
            batch.append(b)
            size += len(b)
            events += 1
            if size >= _BATCH_BYTES:
                flush()
        flush()
        out.write(b"\n]")
        kept, removed, removed_keys, n = _split_top(stream.top)
        redacted += n
        for k, v in kept.items():
            out.write(b",\n" + dumps(k) + b": " + dumps(v))
        out.write(b"\n}\n")
    return _report(src, dst, events, removed, removed_keys, redacted)


def _report(src: Path, dst: Path, events: int, removed: list[str], removed_keys: int, redacted: int) -> ScrubReport:
    return ScrubReport(
        src=src.name,
        bytes_in=src.stat().st_size,
        dst=dst.name,
        bytes_out=dst.stat().st_size,
        events=events,
        removed_blocks=removed,
        removed_keys=removed_keys,
        redacted_values=redacted,
    )


# rocprofv3 documents are scrubbed whole (as Python objects, about 7x the JSON): refused above
# this inflated size rather than let one file take the server's memory.
ROCPROF_SCRUB_LIMIT = 256 << 20


def _scrub_rocprofv3(src: Path, dst: Path) -> ScrubReport:
    from loom_mcp.traces.readers.rocprof import _read_capped

    data = _read_capped(src, ROCPROF_SCRUB_LIMIT)
    if data is None:
        raise LoomError(
            ErrorCode.BAD_INPUT,
            f"{scrub_text(src.name)}: rocprofv3 trace over {ROCPROF_SCRUB_LIMIT >> 20} MiB "
            "(inflated); too large to scrub",
        )
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise json_error(src, exc) from exc
    del data
    if not isinstance(doc, dict):
        raise LoomError(ErrorCode.BAD_INPUT, f"{scrub_text(src.name)}: not a rocprofv3 document")
    removed: list[str] = []
    removed_keys = 0
    for i, sec in enumerate(doc.get("rocprofiler-sdk-tool") or []):
        if isinstance(sec, dict) and "metadata" in sec:
            # hostname, command line, output paths, config: none of it is needed for analysis.
            removed.append(f"rocprofiler-sdk-tool[{i}].metadata")
            removed_keys += inspect_block(sec.pop("metadata"))[0]
    doc, redacted = redact_value(doc)
    events = sum(
        len((sec.get("buffer_records") or {}).get("kernel_dispatch") or [])
        for sec in doc.get("rocprofiler-sdk-tool") or []
        if isinstance(sec, dict)
    )
    with _open_out(dst) as out:
        out.write(orjson.dumps(doc))
    return _report(src, dst, events, removed, removed_keys, redacted)


def _scrub_nsys(src: Path, dst: Path) -> ScrubReport:
    shutil.copyfile(src, dst)
    removed: list[str] = []
    removed_keys = redacted = 0
    db = sqlite3.connect(dst)
    try:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for t in ("TARGET_INFO_SYSTEM_ENV",):  # the recorded process environment
            if t in tables:
                removed_keys += db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]  # noqa: S608
                db.execute(f"DROP TABLE {t}")  # noqa: S608
                removed.append(t)
                tables.remove(t)
        # Tokens can also sit in strings (command lines, NVTX text): redact them wherever
        # they are, in every text column of every table.
        db.create_function(
            "loom_is_secret",
            1,
            lambda v: isinstance(v, str) and SECRET_VALUE_RE.search(v) is not None,
        )
        db.create_function(
            "loom_redact",
            1,
            lambda v: SECRET_VALUE_RE.sub(REDACTED, v) if isinstance(v, str) else v,
        )
        for t in tables:
            if t.startswith("sqlite_"):
                continue
            for col in [r[1] for r in db.execute(f"PRAGMA table_info({t})")]:  # noqa: S608
                cur = db.execute(
                    f'UPDATE "{t}" SET "{col}" = loom_redact("{col}") WHERE loom_is_secret("{col}")'  # noqa: S608
                )
                redacted += max(cur.rowcount, 0)
        count = 0
        if "CUPTI_ACTIVITY_KIND_KERNEL" in tables:
            count = db.execute("SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()[0]
        db.commit()
        db.execute("VACUUM")  # dropped pages would otherwise still hold the old bytes
    finally:
        db.close()
    return _report(src, dst, count, removed, removed_keys, redacted)


def scrub_trace(src: Path, dst: Path) -> ScrubReport:
    """Write a copy of `src` without environment dumps, tokens or keys; report what went."""
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise LoomError(ErrorCode.NOT_FOUND, f"trace not found: {src}")
    if src.resolve() == dst.resolve():
        raise LoomError(ErrorCode.BAD_INPUT, "scrub_trace needs a destination other than the source")
    fmt = detect_format(src)
    if fmt == "nsys":
        return _scrub_nsys(src, dst)
    if fmt == "rocprofv3":
        return _scrub_rocprofv3(src, dst)
    return _scrub_kineto(src, dst)
