"""Trusted worker: validation's reference side, and the benchmark's input sets.

`validate` (one process, started with the candidate's): plans shape x seed x input-kind cases
from a secret nonce, writes the inputs for the candidate and signals it to start, then computes
the reference outputs (native and float64) while the candidate runs: on a GPU as many as fit a
budget, each in this process (the candidate still runs first in its own; the reference has not
run anywhere when it starts). Once the server signals that the candidate's process has exited,
it compares the candidate's saved outputs against them: elementwise and normwise, scaled to the
reference and never stricter than the error the reference itself makes (see
loom_mcp.worker.closeness). The inputs it compares on are the ones it kept in memory, not the file
the candidate could have read.

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
import time
from typing import Any

import torch

from loom_mcp.worker import cuda_ipc, handoff, lending
from loom_mcp.worker.closeness import REF_ERROR_FACTOR as REF_ERROR_FACTOR  # re-exported
from loom_mcp.worker.closeness import RTOL_FLOOR as RTOL_FLOOR  # re-exported
from loom_mcp.worker.closeness import compare_one, degenerate, reference_stats
from loom_mcp.worker.closeness import scale_rules as scale_rules  # re-exported
from loom_mcp.worker.fits import INPUT_WINDOW_BYTES, INPUT_WINDOW_CASES, ResourceLimit, check_fits, output_specs
from loom_mcp.worker.fits import case_sizes as case_sizes  # re-exported
from loom_mcp.worker.harness import (
    INPUT_KINDS,
    apply_task_globals,
    as_output_list,
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

DTYPE_ALIASES = {
    "float64": "fp64",
    "double": "fp64",
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
}


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
    return [
        {"shape": shape, "seed": derive_seed(nonce, shape["name"], i), "kind": kinds[i % len(kinds)]}
        for shape in shapes
        for i in range(seeds)
    ]


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
            sets.append(
                {"seed": seed, "inputs": inputs, "init_inputs": init_inputs, "state_dict": state if i == 0 else {}}
            )
        out.append({"name": shape["name"], "sets": sets, "shape": shape})  # the timer draws more
        meta.append(
            {
                "name": shape["name"],
                "sets": len(sets),
                "input_bytes": input_bytes(sets[0]["inputs"]),
                "flops": _model_value(task, "flops", shape),
                "bytes_moved": _model_value(task, "bytes_moved", shape),
            }
        )
    handoff.write_bundle(request["cases_file"], {"shapes": out})  # a directory: see handoff
    return {"shapes": meta}


def _to_float64(values: list) -> list:
    # Always a copy: .double() of a float64 tensor is the tensor itself, and the native run may
    # change its inputs in place before the float64 run reads them.
    return [
        v.to(torch.float64, copy=True) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in values
    ]


def reference_outputs(task, case: dict, inputs: list, init_inputs: list, device: torch.device):
    """(native outputs, float64 outputs or None, note)."""
    model = build_reference(task, init_inputs, case["seed"])
    model64 = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else None
    if isinstance(model, torch.nn.Module):
        model = model.to(device).eval()
    wants64 = getattr(task, "REFERENCE_PRECISION", "float64") == "float64" and model64 is not None
    # Moved once and widened on the device: widening 6 GiB of kept inputs on the host and moving
    # the 12 GiB that made was most of a big case's comparison time. Widened before the native
    # run, which may change its inputs in place.
    on_device = to_device(inputs, device)
    inputs64 = _to_float64(on_device) if wants64 else None
    with torch.no_grad():
        native = [o.detach() for o in as_output_list(model(*on_device))]
    del on_device
    synchronize(device)
    note = None
    exact = None
    if wants64 and model64 is not None and inputs64 is not None:
        try:
            model64 = model64.double().to(device).eval()
            with torch.no_grad():
                exact = [o.detach().double() for o in as_output_list(model64(*inputs64))]
            synchronize(device)
        except Exception as exc:  # some ops have no float64 kernel on some devices
            note = f"float64 reference unavailable ({type(exc).__name__}); compared to native"
            exact = None
    return native, exact, note


class _ReferenceStore:
    """Reference outputs computed before the candidate's outputs exist, so the reference runs
    while the candidate does. Kept on the device while they fit a budget (a quarter of its
    memory; each case runs ahead only if the candidate keeps room for one of its own cases, see
    _room_beside_candidate), then on the host up to 4 GiB; cases past both are computed after
    the candidate, one at a time. On a CPU nothing is computed ahead: the two processes would
    share the same cores."""

    HOST_BUDGET = 4 << 30

    def __init__(self, device: torch.device, host_budget: int | None = None) -> None:
        self.device_budget = self.host_budget = 0
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            self.device_budget, self.host_budget = total // 4, self.HOST_BUDGET
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


def _room_beside_candidate(device: torch.device, estimate: dict, index: int) -> bool:
    """Whether case `index`'s reference can run ahead on the device and still leave the candidate
    the memory it needs for one case (both from check_fits's estimate): the reference must never
    be why the candidate runs out of memory. Unsized tasks compute ahead as before."""
    if device.type != "cuda" or not estimate.get("case_reference_bytes"):
        return True
    free, _total = torch.cuda.mem_get_info(device)
    need = estimate["case_reference_bytes"][index] + estimate["candidate_bytes"]
    return free >= need * 1.1 + (1 << 30)


def _reference_case(
    task, task_file: str, case: dict, inputs: list, init_inputs: list, device: torch.device, ahead: bool = False
) -> dict[str, Any]:
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


def _tell_candidate(request: dict, count: int) -> None:
    if request.get("cand_go_file"):
        publish_go(request["cand_go_file"], {"cases": count}, os.environ.get("LOOM_GO_SIGNER", ""))


def _consumed(request: dict, index: int) -> bool:
    """Whether the candidate is done with case `index`: its outputs for it are published, or
    the server has said it exited."""
    try:  # the candidate's directory: what it did to it (modes, links) is no error of ours
        if handoff.case_written(request["outputs_dir"], index):
            return True
    except OSError:
        pass
    go = request.get("go_file")
    return isinstance(go, str) and os.path.exists(go)


def _lender(request: dict, device: torch.device, count: int) -> lending.CaseLender | None:
    if not count or not cuda_ipc.available(device) or not request.get("lend_on_device", True):
        return None
    return lending.CaseLender(device, request, count, lending.budget_bytes(device))


def _prepare_cases(
    task, request: dict, device: torch.device
) -> tuple[list[dict], list[tuple[list, list]], dict, lending.CaseLender | None]:
    """Plan the cases, hand over their inputs (and the reference's weights) one case at a time,
    and keep them here. The candidate is told to start once the first case is out; the next ones
    are made meanwhile. On an NVIDIA GPU a big case is lent in device memory (loom_mcp.worker.
    lending); others go to files, bounded on disk (fits.INPUT_WINDOW_BYTES): past the window, a
    case is written once the candidate has finished an earlier one, whose files are then deleted."""
    cases = plan_cases(task, request["seeds"], request.get("shapes"), secret_nonce(request))
    lender = _lender(request, device, len(cases))
    estimate = check_fits(task, cases, request, device, lender.wants_bytes if lender else None) or {}
    if lender is not None:
        lender.reserve = max(estimate.get("case_reference_bytes") or [0])
    cases_dir = request["cases_dir"]
    specs: dict[str, Any] = {}
    handoff.write_count(cases_dir, len(cases))
    kept: list[tuple[list, list]] = []
    window = int(request.get("input_window_bytes") or INPUT_WINDOW_BYTES)
    pending: dict[int, int] = {}  # written, not yet finished by the candidate: bytes per case
    for index, case in enumerate(cases):
        # Kept on the host; lent from where they were drawn (one copy to the host, not two).
        inputs, init_inputs = make_case(
            task, case["shape"], case["seed"], case["kind"], device, on_device=lender is not None
        )
        model = build_reference(task, init_inputs, case["seed"])
        state = dict(model.state_dict()) if isinstance(model, torch.nn.Module) else {}
        value = {"seed": case["seed"], "inputs": inputs, "init_inputs": init_inputs, "state_dict": state}
        name = case["shape"]["name"]
        if lender is not None and name not in specs:
            specs[name] = output_specs(task, case["shape"])
        tensors = [*inputs, *init_inputs, *state.values()]
        lent = lender is not None and lender.wants(tensors, specs[name]) and lender.lend_case(index, value, specs[name])
        if not lent:
            size = input_bytes(inputs) + input_bytes(list(state.values()))
            delay = 0.002
            while True:
                for done in [i for i in pending if _consumed(request, i)]:
                    del pending[done]
                    shutil.rmtree(handoff.case_dir(cases_dir, done), ignore_errors=True)
                if len(pending) < INPUT_WINDOW_CASES or sum(pending.values()) + size <= window:
                    break
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
            handoff.write_case(cases_dir, index, value)
            pending[index] = size
        kept.append(([x.cpu() if isinstance(x, torch.Tensor) else x for x in inputs], init_inputs))
        del model, state, value, tensors, inputs
        if index == 0:
            mark("first_case_lent" if lent else "first_case_written")
            _tell_candidate(request, len(cases))
    if not cases:
        _tell_candidate(request, 0)
    mark("inputs_written")
    return cases, kept, estimate, lender


def inputs_reproducible(task, cases: list[dict], kept: list[tuple[list, list]], device: torch.device) -> bool:
    """Whether the task's inputs come back the same from the seed (the first case drawn again):
    a task that ignores the seed gives reports no one can rerun. Asked once the candidate runs,
    off its critical path."""
    if not cases:
        return True
    try:
        again, _ = make_case(
            task, cases[0]["shape"], cases[0]["seed"], cases[0]["kind"], device, host_fallback=False, on_device=True
        )
        if input_bytes(again) >= 1 << 30:  # compared where it was drawn: hashing 6 GiB took seconds
            return len(again) == len(kept[0][0]) and all(
                _same_tensor(a, k) if isinstance(a, torch.Tensor) else repr(a) == repr(k)
                for a, k in zip(again, kept[0][0])
            )
    except torch.OutOfMemoryError:  # the candidate holds the device now: no way to tell, no blame
        torch.cuda.empty_cache()
        return True
    return tensor_digest(again) == tensor_digest(kept[0][0])


def _same_tensor(a: torch.Tensor, b: Any) -> bool:
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.to(a.device).reshape(-1).view(torch.uint8)))


class CandidateOutputs:
    """What the candidate saved, read one case at a time (no more than a case is held). The
    files are the candidate's: anything wrong in them is its failure, never the reference's."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.count = 0
        self.problem: str | None = None
        try:
            self.count = handoff.read_count(directory)
        except (OSError, ValueError, TypeError) as exc:
            self.problem = f"the candidate's saved outputs could not be read: {type(exc).__name__}: {exc}"

    def get(
        self, index: int, max_bytes: int | None = None, lender: lending.CaseLender | None = None
    ) -> tuple[list[torch.Tensor] | None, str | None]:
        """(case `index`'s outputs, or None; why they could not be read, or None). Outputs of
        more than `max_bytes` (the reference's own, with room) are not read at all. Outputs the
        candidate put in the case's output slots are the lender's copies of them."""
        if self.problem or index >= self.count:
            return None, self.problem
        slots, missing = lender.outputs(index) if lender is not None else (None, None)
        if missing:
            return None, missing
        try:
            got = handoff.read_case(self.directory, index, max_bytes=max_bytes, slots=slots)
        except (OSError, ValueError, TypeError, RuntimeError) as exc:
            return None, f"the candidate's saved outputs could not be read: {type(exc).__name__}: {exc}"
        if got is not None and not (isinstance(got, list) and all(isinstance(t, torch.Tensor) for t in got)):
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
    cases, kept, estimate, lender = _prepare_cases(task, request, device)
    try:
        return _judge_cases(task, request, device, cases, kept, estimate, lender)
    finally:
        if lender is not None:
            lender.close()  # reached once the candidate has exited (or this job is ending)


def _judge_cases(
    task,
    request: dict,
    device: torch.device,
    cases: list[dict],
    kept: list[tuple[list, list]],
    estimate: dict,
    lender: lending.CaseLender | None,
) -> dict:
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
        if not _room_beside_candidate(device, estimate, i):
            break
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
    if lender is not None:
        lender.finish()
    candidate_outputs = CandidateOutputs(request["outputs_dir"])
    results = []
    for index, case in enumerate(cases):
        if index < len(ahead):
            ref, ahead[index] = ahead[index], {}  # freed after this comparison
        else:
            ref = _reference_case(task, request["task"], case, *kept[index], device)
        entry, native, exact, stats = ref["entry"], ref["native"], ref["exact"], ref["stats"]
        entry["inputs_reproducible"] = reproducible
        # More than twice the reference's bytes cannot be a right answer: not worth reading.
        expected = sum(t.numel() * t.element_size() for t in native or [])
        got, problem = candidate_outputs.get(index, max_bytes=2 * expected + (1 << 20), lender=lender)
        if problem and not entry["error"]:
            entry["error"] = problem
        if entry["error"] or got is None:
            results.append(entry)
            continue
        if len(got) != len(native):
            entry["error"] = f"candidate returned {len(got)} outputs, reference {len(native)}"
            results.append(entry)
            continue
        if index == len(ahead):
            mark("first_after_exit_reference")  # where a big case's time goes, in the log
        for i, (out, expected) in enumerate(zip(got, native)):
            expected = expected.to(device)
            tol = tolerances.get(canonical_dtype(expected.dtype), {"atol": 0.0, "rtol": 0.0})
            one = compare_one(out, expected, exact[i].to(device) if exact else None, tol, stats[i] if stats else None)
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
        if index == len(ahead):
            mark("first_after_exit_compared")
        results.append(entry)
    lent = lender.lent if lender is not None else 0
    return {"planned": cases, "cases": results, "device": str(device), "lent_cases": lent}


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
        result = {"error": f"out of memory: {type(exc).__name__}: {str(exc)[:300]}", "error_code": "RESOURCE_LIMIT"}
    except Exception as exc:
        result = {"error": user_traceback(exc, request["task"])}
        if _allocation_failed(exc):
            result["error_code"] = "RESOURCE_LIMIT"
    send_result(result)


def _allocation_failed(exc: BaseException) -> bool:
    """torch's CPU allocator reports a refused allocation as a RuntimeError."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "not enough memory" in text or "DefaultCPUAllocator" in text or "Cannot allocate memory" in text
    )


if __name__ == "__main__":
    main()
    exit_now()
