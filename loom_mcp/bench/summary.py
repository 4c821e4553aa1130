"""One arm's timing samples on their own: checked arrays, summaries, and the stopping rule.

Pure numpy, no device code, so it runs in the trusted server and is tested on CPU.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

from loom_mcp.judge_models import GateConfig, SampleSummary


def as_array(samples: ArrayLike, what: str = "samples") -> np.ndarray:
    """The samples as one flat float64 array; NaN or Inf is refused."""
    arr = np.asarray(samples, dtype=np.float64).ravel()
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{what} contain NaN or Inf")
    return arr


# ---------------------------------------------------------------- summaries


def summarize(samples: ArrayLike) -> SampleSummary:
    """Median, mean, std (n-1), stderr, IQR, MAD, min, max of one arm.

    A single sample has std and stderr 0.0; the stopping rule never trusts fewer than 2 samples.
    """
    x = as_array(samples)
    n = int(x.size)
    if n == 0:
        raise ValueError("cannot summarize zero samples")
    median = float(np.median(x))
    std = float(np.std(x, ddof=1)) if n > 1 else 0.0
    q1, q3 = np.percentile(x, [25, 75])
    return SampleSummary(
        n=n,
        median=median,
        mean=float(np.mean(x)),
        std=std,
        stderr=std / float(np.sqrt(n)),
        iqr=float(q3 - q1),
        mad=float(np.median(np.abs(x - median))),
        min=float(np.min(x)),
        max=float(np.max(x)),
    )


def relative_median_stderr(samples: ArrayLike) -> float:
    """Standard error of the median / median, from a robust spread; +inf when not estimable.

    se(median) = sqrt(pi/2) * sigma / sqrt(n), with sigma = 1.4826 * MAD (the normal-consistent
    MAD; the IQR's when the MAD is zero on quantised timers). The benchmark reports medians, so
    this is the precision that matters: a few slow outliers (a preempted launch, a clock ramp)
    inflate the mean's standard error for ever but move the median by one rank.
    """
    x = as_array(samples)
    if x.size < 2:
        return float("inf")
    median = float(np.median(x))
    if median <= 0:
        return float("inf")
    sigma = 1.4826 * float(np.median(np.abs(x - median)))
    if sigma == 0.0:
        q1, q3 = np.percentile(x, [25, 75])
        sigma = float(q3 - q1) / 1.349
    return float(np.sqrt(np.pi / 2) * sigma / np.sqrt(x.size) / median)


# ---------------------------------------------------------------- stopping rule

StopReason = Literal["precise", "time_cap"]


def stop_reason(
    samples: ArrayLike,
    stderr_target: float,
    min_samples: int,
    min_time_s: float,
    max_time_s: float,
    elapsed: float,
) -> StopReason | None:
    """Why sampling should stop now, or None to keep going.

    The time cap wins over everything (a slow kernel must not hold the device forever). Before
    min_samples and min_time_s nothing else counts: an early, lucky low variance is not precision.
    After that, stop once the median's relative standard error < stderr_target. (nvbench and
    gpu-mode use stderr/mean, which a few slow outliers keep high long after the medians we
    report are precise.)
    """
    if elapsed >= max_time_s:
        return "time_cap"
    if elapsed < min_time_s:  # checked first: this runs after every pair
        return None
    x = as_array(samples)
    if x.size < max(min_samples, 2):
        return None
    if relative_median_stderr(x) < stderr_target:
        return "precise"
    return None


def paired_stop_reason(
    baseline: ArrayLike,
    candidate: ArrayLike,
    config: GateConfig,
    elapsed: float,
) -> StopReason | None:
    """The A/B loop stops when both arms are precise, or at the time cap."""
    args = (config.stderr_target, config.min_samples, config.min_time_s, config.max_time_s, elapsed)
    reasons = (stop_reason(baseline, *args), stop_reason(candidate, *args))
    if None in reasons:
        return None
    return "time_cap" if "time_cap" in reasons else "precise"
