"""Prefill and greedy decode for the Llama Q4_K model, with the decode step as a CUDA graph."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.llama_q4k.model import Transformer


class DecodeStep:
    """One decode step (tokens [batch, 1] at one position) with static input buffers.

    On CUDA the step is captured once as a CUDA graph and then replayed: a single launch per
    token instead of about ten kernel launches per layer. Before capture, the step runs a few
    times on a side stream. That compiles the Triton kernels (a compile cannot happen inside a
    capture) and writes scratch K/V at position 0, so build a DecodeStep before prefill.
    Returned logits live in a static buffer that the next replay overwrites.
    """

    def __init__(self, model: Transformer | torch.nn.Module, batch: int, use_graph: bool) -> None:
        device = model.norm.device
        self.model = model
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.input_pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        if not use_graph:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                model(self.tokens, self.input_pos)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model(self.tokens, self.input_pos)

    def __call__(self, tokens: Tensor, position: int) -> Tensor:
        self.tokens.copy_(tokens)
        self.input_pos.fill_(position)
        if self.graph is None:
            return self.model(self.tokens, self.input_pos)
        self.graph.replay()
        return self.logits


class Clock:
    """Timestamps: CUDA events on a GPU (no host sync inside the timed loop), else perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
        if self.cuda:
            return start.elapsed_time(end)  # type: ignore[union-attr]
        return (end - start) * 1e3  # type: ignore[operator]


@dataclass
class Generation:
    tokens: Tensor  # [batch, steps + 1] greedy tokens: the prefill's, then one per decode step
    ttft_ms: float  # prefill through the first token's argmax
    step_ms: list[float]  # one per decode step
    logits: Tensor | None  # fp32 [batch, prompt + steps, vocab] when asked for


@torch.inference_mode()
def generate(
    model: Transformer,
    decode: DecodeStep,
    prompt: Tensor,
    steps: int,
    keep_logits: bool = False,
) -> Generation:
    """Greedy decoding: prefill `prompt` [batch, prompt_len], then `steps` decode steps.

    Decode step i feeds the previous token at position prompt_len + i, so the cache must hold
    prompt_len + steps positions. With `keep_logits`, prefill computes logits at every prompt
    position (otherwise only the last), and the result holds all logits for every input
    position: the prompt, then each fed token.
    """
    batch, prompt_len = prompt.shape
    clock = Clock(prompt.device)
    clock.sync()
    start = clock.now()
    input_pos = torch.arange(prompt_len, device=prompt.device)
    logits = model(prompt, input_pos, last_only=not keep_logits)
    token = logits[:, -1:].argmax(dim=-1)
    marks = [clock.now()]
    kept = [logits.float()] if keep_logits else []
    tokens = [token]
    for i in range(steps):
        logits = decode(token, prompt_len + i)
        token = logits[:, -1:].argmax(dim=-1)
        marks.append(clock.now())
        if keep_logits:
            kept.append(logits.to(torch.float32, copy=True))  # the graph reuses its buffer
        tokens.append(token)
    clock.sync()
    return Generation(
        tokens=torch.cat(tokens, dim=1),
        ttft_ms=clock.ms(start, marks[0]),
        step_ms=[clock.ms(a, b) for a, b in zip(marks, marks[1:])],
        logits=torch.cat(kept, dim=1) if keep_logits else None,
    )
