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
import re
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import ijson
import orjson

from loom_mcp.errors import ErrorCode, LoomError

HEAD_BYTES = 8 << 20
TAIL_BYTES = 8 << 20
READ_BYTES = 64 << 10  # what ijson asks for per read; also bounds the tail search window


def open_bytes(path: Path) -> IO[bytes]:
    """Open plain or gzip-compressed JSON (sniffed by magic number, not by suffix)."""
    f = open(path, "rb")  # noqa: SIM115 - returned to the caller
    magic = f.read(2)
    f.seek(0)
    if magic == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=f, mode="rb")
    return f


def peek(path: Path, n: int = 65536) -> bytes:
    with open_bytes(path) as f:
        return f.read(n)


class RecordingReader:
    """File-like wrapper that counts bytes and keeps the head and a rolling tail."""

    def __init__(
        self, raw: IO[bytes], head_limit: int | None = None, tail_limit: int | None = None
    ):
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
    return out


_BIG_INT = re.compile(rb"(?<![\w.\"\-])(\d{19,})(?![\w.])")


class BigIntSafeReader:
    """Rewrites integers too large for int64 as floats while streaming.

    yajl (ijson's C backend) rejects them ("integer overflow"), and rocprofv3 writes 64-bit
    unsigned ids (agent hive ids) as bare numbers. Standalone numbers only: digits glued to a
    letter, quote or dot are left alone. Trailing digits of a read are held back so a number
    split across two reads is seen whole.
    """

    def __init__(self, raw: IO[bytes]):
        self.raw = raw
        self.carry = b""

    def read(self, n: int = -1) -> bytes:
        b = self.raw.read(n)
        data = self.carry + b
        if b:
            k = len(data)
            while k > 0 and 0x30 <= data[k - 1] <= 0x39:
                k -= 1
            if k > 0:
                k -= 1  # keep the character before the digits for the look-behind
            self.carry, data = data[k:], data[:k]
            if not data and self.carry:
                return self.read(n)
        else:
            self.carry = b""
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
            raise LoomError(ErrorCode.BAD_INPUT, f"{path.name}: not a JSON trace")
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
                raise LoomError(
                    ErrorCode.BAD_INPUT, f"{self.path.name}: malformed JSON ({exc})"
                ) from exc
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
