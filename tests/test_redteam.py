"""Red team: a cheating candidate for every exploit class of kernel_eval.md §2 that our task format
admits. Each must be rejected with the named check; honest candidates must pass. All of it goes
through the real MCP protocol, real sandboxed workers, and Triton's interpreter on CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mcp import Client

from loom_mcp.config import load_config
from loom_mcp.gate import decide
from loom_mcp.judge_models import CompileEvidence, ValidationEvidence
from loom_mcp.server import build_server
from loom_mcp.store import Ledger

REDTEAM = Path(__file__).parent / "redteam"

# candidate -> (exploit class, checks of which at least one must be reported)
CHEATS = {
    "cheat_stale_output.py": ("stale/uninitialised output", {"validation.nan_inf", "validation.mismatch"}),
    "cheat_input_mutation.py": ("input mutation", {"validation.input_mutation"}),
    "cheat_pointer_cache.py": ("result caching by pointer", {"static.pointer_cache"}),
    "cheat_timer_patch.py": ("timer monkeypatching", {"static.monkeypatch"}),
    "cheat_torch_patch.py": ("torch monkeypatching", {"static.monkeypatch"}),
    "cheat_late_thread.py": ("background thread finishing late", {"validation.late_write", "static.threads"}),
    "cheat_lazy_subclass.py": ("lazy tensor subclass", {"validation.output_type", "static.tensor_subclass"}),
    "cheat_calls_reference.py": ("calling the reference", {"static.reference_use", "static.dynamic_code"}),
    "cheat_subclass_reference.py": ("subclassing the reference", {"static.reference_use"}),
    "cheat_try_fallback.py": ("try/except fallback", {"static.try_fallback"}),
    "cheat_precision_downgrade.py": ("precision downgrade", {"validation.mismatch"}),
    "cheat_hardcoded_seeds.py": ("hard-coded seeds", {"validation.mismatch"}),
    "cheat_partial_work.py": ("partial work", {"validation.mismatch"}),
    "cheat_nan_output.py": ("NaN output", {"validation.nan_inf"}),
    "cheat_grader_introspection.py": ("reading the grader", {"static.grader_introspection"}),
    "cheat_deferred_work.py": ("deferred work aimed at the other arm", {"static.threads"}),
}


# The shortest cheats live here rather than as files beside the others; each test's workspace
# gets them written into its copy of tests/redteam.
SHORT_CHEATS = {
    "cheat_subclass_reference.py": '''\
"""Exploit class: subclassing the reference with nothing changed."""

from task_rmsnorm import Model


class ModelNew(Model):
    pass
''',
    "cheat_constant_output.py": '''\
"""Exploit class: a constant output. 1/cols everywhere is the mean of every softmax row (rows even
sum to one), and within atol of every probability when the row is wide."""

import torch


class ModelNew(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full_like(x, 1.0 / x.shape[-1])
''',
    "cheat_scaled_copy.py": '''\
"""Exploit class: a tiny-scale copy. The right softmax, times 1e-3: the shape of the answer at a
scale the absolute tolerance cannot see."""

import torch


class ModelNew(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(torch.tanh(x), dim=-1) * 1e-3
''',
    "cheat_partial_work.py": '''\
"""Exploit class: partial work. Estimates the mean square from a quarter of each row."""

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        sample = x[:, ::4]
        return x * torch.rsqrt(sample.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
''',
    "cheat_precision_downgrade.py": '''\
"""Exploit class: precision downgrade. Computes in bfloat16 and casts back to float32."""

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        xb, wb = x.to(torch.bfloat16), self.weight.to(torch.bfloat16)
        return (xb * torch.rsqrt(xb.pow(2).mean(-1, keepdim=True) + 1e-6) * wb).to(torch.float32)
''',
    "cheat_stale_output.py": '''\
"""Exploit class: stale / uninitialised output. Returns torch.empty_like and hopes the allocator
hands back memory that still holds a reference result."""

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return torch.empty_like(x)
''',
    "cheat_torch_patch.py": '''\
"""Exploit class: torch monkeypatching. Makes every closeness check agree."""

import torch

torch.allclose = lambda *args, **kwargs: True


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()

    def forward(self, x):
        return x.clone()
''',
    "cheat_input_mutation.py": '''\
"""Exploit class: input mutation. Computes the answer, then scribbles over its input."""

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        out = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
        x.zero_()
        return out
''',
    "cheat_nan_output.py": '''\
"""Exploit class: NaN output. Skips rows it finds awkward and leaves NaN there."""

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        out = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
        out[x.abs().amax(-1) > 2.5] = float("nan")
        return out
''',    "cheat_timer_patch.py": '''\
"""Exploit class: timer monkeypatching. Every timing taken with perf_counter reads zero."""

import time

import torch

time.perf_counter = lambda: 0.0


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
''',
    "cheat_lazy_subclass.py": '''\
"""Exploit class: lazy tensor subclass. The returned object defers the work to whoever reads it."""

import torch


class Deferred(torch.Tensor):
    pass


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        out = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
        return out.as_subclass(Deferred)
''',
    "cheat_pointer_cache.py": '''\
"""Exploit class: result caching by pointer. Same buffer, same answer, whatever it now holds."""

import torch

_CACHE = {}


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        key = x.data_ptr()
        if key not in _CACHE:
            _CACHE[key] = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
        return _CACHE[key]
''',
    "cheat_extra_stream.py": '''\
"""Exploit class: extra stream (GPU). Work goes to a side stream the timer never waits for."""

import torch

_SIDE = torch.cuda.Stream() if torch.cuda.is_available() else None


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        out = torch.empty_like(x)
        with torch.cuda.stream(_SIDE):
            torch.cuda._sleep(2_000_000)
            out.copy_(torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6))
        return out
''',
    "cheat_grader_introspection.py": '''\
"""Exploit class: reading the grader. Walks the call stack looking for a reference output."""

import inspect

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        for frame in inspect.stack():
            ref = frame.frame.f_locals.get("reference")
            if isinstance(ref, torch.Tensor):
                return ref
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
''',
    "cheat_list_result.py": '''\
"""Cheat: answers the harness's result pipe itself with a JSON array and exits 0 before the
harness can report, hoping the server trips over a result of the wrong shape."""

import os

import torch

from loom_mcp.worker import protocol


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        protocol.send_result([1])
        os._exit(0)
''',
    "cheat_phase_detection.py": '''\
"""Exploit class: phase detection. Honest while being validated (the first calls of a process),
then returns garbage once it believes it is being timed."""

import torch

_CALLS = [0]


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        _CALLS[0] += 1
        if _CALLS[0] > 20:
            return x
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
''',
    "cheat_calls_reference.py": '''\
"""Exploit class: calling the reference. Loads the task file and runs its Model."""

import importlib.util
import pathlib

import torch

_spec = importlib.util.spec_from_file_location("ref", pathlib.Path(__file__).with_name("task_rmsnorm.py"))
_ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ref)


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.inner = _ref.Model(dim)

    def forward(self, x):
        return self.inner(x)
''',
    "cheat_deferred_work.py": '''\
"""Exploit class: deferred work aimed at the other arm. The output is honest and computed in
the call, but a finalizer queues a long busy-wait on the GPU for later, when the garbage
collector runs it: with luck, while the baseline is being timed."""

import weakref

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        if x.is_cuda:
            weakref.finalize(y, torch.cuda._sleep, 50_000_000)
        return y
''',
    "cheat_try_fallback.py": '''\
"""Exploit class: try/except fallback. The 'kernel' always fails; torch does the work."""

import torch


def fast_kernel(x, w):
    raise RuntimeError("not implemented")


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        try:
            return fast_kernel(x, self.weight)
        except Exception:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
''',
}


def copy_redteam(root: Path) -> Path:
    """tests/redteam, with the short cheats above, as a fresh directory under `root`."""
    target = root / "redteam"
    shutil.copytree(REDTEAM, target)
    for name, source in SHORT_CHEATS.items():
        (target / name).write_text(source)
    return target


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("redteam")
    copy_redteam(root)
    # These tests look at what the candidate does while timed, not at the CI: two blocks of
    # fresh arm processes each (the fewest allowed) keep every CPU benchmark short.
    (root / "home").mkdir()
    (root / "home" / "loom.toml").write_text("[gate]\nwall_clock_blocks = 2\nwall_clock_max_blocks = 2\n")
    return root


@pytest.fixture(scope="module")
def server(workspace):
    home = workspace / "home"
    return build_server(load_config(home, environ={"LOOM_ALLOWED_ROOTS": str(workspace)}))


async def validate(server, workspace: Path, candidate: str) -> dict:
    async with Client(server) as client:
        result = await client.call_tool("run_validation", {
            "task": str(workspace / "redteam" / "task_rmsnorm.py"),
            "candidate": str(workspace / "redteam" / candidate)})
    assert result.is_error is False, result.content
    return result.structured_content


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_result_of_the_wrong_shape_is_the_candidates_crash_not_internal(server, workspace):
    """The result pipe carries whatever the worker's process sends: a candidate that answers it
    with an array and exits 0 fails validation as a crash (it was [INTERNAL] before)."""
    report = await validate(server, workspace, "cheat_list_result.py")
    assert report["passed"] is False
    crash = [f for f in report["findings"] if f["check"] == "validation.crash"]
    assert crash and "not a result object" in crash[0]["message"]


@pytest.mark.anyio
@pytest.mark.parametrize("candidate", ["honest_torch.py", "honest_triton.py"])
async def test_honest_candidates_pass(server, workspace, candidate):
    report = await validate(server, workspace, candidate)
    assert report["passed"] is True, report
    assert report["cases_total"] == 2 * 5 and report["cases_failed"] == 0
    assert {c["input_kind"] for c in [report["worst_case"]]} <= {"normal", "heavy_tailed", "scaled_1e-3", "scaled_64"}
    # Inputs and outputs are scratch: none is left behind in the jobs' directories.
    assert sorted(p.name for p in (workspace / "home" / "jobs").rglob("*.pt")) == []


@pytest.mark.anyio
@pytest.mark.parametrize("candidate", sorted(CHEATS))
async def test_cheats_are_rejected_with_the_named_check(server, workspace, candidate):
    exploit, expected = CHEATS[candidate]
    report = await validate(server, workspace, candidate)
    checks = {f["check"] for f in report["findings"] if f["severity"] == "error"}
    assert report["passed"] is False, f"{exploit} passed validation"
    assert checks & expected, f"{exploit}: expected one of {expected}, got {checks}"
    # The gate agrees: no validation pass, no accept, whatever a benchmark would say.
    verdict = decide(CompileEvidence(ok=True), ValidationEvidence(
        validation_id=report["validation_id"], passed=False), None, load_config(
            workspace / "home", environ={"LOOM_ALLOWED_ROOTS": str(workspace)}).gate)
    assert verdict.verdict == "reject"


@pytest.mark.gpu
@pytest.mark.anyio
async def test_extra_stream_is_caught_on_gpu(server, workspace):
    report = await validate(server, workspace, "cheat_extra_stream.py")
    checks = {f["check"] for f in report["findings"]}
    assert report["passed"] is False
    assert checks & {"validation.late_write", "static.extra_stream"}


async def bench(server, workspace: Path, candidate: str, shape: str = "rows5_d37") -> dict:
    async with Client(server) as client:
        result = await client.call_tool("benchmark", {
            "task": str(workspace / "redteam" / "task_rmsnorm.py"),
            "candidate": str(workspace / "redteam" / candidate), "shapes": [shape]})
    assert result.is_error is False, result.content
    return result.structured_content


@pytest.mark.gpu
@pytest.mark.anyio
@pytest.mark.parametrize(("candidate", "proven"), [("honest_triton.py", True),
                                                   ("cheat_kernel_in_init.py", False)])
async def test_proof_of_execution_records_the_forward_only(server, workspace, candidate, proven):
    """The proof process's profiler warms up beside the timing and records one forward: a kernel
    launched only while the model is built proves nothing."""
    timed = await bench(server, workspace, candidate)
    assert timed["proof_of_execution"] is proven, timed["proof_note"]


@pytest.mark.gpu
@pytest.mark.anyio
async def test_forged_event_clocks_change_no_number_on_gpu(server, workspace):
    """The arms' own events are the GPU samples. A candidate that rebinds the event clock is
    timed with the originals all the same (the same maths as the reference: about 1x, not the
    1.67x its clock claims) and is reported; an honest fused kernel of a few microseconds is not
    taken for a forged clock by the brackets' check."""
    forged = await bench(server, workspace, "attack_forged_events.py", shape="rows8_d64")
    assert 0.8 < forged["shapes"][0]["speedup"] < 1.25, forged["shapes"]
    assert "benchmark.timer_tampering" in {f["check"] for f in forged["findings"]}
    honest = await bench(server, workspace, "honest_torch.py", shape="rows8_d64")
    assert "benchmark.timing_disagreement" not in {f["check"] for f in honest["findings"]}, honest["findings"]


@pytest.mark.anyio
@pytest.mark.slow
async def test_phase_detection_is_caught_while_timed(server, workspace):
    """Honest for its first 20 calls (enough to pass validation), garbage afterwards."""
    report = await validate(server, workspace, "cheat_phase_detection.py")
    assert report["passed"] is True  # the exploit's premise: validation alone cannot see it
    timed = await bench(server, workspace, "cheat_phase_detection.py")
    assert "benchmark.output_mismatch" in {f["check"] for f in timed["findings"]}


# Validation reports of one candidate in one workspace, for tests that each need it to pass
# before they time it (the same bytes give the same report; a validation is seconds of workers).
_validated: dict[tuple[Path, str], dict] = {}


async def validate_once(server, workspace: Path, candidate: str) -> dict:
    key = (workspace, candidate)
    if key not in _validated:
        _validated[key] = await validate(server, workspace, candidate)
    return _validated[key]


@pytest.mark.anyio
@pytest.mark.parametrize("shape", ["rows5_d37", "rows8_d64"])
@pytest.mark.slow
async def test_partial_work_once_timed_is_caught_while_timed(server, workspace, shape):
    """The last row skipped after validation: a fifth (5 rows) or an eighth (8 rows) of the
    output, under a quarter of most single calls' probes, so it is the shape's calls together
    that must catch it."""
    report = await validate_once(server, workspace, "cheat_phase_partial.py")
    assert report["passed"] is True
    timed = await bench(server, workspace, "cheat_phase_partial.py", shape)
    assert "benchmark.output_mismatch" in {f["check"] for f in timed["findings"]}


@pytest.mark.anyio
@pytest.mark.slow
async def test_pointer_cache_serves_stale_results_while_timed(server, workspace):
    timed = await bench(server, workspace, "cheat_pointer_cache.py")
    assert "benchmark.output_mismatch" in {f["check"] for f in timed["findings"]}


@pytest.mark.anyio
@pytest.mark.slow
async def test_timer_patch_is_detected_while_timed(server, workspace):
    timed = await bench(server, workspace, "cheat_timer_patch.py")
    checks = {f["check"] for f in timed["findings"]}
    assert "benchmark.timer_tampering" in checks
    # The harness bound its timer first, so the samples are real, not zero.
    assert all(s["candidate_median_s"] > 0 for s in timed["shapes"])


def bench_workers() -> list[int]:
    """Live benchmark arm processes, whatever pid namespace they sit in."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if b"loom_mcp.worker.bench" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.anyio
@pytest.mark.slow
async def test_honest_benchmark_reports_statistics(server, workspace):
    timed = await bench(server, workspace, "honest_torch.py")
    # No arm outlives the call: they are ended at "quit", and the whole process tree with them.
    assert not Path("/proc/self").exists() or bench_workers() == []
    assert timed["findings"] == []
    assert sorted(p.name for p in (workspace / "home" / "jobs").rglob("*.pt")) == []  # scratch gone
    shape = timed["shapes"][0]
    assert shape["pairs"] >= 10
    assert shape["ci_low"] <= shape["speedup"] <= shape["ci_high"]
    # Every shape says whether its medians reached the gate's precision or the time cap did.
    assert {s["stop_reason"] for s in timed["shapes"]} <= {"precise", "time_cap"}
    if timed["timer"] == "wall_clock":
        assert "CPU" in timed["timer_note"]
    else:
        assert timed["timer"] in {"cuda_events", "hip_events"} and timed["l2_flushed"] is True
    ledger = Ledger(workspace / "home" / "ledger.sqlite3")
    assert ledger.run(timed["benchmark_id"])["kind"] == "benchmark"


# ---- degenerate outputs
# Red team, degenerate outputs: on a softmax over 20-30k columns every probability is below
# fp32's atol (1e-4) and far below bf16's (1e-2), so all zeros, the row mean everywhere, or the
# answer times 1e-3 met |out - ref| <= atol + rtol |ref| on every element. The tolerance is now
# relative to the reference's scale (atol capped at its RMS, plus a normwise bound); each such
# output must be rejected with `validation.mismatch`, and honest candidates, among them the
# reference's own code copied into ModelNew, must still pass. Through the real MCP protocol and
# sandboxed workers, on the CPU.
# Its own workspace and server (no loom.toml), apart from the ones above.

TASK = "task_softmax_wide.py"

DEGENERATE_CHEATS = {
    "cheat_zero_softmax.py": "all zeros",
    "cheat_constant_output.py": "the row mean everywhere",
    "cheat_scaled_copy.py": "the answer times 1e-3",
}
HONEST = ["honest_softmax_wide.py", "honest_softmax_wide_fused.py"]


@pytest.fixture(scope="module")
def degenerate_workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("degenerate")
    copy_redteam(root)
    return root


@pytest.fixture(scope="module")
def degenerate_server(degenerate_workspace):
    return build_server(load_config(degenerate_workspace / "home",
                                    environ={"LOOM_ALLOWED_ROOTS": str(degenerate_workspace)}))


async def validate_with_evidence(server, workspace: Path, candidate: str) -> tuple[dict, dict]:
    """(the tool's result, the full evidence from loom://runs/{id})."""
    async with Client(server) as client:
        result = await client.call_tool("run_validation", {
            "task": str(workspace / "redteam" / TASK),
            "candidate": str(workspace / "redteam" / candidate)})
        assert result.is_error is False, result.content
        report = result.structured_content
        record = await client.read_resource(f"loom://runs/{report['validation_id']}")
    return report, json.loads(record.contents[0].text)["evidence"]


@pytest.mark.anyio
@pytest.mark.parametrize("candidate", sorted(DEGENERATE_CHEATS))
@pytest.mark.slow
async def test_degenerate_outputs_are_rejected_as_mismatch(degenerate_server, degenerate_workspace, candidate):
    report, evidence = await validate_with_evidence(degenerate_server, degenerate_workspace, candidate)
    errors = {f["check"]: f["message"] for f in report["findings"] if f["severity"] == "error"}
    assert report["passed"] is False, f"{DEGENERATE_CHEATS[candidate]} passed validation"
    assert "validation.mismatch" in errors, errors
    message = errors["validation.mismatch"]
    assert "normwise relative error" in message and "reference RMS" in message, message
    # Every fp32 case fails (bf16 on nearly uniform rows may not: there a constant is as close to
    # the float64 answer as the bf16 reference itself is). The evidence carries both numbers.
    fp32 = [c for c in evidence["cases"] if c["dtype"] == "fp32"]
    assert fp32 and not any(c["passed"] for c in fp32)
    for case in fp32:
        assert case["norm_rel_err"] > case["norm_rel_bound"] >= 1e-4
        assert case["ref_norm_rel_err"] is not None and case["ref_norm_rel_err"] < 1e-5
        assert case["atol_effective"] < case["atol"]  # the RMS (~4e-5) caps atol's 1e-4
        assert 1e-5 < case["ref_rms"] < 1e-4


@pytest.mark.anyio
@pytest.mark.parametrize("candidate", HONEST)
async def test_honest_wide_softmax_passes_in_fp32_and_bf16(degenerate_server, degenerate_workspace, candidate):
    report, evidence = await validate_with_evidence(degenerate_server, degenerate_workspace, candidate)
    assert report["passed"] is True, report
    assert report["cases_failed"] == 0 and report["cases_total"] == 3 * 5
    assert {c["dtype"] for c in evidence["cases"]} == {"fp32", "bf16"}
    for case in evidence["cases"]:
        assert case["norm_rel_err"] <= case["norm_rel_bound"]
        if candidate == "honest_softmax_wide.py":  # the reference's own arithmetic, to the bit
            assert case["norm_rel_err"] == pytest.approx(case["ref_norm_rel_err"])


async def check_while_timed(workspace: Path, task: str, candidate: str) -> dict:
    """The whole judge (validate, benchmark, gate) on one red-team file, with wall-clock accepts
    allowed as the red team's policy did."""
    from loom_mcp.check import _check

    config = load_config(workspace / "home", environ={"LOOM_ALLOWED_ROOTS": str(workspace)})
    config = config.model_copy(update={"gate": config.gate.model_copy(update={"accept_wall_clock": True})})
    result = await _check(config, str(workspace / "redteam" / task), str(workspace / "redteam" / candidate), None, None)
    assert result["validation"]["passed"] is True  # the premise: validation alone cannot see it
    return result


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.parametrize(("task", "candidate", "codes"), [
    ("task_rmsnorm.py", "cheat_precision_when_timed.py", {"benchmark.output_drift"}),
    # Inputs too slow to draw afresh: the prepared sets, perturbed, are all the timer has.
    ("task_rmsnorm_slow_draw.py", "cheat_row_scale_cache.py", {"benchmark.output_drift", "benchmark.misbehaved"}),
    ("task_rmsnorm.py", "honest_torch.py", set()),
])
async def test_what_is_computed_while_timed_meets_validations_standard(workspace, task, candidate, codes):
    """Both cheats pass validation and were accepted before (a red-team pass on CPU); the whole
    judge now rejects them, and an honest kernel draws neither code."""
    result = await check_while_timed(workspace, task, candidate)
    found = set(result["verdict"]["reason_codes"]) & {"benchmark.output_drift", "benchmark.misbehaved"}
    if codes:
        assert result["verdict"]["verdict"] == "reject" and found & codes, result["verdict"]
        # The benchmark's own advice says so already: it read the passed validation of these bytes.
        expected = "less accurately" if found == {"benchmark.output_drift"} else "while timed"
        assert expected in result["benchmark"]["next_step"], result["benchmark"]["next_step"]
    else:
        assert not found, result["verdict"]
        shapes = result["benchmark"]["shapes"]
        assert all(s["output_deviation"] is not None and s["output_deviation"] < 1e-5 for s in shapes), shapes


@pytest.mark.anyio
@pytest.mark.slow
async def test_no_timed_call_is_served_from_a_look_ahead(workspace):
    """The other arm's pass leaves nothing to read ahead: the timer zeroes the shared sets
    after each pass and writes each call's content just before releasing it. The probe marks
    every timed call it could serve from outputs computed ahead; none may reach the timer."""
    result = await check_while_timed(workspace, "task_rmsnorm.py", "probe_lookahead.py")
    codes = set(result["verdict"]["reason_codes"])
    assert not codes & {"benchmark.misbehaved", "benchmark.output_drift"}, result["verdict"]
    shapes = result["benchmark"]["shapes"]
    assert all(s["output_deviation"] is not None and s["output_deviation"] < 1e-5 for s in shapes), shapes


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_forked_process_cannot_copy_what_the_baseline_is_timed_on(workspace):
    """Each arm maps input files of its own, written just before each of its calls: a worker the
    candidate forks finds nothing of the baseline's to copy. The probe marks every timed call it
    serves from such a copy; none may reach the timer (with shared files about half did)."""
    result = await check_while_timed(workspace, "task_rmsnorm_bf16.py", "probe_fork_snoop.py")
    codes = set(result["verdict"]["reason_codes"])
    assert not codes & {"benchmark.misbehaved", "benchmark.output_drift"}, result["verdict"]
    shapes = result["benchmark"]["shapes"]
    assert all(s["output_deviation"] is not None and s["output_deviation"] < 1e-5 for s in shapes), shapes


def test_the_timers_seeds_use_every_bit_a_generator_keeps():
    """torch keeps 32 bits of a seed: salts that differ only above bit 24 must still give other
    sets (a shifted salt kept 24 bits, few enough to tabulate)."""
    from loom_mcp.worker.timer import seed_of

    low = {seed_of(high << 24, "draw", 0) & 0xFFFFFFFF for high in range(256)}
    assert len(low) == 256
    assert seed_of(5, "draw", 0) != seed_of(5, "noise", 0) != seed_of(5, "draw", 1)
    assert all(0 <= seed_of(s, "draw", 0) < 1 << 63 for s in (0, 1 << 61, (1 << 62) - 1))


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.parametrize(("task", "candidate"), [
    ("task_rmsnorm.py", "cheat_row_scale_cache.py"),
    # On bf16 a cache hit corrected for the whole-tensor factor errs by ~0.5 %: inside the drift
    # limit, and accepted at 1.28x before the timer drew its sets afresh.
    ("task_rmsnorm_bf16.py", "cheat_row_scale_cache_corrected.py"),
])
async def test_a_cache_keyed_on_the_inputs_never_serves_a_timed_call(workspace, task, candidate):
    """Every batch's sets are drawn afresh by the task with a secret seed: what the candidate
    computes while timed is its miss path, as accurate as the reference, and no faster."""
    result = await check_while_timed(workspace, task, candidate)
    assert result["verdict"]["verdict"] == "reject", result["verdict"]
    assert "speedup.insufficient" in result["verdict"]["reason_codes"], result["verdict"]
    shapes = result["benchmark"]["shapes"]
    assert all(s["output_deviation"] is not None and s["output_deviation"] < 1e-5 for s in shapes), shapes
