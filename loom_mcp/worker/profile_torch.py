"""Worker: run a task (its Model, or a candidate's ModelNew) or a Python script under
torch.profiler with shapes recorded, and write a Kineto JSON trace.

A candidate runs under the audit hook of loom_mcp.worker.guard, installed before it is imported;
what the hook refused makes the profile fail (and is listed in the result's "guard").

Request: {"trace_file": path, "task": path | None, "candidate": path | None, "shape": name | None,
          "script": path | None, "args": [...], "warmup": int, "active": int, "device": "auto"}
"""

from __future__ import annotations

import runpy
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from loom_mcp.worker import guard as guard_module
from loom_mcp.worker import harness, protocol
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


def profile_task(request: dict, device: torch.device, guarded: list) -> dict:
    task = load_module(request["task"], "loom_task")
    shapes = task_shapes(task)
    shape = next((s for s in shapes if s["name"] == request.get("shape")), None) if request.get("shape") else shapes[0]
    if shape is None:
        raise ValueError(
            f"unknown shape {request['shape']!r}; the task defines " + ", ".join(s["name"] for s in shapes)
        )
    inputs, init_inputs = make_case(task, shape, 0, "normal")
    if request.get("candidate"):
        # The task's module is the agent's reference; the candidate is untrusted: the audit hook
        # goes in before it is imported (see loom_mcp.worker.guard).
        guarded.append(
            guard_module.install(
                [request["candidate"]], watch=[sys.modules[__name__], harness, protocol, guard_module]
            ).violations
        )
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
        with profile(
            activities=activities(device),
            record_shapes=True,
            with_stack=False,
            schedule=schedule(wait=0, warmup=1, active=active, repeat=1),
        ) as prof:
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
    guarded: list = []  # the guard's reader, once installed: a local, out of the candidate's reach
    try:
        info = profile_task(request, device, guarded) if request.get("task") else profile_script(request, device)
        result = {"error": None, "device": str(device), **info}
    except Exception as exc:
        result = {
            "error": user_traceback(exc, request.get("candidate") or request.get("task") or request.get("script") or "")
        }
    if guarded:
        result["guard"] = violations = guarded[0]()
        refused = [v["message"] for v in violations if v.get("severity") == "error"]
        if refused:  # a profile of a candidate that was refused is not a profile of its kernel
            result["error"] = "the candidate was refused by the worker's guard: " + "; ".join(refused[:3])
    result["seconds"] = time.perf_counter() - started
    send_result(result)


if __name__ == "__main__":
    main()
