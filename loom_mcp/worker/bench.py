"""Worker: one arm (baseline or candidate) of an interleaved A/B benchmark, kept warm.

An arm runs the code under test and nothing else. The trusted timer (loom_mcp.worker.timer) owns
the inputs, which the arm maps (read-only files on a CPU, CUDA IPC on a GPU), and releases one
call at a time. On a GPU the arm's stream waits on the timer's go event, runs the call (a graph
replay for short kernels) between two events of its own, copies the outputs into the timer's
slots and records its done event, which the timer's stream waits on. On a CPU it runs the call
and copies the outputs before it answers. Which output positions are compared is never known
here.

The proof-of-execution arm (a third process, never timed) connects to the server instead and
answers trace_start / trace.

Request: {"role", "module", "class_name", "cases_file", "socket", "token", "device",
          "graph_below_s"}
"""

from __future__ import annotations

from loom_mcp.worker.protocol import request_role, take_bench_pid

if __name__ == "__main__":
    take_bench_pid(request_role())  # before torch: see take_pid

import json  # noqa: E402
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from loom_mcp.worker import exchange, handoff, under_test
from loom_mcp.worker.harness import as_output_list, build_model, pick_device, synchronize, to_device
from loom_mcp.worker.protocol import exit_now, read_request, send_result

# Harness functions a candidate has no business replacing, taken before any candidate code is
# imported. The arm's own GPU timings call these originals, so rebinding the names changes no
# number; a replacement is still reported, as intent. (What a rebinding cannot reach, the
# trusted timer's brackets check: see bench.trusted.)
_GUARDED = {
    "time.perf_counter": (lambda: time.perf_counter, time.perf_counter),
    "torch.cuda.Event": (lambda: torch.cuda.Event, torch.cuda.Event),
    "torch.cuda.Event.record": (lambda: torch.cuda.Event.record, torch.cuda.Event.record),
    "torch.cuda.Event.elapsed_time": (lambda: torch.cuda.Event.elapsed_time, torch.cuda.Event.elapsed_time),
    "torch.cuda.synchronize": (lambda: torch.cuda.synchronize, torch.cuda.synchronize),
}
_perf_counter = time.perf_counter
_Event = torch.cuda.Event
_record = torch.cuda.Event.record
_elapsed = torch.cuda.Event.elapsed_time


def tampered() -> list[str]:
    return [name for name, (current, original) in _GUARDED.items() if current() is not original]


class Arm:
    def __init__(self, request: dict) -> None:
        self.device = pick_device(request.get("device"))
        self.gpu = self.device.type == "cuda"
        if not self.gpu:
            # One thread per arm: a parallel region stalls whenever one of its threads loses
            # its core, so on a loaded machine the arm whose ops happen to parallelise was timed
            # hundreds of times slower than the other (seen on a 2-core CI machine).
            torch.set_num_threads(1)
        # The candidate's module has the name validation gives it: one tell fewer of being timed.
        module_name = "loom_candidate" if request["role"] == "candidate" else f"loom_bench_{request['role']}"
        self.model_cls = under_test.load_model_class(
            request["module"], module_name, request["class_name"], request.get("task_globals")
        )
        self.cases_file = request["cases_file"]
        self.role = str(request.get("role") or "")
        self.shapes: list[dict] = []
        self.graph_below_s = float(request.get("graph_below_s") or 0.0)
        self.current: dict[str, Any] = {}
        self.slots: list[torch.Tensor] = []
        self.go: Any = None
        self.done: Any = None
        self.stream: Any = None
        self.own_events: list = []

    # -- setup
    def load(self, timed: bool = False, go: str | None = None) -> dict:
        bundle = handoff.Bundle(self.cases_file)
        # A timed arm takes its inputs from the timer (setup): reading every input set here too
        # was 12 GiB per arm for a KernelBench problem of 6 GiB inputs. The proof traces set 0.
        skip = frozenset() if self.role == "proof" else frozenset({"inputs"})
        self.shapes = bundle.decode(bundle.tree, skip=skip)["shapes"]
        reply: dict[str, Any] = {"shapes": len(self.shapes)}
        if timed and self.gpu:
            # Opening an event handle needs this thread's context current; it makes none itself.
            device = torch.device("cuda", torch.cuda.current_device())
            torch.zeros(1, device=device)
            torch.cuda.synchronize(device)
            self.stream = torch.cuda.Stream()
            self.done = torch.cuda.Event(interprocess=True)
            self.done.record(self.stream)  # created on this device now, so its handle can be taken
            reply["done"] = self.done.ipc_handle().hex()
            self.go = torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(go or ""))
        return reply

    def setup(self, shape_index: int, shared: dict) -> dict:
        sets = self.shapes[shape_index]["sets"]
        model = build_model(self.model_cls, sets[0], self.device)
        inputs = exchange.open_inputs(shared)  # the timer's live input sets, mapped
        self.current = {"model": model, "inputs": inputs, "graphs": None, "outputs": None}
        with torch.no_grad():
            for _ in range(3):  # compile, autotune and allocate outside the timed region
                for x in inputs:
                    outputs = as_output_list(model(*x))
        synchronize(self.device)
        if any(type(out) is not torch.Tensor for out in outputs):
            raise TypeError("an output is not a plain torch.Tensor")
        specs = exchange.output_specs(outputs)
        estimate = min(self._time_eager(i) for i in range(len(inputs)) for _ in range(3))
        use_graph = self.gpu and estimate < self.graph_below_s
        if use_graph:
            use_graph = self._capture()
        return {"estimate_s": estimate, "graph": use_graph, "sets": len(inputs), "specs": specs}

    def bind(self, slots: dict) -> dict:
        """The timer's output slots for this arm, one per output."""
        self.slots = exchange.open_slots(slots)
        return {"slots": len(self.slots)}

    def _capture(self) -> bool:
        model, graphs, outputs = self.current["model"], [], []
        try:
            with torch.cuda.stream(self.stream), torch.no_grad():
                for x in self.current["inputs"]:
                    model(*x)
            self.stream.synchronize()
            for x in self.current["inputs"]:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph), torch.no_grad():
                    out = as_output_list(model(*x))
                graphs.append(graph)
                outputs.append(out)
        except Exception:  # not capturable (host sync, dynamic shapes): run eagerly instead
            torch.cuda.synchronize()
            return False
        self.current["graphs"], self.current["outputs"] = graphs, outputs
        return True

    def _launch(self, set_index: int) -> list:
        if self.current.get("graphs"):
            self.current["graphs"][set_index].replay()
            return self.current["outputs"][set_index]
        with torch.no_grad():
            return as_output_list(self.current["model"](*self.current["inputs"][set_index]))

    def _time_eager(self, set_index: int) -> float:
        """One call, timed here only to choose between graph replay and eager launches."""
        synchronize(self.device)
        t0 = _perf_counter()
        self._launch(set_index)
        synchronize(self.device)
        return _perf_counter() - t0

    # -- one call, released and timed by the timer
    def _hand_over(self, outputs: list) -> dict:
        """Copy each output into the timer's slot for it (on this stream on a GPU)."""
        if len(outputs) != len(self.slots):
            return {"output_error": f"{len(outputs)} outputs where setup gave {len(self.slots)}"}
        for slot, out in zip(self.slots, outputs, strict=True):
            if type(out) is not torch.Tensor:
                return {"output_error": "output is not a plain torch.Tensor"}
            if out.numel() * out.element_size() > slot.numel():
                return {"output_error": "an output grew past its size at setup"}
            exchange.put(slot, out)
        return {"outputs": len(outputs)}

    def call(self, set_index: int, empty: bool) -> dict:
        reply: dict[str, Any] = {"outputs": 0}
        if not self.gpu:
            if empty:
                return reply
            reply = self._hand_over(self._launch(set_index))
            reply["tampered"] = tampered()
            return reply
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.go)
            if not empty:
                # The arm's own reading of the same call (see `times`): precise, but only ever
                # checked against the timer's, never trusted alone.
                start, end = _Event(enable_timing=True), _Event(enable_timing=True)
                _record(start, self.stream)
                outputs = self._launch(set_index)
                _record(end, self.stream)
                self.own_events.append((start, end))
                reply = self._hand_over(outputs)
            self.done.record(self.stream)
        if not empty:
            reply["tampered"] = tampered()
        return reply

    def times(self) -> dict:
        """The arm's own event timings of the calls since the last ask, in order."""
        if self.stream is not None:
            self.stream.synchronize()
        times = [_elapsed(a, b) / 1e3 for a, b in self.own_events]
        self.own_events = []
        return {"times": times}

    # -- proof of execution (a third process, never timed)
    def trace_start(self) -> dict:
        """Start a profiler on this process ahead of `trace`, in its warm-up step: the costly part
        (CUPTI's start, seconds) happens now, and nothing launched before `trace` is recorded."""
        from torch.profiler import ProfilerActivity, profile, schedule

        began = time.perf_counter()
        self.profiler = profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=0, warmup=1, active=1))
        self.profiler.__enter__()
        return {"seconds": {"start": time.perf_counter() - began}}

    def trace(self, shape_index: int) -> dict:
        """One forward of the shape's first input set, the only step the profiler records: the
        names of the device kernels it launched (not those of building the model)."""
        began = time.perf_counter()
        sets = self.shapes[shape_index]["sets"]
        model = build_model(self.model_cls, sets[0], self.device)
        x = to_device(sets[0]["inputs"], self.device)
        torch.cuda.synchronize()
        self.profiler.step()  # warm-up -> recording
        with torch.no_grad():
            model(*x)
        torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        names = sorted({e.name for e in self.profiler.events() if e.device_type.name == "CUDA"})
        return {"kernels": names[:200], "seconds": {"trace": time.perf_counter() - began}}


def _connect(path: str, timeout_s: float = 300.0) -> socket.socket:
    """Connect to the timer's (or server's) socket, which may not be listening yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def main() -> None:
    request = read_request() or {}
    conn = _connect(request["socket"])
    reader = conn.makefile("r", encoding="utf-8")

    def reply(obj: dict) -> None:
        conn.sendall((json.dumps(obj) + "\n").encode())

    def violations() -> list:
        return []

    if request.get("role") != "baseline":
        # Before the candidate is imported; bound to a local, out of the candidate's reach.
        from loom_mcp.worker import guard as guard_module

        violations = guard_module.install(  # type: ignore[assignment]
            [request["module"]], watch=[sys.modules[__name__], under_test, guard_module]
        ).violations
    try:
        arm = Arm(request)
    except Exception as exc:
        reply({"hello": request["token"], "role": request["role"], "error": f"{type(exc).__name__}: {exc}"})
        send_result({"error": str(exc)})
        return
    reply({"hello": request["token"], "role": request["role"], "error": None, "device": str(arm.device)})
    calls = 0
    for line in reader:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "load":
                reply(arm.load(bool(command.get("timed")), command.get("go")))
            elif op == "setup":
                reply(arm.setup(command["shape"], command["inputs"]))
            elif op == "bind":
                reply(arm.bind(command["slots"]))
            elif op == "call":
                calls += 1
                reply(arm.call(int(command["set"]), bool(command.get("empty"))))
            elif op == "times":
                reply(arm.times())
            elif op == "trace_start":
                reply(arm.trace_start())
            elif op == "trace":
                reply(arm.trace(command["shape"]))
            elif op == "quit":
                reply({"bye": True, "violations": violations()})
                break
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            reply(
                {
                    "error": f"{type(exc).__name__}: {str(exc)[:300]} (at {Path(where.filename).name}:"
                    f"{where.lineno} in {where.name})"
                }
            )
    send_result({"calls": calls, "guard": violations()})


if __name__ == "__main__":
    main()
    exit_now()
