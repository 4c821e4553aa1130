"""Speculative decoding: a draft model program proposes k tokens, the target checks them in one
pass over k + 1 positions.

Greedy: the target's argmax at each checked position must be the draft's token; the first that
is not is replaced by the target's own, so the output is exactly plain greedy decoding of the
target. Sampled: the standard rejection rule (accept draft token x with probability
min(1, p(x) / q(x)), else draw from the normalized max(0, p - q); after k acceptances one more
token from p), so the output follows the target's distribution; `accept_or_resample` is that
rule alone. k adapts: one more after a round that accepted everything, one fewer after a round
that accepted less than half.

The draft must share the target's vocabulary: a smaller GGUF of the same family, or the
target's own first layers (`draft_from_target`: a draft built to agree, which is how acceptance
is measured on random weights).

    python -m kernels.llama_q4k.speculative --gguf target.gguf --draft-layers 4 --prompt "Once upon a time"
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kernels.llama_q4k.model import ModelArgs
from kernels.llama_q4k.sampling import SamplingParams, filter_logits, make_generator


@dataclass
class SpecStats:
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    ks: list[int] = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution a sampled step draws from: the sampling chain's filters, then temperature."""
    return (filter_logits(logits.float(), params) / params.temperature).softmax(dim=-1)


def accept_or_resample(
    p: Tensor, q: Tensor, token: int, generator: torch.Generator | None
) -> tuple[bool, int]:
    """The rejection rule for one draft token drawn from q: (accepted, the token to emit). The
    emitted token is distributed as p, whatever q is."""
    u = torch.rand((), generator=generator, device=p.device)
    if float(u) * float(q[token]) < float(p[token]):
        return True, token
    residual = (p - q).clamp_min(0)
    total = residual.sum()
    if float(total) <= 0:  # p == q: never reached after a rejection, but stay defined
        residual, total = p, p.sum()
    return False, int(torch.multinomial(residual / total, 1, generator=generator))


def draft_from_target(args: ModelArgs, weights: dict[str, Tensor], layers: int) -> tuple[ModelArgs, dict[str, Tensor]]:
    """A draft of the target's first `layers` layers with its embedding, final norm and output:
    the same vocabulary, and tokens that mostly agree with the target's."""
    if not 0 < layers <= args.n_layers:
        raise ValueError(f"draft layers must be 1..{args.n_layers}")
    kept = {
        name: w
        for name, w in weights.items()
        if not name.startswith("blk.") or int(name.split(".")[1]) < layers
    }
    return dataclasses.replace(args, n_layers=layers), kept


class Speculative:
    """Batch-1 speculative generation with a target and a draft model (both set up here)."""

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        max_seq: int,
        k: int = 4,
        k_min: int = 1,
        k_max: int = 8,
        adaptive: bool = True,
    ) -> None:
        self.target, self.draft, self.max_seq = target, draft, max_seq
        self.k, self.k_min, self.k_max, self.adaptive = k, k_min, k_max, adaptive
        self.device = next(iter(target.buffers())).device
        target.setup_caches(1, max_seq)
        draft.setup_caches(1, max_seq)
        self.stats = SpecStats()

    def _forward(self, model: torch.nn.Module, tokens: list[int], start: int, last_only: bool) -> Tensor:
        ids = torch.tensor([tokens], device=self.device)
        return model(ids, torch.arange(start, start + len(tokens), device=self.device), last_only=last_only)[0]

    @torch.inference_mode()
    def generate(
        self, prompt: list[int], params: SamplingParams, max_new_tokens: int, stop: set[int] | None = None
    ) -> Iterator[int]:
        """New tokens until a stop token (not yielded), max_new_tokens or the end of the cache."""
        if params.repetition_penalty != 1.0:
            raise ValueError("speculative decoding does not apply a repetition penalty")
        if not prompt or len(prompt) >= self.max_seq:
            raise ValueError(f"the prompt must have 1..{self.max_seq - 1} tokens")
        stop = stop or set()
        generator = make_generator(params, self.device)
        budget = min(max_new_tokens, self.max_seq - len(prompt))

        def choose(logits: Tensor) -> int:
            if params.greedy:
                return int(logits.argmax())
            return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))

        first = choose(self._forward(self.target, prompt, 0, last_only=True)[-1])
        self._forward(self.draft, prompt, 0, last_only=True)
        produced = 0
        if first in stop:
            return
        yield first
        produced += 1
        position = len(prompt)  # where `pending` (the last emitted token) is written next
        pending, draft_pending = first, [first]
        while produced < budget:
            k = max(1, min(self.k, budget - produced - 1, self.max_seq - 1 - position))
            if budget - produced == 1 or position + 1 >= self.max_seq:
                k = 0
            proposals: list[int] = []
            draft_probs: list[Tensor] = []
            start = position - len(draft_pending) + 1
            logits = self._forward(self.draft, draft_pending, start, last_only=True)[-1]
            for i in range(k):
                if params.greedy:
                    token = int(logits.argmax())
                else:
                    q = probabilities(logits, params)
                    token = int(torch.multinomial(q, 1, generator=generator))
                    draft_probs.append(q)
                proposals.append(token)
                if i + 1 < k:
                    logits = self._forward(self.draft, [token], position + 1 + i, last_only=True)[-1]
            checked = self._forward(self.target, [pending, *proposals], position, last_only=False)
            accepted, replacement = 0, None
            for i, token in enumerate(proposals):
                if params.greedy:
                    target_token = int(checked[i].argmax())
                    if target_token == token:
                        accepted += 1
                        continue
                    replacement = target_token
                else:
                    ok, emitted = accept_or_resample(
                        probabilities(checked[i], params), draft_probs[i], token, generator
                    )
                    if ok:
                        accepted += 1
                        continue
                    replacement = emitted
                break
            if replacement is None:  # every proposal accepted: one more token from the target
                replacement = choose(checked[len(proposals)])
            self.stats.rounds += 1
            self.stats.proposed += len(proposals)
            self.stats.accepted += accepted
            self.stats.ks.append(k)
            for token in [*proposals[:accepted], replacement]:
                if token in stop:
                    return
                yield token
                produced += 1
                if produced >= budget:
                    return
            # The draft wrote its inputs up to proposal k-1; after a full acceptance it has not
            # seen the last proposal yet.
            draft_pending = [proposals[-1], replacement] if proposals and accepted == len(proposals) else [replacement]
            position += accepted + 1
            pending = replacement
            if self.adaptive and proposals:
                if accepted == len(proposals):
                    self.k = min(self.k + 1, self.k_max)
                elif accepted * 2 < len(proposals):
                    self.k = max(self.k - 1, self.k_min)


def main(argv: list[str] | None = None) -> int:
    from kernels.llama_q4k.model import KERNEL_OPS, TORCH_OPS
    from kernels.llama_q4k.tokenizer import GGUFTokenizer
    from kernels.llama_q4k.weights import build_model, load_gguf

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True, help="the target model")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--draft", help="a draft GGUF with the same vocabulary")
    group.add_argument("--draft-layers", type=int, help="the target's first N layers as the draft")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    opts = parser.parse_args(argv)
    device = torch.device(opts.device)
    cuda = device.type == "cuda"
    kwargs = {"device": device, "dtype": torch.bfloat16 if cuda else torch.float32, "ops": KERNEL_OPS if cuda else TORCH_OPS}
    tokenizer = GGUFTokenizer(opts.gguf)
    args, weights, _ = load_gguf(opts.gguf)
    if opts.draft:
        draft_args, draft_weights, _ = load_gguf(opts.draft)
    else:
        draft_args, draft_weights = draft_from_target(args, weights, opts.draft_layers)
    target, draft = build_model(args, weights, **kwargs), build_model(draft_args, draft_weights, **kwargs)
    prompt = tokenizer.encode(opts.prompt)
    params = SamplingParams(temperature=opts.temperature, seed=opts.seed)
    max_seq = min(args.context_length, len(prompt) + opts.max_tokens + opts.k + 2)
    spec = Speculative(target, draft, max_seq, k=opts.k)
    began = time.perf_counter()
    tokens = list(spec.generate(prompt, params, opts.max_tokens, tokenizer.stop_ids()))
    spent = time.perf_counter() - began
    print(tokenizer.decode(tokens))
    print(
        f"[{len(tokens)} tokens in {spent:.2f} s; acceptance {spec.stats.acceptance:.1%} of "
        f"{spec.stats.proposed} proposed over {spec.stats.rounds} rounds; last k {spec.k}]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
