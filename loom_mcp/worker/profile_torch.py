"""Worker: run a task (its Model, or a candidate's ModelNew) or a Python script under
torch.profiler with shapes recorded, and write a Kineto JSON trace.

Request: {"trace_file": path, "task": path | None, "candidate": path | None, "shape": name | None,
          "script": path | None, "args": [...], "warmup": int, "active": int, "device": "auto"}
"""

from __future__ import annotations

import runpy
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from loom_mcp.worker.harness import (
    load_module,
    make_case,
    pick_device,
    synchronize,
    task_shapes,
    to_device,
    user_traceback,
)
from loom_mcp.worker.protocol import read_request, send_result


def activities(device: torch.device) -> list[ProfilerActivity]:
    # ROCm builds of torch report their GPU activity through the CUDA activity as well.
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def profile_task(request: dict, device: torch.device) -> dict:
    task = load_module(request["task"], "loom_task")
    shapes = task_shapes(task)
    shape = next((s for s in shapes if s["name"] == request.get("shape")), None) if request.get("shape") else shapes[0]
    if shape is None:
        raise ValueError(f"unknown shape {request['shape']!r}; the task defines "
                         + ", ".join(s["name"] for s in shapes))
    inputs, init_inputs = make_case(task, shape, 0, "normal")
    if request.get("candidate"):
        model_cls = load_module(request["candidate"], "loom_candidate").ModelNew
    else:
        model_cls = task.Model
    torch.manual_seed(0)
    model = model_cls(*init_inputs)
    if isinstance(model, torch.nn.Module):
        model = model.to(device).eval()
    x = to_device(inputs, device)
    warmup, active = request["warmup"], request["active"]
    with torch.no_grad():
        for _ in range(warmup):
            model(*x)
        synchronize(device)
        with profile(activities=activities(device), record_shapes=True, with_stack=False,
                     schedule=schedule(wait=0, warmup=1, active=active, repeat=1)) as prof:
            for _ in range(active + 1):
                model(*x)
                synchronize(device)
                prof.step()
    prof.export_chrome_trace(request["trace_file"])
    return {"shape": shape["name"]}


def profile_script(request: dict, device: torch.device) -> dict:
    sys.argv = [request["script"], *request.get("args", [])]
    with profile(activities=activities(device), record_shapes=True) as prof:
        runpy.run_path(request["script"], run_name="__main__")
        synchronize(device)
    prof.export_chrome_trace(request["trace_file"])
    return {"shape": None}


def main() -> None:
    request = read_request() or {}
    device = pick_device(request.get("device"))
    started = time.perf_counter()
    try:
        info = profile_task(request, device) if request.get("task") else profile_script(request, device)
        result = {"error": None, "device": str(device), **info}
    except Exception as exc:
        result = {"error": user_traceback(exc, request.get("candidate") or request.get("task")
                                          or request.get("script") or "")}
    result["seconds"] = time.perf_counter() - started
    send_result(result)


if __name__ == "__main__":
    main()
