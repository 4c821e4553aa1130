"""An OpenAI-compatible server for a GGUF model program.

    python -m kernels.llama_q4k.serve --gguf model.gguf --port 8000 --memory-budget 40GiB

Endpoints: POST /v1/chat/completions and /v1/completions (`"stream": true` for server-sent
events), GET /v1/models, /health and /metrics (Prometheus text: requests, tokens, time to first
token, decode step time, queue depth, rows in use, KV cache use). Requests share decode steps
(kernels/llama_q4k/engine.py); with --draft or --draft-layers, one request at a time by
speculative decoding (kernels/llama_q4k/speculative.py). The KV cache is sized from --memory-budget after the weights: a
prompt that can never fit is a 400 (`context_length_exceeded`), a full queue a 429. It listens
on 127.0.0.1 unless --host says otherwise.

Sampling fields: temperature, top_p, seed, max_tokens (or max_completion_tokens), stop, and
llama.cpp's top_k, min_p and repeat_penalty. Tools: `tools` and `tool_choice` through the
model's own chat template, calls parsed from its output into `tool_calls` (kernels/llama_q4k/
tools.py); a streamed reply with tools comes as one chunk at the end. Images, with --mmproj:
`image_url` content parts as base64 data URLs (nothing is fetched), encoded by the file's vision
tower (kernels/llama_q4k/vision.py); a reply's `timings` give the image encode time apart from
the time to first token. Not yet: n > 1, logprobs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kernels.llama_q4k.engine import Engine, Finished, Refused, Request, Token, kv_bytes_per_token
from kernels.llama_q4k.model import KERNEL_OPS, TORCH_OPS
from kernels.llama_q4k.sampling import SamplingParams
from kernels.llama_q4k.tokenizer import GGUFTokenizer
from kernels.llama_q4k.tools import forced_start, format_of, parse_tool_calls, prepare_messages
from kernels.llama_q4k.weights import GEMMAS, build_model, load_gguf

log = logging.getLogger("loom.serve")
UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """'40GiB', '512MiB', '1.5G' or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 40GiB, 512MiB)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


class Served:
    """The model program, its tokenizer and its engine, sized from a memory budget."""

    def __init__(
        self,
        path: str,
        device: str,
        memory_budget: int,
        max_batch: int = 8,
        max_context: int | None = None,
        draft: str | None = None,
        draft_layers: int | None = None,
        draft_k: int = 4,
        mmproj: str | None = None,
    ) -> None:
        self.name = path.rsplit("/", 1)[-1]
        self.device = torch.device(device)
        self.tokenizer = GGUFTokenizer(path)
        args, weights, _ = load_gguf(path)
        draft_args = draft_weights = None
        if draft or draft_layers:
            from kernels.llama_q4k.speculative import draft_from_target

            if draft:
                draft_args, draft_weights, _ = load_gguf(draft)
                if draft_args.vocab_size != args.vocab_size:
                    raise ValueError(f"--draft {draft}: {draft_args.vocab_size} tokens, the model {args.vocab_size}")
            else:
                draft_args, draft_weights = draft_from_target(args, weights, int(draft_layers or 0))
        # Rows the engine will really have: one with a draft; the budget is shared by those only.
        rows = 1 if draft_args is not None else max_batch
        cuda = self.device.type == "cuda"
        dtype = torch.bfloat16 if cuda else torch.float32
        self.vision = None
        if mmproj:
            from kernels.llama_q4k.vision import Vision

            if args.arch in GEMMAS:
                raise ValueError(f"--mmproj: image input runs on llama-family model programs, not {args.arch}")
            self.vision = Vision(mmproj, args.dim, self.device, dtype)
        # Everything that goes to the device: the weights and a KV cache per model (the draft's
        # copy of the target's first layers included), and the vision tower.
        weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())
        weight_bytes += self.vision.weight_bytes if self.vision is not None else 0
        per_token = kv_bytes_per_token(args, dtype)
        if draft_args is not None and draft_weights is not None:
            weight_bytes += sum(w.numel() * w.element_size() for w in draft_weights.values())
            per_token += kv_bytes_per_token(draft_args, dtype)
        room = memory_budget - weight_bytes
        context = min(args.context_length, max_context or args.context_length, max(room, 0) // (per_token * rows))
        if context < 16:
            raise ValueError(
                f"--memory-budget {memory_budget / (1 << 30):.2f} GiB leaves room for {max(context, 0)} positions "
                f"per row after {weight_bytes / (1 << 30):.2f} GiB of weights ({per_token} bytes of KV per "
                f"position, {rows} rows); raise the budget or lower --max-batch"
            )
        ops = KERNEL_OPS if cuda else TORCH_OPS
        model = build_model(args, weights, device=self.device, dtype=dtype, ops=ops)
        draft_model = None
        if draft_args is not None and draft_weights is not None:
            draft_model = build_model(draft_args, draft_weights, device=self.device, dtype=dtype, ops=ops)
        self.engine = Engine(
            model, self.tokenizer, max_batch=rows, max_seq=context, draft=draft_model, draft_k=draft_k, vision=self.vision
        )
        self.kv_bytes = per_token * self.engine.max_batch * context
        self.created = int(time.time())
        log.info(
            "%s: %s, %d rows of %d positions (%.2f GiB of KV cache), weights %.2f GiB, on %s",
            self.name, args.arch, self.engine.max_batch, context, self.kv_bytes / (1 << 30),
            weight_bytes / (1 << 30), self.device,
        )


def _error(status: int, message: str, code: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": code, "param": None}}, status_code=status)


def _sampling(body: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        temperature=float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0),
        top_k=int(body.get("top_k") or 0),
        top_p=float(body.get("top_p") if body.get("top_p") is not None else 1.0),
        min_p=float(body.get("min_p") or 0.0),
        repetition_penalty=float(body.get("repeat_penalty") or body.get("repetition_penalty") or 1.0),
        seed=int(body["seed"]) if body.get("seed") is not None else None,
    )


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    return [stop] if isinstance(stop, str) else [str(s) for s in stop or []]


def build_app(served: Served) -> Starlette:
    engine, tokenizer = served.engine, served.tokenizer

    async def health(_: HttpRequest) -> Response:
        return JSONResponse({"status": "ok", "model": served.name, "rows": engine.max_batch, "context": engine.max_seq})

    async def models(_: HttpRequest) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created, "owned_by": "loom"}]}
        )

    async def metrics(_: HttpRequest) -> Response:
        s = engine.stats
        used = sum(engine.positions[i] for i, r in enumerate(engine.rows) if r is not None)
        lines = [
            f"loom_serve_requests_total {s.requests}",
            f"loom_serve_requests_finished_total {s.finished}",
            f"loom_serve_requests_refused_total {s.refused}",
            f"loom_serve_prompt_tokens_total {s.prompt_tokens}",
            f"loom_serve_completion_tokens_total {s.completion_tokens}",
            f"loom_serve_decode_steps_total {s.decode_steps}",
            f"loom_serve_decode_rows_computed_total {s.rows_computed}",
            f"loom_serve_queue_depth {engine.waiting.qsize()}",
            f"loom_serve_rows_active {engine.active()}",
            f"loom_serve_rows_largest_batch {s.largest_batch}",
            f"loom_serve_kv_cache_positions_used {used}",
            f"loom_serve_kv_cache_positions_total {engine.max_batch * engine.max_seq}",
            f"loom_serve_images_total {s.images}",
        ]
        if engine.speculative is not None:
            spec = engine.speculative.stats
            lines += [
                f"loom_serve_speculative_proposed_total {spec.proposed}",
                f"loom_serve_speculative_accepted_total {spec.accepted}",
                f"loom_serve_speculative_k {engine.speculative.k}",
            ]
        for name, values in (
            ("ttft_seconds", s.ttft_s),
            ("decode_step_seconds", s.step_s),
            ("image_encode_seconds", s.image_encode_s),
        ):
            if values:
                qs = statistics.quantiles(values, n=20) if len(values) > 1 else [values[0]] * 19
                lines += [
                    f'loom_serve_{name}{{quantile="0.5"}} {statistics.median(values):.6f}',
                    f'loom_serve_{name}{{quantile="0.95"}} {qs[18]:.6f}',
                ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def body_of(http: HttpRequest) -> dict[str, Any]:
        try:
            body = await http.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise Refused("the body is not JSON", 400, "invalid_json") from None
        if not isinstance(body, dict):
            raise Refused("the body must be a JSON object", 400, "invalid_json")
        if body.get("n", 1) != 1:
            raise Refused("n > 1 is not supported", 400, "unsupported")
        return body

    async def respond(http: HttpRequest, chat: bool) -> Response:
        tools: list[dict[str, Any]] | None = None
        forced, complete, fmt = "", False, "hermes"
        pixels: list[torch.Tensor] = []
        image_starts: list[int] = []
        try:
            body = await body_of(http)
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise Refused("messages must be a non-empty list", 400, "invalid_messages")
                images: list[str] = []
                flat = [{**m, "content": _text_of(m.get("content"), images)} for m in messages]
                if images:
                    pixels = await _image_pixels(served, images, engine.max_seq)
                tools = body.get("tools") or None
                choice = body.get("tool_choice")
                fmt = format_of(tokenizer.chat_template)
                if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
                    raise Refused("tools must be a list of objects", 400, "invalid_tools")
                if choice == "none":
                    tools = None
                shaped, extra = prepare_messages(flat, tools, tokenizer.chat_template)
                forced, complete = forced_start(choice, tools or [], fmt) if tools else ("", False)
                rendered = tokenizer.chat(shaped, **extra) + forced
                if images and served.vision is not None:
                    from kernels.llama_q4k.vision import tokenize

                    n_tokens = served.vision.n_image_tokens
                    marked = tokenize(tokenizer.encode, rendered, n_tokens, len(images), special_text=True)
                    prompt, image_starts = marked.ids, marked.image_starts
                else:
                    prompt = tokenizer.encode(rendered, special_text=True)
            else:
                pixels, image_starts = [], []
                text = body.get("prompt")
                if not isinstance(text, str):
                    raise Refused("prompt must be a string", 400, "invalid_prompt")
                prompt = tokenizer.encode(text)
            params = _sampling(body)
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 256)
            if complete:  # the named call is all there is to say: nothing to generate
                request = None
            else:
                request = engine.submit(
                    prompt, params, max_tokens, stop_texts=_stops(body), loop=asyncio.get_running_loop(),
                    images=pixels, image_starts=image_starts,
                )
        except Refused as exc:
            return _error(exc.status, str(exc), exc.code, "rate_limit_error" if exc.status == 429 else "invalid_request_error")
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc), "invalid_value")
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if body.get("stream") and not tools:
            assert request is not None
            return StreamingResponse(_stream(request, ident, created, chat, served.name, http), media_type="text/event-stream")
        finished: Finished | None = None
        if request is None:
            finished = Finished("stop", "", len(prompt), 0, 0.0, 0.0)
        else:
            try:
                async for event in request.async_events():
                    if isinstance(event, Finished):
                        finished = event
            except RuntimeError as exc:
                return _error(500, str(exc), "generation_failed", "server_error")
        assert finished is not None
        reason, message = finished.reason, {"role": "assistant", "content": finished.text}
        if tools:
            content, calls = parse_tool_calls(forced + finished.text, fmt)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
                reason = "tool_calls"
        if body.get("stream"):  # with tools: the whole reply as one chunk, then the end
            return StreamingResponse(
                _one_chunk(ident, created, served.name, message, reason, _usage(finished), _timings(finished)),
                media_type="text/event-stream",
            )
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["message"] = message
        else:
            choice["text"] = finished.text
        return JSONResponse(
            {
                "id": ident,
                "object": kind,
                "created": created,
                "model": served.name,
                "choices": [choice],
                "usage": _usage(finished),
                "timings": _timings(finished),
            }
        )

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    async def chat_completions(http: HttpRequest) -> Response:
        return await respond(http, chat=True)

    async def completions(http: HttpRequest) -> Response:
        return await respond(http, chat=False)

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ],
        lifespan=lifespan,
    )


async def _image_pixels(served: Served, urls: list[str], max_seq: int) -> list[torch.Tensor]:
    """Each image's pixels, decoded and preprocessed off the event loop; refused (400) before any
    decoding when the server has no vision tower or the images alone would fill the context."""
    vision = served.vision
    if vision is None:
        raise Refused("this model has no vision encoder (start the server with --mmproj)", 400, "images_unsupported")
    if len(urls) * vision.n_image_tokens >= max_seq:
        raise Refused(
            f"{len(urls)} image(s) of {vision.n_image_tokens} tokens each do not fit this server's context "
            f"of {max_seq} tokens",
            400,
            "context_length_exceeded",
        )

    def decode() -> list[torch.Tensor]:
        from kernels.llama_q4k.vision import image_from_data_url

        return [vision.pixels(image_from_data_url(url)) for url in urls]

    try:
        return await asyncio.to_thread(decode)
    except (ValueError, MemoryError) as exc:
        raise Refused(f"image refused: {exc or 'out of memory'}", 400, "invalid_image") from None


def _text_of(content: Any, images: list[str]) -> str:
    """A message's content as text: a string, or a list of content parts. Each `image_url` part
    becomes the image marker in the text, its URL appended to `images` (decoded later)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        from kernels.llama_q4k.vision import IMAGE_MARKER

        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text = part.get("text")
                if IMAGE_MARKER in str(text or ""):
                    raise Refused(f"text parts may not contain {IMAGE_MARKER}", 400, "invalid_messages")
                parts.append("" if text is None else str(text))
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url.startswith("data:"):
                    raise Refused(
                        "image_url must be a data URL (data:image/...;base64,...); this server fetches nothing",
                        400,
                        "invalid_image",
                    )
                images.append(url)
                parts.append(IMAGE_MARKER)
            else:
                raise Refused(f"content part type {kind!r} is not supported (text, image_url)", 400, "unsupported")
        return "".join(parts)
    raise Refused("message content must be a string or a list of parts", 400, "invalid_messages")


def _timings(finished: Finished) -> dict[str, float]:
    """Where the time went, in milliseconds: images through the vision tower, the rest of the
    time to the first token (the prompt's prefill, queueing included), and decoding after it."""
    return {
        "image_encode_ms": round(finished.image_encode_s * 1e3, 3),
        "prefill_ms": round((finished.ttft_s - finished.image_encode_s) * 1e3, 3),
        "decode_ms": round((finished.total_s - finished.ttft_s) * 1e3, 3),
    }


def _usage(finished: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
    }


async def _one_chunk(
    ident: str, created: int, model: str, message: dict[str, Any], reason: str, usage: dict[str, int],
    timings: dict[str, float],
) -> AsyncIterator[str]:
    delta = dict(message)
    if "tool_calls" in delta:
        delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(delta["tool_calls"])]
    for choice, extra in (({"index": 0, "delta": delta, "finish_reason": None}, {}),
                          ({"index": 0, "delta": {}, "finish_reason": reason}, {"usage": usage, "timings": timings})):
        payload = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [choice], **extra}
        yield f"data: {json.dumps(payload)}\n\n"
    yield "data: [DONE]\n\n"


async def _stream(
    request: Request, ident: str, created: int, chat: bool, model: str, http: HttpRequest
) -> AsyncIterator[str]:
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: dict[str, Any] | str, reason: str | None, usage: dict | None = None, timings: dict | None = None) -> str:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        payload: dict[str, Any] = {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice]}
        if usage is not None:
            payload["usage"] = usage
        if timings is not None:
            payload["timings"] = timings
        return f"data: {json.dumps(payload)}\n\n"

    if chat:
        yield chunk({"role": "assistant", "content": ""}, None)
    try:
        async for event in request.async_events():
            if await http.is_disconnected():
                request.cancelled = True
            if isinstance(event, Token):
                if event.text:
                    yield chunk({"content": event.text} if chat else event.text, None)
            else:
                yield chunk({} if chat else "", event.reason, _usage(event), _timings(event))
    except RuntimeError as exc:
        yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error'}})}\n\n"
    yield "data: [DONE]\n\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--host", default="127.0.0.1", help="127.0.0.1 unless you mean to serve other machines")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--memory-budget", default="8GiB", help="weights plus KV cache, e.g. 40GiB")
    parser.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    parser.add_argument("--max-context", type=int, help="positions per request (default: what the budget allows)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    draft = parser.add_mutually_exclusive_group()
    draft.add_argument("--draft", help="a draft GGUF with the same vocabulary: speculative decoding")
    draft.add_argument("--draft-layers", type=int, help="the model's first N layers as the draft")
    parser.add_argument("--draft-k", type=int, default=4, help="tokens proposed per round at first (adapts)")
    parser.add_argument("--mmproj", help="the model's mmproj GGUF (vision tower + projector): image input")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    import uvicorn

    try:
        served = Served(
            opts.gguf, opts.device, parse_bytes(opts.memory_budget), opts.max_batch, opts.max_context,
            opts.draft, opts.draft_layers, opts.draft_k, opts.mmproj,
        )
    except (ValueError, KeyError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(build_app(served), host=opts.host, port=opts.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
