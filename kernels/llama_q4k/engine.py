"""Continuous batching for a served model program: requests join and leave between decode steps.

One thread owns the model. Each pass it admits waiting requests into free rows of the KV cache
(a prefill of that row alone), then runs one decode step for every row at once: each row at its
own position, with its own sampling parameters, seed and stop conditions. A row whose request
ends is free for the next one at the following pass; rows without a request still take part in
the step (a batch of fixed size keeps the decode kernels' shapes) and their outputs are dropped.

    engine = Engine(model, tokenizer, max_batch=8, max_seq=4096)
    engine.start()
    request = engine.submit(prompt_ids, SamplingParams(), max_tokens=128)
    for event in request.events():  # Token(...) pieces, then one Finished(...)
        ...

Families whose model takes one position per row (llama, qwen2, qwen3, phi3) batch; the Gemma
model program takes one position for the whole batch, so it serves one request at a time.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels.llama_q4k.sampling import SamplingParams, make_generator, next_token

log = logging.getLogger("loom.serve")


class Refused(ValueError):
    """A request the engine cannot take: `status` is the HTTP status it maps to (400: never fits,
    429: not now)."""

    def __init__(self, message: str, status: int, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Token:
    id: int
    text: str  # what this token adds to the reply's text (may be "" inside a multi-byte char)


@dataclass
class Finished:
    reason: str  # "stop" (a stop token or string) or "length"
    text: str  # the whole reply
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    total_s: float


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: set[int]
    stop_texts: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    _out: queue.Queue = field(default_factory=queue.Queue)
    _shown: str = ""
    cancelled: bool = False
    # Set by an asyncio caller (`async_events`): events go straight to its loop, so a waiting
    # request holds no thread.
    _loop: asyncio.AbstractEventLoop | None = None
    _aqueue: asyncio.Queue | None = None

    def put(self, item: Token | Finished | BaseException) -> None:
        if self._loop is not None and self._aqueue is not None:
            self._loop.call_soon_threadsafe(self._aqueue.put_nowait, item)
        else:
            self._out.put(item)

    def events(self, timeout_s: float | None = None) -> Iterator[Token | Finished]:
        """What the engine produced for this request, in order, ending with Finished."""
        while True:
            item = self._out.get(timeout=timeout_s)
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Finished):
                return

    async def async_events(self) -> AsyncIterator[Token | Finished]:
        """The same as `events`, for a coroutine on the event loop that submitted the request."""
        assert self._aqueue is not None, "submit(..., loop=...) first"
        while True:
            item = await self._aqueue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Finished):
                return


@dataclass
class Stats:
    requests: int = 0
    finished: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    decode_steps: int = 0
    largest_batch: int = 0  # most rows with a request in one decode step
    ttft_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)


class _RowCache(torch.nn.Module):
    """One row of a layer's KV cache, as views: a prefill into it writes the shared cache."""

    def __init__(self, cache: Any, row: int) -> None:
        super().__init__()
        self.k, self.v = cache.k[row : row + 1], cache.v[row : row + 1]


class Engine:
    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, max_batch: int, max_seq: int, max_waiting: int = 64
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.per_row_positions = type(model).__name__ == "Transformer"
        self.max_batch = max_batch if self.per_row_positions else 1
        self.max_seq, self.max_waiting = max_seq, max_waiting
        self.device = next(iter(model.buffers())).device
        self.rows: list[Request | None] = [None] * self.max_batch
        self.positions = [0] * self.max_batch  # where each row's last token is written next
        self.last = [0] * self.max_batch  # each row's last token
        self.generators: list[torch.Generator | None] = [None] * self.max_batch
        self.waiting: queue.Queue[Request] = queue.Queue()
        self.stats = Stats()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        model.setup_caches(self.max_batch, max_seq)

    # -- the caller's side
    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        max_tokens: int,
        stop_ids: set[int] | None = None,
        stop_texts: list[str] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> Request:
        if not prompt:
            raise Refused("the prompt is empty", 400, "empty_prompt")
        if len(prompt) + 1 > self.max_seq:
            raise Refused(
                f"the prompt has {len(prompt)} tokens; this server's context is {self.max_seq} tokens "
                "(sized from --memory-budget)",
                400,
                "context_length_exceeded",
            )
        if self.waiting.qsize() >= self.max_waiting:
            self.stats.refused += 1
            raise Refused(f"{self.max_waiting} requests are already waiting; try again later", 429, "busy")
        request = Request(
            prompt=list(prompt),
            params=params,
            max_tokens=max(1, min(max_tokens, self.max_seq - len(prompt))),
            stop_ids=self.tokenizer.stop_ids() if stop_ids is None else stop_ids,
            stop_texts=[s for s in (stop_texts or []) if s],
        )
        if loop is not None:
            request._loop, request._aqueue = loop, asyncio.Queue()
        self.stats.requests += 1
        self.waiting.put(request)
        self._wake.set()
        return request

    def active(self) -> int:
        return sum(r is not None for r in self.rows)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="loom-serve-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- the engine's thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._admit()
                if self.active():
                    self._step()
                else:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
            except Exception as exc:  # a failed step ends its requests with the error, not the server
                log.exception("engine step failed")
                for row, request in enumerate(self.rows):
                    if request is not None:
                        request.put(RuntimeError(f"generation failed: {type(exc).__name__}: {exc}"))
                        self.rows[row] = None

    def _admit(self) -> None:
        for row in range(self.max_batch):
            if self.rows[row] is not None:
                continue
            try:
                request = self.waiting.get_nowait()
            except queue.Empty:
                return
            if request.cancelled:
                continue
            try:
                self._prefill(row, request)
            except Exception as exc:  # this request's failure, not the other rows'
                log.exception("prefill failed")
                self.rows[row] = None
                request.put(RuntimeError(f"prefill failed: {type(exc).__name__}: {exc}"))

    @contextmanager
    def _only_row(self, row: int) -> Iterator[None]:
        layers = self.model.layers
        caches = [layer.attention.kv_cache for layer in layers]
        try:
            for layer, cache in zip(layers, caches, strict=True):
                layer.attention.kv_cache = _RowCache(cache, row)
            yield
        finally:
            for layer, cache in zip(layers, caches, strict=True):
                layer.attention.kv_cache = cache

    @torch.inference_mode()
    def _prefill(self, row: int, request: Request) -> None:
        ids = torch.tensor([request.prompt], device=self.device)
        with self._only_row(row):
            logits = self.model(ids, torch.arange(len(request.prompt), device=self.device), last_only=True)
        self.rows[row] = request
        self.generators[row] = make_generator(request.params, self.device)
        # Where the row's last token is written by the next step: each taken token moves it on,
        # so the first sampled token lands right after the prompt.
        self.positions[row] = len(request.prompt) - 1
        self.stats.prompt_tokens += len(request.prompt)
        self._take(row, logits[:, -1])

    @torch.inference_mode()
    def _step(self) -> None:
        started = time.perf_counter()
        tokens = torch.tensor([[t] for t in self.last], device=self.device)
        positions = torch.tensor(self.positions, device=self.device)
        logits = self.model(tokens, positions)[:, -1]
        self.stats.decode_steps += 1
        self.stats.largest_batch = max(self.stats.largest_batch, self.active())
        for row, request in enumerate(self.rows):
            if request is not None:
                self._take(row, logits[row : row + 1])
        self.stats.step_s.append(time.perf_counter() - started)
        del self.stats.step_s[:-1000]

    def _take(self, row: int, logits: torch.Tensor) -> None:
        """Sample row `row`'s next token from its logits [1, vocab], hand it over, and end the
        request when it stops."""
        request = self.rows[row]
        assert request is not None
        seen = None
        if request.params.repetition_penalty != 1.0:
            seen = torch.tensor([request.prompt + request.tokens], device=self.device)
        token = int(next_token(logits, request.params, self.generators[row], seen).item())
        now = time.monotonic()
        if request.first_token_at is None:
            request.first_token_at = now
            self.stats.ttft_s.append(now - request.created)
            del self.stats.ttft_s[:-1000]
        if request.cancelled:
            return self._finish(row, "stop")
        if token in request.stop_ids:
            return self._finish(row, "stop")
        request.tokens.append(token)
        self.stats.completion_tokens += 1
        text = self.tokenizer.decode(request.tokens)
        for stop in request.stop_texts:
            at = text.find(stop)
            if at >= 0:
                piece = text[len(request._shown) : at] if at > len(request._shown) else ""
                if piece:
                    request.put(Token(token, piece))
                request._shown = text[:at]
                return self._finish(row, "stop")
        # Text only once it is whole: a multi-byte character may take several tokens.
        piece = text[len(request._shown) :] if text.startswith(request._shown) and "\ufffd" not in text[-1:] else ""
        if piece:
            request._shown = text
        request.put(Token(token, piece))
        self.last[row] = token
        self.positions[row] += 1
        if len(request.tokens) >= request.max_tokens or self.positions[row] >= self.max_seq:
            self._finish(row, "length")

    def _finish(self, row: int, reason: str) -> None:
        request = self.rows[row]
        assert request is not None
        now = time.monotonic()
        text = request._shown if request.stop_texts else self.tokenizer.decode(request.tokens)
        request.put(
            Finished(
                reason=reason,
                text=text,
                prompt_tokens=len(request.prompt),
                completion_tokens=len(request.tokens),
                ttft_s=(request.first_token_at or now) - request.created,
                total_s=now - request.created,
            )
        )
        self.stats.finished += 1
        self.rows[row] = None
        self.generators[row] = None
        self.last[row] = 0
        self.positions[row] = 0


def kv_bytes_per_token(args: Any, dtype: torch.dtype) -> int:
    """K and V of one position in every layer."""
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()
