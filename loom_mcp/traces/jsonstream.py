"""Streaming access to a JSON trace: the event array one dict at a time, plus the small
top-level blocks around it.

ijson (yajl2_c backend) builds one event at a time, so memory stays flat whatever the file
size. Everything outside the event array (device properties, versions, and any metadata or
environment block a harness added) is recovered from the first and last bytes of the stream,
which a recording wrapper keeps while ijson reads: that avoids a second full parse, which costs
as much as the first.
"""

from __future__ import annotations

import gzip
import os
import re
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import ijson
import numpy as np
import orjson

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.traces import limits as _limits
from loom_mcp.traces.secrets import scrub_text

HEAD_BYTES = 8 << 20
TAIL_BYTES = 8 << 20
READ_BYTES = 64 << 10  # what ijson asks for per read; also bounds the tail search window


def open_trace_file(path: Path) -> IO[bytes]:
    """The one place a trace file is opened (format sniffing, the JSON readers, the nsys
    reader's descriptor, content hashing, the scrubber).

    The server resolves an agent's path once and checks it against the allowed roots
    (`config.check_allowed`); this opens exactly that path with no symlink followed on the way
    (a link swapped in after the check is refused), as a regular file only (a FIFO would block,
    a device could have side effects): `safefs.open_resolved`. A relative path is made absolute
    without resolving anything; a path through a symlink is refused, so library callers pass
    resolved paths too."""
    from loom_mcp.sandbox.safefs import open_resolved

    return open_resolved(os.path.abspath(path), max_bytes=None)


class ByteSource(Protocol):
    """What the stream wrappers below need of their source: a file or another wrapper."""

    def read(self, n: int = -1, /) -> bytes: ...


# bytes.translate table: 1 for the bytes that matter to nesting, 0 for the rest; the result
# is read as a numpy bool array (translate is a plain C loop, twice as fast as a numpy lookup).
_SPECIAL = bytes(1 if c in b'[]{}"\\' else 0 for c in range(256))
_QUOTE, _BACKSLASH = 0x22, 0x5C


class DepthScanner:
    """Tracks JSON nesting depth and token length over a byte stream, chunk by chunk, and
    raises past a limit.

    Vectorised (numpy over each chunk, then over its few structural bytes): brackets inside
    strings do not count, quotes escaped by an odd run of backslashes do not toggle the string
    state, and the state (depth, inside a string, a pending escape, where the last structural
    byte was) carries across chunks. It sees each chunk before the parser does, so no parser
    ever meets a level past the limit. On invalid JSON its state may diverge from a parser's,
    but only after the first invalid byte, which the parser rejects anyway.

    Token length is the distance between consecutive structural bytes (quotes, and brackets
    outside strings): a whole string, or a number with the separators and blanks around it.
    yajl buffers a token that spans reads by copying it again for every read, so one long
    string costs time quadratic in its length (64 MiB: 9 s).
    """

    __slots__ = ("limit", "token_limit", "depth", "in_string", "escape", "name", "offset", "last")

    def __init__(self, limit: int, name: str, token_limit: int = 0) -> None:
        self.limit = limit
        self.token_limit = token_limit
        self.name = name
        self.depth = 0
        self.in_string = 0
        self.escape = False
        self.offset = 0  # stream offset of the next byte fed
        self.last = 0  # stream offset of the last structural byte

    def feed(self, b: bytes) -> None:
        base = self.offset
        self.offset += len(b)
        if self.escape:  # the previous chunk ended in an odd run of backslashes
            self.escape = False
            b = b[1:]
            base += 1
        a = np.frombuffer(b, dtype=np.uint8)
        pos = np.flatnonzero(np.frombuffer(b.translate(_SPECIAL), dtype=bool))
        if pos.size:
            self._structure(a, pos, base)
        if self.token_limit and self.offset - self.last > self.token_limit:
            self._too_long()

    def _structure(self, a: np.ndarray, pos: np.ndarray, base: int) -> None:
        ch = a[pos]
        is_bs = ch == _BACKSLASH
        if is_bs.any():
            # A character after an odd run of backslashes is escaped: it and the backslashes
            # are string content, whatever they are.
            bs = pos[is_bs]
            cut = np.flatnonzero(np.diff(bs) != 1)
            run_start = np.concatenate((bs[:1], bs[cut + 1]))
            run_end = np.concatenate((bs[cut], bs[-1:]))
            escaped = run_end[(run_end - run_start) % 2 == 0] + 1
            if escaped.size and escaped[-1] == len(a):
                self.escape = True
            keep = ~is_bs & ~np.isin(pos, escaped, assume_unique=True)
            ch = ch[keep]
            pos = pos[keep]
        is_q = ch == _QUOTE
        quotes = np.cumsum(is_q, dtype=np.int64)  # quotes up to and including each byte
        outside = ((quotes + self.in_string) & 1) == 0
        outside &= ~is_q
        br = ch[outside]
        if br.size:
            # "[" and "{" have bit 1 set, "]" and "}" do not: +1 / -1.
            levels = np.cumsum((br & 2).astype(np.int64) - 1)
            if self.depth + int(levels.max()) > self.limit:
                raise LoomError(
                    ErrorCode.BAD_INPUT,
                    f"{self.name}: JSON nested deeper than the limit of {self.limit} levels "
                    f"({_limits.ENV['max_depth']}); no trace format nests that deep",
                )
            self.depth += int(levels[-1])
        if quotes.size:
            self.in_string = (self.in_string + int(quotes[-1])) & 1
        if self.token_limit:
            structural = pos[is_q | outside]
            if structural.size:
                first = int(structural[0]) + base - self.last
                inner = int(np.diff(structural).max()) if structural.size > 1 else 0
                if max(first, inner) > self.token_limit:
                    self._too_long()
                self.last = int(structural[-1]) + base

    def _too_long(self) -> None:
        raise LoomError(
            ErrorCode.BAD_INPUT,
            f"{self.name}: a JSON string or number longer than the limit of "
            f"{_limits.human_bytes(self.token_limit)} ({_limits.ENV['max_token_bytes']}); "
            "no name or value in a trace is that long",
        )


@dataclass(eq=False)  # a stream: two readers are never equal
class GuardedReader:
    """Byte stream of a trace with its limits enforced as it is read: JSON nesting depth and,
    for gzip input, the inflated size and the compression ratio (counted while inflating, so a
    bomb is stopped after its first megabytes, whatever its gzip trailer claims)."""

    raw: IO[bytes] | gzip.GzipFile
    file: IO[bytes]
    name: str
    limits: _limits.TraceLimits
    compressed: bool
    inflated: int = field(default=0, init=False)
    depth: DepthScanner | None = field(init=False)

    def __post_init__(self) -> None:
        limits = self.limits
        self.depth = DepthScanner(limits.max_depth, self.name, limits.max_token_bytes) if limits.max_depth > 0 else None

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:
            parts: list[bytes] = []
            while True:
                b = self.read(READ_BYTES * 16)
                if not b:
                    return b"".join(parts)
                parts.append(b)
        b = self.raw.read(n)
        if b:
            if self.compressed:
                self._check_inflated(len(b))
            if self.depth is not None:
                self.depth.feed(b)
        return b

    def _check_inflated(self, n: int) -> None:
        self.inflated += n
        lim = self.limits
        if self.inflated > lim.max_inflated_bytes:
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"{self.name}: inflates past the limit of "
                f"{_limits.human_bytes(lim.max_inflated_bytes)} "
                f"({_limits.ENV['max_inflated_bytes']})",
            )
        if self.inflated > lim.ratio_grace_bytes:
            packed = max(1, self.file.tell())
            if self.inflated > lim.max_ratio * packed:
                raise LoomError(
                    ErrorCode.BAD_INPUT,
                    f"{self.name}: compression ratio over the limit of {lim.max_ratio:g}x "
                    f"({_limits.ENV['max_ratio']}): {_limits.human_bytes(packed)} inflated to "
                    f"more than {_limits.human_bytes(self.inflated)}, a compression bomb",
                )

    def close(self) -> None:
        try:
            self.raw.close()
        finally:
            if self.file is not self.raw:
                self.file.close()

    def __enter__(self) -> GuardedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_bytes(path: Path, limits: _limits.TraceLimits | None = None) -> GuardedReader:
    """Open plain or gzip-compressed JSON (sniffed by magic number, not by suffix), with the
    trace limits enforced on every read."""
    f = open_trace_file(path)
    try:
        magic = f.read(2)
        f.seek(0)
        raw: IO[bytes] | gzip.GzipFile = gzip.GzipFile(fileobj=f, mode="rb") if magic == b"\x1f\x8b" else f
    except BaseException:
        f.close()
        raise
    return GuardedReader(raw, f, scrub_text(path.name), limits or _limits.current(), compressed=raw is not f)


def json_error(path: Path, exc: Exception, pos: int | None = None) -> LoomError:
    """`[BAD_INPUT]` for a parser error. Only the parser's first line is kept: yajl goes on to
    quote the bytes around the error, which may hold a cut token no pattern recognises."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    near = f" in the first {pos} bytes" if pos else ""
    return LoomError(ErrorCode.BAD_INPUT, scrub_text(f"{path.name}: malformed JSON{near} ({first})"))


def peek(path: Path, n: int = 65536) -> bytes:
    with open_bytes(path) as f:
        return f.read(n)


class RecordingReader:
    """File-like wrapper that counts bytes and keeps the head and a rolling tail."""

    def __init__(self, raw: ByteSource, head_limit: int | None = None, tail_limit: int | None = None):
        self.raw = raw
        self.pos = 0
        self.head = bytearray()
        self.head_limit = HEAD_BYTES if head_limit is None else head_limit
        self.tail: deque[bytes] = deque()
        self.tail_size = 0
        self.tail_limit = TAIL_BYTES if tail_limit is None else tail_limit

    def read(self, n: int = -1) -> bytes:
        b = self.raw.read(n)
        if not b:
            return b
        if len(self.head) < self.head_limit:
            self.head += b[: self.head_limit - len(self.head)]
        self.tail.append(b)
        self.tail_size += len(b)
        while self.tail and self.tail_size - len(self.tail[0]) >= self.tail_limit:
            self.tail_size -= len(self.tail.popleft())
        self.pos += len(b)
        return b

    @property
    def tail_offset(self) -> int:
        return self.pos - self.tail_size

    def tail_bytes(self) -> bytes:
        return b"".join(self.tail)


def _first_char(buf: bytes) -> bytes:
    s = buf.lstrip()
    if s.startswith(b"\xef\xbb\xbf"):
        s = s[3:].lstrip()
    return s[:1]


def _keys_before(head: bytes, key: bytes) -> tuple[dict[str, Any], int] | None:
    """Top-level members that precede `key`, and the offset just past the `[` that opens its
    array; None when the head does not reach it."""
    start = 0
    while True:
        k = head.find(b'"' + key + b'"', start)
        if k < 0:
            return None
        try:
            obj = orjson.loads(head[:k] + b'"\\u0000":null}')
        except orjson.JSONDecodeError:
            start = k + 1
            continue
        bracket = head.find(b"[", k + len(key) + 2)
        if isinstance(obj, dict) and bracket >= 0:
            obj.pop("\x00", None)
            return obj, bracket + 1
        start = k + 1


def _keys_after(window: bytes, bare_array: bool) -> dict[str, Any] | None:
    """Members after the event array's closing bracket, found in the stream's last bytes.

    The closing bracket is the first `]` after which the rest of the document is a valid run
    of `, "key": value` members closed by `}`; any `]` inside an event fails that test because
    the rest then carries unbalanced braces or ends inside a string. Each test parses in place
    (the comma is swapped for `{` in a mutable copy), so no candidate costs a copy of the rest.
    """
    buf = bytearray(window)
    view = memoryview(buf)
    ws = b" \t\r\n"
    i = buf.find(b"]")
    while i >= 0:
        j = i + 1
        n = len(buf)
        while j < n and buf[j] in ws:
            j += 1
        if bare_array:
            if j == n:
                return {}
        elif j < n and buf[j] == 0x7D:  # "}": the array was the last member
            if not buf[j + 1 :].strip():
                return {}
        elif j < n and buf[j] == 0x2C:  # ","
            buf[j] = 0x7B  # "{"
            try:
                obj = orjson.loads(view[j:])
            except orjson.JSONDecodeError:
                obj = None
            buf[j] = 0x2C
            if isinstance(obj, dict):
                return obj
        i = buf.find(b"]", i + 1)
    return None


def _top_level_slow(path: Path, events_key: str) -> dict[str, Any]:
    """Second pass: every top-level member except the events (used when head/tail miss)."""
    out: dict[str, Any] = {}
    key: str | None = None
    builder: Any = None
    with open_bytes(path) as f:
        try:
            for prefix, event, value in ijson.parse(f, use_float=True):
                if prefix == "":
                    # Root-level events: the root map itself and its keys.
                    if builder is not None:
                        out[key] = builder.value  # type: ignore[index]
                        builder = None
                    if event == "map_key":
                        key = value
                        builder = None if key == events_key else ijson.ObjectBuilder()
                    continue
                if builder is not None:
                    builder.event(event, value)
        except ijson.JSONError as exc:
            raise json_error(path, exc) from exc
    return out


_BIG_INT = re.compile(rb"(?<![\w.\"\-])(\d{19,})(?![\w.])")


_MAX_HELD_DIGITS = 4096


class BigIntSafeReader:
    """Rewrites integers too large for int64 as floats while streaming.

    yajl (ijson's C backend) rejects them ("integer overflow"), and rocprofv3 writes 64-bit
    unsigned ids (agent hive ids) as bare numbers. Standalone numbers only: digits glued to a
    letter, quote or dot are left alone. Trailing digits of a read are held back so a number
    split across two reads is seen whole.
    """

    def __init__(self, raw: ByteSource):
        self.raw = raw
        self.carry = b""

    def read(self, n: int = -1) -> bytes:
        while True:
            b = self.raw.read(n)
            data = self.carry + b
            if not b:
                self.carry = b""
                break
            digits = len(data) - len(data.rstrip(b"0123456789"))
            if digits > _MAX_HELD_DIGITS:
                # No number is that long: pass it on (the parser rejects it) rather than hold
                # an ever-growing run back, which costs a copy of it per read.
                self.carry = b""
                break
            k = len(data) - digits
            if k > 0:
                k -= 1  # keep the character before the digits for the look-behind
            self.carry, data = data[k:], data[:k]
            if data:
                break
        return _BIG_INT.sub(rb"\1.0", data)


class JsonEventStream:
    """Iterate the events of `{..., "<events_key>": [...], ...}` or of a bare `[...]`.

    After iteration, `top` holds the other top-level members.
    """

    def __init__(self, path: Path, events_key: str = "traceEvents"):
        self.path = path
        self.events_key = events_key
        self.top: dict[str, Any] = {}
        self.count = 0
        self.last_pos = 0
        first = _first_char(peek(path, 4096))
        if first not in (b"{", b"["):
            raise LoomError(ErrorCode.BAD_INPUT, f"{scrub_text(path.name)}: not a JSON trace")
        self.bare_array = first == b"["

    @contextmanager
    def items(self) -> Iterator[tuple[Iterator[dict[str, Any]], RecordingReader]]:
        """(event iterator, reader). The caller loops over the events itself (a wrapping
        generator would cost a frame switch per event) and stores `reader.pos` after each
        event into `self.last_pos`; `finish()` then recovers the other members."""
        prefix = "item" if self.bare_array else f"{self.events_key}.item"
        with open_bytes(self.path) as raw:
            rec = RecordingReader(raw)
            try:
                yield ijson.items(rec, prefix, use_float=True, buf_size=READ_BYTES), rec
            except ijson.JSONError as exc:
                raise json_error(self.path, exc, rec.pos) from exc
            # Drain so the tail really is the end of the document.
            while rec.read(READ_BYTES):
                pass
            self.top = self._recover_top(rec, self.last_pos)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        with self.items() as (it, rec):
            for ev in it:
                self.last_pos = rec.pos
                self.count += 1
                yield ev

    def _recover_top(self, rec: RecordingReader, last_pos: int) -> dict[str, Any]:
        if self.bare_array:
            return {}
        found = _keys_before(bytes(rec.head), self.events_key.encode())
        if self.last_pos == 0 or found is None:
            # No events (small or odd document), or a head too big to hold the members before
            # the events: a second pass.
            return _top_level_slow(self.path, self.events_key)
        before, array_start = found
        # The closing bracket lies after the last event's first byte, which ijson had not yet
        # read one buffer before it yielded that event, and after the array's opening bracket.
        start = max(array_start, last_pos - READ_BYTES - 16)
        after: dict[str, Any] | None = None
        if rec.tail_offset <= start:
            window = rec.tail_bytes()[start - rec.tail_offset :]
            after = _keys_after(window, False)
        if after is None or self.events_key in after:
            return _top_level_slow(self.path, self.events_key)
        before.update(after)
        return before
