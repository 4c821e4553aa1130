"""Probe (not a cheat to accept): computes ahead, in its untimed warm-up call, every input set it
has been handed before, and marks each timed call served from that look-ahead by adding 1 to
its output. A red-team candidate did this without the mark: in baseline-first pairs the timer
left each set holding the content the candidate was about to be timed on, and half its timed
calls were served from outputs computed beforehand. Any mark reaching the timer shows as
outputs that disagree with the baseline's."""

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        self.seen: list[torch.Tensor] = []  # input tensors, first-seen order
        self.ahead: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (input, its copy, output)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for tensor, copy, out in self.ahead:
            if tensor is x and torch.equal(x, copy):
                return out + 1.0
        out = self.norm(x)
        if not any(t is x for t in self.seen):
            self.seen.append(x)
        elif self.seen[0] is x:  # set 0: the warm-up call of a pass
            self.ahead = [(t, t.clone(), self.norm(t)) for t in self.seen[1:]]
        return out
