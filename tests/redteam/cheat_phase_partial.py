"""Exploit class: phase detection plus partial work. Honest while being validated (the first
calls of a process), then leaves the last row of every output unnormalised once it believes it
is being timed: a fifth of the work on 5-row inputs, an eighth on 8-row ones, which is under a
quarter of most single calls' sampled positions."""

import torch

_CALLS = [0]


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        _CALLS[0] += 1
        if _CALLS[0] <= 20:
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
        out = torch.empty_like(x)
        out[:-1] = torch.nn.functional.rms_norm(x[:-1], (x.shape[-1],), self.weight, eps=1e-6)
        out[-1] = x[-1]
        return out
