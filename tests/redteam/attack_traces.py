"""Attacks on analyze_trace: hostile trace files, written at test time (the largest would be
4 MB of gzip, the secrets must not be committed as literals). Each section says what the attack
did to the server before it was closed.

    python tests/redteam/attack_traces.py OUTDIR [nesting deep gzip secrets]    # default: all
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

# ----------------------------------------------------------------------------------------------
# Attack (analyze_trace): 2 MB of opening brackets, `[[[[...`.
#
# A bare JSON array whose first element never ends. ijson builds a prefix string per level
# ("item.item.item..."), so memory grows with the square of the depth: this 2 MB file grew the
# server to 20 GB before it was killed. Generated at test time (the file would be 2 MB):

NESTING_SIZE = 2_000_000


def write_nesting(path: Path, size: int = NESTING_SIZE) -> Path:
    path.write_bytes(b"[" * size)
    return path


# ----------------------------------------------------------------------------------------------
# Attack (analyze_trace): a well-formed Kineto trace, one event of which nests a million levels.
#
# Unlike the nesting above, the document is valid JSON and looks like a real trace: the
# nesting hides in one event's `args` (arrays, then objects), after a normal first event and the
# `deviceProperties` block. Recursive code on the way (a builder, a JSON dump, a scrubber) hits
# the C stack: this closed the MCP connection. Generated at test time:

DEPTH = 1_000_000

_NORMAL = {
    "ph": "X",
    "cat": "kernel",
    "name": "void gemm_kernel<128>(float*)",
    "pid": 0,
    "tid": 7,
    "ts": 1000,
    "dur": 10,
    "args": {"device": 0, "stream": 7, "correlation": 1},
}


def write_deep_nesting(path: Path, depth: int = DEPTH, kind: str = "arrays") -> Path:
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


# ----------------------------------------------------------------------------------------------
# Attack (analyze_trace): gzip bombs, about 4 MB that inflate to 4.3 GB.
#
# Each bomb is a valid gzip file of several members (gzip readers inflate them as one stream):
# a trace-shaped head, then the same member of 64 MiB of one short pattern repeated (near
# deflate's ceiling, about 1000:1) 68 times, then a tail that closes the document. Payloads:
#
# * "events": 80 million valid kernel events: every check on the JSON itself passes, and the
#   columns the reader keeps (tens of bytes an event) would reach gigabytes;
# * "string": the 4.3 GB are one kernel name, so a parser must buffer them whole;
# * "whitespace": the 4.3 GB are blanks between events: memory stays flat, time does not;
# * "rocprof": a rocprofv3 document; the gzip trailer (ISIZE) of the last member claims a few
#   bytes, which used to send the reader down its load-it-whole path.
#
# Generated at test time in a few seconds (one member is compressed once and repeated):

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


def write_gzip_bomb(path: Path, kind: str = "events", members: int = MEMBERS) -> Path:
    head, fill, tail = _HEADS[kind]
    member = gzip.compress(fill * (MEMBER_BYTES // len(fill)), compresslevel=9, mtime=0)
    with open(path, "wb") as f:
        f.write(gzip.compress(head, mtime=0))
        for _ in range(members):
            f.write(member)
        f.write(gzip.compress(tail, mtime=0))  # its ISIZE: a few bytes
    return path


def gzip_bomb_inflated_size(kind: str = "string", members: int = MEMBERS) -> int:
    head, fill, tail = _HEADS[kind]
    return len(head) + members * len(fill) * (MEMBER_BYTES // len(fill)) + len(tail)


# ----------------------------------------------------------------------------------------------
# Attack (analyze_trace): credentials inside the names a trace analysis reports.
#
# Not metadata blocks (those were never echoed) but the strings the analysis exists to show: op
# and kernel names, annotations, the launch API name during a stall, device names, input types,
# top-level block names and the file name. analyze_trace echoed them, although the scrubber's own
# patterns (`loom_mcp/traces/secrets.py`) match every one. One secret sits where a name is cut to
# a column width, so only a scrubber that runs before the cut catches all of it.
#
# Tokens are assembled at run time so no credential-shaped literal is committed:


def secrets() -> dict[str, str]:
    return {
        "github": "ghp_" + "R8x" * 12,
        "aws": "AKIA" + "Q7" * 8,
        "bearer": "Zr4" * 10 + "Yq",  # written after "Authorization: Bearer "
        "hf": "hf_" + "Lm3" * 12,
        "openai": "sk-" + "Tw9" * 10,
    }


def _kineto(s: dict[str, str]) -> dict:
    long_kernel = "void at::native::elementwise_kernel_with_a_long_templated_name_" + s["hf"] + "<4>(int)"
    gemm = f"void cutlass_gemm_{s['github']}<128, 64>(Params)"
    ev = []

    def op(name: str, ts: float, dur: float, ext: int, cat: str = "cpu_op", **args) -> None:
        ev.append(
            {
                "ph": "X",
                "cat": cat,
                "name": name,
                "pid": 100,
                "tid": 100,
                "ts": ts,
                "dur": dur,
                "args": {"External id": ext, **args},
            }
        )

    def launch(ts: float, corr: int, ext: int, name: str = "cudaLaunchKernel", dur: float = 2) -> None:
        ev.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": name,
                "pid": 100,
                "tid": 100,
                "ts": ts,
                "dur": dur,
                "args": {"External id": ext, "correlation": corr},
            }
        )

    def kernel(name: str, ts: float, dur: float, corr: int, ext: int) -> None:
        ev.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": name,
                "pid": 0,
                "tid": 7,
                "ts": ts,
                "dur": dur,
                "args": {"device": 0, "stream": 7, "correlation": corr, "External id": ext},
            }
        )

    op(f"ProfilerStep#{s['openai']}", 900, 2000, 1000, cat="user_annotation")
    for i in range(4):
        t = 1000 + i * 400
        op(
            f"aten::mm_{s['aws']}",
            t,
            10,
            10 + i,
            **{
                "Input Dims": [[64, 128], [128, 256]],
                "Input type": [f"float {s['github']}", "float"],
                "Concrete Inputs": ["", f"Authorization: Bearer {s['bearer']}"],
            },
        )
        launch(t + 1, 100 + i, 10 + i)
        kernel(gemm, t + 5, 120, 100 + i, 10 + i)
        op("aten::add", t + 12, 5, 20 + i)
        launch(t + 13, 200 + i, 20 + i)
        kernel(long_kernel, t + 130, 30, 200 + i, 20 + i)
    # A long stall with one host call in it, named with a token: the stall finding quotes it.
    launch(2400, 999, 0, name=f"cudaStreamSynchronize Authorization: Bearer {s['bearer']}", dur=2500)
    op("aten::relu", 5000, 5, 30)
    launch(5001, 300, 30)
    kernel(long_kernel, 5004, 400, 300, 30)
    return {
        "schemaVersion": 1,
        "deviceProperties": [{"id": 0, "name": f"NVIDIA H100 Authorization: Bearer {s['bearer']}"}],
        "traceEvents": ev,
        s["github"]: {"note": "a top-level block whose name is a token"},
    }


def _rocprof(s: dict[str, str]) -> dict:
    kd = []
    for i in range(6):
        kd.append(
            {
                "start_timestamp": 1_000_000 + i * 200_000,
                "end_timestamp": 1_150_000 + i * 200_000,
                "dispatch_info": {"kernel_id": 1 + i % 2, "agent_id": {"handle": 2}, "queue_id": {"handle": 1}},
                "correlation_id": {"internal": i + 1, "external": 0},
            }
        )
    return {
        "rocprofiler-sdk-tool": [
            {
                "metadata": {"pid": 1, "command": [f"--token={s['hf']}"]},
                "agents": [
                    {"type": 1, "id": {"handle": 1}, "name": "CPU"},
                    {"type": 2, "id": {"handle": 2}, "product_name": f"AMD Instinct MI300X {s['aws']}"},
                ],
                "kernel_symbols": [
                    {"kernel_id": 1, "formatted_kernel_name": f"Cijk_Alik_Bljk_{s['github']}_MT128x128"},
                    {"kernel_id": 2, "formatted_kernel_name": f"elementwise Authorization: Bearer {s['bearer']}"},
                ],
                "strings": {"buffer_records": []},
                "buffer_records": {"kernel_dispatch": kd, "memory_copy": [], "hip_api": []},
            }
        ]
    }


def write_kineto_with_secrets(path: Path) -> Path:
    path.write_text(json.dumps(_kineto(secrets()), indent=1))
    return path


def write_rocprof_with_secrets(path: Path) -> Path:
    path.write_text(json.dumps(_rocprof(secrets())))
    return path


def write_malformed_with_secret(path: Path) -> Path:
    """A syntax error right after a token: the parser's message quotes the bytes around it."""
    s = secrets()
    path.write_text('{"traceEvents": [{"ph": "X", "name": "' + s["github"] + '" ' + s["aws"] + "}]}")
    return path


WRITERS = {
    "nesting": lambda out: [write_nesting(out / "nesting.json")],
    "deep": lambda out: [write_deep_nesting(out / f"deep_{k}.json", kind=k) for k in ("arrays", "objects")],
    "gzip": lambda out: [write_gzip_bomb(out / f"bomb_{k}.json.gz", k) for k in _HEADS],
    "secrets": lambda out: [
        write_kineto_with_secrets(out / "secrets_kineto.json"),
        write_rocprof_with_secrets(out / "secrets_rocprof.json"),
        write_malformed_with_secret(out / "secrets_malformed.json"),
    ],
}

if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    for name in sys.argv[2:] or WRITERS:
        for path in WRITERS[name](out):
            print(path)
