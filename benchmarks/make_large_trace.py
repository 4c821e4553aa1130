"""Build a large Kineto trace by replicating a real one, for scale tests of the trace analyzer.

Copy k is shifted in time by k x (span of the source + 1 ms), and every id that links events
(`External id`, `correlation`, the ac2g flow `id`, Python ids, `Ev Idx`) is offset by
k x a stride larger than any id in the source, so linking stays exact across copies.

    python benchmarks/make_large_trace.py SRC.json[.gz] DST.json --target-mb 1000 [--style kineto|compact]

`kineto` writes each event the way libkineto does (indented, several lines per event), which
is what a real 1 GB trace looks like; `compact` writes one event per line.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

import orjson

_ID_ARGS = ("External id", "correlation", "Python id", "Python parent id", "Ev Idx")


def _load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return orjson.loads(f.read())


def _id_stride(events: list[dict]) -> int:
    top = 0
    for e in events:
        if e.get("ph") in ("s", "f") and isinstance(e.get("id"), int):
            top = max(top, e["id"])
        args = e.get("args")
        if isinstance(args, dict):
            for k in _ID_ARGS:
                v = args.get(k)
                if isinstance(v, int):
                    top = max(top, v)
    stride = 10
    while stride <= top:
        stride *= 10
    return stride


def _span(events: list[dict]) -> tuple[float, float]:
    lo, hi = float("inf"), float("-inf")
    for e in events:
        ts = e.get("ts")
        if isinstance(ts, (int, float)):
            lo = min(lo, ts)
            hi = max(hi, ts + (e.get("dur") or 0))
    return lo, hi


def _shift(e: dict, dt: float, did: int) -> dict:
    e = dict(e)
    if isinstance(e.get("ts"), (int, float)):
        e["ts"] = round(e["ts"] + dt, 3)
    if e.get("ph") in ("s", "f") and isinstance(e.get("id"), int):
        e["id"] = e["id"] + did
    args = e.get("args")
    if isinstance(args, dict):
        args = dict(args)
        for k in _ID_ARGS:
            v = args.get(k)
            if isinstance(v, int) and v >= 0:
                args[k] = v + did
        e["args"] = args
    return e


def _kineto_event(e: dict) -> bytes:
    # libkineto puts the scalar fields on one line and `args` in an indented block.
    head = {k: v for k, v in e.items() if k != "args"}
    body = orjson.dumps(head)[1:-1]
    if "args" not in e:
        return b"  {\n    " + body + b"\n  }"
    args = orjson.dumps(e["args"])[1:-1].replace(b',"', b',\n      "')
    return b"  {\n    " + body + b',\n    "args": {\n      ' + args + b"\n    }\n  }"


def build(src: Path, dst: Path, *, target_mb: float | None, copies: int | None, style: str) -> dict:
    doc = _load(src)
    events = [e for e in doc["traceEvents"] if isinstance(e, dict)]
    meta = [e for e in events if e.get("ph") == "M"]
    body = [e for e in events if e.get("ph") != "M"]
    lo, hi = _span(body)
    period = (hi - lo) + 1000.0
    stride = _id_stride(body)
    enc = _kineto_event if style == "kineto" else (lambda e: orjson.dumps(e))
    sep = b",\n"
    # Top-level keys other than the events (device properties, versions) are kept; blocks
    # that are not part of the Kineto schema (recording environments) are not copied.
    keep = {k: v for k, v in doc.items() if k not in ("traceEvents", "metadata", "environment")}
    written = 0
    n_events = 0
    limit = int(target_mb * 1e6) if target_mb else None
    k = 0
    with open(dst, "wb") as out:
        out.write(b'{\n  "traceEvents": [\n')
        first = True
        for e in meta:
            out.write((b"" if first else sep) + enc(e))
            first = False
            n_events += 1
        while True:
            if copies is not None and k >= copies:
                break
            if limit is not None and written >= limit:
                break
            dt, did = k * period, k * stride
            parts = [enc(_shift(e, dt, did)) for e in body]
            blob = sep.join(parts)
            out.write((b"" if first else sep) + blob)
            first = False
            written += len(blob)
            n_events += len(parts)
            k += 1
        out.write(b"\n  ]")
        for key, val in keep.items():
            out.write(b",\n  " + orjson.dumps(key) + b": " + orjson.dumps(val))
        out.write(b"\n}\n")
    return {"copies": k, "events": n_events, "bytes": dst.stat().st_size, "id_stride": stride}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--target-mb", type=float, default=None)
    g.add_argument("--copies", type=int, default=None)
    ap.add_argument("--style", choices=("kineto", "compact"), default="kineto")
    a = ap.parse_args(argv)
    if a.target_mb is None and a.copies is None:
        a.target_mb = 1000.0
    info = build(a.src, a.dst, target_mb=a.target_mb, copies=a.copies, style=a.style)
    print(orjson.dumps(info).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
