"""The benchmark's timed-output comparison: rounding passes, stale or cached outputs do not."""

from __future__ import annotations

import random

import pytest

from loom_mcp.bench.output_check import samples_agree, shape_disagrees

torch = pytest.importorskip("torch")


def bf16(values: list[float]) -> list[float]:
    return torch.tensor(values, dtype=torch.float64).to(torch.bfloat16).double().tolist()


def test_one_bf16_rounding_step_everywhere_agrees():
    """A fused kernel that rounds once vs a reference that rounds twice: one bf16 step apart
    at many positions, including outputs near zero (the case a sum-based check got wrong)."""
    rng = random.Random(0)
    for _ in range(500):
        exact = [rng.gauss(0, 1) for _ in range(32)]
        baseline = bf16(exact)
        candidate = [
            y + rng.choice([-1, 0, 1]) * 2.0 ** (int(abs(y) and __import__("math").frexp(y)[1]) - 8)
            for y in baseline
        ]
        assert samples_agree(candidate, baseline)


def test_outputs_of_stale_inputs_disagree():
    """Every input perturbed by U(0.9, 1.1): outputs computed from the previous inputs are off
    by a few percent almost everywhere."""
    rng = random.Random(1)
    caught = 0
    for _ in range(500):
        stale = [rng.gauss(0, 1) for _ in range(32)]
        fresh = [y * rng.uniform(0.9, 1.1) for y in stale]
        caught += not samples_agree(bf16(stale), bf16(fresh))
    assert caught >= 495


def test_missing_nan_and_shape_cases():
    assert not samples_agree(None, [1.0])
    assert not samples_agree([1.0], [1.0, 2.0])
    assert samples_agree([], [])
    assert samples_agree([float("nan"), 1.0, 2.0, 3.0], [float("nan"), 1.0, 2.0, 3.0])
    assert not samples_agree([float("inf")] * 4, [1.0] * 4)
    assert not samples_agree([0.0] * 8, [1.0] * 8)  # an unwritten (zeroed) output


def test_a_shape_disagrees_past_a_tenth_of_all_its_samples():
    # A tenth of the work skipped while timed: under a quarter in almost every single call of
    # 32 probes, but the sum over a shape's calls is the rule's business.
    assert shape_disagrees(off=65, total=32 * 20)
    assert not shape_disagrees(off=64, total=32 * 20)
    assert not shape_disagrees(off=0, total=0)
