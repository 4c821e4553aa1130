"""Worker: run an untrusted candidate on prepared inputs and save what it returns.

Runs in its own sandboxed process, started before any reference exists anywhere: the task
module is never imported here. Cases come one at a time (loom_mcp.worker.handoff's case files):
each is read when the reference has written it, and its outputs are published as soon as it ran.
Everything this process reports about itself is advisory; the verdict rests on the outputs it
saved, which the trusted compare step checks.

An audit hook (loom_mcp.worker.guard) is installed before the candidate is imported: what it
refused goes back in the result's "guard" list (and to stderr as it happens), and each becomes
an error finding.

Request: {"candidate": path, "cases_dir": path, "outputs_dir": path, "device": "auto"}
(inputs and outputs are tensor bundles: loom_mcp.worker.handoff)
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from loom_mcp.worker import cuda_ipc, handoff, harness, lending, protocol, under_test
from loom_mcp.worker import guard as guard_module
from loom_mcp.worker.harness import (
    as_output_list,
    build_model,
    input_bytes,
    pick_device,
    synchronize,
    to_device,
    user_traceback,
    wait_for_go,
)
from loom_mcp.worker.protocol import exit_now, mark, read_request, send_result

# The reference writes case i+1 while this runs case i; past this, something is wrong and the
# job's own timeout would only say so later.
CASE_WAIT_S = 600.0
TAKE_WAIT_S = 60.0  # the server takes a case's outputs within milliseconds
BIG_CASE_BYTES = 256 << 20


def _poison_uninitialized_memory() -> None:
    # torch.empty* come back filled with NaN (ints: max value), so a kernel that leaves part of
    # its output unwritten cannot pass by luck of what the allocator hands back.
    # The C-level switch: the public torch.use_deterministic_algorithms also imports the inductor
    # configuration (and with it dynamo), which took 4 s of the candidate step on the H200 host.
    # A candidate that compiles imports inductor itself; the determinism check covers it anyway.
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is not None:
        setter(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(True, warn_only=True)
    # A property of the module's own class (torch swaps it in), which the stubs do not show.
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]


# Bound before the candidate is imported: rebinding os.path.lexists or time.sleep later does
# not end the wait early.
_lexists, _monotonic, _sleep = os.path.lexists, time.monotonic, time.sleep


def _until_taken(outputs_dir: str, index: int, mark_file: Path | None = None) -> bool:
    """Wait while the server moves this case's published outputs out of this process's reach
    (validate.runner.OutputTaker) and, for outputs in the reference's slots, until the reference
    has copied them (`mark_file`), so no candidate code runs while they are still here: the
    collector is off (a finalizer of the candidate's could otherwise run in this loop). False
    when that did not happen in time: the case cannot count, and no later case may run."""
    published = handoff.case_dir(outputs_dir, index)
    gc.disable()
    try:
        deadline = _monotonic() + TAKE_WAIT_S
        while _lexists(published) and _monotonic() < deadline:
            _sleep(0.001)
        while mark_file is not None and not _lexists(mark_file) and _monotonic() < deadline:
            _sleep(0.001)
        return not _lexists(published) and (mark_file is None or _lexists(mark_file))
    finally:
        gc.enable()


def _publish(outputs_dir: str, index: int, out: list | None, slots: Any, device: torch.device) -> bool:
    """Publish case `index`'s outputs: copied into the reference's output slots when it lent
    them and they match in number, dtype and shape, else written to files. True for slots."""
    fits = (
        out is not None
        and isinstance(slots, list)
        and len(slots) == len(out)
        and all(s.dtype == o.dtype and s.shape == o.shape for s, o in zip(slots, out))
    )
    if fits:
        for slot, o in zip(slots, out):  # type: ignore[arg-type]
            slot.copy_(o)
        synchronize(device)
        handoff.write_case(outputs_dir, index, handoff.slot_refs(len(slots)))
        return True
    handoff.write_case(outputs_dir, index, [o.to("cpu") for o in out] if out is not None else None)
    return False


def _memory_in_use(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return -1


# Bound before the candidate is imported: replacing torch.equal later does not change ours.
_torch_equal = torch.equal
# How many torch function / dispatch modes are active: a mode the candidate's forward leaves
# entered would run its own code inside every tensor operation of this harness (copying the
# outputs out, comparing them), and could answer for them.
_function_modes = getattr(torch._C, "_len_torch_function_stack", lambda: 0)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)


def _modes_left() -> str | None:
    if _function_modes() or _dispatch_modes():
        return "forward left a torch function or dispatch mode active (it would intercept the harness's own work)"
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality where the tensors live (NaNs with the same payload are equal): on a GPU
    no copy to the host, which for 30 cases of 32 MB inputs was seconds of every validation."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.numel() == 0:
        return True
    return _torch_equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8), b.detach().contiguous().reshape(-1).view(torch.uint8)
    )


def _unchanged(inputs: list, pristine: list) -> bool:
    return all(
        _same_bits(x, p) if isinstance(x, torch.Tensor) else repr(x) == repr(p)
        for x, p in zip(inputs, pristine, strict=True)
    )


def _clone_inputs(inputs: list) -> list:
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]


def run_case(
    model_cls,
    case: dict,
    device: torch.device,
    candidate_file: str,
    left_running=None,
    threads_before: set[int] | None = None,
) -> tuple[dict, list | None]:
    """`left_running(threads_before)` (from harness.track_threads) lists the threads the
    candidate left running; `threads_before`: those running before the candidate was imported."""
    report: dict[str, Any] = {
        "error": None,
        "output_type_ok": True,
        "aliases_input": False,
        "inputs_unchanged": True,
        "deterministic": True,
        "late_write": False,
        "threads_added": 0,
        "threads": [],
    }
    try:
        model = build_model(model_cls, case, device)
        inputs = to_device(case["inputs"], device)
        pristine = _clone_inputs(inputs)
        input_ptrs = {_storage_ptr(x) for x in inputs if isinstance(x, torch.Tensor)}

        with torch.no_grad():
            first = as_output_list(model(*inputs))
        if (left := _modes_left()) is not None:
            report["error"] = left
            return report, None
        # Snapshot at return, before any sync: work still running on another stream or thread
        # would make the final values differ from what was returned. The snapshot is what is
        # published: candidate code (the rerun below) can reach `first`, never these copies.
        snapshot = [o.clone() if type(o) is torch.Tensor else None for o in first]
        synchronize(device)
        time.sleep(0.02)
        synchronize(device)
        if left_running is not None:
            report["threads"] = left_running(threads_before or set())[:5]
            report["threads_added"] = len(report["threads"])

        for o in first:
            if type(o) is not torch.Tensor:
                report["output_type_ok"] = False
                report["error"] = (
                    f"forward returned {type(o).__module__}.{type(o).__qualname__}, not a plain torch.Tensor"
                )
                return report, None
            if _storage_ptr(o) in input_ptrs:
                report["aliases_input"] = True
        # Each s is a clone (the loop above returned on anything but a plain tensor); no call
        # to a typing helper here, where candidate code has run.
        report["late_write"] = any(
            not _same_bits(s, o)  # type: ignore[arg-type]
            for s, o in zip(snapshot, first)
        )
        report["inputs_unchanged"] = _unchanged(inputs, pristine)

        with torch.no_grad():
            second = as_output_list(model(*_clone_inputs(pristine)))
        # No candidate code runs from here until the outputs are taken (the finalizers of its
        # objects would): the collector stays off until _until_taken ends.
        gc.disable()
        if (left := _modes_left()) is not None:
            report["error"] = left
            return report, None
        synchronize(device)
        if left_running is not None:  # a thread the rerun started could still rewrite the answer
            late = [t for t in left_running(threads_before or set()) if t not in report["threads"]]
            report["threads"] = (report["threads"] + late)[:5]
            report["threads_added"] = len(report["threads"])
        report["deterministic"] = len(snapshot) == len(second) and all(
            type(b) is torch.Tensor and _same_bits(a, b)  # type: ignore[arg-type]
            for a, b in zip(snapshot, second)
        )
        return report, [o.detach() for o in snapshot]  # type: ignore[union-attr]
    except Exception as exc:  # the candidate's failure is a finding, not a worker crash
        report["error"] = user_traceback(exc, candidate_file)
        return report, None


def main() -> None:
    request = read_request() or {}
    device = pick_device(request.get("device"))
    _poison_uninitialized_memory()
    # Like the guard's record, read through a local variable only.
    threads_before = harness.running_thread_ids()
    left_running = harness.track_threads(request["candidate"])
    # The audit hook goes in before the candidate is imported, and what it found is read
    # through a local variable (candidate code reaches module globals through sys.modules, not
    # this function's locals). See loom_mcp.worker.guard.
    cuda_ipc.available(device)  # the driver library is loaded now, before any candidate code
    violations = guard_module.install(
        [request["candidate"]],
        watch=[sys.modules[__name__], harness, handoff, protocol, under_test, guard_module, cuda_ipc, lending],
    ).violations
    send = send_result
    try:
        model_cls = under_test.load_model_class(
            request["candidate"], "loom_candidate", "ModelNew", request.get("task_globals")
        )
        mark("candidate_imported")
    except Exception as exc:
        send({"load_error": user_traceback(exc, request["candidate"]), "cases": [], "guard": violations()})
        return
    # The inputs' first case is written before the go; the rest follow while this runs.
    go = wait_for_go(request["go_file"]) if request.get("go_file") else {}
    count = go.get("cases")
    if type(count) is not int:
        count = handoff.read_count(request["cases_dir"])
    mark("inputs_opened")
    # One case at a time: its inputs are read (a single file is mapped, not copied) just before
    # it runs and its outputs written as soon as it returns, so no worker holds every case.
    reports: list[dict] = []
    # Cases the reference lends in device memory (loom_mcp.worker.lending) are opened in place.
    open_lent = (lambda handle, size: cuda_ipc.open_region(handle, size, device)) if device.type == "cuda" else None
    for index in range(count):
        try:
            case = handoff.read_case(request["cases_dir"], index, wait_s=CASE_WAIT_S, open_lent=open_lent)
        except cuda_ipc.IpcError as exc:  # this machine's, not the candidate's: the server retries with files
            send({"load_error": None, "cases": reports, "lend_error": str(exc), "guard": violations()})
            return
        held = _memory_in_use(device)
        report, out = run_case(model_cls, case, device, request["candidate"], left_running, threads_before)
        # Advisory, for a message when the device runs out: what this process held going in.
        report["held_bytes"], report["peak_bytes"] = held, _peak_memory(device)
        reports.append(report)
        mark_file = lending.taken_mark(request["cases_dir"], index)
        if _lexists(mark_file) or _lexists(handoff.case_dir(request["outputs_dir"], index)):
            # Published before forward returned: by candidate code, not by this harness.
            report["error"] = f"case {index}'s outputs were published by the candidate's code, not the harness"
            gc.enable()
            send({"load_error": None, "cases": reports, "device": str(device), "guard": violations()})
            return
        in_slots = _publish(request["outputs_dir"], index, out, case.get("slots"), device)
        if not _until_taken(request["outputs_dir"], index, mark_file if in_slots else None):
            report["error"] = f"case {index}'s outputs were not taken within {TAKE_WAIT_S:.0f} s"
            send({"load_error": None, "cases": reports, "device": str(device), "guard": violations()})
            return
        big = input_bytes(case["inputs"]) >= BIG_CASE_BYTES
        del case, out
        if big:  # a cycle still holding a big case's tensors must not carry them into the next
            gc.collect()
    mark("cases_run")
    handoff.write_count(request["outputs_dir"], count)
    send({"load_error": None, "cases": reports, "device": str(device), "guard": violations()})


if __name__ == "__main__":
    main()
    exit_now()
