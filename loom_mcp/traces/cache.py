"""Content-addressed cache of analyses: a second look at the same trace costs a file read.

The key is the content hash of the trace (and baseline), top_k and the analysis version. Hashing
a 1 GB file takes seconds, so hashes are remembered by (path, size, mtime_ns) in a small JSON
index; a hit then needs only a stat.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path

import orjson
from filelock import FileLock

from loom_mcp.traces.api import SUMMARY_FILE, analyze_trace_file
from loom_mcp.traces.limits import TraceLimits
from loom_mcp.traces.models import TraceAnalysis
from loom_mcp.traces.summary import ANALYSIS_VERSION

HASH_INDEX = "hash_index.json"
_BLOCK = 8 << 20


def trace_content_hash(path: Path) -> str:
    """blake2b-256 of the file's bytes, read in blocks."""
    from loom_mcp.traces.jsonstream import open_trace_file

    h = hashlib.blake2b(digest_size=32)
    with open_trace_file(path) as f:
        while True:
            b = f.read(_BLOCK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _hash_with_index(path: Path, cache_root: Path) -> str:
    st = path.stat()
    real = str(path.resolve())
    index_path = cache_root / HASH_INDEX
    stamp = [st.st_size, st.st_mtime_ns]
    with FileLock(str(index_path) + ".lock"):
        try:
            index = orjson.loads(index_path.read_bytes())
        except (FileNotFoundError, orjson.JSONDecodeError):
            index = {}
        hit = index.get(real)
        if hit and hit[:2] == stamp:
            return str(hit[2])
    digest = trace_content_hash(path)
    with FileLock(str(index_path) + ".lock"):
        try:
            index = orjson.loads(index_path.read_bytes())
        except (FileNotFoundError, orjson.JSONDecodeError):
            index = {}
        index[real] = [*stamp, digest]
        tmp = index_path.with_suffix(f".{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(orjson.dumps(index))
        os.replace(tmp, index_path)
    return digest


def analyze_trace_cached(
    trace: Path,
    *,
    baseline: Path | None = None,
    top_k: int = 10,
    cache_root: Path,
    limits: TraceLimits | None = None,
    isolate: bool = True,
) -> TraceAnalysis:
    """Analysis of `trace` (and `baseline`) from the cache, or computed and stored.

    A miss is analysed in a child process bounded in memory and wall time (`isolate.py`), so a
    hostile trace costs the caller nothing but a `[BAD_INPUT]` error; `isolate=False` runs it
    in this process (the nesting and inflation limits still hold, memory and time do not).
    """
    trace = Path(trace)
    cache_root = Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    parts = [ANALYSIS_VERSION, _hash_with_index(trace, cache_root)]
    parts.append(_hash_with_index(Path(baseline), cache_root) if baseline is not None else "-")
    parts.append(str(top_k))
    key = hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()
    final = cache_root / key
    summary_path = final / SUMMARY_FILE
    if summary_path.is_file():
        s = TraceAnalysis.model_validate_json(summary_path.read_bytes())
    else:
        # Build in a private directory and rename into place, so a reader never sees a
        # half-written entry and two concurrent misses do not clobber each other.
        tmp = cache_root / f".tmp-{key}-{uuid.uuid4().hex}"
        try:
            if isolate:
                from loom_mcp.traces.isolate import analyze_isolated

                analyze_isolated(trace, baseline=baseline, top_k=top_k, out_dir=tmp, limits=limits)
            else:
                analyze_trace_file(trace, baseline=baseline, top_k=top_k, out_dir=tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        s = TraceAnalysis.model_validate_json((tmp / SUMMARY_FILE).read_bytes())
        s.artifact_dir = str(final)
        (tmp / SUMMARY_FILE).write_text(s.model_dump_json(indent=1))
        try:
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    # Same bytes may come under another name: report the names of this call.
    s.trace = trace.name
    if s.diff is not None and baseline is not None:
        s.diff.baseline = Path(baseline).name
    s.artifact_dir = str(final)
    return s
