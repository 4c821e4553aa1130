"""Interval arithmetic on numpy arrays: unions, their lengths, and the gaps between them."""

from __future__ import annotations

import numpy as np


def merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Union of [start, end) intervals as disjoint sorted intervals.

    Returns (merged_starts, merged_ends, first) where `first[i]` is the index (into the input)
    of the interval that opens merged interval i: the event that ended each idle gap.
    """
    n = len(starts)
    if n == 0:
        empty = np.zeros(0)
        return empty, empty, np.zeros(0, dtype=np.int64)
    order = np.argsort(starts, kind="stable")
    s = starts[order]
    e = np.maximum.accumulate(ends[order])
    new = np.empty(n, dtype=bool)
    new[0] = True
    np.greater(s[1:], e[:-1], out=new[1:])
    idx = np.flatnonzero(new)
    ms = s[idx]
    me = np.empty(len(idx))
    me[:-1] = e[idx[1:] - 1]
    me[-1] = e[-1]
    return ms, me, order[idx]


def union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    ms, me, _ = merge(starts, ends)
    return float(np.sum(me - ms)) if len(ms) else 0.0
