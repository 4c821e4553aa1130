"""Columnar, format-neutral container the readers fill and the analysis reads.

Readers append into `array` columns (8 bytes a value) rather than keeping event dicts, so a
trace of millions of events costs tens of MB, and the analysis turns the columns into numpy
arrays without copying. All times are microseconds, as floats.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loom_mcp.traces.secrets import scrub_any, scrub_text

KIND_KERNEL = 0
KIND_MEMCPY = 1
KIND_MEMSET = 2

NO_ID = -1


class Interner:
    """Maps strings to small ints; names repeat millions of times in a trace."""

    __slots__ = ("ids", "values")

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.values: list[str] = []

    def __call__(self, s: str) -> int:
        i = self.ids.get(s)
        if i is None:
            i = len(self.values)
            self.ids[s] = i
            self.values.append(s)
        return i

    def __getitem__(self, i: int) -> str:
        return self.values[i]

    def __len__(self) -> int:
        return len(self.values)

    def scrub(self) -> None:
        """Redact secrets in the stored values (ids stay valid; lookups by raw value stop)."""
        self.values = [scrub_any(v) for v in self.values]
        self.ids = {}


@dataclass(frozen=True)
class OpSig:
    """What an op was called with: enough to model its FLOPs and bytes."""

    name: str
    dims: Any = None  # Kineto "Input Dims": list per input (list of ints, or nested for lists)
    types: Any = None  # Kineto "Input type": list of dtype strings
    concrete: Any = None  # Kineto "Concrete Inputs": scalars as strings ("" for tensors)


def _d() -> array:
    return array("d")


def _q() -> array:
    return array("q")


def _i() -> array:
    return array("i")


@dataclass
class TraceData:
    source_format: str
    names: Interner = field(default_factory=Interner)
    # GPU activities: kernels, memcpys, memsets.
    g_name: array = field(default_factory=_i)
    g_kind: array = field(default_factory=_i)
    g_ts: array = field(default_factory=_d)
    g_dur: array = field(default_factory=_d)
    g_dev: array = field(default_factory=_q)
    g_stream: array = field(default_factory=_q)
    g_corr: array = field(default_factory=_q)
    g_ext: array = field(default_factory=_q)
    g_bytes: array = field(default_factory=_q)
    # Host API calls that carry a correlation id (kernel launches, memcpy calls, graph launches).
    l_name: array = field(default_factory=_i)
    l_ts: array = field(default_factory=_d)
    l_dur: array = field(default_factory=_d)
    l_thread: array = field(default_factory=_q)
    l_corr: array = field(default_factory=_q)
    l_ext: array = field(default_factory=_q)
    # Host ops (framework operators and annotations) that launches can be attributed to.
    o_ext: array = field(default_factory=_q)
    o_sig: array = field(default_factory=_i)
    o_ts: array = field(default_factory=_d)
    o_dur: array = field(default_factory=_d)
    o_thread: array = field(default_factory=_q)
    sigs: list[OpSig] = field(default_factory=list)
    sig_ids: dict[bytes, int] = field(default_factory=dict)
    # Flow-event ends ("f", ac2g) only used when GPU events lack a correlation arg.
    f_dev: array = field(default_factory=_q)
    f_stream: array = field(default_factory=_q)
    f_ts: array = field(default_factory=_d)
    f_id: array = field(default_factory=_q)
    threads: Interner = field(default_factory=Interner)
    devices: dict[int, str] = field(default_factory=dict)
    # Top-level blocks outside the profiler's own schema: name -> (keys, secret-looking keys,
    # secret-looking values). The values themselves are dropped in the reader.
    metadata_blocks: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    stream_capture_calls: int = 0

    def np(self, name: str) -> np.ndarray:
        col = getattr(self, name)
        code = col.typecode
        dtype = {"d": np.float64, "q": np.int64, "i": np.int32}[code]
        if len(col) == 0:
            return np.zeros(0, dtype=dtype)
        return np.frombuffer(col, dtype=dtype)

    @property
    def n_gpu(self) -> int:
        return len(self.g_ts)

    def scrub(self) -> None:
        """Redact secret-looking substrings in every string the trace brought in.

        Called once per trace by `read_trace`, after the reader is done and before any analysis:
        op, kernel, API and annotation names, device names, op signatures (shapes, dtypes,
        concrete inputs), thread keys, metadata block names and notes. Redacting here, before
        names are shortened or cut to a column width, means no cut can leave part of a token
        that the patterns no longer recognise. The output models scrub once more on the way
        out (`models._M`), so a field added later cannot bypass it.
        """
        self.names.scrub()
        self.threads.scrub()
        self.devices = {k: scrub_text(str(v)) for k, v in self.devices.items()}
        self.sigs = [
            OpSig(scrub_text(str(s.name)), scrub_any(s.dims), scrub_any(s.types), scrub_any(s.concrete))
            for s in self.sigs
        ]
        self.sig_ids = {}
        self.metadata_blocks = {scrub_text(k): v for k, v in self.metadata_blocks.items()}
        self.notes = [scrub_text(n) for n in self.notes]
