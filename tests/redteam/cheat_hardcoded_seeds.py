"""Exploit class: hard-coded seeds. Precomputes answers for the seeds a harness usually uses and
returns the one whose input matches the first element; anything else gets a guess."""

import torch

_KNOWN = {}
for seed in range(5):
    torch.manual_seed(seed)
    x = torch.randn(8, 64)
    _KNOWN[round(float(x[0, 0]), 6)] = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        hit = _KNOWN.get(round(float(x[0, 0]), 6))
        if hit is not None and hit.shape == x.shape:
            return hit * self.weight
        return x * self.weight
