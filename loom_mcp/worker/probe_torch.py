"""Worker: report the torch / triton install and the devices torch sees, then exit.

Run as ``python -m loom_mcp.worker.probe_torch`` by the sandbox, never imported by the server
(importing torch is this process's job precisely so the server never has to). It sends one JSON
object over the sandbox's result pipe:

    {"python", "executable", "torch", "torch_cuda", "torch_hip", "triton",
     "torch_devices": ["cuda:0 NVIDIA H200 (sm_90, 139.8 GiB, 132 SMs, L2 60.0 MiB)", ...],
     "device_details": [{"index", "name", "arch", "total_memory_bytes", "multiprocessors",
                         "l2_cache_bytes"}, ...],
     "torch_error", "triton_error"}

Errors are values, not exceptions: a missing torch is a normal answer.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

send_result: Callable[[Any], None] | None  # None: run by hand, with nowhere to send
try:  # before torch: importing the protocol keeps the result pipe out of anything torch spawns
    from loom_mcp.worker.protocol import RESULT_FD_ENV, send_result
except ImportError:  # a bare interpreter, run by hand
    RESULT_FD_ENV, send_result = "", None


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:500]


def _devices(torch: Any) -> tuple[list[str], list[dict[str, Any]]]:
    if not torch.cuda.is_available():  # ROCm builds answer through torch.cuda too
        return [], []
    labels: list[str] = []
    details: list[dict[str, Any]] = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        # gcnArchName exists on CUDA builds too, holding the device name: trust it on ROCm only.
        hip = getattr(torch.version, "hip", None)
        arch = getattr(props, "gcnArchName", None) if hip else None
        arch = arch or f"sm_{props.major}{props.minor}"
        l2 = getattr(props, "L2_cache_size", None)
        details.append(
            {
                "index": index,
                "name": props.name,
                "arch": arch,
                "total_memory_bytes": int(props.total_memory),
                "multiprocessors": int(props.multi_processor_count),
                "l2_cache_bytes": int(l2) if l2 else None,
            }
        )
        extras = [arch, f"{props.total_memory / 2**30:.1f} GiB", f"{props.multi_processor_count} SMs"]
        if l2:
            extras.append(f"L2 {l2 / 2**20:.1f} MiB")
        labels.append(f"cuda:{index} {props.name} ({', '.join(extras)})")
    return labels, details


def probe() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": None, "torch_cuda": None, "torch_hip": None, "triton": None,
        "torch_devices": [], "device_details": [], "torch_error": None, "triton_error": None,
    }  # fmt: skip
    try:
        import torch
    except Exception as err:  # ImportError, or a broken install raising anything at all
        facts["torch_error"] = _error(err)
    else:
        facts["torch"] = str(torch.__version__)
        facts["torch_cuda"] = getattr(torch.version, "cuda", None)
        facts["torch_hip"] = getattr(torch.version, "hip", None)
        try:
            facts["torch_devices"], facts["device_details"] = _devices(torch)
        except Exception as err:  # a driver that torch cannot talk to
            facts["torch_error"] = f"devices: {_error(err)}"
    try:
        import triton
    except Exception as err:
        facts["triton_error"] = _error(err)
    else:
        facts["triton"] = str(getattr(triton, "__version__", "unknown"))
    return facts


def main() -> None:
    facts = probe()
    if send_result is None or not os.environ.get(RESULT_FD_ENV):
        print(json.dumps(facts, indent=2))  # run by hand, outside the sandbox: stdout is fine
        return
    send_result(facts)


if __name__ == "__main__":
    main()
