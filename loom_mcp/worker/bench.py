"""Worker: one arm (baseline or candidate) of an interleaved A/B benchmark, kept warm.

The server's orchestrator connects both arms over a Unix socket and asks for one batch at a
time, alternating arms, so drift in clocks or temperature lands on both equally. A batch:
perturb every input set, one warm-up call, then each other set once, back to back; before each
timed call the L2 is flushed (a read of a buffer larger than it) and a short sleep kernel holds the stream
so launch latency stays outside the device events; one device-wide sync at the end. Short
kernels replay from a CUDA/HIP graph. On CPU the timer is a wall clock.

Each reply carries a checksum of the output at positions the orchestrator chose secretly, so a
candidate that computes honestly only when validated is caught while being timed.

Request: {"role", "module", "class_name", "cases_file", "socket", "token", "device",
          "flush_bytes", "graph_below_s", "rotate_bytes", "max_sets"}
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import torch

from loom_mcp.worker.harness import (
    as_output_list,
    build_model,
    input_bytes,
    load_module,
    pick_device,
    synchronize,
    to_device,
)
from loom_mcp.worker.protocol import exit_now, read_request, send_result

# Cycles the stream is held before each timed call, so the call's launches are already queued
# when the start event fires. ~100 us at H200 clocks: Python-side Triton launches take tens of
# microseconds, and a shorter hold let their launch latency leak into the timing.
HOLD_CYCLES = 200_000

# Bound before the candidate is imported: a candidate that replaces these module attributes
# does not change what the harness calls, and the replacement is detected and reported.
_perf_counter = time.perf_counter
_Event = torch.cuda.Event
_elapsed_time = torch.cuda.Event.elapsed_time
_cuda_synchronize = torch.cuda.synchronize
_GUARDED = {
    "time.perf_counter": (lambda: time.perf_counter, _perf_counter),
    "torch.cuda.Event": (lambda: torch.cuda.Event, _Event),
    "torch.cuda.Event.elapsed_time": (lambda: torch.cuda.Event.elapsed_time, _elapsed_time),
    "torch.cuda.synchronize": (lambda: torch.cuda.synchronize, _cuda_synchronize),
}


def rotation_count(set_bytes: int, rotate_bytes: int, max_sets: int) -> int:
    """Input sets a batch rotates through: enough that together they pass `rotate_bytes`, at
    least 2 (a repeated pointer would serve a pointer-keyed cache), at most `max_sets`."""
    wanted = -(-rotate_bytes // max(set_bytes, 1)) if rotate_bytes else 2
    return max(2, min(max_sets, wanted))


def tampered() -> list[str]:
    return [name for name, (current, original) in _GUARDED.items() if current() is not original]


class Arm:
    def __init__(self, request: dict) -> None:
        self.device = pick_device(request.get("device"))
        if self.device.type == "cpu":
            # One thread per arm: a parallel region stalls whenever one of its threads loses
            # its core, so on a loaded machine the arm whose ops happen to parallelise was timed
            # hundreds of times slower than the other (seen on a 2-core CI machine).
            torch.set_num_threads(1)
        module = load_module(request["module"], f"loom_bench_{request['role']}")
        self.model_cls = getattr(module, request["class_name"])
        self.cases_file = request["cases_file"]
        self.shapes: list[dict] = []  # loaded on "load": the inputs are prepared while we start
        self.flush_bytes = int(request.get("flush_bytes") or 0)
        self.graph_below_s = float(request.get("graph_below_s") or 0.0)
        self.gpu = self.device.type == "cuda"
        self.flush_buffer = (torch.ones(self.flush_bytes // 4, dtype=torch.int32, device=self.device)
                             if self.flush_bytes else None)
        self.flush_sink = torch.empty((), dtype=torch.int64, device=self.device)
        self.current: dict[str, Any] = {}
        self.perturb = bool(request.get("perturb", True))
        self.rotate_bytes = int(request.get("rotate_bytes") or 0)
        self.max_sets = int(request.get("max_sets") or 8)

    # -- setup
    def load(self) -> dict:
        self.shapes = torch.load(self.cases_file, weights_only=True)["shapes"]
        return {"shapes": len(self.shapes)}

    def setup(self, shape_index: int) -> dict:
        sets = self.shapes[shape_index]["sets"]
        model = build_model(self.model_cls, sets[0], self.device)
        # Pristine device copies: the per-batch perturbation starts from them without a host copy.
        pristine = [to_device(s["inputs"], self.device) for s in sets]
        # The timed sets: the prepared ones, then device copies of them up to the rotation count.
        # Every batch perturbs each set with its own noise, so a copy never repeats content.
        count = rotation_count(input_bytes(pristine[0]), self.rotate_bytes, self.max_sets)
        pristine = [pristine[i % len(pristine)] for i in range(max(count, len(pristine)))]
        inputs = [[v.clone() if isinstance(v, torch.Tensor) else v for v in x] for x in pristine]
        self.current = {"model": model, "inputs": inputs, "pristine": pristine, "graphs": None,
                        "outputs": None, "shape": shape_index}
        with torch.no_grad():
            for _ in range(3):  # compile, autotune and allocate outside the timed region
                for x in inputs:
                    model(*x)
        synchronize(self.device)
        estimate = min(self._time_eager(i) for i in range(len(inputs)) for _ in range(3))
        use_graph = self.gpu and estimate < self.graph_below_s
        if use_graph:
            use_graph = self._capture()
        return {"estimate_s": estimate, "graph": use_graph, "sets": len(inputs)}

    def _capture(self) -> bool:
        model, graphs, outputs = self.current["model"], [], []
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad():
                for x in self.current["inputs"]:
                    model(*x)
            torch.cuda.current_stream().wait_stream(stream)
            for x in self.current["inputs"]:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph), torch.no_grad():
                    out = as_output_list(model(*x))
                graphs.append(graph)
                outputs.append(out)
        except Exception:  # not capturable (host sync, dynamic shapes): time eagerly instead
            torch.cuda.synchronize()
            return False
        self.current["graphs"], self.current["outputs"] = graphs, outputs
        return True

    # -- timing
    def _flush(self) -> None:
        """Evict the L2 by reading a buffer at least twice its size. Reading, not writing: a write flush
        leaves the L2 full of dirty lines that the timed kernel then pays to write back. On an
        H200 a zero_() flush timed a 768 MB Triton add at 188.7 us, a read flush at 183.5 us,
        and ncu (which invalidates clean) at 182.1 us."""
        if self.flush_buffer is not None:
            torch.sum(self.flush_buffer, 0, dtype=torch.int64, out=self.flush_sink)

    def _launch(self, set_index: int):
        if self.current.get("graphs"):
            self.current["graphs"][set_index].replay()
            return self.current["outputs"][set_index]
        with torch.no_grad():
            return as_output_list(self.current["model"](*self.current["inputs"][set_index]))

    def _time_eager(self, set_index: int) -> float:
        """One call, timed alone (used for the setup estimate)."""
        self._flush()
        if self.gpu:
            start, end = _Event(enable_timing=True), _Event(enable_timing=True)
            torch.cuda._sleep(HOLD_CYCLES)
            start.record()
            self._launch(set_index)
            end.record()
            _cuda_synchronize()
            return _elapsed_time(start, end) / 1e3
        t0 = _perf_counter()
        self._launch(set_index)
        return _perf_counter() - t0

    def _perturb(self, salt: int) -> None:
        """Give every input set content never seen before, identically in both arms: each floating
        element times U(0.9, 1.1) drawn from the salt. A result cache keyed by pointer or by
        content then returns stale values, which the sampled-output comparison catches. In place, so
        captured graphs see it. Outside the timed region."""
        generator = torch.Generator(device=self.device).manual_seed(salt)
        for live_set, pristine_set in zip(self.current["inputs"], self.current["pristine"]):
            for live, original in zip(live_set, pristine_set):
                if isinstance(live, torch.Tensor) and live.is_floating_point():
                    noise = torch.empty(live.shape, dtype=torch.float32, device=self.device)
                    noise.uniform_(0.9, 1.1, generator=generator)
                    live.copy_(original.float() * noise)

    def batch(self, probe: list[int], salt: int) -> dict:
        """One warm-up call on set 0, then each other set once, timed back to back.

        Timing right after a warm-up call, with no host round trip between, measures the device in
        its steady state: a GPU left idle between samples (sockets, the other arm) drops its
        clocks and the next kernel would be timed slow. Every timed set was perturbed since its
        last use, so no call in the batch sees inputs it has seen before."""
        if self.perturb:
            self._perturb(salt)
        synchronize(self.device)
        sets = len(self.current["inputs"])
        self._launch(0)
        times, outputs = [], []
        if self.gpu:
            events = []
            for i in range(1, sets):
                self._flush()
                start, end = _Event(enable_timing=True), _Event(enable_timing=True)
                torch.cuda._sleep(HOLD_CYCLES)  # keeps the GPU busy while the launches below queue up
                start.record()
                outputs.append(self._launch(i))
                end.record()
                events.append((start, end))
            _cuda_synchronize()
            times = [_elapsed_time(a, b) / 1e3 for a, b in events]
        else:
            for i in range(1, sets):
                self._flush()
                t0 = _perf_counter()
                outputs.append(self._launch(i))
                times.append(_perf_counter() - t0)
        synchronize(self.device)
        samples = []  # the output values at the probed positions, per call and output
        for out_list in outputs:
            one = []
            for out in out_list:
                if type(out) is not torch.Tensor:
                    return {"times": times, "samples": None, "error": "output is not a plain torch.Tensor"}
                flat = out.detach().reshape(-1)
                idx = torch.tensor([p % max(flat.numel(), 1) for p in probe], device=flat.device)
                one.append(flat[idx].double().cpu().tolist() if flat.numel() else [])
            samples.append(one)
        return {"times": times, "samples": samples, "error": None, "tampered": tampered()}

    def trace_start(self) -> dict:
        """Start a profiler on this process (the proof arm: never timed), ahead of `trace`."""
        from torch.profiler import ProfilerActivity, profile

        began = time.perf_counter()
        self.profiler = profile(activities=[ProfilerActivity.CUDA])
        self.profiler.__enter__()
        return {"seconds": {"start": time.perf_counter() - began}}

    def trace(self, shape_index: int) -> dict:
        """One forward of the shape's first input set under the running profiler: the names of the
        device kernels it launched."""
        began = time.perf_counter()
        sets = self.shapes[shape_index]["sets"]
        model = build_model(self.model_cls, sets[0], self.device)
        x = to_device(sets[0]["inputs"], self.device)
        with torch.no_grad():
            model(*x)
        torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        names = sorted({e.name for e in self.profiler.events() if e.device_type.name == "CUDA"})
        return {"kernels": names[:200], "seconds": {"trace": time.perf_counter() - began}}


def main() -> None:
    request = read_request() or {}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(request["socket"])
    reader = conn.makefile("r", encoding="utf-8")

    def reply(obj: dict) -> None:
        conn.sendall((json.dumps(obj) + "\n").encode())

    try:
        arm = Arm(request)
    except Exception as exc:
        reply({"hello": request["token"], "role": request["role"], "error": f"{type(exc).__name__}: {exc}"})
        send_result({"error": str(exc)})
        return
    reply({"hello": request["token"], "role": request["role"], "error": None, "device": str(arm.device)})
    samples = 0
    for line in reader:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "load":
                reply(arm.load())
            elif op == "setup":
                reply(arm.setup(command["shape"]))
            elif op == "batch":
                samples += 1
                reply(arm.batch(command["probe"], command["salt"]))
            elif op == "trace_start":
                reply(arm.trace_start())
            elif op == "trace":
                reply(arm.trace(command["shape"]))
            elif op == "quit":
                reply({"bye": True})
                break
        except Exception as exc:
            reply({"error": f"{type(exc).__name__}: {exc}"})
    send_result({"samples": samples})


if __name__ == "__main__":
    main()
    exit_now()
