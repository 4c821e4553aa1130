"""Whether a validation job fits this machine and its limits, for the trusted reference worker
(loom_mcp.worker.reference): cases sized on the meta device before any input is made, so a job
too big fails early with sizes and what to do (RESOURCE_LIMIT), never as the task's failure.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loom_mcp.worker.harness import as_output_list, call_with_shape, input_bytes

# Validation's inputs on disk at once: every case while they fit this, else two cases (the one
# the candidate runs and the next); a case the candidate has finished is deleted.
INPUT_WINDOW_BYTES = 4 << 30
INPUT_WINDOW_CASES = 2


def inputs_on_disk(case_bytes: list[int], window_bytes: int = INPUT_WINDOW_BYTES) -> int:
    """The most bytes of inputs on disk at once, for cases of these sizes written in order."""
    if sum(case_bytes) <= window_bytes:
        return sum(case_bytes)
    biggest = sorted(case_bytes, reverse=True)[:INPUT_WINDOW_CASES]
    return max(sum(biggest), min(window_bytes, sum(case_bytes)))


class ResourceLimit(Exception):
    """The job does not fit this machine or its limits: reported as RESOURCE_LIMIT, with what to
    do, never as the task's failure nor the candidate's."""


def _float64_bytes(values: list) -> int:
    return sum(
        v.numel() * (8 if v.is_floating_point() else v.element_size()) for v in values if isinstance(v, torch.Tensor)
    )


def case_sizes(task, shape: dict) -> dict[str, int] | None:
    """Bytes of one case of `shape` without allocating it: get_inputs and the Model run on the
    meta device. None when the task's code cannot run there (then nothing is estimated).
    Outputs the Model cannot produce on meta are taken to be as large as the inputs."""
    try:
        with torch.device("meta"):
            inputs: list = list(call_with_shape(task.get_inputs, shape))
    except Exception:
        return None
    if not all(x.device.type == "meta" for x in inputs if isinstance(x, torch.Tensor)):
        return None  # get_inputs chose a device itself: the numbers would be real allocations
    sizes = {"inputs": input_bytes(inputs), "inputs_f64": _float64_bytes(inputs)}
    try:
        init_fn = getattr(task, "get_init_inputs", None)
        init = list(call_with_shape(init_fn, shape)) if init_fn else []
        with torch.device("meta"), torch.no_grad():
            outputs = as_output_list(task.Model(*init)(*inputs))
        sizes["outputs"] = input_bytes(outputs)
        sizes["outputs_f64"] = _float64_bytes(outputs)
    except Exception:
        sizes["outputs"], sizes["outputs_f64"] = sizes["inputs"], sizes["inputs_f64"]
    return sizes


def output_specs(task, shape: dict) -> list[tuple[torch.dtype, list[int]]] | None:
    """(dtype, shape) of each output the Model returns for `shape`, from the meta device; None
    when it cannot run there or returns anything but tensors."""
    try:
        with torch.device("meta"):
            inputs: list = list(call_with_shape(task.get_inputs, shape))
        init_fn = getattr(task, "get_init_inputs", None)
        init = list(call_with_shape(init_fn, shape)) if init_fn else []
        with torch.device("meta"), torch.no_grad():
            outputs = as_output_list(task.Model(*init)(*inputs))
    except Exception:
        return None
    if not outputs or not all(type(o) is torch.Tensor and o.device.type == "meta" for o in outputs):
        return None
    return [(o.dtype, list(o.shape)) for o in outputs]


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_fits(
    task, cases: list[dict], request: dict, device: torch.device, lent: Callable[[int], bool] | None = None
) -> dict[str, Any] | None:
    """Fail early, with sizes and what to do, when the cases cannot fit: before any input is
    made. What is counted (the model's own temporaries are not): the reference keeps every
    case's inputs to compare on, and computes and compares one case at a time in float64; the
    candidate clones a case's inputs twice (the pristine copy and the rerun's) and keeps three
    copies of its outputs (returned, snapshot, rerun). Returns the estimate, None when the task
    cannot be sized. `lent(bytes)`: whether a case of that many bytes in and out is lent in
    device memory (loom_mcp.worker.lending): it takes no disk."""
    per_shape: dict[str, dict[str, int]] = {}
    for case in cases:
        name = case["shape"]["name"]
        if name not in per_shape:
            sizes = case_sizes(task, case["shape"])
            if sizes is None:
                return None
            per_shape[name] = sizes
    if not per_shape:
        return None
    sized = [per_shape[c["shape"]["name"]] for c in cases]
    kept = sum(s["inputs"] for s in sized)
    # One case at a time: its inputs in float64, the native and float64 outputs, then about five
    # float64 temporaries of an output in reference_stats and compare_one.
    per_case_ref = [s["inputs_f64"] + s["outputs"] + 6 * s["outputs_f64"] for s in sized]
    one_ref = max(per_case_ref)
    one_cand = max(2 * s["inputs"] + 3 * s["outputs"] for s in sized)
    biggest = max(per_shape.items(), key=lambda kv: kv[1]["inputs"])
    estimate = {
        "cases": len(cases),
        "kept_input_bytes": kept,
        "reference_bytes": kept + one_ref,
        "candidate_bytes": one_cand,
        "case_reference_bytes": per_case_ref,
    }
    what = (
        f"{len(cases)} case(s); shape {biggest[0]!r} has {_gib(biggest[1]['inputs'])} of inputs "
        f"and {_gib(biggest[1]['outputs'])} of outputs"
    )
    advice = (
        "Validate a smaller problem: pass shapes=[...] to check fewer shapes, or shrink the "
        'task\'s sizes with task_globals (e.g. task_globals={"batch_size": 16}) or its '
        "SHAPES; or run where there is more memory (job_memory_bytes in loom.toml limits each "
        "job)."
    )
    limits = []
    on_cpu = device.type == "cpu"
    # Host memory: on a GPU the float64 case and the candidate's copies are device memory.
    ref_host = kept + (one_ref if on_cpu else 0)
    # A lent case's outputs are copied out of its slots to the host when the device is short.
    ref_host += sum(s["outputs"] for s in sized if lent is not None and lent(s["inputs"] + s["outputs"]))
    ref_limit = int(request.get("memory_limit_bytes") or 0)
    cand_limit = int(request.get("candidate_memory_limit_bytes") or 0)
    if ref_limit and ref_host > ref_limit:
        limits.append(
            f"the reference process needs at least {_gib(ref_host)} (every case's "
            "inputs, kept to compare on"
            + (", plus one case in float64" if on_cpu else "")
            + f"), more than its memory limit of {_gib(ref_limit)}"
        )
    if on_cpu and cand_limit and one_cand > cand_limit:
        limits.append(
            f"the candidate process needs at least {_gib(one_cand)} for one case, more "
            f"than its memory limit of {_gib(cand_limit)}"
        )
    # Not MemAvailable: on the H200 machines memory grows as it is used (MemTotal read 31 GiB
    # at the start, 255 GiB once 192 GiB were filled), so it would refuse jobs that fit. The job
    # limits are the ceiling; a kernel OOM kill past them is reported as RESOURCE_LIMIT after.
    if device.type == "cuda" and not limits:
        free, _total = torch.cuda.mem_get_info(device)
        if one_cand > free:
            limits.append(
                f"the candidate needs at least {_gib(one_cand)} of device memory for one "
                f"case; {_gib(free)} of {device} is free"
            )
    # Disk: the inputs of the cases in the window (see INPUT_WINDOW_BYTES), every case's outputs.
    disk_limit = int(request.get("disk_limit_bytes") or 0)
    window = int(request.get("input_window_bytes") or INPUT_WINDOW_BYTES)
    on_disk = [s for s in sized if lent is None or not lent(s["inputs"] + s["outputs"])]
    written = {
        "inputs": inputs_on_disk([s["inputs"] for s in on_disk], window) if on_disk else 0,
        "outputs": sum(s["outputs"] for s in on_disk),
    }
    for which, size in written.items():
        if disk_limit and size > disk_limit:
            limits.append(
                f"the {which} of the cases take {_gib(size)} on disk, more than a job's "
                f"disk quota of {_gib(disk_limit)} (job_disk_bytes in loom.toml)"
            )
    cases_dir = Path(request.get("cases_dir") or ".")
    try:
        free_disk = shutil.disk_usage(cases_dir.parent).free
    except OSError:
        free_disk = None
    if free_disk is not None and sum(written.values()) > free_disk:
        limits.append(
            f"the inputs and outputs of all cases take {_gib(sum(written.values()))} on "
            f"disk; {_gib(free_disk)} is free where the jobs run"
        )
    if limits:
        raise ResourceLimit(f"too big ({what}): {'; '.join(limits)}. {advice}")
    return estimate
