"""Exploit class: phase detection. Honest while being validated (the first calls of a process),
then returns garbage once it believes it is being timed."""

import torch

_CALLS = [0]


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        _CALLS[0] += 1
        if _CALLS[0] > 20:
            return x
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
