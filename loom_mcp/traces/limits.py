"""Bounds on one trace analysis: what a hostile trace file can cost the server.

A trace is agent-supplied input. Without bounds, 2 MB of `[[[[...` grew the parser to 20 GB
(ijson builds one prefix string per level), a gzip bomb inflated 4 MB to 4.3 GB, and a
rocprofv3 file could claim any size in its gzip trailer. The limits:

- `max_depth`: JSON nesting. Kineto events nest about 6 levels (an event, its args, the
  per-input shape lists), rocprofv3 records about 8; 64 is far beyond any real trace format and
  keeps every parser (ijson, orjson, the recursive helpers) far from its own stack limits.
- `max_token_bytes`: one JSON string or number (with the blanks around it). Names in real
  traces are at most a few KB; yajl re-copies a token that spans reads, so a single 64 MiB
  string cost 9 s of parsing and a 4 GB one would never finish.
- `max_inflated_bytes`: bytes a compressed trace may inflate to. 4 GiB covers the largest
  traces the analysis is benchmarked on (1 GB Kineto) with room to spare.
- `max_ratio`: inflated / compressed bytes, checked once `ratio_grace_bytes` have been inflated.
  Real gzipped traces compress 10-25x (the H100/H200/MI300X/rocprofv3 fixtures: 10.8-22.7);
  deflate's ceiling is about 1030x, which is what bombs use.
- `timeout_s` and `memory_bytes`: wall time and address space of the child process that runs
  one analysis (see `isolate.py`); the 1 GB Kineto benchmark needs about 16 s and 170 MiB.

Every limit can be changed by an environment variable (`LOOM_TRACE_*`, below). Hitting one is a
`[BAD_INPUT]` error that names the limit.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, fields

GiB = 1 << 30
MiB = 1 << 20

ENV = {
    "max_depth": "LOOM_TRACE_MAX_DEPTH",
    "max_token_bytes": "LOOM_TRACE_MAX_TOKEN_BYTES",
    "max_inflated_bytes": "LOOM_TRACE_MAX_INFLATED_BYTES",
    "max_ratio": "LOOM_TRACE_MAX_RATIO",
    "ratio_grace_bytes": "LOOM_TRACE_RATIO_GRACE_BYTES",
    "timeout_s": "LOOM_TRACE_TIMEOUT_S",
    "memory_bytes": "LOOM_TRACE_MEMORY_BYTES",
}


@dataclass(frozen=True)
class TraceLimits:
    max_depth: int = 64
    max_token_bytes: int = 16 * MiB
    max_inflated_bytes: int = 4 * GiB
    max_ratio: float = 200.0
    ratio_grace_bytes: int = 16 * MiB
    timeout_s: float = 300.0
    memory_bytes: int = 4 * GiB

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TraceLimits:
        env = os.environ if environ is None else environ
        kw: dict[str, int | float] = {}
        for f in fields(cls):
            raw = env.get(ENV[f.name])
            if raw is None or not raw.strip():
                continue
            try:
                v = float(raw)
            except ValueError:
                continue  # a typo must not switch a limit off
            if v > 0:
                kw[f.name] = int(v) if f.type in ("int", int) else v
        return cls(**kw)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)


_ACTIVE: ContextVar[TraceLimits | None] = ContextVar("loom_trace_limits", default=None)


def current() -> TraceLimits:
    """The limits in force: those set by `use_limits`, else the environment's."""
    return _ACTIVE.get() or TraceLimits.from_env()


@contextmanager
def use_limits(limits: TraceLimits) -> Iterator[TraceLimits]:
    token = _ACTIVE.set(limits)
    try:
        yield limits
    finally:
        _ACTIVE.reset(token)


def human_bytes(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:g} GiB"
    if n >= MiB:
        return f"{n / MiB:g} MiB"
    return f"{int(n)} bytes"
