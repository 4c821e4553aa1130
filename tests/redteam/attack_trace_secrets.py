"""Attack (analyze_trace): credentials inside the names a trace analysis reports.

Not metadata blocks (those were never echoed) but the strings the analysis exists to show: op
and kernel names, annotations, the launch API name during a stall, device names, input types,
top-level block names and the file name. analyze_trace echoed them, although the scrubber's own
patterns (`loom_mcp/traces/secrets.py`) match every one. One secret sits where a name is cut to
a column width, so only a scrubber that runs before the cut catches all of it.

Tokens are assembled at run time so no credential-shaped literal is committed:

    python tests/redteam/attack_trace_secrets.py OUTDIR    # kineto, rocprofv3, malformed
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


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
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 100, "tid": 100, "ts": ts,
                   "dur": dur, "args": {"External id": ext, **args}})

    def launch(ts: float, corr: int, ext: int, name: str = "cudaLaunchKernel",
               dur: float = 2) -> None:
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 100, "tid": 100,
                   "ts": ts, "dur": dur, "args": {"External id": ext, "correlation": corr}})

    def kernel(name: str, ts: float, dur: float, corr: int, ext: int) -> None:
        ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts,
                   "dur": dur, "args": {"device": 0, "stream": 7, "correlation": corr,
                                        "External id": ext}})

    op(f"ProfilerStep#{s['openai']}", 900, 2000, 1000, cat="user_annotation")
    for i in range(4):
        t = 1000 + i * 400
        op(f"aten::mm_{s['aws']}", t, 10, 10 + i, **{
            "Input Dims": [[64, 128], [128, 256]],
            "Input type": [f"float {s['github']}", "float"],
            "Concrete Inputs": ["", f"Authorization: Bearer {s['bearer']}"]})
        launch(t + 1, 100 + i, 10 + i)
        kernel(gemm, t + 5, 120, 100 + i, 10 + i)
        op("aten::add", t + 12, 5, 20 + i)
        launch(t + 13, 200 + i, 20 + i)
        kernel(long_kernel, t + 130, 30, 200 + i, 20 + i)
    # A long stall with one host call in it, named with a token: the stall finding quotes it.
    launch(2400, 999, 0, name=f"cudaStreamSynchronize Authorization: Bearer {s['bearer']}",
           dur=2500)
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
        kd.append({"start_timestamp": 1_000_000 + i * 200_000, "end_timestamp": 1_150_000 + i * 200_000,
                   "dispatch_info": {"kernel_id": 1 + i % 2, "agent_id": {"handle": 2},
                                     "queue_id": {"handle": 1}},
                   "correlation_id": {"internal": i + 1, "external": 0}})
    return {"rocprofiler-sdk-tool": [{
        "metadata": {"pid": 1, "command": [f"--token={s['hf']}"]},
        "agents": [{"type": 1, "id": {"handle": 1}, "name": "CPU"},
                   {"type": 2, "id": {"handle": 2}, "product_name": f"AMD Instinct MI300X {s['aws']}"}],
        "kernel_symbols": [
            {"kernel_id": 1, "formatted_kernel_name": f"Cijk_Alik_Bljk_{s['github']}_MT128x128"},
            {"kernel_id": 2, "formatted_kernel_name": f"elementwise Authorization: Bearer {s['bearer']}"},
        ],
        "strings": {"buffer_records": []},
        "buffer_records": {"kernel_dispatch": kd, "memory_copy": [], "hip_api": []},
    }]}


def write_kineto(path: Path) -> Path:
    path.write_text(json.dumps(_kineto(secrets()), indent=1))
    return path


def write_rocprof(path: Path) -> Path:
    path.write_text(json.dumps(_rocprof(secrets())))
    return path


def write_malformed(path: Path) -> Path:
    """A syntax error right after a token: the parser's message quotes the bytes around it."""
    s = secrets()
    path.write_text('{"traceEvents": [{"ph": "X", "name": "' + s["github"] + '" ' + s["aws"] + "}]}")
    return path


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    for p in (write_kineto(out / "secrets_kineto.json"), write_rocprof(out / "secrets_rocprof.json"),
              write_malformed(out / "secrets_malformed.json")):
        print(p)
