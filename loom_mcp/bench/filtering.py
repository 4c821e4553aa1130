"""Which timing samples count: throttled samples and Tukey outliers dropped, pairs kept paired.

Pure numpy, no device code, so it runs in the trusted server and is tested on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from loom_mcp.bench.summary import as_array


def iqr_keep_mask(samples: ArrayLike, k: float = 1.5) -> np.ndarray:
    """True for samples inside [Q1 - k*IQR, Q3 + k*IQR] (Tukey fences; TritonBench uses k=1.5)."""
    x = as_array(samples)
    if x.size == 0:
        return np.zeros(0, dtype=bool)
    q1, q3 = np.percentile(x, [25, 75])
    spread = q3 - q1
    return (x >= q1 - k * spread) & (x <= q3 + k * spread)


@dataclass(frozen=True)
class FilteredSamples:
    baseline: np.ndarray
    candidate: np.ndarray
    throttled_dropped: int
    outliers_dropped: int
    blocks: np.ndarray | None = None  # each kept pair's block, when the pairs came in blocks

    @property
    def paired(self) -> bool:
        return self.baseline.size == self.candidate.size


def _unthrottled(n: int, throttled: Sequence[bool] | None, unit: str) -> np.ndarray:
    """True for each of n samples (or pairs) not taken while throttled."""
    keep = np.ones(n, dtype=bool)
    if throttled is not None:
        flags = np.asarray(throttled, dtype=bool)
        if flags.size != n:
            raise ValueError(f"need one throttle flag per {unit}")
        keep &= ~flags
    return keep


def _drop_outliers(keep: np.ndarray, arms: Sequence[np.ndarray], iqr_k: float | None) -> int:
    """Clears `keep` where any arm's sample is a Tukey outlier among the kept ones (with iqr_k
    and 4 kept at least); returns how many it cleared."""
    if iqr_k is None or keep.sum() < 4:
        return 0
    idx = np.flatnonzero(keep)
    inner = np.logical_and.reduce([iqr_keep_mask(arm[idx], iqr_k) for arm in arms])
    keep[idx[~inner]] = False
    return int((~inner).sum())


def filter_samples(
    samples: ArrayLike, throttled: Sequence[bool] | None = None, iqr_k: float | None = None
) -> tuple[np.ndarray, int, int]:
    """One arm: drop throttled samples, then (optionally) Tukey outliers.

    Returns (kept, throttled_dropped, outliers_dropped). Throttle flags go first because a
    throttled sample is known-bad, while an outlier is only unusual.
    """
    x = as_array(samples)
    keep = _unthrottled(x.size, throttled, "sample")
    throttled_dropped = int(x.size - keep.sum())
    outliers_dropped = _drop_outliers(keep, [x], iqr_k)
    return x[keep], throttled_dropped, outliers_dropped


def filter_pairs(
    baseline: ArrayLike,
    candidate: ArrayLike,
    throttled: Sequence[bool] | None = None,
    iqr_k: float | None = None,
    blocks: Sequence[int] | None = None,
) -> FilteredSamples:
    """Paired arms: drop whole pairs, so the survivors stay paired.

    A pair goes if it was taken while throttled, or (with iqr_k) if either arm's sample is a
    Tukey outlier within its own arm. Counts are samples (a dropped pair counts 2), the unit
    BenchmarkEvidence reports. Arms of unequal length cannot be
    paired; they are filtered per arm (throttle flags and block labels then cannot apply).
    """
    b = as_array(baseline, "baseline samples")
    c = as_array(candidate, "candidate samples")
    labels = None if blocks is None else np.asarray(blocks, dtype=np.int64).ravel()
    if labels is not None and labels.size != b.size:
        raise ValueError("need one block label per pair")
    if b.size != c.size:
        if throttled is not None or labels is not None:
            raise ValueError("throttle flags and block labels need paired arms of equal length")
        bk, _, bo = filter_samples(b, None, iqr_k)
        ck, _, co = filter_samples(c, None, iqr_k)
        return FilteredSamples(bk, ck, 0, bo + co)
    keep = _unthrottled(b.size, throttled, "pair")
    throttled_dropped = 2 * int(b.size - keep.sum())
    outliers_dropped = 2 * _drop_outliers(keep, [b, c], iqr_k)
    return FilteredSamples(
        b[keep], c[keep], throttled_dropped, outliers_dropped, None if labels is None else labels[keep]
    )
