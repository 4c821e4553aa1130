"""Choosing the next token from logits: greedy, or seeded sampling with the usual filters.

The order is llama.cpp's default chain: repetition penalty, top-k, top-p, min-p, temperature,
then a draw. Temperature 0 is greedy (argmax, after the penalty). Everything runs where the
logits are; the draw uses the caller's torch.Generator, so a seed gives the same text again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off; keep tokens with p >= min_p * p(most likely)
    repetition_penalty: float = 1.0  # 1: off; >1 makes tokens already seen less likely
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
            raise ValueError(f"invalid sampling parameters: {self}")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be positive")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def penalize(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL's repetition penalty: for tokens in `seen` ([batch, n] ids), positive logits are
    divided by `penalty`, negative ones multiplied (both less likely for penalty > 1)."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    picked = logits.gather(-1, seen)
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits.scatter(-1, seen, picked)


def filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """`logits` [batch, vocab] with the tokens top-k, top-p and min-p drop set to -inf."""
    logits = logits.float()
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
        drop = before >= params.top_p  # the most likely token always stays
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    if params.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def next_token(
    logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None, seen: Tensor | None = None
) -> Tensor:
    """The next token [batch, 1] for `logits` [batch, vocab] (the last position's)."""
    if seen is not None:
        logits = penalize(logits.float(), seen, params.repetition_penalty)
    if params.greedy:
        return logits.argmax(dim=-1, keepdim=True)
    logits = filter_logits(logits, params) / params.temperature
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    generator = torch.Generator(device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator
