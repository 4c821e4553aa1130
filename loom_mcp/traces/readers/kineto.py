"""PyTorch profiler (Kineto) Chrome-trace JSON, CUDA and ROCm, plain or gzip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.traces.events import (
    KIND_KERNEL,
    KIND_MEMCPY,
    KIND_MEMSET,
    NO_ID,
    OpSig,
    TraceData,
)
from loom_mcp.traces.jsonstream import JsonEventStream
from loom_mcp.traces.secrets import KINETO_KEYS, inspect_block, scrub_text

# Category spellings differ across Kineto versions (old traces capitalise them).
GPU_CATS = {
    "kernel": KIND_KERNEL,
    "Kernel": KIND_KERNEL,
    "gpu_memcpy": KIND_MEMCPY,
    "Memcpy": KIND_MEMCPY,
    "gpu_memset": KIND_MEMSET,
    "Memset": KIND_MEMSET,
}
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver", "Runtime", "hip_runtime", "hip_driver"})
OP_CATS = frozenset({"cpu_op", "user_annotation", "Operator"})


def _int(v: Any, default: int = NO_ID) -> int:
    if isinstance(v, int):
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def read_kineto(path: Path) -> TraceData:
    td = TraceData("kineto")
    stream = JsonEventStream(path, "traceEvents")
    names = td.names
    threads = td.threads
    # Bound methods hoisted out of the loop: this loop runs once per event (millions).
    g_name, g_kind, g_ts, g_dur = (
        td.g_name.append,
        td.g_kind.append,
        td.g_ts.append,
        td.g_dur.append,
    )
    g_dev, g_stream, g_corr = td.g_dev.append, td.g_stream.append, td.g_corr.append
    g_ext, g_bytes = td.g_ext.append, td.g_bytes.append
    l_name, l_ts, l_dur = td.l_name.append, td.l_ts.append, td.l_dur.append
    l_thread, l_corr, l_ext = td.l_thread.append, td.l_corr.append, td.l_ext.append
    o_ext, o_sig, o_ts = td.o_ext.append, td.o_sig.append, td.o_ts.append
    o_dur, o_thread = td.o_dur.append, td.o_thread.append
    sig_ids = td.sig_ids
    dumps = orjson.dumps
    empty: dict[str, Any] = {}

    with stream.items() as (events, rec):
        for e in events:
            stream.last_pos = rec.pos
            if type(e) is not dict:  # a JSON file of other things (a list of numbers, say)
                raise LoomError(
                    ErrorCode.BAD_INPUT,
                    f"{scrub_text(path.name)}: its events are not JSON objects; not a Kineto/PyTorch trace",
                )
            ph = e.get("ph")
            if ph != "X":
                if ph == "f" and e.get("cat") == "ac2g":
                    fid = e.get("id")
                    if isinstance(fid, int):
                        td.f_dev.append(_int(e.get("pid")))
                        td.f_stream.append(_int(e.get("tid")))
                        td.f_ts.append(float(e.get("ts", 0.0)))
                        td.f_id.append(fid)
                continue
            cat = e.get("cat")
            kind = GPU_CATS.get(cat)  # type: ignore[arg-type]
            if kind is not None:
                args = e.get("args") or empty
                g_name(names(e.get("name", "?")))
                g_kind(kind)
                g_ts(float(e["ts"]))
                g_dur(float(e.get("dur") or 0.0))
                g_dev(_int(args.get("device", e.get("pid")), 0))
                g_stream(_int(args.get("stream", e.get("tid")), 0))
                g_corr(_int(args.get("correlation")))
                g_ext(_int(args.get("External id")))
                g_bytes(_int(args.get("bytes"), 0))
            elif cat in LAUNCH_CATS:
                args = e.get("args") or empty
                name = e.get("name", "?")
                if "BeginCapture" in name:
                    td.stream_capture_calls += 1
                corr = args.get("correlation")
                if corr is None:
                    continue
                l_name(names(name))
                l_ts(float(e["ts"]))
                l_dur(float(e.get("dur") or 0.0))
                l_thread(threads((e.get("pid"), e.get("tid"))))  # type: ignore[arg-type]
                l_corr(_int(corr))
                l_ext(_int(args.get("External id")))
            elif cat in OP_CATS:
                args = e.get("args") or empty
                name = e.get("name", "?")
                dims = args.get("Input Dims")
                types = args.get("Input type")
                # One signature per (name, shapes, dtypes): shapes are what the FLOP and byte
                # models need, and grouping by them keeps per-call numbers comparable.
                key = dumps((name, dims, types))
                sig = sig_ids.get(key)
                if sig is None:
                    sig = len(td.sigs)
                    sig_ids[key] = sig
                    td.sigs.append(OpSig(name, dims, types, args.get("Concrete Inputs")))
                o_ext(_int(args.get("External id")))
                o_sig(sig)
                o_ts(float(e["ts"]))
                o_dur(float(e.get("dur") or 0.0))
                o_thread(threads((e.get("pid"), e.get("tid"))))  # type: ignore[arg-type]

    top = stream.top
    for d in top.get("deviceProperties") or []:
        if isinstance(d, dict) and "name" in d:
            td.devices[_int(d.get("id"), len(td.devices))] = str(d["name"])
    for k, v in top.items():
        # Unknown numbers and booleans are new profiler flags, not metadata worth a warning.
        if k not in KINETO_KEYS and not isinstance(v, (bool, int, float)):
            td.metadata_blocks[k] = inspect_block(v)
    if stream.bare_array:
        td.notes.append("bare JSON array trace: no device properties")
    return td
