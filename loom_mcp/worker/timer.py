"""Worker: the benchmark's trusted timer. It never imports candidate code; every number the gate
uses is taken here.

A process that runs candidate code can rewrite anything in itself (a frame walk reached the old
harness's clock; a compiled extension can patch memory), so the two arms only *run* calls and
this process measures them from outside:

* It owns the inputs. Each call's input set is re-perturbed here (each floating element times
  U(0.9, 1.1), and each tensor as a whole by a factor between 0.905 and 1.105, the same for both
  arms) right before the call is released, so nothing an arm computed earlier matches. The
  whole-tensor factor moves statistics elementwise noise leaves nearly still (a 4096-wide row's
  RMS moved 0.1 %, and a red-team candidate served RMSNorm from a cache of row scales).
* Where the task's get_inputs draws a set quickly (FRESH_DRAW_MAX_S), every batch starts from
  sets drawn afresh here, from the task itself with a secret seed: noise of a few percent leaves
  any statistic of a wide row within a bf16 tolerance of its stale value, and a red-team
  candidate that corrected a cached row-scale table for the whole-tensor factor was accepted on
  a bf16 RMSNorm. Fresh draws leave such a cache nothing to hit.
* On a GPU it brackets each call with its own CUDA events. The arm's stream waits on an
  interprocess event this process records after its start event; the arm records its own
  interprocess event after its work, which this stream waits on before the end event. The L2
  flush, the perturbation and a hold (so the arm's launches are queued before the start event)
  run on this stream ahead of the bracket. Two processes' kernels time-slice on one GPU, so a
  bracket also holds a context switch there and back: a few hundred microseconds, measured by
  empty calls of the baseline arm and subtracted by the server.
* On a CPU it timestamps the handshake: call sent, reply received.
* Each arm copies its outputs into slots this process owns (files only that arm may write on a
  CPU, CUDA allocations on a GPU) before it answers; this process reads them at the secret
  positions, which never leave it. The copy's cost, timed here, is charged back. (Positions an
  arm could read let a candidate that knew it was timed compute only those: a red-team
  candidate doing 1/64 of the work was accepted at 8.95x before.)
* On a GPU the arms also time their own work with device events; those precise samples are what
  the server's statistics use there, checked against these brackets.

Request: {"socket", "arms_socket", "token", "arm_tokens" {role: token}, "cases_file", "device",
          "flush_bytes", "rotate_bytes", "max_sets", "exchange", "task", "task_globals"}
Server ops (one JSON line each, one reply each): wait_arms, load, setup {shape}, batch {order,
salt, probe, empty}, quit.
"""

from __future__ import annotations

from loom_mcp.worker.protocol import take_bench_pid

if __name__ == "__main__":
    take_bench_pid("timer")  # before torch: see take_pid

import hashlib  # noqa: E402
import hmac
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch

from loom_mcp.worker import exchange, handoff
from loom_mcp.worker.harness import (
    apply_task_globals,
    input_bytes,
    load_module,
    make_case,
    pick_device,
    synchronize,
    to_device,
)
from loom_mcp.worker.protocol import exit_now, forbid_inspection, read_request, send_result

# Outputs per call the timer reads, and positions per output.
MAX_OUTPUTS = 8
MAX_PROBES = 64
# Output slots are sized from what the arm reports; it may not ask for more than this.
MIN_OUTPUT_CAP = 256 << 20
OUTPUT_CAP_PER_INPUT = 8
# Cycles this stream sleeps before a call is released: the arm's launches must be queued by
# then. Doubled (up to the cap) whenever the GPU was past the release before the arm replied,
# i.e. the host round trip outran the hold and the bracket may have timed launch latency.
HOLD_CYCLES = 400_000
HOLD_CYCLES_MAX = 16_000_000
HOLD_DECAY = 0.9
# A set the task draws slower than this is perturbed between batches instead of drawn afresh:
# the draw is outside the bracket, but a slow get_inputs (a Gram matrix, a host-side loop) would
# make a benchmark spend its time drawing.
FRESH_DRAW_MAX_S = 0.05


def rotation_count(set_bytes: int, rotate_bytes: int, max_sets: int) -> int:
    """Input sets a batch rotates through: enough that together they pass `rotate_bytes`, at
    least 2 (a repeated pointer would serve a pointer-keyed cache), at most `max_sets`."""
    wanted = -(-rotate_bytes // max(set_bytes, 1)) if rotate_bytes else 2
    return max(2, min(max_sets, wanted))


def seed_of(salt: int, purpose: str, index: int) -> int:
    """A seed for one draw or noise of a pair, hashed from the server's secret salt. torch's
    generators keep 32 bits of a seed; a seed built by shifting the salt kept 24 of its bits,
    few enough for an arm to tabulate every set it could be shown."""
    digest = hashlib.blake2b(f"{salt}:{purpose}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Line:
    """A JSON-lines connection."""

    def __init__(self, sock: socket.socket, role: str = "?") -> None:
        self.sock = sock
        self.reader = sock.makefile("r", encoding="utf-8")
        self.role = role

    def send(self, obj: dict) -> None:
        self.sock.sendall((json.dumps(obj) + "\n").encode())

    def receive(self) -> dict:
        line = self.reader.readline(1 << 22)
        if not line:
            raise ArmGone(self.role)
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise ValueError(f"{self.role}: reply is not an object")
        return reply

    def ask(self, obj: dict) -> dict:
        self.send(obj)
        reply = self.receive()
        if reply.get("error"):
            raise ArmFailed(self.role, str(reply["error"]))
        return reply


class ArmGone(Exception):
    pass


class ArmFailed(Exception):
    def __init__(self, role: str, message: str) -> None:
        super().__init__(message)
        self.role = role


class Timer:
    def __init__(self, request: dict) -> None:
        self.request = request
        self.device = pick_device(request.get("device"))
        self.gpu = self.device.type == "cuda"
        if not self.gpu:
            torch.set_num_threads(1)
        self.arms: dict[str, Line] = {}
        self.shapes: list[dict] = []
        self.flush_bytes = int(request.get("flush_bytes") or 0)
        self.rotate_bytes = int(request.get("rotate_bytes") or 0)
        self.max_sets = int(request.get("max_sets") or 8)
        self.hold = HOLD_CYCLES
        self.late = 0
        if self.gpu:
            self.flush_buffer = (
                torch.ones(self.flush_bytes // 4, dtype=torch.int32, device=self.device) if self.flush_bytes else None
            )
            self.flush_sink = torch.empty((), dtype=torch.int64, device=self.device)
            self.go = torch.cuda.Event(interprocess=True)
            self.go.record()  # created on this device now, so its handle can be taken
            self.done: dict[str, torch.cuda.Event] = {}
        self.exchange = Path(request["exchange"])
        self.current: dict[str, Any] = {}
        self.slots: dict[str, list[torch.Tensor]] = {}
        self.specs: dict[str, list[dict]] = {}
        self.copy_s: dict[str, float] = {}
        self.positions = torch.zeros(MAX_PROBES, dtype=torch.int64, device=self.device)
        # The task (the human's file, never the candidate's) for fresh draws; None: perturb only.
        self.task = None
        if request.get("task"):
            self.task = load_module(request["task"], "loom_task")
            apply_task_globals(self.task, request.get("task_globals"), strict=True)

    # -- arms
    def accept_arms(self, listener: socket.socket, tokens: dict[str, str]) -> dict:
        listener.settimeout(float(self.request.get("connect_timeout_s", 300)))
        while len(self.arms) < len(tokens):
            sock, _ = listener.accept()
            sock.settimeout(None)
            conn = Line(sock)
            try:
                hello = conn.receive()
            except (ArmGone, ValueError):
                sock.close()
                continue
            role = hello.get("role")
            if (
                role not in tokens
                or role in self.arms
                or not hmac.compare_digest(str(hello.get("hello")), tokens[role])
            ):
                sock.close()
                continue
            conn.role = role
            if hello.get("error"):
                raise ArmFailed(role, str(hello["error"]))
            self.arms[role] = conn
        return {"arms": sorted(self.arms)}

    def load(self) -> dict:
        self.shapes = handoff.read_bundle(self.request["cases_file"])["shapes"]
        go = self.go.ipc_handle().hex() if self.gpu else None
        for role, arm in self.arms.items():
            reply = arm.ask({"op": "load", "timed": True, "go": go})
            if self.gpu:
                handle = bytes.fromhex(str(reply.get("done", "")))
                self.done[role] = torch.cuda.Event.from_ipc_handle(self.device, handle)
        return {"shapes": len(self.shapes)}

    def setup(self, shape_index: int) -> dict:
        sets = self.shapes[shape_index]["sets"]
        pristine = [to_device(s["inputs"], self.device) for s in sets]
        count = rotation_count(input_bytes(pristine[0]), self.rotate_bytes, self.max_sets)
        shape = self.shapes[shape_index].get("shape")
        draw_s = self._draw_cost(shape, pristine[0]) if shape is not None else None
        fresh = draw_s is not None and draw_s <= FRESH_DRAW_MAX_S
        # Drawn afresh, every rotated set needs buffers of its own; perturbed only, repeats of
        # the prepared sets may share them.
        prepared = len(pristine)
        pristine = [
            [
                v.clone() if fresh and i >= prepared and isinstance(v, torch.Tensor) else v
                for v in pristine[i % prepared]
            ]
            for i in range(max(count, prepared))
        ]
        # On a CPU each arm maps input files of its own, written just before each of its calls:
        # with one set of files for both, a process the candidate forked copied the baseline's
        # inputs while the baseline was timed, and the candidate's warm-up computed them ahead.
        # (On a GPU both arms still open the same allocations.)
        live: dict[str, list[list]] = {}
        shared: dict[str, Any] = {}
        for role in self.arms:
            if self.gpu and live:
                live[role], shared[role] = next(iter(live.values())), next(iter(shared.values()))
                continue
            live[role] = [[v.clone() if isinstance(v, torch.Tensor) else v for v in x] for x in pristine]
            inputs_dir = None if self.gpu else self._fresh(self.exchange / f"in-{role}" / str(shape_index))
            shared[role] = exchange.share_inputs(live[role], inputs_dir)  # CPU: live[role] now maps the files
        self.current = {"pristine": pristine, "live": live, "shape": shape if fresh else None, "sets": len(pristine)}
        replies = {
            role: arm.ask({"op": "setup", "shape": shape_index, "inputs": shared[role]})
            for role, arm in self.arms.items()
        }
        cap = max(
            MIN_OUTPUT_CAP,
            OUTPUT_CAP_PER_INPUT * input_bytes(pristine[0]),
            self._baseline_output_bytes(replies.get("baseline")),
        )
        for role, arm in self.arms.items():
            specs = replies[role].get("specs")
            if not isinstance(specs, list) or not 0 < len(specs) <= MAX_OUTPUTS:
                raise ArmFailed(role, f"it reported no outputs, or more than {MAX_OUTPUTS}")
            self.specs[role] = [{"nbytes": int(x["nbytes"]), "dtype": str(x["dtype"])} for x in specs]
            for spec in self.specs[role]:
                exchange.dtype_named(spec["dtype"])
            out_dir = None if self.gpu else self._fresh(self.exchange / f"out-{role}" / str(shape_index))
            try:
                self.slots[role], described = exchange.output_slots(self.specs[role], out_dir, self.device, cap)
            except ValueError as exc:  # the arm asked for more than its outputs can need
                raise ArmFailed(role, str(exc)) from None
            arm.ask({"op": "bind", "slots": described})
            self.copy_s[role] = self._copy_cost(self.slots[role])
        for reply in replies.values():
            reply.pop("specs", None)
        return {
            "sets": len(pristine),
            "fresh_inputs": fresh,
            "draw_s": draw_s,
            "graph": any(r.get("graph") for r in replies.values()),
            "arms": replies,
            "copy_s": self.copy_s,
        }

    def _baseline_output_bytes(self, reply: dict | None) -> int:
        """What the baseline (the task's Model, or an earlier accepted file) outputs per call:
        a GEMM with a small K writes far more than 8x its inputs. The candidate may ask for as
        much, never more; at most half the device's memory, so no arm can make the timer run
        out of it."""
        specs = (reply or {}).get("specs")
        if not isinstance(specs, list):
            return 0
        total = sum(max(int(x.get("nbytes", 0)), 0) for x in specs if isinstance(x, dict))
        if self.gpu:
            total = min(total, torch.cuda.get_device_properties(self.device).total_memory // 2)
        return total

    @staticmethod
    def _fresh(directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        return directory

    def _copy_cost(self, slots: list[torch.Tensor]) -> float:
        """What copying outputs of these sizes into their slots costs, timed here: the arms do it
        inside the bracket (so the timer reads what the call produced, at positions no arm ever
        sees), and the bracket's reading is charged for it."""
        sources = [torch.empty_like(slot) for slot in slots]
        runs = []
        for _ in range(7):
            if self.gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                # Held, as a bracket is, so the copies are queued before the start event runs:
                # unheld, the reading held the copy's launch latency too (15-30 us where the
                # copy takes 2), more than a short call, whose brackets it floored to nothing.
                torch.cuda._sleep(HOLD_CYCLES)
                start.record()
                for slot, source in zip(slots, sources, strict=True):
                    slot.copy_(source)
                end.record()
                end.synchronize()
                runs.append(start.elapsed_time(end) / 1e3)
            else:
                began = time.perf_counter()
                for slot, source in zip(slots, sources, strict=True):
                    slot.copy_(source)
                runs.append(time.perf_counter() - began)
        return sorted(runs)[len(runs) // 2]

    # -- fresh sets
    def _draw(self, shape: dict, seed: int) -> list:
        """One input set from the task's own get_inputs, on this device."""
        assert self.task is not None  # only called where the task was loaded
        inputs, _ = make_case(self.task, shape, seed, "normal", self.device, host_fallback=False, on_device=True)
        return inputs

    def _draw_cost(self, shape: dict, like: list) -> float | None:
        """Seconds one fresh draw takes; None where there is no task, the draw fails, or it does
        not give tensors of the prepared set's shapes and dtypes (then sets are perturbed only)."""
        if self.task is None:
            return None
        try:
            synchronize(self.device)
            began = time.perf_counter()
            drawn = self._draw(shape, 0)
            synchronize(self.device)
            spent = time.perf_counter() - began
        except Exception:
            return None
        same = len(drawn) == len(like) and all(
            (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype)
            or (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b)
            for a, b in zip(drawn, like, strict=False)
        )
        return spent if same else None

    def _redraw(self, salt: int) -> None:
        """New content for every pristine set, drawn by the task with a seed only this process
        and the server know; both arms then time the same sets, each call's own noise on top."""
        shape = self.current.get("shape")
        if shape is None or self.current.get("drawn_for") == salt:  # the pair's other arm: as drawn
            return
        self.current["drawn_for"] = salt
        for index, pristine in enumerate(self.current["pristine"]):
            drawn = self._draw(shape, seed_of(salt, "draw", index))
            for kept, value in zip(pristine, drawn, strict=True):
                if isinstance(kept, torch.Tensor):
                    kept.copy_(value)

    # -- one call
    def _perturb(self, set_index: int, salt: int, role: str) -> None:
        """Fresh content for one input set of `role`'s, the same for both arms: (salt, set) seeds
        the noise."""
        generator = torch.Generator(device=self.device).manual_seed(seed_of(salt, "noise", set_index))
        live_sets = self.current["live"][role]
        for live, original in zip(live_sets[set_index], self.current["pristine"][set_index], strict=True):
            if isinstance(live, torch.Tensor) and live.is_floating_point():
                noise = torch.empty(live.shape, dtype=torch.float32, device=self.device)
                noise.uniform_(0.9, 1.1, generator=generator)
                factor = torch.empty((), dtype=torch.float32, device=self.device)
                factor.uniform_(-0.1, 0.1, generator=generator).exp_()  # on the device: no sync
                live.copy_(original.float() * noise.mul_(factor))
            elif isinstance(live, torch.Tensor):  # never perturbed, but scrubbed after a pass
                live.copy_(original)

    def _scrub(self, role: str) -> None:
        """Zeros in every shared input set once an arm's pass is over. The other arm times the
        same content next; left in place, a candidate's untimed warm-up could read the sets it
        was about to be timed on and compute them ahead (a red-team candidate served half its
        timed calls that way). Each call's content is written just before its release."""
        for live in self.current["live"][role]:
            for value in live:
                if isinstance(value, torch.Tensor):
                    value.zero_()

    def _flush(self) -> None:
        """Evict the L2 by reading a buffer larger than it (a read leaves no dirty lines)."""
        if self.flush_buffer is not None:
            torch.sum(self.flush_buffer, 0, dtype=torch.int64, out=self.flush_sink)

    def _call_gpu(self, arm: Line, role: str, set_index: int, empty: bool, salt: int) -> tuple[Any, Any, dict]:
        torch.cuda._sleep(self.hold)
        # Perturbed after the hold, just before the bracket: an arm that ran ahead of its go
        # event would have read the previous content.
        if not empty:
            self._perturb(set_index, salt, role)
        self._flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.go.record()
        reply = arm.ask({"op": "call", "set": set_index, "empty": empty})
        done = self.done[role]
        if self.go.query():
            # The GPU was past go before the arm's reply (sent once all its work was queued):
            # it may have idled inside the bracket waiting for launches, so the bracket may
            # hold launch latency. Such a bracket is dropped, and the hold doubles. (Asking
            # only whether the arm's work was already done missed the partial idling.)
            self.late += 1
            self.hold = min(self.hold * 2, HOLD_CYCLES_MAX)
            reply = {**reply, "late": True}
        else:
            # Back towards the floor on calls that were on time, so one slow round trip does
            # not make every later call sleep milliseconds.
            self.hold = max(HOLD_CYCLES, int(self.hold * HOLD_DECAY))
        torch.cuda.current_stream().wait_event(done)
        end.record()
        # Read on this stream before the next call can be released: what this call produced.
        snapshot = None if empty else self._read(role, reply)
        return (start, end), snapshot, reply

    def _call_cpu(self, arm: Line, role: str, set_index: int, empty: bool, salt: int) -> tuple[float, Any, dict]:
        if not empty:
            self._perturb(set_index, salt, role)
        began = time.perf_counter()
        reply = arm.ask({"op": "call", "set": set_index, "empty": empty})
        elapsed = time.perf_counter() - began
        return elapsed, None if empty else self._read(role, reply), reply

    def _read(self, role: str, reply: dict) -> list[torch.Tensor] | None:
        """The call's outputs at the secret positions, from the slots this process owns."""
        if reply.get("output_error") or reply.get("outputs") != len(self.specs[role]):
            return None
        return [
            exchange.read_at(slot, spec, self.positions)
            for slot, spec in zip(self.slots[role], self.specs[role], strict=True)
        ]

    # -- a batch
    def batch(self, order: list[str], salt: int, probe: list[int], empties: int) -> dict:
        """For each arm in `order`: a warm-up call on set 0, then each other set once, every call
        on freshly perturbed inputs and bracketed here; the baseline also runs `empties` calls
        that do nothing, which measure the bracket's own cost, and so does the candidate: the
        context switch into one process costs microseconds more or less than into another."""
        # The positions stay in this process: no arm can compute just them.
        self.positions = torch.tensor([int(p) for p in probe[:MAX_PROBES]], dtype=torch.int64, device=self.device)
        self._redraw(salt)
        sets = self.current["sets"]
        out: dict[str, Any] = {}
        overhead: dict[str, list[float]] = {}
        for role in order:
            arm = self.arms[role]
            brackets, snapshots, replies, empty_brackets = [], [], [], []
            for i in range(sets):
                if self.gpu:
                    bracket, snap, reply = self._call_gpu(arm, role, i, False, salt)
                else:
                    bracket, snap, reply = self._call_cpu(arm, role, i, False, salt)
                if i == 0:
                    continue  # warm-up: the device leaves its idle state on an untimed call
                brackets.append(bracket)
                snapshots.append((snap, reply))
                replies.append(reply)
            for _ in range(empties):
                if self.gpu:
                    bracket, _, _ = self._call_gpu(arm, role, 0, True, salt)
                else:
                    bracket, _, _ = self._call_cpu(arm, role, 0, True, salt)
                empty_brackets.append(bracket)
            self._scrub(role)
            synchronize(self.device)
            # On a GPU the arm also timed its work with its own events (precise, but taken in a
            # process that runs the code under test): reported beside the timer's, for the
            # server to check one against the other.
            own = arm.ask({"op": "times"})["times"][1:] if self.gpu else None
            times = [self._seconds(b) - self.copy_s.get(role, 0.0) for b in brackets]
            # Late brackets timed launch latency too: the server leaves their pairs out.
            late = [bool(reply.get("late")) for reply in replies]
            overhead[role] = [self._seconds(b) for b in empty_brackets]
            read: list = []
            error = None
            for snap, reply in snapshots:
                if snap is None:
                    error = str(reply.get("output_error") or "the arm's outputs differ in number from setup's")
                    break
                read.append([values.cpu().tolist() for values in snap])
            samples = None if error else read
            tampered = sorted({t for r in replies for t in (r.get("tampered") or [])})
            out[role] = {
                "times": times,
                "late": late,
                "own_times": own,
                "samples": samples,
                "error": error,
                "tampered": tampered,
            }
        return {
            "arms": out,
            "overhead": overhead.get("baseline", []),
            "overhead_candidate": overhead.get("candidate", []),
            "late": self.late,
            "hold_cycles": self.hold,
        }

    def _seconds(self, bracket: Any) -> float:
        if isinstance(bracket, float):
            return bracket
        start, end = bracket
        return start.elapsed_time(end) / 1e3

    def quit(self) -> dict:
        """End the arms; what the candidate's audit-hook guard refused while it ran."""
        refused: list = []
        for role, arm in self.arms.items():
            try:
                bye = arm.ask({"op": "quit"})
            except Exception:
                continue
            if role == "candidate" and isinstance(bye.get("violations"), list):
                refused = bye["violations"][:200]
        return {"bye": True, "guard": refused}


def main() -> None:
    request = read_request() or {}
    forbid_inspection()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(request["arms_socket"])
    listener.listen(8)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.connect(request["socket"])
    conn = Line(server, "server")
    try:
        timer = Timer(request)
    except Exception as exc:
        conn.send({"hello": request["token"], "role": "timer", "error": f"{type(exc).__name__}: {exc}"})
        send_result({"error": str(exc)})
        return
    conn.send({"hello": request["token"], "role": "timer", "error": None, "device": str(timer.device)})
    batches = 0
    while True:
        try:
            command = conn.receive()
        except ArmGone:
            break
        op = command.get("op")
        try:
            if op == "wait_arms":
                reply = timer.accept_arms(listener, dict(request["arm_tokens"]))
            elif op == "load":
                reply = timer.load()
            elif op == "setup":
                reply = timer.setup(int(command["shape"]))
            elif op == "batch":
                batches += 1
                reply = timer.batch(
                    list(command["order"]), int(command["salt"]), list(command["probe"]), int(command.get("empties", 2))
                )
            elif op == "quit":
                conn.send(timer.quit())
                break
            else:
                reply = {"error": f"unknown op {op!r}"}
        except ArmFailed as exc:
            reply = {"error": str(exc), "arm": exc.role}
        except ArmGone as exc:
            reply = {"error": "the arm's process ended", "arm": str(exc)}
        except TimeoutError:
            reply = {"error": "an arm did not connect in time", "arm": "?"}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send(reply)
    send_result({"batches": batches})
    try:
        os.unlink(request["arms_socket"])
    except OSError:
        pass


if __name__ == "__main__":
    main()
    exit_now()
