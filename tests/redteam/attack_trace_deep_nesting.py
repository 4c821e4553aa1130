"""Attack (analyze_trace): a well-formed Kineto trace, one event of which nests a million levels.

Unlike `attack_trace_nesting.py` the document is valid JSON and looks like a real trace: the
nesting hides in one event's `args` (arrays, then objects), after a normal first event and the
`deviceProperties` block. Recursive code on the way (a builder, a JSON dump, a scrubber) hits
the C stack: this closed the MCP connection. Generated at test time:

    python tests/redteam/attack_trace_deep_nesting.py OUT.json [arrays|objects]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEPTH = 1_000_000

_NORMAL = {
    "ph": "X", "cat": "kernel", "name": "void gemm_kernel<128>(float*)", "pid": 0, "tid": 7,
    "ts": 1000, "dur": 10, "args": {"device": 0, "stream": 7, "correlation": 1},
}


def write(path: Path, depth: int = DEPTH, kind: str = "arrays") -> Path:
    head = (
        b'{"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100"}], '
        b'"traceEvents": [' + json.dumps(_NORMAL).encode() + b', {"ph": "X", "cat": "cpu_op", '
        b'"name": "aten::mm", "ts": 990, "dur": 4, "args": {"Input Dims": '
    )
    if kind == "arrays":
        body = b"[" * depth + b"]" * depth
    else:
        body = b'{"a": ' * depth + b"1" + b"}" * depth
    path.write_bytes(head + body + b"}}]}")
    return path


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "attack_trace_deep_nesting.json")
    print(write(out, kind=sys.argv[2] if len(sys.argv) > 2 else "arrays"))
