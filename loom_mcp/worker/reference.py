"""Trusted worker: validation's reference side, and the benchmark's input sets.

`validate` (one process, started with the candidate's): plans shape x seed x input-kind cases
from a secret nonce, writes the inputs for the candidate and signals it to start, then computes
the reference outputs (native and float64) while the candidate runs: on a GPU as many as fit a
budget, each in this process (the candidate still runs first in its own; the reference has not
run anywhere when it starts). Once the server signals that the candidate's process has exited,
it compares the candidate's saved outputs against them: elementwise and normwise, scaled to the
reference and never stricter than the error the reference itself makes (see "closeness" below).
The inputs it compares on are the ones it kept in memory, not the file the candidate could have
read.

`prepare_bench`: input sets per shape for timing, written for both benchmark arms.

Request: {"mode": "validate"|"prepare_bench", "task": path, "seeds": int, "shapes": [names],
          "cases_dir": path, "cand_go_file": path, "go_file": path, "outputs_dir": path,
          "device": "auto", "tolerances": {canonical dtype: {"atol", "rtol"}},
          "memory_limit_bytes": int, "candidate_memory_limit_bytes": int}
(prepare_bench writes "cases_file" instead.) Inputs and outputs travel as tensor bundles
(loom_mcp.worker.handoff); a job too big for the limits or this machine fails before any input
is made, with error_code RESOURCE_LIMIT in the result.
The seed nonce (LOOM_NONCE) and the go-file key (LOOM_GO_SIGNER) come in the environment.
"""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from loom_mcp.worker import handoff
from loom_mcp.worker.harness import (
    INPUT_KINDS,
    apply_task_globals,
    as_output_list,
    call_with_shape,
    canonical_dtype,
    input_bytes,
    load_module,
    make_case,
    pick_device,
    shape_kwargs,
    synchronize,
    task_shapes,
    tensor_digest,
    to_device,
    user_traceback,
    wait_for_go,
)
from loom_mcp.worker.protocol import (
    exit_now,
    forbid_inspection,
    mark,
    publish_go,
    read_request,
    send_result,
)

DTYPE_ALIASES = {"float64": "fp64", "double": "fp64", "float32": "fp32", "float": "fp32",
                 "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def canonical_key(name: str) -> str:
    key = name.replace("torch.", "").lower()
    return DTYPE_ALIASES.get(key, key)


def build_reference(task, init_inputs: list, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return task.Model(*init_inputs)


def derive_seed(nonce: int, shape_name: str, index: int) -> int:
    """Seeds the candidate cannot predict: a per-call secret nonce mixed with the case."""
    digest = hashlib.blake2b(f"{nonce}:{shape_name}:{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def secret_nonce(request: dict) -> int:
    """The seed nonce comes in the environment, not the request file: files under the server's
    home are readable by a candidate running as the same user; this process's environment is not."""
    import os

    value = os.environ.get("LOOM_NONCE") or request.get("nonce")
    if value is None:
        raise ValueError("no seed nonce given")
    return int(value)


def plan_cases(task, seeds: int, only: list[str] | None, nonce: int) -> list[dict]:
    shapes = task_shapes(task)
    if only:
        unknown = sorted(set(only) - {s["name"] for s in shapes})
        if unknown:
            names = ", ".join(s["name"] for s in shapes)
            raise ValueError(f"unknown shape(s) {unknown}; the task defines: {names}")
        shapes = [s for s in shapes if s["name"] in only]
    kinds = getattr(task, "INPUT_KINDS", INPUT_KINDS)
    return [{"shape": shape, "seed": derive_seed(nonce, shape["name"], i), "kind": kinds[i % len(kinds)]}
            for shape in shapes for i in range(seeds)]


def _model_value(task, name: str, shape: dict) -> float | None:
    fn = getattr(task, name, None)
    if fn is None:
        return None
    try:
        return float(fn(**shape_kwargs(shape)))
    except Exception:
        return None


def prepare_bench(request: dict) -> dict:
    """Distinct input sets per shape for timing (`max_sets`, 2 by default). The arms rotate through
    more: device copies of these, each perturbed with its own noise before every batch; generating
    and shipping eight full sets per shape through a file took seconds of every benchmark."""
    task = load_module(request["task"], "loom_task")
    apply_task_globals(task, request.get("task_globals"), strict=True)
    device = pick_device(request.get("device"))
    nonce = secret_nonce(request)
    shapes = [c["shape"] for c in plan_cases(task, 1, request.get("shapes"), nonce)]
    out, meta = [], []
    for shape in shapes:
        sets: list[dict[str, Any]] = []
        for i in range(request.get("max_sets", 2)):
            seed = derive_seed(nonce, shape["name"], 1000 + i)
            inputs, init_inputs = make_case(task, shape, seed, "normal", device)
            if i == 0:
                model = build_reference(task, init_inputs, seed)
                state = dict(model.state_dict()) if isinstance(model, torch.nn.Module) else {}
            sets.append({"seed": seed, "inputs": inputs, "init_inputs": init_inputs,
                         "state_dict": state if i == 0 else {}})
        out.append({"name": shape["name"], "sets": sets})
        meta.append({"name": shape["name"], "sets": len(sets),
                     "input_bytes": input_bytes(sets[0]["inputs"]),
                     "flops": _model_value(task, "flops", shape),
                     "bytes_moved": _model_value(task, "bytes_moved", shape)})
    handoff.write_bundle(request["cases_file"], {"shapes": out})  # a directory: see handoff
    return {"shapes": meta}


def _to_float64(values: list) -> list:
    return [v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in values]


def reference_outputs(task, case: dict, inputs: list, init_inputs: list, device: torch.device):
    """(native outputs, float64 outputs or None, note)."""
    model = build_reference(task, init_inputs, case["seed"])
    model64 = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else None
    if isinstance(model, torch.nn.Module):
        model = model.to(device).eval()
    with torch.no_grad():
        native = [o.detach() for o in as_output_list(model(*to_device(inputs, device)))]
    synchronize(device)
    note = None
    exact = None
    if getattr(task, "REFERENCE_PRECISION", "float64") == "float64" and model64 is not None:
        try:
            model64 = model64.double().to(device).eval()
            with torch.no_grad():
                exact = [o.detach().double() for o in
                         as_output_list(model64(*to_device(_to_float64(inputs), device)))]
            synchronize(device)
        except Exception as exc:  # some ops have no float64 kernel on some devices
            note = f"float64 reference unavailable ({type(exc).__name__}); compared to native"
            exact = None
    return native, exact, note


# ---------------------------------------------------------------- closeness
#
# The yardstick is the error the reference itself makes: `native` (the task's Model run in its
# dtype on this device, with the candidate process's numerics switches) against `ref` (the same
# Model in float64). A candidate as accurate as PyTorch must pass, so that error is always
# allowed, with a factor; below it, the task's tolerance applies, scaled to the reference:
#
# * elementwise, |out - ref| <= atol_eff + rtol |ref| with
#   atol_eff = max(min(atol, floor * rms(ref)), REF_ERROR_FACTOR * max |native - ref|),
#   where `floor` is max(rtol, the dtype's default rtol). The cap at floor * RMS keeps atol from
#   passing any output smaller than atol (softmax over 32k columns gives values ~3e-5: all zeros,
#   a constant or the answer times 1e-3 passed at fp32's atol of 1e-4); the second term is what
#   PyTorch's own kernel misses by (fp32 GEMMs on inputs x 64, TF32 convolutions), which may
#   exceed atol. Global, not per element: an equally accurate kernel that sums in another order
#   errs at other elements. A reference whose finite values are all zero keeps atol.
# * normwise, ||out - ref||_2 / ||ref||_2 (float64, finite elements) <= max(floor,
#   REF_ERROR_FACTOR * the same error of `native`). All zeros, any constant and a scaled copy
#   are ~1 off, far above any reference's own error, so the widened elementwise slack cannot
#   let them through.
#
# Both the candidate's error and the reference's own are reported. The reference run in its
# dtype passes both rules by construction. A task's `check(out, ref)` replaces both; the numbers
# are still reported.

# Two bits: within 4x of the error the reference itself makes in the task's dtype. A downgrade of
# an fp32 task from TF32 to bf16 (3 fewer mantissa bits, 8x) still fails it.
REF_ERROR_FACTOR = 4.0
# The default rtol per canonical dtype (judge_models.DEFAULT_TOLERANCES; a test keeps them equal):
# the least relative precision asked of a float output, whatever a task's TOLERANCE says.
RTOL_FLOOR = {"fp64": 1e-7, "fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-2, "fp8": 1e-1}


def _norm(values: torch.Tensor) -> float:
    """2-norm in float64, scaled first so that squares of huge float64 values cannot overflow."""
    if not values.numel():
        return 0.0
    top = float(values.abs().max())
    if top == 0.0 or top == float("inf"):
        return top
    return float(torch.linalg.vector_norm(values / top)) * top


def reference_stats(native: list, exact: list | None) -> list[dict[str, Any] | None]:
    """Per output: the reference's scale (RMS and 2-norm of its finite float64 values) and the
    error the reference makes in the task's dtype (normwise and largest elementwise, against the
    float64 run; None when there is no float64 run). None for non-float outputs. Computed while
    the candidate runs, with the reference outputs themselves."""
    stats: list[dict[str, Any] | None] = []
    for i, value in enumerate(native):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            stats.append(None)
            continue
        ref = exact[i] if exact is not None and i < len(exact) else None
        target = (ref if ref is not None else value).to(torch.float64)
        finite = torch.isfinite(target)
        vals = target[finite]
        norm = _norm(vals)
        entry: dict[str, Any] = {"ref_norm": norm, "ref_rms": norm / max(vals.numel(), 1) ** 0.5,
                                 "ref_norm_rel_err": None, "ref_max_abs_err": None}
        if ref is not None and tuple(value.shape) == tuple(target.shape):
            own = value.to(target.device, torch.float64)
            both = finite & torch.isfinite(own)
            err = (own - target)[both]
            entry["ref_max_abs_err"] = float(err.abs().max()) if err.numel() else 0.0
            entry["ref_norm_rel_err"] = _norm(err) / norm if norm > 0 else None
        stats.append(entry)
    return stats


def scale_rules(dtype: str, tolerance: dict[str, float], stats: dict[str, Any] | None
                ) -> tuple[float, float | None, str]:
    """(atol to use, normwise bound or None, how both were derived) for one float output."""
    atol, rtol = tolerance["atol"], tolerance["rtol"]
    if not stats or not stats["ref_norm"] or stats["ref_norm"] == float("inf"):
        return atol, None, "the reference has no nonzero finite value: plain atol"
    floor = max(rtol, RTOL_FLOOR.get(dtype, 0.0))
    own_abs = stats["ref_max_abs_err"] or 0.0
    own_norm = stats["ref_norm_rel_err"] or 0.0
    atol_eff = max(min(atol, floor * stats["ref_rms"]), REF_ERROR_FACTOR * own_abs)
    bound = max(floor, REF_ERROR_FACTOR * own_norm)
    if stats["ref_norm_rel_err"] is None:
        how = f"rtol {floor:g}; no float64 run to measure the reference's own error"
    else:
        how = (f"the larger of rtol {floor:g} and {REF_ERROR_FACTOR:g} x the reference's own "
               f"{dtype} error {own_norm:.3g}")
    return atol_eff, bound, f"({how}); reference RMS {stats['ref_rms']:.3g}"


def compare_one(out: torch.Tensor, native: torch.Tensor, exact: torch.Tensor | None,
                tolerance: dict[str, float], stats: dict[str, Any] | None = None) -> dict[str, Any]:
    dtype = canonical_dtype(native.dtype)
    result: dict[str, Any] = {"dtype": dtype, "shape_match": True,
                              "dtype_match": True, "nan_inf_parity": True, "max_abs_err": None,
                              "max_rel_err": None, "mismatched": None, "message": None,
                              "atol": tolerance["atol"], "rtol": tolerance["rtol"], "passed": False,
                              "atol_effective": None, "norm_rel_err": None, "norm_rel_bound": None,
                              "ref_norm_rel_err": None, "ref_max_abs_err": None, "ref_rms": None}
    if tuple(out.shape) != tuple(native.shape):
        result["shape_match"] = False
        result["message"] = f"output shape {tuple(out.shape)} != reference {tuple(native.shape)}"
        return result
    if out.dtype != native.dtype:
        result["dtype_match"] = False
        result["message"] = f"output dtype {out.dtype} != reference {native.dtype}"
        return result
    scaled = native.is_floating_point()
    if scaled and stats is None:
        stats = reference_stats([native], [exact] if exact is not None else None)[0]
    atol, bound, how = (scale_rules(dtype, tolerance, stats) if scaled
                        else (tolerance["atol"], None, ""))
    if scaled and stats:
        result.update(atol_effective=atol, norm_rel_bound=bound, ref_rms=stats["ref_rms"],
                      ref_norm_rel_err=stats["ref_norm_rel_err"],
                      ref_max_abs_err=stats["ref_max_abs_err"])
    # On the reference's device: on a GPU the float64 error statistics of 30 cases of 16M elements
    # are milliseconds; on the host they were most of run_validation's wall time.
    target = (exact if exact is not None else native).to(torch.float64)
    got = out.to(target.device, torch.float64)
    ref_nan, got_nan = torch.isnan(target), torch.isnan(got)
    inf = float("inf")
    parity = (torch.equal(ref_nan, got_nan) and torch.equal(target == inf, got == inf)
              and torch.equal(target == -inf, got == -inf))
    result["nan_inf_parity"] = bool(parity)
    finite = torch.isfinite(target) & torch.isfinite(got)
    signed = (got - target)[finite]
    diff = signed.abs()
    scale = target.abs()[finite]
    if diff.numel():
        result["max_abs_err"] = float(diff.max())
        result["max_rel_err"] = float((diff / scale.clamp_min(1e-12)).max())
        bad = diff > atol + tolerance["rtol"] * scale
        result["mismatched"] = int(bad.sum())
    else:
        result["max_abs_err"] = result["max_rel_err"] = 0.0
        result["mismatched"] = 0
    if bound is not None and stats and parity:  # with NaN/Inf out of place it means nothing
        result["norm_rel_err"] = _norm(signed) / stats["ref_norm"]
    norm_bad = bound is not None and result["norm_rel_err"] is not None and \
        not result["norm_rel_err"] <= bound
    problems = []
    if norm_bad:
        problems.append(f"normwise relative error ||out - ref|| / ||ref|| = "
                        f"{result['norm_rel_err']:.3g} exceeds its bound {bound:.3g} {how}")
    if result["mismatched"]:
        if atol < tolerance["atol"]:
            why = f" (capped from {tolerance['atol']:g} at the reference's scale)"
        elif atol > tolerance["atol"]:
            why = (f" (widened from {tolerance['atol']:g} to {REF_ERROR_FACTOR:g} x the "
                   f"reference's own {dtype} max abs error {result['ref_max_abs_err']:.3g})")
        else:
            why = ""
        problems.append(f"{result['mismatched']} of {got.numel()} elements outside "
                        f"atol={atol:.3g}{why} rtol={tolerance['rtol']:g} "
                        f"(max abs err {result['max_abs_err']:.3g})")
    if not result["nan_inf_parity"]:
        result["message"] = (f"NaN/Inf positions differ: reference has {int(ref_nan.sum())} NaN and "
                             f"{int(torch.isinf(target).sum())} Inf, candidate {int(got_nan.sum())} "
                             f"NaN and {int(torch.isinf(got).sum())} Inf")
    elif problems:
        result["message"] = "; ".join(problems)
    result["passed"] = result["nan_inf_parity"] and result["mismatched"] == 0 and not norm_bad
    return result


def degenerate(native: list[torch.Tensor]) -> bool:
    """Outputs that a constant could match (METR dropped such tasks): worth a warning. Their mean
    everywhere is within the dtype's relative tolerance of them in norm (spread <= floor x RMS),
    so it passes the normwise rule; an all-zero output counts. Relative, not absolute: softmax
    rows of 1e-5 values varying by 10 % are not constant."""
    for t in native:
        if t.is_floating_point() and t.numel() > 1:
            v = t.double()
            finite = v[torch.isfinite(v)]
            if finite.numel() > 1:
                floor = RTOL_FLOOR.get(canonical_dtype(t.dtype), 0.0)
                if _norm(finite - finite.mean()) <= floor * _norm(finite):
                    return True
    return False


class _ReferenceStore:
    """Reference outputs computed before the candidate's outputs exist, so the reference runs
    while the candidate does. Kept on the device while they fit a budget (a tenth of its memory,
    at most 4 GiB: the candidate running beside us keeps its room), then on the host up to
    4 GiB; cases past both are computed after the candidate, one at a time. On a CPU nothing is
    computed ahead: the two processes would share the same cores."""

    HOST_BUDGET = 4 << 30

    def __init__(self, device: torch.device, host_budget: int | None = None) -> None:
        self.device_budget = self.host_budget = 0
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            self.device_budget, self.host_budget = min(4 << 30, total // 10), self.HOST_BUDGET
        if host_budget is not None:
            self.host_budget = host_budget
        self.on_device = self.on_host = 0

    def has_room(self) -> bool:
        return self.on_device < self.device_budget or self.on_host < self.host_budget

    def keep(self, tensors: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        if tensors is None:
            return None
        size = sum(t.numel() * t.element_size() for t in tensors)
        if self.on_device + size <= self.device_budget:
            self.on_device += size
            return tensors
        self.on_host += size
        return [t.cpu() for t in tensors]


def _reference_case(task, task_file: str, case: dict, inputs: list, init_inputs: list,
                    device: torch.device, ahead: bool = False) -> dict[str, Any]:
    """One case's reference outputs (native and float64). Ahead of the candidate's exit, running
    out of device memory is not the reference's failure: the candidate holds memory too, so
    the caller stops computing ahead and does this case again afterwards."""
    entry: dict[str, Any] = {"outputs": [], "note": None, "degenerate": False, "error": None}
    native = exact = stats = None
    try:
        native, exact, note = reference_outputs(task, case, inputs, init_inputs, device)
        entry["note"] = note
        entry["degenerate"] = degenerate(native)
        stats = reference_stats(native, exact)
    except torch.OutOfMemoryError:
        if ahead:
            raise
        entry["error"] = "reference failed: out of device memory"
    except Exception as exc:
        entry["error"] = "reference failed: " + user_traceback(exc, task_file)
    return {"entry": entry, "native": native, "exact": exact, "stats": stats}


class ResourceLimit(Exception):
    """The job does not fit this machine or its limits: reported as RESOURCE_LIMIT, with what to
    do, never as the task's failure nor the candidate's."""


def _float64_bytes(values: list) -> int:
    return sum(v.numel() * (8 if v.is_floating_point() else v.element_size())
               for v in values if isinstance(v, torch.Tensor))


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


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_fits(task, cases: list[dict], request: dict, device: torch.device) -> dict[str, Any] | None:
    """Fail early, with sizes and what to do, when the cases cannot fit: before any input is
    made. What is counted (the model's own temporaries are not): the reference keeps every
    case's inputs to compare on, and computes and compares one case at a time in float64; the
    candidate clones a case's inputs twice (the pristine copy and the rerun's) and keeps three
    copies of its outputs (returned, snapshot, rerun). Returns the estimate, None when the task
    cannot be sized."""
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
    one_ref = max(s["inputs_f64"] + s["outputs"] + 6 * s["outputs_f64"] for s in sized)
    one_cand = max(2 * s["inputs"] + 3 * s["outputs"] for s in sized)
    biggest = max(per_shape.items(), key=lambda kv: kv[1]["inputs"])
    estimate = {"cases": len(cases), "kept_input_bytes": kept, "reference_bytes": kept + one_ref,
                "candidate_bytes": one_cand}
    what = (f"{len(cases)} case(s); shape {biggest[0]!r} has {_gib(biggest[1]['inputs'])} of inputs "
            f"and {_gib(biggest[1]['outputs'])} of outputs")
    advice = ("Validate a smaller problem: pass shapes=[...] to check fewer shapes, or shrink the "
              "task's sizes with task_globals (e.g. task_globals={\"batch_size\": 16}) or its "
              "SHAPES; or run where there is more memory (job_memory_bytes in loom.toml limits each "
              "job).")
    limits = []
    on_cpu = device.type == "cpu"
    # Host memory: on a GPU the float64 case and the candidate's copies are device memory.
    ref_host = kept + (one_ref if on_cpu else 0)
    ref_limit = int(request.get("memory_limit_bytes") or 0)
    cand_limit = int(request.get("candidate_memory_limit_bytes") or 0)
    if ref_limit and ref_host > ref_limit:
        limits.append(f"the reference process needs at least {_gib(ref_host)} (every case's "
                      "inputs, kept to compare on" + (", plus one case in float64" if on_cpu else "")
                      + f"), more than its memory limit of {_gib(ref_limit)}")
    if on_cpu and cand_limit and one_cand > cand_limit:
        limits.append(f"the candidate process needs at least {_gib(one_cand)} for one case, more "
                      f"than its memory limit of {_gib(cand_limit)}")
    # Not MemAvailable: on the H200 machines memory grows as it is used (MemTotal read 31 GiB
    # at the start, 255 GiB once 192 GiB were filled), so it would refuse jobs that fit. The job
    # limits are the ceiling; a kernel OOM kill past them is reported as RESOURCE_LIMIT after.
    if device.type == "cuda" and not limits:
        free, _total = torch.cuda.mem_get_info(device)
        if one_cand > free:
            limits.append(f"the candidate needs at least {_gib(one_cand)} of device memory for one "
                          f"case; {_gib(free)} of {device} is free")
    # Disk: every case's inputs are written for the candidate, every case's outputs by it.
    disk_limit = int(request.get("disk_limit_bytes") or 0)
    written = {"inputs": kept, "outputs": sum(s["outputs"] for s in sized)}
    for which, size in written.items():
        if disk_limit and size > disk_limit:
            limits.append(f"the {which} of all cases take {_gib(size)} on disk, more than a job's "
                          f"disk quota of {_gib(disk_limit)} (job_disk_bytes in loom.toml)")
    cases_dir = Path(request.get("cases_dir") or ".")
    try:
        free_disk = shutil.disk_usage(cases_dir.parent).free
    except OSError:
        free_disk = None
    if free_disk is not None and sum(written.values()) > free_disk:
        limits.append(f"the inputs and outputs of all cases take {_gib(sum(written.values()))} on "
                      f"disk; {_gib(free_disk)} is free where the jobs run")
    if limits:
        raise ResourceLimit(f"too big ({what}): {'; '.join(limits)}. {advice}")
    return estimate


def _prepare_cases(task, request: dict, device: torch.device) -> tuple[list[dict], list[tuple[list, list]]]:
    """Plan the cases, write their inputs (and the reference's weights) for the candidate, and
    keep them here. Each case's tensors are written as soon as they are made (see
    loom_mcp.worker.handoff)."""
    cases = plan_cases(task, request["seeds"], request.get("shapes"), secret_nonce(request))
    check_fits(task, cases, request, device)
    writer = handoff.BundleWriter(request["cases_dir"])
    written, kept = [], []
    for case in cases:
        inputs, init_inputs = make_case(task, case["shape"], case["seed"], case["kind"], device)
        model = build_reference(task, init_inputs, case["seed"])
        state = model.state_dict() if isinstance(model, torch.nn.Module) else {}
        written.append(writer.encode({"seed": case["seed"], "inputs": inputs,
                                      "init_inputs": init_inputs, "state_dict": dict(state)}))
        kept.append((inputs, init_inputs))
        del model, state
    writer.close(written)
    mark("inputs_written")
    return cases, kept


def inputs_reproducible(task, cases: list[dict], kept: list[tuple[list, list]], device: torch.device) -> bool:
    """Whether the task's inputs come back the same from the seed (the first case drawn again):
    a task that ignores the seed gives reports no one can rerun. Asked once the candidate runs,
    off its critical path."""
    if not cases:
        return True
    try:
        again, _ = make_case(task, cases[0]["shape"], cases[0]["seed"], cases[0]["kind"], device,
                             host_fallback=False)
    except torch.OutOfMemoryError:  # the candidate holds the device now: no way to tell, no blame
        torch.cuda.empty_cache()
        return True
    return tensor_digest(again) == tensor_digest(kept[0][0])


class CandidateOutputs:
    """What the candidate saved, read one case at a time (no more than a case is held). The
    files are the candidate's: anything wrong in them is its failure, never the reference's."""

    def __init__(self, directory: str) -> None:
        self.bundle: handoff.Bundle | None = None
        self.problem: str | None = None
        try:
            self.bundle = handoff.Bundle(directory)
            if not isinstance(self.bundle.tree, list):
                raise ValueError("not a list of cases")
        except (OSError, ValueError, TypeError) as exc:
            self.problem = f"the candidate's saved outputs could not be read: {type(exc).__name__}: {exc}"

    def get(self, index: int) -> tuple[list[torch.Tensor] | None, str | None]:
        """(case `index`'s outputs, or None; why they could not be read, or None)."""
        if self.bundle is None or index >= len(self.bundle.tree):
            return None, self.problem
        try:
            got = self.bundle.decode(self.bundle.tree[index])
        except (OSError, ValueError, TypeError, RuntimeError) as exc:
            return None, f"the candidate's saved outputs could not be read: {type(exc).__name__}: {exc}"
        if got is not None and not (isinstance(got, list)
                                    and all(isinstance(t, torch.Tensor) for t in got)):
            return None, "the candidate's saved outputs are not a list of tensors per case"
        return got, None


def match_candidate_numerics() -> None:
    """The numerics switches of the candidate's process (loom_mcp.worker.candidate), so that the
    reference's own error measures what PyTorch does in the candidate's setting: deterministic
    algorithms change cuDNN's and some reductions' choice of kernel. TF32 (matmul and cuDNN) is
    left at torch's defaults in both processes."""
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is not None:
        setter(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(True, warn_only=True)


def validate(request: dict) -> dict:
    match_candidate_numerics()
    task = load_module(request["task"], "loom_task")
    apply_task_globals(task, request.get("task_globals"), strict=True)
    device = pick_device(request.get("device"))
    cases, kept = _prepare_cases(task, request, device)
    if request.get("cand_go_file"):
        publish_go(request["cand_go_file"], {}, os.environ.get("LOOM_GO_SIGNER", ""))
    reproducible = inputs_reproducible(task, cases, kept, device)
    if device.type == "cuda":
        torch.zeros(1, device=device)  # the context, while the candidate runs
    tolerances = {canonical_key(k): v for k, v in (request.get("tolerances") or {}).items()}
    task_tol = getattr(task, "TOLERANCE", None)
    if isinstance(task_tol, dict):
        tolerances.update({canonical_key(k): dict(v) for k, v in task_tol.items()})
    custom_check = getattr(task, "check", None)

    # While the candidate runs: as many reference outputs as the store has room for.
    store = _ReferenceStore(device, request.get("ahead_host_bytes"))
    ahead: list[dict[str, Any]] = []
    while len(ahead) < len(cases) and store.has_room():
        i = len(ahead)
        try:
            ref = _reference_case(task, request["task"], cases[i], *kept[i], device, ahead=True)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            break
        ahead.append({**ref, "native": store.keep(ref["native"]), "exact": store.keep(ref["exact"])})

    mark(f"ahead_{len(ahead)}_of_{len(cases)}")
    # Once the candidate has exited: its outputs against the references.
    if request.get("go_file"):
        wait_for_go(request["go_file"])
    candidate_outputs = CandidateOutputs(request["outputs_dir"])
    results = []
    for index, case in enumerate(cases):
        if index < len(ahead):
            ref, ahead[index] = ahead[index], {}  # freed after this comparison
        else:
            ref = _reference_case(task, request["task"], case, *kept[index], device)
        entry, native, exact, stats = ref["entry"], ref["native"], ref["exact"], ref["stats"]
        entry["inputs_reproducible"] = reproducible
        got, problem = candidate_outputs.get(index)
        if problem and not entry["error"]:
            entry["error"] = problem
        if entry["error"] or got is None:
            results.append(entry)
            continue
        if len(got) != len(native):
            entry["error"] = f"candidate returned {len(got)} outputs, reference {len(native)}"
            results.append(entry)
            continue
        for i, (out, expected) in enumerate(zip(got, native)):
            expected = expected.to(device)
            tol = tolerances.get(canonical_dtype(expected.dtype), {"atol": 0.0, "rtol": 0.0})
            one = compare_one(out, expected, exact[i].to(device) if exact else None, tol,
                              stats[i] if stats else None)
            if custom_check is not None and one["shape_match"] and one["dtype_match"]:
                try:
                    ok = bool(custom_check(out.to(expected.device), expected))
                except Exception as exc:
                    ok = False
                    one["message"] = "task check raised: " + user_traceback(exc, request["task"])
                one["passed"] = ok
                if ok:  # the task's rule is the one that counts; its verdict needs no excuse
                    one["message"] = None
                elif not one["message"]:
                    one["message"] = "the task's check(out, ref) returned False"
            entry["outputs"].append(one)
        results.append(entry)
    return {"planned": cases, "cases": results, "device": str(device)}


def warm_up() -> None:
    """Run by a warm worker while it waits for a job: the first computation on the meta device
    (check_fits sizes every job that way) imports torch's reference decompositions and sympy,
    1-4 s that were on every validation's critical path."""
    with torch.device("meta"), torch.no_grad():
        x = torch.randn(2, 8)
        torch.nn.functional.linear(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)), torch.randn(4, 8))


def main() -> None:
    forbid_inspection()  # it will hold reference outputs while a candidate runs beside it
    request = read_request() or {}
    handler = {"validate": validate, "prepare_bench": prepare_bench}[request["mode"]]
    try:
        result = handler(request)
        result["error"] = None
    except ResourceLimit as exc:
        result = {"error": str(exc), "error_code": "RESOURCE_LIMIT"}
    except (MemoryError, torch.OutOfMemoryError) as exc:
        result = {"error": f"out of memory: {type(exc).__name__}: {str(exc)[:300]}",
                  "error_code": "RESOURCE_LIMIT"}
    except Exception as exc:
        result = {"error": user_traceback(exc, request["task"])}
        if _allocation_failed(exc):
            result["error_code"] = "RESOURCE_LIMIT"
    send_result(result)


def _allocation_failed(exc: BaseException) -> bool:
    """torch's CPU allocator reports a refused allocation as a RuntimeError."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("not enough memory" in text
                                              or "DefaultCPUAllocator" in text
                                              or "Cannot allocate memory" in text)


if __name__ == "__main__":
    main()
    exit_now()
