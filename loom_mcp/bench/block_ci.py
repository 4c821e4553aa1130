"""CIs across blocks (CPU wall clock): one replicate per fresh timer and pair of arms.

* On a CPU a process keeps a bias of a few percent for its whole life (core placement, memory
  layout, allocator state): an identical candidate read 0.952 [0.949, 0.955] in one run and
  1.043 [1.039, 1.046] in the next. Samples within one process pair are independent of nothing
  that matters, so any CI over samples is far too narrow. The unit of replication is a *block*:
  a fresh timer and pair of arm processes. Each block gives one log ratio of medians per shape.
* The CI is a Student t interval of the mean of the blocks' log ratios (per shape; for the
  geomean, of each block's mean over shapes). With 4-8 blocks a bootstrap over blocks is too
  narrow (a percentile bootstrap of 4 values covers far less than 95 %); the t interval is exact
  when the log ratios are normal.
* Blocks are added until the geomean CI's relative half-width is below
  `wall_clock_ci_target`, from `wall_clock_blocks` up to `wall_clock_max_blocks`. The rule looks
  at the width only, never at which side of the threshold the estimate lies, so it does not
  shop for a verdict.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from loom_mcp.bench.filtering import FilteredSamples
from loom_mcp.bench.summary import as_array
from loom_mcp.judge_models import RatioCI


def block_log_ratios(baseline: ArrayLike, candidate: ArrayLike, blocks: ArrayLike) -> dict[int, float]:
    """log(median(baseline) / median(candidate)) within each block, keyed by block, ascending."""
    b = as_array(baseline, "baseline samples")
    c = as_array(candidate, "candidate samples")
    labels = np.asarray(blocks, dtype=np.int64).ravel()
    if not b.size == c.size == labels.size:
        raise ValueError("block ratios need paired arms and one block label per pair")
    if np.any(b <= 0) or np.any(c <= 0):
        raise ValueError("times must be positive")
    return {
        int(k): float(np.log(np.median(b[labels == k])) - np.log(np.median(c[labels == k]))) for k in np.unique(labels)
    }


@functools.lru_cache(maxsize=256)
def _t_quantile(level: float, dof: int) -> float:
    from scipy import stats as scipy_stats  # type: ignore[import-untyped]  # ~0.3 s: on first use

    return float(scipy_stats.t.ppf(0.5 + level / 2, dof))


def block_t_ci(log_ratios: ArrayLike, level: float = 0.95) -> RatioCI:
    """Speedup exp(mean) of per-block log ratios, with a Student t interval on k - 1 degrees of
    freedom: each block is one replicate, whatever its number of samples."""
    x = as_array(log_ratios, "block log ratios")
    if x.size < 2:
        raise ValueError("a CI across blocks needs at least 2 blocks")
    mean = float(np.mean(x))
    half = _t_quantile(level, int(x.size) - 1) * float(np.std(x, ddof=1)) / float(np.sqrt(x.size))
    return RatioCI(
        estimate=float(np.exp(mean)),
        ci_low=float(np.exp(mean - half)),
        ci_high=float(np.exp(mean + half)),
        level=level,
        resamples=0,
        method="block_t",
    )


@dataclass(frozen=True)
class BlockCIs:
    per_shape: list[RatioCI]
    geomean: RatioCI
    shape_ratios: list[list[float]]  # per shape, the speedup in each of its blocks
    geomeans: list[float]  # per block with every shape timed, the geomean speedup


def block_cis(kept: Sequence[FilteredSamples], level: float) -> BlockCIs | None:
    """Per-shape and geomean CIs across blocks; None when a shape, or the blocks every shape was
    timed in, number fewer than 2 (then only the bootstrap over samples is left)."""
    if not kept or any(f.blocks is None for f in kept):
        return None
    per_block = [block_log_ratios(f.baseline, f.candidate, f.blocks) for f in kept]  # type: ignore[arg-type]
    complete = sorted(set.intersection(*(set(r) for r in per_block)))
    if len(complete) < 2 or any(len(r) < 2 for r in per_block):
        return None
    joint = [float(np.mean([r[k] for r in per_block])) for k in complete]
    return BlockCIs(
        per_shape=[block_t_ci(list(r.values()), level) for r in per_block],
        geomean=block_t_ci(joint, level),
        shape_ratios=[[float(np.exp(v)) for v in r.values()] for r in per_block],
        geomeans=[float(np.exp(v)) for v in joint],
    )


def relative_half_width(ci: RatioCI) -> float:
    """Half the CI's width on the log scale, as a fraction of the estimate."""
    return float(np.expm1((np.log(ci.ci_high) - np.log(ci.ci_low)) / 2))
