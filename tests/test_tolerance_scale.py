"""Closeness relative to the reference's scale (loom_mcp.worker.reference.compare_one), directly:
atol capped at the reference's RMS, a normwise bound that allows a few times the reference's own
error in its dtype, and the plain absolute check where the reference has nothing to scale by."""

from __future__ import annotations

import math

import pytest
import torch

from loom_mcp.judge_models import DEFAULT_TOLERANCES
from loom_mcp.worker import reference as ref

FP32 = {"atol": 1e-4, "rtol": 1e-4}
BF16 = {"atol": 1e-2, "rtol": 1e-2}


def softmax_case(dtype: torch.dtype = torch.float32, cols: int = 32768, scale: float = 1.0):
    """(native, exact): softmax over wide rows, run in `dtype` and in float64."""
    x = (torch.randn(4, cols, generator=torch.Generator().manual_seed(0)) * scale).to(dtype)
    return torch.softmax(x, -1), torch.softmax(x.double(), -1)


def compare(out, native, exact, tol):
    stats = ref.reference_stats([native], [exact] if exact is not None else None)[0]
    return ref.compare_one(out, native, exact, tol, stats)


def test_floors_follow_the_default_tolerances():
    for dtype, floor in ref.RTOL_FLOOR.items():
        assert DEFAULT_TOLERANCES[dtype].rtol == floor


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.bfloat16, BF16)])
@pytest.mark.parametrize("cheat", ["zeros", "mean", "scaled"])
def test_degenerate_outputs_fail_where_atol_alone_passes_them(dtype, tol, cheat):
    native, exact = softmax_case(dtype, scale=0.1)  # every probability below 1e-4
    assert float(exact.max()) < tol["atol"]
    out = {"zeros": torch.zeros_like(native), "mean": torch.full_like(native, 1 / native.shape[-1]),
           "scaled": native * 1e-3}[cheat]
    # The plain elementwise rule passes it: every error is below atol.
    assert ((out.double() - exact).abs() <= tol["atol"] + tol["rtol"] * exact.abs()).all()
    result = compare(out, native, exact, tol)
    assert not result["passed"]
    assert result["norm_rel_err"] > result["norm_rel_bound"]
    assert result["atol_effective"] < tol["atol"]
    assert result["message"].startswith("normwise relative error ||out - ref|| / ||ref|| = ")
    assert "reference RMS" in result["message"]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.bfloat16, BF16)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 64.0])
def test_honest_outputs_pass(dtype, tol, scale):
    native, exact = softmax_case(dtype, scale=scale)
    # The reference itself, and the same math done another way (in fp32, then rounded).
    x = torch.randn(4, 32768, generator=torch.Generator().manual_seed(0)) * scale
    other = torch.exp(x.to(dtype).float() - x.to(dtype).float().amax(-1, keepdim=True))
    other = (other / other.sum(-1, keepdim=True)).to(dtype)
    for out in (native.clone(), other):
        result = compare(out, native, exact, tol)
        assert result["passed"], result["message"]
        assert result["norm_rel_err"] <= result["norm_rel_bound"]
    assert compare(native, native, exact, tol)["norm_rel_err"] == pytest.approx(
        ref.reference_stats([native], [exact])[0]["ref_norm_rel_err"])


def test_the_references_own_error_widens_the_bound():
    """fp16 outputs in the subnormal range (silu * up at inputs x 1e-3) carry relative errors of
    several percent in the reference itself; a candidate as good as the reference passes."""
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(2, 700, generator=g) * 1e-3 for _ in range(2))
    native = (torch.nn.functional.silu(a.half()) * b.half())
    exact = torch.nn.functional.silu(a.half().double()) * b.half().double()
    stats = ref.reference_stats([native], [exact])[0]
    assert stats["ref_norm_rel_err"] > 1e-2 > 0  # worse than fp16's rtol in norm
    other = (torch.nn.functional.silu(a.half().float()) * b.half().float()).half()
    result = ref.compare_one(other, native, exact, BF16, stats)
    assert result["passed"], result["message"]
    assert result["norm_rel_bound"] == pytest.approx(ref.REF_ERROR_FACTOR * stats["ref_norm_rel_err"])


def test_an_all_zero_reference_keeps_the_absolute_check():
    native = torch.zeros(8, 64)
    exact = native.double()
    noise = torch.full_like(native, 5e-5)
    result = compare(noise, native, exact, FP32)
    assert result["passed"] and result["norm_rel_bound"] is None and result["atol_effective"] == 1e-4
    assert not compare(torch.full_like(native, 2e-4), native, exact, FP32)["passed"]


def test_a_small_localised_error_is_caught_by_the_capped_atol():
    """Zeroing every probability under 1e-5 of a peaked softmax (98 % of them) moves the norm by
    5e-5 of itself, inside the bound, but some zeroed elements are off by more than the capped
    atol (1e-4 x the RMS, ~1e-6)."""
    native, exact = softmax_case(torch.float32, cols=4096, scale=8.0)
    out = torch.where(native < 1e-5, torch.zeros_like(native), native)
    result = compare(out, native, exact, FP32)
    assert result["norm_rel_err"] < result["norm_rel_bound"]
    assert not result["passed"] and result["mismatched"] > 0
    assert "capped from 0.0001" in result["message"]


def test_non_float_outputs_and_no_float64_run():
    ints = torch.arange(10)
    result = ref.compare_one(ints.clone(), ints, None, {"atol": 0.0, "rtol": 0.0})
    assert result["passed"] and result["norm_rel_err"] is None and result["atol_effective"] is None
    native, _ = softmax_case(torch.float32, scale=0.1)
    result = ref.compare_one(torch.zeros_like(native), native, None, FP32)  # native reference only
    assert not result["passed"] and result["ref_norm_rel_err"] is None
    assert result["norm_rel_bound"] == FP32["rtol"] and math.isclose(result["norm_rel_err"], 1.0)


def test_a_task_rtol_of_zero_still_has_a_floor():
    native, exact = softmax_case(torch.float32, scale=1.0)
    result = compare(native.clone(), native, exact, {"atol": 1e-3, "rtol": 0.0})
    assert result["passed"] and result["norm_rel_bound"] == 1e-4


def test_the_degenerate_warning_is_relative_to_the_outputs_scale():
    """Warned when the mean everywhere would pass the normwise rule; tiny values that vary are
    not constant (the old absolute threshold called every wide softmax constant)."""
    x = torch.randn(4, 30000, generator=torch.Generator().manual_seed(2))
    assert ref.degenerate([torch.zeros(8)]) and ref.degenerate([torch.full((8,), 3.0)])
    assert not ref.degenerate([torch.softmax(x, -1)])  # values ~3e-5, spread ~50 %
    nearly_uniform = torch.softmax(x * 1e-3, -1)  # spread 1e-3 of the values
    assert not ref.degenerate([nearly_uniform])  # fp32 resolves it: a constant fails
    assert ref.degenerate([nearly_uniform.bfloat16()])  # bf16 does not: a constant passes
    assert not ref.degenerate([torch.arange(5)])


TASK_WITH_CHECK = '''
import torch

SHAPES = [{"name": "wide", "rows": 2, "cols": 20000}]


class Model(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(torch.tanh(x), -1)


def get_inputs(rows=2, cols=20000):
    return [torch.randn(rows, cols)]


def check(out, ref):
    return bool((out - ref).abs().max() < 1e-3)  # lax on purpose
'''


@pytest.mark.parametrize("with_check", [False, True])
def test_the_workers_verdict_and_a_tasks_own_check(tmp_path, monkeypatch, with_check):
    """Through the worker's validate: zeros fail with both numbers reported; a task's check(out,
    ref) is the rule that counts where it exists (it may accept what is not close, e.g. up to a
    sign), and the numbers are still reported."""
    from tests.test_validation_handoff import _validate_as_the_candidate

    source = TASK_WITH_CHECK if with_check else TASK_WITH_CHECK.split("\ndef check")[0]
    task = tmp_path / "task.py"
    task.write_text(source)
    monkeypatch.setenv("LOOM_NONCE", "777")
    request = {"task": str(task), "seeds": 2, "shapes": None, "device": "cpu",
               "tolerances": {"fp32": FP32}}

    def zeros(cases_dir):
        from loom_mcp.worker import handoff

        cases = handoff.read_cases(cases_dir, wait_s=60)
        return [[torch.zeros_like(case["inputs"][0])] for case in cases]

    result = _validate_as_the_candidate(tmp_path, monkeypatch, request, zeros)
    outs = [case["outputs"][0] for case in result["cases"]]
    assert len(outs) == 2
    for out in outs:
        assert out["norm_rel_err"] == pytest.approx(1.0) and out["norm_rel_bound"] == 1e-4
        assert out["ref_norm_rel_err"] < 1e-5 and out["atol_effective"] < 1e-4
        assert out["passed"] is with_check
        assert (out["message"] is None) is with_check


def test_an_honest_gemm_whose_own_error_exceeds_atol_passes():
    """fp32 GEMM on inputs x 64: PyTorch's own fp32 result misses the float64 one by more than
    fp32's atol near zero outputs. The same product summed in another order (two halves of K) is
    as accurate and passes; the allowance is reported as widened, and a real bug still fails."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(64, 2048, generator=g) * 64, torch.randn(2048, 96, generator=g) * 64
    native, exact = a @ b, a.double() @ b.double()
    other = a[:, :1024] @ b[:1024] + a[:, 1024:] @ b[1024:]
    plain = (other.double() - exact).abs() > FP32["atol"] + FP32["rtol"] * exact.abs()
    assert plain.any()  # the task's tolerance alone rejects PyTorch-grade accuracy
    result = compare(other, native, exact, FP32)
    assert result["passed"], result["message"]
    assert result["ref_max_abs_err"] > FP32["atol"]
    assert result["atol_effective"] == pytest.approx(ref.REF_ERROR_FACTOR * result["ref_max_abs_err"])
    assert result["ref_norm_rel_err"] > 0 and result["norm_rel_err"] > 0
    wrong = other.clone()
    wrong[0, 0] += 100 * result["ref_max_abs_err"]
    failed = compare(wrong, native, exact, FP32)
    assert not failed["passed"] and failed["mismatched"] == 1
    assert "widened from 0.0001" in failed["message"]
    for cheat in (torch.zeros_like(native), native * 0.999):
        assert not compare(cheat, native, exact, FP32)["passed"]


@pytest.mark.parametrize("case", ["honest", "off", "nan_moved", "inf_and_huge"])
def test_a_comparison_in_pieces_reads_what_one_whole_pass_reads(monkeypatch, case):
    """A 6 GiB output is compared in pieces (whole float64 copies ran a 139 GiB GPU out of
    memory); every statistic and the verdict are those of one pass over the whole output."""
    from loom_mcp.worker import closeness

    gen = torch.Generator().manual_seed(3)
    exact = torch.randn(37, 29, generator=gen, dtype=torch.float64) * 3
    native = exact.float()
    out = (exact + 1e-6 * torch.randn(37, 29, generator=gen, dtype=torch.float64)).float()
    if case == "off":
        out[5:9] *= 1.5
    if case == "nan_moved":
        exact[2, 3] = native[2, 3] = float("nan")
        out[4, 4] = float("nan")
    if case == "inf_and_huge":
        exact[1, 1] = native[1, 1] = out[1, 1] = float("inf")
        exact[7, 2], native[7, 2], out[7, 2] = 1e300, float("inf"), float("inf")
        exact[0, 0] = 1e200
    tol = {"atol": 1e-4, "rtol": 1e-4}
    whole = closeness.compare_one(out, native, exact, tol, closeness.reference_stats([native], [exact])[0])
    monkeypatch.setattr(closeness, "CHUNK_ELEMENTS", 7)
    pieces = closeness.compare_one(out, native, exact, tol, closeness.reference_stats([native], [exact])[0])
    assert pieces.keys() == whole.keys()
    for key, value in whole.items():
        if isinstance(value, float) and math.isfinite(value):
            assert pieces[key] == pytest.approx(value, rel=1e-12), key
        else:
            assert pieces[key] == value, key
    assert whole["passed"] is (case == "honest")
    assert closeness.degenerate([torch.full((50,), 2.0)]) and not closeness.degenerate([native])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_float64_run_sees_the_inputs_the_native_run_was_given(dtype):
    """A task whose Model changes its input in place: the float64 run must still read the
    original input, or the reference's own error balloons and widens the bounds until an
    all-zero output passes (for float64 inputs, .double() is the tensor itself)."""
    import types

    from loom_mcp.worker.closeness import compare_one, reference_stats

    class Model(torch.nn.Module):
        def forward(self, x):
            x.mul_(2)
            return x + 1

    x = torch.randn(4096, dtype=dtype, generator=torch.Generator().manual_seed(0))
    native, exact, _ = ref.reference_outputs(types.SimpleNamespace(Model=Model), {"seed": 1}, [x], [], torch.device("cpu"))
    stats = reference_stats(native, exact)[0]
    assert stats["ref_norm_rel_err"] < 1e-6
    tol = {"atol": 1e-7, "rtol": 1e-7}
    assert not compare_one(torch.zeros_like(native[0]), native[0], exact[0], tol, stats)["passed"]
